// SPDX-License-Identifier: Apache-2.0
// ExpertParallelMoeFfn against the single-process MoeFfn on the same weights and inputs, run
// under mpirun at 1, 2 and 4 ranks. Every rank builds the full reference layer from the same
// seed and runs it on the global batch (all ranks' tokens concatenated in rank order), then
// compares its own slice: forward and dx bitwise, routed-expert gradients bitwise, router and
// shared-expert gradients within the summation-order bound of docs/distributed.md. Plus the
// skewed cases (more ranks than experts, uneven experts, a rank without tokens, every token on
// one rank's experts) and the errors (mismatched configurations, bad input on one rank, calls
// out of step) that must throw on every rank instead of hanging.
//
// Collective discipline: every rank runs the same test cases in the same order, and
// comparisons use CHECK (not REQUIRE) so that a failure never makes one rank skip a collective.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <span>
#include <vector>

#include "moe/balance/aux_free_bias.hpp"
#include "moe/balance/global_batch_aux.hpp"
#include "moe/balance/switch_aux.hpp"
#include "moe/core/random.hpp"
#include "moe/dist/expert_parallel.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "support/helpers.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace dist = moe::dist;
namespace experts = moe::experts;
namespace routing = moe::routing;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

std::vector<float> random_vector(Index n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, lo, hi, seed);
  return v;
}

/// Number of positions where a and b differ in their bits (the first one is reported).
Index bit_mismatches(float const* a, float const* b, Index n, char const* what) {
  Index bad = 0;
  for (Index i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      if (bad == 0) {
        UNSCOPED_INFO(what << ": first difference at " << i << ": " << a[i] << " vs " << b[i]);
      }
      ++bad;
    }
  }
  return bad;
}

enum class Placement { kContiguous, kRoundRobin, kReversed };

dist::ExpertPlacement make_placement(Placement kind, Index E, int P) {
  switch (kind) {
    case Placement::kRoundRobin:
      return dist::ExpertPlacement::round_robin(E, P);
    case Placement::kReversed: {
      auto c = dist::ExpertPlacement::contiguous(E, P);
      std::vector<int> owner(c.owners().begin(), c.owners().end());
      for (int& o : owner) o = P - 1 - o;
      return dist::ExpertPlacement::from_owners(owner, P);
    }
    case Placement::kContiguous:
      break;
  }
  return dist::ExpertPlacement::contiguous(E, P);
}

struct Case {
  Index total_tokens = 150;
  std::vector<Index> split;  ///< tokens per rank; empty: near-equal
  Placement placement = Placement::kContiguous;
  dist::GradientReduction reduction = dist::GradientReduction::kRankOrdered;
  int threads = 1;
  bool pack = false;
  experts::WeightFormat format = experts::WeightFormat::kF32;
  bool to_last_rank = false;  ///< route every token to the last rank's experts
  int steps = 1;              ///< forward_train + backward + end_step rounds
  bool mask = false;          ///< mark every 7th token (t % 7 == 3) as padding
  /// Training arithmetic of the reference (from_layer carries it over).
  experts::TrainCompute compute = experts::TrainCompute::kF32;
};

std::vector<Index> token_split(Case const& c, int P) {
  if (!c.split.empty()) {
    std::vector<Index> s = c.split;
    s.resize(static_cast<std::size_t>(P), 0);
    return s;
  }
  std::vector<Index> s(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) {
    s[static_cast<std::size_t>(r)] = dist::detail::part_begin(c.total_tokens, P, r + 1) -
                                     dist::detail::part_begin(c.total_tokens, P, r);
  }
  return s;
}

