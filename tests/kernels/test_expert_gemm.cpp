// SPDX-License-Identifier: Apache-2.0
// kernels::expert_cols (the hot path's expert GEMM with fused gather and epilogues) against a
// scalar double reference, for every weight source, epilogue and tail size.
// This TU is built twice: with -march=native (moe_tests) and without -m flags (moe_tests_sse2).
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "moe/kernels/expert_gemm.hpp"
#include "moe/kernels/gemm_strided.hpp"
#include "support/helpers.hpp"
#include "support/reference.hpp"

using moe::Index;
using moe::kernels::Activation;
namespace kernels = moe::kernels;

namespace {

constexpr Index NP = kernels::panel_width();
template <class T>
using Aligned = std::vector<T, xsimd::aligned_allocator<T, 64>>;

enum class Source { kPacked, kRaw, kRawDot, kBf16 };

double bf16_round(float v) {
  return static_cast<double>(kernels::bf16_to_float(kernels::float_to_bf16(v)));
}

/// The weights of one operand (rows [N, K]) in the form `src` needs.
struct Operand {
  std::vector<float> raw;
  Aligned<float> f32;
  Aligned<std::uint32_t> bf16;
  Operand(std::vector<float> w, Index N, Index K) : raw(std::move(w)) {
    Index const panels = (N + NP - 1) / NP, words = (K + 1) / 2 * NP;
    f32.resize(static_cast<std::size_t>(panels * K * NP));
    bf16.resize(static_cast<std::size_t>(panels * words));
    for (Index p = 0; p < panels; ++p) {
      Index const nc = std::min(NP, N - p * NP);
      kernels::pack_panel(raw.data(), K, p * NP, nc, K, f32.data() + p * K * NP);
      kernels::pack_panel_bf16(raw.data(), K, p * NP, nc, K, bf16.data() + p * words);
    }
  }
};

void set_operand(kernels::WeightPanels& w, int o, Operand const& op, Source src, Index N) {
  if (src == Source::kPacked) w.f32[o] = op.f32.data();
  if (src == Source::kBf16) w.bf16[o] = op.bf16.data();
  if (src == Source::kRaw || src == Source::kRawDot) {
    w.raw[o] = op.raw.data();
    w.raw_rows[o] = N;
    w.dot_products = src == Source::kRawDot;
  }
}

/// The gate and up operands of a GLU in projection, from the fused [gate; up] rows [2F, K].
struct GluOperands {
  Index F;
  Operand gate, up;
  GluOperands(std::vector<float> const& w_in, Index f, Index K)
      : F(f),
        gate(std::vector<float>(w_in.begin(), w_in.begin() + f * K), f, K),
        up(std::vector<float>(w_in.begin() + f * K, w_in.end()), f, K) {}
  kernels::WeightPanels panels(Source src) const {
    kernels::WeightPanels w;
    set_operand(w, 0, gate, src, F);
    set_operand(w, 1, up, src, F);
    return w;
  }
};

/// Does the bf16 path round the activations too (AVX512-BF16 dot products, as this process
/// chose: moe::bf16_kernel())?
bool rounds_activations() { return kernels::bf16_dot_products(); }

/// sum_k a[k] w[k] in double, with the operand rounding of `src`.
double dot(float const* a, float const* w, Index K, Source src) {
  double s = 0.0;
  for (Index k = 0; k < K; ++k) {
    double const av = src == Source::kBf16 && rounds_activations() ? bf16_round(a[k]) : a[k];
    double const wv = src == Source::kBf16 ? bf16_round(w[k]) : w[k];
    s += av * wv;
  }
  return s;
}

char const* name(Source s) {
  switch (s) {
    case Source::kPacked:
      return "packed";
    case Source::kRaw:
      return "raw";
    case Source::kRawDot:
      return "raw, dot products";
    case Source::kBf16:
      return "bf16";
  }
  return "?";
}

}  // namespace

