// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// OrthogonalityLoss: push the outputs of a token's experts towards mutually orthogonal vectors.
#pragma once

#include <cmath>
#include <vector>

#include "moe/balance/detail.hpp"

namespace moe::balance {

/// Orthogonality loss of "Advancing Expert Specialization" (Guo et al., NeurIPS 2025; reference
/// MoEGate in HongcanGuo/Auxloss-For-Advancing-Expert-Specialization):
/// for each real token with outputs o_1..o_n of its routed experts (unweighted E_i(x_t)) and each
/// i, an orthonormal basis {u} of {o_j : j != i} by classical Gram-Schmidt
///   v = o_j - sum_{u so far} <u, o_j> u,   u = v / (|v| + 1e-6)
/// gives proj_i = sum_u |<u, o_i> u|^2, and
///   L = coef * sum_tokens sum_i proj_i / (K * G)   (K = router slots, G = tokens with rows).
/// k mutually orthogonal outputs give 0; two equal outputs v give |v|^2 rho^4,
/// rho = |v| / (|v| + 1e-6). The gradient flows into the expert outputs (and through them into
/// the experts) by reverse-mode differentiation of the Gram-Schmidt steps; the router gets none.
/// The reference groups k consecutive rows of its expert-sorted buffer (a quirk noted in
/// ALGORITHMS.md 4.6); this policy uses the intended grouping, one token's experts.
struct OrthogonalityLoss {
  double coef = 1e-4;
  /// Throws moe::Error unless coef is in [0, detail::kMaxCoefficient].
  void validate() const { detail::check_coefficient("OrthogonalityLoss", "coef", coef); }
  static constexpr double kEps = 1e-6;

  double aux_loss(BalanceInputs const& in) const {
    double total = 0.0;
    Index groups = 0;
    for_each_group(in, [&](std::vector<Index> const& rows) {
      ++groups;
      for (std::size_t i = 0; i < rows.size(); ++i) total += projection(in, rows, i, nullptr, 0.0);
    });
    return groups == 0
               ? 0.0
               : coef * total /
                     (static_cast<double>(in.selection.slots) * static_cast<double>(groups));
  }

  void backward(BalanceInputs const& in, BalanceGradients& g) const {
    Index groups = 0;
    for_each_group(in, [&](std::vector<Index> const&) { ++groups; });
    if (groups == 0) return;
    double const scale =
        coef / (static_cast<double>(in.selection.slots) * static_cast<double>(groups));
    for_each_group(in, [&](std::vector<Index> const& rows) {
      for (std::size_t i = 0; i < rows.size(); ++i) projection(in, rows, i, &g, scale);
    });
  }

 private:
  template <class F>
  static void for_each_group(BalanceInputs const& in, F&& fn) {
    std::vector<Index> rows;
    for (Index t = 0; t < in.plan.num_tokens; ++t) {
      if (!detail::real(in, t) || in.plan.token_count(t) == 0) continue;
      rows.assign(in.plan.token_rows.begin() + in.plan.token_offsets[t],
                  in.plan.token_rows.begin() + in.plan.token_offsets[t + 1]);
      fn(rows);
    }
  }

  /// proj_i for the group `rows`; with g, also adds scale * dproj_i/do to g->dexpert_out.
  static double projection(BalanceInputs const& in, std::vector<Index> const& rows, std::size_t i,
                           BalanceGradients* g, double scale) {
    Index const D = in.expert_out.cols;
    auto o = [&](std::size_t j) { return in.expert_out.row(rows[j]); };
    auto dot = [&](std::vector<double> const& a, float const* b) {
      double s = 0.0;
      for (Index c = 0; c < D; ++c) s += a[c] * b[c];
      return s;
    };
    std::vector<std::size_t> src;  // the j != i, in order
    for (std::size_t j = 0; j < rows.size(); ++j) {
      if (j != i) src.push_back(j);
    }
    std::size_t const m = src.size();
    std::vector<std::vector<double>> v(m, std::vector<double>(static_cast<std::size_t>(D)));
    std::vector<std::vector<double>> u = v;
    std::vector<std::vector<double>> coeff(m, std::vector<double>(m, 0.0));
    std::vector<double> norm(m), d(m), usq(m);
    double proj = 0.0;
    for (std::size_t a = 0; a < m; ++a) {
      float const* oj = o(src[a]);
      for (Index c = 0; c < D; ++c) v[a][c] = oj[c];
      for (std::size_t b = 0; b < a; ++b) {
        coeff[a][b] = dot(u[b], oj);
        for (Index c = 0; c < D; ++c) v[a][c] -= coeff[a][b] * u[b][c];
      }
      double n2 = 0.0;
      for (Index c = 0; c < D; ++c) n2 += v[a][c] * v[a][c];
      norm[a] = std::sqrt(n2);
      usq[a] = 0.0;
      for (Index c = 0; c < D; ++c) {
        u[a][c] = v[a][c] / (norm[a] + kEps);
        usq[a] += u[a][c] * u[a][c];
      }
      d[a] = dot(u[a], o(i));
      proj += d[a] * d[a] * usq[a];
    }
    if (!g) return proj;
    // Reverse mode.
    std::vector<std::vector<double>> gu(m, std::vector<double>(static_cast<std::size_t>(D), 0.0));
    std::vector<std::vector<double>> go(rows.size(),
                                        std::vector<double>(static_cast<std::size_t>(D), 0.0));
    float const* oi = o(i);
    for (std::size_t a = 0; a < m; ++a) {
      for (Index c = 0; c < D; ++c) {
        gu[a][c] += 2.0 * d[a] * usq[a] * oi[c] + 2.0 * d[a] * d[a] * u[a][c];
        go[i][c] += 2.0 * d[a] * usq[a] * u[a][c];
      }
    }
    for (std::size_t a = m; a-- > 0;) {
      double const den = norm[a] + kEps;
      std::vector<double> gv(static_cast<std::size_t>(D));
      double gdotv = 0.0;
      for (Index c = 0; c < D; ++c) gdotv += gu[a][c] * v[a][c];
      for (Index c = 0; c < D; ++c) {
        gv[c] = gu[a][c] / den - (norm[a] > 0.0 ? gdotv / (den * den) * v[a][c] / norm[a] : 0.0);
      }
      float const* oj = o(src[a]);
      for (Index c = 0; c < D; ++c) go[src[a]][c] += gv[c];
      for (std::size_t b = 0; b < a; ++b) {
        double gc = 0.0;  // dL/dcoeff[a][b] = -<gv, u_b>
        for (Index c = 0; c < D; ++c) gc -= gv[c] * u[b][c];
        for (Index c = 0; c < D; ++c) {
          gu[b][c] += -coeff[a][b] * gv[c] + gc * oj[c];
          go[src[a]][c] += gc * u[b][c];
        }
      }
    }
    for (std::size_t j = 0; j < rows.size(); ++j) {
      float* dst = g->dexpert_out.row(rows[j]);
      for (Index c = 0; c < D; ++c) dst[c] += static_cast<float>(scale * go[j][c]);
    }
    return proj;
  }
};

static_assert(BalancePolicy<OrthogonalityLoss>);

}  // namespace moe::balance
