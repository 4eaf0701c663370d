// SPDX-License-Identifier: Apache-2.0
// GGUF blocks (moe/quant/blocks.hpp): byte layouts and reference quantizers on hand-computed
// blocks, decoders on hand-built blocks, the error each format makes, the error policy.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <iterator>
#include <vector>

#include "moe/quant/matrix.hpp"
#include "support/helpers.hpp"

using moe::Index;
namespace quant = moe::quant;
using quant::Format;

namespace {

std::vector<float> dequant(Format f, std::vector<std::byte> const& bytes, Index k) {
  std::vector<float> y(static_cast<std::size_t>(k));
  quant::dequantize_row(f, bytes.data(), k, y.data());
  return y;
}

std::vector<std::byte> quantize(Format f, std::vector<float> const& x) {
  std::vector<std::byte> out(
      static_cast<std::size_t>(quant::row_bytes(f, static_cast<Index>(x.size()))));
  quant::quantize_row(f, x.data(), static_cast<Index>(x.size()), out.data());
  return out;
}

/// Sum of k Gaussian-like values (12 uniforms), seeded.
std::vector<float> gaussian(Index n, std::uint64_t seed) {
  std::vector<float> u = test::random_vector(12 * n, seed, 0.0f, 1.0f),
                     x(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    float s = -6.0f;
    for (Index j = 0; j < 12; ++j) s += u[static_cast<std::size_t>(12 * i + j)];
    x[static_cast<std::size_t>(i)] = s;
  }
  return x;
}

}  // namespace

TEST_CASE("quant: block sizes and names are ggml's", "[quant]") {
  CHECK(quant::block_bytes(Format::kQ8_0) == 34);
  CHECK(quant::block_bytes(Format::kQ4_0) == 18);
  CHECK(quant::block_bytes(Format::kQ4_K) == 144);
  CHECK(quant::block_bytes(Format::kQ6_K) == 210);
  CHECK(quant::bits_per_weight(Format::kQ4_K) == 4.5);
  CHECK(quant::bits_per_weight(Format::kQ6_K) == 6.5625);
  CHECK(quant::block_bytes(Format::kQ5_K) == 176);
  CHECK(quant::bits_per_weight(Format::kQ5_K) == 5.5);
  CHECK(quant::parse_format("Q4_K") == Format::kQ4_K);
  CHECK(quant::parse_format("q8_0") == Format::kQ8_0);
  CHECK(quant::parse_format("Q5_K") == Format::kQ5_K);
  CHECK(quant::block_bytes(Format::kQ5_0) == 22);
  CHECK(quant::bits_per_weight(Format::kQ5_0) == 5.5);
  CHECK(quant::parse_format("Q5_0") == Format::kQ5_0);
  CHECK(quant::block_bytes(Format::kQ4_1) == 20);
  CHECK(quant::bits_per_weight(Format::kQ4_1) == 5.0);
  CHECK(quant::block_bytes(Format::kQ5_1) == 24);
  CHECK(quant::bits_per_weight(Format::kQ5_1) == 6.0);
  CHECK(quant::parse_format("Q4_1") == Format::kQ4_1);
  CHECK(quant::parse_format("q5_1") == Format::kQ5_1);
  CHECK(quant::block_bytes(Format::kIQ4_NL) == 18);
  CHECK(quant::bits_per_weight(Format::kIQ4_NL) == 4.5);
  CHECK(quant::block_bytes(Format::kIQ4_XS) == 136);
  CHECK(quant::bits_per_weight(Format::kIQ4_XS) == 4.25);
  CHECK(quant::block_elems(Format::kIQ4_XS) == 256);
  CHECK(quant::parse_format("IQ4_NL") == Format::kIQ4_NL);
  CHECK(quant::parse_format("iq4_xs") == Format::kIQ4_XS);
  CHECK(quant::block_bytes(Format::kMXFP4) == 17);
  CHECK(quant::bits_per_weight(Format::kMXFP4) == 4.25);
  CHECK(quant::block_elems(Format::kMXFP4) == 32);
  CHECK(quant::parse_format("MXFP4") == Format::kMXFP4);
  for (Format f : quant::kFormats) CHECK(quant::parse_format(quant::name(f)) == f);
  CHECK_THROWS_WITH(quant::parse_format("iq2_xxs"), Catch::Contains("use one of q8_0, q6_k, q5_k"));
}

