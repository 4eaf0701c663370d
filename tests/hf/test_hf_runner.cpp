// SPDX-License-Identifier: Apache-2.0
// moe_run_hf_layer (examples/03_hf_layer) end to end: a tiny checkpoint written by the library,
// the runner's forward and --grad outputs compared with the layer's own forward and backward.
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "hf/hf_test_support.hpp"
#include "io/io_test_support.hpp"
#include "moe/io/hf.hpp"

#ifdef MOE_RUN_HF_LAYER

namespace {

using Catch::Contains;
using moe::io::Dtype;
namespace presets = moe::presets;
namespace fs = std::filesystem;

int run_runner(std::string const& args, fs::path const& log) {
  std::string command = "'";
  command.append(MOE_RUN_HF_LAYER).append("' ").append(args).append(" 2>'");
  command.append(log.string()).append("'");
  int const status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string quoted(fs::path const& p) {
  std::string out = "'";
  return out.append(p.string()).append("'");
}

// The words separated by spaces (no "literal" + std::string: see io/detail/json.hpp concat).
std::string words(std::initializer_list<std::string> parts) {
  std::string out;
  for (std::string const& w : parts) out.append(out.empty() ? "" : " ").append(w);
  return out;
}

void require_close(std::vector<float> const& got, std::vector<float> const& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    REQUIRE(got[i] == Approx(want[i]).epsilon(1e-5).margin(1e-6));
  }
}

/// Writes `layer` (layer 1, in `options`' layout) and x / dy, runs the runner with --grad, and
/// compares every output with the layer's own forward_train + backward.
template <class Layer>
void check_runner(std::string const& name, moe::io::HfMoeConfig const& config, Layer& layer,
                  moe::io::HfSaveOptions const& options, Dtype x_dtype) {
  fs::path const dir = iotest::scratch_dir(name);
  moe::io::save_hf_layer(dir, config, 1, layer, options);
  moe::Index const T = 13, D = layer.d_model(), E = layer.num_experts();
  std::vector<float> x = hftest::random_input(T, D, 51);
  if (x_dtype != Dtype::kF32) x = hftest::rounded(x, x_dtype);
  std::vector<float> const dy = hftest::random_input(T, D, 52);
  moe::io::SafetensorsWriter()
      .add("x", x_dtype, {T, D}, moe::io::from_float(x, x_dtype))
      .save(dir / "x.safetensors");
  moe::io::SafetensorsWriter().add_f32("dy", {T, D}, dy).save(dir / "dy.safetensors");

  std::string const args = words(
      {"--model", quoted(dir), "--layer 1 --input", quoted(dir / "x.safetensors"), "--output",
       quoted(dir / "y.safetensors"), "--grad", quoted(dir / "dy.safetensors"), "--threads 3"});
  int const rc = run_runner(args, dir / "stderr.txt");
  INFO(iotest::read_file(dir / "stderr.txt").size() << " bytes on stderr");
  REQUIRE(rc == 0);

  // The layer's own training forward and backward.
  std::vector<float> y(x.size()), dx(x.size());
  moe::MoeFfnWorkspace ws;
  layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
  auto grads = layer.make_gradients();
  layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads);

  moe::io::SafetensorsFile const out(dir / "y.safetensors");
  moe::Index const K = layer.router().top_k;
  REQUIRE(out.tensor("y").dtype == Dtype::kF32);
  REQUIRE(out.tensor("y").shape == std::vector<std::int64_t>{T, D});
  require_close(moe::io::to_float(out.tensor("y")), y);
  REQUIRE(out.tensor("router_logits").shape == std::vector<std::int64_t>{T, E});
  require_close(moe::io::to_float(out.tensor("router_logits")), ws.logits);
  moe::io::TensorView const& ids = out.tensor("topk_ids");
  REQUIRE(ids.dtype == Dtype::kI64);
  REQUIRE(ids.shape == std::vector<std::int64_t>{T, K});
  std::vector<float> const id_values = moe::io::to_float(ids);
  for (std::size_t i = 0; i < id_values.size(); ++i) {
    REQUIRE(id_values[i] == static_cast<float>(ws.selection.expert[i]));
  }
  REQUIRE(out.tensor("topk_weights").shape == std::vector<std::int64_t>{T, K});
  require_close(moe::io::to_float(out.tensor("topk_weights")), ws.selection.weight);
  require_close(moe::io::to_float(out.tensor("dx")), dx);

