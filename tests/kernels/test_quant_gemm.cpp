// SPDX-License-Identifier: Apache-2.0
// kernels::quant_cols (quantized expert weights, int8 activations) against a double reference
// built from ggml's dequantized weights and the dequantized activations; the portable, the
// AVX512-VNNI and the AVX-VNNI kernels give the same bits. Built three times: -march=native,
// without -m flags (portable) and -march=x86-64-v3 -mavxvnni (the ymm kernel).
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "moe/kernels/expert_gemm.hpp"
#include "moe/quant/blocks.hpp"
#include "moe/quant/matrix.hpp"
#include "support/helpers.hpp"

using moe::Index;
namespace kernels = moe::kernels;
namespace quant = moe::quant;

namespace {

template <class T>
using Aligned = std::vector<T, xsimd::aligned_allocator<T, 64>>;

struct QOperand {
  quant::QuantMatrix q;
  Aligned<std::byte> panels;
  std::vector<float> deq;  // [N, K]
  kernels::QuantWeights w;
  QOperand(quant::Format f, Index N, Index K, std::uint64_t seed) {
    std::vector<float> raw = test::random_vector(N * K, seed);
    q = quant::QuantMatrix::quantize({raw.data(), N, K}, f);
    deq.resize(raw.size());
    q.dequantize({deq.data(), N, K});
    Index const pb = kernels::quant_panel_bytes(f, K), np = (N + 31) / 32;
    panels.resize(static_cast<std::size_t>(np * pb));
    kernels::pack_quant_panels(f, q.bytes().data(), N, K, panels.data());
    w = {panels.data(), f, pb};
  }
};

/// Dequantized activations: a_k * da_b.
std::vector<double> deq_rows(std::vector<std::byte> const& q8, Index M, Index K) {
  Index const rb = kernels::q8_row_bytes(K);
  std::vector<double> out(static_cast<std::size_t>(M * K));
  for (Index i = 0; i < M; ++i) {
    auto const r = kernels::q8_row(q8.data() + i * rb, K);
    for (Index k = 0; k < K; ++k) {
      out[static_cast<std::size_t>(i * K + k)] = static_cast<double>(r.a[k]) * r.d[k / 32];
    }
  }
  return out;
}

/// The portable kernel's outputs for rows [0, M) of q8 (row stride q8_row_bytes(K)) against
/// Ops operands, panel p: out[i][o * 32 + c].
std::vector<std::array<float, 64>> portable_panel(quant::Format f, std::byte const* q8, Index M,
                                                  Index K, std::byte const* const* panels,
                                                  int ops) {
  std::vector<std::array<float, 64>> out(static_cast<std::size_t>(M));
  for (Index i0 = 0; i0 < M; i0 += 8) {
    Index const mr = std::min<Index>(8, M - i0);
    kernels::Q8Row rows[8];
    for (Index r = 0; r < mr; ++r)
      rows[r] = kernels::q8_row(q8 + (i0 + r) * kernels::q8_row_bytes(K), K);
    float o[8][64];
    auto run = [&]<quant::Format F>() {
      if (ops == 1) {
        kernels::detail::quant_tile_portable<F, 1>(rows, mr, K, panels, o);
      } else {
        kernels::detail::quant_tile_portable<F, 2>(rows, mr, K, panels, o);
      }
    };
    if (f == quant::Format::kQ8_0) run.operator()<quant::Format::kQ8_0>();
    if (f == quant::Format::kQ6_K) run.operator()<quant::Format::kQ6_K>();
    if (f == quant::Format::kQ5_K) run.operator()<quant::Format::kQ5_K>();
    if (f == quant::Format::kQ5_0) run.operator()<quant::Format::kQ5_0>();
    if (f == quant::Format::kQ4_1) run.operator()<quant::Format::kQ4_1>();
    if (f == quant::Format::kQ5_1) run.operator()<quant::Format::kQ5_1>();
    if (f == quant::Format::kIQ4_NL) run.operator()<quant::Format::kIQ4_NL>();
    if (f == quant::Format::kIQ4_XS) run.operator()<quant::Format::kIQ4_XS>();
    if (f == quant::Format::kMXFP4) run.operator()<quant::Format::kMXFP4>();
    if (f == quant::Format::kQ4_K) run.operator()<quant::Format::kQ4_K>();
    if (f == quant::Format::kQ4_0) run.operator()<quant::Format::kQ4_0>();
    if (f == quant::Format::kQ3_K) run.operator()<quant::Format::kQ3_K>();
    if (f == quant::Format::kQ2_K) run.operator()<quant::Format::kQ2_K>();
    for (Index r = 0; r < mr; ++r)
      std::copy(o[r], o[r] + 64, out[static_cast<std::size_t>(i0 + r)].begin());
  }
  return out;
}

std::vector<std::byte> quantize_acts(std::vector<float> const& x, Index M, Index K) {
  Index const rb = kernels::q8_row_bytes(K);
  Aligned<std::byte> buf(static_cast<std::size_t>(M * rb));
  kernels::quantize_rows_q8({x.data(), K}, M, K, buf.data(), rb);
  return {buf.begin(), buf.end()};
}

#if MOE_HAS_AVX2_INT8
/// The zmm width of the planar unpacker's byte operations, emulated on bytes (16-bit lanes for
/// the shifts, as vpsrlw / vpsllw), so that an AVX2 machine checks the unpacker's algorithm at
/// the width the AVX-512 kernels run it (the intrinsics of ByteOps<64> are one instruction each).
struct EmulatedZmm {
  std::array<std::uint8_t, 64> b{};
};
}  // namespace

