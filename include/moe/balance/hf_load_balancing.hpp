// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// HfLoadBalancing: Hugging Face's load_balancing_loss_func (Mixtral, Qwen2/3-MoE, OLMoE).
#pragma once

#include <algorithm>
#include <numeric>

#include "moe/balance/detail.hpp"

namespace moe::balance {

/// The Hugging Face auxiliary loss (mixtral/modeling_mixtral.py load_balancing_loss_func), fed the
/// raw router logits exactly once (the double-softmax bug of transformers#45120 cannot happen):
///   p = softmax(z_t);  sel = top-k(p) (k = top_k);  over the T' real tokens (attention mask):
///   f_i = (1/T') sum_t sum_slots 1[sel = i]  (sums to k);   P_i = (1/T') sum_t p_{t,i}
///   L = coef * E * sum_i f_i P_i           (uniform routing: L = coef * k)
/// Gradient through p only: dL/dz_t = softmax VJP of coef * E * f / T'. HF evaluates one loss over
/// the concatenated logits of all layers; this policy is per layer (sum the per-layer values for
/// HF's per-layer-mean variant). Defaults: coef 1e-3 (Mixtral, Qwen; OLMoE uses 1e-2).
struct HfLoadBalancing {
  Index top_k = 2;
  double coef = 1e-3;
  /// Throws moe::Error unless coef is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("HfLoadBalancing", "coef", coef); }

  double aux_loss(BalanceInputs const& in) const {
    Stats st = stats(in);
    double s = 0.0;
    for (std::size_t e = 0; e < st.f.size(); ++e) s += st.f[e] * st.P[e];
    return st.T == 0 ? 0.0 : coef * static_cast<double>(st.f.size()) * s;
  }
  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    Stats st = stats(in);
    if (st.T == 0) return;
    Index const E = static_cast<Index>(st.f.size());
    std::vector<double> p(static_cast<std::size_t>(E));
    for (Index t = 0; t < in.logits.rows; ++t) {
      if (!detail::real(in, t)) continue;
      detail::softmax_row(in.logits.row(t), E, p.data());
      double dot = 0.0;
      for (Index e = 0; e < E; ++e) dot += p[e] * st.f[e];
      double const c = coef * static_cast<double>(E) / static_cast<double>(st.T);
      for (Index e = 0; e < E; ++e)
        g.dlogits(t, e) += static_cast<float>(c * p[e] * (st.f[e] - dot));
    }
  }

 private:
  struct Stats {
    std::vector<double> f, P;
    Index T = 0;
  };
  Stats stats(BalanceInputs const& in) const {
    Index const E = in.logits.cols;
    Stats st;
    st.f.assign(static_cast<std::size_t>(E), 0.0);
    st.P.assign(static_cast<std::size_t>(E), 0.0);
    std::vector<double> p(static_cast<std::size_t>(E));
    std::vector<Index> order(static_cast<std::size_t>(E));
    Index const k = std::min(top_k, E);
    for (Index t = 0; t < in.logits.rows; ++t) {
      if (!detail::real(in, t)) continue;
      ++st.T;
      detail::softmax_row(in.logits.row(t), E, p.data());
      for (Index e = 0; e < E; ++e) st.P[e] += p[e];
      std::iota(order.begin(), order.end(), Index{0});
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](Index a, Index b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      for (Index s = 0; s < k; ++s) st.f[order[s]] += 1.0;
    }
    if (st.T > 0) {
      for (Index e = 0; e < E; ++e) {
        st.f[e] /= static_cast<double>(st.T);
        st.P[e] /= static_cast<double>(st.T);
      }
    }
    return st;
  }
};

static_assert(BalancePolicy<HfLoadBalancing>);

}  // namespace moe::balance
