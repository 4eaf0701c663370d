// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RobustExpertWeighting: distributionally robust reweighting of per-expert losses (DRMoET sketch).
#pragma once

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/routing_plan.hpp"

namespace moe::balance {

/// Robust expert weighting in the spirit of DRMoET (distributionally robust MoE training).
/// DERIVED FROM THAT PAPER'S ABSTRACT ONLY: no paper text or reference code was available
/// (ALGORITHMS.md 4.7); treat it as an optional, experimental policy.
///   l_i   = sum_t a_{t,i} l_t / (sum_t a_{t,i} + eps)       activation-weighted per-expert loss
///           (a_{t,i} = routing weight of token t at expert i, from the plan; l_t per-token loss)
///   Lbar_i <- beta Lbar_i + (1 - beta) l_i                   EMA, experts with rows only
///   q = softmax(Lbar / tau)        (the maximiser of sum_i q_i Lbar_i + tau H(q) on the simplex)
///   training loss = sum_i q_i l_i  (q constant):  dLoss/dl_t = sum_i q_i a_{t,i} / (sum_t a + eps)
/// Use: after the forward, compute per-token losses l_t; call update(plan, l); scale each token's
/// loss gradient by token_weights(plan) (times E to keep the scale of a uniform q).
struct RobustExpertWeighting {
  double beta = 0.9;
  double tau = 1.0;
  double eps = 1e-6;
  std::vector<double> ema;  ///< [E] Lbar
  std::vector<double> q;    ///< [E] current expert weights

  /// Throws moe::Error unless 0 <= beta < 1, tau in (0, 1e6] and eps in [0, 1] (NaN and inf
  /// rejected).
  void validate() const {
    ::moe::detail::check(beta >= 0.0 && beta < 1.0, "RobustExpertWeighting: beta = ", beta,
                         "; it must be in [0, 1)");
    ::moe::detail::check(tau > 0.0 && tau <= 1e6, "RobustExpertWeighting: tau = ", tau,
                         "; it must be in (0, 1e6]");
    ::moe::detail::check(eps >= 0.0 && eps <= 1.0, "RobustExpertWeighting: eps = ", eps,
                         "; it must be in [0, 1]");
  }

  /// Updates the EMA from per-token losses [T] and recomputes q.
  void update(RoutingPlan const& plan, std::span<float const> token_loss) {
    Index const E = plan.num_experts;
    ::moe::detail::check(static_cast<Index>(token_loss.size()) == plan.num_tokens,
                         "RobustExpertWeighting: ", token_loss.size(), " token losses for ",
                         plan.num_tokens, " tokens");
    validate();
    if (static_cast<Index>(ema.size()) != E) ema.assign(static_cast<std::size_t>(E), 0.0);
    for (Index e = 0; e < E; ++e) {
      double num = 0.0, den = 0.0;
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r) {
        num += plan.row_weight[r] * token_loss[plan.row_token[r]];
        den += plan.row_weight[r];
      }
      if (plan.expert_rows(e) > 0) ema[e] = beta * ema[e] + (1.0 - beta) * num / (den + eps);
    }
    q.assign(static_cast<std::size_t>(E), 0.0);
    double m = -INFINITY, s = 0.0;
    for (double v : ema) m = std::max(m, v / tau);
    for (Index e = 0; e < E; ++e) s += (q[e] = std::exp(ema[e] / tau - m));
    for (double& v : q) v /= s;
  }

  /// dLoss/dl_t = sum_i q_i a_{t,i} / (sum_t a_{t,i} + eps) into out [T].
  void token_weights(RoutingPlan const& plan, std::span<float> out) const {
    ::moe::detail::check(
        static_cast<Index>(out.size()) == plan.num_tokens &&
            static_cast<Index>(q.size()) == plan.num_experts,
        "RobustExpertWeighting::token_weights: call update first; out needs one entry "
        "per token");
    std::fill(out.begin(), out.end(), 0.0f);
    for (Index e = 0; e < plan.num_experts; ++e) {
      double den = 0.0;
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r)
        den += plan.row_weight[r];
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r) {
        out[plan.row_token[r]] += static_cast<float>(q[e] * plan.row_weight[r] / (den + eps));
      }
    }
  }
};

}  // namespace moe::balance
