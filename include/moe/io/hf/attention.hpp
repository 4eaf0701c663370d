// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Qwen3-Next's gated full-attention layer (HF Qwen3NextAttention) from a Hugging Face
/// checkpoint into GatedAttention<gating::ElementwiseGate>, and back.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/gating/sdpa_gate.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/hf/config.hpp"
#include "moe/io/hf/layer.hpp"
#include "moe/io/safetensors.hpp"
#include "moe/layers/gated_attention.hpp"

namespace moe::io {

/// The attention part of a Qwen3-Next config.json (Qwen3NextConfig's defaults for absent keys).
///
/// | field                  | config.json key(s)                                           |
/// |------------------------|--------------------------------------------------------------|
/// | hidden_size (D)        | hidden_size (2048)                                           |
/// | num_attention_heads (H)| num_attention_heads (16)                                     |
/// | num_key_value_heads    | num_key_value_heads (2)                                      |
/// | head_dim (d_h)         | head_dim (256)                                               |
/// | rms_norm_eps           | rms_norm_eps (1e-6): q_norm / k_norm, (1 + w) form           |
/// | rope_theta             | rope_parameters.rope_theta, or rope_theta (10000)            |
/// | partial_rotary_factor  | rope_parameters.partial_rotary_factor, or partial_rotary_factor
/// (0.25) | | layer_types            | layer_types, or every full_attention_interval-th (4) layer
/// full |
///
/// RoPE rotates the first rotary_dim() = int(head_dim * partial_rotary_factor) dimensions of
/// each head (rotate-half within them); only the default rope type (no rope_scaling) is read.
struct HfAttentionConfig {
  Index hidden_size = 2048;
  Index num_attention_heads = 16;
  Index num_key_value_heads = 2;
  Index head_dim = 256;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  float partial_rotary_factor = 0.25f;
  Index num_hidden_layers = 48;
  /// "full_attention" or "linear_attention" per decoder layer.
  std::vector<std::string> layer_types;
  std::vector<std::string> defaulted_keys;  ///< keys that took Qwen3NextConfig's defaults
  std::vector<std::string> unknown_keys;    ///< keys Qwen3NextConfig does not know

  /// Rotated dimensions per head: int(head_dim * partial_rotary_factor), as HF computes it.
  Index rotary_dim() const {
    return static_cast<Index>(static_cast<double>(head_dim) * partial_rotary_factor);
  }

  /// Empty when decoder layer `layer` is a full-attention layer; otherwise why not.
  std::string not_full_attention_reason(Index layer) const {
    using detail::concat;
    if (layer < 0 || layer >= num_hidden_layers) {
      return concat("layer ", layer, " does not exist: num_hidden_layers = ", num_hidden_layers);
    }
    std::string const& kind = layer_types[static_cast<std::size_t>(layer)];
    if (kind == "full_attention") return {};
    std::string full;
    for (std::size_t i = 0; i < layer_types.size() && full.size() < 40; ++i) {
      if (layer_types[i] == "full_attention") full += concat(full.empty() ? "" : ", ", i);
    }
    return concat("layer ", layer, " is a ", kind,
                  " (Gated DeltaNet) layer, which this loader does not read (moe::GatedDeltaNet "
                  "is that layer; load_hf_decoder runs the whole model); its full_attention "
                  "layers are ",
                  full.empty() ? std::string("none") : full + ", ...");
  }

