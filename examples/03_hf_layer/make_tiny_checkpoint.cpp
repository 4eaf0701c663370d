// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// make_tiny_checkpoint: write a tiny Hugging Face checkpoint to try the tools on: one MoE layer
// for moe_run_hf_layer, or a whole model (--whole-model) for moe_generate, moe_quantize,
// moe_tokenize and moe_run_hf_attention.
//
// What it shows: moe::io::save_hf_layer() writing config.json + model.safetensors (or shards and
// model.safetensors.index.json) for one MoE layer with random weights, in the checkpoint's own
// tensor names. Layer 1 of a 2-layer model is the MoE layer (layer 0 is dense for every family
// with dense layers: qwen2_moe, qwen3_moe, qwen3_next, deepseek_v3, glm4_moe, deepseek_v2 and
// ernie4_5_moe). With --whole-model, every tensor of the family's model (../common/tiny_model.hpp,
// the same models the decoder tests check against their references): embeddings, each layer's
// attention (MLA for deepseek_v3/v2, Gated DeltaNet and gated full attention for qwen3_next and
// qwen3_5_moe_text), dense MLP or MoE, norms and LM head, the family's config.json, and a
// byte-level BPE tokenizer (tokenizer.json over the 256 bytes, ChatML special tokens and chat
// template in tokenizer_config.json), so that moe_generate --prompt "..." --chat runs on it.
// Either way it also writes x.safetensors ("x" [5, H] F32) and dy.safetensors ("dy" [5, H] F32).
// Why: the ctests run the tools end to end on these files, and so can you; no real model is needed.
//
// Command line:
//   moe_hf_make_tiny_checkpoint DIR MODEL_TYPE [--whole-model] [--hidden H] [--experts E]
//       [--top-k K] [--expert-ffn F] [--bf16]
//       layer:       [--shards N] [--fused] [--use-bias] [--mxfp4]
//       whole model: [--layers L] [--vocab V] [--dense-ffn F] [--heads N] [--kv-heads N]
//                    [--head-dim D]
// MODEL_TYPE: mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe, qwen3_next, glm4_moe,
// deepseek_v2 (group_limited_greedy), minimax_m2, ernie4_5_moe, llama4_text (layer 1 of
// interleave_moe_layer_step 2), gpt_oss (H 32, swiglu_limit 0.4 so the clamps bite) or
// qwen3_5_moe_text. DIR must be new or empty. Sizes: a layer is H 16 (gpt_oss 32), 8 experts of
// width 8 (gpt_oss 32), top-2; a whole model H 16, vocabulary 320, 3 layers (4 for llama4_text,
// qwen3_next, qwen3_5_moe_text), 4 heads and 2 KV heads of 8, dense width 20, 4 experts of width
// 32, top-2 (the group-routed families' groups follow E and K); each size option overrides one
// (e.g. --hidden 256 --expert-ffn 256 for 256-wide quantization blocks). Sizes are range-checked,
// and more than 4 GiB of weights is refused.
// --use-bias: ERNIE 4.5 with use_bias (biased experts and shared expert). --mxfp4: gpt-oss with
// its experts in MXFP4 blocks (the weights rounded to MXFP4 first; quantization_config in
// config.json), as the published gpt-oss checkpoints store them. --shards N: 1 to 1024 (and at
// most the layer's tensor count), read with moe_cli::parse_integer. --help / -h lists the
// options, one line each, on stdout.
// A successful run prints one line on stderr: the directory, the family, the sizes and what it
// wrote.
// Exit status: 0 on success (and for --help), 2 on an unknown argument (one line on stderr
// pointing at --help), 1 with a message on stderr otherwise.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "../common/cli.hpp"
#include "../common/tiny_model.hpp"
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
  moe::fill_uniform(layer.router_bias(), -0.5f, 0.5f, seed + 5);  // empty unless gpt-oss
}

