// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Work queues of projections C = A W^T and the weight-gradient / input-gradient products shared
/// by the attention layers (not public API).
#pragma once

#include <algorithm>
#include <vector>

#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/gemm_strided.hpp"

namespace moe::detail {

/// A queue of projections C[:, 0:cols] = A W^T (kernels::project_cols, or project_cols_packed
/// when the weights come pre-packed), each split into column items (one panel each, or 64
/// columns on the few-rows path). Items are fixed by the shapes alone, so results are bitwise
/// identical for any number of threads.
class ProjectionQueue {
 public:
  struct Job {
    float const* a;
    Index lda, rows;
    float const* w;  // [cols, depth] row-major
    Index depth;
    float* c;
    Index ldc;
    float const* packed = nullptr;  // W as [depth, NP] panels (ExpertBank::pack), or null
  };

  void add(Job const& job, Index cols) {
    if (job.rows == 0 || cols == 0) return;
    Index const j = static_cast<Index>(jobs_.size());
    jobs_.push_back(job);
    Index const step =
        job.rows < kernels::kPanelMinRows && !job.packed ? 64 : kernels::panel_width();
    for (Index c = 0; c < cols; c += step) items_.push_back({j, c, std::min(cols, c + step)});
  }

  /// Runs and clears the queue; `scratch` holds `per_thread` floats per pool thread, at least
  /// kernels::panel_scratch_size(depth) for every job.
  void run(ThreadPool* pool, float* scratch, Index per_thread) {
    parallel_for(pool, static_cast<Index>(items_.size()), [&](Index i, int thread) {
      Item const& it = items_[i];
      Job const& job = jobs_[it.job];
      if (job.packed) {
        kernels::project_cols_packed(job.a, job.lda, job.rows, job.packed, job.depth, it.c0, it.c1,
                                     job.c, job.ldc);
      } else {
        kernels::project_cols(job.a, job.lda, job.rows, job.w, job.depth, job.depth, it.c0, it.c1,
                              job.c, job.ldc, scratch + thread * per_thread);
      }
    });
    jobs_.clear();
    items_.clear();
  }

 private:
  struct Item {
    Index job, c0, c1;
  };
  std::vector<Job> jobs_;
  std::vector<Item> items_;
};

/// grad[r0:r1] += dC[:, r0:r1]^T A: rows [r0, r1) of the gradient of W in C = A W^T.
/// A [n, K], dC [n, >= r1], grad [N, K]. One kernels::gemm_strided call (dC read transposed in
/// place): each gradient element is one FMA chain over the n rows in order, started from its
/// value, so it does not depend on how the rows [r0, r1) are split.
inline void accumulate_weight_grad(ConstMatrixView<float> a, ConstMatrixView<float> dc, Index r0,
                                   Index r1, MatrixView<float> grad) {
  if (a.rows == 0 || r1 <= r0) return;
  kernels::gemm_strided(r1 - r0, a.cols, a.rows, dc.data + r0, 1, dc.row_stride, a.data,
                        a.row_stride, grad.data + r0 * grad.row_stride, grad.row_stride, true);
}

/// One item of a weight-gradient computation: rows [r0, r1) of `grad` += dC[:, off + r0 :
/// off + r1]^T A.
struct GradItem {
  ConstMatrixView<float> a;
  ConstMatrixView<float> dc;
  MatrixView<float> grad;
  Index r0, r1;
};

/// Splits grad [N, K] += dC^T A into items of 64 gradient rows (fixed by the shapes).
inline void add_grad_items(std::vector<GradItem>& items, ConstMatrixView<float> a,
                           ConstMatrixView<float> dc, MatrixView<float> grad) {
  if (a.rows == 0) return;
  for (Index r = 0; r < grad.rows; r += 64) {
    items.push_back({a, dc, grad, r, std::min(grad.rows, r + 64)});
  }
}

inline void run_grad_items(ThreadPool* pool, std::vector<GradItem> const& items) {
  parallel_for(pool, static_cast<Index>(items.size()), [&](Index i, int) {
    GradItem const& it = items[i];
    accumulate_weight_grad(it.a, it.dc, it.r0, it.r1, it.grad);
  });
}

}  // namespace moe::detail