  // Every parameter's gradient, named after its checkpoint tensor, in the checkpoint's layout.
  auto const hf = moe::io::load_hf_layer<Layer>(dir, 1);
  std::size_t parameters = 0;
  for (moe::io::HfTensor const& t : hf.tensors) {
    INFO(t.name);
    if (!t.is_parameter()) {
      REQUIRE(out.find(moe::io::detail::concat("grad.", t.name)) == nullptr);
      continue;
    }
    ++parameters;
    moe::io::TensorView const& g = out.tensor(moe::io::detail::concat("grad.", t.name));
    REQUIRE(g.shape == t.shape);
    require_close(moe::io::to_float(g), moe::io::hf_gradient_values(grads, t));
  }
  REQUIRE(out.size() == 5 + parameters);
}

}  // namespace

TEST_CASE("moe_run_hf_layer: DeepSeek-V3 forward and --grad match the layer", "[hf][runner]") {
  presets::DeepseekV3Config p;
  p.hidden_size = 16;
  p.moe_intermediate_size = 8;
  p.n_routed_experts = 8;
  p.num_experts_per_tok = 3;
  p.n_group = 4;
  p.topk_group = 2;
  p.n_shared_experts = 1;
  presets::DeepseekV3Moe layer = presets::make_deepseek_v3(p);
  hftest::randomize(layer, 61);
  moe::io::HfMoeConfig c = moe::io::hf_config(p);
  c.first_k_dense_replace = 1;
  moe::io::HfSaveOptions options;
  options.shards = 2;
  check_runner("runner_deepseek", c, layer, options, Dtype::kF32);
}

TEST_CASE("moe_run_hf_layer: Qwen2-MoE with BF16 input", "[hf][runner]") {
  presets::Qwen2MoeConfig const p{16, 8, 12, 6, 2, true};
  presets::Qwen2Moe layer = presets::make_qwen2_moe(p);
  hftest::randomize(layer, 62);
  check_runner("runner_qwen2", moe::io::hf_config(p), layer, {}, Dtype::kBf16);
}

TEST_CASE("moe_run_hf_layer: Mixtral with fused experts", "[hf][runner]") {
  presets::MixtralConfig const p{16, 8, 4, 2};
  presets::MixtralMoe layer = presets::make_mixtral(p);
  hftest::randomize(layer, 63);
  moe::io::HfSaveOptions options;
  options.fused_experts = true;
  check_runner("runner_mixtral_fused", moe::io::hf_config(p), layer, options, Dtype::kF32);
}

