// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// gemm_strided: C (+)= A B with A read through arbitrary row and depth strides and B row-major:
/// the backward's expert products (dM = dY W_down, dX = dH W_in, dW_in += dH^T X,
/// dW_down += dY^T M) and the router / gate terms read their operands in place. A is packed per
/// depth slice into row tiles (broadcasts from consecutive addresses), B into panels of
/// strided_width() columns; MR x strided_width() register tiles (6 x 64 with AVX-512). Two loop
/// shapes:
///   - B packed whole when it fits the scratch (the weight gradients, K = one expert's rows):
///     each row tile then streams its rows of C once across all panels, the next tile's rows of C
///     prefetched with intent to write (C, the gradient, is the DRAM traffic there);
///   - deep K (dM, dX: B is a weight matrix): slices of 256 rows, one [256, 64] panel of B at a
///     time (packed, L1/L2; read in place when at most 3 row tiles use it) for all row tiles, the
///     panel two ahead prefetched into L2 meanwhile, and the C block of the next tile (its partial
///     sums) prefetched with intent to write.
/// Allocation-free, bitwise reproducible: each output is one FMA chain over k in ascending order
/// (started from C when accumulating; partial sums pass through C between slices, which is
/// exact), so its value depends only on its row of A, its column of B and K -- not on M, N, the
/// loop shape, the scratch or the thread that runs it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// SIMD batches per row of a gemm_strided tile: 4 with 16-lane batches (6 x 64 tile: 24
/// accumulators of the 32 AVX-512 registers), 2 otherwise (4 x 2 batches of 16 registers).
template <class Arch = simd::DefaultArch>
constexpr int strided_batches() {
  return simd::Batch<float, Arch>::size >= 16 ? 4 : 2;
}

/// Columns of one packed B panel of gemm_strided (64 floats with AVX-512).
template <class Arch = simd::DefaultArch>
constexpr Index strided_width() {
  return strided_batches<Arch>() * static_cast<Index>(simd::Batch<float, Arch>::size);
}

/// Floats of the scratch gemm_strided takes: a packed B of up to 128 K floats (512 KB, half of
/// this machine's L2: an expert's 64 rows of a 2048-wide input) and packed A slices of 64 rows x
/// 256; plus alignment slack.
inline constexpr Index kGemmStridedScratchFloats = 131072 + 64 * 256 + 16;

namespace detail {

inline constexpr Index kStridedRowChunk = 64;       ///< rows of A packed at once
inline constexpr Index kStridedMaxDepth = 256;      ///< deepest A slice (scratch's A part)
inline constexpr Index kStridedDeepSlice = 256;     ///< depth of a slice when B is not packed whole
inline constexpr Index kStridedWholeB = 131072;     ///< floats of the packed-B part of scratch
inline constexpr Index kStridedInPlaceTiles = 3;    ///< deep K: B read in place up to this
inline constexpr Index kStridedPrefetchPanels = 2;  ///< deep K: B prefetched this many panels ahead

template <class Arch>
constexpr Index strided_max_mr() {
  return simd::Batch<float, Arch>::size >= 16 ? 6 : 4;
}

/// Prefetch cursor over a [rows, row_bytes] region (row stride `stride` bytes): one 64-byte line
/// per step into L2, `left` lines from (row, off) on in row-major order; with Write, lines that
/// will be written (prefetch with intent to write).
template <bool Write = false>
struct StridedPrefetch {
  char const* row = nullptr;
  Index stride = 0, row_bytes = 0, off = 0, left = 0;
  /// The cursor at line l of the region (l < lines).
  StridedPrefetch at(Index l, Index count) const {
    StridedPrefetch p = *this;
    Index const lines_per_row = (row_bytes + 63) / 64;
    if (count <= 0 || lines_per_row == 0) return p;
    p.row = row + (l / lines_per_row) * stride;
    p.off = (l % lines_per_row) * 64;
    p.left = count;
    return p;
  }
  MOE_ALWAYS_INLINE void step() {
    if (left > 0) {
#if defined(__GNUC__) || defined(__clang__)
      if constexpr (Write) {
        __builtin_prefetch(row + off, 1, 2);
      } else {
        MOE_PREFETCH_L2(row + off);
      }
#endif
      off += 64;
      if (off >= row_bytes) {
        off = 0;
        row += stride;
      }
      --left;
    }
  }
};

/// A rows [0, M) x depth [0, kd) -> row tiles (the split of for_each_row_tile<MaxMR>): the tile
/// starting at row i0 with mr rows holds A(i0 + r, k) at dst[i0 * kd + k * mr + r].
template <Index MaxMR>
void strided_pack_a(Index M, Index kd, float const* a, Index a_rs, Index a_ks, float* dst) {
  for_each_row_tile<MaxMR>(M, [&]<Index MR>(Index, Index, Index i0) {
    float* d = dst + i0 * kd;
    if (a_ks == 1) {
      for (Index r = 0; r < MR; ++r) {
        float const* src = a + (i0 + r) * a_rs;
        for (Index k = 0; k < kd; ++k) d[k * MR + r] = src[k];
      }
    } else {
      for (Index k = 0; k < kd; ++k) {
        float const* src = a + i0 * a_rs + k * a_ks;
        for (Index r = 0; r < MR; ++r) d[k * MR + r] = src[r * a_rs];
      }
    }
  });
}

/// B rows [0, kd) x columns [0, nb) (row stride ldb) -> panels of NP columns: panel p holds
/// B(k, p * NP + c) at dst[(p * kd + k) * NP + c], zero past nb. Rows are read front to back.
template <class Arch>
void strided_pack_b(Index kd, Index nb, float const* b, Index ldb, float* dst) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr Index NP = strided_width<Arch>();
  constexpr int NB = strided_batches<Arch>();
  Index const full = nb / NP, panels = (nb + NP - 1) / NP;
  for (Index k = 0; k < kd; ++k) {
    float const* src = b + k * ldb;
    for (Index p = 0; p < full; ++p) {
      float* d = dst + (p * kd + k) * NP;
      for (int j = 0; j < NB; ++j) B::load_unaligned(src + p * NP + j * L).store_aligned(d + j * L);
    }
    if (full < panels) {
      float* d = dst + (full * kd + k) * NP;
      Index const nc = nb - full * NP;
      std::copy(src + full * NP, src + nb, d);
      std::fill(d + nc, d + NP, 0.0f);
    }
  }
}

