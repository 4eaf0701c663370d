// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// gemm_strided: C (+)= A B with A read through arbitrary row and depth strides and B row-major,
/// without packing: the backward's four expert products (dM = dY W_down, dX = dH W_in,
/// dW_in += dH^T X, dW_down += dY^T M) read their operands in place. Allocation-free, bitwise
/// reproducible (each output is one FMA chain over k in ascending order, started from C when
/// accumulating), vectorised over 2 SIMD batches of output columns.
#pragma once

#include <algorithm>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

namespace detail {

/// Depth of one pass over B: a [256, 32] block of B is 32 KB and is re-read by every row tile.
inline constexpr Index kStridedKc = 256;

/// MR x (2 batches) tile of C over depth [0, K): acc starts from C (load) or 0.
template <Index MR, class Arch>
MOE_ALWAYS_INLINE void strided_tile(float const* a, Index a_rs, Index a_ks, float const* b,
                                    Index ldb, Index K, float* c, Index ldc, Index nc, bool load) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B acc0[MR], acc1[MR];
  alignas(64) float tmp[2 * L];
  for (Index r = 0; r < MR; ++r) {
    if (!load) {
      acc0[r] = acc1[r] = B(0.0f);
    } else if (nc == 2 * L) {
      acc0[r] = B::load_unaligned(c + r * ldc);
      acc1[r] = B::load_unaligned(c + r * ldc + L);
    } else {
      std::fill(tmp, tmp + 2 * L, 0.0f);
      std::copy(c + r * ldc, c + r * ldc + nc, tmp);
      acc0[r] = B::load_aligned(tmp);
      acc1[r] = B::load_aligned(tmp + L);
    }
  }
  for (Index k = 0; k < K; ++k) {
    B const b0 = B::load_unaligned(b + k * ldb);
    B const b1 = B::load_unaligned(b + k * ldb + L);
    float const* ak = a + k * a_ks;
    for (Index r = 0; r < MR; ++r) {
      B const av(ak[r * a_rs]);
      acc0[r] = xsimd::fma(av, b0, acc0[r]);
      acc1[r] = xsimd::fma(av, b1, acc1[r]);
    }
  }
  for (Index r = 0; r < MR; ++r) {
    if (nc == 2 * L) {
      acc0[r].store_unaligned(c + r * ldc);
      acc1[r].store_unaligned(c + r * ldc + L);
    } else {
      acc0[r].store_aligned(tmp);
      acc1[r].store_aligned(tmp + L);
      std::copy(tmp, tmp + nc, c + r * ldc);
    }
  }
}

/// Rows [0, M) in balanced tiles of at most 6 rows (32 rows -> 6 6 5 5 5 5, not 6 6 6 6 6 2).
template <class Arch>
void strided_rows(Index M, float const* a, Index a_rs, Index a_ks, float const* b, Index ldb,
                  Index K, float* c, Index ldc, Index nc, bool load) {
  for_each_row_tile<6>(M, [&]<Index MR>(Index, Index, Index i0) {
    strided_tile<MR, Arch>(a + i0 * a_rs, a_rs, a_ks, b, ldb, K, c + i0 * ldc, ldc, nc, load);
  });
}

}  // namespace detail

/// C[r, c] = (accumulate ? C[r, c] : 0) + sum_{k < K} A(r, k) B(k, c) for r < M, c < N, with
///   A(r, k) = a[r * a_rs + k * a_ks]   (any strides: a row-major A, or a transposed view)
///   B(k, c) = b[k * ldb + c]           (row-major [K, N], ldb >= N)
///   C row-major [M, N] (ldc >= N).
/// Each C[r, c] is one FMA chain over k = 0, 1, ..., K-1 (started from C when accumulating), so
/// its value depends only on its row of A, its column of B and K. B is copied block by block
/// ([256, 32], zero-padded at a column tail, so B is never read past column N) into a stack
/// buffer. Allocates nothing. Preconditions: C does not alias A or B.
template <class Arch = simd::DefaultArch>
void gemm_strided(Index M, Index N, Index K, float const* a, Index a_rs, Index a_ks, float const* b,
                  Index ldb, float* c, Index ldc, bool accumulate) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = 2 * L;
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) {
      for (Index r = 0; r < M; ++r) std::fill(c + r * ldc, c + r * ldc + N, 0.0f);
    }
    return;
  }
  // Depth slices outer, column blocks inner: a slice of B's rows is read once, front to back,
  // for all its column blocks. Each [kk, 32] block is copied into a contiguous, zero-padded
  // buffer first: B's own rows are ldb apart (often a multiple of 4 KB: L1-set conflicts), the
  // copy is re-read from L1 by every row tile.
  alignas(64) float pad[detail::kStridedKc * NP];
  for (Index k0 = 0; k0 < K; k0 += detail::kStridedKc) {
    Index const kk = std::min(detail::kStridedKc, K - k0);
    for (Index c0 = 0; c0 < N; c0 += NP) {
      Index const nc = std::min(NP, N - c0);
      float const* bk = b + k0 * ldb + c0;
      if (nc == NP) {
        for (Index k = 0; k < kk; ++k) {
          B::load_unaligned(bk + k * ldb).store_aligned(pad + k * NP);
          B::load_unaligned(bk + k * ldb + L).store_aligned(pad + k * NP + L);
        }
      } else {
        for (Index k = 0; k < kk; ++k) {
          std::copy(bk + k * ldb, bk + k * ldb + nc, pad + k * NP);
          std::fill(pad + k * NP + nc, pad + (k + 1) * NP, 0.0f);
        }
      }
      detail::strided_rows<Arch>(M, a + k0 * a_ks, a_rs, a_ks, pad, NP, kk, c + c0, ldc, nc,
                                 accumulate || k0 > 0);
    }
  }
}

}  // namespace moe::kernels
