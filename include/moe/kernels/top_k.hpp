// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Row-wise top-k selection with deterministic tie-breaking.
#pragma once

#include <cmath>

#include "moe/core/types.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// For each row of in [rows, cols] (stride ld), writes the indices and values of its k largest
/// entries to idx [rows, k] and val [rows, k] (stride k), in descending order of value.
///
/// Ties: the lower column index wins and comes first (what a stable descending sort gives).
/// Entries equal to -inf or NaN are never selected: they mark unavailable experts. If a row has
/// fewer than k selectable entries, the remaining slots get index -1 and value -inf.
/// Preconditions: 0 <= k <= cols. Cost O(cols + k * (number of improvements)); whole SIMD
/// batches that cannot beat the current k-th value are skipped with one comparison.
template <class Arch = simd::DefaultArch>
void top_k_rows(float const* in, Index ld, Index rows, Index cols, Index k, ExpertId* idx,
                float* val) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  if (k <= 0) return;
  for (Index i = 0; i < rows; ++i) {
    float const* x = in + i * ld;
    ExpertId* oi = idx + i * k;
    float* ov = val + i * k;
    for (Index s = 0; s < k; ++s) {
      oi[s] = -1;
      ov[s] = -INFINITY;
    }
    // Insert x[j] if it beats the current k-th value (strictly: ties keep the earlier index).
    auto consider = [&](Index j) {
      float const v = x[j];
      if (!(v > ov[k - 1])) return;  // also rejects NaN and -inf
      Index s = k - 1;
      while (s > 0 && v > ov[s - 1]) {
        ov[s] = ov[s - 1];
        oi[s] = oi[s - 1];
        --s;
      }
      ov[s] = v;
      oi[s] = static_cast<ExpertId>(j);
    };
    // (The tail loop counts down from the whole vectors' end: GCC 12 at -O3 with AVX2 otherwise
    // reports a false "iteration ... invokes undefined behavior" for it, -Waggressive-loop-
    // optimizations, after inlining into a caller with a known cols.)
    Index const whole = cols / L * L;
    for (Index j = 0; j < whole; j += L) {
      if (xsimd::any(B::load_unaligned(x + j) > B(ov[k - 1]))) {
        for (Index jj = j; jj < j + L; ++jj) consider(jj);
      }
    }
    for (Index t = cols - whole; t > 0; --t) consider(cols - t);
  }
}

}  // namespace moe::kernels