TEST_CASE(
    "moe_run_hf_layer: Qwen3-Next, GLM-4.5, DeepSeek-V2, MiniMax-M2, ERNIE 4.5, Llama 4, gpt-oss "
    "forward and --grad match the layer",
    "[hf][runner]") {
  for (std::string type : {"qwen3_next", "glm4_moe", "deepseek_v2", "minimax_m2", "ernie4_5_moe",
                           "ernie4_5_moe+use_bias", "llama4_text", "gpt_oss"}) {
    INFO(type);
    bool const use_bias = type.ends_with("+use_bias");
    if (use_bias) type.resize(type.size() - 9);
    moe::io::HfMoeConfig c = moe::io::parse_hf_config(moe::io::detail::concat(
        "{\"model_type\": \"", type, "\", \"num_experts_per_tok\": 3, \"hidden_size\": 16, ",
        "\"moe_intermediate_size\": 8, \"intermediate_size\": 8, \"num_experts\": 8, ",
        "\"shared_expert_intermediate_size\": 12, \"n_routed_experts\": 8, ",
        "\"num_local_experts\": 8, \"moe_num_experts\": 8, \"first_k_dense_replace\": 1, ",
        "\"routed_scaling_factor\": 1.5}"));
    c.use_bias = use_bias;
    c.swiglu_limit = 0.5f;  // gpt-oss: a limit the pre-activations cross
    std::string const dir_name = moe::io::detail::concat("runner_", type, use_bias ? "_bias" : "");
    moe::io::HfSaveOptions options;
    options.fused_experts = c.family == moe::io::HfFamily::kDeepseekV2;
    if (c.family == moe::io::HfFamily::kLlama4) {
      auto layer = moe::io::make_hf_layer<presets::Llama4Moe>(c);
      hftest::randomize(layer, 66);
      check_runner(dir_name, c, layer, options, Dtype::kF32);
    } else if (c.family == moe::io::HfFamily::kGptOss) {
      auto layer = moe::io::make_hf_layer<presets::GptOssMoe>(c);
      hftest::randomize(layer, 67);
      check_runner(dir_name, c, layer, options, Dtype::kF32);
    } else if (c.family == moe::io::HfFamily::kQwen3Next) {
      auto layer = moe::io::make_hf_layer<presets::Qwen2Moe>(c);
      hftest::randomize(layer, 64);
      check_runner(dir_name, c, layer, options, Dtype::kF32);
    } else {
      auto layer = moe::io::make_hf_layer<presets::DeepseekV3Moe>(c);
      hftest::randomize(layer, 65);
      check_runner(dir_name, c, layer, options, Dtype::kF32);
    }
  }
}

TEST_CASE("moe_run_hf_layer: --weights runs the experts quantized, as the library does",
          "[hf][runner][quant]") {
  // Qwen3-MoE with hidden 64 and experts of 32: q8_0 and q4_0 (32-blocks) fit, q4_k does not.
  presets::Qwen3MoeConfig const p{64, 32, 6, 2, true};
  presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
  hftest::randomize(layer, 64);
  fs::path const dir = iotest::scratch_dir("runner_weights");
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 1, layer);
  moe::Index const T = 9, D = 64;
  std::vector<float> const x = hftest::random_input(T, D, 65);
  moe::io::SafetensorsWriter().add_f32("x", {T, D}, x).save(dir / "x.safetensors");
  auto args = [&](std::string const& weights, bool grad) {
    return words({"--model", quoted(dir), "--layer 1 --input", quoted(dir / "x.safetensors"),
                  "--output", quoted(dir / "y.safetensors"), "--threads 2 --weights", weights,
                  grad ? std::string("--grad ") + quoted(dir / "x.safetensors") : std::string()});
  };
  for (auto const format : {moe::experts::WeightFormat::kQ8_0, moe::experts::WeightFormat::kQ4_0,
                            moe::experts::WeightFormat::kBf16}) {
    INFO(moe::experts::name(format));
    REQUIRE(run_runner(args(moe::experts::name(format), false), dir / "stderr.txt") == 0);
    presets::Qwen3Moe packed = layer;
    packed.pack_weights(format);
    std::vector<float> y(x.size());
    moe::MoeFfnWorkspace ws;
    packed.forward({x.data(), T, D}, {y.data(), T, D}, ws);
    moe::io::SafetensorsFile const out(dir / "y.safetensors");
    std::vector<float> const got = moe::io::to_float(out.tensor("y"));
    REQUIRE(got == y);  // the same kernels, bitwise (thread-count invariant)
  }
  auto text = [&] {
    std::vector<std::byte> const err = iotest::read_file(dir / "stderr.txt");
    return std::string(reinterpret_cast<char const*>(err.data()), err.size());
  };
  // q4_k's 256-blocks divide neither depth: every projection falls back to q4_0 (the chain's
  // next format that holds 64 and 32), said in one warning line; the output is q4_0's.
  REQUIRE(run_runner(args("q4_k", false), dir / "stderr.txt") == 0);
  REQUIRE_THAT(text(), Contains("warning: fell back where q4_k blocks do not divide the depth") &&
                           Contains("routed experts' gate/up: q4_k -> q4_0 (depth 64)") &&
                           Contains("routed experts' down: q4_k -> q4_0 (depth 32)"));
  {
    presets::Qwen3Moe packed = layer;
    packed.pack_weights(moe::experts::WeightFormat::kQ4_0);
    std::vector<float> y(x.size());
    moe::MoeFfnWorkspace ws;
    packed.forward({x.data(), T, D}, {y.data(), T, D}, ws);
    REQUIRE(moe::io::to_float(moe::io::SafetensorsFile(dir / "y.safetensors").tensor("y")) == y);
  }
  // The library's strict pack names only formats that hold the depth.
  presets::Qwen3Moe strict = layer;
  REQUIRE_THROWS_WITH(
      strict.pack_weights(moe::experts::WeightFormat::kQ4_K),
      Contains("depth d_model = 64") && Contains("pack it as one of q4_0, q8_0, bf16, fp32"));
  REQUIRE(run_runner(args("q8_0", true), dir / "stderr.txt") == 1);
  REQUIRE_THAT(text(), Contains("--weights q8_0 is for inference"));
  REQUIRE(run_runner(args("int3", false), dir / "stderr.txt") == 1);
  REQUIRE_THAT(text(), Contains("unknown weight format 'int3'"));
}

