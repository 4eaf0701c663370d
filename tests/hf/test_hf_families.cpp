// SPDX-License-Identifier: Apache-2.0
// The families that reuse the Qwen2-MoE and DeepSeek-V3 layer types (Qwen3-Next, GLM-4.5,
// DeepSeek-V2, MiniMax-M2, ERNIE 4.5): a checkpoint written by save_hf_layer(), read back tensor
// by tensor under the names transformers loads, and run through an independent double-precision
// transcription of each family's transformers forward (modeling_<family>.py); the layer that
// load_hf_moe_layer() builds must pick the same experts and give the same output.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <variant>
#include <vector>

#include "hf/hf_moe_reference.hpp"
#include "hf/hf_test_support.hpp"
#include "io/io_test_support.hpp"
#include "moe/io/hf.hpp"

namespace {

using moe::Index;
using moe::io::HfFamily;
using moe::io::HfMoeConfig;
namespace fs = std::filesystem;

using namespace hfref;

/// A tiny config of `family` (parsed from config.json text, then shrunk), MoE layer 1.
HfMoeConfig tiny(std::string const& type) {
  HfMoeConfig c = moe::io::parse_hf_config(
      moe::io::detail::concat("{\"model_type\": \"", type, "\", \"num_experts_per_tok\": 3}"));
  c.hidden_size = 12;
  c.expert_intermediate_size = 6;
  c.num_experts = 8;
  c.shared_expert_intermediate_size = 10;
  c.n_shared_experts = 2;
  c.num_hidden_layers = 3;
  c.decoder_sparse_step = 1;
  c.first_k_dense_replace = 1;
  c.routed_scaling_factor = 1.5f;
  if (c.family == HfFamily::kGlm4Moe) c.n_group = 4, c.topk_group = 2;
  if (c.family == HfFamily::kDeepseekV2) {
    c.topk_method = "group_limited_greedy";
    c.n_group = 4;
    c.topk_group = 2;
  }
  c.defaulted_keys.clear();
  return c;
}

/// save_hf_layer(random layer of `c`), load_hf_moe_layer, forward; compares with hf_forward().
void check_family(HfMoeConfig const& c, std::string const& prefix, std::uint64_t seed) {
  INFO(c.model_type());
  using Layer = moe::presets::DeepseekV3Moe;
  fs::path const dir = iotest::scratch_dir(moe::io::detail::concat("family_", c.model_type()));
  auto save = [&](auto layer) {
    hftest::randomize(layer, seed);
    if constexpr (requires { layer.router().bias; }) {
      // Biases comparable to the score differences, so that they change the selection.
      if (!layer.router().bias.empty()) {
        moe::fill_uniform(layer.router().bias, -0.2f, 0.2f, seed + 9);
      }
    }
    moe::io::save_hf_layer(dir, c, 1, layer);
  };
  if (c.family == HfFamily::kQwen3Next) {
    save(moe::io::make_hf_layer<moe::presets::Qwen2Moe>(c));
  } else {
    save(moe::io::make_hf_layer<Layer>(c));
  }
  Checkpoint const ck(dir / "model.safetensors");
  REQUIRE_FALSE(ck.has(prefix + "gate.bias"));
  Index const T = 29, H = c.hidden_size, k = c.num_experts_per_tok;
  std::vector<float> const x = hftest::random_input(T, H, seed + 5);
  Reference const want = hf_forward(c, ck, prefix, x);

  moe::io::HfAnyLayer any = moe::io::load_hf_moe_layer(dir, 1, {prefix, true});
  std::visit(
      [&](auto const& hf) {
        REQUIRE(hf.config.family == c.family);
        REQUIRE(hf.layout.prefix == prefix);
        REQUIRE(hf.warnings.empty());
        std::vector<float> y(x.size());
        moe::MoeFfnWorkspace ws;
        hf.layer.forward({x.data(), T, H}, {y.data(), T, H}, ws);
        for (Index t = 0; t < T; ++t) {
          INFO("token " << t);
          for (Index j = 0; j < k; ++j) {
            REQUIRE(ws.selection.expert[t * k + j] == want.chosen[t][j]);
          }
        }
        double scale = 0.0, diff = 0.0;
        for (std::size_t i = 0; i < y.size(); ++i) {
          scale = std::max(scale, std::fabs(want.y[i]));
          diff = std::max(diff, std::fabs(y[i] - want.y[i]));
        }
        REQUIRE(scale > 0.01);  // not a vacuous comparison
        REQUIRE(diff / scale < 2e-6);
      },
      any);
}

}  // namespace

