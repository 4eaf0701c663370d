// SPDX-License-Identifier: Apache-2.0
// Every kernel against a scalar double reference, over the tail sizes of STYLE.md 6.9.
// This TU is built twice: with -march=native (moe_tests) and without -m flags (moe_tests_sse2).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "moe/kernels/activations.hpp"
#include "moe/kernels/combine.hpp"
#include "moe/kernels/gather.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/kernels/softmax.hpp"
#include "moe/kernels/top_k.hpp"
#include "support/helpers.hpp"

using moe::Index;
using moe::kernels::Activation;
namespace kernels = moe::kernels;

namespace {
constexpr Index kLanes = static_cast<Index>(moe::kernels::simd::Batch<float>::size);
}

TEST_CASE("softmax_rows matches a double softmax for every tail size", "[kernels][softmax]") {
  INFO("arch " << xsimd::default_arch::name() << ", lanes " << kLanes);
  for (Index n : test::tail_sizes(kLanes)) {
    if (n == 0) continue;
    INFO("cols " << n);
    Index const rows = 3, ld = n + 5;
    auto in = test::random_vector(rows * ld, 11 + static_cast<std::uint64_t>(n), -8.0f, 8.0f);
    std::vector<float> out(static_cast<std::size_t>(rows * n));
    kernels::softmax_rows(in.data(), ld, out.data(), n, rows, n);
    for (Index i = 0; i < rows; ++i) {
      auto p = ref::softmax(std::vector<double>(in.begin() + i * ld, in.begin() + i * ld + n));
      double sum = 0.0;
      for (Index j = 0; j < n; ++j) {
        REQUIRE(out[i * n + j] == Approx(p[j]).epsilon(2e-6).margin(1e-12));
        sum += out[i * n + j];
      }
      REQUIRE(sum == Approx(1.0).epsilon(1e-5));
    }
  }
}

TEST_CASE("softmax_rows gives -inf entries probability 0 and survives huge logits",
          "[kernels][softmax]") {
  float const inf = std::numeric_limits<float>::infinity();
  std::vector<float> z = {-inf, 1000.0f, 999.0f, -inf, -1000.0f, 0.0f, -inf, 1000.0f, -inf,
                          -inf, -inf,    -inf,   -inf, -inf,     -inf, 3.0f, 2.0f};
  Index const n = static_cast<Index>(z.size());
  std::vector<float> p(z.size());
  kernels::softmax_rows(z.data(), n, p.data(), n, 1, n);
  auto want = ref::softmax(std::vector<double>(z.begin(), z.end()));
  for (Index j = 0; j < n; ++j) {
    REQUIRE(std::isfinite(p[j]));
    REQUIRE(p[j] == Approx(want[j]).margin(1e-7));
    if (z[j] == -inf) REQUIRE(p[j] == 0.0f);
  }
}

TEST_CASE("sigmoid_rows matches 1/(1+exp(-x)) and saturates cleanly", "[kernels][sigmoid]") {
  for (Index n : test::tail_sizes(kLanes)) {
    INFO("cols " << n);
    auto in = test::random_vector(2 * n, 7, -30.0f, 30.0f);
    std::vector<float> out(in.size());
    kernels::sigmoid_rows(in.data(), n, out.data(), n, 2, n);
    for (std::size_t i = 0; i < in.size(); ++i) {
      REQUIRE(out[i] == Approx(ref::sigmoid(in[i])).epsilon(2e-6).margin(1e-30));
    }
  }
  float const inf = std::numeric_limits<float>::infinity();
  float z[4] = {-inf, inf, -200.0f, 200.0f};
  float s[4];
  kernels::sigmoid_rows(z, 4, s, 4, 1, 4);
  REQUIRE(s[0] == 0.0f);
  REQUIRE(s[1] == 1.0f);
  REQUIRE(s[2] == 0.0f);
  REQUIRE(s[3] == 1.0f);
}

