// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// make_tiny_checkpoint: write a tiny Hugging Face checkpoint to try moe_run_hf_layer on.
//
// What it shows: moe::io::save_hf_layer() writing config.json + model.safetensors (or shards and
// model.safetensors.index.json) for one MoE layer with random weights, in the checkpoint's own
// tensor names. Layer 1 of a 2-layer model is the MoE layer (layer 0 is dense for every family
// with dense layers: qwen2_moe, qwen3_moe, qwen3_next, deepseek_v3, glm4_moe, deepseek_v2 and
// ernie4_5_moe). It also writes x.safetensors ("x" [5, 16] F32) and
// dy.safetensors ("dy" [5, 16] F32) next to them.
// Why: the ctest of 03_hf_layer runs the runner end to end on it; no real model is needed.
//
// Command line:
//   moe_hf_make_tiny_checkpoint DIR MODEL_TYPE [--shards N] [--bf16] [--fused]
// MODEL_TYPE: mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe, qwen3_next, glm4_moe,
// deepseek_v2 (group_limited_greedy), minimax_m2, ernie4_5_moe or llama4_text (layer 1 of
// interleave_moe_layer_step 2).
// Exit status: 0 on success, 1 with a message on stderr otherwise.

#include <cstdio>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/io/hf.hpp"

namespace {

template <class Layer>
void randomize(Layer& layer, std::uint64_t seed) {
  auto w = layer.router_weight();
  moe::fill_uniform(std::span<float>(w.data, static_cast<std::size_t>(w.rows * w.cols)), -0.5f,
                    0.5f, seed);
  moe::fill_uniform(layer.experts().edit().parameters(), -0.3f, 0.3f, seed + 1);
  if constexpr (Layer::Shared::has_experts) {
    moe::fill_uniform(layer.shared_experts().bank().edit().parameters(), -0.3f, 0.3f, seed + 2);
    auto g = layer.shared_experts().gate_weight();
    moe::fill_uniform(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f,
                      0.5f, seed + 3);
  }
  if constexpr (requires { layer.router().bias; }) {
    moe::fill_uniform(layer.router().bias, -0.1f, 0.1f, seed + 4);
  }
}

template <class Layer>
void write(std::string const& dir, moe::io::HfMoeConfig const& config,
           moe::io::HfSaveOptions const& options) {
  Layer layer = moe::io::make_hf_layer<Layer>(config);
  randomize(layer, 11);
  moe::io::save_hf_layer(dir, config, 1, layer, options);
}

int run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s DIR MODEL_TYPE [--shards N] [--bf16] [--fused]\n", argv[0]);
    return 1;
  }
  std::string const dir = argv[1], type = argv[2];
  moe::io::HfSaveOptions options;
  for (int i = 3; i < argc; ++i) {
    std::string const arg = argv[i];
    if (arg == "--bf16") {
      options.dtype = moe::io::Dtype::kBf16;
    } else if (arg == "--fused") {
      options.fused_experts = true;
    } else if (arg == "--shards" && i + 1 < argc) {
      options.shards = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr, "unknown argument '%s'\n", arg.c_str());
      return 1;
    }
  }
  // A config.json with only model_type (and top-k: deepseek_v2 has no default) takes the
  // family's (large) defaults: set tiny sizes.
  std::string json = "{\"num_experts_per_tok\": 2, \"model_type\": \"";
  json.append(type).append("\"}");
  moe::io::HfMoeConfig c = moe::io::parse_hf_config(json);
  c.hidden_size = 16;
  c.expert_intermediate_size = 8;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.num_hidden_layers = 2;
  c.shared_expert_intermediate_size = 12;
  c.decoder_sparse_step = 2;  // Qwen: layer 1 is MoE, layer 0 dense
  c.n_group = 4;
  c.topk_group = 2;
  c.first_k_dense_replace = 1;  // DeepSeek, GLM: layer 0 dense (ERNIE: moe_layer_start_index 1)
  if (c.family == moe::io::HfFamily::kDeepseekV2) c.topk_method = "group_limited_greedy";
  c.interleave_moe_layer_step = 2;  // Llama 4: layer 1 is MoE, layer 0 dense
  if (c.family == moe::io::HfFamily::kGlm4Moe || c.family == moe::io::HfFamily::kDeepseekV2) {
    c.routed_scaling_factor = 1.5f;
  }
  c.defaulted_keys.clear();
  using namespace moe::presets;
  switch (c.family) {
    case moe::io::HfFamily::kMixtral:
      write<MixtralMoe>(dir, c, options);
      break;
    case moe::io::HfFamily::kQwen2Moe:
    case moe::io::HfFamily::kQwen3Next:
      write<Qwen2Moe>(dir, c, options);
      break;
    case moe::io::HfFamily::kQwen3Moe:
    case moe::io::HfFamily::kOlmoe:
      write<Qwen3Moe>(dir, c, options);
      break;
    case moe::io::HfFamily::kDeepseekV3:
    case moe::io::HfFamily::kGlm4Moe:
    case moe::io::HfFamily::kDeepseekV2:
    case moe::io::HfFamily::kMinimaxM2:
    case moe::io::HfFamily::kErnie45Moe:
      write<DeepseekV3Moe>(dir, c, options);
      break;
    case moe::io::HfFamily::kLlama4:
      write<Llama4Moe>(dir, c, options);
      break;
  }
  std::vector<float> x(5 * 16), dy(5 * 16);
  moe::fill_uniform(x, -1.0f, 1.0f, 21);
  moe::fill_uniform(dy, -1.0f, 1.0f, 22);
  moe::io::SafetensorsWriter()
      .add_f32("x", {5, 16}, x)
      .save(std::filesystem::path(dir) / "x.safetensors");
  moe::io::SafetensorsWriter()
      .add_f32("dy", {5, 16}, dy)
      .save(std::filesystem::path(dir) / "dy.safetensors");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moe_hf_make_tiny_checkpoint: %s\n", e.what());
    return 1;
  }
}
