// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RMSNorm of one vector (the per-head q/k norm of Qwen3 and Qwen3-Next) and its backward.
#pragma once

#include <cmath>

#include "moe/core/types.hpp"

namespace moe::kernels {

/// y = x * r * w',  r = 1 / sqrt(mean(x^2) + eps),  w' = w (Qwen3RMSNorm) or 1 + w
/// (Qwen3NextRMSNorm, `one_plus`), or 1 when w is null (Llama4TextL2Norm), over n entries.
/// Returns r (training keeps it). y may be x.
inline float rms_norm(float const* x, float const* w, bool one_plus, float eps, Index n, float* y) {
  float ss = 0.0f;
  for (Index i = 0; i < n; ++i) ss = std::fma(x[i], x[i], ss);
  float const r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (w == nullptr) {
    for (Index i = 0; i < n; ++i) y[i] = x[i] * r;
    return r;
  }
  for (Index i = 0; i < n; ++i) y[i] = x[i] * r * (one_plus ? 1.0f + w[i] : w[i]);
  return r;
}

/// Backward of rms_norm at input x with the forward's r, given dy:
///   xhat = x r,  g = dy w',  dx = r (g - xhat mean(g xhat)),  dw += dy xhat
/// dx may alias dy; dw is accumulated (pass null to skip it; w null: w' = 1 and no dw).
inline void rms_norm_backward(float const* x, float const* w, bool one_plus, float r, Index n,
                              float const* dy, float* dx, float* dw) {
  auto weight = [&](Index i) { return w == nullptr ? 1.0f : one_plus ? 1.0f + w[i] : w[i]; };
  float dot = 0.0f;
  for (Index i = 0; i < n; ++i) dot = std::fma(dy[i] * weight(i), x[i] * r, dot);
  float const mean = dot / static_cast<float>(n);
  for (Index i = 0; i < n; ++i) {
    float const xhat = x[i] * r;
    float const dyi = dy[i];
    if (dw && w) dw[i] += dyi * xhat;
    dx[i] = r * (dyi * weight(i) - xhat * mean);
  }
}

}  // namespace moe::kernels
