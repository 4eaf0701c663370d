// SPDX-License-Identifier: Apache-2.0
// A double-precision twin of GatedAttention for forward checks and central finite differences:
// the same flat parameter layouts, the layouts of ALGORITHMS.md section 2 written out as the
// reference code does (view + split / chunk), HF-style RMSNorm and rotate_half RoPE, and the
// naive attention of attention_reference.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "attention/attention_reference.hpp"

namespace aref {

struct DoubleGatedAttention {
  enum Layout { kSeparate, kPerGroup, kPerHead };
  enum Norm { kNone, kRms, kRmsOnePlus, kUnweighted };  // kUnweighted: Llama4TextL2Norm
  Index D = 0, H = 1, KV = 1, dh = 0, w = 0;            // w: gate width per head (0, 1 or dh)
  Layout layout = kSeparate;
  Norm norm = kNone;
  bool norm_all_heads = false;  // one RMSNorm over a token's whole q (and k), weight per column
  double eps = 1e-6;
  bool rope = false;
  double theta = 10000.0;
  Index rd = 0;
  // YaRN (transformers' _compute_yarn_parameters): factor 0 = off.
  double yarn_factor = 0.0, beta_fast = 32.0, beta_slow = 1.0, yarn_attention = 0.0;
  Index yarn_original = 4096;
  bool yarn_truncate = true;
  bool interleaved = false;  // RoPE pairs (2i, 2i + 1): transformers' GLM / ERNIE rotate_half
  // Llama 3 scaling (transformers' _compute_llama3_parameters): factor 0 = off.
  double llama3_factor = 0.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  Index llama3_original = 8192;
  Index chunk = 0;  // chunked attention (Llama 4)
  // Temperature tuning (Llama 4 NoPE layers): q *= log1p(floor((pos + 1) / floor)) * a + 1.
  Index temperature_floor = 0;
  double temperature_scale = 0.0;
  double scale = 1.0;
  bool causal = true;
  Index window = 0;  // sliding window (causal)
  Index batch = 1;
  std::vector<Index> positions;        // empty: index in sequence
  std::vector<std::uint8_t> key_mask;  // empty: none
  Vec q_proj, gate_proj, k_proj, v_proj, o_proj, q_norm, k_norm, sinks;
  Vec q_bias, k_bias, v_bias, o_bias;  // empty: none

  static Vec matvec(Vec const& W, Index rows, Index cols, double const* x) {
    Vec y(static_cast<std::size_t>(rows), 0.0);
    for (Index r = 0; r < rows; ++r) {
      for (Index c = 0; c < cols; ++c) y[r] += W[r * cols + c] * x[c];
    }
    return y;
  }

  /// RMSNorm of v[0, n) with weight[0, n).
  void normalize(double* v, Vec const& weight, Index n) const {
    if (norm == kNone) return;
    double ss = 0.0;
    for (Index i = 0; i < n; ++i) ss += v[i] * v[i];
    double const r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    for (Index i = 0; i < n; ++i) {
      v[i] *= r * (norm == kUnweighted ? 1.0 : norm == kRms ? weight[i] : 1.0 + weight[i]);
    }
  }
  static void add_bias(Vec& y, Vec const& b) {
    for (std::size_t i = 0; i < b.size(); ++i) y[i] += b[i];
  }

