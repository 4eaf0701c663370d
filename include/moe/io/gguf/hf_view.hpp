// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// A llama.cpp GGUF model seen as a Hugging Face one: the config.json its metadata implies and
/// a checkpoint of its tensors under the Hugging Face names, so that every loader of moe (the
/// MoE layer loader, the whole-model decoder) reads a GGUF file as it reads a model directory.
///
/// Every tensor is viewed in place in the mapped file (an expert of a merged [E, rows, cols]
/// tensor is a slice of it): F32, F16 and BF16 as themselves, a quantized matrix as a U8 view of
/// its block rows marked with its type (moe/io/block_tensor.hpp), which the loaders run as
/// stored or decode (bit-exact with ggml) when moe has no kernel for the type; only 1-D
/// quantized tensors are decoded here. The families whose HfFamilySpec::gguf names a llama.cpp
/// architecture are read: qwen3moe, qwen2moe, olmoe, glm4moe, minimax-m2, ernie4_5-moe, gpt-oss
/// (its split experts as per-expert gate_proj / up_proj / down_proj tensors with biases, which
/// the gpt-oss layer loader reads besides transformers' fused layout) and llama (Mixtral: its
/// q/k rows, which the converter permuted for ggml's interleaved RoPE, are put back).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/io/block_tensor.hpp"
#include "moe/io/gguf/model.hpp"
#include "moe/io/hf/config.hpp"
#include "moe/io/hf/names.hpp"
#include "moe/io/safetensors/file.hpp"
#include "moe/io/safetensors/sharded.hpp"
#include "moe/quant/ggml_dequantize.hpp"
#include "moe/quant/ggml_type.hpp"

