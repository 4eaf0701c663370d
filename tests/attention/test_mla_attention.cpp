// SPDX-License-Identifier: Apache-2.0
// MlaAttention: forward against a double-precision transcription of transformers'
// DeepseekV3Attention / DeepseekV2Attention (q_lora_rank set and null, YaRN on and off, the three
// RoPE layouts, attention_bias), finite-difference gradients of x and every parameter, cached
// decoding (naive and absorbed orders, fp32 and bf16 latent caches) against the uncached forward,
// determinism across threads, and the errors for bad input.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "attention/mla_reference.hpp"
#include "moe/core/random.hpp"
#include "moe/layers/mla_attention.hpp"
#include "support/finite_difference.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;

namespace {

std::vector<float> random_vector(Index n, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  moe::fill_uniform(v, lo, hi, seed);
  return v;
}

/// D 32, H 4, kv_lora_rank 16, nope 8, rope 4, v 8 (the brief's tiny shape).
moe::MlaAttentionConfig tiny(Index q_lora, bool yarn, bool interleave, bool bias = false) {
  moe::MlaAttentionConfig c;
  c.d_model = 32;
  c.num_heads = 4;
  c.q_lora_rank = q_lora;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 8;
  c.rope_theta = 10000.0f;
  c.rope_interleave = interleave;
  c.attention_bias = bias;
  if (yarn) {
    // DeepSeek-V3's rope_scaling with a short original context so that positions 0..T matter:
    // factor 40, beta 32 / 1, mscale = mscale_all_dim = 1 (V2-Lite: 0.707 both).
    c.yarn = moe::deepseek_yarn(40.0f, 16, 32.0f, 1.0f, 0.707f, 1.0f);
    c.softmax_mscale_all_dim = 1.0f;
  }
  return c;
}

void randomize(moe::MlaAttention& layer, std::uint64_t seed) {
  auto params = layer.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    bool const norm = params[i].name.find("layernorm") != std::string_view::npos;
    float const base = norm ? 1.0f : 0.0f, half = norm ? 0.3f : 0.4f;
    moe::fill_uniform(params[i].values, base - half, base + half, seed + i);
  }
}

aref::Vec* twin_buffer(aref::DoubleMla& m, std::string_view name) {
  if (name == "q_a_proj.weight") return &m.q_a_proj;
  if (name == "q_a_proj.bias") return &m.q_a_bias;
  if (name == "q_a_layernorm.weight") return &m.q_a_norm;
  if (name == "q_b_proj.weight") return &m.q_b_proj;
  if (name == "q_proj.weight") return &m.q_proj;
  if (name == "kv_a_proj_with_mqa.weight") return &m.kv_a_proj;
  if (name == "kv_a_proj_with_mqa.bias") return &m.kv_a_bias;
  if (name == "kv_a_layernorm.weight") return &m.kv_a_norm;
  if (name == "kv_b_proj.weight") return &m.kv_b_proj;
  if (name == "o_proj.weight") return &m.o_proj;
  if (name == "o_proj.bias") return &m.o_bias;
  FAIL("unknown parameter " << name);
  return nullptr;
}

aref::DoubleMla twin(moe::MlaAttention& layer, aref::DoubleMla::Rope rope) {
  auto const& c = layer.config();
  aref::DoubleMla m;
  m.D = c.d_model;
  m.H = c.num_heads;
  m.ql = c.q_lora_rank;
  m.R = c.kv_lora_rank;
  m.dn = c.qk_nope_head_dim;
  m.dr = c.qk_rope_head_dim;
  m.dv = c.v_head_dim;
  m.theta = c.rope_theta;
  m.eps = c.norm_eps;
  m.rope = rope;
  if (c.yarn.enabled()) {  // the config keys deepseek_yarn was given in tiny()
    m.factor = 40.0;
    m.original_max = 16;
    m.mscale = 0.707;
    m.mscale_all_dim = 1.0;
  }
  m.v3_scaling = c.softmax_mscale_all_dim != 0.0f;
  for (auto const& p : layer.parameters()) {
    *twin_buffer(m, p.name) = aref::Vec(p.values.begin(), p.values.end());
  }
  return m;
}

