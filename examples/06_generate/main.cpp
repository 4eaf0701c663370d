// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// moe_generate: load a whole Hugging Face Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5,
// MiniMax-M2, gpt-oss or ERNIE 4.5 checkpoint, or a llama.cpp GGUF file (qwen3moe, qwen2moe,
// olmoe, glm4moe, minimax-m2, ernie4_5-moe, gpt-oss, llama/Mixtral), and generate tokens.
//
// What it shows: moe::models::load_hf_decoder() / load_gguf_decoder() (every layer through the
// library's loaders), moe::models::generate() (a KV-cached prefill and decode loop over
// Decoder::forward, greedy or temperature / top-p sampling by models::Sampler, a callback per
// token), and the numbers a user asks first: prefill and decode tokens/s and the KV-cache bytes
// per token.
//
// Command line:
//   moe_generate --model DIR|FILE.gguf (--prompt-ids 1,2,3 | --prompt TEXT | --prompt-file F)
//                --max-new-tokens N [--chat] [--ignore-eos] [--print-ids] [--print-prompt-ids]
//                [--threads N] [--no-cache]
//                [--temperature T --top-p P --seed S] [--logits OUT.safetensors]
//                [--dense as-stored|FORMAT] [--experts FORMAT] [--mix q4_k_m]
//                [--kv-cache fp32|bf16]
// The prompt: --prompt-ids gives token ids as they are (nothing added; the output is the
// generated ids on stdout, one line, comma-separated, and generation runs to --max-new-tokens).
// --prompt TEXT or --prompt-file F (UTF-8) is tokenized with the model's own tokenizer
// (moe::text::load_model_tokenizer: DIR's tokenizer.json and tokenizer_config.json, or the GGUF
// file's tokenizer.ggml.* metadata), with BOS when the model adds it; --chat first wraps it as
// one user turn in the model's chat format with the assistant's generation prompt (ChatML for
// Qwen, DeepSeek-V3's, gpt-oss's harmony; recognised from the chat template; another template
// is an error). Then the generated text is printed on stdout as it is produced (whole UTF-8
// characters, flushed per token), followed by one newline; generation stops at the model's end
// tokens (EOS, EOT, generation_config.json's eos_token_id, the chat format's end of turn; the
// end token itself is not printed) unless --ignore-eos, else at --max-new-tokens.
// --print-ids then prints the generated ids line as --prompt-ids does (the end token included);
// --print-prompt-ids prints the prompt's ids on stderr. The --prompt options are mutually
// exclusive. Without the tokenizer in the build (moe::text needs PCRE2 and ICU), --prompt,
// --prompt-file and --chat are refused in one line saying so; --prompt-ids works.
// FORMAT: fp32, bf16, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, iq4_xs, q4_1, iq4_nl, q4_0, mxfp4, q3_k
// or q2_k.
// --dense: the embedding, LM head, attention and dense-MLP weights (as-stored, the default,
// keeps a BF16 checkpoint's in bf16: half the bytes a step reads, the same logits as fp32
// copies, and a GGUF file's quantized matrices in their blocks; a block format quantizes them at
// load). --experts: the MoE experts' format (default: as stored: a GGUF file's blocks as they
// are, else fp32; the others quantize them at load, docs/quantization.md). --mix q4_k_m:
// llama.cpp's Q4_K_M choice per matrix (models::DecoderOptions::q4_k_m; overrides --dense and
// --experts). A format whose blocks do not divide a matrix's depth falls back (q4_k -> q4_0 -> q8_0
// -> bf16, q5_k -> q5_1 -> q8_0 -> bf16, q6_k -> q8_0 -> bf16): one warning line lists the
// matrices that did.
// Models larger than RAM (docs/offload.md): --write-expert-store FILE writes the model's routed
// experts (in their --experts formats) as an expert store (one 4 KiB-aligned record per layer
// and expert, packed for this machine's kernels), reading one MoE layer at a time, and exits;
// --expert-store FILE then runs the model with those experts read on demand through a cache of
// --expert-cache bytes
// (--cache-policy, --reader-threads, --prefetch, --direct-io; --read-bandwidth / --read-latency
// emulate a drive), the checkpoint's own expert weights never read; the same ids and logits bit
// for bit, and one line on stderr with the hit rate, bytes read per token, time waiting for reads
// and the prefetch's precision and recall. --stream-experts streams them through the same cache
// straight from the model's own file instead (no store: each miss re-packs the expert's stored
// blocks, or converts its bf16/fp32 weights; formats as stored). --cache-routing (off by default)
// lets a token swap low-ranked uncached experts for cached ones within a guarded rule
// (docs/offload.md): the output then differs from the model's exact routing. --trace-out FILE
// records the routing of every token run (the prompt, then each new token but the last) as a
// routing trace for moe_cache_sim.
// --kv-cache: how the KV cache holds keys and values (fp32 default; bf16 halves its bytes,
// moe::KvFormat). The timings go to stderr.
// --no-cache recomputes the whole sequence at every step (same ids; logits equal within 1e-4 of
// their scale, docs/decoding.md). --logits writes "logits" [N, vocab] F32, one row per
// generated token (the distribution it was drawn from, before temperature); it may not be a file
// the model reads (config.json, weights, shards; by device and inode), an existing directory or
// other non-regular file, or in a missing directory (refused before the model is loaded).
// Greedy by default (temperature 0). Integer options are read as typed and range-checked
// (--max-new-tokens at most 2^20 = 1048576, --threads 1 to 1024, --seed 0 to 2^64 - 1): a value
// out of range is an error naming the option, the value and the range. --help / -h lists the
// options, one line each, on stdout. Exit status 0 on success (and for --help), 2 on an unknown
// argument (one line on stderr pointing at --help), 1 with one line on stderr otherwise (bad or
// conflicting options, a missing tokenizer.json, ...).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "../common/cli.hpp"
#include "../common/output_check.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/io/safetensors.hpp"
#include "moe/models/decoder.hpp"
#include "moe/models/generate.hpp"
#include "moe/models/gguf_decoder.hpp"
#if MOE_GENERATE_WITH_TEXT
#include "moe/text/model_tokenizer.hpp"
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string model, logits_out;
  std::vector<std::int64_t> prompt;
  std::string text;  // --prompt or the contents of --prompt-file
  bool text_mode = false, chat = false, ignore_eos = false, print_ids = false,
       print_prompt_ids = false;
  long max_new = 16;
  int threads = 1;
  bool cache = true;
  double temperature = 0.0, top_p = 1.0;
  std::uint64_t seed = 0;
  std::string write_store;  // --write-expert-store
  std::string predictor;    // --predictor
  std::string trace_out;    // --trace-out
  std::string prompt_file;  // --prompt-file
  moe::models::DecoderOptions weights;
  moe::KvFormat kv = moe::KvFormat::kF32;
};

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR|FILE.gguf",
     "checkpoint: config.json + model.safetensors (or the index and its shards), or a GGUF "
     "file (any shard of a split one; qwen3moe, qwen2moe, olmoe, glm4moe, minimax-m2, "
     "ernie4_5-moe, gpt-oss, llama/Mixtral)"},
    {"--prompt-ids I,J,...",
     "the prompt's token ids, comma-separated, each in [0, vocab); prints the new ids"},
    {"--prompt TEXT",
     "the prompt as text, tokenized with the model's tokenizer (BOS as the model says); prints "
     "the new text as it is produced, stopping at the model's end tokens"},
    {"--prompt-file F", "the same, the text read from file F (UTF-8)"},
    {"--chat",
     "wrap the text prompt as one user turn in the model's chat format (ChatML, DeepSeek-V3, "
     "gpt-oss harmony) with the assistant's generation prompt"},
    {"--ignore-eos", "with a text prompt: go on past the end tokens, to --max-new-tokens"},
    {"--print-ids", "with a text prompt: also print the new ids' line, as --prompt-ids does"},
    {"--print-prompt-ids", "print the prompt's ids (after tokenizing and --chat) on stderr"},
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
     "MoE experts; FORMAT: fp32, bf16, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, iq4_xs, q4_1, iq4_nl, "
     "q4_0, mxfp4, q3_k, q2_k "
     "(default: as stored: a GGUF file's blocks as they are, else fp32)"},
    {"--mix q4_k_m", "llama.cpp's Q4_K_M choice per matrix (overrides --dense and --experts)"},
    {"--kv-cache FORMAT", "how the KV cache holds keys and values: fp32 (default) or bf16"},
    {"--write-expert-store FILE",
     "write the routed experts (in their --experts formats) as an expert store, one layer at a "
     "time (the model is never loaded whole), and exit (no prompt needed)"},
    {"--expert-store FILE",
     "stream the routed experts from this expert store through a bounded cache (the model's "
     "own expert weights are not read)"},
    {"--stream-experts",
     "stream the routed experts straight from the model's file through the bounded cache, no "
     "expert store (quantized formats as stored)"},
    {"--expert-cache SIZE",
     "with --expert-store or --stream-experts: the cache's budget, e.g. 8GiB (default 2GiB)"},
    {"--cache-policy NAME",
     "with a cache: lru (default), lfu, layer-lru or learned (needs --predictor)"},
    {"--predictor FILE", "the learned policy's reuse-distance model (moe_cache_sim writes one)"},
    {"--reader-threads N", "with a cache: threads reading experts, 0 to 256 (default 4)"},
    {"--prefetch MODE",
     "with a cache: read ahead for the next MoE layer: router (default: its router on the "
     "current hidden state), previous (the previous token's experts), both, none"},
    {"--direct-io", "with --expert-store: read with O_DIRECT (past the page cache) where allowed"},
    {"--cache-routing SPEC",
     "with a cache: swap a token's low-ranked uncached experts for cached ones the router "
     "scored almost as high, e.g. tau=0.05,keep=1,candidates=16,swaps=1 (default off: exact)"},
    {"--read-bandwidth SIZE",
     "with --expert-store: emulate a drive of SIZE per second, e.g. 3GB (default: as fast as "
     "the file reads)"},
    {"--read-latency SECONDS", "with --read-bandwidth: per read, in [0, 10] (default 0.0001)"},
    {"--trace-out FILE",
     "write the routing of every token run (prompt and new) as a routing trace (moe_cache_sim "
     "--trace FILE replays it), with the router's top 32 candidates a step"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_generate",
    "--model DIR|FILE.gguf (--prompt-ids I,J,... | --prompt TEXT | --prompt-file F) "
    "--max-new-tokens N [options]",
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
    // Decimal only: std::stod also reads hexadecimal ("0x10" = 16), "inf" and "nan".
    if (s.find_first_of("xXnN") != std::string::npos) throw std::invalid_argument(s);
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
  a.weights.streaming.budget_bytes = std::uint64_t{2} << 30;
  bool have_model = false, have_n = false, latency_given = false, cache_routing_given = false;
  int prompts = 0;           // --prompt-ids, --prompt and --prompt-file given
  std::string cache_option;  // the last expert-cache option given
  for (int i = 1; i < argc; ++i) {
    std::string const f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(f + " needs a value");
      return argv[++i];
    };
    auto file_value = [&]() -> std::string {  // a file name: not empty
      std::string v = value();
      if (v.empty()) usage_error(f + " needs a file name, not an empty string");
      return v;
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
      ++prompts;
    } else if (f == "--prompt") {
      a.text = value();
      a.text_mode = true;
      ++prompts;
    } else if (f == "--prompt-file") {
      std::string const path = value();
      std::error_code ec;
      if (std::filesystem::is_directory(path, ec)) {
        usage_error("--prompt-file: '" + path + "' is a directory; pass a text file");
      }
      std::ifstream in(path, std::ios::binary);
      if (!in) usage_error("--prompt-file: cannot open '" + path + "'");
      a.prompt_file = path;
      std::ostringstream text;
      text << in.rdbuf();
      a.text = text.str();
      a.text_mode = true;
      ++prompts;
    } else if (f == "--chat") {
      a.chat = true;
    } else if (f == "--ignore-eos") {
      a.ignore_eos = true;
    } else if (f == "--print-ids") {
      a.print_ids = true;
    } else if (f == "--print-prompt-ids") {
      a.print_prompt_ids = true;
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
      a.logits_out = file_value();
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
    } else if (f == "--write-expert-store") {
      a.write_store = file_value();
    } else if (f == "--expert-store") {
      a.weights.expert_store = file_value();
    } else if (f == "--stream-experts") {
      a.weights.stream_experts = true;
    } else if (f == "--expert-cache") {
      cache_option = f;
      a.weights.streaming.budget_bytes = moe_cli::parse_bytes(f, value());
    } else if (f == "--cache-policy") {
      cache_option = f;
      a.weights.streaming.policy = value();
    } else if (f == "--predictor") {
      a.predictor = file_value();
    } else if (f == "--reader-threads") {
      cache_option = f;
      a.weights.streaming.reader_threads = moe_cli::parse_integer<int>(f, value(), 0, 256);
    } else if (f == "--trace-out") {
      a.trace_out = file_value();
    } else if (f == "--cache-routing") {
      a.weights.streaming.cache_routing = moe::offload::parse_cache_routing(value());
      cache_routing_given = true;
    } else if (f == "--prefetch") {
      cache_option = f;
      a.weights.streaming.prefetch = value();
    } else if (f == "--direct-io") {
      a.weights.store_read.direct = true;
    } else if (f == "--read-bandwidth") {
      a.weights.store_read.bandwidth_bytes_per_s =
          static_cast<double>(moe_cli::parse_bytes(f, value()));
    } else if (f == "--read-latency") {
      a.weights.store_read.latency_seconds = parse_double(f, value(), 0.0, 10.0);
      latency_given = true;
    } else if (f == "--kv-cache") {
      std::string const v = value();
      if (v != "fp32" && v != "bf16") usage_error("--kv-cache '" + v + "': use fp32 or bf16");
      a.kv = v == "bf16" ? moe::KvFormat::kBf16 : moe::KvFormat::kF32;
    } else {
      moe_cli::exit_unknown_argument(kUsage, f);
    }
  }
  if (!a.write_store.empty()) {
    if (!have_model || prompts > 0 || have_n || !a.weights.expert_store.empty() ||
        a.weights.stream_experts) {
      usage_error(
          "--write-expert-store takes --model (and the weight options) only: it writes the "
          "store and exits");
    }
    return a;
  }
  if (a.weights.stream_experts && !a.weights.expert_store.empty()) {
    usage_error("--stream-experts and --expert-store: give one (where the experts are read from)");
  }
  if (a.weights.expert_store.empty() &&
      (a.weights.store_read.direct || a.weights.store_read.bandwidth_bytes_per_s > 0.0 ||
       latency_given)) {
    usage_error("--direct-io, --read-bandwidth and --read-latency go with --expert-store");
  }
  if (a.weights.expert_store.empty() && !a.weights.stream_experts && !cache_option.empty()) {
    usage_error(cache_option +
                " sizes or drives the expert cache: it goes with --expert-store or "
                "--stream-experts");
  }
  if (a.top_p != 1.0 && a.temperature == 0.0) {
    usage_error(
        "--top-p restricts sampling: give --temperature above 0 with it (at 0, the "
        "default, decoding is greedy)");
  }
  if (a.weights.expert_store.empty() && !a.weights.stream_experts &&
      (!a.predictor.empty() || cache_routing_given)) {
    usage_error("--predictor and --cache-routing go with --expert-store or --stream-experts");
  }
  if (latency_given && a.weights.store_read.bandwidth_bytes_per_s == 0.0) {
    usage_error("--read-latency goes with --read-bandwidth (an emulated drive)");
  }
  if (a.weights.store_read.bandwidth_bytes_per_s > 0.0 && !latency_given) {
    a.weights.store_read.latency_seconds = 1e-4;  // an NVMe drive's ~100 us
  }
  if (!a.predictor.empty()) {
    a.weights.streaming.predictor = moe::offload::ReusePredictor::load(a.predictor);
  }
  if (!a.trace_out.empty() && !a.cache) {
    usage_error(
        "--trace-out needs the KV cache (--no-cache recomputes the whole sequence each "
        "step)");
  }
  if (prompts > 1) {
    usage_error("--prompt-ids, --prompt and --prompt-file are mutually exclusive; give one");
  }
  if (!have_model || prompts == 0 || !have_n) {
    usage_error(
        "--model, a prompt (--prompt-ids, --prompt or --prompt-file) and --max-new-tokens are "
        "required");
  }
  if (a.chat && !a.text_mode) {
    usage_error("--chat wraps a text prompt: use it with --prompt or --prompt-file");
  }
