// SPDX-License-Identifier: Apache-2.0
// MoeFfn backward against central finite differences of a double-precision twin of the layer,
// for every parameter group, routing policy, expert kind, shared-expert variant and Default-MoE
// mode; plus the analytic cases of ALGORITHMS.md and determinism across threads.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <string>

#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/capacity.hpp"
#include "moe/routing/expert_choice.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/one_per_group_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_sigmoid.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "moe/routing/top_p.hpp"
#include "support/double_model.hpp"
#include "support/helpers.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace routing = moe::routing;
namespace experts = moe::experts;

namespace {

using RouteFn = std::function<ref::Routing(ConstMatrixView<double>)>;

std::vector<double> softmax_scores(std::vector<double> const& z) { return ref::softmax(z); }
std::vector<double> sigmoid_scores(std::vector<double> const& z) {
  std::vector<double> s(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) s[i] = ref::sigmoid(z[i]);
  return s;
}

void require_close(float analytic, double fd, char const* what, Index i) {
  INFO(what << "[" << i << "]: analytic " << analytic << ", finite difference " << fd);
  REQUIRE(std::fabs(analytic - fd) <= 2e-4 + 2e-3 * std::fabs(fd));
}

/// Runs forward_train + backward and compares every gradient with finite differences.
template <class Layer>
void check_gradients(Layer& layer, Index T, RouteFn route, bool sigmoid = false,
                     moe::ThreadPool* pool = nullptr) {
  Index const D = layer.d_model();
  auto xf = test::random_vector(T * D, 501, -1.0f, 1.0f);
  auto dyf = test::random_vector(T * D, 502, -1.0f, 1.0f);
  ref::DoubleModel m;
  m.D = D;
  m.E = layer.num_experts();
  auto wr = layer.router_weight();
  m.router.assign(wr.data, wr.data + wr.rows * wr.cols);
  m.router_bias.assign(layer.router_bias().begin(), layer.router_bias().end());
  m.experts = ref::to_double(layer.experts());
  if constexpr (Layer::Shared::has_experts) {
    m.shared = ref::to_double(layer.shared_experts().bank());
    if constexpr (Layer::Shared::gated) {
      auto g = layer.shared_experts().gate_weight();
      m.gate.assign(g.data, g.data + g.rows * g.cols);
    }
  }
  if (layer.default_moe().enabled) {
    auto d = layer.default_outputs();
    m.defaults.assign(d.data, d.data + d.rows * d.cols);
  }
  m.route = std::move(route);
  m.scores = sigmoid ? sigmoid_scores : softmax_scores;
  m.scale_input = moe::routing::detail::scales_input(layer.router());

  std::vector<float> y(xf.size()), dx(xf.size());
  moe::MoeFfnWorkspace ws;
  layer.forward_train({xf.data(), T, D}, {y.data(), T, D}, ws, {nullptr, pool});
  // The layer routes as the double twin does (no near-ties at these sizes).
  {
    std::vector<double> z(ws.logits.begin(), ws.logits.end());
    auto want = m.route(ConstMatrixView<double>(z.data(), T, layer.num_experts()));
    test::require_same_routing(test::routing_of(ws.selection), want, 1e-4);
  }
  auto grads = layer.make_gradients();
  layer.backward(ws, {dyf.data(), T, D}, {dx.data(), T, D}, grads, pool);

  std::vector<double> x(xf.begin(), xf.end()), dy(dyf.begin(), dyf.end());
  for (Index i = 0; i < static_cast<Index>(m.router.size()); ++i) {
    require_close(grads.router_weight[i], ref::central_difference(m, m.router, i, x, dy, T),
                  "router.weight", i);
  }
  REQUIRE(grads.router_bias.size() == m.router_bias.size());
  for (Index i = 0; i < static_cast<Index>(m.router_bias.size()); ++i) {
    require_close(grads.router_bias[i], ref::central_difference(m, m.router_bias, i, x, dy, T),
                  "router.bias", i);
  }
  auto ge = grads.experts.parameters();
  for (Index i = 0; i < static_cast<Index>(ge.size()); ++i) {
    require_close(ge[i], ref::central_difference(m, m.experts.params, i, x, dy, T), "experts", i);
  }
  if constexpr (Layer::Shared::has_experts) {
    auto gs = grads.shared.bank().parameters();
    for (Index i = 0; i < static_cast<Index>(gs.size()); ++i) {
      require_close(gs[i], ref::central_difference(m, m.shared.params, i, x, dy, T),
                    "shared_experts", i);
    }
    if constexpr (Layer::Shared::gated) {
      auto gg = grads.shared.gate_weight();
      for (Index i = 0; i < static_cast<Index>(m.gate.size()); ++i) {
        require_close(gg.data[i], ref::central_difference(m, m.gate, i, x, dy, T),
                      "shared_experts.gate", i);
      }
    }
  }
  for (Index i = 0; i < T * D; ++i)
    require_close(dx[i], ref::central_difference(m, x, i, x, dy, T), "dx", i);
}

}  // namespace

