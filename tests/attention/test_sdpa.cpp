// SPDX-License-Identifier: Apache-2.0
// The blocked online-softmax SDPA kernel and its backward against a naive double-precision
// softmax(Q K^T / sqrt(d)) V: tails in d, dv and T, several key blocks, masks, positions,
// large scores, row-range and thread-split reproducibility.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/attention_reference.hpp"
#include "moe/core/random.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/sdpa.hpp"

using moe::Index;
namespace kernels = moe::kernels;

namespace {

std::vector<float> random_vector(Index n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, lo, hi, seed);
  return v;
}

aref::Vec to_double(std::vector<float> const& v) { return aref::Vec(v.begin(), v.end()); }

struct Case {
  Index Tq = 8, Tk = 8, d = 8, dv = 8;
  bool causal = false;
  Index causal_offset = 0;
  bool padding = false;
  bool positions = false;
  float magnitude = 1.0f;
  std::uint64_t seed = 1;
  Index window = 0;
  float sink = -std::numeric_limits<float>::infinity();
};

struct Data {
  Case c;
  std::vector<float> q, k, v;
  std::vector<Index> pos;
  std::vector<std::uint8_t> mask;
  aref::Sdpa ref;

  explicit Data(Case const& c_) : c(c_) {
    q = random_vector(c.Tq * c.d, c.seed, -c.magnitude, c.magnitude);
    k = random_vector(c.Tk * c.d, c.seed + 1, -c.magnitude, c.magnitude);
    v = random_vector(c.Tk * c.dv, c.seed + 2);
    ref.Tq = c.Tq;
    ref.Tk = c.Tk;
    ref.d = c.d;
    ref.dv = c.dv;
    ref.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    ref.causal = c.causal;
    ref.causal_offset = c.causal_offset;
    ref.window = c.window;
    ref.sink = c.sink;
    if (c.padding) {  // every third key and the first two are padding
      mask.assign(static_cast<std::size_t>(c.Tk), 1);
      for (Index j = 0; j < c.Tk; ++j) mask[j] = (j % 3 == 1 || j < 2) ? 0 : 1;
      ref.key_mask = mask;
    }
    if (c.positions) {  // non-decreasing positions, some repeated (UMoE rows of one expert)
      for (Index i = 0; i < c.Tq; ++i) pos.push_back(std::min(c.Tk - 1, (i * 2) / 3 + i % 2));
      ref.q_pos = pos;
    }
  }

  kernels::SdpaParams params() const {
    kernels::SdpaParams p;
    p.q = q.data();
    p.ldq = c.d;
    p.k = k.data();
    p.ldk = c.d;
    p.v = v.data();
    p.ldv = c.dv;
    p.q_rows = c.Tq;
    p.kv_rows = c.Tk;
    p.head_dim = c.d;
    p.value_dim = c.dv;
    p.scale = static_cast<float>(ref.scale);
    p.causal = c.causal;
    p.causal_offset = c.causal_offset;
    p.q_pos = pos.empty() ? nullptr : pos.data();
    p.key_mask = mask.empty() ? nullptr : mask.data();
    p.window = c.window;
    p.sink = c.sink;
    return p;
  }
};

std::vector<float> scratch_for(Case const& c) {
  return std::vector<float>(static_cast<std::size_t>(kernels::sdpa_scratch_size(c.d, c.dv)));
}

