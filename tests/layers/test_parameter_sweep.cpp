// SPDX-License-Identifier: Apache-2.0
// Every numeric parameter of every policy against NaN, +-inf, 0, negative, denormal and huge
// values: validate() (or the layer's constructor / call) rejects it with a moe::Error naming the
// parameter, or the layer runs (forward, and training forward + backward where the parameter is a
// training one) with finite results. Under the asan preset UBSan makes any undefined conversion
// (e.g. a huge capacity factor cast to an integer) fail the test.
#include <catch2/catch.hpp>
#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

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
#include "moe/core/random.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/optim/adamw.hpp"
#include "moe/optim/sgd.hpp"
#include "moe/quant/alphaq.hpp"
#include "moe/routing/capacity.hpp"
#include "moe/routing/expert_choice.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/one_per_group_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_p.hpp"

namespace {

using Catch::Contains;
using moe::Index;
namespace routing = moe::routing;
namespace balance = moe::balance;

constexpr Index kD = 8, kF = 6, kE = 4, kT = 12;

/// The values every parameter is tried with.
std::vector<double> const& sweep_values() {
  static std::vector<double> const v = {
      std::numeric_limits<double>::quiet_NaN(),
      std::numeric_limits<double>::infinity(),
      -std::numeric_limits<double>::infinity(),
      0.0,
      -0.0,
      -1.0,
      1e-45,  // a float denormal
      0.5,
      1.0,
      2.5,
      1e6,
      1e30,
      FLT_MAX,
  };
  return v;
}

/// What one (parameter, value) did: rejected with a message naming the parameter, or accepted
/// and run with finite results.
struct Outcome {
  int accepted = 0, rejected = 0;
};

/// Runs `attempt(value)` for every sweep value; `attempt` throws moe::Error (reject) or returns
/// having checked the run. The message of a rejection must name `name`.
void sweep(std::string const& name, std::function<void(double)> const& attempt, Outcome& out) {
  for (double const v : sweep_values()) {
    INFO(name << " = " << v);
    try {
      attempt(v);
      ++out.accepted;
    } catch (moe::Error const& e) {
      INFO(e.what());
      CHECK_THAT(std::string(e.what()), Contains(name));
      ++out.rejected;
    }
  }
}

void require_finite(std::vector<float> const& v, char const* what) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    INFO(what << "[" << i << "]");
    REQUIRE(std::isfinite(v[i]));
  }
}

/// Builds a small layer with `router` and `bal`, runs forward, and forward_train + backward;
/// every output, the aux loss and every gradient must be finite.
template <class Router, class Balance = balance::None>
void run_layer(Router const& router, Balance const& bal = {}) {
  moe::MoeFfn<Router, moe::experts::SwiGlu, moe::experts::NoSharedExperts, Balance> layer(
      kD, kF, router, {}, bal);
  moe::fill_uniform(layer.experts().edit().parameters(), -0.3f, 0.3f, 11);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, 12);
  std::vector<float> x(kT * kD), y(x.size()), dx(x.size()), dy(x.size());
  moe::fill_uniform(x, -1.0f, 1.0f, 13);
  moe::fill_uniform(dy, -1.0f, 1.0f, 14);
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), kT, kD}, {y.data(), kT, kD}, ws);
  require_finite(y, "y");
  layer.forward_train({x.data(), kT, kD}, {y.data(), kT, kD}, ws);
  REQUIRE(std::isfinite(ws.aux_loss));
  auto grads = layer.make_gradients();
  layer.backward(ws, {dy.data(), kT, kD}, {dx.data(), kT, kD}, grads);
  require_finite(y, "y (train)");
  require_finite(dx, "dx");
  for (auto const& g : grads.groups()) {
    for (std::size_t i = 0; i < g.values.size(); ++i) REQUIRE(std::isfinite(g.values[i]));
  }
}

}  // namespace

