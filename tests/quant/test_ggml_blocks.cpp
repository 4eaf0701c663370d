// SPDX-License-Identifier: Apache-2.0
// More GGUF blocks (moe/quant/ggml_blocks.hpp): byte layouts, decoders on hand-built blocks
// checked against ggml's formulas written out here, reference quantizers on hand-computed
// blocks, the round trip's error and its fixed points, the tables' spot values.
#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <span>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/quant/ggml_blocks.hpp"
#include "moe/quant/ggml_iq_blocks.hpp"

using moe::Index;
namespace quant = moe::quant;

namespace {

float h2f(std::uint16_t bits) { return moe::f16_to_float(bits); }

/// Sum of 12 uniforms minus 6 (roughly N(0, 1)), seeded.
std::vector<float> gaussian(Index n, std::uint64_t seed) {
  std::vector<float> u(static_cast<std::size_t>(12 * n)), x(static_cast<std::size_t>(n));
  moe::fill_uniform(u, 0.0f, 1.0f, seed);
  for (std::size_t i = 0; i < x.size(); ++i) {
    float s = -6.0f;
    for (std::size_t j = 0; j < 12; ++j) s += u[12 * i + j];
    x[i] = s;
  }
  return x;
}

/// Bit `bit` of the little-endian bytes at p.
int bit_of(std::uint8_t const* p, int bit) { return (p[bit / 8] >> (bit % 8)) & 1; }

/// ggml-common.h's kvalues_iq4nl, typed in again so that a changed table in the header fails.
constexpr int kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                            1,    13,   25,  38,  53,  69,  89,  113};

/// An OCP MX E2M1 code (sign, 2 exponent bits with bias 1, 1 mantissa bit) as its value.
float e2m1(int code) {
  int const s = code >> 3, e = (code >> 1) & 3, m = code & 1;
  float const v = e == 0 ? 0.5f * static_cast<float>(m)
                         : std::ldexp(1.0f + 0.5f * static_cast<float>(m), e - 1);
  return s != 0 ? -v : v;
}

template <class Block, class Quantize, class Dequantize>
double relative_error(std::vector<float> const& x, Quantize quantize, Dequantize dequantize) {
  auto const n = static_cast<Index>(x.size());
  std::vector<Block> q(static_cast<std::size_t>(n / quant::block_elems_v<Block>));
  quantize(x.data(), q.data(), n);
  std::vector<float> y(x.size());
  dequantize(q.data(), y.data(), n);
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    err += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
    norm += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(err / norm);
}

/// quantize(dequantize(quantize(x))) == quantize(x), byte for byte.
template <class Block, class Quantize, class Dequantize>
bool requantizes_to_itself(std::vector<float> const& x, Quantize quantize, Dequantize dequantize) {
  auto const n = static_cast<Index>(x.size());
  auto const nb = static_cast<std::size_t>(n / quant::block_elems_v<Block>);
  std::vector<Block> q1(nb), q2(nb);
  quantize(x.data(), q1.data(), n);
  std::vector<float> y(x.size());
  dequantize(q1.data(), y.data(), n);
  quantize(y.data(), q2.data(), n);
  return std::memcmp(q1.data(), q2.data(), nb * sizeof(Block)) == 0;
}

}  // namespace

TEST_CASE("ggml blocks: sizes and field offsets are ggml's", "[quant]") {
  // ggml-common.h: sizeof(ggml_half) = 2, QK_K = 256, K_SCALE_SIZE = 12.
  CHECK(sizeof(quant::BlockQ4_1) == 2 * 2 + 32 / 2);                  // 20
  CHECK(sizeof(quant::BlockQ5_0) == 2 + 4 + 32 / 2);                  // 22
  CHECK(sizeof(quant::BlockQ5_1) == 2 * 2 + 4 + 32 / 2);              // 24
  CHECK(sizeof(quant::BlockQ5_K) == 2 * 2 + 12 + 256 / 2 + 256 / 8);  // 176
  CHECK(sizeof(quant::BlockIQ4_NL) == 2 + 32 / 2);                    // 18
  CHECK(sizeof(quant::BlockIQ4_XS) == 2 + 2 + 256 / 64 + 256 / 2);    // 136
  CHECK(sizeof(quant::BlockMXFP4) == 1 + 32 / 2);                     // 17
  CHECK(offsetof(quant::BlockQ5_0, qh) == 2);
  CHECK(offsetof(quant::BlockQ5_0, qs) == 6);
  CHECK(offsetof(quant::BlockQ5_1, qh) == 4);
  CHECK(offsetof(quant::BlockQ5_1, qs) == 8);
  CHECK(offsetof(quant::BlockQ5_K, scales) == 4);
  CHECK(offsetof(quant::BlockQ5_K, qh) == 16);
  CHECK(offsetof(quant::BlockQ5_K, qs) == 48);
  CHECK(offsetof(quant::BlockIQ4_XS, scales_h) == 2);
  CHECK(offsetof(quant::BlockIQ4_XS, scales_l) == 4);
  CHECK(offsetof(quant::BlockIQ4_XS, qs) == 8);
  CHECK(offsetof(quant::BlockMXFP4, qs) == 1);
  CHECK(quant::block_elems_v<quant::BlockQ4_1> == 32);
  CHECK(quant::block_elems_v<quant::BlockMXFP4> == 32);
  CHECK(quant::block_elems_v<quant::BlockQ5_K> == 256);
  CHECK(quant::block_elems_v<quant::BlockIQ4_XS> == 256);
}

TEST_CASE("ggml blocks: the value tables are ggml-common.h's", "[quant]") {
  for (int i = 0; i < 16; ++i) CHECK(quant::kIq4nlValues[i] == kIq4nl[i]);
  // kvalues_mxfp4: the E2M1 values doubled (ggml-common.h kvalues_fp4).
  for (int i = 0; i < 16; ++i) {
    INFO("code " << i);
    CHECK(static_cast<float>(quant::kMxfp4Values[i]) == 2.0f * e2m1(i));
  }
  CHECK(quant::kMxfp4Values[7] == 12);
  CHECK(quant::kMxfp4Values[15] == -12);
}

