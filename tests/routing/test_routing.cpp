// SPDX-License-Identifier: Apache-2.0
// Every routing policy against the double reference, the hand cases of ALGORITHMS.md section 7,
// tie-breaking, routing controls and configuration errors.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <set>

#include "moe/core/error.hpp"
#include "moe/kernels/plan.hpp"
#include "moe/routing/capacity.hpp"
#include "moe/routing/controls.hpp"
#include "moe/routing/expert_choice.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/one_per_group_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/stats.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "moe/routing/top_p.hpp"
#include "support/helpers.hpp"

using moe::ConstMatrixView;
using moe::Index;
using moe::Selection;
namespace routing = moe::routing;

namespace {
float const kInf = std::numeric_limits<float>::infinity();

std::vector<float> logits_for(Index T, Index E, std::uint64_t seed, float range = 4.0f) {
  return test::random_vector(T * E, seed, -range, range);
}
}  // namespace

static_assert(moe::RouterPolicy<routing::SoftmaxTopK>);
static_assert(moe::RouterPolicy<routing::TopKSoftmax>);
static_assert(moe::RouterPolicy<routing::GroupLimitedTopK>);
static_assert(moe::RouterPolicy<routing::OnePerGroupTopK>);
static_assert(moe::RouterPolicy<routing::ExpertChoice>);
static_assert(moe::RouterPolicy<routing::TopP>);
static_assert(moe::RouterPolicy<routing::WithCapacity<routing::SoftmaxTopK>>);

TEST_CASE("SoftmaxTopK matches the reference with and without renormalisation", "[routing]") {
  for (Index E : {1, 2, 8, 64}) {
    for (Index k : {Index{1}, std::min<Index>(2, E), E}) {
      for (bool normalize : {false, true}) {
        for (float scale : {1.0f, 2.5f}) {
          INFO("E " << E << " k " << k << " normalize " << normalize << " scale " << scale);
          Index const T = 23;
          auto z = logits_for(T, E, static_cast<std::uint64_t>(E * 7 + k));
          ConstMatrixView<float> logits(z.data(), T, E);
          Selection sel;
          routing::SoftmaxTopK r{E, k, normalize, scale};
          REQUIRE_NOTHROW(r.validate());
          r.select(logits, sel);
          test::require_same_routing(
              test::routing_of(sel),
              ref::softmax_top_k(logits, static_cast<int>(k), normalize, scale));
          for (Index t = 0; t < T; ++t) {
            auto p = ref::softmax(ref::row(logits, t));
            for (Index e = 0; e < E; ++e)
              REQUIRE(sel.scores[t * E + e] == Approx(p[e]).epsilon(1e-5).margin(1e-9));
          }
        }
      }
    }
  }
}

TEST_CASE("TopKSoftmax (Mixtral) equals softmax over the selected logits", "[routing]") {
  Index const T = 31, E = 8, k = 2;
  auto z = logits_for(T, E, 3);
  ConstMatrixView<float> logits(z.data(), T, E);
  Selection a, b;
  routing::TopKSoftmax{E, k}.select(logits, a);
  routing::SoftmaxTopK{E, k, true, 1.0f}.select(logits, b);
  test::require_same_routing(test::routing_of(a), ref::softmax_top_k(logits, k, true, 1.0));
  test::require_same_routing(test::routing_of(a), test::routing_of(b));
  for (Index t = 0; t < T; ++t) {
    // w = softmax(z_A) directly.
    double const z0 = z[t * E + a.expert_row(t)[0]], z1 = z[t * E + a.expert_row(t)[1]];
    REQUIRE(a.weight_row(t)[0] == Approx(1.0 / (1.0 + std::exp(z1 - z0))).epsilon(1e-6));
    REQUIRE(a.weight_row(t)[0] + a.weight_row(t)[1] == Approx(1.0f).epsilon(1e-6));
  }
}