#ifdef MOE_QUANTIZE
TEST_CASE("moe_quantize: AlphaQ and uniform checkpoints that moe_run_hf_layer runs as they are",
          "[hf][runner][quant]") {
  presets::Qwen3MoeConfig const p{64, 32, 6, 2, true};
  presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
  hftest::randomize(layer, 71);
  fs::path const dir = iotest::scratch_dir("quantize_src");
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 1, layer);
  moe::Index const T = 7, D = 64, E = 6;
  std::vector<float> const x = hftest::random_input(T, D, 72);
  moe::io::SafetensorsWriter().add_f32("x", {T, D}, x).save(dir / "x.safetensors");
  auto quantize = [&](std::string const& method, std::string const& bits, fs::path const& out) {
    std::string command = "'";
    command.append(MOE_QUANTIZE).append("' ");
    command.append(
        words({"--model", quoted(dir), "--layer 1 --bits", bits, "--method", method, "--out",
               quoted(out), "--threads 2 >/dev/null 2>", quoted(fs::path(out.string() + ".err"))}));
    int const status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  for (std::string const method : {"alphaq", "uniform"}) {
    INFO(method);
    fs::path const out = iotest::scratch_dir("quantize_" + method);
    REQUIRE(quantize(method, method == "alphaq" ? "6" : "4.5", out) == 0);
    // The checkpoint: U8 GGUF blocks for quantized projections, each marked in the metadata.
    moe::io::SafetensorsFile const file(out / "model.safetensors");
    std::string const gate0 = "model.layers.1.mlp.experts.0.gate_proj.weight";
    auto const it = file.metadata().find("moe.quant." + gate0);
    REQUIRE(it != file.metadata().end());
    auto const f0 = moe::experts::parse_weight_format(it->second);
    if (moe::experts::is_quantized(f0)) REQUIRE(file.tensor(gate0).dtype == Dtype::kU8);
    if (method == "uniform") REQUIRE(f0 == moe::experts::WeightFormat::kQ4_0);
    // The report: a header and two rows per expert.
    std::vector<std::byte> const rep = iotest::read_file(out / "quant_report.tsv");
    std::string const text(reinterpret_cast<char const*>(rep.data()), rep.size());
    REQUIRE(std::count(text.begin(), text.end(), '\n') == 1 + 2 * E);
    REQUIRE_THAT(text, Contains("expert\tprojection\talpha\tformat\tbits\trelative_error"));
    // Loaded back: packed in the stored formats; the runner gives the same bits.
    auto hf = moe::io::load_hf_layer<presets::Qwen3Moe>(out, 1);
    REQUIRE(hf.stored_formats.size() == static_cast<std::size_t>(E));
    REQUIRE(hf.stored_formats[0].in == f0);
    REQUIRE(hf.layer.experts().packed());
    std::vector<float> y(x.size());
    moe::MoeFfnWorkspace ws;
    hf.layer.forward({x.data(), T, D}, {y.data(), T, D}, ws);
    std::string const args =
        words({"--model", quoted(out), "--layer 1 --input", quoted(dir / "x.safetensors"),
               "--output", quoted(out / "y.safetensors")});
    REQUIRE(run_runner(args, out / "stderr.txt") == 0);
    moe::io::SafetensorsFile const yf(out / "y.safetensors");
    REQUIRE(moe::io::to_float(yf.tensor("y")) == y);
  }
  // The runner's own AlphaQ pack, and the tool's errors.
  std::string const args =
      words({"--model", quoted(dir), "--layer 1 --input", quoted(dir / "x.safetensors"), "--output",
             quoted(dir / "y.safetensors"), "--weights alphaq:6"});
  REQUIRE(run_runner(args, dir / "stderr.txt") == 0);
  fs::path const bad = iotest::scratch_dir("quantize_bad");
  REQUIRE(quantize("alphaq", "2", bad) == 1);
  std::vector<std::byte> const err = iotest::read_file(bad.string() + ".err");
  REQUIRE_THAT(std::string(reinterpret_cast<char const*>(err.data()), err.size()),
               Contains("moe_quantize: ") && Contains("below the smallest candidate"));
  // --candidates: an empty list or item is a usage error (exit 2, one line) before the model is
  // read; candidates that cannot hold a depth (64 is no multiple of 256) name the shape.
  auto quantize_with = [&](std::string const& candidates) {
    std::string command = "'";
    command.append(MOE_QUANTIZE).append("' ");
    command.append(
        words({"--model", quoted(dir), "--layer 1 --bits 8 --method alphaq --out", quoted(bad),
               "--candidates", candidates, "2>", quoted(fs::path(bad.string() + ".err"))}));
    int const status = std::system(command.c_str());
    std::vector<std::byte> const e = iotest::read_file(bad.string() + ".err");
    return std::pair{WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                     std::string(reinterpret_cast<char const*>(e.data()), e.size())};
  };
  for (std::string const list : {"''", "q4_k,,q8_0", "q8_0,"}) {
    INFO(list);
    auto const [status, text] = quantize_with(list);
    REQUIRE(status == 2);
    REQUIRE(std::count(text.begin(), text.end(), '\n') == 1);
    REQUIRE_THAT(text, Contains("moe_quantize: --candidates") &&
                           Contains("has an empty format name") && Contains("--help"));
  }
  auto const [status, text] = quantize_with("q4_k,q6_k");
  REQUIRE(status == 1);  // after the progress line, one line of error
  REQUIRE_THAT(text, Contains("\nmoe_quantize: moe: plan_quantization: no candidate format (q4_k, "
                              "q6_k) holds the in projections' depth d_model = 64") &&
                         Contains("the shape is the problem, not the budget") &&
                         Contains("(mxfp4, q4_0, iq4_nl, q4_1, q5_0, q5_1, q8_0, bf16, fp32)") &&
                         !Contains("raise the budget"));
}
#endif

