// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// RowExchange: the all-to-all exchanges of expert parallelism (not tied to any policy type).
/// Each routed row (token, expert) of a rank's RoutingPlan goes to the expert's owner, grouped by
/// destination rank, then expert, then token; the owner keeps its rows expert-major (expert j's
/// rows from rank 0, 1, ... in that order), so an expert's rows are those of the global batch in
/// global token order. Outputs come back the same way, into plan row order. Needs <mpi.h>.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/dist/communicator.hpp"
#include "moe/dist/placement.hpp"
#include "moe/kernels/gather.hpp"

namespace moe::dist {

/// The exchanges of one forward (and its backward) and their bookkeeping. Reused across calls.
class RowExchange {
 public:
  /// What the exchanges run on: the layer's communicator, placement and row width.
  struct Context {
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0, size = 1;
    ExpertPlacement const* placement = nullptr;
    Index d_model = 0;
    MPI_Datatype row_type = MPI_DATATYPE_NULL;
  };

  std::vector<Index> send_token;  ///< [R] token of each row in send order
  std::vector<Index> send_row;    ///< [R] plan row of each send slot (non-monotone maps)
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;  ///< [P]
  std::vector<std::int64_t> count_send, count_recv;  ///< [P, 1 + L_max] status + counts
  std::vector<Index> chunk_rows;                     ///< [P, L] rows from rank s for local expert j
  std::vector<Index> chunk_src, chunk_dst;           ///< [P, L] source-major / expert-major offsets
  std::vector<Index> chunk_fill;                     ///< [L] scratch
  std::vector<Index> local_offsets;                  ///< [L+1] expert-major offsets, local experts
  std::vector<float> send_buf;                       ///< [R, D] rows in send order (token side)
  std::vector<float> recv_buf;                       ///< [R_in, D] rows in source-major order

  /// Rows this rank's experts received (R_in).
  Index received() const { return local_offsets.empty() ? 0 : local_offsets.back(); }

  /// Status + per-expert counts to every rank (MPI_Alltoall); derives the row counts and
  /// displacements of both exchanges and the source-major -> expert-major reordering. A nonzero
  /// status (this rank could not route) makes every rank throw: this one with `route_error`.
  void exchange_counts(Context const& c, RoutingPlan const& plan, std::int64_t status,
                       std::string const& route_error, ExchangeStats& stats) {
    ExpertPlacement const& placement = *c.placement;
    int const P = c.size, me = c.rank;
    Index const block = 1 + placement.max_local(), L = placement.num_local(me);
    count_send.assign(static_cast<std::size_t>(P * block), 0);
    count_recv.assign(static_cast<std::size_t>(P * block), 0);
    for (int q = 0; q < P; ++q) {
      std::int64_t* b = count_send.data() + q * block;
      b[0] = status;
      auto const ids = placement.experts_of(q);
      for (std::size_t j = 0; j < ids.size() && status == 0; ++j) {
        b[1 + j] = plan.expert_rows(ids[j]);
      }
    }
    detail::alltoall_i64(c.comm, count_send.data(), count_recv.data(), static_cast<int>(block),
                         stats);
    for (int s = 0; s < P; ++s) {
      if (count_recv[static_cast<std::size_t>(s * block)] == 0) continue;
      if (s == me) throw Error(route_error);
      ::moe::detail::fail("ExpertParallelMoeFfn::forward (rank ", me, " of ", P, "): rank ", s,
                          " could not route its tokens (non-finite router logits or an invalid "
                          "routing); every rank stops this call. See rank ",
                          s, "'s error for the token and the fix");
    }
    // Send side: rows grouped by destination rank, then expert, then token.
    send_counts.assign(static_cast<std::size_t>(P), 0);
    send_displs.assign(static_cast<std::size_t>(P), 0);
    Index const R = plan.num_rows();
    Index offset = 0;
    bool const monotone = placement.monotone();
    send_token.resize(static_cast<std::size_t>(R));
    send_row.resize(static_cast<std::size_t>(monotone ? 0 : R));
    for (int q = 0; q < P; ++q) {
      Index n = 0;
      for (Index e : placement.experts_of(q)) {
        for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r, ++n) {
          send_token[static_cast<std::size_t>(offset + n)] = plan.row_token[r];
          if (!monotone) send_row[static_cast<std::size_t>(offset + n)] = r;
        }
      }
      send_displs[static_cast<std::size_t>(q)] = detail::mpi_count(offset, "rows sent");
      send_counts[static_cast<std::size_t>(q)] = detail::mpi_count(n, "rows sent");
      offset += n;
    }
    // Receive side: rows from rank s for local expert j.
    chunk_rows.assign(static_cast<std::size_t>(P * L), 0);
    recv_counts.assign(static_cast<std::size_t>(P), 0);
    recv_displs.assign(static_cast<std::size_t>(P), 0);
    local_offsets.assign(static_cast<std::size_t>(L + 1), 0);
    Index rin = 0;
    for (int s = 0; s < P; ++s) {
      Index n = 0;
      for (Index j = 0; j < L; ++j) {
        Index const k = count_recv[static_cast<std::size_t>(s * block + 1 + j)];
        chunk_rows[static_cast<std::size_t>(s * L + j)] = k;
        local_offsets[static_cast<std::size_t>(j + 1)] += k;
        n += k;
      }
      recv_displs[static_cast<std::size_t>(s)] = detail::mpi_count(rin, "rows received");
      recv_counts[static_cast<std::size_t>(s)] = detail::mpi_count(n, "rows received");
      rin += n;
    }
    for (Index j = 0; j < L; ++j) local_offsets[j + 1] += local_offsets[j];
    chunk_src.resize(static_cast<std::size_t>(P * L));
    chunk_dst.resize(static_cast<std::size_t>(P * L));
    chunk_fill.assign(local_offsets.begin(), local_offsets.end() - 1);
    for (int s = 0; s < P; ++s) {
      Index src = recv_displs[static_cast<std::size_t>(s)];
      for (Index j = 0; j < L; ++j) {
        std::size_t const i = static_cast<std::size_t>(s * L + j);
        chunk_src[i] = src;
        chunk_dst[i] = chunk_fill[static_cast<std::size_t>(j)];
        chunk_fill[static_cast<std::size_t>(j)] += chunk_rows[i];
        src += chunk_rows[i];
      }
    }
    stats.rows_sent = R;
    stats.rows_received = rin;
    stats.remote_rows_sent = R - send_counts[static_cast<std::size_t>(me)];
  }