TEST_CASE("ggml blocks: Q4_1 decodes a hand-built block", "[quant]") {
  // d = 0.5, m = -1: weight j = 0.5 q - 1 with q = j (low nibbles) and 15 - j (high nibbles).
  quant::BlockQ4_1 b;
  b.d = 0x3800;
  b.m = 0xBC00;
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  float y[32];
  quant::dequantize_row_q4_1(&b, y, 32);
  for (int j = 0; j < 16; ++j) {
    INFO("j " << j);
    CHECK(y[j] == 0.5f * static_cast<float>(j) - 1.0f);
    CHECK(y[j + 16] == 0.5f * static_cast<float>(15 - j) - 1.0f);
  }
  float z[32];  // quant::Format's decoder (what the kernels multiply): the same values
  quant::dequantize_row(quant::Format::kQ4_1, &b, 32, z);
  CHECK(std::memcmp(z, y, sizeof z) == 0);
}

TEST_CASE("ggml blocks: Q5_0 and Q5_1 decode hand-built blocks", "[quant]") {
  // The 5th bit of weight i is bit i of qh (little-endian); its low 4 bits the low nibble of
  // qs[i] (i < 16) or the high nibble of qs[i - 16].
  std::uint8_t const qh[4] = {0x1E, 0x0F, 0xC3, 0xA5};
  quant::BlockQ5_0 b0;
  quant::BlockQ5_1 b1;
  b0.d = 0x3800;  // 0.5
  b1.d = 0x3400;  // 0.25
  b1.m = 0x4000;  // 2
  std::memcpy(b0.qh, qh, 4);
  std::memcpy(b1.qh, qh, 4);
  for (int j = 0; j < 16; ++j) {
    b0.qs[j] = b1.qs[j] = static_cast<std::uint8_t>(j | (((7 * j + 3) & 0xF) << 4));
  }
  float y0[32], y1[32];
  quant::dequantize_row_q5_0(&b0, y0, 32);
  quant::dequantize_row_q5_1(&b1, y1, 32);
  for (int i = 0; i < 32; ++i) {
    int const low = i < 16 ? i : (7 * (i - 16) + 3) & 0xF;
    int const q = low + 16 * bit_of(qh, i);
    INFO("weight " << i << ", level " << q);
    CHECK(y0[i] == 0.5f * static_cast<float>(q - 16));
    CHECK(y1[i] == 0.25f * static_cast<float>(q) + 2.0f);
    // The kernels' level accessor and quant::Format's decoder (what the kernels multiply).
    CHECK(quant::q5_level(b0, i) == q);
    CHECK(quant::q5_level(b1, i) == q);
  }
  float z0[32];
  quant::dequantize_row(quant::Format::kQ5_0, &b0, 32, z0);
  CHECK(std::memcmp(z0, y0, sizeof z0) == 0);
  quant::dequantize_row(quant::Format::kQ5_1, &b1, 32, z0);
  CHECK(std::memcmp(z0, y1, sizeof z0) == 0);
  // Both high-bit states occur (qh has set and clear bits in each half).
  CHECK(y0[1] == 0.5f * static_cast<float>(1 + 16 - 16));  // bit 1 of 0x1E set
  CHECK(y0[0] == 0.5f * static_cast<float>(0 - 16));       // bit 0 clear
}

TEST_CASE("ggml blocks: Q5_K decodes a hand-built block", "[quant]") {
  // d = 1, dmin = 0.5; 32-block j: scale 10 + 7j, min 63 - 5j (Q4_K's 6-bit packing);
  // weight i = 64 c + 32 h + l has level (5 i + j) % 32: low nibble (h) of qs[32 c + l], 5th bit
  // bit 2c + h of qh[l]; its value (10 + 7j) level - 0.5 (63 - 5j).
  quant::BlockQ5_K b;
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
  for (int i = 0; i < 256; ++i) {
    int const j = i / 32, c = i / 64, half = (i / 32) % 2, l = i % 32, q = (5 * i + j) % 32;
    std::uint8_t& byte = b.qs[32 * c + l];
    byte = static_cast<std::uint8_t>(half == 0 ? (byte & 0xF0) | (q & 0xF)
                                               : (byte & 0x0F) | ((q & 0xF) << 4));
    b.qh[l] = static_cast<std::uint8_t>(b.qh[l] | ((q >> 4) << (2 * c + half)));
  }
  float y[256];
  quant::dequantize_row_q5_k(&b, y, 256);
  for (int i = 0; i < 256; ++i) {
    int const j = i / 32, q = (5 * i + j) % 32;
    INFO("weight " << i);
    CHECK(y[i] == static_cast<float>((10 + 7 * j) * q) - 0.5f * static_cast<float>(63 - 5 * j));
  }
}

