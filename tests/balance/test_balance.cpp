// SPDX-License-Identifier: Apache-2.0
// Balance policies: the analytic cases of ALGORITHMS.md 7.4, finite-difference gradients, masks,
// stateful updates, and their wiring into MoeFfn training.
#include <catch2/catch.hpp>
#include <cmath>

#include "moe/balance/aux_free_bias.hpp"
#include "moe/balance/compose.hpp"
#include "moe/balance/global_batch_aux.hpp"
#include "moe/balance/hf_load_balancing.hpp"
#include "moe/balance/orthogonality_loss.hpp"
#include "moe/balance/robust_expert_weighting.hpp"
#include "moe/balance/seq_aux.hpp"
#include "moe/balance/switch_aux.hpp"
#include "moe/balance/variance_loss.hpp"
#include "moe/balance/z_loss.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "support/helpers.hpp"

using moe::BalanceGradients;
using moe::BalanceInputs;
using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace balance = moe::balance;
namespace routing = moe::routing;

namespace {

/// Logits, a router's selection and plan, and expert outputs: everything a policy sees.
template <class Router>
struct Setup {
  Router router;
  Index T, E, D;
  std::vector<float> z, out;
  std::vector<std::uint8_t> mask;
  moe::Selection sel;
  moe::RoutingPlan plan;

  Setup(Router r, Index T_, Index D_, std::uint64_t seed, float range = 2.0f)
      : router(std::move(r)), T(T_), E(router.expert_count()), D(D_) {
    z = test::random_vector(T * E, seed, -range, range);
    refresh();
    out = test::random_vector(plan.num_rows() * D, seed + 1);
  }
  void refresh() {
    router.select(ConstMatrixView<float>(z.data(), T, E), sel);
    moe::kernels::build_plan(sel, plan);
  }
  BalanceInputs inputs() const {
    return BalanceInputs{ConstMatrixView<float>(z.data(), T, E), sel, plan,
                         ConstMatrixView<float>(out.data(), plan.num_rows(), D), mask};
  }
};

/// dL/dlogits from a policy's backward (scores through the router's VJP, plus direct terms)
/// against central differences of its aux_loss, with the selection held fixed.
template <class Policy, class Router>
void check_logit_gradient(Policy const& policy, Setup<Router>& s) {
  Index const T = s.T, E = s.E;
  std::vector<float> dscores(T * E, 0.0f), dlogits(T * E, 0.0f), extra(T * E, 0.0f),
      dout(s.out.size(), 0.0f);
  std::vector<float> dweight(T * s.sel.slots, 0.0f);
  BalanceGradients g{MatrixView<float>(dscores.data(), T, E), MatrixView<float>(extra.data(), T, E),
                     MatrixView<float>(dout.data(), s.plan.num_rows(), s.D)};
  policy.backward(s.inputs(), g);
  s.router.backward(ConstMatrixView<float>(s.z.data(), T, E), s.sel, dweight.data(),
                    MatrixView<float>(dscores.data(), T, E),
                    MatrixView<float>(dlogits.data(), T, E));
  auto const experts = s.sel.expert;
  for (Index i = 0; i < T * E; ++i) {
    float const old = s.z[i];
    float const h = 2e-3f;
    s.z[i] = old + h;
    s.refresh();
    REQUIRE(s.sel.expert == experts);
    double const lp = policy.aux_loss(s.inputs());
    s.z[i] = old - h;
    s.refresh();
    REQUIRE(s.sel.expert == experts);
    double const lm = policy.aux_loss(s.inputs());
    s.z[i] = old;
    s.refresh();
    double const fd = (lp - lm) / (2.0 * h);
    INFO("logit " << i << ": analytic " << dlogits[i] + extra[i] << ", finite difference " << fd);
    REQUIRE(dlogits[i] + extra[i] == Approx(fd).margin(1e-5).epsilon(1e-3));
  }
}

}  // namespace

