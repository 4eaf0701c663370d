// SPDX-License-Identifier: Apache-2.0
// moe_cache_sim: replays a routing trace through every expert-cache policy and Belady's MIN at a
// list of budgets, and prints hit rate, misses and bytes read per token, and the I/O ceiling in
// tokens/s at a read bandwidth (docs/offload.md).
//
//   moe_cache_sim [--trace FILE | --preset NAME] [--budgets 10%,25%,40%|8GiB,...]
//                 [--expert-bytes N] [--bandwidth GB/s] [--warmup N] [--tokens N] [--layers N]
//                 [--seed S] [--write-trace FILE] [--train-predictor OUT | --predictor FILE]
//                 [--train-trace FILE]
//
// Synthetic traces also get an "oracle" row (LatentOracle: evicts by the generator's expected
// next-token logits, which no real system knows): how far any predictor of the next routing
// could go. The learned policy needs a predictor: --predictor FILE loads one; otherwise one is
// trained (and saved with --train-predictor OUT) on --train-trace FILE, or for a preset on the same
// preset drawn with seed + 1, or else on the replayed trace itself (optimistic: said in the
// output). Errors: one line on stderr, exit status 1; a bad or unknown argument: exit status 2.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../common/cli.hpp"
#include "moe/io/detail/output_file.hpp"
#include "moe/offload/predictor.hpp"
#include "moe/offload/simulator.hpp"
#include "moe/offload/synthetic.hpp"
#include "moe/offload/trace.hpp"