/// MXFP4 of one 32-block: scale 2^(e - 127) with the smallest e whose 6 * 2^(e - 127) covers
/// max |w|, each weight rounded to the nearest FP4 E2M1 value (ties to the lower magnitude).
void mxfp4_block(float const* w, std::uint8_t* bytes, std::uint8_t& scale) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(w[i]));
  int e = 127 - 20;
  while (e < 254 && 6.0f * std::ldexp(1.0f, e - 127) < amax) ++e;
  scale = static_cast<std::uint8_t>(e);
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  auto code = [&](float v) {
    float const a = std::fabs(v) / std::ldexp(1.0f, e - 127);
    int best = 0;
    for (int k = 1; k < 8; ++k) {
      if (std::fabs(kMag[k] - a) < std::fabs(kMag[best] - a)) best = k;
    }
    return static_cast<std::uint8_t>(best | (v < 0.0f && best > 0 ? 8 : 0));
  };
  for (int i = 0; i < 16; ++i) {
    bytes[i] = static_cast<std::uint8_t>(code(w[2 * i]) | (code(w[2 * i + 1]) << 4));
  }
}

/// Writes a gpt-oss layer with MXFP4 experts: the weights are rounded to MXFP4 in place (so the
/// layer is what the checkpoint holds), then every tensor of hf_layer_tensors() is written, the
/// blocks and scales as U8.
void write_gpt_oss_mxfp4(std::string const& dir, moe::io::HfMoeConfig c) {
  using moe::Index;
  using moe::io::HfPart;
  c.mxfp4 = true;
  moe::presets::GptOssMoe layer = moe::io::make_hf_layer<moe::presets::GptOssMoe>(c);
  randomize(layer, 11);
  Index const E = c.num_experts, H = c.hidden_size, I = c.expert_intermediate_size;
  // [E, out, in] rows as the blocks store them: gate_up rows interleaved (2j gate, 2j + 1 up).
  std::vector<std::uint8_t> gu_blocks, gu_scales, d_blocks, d_scales;
  {
    auto edit = layer.experts().edit();
    auto encode = [](float* row, Index n, std::vector<std::uint8_t>& blocks,
                     std::vector<std::uint8_t>& scales) {
      for (Index g = 0; g < n / 32; ++g) {
        std::uint8_t b[16], s = 0;
        mxfp4_block(row + g * 32, b, s);
        blocks.insert(blocks.end(), b, b + 16);
        scales.push_back(s);
        for (int i = 0; i < 16; ++i) {  // the block's values, as a loader decodes them
          row[g * 32 + 2 * i] = moe::io::hf_mxfp4_value(b[i] & 0x0Fu, s);
          row[g * 32 + 2 * i + 1] =
              moe::io::hf_mxfp4_value(static_cast<std::uint8_t>(b[i] >> 4), s);
        }
      }
    };
    for (Index e = 0; e < E; ++e) {
      auto const in = edit.in_proj(e);
      for (Index r = 0; r < 2 * I; ++r) {
        encode(in.row(r % 2 == 0 ? r / 2 : I + r / 2), H, gu_blocks, gu_scales);
      }
    }
    for (Index e = 0; e < E; ++e) {
      auto const down = edit.down_proj(e);
      for (Index r = 0; r < H; ++r) encode(down.row(r), I, d_blocks, d_scales);
    }
  }
  std::filesystem::create_directories(dir);
  moe::io::SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  auto const layout = moe::io::hf_default_layout(c.family, 1);
  for (moe::io::HfTensor const& t : moe::io::hf_layer_tensors(c, layout)) {
    std::vector<std::uint8_t> const* u8 = t.part == HfPart::kExpertsGateUpBlocks   ? &gu_blocks
                                          : t.part == HfPart::kExpertsGateUpScales ? &gu_scales
                                          : t.part == HfPart::kExpertsDownBlocks   ? &d_blocks
                                          : t.part == HfPart::kExpertsDownScales   ? &d_scales
                                                                                   : nullptr;
    if (u8) {
      auto const* p = reinterpret_cast<std::byte const*>(u8->data());
      writer.add(t.name, moe::io::Dtype::kU8, t.shape, std::vector<std::byte>(p, p + u8->size()));
    } else {
      writer.add_f32(t.name, t.shape, moe::io::hf_tensor_values(layer, t));
    }
  }
  writer.save(std::filesystem::path(dir) / "model.safetensors");
  moe::io::detail::write_text_file(std::filesystem::path(dir) / "config.json",
                                   moe::io::hf_config_json(c, "bfloat16"));
}

template <class Layer>
void write(std::string const& dir, moe::io::HfMoeConfig const& config,
           moe::io::HfSaveOptions const& options) {
  Layer layer = moe::io::make_hf_layer<Layer>(config);
  randomize(layer, 11);
  moe::io::save_hf_layer(dir, config, 1, layer, options);
}