TEST_CASE("quant: Q5_K's levels are the integers its decoder multiplies", "[quant]") {
  // q5k_level (what the kernels pack) against ggml's decoder: weight i = d sc q - dmin m with
  // q = q5k_level(i), the scale and min of sub-block i / 32, bit for bit.
  std::vector<float> const w = gaussian(4 * 256, 17);
  std::vector<quant::BlockQ5_K> blocks(4);
  quant::quantize_row(Format::kQ5_K, w.data(), 4 * 256, blocks.data());
  std::vector<float> y(w.size());
  quant::dequantize_row(Format::kQ5_K, blocks.data(), 4 * 256, y.data());
  int high = 0;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    float const d = quant::detail::fp32(blocks[b].d), dmin = quant::detail::fp32(blocks[b].dmin);
    for (int i = 0; i < 256; ++i) {
      std::uint8_t sc, m;
      quant::get_scale_min(i / 32, blocks[b].scales, &sc, &m);
      int const q = quant::q5k_level(blocks[b], i);
      REQUIRE(q >= 0);
      REQUIRE(q < 32);
      high += q >> 4;
      float const want =
          quant::detail::mul(quant::detail::mul(d, static_cast<float>(sc)), static_cast<float>(q)) -
          quant::detail::mul(dmin, static_cast<float>(m));
      INFO("block " << b << " weight " << i);
      REQUIRE(std::memcmp(&want, &y[b * 256 + static_cast<std::size_t>(i)], 4) == 0);
    }
  }
  CHECK(high > 256);  // the fifth bit is exercised
}

TEST_CASE("quant: Q8_0 of a hand-computed block", "[quant]") {
  // amax 127 -> d = 1 (fp16 0x3C00), levels round(x) with halves away from zero (ggml's roundf).
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 1.49f;
  x[4] = -0.5f;
  x[5] = -126.6f;
  auto const b = quantize(Format::kQ8_0, x);
  quant::BlockQ8_0 blk;
  std::memcpy(&blk, b.data(), sizeof blk);
  CHECK(blk.d == 0x3C00);
  std::int8_t const want[6] = {127, 3, -3, 1, -1, -127};
  for (int j = 0; j < 6; ++j) CHECK(blk.qs[j] == want[j]);
  for (int j = 6; j < 32; ++j) CHECK(blk.qs[j] == 0);
  auto const y = dequant(Format::kQ8_0, b, 32);
  CHECK(y[1] == 3.0f);
  CHECK(y[5] == -127.0f);
}

TEST_CASE("quant: Q4_0 of a hand-computed block", "[quant]") {
  // The largest magnitude is -8, so d = -8 / -8 = 1 and level = min(15, trunc(x + 8.5)).
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;   // 0
  x[1] = 7.0f;    // 15
  x[2] = 7.6f;    // 16 -> 15
  x[3] = -0.6f;   // 7
  x[16] = 0.5f;   // 9
  x[17] = -7.4f;  // 1
  auto const b = quantize(Format::kQ4_0, x);
  quant::BlockQ4_0 blk;
  std::memcpy(&blk, b.data(), sizeof blk);
  CHECK(blk.d == 0x3C00);
  CHECK(blk.qs[0] == (0 | (9 << 4)));
  CHECK(blk.qs[1] == (15 | (1 << 4)));
  CHECK(blk.qs[2] == (15 | (8 << 4)));
  CHECK(blk.qs[3] == (7 | (8 << 4)));
  CHECK(blk.qs[4] == (8 | (8 << 4)));
  auto const y = dequant(Format::kQ4_0, b, 32);
  CHECK(y[0] == -8.0f);
  CHECK(y[2] == 7.0f);
  CHECK(y[16] == 1.0f);
  CHECK(y[17] == -7.0f);
}