/// sum_t |a[t, i]| |b[t, j]| for every (i, j): the scale of a gradient summed over tokens.
std::vector<double> abs_outer(float const* a, Index lda, float const* b, Index ldb, Index T,
                              Index n_a, Index n_b) {
  std::vector<double> s(static_cast<std::size_t>(n_a * n_b), 0.0);
  for (Index t = 0; t < T; ++t) {
    for (Index i = 0; i < n_a; ++i) {
      double const ai = std::fabs(a[t * lda + i]);
      if (ai == 0.0) continue;
      for (Index j = 0; j < n_b; ++j) s[i * n_b + j] += ai * std::fabs(b[t * ldb + j]);
    }
  }
  return s;
}

/// |got - want| <= (T + P) 2^-23 scale + 1e-30, element by element.
Index out_of_bound(float const* got, float const* want, std::vector<double> const& scale, Index T,
                   int P, char const* what) {
  Index bad = 0;
  double const gamma = static_cast<double>(T + P) * std::ldexp(1.0, -23);
  for (std::size_t i = 0; i < scale.size(); ++i) {
    double const diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (diff > gamma * scale[i] + 1e-30) {
      if (bad == 0) {
        UNSCOPED_INFO(what << "[" << i << "]: " << got[i] << " vs " << want[i] << ", bound "
                           << gamma * scale[i]);
      }
      ++bad;
    }
  }
  return bad;
}

