// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// save_gguf_model: a whole decoder checkpoint (a Hugging Face directory, or a GGUF file)
/// written as a llama.cpp GGUF file: the architecture's metadata keys, llama.cpp's tensor names
/// and layouts (merged [E, rows, cols] expert tensors, the "llama" architecture's permuted q/k
/// rows, gpt-oss's split experts), every matrix in the format DecoderOptions chooses. The
/// inverse of io::gguf_as_hf(): the names are found through its mapping, so what this writes,
/// load_gguf_decoder() reads back.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/float16.hpp"
#include "moe/core/types.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/io/block_tensor.hpp"
#include "moe/io/gguf/hf_view.hpp"
#include "moe/io/gguf/model.hpp"
#include "moe/io/gguf/writer.hpp"
#include "moe/io/hf.hpp"
#include "moe/models/decoder.hpp"
#include "moe/models/decoder_config.hpp"
#include "moe/models/gguf_decoder.hpp"
#include "moe/quant/blocks.hpp"

namespace moe::models {

/// What save_gguf_model wrote: per ggml type, how many tensors; and the matrices whose format
/// fell back (their blocks do not divide the depth), as load_hf_decoder records them.
struct GgufSaveReport {
  std::map<std::string, Index> tensors_by_type;  ///< "Q4_K" -> count
  std::vector<Fallback> fallbacks;
};

namespace detail {

/// llama.cpp's LlamaModel.permute of q_proj / k_proj rows (`groups` heads of rows / groups
/// rows, each row `row` values): row h d + half d / 2 + j goes to h d + 2 j + half.
inline std::vector<float> gguf_permute_rows(std::vector<float> const& w, Index groups, Index row) {
  Index const rows = static_cast<Index>(w.size()) / row, d = rows / groups;
  std::vector<float> out(w.size());
  for (Index h = 0; h < groups; ++h) {
    for (Index half = 0; half < 2; ++half) {
      for (Index j = 0; j < d / 2; ++j) {
        std::memcpy(out.data() + (h * d + 2 * j + half) * row,
                    w.data() + (h * d + half * (d / 2) + j) * row,
                    static_cast<std::size_t>(row) * sizeof(float));
      }
    }
  }
  return out;
}

/// `values` [rows of `cols`] stored as ggml type `type` (F32, BF16, or a native block format).
inline std::vector<std::byte> gguf_encode(quant::GgmlType type, std::vector<float> const& values,
                                          Index cols) {
  std::vector<std::byte> out;
  auto const n = static_cast<Index>(values.size());
  if (type == quant::GgmlType::kF32) {
    out.resize(values.size() * sizeof(float));
    std::memcpy(out.data(), values.data(), out.size());
  } else if (type == quant::GgmlType::kBF16) {
    out.resize(values.size() * 2);
    for (std::size_t i = 0; i < values.size(); ++i) {
      std::uint16_t const b = float_to_bf16(values[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  } else {
    quant::Format const f = experts::quant_format(*experts::native_format(type));
    Index const rb = quant::row_bytes(f, cols);
    out.resize(static_cast<std::size_t>(n / cols * rb));
    for (Index r = 0; r < n / cols; ++r) {
      quant::quantize_row(f, values.data() + r * cols, cols, out.data() + r * rb);
    }
  }
  return out;
}

/// The n with layer L full attention exactly when (L + 1) % n == 0 (llama.cpp's
/// full_attention_interval: qwen3next hard-codes 4, qwen35moe reads it); throws when no n says
/// the model's layers.
inline Index full_attention_interval(DecoderConfig const& c) {
  for (Index n = 1; n <= c.num_hidden_layers + 1; ++n) {
    bool fits = true;
    for (Index L = 0; L < c.num_hidden_layers && fits; ++L) {
      fits = c.linear_layer(L) == ((L + 1) % n != 0);
    }
    if (fits) return n;
  }
  moe::detail::fail(
      "models: save_gguf_model: the model's linear and full attention layers do "
      "not follow one full_attention_interval, which is all llama.cpp's GGUF "
      "metadata can say; keep the Hugging Face checkpoint");
}

/// The s with layer L an MoE layer exactly when (L + 1) % s == 0 (llama.cpp's
/// interleave_moe_layer_step of Llama 4); throws when no s says the model's layers.
inline Index moe_layer_step(DecoderConfig const& c) {
  for (Index s = 1; s <= c.num_hidden_layers; ++s) {
    bool fits = true;
    for (Index L = 0; L < c.num_hidden_layers && fits; ++L) {
      fits = c.moe.is_moe_layer(L) == ((L + 1) % s == 0);
    }
    if (fits) return s;
  }
  moe::detail::fail(
      "models: save_gguf_model: the model's MoE layers are not every s-th layer, "
      "which is all llama.cpp's interleave_moe_layer_step can say; keep the Hugging "
      "Face checkpoint");
}

/// Refuses what an architecture's GGUF metadata cannot say (llama.cpp hard-codes it), so that a
/// file moe writes is the model it was given.
inline void check_gguf_expressible(DecoderConfig const& c, std::string const& arch) {
  auto refuse = [&](auto const&... why) {
    moe::detail::fail("models: save_gguf_model: ", c.moe.model_type(), " with ", why...,
                      " cannot be written as llama.cpp's \"", arch,
                      "\" GGUF (its metadata has no key for it); keep the Hugging Face checkpoint");
  };
  if (c.mla.enabled) {
    if (c.qkv_bias) refuse("attention biases");
    if (c.yarn.enabled() && c.yarn.attention_factor != 1.0f) {
      refuse("YaRN mscale other than mscale_all_dim");
    }
  }
  if (c.moe.family == io::HfFamily::kGptOss &&
      (c.moe.swiglu_limit != 7.0f || c.moe.swiglu_alpha != 1.702f)) {
    // llama.cpp's gpt-oss experts: swiglu_oai with alpha 1.702 and limit 7, hard-coded.
    refuse("swiglu_limit ", c.moe.swiglu_limit, " and swiglu_alpha ", c.moe.swiglu_alpha,
           " (llama.cpp assumes 7 and 1.702)");
  }
  if (c.moe.spec().decoder.llama4_layers) {
    // llama.cpp's llama4: every 4th layer NoPE with temperature tuning (floor 8192, scale 0.1),
    // chunks of 8192 on the others, the L2 q/k norm unless the model has 128 experts.
    for (Index L = 0; L < c.num_hidden_layers; ++L) {
      bool const nope = (L + 1) % 4 == 0;
      if (c.rope_layer(L) == nope) refuse("NoPE layers other than every 4th");
      if (c.chunk_of(L) != (nope ? 0 : 8192)) refuse("attention chunks other than 8192");
    }
    if (c.temperature_floor != 8192 || c.temperature_scale != 0.1f) {
      refuse("attention temperature tuning other than floor_scale 8192 and attn_scale 0.1");
    }
    if (c.qk_norm_unweighted != (c.moe.num_experts != 128)) {
      refuse(c.qk_norm_unweighted ? "use_qk_norm and 128 experts"
                                  : "use_qk_norm false and other than 128 experts");
    }
    if (c.qkv_bias || c.o_bias) refuse("attention biases");
  }
}

/// The divisor of each RoPE frequency llama.cpp's rope_freqs.weight holds: the model's own
/// factors, or those of its Llama 3 scaling as LlamaModel.generate_extra_tensors computes them
/// (frequencies of head_dim in float, the factor in double).
inline std::vector<float> rope_freq_factors(DecoderConfig const& c) {
  if (!c.rope_freq_factors.empty()) return c.rope_freq_factors;
  kernels::RopeLlama3 const& l = c.llama3;
  double const L0 = static_cast<double>(l.original_max_position), lo = l.low_freq_factor,
               hi = l.high_freq_factor, s = l.factor, pi = 3.14159265358979323846;
  std::vector<float> out;
  for (Index i = 0; i < c.head_dim / 2; ++i) {
    float const freq =
        1.0f / std::pow(c.rope_theta, static_cast<float>(2 * i) / static_cast<float>(c.head_dim));
    double const wavelen = 2.0 * pi / static_cast<double>(freq);
    double factor = 1.0;
    if (wavelen > L0 / lo) {
      factor = s;
    } else if (wavelen >= L0 / hi) {
      double const smooth = (L0 / wavelen - lo) / (hi - lo);
      factor = 1.0 / ((1.0 - smooth) / s + smooth);
    }
    out.push_back(static_cast<float>(factor));
  }
  return out;
}

/// Writes the Gated DeltaNet of layer L (its tensors under `s` = "...linear_attn.") as llama.cpp's
/// converter does: attn_qkv (all q, all k, all v) and attn_gate (z); qwen3next's ssm_ba (per key
/// head the b rows of its value heads, then their a), qwen35moe's ssm_beta and ssm_alpha with
/// the value heads reordered from grouped to tiled (in every tensor that has them); ssm_conv1d
/// [C, kernel], ssm_a = -exp(A_log), ssm_dt.bias, ssm_norm, ssm_out. `values(name, shape)` reads
/// a tensor; `computed(gguf, shape, values, class, L)` writes one.
template <class Values, class Computed>
void write_deltanet(DecoderConfig const& c, std::string const& s, std::string const& b, Index L,
                    Values&& values, Computed&& computed) {
  DecoderDeltaNet const& d = c.deltanet;
  Index const H = c.moe.hidden_size, Hk = d.num_key_heads, Hv = d.num_value_heads, R = Hv / Hk;
  Index const dk = d.key_head_dim, dv = d.value_head_dim, K = Hk * dk, Vd = Hv * dv;
  Index const C = 2 * K + Vd, KW = d.conv_kernel;
  bool const qwen35 = c.moe.family == io::HfFamily::kQwen35Moe;
  bool const tile = qwen35 && d.head_order == DeltaNetHeadOrder::kGrouped && R > 1;
  // File head t (tiled: t = j H_k + g) holds the model's head g R + j.
  auto from = [&](Index t) { return tile ? (t % Hk) * R + t / Hk : t; };
  // Rows [base + t block, + block) of `row` values, per value head t.
  auto heads = [&](std::vector<float> v, Index base, Index block, Index row) {
    if (!tile) return v;
    std::vector<float> out = v;
    for (Index t = 0; t < Hv; ++t) {
      std::copy_n(v.begin() + (base + from(t) * block) * row, block * row,
                  out.begin() + (base + t * block) * row);
    }
    return out;
  };
  std::vector<float> qkv, z, beta, alpha;
  if (d.split_projections) {
    qkv = values(s + "in_proj_qkv.weight", {C, H});
    z = values(s + "in_proj_z.weight", {Vd, H});
    beta = values(s + "in_proj_b.weight", {Hv, H});
    alpha = values(s + "in_proj_a.weight", {Hv, H});
  } else {  // per key head [q | k | v | z] and [b | a]
    std::vector<float> const qkvz = values(s + "in_proj_qkvz.weight", {2 * K + 2 * Vd, H});
    std::vector<float> const ba = values(s + "in_proj_ba.weight", {2 * Hv, H});
    Index const group = 2 * dk + 2 * R * dv;
    auto rows = [&](std::vector<float>& out, std::vector<float> const& src, Index width,
                    Index offset, Index n) {
      for (Index g = 0; g < Hk; ++g) {
        auto const at = src.begin() + (g * width + offset) * H;
        out.insert(out.end(), at, at + n * H);
      }
    };
    rows(qkv, qkvz, group, 0, dk);
    rows(qkv, qkvz, group, dk, dk);
    rows(qkv, qkvz, group, 2 * dk, R * dv);
    rows(z, qkvz, group, 2 * dk + R * dv, R * dv);
    rows(beta, ba, 2 * R, 0, R);
    rows(alpha, ba, 2 * R, R, R);
  }
  computed(b + "attn_qkv.weight", {C, H}, heads(std::move(qkv), 2 * K, dv, H), MatrixClass::kAttnQ,
           L);
  computed(b + "attn_gate.weight", {Vd, H}, heads(std::move(z), 0, dv, H), MatrixClass::kAttnQ, L);
  if (qwen35) {
    computed(b + "ssm_beta.weight", {Hv, H}, heads(std::move(beta), 0, 1, H), MatrixClass::kAttnQ,
             L);
    computed(b + "ssm_alpha.weight", {Hv, H}, heads(std::move(alpha), 0, 1, H), MatrixClass::kAttnQ,
             L);
  } else {
    std::vector<float> ba;
    for (Index g = 0; g < Hk; ++g) {
      ba.insert(ba.end(), beta.begin() + g * R * H, beta.begin() + (g + 1) * R * H);
      ba.insert(ba.end(), alpha.begin() + g * R * H, alpha.begin() + (g + 1) * R * H);
    }
    computed(b + "ssm_ba.weight", {2 * Hv, H}, std::move(ba), MatrixClass::kAttnQ, L);
  }
  computed(b + "ssm_conv1d.weight", {C, KW},
           heads(values(s + "conv1d.weight", {C, 1, KW}), 2 * K, dv, KW));
  std::vector<float> a = heads(values(s + "A_log", {Hv}), 0, 1, 1);
  for (float& x : a) x = -std::exp(x);
  computed(b + "ssm_a", {Hv}, std::move(a));
  computed(b + "ssm_dt.bias", {Hv}, heads(values(s + "dt_bias", {Hv}), 0, 1, 1));
  computed(b + "ssm_norm.weight", {dv}, values(s + "norm.weight", {dv}));
  std::vector<float> const o = values(s + "out_proj.weight", {H, Vd});
  std::vector<float> out = o;
  for (Index r = 0; r < H && tile; ++r) {  // its columns are the value heads
    for (Index t = 0; t < Hv; ++t) {
      std::copy_n(o.begin() + r * Vd + from(t) * dv, dv, out.begin() + r * Vd + t * dv);
    }
  }
  computed(b + "ssm_out.weight", {H, Vd}, std::move(out), MatrixClass::kAttnO, L);
}

}  // namespace detail

/// Writes the decoder of config `c` over checkpoint `ckpt`}  // namespace detail

/// Writes the decoder of config `c` over checkpoint `ckpt` to `path` as a GGUF file (v3) in
/// llama.cpp's layout for the family's architecture (HfFamilySpec::gguf.arch):
///   - metadata: general.architecture, {arch}.block_count, context_length, embedding_length,
///     feed_forward_length / expert_feed_forward_length, attention.head_count,
///     head_count_kv, key_length, value_length, layer_norm_rms_epsilon, rope.freq_base,
///     rope.dimension_count, expert_count, expert_used_count and the family's routing keys
///     (expert_weights_norm, expert_shared_*, expert_group_*, expert_weights_scale,
///     expert_gating_func, leading_dense_block_count, interleave_moe_layer_step), sliding
///     window and YaRN keys: what io::gguf_as_hf reads back into the same DecoderConfig;
///   - tensors: token_embd, output_norm, output (absent when tied), then per layer the
///     attention, norms, the dense MLP or the MoE block with merged ffn_{gate,up,down}_exps
///     [E, rows, cols] (any layout the layer loader reads: per-expert, fused, MXFP4, FP8);
///   - formats: each matrix as `formats` chooses (DecoderOptions::format_of, resolved for its
///     depth; unset: as stored, so a GGUF or moe_quantize checkpoint's blocks are copied as
///     they are), norms, biases, routers and gates F32. A format is written as its ggml type
///     (fp32 F32, bf16 BF16, the block formats theirs, quantized by ggml's reference
///     quantizers).
/// No tokenizer metadata is written (moe's tokenizer reads tokenizer.json; docs/gguf.md).
/// The 2026 architectures as llama.cpp's converter writes them today: deepseek2's MLA run as MQA
/// (1 KV head of kv_lora_rank + rope; kv_b_proj split into attn_k_b and attn_v_b), qwen3next and
/// qwen35moe with their (1 + w) norms + 1, ssm_a = -exp(A_log), attn_qkv / attn_gate and
/// Qwen3.5's value heads in ggml's tiled order (detail::write_deltanet), llama4 with its experts
/// split and its Llama 3 scaling as rope_freqs.weight.
/// Throws moe::Error for a family without a llama.cpp architecture, for what the
/// architecture's metadata cannot say (detail::check_gguf_expressible: e.g. Llama 4 chunks other
/// than llama.cpp's fixed 8192), and as the loaders do for missing or mis-shaped tensors.
inline GgufSaveReport save_gguf_model(std::filesystem::path const& path, DecoderConfig const& c,
                                      io::ShardedCheckpoint const& ckpt,
                                      DecoderOptions const& formats = {},
                                      std::function<void(io::GgufWriter&)> const& metadata = {}) {
  using quant::GgmlType;
  io::HfFamilySpec const& spec = c.moe.spec();
  std::string const arch(spec.gguf.arch);
  moe::detail::check(!arch.empty(), "models: save_gguf_model: ", c.moe.model_type(),
                     " has no llama.cpp GGUF architecture moe writes");
  detail::check_gguf_expressible(c, arch);
  GgufSaveReport report;
  Index const H = c.moe.hidden_size, V = c.vocab_size, nh = c.num_attention_heads,
              kv = c.num_key_value_heads, dh = c.head_dim, Lc = c.num_hidden_layers;
  std::vector<Fallback> fallbacks;
  std::string const why = "a decoder checkpoint holds every tensor of its layers";
  detail::Loading const ld{ckpt, c, formats, nullptr, fallbacks, why};

  io::GgufWriter w;
  using Value = io::GgufMetadataValue;
  auto key = [&](std::string_view k) { return io::detail::concat(arch, ".", k); };
  auto u32 = [](Index v) { return Value(static_cast<std::uint32_t>(v)); };
  w.set("general.architecture", Value(arch));
  w.set(key("block_count"), u32(Lc));
  if (!spec.gguf.extra_layers_key.empty()) w.set(key(spec.gguf.extra_layers_key), u32(0));
  if (c.max_position_embeddings > 0) w.set(key("context_length"), u32(c.max_position_embeddings));
  w.set(key("embedding_length"), u32(H));
  w.set(key(spec.gguf.width_key), u32(c.moe.expert_intermediate_size));
  if (spec.gguf.width_key != "feed_forward_length" && c.intermediate_size > 0) {
    w.set(key("feed_forward_length"), u32(c.intermediate_size));
  }
  w.set(key("attention.head_count"), u32(nh));
  DecoderMla const& mla = c.mla;
  if (mla.enabled) {
    // As llama.cpp's converter writes MLA today: run as MQA over the latent (1 KV head of
    // kv_lora_rank + rope, values of kv_lora_rank), the per-head sizes in the *_mla keys.
    w.set(key("attention.head_count_kv"), u32(1));
    w.set(key("attention.key_length"), u32(mla.kv_lora_rank + mla.qk_rope_head_dim));
    w.set(key("attention.value_length"), u32(mla.kv_lora_rank));
    w.set(key("attention.key_length_mla"), u32(mla.qk_nope_head_dim + mla.qk_rope_head_dim));
    w.set(key("attention.value_length_mla"), u32(mla.v_head_dim));
    if (mla.q_lora_rank > 0) w.set(key("attention.q_lora_rank"), u32(mla.q_lora_rank));
    w.set(key("attention.kv_lora_rank"), u32(mla.kv_lora_rank));
    w.set(key("rope.dimension_count"), u32(mla.qk_rope_head_dim));
  } else {
    w.set(key("attention.head_count_kv"), u32(kv));
    w.set(key("attention.key_length"), u32(dh));
    w.set(key("attention.value_length"), u32(dh));
    w.set(key("rope.dimension_count"), u32(c.rotary_dim > 0 ? c.rotary_dim : dh));
  }
  w.set(key("attention.layer_norm_rms_epsilon"), Value(c.rms_norm_eps));
  w.set(key("rope.freq_base"), Value(c.rope_theta));
  DecoderDeltaNet const& dn = c.deltanet;
  if (!dn.layers.empty()) {
    w.set(key("ssm.conv_kernel"), u32(dn.conv_kernel));
    w.set(key("ssm.state_size"), u32(dn.key_head_dim));
    w.set(key("ssm.group_count"), u32(dn.num_key_heads));
    w.set(key("ssm.time_step_rank"), u32(dn.num_value_heads));
    w.set(key("ssm.inner_size"), u32(dn.num_value_heads * dn.value_head_dim));
    w.set(key("full_attention_interval"), u32(detail::full_attention_interval(c)));
  }
  w.set(key("expert_count"), u32(c.moe.num_experts));
  w.set(key("expert_used_count"), u32(c.moe.num_experts_per_tok));
  if (spec.norm_topk == io::HfNormTopK::kKey) {
    w.set(key("expert_weights_norm"), Value(c.moe.norm_topk_prob));
  }
  if (spec.shared == io::HfShared::kGated) {
    w.set(key("expert_shared_feed_forward_length"), u32(c.moe.shared_expert_intermediate_size));
  } else if (spec.shared == io::HfShared::kCount) {
    w.set(key("expert_shared_count"), u32(c.moe.n_shared_experts));
  }
  if (spec.grouped) {
    w.set(key("expert_group_count"), u32(c.moe.n_group));
    w.set(key("expert_group_used_count"), u32(c.moe.topk_group));
    w.set(key("expert_weights_scale"), Value(c.moe.routed_scaling_factor));
  }
  if (spec.grouped || c.moe.family == io::HfFamily::kMinimaxM2) {  // 1 softmax, 2 sigmoid
    w.set(key("expert_gating_func"), u32(c.moe.scoring_func == "sigmoid" ? 2 : 1));
  }
  switch (spec.layer_rule) {
    case io::HfLayerRule::kFirstK:
    case io::HfLayerRule::kFirstKFreq:
      w.set(key("leading_dense_block_count"), u32(c.moe.first_k_dense_replace));
      break;
    case io::HfLayerRule::kRange:
      w.set(key("leading_dense_block_count"), u32(c.moe.moe_layer_start_index));
      w.set(key("interleave_moe_layer_step"), u32(c.moe.moe_layer_interval));
      break;
    case io::HfLayerRule::kInterleave:
      w.set(key("interleave_moe_layer_step"), u32(detail::moe_layer_step(c)));
      break;
    default:  // kSparseStep: the layers without ffn_gate_inp are dense
      break;
  }
  if (c.sliding_window > 0) w.set(key("attention.sliding_window"), u32(c.sliding_window));
  if (c.yarn.enabled()) {
    w.set(key("rope.scaling.type"), Value("yarn"));
    w.set(key("rope.scaling.factor"), Value(c.yarn.factor));
    w.set(key("rope.scaling.original_context_length"), u32(c.yarn.original_max_position));
    if (mla.enabled) {  // the converter's 0.1 mscale_all_dim (V2: no correction, 1)
      w.set(key("rope.scaling.yarn_log_multiplier"),
            Value(0.1f * (mla.softmax_mscale_all_dim > 0.0f ? mla.softmax_mscale_all_dim : 1.0f)));
    }
  }

  // Tensors. A matrix of class `cls` (nullopt: F32, not a matrix the engine multiplies) written
  // from its stored blocks when they are in the chosen format, else from its values.
  auto emit = [&](std::string const& gguf, std::vector<std::int64_t> const& shape,
                  std::optional<MatrixClass> cls, Index L, std::vector<float> values,
                  std::optional<io::BlockTensor> const& stored, experts::WeightFormat stored_as,
                  Index permute_groups = 0) {
    Index const cols = shape.back();
    experts::WeightFormat f = experts::WeightFormat::kF32;
    if (cls) {
      bool const shared = gguf.find("_shexp") != std::string::npos;
      f = ld.format(gguf, *cls, L, cols, stored_as, shared);
    }
    GgmlType const type = experts::ggml_type(f);
    std::vector<std::byte> bytes;
    if (stored && stored->runs_as(f) && permute_groups == 0) {
      bytes.assign(stored->bytes.begin(), stored->bytes.end());
    } else {
      if (values.empty() && stored) values = stored->dequantize();
      if (permute_groups > 0) values = detail::gguf_permute_rows(values, permute_groups, cols);
      bytes = detail::gguf_encode(type, values, cols);
    }
    w.add_tensor(gguf, type, {shape.rbegin(), shape.rend()}, bytes);
    ++report.tensors_by_type[std::string(quant::ggml_type_name(type))];
  };
  // A tensor read from the checkpoint by its Hugging Face name.
  auto from_ckpt = [&](std::string const& gguf, std::string const& hf,
                       std::vector<std::int64_t> const& shape, std::optional<MatrixClass> cls,
                       Index L, Index permute_groups = 0) {
    std::optional<io::BlockTensor> const b = detail::block_tensor(ckpt, hf, shape);
    std::vector<float> values;
    if (!b) values = detail::read_tensor(ckpt, hf, shape, why, &c.moe);
    emit(gguf, shape, cls, L, std::move(values), b, detail::stored_format(ckpt, hf, shape),
         permute_groups);
  };
  // A float tensor computed here (F32; or a matrix of class `cls` in its chosen format).
  auto computed = [&](std::string const& gguf, std::vector<std::int64_t> const& shape,
                      std::vector<float> values, std::optional<MatrixClass> cls = std::nullopt,
                      Index L = 0) {
    emit(gguf, shape, cls, L, std::move(values), std::nullopt, experts::WeightFormat::kF32);
  };
  auto read = [&](std::string const& hf, std::vector<std::int64_t> const& shape) {
    return detail::read_tensor(ckpt, hf, shape, why, &c.moe);
  };
  // An RMSNorm's weight: + 1 for the (1 + w) form (Qwen3-Next, Qwen3.5), as the converter does.
  auto norm = [&](std::string const& gguf, std::string const& hf, Index n, Index L) {
    if (!c.norm_one_plus) return from_ckpt(gguf, hf, {n}, std::nullopt, L);
    std::vector<float> v = read(hf, {n});
    for (float& x : v) x += 1.0f;
    computed(gguf, {n}, std::move(v));
  };
  detail::CheckpointRoot const root = detail::checkpoint_root(ckpt);
  from_ckpt("token_embd.weight", root.model + "embed_tokens.weight", {V, H},
            MatrixClass::kEmbedding, 0);
  norm("output_norm.weight", root.model + "norm.weight", H, 0);
  if (!c.tie_word_embeddings) {
    from_ckpt("output.weight", root.head + "lm_head.weight", {V, H}, MatrixClass::kLmHead, Lc - 1);
  }
  if (!c.rope_freq_factors.empty() || c.llama3.enabled()) {  // Llama 3 scaling, per frequency
    computed("rope_freqs.weight", {dh / 2}, detail::rope_freq_factors(c));
  }
  for (Index L = 0; L < Lc; ++L) {
    std::string const b = io::detail::concat("blk.", L, ".");
    std::string const p = io::detail::concat(root.model, "layers.", L, ".");
    bool const permuted = spec.gguf.permuted_qk;
    norm(b + "attn_norm.weight", p + "input_layernorm.weight", H, L);
    norm(io::detail::concat(b, spec.gguf.mlp_norm, ".weight"),
         p + "post_attention_layernorm.weight", H, L);
    if (c.linear_layer(L)) {
      detail::write_deltanet(c, p + "linear_attn.", b, L, read, computed);
    } else if (mla.enabled) {
      std::string const s = p + "self_attn.";
      Index const dq = mla.qk_nope_head_dim + mla.qk_rope_head_dim, R = mla.kv_lora_rank;
      if (mla.q_lora_rank > 0) {
        from_ckpt(b + "attn_q_a.weight", s + "q_a_proj.weight", {mla.q_lora_rank, H},
                  MatrixClass::kAttnQ, L);
        from_ckpt(b + "attn_q_a_norm.weight", s + "q_a_layernorm.weight", {mla.q_lora_rank},
                  std::nullopt, L);
        from_ckpt(b + "attn_q_b.weight", s + "q_b_proj.weight", {nh * dq, mla.q_lora_rank},
                  MatrixClass::kAttnQ, L);
      } else {
        from_ckpt(b + "attn_q.weight", s + "q_proj.weight", {nh * dq, H}, MatrixClass::kAttnQ, L);
      }
      from_ckpt(b + "attn_kv_a_mqa.weight", s + "kv_a_proj_with_mqa.weight",
                {R + mla.qk_rope_head_dim, H}, MatrixClass::kAttnK, L);
      from_ckpt(b + "attn_kv_a_norm.weight", s + "kv_a_layernorm.weight", {R}, std::nullopt, L);
      // kv_b_proj split as the converter does: k_b [H, R, nope] (each head's k rows
      // transposed), v_b [H, v, R].
      Index const nope = mla.qk_nope_head_dim, vd = mla.v_head_dim;
      std::vector<float> const kv_b = read(s + "kv_b_proj.weight", {nh * (nope + vd), R});
      std::vector<float> k_b, v_b;
      k_b.reserve(static_cast<std::size_t>(nh * R * nope));
      v_b.reserve(static_cast<std::size_t>(nh * vd * R));
      for (Index h = 0; h < nh; ++h) {
        float const* head = kv_b.data() + h * (nope + vd) * R;
        for (Index r = 0; r < R; ++r) {
          for (Index i = 0; i < nope; ++i) k_b.push_back(head[i * R + r]);
        }
        v_b.insert(v_b.end(), head + nope * R, head + (nope + vd) * R);
      }
      computed(b + "attn_k_b.weight", {nh, R, nope}, std::move(k_b), MatrixClass::kAttnK, L);
      computed(b + "attn_v_b.weight", {nh, vd, R}, std::move(v_b), MatrixClass::kAttnV, L);
      from_ckpt(b + "attn_output.weight", s + "o_proj.weight", {H, nh * vd}, MatrixClass::kAttnO,
                L);
    } else {
      Index const q_rows = (c.attention_gate ? 2 : 1) * nh * dh;  // Qwen3-Next's packed gate
      from_ckpt(b + "attn_q.weight", p + "self_attn.q_proj.weight", {q_rows, H},
                MatrixClass::kAttnQ, L, permuted ? nh : 0);
      from_ckpt(b + "attn_k.weight", p + "self_attn.k_proj.weight", {kv * dh, H},
                MatrixClass::kAttnK, L, permuted ? kv : 0);
      from_ckpt(b + "attn_v.weight", p + "self_attn.v_proj.weight", {kv * dh, H},
                MatrixClass::kAttnV, L);
      from_ckpt(b + "attn_output.weight", p + "self_attn.o_proj.weight", {H, nh * dh},
                MatrixClass::kAttnO, L);
    }
    if (c.qkv_bias) {
      // A bias is a column: permuted as rows of one value.
      auto bias = [&](char const* g, char const* hf, Index rows, Index groups) {
        std::vector<float> v = detail::read_tensor(ckpt, p + hf, {rows}, why);
        if (groups > 0) v = detail::gguf_permute_rows(v, groups, 1);
        emit(b + g, {rows}, std::nullopt, L, std::move(v), std::nullopt,
             experts::WeightFormat::kF32);
      };
      bias("attn_q.bias", "self_attn.q_proj.bias", nh * dh, permuted ? nh : 0);
      bias("attn_k.bias", "self_attn.k_proj.bias", kv * dh, permuted ? kv : 0);
      bias("attn_v.bias", "self_attn.v_proj.bias", kv * dh, 0);
    }
    if (c.o_bias) {
      from_ckpt(b + "attn_output.bias", p + "self_attn.o_proj.bias", {H}, std::nullopt, L);
    }
    if (c.qk_norm && !c.qk_norm_unweighted && !c.linear_layer(L)) {
      bool const all = c.qk_norm_scope == QkNormScope::kAllHeads;
      norm(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", all ? nh * dh : dh, L);
      norm(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", all ? kv * dh : dh, L);
    }
    if (c.sinks) from_ckpt(b + "attn_sinks.weight", p + "self_attn.sinks", {nh}, std::nullopt, L);
    if (!c.moe.is_moe_layer(L)) {
      Index const I = c.intermediate_size;
      std::string const mlp = p + std::string(spec.decoder.dense_module);
      from_ckpt(b + "ffn_gate.weight", mlp + "gate_proj.weight", {I, H}, MatrixClass::kDenseGateUp,
                L);
      from_ckpt(b + "ffn_up.weight", mlp + "up_proj.weight", {I, H}, MatrixClass::kDenseGateUp, L);
      from_ckpt(b + "ffn_down.weight", mlp + "down_proj.weight", {H, I}, MatrixClass::kDenseDown,
                L);
      continue;
    }
    // The MoE block: its tensors as the layer loader reads them (any layout), named per expert.
    io::HfLayout layout = io::hf_default_layout(c.moe.family, L, false);
    layout.fused_experts = false;
    std::vector<io::HfTensor> const tensors = io::hf_layer_tensors(c.moe, layout);
    std::map<std::string, io::HfTensor const*> by_name;
    for (io::HfTensor const& t : tensors) by_name[t.name] = &t;
    io::visit_hf_layer_type(c.moe.family, [&]<class Moe>(std::type_identity<Moe>) {
      io::HfLayer<Moe> const loaded =
          io::load_hf_layer<Moe>(c.moe, ckpt, L, detail::moe_layer_options(root, c, L));
      static constexpr std::string_view kMoe[] = {
          "ffn_gate_inp.weight",      "ffn_gate_inp.bias",   "exp_probs_b.bias",
          "ffn_gate_exps.weight",     "ffn_up_exps.weight",  "ffn_down_exps.weight",
          "ffn_gate_exps.bias",       "ffn_up_exps.bias",    "ffn_down_exps.bias",
          "ffn_gate_shexp.weight",    "ffn_up_shexp.weight", "ffn_down_shexp.weight",
          "ffn_gate_inp_shexp.weight"};
      for (std::string_view const rest : kMoe) {
        std::string const gguf = b + std::string(rest);
        std::optional<std::string> const hf = io::detail::gguf_to_hf_name(c.moe.family, gguf);
        if (!hf) continue;
        std::size_t const at = hf->find("{e}");
        bool const projection = rest.find(".weight") != std::string_view::npos &&
                                rest.find("_inp") == std::string_view::npos;
        std::optional<MatrixClass> const cls = !projection ? std::nullopt
                                               : rest.starts_with("ffn_down")
                                                   ? std::optional(MatrixClass::kExpertsDown)
                                                   : std::optional(MatrixClass::kExpertsIn);
        if (at == std::string::npos) {
          auto const it = by_name.find(*hf);
          if (it == by_name.end()) continue;  // this layer has no such tensor
          io::HfTensor const& t = *it->second;
          std::optional<io::BlockTensor> const blocks =
              projection ? detail::block_tensor(ckpt, t.name, t.shape) : std::nullopt;
          std::vector<std::int64_t> shape = t.shape;
          if (!projection && shape.size() == 2 && shape[0] == 1) shape = {shape[1]};
          emit(gguf, shape, cls, L, io::hf_tensor_values(loaded.layer, t), blocks,
               blocks ? experts::load_format(blocks->type) : experts::WeightFormat::kF32);
          continue;
        }
        // Merged experts: expert e's tensor, stacked into [E, ...].
        std::string first = *hf;
        first.replace(at, 3, "0");
        auto const it0 = by_name.find(first);
        if (it0 == by_name.end()) continue;
        std::vector<std::int64_t> shape = it0->second->shape;
        Index const E = c.moe.num_experts;
        std::optional<io::BlockTensor> stored0 =
            projection ? detail::block_tensor(ckpt, first, shape) : std::nullopt;
        experts::WeightFormat const stored_as =
            stored0 ? experts::load_format(stored0->type) : experts::WeightFormat::kF32;
        // Stored blocks of every expert, in one type: copied when that is the format chosen.
        std::vector<std::byte> joined;
        bool all_blocks = stored0.has_value();
        std::vector<float> values;
        for (Index e = 0; e < E; ++e) {
          std::string name = *hf;
          name.replace(at, 3, std::to_string(e));
          io::HfTensor const& t = *by_name.at(name);
          std::optional<io::BlockTensor> const be =
              projection ? detail::block_tensor(ckpt, name, t.shape) : std::nullopt;
          all_blocks = all_blocks && be && be->type == stored0->type;
          if (all_blocks) joined.insert(joined.end(), be->bytes.begin(), be->bytes.end());
          std::vector<float> const v = io::hf_tensor_values(loaded.layer, t);
          values.insert(values.end(), v.begin(), v.end());
        }
        shape.insert(shape.begin(), E);
        std::optional<io::BlockTensor> merged;
        if (all_blocks) {
          merged = io::BlockTensor{stored0->type, E * shape[1], shape[2], {}};
          merged->bytes = joined;
        }
        emit(gguf, shape, cls, L, std::move(values), merged, stored_as);
      }
    });
  }
  if (metadata) metadata(w);
  w.save(path);
  report.fallbacks = std::move(fallbacks);
  return report;
}

/// save_gguf_model of the model in `model_dir` (config.json and its safetensors) or of a GGUF
/// file (converted to other formats; its tokenizer.* metadata is carried over as it is).
/// `metadata` sets more keys, e.g. the tokenizer of a directory (text::set_gguf_tokenizer, which
/// needs moe::text).
inline GgufSaveReport save_gguf_model(std::filesystem::path const& path,
                                      std::filesystem::path const& model,
                                      DecoderOptions const& formats = {},
                                      std::function<void(io::GgufWriter&)> const& metadata = {}) {
  if (io::is_gguf_file(model)) {
    io::GgufAsHf const g = io::gguf_as_hf(model);
    io::GgufModel const source(model);
    return save_gguf_model(path, gguf_decoder_config(g, model.string()), *g.checkpoint, formats,
                           [&](io::GgufWriter& w) {
                             for (io::GgufKeyValue const& kv : source.metadata().metadata()) {
                               if (kv.key.substr(0, 10) == "tokenizer.") {
                                 w.set(std::string(kv.key), io::GgufMetadataValue::from(kv.value));
                               }
                             }
                             if (metadata) metadata(w);
                           });
  }
  io::detail::check_model_dir(model);
  return save_gguf_model(path, read_decoder_config(model), io::open_checkpoint(model), formats,
                         metadata);
}

}  // namespace moe::models