TEST_CASE("moe_run_hf_layer: bad input exits 1 with one line on stderr", "[hf][runner]") {
  presets::Qwen3MoeConfig const p{8, 4, 4, 2, true};
  presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
  fs::path const dir = iotest::scratch_dir("runner_bad");
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 1, layer);
  std::vector<float> const x(3 * 5, 0.5f);
  moe::io::SafetensorsWriter().add_f32("x", {3, 5}, x).save(dir / "x.safetensors");
  std::string const args =
      words({"--model", quoted(dir), "--layer 1 --input", quoted(dir / "x.safetensors"), "--output",
             quoted(dir / "y.safetensors")});
  REQUIRE(run_runner(args, dir / "stderr.txt") == 1);
  std::vector<std::byte> const err = iotest::read_file(dir / "stderr.txt");
  std::string const text(reinterpret_cast<char const*>(err.data()), err.size());
  REQUIRE_THAT(text, Contains("moe_run_hf_layer: ") &&
                         Contains("tensor 'x' has shape [3, 5] but must be [T, 8]"));
  REQUIRE(text.find('\n') == text.size() - 1);
  REQUIRE_FALSE(fs::exists(dir / "y.safetensors"));
}

namespace {

std::string text_of(fs::path const& path) {
  std::vector<std::byte> const bytes = iotest::read_file(path);
  return std::string(reinterpret_cast<char const*>(bytes.data()), bytes.size());
}

// A tiny Qwen3-MoE checkpoint (layer 1) with x [3, 8] in x.safetensors, in scratch dir `name`.
fs::path tiny_runner_model(std::string const& name) {
  presets::Qwen3MoeConfig const p{8, 4, 4, 2, true};
  presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
  hftest::randomize(layer, 71);
  fs::path const dir = iotest::scratch_dir(name);
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 1, layer);
  moe::io::SafetensorsWriter()
      .add_f32("x", {3, 8}, hftest::random_input(3, 8, 72))
      .save(dir / "x.safetensors");
  return dir;
}

