// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// SwitchAux: the Switch Transformer load-balancing loss on the routed selection.
#pragma once

#include "moe/balance/detail.hpp"

namespace moe::balance {

/// Switch Transformer auxiliary loss (Fedus et al.; HF switch_transformers
/// load_balancing_loss_func):
///   L = coef * E * sum_i f_i P_i,   f_i = (1/T') #{t : i in A_t},   P_i = (1/T') sum_t p_{t,i}
/// over the T' real tokens (token mask), with p the router's scores and A_t its selection
/// (after capacity drops). Gradient through P only: dL/dp_{t,i} = coef * E * f_i / T'.
/// Uniform routing with top-1 gives L = coef. Defaults: coef 1e-2 (paper; HF uses 1e-3).
struct SwitchAux {
  double coef = 1e-2;
  /// Throws moe::Error unless coef is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("SwitchAux", "coef", coef); }

  double aux_loss(BalanceInputs const& in) const {
    Index const E = in.plan.num_experts, T = detail::real_tokens(in);
    if (T == 0) return 0.0;
    auto f = token_fractions(in, T);
    auto P = detail::mean_scores(in, T);
    double s = 0.0;
    for (Index e = 0; e < E; ++e) s += f[e] * P[e];
    return coef * static_cast<double>(E) * s;
  }
  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    Index const E = in.plan.num_experts, T = detail::real_tokens(in);
    if (T == 0) return;
    auto f = token_fractions(in, T);
    for (Index t = 0; t < in.selection.num_tokens; ++t) {
      if (!detail::real(in, t)) continue;
      for (Index e = 0; e < E; ++e) {
        g.dscores(t, e) +=
            static_cast<float>(coef * static_cast<double>(E) * f[e] / static_cast<double>(T));
      }
    }
  }

 private:
  /// f_i: fraction of real tokens with expert i among their routed experts.
  static std::vector<double> token_fractions(BalanceInputs const& in, Index T) {
    auto f = detail::routed_counts(in);
    for (double& v : f) v /= static_cast<double>(T);
    return f;
  }
};

static_assert(BalancePolicy<SwitchAux>);

}  // namespace moe::balance
