// SPDX-License-Identifier: Apache-2.0
// The test oracle: a naive MoE in double precision, written from ALGORITHMS.md sections 5 and 6
// and sharing no code with the library's kernels or routing policies (only its weight views).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "moe/core/views.hpp"
#include "moe/kernels/activations.hpp"
#include "moe/kernels/gemm_bf16.hpp"

namespace ref {

using moe::Index;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// One token's routing: (expert, weight) pairs in slot order.
using TokenChoice = std::vector<std::pair<int, double>>;
using Routing = std::vector<TokenChoice>;

template <class V>
std::vector<double> row(moe::ConstMatrixView<V> m, Index t) {
  return std::vector<double>(m.row(t), m.row(t) + m.cols);
}

inline std::vector<double> softmax(std::vector<double> const& z) {
  double m = kNegInf;
  for (double v : z) m = std::max(m, v);
  std::vector<double> p(z.size());
  double s = 0.0;
  for (std::size_t i = 0; i < z.size(); ++i) s += (p[i] = std::exp(z[i] - m));
  for (double& v : p) v /= s;
  return p;
}

inline double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

/// Indices sorted by descending key, ties by ascending index; -inf keys dropped.
inline std::vector<int> order_desc(std::vector<double> const& key) {
  std::vector<int> idx;
  for (std::size_t i = 0; i < key.size(); ++i) {
    if (key[i] != kNegInf) idx.push_back(static_cast<int>(i));
  }
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key[a] > key[b]; });
  return idx;
}

/// Keeps the first n entries (erase, not resize: GCC 12 -O3 reports a false -Warray-bounds on
/// the resize path here).
inline void truncate(std::vector<int>& v, Index n) {
  if (static_cast<Index>(v.size()) > n) v.erase(v.begin() + n, v.end());
}

/// Softmax over all, top-k, optional renormalisation, scale (Qwen / OLMoE; Mixtral with renorm).
template <class V>
Routing softmax_top_k(moe::ConstMatrixView<V> logits, int k, bool normalize, double scale) {
  Routing out;
  for (Index t = 0; t < logits.rows; ++t) {
    auto z = row(logits, t);
    auto p = softmax(z);
    auto idx = order_desc(z);
    truncate(idx, k);
    double sum = 0.0;
    for (int e : idx) sum += p[e];
    TokenChoice c;
    for (int e : idx) c.emplace_back(e, (normalize ? p[e] / sum : p[e]) * scale);
    out.push_back(c);
  }
  return out;
}

/// DeepSeek-V3 official Gate: sigmoid (or softmax), bias for selection, top-2-sum (or max) group
/// scores, -inf masking of the groups not kept, weights from unbiased scores, renormalised by
/// max(sum + eps, norm_min).
template <class V>
Routing group_limited(moe::ConstMatrixView<V> logits, int k, int n_group, int topk_group,
                      bool normalize, double scale, bool sigmoid_scores,
                      std::vector<float> const& bias, bool top_two_sum, double eps = 1e-20,
                      double norm_min = 0.0) {
  Routing out;
  Index const E = logits.cols;
  Index const gs = E / n_group;
  for (Index t = 0; t < logits.rows; ++t) {
    auto z = row(logits, t);
    std::vector<double> s(z.size());
    if (sigmoid_scores) {
      for (std::size_t e = 0; e < z.size(); ++e) s[e] = sigmoid(z[e]);
    } else {
      s = softmax(z);
    }
    std::vector<double> key(s);
    for (std::size_t e = 0; e < key.size(); ++e) {
      if (!bias.empty()) key[e] += bias[e];
      if (z[e] == kNegInf) key[e] = kNegInf;
    }
    std::vector<double> gscore(static_cast<std::size_t>(n_group));
    for (int g = 0; g < n_group; ++g) {
      std::vector<double> v(key.begin() + g * gs, key.begin() + (g + 1) * gs);
      std::sort(v.begin(), v.end(), std::greater<>());
      gscore[g] = (top_two_sum && v.size() > 1 && v[1] != kNegInf) ? v[0] + v[1] : v[0];
    }
    auto gorder = order_desc(gscore);
    truncate(gorder, topk_group);
    for (int g = 0; g < n_group; ++g) {
      if (std::find(gorder.begin(), gorder.end(), g) == gorder.end()) {
        for (Index e = g * gs; e < (g + 1) * gs; ++e) key[e] = kNegInf;
      }
    }
    auto idx = order_desc(key);
    truncate(idx, k);
    double sum = 0.0;
    for (int e : idx) sum += s[e];
    TokenChoice c;
    double const denom = std::max(sum + eps, norm_min);
    for (int e : idx) c.emplace_back(e, (normalize ? s[e] / denom : s[e]) * scale);
    out.push_back(c);
  }
  return out;
}