TEST_CASE("Qwen3-Next: softmax top-k, renormalised, sigmoid-gated shared expert",
          "[hf][families]") {
  HfMoeConfig c = tiny("qwen3_next");
  for (bool const norm : {true, false}) {
    c.norm_topk_prob = norm;
    check_family(c, "model.layers.1.mlp.", 101);
  }
}

TEST_CASE("GLM-4.5: sigmoid, selection bias, top-2-sum groups, scaled, shared experts",
          "[hf][families]") {
  HfMoeConfig c = tiny("glm4_moe");
  for (bool const norm : {true, false}) {
    c.norm_topk_prob = norm;
    check_family(c, "model.layers.1.mlp.", 102);
  }
}

TEST_CASE("DeepSeek-V2: softmax, group max, scaled and never renormalised", "[hf][families]") {
  HfMoeConfig c = tiny("deepseek_v2");
  check_family(c, "model.layers.1.mlp.", 103);
  c.topk_method = "greedy";
  c.n_group = c.topk_group = 1;
  check_family(c, "model.layers.1.mlp.", 104);
}

TEST_CASE("MiniMax-M2: block_sparse_moe, w1/w3/w2, bias on the block, renormalised",
          "[hf][families]") {
  check_family(tiny("minimax_m2"), "model.layers.1.block_sparse_moe.", 105);
}

TEST_CASE("ERNIE 4.5: bias added to the probabilities, clamped renormalisation, shared experts",
          "[hf][families]") {
  HfMoeConfig c = tiny("ernie4_5_moe");
  check_family(c, "model.layers.1.mlp.", 106);
  // A moe_norm_min above the weights' sum: the sum is clamped (weights no longer sum to 1).
  c.moe_norm_min = 0.9f;
  check_family(c, "model.layers.1.mlp.", 107);
  // use_bias: every routed and shared expert projection has a bias.
  c.moe_norm_min = 1e-12f;
  c.use_bias = true;
  check_family(c, "model.layers.1.mlp.", 108);
}

namespace {

/// Loads layer 1 of `dir` and compares its forward with `want` (routing equal, y within 2e-6).
void check_gpt_oss_layer(fs::path const& dir, Reference const& want, std::vector<float> const& x,
                         Index H, Index k) {
  moe::io::HfAnyLayer any = moe::io::load_hf_moe_layer(dir, 1, {{}, true});
  REQUIRE(std::holds_alternative<moe::io::HfLayer<moe::presets::GptOssMoe>>(any));
  auto const& hf = std::get<moe::io::HfLayer<moe::presets::GptOssMoe>>(any);
  REQUIRE(hf.layout.prefix == "model.layers.1.mlp.");
  REQUIRE(hf.warnings.empty());
  Index const T = static_cast<Index>(x.size()) / H;
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  hf.layer.forward({x.data(), T, H}, {y.data(), T, H}, ws);
  for (Index t = 0; t < T; ++t) {
    for (Index j = 0; j < k; ++j) REQUIRE(ws.selection.expert[t * k + j] == want.chosen[t][j]);
  }
  double scale = 0.0, diff = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    scale = std::max(scale, std::fabs(want.y[i]));
    diff = std::max(diff, std::fabs(y[i] - want.y[i]));
  }
  REQUIRE(scale > 0.01);
  REQUIRE(diff / scale < 2e-6);
}

}  // namespace