TEST_CASE("GroupLimitedTopK matches the official DeepSeek-V3 gate", "[routing][deepseek]") {
  Index const T = 29, E = 32;
  auto z = logits_for(T, E, 17);
  ConstMatrixView<float> logits(z.data(), T, E);
  auto bias = test::random_vector(E, 18, -0.3f, 0.3f);
  for (bool sigmoid : {true, false}) {
    for (bool with_bias : {true, false}) {
      for (auto gs : {routing::GroupScore::kTopTwoSum, routing::GroupScore::kMax}) {
        INFO("sigmoid " << sigmoid << " bias " << with_bias << " group score " << int(gs));
        routing::GroupLimitedTopK r;
        r.num_experts = E;
        r.top_k = 6;
        r.n_group = 8;
        r.topk_group = 3;
        r.scale = 2.5f;
        r.scoring = sigmoid ? routing::ScoreFunction::kSigmoid : routing::ScoreFunction::kSoftmax;
        r.group_score = gs;
        if (with_bias) r.bias = bias;
        REQUIRE_NOTHROW(r.validate());
        Selection sel;
        r.select(logits, sel);
        auto want = ref::group_limited(logits, 6, 8, 3, true, 2.5, sigmoid, r.bias,
                                       gs == routing::GroupScore::kTopTwoSum);
        test::require_same_routing(test::routing_of(sel), want);
        for (Index t = 0; t < T; ++t) {
          std::set<Index> groups;
          float sum = 0.0f;
          for (Index s = 0; s < 6; ++s) {
            groups.insert(sel.expert_row(t)[s] / 4);
            sum += sel.weight_row(t)[s];
          }
          REQUIRE(groups.size() <= 3);                 // chosen experts lie in topk_group groups
          REQUIRE(sum == Approx(2.5f).epsilon(1e-5));  // renormalised, then scaled
        }
      }
    }
  }
}

TEST_CASE("GroupLimitedTopK: the bias changes selection, never the weights",
          "[routing][deepseek]") {
  Index const E = 8;
  // Sigmoid scores ordered 0 > 1 > ... ; a large bias on expert 7 makes it selected.
  std::vector<float> z = {3, 2, 1, 0, -1, -2, -3, -4};
  routing::GroupLimitedTopK r;
  r.num_experts = E;
  r.top_k = 2;
  r.normalize = false;
  Selection plain, biased;
  r.select(ConstMatrixView<float>(z.data(), 1, E), plain);
  REQUIRE(plain.expert_row(0)[0] == 0);
  REQUIRE(plain.expert_row(0)[1] == 1);
  r.bias.assign(E, 0.0f);
  r.bias[7] = 10.0f;
  r.select(ConstMatrixView<float>(z.data(), 1, E), biased);
  REQUIRE(biased.expert_row(0)[0] == 7);
  REQUIRE(biased.expert_row(0)[1] == 0);
  REQUIRE(biased.weight_row(0)[0] == Approx(ref::sigmoid(-4.0)));  // unbiased score
  REQUIRE(biased.weight_row(0)[1] == Approx(ref::sigmoid(3.0)));
}

TEST_CASE("GroupLimitedTopK masks dropped groups with -inf, not 0 (official semantics)",
          "[routing][deepseek]") {
  // Every s + b is negative. With HF's 0.0 mask a masked group's experts (key 0) would beat the
  // kept ones; with -inf they never can.
  Index const E = 4;
  std::vector<float> z = {0.0f, 0.0f, 0.0f, 0.0f};  // s = 0.5 each
  routing::GroupLimitedTopK r;
  r.num_experts = E;
  r.top_k = 2;
  r.n_group = 2;
  r.topk_group = 1;
  r.bias = {-1.0f, -1.2f, -2.0f, -2.0f};  // group 0 wins; keys are all < 0
  Selection sel;
  r.select(ConstMatrixView<float>(z.data(), 1, E), sel);
  REQUIRE(sel.expert_row(0)[0] == 0);
  REQUIRE(sel.expert_row(0)[1] == 1);
}

