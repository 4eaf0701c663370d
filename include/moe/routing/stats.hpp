// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RoutingStats: per-expert load, imbalance, entropies and drops of one routing decision.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"

namespace moe::routing {

/// Statistics of one routing decision:
/// - tokens_per_expert[e] = rows of expert e; min_load, max_load, mean_load = R / E;
/// - imbalance = max_load / mean_load (1 is perfect balance; 0 when nothing was routed);
/// - load_entropy = -sum_e (n_e / R) log(n_e / R), in nats (log E at perfect balance);
/// - router_entropy = mean over tokens of -sum_e p[t, e] log p[t, e] over the router scores
///   (for sigmoid scores, each row is first normalised to sum to 1);
/// - dropped = token-slots removed by a capacity limit.
struct RoutingStats {
  std::vector<Index> tokens_per_expert;
  Index min_load = 0;
  Index max_load = 0;
  double mean_load = 0.0;
  double imbalance = 0.0;
  double load_entropy = 0.0;
  double router_entropy = 0.0;
  Index dropped = 0;
};

/// Computes RoutingStats from a plan and the Selection it was built from (O(T*E + E)).
inline RoutingStats routing_stats(RoutingPlan const& plan, Selection const& sel) {
  RoutingStats st;
  Index const E = plan.num_experts;
  st.tokens_per_expert.resize(static_cast<std::size_t>(E));
  for (Index e = 0; e < E; ++e) st.tokens_per_expert[e] = plan.expert_rows(e);
  Index const R = plan.num_rows();
  if (E > 0) {
    st.min_load = *std::min_element(st.tokens_per_expert.begin(), st.tokens_per_expert.end());
    st.max_load = *std::max_element(st.tokens_per_expert.begin(), st.tokens_per_expert.end());
    st.mean_load = static_cast<double>(R) / static_cast<double>(E);
  }
  st.imbalance = st.mean_load > 0.0 ? static_cast<double>(st.max_load) / st.mean_load : 0.0;
  for (Index e = 0; e < E; ++e) {
    if (st.tokens_per_expert[e] == 0) continue;
    double const q = static_cast<double>(st.tokens_per_expert[e]) / static_cast<double>(R);
    st.load_entropy -= q * std::log(q);
  }
  double total = 0.0;
  for (Index t = 0; t < sel.num_tokens; ++t) {
    float const* p = sel.scores.data() + t * sel.num_experts;
    double sum = 0.0;
    for (Index e = 0; e < sel.num_experts; ++e) sum += p[e];
    if (sum <= 0.0) continue;
    double h = 0.0;
    for (Index e = 0; e < sel.num_experts; ++e) {
      double const q = p[e] / sum;
      if (q > 0.0) h -= q * std::log(q);
    }
    total += h;
  }
  st.router_entropy = sel.num_tokens > 0 ? total / static_cast<double>(sel.num_tokens) : 0.0;
  st.dropped = sel.dropped;
  return st;
}

}  // namespace moe::routing
