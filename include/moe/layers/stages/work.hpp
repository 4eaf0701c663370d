// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The work lists the pipeline stages fill and a layer runs: projections (ProjectionQueue),
/// weight gradients (GradTasks) and the input-gradient terms of a token tile (DxTerms). Items
/// are fixed by the shapes alone and every output element is computed by one item in a fixed
/// order, so results are bitwise identical for any number of threads. Not public API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/expert_gemm.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/layers/detail/bf16_train.hpp"
#include "moe/layers/detail/expert_jobs.hpp"

namespace moe::stages {

/// Which layer filled a training cache, and for what shapes: backward checks it, so a workspace
/// filled by another layer (or by none) is an error, never an out-of-bounds read.
struct Stamp {
  void const* layer = nullptr;  ///< null: empty (no training forward since the last backward)
  Index tokens = 0, d_model = 0, experts = 0, ffn = 0;
  bool filled() const { return layer != nullptr; }
  bool operator==(Stamp const&) const = default;
};

/// Per-thread scratch, grown to `threads * per` floats (no allocation once it has been that big).
class ThreadScratch {
 public:
  float* grow(ThreadPool* pool, Index per) {
    per_ = (per + 15) / 16 * 16;
    Index const n = static_cast<Index>(pool ? pool->size() : 1) * per_;
    if (static_cast<Index>(buf_.size()) < n) buf_.resize(static_cast<std::size_t>(n));
    return buf_.data();
  }
  void reserve(int threads, Index per) {
    buf_.reserve(static_cast<std::size_t>(threads * ((per + 15) / 16 * 16)));
  }
  float* of(int thread) { return buf_.data() + thread * per_; }
  Index per_thread() const { return per_; }

 private:
  std::vector<float> buf_;
  Index per_ = 0;
};

/// Projections C = A W^T of one phase of a layer, with their epilogues (detail::ExpertJob): the
/// stages add jobs, the layer runs them all at once (kernels::expert_cols, items handed out
/// dynamically with the next item's first panel prefetched).
class ProjectionQueue {
 public:
  void add(detail::ExpertJob const& job) {
    depth_ = std::max(depth_, job.depth);
    detail::add_expert_job(jobs_, items_, job);
  }
  /// Runs and clears the queue. RoutedX / SharedX: the expert kinds of the kRoutedHidden and
  /// kSharedHidden jobs' activation epilogues.
  template <class RoutedX, class SharedX>
  void run(ThreadPool* pool) {
    Index const per = kernels::expert_scratch_floats(depth_);
    float* s = scratch_.grow(pool, per);
    detail::run_expert_jobs<RoutedX, SharedX>(jobs_, items_, pool, s, scratch_.per_thread());
    depth_ = 0;
  }
  /// Room for `jobs` jobs of up to `items` items, and scratch for `threads` at depth `depth`.
  void reserve(Index jobs, Index items, int threads, Index depth) {
    jobs_.reserve(static_cast<std::size_t>(jobs));
    items_.reserve(static_cast<std::size_t>(items));
    scratch_.reserve(threads, kernels::expert_scratch_floats(depth));
  }