TEST_CASE("Uniform router: HF loss = k, Switch top-1 = 1, DeepSeek seq-wise = alpha", "[balance]") {
  Index const T = 12, E = 8;
  Setup s(routing::SoftmaxTopK{E, 2, false, 1.0f}, T, 4, 1);
  std::fill(s.z.begin(), s.z.end(), 0.0f);  // p_i = 1/E
  s.refresh();
  REQUIRE(balance::HfLoadBalancing{2, 1.0}.aux_loss(s.inputs()) == Approx(2.0));
  Setup s1(routing::SoftmaxTopK{E, 1, false, 1.0f}, T, 4, 1);
  std::fill(s1.z.begin(), s1.z.end(), 0.0f);
  s1.refresh();
  REQUIRE(balance::SwitchAux{1.0}.aux_loss(s1.inputs()) == Approx(1.0));
  REQUIRE(balance::SeqAux{0.25, 4}.aux_loss(s.inputs()) == Approx(0.25));
  REQUIRE(balance::SeqAux{0.25, 0}.aux_loss(s.inputs()) == Approx(0.25));
}

TEST_CASE("z-loss of zero logits is (log E)^2", "[balance]") {
  Setup s(routing::SoftmaxTopK{6, 2, false, 1.0f}, 5, 4, 2);
  std::fill(s.z.begin(), s.z.end(), 0.0f);
  s.refresh();
  REQUIRE(balance::ZLoss{1.0}.aux_loss(s.inputs()) == Approx(std::log(6.0) * std::log(6.0)));
}

TEST_CASE("A padding mask gives the loss of the unpadded tokens alone", "[balance]") {
  Index const T = 10, E = 6;
  Setup full(routing::SoftmaxTopK{E, 2, false, 1.0f}, T, 4, 3);
  full.mask.assign(T, 1);
  full.mask[2] = full.mask[7] = full.mask[9] = 0;
  // The same tokens without the padded ones.
  Setup kept(routing::SoftmaxTopK{E, 2, false, 1.0f}, T - 3, 4, 3);
  kept.z.clear();
  for (Index t = 0; t < T; ++t) {
    if (full.mask[t])
      kept.z.insert(kept.z.end(), full.z.begin() + t * E, full.z.begin() + (t + 1) * E);
  }
  kept.refresh();
  auto same = [&](auto const& policy) {
    REQUIRE(policy.aux_loss(full.inputs()) ==
            Approx(policy.aux_loss(kept.inputs())).epsilon(1e-12));
  };
  same(balance::HfLoadBalancing{2, 1.0});
  same(balance::SwitchAux{1.0});
  same(balance::ZLoss{1.0});
  same(balance::VarianceLoss{1.0});
}

TEST_CASE("Auxiliary-loss-free bias: counts [5,3,4,4] move the bias by rate*[-1,+1,0,0]",
          "[balance][aux_free]") {
  // 16 tokens, top-1, hand-made selection with loads 5, 3, 4, 4.
  moe::Selection sel;
  sel.reset(16, 1, 4);
  int const loads[4] = {5, 3, 4, 4};
  Index t = 0;
  for (int e = 0; e < 4; ++e) {
    for (int i = 0; i < loads[e]; ++i) sel.expert[t++] = e;
  }
  moe::RoutingPlan plan;
  moe::kernels::build_plan(sel, plan);
  std::vector<float> z(16 * 4, 0.0f);
  balance::AuxFreeBias policy{0.01f, {}};
  policy.observe(BalanceInputs{ConstMatrixView<float>(z.data(), 16, 4), sel, plan});
  routing::GroupLimitedTopK router;
  router.num_experts = 4;
  router.top_k = 1;
  router.bias = {0.5f, 0.5f, 0.5f, 0.5f};
  policy.end_step(router);
  REQUIRE(router.bias[0] == Approx(0.49f));
  REQUIRE(router.bias[1] == Approx(0.51f));
  REQUIRE(router.bias[2] == 0.5f);
  REQUIRE(router.bias[3] == 0.5f);
  // Counts cover the whole step (two micro-batches), then reset.
  policy.observe(BalanceInputs{ConstMatrixView<float>(z.data(), 16, 4), sel, plan});
  policy.observe(BalanceInputs{ConstMatrixView<float>(z.data(), 16, 4), sel, plan});
  REQUIRE(policy.counts[0] == 10.0);
  policy.end_step(router);
  REQUIRE(policy.counts[0] == 0.0);
  REQUIRE(router.bias[0] == Approx(0.48f));
}

