// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Linear: a dense weight matrix of any WeightFormat (attention projections, LM head, dense
/// MLPs), packed once and multiplied by the same engine as the experts (stages::ProjectionQueue:
/// kernels::expert_cols, its epilogues, claim-ahead scheduling and prefetch), and LinearInput,
/// the activation rows prepared once for every Linear that reads them, and LinearQueue, the public
/// way to run products of them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/kernels/expert_gemm.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/quant_gemm.hpp"
#include "moe/layers/detail/expert_jobs.hpp"
#include "moe/layers/stages/work.hpp"
#include "moe/quant/blocks.hpp"

namespace moe {

/// A dense projection y = x W^T + b, W [N, K] (Hugging Face [out, in], row-major), b [N] or
/// none, x [T, K], y [T, N], with W packed once in a WeightFormat:
///
/// | format        | pack                               | product                                 |
/// |---------------|------------------------------------|-----------------------------------------|
/// | kF32          | fp32 panels of W (a copy, exact)   | fp32 FMA chains                         |
/// | kBf16         | bf16 panels (nearest even)         | weights widened to fp32 in registers:   |
/// |               |                                    | bitwise the kF32 product of the rounded |
/// |               |                                    | values (fp32 activations)               |
/// | GGUF blocks   | ggml's reference quantizer, row by | int8 activations (32-blocks), integer   |
/// | (q8_0 ... )   | row, re-packed for the int8 kernels| dot products (docs/quantization.md)     |
///
/// Every output element is one chain over k in ascending order whose value depends only on its
/// row, its column and K: the same bits for any T, batch, tiling or thread count. When `format`'s
/// blocks do not divide K, W is packed in resolve_format(format, K), the first format of its
/// fallback chain that holds K (format() says which, requested_format() what was asked).
/// Inference only: a training layer multiplies its fp32 parameters. A value type (copying
/// copies the pack).
class Linear {
 public:
  Linear() = default;
  /// Packs w [N, K] (row stride >= K) in `format` (or its fallback), with `bias` [N] (empty:
  /// none), in parallel on `pool` (the same pack without). Throws moe::Error for an empty
  /// matrix, a bias of another length, and a non-finite weight for a quantized format.
  Linear(ConstMatrixView<float> w, experts::WeightFormat format, std::span<float const> bias = {},
         ThreadPool* pool = nullptr)
      : rows_(w.rows),
        depth_(w.cols),
        requested_(format),
        format_(experts::resolve_format(format, std::max<Index>(1, w.cols))) {
    detail::check(w.rows >= 1 && w.cols >= 1 && w.data != nullptr && w.row_stride >= w.cols,
                  "Linear: the weight matrix is [", w.rows, ", ", w.cols,
                  "]; it needs at least one row and one column");
    detail::check(bias.empty() || static_cast<Index>(bias.size()) == rows_, "Linear: the bias has ",
                  bias.size(), " values but W has ", rows_, " rows; pass one per row (or none)");
    bias_.assign(bias.begin(), bias.end());
    Index const N = rows_, K = depth_, np = kernels::panel_width();
    if (experts::is_quantized(format_)) {
      for (Index r = 0; r < N; ++r) {
        float const* row = w.row(r);
        for (Index k = 0; k < K; ++k) {
          detail::check(std::isfinite(row[k]), "Linear: W[", r, ", ", k, "] = ", row[k],
                        " cannot be quantized to ", experts::name(format_),
                        "; only finite weights can (fix the weights or pack as bf16 or fp32)");
        }
      }
      quant::Format const qf = experts::quant_format(format_);
      Index const panels = (N + kernels::kQuantPanelCols - 1) / kernels::kQuantPanelCols;
      panel_bytes_ = kernels::quant_panel_bytes(qf, K);
      quant_.assign(static_cast<std::size_t>(panels * panel_bytes_), std::byte{0});
      Index const rb = quant::row_bytes(qf, K);
      parallel_for(pool, panels, [&](Index p, int) {
        Index const r0 = p * kernels::kQuantPanelCols,
                    n = std::min(kernels::kQuantPanelCols, N - r0);
        std::vector<std::byte> rows(static_cast<std::size_t>(n * rb));
        for (Index r = 0; r < n; ++r) {
          quant::quantize_row(qf, w.row(r0 + r), K, rows.data() + r * rb);
        }
        kernels::pack_quant_panels(qf, rows.data(), n, K, quant_.data() + p * panel_bytes_);
      });
    } else if (format_ == experts::WeightFormat::kBf16) {
      Index const panels = (N + np - 1) / np, words = (K + 1) / 2 * np;
      bf16_.assign(static_cast<std::size_t>(panels * words), 0u);
      parallel_for(pool, panels, [&](Index p, int) {
        kernels::pack_panel_bf16(w.data, w.row_stride, p * np, std::min(np, N - p * np), K,
                                 bf16_.data() + p * words);
      });
    } else {
      Index const panels = (N + np - 1) / np;
      f32_.assign(static_cast<std::size_t>(panels * K * np), 0.0f);
      parallel_for(pool, panels, [&](Index p, int) {
        kernels::pack_panel(w.data, w.row_stride, p * np, std::min(np, N - p * np), K,
                            f32_.data() + p * K * np);
      });
    }
  }