void check_forward(Case const& c) {
  INFO("Tq " << c.Tq << " Tk " << c.Tk << " d " << c.d << " dv " << c.dv << " causal " << c.causal
             << " padding " << c.padding << " positions " << c.positions);
  Data data(c);
  std::vector<float> o(static_cast<std::size_t>(c.Tq * c.dv), std::nanf("")),
      lse(static_cast<std::size_t>(c.Tq));
  auto scratch = scratch_for(c);
  kernels::sdpa_forward(data.params(), o.data(), c.dv, lse.data(), 0, c.Tq, scratch.data());
  auto const want = data.ref.forward(to_double(data.q), to_double(data.k), to_double(data.v));
  REQUIRE(aref::rel_err(o.data(), want) < 2e-5);
  // lse against the reference's log-sum-exp.
  for (Index i = 0; i < c.Tq; ++i) {
    double m = -std::numeric_limits<double>::infinity();
    std::vector<double> s;
    for (Index j = 0; j < c.Tk; ++j) {
      if (!data.ref.visible(i, j)) continue;
      double dot = 0.0;
      for (Index x = 0; x < c.d; ++x) dot += double(data.q[i * c.d + x]) * data.k[j * c.d + x];
      s.push_back(dot * data.ref.scale);
      m = std::max(m, s.back());
    }
    if (c.sink != -std::numeric_limits<float>::infinity()) s.push_back(c.sink);  // + exp(sink)
    if (s.empty()) {
      REQUIRE(lse[i] == -std::numeric_limits<float>::infinity());
      continue;
    }
    m = std::max(m, s.back());
    double sum = 0.0;
    for (double v : s) sum += std::exp(v - m);
    REQUIRE(lse[i] == Approx(m + std::log(sum)).epsilon(1e-5).margin(1e-5));
  }
}

