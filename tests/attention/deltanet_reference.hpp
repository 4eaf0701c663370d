// SPDX-License-Identifier: Apache-2.0
// A double-precision scalar transcription of transformers' Qwen3NextGatedDeltaNet /
// Qwen3_5GatedDeltaNet (modeling_qwen3_next.py, modular_qwen3_5.py) for forward checks and
// central finite differences: fix_query_key_value_ordering as view + split, F.conv1d with
// padding kernel - 1, l2norm, torch_chunk_gated_delta_rule (padded chunks, dense masked
// matrices, the row-by-row loop) and torch_recurrent_gated_delta_rule, Qwen3NextRMSNormGated,
// and the cache path (torch_causal_conv1d_update with a conv_state of `kernel` columns).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "moe/core/types.hpp"

namespace dnref {

using moe::Index;
using Vec = std::vector<double>;

struct DeltaNet {
  Index D = 0, Hk = 1, Hv = 1, dk = 0, dv = 0, kernel = 4, chunk = 64;
  double eps = 1e-6;
  bool qwen35 = false;  // in_proj_qkv / z / b / a instead of in_proj_qkvz / ba
  Vec in_proj_qkvz{}, in_proj_ba{}, in_proj_qkv{}, in_proj_z{}, in_proj_b{}, in_proj_a{};
  Vec conv1d{}, A_log{}, dt_bias{}, norm{}, out_proj{};

  Index key_dim() const { return Hk * dk; }
  Index value_dim() const { return Hv * dv; }
  Index conv_dim() const { return 2 * key_dim() + value_dim(); }

  /// What a Qwen3NextDynamicCache keeps for this layer.
  struct Cache {
    Vec conv;       // [C, kernel] (conv_states)
    Vec recurrent;  // [Hv, dk, dv]
    bool has_previous_state = false;
  };

  static Vec linear(Vec const& W, Index rows, Index cols, double const* x) {
    Vec y(static_cast<std::size_t>(rows), 0.0);
    for (Index r = 0; r < rows; ++r) {
      for (Index c = 0; c < cols; ++c) y[r] += W[r * cols + c] * x[c];
    }
    return y;
  }
  static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
  static double silu(double x) { return x * sigmoid(x); }
  static double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
  static void l2norm(double* x, Index n) {
    double ss = 0.0;
    for (Index i = 0; i < n; ++i) ss += x[i] * x[i];
    double const r = 1.0 / std::sqrt(ss + 1e-6);
    for (Index i = 0; i < n; ++i) x[i] *= r;
  }

  /// Per token: mixed_qkv [C] (q | k | v, heads in order), z [Hv dv], b [Hv], a [Hv].
  struct Projected {
    Vec qkv, z, b, a;
  };
  Projected project(double const* x) const {
    Index const K = key_dim(), V = value_dim(), R = Hv / Hk;
    Projected p;
    if (qwen35) {
      p.qkv = linear(in_proj_qkv, 2 * K + V, D, x);
      p.z = linear(in_proj_z, V, D, x);
      p.b = linear(in_proj_b, Hv, D, x);
      p.a = linear(in_proj_a, Hv, D, x);
      return p;
    }
    Vec const qkvz = linear(in_proj_qkvz, 2 * K + 2 * V, D, x);
    Vec const ba = linear(in_proj_ba, 2 * Hv, D, x);
    // view(..., Hk, 2 dk + 2 R dv), split [dk, dk, R dv, R dv]; view(..., Hk, 2R), split [R, R];
    // then v, z reshaped to [Hv, dv] and b, a to [Hv] (group-major).
    Index const W = 2 * dk + 2 * R * dv;
    p.qkv.assign(static_cast<std::size_t>(2 * K + V), 0.0);
    p.z.assign(static_cast<std::size_t>(V), 0.0);
    p.b.assign(static_cast<std::size_t>(Hv), 0.0);
    p.a.assign(static_cast<std::size_t>(Hv), 0.0);
    for (Index g = 0; g < Hk; ++g) {
      double const* grp = qkvz.data() + g * W;
      std::copy(grp, grp + dk, p.qkv.begin() + g * dk);                                    // query
      std::copy(grp + dk, grp + 2 * dk, p.qkv.begin() + K + g * dk);                       // key
      std::copy(grp + 2 * dk, grp + 2 * dk + R * dv, p.qkv.begin() + 2 * K + g * R * dv);  // value
      std::copy(grp + 2 * dk + R * dv, grp + W, p.z.begin() + g * R * dv);                 // z
      double const* bag = ba.data() + g * 2 * R;
      std::copy(bag, bag + R, p.b.begin() + g * R);
      std::copy(bag + R, bag + 2 * R, p.a.begin() + g * R);
    }
    return p;
  }

