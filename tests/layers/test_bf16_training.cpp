// SPDX-License-Identifier: Apache-2.0
// The bf16-compute training mode (TrainCompute::kBf16): its products against a scalar reference
// of the same arithmetic (bf16-rounded operands, double sums), the layer's gradients against
// finite differences of the fp32 layer within the documented tolerance, determinism for 1 and
// 2 threads, the train panels rebuilt after an optimizer step, and its misuse reported.
// Tagged [bf16]: CTest runs them again with each bf16 kernel forced (tests/CMakeLists.txt).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <vector>

#include "moe/gating/sdpa_gate.hpp"
#include "moe/layers/detail/bf16_train.hpp"
#include "moe/layers/moe_attention.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/optim/sgd.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "support/double_model.hpp"
#include "support/helpers.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace experts = moe::experts;
namespace routing = moe::routing;

namespace {

double r16(float v) { return static_cast<double>(moe::kernels::round_bf16_activation(v)); }
double w16(float v) {
  return static_cast<double>(moe::kernels::bf16_to_float(moe::kernels::float_to_bf16(v)));
}

/// |got - want| <= 1e-5 * (sum of |terms|) + 1e-6: the products differ from the double sums of
/// the same bf16 operands only by fp32 accumulation.
void require_product(float got, double want, double mag, char const* what, Index i) {
  INFO(what << "[" << i << "]: got " << got << ", want " << want << " (|terms| " << mag << ")");
  REQUIRE(std::fabs(got - want) <= 1e-5 * mag + 1e-6);
}

/// sqrt(sum (a - b)^2 / sum b^2).
double rel_l2(std::span<float const> a, std::vector<double> const& b) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

TEST_CASE("bf16 training products match a scalar reference of bf16 operands", "[training][bf16]") {
  using Bank = experts::ExpertBank<experts::SwiGlu>;
  // D, F odd and not multiples of the panel width; rows beyond one 256-row block.
  for (auto [D, F, n] : {std::tuple<Index, Index, Index>{37, 21, 5}, {64, 48, 33}, {19, 70, 300}}) {
    INFO("D = " << D << ", F = " << F << ", rows = " << n);
    Index const P = 2 * F;
    Bank bank(2, D, F);
    moe::fill_uniform(bank.edit().parameters(), -0.5f, 0.5f, 11);
    bank.set_train_compute(experts::TrainCompute::kBf16);
    REQUIRE(bank.train_panels_current());
    auto h = test::random_vector(n * P, 12, -2.0f, 2.0f);
    auto dy = test::random_vector(n * D, 13);
    std::vector<float> m(n * F), dh(n * P), dx(n * D);
    std::vector<float> scratch(moe::detail::expert_backward_scratch(bank, n));
    moe::detail::expert_backward_rows(bank, 1, {h.data(), n, P}, {dy.data(), n, D},
                                      {m.data(), n, F}, {dh.data(), n, P}, {dx.data(), n, D},
                                      scratch.data());
    // dm = bf16(dy) bf16(W_down) in double; the fp32 GLU VJP of it; dx = bf16(dh) bf16(W_in).
    auto wd = bank.down_proj(1);
    auto wi = bank.in_proj(1);
    std::vector<float> dm(F), mr(F), dhr(P);
    for (Index i = 0; i < n; ++i) {
      for (Index f = 0; f < F; ++f) {
        double s = 0.0, mag = 0.0;
        for (Index d = 0; d < D; ++d) {
          double const t = r16(dy[i * D + d]) * w16(wd(d, f));
          s += t;
          mag += std::fabs(t);
        }
        dm[f] = static_cast<float>(s);
        (void)mag;
      }
      moe::kernels::glu_backward<moe::kernels::Activation::kSilu>(
          h.data() + i * P, h.data() + i * P + F, dm.data(), mr.data(), dhr.data(), dhr.data() + F,
          F);
      for (Index c = 0; c < P; ++c) {
        INFO("dh[" << i << ", " << c << "]");
        REQUIRE(std::fabs(dh[i * P + c] - dhr[c]) <= 1e-4 * (1.0 + std::fabs(dhr[c])));
      }
      for (Index d = 0; d < D; ++d) {
        double s = 0.0, mag = 0.0;
        for (Index c = 0; c < P; ++c) {
          double const t = r16(dh[i * P + c]) * w16(wi(c, d));
          s += t;
          mag += std::fabs(t);
        }
        require_product(dx[i * D + d], s, mag, "dx", i * D + d);
      }
    }
    // Weight gradient: grad [N = P, K = D] += dH^T X over n rows, in blocks of rows.
    auto x = test::random_vector(n * D, 14);
    std::vector<float> grad(P * D, 0.5f);
    std::vector<float> gs(moe::detail::bf16_weight_grad_scratch());
    Index const blocks = (n + moe::detail::kBf16GradRows - 1) / moe::detail::kBf16GradRows;
    moe::HugePageVector<std::uint32_t> panels(
        static_cast<std::size_t>(blocks * moe::detail::bf16_block_words(D)));
    for (Index b = 0; b < blocks; ++b) {
      moe::detail::bf16_pack_block({x.data(), n, D}, b,
                                   panels.data() + b * moe::detail::bf16_block_words(D));
    }
    for (Index r0 = 0; r0 < P; r0 += 40) {
      moe::detail::bf16_weight_grad(n, D, panels.data(), {dh.data(), n, P}, {grad.data(), P, D}, r0,
                                    std::min(P, r0 + 40), gs.data());
    }
    for (Index c = 0; c < P; ++c) {
      for (Index d = 0; d < D; ++d) {
        double s = 0.5, mag = 0.5;
        for (Index i = 0; i < n; ++i) {
          double const t = r16(dh[i * P + c]) * r16(x[i * D + d]);
          s += t;
          mag += std::fabs(t);
        }
        require_product(grad[c * D + d], s, mag, "grad", c * D + d);
      }
    }
  }
}

TEST_CASE("bf16 training: gradients within the documented tolerance of the fp32 layer's",
          "[training][bf16]") {
  // Gated shared experts, expert biases, two threads; T large enough that experts have rows
  // in several backward chunks and weight-gradient blocks.
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Sh>;
  Index const D = 24, F = 20, E = 4, T = 150;
  Layer layer(D, F, {E, 2, true, 1.0f}, Sh(1, D, 12));
  layer.experts().enable_biases();
  test::randomize_ffn(layer, 41);
  moe::fill_uniform(
      layer.experts().edit().parameters().last(static_cast<std::size_t>(E * (2 * F + D))), -0.2f,
      0.2f, 45);
  auto xf = test::random_vector(T * D, 42);
  auto dyf = test::random_vector(T * D, 43);
  moe::ThreadPool pool(2);

  auto run = [&](Layer& l, moe::ThreadPool* p, std::vector<float>& y, std::vector<float>& dx) {
    moe::MoeFfnWorkspace ws;
    y.assign(xf.size(), 0.0f);
    dx.assign(xf.size(), 0.0f);
    l.forward_train({xf.data(), T, D}, {y.data(), T, D}, ws, {nullptr, p});
    auto g = l.make_gradients();
    l.backward(ws, {dyf.data(), T, D}, {dx.data(), T, D}, g, p);
    return g;
  };
  std::vector<float> y32, dx32, y16, dx16, y16b, dx16b;
  auto g32 = run(layer, &pool, y32, dx32);
  Layer l16 = layer;
  l16.set_train_compute(experts::TrainCompute::kBf16);
  REQUIRE(l16.train_compute() == experts::TrainCompute::kBf16);
  REQUIRE(layer.train_compute() == experts::TrainCompute::kF32);
  auto g16 = run(l16, &pool, y16, dx16);

  // Every SECTION reruns the code outside them (Catch2): the finite differences, the slow part
  // (the double twin), are a section of their own so that they run once.
  SECTION("against the double twin's finite differences") {
    // The fp32 layer is the finite differences' stand-in (it matches them to ~1e-5:
    // test_backward.cpp); here the groups are compared with the double twin's finite differences
    // directly for the experts, as the documented bound is stated against them.
    ref::DoubleModel m;
    m.D = D;
    m.E = E;
    auto wr = layer.router_weight();
    m.router.assign(wr.data, wr.data + wr.rows * wr.cols);
    m.experts = ref::to_double(layer.experts());
    m.shared = ref::to_double(layer.shared_experts().bank());
    auto gw = layer.shared_experts().gate_weight();
    m.gate.assign(gw.data, gw.data + gw.rows * gw.cols);
    m.route = [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); };
    m.scores = [](std::vector<double> const& z) { return ref::softmax(z); };
    std::vector<double> x(xf.begin(), xf.end()), dy(dyf.begin(), dyf.end());
    auto fd_of = [&](std::vector<double>& v, Index stride) {
      std::vector<double> fd(v.size(), 0.0);
      for (Index i = 0; i < static_cast<Index>(v.size()); i += stride)
        fd[i] = ref::central_difference(m, v, i, x, dy, T);
      return fd;
    };
    // Every 7th expert parameter and every 5th input gradient (the double twin is slow).
    Index const wstride = 7, xstride = 5;
    auto fd_experts = fd_of(m.experts.params, wstride);
    auto fd_shared = fd_of(m.shared.params, wstride);
    auto fd_x = fd_of(x, xstride);
    auto sampled = [](std::span<float const> g, std::vector<double> const& fd, Index stride) {
      std::vector<float> a;
      std::vector<double> b;
      for (Index i = 0; i < static_cast<Index>(fd.size()); i += stride) {
        a.push_back(g[static_cast<std::size_t>(i)]);
        b.push_back(fd[static_cast<std::size_t>(i)]);
      }
      return rel_l2(a, b);
    };
    double const e32 = sampled(g32.experts.parameters(), fd_experts, wstride);
    double const e16 = sampled(g16.experts.parameters(), fd_experts, wstride);
    double const s16 = sampled(g16.shared.bank().parameters(), fd_shared, wstride);
    double const x16 = sampled(dx16, fd_x, xstride);
    std::vector<double> y32d(y32.begin(), y32.end());
    double const yerr = rel_l2(y16, y32d);
    std::vector<double> gr32(g32.router_weight.begin(), g32.router_weight.end());
    double const rerr = rel_l2(g16.router_weight, gr32);
    UNSCOPED_INFO("relative L2 errors: fp32 experts " << e32 << "; bf16 experts " << e16
                                                      << ", shared " << s16 << ", dx " << x16
                                                      << ", y " << yerr << ", router " << rerr);
    CHECK(e32 < 1e-4);  // control: the fp32 layer against the same finite differences
    // The documented bounds (docs/design.md, "bf16 compute"): 1e-2 of each gradient's norm.
    CHECK(e16 < 1e-2);
    CHECK(s16 < 1e-2);
    CHECK(x16 < 1e-2);
    CHECK(yerr < 1e-2);
    CHECK(rerr < 1e-2);
    // ... and the errors are those of bf16, not zero (the mode is not silently fp32).
    CHECK(e16 > 10 * e32);
    CHECK(yerr > 1e-5);
  }
  SECTION("bitwise identical for 1 and 2 threads") {
    Layer l1 = l16;
    auto g1 = run(l1, nullptr, y16b, dx16b);
    REQUIRE(y16b == y16);
    REQUIRE(dx16b == dx16);
    auto a = g1.groups();
    auto b = g16.groups();
    for (std::size_t i = 0; i < a.size(); ++i) {
      INFO(a[i].name);
      REQUIRE(std::memcmp(a[i].values.data(), b[i].values.data(), a[i].values.size() * 4) == 0);
    }
  }
  SECTION("an optimizer step rebuilds the bf16 copies; a forward while they are stale throws") {
    {
      auto params = l16.parameters();
      for (auto& p : params) {
        for (float& v : p.values) v *= 0.75f;
      }
      moe::MoeFfnWorkspace ws;
      std::vector<float> y(xf.size());
      REQUIRE_THROWS_WITH(l16.forward_train({xf.data(), T, D}, {y.data(), T, D}, ws),
                          Catch::Contains("not current"));
      REQUIRE_THROWS_WITH(l16.set_train_compute(experts::TrainCompute::kBf16),
                          Catch::Contains("open for writing"));
    }
    REQUIRE(l16.experts().train_panels_current());
    Layer fresh = l16;
    fresh.set_train_compute(experts::TrainCompute::kF32);
    fresh.set_train_compute(experts::TrainCompute::kBf16);
    std::vector<float> ya, dxa, yb, dxb;
    run(l16, nullptr, ya, dxa);
    run(fresh, nullptr, yb, dxb);
    REQUIRE(ya == yb);
    REQUIRE(dxa == dxb);
    // Back to fp32: the same bits as the fp32 layer with those weights.
    Layer back = l16;
    back.set_train_compute(experts::TrainCompute::kF32);
    REQUIRE_FALSE(back.experts().train_panels_current());
    Layer ref32 = layer;
    {
      auto params = ref32.parameters();
      for (auto& p : params) {
        for (float& v : p.values) v *= 0.75f;
      }
    }
    run(back, nullptr, ya, dxa);
    run(ref32, nullptr, yb, dxb);
    REQUIRE(ya == yb);
    REQUIRE(dxa == dxb);
  }
  SECTION("ParameterList::close and a step on a handed-over list rebuild on a pool, same bits") {
    l16.pack_weights(experts::WeightFormat::kBf16, &pool);
    Layer serial = l16;
    {
      auto params = serial.parameters();
      for (auto& p : params) {
        for (float& v : p.values) v *= 0.75f;
      }
    }  // rebuilt on this thread when the list goes
    auto params = l16.parameters();
    for (auto& p : params) {
      for (float& v : p.values) v *= 0.75f;
    }
    auto copy = params;
    auto const& bank = l16.experts();
    REQUIRE_FALSE(bank.train_panels_current());
    REQUIRE_FALSE(bank.packed());
    params.close(&pool);
    REQUIRE_FALSE(bank.editing());
    REQUIRE(bank.train_panels_current());
    REQUIRE(bank.packed());
    params.close(&pool);          // idempotent
    copy = moe::ParameterList{};  // the copy's end ends no other scope
    {
      auto again = l16.experts().edit();
      REQUIRE(bank.editing());
    }
    REQUIRE_FALSE(bank.editing());
    REQUIRE(bank.packed());
    std::vector<float> ya, dxa, yb, dxb;
    auto ga = run(l16, nullptr, ya, dxa);
    auto gb = run(serial, nullptr, yb, dxb);
    REQUIRE(ya == yb);
    REQUIRE(dxa == dxb);
    // An optimizer step on the temporary parameters() list closes it on the pool.
    moe::optim::Sgd opt_a(0.05), opt_b(0.05);
    opt_a.step(l16.parameters(), ga.groups(), &pool);
    REQUIRE_FALSE(bank.editing());
    REQUIRE(bank.train_panels_current());
    REQUIRE(bank.packed());
    {
      auto p = serial.parameters();
      opt_b.step(p, gb.groups());
      REQUIRE(serial.experts().editing());  // an lvalue list stays open until it goes
    }
    run(l16, nullptr, ya, dxa);
    run(serial, nullptr, yb, dxb);
    REQUIRE(ya == yb);
    REQUIRE(dxa == dxb);
    moe::MoeFfnWorkspace wa, wb;
    l16.forward({xf.data(), T, D}, {ya.data(), T, D}, wa, {nullptr, &pool});
    serial.forward({xf.data(), T, D}, {yb.data(), T, D}, wb);
    REQUIRE(ya == yb);
  }
  SECTION("inference forwards are unchanged by the mode") {
    std::vector<float> ya(xf.size()), yb(xf.size());
    moe::MoeFfnWorkspace wa, wb;
    layer.forward({xf.data(), T, D}, {ya.data(), T, D}, wa);
    l16.forward({xf.data(), T, D}, {yb.data(), T, D}, wb);
    REQUIRE(ya == yb);
  }
}