template <>
struct moe::kernels::detail::ByteOps<64> {
  using V = EmulatedZmm;
  static V load(void const* p) {
    V v;
    std::memcpy(v.b.data(), p, 64);
    return v;
  }
  static V set1(int x) {
    V v;
    v.b.fill(static_cast<std::uint8_t>(x));
    return v;
  }
  template <class Op>
  static V bytes(V a, V c, Op op) {
    for (std::size_t i = 0; i < 64; ++i) a.b[i] = static_cast<std::uint8_t>(op(a.b[i], c.b[i]));
    return a;
  }
  static V and_(V a, V c) {
    return bytes(a, c, [](int x, int y) { return x & y; });
  }
  static V or_(V a, V c) {
    return bytes(a, c, [](int x, int y) { return x | y; });
  }
  template <class Op>
  static V lanes(V a, Op op) {
    for (std::size_t i = 0; i < 64; i += 2) {
      auto const x = static_cast<std::uint16_t>(op(a.b[i] | a.b[i + 1] << 8));
      a.b[i] = static_cast<std::uint8_t>(x & 0xFF);
      a.b[i + 1] = static_cast<std::uint8_t>(x >> 8);
    }
    return a;
  }
  static V srl(V a, int n) {
    return lanes(a, [n](unsigned x) { return x >> n; });
  }
  static V sll(V a, int n) {
    return lanes(a, [n](unsigned x) { return x << n; });
  }
};

namespace {
#endif

}  // namespace

#if MOE_HAS_AVX512VNNI || MOE_HAS_AVX2_INT8
TEST_CASE("quant kernels: the planar unpacker gives quant_level's levels at both vector widths",
          "[kernels][quant]") {
  for (quant::Format f : {quant::Format::kQ6_K, quant::Format::kQ3_K, quant::Format::kQ2_K}) {
    Index const K = 512, N = 32;
    QOperand op(f, N, K, 11);
    auto const* levels = reinterpret_cast<std::uint8_t const*>(op.panels.data());
    auto check = [&]<quant::Format F, int W>() {
      using O = kernels::detail::ByteOps<W>;
      for (Index g = 0; g < K / 256; ++g) {
        std::uint8_t const* w =
            levels + g * kernels::quant_group_bytes(F) + kernels::quant_header_bytes(F);
        for (Index sb = 0; sb < 16; ++sb) {
          std::uint8_t const* sub = w + sb * 64 * kernels::quant_level_bits(F);
          for (Index c0 = 0; c0 < 32; c0 += W / 4) {
            int next = 0;
            kernels::detail::planar_quads<F, W>(sub, c0, [&](int t, typename O::V u) {
              REQUIRE(t == next++);
              alignas(64) std::uint8_t got[W];
              std::memcpy(got, &u, W);
              for (Index c = c0; c < c0 + W / 4; ++c) {
                for (Index j = 0; j < 4; ++j) {
                  INFO(quant::name(F) << " W = " << W << " sb = " << sb << " c = " << c);
                  REQUIRE(got[(c - c0) * 4 + j] ==
                          kernels::quant_level(F, w, sb * 16 + 4 * t + j, c));
                }
              }
            });
            REQUIRE(next == 4);
          }
        }
      }
    };
    auto both = [&]<quant::Format F>() {
      check.operator()<F, 32>();
      check.operator()<F, 64>();
    };
    if (f == quant::Format::kQ6_K) both.operator()<quant::Format::kQ6_K>();
    if (f == quant::Format::kQ3_K) both.operator()<quant::Format::kQ3_K>();
    if (f == quant::Format::kQ2_K) both.operator()<quant::Format::kQ2_K>();
  }
}

TEST_CASE("quant kernels: the Q5_K unpacker gives quant_level's levels at both vector widths",
          "[kernels][quant]") {
  constexpr quant::Format F = quant::Format::kQ5_K;
  Index const K = 512, N = 32;
  // Uniform weights in [-1, 1): about half the levels have the fifth bit set.
  QOperand op(F, N, K, 12);
  auto const* levels = reinterpret_cast<std::uint8_t const*>(op.panels.data());
  int fifth = 0;
  auto check = [&]<int W>() {
    using O = kernels::detail::ByteOps<W>;
    for (Index g = 0; g < K / 256; ++g) {
      std::uint8_t const* w =
          levels + g * kernels::quant_group_bytes(F) + kernels::quant_header_bytes(F);
      for (Index sb = 0; sb < 8; ++sb) {
        for (Index c0 = 0; c0 < 32; c0 += W / 4) {
          int next = 0;
          kernels::detail::q5k_quads<W>(
              w + sb * kernels::kQ5kSubBytes, c0, [&](int t, typename O::V u) {
                REQUIRE(t == next++);
                alignas(64) std::uint8_t got[W];
                std::memcpy(got, &u, W);
                for (Index c = c0; c < c0 + W / 4; ++c) {
                  for (Index j = 0; j < 4; ++j) {
                    INFO("W = " << W << " sb = " << sb << " c = " << c << " t = " << t);
                    int const want = kernels::quant_level(F, w, sb * 32 + 4 * t + j, c);
                    REQUIRE(got[(c - c0) * 4 + j] == want);
                    fifth += want >> 4;
                  }
                }
              });
          REQUIRE(next == 8);
        }
      }
    }
  };
  check.operator()<32>();
  check.operator()<64>();
  CHECK(fifth > 2 * K * N / 4);  // both widths: 2 K N levels, of which over a quarter >= 16
}
#endif

