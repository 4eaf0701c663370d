// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// HfMoeConfig (the MoE part of a Hugging Face config.json) and the tools that read and write
/// config.json: the JSON value tree, HfConfigReader (typed keys with defaults and aliases),
/// HfJsonWriter, the RoPE keys. The families' descriptions (moe/io/hf/families/) are written
/// with them; moe/io/hf/config.hpp parses a whole config with the family's description.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/mapped_file.hpp"
#include "moe/io/hf/family.hpp"

namespace moe::io {

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

  /// The family's description (moe/io/hf/families.hpp).
  HfFamilySpec const& spec() const noexcept;
  /// The config.json "model_type".
  char const* model_type() const noexcept;
  /// Do the experts' projections have biases (gpt-oss always; ERNIE 4.5 with use_bias)?
  bool has_expert_biases() const noexcept;
  /// Does the router projection have a bias (gpt-oss router.bias)?
  bool has_router_bias() const noexcept;
  /// Width of the shared expert: shared_expert_intermediate_size (Qwen2-MoE, Qwen3-Next),
  /// n_shared_experts * expert_intermediate_size (DeepSeek-V3, GLM-4.5, DeepSeek-V2, ERNIE 4.5),
  /// expert_intermediate_size (Llama 4), 0 for the other families.
  Index shared_intermediate_size() const noexcept;
  /// Does the shared expert have a sigmoid gate (shared_expert_gate.weight)? Qwen2-MoE and
  /// Qwen3-Next.
  bool has_shared_expert_gate() const noexcept;
  /// Does the router have a selection-only bias (e_score_correction_bias)? DeepSeek-V3,
  /// GLM-4.5, MiniMax-M2, ERNIE 4.5.
  bool has_selection_bias() const noexcept;

  /// Is decoder layer `layer` an MoE layer (as transformers decides it: the family's
  /// HfLayerRule)? Mixtral, OLMoE, MiniMax-M2 and gpt-oss: every layer. Qwen2/3-MoE and
  /// Qwen3-Next: layer not in mlp_only_layers, E > 0 and (layer + 1) % decoder_sparse_step == 0.
  /// DeepSeek-V3: layer >= first_k_dense_replace and layer % moe_layer_freq == 0. GLM-4.5 and
  /// DeepSeek-V2: layer >= first_k_dense_replace (transformers reads no moe_layer_freq for
  /// them). ERNIE 4.5: (layer + 1) % moe_layer_interval == 0 and moe_layer_start_index <= layer
  /// <= moe_layer_end_index (-1: the last layer). Llama 4: layer in moe_layers, else (layer + 1)
  /// % interleave_moe_layer_step == 0. Layers outside [0, num_hidden_layers) are not layers.
  bool is_moe_layer(Index layer) const { return dense_reason(layer).empty(); }

  /// Empty for an MoE layer; otherwise why `layer` is not one (for error messages).
  std::string dense_reason(Index layer) const;
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
  /// Is `key` present with the value null (find() treats that as absent)?
  bool is_null(std::string_view key) const {
    JsonValue const* v = root_.member(key);
    return v != nullptr && v->kind == JsonKind::kNull;
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
    return integer(std::span<std::string_view const>(keys.begin(), keys.size()), fallback,
                   min_value);
  }
  Index integer(std::span<std::string_view const> keys, Index fallback, Index min_value) {
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
  /// rope_type "llama3" (read only when the caller allows it): transformers'
  /// _compute_llama3_parameters keys, all required.
  bool llama3 = false;
  double llama3_factor = 0.0, low_freq_factor = 0.0, high_freq_factor = 0.0;
  Index llama3_original = 0;  ///< original_max_position_embeddings
};

/// Reads rope_parameters.{rope_theta, partial_rotary_factor} or the top-level rope_theta and
/// partial_rotary_factor (`default_theta` when absent), with `allow_yarn` the YaRN keys of
/// rope_parameters or rope_scaling when their rope_type is "yarn", with `allow_llama3` the Llama 3
/// keys when it is "llama3". Throws moe::Error for any other rope_type than "default" (moe's
/// RoPE has no linear or dynamic scaling) and for values of the wrong kind.
inline HfRope read_hf_rope(HfConfigReader& r, std::string const& source, double default_theta,
                           bool allow_yarn = false, bool allow_llama3 = false) {
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
      if (allow_llama3 && t->kind == JsonKind::kString && t->text == "llama3") {
        out.llama3 = true;
        continue;
      }
      moe::detail::fail(
          "hf: ", source, ": ", where, ".", key, " ",
          t->kind == JsonKind::kString ? printable_name(t->text) : std::string("(not a string)"),
          " is not supported: moe's RoPE is the default rope type",
          allow_yarn ? " or YaRN (\"yarn\")" : "", allow_llama3 ? " or Llama 3 (\"llama3\")" : "");
    }
    if (out.llama3) {
      double original = 0.0;
      bool const all = number_in(obj, "factor", out.llama3_factor) &&
                       number_in(obj, "low_freq_factor", out.low_freq_factor) &&
                       number_in(obj, "high_freq_factor", out.high_freq_factor) &&
                       number_in(obj, "original_max_position_embeddings", original);
      if (!all || !(out.llama3_factor > 0.0) || !(out.low_freq_factor > 0.0) ||
          !(out.high_freq_factor >= out.low_freq_factor) ||
          !(original >= 1.0 && original < 2147483648.0 && original == std::floor(original)) ||
          out.llama3_factor > std::numeric_limits<float>::max() ||
          out.high_freq_factor > std::numeric_limits<float>::max()) {
        moe::detail::fail("hf: ", source, ": ", where,
                          " is Llama 3 RoPE scaling; it needs factor > 0, 0 < low_freq_factor <= "
                          "high_freq_factor (finite floats) and a whole "
                          "original_max_position_embeddings in [1, 2^31); fix config.json");
      }
      out.llama3_original = static_cast<Index>(original);
      return;
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

/// The config.json text for `c`: "architectures", "model_type" and the family's MoE keys (the

/// Writes a config.json's top-level object key by key (hf_config_json() and the families'
/// write hooks): Python's json.dumps layout, floats always with a '.' or exponent.
class HfJsonWriter {
 public:
  void integer(std::string_view key, Index value) {
    append_json_key(out_, key);
    out_ += std::to_string(value);
  }
  void boolean(std::string_view key, bool value) {
    append_json_key(out_, key);
    out_ += value ? "true" : "false";
  }
  void string(std::string_view key, std::string_view value) {
    append_json_key(out_, key);
    append_json_string(out_, value);
  }
  void number(std::string_view key, float value) {
    append_json_key(out_, key);
    out_ += json_float(value);
  }
  void integers(std::string_view key, std::vector<Index> const& values) {
    append_json_key(out_, key);
    out_ += "[";
    for (std::size_t i = 0; i < values.size(); ++i) out_ += concat(i > 0 ? ", " : "", values[i]);
    out_ += "]";
  }
  /// `json` as the value of `key`, verbatim.
  void raw(std::string_view key, std::string_view json) {
    append_json_key(out_, key);
    out_ += json;
  }
  /// The finished object (the writer is empty afterwards).
  std::string finish() {
    out_ += "\n}\n";
    return std::exchange(out_, "{");
  }

 private:
  std::string out_ = "{";
};

}  // namespace detail

}  // namespace moe::io
