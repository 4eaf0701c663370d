// SPDX-License-Identifier: Apache-2.0
// GatedAttention: forward against a double-precision twin, finite-difference gradients of every
// parameter and of x, the gate limits (+inf: ungated, -inf: zero), headwise == elementwise for
// equal gates, the three weight layouts agree for permuted weights, causal and padding masks leak
// nothing, determinism across threads, and the errors for bad input.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <span>
#include <vector>

#include "attention/gated_reference.hpp"
#include "moe/core/random.hpp"
#include "moe/layers/gated_attention.hpp"
#include "support/finite_difference.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace gating = moe::gating;

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
    bool const norm = params[i].name.find("norm") != std::string_view::npos;
    float const base = norm && layer.config().qk_norm == moe::QkNorm::kRmsNorm ? 1.0f : 0.0f;
    moe::fill_uniform(params[i].values, base - 0.5f, base + 0.5f, seed + i);
  }
}

template <class Layer>
aref::DoubleGatedAttention twin(Layer& layer, Index batch) {
  auto const& c = layer.config();
  aref::DoubleGatedAttention m;
  m.D = c.d_model;
  m.H = c.num_heads;
  m.KV = c.num_kv_heads;
  m.dh = c.head_dim;
  m.w = layer.gate_width();
  m.layout = c.gate_layout == moe::GateLayout::kSeparate           ? m.kSeparate
             : c.gate_layout == moe::GateLayout::kPackedPerKvGroup ? m.kPerGroup
                                                                   : m.kPerHead;
  m.norm = c.qk_norm == moe::QkNorm::kNone                ? m.kNone
           : c.qk_norm == moe::QkNorm::kRmsNorm           ? m.kRms
           : c.qk_norm == moe::QkNorm::kRmsNormUnweighted ? m.kUnweighted
                                                          : m.kRmsOnePlus;
  m.norm_all_heads = c.qk_norm_scope == moe::QkNormScope::kAllHeads;
  m.eps = c.norm_eps;
  m.rope = c.rope;
  m.theta = c.rope_theta;
  m.rd = c.rotary_dim;
  m.yarn_factor = c.yarn.factor;
  m.beta_fast = c.yarn.beta_fast;
  m.beta_slow = c.yarn.beta_slow;
  m.yarn_attention = c.yarn.attention_factor;
  m.yarn_original = c.yarn.original_max_position;
  m.yarn_truncate = c.yarn.truncate;
  m.interleaved = c.rope_interleaved;
  m.scale = c.scale;
  m.causal = c.causal;
  m.window = c.sliding_window;
  m.chunk = c.attention_chunk;
  m.llama3_factor = c.llama3.factor;
  m.low_freq_factor = c.llama3.low_freq_factor;
  m.high_freq_factor = c.llama3.high_freq_factor;
  m.llama3_original = c.llama3.original_max_position;
  m.temperature_floor = c.temperature_floor;
  m.temperature_scale = c.temperature_scale;
  m.batch = batch;
  auto copy = [](auto src) { return aref::Vec(src.begin(), src.end()); };
  for (auto const& p : layer.parameters()) {
    if (p.name == "q_proj.weight") m.q_proj = copy(p.values);
    if (p.name == "gate_proj.weight") m.gate_proj = copy(p.values);
    if (p.name == "k_proj.weight") m.k_proj = copy(p.values);
    if (p.name == "v_proj.weight") m.v_proj = copy(p.values);
    if (p.name == "o_proj.weight") m.o_proj = copy(p.values);
    if (p.name == "q_norm.weight") m.q_norm = copy(p.values);
    if (p.name == "k_norm.weight") m.k_norm = copy(p.values);
    if (p.name == "sinks") m.sinks = copy(p.values);
    if (p.name == "q_proj.bias") m.q_bias = copy(p.values);
    if (p.name == "k_proj.bias") m.k_bias = copy(p.values);
    if (p.name == "v_proj.bias") m.v_bias = copy(p.values);
    if (p.name == "o_proj.bias") m.o_bias = copy(p.values);
  }
  return m;
}

aref::Vec* twin_buffer(aref::DoubleGatedAttention& m, std::string_view name) {
  if (name == "q_proj.weight") return &m.q_proj;
  if (name == "gate_proj.weight") return &m.gate_proj;
  if (name == "k_proj.weight") return &m.k_proj;
  if (name == "v_proj.weight") return &m.v_proj;
  if (name == "o_proj.weight") return &m.o_proj;
  if (name == "q_norm.weight") return &m.q_norm;
  if (name == "sinks") return &m.sinks;
  if (name == "q_proj.bias") return &m.q_bias;
  if (name == "k_proj.bias") return &m.k_bias;
  if (name == "v_proj.bias") return &m.v_bias;
  if (name == "o_proj.bias") return &m.o_bias;
  return &m.k_norm;
}

struct Run {
  std::vector<float> y, dx;
  moe::GatedAttentionWorkspace ws;
};

/// Forward against the twin, then backward against central differences for every parameter
/// and x.
template <class Layer>
void check_layer(Layer& layer, Index T, moe::AttentionOptions opt, bool gradients = true) {
  Index const D = layer.d_model();
  auto xf = random_vector(T * D, 901);
  auto dyf = random_vector(T * D, 902);
  auto m = twin(layer, opt.batch);
  if (!opt.key_mask.empty()) m.key_mask.assign(opt.key_mask.begin(), opt.key_mask.end());
  if (!opt.positions.empty()) m.positions.assign(opt.positions.begin(), opt.positions.end());
  Run r;
  r.y.resize(xf.size());
  r.dx.resize(xf.size());
  layer.forward_train({xf.data(), T, D}, {r.y.data(), T, D}, r.ws, opt);
  aref::Vec x(xf.begin(), xf.end()), dy(dyf.begin(), dyf.end());
  aref::Vec const want = m.forward(x, T);
  REQUIRE(aref::rel_err(r.y.data(), want) < 2e-5);
  std::vector<float> y2(xf.size());
  moe::GatedAttentionWorkspace ws2;
  layer.forward({xf.data(), T, D}, {y2.data(), T, D}, ws2, opt);
  REQUIRE(y2 == r.y);  // inference and training forwards agree bitwise
  if (!gradients) return;
  auto grads = layer.make_gradients();
  layer.backward(r.ws, {dyf.data(), T, D}, {r.dx.data(), T, D}, grads, opt.pool);
  ref::require_gradients(m, grads.groups(), twin_buffer, x, dy, T, r.dx.data());
}

moe::GatedAttentionConfig small_config(Index heads, Index kv, moe::GateLayout layout) {
  moe::GatedAttentionConfig c;
  c.d_model = 6;
  c.num_heads = heads;
  c.num_kv_heads = kv;
  c.head_dim = 4;
  c.gate_layout = layout;
  return c;
}

}  // namespace

TEST_CASE("GatedAttention gradients match finite differences (elementwise, Qwen3-Next style)",
          "[attention][gated][grad]") {
  auto c = small_config(4, 2, moe::GateLayout::kPackedPerHead);
  c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
  c.rope = true;
  c.rope_theta = 100.0f;
  c.rotary_dim = 2;  // partial RoPE, as Qwen3-Next's partial_rotary_factor
  moe::GatedAttention<gating::ElementwiseGate> layer(c);
  randomize(layer, 11);
  check_layer(layer, 7, {});
}

