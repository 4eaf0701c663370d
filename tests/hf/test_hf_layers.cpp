// SPDX-License-Identifier: Apache-2.0
// One tiny checkpoint per family written by save_hf_layer() from a layer with random weights,
// loaded back and compared with the layer built directly: identical weights and outputs. Also
// sharded, BF16 / F16 and fused-expert checkpoints, and the gradient naming.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "hf/hf_test_support.hpp"
#include "io/io_test_support.hpp"
#include "moe/io/hf.hpp"

namespace {

using hftest::Index;
using moe::io::Dtype;
using moe::io::HfFamily;
using moe::io::HfMoeConfig;
using moe::io::HfSaveOptions;
namespace presets = moe::presets;
namespace fs = std::filesystem;

/// Saves `layer` as layer L, loads it back (typed and through load_hf_moe_layer), and checks
/// weights and outputs against the original.
template <class Layer>
moe::io::HfLayer<Layer> round_trip(std::string const& name, HfMoeConfig const& config, Index L,
                                   Layer const& layer, HfSaveOptions const& options = {}) {
  fs::path const dir = iotest::scratch_dir(name);
  moe::io::save_hf_layer(dir, config, L, layer, options);
  moe::io::HfLayer<Layer> loaded = moe::io::load_hf_layer<Layer>(dir, L);
  REQUIRE(loaded.config.family == config.family);
  REQUIRE(loaded.layer_index == L);
  REQUIRE(loaded.layout.fused_experts == options.fused_experts);
  hftest::require_same_tensors(loaded, layer, options.dtype);
  REQUIRE(loaded.tensors.size() == moe::io::hf_layer_tensors(config, loaded.layout).size());

  // Same outputs: bitwise for F32 weights, close for rounded ones.
  std::vector<float> const x = hftest::random_input(37, layer.d_model(), 99);
  std::vector<float> const want = hftest::forward(layer, x);
  std::vector<float> const got = hftest::forward(loaded.layer, x);
  if (options.dtype == Dtype::kF32) {
    REQUIRE(got == want);
  } else {
    double scale = 1.0, diff = 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
      diff = std::max(diff, static_cast<double>(std::fabs(got[i] - want[i])));
    }
    // Rounded weights may flip a near-tie in the top-k, which moves one token's output a lot;
    // the inputs here have no such ties.
    REQUIRE(diff / scale < 2e-2);
  }

  // The runtime-dispatched loader builds the same layer.
  moe::io::HfAnyLayer any = moe::io::load_hf_moe_layer(dir, L);
  REQUIRE(std::holds_alternative<moe::io::HfLayer<Layer>>(any));
  REQUIRE(hftest::forward(std::get<moe::io::HfLayer<Layer>>(any).layer, x) == got);
  return loaded;
}

}  // namespace

TEST_CASE("Mixtral: save, load, same weights and outputs", "[hf]") {
  presets::MixtralConfig const p{16, 8, 8, 2};
  presets::MixtralMoe layer = presets::make_mixtral(p);
  hftest::randomize(layer, 1);
  auto const loaded = round_trip("mixtral", moe::io::hf_config(p), 0, layer);
  REQUIRE(loaded.layout.prefix == "model.layers.0.block_sparse_moe.");
  REQUIRE(loaded.tensors[0].name == "model.layers.0.block_sparse_moe.gate.weight");
  REQUIRE(loaded.tensors[1].name == "model.layers.0.block_sparse_moe.experts.0.w1.weight");
  REQUIRE(loaded.tensors[2].name == "model.layers.0.block_sparse_moe.experts.0.w3.weight");
  REQUIRE(loaded.tensors[3].name == "model.layers.0.block_sparse_moe.experts.0.w2.weight");
  REQUIRE(loaded.tensors[3].shape == std::vector<std::int64_t>{16, 8});
  REQUIRE(loaded.tensors.size() == 1 + 3 * 8);
}

TEST_CASE("Qwen2-MoE: shared expert and its gate round-trip", "[hf]") {
  presets::Qwen2MoeConfig const p{16, 8, 12, 6, 2, false};
  presets::Qwen2Moe layer = presets::make_qwen2_moe(p);
  hftest::randomize(layer, 2);
  auto const loaded = round_trip("qwen2_moe", moe::io::hf_config(p), 3, layer);
  std::vector<std::string> names;
  for (auto const& t : loaded.tensors) names.push_back(t.name);
  REQUIRE(names.back() == "model.layers.3.mlp.shared_expert_gate.weight");
  REQUIRE(loaded.tensors.back().shape == std::vector<std::int64_t>{1, 16});
  REQUIRE(names[names.size() - 4] == "model.layers.3.mlp.shared_expert.gate_proj.weight");
  REQUIRE(loaded.tensors[names.size() - 4].shape == std::vector<std::int64_t>{12, 16});
  REQUIRE(loaded.layer.router().normalize == false);
}