double max_abs(std::span<float const> v) {
  double m = 0.0;
  for (float a : v) m = std::max(m, static_cast<double>(std::fabs(a)));
  return m;
}

struct Case {
  Index q_lora;
  bool yarn, interleave, bias;
  aref::DoubleMla::Rope rope;
};

}  // namespace

TEST_CASE("MlaAttention forward matches transformers' DeepseekV3/V2Attention", "[mla]") {
  using R = aref::DoubleMla;
  Case const cases[] = {
      {16, false, true, false, R::kV3Interleave}, {16, true, true, false, R::kV3Interleave},
      {0, false, false, false, R::kHalf},         {0, true, false, true, R::kHalf},
      {16, true, false, true, R::kHalf},          {0, false, true, false, R::kV2Complex},
      {16, true, true, true, R::kV2Complex},
  };
  for (Case const& k : cases) {
    moe::MlaAttentionConfig cfg = tiny(k.q_lora, k.yarn, k.interleave, k.bias);
    if (k.rope == R::kV2Complex) cfg.softmax_mscale_all_dim = 0.0f;  // V2: no softmax mscale
    moe::MlaAttention layer(cfg);
    randomize(layer, 11);
    aref::DoubleMla const m = twin(layer, k.rope);
    Index const T = 9, D = 32;
    auto const x = random_vector(T * D, 5);
    std::vector<float> y(static_cast<std::size_t>(T * D));
    moe::MlaAttentionWorkspace ws;
    layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y.data(), T, D), ws);
    aref::Vec const ref = m.forward(aref::Vec(x.begin(), x.end()), T);
    double const tol = 2e-5 * std::max(1.0, max_abs(y));
    INFO("q_lora " << k.q_lora << " yarn " << k.yarn << " interleave " << k.interleave << " rope "
                   << k.rope << " bias " << k.bias);
    for (Index i = 0; i < T * D; ++i) REQUIRE(std::fabs(y[i] - ref[i]) <= tol);
    if (k.yarn && k.rope != R::kV2Complex) {  // V3's scale: qk^-1/2 mscale(40, 1)^2
      double const mscale = 0.1 * std::log(40.0) + 1.0;
      REQUIRE(layer.scale() == Approx(mscale * mscale / std::sqrt(12.0)).epsilon(1e-6));
    }
  }
}

TEST_CASE("MlaAttention backward matches finite differences of the double twin", "[mla]") {
  using R = aref::DoubleMla;
  Case const cases[] = {
      {16, true, true, true, R::kV3Interleave},
      {0, false, false, false, R::kHalf},
  };
  for (Case const& k : cases) {
    moe::MlaAttention layer(tiny(k.q_lora, k.yarn, k.interleave, k.bias));
    randomize(layer, 21);
    aref::DoubleMla m = twin(layer, k.rope);
    Index const T = 6, D = 32;
    auto const x = random_vector(T * D, 8);
    auto const dy = random_vector(T * D, 9);
    std::vector<float> y(static_cast<std::size_t>(T * D)), dx(y.size());
    moe::MlaAttentionWorkspace ws;
    layer.forward_train(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y.data(), T, D),
                        ws);
    auto grads = layer.make_gradients();
    layer.backward(ws, ConstMatrixView<float>(dy.data(), T, D), MatrixView<float>(dx.data(), T, D),
                   grads);
    aref::Vec xd(x.begin(), x.end());
    aref::Vec const dyd(dy.begin(), dy.end());
    auto central = [&](aref::Vec& v, Index i) {
      return ref::central_difference(m, v, i, xd, dyd, T);
    };
    auto const close = ref::require_close;
    for (Index i = 0; i < T * D; ++i) close(dx[i], central(xd, i), "dx", i);
    std::size_t checked = 0;
    for (auto const& g : grads.groups()) {
      aref::Vec& v = *twin_buffer(m, g.name);
      REQUIRE(v.size() == g.values.size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        close(g.values[i], central(v, static_cast<Index>(i)), g.name, static_cast<Index>(i));
      }
      ++checked;
    }
    REQUIRE(checked == (k.q_lora > 0 ? 7u : 5u) + (k.bias ? 3u : 0u));
  }
}