TEST_CASE("GatedAttention with sinks and a sliding window (gpt-oss): twin and finite differences",
          "[attention][gated][grad]") {
  for (Index const window : {Index{0}, Index{3}}) {
    DYNAMIC_SECTION("sliding_window " << window) {
      auto c = small_config(4, 2, moe::GateLayout::kSeparate);
      c.rope = true;
      c.sinks = true;
      c.sliding_window = window;
      moe::GatedAttention<gating::NoGate> layer(c);
      randomize(layer, 15);
      REQUIRE(layer.sinks().size() == 4);
      check_layer(layer, 9, {});
      moe::AttentionOptions opt;  // two sequences: the window restarts with each
      opt.batch = 2;
      check_layer(layer, 10, opt);
    }
  }
}

/// Llama 4's two attention layers: RoPE layers (interleaved pairs, Llama 3 scaling, an
/// unweighted q/k RMSNorm after RoPE, chunked causal masks) and NoPE layers (no RoPE, no norm,
/// full causal attention, queries scaled by the temperature of their position).
moe::GatedAttentionConfig llama4_config(bool rope_layer) {
  auto c = small_config(4, 2, moe::GateLayout::kSeparate);
  c.rope = rope_layer;
  c.rope_interleaved = true;
  c.rope_theta = 500.0f;
  if (rope_layer) {
    c.qk_norm = moe::QkNorm::kRmsNormUnweighted;
    c.attention_chunk = 3;
    // L0 = 8: the wavelengths of theta = 500 at d = 4 (6.3 and 140) fall on both sides
    c.llama3 = {.factor = 4.0f,
                .low_freq_factor = 1.0f,
                .high_freq_factor = 2.0f,
                .original_max_position = 8};
  } else {
    c.temperature_floor = 2;
    c.temperature_scale = 0.5f;
  }
  return c;
}

TEST_CASE(
    "GatedAttention as Llama 4's RoPE (chunked) and NoPE (temperature) layers: twin and "
    "finite differences",
    "[attention][gated][grad][llama4]") {
  for (bool const rope_layer : {true, false}) {
    DYNAMIC_SECTION((rope_layer ? "RoPE layer" : "NoPE layer")) {
      moe::GatedAttention<gating::NoGate> layer(llama4_config(rope_layer));
      randomize(layer, rope_layer ? 41 : 42);
      REQUIRE(layer.q_norm().empty());  // the unweighted norm has no parameter
      check_layer(layer, 8, {});
      moe::AttentionOptions opt;  // two sequences: chunks and positions restart with each
      opt.batch = 2;
      check_layer(layer, 10, opt);
    }
  }
  SECTION("the masks and factors matter: the twin without each differs") {
    for (int change = 0; change < 4; ++change) {
      moe::GatedAttention<gating::NoGate> layer(llama4_config(change < 3));
      randomize(layer, 43);
      Index const T = 8, D = layer.d_model();
      auto const xf = random_vector(T * D, 44);
      aref::Vec const x(xf.begin(), xf.end());
      auto const m = twin(layer, 1);
      auto other = m;
      if (change == 0) other.chunk = 0;
      if (change == 1) other.llama3_factor = 0.0;
      if (change == 2) other.norm = other.kNone;
      if (change == 3) other.temperature_floor = 0;
      aref::Vec const want = m.forward(x, T), got = other.forward(x, T);
      double diff = 0.0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        diff = std::max(diff, std::fabs(got[i] - want[i]));
      }
      INFO("change " << change);
      REQUIRE(diff > 1e-3);
    }
  }
}

TEST_CASE("GatedAttention gradients match finite differences (headwise, per-KV-group packing)",
          "[attention][gated][grad]") {
  auto c = small_config(4, 2, moe::GateLayout::kPackedPerKvGroup);
  c.qk_norm = moe::QkNorm::kRmsNorm;
  moe::GatedAttention<gating::HeadwiseGate> layer(c);
  randomize(layer, 12);
  check_layer(layer, 6, {});
}

TEST_CASE("GatedAttention gradients match finite differences (separate gate, batch, padding)",
          "[attention][gated][grad]") {
  auto c = small_config(3, 1, moe::GateLayout::kSeparate);  // multi-query: 3 heads, 1 KV head
  c.rope = true;
  moe::GatedAttention<gating::ElementwiseGate> layer(c);
  randomize(layer, 13);
  std::vector<std::uint8_t> mask = {0, 1, 1, 1, 1, 1, 0, 1};  // left padding, a hole
  moe::AttentionOptions opt;
  opt.batch = 2;
  opt.key_mask = mask;
  check_layer(layer, 8, opt);
  SECTION("non-causal, headwise, explicit positions") {
    auto c2 = small_config(2, 2, moe::GateLayout::kSeparate);
    c2.causal = false;
    c2.rope = true;
    moe::GatedAttention<gating::HeadwiseGate> l2(c2);
    randomize(l2, 14);
    std::vector<Index> pos = {3, 4, 5, 9, 10, 11};
    moe::AttentionOptions o2;
    o2.positions = pos;
    check_layer(l2, 6, o2);
  }
}

TEST_CASE("GatedAttention without a gate: gradients and forward", "[attention][gated][grad]") {
  auto c = small_config(2, 1, moe::GateLayout::kSeparate);
  c.qk_norm = moe::QkNorm::kRmsNorm;
  c.rope = true;
  moe::GatedAttention<gating::NoGate> layer(c);
  randomize(layer, 15);
  check_layer(layer, 5, {});
}

