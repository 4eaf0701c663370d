// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The decoder-level keys of a whole model's config.json (DecoderConfig, parse_decoder_config)
/// for moe/models/decoder.hpp, in a header of their own: it needs only the config reader, so
/// tools and the config fuzzer can parse without the layers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/io/hf/config.hpp"
#include "moe/kernels/rope.hpp"
#include "moe/layers/attention_options.hpp"

namespace moe::models {

/// Multi-head latent attention's sizes (DeepSeek-V2 / V3, Kimi K2; MlaAttentionConfig's fields
/// of the same names), `enabled` for those families.
struct DecoderMla {
  bool enabled = false;
  Index q_lora_rank = 0;  ///< 0: null (one q_proj, DeepSeek-V2-Lite)
  Index kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = true;  ///< V3's rope_interleave (V2: its complex RoPE, the same)
  /// V3's softmax correction with YaRN: rope_scaling.mscale_all_dim (0: none; V2 has none).
  float softmax_mscale_all_dim = 0.0f;
};

/// Gated DeltaNet's sizes (Qwen3-Next's linear-attention layers; GatedDeltaNetConfig's fields of
/// the same names), `layers` marking the layers that have one.
struct DecoderDeltaNet {
  /// [num_hidden_layers] 1 where layer_types says "linear_attention"; empty: none.
  std::vector<std::uint8_t> layers;
  Index num_key_heads = 0, num_value_heads = 0, key_head_dim = 0, value_head_dim = 0;
  Index conv_kernel = 0;
  /// Qwen3.5's split input projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) instead
  /// of Qwen3-Next's in_proj_qkvz and in_proj_ba.
  bool split_projections = false;
  /// Which key head a value head reads: transformers' grouped order, or the tiled one of
  /// llama.cpp's GGUF files of Qwen3.5 (io::GgufAsHf::deltanet_tiled_value_heads).
  DeltaNetHeadOrder head_order = DeltaNetHeadOrder::kGrouped;
};

/// The decoder-level keys of a config.json (the MoE keys are in `moe`), with the transformers
/// defaults of the family's config class for absent keys. Every family decodes:
///
/// | family     | attention (beyond GQA, causal, rotate-half RoPE)      | dense MLP layers        |
/// |------------|-------------------------------------------------------|-------------------------|
/// | qwen3_moe  | per-head q/k RMSNorm                                  | mlp_only_layers, step   |
/// | mixtral    | sliding_window                                        | none                    |
/// | qwen2_moe  | q/k/v biases (qkv_bias, default true)                 | mlp_only_layers, step   |
/// | olmoe      | q/k RMSNorm over all heads; attention_bias: q/k/v/o   | none                    |
/// | glm4_moe   | attention_bias (q/k/v); use_qk_norm (per head);       | first_k_dense_replace   |
/// |            | partial RoPE (partial_rotary_factor, default 0.5)     |                         |
/// | minimax_m2 | q/k RMSNorm over all heads (use_qk_norm, per_layer);  | none                    |
/// |            | partial RoPE (rotary_dim, default head_dim / 2)       |                         |
/// | gpt_oss    | attention_bias (q/k/v/o, default true); sinks; YaRN   | none                    |
/// |            | RoPE (rope_scaling); sliding_window on the layers     |                         |
/// |            | layer_types calls "sliding_attention"                 |                         |
/// | ernie4_5_moe | interleaved RoPE (pairs 2i, 2i + 1); use_bias must be | layers outside | | |
/// false (it would bias the dense MLPs and the LM head)  | moe_layer_start/end/... |
/// | llama4_text | interleaved RoPE, Llama 3 scaling (rope_type "llama3"); | outside moe_layers |
/// |            | NoPE layers (no_rope_layers, no_rope_layer_interval 4)| or the interleave  |
/// |            | with temperature tuning (attn_temperature_tuning,     | step, under         |
/// |            | floor_scale 8192, attn_scale 0.1); chunks              | feed_forward.,      |
/// |            | (attention_chunk_size 8192) on the layer_types        | intermediate_size_mlp |
/// |            | "chunked_attention" (default: the RoPE layers); an    |                     |
/// |            | unweighted q/k norm on them (use_qk_norm, true)       |                     |
/// | qwen3_next | layer_types (linear_attention / full_attention;       | mlp_only_layers, step |
/// |            | default every full_attention_interval-th (4) full):  | (intermediate_size)   |
/// |            | Gated DeltaNet on the linear layers (linear_* keys);  |                     |
/// |            | on the full ones a sigmoid output gate packed per     |                     |
/// |            | head in q_proj, (1 + w) per-head q/k norms, partial   |                     |
/// |            | RoPE (partial_rotary_factor 0.25); (1 + w) layer norms|                     |
///
/// Keys, with their defaults in the order qwen3_moe / mixtral / qwen2_moe / olmoe / glm4_moe /
/// minimax_m2 / gpt_oss / ernie4_5_moe (llama4_text: Llama4TextConfig's, Llama-4-Scout's):
/// - vocab_size: 151936 / 32000 / 151936 / 50304 / 151552 / 200064 / 201088 / 103424.
/// - num_hidden_layers: **required**; checkpoint layers past it (GLM-4.5's multi-token
///   prediction layer) are not read.
/// - num_attention_heads: 32 / 32 / 16 / 16 / 96 / 48 / 64 / 20.
/// - num_key_value_heads: 4 / 8 / 16 / = heads / 8 / 8 / 8 / 4.
/// - head_dim: else hidden_size / heads (minimax_m2: 128, gpt_oss: 64).
/// - intermediate_size: the dense MLP layers' width (6144 / - / 5632 / - / 10944 / - / - / 12288).
/// - rope_theta or rope_parameters.rope_theta: 1e4 / 1e6 / 1e4 / 1e4 / 1e4 / 5e6 / 1.5e5 / 5e5;
///   rope_scaling and rope_type must be absent, null or "default" (gpt_oss: also "yarn", whose
///   factor, beta_fast, beta_slow, original_max_position_embeddings, truncate and
///   attention_factor set `yarn`; gpt-oss's transformers default when rope_scaling is absent).
/// - rotary_dim: glm4_moe int(head_dim * partial_rotary_factor); minimax_m2 rotary_dim.
/// - rms_norm_eps (also the q/k norms'): 1e-6 / 1e-5 / 1e-6 / 1e-5 / 1e-5 / 1e-6 / 1e-5 / 1e-5.
/// - tie_word_embeddings: false (ernie4_5_moe: true); true: lm_head = embed_tokens.
/// - max_position_embeddings: 0 when absent (no limit known); only warned about
///   (Decoder::context_warning()).
/// - sliding_window: mixtral, every layer (null: none); gpt_oss (128), the layers layer_types
///   calls "sliding_attention" (default: the even ones); use_sliding_window must be false
///   (qwen3_moe, qwen2_moe).
///
/// Refused with a moe::Error naming the key: OLMoE's clip_qkv, MiniMax-M2's qk_norm_type other
/// than "per_layer", attention_bias true where the family has no biases (qwen3_moe, mixtral,
/// minimax_m2).
struct DecoderConfig {
  io::HfMoeConfig moe;
  Index vocab_size = 0;
  Index num_hidden_layers = 0;
  Index num_attention_heads = 0;
  Index num_key_value_heads = 0;
  Index head_dim = 0;
  Index intermediate_size = 0;
  float rope_theta = 10000.0f;
  Index rotary_dim = 0;  ///< RoPE's rotated dimensions per head (the first ones); 0: head_dim
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  Index sliding_window = 0;
  /// [num_hidden_layers] each layer's sliding window (0: the whole prefix).
  std::vector<Index> layer_windows;
  bool sinks = false;           ///< a learned sink logit per head (gpt-oss self_attn.sinks)
  kernels::RopeYarn yarn = {};  ///< YaRN RoPE scaling (gpt-oss); factor 0: plain RoPE
  bool qk_norm = false;         ///< q/k RMSNorm (Qwen3-MoE, GLM-4.5 use_qk_norm, OLMoE, MiniMax-M2)
  QkNormScope qk_norm_scope = QkNormScope::kPerHead;  ///< kAllHeads: OLMoE, MiniMax-M2
  bool qkv_bias = false;  ///< q/k/v projection biases (Qwen2-MoE; GLM-4.5, OLMoE attention_bias)
  bool o_bias = false;    ///< o_proj bias (OLMoE attention_bias)
  bool rope_interleaved = false;    ///< RoPE on pairs (2i, 2i + 1) (ERNIE 4.5, Llama 4)
  kernels::RopeLlama3 llama3 = {};  ///< Llama 3 RoPE scaling (Llama 4 Scout); factor 0: none
  /// [rotary_dim / 2] divisors of the RoPE frequencies (a GGUF file's rope_freqs tensor, which
  /// is how llama.cpp stores Llama 3 scaling: io::GgufAsHf::rope_freq_factors); empty: none.
  std::vector<float> rope_freq_factors;
  /// Multi-head latent attention instead of GQA (DeepSeek-V2 / V3, Kimi K2); its YaRN is `yarn`,
  /// its rope_theta `rope_theta`, its attention_bias `qkv_bias`.
  DecoderMla mla;
  /// [num_hidden_layers] 1 where the layer has no RoPE (Llama 4's NoPE layers); empty: none.
  std::vector<std::uint8_t> nope_layers;
  /// [num_hidden_layers] each layer's attention chunk (Llama 4's chunked layers; 0: none).
  std::vector<Index> layer_chunks;
  /// An unweighted q/k RMSNorm per head on the RoPE layers (Llama 4 use_qk_norm).
  bool qk_norm_unweighted = false;
  /// Qwen3-Next: Gated DeltaNet layers (`deltanet.layers`), a sigmoid output gate packed per head
  /// in q_proj on the full-attention layers, and RMSNorms (layer, final, q/k) of the (1 + w)
  /// form (Qwen3NextRMSNorm).
  DecoderDeltaNet deltanet;
  bool attention_gate = false;
  bool norm_one_plus = false;
  /// Temperature tuning of the NoPE layers' queries (Llama 4 attn_temperature_tuning): floor_scale
  /// (0: off) and attn_scale.
  Index temperature_floor = 0;
  float temperature_scale = 0.0f;
  /// config.json's max_position_embeddings, the context the model was trained for (0: absent).
  /// A longer context is not refused (RoPE runs at any position) but is outside what the model
  /// was trained on: Decoder::context_warning() says so, moe_generate prints it.
  Index max_position_embeddings = 0;

