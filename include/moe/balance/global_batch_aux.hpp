// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GlobalBatchAux: load balancing with expert frequencies counted over a global batch.
#pragma once

#include <algorithm>

#include "moe/balance/detail.hpp"

namespace moe::balance {

/// Global-batch load balancing (Qiu et al., "Demons in the Detail", arXiv 2501.11873; Qwen3):
///   f̄_i = (routed rows of expert i) / (real tokens), both counted over every micro-batch of the
///         current step (forward_train calls since the last end_step, the current one included),
///         scaled by E / K as in the micro-batch LBL so that uniform routing gives f̄_i = 1
///   P_i = (1/T') sum_t p_{t,i} over the current micro-batch;   L = coef * sum_i f̄_i P_i
/// f̄ is a constant (no gradient): dL/dp_{t,i} = coef f̄_i / T'. Counts reset at end_step.
/// With one micro-batch per step this is the ordinary (micro-batch) balance loss.
struct GlobalBatchAux {
  double coef = 1e-3;
  /// Throws moe::Error unless coef is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("GlobalBatchAux", "coef", coef); }
  std::vector<double> counts;  ///< [E] routed rows accumulated over the step
  double tokens = 0.0;         ///< real tokens accumulated over the step
  std::vector<double> fbar;    ///< f̄ of the last observed micro-batch (used by backward)

  double aux_loss(BalanceInputs const& in) const {
    Index const T = detail::real_tokens(in);
    if (T == 0) return 0.0;
    auto f = frequencies(in, /*include_current=*/true);
    auto P = detail::mean_scores(in, T);
    double s = 0.0;
    for (std::size_t e = 0; e < f.size(); ++e) s += f[e] * P[e];
    return coef * s;
  }
  void observe(BalanceInputs const& in) {
    fbar = frequencies(in, true);
    auto c = detail::routed_counts(in);
    if (counts.size() != c.size()) counts.assign(c.size(), 0.0);
    for (std::size_t e = 0; e < c.size(); ++e) counts[e] += c[e];
    tokens += static_cast<double>(detail::real_tokens(in));
  }
  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    Index const T = detail::real_tokens(in), E = in.selection.num_experts;
    if (T == 0) return;
    auto const f = fbar.size() == static_cast<std::size_t>(E) ? fbar : frequencies(in, true);
    for (Index t = 0; t < in.selection.num_tokens; ++t) {
      if (!detail::real(in, t)) continue;
      for (Index e = 0; e < E; ++e)
        g.dscores(t, e) += static_cast<float>(coef * f[e] / static_cast<double>(T));
    }
  }
  template <class Router>
  void end_step(Router&) {
    std::fill(counts.begin(), counts.end(), 0.0);
    tokens = 0.0;
  }

 private:
  std::vector<double> frequencies(BalanceInputs const& in, bool include_current) const {
    Index const E = in.selection.num_experts;
    auto c = include_current ? detail::routed_counts(in)
                             : std::vector<double>(static_cast<std::size_t>(E), 0.0);
    double n = include_current ? static_cast<double>(detail::real_tokens(in)) : 0.0;
    if (counts.size() == c.size()) {
      for (std::size_t e = 0; e < c.size(); ++e) c[e] += counts[e];
    }
    n += tokens;
    double const k = static_cast<double>(std::max<Index>(1, in.selection.slots));
    for (double& v : c) v = n > 0.0 ? v * static_cast<double>(E) / (k * n) : 0.0;
    return c;
  }
};

static_assert(BalancePolicy<GlobalBatchAux>);

}  // namespace moe::balance
