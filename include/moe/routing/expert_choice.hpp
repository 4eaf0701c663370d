// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertChoice: each expert picks its C best tokens (Zhou et al. 2022, "Expert Choice Routing").
#pragma once

#include <algorithm>
#include <cmath>

#include "moe/core/selection.hpp"
#include "moe/kernels/top_k.hpp"
#include "moe/routing/detail/common.hpp"

namespace moe::routing {

/// Expert-choice routing (flaxformer ExpertsChooseMaskedRouter):
///   p = softmax(z_t) over experts, per token
///   C = min(T, max(round(capacity_factor * T / E), min_capacity))   (round half to even)
///   expert e takes the C tokens with the largest p[t, e];  weight = p[t, e] (no renormalisation)
/// A token may get 0 to E experts; every available expert processes exactly C tokens. Ties go to
/// the lower token index. An expert whose logits are all -inf (masked) takes no token.
/// Not causal: a token's experts depend on the other tokens of the batch, so it does not fit
/// autoregressive decoding (as the paper says).
/// Shapes: logits [T, E]; slots = E, slot e holds expert e (or -1), ascending expert order.
/// Preconditions: num_experts >= 1, capacity_factor > 0, min_capacity >= 0.
struct ExpertChoice {
  Index num_experts = 8;
  float capacity_factor = 1.0f;
  Index min_capacity = 4;

  Index expert_count() const { return num_experts; }
  Index slots_per_token() const { return num_experts; }
  /// Tokens each expert processes for a batch of num_tokens tokens.
  Index capacity(Index num_tokens) const {
    double const c =
        std::nearbyint(static_cast<double>(capacity_factor) * static_cast<double>(num_tokens) /
                       static_cast<double>(num_experts));
    // Converting a value beyond Index is undefined behaviour (capacity_factor = 1e30 is valid):
    // saturate at 2^62, more tokens than any batch has.
    Index const capped = c < 0x1p62 ? static_cast<Index>(c) : Index{1} << 62;
    return std::min(num_tokens, std::max(capped, min_capacity));
  }
  void validate() const {
    using detail::check;
    check(num_experts >= 1, "ExpertChoice: num_experts = ", num_experts, "; need at least 1");
    check(capacity_factor > 0.0f && std::isfinite(capacity_factor),
          "ExpertChoice: capacity_factor = ", capacity_factor, "; it must be a positive number");
    check(min_capacity >= 0, "ExpertChoice: min_capacity = ", min_capacity, " is negative");
  }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    (void)logits;
    detail::weights_from_scores_backward(sel, num_experts, false, 0.0f, 1.0f, dweight, dscores);
    detail::score_backward(ScoreFunction::kSoftmax, sel, dscores, dlogits);
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    Index const T = logits.rows;
    Index const E = num_experts;
    Index const C = capacity(T);
    sel.reset(T, E, E);
    detail::compute_scores(ScoreFunction::kSoftmax, logits, sel);
    sel.scratch.resize(static_cast<std::size_t>(T + C));
    float* column = sel.scratch.data();
    float* vals = column + T;
    sel.scratch_ids.resize(static_cast<std::size_t>(C));
    ExpertId* tokens = sel.scratch_ids.data();
    for (Index e = 0; e < E; ++e) {
      for (Index t = 0; t < T; ++t) {
        column[t] = logits(t, e) == -INFINITY ? -INFINITY : sel.scores[t * E + e];
      }
      kernels::top_k_rows(column, T, 1, T, C, tokens, vals);
      for (Index j = 0; j < C; ++j) {
        if (tokens[j] < 0) continue;
        sel.expert[tokens[j] * E + e] = static_cast<ExpertId>(e);
        sel.weight[tokens[j] * E + e] = sel.scores[tokens[j] * E + e];
      }
    }
  }
};

static_assert(RouterPolicy<ExpertChoice>);

}  // namespace moe::routing
