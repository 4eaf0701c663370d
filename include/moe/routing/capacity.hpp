// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// WithCapacity: a per-expert capacity with token dropping, around any token-choice policy.
#pragma once

#include <algorithm>
#include <cmath>

#include "moe/core/selection.hpp"
#include "moe/routing/detail/common.hpp"
#include "moe/routing/softmax_top_k.hpp"

namespace moe::routing {

/// Switch / GShard capacity limit (flaxformer TokensChooseMaskedRouter) on top of `Inner`:
///   C = max(round(capacity_factor * T / E), min_capacity)          (round half to even)
/// Token-slots claim capacity in priority order: every token's slot 0 (its top-1 choice) in
/// token order, then every token's slot 1, and so on; a slot that finds its expert full is
/// dropped (expert -1, weight 0, counted in Selection::dropped). Kept weights are left as the
/// inner policy made them (not renormalised); the residual connection outside the layer carries
/// what was dropped. With batch_prioritized (Riquelme et al., "Batch Prioritized Routing"), tokens
/// are visited by descending slot-0 weight instead of token order (ties: lower token first).
/// Note: C scales with T / E as in flaxformer, not with T * k / E; raise capacity_factor by k
/// for the GShard convention.
/// Shapes: as Inner. Preconditions: capacity_factor > 0, min_capacity >= 0, Inner::validate.
template <class Inner>
struct WithCapacity {
  Inner inner;
  float capacity_factor = 1.25f;
  Index min_capacity = 4;
  bool batch_prioritized = false;

  Index expert_count() const { return inner.expert_count(); }
  Index slots_per_token() const { return inner.slots_per_token(); }
  Index capacity(Index num_tokens) const {
    double const c =
        std::nearbyint(static_cast<double>(capacity_factor) * static_cast<double>(num_tokens) /
                       static_cast<double>(inner.expert_count()));
    // Converting a value beyond Index is undefined behaviour (capacity_factor = 1e30 is valid):
    // saturate at 2^62, more tokens than any batch has.
    Index const capped = c < 0x1p62 ? static_cast<Index>(c) : Index{1} << 62;
    return std::max(capped, min_capacity);
  }
  void validate() const {
    inner.validate();
    detail::check(capacity_factor > 0.0f && std::isfinite(capacity_factor),
                  "WithCapacity: capacity_factor = ", capacity_factor,
                  "; it must be a positive number");
    detail::check(min_capacity >= 0, "WithCapacity: min_capacity = ", min_capacity, " is negative");
  }
  /// Backward (see TrainableRouterPolicy): dweight [T, S] = dL/dw per slot; dscores [T, E] holds
  /// extra dL/dscores on entry and is accumulated into; dlogits [T, E] is overwritten.
  void backward(ConstMatrixView<float> logits, Selection const& sel, float const* dweight,
                MatrixView<float> dscores, MatrixView<float> dlogits) const {
    inner.backward(logits, sel, dweight, dscores, dlogits);  // dropped slots: u = 0, still in S
  }
  void select(ConstMatrixView<float> logits, Selection& sel) const {
    inner.select(logits, sel);
    Index const T = sel.num_tokens;
    Index const S = sel.slots;
    Index const C = capacity(T);
    // Token visiting order, and per-expert fill counts: kept in scratch_ids (no allocation).
    sel.scratch_ids.resize(static_cast<std::size_t>(T + sel.num_experts));
    ExpertId* order = sel.scratch_ids.data();
    ExpertId* fill = order + T;
    for (Index t = 0; t < T; ++t) order[t] = static_cast<ExpertId>(t);
    std::fill(fill, fill + sel.num_experts, ExpertId{0});
    if (batch_prioritized && S > 0) {
      std::sort(order, order + T, [&](ExpertId a, ExpertId b) {
        float const wa = sel.weight[a * S], wb = sel.weight[b * S];
        return wa > wb || (wa == wb && a < b);
      });
    }
    sel.dropped_expert.assign(sel.expert.size(), ExpertId{-1});
    for (Index s = 0; s < S; ++s) {
      for (Index i = 0; i < T; ++i) {
        Index const slot = order[i] * S + s;
        ExpertId const e = sel.expert[slot];
        if (e < 0) continue;
        if (fill[e] < C) {
          ++fill[e];
        } else {
          sel.dropped_expert[slot] = e;
          sel.expert[slot] = -1;
          sel.weight[slot] = 0.0f;
          ++sel.dropped;
        }
      }
    }
  }
};

static_assert(RouterPolicy<WithCapacity<SoftmaxTopK>>);

}  // namespace moe::routing
