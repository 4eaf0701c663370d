// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Mixtral ("mixtral", MixtralForCausalLM): softmax top-k, always renormalised; experts named
/// w1 / w3 / w2 under block_sparse_moe. (v4) or mlp. (v5); sliding-window attention.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

inline constexpr std::string_view kMixtralExpertsKeys[] = {"num_local_experts", "num_experts",
                                                           "n_routed_experts"};

inline constexpr HfFamilySpec kMixtral = {
    .family = HfFamily::kMixtral,
    .model_type = "mixtral",
    .architecture = "MixtralForCausalLM",
    .layer_type = HfLayerType::kMixtral,
    .hidden_size = 4096,
    .width_key = "intermediate_size",
    .width = 14336,
    .experts_keys = kMixtralExpertsKeys,
    .experts = 8,
    .top_k_keys = kTopKKeys,
    .top_k = 2,
    .norm_topk = HfNormTopK::kAlways,  // MixtralSparseMoeBlock always renormalises
    .names = {.v4_module = "block_sparse_moe.", .gate = "w1", .up = "w3", .down = "w2"},
    .keys = kMixtralKeys,
    .decoder = {.vocab_size = 32000,
                .heads = 32,
                .kv_heads = 8,
                .rope_theta = 1e6,
                .rms_norm_eps = 1e-5,
                .sliding = HfSliding::kEveryLayer},
    .gguf = {.arch = "llama", .width_key = "feed_forward_length", .permuted_qk = true},
};

}  // namespace moe::io::families
