// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ZLoss: the ST-MoE router z-loss.
#pragma once

#include "moe/balance/detail.hpp"

namespace moe::balance {

/// Router z-loss (ST-MoE; HF router_z_loss_func, flaxformer _router_z_loss):
///   L = coef * (1/T') sum_t (logsumexp_j z_{t,j})^2,    dL/dz_{t,j} = coef * (2/T') lse_t p_{t,j}
/// over the T' real tokens. Zero logits give L = coef * (log E)^2. Default coef 1e-3.
struct ZLoss {
  double coef = 1e-3;
  /// Throws moe::Error unless coef is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("ZLoss", "coef", coef); }

  double aux_loss(BalanceInputs const& in) const {
    Index const T = detail::real_tokens(in);
    if (T == 0) return 0.0;
    double s = 0.0;
    for (Index t = 0; t < in.logits.rows; ++t) {
      if (detail::real(in, t)) {
        double const l = lse(in.logits.row(t), in.logits.cols);
        s += l * l;
      }
    }
    return coef * s / static_cast<double>(T);
  }
  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    Index const T = detail::real_tokens(in), E = in.logits.cols;
    if (T == 0) return;
    std::vector<double> p(static_cast<std::size_t>(E));
    for (Index t = 0; t < in.logits.rows; ++t) {
      if (!detail::real(in, t)) continue;
      double const l = lse(in.logits.row(t), E);
      detail::softmax_row(in.logits.row(t), E, p.data());
      for (Index e = 0; e < E; ++e) {
        g.dlogits(t, e) += static_cast<float>(coef * 2.0 / static_cast<double>(T) * l * p[e]);
      }
    }
  }

 private:
  static double lse(float const* z, Index E) {
    double m = -INFINITY;
    for (Index e = 0; e < E; ++e) m = z[e] > m ? z[e] : m;
    double s = 0.0;
    for (Index e = 0; e < E; ++e) s += std::exp(static_cast<double>(z[e]) - m);
    return m + std::log(s);
  }
};

static_assert(BalancePolicy<ZLoss>);

}  // namespace moe::balance
