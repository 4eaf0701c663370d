// SPDX-License-Identifier: Apache-2.0
// Every error class of config.json parsing and layer loading: each throws moe::Error naming the
// file, the key or tensor, what is wrong and how to fix it. Also FP8 blockwise dequantisation.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include "hf/hf_test_support.hpp"
#include "io/io_test_support.hpp"
#include "moe/io/hf.hpp"

namespace {

using Catch::Contains;
using moe::io::Dtype;
using moe::io::HfMoeConfig;
using moe::io::parse_hf_config;
namespace presets = moe::presets;
namespace fs = std::filesystem;

constexpr char kRouter[] = "model.layers.0.mlp.gate.weight";
constexpr char kUp1[] = "model.layers.0.mlp.experts.1.up_proj.weight";

// A tiny Qwen2-MoE checkpoint (H 8, I 4, E 4, k 2, shared 6) as layer 0 of `name`.
fs::path tiny_qwen2(std::string const& name, presets::Qwen2Moe* out = nullptr) {
  presets::Qwen2MoeConfig const p{8, 4, 6, 4, 2, false};
  presets::Qwen2Moe layer = presets::make_qwen2_moe(p);
  hftest::randomize(layer, 31);
  fs::path const dir = iotest::scratch_dir(name);
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 0, layer);
  if (out != nullptr) *out = layer;
  return dir;
}

moe::io::HfLayer<presets::Qwen2Moe> load_qwen2(fs::path const& dir, moe::Index layer = 0) {
  return moe::io::load_hf_layer<presets::Qwen2Moe>(dir, layer);
}

}  // namespace

TEST_CASE("Invalid config.json: JSON, model_type, key types, values", "[hf][errors]") {
  REQUIRE_THROWS_AS(parse_hf_config("{"), moe::Error);
  REQUIRE_THROWS_WITH(
      parse_hf_config(R"({"model_type": "mixtral",})", "m/config.json"),
      Contains("m/config.json") && Contains("not valid JSON") && Contains("trailing comma"));
  REQUIRE_THROWS_WITH(parse_hf_config("[1]"), Contains("must be a JSON object"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"hidden_size": 8})"),
                      Contains("no \"model_type\"") && Contains("\"mixtral\""));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "dbrx"})"),
                      Contains("model_type 'dbrx' is not supported") &&
                          Contains("\"deepseek_v3\"") && Contains("\"gpt_oss\""));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": 3})"),
                      Contains("\"model_type\" is a number (3) but must be a string"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "mixtral", "hidden_size": "8"})"),
                      Contains("\"hidden_size\" is a string ('8') but must be a non-negative "
                               "integer") &&
                          Contains("fix config.json"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "mixtral", "hidden_size": 8.5})"),
                      Contains("\"hidden_size\" is a number (8.5)"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "mixtral", "hidden_size": 0})"),
                      Contains("\"hidden_size\" is 0 but must be >= 1"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "qwen3_moe", "norm_topk_prob": 1})"),
                      Contains("\"norm_topk_prob\" is a number (1) but must be true or false"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "qwen3_moe", "mlp_only_layers": [-1]})"),
                      Contains("\"mlp_only_layers\""));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "mixtral", "model_type": "olmoe"})"),
                      Contains("'model_type' appears twice"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "olmoe", "num_experts_per_tok": 65})"),
                      Contains("num_experts_per_tok = 65 must be in [1, num_experts = 64]"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "olmoe", "hidden_act": "gelu"})"),
                      Contains("hidden_act 'gelu' is not supported") && Contains("silu"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "qwen3_moe",
                                          "quantization_config": {"quant_method": "gptq"}})"),
                      Contains("quant_method 'gptq' is not supported"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "qwen3_moe", "quantization_config":
                                          {"quant_method": "fp8", "weight_block_size": [128]}})"),
                      Contains("\"quantization_config.weight_block_size\" is an array"));
  REQUIRE(parse_hf_config(R"({"model_type": "olmoe", "hidden_act": "swish"})").hidden_act ==
          "swish");
}

TEST_CASE("Unsupported DeepSeek-V3 routing settings", "[hf][errors]") {
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v3", "n_group": 3})"),
                      Contains("n_group = 3 must divide n_routed_experts = 256"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v3", "topk_group": 9})"),
                      Contains("topk_group = 9 must be in [1, n_group = 8]"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v3", "n_group": 64,
                                          "topk_group": 1})"),
                      Contains("num_experts_per_tok = 8 exceeds the 4 experts"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v3",
                                          "scoring_func": "softmax"})"),
                      Contains("scoring_func 'softmax' is not supported"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v3", "topk_method": "greedy"})"),
                      Contains("topk_method 'greedy' is not supported"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v3",
                                          "routed_scaling_factor": "2.5"})"),
                      Contains("\"routed_scaling_factor\" is a string"));
}

