// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// moe_generate: load a whole Hugging Face Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5,
// MiniMax-M2, gpt-oss or ERNIE 4.5 checkpoint, or a llama.cpp GGUF file (qwen3moe, qwen2moe,
// olmoe, glm4moe, minimax-m2, ernie4_5-moe, gpt-oss, llama/Mixtral), and generate tokens.
//
// What it shows: moe::models::load_hf_decoder() / load_gguf_decoder() (every layer through the
// library's loaders),
// a KV-cached prefill and decode loop (Decoder::forward with DecoderState), greedy or
// temperature / top-p sampling, and the numbers a user asks first: prefill and decode
// tokens/s and the KV-cache bytes per token.
//
// Command line:
//   moe_generate --model DIR|FILE.gguf --prompt-ids 1,2,3 --max-new-tokens N [--threads N]
//                [--no-cache]
//                [--temperature T --top-p P --seed S] [--logits OUT.safetensors]
//                [--dense as-stored|FORMAT] [--experts FORMAT] [--mix q4_k_m]
//                [--kv-cache fp32|bf16]
// FORMAT: fp32, bf16, q8_0, q6_k, q4_k, q4_0, q3_k or q2_k.
// --dense: the embedding, LM head, attention and dense-MLP weights (as-stored, the default,
// keeps a BF16 checkpoint's in bf16: half the bytes a step reads, the same logits as fp32
// copies; a block format quantizes them at load). --experts: the MoE experts' format (fp32
// default; the others quantize them at load, docs/quantization.md). --mix q4_k_m: llama.cpp's
// Q4_K_M choice per matrix (models::DecoderOptions::q4_k_m; overrides --dense and --experts). A
// format whose blocks do not divide a matrix's depth falls back (q4_k -> q4_0 -> q8_0 -> bf16,
// q6_k -> q8_0 -> bf16): one warning line lists the matrices that did. --kv-cache: how the KV cache
// holds keys and values (fp32 default; bf16 halves its bytes, moe::KvFormat). Prints the generated
// ids on stdout (one line, comma-separated) and the timings on stderr.
// --no-cache recomputes the whole sequence at every step (same ids; logits equal within 1e-4 of
// their scale, docs/decoding.md). --logits writes "logits" [N, vocab] F32, one row per
// generated token (the distribution it was drawn from, before temperature); it may not be a file
// the model reads (config.json, weights, shards; by device and inode), an existing directory or
// other non-regular file, or in a missing directory (refused before the model is loaded).
// Greedy by default (temperature 0). Integer options are read as typed and range-checked
// (--max-new-tokens at most 2^20 = 1048576, --threads 1 to 1024, --seed 0 to 2^64 - 1): a value
// out of range is an error naming the option, the value and the range. --help / -h lists the
// options, one line each, on stdout. Exit status 0 on success (and for --help), 2 on an unknown
// argument (one line on stderr pointing at --help), 1 with one line on stderr otherwise.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../common/cli.hpp"
#include "../common/output_check.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/io/safetensors.hpp"
#include "moe/models/decoder.hpp"
#include "moe/models/gguf_decoder.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string model, logits_out;
  std::vector<std::int64_t> prompt;
  long max_new = 16;
  int threads = 1;
  bool cache = true;
  double temperature = 0.0, top_p = 1.0;
  std::uint64_t seed = 0;
  moe::models::DecoderOptions weights;
  moe::KvFormat kv = moe::KvFormat::kF32;
};

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR|FILE.gguf",
     "checkpoint: config.json + model.safetensors (or the index and its shards), or a GGUF "
     "file (any shard of a split one; qwen3moe, qwen2moe, olmoe, glm4moe, minimax-m2, "
     "ernie4_5-moe, gpt-oss, llama/Mixtral)"},
    {"--prompt-ids I,J,...", "the prompt's token ids, comma-separated, each in [0, vocab)"},
    {"--max-new-tokens N", "tokens to generate, 0 to 2^20 = 1048576"},
    {"--threads N", "worker threads, 1 to 1024 (default 1)"},
    {"--no-cache", "recompute the whole sequence at every step instead of using the KV cache"},
    {"--temperature T", "sample from softmax(logits / T), T in [0, 100] (default 0: greedy)"},
    {"--top-p P", "sample among the likeliest tokens of total probability P, (0, 1] (default 1)"},
    {"--seed S", "sampling seed, 0 to 2^64 - 1 (default 0)"},
    {"--logits OUT.safetensors", "write \"logits\" [N, vocab] F32, one row per new token"},
    {"--dense FORMAT",
     "embedding, LM head, attention, dense MLPs: as-stored (default) or a FORMAT"},
    {"--experts FORMAT",
     "MoE experts; FORMAT: fp32 (default), bf16, q8_0, q6_k, q4_k, q4_0, q3_k, q2_k"},
    {"--mix q4_k_m", "llama.cpp's Q4_K_M choice per matrix (overrides --dense and --experts)"},
    {"--kv-cache FORMAT", "how the KV cache holds keys and values: fp32 (default) or bf16"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_generate", "--model DIR|FILE.gguf --prompt-ids I,J,... --max-new-tokens N [options]",
    kOptions};

