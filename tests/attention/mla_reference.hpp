// SPDX-License-Identifier: Apache-2.0
// A double-precision scalar transcription of transformers' DeepseekV3Attention and
// DeepseekV2Attention (modeling_deepseek_v3.py / modeling_deepseek_v2.py) and of the YaRN
// parameters of modeling_rope_utils.py, for forward checks and central finite differences. It
// follows the Python line by line (split, view, the V3 interleave permutation, V2's complex
// product) and shares no code with moe's kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <vector>

#include "moe/core/types.hpp"

namespace aref {

using moe::Index;
using Vec = std::vector<double>;

struct DoubleMla {
  /// kHalf: V3 with rope_interleave false (apply_rotary_pos_emb); kV3Interleave: V3's
  /// apply_rotary_pos_emb_interleave; kV2Complex: V2's apply_rotary_emb (view_as_complex).
  enum Rope { kHalf, kV3Interleave, kV2Complex };
  Index D = 0, H = 1, ql = 0, R = 0, dn = 0, dr = 0, dv = 0;
  double theta = 10000.0, eps = 1e-6;
  Rope rope = kV3Interleave;
  // rope_scaling {type yarn}: factor 0 = none.
  double factor = 0.0, beta_fast = 32.0, beta_slow = 1.0, mscale = 0.0, mscale_all_dim = 0.0;
  Index original_max = 4096;
  bool v3_scaling = true;  // DeepseekV3Attention folds mscale(factor, mscale_all_dim)^2
  Vec q_a_proj, q_a_bias, q_a_norm, q_b_proj, q_proj;
  Vec kv_a_proj, kv_a_bias, kv_a_norm, kv_b_proj, o_proj, o_bias;

  Index qk() const { return dn + dr; }

  static double get_mscale(double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  }
  /// _compute_yarn_parameters (or the default rope): inv_freq [dr / 2] and attention_factor.
  Vec inv_freq(double* attention_factor) const {
    Vec f(static_cast<std::size_t>(dr / 2));
    *attention_factor = 1.0;
    for (Index i = 0; i < dr / 2; ++i) {
      double const pos_freq = std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(dr));
      f[i] = 1.0 / pos_freq;
      if (factor <= 0.0) continue;
      auto corr = [&](double rot) {
        return static_cast<double>(dr) *
               std::log(static_cast<double>(original_max) / (rot * 2.0 * std::numbers::pi)) /
               (2.0 * std::log(theta));
      };
      double low = std::max(std::floor(corr(beta_fast)), 0.0);
      double high = std::min(std::ceil(corr(beta_slow)), static_cast<double>(dr - 1));
      if (low == high) high += 0.001;
      double const ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      double const extrapolation = 1.0 - ramp;
      f[i] = (1.0 / (factor * pos_freq)) * (1.0 - extrapolation) + (1.0 / pos_freq) * extrapolation;
    }
    if (factor > 0.0) {
      *attention_factor = mscale != 0.0 && mscale_all_dim != 0.0
                              ? get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                              : get_mscale(factor, 1.0);
    }
    return f;
  }
  double scaling() const {
    double s = std::pow(static_cast<double>(qk()), -0.5);
    if (v3_scaling && factor > 0.0 && mscale_all_dim != 0.0) {
      double const m = get_mscale(factor, mscale_all_dim);
      s *= m * m;
    }
    return s;
  }

  static Vec linear(Vec const& W, Vec const& b, Index out, Index in, double const* x) {
    Vec y(static_cast<std::size_t>(out), 0.0);
    for (Index r = 0; r < out; ++r) {
      for (Index c = 0; c < in; ++c) y[r] += W[r * in + c] * x[c];
      if (!b.empty()) y[r] += b[r];
    }
    return y;
  }
  Vec rms(Vec v, Vec const& w) const {
    double ss = 0.0;
    for (double a : v) ss += a * a;
    double const r = 1.0 / std::sqrt(ss / static_cast<double>(v.size()) + eps);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = w[i] * (v[i] * r);
    return v;
  }
  /// One vector's rotary part x [dr] at position pos, as the chosen transformers function.
  Vec rotate(Vec const& x, Index pos) const {
    double af = 1.0;
    Vec const f = inv_freq(&af);
    Index const h = dr / 2;
    Vec cos(static_cast<std::size_t>(dr)), sin(static_cast<std::size_t>(dr));
    for (Index i = 0; i < dr; ++i) {  // emb = cat(freqs, freqs)
      double const a = static_cast<double>(pos) * f[i % h];
      cos[i] = std::cos(a) * af;
      sin[i] = std::sin(a) * af;
    }
    Vec y(static_cast<std::size_t>(dr));
    if (rope == kV2Complex) {  // (x[2i] + i x[2i+1]) * (af e^{i a_i})
      for (Index i = 0; i < h; ++i) {
        double const re = x[2 * i], im = x[2 * i + 1], c = cos[i], s = sin[i];
        y[2 * i] = re * c - im * s;
        y[2 * i + 1] = re * s + im * c;
      }
      return y;
    }
    Vec q = x;
    if (rope == kV3Interleave) {  // view(d/2, 2).transpose(-1, -2).reshape(d)
      for (Index i = 0; i < h; ++i) {
        q[i] = x[2 * i];
        q[h + i] = x[2 * i + 1];
      }
    }
    for (Index i = 0; i < dr; ++i) {  // q * cos + rotate_half(q) * sin
      double const rh = i < h ? -q[i + h] : q[i - h];
      y[i] = q[i] * cos[i] + rh * sin[i];
    }
    return y;
  }

