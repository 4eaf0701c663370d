// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// 03_hf_layer: run one MoE layer of a Hugging Face checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE,
// DeepSeek-V3, OLMoE, Qwen3-Next, GLM-4.5, DeepSeek-V2, MiniMax-M2, ERNIE 4.5) on activations
// from a file, optionally with its backward pass.
//
// What it shows: moe::io::load_hf_moe_layer() (config.json + model.safetensors or index and
// shards -> the family's preset MoeFfn; a llama.cpp GGUF file through load_gguf_moe_layer()),
// forward or forward_train + backward, and moe::io::add_hf_gradients() naming each gradient "grad."
// + its checkpoint name. Why: scripts compare moe against PyTorch/transformers layer by layer with
// it (docs/hf.md). Command line (scripts depend on it):
//   moe_run_hf_layer --model DIR|FILE.gguf --layer L --input X.safetensors --output Y.safetensors
//                    [--grad DY.safetensors] [--threads N]
//                    [--weights fp32|bf16|q8_0|q6_k|q5_k|q5_1|q5_0|q4_k|iq4_xs|q4_1|iq4_nl|
//                               q4_0|mxfp4|q3_k|q2_k|alphaq:<average bits>]
//                    [--strict] [--allow-nonfinite]
// Without --weights the forward runs on packed fp32 weights, so a token's output is bitwise the
// same whatever batch it comes in (with --grad the training forward reads the unpacked weights).
// --weights packs the loaded experts (routed and shared) once in that format before the forward
// (ExpertBank::pack; the quantized ones with ggml's reference quantizers, docs/quantization.md):
// inference only, so it cannot be combined with --grad except as fp32. alphaq:B chooses a
// format per expert projection with AlphaQ at B bits a weight on average (the shared expert
// uniformly). A checkpoint written by moe_quantize loads as it is: packed in its stored formats.
// X holds "x" [T, hidden] (F32, BF16 or F16); DY holds "dy" [T, hidden]. Y gets "y" [T, hidden],
// "router_logits" [T, E], "topk_ids" [T, k] I64 (-1: empty slot), "topk_weights" [T, k], and with
// --grad also "dx" [T, hidden] and "grad.<checkpoint name>" per parameter. All floats are F32.
// Loader warnings (config.json keys transformers does not know or that took defaults, tensors of
// the layer's module that are not read, e.g. a 9th expert when config.json says 8) go to stderr
// as "moe_run_hf_layer: warning: ..." lines; --strict makes them an error. A non-finite value in
// y, router_logits, dx or a gradient is an error (count and first position; nothing written)
// unless --allow-nonfinite. The output may not be one of the inputs (--input, --grad, a file of
// --model; by device and inode) nor an existing non-regular file (directory, link, FIFO, device).
// --threads is at most moe::ThreadPool::kMaxThreads (1024). --help / -h lists the options, one
// line each, on stdout.
// A successful run prints one line on stderr naming the output and what it holds (stdout stays
// empty).
// Exit status: 0 on success (and for --help); 2 on an unknown argument (one line on stderr
// pointing at --help); 1 with a one-line message on stderr for any other bad input or error.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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
#include <variant>
#include <vector>

#include "../common/cli.hpp"
#include "../common/output_check.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/quantize.hpp"
#include "moe/io/gguf/layer.hpp"
#include "moe/io/hf.hpp"

