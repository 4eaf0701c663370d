// SPDX-License-Identifier: Apache-2.0
// MoeFfn with quantized experts (ExpertBank::pack with GGUF formats, one per expert or one for
// all): against the fp32 layer (quality), against an fp32 layer holding ggml's dequantized
// weights (the kernels use exactly those weights), mixed precision in one forward, determinism,
// training ignoring the pack, and the errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <vector>

#include "moe/layers/moe_ffn.hpp"
#include "moe/quant/matrix.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "support/helpers.hpp"

using moe::Index;
namespace routing = moe::routing;
namespace experts = moe::experts;
namespace quant = moe::quant;
using experts::WeightFormat;

namespace {

using Shared = experts::GatedSharedExperts<experts::SwiGlu>;
using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, Shared>;
constexpr Index D = 256, F = 256, E = 8, T = 48;

Layer make_layer(std::uint64_t seed) {
  Layer layer(D, F, {E, 2, true, 1.0f}, Shared(1, D, 256));
  moe::fill_uniform(layer.experts().edit().parameters(), -0.1f, 0.1f, seed);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, seed + 1);
  moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.1f, 0.1f, seed + 2);
  auto g = layer.shared_experts().gate_weight();
  moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f,
                    0.5f, seed + 3);
  return layer;
}

template <class L>
std::vector<float> run(L const& layer, std::vector<float> const& x,
                       moe::ThreadPool* pool = nullptr) {
  Index const n = static_cast<Index>(x.size()) / D;
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward({x.data(), n, D}, {y.data(), n, D}, ws, {nullptr, pool});
  return y;
}

double rel_rms(std::vector<float> const& a, std::vector<float> const& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

/// Replaces the rows of m by what format f stores for them (fp32: unchanged; bf16: rounded).
void round_trip(moe::MatrixView<float> m, WeightFormat f) {
  if (f == WeightFormat::kF32) return;
  if (f == WeightFormat::kBf16) {
    for (Index r = 0; r < m.rows; ++r) {
      for (Index c = 0; c < m.cols; ++c) {
        m(r, c) = moe::kernels::bf16_to_float(moe::kernels::float_to_bf16(m(r, c)));
      }
    }
    return;
  }
  auto const q = quant::QuantMatrix::quantize(m, experts::quant_format(f));
  q.dequantize(m);
}

/// The layer with every expert's weights replaced by what `formats` store for them.
template <class Bank>
void dequantize_bank(Bank& bank, std::vector<experts::ExpertFormat> const& formats) {
  auto ed = bank.edit();
  for (Index e = 0; e < bank.num_experts(); ++e) {
    round_trip(ed.in_proj(e), formats[static_cast<std::size_t>(e)].in);
    round_trip(ed.down_proj(e), formats[static_cast<std::size_t>(e)].down);
  }
}

}  // namespace

TEST_CASE("Quantized experts: every format's layer is within its error of the fp32 layer",
          "[layers][quant]") {
  Layer layer = make_layer(101);
  auto const x = test::random_vector(T * D, 102);
  auto const y32 = run(layer, x);
  // Relative RMS error of the layer output (measured with these seeds: q8_0 0.0122, q6_k 0.0255,
  // q5_k 0.0495, q4_k 0.097, q4_0 0.113, q3_k 0.219, q2_k 0.412, q5_1 0.0520, q5_0 0.0551,
  // q4_1 0.108, iq4_nl 0.120, iq4_xs 0.111, mxfp4 0.178; uniform weights, whose 4-bit rounding
  // is ~6% a weight, and on which IQ4_NL's non-uniform levels and MXFP4's power-of-two scales
  // lose to Q4_0's uniform ones; int8 activations in 32-blocks add ~0.01): bounds ~1.35x.
  WeightFormat const formats[] = {WeightFormat::kQ8_0, WeightFormat::kQ6_K,   WeightFormat::kQ5_K,
                                  WeightFormat::kQ4_K, WeightFormat::kQ4_0,   WeightFormat::kQ3_K,
                                  WeightFormat::kQ2_K, WeightFormat::kQ5_1,   WeightFormat::kQ5_0,
                                  WeightFormat::kQ4_1, WeightFormat::kIQ4_NL, WeightFormat::kIQ4_XS,
                                  WeightFormat::kMXFP4};
  double const bound[] = {0.017, 0.035, 0.067, 0.13, 0.15, 0.3, 0.55,
                          0.07,  0.075, 0.145, 0.16, 0.15, 0.24};
  double err[13];
  for (int i = 0; i < 13; ++i) {
    layer.pack_weights(formats[i]);
    REQUIRE(layer.experts().packed_quant_any());
    err[i] = rel_rms(run(layer, x), y32);
    INFO(experts::name(formats[i]) << ": " << err[i]);

    CHECK(err[i] < bound[i]);
    CHECK(err[i] > 1e-4);  // it did run quantized
  }
  CHECK(err[0] <= 2e-2);
  CHECK(err[3] < err[4]);  // q4_k below q4_0
  CHECK(err[1] < err[2]);  // q6_k below q5_k below q4_k
  CHECK(err[2] < err[3]);
  CHECK(err[0] < err[3]);
  CHECK(err[7] < err[8]);  // q5_1 (a min) below q5_0 (an offset) below q4_1 below q4_0
  CHECK(err[8] < err[9]);
  CHECK(err[9] < err[4]);
  CHECK(err[11] < err[10]);  // iq4_xs (a scale per 32, 6 bits) below iq4_nl (an fp16 one)
  CHECK(err[12] > err[4]);   // mxfp4: power-of-two scales
}