TEST_CASE("ExpertChoice: every expert takes exactly C tokens, weights are the probabilities",
          "[routing][expert_choice]") {
  for (float cf : {0.5f, 1.0f, 2.0f}) {
    Index const T = 40, E = 8;
    auto z = logits_for(T, E, 5);
    ConstMatrixView<float> logits(z.data(), T, E);
    routing::ExpertChoice r{E, cf, 2};
    Index const C = r.capacity(T);
    REQUIRE(C == std::max<Index>(2, static_cast<Index>(std::nearbyint(cf * 40.0 / 8.0))));
    Selection sel;
    r.select(logits, sel);
    test::require_same_routing(test::routing_of(sel), ref::expert_choice(logits, C));
    moe::RoutingPlan plan;
    moe::kernels::build_plan(sel, plan);
    for (Index e = 0; e < E; ++e) REQUIRE(plan.expert_rows(e) == C);
  }
  // Capacity is clamped to T.
  REQUIRE(routing::ExpertChoice{4, 1.0f, 4}.capacity(2) == 2);
}

TEST_CASE("TopP reproduces the hand cases of ALGORITHMS.md", "[routing][top_p]") {
  auto check = [](std::vector<double> p, std::vector<int> experts) {
    Index const E = static_cast<Index>(p.size());
    std::vector<float> z;
    for (double v : p) z.push_back(static_cast<float>(std::log(v)));
    Selection sel;
    routing::TopP{E, 0.4f, 0, false}.select(ConstMatrixView<float>(z.data(), 1, E), sel);
    auto got = test::routing_of(sel)[0];
    REQUIRE(got.size() == experts.size());
    for (std::size_t i = 0; i < experts.size(); ++i) {
      REQUIRE(got[i].first == experts[i]);
      REQUIRE(got[i].second == Approx(p[experts[i]]).epsilon(1e-5));
    }
  };
  check({0.5, 0.3, 0.2}, {0});
  check({0.35, 0.3, 0.2, 0.15}, {0, 1});
  check({0.15, 0.2, 0.3, 0.35}, {3, 2});
  // Random logits against the reference, and a cap.
  Index const T = 19, E = 16;
  auto z = logits_for(T, E, 8, 2.0f);
  ConstMatrixView<float> logits(z.data(), T, E);
  Selection sel;
  routing::TopP{E, 0.7f, 0, false}.select(logits, sel);
  test::require_same_routing(test::routing_of(sel), ref::top_p(logits, 0.7));
  routing::TopP{E, 0.99f, 3, false}.select(logits, sel);
  for (auto const& c : test::routing_of(sel)) REQUIRE(c.size() <= 3);
}

TEST_CASE("A huge capacity_factor saturates the capacity instead of overflowing",
          "[routing][capacity]") {
  // Found by tests/fuzz/fuzz_moe_ffn.cpp: 1e30 * T / E converted to Index was undefined
  // behaviour (UBSan; on x86 it gave INT64_MIN, so C fell back to min_capacity).
  REQUIRE(routing::ExpertChoice{4, 1e30f, 4}.capacity(12) == 12);
  routing::WithCapacity<routing::SoftmaxTopK> const r{{4, 2, false, 1.0f}, 1e30f, 4, false};
  REQUIRE(r.capacity(12) >= 12);
}

