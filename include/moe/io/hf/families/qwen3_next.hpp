// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Qwen3-Next ("qwen3_next", Qwen3NextForCausalLM): the Qwen2-MoE block (softmax top-k, a
/// sigmoid-gated shared expert). Its decoder: Gated DeltaNet (linear attention) layers and, every
/// full_attention_interval-th layer, gated full attention (a sigmoid output gate packed per head
/// in q_proj, (1 + w) q/k norms, partial RoPE); (1 + w) layer and final norms. Its full-attention
/// layers also load alone through moe/io/hf/attention.hpp.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

inline constexpr std::string_view kQwen3NextExpertsKeys[] = {"num_experts"};
/// Its linear-attention (Gated DeltaNet) and rotary keys, beyond the Qwen keys.
inline constexpr std::string_view kQwen3NextKeys[] = {
    "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_num_key_heads",    "linear_num_value_heads", "linear_value_head_dim",
    "partial_rotary_factor"};

inline constexpr HfFamilySpec kQwen3Next = {
    .family = HfFamily::kQwen3Next,
    .model_type = "qwen3_next",
    .architecture = "Qwen3NextForCausalLM",
    .layer_type = HfLayerType::kQwen2Moe,
    .hidden_size = 2048,
    .width = 512,
    .experts_keys = kQwen3NextExpertsKeys,
    .experts = 512,
    .may_be_dense = true,
    .top_k_keys = kTopKKeys,
    .top_k = 10,
    .norm_topk_default = true,
    .shared = HfShared::kGated,
    .shared_key = "shared_expert_intermediate_size",
    .shared_default = 512,
    .layer_rule = HfLayerRule::kSparseStep,
    .names = {.shared_module = "shared_expert."},
    .keys = kQwenKeys,
    .more_keys = kQwen3NextKeys,
    .decoder = {.vocab_size = 151936,
                .heads = 16,
                .kv_heads = 2,
                .rope_theta = 10000.0,
                .rms_norm_eps = 1e-6,
                .dense_width = 5632,
                .head_dim = 256,
                .qk_norm = HfQkNorm::kPerHead,
                .rotary = HfRotary::kFactor,
                .rotary_factor = 0.25,
                .gated_deltanet = true},
    .gguf = {.arch = "qwen3next", .norm_topk = true, .mlp_norm = "post_attention_norm"},
};

}  // namespace moe::io::families
