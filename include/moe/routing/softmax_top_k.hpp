// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// SoftmaxTopK: softmax over all experts, then top-k (Qwen2-MoE, Qwen3-MoE, OLMoE).
#pragma once

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// Token-choice routing with softmax over all experts, then the k best:
///   p = softmax(z_t);  A_t = top-k(p);  w_i = p_i (i in A_t)
///   if normalize: w_i /= sum_{j in A_t} p_j;     then w_i *= scale
/// Hugging Face Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock / OlmoeSparseMoeBlock
/// (`norm_topk_prob` = normalize). With normalize = true the weights equal softmax over the
/// selected logits, as in Mixtral (see TopKSoftmax for that exact formulation).
///
/// Selection is made on the logits (softmax is monotone, and logits do not underflow to equal
/// probabilities); ties go to the lower expert index. Experts with logit -inf are never selected.
/// Shapes: logits [T, E]; Selection slots = top_k, in descending score order.
/// Preconditions: 1 <= top_k <= num_experts; 0 < scale <= 1e6.
struct SoftmaxTopK {
  Index num_experts = 8;
  Index top_k = 2;
  bool normalize = false;  ///< norm_topk_prob
  float scale = 1.0f;      ///< routed_scaling_factor

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return top_k; }
  void validate() const {
    detail::check_top_k("SoftmaxTopK", num_experts, top_k);
    detail::check_scale("SoftmaxTopK", scale);
  }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    (void)logits;
    if (normalize) {
      // Extra score terms through the softmax, then the exact renormalised form.
      detail::score_backward(ScoreFunction::kSoftmax, sel, dscores, dlogits);
      detail::renormalized_softmax_backward(sel, top_k, scale, dweight, dlogits);
      return;
    }
    detail::weights_from_scores_backward(sel, top_k, normalize, 0.0f, scale, dweight, dscores);
    detail::score_backward(ScoreFunction::kSoftmax, sel, dscores, dlogits);
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    sel.reset(logits.rows, top_k, num_experts);
    detail::compute_scores(ScoreFunction::kSoftmax, logits, sel);
    sel.scratch.resize(static_cast<std::size_t>(logits.rows * top_k));
    kernels::top_k_rows(logits.data, logits.row_stride, logits.rows, logits.cols, top_k,
                        sel.expert.data(), sel.scratch.data());
    detail::weights_from_scores(sel, top_k, normalize, 0.0f, scale);
  }
};

static_assert(RouterPolicy<SoftmaxTopK>);

}  // namespace moe::routing
