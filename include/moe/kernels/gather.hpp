// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// gather_rows: dispatch, copying the routed tokens' activations into a contiguous block.
#pragma once

#include "moe/core/types.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// out[i, :] = x[row_token[i], :] for i in [0, n). Shapes: x [T, cols] with stride ld_x,
/// out [n, cols] with stride ld_out; row_token[i] in [0, T). out must not alias x.
template <class Arch = simd::DefaultArch>
void gather_rows(float const* x, Index ld_x, Index const* row_token, Index n, Index cols,
                 float* out, Index ld_out) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index const vec_end = cols - cols % L;
  for (Index i = 0; i < n; ++i) {
    float const* src = x + row_token[i] * ld_x;
    float* dst = out + i * ld_out;
    for (Index j = 0; j < vec_end; j += L) B::load_unaligned(src + j).store_unaligned(dst + j);
    for (Index j = vec_end; j < cols; ++j) dst[j] = src[j];
  }
}

}  // namespace moe::kernels
