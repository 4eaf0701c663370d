// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// gemm_nt: C = A B^T for row-major A and B (activations times [out, in] weights), allocation-free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

namespace detail {

inline constexpr Index kGemmMr = 4;     // rows of A per micro-tile
inline constexpr Index kGemmNr = 4;     // rows of B (output columns) per micro-tile
inline constexpr Index kGemmKc = 2048;  // depth block: a 4 x 2048 B panel is 32 KiB

/// The weight element types of the projections: float, or bf16 as its 16 bits (std::uint16_t),
/// widened to float as it is loaded (exact), so both give the same arithmetic.
template <class W>
inline constexpr bool is_weight_type = std::is_same_v<W, float> || std::is_same_v<W, std::uint16_t>;

template <class Bt, class W>
MOE_ALWAYS_INLINE Bt load_weights(W const* p) {
  if constexpr (std::is_same_v<W, float>) {
    return Bt::load_unaligned(p);
  } else {
    return simd::load_bf16<Bt>(p);
  }
}
template <class W>
MOE_ALWAYS_INLINE float weight_value(W w) {
  if constexpr (std::is_same_v<W, float>) {
    return w;
  } else {
    return simd::widen_bf16(w);
  }
}

/// One MR x NR tile of dot products over k in [0, kc):
///   c[r * ldc + j * cs] (+)= sum_k a[r * lda + k] * b[j * ldb + k]
/// Lanes accumulate k in steps of L; each accumulator is reduced with simd::reduce_add (not
/// xsimd::haddp: in xsimd 8.1 its AVX-512 version returns the sums in permuted lane order); the
/// k tail is added in scalar, in order. The summation order depends only on kc and L, never on M or
/// N. b is float or bf16 (is_weight_type): the same arithmetic on the widened values.
template <Index MR, Index NR, class Arch, class W>
MOE_ALWAYS_INLINE void gemm_nt_tile(float const* a, Index lda, W const* b, Index ldb, float* c,
                                    Index ldc, Index cs, Index kc, bool accumulate) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index kAcc = MR * NR;
  B acc[kAcc];
  for (Index i = 0; i < kAcc; ++i) acc[i] = B(0.0f);
  Index const kv = kc - kc % L;
  for (Index k = 0; k < kv; k += L) {
    B bv[NR];
    for (Index j = 0; j < NR; ++j) bv[j] = load_weights<B>(b + j * ldb + k);
    for (Index r = 0; r < MR; ++r) {
      B const av = B::load_unaligned(a + r * lda + k);
      for (Index j = 0; j < NR; ++j) acc[r * NR + j] = xsimd::fma(av, bv[j], acc[r * NR + j]);
    }
  }
  float sums[kAcc];
  for (Index i = 0; i < kAcc; ++i) sums[i] = simd::reduce_add(acc[i]);
  // The k tail. bf16 weights are widened into a float copy first, so that the loop is the fp32
  // one, compiled alike: with FP contraction on, GCC fused a * widen(b) + s into an FMA where it
  // left the fp32 a * b + s unfused, and the bits differed.
  [[maybe_unused]] float wide[std::is_same_v<W, float> ? 1 : NR * L];
  float const* bt = nullptr;
  Index ldt = ldb;
  if constexpr (std::is_same_v<W, float>) {
    bt = b + kv;
  } else {
    for (Index j = 0; j < NR; ++j) {
      for (Index k = kv; k < kc; ++k) wide[j * L + (k - kv)] = weight_value(b[j * ldb + k]);
    }
    bt = wide;
    ldt = L;
  }
  for (Index k = kv; k < kc; ++k) {
    for (Index r = 0; r < MR; ++r) {
      for (Index j = 0; j < NR; ++j) sums[r * NR + j] += a[r * lda + k] * bt[j * ldt + (k - kv)];
    }
  }
  for (Index r = 0; r < MR; ++r) {
    for (Index j = 0; j < NR; ++j) {
      float& dst = c[r * ldc + j * cs];
      dst = accumulate ? dst + sums[r * NR + j] : sums[r * NR + j];
    }
  }
}

