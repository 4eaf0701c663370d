// SPDX-License-Identifier: Apache-2.0
// GatedDeltaNet (Qwen3-Next / Qwen3.5 linear attention): forward against a double-precision
// transcription of transformers' code in both weight layouts, chunked == recurrent, prompt +
// decode steps == the whole sequence (and == transformers' cache path), several sequences in one
// call, finite-difference gradients of every parameter and of x, determinism across threads, the
// fixed state size, and the errors for bad input.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <string_view>
#include <utility>
#include <vector>

#include "attention/deltanet_reference.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/layers/gated_deltanet.hpp"
#include "support/finite_difference.hpp"
#include "support/helpers.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
using test::random_vector;

namespace {

/// D 32, 2 key heads, 4 value heads of 8, kernel 4.
moe::GatedDeltaNetConfig config(moe::DeltaNetLayout layout) {
  return {.d_model = 32,
          .num_key_heads = 2,
          .num_value_heads = 4,
          .key_head_dim = 8,
          .value_head_dim = 8,
          .conv_kernel = 4,
          .layout = layout};
}

void randomize(moe::GatedDeltaNet& layer, std::uint64_t seed) {
  auto params = layer.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    std::string_view const name = params[i].name;
    float lo = -0.5f, hi = 0.5f;
    if (name == "A_log") lo = -1.5f, hi = 0.5f;
    if (name == "dt_bias" || name == "norm.weight") lo = 0.5f, hi = 1.5f;
    moe::fill_uniform(params[i].values, lo, hi, seed + i);
  }
}

dnref::Vec* twin_buffer(dnref::DeltaNet& m, std::string_view name) {
  static constexpr std::pair<std::string_view, dnref::Vec dnref::DeltaNet::*> kNamed[] = {
      {"in_proj_qkvz.weight", &dnref::DeltaNet::in_proj_qkvz},
      {"in_proj_ba.weight", &dnref::DeltaNet::in_proj_ba},
      {"in_proj_qkv.weight", &dnref::DeltaNet::in_proj_qkv},
      {"in_proj_z.weight", &dnref::DeltaNet::in_proj_z},
      {"in_proj_b.weight", &dnref::DeltaNet::in_proj_b},
      {"in_proj_a.weight", &dnref::DeltaNet::in_proj_a},
      {"conv1d.weight", &dnref::DeltaNet::conv1d},
      {"A_log", &dnref::DeltaNet::A_log},
      {"dt_bias", &dnref::DeltaNet::dt_bias},
      {"norm.weight", &dnref::DeltaNet::norm},
      {"out_proj.weight", &dnref::DeltaNet::out_proj}};
  for (auto const& [n, member] : kNamed) {
    if (n == name) return &(m.*member);
  }
  FAIL("no twin buffer " << name);
  return nullptr;
}

dnref::DeltaNet twin(moe::GatedDeltaNet& layer) {
  auto const& c = layer.config();
  dnref::DeltaNet m{.D = c.d_model,
                    .Hk = c.num_key_heads,
                    .Hv = c.num_value_heads,
                    .dk = c.key_head_dim,
                    .dv = c.value_head_dim,
                    .kernel = c.conv_kernel,
                    .chunk = c.chunk_size,
                    .eps = c.norm_eps,
                    .qwen35 = c.layout == moe::DeltaNetLayout::kQwen35};
  for (auto const& p : layer.parameters()) {
    *twin_buffer(m, p.name) = dnref::Vec(p.values.begin(), p.values.end());
  }
  return m;
}

double rel_err(float const* got, dnref::Vec const& want) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
double rel_err(std::vector<float> const& got, std::vector<float> const& want) {
  return rel_err(got.data(), dnref::Vec(want.begin(), want.end()));
}

std::vector<float> run(moe::GatedDeltaNet const& layer, std::vector<float> const& x, Index T,
                       moe::DeltaRule rule, moe::ThreadPool* pool = nullptr) {
  Index const D = layer.d_model();
  std::vector<float> y(static_cast<std::size_t>(T * D));
  moe::GatedDeltaNetWorkspace ws;
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, pool, rule);
  return y;
}

}  // namespace

