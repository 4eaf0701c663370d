// SPDX-License-Identifier: Apache-2.0
// MoeFfn against the double reference for every routing policy, expert kind and shared-expert
// variant; MoE properties; determinism across threads; external plans; bad input.
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "moe/core/eigen_interop.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/capacity.hpp"
#include "moe/routing/expert_choice.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/one_per_group_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "moe/routing/top_p.hpp"
#include "support/helpers.hpp"
#include "support/layer_reference.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace routing = moe::routing;
namespace experts = moe::experts;

namespace {

template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  moe::fill_uniform(layer.experts().edit().parameters(), -0.2f, 0.2f, seed);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, seed + 1);
  if constexpr (Layer::Shared::has_experts) {
    moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.2f, 0.2f, seed + 2);
    auto g = layer.shared_experts().gate_weight();
    moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f,
                      0.5f, seed + 3);
  }
}

/// Runs the layer, checks its logits against a double GEMM, rebuilds the routing with the
/// reference policy `route_ref` from the layer's own logits, and compares y with the reference.
template <class Layer, class RouteRef>
void check_against_reference(Layer const& layer, Index T, RouteRef route_ref,
                             moe::ThreadPool* pool = nullptr) {
  Index const D = layer.d_model();
  auto x = test::random_vector(T * D, 1234, -1.0f, 1.0f);
  std::vector<float> y(x.size(), 0.0f);
  moe::MoeFfnWorkspace ws;
  ConstMatrixView<float> xv(x.data(), T, D);
  layer.forward(xv, MatrixView<float>(y.data(), T, D), ws, {nullptr, pool});
  auto z = ref::logits(xv, layer.router_weight());
  for (std::size_t i = 0; i < z.size(); ++i) REQUIRE(ws.logits[i] == Approx(z[i]).margin(1e-4));
  ref::Routing r = route_ref(ws.logits_view());
  test::require_same_routing(test::routing_of(ws.selection), r);
  auto want = ref::layer_forward(layer, xv, r);
  REQUIRE(test::max_rel_diff(y.data(), want) < 2e-5);
}

}  // namespace

TEST_CASE("MoeFfn matches the reference for every routing policy", "[layers][moe_ffn]") {
  Index const D = 32, F = 24, E = 8, T = 45;
  SECTION("softmax top-k, no renormalisation (Qwen, OLMoE)") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 3, false, 1.0f});
    randomize(layer, 1);
    check_against_reference(layer, T, [](auto z) { return ref::softmax_top_k(z, 3, false, 1.0); });
  }
  SECTION("softmax top-k, renormalised and scaled") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, true, 1.5f});
    randomize(layer, 2);
    check_against_reference(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.5); });
  }
  SECTION("top-k then softmax (Mixtral)") {
    moe::MoeFfn<routing::TopKSoftmax, experts::SwiGlu> layer(D, F, {E, 2});
    randomize(layer, 3);
    check_against_reference(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
  }
  SECTION("sigmoid, bias, group-limited, scaled (DeepSeek-V3)") {
    routing::GroupLimitedTopK r;
    r.num_experts = E;
    r.top_k = 3;
    r.n_group = 4;
    r.topk_group = 2;
    r.scale = 2.5f;
    r.bias = test::random_vector(E, 9, -0.2f, 0.2f);
    auto bias = r.bias;
    moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu> layer(D, F, r);
    randomize(layer, 4);
    check_against_reference(layer, T, [&](auto z) {
      return ref::group_limited(z, 3, 4, 2, true, 2.5, true, bias, true);
    });
  }
  SECTION("at most one expert per group") {
    moe::MoeFfn<routing::OnePerGroupTopK, experts::SwiGlu> layer(
        D, F, {E, 2, 4, true, 1.0f, routing::ScoreFunction::kSoftmax});
    randomize(layer, 5);
    check_against_reference(layer, T, [](auto z) { return ref::one_per_group(z, 2, 4, true); });
  }
  SECTION("expert choice") {
    moe::MoeFfn<routing::ExpertChoice, experts::SwiGlu> layer(D, F, {E, 1.0f, 4});
    randomize(layer, 6);
    Index const C = layer.router().capacity(T);
    check_against_reference(layer, T, [&](auto z) { return ref::expert_choice(z, C); });
  }
  SECTION("top-p") {
    moe::MoeFfn<routing::TopP, experts::SwiGlu> layer(D, F, {E, 0.5f, 0, false});
    randomize(layer, 7);
    check_against_reference(layer, T, [](auto z) { return ref::top_p(z, 0.5); });
  }
  SECTION("token choice with capacity and dropping") {
    using R = routing::WithCapacity<routing::SoftmaxTopK>;
    moe::MoeFfn<R, experts::SwiGlu> layer(D, F, R{{E, 2, true, 1.0f}, 0.8f, 2, false});
    randomize(layer, 8);
    Index const C = layer.router().capacity(T);
    check_against_reference(layer, T, [&](auto z) {
      Index dropped = 0;
      return ref::with_capacity(ref::softmax_top_k(z, 2, true, 1.0), E, C, false, &dropped);
    });
  }
}

