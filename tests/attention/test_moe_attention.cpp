// SPDX-License-Identifier: Apache-2.0
// MoeAttention (UMoE): forward against a double-precision twin, finite-difference gradients of
// every parameter (the layer's, the shared bank's and x), one expert with k = 1 equals
// single-head attention with identity values followed by the FFN, the bank is shared with an
// MoeFfn and gradients from both uses accumulate, causal masking, threads, errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention/umoe_reference.hpp"
#include "moe/core/random.hpp"
#include "moe/layers/gated_attention.hpp"
#include "moe/layers/moe_attention.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "support/finite_difference.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace gating = moe::gating;
namespace experts = moe::experts;
namespace routing = moe::routing;

namespace {

std::vector<float> random_vector(Index n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, lo, hi, seed);
  return v;
}

template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  auto params = layer.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    float const a = params[i].name == "router.weight" ? 1.0f : 0.6f;
    moe::fill_uniform(params[i].values, -a, a, seed + i);
  }
}

aref::Vec copy(std::span<float> s) { return aref::Vec(s.begin(), s.end()); }

template <class Layer, class Bank>
aref::DoubleUmoe twin(Layer& layer, Bank const& bank, Index batch,
                      std::function<ref::Routing(ConstMatrixView<double>)> route) {
  auto const& c = layer.config();
  aref::DoubleUmoe m;
  m.D = c.d_model;
  m.E = layer.num_experts();
  m.dk = c.qk_dim;
  m.rk = c.q_rank;
  m.w = Layer::Gate::width(c.d_model);
  m.batch = batch;
  m.rd = c.rotary_dim;
  m.residual = c.residual_query;
  m.rope = c.rope;
  m.causal = c.causal;
  m.theta = c.rope_theta;
  m.scale = c.scale;
  m.window = c.sliding_window;
  m.route = std::move(route);
  for (auto const& p : layer.parameters()) {
    if (p.name == "router.weight") m.router = copy(p.values);
    if (p.name == "q_a_proj.weight" || p.name == "q_proj.weight") m.q_a = copy(p.values);
    if (p.name == "q_b_proj.weight") m.q_b = copy(p.values);
    if (p.name == "q_res_proj.weight") m.q_res = copy(p.values);
    if (p.name == "k_proj.weight") m.k_proj = copy(p.values);
    if (p.name == "shared_q_proj.weight") m.shared_q = copy(p.values);
    if (p.name == "gate_proj.weight") m.gate_proj = copy(p.values);
    if (p.name == "shared_experts.gate") m.shared_gate = copy(p.values);
    if (p.name == "sinks") m.sinks = copy(p.values);
  }
  m.experts = ref::to_double(bank);
  if constexpr (Layer::Shared::has_experts)
    m.shared = ref::to_double(layer.shared_experts().bank());
  return m;
}

aref::Vec* twin_buffer(aref::DoubleUmoe& m, std::string_view name) {
  if (name == "router.weight") return &m.router;
  if (name == "q_a_proj.weight" || name == "q_proj.weight") return &m.q_a;
  if (name == "q_b_proj.weight") return &m.q_b;
  if (name == "q_res_proj.weight") return &m.q_res;
  if (name == "k_proj.weight") return &m.k_proj;
  if (name == "shared_q_proj.weight") return &m.shared_q;
  if (name == "gate_proj.weight") return &m.gate_proj;
  if (name == "shared_experts") return &m.shared.params;
  if (name == "sinks") return &m.sinks;
  return &m.shared_gate;
}