TEST_CASE("quant kernels: panels store every format at its own width", "[kernels][quant]") {
  // Bits a weight of one 32-column panel, header included (hand-computed: levels + fp16 scales
  // per column and block + the K-quants' 8-bit sub-block scales and mins).
  Index const K = 1024;
  auto bits = [&](quant::Format f) {
    return static_cast<double>(kernels::quant_panel_bytes(f, K)) * 8.0 / (32.0 * K);
  };
  CHECK(bits(quant::Format::kQ8_0) == 8.5);
  CHECK(bits(quant::Format::kQ6_K) == 6.5625);    // 6 + 16 / 256 + 8 x 16 / 256
  CHECK(bits(quant::Format::kQ5_K) == 5.625);     // 5 + 2 x 16 / 256 + 2 x 8 x 8 / 256
  CHECK(bits(quant::Format::kQ5_0) == 5.5);       // 5 + 16 / 32: GGUF's own size
  CHECK(bits(quant::Format::kQ5_1) == 6.0);       // 5 + 2 x 16 / 32
  CHECK(bits(quant::Format::kQ4_1) == 5.0);       // 4 + 2 x 16 / 32
  CHECK(bits(quant::Format::kIQ4_NL) == 4.5);     // 4 + 16 / 32
  CHECK(bits(quant::Format::kIQ4_XS) == 4.3125);  // 4 + 16 / 256 + 8 x 8 / 256
  CHECK(bits(quant::Format::kQ4_K) == 4.625);     // 4 + 2 x 16 / 256 + 2 x 8 x 8 / 256
  CHECK(bits(quant::Format::kQ4_0) == 4.5);
  CHECK(bits(quant::Format::kMXFP4) == 4.5);    // 4 + 8 / 32 (E8M0) + 8 / 32 (the header's pad)
  CHECK(bits(quant::Format::kQ3_K) == 3.5625);  // 3 + 16 / 256 + 8 x 16 / 256
  CHECK(bits(quant::Format::kQ2_K) == 2.625);   // 2 + 2 x 16 / 256 + 8 x 16 / 256 (nibbles)
  // Every level round-trips through the layout: the GGUF block's level (its decoder's integer).
  for (quant::Format f : quant::kFormats) {
    Index const N = 40;  // a second panel with 8 columns, the rest zero
    QOperand op(f, N, K, 3);
    Index const G = quant::block_elems(f);
    auto gguf_level = [&](Index n, Index k) {
      std::byte const* blk = op.q.row(n) + k / G * quant::block_bytes(f);
      int const i = static_cast<int>(k % G);
      auto as = [&]<class B>(B* b) -> B const& {
        std::memcpy(b, blk, sizeof(B));
        return *b;
      };
      switch (f) {
        case quant::Format::kQ8_0: {
          quant::BlockQ8_0 b;
          return as(&b).qs[i] + 128;
        }
        case quant::Format::kQ4_0: {
          quant::BlockQ4_0 b;
          return i < 16 ? as(&b).qs[i] & 0xF : as(&b).qs[i - 16] >> 4;
        }
        case quant::Format::kQ6_K: {
          quant::BlockQ6_K b;
          return quant::q6_level(as(&b), i);
        }
        case quant::Format::kQ4_K: {
          quant::BlockQ4_K b;
          return quant::q4k_level(as(&b), i);
        }
        case quant::Format::kQ5_K: {  // ggml's dequantize_row_q5_K: nibble + 16 * qh bit
          quant::BlockQ5_K b;
          as(&b);
          int const chunk = i / 64, l = i % 32, hi = i % 64 / 32;
          int const nib = hi ? b.qs[32 * chunk + l] >> 4 : b.qs[32 * chunk + l] & 0xF;
          return nib + ((b.qh[l] & (1 << (2 * chunk + hi))) != 0 ? 16 : 0);
        }
        case quant::Format::kQ5_0: {  // ggml's dequantize_row_q5_0: nibble + 16 * bit i of qh
          quant::BlockQ5_0 b;
          as(&b);
          int const nib = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
          return nib + ((b.qh[i / 8] >> (i % 8)) & 1) * 16;
        }
        case quant::Format::kQ5_1: {  // as Q5_0's
          quant::BlockQ5_1 b;
          as(&b);
          int const nib = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
          return nib + ((b.qh[i / 8] >> (i % 8)) & 1) * 16;
        }
        case quant::Format::kIQ4_NL: {  // ggml's kvalues_iq4nl[nibble], + 128 in the layout
          quant::BlockIQ4_NL b;
          int const q = i < 16 ? as(&b).qs[i] & 0xF : as(&b).qs[i - 16] >> 4;
          return quant::kIq4nlValues[q] + 128;
        }
        case quant::Format::kIQ4_XS: {  // per 32 weights 16 bytes of nibbles, as IQ4_NL's
          quant::BlockIQ4_XS b;
          std::uint8_t const v = as(&b).qs[i / 32 * 16 + i % 16];
          return quant::kIq4nlValues[i % 32 < 16 ? v & 0xF : v >> 4] + 128;
        }
        case quant::Format::kMXFP4: {  // ggml's kvalues_mxfp4[nibble], + 128 in the layout
          quant::BlockMXFP4 b;
          int const q = i < 16 ? as(&b).qs[i] & 0xF : as(&b).qs[i - 16] >> 4;
          return quant::kMxfp4Values[q] + 128;
        }
        case quant::Format::kQ4_1: {  // as Q4_0's
          quant::BlockQ4_1 b;
          return i < 16 ? as(&b).qs[i] & 0xF : as(&b).qs[i - 16] >> 4;
        }
        case quant::Format::kQ3_K: {
          quant::BlockQ3_K b;
          return quant::q3k_level(as(&b), i);
        }
        case quant::Format::kQ2_K: {
          quant::BlockQ2_K b;
          return quant::q2k_level(as(&b), i);
        }
      }
      return -1;
    };
    auto const* panel = reinterpret_cast<std::uint8_t const*>(op.panels.data());
    for (Index n = 0; n < 64; n += 3) {
      for (Index k = 0; k < K; k += 5) {
        std::uint8_t const* w = panel + n / 32 * op.w.panel_bytes +
                                k / G * kernels::quant_group_bytes(f) +
                                kernels::quant_header_bytes(f);
        INFO(quant::name(f) << " n = " << n << " k = " << k);
        // Columns past N are zero bytes: level 0, or the table formats' entry for index 0.
        int const pad = kernels::quant_has_table(f) ? kernels::quant_table(f)[0] : 0;
        REQUIRE(kernels::quant_level(f, w, k % G, n % 32) == (n < N ? gguf_level(n, k) : pad));
      }
    }
  }
}

