// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertParallelMoeFfn: the MoE feed-forward layer with its routed experts sharded over MPI
/// ranks (expert parallelism), dropless, with results equal to the single-process MoeFfn.
/// Needs <mpi.h>: link `moe::dist` (CMake), built when MOE_WITH_MPI is ON. See docs/distributed.md.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "moe/balance/none.hpp"
#include "moe/core/concepts.hpp"
#include "moe/core/eigen_interop.hpp"
#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/dist/communicator.hpp"
#include "moe/dist/placement.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/kernels/combine.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/kernels/gemm.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/layers/detail/expert_jobs.hpp"
#include "moe/layers/detail/row_chunks.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/controls.hpp"

namespace moe::dist {

/// Construction options of ExpertParallelMoeFfn.
struct ExpertParallelOptions {
  /// Owner rank of every routed expert; empty: ExpertPlacement::contiguous(E, P).
  ExpertPlacement placement = {};
  /// How gradients of the replicated parameters are summed over ranks (see GradientReduction).
  GradientReduction reduction = GradientReduction::kRankOrdered;
};

/// Everything one ExpertParallelMoeFfn call writes besides its output. Reused across calls (no
/// allocation once it has seen the largest batch, apart from MPI's own buffers and Eigen's GEMM
/// packing in backward). One per concurrent caller; a training forward keeps here what backward
/// needs. "Token side" buffers hold this rank's tokens; "expert side" buffers hold the rows this
/// rank's experts received from every rank.
struct ExpertParallelWorkspace {
  // Token side, this rank's T tokens.
  std::vector<float> logits;         ///< [T, E] router logits (after routing controls)
  Selection selection;               ///< the router's choices for this rank's tokens
  RoutingPlan plan;                  ///< this rank's rows, sorted by expert
  std::vector<float> routed_out;     ///< [R, D] expert outputs, returned, in plan row order
  std::vector<float> shared_hidden;  ///< [S*T, P_shared] pre-activations (training)
  std::vector<float> shared_act;     ///< [S*T, F_shared] activations
  std::vector<float> shared_out;     ///< [S*T, D]
  std::vector<float> shared_gate;    ///< [T, S]
  double aux_loss = 0.0;             ///< the balance policy's loss on this rank's tokens

  // Where this rank's tokens sit in the global batch (rank order): filled by every forward.
  Index token_offset = 0;              ///< global index of this rank's first token
  Index total_tokens = 0;              ///< tokens over all ranks
  std::vector<Index> tokens_per_rank;  ///< [P]

  // Exchange bookkeeping (rows; MPI counts are int).
  std::vector<Index> send_token;  ///< [R] token of each row in send order
  std::vector<Index> send_row;    ///< [R] plan row of each send slot (non-monotone maps)
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;  ///< [P]
  std::vector<std::int64_t> count_send, count_recv;  ///< [P, 1 + L_max] status + counts
  std::vector<Index> chunk_rows;                     ///< [P, L] rows from rank s for local expert j
  std::vector<Index> chunk_src, chunk_dst;           ///< [P, L] source-major / expert-major offsets
  std::vector<Index> chunk_fill;                     ///< [L] scratch
  std::vector<Index> local_offsets;         ///< [L+1] expert-major offsets of local experts
  std::vector<std::int64_t> global_counts;  ///< [2E+1] all rows, real rows, real tokens
  ExchangeStats stats;                      ///< traffic of the last call
  std::vector<CallRecord> agreement;        ///< [P] the last agreement table

  // Staging for the exchanges.
  std::vector<float> send_buf;  ///< [R, D] rows in send order (token side)
  std::vector<float> recv_buf;  ///< [R_in, D] rows in source-major order (expert side)

  // Expert side: rows of this rank's experts, expert-major (expert j's rows, from rank 0, 1, ...).
  std::vector<float> x_rows;  ///< [R_in, D]
  std::vector<float> hidden;  ///< [R_in, P] pre-activations (training)
  std::vector<float> act;     ///< [R_in, F] (training)
  /// [R_in, D]; 64-byte aligned: a large one is written with streaming stores (MoeFfn's).
  HugePageVector<float> expert_out;
  /// Inference with bf16 panels and AVX512-BF16: projection inputs as bf16 pairs (MoeFfn's
  /// x_pairs / act_pairs; kernels::bf16_pairs_rows), rounded once per forward.
  std::vector<std::uint32_t> x_pairs, act_pairs;                ///< [R_in, D/2], [R_in, F/2]
  std::vector<std::uint32_t> shared_x_pairs, shared_act_pairs;  ///< [T, D/2], [S*T, F_s/2]

  // Training (filled by forward_train, read by backward).
  std::vector<float> x;                  ///< [T, D] copy of the input
  std::vector<std::uint8_t> token_mask;  ///< [T] or empty
  std::vector<float> d_rows;             ///< [R, D] dL/d(expert outputs), plan order
  std::vector<float> dx_rows;            ///< [R, D] returned dL/d(expert inputs), plan order
  std::vector<float> e_drows, e_dxrows, e_dhidden;  ///< expert side [R_in, D], [R_in, D], [R_in, P]
  std::vector<float> shared_dy, shared_dx, shared_dhidden;  ///< [S*T, D], [S*T, D], [S*T, P_s]
  std::vector<float> dweight, dscores, dlogits, dlogits_extra, dgate;
  std::vector<float> bwd_scratch;  ///< per-thread backward_rows / gemm_strided scratch
  std::vector<float> pad;          ///< one zero-padded tile (rank-boundary tiles)
  std::vector<float> partial;      ///< this rank's gradients of the replicated parameters
  std::vector<float> reduce_scratch;
  bool trained = false;

  // Projections: the same job queue as MoeFfn (moe::detail::ExpertJob).
  std::vector<::moe::detail::ExpertJob> jobs;
  std::vector<::moe::detail::ExpertItem> items;
  std::vector<float> panels;

  ConstMatrixView<float> logits_view() const {
    return {logits.data(), selection.num_tokens, selection.num_experts};
  }
};

/// The sparse MoE feed-forward layer of MoeFfn (same policies, same formula, same weights
/// layout) with the E routed experts sharded over the P ranks of an MPI communicator; the router
/// and shared experts are replicated. Each rank calls it on its own tokens.
///
/// | tensor             | shape      |                                                        |
/// |--------------------|------------|--------------------------------------------------------|
/// | x, y, dy, dx       | [T_r, D]   | this rank's tokens (T_r may differ by rank, may be 0);  |
/// |                    |            | y may be x                                             |
/// | router_weight()    | [E, D]     | replicated: equal on every rank                        |
/// | local_experts()    | L_r experts D -> F -> D: experts local_expert_ids()           |
/// | shared_experts()   | replicated, as in MoeFfn                                      |
///
/// Preconditions: MPI initialised (MPI_THREAD_FUNNELED or more when a ThreadPool is used); every
/// rank constructs the layer with the same arguments and calls its collective operations
/// (constructor, forward, forward_train, backward, end_step, verify_replicas, sync_replicas) in
/// the same order — violations are reported as moe::Error on every rank, see below; one thread
/// at a time per layer (calls are numbered); the layer is destroyed before MPI_Finalize.
///
/// Protocol of one forward (every step a collective over the layer's communicator, in order):
///  1. *Agreement* (MPI_Allgather of a fixed-size record): operation, call number, configuration
///     fingerprint, token count and the outcome of the local argument checks. Every rank sees
///     the same table, so a rank with bad input or a different configuration makes *every* rank
///     throw moe::Error, and nobody waits in step 3.
///  2. Routing, locally, with the replicated router: logits, Selection, RoutingPlan (rows sorted
///     by expert), exactly as MoeFfn::route on these tokens.
///  3. *Counts* (MPI_Alltoall, blocks of 1 + L_max int64): to each rank q, a status flag and the
///     number of rows for each of q's experts. A rank whose routing failed (non-finite logits)
///     flags it here and every rank throws.
///  4. *Dispatch* (MPI_Alltoallv, counts in rows of D floats): each row (token, expert) goes to
///     the expert's owner, grouped by destination rank, then expert id, then token. No row is
///     dropped and there is no capacity padding (dropless; capacity policies drop before, as in
///     MoeFfn). The owner reorders rows from source-major to expert-major, so expert e's rows
///     are all its rows of the global batch in global token order.
///  5. Experts run on the owner, each on all its rows at once (same kernels and row counts as
///     MoeFfn on the concatenated batch).
///  6. *Return* (MPI_Alltoallv with the counts swapped): outputs go back to the token's rank.
///  7. Shared experts (replicated) on the local tokens, then combine: each token's rows in slot
///     order, then the shared experts (kernels::combine_rows), as MoeFfn does.
/// forward_train adds 8. an MPI_Allreduce of per-expert row counts (exact integer sums) that
/// gives every rank the global counts: the owner uses them to split its rows into the same tiles
/// as MoeFfn's backward, and stateful balance policies observe the global batch (below).
/// backward reuses the forward's counts: agreement, combine VJP (local), dispatch of dL/dY rows
/// (Alltoallv), expert VJPs on the owner, return of dL/dX rows (Alltoallv), router / shared VJPs
/// (local), and the sum of the replicated parameters' gradients over ranks.
///
/// Equality with MoeFfn (the global batch = the ranks' tokens concatenated in rank order; same
/// weights, same packed state and format; gradients starting from zero):
///  - forward y, logits, selection, plan: bitwise. Every projection element is one fixed FMA
///    chain that depends on the row and on the kernel path; the path of MoeFfn depends on the
///    row count of the call, so each projection here takes the path MoeFfn takes on the global
///    batch (experts: the owner has all the expert's rows; router and shared experts: chosen from
///    the global token count).
///  - backward dx and every routed-expert gradient: bitwise. Eigen's GEMM (backward) can round
///    a row differently depending on the row count and the row's position in the call, so the
///    owner calls it on exactly MoeFfn's tiles (64 rows of the global plan, split at expert
///    boundaries), and the token side evaluates 64-token tiles of the global batch, zero-padded
///    where a tile straddles a rank boundary.
///  - router, shared-expert and gate gradients: sums over all tokens of the global batch. Each
///    rank sums its tokens, then the partials are summed over ranks, so the order of the float
///    additions differs from MoeFfn's: |ep - ref| <= (T + P) 2^-23 sum_t |term_t| per element
///    (T global tokens), in practice a few ulps. With GradientReduction::kRankOrdered the result
///    is bitwise reproducible for a given P and token split, identical on every rank; with one
///    rank it is bitwise equal to MoeFfn.
///
/// Balance policies: aux_loss and its gradient are evaluated on each rank's tokens (the
/// per-device micro-batch loss of GShard / Megatron-LM). Policies with `observe` (AuxFreeBias,
/// GlobalBatchAux) observe the *global* batch: after the count all-reduce they get a count-only
/// BalanceInputs (plan.expert_offsets = global per-expert rows of real tokens, plan.row_token
/// zeros, selection.num_tokens = global real tokens, slots and experts set; logits, scores and
/// expert outputs empty), so every rank updates its replicated state identically and, e.g.,
/// AuxFreeBias moves the router bias exactly as MoeFfn on the global batch does.
///
/// Not supported here (use MoeFfn): Default MoE. Routers whose choice depends on the whole batch
/// (ExpertChoice, WithCapacity) choose within each rank's tokens.
///
/// Threads: compute runs on the optional ThreadPool; MPI is called only from the calling thread
/// (MPI_THREAD_FUNNELED suffices). Results are bitwise identical for any pool size.
/// Errors: local precondition failures (shapes, non-finite logits, mismatched configurations,
/// calls out of step; any std::exception thrown before the first exchange) throw moe::Error on
/// every rank. A failure after the agreement (out of
/// memory, an MPI error) cannot be reported collectively; MPI's default handler aborts the job.
template <RouterPolicy Router_, ExpertPolicy Expert_,
          SharedExpertPolicy Shared_ = experts::NoSharedExperts,
          BalancePolicy Balance_ = balance::None>
class ExpertParallelMoeFfn {
 public:
  using Router = Router_;
  using Expert = Expert_;
  using Shared = Shared_;
  using Balance = Balance_;
  using Bank = experts::ExpertBank<Expert>;
  /// The single-process layer with the same policies.
  using Layer = MoeFfn<Router, Expert, Shared, Balance>;
  static constexpr Index kTileRows = Layer::kTileRows;
  static constexpr Index kGradRows = Layer::kGradRows;

