// SPDX-License-Identifier: Apache-2.0
// moe::Linear, the dense matrix of any weight format on the experts' engine: every format
// against a double reference (fp32: the exact product; bf16: bitwise the fp32 product of the
// rounded weights; GGUF blocks: ggml's dequantized weights times the dequantized int8
// activations), the same bits for any number of rows or threads, bias and accumulate epilogues,
// the GLU pair, the fallback chain and the errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moe/core/float16.hpp"
#include "moe/core/memory.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/layers/linear.hpp"
#include "moe/quant/matrix.hpp"
#include "support/helpers.hpp"

using moe::Index;
using moe::Linear;
using moe::experts::WeightFormat;
namespace kernels = moe::kernels;
namespace quant = moe::quant;

namespace {

constexpr WeightFormat kAll[] = {WeightFormat::kF32,    WeightFormat::kBf16,   WeightFormat::kQ8_0,
                                 WeightFormat::kQ6_K,   WeightFormat::kQ5_K,   WeightFormat::kQ5_1,
                                 WeightFormat::kQ5_0,   WeightFormat::kIQ4_XS, WeightFormat::kQ4_1,
                                 WeightFormat::kIQ4_NL, WeightFormat::kQ4_K,   WeightFormat::kQ4_0,
                                 WeightFormat::kMXFP4,  WeightFormat::kQ3_K,   WeightFormat::kQ2_K};

/// y [T, N] = x W^T (+ bias) (accumulate: y +=) through the engine's queue.
void run(Linear const& w, std::vector<float> const& x, Index T, std::vector<float>& y,
         moe::ThreadPool* pool, bool accumulate = false) {
  moe::stages::ProjectionQueue q;
  moe::LinearInput in;
  moe::ConstMatrixView<float> xv(x.data(), T, w.depth());
  q.add(moe::linear_job(w, in.prepare(xv, moe::experts::is_quantized(w.format()), pool), T,
                        y.data(), w.rows(), accumulate));
  q.run<moe::experts::SwiGlu, moe::experts::SwiGlu>(pool);
}

/// The weights the pack holds, and the activations its product reads, as doubles.
std::vector<double> effective_weights(std::vector<float> const& w, Index N, Index K,
                                      WeightFormat f) {
  std::vector<double> out(w.size());
  if (f == WeightFormat::kF32) {
    for (std::size_t i = 0; i < w.size(); ++i) out[i] = w[i];
  } else if (f == WeightFormat::kBf16) {
    for (std::size_t i = 0; i < w.size(); ++i) {
      out[i] = kernels::bf16_to_float(kernels::float_to_bf16(w[i]));
    }
  } else {
    quant::QuantMatrix const q =
        quant::QuantMatrix::quantize({w.data(), N, K}, moe::experts::quant_format(f));
    std::vector<float> deq(w.size());
    q.dequantize({deq.data(), N, K});
    for (std::size_t i = 0; i < w.size(); ++i) out[i] = deq[i];
  }
  return out;
}
std::vector<double> effective_inputs(std::vector<float> const& x, Index T, Index K,
                                     WeightFormat f) {
  std::vector<double> out(x.begin(), x.end());
  if (!moe::experts::is_quantized(f)) return out;
  Index const rb = kernels::q8_row_bytes(K);
  moe::HugePageVector<std::byte> q8(static_cast<std::size_t>(T * rb));
  kernels::quantize_rows_q8({x.data(), K}, T, K, q8.data(), rb);
  for (Index t = 0; t < T; ++t) {
    auto const r = kernels::q8_row(q8.data() + t * rb, K);
    for (Index k = 0; k < K; ++k) out[t * K + k] = static_cast<double>(r.a[k]) * r.d[k / 32];
  }
  return out;
}

}  // namespace