TEST_CASE("Quantized experts use exactly ggml's dequantized weights", "[layers][quant]") {
  // Against an fp32 layer whose weights are the dequantized blocks, only the int8 activations
  // differ (measured: 0.0098 for every format, the per-32-block rounding of x and of the
  // heavier-tailed activations m); a weight read wrongly would be off by O(1).
  auto const x = test::random_vector(T * D, 112);
  for (WeightFormat f :
       {WeightFormat::kQ8_0, WeightFormat::kQ6_K, WeightFormat::kQ5_K, WeightFormat::kQ4_K,
        WeightFormat::kQ4_0, WeightFormat::kQ3_K, WeightFormat::kQ2_K, WeightFormat::kQ5_1,
        WeightFormat::kQ5_0, WeightFormat::kQ4_1, WeightFormat::kIQ4_NL, WeightFormat::kIQ4_XS,
        WeightFormat::kMXFP4}) {
    INFO(experts::name(f));
    Layer layer = make_layer(111);
    Layer deq = layer;
    std::vector<experts::ExpertFormat> const all(E, {f, f});
    dequantize_bank(deq.experts(), all);
    dequantize_bank(deq.shared_experts().bank(), {{f, f}});
    layer.pack_weights(f);
    double const e = rel_rms(run(layer, x), run(deq, x));
    INFO("relative RMS difference " << e);
    CHECK(e < 1.3e-2);
  }
}

TEST_CASE("Mixed precision: experts of seven formats run in one forward", "[layers][quant]") {
  Layer layer = make_layer(121);
  std::vector<experts::ExpertFormat> const formats = {
      {WeightFormat::kQ8_0, WeightFormat::kQ4_K}, {WeightFormat::kQ4_0, WeightFormat::kQ6_K},
      {WeightFormat::kBf16, WeightFormat::kQ8_0}, {WeightFormat::kF32, WeightFormat::kF32},
      {WeightFormat::kQ4_K, WeightFormat::kBf16}, {WeightFormat::kQ6_K, WeightFormat::kQ4_0},
      {WeightFormat::kQ5_K, WeightFormat::kQ4_K}, {WeightFormat::kF32, WeightFormat::kQ5_K}};
  Layer deq = layer;
  dequantize_bank(deq.experts(), formats);
  layer.experts().pack(formats);
  layer.shared_experts().bank().pack();  // packed: a token's output is then batch-invariant
  REQUIRE(layer.experts().packed_formats().size() == formats.size());
  CHECK(layer.experts().packed_formats()[1] == formats[1]);
  auto const x = test::random_vector(T * D, 122);
  auto const y = run(layer, x);
  CHECK(rel_rms(y, run(deq, x)) < 1.3e-2);
  // Bitwise the same for 1 and 2 threads, and a token's output does not depend on its batch.
  moe::ThreadPool pool(2);
  auto const y2 = run(layer, x, &pool);
  REQUIRE(std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)) == 0);
  std::vector<float> first(x.begin(), x.begin() + 5 * D);
  auto const y5 = run(layer, first);
  REQUIRE(std::memcmp(y.data(), y5.data(), y5.size() * sizeof(float)) == 0);
  // Packed in parallel: the same bytes, so the same outputs.
  Layer par = layer;
  par.experts().pack(formats, &pool);
  auto const yp = run(par, x);
  REQUIRE(std::memcmp(y.data(), yp.data(), y.size() * sizeof(float)) == 0);
  // An edit repacks in the same formats.
  { auto ed = layer.experts().edit(); }
  REQUIRE(layer.experts().packed());
  CHECK(layer.experts().packed_formats()[5] == formats[5]);
  auto const y3 = run(layer, x);
  REQUIRE(std::memcmp(y.data(), y3.data(), y.size() * sizeof(float)) == 0);
}