/// Expert choice: each expert takes its C best tokens by softmax probability.
template <class V>
Routing expert_choice(moe::ConstMatrixView<V> logits, Index capacity) {
  Index const T = logits.rows, E = logits.cols;
  std::vector<std::vector<double>> p;
  for (Index t = 0; t < T; ++t) p.push_back(softmax(row(logits, t)));
  Routing out(static_cast<std::size_t>(T));
  for (Index e = 0; e < E; ++e) {
    std::vector<double> col;
    for (Index t = 0; t < T; ++t) col.push_back(logits(t, e) == -INFINITY ? kNegInf : p[t][e]);
    auto idx = order_desc(col);
    truncate(idx, capacity);
    for (int t : idx) out[t].emplace_back(static_cast<int>(e), p[t][e]);
  }
  for (auto& c : out) std::sort(c.begin(), c.end());  // ascending expert order
  return out;
}

/// Top-p: sorted probabilities until the cumulative sum passes the threshold.
template <class V>
Routing top_p(moe::ConstMatrixView<V> logits, double threshold) {
  Routing out;
  for (Index t = 0; t < logits.rows; ++t) {
    auto z = row(logits, t);
    auto p = softmax(z);
    TokenChoice c;
    double cum = 0.0;
    for (int e : order_desc(z)) {
      c.emplace_back(e, p[e]);
      cum += p[e];
      if (cum > threshold) break;
    }
    out.push_back(c);
  }
  return out;
}

/// Applies a capacity C to a token-choice routing: slot-major priority, token order (or by
/// descending slot-0 weight); dropped slots are removed.
inline Routing with_capacity(Routing r, Index num_experts, Index capacity, bool prioritized,
                             Index* dropped) {
  std::vector<int> order(r.size());
  std::iota(order.begin(), order.end(), 0);
  if (prioritized) {
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      double wa = r[a].empty() ? 0.0 : r[a][0].second, wb = r[b].empty() ? 0.0 : r[b][0].second;
      return wa > wb;
    });
  }
  std::vector<Index> fill(static_cast<std::size_t>(num_experts), 0);
  std::vector<std::vector<bool>> keep(r.size());
  std::size_t max_slots = 0;
  for (std::size_t t = 0; t < r.size(); ++t) {
    keep[t].assign(r[t].size(), false);
    max_slots = std::max(max_slots, r[t].size());
  }
  *dropped = 0;
  for (std::size_t s = 0; s < max_slots; ++s) {
    for (int t : order) {
      if (s >= r[t].size()) continue;
      int const e = r[t][s].first;
      if (fill[e] < capacity) {
        ++fill[e];
        keep[t][s] = true;
      } else {
        ++*dropped;
      }
    }
  }
  for (std::size_t t = 0; t < r.size(); ++t) {
    TokenChoice c;
    for (std::size_t s = 0; s < r[t].size(); ++s) {
      if (keep[t][s]) c.push_back(r[t][s]);
    }
    r[t] = c;
  }
  return r;
}