TEST_CASE("Linear: every format against its double reference, any rows, any threads",
          "[linear][quant][bf16]") {
  Index const N = 70, K = 256;  // 70: a partial panel at either width
  std::vector<float> const w = test::random_vector(N * K, 1, -0.5f, 0.5f);
  std::vector<float> const bias = test::random_vector(N, 2);
  moe::ThreadPool pool(2);
  for (WeightFormat f : kAll) {
    INFO(moe::experts::name(f));
    Linear const lin({w.data(), N, K}, f, bias, &pool);
    REQUIRE(lin.format() == f);
    REQUIRE_FALSE(lin.fell_back());
    REQUIRE(lin.bytes() > 0);
    std::vector<double> const we = effective_weights(w, N, K, f);
    Index const Tmax = 40;
    std::vector<float> const x = test::random_vector(Tmax * K, 3);
    std::vector<float> full(static_cast<std::size_t>(Tmax * N));
    run(lin, x, Tmax, full, &pool);
    std::vector<double> const xe = effective_inputs(x, Tmax, K, f);
    double worst = 0.0;
    for (Index t = 0; t < Tmax; ++t) {
      for (Index n = 0; n < N; ++n) {
        double ref = bias[static_cast<std::size_t>(n)], mag = std::abs(ref);
        for (Index k = 0; k < K; ++k) {
          ref += xe[t * K + k] * we[n * K + k];
          mag += std::abs(xe[t * K + k] * we[n * K + k]);
        }
        worst = std::max(worst, std::abs(full[t * N + n] - ref) / mag);
      }
    }
    // fp32 accumulation of exact products; the blocks: exact integer sums, folded in fp32.
    CHECK(worst < (moe::experts::is_quantized(f) ? 2e-5 : 2e-6));
    // Any number of rows, one thread or two: the same bits, row by row.
    for (Index T : {1, 3, 9}) {
      std::vector<float> y(static_cast<std::size_t>(T * N));
      run(lin, x, T, y, T == 3 ? nullptr : &pool);
      REQUIRE(std::memcmp(y.data(), full.data(), y.size() * sizeof(float)) == 0);
    }
    // accumulate: y += x W^T + b.
    std::vector<float> acc(static_cast<std::size_t>(Tmax * N), 0.25f);
    run(lin, x, Tmax, acc, &pool, true);
    for (std::size_t i = 0; i < acc.size(); ++i) REQUIRE(acc[i] == full[i] + 0.25f);
  }
}

TEST_CASE("Linear: bf16 is bitwise the fp32 product of the rounded weights", "[linear][bf16]") {
  Index const N = 45, K = 99, T = 11;  // odd depth: the bf16 pair pad
  std::vector<float> w = test::random_vector(N * K, 4);
  std::vector<float> const x = test::random_vector(T * K, 5);
  std::vector<float> rounded(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    rounded[i] = kernels::bf16_to_float(kernels::float_to_bf16(w[i]));
  }
  Linear const b16({w.data(), N, K}, WeightFormat::kBf16);
  Linear const f32({rounded.data(), N, K}, WeightFormat::kF32);
  REQUIRE(b16.bytes() * 2 == f32.bytes() + f32.bytes() / K);  // K + 1 values a row: the pair pad
  std::vector<float> y16(static_cast<std::size_t>(T * N)), y32(y16.size());
  moe::ThreadPool pool(2);
  run(b16, x, T, y16, &pool);
  run(f32, x, T, y32, nullptr);
  REQUIRE(std::memcmp(y16.data(), y32.data(), y16.size() * sizeof(float)) == 0);
}