/// MR x NP tile of C over depth [0, K) of packed A (ap, [K][MR]) and packed B (bp, [K][NP]):
/// accumulators start from C (load) or zero; nc <= NP columns of C exist.
template <Index MR, class Arch, class PfB, class PfC>
MOE_ALWAYS_INLINE void strided_tile(float const* ap, float const* bp, Index ldbp, Index K, float* c,
                                    Index ldc, Index nc, bool load, PfB& pf, PfC& pc) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  constexpr int NB = strided_batches<Arch>();
  constexpr Index NP = NB * L;
  B acc[NB][MR];
  alignas(64) float tmp[NP];
  for (Index r = 0; r < MR; ++r) {
    if (!load) {
      for (int j = 0; j < NB; ++j) acc[j][r] = B(0.0f);
    } else if (nc == NP) {
      for (int j = 0; j < NB; ++j) acc[j][r] = B::load_unaligned(c + r * ldc + j * L);
    } else {
      std::fill(tmp, tmp + NP, 0.0f);
      std::copy(c + r * ldc, c + r * ldc + nc, tmp);
      for (int j = 0; j < NB; ++j) acc[j][r] = B::load_aligned(tmp + j * L);
    }
  }
  for (Index k = 0; k < K; ++k) {
    pf.step();
    pc.step();
    B b[NB];
    for (int j = 0; j < NB; ++j) b[j] = B::load_unaligned(bp + k * ldbp + j * L);
    for (Index r = 0; r < MR; ++r) {
      B const av(ap[k * MR + r]);
      for (int j = 0; j < NB; ++j) acc[j][r] = xsimd::fma(av, b[j], acc[j][r]);
    }
  }
  for (Index r = 0; r < MR; ++r) {
    if (nc == NP) {
      for (int j = 0; j < NB; ++j) acc[j][r].store_unaligned(c + r * ldc + j * L);
    } else {
      for (int j = 0; j < NB; ++j) acc[j][r].store_aligned(tmp + j * L);
      std::copy(tmp, tmp + nc, c + r * ldc);
    }
  }
}

