// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// TopKSoftmax: top-k of the logits, then softmax over the selected ones (Mixtral).
#pragma once

#include <cmath>

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// Token-choice routing as written in Mixtral's reference code:
///   A_t = top-k(z_t);  w_i = exp(z_i - z_max) / sum_{j in A_t} exp(z_j - z_max)   (i in A_t)
/// Mathematically equal to SoftmaxTopK with normalize = true (Hugging Face MixtralSparseMoeBlock
/// computes it that way); this form never evaluates the unselected experts' probabilities.
/// Selection::scores still holds the full softmax, for statistics and balance losses.
/// Ties go to the lower expert index; experts with logit -inf are never selected.
/// Shapes: logits [T, E]; slots = top_k. Preconditions: 1 <= top_k <= num_experts.
struct TopKSoftmax {
  Index num_experts = 8;
  Index top_k = 2;

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return top_k; }
  void validate() const { detail::check_top_k("TopKSoftmax", num_experts, top_k); }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    // Extra score terms go through the full softmax; the weights are softmax over the selected
    // logits: dz_i += w_i (u_i - sum_j w_j u_j) for selected i (w recomputed: capacity drops zero
    // the stored weights but not the forward's normalisation).
    detail::score_backward(ScoreFunction::kSoftmax, sel, dscores, dlogits);
    Index const S = sel.slots;
    for (Index t = 0; t < sel.num_tokens; ++t) {
      float const* z = logits.row(t);
      float const* u = dweight + t * S;
      float* dz = dlogits.row(t);
      float zmax = -INFINITY;
      for (Index s = 0; s < top_k; ++s) {
        ExpertId const e = sel.chosen_expert(t * S + s);
        if (e >= 0 && z[e] > zmax) zmax = z[e];
      }
      float sum = 0.0f;
      for (Index s = 0; s < top_k; ++s) {
        ExpertId const e = sel.chosen_expert(t * S + s);
        if (e >= 0) sum += std::exp(z[e] - zmax);
      }
      float dot = 0.0f;
      for (Index s = 0; s < top_k; ++s) {
        ExpertId const e = sel.chosen_expert(t * S + s);
        if (e >= 0) dot += std::exp(z[e] - zmax) / sum * u[s];
      }
      for (Index s = 0; s < top_k; ++s) {
        ExpertId const e = sel.chosen_expert(t * S + s);
        if (e >= 0) dz[e] += std::exp(z[e] - zmax) / sum * (u[s] - dot);
      }
    }
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    sel.reset(logits.rows, top_k, num_experts);
    detail::compute_scores(ScoreFunction::kSoftmax, logits, sel);
    sel.scratch.resize(static_cast<std::size_t>(logits.rows * top_k));
    float* vals = sel.scratch.data();
    kernels::top_k_rows(logits.data, logits.row_stride, logits.rows, logits.cols, top_k,
                        sel.expert.data(), vals);
    for (Index t = 0; t < logits.rows; ++t) {
      float const* v = vals + t * top_k;  // descending; v[0] is the max (finite: E >= 1 available)
      float* w = sel.weight_row(t);
      ExpertId const* ids = sel.expert_row(t);
      float sum = 0.0f;
      for (Index s = 0; s < top_k; ++s) {
        w[s] = ids[s] >= 0 ? std::exp(v[s] - v[0]) : 0.0f;
        sum += w[s];
      }
      for (Index s = 0; s < top_k; ++s) w[s] /= sum;
    }
  }
};

static_assert(RouterPolicy<TopKSoftmax>);

}  // namespace moe::routing
