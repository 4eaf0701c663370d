// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Row-wise softmax and sigmoid over float matrices (router scores).
#pragma once

#include <cmath>

#include "moe/core/types.hpp"
#include "moe/kernels/detail/diagnostics_push.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// out[i, :] = softmax(in[i, :]) = exp(in[i, j] - m_i) / sum_j exp(in[i, j] - m_i),
/// m_i = max_j in[i, j]. Shapes: in [rows, cols] with stride ld_in, out [rows, cols] with stride
/// ld_out; out may alias in. -inf entries get probability 0; a row must hold at least one finite
/// value (an all -inf row gives NaN). Computed in float, as the Hugging Face routers do.
template <class Arch = simd::DefaultArch>
void softmax_rows(float const* in, Index ld_in, float* out, Index ld_out, Index rows, Index cols) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index const vec_end = cols - cols % L;
  for (Index i = 0; i < rows; ++i) {
    float const* x = in + i * ld_in;
    float* y = out + i * ld_out;
    float m = -INFINITY;
    if (vec_end > 0) {
      B mb = B::load_unaligned(x);
      for (Index j = L; j < vec_end; j += L) mb = xsimd::max(mb, B::load_unaligned(x + j));
      m = simd::reduce_max(mb);
    }
    for (Index j = vec_end; j < cols; ++j) m = x[j] > m ? x[j] : m;
    B const mv(m);
    B sb(0.0f);
    for (Index j = 0; j < vec_end; j += L) {
      B const e = xsimd::exp(B::load_unaligned(x + j) - mv);
      e.store_unaligned(y + j);
      sb += e;
    }
    float s = simd::reduce_add(sb);
    for (Index j = vec_end; j < cols; ++j) {
      y[j] = std::exp(x[j] - m);
      s += y[j];
    }
    float const inv = 1.0f / s;
    B const iv(inv);
    for (Index j = 0; j < vec_end; j += L) (B::load_unaligned(y + j) * iv).store_unaligned(y + j);
    for (Index j = vec_end; j < cols; ++j) y[j] *= inv;
  }
}

/// out[i, j] = sigmoid(in[i, j]) = 1 / (1 + exp(-in[i, j])), elementwise over [rows, cols].
/// The form is overflow-safe: exp(-x) = inf for x << 0 gives exactly 0, and -inf gives 0.
/// out may alias in.
template <class Arch = simd::DefaultArch>
void sigmoid_rows(float const* in, Index ld_in, float* out, Index ld_out, Index rows, Index cols) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index const vec_end = cols - cols % L;
  B const one(1.0f);
  for (Index i = 0; i < rows; ++i) {
    float const* x = in + i * ld_in;
    float* y = out + i * ld_out;
    for (Index j = 0; j < vec_end; j += L) {
      (one / (one + xsimd::exp(-B::load_unaligned(x + j)))).store_unaligned(y + j);
    }
    for (Index j = vec_end; j < cols; ++j) y[j] = 1.0f / (1.0f + std::exp(-x[j]));
  }
}

}  // namespace moe::kernels

#include "moe/kernels/detail/diagnostics_pop.hpp"