#if !MOE_GENERATE_WITH_TEXT
  if (a.text_mode || a.chat) {
    usage_error(std::string(a.chat ? "--chat" : "a text prompt") +
                " needs the tokenizer, which this build lacks (moe::text needs PCRE2 and ICU: "
                "apt-get install libpcre2-dev libicu-dev, then reconfigure and rebuild); "
                "--prompt-ids works without it");
  }
#endif
  return a;
}

/// With --expert-store: what the expert cache did.
template <class Dec>
void print_stream_stats(Dec const& d, Args const& a) {
  if (!d.streamer) return;
  moe::offload::StreamStats const& s = d.streamer->stats();
  moe::offload::StoreReadOptions const& r = a.weights.store_read;
  auto const* file = dynamic_cast<moe::offload::ExpertStore const*>(&d.streamer->store());
  std::string how = file == nullptr  ? "re-packed from the model's file on each miss"
                    : file->direct() ? "O_DIRECT reads"
                                     : "buffered reads";
  if (r.bandwidth_bytes_per_s > 0.0) {
    char buf[96];
    std::snprintf(buf, sizeof buf, ", a drive emulated at %.2f GB/s and %.0f us",
                  r.bandwidth_bytes_per_s / 1e9, r.latency_seconds * 1e6);
    how += buf;
  }
  std::fprintf(stderr,
               "moe_generate: experts streamed from %s (%s policy, %.2f GiB cache, %s): hit rate "
               "%.3f of %llu accesses (%llu misses, %llu bypasses); %.1f MiB read per token, "
               "%.3f s waiting for reads; prefetch %s: %llu experts, precision %.3f, recall "
               "%.3f; cache-aware routing %s (%llu swaps)\n",
               d.streamer->store().path().c_str(), a.weights.streaming.policy.c_str(),
               static_cast<double>(a.weights.streaming.budget_bytes) / 1073741824.0, how.c_str(),
               s.hit_rate(), static_cast<unsigned long long>(s.accesses),
               static_cast<unsigned long long>(s.misses),
               static_cast<unsigned long long>(s.bypasses), s.bytes_per_token() / 1048576.0,
               s.wait_seconds, a.weights.streaming.prefetch.c_str(),
               static_cast<unsigned long long>(s.prefetches), s.prefetch_precision(),
               s.prefetch_recall(), a.weights.streaming.cache_routing.enabled ? "on" : "off",
               static_cast<unsigned long long>(s.swaps));
}