TEST_CASE("Variance loss equals minus the mean unbiased variance of the scores", "[balance]") {
  Setup s(routing::SoftmaxTopK{5, 2, false, 1.0f}, 6, 4, 4);
  double want = 0.0;
  for (Index t = 0; t < 6; ++t) {
    double m = 0.0, v = 0.0;
    for (Index e = 0; e < 5; ++e) m += s.sel.scores[t * 5 + e] / 5.0;
    for (Index e = 0; e < 5; ++e) v += std::pow(s.sel.scores[t * 5 + e] - m, 2) / 4.0;
    want += v / 6.0;
  }
  REQUIRE(balance::VarianceLoss{2.0}.aux_loss(s.inputs()) == Approx(-2.0 * want));
}

TEST_CASE("Orthogonality loss: orthogonal outputs give 0, two equal outputs |v|^2 rho^4",
          "[balance][ortho]") {
  Index const D = 5;
  Setup s(routing::SoftmaxTopK{4, 2, false, 1.0f}, 1, D, 5);
  REQUIRE(s.plan.num_rows() == 2);
  std::fill(s.out.begin(), s.out.end(), 0.0f);
  s.out[0 * D + 1] = 3.0f;  // e_1 and e_3 scaled: orthogonal
  s.out[1 * D + 3] = -2.0f;
  REQUIRE(balance::OrthogonalityLoss{1.0}.aux_loss(s.inputs()) == Approx(0.0).margin(1e-12));
  std::vector<float> v = {0.5f, -1.0f, 2.0f, 0.25f, 1.0f};
  std::copy(v.begin(), v.end(), s.out.begin());
  std::copy(v.begin(), v.end(), s.out.begin() + D);
  double n2 = 0.0;
  for (float c : v) n2 += c * c;
  double const rho = std::sqrt(n2) / (std::sqrt(n2) + 1e-6);
  REQUIRE(balance::OrthogonalityLoss{1.0}.aux_loss(s.inputs()) ==
          Approx(n2 * std::pow(rho, 4)).epsilon(1e-9));
}

TEST_CASE("Balance gradients match finite differences of their losses", "[balance][grad]") {
  Index const T = 9, E = 6;
  SECTION("HF load balancing") {
    Setup s(routing::SoftmaxTopK{E, 2, false, 1.0f}, T, 4, 11);
    s.mask.assign(T, 1);
    s.mask[4] = 0;
    check_logit_gradient(balance::HfLoadBalancing{2, 0.5}, s);
  }
  SECTION("Switch") {
    Setup s(routing::SoftmaxTopK{E, 1, false, 1.0f}, T, 4, 12);
    check_logit_gradient(balance::SwitchAux{0.5}, s);
  }
  SECTION("z-loss") {
    Setup s(routing::SoftmaxTopK{E, 2, true, 1.0f}, T, 4, 13);
    check_logit_gradient(balance::ZLoss{0.5}, s);
  }
  SECTION("DeepSeek sequence-wise, sigmoid scores") {
    routing::GroupLimitedTopK r;
    r.num_experts = E;
    r.top_k = 2;
    Setup s(r, T, 4, 14);
    check_logit_gradient(balance::SeqAux{0.5, 3}, s);
  }
  SECTION("variance") {
    Setup s(routing::SoftmaxTopK{E, 2, false, 1.0f}, T, 4, 15);
    check_logit_gradient(balance::VarianceLoss{0.5}, s);
  }
  SECTION("global batch, second micro-batch") {
    Setup s(routing::SoftmaxTopK{E, 2, false, 1.0f}, T, 4, 16);
    balance::GlobalBatchAux policy{0.5, {}, 0.0, {}};
    Setup first(routing::SoftmaxTopK{E, 2, false, 1.0f}, T, 4, 17);
    policy.observe(first.inputs());
    double const before = policy.aux_loss(s.inputs());
    policy.observe(s.inputs());  // backward sees the step's counts, current micro-batch included
    REQUIRE(policy.aux_loss(s.inputs()) != before);  // counts now include s twice: f changed
    balance::GlobalBatchAux fresh{0.5, {}, 0.0, {}};
    fresh.observe(first.inputs());
    fresh.observe(s.inputs());
    // The loss as a function of the current logits, with f̄ fixed: P varies, f̄ does not.
    struct Fixed {
      balance::GlobalBatchAux const* p;
      double aux_loss(BalanceInputs const& in) const {
        Index const Tn = balance::detail::real_tokens(in);
        auto P = balance::detail::mean_scores(in, Tn);
        double v = 0.0;
        for (std::size_t e = 0; e < P.size(); ++e) v += p->fbar[e] * P[e];
        return p->coef * v;
      }
      void backward(BalanceInputs const& in, BalanceGradients& g) const { p->backward(in, g); }
    } fixed{&fresh};
    check_logit_gradient(fixed, s);
  }
}