constexpr moe_cli::Option kOptions[] = {
    {"DIR", "the directory to write (created if missing)"},
    {"MODEL_TYPE",
     "one of: mixtral qwen2_moe qwen3_moe deepseek_v3 olmoe qwen3_next glm4_moe "
     "deepseek_v2 minimax_m2 ernie4_5_moe llama4_text gpt_oss (--whole-model also "
     "qwen3_5_moe_text)"},
    {"--whole-model",
     "a whole model (embeddings, every layer's attention and MLP or MoE, norms, LM head), with a "
     "byte-level BPE tokenizer and ChatML chat template: moe_generate runs it; default: one MoE "
     "layer (layer 1 of 2)"},
    {"--hidden H", "hidden size (layer: 16, gpt_oss 32; whole model: 16)"},
    {"--experts E", "routed experts (layer: 8; whole model: 4)"},
    {"--top-k K", "experts per token, at most E (default 2)"},
    {"--expert-ffn F", "each expert's width (layer: 8, gpt_oss 32; whole model: 32)"},
    {"--layers L",
     "whole model: layers, 2 to 64 (default 3; llama4_text, qwen3_next, qwen3_5_moe_text 4)"},
    {"--vocab V", "whole model: vocabulary, at least the tokenizer's 259 (default 320)"},
    {"--dense-ffn F", "whole model: the dense MLPs' width (default 20)"},
    {"--heads N", "whole model: attention heads (default 4)"},
    {"--kv-heads N", "whole model: key/value heads, dividing --heads (default 2; not for MLA)"},
    {"--head-dim D", "whole model: per-head size, a multiple of 4 (default 8; not for MLA)"},
    {"--shards N", "layer: write N shards and model.safetensors.index.json, 1 to 1024 (default 1)"},
    {"--bf16", "store the weights in BF16 (default F32)"},
    {"--fused", "layer: fused experts.gate_up_proj and experts.down_proj, not a tensor per expert"},
    {"--use-bias", "layer: ernie4_5_moe with use_bias: biased experts and shared expert"},
    {"--mxfp4", "layer: gpt_oss with its experts in MXFP4 blocks, as released"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {"moe_hf_make_tiny_checkpoint", "DIR MODEL_TYPE [options]",
                                   kOptions};

/// The command line: the sizes given (0: the mode's default) and the switches.
struct Args {
  std::vector<std::string> positional;  // DIR, MODEL_TYPE
  moe::io::HfSaveOptions options;
  bool use_bias = false, mxfp4 = false, whole = false;
  moe::Index hidden = 0, experts = 0, top_k = 0, expert_ffn = 0;               // both modes
  moe::Index layers = 0, vocab = 0, dense_ffn = 0, heads = 0, kv = 0, dh = 0;  // whole model
};

Args parse(int argc, char** argv) {
  Args a;
  struct Size {
    char const* flag;
    moe::Index Args::*field;
    moe::Index lo, hi;
  };
  static constexpr Size kSizes[] = {
      {"--hidden", &Args::hidden, 1, 16384},       {"--experts", &Args::experts, 1, 1024},
      {"--top-k", &Args::top_k, 1, 1024},          {"--expert-ffn", &Args::expert_ffn, 1, 65536},
      {"--layers", &Args::layers, 2, 64},          {"--vocab", &Args::vocab, 1, 1 << 20},
      {"--dense-ffn", &Args::dense_ffn, 1, 65536}, {"--heads", &Args::heads, 1, 256},
      {"--kv-heads", &Args::kv, 1, 256},           {"--head-dim", &Args::dh, 4, 1024}};
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    if (moe_cli::is_help(arg)) moe_cli::exit_help(kUsage);
    Size const* size = nullptr;
    for (Size const& z : kSizes) size = arg == z.flag ? &z : size;
    if (size) {
      if (i + 1 >= argc) moe::detail::fail(arg, " needs a value");
      a.*(size->field) = moe_cli::parse_integer<moe::Index>(arg, argv[++i], size->lo, size->hi);
    } else if (arg == "--whole-model") {
      a.whole = true;
    } else if (arg == "--use-bias") {
      a.use_bias = true;
    } else if (arg == "--mxfp4") {
      a.mxfp4 = true;
    } else if (arg == "--bf16") {
      a.options.dtype = moe::io::Dtype::kBf16;
    } else if (arg == "--fused") {
      a.options.fused_experts = true;
    } else if (arg == "--shards") {
      if (i + 1 >= argc) moe::detail::fail("--shards needs a value");
      a.options.shards = moe_cli::parse_integer<int>(arg, argv[++i], 1, 1024);
    } else if (arg.starts_with("-") || a.positional.size() == 2) {
      moe_cli::exit_unknown_argument(kUsage, arg);
    } else {
      a.positional.push_back(arg);
    }
  }
  if (a.positional.size() != 2) {
    moe::detail::fail(
        "DIR and MODEL_TYPE are required; moe_hf_make_tiny_checkpoint --help lists "
        "the options");
  }
  return a;
}

/// x.safetensors and dy.safetensors ([5, H] F32) in `dir`, the runners' input and gradient.
void write_inputs(std::filesystem::path const& dir, std::int64_t H) {
  std::vector<float> x(static_cast<std::size_t>(5 * H)), dy(x.size());
  moe::fill_uniform(x, -1.0f, 1.0f, 21);
  moe::fill_uniform(dy, -1.0f, 1.0f, 22);
  moe::io::SafetensorsWriter().add_f32("x", {5, H}, x).save(dir / "x.safetensors");
  moe::io::SafetensorsWriter().add_f32("dy", {5, H}, dy).save(dir / "dy.safetensors");
}

/// --whole-model: every tensor of the family's model (tiny_model.hpp), its tokenizer and inputs.
int write_whole_model(Args const& a) {
  std::filesystem::path const dir = a.positional[0];
  std::string const& type = a.positional[1];
  char const* layer_only = a.options.shards != 1     ? "--shards"
                           : a.options.fused_experts ? "--fused"
                           : a.use_bias              ? "--use-bias"
                           : a.mxfp4                 ? "--mxfp4"
                                                     : nullptr;
  if (layer_only) {
    moe::detail::fail(layer_only, " is for a layer checkpoint, not --whole-model");
  }
  bool known = false;
  for (char const* f : tiny_model::kDecoderFamilies) known = known || type == f;
  if (!known) {
    std::string list;
    for (char const* f : tiny_model::kDecoderFamilies) list.append(" ").append(f);
    moe::detail::fail("--whole-model: MODEL_TYPE '", type, "' is not one of", list);
  }
  if (tiny_model::mla_of(tiny_model::family_tiny(type)) && (a.dh > 0 || a.kv > 0)) {
    moe::detail::fail(type,
                      "'s attention is MLA, whose sizes are fixed here (kv_lora_rank 8, "
                      "nope 4, rope 4, v 6 per head): drop --head-dim and --kv-heads");
  }
  tiny_model::Tiny t = tiny_model::family_tiny(type);
  t.V = 320;
  t.I_moe = 32;  // the tests' 8 is too narrow to stream experts (panels of 32)
  auto set = [](moe::Index& field, moe::Index value) { field = value > 0 ? value : field; };
  set(t.V, a.vocab);
  set(t.H, a.hidden);
  set(t.L, a.layers);
  set(t.E, a.experts);
  set(t.k, a.top_k);
  set(t.I_moe, a.expert_ffn);
  set(t.I_dense, a.dense_ffn);
  set(t.heads, a.heads);
  set(t.kv, a.kv);
  set(t.dh, a.dh);
  if (t.V < tiny_model::kTokenizerVocab) {
    moe::detail::fail("--vocab ", t.V, " is below the tokenizer's ", tiny_model::kTokenizerVocab,
                      " ids; pass at least ", tiny_model::kTokenizerVocab);
  }
  if (t.k > t.E) moe::detail::fail("--top-k ", t.k, " exceeds the ", t.E, " experts");
  if (t.heads % t.kv != 0) {
    moe::detail::fail("--kv-heads ", t.kv, " does not divide the ", t.heads, " heads");
  }
  if (t.dh % 4 != 0) {
    moe::detail::fail("--head-dim ", t.dh,
                      " is not a multiple of 4 (RoPE pairs, and half the head rotated in some "
                      "families)");
  }
  std::uint64_t values = 0;
  std::vector<tiny_model::TensorSpec> const specs = tiny_model::tensor_specs(t);
  for (tiny_model::TensorSpec const& s : specs) {
    std::uint64_t n = 1;
    for (std::int64_t d : s.shape) n *= static_cast<std::uint64_t>(d);
    values += n;
  }
  bool const bf16 = a.options.dtype == moe::io::Dtype::kBf16;
  double const gib = static_cast<double>(values) * (bf16 ? 2.0 : 4.0) / 1073741824.0;
  if (gib > 4.0) {
    moe::detail::fail("these sizes make ", gib, " GiB of weights; a tiny model stays under 4 GiB");
  }
  tiny_model::write_checkpoint(dir, t, tiny_model::make_tensors(t, 11), bf16);
  tiny_model::write_tokenizer(dir);
  write_inputs(dir, t.H);
  moe::io::HfMoeConfig const c = tiny_model::moe_config(t);
  std::string moe_layers, dense_layers;
  for (moe::Index l = 0; l < t.L; ++l) {
    (c.is_moe_layer(l) ? moe_layers : dense_layers) += moe::io::detail::concat(" ", l);
  }
  std::fprintf(stderr,
               "moe_hf_make_tiny_checkpoint: wrote %s: %s, whole model of %lld layers (MoE:%s; "
               "dense:%s), hidden %lld, vocabulary %lld, %lld experts, top-%lld, %zu tensors "
               "(%s, %.1f MiB) in model.safetensors, a byte-level BPE tokenizer (259 ids, ChatML), "
               "x.safetensors and dy.safetensors [5, %lld]\n",
               dir.c_str(), type.c_str(), static_cast<long long>(t.L), moe_layers.c_str(),
               dense_layers.empty() ? " none" : dense_layers.c_str(), static_cast<long long>(t.H),
               static_cast<long long>(t.V), static_cast<long long>(t.E),
               static_cast<long long>(t.k), specs.size(), bf16 ? "BF16" : "F32", gib * 1024.0,
               static_cast<long long>(t.H));
  return 0;
}

/// DIR must be missing or an empty directory: the maker never mixes its files with others, nor
/// replaces a model.
void check_directory(std::filesystem::path const& dir) {
  std::error_code ec;
  auto const st = std::filesystem::symlink_status(dir, ec);
  if (ec || st.type() == std::filesystem::file_type::not_found) return;
  if (st.type() != std::filesystem::file_type::directory) {
    moe::detail::fail("DIR '", dir.string(),
                      "' exists and is not a directory; pass a new or empty directory");
  }
  if (!std::filesystem::is_empty(dir, ec) || ec) {
    moe::detail::fail("DIR '", dir.string(),
                      "' is not empty; pass a new or empty directory (the maker never writes "
                      "over other files)");
  }
}

int run(int argc, char** argv) {
  Args const a = parse(argc, argv);
  check_directory(a.positional[0]);
  if (a.whole) return write_whole_model(a);
  if (a.layers || a.vocab || a.dense_ffn || a.heads || a.kv || a.dh) {
    moe::detail::fail(
        "--layers, --vocab, --dense-ffn, --heads, --kv-heads and --head-dim size a whole model; "
        "add --whole-model");
  }
  moe::io::HfSaveOptions const& options = a.options;
  bool const use_bias = a.use_bias, mxfp4 = a.mxfp4;
  std::string const &dir = a.positional[0], &type = a.positional[1];
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
  c.decoder_sparse_step = 2;    // Qwen: layer 1 is MoE, layer 0 dense
  c.first_k_dense_replace = 1;  // DeepSeek, GLM: layer 0 dense (ERNIE: moe_layer_start_index 1)
  if (c.family == moe::io::HfFamily::kDeepseekV2) c.topk_method = "group_limited_greedy";
  c.interleave_moe_layer_step = 2;  // Llama 4: layer 1 is MoE, layer 0 dense
  if (c.family == moe::io::HfFamily::kGlm4Moe || c.family == moe::io::HfFamily::kDeepseekV2) {
    c.routed_scaling_factor = 1.5f;
  }
  if (c.family == moe::io::HfFamily::kGptOss) {
    c.hidden_size = 32;  // MXFP4 blocks are 32 wide: H and I multiples of 32
    c.expert_intermediate_size = 32;
    c.swiglu_limit = 0.4f;  // small weights: a small limit, so that both clamps take effect
  }
  c.hidden_size = a.hidden > 0 ? a.hidden : c.hidden_size;
  c.num_experts = a.experts > 0 ? a.experts : c.num_experts;
  c.num_experts_per_tok = a.top_k > 0 ? a.top_k : c.num_experts_per_tok;
  c.expert_intermediate_size = a.expert_ffn > 0 ? a.expert_ffn : c.expert_intermediate_size;
  if (c.num_experts_per_tok > c.num_experts) {
    moe::detail::fail("--top-k ", c.num_experts_per_tok, " exceeds the ", c.num_experts,
                      " experts");
  }
  if (c.family == moe::io::HfFamily::kDeepseekV3 || c.family == moe::io::HfFamily::kGlm4Moe ||
      c.family == moe::io::HfFamily::kDeepseekV2) {
    // Group-limited routing: 4 groups, 2 kept, as the defaults (8 experts, top-2) give; fewer
    // groups when 4 do not divide the experts, more kept when top-k needs them.
    c.n_group = tiny_model::group_count(c.num_experts, 4);
    c.topk_group = tiny_model::kept_groups(c.num_experts, c.num_experts_per_tok, c.n_group,
                                           c.n_group == 4 ? 2 : 1);
  }
  if (mxfp4 && (c.hidden_size % 32 != 0 || c.expert_intermediate_size % 32 != 0)) {
    moe::detail::fail("--mxfp4 needs --hidden and --expert-ffn multiples of 32 (MXFP4 blocks)");
  }
  if (static_cast<double>(c.num_experts) * 3.0 * static_cast<double>(c.hidden_size) *
          static_cast<double>(c.expert_intermediate_size) * 4.0 >
      4.0 * 1073741824.0) {
    moe::detail::fail("these sizes make over 4 GiB of expert weights; a tiny layer stays under");
  }
  if (use_bias && c.family != moe::io::HfFamily::kErnie45Moe) {
    moe::detail::fail("--use-bias is for ernie4_5_moe (gpt_oss always has biases)");
  }
  if (use_bias && options.fused_experts) {
    moe::detail::fail(
        "--use-bias with --fused: ERNIE 4.5's fused expert tensors have no biases; drop one");
  }
  if (mxfp4 && c.family != moe::io::HfFamily::kGptOss) moe::detail::fail("--mxfp4 is for gpt_oss");
  c.use_bias = use_bias;
  c.defaulted_keys.clear();
  using namespace moe::presets;
  switch (c.family) {
    case moe::io::HfFamily::kMixtral:
      write<MixtralMoe>(dir, c, options);
      break;
    case moe::io::HfFamily::kQwen2Moe:
    case moe::io::HfFamily::kQwen3Next:
    case moe::io::HfFamily::kQwen35Moe:
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
    case moe::io::HfFamily::kGptOss:
      if (mxfp4) {
        write_gpt_oss_mxfp4(dir, c);
      } else {
        write<GptOssMoe>(dir, c, options);
      }
      break;
  }
  std::int64_t const H = c.hidden_size;
  write_inputs(dir, H);
  // What was written, read back from the checkpoint.
  std::filesystem::path const index = std::filesystem::path(dir) / "model.safetensors.index.json";
  bool const sharded = std::filesystem::exists(index);
  moe::io::ShardedCheckpoint const written =
      sharded ? moe::io::ShardedCheckpoint::open_index(index)
              : moe::io::ShardedCheckpoint::open_single(std::filesystem::path(dir) /
                                                        "model.safetensors");
  std::string const files = sharded
                                ? moe::io::detail::concat(written.num_shards(), " shards + index")
                                : std::string("model.safetensors");
  std::fprintf(stderr,
               "moe_hf_make_tiny_checkpoint: wrote %s: %s, MoE layer 1 of 2 (hidden %lld, %lld "
               "experts, top-%lld), %zu tensors (%s) in %s, x.safetensors and dy.safetensors "
               "[5, %lld]\n",
               dir.c_str(), c.model_type(), static_cast<long long>(H),
               static_cast<long long>(c.num_experts), static_cast<long long>(c.num_experts_per_tok),
               written.names().size(),
               mxfp4                                    ? "MXFP4 experts"
               : options.dtype == moe::io::Dtype::kBf16 ? "BF16"
                                                        : "F32",
               files.c_str(), static_cast<long long>(H));
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