TEMPLATE_TEST_CASE("MoeFfn matches the reference for every expert kind", "[layers][moe_ffn]",
                   experts::SwiGlu, experts::GeGlu, experts::GeGluErf, experts::ReluMlp,
                   experts::GeluMlp, experts::SiluMlp) {
  moe::MoeFfn<routing::SoftmaxTopK, TestType> layer(20, 36, {6, 2, false, 1.0f});
  randomize(layer, 11);
  check_against_reference(layer, 17, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
}

TEST_CASE("MoeFfn with shared experts, ungated and sigmoid-gated", "[layers][shared]") {
  Index const D = 16, F = 12, E = 4;
  SECTION("two ungated shared experts (DeepSeek style)") {
    using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu,
                              experts::UngatedSharedExperts<experts::SwiGlu>>;
    Layer layer(D, F, {E, 2, true, 1.0f}, experts::UngatedSharedExperts<experts::SwiGlu>(2, D, 20));
    randomize(layer, 21);
    check_against_reference(layer, 70, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
  }
  SECTION("two sigmoid-gated shared experts (Qwen2-MoE style)") {
    using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu,
                              experts::GatedSharedExperts<experts::GeluMlp>>;
    Layer layer(D, F, {E, 2, false, 1.0f}, experts::GatedSharedExperts<experts::GeluMlp>(2, D, 8));
    randomize(layer, 22);
    moe::ThreadPool pool(2);
    check_against_reference(
        layer, 70, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); }, &pool);
  }
  SECTION("zero shared experts of a shared-expert type") {
    using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu,
                              experts::GatedSharedExperts<experts::SwiGlu>>;
    Layer layer(D, F, {E, 2, false, 1.0f}, experts::GatedSharedExperts<experts::SwiGlu>(0, D, 8));
    randomize(layer, 23);
    check_against_reference(layer, 5, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
  }
}

TEST_CASE("Identity experts with renormalised weights return the input", "[layers][properties]") {
  Index const D = 10, E = 4;
  moe::MoeFfn<routing::SoftmaxTopK, experts::ReluMlp> layer(D, D, {E, 3, true, 1.0f});
  for (Index e = 0; e < E; ++e) {
    for (Index i = 0; i < D; ++i) {
      layer.experts().edit().up_proj(e)(i, i) = 1.0f;
      layer.experts().edit().down_proj(e)(i, i) = 1.0f;
    }
  }
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(E * D)), -1.0f, 1.0f, 3);
  Index const T = 77;
  auto x = test::random_vector(T * D, 4, 0.0f, 3.0f);  // relu(x) = x
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(y[i] == Approx(x[i]).epsilon(1e-6));
}

TEST_CASE("Permuting tokens permutes the output when nothing is dropped", "[layers][properties]") {
  Index const D = 24, F = 16, E = 8, T = 90;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, false, 1.0f});
  randomize(layer, 31);
  auto x = test::random_vector(T * D, 32);
  std::vector<Index> perm(T);
  std::iota(perm.begin(), perm.end(), 0);
  auto r = test::random_vector(T, 33, 0.0f, 1.0f);
  std::sort(perm.begin(), perm.end(), [&](Index a, Index b) { return r[a] < r[b]; });
  std::vector<float> xp(x.size()), y(x.size()), yp(x.size());
  for (Index t = 0; t < T; ++t) std::copy_n(x.data() + perm[t] * D, D, xp.data() + t * D);
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws);
  layer.forward({xp.data(), T, D}, {yp.data(), T, D}, ws);
  for (Index t = 0; t < T; ++t) {
    for (Index d = 0; d < D; ++d) REQUIRE(yp[t * D + d] == Approx(y[perm[t] * D + d]).margin(1e-6));
  }
}

TEST_CASE("Edge sizes: T = 0, T = 1, E = 1, k = E, experts with no or all tokens",
          "[layers][properties]") {
  SECTION("T = 0") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(8, 8, {4, 2, false, 1.0f});
    moe::MoeFfnWorkspace ws;
    REQUIRE_NOTHROW(layer.forward({nullptr, 0, 8}, {nullptr, 0, 8}, ws));
    REQUIRE(ws.plan.num_rows() == 0);
  }
  SECTION("T = 1") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(8, 8, {4, 2, false, 1.0f});
    randomize(layer, 41);
    check_against_reference(layer, 1, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
  }
  SECTION("E = 1 and k = E") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> one(8, 8, {1, 1, false, 1.0f});
    randomize(one, 42);
    check_against_reference(one, 9, [](auto z) { return ref::softmax_top_k(z, 1, false, 1.0); });
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> all(8, 8, {5, 5, false, 1.0f});
    randomize(all, 43);
    check_against_reference(all, 9, [](auto z) { return ref::softmax_top_k(z, 5, false, 1.0); });
  }
  SECTION("one expert gets every token, the others none") {
    Index const D = 8, E = 4, T = 150;  // > 2 tiles of rows for expert 2
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, 8, {E, 1, false, 1.0f});
    randomize(layer, 44);
    auto wr = layer.router_weight();
    std::fill_n(wr.data, E * D, 0.0f);
    wr(2, 0) = 1.0f;  // x[:, 0] > 0 for every token below, so expert 2 wins everywhere
    auto x = test::random_vector(T * D, 45, 0.1f, 1.0f);
    std::vector<float> y(x.size());
    moe::MoeFfnWorkspace ws;
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws);
    REQUIRE(ws.plan.expert_rows(2) == T);
    REQUIRE(ws.plan.expert_rows(0) == 0);
    auto want = ref::layer_forward(layer, {x.data(), T, D}, test::routing_of(ws.selection));
    REQUIRE(test::max_rel_diff(y.data(), want) < 2e-5);
  }
}