  /// The GatedAttention configuration of one full-attention layer: elementwise sigmoid gate
  /// packed per head in q_proj, (1 + w) RMSNorm on q and k, partial rotate-half RoPE, causal.
  GatedAttentionConfig layer_config() const {
    GatedAttentionConfig g;
    g.d_model = hidden_size;
    g.num_heads = num_attention_heads;
    g.num_kv_heads = num_key_value_heads;
    g.head_dim = head_dim;
    g.gate_layout = GateLayout::kPackedPerHead;
    g.qk_norm = QkNorm::kRmsNormOnePlus;
    g.norm_eps = rms_norm_eps;
    g.rope = true;
    g.rope_theta = rope_theta;
    g.rotary_dim = rotary_dim();
    g.causal = true;
    return g;
  }
};

/// The layer type of a Qwen3-Next full-attention layer.
using Qwen3NextAttention = GatedAttention<gating::ElementwiseGate>;

/// Parses the attention keys of a Qwen3-Next config.json (text; `source` names it in errors).
/// Throws moe::Error for another model_type, invalid JSON, keys of the wrong type, sizes that
/// do not fit (KV heads dividing the heads, an even rotary_dim in [2, head_dim]),
/// attention_bias true, a rope_scaling / rope type other than the default, or layer_types of
/// the wrong length or with an unknown kind.
inline HfAttentionConfig parse_hf_attention_config(std::string_view text,
                                                   std::string const& source = "config.json") {
  using detail::JsonKind;
  detail::JsonValue const root = detail::parse_config_object(text, source);
  HfMoeConfig keys;  // collects the defaulted keys
  detail::HfConfigReader r(root, source, keys);
  detail::JsonValue const* type = r.find("model_type");
  if (type == nullptr || type->kind != JsonKind::kString || type->text != "qwen3_next") {
    moe::detail::fail("hf: ", source, ": model_type ",
                      type == nullptr                   ? std::string("(none)")
                      : type->kind == JsonKind::kString ? detail::printable_name(type->text)
                                                        : std::string("(not a string)"),
                      " has no attention layer moe loads; moe loads the full-attention layers of "
                      "\"qwen3_next\" models");
  }
  HfAttentionConfig c;
  c.hidden_size = r.integer({"hidden_size"}, 2048, 1);
  c.num_attention_heads = r.integer({"num_attention_heads"}, 16, 1);
  c.num_key_value_heads = r.integer({"num_key_value_heads"}, 2, 1);
  c.head_dim = r.integer({"head_dim"}, 256, 1);
  c.rms_norm_eps = static_cast<float>(r.number("rms_norm_eps", 1e-6));
  c.num_hidden_layers = r.integer({"num_hidden_layers"}, 48, 1);
  if (detail::JsonValue const* b = r.find("attention_bias")) {
    if (b->kind != JsonKind::kBool) r.bad("attention_bias", *b, "true or false");
    if (b->boolean) {
      moe::detail::fail("hf: ", source,
                        ": attention_bias = true is not supported: moe's Qwen3-Next attention "
                        "loader reads no projection biases (Qwen3-Next releases set it false)");
    }
  }
  detail::HfRope const rope = detail::read_hf_rope(r, source, 10000.0);
  double const theta = rope.theta, factor = rope.factor_set ? rope.factor : 0.25;
  if (!rope.factor_set) keys.defaulted_keys.emplace_back("partial_rotary_factor");
  c.rope_theta = static_cast<float>(theta);
  c.partial_rotary_factor = static_cast<float>(factor);

  if (detail::JsonValue const* lt = r.find("layer_types")) {
    if (lt->kind != JsonKind::kArray) r.bad("layer_types", *lt, "an array of strings");
    for (detail::JsonValue const& item : lt->items) {
      if (item.kind != JsonKind::kString ||
          (item.text != "full_attention" && item.text != "linear_attention")) {
        r.bad("layer_types", item, "\"full_attention\" or \"linear_attention\" per layer");
      }
      c.layer_types.push_back(item.text);
    }
    if (static_cast<Index>(c.layer_types.size()) != c.num_hidden_layers) {
      moe::detail::fail("hf: ", source, ": layer_types has ", c.layer_types.size(),
                        " entries but num_hidden_layers = ", c.num_hidden_layers,
                        "; give one per layer");
    }
  } else {
    Index const interval = r.integer({"full_attention_interval"}, 4, 1);
    for (Index i = 0; i < c.num_hidden_layers; ++i) {
      c.layer_types.emplace_back((i + 1) % interval != 0 ? "linear_attention" : "full_attention");
    }
  }
  c.defaulted_keys = std::move(keys.defaulted_keys);
  for (detail::JsonMember const& m : root.members) {
    if (!detail::hf_known_key(HfFamily::kQwen3Next, m.key)) c.unknown_keys.push_back(m.key);
  }

  auto fail_if = [&](bool bad, auto const&... parts) {
    if (bad) moe::detail::fail("hf: ", source, ": ", parts..., "; fix config.json");
  };
  fail_if(c.num_attention_heads % c.num_key_value_heads != 0,
          "num_key_value_heads = ", c.num_key_value_heads,
          " does not divide num_attention_heads = ", c.num_attention_heads);
  fail_if(!(c.rms_norm_eps > 0.0f && std::isfinite(c.rms_norm_eps)),
          "rms_norm_eps = ", c.rms_norm_eps, " must be finite and > 0");
  fail_if(!(c.rope_theta >= 1.0f && std::isfinite(c.rope_theta)), "rope_theta = ", c.rope_theta,
          " must be finite and >= 1");
  Index const rd = c.rotary_dim();
  fail_if(!(factor > 0.0 && factor <= 1.0) || rd < 2 || rd % 2 != 0,
          "partial_rotary_factor = ", factor, " gives ", rd,
          " rotated dimensions of head_dim = ", c.head_dim,
          "; they must be an even number in [2, head_dim]");
  return c;
}

/// Reads `path`: a config.json, or a model directory holding one.
inline HfAttentionConfig read_hf_attention_config(std::filesystem::path const& path) {
  return detail::parse_config_file(path, [](std::string_view text, std::string const& source) {
    return parse_hf_attention_config(text, source);
  });
}

/// One tensor of a Qwen3-Next attention layer.
struct HfAttentionTensor {
  std::string name;                 ///< "model.layers.3.self_attn.q_proj.weight", ...
  std::string parameter;            ///< GatedAttention's name: "q_proj.weight", ...
  std::vector<std::int64_t> shape;  ///< on disk
};

/// The tensors of full-attention layer `layer` under `prefix` (empty:
/// "model.layers.L.self_attn."): q_proj [H 2 d_h, D] (per head: its query rows, then its gate
/// rows), k_proj and v_proj [KV d_h, D], o_proj [D, H d_h], q_norm and k_norm [d_h].
inline std::vector<HfAttentionTensor> hf_attention_tensors(HfAttentionConfig const& c, Index layer,
                                                           std::string prefix = {}) {
  if (prefix.empty()) prefix = detail::concat("model.layers.", layer, ".self_attn.");
  std::int64_t const D = c.hidden_size, H = c.num_attention_heads, KV = c.num_key_value_heads,
                     dh = c.head_dim;
  return {{prefix + "q_proj.weight", "q_proj.weight", {H * 2 * dh, D}},
          {prefix + "k_proj.weight", "k_proj.weight", {KV * dh, D}},
          {prefix + "v_proj.weight", "v_proj.weight", {KV * dh, D}},
          {prefix + "o_proj.weight", "o_proj.weight", {D, H * dh}},
          {prefix + "q_norm.weight", "q_norm.weight", {dh}},
          {prefix + "k_norm.weight", "k_norm.weight", {dh}}};
}

/// A loaded attention layer and the names of its tensors.
struct HfAttentionLayer {
  HfAttentionConfig config;
  Index layer_index = 0;
  std::vector<HfAttentionTensor> tensors;  ///< hf_attention_tensors() order
  Qwen3NextAttention layer;
  /// Unknown or defaulted config.json keys (as HfLayer::warnings); strict makes them errors.
  std::vector<std::string> warnings;
};

/// The values of tensor `t` held by `layer`, row-major in t.shape.
inline std::vector<float> hf_attention_values(Qwen3NextAttention const& layer,
                                              HfAttentionTensor const& t) {
  auto flat = [](ConstMatrixView<float> v) {
    return std::vector<float>(v.data, v.data + v.rows * v.cols);
  };
  if (t.parameter == "q_proj.weight") return flat(layer.q_proj());
  if (t.parameter == "k_proj.weight") return flat(layer.k_proj());
  if (t.parameter == "v_proj.weight") return flat(layer.v_proj());
  if (t.parameter == "o_proj.weight") return flat(layer.o_proj());
  std::span<float const> const norm =
      t.parameter == "q_norm.weight" ? layer.q_norm() : layer.k_norm();
  return {norm.begin(), norm.end()};
}

/// The gradient of tensor `t` from the layer's Gradients, row-major in t.shape.
inline std::vector<float> hf_attention_gradient(Qwen3NextAttention::Gradients const& grads,
                                                HfAttentionTensor const& t) {
  auto const copy = [](HugePageVector<float> const& v) {
    return std::vector<float>(v.begin(), v.end());
  };
  if (t.parameter == "q_proj.weight") return copy(grads.q_proj);
  if (t.parameter == "k_proj.weight") return copy(grads.k_proj);
  if (t.parameter == "v_proj.weight") return copy(grads.v_proj);
  if (t.parameter == "o_proj.weight") return copy(grads.o_proj);
  if (t.parameter == "q_norm.weight") return copy(grads.q_norm);
  if (t.parameter == "k_norm.weight") return copy(grads.k_norm);
  moe::detail::fail("hf: no attention parameter named ", detail::printable_name(t.parameter));
}

/// Loads full-attention layer `layer` of the Qwen3-Next model in `model_dir` (config.json plus
/// model.safetensors or an index and its shards) into Qwen3NextAttention. Tensors may be F32,
/// BF16 or F16. `options.prefix` replaces "model.layers.L.self_attn."; `options.strict` makes
/// warnings (unknown or defaulted config.json keys) errors. Throws moe::Error naming the file
/// and tensor for a linear-attention or missing layer, a missing, mis-shaped or mistyped tensor.
inline HfAttentionLayer load_hf_attention(std::filesystem::path const& model_dir, Index layer,
                                          HfLoadOptions const& options = {}) {
  detail::check_model_dir(model_dir);
  HfAttentionLayer out;
  out.config = read_hf_attention_config(model_dir);
  out.layer_index = layer;
  std::string const where = model_dir.string();
  if (std::string const why = out.config.not_full_attention_reason(layer); !why.empty()) {
    moe::detail::fail("hf: ", where, ": cannot load layer ", layer, " as attention: ", why,
                      "; pick a full_attention layer");
  }
  if (!out.config.unknown_keys.empty() || !out.config.defaulted_keys.empty()) {
    auto join = [](std::vector<std::string> const& keys) {
      std::string list;
      for (std::string const& k : keys) list += detail::concat(list.empty() ? "" : ", ", k);
      return list;
    };
    if (!out.config.unknown_keys.empty()) {
      out.warnings.push_back(detail::concat("config.json has key(s) ",
                                            join(out.config.unknown_keys),
                                            " that transformers' Qwen3NextConfig does not know; "
                                            "they are ignored (misspelt?)"));
    }
    if (!out.config.defaulted_keys.empty()) {
      out.warnings.push_back(detail::concat("config.json lacks ", join(out.config.defaulted_keys),
                                            ", which took their transformers defaults"));
    }
  }
  if (options.strict && !out.warnings.empty()) {
    std::string all;
    for (std::string const& w : out.warnings) all += detail::concat(all.empty() ? "" : "; ", w);
    moe::detail::fail("hf: ", where, ": ", all,
                      " (strict loading; fix the checkpoint or load without strict)");
  }
  out.layer = Qwen3NextAttention(out.config.layer_config());
  out.tensors = hf_attention_tensors(out.config, layer, options.prefix);
  ShardedCheckpoint const ckpt = open_checkpoint(model_dir);
  auto params = out.layer.parameters();
  for (HfAttentionTensor const& t : out.tensors) {
    TensorView const* view = ckpt.find(t.name);
    if (view == nullptr) {
      moe::detail::fail("hf: ", ckpt.source(), ": tensor ", detail::printable_name(t.name), " (",
                        detail::shape_string(t.shape), ") is missing; is layer ", layer,
                        " a full-attention layer of this checkpoint, and does config.json belong "
                        "to it?");
    }
    if (view->dtype != Dtype::kF32 && view->dtype != Dtype::kBf16 && view->dtype != Dtype::kF16) {
      moe::detail::fail("hf: ", ckpt.source(), ": tensor ", detail::printable_name(t.name), " is ",
                        dtype_name(view->dtype), "; moe loads F32, BF16 or F16 attention weights");
    }
    if (view->shape != t.shape) {
      moe::detail::fail("hf: ", ckpt.source(), ": tensor ", detail::printable_name(t.name),
                        " has shape ", detail::shape_string(view->shape),
                        " but config.json implies ", detail::shape_string(t.shape),
                        " (hidden_size ", out.config.hidden_size, ", ",
                        out.config.num_attention_heads, " heads, ", out.config.num_key_value_heads,
                        " KV heads, head_dim ", out.config.head_dim,
                        "); check that config.json belongs to these weights");
    }
    std::vector<float> const values = to_float(*view);
    for (auto& p : params) {
      if (p.name == t.parameter) std::copy(values.begin(), values.end(), p.values.begin());
    }
  }
  return out;
}

/// Writes `layer` as full-attention layer `layer_index` of a tiny Qwen3-Next checkpoint in `dir`
/// (created if needed): config.json with the attention keys of `config` (layer_types included)
/// and model.safetensors with the layer's six tensors (F32). Throws moe::Error when the layer
/// does not match `config` or layer_index is not a full-attention layer.
inline void save_hf_attention(std::filesystem::path const& dir, HfAttentionConfig const& config,
                              Index layer_index, Qwen3NextAttention const& layer) {
  std::string const where = dir.string();
  if (std::string const why = config.not_full_attention_reason(layer_index); !why.empty()) {
    moe::detail::fail("hf: ", where, ": cannot save layer ", layer_index, " as attention: ", why);
  }
  GatedAttentionConfig const want = config.layer_config();
  GatedAttentionConfig const& got = layer.config();
  moe::detail::check(got.d_model == want.d_model && got.num_heads == want.num_heads &&
                         got.num_kv_heads == want.num_kv_heads && got.head_dim == want.head_dim &&
                         got.gate_layout == want.gate_layout && got.qk_norm == want.qk_norm &&
                         got.rotary_dim == want.rotary_dim && got.rope == want.rope &&
                         got.rope_theta == want.rope_theta && got.norm_eps == want.norm_eps,
                     "hf: ", where,
                     ": the layer does not match the config (build it from "
                     "config.layer_config())");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  std::string json = "{\n  \"architectures\": [\"Qwen3NextForCausalLM\"],\n";
  json += detail::concat(
      "  \"model_type\": \"qwen3_next\",\n  \"hidden_size\": ", config.hidden_size,
      ",\n  \"num_attention_heads\": ", config.num_attention_heads,
      ",\n  \"num_key_value_heads\": ", config.num_key_value_heads,
      ",\n  \"head_dim\": ", config.head_dim,
      ",\n  \"rms_norm_eps\": ", detail::json_float(config.rms_norm_eps),
      ",\n  \"rope_theta\": ", detail::json_float(config.rope_theta),
      ",\n  \"partial_rotary_factor\": ", detail::json_float(config.partial_rotary_factor),
      ",\n  \"attention_bias\": false,\n  \"num_hidden_layers\": ", config.num_hidden_layers,
      ",\n  \"layer_types\": [");
  for (std::size_t i = 0; i < config.layer_types.size(); ++i) {
    json += detail::concat(i == 0 ? "" : ", ", "\"", config.layer_types[i], "\"");
  }
  json += "]\n}\n";
  detail::write_text_file(dir / "config.json", json);
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  for (HfAttentionTensor const& t : hf_attention_tensors(config, layer_index)) {
    writer.add_f32(t.name, t.shape, hf_attention_values(layer, t));
  }
  writer.save(dir / "model.safetensors");
  std::filesystem::remove(dir / "model.safetensors.index.json", ec);
}

}  // namespace moe::io
