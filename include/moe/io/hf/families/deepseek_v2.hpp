// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// DeepSeek-V2 ("deepseek_v2", DeepseekV2ForCausalLM): softmax scores, greedy or group-limited
/// top-k (a group scores by its best expert), weights scaled and never renormalised, ungated
/// shared experts; the first first_k_dense_replace layers dense. Its decoder: multi-head latent
/// attention (MLA).
#pragma once

#include "moe/io/hf/families/common.hpp"

namespace moe::io::families {

namespace detail {
inline void read_deepseek_v2(io::detail::HfConfigReader& r, HfMoeConfig& c) {
  using io::detail::JsonKind;
  c.routed_scaling_factor = static_cast<float>(r.number("routed_scaling_factor", 1.0));
  c.topk_method = r.string("topk_method", "greedy");
  if (c.topk_method == "gready") c.topk_method = "greedy";  // DeepSeek's remote spelling
  if (c.topk_method == "group_limited_greedy") {
    r.require("n_group", "topk_method \"group_limited_greedy\" needs it");
    r.require("topk_group", "topk_method \"group_limited_greedy\" needs it");
    c.n_group = r.integer({"n_group"}, 1, 1);
    c.topk_group = r.integer({"topk_group"}, 1, 1);
  }
  c.scoring_func = "softmax";
  if (r.find("scoring_func") != nullptr) c.scoring_func = r.string("scoring_func", "softmax");
  if (io::detail::JsonValue const* v = r.find("norm_topk_prob")) {
    if (v->kind != JsonKind::kBool) r.bad("norm_topk_prob", *v, "true or false");
    if (v->boolean && c.num_experts_per_tok > 1) {
      c.ignored_settings.push_back(
          "norm_topk_prob = true (transformers' DeepSeek-V2 never renormalises the top-k "
          "weights and always multiplies them by routed_scaling_factor; DeepSeek's remote "
          "code would renormalise instead of scaling)");
    }
  }
  if (io::detail::JsonValue const* v = r.find("moe_layer_freq")) {
    if (Index const freq = r.integer("moe_layer_freq", *v, 1); freq != 1) {
      c.ignored_settings.push_back(io::detail::concat(
          "moe_layer_freq = ", freq,
          " (transformers' DeepSeek-V2 makes every layer from first_k_dense_replace on an "
          "MoE layer; DeepSeek's remote code would make only every ",
          freq, "th one)"));
    }
  }
}
inline void write_deepseek_v2(io::detail::HfJsonWriter& w, HfMoeConfig const& c) {
  w.string("topk_method", c.topk_method);
  if (c.topk_method == "group_limited_greedy") {
    w.integer("n_group", c.n_group);
    w.integer("topk_group", c.topk_group);
  }
  w.number("routed_scaling_factor", c.routed_scaling_factor);
  w.boolean("norm_topk_prob", false);
  w.string("scoring_func", c.scoring_func);
}
inline void validate_deepseek_v2(HfMoeConfig const& c, std::string const& where) {
  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("hf: ", where, ": ", parts..., "; fix config.json");
  };
  using io::detail::printable_name;
  fail_if(c.scoring_func != "softmax", "scoring_func ", printable_name(c.scoring_func),
          " is not supported: DeepSeek-V2's gate scores with \"softmax\"");
  fail_if(c.topk_method != "greedy" && c.topk_method != "group_limited_greedy", "topk_method ",
          printable_name(c.topk_method),
          " is not supported: DeepSeek-V2's gate implements \"greedy\" and "
          "\"group_limited_greedy\"");
  fail_if(c.topk_method == "greedy" && (c.n_group != 1 || c.topk_group != 1),
          "topk_method \"greedy\" routes without groups, but n_group = ", c.n_group,
          " and topk_group = ", c.topk_group, " (moe keeps them 1 for greedy)");
}
}  // namespace detail

inline constexpr std::string_view kDeepseekV2ExpertsKeys[] = {"n_routed_experts", "num_experts"};
inline constexpr std::string_view kDeepseekV2Keys[] = {"mlp_bias", "num_experts"};

inline constexpr HfFamilySpec kDeepseekV2 = {
    .family = HfFamily::kDeepseekV2,
    .model_type = "deepseek_v2",
    .architecture = "DeepseekV2ForCausalLM",
    .layer_type = HfLayerType::kDeepseekV3,
    .hidden_size = 4096,
    .width = 1407,
    .experts_keys = kDeepseekV2ExpertsKeys,
    .experts = 64,
    .top_k_keys = kTopKKeys,
    .top_k_required = "transformers' DeepseekV2Config defaults it to None",
    .norm_topk = HfNormTopK::kNever,  // transformers' DeepseekV2 never renormalises
    .shared = HfShared::kCount,
    .shared_key = "n_shared_experts",
    .shared_default = 2,
    .layer_rule = HfLayerRule::kFirstK,
    .grouped = true,
    .routing = {.group_max = true},
    .keys = kDeepseekKeys,
    .more_keys = kDeepseekV2Keys,
    .decoder = {.vocab_size = 32000,
                .heads = 32,
                .rope_theta = 10000.0,
                .rms_norm_eps = 1e-6,
                .dense_width = 11008,
                .bias = HfAttentionBias::kQkv,
                .yarn = true,
                .mla = true,
                .mla_softmax_mscale = false,
                .q_lora_rank = 1536,
                .kv_lora_rank = 512,
                .qk_nope_head_dim = 128,
                .qk_rope_head_dim = 64,
                .v_head_dim = 128},
    .gguf = {.arch = "deepseek2", .gating_func = 1},
    .read = detail::read_deepseek_v2,
    .write = detail::write_deepseek_v2,
    .validate = detail::validate_deepseek_v2,
};

}  // namespace moe::io::families