TEST_CASE("MlaAttention cached decode equals the uncached forward in both orders", "[mla]") {
  for (Index q_lora : {Index{16}, Index{0}}) {
    for (moe::KvFormat format : {moe::KvFormat::kF32, moe::KvFormat::kBf16}) {
      for (moe::MlaOrder order :
           {moe::MlaOrder::kNaive, moe::MlaOrder::kAbsorbed, moe::MlaOrder::kAuto}) {
        moe::MlaAttention layer(tiny(q_lora, true, true, true));
        randomize(layer, 31);
        Index const T = 12, D = 32, prompt = 5;
        auto const x = random_vector(T * D, 3);
        std::vector<float> full(static_cast<std::size_t>(T * D)), y(full.size());
        moe::MlaAttentionWorkspace ws;
        layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(full.data(), T, D),
                      ws);
        // Two sequences: the same tokens, one cached in a prompt and single steps, the other in
        // steps of 3 (the second sequence's rows come second in x).
        moe::KvCache cache = layer.make_cache(2, 0, format);
        REQUIRE(cache.bytes_per_token() == (format == moe::KvFormat::kF32 ? 80u : 40u));
        std::vector<float> xin, yout;
        for (Index a = 0, b = 0; a < T || b < T;) {
          Index const na = a == 0 ? prompt : std::min<Index>(1, T - a);
          Index const nb = std::min<Index>(3, T - b);
          xin.assign(x.begin() + a * D, x.begin() + (a + na) * D);
          xin.insert(xin.end(), x.begin() + b * D, x.begin() + (b + nb) * D);
          yout.resize(xin.size());
          Index const n[2] = {na, nb};
          layer.forward_cached(ConstMatrixView<float>(xin.data(), na + nb, D),
                               MatrixView<float>(yout.data(), na + nb, D), cache, n, ws, nullptr,
                               order);
          std::copy(yout.begin(), yout.begin() + na * D, y.begin() + a * D);
          // The second sequence's rows: compare at once.
          double const scale = std::max(1.0, max_abs(full));
          double const tol = (format == moe::KvFormat::kF32 ? 2e-5 : 2e-2) * scale;
          for (Index i = 0; i < nb * D; ++i) {
            INFO("sequence 1 row " << b + i / D << " order " << static_cast<int>(order));
            REQUIRE(std::fabs(yout[na * D + i] - full[b * D + i]) <= tol);
          }
          a += na;
          b += nb;
        }
        REQUIRE(cache.length(0) == T);
        REQUIRE(cache.length(1) == T);
        double const tol =
            (format == moe::KvFormat::kF32 ? 2e-5 : 2e-2) * std::max(1.0, max_abs(full));
        for (Index i = 0; i < T * D; ++i) {
          INFO("row " << i / D << " order " << static_cast<int>(order) << " q_lora " << q_lora);
          REQUIRE(std::fabs(y[i] - full[i]) <= tol);
        }
      }
    }
  }
}