TEST_CASE("top_k_rows picks the k largest, ties to the lower index, skips -inf and NaN",
          "[kernels][top_k]") {
  for (Index n : test::tail_sizes(kLanes)) {
    if (n == 0) continue;
    for (Index k : {Index{1}, Index{2}, std::min<Index>(8, n), n}) {
      if (k > n) continue;
      INFO("cols " << n << " k " << k);
      Index const rows = 4;
      // Coarse values force many ties.
      auto in =
          test::random_vector(rows * n, 5 + static_cast<std::uint64_t>(n * 31 + k), 0.0f, 6.0f);
      for (float& v : in) v = std::floor(v);
      std::vector<moe::ExpertId> idx(static_cast<std::size_t>(rows * k));
      std::vector<float> val(idx.size());
      kernels::top_k_rows(in.data(), n, rows, n, k, idx.data(), val.data());
      for (Index i = 0; i < rows; ++i) {
        auto want =
            ref::order_desc(std::vector<double>(in.begin() + i * n, in.begin() + (i + 1) * n));
        for (Index s = 0; s < k; ++s) {
          REQUIRE(idx[i * k + s] == want[s]);
          REQUIRE(val[i * k + s] == in[i * n + want[s]]);
        }
      }
    }
  }
  float const inf = std::numeric_limits<float>::infinity();
  float const nan = std::numeric_limits<float>::quiet_NaN();
  float z[5] = {-inf, nan, 2.0f, -inf, 2.0f};
  moe::ExpertId idx[4];
  float val[4];
  kernels::top_k_rows(z, 5, 1, 5, 4, idx, val);
  REQUIRE(idx[0] == 2);
  REQUIRE(idx[1] == 4);
  REQUIRE(idx[2] == -1);  // fewer than k selectable entries: empty slots
  REQUIRE(idx[3] == -1);
  REQUIRE(val[2] == -inf);
}

TEST_CASE("gather_rows copies the routed rows exactly", "[kernels][gather]") {
  for (Index n : test::tail_sizes(kLanes)) {
    INFO("cols " << n);
    Index const T = 9, ld = n + 3;
    auto x = test::random_vector(T * ld, 3);
    std::vector<Index> rows = {4, 0, 8, 4, 2};
    std::vector<float> out(rows.size() * static_cast<std::size_t>(n + 1), -7.0f);
    kernels::gather_rows(x.data(), ld, rows.data(), static_cast<Index>(rows.size()), n, out.data(),
                         n + 1);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      for (Index j = 0; j < n; ++j) REQUIRE(out[i * (n + 1) + j] == x[rows[i] * ld + j]);
      REQUIRE(out[i * (n + 1) + n] == -7.0f);  // the padding column is untouched
    }
  }
}

TEST_CASE("combine_rows sums each token's rows in order and adds gated shared outputs",
          "[kernels][combine]") {
  for (Index n : test::tail_sizes(kLanes)) {
    for (int gated = 0; gated < 2; ++gated) {
      INFO("cols " << n << " gated " << gated);
      Index const T = 5, R = 7, S = 2;
      // token rows: t0 -> {3, 0}, t1 -> {}, t2 -> {6}, t3 -> {1, 2, 4}, t4 -> {5}
      std::vector<Index> offsets = {0, 2, 2, 3, 6, 7};
      std::vector<Index> token_rows = {3, 0, 6, 1, 2, 4, 5};
      auto Y = test::random_vector(R * n, 21);
      auto w = test::random_vector(R, 22, 0.0f, 1.0f);
      auto sh = test::random_vector(S * T * n, 23);
      auto g = test::random_vector(T * S, 24, 0.0f, 1.0f);
      std::vector<float> y(static_cast<std::size_t>(T * n), 99.0f);
      kernels::CombineParams p;
      p.expert_out = Y.data();
      p.ld_expert_out = n;
      p.row_weight = w.data();
      p.token_offsets = offsets.data();
      p.token_rows = token_rows.data();
      p.shared_out = sh.data();
      p.ld_shared = n;
      p.shared_plane = T * n;
      p.num_shared = S;
      p.shared_gate = gated ? g.data() : nullptr;
      p.cols = n;
      p.out = y.data();
      p.ld_out = n;
      // Two disjoint token ranges, as two threads would do.
      p.token_begin = 0;
      p.token_end = 2;
      kernels::combine_rows(p);
      p.token_begin = 2;
      p.token_end = T;
      kernels::combine_rows(p);
      for (Index t = 0; t < T; ++t) {
        for (Index c = 0; c < n; ++c) {
          double want = 0.0;
          for (Index j = offsets[t]; j < offsets[t + 1]; ++j) {
            want += static_cast<double>(w[token_rows[j]]) * Y[token_rows[j] * n + c];
          }
          for (Index s = 0; s < S; ++s) {
            want += (gated ? g[t * S + s] : 1.0) * sh[s * T * n + t * n + c];
          }
          REQUIRE(y[t * n + c] == Approx(want).margin(1e-5));
        }
      }
    }
  }
}

