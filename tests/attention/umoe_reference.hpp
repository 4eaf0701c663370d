// SPDX-License-Identifier: Apache-2.0
// A double-precision twin of MoeAttention (UMoE pre-mixing attention, ALGORITHMS.md section 3)
// written token by token as the UMoE reference code reads: route, per-expert query, one shared
// key, softmax over the sequence with the hidden states as values, optional sigmoid gate, the
// expert FFN, weighted sum, shared experts.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "attention/attention_reference.hpp"
#include "support/double_model.hpp"

namespace aref {

struct DoubleUmoe {
  Index D = 0, E = 0, dk = 0, rk = 0, w = 0, batch = 1, rd = 0;
  bool residual = false, rope = false, causal = true;
  Index window = 0;  // sliding window (0: none)
  Vec sinks;         // [E + S] sink logits per expert head, empty: none
  double theta = 10000.0, scale = 1.0;
  std::function<ref::Routing(moe::ConstMatrixView<double>)> route;
  Vec router, q_a, q_b, q_res, k_proj, shared_q, gate_proj;
  ref::DoubleBank experts, shared;  // shared.E = number of shared experts
  Vec shared_gate;                  // [S, D], empty: ungated
  std::vector<std::uint8_t> key_mask;
  std::vector<Index> positions;

  static Vec matvec(double const* W, Index rows, Index cols, double const* x) {
    Vec y(static_cast<std::size_t>(rows), 0.0);
    for (Index r = 0; r < rows; ++r) {
      for (Index c = 0; c < cols; ++c) y[r] += W[r * cols + c] * x[c];
    }
    return y;
  }

  void rotate(Vec& v, Index pos) const {
    if (!rope) return;
    Index const half = rd / 2;
    Vec out = v;
    for (Index i = 0; i < rd; ++i) {
      Index const f = i % half;
      double const angle =
          static_cast<double>(pos) / std::pow(theta, static_cast<double>(2 * f) / rd);
      double const rot = i < half ? -v[i + half] : v[i - half];
      out[i] = v[i] * std::cos(angle) + rot * std::sin(angle);
    }
    v = out;
  }

  /// The mixed vector of query q of expert head h (E + s: shared s) for token t: softmax over its
  /// sequence's visible keys (and the head's sink).
  Vec mix(Vec const& q, std::vector<Vec> const& keys, Vec const& x, Index t, Index S,
          Index h) const {
    Index const b = t / S, ts = t % S;
    std::vector<double> s;
    std::vector<Index> idx;
    double m = -1e300;
    for (Index j = 0; j < S; ++j) {
      Index const src = b * S + j;
      if (causal && j > ts) continue;
      if (window > 0 && j <= ts - window) continue;
      if (!key_mask.empty() && !key_mask[src]) continue;
      double dot = 0.0;
      for (Index c = 0; c < dk; ++c) dot += q[c] * keys[src][c];
      s.push_back(dot * scale);
      idx.push_back(src);
      m = std::max(m, s.back());
    }
    Vec out(static_cast<std::size_t>(D), 0.0);
    if (s.empty()) return out;
    double sum = 0.0;
    if (!sinks.empty()) {  // one more term in the denominator, with a zero value
      double const z = sinks[static_cast<std::size_t>(h)];
      m = std::max(m, z);
      sum += std::exp(z - m);
    }
    for (double& v : s) sum += (v = std::exp(v - m));
    for (std::size_t i = 0; i < s.size(); ++i) {
      for (Index c = 0; c < D; ++c) out[c] += s[i] / sum * x[idx[i] * D + c];
    }
    return out;
  }

  void apply_gate(Vec& m, Index row, double const* xt) const {
    if (w == 0) return;
    Vec const g = matvec(gate_proj.data() + row * w * D, w, D, xt);
    for (Index c = 0; c < D; ++c) m[c] *= sigmoid(g[w == 1 ? 0 : c]);
  }

  Vec forward(Vec const& x, Index T) const {
    Index const S = T / batch;
    Vec z(static_cast<std::size_t>(T * E), 0.0);
    std::vector<Vec> keys(static_cast<std::size_t>(T));
    for (Index t = 0; t < T; ++t) {
      Vec const zt = matvec(router.data(), E, D, x.data() + t * D);
      std::copy(zt.begin(), zt.end(), z.begin() + t * E);
      keys[t] = matvec(k_proj.data(), dk, D, x.data() + t * D);
      rotate(keys[t], positions.empty() ? t % S : positions[t]);
    }
    ref::Routing const routing = route(moe::ConstMatrixView<double>(z.data(), T, E));
    Vec y(static_cast<std::size_t>(T * D), 0.0);
    for (Index t = 0; t < T; ++t) {
      double const* xt = x.data() + t * D;
      Index const pos = positions.empty() ? t % S : positions[t];
      for (auto [e, weight] : routing[t]) {
        Vec q;
        if (rk > 0) {
          Vec const u = matvec(q_a.data() + e * rk * D, rk, D, xt);
          q = matvec(q_b.data() + e * dk * rk, dk, rk, u.data());
        } else {
          q = matvec(q_a.data() + e * dk * D, dk, D, xt);
        }
        if (residual) {
          Vec const res = matvec(q_res.data(), dk, D, xt);
          for (Index c = 0; c < dk; ++c) q[c] += res[c];
        }
        rotate(q, pos);
        Vec m = mix(q, keys, x, t, S, e);
        apply_gate(m, e, xt);
        Vec const o = experts.run(e, m.data());
        for (Index c = 0; c < D; ++c) y[t * D + c] += weight * o[c];
      }
      for (Index s = 0; s < shared.E; ++s) {
        Vec q = matvec(shared_q.data() + s * dk * D, dk, D, xt);
        rotate(q, pos);
        Vec m = mix(q, keys, x, t, S, E + s);
        apply_gate(m, E + s, xt);
        Vec const o = shared.run(s, m.data());
        double g = 1.0;
        if (!shared_gate.empty()) {
          double a = 0.0;
          for (Index c = 0; c < D; ++c) a += shared_gate[s * D + c] * xt[c];
          g = sigmoid(a);
        }
        for (Index c = 0; c < D; ++c) y[t * D + c] += g * o[c];
      }
    }
    return y;
  }

  double objective(Vec const& x, Vec const& dy, Index T) const {
    Vec const y = forward(x, T);
    double s = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * dy[i];
    return s;
  }
};

}  // namespace aref