TEST_CASE("Linear: two matrices as the gate and up operands of one GLU job", "[linear][quant]") {
  Index const I = 40, K = 64, T = 5;
  std::vector<float> const g = test::random_vector(I * K, 6), u = test::random_vector(I * K, 7);
  std::vector<float> const x = test::random_vector(T * K, 8);
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kQ8_0}) {
    INFO(moe::experts::name(f));
    Linear const gate({g.data(), I, K}, f), up({u.data(), I, K}, f);
    std::vector<float> yg(static_cast<std::size_t>(T * I)), yu(yg.size()), m(yg.size());
    run(gate, x, T, yg, nullptr);
    run(up, x, T, yu, nullptr);
    moe::detail::ExpertJob job;
    job.kind = moe::detail::ExpertJob::Kind::kRoutedHidden;
    moe::LinearInput in;
    job.a = in.prepare({x.data(), T, K}, moe::experts::is_quantized(f), nullptr);
    job.rows = T;
    job.depth = K;
    job.w = Linear::glu_panels(gate, up);
    job.c = m.data();
    job.ldc = I;
    job.cols = I;
    moe::stages::ProjectionQueue q;
    q.add(job);
    q.run<moe::experts::SwiGlu, moe::experts::SwiGlu>(nullptr);
    for (std::size_t i = 0; i < m.size(); ++i) {
      float const s = yg[i] / (1.0f + std::exp(-yg[i]));
      REQUIRE(m[i] == Approx(s * yu[i]).epsilon(1e-5).margin(1e-6));
    }
  }
  Linear const a({g.data(), I, K}, WeightFormat::kQ8_0), b({u.data(), I, K}, WeightFormat::kBf16);
  REQUIRE_THROWS_WITH(Linear::glu_panels(a, b),
                      Catch::Contains("must have one shape and one format"));
}