TEST_CASE("ggml blocks: IQ4_NL and IQ4_XS decode hand-built blocks", "[quant]") {
  // IQ4_NL: d = 0.5, weight j = 0.5 kvalues[j], weight j + 16 = 0.5 kvalues[15 - j].
  quant::BlockIQ4_NL nl;
  nl.d = 0x3800;
  for (int j = 0; j < 16; ++j) nl.qs[j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  float y[256];
  quant::dequantize_row_iq4_nl(&nl, y, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[j] == 0.5f * static_cast<float>(kIq4nl[j]));
    CHECK(y[j + 16] == 0.5f * static_cast<float>(kIq4nl[15 - j]));
  }
  float z[256];  // quant::Format's decoder (what the kernels multiply): the same values
  quant::dequantize_row(quant::Format::kIQ4_NL, &nl, 32, z);
  CHECK(std::memcmp(z, y, 32 * sizeof(float)) == 0);
  // IQ4_XS: d = 0.25; 32-block ib's 6-bit scale ls = (9 ib + 5) % 64, low nibble in scales_l,
  // high 2 bits in scales_h; weight i = 32 ib + 16 h + l has index (3 i) % 16 in nibble h of
  // qs[16 ib + l]; its value 0.25 (ls - 32) kvalues[index].
  quant::BlockIQ4_XS xs;
  std::memset(&xs, 0, sizeof xs);
  xs.d = 0x3400;
  for (int ib = 0; ib < 8; ++ib) {
    int const ls = (9 * ib + 5) % 64;
    xs.scales_l[ib / 2] =
        static_cast<std::uint8_t>(xs.scales_l[ib / 2] | ((ls & 0xF) << (4 * (ib % 2))));
    xs.scales_h = static_cast<std::uint16_t>(xs.scales_h | ((ls >> 4) << (2 * ib)));
  }
  for (int i = 0; i < 256; ++i) {
    int const ib = i / 32, hi = (i / 16) % 2, l = i % 16, q = (3 * i) % 16;
    xs.qs[16 * ib + l] = static_cast<std::uint8_t>(xs.qs[16 * ib + l] | (q << (4 * hi)));
  }
  quant::dequantize_row_iq4_xs(&xs, y, 256);
  for (int i = 0; i < 256; ++i) {
    int const ib = i / 32, ls = (9 * ib + 5) % 64;
    INFO("weight " << i);
    CHECK(y[i] == 0.25f * static_cast<float>(ls - 32) * static_cast<float>(kIq4nl[(3 * i) % 16]));
    if (i % 32 == 0) CHECK(quant::iq4xs_scale(xs, ib) == ls);
  }
  quant::dequantize_row(quant::Format::kIQ4_XS, &xs, 256, z);
  CHECK(std::memcmp(z, y, sizeof z) == 0);
}

TEST_CASE("ggml blocks: MXFP4 decodes E2M1 codes times 2^(e - 127)", "[quant]") {
  // The OCP MX definition, not ggml's doubled table: weight = e2m1(code) * 2^(e - 127), for
  // exponents around 1, the subnormal scales (e = 0, 1) and the top (e = 254, 255: ggml gives
  // 2^128 for 255, no NaN; 6 * 2^127 overflows to inf in both).
  for (int e : {127, 130, 100, 1, 0, 254, 255}) {
    INFO("e " << e);
    quant::BlockMXFP4 b;
    b.e = static_cast<std::uint8_t>(e);
    for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
    float y[32];
    quant::dequantize_row_mxfp4(&b, y, 32);
    for (int j = 0; j < 16; ++j) {
      INFO("j " << j);
      CHECK(y[j] == std::ldexp(e2m1(j), e - 127));
      CHECK(y[j + 16] == std::ldexp(e2m1(15 - j), e - 127));
    }
    float z[32];  // quant::Format's decoder (what the kernels multiply): the same values
    quant::dequantize_row(quant::Format::kMXFP4, &b, 32, z);
    CHECK(std::memcmp(z, y, sizeof z) == 0);
  }
}

TEST_CASE("ggml blocks: F16 and BF16 rows", "[quant]") {
  std::uint16_t const f16[4] = {0x3C00, 0xC000, 0x7C00, 0x0001};
  std::uint16_t const bf16[3] = {0x3F80, 0x4049, 0xFF80};
  float y[4];
  quant::dequantize_row_f16(f16, y, 4);
  CHECK(y[0] == 1.0f);
  CHECK(y[1] == -2.0f);
  CHECK(y[2] == INFINITY);
  CHECK(y[3] == std::ldexp(1.0f, -24));
  quant::dequantize_row_bf16(bf16, y, 3);
  CHECK(y[0] == 1.0f);
  CHECK(y[1] == 3.140625f);
  CHECK(y[2] == -INFINITY);
  float const x[3] = {1.0f, 1.0f + std::ldexp(1.0f, -11), 3.14159f};  // a tie: to even
  std::uint16_t out[3];
  quant::quantize_row_f16_ref(x, out, 3);
  CHECK(out[0] == 0x3C00);
  CHECK(out[1] == 0x3C00);
  CHECK(out[2] == 0x4248);
  quant::quantize_row_bf16_ref(x, out, 3);
  CHECK(out[0] == 0x3F80);
  CHECK(out[2] == 0x4049);
}

TEST_CASE("ggml blocks: Q4_1, Q5_0 and Q5_1 quantize hand-computed blocks", "[quant]") {
  std::vector<float> x(32, 0.0f);
  SECTION("Q4_1: d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5))") {
    x[0] = -1.0f;   // min: 0
    x[1] = 14.0f;   // max: 15
    x[2] = 0.4f;    // 1.9: 1
    x[3] = 0.6f;    // 2.1: 2
    x[16] = 2.5f;   // 4.0: 4
    x[17] = 13.9f;  // 15.4: 15; zeros: 1.5: 1
    quant::BlockQ4_1 b;
    quant::quantize_row_q4_1_ref(x.data(), &b, 32);
    CHECK(b.d == 0x3C00);
    CHECK(b.m == 0xBC00);
    CHECK(b.qs[0] == (0 | (4 << 4)));
    CHECK(b.qs[1] == (15 | (15 << 4)));
    CHECK(b.qs[2] == (1 | (1 << 4)));
    CHECK(b.qs[3] == (2 | (1 << 4)));
    for (int j = 4; j < 16; ++j) CHECK(b.qs[j] == (1 | (1 << 4)));
  }
  SECTION("Q5_0: d = max / -16, q = min(31, trunc(x / d + 16.5))") {
    x[0] = -16.0f;  // d = 1; 0
    x[1] = 15.2f;   // 31.7: 31
    x[2] = 15.6f;   // 32.1: 31
    x[3] = -0.6f;   // 15.9: 15
    x[16] = 0.5f;   // 17.0: 17; zeros: 16
    x[17] = -8.4f;  // 8.1: 8
    quant::BlockQ5_0 b;
    quant::quantize_row_q5_0_ref(x.data(), &b, 32);
    CHECK(b.d == 0x3C00);
    int const want[32] = {0,  31, 31, 15, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
                          17, 8,  16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16};
    for (int i = 0; i < 32; ++i) {
      INFO("weight " << i);
      int const low = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
      CHECK(low + 16 * bit_of(b.qh, i) == want[i]);
    }
  }
  SECTION("Q5_1: d = (max - min) / 31, q = trunc((x - min) / d + 0.5)") {
    x[0] = 31.0f;  // min 0, d = 1: 31
    x[1] = 16.4f;  // 16
    x[2] = 15.5f;  // 16
    x[3] = 0.49f;  // 0
    quant::BlockQ5_1 b;
    quant::quantize_row_q5_1_ref(x.data(), &b, 32);
    CHECK(b.d == 0x3C00);
    CHECK(b.m == 0x0000);
    int const want[4] = {31, 16, 16, 0};
    for (int i = 0; i < 32; ++i) {
      int const low = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
      CHECK(low + 16 * bit_of(b.qh, i) == (i < 4 ? want[i] : 0));
    }
  }
}