/// gemm_strided on buffers: bbuf (64-byte aligned) holds kStridedWholeB floats if whole_ok,
/// else kStridedDeepSlice * NP; abuf kStridedRowChunk * kStridedMaxDepth floats if whole_ok, else
/// kStridedRowChunk * kStridedDeepSlice.
template <class Arch>
void gemm_strided_impl(Index M, Index N, Index K, float const* a, Index a_rs, Index a_ks,
                       float const* b, Index ldb, float* c, Index ldc, bool accumulate, float* bbuf,
                       float* abuf, bool whole_ok) {
  constexpr Index NP = strided_width<Arch>();
  constexpr Index MaxMR = strided_max_mr<Arch>();
  constexpr Index kDeep = kStridedDeepSlice;
  constexpr Index kLine = 64;
  constexpr Index kFloat = static_cast<Index>(sizeof(float));
  Index const panels = (N + NP - 1) / NP;
  auto tile_at = [&]<Index MR>(Index m0, Index i0, Index p, Index k0, Index kd, float const* bp,
                               Index ldbp, auto& pf, auto& pc) {
    Index const nc = std::min(NP, N - p * NP);
    strided_tile<MR, Arch>(abuf + i0 * kd, bp, ldbp, kd, c + (m0 + i0) * ldc + p * NP, ldc, nc,
                           accumulate || k0 > 0, pf, pc);
  };
  StridedPrefetch<> none;
  if (whole_ok && panels * NP * K <= kStridedWholeB && K <= kStridedMaxDepth) {
    // Whole B (the weight-gradient products: K = the rows of one expert): B packed once, then
    // each row tile streams its rows of C once across all panels while the next tile's rows of
    // C are prefetched (with intent to write).
    strided_pack_b<Arch>(K, N, b, ldb, bbuf);
    for (Index m0 = 0; m0 < M; m0 += kStridedRowChunk) {
      Index const mc = std::min(kStridedRowChunk, M - m0);
      strided_pack_a<MaxMR>(mc, K, a + m0 * a_rs, a_rs, a_ks, abuf);
      for_each_row_tile<MaxMR>(mc, [&]<Index MR>(Index, Index, Index i0) {
        StridedPrefetch<true> cnext;
        Index const nr = std::min(MaxMR, M - (m0 + i0 + MR));
        cnext.row = reinterpret_cast<char const*>(c + (m0 + i0 + MR) * ldc);
        cnext.stride = ldc * kFloat;
        cnext.row_bytes = N * kFloat;
        Index const lines = nr > 0 ? nr * ((N * kFloat + kLine - 1) / kLine) : 0;
        Index const per = (lines + panels - 1) / panels;
        for (Index p = 0; p < panels; ++p) {
          Index const l0 = std::min(lines, p * per);
          auto pc = cnext.at(l0, std::min(lines, l0 + per) - l0);
          tile_at.template operator()<MR>(m0, i0, p, 0, K, bbuf + p * K * NP, NP, none, pc);
        }
      });
    }
    return;
  }
  // Deep K: depth slices of kDeep outer; A's slice packed once per row chunk, then one column
  // panel of B at a time ([kDeep, NP] = 64 KB, packed: L1 and L2) for all row tiles, the
  // panels ahead prefetched meanwhile.
  for (Index k0 = 0; k0 < K; k0 += kDeep) {
    Index const kd = std::min(kDeep, K - k0);
    for (Index m0 = 0; m0 < M; m0 += kStridedRowChunk) {
      Index const mc = std::min(kStridedRowChunk, M - m0);
      strided_pack_a<MaxMR>(mc, kd, a + m0 * a_rs + k0 * a_ks, a_rs, a_ks, abuf);
      Index const tiles = (mc + MaxMR - 1) / MaxMR;
      // Few row tiles: reading full panels of B in place (from L2, prefetched) beats packing a
      // block that only a few tiles reuse (DeepSeek-like shapes: 16 rows per expert).
      bool const direct = tiles <= kStridedInPlaceTiles;
      for (Index p = 0; p < panels; ++p) {
        bool const in_place = direct && (p + 1) * NP <= N;
        if (!in_place) {
          strided_pack_b<Arch>(kd, std::min(NP, N - p * NP), b + k0 * ldb + p * NP, ldb, bbuf);
        }
        // The block of B kStridedPrefetchPanels panels ahead (into the next slice at the end),
        // spread over the row tiles: one panel ahead leaves too little time for DRAM.
        StridedPrefetch<> next;
        next.stride = ldb * kFloat;
        Index rows = 0;
        Index const q = p + kStridedPrefetchPanels;
        if (q < panels) {
          next.row = reinterpret_cast<char const*>(b + k0 * ldb + q * NP);
          next.row_bytes = std::min(NP, N - q * NP) * kFloat;
          rows = kd;
        } else if (k0 + kDeep < K && m0 + kStridedRowChunk >= M && q - panels < panels) {
          next.row = reinterpret_cast<char const*>(b + (k0 + kDeep) * ldb + (q - panels) * NP);
          next.row_bytes = std::min(NP, N - (q - panels) * NP) * kFloat;
          rows = std::min(kDeep, K - k0 - kDeep);
        }
        Index const lines = rows * ((next.row_bytes + kLine - 1) / kLine);
        Index const per = (lines + tiles - 1) / tiles;
        for_each_row_tile<MaxMR>(mc, [&]<Index MR>(Index t, Index, Index i0) {
          Index const l0 = std::min(lines, t * per);
          auto pf = next.at(l0, std::min(lines, l0 + per) - l0);
          // The C block the next tile loads (the next rows of this panel, or the chunk's first
          // rows of the next panel), prefetched with intent to write: without it each tile
          // started by waiting on its accumulators (C's partial sums of the previous slice).
          StridedPrefetch<true> pc;
          Index const ni = i0 + MR < mc ? i0 + MR : 0, np = i0 + MR < mc ? p : p + 1;
          if (np < panels) {
            pc.row = reinterpret_cast<char const*>(c + (m0 + ni) * ldc + np * NP);
            pc.stride = ldc * kFloat;
            pc.row_bytes = std::min(NP, N - np * NP) * kFloat;
            pc = pc.at(0, std::min(MaxMR, mc - ni) * ((pc.row_bytes + kLine - 1) / kLine));
          }
          tile_at.template operator()<MR>(m0, i0, p, k0, kd,
                                          in_place ? b + k0 * ldb + p * NP : bbuf,
                                          in_place ? ldb : NP, pf, pc);
        });
      }
    }
  }
}

}  // namespace detail

