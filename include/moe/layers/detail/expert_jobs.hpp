// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The work queue of expert projections every layer runs through stages::ProjectionQueue (not
/// public API): jobs (one projection of some rows with its epilogue) split into items of panels x
/// rows, run on a ThreadPool through kernels::expert_cols. Items are fixed by the shapes alone and
/// every output element is computed by one item, so results are bitwise identical for any number
/// of threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/kernels/expert_gemm.hpp"

namespace moe::detail {

/// One projection of `rows` rows of `a` (depth K) against one weight matrix, or against the gate
/// and up halves of a GLU in projection, finished by an epilogue.
struct ExpertJob {
  enum class Kind : std::uint8_t {
    kStore,         ///< c = scale * (a W^T)                       (kernels::StoreEpilogue)
    kRoutedHidden,  ///< m = act(g) * u or act(h), routed experts' activation (Glu/ActEpilogue)
    kSharedHidden,  ///< the same with the shared experts' activation
  };
  Kind kind = Kind::kStore;
  kernels::RowSource a;  ///< the rows: gathered through an index, or strided
  Index rows = 0, depth = 0;
  kernels::WeightPanels w;       ///< packed panels or raw weights (see expert_weights)
  float* c = nullptr;            ///< kStore: output [rows, cols]; hidden kinds: m [rows, cols = F]
  Index ldc = 0, cols = 0;       ///< row stride and columns of c
  float const* scale = nullptr;  ///< kStore: per-row factors (routing weights) or null
  bool stream = false;           ///< kStore: non-temporal stores (an output far larger than L2)
  float* h = nullptr;            ///< hidden kinds: pre-activations [rows, P] (training) or null
  Index ldh = 0;
  float const* bias = nullptr;  ///< biased experts: [cols] (kStore) or [P] (hidden kinds)
  kernels::GluClamp clamp{};    ///< hidden kinds of a clamped GLU expert
  bool accumulate = false;      ///< kStore without scale or stream: c += a W^T (+ bias)
};

/// Routed expert outputs of at least this many bytes (about the last-level cache) are written
/// with non-temporal stores (ExpertJob::stream): they would not stay cached until the combine
/// reads them, and reading each line before writing it cost the down projections 3-11% (two
/// threads over cold 16-row DeepSeek-like experts; 6-18% back with streaming stores).
inline constexpr Index kStreamOutputBytes = Index{16} << 20;

/// Panels [p0, p1) of rows [r0, r1) of one job.
struct ExpertItem {
  Index job, p0, p1, r0, r1;
};

/// A job's rows are split into chunks of at most this many rows per item.
inline constexpr Index kItemRows = 512;
/// Panels per item with packed weights (the next panel of an item is prefetched while the
/// current one is multiplied); raw weights take one panel per item (each packs its own).
inline constexpr Index kItemPanels = 4;

/// The weights of a projection as kernels::expert_cols reads them: quantized panels (if
/// use_bf16, i.e. an inference forward, and `quant` has them), bf16 panels (if use_bf16), fp32
/// panels, or the raw rows [rows, depth]. half > 0 splits a GLU in projection into gate
/// rows [0, half) and up rows [half, 2 half) (packed panels need half % panel_width() == 0,
/// raw weights are used otherwise). `dot_products`: raw weights go through gemm_nt row by row
/// (set it for jobs of fewer than kernels::kPanelMinRows rows).
inline kernels::WeightPanels expert_weights(float const* raw, Index rows, float const* packed,
                                            std::uint32_t const* packed_bf16, Index depth,
                                            Index half, bool use_bf16, bool dot_products,
                                            kernels::QuantWeights const* quant = nullptr) {
  Index const np = kernels::panel_width();
  kernels::WeightPanels w;
  if (use_bf16 && quant && quant[0].data) {
    w.quant[0] = quant[0];
    w.quant[1] = quant[1];
    return w;
  }
  bool const aligned = half == 0 || half % np == 0;
  if (use_bf16 && packed_bf16 && aligned) {
    w.bf16[0] = packed_bf16;
    if (half > 0) w.bf16[1] = packed_bf16 + (half / np) * ((depth + 1) / 2) * np;
  } else if (packed && aligned) {
    w.f32[0] = packed;
    if (half > 0) w.f32[1] = packed + (half / np) * depth * np;
  } else {
    w.raw[0] = raw;
    w.raw_rows[0] = half > 0 ? half : rows;
    if (half > 0) {
      w.raw[1] = raw + half * depth;
      w.raw_rows[1] = half;
    }
    w.dot_products = dot_products;
  }
  return w;
}

/// Whether an inference forward hands `bank`'s projections their inputs as bf16 pairs: the bank
/// is packed as bf16 (and current) and expert_cols multiplies bf16 panels with dot products.
template <class Bank>
bool uses_bf16_pairs(Bank const& bank, bool use_bf16) {
  // bf16_dot_products() last: it is decided at pack time, so a forward over unpacked or fp32
  // weights never asks (asking first decides it, which allocates).
  return use_bf16 && bank.packed_bf16_any() && kernels::bf16_dot_products();
}

/// Whether an inference forward hands `bank`'s projections their inputs quantized to int8 rows
/// (kernels::quantize_rows_q8): some projection is packed in a quantized format.
template <class Bank>
bool uses_q8_rows(Bank const& bank, bool inference) {
  return inference && bank.packed_quant_any();
}

/// Rows [0, rows) of `src` (row stride ld, depth K) to be rounded into bf16 pairs at dst
/// (ceil(K / 2) words per row), for the AVX512-BF16 path of expert_cols (RowSource::pairs),
/// and/or quantized to int8 rows at q8 (kernels::q8_row_bytes(K) bytes per row) for the
/// quantized-weight path (RowSource::q8).
struct PairsTask {
  float const* src = nullptr;
  Index ld = 0, rows = 0, K = 0;
  std::uint32_t* dst = nullptr;
  std::byte* q8 = nullptr;
};

/// Runs the tasks (kernels::bf16_pairs_rows, kernels::quantize_rows_q8) in parallel tiles of 64
/// rows; null tasks are skipped.
template <std::size_t N>
void run_pairs_tasks(ThreadPool* pool, PairsTask const (&tasks)[N]) {
  constexpr Index kTile = 64;
  Index tiles[N + 1] = {0};
  for (std::size_t i = 0; i < N; ++i) {
    Index const n = tasks[i].dst || tasks[i].q8 ? (tasks[i].rows + kTile - 1) / kTile : 0;
    tiles[i + 1] = tiles[i] + n;
  }
  parallel_for(pool, tiles[N], [&](Index item, int) {
    std::size_t i = 0;
    while (item >= tiles[i + 1]) ++i;
    PairsTask const& t = tasks[i];
    Index const r0 = (item - tiles[i]) * kTile, kp = (t.K + 1) / 2,
                n = std::min(kTile, t.rows - r0);
    if (t.dst)
      kernels::bf16_pairs_rows({t.src + r0 * t.ld, t.ld, nullptr}, n, t.K, t.dst + r0 * kp, kp);
    if (t.q8) {
      Index const rb = kernels::q8_row_bytes(t.K);
      kernels::quantize_rows_q8({t.src + r0 * t.ld, t.ld, nullptr}, n, t.K, t.q8 + r0 * rb, rb);
    }
  });
}

/// Queues a job as items of (panels, rows).
inline void add_expert_job(std::vector<ExpertJob>& jobs, std::vector<ExpertItem>& items,
                           ExpertJob const& job) {
  if (job.rows == 0 || job.cols == 0) return;
  Index const np = kernels::panel_width();
  Index const j = static_cast<Index>(jobs.size());
  jobs.push_back(job);
  Index const pw = job.w.quant[0].data ? kernels::kQuantPanelCols : np;
  Index const panels = (job.cols + pw - 1) / pw;
  Index const group = job.w.raw[0] ? 1 : kItemPanels;
  for (Index r0 = 0; r0 < job.rows; r0 += kItemRows) {
    Index const r1 = std::min(job.rows, r0 + kItemRows);
    for (Index p = 0; p < panels; p += group) {
      items.push_back({j, p, std::min(panels, p + group), r0, r1});
    }
  }
}

/// The expert type of a shared-expert policy, or Fallback when it has none.
template <class S, class Fallback>
struct SharedExpertOr {
  using type = Fallback;
};
template <class S, class Fallback>
requires(S::has_experts) struct SharedExpertOr<S, Fallback> {
  using type = typename S::Expert;
};

/// An in-projection item with the expert's activation in the epilogue.
template <class X>
void run_hidden_item(ExpertJob const& job, kernels::RowSource a, Index M, ExpertItem const& item,
                     float* scratch, kernels::NextPanel after) {
  float* m = job.c + item.r0 * job.ldc;
  float* h = job.h ? job.h + item.r0 * job.ldh : nullptr;
  if constexpr (X::gated) {
    kernels::GluEpilogue<X::activation, experts::is_clamped_glu<X>> const epi{
        m, job.ldc, job.cols, h, job.ldh, job.bias, job.clamp};
    kernels::expert_cols(a, M, job.depth, job.w, item.p0, item.p1, epi, scratch, 0, after);
  } else {
    kernels::ActEpilogue<X::activation> const epi{m, job.ldc, job.cols, h, job.ldh, job.bias};
    kernels::expert_cols(a, M, job.depth, job.w, item.p0, item.p1, epi, scratch, 0, after);
  }
}

/// Runs one item; `next` is the item this thread runs after it (its first panel is prefetched
/// during this one's last slice), or null.
template <class RoutedX, class SharedX>
void run_expert_item(std::vector<ExpertJob> const& jobs, ExpertItem const& item, float* s,
                     ExpertItem const* next) {
  ExpertJob const& job = jobs[static_cast<std::size_t>(item.job)];
  kernels::NextPanel after;
  if (next) {
    ExpertJob const& nj = jobs[static_cast<std::size_t>(next->job)];
    after = {&nj.w, next->p0, nj.depth};
  }
  kernels::RowSource const a = job.a.from(item.r0);
  Index const M = item.r1 - item.r0;
  switch (job.kind) {
    case ExpertJob::Kind::kStore: {
      kernels::StoreEpilogue const epi{job.c + item.r0 * job.ldc,
                                       job.ldc,
                                       job.cols,
                                       job.scale ? job.scale + item.r0 : nullptr,
                                       job.stream,
                                       job.bias,
                                       job.accumulate};
      kernels::expert_cols(a, M, job.depth, job.w, item.p0, item.p1, epi, s, 0, after);
      if (job.stream) kernels::simd::stream_fence();
      break;
    }
    case ExpertJob::Kind::kRoutedHidden:
      run_hidden_item<RoutedX>(job, a, M, item, s, after);
      break;
    case ExpertJob::Kind::kSharedHidden:
      run_hidden_item<SharedX>(job, a, M, item, s, after);
      break;
  }
}

/// Runs and clears the queue. `scratch` holds `per_thread` floats per pool thread, at least
/// kernels::expert_scratch_floats(depth) for every job's depth. Items are handed out
/// dynamically, one ahead while many remain: a thread claims its next item before it runs the
/// current one, so the current one's last slice can prefetch the next one's first
/// (kernels::NextPanel). Which thread runs an item never changes its result.
template <class RoutedX, class SharedX>
void run_expert_jobs(std::vector<ExpertJob>& jobs, std::vector<ExpertItem>& items, ThreadPool* pool,
                     float* scratch, Index per_thread) {
  Index const n = static_cast<Index>(items.size());
  std::atomic<Index> next{0};
  Index const threads = pool ? pool->size() : 1;
  parallel_for(pool, threads, [&](Index, int thread) {
    float* s = scratch + thread * per_thread;
    Index cur = next.fetch_add(1, std::memory_order_relaxed);
    while (cur < n) {
      // Claim ahead only while plenty of items remain: at the end of the queue an item held
      // ahead would keep another thread idle.
      Index const nxt = cur + 2 * threads < n ? next.fetch_add(1, std::memory_order_relaxed) : n;
      run_expert_item<RoutedX, SharedX>(jobs, items[static_cast<std::size_t>(cur)], s,
                                        nxt < n ? &items[static_cast<std::size_t>(nxt)] : nullptr);
      cur = nxt < n ? nxt : next.fetch_add(1, std::memory_order_relaxed);
    }
  });
  jobs.clear();
  items.clear();
}

}  // namespace moe::detail