std::string runner_args(fs::path const& dir, fs::path const& output,
                        std::string const& extra = {}) {
  return words({"--model", quoted(dir), "--layer 1 --input", quoted(dir / "x.safetensors"),
                "--output", quoted(output), extra});
}

}  // namespace

TEST_CASE("moe_run_hf_layer: --threads above the limit is refused at once", "[hf][runner]") {
  fs::path const dir = tiny_runner_model("runner_threads");
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors", "--threads 100000"),
                     dir / "stderr.txt") == 1);
  REQUIRE_THAT(text_of(dir / "stderr.txt"),
               Contains("--threads '100000' is not an integer in [1, 1024]"));
  REQUIRE_FALSE(fs::exists(dir / "y.safetensors"));
}

TEST_CASE("moe_run_hf_layer: an output that is an input or not a regular file is refused",
          "[hf][runner]") {
  fs::path const dir = tiny_runner_model("runner_outputs");
  std::vector<std::byte> const x_before = iotest::read_file(dir / "x.safetensors");
  std::vector<std::byte> const w_before = iotest::read_file(dir / "model.safetensors");
  auto refused = [&](fs::path const& output, std::string const& extra, std::string const& why) {
    INFO(output.string() << " " << extra);
    REQUIRE(run_runner(runner_args(dir, output, extra), dir / "stderr.txt") == 1);
    std::string const err = text_of(dir / "stderr.txt");
    REQUIRE_THAT(err, Contains("moe_run_hf_layer: moe: --output: the output ") && Contains(why));
    REQUIRE(err.find('\n') == err.size() - 1);
  };
  refused(dir / "x.safetensors", "", "is the input");
  refused(dir / "model.safetensors", "", "is the input");
  refused(dir / "config.json", "", "is the input");
  moe::io::SafetensorsWriter()
      .add_f32("dy", {3, 8}, std::vector<float>(24, 1.0f))
      .save(dir / "dy.safetensors");
  refused(dir / "dy.safetensors", words({"--grad", quoted(dir / "dy.safetensors")}),
          "is the input");
  fs::create_hard_link(dir / "x.safetensors", dir / "x_link.safetensors");
  refused(dir / "x_link.safetensors", "", "is the input");  // same inode, another name
  fs::create_directory(dir / "out_dir");
  refused(dir / "out_dir", "", "exists and is a directory");
  fs::create_symlink(dir / "elsewhere.safetensors", dir / "link.safetensors");
  refused(dir / "link.safetensors", "", "exists and is a symbolic link");
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  refused(dir / "fifo", "", "exists and is a FIFO");
  REQUIRE(iotest::read_file(dir / "x.safetensors") == x_before);
  REQUIRE(iotest::read_file(dir / "model.safetensors") == w_before);
  REQUIRE(fs::is_fifo(dir / "fifo"));
  REQUIRE(fs::is_symlink(dir / "link.safetensors"));
  // An existing regular output is replaced.
  iotest::write_text(dir / "y.safetensors", "old");
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors"), dir / "stderr.txt") == 0);
  REQUIRE(moe::io::SafetensorsFile(dir / "y.safetensors").contains("y"));
}

