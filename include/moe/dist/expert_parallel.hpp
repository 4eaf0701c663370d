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
#include "moe/core/error.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/routing_plan.hpp"
#include "moe/core/selection.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/dist/communicator.hpp"
#include "moe/dist/placement.hpp"
#include "moe/dist/row_exchange.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/layers/detail/expert_jobs.hpp"
#include "moe/layers/detail/ffn_base.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/layers/stages/combine.hpp"
#include "moe/layers/stages/routed_experts.hpp"
#include "moe/layers/stages/router.hpp"
#include "moe/layers/stages/shared_experts.hpp"
#include "moe/layers/stages/work.hpp"
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
/// allocation once it has seen the largest batch, apart from MPI's own buffers). One per
/// concurrent caller; a training forward keeps here what backward needs. "Token side" buffers
/// hold this rank's tokens; "expert side" buffers hold the rows this rank's experts received
/// from every rank. The stages are MoeFfn's (moe/layers/stages/): only the exchanges are this
/// layer's own.
struct ExpertParallelWorkspace {
  // Token side, this rank's T tokens: the results of routing.
  std::vector<float> logits;      ///< [T, E] router logits (after routing controls)
  Selection selection;            ///< the router's choices for this rank's tokens
  RoutingPlan plan;               ///< this rank's rows, sorted by expert
  double aux_loss = 0.0;          ///< the balance policy's loss on this rank's tokens
  std::vector<float> routed_out;  ///< [R, D] expert outputs, returned, in plan row order
  stages::SharedStage shared;     ///< the replicated shared experts on this rank's tokens
  std::vector<std::uint32_t> shared_x_pairs;  ///< [T, ceil(D / 2)] bf16 pairs of x (inference)
  std::vector<std::byte> shared_x_q8;         ///< [T] int8 rows of x (quantized shared experts)

  // Where this rank's tokens sit in the global batch (rank order): filled by every forward.
  Index token_offset = 0;              ///< global index of this rank's first token
  Index total_tokens = 0;              ///< tokens over all ranks
  std::vector<Index> tokens_per_rank;  ///< [P]

  RowExchange exchange;                     ///< the row exchanges' bookkeeping and staging
  std::vector<std::int64_t> global_counts;  ///< [2E+1] all rows, real rows, real tokens
  ExchangeStats stats;                      ///< traffic of the last call
  std::vector<CallRecord> agreement;        ///< [P] the last agreement table

  // Expert side: rows of this rank's experts, expert-major (expert j's rows, from rank 0, 1, ...).
  /// x_rows [R_in, D] as received, pre-activations, activations, outputs (64-byte aligned: a
  /// large one is written with streaming stores), bf16 pairs; backward rows.
  stages::RoutedExperts experts;
  std::vector<std::uint32_t> x_pairs;  ///< [R_in, ceil(D / 2)] bf16 pairs of x_rows (inference)
  std::vector<std::byte> x_q8;         ///< [R_in] int8 rows of x_rows (quantized experts)
  stages::ProjectionQueue queue;       ///< projections of the current phase, per-thread scratch