TEST_CASE("gpt-oss: biased router and experts, interleaved gate_up, clamped GLU, MXFP4",
          "[hf][families][gpt_oss]") {
  HfMoeConfig c = moe::io::parse_hf_config(
      R"({"model_type": "gpt_oss", "hidden_size": 32, "intermediate_size": 32,
          "num_local_experts": 8, "num_experts_per_tok": 3, "num_hidden_layers": 2,
          "swiglu_limit": 0.5})");
  REQUIRE(c.family == HfFamily::kGptOss);
  REQUIRE(c.is_moe_layer(0));
  REQUIRE(c.is_moe_layer(1));
  REQUIRE(c.swiglu_limit == 0.5f);
  REQUIRE(c.swiglu_alpha == 1.702f);
  Index const H = 32, I = 32, E = 8, k = 3, T = 21;
  std::vector<float> const x = hftest::random_input(T, H, 122);
  std::string const p = "model.layers.1.mlp.";
  SECTION("bf16 weights (save_hf_layer)") {
    auto layer = moe::io::make_hf_layer<moe::presets::GptOssMoe>(c);
    hftest::randomize(layer, 121);
    fs::path const dir = iotest::scratch_dir("family_gpt_oss");
    moe::io::HfSaveOptions options;
    options.dtype = moe::io::Dtype::kBf16;
    moe::io::save_hf_layer(dir, c, 1, layer, options);
    Checkpoint const ck(dir / "model.safetensors");
    Reference const want =
        gpt_oss_forward(c, ck.get(p + "router.weight", {E, H}), ck.get(p + "router.bias", {E}),
                        ck.get(p + "experts.gate_up_proj", {E, H, 2 * I}),
                        ck.get(p + "experts.gate_up_proj_bias", {E, 2 * I}),
                        ck.get(p + "experts.down_proj", {E, I, H}),
                        ck.get(p + "experts.down_proj_bias", {E, H}), x);
    // The clamps take effect (the test would not see them otherwise).
    check_gpt_oss_layer(dir, want, x, H, k);
  }
  SECTION("MXFP4 experts (gate_up_proj_blocks / _scales, down_proj_blocks / _scales)") {
    // Random FP4 nibbles and E8M0 scales around 2^-4, decoded here with the FP4_VALUES table of
    // transformers/integrations/mxfp4.py (low nibble first, ldexp(value, scale - 127)), then
    // transposed from [E, out, in] to the x @ W layout.
    c.mxfp4 = true;
    std::vector<std::byte> gu_blocks(static_cast<std::size_t>(E * 2 * I * H / 2)),
        gu_scales(static_cast<std::size_t>(E * 2 * I * H / 32)),
        dn_blocks(static_cast<std::size_t>(E * H * I / 2)),
        dn_scales(static_cast<std::size_t>(E * H * I / 32));
    std::uint64_t state = 123;
    auto next = [&] {  // a 64-bit LCG: any bytes do
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<unsigned>(state >> 33);
    };
    for (auto& b : gu_blocks) b = static_cast<std::byte>(next() & 0xFFu);
    for (auto& b : dn_blocks) b = static_cast<std::byte>(next() & 0xFFu);
    for (auto& b : gu_scales) b = static_cast<std::byte>(121u + next() % 4u);
    for (auto& b : dn_scales) b = static_cast<std::byte>(121u + next() % 4u);
    static constexpr double kFp4[16] = {0.0,  0.5,  1.0,  1.5,  2.0,  3.0,  4.0,  6.0,
                                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};
    auto decode = [&](std::vector<std::byte> const& blocks, std::vector<std::byte> const& scales,
                      Index rows, Index cols) {  // [E, rows, cols] -> x @ W: [E, cols, rows]
      std::vector<double> w(static_cast<std::size_t>(E * rows * cols));
      for (Index e = 0; e < E; ++e) {
        for (Index r = 0; r < rows; ++r) {
          for (Index col = 0; col < cols; ++col) {
            Index const flat = (e * rows + r) * cols + col;
            auto const byte = static_cast<unsigned>(blocks[static_cast<std::size_t>(flat / 2)]);
            unsigned const nib = col % 2 == 0 ? byte & 0xFu : byte >> 4;
            int const sc = static_cast<int>(scales[static_cast<std::size_t>(flat / 32)]) - 127;
            w[(e * cols + col) * rows + r] = std::ldexp(kFp4[nib], sc);
          }
        }
      }
      return w;
    };
    std::vector<float> wr(static_cast<std::size_t>(E * H)), br(static_cast<std::size_t>(E)),
        gub(static_cast<std::size_t>(E * 2 * I)), dnb(static_cast<std::size_t>(E * H));
    moe::fill_uniform(wr, -0.5f, 0.5f, 124);
    moe::fill_uniform(br, -0.5f, 0.5f, 125);
    moe::fill_uniform(gub, -0.3f, 0.3f, 126);
    moe::fill_uniform(dnb, -0.3f, 0.3f, 127);
    fs::path const dir = iotest::scratch_dir("family_gpt_oss_mxfp4");
    auto write = [&] {
      moe::io::SafetensorsWriter()
          .add_f32(p + "router.weight", {E, H}, wr)
          .add_f32(p + "router.bias", {E}, br)
          .add(p + "experts.gate_up_proj_blocks", moe::io::Dtype::kU8, {E, 2 * I, H / 32, 16},
               gu_blocks)
          .add(p + "experts.gate_up_proj_scales", moe::io::Dtype::kU8, {E, 2 * I, H / 32},
               gu_scales)
          .add_f32(p + "experts.gate_up_proj_bias", {E, 2 * I}, gub)
          .add(p + "experts.down_proj_blocks", moe::io::Dtype::kU8, {E, H, I / 32, 16}, dn_blocks)
          .add(p + "experts.down_proj_scales", moe::io::Dtype::kU8, {E, H, I / 32}, dn_scales)
          .add_f32(p + "experts.down_proj_bias", {E, H}, dnb)
          .save(dir / "model.safetensors");
    };
    write();
    std::string const json = moe::io::hf_config_json(c);
    REQUIRE_THAT(json, Catch::Contains("\"quant_method\": \"mxfp4\""));
    REQUIRE(moe::io::parse_hf_config(json).mxfp4);
    iotest::write_text(dir / "config.json", json);
    Reference const want = gpt_oss_forward(
        c, {wr.begin(), wr.end()}, {br.begin(), br.end()}, decode(gu_blocks, gu_scales, 2 * I, H),
        {gub.begin(), gub.end()}, decode(dn_blocks, dn_scales, H, I), {dnb.begin(), dnb.end()}, x);
    check_gpt_oss_layer(dir, want, x, H, k);
    // A NaN scale (E8M0 255) is an error naming the tensor.
    gu_scales[5] = std::byte{255};
    write();
    REQUIRE_THROWS_WITH(moe::io::load_hf_moe_layer(dir, 1),
                        Catch::Contains("gate_up_proj_scales") && Catch::Contains("255"));
  }
}