  /// W [N, K] stored as GGUF blocks of the block format `format`, row by row (row n: the
  /// quant::row_bytes(quant_format(format), K) bytes at rows + n * that, a GGUF tensor's rows),
  /// packed as stored: the blocks are re-packed for the integer kernels, never re-quantized, so
  /// the product is that of the values ggml's dequantizer gives. In parallel on `pool` (the same
  /// pack without). Throws moe::Error for a format that is not a block format, an empty matrix,
  /// a depth that is not whole blocks, or a bias of another length.
  static Linear from_blocks(experts::WeightFormat format, std::byte const* rows, Index N, Index K,
                            std::span<float const> bias = {}, ThreadPool* pool = nullptr) {
    detail::check(experts::is_quantized(format), "Linear::from_blocks: ", experts::name(format),
                  " is not a block format; build an fp32 or bf16 Linear from its values");
    detail::check(N >= 1 && K >= 1 && rows != nullptr, "Linear::from_blocks: the matrix is [", N,
                  ", ", K, "]; it needs at least one row and one column");
    quant::Format const qf = experts::quant_format(format);
    detail::check(K % quant::block_elems(qf) == 0, "Linear::from_blocks: rows of ", K,
                  " weights are not whole ", experts::name(format), " blocks of ",
                  quant::block_elems(qf));
    detail::check(bias.empty() || static_cast<Index>(bias.size()) == N,
                  "Linear::from_blocks: the bias has ", bias.size(), " values but W has ", N,
                  " rows; pass one per row (or none)");
    Linear l;
    l.rows_ = N;
    l.depth_ = K;
    l.requested_ = l.format_ = format;
    l.bias_.assign(bias.begin(), bias.end());
    Index const panels = (N + kernels::kQuantPanelCols - 1) / kernels::kQuantPanelCols;
    l.panel_bytes_ = kernels::quant_panel_bytes(qf, K);
    l.quant_.assign(static_cast<std::size_t>(panels * l.panel_bytes_), std::byte{0});
    Index const rb = quant::row_bytes(qf, K);
    parallel_for(pool, panels, [&](Index p, int) {
      Index const r0 = p * kernels::kQuantPanelCols, n = std::min(kernels::kQuantPanelCols, N - r0);
      kernels::pack_quant_panels(qf, rows + r0 * rb, n, K, l.quant_.data() + p * l.panel_bytes_);
    });
    return l;
  }

  bool empty() const { return rows_ == 0; }
  Index rows() const { return rows_; }    ///< N (outputs)
  Index depth() const { return depth_; }  ///< K (inputs)
  /// The format of the pack, and the one asked for (they differ after a fallback).
  experts::WeightFormat format() const { return format_; }
  experts::WeightFormat requested_format() const { return requested_; }
  bool fell_back() const { return format_ != requested_; }
  /// Is it packed in a GGUF block format (its products read int8 activation rows)?
  bool quantized() const { return !empty() && experts::is_quantized(format_); }
  /// The bias [N], or empty.
  std::span<float const> bias() const { return bias_; }
  /// Bytes of the pack: what a product streams.
  std::size_t bytes() const {
    return f32_.size() * sizeof(float) + bf16_.size() * sizeof(std::uint32_t) + quant_.size();
  }

