// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// combine_rows: each token's expert outputs summed in a fixed order, each output row written once;
/// scale_dot: one row of the combine's backward.
#pragma once

#include <cmath>

#include "moe/core/types.hpp"
#include "moe/kernels/simd.hpp"

namespace moe::kernels {

/// Arguments of combine_rows (plain pointers and sizes; see combine_rows for the formula).
struct CombineParams {
  float const* expert_out = nullptr;  // Y [R, cols], stride ld_expert_out
  Index ld_expert_out = 0;
  float const* row_weight = nullptr;     // [R], or null for weight 1 (the dispatch VJP)
  Index const* token_offsets = nullptr;  // [T+1] (indexes token_rows)
  Index const* token_rows = nullptr;     // [R]
  float const* shared_out = nullptr;     // S [num_shared, T, cols] (stride ld_shared, plane stride
  Index ld_shared = 0;  //   shared_plane), or null when there are no shared experts
  Index shared_plane = 0;
  Index num_shared = 0;
  float const* shared_gate = nullptr;  // [T, num_shared], or null for ungated shared experts
  Index token_begin = 0;               // tokens [token_begin, token_end) are written
  Index token_end = 0;
  Index cols = 0;
  float* out = nullptr;  // y [T, cols], stride ld_out
  Index ld_out = 0;
};

/// For t in [token_begin, token_end):
///   y[t] = sum_{j in token's rows, in order} row_weight[r_j] * Y[r_j]     (weight 1 if null)
///        + sum_{s < num_shared} g[t, s] * S[s, t]          (g = 1 when shared_gate is null)
/// The terms are accumulated left to right in exactly this order, so the result is independent
/// of how tokens are split across threads. A token with no rows and no shared experts gets 0.
/// `out` must not alias Y, S or the gates; it may be the layer's input x, which is not read here.
template <class Arch = simd::DefaultArch>
void combine_rows(CombineParams const& p) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  Index const vec_end = p.cols - p.cols % L;
  for (Index t = p.token_begin; t < p.token_end; ++t) {
    Index const j0 = p.token_offsets[t];
    Index const j1 = p.token_offsets[t + 1];
    float* y = p.out + t * p.ld_out;
    for (Index c = 0; c < vec_end; c += L) {
      B acc(0.0f);
      for (Index j = j0; j < j1; ++j) {
        Index const r = p.token_rows[j];
        B const v = B::load_unaligned(p.expert_out + r * p.ld_expert_out + c);
        acc = p.row_weight ? xsimd::fma(B(p.row_weight[r]), v, acc) : acc + v;
      }
      for (Index s = 0; s < p.num_shared; ++s) {
        B const v = B::load_unaligned(p.shared_out + s * p.shared_plane + t * p.ld_shared + c);
        acc = p.shared_gate ? xsimd::fma(B(p.shared_gate[t * p.num_shared + s]), v, acc) : acc + v;
      }
      acc.store_unaligned(y + c);
    }
    for (Index c = vec_end; c < p.cols; ++c) {
      float acc = 0.0f;
      for (Index j = j0; j < j1; ++j) {
        Index const r = p.token_rows[j];
        float const v = p.expert_out[r * p.ld_expert_out + c];
        acc = p.row_weight ? std::fma(p.row_weight[r], v, acc) : acc + v;
      }
      for (Index s = 0; s < p.num_shared; ++s) {
        float const v = p.shared_out[s * p.shared_plane + t * p.ld_shared + c];
        acc = p.shared_gate ? std::fma(p.shared_gate[t * p.num_shared + s], v, acc) : acc + v;
      }
      y[c] = acc;
    }
  }
}

/// One row of the combine's VJP, for a term w * y of a token's output with upstream gradient g:
///   dst[c] = w * g[c]  (c < n)   and returns   <g, y> = sum_c g[c] y[c]
/// (dL/dy for the expert row and dL/dw for its routing weight or gate). The dot product is
/// accumulated in SIMD lanes (two batch accumulators over alternating blocks of L, added, then
/// reduced with simd::reduce_add, then the scalar tail in order), so its value depends only on
/// the inputs and n. dst may alias g; it must not alias y. NaN/Inf propagate as IEEE arithmetic.
template <class Arch = simd::DefaultArch>
float scale_dot(float const* g, float const* y, float w, float* dst, Index n) {
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  B const wb(w);
  B acc0(0.0f), acc1(0.0f);
  Index c = 0;
  for (; c + 2 * L <= n; c += 2 * L) {
    B const g0 = B::load_unaligned(g + c), g1 = B::load_unaligned(g + c + L);
    acc0 = xsimd::fma(g0, B::load_unaligned(y + c), acc0);
    acc1 = xsimd::fma(g1, B::load_unaligned(y + c + L), acc1);
    (wb * g0).store_unaligned(dst + c);
    (wb * g1).store_unaligned(dst + c + L);
  }
  if (c + L <= n) {
    B const g0 = B::load_unaligned(g + c);
    acc0 = xsimd::fma(g0, B::load_unaligned(y + c), acc0);
    (wb * g0).store_unaligned(dst + c);
    c += L;
  }
  float dot = simd::reduce_add(B(acc0 + acc1));
  for (; c < n; ++c) {
    dot = std::fma(g[c], y[c], dot);
    dst[c] = w * g[c];
  }
  return dot;
}

}  // namespace moe::kernels