  /// Gradients laid out like parameters(): the router and shared experts (replicated, identical
  /// on every rank after backward) and this rank's routed experts only.
  struct Gradients {
    std::vector<float> router_weight;  ///< [E, D]
    Bank experts;                      ///< this rank's L experts
    Shared shared;                     ///< like the layer's shared experts
    void zero() {
      std::fill(router_weight.begin(), router_weight.end(), 0.0f);
      std::fill(experts.parameters().begin(), experts.parameters().end(), 0.0f);
      if constexpr (Shared::has_experts) {
        auto p = shared.bank().parameters();
        std::fill(p.begin(), p.end(), 0.0f);
        auto g = shared.gate_weight();
        std::fill(g.data, g.data + g.rows * g.cols, 0.0f);
      }
    }
    ParameterList groups() { return list_parameters(router_weight, experts, shared); }
  };

  ExpertParallelMoeFfn() = default;

  /// A layer with zero weights, sharded over `comm` (collective over comm: every rank must call
  /// it, with the same arguments). This rank stores its own experts (see local_experts()), the
  /// router and the shared experts. Throws moe::Error on every rank if any rank's arguments are
  /// invalid or the ranks disagree on the sizes, the router's kind and slots, the expert kind,
  /// the shared experts or the placement.
  ExpertParallelMoeFfn(MPI_Comm comm, Index d_model, Index d_ffn, Router router, Shared shared = {},
                       Balance balance = {}, ExpertParallelOptions options = {})
      : comm_(comm) {
    CallRecord rec = record(CallKind::kConstruct);
    try {
      router.validate();
      Index const E = router.expert_count();
      ::moe::detail::check(d_model >= 1 && d_ffn >= 1, "ExpertParallelMoeFfn: d_model = ", d_model,
                           ", d_ffn = ", d_ffn, "; both must be >= 1");
      if (options.placement.empty()) {
        options.placement = ExpertPlacement::contiguous(E, comm_.size());
      }
      ::moe::detail::check(
          options.placement.num_experts() == E && options.placement.num_ranks() == comm_.size(),
          "ExpertParallelMoeFfn: the placement is for ", options.placement.num_experts(),
          " experts over ", options.placement.num_ranks(), " ranks, but the router has ", E,
          " experts and the communicator ", comm_.size(),
          " ranks; build it with ExpertPlacement::contiguous(E, P) or similar");
      if constexpr (Shared::has_experts) {
        ::moe::detail::check(
            shared.count() == 0 || shared.bank().d_model() == d_model,
            "ExpertParallelMoeFfn: shared experts have d_model = ", shared.bank().d_model(),
            " but the layer has ", d_model, "; build them with the layer's d_model");
      }
      router_ = std::move(router);
      shared_ = std::move(shared);
      balance_ = std::move(balance);
      placement_ = std::move(options.placement);
      reduction_ = options.reduction;
      d_model_ = d_model;
      d_ffn_ = d_ffn;
      bank_ = Bank(placement_.num_local(comm_.rank()), d_model, d_ffn);
      router_weight_.assign(static_cast<std::size_t>(E * d_model), 0.0f);
      row_type_ = RowType(d_model);
      describe_config(rec);
    } catch (std::exception const& e) {
      rec.failed = 1;
      detail::copy_text(rec.message, e.what());
    }
    std::vector<CallRecord> table;
    detail::agree(comm_.get(), rec, "ExpertParallelMoeFfn", false, nullptr, table);
  }

  /// The expert-parallel twin of a single-process layer (collective): the same router (with its
  /// settings and bias), balance policy, router and shared-expert weights, and this rank's
  /// experts copied from `layer`'s bank. Packs the local experts if `layer`'s are packed.
  static ExpertParallelMoeFfn from_layer(MPI_Comm comm, Layer const& layer,
                                         ExpertParallelOptions options = {}) {
    ExpertParallelMoeFfn ep(comm, layer.d_model(), layer.d_ffn(), layer.router(),
                            layer.shared_experts(), layer.balance(), std::move(options));
    auto const w = layer.router_weight();
    std::copy(w.data, w.data + w.rows * w.cols, ep.router_weight_.begin());
    auto const ids = ep.local_expert_ids();
    for (std::size_t j = 0; j < ids.size(); ++j) {
      auto const src_in = layer.experts().in_proj(ids[j]);
      auto const src_down = layer.experts().down_proj(ids[j]);
      auto dst_in = ep.bank_.in_proj(static_cast<Index>(j));
      auto dst_down = ep.bank_.down_proj(static_cast<Index>(j));
      std::copy(src_in.data, src_in.data + src_in.rows * src_in.cols, dst_in.data);
      std::copy(src_down.data, src_down.data + src_down.rows * src_down.cols, dst_down.data);
    }
    if (layer.experts().packed()) ep.bank_.pack(layer.experts().packed_format());
    return ep;
  }

  ExpertParallelMoeFfn(ExpertParallelMoeFfn&&) noexcept = default;
  ExpertParallelMoeFfn& operator=(ExpertParallelMoeFfn&&) noexcept = default;

  Index d_model() const { return d_model_; }
  Index d_ffn() const { return d_ffn_; }
  Index num_experts() const { return router_.expert_count(); }
  int rank() const { return comm_.rank(); }
  int num_ranks() const { return comm_.size(); }
  /// The layer's own duplicate of the communicator it was built on.
  MPI_Comm communicator() const { return comm_.get(); }
  ExpertPlacement const& placement() const { return placement_; }
  GradientReduction reduction() const { return reduction_; }
  /// Global ids of this rank's experts, ascending: local expert j is expert local_expert_ids()[j].
  std::span<Index const> local_expert_ids() const { return placement_.experts_of(comm_.rank()); }

  Router& router() { return router_; }
  Router const& router() const { return router_; }
  /// This rank's routed experts (L = local_expert_ids().size() of them, possibly 0).
  Bank& local_experts() { return bank_; }
  Bank const& local_experts() const { return bank_; }
  Shared& shared_experts() { return shared_; }
  Shared const& shared_experts() const { return shared_; }
  Balance& balance() { return balance_; }
  Balance const& balance() const { return balance_; }
  /// [E, D] router projection (replicated: keep it equal on every rank).
  MatrixView<float> router_weight() { return {router_weight_.data(), num_experts(), d_model_}; }
  ConstMatrixView<float> router_weight() const {
    return {router_weight_.data(), num_experts(), d_model_};
  }

  /// Every trainable parameter as in MoeFfn::parameters(), except that "experts" holds this
  /// rank's experts only.
  ParameterList parameters() { return list_parameters(router_weight_, bank_, shared_); }

  /// Zero gradients shaped like parameters().
  Gradients make_gradients() const {
    Gradients g;
    g.router_weight.assign(router_weight_.size(), 0.0f);
    g.experts = Bank(bank_.num_experts(), d_model_, d_ffn_);
    if constexpr (Shared::has_experts) {
      g.shared = Shared(shared_.count(), d_model_, shared_.bank().d_ffn());
    }
    return g;
  }

  /// Packs the local and shared experts' weights once (ExpertBank::pack), as MoeFfn::pack_weights:
  /// fp32 panels, or bf16 panels for inference (training forwards then use the fp32 weights).
  void pack_weights(experts::WeightFormat format = experts::WeightFormat::kF32) {
    bank_.pack(format);
    if constexpr (Shared::has_experts) shared_.bank().pack(format);
  }