namespace {

namespace off = moe::offload;

constexpr moe_cli::Option kOptions[] = {
    {"--trace FILE", "replay this trace file (format: docs/offload.md)"},
    {"--preset NAME", "replay a synthetic trace: qwen3-30b-a3b (default) or uniform"},
    {"--tokens N", "tokens of the synthetic trace (default 2000)"},
    {"--layers N", "layers of the synthetic trace (default: the preset's, 48)"},
    {"--seed S", "seed of the synthetic trace (default 1)"},
    {"--write-trace FILE", "also write the replayed trace to FILE"},
    {"--budgets LIST",
     "cache budgets, each a share (25%) or a size (8GiB, 512MiB, 2GB); "
     "default 10%,25%,40%"},
    {"--expert-bytes N",
     "bytes of one expert (default 9437184: Qwen3-30B-A3B bf16, 3 x 2048 x "
     "768 x 2)"},
    {"--bandwidth GB/s", "read bandwidth for the I/O ceiling, 1e9 bytes/s (default 3)"},
    {"--warmup N", "tokens replayed before counting (default 200)"},
    {"--predictor FILE", "the learned policy's predictor (moe-reuse-predictor file)"},
    {"--train-predictor OUT", "train the predictor and save it to OUT"},
    {"--train-trace FILE", "train the predictor on this trace file"},
    {"--cache-routing SPEC",
     "replay cache-aware routing, e.g. tau=0.05,keep=1,candidates=16,swaps=1 (needs candidates in "
     "the trace; the belady row stays exact routing's bound)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_cache_sim",
    "[--trace FILE | --preset NAME] [--budgets LIST] [--expert-bytes N] [--bandwidth GB/s] "
    "[--warmup N] [--tokens N] [--layers N] [--seed S] [--write-trace FILE] "
    "[--train-predictor OUT | --predictor FILE] [--train-trace FILE] [--cache-routing SPEC]",
    kOptions};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A budget as typed: a share of all experts' bytes, or a size.
struct Budget {
  std::string text;
  double share = -1.0;      // in (0, 1] when given as a percentage
  std::uint64_t bytes = 0;  // else
};

struct Args {
  std::string trace, preset = "qwen3-30b-a3b", write_trace, predictor, train_predictor, train_trace;
  moe::Index tokens = 2000, layers = 0, warmup = 200;
  std::uint64_t seed = 1, expert_bytes = 9437184;
  double bandwidth_gbs = 3.0;
  std::vector<Budget> budgets;
  bool have_preset = false;
  moe::offload::CacheRoutingOptions cache_routing;
};

double parse_number(std::string_view option, std::string_view text) {
  std::string const s(text);
  char* end = nullptr;
  double const v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v <= 0.0)
    throw UsageError(std::string(option) + " '" + s + "' is not a positive number");
  return v;
}

Budget parse_budget(std::string_view text) {
  Budget b;
  b.text = std::string(text);
  if (!text.empty() && text.back() == '%') {
    b.share = parse_number("--budgets", text.substr(0, text.size() - 1)) / 100.0;
    if (b.share > 1.0) throw UsageError("--budgets '" + b.text + "' is more than 100%");
    return b;
  }
  try {  // a size with its unit (moe_cli::parse_bytes)
    b.bytes = moe_cli::parse_bytes("--budgets", text);
  } catch (moe::Error const&) {
    throw UsageError("--budgets '" + b.text +
                     "' is neither a share (25%) nor a size with a unit (8GiB, 512MiB, 2GB, 100B)");
  }
  return b;
}

Args parse(int argc, char** argv) {
  Args a;
  std::string budgets = "10%,25%,40%";
  for (int i = 1; i < argc; ++i) {
    std::string const f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(f + " needs a value");
      return argv[++i];
    };
    if (moe_cli::is_help(f)) {
      moe_cli::exit_help(kUsage);
    } else if (f == "--trace") {
      a.trace = value();
    } else if (f == "--preset") {
      a.preset = value();
      a.have_preset = true;
      if (a.preset != "qwen3-30b-a3b" && a.preset != "uniform")
        throw UsageError("--preset '" + a.preset + "' is not one of qwen3-30b-a3b, uniform");
    } else if (f == "--tokens") {
      a.tokens = moe_cli::parse_integer<moe::Index>("--tokens", value(), 2, 10000000);
    } else if (f == "--layers") {
      a.layers = moe_cli::parse_integer<moe::Index>("--layers", value(), 1, 65536);
    } else if (f == "--seed") {
      a.seed = moe_cli::parse_integer<std::uint64_t>("--seed", value(), 0, UINT64_MAX);
    } else if (f == "--write-trace") {
      a.write_trace = value();
    } else if (f == "--budgets") {
      budgets = value();
    } else if (f == "--expert-bytes") {
      a.expert_bytes =
          moe_cli::parse_integer<std::uint64_t>("--expert-bytes", value(), 1, 1ull << 40);
    } else if (f == "--bandwidth") {
      a.bandwidth_gbs = parse_number("--bandwidth", value());
    } else if (f == "--warmup") {
      a.warmup = moe_cli::parse_integer<moe::Index>("--warmup", value(), 0, 10000000);
    } else if (f == "--predictor") {
      a.predictor = value();
    } else if (f == "--train-predictor") {
      a.train_predictor = value();
    } else if (f == "--cache-routing") {
      a.cache_routing = moe::offload::parse_cache_routing(value());
    } else if (f == "--train-trace") {
      a.train_trace = value();
    } else {
      moe_cli::exit_unknown_argument(kUsage, f);
    }
  }
  if (!a.trace.empty() && a.have_preset)
    throw UsageError("give --trace FILE or --preset NAME, not both");
  if (!a.predictor.empty() && (!a.train_predictor.empty() || !a.train_trace.empty()))
    throw UsageError(
        "--predictor FILE loads a predictor; --train-predictor / --train-trace "
        "train one: give one or the other");
  std::string_view s = budgets;
  while (true) {
    std::size_t const comma = s.find(',');
    a.budgets.push_back(parse_budget(s.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return a;
}

off::SyntheticTraceConfig preset_config(Args const& a, std::uint64_t seed) {
  off::SyntheticTraceConfig c = off::qwen3_30b_a3b_trace_config(a.tokens, seed);
  if (a.preset == "uniform") {  // the same sizes, i.i.d. uniform routing
    c.reuse_probability = -1.0;
    c.persistence = 0.0;
    c.zipf_exponent = 0.0;
    c.slow_fraction = 0.0;
  }
  if (a.layers > 0) c.num_layers = a.layers;
  return c;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  return buf;
}

template <class Policy>
void row(off::Trace const& t, off::CacheGeometry const& g, Policy policy,
         off::SimulationOptions const& o, std::vector<moe::Index> const& next,
         std::string const& budget) {
  off::SimulationResult const r = off::simulate(t, g, std::move(policy), o, next);
  std::printf("%-22s %-10s %8.4f %10.2f %12.1f %14.2f", budget.c_str(), r.policy.c_str(),
              r.hit_rate, r.misses_per_token, r.bytes_per_token / 1048576.0,
              r.io_ceiling_tokens_per_s);
  if (o.cache_routing.enabled) {
    std::printf(" %9.3f %9.4f",
                static_cast<double>(r.swaps) / static_cast<double>(r.measured_tokens),
                r.swapped_weight);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moe_cache_sim: %s; moe_cache_sim --help lists the options\n", e.what());
    return moe_cli::kExitUsage;
  }
  try {
    // Before anything is read or written: an input that is a directory, and an output that is an
    // input (by device and inode) or the other output, are refused.
    std::vector<std::filesystem::path> inputs;
    for (std::string const* in : {&a.trace, &a.train_trace, &a.predictor}) {
      if (in->empty()) continue;
      std::error_code ec;
      if (std::filesystem::is_directory(*in, ec)) {
        moe::detail::fail("'", *in, "' is a directory; pass a file");
      }
      inputs.emplace_back(*in);
    }
    for (auto const& [out, option] : {std::pair{&a.write_trace, "--write-trace"},
                                      std::pair{&a.train_predictor, "--train-predictor"}}) {
      if (out->empty()) continue;
      moe::io::check_output_file(*out, inputs, option);
    }
    if (!a.write_trace.empty() && moe::io::same_file(a.write_trace, a.train_predictor)) {
      moe::detail::fail("--write-trace and --train-predictor name the same file '", a.write_trace,
                        "'; give each output its own file");
    }
    off::Trace trace;
    std::string source;
    std::optional<off::SyntheticTraceConfig> config;
    std::vector<float> latent;  // a synthetic trace's expected next-token logits (LatentOracle)
    if (!a.trace.empty()) {
      trace = off::read_trace(a.trace);
      source = a.trace;
    } else {
      config = preset_config(a, a.seed);
      trace = off::make_synthetic_trace(*config, &latent);
      source = "synthetic " + a.preset + " (seed " + std::to_string(a.seed) + ")";
    }
    if (!a.write_trace.empty()) off::write_trace(a.write_trace, trace);
    off::TraceShape const& s = trace.shape();
    if (a.warmup >= trace.num_tokens())
      throw std::runtime_error("--warmup " + std::to_string(a.warmup) + " is not below the " +
                               std::to_string(trace.num_tokens()) + " tokens of the trace");

    // The learned policy's predictor.
    off::ReusePredictor predictor;
    std::string trained_on;
    if (!a.predictor.empty()) {
      predictor = off::ReusePredictor::load(a.predictor);
      trained_on = "loaded from " + a.predictor;
    } else {
      off::Trace train;
      if (!a.train_trace.empty()) {
        train = off::read_trace(a.train_trace);
        trained_on = "trained on " + a.train_trace;
      } else if (config) {
        train = off::make_synthetic_trace(preset_config(a, a.seed + 1));
        trained_on = "trained on the preset with seed " + std::to_string(a.seed + 1);
      } else {
        train = trace;
        trained_on = "trained on the replayed trace itself (optimistic)";
      }
      off::Trace const* traces[] = {&train};
      predictor = off::ReusePredictor::train(traces);
      if (!a.train_predictor.empty()) {
        predictor.save(a.train_predictor);
        trained_on += ", saved to " + a.train_predictor;
      }
    }

    off::LocalityStats const loc = off::measure_locality(trace);
    double const total =
        static_cast<double>(a.expert_bytes) * static_cast<double>(s.num_layers * s.num_experts);
    std::printf("trace: %s: %td tokens, %td layers x %td experts, top-%td, %td candidates\n",
                source.c_str(), trace.num_tokens(), s.num_layers, s.num_experts, s.top_k,
                s.num_candidates);
    std::printf(
        "locality: next-token repeat %.3f, within 8 tokens %.3f, median reuse distance "
        "%.0f tokens\n",
        loc.next_token_repeat, loc.within_8_repeat, loc.median_reuse_distance);
    std::printf("experts: %td x %llu bytes = %s; warm-up %td tokens; bandwidth %.2f GB/s\n",
                s.num_layers * s.num_experts, static_cast<unsigned long long>(a.expert_bytes),
                gib(total).c_str(), a.warmup, a.bandwidth_gbs);
    std::printf("learned predictor: %s\n\n", trained_on.c_str());
    std::printf("%-22s %-10s %8s %10s %12s %14s%s\n", "budget", "policy", "hit rate", "misses/tok",
                "MiB/token", "I/O ceil tok/s",
                a.cache_routing.enabled ? "  swaps/tok  weight moved" : "");

    off::SimulationOptions o;
    o.warmup_tokens = a.warmup;
    o.bandwidth_bytes_per_s = a.bandwidth_gbs * 1e9;
    o.cache_routing = a.cache_routing;
    if (a.cache_routing.enabled && s.num_candidates == 0) {
      throw std::runtime_error(
          "--cache-routing needs the router's candidates in the trace (this one records none)");
    }
    std::vector<moe::Index> const next = off::next_use_steps(trace);
    for (Budget const& b : a.budgets) {
      std::uint64_t const bytes =
          b.share > 0 ? static_cast<std::uint64_t>(b.share * total) : b.bytes;
      off::CacheGeometry const g =
          off::CacheGeometry::uniform(s.num_layers, s.num_experts, a.expert_bytes, bytes);
      std::string const label = b.text + " (" + gib(static_cast<double>(bytes)) + ")";
      row(trace, g, off::Lru{}, o, next, label);
      row(trace, g, off::DecayedLfu{}, o, next, label);
      row(trace, g, off::LayerAwareLru{}, o, next, label);
      row(trace, g, off::LearnedEviction(predictor), o, next, label);
      if (!latent.empty()) row(trace, g, off::LatentOracle(latent), o, next, label);
      off::SimulationOptions exact = o;
      exact.cache_routing = {};  // Belady: the bound of the trace's own routing
      row(trace, g, off::Belady{}, exact, next, label);
    }
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moe_cache_sim: %s\n", e.what());
    return 1;
  }
}
