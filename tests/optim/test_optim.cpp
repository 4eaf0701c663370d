// SPDX-License-Identifier: Apache-2.0
// moe::optim::Sgd and moe::optim::AdamW against the update formulas of torch.optim.SGD and
// torch.optim.AdamW, written out here in double independently of the implementation (plus a few
// values worked out by hand), convergence on a quadratic, and the checks on misuse.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/optim/adamw.hpp"
#include "moe/optim/sgd.hpp"
#include "moe/routing/softmax_top_k.hpp"

namespace {

using moe::ParameterList;
using moe::optim::AdamW;
using moe::optim::Sgd;

/// Two tiny parameters "a" [3] and "b" [2] with their gradient buffers.
struct Tiny {
  std::vector<float> a{1.0f, -0.5f, 2.0f}, b{0.25f, -1.5f};
  std::vector<float> ga = std::vector<float>(3), gb = std::vector<float>(2);
  ParameterList params() { return {{"a", a}, {"b", b}}; }
  ParameterList grads() { return {{"a", ga}, {"b", gb}}; }
  std::vector<double> values() const {
    std::vector<double> v(a.begin(), a.end());
    v.insert(v.end(), b.begin(), b.end());
    return v;
  }
  /// Gradients of step s (s = 0, 1, ...): varied signs and magnitudes.
  void set_grads(int s) {
    float const k = static_cast<float>(s + 1);
    ga = {0.5f * k, -0.3f, 0.1f * k * k};
    gb = {-1.0f / k, 0.7f - 0.4f * k};
  }
  std::vector<double> grad_values() const {
    std::vector<double> v(ga.begin(), ga.end());
    v.insert(v.end(), gb.begin(), gb.end());
    return v;
  }
};

void require_close(std::vector<double> const& want, std::vector<double> const& got) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    REQUIRE(got[i] == Approx(want[i]).epsilon(2e-6).margin(1e-7));
  }
}

/// torch.optim.SGD (dampening 0) for one element, in double.
struct RefSgd {
  double lr, momentum, weight_decay;
  bool nesterov;
  std::vector<double> buf;
  void step(std::vector<double>& p, std::vector<double> const& g) {
    if (buf.empty() && momentum != 0.0) buf.assign(p.size(), 0.0);
    bool const first = steps++ == 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double d = g[i] + weight_decay * p[i];
      if (momentum != 0.0) {
        buf[i] = first ? d : momentum * buf[i] + d;
        d = nesterov ? d + momentum * buf[i] : buf[i];
      }
      p[i] -= lr * d;
    }
  }
  int steps = 0;
};

/// torch.optim.AdamW for one element, in double.
struct RefAdamW {
  double lr, beta1, beta2, eps, weight_decay;
  std::vector<double> m, v;
  int t = 0;
  void step(std::vector<double>& p, std::vector<double> const& g) {
    if (m.empty()) {
      m.assign(p.size(), 0.0);
      v.assign(p.size(), 0.0);
    }
    ++t;
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1.0 - lr * weight_decay;
      m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
      double const m_hat = m[i] / (1.0 - std::pow(beta1, t));
      double const v_hat = v[i] / (1.0 - std::pow(beta2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

}  // namespace

TEST_CASE("Sgd follows torch.optim.SGD on values worked out by hand", "[optim][sgd]") {
  std::vector<float> p{1.0f}, g{0.5f};
  ParameterList params{{"p", p}}, grads{{"p", g}};
  SECTION("plain: p -= lr g") {
    Sgd opt(0.1);
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.95).epsilon(1e-7));
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.90).epsilon(1e-7));
    REQUIRE(opt.steps() == 2);
  }
  SECTION("momentum 0.9: buffers 0.5, 0.95, 1.355") {
    Sgd opt(0.1, 0.9);
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.95).epsilon(1e-7));
    REQUIRE(opt.momentum_buffer(0)[0] == Approx(0.5).epsilon(1e-7));
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.855).epsilon(1e-7));
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.7195).epsilon(1e-7));
    REQUIRE(opt.momentum_buffer(0)[0] == Approx(1.355).epsilon(1e-7));
  }
  SECTION("Nesterov momentum 0.9: steps of lr (g + 0.9 b)") {
    Sgd opt(0.1, 0.9, 0.0, true);
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.905).epsilon(1e-7));  // 1 - 0.1 (0.5 + 0.45)
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.7695).epsilon(1e-7));  // 0.905 - 0.1 (0.5 + 0.855)
  }
  SECTION("Nesterov with weight decay 0.1: g <- g + 0.1 p first") {
    Sgd opt(0.1, 0.9, 0.1, true);
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.886).epsilon(1e-7));  // d = 0.6, b = 0.6, p = 1 - 0.1 * 1.14
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.725566).epsilon(1e-6));  // d = 0.5886, b = 1.1286
    opt.step(params, grads);
    REQUIRE(p[0] == Approx(0.525363646).epsilon(1e-6));
  }
}

