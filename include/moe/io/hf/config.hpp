// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// HfMoeConfig: the MoE part of a Hugging Face config.json (Mixtral, Qwen2-MoE, Qwen3-MoE,
/// DeepSeek-V3, OLMoE, Qwen3-Next, GLM-4.5, DeepSeek-V2, MiniMax-M2, ERNIE 4.5), its defaults,
/// which layers are MoE layers, and its JSON form.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/mapped_file.hpp"

namespace moe::io {

/// The model families whose MoE layers moe::io loads (config.json "model_type").
enum class HfFamily : std::uint8_t {
  kMixtral,     ///< "mixtral": MixtralSparseMoeBlock, block_sparse_moe.*
  kQwen2Moe,    ///< "qwen2_moe": routed experts + sigmoid-gated shared expert
  kQwen3Moe,    ///< "qwen3_moe": routed experts only
  kDeepseekV3,  ///< "deepseek_v3": sigmoid, selection bias, groups, ungated shared experts
  kOlmoe,       ///< "olmoe": routed experts only, expert width is intermediate_size
  kQwen3Next,   ///< "qwen3_next": the Qwen2-MoE block (sigmoid-gated shared expert)
  kGlm4Moe,     ///< "glm4_moe": DeepSeek-V3's router and ungated shared experts
  kDeepseekV2,  ///< "deepseek_v2": softmax, greedy / group-limited (group max), scaled
  kMinimaxM2,   ///< "minimax_m2": sigmoid + selection bias, renormalised; Mixtral names
  kErnie45Moe,  ///< "ernie4_5_moe": softmax + selection bias on probabilities, shared experts
  kLlama4,      ///< "llama4_text" (or "llama4"'s text_config): sigmoid-scaled expert inputs
  kGptOss,      ///< "gpt_oss": biased router and experts, clamped GLU, MXFP4 checkpoints
};

/// Every family, in HfFamily order.
inline constexpr HfFamily kHfFamilies[] = {
    HfFamily::kMixtral,   HfFamily::kQwen2Moe,   HfFamily::kQwen3Moe, HfFamily::kDeepseekV3,
    HfFamily::kOlmoe,     HfFamily::kQwen3Next,  HfFamily::kGlm4Moe,  HfFamily::kDeepseekV2,
    HfFamily::kMinimaxM2, HfFamily::kErnie45Moe, HfFamily::kLlama4,   HfFamily::kGptOss};

/// The config.json "model_type" of a family ("mixtral", "qwen2_moe", ...).
inline char const* hf_model_type(HfFamily family) noexcept {
  switch (family) {
    case HfFamily::kMixtral:
      return "mixtral";
    case HfFamily::kQwen2Moe:
      return "qwen2_moe";
    case HfFamily::kQwen3Moe:
      return "qwen3_moe";
    case HfFamily::kDeepseekV3:
      return "deepseek_v3";
    case HfFamily::kOlmoe:
      return "olmoe";
    case HfFamily::kQwen3Next:
      return "qwen3_next";
    case HfFamily::kGlm4Moe:
      return "glm4_moe";
    case HfFamily::kDeepseekV2:
      return "deepseek_v2";
    case HfFamily::kMinimaxM2:
      return "minimax_m2";
    case HfFamily::kErnie45Moe:
      return "ernie4_5_moe";
    case HfFamily::kLlama4:
      return "llama4_text";
    case HfFamily::kGptOss:
      return "gpt_oss";
  }
  return "?";
}

/// The transformers class name of a family's causal LM ("MixtralForCausalLM", ...), written to
/// config.json "architectures" by save_hf_layer().
inline char const* hf_architecture(HfFamily family) noexcept {
  switch (family) {
    case HfFamily::kMixtral:
      return "MixtralForCausalLM";
    case HfFamily::kQwen2Moe:
      return "Qwen2MoeForCausalLM";
    case HfFamily::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
    case HfFamily::kDeepseekV3:
      return "DeepseekV3ForCausalLM";
    case HfFamily::kOlmoe:
      return "OlmoeForCausalLM";
    case HfFamily::kQwen3Next:
      return "Qwen3NextForCausalLM";
    case HfFamily::kGlm4Moe:
      return "Glm4MoeForCausalLM";
    case HfFamily::kDeepseekV2:
      return "DeepseekV2ForCausalLM";
    case HfFamily::kMinimaxM2:
      return "MiniMaxM2ForCausalLM";
    case HfFamily::kErnie45Moe:
      return "Ernie4_5_MoeForCausalLM";
    case HfFamily::kLlama4:
      return "Llama4ForCausalLM";
    case HfFamily::kGptOss:
      return "GptOssForCausalLM";
  }
  return "?";
}

/// The config.json key of the number of routed experts ("num_local_experts" for Mixtral,
/// "n_routed_experts" for DeepSeek and GLM, "moe_num_experts" for ERNIE, ...).
inline char const* hf_experts_key(HfFamily family) noexcept {
  switch (family) {
    case HfFamily::kMixtral:
    case HfFamily::kMinimaxM2:
    case HfFamily::kLlama4:
    case HfFamily::kGptOss:
      return "num_local_experts";
    case HfFamily::kDeepseekV3:
    case HfFamily::kGlm4Moe:
    case HfFamily::kDeepseekV2:
      return "n_routed_experts";
    case HfFamily::kErnie45Moe:
      return "moe_num_experts";
    default:
      return "num_experts";
  }
}

/// The config.json key of a routed expert's width: "intermediate_size" (Mixtral, OLMoE,
/// MiniMax-M2) or "moe_intermediate_size" (the others).
inline char const* hf_width_key(HfFamily family) noexcept {
  return family == HfFamily::kMixtral || family == HfFamily::kOlmoe ||
                 family == HfFamily::kMinimaxM2 || family == HfFamily::kLlama4 ||
                 family == HfFamily::kGptOss
             ? "intermediate_size"
             : "moe_intermediate_size";
}

/// The supported model types as a list for messages: "\"mixtral\", \"qwen2_moe\", ... and
/// \"ernie4_5_moe\"".
inline std::string hf_model_type_list() {
  std::string out;
  std::size_t const n = sizeof kHfFamilies / sizeof kHfFamilies[0];
  for (std::size_t i = 0; i < n; ++i) {
    out += i == 0 ? "" : i + 1 == n ? " and " : ", ";
    out += std::string("\"") + hf_model_type(kHfFamilies[i]) + "\"";
  }
  return out;
}

/// The MoE-relevant part of a Hugging Face config.json, with the family's transformers defaults
/// filled in for absent keys (see docs/hf.md for the table). Fields that a family does not use
/// keep the values below.
///
/// | field                           | config.json key(s)                                       |
/// |---------------------------------|----------------------------------------------------------|
/// | num_experts (E)                 | num_local_experts / num_experts / n_routed_experts /     |
/// |                                 | moe_num_experts (ERNIE)                                  |
/// | num_experts_per_tok (k)         | num_experts_per_tok / moe_k (ERNIE)                      |
/// | expert_intermediate_size (I)    | moe_intermediate_size (Qwen, DeepSeek, GLM, ERNIE) or    |
/// |                                 | intermediate_size (Mixtral, OLMoE, MiniMax-M2)           |
/// | shared_expert_intermediate_size | shared_expert_intermediate_size (Qwen2-MoE, Qwen3-Next)  |
/// | n_shared_experts                | n_shared_experts (DeepSeek, GLM) / moe_num_shared_experts |
/// |                                 | (ERNIE): one shared expert of width n * I                |
/// | which layers are MoE            | decoder_sparse_step, mlp_only_layers (Qwen);             |
/// |                                 | first_k_dense_replace, moe_layer_freq (DeepSeek-V3);     |
/// |                                 | first_k_dense_replace (GLM, DeepSeek-V2);                |
/// |                                 | moe_layer_start_index / _end_index / _interval (ERNIE)   |
struct HfMoeConfig {
  HfFamily family = HfFamily::kMixtral;
  Index hidden_size = 0;               ///< H
  Index num_experts = 0;               ///< E (routed experts)
  Index num_experts_per_tok = 0;       ///< k
  Index expert_intermediate_size = 0;  ///< I, width of one routed expert
  bool norm_topk_prob = false;         ///< renormalise the k weights (Mixtral: always)
  std::string hidden_act = "silu";     ///< "silu" (or its alias "swish"): SwiGLU experts
  Index num_hidden_layers = -1;        ///< -1 when config.json does not say

  // Qwen2-MoE / Qwen3-MoE.
  Index shared_expert_intermediate_size = 0;  ///< Qwen2-MoE shared expert width
  Index decoder_sparse_step = 1;              ///< MoE iff (L + 1) % step == 0
  std::vector<Index> mlp_only_layers;         ///< layers forced dense