TEST_CASE("Missing files: no config.json, no weights", "[hf][errors]") {
  fs::path const dir = iotest::scratch_dir("missing_files");
  REQUIRE_THROWS_WITH(load_qwen2(dir),
                      Contains("config.json' does not exist") && Contains("missing_files"));
  iotest::write_text(dir / "config.json", R"({"model_type": "qwen2_moe"})");
  REQUIRE_THROWS_WITH(load_qwen2(dir), Contains("has neither model.safetensors nor "
                                                "model.safetensors.index.json"));
}

TEST_CASE("A dense layer index is rejected before any tensor is read", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("dense_layer");
  HfMoeConfig c = moe::io::read_hf_config(dir);
  c.decoder_sparse_step = 2;
  iotest::write_text(dir / "config.json", moe::io::hf_config_json(c));
  REQUIRE_THROWS_WITH(load_qwen2(dir, 0),
                      Contains("cannot load layer 0 of this qwen2_moe model as an MoE layer") &&
                          Contains("decoder_sparse_step = 2") && Contains("dense_layer"));
  c.decoder_sparse_step = 1;
  c.mlp_only_layers = {0};
  iotest::write_text(dir / "config.json", moe::io::hf_config_json(c));
  REQUIRE_THROWS_WITH(load_qwen2(dir, 0), Contains("mlp_only_layers"));
  c.mlp_only_layers = {};
  c.num_hidden_layers = 1;
  iotest::write_text(dir / "config.json", moe::io::hf_config_json(c));
  REQUIRE_THROWS_WITH(load_qwen2(dir, 1), Contains("layer 1 does not exist"));
  REQUIRE_THROWS_WITH(load_qwen2(dir, -1), Contains("layer -1 is negative"));
  REQUIRE_NOTHROW(load_qwen2(dir, 0));
  // Saving a dense layer index is refused too.
  presets::Qwen2Moe layer = load_qwen2(dir, 0).layer;
  c.first_k_dense_replace = 0;
  c.mlp_only_layers = {0};
  REQUIRE_THROWS_WITH(moe::io::save_hf_layer(dir, c, 0, layer),
                      Contains("cannot save layer 0 as an MoE layer"));
}

TEST_CASE("A layer index the checkpoint lacks names the missing tensor", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("absent_layer");
  REQUIRE_THROWS_WITH(load_qwen2(dir, 2),
                      Contains("tensor 'model.layers.2.mlp.gate.weight' ([4, 8]) is missing") &&
                          Contains("no tensor of this layer"));
}

TEST_CASE("Missing tensor", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("missing_tensor");
  hftest::rewrite_checkpoint(dir, [](auto& tensors, auto&) {
    tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(hftest::index_of(tensors, kUp1)));
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir),
                      Contains("model.safetensors") &&
                          Contains("tensor 'model.layers.0.mlp.experts.1.up_proj.weight' ([4, "
                                   "8]) is missing") &&
                          Contains("do not agree"));
  // The shared expert gate of Qwen2-MoE is required as well.
  fs::path const dir2 = tiny_qwen2("missing_shared_gate");
  hftest::rewrite_checkpoint(dir2, [](auto& tensors, auto&) {
    tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(hftest::index_of(
                                        tensors, "model.layers.0.mlp.shared_expert_gate.weight")));
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir2),
                      Contains("shared_expert_gate.weight") && Contains("is missing"));
}

TEST_CASE("A dense MLP where config.json says MoE", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("dense_in_checkpoint");
  std::vector<float> const w(32, 0.25f);
  hftest::rewrite_checkpoint(dir, [&](auto& tensors, auto& storage) {
    tensors.clear();
    storage.push_back(moe::io::from_float(w, Dtype::kF32));
    tensors.push_back({"model.layers.0.mlp.gate_proj.weight", Dtype::kF32, {4, 8}, storage[0]});
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir),
                      Contains("holds a dense MLP") && Contains("config.json and the weights"));
}