TEST_CASE("WithCapacity drops top-1 choices before top-2, in token order", "[routing][capacity]") {
  // 6 tokens, 2 experts, k = 2, C = max(round(cf * 6 / 2), 0) = 3 with cf = 1.
  // Tokens 0..3 prefer expert 0, tokens 4, 5 prefer expert 1.
  Index const T = 6, E = 2;
  std::vector<float> z = {2, 0, 2, 0, 2, 0, 2, 0, 0, 2, 0, 2};
  routing::WithCapacity<routing::SoftmaxTopK> r{{E, 2, false, 1.0f}, 1.0f, 0, false};
  REQUIRE(r.capacity(T) == 3);
  Selection sel;
  r.select(ConstMatrixView<float>(z.data(), T, E), sel);
  // Slot 0: tokens 0,1,2 fill expert 0; token 3 dropped; tokens 4,5 take expert 1 (2 of 3).
  // Slot 1: tokens 0..3 want expert 1: only token 0 fits; tokens 4,5 want expert 0: full.
  auto got = test::routing_of(sel);
  REQUIRE(got[0].size() == 2);
  REQUIRE(got[1].size() == 1);
  REQUIRE(got[1][0].first == 0);
  REQUIRE(got[3].empty());
  REQUIRE(got[4].size() == 1);
  REQUIRE(got[4][0].first == 1);
  REQUIRE(sel.dropped == 12 - 6);
  Index dropped = 0;
  auto want =
      ref::with_capacity(ref::softmax_top_k(ConstMatrixView<float>(z.data(), T, E), 2, false, 1.0),
                         E, 3, false, &dropped);
  test::require_same_routing(got, want);
  REQUIRE(dropped == sel.dropped);
}

TEST_CASE("WithCapacity matches the reference, token order and batch-prioritized",
          "[routing][capacity]") {
  Index const T = 50, E = 8;
  auto z = logits_for(T, E, 41);
  ConstMatrixView<float> logits(z.data(), T, E);
  for (bool prioritized : {false, true}) {
    routing::WithCapacity<routing::SoftmaxTopK> r{{E, 2, true, 1.0f}, 1.0f, 4, prioritized};
    Selection sel;
    r.select(logits, sel);
    Index dropped = 0;
    auto want = ref::with_capacity(ref::softmax_top_k(logits, 2, true, 1.0), E, r.capacity(T),
                                   prioritized, &dropped);
    test::require_same_routing(test::routing_of(sel), want);
    REQUIRE(sel.dropped == dropped);
    REQUIRE(dropped > 0);
  }
}

TEST_CASE("OnePerGroupTopK never picks two experts of one group", "[routing][groups]") {
  Index const T = 33, E = 16;
  auto z = logits_for(T, E, 12);
  ConstMatrixView<float> logits(z.data(), T, E);
  for (bool normalize : {false, true}) {
    routing::OnePerGroupTopK r{E, 3, 4, normalize, 1.0f, routing::ScoreFunction::kSoftmax};
    REQUIRE_NOTHROW(r.validate());
    Selection sel;
    r.select(logits, sel);
    test::require_same_routing(test::routing_of(sel), ref::one_per_group(logits, 3, 4, normalize));
    for (auto const& c : test::routing_of(sel)) {
      std::set<int> groups;
      for (auto [e, w] : c) groups.insert(e / 4);
      REQUIRE(groups.size() == c.size());
    }
  }
}

TEST_CASE("Ties break to the lower expert index in every policy", "[routing][ties]") {
  Index const E = 8;
  std::vector<float> z(E, 0.5f);
  ConstMatrixView<float> logits(z.data(), 1, E);
  Selection sel;
  auto first_experts = [&](Index k) {
    for (Index s = 0; s < k; ++s) REQUIRE(sel.expert_row(0)[s] == s);
  };
  routing::SoftmaxTopK{E, 3, false, 1.0f}.select(logits, sel);
  first_experts(3);
  routing::TopKSoftmax{E, 3}.select(logits, sel);
  first_experts(3);
  routing::GroupLimitedTopK g;
  g.num_experts = E;
  g.top_k = 3;
  g.n_group = 4;
  g.topk_group = 2;
  g.select(logits, sel);
  first_experts(3);
  routing::OnePerGroupTopK{E, 3, 4, false, 1.0f, routing::ScoreFunction::kSoftmax}.select(logits,
                                                                                          sel);
  REQUIRE(sel.expert_row(0)[0] == 0);
  REQUIRE(sel.expert_row(0)[1] == 2);
  REQUIRE(sel.expert_row(0)[2] == 4);
  routing::TopP{E, 0.3f, 0, false}.select(logits, sel);
  first_experts(3);  // 3 * 1/8 = 0.375 > 0.3
  REQUIRE(sel.expert_row(0)[3] == -1);
  // Expert choice over equal tokens: the lower token index wins.
  std::vector<float> zt(4 * 2, 0.0f);
  routing::ExpertChoice{2, 1.0f, 1}.select(ConstMatrixView<float>(zt.data(), 4, 2), sel);
  REQUIRE(sel.expert_row(0)[0] == 0);
  REQUIRE(sel.expert_row(1)[0] == 0);
  REQUIRE(sel.expert_row(2)[0] == -1);
}

