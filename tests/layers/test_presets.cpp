// SPDX-License-Identifier: Apache-2.0
// Presets: the family defaults, and each family's layer at small sizes against the reference.
#include <catch2/catch.hpp>

#include "moe/layers/presets.hpp"
#include "support/helpers.hpp"
#include "support/layer_reference.hpp"

using moe::Index;
namespace presets = moe::presets;

namespace {

template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  moe::fill_uniform(layer.experts().edit().parameters(), -0.2f, 0.2f, seed);
  auto wr = layer.router_weight();
  moe::fill_uniform(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f,
                    0.5f, seed + 1);
  if constexpr (Layer::Shared::has_experts) {
    moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.2f, 0.2f, seed + 2);
    auto g = layer.shared_experts().gate_weight();
    moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f,
                      0.5f, seed + 3);
  }
}

template <class Layer, class RouteRef>
void check(Layer& layer, RouteRef route_ref) {
  randomize(layer, 7);
  Index const T = 33, D = layer.d_model();
  auto x = test::random_vector(T * D, 8);
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  moe::ThreadPool pool(2);
  layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, {nullptr, &pool});
  auto r = route_ref(ws.logits_view());
  test::require_same_routing(test::routing_of(ws.selection), r);
  REQUIRE(test::max_rel_diff(y.data(), ref::layer_forward(layer, {x.data(), T, D}, r)) < 2e-5);
}

}  // namespace

TEST_CASE("Preset configs carry the published defaults", "[layers][presets]") {
  presets::MixtralConfig mx;
  REQUIRE(mx.hidden_size == 4096);
  REQUIRE(mx.intermediate_size == 14336);
  REQUIRE(mx.num_local_experts == 8);
  REQUIRE(mx.num_experts_per_tok == 2);
  presets::Qwen2MoeConfig q2;
  REQUIRE(q2.num_experts == 60);
  REQUIRE(q2.num_experts_per_tok == 4);
  REQUIRE(q2.moe_intermediate_size == 1408);
  REQUIRE(q2.shared_expert_intermediate_size == 5632);
  REQUIRE_FALSE(q2.norm_topk_prob);
  presets::Qwen3MoeConfig q3;
  REQUIRE(q3.num_experts == 128);
  REQUIRE(q3.num_experts_per_tok == 8);
  REQUIRE(q3.moe_intermediate_size == 768);
  presets::DeepseekV3Config ds;
  REQUIRE(ds.n_routed_experts == 256);
  REQUIRE(ds.n_group == 8);
  REQUIRE(ds.topk_group == 4);
  REQUIRE(ds.routed_scaling_factor == 2.5f);
  REQUIRE(ds.n_shared_experts == 1);
  presets::OlmoeConfig ol;
  REQUIRE(ol.num_experts == 64);
  REQUIRE(ol.num_experts_per_tok == 8);
  REQUIRE_FALSE(ol.norm_topk_prob);
}

TEST_CASE("Mixtral preset matches the reference", "[layers][presets]") {
  auto layer = presets::make_mixtral({16, 24, 8, 2});
  check(layer, [](auto z) { return ref::softmax_top_k(z, 2, true, 1.0); });
}

TEST_CASE("Qwen2-MoE preset matches the reference (gated shared expert)", "[layers][presets]") {
  auto layer = presets::make_qwen2_moe({16, 12, 40, 6, 4, false});
  REQUIRE(layer.shared_experts().count() == 1);
  REQUIRE(layer.shared_experts().bank().d_ffn() == 40);
  check(layer, [](auto z) { return ref::softmax_top_k(z, 4, false, 1.0); });
}

TEST_CASE("Qwen3-MoE preset matches the reference", "[layers][presets]") {
  auto layer = presets::make_qwen3_moe({16, 12, 16, 4, true});
  check(layer, [](auto z) { return ref::softmax_top_k(z, 4, true, 1.0); });
}