TEST_CASE("expert_cols with StoreEpilogue: gathered rows times W^T, scaled per row",
          "[kernels][expert_gemm][bf16]") {
  for (Source src : {Source::kPacked, Source::kRaw, Source::kRawDot, Source::kBf16}) {
    for (Index K : {Index{1}, Index{17}, Index{64}}) {
      for (Index M : {Index{1}, Index{3}, Index{7}, Index{8}, Index{13}, Index{33}}) {
        for (Index N : {Index{1}, NP - 1, 2 * NP + 5}) {
          INFO(name(src) << " M " << M << " N " << N << " K " << K);
          Index const T = M + 4;  // source rows; each of the M rows picks one
          auto X = test::random_vector(T * (K + 3), 301);
          std::vector<Index> index(static_cast<std::size_t>(M));
          for (Index i = 0; i < M; ++i) index[i] = (i * 7 + 3) % T;
          auto scale = test::random_vector(M, 302, 0.1f, 1.0f);
          Operand op(test::random_vector(N * K, 303), N, K);
          kernels::WeightPanels w;
          set_operand(w, 0, op, src, N);
          Index const ldc = N + 2;
          std::vector<float> C(static_cast<std::size_t>(M * ldc), -7.0f);
          std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
          kernels::RowSource const a{X.data(), K + 3, index.data()};
          Index const panels = (N + NP - 1) / NP;
          // Two calls over a split of the panels: items of one job.
          kernels::StoreEpilogue const epi{C.data(), ldc, N, scale.data()};
          kernels::expert_cols(a, M, K, w, 0, panels / 2, epi, scratch.data());
          kernels::expert_cols(a, M, K, w, panels / 2, panels, epi, scratch.data());
          for (Index i = 0; i < M; ++i) {
            for (Index j = 0; j < N; ++j) {
              double const want =
                  scale[i] * dot(X.data() + index[i] * (K + 3), op.raw.data() + j * K, K, src);
              REQUIRE(C[i * ldc + j] == Approx(want).margin(2e-5 * (1 + K)));
            }
            for (Index j = N; j < ldc; ++j) REQUIRE(C[i * ldc + j] == -7.0f);  // untouched
          }
        }
      }
    }
  }
}