TEST_CASE("scale_dot scales a row and returns its dot product for every tail size",
          "[kernels][combine]") {
  for (Index n : test::tail_sizes(kLanes)) {
    INFO("cols " << n);
    auto g = test::random_vector(n, 31);
    auto y = test::random_vector(n, 32);
    std::vector<float> dst(static_cast<std::size_t>(n) + 1, 99.0f);
    float const dot = kernels::scale_dot(g.data(), y.data(), -0.75f, dst.data(), n);
    double want = 0.0, mag = 0.0;
    for (Index c = 0; c < n; ++c) {
      want += static_cast<double>(g[c]) * y[c];
      mag += std::abs(static_cast<double>(g[c]) * y[c]);
      REQUIRE(dst[c] == -0.75f * g[c]);  // one rounding: exact against the float product
    }
    REQUIRE(dst[n] == 99.0f);  // nothing written past n
    REQUIRE(dot == Approx(want).margin(1e-6 * (1.0 + mag)));
    // In place (dst aliasing g) gives the same dot product and scaled values.
    auto g2 = g;
    REQUIRE(kernels::scale_dot(g2.data(), y.data(), -0.75f, g2.data(), n) == dot);
    for (Index c = 0; c < n; ++c) REQUIRE(g2[c] == dst[c]);
  }
  // A NaN in y reaches the dot product, not the scaled row; an Inf in g reaches both.
  std::vector<float> g(37, 1.0f), y(37, 2.0f), dst(37);
  y[20] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(std::isnan(kernels::scale_dot(g.data(), y.data(), 0.5f, dst.data(), 37)));
  for (float v : dst) REQUIRE(v == 0.5f);
  y[20] = 2.0f;
  g[3] = std::numeric_limits<float>::infinity();
  REQUIRE(std::isinf(kernels::scale_dot(g.data(), y.data(), 0.5f, dst.data(), 37)));
  REQUIRE(std::isinf(dst[3]));
}