  // DeepSeek-V3 (and GLM-4.5, DeepSeek-V2, ERNIE 4.5).
  Index n_shared_experts = 0;          ///< one shared expert of width n * I (0: none)
  Index n_group = 1;                   ///< expert groups
  Index topk_group = 1;                ///< groups kept per token
  float routed_scaling_factor = 1.0f;  ///< multiplies the routed weights
  std::string scoring_func = "sigmoid";
  std::string topk_method = "noaux_tc";
  Index first_k_dense_replace = 0;  ///< layers [0, first_k_dense_replace) are dense
  Index moe_layer_freq = 1;         ///< MoE iff L >= first_k_dense_replace and L % freq == 0

  // ERNIE 4.5: MoE iff (L + 1) % interval == 0 and start <= L <= end (end -1: the last layer).
  Index moe_layer_start_index = 1;
  Index moe_layer_end_index = -1;
  Index moe_layer_interval = 1;
  float moe_norm_min = 1e-12f;  ///< the weights' sum is clamped to at least this

  // Llama 4: MoE iff L in moe_layers, or (without it) (L + 1) % interleave_moe_layer_step == 0.
  Index interleave_moe_layer_step = 1;
  std::vector<Index> moe_layers;  ///< explicit MoE layer indices (moe_layers_given)
  bool moe_layers_given = false;  ///< config.json has a non-null moe_layers

  // gpt-oss: the clamped GLU (experts::ClampedSwiGlu) and MXFP4 expert weights.
  float swiglu_limit = 7.0f;    ///< clamp of gate (above) and up (both sides)
  float swiglu_alpha = 1.702f;  ///< the sigmoid's slope (transformers v5 "swiglu_alpha")
  /// quantization_config.quant_method "mxfp4": the experts' weights are stored as
  /// *_blocks / *_scales (FP4 E2M1 values in 32-blocks with an E8M0 scale), dequantised on load.
  bool mxfp4 = false;

  // ERNIE 4.5 use_bias: biases in the routed and shared experts' projections.
  bool use_bias = false;

  // FP8 block quantisation ("quantization_config" with quant_method "fp8", as DeepSeek-V3 and
  // the Qwen3 FP8 releases have it), 0 when absent.
  Index fp8_block_rows = 0;
  Index fp8_block_cols = 0;

  /// Keys that config.json lacked and that took the family's default (reported by the loader,
  /// an error under HfLoadOptions::strict).
  std::vector<std::string> defaulted_keys;
  /// Top-level keys of config.json that transformers' configuration class of the family does
  /// not know (detail::hf_known_keys): most often a misspelt key whose setting then silently
  /// took its default. Reported like defaulted_keys.
  std::vector<std::string> unknown_keys;
  /// Keys that config.json sets to a value transformers' modeling code of the family ignores
  /// although it would change the layer (e.g. DeepSeek-V2's norm_topk_prob true, MiniMax-M2's
  /// scoring_func): moe follows transformers, and the loader reports each like unknown_keys.
  std::vector<std::string> ignored_settings;

  /// The config.json "model_type".
  char const* model_type() const noexcept { return hf_model_type(family); }

  /// Do the experts' projections have biases (gpt-oss always; ERNIE 4.5 with use_bias)?
  bool has_expert_biases() const noexcept {
    return family == HfFamily::kGptOss || (family == HfFamily::kErnie45Moe && use_bias);
  }
  /// Does the router projection have a bias (gpt-oss router.bias)?
  bool has_router_bias() const noexcept { return family == HfFamily::kGptOss; }

  /// Width of the shared expert: shared_expert_intermediate_size (Qwen2-MoE, Qwen3-Next),
  /// n_shared_experts * expert_intermediate_size (DeepSeek-V3, GLM-4.5, DeepSeek-V2, ERNIE 4.5),
  /// 0 for the other families.
  Index shared_intermediate_size() const noexcept {
    switch (family) {
      case HfFamily::kQwen2Moe:
      case HfFamily::kQwen3Next:
        return shared_expert_intermediate_size;
      case HfFamily::kDeepseekV3:
      case HfFamily::kGlm4Moe:
      case HfFamily::kDeepseekV2:
      case HfFamily::kErnie45Moe:
        return n_shared_experts * expert_intermediate_size;
      case HfFamily::kLlama4:
        return expert_intermediate_size;  // one shared expert of the experts' width
      default:
        return 0;
    }
  }

  /// Does the shared expert have a sigmoid gate (shared_expert_gate.weight)? Qwen2-MoE and
  /// Qwen3-Next.
  bool has_shared_expert_gate() const noexcept {
    return family == HfFamily::kQwen2Moe || family == HfFamily::kQwen3Next;
  }

  /// Does the router have a selection-only bias (e_score_correction_bias)? DeepSeek-V3,
  /// GLM-4.5, MiniMax-M2, ERNIE 4.5.
  bool has_selection_bias() const noexcept {
    return family == HfFamily::kDeepseekV3 || family == HfFamily::kGlm4Moe ||
           family == HfFamily::kMinimaxM2 || family == HfFamily::kErnie45Moe;
  }

  /// Is decoder layer `layer` an MoE layer (as transformers decides it)? Mixtral, OLMoE and
  /// MiniMax-M2: every layer. Qwen2/3-MoE and Qwen3-Next: layer not in mlp_only_layers, E > 0
  /// and (layer + 1) % decoder_sparse_step == 0. DeepSeek-V3: layer >= first_k_dense_replace
  /// and layer % moe_layer_freq == 0. GLM-4.5 and DeepSeek-V2: layer >= first_k_dense_replace
  /// (transformers reads no moe_layer_freq for them). ERNIE 4.5: (layer + 1) %
  /// moe_layer_interval == 0 and moe_layer_start_index <= layer <= moe_layer_end_index (-1: the
  /// last layer). Layers outside [0, num_hidden_layers) are not layers at all.
  bool is_moe_layer(Index layer) const { return dense_reason(layer).empty(); }

  /// Empty for an MoE layer; otherwise why `layer` is not one (for error messages).
  std::string dense_reason(Index layer) const {
    using detail::concat;
    if (layer < 0) return concat("layer ", layer, " is negative");
    if (num_hidden_layers >= 0 && layer >= num_hidden_layers) {
      return concat("layer ", layer, " does not exist: num_hidden_layers = ", num_hidden_layers,
                    " (layers 0 to ", num_hidden_layers - 1, ")");
    }
    switch (family) {
      case HfFamily::kMixtral:
      case HfFamily::kOlmoe:
      case HfFamily::kMinimaxM2:
      case HfFamily::kGptOss:
        return {};
      case HfFamily::kLlama4:
        if (moe_layers_given) {
          if (std::find(moe_layers.begin(), moe_layers.end(), layer) == moe_layers.end()) {
            return concat("layer ", layer, " is a dense MLP layer: it is not listed in moe_layers");
          }
          return {};
        }
        if ((layer + 1) % interleave_moe_layer_step != 0) {
          return concat("layer ", layer, " is a dense MLP layer: interleave_moe_layer_step = ",
                        interleave_moe_layer_step,
                        " makes layer L an MoE layer only when (L + 1) % ",
                        interleave_moe_layer_step, " == 0");
        }
        return {};
      case HfFamily::kQwen2Moe:
      case HfFamily::kQwen3Moe:
      case HfFamily::kQwen3Next:
        if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) !=
            mlp_only_layers.end()) {
          return concat("layer ", layer, " is a dense MLP layer: it is listed in mlp_only_layers");
        }
        if (num_experts == 0) return concat("every layer is dense: num_experts = 0");
        if ((layer + 1) % decoder_sparse_step != 0) {
          return concat(
              "layer ", layer, " is a dense MLP layer: decoder_sparse_step = ", decoder_sparse_step,
              " makes layer L an MoE layer only when (L + 1) % ", decoder_sparse_step, " == 0");
        }
        return {};
      case HfFamily::kDeepseekV3:
        if (layer < first_k_dense_replace) {
          return concat("layer ", layer,
                        " is a dense MLP layer: first_k_dense_replace = ", first_k_dense_replace,
                        " makes layers 0 to ", first_k_dense_replace - 1, " dense");
        }
        if (layer % moe_layer_freq != 0) {
          return concat("layer ", layer, " is a dense MLP layer: moe_layer_freq = ", moe_layer_freq,
                        " makes layer L an MoE layer only when L % ", moe_layer_freq, " == 0");
        }
        return {};
      case HfFamily::kGlm4Moe:
      case HfFamily::kDeepseekV2:
        if (layer < first_k_dense_replace) {
          return concat("layer ", layer,
                        " is a dense MLP layer: first_k_dense_replace = ", first_k_dense_replace,
                        " makes layers 0 to ", first_k_dense_replace - 1, " dense");
        }
        return {};
      case HfFamily::kErnie45Moe: {
        if (layer < moe_layer_start_index) {
          return concat("layer ", layer,
                        " is a dense MLP layer: moe_layer_start_index = ", moe_layer_start_index,
                        " makes layers 0 to ", moe_layer_start_index - 1, " dense");
        }
        Index const end = moe_layer_end_index == -1 ? num_hidden_layers - 1 : moe_layer_end_index;
        if (moe_layer_end_index != -1 || num_hidden_layers >= 0) {
          if (layer > end) {
            return concat("layer ", layer,
                          " is a dense MLP layer: moe_layer_end_index = ", moe_layer_end_index,
                          " makes the layers after ", end, " dense");
          }
        }
        if ((layer + 1) % moe_layer_interval != 0) {
          return concat(
              "layer ", layer, " is a dense MLP layer: moe_layer_interval = ", moe_layer_interval,
              " makes layer L an MoE layer only when (L + 1) % ", moe_layer_interval, " == 0");
        }
        return {};
      }
    }
    return {};
  }
};

