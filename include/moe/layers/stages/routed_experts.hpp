// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The routed-experts engine every MoE layer runs its experts through: expert e's rows are
/// [offsets[e], offsets[e + 1]) of an expert-major row space; forward
///   m = act(x W_gate^T) * (x W_up^T)   (in projection, activation in the epilogue)
///   Y = (m W_down^T) * w_row           (down projection, routing weight in the epilogue)
/// over packed fp32 / bf16 panels or raw weights, bf16 input pairs rounded once, the next
/// item's panel prefetched; backward: dm = dY W_down, the activation VJP, dX = dH W_in per row
/// chunk, and the weight gradients dW_in += dH^T X, dW_down += dY^T m. Not public API.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "moe/core/memory.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/layers/detail/row_chunks.hpp"
#include "moe/layers/stages/work.hpp"

namespace moe::stages {

/// Expert e's rows are [offsets[e], offsets[e + 1]) for e in [0, count); offsets[0] = 0. With
/// `only`, the enqueue calls take just the experts e with only[e] == want (a phase of a forward
/// whose experts become readable in two steps: ExpertSchedule).
struct ExpertRows {
  Index const* offsets = nullptr;
  Index count = 0;
  unsigned char const* only = nullptr;
  unsigned char want = 1;
  Index rows(Index e) const { return offsets[e + 1] - offsets[e]; }
  Index total() const { return count > 0 ? offsets[count] : 0; }
  /// Does this phase leave expert e out (no rows, or another phase's)?
  bool skips(Index e) const { return rows(e) == 0 || (only != nullptr && only[e] != want); }
};

/// How a forward runs: training keeps pre-activations and the fp32 weights (or the bf16 train
/// panels of a bank in bf16-compute mode); inference may read bf16 panels, then with
/// AVX512-BF16 through bf16 input pairs.
struct ExpertMode {
  bool train = false;
  bool pairs = false;  ///< inputs handed over as bf16 pairs (see detail::uses_bf16_pairs)
  bool q8 = false;     ///< inputs handed over as int8 rows (see detail::uses_q8_rows)
};

/// The routed experts' buffers (expert-major rows, R of them) and the engine that fills them.
struct RoutedExperts {
  std::vector<float> x_rows;  ///< [R, D] inputs, when the layer materialises them (training)
  std::vector<float> hidden;  ///< [R, P] pre-activations (training)
  std::vector<float> act;     ///< [R, F] activations m
  /// [R, D] outputs (times the routing weight when the layer asks for it); 64-byte aligned, so
  /// a large one can be written with non-temporal stores.
  HugePageVector<float> out;
  std::vector<std::uint32_t> act_pairs;  ///< [R, ceil(F / 2)] bf16 pairs of m (inference)
  std::vector<std::byte> act_q8;  ///< [R] int8 rows of m (kernels::q8_row_bytes(F) bytes each)
  // Backward.
  std::vector<float> d_out;    ///< [R, D] dL/d(outputs)
  std::vector<float> dx_rows;  ///< [R, D] dL/d(inputs)
  std::vector<float> dhidden;  ///< [R, P]
  std::vector<detail::RowChunk> chunks;

  /// Sizes the forward's buffers for R rows of `bank`'s experts; x_rows too with `keep_inputs`
  /// (otherwise its owner sizes it: an exchange fills it, or the rows are read in place).
  template <class Bank>
  void prepare(Bank const& bank, Index R, ExpertMode mode, bool keep_inputs) {
    Index const D = bank.d_model(), F = bank.d_ffn();
    if (keep_inputs) x_rows.resize(static_cast<std::size_t>(R * D));
    hidden.resize(static_cast<std::size_t>(mode.train ? R * bank.hidden_cols() : 0));
    act.resize(static_cast<std::size_t>(R * F));
    out.resize(static_cast<std::size_t>(R * D));
    act_pairs.resize(static_cast<std::size_t>(mode.pairs ? R * ((F + 1) / 2) : 0));
    act_q8.resize(static_cast<std::size_t>(mode.q8 ? R * kernels::q8_row_bytes(F) : 0));
  }
  template <class Bank>
  void reserve(Bank const& bank, Index R) {
    act.reserve(static_cast<std::size_t>(R * bank.d_ffn()));
    out.reserve(static_cast<std::size_t>(R * bank.d_model()));
    if (kernels::bf16_dot_products()) {
      act_pairs.reserve(static_cast<std::size_t>(R * ((bank.d_ffn() + 1) / 2)));
    }
    if (bank.packed_quant_any()) {
      act_q8.reserve(static_cast<std::size_t>(R * kernels::q8_row_bytes(bank.d_ffn())));
    }
  }