TEST_CASE("activations match the double definitions on a grid including |x| > 20",
          "[kernels][activations]") {
  for (Activation a :
       {Activation::kSilu, Activation::kGeluErf, Activation::kGeluTanh, Activation::kRelu}) {
    INFO("activation " << moe::kernels::to_string(a));
    for (Index n : test::tail_sizes(kLanes)) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (Index i = 0; i < n; ++i)
        x[i] =
            -40.0f + 80.0f * static_cast<float>(i) / static_cast<float>(std::max<Index>(1, n - 1));
      auto up = test::random_vector(n, 9);
      std::vector<float> out(x.size()), glu(x.size());
      switch (a) {
        case Activation::kSilu:
          kernels::activate<Activation::kSilu>(x.data(), out.data(), n);
          kernels::glu<Activation::kSilu>(x.data(), up.data(), glu.data(), n);
          break;
        case Activation::kGeluErf:
          kernels::activate<Activation::kGeluErf>(x.data(), out.data(), n);
          kernels::glu<Activation::kGeluErf>(x.data(), up.data(), glu.data(), n);
          break;
        case Activation::kGeluTanh:
          kernels::activate<Activation::kGeluTanh>(x.data(), out.data(), n);
          kernels::glu<Activation::kGeluTanh>(x.data(), up.data(), glu.data(), n);
          break;
        case Activation::kRelu:
          kernels::activate<Activation::kRelu>(x.data(), out.data(), n);
          kernels::glu<Activation::kRelu>(x.data(), up.data(), glu.data(), n);
          break;
      }
      for (Index i = 0; i < n; ++i) {
        INFO("x = " << x[i]);
        double const want = ref::activate(a, x[i]);
        REQUIRE(std::isfinite(out[i]));
        REQUIRE(out[i] == Approx(want).epsilon(1e-5).margin(1e-6));
        REQUIRE(glu[i] == Approx(want * up[i]).epsilon(1e-5).margin(1e-6));
      }
    }
    // Dense grid in the curved region.
    std::vector<float> x(401), out(401);
    for (int i = 0; i < 401; ++i) x[i] = -10.0f + 0.05f * static_cast<float>(i);
    switch (a) {
      case Activation::kSilu:
        kernels::activate<Activation::kSilu>(x.data(), out.data(), 401);
        break;
      case Activation::kGeluErf:
        kernels::activate<Activation::kGeluErf>(x.data(), out.data(), 401);
        break;
      case Activation::kGeluTanh:
        kernels::activate<Activation::kGeluTanh>(x.data(), out.data(), 401);
        break;
      case Activation::kRelu:
        kernels::activate<Activation::kRelu>(x.data(), out.data(), 401);
        break;
    }
    for (int i = 0; i < 401; ++i)
      REQUIRE(out[i] == Approx(ref::activate(a, x[i])).epsilon(1e-5).margin(1e-6));
  }
}

TEST_CASE("build_plan is a stable counting sort of the selection", "[kernels][plan]") {
  for (Index E : {1, 2, 8, 64}) {
    for (Index K : {Index{1}, std::min<Index>(2, E), E}) {
      INFO("E " << E << " K " << K);
      Index const T = 37;
      moe::Selection sel;
      sel.reset(T, K, E);
      auto r = test::random_vector(T * K, static_cast<std::uint64_t>(E * 100 + K), 0.0f, 1.0f);
      for (Index i = 0; i < T * K; ++i) {
        // Random experts, some slots empty (-1), duplicates across tokens.
        int const e = static_cast<int>(r[i] * static_cast<float>(E + 1)) - 1;
        sel.expert[i] = static_cast<moe::ExpertId>(std::min<int>(e, static_cast<int>(E) - 1));
        sel.weight[i] = static_cast<float>(i);
      }
      moe::RoutingPlan plan;
      kernels::build_plan(sel, plan);
      REQUIRE_NOTHROW(plan.validate(T, E));
      // Naive: for each expert, scan tokens then slots.
      Index r_expected = 0;
      for (Index e = 0; e < E; ++e) {
        REQUIRE(plan.expert_offsets[e] == r_expected);
        for (Index t = 0; t < T; ++t) {
          for (Index s = 0; s < K; ++s) {
            if (sel.expert[t * K + s] != e) continue;
            REQUIRE(plan.row_token[r_expected] == t);
            REQUIRE(plan.row_weight[r_expected] == sel.weight[t * K + s]);
            ++r_expected;
          }
        }
      }
      REQUIRE(plan.num_rows() == r_expected);
      for (Index t = 0; t < T; ++t) {
        Index j = plan.token_offsets[t];
        for (Index s = 0; s < K; ++s) {
          if (sel.expert[t * K + s] < 0) continue;
          Index const row = plan.token_rows[j++];
          REQUIRE(plan.row_weight[row] == sel.weight[t * K + s]);  // slot order kept
        }
        REQUIRE(j == plan.token_offsets[t + 1]);
      }
    }
  }
  moe::Selection bad;
  bad.reset(1, 1, 2);
  bad.expert[0] = 5;
  moe::RoutingPlan plan;
  REQUIRE_THROWS_WITH(kernels::build_plan(bad, plan), Catch::Contains("names expert 5"));
}

