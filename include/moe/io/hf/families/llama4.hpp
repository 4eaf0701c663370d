// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Llama 4 ("llama4_text", or "llama4" with the text model's keys in text_config;
/// Llama4ForCausalLM): sigmoid-scaled expert inputs of the top-1 expert, one shared expert of
/// the experts' width, fused transposed experts under feed_forward.; MoE layers listed in
/// moe_layers or every interleave_moe_layer_step. Its decoder: interleaved RoPE (complex pairs)
/// with Llama 3 scaling, NoPE layers with temperature tuning, chunked attention on the RoPE
/// layers, an unweighted q/k norm there, dense MLPs of intermediate_size_mlp under feed_forward.
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

inline constexpr std::string_view kLlama4ExpertsKeys[] = {"num_local_experts"};
inline constexpr std::string_view kLlama4Keys[] = {"attention_chunk_size",
                                                   "attn_scale",
                                                   "attn_temperature_tuning",
                                                   "cache_implementation",
                                                   "floor_scale",
                                                   "interleave_moe_layer_step",
                                                   "intermediate_size_mlp",
                                                   "layer_types",
                                                   "moe_layers",
                                                   "no_rope_layer_interval",
                                                   "no_rope_layers",
                                                   "num_local_experts",
                                                   "output_router_logits",
                                                   "router_aux_loss_coef",
                                                   "router_jitter_noise",
                                                   "use_qk_norm"};

inline constexpr HfFamilySpec kLlama4 = {
    .family = HfFamily::kLlama4,
    .model_type = "llama4_text",
    .architecture = "Llama4ForCausalLM",
    .layer_type = HfLayerType::kLlama4,
    .nested_model_type = "llama4",
    .hidden_size = 5120,
    .width_key = "intermediate_size",
    .width = 8192,
    .experts_keys = kLlama4ExpertsKeys,
    .experts = 16,
    .top_k_keys = kTopKKeys,
    .top_k = 1,
    .norm_topk = HfNormTopK::kNever,
    .shared = HfShared::kExpertWidth,
    .layer_rule = HfLayerRule::kInterleave,
    .names = {.module = "feed_forward.",
              .router = "router.weight",
              .shared_module = "shared_expert."},
    .storage = HfExpertStorage::kFusedTransposed,
    .keys = kLlama4Keys,
    .decoder = {.vocab_size = 202048,
                .heads = 40,
                .kv_heads = 8,
                .rope_theta = 500000.0,
                .rms_norm_eps = 1e-5,
                .dense_width = 16384,
                .head_dim = 128,
                .qk_norm = HfQkNorm::kUnweightedOnRope,
                .qk_norm_key = "use_qk_norm",
                .qk_norm_default = true,
                .bias = HfAttentionBias::kAll,
                .rope_interleaved = true,
                .llama4_layers = true,
                .dense_module = "feed_forward.",
                .dense_width_key = "intermediate_size_mlp"},
    .gguf = {.arch = "llama4"},
};

}  // namespace moe::io::families
