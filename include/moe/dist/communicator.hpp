// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MPI plumbing of the expert-parallel layer: an owned communicator, the agreement collective
/// that turns one rank's error into a clear error on every rank (instead of a hang), the
/// exchange wrappers that count bytes, and the deterministic (rank-ordered) gradient sum.
/// Needs <mpi.h>: link `moe::dist` (CMake) or MPI::MPI_CXX.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"

namespace moe::dist {

/// What one collective call of a layer moved between ranks. `bytes_*` count payload bytes to or
/// from *other* ranks (rows a rank sends to itself are copies, not traffic), over every
/// collective of the call: the agreement record, the per-expert counts, the token rows, and in
/// backward the gradient reduction. For MPI_Allreduce (GradientReduction::kAllreduce) the
/// nominal ring volume 2 n (P - 1) / P floats is counted, since the real one is the library's
/// choice.
struct ExchangeStats {
  std::int64_t rows_sent = 0;         ///< token rows sent to expert owners (self included)
  std::int64_t rows_received = 0;     ///< expert rows received from token owners (self included)
  std::int64_t remote_rows_sent = 0;  ///< rows_sent that went to other ranks
  std::int64_t bytes_sent = 0;        ///< payload bytes sent to other ranks
  std::int64_t bytes_received = 0;    ///< payload bytes received from other ranks
  int collectives = 0;                ///< MPI collective calls made
  double mpi_seconds = 0.0;  ///< wall time inside those calls (transfer + waiting for other ranks)
  void clear() { *this = {}; }
};

namespace detail {

/// Throws moe::Error naming the MPI call when rc is not MPI_SUCCESS. (With MPI's default error
/// handler, MPI_ERRORS_ARE_FATAL, a failing call aborts the job before returning.)
inline void mpi_check(int rc, char const* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  ::moe::detail::fail("dist: ", call, " failed: ", std::string(text, static_cast<std::size_t>(len)),
                      "; check the MPI installation and that every rank makes the same calls");
}

/// n as an MPI count (int), or a moe::Error saying what overflowed.
inline int mpi_count(std::int64_t n, char const* what) {
  ::moe::detail::check(n >= 0 && n <= INT_MAX, "dist: ", what, " = ", n,
                       " does not fit an MPI count (int); split the batch into smaller calls");
  return static_cast<int>(n);
}

/// Copies a string into a fixed char array, truncated and NUL-terminated.
template <std::size_t N>
void copy_text(char (&dst)[N], std::string const& src) {
  std::size_t const n = std::min(N - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

/// 64-bit FNV-1a over bytes, continuing from h.
inline std::uint64_t fnv1a(void const* data, std::size_t bytes,
                           std::uint64_t h = 0xcbf29ce484222325ull) {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace detail

/// Owns a duplicate (MPI_Comm_dup) of the communicator a layer is built on, so the layer's
/// collectives never match the application's own messages. Move-only. Construction is
/// collective over `comm`; destroy it before MPI_Finalize (after finalisation it is released
/// without calling MPI). MPI must be initialised (MPI_Init_thread with at least
/// MPI_THREAD_FUNNELED when a ThreadPool runs the compute: moe calls MPI only from the thread that
/// calls the layer).
class Communicator {
 public:
  Communicator() = default;
  explicit Communicator(MPI_Comm comm) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    ::moe::detail::check(initialized != 0,
                         "dist::Communicator: MPI is not initialised; call MPI_Init_thread (with "
                         "MPI_THREAD_FUNNELED) before building an expert-parallel layer");
    ::moe::detail::check(comm != MPI_COMM_NULL,
                         "dist::Communicator: got MPI_COMM_NULL; pass the communicator of the "
                         "ranks that share the experts (e.g. MPI_COMM_WORLD)");
    detail::mpi_check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  Communicator(Communicator const&) = delete;
  Communicator& operator=(Communicator const&) = delete;
  Communicator(Communicator&& other) noexcept
      : comm_(std::exchange(other.comm_, MPI_COMM_NULL)), rank_(other.rank_), size_(other.size_) {}
  Communicator& operator=(Communicator&& other) noexcept {
    if (this != &other) {
      release();
      comm_ = std::exchange(other.comm_, MPI_COMM_NULL);
      rank_ = other.rank_;
      size_ = other.size_;
    }
    return *this;
  }
  ~Communicator() { release(); }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool valid() const { return comm_ != MPI_COMM_NULL; }

 private:
  void release() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

/// An MPI datatype of `cols` contiguous floats (one activation row), so that Alltoallv counts
/// are rows, not floats (MPI counts are int; Open MPI 4.1 has no large-count variants).
class RowType {
 public:
  RowType() = default;
  explicit RowType(Index cols) {
    detail::mpi_check(MPI_Type_contiguous(detail::mpi_count(cols, "row width"), MPI_FLOAT, &type_),
                      "MPI_Type_contiguous");
    detail::mpi_check(MPI_Type_commit(&type_), "MPI_Type_commit");
  }
  RowType(RowType const&) = delete;
  RowType& operator=(RowType const&) = delete;
  RowType(RowType&& o) noexcept : type_(std::exchange(o.type_, MPI_DATATYPE_NULL)) {}
  RowType& operator=(RowType&& o) noexcept {
    if (this != &o) {
      release();
      type_ = std::exchange(o.type_, MPI_DATATYPE_NULL);
    }
    return *this;
  }
  ~RowType() { release(); }
  MPI_Datatype get() const { return type_; }

 private:
  void release() noexcept {
    if (type_ == MPI_DATATYPE_NULL) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Type_free(&type_);
    type_ = MPI_DATATYPE_NULL;
  }
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

/// The collective operations of a layer, named in agreement errors.
enum class CallKind : std::int64_t {
  kConstruct = 1,
  kForward,
  kForwardTrain,
  kBackward,
  kEndStep,
  kVerifyReplicas,
  kSyncReplicas,
};

inline char const* to_string(CallKind k) {
  switch (k) {
    case CallKind::kConstruct:
      return "the constructor";
    case CallKind::kForward:
      return "forward";
    case CallKind::kForwardTrain:
      return "forward_train";
    case CallKind::kBackward:
      return "backward";
    case CallKind::kEndStep:
      return "end_step";
    case CallKind::kVerifyReplicas:
      return "verify_replicas";
    case CallKind::kSyncReplicas:
      return "sync_replicas";
  }
  return "an unknown operation";
}

/// One rank's fixed-size record for the agreement collective (exchanged as bytes, so ranks that
/// disagree about everything else still agree on its size and cannot hang in it).
struct CallRecord {
  static constexpr std::int64_t kMagic = 0x6d6f652d65703031;  // "moe-ep01"
  std::int64_t magic = kMagic;
  std::int64_t kind = 0;       ///< CallKind
  std::int64_t seq = 0;        ///< collective calls made on this layer before this one
  std::uint64_t config = 0;    ///< fingerprint of the layer configuration
  std::int64_t tokens = 0;     ///< this rank's tokens (forward) or 0
  std::int64_t failed = 0;     ///< 1 if this rank's local checks threw
  std::uint64_t extra = 0;     ///< call-specific value compared across ranks (replica hash)
  char config_text[192] = {};  ///< human-readable configuration, for the error message
  char message[320] = {};      ///< this rank's error message when failed
};

namespace detail {

/// The agreement collective: every rank contributes its CallRecord (MPI_Allgather of bytes) and
/// every rank runs the same checks on the same table, so they all throw the same moe::Error (or
/// all go on) — nobody is left waiting in a later exchange. Checked, in order: same library
/// record, same operation and call number, no rank failed its local checks, same configuration
/// fingerprint, same `extra` when `compare_extra`. Fills `all` with the table [P] (tokens per
/// rank etc.; its storage is reused from call to call).
inline void agree(MPI_Comm comm, CallRecord const& mine, char const* where, bool compare_extra,
                  ExchangeStats* stats, std::vector<CallRecord>& all) {
  int size = 1, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  all.resize(static_cast<std::size_t>(size));
  double const t0 = MPI_Wtime();
  mpi_check(MPI_Allgather(&mine, static_cast<int>(sizeof(CallRecord)), MPI_BYTE, all.data(),
                          static_cast<int>(sizeof(CallRecord)), MPI_BYTE, comm),
            "MPI_Allgather (agreement)");
  if (stats) {
    stats->mpi_seconds += MPI_Wtime() - t0;
    stats->collectives += 1;
    stats->bytes_sent += static_cast<std::int64_t>(sizeof(CallRecord)) * (size - 1);
    stats->bytes_received += static_cast<std::int64_t>(sizeof(CallRecord)) * (size - 1);
  }
  auto const head = [&] {
    return std::string(where) + " (rank " + std::to_string(rank) + " of " + std::to_string(size) +
           "): ";
  };
  for (int r = 0; r < size; ++r) {
    CallRecord const& c = all[static_cast<std::size_t>(r)];
    if (c.magic != CallRecord::kMagic) {
      ::moe::detail::fail(head(), "rank ", r,
                          " sent a record from another program or moe version; run the same "
                          "binary on every rank");
    }
  }
  CallRecord const& first = all[0];
  for (int r = 1; r < size; ++r) {
    CallRecord const& c = all[static_cast<std::size_t>(r)];
    if (c.kind != first.kind || c.seq != first.seq) {
      ::moe::detail::fail(head(), "ranks are out of step: rank 0 called ",
                          to_string(static_cast<CallKind>(first.kind)), " (collective call #",
                          first.seq, " on this layer) while rank ", r, " called ",
                          to_string(static_cast<CallKind>(c.kind)), " (call #", c.seq,
                          "); every rank must call the layer's collective operations in the same "
                          "order");
    }
  }
  for (int r = 0; r < size; ++r) {
    CallRecord const& c = all[static_cast<std::size_t>(r)];
    if (c.failed) {
      ::moe::detail::fail(head(), "rank ", r, " failed its local checks, so every rank stops ",
                          to_string(static_cast<CallKind>(c.kind)), ". Rank ", r, ": ", c.message);
    }
  }
  for (int r = 1; r < size; ++r) {
    CallRecord const& c = all[static_cast<std::size_t>(r)];
    if (c.config != first.config) {
      ::moe::detail::fail(head(), "ranks disagree on the layer configuration: rank 0 has {",
                          first.config_text, "} but rank ", r, " has {", c.config_text,
                          "}; build the layer with the same sizes, router, expert kind, shared "
                          "experts and placement on every rank");
    }
  }
  if (compare_extra) {
    for (int r = 1; r < size; ++r) {
      CallRecord const& c = all[static_cast<std::size_t>(r)];
      if (c.extra != first.extra) {
        ::moe::detail::fail(head(), "replicated parameters differ: rank 0 has {", first.message,
                            "} but rank ", r, " has {", c.message,
                            "}; load the same router and shared-expert weights on every rank, "
                            "or call sync_replicas() to copy rank 0's");
      }
    }
  }
}

/// MPI_Alltoall of fixed blocks of int64, with byte accounting.
inline void alltoall_i64(MPI_Comm comm, std::int64_t const* send, std::int64_t* recv, int block,
                         ExchangeStats& stats) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  double const t0 = MPI_Wtime();
  mpi_check(MPI_Alltoall(send, block, MPI_INT64_T, recv, block, MPI_INT64_T, comm),
            "MPI_Alltoall (per-expert counts)");
  stats.mpi_seconds += MPI_Wtime() - t0;
  stats.collectives += 1;
  stats.bytes_sent += std::int64_t{8} * block * (size - 1);
  stats.bytes_received += std::int64_t{8} * block * (size - 1);
}

/// MPI_Alltoallv of rows (counts and displacements in rows of `type`, `row_bytes` each).
inline void alltoallv_rows(MPI_Comm comm, float const* send, std::vector<int> const& send_counts,
                           std::vector<int> const& send_displs, float* recv,
                           std::vector<int> const& recv_counts, std::vector<int> const& recv_displs,
                           MPI_Datatype type, std::int64_t row_bytes, ExchangeStats& stats) {
  int size = 1, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  double const t0 = MPI_Wtime();
  mpi_check(MPI_Alltoallv(send, send_counts.data(), send_displs.data(), type, recv,
                          recv_counts.data(), recv_displs.data(), type, comm),
            "MPI_Alltoallv (token rows)");
  stats.mpi_seconds += MPI_Wtime() - t0;
  stats.collectives += 1;
  for (int q = 0; q < size; ++q) {
    if (q == rank) continue;
    stats.bytes_sent += row_bytes * send_counts[static_cast<std::size_t>(q)];
    stats.bytes_received += row_bytes * recv_counts[static_cast<std::size_t>(q)];
  }
}

/// First element of part q when n items are split into P near-equal contiguous parts.
inline std::int64_t part_begin(std::int64_t n, int P, int q) {
  return q * (n / P) + std::min<std::int64_t>(q, n % P);
}

}  // namespace detail

/// How the gradients of replicated parameters (router, shared experts, their gate) are summed
/// over ranks.
enum class GradientReduction {
  /// Deterministic: a reduce-scatter (MPI_Alltoallv) in which each rank sums its segment of the
  /// P partial gradients in rank order 0, 1, ..., P-1, then MPI_Allgatherv. The result depends
  /// only on the partials and P — not on the MPI library, its tuning or the network — and is
  /// bitwise identical on every rank and from run to run. Moves 2 n (P - 1) / P floats per rank.
  kRankOrdered,
  /// MPI_Allreduce(MPI_SUM): the library picks the summation order (Open MPI 4.1 switches
  /// algorithm with message size and rank count), so results can change with the MPI build or
  /// its parameters. Fastest on large clusters; not bitwise reproducible across setups.
  kAllreduce,
};

namespace detail {

/// data[i] <- sum over ranks of data[i] (same n on every rank), as chosen by `mode`.
/// `scratch` is resized as needed. Collective.
inline void sum_over_ranks(MPI_Comm comm, std::span<float> data, GradientReduction mode,
                           std::vector<float>& scratch, ExchangeStats& stats) {
  int P = 1, me = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &me);
  auto const n = static_cast<std::int64_t>(data.size());
  int const count = mpi_count(n, "gradient floats");
  if (P == 1) return;
  double const t0 = MPI_Wtime();
  if (mode == GradientReduction::kAllreduce) {
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, data.data(), count, MPI_FLOAT, MPI_SUM, comm),
              "MPI_Allreduce (gradients)");
    stats.mpi_seconds += MPI_Wtime() - t0;
    stats.collectives += 1;
    std::int64_t const nominal = 2 * n * (P - 1) / P * 4;
    stats.bytes_sent += nominal;
    stats.bytes_received += nominal;
    return;
  }
  // Reduce-scatter in rank order: rank q receives segment q of every rank's partial.
  std::vector<int> seg_count(static_cast<std::size_t>(P)), seg_displ(static_cast<std::size_t>(P));
  for (int q = 0; q < P; ++q) {
    seg_displ[static_cast<std::size_t>(q)] = static_cast<int>(part_begin(n, P, q));
    seg_count[static_cast<std::size_t>(q)] =
        static_cast<int>(part_begin(n, P, q + 1) - part_begin(n, P, q));
  }
  int const mine = seg_count[static_cast<std::size_t>(me)];
  std::vector<int> recv_count(static_cast<std::size_t>(P), mine),
      recv_displ(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) recv_displ[static_cast<std::size_t>(s)] = s * mine;
  scratch.resize(static_cast<std::size_t>(P) * static_cast<std::size_t>(mine) +
                 static_cast<std::size_t>(mine));
  float* parts = scratch.data();
  float* acc = scratch.data() + static_cast<std::size_t>(P) * static_cast<std::size_t>(mine);
  mpi_check(MPI_Alltoallv(data.data(), seg_count.data(), seg_displ.data(), MPI_FLOAT, parts,
                          recv_count.data(), recv_displ.data(), MPI_FLOAT, comm),
            "MPI_Alltoallv (gradient reduce-scatter)");
  // ((p_0 + p_1) + p_2) + ... in rank order.
  std::copy(parts, parts + mine, acc);
  for (int s = 1; s < P; ++s) {
    float const* p = parts + static_cast<std::size_t>(s) * static_cast<std::size_t>(mine);
    for (int i = 0; i < mine; ++i) acc[i] += p[i];
  }
  mpi_check(MPI_Allgatherv(acc, mine, MPI_FLOAT, data.data(), seg_count.data(), seg_displ.data(),
                           MPI_FLOAT, comm),
            "MPI_Allgatherv (gradients)");
  stats.mpi_seconds += MPI_Wtime() - t0;
  stats.collectives += 2;
  std::int64_t const moved = 4 * (n - mine);
  std::int64_t const got = std::int64_t{4} * mine * (P - 1);
  stats.bytes_sent += moved + std::int64_t{4} * mine * (P - 1);
  stats.bytes_received += got + moved;
}

}  // namespace detail
}  // namespace moe::dist