TEST_CASE("GatedDeltaNet forward matches transformers' chunked and recurrent rules",
          "[attention][deltanet]") {
  for (auto const layout : {moe::DeltaNetLayout::kQwen3Next, moe::DeltaNetLayout::kQwen35}) {
    for (Index const T : {Index{1}, Index{5}, Index{64}, Index{150}}) {
      DYNAMIC_SECTION("layout " << static_cast<int>(layout) << ", T " << T) {
        moe::GatedDeltaNet layer(config(layout));
        randomize(layer, 31);
        auto const m = twin(layer);
        Index const D = layer.d_model();
        auto const x = random_vector(T * D, 41);
        dnref::Vec const xd(x.begin(), x.end());
        dnref::Vec const want_chunk = m.forward(xd, T);
        dnref::Vec const want_rec = m.forward(xd, T, nullptr, true);
        // The two reference rules agree to double rounding.
        double diff = 0.0, den = 0.0;
        for (std::size_t i = 0; i < want_rec.size(); ++i) {
          diff = std::max(diff, std::fabs(want_chunk[i] - want_rec[i]));
          den = std::max(den, std::fabs(want_rec[i]));
        }
        REQUIRE(diff <= 1e-12 * den);
        auto const chunked = run(layer, x, T, moe::DeltaRule::kChunked);
        auto const recurrent = run(layer, x, T, moe::DeltaRule::kRecurrent);
        auto const automatic = run(layer, x, T, moe::DeltaRule::kAuto);
        CHECK(rel_err(chunked.data(), want_chunk) < 1e-5);
        CHECK(rel_err(recurrent.data(), want_rec) < 1e-5);
        CHECK(rel_err(chunked, recurrent) < 1e-5);
        CHECK(automatic == (T > 1 ? chunked : recurrent));
      }
    }
  }
}

TEST_CASE("GatedDeltaNet: strong decay and long sequences stay finite, both rules agree",
          "[attention][deltanet]") {
  moe::GatedDeltaNet layer(config(moe::DeltaNetLayout::kQwen35));
  randomize(layer, 37);
  for (auto& p : layer.parameters()) {  // A up to 16 (transformers' init range) and large a
    if (p.name == "A_log") moe::fill_uniform(p.values, 2.0f, 2.77f, 38);
    if (p.name == "in_proj_a.weight") moe::fill_uniform(p.values, -3.0f, 3.0f, 39);
  }
  Index const T = 300, D = layer.d_model();
  auto const x = random_vector(T * D, 40, -3.0f, 3.0f);
  auto const chunked = run(layer, x, T, moe::DeltaRule::kChunked);
  auto const recurrent = run(layer, x, T, moe::DeltaRule::kRecurrent);
  REQUIRE(std::all_of(chunked.begin(), chunked.end(), [](float v) { return std::isfinite(v); }));
  CHECK(rel_err(chunked, recurrent) < 1e-5);
  auto const m = twin(layer);
  CHECK(rel_err(chunked.data(), m.forward(dnref::Vec(x.begin(), x.end()), T)) < 1e-5);
}

TEST_CASE("GatedDeltaNet: the two layouts are the same layer for permuted weights",
          "[attention][deltanet]") {
  moe::GatedDeltaNet next(config(moe::DeltaNetLayout::kQwen3Next));
  moe::GatedDeltaNet q35(config(moe::DeltaNetLayout::kQwen35));
  randomize(next, 5);
  Index const D = next.d_model(), P = next.proj_cols();
  // Row r of the Qwen3-Next projections feeds output column r; copy each to the row of the
  // Qwen3.5 projection feeding the same quantity.
  auto src = next.parameters();
  auto dst = q35.parameters();
  auto find = [](moe::ParameterList& l, std::string_view n) {
    for (auto& p : l) {
      if (p.name == n) return p.values;
    }
    FAIL("no parameter " << n);
    return std::span<float>{};
  };
  std::vector<float> next_rows(static_cast<std::size_t>(P * D));  // [P, D] in next's order
  auto qkvz = find(src, "in_proj_qkvz.weight");
  auto ba = find(src, "in_proj_ba.weight");
  std::copy(qkvz.begin(), qkvz.end(), next_rows.begin());
  std::copy(ba.begin(), ba.end(), next_rows.begin() + static_cast<std::ptrdiff_t>(qkvz.size()));
  std::vector<float> q35_rows(next_rows.size());
  auto const& c = next.config();
  auto move_row = [&](Index from, Index to) {
    std::copy_n(next_rows.begin() + from * D, D, q35_rows.begin() + to * D);
  };
  for (Index kh = 0; kh < c.num_key_heads; ++kh) {
    for (Index i = 0; i < c.key_head_dim; ++i) {
      move_row(next.q_col(kh, i), q35.q_col(kh, i));
      move_row(next.k_col(kh, i), q35.k_col(kh, i));
    }
  }
  for (Index h = 0; h < c.num_value_heads; ++h) {
    for (Index i = 0; i < c.value_head_dim; ++i) {
      move_row(next.v_col(h, i), q35.v_col(h, i));
      move_row(next.z_col(h, i), q35.z_col(h, i));
    }
    move_row(next.b_col(h), q35.b_col(h));
    move_row(next.a_col(h), q35.a_col(h));
  }
  Index row = 0;
  for (auto name :
       {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}) {
    auto d = find(dst, name);
    std::copy_n(q35_rows.begin() + row * D, d.size(), d.begin());
    row += static_cast<Index>(d.size()) / D;
  }
  for (auto name : {"conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"}) {
    auto s = find(src, name);
    std::copy(s.begin(), s.end(), find(dst, name).begin());
  }
  Index const T = 70;
  auto const x = random_vector(T * D, 8);
  REQUIRE(run(next, x, T, moe::DeltaRule::kAuto) == run(q35, x, T, moe::DeltaRule::kAuto));
}