TEST_CASE("GatedAttention with projection biases and q/k norms over all heads (Qwen2-MoE, OLMoE)",
          "[attention][gated][grad]") {
  SECTION("q/k/v and o biases, no norm, partial RoPE") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.qkv_bias = true;
    c.o_bias = true;
    c.rope = true;
    c.rotary_dim = 2;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 16);
    REQUIRE(layer.q_bias().size() == 16);
    REQUIRE(layer.k_bias().size() == 8);
    REQUIRE(layer.o_bias().size() == 6);
    check_layer(layer, 7, {});
  }
  SECTION("q/k RMSNorm over all heads and q/k/v biases (OLMoE-like), two sequences") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.qk_norm = moe::QkNorm::kRmsNorm;
    c.qk_norm_scope = moe::QkNormScope::kAllHeads;
    c.qkv_bias = true;
    c.rope = true;
    moe::GatedAttention<gating::NoGate> layer(c);
    REQUIRE(layer.q_norm().size() == 16);
    REQUIRE(layer.k_norm().size() == 8);
    randomize(layer, 17);
    moe::AttentionOptions opt;
    opt.batch = 2;
    check_layer(layer, 8, opt);
  }
  SECTION("gpt-oss: YaRN RoPE, sinks, a sliding window, q/k/v/o biases, far positions") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.head_dim = 8;
    c.qkv_bias = true;
    c.o_bias = true;
    c.rope = true;
    c.rope_theta = 150000.0f;
    c.sinks = true;
    c.sliding_window = 3;
    for (bool const truncate : {false, true}) {
      c.yarn = {};
      c.yarn.factor = 32.0f;
      c.yarn.original_max_position = 10000;  // the ramp runs over frequencies 1-3 of 4
      c.yarn.truncate = truncate;
      moe::GatedAttention<gating::NoGate> layer(c);
      randomize(layer, 19);
      std::vector<Index> pos = {0, 1, 7, 300, 301, 302, 5000, 5001};
      moe::AttentionOptions opt;
      opt.positions = pos;
      check_layer(layer, 8, opt);
    }
  }
  SECTION("interleaved RoPE (ERNIE 4.5, GLM-4: pairs 2i, 2i + 1), full and partial, biases") {
    for (Index const rd : {Index{0}, Index{2}}) {
      auto c = small_config(4, 2, moe::GateLayout::kSeparate);
      c.rope = true;
      c.rope_interleaved = true;
      c.rotary_dim = rd;
      c.qkv_bias = c.o_bias = true;
      moe::GatedAttention<gating::NoGate> layer(c);
      randomize(layer, 20);
      std::vector<Index> pos = {0, 3, 4, 9, 17, 30};
      moe::AttentionOptions opt;
      opt.positions = pos;
      check_layer(layer, 6, opt);
    }
  }
  SECTION("(1 + w) norms over all heads, a separate elementwise gate, o bias") {
    auto c = small_config(2, 1, moe::GateLayout::kSeparate);
    c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
    c.qk_norm_scope = moe::QkNormScope::kAllHeads;
    c.o_bias = true;
    moe::GatedAttention<gating::ElementwiseGate> layer(c);
    randomize(layer, 18);
    check_layer(layer, 5, {});
  }
}

TEST_CASE("GatedAttention forward matches the twin at larger sizes, several key blocks",
          "[attention][gated]") {
  moe::GatedAttentionConfig c;
  c.d_model = 40;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 20;
  c.gate_layout = moe::GateLayout::kPackedPerHead;
  c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
  c.rope = true;
  moe::GatedAttention<gating::ElementwiseGate> layer(c);
  randomize(layer, 16);
  moe::ThreadPool pool(2);
  moe::AttentionOptions opt;
  opt.pool = &pool;
  check_layer(layer, 150, opt, false);
}

TEST_CASE("Gate at +infinity gives the ungated layer, at -infinity zero", "[attention][gated]") {
  Index const T = 9, D = 6;
  for (auto layout : {moe::GateLayout::kSeparate, moe::GateLayout::kPackedPerKvGroup,
                      moe::GateLayout::kPackedPerHead}) {
    auto c = small_config(4, 2, layout);
    c.rope = true;
    moe::GatedAttention<gating::NoGate> plain(c);
    moe::GatedAttention<gating::ElementwiseGate> gated(c);
    randomize(plain, 21);
    // Same q/k/v/o weights; gate rows of +-1e4 on all-positive inputs: logits beyond +-1e3.
    auto x = random_vector(T * D, 22, 0.1f, 1.0f);
    for (float sign : {1.0f, -1.0f}) {
      auto qp = plain.q_proj();
      auto gp = gated.q_proj();
      for (Index h = 0; h < 4; ++h) {
        for (Index d = 0; d < 4; ++d) {
          std::copy(qp.row(h * 4 + d), qp.row(h * 4 + d) + D, gp.row(gated.query_col(h) + d));
        }
      }
      auto gate_rows = layout == moe::GateLayout::kSeparate ? gated.gate_proj() : gp;
      for (Index h = 0; h < 4; ++h) {
        for (Index d = 0; d < 4; ++d) {
          Index const row =
              layout == moe::GateLayout::kSeparate ? h * 4 + d : gated.gate_col(h) + d;
          std::fill(gate_rows.row(row), gate_rows.row(row) + D, sign * 1e4f);
        }
      }
      auto copy = [](auto src, auto dst) {
        std::copy(src.data, src.data + src.rows * src.cols, dst.data);
      };
      copy(plain.k_proj(), gated.k_proj());
      copy(plain.v_proj(), gated.v_proj());
      copy(plain.o_proj(), gated.o_proj());
      std::vector<float> y0(x.size()), y1(x.size());
      moe::GatedAttentionWorkspace ws;
      plain.forward({x.data(), T, D}, {y0.data(), T, D}, ws);
      gated.forward({x.data(), T, D}, {y1.data(), T, D}, ws);
      if (sign > 0) {
        REQUIRE(y1 == y0);  // sigmoid = 1 exactly: bitwise the ungated layer
      } else {
        for (float v : y1) REQUIRE(v == 0.0f);
      }
    }
  }
}