/// Called with each new id; returns true to stop generating after it.
using TokenSink = std::function<bool(std::int64_t)>;

/// Generates with moe::models::generate (the library's loop), collecting the logits for
/// --logits, printing the ids (id mode) and the timings.
int generate(moe::models::AnyDecoder const& dec, Args const& a, moe::ThreadPool* pool,
             TokenSink const& sink) {
  moe::Index const V = std::visit([](auto const& d) { return d.vocab(); }, dec);
  moe::models::GenerateOptions o;
  o.max_new_tokens = a.max_new;
  o.sampling = {a.temperature, a.top_p, a.seed};
  o.cache = a.cache;
  o.kv = a.kv;
  o.pool = pool;
  std::vector<float> all_logits;
  std::optional<moe::offload::Trace> trace;
  if (!a.trace_out.empty()) {
    trace.emplace(std::visit([](auto const& d) { return d.trace_shape(32); }, dec));
    o.trace = &*trace;
  }
  auto last_note = Clock::now();
  long done = 0;
  o.on_token = [&](std::int64_t id, std::span<float const> logits) {
    if (!a.logits_out.empty()) all_logits.insert(all_logits.end(), logits.begin(), logits.end());
    bool const stop = sink && sink(id);
    if (++done < a.max_new && Clock::now() - last_note > std::chrono::seconds(1)) {
      last_note = Clock::now();
      std::fprintf(stderr, "moe_generate: %ld of %ld tokens\n", done, a.max_new);
    }
    return stop;
  };
  moe::models::GenerateResult const r = moe::models::generate(dec, a.prompt, o);
  if (!a.text_mode) {  // a text prompt's printer printed the text (and --print-ids the ids)
    for (std::size_t i = 0; i < r.ids.size(); ++i) {
      std::printf("%s%lld", i == 0 ? "" : ",", static_cast<long long>(r.ids[i]));
    }
    std::printf("\n");
  }
  std::fprintf(stderr,
               "moe_generate: prefill %zu tokens in %.3f s (%.1f tokens/s); decode %lld steps in "
               "%.3f s (%.1f tokens/s%s); KV cache %zu bytes per token%s (%d layers)\n",
               a.prompt.size(), r.prefill_seconds,
               static_cast<double>(a.prompt.size()) / r.prefill_seconds,
               static_cast<long long>(r.steps), r.decode_seconds,
               r.steps > 0 ? static_cast<double>(r.steps) / r.decode_seconds : 0.0,
               a.cache ? "" : ", no cache: each step recomputes the prefix", r.kv_bytes_per_token,
               r.recurrent_bytes == 0
                   ? ""
                   : (", recurrent state " + std::to_string(r.recurrent_bytes) + " bytes").c_str(),
               static_cast<int>(std::visit([](auto const& d) { return d.blocks.size(); }, dec)));
  std::visit([&](auto const& d) { print_stream_stats(d, a); }, dec);
  if (trace) {
    moe::offload::write_trace(a.trace_out, *trace);
    std::fprintf(
        stderr,
        "moe_generate: wrote the routing trace %s: %lld tokens x %lld MoE layers, top-%lld "
        "of %lld experts, %lld candidates a step\n",
        a.trace_out.c_str(), static_cast<long long>(trace->num_tokens()),
        static_cast<long long>(trace->shape().num_layers),
        static_cast<long long>(trace->shape().top_k),
        static_cast<long long>(trace->shape().num_experts),
        static_cast<long long>(trace->shape().num_candidates));
  }
  if (!a.logits_out.empty()) {
    moe::io::SafetensorsWriter()
        .add_f32("logits", {static_cast<std::int64_t>(r.ids.size()), V}, all_logits)
        .save(a.logits_out);
  }
  return 0;
}

