// SPDX-License-Identifier: Apache-2.0
// Golden digests of MoeFfn (each router family, shared experts ungated and gated, Default MoE,
// packed fp32 and bf16 weights, MLP experts, few-row experts) and MoeAttention: y, dx and every
// gradient on fixed inputs, for 1 and 2 threads. Recorded before the pipeline was split into
// stages (issue 16) and kept: a change of the pipeline that moves any output bit fails here.
// See tests/support/golden.hpp for the arch keys.
#include <catch2/catch.hpp>
#include <vector>

#include "moe/balance/switch_aux.hpp"
#include "moe/core/random.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/gating/sdpa_gate.hpp"
#include "moe/layers/moe_attention.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/capacity.hpp"
#include "moe/routing/expert_choice.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "moe/routing/top_p.hpp"
#include "support/golden.hpp"
#include "support/helpers.hpp"

using moe::Index;
namespace routing = moe::routing;
namespace experts = moe::experts;

namespace {

// clang-format off
test::GoldenEntry const kGolden[] = {
#include "layers/golden_digests.inc"
};
// clang-format on

template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  auto params = layer.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    float const a = params[i].name == "router.weight" ? 1.0f : 0.5f;
    moe::fill_uniform(params[i].values, -a, a, seed + i);
  }
}

/// One digest of: inference y at 1 and 2 threads (required equal), then `steps` training steps
/// (forward_train, backward: y, dx, every gradient, aux loss) at 1 and 2 threads (equal).
template <class Layer>
std::uint64_t ffn_digest(Layer& layer, Index T, int steps = 1, bool train = true) {
  Index const D = layer.d_model();
  auto x = test::random_vector(T * D, 11);
  auto dy = test::random_vector(T * D, 12);
  moe::ThreadPool pool(2);
  test::Digest dg;
  std::vector<float> y1(x.size()), y2(x.size());
  moe::MoeFfnWorkspace ws1, ws2;
  layer.forward({x.data(), T, D}, {y1.data(), T, D}, ws1);
  layer.forward({x.data(), T, D}, {y2.data(), T, D}, ws2, {.pool = &pool});
  REQUIRE(y1 == y2);
  dg.add(y1.data(), y1.size());
  dg.add(ws1.aux_loss);
  if (!train) return dg.value();
  for (int step = 0; step < steps; ++step) {
    std::vector<float> dx1(x.size()), dx2(x.size());
    auto g1 = layer.make_gradients();
    auto g2 = layer.make_gradients();
    // Both thread counts from the same layer state: stateful parts (Default-MoE EMA) are
    // updated by the forward_train, so run the 2-thread step on a copy.
    Layer twin = layer;
    layer.forward_train({x.data(), T, D}, {y1.data(), T, D}, ws1);
    layer.backward(ws1, {dy.data(), T, D}, {dx1.data(), T, D}, g1);
    twin.forward_train({x.data(), T, D}, {y2.data(), T, D}, ws2, {.pool = &pool});
    twin.backward(ws2, {dy.data(), T, D}, {dx2.data(), T, D}, g2, &pool);
    REQUIRE(y1 == y2);
    REQUIRE(dx1 == dx2);
    dg.add(y1.data(), y1.size());
    dg.add(dx1.data(), dx1.size());
    dg.add(ws1.aux_loss);
    auto l1 = g1.groups();
    auto l2 = g2.groups();
    REQUIRE(l1.size() == l2.size());
    for (std::size_t i = 0; i < l1.size(); ++i) {
      INFO("gradient " << l1[i].name);
      REQUIRE(std::equal(l1[i].values.begin(), l1[i].values.end(), l2[i].values.begin()));
      dg.add(l1[i].values);
    }
    if (layer.default_moe().enabled) {
      auto d = layer.default_outputs();
      dg.add(d.data, static_cast<std::size_t>(d.rows * d.cols));
    }
  }
  return dg.value();
}

constexpr Index kD = 64;

}  // namespace