TEST_CASE("Headwise equals elementwise when the elementwise gates are equal within a head",
          "[attention][gated]") {
  Index const T = 11, D = 6;
  for (auto layout : {moe::GateLayout::kSeparate, moe::GateLayout::kPackedPerKvGroup,
                      moe::GateLayout::kPackedPerHead}) {
    auto c = small_config(4, 2, layout);
    moe::GatedAttention<gating::HeadwiseGate> hw(c);
    moe::GatedAttention<gating::ElementwiseGate> ew(c);
    randomize(hw, 31);
    auto hq = hw.q_proj();
    auto eq = ew.q_proj();
    for (Index h = 0; h < 4; ++h) {
      for (Index d = 0; d < 4; ++d) {
        std::copy(hq.row(hw.query_col(h) + d), hq.row(hw.query_col(h) + d) + D,
                  eq.row(ew.query_col(h) + d));
        // Every elementwise gate row of head h = the headwise gate row of head h.
        float const* src =
            layout == moe::GateLayout::kSeparate ? hw.gate_proj().row(h) : hq.row(hw.gate_col(h));
        float* dst = layout == moe::GateLayout::kSeparate ? ew.gate_proj().row(h * 4 + d)
                                                          : eq.row(ew.gate_col(h) + d);
        std::copy(src, src + D, dst);
      }
    }
    auto copy = [](auto src, auto dst) {
      std::copy(src.data, src.data + src.rows * src.cols, dst.data);
    };
    copy(hw.k_proj(), ew.k_proj());
    copy(hw.v_proj(), ew.v_proj());
    copy(hw.o_proj(), ew.o_proj());
    auto x = random_vector(T * D, 32);
    auto dy = random_vector(T * D, 33);
    std::vector<float> y0(x.size()), y1(x.size()), dx0(x.size()), dx1(x.size());
    moe::GatedAttentionWorkspace w0, w1;
    hw.forward_train({x.data(), T, D}, {y0.data(), T, D}, w0);
    ew.forward_train({x.data(), T, D}, {y1.data(), T, D}, w1);
    // Equal up to rounding: the gate's sigmoid runs in SIMD lanes or in a scalar tail
    // depending on the number of gate logits per token.
    for (std::size_t i = 0; i < y0.size(); ++i) REQUIRE(y1[i] == Approx(y0[i]).margin(1e-6));
    auto g0 = hw.make_gradients();
    auto g1 = ew.make_gradients();
    hw.backward(w0, {dy.data(), T, D}, {dx0.data(), T, D}, g0);
    ew.backward(w1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
    for (std::size_t i = 0; i < dx0.size(); ++i) REQUIRE(dx0[i] == Approx(dx1[i]).margin(1e-6));
    // The headwise gate gradient is the sum of the elementwise ones within the head.
    for (Index h = 0; h < 4; ++h) {
      for (Index k = 0; k < D; ++k) {
        auto grad_row = [&](auto& g, Index row) {
          return g.gate_proj.empty() ? g.q_proj[row * D + k] : g.gate_proj[row * D + k];
        };
        Index const hrow = layout == moe::GateLayout::kSeparate ? h : hw.gate_col(h);
        double sum = 0.0;
        for (Index d = 0; d < 4; ++d) {
          sum +=
              grad_row(g1, layout == moe::GateLayout::kSeparate ? h * 4 + d : ew.gate_col(h) + d);
        }
        REQUIRE(grad_row(g0, hrow) == Approx(sum).margin(1e-5));
      }
    }
  }
}

TEST_CASE("The three q_proj layouts give the same layer for permuted weights",
          "[attention][gated]") {
  Index const T = 12, D = 6;
  auto cs = small_config(6, 2, moe::GateLayout::kSeparate);  // G = 3 heads per KV group
  cs.qk_norm = moe::QkNorm::kRmsNormOnePlus;
  cs.rope = true;
  moe::GatedAttention<gating::ElementwiseGate> sep(cs);
  randomize(sep, 41);
  auto x = random_vector(T * D, 42);
  auto dy = random_vector(T * D, 43);
  std::vector<float> y0(x.size()), dx0(x.size());
  moe::GatedAttentionWorkspace w0;
  sep.forward_train({x.data(), T, D}, {y0.data(), T, D}, w0);
  auto g0 = sep.make_gradients();
  sep.backward(w0, {dy.data(), T, D}, {dx0.data(), T, D}, g0);
  for (auto layout : {moe::GateLayout::kPackedPerKvGroup, moe::GateLayout::kPackedPerHead}) {
    auto c = cs;
    c.gate_layout = layout;
    moe::GatedAttention<gating::ElementwiseGate> packed(c);
    auto sp = sep.parameters();
    auto pp = packed.parameters();
    REQUIRE(pp.size() == sp.size() - 1);  // no separate gate_proj
    // Permute: query row (h, d) and gate row (h, d) into their packed positions.
    for (Index h = 0; h < 6; ++h) {
      for (Index d = 0; d < 4; ++d) {
        std::copy(sep.q_proj().row(h * 4 + d), sep.q_proj().row(h * 4 + d) + D,
                  packed.q_proj().row(packed.query_col(h) + d));
        std::copy(sep.gate_proj().row(h * 4 + d), sep.gate_proj().row(h * 4 + d) + D,
                  packed.q_proj().row(packed.gate_col(h) + d));
      }
    }
    for (std::size_t i = 2; i < sp.size(); ++i) {
      std::copy(sp[i].values.begin(), sp[i].values.end(), pp[i - 1].values.begin());
    }
    std::vector<float> y1(x.size()), dx1(x.size());
    moe::GatedAttentionWorkspace w1;
    packed.forward_train({x.data(), T, D}, {y1.data(), T, D}, w1);
    REQUIRE(y1 == y0);
    auto g1 = packed.make_gradients();
    packed.backward(w1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
    // Gradients: the same values in the permuted rows (summation orders differ in dx).
    auto same = [](float a, float b) { return std::fabs(a - b) <= 1e-6f + 1e-5f * std::fabs(b); };
    for (std::size_t i = 0; i < dx0.size(); ++i) REQUIRE(same(dx1[i], dx0[i]));
    for (Index h = 0; h < 6; ++h) {
      for (Index d = 0; d < 4; ++d) {
        for (Index k = 0; k < D; ++k) {
          REQUIRE(
              same(g1.q_proj[(packed.query_col(h) + d) * D + k], g0.q_proj[(h * 4 + d) * D + k]));
          REQUIRE(
              same(g1.q_proj[(packed.gate_col(h) + d) * D + k], g0.gate_proj[(h * 4 + d) * D + k]));
        }
      }
    }
    for (std::size_t i = 0; i < g0.k_proj.size(); ++i) REQUIRE(same(g1.k_proj[i], g0.k_proj[i]));
    for (std::size_t i = 0; i < g0.o_proj.size(); ++i) REQUIRE(same(g1.o_proj[i], g0.o_proj[i]));
    for (std::size_t i = 0; i < g0.q_norm.size(); ++i) REQUIRE(same(g1.q_norm[i], g0.q_norm[i]));
  }
}

TEST_CASE("Causal masking leaks nothing from the future; padding keys are never attended",
          "[attention][gated][mask]") {
  Index const T = 80, D = 16;  // two query chunks, two key blocks
  moe::GatedAttentionConfig c;
  c.d_model = D;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.gate_layout = moe::GateLayout::kPackedPerHead;
  c.rope = true;
  moe::GatedAttention<gating::ElementwiseGate> layer(c);
  randomize(layer, 51);
  auto x = random_vector(T * D, 52);
  std::vector<float> y0(x.size()), y1(x.size());
  moe::GatedAttentionWorkspace ws;
  layer.forward({x.data(), T, D}, {y0.data(), T, D}, ws);
  for (Index t0 : {1, 37, 64, 79}) {
    auto x2 = x;
    for (Index t = t0; t < T; ++t) {
      for (Index d = 0; d < D; ++d) x2[t * D + d] += 5.0f;
    }
    layer.forward({x2.data(), T, D}, {y1.data(), T, D}, ws);
    REQUIRE(std::memcmp(y0.data(), y1.data(), static_cast<std::size_t>(t0 * D) * 4) == 0);
    REQUIRE(y0[t0 * D] != y1[t0 * D]);
  }
  // Padding: changing a padded token changes no other token's output, causal or not.
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(T), 1);
  mask[3] = mask[50] = 0;
  for (bool causal : {true, false}) {
    auto c2 = c;
    c2.causal = causal;
    moe::GatedAttention<gating::ElementwiseGate> l2(c2);
    randomize(l2, 53);
    moe::AttentionOptions opt;
    opt.key_mask = mask;
    l2.forward({x.data(), T, D}, {y0.data(), T, D}, ws, opt);
    auto x2 = x;
    for (Index d = 0; d < D; ++d) x2[50 * D + d] -= 3.0f;
    l2.forward({x2.data(), T, D}, {y1.data(), T, D}, ws, opt);
    for (Index t = 0; t < T; ++t) {
      if (t == 50) continue;
      REQUIRE(std::memcmp(y0.data() + t * D, y1.data() + t * D, D * 4) == 0);
    }
  }
}

TEST_CASE("A batch of sequences equals one call per sequence", "[attention][gated]") {
  Index const S = 9, D = 6;
  auto c = small_config(4, 2, moe::GateLayout::kPackedPerKvGroup);
  c.rope = true;
  moe::GatedAttention<gating::HeadwiseGate> layer(c);
  randomize(layer, 61);
  auto x = random_vector(3 * S * D, 62);
  std::vector<float> yb(x.size()), y1(static_cast<std::size_t>(S * D));
  moe::GatedAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.batch = 3;
  layer.forward({x.data(), 3 * S, D}, {yb.data(), 3 * S, D}, ws, opt);
  for (Index b = 0; b < 3; ++b) {
    layer.forward({x.data() + b * S * D, S, D}, {y1.data(), S, D}, ws);
    for (Index i = 0; i < S * D; ++i) REQUIRE(y1[i] == Approx(yb[b * S * D + i]).margin(1e-6));
  }
}

namespace {

template <class Layer>
void check_threads(Layer const& layer, Index T, Index D) {
  auto x = random_vector(T * D, 72);
  auto dy = random_vector(T * D, 73);
  moe::ThreadPool pool(2);
  std::vector<float> y1(x.size()), y2(x.size()), dx1(x.size()), dx2(x.size());
  moe::GatedAttentionWorkspace w1, w2;
  moe::AttentionOptions o1, o2;
  o1.batch = o2.batch = 2;
  o2.pool = &pool;
  layer.forward_train({x.data(), T, D}, {y1.data(), T, D}, w1, o1);
  layer.forward_train({x.data(), T, D}, {y2.data(), T, D}, w2, o2);
  REQUIRE(y1 == y2);
  auto g1 = layer.make_gradients();
  auto g2 = layer.make_gradients();
  layer.backward(w1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
  layer.backward(w2, {dy.data(), T, D}, {dx2.data(), T, D}, g2, &pool);
  REQUIRE(dx1 == dx2);
  auto a = g1.groups();
  auto b = g2.groups();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    REQUIRE(std::memcmp(a[i].values.data(), b[i].values.data(), a[i].values.size() * 4) == 0);
  }
}

}  // namespace

TEST_CASE("GatedAttention forward and backward are bitwise identical for 1 and 2 threads",
          "[attention][gated][determinism]") {
  Index const T = 130, D = 32;
  moe::GatedAttentionConfig c;
  c.d_model = D;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.gate_layout = moe::GateLayout::kPackedPerHead;
  c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
  c.rope = true;
  SECTION("elementwise gate packed per head, per-head (1 + w) norms") {
    moe::GatedAttention<gating::ElementwiseGate> layer(c);
    randomize(layer, 71);
    check_threads(layer, T, D);
  }
  SECTION("biases, norms over all heads (OLMoE-like)") {
    c.gate_layout = moe::GateLayout::kSeparate;
    c.qk_norm_scope = moe::QkNormScope::kAllHeads;
    c.qkv_bias = true;
    c.o_bias = true;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 74);
    check_threads(layer, T, D);
  }
}