/// Runs the reference on the global batch and the expert-parallel layer on this rank's slice,
/// and compares everything (see the file comment).
template <class Layer>
void check_against_reference(Layer ref, Case const& c) {
  using EP = dist::ExpertParallelOf<Layer>;
  int const P = world_size(), me = world_rank();
  Index const D = ref.d_model(), E = ref.num_experts(), T = c.total_tokens;
  auto const split = token_split(c, P);
  Index O = 0;
  for (int r = 0; r < me; ++r) O += split[static_cast<std::size_t>(r)];
  Index const Tr = split[static_cast<std::size_t>(me)];
  {
    Index sum = 0;
    for (Index n : split) sum += n;
    REQUIRE(sum == T);  // same on every rank: a test-setup error, not a layer failure
  }
  dist::ExpertParallelOptions options;
  options.placement = make_placement(c.placement, E, P);
  options.reduction = c.reduction;

  auto X = random_vector(T * D, 11);
  auto dY = random_vector(T * D, 12);
  if (c.to_last_rank) {
    auto w = ref.router_weight();
    for (Index e = 0; e < E; ++e) w(e, 0) = options.placement.owner(e) == P - 1 ? 30.0f : -30.0f;
    for (Index t = 0; t < T; ++t) X[static_cast<std::size_t>(t * D)] = 1.0f;
  }
  if (c.pack) ref.pack_weights(c.format);
  ref.set_train_compute(c.compute);
  moe::ThreadPool pool(c.threads);
  moe::ThreadPool* pp = c.threads > 1 ? &pool : nullptr;
  std::vector<std::uint8_t> mask;
  if (c.mask) {
    mask.resize(static_cast<std::size_t>(T));
    for (Index t = 0; t < T; ++t) mask[static_cast<std::size_t>(t)] = t % 7 == 3 ? 0 : 1;
  }
  moe::ForwardOptions ref_opt{nullptr, pp, mask};
  moe::ForwardOptions ep_opt{nullptr, pp,
                             c.mask ? std::span<std::uint8_t const>(mask).subspan(
                                          static_cast<std::size_t>(O), static_cast<std::size_t>(Tr))
                                    : std::span<std::uint8_t const>()};

  EP ep = EP::from_layer(MPI_COMM_WORLD, ref, options);
  CHECK(ep.train_compute() == c.compute);
  CHECK_NOTHROW(ep.verify_replicas());
  auto const ids = ep.local_expert_ids();
  CHECK(static_cast<Index>(ids.size()) == ep.local_experts().num_experts());

  for (int step = 0; step < c.steps; ++step) {
    INFO("rank " << me << " of " << P << ", step " << step);
    // Reference, global batch.
    moe::MoeFfnWorkspace rws;
    std::vector<float> Yref(static_cast<std::size_t>(T * D)), dXref(Yref.size());
    ref.forward_train({X.data(), T, D}, {Yref.data(), T, D}, rws, ref_opt);
    auto gref = ref.make_gradients();
    ref.backward(rws, {dY.data(), T, D}, {dXref.data(), T, D}, gref, pp);

    // Expert parallel, this rank's slice.
    dist::ExpertParallelWorkspace ws;
    std::vector<float> y(static_cast<std::size_t>(Tr * D)), dx(y.size());
    ep.forward_train({X.data() + O * D, Tr, D}, {y.data(), Tr, D}, ws, ep_opt);
    CHECK(ws.total_tokens == T);
    CHECK(ws.token_offset == O);
    CHECK(bit_mismatches(y.data(), Yref.data() + O * D, Tr * D, "y") == 0);
    Index const S = ws.selection.slots;
    CHECK(S == rws.selection.slots);
    CHECK(std::equal(ws.selection.expert.begin(), ws.selection.expert.end(),
                     rws.selection.expert.begin() + O * S));
    CHECK(bit_mismatches(ws.selection.weight.data(), rws.selection.weight.data() + O * S, Tr * S,
                         "routing weights") == 0);
    // Traffic: rows sent = local rows; rows received = the local experts' global rows.
    CHECK(ws.stats.rows_sent == ws.plan.num_rows());
    Index want_in = 0;
    for (Index e : ids) want_in += rws.plan.expert_rows(e);
    CHECK(ws.stats.rows_received == want_in);
    if (c.to_last_rank && me != P - 1) CHECK(ws.stats.rows_received == 0);

    auto g = ep.make_gradients();
    ep.backward(ws, {dY.data() + O * D, Tr, D}, {dx.data(), Tr, D}, g, pp);
    CHECK(bit_mismatches(dx.data(), dXref.data() + O * D, Tr * D, "dx") == 0);
    for (std::size_t j = 0; j < ids.size(); ++j) {
      INFO("local expert " << j << " = expert " << ids[j]);
      auto const gi = g.experts.in_proj(static_cast<Index>(j));
      auto const gd = g.experts.down_proj(static_cast<Index>(j));
      CHECK(bit_mismatches(gi.data, gref.experts.in_proj(ids[j]).data, gi.rows * gi.cols,
                           "expert in_proj grad") == 0);
      CHECK(bit_mismatches(gd.data, gref.experts.down_proj(ids[j]).data, gd.rows * gd.cols,
                           "expert down_proj grad") == 0);
      REQUIRE(g.experts.has_biases() == ref.experts().has_biases());
      if (ref.experts().has_biases()) {
        auto const bi = g.experts.in_bias(static_cast<Index>(j));
        auto const bd = g.experts.down_bias(static_cast<Index>(j));
        CHECK(bit_mismatches(bi.data(), gref.experts.in_bias(ids[j]).data(),
                             static_cast<Index>(bi.size()), "expert in_bias grad") == 0);
        CHECK(bit_mismatches(bd.data(), gref.experts.down_bias(ids[j]).data(),
                             static_cast<Index>(bd.size()), "expert down_bias grad") == 0);
      }
    }
    // Replicated parameters: summation-order bound (bitwise with one rank).
    auto const rscale =
        abs_outer(rws.router_grads.dlogits.data(), E, rws.train.x.data(), D, T, E, D);
    if (P == 1) {
      CHECK(bit_mismatches(g.router_weight.data(), gref.router_weight.data(), E * D,
                           "router grad") == 0);
    }
    CHECK(out_of_bound(g.router_weight.data(), gref.router_weight.data(), rscale, T, P,
                       "router grad") == 0);
    REQUIRE(g.router_bias.size() == gref.router_bias.size());
    if (!gref.router_bias.empty()) {  // projection bias: sum over tokens of |dlogits|
      std::vector<double> bscale(static_cast<std::size_t>(E), 0.0);
      for (Index t = 0; t < T; ++t) {
        for (Index e = 0; e < E; ++e) {
          bscale[static_cast<std::size_t>(e)] +=
              std::fabs(rws.router_grads.dlogits[static_cast<std::size_t>(t * E + e)]);
        }
      }
      CHECK(out_of_bound(g.router_bias.data(), gref.router_bias.data(), bscale, T, P,
                         "router bias grad") == 0);
    }
    if constexpr (Layer::Shared::has_experts) {
      auto const& sb = ref.shared_experts().bank();
      Index const ns = sb.num_experts(), Ps = sb.hidden_cols(), Fs = sb.d_ffn();
      for (Index s = 0; s < ns; ++s) {
        auto const in_scale =
            abs_outer(rws.shared.dhidden.data() + s * T * Ps, Ps, rws.train.x.data(), D, T, Ps, D);
        auto const down_scale = abs_outer(rws.shared.dy.data() + s * T * D, D,
                                          rws.shared.act.data() + s * T * Fs, Fs, T, D, Fs);
        CHECK(out_of_bound(g.shared.bank().in_proj(s).data, gref.shared.bank().in_proj(s).data,
                           in_scale, T, P, "shared in_proj grad") == 0);
        CHECK(out_of_bound(g.shared.bank().down_proj(s).data, gref.shared.bank().down_proj(s).data,
                           down_scale, T, P, "shared down_proj grad") == 0);
      }
      if constexpr (Layer::Shared::gated) {
        auto const gscale = abs_outer(rws.shared.dgate.data(), ns, rws.train.x.data(), D, T, ns, D);
        CHECK(out_of_bound(g.shared.gate_weight().data, gref.shared.gate_weight().data, gscale, T,
                           P, "shared gate grad") == 0);
      }
      if (P == 1) {
        auto const a = g.shared.bank().parameters();
        auto const b = gref.shared.bank().parameters();
        CHECK(bit_mismatches(a.data(), b.data(), static_cast<Index>(a.size()), "shared grad") == 0);
      }
    }
    // The replicated gradients are identical on every rank.
    {
      std::uint64_t h = dist::detail::fnv1a(g.router_weight.data(), g.router_weight.size() * 4);
      std::uint64_t lo = h, hi = h;
      MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
      CHECK(lo == hi);
    }
    ref.end_step();
    ep.end_step();
    if constexpr (requires { ref.router().bias; }) {
      CHECK(bit_mismatches(ep.router().bias.data(), ref.router().bias.data(),
                           static_cast<Index>(ref.router().bias.size()), "router bias") == 0);
    }
  }

  // Inference forward, in place (y = x), against the reference's inference forward.
  {
    CHECK(std::as_const(ep).local_experts().packed() == std::as_const(ref).experts().packed());
    moe::MoeFfnWorkspace rws;
    std::vector<float> Yref(static_cast<std::size_t>(T * D));
    ref.forward({X.data(), T, D}, {Yref.data(), T, D}, rws, {nullptr, pp});
    std::vector<float> xy(X.begin() + O * D, X.begin() + (O + Tr) * D);
    dist::ExpertParallelWorkspace ws;
    ep.forward({xy.data(), Tr, D}, {xy.data(), Tr, D}, ws, {nullptr, pp});
    CHECK(bit_mismatches(xy.data(), Yref.data() + O * D, Tr * D, "inference y") == 0);
  }
}

