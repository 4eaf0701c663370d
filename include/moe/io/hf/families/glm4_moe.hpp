// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GLM-4.5 ("glm4_moe", Glm4MoeForCausalLM): DeepSeek-V3's router and ungated shared experts;
/// the first first_k_dense_replace layers dense; partial RoPE, optional per-head q/k norm.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
inline void read_glm4_moe(io::detail::HfConfigReader& r, HfMoeConfig& c) {
  read_groups(r, c, 1, 1, 1.0);
}
}  // namespace detail

inline constexpr std::string_view kGlm4MoeExpertsKeys[] = {"n_routed_experts", "num_local_experts"};
inline constexpr std::string_view kGlm4MoeKeys[] = {"first_k_dense_replace",
                                                    "moe_intermediate_size",
                                                    "n_group",
                                                    "n_routed_experts",
                                                    "n_shared_experts",
                                                    "norm_topk_prob",
                                                    "num_local_experts",
                                                    "num_mtp_layers",
                                                    "num_nextn_predict_layers",
                                                    "partial_rotary_factor",
                                                    "routed_scaling_factor",
                                                    "topk_group",
                                                    "use_qk_norm"};

inline constexpr HfFamilySpec kGlm4Moe = {
    .family = HfFamily::kGlm4Moe,
    .model_type = "glm4_moe",
    .architecture = "Glm4MoeForCausalLM",
    .layer_type = HfLayerType::kDeepseekV3,
    .hidden_size = 4096,
    .width = 1408,
    .experts_keys = kGlm4MoeExpertsKeys,
    .experts = 128,
    .top_k_keys = kTopKKeys,
    .top_k = 8,
    .norm_topk_default = true,
    .shared = HfShared::kCount,
    .shared_key = "n_shared_experts",
    .shared_default = 1,
    .layer_rule = HfLayerRule::kFirstK,
    .first_k_dense_default = 1,
    .grouped = true,
    .names = {.selection_bias = "gate.e_score_correction_bias"},
    .keys = kGlm4MoeKeys,
    .decoder = {.vocab_size = 151552,
                .heads = 96,
                .kv_heads = 8,
                .rms_norm_eps = 1e-5,
                .dense_width = 10944,
                .qk_norm = HfQkNorm::kPerHead,
                .qk_norm_key = "use_qk_norm",
                .bias = HfAttentionBias::kQkv,
                .rotary = HfRotary::kFactor,
                .rotary_factor = 0.5},
    .gguf = {.arch = "glm4moe",
             .mlp_norm = "post_attention_norm",
             .extra_layers_key = "nextn_predict_layers"},
    .read = detail::read_glm4_moe,
    .write = write_groups,
};

}  // namespace moe::io::families