TEST_CASE("GatedDeltaNet: a prompt then decode steps equal the whole sequence",
          "[attention][deltanet][cache]") {
  for (auto const layout : {moe::DeltaNetLayout::kQwen3Next, moe::DeltaNetLayout::kQwen35}) {
    for (Index const prompt : {Index{2}, Index{70}}) {  // shorter than the kernel, longer
      DYNAMIC_SECTION("layout " << static_cast<int>(layout) << ", prompt " << prompt) {
        moe::GatedDeltaNet layer(config(layout));
        randomize(layer, 17);
        Index const D = layer.d_model(), steps = 6, T = prompt + steps;
        auto const x = random_vector(T * D, 19);
        auto const whole = run(layer, x, T, moe::DeltaRule::kAuto);
        auto state = layer.make_state();
        std::size_t const bytes = state.bytes();
        moe::GatedDeltaNetWorkspace ws;
        std::vector<float> y(static_cast<std::size_t>(T * D));
        layer.forward({x.data(), prompt, D}, {y.data(), prompt, D}, state, ws);
        for (Index t = prompt; t < T; ++t) {
          layer.forward({x.data() + t * D, 1, D}, {y.data() + t * D, 1, D}, state, ws);
        }
        REQUIRE(state.tokens == T);
        REQUIRE(state.bytes() == bytes);
        CHECK(rel_err(y, whole) < 1e-5);
        // transformers' cache path: the prompt chunked, then torch_causal_conv1d_update and the
        // recurrent rule from the cached state.
        auto const m = twin(layer);
        dnref::DeltaNet::Cache cache;
        dnref::Vec want = m.forward(dnref::Vec(x.begin(), x.begin() + prompt * D), prompt, &cache);
        for (Index t = prompt; t < T; ++t) {
          dnref::Vec const yt =
              m.forward(dnref::Vec(x.begin() + t * D, x.begin() + (t + 1) * D), 1, &cache);
          want.insert(want.end(), yt.begin(), yt.end());
        }
        CHECK(rel_err(y.data(), want) < 1e-5);
        // Two prompts in a row (the second continues with the chunked rule from the state).
        state.reset();
        Index const half = T / 2;
        layer.forward({x.data(), half, D}, {y.data(), half, D}, state, ws);
        layer.forward({x.data() + half * D, T - half, D}, {y.data() + half * D, T - half, D}, state,
                      ws);
        CHECK(rel_err(y, whole) < 1e-5);
      }
    }
  }
}

