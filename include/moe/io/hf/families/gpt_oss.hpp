// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// gpt-oss ("gpt_oss", GptOssForCausalLM): a biased router, softmax over the top-k logits,
/// biased experts with the clamped GLU (swiglu_limit, swiglu_alpha), fused interleaved experts
/// (MXFP4 in the released checkpoints); attention with biases, sinks, YaRN RoPE and sliding
/// windows on the layers layer_types names.
#pragma once

#include <cmath>

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
// transformers v4.5x reads swiglu_limit from the config only in its MXFP4 kernels and hard-codes
// 7.0 and 1.702 in GptOssExperts; v5 has both as config fields.
inline void read_gpt_oss(io::detail::HfConfigReader& r, HfMoeConfig& c) {
  c.swiglu_limit = static_cast<float>(r.number("swiglu_limit", 7.0));
  c.swiglu_alpha = static_cast<float>(r.number("swiglu_alpha", 1.702));
}
inline void write_gpt_oss(io::detail::HfJsonWriter& w, HfMoeConfig const& c) {
  w.number("swiglu_limit", c.swiglu_limit);
  w.number("swiglu_alpha", c.swiglu_alpha);
}
inline void validate_gpt_oss(HfMoeConfig const& c, std::string const& where) {
  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("hf: ", where, ": ", parts..., "; fix config.json");
  };
  fail_if(!(c.swiglu_limit > 0.0f && std::isfinite(c.swiglu_limit)),
          "swiglu_limit = ", c.swiglu_limit, " must be finite and > 0 (gpt-oss: 7.0)");
  fail_if(!(c.swiglu_alpha > 0.0f && std::isfinite(c.swiglu_alpha)),
          "swiglu_alpha = ", c.swiglu_alpha, " must be finite and > 0 (gpt-oss: 1.702)");
  fail_if(c.mxfp4 && (c.hidden_size % 32 != 0 || c.expert_intermediate_size % 32 != 0),
          "MXFP4 experts need hidden_size = ", c.hidden_size,
          " and intermediate_size = ", c.expert_intermediate_size,
          " to be multiples of 32 (the blocks' size)");
}
}  // namespace detail

inline constexpr std::string_view kGptOssExpertsKeys[] = {"num_local_experts"};
inline constexpr std::string_view kGptOssTopKKeys[] = {"num_experts_per_tok", "experts_per_token"};
/// GptOssConfig (v4.55 to v5) and the keys of the published config.json files.
inline constexpr std::string_view kGptOssKeys[] = {
    "experts_per_token", "initial_context_length", "layer_types",
    "num_local_experts", "output_router_logits",   "router_aux_loss_coef",
    "sliding_window",    "swiglu_alpha",           "swiglu_limit"};

inline constexpr HfFamilySpec kGptOss = {
    .family = HfFamily::kGptOss,
    .model_type = "gpt_oss",
    .architecture = "GptOssForCausalLM",
    .layer_type = HfLayerType::kGptOss,
    .hidden_size = 2880,
    .width_key = "intermediate_size",
    .width = 2880,
    .experts_keys = kGptOssExpertsKeys,
    .experts = 128,
    .top_k_keys = kGptOssTopKKeys,
    .top_k = 4,
    .norm_topk = HfNormTopK::kAlways,  // softmax over the k chosen logits
    .names = {.router = "router.weight"},
    .storage = HfExpertStorage::kFusedInterleaved,
    .expert_biases = HfExpertBiases::kAlways,
    .router_bias = true,
    .keys = kGptOssKeys,
    .decoder = {.vocab_size = 201088,
                .heads = 64,
                .kv_heads = 8,
                .rope_theta = 150000.0,
                .rms_norm_eps = 1e-5,
                .head_dim = 64,
                .bias = HfAttentionBias::kAllOnByDefault,
                .sinks = true,
                .yarn = true,  // GptOssConfig's default rope_scaling:
                .yarn_factor = 32.0,
                .yarn_original_max_position = 4096,
                .yarn_truncate = false,
                .sliding = HfSliding::kLayerTypes,
                .sliding_window = 128},
    .gguf = {.arch = "gpt-oss", .mlp_norm = "post_attention_norm"},
    .read = detail::read_gpt_oss,
    .write = detail::write_gpt_oss,
    .validate = detail::validate_gpt_oss,
};

}  // namespace moe::io::families