TEST_CASE("ggml blocks: IQ4_NL and MXFP4 quantize hand-computed blocks", "[quant]") {
  std::vector<float> x(32, 0.0f);
  SECTION("IQ4_NL: levels nearest x / (max / -127), d their x^2-weighted least-squares scale") {
    x[0] = -127.0f;         // d0 = 1: index 0
    x[1] = 7.0f;            // between 1 and 13, a tie: the upper, 13 (index 9)
    x[2] = 6.9f;            // 1 (index 8)
    x[3] = -16.0f;          // between -22 and -10, a tie: -10 (index 7)
    x[4] = 113.0f;          // index 15
    x[16] = 200.0f / 3.0f;  // 66.7: 69 (index 13); zeros: 1 (index 8)
    quant::BlockIQ4_NL b;
    quant::quantize_row_iq4_nl_ref(x.data(), &b, 32);
    int const want[6] = {0, 9, 8, 7, 15, 8};
    for (int i = 0; i < 32; ++i) {
      int const index = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
      CHECK(index == (i < 5 ? want[i] : (i == 16 ? 13 : 8)));
    }
    double num = 0, den = 0;  // sum x^2 q x / sum x^2 q^2
    for (int i = 0; i < 32; ++i) {
      int const index = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
      double const xi = x[static_cast<std::size_t>(i)], q = kIq4nl[index];
      num += xi * xi * q * xi;
      den += xi * xi * q * q;
    }
    CHECK(std::fabs(h2f(b.d) - num / den) <= num / den * std::ldexp(1.0, -11));
  }
  SECTION("MXFP4: e = floor(log2 amax) - 2 + 127, codes nearest (first on a tie)") {
    x[0] = 6.0f;    // amax 6: e = 127, scale 2^-1 on the doubled values: 0, 0.5, 1, ..., 6
    x[1] = -2.4f;   // -2 (code 12)
    x[2] = 0.25f;   // 0 and 0.5 tie: 0 (code 0)
    x[3] = -0.25f;  // 0 and -0.5 tie: code 0
    x[4] = 5.0f;    // 4 and 6 tie: 4 (code 6)
    x[16] = -5.0f;  // -4 (code 14)
    x[17] = 1.2f;   // 1 (code 2)
    quant::BlockMXFP4 b;
    quant::quantize_row_mxfp4_ref(x.data(), &b, 32);
    CHECK(b.e == 127);
    CHECK(b.qs[0] == (7 | (14 << 4)));
    CHECK(b.qs[1] == (12 | (2 << 4)));
    CHECK(b.qs[2] == 0);
    CHECK(b.qs[3] == 0);
    CHECK(b.qs[4] == 6);
    x.assign(32, 0.0f);
    quant::quantize_row_mxfp4_ref(x.data(), &b, 32);
    CHECK(b.e == 0);  // amax 0
    x[5] = 1e-39f;    // amax < 2^-125: ggml's conversion is undefined; moe clamps e to 0
    quant::quantize_row_mxfp4_ref(x.data(), &b, 32);
    CHECK(b.e == 0);
    x[5] = std::ldexp(1.0f, 100);
    quant::quantize_row_mxfp4_ref(x.data(), &b, 32);
    CHECK(b.e == 100 - 2 + 127);
    CHECK((b.qs[5] & 0xF) == 6);  // 2^100 = 8 * 2^97: the doubled value 8, code 6
    // quant::quantize_row (what Linear and the expert banks quantize with) is this reference,
    // byte for byte, over blocks of very different magnitudes.
    std::vector<float> row(4 * 32);
    for (std::size_t i = 0; i < row.size(); ++i) {
      row[i] =
          std::ldexp(std::sin(0.7f * static_cast<float>(i)), static_cast<int>(i / 32) * 40 - 70);
    }
    quant::BlockMXFP4 ref[4];
    quant::quantize_row_mxfp4_ref(row.data(), ref, 4 * 32);
    quant::BlockMXFP4 fmt[4];
    quant::quantize_row(quant::Format::kMXFP4, row.data(), 4 * 32, fmt);
    CHECK(std::memcmp(ref, fmt, sizeof ref) == 0);
  }
}

TEST_CASE("ggml blocks: round trips of Gaussian rows within each format's error", "[quant]") {
  std::vector<float> const x = gaussian(64 * 256, 5);
  // Relative Frobenius errors (measured with this seed: q4_1 0.0767, q5_0 0.0414, q5_1 0.0368,
  // q5_k 0.0352, iq4_nl 0.0773, iq4_xs 0.0752, mxfp4 0.115; a uniform step over the range of 32
  // Gaussian samples predicts 0.08 for 4 bits and 0.04 for 5); the bounds leave ~20% room.
  auto const q41 =
      relative_error<quant::BlockQ4_1>(x, quant::quantize_row_q4_1_ref, quant::dequantize_row_q4_1);
  auto const q50 =
      relative_error<quant::BlockQ5_0>(x, quant::quantize_row_q5_0_ref, quant::dequantize_row_q5_0);
  auto const q51 =
      relative_error<quant::BlockQ5_1>(x, quant::quantize_row_q5_1_ref, quant::dequantize_row_q5_1);
  auto const q5k =
      relative_error<quant::BlockQ5_K>(x, quant::quantize_row_q5_k_ref, quant::dequantize_row_q5_k);
  auto const nl = relative_error<quant::BlockIQ4_NL>(x, quant::quantize_row_iq4_nl_ref,
                                                     quant::dequantize_row_iq4_nl);
  auto const xs = relative_error<quant::BlockIQ4_XS>(x, quant::quantize_row_iq4_xs_ref,
                                                     quant::dequantize_row_iq4_xs);
  auto const mx = relative_error<quant::BlockMXFP4>(x, quant::quantize_row_mxfp4_ref,
                                                    quant::dequantize_row_mxfp4);
  INFO("q4_1 " << q41 << " q5_0 " << q50 << " q5_1 " << q51 << " q5_k " << q5k << " iq4_nl " << nl
               << " iq4_xs " << xs << " mxfp4 " << mx);
  CHECK(q41 < 0.092);
  CHECK(q50 < 0.05);
  CHECK(q51 < 0.044);
  CHECK(q5k < 0.042);
  CHECK(nl < 0.093);
  CHECK(xs < 0.09);
  CHECK(mx < 0.138);
  // The 5-bit formats beat the 4-bit ones, and those MXFP4 (a power-of-two scale).
  for (double four : {q41, nl, xs}) {
    CHECK(std::max({q50, q51, q5k}) < four);
    CHECK(four < mx);
  }
}