TEST_CASE("router parameters: rejected or run with finite results", "[layers][validation]") {
  Outcome o;
  sweep(
      "scale",
      [](double v) {
        routing::SoftmaxTopK r{kE, 2, true, static_cast<float>(v)};
        run_layer(r);
      },
      o);
  sweep(
      "scale",
      [](double v) {
        routing::GroupLimitedTopK r;
        r.num_experts = kE, r.top_k = 2, r.n_group = 2, r.topk_group = 2;
        r.scale = static_cast<float>(v);
        run_layer(r);
      },
      o);
  sweep(
      "scale",
      [](double v) {
        routing::OnePerGroupTopK r{kE, 2, 2, false, static_cast<float>(v)};
        run_layer(r);
      },
      o);
  sweep(
      "bias",
      [](double v) {
        routing::GroupLimitedTopK r;
        r.num_experts = kE, r.top_k = 2, r.bias = {0.0f, static_cast<float>(v), 0.0f, 0.0f};
        run_layer(r);
      },
      o);
  sweep(
      "threshold",
      [](double v) {
        routing::TopP r{kE, static_cast<float>(v), 0, false};
        run_layer(r);
      },
      o);
  // Capacity factors: a huge or infinite factor means no limit (C clamped to T, never an
  // out-of-range integer conversion): nothing is dropped.
  sweep(
      "capacity_factor",
      [](double v) {
        routing::WithCapacity<routing::SoftmaxTopK> r{
            {kE, 2, false, 1.0f}, static_cast<float>(v), 0};
        r.validate();
        Index const c = r.capacity(kT);
        REQUIRE(c >= 0);
        REQUIRE(c <= kT);
        if (v >= 1e6) REQUIRE(c == kT);
        run_layer(r);
      },
      o);
  sweep(
      "capacity_factor",
      [](double v) {
        routing::ExpertChoice r{kE, static_cast<float>(v), 0};
        r.validate();
        REQUIRE(r.capacity(kT) <= kT);
        if (v >= 1e6) REQUIRE(r.capacity(kT) == kT);
        run_layer(r);
      },
      o);
  CHECK(o.accepted > 0);
  CHECK(o.rejected > 0);
}

TEST_CASE("a router parameter changed after construction is checked on the next call",
          "[layers][validation]") {
  moe::MoeFfn<routing::SoftmaxTopK, moe::experts::SwiGlu> layer(kD, kF, {kE, 2, false, 1.0f});
  std::vector<float> x(kT * kD, 0.1f), y(x.size());
  moe::MoeFfnWorkspace ws;
  layer.router().scale = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(layer.forward({x.data(), kT, kD}, {y.data(), kT, kD}, ws),
                      Contains("SoftmaxTopK: scale = nan"));
  layer.router().scale = 1.0f;
  REQUIRE_NOTHROW(layer.forward({x.data(), kT, kD}, {y.data(), kT, kD}, ws));
}

TEST_CASE("balance coefficients and rates: rejected or run with finite results",
          "[layers][validation]") {
  Outcome o;
  routing::SoftmaxTopK const r{kE, 2, true, 1.0f};
  sweep(
      "coef", [&](double v) { run_layer(r, balance::SwitchAux{v}); }, o);
  sweep(
      "coef", [&](double v) { run_layer(r, balance::ZLoss{v}); }, o);
  sweep(
      "alpha", [&](double v) { run_layer(r, balance::SeqAux{v}); }, o);
  sweep(
      "coef",
      [&](double v) {
        run_layer(r, balance::HfLoadBalancing{2, v});
      },
      o);
  sweep(
      "coef",
      [&](double v) {
        balance::GlobalBatchAux b;
        b.coef = v;
        run_layer(r, b);
      },
      o);
  sweep(
      "coef", [&](double v) { run_layer(r, balance::VarianceLoss{v}); }, o);
  sweep(
      "coef", [&](double v) { run_layer(r, balance::OrthogonalityLoss{v}); }, o);
  sweep(
      "coef",
      [&](double v) {
        balance::Compose<balance::SwitchAux, balance::ZLoss> b;
        b.get<1>().coef = v;
        run_layer(r, b);
      },
      o);
  sweep(
      "rate",
      [](double v) {
        routing::GroupLimitedTopK g;
        g.num_experts = kE, g.top_k = 2;
        balance::AuxFreeBias b;
        b.rate = static_cast<float>(v);
        run_layer(g, b);
      },
      o);
  for (char const* which : {"beta", "tau", "eps"}) {
    sweep(
        which,
        [&](double v) {
          balance::RobustExpertWeighting w;
          if (std::string(which) == "beta") w.beta = v;
          if (std::string(which) == "tau") w.tau = v;
          if (std::string(which) == "eps") w.eps = v;
          w.validate();
          moe::Selection sel;
          sel.reset(2, 2, kE);
          sel.expert = {0, 1, 1, 2};
          sel.weight = {0.6f, 0.4f, 0.7f, 0.3f};
          moe::RoutingPlan plan;
          moe::kernels::build_plan(sel, plan);
          std::vector<float> loss = {1.0f, 2.0f};
          w.update(plan, loss);
          for (double q : w.q) REQUIRE(std::isfinite(q));
        },
        o);
  }
  CHECK(o.accepted > 0);
  CHECK(o.rejected > 0);
}