TEST_CASE("Mis-shaped tensor", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("wrong_shape");
  hftest::rewrite_checkpoint(dir, [](auto& tensors, auto&) {
    auto& t = tensors[hftest::index_of(tensors, kUp1)];
    t.shape = {8, 4};  // transposed: same bytes, wrong shape
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir),
                      Contains("tensor 'model.layers.0.mlp.experts.1.up_proj.weight' has shape "
                               "[8, 4] but config.json implies [4, 8]") &&
                          Contains("check that config.json belongs to these weights"));
  // When the config took defaults, the message says so.
  fs::path const dir2 = tiny_qwen2("wrong_shape_defaults");
  iotest::write_text(dir2 / "config.json",
                     R"({"model_type": "qwen2_moe", "moe_intermediate_size": 4,
                         "shared_expert_intermediate_size": 6, "num_experts": 4,
                         "num_experts_per_tok": 2})");
  REQUIRE_THROWS_WITH(load_qwen2(dir2), Contains("has shape [4, 8] but config.json implies "
                                                 "[4, 2048]") &&
                                            Contains("lacks hidden_size"));
}

TEST_CASE("Mistyped tensor", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("wrong_dtype");
  hftest::rewrite_checkpoint(dir, [](auto& tensors, auto&) {
    tensors[hftest::index_of(tensors, kRouter)].dtype = Dtype::kI32;  // same size as F32
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir), Contains("tensor 'model.layers.0.mlp.gate.weight' is I32") &&
                                           Contains("F32, BF16 or F16"));
  fs::path const dir2 = tiny_qwen2("wrong_dtype_f8");
  hftest::rewrite_checkpoint(dir2, [](auto& tensors, auto& storage) {
    auto& t = tensors[hftest::index_of(tensors, kUp1)];
    storage.emplace_back(t.bytes.begin(), t.bytes.begin() + 32);
    t.dtype = Dtype::kF8E4M3;
    t.bytes = storage.back();
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir2), Contains("is F8_E4M3 but the checkpoint has no "
                                                 "'model.layers.0.mlp.experts.1.up_proj.weight_"
                                                 "scale_inv'"));
}

TEST_CASE("Wrong layer type for the model family", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("wrong_type");
  REQUIRE_THROWS_WITH(moe::io::load_hf_layer<presets::MixtralMoe>(dir, 0),
                      Contains("is a qwen2_moe model, which does not load into this layer type"));
  presets::Qwen2Moe layer = load_qwen2(dir).layer;
  HfMoeConfig c = moe::io::read_hf_config(dir);
  c.num_experts = 5;
  REQUIRE_THROWS_WITH(moe::io::save_hf_layer(dir, c, 0, layer),
                      Contains("does not match the qwen2_moe config"));
}

TEST_CASE("Fused and per-expert weights in one layer are ambiguous", "[hf][errors]") {
  fs::path const dir = tiny_qwen2("both_layouts");
  std::vector<float> const w(4 * 8 * 8, 0.0f);
  hftest::rewrite_checkpoint(dir, [&](auto& tensors, auto& storage) {
    storage.push_back(moe::io::from_float(w, Dtype::kF32));
    tensors.push_back(
        {"model.layers.0.mlp.experts.gate_up_proj", Dtype::kF32, {4, 8, 8}, storage.back()});
  });
  REQUIRE_THROWS_WITH(load_qwen2(dir), Contains("has both fused") && Contains("keep one layout"));
}