TEST_CASE("GatedAttention reports bad configurations and bad input clearly", "[attention][gated]") {
  auto c = small_config(6, 4, moe::GateLayout::kSeparate);
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::HeadwiseGate>(c),
                      Catch::Contains("num_kv_heads = 4 does not divide num_heads = 6"));
  c = small_config(4, 2, moe::GateLayout::kSeparate);
  c.rope = true;
  c.rotary_dim = 3;
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::HeadwiseGate>(c),
                      Catch::Contains("even rotary_dim"));
  c = small_config(4, 2, moe::GateLayout::kSeparate);
  c.head_dim = 0;
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::NoGate>(c), Catch::Contains("must be >= 1"));
  c = small_config(4, 2, moe::GateLayout::kPackedPerHead);
  c.qk_norm = moe::QkNorm::kRmsNorm;
  c.qk_norm_scope = moe::QkNormScope::kAllHeads;
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::HeadwiseGate>(c),
                      Catch::Contains("kAllHeads") && Catch::Contains("kSeparate"));
  REQUIRE_NOTHROW(moe::GatedAttention<gating::NoGate>(c));  // no gate: queries contiguous
  c = llama4_config(true);
  c.yarn.factor = 2.0f;  // two scalings of the frequencies at once
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::NoGate>(c),
                      Catch::Contains("llama3 = {factor 4") && Catch::Contains("no YaRN"));
  c = llama4_config(true);
  c.llama3.high_freq_factor = 0.5f;
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::NoGate>(c),
                      Catch::Contains("low_freq_factor <= high_freq_factor"));
  c = llama4_config(true);
  c.causal = false;
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::NoGate>(c),
                      Catch::Contains("attention_chunk = 3") && Catch::Contains("causal"));
  c = llama4_config(false);
  c.temperature_floor = -1;
  REQUIRE_THROWS_WITH(moe::GatedAttention<gating::NoGate>(c),
                      Catch::Contains("temperature_floor = -1"));
  c = small_config(4, 2, moe::GateLayout::kSeparate);
  moe::GatedAttention<gating::HeadwiseGate> layer(c);
  std::vector<float> x(60), y(60), dx(60);
  moe::GatedAttentionWorkspace ws;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 12, 5}, {y.data(), 12, 5}, ws),
                      Catch::Contains("x has 5 columns but d_model = 6"));
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 10, 6}, {y.data(), 9, 6}, ws),
                      Catch::Contains("y is [9, 6] but must be [10, 6]"));
  moe::AttentionOptions opt;
  opt.batch = 3;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 10, 6}, {y.data(), 10, 6}, ws, opt),
                      Catch::Contains("batch = 3 does not divide the 10 tokens"));
  std::vector<std::uint8_t> mask(4, 1);
  opt = {};
  opt.key_mask = mask;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 10, 6}, {y.data(), 10, 6}, ws, opt),
                      Catch::Contains("key_mask has 4 entries for 10 tokens"));
  auto g = layer.make_gradients();
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g),
                      Catch::Contains("call forward_train first"));
  layer.forward_train({x.data(), 10, 6}, {y.data(), 10, 6}, ws);
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 9, 6}, {dx.data(), 9, 6}, g),
                      Catch::Contains("must be [10, 6]"));
  // Another layer's training forward: refused, never read as this layer's.
  moe::GatedAttention<gating::HeadwiseGate> other(c);
  REQUIRE_THROWS_WITH(other.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g),
                      Catch::Contains("holds another layer's training forward"));
  layer.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g);  // its own: fine, once
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 10, 6}, {dx.data(), 10, 6}, g),
                      Catch::Contains("call forward_train first"));
  moe::GatedAttention<gating::HeadwiseGate> empty;
  REQUIRE_THROWS_WITH(empty.forward({x.data(), 10, 6}, {y.data(), 10, 6}, ws),
                      Catch::Contains("default-constructed"));
}