TEST_CASE("Default MoE decay: [0, 1] or an error at the training forward", "[layers][validation]") {
  Outcome o;
  sweep(
      "decay",
      [](double v) {
        moe::MoeFfn<routing::SoftmaxTopK, moe::experts::SwiGlu> layer(kD, kF, {kE, 2, true, 1.0f});
        moe::fill_uniform(layer.experts().edit().parameters(), -0.3f, 0.3f, 21);
        layer.default_moe() = {true, static_cast<float>(v), moe::DefaultMoe::Mode::kForward};
        std::vector<float> x(kT * kD), y(x.size());
        moe::fill_uniform(x, -1.0f, 1.0f, 22);
        moe::MoeFfnWorkspace ws;
        for (int step = 0; step < 3; ++step)
          layer.forward_train({x.data(), kT, kD}, {y.data(), kT, kD}, ws);
        require_finite(y, "y");
      },
      o);
  CHECK(o.rejected >= 8);  // NaN, +-inf, -1, 2.5, 1e6, 1e30, FLT_MAX
}

TEST_CASE("attention parameters: rejected or run with finite results", "[layers][validation]") {
  Outcome o;
  auto run = [](moe::GatedAttentionConfig c) {
    moe::GatedAttention<moe::gating::HeadwiseGate> a(c);
    std::uint64_t seed = 31;
    for (moe::ParameterRef const& w : a.parameters())
      moe::fill_uniform(w.values, -0.3f, 0.3f, seed++);
    std::vector<float> x(kT * c.d_model), y(x.size());
    moe::fill_uniform(x, -1.0f, 1.0f, 32);
    moe::GatedAttentionWorkspace ws;
    a.forward({x.data(), kT, c.d_model}, {y.data(), kT, c.d_model}, ws, {});
    require_finite(y, "y");
  };
  moe::GatedAttentionConfig base;
  base.d_model = 8, base.num_heads = 2, base.num_kv_heads = 1, base.head_dim = 4;
  base.qk_norm = moe::QkNorm::kRmsNorm, base.rope = true;
  sweep(
      "norm_eps",
      [&](double v) {
        auto c = base;
        c.norm_eps = static_cast<float>(v);
        run(c);
      },
      o);
  sweep(
      "rope_theta",
      [&](double v) {
        auto c = base;
        c.rope_theta = static_cast<float>(v);
        run(c);
      },
      o);
  sweep(
      "scale",
      [&](double v) {
        auto c = base;
        c.scale = static_cast<float>(v);
        if (c.scale > 1e3f) return;  // a finite but huge softmax scale: see the NaN/Inf policy
        run(c);
      },
      o);
  CHECK(o.rejected > 0);
}

TEST_CASE("optimizer and quantization budgets: rejected or finite", "[layers][validation]") {
  Outcome o;
  std::vector<float> p = {0.5f, -0.25f, 0.0f}, g = {0.0f, 1.0f, -2.0f};
  moe::ParameterList grads{{"p", std::span<float>(g)}};
  for (char const* which : {"lr", "beta1", "beta2", "eps", "weight_decay"}) {
    sweep(
        which,
        [&](double v) {
          moe::optim::AdamW opt;
          std::string const w = which;
          if (w == "lr") opt.lr = v;
          if (w == "beta1") opt.beta1 = v;
          if (w == "beta2") opt.beta2 = v;
          if (w == "eps") opt.eps = v;
          if (w == "weight_decay") opt.weight_decay = v;
          std::vector<float> q = p;
          moe::ParameterList qp{{"p", std::span<float>(q)}};
          opt.step(qp, grads);
          if (v <= 1e6 || w == "beta1" || w == "beta2") require_finite(q, "p");
        },
        o);
  }
  for (char const* which : {"lr", "momentum", "weight_decay"}) {
    sweep(
        which,
        [&](double v) {
          moe::optim::Sgd opt;
          std::string const w = which;
          if (w == "lr") opt.lr = v;
          if (w == "momentum") opt.momentum = v;
          if (w == "weight_decay") opt.weight_decay = v;
          std::vector<float> q = p;
          moe::ParameterList qp{{"p", std::span<float>(q)}};
          opt.step(qp, grads);
        },
        o);
  }
  sweep(
      "budget",
      [](double v) {
        std::vector<moe::quant::AllocationUnit> units(2);
        for (auto& u : units) u.weights = 64, u.errors = {0.5, 0.1};
        auto const a = moe::quant::allocate_bits(units, {4.5, 8.5}, v);
        REQUIRE(std::isfinite(a.objective));
      },
      o);
  sweep(
      "bits",
      [](double v) {
        std::vector<moe::quant::AllocationUnit> units(1);
        units[0].weights = 32, units[0].errors = {0.5};
        (void)moe::quant::allocate_bits(units, {v}, 64.0);
      },
      o);
  CHECK(o.rejected > 0);
}
