// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Rotary position embedding (RoPE, rotate-half form as in Hugging Face Llama/Qwen) and its
/// backward, on one head vector at a time.
#pragma once

#include <cmath>

#include "moe/core/types.hpp"

namespace moe::kernels {

/// cos and sin of the RoPE angles of one position, for the first `rotary_dim` dimensions
/// (rotary_dim even): for i < rotary_dim / 2,
///   inv_freq_i = 1 / theta^(2i / rotary_dim)  (rounded to float, as HF computes it),
///   angle_i = float(position) * inv_freq_i,  cos_i = cos(angle_i),  sin_i = sin(angle_i).
/// Writes rotary_dim / 2 values to each of cos_out and sin_out.
inline void rope_angles(Index position, float theta, Index rotary_dim, float* cos_out,
                        float* sin_out) {
  Index const half = rotary_dim / 2;
  for (Index i = 0; i < half; ++i) {
    double const e = static_cast<double>(2 * i) / static_cast<double>(rotary_dim);
    auto const inv_freq = static_cast<float>(1.0 / std::pow(static_cast<double>(theta), e));
    float const angle = static_cast<float>(position) * inv_freq;
    cos_out[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    sin_out[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

/// YaRN RoPE scaling ("NTK-by-parts" interpolation, Peng et al. 2023; rope_type "yarn" of
/// gpt-oss and DeepSeek-V3, transformers' _compute_yarn_parameters). Off while factor is 0.
struct RopeYarn {
  float factor = 0.0f;  ///< s > 0 (gpt-oss: 32); 0: plain RoPE
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
  Index original_max_position = 4096;  ///< the pre-extension context length L0
  bool truncate = true;                ///< floor / ceil the correction range (gpt-oss: false)
  /// cos and sin are multiplied by it; 0: 0.1 ln(s) + 1 (1 when s <= 1).
  float attention_factor = 0.0f;

  bool enabled() const { return factor > 0.0f; }
  /// The scale of cos and sin.
  float scale() const {
    if (attention_factor > 0.0f) return attention_factor;
    return factor <= 1.0f ? 1.0f
                          : static_cast<float>(0.1 * std::log(static_cast<double>(factor)) + 1.0);
  }
};

/// YaRN inverse frequencies of rotary_dim (d) dimensions with base theta, into inv_freq[d / 2]:
///   c(r) = d ln(L0 / (2 pi r)) / (2 ln theta);  low = c(beta_fast), high = c(beta_slow)
///   (floor / ceil when truncate), clamped to [0, d - 1] (high += 0.001 when equal);
///   e_i = 1 - clamp((i - low) / (high - low), 0, 1)   (the extrapolated share),
///   inv_freq_i = theta^(-2i/d) (e_i + (1 - e_i) / s).
inline void rope_yarn_inv_freq(float theta, Index rotary_dim, RopeYarn const& y, float* inv_freq) {
  double const d = static_cast<double>(rotary_dim), base = static_cast<double>(theta);
  auto correction = [&](double rotations) {
    double const pi = 3.14159265358979323846;
    return d * std::log(static_cast<double>(y.original_max_position) / (rotations * 2.0 * pi)) /
           (2.0 * std::log(base));
  };
  double low = correction(static_cast<double>(y.beta_fast));
  double high = correction(static_cast<double>(y.beta_slow));
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = low < 0.0 ? 0.0 : low;
  high = high > d - 1.0 ? d - 1.0 : high;
  if (low == high) high += 0.001;
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    double ramp = (static_cast<double>(i) - low) / (high - low);
    ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
    double const e = 1.0 - ramp;
    double const extrapolated = 1.0 / std::pow(base, 2.0 * static_cast<double>(i) / d);
    inv_freq[i] =
        static_cast<float>(extrapolated * (e + (1.0 - e) / static_cast<double>(y.factor)));
  }
}

/// Llama 3 RoPE scaling (rope_type "llama3": Llama 3.1 and Llama 4 Scout; transformers'
/// _compute_llama3_parameters). Off while factor is 0. cos and sin are not scaled.
struct RopeLlama3 {
  float factor = 0.0f;  ///< s > 0 (Llama 4 Scout: 16); 0: plain RoPE
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;       ///< > low_freq_factor, or equal to it (no smooth band)
  Index original_max_position = 8192;  ///< the pre-extension context length L0

  bool enabled() const { return factor > 0.0f; }
};

/// Llama 3 inverse frequencies of rotary_dim (d) dimensions with base theta, into
/// inv_freq[d / 2]: with f_i = theta^(-2i/d), its wavelength w_i = 2 pi / f_i,
/// lo = L0 / low_freq_factor, hi = L0 / high_freq_factor:
///   w_i < hi: f_i (high frequencies kept);  w_i > lo: f_i / s (low ones interpolated);
///   else (1 - a) f_i / s + a f_i,  a = (L0 / w_i - low_freq_factor) /
///                                      (high_freq_factor - low_freq_factor).
inline void rope_llama3_inv_freq(float theta, Index rotary_dim, RopeLlama3 const& l,
                                 float* inv_freq) {
  double const d = static_cast<double>(rotary_dim), pi = 3.14159265358979323846;
  double const s = static_cast<double>(l.factor), L0 = static_cast<double>(l.original_max_position);
  double const lo_f = static_cast<double>(l.low_freq_factor);
  double const hi_f = static_cast<double>(l.high_freq_factor);
  double const lo_wavelen = L0 / lo_f, hi_wavelen = L0 / hi_f;
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    // theta^(-2i/d) rounded to float first, as transformers computes it
    double const f = static_cast<float>(
        1.0 / std::pow(static_cast<double>(theta), 2.0 * static_cast<double>(i) / d));
    double const wavelen = 2.0 * pi / f;
    double out = f;
    if (wavelen > lo_wavelen) {
      out = f / s;
    } else if (wavelen >= hi_wavelen && hi_f != lo_f) {
      double const a = (L0 / wavelen - lo_f) / (hi_f - lo_f);
      out = (1.0 - a) * f / s + a * f;
    }
    inv_freq[i] = static_cast<float>(out);
  }
}

/// Inverse frequencies divided by per-frequency factors (llama.cpp's rope_freqs tensor, which
/// its converter writes for Llama 3 scaling instead of the four parameters):
/// inv_freq[i] = float(theta^(-2i/d)) / factors[i], i < d / 2.
inline void rope_factored_inv_freq(float theta, Index rotary_dim, float const* factors,
                                   float* inv_freq) {
  double const d = static_cast<double>(rotary_dim);
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    float const f = static_cast<float>(
        1.0 / std::pow(static_cast<double>(theta), 2.0 * static_cast<double>(i) / d));
    inv_freq[i] = f / factors[i];
  }
}

/// cos and sin of one position from precomputed inverse frequencies, times `scale`:
/// angle_i = float(position) * inv_freq[i], cos_i = scale cos(angle_i), sin_i = scale sin(angle_i).
inline void rope_angles(Index position, float const* inv_freq, float scale, Index rotary_dim,
                        float* cos_out, float* sin_out) {
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    float const angle = static_cast<float>(position) * inv_freq[i];
    cos_out[i] = static_cast<float>(std::cos(static_cast<double>(angle))) * scale;
    sin_out[i] = static_cast<float>(std::sin(static_cast<double>(angle))) * scale;
  }
}

/// In place, the rotate-half RoPE of the first rotary_dim entries of x (the rest unchanged):
///   x'[i]     = x[i] cos_i - x[i + h] sin_i
///   x'[i + h] = x[i + h] cos_i + x[i] sin_i,     i < h = rotary_dim / 2
/// (HF apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, cos = cat(cos_i, cos_i)).
inline void rope_apply(float* x, float const* cos_t, float const* sin_t, Index rotary_dim) {
  Index const h = rotary_dim / 2;
  for (Index i = 0; i < h; ++i) {
    float const a = x[i], b = x[i + h];
    x[i] = a * cos_t[i] - b * sin_t[i];
    x[i + h] = b * cos_t[i] + a * sin_t[i];
  }
}

/// In place, the backward of rope_apply (the transposed rotation): dx = R^T dx'.
///   dx[i] = dx'[i] cos_i + dx'[i + h] sin_i;   dx[i + h] = dx'[i + h] cos_i - dx'[i] sin_i
inline void rope_backward(float* dx, float const* cos_t, float const* sin_t, Index rotary_dim) {
  Index const h = rotary_dim / 2;
  for (Index i = 0; i < h; ++i) {
    float const a = dx[i], b = dx[i + h];
    dx[i] = a * cos_t[i] + b * sin_t[i];
    dx[i + h] = b * cos_t[i] - a * sin_t[i];
  }
}

/// In place, the interleaved (GPT-J style; GLM-4 and ERNIE 4.5) RoPE of the first rotary_dim
/// entries of x, pairs (2i, 2i + 1) (transformers: rotate_half(x) = stack(-x[1::2], x[0::2]),
/// cos and sin repeat_interleave(2)):
///   x'[2i]     = x[2i] cos_i - x[2i + 1] sin_i
///   x'[2i + 1] = x[2i + 1] cos_i + x[2i] sin_i,     i < rotary_dim / 2
inline void rope_apply_interleaved(float* x, float const* cos_t, float const* sin_t,
                                   Index rotary_dim) {
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    float const a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cos_t[i] - b * sin_t[i];
    x[2 * i + 1] = b * cos_t[i] + a * sin_t[i];
  }
}

/// In place, the backward of rope_apply_interleaved (the transposed rotation of each pair).
inline void rope_backward_interleaved(float* dx, float const* cos_t, float const* sin_t,
                                      Index rotary_dim) {
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    float const a = dx[2 * i], b = dx[2 * i + 1];
    dx[2 * i] = a * cos_t[i] + b * sin_t[i];
    dx[2 * i + 1] = b * cos_t[i] - a * sin_t[i];
  }
}

/// rope_apply_interleaved when `interleaved`, else rope_apply (a layer's configured layout).
inline void rope_rotate(float* x, float const* cos_t, float const* sin_t, Index rotary_dim,
                        bool interleaved) {
  if (interleaved) {
    rope_apply_interleaved(x, cos_t, sin_t, rotary_dim);
  } else {
    rope_apply(x, cos_t, sin_t, rotary_dim);
  }
}

/// The backward of rope_rotate.
inline void rope_rotate_backward(float* dx, float const* cos_t, float const* sin_t,
                                 Index rotary_dim, bool interleaved) {
  if (interleaved) {
    rope_backward_interleaved(dx, cos_t, sin_t, rotary_dim);
  } else {
    rope_backward(dx, cos_t, sin_t, rotary_dim);
  }
}

}  // namespace moe::kernels
