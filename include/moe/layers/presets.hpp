// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Presets: the MoE FFN layer of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and OLMoE, and of
/// the families that reuse their layer types: Qwen3-Next (Qwen2-MoE's), GLM-4.5, DeepSeek-V2,
/// MiniMax-M2 and ERNIE 4.5 (DeepSeek-V3's); Llama 4 and gpt-oss.
#pragma once

#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_sigmoid.hpp"
#include "moe/routing/top_k_softmax.hpp"

namespace moe::presets {

/// Mixtral (HF MixtralSparseMoeBlock): top-2 of 8 by logits, softmax over the two, SwiGLU
/// experts (w1 gate, w3 up, w2 down), no shared expert. Defaults: Mixtral-8x7B config.json.
struct MixtralConfig {
  Index hidden_size = 4096;
  Index intermediate_size = 14336;
  Index num_local_experts = 8;
  Index num_experts_per_tok = 2;
};
using MixtralMoe = MoeFfn<routing::TopKSoftmax, experts::SwiGlu>;
inline MixtralMoe make_mixtral(MixtralConfig const& c = {}) {
  return MixtralMoe(c.hidden_size, c.intermediate_size,
                    routing::TopKSoftmax{c.num_local_experts, c.num_experts_per_tok});
}

/// Qwen2-MoE (HF Qwen2MoeSparseMoeBlock): softmax over all experts, top-k, optional renorm,
/// SwiGLU experts, one shared SwiGLU expert scaled by sigmoid(shared_expert_gate x).
/// Defaults: Qwen1.5-MoE-A2.7B / HF Qwen2MoeConfig (norm_topk_prob false).
struct Qwen2MoeConfig {
  Index hidden_size = 2048;
  Index moe_intermediate_size = 1408;
  Index shared_expert_intermediate_size = 5632;
  Index num_experts = 60;
  Index num_experts_per_tok = 4;
  bool norm_topk_prob = false;
};
using Qwen2Moe =
    MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, experts::GatedSharedExperts<experts::SwiGlu>>;
inline Qwen2Moe make_qwen2_moe(Qwen2MoeConfig const& c = {}) {
  return Qwen2Moe(
      c.hidden_size, c.moe_intermediate_size,
      routing::SoftmaxTopK{c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, 1.0f},
      experts::GatedSharedExperts<experts::SwiGlu>(1, c.hidden_size,
                                                   c.shared_expert_intermediate_size));
}

/// Qwen3-MoE (HF Qwen3MoeSparseMoeBlock): the Qwen2-MoE router without a shared expert.
/// Defaults: Qwen3-30B-A3B (its config.json sets norm_topk_prob true; HF's Qwen3MoeConfig class
/// default is false, so set it from the checkpoint's config when loading another model).
struct Qwen3MoeConfig {
  Index hidden_size = 2048;
  Index moe_intermediate_size = 768;
  Index num_experts = 128;
  Index num_experts_per_tok = 8;
  bool norm_topk_prob = true;
};
using Qwen3Moe = MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
inline Qwen3Moe make_qwen3_moe(Qwen3MoeConfig const& c = {}) {
  return Qwen3Moe(
      c.hidden_size, c.moe_intermediate_size,
      routing::SoftmaxTopK{c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, 1.0f});
}

/// DeepSeek-V3 (official Gate + MoE; HF DeepseekV3MoE): sigmoid scores, selection-only bias,
/// group-limited top-k (-inf masking), renormalised weights times routed_scaling_factor, plus
/// n_shared_experts ungated shared experts stored as one expert of width
/// n_shared_experts * moe_intermediate_size. Defaults: DeepSeek-V3 (671B) config.json.
struct DeepseekV3Config {
  Index hidden_size = 7168;
  Index moe_intermediate_size = 2048;
  Index n_routed_experts = 256;
  Index num_experts_per_tok = 8;
  Index n_group = 8;
  Index topk_group = 4;
  float routed_scaling_factor = 2.5f;
  Index n_shared_experts = 1;
  bool norm_topk_prob = true;
};
using DeepseekV3Moe = MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu,
                             experts::UngatedSharedExperts<experts::SwiGlu>>;
inline DeepseekV3Moe make_deepseek_v3(DeepseekV3Config const& c = {}) {
  routing::GroupLimitedTopK r;
  r.num_experts = c.n_routed_experts;
  r.top_k = c.num_experts_per_tok;
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  r.normalize = c.norm_topk_prob;
  r.scale = c.routed_scaling_factor;
  r.bias.assign(static_cast<std::size_t>(c.n_routed_experts), 0.0f);
  return DeepseekV3Moe(c.hidden_size, c.moe_intermediate_size, std::move(r),
                       experts::UngatedSharedExperts<experts::SwiGlu>(
                           c.n_shared_experts > 0 ? 1 : 0, c.hidden_size,
                           std::max<Index>(1, c.n_shared_experts) * c.moe_intermediate_size));
}

/// OLMoE (HF OlmoeSparseMoeBlock): softmax over all 64 experts, top-8, raw probabilities
/// (norm_topk_prob false), SwiGLU experts, no shared expert. Defaults: OLMoE-1B-7B.
struct OlmoeConfig {
  Index hidden_size = 2048;
  Index intermediate_size = 1024;
  Index num_experts = 64;
  Index num_experts_per_tok = 8;
  bool norm_topk_prob = false;
};
using OlmoeMoe = MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
inline OlmoeMoe make_olmoe(OlmoeConfig const& c = {}) {
  return OlmoeMoe(
      c.hidden_size, c.intermediate_size,
      routing::SoftmaxTopK{c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, 1.0f});
}

/// Qwen3-Next (HF Qwen3NextSparseMoeBlock): Qwen2-MoE's block (softmax over all experts,
/// top-k, renormalised when norm_topk_prob, one shared expert scaled by sigmoid(w_g . x)), in the
/// Qwen2Moe layer type. Defaults: HF Qwen3NextConfig (Qwen3-Next-80B-A3B).
struct Qwen3NextConfig {
  Index hidden_size = 2048;
  Index moe_intermediate_size = 512;
  Index shared_expert_intermediate_size = 512;
  Index num_experts = 512;
  Index num_experts_per_tok = 10;
  bool norm_topk_prob = true;
};
using Qwen3NextMoe = Qwen2Moe;
inline Qwen3NextMoe make_qwen3_next(Qwen3NextConfig const& c = {}) {
  return make_qwen2_moe({c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size,
                         c.num_experts, c.num_experts_per_tok, c.norm_topk_prob});
}

/// GLM-4.5 (HF Glm4MoeMoE + Glm4MoeTopkRouter): DeepSeek-V3's router (sigmoid, selection-only
/// e_score_correction_bias, top-2-sum group scores, renormalised with + 1e-20 when
/// norm_topk_prob, then times routed_scaling_factor) and n_shared_experts ungated shared experts
/// as one of width n_shared_experts * moe_intermediate_size. Defaults: HF Glm4MoeConfig
/// (GLM-4.5-Air).
struct Glm4MoeConfig {
  Index hidden_size = 4096;
  Index moe_intermediate_size = 1408;
  Index n_routed_experts = 128;
  Index num_experts_per_tok = 8;
  Index n_group = 1;
  Index topk_group = 1;
  float routed_scaling_factor = 1.0f;
  Index n_shared_experts = 1;
  bool norm_topk_prob = true;
};
using Glm4Moe = DeepseekV3Moe;
inline Glm4Moe make_glm4_moe(Glm4MoeConfig const& c = {}) {
  return make_deepseek_v3({c.hidden_size, c.moe_intermediate_size, c.n_routed_experts,
                           c.num_experts_per_tok, c.n_group, c.topk_group, c.routed_scaling_factor,
                           c.n_shared_experts, c.norm_topk_prob});
}

/// DeepSeek-V2 (HF DeepseekV2Moe): softmax over all experts, no selection bias; topk_method
/// "greedy" (n_group = topk_group = 1) or "group_limited_greedy" (groups scored by their best
/// probability, topk_group kept); weights = probabilities * routed_scaling_factor, never
/// renormalised (transformers reads no norm_topk_prob for this family); n_shared_experts ungated
/// shared experts as one. Defaults: DeepSeek-V2 (236B) config.json.
struct DeepseekV2Config {
  Index hidden_size = 5120;
  Index moe_intermediate_size = 1536;
  Index n_routed_experts = 160;
  Index num_experts_per_tok = 6;
  Index n_group = 8;  ///< 1 for topk_method "greedy"
  Index topk_group = 3;
  float routed_scaling_factor = 16.0f;
  Index n_shared_experts = 2;
};
using DeepseekV2Moe = DeepseekV3Moe;
inline DeepseekV2Moe make_deepseek_v2(DeepseekV2Config const& c = {}) {
  DeepseekV2Moe layer = make_deepseek_v3(
      {c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok, c.n_group,
       c.topk_group, c.routed_scaling_factor, c.n_shared_experts, false});
  routing::GroupLimitedTopK& r = layer.router();
  r.scoring = routing::ScoreFunction::kSoftmax;
  r.group_score = routing::GroupScore::kMax;
  r.bias.clear();
  return layer;
}

/// MiniMax-M2 (HF MiniMaxM2SparseMoeBlock): sigmoid scores, selection-only
/// e_score_correction_bias, top-k, weights always renormalised (no epsilon), unscaled, no
/// groups, no shared expert. Defaults: HF MiniMaxM2Config (MiniMax-M2).
struct MinimaxM2Config {
  Index hidden_size = 3072;
  Index intermediate_size = 1536;
  Index num_local_experts = 256;
  Index num_experts_per_tok = 8;
};
using MinimaxM2Moe = DeepseekV3Moe;
inline MinimaxM2Moe make_minimax_m2(MinimaxM2Config const& c = {}) {
  MinimaxM2Moe layer = make_deepseek_v3({c.hidden_size, c.intermediate_size, c.num_local_experts,
                                         c.num_experts_per_tok, 1, 1, 1.0f, 0, true});
  layer.router().norm_epsilon = 0.0f;
  return layer;
}

/// ERNIE 4.5 MoE (HF Ernie4_5_MoeSparseMoeBlock): softmax over all experts; the selection-only
/// bias moe_statics.e_score_correction_bias is added to the probabilities; weights = the chosen
/// probabilities / max(their sum, moe_norm_min); unscaled; moe_num_shared_experts ungated shared
/// experts as one of width moe_num_shared_experts * moe_intermediate_size; with use_bias every
/// routed and shared expert projection has a bias (ExpertBank::enable_biases; the router has
/// none). Defaults: HF Ernie4_5_MoeConfig (ERNIE-4.5-21B-A3B).
struct Ernie45MoeConfig {
  Index hidden_size = 2560;
  Index moe_intermediate_size = 1536;
  Index moe_num_experts = 64;
  Index moe_k = 6;
  Index moe_num_shared_experts = 2;
  float moe_norm_min = 1e-12f;
  bool use_bias = false;
};
using Ernie45Moe = DeepseekV3Moe;
inline Ernie45Moe make_ernie4_5_moe(Ernie45MoeConfig const& c = {}) {
  Ernie45Moe layer = make_deepseek_v3({c.hidden_size, c.moe_intermediate_size, c.moe_num_experts,
                                       c.moe_k, 1, 1, 1.0f, c.moe_num_shared_experts, true});
  routing::GroupLimitedTopK& r = layer.router();
  r.scoring = routing::ScoreFunction::kSoftmax;
  r.norm_epsilon = 0.0f;
  r.norm_min = c.moe_norm_min;
  if (c.use_bias) {
    layer.experts().enable_biases();
    layer.shared_experts().bank().enable_biases();
  }
  return layer;
}

/// Llama 4 text MoE (HF Llama4TextMoe): top-k of the router logits, the sigmoid of each chosen
/// logit scales that expert's *input* (routing::TopKSigmoid with scale_input), SwiGLU experts,
/// plus one ungated SwiGLU shared expert of the experts' width:
///   y_t = sum_{i in A_t} E_i(sigmoid(z_i) x_t) + S(x_t).
/// Defaults: Llama-4-Scout-17B-16E (HF Llama4TextConfig).
struct Llama4Config {
  Index hidden_size = 5120;
  Index intermediate_size = 8192;
  Index num_local_experts = 16;
  Index num_experts_per_tok = 1;
};
using Llama4Moe =
    MoeFfn<routing::TopKSigmoid, experts::SwiGlu, experts::UngatedSharedExperts<experts::SwiGlu>>;
inline Llama4Moe make_llama4(Llama4Config const& c = {}) {
  return Llama4Moe(
      c.hidden_size, c.intermediate_size,
      routing::TopKSigmoid{c.num_local_experts, c.num_experts_per_tok, true},
      experts::UngatedSharedExperts<experts::SwiGlu>(1, c.hidden_size, c.intermediate_size));
}

/// gpt-oss (HF GptOssMLP): router logits x W_r^T + b_r (router.bias), top-k of them, softmax
/// over the k; experts::ClampedSwiGlu experts with biases, each output (bias included) times its
/// routing weight; no shared expert:
///   y_t = sum_{i in A_t} w_i (W_down,i m_i + b_down,i),
///   m_i = min(g, L) sigmoid(alpha min(g, L)) (clamp(u, -L, L) + 1),  g, u = W x + b.
/// Defaults: HF GptOssConfig (gpt-oss-120b: 128 experts, top-4; gpt-oss-20b has 32).
struct GptOssConfig {
  Index hidden_size = 2880;
  Index intermediate_size = 2880;
  Index num_local_experts = 128;
  Index num_experts_per_tok = 4;
  float swiglu_limit = 7.0f;
  float swiglu_alpha = 1.702f;
};
using GptOssMoe = MoeFfn<routing::TopKSoftmax, experts::ClampedSwiGlu>;
inline GptOssMoe make_gpt_oss(GptOssConfig const& c = {}) {
  GptOssMoe layer(c.hidden_size, c.intermediate_size,
                  routing::TopKSoftmax{c.num_local_experts, c.num_experts_per_tok});
  layer.enable_router_bias();
  layer.experts().enable_biases();
  layer.experts().set_glu_clamp({c.swiglu_alpha, c.swiglu_limit});
  return layer;
}

}  // namespace moe::presets