  /// y [T, D] of x [T, D], one causal sequence at positions 0 .. T - 1.
  Vec forward(Vec const& x, Index T) const {
    Index const dq = qk(), dkv = dn + dv;
    std::vector<Vec> q(T), k(T), v(T);  // [H dq], [H dq], [H dv] per token
    for (Index t = 0; t < T; ++t) {
      double const* xt = x.data() + t * D;
      Vec qs;
      if (ql == 0) {
        qs = linear(q_proj, {}, H * dq, D, xt);
      } else {
        Vec const a = rms(linear(q_a_proj, q_a_bias, ql, D, xt), q_a_norm);
        qs = linear(q_b_proj, {}, H * dq, ql, a.data());
      }
      Vec const ckv = linear(kv_a_proj, kv_a_bias, R + dr, D, xt);
      Vec const k_pass = rms(Vec(ckv.begin(), ckv.begin() + R), kv_a_norm);
      Vec const k_rot = rotate(Vec(ckv.begin() + R, ckv.end()), t);
      Vec const kvb = linear(kv_b_proj, {}, H * dkv, R, k_pass.data());
      q[t].resize(static_cast<std::size_t>(H * dq));
      k[t].resize(static_cast<std::size_t>(H * dq));
      v[t].resize(static_cast<std::size_t>(H * dv));
      for (Index h = 0; h < H; ++h) {
        Vec const q_rot = rotate(Vec(qs.begin() + h * dq + dn, qs.begin() + (h + 1) * dq), t);
        for (Index c = 0; c < dn; ++c) q[t][h * dq + c] = qs[h * dq + c];
        for (Index c = 0; c < dr; ++c) q[t][h * dq + dn + c] = q_rot[c];
        for (Index c = 0; c < dn; ++c) k[t][h * dq + c] = kvb[h * dkv + c];
        for (Index c = 0; c < dr; ++c) k[t][h * dq + dn + c] = k_rot[c];
        for (Index c = 0; c < dv; ++c) v[t][h * dv + c] = kvb[h * dkv + dn + c];
      }
    }
    double const scale = scaling();
    Vec y(static_cast<std::size_t>(T * D), 0.0);
    for (Index t = 0; t < T; ++t) {
      Vec attn(static_cast<std::size_t>(H * dv), 0.0);
      for (Index h = 0; h < H; ++h) {
        Vec s(static_cast<std::size_t>(t + 1));
        double m = -std::numeric_limits<double>::infinity();
        for (Index j = 0; j <= t; ++j) {
          double acc = 0.0;
          for (Index c = 0; c < dq; ++c) acc += q[t][h * dq + c] * k[j][h * dq + c];
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        double sum = 0.0;
        for (Index j = 0; j <= t; ++j) sum += (s[j] = std::exp(s[j] - m));
        for (Index j = 0; j <= t; ++j) {
          for (Index c = 0; c < dv; ++c) attn[h * dv + c] += s[j] / sum * v[j][h * dv + c];
        }
      }
      Vec const o = linear(o_proj, o_bias, D, H * dv, attn.data());
      std::copy(o.begin(), o.end(), y.begin() + t * D);
    }
    return y;
  }

  /// sum(forward(x) * dy): its gradient is the backward's given dy.
  double objective(Vec const& x, Vec const& dy, Index T) const {
    Vec const y = forward(x, T);
    double acc = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) acc += y[i] * dy[i];
    return acc;
  }
};

}  // namespace aref