namespace detail {

struct JsonMember;

/// A parsed JSON value (config files are small: a tree is fine).
struct JsonValue {
  JsonKind kind = JsonKind::kNull;
  std::string text;  ///< string contents, or a number as written
  bool boolean = false;
  JsonNumber number;  ///< is_u64 / value for numbers (number.text is not kept)
  std::vector<JsonValue> items;
  std::vector<JsonMember> members;

  /// The member named `key` of an object, or nullptr.
  JsonValue const* member(std::string_view key) const;
};

/// One "key": value pair of an object.
struct JsonMember {
  std::string key;
  JsonValue value;
};

inline JsonValue const* JsonValue::member(std::string_view key) const {
  for (JsonMember const& m : members) {
    if (m.key == key) return &m.value;
  }
  return nullptr;
}

inline JsonValue parse_json_value(JsonCursor& cur) {
  JsonValue v;
  v.kind = cur.peek();
  switch (v.kind) {
    case JsonKind::kObject: {
      cur.begin_object();
      std::string key;
      bool first = true;
      while (cur.next_member(key, first)) {
        JsonMember m{key, {}};
        m.value = parse_json_value(cur);
        v.members.push_back(std::move(m));
      }
      break;
    }
    case JsonKind::kArray: {
      cur.begin_array();
      bool first = true;
      while (cur.next_element(first)) v.items.push_back(parse_json_value(cur));
      break;
    }
    case JsonKind::kString:
      v.text = cur.read_string();
      break;
    case JsonKind::kNumber:
      v.number = cur.read_number();
      v.text = std::string(v.number.text);
      v.number.text = {};
      break;
    case JsonKind::kBool:
      v.boolean = cur.read_bool();
      break;
    case JsonKind::kNull:
      cur.read_null();
      break;
  }
  return v;
}

/// Whether `key` is a top-level config.json key that transformers knows for `family`: the
/// keys every PretrainedConfig reads or writes (v4 and v5, legacy generation parameters,
/// quantization_config, auto_map, rope settings) and the family's configuration class
/// (configuration_<family>.py, v4.36 to v5; DeepSeek-V3 also its Hub remote code).
inline bool hf_known_key(HfFamily family, std::string_view key) {
  static constexpr std::string_view kCommon[] = {"_attn_implementation_autoset",
                                                 "_commit_hash",
                                                 "_name_or_path",
                                                 "add_cross_attention",
                                                 "architectures",
                                                 "attn_implementation",
                                                 "auto_map",
                                                 "bad_words_ids",
                                                 "begin_suppress_tokens",
                                                 "bos_token_id",
                                                 "chunk_size_feed_forward",
                                                 "cross_attention_hidden_size",
                                                 "decoder_start_token_id",
                                                 "diversity_penalty",
                                                 "do_sample",
                                                 "dtype",
                                                 "early_stopping",
                                                 "encoder_no_repeat_ngram_size",
                                                 "eos_token_id",
                                                 "experts_implementation",
                                                 "exponential_decay_length_penalty",
                                                 "finetuning_task",
                                                 "forced_bos_token_id",
                                                 "forced_eos_token_id",
                                                 "gradient_checkpointing",
                                                 "id2label",
                                                 "is_decoder",
                                                 "is_encoder_decoder",
                                                 "label2id",
                                                 "length_penalty",
                                                 "max_length",
                                                 "min_length",
                                                 "model_type",
                                                 "name_or_path",
                                                 "no_repeat_ngram_size",
                                                 "num_beam_groups",
                                                 "num_beams",
                                                 "num_labels",
                                                 "num_return_sequences",
                                                 "output_attentions",
                                                 "output_hidden_states",
                                                 "output_scores",
                                                 "pad_token_id",
                                                 "per_layer_config",
                                                 "prefix",
                                                 "problem_type",
                                                 "pruned_heads",
                                                 "quantization_config",
                                                 "remove_invalid_values",
                                                 "repetition_penalty",
                                                 "return_dict",
                                                 "return_dict_in_generate",
                                                 "rope_parameters",
                                                 "rope_scaling",
                                                 "rope_theta",
                                                 "sep_token_id",
                                                 "suppress_tokens",
                                                 "task_specific_params",
                                                 "temperature",
                                                 "tf_legacy_loss",
                                                 "tie_encoder_decoder",
                                                 "tie_word_embeddings",
                                                 "tokenizer_class",
                                                 "top_k",
                                                 "top_p",
                                                 "torch_dtype",
                                                 "torchscript",
                                                 "transformers_version",
                                                 "typical_p",
                                                 "use_bfloat16",
                                                 "use_cache"};
  // Model keys shared by the five families' configuration classes.
  static constexpr std::string_view kDecoder[] = {
      "attention_bias",      "attention_dropout",   "head_dim",          "hidden_act",
      "hidden_size",         "initializer_range",   "intermediate_size", "max_position_embeddings",
      "num_attention_heads", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
      "rms_norm_eps",        "vocab_size"};
  static constexpr std::string_view kMixtral[] = {"num_experts",          "num_local_experts",
                                                  "output_router_logits", "router_aux_loss_coef",
                                                  "router_jitter_noise",  "sliding_window"};
  static constexpr std::string_view kQwen[] = {
      "decoder_sparse_step",   "layer_types",
      "max_window_layers",     "mlp_only_layers",
      "moe_intermediate_size", "norm_topk_prob",
      "num_experts",           "num_local_experts",
      "output_router_logits",  "qkv_bias",
      "router_aux_loss_coef",  "shared_expert_intermediate_size",
      "sliding_window",        "use_sliding_window"};
  static constexpr std::string_view kDeepseek[] = {"aux_loss_alpha",
                                                   "ep_size",
                                                   "first_k_dense_replace",
                                                   "kv_lora_rank",
                                                   "moe_intermediate_size",
                                                   "moe_layer_freq",
                                                   "n_group",
                                                   "n_routed_experts",
                                                   "n_shared_experts",
                                                   "norm_topk_prob",
                                                   "num_local_experts",
                                                   "num_nextn_predict_layers",
                                                   "pretraining_tp",
                                                   "q_lora_rank",
                                                   "qk_head_dim",
                                                   "qk_nope_head_dim",
                                                   "qk_rope_head_dim",
                                                   "rope_interleave",
                                                   "routed_scaling_factor",
                                                   "scoring_func",
                                                   "seq_aux",
                                                   "topk_group",
                                                   "topk_method",
                                                   "v_head_dim"};
  static constexpr std::string_view kOlmoe[] = {
      "clip_qkv",          "norm_topk_prob",       "num_experts",
      "num_local_experts", "output_router_logits", "router_aux_loss_coef"};
  // Qwen3-Next: the Qwen keys, its linear-attention (Gated DeltaNet) and rotary keys.
  static constexpr std::string_view kQwen3Next[] = {
      "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
      "linear_num_key_heads",    "linear_num_value_heads", "linear_value_head_dim",
      "partial_rotary_factor"};
  static constexpr std::string_view kGlm4Moe[] = {"first_k_dense_replace",
                                                  "moe_intermediate_size",
                                                  "n_group",
                                                  "n_routed_experts",
                                                  "n_shared_experts",
                                                  "norm_topk_prob",
                                                  "num_local_experts",
                                                  "num_mtp_layers",
                                                  "num_nextn_predict_layers",
                                                  "partial_rotary_factor",
                                                  "routed_scaling_factor",
                                                  "topk_group",
                                                  "use_qk_norm"};
  static constexpr std::string_view kDeepseekV2[] = {"mlp_bias", "num_experts"};  // + kDeepseek
  // MiniMax-M2: the Mixtral keys and the keys of its Hub config.json (remote code).
  static constexpr std::string_view kMinimaxM2[] = {"attn_type_list",  "mtp_transformer_layers",
                                                    "num_mtp_modules", "partial_rotary_factor",
                                                    "qk_norm_type",    "rotary_dim",
                                                    "scoring_func",    "shared_intermediate_size",
                                                    "use_mtp",         "use_qk_norm",
                                                    "use_routing_bias"};
  static constexpr std::string_view kLlama4[] = {"attention_chunk_size",
                                                 "attn_scale",
                                                 "attn_temperature_tuning",
                                                 "cache_implementation",
                                                 "floor_scale",
                                                 "interleave_moe_layer_step",
                                                 "intermediate_size_mlp",
                                                 "layer_types",
                                                 "moe_layers",
                                                 "no_rope_layer_interval",
                                                 "no_rope_layers",
                                                 "num_local_experts",
                                                 "output_router_logits",
                                                 "router_aux_loss_coef",
                                                 "router_jitter_noise",
                                                 "use_qk_norm"};
  static constexpr std::string_view kErnie45Moe[] = {"moe_capacity",
                                                     "moe_gate",
                                                     "moe_intermediate_size",
                                                     "moe_k",
                                                     "moe_layer_end_index",
                                                     "moe_layer_interval",
                                                     "moe_layer_start_index",
                                                     "moe_norm_min",
                                                     "moe_num_experts",
                                                     "moe_num_shared_experts",
                                                     "moe_use_aux_free",
                                                     "num_experts",
                                                     "output_router_logits",
                                                     "router_aux_loss_coef",
                                                     "use_bias"};
  // gpt-oss: GptOssConfig (v4.55 to v5) and the keys of the published config.json files.
  static constexpr std::string_view kGptOss[] = {
      "experts_per_token", "initial_context_length", "layer_types",
      "num_local_experts", "output_router_logits",   "router_aux_loss_coef",
      "sliding_window",    "swiglu_alpha",           "swiglu_limit"};
  auto in = [&](auto const& list) {
    for (std::string_view const k : list) {
      if (k == key) return true;
    }
    return false;
  };
  if (in(kCommon) || in(kDecoder)) return true;
  switch (family) {
    case HfFamily::kMixtral:
      return in(kMixtral);
    case HfFamily::kQwen2Moe:
    case HfFamily::kQwen3Moe:
      return in(kQwen);
    case HfFamily::kDeepseekV3:
      return in(kDeepseek);
    case HfFamily::kOlmoe:
      return in(kOlmoe);
    case HfFamily::kQwen3Next:
      return in(kQwen) || in(kQwen3Next);
    case HfFamily::kGlm4Moe:
      return in(kGlm4Moe);
    case HfFamily::kDeepseekV2:
      return in(kDeepseek) || in(kDeepseekV2);
    case HfFamily::kMinimaxM2:
      return in(kMixtral) || in(kMinimaxM2);
    case HfFamily::kErnie45Moe:
      return in(kErnie45Moe);
    case HfFamily::kLlama4:
      return in(kLlama4);
    case HfFamily::kGptOss:
      return in(kGptOss);
  }
  return false;
}

/// Typed access to the top-level keys of a config.json, with defaults and aliases. A key whose
/// value is null counts as absent (transformers then uses the default as well).
class HfConfigReader {
 public:
  HfConfigReader(JsonValue const& root, std::string source, HfMoeConfig& out)
      : root_(root), source_(std::move(source)), out_(out) {}