using Plain = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
using Qwen2Like = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu,
                              experts::GatedSharedExperts<experts::SwiGlu>>;
using DeepSeekLike =
    moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu,
                experts::UngatedSharedExperts<experts::SwiGlu>, moe::balance::AuxFreeBias>;
using MlpLayer = moe::MoeFfn<routing::TopKSoftmax, experts::ReluMlp>;

Plain make_plain(Index E = 8, Index k = 2, Index D = 16, Index F = 24) {
  Plain layer(D, F, routing::SoftmaxTopK{E, k, true, 1.0f});
  test::randomize_ffn(layer, 7);
  return layer;
}

Qwen2Like make_qwen2_like(Index F = 20, Index Fs = 28) {
  Index const D = 16;
  Qwen2Like layer(D, F, routing::SoftmaxTopK{6, 2, false, 1.0f},
                  experts::GatedSharedExperts<experts::SwiGlu>(1, D, Fs));
  test::randomize_ffn(layer, 17);
  return layer;
}

DeepSeekLike make_deepseek_like() {
  Index const D = 16;
  routing::GroupLimitedTopK r;
  r.num_experts = 8;
  r.top_k = 2;
  r.n_group = 4;
  r.topk_group = 2;
  r.scale = 2.5f;
  r.bias.assign(8, 0.0f);
  DeepSeekLike layer(D, 12, std::move(r), experts::UngatedSharedExperts<experts::SwiGlu>(1, D, 24),
                     moe::balance::AuxFreeBias{0.05f, {}});
  test::randomize_ffn(layer, 27);
  return layer;
}