TEST_CASE("Backward matches finite differences for every routing policy", "[training][grad]") {
  Index const D = 6, F = 5, E = 4, T = 7;
  SECTION("softmax top-k without renormalisation (Qwen, OLMoE)") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, false, 1.0f});
    test::randomize_ffn(layer, 1);
    check_gradients(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
  }
  SECTION("softmax top-k, renormalised and scaled") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, true, 1.7f});
    test::randomize_ffn(layer, 2);
    check_gradients(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.7); });
  }
  SECTION("top-k of the biased logits then softmax (gpt-oss router with its bias)") {
    moe::MoeFfn<routing::TopKSoftmax, experts::SwiGlu> layer(D, F, {E, 2});
    test::randomize_ffn(layer, 16);
    REQUIRE_FALSE(layer.has_router_bias());
    layer.enable_router_bias();
    auto const names = [&] {
      std::vector<std::string> n;
      for (auto const& p : layer.parameters()) n.emplace_back(p.name);
      return n;
    }();
    REQUIRE(names.size() >= 3);
    REQUIRE(names[1] == "router.bias");
    moe::fill_uniform(layer.router_bias(), -0.8f, 0.8f, 17);
    check_gradients(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
  }
  SECTION("top-k then softmax (Mixtral)") {
    moe::MoeFfn<routing::TopKSoftmax, experts::SwiGlu> layer(D, F, {E, 2});
    test::randomize_ffn(layer, 3);
    check_gradients(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
  }
  SECTION("sigmoid, bias, groups, renormalised, scaled (DeepSeek-V3)") {
    routing::GroupLimitedTopK r;
    r.num_experts = 8;
    r.top_k = 3;
    r.n_group = 4;
    r.topk_group = 2;
    r.scale = 2.5f;
    r.bias = test::random_vector(8, 7, -0.3f, 0.3f);
    auto bias = r.bias;
    moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu> layer(D, F, r);
    test::randomize_ffn(layer, 4);
    check_gradients(
        layer, T,
        [bias](auto z) { return ref::group_limited(z, 3, 4, 2, true, 2.5, true, bias, true); },
        true);
  }
  SECTION("softmax, group max, unnormalised, scaled (DeepSeek-V2)") {
    routing::GroupLimitedTopK r;
    r.num_experts = 8;
    r.top_k = 3;
    r.n_group = 4;
    r.topk_group = 2;
    r.normalize = false;
    r.scale = 1.5f;
    r.scoring = routing::ScoreFunction::kSoftmax;
    r.group_score = routing::GroupScore::kMax;
    moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu> layer(D, F, r);
    test::randomize_ffn(layer, 11);
    check_gradients(layer, T, [](auto z) {
      return ref::group_limited(z, 3, 4, 2, false, 1.5, false, {}, false);
    });
  }
  SECTION("sigmoid, bias, renormalised without epsilon (MiniMax-M2)") {
    routing::GroupLimitedTopK r;
    r.num_experts = 8;
    r.top_k = 3;
    r.norm_epsilon = 0.0f;
    r.bias = test::random_vector(8, 12, -0.3f, 0.3f);
    auto bias = r.bias;
    moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu> layer(D, F, r);
    test::randomize_ffn(layer, 12);
    check_gradients(
        layer, T,
        [bias](auto z) { return ref::group_limited(z, 3, 1, 1, true, 1.0, true, bias, true, 0.0); },
        true);
  }
  for (float const norm_min : {1e-12f, 0.95f}) {
    // ERNIE 4.5: softmax, bias added to the probabilities, the sum clamped to >= norm_min (0.95:
    // above the top-3 sum of most tokens, so the clamped branch is differentiated too).
    DYNAMIC_SECTION("softmax, bias on probabilities, clamped renormalisation, norm_min "
                    << norm_min) {
      routing::GroupLimitedTopK r;
      r.num_experts = 8;
      r.top_k = 3;
      r.scoring = routing::ScoreFunction::kSoftmax;
      r.norm_epsilon = 0.0f;
      r.norm_min = norm_min;
      r.bias = test::random_vector(8, 13, -0.05f, 0.05f);
      auto bias = r.bias;
      moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu> layer(D, F, r);
      test::randomize_ffn(layer, 13);
      check_gradients(layer, T, [bias, norm_min](auto z) {
        return ref::group_limited(z, 3, 1, 1, true, 1.0, false, bias, true, 0.0, norm_min);
      });
    }
  }
  for (bool const scale_input : {true, false}) {
    DYNAMIC_SECTION("top-k of the logits, sigmoid weights "
                    << (scale_input ? "on the experts' inputs (Llama 4)" : "on the outputs")) {
      moe::MoeFfn<routing::TopKSigmoid, experts::SwiGlu> layer(D, F, {8, 2, scale_input});
      test::randomize_ffn(layer, 14);
      auto const route = [](auto z) {
        return ref::group_limited(z, 2, 1, 1, false, 1.0, true, {}, true);
      };
      check_gradients(layer, T, route, true);
      // The value too: sum_t <dy_t, y_t> of the inference forward against the double twin.
      auto xf = test::random_vector(T * D, 601, -1.0f, 1.0f);
      auto dyf = test::random_vector(T * D, 602, -1.0f, 1.0f);
      std::vector<float> y(xf.size());
      moe::MoeFfnWorkspace ws;
      layer.forward({xf.data(), T, D}, {y.data(), T, D}, ws);
      ref::DoubleModel m;
      m.D = D;
      m.E = 8;
      auto wr = layer.router_weight();
      m.router.assign(wr.data, wr.data + wr.rows * wr.cols);
      m.experts = ref::to_double(layer.experts());
      m.route = route;
      m.scale_input = scale_input;
      double got = 0.0;
      for (std::size_t i = 0; i < y.size(); ++i) got += static_cast<double>(dyf[i]) * y[i];
      std::vector<double> const x(xf.begin(), xf.end()), dy(dyf.begin(), dyf.end());
      double const want = m.objective(x, dy, T);
      REQUIRE(got == Approx(want).epsilon(1e-5));
      m.scale_input = !scale_input;  // the other form is a different function
      REQUIRE(std::fabs(m.objective(x, dy, T) - want) > 1e-3 * std::fabs(want));
    }
  }
  SECTION("at most one expert per group") {
    moe::MoeFfn<routing::OnePerGroupTopK, experts::SwiGlu> layer(
        D, F, {8, 2, 4, true, 1.0f, routing::ScoreFunction::kSoftmax});
    test::randomize_ffn(layer, 5);
    check_gradients(layer, T, [](auto z) { return ref::one_per_group(z, 2, 4, true); });
  }
  SECTION("expert choice") {
    moe::MoeFfn<routing::ExpertChoice, experts::SwiGlu> layer(D, F, {E, 1.0f, 3});
    test::randomize_ffn(layer, 6);
    Index const C = layer.router().capacity(T);
    check_gradients(layer, T, [C](auto z) { return ref::expert_choice(z, C); });
  }
  SECTION("top-p") {
    moe::MoeFfn<routing::TopP, experts::SwiGlu> layer(D, F, {E, 0.6f, 0, false});
    test::randomize_ffn(layer, 8);
    check_gradients(layer, T, [](auto z) { return ref::top_p(z, 0.6); });
  }
  SECTION("capacity drops with renormalised weights") {
    using R = routing::WithCapacity<routing::SoftmaxTopK>;
    moe::MoeFfn<R, experts::SwiGlu> layer(D, F, R{{E, 2, true, 1.0f}, 0.6f, 1, false});
    test::randomize_ffn(layer, 9);
    Index const C = layer.router().capacity(T);
    check_gradients(layer, T, [C](auto z) {
      Index dropped = 0;
      return ref::with_capacity(ref::softmax_top_k(z, 2, true, 1.0), 4, C, false, &dropped);
    });
  }
  SECTION("capacity drops around top-k then softmax") {
    using R = routing::WithCapacity<routing::TopKSoftmax>;
    moe::MoeFfn<R, experts::SwiGlu> layer(D, F, R{{E, 2}, 0.6f, 1, false});
    test::randomize_ffn(layer, 10);
    Index const C = layer.router().capacity(T);
    check_gradients(layer, T, [C](auto z) {
      Index dropped = 0;
      return ref::with_capacity(ref::softmax_top_k(z, 2, true, 1.0), 4, C, false, &dropped);
    });
  }
}

TEMPLATE_TEST_CASE("Backward matches finite differences for every expert kind", "[training][grad]",
                   experts::GeGlu, experts::GeGluErf, experts::ReluMlp, experts::GeluMlp,
                   experts::SiluMlp, experts::GeluTanhMlp) {
  moe::MoeFfn<routing::SoftmaxTopK, TestType> layer(5, 7, {4, 2, false, 1.0f});
  test::randomize_ffn(layer, 21);
  check_gradients(layer, 6, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
}

TEST_CASE("Backward matches finite differences when an expert's rows span several row items",
          "[training][grad]") {
  // Top-1 of 2 experts over 600 tokens: each expert gets about 300 rows, more than one row-phase
  // work item takes (detail::kBackwardRows = 256), so its rows are split into chunks.
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(4, 3, {2, 1, false, 1.0f});
  test::randomize_ffn(layer, 41);
  moe::ThreadPool pool(2);
  check_gradients(
      layer, 600, [](auto z) { return ref::softmax_top_k(z, 1, false, 1.0); }, false, &pool);
}

TEST_CASE("Backward matches finite differences with shared experts", "[training][grad]") {
  SECTION("two ungated shared experts") {
    using Sh = experts::UngatedSharedExperts<experts::SwiGlu>;
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(6, 5, {4, 2, true, 1.0f},
                                                                 Sh(2, 6, 4));
    test::randomize_ffn(layer, 31);
    check_gradients(layer, 7, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
  }
  SECTION("sigmoid-gated shared experts, two threads") {
    using Sh = experts::GatedSharedExperts<experts::GeluMlp>;
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(6, 5, {4, 2, false, 1.0f},
                                                                 Sh(2, 6, 3));
    test::randomize_ffn(layer, 32);
    moe::ThreadPool pool(2);
    check_gradients(
        layer, 70, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); }, false, &pool);
  }
}

TEST_CASE("Backward matches finite differences with expert biases and the clamped GLU",
          "[training][grad][gpt_oss]") {
  auto biased = [](auto& bank, std::uint64_t seed) {
    bank.enable_biases();
    moe::fill_uniform(bank.edit().parameters(), -0.5f, 0.5f, seed);
  };
  SECTION("gpt-oss: router bias, biased clamped experts (limit inside the values' range)") {
    // D 6, F 5 (a partial panel), top-2 of 4 with softmax over the two logits; limit 0.3 so some
    // gates and ups are clamped on both sides and some are not.
    moe::MoeFfn<routing::TopKSoftmax, experts::ClampedSwiGlu> layer(6, 5, {4, 2});
    test::randomize_ffn(layer, 61);
    layer.enable_router_bias();
    moe::fill_uniform(layer.router_bias(), -0.8f, 0.8f, 62);
    biased(layer.experts(), 63);
    layer.experts().set_glu_clamp({1.702f, 0.3f});
    moe::ThreadPool pool(2);
    check_gradients(
        layer, 9, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); }, false, &pool);
  }
  SECTION("biased routed and shared experts (ERNIE 4.5 use_bias), a plain MLP too") {
    using Sh = experts::UngatedSharedExperts<experts::SwiGlu>;
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(6, 5, {4, 2, true, 1.0f},
                                                                 Sh(2, 6, 3));
    test::randomize_ffn(layer, 64);
    biased(layer.experts(), 65);
    biased(layer.shared_experts().bank(), 66);
    check_gradients(layer, 7, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
    moe::MoeFfn<routing::SoftmaxTopK, experts::GeluMlp> mlp(5, 7, {4, 2, false, 1.0f});
    test::randomize_ffn(mlp, 67);
    biased(mlp.experts(), 68);
    check_gradients(mlp, 6, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
  }
}

TEST_CASE("Default MoE: dense router gradient, both modes, EMA update", "[training][default_moe]") {
  Index const D = 6, F = 5, E = 4, T = 7;
  for (auto mode : {moe::DefaultMoe::Mode::kGradOnly, moe::DefaultMoe::Mode::kForward}) {
    INFO("mode " << (mode == moe::DefaultMoe::Mode::kForward ? "forward" : "grad-only"));
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, false, 1.0f});
    test::randomize_ffn(layer, 41);
    layer.default_moe() = {true, 0.9f, mode};
    auto d = layer.default_outputs();
    moe::fill_uniform(std::span<float>(d.data, static_cast<std::size_t>(E * D)), -1.0f, 1.0f, 42);
    check_gradients(layer, T, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
  }
  // Values: grad-only returns exactly the sparse output; forward adds sum p_i d_i.
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, F, {E, 2, false, 1.0f});
  test::randomize_ffn(layer, 43);
  auto x = test::random_vector(T * D, 44);
  std::vector<float> plain(x.size()), grad_only(x.size()), fwd(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), T, D}, {plain.data(), T, D}, ws);
  auto d = layer.default_outputs();
  moe::fill_uniform(std::span<float>(d.data, static_cast<std::size_t>(E * D)), -1.0f, 1.0f, 45);
  std::vector<float> d0(d.data, d.data + E * D);
  layer.default_moe() = {true, 0.5f, moe::DefaultMoe::Mode::kGradOnly};
  layer.forward_train({x.data(), T, D}, {grad_only.data(), T, D}, ws);
  // Equal up to rounding: inference applies the routing weight in the down projection's
  // epilogue, a training forward in the combine (it keeps the unweighted expert outputs).
  for (std::size_t i = 0; i < plain.size(); ++i) {
    REQUIRE(grad_only[i] == Approx(plain[i]).epsilon(1e-5).margin(1e-7));
  }
  // EMA: d_e <- 0.5 d_e + 0.5 mean of expert e's outputs; experts without rows keep d_e.
  for (Index e = 0; e < E; ++e) {
    Index const n = ws.plan.expert_rows(e);
    for (Index c = 0; c < D; ++c) {
      double mean = 0.0;
      for (Index r = ws.plan.expert_offsets[e]; r < ws.plan.expert_offsets[e + 1]; ++r) {
        mean += ws.routed.out[r * D + c];
      }
      double const want =
          n == 0 ? d0[e * D + c] : 0.5 * d0[e * D + c] + 0.5 * mean / static_cast<double>(n);
      REQUIRE(d(e, c) == Approx(want).margin(1e-6));
    }
  }
  std::copy(d0.begin(), d0.end(), d.data);
  layer.default_moe() = {true, 0.5f, moe::DefaultMoe::Mode::kForward};
  layer.forward_train({x.data(), T, D}, {fwd.data(), T, D}, ws);
  for (Index t = 0; t < T; ++t) {
    for (Index c = 0; c < D; ++c) {
      double extra = 0.0;
      for (Index e = 0; e < E; ++e) {
        bool chosen = false;
        for (Index s = 0; s < 2; ++s) chosen = chosen || ws.selection.expert[t * 2 + s] == e;
        if (!chosen) extra += ws.selection.scores[t * E + e] * d0[e * D + c];
      }
      REQUIRE(fwd[t * D + c] == Approx(plain[t * D + c] + extra).margin(1e-5));
    }
  }
  // Inference ignores Default MoE.
  std::vector<float> inf(x.size());
  layer.forward({x.data(), T, D}, {inf.data(), T, D}, ws);
  REQUIRE(inf == plain);
}