TEST_CASE("Unavailable experts (-inf logits) are never selected", "[routing][mask]") {
  Index const T = 12, E = 8;
  auto z = logits_for(T, E, 77);
  for (Index t = 0; t < T; ++t) {
    z[t * E + 0] = -kInf;
    z[t * E + 5] = -kInf;
  }
  ConstMatrixView<float> logits(z.data(), T, E);
  Selection sel;
  auto check_none = [&] {
    for (auto const& c : test::routing_of(sel)) {
      for (auto [e, w] : c) {
        REQUIRE(e != 0);
        REQUIRE(e != 5);
        REQUIRE(std::isfinite(w));
      }
    }
  };
  routing::SoftmaxTopK{E, 6, true, 1.0f}.select(logits, sel);
  check_none();
  REQUIRE(test::routing_of(sel)[0].size() == 6);
  routing::SoftmaxTopK{E, 8, true, 1.0f}.select(logits, sel);  // only 6 available
  check_none();
  REQUIRE(test::routing_of(sel)[0].size() == 6);
  routing::TopKSoftmax{E, 4}.select(logits, sel);
  check_none();
  routing::GroupLimitedTopK g;
  g.num_experts = E;
  g.top_k = 4;
  g.n_group = 4;
  g.topk_group = 2;
  g.select(logits, sel);
  check_none();
  routing::ExpertChoice{E, 1.0f, 2}.select(logits, sel);
  check_none();
  routing::TopP{E, 0.9f, 0, false}.select(logits, sel);
  check_none();
  routing::OnePerGroupTopK{E, 4, 4, false, 1.0f, routing::ScoreFunction::kSoftmax}.select(logits,
                                                                                          sel);
  check_none();
}

TEST_CASE("RoutingControls steer, mask and scale any policy", "[routing][controls]") {
  Index const T = 16, E = 8;
  auto z = logits_for(T, E, 99);
  std::vector<float> offsets(E, 0.0f);
  offsets[6] = 100.0f;  // steer every token to expert 6
  std::vector<std::uint8_t> mask(E, 1);
  mask[2] = 0;
  std::vector<float> mult(E, 1.0f);
  mult[6] = 0.5f;
  routing::RoutingControls c;
  c.logit_offset = offsets;
  c.expert_mask = mask;
  c.weight_multiplier = mult;
  REQUIRE_NOTHROW(c.validate(E));
  std::vector<float> zc = z;
  c.apply_to_logits(moe::MatrixView<float>(zc.data(), T, E));
  Selection sel;
  routing::SoftmaxTopK{E, 2, false, 1.0f}.select(ConstMatrixView<float>(zc.data(), T, E), sel);
  std::vector<float> before = sel.weight;
  c.apply_to_weights(sel);
  for (Index t = 0; t < T; ++t) {
    REQUIRE(sel.expert_row(t)[0] == 6);
    REQUIRE(sel.expert_row(t)[1] != 2);
    REQUIRE(sel.weight_row(t)[0] == before[t * 2] * 0.5f);
    REQUIRE(sel.weight_row(t)[1] == before[t * 2 + 1]);
  }
  std::vector<std::uint8_t> none(E, 0);
  routing::RoutingControls all_masked;
  all_masked.expert_mask = none;
  REQUIRE_THROWS_WITH(all_masked.validate(E), Catch::Contains("removes every expert"));
  std::vector<float> short_offsets(3, 0.0f);
  routing::RoutingControls wrong;
  wrong.logit_offset = short_offsets;
  REQUIRE_THROWS_WITH(wrong.validate(E), Catch::Contains("logit_offset has 3 entries"));
}