TEST_CASE("ggml blocks: requantizing the decoded row gives the same bytes", "[quant]") {
  // A decoded value is level * scale (+ min) on the block's own grid, and these quantizers find
  // that grid again: the scale from the extreme value (Q5_0, IQ4_NL's first guess, MXFP4's
  // exponent) or from min and max (Q4_1, Q5_1), whose levels are 0 and the top; each value
  // then rounds to its own level (IQ4_NL's least-squares scale of exact levels is d again).
  std::vector<float> const x = gaussian(64 * 256, 9);
  CHECK(requantizes_to_itself<quant::BlockQ4_1>(x, quant::quantize_row_q4_1_ref,
                                                quant::dequantize_row_q4_1));
  CHECK(requantizes_to_itself<quant::BlockQ5_0>(x, quant::quantize_row_q5_0_ref,
                                                quant::dequantize_row_q5_0));
  CHECK(requantizes_to_itself<quant::BlockQ5_1>(x, quant::quantize_row_q5_1_ref,
                                                quant::dequantize_row_q5_1));
  CHECK(requantizes_to_itself<quant::BlockIQ4_NL>(x, quant::quantize_row_iq4_nl_ref,
                                                  quant::dequantize_row_iq4_nl));
  CHECK(requantizes_to_itself<quant::BlockMXFP4>(x, quant::quantize_row_mxfp4_ref,
                                                 quant::dequantize_row_mxfp4));
}

TEST_CASE("ggml blocks: Q5_K and IQ4_XS requantize their decoded rows nearly unchanged",
          "[quant]") {
  // Their scale searches (make_qkx2_quants; IQ4_XS's 15 candidate scales, then 6-bit block
  // scales) may pick another scale for the decoded values, so the bytes are not a fixed point
  // (measured: 2 to 5 of 64 super-blocks change, by seed). The second round trip moves the
  // decoded row by at most a tenth of the first one's error (measured: 0.002-0.007 against
  // 0.035 and 0.075).
  std::vector<float> const x = gaussian(64 * 256, 9);
  auto second_error = [&x](auto quantize, auto dequantize, auto block) {
    using Block = decltype(block);
    auto const n = static_cast<Index>(x.size());
    std::vector<Block> q(x.size() / static_cast<std::size_t>(quant::block_elems_v<Block>));
    std::vector<float> y(x.size()), z(x.size());
    quantize(x.data(), q.data(), n);
    dequantize(q.data(), y.data(), n);
    quantize(y.data(), q.data(), n);
    dequantize(q.data(), z.data(), n);
    double e1 = 0, e2 = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      e1 += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
      e2 += (static_cast<double>(y[i]) - z[i]) * (static_cast<double>(y[i]) - z[i]);
    }
    return std::sqrt(e2 / e1);
  };
  CHECK(second_error(quant::quantize_row_q5_k_ref, quant::dequantize_row_q5_k, quant::BlockQ5_K{}) <
        0.1);
  CHECK(second_error(quant::quantize_row_iq4_xs_ref, quant::dequantize_row_iq4_xs,
                     quant::BlockIQ4_XS{}) < 0.1);
}

TEST_CASE("ggml blocks: bad rows are errors naming the cause", "[quant]") {
  std::vector<float> x(256, 1.0f), y(256);
  quant::BlockQ5_K b[1] = {};
  quant::BlockQ4_1 b41[8] = {};
  CHECK_THROWS_WITH(quant::quantize_row_q5_k_ref(x.data(), b, 96),
                    Catch::Contains("96 weights cannot be q5_k") && Catch::Contains("256"));
  CHECK_THROWS_WITH(quant::dequantize_row_q4_1(b41, y.data(), 40),
                    Catch::Contains("40 weights cannot be q4_1"));
  CHECK_THROWS_WITH(quant::dequantize_row_mxfp4(nullptr, y.data(), 0),
                    Catch::Contains("0 weights cannot be mxfp4"));
  x[77] = std::nanf("");
  CHECK_THROWS_WITH(quant::quantize_row_q4_1_ref(x.data(), b41, 256),
                    Catch::Contains("weight 77") && Catch::Contains("finite"));
  x[77] = INFINITY;
  quant::BlockMXFP4 mx[8] = {};
  CHECK_THROWS_WITH(quant::quantize_row_mxfp4_ref(x.data(), mx, 256),
                    Catch::Contains("weight 77") && Catch::Contains("finite"));
}

// ---------------------------------------------------------------------------------------------
// The codebook formats (moe/quant/ggml_iq_blocks.hpp).

namespace {

/// Byte j of a grid entry as it lies in memory (how ggml reads it).
int entry_byte(std::uint64_t entry, int j) {
  unsigned char b[8];
  std::memcpy(b, &entry, 8);
  return b[j];
}
int entry_byte(std::uint32_t entry, int j) {
  unsigned char b[4];
  std::memcpy(b, &entry, 4);
  return b[j];
}

/// Whether weight j of 8 is negated under 7 stored sign bits: bit j, the 8th by even parity.
bool negated(unsigned s7, int j) {
  return j < 7 ? ((s7 >> j) & 1u) != 0 : (std::popcount(s7) & 1) != 0;
}

/// A seeded stream of small integers for filling blocks.
struct Lcg {
  std::uint32_t state;
  unsigned next(unsigned bound) {
    state = state * 1664525u + 1013904223u;
    return (state >> 8) % bound;
  }
};

}  // namespace