  /// y = MoE(x) for this rank's tokens x [T_r, D] into y [T_r, D] (y may be x). Collective: every
  /// rank calls it (T_r may differ, and may be 0). Same options as MoeFfn::forward.
  void forward(ConstMatrixView<float> x, MatrixView<float> y, ExpertParallelWorkspace& ws,
               ForwardOptions const& opt = {}) {
    forward_impl(x, y, ws, opt, false);
  }

  /// Training forward (collective): forward() that also keeps in `ws` what backward needs, gets
  /// the global per-expert counts and lets stateful balance policies observe the global batch.
  void forward_train(ConstMatrixView<float> x, MatrixView<float> y, ExpertParallelWorkspace& ws,
                     ForwardOptions const& opt = {}) {
    forward_impl(x, y, ws, opt, true);
  }

  /// Backward of the last forward_train on `ws` (collective): dx [T_r, D] = dL/dx for this rank's
  /// tokens (overwritten); gradients accumulated (+=) into `grads`: this rank's experts from
  /// this rank's rows only (the owner has every row of its experts), the router, shared experts
  /// and gate summed over all ranks (identical on every rank; see GradientReduction).
  void backward(ExpertParallelWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                Gradients& grads,
                ThreadPool* pool = nullptr) requires TrainableRouterPolicy<Router> {
    CallRecord rec = record(CallKind::kBackward);
    try {
      ::moe::detail::check(ws.trained,
                           "ExpertParallelMoeFfn::backward: the workspace holds no training "
                           "forward; call forward_train first (and backward once per forward)");
      Index const T = ws.selection.num_tokens, D = d_model_;
      ::moe::detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                           "ExpertParallelMoeFfn::backward: dy and dx must be [", T, ", ", D,
                           "] like the forward's x");
      ::moe::detail::check(
          grads.router_weight.size() == router_weight_.size() &&
              grads.experts.parameters().size() == std::as_const(bank_).parameters().size(),
          "ExpertParallelMoeFfn::backward: gradients do not match this layer; use "
          "make_gradients()");
      if constexpr (Shared::has_experts) {
        ::moe::detail::check(
            grads.shared.bank().parameters().size() ==
                std::as_const(shared_).bank().parameters().size(),
            "ExpertParallelMoeFfn::backward: shared-expert gradients do not match; use "
            "make_gradients()");
      }
    } catch (std::exception const& e) {
      rec.failed = 1;
      detail::copy_text(rec.message, e.what());
    }
    ws.stats.clear();
    detail::agree(comm_.get(), rec, "ExpertParallelMoeFfn::backward", false, &ws.stats,
                  ws.agreement);
    ws.trained = false;
    backward_impl(ws, dy, dx, grads, pool);
  }

  /// Calls the balance policy's end_step(router) if it has one (collective: every rank calls it,
  /// so replicated router state stays equal). Call once per optimizer step.
  void end_step() {
    CallRecord rec = record(CallKind::kEndStep);
    std::vector<CallRecord> table;
    detail::agree(comm_.get(), rec, "ExpertParallelMoeFfn::end_step", false, nullptr, table);
    if constexpr (requires(Balance & b, Router & r) { b.end_step(r); }) balance_.end_step(router_);
  }

  /// Checks (collective) that the replicated parameters — router weight, router bias if the
  /// router has one, shared experts and their gate — are bitwise equal on every rank, by
  /// comparing 64-bit hashes. Throws moe::Error on every rank otherwise.
  void verify_replicas() {
    CallRecord rec = record(CallKind::kVerifyReplicas);
    std::uint64_t const hr = detail::fnv1a(router_weight_.data(), router_weight_.size() * 4);
    std::uint64_t hb = 0, hs = 0;
    if constexpr (requires(Router const& r) { r.bias.data(); }) {
      hb = detail::fnv1a(router_.bias.data(), router_.bias.size() * sizeof(float));
    }
    if constexpr (Shared::has_experts) {
      auto p = std::as_const(shared_).bank().parameters();
      auto g = std::as_const(shared_).gate_weight();
      hs = detail::fnv1a(p.data(), p.size() * 4);
      hs = detail::fnv1a(g.data, static_cast<std::size_t>(g.rows * g.cols) * 4, hs);
    }
    rec.extra = detail::fnv1a(&hb, 8, detail::fnv1a(&hs, 8, hr));
    detail::copy_text(rec.message, "router.weight hash " + std::to_string(hr % 1000000) +
                                       ", router bias hash " + std::to_string(hb % 1000000) +
                                       ", shared experts hash " + std::to_string(hs % 1000000));
    std::vector<CallRecord> table;
    detail::agree(comm_.get(), rec, "ExpertParallelMoeFfn::verify_replicas", true, nullptr, table);
  }