  /// The pack as kernels::expert_cols reads it (operand 0).
  kernels::WeightPanels panels() const {
    kernels::WeightPanels w;
    set_operand(w, 0);
    return w;
  }
  /// gate and up as the two operands of one GLU in projection (GluEpilogue): they must have the
  /// same rows, depth and format (checked).
  static kernels::WeightPanels glu_panels(Linear const& gate, Linear const& up) {
    detail::check(!gate.empty() && gate.rows_ == up.rows_ && gate.depth_ == up.depth_ &&
                      gate.format_ == up.format_,
                  "Linear::glu_panels: gate [", gate.rows_, ", ", gate.depth_, "] ",
                  experts::name(gate.format_), " and up [", up.rows_, ", ", up.depth_, "] ",
                  experts::name(up.format_), " must have one shape and one format");
    kernels::WeightPanels w;
    gate.set_operand(w, 0);
    up.set_operand(w, 1);
    return w;
  }

 private:
  void set_operand(kernels::WeightPanels& w, int o) const {
    w.widen_bf16 = true;
    if (!quant_.empty()) {
      w.quant[o] = {quant_.data(), experts::quant_format(format_), panel_bytes_};
    } else if (!bf16_.empty()) {
      w.bf16[o] = bf16_.data();
    } else if (!f32_.empty()) {
      w.f32[o] = f32_.data();
    }
  }

  Index rows_ = 0, depth_ = 0;
  experts::WeightFormat requested_ = experts::WeightFormat::kF32;
  experts::WeightFormat format_ = experts::WeightFormat::kF32;
  std::vector<float> bias_;
  HugePageVector<float> f32_;
  HugePageVector<std::uint32_t> bf16_;
  HugePageVector<std::byte> quant_;
  Index panel_bytes_ = 0;
};

/// Activation rows prepared once for every Linear that reads them: with `quantized`, the rows of
/// x quantized to int8 blocks (kernels::quantize_rows_q8, what quantized packs multiply), in
/// parallel; otherwise x as it is. Reused across calls (no allocation once grown).
class LinearInput {
 public:
  /// The rows of x as the engine reads them. Precondition for `quantized`: x.cols % 32 == 0 (a
  /// quantized Linear has such a depth).
  kernels::RowSource prepare(ConstMatrixView<float> x, bool quantized, ThreadPool* pool) {
    kernels::RowSource a{x.data, x.row_stride};
    if (!quantized || x.rows == 0) return a;
    Index const rb = kernels::q8_row_bytes(x.cols);
    if (static_cast<Index>(q8_.size()) < x.rows * rb) {
      q8_.resize(static_cast<std::size_t>(x.rows * rb));
    }
    detail::PairsTask const tasks[1] = {
        {x.data, x.row_stride, x.rows, x.cols, nullptr, q8_.data()}};
    detail::run_pairs_tasks(pool, tasks);
    a.q8 = q8_.data();
    a.ldq = rb;
    return a;
  }