template <class Layer, class Bank>
void check_layer(Layer& layer, Bank const& bank, Index T, moe::AttentionOptions opt,
                 std::function<ref::Routing(ConstMatrixView<double>)> route) {
  Index const D = layer.d_model();
  auto xf = random_vector(T * D, 701);
  auto dyf = random_vector(T * D, 702);
  auto m = twin(layer, bank, opt.batch, route);
  if (!opt.key_mask.empty()) m.key_mask.assign(opt.key_mask.begin(), opt.key_mask.end());
  std::vector<float> y(xf.size()), dx(xf.size()), y2(xf.size());
  moe::MoeAttentionWorkspace ws, ws2;
  layer.forward_train({xf.data(), T, D}, {y.data(), T, D}, ws, opt);
  layer.forward({xf.data(), T, D}, {y2.data(), T, D}, ws2, opt);
  REQUIRE(y == y2);
  aref::Vec x(xf.begin(), xf.end()), dy(dyf.begin(), dyf.end());
  REQUIRE(aref::rel_err(y.data(), m.forward(x, T)) < 2e-5);
  auto grads = layer.make_gradients();
  Bank bank_grads(bank.num_experts(), bank.d_model(), bank.d_ffn());
  layer.backward(ws, {dyf.data(), T, D}, {dx.data(), T, D}, grads, bank_grads, opt.pool);
  auto gb = bank_grads.parameters();
  for (Index i = 0; i < static_cast<Index>(gb.size()); ++i) {
    ref::require_close(gb[i], ref::central_difference(m, m.experts.params, i, x, dy, T), "experts",
                       i);
  }
  ref::require_gradients(m, grads.groups(), twin_buffer, x, dy, T, dx.data());
}

}  // namespace

