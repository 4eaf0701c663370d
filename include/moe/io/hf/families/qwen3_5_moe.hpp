// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Qwen3.5-MoE ("qwen3_5_moe_text", Qwen3_5MoeForCausalLM; or "qwen3_5_moe" with the text
/// model's keys in text_config and its tensors under model.language_model., as
/// Qwen3_5MoeForConditionalGeneration saves Qwen3.5-35B-A3B): Qwen3-Next's block (softmax top-k,
/// a sigmoid-gated shared expert) on every layer, the top-k weights always renormalised
/// (Qwen3VLMoeTextTopKRouter). Its decoder is Qwen3-Next's with the Gated DeltaNet's input
/// projections split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). For text the model's
/// multimodal RoPE (mrope_section) is the plain one: the three position ids are the same.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

inline constexpr std::string_view kQwen35ExpertsKeys[] = {"num_experts"};
/// Qwen3_5MoeTextConfig's keys beyond those every config has (it drops Qwen3-Next's
/// intermediate_size, decoder_sparse_step, norm_topk_prob and mlp_only_layers).
inline constexpr std::string_view kQwen35Keys[] = {"full_attention_interval",
                                                   "layer_types",
                                                   "linear_conv_kernel_dim",
                                                   "linear_key_head_dim",
                                                   "linear_num_key_heads",
                                                   "linear_num_value_heads",
                                                   "linear_value_head_dim",
                                                   "moe_intermediate_size",
                                                   "num_experts",
                                                   "output_router_logits",
                                                   "partial_rotary_factor",
                                                   "router_aux_loss_coef",
                                                   "shared_expert_intermediate_size"};

inline constexpr HfFamilySpec kQwen35Moe = {
    .family = HfFamily::kQwen35Moe,
    .model_type = "qwen3_5_moe_text",
    .architecture = "Qwen3_5MoeForCausalLM",
    .layer_type = HfLayerType::kQwen2Moe,
    .nested_model_type = "qwen3_5_moe",
    .hidden_size = 2048,
    .width = 512,
    .experts_keys = kQwen35ExpertsKeys,
    .experts = 256,
    .top_k_keys = kTopKKeys,
    .top_k = 8,
    .norm_topk = HfNormTopK::kAlways,
    .shared = HfShared::kGated,
    .shared_key = "shared_expert_intermediate_size",
    .shared_default = 512,
    .layer_rule = HfLayerRule::kEvery,
    .names = {.shared_module = "shared_expert."},
    .keys = kQwen35Keys,
    .decoder = {.vocab_size = 248320,
                .heads = 16,
                .kv_heads = 2,
                .rope_theta = 10000.0,
                .rms_norm_eps = 1e-6,
                .head_dim = 256,
                .qk_norm = HfQkNorm::kPerHead,
                .rotary = HfRotary::kFactor,
                .rotary_factor = 0.25,
                .gated_deltanet = true,
                .deltanet_split_projections = true},
    .gguf = {.arch = "qwen35moe",
             .mlp_norm = "post_attention_norm",
             .extra_layers_key = "nextn_predict_layers"},
};

}  // namespace moe::io::families