TEST_CASE("moe_run_hf_layer: messages name the real cause", "[hf][runner]") {
  fs::path const dir = tiny_runner_model("runner_messages");
  auto error_of = [&](std::string const& args) {
    INFO(args);
    REQUIRE(run_runner(args, dir / "stderr.txt") == 1);
    return text_of(dir / "stderr.txt");
  };
  std::vector<std::byte> ints(3 * 8 * 4);
  moe::io::SafetensorsWriter().add("x", Dtype::kI32, {3, 8}, ints).save(dir / "xi.safetensors");
  CHECK_THAT(
      error_of(words({"--model", quoted(dir), "--layer 1 --input", quoted(dir / "xi.safetensors"),
                      "--output", quoted(dir / "y.safetensors")})),
      Contains("tensor 'x' is I32; use F32, BF16 or F16"));
  moe::io::SafetensorsWriter()
      .add_f32("dy", {4, 8}, std::vector<float>(32, 0.5f))
      .save(dir / "dy.safetensors");
  CHECK_THAT(error_of(runner_args(dir, dir / "y.safetensors",
                                  words({"--grad", quoted(dir / "dy.safetensors")}))),
             Contains("tensor 'dy' has 4 rows but must have 3, one per token of --input's x"));
  CHECK_THAT(
      error_of(words({"--model", quoted(dir / "config.json"), "--layer 1 --input",
                      quoted(dir / "x.safetensors"), "--output", quoted(dir / "y.safetensors")})),
      Contains("config.json' is a file; pass the model's directory"));
  CHECK_THAT(error_of(runner_args(dir, dir / "y.safetensors", "--strict --strict")),
             Contains("--strict is given twice"));
  REQUIRE_FALSE(fs::exists(dir / "y.safetensors"));
}

TEST_CASE("moe_run_hf_layer: extra expert tensors and unknown config keys warn; --strict fails",
          "[hf][runner]") {
  fs::path const dir = tiny_runner_model("runner_strict");
  // Clean checkpoint: no warning at all, --strict passes; stderr is the one line that says what
  // was written, stdout stays empty.
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors", "--strict") + " >" +
                         quoted(dir / "stdout.txt"),
                     dir / "stderr.txt") == 0);
  REQUIRE(text_of(dir / "stdout.txt").empty());
  REQUIRE(text_of(dir / "stderr.txt") ==
          "moe_run_hf_layer: wrote " + (dir / "y.safetensors").string() +
              ": layer 1 (qwen3_moe), 3 tokens: y [3, 8], router_logits [3, 4], topk_ids and "
              "topk_weights [3, 2]\n");

  // A 5th expert although config.json says 4.
  {
    moe::io::SafetensorsFile const in(dir / "model.safetensors");
    moe::io::SafetensorsWriter w;
    for (moe::io::TensorView const& t : in.tensors()) w.add(t.name, t.dtype, t.shape, t.bytes);
    w.add_f32("model.layers.1.mlp.experts.4.gate_proj.weight", {4, 8},
              std::vector<float>(32, 0.25f));
    w.save(dir / "model2.safetensors");
  }
  fs::rename(dir / "model2.safetensors", dir / "model.safetensors");
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors"), dir / "stderr.txt") == 0);
  std::string const warned = text_of(dir / "stderr.txt");
  REQUIRE_THAT(warned, Contains("moe_run_hf_layer: warning: the checkpoint has 1 tensor(s) under "
                                "'model.layers.1.mlp.' that this layer does not read (first: "
                                "'model.layers.1.mlp.experts.4.gate_proj.weight'); config.json "
                                "describes 4 routed experts"));
  REQUIRE(run_runner(runner_args(dir, dir / "y2.safetensors", "--strict"), dir / "stderr.txt") ==
          1);
  REQUIRE_THAT(text_of(dir / "stderr.txt"),
               Contains("experts.4.gate_proj.weight") && Contains("strict loading"));
  REQUIRE_FALSE(fs::exists(dir / "y2.safetensors"));

  // A misspelt key: transformers would ignore it, so does moe, but it says so.
  std::string config = text_of(dir / "config.json");
  config.insert(config.find('{') + 1, "\n  \"num_expert_per_tok\": 3,");
  iotest::write_text(dir / "config.json", config);
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors"), dir / "stderr.txt") == 0);
  REQUIRE_THAT(text_of(dir / "stderr.txt"),
               Contains("warning: config.json has key(s) 'num_expert_per_tok' that transformers' "
                        "configuration of qwen3_moe does not know"));
}