namespace {

using moe::Index;
using moe::detail::fail;

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR|FILE.gguf",
     "checkpoint: config.json + model.safetensors (or the index and its shards), or a GGUF "
     "file of an architecture docs/gguf.md lists"},
    {"--layer L", "the MoE layer to run, 0 to 2^31 - 1"},
    {"--input X.safetensors", "\"x\" [T, hidden], F32, BF16 or F16"},
    {"--output Y.safetensors", "written: y, router_logits, topk_ids, topk_weights (F32, ids I64)"},
    {"--grad DY.safetensors", "also run backward on \"dy\" [T, hidden]: writes dx, grad.<name>"},
    {"--threads N", "worker threads, 1 to 1024 (default: the core count)"},
    {"--weights FORMAT",
     "pack the experts: fp32 bf16 q8_0 q6_k q5_k q5_1 q5_0 q4_k iq4_xs q4_1 iq4_nl q4_0 mxfp4 q3_k "
     "q2_k alphaq:<bits>"},
    {"--strict", "loader warnings (unknown config keys, unread tensors) are errors"},
    {"--allow-nonfinite", "write non-finite outputs instead of failing"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_run_hf_layer",
    "--model DIR|FILE.gguf --layer L --input X.safetensors --output Y.safetensors [options]",
    kOptions};
/// Ends the messages of a bad command line.
constexpr char kSeeHelp[] = "moe_run_hf_layer --help lists the options";

Index parse_int(std::map<std::string, std::string> const& args, std::string const& key, Index lo,
                Index hi = INT32_MAX) {
  return moe_cli::parse_integer<Index>(key, args.at(key), lo, hi);
}

// The float matrix `name` [rows, cols] of a safetensors file (rows < 0: any; else the T rows of
// `rows_from`).
std::vector<float> read_matrix(std::string const& path, char const* name, Index& rows, Index cols,
                               char const* rows_from = nullptr) {
  moe::io::SafetensorsFile const file(path);
  moe::io::TensorView const* t = file.find(name);
  if (t == nullptr) fail(path, ": no tensor '", name, "'; the file must hold \"", name, "\"");
  using moe::io::Dtype;
  if (t->dtype != Dtype::kF32 && t->dtype != Dtype::kBf16 && t->dtype != Dtype::kF16) {
    fail(path, ": tensor '", name, "' is ", moe::io::dtype_name(t->dtype),
         "; use F32, BF16 or F16");
  }
  if (t->shape.size() != 2 || t->shape[1] != cols) {
    fail(path, ": tensor '", name, "' has shape ", moe::io::detail::shape_string(t->shape),
         " but must be [", rows >= 0 ? std::to_string(rows) : std::string("T"), ", ", cols,
         "]: ", cols, " columns, the hidden_size of the model");
  }
  if (rows >= 0 && t->shape[0] != rows) {
    fail(path, ": tensor '", name, "' has ", t->shape[0], " rows but must have ", rows,
         ", one per token of ", rows_from, "; use the same T");
  }
  rows = static_cast<Index>(t->shape[0]);
  return moe::io::to_float(*t);
}

// Throws unless every value of `values` [rows, cols] is finite (or --allow-nonfinite).
void check_finite(std::map<std::string, std::string> const& args, std::string const& name,
                  std::span<float const> values, Index cols) {
  if (args.count("--allow-nonfinite") != 0) return;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) && bad++ == 0) first = i;
  }
  if (bad == 0) return;
  auto const c = static_cast<std::size_t>(cols);
  fail("output '", name, "' has ", bad, " non-finite value(s), the first at [", first / c, ", ",
       first % c, "] (", values[first],
       "); the input or the weights overflow float. Nothing was written; pass --allow-nonfinite "
       "to write them anyway");
}