  /// Does layer L rotate its queries and keys (no: a NoPE layer)?
  bool rope_layer(Index L) const {
    return static_cast<std::size_t>(L) >= nope_layers.size() ||
           nope_layers[static_cast<std::size_t>(L)] == 0;
  }
  /// Is layer L a Gated DeltaNet (linear-attention) layer?
  bool linear_layer(Index L) const {
    return static_cast<std::size_t>(L) < deltanet.layers.size() &&
           deltanet.layers[static_cast<std::size_t>(L)] != 0;
  }
  /// Layer L's sliding window and attention chunk (0: none).
  Index window_of(Index L) const {
    return static_cast<std::size_t>(L) < layer_windows.size()
               ? layer_windows[static_cast<std::size_t>(L)]
               : sliding_window;
  }
  Index chunk_of(Index L) const {
    return static_cast<std::size_t>(L) < layer_chunks.size()
               ? layer_chunks[static_cast<std::size_t>(L)]
               : 0;
  }
};

namespace detail {

/// Does `family` decode (its description has no HfDecoderFacts::lacks)?
inline bool decodes(io::HfFamily family) { return io::hf_family(family).decoder.lacks.empty(); }

/// The model types of the families whose decoder facts satisfy `pred`, as a list for messages.
template <class Pred>
std::string model_types_where(Pred pred) {
  std::string out;
  for (io::HfFamily const f : io::kHfFamilies) {
    if (pred(io::hf_family(f).decoder)) {
      out += io::detail::concat(out.empty() ? "" : ", ", io::hf_model_type(f));
    }
  }
  return out;
}

/// Llama 4's per-layer attention (HfDecoderFacts::llama4_layers) into c: NoPE layers, chunks,
/// temperature tuning, as Llama4TextConfig.__post_init__ fills their defaults.
inline void read_llama4_layers(io::detail::HfConfigReader& r, DecoderConfig& c) {
  using io::detail::JsonKind;
  std::size_t const L = static_cast<std::size_t>(c.num_hidden_layers);
  auto per_layer = [&](char const* key, io::detail::JsonValue const& a) {
    if (a.kind != JsonKind::kArray) r.bad(key, a, "an array with one entry per layer");
    if (a.items.size() != L) {
      moe::detail::fail("models: ", r.source(), ": ", key, " has ", a.items.size(),
                        " entries but num_hidden_layers = ", L, "; give one per layer");
    }
  };
  // no_rope_layers[L] = 1: layer L uses RoPE (the name is transformers'); an empty list or
  // none: every no_rope_layer_interval-th layer is NoPE.
  c.nope_layers.assign(L, 0);
  io::detail::JsonValue const* nr = r.find("no_rope_layers");
  if (nr != nullptr && !(nr->kind == JsonKind::kArray && nr->items.empty())) {
    per_layer("no_rope_layers", *nr);
    for (std::size_t i = 0; i < L; ++i) {
      Index const v = r.integer("no_rope_layers", nr->items[i], 0);
      if (v > 1) r.bad("no_rope_layers", nr->items[i], "0 (a NoPE layer) or 1 (RoPE)");
      c.nope_layers[i] = v == 0 ? 1 : 0;
    }
  } else {
    Index const interval = r.integer({"no_rope_layer_interval"}, 4, 1);
    for (std::size_t i = 0; i < L; ++i) {
      c.nope_layers[i] = (static_cast<Index>(i) + 1) % interval == 0 ? 1 : 0;
    }
  }
  // attention_chunk_size (null: no chunks) on the layers layer_types calls "chunked_attention".
  Index const chunk =
      r.is_null("attention_chunk_size") ? 0 : r.integer({"attention_chunk_size"}, 8192, 1);
  c.layer_chunks.assign(L, 0);
  if (io::detail::JsonValue const* lt = r.find("layer_types")) {
    per_layer("layer_types", *lt);
    for (std::size_t i = 0; i < L; ++i) {
      io::detail::JsonValue const& item = lt->items[i];
      if (item.kind != JsonKind::kString ||
          (item.text != "chunked_attention" && item.text != "full_attention")) {
        r.bad("layer_types", item, "\"chunked_attention\" or \"full_attention\" per layer");
      }
      if (item.text == "chunked_attention") c.layer_chunks[i] = chunk;
    }
  } else {
    for (std::size_t i = 0; i < L; ++i) c.layer_chunks[i] = c.nope_layers[i] ? 0 : chunk;
  }
  if (r.boolean("attn_temperature_tuning", true)) {
    c.temperature_floor = r.integer({"floor_scale"}, 8192, 1);
    double const a = r.number("attn_scale", 0.1);
    if (!(std::fabs(a) <= std::numeric_limits<float>::max())) {
      moe::detail::fail("models: ", r.source(), ": attn_scale = ", a,
                        " does not fit a float; fix config.json");
    }
    c.temperature_scale = static_cast<float>(a);
  }
}

/// Qwen3-Next's hybrid layers (HfDecoderFacts::gated_deltanet) into c: layer_types (default:
/// every full_attention_interval-th layer full, as Qwen3NextConfig.__post_init__ fills it) and
/// the Gated DeltaNet sizes.
inline void read_deltanet_layers(io::detail::HfConfigReader& r, DecoderConfig& c) {
  using io::detail::JsonKind;
  std::size_t const L = static_cast<std::size_t>(c.num_hidden_layers);
  DecoderDeltaNet& d = c.deltanet;
  d.layers.assign(L, 0);
  if (io::detail::JsonValue const* lt = r.find("layer_types");
      lt != nullptr && !r.is_null("layer_types")) {
    if (lt->kind != JsonKind::kArray)
      r.bad("layer_types", *lt, "an array with one entry per layer");
    if (lt->items.size() != L) {
      moe::detail::fail("models: ", r.source(), ": layer_types has ", lt->items.size(),
                        " entries but num_hidden_layers = ", L, "; give one per layer");
    }
    for (std::size_t i = 0; i < L; ++i) {
      // transformers' remap_legacy_layer_types also reads "mamba" and "attention" as these two
      io::detail::JsonValue const& item = lt->items[i];
      bool const linear = item.text == "linear_attention" || item.text == "mamba";
      if (item.kind != JsonKind::kString ||
          !(linear || item.text == "full_attention" || item.text == "attention")) {
        r.bad("layer_types", item, "\"linear_attention\" or \"full_attention\" per layer");
      }
      d.layers[i] = linear ? 1 : 0;
    }
  } else {
    Index const interval = r.integer({"full_attention_interval"}, 4, 1);
    for (std::size_t i = 0; i < L; ++i) {
      d.layers[i] = (static_cast<Index>(i) + 1) % interval != 0 ? 1 : 0;
    }
  }
  d.num_key_heads = r.integer({"linear_num_key_heads"}, 16, 1);
  d.num_value_heads = r.integer({"linear_num_value_heads"}, 32, 1);
  d.key_head_dim = r.integer({"linear_key_head_dim"}, 128, 1);
  d.value_head_dim = r.integer({"linear_value_head_dim"}, 128, 1);
  d.conv_kernel = r.integer({"linear_conv_kernel_dim"}, 4, 1);
  if (d.num_value_heads % d.num_key_heads != 0) {
    moe::detail::fail("models: ", r.source(), ": linear_num_value_heads = ", d.num_value_heads,
                      " must be a multiple of linear_num_key_heads = ", d.num_key_heads,
                      " (each key head serves as many value heads); fix config.json");
  }
  d.split_projections = c.moe.spec().decoder.deltanet_split_projections;
  c.attention_gate = true;
  c.norm_one_plus = true;
}

}  // namespace detail

/// Parses a config.json (text; `source` names it in errors) of a family DecoderConfig lists.
/// Throws moe::Error for another model_type, a missing num_hidden_layers, a rope_scaling or
/// rope_type other than the default, the refusals DecoderConfig lists, or sizes that do not fit
/// (KV heads dividing the heads, an odd or too wide rotary_dim, the MoE keys as parse_hf_config
/// checks them).
inline DecoderConfig parse_decoder_config(std::string_view text,
                                          std::string const& source = "config.json") {
  using io::detail::JsonKind;
  DecoderConfig c;
  c.moe = io::parse_hf_config(text, source);
  io::HfDecoderFacts const& def = c.moe.spec().decoder;
  if (!def.lacks.empty()) {
    moe::detail::fail(
        "models: ", source, ": model_type \"", c.moe.model_type(),
        "\" has no decoder in moe yet (moe lacks ", def.lacks, "); moe::models decodes ",
        detail::model_types_where([](io::HfDecoderFacts const& d) { return d.lacks.empty(); }),
        " models (the other families load layer by layer through moe/io/hf.hpp)");
  }
  io::detail::JsonValue const root = io::detail::parse_config_object(text, source);
  io::HfMoeConfig keys;
  // A multimodal config.json nests the text model's keys in text_config (parse_hf_config
  // checked that it is an object).
  io::detail::JsonValue const* model_type = root.member("model_type");
  bool const nested = model_type != nullptr && model_type->kind == JsonKind::kString &&
                      io::detail::nesting_family(model_type->text) != nullptr;
  io::detail::HfConfigReader r(nested ? *root.member("text_config") : root, source, keys);
  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("models: ", source, ": ", parts..., "; fix config.json");
  };
  moe::detail::check(r.find("num_hidden_layers") != nullptr, "models: ", source,
                     ": config.json has no num_hidden_layers; the decoder needs the layer count");
  c.num_hidden_layers = c.moe.num_hidden_layers;
  moe::detail::check(c.num_hidden_layers <= 65536, "models: ", source,
                     ": num_hidden_layers = ", c.num_hidden_layers,
                     " is not a model the decoder can hold (at most 65536 layers); fix "
                     "config.json");
  c.vocab_size = r.integer({"vocab_size"}, def.vocab_size, 1);
  c.num_attention_heads = r.integer({"num_attention_heads"}, def.heads, 1);
  c.num_key_value_heads = r.integer({"num_key_value_heads"},
                                    def.kv_heads > 0 ? def.kv_heads : c.num_attention_heads, 1);
  Index const H = c.moe.hidden_size;
  c.head_dim =
      r.integer({"head_dim"}, def.head_dim > 0 ? def.head_dim : H / c.num_attention_heads, 1);
  c.intermediate_size =
      def.dense_width > 0 ? r.integer({def.dense_width_key}, def.dense_width, 1) : 0;
  io::detail::HfRope rope =
      io::detail::read_hf_rope(r, source, def.rope_theta, def.yarn, def.llama4_layers);
  if (rope.llama3) {
    c.llama3.factor = static_cast<float>(rope.llama3_factor);
    c.llama3.low_freq_factor = static_cast<float>(rope.low_freq_factor);
    c.llama3.high_freq_factor = static_cast<float>(rope.high_freq_factor);
    c.llama3.original_max_position = rope.llama3_original;
  }
  if (def.yarn && def.yarn_factor > 0.0 && r.find("rope_scaling") == nullptr &&
      r.find("rope_parameters") == nullptr) {
    rope.yarn = true;  // the family's default rope_scaling
    rope.yarn_factor = def.yarn_factor;
    rope.original_max_position = def.yarn_original_max_position;
    rope.truncate = def.yarn_truncate;
  }
  if (rope.yarn) {
    c.yarn.factor = static_cast<float>(rope.yarn_factor);
    c.yarn.beta_fast = static_cast<float>(rope.beta_fast);
    c.yarn.beta_slow = static_cast<float>(rope.beta_slow);
    c.yarn.original_max_position = rope.original_max_position;
    c.yarn.truncate = rope.truncate;
    c.yarn.attention_factor = static_cast<float>(rope.attention_factor);
  }
  // A number of config.json as the float the kernels use (moe::Error when it does not fit).
  auto as_float = [&](double v, char const* key) {
    fail_if(!(std::fabs(v) <= std::numeric_limits<float>::max()), key, " = ", v,
            " does not fit a float");
    fail_if(v != 0.0 && static_cast<float>(v) == 0.0f, key, " = ", v,
            " is so small that it reads as 0 in a float (the model computes in fp32); fix "
            "config.json");
    return static_cast<float>(v);
  };
  c.rope_theta = as_float(rope.theta, "rope_theta");
  c.rms_norm_eps = as_float(r.number("rms_norm_eps", def.rms_norm_eps), "rms_norm_eps");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", def.tie_word_embeddings);
  if (r.find("max_position_embeddings") != nullptr) {
    c.max_position_embeddings = r.integer({"max_position_embeddings"}, 0, 1);
  }

