// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Parsing and writing the MoE part of a Hugging Face config.json (HfMoeConfig) for every
/// family of the registry (moe/io/hf/families.hpp): the common keys here, the family's own
/// keys, defaults and checks from its description.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/hf/config_reader.hpp"
#include "moe/io/hf/families.hpp"
#include "moe/io/hf/family.hpp"

namespace moe::io {

/// The config.json "model_type" of a family ("mixtral", "qwen2_moe", ...).
inline char const* hf_model_type(HfFamily family) noexcept {
  return hf_family(family).model_type.data();  // the literals are NUL-terminated
}

/// The supported model types as a list for messages: "\"mixtral\", \"qwen2_moe\", ... and
/// \"gpt_oss\"".
inline std::string hf_model_type_list() {
  std::string out;
  std::size_t const n = std::size(kHfFamilies);
  for (std::size_t i = 0; i < n; ++i) {
    out += i == 0 ? "" : i + 1 == n ? " and " : ", ";
    out += detail::concat("\"", hf_model_type(kHfFamilies[i]), "\"");
  }
  return out;
}

inline HfFamilySpec const& HfMoeConfig::spec() const noexcept { return hf_family(family); }
inline char const* HfMoeConfig::model_type() const noexcept { return hf_model_type(family); }
inline bool HfMoeConfig::has_expert_biases() const noexcept {
  HfExpertBiases const b = spec().expert_biases;
  return b == HfExpertBiases::kAlways || (b == HfExpertBiases::kUseBias && use_bias);
}
inline bool HfMoeConfig::has_router_bias() const noexcept { return spec().router_bias; }
inline Index HfMoeConfig::shared_intermediate_size() const noexcept {
  switch (spec().shared) {
    case HfShared::kGated:
      return shared_expert_intermediate_size;
    case HfShared::kCount:
      return n_shared_experts * expert_intermediate_size;
    case HfShared::kExpertWidth:
      return expert_intermediate_size;
    case HfShared::kNone:
      break;
  }
  return 0;
}
inline bool HfMoeConfig::has_shared_expert_gate() const noexcept {
  return spec().shared == HfShared::kGated;
}
inline bool HfMoeConfig::has_selection_bias() const noexcept {
  return !spec().names.selection_bias.empty();
}

inline std::string HfMoeConfig::dense_reason(Index layer) const {
  using detail::concat;
  if (layer < 0) return concat("layer ", layer, " is negative");
  if (num_hidden_layers >= 0 && layer >= num_hidden_layers) {
    return concat("layer ", layer, " does not exist: num_hidden_layers = ", num_hidden_layers,
                  " (layers 0 to ", num_hidden_layers - 1, ")");
  }
  auto every = [&](char const* key, Index step, Index offset) -> std::string {
    if ((layer + offset) % step == 0) return {};
    return concat("layer ", layer, " is a dense MLP layer: ", key, " = ", step,
                  " makes layer L an MoE layer only when ", offset == 1 ? "(L + 1)" : "L", " % ",
                  step, " == 0");
  };
  auto first_k = [&]() -> std::string {
    if (layer >= first_k_dense_replace) return {};
    return concat("layer ", layer,
                  " is a dense MLP layer: first_k_dense_replace = ", first_k_dense_replace,
                  " makes layers 0 to ", first_k_dense_replace - 1, " dense");
  };
  switch (spec().layer_rule) {
    case HfLayerRule::kEvery:
      return {};
    case HfLayerRule::kInterleave:
      if (moe_layers_given) {
        if (std::find(moe_layers.begin(), moe_layers.end(), layer) == moe_layers.end()) {
          return concat("layer ", layer, " is a dense MLP layer: it is not listed in moe_layers");
        }
        return {};
      }
      return every("interleave_moe_layer_step", interleave_moe_layer_step, 1);
    case HfLayerRule::kSparseStep:
      if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) !=
          mlp_only_layers.end()) {
        return concat("layer ", layer, " is a dense MLP layer: it is listed in mlp_only_layers");
      }
      if (num_experts == 0) return concat("every layer is dense: num_experts = 0");
      return every("decoder_sparse_step", decoder_sparse_step, 1);
    case HfLayerRule::kFirstKFreq:
      if (std::string why = first_k(); !why.empty()) return why;
      return every("moe_layer_freq", moe_layer_freq, 0);
    case HfLayerRule::kFirstK:
      return first_k();
    case HfLayerRule::kRange: {
      if (layer < moe_layer_start_index) {
        return concat("layer ", layer,
                      " is a dense MLP layer: moe_layer_start_index = ", moe_layer_start_index,
                      " makes layers 0 to ", moe_layer_start_index - 1, " dense");
      }
      Index const end = moe_layer_end_index == -1 ? num_hidden_layers - 1 : moe_layer_end_index;
      if ((moe_layer_end_index != -1 || num_hidden_layers >= 0) && layer > end) {
        return concat("layer ", layer,
                      " is a dense MLP layer: moe_layer_end_index = ", moe_layer_end_index,
                      " makes the layers after ", end, " dense");
      }
      return every("moe_layer_interval", moe_layer_interval, 1);
    }
  }
  return {};
}