TEST_CASE(
    "MoeAttention gradients match finite differences (UMoE config: low rank, residual, "
    "gated shared expert, headwise gate)",
    "[attention][umoe][grad]") {
  Index const D = 6, F = 5;
  experts::ExpertBank<experts::SiluMlp> bank(4, D, F);  // UMoE VanillaMLP: down(silu(gate x))
  moe::fill_uniform(bank.edit().parameters(), -0.6f, 0.6f, 81);
  using Sh = experts::GatedSharedExperts<experts::SiluMlp>;
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 4;
  c.q_rank = 3;
  c.residual_query = true;
  c.rope = true;
  c.rope_theta = 50.0f;
  moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp, Sh, gating::HeadwiseGate> layer(
      c, {4, 2, false, 1.0f}, bank, Sh(1, D, 3));
  randomize(layer, 82);
  std::vector<std::uint8_t> mask = {0, 1, 1, 1, 1, 1, 1, 0, 1, 1};
  moe::AttentionOptions opt;
  opt.batch = 2;
  opt.key_mask = mask;
  check_layer(layer, bank, 10, opt, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
}

TEST_CASE(
    "MoeAttention gradients match finite differences (full-rank queries, elementwise "
    "gate, non-causal, SwiGLU experts, two threads)",
    "[attention][umoe][grad]") {
  Index const D = 5;
  experts::ExpertBank<experts::SwiGlu> bank(3, D, 4);
  moe::fill_uniform(bank.edit().parameters(), -0.6f, 0.6f, 91);
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 3;
  c.causal = false;
  moe::MoeAttention<routing::TopKSoftmax, experts::SwiGlu, experts::NoSharedExperts,
                    gating::ElementwiseGate>
      layer(c, {3, 2}, bank);
  randomize(layer, 92);
  moe::ThreadPool pool(2);
  moe::AttentionOptions opt;
  opt.pool = &pool;
  check_layer(layer, bank, 7, opt, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
}

TEST_CASE(
    "MoeAttention gradients match finite differences (no gate, two ungated shared "
    "experts)",
    "[attention][umoe][grad]") {
  Index const D = 6;
  experts::ExpertBank<experts::GeluMlp> bank(3, D, 4);
  moe::fill_uniform(bank.edit().parameters(), -0.6f, 0.6f, 95);
  using Sh = experts::UngatedSharedExperts<experts::SiluMlp>;
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 4;
  c.q_rank = 2;
  c.rope = true;
  moe::MoeAttention<routing::SoftmaxTopK, experts::GeluMlp, Sh> layer(c, {3, 1, false, 1.0f}, bank,
                                                                      Sh(2, D, 3));
  randomize(layer, 96);
  check_layer(layer, bank, 8, {}, [](auto z) { return ref::softmax_top_k(z, 1, false, 1.0); });
}

TEST_CASE(
    "MoeAttention gradients match finite differences (sliding window and sinks, a gated "
    "shared expert, padding, two sequences)",
    "[attention][umoe][grad][window][sinks]") {
  Index const D = 6;
  experts::ExpertBank<experts::SiluMlp> bank(4, D, 5);
  moe::fill_uniform(bank.edit().parameters(), -0.6f, 0.6f, 121);
  using Sh = experts::GatedSharedExperts<experts::SiluMlp>;
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 4;
  c.q_rank = 3;
  c.rope = true;
  c.sliding_window = 3;
  c.sinks = true;
  moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp, Sh, gating::HeadwiseGate> layer(
      c, {4, 2, false, 1.0f}, bank, Sh(1, D, 3));
  randomize(layer, 122);
  REQUIRE(layer.sinks().size() == 5);  // 4 routed experts, 1 shared
  for (Index w : {Index{3}, Index{1}}) {
    INFO("window " << w);
    auto c2 = c;
    c2.sliding_window = w;
    moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp, Sh, gating::HeadwiseGate> lw(
        c2, {4, 2, false, 1.0f}, bank, Sh(1, D, 3));
    randomize(lw, 122);
    std::vector<std::uint8_t> mask = {1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1};
    moe::AttentionOptions opt;
    opt.batch = 2;
    opt.key_mask = mask;
    check_layer(lw, bank, 12, opt, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
  }
  // Sinks alone (no window), one sequence, two threads.
  auto c3 = c;
  c3.sliding_window = 0;
  moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp, Sh, gating::HeadwiseGate> ls(
      c3, {4, 2, false, 1.0f}, bank, Sh(1, D, 3));
  randomize(ls, 123);
  moe::ThreadPool pool(2);
  moe::AttentionOptions opt;
  opt.pool = &pool;
  check_layer(ls, bank, 9, opt, [](auto z) { return ref::softmax_top_k(z, 2, false, 1.0); });
}

TEST_CASE(
    "MoeAttention: with a window of 1 it is the MoE FFN of the token itself; sinks of -200 "
    "are no sinks, sinks of +200 take all the mass",
    "[attention][umoe][window][sinks]") {
  // Hand-checkable limits. Window 1: every query sees only its own token, so the mixed vector
  // is x_t and the layer (no gate, no shared experts) is an MoeFfn with the same router and
  // bank. Sinks of -200: exp(-200 - s) underflows, so the layer equals the one without sinks.
  // Sinks of +200: the keys' terms underflow, the mixed vectors are 0, and so is SwiGLU(0).
  Index const T = 70, D = 8;  // T spans two key blocks
  using Ffn = moe::MoeFfn<routing::TopKSoftmax, experts::SwiGlu>;
  Ffn ffn(D, 6, {3, 2});
  moe::fill_uniform(ffn.experts().edit().parameters(), -0.5f, 0.5f, 131);
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 4;
  c.rope = true;
  using L = moe::MoeAttention<routing::TopKSoftmax, experts::SwiGlu>;
  auto x = random_vector(T * D, 133);
  std::vector<float> y0(x.size()), y1(x.size()), yf(x.size());
  moe::MoeAttentionWorkspace ws;
  c.sliding_window = 1;
  L one(c, {3, 2}, ffn.experts());
  randomize(one, 132);
  auto wr = one.router_weight(), wf = ffn.router_weight();
  std::copy(wr.data, wr.data + wr.rows * wr.cols, wf.data);
  one.forward({x.data(), T, D}, {y1.data(), T, D}, ws);
  moe::MoeFfnWorkspace fws;
  ffn.forward({x.data(), T, D}, {yf.data(), T, D}, fws);
  double max_y = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    REQUIRE(y1[i] == Approx(yf[i]).margin(1e-5));
    max_y = std::max(max_y, static_cast<double>(std::fabs(yf[i])));
  }
  REQUIRE(max_y > 1e-3);

  c.sliding_window = 0;
  L plain(c, {3, 2}, ffn.experts());
  randomize(plain, 132);
  c.sinks = true;
  L sunk(c, {3, 2}, ffn.experts());
  randomize(sunk, 132);
  std::fill(sunk.sinks().begin(), sunk.sinks().end(), -200.0f);
  plain.forward({x.data(), T, D}, {y0.data(), T, D}, ws);
  sunk.forward({x.data(), T, D}, {y1.data(), T, D}, ws);
  REQUIRE(y0 == y1);
  std::fill(sunk.sinks().begin(), sunk.sinks().end(), 200.0f);
  sunk.forward({x.data(), T, D}, {y1.data(), T, D}, ws);
  for (float v : y1) REQUIRE(std::fabs(v) <= 1e-6f);
}

TEST_CASE(
    "UMoE with one expert and k = 1 equals single-head attention with identity values "
    "followed by the FFN; both uses share the bank and accumulate its gradient",
    "[attention][umoe]") {
  Index const T = 70, D = 12, F = 10, r = 4;  // T spans two key blocks
  using Ffn = moe::MoeFfn<routing::SoftmaxTopK, experts::SiluMlp>;
  Ffn ffn(D, F, {1, 1, false, 1.0f});
  moe::fill_uniform(ffn.experts().edit().parameters(), -0.4f, 0.4f, 101);
  auto wr = ffn.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(D)), -1.0f, 1.0f, 102);
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = D;  // single-head attention with identity values needs head_dim = D
  c.q_rank = r;
  c.residual_query = true;
  c.rope = true;
  moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp> umoe(c, {1, 1, false, 1.0f},
                                                                 ffn.experts());
  randomize(umoe, 103);
  REQUIRE(&umoe.experts() == &ffn.experts());

  // The same attention as a GatedAttention: q_proj = W_qb W_qa + W_qres, v_proj = o_proj = I.
  moe::GatedAttentionConfig gc;
  gc.d_model = D;
  gc.num_heads = gc.num_kv_heads = 1;
  gc.head_dim = D;
  gc.rope = true;
  moe::GatedAttention<gating::NoGate> attn(gc);
  auto qa = umoe.q_a_proj(0), qb = umoe.q_b_proj(0), qres = umoe.q_res_proj();
  for (Index i = 0; i < D; ++i) {
    for (Index j = 0; j < D; ++j) {
      double v = qres(i, j);
      for (Index k = 0; k < r; ++k) v += static_cast<double>(qb(i, k)) * qa(k, j);
      attn.q_proj()(i, j) = static_cast<float>(v);
      attn.v_proj()(i, j) = attn.o_proj()(i, j) = i == j ? 1.0f : 0.0f;
    }
  }
  auto kp = umoe.k_proj();
  std::copy(kp.data, kp.data + D * D, attn.k_proj().data);

  auto x = random_vector(T * D, 104);
  std::vector<float> y_umoe(x.size()), mid(x.size()), y_ref(x.size());
  moe::MoeAttentionWorkspace ws;
  umoe.forward({x.data(), T, D}, {y_umoe.data(), T, D}, ws);
  moe::GatedAttentionWorkspace aws;
  attn.forward({x.data(), T, D}, {mid.data(), T, D}, aws);
  moe::MoeFfnWorkspace fws;
  ffn.forward({mid.data(), T, D}, {y_ref.data(), T, D}, fws);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(y_umoe[i] == Approx(y_ref[i]).margin(2e-5));

  // Gradients of the shared bank: attention use + FFN use into one gradient bank.
  auto dy = random_vector(T * D, 105);
  std::vector<float> y(x.size()), dx(x.size());
  auto fg = ffn.make_gradients();
  auto ag = umoe.make_gradients();
  ffn.forward_train({x.data(), T, D}, {y.data(), T, D}, fws);
  ffn.backward(fws, {dy.data(), T, D}, {dx.data(), T, D}, fg);
  std::vector<float> ffn_only(fg.experts.parameters().begin(), fg.experts.parameters().end());
  umoe.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
  umoe.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, ag, fg.experts);
  auto alone = ffn.make_gradients();
  umoe.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
  umoe.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, ag, alone.experts);
  auto both = fg.experts.parameters();
  auto att = alone.experts.parameters();
  double max_att = 0.0;
  for (std::size_t i = 0; i < both.size(); ++i) {
    REQUIRE(both[i] == Approx(ffn_only[i] + att[i]).margin(1e-5));
    max_att = std::max(max_att, static_cast<double>(std::fabs(att[i])));
  }
  REQUIRE(max_att > 1e-3);  // the attention use contributes a real gradient
}