/// At most one expert per group: each group's best expert, then the k best winners.
template <class V>
Routing one_per_group(moe::ConstMatrixView<V> logits, int k, int n_group, bool normalize) {
  Routing out;
  Index const gs = logits.cols / n_group;
  for (Index t = 0; t < logits.rows; ++t) {
    auto z = row(logits, t);
    auto p = softmax(z);
    std::vector<int> winners;
    for (int g = 0; g < n_group; ++g) {
      std::vector<double> v(z.begin() + g * gs, z.begin() + (g + 1) * gs);
      auto o = order_desc(v);
      if (!o.empty()) winners.push_back(static_cast<int>(g * gs) + o[0]);
    }
    std::vector<double> wz;
    for (int e : winners) wz.push_back(z[e]);
    auto o = order_desc(wz);
    truncate(o, k);
    double sum = 0.0;
    for (int i : o) sum += p[winners[i]];
    TokenChoice c;
    for (int i : o) c.emplace_back(winners[i], normalize ? p[winners[i]] / sum : p[winners[i]]);
    out.push_back(c);
  }
  return out;
}

/// Activations in double (ALGORITHMS.md section 6).
inline double activate(moe::kernels::Activation a, double x) {
  using moe::kernels::Activation;
  switch (a) {
    case Activation::kSilu:
      return x * sigmoid(x);
    case Activation::kGeluErf:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::kGeluTanh: {
      double const c = std::sqrt(2.0 / M_PI);
      return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
    }
    case Activation::kRelu:
      return x > 0.0 ? x : 0.0;
  }
  return 0.0;
}

/// v rounded to bf16 (nearest even) and back.
inline double bf16_round(double v) {
  return moe::kernels::bf16_to_float(moe::kernels::float_to_bf16(static_cast<float>(v)));
}

/// What a bf16 forward rounds to bf16 before multiplying: the weights (bf16 panels), and with
/// AVX512-BF16 dot products also the projections' inputs (x, and m before the down projection).
struct Bf16Rounding {
  bool weights = false;
  bool activations = false;
};

/// One expert in double: W_down (act(W_gate x) * W_up x) or W_down act(W_up x).
/// gate may be an empty view (plain MLP). `bf16`: operands rounded as a bf16 forward rounds them.
inline std::vector<double> expert(moe::ConstMatrixView<float> gate, moe::ConstMatrixView<float> up,
                                  moe::ConstMatrixView<float> down, moe::kernels::Activation a,
                                  float const* x, Bf16Rounding bf16 = {}) {
  Index const F = up.rows, D = up.cols;
  auto w = [&](float v) { return bf16.weights ? bf16_round(v) : static_cast<double>(v); };
  auto in = [&](double v) { return bf16.activations ? bf16_round(v) : v; };
  std::vector<double> h(static_cast<std::size_t>(F));
  for (Index f = 0; f < F; ++f) {
    double u = 0.0, g = 0.0;
    for (Index d = 0; d < D; ++d) {
      u += w(up(f, d)) * in(x[d]);
      if (gate.rows > 0) g += w(gate(f, d)) * in(x[d]);
    }
    h[f] = in(gate.rows > 0 ? activate(a, g) * u : activate(a, u));
  }
  std::vector<double> y(static_cast<std::size_t>(D), 0.0);
  for (Index d = 0; d < D; ++d) {
    for (Index f = 0; f < F; ++f) y[d] += w(down(d, f)) * h[f];
  }
  return y;
}

/// Router logits in double: z = x W_r^T, rounded to float (the input routers see).
inline std::vector<float> logits(moe::ConstMatrixView<float> x, moe::ConstMatrixView<float> wr) {
  std::vector<float> z(static_cast<std::size_t>(x.rows * wr.rows));
  for (Index t = 0; t < x.rows; ++t) {
    for (Index e = 0; e < wr.rows; ++e) {
      double s = 0.0;
      for (Index d = 0; d < x.cols; ++d) s += static_cast<double>(x(t, d)) * wr(e, d);
      z[t * wr.rows + e] = static_cast<float>(s);
    }
  }
  return z;
}

}  // namespace ref