namespace detail {

/// The family whose keys a multimodal config.json of model_type `type` nests in text_config
/// (HfFamilySpec::nested_model_type: "llama4", "qwen3_5_moe"), or null.
inline HfFamilySpec const* nesting_family(std::string_view type) {
  for (HfFamily const f : kHfFamilies) {
    HfFamilySpec const& s = hf_family(f);
    if (!s.nested_model_type.empty() && s.nested_model_type == type) return &s;
  }
  return nullptr;
}

/// Whether `key` is a top-level config.json key that transformers knows for `family`: the
/// keys every PretrainedConfig reads or writes (v4 and v5, legacy generation parameters,
/// quantization_config, auto_map, rope settings), the decoder keys every family's
/// configuration class has, the keys parse_hf_config() reads for it, and the family's own
/// (HfFamilySpec::keys and more_keys, from configuration_<family>.py, v4.36 to v5; DeepSeek-V3 also
/// its Hub remote code).
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
  auto in = [&](auto const& list) {
    return std::find(std::begin(list), std::end(list), key) != std::end(list);
  };
  HfFamilySpec const& s = hf_family(family);
  // The parser's own aliases (attribute_map's) are known whatever the class lists.
  return in(kCommon) || in(kDecoder) || in(s.keys) || in(s.more_keys) || in(s.experts_keys) ||
         in(s.top_k_keys) || key == s.width_key || (!s.shared_key.empty() && key == s.shared_key);
}

/// Checks the parsed sizes against each other; `where` names config.json.
inline void validate_hf_config(HfMoeConfig const& c, std::string const& where) {
  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("hf: ", where, ": ", parts..., "; fix config.json");
  };
  HfFamilySpec const& s = c.spec();
  std::string_view const experts_key = s.experts_keys.front();
  std::string_view const k_key = s.top_k_keys.front();
  fail_if(c.hidden_size < 1, "hidden_size = ", c.hidden_size, " must be >= 1");
  fail_if(c.expert_intermediate_size < 1, s.width_key, " = ", c.expert_intermediate_size,
          " must be >= 1");
  fail_if(c.num_experts < (s.may_be_dense ? 0 : 1), experts_key, " = ", c.num_experts,
          " must be >= 1");
  fail_if(c.num_experts > 0 && (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts),
          k_key, " = ", c.num_experts_per_tok, " must be in [1, ", experts_key, " = ",
          c.num_experts, "]");
  fail_if(c.hidden_act != "silu" && c.hidden_act != "swish", "hidden_act ",
          printable_name(c.hidden_act),
          " is not supported: moe's preset layers have SwiGLU experts, which need \"silu\"");
  if (s.shared == HfShared::kGated) {
    fail_if(c.shared_expert_intermediate_size < 1, s.shared_key, " = ",
            c.shared_expert_intermediate_size, " must be >= 1 (", c.model_type(),
            " has a shared expert)");
  }
  fail_if(c.decoder_sparse_step < 1, "decoder_sparse_step = ", c.decoder_sparse_step,
          " must be >= 1");
  if (s.grouped) {
    fail_if(c.moe_layer_freq < 1, "moe_layer_freq = ", c.moe_layer_freq, " must be >= 1");
    fail_if(c.n_group < 1 || c.num_experts % c.n_group != 0, "n_group = ", c.n_group,
            " must divide ", experts_key, " = ", c.num_experts);
    fail_if(c.topk_group < 1 || c.topk_group > c.n_group, "topk_group = ", c.topk_group,
            " must be in [1, n_group = ", c.n_group, "]");
    fail_if(c.num_experts_per_tok > c.topk_group * (c.num_experts / c.n_group),
            "num_experts_per_tok = ", c.num_experts_per_tok, " exceeds the ",
            c.topk_group * (c.num_experts / c.n_group), " experts of the topk_group kept groups");
    fail_if(!(c.routed_scaling_factor > 0.0f && c.routed_scaling_factor <= 1e6f),
            "routed_scaling_factor = ", c.routed_scaling_factor, " must be in (0, 1e6]");
  }
  if (s.layer_rule == HfLayerRule::kRange) {
    fail_if(c.moe_layer_start_index < 0, "moe_layer_start_index = ", c.moe_layer_start_index,
            " must be >= 0");
    fail_if(c.moe_layer_end_index < -1, "moe_layer_end_index = ", c.moe_layer_end_index,
            " must be >= 0 (or -1: the last layer)");
    fail_if(c.moe_layer_interval < 1, "moe_layer_interval = ", c.moe_layer_interval,
            " must be >= 1");
  }
  if (s.validate != nullptr) s.validate(c, where);
}

