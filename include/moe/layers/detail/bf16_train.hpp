// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The backward products of the bf16-compute training mode (ExpertBank::set_train_compute
/// (TrainCompute::kBf16)), on kernels::expert_cols over bf16 panels, so that they run on the
/// CPU's bf16 unit (AMX tiles, AVX512-BF16 dot products, or widened to fp32 FMAs):
///   - row phase: dM = dY W_down and dX = dH W_in against the bank's transposed train panels,
///     dY and dH rounded to bf16 first; the activation VJP in fp32 between them;
///   - weight gradients with bf16 dot products (AMX, AVX512-BF16): grad [N, K] += dC^T A over
///     n rows, in blocks of kBf16GradRows rows (the depth of one product, in row order): A's
///     blocks packed once into bf16 panels (bf16_pack_block, by stages::GradTasks), dC^T rounded
///     into a row buffer per item, each block's product added to the fp32 gradient
///     (StoreEpilogue::accumulate). Where bf16 is widened to fp32 anyway, GradTasks instead
///     rounds A and dC to bf16 values in fp32 copies and runs kernels::gemm_strided on them (the
///     same arithmetic: products of bf16 values are exact in fp32).
/// Each output element is one fixed sum for a given kernel path: bitwise identical for any
/// number of threads. Not public API.
#pragma once

#include <algorithm>
#include <cstdint>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/kernels/expert_gemm.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_strided.hpp"