TEST_CASE("golden: MoeFfn routers, experts and shared experts", "[golden][bf16]") {
  SECTION("softmax top-k, SwiGLU, Switch aux") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, experts::NoSharedExperts,
                moe::balance::SwitchAux>
        layer(kD, 64, routing::SoftmaxTopK{8, 2, true, 1.0f});
    randomize(layer, 100);
    test::check_golden(kGolden, "ffn_softmax_topk_T70", ffn_digest(layer, 70));
    test::check_golden(kGolden, "ffn_softmax_topk_T5", ffn_digest(layer, 5));
    test::check_golden(kGolden, "ffn_softmax_topk_T1", ffn_digest(layer, 1));
    layer.pack_weights();
    test::check_golden(kGolden, "ffn_softmax_topk_packed_f32_T70", ffn_digest(layer, 70));
    test::check_golden(kGolden, "ffn_softmax_topk_packed_f32_T5", ffn_digest(layer, 5));
    layer.pack_weights(experts::WeightFormat::kBf16);
    test::check_golden(kGolden, "ffn_softmax_topk_packed_bf16_T70",
                       ffn_digest(layer, 70, 1, false));
    test::check_golden(kGolden, "ffn_softmax_topk_packed_bf16_T3", ffn_digest(layer, 3, 1, false));
  }
  SECTION("top-k softmax, GeGLU, unaligned F") {
    moe::MoeFfn<routing::TopKSoftmax, experts::GeGlu> layer(kD, 40, routing::TopKSoftmax{8, 2});
    randomize(layer, 200);
    test::check_golden(kGolden, "ffn_topk_softmax_F40_T70", ffn_digest(layer, 70));
  }
  SECTION("group-limited top-k with bias, ungated shared expert") {
    routing::GroupLimitedTopK r;
    r.num_experts = 8;
    r.top_k = 2;
    r.n_group = 4;
    r.topk_group = 2;
    r.scale = 2.5f;
    r.bias = test::random_vector(8, 301);
    moe::MoeFfn<routing::GroupLimitedTopK, experts::SwiGlu,
                experts::UngatedSharedExperts<experts::SwiGlu>>
        layer(kD, 32, r, experts::UngatedSharedExperts<experts::SwiGlu>(1, kD, 64));
    randomize(layer, 300);
    test::check_golden(kGolden, "ffn_group_limited_shared_T70", ffn_digest(layer, 70));
    layer.pack_weights(experts::WeightFormat::kBf16);
    test::check_golden(kGolden, "ffn_group_limited_shared_bf16_T70",
                       ffn_digest(layer, 70, 1, false));
  }
  SECTION("softmax top-k, gated shared experts") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu, experts::GatedSharedExperts<experts::SwiGlu>>
        layer(kD, 64, routing::SoftmaxTopK{8, 2, false, 1.0f},
              experts::GatedSharedExperts<experts::SwiGlu>(2, kD, 32));
    randomize(layer, 400);
    test::check_golden(kGolden, "ffn_gated_shared_T70", ffn_digest(layer, 70));
    layer.pack_weights();
    test::check_golden(kGolden, "ffn_gated_shared_packed_T70", ffn_digest(layer, 70));
  }
  SECTION("expert choice, GELU MLP") {
    moe::MoeFfn<routing::ExpertChoice, experts::GeluMlp> layer(kD, 48,
                                                               routing::ExpertChoice{8, 1.0f, 4});
    randomize(layer, 500);
    test::check_golden(kGolden, "ffn_expert_choice_mlp_T70", ffn_digest(layer, 70));
  }
  SECTION("capacity, token dropping") {
    routing::WithCapacity<routing::SoftmaxTopK> r;
    r.inner = routing::SoftmaxTopK{8, 2, true, 1.0f};
    r.capacity_factor = 0.75f;
    moe::MoeFfn<routing::WithCapacity<routing::SoftmaxTopK>, experts::SwiGlu> layer(kD, 32, r);
    randomize(layer, 600);
    test::check_golden(kGolden, "ffn_capacity_T70", ffn_digest(layer, 70));
  }
  SECTION("top-p, ReLU MLP") {
    moe::MoeFfn<routing::TopP, experts::ReluMlp> layer(kD, 32, routing::TopP{8, 0.5f, 3, true});
    randomize(layer, 700);
    test::check_golden(kGolden, "ffn_top_p_T70", ffn_digest(layer, 70));
  }
  SECTION("Default MoE, forward mode, two steps") {
    moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu> layer(kD, 32,
                                                             routing::SoftmaxTopK{8, 2, true});
    randomize(layer, 800);
    layer.default_moe().enabled = true;
    layer.default_moe().mode = moe::DefaultMoe::Mode::kForward;
    test::check_golden(kGolden, "ffn_default_moe_T70", ffn_digest(layer, 70, 2));
  }
}