  /// Forward dispatch: x's rows of this rank's plan to their experts' owners, expert-major into
  /// `rows` [R_in, D].
  void dispatch(Context const& c, ConstMatrixView<float> x, Index R, std::vector<float>& rows,
                ThreadPool* pool, ExchangeStats& stats) {
    Index const D = c.d_model;
    send_buf.resize(static_cast<std::size_t>(R * D));
    parallel_for(pool, (R + 63) / 64, [&](Index i, int) {
      Index const r0 = i * 64, n = std::min<Index>(64, R - r0);
      kernels::gather_rows(x.data, x.row_stride, send_token.data() + r0, n, D,
                           send_buf.data() + r0 * D, D);
    });
    receive(c, send_buf.data(), rows, pool, stats);
  }

  /// Backward dispatch: `src` [R, D] in plan row order to the owners, expert-major into `rows`.
  void send_to_owners(Context const& c, std::vector<float> const& src, Index R,
                      std::vector<float>& rows, ThreadPool* pool, ExchangeStats& stats) {
    Index const D = c.d_model;
    float const* send = src.data();
    if (!c.placement->monotone()) {
      send_buf.resize(static_cast<std::size_t>(R * D));
      for (Index i = 0; i < R; ++i) {
        Index const r = send_row[static_cast<std::size_t>(i)];
        std::copy(src.data() + r * D, src.data() + (r + 1) * D, send_buf.data() + i * D);
      }
      send = send_buf.data();
    }
    receive(c, send, rows, pool, stats);
  }

  /// Return (forward outputs, backward input gradients): expert-major rows `src` [R_in, D] back
  /// to the tokens' ranks, into `dst` [R, D] in plan row order.
  void return_rows(Context const& c, float const* src, Index R, std::vector<float>& dst,
                   ThreadPool* pool, ExchangeStats& stats) {
    Index const D = c.d_model, rin = received();
    float const* send = src;
    if (!direct(c)) {
      recv_buf.resize(static_cast<std::size_t>(rin * D));
      reorder(c, src, recv_buf.data(), true, pool);
      send = recv_buf.data();
    }
    dst.resize(static_cast<std::size_t>(R * D));
    bool const monotone = c.placement->monotone();
    if (!monotone) send_buf.resize(static_cast<std::size_t>(R * D));
    detail::alltoallv_rows(c.comm, send, recv_counts, recv_displs,
                           monotone ? dst.data() : send_buf.data(), send_counts, send_displs,
                           c.row_type, D * 4, stats);
    if (!monotone) {
      for (Index i = 0; i < R; ++i) {
        Index const r = send_row[static_cast<std::size_t>(i)];
        std::copy(send_buf.data() + i * D, send_buf.data() + (i + 1) * D, dst.data() + r * D);
      }
    }
  }

 private:
  /// With at most one local expert the source-major receive order is already expert-major,
  /// and the reorder is skipped.
  static bool direct(Context const& c) { return c.placement->num_local(c.rank) <= 1; }

  /// MPI_Alltoallv of rows in send order, then source-major -> expert-major into `rows`.
  void receive(Context const& c, float const* send, std::vector<float>& rows, ThreadPool* pool,
               ExchangeStats& stats) {
    Index const D = c.d_model, rin = received();
    rows.resize(static_cast<std::size_t>(rin * D));
    if (!direct(c)) recv_buf.resize(static_cast<std::size_t>(rin * D));
    detail::alltoallv_rows(c.comm, send, send_counts, send_displs,
                           direct(c) ? rows.data() : recv_buf.data(), recv_counts, recv_displs,
                           c.row_type, D * 4, stats);
    if (!direct(c)) reorder(c, recv_buf.data(), rows.data(), false, pool);
  }

  /// Source-major rows (as received) -> expert-major rows, or back (`to_source`).
  void reorder(Context const& c, float const* src, float* dst, bool to_source,
               ThreadPool* pool) const {
    Index const D = c.d_model;
    parallel_for(pool, static_cast<Index>(chunk_rows.size()), [&](Index i, int) {
      std::size_t const k = static_cast<std::size_t>(i);
      Index const n = chunk_rows[k], a = chunk_src[k], b = chunk_dst[k];
      if (n == 0) return;
      if (to_source) {
        std::copy(src + b * D, src + (b + n) * D, dst + a * D);
      } else {
        std::copy(src + a * D, src + (a + n) * D, dst + b * D);
      }
    });
  }
};

}  // namespace moe::dist