TEST_CASE("GatedDeltaNet: several sequences in one call equal one call each",
          "[attention][deltanet][cache]") {
  moe::GatedDeltaNet layer(config(moe::DeltaNetLayout::kQwen3Next));
  randomize(layer, 23);
  Index const D = layer.d_model();
  std::vector<Index> const counts = {5, 0, 1, 9};
  Index const T = 15;
  auto const x = random_vector(T * D, 29);
  auto const prefix = random_vector(3 * D, 30);
  std::vector<moe::DeltaNetState> states(counts.size(), layer.make_state()), solo = states;
  moe::GatedDeltaNetWorkspace ws;
  std::vector<float> y(static_cast<std::size_t>(T * D)), ys(y.size()), scratch(3 * D);
  for (std::size_t s = 0; s < states.size(); ++s) {  // some history first
    layer.forward({prefix.data(), 3, D}, {scratch.data(), 3, D}, states[s], ws);
    layer.forward({prefix.data(), 3, D}, {scratch.data(), 3, D}, solo[s], ws);
  }
  std::vector<moe::DeltaNetState*> ptrs;
  for (auto& s : states) ptrs.push_back(&s);
  layer.forward_cached({x.data(), T, D}, {y.data(), T, D}, ptrs, counts, ws);
  Index r = 0;
  for (std::size_t s = 0; s < counts.size(); ++s) {
    layer.forward({x.data() + r * D, counts[s], D}, {ys.data() + r * D, counts[s], D}, solo[s], ws);
    r += counts[s];
  }
  CHECK(rel_err(y, ys) < 1e-6);
  for (std::size_t s = 0; s < states.size(); ++s) {
    CHECK(states[s].tokens == solo[s].tokens);
    // The projections round differently for 15 rows and for 5 (kernels::kPanelMinRows).
    CHECK(rel_err(states[s].conv, solo[s].conv) < 1e-6);
    CHECK(rel_err(states[s].recurrent, solo[s].recurrent) < 1e-5);
  }
}

TEST_CASE("GatedDeltaNet: the tiled value-head order (GGUF Qwen3.5) is the grouped one permuted",
          "[attention][deltanet]") {
  // 2 key heads, 6 value heads (R = 3): tiled head t is grouped head (t mod 2) 3 + t / 2.
  moe::GatedDeltaNetConfig c = config(moe::DeltaNetLayout::kQwen35);
  c.num_value_heads = 6;
  moe::GatedDeltaNet grouped(c);
  c.head_order = moe::DeltaNetHeadOrder::kTiled;
  moe::GatedDeltaNet tiled(c);
  randomize(grouped, 7);
  Index const D = c.d_model, Hk = c.num_key_heads, Hv = c.num_value_heads, R = Hv / Hk;
  Index const dv = c.value_head_dim, K = Hk * c.key_head_dim, V = Hv * dv, KW = c.conv_kernel;
  auto from = [&](Index t) { return (t % Hk) * R + t / Hk; };  // the grouped head of tiled t
  auto src = grouped.parameters();
  auto dst = tiled.parameters();
  for (std::size_t i = 0; i < src.size(); ++i) {
    std::string_view const n = src[i].name;
    std::span<float const> const s = src[i].values;
    std::span<float> const d = dst[i].values;
    std::copy(s.begin(), s.end(), d.begin());
    // Per tiled head t: `block` consecutive rows of `row` values at `base`, from grouped's.
    auto heads = [&](Index base, Index block, Index row) {
      for (Index t = 0; t < Hv; ++t) {
        std::copy_n(s.begin() + (base + from(t) * block) * row, block * row,
                    d.begin() + (base + t * block) * row);
      }
    };
    if (n == "in_proj_qkv.weight") heads(2 * K, dv, D);
    if (n == "in_proj_z.weight") heads(0, dv, D);
    if (n == "in_proj_b.weight" || n == "in_proj_a.weight") heads(0, 1, D);
    if (n == "A_log" || n == "dt_bias") heads(0, 1, 1);
    if (n == "conv1d.weight") heads(2 * K, dv, KW);
    if (n == "out_proj.weight") {  // columns
      for (Index r = 0; r < D; ++r) {
        for (Index t = 0; t < Hv; ++t) {
          std::copy_n(s.begin() + r * V + from(t) * dv, dv, d.begin() + r * V + t * dv);
        }
      }
    }
  }
  Index const T = 70;
  auto const x = random_vector(T * D, 9);
  for (auto const rule : {moe::DeltaRule::kChunked, moe::DeltaRule::kRecurrent}) {
    // The same numbers per head; out_proj sums the heads in another order.
    REQUIRE(rel_err(run(tiled, x, T, rule), run(grouped, x, T, rule)) < 1e-6);
  }
  // A wrong key head for any value head changes the output: the test can fail.
  c.head_order = moe::DeltaNetHeadOrder::kGrouped;
  moe::GatedDeltaNet wrong(c);
  auto w = wrong.parameters();
  for (std::size_t i = 0; i < w.size(); ++i) {
    std::copy(dst[i].values.begin(), dst[i].values.end(), w[i].values.begin());
  }
  REQUIRE(rel_err(run(wrong, x, T, moe::DeltaRule::kAuto),
                  run(grouped, x, T, moe::DeltaRule::kAuto)) > 1e-3);
  // Training: the input gradient of the same upstream gradient.
  auto const dyf = random_vector(T * D, 10);
  auto dx_of = [&](moe::GatedDeltaNet& l) {
    std::vector<float> y(x.size()), dx(x.size());
    moe::GatedDeltaNetWorkspace ws;
    l.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
    auto g = l.make_gradients();
    l.backward(ws, {dyf.data(), T, D}, {dx.data(), T, D}, g);
    return dx;
  };
  REQUIRE(rel_err(dx_of(tiled), dx_of(grouped)) < 1e-5);
}