  std::string const& source() const { return source_; }

  JsonValue const* find(std::string_view key) const {
    JsonValue const* v = root_.member(key);
    return v == nullptr || v->kind == JsonKind::kNull ? nullptr : v;
  }

  [[noreturn]] void bad(std::string_view key, JsonValue const& v, char const* expected) const {
    std::string shown = v.kind == JsonKind::kString ? printable_name(v.text) : v.text;
    if (v.kind == JsonKind::kBool) shown = v.boolean ? "true" : "false";
    if (!shown.empty()) shown = concat(" (", shown, ")");
    moe::detail::fail("hf: ", source_, ": key \"", key, "\" is ", json_kind_name(v.kind), shown,
                      " but must be ", expected, "; fix config.json");
  }

  Index integer(std::string_view key, JsonValue const& v, Index min_value) const {
    if (v.kind != JsonKind::kNumber || !v.number.is_u64 ||
        v.number.value > static_cast<std::uint64_t>(INT32_MAX)) {
      bad(key, v, "a non-negative integer below 2^31");
    }
    auto const value = static_cast<Index>(v.number.value);
    if (value < min_value) {
      moe::detail::fail("hf: ", source_, ": key \"", key, "\" is ", value,
                        " but must be >= ", min_value, "; fix config.json");
    }
    return value;
  }

  /// The first of `keys` that is present (all present ones must agree), or `fallback`.
  Index integer(std::initializer_list<std::string_view> keys, Index fallback, Index min_value) {
    Index result = fallback;
    std::string_view found;
    for (std::string_view const key : keys) {
      JsonValue const* v = find(key);
      if (v == nullptr) continue;
      Index const value = integer(key, *v, min_value);
      if (!found.empty() && value != result) {
        moe::detail::fail("hf: ", source_, ": keys \"", found, "\" = ", result, " and \"", key,
                          "\" = ", value,
                          " name the same setting but disagree; keep one of them in config.json");
      }
      if (found.empty()) result = value;
      found = key;
    }
    if (found.empty()) out_.defaulted_keys.emplace_back(*keys.begin());
    return result;
  }

  bool boolean(std::string_view key, bool fallback) {
    JsonValue const* v = find(key);
    if (v == nullptr) {
      out_.defaulted_keys.emplace_back(key);
      return fallback;
    }
    if (v->kind != JsonKind::kBool) bad(key, *v, "true or false");
    return v->boolean;
  }

  double number(std::string_view key, double fallback) {
    JsonValue const* v = find(key);
    if (v == nullptr) {
      out_.defaulted_keys.emplace_back(key);
      return fallback;
    }
    if (v->kind != JsonKind::kNumber) bad(key, *v, "a number");
    double value = 0.0;
    auto const [end, ec] = std::from_chars(v->text.data(), v->text.data() + v->text.size(), value);
    if (ec == std::errc::result_out_of_range) {
      bad(key, *v,
          "a number a double can hold (this one is out of range: too large, or so small "
          "that it would read as 0)");
    }
    if (ec != std::errc() || end != v->text.data() + v->text.size() || !std::isfinite(value)) {
      bad(key, *v, "a finite number");
    }
    return value;
  }

  std::string string(std::string_view key, std::string fallback) {
    JsonValue const* v = find(key);
    if (v == nullptr) {
      out_.defaulted_keys.emplace_back(key);
      return fallback;
    }
    if (v->kind != JsonKind::kString) bad(key, *v, "a string");
    return v->text;
  }

  /// Throws unless `key` is present (and not null): for keys whose transformers default (None)
  /// the layer cannot run with; `why` says so.
  void require(std::string_view key, std::string_view why) const {
    if (find(key) == nullptr) {
      moe::detail::fail("hf: ", source_, ": config.json lacks \"", key, "\" (", why,
                        "); set it in config.json");
    }
  }

  /// An integer that may be negative (>= min_value), or `fallback` when absent.
  Index signed_integer(std::string_view key, Index fallback, Index min_value) {
    JsonValue const* v = find(key);
    if (v == nullptr) {
      out_.defaulted_keys.emplace_back(key);
      return fallback;
    }
    if (v->kind == JsonKind::kNumber && !v->number.is_u64 && !v->text.empty() &&
        v->text[0] == '-') {
      Index value = 0;
      auto const [end, ec] =
          std::from_chars(v->text.data(), v->text.data() + v->text.size(), value);
      if (ec == std::errc() && end == v->text.data() + v->text.size() && value >= min_value) {
        return value;
      }
      bad(key, *v, detail::concat("an integer >= ", min_value).c_str());
    }
    return integer(key, *v, min_value < 0 ? 0 : min_value);
  }

  std::vector<Index> integer_list(std::string_view key) {
    JsonValue const* v = find(key);
    std::vector<Index> out;
    if (v == nullptr) {
      out_.defaulted_keys.emplace_back(key);
      return out;
    }
    if (v->kind != JsonKind::kArray) bad(key, *v, "an array of layer indices");
    for (JsonValue const& item : v->items) out.push_back(integer(key, item, 0));
    return out;
  }

