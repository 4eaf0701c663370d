// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// 05_quantize: quantize the experts of one MoE layer of a Hugging Face checkpoint, uniformly or
// with AlphaQ (a precision per expert from its weights' spectra, no calibration data); or write
// a whole model as a llama.cpp GGUF file in the formats asked for.
//
// What it shows: moe::experts::plan_quantization() (alpha per projection, the exact bit
// allocation under a budget, the report), moe::io::save_hf_layer_quantized() (a checkpoint whose
// expert tensors are GGUF blocks), and that moe_run_hf_layer --model OUT runs it as it is.
// Command line:
//   moe_quantize --model DIR --layer L --bits B --method alphaq|uniform --out DIR
//                [--threads N] [--alpha-power P] [--candidates q4_0,q4_k,q6_k,q8_0,bf16]
//   moe_quantize --model DIR|FILE.gguf --out FILE.gguf [--mix q4_k_m] [--dense FORMAT]
//                [--experts FORMAT]
// The second form (an --out ending in .gguf) writes the whole model (every layer, the
// embedding, the LM head) in llama.cpp's names, metadata and layouts
// (models::save_gguf_model), each matrix in the format asked for (--mix q4_k_m: llama.cpp's
// Q4_K_M choice per matrix; --dense / --experts: one format for those classes; unset: as
// stored), which moe_generate --model FILE.gguf then runs as stored; it prints one line per
// type written and the matrices that fell back. The tokenizer goes with it: a GGUF input's
// tokenizer.* metadata as it is; a directory's tokenizer.json (and tokenizer_config.json) as
// llama.cpp's converter writes it (text::set_gguf_tokenizer; a build with moe::text), or a
// warning line saying why it could not be.
// B: the average bits a weight over the routed experts (e.g. 4.5 = q4_k's). The shared expert
// (if any) takes the uniform choice at B. Writes OUT/config.json, OUT/model.safetensors (the
// layer, its expert projections in the chosen formats: docs/quantization.md "Checkpoints") and
// OUT/quant_report.tsv (expert, projection, alpha, format, bits, relative error), and prints a
// summary. --help / -h lists the options, one line each, on stdout. Exit status 0 (and for
// --help), 2 on an unknown argument or an empty --candidates list or item (one line on stderr
// pointing at --help), or 1 with a one-line message on stderr.

#include <charconv>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "../common/cli.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/quantize.hpp"
#include "moe/io/hf.hpp"
#include "moe/models/gguf_writer.hpp"
#ifdef MOE_QUANTIZE_WITH_TEXT
#include "moe/text/gguf_tokenizer.hpp"
#endif

namespace {

using moe::Index;
using moe::detail::fail;
namespace experts = moe::experts;

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR",
     "checkpoint: config.json + model.safetensors, or the index and its shards "
     "(with --out FILE.gguf also a .gguf file)"},
    {"--layer L", "the MoE layer to quantize, 0 to 2^20"},
    {"--bits B", "average bits a weight over the routed experts, in [0, 64] (4.5: q4_k's)"},
    {"--method M", "alphaq (a format per projection from its spectrum) or uniform"},
    {"--out DIR", "a new directory: config.json, model.safetensors, quant_report.tsv"},
    {"--threads N", "worker threads, 1 to 1024 (default: the core count)"},
    {"--alpha-power P", "AlphaQ's exponent on alpha, in [0, 64] (default 3)"},
    {"--candidates LIST",
     "formats to choose from (default: q2_k,q3_k,q4_0,q4_k,q5_k,q6_k,q8_0,bf16)"},
    {"--out FILE.gguf", "instead: the whole model as a llama.cpp GGUF file (no --layer/--bits)"},
    {"--mix q4_k_m", "with FILE.gguf: llama.cpp's Q4_K_M choice per matrix"},
    {"--dense FORMAT", "with FILE.gguf: embedding, LM head, attention, dense MLPs (as stored)"},
    {"--experts FORMAT", "with FILE.gguf: routed and shared experts (default: as stored)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {"moe_quantize",
                                   "--model DIR (--layer L --bits B --method alphaq|uniform --out "
                                   "DIR | --out FILE.gguf) [options]",
                                   kOptions};
/// Ends the messages of a bad command line.
constexpr char kSeeHelp[] = "moe_quantize --help lists the options";

double parse_double(std::string const& key, std::string const& s) {
  double v = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || !(v >= 0) || v > 64) {
    fail(key, " '", s, "' is not a number in [0, 64]; ", kSeeHelp);
  }
  return v;
}

Index parse_int(std::string const& key, std::string const& s, Index lo, Index hi) {
  return moe_cli::parse_integer<Index>(key, s, lo, hi);
}