MlpLayer make_mlp(Index E, Index k) {
  MlpLayer layer(16, 20, routing::TopKSoftmax{E, k});
  test::randomize_ffn(layer, 37);
  return layer;
}

}  // namespace

TEST_CASE("dist: placement", "[dist]") {
  auto c = dist::ExpertPlacement::contiguous(10, 4);
  CHECK(c.num_local(0) == 3);
  CHECK(c.num_local(1) == 3);
  CHECK(c.num_local(2) == 2);
  CHECK(c.num_local(3) == 2);
  CHECK(c.owner(2) == 0);
  CHECK(c.owner(3) == 1);
  CHECK(c.owner(9) == 3);
  CHECK(c.local_index(7) == 1);
  CHECK(c.monotone());
  auto few = dist::ExpertPlacement::contiguous(3, 4);
  CHECK(few.num_local(3) == 0);
  CHECK(few.max_local() == 1);
  auto rr = dist::ExpertPlacement::round_robin(5, 2);
  CHECK(rr.experts_of(1).size() == 2);
  CHECK(rr.experts_of(1)[1] == 3);
  CHECK(!rr.monotone());
  CHECK_THROWS_WITH(dist::ExpertPlacement::from_owners({0, 2}, 2),
                    Catch::Contains("expert 1 is given to rank 2"));
  CHECK_THROWS_AS(dist::ExpertPlacement::contiguous(0, 2), moe::Error);
}

