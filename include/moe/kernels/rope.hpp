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

}  // namespace moe::kernels