 private:
  std::vector<detail::ExpertJob> jobs_;
  std::vector<detail::ExpertItem> items_;
  ThreadScratch scratch_;
  Index depth_ = 0;
};

/// C[:, 0:cols] = A W^T with W [cols, depth] fp32 rows read in place, as a job of a
/// ProjectionQueue: dot products (each weight row streamed once) for fewer than
/// kernels::kPanelMinRows rows, panels packed per call into scratch from there on (the path
/// depends on `rows` alone, so a row's bits do not depend on the column split or the threads).
inline detail::ExpertJob raw_job(float const* a, Index lda, Index rows, float const* w, Index depth,
                                 float* c, Index ldc, Index cols) {
  detail::ExpertJob j;
  j.kind = detail::ExpertJob::Kind::kStore;
  j.a = kernels::RowSource{a, lda};
  j.rows = rows;
  j.depth = depth;
  j.w.raw[0] = w;
  j.w.raw_rows[0] = cols;
  j.w.dot_products = rows < kernels::kPanelMinRows;
  j.c = c;
  j.ldc = ldc;
  j.cols = cols;
  return j;
}

/// The weights of a projection as expert_cols reads them (see detail::expert_weights); raw
/// weights go through dot products when the projection has fewer than kPanelMinRows rows in
/// `path_rows` (the rows the single-process layer gives it).
inline kernels::WeightPanels weights_for(float const* raw, Index rows, float const* packed,
                                         std::uint32_t const* packed_bf16, Index depth, Index half,
                                         bool use_bf16, Index path_rows,
                                         kernels::QuantWeights const* quant = nullptr) {
  return detail::expert_weights(raw, rows, packed, packed_bf16, depth, half, use_bf16,
                                path_rows < kernels::kPanelMinRows, quant);
}

/// Throws unless `w` reads a pack: a bank without its fp32 weights
/// (ExpertBank::discard_master_weights) runs only forwards that read the pack.
template <class Bank>
kernels::WeightPanels from_pack(Bank const& bank, Index e, kernels::WeightPanels const& w,
                                bool inference) {
  if (!bank.has_master_weights()) {
    detail::check(w.f32[0] || w.bf16[0] || w.quant[0].data, "MoE layer: expert ", e,
                  "'s fp32 weights were discarded (ExpertBank::discard_master_weights) and this ",
                  inference ? "forward" : "training forward", " needs them (",
                  inference ? "the pack does not hold this projection as the kernels read it"
                            : "training multiplies the exact fp32 weights",
                  "); run inference forwards only, or keep the weights");
  }
  return w;
}

/// Expert e's in projection (gate and up) of `bank` as expert_cols reads it: the packed
/// format of that expert when `inference`; in training the bf16 train panels of a bank in
/// bf16-compute mode, else fp32 panels or raw weights.
template <class Bank>
kernels::WeightPanels in_weights(Bank const& bank, Index e, bool inference, Index path_rows) {
  if (!inference && detail::trains_bf16(bank)) {
    detail::require_train_panels(bank);
    kernels::WeightPanels w;
    w.bf16[0] = bank.train_in_bf16(e, 0);
    if constexpr (Bank::Expert::gated) w.bf16[1] = bank.train_in_bf16(e, 1);
    return w;
  }
  Index const half = Bank::Expert::gated ? bank.d_ffn() : 0;
  auto const q = bank.packed_in_quant(e);
  float const* raw = bank.has_master_weights() ? bank.in_proj(e).data : nullptr;
  return from_pack(bank, e,
                   weights_for(raw, bank.hidden_cols(), bank.packed_in(e), bank.packed_in_bf16(e),
                               bank.d_model(), half, inference, path_rows, q.data()),
                   inference);
}
/// Expert e's down projection, likewise.
template <class Bank>
kernels::WeightPanels down_weights(Bank const& bank, Index e, bool inference, Index path_rows) {
  if (!inference && detail::trains_bf16(bank)) {
    detail::require_train_panels(bank);
    kernels::WeightPanels w;
    w.bf16[0] = bank.train_down_bf16(e);
    return w;
  }
  auto const q = bank.packed_down_quant(e);
  float const* raw = bank.has_master_weights() ? bank.down_proj(e).data : nullptr;
  return from_pack(bank, e,
                   weights_for(raw, bank.d_model(), bank.packed_down(e), bank.packed_down_bf16(e),
                               bank.d_ffn(), 0, inference, path_rows, q.data()),
                   inference);
}

/// One weight-gradient item: rows [r0, r1) of grad [N, K] += dC[:, r0:r1]^T A, A [n, K],
/// dC [n, N] (the gradient of W in C = A W^T). Each gradient element is one FMA chain over the n
/// rows in order, started from its value (kernels::gemm_strided), so it does not depend on how
/// the rows [r0, r1) are split into items. With `bf16`, the product has bf16 operands and fp32
/// accumulation (detail::bf16_weight_grad; the bf16-compute training mode).
struct GradTask {
  ConstMatrixView<float> a;
  ConstMatrixView<float> dc;
  MatrixView<float> grad;
  Index r0, r1;
  bool bf16 = false;
  Index pack = -1;  ///< bf16: which of the list's packed A operands (GradTasks::Pack)
};

/// The weight gradients of one backward, in items of `block` gradient rows.
class GradTasks {
 public:
  void clear() {
    tasks_.clear();
    packs_.clear();
    pack_words_ = 0;
    copy_floats_ = 0;
  }
  /// grad += dc^T a, split into items of `block` rows of grad (bf16: bf16 operands, at most
  /// detail::kBf16GradBlock rows an item). Nothing when a has no rows.
  void add(ConstMatrixView<float> a, ConstMatrixView<float> dc, MatrixView<float> grad,
           Index block = 64, bool bf16 = false) {
    if (a.rows == 0) return;
    Index pack = -1;
    if (bf16) {
      // The operands are prepared once, for all the items of their gradient: with bf16 dot
      // products (AMX, AVX512-BF16) A as bf16 panels, each item rounding its columns of dC;
      // where bf16 is widened to fp32 anyway, A and dC rounded to bf16 values in fp32 copies for
      // gemm_strided (products of bf16 values are exact in fp32: the same arithmetic).
      block = std::min(block, detail::kBf16GradBlock);
      pack = static_cast<Index>(packs_.size());
      Index const blocks = (a.rows + detail::kBf16GradRows - 1) / detail::kBf16GradRows;
      if (kernels::bf16_dot_products()) {
        packs_.push_back({a, dc, pack_words_, blocks, false});
        pack_words_ += blocks * detail::bf16_block_words(a.cols);
      } else {
        packs_.push_back({a, dc, copy_floats_, blocks, true});
        copy_floats_ += a.rows * (a.cols + dc.cols);
      }
    }
    for (Index r = 0; r < grad.rows; r += block) {
      tasks_.push_back({a, dc, grad, r, std::min(grad.rows, r + block), bf16, pack});
    }
  }
  /// bias += the column sums of dc [n, N] (the gradient of b in C = A W^T + b), one item per 64
  /// columns: dc^T times a column of ones (a one-float matrix of row stride 0).
  void add_bias(ConstMatrixView<float> dc, std::span<float> bias) {
    static constexpr float kOne = 1.0f;
    add(ConstMatrixView<float>(&kOne, dc.rows, 1, 0), dc,
        MatrixView<float>(bias.data(), static_cast<Index>(bias.size()), 1));
  }
  /// Runs every item (scratch: kernels::kGemmStridedScratchFloats per thread, or more).
  void run(ThreadPool* pool, ThreadScratch& scratch) {
    Index need = kernels::kGemmStridedScratchFloats;
    if (!packs_.empty()) {
      need = std::max(need, detail::bf16_weight_grad_scratch());
      // The bf16 operands, prepared once per 256-row block, in parallel.
      panels_.resize(static_cast<std::size_t>(pack_words_));
      copies_.resize(static_cast<std::size_t>(copy_floats_));
      Index total = 0;
      for (Pack const& p : packs_) total += p.blocks;
      parallel_for(pool, total, [&](Index i, int) {
        std::size_t j = 0;
        while (i >= packs_[j].blocks) i -= packs_[j++].blocks;
        Pack const& p = packs_[j];
        if (!p.copies) {
          detail::bf16_pack_block(
              p.a, i, panels_.data() + p.offset + i * detail::bf16_block_words(p.a.cols));
          return;
        }
        Index const n = p.a.rows, K = p.a.cols, N = p.dc.cols;
        float* const a16 = copies_.data() + p.offset;
        float* const dc16 = a16 + n * K;
        for (Index r = i * detail::kBf16GradRows; r < std::min(n, (i + 1) * detail::kBf16GradRows);
             ++r) {
          for (Index c = 0; c < K; ++c) a16[r * K + c] = kernels::round_bf16_activation(p.a(r, c));
          for (Index c = 0; c < N; ++c) {
            dc16[r * N + c] = kernels::round_bf16_activation(p.dc(r, c));
          }
        }
      });
    }
    float* const base = scratch.grow(pool, need);
    Index const per = scratch.per_thread();
    parallel_for(pool, static_cast<Index>(tasks_.size()), [&](Index i, int thread) {
      GradTask const& t = tasks_[static_cast<std::size_t>(i)];
      if (t.bf16) {
        Pack const& p = packs_[static_cast<std::size_t>(t.pack)];
        Index const n = t.a.rows, K = t.a.cols, N = t.dc.cols;
        if (p.copies) {
          float const* const a16 = copies_.data() + p.offset;
          kernels::gemm_strided(t.r1 - t.r0, K, n, a16 + n * K + t.r0, 1, N, a16, K,
                                t.grad.row(t.r0), t.grad.row_stride, true, base + thread * per);
        } else {
          detail::bf16_weight_grad(n, K, panels_.data() + p.offset, t.dc, t.grad, t.r0, t.r1,
                                   base + thread * per);
        }
        return;
      }
      kernels::gemm_strided(t.r1 - t.r0, t.a.cols, t.a.rows, t.dc.data + t.r0, 1, t.dc.row_stride,
                            t.a.data, t.a.row_stride, t.grad.row(t.r0), t.grad.row_stride, true,
                            base + thread * per);
    });
  }
  std::size_t size() const { return tasks_.size(); }