TEST_CASE("Linear: a format whose blocks do not divide the depth falls back along its chain",
          "[linear][quant]") {
  using moe::experts::resolve_format;
  // The chain itself.
  CHECK(resolve_format(WeightFormat::kQ4_K, 256) == WeightFormat::kQ4_K);
  CHECK(resolve_format(WeightFormat::kQ4_K, 2880) == WeightFormat::kQ4_0);  // gpt-oss d_ffn
  CHECK(resolve_format(WeightFormat::kQ2_K, 128) == WeightFormat::kQ4_0);
  CHECK(resolve_format(WeightFormat::kQ3_K, 96) == WeightFormat::kQ4_0);
  CHECK(resolve_format(WeightFormat::kQ6_K, 2880) == WeightFormat::kQ8_0);
  CHECK(resolve_format(WeightFormat::kQ5_K, 2880) == WeightFormat::kQ5_1);  // not q4_0: smaller
  CHECK(resolve_format(WeightFormat::kQ5_K, 200) == WeightFormat::kBf16);
  CHECK(resolve_format(WeightFormat::kQ4_1, 48) == WeightFormat::kBf16);
  CHECK(resolve_format(WeightFormat::kQ5_K, 512) == WeightFormat::kQ5_K);
  CHECK(resolve_format(WeightFormat::kQ4_K, 200) == WeightFormat::kBf16);  // not even 32-blocks
  CHECK(resolve_format(WeightFormat::kQ8_0, 48) == WeightFormat::kBf16);
  CHECK(resolve_format(WeightFormat::kBf16, 7) == WeightFormat::kBf16);
  CHECK(resolve_format(WeightFormat::kF32, 7) == WeightFormat::kF32);
  // Suggestions name only formats that hold the depth.
  CHECK(moe::experts::formats_holding(WeightFormat::kQ4_K, 200) == "bf16, fp32");
  CHECK(moe::experts::formats_holding(WeightFormat::kQ4_K, 96) == "q4_0, q8_0, bf16, fp32");
  CHECK(moe::experts::formats_holding(WeightFormat::kQ6_K, 256) == "q6_k, q8_0, bf16, fp32");
  CHECK(moe::experts::formats_holding(WeightFormat::kQ5_K, 96) == "q5_1, q8_0, bf16, fp32");
  // A Linear says what it got, and multiplies in it.
  Index const N = 33, K = 96, T = 2;
  std::vector<float> const w = test::random_vector(N * K, 9);
  std::vector<float> const x = test::random_vector(T * K, 10);
  Linear const fell({w.data(), N, K}, WeightFormat::kQ4_K);
  REQUIRE(fell.fell_back());
  REQUIRE(fell.requested_format() == WeightFormat::kQ4_K);
  REQUIRE(fell.format() == WeightFormat::kQ4_0);
  Linear const direct({w.data(), N, K}, WeightFormat::kQ4_0);
  std::vector<float> y1(static_cast<std::size_t>(T * N)), y2(y1.size());
  run(fell, x, T, y1, nullptr);
  run(direct, x, T, y2, nullptr);
  REQUIRE(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
  Linear const odd({w.data(), N, 40}, WeightFormat::kQ8_0);  // 40: no 32-block format holds it
  REQUIRE(odd.format() == WeightFormat::kBf16);
}

TEST_CASE("Linear::from_blocks: stored GGUF blocks run as stored, never re-quantized",
          "[linear][quant]") {
  Index const N = 70, K = 512, T = 5;
  std::vector<float> const w = test::random_vector(N * K, 21, -0.5f, 0.5f);
  std::vector<float> const x = test::random_vector(T * K, 22);
  moe::ThreadPool pool(2);
  for (WeightFormat f : kAll) {
    if (!moe::experts::is_quantized(f)) continue;
    INFO(moe::experts::name(f));
    quant::Format const qf = moe::experts::quant_format(f);
    quant::QuantMatrix const q = quant::QuantMatrix::quantize({w.data(), N, K}, qf);
    // The blocks of quantize_row are what the Linear constructor packs: the same bits.
    Linear const stored = Linear::from_blocks(f, q.row(0), N, K, {}, &pool);
    Linear const made({w.data(), N, K}, f);
    REQUIRE(stored.format() == f);
    REQUIRE(stored.bytes() == made.bytes());
    std::vector<float> ys(static_cast<std::size_t>(T * N)), ym(ys.size());
    run(stored, x, T, ys, &pool);
    run(made, x, T, ym, nullptr);
    REQUIRE(std::memcmp(ys.data(), ym.data(), ys.size() * sizeof(float)) == 0);
    // Blocks edited by hand (every fp16 block scale d times 0.75) multiply as the values
    // ggml's dequantizer gives them: the reference is the dequantized matrix.
    quant::QuantMatrix odd = q;
    for (Index r = 0; r < N; ++r) {
      for (Index b = 0; b < K / quant::block_elems(qf); ++b) {
        std::byte* blk = odd.row(r) + b * quant::block_bytes(qf);
        std::uint16_t d;
        std::size_t const at = qf == quant::Format::kQ6_K   ? 208
                               : qf == quant::Format::kQ3_K ? 108
                               : qf == quant::Format::kQ2_K ? 80
                                                            : 0;  // Q8_0, Q5_*, Q4_K, Q4_0
        std::memcpy(&d, blk + at, 2);
        d = moe::float_to_f16(0.75f * moe::f16_to_float(d));
        std::memcpy(blk + at, &d, 2);
      }
    }
    std::vector<float> deq(static_cast<std::size_t>(N * K));
    odd.dequantize({deq.data(), N, K});
    Linear const from_odd = Linear::from_blocks(f, odd.row(0), N, K);
    std::vector<float> y(static_cast<std::size_t>(T * N));
    run(from_odd, x, T, y, &pool);
    std::vector<double> const xe = effective_inputs(x, T, K, f);
    for (Index t = 0; t < T; ++t) {
      for (Index n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (Index k = 0; k < K; ++k) {
          ref += xe[t * K + k] * deq[n * K + k];
          mag += std::abs(xe[t * K + k] * deq[n * K + k]);
        }
        REQUIRE(std::abs(y[t * N + n] - ref) <= 2e-5 * mag);
      }
    }
  }
  std::vector<std::byte> const blocks(static_cast<std::size_t>(4 * 34));
  REQUIRE_THROWS_WITH(Linear::from_blocks(WeightFormat::kBf16, blocks.data(), 4, 32),
                      Catch::Contains("bf16 is not a block format"));
  REQUIRE_THROWS_WITH(Linear::from_blocks(WeightFormat::kQ8_0, blocks.data(), 1, 48),
                      Catch::Contains("rows of 48 weights are not whole q8_0 blocks of 32"));
}

TEST_CASE("Linear: errors", "[linear]") {
  std::vector<float> w = test::random_vector(4 * 32, 11);
  std::vector<float> const b(3, 0.0f);
  REQUIRE_THROWS_WITH(Linear({w.data(), 4, 32}, WeightFormat::kF32, b),
                      Catch::Contains("the bias has 3 values but W has 4 rows"));
  REQUIRE_THROWS_WITH(Linear({w.data(), 0, 32}, WeightFormat::kF32),
                      Catch::Contains("needs at least one row and one column"));
  w[37] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(Linear({w.data(), 4, 32}, WeightFormat::kQ8_0),
                      Catch::Contains("W[1, 5] = inf cannot be quantized to q8_0"));
  REQUIRE_NOTHROW(Linear({w.data(), 4, 32}, WeightFormat::kF32));  // fp32 keeps it as it is
}

TEST_CASE("LinearQueue: products queued together give the bits of each alone", "[linear][quant]") {
  Index const K = 64, T = 6;
  std::vector<float> const w1 = test::random_vector(48 * K, 20),
                           w2 = test::random_vector(40 * K, 21);
  std::vector<float> const x = test::random_vector(T * K, 22), x2 = test::random_vector(T * K, 23);
  Linear const a({w1.data(), 48, K}, WeightFormat::kQ8_0),
      b({w2.data(), 40, K}, WeightFormat::kQ4_0);
  Linear const c({w2.data(), 40, K}, WeightFormat::kBf16);
  Linear const g({w2.data(), 40, K}, WeightFormat::kQ8_0),
      u({w1.data(), 40, K}, WeightFormat::kQ8_0);
  std::vector<float> ya(static_cast<std::size_t>(T * 48)), yb(static_cast<std::size_t>(T * 40)),
      yc(yb.size(), 1.0f), m(yb.size());
  moe::ThreadPool pool(2);
  moe::LinearQueue q;
  q.add(a, {x.data(), T, K}, {ya.data(), T, 48});
  q.add(b, {x.data(), T, K}, {yb.data(), T, 40});  // x quantized once for both
  q.add(c, {x2.data(), T, K}, {yc.data(), T, 40}, true);
  q.add_swiglu(g, u, {x2.data(), T, K}, {m.data(), T, 40});
  q.run(&pool);
  std::vector<float> ra(ya.size()), rb(yb.size()), rc(yc.size(), 1.0f), rg(m.size()), ru(m.size());
  run(a, x, T, ra, nullptr);
  run(b, x, T, rb, nullptr);
  run(c, x2, T, rc, nullptr, true);
  run(g, x2, T, rg, nullptr);
  run(u, x2, T, ru, nullptr);
  REQUIRE(ya == ra);
  REQUIRE(yb == rb);
  REQUIRE(yc == rc);
  for (std::size_t i = 0; i < m.size(); ++i) {
    REQUIRE(m[i] == Approx(rg[i] / (1.0f + std::exp(-rg[i])) * ru[i]).epsilon(1e-5).margin(1e-6));
  }
  // Reused: the same bits again.
  std::vector<float> again(ya.size());
  q.add(a, {x.data(), T, K}, {again.data(), T, 48});
  q.run(nullptr);
  REQUIRE(again == ya);
  REQUIRE_THROWS_WITH(q.add(a, {x.data(), T, K}, {ya.data(), T, 40}),
                      Catch::Contains("they must be [T, 64] and [T, 48]"));
}