#if MOE_GENERATE_WITH_TEXT
/// The text prompt's ids (wrapped in the chat format with --chat), into a.prompt.
void tokenize_prompt(moe::text::ModelTokenizer const& tok, Args& a) {
  if (a.chat && tok.chat == moe::text::ChatFormat::kUnknown) {
    throw std::runtime_error(
        "--chat: " + tok.source +
        (tok.chat_template.empty() ? std::string(" comes with no chat template")
                                   : std::string("'s chat template is not one moe recognises")) +
        " (moe knows ChatML, DeepSeek-V3 and gpt-oss harmony); wrap the prompt yourself and pass "
        "it with --prompt");
  }
  std::vector<std::int32_t> const ids =
      a.chat ? tok.encode_chat(a.text) : tok.encode_prompt(a.text);
  if (ids.empty()) throw std::runtime_error("the prompt is empty; give some text");
  a.prompt.assign(ids.begin(), ids.end());
}

/// Prints each new token's text as it comes (whole UTF-8 characters, flushed) and stops at the
/// model's end tokens unless --ignore-eos; ids the tokenizer does not have (an embedding padded
/// past the vocabulary) print nothing.
struct TextPrinter {
  moe::text::ModelTokenizer const* tok;
  moe::text::StreamDecoder stream;
  bool ignore_eos;
  std::vector<std::int64_t> ids;  // every new id, the end token included