TEST_CASE("quant kernels: activation rows are quantized per 32-block with their sums",
          "[kernels][quant]") {
  Index const K = 64;
  std::vector<float> x = test::random_vector(K, 3, -2.0f, 2.0f);
  x[5] = 2.5f;  // the block's amax: d = 2.5 / 127
  auto const q8 = quantize_acts(x, 1, K);
  auto const r = kernels::q8_row(q8.data(), K);
  CHECK(r.d[0] == 2.5f / 127.0f);
  CHECK(r.a[5] == 127);
  std::int32_t s = 0, s16 = 0;
  for (int k = 0; k < 32; ++k) {
    float const want = std::nearbyint(x[static_cast<std::size_t>(k)] * (1.0f / r.d[0]));
    CHECK(static_cast<float>(r.a[k]) == want);
    s += r.a[k];
    if (k < 16) s16 += r.a[k];
  }
  CHECK(r.s32[0] == s);
  CHECK(r.s16[0] == s16);
  CHECK(r.ds[0] == r.d[0] * static_cast<float>(s));
  // A block with a non-finite value gets da = NaN; the other block is untouched.
  x[40] = std::numeric_limits<float>::infinity();
  auto const bad = quantize_acts(x, 1, K);
  auto const rb = kernels::q8_row(bad.data(), K);
  CHECK(std::isnan(rb.d[1]));
  CHECK(rb.d[0] == r.d[0]);
}

TEST_CASE("quant kernels: every activation block against the scalar formula (SIMD paths)",
          "[kernels][quant]") {
  // Rows of different magnitudes (down to subnormal blocks), an all-zero block and ties: the
  // SIMD quantizers (zmm, ymm) against the formula, level by level.
  Index const K = 512, M = 6;
  std::vector<float> x = test::random_vector(M * K, 77, -3.0f, 3.0f);
  float const scale[M] = {1.0f, 1e-3f, 1e4f, 1e-40f, 0.5f, 7.0f};
  for (Index i = 0; i < M; ++i)
    for (Index k = 0; k < K; ++k) x[static_cast<std::size_t>(i * K + k)] *= scale[i];
  for (Index k = 64; k < 96; ++k) x[static_cast<std::size_t>(k)] = 0.0f;
  for (Index k = 96; k < 128; ++k)
    x[static_cast<std::size_t>(k)] = 0.5f * static_cast<float>(k % 5);
  auto const q8 = quantize_acts(x, M, K);
  for (Index i = 0; i < M; ++i) {
    auto const r = kernels::q8_row(q8.data() + i * kernels::q8_row_bytes(K), K);
    for (Index b = 0; b < K / 32; ++b) {
      INFO("row " << i << " block " << b);
      float amax = 0.0f;
      for (Index k = 0; k < 32; ++k)
        amax = std::max(amax, std::fabs(x[static_cast<std::size_t>(i * K + 32 * b + k)]));
      float const d = amax / 127.0f;
      REQUIRE(r.d[b] == d);
      float const id = quant::detail::inverse(d);
      std::int32_t lo = 0, hi = 0;
      for (Index k = 0; k < 32; ++k) {
        float const q = std::nearbyint(x[static_cast<std::size_t>(i * K + 32 * b + k)] * id);
        float const want = std::clamp(q, -128.0f, 127.0f);
        REQUIRE(static_cast<float>(r.a[32 * b + k]) == want);
        (k < 16 ? lo : hi) += r.a[32 * b + k];
      }
      REQUIRE(r.s16[2 * b] == lo);
      REQUIRE(r.s16[2 * b + 1] == hi);
      REQUIRE(r.s32[b] == lo + hi);
      REQUIRE(r.ds[b] == d * static_cast<float>(lo + hi));
    }
  }
}