namespace moe::detail {

/// Does a training step over `bank` run in bf16 (set_train_compute(kBf16))?
template <class Bank>
bool trains_bf16(Bank const& bank) {
  return bank.train_compute() == experts::TrainCompute::kBf16;
}

/// Throws unless the bf16 train panels of a bank in bf16-compute mode are current.
template <class Bank>
void require_train_panels(Bank const& bank) {
  check(bank.train_panels_current(),
        "MoE layer: the expert bank trains in bf16 (TrainCompute::kBf16) but its bf16 copies of "
        "the weights are not current: an edit scope (ExpertBank::Edit, or a layer's "
        "parameters() list) is still open; let it end before the training forward");
}

/// Floats of scratch expert_backward_rows needs for n rows of `bank`.
template <class Bank>
Index expert_backward_scratch(Bank const& bank, Index n) {
  if (!trains_bf16(bank)) return bank.backward_scratch_floats(n);
  Index const D = bank.d_model(), F = bank.d_ffn(), P = bank.hidden_cols();
  return n * (D + F + P) + kernels::expert_scratch_floats(std::max(D, P)) + 16;
}

/// Row phase of the backward of expert e over n rows (see ExpertBank::backward_rows): m
/// recomputed, dh and dx, in fp32 or (bf16-compute mode) with bf16 products.
template <class Bank>
void expert_backward_rows(Bank const& bank, Index e, ConstMatrixView<float> h,
                          ConstMatrixView<float> dy, MatrixView<float> m, MatrixView<float> dh,
                          MatrixView<float> dx, float* scratch) {
  if (!trains_bf16(bank)) {
    bank.backward_rows(e, h, dy, m, dh, dx, scratch);
    return;
  }
  require_train_panels(bank);
  Index const n = h.rows, D = bank.d_model(), F = bank.d_ffn(), P = bank.hidden_cols();
  Index const np = kernels::panel_width();
  if (n == 0) return;
  float* const dy16 = scratch;
  float* const dm = dy16 + n * D;
  float* const dh16 = dm + n * F;
  float* const ks = dh16 + n * P;
  for (Index i = 0; i < n; ++i) {
    for (Index c = 0; c < D; ++c) dy16[i * D + c] = kernels::round_bf16_activation(dy(i, c));
  }
  kernels::WeightPanels wd;
  wd.bf16[0] = bank.train_down_t_bf16(e);
  kernels::expert_cols(kernels::RowSource{dy16, D, nullptr}, n, D, wd, 0, (F + np - 1) / np,
                       kernels::StoreEpilogue{dm, F, F}, ks);
  bank.activation_backward(h, ConstMatrixView<float>(dm, n, F), m, dh);
  for (Index i = 0; i < n; ++i) {
    for (Index c = 0; c < P; ++c) dh16[i * P + c] = kernels::round_bf16_activation(dh(i, c));
  }
  kernels::WeightPanels wi;
  wi.bf16[0] = bank.train_in_t_bf16(e);
  kernels::expert_cols(kernels::RowSource{dh16, P, nullptr}, n, P, wi, 0, (D + np - 1) / np,
                       kernels::StoreEpilogue{dx.data, dx.row_stride, D}, ks);
}

/// Rows of A (and dC) per product of a bf16 weight-gradient item: its depth.
inline constexpr Index kBf16GradRows = 256;
/// Gradient rows per bf16 weight-gradient item, at most.
inline constexpr Index kBf16GradBlock = 256;
/// Gradient rows per expert_cols call of an item (one AMX row tile).
inline constexpr Index kBf16GradGroupRows = 16;

/// Words of the bf16 panels of one kBf16GradRows-row block of an A with K columns
/// (bf16_pack_block).
inline Index bf16_block_words(Index K) {
  Index const np = kernels::panel_width();
  return (K + np - 1) / np * (kBf16GradRows / 2) * np;
}

/// Rows [b kBf16GradRows, (b + 1) kBf16GradRows) of A [n, K] (fewer in the last block) as the
/// bf16 panels bf16_weight_grad multiplies: ceil(K / NP) panels of depth = the block's rows
/// (kernels::pack_panels_bf16_t), at dst (bf16_block_words(K) words, 64-byte aligned).
inline void bf16_pack_block(ConstMatrixView<float> a, Index b, std::uint32_t* dst) {
  Index const t0 = b * kBf16GradRows, nb = std::min(kBf16GradRows, a.rows - t0);
  kernels::pack_panels_bf16_t(a.row(t0), a.row_stride, a.cols, nb, dst);
}

/// Floats of scratch bf16_weight_grad needs.
inline Index bf16_weight_grad_scratch() {
  return kBf16GradBlock * kBf16GradRows + kernels::expert_scratch_floats(kBf16GradRows) + 16;
}

/// grad rows [r0, r1) += dC[:, r0:r1]^T A with bf16 operands and fp32 accumulation: A [n, K]
/// (given as its blocks' panels, `a_panels`: block b at b * bf16_block_words(K) words, see
/// bf16_pack_block), dC [n, N], grad [N, K], r1 - r0 <= kBf16GradBlock; one product per block
/// of kBf16GradRows rows, each added to grad, blocks in row order. `scratch`:
/// bf16_weight_grad_scratch() floats.
inline void bf16_weight_grad(Index n, Index K, std::uint32_t const* a_panels,
                             ConstMatrixView<float> dc, MatrixView<float> grad, Index r0, Index r1,
                             float* scratch) {
  Index const rows = r1 - r0, np = kernels::panel_width(), panels = (K + np - 1) / np;
  float* const at = scratch;  // [rows, nb]: dC^T of the block, rounded
  float* const ks = at + kBf16GradBlock * kBf16GradRows;
  for (Index t0 = 0, b = 0; t0 < n; t0 += kBf16GradRows, ++b) {
    Index const nb = std::min(kBf16GradRows, n - t0);
    for (Index t = 0; t < nb; ++t) {
      float const* d = dc.row(t0 + t) + r0;
      for (Index i = 0; i < rows; ++i) at[i * nb + t] = kernels::round_bf16_activation(d[i]);
    }
    kernels::WeightPanels w;
    w.bf16[0] = a_panels + b * bf16_block_words(K);
    // Groups of kBf16GradGroupRows gradient rows across all panels: each group's rows of the
    // gradient (the DRAM traffic: read, add, write) stream contiguously, A's panels stay in L2.
    for (Index i0 = 0; i0 < rows; i0 += kBf16GradGroupRows) {
      kernels::StoreEpilogue epi{grad.row(r0 + i0), grad.row_stride, K};
      epi.accumulate = true;
      kernels::expert_cols(kernels::RowSource{at + i0 * nb, nb, nullptr},
                           std::min(kBf16GradGroupRows, rows - i0), nb, w, 0, panels, epi, ks);
    }
  }
}

}  // namespace moe::detail