TEST_CASE("MlaAttention naive and absorbed orders agree; the order rule", "[mla]") {
  moe::MlaAttention layer(tiny(16, false, true));
  randomize(layer, 41);
  Index const D = 32, prompt = 20;
  auto const x = random_vector((prompt + 4) * D, 4);
  std::vector<float> ya(static_cast<std::size_t>(4 * D)), yn(ya.size());
  moe::MlaAttentionWorkspace ws;
  for (moe::KvFormat format : {moe::KvFormat::kF32, moe::KvFormat::kBf16}) {
    moe::KvCache a = layer.make_cache(1, 0, format), n = layer.make_cache(1, 0, format);
    Index const p[1] = {prompt}, s[1] = {4};
    std::vector<float> tmp(static_cast<std::size_t>(prompt * D));
    layer.forward_cached(ConstMatrixView<float>(x.data(), prompt, D),
                         MatrixView<float>(tmp.data(), prompt, D), a, p, ws);
    layer.forward_cached(ConstMatrixView<float>(x.data(), prompt, D),
                         MatrixView<float>(tmp.data(), prompt, D), n, p, ws);
    layer.forward_cached(ConstMatrixView<float>(x.data() + prompt * D, 4, D),
                         MatrixView<float>(ya.data(), 4, D), a, s, ws, nullptr,
                         moe::MlaOrder::kAbsorbed);
    layer.forward_cached(ConstMatrixView<float>(x.data() + prompt * D, 4, D),
                         MatrixView<float>(yn.data(), 4, D), n, s, ws, nullptr,
                         moe::MlaOrder::kNaive);
    // Both read the same (rounded) latent rows: they differ by fp32 re-association only.
    double const tol = 1e-5 * std::max(1.0, max_abs(yn));
    for (std::size_t i = 0; i < ya.size(); ++i) REQUIRE(std::fabs(ya[i] - yn[i]) <= tol);
  }
  // The rule: a decode step on a context absorbs; a prefill from nothing expands (2 R > d_n +
  // d_v here: 32 > 16); the crossover on a long context is R (d_n + d_v) / (2 R + d_r - d_q -
  // d_v) = 256 / 16 = 16 new tokens.
  moe::KvCache c = layer.make_cache(1);
  Index const one[1] = {1}, many[1] = {64};
  REQUIRE(layer.choose_order(many, c) == moe::MlaOrder::kNaive);
  std::vector<float> tmp(static_cast<std::size_t>(prompt * D));
  Index const p[1] = {prompt};
  layer.forward_cached(ConstMatrixView<float>(x.data(), prompt, D),
                       MatrixView<float>(tmp.data(), prompt, D), c, p, ws);
  REQUIRE(layer.choose_order(one, c) == moe::MlaOrder::kAbsorbed);
  REQUIRE(layer.cached_flops(moe::MlaOrder::kAbsorbed, 8, 100000) <
          layer.cached_flops(moe::MlaOrder::kNaive, 8, 100000));
  REQUIRE(layer.cached_flops(moe::MlaOrder::kAbsorbed, 32, 100000) >
          layer.cached_flops(moe::MlaOrder::kNaive, 32, 100000));
}

TEST_CASE("MlaAttention is bitwise identical for 1 and 2 threads", "[mla]") {
  moe::MlaAttention layer(tiny(16, true, true, true));
  randomize(layer, 51);
  Index const T = 70, D = 32;  // two token tiles, two query chunks
  auto const x = random_vector(T * D, 6);
  auto const dy = random_vector(T * D, 7);
  moe::ThreadPool pool(2);
  auto run = [&](moe::ThreadPool* p) {
    moe::MlaAttentionWorkspace ws;
    std::vector<float> y(static_cast<std::size_t>(T * D)), dx(y.size());
    moe::AttentionOptions opt;
    opt.pool = p;
    layer.forward_train(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y.data(), T, D),
                        ws, opt);
    auto g = layer.make_gradients();
    layer.backward(ws, ConstMatrixView<float>(dy.data(), T, D), MatrixView<float>(dx.data(), T, D),
                   g, p);
    std::vector<float> out = y;
    out.insert(out.end(), dx.begin(), dx.end());
    for (auto const& b : g.groups()) out.insert(out.end(), b.values.begin(), b.values.end());
    for (moe::MlaOrder order : {moe::MlaOrder::kNaive, moe::MlaOrder::kAbsorbed}) {
      moe::KvCache cache = layer.make_cache(1);
      Index const pre[1] = {T - 1}, step[1] = {1};
      layer.forward_cached(ConstMatrixView<float>(x.data(), T - 1, D),
                           MatrixView<float>(y.data(), T - 1, D), cache, pre, ws, p, order);
      layer.forward_cached(ConstMatrixView<float>(x.data() + (T - 1) * D, 1, D),
                           MatrixView<float>(y.data(), 1, D), cache, step, ws, p, order);
      out.insert(out.end(), y.begin(), y.begin() + D);
    }
    return out;
  };
  std::vector<float> const a = run(nullptr), b = run(&pool);
  REQUIRE(a.size() == b.size());
  REQUIRE(std::equal(a.begin(), a.end(), b.begin(),
                     [](float u, float v) { return std::memcmp(&u, &v, sizeof u) == 0; }));
}