template <class Layer>
void quantize(moe::io::HfLayer<Layer>& hf, std::map<std::string, std::string> const& args,
              std::vector<experts::WeightFormat> const& candidates, moe::ThreadPool* pool) {
  Layer& layer = hf.layer;
  double const bits = parse_double("--bits", args.at("--bits"));
  std::string const& m = args.at("--method");
  if (m != "alphaq" && m != "uniform") fail("--method '", m, "' is not alphaq or uniform");
  auto const method =
      m == "alphaq" ? experts::AllocationMethod::kAlphaQ : experts::AllocationMethod::kUniform;
  experts::QuantOptions opt;
  opt.pool = pool;
  if (args.count("--alpha-power") != 0) {
    opt.alpha_power = parse_double("--alpha-power", args.at("--alpha-power"));
  }
  if (!candidates.empty()) opt.candidates = candidates;
  std::fprintf(stderr, "moe_quantize: %lld experts, spectra and errors of every projection...\n",
               static_cast<long long>(layer.num_experts()));
  experts::QuantPlan const plan = experts::plan_quantization(layer.experts(), bits, method, opt);
  experts::ExpertFormat shared{};
  experts::QuantPlan shared_plan;
  if constexpr (Layer::Shared::has_experts) {
    if (layer.shared_experts().count() > 0) {
      shared_plan = experts::plan_quantization(layer.shared_experts().bank(), bits,
                                               experts::AllocationMethod::kUniform, opt);
      shared = shared_plan.formats[0];
    }
  }
  std::filesystem::path const out = args.at("--out");
  moe::io::save_hf_layer_quantized(out, hf.config, hf.layer_index, layer, plan.formats, shared);
  std::string report = "expert\tprojection\talpha\tformat\tbits\trelative_error\n";
  auto row = [&](std::string const& who, char const* proj, experts::ProjectionReport const& r) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s\t%s\t%.4f\t%s\t%.4f\t%.6f\n", who.c_str(), proj, r.alpha,
                  experts::name(r.format), r.bits, r.relative_error);
    report += buf;
  };
  for (std::size_t e = 0; e < plan.experts.size(); ++e) {
    row(std::to_string(e), "in", plan.experts[e].in);
    row(std::to_string(e), "down", plan.experts[e].down);
  }
  if (!shared_plan.experts.empty()) {
    row("shared", "in", shared_plan.experts[0].in);
    row("shared", "down", shared_plan.experts[0].down);
  }
  moe::io::detail::write_text_file(out / "quant_report.tsv", report);
  std::map<std::string, int> count;
  for (auto const& f : plan.formats) {
    ++count[experts::name(f.in)];
    ++count[experts::name(f.down)];
  }
  std::printf("moe_quantize: layer %lld, %s at %.4f bits: %.4f bits a weight on average;",
              static_cast<long long>(hf.layer_index), m.c_str(), bits, plan.average_bits);
  for (auto const& [name, n] : count) std::printf(" %s x%d", name.c_str(), n);
  std::printf(" (projections); weighted error %.6g; wrote %s\n", plan.objective,
              out.string().c_str());
}

/// The whole model in `args` as a GGUF file (--out FILE.gguf).
int write_gguf_model(std::map<std::string, std::string> const& args) {
  for (char const* layer_only :
       {"--layer", "--bits", "--method", "--alpha-power", "--candidates", "--threads"}) {
    if (args.count(layer_only) != 0) {
      fail(layer_only, " quantizes one layer; --out FILE.gguf writes the whole model in the ",
           "formats --mix, --dense and --experts ask for. ", kSeeHelp);
    }
  }
  moe::models::DecoderOptions o;
  if (args.count("--mix") != 0) {
    if (args.at("--mix") != "q4_k_m") fail("--mix '", args.at("--mix"), "' is not q4_k_m");
    o = moe::models::DecoderOptions::q4_k_m();
  }
  if (args.count("--dense") != 0) o.dense = experts::parse_weight_format(args.at("--dense"));
  if (args.count("--experts") != 0) o.experts = experts::parse_weight_format(args.at("--experts"));
  std::filesystem::path const out = args.at("--out"), model = args.at("--model");
  if (moe::io::same_file(out, model)) fail("--out '", out.string(), "' is the --model file");
  // A directory's tokenizer, as llama.cpp's converter writes it (a GGUF input carries its own).
  std::function<void(moe::io::GgufWriter&)> tokenizer;
  std::string tokenizer_note;
  if (!moe::io::is_gguf_file(model)) {
    std::filesystem::path const json = model / "tokenizer.json";
    if (!std::filesystem::exists(json)) {
      tokenizer_note = "no tokenizer.json in the model directory: the file has no tokenizer";
    } else {
#ifdef MOE_QUANTIZE_WITH_TEXT
      moe::Index const vocab = moe::models::read_decoder_config(model).vocab_size;
      tokenizer = [&, json, vocab](moe::io::GgufWriter& w) {
        try {
          std::string const pre =
              moe::text::set_gguf_tokenizer(w, json, static_cast<std::size_t>(vocab));
          tokenizer_note = pre.empty() ? "tokenizer written (SentencePiece, model llama)"
                                       : "tokenizer written (model gpt2, pre " + pre + ")";
        } catch (moe::Error const& e) {
          tokenizer_note = std::string("the file has no tokenizer: ") + e.what();
        }
      };
#else
      tokenizer_note =
          "this moe_quantize was built without moe::text (PCRE2, ICU): the file has no tokenizer";
#endif
    }
  }
  moe::models::GgufSaveReport const r = moe::models::save_gguf_model(out, model, o, tokenizer);
  if (!tokenizer_note.empty()) {
    bool const written = tokenizer_note.rfind("tokenizer written", 0) == 0;
    std::fprintf(stderr, "moe_quantize: %s%s\n",
                 written ? "" : "warning: ", tokenizer_note.c_str());
  }
  std::string fell;
  for (moe::models::Fallback const& f : r.fallbacks) {
    fell += (fell.empty() ? "" : ", ") + f.matrix + " " + experts::name(f.asked) + " -> " +
            experts::name(f.chosen);
  }
  if (!fell.empty()) std::fprintf(stderr, "moe_quantize: warning: fell back: %s\n", fell.c_str());
  std::printf("moe_quantize: wrote %s:", out.string().c_str());
  for (auto const& [type, n] : r.tensors_by_type) {
    std::printf(" %s x%lld", type.c_str(), static_cast<long long>(n));
  }
  std::printf(" (tensors)\n");
  return 0;
}