/// The panel path of a projection, as the kernels' tests drive it: C[:, c0:c1] = A W^T with
/// M < kPanelMinRows through gemm_nt and otherwise through pack_panel + gemm_panel per panel (c0 a
/// multiple of panel_width()); W fp32 or bf16. `scratch` holds panel_scratch_size(K) floats.
template <class Wt>
void project_cols(float const* A, Index lda, Index M, Wt const* W, Index ldw, Index K, Index c0,
                  Index c1, float* C, Index ldc, float* scratch) {
  if (M <= 0 || c1 <= c0) return;
  if (M < kernels::kPanelMinRows) {
    kernels::gemm_nt(A, lda, W + c0 * ldw, ldw, C + c0, ldc, M, c1 - c0, K);
    return;
  }
  constexpr Index NP = kernels::panel_width();
  auto const addr = reinterpret_cast<std::uintptr_t>(scratch);
  float* panel = scratch + ((64 - addr % 64) % 64) / sizeof(float);
  for (Index n0 = c0; n0 < c1; n0 += NP) {
    Index const nc = std::min(NP, c1 - n0);
    kernels::pack_panel(W, ldw, n0, nc, K, panel);
    kernels::gemm_panel(A, lda, panel, M, K, C + n0, ldc, nc);
  }
}

TEST_CASE("gemm_nt and project_cols match a double GEMM for every tail size", "[kernels][gemm]") {
  constexpr Index NP = kernels::panel_width();
  std::vector<float> scratch(static_cast<std::size_t>(kernels::panel_scratch_size(300)));
  for (Index K : test::tail_sizes(kLanes)) {
    for (Index M : {Index{1}, Index{3}, Index{7}, Index{8}, Index{13}}) {
      for (Index N : {Index{1}, NP - 1, NP, NP + 1, 2 * NP + 3}) {
        INFO("M " << M << " N " << N << " K " << K);
        Index const lda = K + 1, ldc = N + 2;
        auto A = test::random_vector(M * lda, 91 + static_cast<std::uint64_t>(K));
        auto W = test::random_vector(N * K, 92 + static_cast<std::uint64_t>(N));
        std::vector<float> C(static_cast<std::size_t>(M * ldc), 5.0f), C2(C), C3(C);
        kernels::gemm_nt(A.data(), lda, W.data(), K, C.data(), ldc, M, N, K);
        project_cols(A.data(), lda, M, W.data(), K, K, 0, N, C2.data(), ldc, scratch.data());
        // Split at a panel boundary, as two work items would.
        Index const split = std::min(N, NP);
        project_cols(A.data(), lda, M, W.data(), K, K, 0, split, C3.data(), ldc, scratch.data());
        project_cols(A.data(), lda, M, W.data(), K, K, split, N, C3.data(), ldc, scratch.data());
        // Column by column (gemm_nt groups far-apart columns into one tile when N >= 16): the
        // same bits as the whole call.
        std::vector<float> C4(C);
        for (Index j = 0; j < N; ++j) {
          kernels::gemm_nt(A.data(), lda, W.data() + j * K, K, C4.data() + j, ldc, M, 1, K);
        }
        REQUIRE(C4 == C);
        for (Index i = 0; i < M; ++i) {
          for (Index j = 0; j < N; ++j) {
            double want = 0.0;
            for (Index k = 0; k < K; ++k)
              want += static_cast<double>(A[i * lda + k]) * W[j * K + k];
            REQUIRE(C[i * ldc + j] == Approx(want).margin(1e-4));
            REQUIRE(C2[i * ldc + j] == Approx(want).margin(1e-4));
            REQUIRE(C3[i * ldc + j] == C2[i * ldc + j]);
          }
          REQUIRE(C[i * ldc + N] == 5.0f);  // the padding columns are untouched
          REQUIRE(C2[i * ldc + N + 1] == 5.0f);
        }
      }
    }
  }
}