TEST_CASE("Results are bitwise identical for 1 and 2 threads and from run to run",
          "[layers][determinism]") {
  Index const D = 64, F = 48, E = 16, T = 300;
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu,
                            experts::GatedSharedExperts<experts::SwiGlu>>;
  Layer layer(D, F, {E, 4, true, 1.0f}, experts::GatedSharedExperts<experts::SwiGlu>(1, D, 32));
  randomize(layer, 51);
  auto x = test::random_vector(T * D, 52);
  std::vector<float> y1(x.size()), y2(x.size()), y3(x.size());
  moe::MoeFfnWorkspace ws1, ws2;
  moe::ThreadPool pool(2);
  layer.forward({x.data(), T, D}, {y1.data(), T, D}, ws1);
  layer.forward({x.data(), T, D}, {y2.data(), T, D}, ws2, {nullptr, &pool});
  layer.forward({x.data(), T, D}, {y3.data(), T, D}, ws2, {nullptr, &pool});
  REQUIRE(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(y2.data(), y3.data(), y1.size() * sizeof(float)) == 0);
}

TEST_CASE("Large expert outputs, written with streaming stores, match the reference",
          "[layers][determinism]") {
  // T = 2048 tokens x top-2 x D = 1024: a 16 MiB [R, D] expert output, which the down
  // projections write with non-temporal stores (detail::kStreamOutputBytes), then the combine
  // reads on another thread. Against the double reference, and bitwise for 1 and 2 threads.
  Index const D = 1024, F = 32, E = 4, T = 2048;
  REQUIRE(2 * T * D * Index{4} >= moe::detail::kStreamOutputBytes);
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, true, 1.0f});
  randomize(layer, 61);
  moe::ThreadPool pool(2);
  for (auto format : {experts::WeightFormat::kF32, experts::WeightFormat::kBf16}) {
    layer.pack_weights(format);
    if (format == experts::WeightFormat::kF32) {
      check_against_reference(
          layer, T, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); }, &pool);
    }
    auto x = test::random_vector(T * D, 62);
    std::vector<float> y1(x.size()), y2(x.size());
    moe::MoeFfnWorkspace w1, w2;
    layer.forward({x.data(), T, D}, {y1.data(), T, D}, w1);
    layer.forward({x.data(), T, D}, {y2.data(), T, D}, w2, {nullptr, &pool});
    REQUIRE(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("With packed weights a token's output does not depend on its batch (fp32, bf16)",
          "[layers][determinism][bf16]") {
  // 2048 tokens at once give experts ~1024 rows and the shared expert 2048: jobs of more than
  // one 512-row work item, whose later items must read their own rows (and, with AVX512-BF16,
  // their own bf16 pairs). 256-token batches keep every job in one item.
  Index const D = 256, F = 32, E = 4, T = 2048, B = 256;
  using Sh = experts::UngatedSharedExperts<experts::SwiGlu>;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(D, F, {E, 2, true, 1.0f},
                                                               Sh(1, D, 32));
  randomize(layer, 71);
  auto x = test::random_vector(T * D, 72);
  moe::ThreadPool pool(2);
  for (auto format : {experts::WeightFormat::kF32, experts::WeightFormat::kBf16}) {
    INFO("bf16 " << (format == experts::WeightFormat::kBf16));
    layer.pack_weights(format);
    std::vector<float> whole(x.size()), parts(x.size());
    moe::MoeFfnWorkspace ws;
    layer.forward({x.data(), T, D}, {whole.data(), T, D}, ws, {nullptr, &pool});
    for (Index t0 = 0; t0 < T; t0 += B) {
      layer.forward({x.data() + t0 * D, B, D}, {parts.data() + t0 * D, B, D}, ws);
    }
    REQUIRE(std::memcmp(whole.data(), parts.data(), whole.size() * sizeof(float)) == 0);
    // Batches below kernels::kPanelMinRows (decode steps): the router takes the same kernel.
    for (Index t0 : {Index{0}, Index{5}, Index{1234}}) {
      for (Index b : {Index{1}, Index{3}}) {
        INFO("tokens " << t0 << " + " << b);
        std::vector<float> small(static_cast<std::size_t>(b * D));
        layer.forward({x.data() + t0 * D, b, D}, {small.data(), b, D}, ws);
        REQUIRE(std::memcmp(small.data(), whole.data() + t0 * D, small.size() * sizeof(float)) ==
                0);
      }
    }
  }
}

TEST_CASE("A plan computed elsewhere drives another expert bank", "[layers][plan]") {
  Index const D = 16, F = 12, E = 6, T = 40;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> a(D, F, {E, 2, false, 1.0f});
  moe::MoeFfn<routing::SoftmaxTopK, experts::GeluMlp> b(D, 20, {E, 2, false, 1.0f});
  randomize(a, 61);
  randomize(b, 62);
  auto x = test::random_vector(T * D, 63);
  std::vector<float> ya(x.size()), yb(x.size()), ya2(x.size());
  moe::MoeFfnWorkspace wa, wb;
  a.forward({x.data(), T, D}, {ya.data(), T, D}, wa);
  // Same plan on the same layer: bitwise the same output.
  a.forward_with_plan({x.data(), T, D}, wa.plan, {ya2.data(), T, D}, wb);
  REQUIRE(ya == ya2);
  // a's routing decision drives b's experts (shared router across projections).
  b.forward_with_plan({x.data(), T, D}, wa.plan, {yb.data(), T, D}, wb);
  auto want = ref::layer_forward(b, {x.data(), T, D}, test::routing_of(wa.selection));
  REQUIRE(test::max_rel_diff(yb.data(), want) < 2e-5);
}

TEST_CASE("A hand-built plan is validated and used", "[layers][plan]") {
  Index const D = 4, E = 2, T = 2;
  moe::MoeFfn<routing::SoftmaxTopK, experts::ReluMlp> layer(D, D, {E, 1, false, 1.0f});
  for (Index e = 0; e < E; ++e) {
    for (Index i = 0; i < D; ++i) {
      layer.experts().edit().up_proj(e)(i, i) = 1.0f;
      layer.experts().edit().down_proj(e)(i, i) = static_cast<float>(e + 1);
    }
  }
  moe::RoutingPlan plan;
  plan.num_tokens = T;
  plan.num_experts = E;
  plan.expert_offsets = {0, 1, 3};
  plan.row_token = {1, 0, 1};
  plan.row_weight = {0.5f, 1.0f, 0.25f};
  plan.token_offsets = {0, 1, 3};
  plan.token_rows = {1, 0, 2};
  std::vector<float> x = {1, 2, 3, 4, 1, 1, 1, 1}, y(8);
  moe::MoeFfnWorkspace ws;
  layer.forward_with_plan({x.data(), T, D}, plan, {y.data(), T, D}, ws);
  // token 0: 1.0 * 2 * x0; token 1: 0.5 * 1 * x1 + 0.25 * 2 * x1 = x1
  std::vector<float> want = {2, 4, 6, 8, 1, 1, 1, 1};
  REQUIRE(y == want);
  auto bad = plan;
  bad.row_token[0] = 0;
  REQUIRE_THROWS_WITH(layer.forward_with_plan({x.data(), T, D}, bad, {y.data(), T, D}, ws),
                      Catch::Contains("listed under token 1 but row_token says 0"));
  bad = plan;
  bad.token_rows = {1, 1, 2};
  REQUIRE_THROWS_WITH(layer.forward_with_plan({x.data(), T, D}, bad, {y.data(), T, D}, ws),
                      Catch::Contains("listed twice"));
  bad = plan;
  bad.expert_offsets = {0, 2, 1};
  REQUIRE_THROWS_AS(layer.forward_with_plan({x.data(), T, D}, bad, {y.data(), T, D}, ws),
                    moe::Error);
  bad = plan;
  bad.num_tokens = 3;
  REQUIRE_THROWS_WITH(layer.forward_with_plan({x.data(), T, D}, bad, {y.data(), T, D}, ws),
                      Catch::Contains("num_tokens = 3"));
  bad = plan;
  bad.row_weight[1] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(layer.forward_with_plan({x.data(), T, D}, bad, {y.data(), T, D}, ws),
                      Catch::Contains("non-finite weight"));
}

TEST_CASE("Bad input gets a clear moe::Error", "[layers][errors]") {
  Index const D = 8, E = 4;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, 8, {E, 2, false, 1.0f});
  randomize(layer, 71);
  std::vector<float> x(3 * D, 0.5f), y(3 * D);
  moe::MoeFfnWorkspace ws;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 3, D - 1}, {y.data(), 3, D - 1}, ws),
                      Catch::Contains("x has 7 columns but d_model = 8"));
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 3, D}, {y.data(), 2, D}, ws),
                      Catch::Contains("y is [2, 8] but must be [3, 8]"));
  x[1 * D + 3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 3, D}, {y.data(), 3, D}, ws),
                      Catch::Contains("router logit [token 1, expert 0] is"));
  x[1 * D + 3] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 3, D}, {y.data(), 3, D}, ws),
                      Catch::Contains("NaN or Inf"));
  REQUIRE_THROWS_WITH(
      (moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>(D, 8, {E, 5, false, 1.0f})),
      Catch::Contains("top_k = 5"));
  REQUIRE_THROWS_WITH(
      (moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>(0, 8, {E, 1, false, 1.0f})),
      Catch::Contains("d_model = 0"));
  using G = routing::GroupLimitedTopK;
  G g;
  g.num_experts = 6;
  g.top_k = 2;
  g.n_group = 4;
  REQUIRE_THROWS_WITH((moe::MoeFfn<G, experts::SwiGlu>(D, 8, g)),
                      Catch::Contains("does not divide"));
  using Shared = experts::UngatedSharedExperts<experts::SwiGlu>;
  REQUIRE_THROWS_WITH((moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Shared>(
                          D, 8, {E, 2, false, 1.0f}, Shared(1, D + 1, 8))),
                      Catch::Contains("shared experts have d_model = 9"));
}