 private:
  JsonValue const& root_;
  std::string source_;
  HfMoeConfig& out_;
};

/// RoPE keys of a config.json: transformers v5 keeps them in rope_parameters, v4 in rope_theta,
/// partial_rotary_factor and rope_scaling.
struct HfRope {
  double theta = 10000.0;
  double factor = 1.0;      ///< partial_rotary_factor
  bool factor_set = false;  ///< partial_rotary_factor given (else the family's default applies)
  /// rope_type "yarn" (read only when the caller allows it): transformers'
  /// _compute_yarn_parameters keys.
  bool yarn = false;
  double yarn_factor = 0.0;  ///< factor, else max_position_embeddings / original
  double beta_fast = 32.0, beta_slow = 1.0;
  Index original_max_position = 0;  ///< original_max_position_embeddings
  bool truncate = true;
  /// attention_factor, else (with mscale and mscale_all_dim) get_mscale(s, mscale) /
  /// get_mscale(s, mscale_all_dim), else 0 (the consumer's default 0.1 ln(s) + 1).
  double attention_factor = 0.0;
};

/// Reads rope_parameters.{rope_theta, partial_rotary_factor} or the top-level rope_theta and
/// partial_rotary_factor (`default_theta` when absent), and with `allow_yarn` the YaRN keys of
/// rope_parameters or rope_scaling when their rope_type is "yarn". Throws moe::Error for any
/// other rope_type than "default" (moe's RoPE has no linear, dynamic or llama3 scaling) and for
/// values of the wrong kind.
inline HfRope read_hf_rope(HfConfigReader& r, std::string const& source, double default_theta,
                           bool allow_yarn = false) {
  HfRope out;
  bool theta_set = false;
  auto number_in = [&](JsonValue const& obj, char const* key, double& value) {
    JsonValue const* v = obj.member(key);
    if (v == nullptr || v->kind == JsonKind::kNull) return false;
    if (v->kind != JsonKind::kNumber) r.bad(key, *v, "a number");
    value = std::strtod(v->text.c_str(), nullptr);
    if (!std::isfinite(value)) r.bad(key, *v, "a finite number");
    return true;
  };
  // rope_type / type: "default" (or absent) always; "yarn" when allowed: read its keys.
  auto read_type = [&](JsonValue const& obj, std::string_view where) {
    for (std::string_view const key : {"rope_type", "type"}) {
      JsonValue const* t = obj.member(key);
      if (t == nullptr || (t->kind == JsonKind::kString && t->text == "default")) continue;
      if (allow_yarn && t->kind == JsonKind::kString && t->text == "yarn") {
        out.yarn = true;
        continue;
      }
      moe::detail::fail(
          "hf: ", source, ": ", where, ".", key, " ",
          t->kind == JsonKind::kString ? printable_name(t->text) : std::string("(not a string)"),
          " is not supported: moe's RoPE is the default rope type",
          allow_yarn ? " or YaRN (\"yarn\")" : "");
    }
    if (!out.yarn) return;
    number_in(obj, "factor", out.yarn_factor);
    number_in(obj, "beta_fast", out.beta_fast);
    number_in(obj, "beta_slow", out.beta_slow);
    // A context length: a whole number in [1, 2^31) (checked before any integer conversion).
    auto context = [&](double v, char const* key) {
      if (!(v >= 1.0 && v < 2147483648.0 && v == std::floor(v))) {
        moe::detail::fail("hf: ", source, ": ", where, ".", key, " = ", v,
                          " must be a whole number of tokens in [1, 2^31); fix config.json");
      }
      return static_cast<Index>(v);
    };
    double original = 0.0;
    if (number_in(obj, "original_max_position_embeddings", original)) {
      out.original_max_position = context(original, "original_max_position_embeddings");
    }
    if (JsonValue const* t = obj.member("truncate"); t != nullptr && t->kind != JsonKind::kNull) {
      if (t->kind != JsonKind::kBool) r.bad("truncate", *t, "true or false");
      out.truncate = t->boolean;
    }
    double mscale = 0.0, mscale_all = 0.0;
    number_in(obj, "attention_factor", out.attention_factor);
    number_in(obj, "mscale", mscale);
    number_in(obj, "mscale_all_dim", mscale_all);
    double const max_pos = r.number("max_position_embeddings", 0.0);
    if (out.original_max_position <= 0 && max_pos != 0.0) {
      out.original_max_position = context(max_pos, "max_position_embeddings");
    }
    if (out.yarn_factor <= 0.0 && out.original_max_position > 0) {
      out.yarn_factor = max_pos / static_cast<double>(out.original_max_position);
    }
    if (!(out.yarn_factor > 0.0) || out.original_max_position < 1 || !(out.beta_fast > 0.0) ||
        !(out.beta_slow > 0.0) || out.attention_factor < 0.0) {
      moe::detail::fail("hf: ", source, ": ", where, " is YaRN with factor ", out.yarn_factor,
                        ", original_max_position_embeddings ", out.original_max_position,
                        ", beta_fast ", out.beta_fast, ", beta_slow ", out.beta_slow,
                        "; YaRN needs a factor > 0 (or max_position_embeddings and "
                        "original_max_position_embeddings), positive betas; fix config.json");
    }
    if (out.attention_factor == 0.0 && mscale != 0.0 && mscale_all != 0.0) {
      auto get_mscale = [&](double m) {
        return out.yarn_factor <= 1.0 ? 1.0 : 0.1 * m * std::log(out.yarn_factor) + 1.0;
      };
      out.attention_factor = get_mscale(mscale) / get_mscale(mscale_all);
    }
    // Every value must survive the conversion to float the kernels use.
    auto fits = [](double v) {
      return std::isfinite(v) && std::fabs(v) <= std::numeric_limits<float>::max();
    };
    if (!fits(out.yarn_factor) || !fits(out.beta_fast) || !fits(out.beta_slow) ||
        !fits(out.attention_factor) || out.attention_factor < 0.0) {
      moe::detail::fail("hf: ", source, ": ", where, " is YaRN with factor ", out.yarn_factor,
                        ", beta_fast ", out.beta_fast, ", beta_slow ", out.beta_slow,
                        ", attention factor ", out.attention_factor,
                        "; they must be finite floats (the attention factor >= 0); fix "
                        "config.json");
    }
  };
  if (JsonValue const* rp = r.find("rope_parameters")) {
    if (rp->kind != JsonKind::kObject) r.bad("rope_parameters", *rp, "an object");
    read_type(*rp, "rope_parameters");
    theta_set = number_in(*rp, "rope_theta", out.theta);
    out.factor_set = number_in(*rp, "partial_rotary_factor", out.factor);
  }
  if (JsonValue const* rs = r.find("rope_scaling")) {
    if (rs->kind != JsonKind::kObject) r.bad("rope_scaling", *rs, "an object or null");
    read_type(*rs, "rope_scaling");
  }
  if (!theta_set) out.theta = r.number("rope_theta", default_theta);
  if (!out.factor_set && r.find("partial_rotary_factor") != nullptr) {
    out.factor = r.number("partial_rotary_factor", 1.0);
    out.factor_set = true;
  }
  return out;
}

/// Checks the parsed sizes against each other; `where` names config.json.
inline void validate_hf_config(HfMoeConfig const& c, std::string const& where) {
  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("hf: ", where, ": ", parts..., "; fix config.json");
  };
  char const* const experts_key = hf_experts_key(c.family);
  char const* const width_key = hf_width_key(c.family);
  char const* const k_key = c.family == HfFamily::kErnie45Moe ? "moe_k" : "num_experts_per_tok";
  fail_if(c.hidden_size < 1, "hidden_size = ", c.hidden_size, " must be >= 1");
  fail_if(c.expert_intermediate_size < 1, width_key, " = ", c.expert_intermediate_size,
          " must be >= 1");
  bool const may_be_dense = c.family == HfFamily::kQwen2Moe || c.family == HfFamily::kQwen3Moe ||
                            c.family == HfFamily::kQwen3Next;
  fail_if(c.num_experts < (may_be_dense ? 0 : 1), experts_key, " = ", c.num_experts,
          " must be >= 1");
  fail_if(c.num_experts > 0 && (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts),
          k_key, " = ", c.num_experts_per_tok, " must be in [1, ", experts_key, " = ",
          c.num_experts, "]");
  fail_if(c.hidden_act != "silu" && c.hidden_act != "swish", "hidden_act ",
          printable_name(c.hidden_act),
          " is not supported: moe's preset layers have SwiGLU experts, which need \"silu\"");
  if (c.family == HfFamily::kQwen2Moe || c.family == HfFamily::kQwen3Next) {
    fail_if(c.shared_expert_intermediate_size < 1,
            "shared_expert_intermediate_size = ", c.shared_expert_intermediate_size,
            " must be >= 1 (", c.model_type(), " has a shared expert)");
  }
  fail_if(c.decoder_sparse_step < 1, "decoder_sparse_step = ", c.decoder_sparse_step,
          " must be >= 1");
  bool const grouped = c.family == HfFamily::kDeepseekV3 || c.family == HfFamily::kGlm4Moe ||
                       c.family == HfFamily::kDeepseekV2;
  if (grouped) {
    fail_if(c.moe_layer_freq < 1, "moe_layer_freq = ", c.moe_layer_freq, " must be >= 1");
    fail_if(c.n_group < 1 || c.num_experts % c.n_group != 0, "n_group = ", c.n_group,
            " must divide n_routed_experts = ", c.num_experts);
    fail_if(c.topk_group < 1 || c.topk_group > c.n_group, "topk_group = ", c.topk_group,
            " must be in [1, n_group = ", c.n_group, "]");
    fail_if(c.num_experts_per_tok > c.topk_group * (c.num_experts / c.n_group),
            "num_experts_per_tok = ", c.num_experts_per_tok, " exceeds the ",
            c.topk_group * (c.num_experts / c.n_group), " experts of the topk_group kept groups");
    fail_if(!(c.routed_scaling_factor > 0.0f && c.routed_scaling_factor <= 1e6f),
            "routed_scaling_factor = ", c.routed_scaling_factor, " must be in (0, 1e6]");
  }
  if (c.family == HfFamily::kDeepseekV2) {
    fail_if(c.scoring_func != "softmax", "scoring_func ", printable_name(c.scoring_func),
            " is not supported: DeepSeek-V2's gate scores with \"softmax\"");
    fail_if(c.topk_method != "greedy" && c.topk_method != "group_limited_greedy", "topk_method ",
            printable_name(c.topk_method),
            " is not supported: DeepSeek-V2's gate implements \"greedy\" and "
            "\"group_limited_greedy\"");
    fail_if(c.topk_method == "greedy" && (c.n_group != 1 || c.topk_group != 1),
            "topk_method \"greedy\" routes without groups, but n_group = ", c.n_group,
            " and topk_group = ", c.topk_group, " (moe keeps them 1 for greedy)");
  }
  if (c.family == HfFamily::kErnie45Moe) {
    fail_if(c.moe_layer_start_index < 0, "moe_layer_start_index = ", c.moe_layer_start_index,
            " must be >= 0");
    fail_if(c.moe_layer_end_index < -1, "moe_layer_end_index = ", c.moe_layer_end_index,
            " must be >= 0 (or -1: the last layer)");
    fail_if(c.moe_layer_interval < 1, "moe_layer_interval = ", c.moe_layer_interval,
            " must be >= 1");
    fail_if(!(c.moe_norm_min >= 0.0f && c.moe_norm_min <= 1.0f), "moe_norm_min = ", c.moe_norm_min,
            " must be in [0, 1]");
  }
  if (c.family == HfFamily::kGptOss) {
    fail_if(!(c.swiglu_limit > 0.0f && std::isfinite(c.swiglu_limit)),
            "swiglu_limit = ", c.swiglu_limit, " must be finite and > 0 (gpt-oss: 7.0)");
    fail_if(!(c.swiglu_alpha > 0.0f && std::isfinite(c.swiglu_alpha)),
            "swiglu_alpha = ", c.swiglu_alpha, " must be finite and > 0 (gpt-oss: 1.702)");
    fail_if(c.mxfp4 && (c.hidden_size % 32 != 0 || c.expert_intermediate_size % 32 != 0),
            "MXFP4 experts need hidden_size = ", c.hidden_size,
            " and intermediate_size = ", c.expert_intermediate_size,
            " to be multiples of 32 (the blocks' size)");
  }
  if (c.family == HfFamily::kDeepseekV3) {
    fail_if(c.scoring_func != "sigmoid", "scoring_func ", printable_name(c.scoring_func),
            " is not supported: DeepSeek-V3's gate (and moe's DeepseekV3Moe) scores with "
            "\"sigmoid\"");
    fail_if(c.topk_method != "noaux_tc", "topk_method ", printable_name(c.topk_method),
            " is not supported: DeepSeek-V3's gate implements only \"noaux_tc\" (group-limited "
            "top-k with e_score_correction_bias)");
  }
}

}  // namespace detail