TEST_CASE("expert_cols with GluEpilogue: gate and up in one pass, act(g) * u in registers",
          "[kernels][expert_gemm][bf16]") {
  for (Activation act : {Activation::kSilu, Activation::kGeluTanh}) {
    for (Source src : {Source::kPacked, Source::kRaw, Source::kRawDot, Source::kBf16}) {
      for (Index F : {Index{5}, NP, 2 * NP + 3}) {
        for (Index M : {Index{1}, Index{6}, Index{8}, Index{21}}) {
          Index const K = 37;
          INFO(name(src) << " act " << kernels::to_string(act) << " F " << F << " M " << M);
          auto X = test::random_vector(M * K, 311, -2.0f, 2.0f);
          auto Win = test::random_vector(2 * F * K, 312);  // HF fused [gate; up], [2F, K]
          GluOperands const glu(Win, F, K);
          kernels::WeightPanels const w = glu.panels(src);
          std::vector<float> m(static_cast<std::size_t>(M * F)),
              h(static_cast<std::size_t>(M * 2 * F));
          std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
          kernels::RowSource const a{X.data(), K, nullptr};
          Index const panels = (F + NP - 1) / NP;
          if (act == Activation::kSilu) {
            kernels::GluEpilogue<Activation::kSilu> const epi{m.data(), F, F, h.data(), 2 * F};
            kernels::expert_cols(a, M, K, w, 0, panels, epi, scratch.data());
          } else {
            kernels::GluEpilogue<Activation::kGeluTanh> const epi{m.data(), F, F, h.data(), 2 * F};
            kernels::expert_cols(a, M, K, w, 0, panels, epi, scratch.data());
          }
          for (Index i = 0; i < M; ++i) {
            for (Index j = 0; j < F; ++j) {
              double const g = dot(X.data() + i * K, Win.data() + j * K, K, src);
              double const u = dot(X.data() + i * K, Win.data() + (F + j) * K, K, src);
              REQUIRE(h[i * 2 * F + j] == Approx(g).margin(1e-4));
              REQUIRE(h[i * 2 * F + F + j] == Approx(u).margin(1e-4));
              REQUIRE(m[i * F + j] == Approx(ref::activate(act, g) * u).margin(2e-4));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("expert_cols with ActEpilogue: act(x W^T), pre-activations optional",
          "[kernels][expert_gemm]") {
  for (Source src : {Source::kPacked, Source::kRaw, Source::kRawDot}) {
    Index const K = 19, F = NP + 7;
    for (Index M : {Index{2}, Index{9}}) {
      auto X = test::random_vector(M * K, 321, -3.0f, 3.0f);
      Operand op(test::random_vector(F * K, 322), F, K);
      kernels::WeightPanels w;
      set_operand(w, 0, op, src, F);
      std::vector<float> m(static_cast<std::size_t>(M * F));
      std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
      kernels::ActEpilogue<Activation::kRelu> const epi{m.data(), F, F};
      kernels::expert_cols(kernels::RowSource{X.data(), K, nullptr}, M, K, w, 0, 2, epi,
                           scratch.data());
      for (Index i = 0; i < M; ++i) {
        for (Index j = 0; j < F; ++j) {
          double const z = dot(X.data() + i * K, op.raw.data() + j * K, K, src);
          REQUIRE(m[i * F + j] == Approx(std::max(z, 0.0)).margin(1e-4));
        }
      }
    }
  }
}

TEST_CASE("expert_cols: a row's result does not depend on the other rows or the panel split",
          "[kernels][expert_gemm][bf16]") {
  // Rows tile differently for M = 40 and M = 9 (balanced tiles of up to 8 or 6 rows), and the
  // prefetch slices change with the tile count: the values must not.
  Index const K = 300, N = 3 * NP;
  auto X = test::random_vector(40 * K, 331);
  for (Source src : {Source::kPacked, Source::kBf16}) {
    Operand op(test::random_vector(N * K, 332), N, K);
    kernels::WeightPanels w;
    set_operand(w, 0, op, src, N);
    std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
    std::vector<float> all(static_cast<std::size_t>(40 * N)), part(static_cast<std::size_t>(9 * N));
    kernels::expert_cols(kernels::RowSource{X.data(), K, nullptr}, 40, K, w, 0, 3,
                         kernels::StoreEpilogue{all.data(), N, N}, scratch.data());
    std::vector<Index> index{31, 8, 9, 10, 11, 12, 13, 14, 39};
    for (Index p = 0; p < 3; ++p) {
      kernels::expert_cols(kernels::RowSource{X.data(), K, index.data()}, 9, K, w, p, p + 1,
                           kernels::StoreEpilogue{part.data(), N, N}, scratch.data());
    }
    for (Index i = 0; i < 9; ++i) {
      for (Index j = 0; j < N; ++j) REQUIRE(part[i * N + j] == all[index[i] * N + j]);
    }
  }
}

TEST_CASE("expert_cols with AMX tiles: every row count 1..33 and 130, depths off the tile",
          "[kernels][expert_gemm][bf16][amx]") {
  if (!kernels::bf16_amx()) {
    WARN("AMX bf16 tiles skipped: " << (moe::compiled_amx_bf16()
                                            ? "this CPU has no AMX-BF16 (or Linux refused tile "
                                              "data), or MOE_BF16_KERNEL chose another kernel"
                                            : "this build has no AMX kernels (needs -march with "
                                              "amx-tile and amx-bf16)"));
    return;
  }
  // Depths: one pair, a partial tile only, exactly one and two tiles, a tile plus a tail, odd.
  // 600: 18 whole steps of 16 pairs and a tail step.
  for (Index K : {Index{2}, Index{31}, Index{32}, Index{64}, Index{50}, Index{97}, Index{600}}) {
    Index const F = NP + 7, T = 140;
    auto X = test::random_vector(T * K, 401);
    auto Win = test::random_vector(2 * F * K, 402);
    GluOperands const glu(Win, F, K);
    kernels::WeightPanels const w = glu.panels(Source::kBf16);
    std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
    // Each row alone: the reference for bitwise independence from the other rows.
    std::vector<float> alone(static_cast<std::size_t>(T * 2 * F));
    for (Index t = 0; t < T; ++t) {
      std::vector<float> m(static_cast<std::size_t>(F));
      kernels::GluEpilogue<Activation::kSilu> const epi{m.data(), F, F, alone.data() + t * 2 * F,
                                                        2 * F};
      kernels::expert_cols(kernels::RowSource{X.data() + t * K, K, nullptr}, 1, K, w, 0, 2, epi,
                           scratch.data());
    }
    for (Index t = 0; t < T; ++t) {
      for (Index j = 0; j < F; ++j) {
        double const g = dot(X.data() + t * K, glu.gate.raw.data() + j * K, K, Source::kBf16);
        double const u = dot(X.data() + t * K, glu.up.raw.data() + j * K, K, Source::kBf16);
        INFO("K " << K << " row " << t << " column " << j);
        REQUIRE(alone[t * 2 * F + j] == Approx(g).margin(2e-5 * (1 + K)));
        REQUIRE(alone[t * 2 * F + F + j] == Approx(u).margin(2e-5 * (1 + K)));
      }
    }
    std::vector<Index> all_rows;
    for (Index M = 1; M <= 33; ++M) all_rows.push_back(M);
    all_rows.push_back(130);  // two row chunks
    for (Index M : all_rows) {
      INFO("K " << K << " M " << M);
      std::vector<Index> index(static_cast<std::size_t>(M));
      for (Index i = 0; i < M; ++i) index[i] = (i * 37 + M) % T;
      std::vector<float> m(static_cast<std::size_t>(M * F)), h(static_cast<std::size_t>(M * 2 * F));
      kernels::GluEpilogue<Activation::kSilu> const epi{m.data(), F, F, h.data(), 2 * F};
      kernels::expert_cols(kernels::RowSource{X.data(), K, index.data()}, M, K, w, 0, 2, epi,
                           scratch.data());
      for (Index i = 0; i < M; ++i) {
        REQUIRE(std::memcmp(h.data() + i * 2 * F, alone.data() + index[i] * 2 * F,
                            sizeof(float) * 2 * F) == 0);
      }
    }
  }
}

TEST_CASE("expert_cols: K slices and row chunks give bitwise the one-pass result",
          "[kernels][expert_gemm][bf16]") {
  // 150 rows = two chunks (128 + 22); slices of 6 and 64 against one slice of the whole K (odd).
  Index const K = 131, F = NP + 5, M = 150;
  auto X = test::random_vector(M * K, 341);
  auto Win = test::random_vector(2 * F * K, 342);
  GluOperands const glu(Win, F, K);
  for (Source src : {Source::kPacked, Source::kRaw, Source::kBf16}) {
    INFO(name(src));
    kernels::WeightPanels const w = glu.panels(src);
    std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
    auto run = [&](Index k_slice) {
      std::vector<float> m(static_cast<std::size_t>(M * F)), h(static_cast<std::size_t>(M * 2 * F));
      kernels::GluEpilogue<Activation::kSilu> const epi{m.data(), F, F, h.data(), 2 * F};
      kernels::expert_cols(kernels::RowSource{X.data(), K, nullptr}, M, K, w, 0, 2, epi,
                           scratch.data(), k_slice);
      m.insert(m.end(), h.begin(), h.end());
      return m;
    };
    auto const one = run(K + 1);
    REQUIRE(run(6) == one);
    REQUIRE(run(64) == one);
    REQUIRE(run(0) == one);
  }
}

TEST_CASE("bf16_pairs_rows rounds like vcvtne2ps2bf16: nearest even, denormals to zero, NaN kept",
          "[kernels][expert_gemm][bf16]") {
  // Reference: round to nearest even on the bits; denormal inputs are signed zeros.
  auto want = [](float f) -> std::uint32_t {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0) return (u & 0x80000000u) >> 16;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  };
  float const specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            1.00390625f,  // 1 + 2^-8: a tie, rounds to even (1)
                            1.01171875f,  // 1 + 3 * 2^-8: a tie, rounds to even (1 + 2^-6)
                            std::numeric_limits<float>::denorm_min(),
                            -1e-39f,  // denormal
                            std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            3.0e38f};
  for (Index K :
       {Index{1}, Index{2}, Index{13}, Index{31}, Index{32}, Index{33}, Index{64}, Index{77}}) {
    INFO("K " << K);
    Index const rows = 3, kp = (K + 1) / 2, ldd = kp + 2;
    auto X = test::random_vector(rows * (K + 1), 361, -3.0f, 3.0f);
    for (Index i = 0; i < rows * (K + 1); i += 3) X[i] = specials[(i / 3) % 13];
    std::vector<std::uint32_t> got(static_cast<std::size_t>(rows * ldd), 0xDEADBEEFu);
    std::vector<Index> index{2, 0, 1};
    kernels::bf16_pairs_rows({X.data(), K + 1, index.data()}, rows, K, got.data(), ldd);
    for (Index r = 0; r < rows; ++r) {
      float const* x = X.data() + index[r] * (K + 1);
      for (Index k = 0; k < kp; ++k) {
        std::uint32_t const lo = want(x[2 * k]), hi = 2 * k + 1 < K ? want(x[2 * k + 1]) : 0u;
        REQUIRE(got[r * ldd + k] == (lo | (hi << 16)));
      }
      REQUIRE(got[r * ldd + kp] == 0xDEADBEEFu);  // nothing written past the row
    }
  }
}

TEST_CASE("expert_cols: bf16 pairs given in RowSource give bitwise the rows' own rounding",
          "[kernels][expert_gemm][bf16]") {
  Index const K = 75, F = NP + 3, M = 140, T = 150;
  auto X = test::random_vector(T * K, 371);
  auto Win = test::random_vector(2 * F * K, 372);
  GluOperands const glu(Win, F, K);
  kernels::WeightPanels const w = glu.panels(Source::kBf16);
  std::vector<Index> index(static_cast<std::size_t>(M));
  for (Index i = 0; i < M; ++i) index[i] = (i * 11 + 5) % T;
  Index const kp = (K + 1) / 2;
  std::vector<std::uint32_t> pairs(static_cast<std::size_t>(T * kp));
  kernels::bf16_pairs_rows({X.data(), K, nullptr}, T, K, pairs.data(), kp);
  std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
  auto run = [&](kernels::RowSource a) {
    std::vector<float> m(static_cast<std::size_t>(M * F));
    kernels::GluEpilogue<Activation::kSilu> const epi{m.data(), F, F};
    kernels::expert_cols(a, M, K, w, 0, 2, epi, scratch.data(), 32);
    return m;
  };
  REQUIRE(run({X.data(), K, index.data(), pairs.data(), kp}) == run({X.data(), K, index.data()}));
}

TEST_CASE("expert_cols: streaming stores write the same values, aligned or not, with tails",
          "[kernels][expert_gemm][bf16]") {
  Index const K = 40, N = 3 * NP + 5, M = 13;
  auto X = test::random_vector(M * K, 391);
  Operand w_op(test::random_vector(N * K, 392), N, K);
  auto scale = test::random_vector(M, 393);
  std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
  for (Source src : {Source::kPacked, Source::kBf16}) {
    kernels::WeightPanels w;
    set_operand(w, 0, w_op, src, N);
    Index const panels = (N + NP - 1) / NP;
    for (Index offset : {Index{0}, Index{1}}) {  // 64-byte aligned rows, then misaligned ones
      INFO("offset " << offset);
      Index const ldc = 4 * NP;  // rows 64-byte aligned when c is
      Aligned<float> plain(static_cast<std::size_t>(M * ldc + 16), -1.0f);
      Aligned<float> streamed(plain.size(), -1.0f);
      kernels::StoreEpilogue e0{plain.data() + offset, ldc, N, scale.data()};
      kernels::StoreEpilogue e1{streamed.data() + offset, ldc, N, scale.data(), true};
      kernels::expert_cols({X.data(), K, nullptr}, M, K, w, 0, panels, e0, scratch.data());
      kernels::expert_cols({X.data(), K, nullptr}, M, K, w, 0, panels, e1, scratch.data());
      kernels::simd::stream_fence();
      REQUIRE(plain == streamed);
    }
  }
}

TEST_CASE("expert_cols: the NextPanel prefetch hint never changes a result",
          "[kernels][expert_gemm]") {
  Index const K = 75, F = 2 * NP + 3, M = 20;
  auto X = test::random_vector(M * K, 381);
  auto Win = test::random_vector(2 * F * K, 382);
  GluOperands const glu(Win, F, K);
  Operand other(test::random_vector(F * 40, 383), F, 40);
  for (Source src : {Source::kPacked, Source::kBf16}) {
    kernels::WeightPanels const w = glu.panels(src);
    kernels::WeightPanels next_f32, next_bf16;
    set_operand(next_f32, 0, other, Source::kPacked, F);
    set_operand(next_bf16, 0, other, Source::kBf16, F);
    std::vector<float> scratch(static_cast<std::size_t>(kernels::expert_scratch_floats(K)));
    auto run = [&](kernels::NextPanel after) {
      std::vector<float> m(static_cast<std::size_t>(M * F));
      kernels::GluEpilogue<Activation::kSilu> const epi{m.data(), F, F};
      kernels::expert_cols({X.data(), K, nullptr}, M, K, w, 0, 3, epi, scratch.data(), 32, after);
      return m;
    };
    auto const want = run({});
    // The next panel: another projection (either layout, another depth) or this one's.
    REQUIRE(run({&next_f32, 1, 40}) == want);
    REQUIRE(run({&next_bf16, 2, 40}) == want);
    REQUIRE(run({&w, 0, K}) == want);
  }
}

TEST_CASE("gemm_strided matches a double GEMM for row-major and transposed A, with tails",
          "[kernels][gemm_strided]") {
  constexpr Index SW = kernels::strided_width();
  std::vector<float> scratch(static_cast<std::size_t>(kernels::kGemmStridedScratchFloats) + 3);
  for (bool transposed : {false, true}) {
    for (bool accumulate : {false, true}) {
      // M = 70: two row chunks; K = 37 (B packed whole with scratch), 300 (slices of 256).
      for (Index M : {Index{1}, Index{5}, Index{7}, Index{13}, Index{70}}) {
        for (Index N : {Index{1}, SW - 1, SW + 1, 2 * SW + 6}) {
          for (Index K : {Index{1}, Index{37}, Index{300}}) {
            INFO("transposed " << transposed << " accumulate " << accumulate << " M " << M << " N "
                               << N << " K " << K);
            // A as [M, K] (row stride K + 2) or stored transposed as [K, M] (row stride M + 3).
            Index const a_rs = transposed ? 1 : K + 2, a_ks = transposed ? M + 3 : 1;
            auto A = test::random_vector((transposed ? K * (M + 3) : M * (K + 2)), 351);
            Index const ldb = N + 4, ldc = N + 1;
            auto Bm = test::random_vector(K * ldb, 352);
            auto C = test::random_vector(M * ldc, 353);
            auto const C0 = C;
            kernels::gemm_strided(M, N, K, A.data(), a_rs, a_ks, Bm.data(), ldb, C.data(), ldc,
                                  accumulate);
            for (Index r = 0; r < M; ++r) {
              for (Index c = 0; c < N; ++c) {
                double want = accumulate ? C0[r * ldc + c] : 0.0;
                for (Index k = 0; k < K; ++k) {
                  want += static_cast<double>(A[r * a_rs + k * a_ks]) * Bm[k * ldb + c];
                }
                REQUIRE(C[r * ldc + c] == Approx(want).margin(1e-4));
              }
              REQUIRE(C[r * ldc + N] == C0[r * ldc + N]);  // the column past N is untouched
            }
            // With scratch (misaligned on purpose): other loops, bitwise the same results.
            auto Cs = C0;
            kernels::gemm_strided(M, N, K, A.data(), a_rs, a_ks, Bm.data(), ldb, Cs.data(), ldc,
                                  accumulate, scratch.data() + 1);
            REQUIRE(Cs == C);
            // A block of rows and columns computed alone equals the same block of the whole.
            Index const r0 = M / 3, c0 = N / 2;
            auto Cb = C0;
            kernels::gemm_strided(M - r0, N - c0, K, A.data() + r0 * a_rs, a_rs, a_ks,
                                  Bm.data() + c0, ldb, Cb.data() + r0 * ldc + c0, ldc, accumulate,
                                  scratch.data());
            for (Index r = r0; r < M; ++r) {
              for (Index c = c0; c < N; ++c) REQUIRE(Cb[r * ldc + c] == C[r * ldc + c]);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("pack_panel transposes W rows into a zero-padded K x NP panel",
          "[kernels][expert_gemm]") {
  // Full panels take the in-register transpose (16 x 16 blocks of fp32 on AVX-512, 8 x 8 blocks
  // of fp32 or bf16 on AVX2); K tails and partial panels the scalar loop.
  for (Index K :
       {Index{1}, Index{7}, Index{8}, Index{9}, Index{15}, Index{16}, Index{17}, Index{50}}) {
    for (Index nc : {NP, NP - 1, Index{1}}) {
      INFO("K " << K << " nc " << nc);
      Index const ldw = K + 3, n0 = 2;
      auto W = test::random_vector((n0 + NP) * ldw, 361);
      std::vector<float> panel(static_cast<std::size_t>(K * NP), -1.0f);
      kernels::pack_panel(W.data(), ldw, n0, nc, K, panel.data());
      // bf16 source: the panel holds the widened values, bit for bit.
      std::vector<std::uint16_t> Wb(W.size());
      for (std::size_t i = 0; i < W.size(); ++i) {
        Wb[i] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(W[i]) >> 16);
      }
      std::vector<float> panel_b(static_cast<std::size_t>(K * NP), -1.0f);
      kernels::pack_panel(Wb.data(), ldw, n0, nc, K, panel_b.data());
      for (Index k = 0; k < K; ++k) {
        for (Index c = 0; c < NP; ++c) {
          float const want = c < nc ? W[(n0 + c) * ldw + k] : 0.0f;
          REQUIRE(panel[k * NP + c] == want);
          float const want_b =
              c < nc ? std::bit_cast<float>(std::uint32_t{Wb[(n0 + c) * ldw + k]} << 16) : 0.0f;
          REQUIRE(std::bit_cast<std::uint32_t>(panel_b[k * NP + c]) ==
                  std::bit_cast<std::uint32_t>(want_b));
        }
      }
    }
  }
}