TEST_CASE("Invalid routing configurations get a clear moe::Error", "[routing][errors]") {
  REQUIRE_THROWS_WITH((routing::SoftmaxTopK{4, 5, false, 1.0f}.validate()),
                      Catch::Contains("top_k = 5") && Catch::Contains("[1, num_experts]"));
  REQUIRE_THROWS_AS((routing::SoftmaxTopK{4, 0, false, 1.0f}.validate()), moe::Error);
  REQUIRE_THROWS_AS((routing::TopKSoftmax{0, 1}.validate()), moe::Error);
  routing::GroupLimitedTopK g;
  g.num_experts = 10;
  g.top_k = 2;
  g.n_group = 4;
  g.topk_group = 2;
  REQUIRE_THROWS_WITH(g.validate(),
                      Catch::Contains("n_group = 4 does not divide num_experts = 10"));
  g.num_experts = 8;
  g.topk_group = 5;
  REQUIRE_THROWS_WITH(g.validate(), Catch::Contains("topk_group = 5"));
  g.topk_group = 1;
  g.top_k = 3;
  REQUIRE_THROWS_WITH(g.validate(), Catch::Contains("exceeds the 2 experts in the kept groups"));
  g.top_k = 2;
  g.bias = {1.0f};
  REQUIRE_THROWS_WITH(g.validate(), Catch::Contains("bias has 1 entries"));
  REQUIRE_THROWS_AS(
      (routing::OnePerGroupTopK{8, 5, 4, false, 1.0f, routing::ScoreFunction::kSoftmax}.validate()),
      moe::Error);
  REQUIRE_THROWS_AS((routing::ExpertChoice{8, 0.0f, 4}.validate()), moe::Error);
  REQUIRE_THROWS_AS((routing::TopP{8, 1.5f, 0, false}.validate()), moe::Error);
  REQUIRE_THROWS_AS(
      (routing::WithCapacity<routing::SoftmaxTopK>{{8, 2, false, 1.0f}, -1.0f, 4, false}
           .validate()),
      moe::Error);
}

TEST_CASE("routing_stats counts loads, imbalance, entropies and drops", "[routing][stats]") {
  // 4 tokens, 2 experts, top-1: 3 tokens to expert 0, 1 to expert 1.
  std::vector<float> z = {1, 0, 1, 0, 1, 0, 0, 1};
  Selection sel;
  routing::SoftmaxTopK{2, 1, false, 1.0f}.select(ConstMatrixView<float>(z.data(), 4, 2), sel);
  moe::RoutingPlan plan;
  moe::kernels::build_plan(sel, plan);
  auto st = routing::routing_stats(plan, sel);
  REQUIRE(st.tokens_per_expert == std::vector<Index>{3, 1});
  REQUIRE(st.min_load == 1);
  REQUIRE(st.max_load == 3);
  REQUIRE(st.imbalance == Approx(1.5));
  REQUIRE(st.load_entropy == Approx(-(0.75 * std::log(0.75) + 0.25 * std::log(0.25))));
  double const p = 1.0 / (1.0 + std::exp(-1.0));
  REQUIRE(st.router_entropy ==
          Approx(-(p * std::log(p) + (1 - p) * std::log(1 - p))).epsilon(1e-5));
  REQUIRE(st.dropped == 0);
}