TEST_CASE("Sgd matches the double-precision formulas over several steps", "[optim][sgd]") {
  struct Case {
    double lr, momentum, weight_decay;
    bool nesterov;
  };
  for (Case c :
       {Case{0.05, 0.0, 0.0, false}, Case{0.05, 0.0, 0.2, false}, Case{0.1, 0.9, 0.0, false},
        Case{0.1, 0.8, 0.05, false}, Case{0.1, 0.9, 0.0, true}, Case{0.02, 0.5, 0.3, true}}) {
    INFO("lr " << c.lr << ", momentum " << c.momentum << ", weight_decay " << c.weight_decay
               << ", nesterov " << c.nesterov);
    Tiny tiny;
    Sgd opt(c.lr, c.momentum, c.weight_decay, c.nesterov);
    RefSgd ref{c.lr, c.momentum, c.weight_decay, c.nesterov, {}};
    std::vector<double> want = tiny.values();
    for (int s = 0; s < 5; ++s) {
      tiny.set_grads(s);
      opt.step(tiny.params(), tiny.grads());
      ref.step(want, tiny.grad_values());
      require_close(want, tiny.values());
    }
    REQUIRE(opt.steps() == 5);
  }
}

TEST_CASE("AdamW follows torch.optim.AdamW on values worked out by hand", "[optim][adamw]") {
  std::vector<float> p{1.0f}, g{0.5f};
  ParameterList params{{"p", p}}, grads{{"p", g}};
  AdamW opt(0.1);  // beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0.01
  // Step 1: p = 1 * (1 - 0.1 * 0.01) = 0.999; m_hat = g, v_hat = g^2: p -= 0.1 * 0.5 / 0.5.
  opt.step(params, grads);
  REQUIRE(p[0] == Approx(0.899).epsilon(1e-7));
  REQUIRE(opt.first_moment(0)[0] == Approx(0.05).epsilon(1e-6));
  REQUIRE(opt.second_moment(0)[0] == Approx(0.00025).epsilon(1e-6));
  // Step 2, g = -1: m = 0.045 - 0.1 = -0.055, v = 0.00024975 + 0.001 = 0.00124975,
  // p = 0.898101 + 0.1 * (0.055 / 0.19) / sqrt(0.00124975 / 0.001999).
  g[0] = -1.0f;
  opt.step(params, grads);
  REQUIRE(opt.first_moment(0)[0] == Approx(-0.055).epsilon(1e-6));
  REQUIRE(opt.second_moment(0)[0] == Approx(0.00124975).epsilon(1e-6));
  REQUIRE(p[0] == Approx(0.9347113542).epsilon(1e-6));
  g[0] = 0.25f;
  opt.step(params, grads);
  REQUIRE(p[0] == Approx(0.9474457090).epsilon(1e-6));
  REQUIRE(opt.steps() == 3);
}

TEST_CASE("AdamW matches the double-precision formulas over several steps", "[optim][adamw]") {
  struct Case {
    double lr, beta1, beta2, eps, weight_decay;
  };
  for (Case c : {Case{1e-3, 0.9, 0.999, 1e-8, 0.01}, Case{0.05, 0.9, 0.999, 1e-8, 0.0},
                 Case{0.05, 0.8, 0.99, 1e-3, 0.1}, Case{0.01, 0.0, 0.9, 1e-8, 0.5},
                 Case{0.02, 0.5, 0.0, 0.1, 0.0}}) {
    INFO("lr " << c.lr << ", betas " << c.beta1 << " " << c.beta2 << ", eps " << c.eps
               << ", weight_decay " << c.weight_decay);
    Tiny tiny;
    AdamW opt(c.lr, c.beta1, c.beta2, c.eps, c.weight_decay);
    RefAdamW ref{c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, {}, {}};
    std::vector<double> want = tiny.values();
    for (int s = 0; s < 6; ++s) {
      tiny.set_grads(s);
      opt.step(tiny.params(), tiny.grads());
      ref.step(want, tiny.grad_values());
      require_close(want, tiny.values());
    }
    REQUIRE(opt.steps() == 6);
  }
}