TEST_CASE("Default MoE vanishes when every expert is selected (k = E)", "[training][default_moe]") {
  Index const D = 6, E = 3, T = 5;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> a(D, 4, {E, E, false, 1.0f}),
      b(D, 4, {E, E, false, 1.0f});
  test::randomize_ffn(a, 51);
  test::randomize_ffn(b, 51);
  b.default_moe() = {true, 0.9f, moe::DefaultMoe::Mode::kForward};
  auto d = b.default_outputs();
  moe::fill_uniform(std::span<float>(d.data, static_cast<std::size_t>(E * D)), -1.0f, 1.0f, 52);
  auto x = test::random_vector(T * D, 53);
  auto dy = test::random_vector(T * D, 54);
  std::vector<float> ya(x.size()), yb(x.size()), dxa(x.size()), dxb(x.size());
  moe::MoeFfnWorkspace wa, wb;
  a.forward_train({x.data(), T, D}, {ya.data(), T, D}, wa);
  b.forward_train({x.data(), T, D}, {yb.data(), T, D}, wb);
  REQUIRE(ya == yb);
  auto ga = a.make_gradients();
  auto gb = b.make_gradients();
  a.backward(wa, {dy.data(), T, D}, {dxa.data(), T, D}, ga);
  b.backward(wb, {dy.data(), T, D}, {dxb.data(), T, D}, gb);
  REQUIRE(ga.router_weight == gb.router_weight);
  REQUIRE(dxa == dxb);
}

