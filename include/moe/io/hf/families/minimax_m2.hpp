// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MiniMax-M2 ("minimax_m2", MiniMaxM2ForCausalLM): sigmoid scores with a selection-only bias,
/// renormalised by the plain sum; Mixtral's tensor names; q/k RMSNorm over all heads and
/// partial RoPE (rotary_dim).
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
/// transformers' MiniMax-M2 ignores these keys although they would change the layer: report.
inline void read_minimax_m2(io::detail::HfConfigReader& r, HfMoeConfig& c) {
  using io::detail::JsonKind;
  if (io::detail::JsonValue const* v = r.find("scoring_func");
      v != nullptr && !(v->kind == JsonKind::kString && v->text == "sigmoid")) {
    c.ignored_settings.push_back(
        io::detail::concat("scoring_func = ",
                           v->kind == JsonKind::kString ? io::detail::printable_name(v->text)
                                                        : std::string("(not a string)"),
                           " (transformers' MiniMax-M2 always scores with sigmoid)"));
  }
  if (io::detail::JsonValue const* v = r.find("use_routing_bias");
      v != nullptr && !(v->kind == JsonKind::kBool && v->boolean)) {
    c.ignored_settings.push_back(
        "use_routing_bias = false (transformers' MiniMax-M2 always adds "
        "e_score_correction_bias for the selection)");
  }
  if (io::detail::JsonValue const* v = r.find("shared_intermediate_size");
      v != nullptr && !(v->kind == JsonKind::kNumber && v->text == "0")) {
    c.ignored_settings.push_back(
        io::detail::concat("shared_intermediate_size = ", v->text,
                           " (transformers' MiniMax-M2 has no shared expert)"));
  }
}
inline void check_minimax_m2_decoder(io::detail::HfConfigReader& r, HfMoeConfig const&,
                                     bool qk_norm, std::string const& source) {
  std::string const type = r.string("qk_norm_type", "per_layer");
  if (qk_norm && type != "per_layer") {
    moe::detail::fail("models: ", source, ": qk_norm_type \"", type,
                      "\" is not supported; moe reads MiniMax-M2's \"per_layer\" q/k norms (one "
                      "RMSNorm over all heads); fix config.json");
  }
}
}  // namespace detail

inline constexpr std::string_view kMinimaxM2ExpertsKeys[] = {"num_local_experts", "num_experts"};
/// The keys of its Hub config.json (remote code), beyond Mixtral's.
inline constexpr std::string_view kMinimaxM2Keys[] = {"attn_type_list",  "mtp_transformer_layers",
                                                      "num_mtp_modules", "partial_rotary_factor",
                                                      "qk_norm_type",    "rotary_dim",
                                                      "scoring_func",    "shared_intermediate_size",
                                                      "use_mtp",         "use_qk_norm",
                                                      "use_routing_bias"};

inline constexpr HfFamilySpec kMinimaxM2 = {
    .family = HfFamily::kMinimaxM2,
    .model_type = "minimax_m2",
    .architecture = "MiniMaxM2ForCausalLM",
    .layer_type = HfLayerType::kDeepseekV3,
    .hidden_size = 3072,
    .width_key = "intermediate_size",
    .width = 1536,
    .experts_keys = kMinimaxM2ExpertsKeys,
    .experts = 256,
    .top_k_keys = kTopKKeys,
    .top_k = 8,
    .norm_topk = HfNormTopK::kAlways,  // MiniMaxM2SparseMoeBlock always renormalises
    .names = {.v4_module = "block_sparse_moe.",
              .selection_bias = "e_score_correction_bias",
              .gate = "w1",
              .up = "w3",
              .down = "w2"},
    .routing = {.exact_norm = true},
    .keys = kMixtralKeys,
    .more_keys = kMinimaxM2Keys,
    .decoder = {.vocab_size = 200064,
                .heads = 48,
                .kv_heads = 8,
                .rope_theta = 5e6,
                .rms_norm_eps = 1e-6,
                .head_dim = 128,
                .qk_norm = HfQkNorm::kAllHeads,
                .qk_norm_key = "use_qk_norm",
                .qk_norm_default = true,
                .rotary = HfRotary::kRotaryDim,
                .check = detail::check_minimax_m2_decoder},
    .gguf = {.arch = "minimax-m2"},
    .read = detail::read_minimax_m2,
};

}  // namespace moe::io::families