TEST_CASE("FP8 blockwise weights are dequantised with weight_scale_inv", "[hf][fp8]") {
  // DeepSeek-V3 layout with 4x4 blocks: experts F8_E4M3 [I=6, H=8] + F32 scales [2, 2].
  presets::DeepseekV3Config p;
  p.hidden_size = 8;
  p.moe_intermediate_size = 6;
  p.n_routed_experts = 4;
  p.num_experts_per_tok = 2;
  p.n_group = 2;
  p.topk_group = 1;
  p.n_shared_experts = 1;
  presets::DeepseekV3Moe layer = presets::make_deepseek_v3(p);
  hftest::randomize(layer, 41);
  HfMoeConfig c = moe::io::hf_config(p);
  fs::path const dir = iotest::scratch_dir("fp8");
  moe::io::save_hf_layer(dir, c, 0, layer);
  c.fp8_block_rows = c.fp8_block_cols = 4;
  iotest::write_text(dir / "config.json", moe::io::hf_config_json(c));
  std::string const name = "model.layers.0.mlp.experts.2.down_proj.weight";  // [8, 6]
  std::vector<std::byte> q(48);
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = static_cast<std::byte>((i * 37 + 11) % 0x7E);  // never 0x7F (NaN)
  }
  std::vector<float> const scales = {0.5f, 2.0f, 0.25f, 4.0f};
  std::vector<std::byte> const scale_bytes = moe::io::from_float(scales, Dtype::kF32);
  hftest::rewrite_checkpoint(dir, [&](auto& tensors, auto&) {
    auto& t = tensors[hftest::index_of(tensors, name)];
    t.dtype = Dtype::kF8E4M3;
    t.bytes = q;
    tensors.push_back(
        {moe::io::detail::concat(name, "_scale_inv"), Dtype::kF32, {2, 2}, scale_bytes});
  });
  auto const loaded = moe::io::load_hf_layer<presets::DeepseekV3Moe>(dir, 0);
  auto const w = loaded.layer.experts().down_proj(2);
  for (moe::Index r = 0; r < 8; ++r) {
    for (moe::Index k = 0; k < 6; ++k) {
      float const want = moe::io::f8_e4m3_to_float(static_cast<std::uint8_t>(q[r * 6 + k])) *
                         scales[static_cast<std::size_t>((r / 4) * 2 + k / 4)];
      REQUIRE(w(r, k) == want);
    }
  }
  // Other tensors are untouched.
  REQUIRE(moe::io::hf_tensor_values(loaded.layer, loaded.tensors[0]) ==
          moe::io::hf_tensor_values(layer, loaded.tensors[0]));

  // A scale of the wrong shape is reported with the block size.
  std::vector<std::byte> const bad_scale = moe::io::from_float(scales, Dtype::kF32);
  hftest::rewrite_checkpoint(dir, [&](auto& tensors, auto&) {
    auto& s = tensors[hftest::index_of(tensors, moe::io::detail::concat(name, "_scale_inv"))];
    s.shape = {4, 1};
  });
  REQUIRE_THROWS_WITH(
      moe::io::load_hf_layer<presets::DeepseekV3Moe>(dir, 0),
      Contains("_scale_inv' is F32 [4, 1] but the 4x4 blocks") && Contains("need F32 [2, 2]"));
  (void)bad_scale;
}

TEST_CASE("A config.json implying a huge layer is refused by its shapes before any allocation",
          "[hf][errors]") {
  // The checkpoint is 8 wide; config.json implies 128 experts of 65536 x 65536 (terabytes).
  // The loader compares every tensor header with config.json before it allocates the layer, so
  // the error is the shape, at once. Run in a child under an address-space limit of 1 GiB more
  // than it has: a loader that allocated first would fail with std::bad_alloc (exit 2) instead
  // of committing the machine's memory.
  fs::path const dir = tiny_qwen2("huge_config");
  iotest::write_text(dir / "config.json",
                     R"({"model_type": "qwen2_moe", "hidden_size": 65536,
                         "moe_intermediate_size": 65536, "shared_expert_intermediate_size": 65536,
                         "num_experts": 128, "num_experts_per_tok": 2})");
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  pid_t const pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(pipe_fds[0]);
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    rlim_t const limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) +
                         (rlim_t{1} << 30);
    struct rlimit const rl = {limit, limit};
    ::setrlimit(RLIMIT_AS, &rl);
    std::string message;
    int code = 3;
    try {
      load_qwen2(dir);
      message = "loaded";
    } catch (moe::Error const& e) {
      message = e.what();
      code = 0;
    } catch (std::bad_alloc const&) {
      message = "std::bad_alloc";
      code = 2;
    } catch (std::exception const& e) {
      message = e.what();
    }
    if (::write(pipe_fds[1], message.data(), message.size()) < 0) code = 4;
    ::_exit(code);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buffer[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;) {
    message.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(pipe_fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  INFO(message);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  CHECK_THAT(message, Contains("tensor 'model.layers.0.mlp.gate.weight' has shape [4, 8] but "
                               "config.json implies [128, 65536]") &&
                          Contains("check that config.json belongs to these weights"));
}

TEST_CASE("A config.json that is a link to a device says config.json is not a regular file",
          "[hf][errors]") {
  fs::path const dir = tiny_qwen2("config_device");
  fs::remove(dir / "config.json");
  fs::create_symlink("/dev/zero", dir / "config.json");
  auto const message = [&] {
    try {
      load_qwen2(dir);
    } catch (moe::Error const& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  }();
  CHECK_THAT(message, Contains("config.json' is not a regular file (a character device") &&
                          Contains("config.json is a regular file") &&
                          !Contains(".safetensors file"));
  CHECK_THROWS_WITH(moe::io::read_hf_config(dir),
                    Contains("is not a regular file") && !Contains(".safetensors file"));
}