TEST_CASE(
    "Renormalised routing gives unselected logits exactly zero gradient; plain softmax does not",
    "[training][grad]") {
  Index const D = 6, E = 5, T = 4;
  auto x = test::random_vector(T * D, 61);
  auto dy = test::random_vector(T * D, 62);
  for (bool normalize : {true, false}) {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(D, 4, {E, 2, normalize, 1.0f});
    test::randomize_ffn(layer, 63);
    std::vector<float> y(x.size()), dx(x.size());
    moe::MoeFfnWorkspace ws;
    layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
    auto g = layer.make_gradients();
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, g);
    for (Index t = 0; t < T; ++t) {
      // u = dL/dw for the two selected experts; p = scores.
      float const* p = ws.selection.scores.data() + t * E;
      double pu = 0.0;
      for (Index s = 0; s < 2; ++s)
        pu += p[ws.selection.expert[t * 2 + s]] * ws.router_grads.dweight[t * 2 + s];
      for (Index e = 0; e < E; ++e) {
        bool chosen = ws.selection.expert[t * 2] == e || ws.selection.expert[t * 2 + 1] == e;
        if (chosen) continue;
        float const dz = ws.router_grads.dlogits[t * E + e];
        if (normalize) {
          REQUIRE(dz == 0.0f);
        } else {
          REQUIRE(dz == Approx(-p[e] * pu).margin(1e-6));  // -p_j <p_A, u_A>
        }
      }
    }
  }
}