  bool operator()(std::int64_t id) {
    ids.push_back(id);
    auto const id32 = static_cast<std::int32_t>(id);
    if (!ignore_eos && tok->is_end(id32)) return true;
    if (tok->tokenizer.contains(id32)) {
      std::string const text = stream.push(id32);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    }
    return false;
  }
  /// The held-back bytes and the newline; then, with --print-ids, the ids line.
  void finish(bool print_ids) {
    std::string text = stream.finish() + "\n";
    if (print_ids) {
      for (std::size_t i = 0; i < ids.size(); ++i) {
        text += (i == 0 ? "" : ",") + std::to_string(ids[i]);
      }
      text += "\n";
    }
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  }
};
#endif

}  // namespace

/// Every file this run reads: the model's (model_inputs), its tokenizer files, the prompt file,
/// the expert store and the predictor. No output may be one of them.
std::vector<std::filesystem::path> run_inputs(Args const& a) {
  std::vector<std::filesystem::path> in = moe_cli::model_inputs(a.model);
  std::error_code ec;
  if (std::filesystem::is_directory(a.model, ec)) {
    for (char const* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                          "chat_template.jinja"}) {
      in.push_back(std::filesystem::path(a.model) / f);
    }
  }
  for (std::string const* f : {&a.prompt_file, &a.weights.expert_store, &a.predictor}) {
    if (!f->empty()) in.emplace_back(*f);
  }
  return in;
}