TEST_CASE("Llama 4: top-k of the logits, sigmoid scales the expert input, fused [E, H, 2I]",
          "[hf][families]") {
  for (bool const nested : {false, true}) {
    INFO((nested ? "multimodal checkpoint (language_model.)" : "text-only checkpoint"));
    HfMoeConfig c = moe::io::parse_hf_config(
        R"({"model_type": "llama4_text", "hidden_size": 12, "intermediate_size": 6,
            "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
            "interleave_moe_layer_step": 2})");
    REQUIRE_FALSE(c.is_moe_layer(0));
    REQUIRE(c.is_moe_layer(1));
    REQUIRE(c.shared_intermediate_size() == 6);
    auto layer = moe::io::make_hf_layer<moe::presets::Llama4Moe>(c);
    hftest::randomize(layer, 111);
    fs::path const dir = iotest::scratch_dir(nested ? "family_llama4_vlm" : "family_llama4");
    moe::io::save_hf_layer(dir, c, 1, layer);
    std::string prefix = "model.layers.1.feed_forward.";
    if (nested) {  // rename every tensor as Llama4ForConditionalGeneration stores it
      hftest::rewrite_checkpoint(dir, [](auto& tensors, auto&) {
        for (auto& t : tensors) t.name = "language_model." + t.name;
      });
      prefix = "language_model." + prefix;
    }
    Index const H = 12, k = 2, T = 23;
    Checkpoint const ck(dir / "model.safetensors");
    std::vector<float> const x = hftest::random_input(T, H, 112);
    hfref::Reference const ref = hfref::llama4_forward(c, ck, prefix, x);
    std::vector<double> const& want = ref.y;
    std::vector<std::vector<int>> const& chosen = ref.chosen;
    moe::io::HfAnyLayer any = moe::io::load_hf_moe_layer(dir, 1, {{}, true});
    REQUIRE(std::holds_alternative<moe::io::HfLayer<moe::presets::Llama4Moe>>(any));
    auto const& hf = std::get<moe::io::HfLayer<moe::presets::Llama4Moe>>(any);
    REQUIRE(hf.layout.prefix == prefix);
    std::vector<float> y(x.size());
    moe::MoeFfnWorkspace ws;
    hf.layer.forward({x.data(), T, H}, {y.data(), T, H}, ws);
    for (Index t = 0; t < T; ++t) {
      for (Index j = 0; j < k; ++j) REQUIRE(ws.selection.expert[t * k + j] == chosen[t][j]);
    }
    double scale = 0.0, diff = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) {
      scale = std::max(scale, std::fabs(want[i]));
      diff = std::max(diff, std::fabs(y[i] - want[i]));
    }
    REQUIRE(scale > 0.01);
    REQUIRE(diff / scale < 2e-6);
  }
}