TEST_CASE("Qwen3-MoE: both norm_topk_prob values", "[hf]") {
  for (bool const norm : {false, true}) {
    INFO("norm_topk_prob " << norm);
    presets::Qwen3MoeConfig const p{16, 8, 8, 3, norm};
    presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
    hftest::randomize(layer, 3);
    auto const loaded =
        round_trip(norm ? "qwen3_norm" : "qwen3_raw", moe::io::hf_config(p), 1, layer);
    REQUIRE(loaded.config.norm_topk_prob == norm);
    REQUIRE(loaded.layer.router().normalize == norm);
    // The two settings route identically but weigh differently.
    moe::MoeFfnWorkspace ws;
    std::vector<float> const x = hftest::random_input(4, 16, 5);
    std::vector<float> y(x.size());
    loaded.layer.forward({x.data(), 4, 16}, {y.data(), 4, 16}, ws);
    float const sum = ws.selection.weight[0] + ws.selection.weight[1] + ws.selection.weight[2];
    if (norm) {
      REQUIRE(sum == Approx(1.0f).epsilon(1e-6));
    } else {
      REQUIRE(sum < 0.99f);
    }
  }
}

TEST_CASE("DeepSeek-V3: groups, selection bias and shared experts round-trip", "[hf]") {
  presets::DeepseekV3Config p;
  p.hidden_size = 16;
  p.moe_intermediate_size = 8;
  p.n_routed_experts = 16;
  p.num_experts_per_tok = 4;
  p.n_group = 4;
  p.topk_group = 2;
  p.routed_scaling_factor = 2.5f;
  p.n_shared_experts = 2;
  presets::DeepseekV3Moe layer = presets::make_deepseek_v3(p);
  hftest::randomize(layer, 4);
  HfMoeConfig c = moe::io::hf_config(p);
  c.first_k_dense_replace = 1;
  c.num_hidden_layers = 3;
  auto const loaded = round_trip("deepseek_v3", c, 2, layer);
  auto const& r = loaded.layer.router();
  REQUIRE(r.bias == layer.router().bias);
  REQUIRE(r.n_group == 4);
  REQUIRE(r.topk_group == 2);
  REQUIRE(r.scale == 2.5f);
  REQUIRE(r.normalize);
  REQUIRE(loaded.layer.shared_experts().count() == 1);
  REQUIRE(loaded.layer.shared_experts().bank().d_ffn() == 16);  // n_shared_experts * I
  REQUIRE(loaded.tensors[1].name == "model.layers.2.mlp.gate.e_score_correction_bias");
  REQUIRE_FALSE(loaded.tensors[1].is_parameter());
  REQUIRE(loaded.tensors.back().name == "model.layers.2.mlp.shared_experts.down_proj.weight");
  REQUIRE(loaded.config.first_k_dense_replace == 1);
  REQUIRE(loaded.config.num_hidden_layers == 3);
}

TEST_CASE("DeepSeek-V3 without shared experts", "[hf]") {
  presets::DeepseekV3Config p;
  p.hidden_size = 8;
  p.moe_intermediate_size = 4;
  p.n_routed_experts = 8;
  p.num_experts_per_tok = 2;
  p.n_group = 2;
  p.topk_group = 1;
  p.n_shared_experts = 0;
  p.norm_topk_prob = false;
  presets::DeepseekV3Moe layer = presets::make_deepseek_v3(p);
  hftest::randomize(layer, 5);
  auto const loaded = round_trip("deepseek_v3_noshared", moe::io::hf_config(p), 0, layer);
  REQUIRE(loaded.layer.shared_experts().count() == 0);
  REQUIRE(loaded.tensors.back().name == "model.layers.0.mlp.experts.7.down_proj.weight");
}