  /// x_rows[r] = x[row_token[r]] for the R rows (training: the rows the weight gradient reads).
  void gather(ConstMatrixView<float> x, Index const* row_token, Index R, ThreadPool* pool) {
    Index const D = x.cols;
    parallel_for(pool, (R + 63) / 64, [&](Index i, int) {
      Index const r0 = i * 64, n = std::min<Index>(64, R - r0);
      kernels::gather_rows(x.data, x.row_stride, row_token + r0, n, D, x_rows.data() + r0 * D, D);
    });
  }

  /// x_rows[r] *= weight[r] (input-scaled routing: the experts see w_r x_t).
  void scale_inputs(float const* weight, Index R, Index D, ThreadPool* pool) {
    parallel_for(pool, (R + 63) / 64, [&](Index i, int) {
      for (Index r = i * 64; r < std::min<Index>(R, i * 64 + 64); ++r) {
        float* row = x_rows.data() + r * D;
        for (Index c = 0; c < D; ++c) row[c] *= weight[r];
      }
    });
  }

  /// Backward of scale_inputs, after backward_rows: dweight[t, s] = <dx_rows[r], x[t]> for the
  /// row r of each chosen slot (overwriting the combine's), then dx_rows[r] *= weight[r].
  void scaled_input_grads(ConstMatrixView<float> x, RoutingPlan const& plan, Selection const& sel,
                          float* dweight, ThreadPool* pool) {
    Index const T = x.rows, D = x.cols, S = sel.slots;
    parallel_for(pool, (T + 63) / 64, [&](Index i, int) {
      for (Index t = i * 64; t < std::min<Index>(T, i * 64 + 64); ++t) {
        Index j = plan.token_offsets[t];
        for (Index s = 0; s < S; ++s) {
          if (sel.expert[static_cast<std::size_t>(t * S + s)] < 0) continue;
          Index const r = plan.token_rows[j++];
          float* g = dx_rows.data() + r * D;
          float dot = 0.0f;
          for (Index c = 0; c < D; ++c) dot = std::fma(g[c], x(t, c), dot);
          dweight[t * S + s] = dot;
          float const w = plan.row_weight[r];
          for (Index c = 0; c < D; ++c) g[c] *= w;
        }
      }
    });
  }

  /// bf16-compute training (a bank in TrainCompute::kBf16, mode.train): the R input rows of
  /// x_rows rounded to bf16, after any gather or input scaling; they are the in projections' A
  /// operand and the X of dW_in.
  template <class Bank>
  void round_inputs(Bank const& bank, Index R, ExpertMode mode, ThreadPool* pool) {
    if (mode.train && detail::trains_bf16(bank)) {
      round_bf16(x_rows.data(), R * bank.d_model(), pool);
    }
  }
  /// bf16-compute training: m of the R rows rounded to bf16 (the down projections' A operand),
  /// after the in projections ran.
  template <class Bank>
  void round_hidden(Bank const& bank, Index R, ExpertMode mode, ThreadPool* pool) {
    if (mode.train && detail::trains_bf16(bank)) round_bf16(act.data(), R * bank.d_ffn(), pool);
  }

  /// In projections with the activation fused: m (and h when training) of every expert's rows,
  /// reading row r of expert e's group from a.from(offsets[e]).
  template <class Bank>
  void enqueue_in(ProjectionQueue& q, Bank const& bank, ExpertRows rows, kernels::RowSource a,
                  ExpertMode mode) {
    Index const D = bank.d_model(), F = bank.d_ffn(), P = bank.hidden_cols();
    for (Index e = 0; e < rows.count; ++e) {
      Index const r0 = rows.offsets[e], n = rows.rows(e);
      if (rows.skips(e)) continue;  // (a streamed bank holds only the routed experts)
      detail::ExpertJob job;
      job.kind = detail::ExpertJob::Kind::kRoutedHidden;
      job.a = a.from(r0);
      job.rows = n;
      job.depth = D;
      job.w = in_weights(bank, e, !mode.train, n);
      job.c = act.data() + r0 * F;
      job.ldc = F;
      job.cols = F;
      job.h = mode.train ? hidden.data() + r0 * P : nullptr;
      job.ldh = P;
      job.bias = bank.in_bias_data(e);
      job.clamp = bank.glu_clamp();
      q.add(job);
    }
  }

  /// The bf16 pairs and int8 rows of m for the down projections (a null task unless mode.pairs
  /// or mode.q8).
  template <class Bank>
  detail::PairsTask act_pairs_task(Bank const& bank, Index R) {
    Index const F = bank.d_ffn();
    return {act.data(),
            F,
            R,
            F,
            act_pairs.empty() ? nullptr : act_pairs.data(),
            act_q8.empty() ? nullptr : act_q8.data()};
  }

