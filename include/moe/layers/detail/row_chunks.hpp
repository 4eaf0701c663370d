// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Work items of a backward's row phase (not public API): each expert's rows, in chunks, shared
/// by every layer through the routed-experts engine (stages::RoutedExperts::backward_rows).
#pragma once

#include <vector>

#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/layers/detail/bf16_train.hpp"

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

/// The row phase of one chunk: bank.backward_rows over rows [c.r0, c.r1) of the row-major
/// buffers h [R, P], dy [R, D], m [R, F], dh [R, P] and dx [R, D] (P = bank.hidden_cols()).
template <class Bank>
void backward_chunk(Bank const& bank, RowChunk c, float const* h, float const* dy, float* m,
                    float* dh, float* dx, float* scratch) {
  Index const r = c.r0, n = c.r1 - c.r0;
  Index const P = bank.hidden_cols(), D = bank.d_model(), F = bank.d_ffn();
  expert_backward_rows(bank, c.e, ConstMatrixView<float>(h + r * P, n, P),
                       ConstMatrixView<float>(dy + r * D, n, D), MatrixView<float>(m + r * F, n, F),
                       MatrixView<float>(dh + r * P, n, P), MatrixView<float>(dx + r * D, n, D),
                       scratch);
}

}  // namespace moe::detail
