// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// What the AMX kernels share (AMX bf16: detail/amx_bf16.hpp; AMX int8: kernels/quant_gemm.hpp):
/// the tile configuration, its release and a compiler barrier for the tile intrinsics.
/// Tile state is per thread: a call that uses tiles configures them first and releases them when
/// done, so kernels with different tile shapes can follow each other on one thread.
#pragma once

#include <cstdint>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"

#if MOE_HAS_AMX_BF16 || MOE_HAS_AMX_INT8
#include <immintrin.h>

namespace moe::kernels::detail {

/// A compiler barrier for memory. GCC 12's tile intrinsics are asm statements that do not tell
/// the compiler which memory they read or write (ldtilecfg names only the first 8 bytes of its
/// operand, tileloadd and tilestored no memory at all), so the stores that fill the tiles'
/// sources must be complete before them and the reads of their results must come after.
MOE_ALWAYS_INLINE void amx_memory_barrier() { asm volatile("" ::: "memory"); }

/// ldtilecfg's 64-byte operand: palette 1, per tile its bytes a row (colsb) and rows.
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

/// Loads `c` as this thread's tile configuration.
MOE_ALWAYS_INLINE void amx_configure(AmxTileConfig const& c) {
  amx_memory_barrier();
  _tile_loadconfig(&c);
  amx_memory_barrier();
}

/// Configures tiles 0-7 as 16 rows x 64 bytes (the bf16 kernel's shapes).
MOE_ALWAYS_INLINE void amx_configure() {
  AmxTileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  amx_configure(c);
}

/// Returns the tile state to init (the kernel then saves none of it on a context switch).
MOE_ALWAYS_INLINE void amx_release() { _tile_release(); }

}  // namespace moe::kernels::detail
#endif