 private:
  /// The operands of a bf16 gradient, prepared by run(): A's bf16 panels at panels_ + offset,
  /// or (`copies`) A and dC rounded to bf16 values at copies_ + offset ([n, K] then [n, N]).
  struct Pack {
    ConstMatrixView<float> a, dc;
    Index offset = 0, blocks = 0;
    bool copies = false;
  };
  std::vector<GradTask> tasks_;
  std::vector<Pack> packs_;
  Index pack_words_ = 0, copy_floats_ = 0;
  HugePageVector<std::uint32_t> panels_;
  HugePageVector<float> copies_;
};

/// p[i] = kernels::round_bf16_activation(p[i]) for i < n, in parallel: the operands of the
/// bf16-compute training mode.
inline void round_bf16(float* p, Index n, ThreadPool* pool) {
  constexpr Index kChunk = Index{1} << 14;
  parallel_for(pool, (n + kChunk - 1) / kChunk, [&](Index i, int) {
    kernels::round_bf16_activations(p + i * kChunk, std::min(kChunk, n - i * kChunk));
  });
}

/// One term of an input gradient: dx[t] += d[t] W for the tokens of a tile, d [T, k] (row
/// stride ld), W [k, D] (row stride ldw). A layer's dx is the combine of its rows plus its
/// terms, in a fixed order.
struct DxTerm {
  float const* d = nullptr;
  Index ld = 0, k = 0;
  float const* w = nullptr;
  Index ldw = 0;
};

/// dx rows [t0, t0 + n) += sum of the terms, in order (one accumulating gemm_strided each).
inline void add_dx_terms(std::span<DxTerm const> terms, Index t0, Index n, MatrixView<float> dx) {
  float* const dxt = dx.row(t0);
  for (DxTerm const& t : terms) {
    if (t.k == 0) continue;
    kernels::gemm_strided(n, dx.cols, t.k, t.d + t0 * t.ld, t.ld, 1, t.w, t.ldw, dxt, dx.row_stride,
                          true);
  }
}

}  // namespace moe::stages
