// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// OLMoE ("olmoe", OlmoeForCausalLM): softmax top-k, routed experts only (of width
/// intermediate_size); q/k RMSNorm over all heads; attention_bias on q/k/v/o.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
inline void check_olmoe_decoder(io::detail::HfConfigReader& r, HfMoeConfig const&, bool,
                                std::string const& source) {
  if (r.find("clip_qkv") != nullptr) {
    moe::detail::fail("models: ", source,
                      ": clip_qkv is not supported (moe's attention does not clamp q, k and v); "
                      "OLMoE releases set it null; fix config.json");
  }
}
}  // namespace detail

inline constexpr std::string_view kOlmoeExpertsKeys[] = {"num_experts", "num_local_experts",
                                                         "n_routed_experts"};
inline constexpr std::string_view kOlmoeKeys[] = {
    "clip_qkv",          "norm_topk_prob",       "num_experts",
    "num_local_experts", "output_router_logits", "router_aux_loss_coef"};

inline constexpr HfFamilySpec kOlmoe = {
    .family = HfFamily::kOlmoe,
    .model_type = "olmoe",
    .architecture = "OlmoeForCausalLM",
    .layer_type = HfLayerType::kQwen3Moe,
    .hidden_size = 2048,
    .width_key = "intermediate_size",
    .width = 2048,
    .experts_keys = kOlmoeExpertsKeys,
    .experts = 64,
    .top_k_keys = kTopKKeys,
    .top_k = 8,
    .keys = kOlmoeKeys,
    .decoder = {.vocab_size = 50304,
                .heads = 16,
                .rms_norm_eps = 1e-5,
                .qk_norm = HfQkNorm::kAllHeads,
                .bias = HfAttentionBias::kAll,
                .check = detail::check_olmoe_decoder},
    .gguf = {.arch = "olmoe", .width_key = "feed_forward_length"},
};

}  // namespace moe::io::families