TEST_CASE("Backward is bitwise identical for 1 and 2 threads", "[training][determinism]") {
  Index const D = 32, T = 150;
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(D, 24, {8, 2, true, 1.0f},
                                                               Sh(1, D, 16));
  test::randomize_ffn(layer, 71);
  layer.default_moe() = {true, 0.9f, moe::DefaultMoe::Mode::kGradOnly};
  auto x = test::random_vector(T * D, 72);
  auto dy = test::random_vector(T * D, 73);
  moe::ThreadPool pool(2);
  std::vector<float> y1(x.size()), y2(x.size()), dx1(x.size()), dx2(x.size());
  auto copy = layer;
  moe::MoeFfnWorkspace w1, w2;
  layer.forward_train({x.data(), T, D}, {y1.data(), T, D}, w1);
  copy.forward_train({x.data(), T, D}, {y2.data(), T, D}, w2, {nullptr, &pool});
  auto g1 = layer.make_gradients();
  auto g2 = copy.make_gradients();
  layer.backward(w1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
  copy.backward(w2, {dy.data(), T, D}, {dx2.data(), T, D}, g2, &pool);
  REQUIRE(y1 == y2);
  REQUIRE(dx1 == dx2);
  auto a = g1.groups();
  auto b = g2.groups();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    REQUIRE(std::memcmp(a[i].values.data(), b[i].values.data(), a[i].values.size() * 4) == 0);
  }
}