template <class Layer>
void run(moe::io::HfLayer<Layer>& hf, std::map<std::string, std::string> const& args,
         moe::ThreadPool* pool) {
  Layer& layer = hf.layer;
  if (args.count("--weights") != 0) {
    std::string const& w = args.at("--weights");
    bool const alphaq = w.rfind("alphaq:", 0) == 0;
    auto const format =
        alphaq ? moe::experts::WeightFormat::kQ4_K : moe::experts::parse_weight_format(w);
    if ((alphaq || format != moe::experts::WeightFormat::kF32) && args.count("--grad") != 0) {
      fail("--weights ", w,
           " is for inference, but --grad runs a training forward (fp32 weights); drop one of "
           "them");
    }
    if (alphaq) {
      std::string const b = w.substr(7);
      char* end = nullptr;
      double const bits = std::strtod(b.c_str(), &end);
      if (b.empty() || *end != '\0' || !(bits > 0 && bits <= 32)) {
        fail("--weights alphaq:", b, ": the average bits must be a number in (0, 32]");
      }
      moe::experts::QuantOptions opt;
      opt.pool = pool;
      auto const plan = moe::experts::plan_quantization(
          layer.experts(), bits, moe::experts::AllocationMethod::kAlphaQ, opt);
      layer.experts().pack(plan.formats, pool);
      if constexpr (Layer::Shared::has_experts) {
        if (layer.shared_experts().count() > 0) {
          auto const sp = moe::experts::plan_quantization(
              layer.shared_experts().bank(), bits, moe::experts::AllocationMethod::kUniform, opt);
          layer.shared_experts().bank().pack(sp.formats, pool);
        }
      }
    } else {
      // A format whose blocks do not divide a projection's depth falls back (q4_k -> q4_0 ->
      // q8_0 -> bf16, q5_k -> q5_1 -> q8_0 -> bf16, q6_k -> q8_0 -> bf16): one warning line
      // says which.
      std::vector<std::string> const fell = layer.pack_weights_with_fallback(format, pool);
      std::string line;
      for (std::string const& f : fell) line += (line.empty() ? "" : "; ") + f;
      if (!line.empty()) {
        std::fprintf(stderr,
                     "moe_run_hf_layer: warning: fell back where %s blocks do not divide "
                     "the depth: %s\n",
                     moe::experts::name(format), line.c_str());
      }
    }
  } else if (args.count("--grad") == 0 && !layer.experts().packed()) {
    // Packed fp32 weights: the same kernels for every batch, so a token's output does not
    // depend on the batch it came in (docs/hf.md).
    layer.pack_weights(moe::experts::WeightFormat::kF32, pool);
  }
  Index const D = layer.d_model(), E = layer.num_experts();
  Index T = -1;
  std::vector<float> const x = read_matrix(args.at("--input"), "x", T, D);
  std::vector<float> y(x.size());
  moe::MoeFfnWorkspace ws;
  moe::ForwardOptions opt;
  opt.pool = pool;
  moe::io::SafetensorsWriter out;
  std::size_t gradients = 0;
  if (args.count("--grad") == 0) {
    layer.forward({x.data(), T, D}, {y.data(), T, D}, ws, opt);
  } else {
    std::vector<float> const dy = read_matrix(args.at("--grad"), "dy", T, D, "--input's x");
    layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws, opt);
    auto grads = layer.make_gradients();
    std::vector<float> dx(x.size());
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, pool);
    check_finite(args, "dx", dx, D);
    out.add_f32("dx", {T, D}, dx);
    // add_hf_gradients, with each gradient checked as it is converted (converted once).
    for (moe::io::HfTensor const& t : hf.tensors) {
      if (!t.is_parameter()) continue;
      std::string const name = moe::io::detail::concat("grad.", t.name);
      std::vector<float> const g = moe::io::hf_gradient_values(grads, t);
      check_finite(args, name, g, t.shape.empty() ? 1 : t.shape.back());
      out.add_f32(name, t.shape, g);
      ++gradients;
    }
  }
  check_finite(args, "y", y, D);
  check_finite(args, "router_logits", ws.logits, E);
  moe::Selection const& sel = ws.selection;
  Index const K = sel.slots;
  std::vector<std::byte> ids(static_cast<std::size_t>(T * K) * 8);
  for (Index i = 0; i < T * K; ++i) {
    moe::io::detail::store_le<std::uint64_t>(ids.data() + 8 * i,
                                             static_cast<std::uint64_t>(sel.expert[i]));
  }
  out.add_f32("y", {T, D}, y)
      .add_f32("router_logits", {T, E}, ws.logits)
      .add("topk_ids", moe::io::Dtype::kI64, {T, K}, ids)
      .add_f32("topk_weights", {T, K}, sel.weight);
  out.save(args.at("--output"));
  auto const ll = [](Index v) { return static_cast<long long>(v); };
  std::string const grads =
      args.count("--grad") == 0 ? "" : moe::io::detail::concat(", dx and ", gradients, " grad.*");
  std::fprintf(stderr,
               "moe_run_hf_layer: wrote %s: layer %lld (%s), %lld tokens: y [%lld, %lld], "
               "router_logits [%lld, %lld], topk_ids and topk_weights [%lld, %lld]%s\n",
               args.at("--output").c_str(), ll(hf.layer_index), hf.config.model_type(), ll(T),
               ll(T), ll(D), ll(T), ll(E), ll(T), ll(K), grads.c_str());
}