namespace detail {

/// The top-level JSON object of a config.json's text (`source` names it in errors). Throws
/// moe::Error unless it is valid UTF-8, valid JSON, an object, and names no key twice (Python's
/// json module would keep the last one silently).
inline JsonValue parse_config_object(std::string_view text, std::string const& source) {
  std::string const hint = "fix config.json (it must be the model's JSON configuration)";
  if (std::size_t const bad = find_invalid_utf8(text); bad != std::string_view::npos) {
    moe::detail::fail("hf: ", source, ": config.json is not valid UTF-8 (at byte ", bad, "); ",
                      hint);
  }
  JsonCursor cur(text, concat("hf: ", source), "config.json", hint);
  if (JsonKind const kind = cur.peek(); kind != JsonKind::kObject) {
    moe::detail::fail("hf: ", source, ": config.json must be a JSON object, but it is ",
                      json_kind_name(kind), "; ", hint);
  }
  JsonValue root = parse_json_value(cur);
  cur.finish();
  for (std::size_t i = 0; i < root.members.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (root.members[i].key == root.members[j].key) {
        moe::detail::fail("hf: ", source, ": key ", printable_name(root.members[i].key),
                          " appears twice in config.json; keep one of them");
      }
    }
  }
  return root;
}

/// parse(text, source) of the config.json at `path`: the file itself, or `path`/config.json
/// when `path` is a directory (a model directory).
template <class Parse>
auto parse_config_file(std::filesystem::path const& path, Parse parse) {
  std::error_code ec;
  std::filesystem::path const file =
      std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  if (!std::filesystem::exists(file, ec)) {
    moe::detail::fail("hf: '", file.string(),
                      "' does not exist; pass the directory of a Hugging Face model (it holds "
                      "config.json and the safetensors weights)");
  }
  MappedFile const mapped(file, "hf", "a model directory whose config.json is a regular file");
  std::string_view const text(reinterpret_cast<char const*>(mapped.bytes().data()),
                              mapped.bytes().size());
  return parse(text, file.string());
}

}  // namespace detail

