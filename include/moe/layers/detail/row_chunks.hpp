// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Work items of a backward's row phase (not public API): each expert's rows, in chunks, shared
/// by MoeFfn, MoeAttention and ExpertParallelMoeFfn so that all three split rows alike.
#pragma once

#include <vector>

#include "moe/core/types.hpp"

namespace moe::detail {

/// Rows [r0, r1) of expert e: one work item of a backward's row phase (ExpertBank::backward_rows).
struct RowChunk {
  Index e, r0, r1;
};

/// At most this many rows per row-phase item: an expert's rows stay in one item up to this
/// count, so its W_down and W_in are streamed once for all of them, not once per tile.
inline constexpr Index kBackwardRows = 256;

/// Appends expert e's n rows, starting at row `base`, as ceil(n / kBackwardRows) chunks of
/// near-equal size (sizes differ by at most one). The split depends on n alone.
inline void add_row_chunks(std::vector<RowChunk>& out, Index e, Index base, Index n) {
  if (n <= 0) return;
  Index const k = (n + kBackwardRows - 1) / kBackwardRows;
  for (Index i = 0; i < k; ++i) {
    out.push_back({e, base + i * n / k, base + (i + 1) * n / k});
  }
}

}  // namespace moe::detail
