// SPDX-License-Identifier: Apache-2.0
// quant::ggml_dequantize: every GGUF tensor type moe reads decodes through one entry point, as
// the format's own decoder does and close to the weights that were quantized.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "moe/io/block_tensor.hpp"
#include "moe/io/gguf.hpp"
#include "moe/kernels/quant_gemm.hpp"
#include "moe/layers/linear.hpp"
#include "moe/quant/ggml_dequantize.hpp"

namespace {

using Catch::Contains;
using moe::Index;
using moe::quant::GgmlType;
namespace kernels = moe::kernels;

template <class T>
std::vector<std::byte> as_bytes(std::vector<T> const& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<float> decode(moe::io::GgufTensorInfo const& t) {
  std::vector<float> out(static_cast<std::size_t>(t.num_elements()));
  moe::quant::ggml_dequantize(t.type, t.data, t.num_elements(), out.data());
  return out;
}

}  // namespace

TEST_CASE("ggml_dequantize decodes every quantized type of a GGUF file", "[gguf][quant]") {
  constexpr Index kRows = 3, kCols = 512;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(kRows * kCols));
  for (float& v : x) v = dist(rng);

  // Quantize x with each format's own reference quantizer; `bound` is a loose max |error| for
  // weights in [-1, 1] (decoding a tensor as another format would be far off).
  struct Case {
    GgmlType type;
    float bound;
    std::vector<std::byte> bytes;
    std::vector<float> direct;  // the format's own dequantizer on the same bytes
  };
  std::vector<Case> cases;
  auto add = [&]<class Block>(GgmlType type, float bound, auto quantize, auto dequantize) {
    std::vector<Block> blocks(x.size() / moe::quant::block_elems_v<Block>);
    quantize(x.data(), blocks.data(), static_cast<Index>(x.size()));
    std::vector<float> direct(x.size());
    dequantize(blocks.data(), direct.data(), static_cast<Index>(x.size()));
    cases.push_back({type, bound, as_bytes(blocks), std::move(direct)});
  };
  using namespace moe::quant;
  add.operator()<BlockQ4_1>(GgmlType::kQ4_1, 0.15f, quantize_row_q4_1_ref, dequantize_row_q4_1);
  add.operator()<BlockQ5_0>(GgmlType::kQ5_0, 0.08f, quantize_row_q5_0_ref, dequantize_row_q5_0);
  add.operator()<BlockQ5_1>(GgmlType::kQ5_1, 0.08f, quantize_row_q5_1_ref, dequantize_row_q5_1);
  add.operator()<BlockQ5_K>(GgmlType::kQ5_K, 0.08f, quantize_row_q5_k_ref, dequantize_row_q5_k);
  add.operator()<BlockIQ4_NL>(GgmlType::kIQ4_NL, 0.15f, quantize_row_iq4_nl_ref,
                              dequantize_row_iq4_nl);
  add.operator()<BlockIQ4_XS>(GgmlType::kIQ4_XS, 0.15f, quantize_row_iq4_xs_ref,
                              dequantize_row_iq4_xs);
  add.operator()<BlockMXFP4>(GgmlType::kMXFP4, 0.3f, quantize_row_mxfp4_ref, dequantize_row_mxfp4);
  // The formats without typed entry points above, through quant::quantize_row / dequantize_row.
  for (Format const f :
       {Format::kQ8_0, Format::kQ6_K, Format::kQ4_K, Format::kQ4_0, Format::kQ3_K, Format::kQ2_K}) {
    GgmlType const type = f == Format::kQ8_0   ? GgmlType::kQ8_0
                          : f == Format::kQ6_K ? GgmlType::kQ6_K
                          : f == Format::kQ4_K ? GgmlType::kQ4_K
                          : f == Format::kQ4_0 ? GgmlType::kQ4_0
                          : f == Format::kQ3_K ? GgmlType::kQ3_K
                                               : GgmlType::kQ2_K;
    std::vector<std::byte> bytes(static_cast<std::size_t>(kRows * row_bytes(f, kCols)));
    quantize_row(f, x.data(), static_cast<Index>(x.size()), bytes.data());
    std::vector<float> direct(x.size());
    dequantize_row(f, bytes.data(), static_cast<Index>(x.size()), direct.data());
    cases.push_back({type, f == Format::kQ2_K ? 0.4f : 0.25f, std::move(bytes), direct});
  }