TEST_CASE("dist: forward and backward equal MoeFfn", "[dist]") {
  int const P = world_size();
  SECTION("softmax top-2 of 8, SwiGLU, even split") { check_against_reference(make_plain(), {}); }
  SECTION("router projection bias (gpt-oss's router.bias)") {
    auto layer = make_plain();
    layer.enable_router_bias();
    moe::fill_uniform(layer.router_bias(), -0.5f, 0.5f, 77);
    check_against_reference(std::move(layer), {});
  }
  SECTION("gpt-oss-like: router bias, biased clamped experts (ClampedSwiGlu), 2 threads") {
    using GptOssLike = moe::MoeFfn<routing::TopKSoftmax, experts::ClampedSwiGlu>;
    GptOssLike layer(16, 24, routing::TopKSoftmax{8, 2});
    layer.enable_router_bias();
    layer.experts().enable_biases();
    layer.experts().set_glu_clamp({1.702f, 0.3f});
    test::randomize_ffn(layer, 78);
    moe::fill_uniform(layer.router_bias(), -0.5f, 0.5f, 79);
    Case c;
    c.total_tokens = 57;
    c.threads = 2;
    check_against_reference(std::move(layer), c);
  }
  SECTION("uneven split, one rank without tokens, 2 threads") {
    Case c;
    c.total_tokens = 133;
    if (P >= 2) c.split = {70, 0, 63};  // rank 1 has no tokens; ranks >= 3 none either
    if (P == 2) c.split = {133, 0};
    c.threads = 2;
    check_against_reference(make_plain(), c);
  }
  SECTION("fewer than 8 tokens on some ranks (router path of the global batch), packed") {
    Case c;
    c.total_tokens = 13;
    c.pack = true;
    check_against_reference(make_plain(), c);
  }
  SECTION("bf16-packed routed and shared experts (inference), fp32 training") {
    Case c;
    c.total_tokens = 45;
    c.pack = true;
    c.format = experts::WeightFormat::kBf16;
    check_against_reference(make_qwen2_like(), c);
  }
  SECTION("bf16, every projection on panels (inputs rounded to bf16 pairs once), 2 threads") {
    Case c;
    c.total_tokens = 61;
    c.pack = true;
    c.threads = 2;
    c.format = experts::WeightFormat::kBf16;
    Index const np = moe::kernels::panel_width();
    check_against_reference(make_qwen2_like(np, np), c);
  }
  SECTION("bf16-compute training (TrainCompute::kBf16), gated shared expert, 2 threads, 2 steps") {
    Case c;
    c.total_tokens = 83;
    c.threads = 2;
    c.steps = 2;
    c.compute = experts::TrainCompute::kBf16;
    check_against_reference(make_qwen2_like(), c);
  }
  SECTION("global batch under 8 tokens") {
    Case c;
    c.total_tokens = 5;
    check_against_reference(make_plain(), c);
  }
  SECTION("every token routed to the last rank's experts") {
    Case c;
    c.to_last_rank = true;
    c.total_tokens = 90;
    check_against_reference(make_plain(8, 2), c);
  }
  SECTION("gated shared expert (Qwen2-MoE-like), kAllreduce") {
    Case c;
    c.total_tokens = 140;
    c.reduction = dist::GradientReduction::kAllreduce;
    check_against_reference(make_qwen2_like(), c);
  }
  SECTION("gated shared expert, rank-ordered, round-robin placement") {
    Case c;
    c.total_tokens = 77;
    c.placement = Placement::kRoundRobin;
    check_against_reference(make_qwen2_like(), c);
  }
}

// Its own case, tagged [large]: under the sanitizers it runs at 2 ranks only (25 s a run there;
// tests/dist/CMakeLists.txt).
TEST_CASE("dist: large expert outputs, written with streaming stores, 2 threads", "[dist][large]") {
  // 2 experts, top-2: a rank that owns an expert computes all 4096 rows of it, a [4096, 1024]
  // output of 16 MiB, which the down projections write with non-temporal stores
  // (detail::kStreamOutputBytes) before the exchange reads it.
  Case c;
  c.total_tokens = 4096;
  c.threads = 2;
  c.pack = true;
  REQUIRE(c.total_tokens * 1024 * Index{4} >= moe::detail::kStreamOutputBytes);
  check_against_reference(make_plain(2, 2, 1024, 32), c);
}

TEST_CASE("dist: skewed shapes", "[dist]") {
  SECTION("5 experts (not dividing 2 or 4 ranks), ReLU MLP, reversed placement") {
    Case c;
    c.total_tokens = 101;
    c.placement = Placement::kReversed;
    check_against_reference(make_mlp(5, 2), c);
  }
  SECTION("3 experts: more ranks than experts at 4 ranks") {
    Case c;
    c.total_tokens = 70;
    check_against_reference(make_mlp(3, 1), c);
  }
  SECTION("1 expert: every other rank owns none") {
    Case c;
    c.total_tokens = 40;
    check_against_reference(make_mlp(1, 1), c);
  }
  SECTION("no tokens anywhere") {
    Case c;
    c.total_tokens = 0;
    check_against_reference(make_plain(), c);
  }
}