int main_impl(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; i += 2) {
    std::string const key = argv[i];
    if (moe_cli::is_help(key)) return moe_cli::print_help(kUsage);
    if (key == "--strict" || key == "--allow-nonfinite") {  // switches: no value
      if (!args.emplace(key, "").second) fail(key, " is given twice; ", kSeeHelp);
      --i;
      continue;
    }
    std::string_view const flags[] = {"--model", "--layer",   "--input",  "--output",
                                      "--grad",  "--threads", "--weights"};
    if (std::find(std::begin(flags), std::end(flags), key) == std::end(flags)) {
      return moe_cli::print_unknown_argument(kUsage, key);
    }
    if (i + 1 >= argc) fail(key, " needs a value; ", kSeeHelp);
    if (!args.emplace(key, argv[i + 1]).second) fail(key, " is given twice; ", kSeeHelp);
  }
  for (char const* required : {"--model", "--layer", "--input", "--output"}) {
    if (args.count(required) == 0) fail("missing ", required, "; ", kSeeHelp);
  }
  Index const layer = parse_int(args, "--layer", 0);
  Index threads = std::clamp(static_cast<Index>(std::thread::hardware_concurrency()), Index{1},
                             Index{moe::ThreadPool::kMaxThreads});
  if (args.count("--threads") != 0)
    threads = parse_int(args, "--threads", 1, moe::ThreadPool::kMaxThreads);
  std::unique_ptr<moe::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<moe::ThreadPool>(static_cast<int>(threads));

  // The output must not be an input (by device and inode: hard and symbolic links included), an
  // existing non-regular file or in a missing directory; checked before the work, so a refused
  // run writes nothing.
  std::filesystem::path const model = args.at("--model");
  std::vector<std::filesystem::path> inputs = moe_cli::model_inputs(model);
  inputs.emplace_back(args.at("--input"));
  if (args.count("--grad") != 0) inputs.emplace_back(args.at("--grad"));
  moe_cli::check_output(args.at("--output"), inputs, "--output");

  moe::io::HfLoadOptions options;
  options.strict = args.count("--strict") != 0;
  moe::io::HfAnyLayer hf = moe::io::is_gguf_file(model)
                               ? moe::io::load_gguf_moe_layer(model, layer, options)
                               : moe::io::load_hf_moe_layer(model, layer, options);
  std::visit(
      [](auto const& loaded) {
        for (std::string const& w : loaded.warnings) {
          std::fprintf(stderr, "moe_run_hf_layer: warning: %s (--strict makes this an error)\n",
                       w.c_str());
        }
      },
      hf);
  std::visit([&](auto& loaded) { run(loaded, args, pool.get()); }, hf);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string message;
  try {
    return main_impl(argc, argv);
  } catch (std::exception const& e) {  // moe::Error, std::bad_alloc, ...
    message = e.what();
  }
  for (char& c : message) c = (c == '\n' || c == '\r') ? ' ' : c;
  std::fprintf(stderr, "moe_run_hf_layer: %s\n", message.c_str());
  return 1;
}