/// The outputs given (--logits, --trace-out, --write-expert-store) are checked before anything
/// is read or written: none may be a file the run reads (by device and inode), another output,
/// a directory or other non-regular file, or in a missing directory.
void check_outputs(Args const& a) {
  std::vector<std::filesystem::path> inputs = run_inputs(a);
  std::pair<std::string const*, char const*> const outputs[] = {
      {&a.logits_out, "--logits"},
      {&a.trace_out, "--trace-out"},
      {&a.write_store, "--write-expert-store"}};
  std::vector<std::filesystem::path> seen;
  for (auto const& [path, option] : outputs) {
    if (path->empty()) continue;
    for (std::filesystem::path const& other : seen) {
      if (moe::io::same_file(*path, other)) {
        moe::detail::fail(option, " '", *path,
                          "' is also another output of this run; give each "
                          "output its own file");
      }
    }
    moe_cli::check_output(*path, inputs, option);
    seen.emplace_back(*path);
  }
}

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    check_outputs(a);  // before anything is read: a refused run reads and writes nothing
#if MOE_GENERATE_WITH_TEXT
    // The tokenizer first: a missing tokenizer.json fails before the model is loaded.
    std::optional<moe::text::ModelTokenizer> tok;
    if (a.text_mode) {
      tok = moe::text::load_model_tokenizer(a.model);
      tokenize_prompt(*tok, a);
    }
