// SPDX-License-Identifier: Apache-2.0
// Whole models from llama.cpp GGUF files: a file written here in each architecture's layout, as
// convert_hf_to_gguf.py writes it (names, metadata keys and the converter's changes spelt out
// independently of moe's mapping), decodes bit for bit as the Hugging Face checkpoint of the
// values it holds; Q4_K_M-style files run their blocks as stored; save_gguf_model writes
// llama.cpp's layout; the moe_generate and moe_quantize paths; and the files moe refuses.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <numbers>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "hf/decoder_tiny.hpp"
#include "io/io_test_support.hpp"
#include "moe/core/random.hpp"
#include "moe/io/gguf.hpp"
#include "moe/io/gguf/layer.hpp"
#include "moe/models/decoder.hpp"
#include "moe/models/generate.hpp"
#include "moe/models/gguf_decoder.hpp"
#include "moe/models/gguf_writer.hpp"
#include "moe/quant/blocks.hpp"
#include "moe/quant/ggml_blocks.hpp"
#include "moe/quant/ggml_dequantize.hpp"

using namespace dectest;  // NOLINT(google-build-using-namespace)

// ---- GGUF files (llama.cpp's layout) decode as the Hugging Face checkpoint of their values.

namespace {

using moe::experts::WeightFormat;
using moe::quant::GgmlType;

/// ggml's dimension order of a row-major shape: ne[0] is the last (contiguous) dimension.
std::vector<std::int64_t> ggml_ne(Shape const& shape) { return {shape.rbegin(), shape.rend()}; }

/// llama.cpp's LlamaModel.permute of q_proj / k_proj rows (`groups` heads of `rows / groups`
/// rows each; a weight's rows are `cols` wide, a bias's 1): reshape(groups, 2, d / 2, cols)
/// .swapaxes(1, 2), as convert_hf_to_gguf.py does for the "llama" architecture.
std::vector<float> llama_permute(std::vector<float> const& w, Index groups, Index cols) {
  Index const rows = static_cast<Index>(w.size()) / cols, d = rows / groups;
  std::vector<float> out(w.size());
  for (Index h = 0; h < groups; ++h) {
    for (Index half = 0; half < 2; ++half) {
      for (Index j = 0; j < d / 2; ++j) {
        Index const from = h * d + half * (d / 2) + j, to = h * d + j * 2 + half;
        std::copy_n(w.begin() + from * cols, cols, out.begin() + to * cols);
      }
    }
  }
  return out;
}

/// The inverse of llama_permute (written out on its own: the test checks moe's undoing).
std::vector<float> llama_unpermute(std::vector<float> const& w, Index groups, Index cols) {
  Index const rows = static_cast<Index>(w.size()) / cols, d = rows / groups;
  std::vector<float> out(w.size());
  for (Index r = 0; r < rows; ++r) {  // GGUF row r = h d + 2 j + half
    Index const h = r / d, j = (r % d) / 2, half = r % 2;
    std::copy_n(w.begin() + r * cols, cols, out.begin() + (h * d + half * (d / 2) + j) * cols);
  }
  return out;
}

/// The GGUF file of tiny model `t` from its Hugging Face tensors `m`, named, shaped and
/// described as llama.cpp's convert_hf_to_gguf.py writes the model's architecture (the names
/// are spelt out here, independently of moe's mapping). Every tensor is stored as `type`
/// (F32, F16 or BF16), or with Q8_0 the matrices whose rows are whole 32-blocks (the rest F32).
/// `stored` receives the values the file holds, under the Hugging Face names (q/k un-permuted).
/// `type_of`, when given, chooses each tensor's type instead (by GGUF name and shape; F32, F16,
/// BF16, a block type with a kernel in moe (Q8_0, Q6_K, Q5_K, Q5_0, Q4_K, MXFP4, ...: written by
/// ggml's reference quantizers) or IQ2_XXS, which moe has no kernel nor quantizer for: its blocks
/// are hashed bytes, the values they decode to what the file holds).
using TypeOf = std::function<GgmlType(std::string const& gguf, Shape const& shape)>;
fs::path write_gguf(Tiny const& t, Tensors const& m, std::string const& name, GgmlType type,
                    Tensors& stored, TypeOf const& type_of = {}) {
  std::map<std::string, std::string> const archs = {
      {"qwen3_moe", "qwen3moe"}, {"qwen2_moe", "qwen2moe"},    {"olmoe", "olmoe"},
      {"glm4_moe", "glm4moe"},   {"minimax_m2", "minimax-m2"}, {"ernie4_5_moe", "ernie4_5-moe"},
      {"mixtral", "llama"},      {"gpt_oss", "gpt-oss"}};
  std::string const arch = archs.at(t.type);
  bool const mixtral_names = t.type == "mixtral" || t.type == "minimax_m2";
  moe::io::GgufWriter w;
  using V = moe::io::GgufMetadataValue;
  auto u32 = [](Index v) { return V(static_cast<std::uint32_t>(v)); };
  w.set("general.architecture", V(arch));
  w.set(arch + ".block_count", u32(arch == "glm4moe" ? t.L + 1 : t.L));  // + glm's MTP layer
  w.set(arch + ".context_length", u32(4096));
  w.set(arch + ".embedding_length", u32(t.H));
  w.set(arch + ".attention.head_count", u32(t.heads));
  w.set(arch + ".attention.head_count_kv", u32(t.kv));
  w.set(arch + ".attention.key_length", u32(t.dh));
  w.set(arch + ".attention.value_length", u32(t.dh));
  w.set(arch + ".rope.freq_base", V(static_cast<float>(t.theta)));
  w.set(arch + ".attention.layer_norm_rms_epsilon", V(static_cast<float>(t.eps)));
  w.set(arch + ".expert_count", u32(t.E));
  w.set(arch + ".expert_used_count", u32(t.k));
  if (arch == "llama" || arch == "olmoe") {  // the expert width, in feed_forward_length
    w.set(arch + ".feed_forward_length", u32(t.I_moe));
    w.set(arch + ".rope.dimension_count", u32(t.dh));
  } else {
    w.set(arch + ".feed_forward_length", u32(t.I_dense));
    w.set(arch + ".expert_feed_forward_length", u32(t.I_moe));
  }
  if (arch == "qwen2moe") w.set(arch + ".expert_shared_feed_forward_length", u32(12));
  if (arch == "glm4moe") {
    w.set(arch + ".nextn_predict_layers", u32(1));
    w.set(arch + ".leading_dense_block_count", u32(1));
    w.set(arch + ".expert_shared_count", u32(1));
    w.set(arch + ".expert_group_count", u32(2));
    w.set(arch + ".expert_group_used_count", u32(1));
    w.set(arch + ".expert_weights_scale", V(1.5f));
    w.set(arch + ".expert_weights_norm", V(true));
    w.set(arch + ".expert_gating_func", u32(2));  // sigmoid
    w.set(arch + ".rope.dimension_count", u32(t.dh / 2));
  }
  if (arch == "minimax-m2") {
    w.set(arch + ".rope.dimension_count", u32(t.dh / 2));
    w.set(arch + ".expert_gating_func", u32(2));
  }
  if (arch == "gpt-oss") {
    w.set(arch + ".attention.sliding_window", u32(t.window));
    w.set(arch + ".rope.scaling.type", V("yarn"));
    w.set(arch + ".rope.scaling.factor", V(32.0f));
    w.set(arch + ".rope.scaling.original_context_length", u32(kYarnOriginal));
  }
  if (arch == "ernie4_5-moe") {
    w.set(arch + ".leading_dense_block_count", u32(1));
    w.set(arch + ".interleave_moe_layer_step", u32(1));
    w.set(arch + ".expert_shared_count", u32(1));
    w.set(arch + ".expert_shared_feed_forward_length", u32(t.I_dense / t.kv));  // as written
  }
  std::map<std::string, Shape> shapes;
  for (TensorSpec const& s : tensor_specs(t)) shapes[s.name] = s.shape;
  // Adds GGUF tensor `gguf` from the Hugging Face tensors `hf` (one, or the experts' stack);
  // `groups` > 0: q/k rows permuted as the "llama" converter does.
  auto add = [&](std::string const& gguf, std::vector<std::string> const& hf, Shape shape,
                 Index groups = 0, Tensors const* src = nullptr) {
    Tensors const& from = src != nullptr ? *src : m;
    std::vector<float> values;
    for (std::string const& n : hf) {
      values.insert(values.end(), from.at(n).begin(), from.at(n).end());
    }
    Index const cols = shape.back();
    Index const row = shape.size() == 1 ? 1 : cols;
    if (groups > 0) values = llama_permute(values, groups, row);
    bool const halves = type == GgmlType::kF16 || type == GgmlType::kBF16;  // every tensor
    GgmlType const ty = type_of                                           ? type_of(gguf, shape)
                        : halves || (shape.size() >= 2 && cols % 32 == 0) ? type
                                                                          : GgmlType::kF32;
    std::vector<std::byte> bytes;
    std::vector<float> back(values.size());
    if (ty == GgmlType::kIQ2_XXS) {  // no kernel in moe: decoded at load
      auto const n = static_cast<Index>(values.size());
      std::vector<moe::quant::BlockIQ2_XXS> blocks(static_cast<std::size_t>(n / 256));
      std::uint32_t h = 2166136261u ^ static_cast<std::uint32_t>(n);
      for (moe::quant::BlockIQ2_XXS& b : blocks) {
        b.d = 0x0C00;  // 2^-12: weights of at most 15.5 / 4 * 43 * 2^-12 = 0.04
        for (std::uint16_t& q : b.qs) {
          h = (h ^ q) * 16777619u;
          q = static_cast<std::uint16_t>(h >> 16);
        }
      }
      bytes.resize(blocks.size() * sizeof(moe::quant::BlockIQ2_XXS));
      std::memcpy(bytes.data(), blocks.data(), bytes.size());
      moe::quant::ggml_dequantize(ty, bytes, n, back.data());
    } else if (ty != GgmlType::kF32 && ty != GgmlType::kF16 && ty != GgmlType::kBF16) {
      std::optional<WeightFormat> const f = moe::experts::native_format(ty);
      REQUIRE(f.has_value());
      moe::quant::Format const qf = moe::experts::quant_format(*f);
      auto const n = static_cast<Index>(values.size());
      bytes.resize(static_cast<std::size_t>(moe::quant::row_bytes(qf, n)));
      moe::quant::quantize_row(qf, values.data(), n, bytes.data());
      moe::quant::ggml_dequantize(ty, bytes, n, back.data());
    } else if (ty == GgmlType::kF32) {
      bytes.resize(values.size() * 4);
      std::memcpy(bytes.data(), values.data(), bytes.size());
      back = values;
    } else {  // F16 or BF16
      std::vector<std::uint16_t> h(values.size());
      for (std::size_t i = 0; i < h.size(); ++i) {
        h[i] = ty == GgmlType::kF16 ? moe::float_to_f16(values[i]) : moe::float_to_bf16(values[i]);
        back[i] = ty == GgmlType::kF16 ? moe::f16_to_float(h[i]) : moe::bf16_to_float(h[i]);
      }
      bytes.resize(h.size() * 2);
      std::memcpy(bytes.data(), h.data(), bytes.size());
    }
    w.add_tensor(gguf, ty, ggml_ne(shape), bytes);
    if (groups > 0) back = llama_unpermute(back, groups, row);
    std::size_t at = 0;
    for (std::string const& n : hf) {
      stored[n].assign(back.begin() + static_cast<std::ptrdiff_t>(at),
                       back.begin() + static_cast<std::ptrdiff_t>(at + from.at(n).size()));
      at += from.at(n).size();
    }
  };
  auto one = [&](std::string const& gguf, std::string const& hf, Index groups = 0) {
    add(gguf, {hf}, shapes.at(hf), groups);
  };
  one("token_embd.weight", "model.embed_tokens.weight");
  one("output_norm.weight", "model.norm.weight");
  if (!t.tie) one("output.weight", "lm_head.weight");
  for (Index l = 0; l < t.L; ++l) {
    std::string const b = concat("blk.", l, "."), p = concat("model.layers.", l, ".");
    one(b + "attn_norm.weight", p + "input_layernorm.weight");
    bool const post_norm = arch == "glm4moe" || arch == "gpt-oss";
    one(b + (post_norm ? "post_attention_norm.weight" : "ffn_norm.weight"),
        p + "post_attention_layernorm.weight");
    if (m.count(p + "self_attn.sinks")) one(b + "attn_sinks.weight", p + "self_attn.sinks");
    for (char const* x : {"q", "k", "v"}) {
      std::string const hf = concat(p, "self_attn.", x, "_proj.");
      // llama permutes q and k (weight and bias) for ggml's interleaved RoPE.
      Index const groups = arch != "llama" || *x == 'v' ? 0 : *x == 'q' ? t.heads : t.kv;
      one(concat(b, "attn_", x, ".weight"), hf + "weight", groups);
      if (m.count(hf + "bias")) one(concat(b, "attn_", x, ".bias"), hf + "bias", groups);
    }
    one(b + "attn_output.weight", p + "self_attn.o_proj.weight");
    if (m.count(p + "self_attn.o_proj.bias")) {
      one(b + "attn_output.bias", p + "self_attn.o_proj.bias");
    }
    if (m.count(p + "self_attn.q_norm.weight")) {
      one(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight");
      one(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight");
    }
    if (is_dense(t, l)) {
      for (char const* x : {"gate", "up", "down"}) {
        one(concat(b, "ffn_", x, ".weight"), concat(p, "mlp.", x, "_proj.weight"));
      }
      continue;
    }
    if (arch == "gpt-oss") {
      // transformers: experts.gate_up_proj [E, H, 2I] (column 2j gate j, 2j + 1 up j), its
      // bias [E, 2I] likewise, down_proj [E, I, H]; llama.cpp: ffn_gate_exps / ffn_up_exps
      // [E, I, H], their biases [E, I], ffn_down_exps [E, H, I].
      std::string const q = p + "mlp.";
      one(b + "ffn_gate_inp.weight", q + "router.weight");
      one(b + "ffn_gate_inp.bias", q + "router.bias");
      one(b + "ffn_down_exps.bias", q + "experts.down_proj_bias");
      Index const E = t.E, I = t.I_moe, H = t.H;
      std::vector<float> const& gu = m.at(q + "experts.gate_up_proj");
      std::vector<float> const& gub = m.at(q + "experts.gate_up_proj_bias");
      std::vector<float> const& dn = m.at(q + "experts.down_proj");
      Tensors split;  // the GGUF tensors' values
      for (char const* x : {"gate", "up"}) {
        Index const odd = *x == 'u' ? 1 : 0;
        std::vector<float>& wv = split[concat("gguf.", x, ".w")];
        std::vector<float>& bv = split[concat("gguf.", x, ".b")];
        for (Index e = 0; e < E; ++e) {
          for (Index j = 0; j < I; ++j) {
            for (Index h = 0; h < H; ++h) wv.push_back(gu[(e * H + h) * 2 * I + 2 * j + odd]);
            bv.push_back(gub[e * 2 * I + 2 * j + odd]);
          }
        }
      }
      std::vector<float>& dv = split["gguf.down.w"];
      for (Index e = 0; e < E; ++e) {
        for (Index h = 0; h < H; ++h) {
          for (Index i = 0; i < I; ++i) dv.push_back(dn[(e * I + i) * H + h]);
        }
      }
      // Each through add(), which reads its values from `src` and records what the file holds.
      add(b + "ffn_gate_exps.weight", {"gguf.gate.w"}, {E, I, H}, 0, &split);
      add(b + "ffn_up_exps.weight", {"gguf.up.w"}, {E, I, H}, 0, &split);
      add(b + "ffn_down_exps.weight", {"gguf.down.w"}, {E, H, I}, 0, &split);
      add(b + "ffn_gate_exps.bias", {"gguf.gate.b"}, {E, I}, 0, &split);
      add(b + "ffn_up_exps.bias", {"gguf.up.b"}, {E, I}, 0, &split);
      std::vector<float> gu_back(gu.size()), gub_back(gub.size()), dn_back(dn.size());
      for (Index e = 0; e < E; ++e) {
        for (Index j = 0; j < I; ++j) {
          for (Index h = 0; h < H; ++h) {
            gu_back[(e * H + h) * 2 * I + 2 * j] = stored["gguf.gate.w"][(e * I + j) * H + h];
            gu_back[(e * H + h) * 2 * I + 2 * j + 1] = stored["gguf.up.w"][(e * I + j) * H + h];
            dn_back[(e * I + j) * H + h] = stored["gguf.down.w"][(e * H + h) * I + j];
          }
          gub_back[e * 2 * I + 2 * j] = stored["gguf.gate.b"][e * I + j];
          gub_back[e * 2 * I + 2 * j + 1] = stored["gguf.up.b"][e * I + j];
        }
      }
      for (auto const& [k, v] : split) stored.erase(k);
      stored[q + "experts.gate_up_proj"] = gu_back;
      stored[q + "experts.gate_up_proj_bias"] = gub_back;
      stored[q + "experts.down_proj"] = dn_back;
      continue;
    }
    std::string const moe = p + (mixtral_names ? "block_sparse_moe." : "mlp.");
    one(b + "ffn_gate_inp.weight", moe + "gate.weight");
    std::map<std::string, std::string> const w_names = {
        {"gate", "w1"}, {"up", "w3"}, {"down", "w2"}};
    for (char const* x : {"gate", "up", "down"}) {
      std::vector<std::string> experts;
      for (Index e = 0; e < t.E; ++e) {
        experts.push_back(mixtral_names ? concat(moe, "experts.", e, ".", w_names.at(x), ".weight")
                                        : concat(moe, "experts.", e, ".", x, "_proj.weight"));
      }
      Shape shape = shapes.at(experts[0]);
      shape.insert(shape.begin(), t.E);
      add(concat(b, "ffn_", x, "_exps.weight"), experts, shape);
      if (t.type == "qwen2_moe") {
        one(concat(b, "ffn_", x, "_shexp.weight"),
            concat(p, "mlp.shared_expert.", x, "_proj.weight"));
      }
      if (t.type == "glm4_moe" || t.type == "ernie4_5_moe") {
        one(concat(b, "ffn_", x, "_shexp.weight"),
            concat(p, "mlp.shared_experts.", x, "_proj.weight"));
      }
    }
    if (t.type == "qwen2_moe") {  // [1, H] in transformers, [H] in GGUF
      add(b + "ffn_gate_inp_shexp.weight", {p + "mlp.shared_expert_gate.weight"}, {t.H});
    }
    if (t.type == "glm4_moe") one(b + "exp_probs_b.bias", p + "mlp.gate.e_score_correction_bias");
    if (t.type == "minimax_m2") {
      one(b + "exp_probs_b.bias", p + "block_sparse_moe.e_score_correction_bias");
    }
    if (t.type == "ernie4_5_moe") {  // [1, E] in transformers, [E] in GGUF
      add(b + "exp_probs_b.bias", {p + "mlp.moe_statics.e_score_correction_bias"}, {t.E});
    }
  }
  if (arch == "glm4moe") {  // the multi-token-prediction layer: written, never decoded
    std::vector<float> const junk(static_cast<std::size_t>(t.H * 2 * t.H), 0.25f);
    std::vector<std::byte> bytes(junk.size() * 4);
    std::memcpy(bytes.data(), junk.data(), bytes.size());
    w.add_tensor(concat("blk.", t.L, ".nextn.eh_proj.weight"), GgmlType::kF32, {2 * t.H, t.H},
                 bytes);
  }
  fs::path const file = iotest::scratch_dir(name) / "model.gguf";
  w.save(file);
  return file;
}

/// The 2026 architectures as llama.cpp's convert_hf_to_gguf.py writes them (F32; its changes to
/// the values spelt out here): deepseek2 (DeepSeek-V3 with the newer converter's attn_k_b /
/// attn_v_b and 1 KV head of kv_lora_rank + rope; DeepSeek-V2 as older files hold it, attn_kv_b
/// and no gating function), qwen3next (`old`: ssm_in and ssm_ba as transformers has them; else
/// the newer attn_qkv / attn_gate split), qwen35moe (value heads reordered from grouped to
/// tiled), llama4 (split experts, rope_freqs for its Llama 3 scaling, llama.cpp's fixed chunk,
/// NoPE interval and temperature). `stored` receives the Hugging Face tensors the file holds (the
/// converter's changes undone in float, heads in transformers' order).
fs::path write_gguf_2026(Tiny const& t, Tensors const& m, std::string const& name, bool old,
                         Tensors& stored) {
  std::map<std::string, std::string> const archs = {{"deepseek_v3", "deepseek2"},
                                                    {"deepseek_v2", "deepseek2"},
                                                    {"qwen3_next", "qwen3next"},
                                                    {"qwen3_5_moe_text", "qwen35moe"},
                                                    {"llama4_text", "llama4"}};
  std::string const arch = archs.at(t.type);
  moe::io::GgufWriter w;
  using V = moe::io::GgufMetadataValue;
  auto u32 = [](Index v) { return V(static_cast<std::uint32_t>(v)); };
  auto set = [&](std::string const& k, V v) { w.set(arch + "." + k, std::move(v)); };
  w.set("general.architecture", V(arch));
  set("block_count", u32(t.L));
  set("context_length", u32(32));
  set("embedding_length", u32(t.H));
  if (t.type != "qwen3_5_moe_text") set("feed_forward_length", u32(t.I_dense));  // no dense layer
  set("expert_feed_forward_length", u32(t.I_moe));
  set("attention.head_count", u32(t.heads));
  set("rope.freq_base", V(static_cast<float>(t.theta)));
  set("attention.layer_norm_rms_epsilon", V(static_cast<float>(t.eps)));
  set("expert_count", u32(t.E));
  set("expert_used_count", u32(t.k));
  std::optional<Mla> const ml = mla_of(t);
  Gdn const g;
  Index const R = g.Hv / g.Hk, K = g.Hk * g.dk, Vd = g.Hv * g.dv;
  if (ml) {
    set("attention.head_count_kv", u32(old ? t.heads : 1));
    set("attention.key_length", u32(old ? ml->dn + ml->dr : ml->R + ml->dr));
    set("attention.value_length", u32(old ? ml->dv : ml->R));
    if (!old) {
      set("attention.key_length_mla", u32(ml->dn + ml->dr));
      set("attention.value_length_mla", u32(ml->dv));
    }
    if (ml->ql > 0) set("attention.q_lora_rank", u32(ml->ql));
    set("attention.kv_lora_rank", u32(ml->R));
    set("rope.dimension_count", u32(ml->dr));
    set("leading_dense_block_count", u32(1));
    set("expert_shared_count", u32(1));
    set("expert_weights_scale", V(1.5f));
    set("expert_group_count", u32(2));
    set("expert_group_used_count", u32(1));
    if (ml->v3) {
      set("expert_weights_norm", V(true));
      set("expert_gating_func", u32(2));
      set("rope.scaling.type", V("yarn"));
      set("rope.scaling.factor", V(4.0f));
      set("rope.scaling.original_context_length", u32(8));
      set("rope.scaling.yarn_log_multiplier", V(0.1f));  // 0.1 mscale_all_dim
    }
  } else {
    set("attention.head_count_kv", u32(t.kv));
    set("attention.key_length", u32(t.dh));
    set("attention.value_length", u32(t.dh));
    set("rope.dimension_count", u32(attention_of(t).rd));
  }
  if (hybrid(t)) {
    set("expert_shared_feed_forward_length", u32(12));
    set("ssm.conv_kernel", u32(g.kernel));
    set("ssm.state_size", u32(g.dk));
    set("ssm.group_count", u32(g.Hk));
    set("ssm.time_step_rank", u32(g.Hv));
    set("ssm.inner_size", u32(Vd));
    set("full_attention_interval", u32(2));
  }
  if (t.type == "llama4_text") set("interleave_moe_layer_step", u32(2));

  std::map<std::string, Shape> shapes;
  for (TensorSpec const& s : tensor_specs(t)) shapes[s.name] = s.shape;
  // F32 tensor `gguf` [shape] of values v; `hf` (when given) the Hugging Face tensor its values
  // are, as `back` (the file's values, the converter's change undone in float).
  auto add = [&](std::string const& gguf, Shape const& shape, std::vector<float> const& v) {
    std::vector<std::byte> bytes(v.size() * 4);
    std::memcpy(bytes.data(), v.data(), bytes.size());
    w.add_tensor(gguf, GgmlType::kF32, ggml_ne(shape), bytes);
  };
  auto one = [&](std::string const& gguf, std::string const& hf) {
    add(gguf, shapes.at(hf), m.at(hf));
    stored[hf] = m.at(hf);
  };
  // (1 + w) norms: the converter adds 1; transformers' weight is the file's minus 1.
  auto norm = [&](std::string const& gguf, std::string const& hf) {
    if (!one_plus(t)) return one(gguf, hf);
    std::vector<float> v = m.at(hf), back(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += 1.0f, back[i] = v[i] - 1.0f;
    add(gguf, shapes.at(hf), v);
    stored[hf] = back;
  };
  // Value-head order: Qwen3.5's converter moves head g R + j (grouped) to j H_k + g (tiled).
  bool const tiled = t.type == "qwen3_5_moe_text";
  // `block` rows of `row` values a head from row `base` on; `back`: tiled to grouped.
  auto tiled_rows = [&](std::vector<float> const& v, Index base, Index block, Index row,
                        bool back = false) {
    std::vector<float> out = v;
    if (!tiled) return out;
    for (Index gk = 0; gk < g.Hk; ++gk) {
      for (Index j = 0; j < R; ++j) {
        Index const grouped = gk * R + j, tiled_head = j * g.Hk + gk;
        Index const from = back ? tiled_head : grouped, to = back ? grouped : tiled_head;
        std::copy_n(v.begin() + (base + from * block) * row, block * row,
                    out.begin() + (base + to * block) * row);
      }
    }
    return out;
  };
  one("token_embd.weight", "model.embed_tokens.weight");
  norm("output_norm.weight", "model.norm.weight");
  one("output.weight", "lm_head.weight");
  if (t.type == "llama4_text") {
    // LlamaModel.generate_extra_tensors: the Llama 3 factors of the tiny config's rope_scaling
    // (factor 4, low 1, high 2, original 8), per frequency of head_dim.
    std::vector<float> f;
    for (Index i = 0; i < t.dh / 2; ++i) {
      float const freq = static_cast<float>(
          1.0 / std::pow(t.theta, static_cast<double>(2 * i) / static_cast<double>(t.dh)));
      double const wavelen = 2 * std::numbers::pi / freq, lo = 8.0 / 1.0, hi = 8.0 / 2.0;
      double factor = 1;
      if (wavelen > lo) {
        factor = 4;
      } else if (wavelen >= hi) {
        double const smooth = (8.0 / wavelen - 1.0) / (2.0 - 1.0);
        factor = 1 / ((1 - smooth) / 4 + smooth);
      }
      f.push_back(static_cast<float>(factor));
    }
    add("rope_freqs.weight", {t.dh / 2}, f);
  }
  for (Index l = 0; l < t.L; ++l) {
    std::string const b = concat("blk.", l, "."), p = concat("model.layers.", l, ".");
    std::string const s = p + "self_attn.", la = p + "linear_attn.";
    norm(b + "attn_norm.weight", p + "input_layernorm.weight");
    norm(b + (hybrid(t) ? "post_attention_norm.weight" : "ffn_norm.weight"),
         p + "post_attention_layernorm.weight");
    if (linear_layer(t, l)) {
      Index const C = 2 * K + Vd, H = t.H;
      if (split_projections(t)) {
        std::vector<float> const qkv = m.at(la + "in_proj_qkv.weight");
        add(b + "attn_qkv.weight", {C, H}, tiled_rows(qkv, 2 * K, g.dv, H));
        add(b + "attn_gate.weight", {Vd, H}, tiled_rows(m.at(la + "in_proj_z.weight"), 0, g.dv, H));
        add(b + "ssm_beta.weight", {g.Hv, H}, tiled_rows(m.at(la + "in_proj_b.weight"), 0, 1, H));
        add(b + "ssm_alpha.weight", {g.Hv, H}, tiled_rows(m.at(la + "in_proj_a.weight"), 0, 1, H));
        for (char const* n :
             {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}) {
          stored[la + n] = m.at(la + n);
        }
      } else if (old) {
        one(b + "ssm_in.weight", la + "in_proj_qkvz.weight");
      } else {
        // The newer converter: [q, k, v, z] per key head -> q of all heads, k, v; and z.
        std::vector<float> const& qkvz = m.at(la + "in_proj_qkvz.weight");
        std::vector<float> qkv, z;
        Index const group = 2 * g.dk + 2 * R * g.dv;
        auto rows = [&](std::vector<float>& out, Index offset, Index n) {
          for (Index gk = 0; gk < g.Hk; ++gk) {
            auto const from = qkvz.begin() + (gk * group + offset) * H;
            out.insert(out.end(), from, from + n * H);
          }
        };
        rows(qkv, 0, g.dk);
        rows(qkv, g.dk, g.dk);
        rows(qkv, 2 * g.dk, R * g.dv);
        rows(z, 2 * g.dk + R * g.dv, R * g.dv);
        add(b + "attn_qkv.weight", {C, H}, qkv);
        add(b + "attn_gate.weight", {Vd, H}, z);
        stored[la + "in_proj_qkvz.weight"] = qkvz;
      }
      if (!split_projections(t)) one(b + "ssm_ba.weight", la + "in_proj_ba.weight");
      // conv1d [C, 1, kernel] squeezed to [C, kernel]; its v channels tiled for Qwen3.5.
      add(b + "ssm_conv1d.weight", {C, g.kernel},
          tiled_rows(m.at(la + "conv1d.weight"), 2 * K, g.dv, g.kernel));
      stored[la + "conv1d.weight"] = m.at(la + "conv1d.weight");
      std::vector<float> a = tiled_rows(m.at(la + "A_log"), 0, 1, 1), a_back(a.size());
      for (float& x : a) x = -std::exp(x);  // the converter's -exp(A_log)
      add(b + "ssm_a", {g.Hv}, a);
      for (std::size_t i = 0; i < a.size(); ++i) a_back[i] = std::log(-a[i]);
      stored[la + "A_log"] = tiled_rows(a_back, 0, 1, 1, true);
      add(b + "ssm_dt.bias", {g.Hv}, tiled_rows(m.at(la + "dt_bias"), 0, 1, 1));
      stored[la + "dt_bias"] = m.at(la + "dt_bias");
      one(b + "ssm_norm.weight", la + "norm.weight");  // Qwen3NextRMSNormGated: no + 1
      std::vector<float> const& o = m.at(la + "out_proj.weight");
      std::vector<float> ot = o;
      for (Index r = 0; r < H && tiled; ++r) {  // columns: value heads
        for (Index gk = 0; gk < g.Hk; ++gk) {
          for (Index j = 0; j < R; ++j) {
            std::copy_n(o.begin() + r * Vd + (gk * R + j) * g.dv, g.dv,
                        ot.begin() + r * Vd + (j * g.Hk + gk) * g.dv);
          }
        }
      }
      add(b + "ssm_out.weight", {H, Vd}, ot);
      stored[la + "out_proj.weight"] = o;
    } else if (ml) {
      if (ml->ql > 0) {
        one(b + "attn_q_a.weight", s + "q_a_proj.weight");
        one(b + "attn_q_a_norm.weight", s + "q_a_layernorm.weight");
        one(b + "attn_q_b.weight", s + "q_b_proj.weight");
      } else {
        one(b + "attn_q.weight", s + "q_proj.weight");
      }
      one(b + "attn_kv_a_mqa.weight", s + "kv_a_proj_with_mqa.weight");
      one(b + "attn_kv_a_norm.weight", s + "kv_a_layernorm.weight");
      if (old) {
        one(b + "attn_kv_b.weight", s + "kv_b_proj.weight");
      } else {
        // kv_b.view(H, nope + v, R) split: k_b transposed to [H, R, nope], v_b [H, v, R].
        std::vector<float> const& kv = m.at(s + "kv_b_proj.weight");
        Index const dn = ml->dn, dv = ml->dv, Rl = ml->R;
        std::vector<float> kb, vb;
        for (Index h = 0; h < t.heads; ++h) {
          for (Index r = 0; r < Rl; ++r) {
            for (Index i = 0; i < dn; ++i) kb.push_back(kv[(h * (dn + dv) + i) * Rl + r]);
          }
          for (Index i = 0; i < dv * Rl; ++i) vb.push_back(kv[(h * (dn + dv) + dn) * Rl + i]);
        }
        add(b + "attn_k_b.weight", {t.heads, Rl, dn}, kb);
        add(b + "attn_v_b.weight", {t.heads, dv, Rl}, vb);
        stored[s + "kv_b_proj.weight"] = kv;
      }
      one(b + "attn_output.weight", s + "o_proj.weight");
    } else {
      for (char const* x : {"q", "k", "v"}) {
        one(concat(b, "attn_", x, ".weight"), concat(s, x, "_proj.weight"));
      }
      one(b + "attn_output.weight", s + "o_proj.weight");
      if (m.count(s + "q_norm.weight")) {
        norm(b + "attn_q_norm.weight", s + "q_norm.weight");
        norm(b + "attn_k_norm.weight", s + "k_norm.weight");
      }
    }
    std::string const f = p + dense_module(t);
    if (is_dense(t, l)) {
      for (char const* x : {"gate", "up", "down"}) {
        one(concat(b, "ffn_", x, ".weight"), concat(f, x, "_proj.weight"));
      }
      continue;
    }
    Index const E = t.E, I = t.I_moe, H = t.H;
    if (t.type == "llama4_text") {
      // experts.gate_up_proj [E, H, 2I] transposed and split: gate [E, I, H], up [E, I, H];
      // experts.down_proj [E, I, H] transposed: [E, H, I].
      one(b + "ffn_gate_inp.weight", f + "router.weight");
      std::vector<float> const& gu = m.at(f + "experts.gate_up_proj");
      std::vector<float> const& dn = m.at(f + "experts.down_proj");
      std::vector<float> gate, up, down;
      for (Index e = 0; e < E; ++e) {
        for (Index j = 0; j < 2 * I; ++j) {
          for (Index h = 0; h < H; ++h) (j < I ? gate : up).push_back(gu[(e * H + h) * 2 * I + j]);
        }
        for (Index h = 0; h < H; ++h) {
          for (Index i = 0; i < I; ++i) down.push_back(dn[(e * I + i) * H + h]);
        }
      }
      add(b + "ffn_gate_exps.weight", {E, I, H}, gate);
      add(b + "ffn_up_exps.weight", {E, I, H}, up);
      add(b + "ffn_down_exps.weight", {E, H, I}, down);
      stored[f + "experts.gate_up_proj"] = gu;
      stored[f + "experts.down_proj"] = dn;
      for (char const* x : {"gate", "up", "down"}) {
        one(concat(b, "ffn_", x, "_shexp.weight"), concat(f, "shared_expert.", x, "_proj.weight"));
      }
      continue;
    }
    one(b + "ffn_gate_inp.weight", f + "gate.weight");
    for (char const* x : {"gate", "up", "down"}) {
      std::vector<float> v;
      for (Index e = 0; e < E; ++e) {
        std::vector<float> const& ve = m.at(concat(f, "experts.", e, ".", x, "_proj.weight"));
        v.insert(v.end(), ve.begin(), ve.end());
        stored[concat(f, "experts.", e, ".", x, "_proj.weight")] = ve;
      }
      add(concat(b, "ffn_", x, "_exps.weight"), *x == 'd' ? Shape{E, H, I} : Shape{E, I, H}, v);
      std::string const shared = hybrid(t) ? "shared_expert." : "shared_experts.";
      one(concat(b, "ffn_", x, "_shexp.weight"), concat(f, shared, x, "_proj.weight"));
    }
    if (hybrid(t)) {  // [1, H] in transformers, [H] in GGUF
      add(b + "ffn_gate_inp_shexp.weight", {t.H}, m.at(f + "shared_expert_gate.weight"));
      stored[f + "shared_expert_gate.weight"] = m.at(f + "shared_expert_gate.weight");
    }
    if (ml && ml->v3) one(b + "exp_probs_b.bias", f + "gate.e_score_correction_bias");
  }
  fs::path const file = iotest::scratch_dir(name) / "model.gguf";
  w.save(file);
  return file;
}

/// Greedy decoding of a few steps with each decoder (the ids of `a`): every step's logits bit for
/// bit alike, or with `tol`, within tol of the largest one of `b` (for files whose values or
/// order moe runs otherwise than the checkpoint's: a permuted sum, RoPE factors instead of their
/// parameters).
void check_decoding(moe::models::AnyDecoder const& a, moe::models::AnyDecoder const& b, Index V,
                    std::optional<double> tol) {
  std::visit(
      [&](auto const& da, auto const& db) {
        if constexpr (std::is_same_v<decltype(da), decltype(db)>) {
          std::vector<std::int64_t> ids = {3, 17, 5, 9, 2, 30, 11};
          auto sa = da.make_state(1);
          auto sb = db.make_state(1);
          std::vector<float> la(static_cast<std::size_t>(V)), lb(la.size());
          std::vector<Index> counts = {static_cast<Index>(ids.size())};
          da.forward(ids, counts, sa, {la.data(), 1, V});
          db.forward(ids, counts, sb, {lb.data(), 1, V});
          for (int step = 0; step < 4; ++step) {
            INFO("step " << step);
            if (!tol) {
              REQUIRE(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);
            } else {
              double worst = 0, scale = 0;
              for (Index i = 0; i < V; ++i) {
                worst = std::max(worst, static_cast<double>(std::abs(la[i] - lb[i])));
                scale = std::max(scale, static_cast<double>(std::abs(lb[i])));
              }
              INFO(worst << " of " << scale);
              REQUIRE(worst <= *tol * scale);
            }
            std::vector<std::int64_t> const next = {argmax(la.data(), V)};
            counts = {1};
            da.forward(next, counts, sa, {la.data(), 1, V});
            db.forward(next, counts, sb, {lb.data(), 1, V});
          }
        } else {
          FAIL("the two decoders are of different MoE types");
        }
      },
      a, b);
}
void check_same_decoding(moe::models::AnyDecoder const& a, moe::models::AnyDecoder const& b,
                         Index V) {
  check_decoding(a, b, V, std::nullopt);
}
void check_close_decoding(moe::models::AnyDecoder const& a, moe::models::AnyDecoder const& b,
                          Index V, double tol) {
  check_decoding(a, b, V, tol);
}

}  // namespace

TEST_CASE("Decoder: a GGUF file decodes as the Hugging Face checkpoint of the values it holds",
          "[models][decoder][gguf]") {
  struct Case {
    std::string type;
    GgmlType stored;
    bool bf16_checkpoint;
  };
  for (Case const& c :
       {Case{"qwen3_moe", GgmlType::kF32, false}, Case{"qwen2_moe", GgmlType::kF32, false},
        Case{"qwen3_moe", GgmlType::kF16, false}, Case{"qwen3_moe", GgmlType::kBF16, true},
        Case{"qwen3_moe", GgmlType::kQ8_0, false}, Case{"qwen2_moe", GgmlType::kQ8_0, false},
        Case{"olmoe", GgmlType::kF32, false}, Case{"glm4_moe", GgmlType::kF32, false},
        Case{"minimax_m2", GgmlType::kF32, false}, Case{"ernie4_5_moe", GgmlType::kQ8_0, false},
        Case{"mixtral", GgmlType::kF32, false}, Case{"mixtral", GgmlType::kQ8_0, false},
        Case{"gpt_oss", GgmlType::kF32, false}, Case{"gpt_oss", GgmlType::kQ8_0, false}}) {
    INFO(c.type << " stored as " << moe::quant::ggml_type_name(c.stored));
    Tiny t;
    t.type = c.type;
    t.H = 32, t.I_dense = 32, t.I_moe = 32;  // whole 32-blocks in every matrix's rows
    t.tie = c.stored == GgmlType::kF16;      // output.weight absent: tied
    if (c.type == "gpt_oss") {
      t.window = 3;
      t.swiglu_limit = 7.0f;  // a GGUF file has no limit: llama.cpp and moe use gpt-oss's 7
    }
    Tensors const m = make_tensors(t, 900);
    Tensors stored;
    std::string const tag = concat("gguf_", c.type, "_", moe::quant::ggml_type_name(c.stored));
    fs::path const gguf = write_gguf(t, m, tag, c.stored, stored);
    REQUIRE(moe::io::is_gguf_file(gguf));
    REQUIRE_FALSE(moe::io::is_gguf_file(gguf.parent_path()));
    fs::path const dir = write_model(t, stored, tag + "_hf", c.bf16_checkpoint);
    moe::models::AnyDecoder const from_gguf = moe::models::load_gguf_decoder(gguf);
    // The GGUF's Q8_0 matrices run as stored (q8_0 packs of its blocks); the directory holds
    // their values, which Q8_0's quantizer turns back into the same blocks.
    bool const quantized = c.stored == GgmlType::kQ8_0;
    moe::models::DecoderOptions q8;
    if (quantized) q8.dense = q8.experts = WeightFormat::kQ8_0;
    moe::models::AnyDecoder const from_hf = moe::models::load_hf_decoder(dir, nullptr, q8);
    if (c.type == "qwen2_moe" && quantized) {
      // Its shared expert's down projection (12 wide: no 32-blocks) stays F32 in the file, which
      // one shared_experts format cannot say: ask the same formats of both (a format asked that
      // is the stored one still runs the file's blocks).
      check_same_decoding(moe::models::load_gguf_decoder(gguf, nullptr, q8), from_hf, t.V);
    } else {
      check_same_decoding(from_gguf, from_hf, t.V);
    }
    std::visit(
        [&](auto const& d) {
          for (std::string const& w : d.warnings) {
            INFO(w);
            // Every matrix runs as stored; the test's gpt-oss file has Q8_0 expert biases
            REQUIRE((w.find("decoded") == std::string::npos ||
                     (c.type == "gpt_oss" && w.find("9 Q8_0 tensor(s) decoded") == 0)));  // 3 x 3
          }
          if (quantized) {
            REQUIRE(d.embed.blocks_view != nullptr);  // read in place from the mapped file
            REQUIRE(d.embed.format == WeightFormat::kQ8_0);
            REQUIRE(d.lm_head.format() == WeightFormat::kQ8_0);
            REQUIRE(d.blocks[0].attention()->formats().v == WeightFormat::kQ8_0);
          }
          REQUIRE(d.blocks.size() == static_cast<std::size_t>(t.L));
          for (Index l = 0; l < t.L; ++l) {
            REQUIRE(d.blocks[static_cast<std::size_t>(l)].moe.has_value() == !is_dense(t, l));
          }
        },
        from_gguf);
  }
}

TEST_CASE("Decoder: GGUF files of the 2026 architectures decode as their checkpoints",
          "[models][decoder][gguf]") {
  struct Case {
    std::string type;
    bool old;      // the older converter's layout (see write_gguf_2026)
    bool bitwise;  // the same sums in the same order as the checkpoint's decoder
  };
  for (Case const& c :
       {Case{"deepseek_v3", false, true}, Case{"deepseek_v2", true, true},
        Case{"qwen3_next", true, true}, Case{"qwen3_next", false, true},
        Case{"qwen3_5_moe_text", false, false}, Case{"llama4_text", false, false}}) {
    INFO(c.type << (c.old ? " (older converter)" : ""));
    Tiny const t = family_tiny(c.type);
    Tensors const m = make_tensors(t, 906);
    Tensors stored;
    std::string const tag = concat("gguf26_", c.type, c.old ? "_old" : "");
    fs::path const gguf = write_gguf_2026(t, m, tag, c.old, stored);
    // The checkpoints: of the values the file holds, and the original ones. Llama 4's file says
    // what llama.cpp fixes for the architecture: chunks of 8192, every 4th layer NoPE, tuning
    // floor 8192 and scale 0.1.
    fs::path const dir = write_model(t, stored, tag + "_hf");
    fs::path const original = write_model(t, m, tag + "_original");
    if (c.type == "llama4_text") {
      std::string j = config_json(t);
      std::string const tiny =
          concat("\"no_rope_layers\": [1, 0, 1, 1], \"attention_chunk_size\": ", kLlama4Chunk,
                 ", \"attn_temperature_tuning\": true, "
                 "\"floor_scale\": ",
                 kLlama4Floor, ", \"attn_scale\": ", kLlama4Temp);
      REQUIRE(j.find(tiny) != std::string::npos);
      j.replace(j.find(tiny), tiny.size(),
                "\"no_rope_layers\": [1, 1, 1, 0], \"attention_chunk_size\": 8192, "
                "\"attn_temperature_tuning\": true, \"floor_scale\": 8192, \"attn_scale\": 0.1");
      iotest::write_text(dir / "config.json", j);
      iotest::write_text(original / "config.json", j);
    }
    moe::models::AnyDecoder const from_gguf = moe::models::load_gguf_decoder(gguf);
    moe::models::AnyDecoder const from_hf = moe::models::load_hf_decoder(dir);
    if (c.bitwise) {
      check_same_decoding(from_gguf, from_hf, t.V);
    } else {
      check_close_decoding(from_gguf, from_hf, t.V, 1e-5);
    }
    // Against the original values: the converter's changes undone, not merely mirrored.
    check_close_decoding(from_gguf, moe::models::load_hf_decoder(original), t.V, 1e-5);
    // save_gguf_model writes what the converter writes today (the newer layouts): tensor for
    // tensor the test's file where it is of the newer converter (names, types, shapes; values
    // within float rounding: -exp(log(-a)), the RoPE factors' frequencies in float), and a
    // file that decodes as the checkpoint in every case.
    fs::path const ours = dir.parent_path() / (tag + "_ours.gguf");
    moe::models::GgufSaveReport const r = moe::models::save_gguf_model(ours, dir);
    REQUIRE(r.fallbacks.empty());
    REQUIRE(r.tensors_by_type.size() == 1);  // F32 stays F32
    check_close_decoding(moe::models::load_gguf_decoder(ours), from_hf, t.V, 1e-5);
    if (!c.old) {
      moe::io::GgufModel const a(ours), b(gguf);
      REQUIRE(a.names().size() == b.names().size());
      for (std::string_view const n : b.names()) {
        INFO(n);
        REQUIRE(a.has_tensor(n));
        moe::io::GgufTensorInfo const &x = a.tensor(n), &y = b.tensor(n);
        REQUIRE(x.type == y.type);
        REQUIRE(x.shape() == y.shape());
        std::span<float const> const fx(reinterpret_cast<float const*>(x.data.data()),
                                        x.data.size() / 4);
        std::span<float const> const fy(reinterpret_cast<float const*>(y.data.data()),
                                        y.data.size() / 4);
        for (std::size_t i = 0; i < fx.size(); ++i) {
          REQUIRE(std::abs(fx[i] - fy[i]) <= 1e-6f * std::max(1.0f, std::abs(fy[i])));
        }
      }
      for (moe::io::GgufKeyValue const& kv : b.metadata().metadata()) {
        INFO(kv.key);  // (the test writes a context length the tiny configs do not all have)
        REQUIRE((a.metadata().has(kv.key) || kv.key.ends_with(".context_length")));
      }
    }
    std::visit(
        [&](auto const& d) {
          REQUIRE(d.blocks.size() == static_cast<std::size_t>(t.L));
          for (std::string const& w : d.warnings) {
            INFO(w);
            REQUIRE(w.find("not read") == std::string::npos);  // every tensor has a name
          }
          for (Index l = 0; l < t.L; ++l) {
            auto const& b = d.blocks[static_cast<std::size_t>(l)];
            REQUIRE(b.moe.has_value() == !is_dense(t, l));
            REQUIRE((b.deltanet() != nullptr) == linear_layer(t, l));
            REQUIRE((b.mla() != nullptr) == mla_of(t).has_value());
            if (b.deltanet() != nullptr) {
              REQUIRE((b.deltanet()->config().head_order == moe::DeltaNetHeadOrder::kTiled) ==
                      (c.type == "qwen3_5_moe_text"));
              REQUIRE((b.deltanet()->config().layout == moe::DeltaNetLayout::kQwen35) ==
                      (c.type == "qwen3_5_moe_text" || !c.old));
            }
          }
        },
        from_gguf);
  }
}

TEST_CASE("Decoder: a Q4_K_M-style GGUF file runs its blocks as stored, never re-quantized",
          "[models][decoder][gguf]") {
  // Types as llama.cpp's Q4_K_M writes them: Q4_K, with Q6_K for the output matrix, attn_v and
  // the experts' ffn_down, the dense layer's ffn_down in Q5_K, attn_k in Q5_0; attn_output in
  // MXFP4 (gpt-oss's format), and attn_q in IQ2_XXS, which moe has no kernel for.
  Tiny t;
  t.H = 256, t.I_dense = 256, t.I_moe = 256, t.dh = 64;  // whole 256-blocks in every row
  Tensors const m = make_tensors(t, 904);
  TypeOf const type_of = [](std::string const& g, Shape const& shape) {
    if (shape.size() < 2 || g.find("ffn_gate_inp") != std::string::npos) return GgmlType::kF32;
    if (g == "output.weight" || g.find("attn_v.") != std::string::npos ||
        g.find("ffn_down_exps") != std::string::npos) {
      return GgmlType::kQ6_K;
    }
    if (g.find("ffn_down.") != std::string::npos) return GgmlType::kQ5_K;
    if (g.find("attn_k.") != std::string::npos) return GgmlType::kQ5_0;
    if (g.find("attn_q.") != std::string::npos) return GgmlType::kIQ2_XXS;
    if (g.find("attn_output.") != std::string::npos) return GgmlType::kMXFP4;
    return GgmlType::kQ4_K;
  };
  Tensors stored;
  fs::path const gguf = write_gguf(t, m, "gguf_q4_k_m", GgmlType::kF32, stored, type_of);
  moe::io::GgufModel const file(gguf);
  moe::models::AnyDecoder const any = moe::models::load_gguf_decoder(gguf);
  auto const& d = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(any);
  // Every matrix in its stored format; the IQ2_XXS ones as q8_0, with a warning that says so.
  REQUIRE(d.embed.format == WeightFormat::kQ4_K);
  std::span<std::byte const> const embd = file.tensor("token_embd.weight").data;
  REQUIRE(d.embed.blocks_view != nullptr);  // in the decoder's mapping of the file
  REQUIRE(std::memcmp(d.embed.blocks_view, embd.data(), embd.size()) == 0);
  REQUIRE(d.lm_head.format() == WeightFormat::kQ6_K);
  bool said = false;
  for (std::string const& w : d.warnings) {
    said = said || (w.find(concat(t.L, " IQ2_XXS tensor(s): moe has no IQ2_XXS kernel yet")) !=
                        std::string::npos &&
                    w.find("packed as q8_0") != std::string::npos);
    REQUIRE(w.find("Q5_K") == std::string::npos);   // runs as stored
    REQUIRE(w.find("Q5_0") == std::string::npos);   // runs as stored
    REQUIRE(w.find("MXFP4") == std::string::npos);  // runs as stored
  }
  REQUIRE(said);
  // The packs are the file's blocks, re-packed: byte for byte what pack_quant_panels makes of
  // them (a re-quantization would give other scales).
  auto same_pack = [](moe::kernels::QuantWeights const& q, WeightFormat f, std::byte const* rows,
                      Index N, Index K) {
    REQUIRE(q.format == moe::experts::quant_format(f));
    Index const panels = (N + moe::kernels::kQuantPanelCols - 1) / moe::kernels::kQuantPanelCols;
    moe::HugePageVector<std::byte> want(static_cast<std::size_t>(panels * q.panel_bytes));
    moe::kernels::pack_quant_panels(q.format, rows, N, K, want.data());
    REQUIRE(std::memcmp(q.data, want.data(), want.size()) == 0);
  };
  same_pack(d.lm_head.panels().quant[0], WeightFormat::kQ6_K,
            file.tensor("output.weight").data.data(), t.V, t.H);
  for (Index l = 0; l < t.L; ++l) {
    INFO("layer " << l);
    auto const& b = d.blocks[static_cast<std::size_t>(l)];
    moe::AttentionFormats const f = b.attention()->formats();
    REQUIRE((f.q == WeightFormat::kQ8_0 && f.k == WeightFormat::kQ5_0 &&
             f.v == WeightFormat::kQ6_K && f.o == WeightFormat::kMXFP4));
    REQUIRE(b.attention()->master_weights_discarded());
    std::string const p = concat("blk.", l, ".");
    if (!b.moe) {
      REQUIRE(b.mlp.gate.format() == WeightFormat::kQ4_K);
      REQUIRE(b.mlp.down.format() == WeightFormat::kQ5_K);  // as stored
      same_pack(b.mlp.gate.panels().quant[0], WeightFormat::kQ4_K,
                file.tensor(p + "ffn_gate.weight").data.data(), t.I_dense, t.H);
      same_pack(b.mlp.down.panels().quant[0], WeightFormat::kQ5_K,
                file.tensor(p + "ffn_down.weight").data.data(), t.H, t.I_dense);
      continue;
    }
    auto const& bank = b.moe->experts();
    std::span<std::byte const> const gate = file.tensor(p + "ffn_gate_exps.weight").data,
                                     up = file.tensor(p + "ffn_up_exps.weight").data,
                                     down = file.tensor(p + "ffn_down_exps.weight").data;
    for (Index e = 0; e < t.E; ++e) {
      REQUIRE(bank.packed_formats()[static_cast<std::size_t>(e)] ==
              moe::experts::ExpertFormat{WeightFormat::kQ4_K, WeightFormat::kQ6_K});
      auto const in = bank.packed_in_quant(e);
      std::size_t const in_bytes = gate.size() / static_cast<std::size_t>(t.E),
                        down_bytes = down.size() / static_cast<std::size_t>(t.E);
      same_pack(in[0], WeightFormat::kQ4_K, gate.data() + e * in_bytes, t.I_moe, t.H);
      same_pack(in[1], WeightFormat::kQ4_K, up.data() + e * in_bytes, t.I_moe, t.H);
      same_pack(bank.packed_down_quant(e)[0], WeightFormat::kQ6_K, down.data() + e * down_bytes,
                t.H, t.I_moe);
    }
  }
  // The logits: those of the values the blocks hold, in fp32, up to the int8 activations the
  // block kernels multiply (docs/quantization.md).
  fs::path const dir = write_model(t, stored, "gguf_q4_k_m_hf");
  moe::models::AnyDecoder const reference = moe::models::load_hf_decoder(dir);
  auto const& ref = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(reference);
  std::vector<std::int64_t> const ids = {3, 17, 5, 9};
  std::vector<Index> const counts = {4};
  std::vector<float> got(static_cast<std::size_t>(t.V)), want(got.size());
  auto sa = d.make_state(1);
  auto sb = ref.make_state(1);
  d.forward(ids, counts, sa, {got.data(), 1, t.V});
  ref.forward(ids, counts, sb, {want.data(), 1, t.V});
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(got[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::abs(want[i])));
  }
  INFO("worst " << worst << " of " << scale);
  REQUIRE(worst <= 0.03 * scale);
  // Formats asked for replace the stored ones (the experts re-quantized from their values).
  moe::models::DecoderOptions o;
  o.experts = WeightFormat::kQ8_0;
  moe::models::AnyDecoder const asked = moe::models::load_gguf_decoder(gguf, nullptr, o);
  auto const& da = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(asked);
  REQUIRE(da.blocks[0].moe->experts().packed_format() == WeightFormat::kQ8_0);
  REQUIRE(da.blocks[0].attention()->formats().o == WeightFormat::kMXFP4);
}

TEST_CASE("save_gguf_model: a checkpoint in llama.cpp's GGUF layout, tensor for tensor",
          "[models][decoder][gguf]") {
  for (std::string const type : {"qwen3_moe", "qwen2_moe", "olmoe", "glm4_moe", "minimax_m2",
                                 "ernie4_5_moe", "mixtral", "gpt_oss"}) {
    INFO(type);
    Tiny t;
    t.type = type;
    t.H = 32, t.I_dense = 32, t.I_moe = 32;
    if (type == "gpt_oss") t.window = 3, t.swiglu_limit = 7.0f;
    Tensors stored;
    // The test's own writer spells llama.cpp's names and layouts (F32: the values as they are).
    fs::path const theirs =
        write_gguf(t, make_tensors(t, 905), "save_" + type, GgmlType::kF32, stored);
    fs::path const dir = write_model(t, stored, "save_" + type + "_hf");
    fs::path const ours = dir.parent_path() / ("save_" + type + "_ours.gguf");
    moe::models::GgufSaveReport const r = moe::models::save_gguf_model(ours, dir);
    REQUIRE(r.fallbacks.empty());
    REQUIRE(r.tensors_by_type.size() == 1);  // F32 stays F32
    moe::io::GgufModel const a(ours), b(theirs);
    std::size_t matched = 0;
    for (std::string_view const name : b.names()) {
      if (name.starts_with(concat("blk.", t.L, "."))) continue;  // GLM's MTP layer: not written
      INFO(name);
      REQUIRE(a.has_tensor(name));
      moe::io::GgufTensorInfo const &x = a.tensor(name), &y = b.tensor(name);
      REQUIRE(x.type == y.type);
      REQUIRE(x.shape() == y.shape());
      REQUIRE(std::equal(x.data.begin(), x.data.end(), y.data.begin(), y.data.end()));
      ++matched;
    }
    REQUIRE(matched == a.names().size());  // and nothing else
    check_same_decoding(moe::models::load_gguf_decoder(ours), moe::models::load_hf_decoder(dir),
                        t.V);
  }
  // Formats: llama.cpp's Q4_K_M mix from the directory decodes as the directory packed so (the
  // same quantizers on the same values); a GGUF file re-written as stored keeps its blocks.
  Tiny t;
  t.H = 256, t.I_dense = 256, t.I_moe = 256, t.dh = 64;
  Tensors stored;
  TypeOf const type_of = [](std::string const& g, Shape const& shape) {
    if (shape.size() < 2 || g.find("ffn_gate_inp") != std::string::npos) return GgmlType::kF32;
    if (g.find("ffn_down.") != std::string::npos) return GgmlType::kIQ2_XXS;  // no kernel
    if (g.find("attn_output.") != std::string::npos) return GgmlType::kMXFP4;
    return g.find("attn_v.") != std::string::npos ? GgmlType::kQ6_K : GgmlType::kQ4_K;
  };
  fs::path const mixed =
      write_gguf(t, make_tensors(t, 906), "save_mixed", GgmlType::kF32, stored, type_of);
  fs::path const dir = write_model(t, stored, "save_mixed_hf");
  fs::path const q4km = dir.parent_path() / "save_q4_k_m.gguf";
  moe::models::save_gguf_model(q4km, dir, moe::models::DecoderOptions::q4_k_m());
  moe::io::GgufModel const q(q4km);
  REQUIRE(q.tensor("output.weight").type == GgmlType::kQ6_K);
  REQUIRE(q.tensor("token_embd.weight").type == GgmlType::kQ4_K);
  REQUIRE(q.tensor("blk.0.ffn_down_exps.weight").type == GgmlType::kQ4_K);
  REQUIRE(q.tensor("blk.2.ffn_down_exps.weight").type == GgmlType::kQ6_K);  // more_bits(2, 3)
  REQUIRE(q.tensor("blk.0.ffn_gate_inp.weight").type == GgmlType::kF32);
  check_same_decoding(
      moe::models::load_gguf_decoder(q4km),
      moe::models::load_hf_decoder(dir, nullptr, moe::models::DecoderOptions::q4_k_m()), t.V);
  fs::path const copy = dir.parent_path() / "save_copy.gguf";
  moe::models::GgufSaveReport const r = moe::models::save_gguf_model(copy, mixed);
  REQUIRE(r.tensors_by_type.at("Q8_0") == 1);     // the IQ2_XXS matrix: no kernel, written as q8_0
  REQUIRE(r.tensors_by_type.at("MXFP4") == t.L);  // attn_output: as stored
  moe::io::GgufModel const a(copy), b(mixed);
  for (std::string_view const name : b.names()) {
    INFO(name);
    moe::io::GgufTensorInfo const &x = a.tensor(name), &y = b.tensor(name);
    if (y.type == GgmlType::kIQ2_XXS) {
      REQUIRE(x.type == GgmlType::kQ8_0);
      continue;
    }
    REQUIRE(x.type == y.type);
    REQUIRE(std::equal(x.data.begin(), x.data.end(), y.data.begin(), y.data.end()));
  }
}

TEST_CASE("load_gguf_moe_layer: a GGUF MoE layer loads as the directory's of its values",
          "[models][decoder][gguf]") {
  for (auto const& [type, stored_as] : {std::pair{std::string("qwen2_moe"), GgmlType::kF32},
                                        std::pair{std::string("mixtral"), GgmlType::kQ8_0},
                                        std::pair{std::string("gpt_oss"), GgmlType::kQ8_0},
                                        std::pair{std::string("glm4_moe"), GgmlType::kF32}}) {
    INFO(type);
    Tiny t;
    t.type = type;
    t.H = 32, t.I_dense = 32, t.I_moe = 32;
    if (type == "gpt_oss") t.window = 3, t.swiglu_limit = 7.0f;
    Tensors const m = make_tensors(t, 902);
    Tensors stored;
    std::string const tag = "gguf_layer_" + type;
    fs::path const gguf = write_gguf(t, m, tag, stored_as, stored);
    fs::path const dir = write_model(t, stored, tag + "_hf");
    Index const L = type == "glm4_moe" ? 1 : 0;  // GLM's layer 0 is dense
    moe::io::HfAnyLayer const a = moe::io::load_gguf_moe_layer(gguf, L);
    moe::io::HfAnyLayer const b = moe::io::load_hf_moe_layer(dir, L);
    REQUIRE(a.index() == b.index());
    std::visit(
        [&](auto const& la) {
          auto const& lb = std::get<std::remove_cvref_t<decltype(la)>>(b);
          // gpt-oss: the file's split experts load as per-expert tensors, the directory's as
          // transformers' fused ones; either way the layer holds the directory's values.
          REQUIRE(la.layout.fused_experts == (type != "gpt_oss" ? lb.layout.fused_experts : false));
          for (moe::io::HfTensor const& ht : lb.tensors) {
            INFO(ht.name);
            REQUIRE(moe::io::hf_tensor_values(la.layer, ht) ==
                    moe::io::hf_tensor_values(lb.layer, ht));
          }
          for (std::string const& w : la.warnings) {  // no config.json: nothing "lacks" a key
            REQUIRE(w.find("config.json lacks") == std::string::npos);
          }
        },
        a);
  }
  Tiny t;
  t.H = 32, t.I_dense = 32, t.I_moe = 32;
  Tensors stored;
  fs::path const gguf =
      write_gguf(t, make_tensors(t, 903), "gguf_layer_dense", GgmlType::kF32, stored);
  REQUIRE_THROWS_WITH(moe::io::load_gguf_moe_layer(gguf, 1),
                      Catch::Contains("cannot load layer 1") && Catch::Contains("mlp_only_layers"));
}

TEST_CASE("load_hf_layer with pack_formats: every expert packed straight from the file, as pack()",
          "[models][decoder][gguf][packing]") {
  using moe::experts::ExpertFormat;
  using moe::io::HfAnyLayer;
  using moe::io::HfLoadOptions;
  // Per expert: in q8_0 or bf16, down bf16 or fp32 (the shared expert, 12 wide: q8_0 / bf16).
  auto pick = [](bool shared, Index e) {
    if (shared) return ExpertFormat{WeightFormat::kQ8_0, WeightFormat::kBf16};
    return e % 2 == 0 ? ExpertFormat{WeightFormat::kQ8_0, WeightFormat::kBf16}
                      : ExpertFormat{WeightFormat::kBf16, WeightFormat::kF32};
  };
  auto asking = [](auto choose) {
    HfLoadOptions o;
    o.pack_formats = [choose](bool shared, Index n, Index,
                              std::vector<ExpertFormat> const& stored) {
      std::vector<ExpertFormat> f;
      for (Index e = 0; e < n; ++e) f.push_back(choose(shared, e, stored));
      return f;
    };
    return o;
  };
  HfLoadOptions const asked = asking(
      [&](bool shared, Index e, std::vector<ExpertFormat> const&) { return pick(shared, e); });
  HfLoadOptions const as_stored = asking([](bool, Index e, std::vector<ExpertFormat> const& st) {
    return st.at(static_cast<std::size_t>(e));
  });
  auto same_pack = [](auto const& a, auto const& b) {  // banks: formats and records, byte for byte
    REQUIRE(a.packed());
    REQUIRE(b.packed());
    REQUIRE(a.num_experts() == b.num_experts());
    for (Index e = 0; e < a.num_experts(); ++e) {
      INFO("expert " << e);
      REQUIRE(a.packed_formats()[static_cast<std::size_t>(e)] ==
              b.packed_formats()[static_cast<std::size_t>(e)]);
      auto const ra = a.packed_record(e), rb = b.packed_record(e);
      REQUIRE(std::equal(ra.begin(), ra.end(), rb.begin(), rb.end()));
    }
  };
  // `reference`: the layer loaded with its fp32 weights, packed by pack() (or, repack = false,
  // as the loader packed its stored blocks); `fresh`: loaded with pack_formats.
  auto check = [&](HfAnyLayer& reference, HfAnyLayer const& fresh, bool repack) {
    std::visit(
        [&](auto& ref) {
          auto const& got = std::get<std::remove_cvref_t<decltype(ref)>>(fresh);
          auto& rb = ref.layer.experts();
          Index const E = rb.num_experts();
          std::vector<ExpertFormat> formats;
          for (Index e = 0; e < E; ++e) formats.push_back(pick(false, e));
          if (repack) rb.pack(formats);
          REQUIRE_FALSE(got.layer.experts().has_master_weights());
          same_pack(rb, got.layer.experts());
          if constexpr (std::remove_cvref_t<decltype(ref.layer)>::Shared::has_experts) {
            if (ref.layer.shared_experts().count() > 0) {
              auto& sb = ref.layer.shared_experts().bank();
              if (repack) sb.pack(std::vector<ExpertFormat>{pick(true, 0)});
              REQUIRE_FALSE(got.layer.shared_experts().bank().has_master_weights());
              same_pack(sb, got.layer.shared_experts().bank());
            }
          }
          // The rest of the layer (router, biases, selection bias) is the reference's too.
          for (moe::io::HfTensor const& ht : ref.tensors) {
            bool const expert_weight =
                ht.part == moe::io::HfPart::kExpertGate || ht.part == moe::io::HfPart::kExpertUp ||
                ht.part == moe::io::HfPart::kExpertDown ||
                ht.part == moe::io::HfPart::kExpertsGateUp ||
                ht.part == moe::io::HfPart::kExpertsDown ||
                ht.part == moe::io::HfPart::kExpertsGateUpT ||
                ht.part == moe::io::HfPart::kExpertsDownT ||
                ht.part == moe::io::HfPart::kExpertsGateUpI ||
                ht.part == moe::io::HfPart::kSharedGate || ht.part == moe::io::HfPart::kSharedUp ||
                ht.part == moe::io::HfPart::kSharedDown;
            if (expert_weight) continue;
            INFO(ht.name);
            REQUIRE(moe::io::hf_tensor_values(got.layer, ht) ==
                    moe::io::hf_tensor_values(ref.layer, ht));
          }
          // And it runs as the reference does, bit for bit, on 1 and 2 threads.
          Index const T = 7, H = rb.d_model();
          std::vector<float> x(static_cast<std::size_t>(T * H));
          moe::fill_uniform(x, -1.0f, 1.0f, 905);
          std::vector<float> ya(x.size()), yb(x.size()), yc(x.size());
          moe::MoeFfnWorkspace ws;
          moe::ThreadPool pool(2);
          ref.layer.forward({x.data(), T, H}, {ya.data(), T, H}, ws);
          got.layer.forward({x.data(), T, H}, {yb.data(), T, H}, ws);
          got.layer.forward({x.data(), T, H}, {yc.data(), T, H}, ws, {nullptr, &pool});
          REQUIRE(yb == ya);
          REQUIRE(yc == ya);
        },
        reference);
  };
  // Hugging Face directories: per-expert (Qwen2-MoE with a shared expert, Mixtral's w1/w2/w3,
  // ERNIE 4.5 with biases), fused (Llama 4's x @ W, gpt-oss's interleaved one with biases),
  // DeepSeek-V3's ungated shared experts.
  for (std::string const type :
       {"qwen2_moe", "mixtral", "ernie4_5_moe", "llama4_text", "gpt_oss", "deepseek_v3"}) {
    INFO(type);
    Tiny t = family_tiny(type);
    t.H = 32, t.I_dense = 32, t.I_moe = 32;
    fs::path const dir = write_model(t, make_tensors(t, 904), "pack_from_" + type);
    Index L = 0;
    while (is_dense(t, L)) ++L;
    HfAnyLayer reference = moe::io::load_hf_moe_layer(dir, L);
    check(reference, moe::io::load_hf_moe_layer(dir, L, asked), true);
  }
  // GGUF files: the experts' blocks re-packed as stored, or converted to other formats.
  for (std::string const type : {"qwen2_moe", "gpt_oss", "ernie4_5_moe"}) {
    INFO(type << " GGUF");
    Tiny t = family_tiny(type);
    t.H = 32, t.I_dense = 32, t.I_moe = 32;
    Tensors stored;
    fs::path const gguf =
        write_gguf(t, make_tensors(t, 906), "pack_from_gguf_" + type, GgmlType::kQ8_0, stored);
    Index L = 0;
    while (is_dense(t, L)) ++L;
    HfAnyLayer reference = moe::io::load_gguf_moe_layer(gguf, L);  // packed as stored
    check(reference, moe::io::load_gguf_moe_layer(gguf, L, as_stored), false);
    HfAnyLayer reference2 = moe::io::load_gguf_moe_layer(gguf, L);
    check(reference2, moe::io::load_gguf_moe_layer(gguf, L, asked), true);
  }
  // GLU experts whose bf16 in projection would split a panel need their fp32 weights: the
  // shared expert of width 12 is then loaded with them, and packed as asked.
  Tiny t = family_tiny("qwen2_moe");
  t.H = 32, t.I_dense = 32, t.I_moe = 32;
  fs::path const dir = write_model(t, make_tensors(t, 907), "pack_from_odd");
  HfLoadOptions const bf16 = asking([](bool, Index, std::vector<ExpertFormat> const&) {
    return ExpertFormat{WeightFormat::kBf16, WeightFormat::kBf16};
  });
  auto const odd =
      std::get<moe::io::HfLayer<moe::presets::Qwen2Moe>>(moe::io::load_hf_moe_layer(dir, 0, bf16));
  REQUIRE(odd.layer.shared_experts().bank().has_master_weights());
  REQUIRE(odd.layer.shared_experts().bank().packed_format() == WeightFormat::kBf16);
  REQUIRE(odd.layer.experts().packed_format() == WeightFormat::kBf16);
}

TEST_CASE("Decoder: experts streamed straight from a GGUF file decode as resident ones",
          "[models][decoder][gguf][offload]") {
  // The file's Q8_0 expert blocks re-packed on each miss (no store); asked as bf16, the blocks
  // decoded and packed as bf16 panels. A cache that holds nothing, and one that holds all.
  for (std::string const type : {"qwen2_moe", "gpt_oss"}) {
    Tiny t = family_tiny(type);
    t.H = 32, t.I_dense = 32, t.I_moe = 32;
    Tensors stored;
    fs::path const gguf =
        write_gguf(t, make_tensors(t, 912), "gguf_stream_" + type, GgmlType::kQ8_0, stored);
    for (bool const bf16 : {false, true}) {
      for (std::uint64_t const budget : {std::uint64_t{0}, std::uint64_t{1} << 30}) {
        INFO(type << (bf16 ? ", bf16 experts" : ", as stored") << ", budget " << budget);
        moe::models::DecoderOptions resident;
        if (bf16) resident.experts = WeightFormat::kBf16;
        moe::models::DecoderOptions streamed = resident;
        streamed.stream_experts = true;
        streamed.streaming.budget_bytes = budget;
        moe::models::AnyDecoder const s = moe::models::load_gguf_decoder(gguf, nullptr, streamed);
        check_same_decoding(s, moe::models::load_gguf_decoder(gguf, nullptr, resident), t.V);
        std::visit(
            [&](auto const& d) {
              REQUIRE(d.streamer != nullptr);
              moe::offload::StreamStats const& st = d.streamer->stats();
              CHECK(st.misses + st.bypasses > 0);
              if (budget == 0) CHECK(st.hits == 0);
              std::vector<std::size_t> const blocks = d.moe_blocks();
              auto const& bank = d.blocks[blocks.front()].moe->experts();
              CHECK(bank.packed_format() == (bf16 ? WeightFormat::kBf16 : WeightFormat::kQ8_0));
            },
            s);
      }
    }
    // q4_0 is not what the file stores: quantizing each miss is refused.
    moe::models::DecoderOptions q4;
    q4.stream_experts = true;
    q4.experts = WeightFormat::kQ4_0;
    REQUIRE_THROWS_WITH(moe::models::load_gguf_decoder(gguf, nullptr, q4),
                        Catch::Contains("stores it as q8_0") && Catch::Contains("expert store"));
  }
}

TEST_CASE("Decoder: GGUF files moe cannot read are refused with the reason",
          "[models][decoder][gguf]") {
  using V = moe::io::GgufMetadataValue;
  moe::io::GgufWriter w;
  w.set("general.architecture", V(std::string("jamba")));
  fs::path const file = iotest::scratch_dir("gguf_refused") / "model.gguf";
  w.save(file);
  REQUIRE_THROWS_WITH(moe::models::load_gguf_decoder(file),
                      Catch::Contains("'jamba' is not one moe reads yet") &&
                          Catch::Contains("\"qwen3moe\"") && Catch::Contains("\"deepseek2\"") &&
                          Catch::Contains("\"qwen3next\"") && Catch::Contains("\"qwen35moe\"") &&
                          Catch::Contains("\"llama4\""));
  moe::io::GgufWriter q;
  q.set("general.architecture", V(std::string("qwen3moe")));
  q.set("qwen3moe.block_count", V(std::uint32_t{2}));
  q.set("qwen3moe.embedding_length", V(std::uint32_t{32}));
  fs::path const partial = iotest::scratch_dir("gguf_partial") / "model.gguf";
  q.save(partial);
  REQUIRE_THROWS_WITH(moe::models::load_gguf_decoder(partial),
                      Catch::Contains("qwen3moe.expert_feed_forward_length"));
  // A block_count past the file's tensors (found by the gguf_model fuzzer: 2^28 layers in a
  // 2 KB file made every per-layer list of the config that long) is refused before any is made.
  q.set("qwen3moe.block_count", V(std::uint32_t{1} << 28));
  q.set("qwen3moe.expert_feed_forward_length", V(std::uint32_t{16}));
  q.set("qwen3moe.expert_count", V(std::uint32_t{4}));
  q.set("qwen3moe.expert_used_count", V(std::uint32_t{2}));
  q.add_tensor("blk.1.attn_norm.weight", GgmlType::kF32, {32},
               std::vector<std::byte>(32 * sizeof(float)));
  fs::path const tall = iotest::scratch_dir("gguf_tall") / "model.gguf";
  q.save(tall);
  REQUIRE_THROWS_WITH(moe::models::load_gguf_decoder(tall),
                      Catch::Contains("qwen3moe.block_count = 268435456 but the file's tensors "
                                      "hold 2 blocks (blk.0 to blk.1); the file is corrupt"));
}

#ifdef MOE_GENERATE
TEST_CASE("moe_generate: a GGUF file generates as the checkpoint of its values; bad ones fail",
          "[models][decoder][generate][gguf]") {
  Tiny t;
  t.H = 32, t.I_dense = 32, t.I_moe = 32;
  Tensors const m = make_tensors(t, 901);
  Tensors stored;
  fs::path const gguf = write_gguf(t, m, "generate_gguf", GgmlType::kQ8_0, stored);
  fs::path const dir = write_model(t, stored, "generate_gguf_hf");
  std::string const tail = " --prompt-ids 3,17,5 --max-new-tokens 4 --logits '";
  REQUIRE(run_generate(
              "--model '" + gguf.string() + "'" + tail + (dir / "g.safetensors").string() + "'",
              dir) == 0);
  std::string const ids = text_of(dir / "out.txt");
  // Its Q8_0 matrices run as stored: as the directory of their values packed in q8_0.
  REQUIRE_THAT(text_of(dir / "err.txt"), !Catch::Contains("decoded"));
  REQUIRE(run_generate("--model '" + dir.string() + "' --dense q8_0 --experts q8_0" + tail +
                           (dir / "h.safetensors").string() + "'",
                       dir) == 0);
  REQUIRE(text_of(dir / "out.txt") == ids);
  moe::io::SafetensorsFile const g(dir / "g.safetensors"), h(dir / "h.safetensors");
  REQUIRE(moe::io::to_float(g.tensor("logits")) == moe::io::to_float(h.tensor("logits")));
  // --logits may not overwrite the model; a truncated GGUF file fails in one line.
  std::vector<std::byte> const before = iotest::read_file(gguf);
  REQUIRE(run_generate("--model '" + gguf.string() + "'" + tail + gguf.string() + "'", dir) == 1);
  REQUIRE(iotest::read_file(gguf) == before);
  fs::path const cut = dir / "cut.gguf";
  iotest::write_file(cut, std::vector<std::byte>(before.begin(), before.begin() + 200));
  REQUIRE(run_generate("--model '" + cut.string() + "' --prompt-ids 1 --max-new-tokens 1", dir) ==
          1);
  std::string const err = text_of(dir / "err.txt");
  REQUIRE(std::count(err.begin(), err.end(), '\n') == 1);
  REQUIRE_THAT(err, Catch::StartsWith("moe_generate: ") && Catch::Contains("cut.gguf"));
}

TEST_CASE("moe_generate --help exits 0 and names every weight format the library has",
          "[models][decoder][generate]") {
  fs::path const dir = iotest::scratch_dir("generate_help");
  REQUIRE(run_generate("--help", dir) == 0);
  std::string const help = text_of(dir / "out.txt");
  for (WeightFormat const f : moe::experts::kBlockFormats) {
    INFO(moe::experts::name(f));
    REQUIRE_THAT(help, Catch::Contains(concat(moe::experts::name(f), ",")) ||
                           Catch::Contains(concat(moe::experts::name(f), " ")));
  }
}

TEST_CASE("moe_generate: GGUF files of the 2026 architectures generate as their checkpoints",
          "[models][decoder][generate][gguf]") {
  // The files of "GGUF files of the 2026 architectures decode as their checkpoints" through the
  // command: the same ids and logits as the checkpoint of the values they hold, cached and not.
  for (char const* type : {"deepseek_v3", "qwen3_next"}) {
    INFO(type);
    Tiny const t = family_tiny(type);
    Tensors stored;
    std::string const tag = concat("generate_gguf26_", type);
    fs::path const gguf = write_gguf_2026(t, make_tensors(t, 907), tag, false, stored);
    fs::path const dir = write_model(t, stored, tag + "_hf");
    std::string const tail = " --prompt-ids 3,17,5 --max-new-tokens 4 --logits '";
    REQUIRE(run_generate("--model '" + gguf.string() + "'" + tail +
                             (dir / "g.safetensors").string() + "' --threads 2",
                         dir) == 0);
    std::string const ids = text_of(dir / "out.txt");
    REQUIRE(run_generate("--model '" + dir.string() + "'" + tail +
                             (dir / "h.safetensors").string() + "' --no-cache",
                         dir) == 0);
    REQUIRE(text_of(dir / "out.txt") == ids);
    moe::io::SafetensorsFile const g(dir / "g.safetensors"), h(dir / "h.safetensors");
    std::vector<float> const lg = moe::io::to_float(g.tensor("logits")),
                             lh = moe::io::to_float(h.tensor("logits"));
    REQUIRE(lg.size() == lh.size());
    float worst = 0.0f, scale = 0.0f;
    for (std::size_t i = 0; i < lg.size(); ++i) {
      worst = std::max(worst, std::abs(lg[i] - lh[i]));
      scale = std::max(scale, std::abs(lh[i]));
    }
    INFO(worst << " of " << scale);
    REQUIRE(worst <= 1e-4f * scale);  // cached against recomputed
  }
}
#endif  // MOE_GENERATE

#if defined(MOE_GENERATE) && defined(MOE_QUANTIZE)
TEST_CASE("moe_quantize --out FILE.gguf: the whole model in llama.cpp's GGUF, run as stored",
          "[models][decoder][generate][gguf]") {
  Tiny t;
  t.H = 32, t.I_dense = 32, t.I_moe = 32;
  fs::path const dir = write_model(t, make_tensors(t, 907), "quantize_gguf_hf");
  fs::path const gguf = dir.parent_path() / "quantize_gguf.gguf";
  auto quantize = [&](std::string const& args) {
    std::string command = "'";
    command.append(MOE_QUANTIZE).append("' ").append(args);
    command.append(" >'").append((dir / "q_out.txt").string()).append("'");
    command.append(" 2>'").append((dir / "q_err.txt").string()).append("'");
    int const status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  REQUIRE(quantize("--model '" + dir.string() + "' --out '" + gguf.string() + "' --mix q4_k_m") ==
          0);
  REQUIRE_THAT(text_of(dir / "q_out.txt"), Catch::StartsWith("moe_quantize: wrote ") &&
                                               Catch::Contains("Q4_0 x") &&
                                               Catch::Contains("Q8_0 x"));
  // 32-wide rows: q4_k falls back to q4_0, q6_k to q8_0, as llama.cpp falls back per tensor.
  REQUIRE_THAT(text_of(dir / "q_err.txt"), Catch::Contains("fell back"));
  // The file runs as stored: what the directory gives packed in the same mix.
  std::string const tail = " --prompt-ids 3,17,5 --max-new-tokens 4 --logits '";
  REQUIRE(run_generate(
              "--model '" + gguf.string() + "'" + tail + (dir / "g.safetensors").string() + "'",
              dir) == 0);
  std::string const ids = text_of(dir / "out.txt");
  REQUIRE(run_generate("--model '" + dir.string() + "' --mix q4_k_m" + tail +
                           (dir / "h.safetensors").string() + "'",
                       dir) == 0);
  REQUIRE(text_of(dir / "out.txt") == ids);
  moe::io::SafetensorsFile const g(dir / "g.safetensors"), h(dir / "h.safetensors");
  REQUIRE(moe::io::to_float(g.tensor("logits")) == moe::io::to_float(h.tensor("logits")));
  // One layer's options with a model file, and the model as its own output: one line, exit 1.
  REQUIRE(quantize("--model '" + dir.string() + "' --out '" + gguf.string() + "' --layer 0") == 1);
  REQUIRE_THAT(text_of(dir / "q_err.txt"), Catch::Contains("--layer quantizes one layer"));
  REQUIRE(quantize("--model '" + gguf.string() + "' --out '" + gguf.string() + "'") == 1);
  REQUIRE_THAT(text_of(dir / "q_err.txt"), Catch::Contains("is the --model file"));
}
#endif