namespace moe::io {

/// A GGUF model as a Hugging Face model (gguf_as_hf()).
struct GgufAsHf {
  HfFamily family = HfFamily::kQwen3Moe;
  /// The config.json its metadata implies (parse_hf_config / parse_decoder_config read it).
  std::string config_json;
  /// Its tensors under the Hugging Face names; keeps the GGUF mapping and the decoded buffers
  /// alive.
  std::shared_ptr<ShardedCheckpoint const> checkpoint;
  /// What the reading noticed, one sentence each: tensors decoded to fp32 (by type), GGUF
  /// tensors no Hugging Face name maps to.
  std::vector<std::string> warnings;
  /// What the whole-model decoder needs beyond config.json (models::gguf_decoder_config applies
  /// it): the Gated DeltaNet's input projections split (a qwen3next file of llama.cpp's newer
  /// converter, attn_qkv / attn_gate: DecoderDeltaNet::split_projections), its value heads in
  /// ggml's tiled order (qwen35moe: DeltaNetHeadOrder::kTiled), and the RoPE frequency factors
  /// of rope_freqs.weight (llama4's Llama 3 scaling: DecoderConfig::rope_freq_factors).
  bool deltanet_split_projections = false;
  bool deltanet_tiled_value_heads = false;
  std::vector<float> rope_freq_factors;
};

namespace detail {

/// The block (layer) index L of a GGUF tensor named "blk.L.<rest>", or nullopt.
inline std::optional<Index> gguf_block_of(std::string_view name) {
  return indexed_name(name, "blk.");
}

/// The Hugging Face name of GGUF tensor `name` of a `family` model, or nullopt. A merged
/// expert tensor (blk.L.ffn_*_exps.weight) maps to the per-expert name with "{e}" for the
/// expert.
inline std::optional<std::string> gguf_to_hf_name(HfFamily family, std::string_view name) {
  if (name == "token_embd.weight") return "model.embed_tokens.weight";
  if (name == "output_norm.weight") return "model.norm.weight";
  if (name == "output.weight") return "lm_head.weight";
  std::optional<Index> const block = gguf_block_of(name);
  if (!block) return std::nullopt;
  Index const L = *block;
  std::string_view const rest = name.substr(name.find('.', 4) + 1);
  std::string const p = concat("model.layers.", L, ".");
  HfTensorNames const& n = hf_family(family).names;
  std::string const moe = hf_default_layout(family, L, false).prefix;
  // Attention, norms and dense MLPs: the names every decoding family shares.
  if (rest.starts_with(hf_family(family).gguf.mlp_norm) &&
      rest.substr(hf_family(family).gguf.mlp_norm.size()) == ".weight") {
    return p + "post_attention_layernorm.weight";
  }
  static constexpr std::pair<std::string_view, std::string_view> kLayer[] = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"attn_q.bias", "self_attn.q_proj.bias"},
      {"attn_k.bias", "self_attn.k_proj.bias"},
      {"attn_v.bias", "self_attn.v_proj.bias"},
      {"attn_output.bias", "self_attn.o_proj.bias"},
      {"attn_q_norm.weight", "self_attn.q_norm.weight"},
      {"attn_k_norm.weight", "self_attn.k_norm.weight"},
      {"attn_sinks.weight", "self_attn.sinks"},
      // Multi-head latent attention (deepseek2; attn_k_b / attn_v_b: gguf_as_hf joins them).
      {"attn_q_a.weight", "self_attn.q_a_proj.weight"},
      {"attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"},
      {"attn_q_b.weight", "self_attn.q_b_proj.weight"},
      {"attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"},
      {"attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"},
      {"attn_kv_b.weight", "self_attn.kv_b_proj.weight"},
      // Gated DeltaNet (qwen3next: ssm_in and ssm_ba, or attn_qkv, attn_gate and ssm_ba from
      // llama.cpp's newer converter; qwen35moe: attn_qkv, attn_gate, ssm_beta, ssm_alpha).
      {"ssm_in.weight", "linear_attn.in_proj_qkvz.weight"},
      {"ssm_ba.weight", "linear_attn.in_proj_ba.weight"},
      {"attn_qkv.weight", "linear_attn.in_proj_qkv.weight"},
      {"attn_gate.weight", "linear_attn.in_proj_z.weight"},
      {"ssm_beta.weight", "linear_attn.in_proj_b.weight"},
      {"ssm_alpha.weight", "linear_attn.in_proj_a.weight"},
      {"ssm_conv1d.weight", "linear_attn.conv1d.weight"},
      {"ssm_a", "linear_attn.A_log"},
      {"ssm_dt.bias", "linear_attn.dt_bias"},
      {"ssm_norm.weight", "linear_attn.norm.weight"},
      {"ssm_out.weight", "linear_attn.out_proj.weight"}};
  for (auto const& [gguf, hf] : kLayer) {
    if (rest == gguf) return p + std::string(hf);
  }
  // Dense MLP layers, under the family's module ("mlp.", Llama 4's "feed_forward.").
  std::string const dense(hf_family(family).decoder.dense_module);
  if (rest == "ffn_gate.weight") return p + dense + "gate_proj.weight";
  if (rest == "ffn_up.weight") return p + dense + "up_proj.weight";
  if (rest == "ffn_down.weight") return p + dense + "down_proj.weight";
  // The MoE block, named as the family's HfTensorNames say.
  if (rest == "ffn_gate_inp.weight") return concat(moe, n.router);
  if (rest == "ffn_gate_inp.bias" && hf_family(family).router_bias) {
    return concat(moe, "router.bias");
  }
  if (rest == "exp_probs_b.bias" && !n.selection_bias.empty()) {
    return concat(moe, n.selection_bias);
  }
  if (rest == "ffn_gate_exps.weight") return concat(moe, "experts.{e}.", n.gate, ".weight");
  if (rest == "ffn_up_exps.weight") return concat(moe, "experts.{e}.", n.up, ".weight");
  if (rest == "ffn_down_exps.weight") return concat(moe, "experts.{e}.", n.down, ".weight");
  // gpt-oss's expert biases [E, rows], per expert as ERNIE's use_bias names them.
  if (rest == "ffn_gate_exps.bias") return concat(moe, "experts.{e}.", n.gate, ".bias");
  if (rest == "ffn_up_exps.bias") return concat(moe, "experts.{e}.", n.up, ".bias");
  if (rest == "ffn_down_exps.bias") return concat(moe, "experts.{e}.", n.down, ".bias");
  if (rest == "ffn_gate_shexp.weight") return concat(moe, n.shared_module, "gate_proj.weight");
  if (rest == "ffn_up_shexp.weight") return concat(moe, n.shared_module, "up_proj.weight");
  if (rest == "ffn_down_shexp.weight") return concat(moe, n.shared_module, "down_proj.weight");
  if (rest == "ffn_gate_inp_shexp.weight") return concat(moe, "shared_expert_gate.weight");
  return std::nullopt;
}

/// What a GgufAsHf checkpoint's views point into: the mapped model and the decoded tensors.
struct GgufHolder {
  explicit GgufHolder(GgufModel m) : model(std::move(m)) {}
  GgufModel model;
  std::vector<std::unique_ptr<std::vector<float>>> decoded;
  std::vector<std::unique_ptr<std::vector<std::byte>>> rearranged;  // permuted q/k rows
};

}  // namespace detail