TEST_CASE("OLMoE: save, load, same weights and outputs", "[hf]") {
  presets::OlmoeConfig const p{16, 8, 8, 4, false};
  presets::OlmoeMoe layer = presets::make_olmoe(p);
  hftest::randomize(layer, 6);
  auto const loaded = round_trip("olmoe", moe::io::hf_config(p), 5, layer);
  REQUIRE(loaded.config.family == HfFamily::kOlmoe);
  fs::path const dir = iotest::scratch_dir("olmoe");  // config.json names intermediate_size
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 5, layer);
  REQUIRE(moe::io::read_hf_config(dir).expert_intermediate_size == 8);
}

TEST_CASE("Sharded checkpoints: index + shards load like one file", "[hf]") {
  presets::Qwen2MoeConfig const p{16, 8, 12, 6, 2, true};
  presets::Qwen2Moe layer = presets::make_qwen2_moe(p);
  hftest::randomize(layer, 7);
  HfSaveOptions options;
  options.shards = 2;
  round_trip("sharded2", moe::io::hf_config(p), 0, layer, options);
  fs::path const dir = iotest::scratch_dir("sharded2");
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 0, layer, options);
  REQUIRE(fs::exists(dir / "model.safetensors.index.json"));
  REQUIRE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  REQUIRE(fs::exists(dir / "model-00002-of-00002.safetensors"));
  REQUIRE_FALSE(fs::exists(dir / "model.safetensors"));
  moe::io::ShardedCheckpoint const ckpt = moe::io::open_checkpoint(dir);
  REQUIRE(ckpt.num_shards() == 2);
  REQUIRE(ckpt.size() == 1 + 3 * 6 + 3 + 1);
  // Saving as one file again removes the index, so the loader reads the new file.
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 0, layer);
  REQUIRE_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  REQUIRE(moe::io::open_checkpoint(dir).num_shards() == 1);

  presets::DeepseekV3Config d;
  d.hidden_size = 8;
  d.moe_intermediate_size = 4;
  d.n_routed_experts = 8;
  d.num_experts_per_tok = 2;
  d.n_group = 4;
  d.topk_group = 2;
  presets::DeepseekV3Moe ds = presets::make_deepseek_v3(d);
  hftest::randomize(ds, 8);
  options.shards = 3;
  round_trip("sharded3", moe::io::hf_config(d), 0, ds, options);
}

TEST_CASE("BF16 and F16 checkpoints: weights rounded, outputs close", "[hf]") {
  presets::DeepseekV3Config d;
  d.hidden_size = 16;
  d.moe_intermediate_size = 8;
  d.n_routed_experts = 8;
  d.num_experts_per_tok = 2;
  d.n_group = 2;
  d.topk_group = 2;
  presets::DeepseekV3Moe ds = presets::make_deepseek_v3(d);
  hftest::randomize(ds, 9);
  HfSaveOptions options;
  options.dtype = Dtype::kBf16;
  auto const loaded = round_trip("bf16", moe::io::hf_config(d), 0, ds, options);
  REQUIRE(loaded.layer.router().bias == ds.router().bias);  // kept F32
  moe::io::ShardedCheckpoint const ckpt =
      moe::io::open_checkpoint(fs::path(MOE_IO_TEST_TMP) / "bf16");
  REQUIRE(ckpt.tensor("model.layers.0.mlp.gate.weight").dtype == Dtype::kBf16);
  REQUIRE(ckpt.tensor("model.layers.0.mlp.gate.e_score_correction_bias").dtype == Dtype::kF32);
  REQUIRE(moe::io::read_hf_config(fs::path(MOE_IO_TEST_TMP) / "bf16").family ==
          HfFamily::kDeepseekV3);

  presets::MixtralConfig const m{16, 8, 4, 2};
  presets::MixtralMoe mx = presets::make_mixtral(m);
  hftest::randomize(mx, 10);
  options.dtype = Dtype::kF16;
  round_trip("f16", moe::io::hf_config(m), 0, mx, options);
}