  /// Copies the replicated parameters (router weight, router bias, shared experts and gate)
  /// from rank `root` to every rank (collective, MPI_Bcast): e.g. after initialising them on
  /// one rank only.
  void sync_replicas(int root = 0) {
    CallRecord rec = record(CallKind::kSyncReplicas);
    if (root < 0 || root >= comm_.size()) {
      rec.failed = 1;
      detail::copy_text(rec.message, "sync_replicas: root " + std::to_string(root) +
                                         " is not a rank of the layer's communicator");
    }
    std::vector<CallRecord> table;
    detail::agree(comm_.get(), rec, "ExpertParallelMoeFfn::sync_replicas", false, nullptr, table);
    auto bcast = [&](float* p, std::size_t n) {
      if (n == 0) return;
      detail::mpi_check(MPI_Bcast(p, detail::mpi_count(static_cast<std::int64_t>(n), "floats"),
                                  MPI_FLOAT, root, comm_.get()),
                        "MPI_Bcast");
    };
    bcast(router_weight_.data(), router_weight_.size());
    if constexpr (requires(Router & r) { r.bias.data(); }) {
      std::int64_t n = static_cast<std::int64_t>(router_.bias.size());
      detail::mpi_check(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm_.get()), "MPI_Bcast");
      router_.bias.resize(static_cast<std::size_t>(n));
      bcast(router_.bias.data(), router_.bias.size());
    }
    if constexpr (Shared::has_experts) {
      auto p = shared_.bank().parameters();
      bcast(p.data(), p.size());
      auto g = shared_.gate_weight();
      bcast(g.data, static_cast<std::size_t>(g.rows * g.cols));
    }
  }

 private:
  template <class V, class SharedT>
  static ParameterList list_parameters(V& router_weight, Bank& bank, SharedT& shared) {
    ParameterList list;
    list.push_back({"router.weight", std::span<float>(router_weight)});
    list.push_back({"experts", bank.parameters()});
    if constexpr (SharedT::has_experts) {
      list.push_back({"shared_experts", shared.bank().parameters()});
      auto g = shared.gate_weight();
      list.push_back({"shared_experts.gate",
                      std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols))});
    }
    return list;
  }

  CallRecord record(CallKind kind) {
    CallRecord rec;
    rec.kind = static_cast<std::int64_t>(kind);
    rec.seq = seq_++;
    rec.config = config_hash_;
    detail::copy_text(rec.config_text, config_text_);
    return rec;
  }

  /// The configuration every rank must share, as a fingerprint and a readable line.
  void describe_config(CallRecord& rec) {
    Index Fs = 0;
    if constexpr (Shared::has_experts) Fs = shared_.bank().d_ffn();
    std::string text =
        "E=" + std::to_string(num_experts()) + " D=" + std::to_string(d_model_) +
        " F=" + std::to_string(d_ffn_) + " slots=" + std::to_string(router_.slots_per_token()) +
        " expert=" + (Expert::gated ? "glu/" : "mlp/") + kernels::to_string(Expert::activation) +
        " shared=" + std::to_string(shared_.count()) + "x" + std::to_string(Fs) +
        (Shared::gated ? " gated" : "") + " placement=" + placement_.describe() + " reduction=" +
        (reduction_ == GradientReduction::kRankOrdered ? "rank-ordered" : "allreduce") +
        " router=" + typeid(Router).name() + " balance=" + typeid(Balance).name();
    config_text_ = text;
    config_hash_ = detail::fnv1a(text.data(), text.size());
    std::uint64_t const ph = placement_.fingerprint();
    config_hash_ = detail::fnv1a(&ph, sizeof ph, config_hash_);
    rec.config = config_hash_;
    detail::copy_text(rec.config_text, config_text_);
  }

  static int threads_of(ThreadPool* pool) { return pool ? pool->size() : 1; }

  /// The largest projection depth (K) of any job.
  Index panel_depth() const {
    Index k = std::max(d_model_, d_ffn_);
    if constexpr (Shared::has_experts) k = std::max(k, shared_.bank().d_ffn());
    return k;
  }
  Index panel_floats() const {
    Index const n = kernels::expert_scratch_floats(panel_depth());
    return (n + 15) / 16 * 16;
  }

  using Job = ::moe::detail::ExpertJob;

  /// Queues a projection on MoeFfn's queue. `rows_for_path` is the row count MoeFfn's job has on
  /// the global batch: raw weights take the dot-product path below kPanelMinRows of them, so that
  /// every row gets the arithmetic MoeFfn gives it.
  static void add_job(ExpertParallelWorkspace& ws, Job job, Index rows_for_path) {
    job.w.dot_products = job.w.raw[0] != nullptr && rows_for_path < kernels::kPanelMinRows;
    ::moe::detail::add_expert_job(ws.jobs, ws.items, job);
  }
  static kernels::WeightPanels weights_of(float const* raw, Index rows, float const* packed,
                                          std::uint32_t const* packed_bf16, Index depth, Index half,
                                          bool use_bf16) {
    return ::moe::detail::expert_weights(raw, rows, packed, packed_bf16, depth, half, use_bf16,
                                         false);
  }

  void run_jobs(ExpertParallelWorkspace& ws, ThreadPool* pool) const {
    Index const per = panel_floats();
    ws.panels.resize(static_cast<std::size_t>(threads_of(pool) * per));
    using SharedX = typename ::moe::detail::SharedExpertOr<Shared, Expert>::type;
    ::moe::detail::run_expert_jobs<Expert, SharedX>(ws.jobs, ws.items, pool, ws.panels.data(), per);
  }

  void check_input(ConstMatrixView<float> x) const {
    ::moe::detail::check(x.cols == d_model_, "ExpertParallelMoeFfn: x has ", x.cols,
                         " columns but d_model = ", d_model_,
                         "; pass activations of shape [tokens, d_model]");
    ::moe::detail::check(x.rows >= 0 && x.row_stride >= x.cols && (x.data || x.rows == 0),
                         "ExpertParallelMoeFfn: x is not a valid view (rows = ", x.rows,
                         ", row_stride = ", x.row_stride, ")");
    ::moe::detail::check(comm_.valid() && !router_weight_.empty(),
                         "ExpertParallelMoeFfn: the layer was default-constructed or moved from; "
                         "construct it with a communicator and sizes first");
  }
  void check_output(ConstMatrixView<float> x, MatrixView<float> y) const {
    ::moe::detail::check(y.rows == x.rows && y.cols == d_model_, "ExpertParallelMoeFfn: y is [",
                         y.rows, ", ", y.cols, "] but must be [", x.rows, ", ", d_model_,
                         "] like x");
    ::moe::detail::check(y.row_stride >= y.cols && (y.data || y.rows == 0),
                         "ExpertParallelMoeFfn: y is not a valid view");
  }

  BalanceInputs balance_inputs(ExpertParallelWorkspace const& ws) const {
    return BalanceInputs{ws.logits_view(), ws.selection, ws.plan,
                         ConstMatrixView<float>(ws.routed_out.data(), ws.plan.num_rows(), d_model_),
                         ws.token_mask};
  }

  /// Routing of this rank's tokens, as MoeFfn::route; the router projection takes the kernel
  /// path MoeFfn takes for `total_tokens` rows.
  void route(ConstMatrixView<float> x, ExpertParallelWorkspace& ws, ForwardOptions const& opt,
             Index total_tokens) const {
    Index const T = x.rows, E = num_experts();
    ws.logits.resize(static_cast<std::size_t>(T * E));
    MatrixView<float> logits(ws.logits.data(), T, E);
    ws.jobs.clear();
    ws.items.clear();
    Job job;
    job.a = {x.data, x.row_stride, nullptr};
    job.rows = T;
    job.depth = d_model_;
    job.w = weights_of(router_weight_.data(), E, nullptr, nullptr, d_model_, 0, false);
    job.c = logits.data;
    job.ldc = E;
    job.cols = E;
    add_job(ws, job, total_tokens);
    run_jobs(ws, opt.pool);
    for (Index t = 0; t < T; ++t) {
      float const* z = logits.row(t);
      for (Index e = 0; e < E; ++e) {
        if (!std::isfinite(z[e])) {
          ::moe::detail::fail("ExpertParallelMoeFfn: router logit [token ", t, " of rank ",
                              comm_.rank(), " (global token ", ws.token_offset + t, "), expert ", e,
                              "] is ", z[e],
                              "; NaN or Inf in the input x or the router weight. Check the "
                              "previous layer's output");
        }
      }
    }
    if (opt.controls) opt.controls->apply_to_logits(logits);
    router_.select(logits, ws.selection);
    if (opt.controls) opt.controls->apply_to_weights(ws.selection);
    kernels::build_plan(ws.selection, ws.plan);
    ws.aux_loss =
        balance_.aux_loss(BalanceInputs{logits, ws.selection, ws.plan, {}, opt.token_mask});
  }

  void forward_impl(ConstMatrixView<float> x, MatrixView<float> y, ExpertParallelWorkspace& ws,
                    ForwardOptions const& opt, bool train) {
    // 1. Local checks, then the agreement (no exchange before every rank is known to be fine).
    CallRecord rec = record(train ? CallKind::kForwardTrain : CallKind::kForward);
    rec.tokens = x.rows;
    try {
      check_input(x);
      check_output(x, y);
      ::moe::detail::check(
          opt.token_mask.empty() || static_cast<Index>(opt.token_mask.size()) == x.rows,
          "ExpertParallelMoeFfn: token_mask has ", opt.token_mask.size(), " entries for ", x.rows,
          " tokens; pass one per token or none");
      if (opt.controls) opt.controls->validate(num_experts());
      ::moe::detail::check(!train || !opt.controls || opt.controls->weight_multiplier.empty(),
                           "ExpertParallelMoeFfn::forward_train: routing weight multipliers are "
                           "an inference-time control; train without them");
    } catch (std::exception const& e) {
      rec.failed = 1;
      detail::copy_text(rec.message, e.what());
    }
    ws.stats.clear();
    ws.trained = false;
    detail::agree(comm_.get(), rec,
                  train ? "ExpertParallelMoeFfn::forward_train" : "ExpertParallelMoeFfn::forward",
                  false, &ws.stats, ws.agreement);
    auto const& table = ws.agreement;
    int const P = comm_.size(), me = comm_.rank();
    ws.tokens_per_rank.resize(static_cast<std::size_t>(P));
    ws.total_tokens = 0;
    for (int r = 0; r < P; ++r) {
      if (r == me) ws.token_offset = ws.total_tokens;
      ws.tokens_per_rank[static_cast<std::size_t>(r)] = table[static_cast<std::size_t>(r)].tokens;
      ws.total_tokens += table[static_cast<std::size_t>(r)].tokens;
    }
    Index const T = x.rows, D = d_model_;
    ConstMatrixView<float> xin = x;
    if (train) {
      ws.x.resize(static_cast<std::size_t>(T * D));
      for (Index t = 0; t < T; ++t) std::copy(x.row(t), x.row(t) + D, ws.x.data() + t * D);
      xin = ConstMatrixView<float>(ws.x.data(), T, D);
      ws.token_mask.assign(opt.token_mask.begin(), opt.token_mask.end());
    }
    // 2. Route locally; a failure is reported with the counts (3).
    std::int64_t status = 0;
    std::string route_error;
    try {
      route(xin, ws, opt, ws.total_tokens);
    } catch (std::exception const& e) {
      status = 1;
      route_error = e.what();
    }
    // 3. Counts.
    exchange_counts(ws, status, route_error);
    // 4. Dispatch the token rows to the experts' owners.
    dispatch_rows(xin, ws, opt.pool);
    // 5. Local experts on every row they received.
    run_local_experts(ws, opt.pool, train);
    // 6. Outputs back to the tokens' ranks, in plan row order.
    return_rows(ws.expert_out.data(), ws.routed_out, ws, opt.pool);
    // 7. Shared experts and combine.
    run_shared_and_combine(xin, y, ws, opt.pool, train);
    if (train) {
      global_counts(ws);
      if constexpr (requires(Balance & b, BalanceInputs const& in) { b.observe(in); }) {
        observe_global(ws);
      }
      ws.trained = true;
    }
  }

  /// Step 3: status + per-expert counts to every rank (MPI_Alltoall); derives the row counts
  /// and displacements of both exchanges and the source-major -> expert-major reordering.
  void exchange_counts(ExpertParallelWorkspace& ws, std::int64_t status,
                       std::string const& route_error) const {
    int const P = comm_.size(), me = comm_.rank();
    Index const Lmax = placement_.max_local(), block = 1 + Lmax;
    RoutingPlan const& plan = ws.plan;
    bool const routed = status == 0;
    ws.count_send.assign(static_cast<std::size_t>(P * block), 0);
    ws.count_recv.assign(static_cast<std::size_t>(P * block), 0);
    for (int q = 0; q < P; ++q) {
      std::int64_t* b = ws.count_send.data() + q * block;
      b[0] = status;
      auto const ids = placement_.experts_of(q);
      for (std::size_t j = 0; j < ids.size() && routed; ++j) b[1 + j] = plan.expert_rows(ids[j]);
    }
    detail::alltoall_i64(comm_.get(), ws.count_send.data(), ws.count_recv.data(),
                         static_cast<int>(block), ws.stats);
    for (int s = 0; s < P; ++s) {
      if (ws.count_recv[static_cast<std::size_t>(s * block)] != 0) {
        if (s == me) throw Error(route_error);
        ::moe::detail::fail("ExpertParallelMoeFfn::forward (rank ", me, " of ", P, "): rank ", s,
                            " could not route its tokens (non-finite router logits or an invalid "
                            "routing); every rank stops this call. See rank ",
                            s, "'s error for the token and the fix");
      }
    }
    // Send side: rows grouped by destination rank, then expert, then token.
    ws.send_counts.assign(static_cast<std::size_t>(P), 0);
    ws.send_displs.assign(static_cast<std::size_t>(P), 0);
    Index R = plan.num_rows(), offset = 0;
    bool const monotone = placement_.monotone();
    ws.send_token.resize(static_cast<std::size_t>(R));
    ws.send_row.resize(static_cast<std::size_t>(monotone ? 0 : R));
    for (int q = 0; q < P; ++q) {
      Index n = 0;
      for (Index e : placement_.experts_of(q)) {
        for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r) {
          ws.send_token[static_cast<std::size_t>(offset + n)] = plan.row_token[r];
          if (!monotone) ws.send_row[static_cast<std::size_t>(offset + n)] = r;
          ++n;
        }
      }
      ws.send_displs[static_cast<std::size_t>(q)] = detail::mpi_count(offset, "rows sent");
      ws.send_counts[static_cast<std::size_t>(q)] = detail::mpi_count(n, "rows sent");
      offset += n;
    }
    // Receive side: rows from rank s for local expert j.
    Index const L = bank_.num_experts();
    ws.chunk_rows.assign(static_cast<std::size_t>(P * L), 0);
    ws.recv_counts.assign(static_cast<std::size_t>(P), 0);
    ws.recv_displs.assign(static_cast<std::size_t>(P), 0);
    ws.local_offsets.assign(static_cast<std::size_t>(L + 1), 0);
    Index rin = 0;
    for (int s = 0; s < P; ++s) {
      Index n = 0;
      for (Index j = 0; j < L; ++j) {
        Index const c = ws.count_recv[static_cast<std::size_t>(s * block + 1 + j)];
        ws.chunk_rows[static_cast<std::size_t>(s * L + j)] = c;
        ws.local_offsets[static_cast<std::size_t>(j + 1)] += c;
        n += c;
      }
      ws.recv_displs[static_cast<std::size_t>(s)] = detail::mpi_count(rin, "rows received");
      ws.recv_counts[static_cast<std::size_t>(s)] = detail::mpi_count(n, "rows received");
      rin += n;
    }
    for (Index j = 0; j < L; ++j) ws.local_offsets[j + 1] += ws.local_offsets[j];
    ws.chunk_src.resize(static_cast<std::size_t>(P * L));
    ws.chunk_dst.resize(static_cast<std::size_t>(P * L));
    std::vector<Index>& dst_fill = ws.chunk_fill;
    dst_fill.assign(ws.local_offsets.begin(), ws.local_offsets.end() - 1);
    for (int s = 0; s < P; ++s) {
      Index src = ws.recv_displs[static_cast<std::size_t>(s)];
      for (Index j = 0; j < L; ++j) {
        Index const c = ws.chunk_rows[static_cast<std::size_t>(s * L + j)];
        ws.chunk_src[static_cast<std::size_t>(s * L + j)] = src;
        ws.chunk_dst[static_cast<std::size_t>(s * L + j)] = dst_fill[static_cast<std::size_t>(j)];
        dst_fill[static_cast<std::size_t>(j)] += c;
        src += c;
      }
    }
    ws.stats.rows_sent = R;
    ws.stats.rows_received = rin;
    ws.stats.remote_rows_sent = R - ws.send_counts[static_cast<std::size_t>(me)];
  }

  /// With at most one local expert the source-major receive order is already expert-major,
  /// and the reorder is skipped.
  static bool expert_major_is_source_major(Index L) { return L <= 1; }

  /// Source-major rows (as received) -> expert-major rows, or back (`to_source`).
  void reorder(float const* src, float* dst, ExpertParallelWorkspace const& ws, bool to_source,
               ThreadPool* pool) const {
    Index const D = d_model_;
    Index const chunks = static_cast<Index>(ws.chunk_rows.size());
    parallel_for(pool, chunks, [&](Index i, int) {
      Index const n = ws.chunk_rows[static_cast<std::size_t>(i)];
      Index const a = ws.chunk_src[static_cast<std::size_t>(i)];
      Index const b = ws.chunk_dst[static_cast<std::size_t>(i)];
      if (n == 0) return;
      if (to_source) {
        std::copy(src + b * D, src + (b + n) * D, dst + a * D);
      } else {
        std::copy(src + a * D, src + (a + n) * D, dst + b * D);
      }
    });
  }

  /// Step 4: gather this rank's rows in send order, MPI_Alltoallv, reorder to expert-major.
  void dispatch_rows(ConstMatrixView<float> x, ExpertParallelWorkspace& ws,
                     ThreadPool* pool) const {
    Index const D = d_model_, R = ws.plan.num_rows(), L = bank_.num_experts();
    Index const rin = ws.local_offsets.back();
    ws.send_buf.resize(static_cast<std::size_t>(R * D));
    ws.x_rows.resize(static_cast<std::size_t>(rin * D));
    Index const tiles = (R + kTileRows - 1) / kTileRows;
    parallel_for(pool, tiles, [&](Index i, int) {
      Index const r0 = i * kTileRows, n = std::min(kTileRows, R - r0);
      kernels::gather_rows(x.data, x.row_stride, ws.send_token.data() + r0, n, D,
                           ws.send_buf.data() + r0 * D, D);
    });
    bool const direct = expert_major_is_source_major(L);
    if (!direct) ws.recv_buf.resize(static_cast<std::size_t>(rin * D));
    detail::alltoallv_rows(comm_.get(), ws.send_buf.data(), ws.send_counts, ws.send_displs,
                           direct ? ws.x_rows.data() : ws.recv_buf.data(), ws.recv_counts,
                           ws.recv_displs, row_type_.get(), D * 4, ws.stats);
    if (!direct) reorder(ws.recv_buf.data(), ws.x_rows.data(), ws, false, pool);
  }

  /// Step 6 (and its backward twin): expert-major rows `src` [R_in, D] back to the tokens'
  /// ranks, into `dst` [R, D] in plan row order.
  void return_rows(float const* src, std::vector<float>& dst, ExpertParallelWorkspace& ws,
                   ThreadPool* pool) const {
    Index const D = d_model_, R = ws.plan.num_rows(), L = bank_.num_experts();
    Index const rin = ws.local_offsets.back();
    bool const direct = expert_major_is_source_major(L);
    float const* send = src;
    if (!direct) {
      ws.recv_buf.resize(static_cast<std::size_t>(rin * D));
      reorder(src, ws.recv_buf.data(), ws, true, pool);
      send = ws.recv_buf.data();
    }
    dst.resize(static_cast<std::size_t>(R * D));
    bool const monotone = placement_.monotone();
    if (!monotone) ws.send_buf.resize(static_cast<std::size_t>(R * D));
    detail::alltoallv_rows(comm_.get(), send, ws.recv_counts, ws.recv_displs,
                           monotone ? dst.data() : ws.send_buf.data(), ws.send_counts,
                           ws.send_displs, row_type_.get(), D * 4, ws.stats);
    if (!monotone) {
      for (Index i = 0; i < R; ++i) {
        Index const r = ws.send_row[static_cast<std::size_t>(i)];
        std::copy(ws.send_buf.data() + i * D, ws.send_buf.data() + (i + 1) * D, dst.data() + r * D);
      }
    }
  }

  /// The backward dispatch: `src` [R, D] in plan row order to the owners, expert-major into dst.
  void send_rows_to_owners(std::vector<float> const& src, std::vector<float>& dst,
                           ExpertParallelWorkspace& ws, ThreadPool* pool) const {
    Index const D = d_model_, R = ws.plan.num_rows(), L = bank_.num_experts();
    Index const rin = ws.local_offsets.back();
    bool const monotone = placement_.monotone();
    float const* send = src.data();
    if (!monotone) {
      ws.send_buf.resize(static_cast<std::size_t>(R * D));
      for (Index i = 0; i < R; ++i) {
        Index const r = ws.send_row[static_cast<std::size_t>(i)];
        std::copy(src.data() + r * D, src.data() + (r + 1) * D, ws.send_buf.data() + i * D);
      }
      send = ws.send_buf.data();
    }
    dst.resize(static_cast<std::size_t>(rin * D));
    bool const direct = expert_major_is_source_major(L);
    if (!direct) ws.recv_buf.resize(static_cast<std::size_t>(rin * D));
    detail::alltoallv_rows(comm_.get(), send, ws.send_counts, ws.send_displs,
                           direct ? dst.data() : ws.recv_buf.data(), ws.recv_counts, ws.recv_displs,
                           row_type_.get(), D * 4, ws.stats);
    if (!direct) reorder(ws.recv_buf.data(), dst.data(), ws, false, pool);
  }

  /// Step 5: in projection with the activation fused, down projection, of every local expert on
  /// all its rows (MoeFfn's jobs; outputs unweighted: the routing weight is applied on return).
  void run_local_experts(ExpertParallelWorkspace& ws, ThreadPool* pool, bool train) const {
    Index const L = bank_.num_experts(), D = d_model_, F = d_ffn_, P = bank_.hidden_cols();
    Index const rin = ws.local_offsets.back();
    ws.hidden.resize(static_cast<std::size_t>(train ? rin * P : 0));
    ws.act.resize(static_cast<std::size_t>(rin * F));
    ws.expert_out.resize(static_cast<std::size_t>(rin * D));
    ws.jobs.clear();
    ws.items.clear();
    bool const use_bf16 = !train;
    bool const pairs = ::moe::detail::uses_bf16_pairs(bank_, use_bf16);
    Index const kpD = (D + 1) / 2, kpF = (F + 1) / 2;
    ws.x_pairs.resize(static_cast<std::size_t>(pairs ? rin * kpD : 0));
    ws.act_pairs.resize(static_cast<std::size_t>(pairs ? rin * kpF : 0));
    ::moe::detail::run_pairs_tasks(pool,
                                   {::moe::detail::PairsTask{ws.x_rows.data(), D, rin, D,
                                                             pairs ? ws.x_pairs.data() : nullptr}});
    for (Index j = 0; j < L; ++j) {
      Index const r0 = ws.local_offsets[j], n = ws.local_offsets[j + 1] - r0;
      Job job;
      job.kind = Job::Kind::kRoutedHidden;
      job.a = {ws.x_rows.data() + r0 * D, D, nullptr,
               pairs ? ws.x_pairs.data() + r0 * kpD : nullptr, kpD};
      job.rows = n;
      job.depth = D;
      job.w = weights_of(bank_.in_proj(j).data, P, bank_.packed_in(j), bank_.packed_in_bf16(j), D,
                         Expert::gated ? F : 0, use_bf16);
      job.c = ws.act.data() + r0 * F;
      job.ldc = F;
      job.cols = F;
      job.h = train ? ws.hidden.data() + r0 * P : nullptr;
      job.ldh = P;
      add_job(ws, job, n);
    }
    run_jobs(ws, pool);
    ::moe::detail::run_pairs_tasks(
        pool, {::moe::detail::PairsTask{ws.act.data(), F, rin, F,
                                        pairs ? ws.act_pairs.data() : nullptr}});
    // A large output goes to memory with non-temporal stores, as in MoeFfn: it is read next by
    // the exchange, not while it would still be cached (::moe::detail::kStreamOutputBytes).
    bool const stream_out =
        rin * D * static_cast<Index>(sizeof(float)) >= ::moe::detail::kStreamOutputBytes;
    for (Index j = 0; j < L; ++j) {
      Index const r0 = ws.local_offsets[j], n = ws.local_offsets[j + 1] - r0;
      Job job;
      job.a = {ws.act.data() + r0 * F, F, nullptr, pairs ? ws.act_pairs.data() + r0 * kpF : nullptr,
               kpF};
      job.rows = n;
      job.depth = F;
      job.w = weights_of(bank_.down_proj(j).data, D, bank_.packed_down(j),
                         bank_.packed_down_bf16(j), F, 0, use_bf16);
      job.c = ws.expert_out.data() + r0 * D;
      job.ldc = D;
      job.cols = D;
      job.stream = stream_out;
      add_job(ws, job, n);
    }
    run_jobs(ws, pool);
  }

  /// Step 7: shared experts on this rank's tokens (kernel path of the global batch), combine.
  /// Inference applies each routed row's weight first (the product MoeFfn's down-projection
  /// epilogue computes), then sums; training combines the unweighted rows with the weights.
  void run_shared_and_combine(ConstMatrixView<float> x, MatrixView<float> y,
                              ExpertParallelWorkspace& ws, ThreadPool* pool, bool train) const {
    Index const T = x.rows, D = d_model_, ns = shared_.count();
    Index Ps = 0, Fs = 0;
    if constexpr (Shared::has_experts) {
      Ps = shared_.bank().hidden_cols();
      Fs = shared_.bank().d_ffn();
    }
    ws.shared_out.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_gate.resize(static_cast<std::size_t>(Shared::gated ? ns * T : 0));
    ws.shared_hidden.resize(static_cast<std::size_t>(train ? ns * T * Ps : 0));
    ws.shared_act.resize(static_cast<std::size_t>(ns * T * Fs));
    Index const token_tiles = (T + kTileRows - 1) / kTileRows;
    bool const use_bf16 = !train;
    if constexpr (Shared::has_experts) {
      using SX = typename Shared::Expert;
      if constexpr (Shared::gated) {
        parallel_for(pool, token_tiles, [&](Index i, int) {
          Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
          for (Index t = t0; t < t1; ++t) {
            for (Index s = 0; s < ns; ++s) {
              float const* g = shared_.gate_weight().row(s);
              float const* xt = x.row(t);
              float z = 0.0f;
              for (Index d = 0; d < D; ++d) z = std::fma(g[d], xt[d], z);
              ws.shared_gate[static_cast<std::size_t>(t * ns + s)] = 1.0f / (1.0f + std::exp(-z));
            }
          }
        });
      }
      ws.jobs.clear();
      ws.items.clear();
      auto const& sb = shared_.bank();
      bool const pairs = ::moe::detail::uses_bf16_pairs(sb, use_bf16);
      Index const kpD = (D + 1) / 2, kpFs = (Fs + 1) / 2;
      ws.shared_x_pairs.resize(static_cast<std::size_t>(pairs ? T * kpD : 0));
      ws.shared_act_pairs.resize(static_cast<std::size_t>(pairs ? ns * T * kpFs : 0));
      ::moe::detail::run_pairs_tasks(
          pool, {::moe::detail::PairsTask{x.data, x.row_stride, T, D,
                                          pairs ? ws.shared_x_pairs.data() : nullptr}});
      for (Index s = 0; s < ns; ++s) {
        Job job;
        job.kind = Job::Kind::kSharedHidden;
        job.a = {x.data, x.row_stride, nullptr, pairs ? ws.shared_x_pairs.data() : nullptr, kpD};
        job.rows = T;
        job.depth = D;
        job.w = weights_of(sb.in_proj(s).data, Ps, sb.packed_in(s), sb.packed_in_bf16(s), D,
                           SX::gated ? Fs : 0, use_bf16);
        job.c = ws.shared_act.data() + s * T * Fs;
        job.ldc = Fs;
        job.cols = Fs;
        job.h = train ? ws.shared_hidden.data() + s * T * Ps : nullptr;
        job.ldh = Ps;
        add_job(ws, job, ws.total_tokens);
      }
      run_jobs(ws, pool);
      ::moe::detail::run_pairs_tasks(
          pool, {::moe::detail::PairsTask{ws.shared_act.data(), Fs, ns * T, Fs,
                                          pairs ? ws.shared_act_pairs.data() : nullptr}});
      for (Index s = 0; s < ns; ++s) {
        Job job;
        job.a = {ws.shared_act.data() + s * T * Fs, Fs, nullptr,
                 pairs ? ws.shared_act_pairs.data() + s * T * kpFs : nullptr, kpFs};
        job.rows = T;
        job.depth = Fs;
        job.w = weights_of(sb.down_proj(s).data, D, sb.packed_down(s), sb.packed_down_bf16(s), Fs,
                           0, use_bf16);
        job.c = ws.shared_out.data() + s * T * D;
        job.ldc = D;
        job.cols = D;
        add_job(ws, job, ws.total_tokens);
      }
      run_jobs(ws, pool);
    }
    RoutingPlan const& plan = ws.plan;
    if (!train) {
      Index const R = plan.num_rows();
      parallel_for(pool, (R + kTileRows - 1) / kTileRows, [&](Index i, int) {
        for (Index r = i * kTileRows; r < std::min(R, (i + 1) * kTileRows); ++r) {
          float const w = plan.row_weight[static_cast<std::size_t>(r)];
          float* row = ws.routed_out.data() + r * D;
          for (Index c = 0; c < D; ++c) row[c] = row[c] * w;
        }
      });
    }
    parallel_for(pool, token_tiles, [&](Index i, int) {
      kernels::CombineParams p;
      p.expert_out = ws.routed_out.data();
      p.ld_expert_out = D;
      p.row_weight = train ? plan.row_weight.data() : nullptr;
      p.token_offsets = plan.token_offsets.data();
      p.token_rows = plan.token_rows.data();
      p.shared_out = ns > 0 ? ws.shared_out.data() : nullptr;
      p.ld_shared = D;
      p.shared_plane = T * D;
      p.num_shared = ns;
      p.shared_gate = Shared::gated && ns > 0 ? ws.shared_gate.data() : nullptr;
      p.token_begin = i * kTileRows;
      p.token_end = std::min(T, p.token_begin + kTileRows);
      p.cols = D;
      p.out = y.data;
      p.ld_out = y.row_stride;
      kernels::combine_rows(p);
    });
  }

  /// Step 8 (training): global per-expert rows, rows of real tokens, and real tokens
  /// (MPI_Allreduce of int64: exact, order-independent); the global row offset of each local
  /// expert.
  void global_counts(ExpertParallelWorkspace& ws) const {
    Index const E = num_experts();
    RoutingPlan const& plan = ws.plan;
    ws.global_counts.assign(static_cast<std::size_t>(2 * E + 1), 0);
    for (Index e = 0; e < E; ++e) {
      ws.global_counts[static_cast<std::size_t>(e)] = plan.expert_rows(e);
      std::int64_t real = 0;
      for (Index r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r) {
        real += ws.token_mask.empty() || ws.token_mask[static_cast<std::size_t>(plan.row_token[r])];
      }
      ws.global_counts[static_cast<std::size_t>(E + e)] = real;
    }
    std::int64_t real_tokens = 0;
    for (Index t = 0; t < ws.selection.num_tokens; ++t) {
      real_tokens += ws.token_mask.empty() || ws.token_mask[static_cast<std::size_t>(t)];
    }
    ws.global_counts[static_cast<std::size_t>(2 * E)] = real_tokens;
    int const n = detail::mpi_count(2 * E + 1, "counts");
    double const t0 = MPI_Wtime();
    detail::mpi_check(
        MPI_Allreduce(MPI_IN_PLACE, ws.global_counts.data(), n, MPI_INT64_T, MPI_SUM, comm_.get()),
        "MPI_Allreduce (global expert counts)");
    ws.stats.mpi_seconds += MPI_Wtime() - t0;
    ws.stats.collectives += 1;
    std::int64_t const nominal = 2 * std::int64_t{8} * n * (comm_.size() - 1) / comm_.size();
    ws.stats.bytes_sent += nominal;
    ws.stats.bytes_received += nominal;
    auto const ids = local_expert_ids();
    for (std::size_t j = 0; j < ids.size(); ++j) {
      ::moe::detail::check(ws.global_counts[static_cast<std::size_t>(ids[j])] ==
                               ws.local_offsets[j + 1] - ws.local_offsets[j],
                           "ExpertParallelMoeFfn: internal error, the counts of expert ", ids[j],
                           " disagree between the all-to-all and the all-reduce");
    }
  }

  /// Lets the balance policy observe the global batch through a count-only BalanceInputs.
  void observe_global(ExpertParallelWorkspace const& ws) {
    Index const E = num_experts();
    Selection sel;
    sel.num_tokens = ws.global_counts[static_cast<std::size_t>(2 * E)];
    sel.slots = router_.slots_per_token();
    sel.num_experts = E;
    RoutingPlan plan;
    plan.num_tokens = sel.num_tokens;
    plan.num_experts = E;
    plan.expert_offsets.assign(static_cast<std::size_t>(E + 1), 0);
    for (Index e = 0; e < E; ++e) {
      plan.expert_offsets[e + 1] =
          plan.expert_offsets[e] + ws.global_counts[static_cast<std::size_t>(E + e)];
    }
    plan.row_token.assign(static_cast<std::size_t>(plan.expert_offsets.back()), 0);
    balance_.observe(BalanceInputs{ConstMatrixView<float>(nullptr, 0, E), sel, plan, {}, {}});
  }

  /// The tiles of `kTileRows` global tokens that overlap this rank's tokens: calls
  /// fn(global_begin, global_end, local_begin, local_end) for each, where [local_begin,
  /// local_end) are this rank's rows of the tile (local indices) and the tile has
  /// global_end - global_begin rows in MoeFfn.
  template <class Fn>
  static void for_each_global_tile(ExpertParallelWorkspace const& ws, Index T, Fn&& fn) {
    Index const O = ws.token_offset, total = ws.total_tokens;
    if (T == 0) return;
    for (Index g0 = O / kTileRows * kTileRows; g0 < O + T; g0 += kTileRows) {
      Index const g1 = std::min(total, g0 + kTileRows);
      fn(g0, g1, std::max(g0, O) - O, std::min(g1, O + T) - O);
    }
  }

  void backward_impl(ExpertParallelWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                     Gradients& grads, ThreadPool* pool) const {
    Index const T = ws.selection.num_tokens, D = d_model_, E = num_experts(), F = d_ffn_;
    Index const P = bank_.hidden_cols(), S = ws.selection.slots, L = bank_.num_experts();
    RoutingPlan const& plan = ws.plan;
    Index const R = plan.num_rows(), ns = shared_.count();
    Index const rin = ws.local_offsets.back();
    Index Ps = 0, Fs = 0;
    if constexpr (Shared::has_experts) {
      Ps = shared_.bank().hidden_cols();
      Fs = shared_.bank().d_ffn();
    }
    ConstMatrixView<float> x(ws.x.data(), T, D);
    Index const token_tiles = (T + kTileRows - 1) / kTileRows;
    ws.d_rows.resize(static_cast<std::size_t>(R * D));
    ws.shared_dy.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_dx.resize(static_cast<std::size_t>(ns * T * D));
    ws.shared_dhidden.resize(static_cast<std::size_t>(ns * T * Ps));
    ws.dweight.assign(static_cast<std::size_t>(T * S), 0.0f);
    ws.dscores.assign(static_cast<std::size_t>(T * E), 0.0f);
    ws.dlogits.assign(static_cast<std::size_t>(T * E), 0.0f);
    ws.dlogits_extra.assign(static_cast<std::size_t>(T * E), 0.0f);
    ws.dgate.assign(static_cast<std::size_t>(ns * T), 0.0f);
    // backward_rows scratch per thread; it also holds the weight gradients' gemm_strided scratch.
    Index scratch_per = bank_.backward_scratch_floats(::moe::detail::kBackwardRows);
    if constexpr (Shared::has_experts) {
      scratch_per = std::max(scratch_per, shared_.bank().backward_scratch_floats(kTileRows));
    }
    ws.bwd_scratch.resize(static_cast<std::size_t>(threads_of(pool) * scratch_per));

    // 1. Combine VJP (token side): dY_r = w_r dy[t]; dL/dw of each slot; shared experts.
    parallel_for(pool, token_tiles, [&](Index i, int) {
      Index const t0 = i * kTileRows, t1 = std::min(T, t0 + kTileRows);
      for (Index t = t0; t < t1; ++t) {
        float const* g = dy.row(t);
        Index j = plan.token_offsets[t];
        for (Index s = 0; s < S; ++s) {
          if (ws.selection.expert[static_cast<std::size_t>(t * S + s)] < 0) continue;
          Index const r = plan.token_rows[j++];
          ws.dweight[static_cast<std::size_t>(t * S + s)] = kernels::scale_dot(
              g, ws.routed_out.data() + r * D, plan.row_weight[r], ws.d_rows.data() + r * D, D);
        }
        for (Index s = 0; s < ns; ++s) {
          float const gate =
              Shared::gated ? ws.shared_gate[static_cast<std::size_t>(t * ns + s)] : 1.0f;
          float const dot = kernels::scale_dot(g, ws.shared_out.data() + (s * T + t) * D, gate,
                                               ws.shared_dy.data() + (s * T + t) * D, D);
          if (Shared::gated)
            ws.dgate[static_cast<std::size_t>(t * ns + s)] = dot * gate * (1.0f - gate);
        }
      }
    });
    // 2. Balance gradients on this rank's tokens.
    BalanceGradients bg{MatrixView<float>(ws.dscores.data(), T, E),
                        MatrixView<float>(ws.dlogits_extra.data(), T, E),
                        MatrixView<float>(ws.d_rows.data(), R, D)};
    balance_.backward(balance_inputs(ws), bg);
    // 3. dL/dY rows to the experts' owners (the forward's counts).
    send_rows_to_owners(ws.d_rows, ws.e_drows, ws, pool);
    // 4. Expert VJPs on the owner, row phase, on MoeFfn's items: each expert's rows (all of
    //    them are here) in chunks of up to kBackwardRows.
    ws.e_dxrows.resize(static_cast<std::size_t>(rin * D));
    ws.e_dhidden.resize(static_cast<std::size_t>(rin * P));
    ws.act.resize(static_cast<std::size_t>(rin * F));
    std::vector<::moe::detail::RowChunk> chunks;
    for (Index j = 0; j < L; ++j) {
      Index const base = ws.local_offsets[j];
      ::moe::detail::add_row_chunks(chunks, j, base, ws.local_offsets[j + 1] - base);
    }
    parallel_for(pool, static_cast<Index>(chunks.size()), [&](Index i, int thread) {
      ::moe::detail::backward_chunk(bank_, chunks[static_cast<std::size_t>(i)], ws.hidden.data(),
                                    ws.e_drows.data(), ws.act.data(), ws.e_dhidden.data(),
                                    ws.e_dxrows.data(),
                                    ws.bwd_scratch.data() + thread * scratch_per);
    });
    // Expert weight gradients: one item per (expert, 64-row block of the gradient), all rows.
    struct GradItem {
      int kind;  // 0 expert in, 1 expert down, 2 shared in, 3 shared down, 4 router, 5 gate
      Index e, r0, r1;
    };
    std::vector<GradItem> gitems;
    for (Index j = 0; j < L; ++j) {
      if (ws.local_offsets[j + 1] == ws.local_offsets[j]) continue;
      for (Index r = 0; r < P; r += kGradRows)
        gitems.push_back({0, j, r, std::min(P, r + kGradRows)});
      for (Index r = 0; r < D; r += kGradRows)
        gitems.push_back({1, j, r, std::min(D, r + kGradRows)});
    }
    // 5. dL/dX rows back to the tokens' ranks.
    return_rows(ws.e_dxrows.data(), ws.dx_rows, ws, pool);
    // 6. Router VJP (token side).
    MatrixView<float> dlogits(ws.dlogits.data(), T, E);
    router_.backward(ws.logits_view(), ws.selection, ws.dweight.data(),
                     MatrixView<float>(ws.dscores.data(), T, E), dlogits);
    for (Index i = 0; i < T * E; ++i) {
      ws.dlogits[static_cast<std::size_t>(i)] += ws.dlogits_extra[static_cast<std::size_t>(i)];
    }
    // 7. Shared experts' row phase on 64-token tiles of the global batch.
    if constexpr (Shared::has_experts) shared_backward_rows(ws, pool, scratch_per);
    // 8. Weight gradients: routed experts into grads (they stay here), replicated parameters
    //    into this rank's partial sums.
    Index const n_router = E * D;
    Index n_shared = 0, n_gate = 0;
    if constexpr (Shared::has_experts) {
      n_shared = static_cast<Index>(shared_.bank().parameters().size());
      n_gate = shared_.gate_weight().rows * shared_.gate_weight().cols;
    }
    ws.partial.assign(static_cast<std::size_t>(n_router + n_shared + n_gate), 0.0f);
    // This rank's partial sums, laid out like [router.weight | shared bank parameters() (every
    // in_proj block, then every down_proj block) | gate].
    float* const partial_router = ws.partial.data();
    float* const partial_shared = partial_router + n_router;
    auto partial_in = [&](Index s) {
      return MatrixView<float>(partial_shared + s * Ps * D, Ps, D);
    };
    auto partial_down = [&](Index s) {
      return MatrixView<float>(partial_shared + ns * Ps * D + s * D * Fs, D, Fs);
    };
    MatrixView<float> const partial_gate(partial_shared + n_shared, Shared::gated ? ns : 0, D);
    for (Index s = 0; s < ns && T > 0; ++s) {
      for (Index r = 0; r < Ps; r += kGradRows)
        gitems.push_back({2, s, r, std::min(Ps, r + kGradRows)});
      for (Index r = 0; r < D; r += kGradRows)
        gitems.push_back({3, s, r, std::min(D, r + kGradRows)});
    }
    for (Index r = 0; r < E; r += kTileRows)
      gitems.push_back({4, 0, r, std::min(E, r + kTileRows)});
    if (Shared::gated && ns > 0) gitems.push_back({5, 0, 0, ns});
    parallel_for(pool, static_cast<Index>(gitems.size()), [&](Index i, int thread) {
      GradItem const& it = gitems[static_cast<std::size_t>(i)];
      float* const scratch = ws.bwd_scratch.data() + thread * scratch_per;
      if (it.kind == 0 || it.kind == 1) {
        Index const r0 = ws.local_offsets[it.e], n = ws.local_offsets[it.e + 1] - r0;
        if (it.kind == 0) {
          Bank::accumulate_in_grad(ConstMatrixView<float>(ws.x_rows.data() + r0 * D, n, D),
                                   ConstMatrixView<float>(ws.e_dhidden.data() + r0 * P, n, P),
                                   it.r0, it.r1, grads.experts.in_proj(it.e), scratch);
        } else {
          Bank::accumulate_down_grad(ConstMatrixView<float>(ws.act.data() + r0 * F, n, F),
                                     ConstMatrixView<float>(ws.e_drows.data() + r0 * D, n, D),
                                     it.r0, it.r1, grads.experts.down_proj(it.e), scratch);
        }
      } else if (it.kind == 4) {
        if (T == 0) return;
        // partial_router[r0:r1] += dlogits[:, r0:r1]^T x (MoeFfn's kernel and order)
        kernels::gemm_strided(it.r1 - it.r0, D, T, ws.dlogits.data() + it.r0, 1, E, x.data,
                              x.row_stride, partial_router + it.r0 * D, D, true, scratch);
      } else if constexpr (Shared::has_experts) {
        using SBank = std::remove_cvref_t<decltype(shared_.bank())>;
        Index const off = it.e * T;
        if (it.kind == 2) {
          SBank::accumulate_in_grad(
              x, ConstMatrixView<float>(ws.shared_dhidden.data() + off * Ps, T, Ps), it.r0, it.r1,
              partial_in(it.e), scratch);
        } else if (it.kind == 3) {
          SBank::accumulate_down_grad(
              ConstMatrixView<float>(ws.shared_act.data() + off * Fs, T, Fs),
              ConstMatrixView<float>(ws.shared_dy.data() + off * D, T, D), it.r0, it.r1,
              partial_down(it.e), scratch);
        } else if constexpr (Shared::gated) {
          if (T == 0) return;
          kernels::gemm_strided(ns, D, T, ws.dgate.data(), 1, ns, x.data, x.row_stride,
                                partial_gate.data, partial_gate.row_stride, true, scratch);
        }
      }
    });
    (void)partial_in;
    (void)partial_down;
    (void)partial_gate;
    // 9. dx = combine(dX rows, shared dx) + dlogits W_r + dgate W_g, on MoeFfn's token tiles.
    input_gradient(ws, dx, pool);
    // 10. Sum the replicated parameters' gradients over ranks; accumulate into grads.
    detail::sum_over_ranks(comm_.get(), ws.partial, reduction_, ws.reduce_scratch, ws.stats);
    for (Index i = 0; i < n_router; ++i) {
      grads.router_weight[static_cast<std::size_t>(i)] += ws.partial[static_cast<std::size_t>(i)];
    }
    if constexpr (Shared::has_experts) {
      auto gp = grads.shared.bank().parameters();
      for (Index i = 0; i < n_shared; ++i) {
        gp[static_cast<std::size_t>(i)] += ws.partial[static_cast<std::size_t>(n_router + i)];
      }
      auto gg = grads.shared.gate_weight();
      for (Index i = 0; i < n_gate; ++i) {
        gg.data[i] += ws.partial[static_cast<std::size_t>(n_router + n_shared + i)];
      }
    }
  }

  /// Shared experts' backward row phase: MoeFfn's items are (shared expert, 64-token tile of the
  /// global batch); tiles that straddle a rank boundary run on a zero-padded copy so that Eigen
  /// sees the same row count and row positions.
  void shared_backward_rows(ExpertParallelWorkspace& ws, ThreadPool* pool, Index scratch_per) const
      requires(Shared::has_experts) {
    Index const T = ws.selection.num_tokens, D = d_model_, ns = shared_.count();
    Index const Ps = shared_.bank().hidden_cols(), Fs = shared_.bank().d_ffn();
    struct Tile {
      Index g0, g1, a, b;
    };
    std::vector<Tile> tiles;
    for_each_global_tile(ws, T, [&](Index g0, Index g1, Index a, Index b) {
      tiles.push_back({g0, g1, a, b});
    });
    Index const nt = static_cast<Index>(tiles.size());
    auto full = [&](Tile const& t) { return t.b - t.a == t.g1 - t.g0; };
    parallel_for(pool, ns * nt, [&](Index i, int thread) {
      Index const s = i / nt;
      Tile const& tl = tiles[static_cast<std::size_t>(i % nt)];
      if (!full(tl)) return;
      Index const off = s * T + tl.a, n = tl.b - tl.a;
      shared_.bank().backward_rows(
          s, ConstMatrixView<float>(ws.shared_hidden.data() + off * Ps, n, Ps),
          ConstMatrixView<float>(ws.shared_dy.data() + off * D, n, D),
          MatrixView<float>(ws.shared_act.data() + off * Fs, n, Fs),
          MatrixView<float>(ws.shared_dhidden.data() + off * Ps, n, Ps),
          MatrixView<float>(ws.shared_dx.data() + off * D, n, D),
          ws.bwd_scratch.data() + thread * scratch_per);
    });
    for (Index s = 0; s < ns; ++s) {
      for (Tile const& tl : tiles) {
        if (full(tl)) continue;
        Index const n = tl.g1 - tl.g0, lead = tl.a + ws.token_offset - tl.g0, m = tl.b - tl.a;
        // pad = [h n*Ps | dy n*D | act n*Fs | dh n*Ps | dx n*D]
        ws.pad.assign(static_cast<std::size_t>(n * (2 * Ps + 2 * D + Fs)), 0.0f);
        float* h = ws.pad.data();
        float* g = h + n * Ps;
        float* a = g + n * D;
        float* dh = a + n * Fs;
        float* ddx = dh + n * Ps;
        Index const off = s * T + tl.a;
        std::copy(ws.shared_hidden.data() + off * Ps, ws.shared_hidden.data() + (off + m) * Ps,
                  h + lead * Ps);
        std::copy(ws.shared_dy.data() + off * D, ws.shared_dy.data() + (off + m) * D, g + lead * D);
        shared_.bank().backward_rows(s, ConstMatrixView<float>(h, n, Ps),
                                     ConstMatrixView<float>(g, n, D), MatrixView<float>(a, n, Fs),
                                     MatrixView<float>(dh, n, Ps), MatrixView<float>(ddx, n, D),
                                     ws.bwd_scratch.data());
        std::copy(a + lead * Fs, a + (lead + m) * Fs, ws.shared_act.data() + off * Fs);
        std::copy(dh + lead * Ps, dh + (lead + m) * Ps, ws.shared_dhidden.data() + off * Ps);
        std::copy(ddx + lead * D, ddx + (lead + m) * D, ws.shared_dx.data() + off * D);
      }
    }
  }

  /// dx for this rank's tokens, tile by tile of the global batch (padded at rank boundaries).
  void input_gradient(ExpertParallelWorkspace& ws, MatrixView<float> dx, ThreadPool* pool) const {
    Index const T = ws.selection.num_tokens, D = d_model_, E = num_experts(), ns = shared_.count();
    RoutingPlan const& plan = ws.plan;
    auto combine = [&](Index t0, Index t1) {
      kernels::CombineParams p;
      p.expert_out = ws.dx_rows.data();
      p.ld_expert_out = D;
      p.row_weight = nullptr;
      p.token_offsets = plan.token_offsets.data();
      p.token_rows = plan.token_rows.data();
      p.shared_out = ns > 0 ? ws.shared_dx.data() : nullptr;
      p.ld_shared = D;
      p.shared_plane = T * D;
      p.num_shared = ns;
      p.shared_gate = nullptr;
      p.token_begin = t0;
      p.token_end = t1;
      p.cols = D;
      p.out = dx.data;
      p.ld_out = dx.row_stride;
      kernels::combine_rows(p);
    };
    // rows [0, n) of the tile: dxt += dlogits W_r (+ dgate W_g), exactly MoeFfn's expressions.
    auto project = [&](MatrixView<float> dxt, float const* dl, float const* dg, Index n) {
      (void)dg;
      kernels::gemm_strided(n, D, E, dl, E, 1, router_weight_.data(), D, dxt.data, dxt.row_stride,
                            true);
      if constexpr (Shared::gated) {
        if (ns > 0) {
          auto const g = std::as_const(shared_).gate_weight();
          kernels::gemm_strided(n, D, ns, dg, ns, 1, g.data, g.row_stride, dxt.data, dxt.row_stride,
                                true);
        }
      }
    };
    struct Tile {
      Index g0, g1, a, b;
    };
    std::vector<Tile> tiles;
    for_each_global_tile(ws, T, [&](Index g0, Index g1, Index a, Index b) {
      tiles.push_back({g0, g1, a, b});
    });
    parallel_for(pool, static_cast<Index>(tiles.size()), [&](Index i, int) {
      Tile const& tl = tiles[static_cast<std::size_t>(i)];
      combine(tl.a, tl.b);
      if (tl.b - tl.a != tl.g1 - tl.g0) return;
      Index const n = tl.b - tl.a;
      project(dx.middle_rows(tl.a, n), ws.dlogits.data() + tl.a * E,
              ns > 0 && Shared::gated ? ws.dgate.data() + tl.a * ns : nullptr, n);
    });
    for (Tile const& tl : tiles) {
      if (tl.b - tl.a == tl.g1 - tl.g0) continue;
      Index const n = tl.g1 - tl.g0, lead = tl.a + ws.token_offset - tl.g0, m = tl.b - tl.a;
      Index const gcols = Shared::gated ? ns : 0;
      ws.pad.assign(static_cast<std::size_t>(n * (D + E + gcols)), 0.0f);
      float* pdx = ws.pad.data();
      float* pdl = pdx + n * D;
      float* pdg = pdl + n * E;
      for (Index t = 0; t < m; ++t) {
        std::copy(dx.row(tl.a + t), dx.row(tl.a + t) + D, pdx + (lead + t) * D);
      }
      std::copy(ws.dlogits.data() + tl.a * E, ws.dlogits.data() + tl.b * E, pdl + lead * E);
      if (gcols > 0) {
        std::copy(ws.dgate.data() + tl.a * ns, ws.dgate.data() + tl.b * ns, pdg + lead * ns);
      }
      project(MatrixView<float>(pdx, n, D), pdl, pdg, n);
      for (Index t = 0; t < m; ++t) {
        std::copy(pdx + (lead + t) * D, pdx + (lead + t + 1) * D, dx.row(tl.a + t));
      }
    }
  }

  Communicator comm_;
  RowType row_type_;
  Router router_{};
  Bank bank_;
  Shared shared_{};
  Balance balance_{};
  ExpertPlacement placement_;
  GradientReduction reduction_ = GradientReduction::kRankOrdered;
  Index d_model_ = 0;
  Index d_ffn_ = 0;
  std::vector<float> router_weight_;
  std::uint64_t config_hash_ = 0;
  std::string config_text_;
  std::int64_t seq_ = 0;
};

/// The expert-parallel layer with the policies of a MoeFfn type, e.g.
/// `dist::ExpertParallelOf<presets::Qwen3Moe>`.
template <class Layer>
using ExpertParallelOf = ExpertParallelMoeFfn<typename Layer::Router, typename Layer::Expert,
                                              typename Layer::Shared, typename Layer::Balance>;

}  // namespace moe::dist
