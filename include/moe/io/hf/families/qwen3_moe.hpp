// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Qwen3-MoE ("qwen3_moe", Qwen3MoeForCausalLM): softmax top-k, routed experts only; dense
/// layers by decoder_sparse_step and mlp_only_layers; per-head q/k RMSNorm.
#pragma once

#include "moe/io/hf/families/qwen2_moe.hpp"

namespace moe::io::families {

inline constexpr HfFamilySpec kQwen3Moe = {
    .family = HfFamily::kQwen3Moe,
    .model_type = "qwen3_moe",
    .architecture = "Qwen3MoeForCausalLM",
    .layer_type = HfLayerType::kQwen3Moe,
    .hidden_size = 2048,
    .width = 768,
    .experts_keys = kQwenExpertsKeys,
    .experts = 128,
    .may_be_dense = true,
    .top_k_keys = kTopKKeys,
    .top_k = 8,
    .layer_rule = HfLayerRule::kSparseStep,
    .keys = kQwenKeys,
    .decoder = {.vocab_size = 151936,
                .heads = 32,
                .kv_heads = 4,
                .rms_norm_eps = 1e-6,
                .dense_width = 6144,
                .qk_norm = HfQkNorm::kPerHead},
    .gguf = {.arch = "qwen3moe", .norm_topk = true},
};

}  // namespace moe::io::families