/// Backward against the double reference (dq, dk, dv, and dsink with a sink), then the parallel
/// split (dq over rows [0, split) and [split, Tq), dk/dv one key block at a time) bitwise equal.
void check_backward(Case const& c, Index split) {
  Data data(c);
  auto const p = data.params();
  auto scratch = scratch_for(c);
  std::vector<float> o(static_cast<std::size_t>(c.Tq * c.dv)), lse(static_cast<std::size_t>(c.Tq)),
      delta(lse.size());
  kernels::sdpa_forward(p, o.data(), c.dv, lse.data(), 0, c.Tq, scratch.data());
  auto dout = random_vector(c.Tq * c.dv, c.seed + 9);
  std::vector<float> dq(static_cast<std::size_t>(c.Tq * c.d), 0.0f),
      dk(static_cast<std::size_t>(c.Tk * c.d), 0.0f),
      dv(static_cast<std::size_t>(c.Tk * c.dv), 0.0f);
  kernels::SdpaGrads g;
  g.o = o.data();
  g.ldo = c.dv;
  g.dout = dout.data();
  g.lddo = c.dv;
  g.lse = lse.data();
  g.delta = delta.data();
  g.dq = dq.data();
  g.lddq = c.d;
  g.dk = dk.data();
  g.lddk = c.d;
  g.dv = dv.data();
  g.lddv = c.dv;
  kernels::sdpa_backward_delta(g, c.dv, 0, c.Tq, delta.data());
  kernels::sdpa_backward(p, g, scratch.data());
  aref::Vec rq, rk, rv;
  double rsink = 0.0;
  data.ref.backward(to_double(data.q), to_double(data.k), to_double(data.v), to_double(dout), rq,
                    rk, rv, &rsink);
  CHECK(aref::rel_err(dq.data(), rq) < 1e-4);
  CHECK(aref::rel_err(dk.data(), rk) < 1e-4);
  CHECK(aref::rel_err(dv.data(), rv) < 1e-4);
  if (c.sink != -std::numeric_limits<float>::infinity()) {
    float const dsink = kernels::sdpa_sink_grad(c.sink, lse.data(), delta.data(), c.Tq);
    CHECK(dsink == Approx(rsink).epsilon(1e-4).margin(1e-5));
  }
  // The split over rows and key blocks gives the same bits.
  std::vector<float> dq2(dq.size(), 0.0f), dk2(dk.size(), 0.0f), dv2(dv.size(), 0.0f);
  g.dq = dq2.data();
  g.dk = dk2.data();
  g.dv = dv2.data();
  kernels::sdpa_backward_dq(p, g, 0, split, scratch.data());
  kernels::sdpa_backward_dq(p, g, split, c.Tq, scratch.data());
  Index const nkb = (c.Tk + kernels::kSdpaKeyBlock - 1) / kernels::kSdpaKeyBlock;
  for (Index kb = 0; kb < nkb; ++kb) kernels::sdpa_backward_dkv(p, g, kb, kb + 1, scratch.data());
  REQUIRE(std::memcmp(dq.data(), dq2.data(), dq.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(dk.data(), dk2.data(), dk.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(dv.data(), dv2.data(), dv.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("SDPA forward matches softmax(QK^T/sqrt(d))V, tails in T, d and dv",
          "[attention][sdpa]") {
  for (Index T : {1, 2, 5, 31, 32, 33, 63, 64, 65, 130}) {
    for (Index d : {1, 3, 16, 17, 64}) {
      Case c;
      c.Tq = c.Tk = T;
      c.d = d;
      c.dv = d == 17 ? 37 : d;
      c.seed = static_cast<std::uint64_t>(T * 100 + d);
      c.causal = false;
      check_forward(c);
      c.causal = true;
      check_forward(c);
    }
  }
}

TEST_CASE("SDPA forward with padding masks, positions, decode offsets", "[attention][sdpa]") {
  for (Index T : {3, 40, 129}) {
    Case c;
    c.Tq = c.Tk = T;
    c.d = 24;
    c.dv = 19;
    c.padding = true;
    check_forward(c);  // the first two keys are padding: row 0 and 1 still see later keys
    c.causal = true;   // causal + padding: rows 0 and 1 see nothing (o = 0, lse = -inf)
    check_forward(c);
    c.padding = false;
    c.positions = true;
    check_forward(c);
  }
  // Decode: 5 new queries at positions 95..99 over 100 keys.
  Case c;
  c.Tq = 5;
  c.Tk = 100;
  c.d = 16;
  c.dv = 16;
  c.causal = true;
  c.causal_offset = 95;
  check_forward(c);
}

TEST_CASE("SDPA forward is stable for long sequences and large scores", "[attention][sdpa]") {
  Case c;
  c.Tq = c.Tk = 1000;  // 16 key blocks: the running max moves many times
  c.d = 8;
  c.dv = 9;
  c.causal = true;
  c.magnitude = 12.0f;  // scores up to ~400: exp would overflow without the running max
  check_forward(c);
  c.causal = false;
  c.padding = true;
  c.magnitude = 1.0f;
  check_forward(c);
}

TEST_CASE("SDPA forward: a row's result does not depend on the row range of the call",
          "[attention][sdpa]") {
  Case c;
  c.Tq = c.Tk = 150;
  c.d = 20;
  c.dv = 20;
  c.causal = true;
  Data data(c);
  auto scratch = scratch_for(c);
  std::vector<float> a(static_cast<std::size_t>(c.Tq * c.dv)), b(a.size());
  std::vector<float> la(static_cast<std::size_t>(c.Tq)), lb(la.size());
  kernels::sdpa_forward(data.params(), a.data(), c.dv, la.data(), 0, c.Tq, scratch.data());
  for (Index r0 : {0, 7, 40, 41, 100}) {
    Index const r1 = r0 == 0 ? 7 : r0 == 7 ? 40 : r0 == 40 ? 41 : r0 == 41 ? 100 : c.Tq;
    kernels::sdpa_forward(data.params(), b.data(), c.dv, lb.data(), r0, r1, scratch.data());
  }
  REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  REQUIRE(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);
}

TEST_CASE("SDPA backward matches the analytic double reference; the split is bitwise equal",
          "[attention][sdpa][grad]") {
  std::vector<Case> cases;
  for (Index T : {1, 5, 33, 70, 200}) {
    Case c;
    c.Tq = c.Tk = T;
    c.d = T == 33 ? 17 : 16;
    c.dv = T == 70 ? 23 : c.d;
    c.causal = T != 5;
    c.padding = T == 70;
    c.positions = T == 33;
    c.seed = static_cast<std::uint64_t>(T);
    cases.push_back(c);
  }
  for (Case const& c : cases) {
    INFO("T " << c.Tq << " d " << c.d << " dv " << c.dv << " causal " << c.causal);
    check_backward(c, c.Tq / 2);
  }
}

TEST_CASE("SDPA with a sliding window and an attention sink (gpt-oss): forward, lse, backward",
          "[attention][sdpa][grad]") {
  // Windows shorter and longer than a key block, with and without a sink, with padding, and a
  // decode offset (queries at positions 100.. over 150 keys: blocks before the window skipped).
  std::vector<Case> cases;
  for (Index const window : {Index{0}, Index{5}, Index{70}}) {
    for (float const sink : {-std::numeric_limits<float>::infinity(), 0.7f, -3.0f}) {
      if (window == 0 && sink == -std::numeric_limits<float>::infinity()) continue;
      Case c;
      c.Tq = c.Tk = 150;
      c.d = c.dv = 16;
      c.causal = true;
      c.window = window;
      c.sink = sink;
      c.padding = window == 5;
      c.seed = static_cast<std::uint64_t>(window) + 7;
      cases.push_back(c);
    }
  }
  Case decode;
  decode.Tq = 20;
  decode.Tk = 150;
  decode.causal = true;
  decode.causal_offset = 130;
  decode.window = 40;
  decode.sink = 0.3f;
  cases.push_back(decode);
  for (Case const& c : cases) {
    INFO("window " << c.window << " sink " << c.sink << " padding " << c.padding << " Tq " << c.Tq);
    check_forward(c);
    check_backward(c, c.Tq / 3);
  }
}

TEST_CASE("SDPA forward over bf16 keys and values: the bits of fp32 arrays of the widened values",
          "[attention][sdpa][bf16]") {
  // k_bf16 / v_bf16 (a bf16 KV cache) against k / v holding the same values widened: the kernel
  // widens as it loads, so every output and lse must be bitwise equal, in every tail.
  for (Case c :
       {Case{1, 200, 20, 12}, Case{5, 67, 8, 8}, Case{3, 130, 128, 128}, Case{16, 300, 64, 64}}) {
    c.causal = c.Tq > 1;
    c.causal_offset = c.Tk - c.Tq;
    for (Index const window : {Index{0}, Index{50}}) {
      c.window = window;
      c.sink = window > 0 ? 0.25f : -std::numeric_limits<float>::infinity();
      INFO("Tq " << c.Tq << " Tk " << c.Tk << " d " << c.d << " dv " << c.dv << " window "
                 << window);
      Data data(c);
      std::vector<std::uint16_t> k16(data.k.size()), v16(data.v.size());
      for (std::size_t i = 0; i < k16.size(); ++i) {
        k16[i] = kernels::float_to_bf16(data.k[i]);
        data.k[i] = kernels::bf16_to_float(k16[i]);
      }
      for (std::size_t i = 0; i < v16.size(); ++i) {
        v16[i] = kernels::float_to_bf16(data.v[i]);
        data.v[i] = kernels::bf16_to_float(v16[i]);
      }
      auto scratch = scratch_for(c);
      std::vector<float> o32(static_cast<std::size_t>(c.Tq * c.dv)), o16(o32.size()),
          l32(static_cast<std::size_t>(c.Tq)), l16(l32.size());
      kernels::SdpaParams p = data.params();
      kernels::sdpa_forward(p, o32.data(), c.dv, l32.data(), 0, c.Tq, scratch.data());
      p.k = p.v = nullptr;
      p.k_bf16 = k16.data();
      p.v_bf16 = v16.data();
      kernels::sdpa_forward(p, o16.data(), c.dv, l16.data(), 0, c.Tq, scratch.data());
      REQUIRE(std::memcmp(o32.data(), o16.data(), o32.size() * sizeof(float)) == 0);
      REQUIRE(std::memcmp(l32.data(), l16.data(), l32.size() * sizeof(float)) == 0);
      // And both are the reference's attention over the rounded keys and values.
      auto const want = data.ref.forward(to_double(data.q), to_double(data.k), to_double(data.v));
      REQUIRE(aref::rel_err(o16.data(), want) < 2e-5);
    }
  }
}