TEST_CASE("quant kernels: quant_cols matches the dequantized double reference",
          "[kernels][quant]") {
  for (quant::Format f : quant::kFormats) {
    for (Index N : {Index{32}, Index{70}}) {
      for (Index M : {Index{1}, Index{5}, Index{13}}) {
        Index const K = 512;
        INFO(quant::name(f) << " N = " << N << " M = " << M);
        QOperand op(f, N, K, 7 + static_cast<std::uint64_t>(N));
        std::vector<float> x = test::random_vector(M * K, 21 + static_cast<std::uint64_t>(M));
        auto const q8 = quantize_acts(x, M, K);
        auto const xa = deq_rows(q8, M, K);
        std::vector<float> scale = test::random_vector(M, 5, 0.5f, 1.5f);
        std::vector<float> c(static_cast<std::size_t>(M * N), -1.0f);
        std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
        kernels::WeightPanels w;
        w.quant[0] = op.w;
        kernels::StoreEpilogue const epi{c.data(), N, N, scale.data()};
        // The rows quantized here per chunk (a.q8 null).
        kernels::expert_cols(kernels::RowSource{x.data(), K}, M, K, w, 0, (N + 31) / 32, epi,
                             scratch.data());
        for (Index i = 0; i < M; ++i) {
          for (Index n = 0; n < N; ++n) {
            double want = 0, mag = 0;
            for (Index k = 0; k < K; ++k) {
              double const t = xa[static_cast<std::size_t>(i * K + k)] *
                               op.deq[static_cast<std::size_t>(n * K + k)];
              want += t;
              mag += std::fabs(t);
            }
            want *= scale[static_cast<std::size_t>(i)];
            REQUIRE(std::fabs(c[static_cast<std::size_t>(i * N + n)] - want) <= 1e-5 * mag + 1e-6);
          }
        }
        // Handed pre-quantized rows through an index (a gather), one item per panel: same bits.
        std::vector<Index> index(static_cast<std::size_t>(M));
        for (Index i = 0; i < M; ++i) index[static_cast<std::size_t>(i)] = M - 1 - i;
        std::vector<float> c2(c.size(), -1.0f);
        std::vector<float> scale2(scale.rbegin(), scale.rend());
        kernels::StoreEpilogue const epi2{c2.data(), N, N, scale2.data()};
        kernels::RowSource src{x.data(), K, index.data()};
        src.q8 = q8.data();
        src.ldq = kernels::q8_row_bytes(K);
        for (Index p = 0; p < (N + 31) / 32; ++p) {
          kernels::expert_cols(src, M, K, w, p, p + 1, epi2, scratch.data());
        }
        for (Index i = 0; i < M; ++i) {
          for (Index n = 0; n < N; ++n) {
            REQUIRE(c2[static_cast<std::size_t>((M - 1 - i) * N + n)] ==
                    c[static_cast<std::size_t>(i * N + n)]);
          }
        }
      }
    }
  }
}

