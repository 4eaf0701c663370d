// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// moe_run_hf_attention: run one full-attention layer of a Qwen3-Next checkpoint (the gated
// attention of HF Qwen3NextAttention) on activations from a file, optionally with its backward.
//
// What it shows: moe::io::load_hf_attention() (config.json + model.safetensors or index and
// shards -> GatedAttention<ElementwiseGate>: q_proj packing each head's query and gate, (1 + w)
// RMSNorm on q and k, partial rotate-half RoPE, GQA, causal), forward or forward_train + backward.
// Why: scripts compare moe against transformers layer by layer with it (docs/hf.md).
// Command line (scripts depend on it):
//   moe_run_hf_attention --model DIR --layer L --input X.safetensors --output Y.safetensors
//                        [--grad DY.safetensors] [--threads N] [--strict] [--allow-nonfinite]
// X holds "x" [T, hidden] (F32, BF16 or F16): one sequence at positions 0..T-1. DY holds "dy"
// [T, hidden]. Y gets "y" [T, hidden] and with --grad "dx" [T, hidden] and "grad.<checkpoint
// name>" for each of q_proj, k_proj, v_proj, o_proj, q_norm, k_norm. All F32. A layer that is a
// linear_attention (Gated DeltaNet) layer is an error naming the full-attention layers.
// --help / -h lists the options, one line each, on stdout.
// Exit status: 0 on success (and for --help); 2 on an unknown argument (one line on stderr
// pointing at --help); 1 with a one-line message on stderr for any other bad input or error.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iterator>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "../common/cli.hpp"
#include "../common/output_check.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/io/hf.hpp"
#include "moe/io/hf/attention.hpp"

namespace {

using moe::Index;
using moe::detail::fail;

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR", "Qwen3-Next checkpoint: config.json + model.safetensors, or index and shards"},
    {"--layer L", "the full-attention layer to run, 0 to 2^31 - 1"},
    {"--input X.safetensors",
     "\"x\" [T, hidden], F32, BF16 or F16: one sequence, positions 0..T-1"},
    {"--output Y.safetensors", "written: \"y\" [T, hidden] F32"},
    {"--grad DY.safetensors", "also run backward on \"dy\" [T, hidden]: writes dx, grad.<name>"},
    {"--threads N", "worker threads, 1 to 1024 (default: the core count)"},
    {"--strict", "loader warnings (unknown config keys, unread tensors) are errors"},
    {"--allow-nonfinite", "write non-finite outputs instead of failing"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_run_hf_attention",
    "--model DIR --layer L --input X.safetensors --output Y.safetensors [options]", kOptions};
/// Ends the messages of a bad command line.
constexpr char kSeeHelp[] = "moe_run_hf_attention --help lists the options";

Index parse_int(std::map<std::string, std::string> const& args, std::string const& key, Index lo,
                Index hi) {
  return moe_cli::parse_integer<Index>(key, args.at(key), lo, hi);
}

std::vector<float> read_matrix(std::string const& path, char const* name, Index& rows, Index cols) {
  moe::io::SafetensorsFile const file(path);
  moe::io::TensorView const* t = file.find(name);
  if (t == nullptr) fail(path, ": no tensor '", name, "'; the file must hold \"", name, "\"");
  using moe::io::Dtype;
  if (t->dtype != Dtype::kF32 && t->dtype != Dtype::kBf16 && t->dtype != Dtype::kF16) {
    fail(path, ": tensor '", name, "' is ", moe::io::dtype_name(t->dtype),
         "; use F32, BF16 or F16");
  }
  if (t->shape.size() != 2 || t->shape[1] != cols || (rows >= 0 && t->shape[0] != rows)) {
    fail(path, ": tensor '", name, "' has shape ", moe::io::detail::shape_string(t->shape),
         " but must be [", rows >= 0 ? std::to_string(rows) : std::string("T"), ", ", cols,
         "] (T tokens of hidden_size ", cols, "; dy has the T of x)");
  }
  rows = static_cast<Index>(t->shape[0]);
  return moe::io::to_float(*t);
}

void check_finite(std::map<std::string, std::string> const& args, std::string const& name,
                  std::span<float const> values) {
  if (args.count("--allow-nonfinite") != 0) return;
  auto const bad =
      std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
  if (bad == values.end()) return;
  fail("output '", name, "' has a non-finite value at flat index ", bad - values.begin(),
       "; the input or the weights overflow float. Nothing was written; pass --allow-nonfinite "
       "to write it anyway");
}

int main_impl(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; i += 2) {
    std::string const key = argv[i];
    if (moe_cli::is_help(key)) return moe_cli::print_help(kUsage);
    if (key == "--strict" || key == "--allow-nonfinite") {
      if (!args.emplace(key, "").second) fail(key, " is given twice; ", kSeeHelp);
      --i;
      continue;
    }
    std::string_view const flags[] = {"--model",  "--layer", "--input",
                                      "--output", "--grad",  "--threads"};
    if (std::find(std::begin(flags), std::end(flags), key) == std::end(flags)) {
      return moe_cli::print_unknown_argument(kUsage, key);
    }
    if (i + 1 >= argc) fail(key, " needs a value; ", kSeeHelp);
    if (!args.emplace(key, argv[i + 1]).second) fail(key, " is given twice; ", kSeeHelp);
  }
  for (char const* required : {"--model", "--layer", "--input", "--output"}) {
    if (args.count(required) == 0) fail("missing ", required, "; ", kSeeHelp);
  }
  Index const layer = parse_int(args, "--layer", 0, INT32_MAX);
  Index threads = std::clamp(static_cast<Index>(std::thread::hardware_concurrency()), Index{1},
                             Index{moe::ThreadPool::kMaxThreads});
  if (args.count("--threads") != 0) {
    threads = parse_int(args, "--threads", 1, moe::ThreadPool::kMaxThreads);
  }
  std::unique_ptr<moe::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<moe::ThreadPool>(static_cast<int>(threads));