TEST_CASE("golden: MoeAttention", "[golden][bf16]") {
  using Bank = experts::ExpertBank<experts::SiluMlp>;
  Index const D = 32, B = 2, S = 20, T = B * S;
  auto digest = [&](auto& layer, Bank& bank) {
    auto x = test::random_vector(T * D, 21);
    auto dy = test::random_vector(T * D, 22);
    moe::ThreadPool pool(2);
    test::Digest dg;
    std::vector<float> y1(x.size()), y2(x.size()), dx1(x.size()), dx2(x.size());
    moe::MoeAttentionWorkspace ws1, ws2;
    moe::AttentionOptions o1{.batch = B}, o2{.pool = &pool, .batch = B};
    layer.forward({x.data(), T, D}, {y1.data(), T, D}, ws1, o1);
    layer.forward({x.data(), T, D}, {y2.data(), T, D}, ws2, o2);
    REQUIRE(y1 == y2);
    dg.add(y1.data(), y1.size());
    auto g1 = layer.make_gradients();
    auto g2 = layer.make_gradients();
    Bank b1(bank.num_experts(), D, bank.d_ffn()), b2(bank.num_experts(), D, bank.d_ffn());
    layer.forward_train({x.data(), T, D}, {y1.data(), T, D}, ws1, o1);
    layer.backward(ws1, {dy.data(), T, D}, {dx1.data(), T, D}, g1, b1);
    layer.forward_train({x.data(), T, D}, {y2.data(), T, D}, ws2, o2);
    layer.backward(ws2, {dy.data(), T, D}, {dx2.data(), T, D}, g2, b2, &pool);
    REQUIRE(y1 == y2);
    REQUIRE(dx1 == dx2);
    dg.add(y1.data(), y1.size());
    dg.add(dx1.data(), dx1.size());
    auto l1 = g1.groups();
    auto l2 = g2.groups();
    for (std::size_t i = 0; i < l1.size(); ++i) {
      INFO("gradient " << l1[i].name);
      REQUIRE(std::equal(l1[i].values.begin(), l1[i].values.end(), l2[i].values.begin()));
      dg.add(l1[i].values);
    }
    auto p1 = std::as_const(b1).parameters();
    auto p2 = std::as_const(b2).parameters();
    REQUIRE(std::equal(p1.begin(), p1.end(), p2.begin()));
    dg.add(p1.data(), p1.size());
    return dg.value();
  };
  // MoeAttention runs its experts through the routed-experts engine since issue 16, whose fused
  // activation epilogue evaluates the activation of every column with the SIMD exp; the old
  // separate pass took the scalar std::exp for the last F mod L columns. With F a multiple of
  // the lane count (the F = 32 case here, or the AVX2 build's 8 lanes) the digests are those of
  // the code before the change; F = 24 on AVX-512 was re-recorded after it.
  for (Index F : {Index{24}, Index{32}}) {
    DYNAMIC_SECTION("low-rank queries, residual query, RoPE, headwise gate, gated shared expert, F "
                    << F) {
      Bank bank(4, D, F);
      moe::fill_uniform(bank.edit().parameters(), -0.5f, 0.5f, 900);
      moe::MoeAttentionConfig c;
      c.d_model = D;
      c.qk_dim = 16;
      c.q_rank = 8;
      c.residual_query = true;
      c.rope = true;
      moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp,
                        experts::GatedSharedExperts<experts::SiluMlp>, moe::gating::HeadwiseGate>
          layer(c, routing::SoftmaxTopK{4, 2}, bank,
                experts::GatedSharedExperts<experts::SiluMlp>(1, D, F));
      randomize(layer, 910);
      test::check_golden(kGolden, F == 24 ? "attn_umoe_full" : "attn_umoe_full_F32",
                         digest(layer, bank));
    }
  }
  SECTION("full-rank queries, no gate, packed bank") {
    Bank bank(4, D, 32);
    moe::fill_uniform(bank.edit().parameters(), -0.5f, 0.5f, 920);
    bank.pack();
    moe::MoeAttentionConfig c;
    c.d_model = D;
    c.qk_dim = 16;
    moe::MoeAttention<routing::SoftmaxTopK, experts::SiluMlp> layer(c, routing::SoftmaxTopK{4, 2},
                                                                    bank);
    randomize(layer, 930);
    test::check_golden(kGolden, "attn_umoe_packed", digest(layer, bank));
  }
}
