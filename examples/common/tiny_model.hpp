// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// Tiny whole models of every family the decoder runs (not part of the library's API), shared by
// moe_hf_make_tiny_checkpoint --whole-model and the decoder tests (tests/hf/decoder_tiny.hpp):
// the family's config.json (its MoE keys, attention, RoPE, norms and layer pattern as the
// published configs spell them), every tensor under its Hugging Face name and shape, random
// values, and a byte-level BPE tokenizer of 259 ids (the 256 bytes and ChatML's three special
// tokens) with a ChatML chat template, so that moe_generate --prompt and --chat run on it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/io/hf.hpp"
#include "moe/io/safetensors.hpp"

namespace tiny_model {

using moe::Index;
using moe::io::HfFamily;
using moe::io::detail::concat;
namespace fs = std::filesystem;
using Tensors = std::map<std::string, std::vector<float>>;
using Shape = std::vector<std::int64_t>;

/// The sizes of a tiny model (the tests' defaults; moe_hf_make_tiny_checkpoint sets them from its
/// options): vocabulary V, hidden size H, layers L, attention heads and KV heads of dh, the dense
/// MLPs' width I_dense, the experts' I_moe, E experts of which k are routed per token. The MLA and
/// Gated DeltaNet sub-sizes are fixed (Mla, Gdn).
struct Tiny {
  std::string type = "qwen3_moe";
  Index V = 40, H = 16, L = 3, heads = 4, kv = 2, dh = 8, I_dense = 20, I_moe = 8, E = 4, k = 2;
  double theta = 1000.0, eps = 1e-6;
  Index window = 0;  // Mixtral sliding_window
  bool tie = false;
  Index fp8_block = 0;        // > 0: config.json says FP8 with square blocks of this size
  bool mxfp4 = false;         // gpt-oss: config.json says the experts are MXFP4
  float swiglu_limit = 0.5f;  // gpt-oss: small, so that the clamps take effect
};

/// What the family's attention has (DecoderConfig's table), as the test's config.json sets it.
struct Attention {
  bool qkv_bias = false, o_bias = false, norm = false, norm_all = false, sinks = false;
  Index rd = 0;              // rotated dimensions per head
  bool yarn = false;         // gpt-oss: factor 32, betas 32 / 1, not truncated, L0 = kYarnOriginal
  bool interleaved = false;  // ERNIE 4.5: RoPE on the pairs (2i, 2i + 1)
  // Llama 4: Llama 3 RoPE scaling, NoPE layers (layer 1) with temperature tuning, chunks of
  // kLlama4Chunk on the RoPE layers, an unweighted q/k norm after RoPE on them.
  bool llama4 = false;
  bool gate = false;  // Qwen3-Next: a sigmoid output gate per head, packed in q_proj
};

inline constexpr Index kLlama4Chunk = 4;  // the 11 tokens of check_generation cross two boundaries
inline constexpr Index kLlama4Floor = 2;  // floor_scale: the temperature grows every 2 positions
inline constexpr double kLlama4Temp = 0.5;  // attn_scale
/// DeepSeek's multi-head latent attention in the tiny models: q_lora_rank 12 (V3) or null (V2),
/// kv_lora_rank 8, nope 4, rope 4, v 6 per head; V3 with YaRN (factor 4 over 8 positions,
/// mscale 1 / 1: its softmax correction (0.1 ln 4 + 1)^2).
struct Mla {
  Index ql = 0, R = 8, dn = 4, dr = 4, dv = 6;
  bool v3 = true;
};
inline std::optional<Mla> mla_of(Tiny const& t) {
  if (t.type == "deepseek_v3") return Mla{.ql = 12};
  if (t.type == "deepseek_v2") return Mla{.v3 = false};
  return std::nullopt;
}

/// Qwen3-Next's Gated DeltaNet in the tiny model (full_attention_interval 2: layers 0 and 2
/// linear, 1 and 3 full): 2 key heads of 4, 4 value heads of 6, a convolution of 3 taps.
struct Gdn {
  Index Hk = 2, Hv = 4, dk = 4, dv = 6, kernel = 3;
};
/// Qwen3-Next and Qwen3.5-MoE (whose Gated DeltaNet splits its input projections).
inline bool hybrid(Tiny const& t) { return t.type == "qwen3_next" || t.type == "qwen3_5_moe_text"; }
inline bool split_projections(Tiny const& t) { return t.type == "qwen3_5_moe_text"; }
inline bool linear_layer(Tiny const& t, Index l) { return hybrid(t) && l % 2 == 0; }
/// Qwen3NextRMSNorm's (1 + w) form (every norm but the Gated DeltaNet's own).
inline bool one_plus(Tiny const& t) { return hybrid(t); }

/// Llama 4's tiny model: layer 1 is NoPE (no_rope_layers [1, 0, 1, 1]).
inline bool rope_layer(Tiny const& t, Index l) { return t.type != "llama4_text" || l != 1; }
/// Llama 4's no_rope_layers list: 1 on the RoPE layers ([1, 0, 1, 1] for 4 layers).
inline std::string no_rope_layers(Tiny const& t) {
  std::string s = "[";
  for (Index l = 0; l < t.L; ++l) s += concat(l ? ", " : "", rope_layer(t, l) ? 1 : 0);
  return s + "]";
}

inline constexpr Index kYarnOriginal = 10000;  // the YaRN ramp then blends frequencies 1-3 of 4

/// The window of layer l: Mixtral's on every layer, gpt-oss's on the even (sliding) ones.
inline Index window_of(Tiny const& t, Index l) {
  if (t.type == "gpt_oss") return l % 2 == 0 ? t.window : 0;
  if (t.type == "llama4_text") return rope_layer(t, l) ? kLlama4Chunk : 0;  // the chunk's cache
  return t.window;
}

inline Attention attention_of(Tiny const& t) {
  Attention a;
  a.rd = t.dh;
  if (t.type == "qwen3_moe") a.norm = true;
  if (t.type == "qwen2_moe") a.qkv_bias = true;
  if (t.type == "olmoe") a.qkv_bias = a.o_bias = a.norm = a.norm_all = true;
  if (t.type == "glm4_moe") a.qkv_bias = a.norm = true, a.rd = t.dh / 2;
  if (t.type == "minimax_m2") a.norm = a.norm_all = true, a.rd = t.dh / 2;
  if (t.type == "gpt_oss") a.qkv_bias = a.o_bias = a.sinks = a.yarn = true;
  if (t.type == "ernie4_5_moe") a.interleaved = true;
  if (t.type == "llama4_text") a.interleaved = a.llama4 = true;
  if (hybrid(t)) a.norm = a.gate = true, a.rd = t.dh / 2;
  return a;
}

/// The expert groups of the group-routed families (DeepSeek-V3/V2, GLM-4.5): the largest power
/// of two up to `most` that divides the experts (the tests' 4 experts: 2).
inline Index group_count(Index E, Index most = 2) {
  Index g = most;
  while (g > 1 && E % g != 0) g /= 2;
  return g;
}
/// The groups kept: at least `least` (the tests' top-2 of 4: 1), more when top-k needs more
/// experts than those hold, at most all of them.
inline Index kept_groups(Index E, Index k, Index groups, Index least = 1) {
  Index const per = E / groups;
  return std::min(groups, std::max(least, (k + per - 1) / per));
}

/// The MoE keys of the tiny model (dense layers: Qwen's mlp_only_layers {1}, GLM's first layer).
inline moe::io::HfMoeConfig moe_config(Tiny const& t) {
  moe::io::HfMoeConfig c = moe::io::parse_hf_config(
      concat("{\"model_type\": \"", t.type, "\", \"num_experts_per_tok\": ", t.k, "}"));
  c.hidden_size = t.H;
  c.expert_intermediate_size = t.I_moe;
  c.num_experts = t.E;
  c.num_hidden_layers = t.L;
  if (t.type == "qwen3_moe") c.norm_topk_prob = true, c.mlp_only_layers = {1};
  if (t.type == "qwen2_moe") c.shared_expert_intermediate_size = 12, c.mlp_only_layers = {1};
  if (t.type == "qwen3_next") c.shared_expert_intermediate_size = 12, c.mlp_only_layers = {2};
  if (t.type == "qwen3_5_moe_text") c.shared_expert_intermediate_size = 12;
  if (t.type == "glm4_moe") {
    c.n_shared_experts = 1;
    c.first_k_dense_replace = 1;
    c.n_group = group_count(t.E);
    c.topk_group = kept_groups(t.E, t.k, c.n_group);
    c.routed_scaling_factor = 1.5f;
    c.norm_topk_prob = true;
  }
  if (t.type == "gpt_oss") c.swiglu_limit = t.swiglu_limit;
  if (t.type == "deepseek_v3" || t.type == "deepseek_v2") {
    c.n_shared_experts = 1;
    c.first_k_dense_replace = 1;
    c.n_group = group_count(t.E);
    c.topk_group = kept_groups(t.E, t.k, c.n_group);
    c.routed_scaling_factor = 1.5f;
    c.norm_topk_prob = t.type == "deepseek_v3";
    if (t.type == "deepseek_v2") c.topk_method = "group_limited_greedy";
  }
  if (t.type == "ernie4_5_moe") c.n_shared_experts = 1;          // layer 0 dense (start index 1)
  if (t.type == "llama4_text") c.interleave_moe_layer_step = 2;  // layers 1 and 3 MoE
  c.fp8_block_rows = c.fp8_block_cols = t.fp8_block;
  c.mxfp4 = t.mxfp4;
  c.defaulted_keys.clear();
  return c;
}

inline std::string config_json(Tiny const& t) {
  std::string j = moe::io::hf_config_json(moe_config(t));
  j.resize(j.rfind('}'));  // the MoE keys, then the decoder's
  j += concat(", \"vocab_size\": ", t.V, ", \"num_attention_heads\": ", t.heads,
              ", \"num_key_value_heads\": ", t.kv, ", \"head_dim\": ", t.dh,
              ", \"rope_theta\": ", t.theta, ", \"rms_norm_eps\": ", t.eps,
              ", \"tie_word_embeddings\": ", t.tie ? "true" : "false");
  if (t.type == "qwen3_moe" || t.type == "qwen2_moe" || t.type == "glm4_moe" ||
      t.type == "ernie4_5_moe" || t.type == "qwen3_next" || mla_of(t)) {
    j += concat(", \"intermediate_size\": ", t.I_dense);
  }
  if (t.type == "mixtral") {
    j += concat(", \"sliding_window\": ", t.window == 0 ? std::string("null") : concat(t.window));
  }
  if (t.type == "olmoe") j += ", \"attention_bias\": true, \"clip_qkv\": null";
  if (t.type == "glm4_moe") {
    j += ", \"attention_bias\": true, \"use_qk_norm\": true, \"partial_rotary_factor\": 0.5";
  }
  if (t.type == "gpt_oss") {
    j += concat(", \"sliding_window\": ", t.window, ", \"layer_types\": [");
    for (Index l = 0; l < t.L; ++l) {
      j += concat(l ? ", " : "", l % 2 == 0 ? "\"sliding_attention\"" : "\"full_attention\"");
    }
    j += concat("], \"max_position_embeddings\": ", 32 * kYarnOriginal,
                ", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 32.0, "
                "\"beta_fast\": 32.0, \"beta_slow\": 1.0, \"truncate\": false, "
                "\"original_max_position_embeddings\": ",
                kYarnOriginal, "}");
  }
  if (t.type == "minimax_m2") {
    j += concat(", \"rotary_dim\": ", t.dh / 2,
                ", \"use_qk_norm\": true, \"qk_norm_type\": \"per_layer\"");
  }
  if (std::optional<Mla> const a = mla_of(t)) {
    j += concat(", \"q_lora_rank\": ", a->ql > 0 ? concat(a->ql) : std::string("null"),
                ", \"kv_lora_rank\": ", a->R, ", \"qk_nope_head_dim\": ", a->dn,
                ", \"qk_rope_head_dim\": ", a->dr, ", \"v_head_dim\": ", a->dv);
    if (a->v3) {
      j += ", \"rope_interleave\": true, \"max_position_embeddings\": 32, \"rope_scaling\": "
           "{\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 8, "
           "\"beta_fast\": 32, \"beta_slow\": 1, \"mscale\": 1.0, \"mscale_all_dim\": 1.0}";
    }
  }
  if (hybrid(t)) {
    Gdn const g;
    j += concat(", \"full_attention_interval\": 2, \"partial_rotary_factor\": 0.5",
                ", \"linear_num_key_heads\": ", g.Hk, ", \"linear_num_value_heads\": ", g.Hv,
                ", \"linear_key_head_dim\": ", g.dk, ", \"linear_value_head_dim\": ", g.dv,
                ", \"linear_conv_kernel_dim\": ", g.kernel);
  }
  if (t.type == "llama4_text") {
    // L0 = 8: inv_freq 1 (wavelength 6.3) is smoothed, the lower ones divided by 4
    j += concat(", \"intermediate_size_mlp\": ", t.I_dense,
                ", \"no_rope_layers\": ", no_rope_layers(t),
                ", \"attention_chunk_size\": ", kLlama4Chunk,
                ", \"attn_temperature_tuning\": true, \"floor_scale\": ", kLlama4Floor,
                ", \"attn_scale\": ", kLlama4Temp,
                ", \"use_qk_norm\": true, \"rope_scaling\": {\"rope_type\": \"llama3\", "
                "\"factor\": 4.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 2.0, "
                "\"original_max_position_embeddings\": 8}");
  }
  return j + "}";
}

inline bool is_dense(Tiny const& t, Index layer) { return !moe_config(t).is_moe_layer(layer); }
inline std::string dense_module(Tiny const& t) {
  return t.type == "llama4_text" ? "feed_forward." : "mlp.";
}

/// Every tensor of the whole model: name, shape and the range of its random values.
struct TensorSpec {
  std::string name;
  Shape shape;
  float lo, hi;
};

inline std::vector<TensorSpec> tensor_specs(Tiny const& t) {
  std::int64_t const V = t.V, H = t.H, q = t.heads * t.dh, kvd = t.kv * t.dh;
  Attention const at = attention_of(t);
  float const a = 0.4f;
  // A norm's weight: around 1, or around 0 in the (1 + w) form.
  float const n0 = one_plus(t) ? -0.5f : 0.5f, n1 = n0 + 1.0f;
  std::vector<TensorSpec> out = {{"model.embed_tokens.weight", {V, H}, -1.0f, 1.0f},
                                 {"model.norm.weight", {H}, n0, n1}};
  if (!t.tie) out.push_back({"lm_head.weight", {V, H}, -0.5f, 0.5f});
  moe::io::HfMoeConfig const c = moe_config(t);
  for (Index l = 0; l < t.L; ++l) {
    std::string const p = concat("model.layers.", l, ".");
    if (linear_layer(t, l)) {  // Qwen3NextGatedDeltaNet's
      Gdn const g;
      std::string const s = p + "linear_attn.";
      std::int64_t const K = g.Hk * g.dk, Vd = g.Hv * g.dv;
      if (split_projections(t)) {  // Qwen3_5GatedDeltaNet's
        out.push_back({s + "in_proj_qkv.weight", {2 * K + Vd, H}, -a, a});
        out.push_back({s + "in_proj_z.weight", {Vd, H}, -a, a});
        out.push_back({s + "in_proj_b.weight", {g.Hv, H}, -1.0f, 1.0f});
        out.push_back({s + "in_proj_a.weight", {g.Hv, H}, -1.0f, 1.0f});
      } else {
        out.push_back({s + "in_proj_qkvz.weight", {2 * K + 2 * Vd, H}, -a, a});
        out.push_back({s + "in_proj_ba.weight", {2 * g.Hv, H}, -1.0f, 1.0f});
      }
      out.push_back({s + "conv1d.weight", {2 * K + Vd, 1, g.kernel}, -0.6f, 0.6f});
      out.push_back({s + "A_log", {g.Hv}, -1.0f, 1.0f});
      out.push_back({s + "dt_bias", {g.Hv}, -1.0f, 1.0f});
      out.push_back({s + "norm.weight", {g.dv}, 0.5f, 1.5f});
      out.push_back({s + "out_proj.weight", {H, Vd}, -a, a});
    } else if (std::optional<Mla> const ml = mla_of(t)) {  // DeepseekV3Attention's modules
      std::string const s = p + "self_attn.";
      std::int64_t const heads = t.heads, dq = ml->dn + ml->dr;
      if (ml->ql > 0) {
        out.push_back({s + "q_a_proj.weight", {ml->ql, H}, -a, a});
        out.push_back({s + "q_a_layernorm.weight", {ml->ql}, 0.5f, 1.5f});
        out.push_back({s + "q_b_proj.weight", {heads * dq, ml->ql}, -a, a});
      } else {
        out.push_back({s + "q_proj.weight", {heads * dq, H}, -a, a});
      }
      out.push_back({s + "kv_a_proj_with_mqa.weight", {ml->R + ml->dr, H}, -a, a});
      out.push_back({s + "kv_a_layernorm.weight", {ml->R}, 0.5f, 1.5f});
      out.push_back({s + "kv_b_proj.weight", {heads * (ml->dn + ml->dv), ml->R}, -a, a});
      out.push_back({s + "o_proj.weight", {H, heads * ml->dv}, -a, a});
    } else {
      out.push_back({p + "self_attn.q_proj.weight", {at.gate ? 2 * q : q, H}, -a, a});
      out.push_back({p + "self_attn.k_proj.weight", {kvd, H}, -a, a});
      out.push_back({p + "self_attn.v_proj.weight", {kvd, H}, -a, a});
      out.push_back({p + "self_attn.o_proj.weight", {H, q}, -a, a});
    }
    if (at.qkv_bias) {
      out.push_back({p + "self_attn.q_proj.bias", {q}, -a, a});
      out.push_back({p + "self_attn.k_proj.bias", {kvd}, -a, a});
      out.push_back({p + "self_attn.v_proj.bias", {kvd}, -a, a});
    }
    if (at.o_bias) out.push_back({p + "self_attn.o_proj.bias", {H}, -a, a});
    if (at.sinks) out.push_back({p + "self_attn.sinks", {t.heads}, -1.0f, 1.0f});
    if (at.norm && !linear_layer(t, l)) {
      out.push_back({p + "self_attn.q_norm.weight", {at.norm_all ? q : t.dh}, n0, n1});
      out.push_back({p + "self_attn.k_norm.weight", {at.norm_all ? kvd : t.dh}, n0, n1});
    }
    out.push_back({p + "input_layernorm.weight", {H}, n0, n1});
    out.push_back({p + "post_attention_layernorm.weight", {H}, n0, n1});
    if (is_dense(t, l)) {
      std::string const mlp = p + dense_module(t);
      out.push_back({mlp + "gate_proj.weight", {t.I_dense, H}, -a, a});
      out.push_back({mlp + "up_proj.weight", {t.I_dense, H}, -a, a});
      out.push_back({mlp + "down_proj.weight", {H, t.I_dense}, -a, a});
      continue;
    }
    for (moe::io::HfTensor const& ht :
         moe::io::hf_layer_tensors(c, moe::io::hf_default_layout(c.family, l))) {
      using moe::io::HfPart;
      bool const router = ht.part == HfPart::kRouter || ht.part == HfPart::kSharedExpertGate;
      float const r = ht.part == HfPart::kSelectionBias ? 0.2f : router ? 1.0f : a;
      out.push_back({ht.name, ht.shape, -r, r});
    }
  }
  return out;
}

/// Random tensors under the HF names of the whole model.
inline Tensors make_tensors(Tiny const& t, std::uint64_t seed) {
  Tensors m;
  for (TensorSpec const& s : tensor_specs(t)) {
    std::int64_t n = 1;
    for (std::int64_t d : s.shape) n *= d;
    std::vector<float> v(static_cast<std::size_t>(n));
    moe::fill_uniform(v, s.lo, s.hi, seed++);
    m[s.name] = v;
  }
  return m;
}

/// The tiny model of each family the decoder tests use.
inline Tiny family_tiny(std::string const& type) {
  Tiny t;
  t.type = type;
  if (type == "mixtral") t.window = 4, t.tie = true, t.theta = 1e6, t.eps = 1e-5;
  if (type == "olmoe" || type == "ernie4_5_moe" || type == "llama4_text") t.eps = 1e-5;
  if (type == "glm4_moe") t.theta = 1e6;
  if (type == "gpt_oss") t.theta = 150000.0, t.eps = 1e-5, t.window = 3;
  if (type == "ernie4_5_moe") t.theta = 500000.0;
  if (type == "minimax_m2") t.theta = 5e6;
  if (type == "llama4_text" || hybrid(t)) t.L = 4;
  return t;
}
inline constexpr char const* kDecoderFamilies[] = {
    "deepseek_v3",  "deepseek_v2", "qwen3_next", "qwen3_5_moe_text", "qwen3_moe",
    "mixtral",      "qwen2_moe",   "olmoe",      "glm4_moe",         "gpt_oss",
    "ernie4_5_moe", "minimax_m2",  "llama4_text"};

/// Writes the checkpoint of `m` into `dir` (created if missing): model.safetensors (F32 tensors,
/// or BF16 ones rounded to nearest even) and config.json.
inline void write_checkpoint(fs::path const& dir, Tiny const& t, Tensors const& m,
                             bool bf16 = false) {
  fs::create_directories(dir);
  std::map<std::string, Shape> shapes;
  for (TensorSpec const& s : tensor_specs(t)) shapes[s.name] = s.shape;
  moe::io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  for (auto const& [n, v] : m) {
    if (bf16) {
      w.add_bf16(n, shapes.at(n), v);
    } else {
      w.add_f32(n, shapes.at(n), v);
    }
  }
  w.save(dir / "model.safetensors");
  moe::io::detail::write_text_file(dir / "config.json", config_json(t));
}

/// The tokenizer's size: ids 0-255 are the bytes (GPT-2's byte-to-unicode symbols), then
/// <|endoftext|> 256, <|im_start|> 257, <|im_end|> 258.
inline constexpr Index kTokenizerVocab = 259;

/// The byte-level BPE symbol of byte `b` (GPT-2's bytes_to_unicode), UTF-8 encoded, escaped for a
/// JSON string.
inline std::string byte_symbol(int b) {
  auto const printable = [](int c) {
    return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
  };
  int code = b;
  if (!printable(b)) {
    code = 256;
    for (int c = 0; c < b; ++c) code += printable(c) ? 0 : 1;
  }
  if (code == '"' || code == '\\') return std::string("\\") + static_cast<char>(code);
  if (code < 0x80) return std::string(1, static_cast<char>(code));
  return {static_cast<char>(0xC0 | (code >> 6)), static_cast<char>(0x80 | (code & 0x3F))};
}

/// Writes tokenizer.json (byte-level BPE over the 256 bytes, no merges, Qwen2's NFC normalizer and
/// split), tokenizer_config.json (no BOS, EOS <|im_end|>, the ChatML chat template) and
/// generation_config.json (eos_token_id [258, 256]) into `dir`.
inline void write_tokenizer(fs::path const& dir) {
  std::string vocab;
  for (int b = 0; b < 256; ++b) vocab += concat(b ? ", " : "", "\"", byte_symbol(b), "\": ", b);
  std::string const json = concat(
      R"({"version": "1.0", "added_tokens": [)",
      R"({"id": 256, "content": "<|endoftext|>", "special": true, "lstrip": false, "rstrip": false}, )",
      R"({"id": 257, "content": "<|im_start|>", "special": true, "lstrip": false, "rstrip": false}, )",
      R"({"id": 258, "content": "<|im_end|>", "special": true, "lstrip": false, "rstrip": false}], )",
      R"("normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)",
      R"({"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, )",
      R"("behavior": "Isolated", "invert": false}, )",
      R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]}, )",
      R"("post_processor": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}, )",
      R"("decoder": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}, )",
      R"("model": {"type": "BPE", "dropout": null, "unk_token": null, "vocab": {)", vocab,
      R"(}, "merges": []}})");
  moe::io::detail::write_text_file(dir / "tokenizer.json", json);
  moe::io::detail::write_text_file(
      dir / "tokenizer_config.json",
      concat(
          R"({"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>", )",
          R"("pad_token": "<|endoftext|>", "chat_template": ")",
          R"({%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + )",
          R"(message.content + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt )",
          R"(%}{{- '<|im_start|>assistant\n' }}{%- endif %}"})"));
  moe::io::detail::write_text_file(dir / "generation_config.json",
                                   R"({"eos_token_id": [258, 256], "do_sample": false})");
}

}  // namespace tiny_model