TEST_CASE("quant: Q4_K decodes a hand-built block", "[quant]") {
  // d = 1, dmin = 0.5; sub-block j: scale 10 + 7j, min 63 - 5j (6 bits, high bits exercised);
  // weight i of sub-block j has level (i + j) % 16: value (10 + 7j) * level - 0.5 (63 - 5j).
  quant::BlockQ4_K b;
  std::memset(&b, 0, sizeof b);
  b.d = 0x3C00;
  b.dmin = 0x3800;
  for (int j = 0; j < 8; ++j) {
    int const sc = 10 + 7 * j, m = 63 - 5 * j;
    if (j < 4) {
      b.scales[j] = static_cast<std::uint8_t>(sc);
      b.scales[j + 4] = static_cast<std::uint8_t>(m);
    } else {
      b.scales[j + 4] = static_cast<std::uint8_t>((sc & 0xF) | ((m & 0xF) << 4));
      b.scales[j - 4] = static_cast<std::uint8_t>(b.scales[j - 4] | ((sc >> 4) << 6));
      b.scales[j] = static_cast<std::uint8_t>(b.scales[j] | ((m >> 4) << 6));
    }
  }
  for (int j = 0; j < 8; ++j) {
    std::uint8_t sc, m;
    quant::get_scale_min(j, b.scales, &sc, &m);
    CHECK(sc == 10 + 7 * j);
    CHECK(m == 63 - 5 * j);
  }
  // Sub-blocks 2c and 2c + 1 share bytes qs[32c .. 32c + 32): low nibbles, then high ones.
  for (int i = 0; i < 256; ++i) {
    int const j = i / 32, l = i % 32, level = (l + j) % 16;
    std::uint8_t& byte = b.qs[32 * (j / 2) + l];
    byte = static_cast<std::uint8_t>(j % 2 == 0 ? (byte & 0xF0) | level
                                                : (byte & 0x0F) | (level << 4));
  }
  std::vector<std::byte> bytes(sizeof b);
  std::memcpy(bytes.data(), &b, sizeof b);
  auto const y = dequant(Format::kQ4_K, bytes, 256);
  for (int i = 0; i < 256; ++i) {
    int const j = i / 32, level = (i % 32 + j) % 16;
    INFO("weight " << i);
    CHECK(y[static_cast<std::size_t>(i)] ==
          static_cast<float>((10 + 7 * j) * level) - 0.5f * static_cast<float>(63 - 5 * j));
    CHECK(quant::q4k_level(b, i) == level);
  }
}

TEST_CASE("quant: Q6_K decodes a hand-built block", "[quant]") {
  // d = 0.25, scale of 16-block j = j - 8, level of weight i = (3 i) % 64: 0.25 (j - 8)(q - 32).
  quant::BlockQ6_K b;
  std::memset(&b, 0, sizeof b);
  b.d = 0x3400;
  for (int j = 0; j < 16; ++j) b.scales[j] = static_cast<std::int8_t>(j - 8);
  for (int i = 0; i < 256; ++i) {
    int const q = (3 * i) % 64, half = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
    std::uint8_t* ql = b.ql + 64 * half;
    std::uint8_t& lo = ql[l + (quarter % 2) * 32];
    lo = static_cast<std::uint8_t>(quarter < 2 ? (lo & 0xF0) | (q & 0xF)
                                               : (lo & 0x0F) | ((q & 0xF) << 4));
    b.qh[32 * half + l] =
        static_cast<std::uint8_t>(b.qh[32 * half + l] | ((q >> 4) << (2 * quarter)));
  }
  std::vector<std::byte> bytes(sizeof b);
  std::memcpy(bytes.data(), &b, sizeof b);
  auto const y = dequant(Format::kQ6_K, bytes, 256);
  for (int i = 0; i < 256; ++i) {
    int const q = (3 * i) % 64, j = i / 16;
    INFO("weight " << i);
    CHECK(y[static_cast<std::size_t>(i)] == 0.25f * static_cast<float>((j - 8) * (q - 32)));
    CHECK(quant::q6_level(b, i) == q);
  }
}

TEST_CASE("quant: Q3_K and Q2_K decode hand-built blocks", "[quant]") {
  // Weight i = 128 h + 32 j + l: low 2 bits in bits 2j of qs[32 h + l]; Q3_K's high bit in bit
  // 4h + j of hmask[l]. Q3_K scales: 6 bits stored + 32 (low nibbles in scales[0..8), high pairs
  // in scales[8..12)); Q2_K: scale in the low nibble of scales[i / 16], min in the high one.
  quant::BlockQ3_K b3;
  quant::BlockQ2_K b2;
  std::memset(&b3, 0, sizeof b3);
  std::memset(&b2, 0, sizeof b2);
  b3.d = 0x3800;     // 0.5
  b2.d = 0x3C00;     // 1
  b2.dmin = 0x3400;  // 0.25
  for (int j = 0; j < 16; ++j) {
    int const stored = (7 * j + 5) % 64;  // the scale is stored - 32
    if (j < 8) {
      b3.scales[j] = static_cast<std::uint8_t>(b3.scales[j] | (stored & 0xF));
    } else {
      b3.scales[j - 8] = static_cast<std::uint8_t>(b3.scales[j - 8] | ((stored & 0xF) << 4));
    }
    b3.scales[8 + j % 4] =
        static_cast<std::uint8_t>(b3.scales[8 + j % 4] | ((stored >> 4) << (2 * (j / 4))));
    b2.scales[j] = static_cast<std::uint8_t>((j % 16) | (((15 - j) % 16) << 4));
  }
  for (int i = 0; i < 256; ++i) {
    int const h = i / 128, j = (i % 128) / 32, l = i % 32;
    int const q3 = (5 * i + 3) % 8, q2 = (3 * i + 1) % 4;
    b3.qs[32 * h + l] = static_cast<std::uint8_t>(b3.qs[32 * h + l] | ((q3 & 3) << (2 * j)));
    b3.hmask[l] = static_cast<std::uint8_t>(b3.hmask[l] | ((q3 >> 2) << (4 * h + j)));
    b2.qs[32 * h + l] = static_cast<std::uint8_t>(b2.qs[32 * h + l] | (q2 << (2 * j)));
  }
  std::vector<std::byte> bytes3(sizeof b3), bytes2(sizeof b2);
  std::memcpy(bytes3.data(), &b3, sizeof b3);
  std::memcpy(bytes2.data(), &b2, sizeof b2);
  auto const y3 = dequant(Format::kQ3_K, bytes3, 256);
  auto const y2 = dequant(Format::kQ2_K, bytes2, 256);
  for (int i = 0; i < 256; ++i) {
    INFO("weight " << i);
    int const sub = i / 16;
    int const sc3 = (7 * sub + 5) % 64 - 32, q3 = (5 * i + 3) % 8;
    CHECK(y3[static_cast<std::size_t>(i)] ==
          0.5f * static_cast<float>(sc3) * static_cast<float>(q3 - 4));
    int const q2 = (3 * i + 1) % 4;
    CHECK(y2[static_cast<std::size_t>(i)] == static_cast<float>(sub % 16) * static_cast<float>(q2) -
                                                 0.25f * static_cast<float>((15 - sub) % 16));
  }
}