/// Reads the GGUF model `opened` as a Hugging Face model of the family whose
/// HfFamilySpec::gguf.arch is its general.architecture.
///
/// config.json keys from the metadata ({arch} = general.architecture): num_hidden_layers =
/// block_count, hidden_size = embedding_length, the experts' width = expert_feed_forward_length,
/// their count = expert_count, top-k = expert_used_count, norm_topk_prob = expert_weights_norm
/// (else llama.cpp's choice for the architecture), the shared expert's width =
/// expert_shared_feed_forward_length, num_attention_heads = attention.head_count,
/// num_key_value_heads = attention.head_count_kv, head_dim = attention.key_length,
/// rope_theta = rope.freq_base, rms_norm_eps = attention.layer_norm_rms_epsilon,
/// max_position_embeddings = context_length, the dense layers' width = feed_forward_length;
/// vocab_size = the rows of token_embd.weight; tie_word_embeddings when output.weight is
/// absent; q/k/v biases when attn_q.bias is there; mlp_only_layers = the layers without
/// ffn_gate_inp.weight. Throws moe::Error naming the file for an architecture moe does not
/// read, a missing key, or a tensor type that cannot be decoded.
inline GgufAsHf gguf_as_hf(GgufModel opened) {
  auto holder = std::make_shared<detail::GgufHolder>(std::move(opened));
  GgufModel const& model = holder->model;
  GgufFile const& meta = model.metadata();
  std::string const src = meta.display_name();
  std::string_view const arch = meta.string("general.architecture");
  GgufAsHf out;
  bool found = false;
  std::string supported;
  // Several families may share an architecture (deepseek2: DeepSeek-V2 and V3 / Kimi K2); the
  // expert gating function tells them apart (absent: softmax, as llama.cpp assumes for older
  // DeepSeek-2 files).
  std::uint64_t const gating = meta.integer_or(detail::concat(arch, ".expert_gating_func"), 1);
  for (HfFamily const f : kHfFamilies) {
    HfGgufFacts const& g = hf_family(f).gguf;
    if (g.arch.empty()) continue;
    if (supported.find(detail::concat("\"", g.arch, "\"")) == std::string::npos) {
      supported += detail::concat(supported.empty() ? "" : ", ", "\"", g.arch, "\"");
    }
    if (g.arch == arch && (g.gating_func == 0 || g.gating_func == gating)) {
      out.family = f, found = true;
    }
  }
  if (!found && supported.find(detail::concat("\"", arch, "\"")) != std::string::npos) {
    moe::detail::fail("gguf: ", src, ": ", arch, ".expert_gating_func = ", gating,
                      " is not one moe reads for this architecture (1: softmax, DeepSeek-V2; 2: "
                      "sigmoid, DeepSeek-V3 and Kimi K2); the file is corrupt or of a newer model");
  }
  if (!found) {
    moe::detail::fail("gguf: ", src, ": general.architecture ", detail::printable_name(arch),
                      " is not one moe reads yet (it reads ", supported,
                      "); use a Hugging Face checkpoint of the model");
  }
  HfFamilySpec const& spec = hf_family(out.family);
  auto key = [&](std::string_view k) { return detail::concat(arch, ".", k); };
  auto count = [&](std::string_view k) {
    std::uint64_t const v = meta.integer(key(k));
    moe::detail::check(v >= 1 && v < (std::uint64_t{1} << 31), "gguf: ", src, ": ", key(k), " = ",
                       v, " must be in [1, 2^31); the file is corrupt");
    return static_cast<Index>(v);
  };

  // config.json: the family's own key names, so that parse_hf_config reads it as any other.
  detail::HfJsonWriter w;
  w.string("model_type", spec.model_type);
  Index layers = count("block_count");
  if (!spec.gguf.extra_layers_key.empty()) {  // multi-token-prediction layers: not decoded
    layers -= static_cast<Index>(meta.integer_or(key(spec.gguf.extra_layers_key), 0));
    moe::detail::check(layers >= 1, "gguf: ", src, ": ", key("block_count"),
                       " leaves no layer "
                       "beside the ",
                       key(spec.gguf.extra_layers_key), "; the file is corrupt");
  }
  Index const H = count("embedding_length");
  w.integer("num_hidden_layers", layers);
  w.integer("hidden_size", H);
  w.string("hidden_act", "silu");
  w.integer(spec.width_key, count(spec.gguf.width_key));
  w.integer(spec.experts_keys.front(), count("expert_count"));
  w.integer(spec.top_k_keys.front(), count("expert_used_count"));
  if (spec.norm_topk == HfNormTopK::kKey) {
    w.boolean("norm_topk_prob", meta.boolean_or(key("expert_weights_norm"), spec.gguf.norm_topk));
  }
  auto count_or = [&](std::string_view k, Index fallback) {
    return meta.has(key(k)) ? static_cast<Index>(meta.integer(key(k))) : fallback;
  };
  if (spec.shared == HfShared::kGated) {
    w.integer(spec.shared_key, count("expert_shared_feed_forward_length"));
  } else if (spec.shared == HfShared::kCount) {
    w.integer(spec.shared_key, count_or("expert_shared_count", 0));
  }
  if (spec.grouped) {
    w.integer("n_group", count_or("expert_group_count", 1));
    w.integer("topk_group", count_or("expert_group_used_count", 1));
    w.number("routed_scaling_factor",
             static_cast<float>(meta.number_or(key("expert_weights_scale"), 1.0)));
  }
  // Every decoded layer has tensors in the file: a block_count past them (a corrupt header) would
  // otherwise size the config's per-layer lists (layer_types, mlp_only_layers) by it.
  Index blocks_in_file = 0;
  for (std::size_t s = 0; s < model.num_shards(); ++s) {
    for (GgufTensorInfo const& t : model.shard(s).tensors()) {
      if (auto const L = detail::gguf_block_of(t.name))
        blocks_in_file = std::max(blocks_in_file, *L + 1);
    }
  }
  moe::detail::check(layers <= blocks_in_file, "gguf: ", src, ": ", key("block_count"), " = ",
                     layers, " but the file's tensors hold ", blocks_in_file,
                     " blocks (blk.0 to blk.", blocks_in_file - 1,
                     "); the file is corrupt or truncated");
  switch (spec.layer_rule) {
    case HfLayerRule::kSparseStep: {  // the layers without a router are dense
      std::vector<Index> dense;
      for (Index L = 0; L < layers; ++L) {
        if (!model.has_tensor(detail::concat("blk.", L, ".ffn_gate_inp.weight"))) {
          dense.push_back(L);
        }
      }
      w.integers("mlp_only_layers", dense);
      break;
    }
    case HfLayerRule::kFirstK:
    case HfLayerRule::kFirstKFreq:
      w.integer("first_k_dense_replace", count_or("leading_dense_block_count", 0));
      break;
    case HfLayerRule::kRange:
      w.integer("moe_layer_start_index", count_or("leading_dense_block_count", 0));
      w.integer("moe_layer_interval", count_or("interleave_moe_layer_step", 1));
      break;
    case HfLayerRule::kInterleave:  // Llama 4: the layers L with (L + 1) % step == 0
      w.integer("interleave_moe_layer_step", count_or("interleave_moe_layer_step", 1));
      break;
    default:
      break;
  }
  Index const heads = count("attention.head_count");
  bool const mla = spec.decoder.mla;
  // MLA files of llama.cpp's newer converter say 1 KV head (the latent, run as MQA); the
  // attention itself has a key and a value per head.
  Index const kv_heads =
      !mla && meta.has(key("attention.head_count_kv")) ? count("attention.head_count_kv") : heads;
  w.integer("num_attention_heads", heads);
  w.integer("num_key_value_heads", kv_heads);
  if (!mla && meta.has(key("attention.key_length"))) {
    w.integer("head_dim", count("attention.key_length"));
  }
  if (mla) {
    // Older files: key_length = nope + rope and value_length = v per head. Newer ones (attn_k_b
    // and attn_v_b): key_length = kv_lora_rank + rope and value_length = kv_lora_rank, the
    // per-head sizes in key_length_mla / value_length_mla.
    bool const split = meta.has(key("attention.key_length_mla"));
    Index const rope = count("rope.dimension_count");
    Index const qk = count(split ? "attention.key_length_mla" : "attention.key_length");
    moe::detail::check(qk > rope, "gguf: ", src, ": ", key("attention.key_length"),
                       split ? "_mla" : "", " = ", qk, " must exceed ", key("rope.dimension_count"),
                       " = ", rope,
                       " (a head's key is its nope and rope parts); the file is corrupt");
    if (meta.has(key("attention.q_lora_rank")) && meta.integer(key("attention.q_lora_rank")) > 0) {
      w.integer("q_lora_rank", count("attention.q_lora_rank"));
    } else {
      w.raw("q_lora_rank", "null");
    }
    w.integer("kv_lora_rank", count("attention.kv_lora_rank"));
    w.integer("qk_rope_head_dim", rope);
    w.integer("qk_nope_head_dim", qk - rope);
    w.integer("v_head_dim", count(split ? "attention.value_length_mla" : "attention.value_length"));
    if (out.family == HfFamily::kDeepseekV2) {  // group-limited when the file has groups
      w.string("topk_method",
               count_or("expert_group_count", 1) > 1 ? "group_limited_greedy" : "greedy");
    }
  }
  w.number("rope_theta", static_cast<float>(meta.number_or(key("rope.freq_base"), 10000.0)));
  if (spec.decoder.yarn && meta.string_or(key("rope.scaling.type"), "") == "yarn") {
    // llama.cpp reads the factor and the original context; the betas it keeps at 32 and 1
    // (transformers' defaults too), and the family's truncation. DeepSeek's mscale and
    // mscale_all_dim: the converter writes 0.1 mscale_all_dim as yarn_log_multiplier, and the
    // released configs have mscale = mscale_all_dim.
    std::string mscale;
    if (mla && meta.has(key("rope.scaling.yarn_log_multiplier"))) {
      std::string const m = detail::json_float(
          static_cast<float>(meta.number(key("rope.scaling.yarn_log_multiplier")) / 0.1));
      mscale = detail::concat(", \"mscale\": ", m, ", \"mscale_all_dim\": ", m);
    }
    w.raw("rope_scaling",
          detail::concat(
              "{\"rope_type\": \"yarn\", \"factor\": ",
              detail::json_float(static_cast<float>(meta.number(key("rope.scaling.factor")))),
              ", \"original_max_position_embeddings\": ",
              count("rope.scaling.original_context_length"),
              ", \"beta_fast\": 32.0, \"beta_slow\": 1.0, \"truncate\": ",
              spec.decoder.yarn_truncate ? "true" : "false", mscale, "}"));
  }
  w.number("rms_norm_eps",
           static_cast<float>(meta.number(key("attention.layer_norm_rms_epsilon"))));
  if (meta.has(key("context_length"))) {
    w.integer("max_position_embeddings", count("context_length"));
  }
  if (spec.decoder.dense_width > 0 && meta.has(key("feed_forward_length"))) {
    w.integer(spec.decoder.dense_width_key, count("feed_forward_length"));
  }
  if (spec.decoder.gated_deltanet) {
    // The hybrid's layers: linear where the file has a Gated DeltaNet (ssm_out), else full
    // attention; its sizes as llama.cpp's converter writes them.
    std::string types = "[";
    for (Index L = 0; L < layers; ++L) {
      bool const linear = model.has_tensor(detail::concat("blk.", L, ".ssm_out.weight"));
      types +=
          detail::concat(L ? ", " : "", linear ? "\"linear_attention\"" : "\"full_attention\"");
    }
    w.raw("layer_types", types + "]");
    Index const v_heads = count("ssm.time_step_rank"), inner = count("ssm.inner_size");
    moe::detail::check(inner % v_heads == 0, "gguf: ", src, ": ", key("ssm.inner_size"), " = ",
                       inner, " is not a multiple of ", key("ssm.time_step_rank"), " = ", v_heads,
                       " (the value heads); the file is corrupt");
    w.integer("linear_num_key_heads", count("ssm.group_count"));
    w.integer("linear_num_value_heads", v_heads);
    w.integer("linear_key_head_dim", count("ssm.state_size"));
    w.integer("linear_value_head_dim", inner / v_heads);
    w.integer("linear_conv_kernel_dim", count("ssm.conv_kernel"));
    bool split = spec.decoder.deltanet_split_projections;
    for (Index L = 0; L < layers && !split; ++L) {
      split = model.has_tensor(detail::concat("blk.", L, ".attn_qkv.weight"));
    }
    out.deltanet_split_projections = split;
    // llama.cpp's Qwen3.5 converter reorders the value heads from grouped to tiled.
    out.deltanet_tiled_value_heads = spec.decoder.deltanet_split_projections;
  }
  GgufTensorInfo const& embed = model.tensor("token_embd.weight");
  w.integer("vocab_size", embed.shape().front());
  w.boolean("tie_word_embeddings", !model.has_tensor("output.weight"));
  bool const biased = model.has_tensor("blk.0.attn_q.bias");
  switch (spec.decoder.bias) {
    case HfAttentionBias::kQkvKey:
      w.boolean("qkv_bias", biased);
      break;
    case HfAttentionBias::kNone:
      break;
    default:
      w.boolean("attention_bias", biased);
      break;
  }
  if (spec.decoder.qk_norm == HfQkNorm::kUnweightedOnRope) {
    // Llama 4's L2 norm has no tensor: llama.cpp turns it off for the 128-expert model
    // (Maverick, use_qk_norm false) and on otherwise (Scout).
    w.boolean(spec.decoder.qk_norm_key, count("expert_count") != 128);
  } else if (!spec.decoder.qk_norm_key.empty()) {
    w.boolean(spec.decoder.qk_norm_key, model.has_tensor("blk.0.attn_q_norm.weight"));
  }
  if (spec.decoder.rotary != HfRotary::kFull && meta.has(key("rope.dimension_count"))) {
    Index const rotary = count("rope.dimension_count");
    Index const head_dim =
        meta.has(key("attention.key_length")) ? count("attention.key_length") : H / heads;
    if (spec.decoder.rotary == HfRotary::kRotaryDim) {
      w.integer("rotary_dim", rotary);
    } else {  // int(head_dim * factor) must give back `rotary`: aim between two integers
      w.number("partial_rotary_factor",
               rotary >= head_dim ? 1.0f
                                  : static_cast<float>((static_cast<double>(rotary) + 0.5) /
                                                       static_cast<double>(head_dim)));
    }
  }
  if (spec.decoder.sliding != HfSliding::kRefused && meta.has(key("attention.sliding_window"))) {
    w.integer("sliding_window", count("attention.sliding_window"));
  }
  out.config_json = w.finish();

  // The tensors under their Hugging Face names.
  std::vector<TensorView> views;
  Metadata metadata;                           // "moe.quant.<name>" of the block tensors
  std::map<std::string, Index> decoded_types;  // type name -> tensors decoded
  std::map<std::string, Index> block_types;    // type name -> tensors kept as blocks
  constexpr std::size_t npos = std::string::npos;
  std::size_t unmapped = 0;
  std::string first_unmapped;
  // A tensor's values as floats (any type ggml_dequantize decodes).
  auto values_of = [&](GgufTensorInfo const& t) {
    std::vector<float> v(static_cast<std::size_t>(t.num_elements()));
    quant::ggml_dequantize(t.type, t.data, t.num_elements(), v.data());
    return v;
  };
  // A view of values computed here (kept alive by the holder).
  auto computed = [&](std::string name, std::vector<std::int64_t> shape, std::vector<float> v) {
    auto kept = std::make_unique<std::vector<float>>(std::move(v));
    views.push_back(TensorView{std::move(name), Dtype::kF32, std::move(shape),
                               std::as_bytes(std::span<float const>(*kept))});
    holder->decoded.push_back(std::move(kept));
  };
  // The (1 + w) RMSNorms of Qwen3-Next / Qwen3.5: llama.cpp's converter adds the 1 (all but the
  // Gated DeltaNet's own norm); transformers' weights are the file's minus 1.
  bool const one_plus = spec.decoder.gated_deltanet;
  auto one_plus_norm = [&](std::string_view rest) {
    return rest == "output_norm.weight" || rest == "attn_norm.weight" ||
           rest == "attn_q_norm.weight" || rest == "attn_k_norm.weight" ||
           rest == detail::concat(spec.gguf.mlp_norm, ".weight");
  };
  std::map<Index, std::pair<GgufTensorInfo const*, GgufTensorInfo const*>> mla_kv_b;  // k_b, v_b
  for (std::string_view const name : model.names()) {
    GgufTensorInfo const& t = model.tensor(name);
    if (name == "rope_freqs.weight") {  // llama.cpp's Llama 3 RoPE scaling, per frequency
      out.rope_freq_factors = values_of(t);
      continue;
    }
    std::string_view const rest =
        name.starts_with("blk.") ? name.substr(name.find('.', 4) + 1) : name;
    if (mla && (rest == "attn_k_b.weight" || rest == "attn_v_b.weight")) {
      std::string_view const digits = name.substr(4, name.find('.', 4) - 4);
      Index L = 0;
      for (char const ch : digits) {
        moe::detail::check(ch >= '0' && ch <= '9' && L < (Index{1} << 30) && !digits.empty(),
                           "gguf: ", src, ": tensor ", detail::printable_name(name),
                           " has no layer number after blk.; the file is corrupt");
        L = L * 10 + (ch - '0');
      }
      (rest == "attn_k_b.weight" ? mla_kv_b[L].first : mla_kv_b[L].second) = &t;
      continue;
    }
    std::optional<std::string> const hf = detail::gguf_to_hf_name(out.family, name);
    if (!hf) {
      if (unmapped++ == 0) first_unmapped = std::string(name);
      continue;
    }
    std::vector<std::int64_t> shape = t.shape();
    // Tensors llama.cpp's converter changed, back to transformers' values and layouts.
    if (one_plus && one_plus_norm(rest)) {
      std::vector<float> v = values_of(t);
      for (float& x : v) x -= 1.0f;
      computed(*hf, std::move(shape), std::move(v));
      continue;
    }
    if (rest == "ssm_a") {  // -exp(A_log)
      std::vector<float> v = values_of(t);
      for (float& x : v) {
        moe::detail::check(x < 0.0f && std::isfinite(x), "gguf: ", src, ": tensor ",
                           detail::printable_name(name), " holds ", x,
                           "; it is -exp(A_log), negative and finite; the file is corrupt");
        x = std::log(-x);
      }
      computed(*hf, std::move(shape), std::move(v));
      continue;
    }
    if (rest == "ssm_conv1d.weight" && shape.size() == 2) {  // squeezed [C, 1, kernel]
      shape.insert(shape.begin() + 1, 1);
    }
    if (rest == "ssm_ba.weight" && out.deltanet_split_projections) {
      // Per key head g: the b rows of its R value heads, then their a rows. transformers' split
      // layout (in_proj_b, in_proj_a) has them by value head, which whole rows give.
      Index const Hk = count("ssm.group_count"), Hv = count("ssm.time_step_rank"), R = Hv / Hk;
      moe::detail::check(shape.size() == 2 && shape[0] == 2 * Hv && R * Hk == Hv, "gguf: ", src,
                         ": tensor ", detail::printable_name(name), " has shape ",
                         detail::shape_string(shape), "; it needs 2 ", key("ssm.time_step_rank"),
                         " rows; the file is corrupt");
      std::string const base = hf->substr(0, hf->size() - std::string("in_proj_ba.weight").size());
      // Whole rows move: a quantized matrix's block rows stay blocks (U8 views marked with its
      // type, as below); any other type is decoded to fp32 first.
      bool const quantized = quant::ggml_type_info(t.type).quantized;
      std::vector<float> const values = quantized ? std::vector<float>{} : values_of(t);
      std::span<std::byte const> const from =
          quantized ? t.data : std::as_bytes(std::span<float const>(values));
      std::size_t const row = from.size() / static_cast<std::size_t>(shape[0]);
      for (Index part = 0; part < 2; ++part) {  // b, then a
        auto rows = std::make_unique<std::vector<std::byte>>(static_cast<std::size_t>(Hv) * row);
        for (Index g = 0; g < Hk; ++g) {
          for (Index j = 0; j < R; ++j) {
            std::memcpy(rows->data() + static_cast<std::size_t>(g * R + j) * row,
                        from.data() + static_cast<std::size_t>(g * 2 * R + part * R + j) * row,
                        row);
          }
        }
        std::string const part_name = base + (part == 0 ? "in_proj_b.weight" : "in_proj_a.weight");
        if (quantized) metadata[block_type_key(part_name)] = block_type_value(t.type);
        views.push_back(TensorView{part_name,
                                   quantized ? Dtype::kU8 : Dtype::kF32,
                                   {Hv, quantized ? static_cast<std::int64_t>(row) : shape[1]},
                                   *rows});
        holder->rearranged.push_back(std::move(rows));
      }
      if (quantized) {
        ++block_types[std::string(quant::ggml_type_name(t.type))];
      } else if (t.type != quant::GgmlType::kF32) {
        ++decoded_types[std::string(quant::ggml_type_name(t.type))];
      }
      continue;
    }
    if ((name.ends_with("ffn_gate_inp_shexp.weight") ||
         (name.ends_with("exp_probs_b.bias") && spec.names.selection_bias_row)) &&
        shape.size() == 1) {
      shape.insert(shape.begin(), 1);  // [n] in GGUF, [1, n] in transformers
    }
    Dtype dtype = Dtype::kF32;
    std::span<std::byte const> bytes = t.data;
    // A quantized matrix (or merged experts) stays in its blocks, in place: a U8 view of its rows
    // marked with its type (moe/io/block_tensor.hpp); the loaders run it as stored.
    bool const merged = hf->find("{e}") != npos;
    bool const blocks = quant::ggml_type_info(t.type).quantized && !name.ends_with(".bias") &&
                        shape.size() == (merged ? 3u : 2u);
    if (t.type == quant::GgmlType::kF16) {
      dtype = Dtype::kF16;
    } else if (t.type == quant::GgmlType::kBF16) {
      dtype = Dtype::kBf16;
    } else if (blocks) {
      dtype = Dtype::kU8;
      std::string const mark = block_type_value(t.type);
      std::size_t const at = hf->find("{e}");
      if (at == npos) {
        metadata[block_type_key(*hf)] = mark;
      } else {
        for (std::int64_t e = 0; e < shape[0]; ++e) {
          std::string expert_name = *hf;
          expert_name.replace(at, 3, std::to_string(e));
          metadata[block_type_key(expert_name)] = mark;
        }
      }
      ++block_types[std::string(quant::ggml_type_name(t.type))];
      std::int64_t const rows =
          std::accumulate(shape.begin(), shape.end() - 1, std::int64_t{1}, std::multiplies<>());
      shape.back() = rows > 0 ? static_cast<std::int64_t>(bytes.size()) / rows : 0;  // (empty)
    } else if (t.type != quant::GgmlType::kF32) {
      auto values =
          std::make_unique<std::vector<float>>(static_cast<std::size_t>(t.num_elements()));
      quant::ggml_dequantize(t.type, t.data, t.num_elements(), values->data());
      bytes = std::as_bytes(std::span<float const>(*values));
      holder->decoded.push_back(std::move(values));
      ++decoded_types[std::string(quant::ggml_type_name(t.type))];
    }
    if (spec.gguf.permuted_qk &&
        (name.ends_with(".attn_q.weight") || name.ends_with(".attn_k.weight") ||
         name.ends_with(".attn_q.bias") || name.ends_with(".attn_k.bias"))) {
      // llama.cpp's converter interleaved each head's two rotary halves (row (h, half, j) at
      // h d + 2 j + half); put row h d + 2 j + half back at h d + half d / 2 + j.
      bool const is_q = name.find(".attn_q.") != std::string_view::npos;
      Index const groups = is_q ? heads : kv_heads;
      Index const rows = shape.front();
      moe::detail::check(rows % (2 * groups) == 0, "gguf: ", src, ": tensor ",
                         detail::printable_name(name), " has ", rows,
                         " rows, not whole pairs of rows per head; the file is corrupt");
      std::size_t const row = bytes.size() / static_cast<std::size_t>(rows);
      Index const d = rows / groups;
      auto undone = std::make_unique<std::vector<std::byte>>(bytes.size());
      for (Index h = 0; h < groups; ++h) {
        for (Index j = 0; j < d / 2; ++j) {
          for (Index half = 0; half < 2; ++half) {
            std::memcpy(undone->data() + static_cast<std::size_t>(h * d + half * (d / 2) + j) * row,
                        bytes.data() + static_cast<std::size_t>(h * d + 2 * j + half) * row, row);
          }
        }
      }
      bytes = *undone;
      holder->rearranged.push_back(std::move(undone));
    }
    std::size_t const at = hf->find("{e}");
    if (at == std::string::npos) {
      views.push_back(TensorView{*hf, dtype, std::move(shape), bytes});
      continue;
    }
    bool const bias = name.ends_with(".bias");
    moe::detail::check(shape.size() == (bias ? 2u : 3u) && shape[0] > 0, "gguf: ", src, ": tensor ",
                       detail::printable_name(name), " has shape ", detail::shape_string(shape),
                       bias ? " but merged expert biases are 2-D [experts, rows]"
                            : " but merged expert weights are 3-D [experts, rows, cols]");
    std::size_t const per_expert = bytes.size() / static_cast<std::size_t>(shape[0]);
    for (std::int64_t e = 0; e < shape[0]; ++e) {
      std::string expert_name = *hf;
      expert_name.replace(at, 3, std::to_string(e));
      views.push_back(TensorView{
          std::move(expert_name), dtype, std::vector<std::int64_t>(shape.begin() + 1, shape.end()),
          bytes.subspan(static_cast<std::size_t>(e) * per_expert, per_expert)});
    }
  }
  // MLA's kv_b_proj from the newer converter's attn_k_b [H, kv_lora_rank, nope] (each head's
  // k rows transposed) and attn_v_b [H, v, kv_lora_rank]: per head h, rows [h (nope + v), +
  // nope) are k_b[h]^T and the next v rows v_b[h]. Decoded to fp32.
  for (auto const& [L, kv] : mla_kv_b) {
    auto const [kb, vb] = kv;
    std::string const where = detail::concat("blk.", L, ".attn_k_b.weight / attn_v_b.weight");
    moe::detail::check(kb != nullptr && vb != nullptr, "gguf: ", src, ": layer ", L,
                       " has only one of attn_k_b.weight and attn_v_b.weight; the file is corrupt");
    std::vector<std::int64_t> const ks = kb->shape(), vs = vb->shape();
    moe::detail::check(ks.size() == 3 && vs.size() == 3 && ks[0] == vs[0] && ks[1] == vs[2],
                       "gguf: ", src, ": ", where, " have shapes ", detail::shape_string(ks),
                       " and ", detail::shape_string(vs),
                       "; they must be [heads, kv_lora_rank, nope] and [heads, v, kv_lora_rank]");
    std::int64_t const nh = ks[0], R = ks[1], dn = ks[2], dv = vs[1];
    for (GgufTensorInfo const* t : {kb, vb}) {
      if (t->type != quant::GgmlType::kF32)
        ++decoded_types[std::string(quant::ggml_type_name(t->type))];
    }
    std::vector<float> const k = values_of(*kb), v = values_of(*vb);
    std::vector<float> kv_b(static_cast<std::size_t>(nh * (dn + dv) * R));
    for (std::int64_t h = 0; h < nh; ++h) {
      float* head = kv_b.data() + h * (dn + dv) * R;
      for (std::int64_t i = 0; i < dn; ++i) {
        for (std::int64_t r = 0; r < R; ++r) head[i * R + r] = k[(h * R + r) * dn + i];
      }
      std::copy_n(v.data() + h * dv * R, dv * R, head + dn * R);
    }
    computed(detail::concat("model.layers.", L, ".self_attn.kv_b_proj.weight"), {nh * (dn + dv), R},
             std::move(kv_b));
  }
  for (auto const& [type, n] : decoded_types) {
    out.warnings.push_back(detail::concat(n, " ", type,
                                          " tensor(s) decoded to fp32 at load (bit-exact with "
                                          "ggml): moe does not run them as stored in this "
                                          "layout"));
  }
  for (auto const& [type, n] : block_types) {
    quant::GgmlType const t = *quant::parse_ggml_type(type);
    if (experts::native_format(t)) continue;  // runs as stored
    out.warnings.push_back(detail::concat(
        n, " ", type, " tensor(s): moe has no ", type,
        " kernel yet; they are decoded at load (bit-exact with ggml) and, unless another format "
        "is asked for, packed as ",
        experts::name(experts::load_format(t)), " (",
        experts::bits_per_weight(experts::load_format(t)), " bits a weight)"));
  }
  if (unmapped > 0) {
    out.warnings.push_back(detail::concat(unmapped,
                                          " GGUF tensor(s) have no Hugging Face name and are "
                                          "not read (first: ",
                                          detail::printable_name(first_unmapped), ")"));
  }
  SafetensorsFile file =
      SafetensorsFile::from_views(std::move(views), std::move(metadata), holder, src);
  out.checkpoint =
      std::make_shared<ShardedCheckpoint const>(ShardedCheckpoint::from_file(std::move(file), src));
  return out;
}

/// gguf_as_hf of the GGUF model at `path` (a file, or any shard of a split model).
inline GgufAsHf gguf_as_hf(std::filesystem::path const& path) {
  return gguf_as_hf(GgufModel(path));
}

}  // namespace moe::io