/// C[r, c] = (accumulate ? C[r, c] : 0) + sum_{k < K} A(r, k) B(k, c) for r < M, c < N, with
///   A(r, k) = a[r * a_rs + k * a_ks]   (any strides: a row-major A, or a transposed view)
///   B(k, c) = b[k * ldb + c]           (row-major [K, N], ldb >= N)
///   C row-major [M, N] (ldc >= N).
/// Each C[r, c] is one FMA chain over k = 0, 1, ..., K-1 (started from C when accumulating), so
/// its value depends only on its row of A, its column of B and K. B is never read past column N,
/// C never written past it. `scratch` holds kGemmStridedScratchFloats floats (any alignment); with
/// it, a B of up to 128 K floats (K <= 256) is packed whole (the weight-gradient shapes). Without
/// scratch (null, or the overload without it), 128 KB of stack buffers serve. Allocates nothing.
/// Preconditions: C does not alias A or B; scratch aliases nothing.
template <class Arch = simd::DefaultArch>
void gemm_strided(Index M, Index N, Index K, float const* a, Index a_rs, Index a_ks, float const* b,
                  Index ldb, float* c, Index ldc, bool accumulate);

template <class Arch = simd::DefaultArch>
void gemm_strided(Index M, Index N, Index K, float const* a, Index a_rs, Index a_ks, float const* b,
                  Index ldb, float* c, Index ldc, bool accumulate, float* scratch) {
  if (scratch == nullptr || M <= 0 || N <= 0 || K <= 0) {
    gemm_strided<Arch>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, accumulate);
    return;
  }
  auto const addr = reinterpret_cast<std::uintptr_t>(scratch);
  float* const bbuf = scratch + ((64 - addr % 64) % 64) / sizeof(float);
  detail::gemm_strided_impl<Arch>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, accumulate, bbuf,
                                  bbuf + detail::kStridedWholeB, true);
}

/// gemm_strided without scratch: depth slices through 128 KB of stack buffers (same results).
template <class Arch>
void gemm_strided(Index M, Index N, Index K, float const* a, Index a_rs, Index a_ks, float const* b,
                  Index ldb, float* c, Index ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) {
      for (Index r = 0; r < M; ++r) std::fill(c + r * ldc, c + r * ldc + N, 0.0f);
    }
    return;
  }
  alignas(64) float bbuf[detail::kStridedDeepSlice * strided_width<Arch>()];
  alignas(64) float abuf[detail::kStridedRowChunk * detail::kStridedDeepSlice];
  detail::gemm_strided_impl<Arch>(M, N, K, a, a_rs, a_ks, b, ldb, c, ldc, accumulate, bbuf, abuf,
                                  false);
}

}  // namespace moe::kernels

// Compiled once for our own binaries (see MOE_SDPA_INSTANTIATION in kernels/sdpa.hpp).
#define MOE_GEMM_STRIDED_INSTANTIATION(EXTERN, Arch)                                          \
  EXTERN template void moe::kernels::detail::gemm_strided_impl<Arch>(                         \
      moe::Index, moe::Index, moe::Index, float const*, moe::Index, moe::Index, float const*, \
      moe::Index, float*, moe::Index, bool, float*, float*, bool)
#if defined(MOE_EXTERN_EXPERT_KERNELS)
MOE_GEMM_STRIDED_INSTANTIATION(extern, moe::kernels::simd::DefaultArch);
#endif