TEST_CASE("A row's projection does not depend on the other rows of the batch", "[kernels][gemm]") {
  Index const K = 77, N = 40;
  auto W = test::random_vector(N * K, 93);
  auto A = test::random_vector(20 * K, 94);
  std::vector<float> scratch(static_cast<std::size_t>(kernels::panel_scratch_size(K)));
  std::vector<float> all(20 * N), part(12 * N);
  project_cols(A.data(), K, 20, W.data(), K, K, 0, N, all.data(), N, scratch.data());
  project_cols(A.data() + 8 * K, K, 12, W.data(), K, K, 0, N, part.data(), N, scratch.data());
  for (Index i = 0; i < 12 * N; ++i) REQUIRE(part[i] == all[8 * N + i]);
}

TEST_CASE("bf16 weights give the bits of their fp32 copies in gemm_nt and project_cols",
          "[kernels][gemm][bf16]") {
  // The widening load must keep lane order and exactness: any slip changes the summation.
  constexpr Index NP = kernels::panel_width();
  std::vector<float> scratch(static_cast<std::size_t>(kernels::panel_scratch_size(300)));
  for (Index K : test::tail_sizes(kLanes)) {
    for (Index M : {Index{1}, Index{4}, Index{7}, Index{8}, Index{13}}) {
      for (Index N : {Index{1}, Index{5}, NP + 1, Index{4 * 4 + 3}}) {
        INFO("M " << M << " N " << N << " K " << K);
        Index const lda = K + 3, ldc = N + 1;
        auto A = test::random_vector(M * lda, 191 + static_cast<std::uint64_t>(K));
        auto W = test::random_vector(N * K, 192 + static_cast<std::uint64_t>(N));
        std::vector<std::uint16_t> W16(W.size());
        for (std::size_t i = 0; i < W.size(); ++i) {
          W16[i] = kernels::float_to_bf16(W[i]);
          W[i] = kernels::bf16_to_float(W16[i]);
        }
        std::vector<float> want(static_cast<std::size_t>(M * ldc), 5.0f), got(want);
        kernels::gemm_nt(A.data(), lda, W.data(), K, want.data(), ldc, M, N, K);
        kernels::gemm_nt(A.data(), lda, W16.data(), K, got.data(), ldc, M, N, K);
        REQUIRE(got == want);
        // Accumulating, and through project_cols (both paths: M < 8 and the packed one).
        kernels::gemm_nt(A.data(), lda, W.data(), K, want.data(), ldc, M, N, K, true);
        kernels::gemm_nt(A.data(), lda, W16.data(), K, got.data(), ldc, M, N, K, true);
        REQUIRE(got == want);
        project_cols(A.data(), lda, M, W.data(), K, K, 0, N, want.data(), ldc, scratch.data());
        project_cols(A.data(), lda, M, W16.data(), K, K, 0, N, got.data(), ldc, scratch.data());
        REQUIRE(got == want);
        for (Index i = 0; i < M; ++i) {
          for (Index j = 0; j < N; ++j) {
            double ref = 0.0;
            for (Index k = 0; k < K; ++k) ref += static_cast<double>(A[i * lda + k]) * W[j * K + k];
            REQUIRE(got[i * ldc + j] == Approx(ref).margin(1e-4));
          }
          REQUIRE(got[i * ldc + N] == 5.0f);
        }
      }
    }
  }
  // Every bf16 bit pattern widens as the scalar conversion does (NaN payloads, Inf, denormals).
  using B = kernels::simd::Batch<float>;
  std::vector<std::uint16_t> all(65536 + B::size);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  for (std::size_t i = 0; i + B::size <= all.size(); i += B::size) {
    alignas(64) float lanes[B::size];
    kernels::simd::load_bf16<B>(all.data() + i).store_aligned(lanes);
    for (std::size_t l = 0; l < B::size; ++l) {
      std::uint32_t bits;
      std::memcpy(&bits, &lanes[l], 4);
      REQUIRE(bits == static_cast<std::uint32_t>(all[i + l]) << 16);
    }
  }
}