TEST_CASE(
    "MoeAttention: causal masking leaks nothing from the future; threads are bitwise "
    "identical",
    "[attention][umoe][mask][determinism]") {
  Index const T = 150, D = 16;
  experts::ExpertBank<experts::SwiGlu> bank(6, D, 12);
  moe::fill_uniform(bank.edit().parameters(), -0.3f, 0.3f, 111);
  using Sh = experts::GatedSharedExperts<experts::SwiGlu>;
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 8;
  c.q_rank = 4;
  c.residual_query = true;
  c.rope = true;
  moe::MoeAttention<routing::SoftmaxTopK, experts::SwiGlu, Sh, gating::ElementwiseGate> layer(
      c, {6, 2, false, 1.0f}, bank, Sh(1, D, 8));
  randomize(layer, 112);
  auto x = random_vector(T * D, 113);
  std::vector<float> y0(x.size()), y1(x.size());
  moe::MoeAttentionWorkspace ws;
  layer.forward({x.data(), T, D}, {y0.data(), T, D}, ws);
  for (Index t0 : {5, 64, 100}) {
    auto x2 = x;
    for (Index i = t0 * D; i < T * D; ++i) x2[i] = -x2[i];
    layer.forward({x2.data(), T, D}, {y1.data(), T, D}, ws);
    REQUIRE(std::memcmp(y0.data(), y1.data(), static_cast<std::size_t>(t0 * D) * 4) == 0);
  }
  // A packed bank (ExpertBank::pack) gives the same output up to rounding (experts with fewer
  // than 8 rows take the dot-product path when unpacked).
  bank.pack();
  REQUIRE(bank.packed());
  layer.forward({x.data(), T, D}, {y1.data(), T, D}, ws);
  for (std::size_t i = 0; i < y0.size(); ++i) REQUIRE(y1[i] == Approx(y0[i]).margin(1e-5));
  // 1 vs 2 threads, forward and backward, batch of two sequences.
  auto dy = random_vector(T * D, 114);
  moe::ThreadPool pool(2);
  std::vector<float> ya(x.size()), yb(x.size()), dxa(x.size()), dxb(x.size());
  moe::MoeAttentionWorkspace wa, wb;
  moe::AttentionOptions oa, ob;
  oa.batch = ob.batch = 2;
  ob.pool = &pool;
  layer.forward_train({x.data(), T, D}, {ya.data(), T, D}, wa, oa);
  layer.forward_train({x.data(), T, D}, {yb.data(), T, D}, wb, ob);
  REQUIRE(ya == yb);
  auto ga = layer.make_gradients();
  auto gb = layer.make_gradients();
  experts::ExpertBank<experts::SwiGlu> ea(6, D, 12), eb(6, D, 12);
  layer.backward(wa, {dy.data(), T, D}, {dxa.data(), T, D}, ga, ea);
  layer.backward(wb, {dy.data(), T, D}, {dxb.data(), T, D}, gb, eb, &pool);
  REQUIRE(dxa == dxb);
  REQUIRE(std::equal(ea.parameters().begin(), ea.parameters().end(), eb.parameters().begin()));
  auto la = ga.groups();
  auto lb = gb.groups();
  REQUIRE(la.size() == lb.size());
  for (std::size_t i = 0; i < la.size(); ++i) {
    INFO(la[i].name);
    REQUIRE(std::memcmp(la[i].values.data(), lb[i].values.data(), la[i].values.size() * 4) == 0);
  }
}