TEST_CASE("quant kernels: the SIMD (zmm, AVX-VNNI, AVX2) and portable kernels give the same bits",
          "[kernels][quant]") {
  INFO("this build: " << (kernels::has_avx512_vnni() ? "AVX512-VNNI"
                          : kernels::has_avx_vnni()  ? "AVX-VNNI"
                          : kernels::has_avx2_int8() ? "AVX2 vpmaddubsw"
                                                     : "portable only"));
  for (quant::Format f : quant::kFormats) {
    Index const K = 768, N = 64;
    QOperand gate(f, N, K, 31), up(f, N, K, 32);
    // Every row-tile size of both kernels and their tails.
    for (Index M : {1, 2, 3, 4, 5, 7, 8, 13}) {
      INFO(quant::name(f) << " M = " << M);
      std::vector<float> x = test::random_vector(M * K, 41 + static_cast<std::uint64_t>(M));
      std::vector<float> m(static_cast<std::size_t>(M * N)), c(static_cast<std::size_t>(M * N));
      std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
      kernels::WeightPanels w;
      w.quant[0] = gate.w;
      w.quant[1] = up.w;
      kernels::GluEpilogue<kernels::Activation::kSilu> const epi{m.data(), N, N};
      kernels::expert_cols(kernels::RowSource{x.data(), K}, M, K, w, 0, 2, epi, scratch.data());
      kernels::WeightPanels w1;
      w1.quant[0] = up.w;
      kernels::expert_cols(kernels::RowSource{x.data(), K}, M, K, w1, 0, 2,
                           kernels::StoreEpilogue{c.data(), N, N}, scratch.data());
      // The portable kernel on the same rows, then the same activation arithmetic.
      auto const q8 = quantize_acts(x, M, K);
      for (Index p = 0; p < 2; ++p) {
        std::byte const* panels[2] = {gate.w.data + p * gate.w.panel_bytes,
                                      up.w.data + p * up.w.panel_bytes};
        auto const out = portable_panel(f, q8.data(), M, K, panels, 2);
        std::byte const* up_only[2] = {panels[1], nullptr};
        auto const out1 = portable_panel(f, q8.data(), M, K, up_only, 1);
        std::vector<float> mp(static_cast<std::size_t>(M * N));
        kernels::GluEpilogue<kernels::Activation::kSilu> const pe{mp.data(), N, N};
        using B = moe::kernels::simd::Batch<float>;
        constexpr int NB = static_cast<int>(64 / B::size);
        for (Index i = 0; i < M; ++i) {
          B v[NB];
          for (int j = 0; j < NB; ++j)
            v[j] = B::load_unaligned(out[static_cast<std::size_t>(i)].data() +
                                     j * static_cast<Index>(B::size));
          pe.row(i, p, v);
          for (Index cc = 0; cc < 32; ++cc) {
            std::size_t const at = static_cast<std::size_t>(i * N + p * 32 + cc);
            float const want = out1[static_cast<std::size_t>(i)][static_cast<std::size_t>(cc)];
            REQUIRE(std::memcmp(&m[at], &mp[at], 4) == 0);
            REQUIRE(std::memcmp(&c[at], &want, 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE(
    "quant kernels: GGUF's legacy, IQ4 and MXFP4 formats against the dequantize-then-dot reference",
    "[kernels][quant]") {
  // Odd row counts, depths of one and of several blocks, T = 1, 3, 8, 33 tokens: quant_cols
  // (the SIMD kernel of this build) against the double product of ggml's dequantized weights
  // and the dequantized int8 activations, and bitwise against the portable kernel.
  for (quant::Format f : {quant::Format::kQ5_0, quant::Format::kQ4_1, quant::Format::kQ5_1,
                          quant::Format::kIQ4_NL, quant::Format::kIQ4_XS, quant::Format::kMXFP4}) {
    for (Index N : {Index{1}, Index{45}}) {
      for (Index K : {quant::block_elems(f), 5 * quant::block_elems(f)}) {
        QOperand op(f, N, K, 101 + static_cast<std::uint64_t>(N + K));
        for (Index T : {Index{1}, Index{3}, Index{8}, Index{33}}) {
          INFO(quant::name(f) << " N = " << N << " K = " << K << " T = " << T);
          std::vector<float> x = test::random_vector(T * K, 7 + static_cast<std::uint64_t>(T));
          auto const q8 = quantize_acts(x, T, K);
          auto const xa = deq_rows(q8, T, K);
          std::vector<float> c(static_cast<std::size_t>(T * N), -1.0f);
          std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
          kernels::WeightPanels w;
          w.quant[0] = op.w;
          Index const np = (N + 31) / 32;
          kernels::expert_cols(kernels::RowSource{x.data(), K}, T, K, w, 0, np,
                               kernels::StoreEpilogue{c.data(), N, N}, scratch.data());
          for (Index p = 0; p < np; ++p) {
            std::byte const* panels[2] = {op.w.data + p * op.w.panel_bytes, nullptr};
            auto const port = portable_panel(f, q8.data(), T, K, panels, 1);
            for (Index i = 0; i < T; ++i) {
              for (Index n = p * 32; n < std::min(N, p * 32 + 32); ++n) {
                double want = 0, mag = 0;
                for (Index k = 0; k < K; ++k) {
                  double const t = xa[static_cast<std::size_t>(i * K + k)] *
                                   op.deq[static_cast<std::size_t>(n * K + k)];
                  want += t;
                  mag += std::fabs(t);
                }
                float const got = c[static_cast<std::size_t>(i * N + n)];
                REQUIRE(std::fabs(got - want) <= 1e-5 * mag + 1e-6);
                float const same =
                    port[static_cast<std::size_t>(i)][static_cast<std::size_t>(n - p * 32)];
                REQUIRE(std::memcmp(&got, &same, 4) == 0);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("quant kernels: MXFP4's E8M0 scales are ggml_e8m0_to_fp32_half's, subnormals included",
          "[kernels][quant]") {
  // Every exponent byte e: the scale the kernels take from a packed header (quant_scale, the
  // portable kernel's, and this build's vector unpackers) is 2^(e - 128) bit for bit, as ggml's
  // ggml_e8m0_to_fp32_half, whose e = 0 and 1 are the subnormals 2^-128 and 2^-127 (where the
  // exponent field (e - 1) << 23 would be -inf's and zero's bits) and e = 255 is 2^127.
  alignas(64) std::byte grp[64] = {};
  for (int e0 = 0; e0 < 256; e0 += 32) {
    for (int c = 0; c < 32; ++c) grp[c] = static_cast<std::byte>(e0 + c);
    alignas(64) float vec[32];
#if MOE_HAS_AVX512VNNI
    for (Index c0 : {Index{0}, Index{16}}) {
      _mm512_store_ps(vec + c0, kernels::detail::quant_scales_zmm<quant::Format::kMXFP4>(grp, c0));
    }
#elif MOE_HAS_AVX2_INT8
    for (Index c0 = 0; c0 < 32; c0 += 8) {
      _mm256_store_ps(vec + c0, kernels::detail::quant_scales_ymm<quant::Format::kMXFP4>(grp, c0));
    }
#else
    for (Index c = 0; c < 32; ++c) vec[c] = kernels::quant_scale(quant::Format::kMXFP4, grp, c);
#endif
    for (int c = 0; c < 32; ++c) {
      int const e = e0 + c;
      INFO("e = " << e);
      float const want = std::ldexp(1.0f, e - 128);
      float const scalar = kernels::quant_scale(quant::Format::kMXFP4, grp, c);
      float const decoder = quant::detail::e8m0_to_fp32_half(static_cast<std::uint8_t>(e));
      REQUIRE(std::memcmp(&scalar, &want, 4) == 0);
      REQUIRE(std::memcmp(&decoder, &want, 4) == 0);
      REQUIRE(std::memcmp(&vec[c], &want, 4) == 0);
    }
  }
  // Hand-built blocks whose exponents span the range a product stays finite in (the subnormal
  // scales among them) and random codes (-0 included): the SIMD kernel gives the portable
  // kernel's bits, and both the double product of ggml's decoded weights.
  constexpr Index N = 40, K = 96, T = 5;
  int const exps[] = {0, 1, 2, 3, 64, 120, 127, 128, 129, 135, 160, 200};
  std::vector<quant::BlockMXFP4> blocks(static_cast<std::size_t>(N * K / 32));
  std::uint32_t state = 12345;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    blocks[b].e = static_cast<std::uint8_t>(exps[b % std::size(exps)]);
    for (auto& q : blocks[b].qs) {
      state = state * 1664525u + 1013904223u;
      q = static_cast<std::uint8_t>(state >> 24);
    }
  }
  std::vector<float> deq(static_cast<std::size_t>(N * K));
  quant::dequantize_row(quant::Format::kMXFP4, blocks.data(), N * K, deq.data());
  Index const pb = kernels::quant_panel_bytes(quant::Format::kMXFP4, K);
  Aligned<std::byte> panels(static_cast<std::size_t>(2 * pb));
  kernels::pack_quant_panels(quant::Format::kMXFP4,
                             reinterpret_cast<std::byte const*>(blocks.data()), N, K,
                             panels.data());
  std::vector<float> x = test::random_vector(T * K, 17);
  auto const q8 = quantize_acts(x, T, K);
  auto const xa = deq_rows(q8, T, K);
  std::vector<float> c(static_cast<std::size_t>(T * N), -1.0f);
  std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
  kernels::WeightPanels w;
  w.quant[0] = {panels.data(), quant::Format::kMXFP4, pb};
  kernels::expert_cols(kernels::RowSource{x.data(), K}, T, K, w, 0, 2,
                       kernels::StoreEpilogue{c.data(), N, N}, scratch.data());
  for (Index p = 0; p < 2; ++p) {
    std::byte const* pp[2] = {panels.data() + p * pb, nullptr};
    auto const port = portable_panel(quant::Format::kMXFP4, q8.data(), T, K, pp, 1);
    for (Index i = 0; i < T; ++i) {
      for (Index n = p * 32; n < std::min(N, p * 32 + 32); ++n) {
        INFO("row " << i << " column " << n);
        double want = 0, mag = 0;
        for (Index k = 0; k < K; ++k) {
          double const v =
              xa[static_cast<std::size_t>(i * K + k)] * deq[static_cast<std::size_t>(n * K + k)];
          want += v;
          mag += std::fabs(v);
        }
        float const got = c[static_cast<std::size_t>(i * N + n)];
        REQUIRE(std::fabs(got - want) <= 1e-5 * mag + 1e-44);  // a few ulps of the subnormals
        float const same = port[static_cast<std::size_t>(i)][static_cast<std::size_t>(n - p * 32)];
        REQUIRE(std::memcmp(&got, &same, 4) == 0);
      }
    }
  }
}

TEST_CASE("quant kernels: a non-finite activation makes its outputs NaN", "[kernels][quant]") {
  Index const K = 256, N = 32, M = 2;
  QOperand op(quant::Format::kQ4_K, N, K, 9);
  std::vector<float> x = test::random_vector(M * K, 2);
  x[static_cast<std::size_t>(K + 100)] = std::numeric_limits<float>::infinity();
  std::vector<float> c(static_cast<std::size_t>(M * N));
  std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
  kernels::WeightPanels w;
  w.quant[0] = op.w;
  kernels::expert_cols(kernels::RowSource{x.data(), K}, M, K, w, 0, 1,
                       kernels::StoreEpilogue{c.data(), N, N}, scratch.data());
  for (Index n = 0; n < N; ++n) {
    CHECK(std::isfinite(c[static_cast<std::size_t>(n)]));
    CHECK(std::isnan(c[static_cast<std::size_t>(N + n)]));
  }
}

TEST_CASE("quant kernels: the AMX int8 tiles give the portable kernel's bits",
          "[kernels][quant][amx]") {
  if (!kernels::quant_amx()) {
    WARN("AMX int8 tiles skipped: "
         << (moe::compiled_amx_int8() ? "this CPU has no AMX-INT8 (or Linux refused tile data), "
                                        "or MOE_QUANT_KERNEL chose another kernel"
                                      : "this build has no AMX int8 kernels (needs -march with "
                                        "amx-tile and amx-int8)"));
    return;
  }
  using B = moe::kernels::simd::Batch<float>;
  constexpr Index L = static_cast<Index>(B::size);
  for (quant::Format f : quant::kFormats) {
    // One group of a K-quant, and three; rows: below and above the AMX threshold, one and two
    // tiles with tails, and more than one chunk of kQuantChunkRows.
    for (Index K : {Index{256}, Index{768}}) {
      Index const N = 64;
      QOperand gate(f, N, K, 61 + static_cast<std::uint64_t>(K)), up(f, N, K, 62);
      for (Index M : {1, 5, 6, 15, 16, 17, 21, 22, 31, 32, 33, 130, 150}) {
        INFO(quant::name(f) << " K = " << K << " M = " << M);
        std::vector<float> x = test::random_vector(M * K, 71 + static_cast<std::uint64_t>(M));
        if (M == 21)
          x[static_cast<std::size_t>(19 * K + 33)] = std::numeric_limits<float>::quiet_NaN();
        auto const q8 = quantize_acts(x, M, K);
        std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
        // One operand (store), rows quantized in the call.
        std::vector<float> c(static_cast<std::size_t>(M * N));
        kernels::WeightPanels w1;
        w1.quant[0] = gate.w;
        kernels::expert_cols(kernels::RowSource{x.data(), K}, M, K, w1, 0, 2,
                             kernels::StoreEpilogue{c.data(), N, N}, scratch.data());
        // Two operands (SiLU x up), pre-quantized rows through a reversing index.
        std::vector<Index> index(static_cast<std::size_t>(M));
        for (Index i = 0; i < M; ++i) index[static_cast<std::size_t>(i)] = M - 1 - i;
        kernels::RowSource src{x.data(), K, index.data()};
        src.q8 = q8.data();
        src.ldq = kernels::q8_row_bytes(K);
        kernels::WeightPanels w2;
        w2.quant[0] = gate.w;
        w2.quant[1] = up.w;
        std::vector<float> m(static_cast<std::size_t>(M * N));
        kernels::expert_cols(src, M, K, w2, 0, 2,
                             kernels::GluEpilogue<kernels::Activation::kSilu>{m.data(), N, N},
                             scratch.data());
        std::vector<float> mp(static_cast<std::size_t>(M * N));
        kernels::GluEpilogue<kernels::Activation::kSilu> const pe{mp.data(), N, N};
        for (Index p = 0; p < 2; ++p) {
          std::byte const* p1[2] = {gate.w.data + p * gate.w.panel_bytes, nullptr};
          std::byte const* p2[2] = {gate.w.data + p * gate.w.panel_bytes,
                                    up.w.data + p * up.w.panel_bytes};
          auto const r1 = portable_panel(f, q8.data(), M, K, p1, 1);
          auto const r2 = portable_panel(f, q8.data(), M, K, p2, 2);
          for (Index i = 0; i < M; ++i) {
            B v[64 / L];
            for (Index j = 0; j < 64 / L; ++j)
              v[j] = B::load_unaligned(r2[static_cast<std::size_t>(M - 1 - i)].data() + j * L);
            pe.row(i, p, v);
          }
          for (Index i = 0; i < M; ++i) {
            for (Index cc = 0; cc < 32; ++cc) {
              std::size_t const at = static_cast<std::size_t>(i * N + p * 32 + cc);
              float const want = r1[static_cast<std::size_t>(i)][static_cast<std::size_t>(cc)];
              REQUIRE(std::memcmp(&c[at], &want, 4) == 0);
              REQUIRE(std::memcmp(&m[at], &mp[at], 4) == 0);
            }
          }
        }
        if (M == 21) {  // the row with a NaN: every output NaN, the others finite
          for (Index n = 0; n < N; ++n) {
            CHECK(std::isnan(c[static_cast<std::size_t>(19 * N + n)]));
            CHECK(std::isfinite(c[static_cast<std::size_t>(18 * N + n)]));
          }
        }
      }
    }
  }
}

TEST_CASE("pack_quant_panels: the word-at-a-time re-pack is the level-by-level one, byte for byte",
          "[quant][kernels]") {
  // Random block bytes (any bytes are blocks: the re-pack moves levels and headers, it does not
  // interpret them), a partial last panel, every format.
  Index const N = 45, K = 512;
  for (quant::Format const f : quant::kFormats) {
    INFO(quant::name(f));
    Index const rb = quant::row_bytes(f, K);
    std::vector<std::byte> rows(static_cast<std::size_t>(N * rb));
    std::uint64_t x = 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(f);
    for (std::byte& b : rows) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      b = static_cast<std::byte>(x & 0xFF);
    }
    auto const bytes =
        static_cast<std::size_t>((N + kernels::kQuantPanelCols - 1) / kernels::kQuantPanelCols *
                                 kernels::quant_panel_bytes(f, K));
    std::vector<std::byte> fast(bytes, std::byte{0x5A}), slow(bytes, std::byte{0xA5});
    kernels::pack_quant_panels(f, rows.data(), N, K, fast.data());
    kernels::detail::pack_quant_panels(f, rows.data(), N, K, slow.data(), false);
    REQUIRE(fast == slow);
  }
}