/// Parses the text of a config.json. `source` names it in error messages. Reads "model_type"
/// (required: one of hf_model_type_list()) and the family's
/// MoE keys; an absent (or null) key takes the default of the family's transformers config
/// class and is listed in defaulted_keys. Throws moe::Error for invalid JSON, a missing or
/// unsupported model_type, a key of the wrong JSON type, an unsupported hidden_act /
/// scoring_func / topk_method / quantization_config.quant_method (only "fp8" is read), or
/// sizes that do not fit together.
inline HfMoeConfig parse_hf_config(std::string_view text,
                                   std::string const& source = "config.json") {
  using detail::JsonKind;
  detail::JsonValue const root = detail::parse_config_object(text, source);

  HfMoeConfig c;
  // Llama 4's multimodal config.json ("llama4") nests the text model's keys in text_config.
  detail::JsonValue const* keys = &root;
  if (detail::JsonValue const* t = root.member("model_type");
      t != nullptr && t->kind == JsonKind::kString && t->text == "llama4") {
    keys = root.member("text_config");
    if (keys == nullptr || keys->kind != JsonKind::kObject) {
      moe::detail::fail("hf: ", source,
                        ": model_type \"llama4\" needs a \"text_config\" object with the text "
                        "model's keys; fix config.json");
    }
  }
  detail::HfConfigReader r(*keys, source, c);
  detail::JsonValue const* type = keys == &root ? r.find("model_type") : root.member("model_type");
  if (type == nullptr) {
    moe::detail::fail("hf: ", source,
                      ": config.json has no \"model_type\"; it must name the model family (",
                      hf_model_type_list(), ")");
  }
  if (type->kind != JsonKind::kString) r.bad("model_type", *type, "a string");
  bool known = false;
  for (HfFamily const f : kHfFamilies) {
    if (type->text == hf_model_type(f)) c.family = f, known = true;
  }
  if (type->text == "llama4") c.family = HfFamily::kLlama4, known = true;
  if (!known) {
    moe::detail::fail("hf: ", source, ": model_type ", detail::printable_name(type->text),
                      " is not supported; moe loads the MoE layers of ", hf_model_type_list(),
                      " models");
  }

  // Defaults of the transformers configuration classes.
  switch (c.family) {
    case HfFamily::kMixtral:
      c.hidden_size = r.integer({"hidden_size"}, 4096, 1);
      c.expert_intermediate_size = r.integer({"intermediate_size"}, 14336, 1);
      c.num_experts = r.integer({"num_local_experts", "num_experts", "n_routed_experts"}, 8, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 2, 1);
      c.norm_topk_prob = true;  // MixtralSparseMoeBlock always renormalises
      break;
    case HfFamily::kQwen2Moe:
      c.hidden_size = r.integer({"hidden_size"}, 2048, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 1408, 1);
      c.shared_expert_intermediate_size = r.integer({"shared_expert_intermediate_size"}, 5632, 1);
      c.num_experts = r.integer({"num_experts", "num_local_experts", "n_routed_experts"}, 60, 0);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 4, 1);
      c.norm_topk_prob = r.boolean("norm_topk_prob", false);
      c.decoder_sparse_step = r.integer({"decoder_sparse_step"}, 1, 1);
      c.mlp_only_layers = r.integer_list("mlp_only_layers");
      break;
    case HfFamily::kQwen3Moe:
      c.hidden_size = r.integer({"hidden_size"}, 2048, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 768, 1);
      c.num_experts = r.integer({"num_experts", "num_local_experts", "n_routed_experts"}, 128, 0);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 8, 1);
      c.norm_topk_prob = r.boolean("norm_topk_prob", false);
      c.decoder_sparse_step = r.integer({"decoder_sparse_step"}, 1, 1);
      c.mlp_only_layers = r.integer_list("mlp_only_layers");
      break;
    case HfFamily::kDeepseekV3:
      c.hidden_size = r.integer({"hidden_size"}, 7168, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 2048, 1);
      c.num_experts = r.integer({"n_routed_experts", "num_experts", "num_local_experts"}, 256, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 8, 1);
      c.norm_topk_prob = r.boolean("norm_topk_prob", true);
      c.n_shared_experts = r.integer({"n_shared_experts"}, 1, 0);
      c.n_group = r.integer({"n_group"}, 8, 1);
      c.topk_group = r.integer({"topk_group"}, 4, 1);
      c.routed_scaling_factor = static_cast<float>(r.number("routed_scaling_factor", 2.5));
      c.scoring_func = r.string("scoring_func", "sigmoid");
      c.topk_method = r.string("topk_method", "noaux_tc");
      c.first_k_dense_replace = r.integer({"first_k_dense_replace"}, 3, 0);
      c.moe_layer_freq = r.integer({"moe_layer_freq"}, 1, 1);
      break;
    case HfFamily::kOlmoe:
      c.hidden_size = r.integer({"hidden_size"}, 2048, 1);
      c.expert_intermediate_size = r.integer({"intermediate_size"}, 2048, 1);
      c.num_experts = r.integer({"num_experts", "num_local_experts", "n_routed_experts"}, 64, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 8, 1);
      c.norm_topk_prob = r.boolean("norm_topk_prob", false);
      break;
    case HfFamily::kQwen3Next:
      c.hidden_size = r.integer({"hidden_size"}, 2048, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 512, 1);
      c.shared_expert_intermediate_size = r.integer({"shared_expert_intermediate_size"}, 512, 1);
      c.num_experts = r.integer({"num_experts"}, 512, 0);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 10, 1);
      c.norm_topk_prob = r.boolean("norm_topk_prob", true);
      c.decoder_sparse_step = r.integer({"decoder_sparse_step"}, 1, 1);
      c.mlp_only_layers = r.integer_list("mlp_only_layers");
      break;
    case HfFamily::kGlm4Moe:
      c.hidden_size = r.integer({"hidden_size"}, 4096, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 1408, 1);
      c.num_experts = r.integer({"n_routed_experts", "num_local_experts"}, 128, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 8, 1);
      c.norm_topk_prob = r.boolean("norm_topk_prob", true);
      c.n_shared_experts = r.integer({"n_shared_experts"}, 1, 0);
      c.n_group = r.integer({"n_group"}, 1, 1);
      c.topk_group = r.integer({"topk_group"}, 1, 1);
      c.routed_scaling_factor = static_cast<float>(r.number("routed_scaling_factor", 1.0));
      c.first_k_dense_replace = r.integer({"first_k_dense_replace"}, 1, 0);
      break;
    case HfFamily::kDeepseekV2: {
      c.hidden_size = r.integer({"hidden_size"}, 4096, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 1407, 1);
      c.num_experts = r.integer({"n_routed_experts", "num_experts"}, 64, 1);
      r.require("num_experts_per_tok", "transformers' DeepseekV2Config defaults it to None");
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 0, 1);
      c.n_shared_experts = r.integer({"n_shared_experts"}, 2, 0);
      c.routed_scaling_factor = static_cast<float>(r.number("routed_scaling_factor", 1.0));
      c.topk_method = r.string("topk_method", "greedy");
      if (c.topk_method == "gready") c.topk_method = "greedy";  // DeepSeek's remote spelling
      if (c.topk_method == "group_limited_greedy") {
        r.require("n_group", "topk_method \"group_limited_greedy\" needs it");
        r.require("topk_group", "topk_method \"group_limited_greedy\" needs it");
        c.n_group = r.integer({"n_group"}, 1, 1);
        c.topk_group = r.integer({"topk_group"}, 1, 1);
      }
      c.scoring_func = "softmax";
      if (r.find("scoring_func") != nullptr) c.scoring_func = r.string("scoring_func", "softmax");
      c.first_k_dense_replace = r.integer({"first_k_dense_replace"}, 0, 0);
      c.norm_topk_prob = false;  // transformers' DeepseekV2 never renormalises
      if (detail::JsonValue const* v = r.find("norm_topk_prob")) {
        if (v->kind != JsonKind::kBool) r.bad("norm_topk_prob", *v, "true or false");
        if (v->boolean && c.num_experts_per_tok > 1) {
          c.ignored_settings.push_back(
              "norm_topk_prob = true (transformers' DeepSeek-V2 never renormalises the top-k "
              "weights and always multiplies them by routed_scaling_factor; DeepSeek's remote "
              "code would renormalise instead of scaling)");
        }
      }
      if (detail::JsonValue const* v = r.find("moe_layer_freq")) {
        if (Index const freq = r.integer("moe_layer_freq", *v, 1); freq != 1) {
          c.ignored_settings.push_back(detail::concat(
              "moe_layer_freq = ", freq,
              " (transformers' DeepSeek-V2 makes every layer from first_k_dense_replace on an "
              "MoE layer; DeepSeek's remote code would make only every ",
              freq, "th one)"));
        }
      }
      break;
    }
    case HfFamily::kMinimaxM2:
      c.hidden_size = r.integer({"hidden_size"}, 3072, 1);
      c.expert_intermediate_size = r.integer({"intermediate_size"}, 1536, 1);
      c.num_experts = r.integer({"num_local_experts", "num_experts"}, 256, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 8, 1);
      c.norm_topk_prob = true;  // MiniMaxM2SparseMoeBlock always renormalises
      if (detail::JsonValue const* v = r.find("scoring_func");
          v != nullptr && !(v->kind == JsonKind::kString && v->text == "sigmoid")) {
        c.ignored_settings.push_back(
            detail::concat("scoring_func = ",
                           v->kind == JsonKind::kString ? detail::printable_name(v->text)
                                                        : std::string("(not a string)"),
                           " (transformers' MiniMax-M2 always scores with sigmoid)"));
      }
      if (detail::JsonValue const* v = r.find("use_routing_bias");
          v != nullptr && !(v->kind == JsonKind::kBool && v->boolean)) {
        c.ignored_settings.push_back(
            "use_routing_bias = false (transformers' MiniMax-M2 always adds "
            "e_score_correction_bias for the selection)");
      }
      if (detail::JsonValue const* v = r.find("shared_intermediate_size");
          v != nullptr && !(v->kind == JsonKind::kNumber && v->text == "0")) {
        c.ignored_settings.push_back(
            detail::concat("shared_intermediate_size = ", v->text,
                           " (transformers' MiniMax-M2 has no shared expert)"));
      }
      break;
    case HfFamily::kLlama4:
      c.hidden_size = r.integer({"hidden_size"}, 5120, 1);
      c.expert_intermediate_size = r.integer({"intermediate_size"}, 8192, 1);
      c.num_experts = r.integer({"num_local_experts"}, 16, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok"}, 1, 1);
      c.interleave_moe_layer_step = r.integer({"interleave_moe_layer_step"}, 1, 1);
      if (r.find("moe_layers") != nullptr) {
        c.moe_layers = r.integer_list("moe_layers");
        c.moe_layers_given = true;
      }
      break;
    case HfFamily::kGptOss:
      c.hidden_size = r.integer({"hidden_size"}, 2880, 1);
      c.expert_intermediate_size = r.integer({"intermediate_size"}, 2880, 1);
      c.num_experts = r.integer({"num_local_experts"}, 128, 1);
      c.num_experts_per_tok = r.integer({"num_experts_per_tok", "experts_per_token"}, 4, 1);
      c.norm_topk_prob = true;  // softmax over the k chosen logits
      // transformers v4.5x reads swiglu_limit from the config only in its MXFP4 kernels and
      // hard-codes 7.0 and 1.702 in GptOssExperts; v5 has both as config fields.
      c.swiglu_limit = static_cast<float>(r.number("swiglu_limit", 7.0));
      c.swiglu_alpha = static_cast<float>(r.number("swiglu_alpha", 1.702));
      break;
    case HfFamily::kErnie45Moe: {
      c.hidden_size = r.integer({"hidden_size"}, 2560, 1);
      c.expert_intermediate_size = r.integer({"moe_intermediate_size"}, 1536, 1);
      c.num_experts = r.integer({"moe_num_experts", "num_experts"}, 64, 1);
      c.num_experts_per_tok = r.integer({"moe_k", "num_experts_per_tok"}, 6, 1);
      c.n_shared_experts = r.integer({"moe_num_shared_experts"}, 2, 0);
      c.moe_layer_start_index = r.integer({"moe_layer_start_index"}, 1, 0);
      c.moe_layer_end_index = r.signed_integer("moe_layer_end_index", -1, -1);
      c.moe_layer_interval = r.integer({"moe_layer_interval"}, 1, 1);
      c.moe_norm_min = static_cast<float>(r.number("moe_norm_min", 1e-12));
      c.norm_topk_prob = true;  // the weights are always renormalised (clamped sum)
      c.scoring_func = "softmax";
      c.use_bias = r.boolean("use_bias", false);
      break;
    }
  }
  c.hidden_act = r.string("hidden_act", "silu");
  if (detail::JsonValue const* q = r.find("quantization_config")) {
    if (q->kind != JsonKind::kObject) r.bad("quantization_config", *q, "an object");
    detail::JsonValue const* method = q->member("quant_method");
    std::string const name =
        method != nullptr && method->kind == JsonKind::kString ? method->text : std::string("?");
    if (name == "mxfp4" && c.family == HfFamily::kGptOss) {
      c.mxfp4 = true;
    } else if (name != "fp8") {
      moe::detail::fail("hf: ", source, ": quantization_config.quant_method ",
                        detail::printable_name(name),
                        " is not supported: moe reads F32, BF16 and F16 weights, FP8 "
                        "(quant_method \"fp8\") block-quantised ones and gpt-oss's MXFP4 "
                        "experts; use such a checkpoint");
    }
    if (!c.mxfp4) c.fp8_block_rows = c.fp8_block_cols = 128;
    if (detail::JsonValue const* block = q->member("weight_block_size");
        !c.mxfp4 && block != nullptr && block->kind != JsonKind::kNull) {
      if (block->kind != JsonKind::kArray || block->items.size() != 2) {
        r.bad("quantization_config.weight_block_size", *block, "an array of two integers");
      }
      c.fp8_block_rows = r.integer("quantization_config.weight_block_size", block->items[0], 1);
      c.fp8_block_cols = r.integer("quantization_config.weight_block_size", block->items[1], 1);
    }
  }
  if (detail::JsonValue const* n = r.find("num_hidden_layers")) {
    c.num_hidden_layers = r.integer("num_hidden_layers", *n, 1);
  }
  for (detail::JsonMember const& m : keys->members) {
    if (!detail::hf_known_key(c.family, m.key)) c.unknown_keys.push_back(m.key);
  }
  detail::validate_hf_config(c, source);
  return c;
}