  moe::io::GgufWriter w;
  for (Case const& c : cases) {
    w.add_tensor(std::string(ggml_type_name(c.type)), c.type, {kCols, kRows}, c.bytes);
  }
  moe::io::GgufFile const f(w.serialize());
  for (Case const& c : cases) {
    INFO(ggml_type_name(c.type));
    std::vector<float> const y = decode(f.tensor(ggml_type_name(c.type)));
    REQUIRE(std::memcmp(y.data(), c.direct.data(), y.size() * sizeof(float)) == 0);
    float worst = 0.0f;
    for (std::size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::fabs(y[i] - x[i]));
    CHECK(worst < c.bound);
  }
}

TEST_CASE("ggml_dequantize decodes the codebook types as their own decoders do", "[gguf][quant]") {
  using namespace moe::quant;
  std::mt19937 rng(11);
  auto check = [&]<class Block>(GgmlType type, auto dequantize) {
    INFO(ggml_type_name(type));
    std::vector<Block> blocks(4);
    auto* raw = reinterpret_cast<unsigned char*>(blocks.data());
    for (std::size_t i = 0; i < sizeof(Block) * blocks.size(); ++i) raw[i] = rng() & 0xFFu;
    for (Block& b : blocks) b.d = 0x3800;  // a finite fp16 scale (0.5)
    Index const n = static_cast<Index>(blocks.size()) * block_elems_v<Block>;
    std::vector<float> direct(static_cast<std::size_t>(n)), y(direct.size());
    dequantize(blocks.data(), direct.data(), n);
    ggml_dequantize(type, std::as_bytes(std::span(blocks)), n, y.data());
    REQUIRE(std::memcmp(y.data(), direct.data(), y.size() * sizeof(float)) == 0);
  };
  check.operator()<BlockIQ2_XXS>(GgmlType::kIQ2_XXS, dequantize_row_iq2_xxs);
  check.operator()<BlockIQ2_XS>(GgmlType::kIQ2_XS, dequantize_row_iq2_xs);
  check.operator()<BlockIQ2_S>(GgmlType::kIQ2_S, dequantize_row_iq2_s);
  check.operator()<BlockIQ3_XXS>(GgmlType::kIQ3_XXS, dequantize_row_iq3_xxs);
  check.operator()<BlockIQ3_S>(GgmlType::kIQ3_S, dequantize_row_iq3_s);
  check.operator()<BlockIQ1_S>(GgmlType::kIQ1_S, dequantize_row_iq1_s);
}

TEST_CASE("ggml_dequantize converts the plain types exactly and refuses what it cannot read",
          "[gguf][quant]") {
  using moe::quant::ggml_dequantize;
  float y[4];
  std::vector<float> const f32 = {1.5f, -2.0f, 0.0f, 3.25f};
  ggml_dequantize(GgmlType::kF32, std::as_bytes(std::span(f32)), 4, y);
  CHECK(std::vector<float>(y, y + 4) == f32);
  std::vector<std::uint16_t> const f16 = {0x3C00, 0xC000, 0x3800, 0x7C00};  // 1, -2, 0.5, inf
  ggml_dequantize(GgmlType::kF16, std::as_bytes(std::span(f16)), 4, y);
  CHECK(y[0] == 1.0f);
  CHECK(y[1] == -2.0f);
  CHECK(y[2] == 0.5f);
  CHECK(std::isinf(y[3]));
  std::vector<std::uint16_t> const bf16 = {0x3F80, 0xBFC0, 0x0000, 0x4049};  // 1, -1.5, 0, 3.140625
  ggml_dequantize(GgmlType::kBF16, std::as_bytes(std::span(bf16)), 4, y);
  CHECK(std::vector<float>(y, y + 4) == std::vector<float>{1.0f, -1.5f, 0.0f, 3.140625f});
  std::vector<double> const f64 = {0.25, -1e300, 1e300, -3.0};
  ggml_dequantize(GgmlType::kF64, std::as_bytes(std::span(f64)), 4, y);
  CHECK(y[0] == 0.25f);
  CHECK((std::isinf(y[1]) && y[1] < 0));
  CHECK((std::isinf(y[2]) && y[2] > 0));
  CHECK(y[3] == -3.0f);
  std::vector<std::int32_t> const i32 = {7, -8, 1 << 20, 0};
  ggml_dequantize(GgmlType::kI32, std::as_bytes(std::span(i32)), 4, y);
  CHECK(std::vector<float>(y, y + 4) == std::vector<float>{7.0f, -8.0f, 1048576.0f, 0.0f});

  std::vector<std::byte> const q8k(292);
  REQUIRE_THROWS_WITH(ggml_dequantize(GgmlType::kQ8_K, q8k, 256, y),
                      Contains("Q8_K") && Contains("cannot be read"));
  std::vector<std::byte> const q8(33);  // one byte short of a Q8_0 block
  REQUIRE_THROWS_WITH(ggml_dequantize(GgmlType::kQ8_0, q8, 32, y),
                      Contains("take 34 bytes") && Contains("33"));
  REQUIRE_THROWS_WITH(ggml_dequantize(GgmlType::kQ4_K, std::span<std::byte const>(), 100, y),
                      Contains("whole 256-element blocks"));
  REQUIRE_THROWS_WITH(ggml_dequantize(static_cast<GgmlType>(4), q8, 32, y),
                      Contains("unknown ggml type 4"));
}

