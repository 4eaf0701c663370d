// SPDX-License-Identifier: Apache-2.0
// F16 / BF16 / F8 <-> float conversions against hand-computed bit patterns.
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moe/io/safetensors/convert.hpp"
#include "moe/io/safetensors/tensor_view.hpp"

namespace {

using moe::io::bf16_to_float;
using moe::io::f16_to_float;
using moe::io::float_to_bf16;
using moe::io::float_to_f16;

float from_bits(std::uint32_t b) { return std::bit_cast<float>(b); }
std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }

}  // namespace

TEST_CASE("f16_to_float decodes normals, subnormals, zeros, inf and NaN exactly", "[io][convert]") {
  CHECK(bits(f16_to_float(0x0000)) == 0x00000000u);  // +0
  CHECK(bits(f16_to_float(0x8000)) == 0x80000000u);  // -0
  CHECK(f16_to_float(0x3C00) == 1.0f);
  CHECK(f16_to_float(0xC000) == -2.0f);
  CHECK(f16_to_float(0x3555) == 0.333251953125f);
  CHECK(f16_to_float(0x7BFF) == 65504.0f);                  // largest finite
  CHECK(f16_to_float(0x0400) == std::ldexp(1.0f, -14));     // smallest normal
  CHECK(f16_to_float(0x0001) == std::ldexp(1.0f, -24));     // smallest subnormal
  CHECK(f16_to_float(0x03FF) == std::ldexp(1023.0f, -24));  // largest subnormal
  CHECK(f16_to_float(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(bits(f16_to_float(0x7C00)) == 0x7F800000u);  // +inf
  CHECK(bits(f16_to_float(0xFC00)) == 0xFF800000u);  // -inf
  CHECK(bits(f16_to_float(0x7E00)) == 0x7FC00000u);  // quiet NaN, payload kept
  CHECK(bits(f16_to_float(0xFE01)) == 0xFFC02000u);  // negative NaN with payload
  CHECK(std::isnan(f16_to_float(0x7C01)));           // signalling NaN stays a NaN
}

TEST_CASE("float_to_f16 rounds to nearest even, with subnormals, overflow and NaN",
          "[io][convert]") {
  CHECK(float_to_f16(0.0f) == 0x0000);
  CHECK(float_to_f16(-0.0f) == 0x8000);
  CHECK(float_to_f16(1.0f) == 0x3C00);
  CHECK(float_to_f16(-2.0f) == 0xC000);
  CHECK(float_to_f16(65504.0f) == 0x7BFF);
  // Ties at the 10-bit mantissa: 1 + 2^-11 lies halfway between 0x3C00 and 0x3C01.
  CHECK(float_to_f16(from_bits(0x3F801000u)) == 0x3C00);  // tie, to even (down)
  CHECK(float_to_f16(from_bits(0x3F803000u)) == 0x3C02);  // tie, to even (up)
  CHECK(float_to_f16(from_bits(0x3F801001u)) == 0x3C01);  // just above the tie
  CHECK(float_to_f16(from_bits(0x3F800FFFu)) == 0x3C00);  // just below the tie
  // Overflow: 65520 is the tie between 65504 and 65536 (inf): to even, inf.
  CHECK(float_to_f16(65519.996f) == 0x7BFF);
  CHECK(float_to_f16(65520.0f) == 0x7C00);
  CHECK(float_to_f16(-1e9f) == 0xFC00);
  CHECK(float_to_f16(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(float_to_f16(-std::numeric_limits<float>::infinity()) == 0xFC00);
  // Subnormal results.
  CHECK(float_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(float_to_f16(std::ldexp(1.0f, -25)) == 0x0000);                       // tie, to even 0
  CHECK(float_to_f16(from_bits(bits(std::ldexp(1.0f, -25)) + 1)) == 0x0001);  // above the tie
  CHECK(float_to_f16(std::ldexp(3.0f, -25)) == 0x0002);                       // 1.5 ulp: to even 2
  CHECK(float_to_f16(std::ldexp(5.0f, -25)) == 0x0002);                       // 2.5 ulp: to even 2
  CHECK(float_to_f16(std::ldexp(1023.0f, -24)) == 0x03FF);
  CHECK(float_to_f16(std::ldexp(2047.0f, -25)) == 0x0400);  // 1023.5 ulp: carries to normal
  CHECK(float_to_f16(-std::ldexp(1.0f, -24)) == 0x8001);
  CHECK(float_to_f16(1e-10f) == 0x0000);
  CHECK(float_to_f16(-1e-10f) == 0x8000);
  CHECK(float_to_f16(std::numeric_limits<float>::denorm_min()) == 0x0000);
  // NaN stays NaN (quiet), with its sign.
  CHECK(float_to_f16(std::numeric_limits<float>::quiet_NaN()) == 0x7E00);
  CHECK(float_to_f16(from_bits(0xFFC00000u)) == 0xFE00);
  CHECK(float_to_f16(from_bits(0x7F800001u)) == 0x7E00);  // signalling NaN: quieted, not inf
}

TEST_CASE("every finite and infinite f16 survives f16 -> float -> f16", "[io][convert]") {
  for (std::uint32_t h = 0; h <= 0xFFFF; ++h) {
    auto const half = static_cast<std::uint16_t>(h);
    bool const is_nan = (half & 0x7C00) == 0x7C00 && (half & 0x3FF) != 0;
    if (is_nan) {
      REQUIRE(std::isnan(f16_to_float(half)));
      REQUIRE((float_to_f16(f16_to_float(half)) & 0x7E00) == 0x7E00);
    } else {
      REQUIRE(float_to_f16(f16_to_float(half)) == half);
    }
  }
}

TEST_CASE("bf16 is the upper half of a float, rounded to nearest even", "[io][convert]") {
  CHECK(bf16_to_float(0x3F80) == 1.0f);
  CHECK(bf16_to_float(0xC040) == -3.0f);
  CHECK(bits(bf16_to_float(0x8000)) == 0x80000000u);
  CHECK(bits(bf16_to_float(0x7F80)) == 0x7F800000u);
  CHECK(bits(bf16_to_float(0xFF80)) == 0xFF800000u);
  CHECK(bf16_to_float(0x0001) == std::ldexp(1.0f, -133));  // smallest subnormal
  CHECK(std::isnan(bf16_to_float(0x7FC0)));

  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(-3.0f) == 0xC040);
  CHECK(float_to_bf16(from_bits(0x3F808000u)) == 0x3F80);             // tie, to even (down)
  CHECK(float_to_bf16(from_bits(0x3F818000u)) == 0x3F82);             // tie, to even (up)
  CHECK(float_to_bf16(from_bits(0x3F808001u)) == 0x3F81);             // above the tie
  CHECK(float_to_bf16(from_bits(0x3F807FFFu)) == 0x3F80);             // below the tie
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // rounds up to inf
  CHECK(float_to_bf16(from_bits(0x7F7F7FFFu)) == 0x7F7F);             // largest that stays
  CHECK(float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(float_to_bf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(float_to_bf16(from_bits(0x00008000u)) == 0x0000);  // subnormal tie, to even 0
  CHECK(float_to_bf16(from_bits(0x00018000u)) == 0x0002);  // subnormal tie, to even 2
  CHECK(float_to_bf16(from_bits(0x80000001u)) == 0x8000);
  CHECK(float_to_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FC0);
  CHECK(float_to_bf16(from_bits(0xFFC00000u)) == 0xFFC0);
  CHECK(float_to_bf16(from_bits(0x7F800001u)) == 0x7FC0);  // signalling NaN: quieted, not inf
  CHECK(float_to_bf16(from_bits(0x7FFFFFFFu)) == 0x7FFF);  // no carry out of a NaN

  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    auto const v = static_cast<std::uint16_t>(b);
    bool const is_nan = (v & 0x7F80) == 0x7F80 && (v & 0x7F) != 0;
    if (!is_nan) REQUIRE(float_to_bf16(bf16_to_float(v)) == v);
  }
}

TEST_CASE("F8 formats decode exactly, with their own NaN and inf rules", "[io][convert]") {
  using namespace moe::io;
  // E4M3 (fn): bias 7, no inf, S.1111.111 is NaN.
  CHECK(f8_e4m3_to_float(0x38) == 1.0f);
  CHECK(f8_e4m3_to_float(0xB8) == -1.0f);
  CHECK(f8_e4m3_to_float(0x7E) == 448.0f);
  CHECK(f8_e4m3_to_float(0x78) == 256.0f);  // exponent 15 is finite in the fn variant
  CHECK(f8_e4m3_to_float(0x08) == std::ldexp(1.0f, -6));
  CHECK(f8_e4m3_to_float(0x01) == std::ldexp(1.0f, -9));
  CHECK(bits(f8_e4m3_to_float(0x80)) == 0x80000000u);
  CHECK(std::isnan(f8_e4m3_to_float(0x7F)));
  CHECK(std::isnan(f8_e4m3_to_float(0xFF)));
  // E5M2: the upper byte of a binary16.
  CHECK(f8_e5m2_to_float(0x3C) == 1.0f);
  CHECK(f8_e5m2_to_float(0x7B) == 57344.0f);
  CHECK(f8_e5m2_to_float(0x01) == std::ldexp(1.0f, -16));
  CHECK(std::isinf(f8_e5m2_to_float(0x7C)));
  CHECK(f8_e5m2_to_float(0xFC) < 0.0f);
  CHECK(std::isnan(f8_e5m2_to_float(0x7D)));
  // E8M0: 2^(v - 127), 0xFF NaN.
  CHECK(f8_e8m0_to_float(127) == 1.0f);
  CHECK(f8_e8m0_to_float(0) == std::ldexp(1.0f, -127));
  CHECK(f8_e8m0_to_float(254) == std::ldexp(1.0f, 127));
  CHECK(std::isnan(f8_e8m0_to_float(255)));
  // FNUZ variants: bias 8 / 16, 0x80 is the only NaN, no -0, no inf.
  CHECK(f8_e4m3fnuz_to_float(0x40) == 1.0f);
  CHECK(f8_e4m3fnuz_to_float(0x7F) == 240.0f);
  CHECK(f8_e4m3fnuz_to_float(0x01) == std::ldexp(1.0f, -10));
  CHECK(std::isnan(f8_e4m3fnuz_to_float(0x80)));
  CHECK(f8_e5m2fnuz_to_float(0x40) == 1.0f);
  CHECK(f8_e5m2fnuz_to_float(0x7F) == 57344.0f);
  CHECK(f8_e5m2fnuz_to_float(0x01) == std::ldexp(1.0f, -17));
  CHECK(std::isnan(f8_e5m2fnuz_to_float(0x80)));
}

TEST_CASE("from_float and to_float are inverse for F32, F64, and exact for F16/BF16 values",
          "[io][convert]") {
  using namespace moe::io;
  std::vector<float> const values = {0.0f,     -0.0f,
                                     1.0f,     -2.5f,
                                     65504.0f, std::ldexp(1.0f, -24),
                                     0.25f,    3.0f,
                                     -1024.0f, std::numeric_limits<float>::infinity()};
  for (Dtype const dtype : {Dtype::kF32, Dtype::kF64, Dtype::kF16, Dtype::kBf16}) {
    INFO(dtype_name(dtype));
    std::vector<std::byte> const encoded = from_float(values, dtype);
    REQUIRE(encoded.size() == values.size() * dtype_bits(dtype) / 8);
    TensorView const view{"t", dtype, {static_cast<std::int64_t>(values.size())}, encoded};
    std::vector<float> const decoded = to_float(view);
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (dtype == Dtype::kBf16 && i == 4) continue;  // 65504 is not a bf16 value
      CHECK(bits(decoded[i]) == bits(values[i]));
    }
  }
  // BF16 rounding goes through from_float too.
  std::vector<std::byte> const b =
      from_float(std::vector<float>{from_bits(0x3F818000u)}, Dtype::kBf16);
  CHECK(std::to_integer<int>(b[0]) == 0x82);
  CHECK(std::to_integer<int>(b[1]) == 0x3F);
  CHECK_THROWS_WITH(from_float(values, Dtype::kI32),
                    Catch::Contains("cannot encode floats as I32"));
}

TEST_CASE("to_float passes NaN and inf through as stored", "[io][convert]") {
  using namespace moe::io;
  std::vector<float> const special = {std::numeric_limits<float>::quiet_NaN(),
                                      std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity()};
  for (Dtype const dtype : {Dtype::kF32, Dtype::kF16, Dtype::kBf16, Dtype::kF64}) {
    std::vector<std::byte> const encoded = from_float(special, dtype);
    std::vector<float> const decoded = to_float(TensorView{"s", dtype, {3}, encoded});
    CHECK(std::isnan(decoded[0]));
    CHECK(decoded[1] == std::numeric_limits<float>::infinity());
    CHECK(decoded[2] == -std::numeric_limits<float>::infinity());
  }
}

TEST_CASE("to_float checks the view and the output size", "[io][convert]") {
  using namespace moe::io;
  std::vector<std::byte> const bytes(12);
  std::vector<float> out(3);
  CHECK_THROWS_WITH(to_float(TensorView{"w", Dtype::kF32, {2, 2}, bytes}, out),
                    Catch::Contains("tensor 'w': holds 12 bytes but F32 [2, 2] needs 16"));
  CHECK_THROWS_WITH(to_float(TensorView{"w", Dtype::kF16, {3, 2}, bytes}, out),
                    Catch::Contains("has 6 elements but the output span holds 3"));
  CHECK_THROWS_WITH(to_float(TensorView{"c", Dtype::kC64, {1}, std::span(bytes).first(8)}, out),
                    Catch::Contains("C64, which has no conversion to float"));
  CHECK_THROWS_WITH(to_float(TensorView{"n", Dtype::kU8, {-1}, bytes}, out),
                    Catch::Contains("negative dimension"));
}
