// SPDX-License-Identifier: Apache-2.0
// The attention oracle: naive double-precision softmax(Q K^T * scale + mask) V with the full
// score matrix, and its backward, written from the formulas (ALGORITHMS.md sections 0 and 2)
// and sharing no code with moe's kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moe/core/types.hpp"

namespace aref {

using moe::Index;
using Vec = std::vector<double>;

/// One head: q [Tq, d], k [Tk, d], v [Tk, dv], all dense row-major.
struct Sdpa {
  Index Tq = 0, Tk = 0, d = 0, dv = 0;
  double scale = 1.0;
  bool causal = false;
  Index causal_offset = 0;
  std::vector<Index> q_pos;            // empty: i + causal_offset
  std::vector<std::uint8_t> key_mask;  // empty: all keys
  Index window = 0;                    // keys j > pos - window; 0: all
  Index chunk = 0;  // keys of the query's chunk: j >= chunk floor(pos / chunk); 0: all
  double sink = -std::numeric_limits<double>::infinity();  // extra denominator term exp(sink)

  bool visible(Index i, Index j) const {
    Index const pos = q_pos.empty() ? i + causal_offset : q_pos[i];
    if (causal && j > pos) return false;
    if (window > 0 && j <= pos - window) return false;
    if (chunk > 0 && j / chunk != pos / chunk) return false;
    return key_mask.empty() || key_mask[j] != 0;
  }

  /// P [Tq, Tk] (rows with no visible key are all 0). With a sink the row sums to
  /// 1 - sink_probability(i).
  Vec probabilities(Vec const& q, Vec const& k, Vec* sink_p = nullptr) const {
    Vec p(static_cast<std::size_t>(Tq * Tk), 0.0);
    if (sink_p) sink_p->assign(static_cast<std::size_t>(Tq), 0.0);
    for (Index i = 0; i < Tq; ++i) {
      double m = sink;
      for (Index j = 0; j < Tk; ++j) {
        if (!visible(i, j)) continue;
        double s = 0.0;
        for (Index c = 0; c < d; ++c) s += q[i * d + c] * k[j * d + c];
        p[i * Tk + j] = s * scale;
        m = std::max(m, s * scale);
      }
      bool const has_sink = sink > -std::numeric_limits<double>::infinity();
      double sum = has_sink ? std::exp(sink - m) : 0.0;
      for (Index j = 0; j < Tk; ++j) {
        if (!visible(i, j)) continue;
        p[i * Tk + j] = std::exp(p[i * Tk + j] - m);
        sum += p[i * Tk + j];
      }
      for (Index j = 0; j < Tk; ++j) p[i * Tk + j] = visible(i, j) ? p[i * Tk + j] / sum : 0.0;
      if (sink_p && has_sink) (*sink_p)[i] = std::exp(sink - m) / sum;
    }
    return p;
  }

  Vec forward(Vec const& q, Vec const& k, Vec const& v) const {
    Vec p = probabilities(q, k);
    Vec o(static_cast<std::size_t>(Tq * dv), 0.0);
    for (Index i = 0; i < Tq; ++i) {
      for (Index j = 0; j < Tk; ++j) {
        for (Index c = 0; c < dv; ++c) o[i * dv + c] += p[i * Tk + j] * v[j * dv + c];
      }
    }
    return o;
  }

  /// dq, dk, dv (and, with a sink, *dsink) of sum(o * dout).
  void backward(Vec const& q, Vec const& k, Vec const& v, Vec const& dout, Vec& dq, Vec& dk,
                Vec& dvv, double* dsink = nullptr) const {
    Vec ps;
    Vec p = probabilities(q, k, &ps);
    if (dsink) *dsink = 0.0;
    dq.assign(static_cast<std::size_t>(Tq * d), 0.0);
    dk.assign(static_cast<std::size_t>(Tk * d), 0.0);
    dvv.assign(static_cast<std::size_t>(Tk * dv), 0.0);
    for (Index i = 0; i < Tq; ++i) {
      Vec dp(static_cast<std::size_t>(Tk), 0.0);
      double dot = 0.0;
      for (Index j = 0; j < Tk; ++j) {
        for (Index c = 0; c < dv; ++c) dp[j] += dout[i * dv + c] * v[j * dv + c];
        dot += p[i * Tk + j] * dp[j];
      }
      if (dsink) *dsink -= ps[i] * dot;  // the sink's value is 0: dS = P_sink (0 - dot)
      for (Index j = 0; j < Tk; ++j) {
        double const ds = p[i * Tk + j] * (dp[j] - dot) * scale;
        for (Index c = 0; c < d; ++c) {
          dq[i * d + c] += ds * k[j * d + c];
          dk[j * d + c] += ds * q[i * d + c];
        }
        for (Index c = 0; c < dv; ++c) dvv[j * dv + c] += p[i * Tk + j] * dout[i * dv + c];
      }
    }
  }
};

inline double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

/// max |a - b| / max(1, max |b|) over n elements.
template <class A>
double rel_err(A const* a, Vec const& b) {
  double scale = 1.0, diff = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::fabs(b[i]));
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return diff / scale;
}

}  // namespace aref