/// Reads the keys of the family's layer rule (HfFamilySpec::layer_rule).
inline void read_layer_rule(HfConfigReader& r, HfFamilySpec const& s, HfMoeConfig& c) {
  switch (s.layer_rule) {
    case HfLayerRule::kEvery:
      break;
    case HfLayerRule::kSparseStep:
      c.decoder_sparse_step = r.integer({"decoder_sparse_step"}, 1, 1);
      c.mlp_only_layers = r.integer_list("mlp_only_layers");
      break;
    case HfLayerRule::kFirstKFreq:
    case HfLayerRule::kFirstK:
      c.first_k_dense_replace = r.integer({"first_k_dense_replace"}, s.first_k_dense_default, 0);
      if (s.layer_rule == HfLayerRule::kFirstKFreq) {
        c.moe_layer_freq = r.integer({"moe_layer_freq"}, 1, 1);
      }
      break;
    case HfLayerRule::kRange:
      c.moe_layer_start_index = r.integer({"moe_layer_start_index"}, 1, 0);
      c.moe_layer_end_index = r.signed_integer("moe_layer_end_index", -1, -1);
      c.moe_layer_interval = r.integer({"moe_layer_interval"}, 1, 1);
      break;
    case HfLayerRule::kInterleave:
      c.interleave_moe_layer_step = r.integer({"interleave_moe_layer_step"}, 1, 1);
      if (r.find("moe_layers") != nullptr) {
        c.moe_layers = r.integer_list("moe_layers");
        c.moe_layers_given = true;
      }
      break;
  }
}

/// Writes what read_layer_rule() reads.
inline void write_layer_rule(HfJsonWriter& w, HfFamilySpec const& s, HfMoeConfig const& c) {
  switch (s.layer_rule) {
    case HfLayerRule::kEvery:
      break;
    case HfLayerRule::kSparseStep:
      w.integer("decoder_sparse_step", c.decoder_sparse_step);
      w.integers("mlp_only_layers", c.mlp_only_layers);
      break;
    case HfLayerRule::kFirstKFreq:
      w.integer("moe_layer_freq", c.moe_layer_freq);
      [[fallthrough]];
    case HfLayerRule::kFirstK:
      w.integer("first_k_dense_replace", c.first_k_dense_replace);
      break;
    case HfLayerRule::kRange:
      w.integer("moe_layer_start_index", c.moe_layer_start_index);
      w.integer("moe_layer_end_index", c.moe_layer_end_index);
      w.integer("moe_layer_interval", c.moe_layer_interval);
      break;
    case HfLayerRule::kInterleave:
      w.integer("interleave_moe_layer_step", c.interleave_moe_layer_step);
      if (c.moe_layers_given) w.integers("moe_layers", c.moe_layers);
      break;
  }
}

}  // namespace detail