TEST_CASE("In-place forward (y is x) gives the out-of-place result", "[layers][properties]") {
  Index const D = 16, T = 70;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, experts::GatedSharedExperts<experts::SwiGlu>>
      layer(D, 8, {4, 2, false, 1.0f}, experts::GatedSharedExperts<experts::SwiGlu>(1, D, 8));
  randomize(layer, 81);
  auto x = test::random_vector(T * D, 82);
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  moe::ThreadPool pool(2);
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
  layer.forward({x.data(), T, D}, {x.data(), T, D}, ws, {nullptr, &pool});
  REQUIRE(x == y);
}

TEST_CASE("Routing controls pass through the layer", "[layers][controls]") {
  Index const D = 16, E = 8, T = 30;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, 8, {E, 2, true, 1.0f});
  randomize(layer, 91);
  auto x = test::random_vector(T * D, 92);
  std::vector<float> y(x.size());
  std::vector<std::uint8_t> mask(E, 1);
  mask[0] = mask[3] = 0;
  routing::RoutingControls c;
  c.expert_mask = mask;
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {&c, nullptr});
  REQUIRE(ws.plan.expert_rows(0) == 0);
  REQUIRE(ws.plan.expert_rows(3) == 0);
  // Reference: the same routing with experts 0 and 3 removed from the softmax.
  auto want = ref::layer_forward(layer, {x.data(), T, D},
                                 ref::softmax_top_k(ws.logits_view(), 2, true, 1.0));
  REQUIRE(test::max_rel_diff(y.data(), want) < 2e-5);
}