TEST_CASE("DeepSeek-V3 preset matches the reference (groups, bias, scale, shared)",
          "[layers][presets]") {
  presets::DeepseekV3Config c;
  c.hidden_size = 16;
  c.moe_intermediate_size = 8;
  c.n_routed_experts = 32;
  c.num_experts_per_tok = 4;
  c.n_group = 8;
  c.topk_group = 2;
  c.n_shared_experts = 2;
  auto layer = presets::make_deepseek_v3(c);
  REQUIRE(layer.shared_experts().count() == 1);
  REQUIRE(layer.shared_experts().bank().d_ffn() == 16);  // n_shared * moe_intermediate
  layer.router().bias = test::random_vector(32, 3, -0.1f, 0.1f);
  auto bias = layer.router().bias;
  check(layer, [&](auto z) { return ref::group_limited(z, 4, 8, 2, true, 2.5, true, bias, true); });
}

TEST_CASE("OLMoE preset matches the reference", "[layers][presets]") {
  auto layer = presets::make_olmoe({16, 12, 16, 8, false});
  check(layer, [](auto z) { return ref::softmax_top_k(z, 8, false, 1.0); });
}

TEST_CASE("The 2026 presets carry their families' defaults and route as their families",
          "[layers][presets]") {
  presets::Qwen3NextConfig const qn;
  REQUIRE(qn.num_experts == 512);
  REQUIRE(qn.num_experts_per_tok == 10);
  REQUIRE(qn.norm_topk_prob);
  presets::Glm4MoeConfig const glm;
  REQUIRE(glm.n_routed_experts == 128);
  REQUIRE(glm.moe_intermediate_size == 1408);
  presets::DeepseekV2Config const v2;
  REQUIRE(v2.routed_scaling_factor == 16.0f);
  REQUIRE(v2.num_experts_per_tok == 6);
  presets::MinimaxM2Config const mm;
  REQUIRE(mm.num_local_experts == 256);
  presets::Ernie45MoeConfig const er;
  REQUIRE(er.moe_k == 6);
  REQUIRE(er.moe_norm_min == 1e-12f);

  SECTION("Qwen3-Next: as Qwen2-MoE") {
    auto layer = presets::make_qwen3_next({16, 12, 20, 16, 4, true});
    REQUIRE(layer.shared_experts().bank().d_ffn() == 20);
    check(layer, [](auto z) { return ref::softmax_top_k(z, 4, true, 1.0); });
  }
  SECTION("GLM-4.5: as DeepSeek-V3") {
    auto layer = presets::make_glm4_moe({16, 8, 16, 4, 4, 2, 1.5f, 2, true});
    REQUIRE(layer.shared_experts().bank().d_ffn() == 16);
    layer.router().bias = test::random_vector(16, 4, -0.1f, 0.1f);
    auto bias = layer.router().bias;
    check(layer,
          [&](auto z) { return ref::group_limited(z, 4, 4, 2, true, 1.5, true, bias, true); });
  }
  SECTION("DeepSeek-V2: softmax, group max, scaled, not renormalised, no bias") {
    auto layer = presets::make_deepseek_v2({16, 8, 16, 4, 4, 2, 16.0f, 2});
    REQUIRE(layer.router().bias.empty());
    check(layer,
          [](auto z) { return ref::group_limited(z, 4, 4, 2, false, 16.0, false, {}, false); });
  }
  SECTION("MiniMax-M2: sigmoid, bias, renormalised without epsilon, no shared expert") {
    auto layer = presets::make_minimax_m2({16, 8, 16, 4});
    REQUIRE(layer.shared_experts().count() == 0);
    layer.router().bias = test::random_vector(16, 5, -0.1f, 0.1f);
    auto bias = layer.router().bias;
    check(layer,
          [&](auto z) { return ref::group_limited(z, 4, 1, 1, true, 1.0, true, bias, true, 0.0); });
  }
  SECTION("ERNIE 4.5: softmax, bias on the probabilities, clamped renormalisation") {
    auto layer = presets::make_ernie4_5_moe({16, 8, 16, 4, 2, 0.6f});
    REQUIRE(layer.shared_experts().bank().d_ffn() == 16);
    layer.router().bias = test::random_vector(16, 6, -0.02f, 0.02f);
    auto bias = layer.router().bias;
    check(layer, [&](auto z) {
      return ref::group_limited(z, 4, 1, 1, true, 1.0, false, bias, true, 0.0, 0.6);
    });
  }
}