TEST_CASE("ggml IQ blocks: sizes are ggml's", "[quant]") {
  CHECK(sizeof(quant::BlockIQ2_XXS) == 2 + 256 / 8 * 2);               // 66
  CHECK(sizeof(quant::BlockIQ2_XS) == 2 + 256 / 8 * 2 + 256 / 32);     // 74
  CHECK(sizeof(quant::BlockIQ2_S) == 2 + 256 / 4 + 256 / 16);          // 82
  CHECK(sizeof(quant::BlockIQ3_XXS) == 2 + 3 * (256 / 8));             // 98
  CHECK(sizeof(quant::BlockIQ3_S) == 2 + 13 * (256 / 32) + 256 / 64);  // 110
  CHECK(sizeof(quant::BlockIQ1_S) == 2 + 256 / 8 + 256 / 16);          // 50
  CHECK(sizeof(quant::BlockIQ1_M) == 256 / 8 + 256 / 16 + 256 / 32);   // 56
  CHECK(offsetof(quant::BlockIQ2_S, qh) == 66);
  CHECK(offsetof(quant::BlockIQ3_S, signs) == 74);
  CHECK(offsetof(quant::BlockIQ3_S, scales) == 106);
  CHECK(offsetof(quant::BlockIQ1_S, qh) == 34);
  CHECK(offsetof(quant::BlockIQ1_M, scales) == 48);
  CHECK(quant::block_elems_v<quant::BlockIQ1_M> == 256);
  CHECK(quant::kIq1Delta == 0.125f);
}

TEST_CASE("ggml IQ blocks: the grids and sign tables are ggml-common.h's", "[quant]") {
  for (int j = 0; j < 8; ++j) CHECK(quant::kKmaskIq2xs[j] == 1 << j);
  for (unsigned s = 0; s < 128; ++s) {
    INFO("ksigns " << s);
    for (int j = 0; j < 8; ++j) CHECK((((quant::kKsignsIq2xs[s] >> j) & 1) != 0) == negated(s, j));
  }
  // First, middle and last entries as ggml-common.h (d99724f2) writes them, and a checksum of
  // each whole table (sum of (i + 1) * entry mod 2^64, computed from ggml-common.h's text).
  auto checksum = [](auto const& table) {
    std::uint64_t s = 0;
    for (std::size_t i = 0; i < std::size(table); ++i) s += (i + 1) * std::uint64_t{table[i]};
    return s;
  };
  CHECK(quant::kIq2xxsGrid[0] == 0x0808080808080808);
  CHECK(quant::kIq2xxsGrid[129] == 0x082b2b08082b0808);
  CHECK(quant::kIq2xxsGrid[255] == 0x2b2b2b1908081908);
  CHECK(checksum(quant::kIq2xxsGrid) == 0xcb9ca27f96a681f5);
  CHECK(quant::kIq2xsGrid[0] == 0x0808080808080808);
  CHECK(quant::kIq2xsGrid[257] == 0x1908080808082b19);
  CHECK(quant::kIq2xsGrid[511] == 0x2b2b2b2b2b2b2b2b);
  CHECK(checksum(quant::kIq2xsGrid) == 0xa3bb3aa0abccb48c);
  CHECK(quant::kIq2sGrid[0] == 0x0808080808080808);
  CHECK(quant::kIq2sGrid[513] == 0x1908081919080819);
  CHECK(quant::kIq2sGrid[1023] == 0x2b2b2b2b2b2b2b2b);
  CHECK(checksum(quant::kIq2sGrid) == 0x20f0afd18f24c859);
  CHECK(quant::kIq3xxsGrid[0] == 0x04040404);
  CHECK(quant::kIq3xxsGrid[129] == 0x141c3e24);
  CHECK(quant::kIq3xxsGrid[255] == 0x3e341c04);
  CHECK(checksum(quant::kIq3xxsGrid) == 0x11be6d9a520e);
  CHECK(quant::kIq3sGrid[0] == 0x01010101);
  CHECK(quant::kIq3sGrid[257] == 0x05090705);
  CHECK(quant::kIq3sGrid[511] == 0x0f0f0101);
  CHECK(checksum(quant::kIq3sGrid) == 0x114b10ed9fb0);
  CHECK(quant::kIq1sGrid[0] == 0xffffffffffffffff);
  CHECK(quant::kIq1sGrid[1025] == 0x000000000000ffff);
  CHECK(quant::kIq1sGrid[2047] == 0x0101010101010101);
  CHECK(checksum(quant::kIq1sGrid) == 0x05749c55a8776663);
  CHECK(checksum(quant::kKsignsIq2xs) == 0x12ba80);
  // Every byte is one of the format's magnitudes (IQ1: an int8 -1, 0 or 1).
  auto bytes_in = [](auto const& table, std::vector<int> allowed) {
    for (auto entry : table) {
      for (std::size_t j = 0; j < sizeof entry; ++j) {
        int const b = entry_byte(entry, static_cast<int>(j));
        if (std::find(allowed.begin(), allowed.end(), b) == allowed.end()) return false;
      }
    }
    return true;
  };
  CHECK(bytes_in(quant::kIq2xxsGrid, {8, 25, 43}));
  CHECK(bytes_in(quant::kIq2xsGrid, {8, 25, 43}));
  CHECK(bytes_in(quant::kIq2sGrid, {8, 25, 43}));
  CHECK(bytes_in(quant::kIq3xxsGrid, {4, 12, 20, 28, 36, 44, 52, 62}));
  CHECK(bytes_in(quant::kIq3sGrid, {1, 3, 5, 7, 9, 11, 13, 15}));
  CHECK(bytes_in(quant::kIq1sGrid, {0x00, 0x01, 0xFF}));
}