namespace {

/// Prefill then decode steps through a KvCache for three sequences of different lengths (one
/// starts empty and joins later), against forward() over each whole sequence (batch 1).
template <class Layer>
void check_cached(Layer const& layer, moe::ThreadPool* pool,
                  moe::KvFormat format = moe::KvFormat::kF32, Index window = 0) {
  bool const bf16 = format == moe::KvFormat::kBf16;
  Index const D = layer.d_model();
  Index const S = 3;
  // Per call, the new tokens of each sequence: a prefill (7, 12, 0 tokens), 1-token steps, a
  // 3-token chunk, and sequence 2's own prefill in the middle.
  std::vector<std::vector<Index>> const calls = {{7, 12, 0}, {1, 1, 0}, {1, 1, 9}, {3, 0, 1},
                                                 {1, 1, 1},  {0, 1, 1}, {1, 1, 1}};
  std::vector<std::vector<float>> seq(S);  // every token of each sequence so far
  Index const KD = layer.num_kv_heads() * layer.head_dim();
  moe::KvCache cache(S, KD, 4, format, window);
  moe::KvCache f32(S, KD, 4);  // bf16: the same calls on an fp32 cache, for its stored rows
  moe::GatedAttentionWorkspace ws, ws32, full_ws;
  double max_rel = 0.0;
  std::uint64_t seed = 900;
  for (std::size_t c = 0; c < calls.size(); ++c) {
    INFO("call " << c);
    std::vector<float> x;
    for (Index s = 0; s < S; ++s) {
      auto const part = random_vector(calls[c][s] * D, seed++);
      x.insert(x.end(), part.begin(), part.end());
      seq[s].insert(seq[s].end(), part.begin(), part.end());
    }
    Index const T = static_cast<Index>(x.size()) / D;
    std::vector<float> y(x.size());
    layer.forward_cached({x.data(), T, D}, {y.data(), T, D}, cache, calls[c], ws, pool);
    if (bf16) {  // the bf16 cache holds the fp32 cache's keys and values, rounded
      std::vector<float> y32(x.size());
      layer.forward_cached({x.data(), T, D}, {y32.data(), T, D}, f32, calls[c], ws32, pool);
      for (Index s = 0; s < S; ++s) {
        // (a windowed cache holds positions [first(s), length(s)) of them)
        auto const skip = static_cast<std::size_t>(cache.first(s) * KD);
        auto const k32 = f32.keys(s).subspan(skip), v32 = f32.values(s).subspan(skip);
        auto const k16 = cache.keys_bf16(s), v16 = cache.values_bf16(s);
        REQUIRE(k16.size() == k32.size());
        for (std::size_t i = 0; i < k32.size(); ++i) {
          REQUIRE(k16[i] == moe::kernels::float_to_bf16(k32[i]));
          REQUIRE(v16[i] == moe::kernels::float_to_bf16(v32[i]));
        }
      }
      REQUIRE_THROWS_WITH(cache.keys(0), Catch::Contains("bf16"));
    }
    Index row = 0;
    for (Index s = 0; s < S; ++s) {
      Index const n = calls[c][s], len = static_cast<Index>(seq[s].size()) / D;
      REQUIRE(cache.length(s) == len);
      if (n == 0) continue;
      std::vector<float> yf(seq[s].size());
      layer.forward({seq[s].data(), len, D}, {yf.data(), len, D}, full_ws, {pool});
      double scale = 0.0, diff = 0.0;
      for (Index i = 0; i < n * D; ++i) {
        double const want = yf[static_cast<std::size_t>((len - n) * D + i)];
        scale = std::max(scale, std::fabs(want));
        diff = std::max(diff, std::fabs(y[static_cast<std::size_t>(row * D + i)] - want));
      }
      INFO("sequence " << s << ": max |diff| " << diff << " of max |y| " << scale);
      REQUIRE(scale > 1e-3);
      // bf16 keys and values: each rounded by at most 2^-9 relative.
      REQUIRE(diff <= (bf16 ? 1e-2 : 1e-5) * scale);
      max_rel = std::max(max_rel, diff / scale);
      row += n;
    }
  }
  if (window > 0) {
    // Sequence 1's 12-token prefill grew the blocks 4 -> 8 -> 16; its 17 tokens would have grown
    // them to 32, but the window dropped its oldest tokens instead.
    REQUIRE(cache.capacity() == 16);
    REQUIRE(cache.length(1) == 17);
    REQUIRE(cache.first(1) > 0);
    REQUIRE(cache.rows(1) == cache.length(1) - cache.first(1));
    REQUIRE(static_cast<Index>(bf16 ? cache.keys_bf16(1).size() : cache.keys(1).size()) ==
            cache.rows(1) * KD);
    REQUIRE_THROWS_WITH(cache.truncate(1, cache.first(1) - 1),
                        Catch::Contains("the window's oldest kept token"));
    return;
  }
  REQUIRE(cache.capacity() >= 16);  // grew from 4
  REQUIRE(cache.bytes_per_token() == (bf16 ? 2u : 4u) * 2u * static_cast<std::size_t>(KD));
  if (bf16) REQUIRE(max_rel > 1e-6);  // the rounding is visible: the bf16 path ran
}

}  // namespace

TEST_CASE("KV cache: prefill and decode steps equal the full recompute", "[attention][cache]") {
  SECTION("GQA, q/k RMSNorm, RoPE (Qwen3-MoE attention), no gate") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.qk_norm = moe::QkNorm::kRmsNorm;
    c.rope = true;
    c.rope_theta = 1000.0f;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 31);
    check_cached(layer, nullptr);
  }
  SECTION("sliding window 5 and sinks (gpt-oss), two threads") {
    auto c = small_config(4, 1, moe::GateLayout::kSeparate);
    c.rope = true;
    c.sinks = true;
    c.sliding_window = 5;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 32);
    moe::ThreadPool pool(2);
    check_cached(layer, &pool);
  }
  SECTION("a windowed cache (KvCache window 5) keeps only what the window sees") {
    auto c = small_config(4, 1, moe::GateLayout::kSeparate);
    c.rope = true;
    c.sinks = true;
    c.sliding_window = 5;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 38);
    moe::ThreadPool pool(2);
    check_cached(layer, &pool, moe::KvFormat::kF32, 5);
    check_cached(layer, nullptr, moe::KvFormat::kBf16, 6);     // a wider cache window is fine
    auto c2 = small_config(4, 2, moe::GateLayout::kSeparate);  // the grouped 1-token path
    c2.rope = true;
    c2.sliding_window = 4;
    moe::GatedAttention<gating::NoGate> l2(c2);
    randomize(l2, 39);
    check_cached(l2, &pool, moe::KvFormat::kF32, 4);
  }
  SECTION("q/k/v and o biases, q/k norms over all heads (OLMoE-like), two threads") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.qk_norm = moe::QkNorm::kRmsNorm;
    c.qk_norm_scope = moe::QkNormScope::kAllHeads;
    c.qkv_bias = true;
    c.o_bias = true;
    c.rope = true;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 34);
    moe::ThreadPool pool(2);
    check_cached(layer, &pool);
  }
  SECTION("a bf16 cache (KvFormat::kBf16): the rounded rows of the fp32 cache, two threads") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.qk_norm = moe::QkNorm::kRmsNorm;
    c.rope = true;
    c.qkv_bias = true;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 35);
    moe::ThreadPool pool(2);
    check_cached(layer, &pool, moe::KvFormat::kBf16);
    c.sinks = true;  // the per-(head, chunk) path instead of the grouped one
    c.sliding_window = 4;
    moe::GatedAttention<gating::NoGate> l2(c);
    randomize(l2, 36);
    check_cached(l2, nullptr, moe::KvFormat::kBf16);
  }
  SECTION("Llama 4: chunked RoPE layers (a cache of the chunk, and a whole one), NoPE layers") {
    moe::GatedAttention<gating::NoGate> rope_layer(llama4_config(true));
    randomize(rope_layer, 45);
    REQUIRE(rope_layer.lookback() == 3);
    moe::ThreadPool pool(2);
    check_cached(rope_layer, &pool);
    check_cached(rope_layer, nullptr, moe::KvFormat::kF32, 3);
    moe::GatedAttention<gating::NoGate> nope_layer(llama4_config(false));
    randomize(nope_layer, 46);
    REQUIRE(nope_layer.lookback() == 0);
    check_cached(nope_layer, &pool);
    auto c = llama4_config(true);  // a sliding window and chunks: the smaller one
    c.sliding_window = 2;
    REQUIRE(moe::GatedAttention<gating::NoGate>(c).lookback() == 2);
  }
  SECTION("interleaved RoPE (ERNIE 4.5)") {
    auto c = small_config(4, 2, moe::GateLayout::kSeparate);
    c.rope = true;
    c.rope_interleaved = true;
    moe::GatedAttention<gating::NoGate> layer(c);
    randomize(layer, 37);
    check_cached(layer, nullptr);
  }
  SECTION("elementwise gate packed per head (Qwen3-Next), partial RoPE, (1 + w) norms") {
    auto c = small_config(2, 2, moe::GateLayout::kPackedPerHead);
    c.qk_norm = moe::QkNorm::kRmsNormOnePlus;
    c.rope = true;
    c.rotary_dim = 2;
    moe::GatedAttention<gating::ElementwiseGate> layer(c);
    randomize(layer, 33);
    check_cached(layer, nullptr);
  }
}

