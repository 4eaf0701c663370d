// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Qwen3-Next ("qwen3_next", Qwen3NextForCausalLM): the Qwen2-MoE block (softmax top-k, a
/// sigmoid-gated shared expert). No decoder yet (Gated DeltaNet layers); its full-attention
/// layers load through moe/io/hf/attention.hpp.
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
    .decoder = {.lacks = "its Gated DeltaNet (linear attention) layers"},
};

}  // namespace moe::io::families
