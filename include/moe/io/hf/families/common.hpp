// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// What several family descriptions share: key lists of configuration classes that families
/// inherit from each other, and the readers and writers of DeepSeek-V3's group keys.
#pragma once

#include <string_view>

#include "moe/io/hf/config_reader.hpp"
#include "moe/io/hf/family.hpp"

namespace moe::io::families {

/// num_experts_per_tok, the top-k key of most families.
inline constexpr std::string_view kTopKKeys[] = {"num_experts_per_tok"};

/// MixtralConfig's keys (MiniMax-M2 has them too).
inline constexpr std::string_view kMixtralKeys[] = {"num_experts",          "num_local_experts",
                                                    "output_router_logits", "router_aux_loss_coef",
                                                    "router_jitter_noise",  "sliding_window"};

/// Qwen2MoeConfig's and Qwen3MoeConfig's keys (Qwen3-Next has them too).
inline constexpr std::string_view kQwenKeys[] = {
    "decoder_sparse_step",   "layer_types",
    "max_window_layers",     "mlp_only_layers",
    "moe_intermediate_size", "norm_topk_prob",
    "num_experts",           "num_local_experts",
    "output_router_logits",  "qkv_bias",
    "router_aux_loss_coef",  "shared_expert_intermediate_size",
    "sliding_window",        "use_sliding_window"};

/// DeepseekV3Config's keys and its Hub remote code's (DeepSeek-V2 has them too).
inline constexpr std::string_view kDeepseekKeys[] = {"aux_loss_alpha",
                                                     "ep_size",
                                                     "first_k_dense_replace",
                                                     "kv_lora_rank",
                                                     "moe_intermediate_size",
                                                     "moe_layer_freq",
                                                     "n_group",
                                                     "n_routed_experts",
                                                     "n_shared_experts",
                                                     "norm_topk_prob",
                                                     "num_local_experts",
                                                     "num_nextn_predict_layers",
                                                     "pretraining_tp",
                                                     "q_lora_rank",
                                                     "qk_head_dim",
                                                     "qk_nope_head_dim",
                                                     "qk_rope_head_dim",
                                                     "rope_interleave",
                                                     "routed_scaling_factor",
                                                     "scoring_func",
                                                     "seq_aux",
                                                     "topk_group",
                                                     "topk_method",
                                                     "v_head_dim"};

/// Reads n_group, topk_group and routed_scaling_factor with these defaults.
inline void read_groups(io::detail::HfConfigReader& r, HfMoeConfig& c, Index n_group,
                        Index topk_group, double scaling) {
  c.n_group = r.integer({"n_group"}, n_group, 1);
  c.topk_group = r.integer({"topk_group"}, topk_group, 1);
  c.routed_scaling_factor = static_cast<float>(r.number("routed_scaling_factor", scaling));
}

/// Writes what read_groups() reads.
inline void write_groups(io::detail::HfJsonWriter& w, HfMoeConfig const& c) {
  w.integer("n_group", c.n_group);
  w.integer("topk_group", c.topk_group);
  w.number("routed_scaling_factor", c.routed_scaling_factor);
}

}  // namespace moe::io::families