TEST_CASE("MlaAttention packed projections give the fp32 forward", "[mla]") {
  moe::MlaAttention layer(tiny(16, false, true, true));
  randomize(layer, 61);
  Index const T = 9, D = 32;
  auto const x = random_vector(T * D, 2);
  std::vector<float> y0(static_cast<std::size_t>(T * D)), y1(y0.size());
  moe::MlaAttentionWorkspace ws;
  layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y0.data(), T, D), ws);
  layer.pack_weights(moe::experts::WeightFormat::kF32);
  REQUIRE(layer.packed());
  layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y1.data(), T, D), ws);
  for (std::size_t i = 0; i < y0.size(); ++i) REQUIRE(y1[i] == Approx(y0[i]).margin(1e-5));
  layer.pack_weights(moe::experts::WeightFormat::kBf16);
  layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y1.data(), T, D), ws);
  double const tol = 3e-2 * std::max(1.0, max_abs(y0));
  for (std::size_t i = 0; i < y0.size(); ++i) REQUIRE(std::fabs(y1[i] - y0[i]) <= tol);
  (void)layer.parameters();
  REQUIRE_FALSE(layer.packed());
  SECTION("discard_master_weights: the packs alone give the same outputs, cached too") {
    REQUIRE_THROWS_WITH(layer.discard_master_weights(), Catch::Contains("not packed"));
    layer.pack_weights(moe::experts::WeightFormat::kBf16);
    std::size_t const bytes = layer.projection_bytes();
    moe::KvCache c0 = layer.make_cache(1), c1 = layer.make_cache(1);
    std::vector<Index> const n = {T};
    std::vector<float> z0(y0.size()), z1(y0.size());
    layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y0.data(), T, D), ws);
    layer.forward_cached(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(z0.data(), T, D),
                         c0, n, ws);
    layer.discard_master_weights();
    REQUIRE_FALSE(layer.has_master_weights());
    REQUIRE(layer.projection_bytes() == bytes);  // the packs and kv_b_proj, as before
    layer.forward(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(y1.data(), T, D), ws);
    layer.forward_cached(ConstMatrixView<float>(x.data(), T, D), MatrixView<float>(z1.data(), T, D),
                         c1, n, ws);
    REQUIRE(y1 == y0);
    REQUIRE(z1 == z0);
    REQUIRE_THROWS_WITH(layer.forward_train(ConstMatrixView<float>(x.data(), T, D),
                                            MatrixView<float>(y1.data(), T, D), ws),
                        Catch::Contains("inference-only"));
    REQUIRE_THROWS_WITH(layer.parameters(), Catch::Contains("discarded"));
  }
}