  // Training (filled by forward_train, read by backward).
  std::vector<float> x;                  ///< [T, D] copy of the input
  std::vector<std::uint8_t> token_mask;  ///< [T] or empty
  stages::Stamp stamp;                   ///< the layer and shapes that filled it (or none)
  std::vector<float> d_rows;             ///< [R, D] dL/d(expert outputs), plan order
  std::vector<float> dx_rows;            ///< [R, D] returned dL/d(expert inputs), plan order
  stages::RouterGrads router_grads;      ///< dL/d(slot weights), d(scores), d(logits)
  stages::GradTasks grad_tasks;          ///< the weight-gradient items of a backward
  stages::ThreadScratch scratch;         ///< per-thread backward scratch
  std::vector<float> partial;            ///< this rank's gradients of the replicated parameters
  std::vector<float> reduce_scratch;

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
///  - backward dx and every routed-expert gradient: bitwise. Both layers run the same stages
///    (moe/layers/stages/); the backward's products (kernels::gemm_strided) give each element
///    one FMA chain over k that depends on its row and column only, not on the row count or the
///    row's position in the call, so the owner may run an expert's rows in one call and the
///    token side its own tokens in local tiles (golden digests at 1, 2 and 4 ranks keep this).
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
class ExpertParallelMoeFfn
    : public ::moe::detail::FfnLayerBase<Router_, Expert_, Shared_, Balance_> {
  using Base = ::moe::detail::FfnLayerBase<Router_, Expert_, Shared_, Balance_>;

 public:
  using typename Base::Balance, typename Base::Bank, typename Base::Expert, typename Base::Router,
      typename Base::Shared;
  /// Gradients laid out like parameters(): the router and shared experts (replicated, identical
  /// on every rank after backward) and this rank's routed experts only.
  using Gradients = typename Base::Gradients;
  /// The single-process layer with the same policies.
  using Layer = MoeFfn<Router, Expert, Shared, Balance>;
  /// Rows per token-side work item (row-independent work: any value gives the same bits).
  static constexpr Index kTileRows = stages::kTokenTile;

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
      if (options.placement.empty()) {
        options.placement = ExpertPlacement::contiguous(E, comm_.size());
      }
      ::moe::detail::check(
          options.placement.num_experts() == E && options.placement.num_ranks() == comm_.size(),
          "ExpertParallelMoeFfn: the placement is for ", options.placement.num_experts(),
          " experts over ", options.placement.num_ranks(), " ranks, but the router has ", E,
          " experts and the communicator ", comm_.size(),
          " ranks; build it with ExpertPlacement::contiguous(E, P) or similar");
      Index const local = options.placement.num_local(comm_.rank());
      this->init(d_model, d_ffn, local, std::move(router), std::move(shared), std::move(balance),
                 "ExpertParallelMoeFfn");
      placement_ = std::move(options.placement);
      reduction_ = options.reduction;
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
    ep.router_bias_.assign(layer.router_bias().begin(), layer.router_bias().end());
    auto const ids = ep.local_expert_ids();
    if (layer.experts().has_biases()) ep.bank_.enable_biases();
    ep.bank_.set_glu_clamp(layer.experts().glu_clamp());
    {
      auto const edit = ep.bank_.edit();
      for (std::size_t j = 0; j < ids.size(); ++j) {
        auto const src_in = layer.experts().in_proj(ids[j]);
        auto const src_down = layer.experts().down_proj(ids[j]);
        auto dst_in = edit.in_proj(static_cast<Index>(j));
        auto dst_down = edit.down_proj(static_cast<Index>(j));
        std::copy(src_in.data, src_in.data + src_in.rows * src_in.cols, dst_in.data);
        std::copy(src_down.data, src_down.data + src_down.rows * src_down.cols, dst_down.data);
        auto const bi = layer.experts().in_bias(ids[j]), bd = layer.experts().down_bias(ids[j]);
        std::copy(bi.begin(), bi.end(), edit.in_bias(static_cast<Index>(j)).begin());
        std::copy(bd.begin(), bd.end(), edit.down_bias(static_cast<Index>(j)).begin());
      }
    }
    if (layer.experts().packed()) {
      auto const all = layer.experts().packed_formats();
      std::vector<experts::ExpertFormat> local;
      for (auto const id : ids) local.push_back(all[static_cast<std::size_t>(id)]);
      ep.bank_.pack(local);
    }
    if (layer.train_compute() != experts::TrainCompute::kF32) {
      ep.set_train_compute(layer.train_compute());
    }
    return ep;
  }

  ExpertParallelMoeFfn(ExpertParallelMoeFfn&&) noexcept = default;
  ExpertParallelMoeFfn& operator=(ExpertParallelMoeFfn&&) noexcept = default;

  using Base::num_experts, Base::router_weight;
  int rank() const { return comm_.rank(); }
  int num_ranks() const { return comm_.size(); }
  /// The layer's own duplicate of the communicator it was built on.
  MPI_Comm communicator() const { return comm_.get(); }
  ExpertPlacement const& placement() const { return placement_; }
  GradientReduction reduction() const { return reduction_; }
  /// Global ids of this rank's experts, ascending: local expert j is expert local_expert_ids()[j].
  std::span<Index const> local_expert_ids() const { return placement_.experts_of(comm_.rank()); }