TEST_CASE("GatedDeltaNet gradients match finite differences of the double twin",
          "[attention][deltanet][grad]") {
  for (auto const layout : {moe::DeltaNetLayout::kQwen3Next, moe::DeltaNetLayout::kQwen35}) {
    for (auto const rule : {moe::DeltaRule::kChunked, moe::DeltaRule::kRecurrent}) {
      DYNAMIC_SECTION("layout " << static_cast<int>(layout) << ", rule "
                                << static_cast<int>(rule)) {
        moe::GatedDeltaNetConfig const c{.d_model = 6,
                                         .num_key_heads = 1,
                                         .num_value_heads = 2,
                                         .key_head_dim = 4,
                                         .value_head_dim = 3,
                                         .conv_kernel = 3,
                                         .layout = layout,
                                         .chunk_size = 3};  // checkpoints, a partial chunk
        moe::GatedDeltaNet layer(c);
        randomize(layer, 51);
        Index const T = 8, D = c.d_model;
        auto const xf = random_vector(T * D, 52), dyf = random_vector(T * D, 53);
        auto m = twin(layer);
        std::vector<float> y(xf.size()), dx(xf.size());
        moe::GatedDeltaNetWorkspace ws;
        layer.forward_train({xf.data(), T, D}, {y.data(), T, D}, ws, nullptr, rule);
        dnref::Vec x(xf.begin(), xf.end()), dy(dyf.begin(), dyf.end());
        REQUIRE(rel_err(y.data(), m.forward(x, T, nullptr, true)) < 1e-5);
        auto grads = layer.make_gradients();
        layer.backward(ws, {dyf.data(), T, D}, {dx.data(), T, D}, grads);
        ref::require_gradients(m, grads.groups(), twin_buffer, x, dy, T, dx.data());
      }
    }
  }
}

TEST_CASE("GatedDeltaNet forward and backward are bitwise identical for 1 and 2 threads",
          "[attention][deltanet][determinism]") {
  moe::GatedDeltaNet layer(config(moe::DeltaNetLayout::kQwen3Next));
  randomize(layer, 61);
  Index const T = 150, D = layer.d_model();
  auto const x = random_vector(T * D, 62), dy = random_vector(T * D, 63);
  moe::ThreadPool pool(2);
  auto train = [&](moe::ThreadPool* p) {
    moe::GatedDeltaNetWorkspace ws;
    std::vector<float> y(x.size()), dx(x.size());
    layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, p);
    auto grads = layer.make_gradients();
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, p);
    std::vector<float> all = y;
    all.insert(all.end(), dx.begin(), dx.end());
    for (auto const& g : grads.groups()) all.insert(all.end(), g.values.begin(), g.values.end());
    return all;
  };
  REQUIRE(train(nullptr) == train(&pool));
  REQUIRE(run(layer, x, T, moe::DeltaRule::kAuto) ==
          run(layer, x, T, moe::DeltaRule::kAuto, &pool));
}