int main_impl(int argc, char** argv) {
  std::map<std::string, std::string> args;
  std::string_view const flags[] = {"--model", "--layer",   "--bits",        "--method",
                                    "--out",   "--threads", "--alpha-power", "--candidates",
                                    "--mix",   "--dense",   "--experts"};
  for (int i = 1; i < argc; i += 2) {
    std::string const key = argv[i];
    if (moe_cli::is_help(key)) return moe_cli::print_help(kUsage);
    bool known = false;
    for (auto f : flags) known = known || f == key;
    if (!known) return moe_cli::print_unknown_argument(kUsage, key);
    if (i + 1 >= argc) fail(key, " needs a value; ", kSeeHelp);
    if (!args.emplace(key, argv[i + 1]).second) fail(key, " is given twice; ", kSeeHelp);
  }
  if (args.count("--out") != 0 && args.at("--out").ends_with(".gguf")) {
    if (args.count("--model") == 0) fail("missing --model; ", kSeeHelp);
    return write_gguf_model(args);
  }
  for (char const* gguf_only : {"--mix", "--dense", "--experts"}) {
    if (args.count(gguf_only) != 0) {
      fail(gguf_only, " chooses formats for --out FILE.gguf (the whole model); one layer takes ",
           "--bits and --method. ", kSeeHelp);
    }
  }
  for (char const* required : {"--model", "--layer", "--bits", "--method", "--out"}) {
    if (args.count(required) == 0) {
      // --out not ending in .gguf means a layer checkpoint directory: say so.
      fail("missing ", required, " (one layer quantized into the directory --out",
           args.count("--out") != 0 ? " '" + args.at("--out") + "'" : std::string(),
           "; a whole model is written by --out FILE.gguf, lower-case .gguf); ", kSeeHelp);
    }
  }
  Index const layer = parse_int("--layer", args.at("--layer"), 0, 1 << 20);
  // --candidates: a comma-separated list of format names; an empty list or item is a usage
  // error (exit 2), not the default list.
  std::vector<experts::WeightFormat> candidates;
  if (args.count("--candidates") != 0) {
    std::string_view list = args.at("--candidates");
    for (bool more = true; more;) {
      std::size_t const comma = list.find(',');
      std::string_view const item = list.substr(0, comma);
      if (item.empty()) {
        std::fprintf(stderr,
                     "moe_quantize: --candidates '%s' has an empty format name; give a "
                     "comma-separated list such as q4_k,q6_k,q8_0,bf16 (%s)\n",
                     args.at("--candidates").c_str(), kSeeHelp);
        return moe_cli::kExitUsage;
      }
      candidates.push_back(experts::parse_weight_format(item));
      more = comma != std::string_view::npos;
      if (more) list = list.substr(comma + 1);
    }
  }
  Index threads = std::clamp(static_cast<Index>(std::thread::hardware_concurrency()), Index{1},
                             Index{moe::ThreadPool::kMaxThreads});
  if (args.count("--threads") != 0)
    threads = parse_int("--threads", args.at("--threads"), 1, moe::ThreadPool::kMaxThreads);
  std::unique_ptr<moe::ThreadPool> pool;
  if (threads > 1) pool = std::make_unique<moe::ThreadPool>(static_cast<int>(threads));
  if (moe::io::same_file(args.at("--out"), args.at("--model"))) {
    fail("--out '", args.at("--out"),
         "' is the --model directory; writing there would replace the ",
         "model's config.json and weights, pass a new directory");
  }
  moe::io::HfAnyLayer hf = moe::io::load_hf_moe_layer(args.at("--model"), layer);
  std::visit([&](auto& loaded) { quantize(loaded, args, candidates, pool.get()); }, hf);
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
  std::fprintf(stderr, "moe_quantize: %s\n", message.c_str());
  return 1;
}