template <Index MR, class Arch, class W>
MOE_ALWAYS_INLINE void gemm_nt_row_block(float const* a, Index lda, W const* b, Index ldb, float* c,
                                         Index ldc, Index cs, Index nr, Index kc, bool acc) {
  switch (nr) {
    case 4:
      gemm_nt_tile<MR, 4, Arch, W>(a, lda, b, ldb, c, ldc, cs, kc, acc);
      break;
    case 3:
      gemm_nt_tile<MR, 3, Arch, W>(a, lda, b, ldb, c, ldc, cs, kc, acc);
      break;
    case 2:
      gemm_nt_tile<MR, 2, Arch, W>(a, lda, b, ldb, c, ldc, cs, kc, acc);
      break;
    default:
      gemm_nt_tile<MR, 1, Arch, W>(a, lda, b, ldb, c, ldc, cs, kc, acc);
      break;
  }
}

/// All rows of A against NR rows of B: b + j * ldb, written to c + j * cs (j < nr).
template <class Arch, class W>
MOE_ALWAYS_INLINE void gemm_nt_rows(float const* A, Index lda, Index M, W const* b, Index ldb,
                                    float* c, Index ldc, Index cs, Index nr, Index kc, bool acc) {
  Index i0 = 0;
  for (; i0 + kGemmMr <= M; i0 += kGemmMr) {
    gemm_nt_row_block<kGemmMr, Arch, W>(A + i0 * lda, lda, b, ldb, c + i0 * ldc, ldc, cs, nr, kc,
                                        acc);
  }
  for (; i0 < M; ++i0) {
    gemm_nt_row_block<1, Arch, W>(A + i0 * lda, lda, b, ldb, c + i0 * ldc, ldc, cs, nr, kc, acc);
  }
}

}  // namespace detail

/// C = A B^T (or C += A B^T when accumulate), all row-major:
///   C[i, j] = sum_k A[i, k] B[j, k],   A [M, K] (lda), B [N, K] (ldb), C [M, N] (ldc).
/// This is the layout of every MoE projection: activations [rows, in] times HF weights [out, in].
/// Each output is a dot product accumulated in SIMD lanes over blocks of 2048 k, so the value of
/// C[i, j] depends only on row i of A, row j of B and K: never on M, N, the tiling of rows across
/// calls, or threads (bitwise reproducible). Each B row is read once per call for all M rows
/// (weights are streamed once: the small-T path). Allocates nothing.
/// B may be bf16 (std::uint16_t, the top half of a float): each weight is widened to fp32 as it
/// is loaded, so the result equals, bitwise, gemm_nt on the widened fp32 B (half the bytes read).
/// Preconditions: M, N, K >= 0; C does not alias A or B.
template <class Arch = simd::DefaultArch, class W = float>
void gemm_nt(float const* A, Index lda, W const* B, Index ldb, float* C, Index ldc, Index M,
             Index N, Index K, bool accumulate = false) {
  static_assert(detail::is_weight_type<W>, "gemm_nt: B is float or bf16 (std::uint16_t)");
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) {
      for (Index i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    }
    return;
  }
  constexpr Index NR = detail::kGemmNr;
  // The NR rows of B a tile reads are S rows apart (S = N / NR): NR long sequential streams,
  // which keep more lines in flight than NR adjacent rows (one stream of NR short pieces).
  // Measured on a Zen 5 VM, 2 threads, one row against a [151936, 2048] fp32 matrix: 59-64 GB/s
  // against 48-51 with adjacent rows, side by side. Which rows share a tile does not change any
  // output's arithmetic.
  Index const S = N >= 4 * NR ? N / NR : 0;
  for (Index k0 = 0; k0 < K; k0 += detail::kGemmKc) {
    Index const kc = std::min(detail::kGemmKc, K - k0);
    bool const acc = accumulate || k0 > 0;
    for (Index j = 0; j < S; ++j) {
      detail::gemm_nt_rows<Arch, W>(A + k0, lda, M, B + j * ldb + k0, S * ldb, C + j, ldc, S, NR,
                                    kc, acc);
    }
    for (Index j0 = S * NR; j0 < N; j0 += NR) {
      detail::gemm_nt_rows<Arch, W>(A + k0, lda, M, B + j0 * ldb + k0, ldb, C + j0, ldc, 1,
                                    std::min(NR, N - j0), kc, acc);
    }
  }
}

}  // namespace moe::kernels