 private:
  HugePageVector<std::byte> q8_;
};

/// The rows of a product y = x W^T (+ b), as a job of the engine's queue: `a` holds `rows` rows
/// of depth w.depth() (from LinearInput::prepare when w is quantized), y [rows, w.rows()] at c
/// (row stride ldc). With `accumulate`, y += x W^T (+ b) (a residual added in the epilogue).
inline detail::ExpertJob linear_job(Linear const& w, kernels::RowSource a, Index rows, float* c,
                                    Index ldc, bool accumulate = false) {
  detail::ExpertJob job;
  job.kind = detail::ExpertJob::Kind::kStore;
  job.a = a;
  job.rows = rows;
  job.depth = w.depth();
  job.w = w.panels();
  job.c = c;
  job.ldc = ldc;
  job.cols = w.rows();
  job.bias = w.bias().empty() ? nullptr : w.bias().data();
  job.accumulate = accumulate;
  return job;
}

namespace detail {
/// The engine's job C = A W^T (+ bias; C += with `accumulate`) of one layer projection: its
/// pack when `inference` and the pack is not empty, else its fp32 weights w [rows_w, depth] read
/// in place (stages::raw_job: dot products below kernels::kPanelMinRows rows, panels packed per
/// call from there on). bias: [rows_w] or null.
inline ExpertJob projection_job(kernels::RowSource a, Index rows, Linear const& pack,
                                float const* w, Index rows_w, Index depth, float* c, Index ldc,
                                bool inference, float const* bias = nullptr,
                                bool accumulate = false) {
  ExpertJob j = inference && !pack.empty()
                    ? linear_job(pack, a, rows, c, ldc)
                    : stages::raw_job(a.base, a.ld, rows, w, depth, c, ldc, rows_w);
  j.accumulate = accumulate;
  if (bias) j.bias = bias;
  return j;
}
}  // namespace detail

/// Products of Linear matrices, queued and run together on the engine (one parallel pass over
/// all their items): y = x W^T + b (or y +=), and GLU pairs m = silu(x W_g^T) * (x W_u^T). The
/// rows of each input that a quantized matrix reads are quantized once per run, however many
/// matrices read them. Every output element is computed by one item in a fixed order: the same
/// bits for any pool size. Reused across calls (no allocation once grown). The views must stay
/// valid until run(); an output must not be an input of the same run.
class LinearQueue {
 public:
  /// Queues y = x W^T + b (with `accumulate`, y += x W^T + b: a residual added in the epilogue).
  /// Throws moe::Error unless x is [T, w.depth()] and y [T, w.rows()].
  void add(Linear const& w, ConstMatrixView<float> x, MatrixView<float> y,
           bool accumulate = false) {
    check_shapes(w, x, y.rows, y.cols, w.rows(), "add");
    detail::ExpertJob j =
        linear_job(w, {x.data, x.row_stride}, x.rows, y.data, y.row_stride, accumulate);
    pending_.push_back({j, input_of(x, experts::is_quantized(w.format()))});
  }
  /// Queues m = silu(x W_g^T) * (x W_u^T) (SwiGLU; gate and up of one shape and format, in one
  /// pass with the activation in the epilogue). m is [T, gate.rows()].
  void add_swiglu(Linear const& gate, Linear const& up, ConstMatrixView<float> x,
                  MatrixView<float> m) {
    check_shapes(gate, x, m.rows, m.cols, gate.rows(), "add_swiglu");
    detail::ExpertJob j;
    j.kind = detail::ExpertJob::Kind::kRoutedHidden;
    j.a = {x.data, x.row_stride};
    j.rows = x.rows;
    j.depth = gate.depth();
    j.w = Linear::glu_panels(gate, up);
    j.c = m.data;
    j.ldc = m.row_stride;
    j.cols = gate.rows();
    pending_.push_back({j, input_of(x, experts::is_quantized(gate.format()))});
  }
  /// Runs and clears the queue.
  void run(ThreadPool* pool) {
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      Input const& in = inputs_[i];
      kernels::RowSource const a = buffers_[i].prepare(in.x, true, pool);
      for (Pending& p : pending_) {
        if (p.input == static_cast<Index>(i)) {
          p.job.a.q8 = a.q8;
          p.job.a.ldq = a.ldq;
        }
      }
    }
    for (Pending const& p : pending_) queue_.add(p.job);
    queue_.run<experts::SwiGlu, experts::SwiGlu>(pool);
    pending_.clear();
    inputs_.clear();
  }

 private:
  struct Pending {
    detail::ExpertJob job;
    Index input = -1;  ///< the quantized input it reads (index into inputs_), or -1
  };
  struct Input {
    ConstMatrixView<float> x;
  };
  static void check_shapes(Linear const& w, ConstMatrixView<float> x, Index out_rows,
                           Index out_cols, Index cols, char const* who) {
    detail::check(!w.empty() && x.cols == w.depth() && out_rows == x.rows && out_cols == cols,
                  "LinearQueue::", who, ": x is [", x.rows, ", ", x.cols, "] and the output [",
                  out_rows, ", ", out_cols, "] for a matrix [", w.rows(), ", ", w.depth(),
                  "]; they must be [T, ", w.depth(), "] and [T, ", cols, "]");
  }
  /// The index of x among this run's quantized inputs (added if new), or -1.
  Index input_of(ConstMatrixView<float> x, bool quantized) {
    if (!quantized) return -1;
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      ConstMatrixView<float> const& y = inputs_[i].x;
      if (y.data == x.data && y.rows == x.rows && y.cols == x.cols &&
          y.row_stride == x.row_stride) {
        return static_cast<Index>(i);
      }
    }
    inputs_.push_back({x});
    if (buffers_.size() < inputs_.size()) buffers_.resize(inputs_.size());
    return static_cast<Index>(inputs_.size() - 1);
  }

  stages::ProjectionQueue queue_;
  std::vector<Pending> pending_;
  std::vector<Input> inputs_;
  std::vector<LinearInput> buffers_;
};

}  // namespace moe