TEST_CASE("MoeFfn composes with an archetype router that only has what the concept names",
          "[layers][concepts]") {
  // Proves the layer uses nothing beyond RouterPolicy: always routes token t to expert t % E.
  struct ArchetypeRouter {
    Index expert_count() const { return 3; }
    Index slots_per_token() const { return 1; }
    void validate() const {}
    void select(ConstMatrixView<float> logits, moe::Selection& sel) const {
      sel.reset(logits.rows, 1, 3);
      for (Index t = 0; t < logits.rows; ++t) {
        sel.expert[t] = static_cast<moe::ExpertId>(t % 3);
        sel.weight[t] = 1.0f;
      }
    }
  };
  static_assert(moe::RouterPolicy<ArchetypeRouter>);
  moe::MoeFfn<ArchetypeRouter, experts::SwiGlu> layer(8, 8, ArchetypeRouter{});
  randomize(layer, 95);
  ref::Routing r;
  for (int t = 0; t < 7; ++t) r.push_back({{t % 3, 1.0}});
  check_against_reference(layer, 7, [&](auto) { return r; });
}

TEST_CASE("Packed weights give the unpacked result, and stale packs are never used",
          "[layers][packing]") {
  Index const D = 40, F = 24, E = 6, T = 90;
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(D, F, {E, 2, false, 1.0f},
                                                               Sh(1, D, 20));
  randomize(layer, 101);
  auto x = test::random_vector(T * D, 102);
  std::vector<float> plain(x.size()), packed(x.size()), after(x.size());
  moe::MoeFfnWorkspace ws;
  moe::ThreadPool pool(2);
  layer.forward({x.data(), T, D}, {plain.data(), T, D}, ws, {nullptr, &pool});
  layer.pack_weights();
  REQUIRE(layer.experts().packed());
  layer.forward({x.data(), T, D}, {packed.data(), T, D}, ws, {nullptr, &pool});
  auto want = ref::layer_forward(layer, {x.data(), T, D}, test::routing_of(ws.selection));
  REQUIRE(test::max_rel_diff(packed.data(), want) < 2e-5);
  for (std::size_t i = 0; i < plain.size(); ++i)
    REQUIRE(packed[i] == Approx(plain[i]).margin(1e-6));
  // Changing a weight after packing: while the edit is open the pack is not used (the layer
  // packs per call and sees the write); when it closes, the pack is rebuilt from the new weights.
  {
    auto const edit = layer.experts().edit();
    edit.down_proj(0)(0, 0) += 1.0f;
    REQUIRE_FALSE(layer.experts().packed());
    layer.forward({x.data(), T, D}, {after.data(), T, D}, ws, {nullptr, &pool});
    auto want2 = ref::layer_forward(layer, {x.data(), T, D}, test::routing_of(ws.selection));
    REQUIRE(test::max_rel_diff(after.data(), want2) < 2e-5);
  }
  REQUIRE(layer.experts().packed());
  std::vector<float> repacked(x.size());
  layer.forward({x.data(), T, D}, {repacked.data(), T, D}, ws, {nullptr, &pool});
  REQUIRE(repacked == after);  // the rebuilt pack holds the edited weight
  // Reading the weights through a non-const layer never touches the pack.
  REQUIRE(layer.experts().down_proj(0)(0, 0) == std::as_const(layer).experts().down_proj(0)(0, 0));
  REQUIRE(layer.experts().packed());
  // Training through packed weights gives the same gradients as through unpacked ones.
  layer.pack_weights();
  auto copy = layer;
  auto const copy_edit = copy.experts().edit();  // the copy runs unpacked while this is open
  auto const copy_shared_edit = copy.shared_experts().bank().edit();
  REQUIRE(layer.experts().packed());
  REQUIRE_FALSE(copy.experts().packed());
  std::vector<float> dy = test::random_vector(T * D, 103), dx1(x.size()), dx2(x.size()),
                     y(x.size());
  moe::MoeFfnWorkspace w1, w2;
  layer.forward_train({x.data(), T, D}, {y.data(), T, D}, w1);
  copy.forward_train({x.data(), T, D}, {y.data(), T, D}, w2);
  auto g1 = layer.make_gradients();
  auto g2 = copy.make_gradients();
  layer.backward(w1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
  copy.backward(w2, {dy.data(), T, D}, {dx2.data(), T, D}, g2);
  for (std::size_t i = 0; i < dx1.size(); ++i) REQUIRE(dx1[i] == Approx(dx2[i]).margin(1e-5));
}

TEST_CASE("bf16-packed weights: inference equals a double forward of the bf16-rounded operands",
          "[layers][packing][bf16]") {
  // F and the shared F are multiples of the panel width, so every projection (gate+up and down,
  // routed and shared) multiplies bf16 panels; with AVX512-BF16 the layer rounds x and m to
  // bf16 pairs once per forward (MoeFfnWorkspace::x_pairs, act_pairs, shared_act_pairs).
  Index const np = moe::kernels::panel_width();
  Index const D = 70, F = 2 * np, E = 5, T = 37;
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(D, F, {E, 2, true, 1.0f},
                                                               Sh(1, D, np));
  randomize(layer, 121);
  layer.pack_weights(experts::WeightFormat::kBf16);
  auto x = test::random_vector(T * D, 122);
  ConstMatrixView<float> xv(x.data(), T, D);
  std::vector<float> y1(x.size()), y2(x.size());
  moe::MoeFfnWorkspace ws1, ws2;
  moe::ThreadPool pool(2);
  layer.forward(xv, {y1.data(), T, D}, ws1);
  layer.forward(xv, {y2.data(), T, D}, ws2, {nullptr, &pool});
  REQUIRE(y1 == y2);  // bitwise for 1 and 2 threads
  bool const dp = moe::kernels::bf16_dot_products();
  REQUIRE(ws1.x_pairs.size() == static_cast<std::size_t>(dp ? T * ((D + 1) / 2) : 0));
  REQUIRE(ws1.routed.act_pairs.size() == static_cast<std::size_t>(dp ? 2 * T * (F / 2) : 0));
  auto const r = test::routing_of(ws1.selection);
  auto const& cl = std::as_const(layer);
  auto const spec = ref::layer_forward(cl, xv, r, {true, dp});
  auto const exact = ref::layer_forward(cl, xv, r);
  // fp32 accumulation against double (an m whose fp32 and double values round to different
  // bf16 neighbours would move y by one of F terms at 2^-8; none does with this seed).
  double const to_spec = test::max_rel_diff(y1.data(), spec);
  double const to_exact = test::max_rel_diff(y1.data(), exact);
  INFO("to_spec " << to_spec << " to_exact " << to_exact);
  REQUIRE(to_spec < 5e-5);
  REQUIRE(to_exact > 20 * to_spec);  // the rounding model explains the bf16 error
}

TEST_CASE("discard_master_weights: inference unchanged, every use of the fp32 weights refused",
          "[layers][packing]") {
  Index const np = moe::kernels::panel_width();
  Index const D = 64, F = 2 * np, E = 5, T = 33;  // q8_0 blocks: 32 | D and 32 | F
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh>;
  moe::ThreadPool pool(2);
  auto x = test::random_vector(T * D, 132);
  ConstMatrixView<float> const xv(x.data(), T, D);
  for (auto format :
       {experts::WeightFormat::kF32, experts::WeightFormat::kBf16, experts::WeightFormat::kQ8_0}) {
    INFO("format " << experts::name(format));
    Layer layer(D, F, {E, 2, true, 1.0f}, Sh(1, D, F));
    randomize(layer, 131);
    REQUIRE_FALSE(layer.can_discard_master_weights());  // not packed yet
    REQUIRE_THROWS_AS(layer.discard_master_weights(), moe::Error);
    layer.pack_weights(format);
    REQUIRE(layer.can_discard_master_weights());
    std::vector<float> y1(x.size()), y2(x.size()), y3(x.size()), t1(x.size()), t2(x.size());
    moe::MoeFfnWorkspace ws, wt1, wt2;
    layer.forward(xv, {y1.data(), T, D}, ws, {nullptr, &pool});
    layer.forward_train(xv, {t1.data(), T, D}, wt1);
    layer.discard_master_weights();
    REQUIRE_FALSE(layer.experts().has_master_weights());
    REQUIRE_FALSE(layer.shared_experts().bank().has_master_weights());
    layer.forward(xv, {y2.data(), T, D}, ws, {nullptr, &pool});
    layer.forward(xv, {y3.data(), T, D}, ws);
    REQUIRE(y2 == y1);  // bit for bit, 2 threads and 1
    REQUIRE(y3 == y1);
    auto const& cl = std::as_const(layer);
    REQUIRE_THROWS_AS(cl.experts().in_proj(0), moe::Error);
    REQUIRE_THROWS_AS(cl.experts().down_proj(0), moe::Error);
    REQUIRE_THROWS_AS(cl.experts().parameters(), moe::Error);
    REQUIRE_THROWS_AS(cl.shared_experts().bank().up_proj(0), moe::Error);
    REQUIRE_THROWS_AS(layer.experts().edit(), moe::Error);
    REQUIRE_THROWS_AS(layer.parameters(), moe::Error);
    REQUIRE_THROWS_AS(layer.pack_weights(format), moe::Error);
    if (format == experts::WeightFormat::kF32) {
      // fp32 panels are the exact weights: a training forward still runs (same result), and
      // the backward, which multiplies by the weights' transpose, is refused.
      layer.forward_train(xv, {t2.data(), T, D}, wt2);
      REQUIRE(t2 == t1);
      std::vector<float> dy = test::random_vector(T * D, 133), dx(x.size());
      auto g = layer.make_gradients();
      REQUIRE_THROWS_AS(layer.backward(wt2, {dy.data(), T, D}, {dx.data(), T, D}, g), moe::Error);
    } else {
      REQUIRE_THROWS_AS(layer.forward_train(xv, {t2.data(), T, D}, wt2), moe::Error);
    }
    layer.discard_master_weights();  // idempotent
  }
  // GLU experts whose F splits a panel run their gate and up from the fp32 weights with an fp32
  // or bf16 pack: those are kept.
  Layer odd(D, np + 8, {E, 2, true, 1.0f}, Sh(1, D, np));
  randomize(odd, 134);
  odd.pack_weights(experts::WeightFormat::kBf16);
  REQUIRE_FALSE(odd.experts().pack_serves_inference());
  REQUIRE_FALSE(odd.can_discard_master_weights());
  REQUIRE_THROWS_AS(odd.experts().discard_master_weights(), moe::Error);
  REQUIRE(odd.experts().has_master_weights());
}

TEST_CASE("discard_master_weights keeps the experts' biases", "[experts][packing]") {
  experts::ExpertBank<experts::SwiGlu> bank(3, 16, 2 * moe::kernels::panel_width());
  bank.enable_biases();
  {
    auto ed = bank.edit();
    auto p = ed.parameters();
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<float>(i % 97) * 0.01f;
  }
  std::vector<float> const in_b(bank.in_bias(2).begin(), bank.in_bias(2).end());
  std::vector<float> const down_b(bank.down_bias(1).begin(), bank.down_bias(1).end());
  bank.pack(experts::WeightFormat::kBf16);
  bank.discard_master_weights();
  REQUIRE(std::vector<float>(bank.in_bias(2).begin(), bank.in_bias(2).end()) == in_b);
  REQUIRE(std::vector<float>(bank.down_bias(1).begin(), bank.down_bias(1).end()) == down_b);
  REQUIRE(bank.in_bias_data(0) != nullptr);
  bank.enable_biases();  // idempotent: the biases are kept
  REQUIRE(std::vector<float>(bank.in_bias(2).begin(), bank.in_bias(2).end()) == in_b);
}

TEST_CASE("EmptyWeights + pack_from: the pack of pack(), without ever holding fp32 weights",
          "[experts][packing]") {
  namespace ex = experts;
  using F_ = ex::WeightFormat;
  Index const np = moe::kernels::panel_width();
  Index const D = 64, F = 2 * np, E = 5, T = 29;  // 32 | D and 32 | F (q8_0, q4_0 blocks)
  using Sh = ex::GatedSharedExperts<ex::SwiGlu>;
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, ex::SwiGlu, Sh>;
  Layer a(D, F, {E, 2, true, 1.0f}, Sh(1, D, F));
  a.experts().enable_biases();
  randomize(a, 141);
  {
    auto ed = a.experts().edit();
    for (Index e = 0; e < E; ++e) {
      for (std::size_t i = 0; i < ed.in_bias(e).size(); ++i)
        ed.in_bias(e)[i] = 0.01f * static_cast<float>((e + 3 * static_cast<Index>(i)) % 7);
      for (std::size_t i = 0; i < ed.down_bias(e).size(); ++i)
        ed.down_bias(e)[i] = -0.02f * static_cast<float>((2 * e + static_cast<Index>(i)) % 5);
    }
  }
  // A format per expert, and stored blocks for some quantized projections (expert 3's gate
  // and down, not its up; all of expert 4): those are re-packed, the rest quantized.
  std::vector<ex::ExpertFormat> const formats = {{F_::kF32, F_::kF32},
                                                 {F_::kBf16, F_::kBf16},
                                                 {F_::kQ8_0, F_::kBf16},
                                                 {F_::kQ4_0, F_::kQ8_0},
                                                 {F_::kQ8_0, F_::kQ4_0}};
  auto rows_of = [](float const* w, Index rows, Index depth, F_ f) {
    moe::quant::Format const qf = ex::quant_format(f);
    Index const rb = moe::quant::row_bytes(qf, depth);
    std::vector<std::byte> out(static_cast<std::size_t>(rows * rb));
    for (Index r = 0; r < rows; ++r)
      moe::quant::quantize_row(qf, w + r * depth, depth, out.data() + r * rb);
    return out;
  };
  auto const& ca = std::as_const(a);
  std::vector<std::byte> const gate3 = rows_of(ca.experts().gate_proj(3).data, F, D, F_::kQ4_0);
  std::vector<std::byte> const down3 = rows_of(ca.experts().down_proj(3).data, D, F, F_::kQ8_0);
  std::vector<std::byte> const gate4 = rows_of(ca.experts().gate_proj(4).data, F, D, F_::kQ8_0);
  std::vector<std::byte> const up4 = rows_of(ca.experts().up_proj(4).data, F, D, F_::kQ8_0);
  std::vector<std::byte> const down4 = rows_of(ca.experts().down_proj(4).data, D, F, F_::kQ4_0);
  ex::StoredBlocks const stored = [&](Index e, ex::Projection p, F_ f) -> std::byte const* {
    if (e == 3 && p == ex::Projection::kGate && f == F_::kQ4_0) return gate3.data();
    if (e == 3 && p == ex::Projection::kDown && f == F_::kQ8_0) return down3.data();
    if (e == 4 && f == F_::kQ8_0 && p != ex::Projection::kDown)
      return p == ex::Projection::kGate ? gate4.data() : up4.data();
    if (e == 4 && p == ex::Projection::kDown && f == F_::kQ4_0) return down4.data();
    return nullptr;
  };
  a.experts().pack(formats, nullptr, stored);
  a.shared_experts().bank().pack(F_::kBf16);

  // b: the same layer built without fp32 expert weights.
  Layer b = [&] {
    ex::EmptyWeights scope;
    return Layer(D, F, {E, 2, true, 1.0f}, Sh(1, D, F));
  }();
  REQUIRE_FALSE(b.experts().has_master_weights());
  REQUIRE_FALSE(b.shared_experts().bank().has_master_weights());
  REQUIRE(Layer(D, F, {E, 2, true, 1.0f}, Sh(1, D, F)).experts().has_master_weights());
  std::copy(a.router_weight().data, a.router_weight().data + E * D, b.router_weight().data);
  std::copy(a.shared_experts().gate_weight().data, a.shared_experts().gate_weight().data + D,
            b.shared_experts().gate_weight().data);
  b.experts().enable_biases();
  {
    auto ed = b.experts().edit();  // biases only, before the pack
    for (Index e = 0; e < E; ++e) {
      std::copy(ca.experts().in_bias(e).begin(), ca.experts().in_bias(e).end(),
                ed.in_bias(e).begin());
      std::copy(ca.experts().down_bias(e).begin(), ca.experts().down_bias(e).end(),
                ed.down_bias(e).begin());
    }
    REQUIRE_THROWS_WITH(ed.in_proj(0), Catch::Contains("EmptyWeights"));
    REQUIRE_THROWS_AS(ed.parameters(), moe::Error);
  }
  std::atomic<int> in_reads{0}, down_reads{0};
  ex::ExpertSource const source{stored, [&](Index e, float* in, float* down) {
                                  if (in) {
                                    ++in_reads;
                                    std::copy_n(ca.experts().in_proj(e).data, 2 * F * D, in);
                                  }
                                  if (down) {
                                    ++down_reads;
                                    std::copy_n(ca.experts().down_proj(e).data, D * F, down);
                                  }
                                }};
  moe::ThreadPool pool(2);
  b.experts().pack_from(formats, source, &pool);
  REQUIRE(in_reads == 4);    // expert 4's in projection came from its blocks only
  REQUIRE(down_reads == 3);  // experts 3 and 4: stored down blocks
  ex::ExpertSource const shared_source{
      {}, [&](Index, float* in, float* down) {
        if (in) std::copy_n(ca.shared_experts().bank().in_proj(0).data, 2 * F * D, in);
        if (down) std::copy_n(ca.shared_experts().bank().down_proj(0).data, D * F, down);
      }};
  std::vector<ex::ExpertFormat> const bf16_one(1, {F_::kBf16, F_::kBf16});
  b.shared_experts().bank().pack_from(bf16_one, shared_source);
  for (Index e = 0; e < E; ++e) {
    auto const ra = a.experts().packed_record(e), rb = b.experts().packed_record(e);
    INFO("expert " << e);
    REQUIRE(std::equal(ra.begin(), ra.end(), rb.begin(), rb.end()));  // byte for byte
  }
  auto x = test::random_vector(T * D, 142);
  ConstMatrixView<float> const xv(x.data(), T, D);
  std::vector<float> ya(x.size()), yb(x.size()), yb1(x.size());
  moe::MoeFfnWorkspace ws;
  a.forward(xv, {ya.data(), T, D}, ws, {nullptr, &pool});
  b.forward(xv, {yb.data(), T, D}, ws, {nullptr, &pool});
  b.forward(xv, {yb1.data(), T, D}, ws);
  REQUIRE(yb == ya);
  REQUIRE(yb1 == ya);
  // Inference-only from the start: every use of fp32 weights is refused, with the reason.
  REQUIRE_THROWS_WITH(std::as_const(b).experts().in_proj(0), Catch::Contains("EmptyWeights"));
  REQUIRE_THROWS_AS(b.experts().edit(), moe::Error);  // packed: nothing to write
  REQUIRE_THROWS_AS(b.experts().pack(formats), moe::Error);
  REQUIRE_THROWS_AS(b.parameters(), moe::Error);
  REQUIRE_THROWS_WITH(a.experts().pack_from(formats, source), Catch::Contains("pack() them"));

  // Non-finite weights to be quantized: an error naming the expert; the bank stays unpacked.
  ex::ExpertBank<ex::SwiGlu> c = [&] {
    ex::EmptyWeights scope;
    return ex::ExpertBank<ex::SwiGlu>(E, D, F);
  }();
  ex::ExpertSource const nan_source{{}, [&](Index e, float* in, float* down) {
                                      if (in) std::fill_n(in, 2 * F * D, e == 2 ? NAN : 0.5f);
                                      if (down) std::fill_n(down, D * F, 0.25f);
                                    }};
  REQUIRE_THROWS_WITH(c.pack_from(formats, nan_source), Catch::Contains("expert 2's in"));
  REQUIRE_FALSE(c.packed());
  ex::ExpertSource const no_weights{stored, {}};
  REQUIRE_THROWS_WITH(c.pack_from(formats, no_weights), Catch::Contains("ExpertSource::weights"));
  std::vector<ex::ExpertFormat> const q8(static_cast<std::size_t>(E), {F_::kQ8_0, F_::kQ8_0});
  ex::ExpertSource const finite{{}, [&](Index, float* in, float* down) {
                                  if (in) std::fill_n(in, 2 * F * D, 0.5f);
                                  if (down) std::fill_n(down, D * F, 0.25f);
                                }};
  c.pack_from(q8, finite);
  REQUIRE(c.packed());
  // GLU experts whose F splits a panel read gate and up from fp32 weights in an fp32/bf16 pack:
  // a bank without them refuses those formats (quantized ones are fine).
  ex::ExpertBank<ex::SwiGlu> odd = [&] {
    ex::EmptyWeights scope;
    return ex::ExpertBank<ex::SwiGlu>(2, D, np + 8);
  }();
  std::vector<ex::ExpertFormat> const bf16_two(2, {F_::kBf16, F_::kBf16});
  REQUIRE_THROWS_WITH(odd.pack_from(bf16_two, nan_source), Catch::Contains("panel width"));
}

TEST_CASE("bf16-packed weights: inference within bf16 rounding, training stays exact",
          "[layers][packing][bf16]") {
  Index const D = 48, F = 40, E = 6, T = 60;
  using Sh = experts::UngatedSharedExperts<experts::GeluMlp>;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(D, F, {E, 2, true, 1.0f},
                                                               Sh(1, D, 24));
  randomize(layer, 111);
  auto x = test::random_vector(T * D, 112);
  std::vector<float> exact(x.size()), bf16(x.size()), train(x.size());
  moe::MoeFfnWorkspace ws;
  moe::ThreadPool pool(2);
  layer.forward({x.data(), T, D}, {exact.data(), T, D}, ws, {nullptr, &pool});
  layer.pack_weights(experts::WeightFormat::kBf16);
  REQUIRE(layer.experts().packed());
  REQUIRE(layer.experts().packed_format() == experts::WeightFormat::kBf16);
  layer.forward({x.data(), T, D}, {bf16.data(), T, D}, ws, {nullptr, &pool});
  // bf16 keeps 8 significant bits: relative error of a dot product about 2^-8 of its terms.
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < exact.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(bf16[i] - exact[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(exact[i])));
  }
  REQUIRE(err > 0.0);  // the bf16 path really ran
  REQUIRE(err < 2e-2 * scale);
  layer.forward_train({x.data(), T, D}, {train.data(), T, D}, ws, {nullptr, &pool});
  for (std::size_t i = 0; i < exact.size(); ++i) REQUIRE(train[i] == Approx(exact[i]).margin(1e-6));
}
