// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ERNIE 4.5 ("ernie4_5_moe", Ernie4_5_MoeForCausalLM): softmax scores with a selection-only
/// bias on the probabilities, renormalised by a clamped sum (moe_norm_min), ungated shared
/// experts, optional biases (use_bias); MoE layers in [moe_layer_start_index,
/// moe_layer_end_index] every moe_layer_interval; interleaved RoPE; tied embeddings.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
inline void read_ernie4_5_moe(io::detail::HfConfigReader& r, HfMoeConfig& c) {
  c.moe_norm_min = static_cast<float>(r.number("moe_norm_min", 1e-12));
  c.scoring_func = "softmax";
  c.use_bias = r.boolean("use_bias", false);
}
inline void write_ernie4_5_moe(io::detail::HfJsonWriter& w, HfMoeConfig const& c) {
  w.number("moe_norm_min", c.moe_norm_min);
  w.boolean("use_bias", c.use_bias);
}
inline void validate_ernie4_5_moe(HfMoeConfig const& c, std::string const& where) {
  moe::detail::check(c.moe_norm_min >= 0.0f && c.moe_norm_min <= 1.0f, "hf: ", where,
                     ": moe_norm_min = ", c.moe_norm_min, " must be in [0, 1]; fix config.json");
}
inline void check_ernie4_5_moe_decoder(io::detail::HfConfigReader&, HfMoeConfig const& c, bool,
                                       std::string const& source) {
  moe::detail::check(!c.use_bias, "models: ", source,
                     ": use_bias = true is not supported by the ernie4_5_moe decoder (it would "
                     "add biases to the attention, the dense MLPs and the LM head; released "
                     "models set it false); fix config.json");
}
}  // namespace detail

inline constexpr std::string_view kErnie45MoeExpertsKeys[] = {"moe_num_experts", "num_experts"};
inline constexpr std::string_view kErnie45MoeTopKKeys[] = {"moe_k", "num_experts_per_tok"};
inline constexpr std::string_view kErnie45MoeKeys[] = {"moe_capacity",
                                                       "moe_gate",
                                                       "moe_intermediate_size",
                                                       "moe_k",
                                                       "moe_layer_end_index",
                                                       "moe_layer_interval",
                                                       "moe_layer_start_index",
                                                       "moe_norm_min",
                                                       "moe_num_experts",
                                                       "moe_num_shared_experts",
                                                       "moe_use_aux_free",
                                                       "num_experts",
                                                       "output_router_logits",
                                                       "router_aux_loss_coef",
                                                       "use_bias"};

inline constexpr HfFamilySpec kErnie45Moe = {
    .family = HfFamily::kErnie45Moe,
    .model_type = "ernie4_5_moe",
    .architecture = "Ernie4_5_MoeForCausalLM",
    .layer_type = HfLayerType::kDeepseekV3,
    .hidden_size = 2560,
    .width = 1536,
    .experts_keys = kErnie45MoeExpertsKeys,
    .experts = 64,
    .top_k_keys = kErnie45MoeTopKKeys,
    .top_k = 6,
    .norm_topk = HfNormTopK::kAlways,  // always renormalised (by the clamped sum)
    .shared = HfShared::kCount,
    .shared_key = "moe_num_shared_experts",
    .shared_default = 2,
    .layer_rule = HfLayerRule::kRange,
    .names = {.selection_bias = "moe_statics.e_score_correction_bias", .selection_bias_row = true},
    .expert_biases = HfExpertBiases::kUseBias,
    .routing = {.exact_norm = true, .norm_min = true},
    .keys = kErnie45MoeKeys,
    .decoder = {.vocab_size = 103424,
                .heads = 20,
                .kv_heads = 4,
                .rope_theta = 500000.0,
                .rms_norm_eps = 1e-5,
                .dense_width = 12288,
                .tie_word_embeddings = true,
                .rope_interleaved = true,
                .check = detail::check_ernie4_5_moe_decoder},
    .gguf = {.arch = "ernie4_5-moe"},
    .read = detail::read_ernie4_5_moe,
    .write = detail::write_ernie4_5_moe,
    .validate = detail::validate_ernie4_5_moe,
};

}  // namespace moe::io::families