TEST_CASE("config.json of Llama-4-Scout and of the multimodal llama4 (text_config)",
          "[hf][families][config]") {
  HfMoeConfig const c = moe::io::parse_hf_config(R"({"architectures":
    ["Llama4ForConditionalGeneration"], "model_type": "llama4", "boi_token_index": 200080,
    "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
      "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
      "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
      "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": true,
      "no_rope_layers": [], "attention_chunk_size": 8192, "rope_theta": 500000.0,
      "rms_norm_eps": 1e-05, "vocab_size": 202048, "router_aux_loss_coef": 0.001},
    "vision_config": {}})");
  REQUIRE(c.family == HfFamily::kLlama4);
  REQUIRE(c.num_experts == 16);
  REQUIRE(c.num_experts_per_tok == 1);
  REQUIRE(c.expert_intermediate_size == 8192);
  REQUIRE(c.shared_intermediate_size() == 8192);
  REQUIRE(c.unknown_keys.empty());
  REQUIRE(c.is_moe_layer(0));
  REQUIRE(c.is_moe_layer(47));
  // Maverick interleaves: every second layer (1, 3, ...) is MoE; moe_layers overrides the step.
  HfMoeConfig const m = moe::io::parse_hf_config(
      R"({"model_type": "llama4_text", "num_local_experts": 128, "interleave_moe_layer_step": 2})");
  REQUIRE_FALSE(m.is_moe_layer(0));
  REQUIRE(m.is_moe_layer(1));
  REQUIRE_THAT(m.dense_reason(2), Catch::Contains("interleave_moe_layer_step = 2"));
  HfMoeConfig const l =
      moe::io::parse_hf_config(R"({"model_type": "llama4_text", "moe_layers": [0, 5]})");
  REQUIRE(l.is_moe_layer(5));
  REQUIRE_FALSE(l.is_moe_layer(1));
  REQUIRE_THAT(l.dense_reason(1), Catch::Contains("not listed in moe_layers"));
  HfMoeConfig const back = moe::io::parse_hf_config(moe::io::hf_config_json(l));
  REQUIRE(back.moe_layers == std::vector<Index>{0, 5});
  REQUIRE_THROWS_WITH(moe::io::parse_hf_config(R"({"model_type": "llama4"})"),
                      Catch::Contains("text_config"));
}