  std::filesystem::path const model = args.at("--model");
  std::vector<std::filesystem::path> inputs = moe_cli::model_inputs(model);
  inputs.emplace_back(args.at("--input"));
  if (args.count("--grad") != 0) inputs.emplace_back(args.at("--grad"));
  moe_cli::check_output(args.at("--output"), inputs, "--output");

  moe::io::HfLoadOptions options;
  options.strict = args.count("--strict") != 0;
  moe::io::HfAttentionLayer const hf = moe::io::load_hf_attention(model, layer, options);
  for (std::string const& w : hf.warnings) {
    std::fprintf(stderr, "moe_run_hf_attention: warning: %s (--strict makes this an error)\n",
                 w.c_str());
  }
  Index const D = hf.layer.d_model();
  Index T = -1;
  std::vector<float> const x = read_matrix(args.at("--input"), "x", T, D);
  std::vector<float> y(x.size());
  moe::GatedAttentionWorkspace ws;
  moe::AttentionOptions opt;
  opt.pool = pool.get();
  moe::io::SafetensorsWriter out;
  if (args.count("--grad") == 0) {
    hf.layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, opt);
  } else {
    std::vector<float> const dy = read_matrix(args.at("--grad"), "dy", T, D);
    hf.layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);
    auto grads = hf.layer.make_gradients();
    std::vector<float> dx(x.size());
    hf.layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, pool.get());
    check_finite(args, "dx", dx);
    out.add_f32("dx", {T, D}, dx);
    for (moe::io::HfAttentionTensor const& t : hf.tensors) {
      std::string const name = moe::io::detail::concat("grad.", t.name);
      std::vector<float> const g = moe::io::hf_attention_gradient(grads, t);
      check_finite(args, name, g);
      out.add_f32(name, t.shape, g);
    }
  }
  check_finite(args, "y", y);
  out.add_f32("y", {T, D}, y);
  out.save(args.at("--output"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string message;
  try {
    return main_impl(argc, argv);
  } catch (std::exception const& e) {
    message = e.what();
  }
  for (char& c : message) c = (c == '\n' || c == '\r') ? ' ' : c;
  std::fprintf(stderr, "moe_run_hf_attention: %s\n", message.c_str());
  return 1;
}