TEST_CASE("GatedDeltaNet: packed projections give the fp32 layer's result",
          "[attention][deltanet]") {
  moe::GatedDeltaNet layer(config(moe::DeltaNetLayout::kQwen35));
  randomize(layer, 71);
  Index const T = 40, D = layer.d_model();
  auto const x = random_vector(T * D, 72);
  auto const plain = run(layer, x, T, moe::DeltaRule::kAuto);
  layer.pack_weights(moe::experts::WeightFormat::kF32);
  REQUIRE(layer.packed());
  CHECK(rel_err(run(layer, x, T, moe::DeltaRule::kAuto), plain) < 1e-6);
  layer.pack_weights(moe::experts::WeightFormat::kBf16);
  CHECK(rel_err(run(layer, x, T, moe::DeltaRule::kAuto), plain) < 2e-2);
  SECTION("an inference-only layer: packs adopted, fp32 projections freed") {
    auto params = layer.parameters();  // drops the packs
    Index const D2 = layer.d_model();
    std::vector<moe::Linear> in;
    for (std::size_t i = 0; i < 4; ++i) {
      Index const rows = static_cast<Index>(params[i].values.size()) / D2;
      in.emplace_back(ConstMatrixView<float>(params[i].values.data(), rows, D2),
                      moe::experts::WeightFormat::kF32);
    }
    moe::Linear out(ConstMatrixView<float>(params.back().values.data(), D2, layer.value_dim()),
                    moe::experts::WeightFormat::kF32);
    std::vector<moe::Linear> two(in.begin(), in.begin() + 2);
    REQUIRE_THROWS_WITH(layer.adopt_packed_weights(two, out), Catch::Contains("this layout has 4"));
    layer.adopt_packed_weights(in, std::move(out));
    REQUIRE(layer.master_weights_discarded());
    CHECK(rel_err(run(layer, x, T, moe::DeltaRule::kAuto), plain) < 1e-6);
    moe::GatedDeltaNetWorkspace ws;
    std::vector<float> y(x.size());
    REQUIRE_THROWS_WITH(layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws),
                        Catch::Contains("inference-only"));
    REQUIRE_THROWS_WITH(layer.parameters(), Catch::Contains("inference-only"));
  }
}

TEST_CASE("GatedDeltaNet: the state has a fixed size", "[attention][deltanet][cache]") {
  auto c = config(moe::DeltaNetLayout::kQwen3Next);
  moe::GatedDeltaNet layer(c);
  Index const C = 2 * 2 * 8 + 4 * 8;
  REQUIRE(layer.state_bytes() == static_cast<std::size_t>((3 * C + 4 * 8 * 8) * 4));
}

TEST_CASE("GatedDeltaNet reports bad configurations and bad input clearly",
          "[attention][deltanet]") {
  auto c = config(moe::DeltaNetLayout::kQwen3Next);
  c.num_value_heads = 3;
  REQUIRE_THROWS_WITH(moe::GatedDeltaNet(c),
                      Catch::Contains("num_key_heads = 2 does not divide num_value_heads = 3"));
  c = config(moe::DeltaNetLayout::kQwen3Next);
  c.conv_kernel = 0;
  REQUIRE_THROWS_WITH(moe::GatedDeltaNet(c), Catch::Contains("must be >= 1"));
  c = config(moe::DeltaNetLayout::kQwen3Next);
  c.norm_eps = 0.0f;
  REQUIRE_THROWS_WITH(moe::GatedDeltaNet(c), Catch::Contains("norm_eps"));
  moe::GatedDeltaNet layer(config(moe::DeltaNetLayout::kQwen3Next));
  moe::GatedDeltaNetWorkspace ws;
  std::vector<float> x(4 * 32), y(4 * 32);
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 4, 31}, {y.data(), 4, 32}, ws),
                      Catch::Contains("d_model = 32"));
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 4, 32}, {y.data(), 3, 32}, ws),
                      Catch::Contains("like x"));
  moe::DeltaNetState wrong;
  REQUIRE_THROWS_WITH(layer.forward({x.data(), 4, 32}, {y.data(), 4, 32}, wrong, ws),
                      Catch::Contains("make_state()"));
  auto state = layer.make_state();
  moe::DeltaNetState* ptr = &state;
  Index const three = 3;
  REQUIRE_THROWS_WITH(
      layer.forward_cached({x.data(), 4, 32}, {y.data(), 4, 32}, {&ptr, 1}, {&three, 1}, ws),
      Catch::Contains("sum to 3"));
  std::vector<float> dx(x.size());
  auto grads = layer.make_gradients();
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 4, 32}, {dx.data(), 4, 32}, grads),
                      Catch::Contains("forward_train first"));
  moe::GatedDeltaNet other(config(moe::DeltaNetLayout::kQwen35));
  layer.forward_train({x.data(), 4, 32}, {y.data(), 4, 32}, ws);
  auto wrong_grads = other.make_gradients();
  REQUIRE_THROWS_WITH(layer.backward(ws, {y.data(), 4, 32}, {dx.data(), 4, 32}, wrong_grads),
                      Catch::Contains("make_gradients()"));
}