TEST_CASE("Orthogonality gradient matches finite differences on the expert outputs",
          "[balance][ortho][grad]") {
  Index const D = 4;
  Setup s(routing::SoftmaxTopK{6, 3, false, 1.0f}, 3, D, 21);
  balance::OrthogonalityLoss policy{0.7};
  std::vector<float> ds(3 * 6), dz(3 * 6), dout(s.out.size(), 0.0f);
  BalanceGradients g{MatrixView<float>(ds.data(), 3, 6), MatrixView<float>(dz.data(), 3, 6),
                     MatrixView<float>(dout.data(), s.plan.num_rows(), D)};
  policy.backward(s.inputs(), g);
  for (std::size_t i = 0; i < s.out.size(); ++i) {
    float const old = s.out[i], h = 1e-2f;
    s.out[i] = old + h;
    double const lp = policy.aux_loss(s.inputs());
    s.out[i] = old - h;
    double const lm = policy.aux_loss(s.inputs());
    s.out[i] = old;
    INFO("output " << i);
    REQUIRE(dout[i] == Approx((lp - lm) / (2.0 * h)).margin(1e-4).epsilon(2e-3));
  }
}

TEST_CASE("A layer's balance policy enters its loss and its router gradient",
          "[balance][training]") {
  Index const D = 8, E = 6, T = 20;
  using Policy = balance::Compose<balance::HfLoadBalancing, balance::ZLoss>;
  moe::MoeFfn<routing::SoftmaxTopK, moe::experts::SwiGlu> plain(D, 4, {E, 2, false, 1.0f});
  moe::MoeFfn<routing::SoftmaxTopK, moe::experts::SwiGlu, moe::experts::NoSharedExperts, Policy>
      with(D, 4, {E, 2, false, 1.0f}, {},
           Policy{{balance::HfLoadBalancing{2, 0.1}, balance::ZLoss{0.01}}});
  moe::fill_uniform(plain.experts().edit().parameters(), -0.3f, 0.3f, 1);
  moe::fill_uniform(with.experts().edit().parameters(), -0.3f, 0.3f, 1);
  auto wr = test::random_vector(E * D, 2);
  std::copy(wr.begin(), wr.end(), plain.router_weight().data);
  std::copy(wr.begin(), wr.end(), with.router_weight().data);
  auto x = test::random_vector(T * D, 3);
  auto dy = test::random_vector(T * D, 4);
  std::vector<float> y1(x.size()), y2(x.size()), dx1(x.size()), dx2(x.size());
  moe::MoeFfnWorkspace w1, w2;
  plain.forward_train({x.data(), T, D}, {y1.data(), T, D}, w1);
  with.forward_train({x.data(), T, D}, {y2.data(), T, D}, w2);
  REQUIRE(y1 == y2);
  BalanceInputs in{w2.logits_view(), w2.selection, w2.plan};
  double const want =
      balance::HfLoadBalancing{2, 0.1}.aux_loss(in) + balance::ZLoss{0.01}.aux_loss(in);
  REQUIRE(w2.aux_loss == Approx(want));
  auto g1 = plain.make_gradients();
  auto g2 = with.make_gradients();
  plain.backward(w1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
  with.backward(w2, {dy.data(), T, D}, {dx2.data(), T, D}, g2);
  // The difference is exactly the balance term: dW_r += dz_bal^T x.
  std::vector<float> ds(T * E, 0.0f), dz(T * E, 0.0f), dw(T * 2, 0.0f), dl(T * E, 0.0f);
  BalanceGradients bg{MatrixView<float>(ds.data(), T, E), MatrixView<float>(dz.data(), T, E), {}};
  with.balance().backward(in, bg);
  for (Index e = 0; e < E; ++e) {
    for (Index d = 0; d < D; ++d) {
      double extra = 0.0;
      for (Index t = 0; t < T; ++t) extra += static_cast<double>(dz[t * E + e]) * x[t * D + d];
      REQUIRE(g2.router_weight[e * D + d] ==
              Approx(g1.router_weight[e * D + d] + extra).margin(1e-5));
    }
  }
  REQUIRE(g2.experts.parameters()[0] == g1.experts.parameters()[0]);
}

TEST_CASE("Auxiliary-loss-free balancing through the layer moves the router bias",
          "[balance][aux_free]") {
  Index const D = 8, E = 4, T = 64;
  routing::GroupLimitedTopK r;
  r.num_experts = E;
  r.top_k = 1;
  moe::MoeFfn<routing::GroupLimitedTopK, moe::experts::SwiGlu, moe::experts::NoSharedExperts,
              balance::AuxFreeBias>
      layer(D, 4, r, {}, balance::AuxFreeBias{0.05f, {}});
  auto wr = layer.router_weight();
  wr(0, 0) = 4.0f;  // expert 0 wins for most tokens
  auto x = test::random_vector(T * D, 5, 0.0f, 1.0f);
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
  layer.end_step();
  REQUIRE(layer.router().bias.size() == static_cast<std::size_t>(E));
  REQUIRE(layer.router().bias[0] == Approx(-0.05f));  // overloaded
  for (Index e = 1; e < E; ++e) REQUIRE(layer.router().bias[e] == Approx(0.05f));
}

TEST_CASE("Robust expert weighting: EMA of activation-weighted losses, softmax weights",
          "[balance][robust]") {
  moe::Selection sel;
  sel.reset(3, 1, 2);
  sel.expert = {0, 1, 0};
  sel.weight = {1.0f, 1.0f, 0.5f};
  moe::RoutingPlan plan;
  moe::kernels::build_plan(sel, plan);
  std::vector<float> loss = {1.0f, 4.0f, 2.0f};
  balance::RobustExpertWeighting rw{0.5, 1.0, 0.0, {}, {}};
  rw.update(plan, loss);
  // l_0 = (1*1 + 0.5*2) / 1.5 = 4/3; l_1 = 4. EMA from 0 with beta 0.5.
  REQUIRE(rw.ema[0] == Approx(2.0 / 3.0));
  REQUIRE(rw.ema[1] == Approx(2.0));
  double const q1 = std::exp(2.0) / (std::exp(2.0) + std::exp(2.0 / 3.0));
  REQUIRE(rw.q[1] == Approx(q1));
  std::vector<float> w(3);
  rw.token_weights(plan, w);
  REQUIRE(w[1] == Approx(q1));
  REQUIRE(w[0] == Approx((1.0 - q1) / 1.5));
  REQUIRE(w[2] == Approx((1.0 - q1) * 0.5 / 1.5));
}