/// Parses the text of a config.json. `source` names it in error messages. Reads "model_type"
/// (required: one of hf_model_type_list()) and the family's MoE keys (its description in
/// moe/io/hf/families/); an absent (or null) key takes the default of the family's
/// transformers config class and is listed in defaulted_keys. Throws moe::Error for invalid
/// JSON, a missing or unsupported model_type, a key of the wrong JSON type, an unsupported
/// hidden_act / scoring_func / topk_method / quantization_config.quant_method (only "fp8" is
/// read, and gpt-oss's "mxfp4"), or sizes that do not fit together.
inline HfMoeConfig parse_hf_config(std::string_view text,
                                   std::string const& source = "config.json") {
  using detail::JsonKind;
  detail::JsonValue const root = detail::parse_config_object(text, source);

  HfMoeConfig c;
  // A multimodal config.json ("llama4", "qwen3_5_moe") nests the text model's keys in
  // text_config (HfFamilySpec::nested_model_type).
  detail::JsonValue const* keys = &root;
  HfFamilySpec const* nested = nullptr;
  if (detail::JsonValue const* t = root.member("model_type");
      t != nullptr && t->kind == JsonKind::kString) {
    nested = detail::nesting_family(t->text);
  }
  if (nested != nullptr) {
    keys = root.member("text_config");
    if (keys == nullptr || keys->kind != JsonKind::kObject) {
      moe::detail::fail("hf: ", source, ": model_type \"", nested->nested_model_type,
                        "\" needs a \"text_config\" object with the text model's keys; fix "
                        "config.json");
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
  if (nested != nullptr) c.family = nested->family, known = true;
  // Kimi K2's config.json names its own model type over DeepSeek-V3's architecture and keys.
  if (type->text == "kimi_k2") c.family = HfFamily::kDeepseekV3, known = true;
  if (!known) {
    moe::detail::fail("hf: ", source, ": model_type ", detail::printable_name(type->text),
                      " is not supported; moe loads the MoE layers of ", hf_model_type_list(),
                      " models");
  }

  // The keys every family has, with the defaults of its transformers configuration class.
  HfFamilySpec const& s = c.spec();
  c.hidden_size = r.integer({"hidden_size"}, s.hidden_size, 1);
  c.expert_intermediate_size = r.integer({s.width_key}, s.width, 1);
  if (s.shared == HfShared::kGated) {
    c.shared_expert_intermediate_size = r.integer({s.shared_key}, s.shared_default, 1);
  }
  c.num_experts = r.integer(s.experts_keys, s.experts, s.may_be_dense ? 0 : 1);
  if (!s.top_k_required.empty()) r.require(s.top_k_keys.front(), s.top_k_required);
  c.num_experts_per_tok = r.integer(s.top_k_keys, s.top_k, 1);
  c.norm_topk_prob =
      s.norm_topk == HfNormTopK::kAlways ||
      (s.norm_topk == HfNormTopK::kKey && r.boolean("norm_topk_prob", s.norm_topk_default));
  if (s.shared == HfShared::kCount) {
    c.n_shared_experts = r.integer({s.shared_key}, s.shared_default, 0);
  }
  if (s.read != nullptr) s.read(r, c);
  detail::read_layer_rule(r, s, c);
  c.hidden_act = r.string("hidden_act", "silu");
  if (detail::JsonValue const* q = r.find("quantization_config")) {
    if (q->kind != JsonKind::kObject) r.bad("quantization_config", *q, "an object");
    detail::JsonValue const* method = q->member("quant_method");
    std::string const name =
        method != nullptr && method->kind == JsonKind::kString ? method->text : std::string("?");
    if (name == "mxfp4" && s.storage == HfExpertStorage::kFusedInterleaved) {
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

/// The config.json text for `c`: "architectures", "model_type" and the family's MoE keys (the
/// ones parse_hf_config() reads), with "torch_dtype" set to `torch_dtype` when not empty.
/// parse_hf_config(hf_config_json(c)) gives back `c` (apart from defaulted_keys).
inline std::string hf_config_json(HfMoeConfig const& c, std::string_view torch_dtype = {}) {
  HfFamilySpec const& s = c.spec();
  detail::HfJsonWriter w;
  std::string architectures = "[";
  detail::append_json_string(architectures, s.architecture);
  w.raw("architectures", architectures + "]");
  w.string("model_type", s.model_type);
  w.integer("hidden_size", c.hidden_size);
  w.string("hidden_act", c.hidden_act);
  if (c.num_hidden_layers >= 0) w.integer("num_hidden_layers", c.num_hidden_layers);
  w.integer(s.width_key, c.expert_intermediate_size);
  w.integer(s.experts_keys.front(), c.num_experts);
  w.integer(s.top_k_keys.front(), c.num_experts_per_tok);
  if (s.norm_topk == HfNormTopK::kKey) w.boolean("norm_topk_prob", c.norm_topk_prob);
  if (s.shared == HfShared::kGated) w.integer(s.shared_key, c.shared_expert_intermediate_size);
  if (s.shared == HfShared::kCount) w.integer(s.shared_key, c.n_shared_experts);
  if (s.write != nullptr) s.write(w, c);
  detail::write_layer_rule(w, s, c);
  if (c.mxfp4) {
    w.raw("quantization_config",
          "{\"modules_to_not_convert\": [\"model.layers.*.self_attn\", "
          "\"model.layers.*.mlp.router\", \"model.embed_tokens\", \"lm_head\"], "
          "\"quant_method\": \"mxfp4\"}");
  } else if (c.fp8_block_rows > 0) {
    w.raw("quantization_config",
          detail::concat("{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", ",
                         "\"quant_method\": \"fp8\", \"weight_block_size\": [", c.fp8_block_rows,
                         ", ", c.fp8_block_cols, "]}"));
  }
  if (!torch_dtype.empty()) w.string("torch_dtype", torch_dtype);
  return w.finish();
}

}  // namespace moe::io