TEST_CASE("AdamW's bias correction makes the first step lr * sign(g)", "[optim][adamw]") {
  std::vector<float> p(64, 0.0f), g(64);
  moe::fill_uniform(g, -3.0f, 3.0f, 7);
  AdamW opt(0.01, 0.9, 0.999, 1e-8, 0.0);
  opt.step({{"p", p}}, {{"p", g}});
  for (std::size_t i = 0; i < p.size(); ++i) {
    INFO("g = " << g[i]);
    REQUIRE(p[i] == Approx(g[i] > 0 ? -0.01 : 0.01).epsilon(1e-5));
  }
}

TEST_CASE("Decoupled weight decay shrinks p without touching the moments", "[optim][adamw]") {
  std::vector<float> p{2.0f, -4.0f}, g{0.0f, 0.0f};
  AdamW opt(0.1, 0.9, 0.999, 1e-8, 0.5);
  opt.step({{"p", p}}, {{"p", g}});
  // Zero gradient: m = v = 0, the Adam term is 0 / (0 + eps) = 0; p *= 1 - 0.1 * 0.5.
  REQUIRE(p[0] == Approx(1.9).epsilon(1e-7));
  REQUIRE(p[1] == Approx(-3.8).epsilon(1e-7));
  REQUIRE(opt.first_moment(0)[0] == 0.0f);
  REQUIRE(opt.second_moment(0)[1] == 0.0f);
}

TEST_CASE("Sgd and AdamW minimise a quadratic", "[optim][convergence]") {
  // f(p) = 0.5 sum_i a_i (p_i - c_i)^2, gradient a_i (p_i - c_i), minimum at p = c.
  std::vector<float> a(16), c(16);
  moe::fill_uniform(a, 0.5f, 2.0f, 11);
  moe::fill_uniform(c, -1.0f, 1.0f, 12);
  auto run = [&](auto& opt, int steps) {
    std::vector<float> p(16, 0.0f), g(16);
    ParameterList params{{"p", p}}, grads{{"p", g}};
    for (int s = 0; s < steps; ++s) {
      for (std::size_t i = 0; i < p.size(); ++i) g[i] = a[i] * (p[i] - c[i]);
      opt.step(params, grads);
    }
    double worst = 0.0;
    for (std::size_t i = 0; i < p.size(); ++i)
      worst = std::max(worst, double{std::fabs(p[i] - c[i])});
    return worst;
  };
  Sgd plain(0.3);
  REQUIRE(run(plain, 200) < 1e-5);
  Sgd heavy(0.1, 0.9);
  REQUIRE(run(heavy, 300) < 1e-5);
  Sgd nesterov(0.1, 0.9, 0.0, true);
  REQUIRE(run(nesterov, 300) < 1e-5);
  AdamW adam(0.05, 0.9, 0.999, 1e-8, 0.0);
  REQUIRE(run(adam, 1000) < 1e-2);
}

TEST_CASE("A ThreadPool gives bitwise the same step as the calling thread", "[optim][threads]") {
  // One parameter of several blocks with a ragged tail, and two small ones.
  std::vector<std::size_t> const sizes{3 * moe::optim::detail::kBlock + 17, 5, 1};
  auto run = [&](auto opt, moe::ThreadPool* pool) {
    std::vector<std::vector<float>> p(sizes.size()), g(sizes.size());
    ParameterList params, grads;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      p[i].resize(sizes[i]);
      g[i].resize(sizes[i]);
      moe::fill_uniform(p[i], -1.0f, 1.0f, 30 + i);
      params.push_back({i == 0 ? "big" : i == 1 ? "small" : "one", p[i]});
      grads.push_back({params.back().name, g[i]});
    }
    for (int s = 0; s < 3; ++s) {
      for (std::size_t i = 0; i < sizes.size(); ++i) moe::fill_uniform(g[i], -1.0f, 1.0f, 40 + s);
      opt.step(params, grads, pool);
    }
    return p;
  };
  moe::ThreadPool pool(3);
  REQUIRE(run(Sgd(0.1, 0.9, 0.01, true), &pool) == run(Sgd(0.1, 0.9, 0.01, true), nullptr));
  REQUIRE(run(AdamW(0.01), &pool) == run(AdamW(0.01), nullptr));
}