TEST_CASE("moe_run_hf_layer: non-finite outputs fail unless --allow-nonfinite", "[hf][runner]") {
  fs::path const dir = tiny_runner_model("runner_nonfinite");
  std::vector<float> x(3 * 8, 0.5f);
  x[8 + 2] = 3e38f;  // finite, but the router logits and the experts overflow
  moe::io::SafetensorsWriter().add_f32("x", {3, 8}, x).save(dir / "x.safetensors");
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors"), dir / "stderr.txt") == 1);
  REQUIRE_THAT(text_of(dir / "stderr.txt"),
               Contains("non-finite value(s), the first at [1, ") && Contains("--allow-nonfinite"));
  REQUIRE_FALSE(fs::exists(dir / "y.safetensors"));
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors", "--allow-nonfinite"),
                     dir / "stderr.txt") == 0);
  REQUIRE(fs::exists(dir / "y.safetensors"));
}

TEST_CASE("moe_run_hf_layer: a token's output does not depend on its batch (packed weights)",
          "[hf][runner]") {
  presets::Qwen3MoeConfig const p{64, 32, 8, 2, true};
  presets::Qwen3Moe layer = presets::make_qwen3_moe(p);
  hftest::randomize(layer, 73);
  fs::path const dir = iotest::scratch_dir("runner_batch");
  moe::io::save_hf_layer(dir, moe::io::hf_config(p), 1, layer);
  moe::Index const T = 40, D = 64;
  std::vector<float> const x = hftest::random_input(T, D, 74);
  moe::io::SafetensorsWriter().add_f32("x", {T, D}, x).save(dir / "x.safetensors");
  moe::io::SafetensorsWriter()
      .add_f32("x", {1, D}, std::span<float const>(x.data() + 5 * D, D))
      .save(dir / "x1.safetensors");
  REQUIRE(run_runner(runner_args(dir, dir / "y.safetensors", "--threads 2"), dir / "err") == 0);
  REQUIRE(
      run_runner(words({"--model", quoted(dir), "--layer 1 --input", quoted(dir / "x1.safetensors"),
                        "--output", quoted(dir / "y1.safetensors"), "--threads 1"}),
                 dir / "err") == 0);
  std::vector<float> const all =
      moe::io::to_float(moe::io::SafetensorsFile(dir / "y.safetensors").tensor("y"));
  std::vector<float> const one =
      moe::io::to_float(moe::io::SafetensorsFile(dir / "y1.safetensors").tensor("y"));
  REQUIRE(one == std::vector<float>(all.begin() + 5 * D, all.begin() + 6 * D));  // bitwise
}

#endif  // MOE_RUN_HF_LAYER
