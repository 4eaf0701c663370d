// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// VarianceLoss: reward confident routing by maximising the variance of the router scores.
#pragma once

#include "moe/balance/detail.hpp"

namespace moe::balance {

/// Variance loss of "Advancing Expert Specialization" (Guo et al., NeurIPS 2025;
/// HongcanGuo/Auxloss-For-Advancing-Expert-Specialization MoEGate):
///   V = (1/T') sum_t Var_i(p_{t,i}),  Var unbiased (divides by E - 1, like torch.var)
///   L = -coef * V   (the variance is maximised: the reference subtracts w_v * V)
///   dL/dp_{t,i} = -coef * 2 (p_{t,i} - mean_t) / ((E - 1) T')
/// The reference auto-scales its weight at the first step; here coef is set by the user
/// (reference target 1e-3). Requires E >= 2 (0 otherwise).
struct VarianceLoss {
  double coef = 1e-3;
  /// Throws moe::Error unless coef is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("VarianceLoss", "coef", coef); }

  /// V, the mean unbiased variance (without coefficient or sign).
  static double variance(BalanceInputs const& in) {
    Index const T = detail::real_tokens(in), E = in.selection.num_experts;
    if (T == 0 || E < 2) return 0.0;
    double total = 0.0;
    for (Index t = 0; t < in.selection.num_tokens; ++t) {
      if (!detail::real(in, t)) continue;
      float const* p = in.selection.scores.data() + t * E;
      double m = 0.0;
      for (Index e = 0; e < E; ++e) m += p[e];
      m /= static_cast<double>(E);
      double v = 0.0;
      for (Index e = 0; e < E; ++e) v += (p[e] - m) * (p[e] - m);
      total += v / static_cast<double>(E - 1);
    }
    return total / static_cast<double>(T);
  }
  double aux_loss(BalanceInputs const& in) const { return -coef * variance(in); }
  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    Index const T = detail::real_tokens(in), E = in.selection.num_experts;
    if (T == 0 || E < 2) return;
    for (Index t = 0; t < in.selection.num_tokens; ++t) {
      if (!detail::real(in, t)) continue;
      float const* p = in.selection.scores.data() + t * E;
      double m = 0.0;
      for (Index e = 0; e < E; ++e) m += p[e];
      m /= static_cast<double>(E);
      double const c = -coef * 2.0 / (static_cast<double>(E - 1) * static_cast<double>(T));
      for (Index e = 0; e < E; ++e) g.dscores(t, e) += static_cast<float>(c * (p[e] - m));
    }
  }
};

static_assert(BalancePolicy<VarianceLoss>);

}  // namespace moe::balance