TEST_CASE("Parameters and gradients list the same buffers; misuse is reported", "[training]") {
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh> layer(8, 4, {4, 2, false, 1.0f},
                                                               Sh(1, 8, 6));
  auto params = layer.parameters();
  auto grads = layer.make_gradients();
  auto groups = grads.groups();
  REQUIRE(params.size() == 4);
  REQUIRE(groups.size() == 4);
  for (std::size_t i = 0; i < params.size(); ++i) {
    REQUIRE(params[i].name == groups[i].name);
    REQUIRE(params[i].values.size() == groups[i].values.size());
  }
  REQUIRE(params[0].name == "router.weight");
  REQUIRE(params[0].values.data() == layer.router_weight().data);
  std::vector<float> x(16, 0.1f), dy(16, 0.1f), dx(16);
  moe::MoeFfnWorkspace ws;
  REQUIRE_THROWS_WITH(layer.backward(ws, {dy.data(), 2, 8}, {dx.data(), 2, 8}, grads),
                      Catch::Contains("call forward_train first"));
  std::vector<float> y(16);
  layer.forward_train({x.data(), 2, 8}, {y.data(), 2, 8}, ws);
  REQUIRE_THROWS_WITH(layer.backward(ws, {dy.data(), 1, 8}, {dx.data(), 1, 8}, grads),
                      Catch::Contains("must be [2, 8]"));
}