#endif
    if (!a.write_store.empty()) {
      std::unique_ptr<moe::ThreadPool> pool;
      if (a.threads > 1) pool = std::make_unique<moe::ThreadPool>(a.threads);
      auto const t0 = Clock::now();
      // One MoE layer at a time: the model is never loaded whole.
      std::vector<moe::models::Fallback> const fell =
          moe::io::is_gguf_file(a.model)
              ? moe::models::write_gguf_expert_store(a.model, a.write_store, pool.get(), a.weights)
              : moe::models::write_hf_expert_store(a.model, a.write_store, pool.get(), a.weights);
      if (!fell.empty()) {
        std::fprintf(stderr,
                     "moe_generate: warning: %zu expert matrices have depths their format's "
                     "blocks do not divide and fell back (first: %s %s -> %s)\n",
                     fell.size(), fell.front().matrix.c_str(),
                     moe::experts::name(fell.front().asked),
                     moe::experts::name(fell.front().chosen));
      }
      moe::offload::ExpertStore const store(a.write_store);
      std::uint64_t bytes = 0;
      for (moe::Index l = 0; l < store.shape().num_layers; ++l) {
        for (auto const& r : store.layer_records(l)) bytes += r.read_bytes();
      }
      std::fprintf(stderr,
                   "moe_generate: wrote %s in %.2f s: %lld MoE layers x %lld experts, %.3f GiB "
                   "of records (experts %s)\n",
                   a.write_store.c_str(), std::chrono::duration<double>(Clock::now() - t0).count(),
                   static_cast<long long>(store.shape().num_layers),
                   static_cast<long long>(store.shape().num_experts),
                   static_cast<double>(bytes) / 1073741824.0,
                   moe::experts::name(store.record(0, 0).format.in));
      return 0;
    }
    if (a.prompt.empty()) usage_error("--prompt-ids needs at least one id");
    if (a.print_prompt_ids) {
      std::string line;
      for (std::int64_t const id : a.prompt) line += (line.empty() ? "" : ",") + std::to_string(id);
      std::fprintf(stderr, "moe_generate: prompt ids (%zu): %s\n", a.prompt.size(), line.c_str());
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
        usage_error(std::string(a.text_mode ? "the tokenized prompt" : "--prompt-ids") + " holds " +
                    std::to_string(id) + ", outside the model's vocabulary [0, " +
                    std::to_string(vocab) + ")" +
                    (a.text_mode ? "; the tokenizer does not belong to this model" : ""));
      }
    }
    std::string const formats = std::visit(
        [&](auto const& d) {
          // The formats of the first layer (a mix varies them per layer).
          std::string attn = "-", experts = "-";
          if (!d.blocks.empty()) {
            attn = std::visit(
                [](auto const& m) -> std::string {
                  if constexpr (requires { m.formats(); }) {  // GQA: q/k/v/o may differ
                    moe::AttentionFormats const f = m.formats();
                    std::string out = moe::experts::name(f.q);
                    if (!(f == moe::AttentionFormats(f.q))) {
                      out = out + "/" + moe::experts::name(f.k) + "/" + moe::experts::name(f.v) +
                            "/" + moe::experts::name(f.o);
                    }
                    return out;
                  } else {
                    return moe::experts::name(m.weight_format());
                  }
                },
                d.blocks.front().mixer);
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
#if MOE_GENERATE_WITH_TEXT
    if (tok) {
      TextPrinter printer{&*tok, moe::text::StreamDecoder(tok->tokenizer), a.ignore_eos, {}};
      TokenSink const sink = [&](std::int64_t id) { return printer(id); };
      int const rc = generate(dec, a, pool.get(), sink);
      printer.finish(a.print_ids);
      return rc;
    }
#endif
    return generate(dec, a, pool.get(), TokenSink());
  } catch (std::exception const& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "moe_generate: %s\n", msg.c_str());
    return 1;
  }
}
