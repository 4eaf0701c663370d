// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// SeqAux: DeepSeek-V3's complementary sequence-wise balance loss.
#pragma once

#include "moe/balance/detail.hpp"
#include "moe/core/error.hpp"

namespace moe::balance {

/// DeepSeek-V3 sequence-wise balance loss, per sequence of `seq_len` consecutive tokens
/// (0: the whole batch is one sequence), averaged over the B sequences:
///   f_i = E / (K T_s) #{t : i in A_t}     (the routed, i.e. biased, selection, as implemented)
///   s'_{t,i} = s_{t,i} / sum_j s_{t,j};   P_i = (1/T_s) sum_t s'_{t,i}
///   L = alpha * mean_sequences sum_i f_i P_i          (perfect balance: L = alpha)
/// K is the router's slots per token. Gradient through s' into the router scores:
///   ds_{t,j} = (g_j - sum_i g_i s'_{t,i}) / sum_i s_{t,i},  g_i = alpha f_i / (B T_s).
/// Padding tokens (mask 0) are left out of T_s and f. Default alpha 1e-4 (DeepSeek-V3).
struct SeqAux {
  double alpha = 1e-4;
  /// Throws moe::Error unless alpha is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("SeqAux", "alpha", alpha); }
  Index seq_len = 0;

  double aux_loss(BalanceInputs const& in) const {
    double total = 0.0;
    for_each_sequence(in, [&](Index t0, Index t1, Index Ts, std::vector<double> const& f, Index B) {
      std::vector<double> P(f.size(), 0.0);
      Index const E = static_cast<Index>(f.size());
      for (Index t = t0; t < t1; ++t) {
        if (!detail::real(in, t)) continue;
        float const* s = in.selection.scores.data() + t * E;
        double sum = 0.0;
        for (Index e = 0; e < E; ++e) sum += s[e];
        for (Index e = 0; e < E; ++e) P[e] += s[e] / sum / static_cast<double>(Ts);
      }
      double l = 0.0;
      for (Index e = 0; e < E; ++e) l += f[e] * P[e];
      total += alpha * l / static_cast<double>(B);
    });
    return total;
  }

  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    for_each_sequence(in, [&](Index t0, Index t1, Index Ts, std::vector<double> const& f, Index B) {
      Index const E = static_cast<Index>(f.size());
      for (Index t = t0; t < t1; ++t) {
        if (!detail::real(in, t)) continue;
        float const* s = in.selection.scores.data() + t * E;
        double sum = 0.0, dot = 0.0;
        for (Index e = 0; e < E; ++e) sum += s[e];
        double const c = alpha / (static_cast<double>(B) * static_cast<double>(Ts));
        for (Index e = 0; e < E; ++e) dot += c * f[e] * s[e] / sum;
        for (Index e = 0; e < E; ++e) g.dscores(t, e) += static_cast<float>((c * f[e] - dot) / sum);
      }
    });
  }

 private:
  template <class F>
  void for_each_sequence(BalanceInputs const& in, F&& fn) const {
    Index const T = in.selection.num_tokens, E = in.selection.num_experts;
    Index const L = seq_len > 0 ? seq_len : T;
    ::moe::detail::check(seq_len == 0 || T % seq_len == 0, "SeqAux: ", T,
                         " tokens are not a whole number ", "of sequences of seq_len = ", seq_len,
                         "; pass [batch * seq_len] tokens");
    if (T == 0) return;
    Index const B = T / L;
    Index const K = in.selection.slots;
    for (Index t0 = 0; t0 < T; t0 += L) {
      Index const t1 = t0 + L;
      Index Ts = 0;
      for (Index t = t0; t < t1; ++t) Ts += detail::real(in, t);
      if (Ts == 0) continue;
      std::vector<double> f(static_cast<std::size_t>(E), 0.0);
      for (Index t = t0; t < t1; ++t) {
        if (!detail::real(in, t)) continue;
        for (Index s = 0; s < K; ++s) {
          ExpertId const e = in.selection.expert[t * K + s];
          if (e >= 0)
            f[e] += static_cast<double>(E) / (static_cast<double>(K) * static_cast<double>(Ts));
        }
      }
      fn(t0, t1, Ts, f, B);
    }
  }
};

static_assert(BalancePolicy<SeqAux>);

}  // namespace moe::balance