TEST_CASE("Mismatched parameter and gradient lists are reported", "[optim][errors]") {
  std::vector<float> a(3), b(2), ga(3), gb(2), gb3(3);
  ParameterList params{{"a", a}, {"b", b}};
  Sgd sgd(0.1, 0.9);
  AdamW adam(0.1);
  auto both = [&](ParameterList const& p, ParameterList const& g, char const* what) {
    REQUIRE_THROWS_WITH(sgd.step(p, g), Catch::Contains(what) && Catch::Contains("optim::Sgd"));
    REQUIRE_THROWS_WITH(adam.step(p, g), Catch::Contains(what) && Catch::Contains("optim::AdamW"));
  };
  both(params, {{"a", ga}}, "2 parameters but 1 gradients");
  both(params, {{"a", ga}, {"c", gb}}, "gradient 1 is \"c\"");
  both(params, {{"a", ga}, {"b", gb3}}, "has 2 values but its gradient has 3");
  both(params, params, "same buffer");
  REQUIRE(sgd.steps() == 0);
  REQUIRE(adam.steps() == 0);
  // The state is bound to the first list stepped: another list is an error until reset().
  sgd.step(params, {{"a", ga}, {"b", gb}});
  adam.step(params, {{"a", ga}, {"b", gb}});
  REQUIRE(adam.first_moment(1).size() == 2);
  std::vector<float> c(5), gc(5);
  both({{"c", c}}, {{"c", gc}}, "state was made for 2");
  both({{"a", a}, {"c", c}}, {{"a", ga}, {"c", gc}}, "state was made for \"b\" of 2");
  sgd.reset();
  adam.reset();
  REQUIRE(sgd.steps() == 0);
  REQUIRE_THROWS_AS(adam.first_moment(0), moe::Error);
  sgd.step({{"c", c}}, {{"c", gc}});
  adam.step({{"c", c}}, {{"c", gc}});
  REQUIRE(adam.first_moment(0).size() == 5);
}

TEST_CASE("Invalid hyper-parameters are reported", "[optim][errors]") {
  REQUIRE_THROWS_WITH(Sgd(-0.1), Catch::Contains("lr = -0.1"));
  REQUIRE_THROWS_WITH(Sgd(0.1, -0.5), Catch::Contains("momentum"));
  REQUIRE_THROWS_WITH(Sgd(0.1, 0.0, -1.0), Catch::Contains("weight_decay"));
  REQUIRE_THROWS_WITH(Sgd(0.1, 0.0, 0.0, true), Catch::Contains("Nesterov momentum needs"));
  REQUIRE_THROWS_WITH(AdamW(std::nan("")), Catch::Contains("learning rate"));
  REQUIRE_THROWS_WITH(AdamW(0.1, 1.0), Catch::Contains("beta1 = 1"));
  REQUIRE_THROWS_WITH(AdamW(0.1, 0.9, -0.1), Catch::Contains("beta2"));
  REQUIRE_THROWS_WITH(AdamW(0.1, 0.9, 0.999, -1e-8), Catch::Contains("eps"));
  // Public hyper-parameters changed later are checked by step().
  AdamW adam(0.1);
  adam.beta2 = 1.5;
  std::vector<float> p(1), g(1);
  REQUIRE_THROWS_WITH(adam.step({{"p", p}}, {{"p", g}}), Catch::Contains("beta2 = 1.5"));
}

TEST_CASE("AdamW steps an MoeFfn through parameters() and Gradients::groups()",
          "[optim][training]") {
  // A tiny layer fitted to a fixed random target: the MSE must fall.
  moe::Index const D = 8, F = 6, E = 4, T = 32;
  moe::MoeFfn<moe::routing::SoftmaxTopK, moe::experts::SwiGlu> layer(D, F, {E, 2, true, 1.0f});
  moe::fill_uniform(layer.experts().edit().parameters(), -0.3f, 0.3f, 21);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(E * D)), -0.3f, 0.3f, 22);
  std::vector<float> x(T * D), target(T * D), y(T * D), dy(T * D), dx(T * D);
  moe::fill_uniform(x, -1.0f, 1.0f, 23);
  moe::fill_uniform(target, -0.5f, 0.5f, 24);
  moe::MoeFfnWorkspace ws;
  auto grads = layer.make_gradients();
  AdamW opt(0.02);
  auto loss_and_grad = [&] {
    layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
    double loss = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) {
      double const r = y[i] - target[i];
      loss += r * r / static_cast<double>(y.size());
      dy[i] = static_cast<float>(2.0 * r / static_cast<double>(y.size()));
    }
    grads.zero();
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads);
    return loss;
  };
  double const first = loss_and_grad();
  for (int s = 0; s < 100; ++s) {
    opt.step(layer.parameters(), grads.groups());
    loss_and_grad();
  }
  double const last = loss_and_grad();
  INFO("MSE " << first << " -> " << last);
  REQUIRE(last < 0.7 * first);
  REQUIRE(opt.steps() == 100);
}
