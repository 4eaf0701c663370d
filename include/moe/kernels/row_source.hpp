// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RowSource: the activation rows an expert GEMM reads in place, optionally through an index.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe/core/config.hpp"
#include "moe/core/types.hpp"

namespace moe::kernels {

/// Rows of an activation matrix read in place: row i is base + (index ? index[i] : i) * ld.
/// With an index (e.g. RoutingPlan::row_token of one expert) the gather is part of the GEMM.
/// Optionally `pairs` holds the same rows already rounded to bf16 pairs (bf16_pairs_rows, row
/// stride ldp words, addressed through the same index): the AVX512-BF16 path of expert_cols then
/// reads them instead of rounding the rows itself (once per call), so a layer rounds each row
/// once per forward. Likewise `q8` holds the rows quantized to int8 blocks (quantize_rows_q8,
/// row stride ldq bytes) for the quantized-weight kernels (quant_cols). Each is ignored by every
/// other path.
struct RowSource {
  float const* base = nullptr;
  Index ld = 0;
  Index const* index = nullptr;
  std::uint32_t const* pairs = nullptr;
  Index ldp = 0;
  std::byte const* q8 = nullptr;
  Index ldq = 0;
  MOE_ALWAYS_INLINE Index at(Index i) const { return index ? index[i] : i; }
  MOE_ALWAYS_INLINE float const* row(Index i) const { return base + at(i) * ld; }
  /// The same source from row r on: the index advanced, or (rows in place) the base, the
  /// pairs and the q8 rows, which then move together.
  MOE_ALWAYS_INLINE RowSource from(Index r) const {
    RowSource s = *this;
    if (s.index) {
      s.index += r;
    } else {
      s.base += r * ld;
      if (s.pairs) s.pairs += r * ldp;
      if (s.q8) s.q8 += r * ldq;
    }
    return s;
  }
};

}  // namespace moe::kernels