TEST_CASE("ggml IQ blocks: IQ2_XXS, IQ2_XS and IQ2_S decode hand-built blocks", "[quant]") {
  // Per 32-block ib and 8-group l: grid index, 7 (IQ2_S: 8) sign bits and a 4-bit scale s per
  // 32 (IQ2_XXS) or per 16; weight = d (0.5 + s) / 4 * magnitude, negated by its sign bit.
  float const d = 0.5f;
  float want_xxs[256], want_xs[256], want_s[256];
  quant::BlockIQ2_XXS xxs;
  quant::BlockIQ2_XS xs;
  quant::BlockIQ2_S s;
  std::memset(&xxs, 0, sizeof xxs);
  std::memset(&xs, 0, sizeof xs);
  std::memset(&s, 0, sizeof s);
  xxs.d = xs.d = s.d = 0x3800;
  Lcg rng{17};
  for (int ib = 0; ib < 8; ++ib) {
    unsigned const sc = rng.next(16), sc_lo = rng.next(16), sc_hi = rng.next(16);
    xxs.qs[4 * ib + 3] = static_cast<std::uint16_t>(sc << 12);
    xs.scales[ib] = s.scales[ib] = static_cast<std::uint8_t>(sc_lo | (sc_hi << 4));
    for (int l = 0; l < 4; ++l) {
      // IQ2_XXS: index byte l of the group's first 32 bits, signs at bit 7 l of the second.
      unsigned const i8 = ib == 0 && l == 0 ? 0 : rng.next(256), s7 = rng.next(128);
      auto* words = xxs.qs + 4 * ib;
      words[l / 2] = static_cast<std::uint16_t>(words[l / 2] | (i8 << (8 * (l % 2))));
      std::uint32_t const sign_word = s7 << (7 * l);
      words[2] = static_cast<std::uint16_t>(words[2] | (sign_word & 0xFFFF));
      words[3] = static_cast<std::uint16_t>(words[3] | (sign_word >> 16));
      // IQ2_XS: a 16-bit word, 9-bit index and 7 sign bits.
      unsigned const i9 = rng.next(512), t7 = rng.next(128);
      xs.qs[4 * ib + l] = static_cast<std::uint16_t>(i9 | (t7 << 9));
      // IQ2_S: low index byte in qs, 2 high bits at bit 2 l of qh[ib], a full sign byte.
      unsigned const i10 = rng.next(1024), s8 = rng.next(256);
      s.qs[4 * ib + l] = static_cast<std::uint8_t>(i10 & 0xFF);
      s.qh[ib] = static_cast<std::uint8_t>(s.qh[ib] | ((i10 >> 8) << (2 * l)));
      s.qs[32 + 4 * ib + l] = static_cast<std::uint8_t>(s8);
      float const db_xxs = d * (0.5f + static_cast<float>(sc)) * 0.25f;
      float const db_16 = d * (0.5f + static_cast<float>(l < 2 ? sc_lo : sc_hi)) * 0.25f;
      for (int j = 0; j < 8; ++j) {
        int const w = 32 * ib + 8 * l + j;
        float const m1 = static_cast<float>(entry_byte(quant::kIq2xxsGrid[i8], j));
        float const m2 = static_cast<float>(entry_byte(quant::kIq2xsGrid[i9], j));
        float const m3 = static_cast<float>(entry_byte(quant::kIq2sGrid[i10], j));
        want_xxs[w] = (negated(s7, j) ? -1.f : 1.f) * db_xxs * m1;
        want_xs[w] = (negated(t7, j) ? -1.f : 1.f) * db_16 * m2;
        want_s[w] = (((s8 >> j) & 1u) != 0 ? -1.f : 1.f) * db_16 * m3;
      }
    }
  }
  float y[256];
  quant::dequantize_row_iq2_xxs(&xxs, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq2_xxs weight " << w);
    CHECK(y[w] == want_xxs[w]);
  }
  // Group 0 of IQ2_XXS by hand: grid point 0 (all 8s), scale s: 0.5 (0.5 + s) / 4 * 8 = 0.5 + s.
  unsigned const s0 = xxs.qs[3] >> 12;
  CHECK(std::fabs(y[0]) == 0.5f + static_cast<float>(s0));
  quant::dequantize_row_iq2_xs(&xs, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq2_xs weight " << w);
    CHECK(y[w] == want_xs[w]);
  }
  quant::dequantize_row_iq2_s(&s, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq2_s weight " << w);
    CHECK(y[w] == want_s[w]);
  }
}