  /// This rank's routed experts (L = local_expert_ids().size() of them, possibly 0). The
  /// router weight [E, D] and the shared experts are replicated: keep them equal on every rank.
  /// parameters() are MoeFfn::parameters(), except that "experts" holds this rank's experts.
  Bank& local_experts() { return bank_; }
  Bank const& local_experts() const { return bank_; }

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
      ::moe::detail::check(ws.stamp.filled(),
                           "ExpertParallelMoeFfn::backward: the workspace holds no training "
                           "forward; call forward_train first (and backward once per forward)");
      Index const T = ws.stamp.tokens, D = d_model_;
      ::moe::detail::check(ws.stamp == stamp(T),
                           "ExpertParallelMoeFfn::backward: the workspace was filled by another "
                           "layer's forward_train; pass the workspace of this layer's");
      ::moe::detail::check(dy.rows == T && dy.cols == D && dx.rows == T && dx.cols == D,
                           "ExpertParallelMoeFfn::backward: dy and dx must be [", T, ", ", D,
                           "] like the forward's x");
      ::moe::detail::check_ffn_gradients(grads, router_weight_.size(), router_bias_.size(), bank_,
                                         shared_, "ExpertParallelMoeFfn");
    } catch (std::exception const& e) {
      rec.failed = 1;
      detail::copy_text(rec.message, e.what());
    }
    ws.stats.clear();
    detail::agree(comm_.get(), rec, "ExpertParallelMoeFfn::backward", false, &ws.stats,
                  ws.agreement);
    ws.stamp = {};
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

  /// Checks (collective) that the replicated parameters — router weight (and projection bias),
  /// router selection bias if the router has one, shared experts and their gate — are bitwise
  /// equal on every rank, by
  /// comparing 64-bit hashes. Throws moe::Error on every rank otherwise.
  void verify_replicas() {
    CallRecord rec = record(CallKind::kVerifyReplicas);
    std::uint64_t const hr =
        detail::fnv1a(router_bias_.data(), router_bias_.size() * 4,
                      detail::fnv1a(router_weight_.data(), router_weight_.size() * 4));
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
    {  // the projection bias: root's (present or not) everywhere
      std::int64_t n = static_cast<std::int64_t>(router_bias_.size());
      detail::mpi_check(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm_.get()), "MPI_Bcast");
      router_bias_.resize(static_cast<std::size_t>(n));
      bcast(router_bias_.data(), router_bias_.size());
    }
    if constexpr (requires(Router & r) { r.bias.data(); }) {
      std::int64_t n = static_cast<std::int64_t>(router_.bias.size());
      detail::mpi_check(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm_.get()), "MPI_Bcast");
      router_.bias.resize(static_cast<std::size_t>(n));
      bcast(router_.bias.data(), router_.bias.size());
    }
    if constexpr (Shared::has_experts) {
      auto const p = shared_.bank().edit();
      bcast(p.parameters().data(), p.parameters().size());
      auto g = shared_.gate_weight();
      bcast(g.data, static_cast<std::size_t>(g.rows * g.cols));
    }
  }

 private:
  using Base::balance_, Base::bank_, Base::d_model_, Base::router_, Base::router_bias_,
      Base::router_weight_, Base::shared_;
  using SharedX = typename ::moe::detail::SharedExpertOr<Shared, Expert>::type;

  stages::Stamp stamp(Index tokens) const {
    return {this, tokens, d_model_, num_experts(), bank_.d_ffn()};
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
        " F=" + std::to_string(bank_.d_ffn()) +
        " slots=" + std::to_string(router_.slots_per_token()) +
        " expert=" + experts::expert_kind_name<Expert>() +
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

  void check_input(ConstMatrixView<float> x) const {
    Base::check_input(x, "ExpertParallelMoeFfn");
    ::moe::detail::check(comm_.valid() && !router_weight_.empty(),
                         "ExpertParallelMoeFfn: the layer was default-constructed or moved from; "
                         "construct it with a communicator and sizes first");
  }
  void check_output(ConstMatrixView<float> x, MatrixView<float> y) const {
    Base::check_output(x, y, "ExpertParallelMoeFfn");
  }

  BalanceInputs balance_inputs(ExpertParallelWorkspace const& ws) const {
    return BalanceInputs{ws.logits_view(), ws.selection, ws.plan,
                         ConstMatrixView<float>(ws.routed_out.data(), ws.plan.num_rows(), d_model_),
                         ws.token_mask};
  }

  /// Routing of this rank's tokens, as MoeFfn::route (the router's dot products give each token
  /// the logits MoeFfn gives it, whatever the batch).
  void route(ConstMatrixView<float> x, ExpertParallelWorkspace& ws,
             ForwardOptions const& opt) const {
    this->check_policies();
    moe::detail::check(!routing::detail::scales_input(router_),
                       "ExpertParallelMoeFfn: the router scales the experts' inputs (scale_input, "
                       "Llama 4), which expert parallelism does not support yet; use MoeFfn or a "
                       "router that weighs the outputs");
    Index const T = x.rows, E = num_experts();
    stages::router_logits<Expert, SharedX>(x, router_weight_.data(), E, ws.logits, ws.queue,
                                           opt.pool);
    stages::add_router_bias(ws.logits, router_bias_);
    MatrixView<float> logits(ws.logits.data(), T, E);
    stages::check_finite_logits(logits, {"ExpertParallelMoeFfn", comm_.rank(), ws.token_offset});
    stages::select_and_plan(router_, logits, opt.controls, ws.selection, ws.plan,
                            "ExpertParallelMoeFfn");
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
    ws.stamp = {};
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
      route(xin, ws, opt);
    } catch (std::exception const& e) {
      status = 1;
      route_error = e.what();
    }
    // 3. Counts.
    RowExchange::Context const ex = exchange_context();
    ws.exchange.exchange_counts(ex, ws.plan, status, route_error, ws.stats);
    // 4. Dispatch the token rows to the experts' owners.
    ws.exchange.dispatch(ex, xin, ws.plan.num_rows(), ws.experts.x_rows, opt.pool, ws.stats);
    // 5. Local experts on every row they received.
    run_local_experts(ws, opt.pool, train);
    // 6. Outputs back to the tokens' ranks, in plan row order.
    ws.exchange.return_rows(ex, ws.experts.out.data(), ws.plan.num_rows(), ws.routed_out, opt.pool,
                            ws.stats);
    // 7. Shared experts and combine.
    run_shared_and_combine(xin, y, ws, opt.pool, train);
    if (train) {
      global_counts(ws);
      if constexpr (requires(Balance & b, BalanceInputs const& in) { b.observe(in); }) {
        observe_global(ws);
      }
      ws.stamp = stamp(T);
    }
  }

  RowExchange::Context exchange_context() const {
    return {comm_.get(), comm_.rank(), comm_.size(), &placement_, d_model_, row_type_.get()};
  }

  stages::ExpertRows local_rows(ExpertParallelWorkspace const& ws) const {
    return {ws.exchange.local_offsets.data(), bank_.num_experts()};
  }

  /// Step 5: the routed-experts engine on every row this rank's experts received (MoeFfn's
  /// jobs on all of an expert's rows; outputs unweighted: the weight is applied on return).
  void run_local_experts(ExpertParallelWorkspace& ws, ThreadPool* pool, bool train) const {
    Index const D = d_model_, rin = ws.exchange.received(), kpD = (D + 1) / 2;
    stages::ExpertMode const mode{train, ::moe::detail::uses_bf16_pairs(bank_, !train),
                                  ::moe::detail::uses_q8_rows(bank_, !train)};
    Index const rbD = kernels::q8_row_bytes(D);
    ws.experts.prepare(bank_, rin, mode, false);
    ws.experts.round_inputs(bank_, rin, mode, pool);
    ws.x_pairs.resize(static_cast<std::size_t>(mode.pairs ? rin * kpD : 0));
    ws.x_q8.resize(static_cast<std::size_t>(mode.q8 ? rin * rbD : 0));
    std::uint32_t* const pairs = mode.pairs ? ws.x_pairs.data() : nullptr;
    std::byte* const q8 = mode.q8 ? ws.x_q8.data() : nullptr;
    ::moe::detail::run_pairs_tasks(
        pool, {::moe::detail::PairsTask{ws.experts.x_rows.data(), D, rin, D, pairs, q8}});
    ws.experts.enqueue_in(ws.queue, bank_, local_rows(ws),
                          {ws.experts.x_rows.data(), D, nullptr, pairs, kpD, q8, rbD}, mode);
    ws.queue.run<Expert, SharedX>(pool);
    ws.experts.round_hidden(bank_, rin, mode, pool);
    ::moe::detail::run_pairs_tasks(pool, {ws.experts.act_pairs_task(bank_, rin)});
    ws.experts.enqueue_down(ws.queue, bank_, local_rows(ws), nullptr, mode);
    ws.queue.run<Expert, SharedX>(pool);
  }

  /// Step 7: shared experts on this rank's tokens (kernel path of the global batch), combine.
  /// Inference applies each routed row's weight first (the product MoeFfn's down-projection
  /// epilogue computes), then sums; training combines the unweighted rows with the weights.
  void run_shared_and_combine(ConstMatrixView<float> x, MatrixView<float> y,
                              ExpertParallelWorkspace& ws, ThreadPool* pool, bool train) const {
    Index const T = x.rows, D = d_model_, kpD = (D + 1) / 2;
    stages::ExpertMode const mode{train, stages::SharedStage::uses_pairs(shared_, train),
                                  stages::SharedStage::uses_q8(shared_, train)};
    Index const rbD = kernels::q8_row_bytes(D);
    ws.shared.prepare(shared_, T, mode, D);
    ws.shared.gates(shared_, x, pool);
    ws.shared_x_pairs.resize(static_cast<std::size_t>(mode.pairs ? T * kpD : 0));
    ws.shared_x_q8.resize(static_cast<std::size_t>(mode.q8 ? T * rbD : 0));
    std::uint32_t* const pairs = mode.pairs ? ws.shared_x_pairs.data() : nullptr;
    std::byte* const q8 = mode.q8 ? ws.shared_x_q8.data() : nullptr;
    ::moe::detail::run_pairs_tasks(
        pool, {::moe::detail::PairsTask{x.data, x.row_stride, T, D, pairs, q8}});
    ConstMatrixView<float> const xs = ws.shared.inputs(shared_, x, mode, pool);
    ws.shared.enqueue_in(ws.queue, shared_, {xs.data, xs.row_stride, nullptr, pairs, kpD, q8, rbD},
                         T, mode, ws.total_tokens);
    ws.queue.run<Expert, SharedX>(pool);
    ws.shared.round_hidden(shared_, mode, pool);
    ::moe::detail::run_pairs_tasks(pool, {ws.shared.act_pairs_task(shared_, T)});
    ws.shared.enqueue_down(ws.queue, shared_, T, mode, ws.total_tokens);
    ws.queue.run<Expert, SharedX>(pool);
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
    stages::combine(combine_source(ws, train), y, pool);
  }

  stages::CombineSource combine_source(ExpertParallelWorkspace const& ws, bool weighted) const {
    stages::CombineSource src;
    src.rows = ws.routed_out.data();
    src.row_weight = weighted ? ws.plan.row_weight.data() : nullptr;
    src.plan = &ws.plan;
    ws.shared.add_to(src, shared_);
    return src;
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
                               ws.exchange.local_offsets[j + 1] - ws.exchange.local_offsets[j],
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

  /// The backward: MoeFfn's stages on each side of the exchanges.
  void backward_impl(ExpertParallelWorkspace& ws, ConstMatrixView<float> dy, MatrixView<float> dx,
                     Gradients& grads, ThreadPool* pool) const {
    Index const T = ws.selection.num_tokens, D = d_model_, E = num_experts();
    RoutingPlan const& plan = ws.plan;
    Index const R = plan.num_rows();
    ConstMatrixView<float> x(ws.x.data(), T, D);
    ws.router_grads.reset(T, ws.selection.slots, E);
    ws.d_rows.resize(static_cast<std::size_t>(R * D));
    ws.shared.prepare_backward(shared_, T, D);
    // 1. Combine VJP (token side): dY_r = w_r dy[t]; dL/dw of each slot; shared experts.
    stages::CombineGrads cg{ws.d_rows.data(), ws.router_grads.dweight.data()};
    ws.shared.add_to(cg);
    stages::combine_backward(dy, combine_source(ws, true), ws.selection, cg, pool);
    // 2. Balance gradients on this rank's tokens.
    BalanceGradients bg{MatrixView<float>(ws.router_grads.dscores.data(), T, E),
                        MatrixView<float>(ws.router_grads.dlogits_extra.data(), T, E),
                        MatrixView<float>(ws.d_rows.data(), R, D)};
    balance_.backward(balance_inputs(ws), bg);
    // 3. dL/dY rows to the experts' owners (the forward's counts).
    RowExchange::Context const ex = exchange_context();
    ws.exchange.send_to_owners(ex, ws.d_rows, R, ws.experts.d_out, pool, ws.stats);
    // 4. Expert VJPs on the owner, row phase, on all of each expert's rows.
    ws.experts.backward_rows(bank_, local_rows(ws), pool, ws.scratch);
    // 5. dL/dX rows back to the tokens' ranks.
    ws.exchange.return_rows(ex, ws.experts.dx_rows.data(), R, ws.dx_rows, pool, ws.stats);
    // 6. Router VJP and the shared experts' row phase (token side).
    ws.router_grads.vjp(router_, ws.logits_view(), ws.selection);
    ws.shared.backward_rows(shared_, T, pool, ws.scratch);
    // 7. Weight gradients: routed experts into grads (they stay here), replicated parameters
    //    into this rank's partial sums, laid out [router.weight | router.bias | shared bank
    //    parameters() | gate].
    Index const n_router = E * D + static_cast<Index>(router_bias_.size());
    Index n_shared = 0, n_gate = 0;
    if constexpr (Shared::has_experts) {
      n_shared = static_cast<Index>(shared_.bank().parameters().size());
      n_gate = shared_.gate_weight().rows * shared_.gate_weight().cols;
    }
    ws.partial.assign(static_cast<std::size_t>(n_router + n_shared + n_gate), 0.0f);
    float* const partial = ws.partial.data();
    ws.grad_tasks.clear();
    auto const expert_grads = grads.experts.edit();
    ws.experts.add_weight_grads(ws.grad_tasks, bank_, local_rows(ws), ws.experts.x_rows.data(),
                                expert_grads);
    ws.shared.add_weight_grads(ws.grad_tasks, shared_, x,
                               {partial + n_router, partial + n_router + n_shared});
    ws.router_grads.add_weight_grad(ws.grad_tasks, x, E, partial);
    if (!router_bias_.empty()) ws.router_grads.add_bias_grad(T, E, partial + E * D);
    ws.grad_tasks.run(pool, ws.scratch);
    // 8. dx = combine(dX rows, shared dx) + dlogits W_r + dgate W_g.
    stages::CombineSource src;
    src.rows = ws.dx_rows.data();
    src.plan = &plan;
    src.shared = ws.shared.dx.data();
    src.num_shared = shared_.count();
    stages::DxTerm const terms[] = {ws.router_grads.dx_term(router_weight_.data(), E, D),
                                    ws.shared.gate_dx_term(shared_)};
    stages::combine(src, dx, pool,
                    [&](Index t0, Index n) { stages::add_dx_terms(terms, t0, n, dx); });
    // 9. Sum the replicated parameters' gradients over ranks; accumulate into grads.
    detail::sum_over_ranks(comm_.get(), ws.partial, reduction_, ws.reduce_scratch, ws.stats);
    for (Index i = 0; i < E * D; ++i) {
      grads.router_weight[static_cast<std::size_t>(i)] += ws.partial[static_cast<std::size_t>(i)];
    }
    for (Index i = E * D; i < n_router; ++i) {
      grads.router_bias[static_cast<std::size_t>(i - E * D)] +=
          ws.partial[static_cast<std::size_t>(i)];
    }
    if constexpr (Shared::has_experts) {
      auto const edit = grads.shared.bank().edit();
      auto gp = edit.parameters();
      for (Index i = 0; i < n_shared; ++i) {
        gp[static_cast<std::size_t>(i)] += ws.partial[static_cast<std::size_t>(n_router + i)];
      }
      auto gg = grads.shared.gate_weight();
      for (Index i = 0; i < n_gate; ++i) {
        gg.data[i] += ws.partial[static_cast<std::size_t>(n_router + n_shared + i)];
      }
    }
  }

  Communicator comm_;
  RowType row_type_;
  ExpertPlacement placement_;
  GradientReduction reduction_ = GradientReduction::kRankOrdered;
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
