// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The work queue of the attention layers' query / key / value / gate projections C = A W^T
/// (not public API; the weight gradients are stages::GradTasks).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/kernels/gemm_packed.hpp"

namespace moe::detail {

/// A queue of projections C[:, 0:cols] = A W^T (kernels::project_cols on fp32 or bf16 W, or
/// project_cols_packed when the weights come pre-packed), each split into column items (one panel
/// each, or 64 columns on the few-rows path). Items are fixed by the shapes alone, so results are
/// bitwise identical for any number of threads.
class ProjectionQueue {
 public:
  struct Job {
    float const* a;
    Index lda, rows;
    float const* w;  // [cols, depth] row-major
    Index depth;
    float* c;
    Index ldc;
    float const* packed = nullptr;          // W as [depth, NP] panels (ExpertBank::pack), or null
    std::uint16_t const* w_bf16 = nullptr;  // W in bf16 [cols, depth] (then w is unused), or null
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
        auto cols = [&](auto const* w) {
          kernels::project_cols(job.a, job.lda, job.rows, w, job.depth, job.depth, it.c0, it.c1,
                                job.c, job.ldc, scratch + thread * per_thread);
        };
        if (job.w_bf16) {
          cols(job.w_bf16);
        } else {
          cols(job.w);
        }
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

}  // namespace moe::detail