TEST_CASE("backward checks whose workspace and gradients it is given", "[backward][errors]") {
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh>;
  Layer a(8, 6, {4, 2, true, 1.0f}, Sh(1, 8, 6));
  Layer same_shape(8, 6, {4, 2, true, 1.0f}, Sh(1, 8, 6));
  Layer wider(8, 6, {6, 2, true, 1.0f}, Sh(1, 8, 6));
  Layer two_shared(8, 6, {4, 2, true, 1.0f}, Sh(2, 8, 6));
  test::randomize_ffn(a, 40);
  std::vector<float> x = test::random_vector(3 * 8, 41), y(24), dy(24, 0.1f), dx(24);
  moe::MoeFfnWorkspace ws;
  auto grads = a.make_gradients();
  // A workspace another layer filled (even one of the same shapes) is refused, not read.
  a.forward_train({x.data(), 3, 8}, {y.data(), 3, 8}, ws);
  REQUIRE_THROWS_WITH(same_shape.backward(ws, {dy.data(), 3, 8}, {dx.data(), 3, 8}, grads),
                      Catch::Contains("filled by another layer"));
  auto wider_grads = wider.make_gradients();
  REQUIRE_THROWS_WITH(wider.backward(ws, {dy.data(), 3, 8}, {dx.data(), 3, 8}, wider_grads),
                      Catch::Contains("filled by another layer"));
  // Gradients of another layer's shapes (more experts, more shared experts) are refused.
  REQUIRE_THROWS_WITH(a.backward(ws, {dy.data(), 3, 8}, {dx.data(), 3, 8}, wider_grads),
                      Catch::Contains("not shaped like this layer"));
  auto shared_grads = two_shared.make_gradients();
  REQUIRE_THROWS_WITH(a.backward(ws, {dy.data(), 3, 8}, {dx.data(), 3, 8}, shared_grads),
                      Catch::Contains("not shaped like this layer"));
  // The right pair still works, once.
  REQUIRE_NOTHROW(a.backward(ws, {dy.data(), 3, 8}, {dx.data(), 3, 8}, grads));
  REQUIRE_THROWS_WITH(a.backward(ws, {dy.data(), 3, 8}, {dx.data(), 3, 8}, grads),
                      Catch::Contains("call forward_train first"));
}

TEST_CASE("A router policy that leaves a misshapen Selection is an error, not an overflow",
          "[layers][errors]") {
  // Each policy breaks one part of the contract of select().
  struct BadRouter {
    int flaw = 0;
    Index expert_count() const { return 3; }
    Index slots_per_token() const { return 2; }
    void validate() const {}
    void select(ConstMatrixView<float> logits, moe::Selection& sel) const {
      Index const T = logits.rows;
      sel.reset(flaw == 0 ? T - 1 : T, flaw == 1 ? 1 : 2, 3);  // 0: too few tokens; 1: slots
      for (std::size_t i = 0; i < sel.expert.size(); ++i) {
        sel.expert[i] = static_cast<moe::ExpertId>(i % 3);
        sel.weight[i] = 0.5f;
      }
      if (flaw == 2) sel.expert[1] = 7;     // an expert id out of range
      if (flaw == 3) sel.weight.resize(1);  // weights of the wrong length
      if (flaw == 4) sel.scores.clear();    // no scores
    }
  };
  std::vector<float> x = test::random_vector(4 * 8, 42), y(32);
  moe::MoeFfnWorkspace ws;
  for (int flaw = 0; flaw < 5; ++flaw) {
    INFO("flaw " << flaw);
    moe::MoeFfn<BadRouter, experts::SwiGlu> layer(8, 4, BadRouter{flaw});
    REQUIRE_THROWS_WITH(layer.forward({x.data(), 4, 8}, {y.data(), 4, 8}, ws),
                        Catch::Contains("router policy") && Catch::Contains("MoeFfn"));
  }
}