TEST_CASE("Training forwards ignore a quantized pack and use the fp32 weights", "[layers][quant]") {
  Layer layer = make_layer(131);
  auto const x = test::random_vector(T * D, 132);
  std::vector<float> y1(x.size()), y2(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward_train({x.data(), T, D}, {y1.data(), T, D}, ws);
  layer.pack_weights(WeightFormat::kQ4_0);
  layer.forward_train({x.data(), T, D}, {y2.data(), T, D}, ws);
  REQUIRE(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
}

TEST_CASE("Quantized packs of shapes their blocks do not divide are errors", "[layers][quant]") {
  moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(96, 64, {4, 2, true, 1.0f});
  CHECK_THROWS_WITH(layer.pack_weights(WeightFormat::kQ4_K),
                    Catch::Contains("depth d_model = 96") && Catch::Contains("q4_k") &&
                        Catch::Contains("pack it as one of q4_0, q8_0, bf16, fp32"));
  layer.pack_weights(WeightFormat::kQ8_0);  // 32-blocks divide 96 and 64
  CHECK(layer.experts().packed_quant_any());
  std::vector<experts::ExpertFormat> const three(3);
  CHECK_THROWS_WITH(layer.experts().pack(three), Catch::Contains("3 formats for 4 experts"));
  CHECK(experts::parse_weight_format("Q4_K") == WeightFormat::kQ4_K);
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kQ8_0,
                         WeightFormat::kQ6_K, WeightFormat::kQ5_K, WeightFormat::kQ4_K,
                         WeightFormat::kQ4_0, WeightFormat::kQ3_K, WeightFormat::kQ2_K}) {
    INFO(experts::name(f));
    CHECK(experts::parse_weight_format(experts::name(f)) == f);  // every format's name parses
  }
  CHECK_THROWS_WITH(experts::parse_weight_format("int4"), Catch::Contains("fp32, bf16, q8_0"));
}

TEST_CASE("Quantized gpt-oss-style experts: biases and the clamped GLU in the integer kernels",
          "[layers][quant][gpt_oss]") {
  // The epilogues add the biases and apply the clamp on every kernel path: against an fp32
  // layer holding the dequantized weights only the int8 activations differ (as above); biases
  // of +-0.3 (as large as the outputs) or a missing clamp would be off by O(1).
  using GptOss = moe::MoeFfn<routing::TopKSoftmax, experts::ClampedSwiGlu>;
  auto const x = test::random_vector(T * D, 132);
  for (WeightFormat f : {WeightFormat::kQ8_0, WeightFormat::kQ4_0, WeightFormat::kBf16}) {
    INFO(experts::name(f));
    GptOss layer(D, F, {E, 2});
    layer.enable_router_bias();
    layer.experts().enable_biases();
    layer.experts().set_glu_clamp({1.702f, 0.2f});
    moe::fill_uniform(layer.experts().edit().parameters(), -0.1f, 0.1f, 133);
    {
      auto ed = layer.experts().edit();
      for (Index e = 0; e < E; ++e) {
        moe::fill_uniform(ed.in_bias(e), -0.3f, 0.3f, 134 + static_cast<std::uint64_t>(e));
        moe::fill_uniform(ed.down_bias(e), -0.3f, 0.3f, 150 + static_cast<std::uint64_t>(e));
      }
    }
    auto wr = layer.router_weight();
    moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                      0.5f, 135);
    moe::fill_uniform(layer.router_bias(), -0.5f, 0.5f, 136);
    GptOss deq = layer;
    dequantize_bank(deq.experts(), std::vector<experts::ExpertFormat>(E, {f, f}));
    layer.pack_weights(f);
    std::vector<float> const want = run(deq, x);
    double const e = rel_rms(run(layer, x), want);
    INFO("relative RMS difference " << e);
    CHECK(e < 1.3e-2);
    // Without the expert biases the output is far off: the comparison sees them.
    GptOss unbiased = deq;
    {
      auto ed = unbiased.experts().edit();
      for (Index j = 0; j < E; ++j) {
        std::fill(ed.in_bias(j).begin(), ed.in_bias(j).end(), 0.0f);
        std::fill(ed.down_bias(j).begin(), ed.down_bias(j).end(), 0.0f);
      }
    }
    CHECK(rel_rms(run(unbiased, x), want) > 0.3);
  }
}