TEST_CASE("Activation backward kernels match the analytic derivatives", "[kernels][activations]") {
  auto check = [](Activation a, auto act_bwd, auto glu_bwd) {
    for (Index n : test::tail_sizes(kLanes)) {
      std::vector<float> h(static_cast<std::size_t>(n));
      for (Index i = 0; i < n; ++i)
        h[i] = -25.0f +
               50.0f * static_cast<float>(i) / static_cast<float>(std::max<Index>(1, n - 1)) +
               0.013f;
      auto u = test::random_vector(n, 95);
      auto da = test::random_vector(n, 96);
      std::vector<float> act(h.size()), dh(h.size()), m(h.size()), dg(h.size()), du(h.size());
      act_bwd(h.data(), da.data(), act.data(), dh.data(), n);
      glu_bwd(h.data(), u.data(), da.data(), m.data(), dg.data(), du.data(), n);
      for (Index i = 0; i < n; ++i) {
        double const x = h[i], eps = 1e-6;
        double const grad = (ref::activate(a, x + eps) - ref::activate(a, x - eps)) / (2 * eps);
        INFO(moe::kernels::to_string(a) << " at x = " << x);
        REQUIRE(act[i] == Approx(ref::activate(a, x)).epsilon(1e-5).margin(1e-6));
        REQUIRE(dh[i] == Approx(da[i] * grad).epsilon(1e-4).margin(1e-5));
        REQUIRE(m[i] == Approx(ref::activate(a, x) * u[i]).epsilon(1e-5).margin(1e-6));
        REQUIRE(dg[i] == Approx(da[i] * u[i] * grad).epsilon(1e-4).margin(1e-5));
        REQUIRE(du[i] == Approx(da[i] * ref::activate(a, x)).epsilon(1e-5).margin(1e-6));
      }
    }
  };
  check(Activation::kSilu, kernels::activate_backward<Activation::kSilu>,
        kernels::glu_backward<Activation::kSilu>);
  check(Activation::kGeluErf, kernels::activate_backward<Activation::kGeluErf>,
        kernels::glu_backward<Activation::kGeluErf>);
  check(Activation::kGeluTanh, kernels::activate_backward<Activation::kGeluTanh>,
        kernels::glu_backward<Activation::kGeluTanh>);
  check(Activation::kRelu, kernels::activate_backward<Activation::kRelu>,
        kernels::glu_backward<Activation::kRelu>);
}

TEST_CASE("bf16 conversion rounds to nearest even and keeps NaN and Inf", "[kernels][bf16]") {
  REQUIRE(kernels::float_to_bf16(1.0f) == 0x3F80);
  REQUIRE(kernels::bf16_to_float(0x3F80) == 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0); just above rounds up.
  REQUIRE(kernels::float_to_bf16(1.00390625f) == 0x3F80);
  REQUIRE(kernels::float_to_bf16(std::nextafter(1.00390625f, 2.0f)) == 0x3F81);
  REQUIRE(kernels::float_to_bf16(1.01171875f) == 0x3F82);  // 1 + 3 * 2^-8: tie, up to even
  REQUIRE(kernels::float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  REQUIRE(std::isnan(
      kernels::bf16_to_float(kernels::float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  REQUIRE(kernels::float_to_bf16(-2.0f) == 0xC000);
}