TEST_CASE("ggml IQ blocks: IQ3_XXS and IQ3_S decode hand-built blocks", "[quant]") {
  // Each 8-group is two 4-magnitude grid points. IQ3_XXS: 8-bit indices, per 32 a word of 4 x 7
  // sign bits and a 4-bit scale s on top, weight d (0.5 + s) / 2 * magnitude; IQ3_S: 9-bit
  // indices (9th bits 2 l, 2 l + 1 of qh[ib]), sign bytes, 4-bit scales per 32 (two a byte),
  // weight d (1 + 2 s) * magnitude.
  float const d = 0.25f;
  float want_xxs[256], want_s[256];
  quant::BlockIQ3_XXS xxs;
  quant::BlockIQ3_S s;
  std::memset(&xxs, 0, sizeof xxs);
  std::memset(&s, 0, sizeof s);
  xxs.d = s.d = 0x3400;
  Lcg rng{29};
  for (int ib = 0; ib < 8; ++ib) {
    unsigned const sc = rng.next(16), sc3 = rng.next(16);
    std::uint32_t word = sc << 28;
    s.scales[ib / 2] = static_cast<std::uint8_t>(s.scales[ib / 2] | (sc3 << (4 * (ib % 2))));
    for (int l = 0; l < 4; ++l) {
      unsigned const a = rng.next(256), b = rng.next(256), s7 = rng.next(128);
      xxs.qs[8 * ib + 2 * l] = static_cast<std::uint8_t>(a);
      xxs.qs[8 * ib + 2 * l + 1] = static_cast<std::uint8_t>(b);
      word |= s7 << (7 * l);
      unsigned const a9 = rng.next(512), b9 = rng.next(512), s8 = rng.next(256);
      s.qs[8 * ib + 2 * l] = static_cast<std::uint8_t>(a9 & 0xFF);
      s.qs[8 * ib + 2 * l + 1] = static_cast<std::uint8_t>(b9 & 0xFF);
      s.qh[ib] =
          static_cast<std::uint8_t>(s.qh[ib] | ((a9 >> 8) << (2 * l)) | ((b9 >> 8) << (2 * l + 1)));
      s.signs[4 * ib + l] = static_cast<std::uint8_t>(s8);
      float const db = d * (0.5f + static_cast<float>(sc)) * 0.5f;
      float const db3 = d * static_cast<float>(1 + 2 * sc3);
      for (int j = 0; j < 8; ++j) {
        int const w = 32 * ib + 8 * l + j;
        float const m = static_cast<float>(entry_byte(quant::kIq3xxsGrid[j < 4 ? a : b], j % 4));
        float const m3 = static_cast<float>(entry_byte(quant::kIq3sGrid[j < 4 ? a9 : b9], j % 4));
        want_xxs[w] = (negated(s7, j) ? -1.f : 1.f) * db * m;
        want_s[w] = (((s8 >> j) & 1u) != 0 ? -1.f : 1.f) * db3 * m3;
      }
    }
    for (int k = 0; k < 4; ++k)
      xxs.qs[64 + 4 * ib + k] = static_cast<std::uint8_t>(word >> (8 * k));
  }
  float y[256];
  quant::dequantize_row_iq3_xxs(&xxs, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq3_xxs weight " << w);
    CHECK(y[w] == want_xxs[w]);
  }
  quant::dequantize_row_iq3_s(&s, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq3_s weight " << w);
    CHECK(y[w] == want_s[w]);
  }
}

TEST_CASE("ggml IQ blocks: IQ1_S and IQ1_M decode hand-built blocks", "[quant]") {
  // Grid values g in {-1, 0, 1}, 11-bit indices; weight = d (2 s + 1) (g + delta), delta
  // +-1/8. IQ1_S: per 32, qh[ib] holds 4 x 3 high index bits, s (bits 12..14) and delta's sign
  // (bit 15). IQ1_M: per 8-group a nibble of qh (3 high index bits, delta's sign), 3-bit scales
  // per 16 (4 in each 16-bit scale word), and d's fp16 bits in the words' top nibbles.
  float want_s[256], want_m[256];
  quant::BlockIQ1_S s;
  quant::BlockIQ1_M m;
  std::memset(&s, 0, sizeof s);
  std::memset(&m, 0, sizeof m);
  s.d = 0x3800;  // 0.5
  // IQ1_M's d = 0.75 = fp16 0x3A00: nibbles 0x0, 0x0, 0xA, 0x3 on top of words 0..3.
  std::uint16_t words[4] = {0x0000, 0x0000, 0xA000, 0x3000};
  Lcg rng{41};
  for (int ib = 0; ib < 8; ++ib) {
    unsigned const sc = rng.next(8), neg = rng.next(2);
    unsigned const sc1 = rng.next(8), sc2 = rng.next(8);
    s.qh[ib] = static_cast<std::uint16_t>((sc << 12) | (neg << 15));
    words[ib / 2] = static_cast<std::uint16_t>(words[ib / 2] | (sc1 << (6 * (ib % 2))) |
                                               (sc2 << (6 * (ib % 2) + 3)));
    for (int l = 0; l < 4; ++l) {
      unsigned const i11 = rng.next(2048), j11 = rng.next(2048), neg_m = rng.next(2);
      s.qs[4 * ib + l] = static_cast<std::uint8_t>(i11 & 0xFF);
      s.qh[ib] = static_cast<std::uint16_t>(s.qh[ib] | ((i11 >> 8) << (3 * l)));
      m.qs[4 * ib + l] = static_cast<std::uint8_t>(j11 & 0xFF);
      std::uint8_t& qh = m.qh[2 * ib + l / 2];
      qh = static_cast<std::uint8_t>(qh | (((j11 >> 8) | (neg_m << 3)) << (4 * (l % 2))));
      float const dl = 0.5f * static_cast<float>(2 * sc + 1);
      float const dlm = 0.75f * static_cast<float>(2 * (l < 2 ? sc1 : sc2) + 1);
      float const delta = neg != 0 ? -0.125f : 0.125f, delta_m = neg_m != 0 ? -0.125f : 0.125f;
      for (int j = 0; j < 8; ++j) {
        int const w = 32 * ib + 8 * l + j;
        auto const g = static_cast<std::int8_t>(entry_byte(quant::kIq1sGrid[i11], j));
        auto const gm = static_cast<std::int8_t>(entry_byte(quant::kIq1sGrid[j11], j));
        want_s[w] = dl * (static_cast<float>(g) + delta);
        want_m[w] = dlm * (static_cast<float>(gm) + delta_m);
      }
    }
  }
  for (int k = 0; k < 4; ++k) {
    m.scales[2 * k] = static_cast<std::uint8_t>(words[k] & 0xFF);
    m.scales[2 * k + 1] = static_cast<std::uint8_t>(words[k] >> 8);
  }
  CHECK(quant::iq1m_scale_bits(m) == 0x3A00);
  float y[256];
  quant::dequantize_row_iq1_s(&s, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq1_s weight " << w);
    CHECK(y[w] == want_s[w]);
  }
  quant::dequantize_row_iq1_m(&m, y, 256);
  for (int w = 0; w < 256; ++w) {
    INFO("iq1_m weight " << w);
    CHECK(y[w] == want_m[w]);
  }
}

TEST_CASE("ggml IQ blocks: rows are whole blocks", "[quant]") {
  quant::BlockIQ2_XXS b[2] = {};
  std::vector<float> y(512);
  quant::dequantize_row_iq2_xxs(b, y.data(), 512);
  for (float v : y) CHECK(v == 0.0f);
  CHECK_THROWS_WITH(quant::dequantize_row_iq3_s(nullptr, y.data(), 128),
                    Catch::Contains("128 weights cannot be iq3_s"));
}
