// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Helpers shared by the balance policies (not public API).
#pragma once

#include <cmath>
#include <vector>

#include "moe/core/concepts.hpp"
#include "moe/core/error.hpp"

namespace moe::balance::detail {

/// Largest loss coefficient a balance policy accepts: far above any published value (1e-4 to
/// 1e-1), low enough that coef times a loss of order E stays finite in float gradients.
inline constexpr double kMaxCoefficient = 1e6;

/// Throws moe::Error unless 0 <= value <= kMaxCoefficient (NaN and +-inf rejected; 0 turns the
/// term off; denormals are accepted and give a vanishing term).
inline void check_coefficient(char const* who, char const* name, double value) {
  ::moe::detail::check(value >= 0.0 && value <= kMaxCoefficient, who, ": ", name, " = ", value,
                       "; it must be a number in [0, ", kMaxCoefficient, "] (0 turns it off)");
}

/// Is token t a real token (no mask, or mask[t] != 0)?
inline bool real(BalanceInputs const& in, Index t) {
  return in.token_mask.empty() || in.token_mask[t] != 0;
}

/// Number of real tokens.
inline Index real_tokens(BalanceInputs const& in) {
  Index n = 0;
  for (Index t = 0; t < in.selection.num_tokens; ++t) n += real(in, t);
  return n;
}

/// Per-expert count of real tokens routed to it (plan rows; a token counts once per slot).
inline std::vector<double> routed_counts(BalanceInputs const& in) {
  Index const E = in.plan.num_experts;
  std::vector<double> c(static_cast<std::size_t>(E), 0.0);
  for (Index e = 0; e < E; ++e) {
    for (Index r = in.plan.expert_offsets[e]; r < in.plan.expert_offsets[e + 1]; ++r) {
      if (real(in, in.plan.row_token[r])) c[e] += 1.0;
    }
  }
  return c;
}

/// Mean router score per expert over real tokens: P_i = (1/T') sum_t scores[t, i].
inline std::vector<double> mean_scores(BalanceInputs const& in, Index real_count) {
  Index const E = in.selection.num_experts;
  std::vector<double> P(static_cast<std::size_t>(E), 0.0);
  for (Index t = 0; t < in.selection.num_tokens; ++t) {
    if (!real(in, t)) continue;
    float const* p = in.selection.scores.data() + t * E;
    for (Index e = 0; e < E; ++e) P[e] += p[e];
  }
  for (double& v : P) v /= static_cast<double>(real_count > 0 ? real_count : 1);
  return P;
}

/// Softmax of one logit row in double (-inf entries get 0).
inline void softmax_row(float const* z, Index E, double* p) {
  double m = -INFINITY;
  for (Index e = 0; e < E; ++e) m = z[e] > m ? z[e] : m;
  double s = 0.0;
  for (Index e = 0; e < E; ++e) s += (p[e] = std::exp(static_cast<double>(z[e]) - m));
  for (Index e = 0; e < E; ++e) p[e] /= s;
}

}  // namespace moe::balance::detail