TEST_CASE("KV cache: bad calls are errors", "[attention][cache]") {
  auto c = small_config(4, 2, moe::GateLayout::kSeparate);
  moe::GatedAttention<gating::NoGate> layer(c);
  std::vector<float> x(3 * 6, 0.1f), y(x.size());
  moe::GatedAttentionWorkspace ws;
  moe::KvCache wrong(2, 5);
  std::vector<Index> const counts = {2, 1};
  REQUIRE_THROWS_WITH(layer.forward_cached({x.data(), 3, 6}, {y.data(), 3, 6}, wrong, counts, ws),
                      Catch::Contains("kv_dim") || Catch::Contains("KvCache(sequences, 8)"));
  moe::KvCache cache(2, 8);
  std::vector<Index> const short_counts = {3};
  REQUIRE_THROWS_WITH(
      layer.forward_cached({x.data(), 3, 6}, {y.data(), 3, 6}, cache, short_counts, ws),
      Catch::Contains("one count per sequence"));
  std::vector<Index> const bad_sum = {1, 1};
  REQUIRE_THROWS_WITH(layer.forward_cached({x.data(), 3, 6}, {y.data(), 3, 6}, cache, bad_sum, ws),
                      Catch::Contains("sum to 2") && Catch::Contains("3 rows"));
  REQUIRE_THROWS_WITH(cache.truncate(0, 1), Catch::Contains("between 0 and its length"));
  moe::KvCache windowed(2, 8, 0, moe::KvFormat::kF32, 4);  // the layer attends to everything
  REQUIRE_THROWS_WITH(
      layer.forward_cached({x.data(), 3, 6}, {y.data(), 3, 6}, windowed, counts, ws),
      Catch::Contains("window of 4") && Catch::Contains("sliding_window 0"));
  auto nc = c;
  nc.causal = false;
  moe::GatedAttention<gating::NoGate> bidir(nc);
  REQUIRE_THROWS_WITH(bidir.forward_cached({x.data(), 3, 6}, {y.data(), 3, 6}, cache, counts, ws),
                      Catch::Contains("not causal"));
}

TEST_CASE("KV cache: a reserve that cannot be allocated names its tokens and bytes",
          "[attention][cache]") {
  moe::KvCache cache(1, 8, 4);
  std::vector<float> const row(8, 1.5f);
  cache.make_room(0, 1);
  cache.store_key(0, 0, row.data());
  cache.store_value(0, 0, row.data());
  cache.advance(0, 1);
  // 2^50 tokens x 64 bytes = 2^56 bytes: more than the machine's memory, refused before the
  // allocator is asked (std::bad_alloc before; a sanitizer's allocator would abort).
  REQUIRE_THROWS_WITH(cache.reserve(Index{1} << 50),
                      Catch::Contains("KvCache::reserve: room for 1125899906842624 tokens x 1 "
                                      "sequence(s) x 64 bytes a token = 72057594037927936 "
                                      "bytes is more than this machine's") &&
                          Catch::Contains("reserve fewer tokens"));
  // 2^60 tokens: more bytes than an address space holds, refused before allocating.
  REQUIRE_THROWS_WITH(cache.reserve(Index{1} << 60),
                      Catch::Contains("is more than a process can address"));
  // The cache is unchanged.
  REQUIRE(cache.capacity() == 4);
  REQUIRE(cache.length(0) == 1);
  REQUIRE(cache.keys(0)[7] == 1.5f);
  REQUIRE(cache.values(0)[0] == 1.5f);
}