  /// inv_freq of frequency f < rd / 2, YaRN-blended when yarn_factor > 0.
  double inv_freq(Index f) const {
    double const pos_freq = std::pow(theta, static_cast<double>(2 * f) / static_cast<double>(rd));
    if (llama3_factor > 0.0) {  // transformers' torch.where form, written out
      double const inv = 1.0 / pos_freq, wavelen = 2.0 * std::numbers::pi / inv;
      double const low_wavelen = static_cast<double>(llama3_original) / low_freq_factor;
      double const high_wavelen = static_cast<double>(llama3_original) / high_freq_factor;
      double const scaled = wavelen > low_wavelen ? inv / llama3_factor : inv;
      bool const medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (!medium) return scaled;
      double const smooth = (static_cast<double>(llama3_original) / wavelen - low_freq_factor) /
                            (high_freq_factor - low_freq_factor);
      return (1.0 - smooth) * scaled / llama3_factor + smooth * scaled;
    }
    if (yarn_factor <= 0.0) return 1.0 / pos_freq;
    auto correction_dim = [&](double rotations) {
      return (static_cast<double>(rd) *
              std::log(static_cast<double>(yarn_original) / (rotations * 2.0 * std::numbers::pi))) /
             (2.0 * std::log(theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (yarn_truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(rd - 1));
    if (low == high) high += 0.001;
    double const ramp = std::clamp((static_cast<double>(f) - low) / (high - low), 0.0, 1.0);
    double const extrapolation_factor = 1.0 - ramp;
    return (1.0 / (yarn_factor * pos_freq)) * (1.0 - extrapolation_factor) +
           (1.0 / pos_freq) * extrapolation_factor;
  }
  /// The attention factor that scales cos and sin (YaRN's mscale).
  double rope_scale() const {
    if (yarn_factor <= 0.0) return 1.0;
    if (yarn_attention > 0.0) return yarn_attention;
    return yarn_factor <= 1.0 ? 1.0 : 0.1 * std::log(yarn_factor) + 1.0;
  }

  void rotate(double* v, Index pos) const {
    if (!rope) return;
    Index const half = rd / 2;
    Vec out(v, v + rd);
    for (Index i = 0; i < rd; ++i) {
      // cos / sin: cat(freqs, freqs), or freqs repeat_interleave(2) when interleaved
      Index const f = interleaved ? i / 2 : i % half;
      double const angle = static_cast<double>(pos) * inv_freq(f);
      double rot = i < half ? -v[i + half] : v[i - half];        // rotate_half
      if (interleaved) rot = i % 2 == 0 ? -v[i + 1] : v[i - 1];  // stack(-x2, x1).flatten
      out[i] = (v[i] * std::cos(angle) + rot * std::sin(angle)) * rope_scale();
    }
    std::copy(out.begin(), out.end(), v);
  }

  /// y [T, D] for x [T, D]; also returns the gate values s [T, H, w] in `gates` if given.
  Vec forward(Vec const& x, Index T, Vec* gates = nullptr) const {
    Index const G = H / KV, S = T / batch, HD = H * dh, KD = KV * dh;
    Vec q(static_cast<std::size_t>(T * HD)), gam(static_cast<std::size_t>(T * H * w)),
        k(static_cast<std::size_t>(T * KD)), v(static_cast<std::size_t>(T * KD));
    Index const Pq = layout == kSeparate ? HD : HD + H * w;
    for (Index t = 0; t < T; ++t) {
      Vec qg = matvec(q_proj, Pq, D, x.data() + t * D);
      add_bias(qg, q_bias);
      // Split the q_proj output as the reference code does.
      for (Index h = 0; h < H; ++h) {
        Index qo = 0, go = 0;
        if (layout == kSeparate) {
          qo = h * dh;
        } else if (layout == kPerGroup) {  // view(n_kv, -1) then split [G dh, G w]
          Index const g = h / G, i = h % G, base = g * (G * dh + G * w);
          qo = base + i * dh;
          go = base + G * dh + i * w;
        } else {  // view(-1, dh + w) then chunk
          qo = h * (dh + w);
          go = qo + dh;
        }
        for (Index c = 0; c < dh; ++c) q[t * HD + h * dh + c] = qg[qo + c];
        if (layout != kSeparate) {
          for (Index c = 0; c < w; ++c) gam[(t * H + h) * w + c] = qg[go + c];
        }
      }
      if (layout == kSeparate && w > 0) {
        Vec const gm = matvec(gate_proj, H * w, D, x.data() + t * D);
        for (Index i = 0; i < H * w; ++i) gam[t * H * w + i] = gm[i];
      }
      Vec kt = matvec(k_proj, KD, D, x.data() + t * D);
      Vec vt = matvec(v_proj, KD, D, x.data() + t * D);
      add_bias(kt, k_bias);
      add_bias(vt, v_bias);
      std::copy(kt.begin(), kt.end(), k.begin() + t * KD);
      std::copy(vt.begin(), vt.end(), v.begin() + t * KD);
      Index const pos = positions.empty() ? t % S : positions[t];
      if (norm_all_heads) {  // OLMoE: q_norm(q_proj(x)) before the view into heads
        normalize(q.data() + t * HD, q_norm, HD);
        normalize(k.data() + t * KD, k_norm, KD);
      }
      // Llama 4 normalises after RoPE (Llama4TextAttention), the others before.
      bool const after = norm == kUnweighted;
      double const temp = temperature_floor > 0
                              ? std::log1p(std::floor(static_cast<double>(pos + 1) /
                                                      static_cast<double>(temperature_floor))) *
                                        temperature_scale +
                                    1.0
                              : 1.0;
      for (Index h = 0; h < H; ++h) {
        double* qh = q.data() + t * HD + h * dh;
        if (!norm_all_heads && !after) normalize(qh, q_norm, dh);
        rotate(qh, pos);
        if (!norm_all_heads && after) normalize(qh, q_norm, dh);
        for (Index c = 0; c < dh; ++c) qh[c] *= temp;
      }
      for (Index g = 0; g < KV; ++g) {
        double* kg = k.data() + t * KD + g * dh;
        if (!norm_all_heads && !after) normalize(kg, k_norm, dh);
        rotate(kg, pos);
        if (!norm_all_heads && after) normalize(kg, k_norm, dh);
      }
    }
    Vec o(static_cast<std::size_t>(T * HD), 0.0);
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < H; ++h) {
        Index const g = h / G;
        Sdpa sd;
        sd.Tq = sd.Tk = S;
        sd.d = sd.dv = dh;
        sd.scale = scale;
        sd.causal = causal;
        sd.window = window;
        sd.chunk = chunk;
        if (!sinks.empty()) sd.sink = sinks[static_cast<std::size_t>(h)];
        if (!key_mask.empty())
          sd.key_mask.assign(key_mask.begin() + b * S, key_mask.begin() + (b + 1) * S);
        Vec qh(static_cast<std::size_t>(S * dh)), kh(qh.size()), vh(qh.size());
        for (Index s = 0; s < S; ++s) {
          for (Index c = 0; c < dh; ++c) {
            qh[s * dh + c] = q[(b * S + s) * HD + h * dh + c];
            kh[s * dh + c] = k[(b * S + s) * KD + g * dh + c];
            vh[s * dh + c] = v[(b * S + s) * KD + g * dh + c];
          }
        }
        Vec const a = sd.forward(qh, kh, vh);
        for (Index s = 0; s < S; ++s) {
          for (Index c = 0; c < dh; ++c) {
            double const gate =
                w == 0 ? 1.0 : sigmoid(gam[((b * S + s) * H + h) * w + (w == 1 ? 0 : c)]);
            o[(b * S + s) * HD + h * dh + c] = a[s * dh + c] * gate;
          }
        }
      }
    }
    if (gates) {
      gates->resize(gam.size());
      for (std::size_t i = 0; i < gam.size(); ++i) (*gates)[i] = sigmoid(gam[i]);
    }
    Vec y(static_cast<std::size_t>(T * D));
    for (Index t = 0; t < T; ++t) {
      Vec yt = matvec(o_proj, D, HD, o.data() + t * HD);
      add_bias(yt, o_bias);
      std::copy(yt.begin(), yt.end(), y.begin() + t * D);
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
