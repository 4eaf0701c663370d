// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Qwen2-MoE ("qwen2_moe", Qwen2MoeForCausalLM): softmax top-k, routed experts plus one shared
/// expert with a sigmoid gate; dense layers by decoder_sparse_step and mlp_only_layers; q/k/v
/// projection biases.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

inline constexpr std::string_view kQwenExpertsKeys[] = {"num_experts", "num_local_experts",
                                                        "n_routed_experts"};

inline constexpr HfFamilySpec kQwen2Moe = {
    .family = HfFamily::kQwen2Moe,
    .model_type = "qwen2_moe",
    .architecture = "Qwen2MoeForCausalLM",
    .layer_type = HfLayerType::kQwen2Moe,
    .hidden_size = 2048,
    .width = 1408,
    .experts_keys = kQwenExpertsKeys,
    .experts = 60,
    .may_be_dense = true,
    .top_k_keys = kTopKKeys,
    .top_k = 4,
    .shared = HfShared::kGated,
    .shared_key = "shared_expert_intermediate_size",
    .shared_default = 5632,
    .layer_rule = HfLayerRule::kSparseStep,
    .names = {.shared_module = "shared_expert."},
    .keys = kQwenKeys,
    .decoder = {.vocab_size = 151936,
                .heads = 16,
                .kv_heads = 16,
                .rms_norm_eps = 1e-6,
                .dense_width = 5632,
                .bias = HfAttentionBias::kQkvKey},
    .gguf = {.arch = "qwen2moe", .norm_topk = false},
};

}  // namespace moe::io::families
