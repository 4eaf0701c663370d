// SPDX-License-Identifier: Apache-2.0
// ExpertBank: weight layout and every expert kind against the double reference.
#include <catch2/catch.hpp>
#include <memory>

#include "moe/experts/expert_bank.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/layers/detail/ffn_base.hpp"
#include "support/helpers.hpp"
#include "support/layer_reference.hpp"
#include "support/run_expert.hpp"

using moe::Index;
namespace experts = moe::experts;

static_assert(moe::ExpertPolicy<experts::SwiGlu>);
static_assert(moe::ExpertPolicy<experts::ReluMlp>);
static_assert(moe::SharedExpertPolicy<experts::NoSharedExperts>);
static_assert(moe::SharedExpertPolicy<experts::GatedSharedExperts<experts::SwiGlu>>);
static_assert(moe::SharedExpertPolicy<experts::UngatedSharedExperts<experts::GeluMlp>>);

TEMPLATE_TEST_CASE("One expert through the routed-experts engine matches the reference expert",
                   "[experts]", experts::SwiGlu, experts::GeGlu, experts::GeGluErf,
                   experts::ReluMlp, experts::GeluMlp, experts::GeluTanhMlp, experts::SiluMlp) {
  Index const E = 3, D = 24, F = 40;
  experts::ExpertBank<TestType> bank(E, D, F);
  moe::fill_uniform(bank.edit().parameters(), -0.3f, 0.3f, 5);
  for (Index n : {0, 1, 5, 70}) {
    INFO("rows " << n);
    auto x = test::random_vector(n * D, 6, -2.0f, 2.0f);
    std::vector<float> y(static_cast<std::size_t>(n * D));
    for (Index e = 0; e < E; ++e) {
      test::run_expert(bank, e, moe::ConstMatrixView<float>(x.data(), n, D),
                       moe::MatrixView<float>(y.data(), n, D));
      for (Index i = 0; i < n; ++i) {
        auto want = ref::bank_expert(bank, e, x.data() + i * D);
        REQUIRE(test::max_rel_diff(y.data() + i * D, want) < 1e-5);
      }
    }
  }
}

TEST_CASE("ExpertBank GLU layout: gate rows then up rows of the fused in_proj", "[experts]") {
  Index const E = 2, D = 3, F = 4;
  experts::ExpertBank<experts::SwiGlu> bank(E, D, F);
  REQUIRE(bank.parameters().size() == static_cast<std::size_t>(E * 3 * F * D));
  for (Index e = 0; e < E; ++e) {
    auto in = bank.in_proj(e);
    REQUIRE(in.rows == 2 * F);
    REQUIRE(bank.gate_proj(e).data == in.data);
    REQUIRE(bank.up_proj(e).data == in.row(F));
    REQUIRE(bank.down_proj(e).rows == D);
    REQUIRE(bank.down_proj(e).cols == F);
  }
  // Blocks are disjoint and cover the flat parameter array in order.
  REQUIRE(bank.in_proj(1).data == bank.in_proj(0).data + 2 * F * D);
  REQUIRE(bank.down_proj(0).data == bank.parameters().data() + E * 2 * F * D);
  REQUIRE(bank.down_proj(1).data + D * F == bank.parameters().data() + bank.parameters().size());
  experts::ExpertBank<experts::ReluMlp> mlp(E, D, F);
  REQUIRE(mlp.up_proj(0).data == mlp.in_proj(0).data);
  REQUIRE(mlp.parameters().size() == static_cast<std::size_t>(E * 2 * F * D));
}

TEST_CASE("Fused gate_up equals separate gate and up projections", "[experts]") {
  // Two routes to the same expert: writing gate and up through their own views, or the fused
  // [2F, D] block row by row, gives identical weights and outputs.
  Index const D = 8, F = 6;
  experts::ExpertBank<experts::SwiGlu> a(1, D, F), b(1, D, F);
  auto g = test::random_vector(F * D, 1);
  auto u = test::random_vector(F * D, 2);
  auto dn = test::random_vector(D * F, 3);
  {
    auto const ea = a.edit();
    auto const eb = b.edit();
    for (Index i = 0; i < F * D; ++i) {
      ea.gate_proj(0).data[i] = g[i];
      ea.up_proj(0).data[i] = u[i];
    }
    auto fused = eb.in_proj(0);
    for (Index f = 0; f < F; ++f) {
      for (Index d = 0; d < D; ++d) {
        fused(f, d) = g[f * D + d];
        fused(F + f, d) = u[f * D + d];
      }
    }
    for (Index i = 0; i < D * F; ++i) ea.down_proj(0).data[i] = eb.down_proj(0).data[i] = dn[i];
  }
  auto x = test::random_vector(D, 4);
  std::vector<float> ya(D), yb(D);
  test::run_expert(a, 0, {x.data(), 1, D}, {ya.data(), 1, D});
  test::run_expert(b, 0, {x.data(), 1, D}, {yb.data(), 1, D});
  REQUIRE(ya == yb);
}