TEST_CASE("MlaAttention rejects bad configs and shapes", "[mla]") {
  auto throws = [](moe::MlaAttentionConfig const& c) {
    REQUIRE_THROWS_AS(moe::MlaAttention(c), moe::Error);
  };
  moe::MlaAttentionConfig c = tiny(16, false, true);
  c.qk_rope_head_dim = 3;
  throws(c);
  c = tiny(16, false, true);
  c.kv_lora_rank = 0;
  throws(c);
  c = tiny(16, false, true);
  c.q_lora_rank = -1;
  throws(c);
  c = tiny(16, false, true);
  c.rope_theta = 0.5f;
  throws(c);
  c = tiny(16, true, true);
  c.yarn.beta_fast = -1.0f;
  throws(c);
  c = tiny(16, false, true);
  c.norm_eps = 0.0f;
  throws(c);

  moe::MlaAttention layer(tiny(16, false, true));
  moe::MlaAttentionWorkspace ws;
  std::vector<float> x(4 * 32), y(4 * 32);
  REQUIRE_THROWS_AS(layer.forward(ConstMatrixView<float>(x.data(), 4, 31),
                                  MatrixView<float>(y.data(), 4, 32), ws),
                    moe::Error);
  REQUIRE_THROWS_AS(layer.forward(ConstMatrixView<float>(x.data(), 4, 32),
                                  MatrixView<float>(y.data(), 3, 32), ws),
                    moe::Error);
  auto g = layer.make_gradients();
  REQUIRE_THROWS_AS(layer.backward(ws, ConstMatrixView<float>(y.data(), 4, 32),
                                   MatrixView<float>(x.data(), 4, 32), g),
                    moe::Error);
  moe::KvCache wrong(1, 20);
  Index const n[1] = {4};
  REQUIRE_THROWS_AS(layer.forward_cached(ConstMatrixView<float>(x.data(), 4, 32),
                                         MatrixView<float>(y.data(), 4, 32), wrong, n, ws),
                    moe::Error);
  moe::KvCache cache = layer.make_cache(1);
  Index const bad[1] = {3};
  REQUIRE_THROWS_AS(layer.forward_cached(ConstMatrixView<float>(x.data(), 4, 32),
                                         MatrixView<float>(y.data(), 4, 32), cache, bad, ws),
                    moe::Error);
  try {
    c = tiny(16, false, true);
    c.qk_rope_head_dim = 5;
    moe::MlaAttention bad_layer(c);
    FAIL("no error");
  } catch (moe::Error const& e) {
    REQUIRE(std::string(e.what()).find("qk_rope_head_dim") != std::string::npos);
  }
}

TEST_CASE("MlaAttention batch of two sequences equals two calls; positions shift RoPE", "[mla]") {
  moe::MlaAttention layer(tiny(0, true, false, true));
  randomize(layer, 71);
  Index const S = 7, D = 32;
  auto const x = random_vector(2 * S * D, 12);
  std::vector<float> both(x.size()), one(static_cast<std::size_t>(S * D));
  moe::MlaAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.batch = 2;
  layer.forward(ConstMatrixView<float>(x.data(), 2 * S, D),
                MatrixView<float>(both.data(), 2 * S, D), ws, opt);
  for (Index b = 0; b < 2; ++b) {
    layer.forward(ConstMatrixView<float>(x.data() + b * S * D, S, D),
                  MatrixView<float>(one.data(), S, D), ws);
    // 14 rows take the projections' panel path, 7 their dot products: rounding differs.
    double const tol = 1e-5 * std::max(1.0, max_abs(one));
    for (Index i = 0; i < S * D; ++i) REQUIRE(std::fabs(both[b * S * D + i] - one[i]) <= tol);
  }
  // Positions p + 5 for every token: RoPE sees relative offsets only, so the output is the same
  // up to rounding (YaRN scales cos and sin alike at every position).
  std::vector<Index> pos(static_cast<std::size_t>(S));
  for (Index t = 0; t < S; ++t) pos[static_cast<std::size_t>(t)] = t + 5;
  moe::AttentionOptions shifted;
  shifted.positions = pos;
  std::vector<float> y0(one.size()), y1(one.size());
  layer.forward(ConstMatrixView<float>(x.data(), S, D), MatrixView<float>(y0.data(), S, D), ws);
  layer.forward(ConstMatrixView<float>(x.data(), S, D), MatrixView<float>(y1.data(), S, D), ws,
                shifted);
  double const tol = 1e-4 * std::max(1.0, max_abs(y0));
  for (std::size_t i = 0; i < y0.size(); ++i) REQUIRE(std::fabs(y1[i] - y0[i]) <= tol);
}