TEST_CASE("quant: every format round-trips within its error, finer formats closer", "[quant]") {
  Index const rows = 16, cols = 1024;
  std::vector<float> w = gaussian(rows * cols, 11);
  moe::ConstMatrixView<float> const wv(w.data(), rows, cols);
  double prev = 0;
  // Relative Frobenius errors on Gaussian weights (measured with this seed: q8_0 0.00525,
  // q6_k 0.0175, q5_k 0.0357, q4_k 0.0706, q4_0 0.0846, mxfp4 0.114, q3_k 0.149, q2_k 0.293; a
  // uniform step over 32 samples' range predicts 0.005, 0.016, 0.04, 0.08, 0.08; MXFP4's
  // power-of-two scale wastes up to half its range); the bounds leave ~20% room.
  double const bound[] = {0.0063, 0.021, 0.042, 0.045, 0.05, 0.085, 0.09,
                          0.092,  0.093, 0.1,   0.137, 0.18, 0.35};
  static_assert(std::size(quant::kFormats) == std::size(bound));
  for (std::size_t i = 0; i < std::size(bound); ++i) {
    Format const f = quant::kFormats[i];
    auto const q = quant::QuantMatrix::quantize(wv, f);
    CHECK(static_cast<Index>(q.bytes().size()) == rows * quant::row_bytes(f, cols));
    auto const e = quant::quantization_error(wv, q);
    INFO(quant::name(f) << ": relative error " << e.relative);
    CHECK(e.relative < bound[i]);
    CHECK(e.relative > prev);
    prev = e.relative;
  }
}

TEST_CASE("quant: zero rows quantize to zero blocks", "[quant]") {
  for (Format f : quant::kFormats) {
    std::vector<float> x(256, 0.0f);
    auto const y = dequant(f, quantize(f, x), 256);
    for (float v : y) CHECK(v == 0.0f);
  }
}

TEST_CASE("quant: subnormal blocks quantize to zero without overflow", "[quant]") {
  // 1 / (amax / 127) overflows for subnormal amax: the levels must stay defined (UBSan checks the
  // float-to-int conversions), the decoded block zero (its fp16 scale underflows to 0).
  for (Format f : quant::kFormats) {
    INFO(quant::name(f));
    std::vector<float> x(256, 0.0f);
    x[3] = 1e-40f;
    x[200] = -3e-41f;
    auto const y = dequant(f, quantize(f, x), 256);
    for (float v : y) CHECK(std::fabs(v) < 1e-30f);
  }
}

TEST_CASE("quant: bad input is an error naming the cause", "[quant]") {
  std::vector<float> x(256, 1.0f);
  std::vector<std::byte> out(1024);
  CHECK_THROWS_WITH(
      quant::quantize_row(Format::kQ4_K, x.data(), 96, out.data()),
      Catch::Contains("96 weights cannot be q4_k") && Catch::Contains("q8_0 or q4_0"));
  x[77] = std::nanf("");
  CHECK_THROWS_WITH(quant::quantize_row(Format::kQ8_0, x.data(), 256, out.data()),
                    Catch::Contains("weight 77") && Catch::Contains("finite"));
  x[77] = INFINITY;
  CHECK_THROWS_WITH(quant::quantize_row(Format::kQ6_K, x.data(), 256, out.data()),
                    Catch::Contains("weight 77"));
}