  // Attention: q/k norms, biases, rotary dimensions, interleaved RoPE, sinks.
  using io::HfAttentionBias;
  bool const qk_norm = def.qk_norm != io::HfQkNorm::kNone &&
                       (def.qk_norm_key.empty() || r.boolean(def.qk_norm_key, def.qk_norm_default));
  c.qk_norm = qk_norm && def.qk_norm != io::HfQkNorm::kUnweightedOnRope;
  c.qk_norm_unweighted = qk_norm && def.qk_norm == io::HfQkNorm::kUnweightedOnRope;
  if (def.qk_norm == io::HfQkNorm::kAllHeads) c.qk_norm_scope = QkNormScope::kAllHeads;
  bool attention_bias = def.bias == HfAttentionBias::kAllOnByDefault;
  if (io::detail::JsonValue const* b = r.find("attention_bias")) {
    if (b->kind != JsonKind::kBool) r.bad("attention_bias", *b, "true or false");
    attention_bias = b->boolean;
  }
  fail_if(attention_bias && def.bias == HfAttentionBias::kNone,
          "attention_bias = true is not supported for ", c.moe.model_type(),
          " (its attention has no projection biases in transformers)");
  switch (def.bias) {
    case HfAttentionBias::kQkvKey:
      c.qkv_bias = r.boolean("qkv_bias", true);
      break;
    case HfAttentionBias::kQkv:
      c.qkv_bias = attention_bias;
      break;
    case HfAttentionBias::kAll:
    case HfAttentionBias::kAllOnByDefault:
      c.qkv_bias = c.o_bias = attention_bias;
      break;
    case HfAttentionBias::kNone:
      break;
  }
  // int(head_dim * partial_rotary_factor), as transformers computes the rotary dimension.
  auto rotary_of = [&](double factor) {
    fail_if(!(factor > 0.0 && factor <= 1.0), "partial_rotary_factor = ", factor,
            " must be in (0, 1]");
    return static_cast<Index>(static_cast<double>(c.head_dim) * factor);
  };
  bool const partial = def.rotary != io::HfRotary::kFull;
  fail_if(rope.yarn && !def.yarn, "rope_type \"yarn\" is read for ",
          detail::model_types_where([](io::HfDecoderFacts const& d) { return d.yarn; }), " only");
  fail_if(!partial && rope.factor_set && rope.factor != 1.0,
          "partial_rotary_factor = ", rope.factor, " is not supported for ", c.moe.model_type(),
          " (its attention rotates the whole head)");
  if (def.rotary == io::HfRotary::kFactor) {
    c.rotary_dim = rotary_of(rope.factor_set ? rope.factor : def.rotary_factor);
  } else if (def.rotary == io::HfRotary::kRotaryDim) {
    c.rotary_dim =
        rope.factor_set ? rotary_of(rope.factor) : r.integer({"rotary_dim"}, c.head_dim / 2, 0);
  }
  c.rope_interleaved = def.rope_interleaved;
  c.sinks = def.sinks;
  if (def.check != nullptr) def.check(r, c.moe, c.qk_norm, source);
  c.layer_windows.assign(static_cast<std::size_t>(c.num_hidden_layers), 0);
  if (def.sliding == io::HfSliding::kEveryLayer) {
    if (r.find("sliding_window") != nullptr) {
      c.sliding_window = r.integer({"sliding_window"}, 0, 1);
    }
    std::fill(c.layer_windows.begin(), c.layer_windows.end(), c.sliding_window);
  } else if (def.sliding == io::HfSliding::kLayerTypes) {
    c.sliding_window = r.integer({"sliding_window"}, def.sliding_window, 1);
    std::vector<std::string> types;
    if (io::detail::JsonValue const* lt = r.find("layer_types")) {
      if (lt->kind != JsonKind::kArray) r.bad("layer_types", *lt, "an array of strings");
      for (io::detail::JsonValue const& item : lt->items) {
        if (item.kind != JsonKind::kString ||
            (item.text != "sliding_attention" && item.text != "full_attention")) {
          r.bad("layer_types", item, "\"sliding_attention\" or \"full_attention\" per layer");
        }
        types.push_back(item.text);
      }
      fail_if(static_cast<Index>(types.size()) != c.num_hidden_layers, "layer_types has ",
              types.size(), " entries but num_hidden_layers = ", c.num_hidden_layers,
              "; give one per layer");
    } else {  // GptOssConfig's default: sliding on the even layers
      for (Index L = 0; L < c.num_hidden_layers; ++L) {
        types.emplace_back(L % 2 == 0 ? "sliding_attention" : "full_attention");
      }
    }
    for (std::size_t L = 0; L < types.size(); ++L) {
      if (types[L] == "sliding_attention") c.layer_windows[L] = c.sliding_window;
    }
  } else {
    fail_if(r.boolean("use_sliding_window", false),
            "use_sliding_window = true is not supported "
            "for ",
            c.moe.model_type());
  }
  if (def.llama4_layers) detail::read_llama4_layers(r, c);
  if (def.gated_deltanet) detail::read_deltanet_layers(r, c);
  if (def.mla) {
    DecoderMla& m = c.mla;
    m.enabled = true;
    m.q_lora_rank = r.is_null("q_lora_rank") ? 0 : r.integer({"q_lora_rank"}, def.q_lora_rank, 1);
    m.kv_lora_rank = r.integer({"kv_lora_rank"}, def.kv_lora_rank, 1);
    m.qk_nope_head_dim = r.integer({"qk_nope_head_dim"}, def.qk_nope_head_dim, 0);
    m.qk_rope_head_dim = r.integer({"qk_rope_head_dim"}, def.qk_rope_head_dim, 2);
    m.v_head_dim = r.integer({"v_head_dim"}, def.v_head_dim, 1);
    m.rope_interleave = r.boolean("rope_interleave", true);
    fail_if(m.qk_rope_head_dim % 2 != 0, "qk_rope_head_dim = ", m.qk_rope_head_dim,
            " must be even (RoPE rotates pairs)");
    if (def.mla_softmax_mscale && rope.yarn) {
      m.softmax_mscale_all_dim = as_float(rope.mscale_all_dim, "rope_scaling.mscale_all_dim");
    }
  }
  fail_if(c.head_dim < 1, "head_dim = ", c.head_dim, " must be >= 1 (hidden_size / heads)");
  fail_if(c.num_attention_heads % c.num_key_value_heads != 0,
          "num_key_value_heads = ", c.num_key_value_heads,
          " must divide num_attention_heads = ", c.num_attention_heads);
  fail_if(partial && (c.rotary_dim < 2 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.head_dim),
          "the rotary dimension ", c.rotary_dim, " (head_dim ", c.head_dim,
          " times partial_rotary_factor, or rotary_dim) must be even and in [2, head_dim]");
  fail_if(!(c.rope_theta >= 1.0f && std::isfinite(c.rope_theta)), "rope_theta = ", c.rope_theta,
          " must be finite and >= 1");
  fail_if(!(c.rms_norm_eps > 0.0f && std::isfinite(c.rms_norm_eps)),
          "rms_norm_eps = ", c.rms_norm_eps, " must be finite and > 0");
  return c;
}

/// Reads `dir`/config.json (or a config.json path) with parse_decoder_config.
inline DecoderConfig read_decoder_config(std::filesystem::path const& path) {
  return io::detail::parse_config_file(path, [](std::string_view text, std::string const& source) {
    return parse_decoder_config(text, source);
  });
}

}  // namespace moe::models