TEST_CASE("dist: balance policies observe the global batch", "[dist]") {
  SECTION("AuxFreeBias: router bias after end_step equals MoeFfn's, over 3 steps") {
    Case c;
    c.total_tokens = 96;
    c.steps = 3;
    check_against_reference(make_deepseek_like(), c);
  }
  SECTION("AuxFreeBias with padding tokens (token mask): counts of real tokens only") {
    Case c;
    c.total_tokens = 80;
    c.steps = 2;
    c.mask = true;
    check_against_reference(make_deepseek_like(), c);
  }
  SECTION("GlobalBatchAux: global frequencies") {
    int const P = world_size(), me = world_rank();
    using L = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, experts::NoSharedExperts,
                          moe::balance::GlobalBatchAux>;
    L ref(16, 24, routing::SoftmaxTopK{8, 2, true, 1.0f}, {}, moe::balance::GlobalBatchAux{});
    test::randomize_ffn(ref, 47);
    Index const T = 100, D = 16;
    auto X = random_vector(T * D, 11);
    auto ep = dist::ExpertParallelOf<L>::from_layer(MPI_COMM_WORLD, ref);
    Case c;
    c.total_tokens = T;
    auto const split = token_split(c, P);
    Index O = 0;
    for (int r = 0; r < me; ++r) O += split[static_cast<std::size_t>(r)];
    Index const Tr = split[static_cast<std::size_t>(me)];
    moe::MoeFfnWorkspace rws;
    std::vector<float> yref(static_cast<std::size_t>(T * D)), y(static_cast<std::size_t>(Tr * D));
    ref.forward_train({X.data(), T, D}, {yref.data(), T, D}, rws);
    dist::ExpertParallelWorkspace ws;
    ep.forward_train({X.data() + O * D, Tr, D}, {y.data(), Tr, D}, ws);
    CHECK(ep.balance().fbar == ref.balance().fbar);
    CHECK(ep.balance().counts == ref.balance().counts);
    CHECK(ep.balance().tokens == ref.balance().tokens);
    // aux_loss is this rank's micro-batch loss: MoeFfn::route on the same tokens.
    moe::MoeFfnWorkspace lws;
    L ref2(16, 24, routing::SoftmaxTopK{8, 2, true, 1.0f}, {}, moe::balance::GlobalBatchAux{});
    std::copy(ref.router_weight().data, ref.router_weight().data + 8 * 16,
              ref2.router_weight().data);
    ref2.route({X.data() + O * D, Tr, D}, lws);
    CHECK(ws.aux_loss == lws.aux_loss);
  }
}