[[noreturn]] void usage_error(std::string const& what) {
  throw std::runtime_error(what + "; moe_generate --help lists the options");
}

/// Most tokens --max-new-tokens asks for (2^20, above the context length of every family this
/// tool runs): the KV cache is sized up front for the prompt and every new token, and the sum
/// must not overflow.
constexpr long kMaxNewTokens = 1L << 20;

double parse_double(std::string const& flag, std::string const& s, double lo, double hi) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (std::exception const&) {
    used = 0;
  }
  if (used != s.size() || s.empty() || !(v >= lo && v <= hi)) {
    usage_error(flag + " needs a number in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got '" + s + "'");
  }
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  bool have_model = false, have_prompt = false, have_n = false;
  for (int i = 1; i < argc; ++i) {
    std::string const f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(f + " needs a value");
      return argv[++i];
    };
    if (moe_cli::is_help(f)) {
      moe_cli::exit_help(kUsage);
    } else if (f == "--model") {
      a.model = value();
      have_model = true;
    } else if (f == "--prompt-ids") {
      std::string const s = value();
      std::size_t p = 0;
      while (p <= s.size()) {
        std::size_t const q = std::min(s.find(',', p), s.size());
        a.prompt.push_back(moe_cli::parse_integer<std::int64_t>(
            "--prompt-ids", std::string_view(s).substr(p, q - p), 0, INT64_MAX));
        p = q + 1;
      }
      have_prompt = true;
    } else if (f == "--max-new-tokens") {
      a.max_new = moe_cli::parse_integer<long>(
          f, value(), 0, kMaxNewTokens,
          "at most 2^20: the KV cache is sized for the prompt and every new token");
      have_n = true;
    } else if (f == "--threads") {
      a.threads = moe_cli::parse_integer<int>(f, value(), 1, moe::ThreadPool::kMaxThreads);
    } else if (f == "--no-cache") {
      a.cache = false;
    } else if (f == "--temperature") {
      a.temperature = parse_double(f, value(), 0.0, 100.0);
    } else if (f == "--top-p") {
      a.top_p = parse_double(f, value(), 1e-6, 1.0);
    } else if (f == "--seed") {
      a.seed = moe_cli::parse_integer<std::uint64_t>(f, value(), 0, UINT64_MAX);
    } else if (f == "--logits") {
      a.logits_out = value();
    } else if (f == "--dense") {
      std::string const v = value();
      a.weights.dense =
          v == "as-stored" ? std::nullopt : std::optional(moe::experts::parse_weight_format(v));
    } else if (f == "--mix") {
      std::string const v = value();
      if (v != "q4_k_m") usage_error("--mix '" + v + "': the one mix is q4_k_m");
      a.weights.mix = moe::models::DecoderOptions::Mix::kQ4_K_M;
    } else if (f == "--experts") {
      a.weights.experts = moe::experts::parse_weight_format(value());
    } else if (f == "--kv-cache") {
      std::string const v = value();
      if (v != "fp32" && v != "bf16") usage_error("--kv-cache '" + v + "': use fp32 or bf16");
      a.kv = v == "bf16" ? moe::KvFormat::kBf16 : moe::KvFormat::kF32;
    } else {
      moe_cli::exit_unknown_argument(kUsage, f);
    }
  }
  if (!have_model || !have_prompt || !have_n) {
    usage_error("--model, --prompt-ids and --max-new-tokens are required");
  }
  return a;
}

