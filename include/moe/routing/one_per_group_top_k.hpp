// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// OnePerGroupTopK: at most one expert per group ("diversity-constrained" routing).
#pragma once

#include <cmath>

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// Token-choice routing that never picks two experts from the same group:
///   p = score(z_t);  winner_j = argmax_{e in group j} z_e  (j < n_group)
///   A_t = the k best winners;  w_i = p_i;  if normalize: w_i /= sum_A p;  w_i *= scale
/// Groups are contiguous blocks of num_experts / n_group experts. This is the sketch in
/// ALGORITHMS.md section 5 ("DivMoE", derived from the paper's abstract only: no reference code
/// was available), equal to group-limited routing with a top-1-per-group rule.
/// Ties go to the lower index; experts with logit -inf are never selected; a group with no
/// available expert has no winner.
/// Shapes: logits [T, E]; slots = top_k. Preconditions: n_group divides num_experts,
/// 1 <= top_k <= n_group, 0 < scale <= 1e6.
struct OnePerGroupTopK {
  Index num_experts = 8;
  Index top_k = 2;
  Index n_group = 4;
  bool normalize = false;
  float scale = 1.0f;
  ScoreFunction scoring = ScoreFunction::kSoftmax;

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return top_k; }
  void validate() const {
    using detail::check;
    detail::check_top_k("OnePerGroupTopK", num_experts, top_k);
    check(n_group >= 1 && num_experts % n_group == 0, "OnePerGroupTopK: n_group = ", n_group,
          " does not divide num_experts = ", num_experts, "; pick n_group among its divisors");
    check(top_k <= n_group, "OnePerGroupTopK: top_k = ", top_k, " exceeds n_group = ", n_group,
          "; at most one expert per group can be chosen");
    detail::check_scale("OnePerGroupTopK", scale);
  }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    (void)logits;
    if (normalize && scoring == ScoreFunction::kSoftmax) {
      // Extra score terms through the softmax, then the exact renormalised form.
      detail::score_backward(ScoreFunction::kSoftmax, sel, dscores, dlogits);
      detail::renormalized_softmax_backward(sel, top_k, scale, dweight, dlogits);
      return;
    }
    detail::weights_from_scores_backward(sel, top_k, normalize, 0.0f, scale, dweight, dscores);
    detail::score_backward(scoring, sel, dscores, dlogits);
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    Index const T = logits.rows;
    Index const E = num_experts;
    Index const group_size = E / n_group;
    sel.reset(T, top_k, E);
    detail::compute_scores(scoring, logits, sel);
    sel.scratch.resize(static_cast<std::size_t>(n_group + top_k));
    float* gbest = sel.scratch.data();
    float* vals = gbest + n_group;
    sel.scratch_ids.resize(static_cast<std::size_t>(n_group + top_k));
    ExpertId* winner = sel.scratch_ids.data();
    ExpertId* gids = winner + n_group;
    for (Index t = 0; t < T; ++t) {
      float const* z = logits.row(t);
      for (Index g = 0; g < n_group; ++g) {
        gbest[g] = -INFINITY;
        winner[g] = -1;
        for (Index e = g * group_size; e < (g + 1) * group_size; ++e) {
          if (z[e] > gbest[g]) {
            gbest[g] = z[e];
            winner[g] = static_cast<ExpertId>(e);
          }
        }
      }
      // Logits order experts exactly as both score functions do (monotone), across groups too.
      kernels::top_k_rows(gbest, n_group, 1, n_group, top_k, gids, vals);
      ExpertId* ids = sel.expert_row(t);
      for (Index s = 0; s < top_k; ++s) ids[s] = gids[s] >= 0 ? winner[gids[s]] : -1;
    }
    detail::weights_from_scores(sel, top_k, normalize, 0.0f, scale);
  }
};

static_assert(RouterPolicy<OnePerGroupTopK>);

}  // namespace moe::routing