TEST_CASE(
    "GatedAttention bf16 weights: the bits of the rounded layer's fp32 packs, training stays "
    "fp32",
    "[attention][gated][bf16]") {
  moe::GatedAttentionConfig c;
  c.d_model = 37;  // not a multiple of any SIMD width: the scalar tails read bf16 too
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.gate_layout = moe::GateLayout::kSeparate;
  c.qk_norm = moe::QkNorm::kRmsNorm;
  c.rope = true;
  using Layer = moe::GatedAttention<gating::ElementwiseGate>;
  Layer fp32(c);
  randomize(fp32, 77);
  Layer rounded = fp32;  // the same weights rounded to bf16, kept in fp32
  for (auto& p : rounded.parameters()) {
    if (p.name.find("proj") == std::string_view::npos) continue;
    for (float& v : p.values) v = moe::kernels::bf16_to_float(moe::kernels::float_to_bf16(v));
  }
  // fp32 panels of the rounded values: the FMA chains the bf16 panels run (widened weights).
  rounded.pack_weights(moe::experts::WeightFormat::kF32);
  Layer packed = fp32;
  REQUIRE(packed.weight_format() == moe::experts::WeightFormat::kF32);
  packed.pack_weights(moe::experts::WeightFormat::kBf16);
  REQUIRE(packed.weight_format() == moe::experts::WeightFormat::kBf16);
  Layer const& cpacked = packed;  // const access keeps the copies
  REQUIRE(cpacked.q_proj().rows == c.num_heads * c.head_dim);
  REQUIRE(packed.weight_format() == moe::experts::WeightFormat::kBf16);

  moe::ThreadPool pool(2);
  Index const D = c.d_model;
  moe::GatedAttentionWorkspace ws;
  for (Index T : {Index{3}, Index{20}}) {  // the few-rows path and the packed-panel path
    INFO("T " << T);
    auto const x = random_vector(T * D, 78);
    std::vector<float> y_packed(x.size()), y_rounded(x.size()), y_fp32(x.size()), y(x.size());
    cpacked.forward({x.data(), T, D}, {y_packed.data(), T, D}, ws, {&pool});
    rounded.forward({x.data(), T, D}, {y_rounded.data(), T, D}, ws, {&pool});
    fp32.forward({x.data(), T, D}, {y_fp32.data(), T, D}, ws, {&pool});
    REQUIRE(y_packed == y_rounded);
    for (std::size_t i = 0; i < y.size(); ++i)
      REQUIRE(y_packed[i] == Approx(y_fp32[i]).margin(1e-2));
    REQUIRE(y_packed != y_fp32);  // the rounding is visible: the test can fail
    // Training forwards read the fp32 parameters.
    cpacked.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
    REQUIRE(y == y_fp32);
  }
  // Cached decoding: prefill, then steps.
  moe::KvCache cache_packed(1, c.num_kv_heads * c.head_dim),
      cache_rounded(1, c.num_kv_heads * c.head_dim);
  moe::GatedAttentionWorkspace ws2;
  for (Index n : {Index{9}, Index{1}, Index{1}, Index{3}}) {
    auto const x = random_vector(n * D, 79 + static_cast<std::uint64_t>(n));
    std::vector<float> a(x.size()), b(x.size());
    std::vector<Index> const counts = {n};
    cpacked.forward_cached({x.data(), n, D}, {a.data(), n, D}, cache_packed, counts, ws, &pool);
    rounded.forward_cached({x.data(), n, D}, {b.data(), n, D}, cache_rounded, counts, ws2, &pool);
    REQUIRE(a == b);
  }
  // A write access drops the copies (they never go stale); the layer is fp32 again.
  (void)packed.q_proj();
  REQUIRE(packed.weight_format() == moe::experts::WeightFormat::kF32);
  auto const x = random_vector(5 * D, 80);
  std::vector<float> a(x.size()), b(x.size());
  packed.forward({x.data(), 5, D}, {a.data(), 5, D}, ws);
  fp32.forward({x.data(), 5, D}, {b.data(), 5, D}, ws);
  REQUIRE(a == b);
  // d_model 37: no block format holds it; q8_0 falls back to bf16 (the chain's end).
  packed.pack_weights(moe::experts::WeightFormat::kQ8_0);
  REQUIRE(packed.formats().q == moe::experts::WeightFormat::kBf16);
  REQUIRE(packed.formats().o == moe::experts::WeightFormat::kQ8_0);  // o's depth H d_h = 32
}

TEST_CASE(
    "GatedAttention quantized projections: within the format's error of the dequantized "
    "layer, cached steps as the recompute, fallbacks, inference-only layers",
    "[attention][gated][quant]") {
  using moe::experts::WeightFormat;
  moe::GatedAttentionConfig c;
  c.d_model = 256;  // a K-quant block
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.qk_norm = moe::QkNorm::kRmsNorm;
  c.rope = true;
  c.qkv_bias = true;
  c.o_bias = true;
  using Layer = moe::GatedAttention<gating::HeadwiseGate>;
  Layer fp32(c);
  randomize(fp32, 90);
  Index const D = c.d_model, T = 12;
  auto const x = random_vector(T * D, 91);
  moe::ThreadPool pool(2);
  moe::GatedAttentionWorkspace ws;
  std::vector<float> y_ref(x.size());
  fp32.forward({x.data(), T, D}, {y_ref.data(), T, D}, ws, {&pool});
  float scale = 0.0f;
  for (float v : y_ref) scale = std::max(scale, std::abs(v));
  // Bounds relative to the output's largest magnitude: weights and int8 activations quantized.
  struct Case {
    WeightFormat f;
    double bound;
  };
  for (Case const k : {Case{WeightFormat::kQ8_0, 0.02}, Case{WeightFormat::kQ6_K, 0.04},
                       Case{WeightFormat::kQ4_K, 0.15}, Case{WeightFormat::kQ4_0, 0.15}}) {
    INFO(moe::experts::name(k.f));
    Layer q = fp32;
    q.pack_weights(k.f, &pool);
    REQUIRE(q.formats() == moe::AttentionFormats(k.f));
    REQUIRE(q.projection_bytes() < fp32.projection_bytes() / 3);
    std::vector<float> y(x.size()), y1(x.size());
    q.forward({x.data(), T, D}, {y.data(), T, D}, ws, {&pool});
    double worst = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i)
      worst = std::max(worst, double(std::abs(y[i] - y_ref[i])));
    CHECK(worst / scale < k.bound);
    CHECK(worst > 0.0);  // the quantization is visible
    // One thread or two, the same bits.
    q.forward({x.data(), T, D}, {y1.data(), T, D}, ws);
    REQUIRE(y1 == y);
    // Cached: a prefill and steps give the rows of the full forward (packed projections take
    // the same FMA chains for any number of rows); accumulate adds them to y.
    moe::KvCache cache(1, c.num_kv_heads * c.head_dim);
    Index done = 0;
    for (Index n : {Index{7}, Index{1}, Index{1}, Index{3}}) {
      std::vector<float> out(static_cast<std::size_t>(n * D), 0.5f);
      std::vector<Index> const counts = {n};
      q.forward_cached({x.data() + done * D, n, D}, {out.data(), n, D}, cache, counts, ws, &pool,
                       true);
      for (Index i = 0; i < n * D; ++i) {
        REQUIRE(out[static_cast<std::size_t>(i)] ==
                Approx(y[static_cast<std::size_t>(done * D + i)] + 0.5f).margin(1e-5));
      }
      done += n;
    }
    // Inference only: the fp32 projections freed, the same outputs.
    q.discard_master_weights();
    REQUIRE(q.master_weights_discarded());
    std::vector<float> y2(x.size());
    q.forward({x.data(), T, D}, {y2.data(), T, D}, ws, {&pool});
    REQUIRE(y2 == y);
    REQUIRE_THROWS_WITH(q.q_proj(), Catch::Contains("discarded"));
    REQUIRE_THROWS_WITH(q.forward_train({x.data(), T, D}, {y2.data(), T, D}, ws),
                        Catch::Contains("cannot train"));
  }
  // A depth no K-quant block divides: q4_k falls back to q4_0 for those projections.
  c.d_model = 96;
  Layer narrow(c);
  randomize(narrow, 92);
  narrow.pack_weights(WeightFormat::kQ4_K);
  REQUIRE(narrow.formats() == moe::AttentionFormats(WeightFormat::kQ4_0, WeightFormat::kQ4_0,
                                                    WeightFormat::kQ4_0, WeightFormat::kQ4_K));
  std::vector<float> out(std::size_t{2} * 96, 0.0f);
  moe::KvCache cache(1, c.num_kv_heads * c.head_dim);
  std::vector<Index> const counts = {2};
  REQUIRE_THROWS_WITH(narrow.forward_cached({out.data(), 2, 96}, {out.data(), 2, 96}, cache, counts,
                                            ws, nullptr, true),
                      Catch::Contains("y must not be x"));
  REQUIRE_THROWS_WITH(Layer(c).discard_master_weights(), Catch::Contains("not packed"));
}
