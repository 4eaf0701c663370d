// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// DeepSeek-V3 ("deepseek_v3", DeepseekV3ForCausalLM): sigmoid scores, a selection-only bias
/// (e_score_correction_bias), group-limited top-k ("noaux_tc"), scaled weights, ungated shared
/// experts; the first first_k_dense_replace layers dense. Its decoder: multi-head latent attention
/// (MLA).
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
inline void read_deepseek_v3(io::detail::HfConfigReader& r, HfMoeConfig& c) {
  read_groups(r, c, 8, 4, 2.5);
  c.scoring_func = r.string("scoring_func", "sigmoid");
  c.topk_method = r.string("topk_method", "noaux_tc");
}
inline void write_deepseek_v3(io::detail::HfJsonWriter& w, HfMoeConfig const& c) {
  write_groups(w, c);
  w.string("scoring_func", c.scoring_func);
  w.string("topk_method", c.topk_method);
}
inline void validate_deepseek_v3(HfMoeConfig const& c, std::string const& where) {
  moe::detail::check(c.scoring_func == "sigmoid", "hf: ", where, ": scoring_func ",
                     io::detail::printable_name(c.scoring_func),
                     " is not supported: DeepSeek-V3's gate (and moe's DeepseekV3Moe) scores "
                     "with \"sigmoid\"; fix config.json");
  moe::detail::check(c.topk_method == "noaux_tc", "hf: ", where, ": topk_method ",
                     io::detail::printable_name(c.topk_method),
                     " is not supported: DeepSeek-V3's gate implements only \"noaux_tc\" "
                     "(group-limited top-k with e_score_correction_bias); fix config.json");
}
}  // namespace detail

inline constexpr std::string_view kDeepseekV3ExpertsKeys[] = {"n_routed_experts", "num_experts",
                                                              "num_local_experts"};

inline constexpr HfFamilySpec kDeepseekV3 = {
    .family = HfFamily::kDeepseekV3,
    .model_type = "deepseek_v3",
    .architecture = "DeepseekV3ForCausalLM",
    .layer_type = HfLayerType::kDeepseekV3,
    .hidden_size = 7168,
    .width = 2048,
    .experts_keys = kDeepseekV3ExpertsKeys,
    .experts = 256,
    .top_k_keys = kTopKKeys,
    .top_k = 8,
    .norm_topk_default = true,
    .shared = HfShared::kCount,
    .shared_key = "n_shared_experts",
    .shared_default = 1,
    .layer_rule = HfLayerRule::kFirstKFreq,
    .first_k_dense_default = 3,
    .grouped = true,
    .names = {.selection_bias = "gate.e_score_correction_bias"},
    .keys = kDeepseekKeys,
    .decoder = {.vocab_size = 129280,
                .heads = 128,
                .rope_theta = 10000.0,
                .rms_norm_eps = 1e-6,
                .dense_width = 18432,
                .bias = HfAttentionBias::kQkv,
                .yarn = true,
                .mla = true,
                .mla_softmax_mscale = true,
                .q_lora_rank = 1536,
                .kv_lora_rank = 512,
                .qk_nope_head_dim = 128,
                .qk_rope_head_dim = 64,
                .v_head_dim = 128},
    .gguf = {.arch = "deepseek2", .norm_topk = true, .gating_func = 2},
    .read = detail::read_deepseek_v3,
    .write = detail::write_deepseek_v3,
    .validate = detail::validate_deepseek_v3,
};

}  // namespace moe::io::families