TEST_CASE("bf16 training: misuse is reported", "[training][bf16][errors]") {
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu>;
  Layer layer(16, 32, {4, 2, true, 1.0f});
  test::randomize_ffn(layer, 51);
  layer.pack_weights(experts::WeightFormat::kBf16);
  layer.discard_master_weights();
  REQUIRE_THROWS_WITH(layer.set_train_compute(experts::TrainCompute::kBf16),
                      Catch::Contains("discarded"));
}

TEST_CASE("bf16 training: MoeAttention (UMoE experts over the FFN's bank) against its fp32 run",
          "[training][bf16][attention]") {
  // The bank in bf16-compute mode serves the attention experts too; shared attention experts
  // in the same mode. y, dx and every gradient within the documented 1e-2 of the fp32 layer's
  // (whose gradients match finite differences: tests/attention/test_moe_attention.cpp), the
  // differences those of bf16, and 1 vs 2 threads bitwise.
  Index const D = 16, T = 37;
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  using Att = moe::MoeAttention<routing::SoftmaxTopK, experts::SwiGlu, Sh>;
  experts::ExpertBank<experts::SwiGlu> bank(4, D, 12);
  moe::fill_uniform(bank.edit().parameters(), -0.5f, 0.5f, 61);
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 8;
  c.q_rank = 4;
  c.rope = true;
  Att att(c, {4, 2, true, 1.0f}, bank, Sh(1, D, 10));
  {
    auto params = att.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      moe::fill_uniform(params[i].values, -0.5f, 0.5f, 62 + i);
    }
  }
  auto x = test::random_vector(T * D, 63);
  auto dy = test::random_vector(T * D, 64);
  struct Run {
    std::vector<float> y, dx;
    Att::Gradients g;
    experts::ExpertBank<experts::SwiGlu> ge;
  };
  auto run = [&](moe::ThreadPool* pool) {
    Run r{std::vector<float>(x.size()), std::vector<float>(x.size()), att.make_gradients(),
          experts::ExpertBank<experts::SwiGlu>(4, D, 12)};
    moe::MoeAttentionWorkspace ws;
    moe::AttentionOptions opt;
    opt.pool = pool;
    att.forward_train({x.data(), T, D}, {r.y.data(), T, D}, ws, opt);
    att.backward(ws, {dy.data(), T, D}, {r.dx.data(), T, D}, r.g, r.ge, pool);
    return r;
  };
  moe::ThreadPool pool(2);
  Run const f32 = run(&pool);
  bank.set_train_compute(experts::TrainCompute::kBf16);
  att.shared_experts().bank().set_train_compute(experts::TrainCompute::kBf16);
  Run b16 = run(&pool);
  auto as_double = [](std::span<float const> v) { return std::vector<double>(v.begin(), v.end()); };
  double const ey = rel_l2(b16.y, as_double(f32.y));
  double const edx = rel_l2(b16.dx, as_double(f32.dx));
  double const ee = rel_l2(b16.ge.parameters(), as_double(f32.ge.parameters()));
  double const es = rel_l2(b16.g.shared.bank().parameters(),
                           as_double(std::as_const(f32.g.shared).bank().parameters()));
  double const eq = rel_l2(b16.g.q_b, as_double(f32.g.q_b));
  UNSCOPED_INFO("relative L2 errors: y " << ey << ", dx " << edx << ", experts " << ee
                                         << ", shared " << es << ", q_b " << eq);
  CHECK(ey < 1e-2);
  CHECK(edx < 1e-2);
  CHECK(ee < 1e-2);
  CHECK(es < 1e-2);
  CHECK(eq < 1e-2);
  CHECK(ee > 1e-5);
  CHECK(ey > 1e-5);
  Run const one = run(nullptr);
  REQUIRE(one.y == b16.y);
  REQUIRE(one.dx == b16.dx);
  auto ga = one.ge.parameters();
  auto gb = b16.ge.parameters();
  REQUIRE(std::memcmp(ga.data(), gb.data(), ga.size() * 4) == 0);
}
