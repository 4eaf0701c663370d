// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// AMX bf16 tiles for the expert GEMMs (kernels::expert_cols with moe::Bf16Kernel::kAmx).
///
/// The bf16 weight panels of ExpertBank::pack are already in AMX's "VNNI" layout: a panel row kp
/// holds, for each of its 32 columns, the pair (W[n, 2kp], W[n, 2kp + 1]) as one 32-bit word, so
/// 16 panel rows from column 0 (or 16) with a 128-byte stride are one B tile (16 pair rows x 16
/// columns). The activations, rounded to bf16 pairs (bf16_pairs_rows), with the row stride
/// padded to 16 pairs, give A tiles (16 rows x 16 pairs) the same way. One tdpbf16ps adds
/// A (16 x 32 bf16) x B (32 x 16 bf16) to a 16 x 16 fp32 C tile.
///
/// Tiles (palette 1, all 16 rows x 64 bytes): C 0-3 (row tile r, column half h: tile 2r + h),
/// A 4-5 (row tile r), B 6-7 (column half h): 2 x 2 blocking, each B tile used by 2 row tiles
/// and each A tile by 2 column halves.
///
/// Every C element is the fp32 sum of its row's and column's pair products over k in ascending
/// steps of 32 (the order inside a step is the hardware's, fixed), so it depends only on its row,
/// its column and K: bitwise the same for any row count, blocking, work split or thread count.
/// tdpbf16ps treats denormal inputs as zero and flushes denormal results, rounds to nearest even
/// and never traps; NaN and Inf propagate.
#pragma once

#include <cstdint>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/detail/amx.hpp"

#if MOE_HAS_AMX_BF16
#include <immintrin.h>

namespace moe::kernels::detail {

/// C = A x panel over all `steps` steps of 16 pairs, for R row tiles (16 R rows) and one
/// 32-column panel: c[r * 32 + n] = sum over kp of pair(A[r, kp]) . pair(B[kp, n]).
/// Step s < full reads the panel at b + s * 512 words (16 rows of 32 words, a 128-byte stride);
/// step s = full (a depth that is not a multiple of 16 pairs) reads b_tail (16 rows of 32 words,
/// zero past the panel's depth). A is tiled: the 16 x 16-pair tile of row tile r and step s is
/// 1 KiB at a + (r * steps + s) * 256 words. `c` is 32 x 16 R floats (row stride 32), 64-byte
/// aligned.
template <int R>
MOE_ALWAYS_INLINE void amx_panel_block(std::uint32_t const* a, Index steps, std::uint32_t const* b,
                                       Index full, std::uint32_t const* b_tail, float* c) {
  static_assert(R == 1 || R == 2);
  amx_memory_barrier();
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (Index s = 0; s < steps; ++s) {
    std::uint32_t const* bk = s < full ? b + s * 512 : b_tail;
    std::uint32_t const* ak = a + s * 256;
    _tile_loadd(6, bk, 128);
    _tile_loadd(4, ak, 64);
    _tile_loadd(7, bk + 16, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, ak + steps * 256, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if constexpr (R == 2) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
  amx_memory_barrier();
}

}  // namespace moe::kernels::detail
#endif
