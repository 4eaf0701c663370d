// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// build_plan: a stable counting sort of a Selection into a RoutingPlan.
#pragma once

#include "moe/core/error.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"

namespace moe::kernels {

/// Builds `plan` from the non-empty slots of `sel`: rows sorted by expert; within an expert by
/// token, then slot (stable counting sort, O(T*S + E)); each token's rows listed in slot order.
/// Empty slots (expert -1) are skipped. Reuses the plan's storage: no allocation once the
/// largest shape has been seen. Throws moe::Error on an expert id outside [-1, E).
inline void build_plan(Selection const& sel, RoutingPlan& plan) {
  Index const T = sel.num_tokens;
  Index const S = sel.slots;
  Index const E = sel.num_experts;
  plan.num_tokens = T;
  plan.num_experts = E;
  plan.expert_offsets.assign(static_cast<std::size_t>(E + 1), 0);
  plan.token_offsets.resize(static_cast<std::size_t>(T + 1));
  Index* counts = plan.expert_offsets.data() + 1;
  plan.token_offsets[0] = 0;
  for (Index t = 0; t < T; ++t) {
    ExpertId const* ids = sel.expert_row(t);
    Index used = 0;
    for (Index s = 0; s < S; ++s) {
      ExpertId const e = ids[s];
      if (e < 0) continue;
      ::moe::detail::check(e < E, "build_plan: token ", t, " slot ", s, " names expert ", e,
                           " but there are only ", E, " experts; the router produced a bad id");
      ++counts[e];
      ++used;
    }
    plan.token_offsets[t + 1] = plan.token_offsets[t] + used;
  }
  for (Index e = 0; e < E; ++e) plan.expert_offsets[e + 1] += plan.expert_offsets[e];
  Index const R = plan.expert_offsets[E];
  plan.row_token.resize(static_cast<std::size_t>(R));
  plan.row_weight.resize(static_cast<std::size_t>(R));
  plan.token_rows.resize(static_cast<std::size_t>(R));
  // Shift the prefix sums right by one: expert_offsets[e + 1] becomes the start of expert e and
  // serves as its write cursor; after the fill it is the end of expert e again (no extra buffer).
  for (Index e = E; e > 0; --e) plan.expert_offsets[e] = plan.expert_offsets[e - 1];
  plan.expert_offsets[0] = 0;
  for (Index t = 0; t < T; ++t) {
    ExpertId const* ids = sel.expert_row(t);
    float const* ws = sel.weight_row(t);
    Index j = plan.token_offsets[t];
    for (Index s = 0; s < S; ++s) {
      ExpertId const e = ids[s];
      if (e < 0) continue;
      Index const r = plan.expert_offsets[e + 1]++;
      plan.row_token[r] = t;
      plan.row_weight[r] = ws[s];
      plan.token_rows[j++] = r;
    }
  }
}

}  // namespace moe::kernels