  /// torch_recurrent_gated_delta_rule for one head, S [dk, dv] in/out; q, k normalised.
  void recurrent_head(Vec const& q, Vec const& k, Vec const& v, Vec const& g, Vec const& beta,
                      Index T, Index h, double* S, Vec& out) const {
    Index const R = Hv / Hk, kh = h / R, K = key_dim(), V = value_dim();
    double const scale = 1.0 / std::sqrt(static_cast<double>(dk));
    for (Index t = 0; t < T; ++t) {
      double const* qt = q.data() + t * K + kh * dk;
      double const* kt = k.data() + t * K + kh * dk;
      double const* vt = v.data() + t * V + h * dv;
      double const gt = std::exp(g[t * Hv + h]), bt = beta[t * Hv + h];
      for (Index i = 0; i < dk * dv; ++i) S[i] *= gt;
      Vec kv_mem(static_cast<std::size_t>(dv), 0.0);
      for (Index i = 0; i < dk; ++i) {
        for (Index j = 0; j < dv; ++j) kv_mem[j] += S[i * dv + j] * kt[i];
      }
      for (Index i = 0; i < dk; ++i) {
        for (Index j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * (vt[j] - kv_mem[j]) * bt;
      }
      for (Index j = 0; j < dv; ++j) {
        double o = 0.0;
        for (Index i = 0; i < dk; ++i) o += S[i * dv + j] * qt[i] * scale;
        out[t * V + h * dv + j] = o;
      }
    }
  }

  /// torch_chunk_gated_delta_rule for one head from a zero state (initial_state = None); the
  /// final state into S.
  void chunk_head(Vec const& q, Vec const& k, Vec const& v, Vec const& g, Vec const& beta, Index T,
                  Index h, double* S, Vec& out) const {
    Index const R = Hv / Hk, kh = h / R, K = key_dim(), V = value_dim(), C = chunk;
    Index const pad = (C - T % C) % C, TT = T + pad, N = TT / C;
    double const scale = 1.0 / std::sqrt(static_cast<double>(dk));
    // Padded per-head copies: qh, kh_, vh [TT, d], gh, bh [TT].
    Vec qh(static_cast<std::size_t>(TT * dk), 0.0), kk(qh),
        vh(static_cast<std::size_t>(TT * dv), 0.0);
    Vec gh(static_cast<std::size_t>(TT), 0.0), bh(gh);
    for (Index t = 0; t < T; ++t) {
      for (Index i = 0; i < dk; ++i) {
        qh[t * dk + i] = q[t * K + kh * dk + i] * scale;
        kk[t * dk + i] = k[t * K + kh * dk + i];
      }
      for (Index j = 0; j < dv; ++j) vh[t * dv + j] = v[t * V + h * dv + j];
      gh[t] = g[t * Hv + h];
      bh[t] = beta[t * Hv + h];
    }
    std::fill(S, S + dk * dv, 0.0);
    for (Index n = 0; n < N; ++n) {
      Index const o = n * C;
      Vec gc(static_cast<std::size_t>(C));
      double acc = 0.0;
      for (Index i = 0; i < C; ++i) gc[i] = acc += gh[o + i];
      auto decay = [&](Index i, Index j) { return i >= j ? std::exp(gc[i] - gc[j]) : 0.0; };
      // attn = -((k_beta @ key^T) * decay_mask).masked_fill(triu(diagonal 0), 0)
      Vec attn(static_cast<std::size_t>(C * C), 0.0);
      for (Index i = 0; i < C; ++i) {
        for (Index j = 0; j < i; ++j) {
          double kb = 0.0;
          for (Index a = 0; a < dk; ++a)
            kb += kk[(o + i) * dk + a] * bh[o + i] * kk[(o + j) * dk + a];
          attn[i * C + j] = -kb * decay(i, j);
        }
      }
      for (Index i = 1; i < C; ++i) {
        Vec const row(attn.begin() + i * C, attn.begin() + i * C + i);
        Vec sub(static_cast<std::size_t>(i * i));
        for (Index m = 0; m < i; ++m) {
          for (Index j = 0; j < i; ++j) sub[m * i + j] = attn[m * C + j];
        }
        for (Index j = 0; j < i; ++j) {
          double s = 0.0;
          for (Index m = 0; m < i; ++m) s += row[m] * sub[m * i + j];
          attn[i * C + j] = row[j] + s;
        }
      }
      for (Index i = 0; i < C; ++i) attn[i * C + i] += 1.0;
      // value = attn @ v_beta; k_cumdecay = attn @ (k_beta * g.exp())
      Vec value(static_cast<std::size_t>(C * dv), 0.0), kcd(static_cast<std::size_t>(C * dk), 0.0);
      for (Index i = 0; i < C; ++i) {
        for (Index j = 0; j < C; ++j) {
          double const aij = attn[i * C + j];
          for (Index b = 0; b < dv; ++b)
            value[i * dv + b] += aij * vh[(o + j) * dv + b] * bh[o + j];
          for (Index a = 0; a < dk; ++a) {
            kcd[i * dk + a] += aij * kk[(o + j) * dk + a] * bh[o + j] * std::exp(gc[j]);
          }
        }
      }
      // attn2 = (q @ k^T * decay_mask).masked_fill(triu(diagonal 1), 0)
      Vec vnew(static_cast<std::size_t>(C * dv));
      for (Index i = 0; i < C; ++i) {
        for (Index b = 0; b < dv; ++b) {
          double vp = 0.0;
          for (Index a = 0; a < dk; ++a) vp += kcd[i * dk + a] * S[a * dv + b];
          vnew[i * dv + b] = value[i * dv + b] - vp;
        }
      }
      for (Index i = 0; i < C; ++i) {
        if (o + i >= T) break;
        for (Index b = 0; b < dv; ++b) {
          double inter = 0.0;
          for (Index a = 0; a < dk; ++a)
            inter += qh[(o + i) * dk + a] * std::exp(gc[i]) * S[a * dv + b];
          double intra = 0.0;
          for (Index j = 0; j <= i; ++j) {
            double qk = 0.0;
            for (Index a = 0; a < dk; ++a) qk += qh[(o + i) * dk + a] * kk[(o + j) * dk + a];
            intra += qk * decay(i, j) * vnew[j * dv + b];
          }
          out[(o + i) * V + h * dv + b] = inter + intra;
        }
      }
      double const last = gc[C - 1];
      Vec Snew(static_cast<std::size_t>(dk * dv));
      for (Index a = 0; a < dk; ++a) {
        for (Index b = 0; b < dv; ++b) {
          double s = S[a * dv + b] * std::exp(last);
          for (Index j = 0; j < C; ++j)
            s += kk[(o + j) * dk + a] * std::exp(last - gc[j]) * vnew[j * dv + b];
          Snew[a * dv + b] = s;
        }
      }
      std::copy(Snew.begin(), Snew.end(), S);
    }
  }

  /// The layer's forward over T tokens of one sequence (x, y [T, D]), as Qwen3NextGatedDeltaNet
  /// .forward runs it: without a cache or on a prompt, the chunked rule from the zero state
  /// (`recurrent` forces the recurrent rule there); with a cache holding a previous state and
  /// T == 1, the conv update and the recurrent rule from the cached state. The cache is filled.
  Vec forward(Vec const& x, Index T, Cache* cache = nullptr, bool recurrent = false) const {
    Index const K = key_dim(), V = value_dim(), C = conv_dim();
    bool const step = cache && cache->has_previous_state && T == 1;
    Vec mixed(static_cast<std::size_t>(T * C)), z(static_cast<std::size_t>(T * V));
    Vec b(static_cast<std::size_t>(T * Hv)), a(b);
    for (Index t = 0; t < T; ++t) {
      Projected const p = project(x.data() + t * D);
      std::copy(p.qkv.begin(), p.qkv.end(), mixed.begin() + t * C);
      std::copy(p.z.begin(), p.z.end(), z.begin() + t * V);
      std::copy(p.b.begin(), p.b.end(), b.begin() + t * Hv);
      std::copy(p.a.begin(), p.a.end(), a.begin() + t * Hv);
    }
    Vec conv(static_cast<std::size_t>(T * C));
    if (step) {  // torch_causal_conv1d_update: cat(state, x) -> conv, keep the last `kernel`
      Vec& st = cache->conv;
      for (Index c = 0; c < C; ++c) {
        Vec seq(st.begin() + c * kernel, st.begin() + (c + 1) * kernel);
        seq.push_back(mixed[c]);
        double acc = 0.0;  // the last output of the valid convolution over kernel + 1 inputs
        for (Index j = 0; j < kernel; ++j) acc += conv1d[c * kernel + j] * seq[1 + j];
        conv[c] = silu(acc);
        std::copy(seq.end() - kernel, seq.end(), st.begin() + c * kernel);
      }
    } else {
      if (cache) {  // F.pad(mixed_qkv, (kernel - T, 0)): the last `kernel` inputs, zeros before
        cache->conv.assign(static_cast<std::size_t>(C * kernel), 0.0);
        for (Index c = 0; c < C; ++c) {
          for (Index j = 0; j < kernel; ++j) {
            Index const t = T - kernel + j;
            if (t >= 0) cache->conv[c * kernel + j] = mixed[t * C + c];
          }
        }
      }
      for (Index t = 0; t < T; ++t) {  // F.conv1d(padding = kernel - 1)[..., :T]
        for (Index c = 0; c < C; ++c) {
          double acc = 0.0;
          for (Index j = 0; j < kernel; ++j) {
            Index const src = t + j - (kernel - 1);
            if (src >= 0) acc += conv1d[c * kernel + j] * mixed[src * C + c];
          }
          conv[t * C + c] = silu(acc);
        }
      }
    }
    Vec q(static_cast<std::size_t>(T * K)), k(q), v(static_cast<std::size_t>(T * V));
    Vec beta(static_cast<std::size_t>(T * Hv)), g(beta);
    for (Index t = 0; t < T; ++t) {
      double const* m = conv.data() + t * C;
      std::copy(m, m + K, q.begin() + t * K);
      std::copy(m + K, m + 2 * K, k.begin() + t * K);
      std::copy(m + 2 * K, m + C, v.begin() + t * V);
      for (Index h = 0; h < Hk; ++h) {  // use_qk_l2norm_in_kernel
        l2norm(q.data() + t * K + h * dk, dk);
        l2norm(k.data() + t * K + h * dk, dk);
      }
      for (Index h = 0; h < Hv; ++h) {
        beta[t * Hv + h] = sigmoid(b[t * Hv + h]);
        g[t * Hv + h] = -std::exp(A_log[h]) * softplus(a[t * Hv + h] + dt_bias[h]);
      }
    }
    Vec core(static_cast<std::size_t>(T * V), 0.0);
    Vec state(static_cast<std::size_t>(Hv * dk * dv), 0.0);
    for (Index h = 0; h < Hv; ++h) {
      double* S = state.data() + h * dk * dv;
      if (step) {
        std::copy(cache->recurrent.begin() + h * dk * dv,
                  cache->recurrent.begin() + (h + 1) * dk * dv, S);
        recurrent_head(q, k, v, g, beta, T, h, S, core);
      } else if (recurrent) {
        recurrent_head(q, k, v, g, beta, T, h, S, core);
      } else {
        chunk_head(q, k, v, g, beta, T, h, S, core);
      }
    }
    if (cache) {
      cache->recurrent = state;
      cache->has_previous_state = true;
    }
    // Qwen3NextRMSNormGated over each [dv] row, then out_proj.
    Vec y(static_cast<std::size_t>(T * D));
    Vec row(static_cast<std::size_t>(V));
    for (Index t = 0; t < T; ++t) {
      for (Index h = 0; h < Hv; ++h) {
        double const* o = core.data() + t * V + h * dv;
        double var = 0.0;
        for (Index j = 0; j < dv; ++j) var += o[j] * o[j];
        var /= static_cast<double>(dv);
        double const r = 1.0 / std::sqrt(var + eps);
        for (Index j = 0; j < dv; ++j) {
          row[h * dv + j] = norm[j] * (o[j] * r) * silu(z[t * V + h * dv + j]);
        }
      }
      Vec const yt = linear(out_proj, D, V, row.data());
      std::copy(yt.begin(), yt.end(), y.begin() + t * D);
    }
    return y;
  }

  /// sum(forward(x) * dy): the objective of the finite differences (recurrent rule: the chunked
  /// one is the same function).
  double objective(Vec const& x, Vec const& dy, Index T) const {
    Vec const y = forward(x, T, nullptr, true);
    double s = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * dy[i];
    return s;
  }
};

}  // namespace dnref
