// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// TopKSigmoid: top-k of the logits, each chosen expert weighted by the sigmoid of its logit;
/// by default the weight scales the expert's input (Llama 4).
#pragma once

#include <cmath>

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// Token-choice routing of Hugging Face Llama4Router:
///   A_t = top-k(z_t);  w_i = sigmoid(z_i)  (i in A_t; not renormalised)
/// With scale_input (Llama4TextMoe), an MoE layer multiplies expert i's *input* by w_i and adds
/// its output unweighted:  y_t = sum_{i in A_t} E_i(w_i x_t)  (+ shared experts); otherwise it
/// weighs the outputs as every other router does: y_t = sum_i w_i E_i(x_t). For SwiGLU experts
/// the two differ (E_i(w x) != w E_i(x)), in the forward and in the gradients.
/// Selection is made on the logits (the sigmoid saturates in float, the logits do not); ties go
/// to the lower expert index; experts with logit -inf are never selected. Selection::scores
/// holds sigmoid(z) of every expert (for statistics and balance losses).
/// Shapes: logits [T, E]; slots = top_k. Preconditions: 1 <= top_k <= num_experts.
struct TopKSigmoid {
  Index num_experts = 16;
  Index top_k = 1;
  bool scale_input = true;  ///< the weight multiplies the expert's input (Llama 4)

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return top_k; }
  void validate() const { detail::check_top_k("TopKSigmoid", num_experts, top_k); }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten:
  /// dz_i = (dscores_i + u_i [i in A_t]) s_i (1 - s_i).
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    (void)logits;
    detail::weights_from_scores_backward(sel, top_k, false, 0.0f, 1.0f, dweight, dscores);
    detail::score_backward(ScoreFunction::kSigmoid, sel, dscores, dlogits);
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    sel.reset(logits.rows, top_k, num_experts);
    detail::compute_scores(ScoreFunction::kSigmoid, logits, sel);
    sel.scratch.resize(static_cast<std::size_t>(logits.rows * top_k));
    kernels::top_k_rows(logits.data, logits.row_stride, logits.rows, logits.cols, top_k,
                        sel.expert.data(), sel.scratch.data());
    detail::weights_from_scores(sel, top_k, false, 0.0f, 1.0f);
  }
};

static_assert(RouterPolicy<TopKSigmoid>);

namespace detail {
/// Does router `r` ask its layer to scale the experts' inputs by the routing weights
/// (TopKSigmoid::scale_input) instead of their outputs?
template <class Router>
bool scales_input(Router const& r) {
  if constexpr (requires { r.scale_input; }) {
    return r.scale_input;
  } else {
    return false;
  }
}
}  // namespace detail

}  // namespace moe::routing