// A build may compile the presets' layers once, in translation units that instantiate them
// explicitly (src/precompiled/layers_*.cpp do, in moe_expert_kernels, for moe::precompiled and
// our own binaries), instead of in every unit that runs one: where MOE_EXTERN_EXPERT_KERNELS is
// defined, MoeFfn's entry points (route, forward, forward_with_plan, forward_train, backward:
// defined out of the class for this) of the six preset layer types are declared extern.
// MOE_FFN_INSTANTIATION(extern, L) declares them for one layer type L, MOE_FFN_INSTANTIATION(, L)
// defines them.
#define MOE_FFN_INSTANTIATION(EXTERN, L) \
  EXTERN template class ::moe::MoeFfn<L::Router, L::Expert, L::Shared, L::Balance>;
// The six layer types (also AnyDecoder's six MoE types, models/decoder.hpp): X(L) for each.
#define MOE_PRESET_LAYERS(X)    \
  X(::moe::presets::Qwen3Moe)   \
  X(::moe::presets::Qwen2Moe)   \
  X(::moe::presets::MixtralMoe) \
  X(::moe::presets::GptOssMoe) X(::moe::presets::DeepseekV3Moe) X(::moe::presets::Llama4Moe)
#if defined(MOE_EXTERN_EXPERT_KERNELS)
#define MOE_FFN_EXTERN_INSTANTIATION(L) MOE_FFN_INSTANTIATION(extern, L)
MOE_PRESET_LAYERS(MOE_FFN_EXTERN_INSTANTIATION)
#undef MOE_FFN_EXTERN_INSTANTIATION
#endif