TEST_CASE("MoeAttention reports bad input clearly", "[attention][umoe]") {
  Index const D = 6;
  experts::ExpertBank<experts::SwiGlu> bank(4, D, 5), other(3, D, 5);
  moe::MoeAttentionConfig c;
  c.d_model = D;
  c.qk_dim = 4;
  using Layer = moe::MoeAttention<routing::SoftmaxTopK, experts::SwiGlu>;
  REQUIRE_THROWS_WITH(Layer(c, {3, 2, false, 1.0f}, bank),
                      Catch::Contains("the expert bank has 4 experts"));
  c.rope = true;
  c.rotary_dim = 5;
  REQUIRE_THROWS_WITH(Layer(c, {4, 2, false, 1.0f}, bank), Catch::Contains("even rotary_dim"));
  c.rope = false;
  REQUIRE_THROWS_WITH(Layer(c, {4, 5, false, 1.0f}, bank), Catch::Contains("top_k"));
  c.causal = false;
  c.sliding_window = 4;
  REQUIRE_THROWS_WITH(Layer(c, {4, 2, false, 1.0f}, bank),
                      Catch::Contains("a window needs causal attention"));
  c.causal = true;
  c.sliding_window = -1;
  REQUIRE_THROWS_WITH(Layer(c, {4, 2, false, 1.0f}, bank), Catch::Contains("sliding_window = -1"));
  c.sliding_window = 0;
  Layer layer(c, {4, 2, false, 1.0f}, bank);
  std::vector<float> x(60, 0.1f), y(60), dx(60);
  moe::MoeAttentionWorkspace ws;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 12, 5}, {y.data(), 12, 5}, ws),
                      Catch::Contains("x has 5 columns but d_model = 6"));
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 10, 6}, {x.data(), 10, 6}, ws),
                      Catch::Contains("y aliases x"));
  moe::AttentionOptions opt;
  opt.batch = 4;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 10, 6}, {y.data(), 10, 6}, ws, opt),
                      Catch::Contains("batch = 4 does not divide the 10 tokens"));
  auto g = layer.make_gradients();
  experts::ExpertBank<experts::SwiGlu> eg(4, D, 5);
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g, eg),
                      Catch::Contains("call forward_train first"));
  layer.forward_train({x.data(), 10, 6}, {y.data(), 10, 6}, ws);
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g, other),
                      Catch::Contains("expert_grads is not shaped like the expert bank"));
  REQUIRE_THROWS_WITH(layer.bind_experts(other), Catch::Contains("the expert bank has 3"));
  // A workspace another layer filled is refused (the layer's stamp), not read.
  Layer twin(c, {4, 2, false, 1.0f}, bank);
  REQUIRE_THROWS_WITH(twin.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g, eg),
                      Catch::Contains("filled by another layer"));
  REQUIRE_NOTHROW(layer.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g, eg));
}