/// Uniform in [0, 1) from a SplitMix64 stream.
double uniform(std::uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

/// Greedy (temperature 0: the first maximum) or a sample of softmax(logits / T) restricted to
/// the smallest set of most likely tokens whose probability reaches top_p.
std::int64_t pick(std::vector<float> const& logits, Args const& a, std::uint64_t& rng) {
  auto const n = static_cast<std::int64_t>(logits.size());
  if (a.temperature == 0.0) {
    return static_cast<std::int64_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int64_t x, std::int64_t y) { return logits[x] > logits[y]; });
  std::vector<double> p(static_cast<std::size_t>(n));
  double const mx = logits[order[0]];
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    sum += (p[i] = std::exp((logits[order[i]] - mx) / a.temperature));
  }
  std::int64_t keep = 0;
  double mass = 0.0;
  while (keep < n && mass < a.top_p * sum) mass += p[keep++];
  double u = uniform(rng) * mass;
  for (std::int64_t i = 0; i < keep; ++i) {
    if ((u -= p[i]) < 0.0) return order[i];
  }
  return order[keep - 1];
}

template <class Decoder>
int generate(Decoder const& dec, Args const& a, moe::ThreadPool* pool) {
  moe::Index const V = dec.vocab();
  std::vector<std::int64_t> ids = a.prompt;
  std::vector<float> logits(static_cast<std::size_t>(V)), all_logits;
  auto st = dec.make_state(1, static_cast<moe::Index>(a.prompt.size()) + a.max_new, a.kv);
  std::uint64_t rng = a.seed;
  auto run = [&](std::vector<std::int64_t> const& tokens) {
    if (!a.cache) st = dec.make_state(1, static_cast<moe::Index>(tokens.size()), a.kv);
    std::vector<moe::Index> const n = {static_cast<moe::Index>(tokens.size())};
    dec.forward(tokens, n, st, {logits.data(), 1, V}, pool);
  };
  auto const t0 = Clock::now();
  run(a.prompt);
  double const prefill = std::chrono::duration<double>(Clock::now() - t0).count();
  auto const t1 = Clock::now();
  auto last_note = t1;
  for (long i = 0; i < a.max_new; ++i) {
    if (!a.logits_out.empty()) all_logits.insert(all_logits.end(), logits.begin(), logits.end());
    std::int64_t const next = pick(logits, a, rng);
    ids.push_back(next);
    if (i + 1 == a.max_new) break;
    run(a.cache ? std::vector<std::int64_t>{next} : ids);
    if (Clock::now() - last_note > std::chrono::seconds(1)) {
      last_note = Clock::now();
      std::fprintf(stderr, "moe_generate: %ld of %ld tokens\n", i + 1, a.max_new);
    }
  }
  double const decode = std::chrono::duration<double>(Clock::now() - t1).count();
  for (std::size_t i = a.prompt.size(); i < ids.size(); ++i) {
    std::printf("%s%lld", i == a.prompt.size() ? "" : ",", static_cast<long long>(ids[i]));
  }
  std::printf("\n");
  long const steps = std::max(0L, a.max_new - 1);
  std::fprintf(stderr,
               "moe_generate: prefill %zu tokens in %.3f s (%.1f tokens/s); decode %ld steps in "
               "%.3f s (%.1f tokens/s%s); KV cache %zu bytes per token (%d layers)\n",
               a.prompt.size(), prefill, static_cast<double>(a.prompt.size()) / prefill, steps,
               decode, steps > 0 ? static_cast<double>(steps) / decode : 0.0,
               a.cache ? "" : ", no cache: each step recomputes the prefix",
               st.kv_bytes_per_token(), static_cast<int>(dec.blocks.size()));
  if (!a.logits_out.empty()) {
    moe::io::SafetensorsWriter()
        .add_f32("logits", {static_cast<std::int64_t>(a.max_new), V}, all_logits)
        .save(a.logits_out);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args const a = parse(argc, argv);
    if (a.prompt.empty()) usage_error("--prompt-ids needs at least one id");
    // The logits file must not be a file of the model (config.json, a weights file or shard: by
    // device and inode), a directory or other non-regular file, or in a missing directory;
    // checked before the model is loaded, so a refused run reads and writes nothing.
    if (!a.logits_out.empty()) {
      moe_cli::check_output(a.logits_out, moe_cli::model_inputs(a.model), "--logits");
    }
    std::unique_ptr<moe::ThreadPool> pool;
    if (a.threads > 1) pool = std::make_unique<moe::ThreadPool>(a.threads);
    auto const t0 = Clock::now();
    moe::models::AnyDecoder const dec =
        moe::io::is_gguf_file(a.model)
            ? moe::models::load_gguf_decoder(a.model, pool.get(), a.weights)
            : moe::models::load_hf_decoder(a.model, pool.get(), a.weights);
    moe::Index const vocab = std::visit([](auto const& d) { return d.vocab(); }, dec);
    for (std::int64_t const id : a.prompt) {
      if (id >= vocab) {
        usage_error("--prompt-ids holds " + std::to_string(id) +
                    ", outside the model's vocabulary [0, " + std::to_string(vocab) + ")");
      }
    }
    std::string const formats = std::visit(
        [&](auto const& d) {
          // The formats of the first layer (a mix varies them per layer).
          std::string attn = "-", experts = "-";
          if (!d.blocks.empty()) {
            moe::AttentionFormats const f = d.blocks.front().attention.formats();
            attn = moe::experts::name(f.q);
            if (!(f == moe::AttentionFormats(f.q))) {
              attn = attn + "/" + moe::experts::name(f.k) + "/" + moe::experts::name(f.v) + "/" +
                     moe::experts::name(f.o);
            }
          }
          for (auto const& b : d.blocks) {
            if (!b.moe) continue;
            auto const ef = b.moe->experts().packed_formats();
            if (ef.empty()) break;
            experts = moe::experts::name(ef[0].in);
            if (ef[0].down != ef[0].in) experts = experts + "/" + moe::experts::name(ef[0].down);
            break;
          }
          std::string fell;
          for (moe::models::Fallback const& f : d.fallbacks) {
            fell += (fell.empty() ? "" : ", ") + f.matrix + " " + moe::experts::name(f.asked) +
                    " -> " + moe::experts::name(f.chosen) + " (depth " + std::to_string(f.depth) +
                    ")";
          }
          for (std::string const& w : d.warnings) {
            std::fprintf(stderr, "moe_generate: warning: %s\n", w.c_str());
          }
          if (std::string const w = d.context_warning(static_cast<moe::Index>(a.prompt.size()) +
                                                      static_cast<moe::Index>(a.max_new));
              !w.empty()) {
            std::fprintf(stderr, "moe_generate: warning: %s\n", w.c_str());
          }
          if (!fell.empty()) {
            std::fprintf(stderr,
                         "moe_generate: warning: %zu matrices have depths their format's blocks "
                         "do not divide and fell back: %s\n",
                         d.fallbacks.size(), fell.c_str());
          }
          return std::string(d.config.moe.model_type()) + ", " + std::to_string(d.blocks.size()) +
                 " layers; LM head " + moe::experts::name(d.lm_head.format()) + ", attention " +
                 attn + ", experts " + experts + ", KV cache " +
                 (a.kv == moe::KvFormat::kBf16 ? "bf16" : "fp32");
        },
        dec);
    std::fprintf(stderr, "moe_generate: loaded %s in %.2f s (%s); %s\n", a.model.c_str(),
                 std::chrono::duration<double>(Clock::now() - t0).count(), formats.c_str(),
                 moe::cpu_features().describe().c_str());
    return std::visit([&](auto const& d) { return generate(d, a, pool.get()); }, dec);
  } catch (std::exception const& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "moe_generate: %s\n", msg.c_str());
    return 1;
  }
}