TEST_CASE("ExpertBank rejects non-positive sizes", "[experts][errors]") {
  REQUIRE_THROWS_WITH((experts::ExpertBank<experts::SwiGlu>(2, 0, 4)),
                      Catch::Contains("sizes must be positive"));
  REQUIRE_NOTHROW((experts::ExpertBank<experts::SwiGlu>(0, 4, 4)));
}

TEST_CASE("ExpertBank::pack: reads never touch it, an edit suspends and rebuilds it", "[experts]") {
  using Bank = experts::ExpertBank<experts::SwiGlu>;
  Index const np = moe::kernels::panel_width();
  Bank bank(2, np, np);
  REQUIRE_FALSE(bank.packed());
  bank.pack(experts::WeightFormat::kBf16);
  REQUIRE(bank.packed());
  REQUIRE(bank.packed_format() == experts::WeightFormat::kBf16);
  REQUIRE(bank.packed_in_bf16(1) != nullptr);
  REQUIRE(bank.packed_in(1) == nullptr);
  bank.pack(experts::WeightFormat::kF32);
  REQUIRE(bank.packed_format() == experts::WeightFormat::kF32);
  REQUIRE(bank.packed_in(1) != nullptr);
  REQUIRE(bank.packed_in_bf16(1) == nullptr);
  // Reads (const views, also of a non-const bank) leave the pack current.
  REQUIRE(bank.in_proj(0)(0, 0) == 0.0f);
  REQUIRE(bank.packed());
  {
    auto const edit = bank.edit();  // while an edit is open the pack is not used...
    edit.in_proj(0)(0, 0) = 1.0f;
    REQUIRE(bank.editing());
    REQUIRE_FALSE(bank.packed());
    REQUIRE(bank.packed_in(1) == nullptr);
    // ... and cannot be rebuilt under it.
    REQUIRE_THROWS_WITH(bank.pack(), Catch::Contains("open for writing"));
    auto const nested = bank.edit();
    nested.down_proj(1)(0, 0) = 2.0f;
  }
  // When the last edit ends the pack is rebuilt, in its format, from the edited weights.
  REQUIRE_FALSE(bank.editing());
  REQUIRE(bank.packed());
  REQUIRE(bank.packed_format() == experts::WeightFormat::kF32);
  REQUIRE(bank.packed_in(0)[0] == 1.0f);  // panel 0, k = 0, column 0 = W_in[0, 0]
  // A bank never packed stays unpacked after an edit; a copy starts with no edit open.
  Bank plain(1, np, np);
  {
    auto const edit = plain.edit();
    Bank copy = plain;
    REQUIRE_FALSE(copy.editing());
    REQUIRE_NOTHROW(copy.pack());
  }
  REQUIRE_FALSE(plain.packed());
  // A layer's parameters() list holds the edit open while it lives (an optimizer's writes are
  // seen), and the pack comes back when it goes.
  {
    auto const list = std::make_shared<moe::ParameterList>();
    list->push_back({"experts", moe::detail::open_edit(*list, bank).parameters()});
    REQUIRE_FALSE(bank.packed());
    list->front().values[0] = 3.0f;
  }
  REQUIRE(bank.packed());
  REQUIRE(bank.packed_in(0)[0] == 3.0f);
  // A bank of no experts (an expert-parallel rank that owns none) is packed once pack() ran,
  // in the format asked for, though it stores nothing.
  Bank none(0, np, np);
  REQUIRE_FALSE(none.packed());
  none.pack(experts::WeightFormat::kBf16);
  REQUIRE(none.packed());
  REQUIRE(none.packed_format() == experts::WeightFormat::kBf16);
}