TEST_CASE("dist: errors reach every rank, no hang", "[dist]") {
  int const P = world_size(), me = world_rank();
  Index const D = 16;
  SECTION("mismatched d_ffn across ranks") {
    if (P >= 2) {
      CHECK_THROWS_WITH(
          dist::ExpertParallelOf<Plain>(MPI_COMM_WORLD, D, me == 1 ? 25 : 24,
                                        routing::SoftmaxTopK{8, 2, true, 1.0f}),
          Catch::Contains("disagree on the layer configuration") && Catch::Contains("F=25"));
    }
  }
  SECTION("mismatched placement across ranks") {
    if (P >= 2) {
      dist::ExpertParallelOptions o;
      o.placement = me == 0 ? dist::ExpertPlacement::round_robin(8, P)
                            : dist::ExpertPlacement::contiguous(8, P);
      CHECK_THROWS_WITH(
          dist::ExpertParallelOf<Plain>(MPI_COMM_WORLD, D, 24,
                                        routing::SoftmaxTopK{8, 2, true, 1.0f}, {}, {}, o),
          Catch::Contains("disagree on the layer configuration"));
    }
  }
  SECTION("invalid router on one rank") {
    CHECK_THROWS_WITH(
        dist::ExpertParallelOf<Plain>(MPI_COMM_WORLD, D, 24,
                                      routing::SoftmaxTopK{8, me == P - 1 ? 9 : 2, true, 1.0f}),
        Catch::Contains("rank " + std::to_string(P - 1) + " failed its local checks") &&
            Catch::Contains("top_k"));
  }
  SECTION("backward with a workspace another layer filled") {
    Plain ref = make_plain();
    auto ep = dist::ExpertParallelOf<Plain>::from_layer(MPI_COMM_WORLD, ref);
    auto twin = dist::ExpertParallelOf<Plain>::from_layer(MPI_COMM_WORLD, ref);
    Index const T = 12;
    auto X = random_vector(T * D, 6);
    std::vector<float> y(X.size()), dx(X.size());
    dist::ExpertParallelWorkspace ws;
    auto g = ep.make_gradients();
    ep.forward_train({X.data(), T, D}, {y.data(), T, D}, ws);
    CHECK_THROWS_WITH(twin.backward(ws, {y.data(), T, D}, {dx.data(), T, D}, g),
                      Catch::Contains("another layer"));
    CHECK_NOTHROW(ep.backward(ws, {y.data(), T, D}, {dx.data(), T, D}, g));
  }
  SECTION("calls on a layer") {
    Plain ref = make_plain();
    auto ep = dist::ExpertParallelOf<Plain>::from_layer(MPI_COMM_WORLD, ref);
    Index const T = 20;
    auto X = random_vector(T * D, 5);
    std::vector<float> y(X.size());
    dist::ExpertParallelWorkspace ws;
    // Bad shape on the last rank only: every rank throws, naming it.
    Index const cols = me == P - 1 ? D - 1 : D;
    CHECK_THROWS_WITH(
        ep.forward({X.data(), T, cols, D}, {y.data(), T, cols, D}, ws),
        Catch::Contains("rank " + std::to_string(P - 1) + " failed") && Catch::Contains("columns"));
    // NaN in one rank's input: caught after routing, with the counts; every rank throws.
    std::vector<float> Xn = X;
    if (me == 0) Xn[3] = NAN;
    CHECK_THROWS_WITH(ep.forward({Xn.data(), T, D}, {y.data(), T, D}, ws),
                      Catch::Contains("rank 0") &&
                          (Catch::Contains("could not route") || Catch::Contains("NaN")));
    // Out of step: rank 0 runs forward while the others end a step.
    if (P >= 2) {
      if (me == 0) {
        CHECK_THROWS_WITH(ep.forward({X.data(), T, D}, {y.data(), T, D}, ws),
                          Catch::Contains("out of step"));
      } else {
        CHECK_THROWS_WITH(ep.end_step(), Catch::Contains("out of step"));
      }
    }
    // backward without forward_train.
    auto g = ep.make_gradients();
    CHECK_THROWS_WITH(ep.backward(ws, {y.data(), T, D}, {y.data(), T, D}, g),
                      Catch::Contains("forward_train first"));
    // Replicas: a different router weight on the last rank is found; sync_replicas fixes it.
    if (P >= 2 && me == P - 1) ep.router_weight()(0, 0) += 1.0f;
    if (P >= 2) {
      CHECK_THROWS_WITH(ep.verify_replicas(), Catch::Contains("replicated parameters differ"));
    }
    ep.sync_replicas(0);
    CHECK_NOTHROW(ep.verify_replicas());
    // After all of that the layer still works, and matches MoeFfn.
    std::vector<float> yref(static_cast<std::size_t>(P) * X.size());
    std::vector<float> Xall(yref.size());
    for (int r = 0; r < P; ++r) std::copy(X.begin(), X.end(), Xall.begin() + r * T * D);
    moe::MoeFfnWorkspace rws;
    ref.forward({Xall.data(), P * T, D}, {yref.data(), P * T, D}, rws);
    CHECK_NOTHROW(ep.forward({X.data(), T, D}, {y.data(), T, D}, ws));
    CHECK(bit_mismatches(y.data(), yref.data() + me * T * D, T * D, "y after errors") == 0);
  }
}