TEST_CASE("GGUF tensors of the block types moe has kernels for run as stored", "[gguf][quant]") {
  // A GGUF file with a [N, K] tensor of each type: native_format names the kernel format, the
  // Linear made from the file's bytes packs them as they are (pack_quant_panels of the mapped
  // blocks, no conversion), and its product is the dequantized weights' (ggml's decoder) times
  // the int8 activations, to fp32 rounding.
  using moe::experts::WeightFormat;
  constexpr Index N = 37, K = 512, T = 3;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(N * K)), x(static_cast<std::size_t>(T * K));
  for (float& v : w) v = dist(rng);
  for (float& v : x) v = dist(rng);
  std::vector<std::pair<GgmlType, WeightFormat>> const types = {
      {GgmlType::kQ5_0, WeightFormat::kQ5_0},     {GgmlType::kQ4_1, WeightFormat::kQ4_1},
      {GgmlType::kQ5_1, WeightFormat::kQ5_1},     {GgmlType::kIQ4_NL, WeightFormat::kIQ4_NL},
      {GgmlType::kIQ4_XS, WeightFormat::kIQ4_XS}, {GgmlType::kMXFP4, WeightFormat::kMXFP4}};
  moe::io::GgufWriter writer;
  for (auto const& [type, format] : types) {
    moe::quant::Format const qf = moe::experts::quant_format(format);
    std::vector<std::byte> bytes(static_cast<std::size_t>(N * moe::quant::row_bytes(qf, K)));
    moe::quant::quantize_row(qf, w.data(), N * K, bytes.data());
    writer.add_tensor(std::string(moe::quant::ggml_type_name(type)), type, {K, N}, bytes);
  }
  moe::io::GgufFile const file(writer.serialize());
  for (auto const& [type, format] : types) {
    INFO(moe::quant::ggml_type_name(type));
    moe::io::GgufTensorInfo const& info = file.tensor(moe::quant::ggml_type_name(type));
    moe::io::BlockTensor const t{info.type, N, K, info.data};
    REQUIRE(t.native() == format);
    REQUIRE(moe::experts::load_format(type) == format);
    moe::Linear const lin = moe::Linear::from_blocks(format, info.data.data(), N, K);
    REQUIRE(lin.format() == format);
    kernels::QuantWeights const& pack = lin.panels().quant[0];
    std::vector<std::byte> want(static_cast<std::size_t>((N + 31) / 32 * pack.panel_bytes));
    kernels::pack_quant_panels(pack.format, info.data.data(), N, K, want.data());
    REQUIRE(std::memcmp(pack.data, want.data(), want.size()) == 0);
    // y = x W^T through the projection queue.
    std::vector<float> y(static_cast<std::size_t>(T * N));
    moe::stages::ProjectionQueue q;
    moe::LinearInput in;
    q.add(moe::linear_job(lin, in.prepare({x.data(), T, K}, true, nullptr), T, y.data(), N));
    q.run<moe::experts::SwiGlu, moe::experts::SwiGlu>(nullptr);
    std::vector<float> const deq = t.dequantize();
    Index const rb = kernels::q8_row_bytes(K);
    std::vector<std::byte, xsimd::aligned_allocator<std::byte, 64>> q8(
        static_cast<std::size_t>(T * rb));
    kernels::quantize_rows_q8({x.data(), K}, T, K, q8.data(), rb);
    for (Index i = 0; i < T; ++i) {
      kernels::Q8Row const r = kernels::q8_row(q8.data() + i * rb, K);
      for (Index n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (Index k = 0; k < K; ++k) {
          double const p =
              static_cast<double>(r.a[k]) * r.d[k / 32] * deq[static_cast<std::size_t>(n * K + k)];
          ref += p;
          mag += std::fabs(p);
        }
        REQUIRE(std::fabs(y[static_cast<std::size_t>(i * N + n)] - ref) <= 1e-5 * mag + 1e-6);
      }
    }
  }
}