  /// Down projections Y = m W_down^T, times scale[r] when `scale` is given (inference: the
  /// routing weights); outputs of at least detail::kStreamOutputBytes go to memory with
  /// non-temporal stores (they are read next by the combine or an exchange, not while cached).
  template <class Bank>
  void enqueue_down(ProjectionQueue& q, Bank const& bank, ExpertRows rows, float const* scale,
                    ExpertMode mode) {
    Index const D = bank.d_model(), F = bank.d_ffn(), kpF = (F + 1) / 2;
    Index const rbF = kernels::q8_row_bytes(F);
    bool const stream =
        rows.total() * D * static_cast<Index>(sizeof(float)) >= detail::kStreamOutputBytes;
    for (Index e = 0; e < rows.count; ++e) {
      Index const r0 = rows.offsets[e], n = rows.rows(e);
      if (rows.skips(e)) continue;  // (a streamed bank holds only the routed experts)
      detail::ExpertJob job;
      job.a = {act.data() + r0 * F,
               F,
               nullptr,
               act_pairs.empty() ? nullptr : act_pairs.data() + r0 * kpF,
               kpF,
               act_q8.empty() ? nullptr : act_q8.data() + r0 * rbF,
               rbF};
      job.rows = n;
      job.depth = F;
      job.w = down_weights(bank, e, !mode.train, n);
      job.c = out.data() + r0 * D;
      job.ldc = D;
      job.cols = D;
      job.scale = scale ? scale + r0 : nullptr;
      job.stream = stream;
      job.bias = bank.down_bias_data(e);
      q.add(job);
    }
  }

  /// Floats of backward scratch per thread (backward_rows, then gemm_strided).
  template <class Bank>
  static Index backward_scratch(Bank const& bank) {
    return detail::expert_backward_scratch(bank, detail::kBackwardRows);
  }

  /// Row phase of the backward, from d_out: m recomputed, dhidden and dx_rows, each expert's
  /// rows in chunks of up to detail::kBackwardRows (each streams the expert's weights once).
  template <class Bank>
  void backward_rows(Bank const& bank, ExpertRows rows, ThreadPool* pool, ThreadScratch& scratch) {
    Index const R = rows.total(), D = bank.d_model();
    dx_rows.resize(static_cast<std::size_t>(R * D));
    dhidden.resize(static_cast<std::size_t>(R * bank.hidden_cols()));
    act.resize(static_cast<std::size_t>(R * bank.d_ffn()));
    chunks.clear();
    for (Index e = 0; e < rows.count; ++e) {
      detail::add_row_chunks(chunks, e, rows.offsets[e], rows.rows(e));
    }
    scratch.grow(pool, backward_scratch(bank));
    parallel_for(pool, static_cast<Index>(chunks.size()), [&](Index i, int thread) {
      detail::backward_chunk(bank, chunks[static_cast<std::size_t>(i)], hidden.data(), d_out.data(),
                             act.data(), dhidden.data(), dx_rows.data(), scratch.of(thread));
    });
  }

  /// Weight gradients of every expert with rows, into grads (an edit of a bank shaped like the
  /// experts): in_proj += dH^T X (X: `inputs` [R, D]), down_proj += dY^T m, in items of 256
  /// rows; with biases in_bias += the column sums of dH, down_bias += those of dY (rows in order).
  template <class Bank>
  void add_weight_grads(GradTasks& tasks, Bank const& bank, ExpertRows rows, float const* inputs,
                        typename Bank::Edit const& grads) const {
    Index const D = bank.d_model(), F = bank.d_ffn(), P = bank.hidden_cols();
    constexpr Index kBlock = 256;
    bool const bf16 = detail::trains_bf16(bank);
    for (Index e = 0; e < rows.count; ++e) {
      Index const r0 = rows.offsets[e], n = rows.rows(e);
      if (n == 0) continue;
      tasks.add(ConstMatrixView<float>(inputs + r0 * D, n, D),
                ConstMatrixView<float>(dhidden.data() + r0 * P, n, P), grads.in_proj(e), kBlock,
                bf16);
      tasks.add(ConstMatrixView<float>(act.data() + r0 * F, n, F),
                ConstMatrixView<float>(d_out.data() + r0 * D, n, D), grads.down_proj(e), kBlock,
                bf16);
      if (bank.has_biases()) {
        tasks.add_bias(ConstMatrixView<float>(dhidden.data() + r0 * P, n, P), grads.in_bias(e));
        tasks.add_bias(ConstMatrixView<float>(d_out.data() + r0 * D, n, D), grads.down_bias(e));
      }
    }
  }
};

}  // namespace moe::stages