/// Reads and parses `path`: a config.json, or a model directory holding one.
inline HfMoeConfig read_hf_config(std::filesystem::path const& path) {
  return detail::parse_config_file(path, [](std::string_view text, std::string const& source) {
    return parse_hf_config(text, source);
  });
}

namespace detail {

inline void append_json_key(std::string& out, std::string_view key) {
  out += out.size() > 2 ? ",\n  " : "\n  ";
  append_json_string(out, key);
  out += ": ";
}

inline std::string json_float(float value) {
  char buffer[64];
  auto const [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, value);
  std::string text(buffer, ec == std::errc() ? end : buffer);
  // Keep it a JSON float ("2.0", not "2"), as Python's json module writes floats.
  if (text.find_first_of(".eE") == std::string::npos) text += ".0";
  return text;
}

}  // namespace detail

/// The config.json text for `c`: "architectures", "model_type" and the family's MoE keys (the
/// ones parse_hf_config() reads), with "torch_dtype" set to `torch_dtype` when not empty.
/// parse_hf_config(hf_config_json(c)) gives back `c` (apart from defaulted_keys).
inline std::string hf_config_json(HfMoeConfig const& c, std::string_view torch_dtype = {}) {
  using detail::append_json_key;
  std::string out = "{";
  auto int_key = [&](std::string_view key, Index value) {
    append_json_key(out, key);
    out += std::to_string(value);
  };
  auto bool_key = [&](std::string_view key, bool value) {
    append_json_key(out, key);
    out += value ? "true" : "false";
  };
  auto string_key = [&](std::string_view key, std::string_view value) {
    append_json_key(out, key);
    detail::append_json_string(out, value);
  };
  append_json_key(out, "architectures");
  out += "[";
  detail::append_json_string(out, hf_architecture(c.family));
  out += "]";
  string_key("model_type", c.model_type());
  int_key("hidden_size", c.hidden_size);
  string_key("hidden_act", c.hidden_act);
  if (c.num_hidden_layers >= 0) int_key("num_hidden_layers", c.num_hidden_layers);
  auto float_key = [&](std::string_view key, float value) {
    append_json_key(out, key);
    out += detail::json_float(value);
  };
  if (c.family != HfFamily::kErnie45Moe) int_key("num_experts_per_tok", c.num_experts_per_tok);
  switch (c.family) {
    case HfFamily::kMixtral:
      int_key("intermediate_size", c.expert_intermediate_size);
      int_key("num_local_experts", c.num_experts);
      break;
    case HfFamily::kQwen2Moe:
    case HfFamily::kQwen3Moe:
    case HfFamily::kQwen3Next:
      int_key("moe_intermediate_size", c.expert_intermediate_size);
      if (c.family != HfFamily::kQwen3Moe) {
        int_key("shared_expert_intermediate_size", c.shared_expert_intermediate_size);
      }
      int_key("num_experts", c.num_experts);
      bool_key("norm_topk_prob", c.norm_topk_prob);
      int_key("decoder_sparse_step", c.decoder_sparse_step);
      append_json_key(out, "mlp_only_layers");
      out += "[";
      for (std::size_t i = 0; i < c.mlp_only_layers.size(); ++i) {
        if (i > 0) out += ", ";
        out += std::to_string(c.mlp_only_layers[i]);
      }
      out += "]";
      break;
    case HfFamily::kDeepseekV3:
    case HfFamily::kGlm4Moe:  // DeepSeek-V3's keys without scoring_func, topk_method, freq
      int_key("moe_intermediate_size", c.expert_intermediate_size);
      int_key("n_routed_experts", c.num_experts);
      int_key("n_shared_experts", c.n_shared_experts);
      int_key("n_group", c.n_group);
      int_key("topk_group", c.topk_group);
      float_key("routed_scaling_factor", c.routed_scaling_factor);
      bool_key("norm_topk_prob", c.norm_topk_prob);
      if (c.family == HfFamily::kDeepseekV3) {
        string_key("scoring_func", c.scoring_func);
        string_key("topk_method", c.topk_method);
        int_key("moe_layer_freq", c.moe_layer_freq);
      }
      int_key("first_k_dense_replace", c.first_k_dense_replace);
      break;
    case HfFamily::kOlmoe:
      int_key("intermediate_size", c.expert_intermediate_size);
      int_key("num_experts", c.num_experts);
      bool_key("norm_topk_prob", c.norm_topk_prob);
      break;
    case HfFamily::kDeepseekV2:
      int_key("moe_intermediate_size", c.expert_intermediate_size);
      int_key("n_routed_experts", c.num_experts);
      int_key("n_shared_experts", c.n_shared_experts);
      string_key("topk_method", c.topk_method);
      if (c.topk_method == "group_limited_greedy") {
        int_key("n_group", c.n_group);
        int_key("topk_group", c.topk_group);
      }
      float_key("routed_scaling_factor", c.routed_scaling_factor);
      bool_key("norm_topk_prob", false);
      string_key("scoring_func", c.scoring_func);
      int_key("first_k_dense_replace", c.first_k_dense_replace);
      break;
    case HfFamily::kMinimaxM2:
      int_key("intermediate_size", c.expert_intermediate_size);
      int_key("num_local_experts", c.num_experts);
      break;
    case HfFamily::kLlama4:
      int_key("intermediate_size", c.expert_intermediate_size);
      int_key("num_local_experts", c.num_experts);
      int_key("interleave_moe_layer_step", c.interleave_moe_layer_step);
      if (c.moe_layers_given) {
        append_json_key(out, "moe_layers");
        out += "[";
        for (std::size_t i = 0; i < c.moe_layers.size(); ++i) {
          out += detail::concat(i > 0 ? ", " : "", c.moe_layers[i]);
        }
        out += "]";
      }
      break;
    case HfFamily::kGptOss:
      int_key("intermediate_size", c.expert_intermediate_size);
      int_key("num_local_experts", c.num_experts);
      float_key("swiglu_limit", c.swiglu_limit);
      float_key("swiglu_alpha", c.swiglu_alpha);
      break;
    case HfFamily::kErnie45Moe:
      int_key("moe_intermediate_size", c.expert_intermediate_size);
      int_key("moe_num_experts", c.num_experts);
      int_key("moe_k", c.num_experts_per_tok);
      int_key("moe_num_shared_experts", c.n_shared_experts);
      int_key("moe_layer_start_index", c.moe_layer_start_index);
      int_key("moe_layer_end_index", c.moe_layer_end_index);
      int_key("moe_layer_interval", c.moe_layer_interval);
      append_json_key(out, "moe_norm_min");
      out += detail::json_float(c.moe_norm_min);
      bool_key("use_bias", c.use_bias);
      break;
  }
  if (c.mxfp4) {
    append_json_key(out, "quantization_config");
    out +=
        "{\"modules_to_not_convert\": [\"model.layers.*.self_attn\", "
        "\"model.layers.*.mlp.router\", \"model.embed_tokens\", \"lm_head\"], "
        "\"quant_method\": \"mxfp4\"}";
  } else if (c.fp8_block_rows > 0) {
    append_json_key(out, "quantization_config");
    out += detail::concat("{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", ",
                          "\"quant_method\": \"fp8\", \"weight_block_size\": [", c.fp8_block_rows,
                          ", ", c.fp8_block_cols, "]}");
  }
  if (!torch_dtype.empty()) string_key("torch_dtype", torch_dtype);
  out += "\n}\n";
  return out;
}

}  // namespace moe::io