TEST_CASE("MoeAttention KV cache: prefill and decode steps equal the full recompute",
          "[attention][umoe][cache][window][sinks]") {
  // UMoE config with every part: low-rank + residual queries, RoPE, a gated shared expert with
  // its own query, a headwise gate; three sequences of different lengths, one joining later.
  Index const D = 8, F = 6;
  experts::ExpertBank<experts::SiluMlp> bank(4, D, F);
  moe::fill_uniform(bank.edit().parameters(), -0.6f, 0.6f, 91);
  using Sh = experts::GatedSharedExperts<experts::SiluMlp>;
  for (int const variant : {0, 1, 2}) {  // 1: a sliding window and sinks; 2: a bf16 cache
    bool const extras = variant == 1, bf16 = variant == 2;
    INFO((extras ? "window 5, sinks" : "no window, no sinks") << (bf16 ? ", bf16 cache" : ""));
    moe::MoeAttentionConfig c;
    c.d_model = D;
    c.qk_dim = 4;
    c.q_rank = 3;
    c.residual_query = true;
    c.rope = true;
    c.rope_theta = 50.0f;
    c.sliding_window = extras ? 5 : 0;
    c.sinks = extras;
    moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp, Sh, gating::HeadwiseGate> layer(
        c, {4, 2, false, 1.0f}, bank, Sh(1, D, 3));
    randomize(layer, 92);
    moe::ThreadPool pool(2);
    Index const S = 3;
    std::vector<std::vector<Index>> const calls = {{6, 11, 0}, {1, 1, 0}, {1, 1, 8},
                                                   {2, 0, 1},  {1, 1, 1}, {0, 1, 1}};
    std::vector<std::vector<float>> seq(S);
    auto cache = moe::KvCache::with_widths(S, c.qk_dim, D, 2,
                                           bf16 ? moe::KvFormat::kBf16 : moe::KvFormat::kF32);
    REQUIRE(cache.bytes_per_token() == (4 + 8) * (bf16 ? 2u : 4u));
    moe::MoeAttentionWorkspace ws, full_ws;
    std::uint64_t seed = 950;
    for (std::size_t k = 0; k < calls.size(); ++k) {
      INFO("call " << k);
      std::vector<float> x;
      for (Index s = 0; s < S; ++s) {
        auto const part = random_vector(calls[k][s] * D, seed++);
        x.insert(x.end(), part.begin(), part.end());
        seq[s].insert(seq[s].end(), part.begin(), part.end());
      }
      Index const T = static_cast<Index>(x.size()) / D;
      std::vector<float> y(x.size());
      layer.forward_cached({x.data(), T, D}, {y.data(), T, D}, cache, calls[k], ws, &pool);
      Index row = 0;
      for (Index s = 0; s < S; ++s) {
        Index const n = calls[k][s], len = static_cast<Index>(seq[s].size()) / D;
        REQUIRE(cache.length(s) == len);
        if (n == 0) continue;
        std::vector<float> yf(seq[s].size());
        layer.forward({seq[s].data(), len, D}, {yf.data(), len, D}, full_ws, {&pool});
        double scale = 0.0, diff = 0.0;
        for (Index i = 0; i < n * D; ++i) {
          double const want = yf[static_cast<std::size_t>((len - n) * D + i)];
          scale = std::max(scale, std::fabs(want));
          diff = std::max(diff, std::fabs(y[static_cast<std::size_t>(row * D + i)] - want));
        }
        INFO("sequence " << s << ": max |diff| " << diff << " of max |y| " << scale);
        REQUIRE(scale > 1e-3);
        // bf16: the keys and the hidden states (UMoE's values) rounded by 2^-9 at most.
        REQUIRE(diff <= (bf16 ? 2e-2 : 1e-5) * scale);
        if (bf16) REQUIRE(cache.values_bf16(s).size() == static_cast<std::size_t>(len * D));
        row += n;
      }
    }
    moe::KvCache wrong(S, 4);
    std::vector<float> x(static_cast<std::size_t>(D)), y(x.size());
    std::vector<Index> const one = {1, 0, 0};
    REQUIRE_THROWS_WITH(layer.forward_cached({x.data(), 1, D}, {y.data(), 1, D}, wrong, one, ws),
                        Catch::Contains("with_widths"));
    moe::KvCache windowed(S, 4, 0, moe::KvFormat::kF32, 5);
    REQUIRE_THROWS_WITH(layer.forward_cached({x.data(), 1, D}, {y.data(), 1, D}, windowed, one, ws),
                        Catch::Contains("window"));
  }
}
