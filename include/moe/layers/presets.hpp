// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Presets: the MoE FFN layer of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and OLMoE.
#pragma once

#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
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

}  // namespace moe::presets