TEST_CASE("Fused experts: gate_up_proj [E, 2I, H] and down_proj [E, H, I]", "[hf]") {
  presets::MixtralConfig const m{16, 8, 4, 2};
  presets::MixtralMoe mx = presets::make_mixtral(m);
  hftest::randomize(mx, 11);
  HfSaveOptions options;
  options.fused_experts = true;
  auto const loaded = round_trip("fused_mixtral", moe::io::hf_config(m), 1, mx, options);
  REQUIRE(loaded.layout.prefix == "model.layers.1.mlp.");  // transformers v5 naming
  REQUIRE(loaded.tensors.size() == 3);
  REQUIRE(loaded.tensors[1].name == "model.layers.1.mlp.experts.gate_up_proj");
  REQUIRE(loaded.tensors[1].shape == std::vector<std::int64_t>{4, 16, 16});
  REQUIRE(loaded.tensors[2].name == "model.layers.1.mlp.experts.down_proj");
  REQUIRE(loaded.tensors[2].shape == std::vector<std::int64_t>{4, 16, 8});
  // gate rows first, then up rows, per expert.
  std::vector<float> const fused = moe::io::hf_tensor_values(mx, loaded.tensors[1]);
  auto const up2 = mx.experts().up_proj(2);
  REQUIRE(fused[static_cast<std::size_t>(2 * 16 * 16 + 8 * 16 + 5)] == up2(0, 5));

  presets::Qwen2MoeConfig const p{16, 8, 12, 6, 2, false};
  presets::Qwen2Moe q = presets::make_qwen2_moe(p);
  hftest::randomize(q, 12);
  round_trip("fused_qwen2", moe::io::hf_config(p), 0, q, options);
}

TEST_CASE("Gradients are named after the checkpoint tensors, in their layout", "[hf]") {
  presets::Qwen2MoeConfig const p{16, 8, 12, 6, 2, true};
  presets::Qwen2Moe layer = presets::make_qwen2_moe(p);
  hftest::randomize(layer, 13);
  std::vector<float> const x = hftest::random_input(9, 16, 14);
  std::vector<float> const dy = hftest::random_input(9, 16, 15);
  std::vector<float> y(x.size()), dx(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward_train({x.data(), 9, 16}, {y.data(), 9, 16}, ws);
  auto grads = layer.make_gradients();
  layer.backward(ws, {dy.data(), 9, 16}, {dx.data(), 9, 16}, grads);

  for (bool const fused : {false, true}) {
    INFO("fused " << fused);
    fs::path const dir = iotest::scratch_dir("grad_names");
    HfSaveOptions options;
    options.fused_experts = fused;
    moe::io::save_hf_layer(dir, moe::io::hf_config(p), 0, layer, options);
    auto const hf = moe::io::load_hf_layer<presets::Qwen2Moe>(dir, 0);
    moe::io::SafetensorsWriter writer;
    moe::io::add_hf_gradients(writer, hf, grads);
    moe::io::SafetensorsFile const file(writer.serialize());
    REQUIRE(file.size() == hf.tensors.size());  // Qwen2-MoE has no buffer
    for (moe::io::HfTensor const& t : hf.tensors) {
      moe::io::TensorView const& g = file.tensor(moe::io::detail::concat("grad.", t.name));
      REQUIRE(g.shape == t.shape);
      REQUIRE(g.dtype == Dtype::kF32);
    }
    auto const router = moe::io::to_float(file.tensor("grad.model.layers.0.mlp.gate.weight"));
    REQUIRE(router == grads.router_weight);
    auto const gate =
        moe::io::to_float(file.tensor("grad.model.layers.0.mlp.shared_expert_gate.weight"));
    REQUIRE(gate[3] == grads.shared.gate_weight()(0, 3));
    std::string const up_name = fused ? "grad.model.layers.0.mlp.experts.gate_up_proj"
                                      : "grad.model.layers.0.mlp.experts.4.up_proj.weight";
    auto const up = moe::io::to_float(file.tensor(up_name));
    std::size_t const at = fused ? static_cast<std::size_t>(4 * 16 * 16 + 8 * 16 + 7) : 7;
    REQUIRE(up[at] == grads.experts.up_proj(4)(0, 7));
  }
}

TEST_CASE("Tensors of other layers and modules are ignored", "[hf]") {
  presets::Qwen3MoeConfig const p{8, 4, 4, 2, true};
  presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
  hftest::randomize(layer, 16);
  fs::path const dir = iotest::scratch_dir("extra_tensors");
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 1, layer);
  std::vector<float> const filler(64, 0.5f);
  hftest::rewrite_checkpoint(dir, [&](auto& tensors, auto& storage) {
    storage.push_back(moe::io::from_float(filler, Dtype::kBf16));
    tensors.push_back({"model.embed_tokens.weight", Dtype::kBf16, {8, 8}, storage.back()});
    storage.push_back(moe::io::from_float(filler, Dtype::kF32));
    tensors.push_back({"model.layers.0.mlp.gate.weight", Dtype::kF32, {8, 8}, storage.back()});
  });
  auto const loaded = moe::io::load_hf_layer<presets::Qwen3Moe>(dir, 1);
  hftest::require_same_tensors(loaded, layer);
}
