// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// TopP: as many experts as it takes to pass a probability threshold (Huang et al. 2024).
#pragma once

#include <cmath>

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// Adaptive top-p routing ("Harder Tasks Need More Experts", ZhenweiAn/Dynamic_MoE
/// top_p_sampling_batched_all_sequence):
///   p = softmax(z_t);  sort p descending;  c_j = cumulative sum
///   keep experts up to and including the first j with c_j > threshold (all of them if none)
///   w_i = p_i (raw probabilities, no renormalisation unless normalize)
/// Example: p = [0.5, 0.3, 0.2], threshold 0.4 -> one expert with weight 0.5;
/// p = [0.35, 0.3, 0.2, 0.15] -> two experts. `max_experts` > 0 caps the count per token.
/// Ties go to the lower expert index; experts with logit -inf are never selected.
/// Shapes: logits [T, E]; slots = E, filled in descending score order, the rest empty.
/// Preconditions: 0 <= threshold <= 1, 0 <= max_experts <= num_experts.
struct TopP {
  Index num_experts = 8;
  float threshold = 0.4f;
  Index max_experts = 0;  ///< 0: no cap
  bool normalize = false;

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return num_experts; }
  void validate() const {
    using detail::check;
    check(num_experts >= 1, "TopP: num_experts = ", num_experts, "; need at least 1");
    check(threshold >= 0.0f && threshold <= 1.0f, "TopP: threshold = ", threshold,
          "; it must be a probability in [0, 1]");
    check(max_experts >= 0 && max_experts <= num_experts, "TopP: max_experts = ", max_experts,
          "; it must be in [0, num_experts] (0 means no cap)");
  }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    (void)logits;
    detail::weights_from_scores_backward(sel, num_experts, normalize, 0.0f, 1.0f, dweight, dscores);
    detail::score_backward(ScoreFunction::kSoftmax, sel, dscores, dlogits);
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    Index const T = logits.rows;
    Index const E = num_experts;
    sel.reset(T, E, E);
    detail::compute_scores(ScoreFunction::kSoftmax, logits, sel);
    sel.scratch.resize(static_cast<std::size_t>(E));
    float* vals = sel.scratch.data();
    Index const cap = max_experts > 0 ? max_experts : E;
    for (Index t = 0; t < T; ++t) {
      ExpertId* ids = sel.expert_row(t);
      kernels::top_k_rows(logits.row(t), E, 1, E, E, ids, vals);  // every expert, sorted
      float const* p = sel.scores.data() + t * E;
      float cum = 0.0f;
      Index keep = 0;
      while (keep < cap && ids[keep] >= 0) {
        cum += p[ids[keep]];
        ++keep;
        if (cum > threshold) break;
      }
      for (Index s = keep; s < E; ++s) ids[s] = -1;
    }
    detail::weights_from_scores(sel, E, normalize, 0.0f, 1.0f);
  }
};

static_assert(RouterPolicy<TopP>);

}  // namespace moe::routing
