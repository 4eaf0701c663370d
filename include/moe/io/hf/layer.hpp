// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Loading one MoE layer of a Hugging Face checkpoint into moe's preset layers, saving a layer
/// as a checkpoint, and naming its gradients after the checkpoint tensors.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/views.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/io/block_tensor.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/output_file.hpp"
#include "moe/io/hf/config.hpp"
#include "moe/io/hf/names.hpp"
#include "moe/io/safetensors.hpp"
#include "moe/layers/presets.hpp"
#include "moe/quant/blocks.hpp"

namespace moe::io {

// ---------------------------------------------------------------------------------------------
// Families, preset configs and layer types.

namespace detail {
/// An HfMoeConfig of `family` with these sizes; the top-k weights renormalised as the family
/// does (`norm` where config.json decides it).
inline HfMoeConfig hf_sized(HfFamily family, Index hidden, Index width, Index experts, Index top_k,
                            bool norm = false) {
  HfMoeConfig c;
  c.family = family;
  c.hidden_size = hidden;
  c.expert_intermediate_size = width;
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  HfNormTopK const rule = c.spec().norm_topk;
  c.norm_topk_prob = rule == HfNormTopK::kAlways || (rule == HfNormTopK::kKey && norm);
  return c;
}
}  // namespace detail

/// HfMoeConfig of a preset configuration (the inverse of the mapping load_hf_layer() uses).
/// num_hidden_layers stays -1 (unknown) and every layer counts as an MoE layer.
inline HfMoeConfig hf_config(presets::MixtralConfig const& p) {
  return detail::hf_sized(HfFamily::kMixtral, p.hidden_size, p.intermediate_size,
                          p.num_local_experts, p.num_experts_per_tok);
}
inline HfMoeConfig hf_config(presets::Qwen2MoeConfig const& p) {
  HfMoeConfig c = detail::hf_sized(HfFamily::kQwen2Moe, p.hidden_size, p.moe_intermediate_size,
                                   p.num_experts, p.num_experts_per_tok, p.norm_topk_prob);
  c.shared_expert_intermediate_size = p.shared_expert_intermediate_size;
  return c;
}
inline HfMoeConfig hf_config(presets::Qwen3MoeConfig const& p) {
  return detail::hf_sized(HfFamily::kQwen3Moe, p.hidden_size, p.moe_intermediate_size,
                          p.num_experts, p.num_experts_per_tok, p.norm_topk_prob);
}
inline HfMoeConfig hf_config(presets::DeepseekV3Config const& p) {
  HfMoeConfig c = detail::hf_sized(HfFamily::kDeepseekV3, p.hidden_size, p.moe_intermediate_size,
                                   p.n_routed_experts, p.num_experts_per_tok, p.norm_topk_prob);
  c.n_group = p.n_group;
  c.topk_group = p.topk_group;
  c.routed_scaling_factor = p.routed_scaling_factor;
  c.n_shared_experts = p.n_shared_experts;
  return c;
}
inline HfMoeConfig hf_config(presets::OlmoeConfig const& p) {
  return detail::hf_sized(HfFamily::kOlmoe, p.hidden_size, p.intermediate_size, p.num_experts,
                          p.num_experts_per_tok, p.norm_topk_prob);
}
inline HfMoeConfig hf_config(presets::Qwen3NextConfig const& p) {
  HfMoeConfig c = hf_config(presets::Qwen2MoeConfig{
      p.hidden_size, p.moe_intermediate_size, p.shared_expert_intermediate_size, p.num_experts,
      p.num_experts_per_tok, p.norm_topk_prob});
  c.family = HfFamily::kQwen3Next;
  return c;
}
inline HfMoeConfig hf_config(presets::Glm4MoeConfig const& p) {
  HfMoeConfig c = hf_config(presets::DeepseekV3Config{
      p.hidden_size, p.moe_intermediate_size, p.n_routed_experts, p.num_experts_per_tok, p.n_group,
      p.topk_group, p.routed_scaling_factor, p.n_shared_experts, p.norm_topk_prob});
  c.family = HfFamily::kGlm4Moe;
  return c;
}
inline HfMoeConfig hf_config(presets::DeepseekV2Config const& p) {
  HfMoeConfig c = hf_config(presets::DeepseekV3Config{
      p.hidden_size, p.moe_intermediate_size, p.n_routed_experts, p.num_experts_per_tok, p.n_group,
      p.topk_group, p.routed_scaling_factor, p.n_shared_experts, false});
  c.family = HfFamily::kDeepseekV2;
  c.scoring_func = "softmax";
  c.topk_method = p.n_group == 1 && p.topk_group == 1 ? "greedy" : "group_limited_greedy";
  return c;
}
inline HfMoeConfig hf_config(presets::MinimaxM2Config const& p) {
  return detail::hf_sized(HfFamily::kMinimaxM2, p.hidden_size, p.intermediate_size,
                          p.num_local_experts, p.num_experts_per_tok);
}
inline HfMoeConfig hf_config(presets::Llama4Config const& p) {
  return detail::hf_sized(HfFamily::kLlama4, p.hidden_size, p.intermediate_size,
                          p.num_local_experts, p.num_experts_per_tok);
}
inline HfMoeConfig hf_config(presets::Ernie45MoeConfig const& p) {
  HfMoeConfig c = detail::hf_sized(HfFamily::kErnie45Moe, p.hidden_size, p.moe_intermediate_size,
                                   p.moe_num_experts, p.moe_k);
  c.n_shared_experts = p.moe_num_shared_experts;
  c.moe_layer_start_index = 0;  // every layer an MoE layer, as the other preset configs
  c.moe_norm_min = p.moe_norm_min;
  c.scoring_func = "softmax";
  c.use_bias = p.use_bias;
  return c;
}
inline HfMoeConfig hf_config(presets::GptOssConfig const& p) {
  HfMoeConfig c = detail::hf_sized(HfFamily::kGptOss, p.hidden_size, p.intermediate_size,
                                   p.num_local_experts, p.num_experts_per_tok);
  c.swiglu_limit = p.swiglu_limit;
  c.swiglu_alpha = p.swiglu_alpha;
  return c;
}

// Qwen3-MoE and OLMoE share one C++ type; HfAnyLayer relies on the four types below differing.
static_assert(std::is_same_v<presets::Qwen3Moe, presets::OlmoeMoe>,
              "moe::io::HfAnyLayer holds Qwen3-MoE and OLMoE layers in one alternative; give "
              "OlmoeMoe its own alternative if the presets ever make them different types");

/// Does the preset layer type `Layer` hold layers of `family`? Six types hold the thirteen
/// families: MixtralMoe (mixtral); Llama4Moe (llama4_text); GptOssMoe (gpt_oss); Qwen2Moe
/// (qwen2_moe, qwen3_next, qwen3_5_moe_text); Qwen3Moe == OlmoeMoe (qwen3_moe, olmoe);
/// DeepseekV3Moe (deepseek_v3, glm4_moe, deepseek_v2, minimax_m2, ernie4_5_moe: GroupLimitedTopK
/// with the family's scores, bias, groups and normalisation).
template <class Layer>
constexpr bool hf_family_matches(HfFamily family) noexcept {
  switch (hf_family(family).layer_type) {
    case HfLayerType::kMixtral:
      return std::is_same_v<Layer, presets::MixtralMoe>;
    case HfLayerType::kQwen2Moe:
      return std::is_same_v<Layer, presets::Qwen2Moe>;
    case HfLayerType::kQwen3Moe:
      return std::is_same_v<Layer, presets::Qwen3Moe>;
    case HfLayerType::kDeepseekV3:
      return std::is_same_v<Layer, presets::DeepseekV3Moe>;
    case HfLayerType::kLlama4:
      return std::is_same_v<Layer, presets::Llama4Moe>;
    case HfLayerType::kGptOss:
      return std::is_same_v<Layer, presets::GptOssMoe>;
  }
  return false;
}

/// Calls f(presets::XMoe{}) -- a tag of the preset layer type that holds `family`'s layers
/// (HfFamilySpec::layer_type) -- and returns what it returns: the one dispatch from a family
/// to a C++ type.
template <class F>
decltype(auto) visit_hf_layer_type(HfFamily family, F&& f) {
  switch (hf_family(family).layer_type) {
    case HfLayerType::kMixtral:
      return f(std::type_identity<presets::MixtralMoe>{});
    case HfLayerType::kQwen2Moe:
      return f(std::type_identity<presets::Qwen2Moe>{});
    case HfLayerType::kQwen3Moe:
      return f(std::type_identity<presets::Qwen3Moe>{});
    case HfLayerType::kDeepseekV3:
      return f(std::type_identity<presets::DeepseekV3Moe>{});
    case HfLayerType::kLlama4:
      return f(std::type_identity<presets::Llama4Moe>{});
    case HfLayerType::kGptOss:
      break;
  }
  return f(std::type_identity<presets::GptOssMoe>{});
}

namespace detail {
/// The router of a DeepseekV3Moe-type layer for config `c` (GLM-4.5, DeepSeek-V2, MiniMax-M2
/// and ERNIE 4.5 differ from DeepSeek-V3 in scores, groups, bias and normalisation only).
inline routing::GroupLimitedTopK hf_group_router(HfMoeConfig const& c) {
  HfGroupRouting const& how = c.spec().routing;
  routing::GroupLimitedTopK r;
  r.num_experts = c.num_experts;
  r.top_k = c.num_experts_per_tok;
  r.n_group = c.n_group;
  r.topk_group = c.topk_group;
  r.normalize = c.norm_topk_prob;
  r.scale = c.routed_scaling_factor;
  if (c.scoring_func == "softmax") r.scoring = routing::ScoreFunction::kSoftmax;
  if (how.group_max) r.group_score = routing::GroupScore::kMax;
  if (how.exact_norm) r.norm_epsilon = 0.0f;
  if (how.norm_min) r.norm_min = c.moe_norm_min;
  if (c.has_selection_bias()) r.bias.assign(static_cast<std::size_t>(c.num_experts), 0.0f);
  return r;
}
}  // namespace detail

/// A layer of type `Layer` with zero weights, shaped and routed as config `c` says:
/// make_mixtral / make_qwen2_moe / make_qwen3_moe / make_deepseek_v3 / make_olmoe with the
/// config's sizes, top-k, norm_topk_prob, groups, routed_scaling_factor and shared experts
/// (Qwen3-Next in the Qwen2Moe type; GLM-4.5, DeepSeek-V2, MiniMax-M2 and ERNIE 4.5 in the
/// DeepseekV3Moe type, with their routers as detail::hf_group_router sets them, and ERNIE's
/// expert biases with use_bias; gpt-oss with its router bias, expert biases and clamp).
/// Throws moe::Error when `Layer` is not the preset type of c.family.
template <class Layer>
Layer make_hf_layer(HfMoeConfig const& c) {
  moe::detail::check(hf_family_matches<Layer>(c.family), "hf: a ", c.model_type(),
                     " layer cannot be built as this layer type; use the preset type of its "
                     "family (or load_hf_moe_layer(), which picks it)");
  if constexpr (std::is_same_v<Layer, presets::MixtralMoe>) {
    return presets::make_mixtral(
        {c.hidden_size, c.expert_intermediate_size, c.num_experts, c.num_experts_per_tok});
  } else if constexpr (std::is_same_v<Layer, presets::Qwen2Moe>) {
    return presets::make_qwen2_moe({c.hidden_size, c.expert_intermediate_size,
                                    c.shared_expert_intermediate_size, c.num_experts,
                                    c.num_experts_per_tok, c.norm_topk_prob});
  } else if constexpr (std::is_same_v<Layer, presets::Llama4Moe>) {
    return presets::make_llama4(
        {c.hidden_size, c.expert_intermediate_size, c.num_experts, c.num_experts_per_tok});
  } else if constexpr (std::is_same_v<Layer, presets::GptOssMoe>) {
    return presets::make_gpt_oss({c.hidden_size, c.expert_intermediate_size, c.num_experts,
                                  c.num_experts_per_tok, c.swiglu_limit, c.swiglu_alpha});
  } else if constexpr (std::is_same_v<Layer, presets::Qwen3Moe>) {
    return presets::make_qwen3_moe({c.hidden_size, c.expert_intermediate_size, c.num_experts,
                                    c.num_experts_per_tok, c.norm_topk_prob});
  } else {
    static_assert(std::is_same_v<Layer, presets::DeepseekV3Moe>, "not a preset MoE layer type");
    Index const shared = c.shared_intermediate_size();
    presets::DeepseekV3Moe layer(
        c.hidden_size, c.expert_intermediate_size, detail::hf_group_router(c),
        experts::UngatedSharedExperts<experts::SwiGlu>(shared > 0 ? 1 : 0, c.hidden_size,
                                                       std::max<Index>(1, shared)));
    if (c.has_expert_biases()) {  // ERNIE 4.5 use_bias
      layer.experts().enable_biases();
      layer.shared_experts().bank().enable_biases();
    }
    return layer;
  }
}

/// A layer loaded from a checkpoint, with where each of its tensors came from.
///
/// `tensors` lists every checkpoint tensor of the layer (hf_layer_tensors()) with its name:
/// runners name gradients "grad." + name (add_hf_gradients()), and hf_tensor_values() /
/// hf_gradient_values() give any of them back in the checkpoint's own layout.
template <class Layer>
struct HfLayer {
  HfMoeConfig config;             ///< the parsed config.json
  Index layer_index = 0;          ///< L
  HfLayout layout;                ///< prefix and per-expert / fused experts
  std::vector<HfTensor> tensors;  ///< every tensor read, in hf_layer_tensors() order
  Layer layer;                    ///< the weights
  /// For a checkpoint of experts stored as blocks (save_hf_layer_quantized, a GGUF file): the
  /// stored format of every routed expert, and of the shared expert (the layer is packed in
  /// them, unless HfLoadOptions::pack_formats asks for others); else empty.
  std::vector<experts::ExpertFormat> stored_formats;
  std::vector<experts::ExpertFormat> stored_shared_formats;
  /// What the loader accepted but a user should hear about (hf_load_warnings()): config.json
  /// keys transformers does not know, keys that took defaults, and checkpoint tensors of the
  /// layer's module that config.json does not account for (e.g. a 9th expert when it says 8).
  /// Empty when everything matched; HfLoadOptions::strict turns them into an error.
  std::vector<std::string> warnings;
};

/// A loaded layer of any supported family (load_hf_moe_layer()); config.family tells which
/// (see hf_family_matches() for the families each alternative holds). Use std::visit.
using HfAnyLayer = std::variant<HfLayer<presets::MixtralMoe>, HfLayer<presets::Qwen2Moe>,
                                HfLayer<presets::Qwen3Moe>, HfLayer<presets::DeepseekV3Moe>,
                                HfLayer<presets::Llama4Moe>, HfLayer<presets::GptOssMoe>>;

// ---------------------------------------------------------------------------------------------
// Moving values between checkpoint tensors and layers.

namespace detail {

inline void append_view(std::vector<float>& out, ConstMatrixView<float> v) {
  for (Index r = 0; r < v.rows; ++r) out.insert(out.end(), v.row(r), v.row(r) + v.cols);
}

/// v^T appended row by row ([cols, rows]): the x @ W layouts of Llama 4's fused experts.
inline void append_transposed(std::vector<float>& out, ConstMatrixView<float> v) {
  for (Index c = 0; c < v.cols; ++c) {
    for (Index r = 0; r < v.rows; ++r) out.push_back(v(r, c));
  }
}

/// The inverse of append_transposed: v = src^T for src [v.cols, v.rows]; returns src's end.
inline float const* copy_transposed_into_view(float const* src, MatrixView<float> v) {
  for (Index c = 0; c < v.cols; ++c) {
    for (Index r = 0; r < v.rows; ++r) v(r, c) = *src++;
  }
  return src;
}

inline float const* copy_into_view(float const* src, MatrixView<float> v) {
  for (Index r = 0; r < v.rows; ++r) {
    std::copy(src, src + v.cols, v.row(r));
    src += v.cols;
  }
  return src;
}

/// The values of tensor `t` (row-major, its checkpoint shape) from a layer's parts: the router
/// weight [E, H], the selection bias (DeepSeek-V3; may be empty: zeros), the routed experts'
/// bank and the shared experts. Works on a layer and on its Gradients alike.
template <class Bank, class Shared>
std::vector<float> gather_tensor(HfTensor const& t, float const* router,
                                 std::span<float const> bias, std::span<float const> router_bias,
                                 Bank const& bank, Shared const& shared) {
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(t.num_elements()));
  Index const E = bank.num_experts(), H = bank.d_model(), I = bank.d_ffn();
  auto append_span = [&](std::span<float const> v, std::size_t from, std::size_t n) {
    moe::detail::check(v.size() >= from + n, "hf: tensor ", printable_name(t.name),
                       " is a bias the layer does not have; the layer and its config disagree");
    out.insert(out.end(), v.begin() + static_cast<std::ptrdiff_t>(from),
               v.begin() + static_cast<std::ptrdiff_t>(from + n));
  };
  switch (t.part) {
    case HfPart::kRouterBias:
      append_span(router_bias, 0, static_cast<std::size_t>(E));
      break;
    case HfPart::kExpertsGateUpI:  // [H, 2I]: column 2j gate row j, 2j + 1 up row j
      for (Index e = 0; e < E; ++e) {
        auto const w = bank.in_proj(e);
        for (Index h = 0; h < H; ++h) {
          for (Index j = 0; j < I; ++j) {
            out.push_back(w(j, h));
            out.push_back(w(I + j, h));
          }
        }
      }
      break;
    case HfPart::kExpertsGateUpBias:
      for (Index e = 0; e < E; ++e) {
        auto const b = bank.in_bias(e);
        moe::detail::check(!b.empty(), "hf: tensor ", printable_name(t.name),
                           " is a bias the layer does not have; the layer and its config disagree");
        for (Index j = 0; j < I; ++j) {
          out.push_back(b[static_cast<std::size_t>(j)]);
          out.push_back(b[static_cast<std::size_t>(I + j)]);
        }
      }
      break;
    case HfPart::kExpertsDownBias:
      for (Index e = 0; e < E; ++e) append_span(bank.down_bias(e), 0, static_cast<std::size_t>(H));
      break;
    case HfPart::kExpertGateBias:
      append_span(bank.in_bias(t.expert), 0, static_cast<std::size_t>(I));
      break;
    case HfPart::kExpertUpBias:
      append_span(bank.in_bias(t.expert), static_cast<std::size_t>(I), static_cast<std::size_t>(I));
      break;
    case HfPart::kExpertDownBias:
      append_span(bank.down_bias(t.expert), 0, static_cast<std::size_t>(H));
      break;
    case HfPart::kSharedGateBias:
    case HfPart::kSharedUpBias:
    case HfPart::kSharedDownBias:
      if constexpr (Shared::has_experts) {
        auto const& sb = shared.bank();
        auto const Is = static_cast<std::size_t>(sb.d_ffn());
        if (t.part == HfPart::kSharedGateBias) append_span(sb.in_bias(0), 0, Is);
        if (t.part == HfPart::kSharedUpBias) append_span(sb.in_bias(0), Is, Is);
        if (t.part == HfPart::kSharedDownBias) {
          append_span(sb.down_bias(0), 0, static_cast<std::size_t>(H));
        }
      }
      break;
    case HfPart::kExpertsGateUpBlocks:
    case HfPart::kExpertsGateUpScales:
    case HfPart::kExpertsDownBlocks:
    case HfPart::kExpertsDownScales:
      moe::detail::fail("hf: tensor ", printable_name(t.name),
                        " is MXFP4 storage (U8 blocks or scales), which moe reads but does not "
                        "write; its values are the dequantised gate_up_proj / down_proj");
    case HfPart::kRouter:
      out.assign(router, router + E * H);
      break;
    case HfPart::kSelectionBias:
      out.assign(static_cast<std::size_t>(E), 0.0f);
      if (!bias.empty()) std::copy(bias.begin(), bias.end(), out.begin());
      break;
    case HfPart::kExpertGate:
      append_view(out, bank.gate_proj(t.expert));
      break;
    case HfPart::kExpertUp:
      append_view(out, bank.up_proj(t.expert));
      break;
    case HfPart::kExpertDown:
      append_view(out, bank.down_proj(t.expert));
      break;
    case HfPart::kExpertsGateUp:
      for (Index e = 0; e < E; ++e) append_view(out, bank.in_proj(e));
      break;
    case HfPart::kExpertsDown:
      for (Index e = 0; e < E; ++e) append_view(out, bank.down_proj(e));
      break;
    case HfPart::kExpertsGateUpT:
      for (Index e = 0; e < E; ++e) append_transposed(out, bank.in_proj(e));
      break;
    case HfPart::kExpertsDownT:
      for (Index e = 0; e < E; ++e) append_transposed(out, bank.down_proj(e));
      break;
    case HfPart::kSharedGate:
    case HfPart::kSharedUp:
    case HfPart::kSharedDown:
    case HfPart::kSharedExpertGate:
      if constexpr (Shared::has_experts) {
        auto const& sb = shared.bank();
        if (t.part == HfPart::kSharedGate) append_view(out, sb.gate_proj(0));
        if (t.part == HfPart::kSharedUp) append_view(out, sb.up_proj(0));
        if (t.part == HfPart::kSharedDown) append_view(out, sb.down_proj(0));
        if (t.part == HfPart::kSharedExpertGate) append_view(out, shared.gate_weight());
      }
      break;
  }
  moe::detail::check(static_cast<std::int64_t>(out.size()) == t.num_elements(), "hf: tensor ",
                     printable_name(t.name), " does not match the layer (", out.size(),
                     " values for shape ", shape_string(t.shape),
                     "); the layer and its config disagree");
  return out;
}

/// Writes the values of tensor `t` into `layer` (the inverse of gather_tensor()). The MXFP4
/// block tensors take their dequantised values in the on-disk [E, out, in] order (gate_up rows
/// interleaved), the scale tensors nothing (read with the blocks).
/// Writes the routed experts' weights of a tensor of part `part` from `src` (its values,
/// row-major) into `bank` (an ExpertBank::Edit, or OneExpert): a fused tensor's E experts, or
/// expert `expert`'s projection of a per-expert tensor. Returns src's end. Other parts: nothing.
template <class Target>
float const* scatter_expert_weights(HfPart part, float const* src, Target const& bank, Index E,
                                    Index H, Index I, Index expert) {
  switch (part) {
    case HfPart::kExpertsGateUpI:  // [E, H, 2I], column 2j gate j, 2j + 1 up j
      for (Index e = 0; e < E; ++e) {
        auto const w = bank.in_proj(e);
        for (Index h = 0; h < H; ++h) {
          for (Index j = 0; j < I; ++j) {
            w(j, h) = *src++;
            w(I + j, h) = *src++;
          }
        }
      }
      break;
    case HfPart::kExpertsGateUpBlocks:  // [E, 2I, H], rows interleaved
      for (Index e = 0; e < E; ++e) {
        auto const w = bank.in_proj(e);
        for (Index r = 0; r < 2 * I; ++r) {
          float* dst = w.row(r % 2 == 0 ? r / 2 : I + r / 2);
          std::copy(src, src + H, dst);
          src += H;
        }
      }
      break;
    case HfPart::kExpertsDownBlocks:  // [E, H, I]
    case HfPart::kExpertsDown:
      for (Index e = 0; e < E; ++e) src = copy_into_view(src, bank.down_proj(e));
      break;
    case HfPart::kExpertGate:
      src = copy_into_view(src, bank.gate_proj(expert));
      break;
    case HfPart::kExpertUp:
      src = copy_into_view(src, bank.up_proj(expert));
      break;
    case HfPart::kExpertDown:
      src = copy_into_view(src, bank.down_proj(expert));
      break;
    case HfPart::kExpertsGateUp:
      for (Index e = 0; e < E; ++e) src = copy_into_view(src, bank.in_proj(e));
      break;
    case HfPart::kExpertsGateUpT:
      for (Index e = 0; e < E; ++e) src = copy_transposed_into_view(src, bank.in_proj(e));
      break;
    case HfPart::kExpertsDownT:
      for (Index e = 0; e < E; ++e) src = copy_transposed_into_view(src, bank.down_proj(e));
      break;
    default:
      break;
  }
  return src;
}

/// One expert's weights in two caller buffers, in [P, H] (GLU: gate rows, then up rows) and
/// down [H, I], with the views of an ExpertBank::Edit (for expert 0 only): what
/// scatter_expert_weights writes when a loader reads one expert at a time.
struct OneExpert {
  float* in = nullptr;
  float* down = nullptr;
  Index H = 0, I = 0, in_factor = 2;
  MatrixView<float> in_proj(Index) const { return {in, in_factor * I, H}; }
  MatrixView<float> gate_proj(Index) const { return {in, I, H}; }
  MatrixView<float> up_proj(Index) const { return {in + (in_factor - 1) * I * H, I, H}; }
  MatrixView<float> down_proj(Index) const { return {down, H, I}; }
};

template <class Layer>
void scatter_tensor(HfTensor const& t, std::span<float const> v, Layer& layer) {
  auto const bank = layer.experts().edit();
  Index const E = layer.experts().num_experts(), H = layer.experts().d_model(),
              I = layer.experts().d_ffn();
  float const* src = v.data();
  auto to_span = [&](std::span<float> dst, std::size_t n) {
    moe::detail::check(dst.size() >= n, "hf: tensor ", printable_name(t.name),
                       " is a bias the layer does not have; build the layer from its config");
    std::copy(src, src + n, dst.begin());
    src += n;
  };
  if (hf_is_routed_weight(t.part)) {  // (MXFP4 scales: read with their blocks)
    scatter_expert_weights(t.part, src, bank, E, H, I, t.expert);
    return;
  }
  switch (t.part) {
    case HfPart::kRouterBias:
      if constexpr (requires { layer.router_bias(); }) {
        to_span(layer.router_bias(), static_cast<std::size_t>(E));
      }
      break;
    case HfPart::kExpertsGateUpBias:
      for (Index e = 0; e < E; ++e) {
        std::span<float> const b = bank.in_bias(e);
        moe::detail::check(!b.empty(), "hf: tensor ", printable_name(t.name),
                           " is a bias the layer does not have; build the layer from its config");
        for (Index j = 0; j < I; ++j) {
          b[static_cast<std::size_t>(j)] = *src++;
          b[static_cast<std::size_t>(I + j)] = *src++;
        }
      }
      break;
    case HfPart::kExpertsDownBias:
      for (Index e = 0; e < E; ++e) to_span(bank.down_bias(e), static_cast<std::size_t>(H));
      break;
    case HfPart::kExpertGateBias:
      to_span(bank.in_bias(t.expert), static_cast<std::size_t>(I));
      break;
    case HfPart::kExpertUpBias: {
      std::span<float> const b = bank.in_bias(t.expert);
      to_span(b.empty() ? b : b.subspan(static_cast<std::size_t>(I)), static_cast<std::size_t>(I));
      break;
    }
    case HfPart::kExpertDownBias:
      to_span(bank.down_bias(t.expert), static_cast<std::size_t>(H));
      break;
    case HfPart::kSharedGateBias:
    case HfPart::kSharedUpBias:
    case HfPart::kSharedDownBias:
      if constexpr (Layer::Shared::has_experts) {
        auto const sb = layer.shared_experts().bank().edit();
        auto const Is = static_cast<std::size_t>(layer.shared_experts().bank().d_ffn());
        std::span<float> const b = sb.in_bias(0);
        if (t.part == HfPart::kSharedGateBias) to_span(b, Is);
        if (t.part == HfPart::kSharedUpBias) to_span(b.empty() ? b : b.subspan(Is), Is);
        if (t.part == HfPart::kSharedDownBias)
          to_span(sb.down_bias(0), static_cast<std::size_t>(H));
      }
      break;
    case HfPart::kRouter:
      copy_into_view(src, layer.router_weight());
      break;
    case HfPart::kSelectionBias:
      if constexpr (requires { layer.router().bias; })
        layer.router().bias.assign(v.begin(), v.end());
      break;
    case HfPart::kSharedGate:
    case HfPart::kSharedUp:
    case HfPart::kSharedDown:
    case HfPart::kSharedExpertGate:
      if constexpr (Layer::Shared::has_experts) {
        auto const sb = layer.shared_experts().bank().edit();
        if (t.part == HfPart::kSharedGate) copy_into_view(src, sb.gate_proj(0));
        if (t.part == HfPart::kSharedUp) copy_into_view(src, sb.up_proj(0));
        if (t.part == HfPart::kSharedDown) copy_into_view(src, sb.down_proj(0));
        if (t.part == HfPart::kSharedExpertGate) {
          copy_into_view(src, layer.shared_experts().gate_weight());
        }
      }
      break;
    default:  // the routed experts' weights, above
      break;
  }
}

template <class Layer>
std::span<float const> selection_bias(Layer const& layer) {
  if constexpr (requires { layer.router().bias; }) {
    return layer.router().bias;
  } else {
    return {};
  }
}

}  // namespace detail

/// The values of checkpoint tensor `t` held by `layer`, row-major in t.shape (per-expert or
/// fused, as `t` says).
template <class Layer>
std::vector<float> hf_tensor_values(Layer const& layer, HfTensor const& t) {
  return detail::gather_tensor(t, layer.router_weight().data, detail::selection_bias(layer),
                               layer.router_bias(), layer.experts(), layer.shared_experts());
}

/// The gradient of checkpoint tensor `t` (a parameter: t.is_parameter()) from a layer's
/// Gradients, row-major in t.shape.
template <class Gradients>
std::vector<float> hf_gradient_values(Gradients const& grads, HfTensor const& t) {
  moe::detail::check(t.is_parameter(), "hf: tensor ", detail::printable_name(t.name),
                     " is a buffer (the selection bias) or MXFP4 storage, not a parameter; it has "
                     "no gradient");
  return detail::gather_tensor(t, grads.router_weight.data(), {}, grads.router_bias, grads.experts,
                               grads.shared);
}

/// Adds the gradient of every parameter of `hf` to `out` as F32 tensors named
/// `prefix` + checkpoint name ("grad.model.layers.3.mlp.experts.0.gate_proj.weight"), in the
/// checkpoint's own layout (per-expert or fused). `grads` comes from hf.layer.make_gradients()
/// and MoeFfn::backward.
template <class Layer>
void add_hf_gradients(SafetensorsWriter& out, HfLayer<Layer> const& hf,
                      typename Layer::Gradients const& grads, std::string_view prefix = "grad.") {
  for (HfTensor const& t : hf.tensors) {
    if (!t.is_parameter()) continue;
    out.add_f32(detail::concat(prefix, t.name), t.shape, hf_gradient_values(grads, t));
  }
}

// ---------------------------------------------------------------------------------------------
// Loading.

/// Options of load_hf_layer().
struct HfLoadOptions {
  /// Module prefix of the layer, ending in '.', e.g. "model.language_model.layers.3.mlp." for a
  /// checkpoint that nests the text model. Empty: "model.layers.L.block_sparse_moe." or
  /// "model.layers.L.mlp." (Mixtral), "model.layers.L.mlp." (the other families).
  std::string prefix;
  /// Throw moe::Error instead of returning HfLayer::warnings (unknown or defaulted config.json
  /// keys, tensors of the layer's module that are not read).
  bool strict = false;
  /// false: the routed experts' weight tensors are checked but not read (their biases are), and
  /// the bank is left unpacked (without fp32 weights when pack_formats is set, else zero): for a
  /// caller that streams the experts from an expert store (models::DecoderOptions::expert_store).
  bool routed_expert_weights = true;
  /// Set: an inference-only layer whose experts are packed straight from the checkpoint, in
  /// the formats pack_formats(shared, experts, d_ffn, stored) returns, one per expert of the
  /// routed bank (E experts of width expert_intermediate_size) or of the shared one (1 expert);
  /// `stored` is HfLayer::stored_formats or stored_shared_formats, empty for experts stored as
  /// floats. The layer is built in an experts::EmptyWeights scope and each
  /// expert is read, converted and packed on its own (ExpertBank::pack_from): stored blocks of
  /// a format asked for are re-packed as they are, everything else is read one expert at a time,
  /// so at most one expert's fp32 weights per thread are ever held, never a layer's. GLU experts
  /// whose fp32 or bf16 in projection would split a panel (pack_serves_inference) need their
  /// fp32 weights: such a layer is loaded with them, then packed in the same formats.
  std::function<std::vector<experts::ExpertFormat>(
      bool shared, Index experts, Index d_ffn, std::vector<experts::ExpertFormat> const& stored)>
      pack_formats{};
  /// Reads and packs the experts in parallel (pack_formats; the result does not depend on it).
  ThreadPool* pool = nullptr;
};

namespace detail {

inline bool starts_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(0, p.size()) == p;
}

/// Why a tensor may be missing: a hint for the error message.
inline std::string missing_tensor_hint(ShardedCheckpoint const& ckpt, HfMoeConfig const& c,
                                       Index layer, std::string const& prefix) {
  std::string const layer_prefix = concat("model.layers.", layer, ".");
  std::vector<std::string> const names = ckpt.names();
  bool const any_of_layer = std::any_of(names.begin(), names.end(), [&](std::string const& n) {
    return starts_with(n, starts_with(prefix, layer_prefix) ? layer_prefix : prefix);
  });
  if (!any_of_layer) {
    return concat("the checkpoint holds no tensor of this layer (nothing starts with '",
                  starts_with(prefix, layer_prefix) ? layer_prefix : prefix,
                  "'); is a shard missing, or is the layer index out of range?");
  }
  if (ckpt.contains(concat(layer_prefix, "mlp.gate_proj.weight")) ||
      ckpt.contains(concat(layer_prefix, "mlp.up_proj.weight"))) {
    return concat("the checkpoint holds a dense MLP (", layer_prefix,
                  "mlp.gate_proj.weight) at this layer although config.json makes it an MoE "
                  "layer; config.json and the weights do not belong together");
  }
  std::string hint =
      concat("config.json (model_type ", c.model_type(), ", ", c.num_experts, " routed experts");
  if (c.shared_intermediate_size() > 0) hint += ", a shared expert";
  hint += ") and the checkpoint do not agree; check that they come from the same model";
  return hint;
}

/// The loader's warnings for `config` and the checkpoint tensors under `prefix` that `read`
/// does not list (see HfLayer::warnings).
inline std::vector<std::string> hf_load_warnings(HfMoeConfig const& c,
                                                 ShardedCheckpoint const& ckpt,
                                                 std::string const& prefix,
                                                 std::vector<HfTensor> const& read) {
  std::vector<std::string> out;
  auto join = [](std::vector<std::string> const& keys) {
    std::string list;
    for (std::string const& k : keys) list += concat(list.empty() ? "" : ", ", printable_name(k));
    return list;
  };
  if (!c.unknown_keys.empty()) {
    out.push_back(concat("config.json has key(s) ", join(c.unknown_keys),
                         " that transformers' configuration of ", c.model_type(),
                         " does not know; they are ignored (misspelt?)"));
  }
  if (!c.defaulted_keys.empty()) {
    out.push_back(concat("config.json lacks ", join(c.defaulted_keys),
                         ", which took their transformers defaults"));
  }
  for (std::string const& setting : c.ignored_settings) {
    out.push_back(concat("config.json sets ", setting, "; moe follows transformers"));
  }
  std::vector<std::string> used;
  used.reserve(read.size());
  for (HfTensor const& t : read) used.push_back(t.name);
  std::sort(used.begin(), used.end());
  std::size_t unused = 0;
  std::string first;
  for (std::string const& name : ckpt.names()) {
    if (!starts_with(name, prefix)) continue;
    std::string base = name;
    if (std::string_view const suffix = "_scale_inv";
        base.size() > suffix.size() && base.ends_with(suffix)) {
      base.resize(base.size() - suffix.size());  // FP8 block scales of a weight read
    }
    if (std::binary_search(used.begin(), used.end(), base)) continue;
    if (unused++ == 0) first = name;
  }
  if (unused > 0) {
    out.push_back(concat("the checkpoint has ", unused, " tensor(s) under '", prefix,
                         "' that this layer does not read (first: ", printable_name(first),
                         "); config.json describes ", c.num_experts,
                         " routed experts, check that it belongs to these weights"));
  }
  return out;
}

inline std::string defaulted_note(HfMoeConfig const& c) {
  if (c.defaulted_keys.empty()) return {};
  std::string note = " (config.json lacks ";
  for (std::size_t i = 0; i < c.defaulted_keys.size(); ++i) {
    if (i > 0) note += ", ";
    note += c.defaulted_keys[i];
  }
  return note + ", which took their transformers defaults)";
}

/// Tensor `t`'s view, its presence, dtype and shape checked against config.json from the header
/// alone (no data is read): a U8 GGUF-block tensor marked by save_hf_layer_quantized, F32 /
/// BF16 / F16, or a 2-D F8_E4M3 weight with its "<name>_scale_inv" F32 / BF16 / F16 tensor of
/// [ceil(rows/br), ceil(cols/bc)] blocks; an MXFP4 blocks or scales tensor is U8 of its shape.
inline TensorView const& checked_hf_tensor(ShardedCheckpoint const& ckpt, HfTensor const& t,
                                           HfMoeConfig const& c, Index layer,
                                           std::string const& prefix) {
  std::string const& src = ckpt.source();
  TensorView const* view = ckpt.find(t.name);
  if (hf_is_mxfp4(t.part)) {
    if (view == nullptr) {
      moe::detail::fail("hf: ", src, ": tensor ", printable_name(t.name), " (U8 ",
                        shape_string(t.shape),
                        ") is missing; config.json says the experts are "
                        "MXFP4 (quantization_config.quant_method \"mxfp4\"); ",
                        missing_tensor_hint(ckpt, c, layer, prefix));
    }
    if (view->dtype != Dtype::kU8 || view->shape != t.shape) {
      moe::detail::fail("hf: ", src, ": tensor ", printable_name(t.name), " is ",
                        dtype_name(view->dtype), " ", shape_string(view->shape), " but MXFP4 ",
                        "storage of these experts is U8 ", shape_string(t.shape), " (hidden_size ",
                        c.hidden_size, ", ", c.num_experts, " experts of width ",
                        c.expert_intermediate_size, defaulted_note(c),
                        "); check that config.json belongs to these weights");
    }
    return *view;
  }
  if (view == nullptr) {
    moe::detail::fail("hf: ", src, ": tensor ", printable_name(t.name), " (", shape_string(t.shape),
                      ") is missing; ", missing_tensor_hint(ckpt, c, layer, prefix));
  }
  if (t.shape.size() == 2) {
    if (find_block_tensor(ckpt, t.name, t.shape[0], t.shape[1])) return *view;
  } else if (std::string const* mark = ckpt.shard_metadata(t.name, block_type_key(t.name))) {
    std::optional<quant::GgmlType> const type = parse_block_type(*mark);
    moe::detail::check(!type || !quant::ggml_type_info(*type).quantized, "hf: ", src, ": tensor ",
                       printable_name(t.name), " is marked ", *mark,
                       " but only 2-D weights are stored as blocks");
  }
  bool const fp8 = view->dtype == Dtype::kF8E4M3;
  bool const float_type =
      view->dtype == Dtype::kF32 || view->dtype == Dtype::kBf16 || view->dtype == Dtype::kF16;
  if (!float_type && !(fp8 && t.shape.size() == 2)) {
    moe::detail::fail("hf: ", src, ": tensor ", printable_name(t.name), " is ",
                      dtype_name(view->dtype),
                      "; moe loads F32, BF16 or F16 weights (and F8_E4M3 with a weight_scale_inv "
                      "for 2-D weights); convert the checkpoint to one of them");
  }
  if (view->shape != t.shape) {
    moe::detail::fail("hf: ", src, ": tensor ", printable_name(t.name), " has shape ",
                      shape_string(view->shape), " but config.json implies ", shape_string(t.shape),
                      " (hidden_size ", c.hidden_size, ", ", c.num_experts, " experts of width ",
                      c.expert_intermediate_size, defaulted_note(c),
                      "); check that config.json belongs to these weights");
  }
  if (!fp8) return *view;
  std::string const scale_name = concat(t.name, "_scale_inv");
  TensorView const* scale = ckpt.find(scale_name);
  if (scale == nullptr) {
    moe::detail::fail("hf: ", src, ": tensor ", printable_name(t.name),
                      " is F8_E4M3 but the checkpoint has no ", printable_name(scale_name),
                      " to dequantise it with; an FP8 checkpoint needs both (or convert it to "
                      "BF16)");
  }
  std::int64_t const rows = t.shape[0], cols = t.shape[1];
  std::int64_t const br = c.fp8_block_rows > 0 ? c.fp8_block_rows : 128;
  std::int64_t const bc = c.fp8_block_cols > 0 ? c.fp8_block_cols : 128;
  std::vector<std::int64_t> const scale_shape = {(rows + br - 1) / br, (cols + bc - 1) / bc};
  if (scale->shape != scale_shape ||
      !(scale->dtype == Dtype::kF32 || scale->dtype == Dtype::kBf16 ||
        scale->dtype == Dtype::kF16)) {
    moe::detail::fail("hf: ", src, ": tensor ", printable_name(scale_name), " is ",
                      dtype_name(scale->dtype), " ", shape_string(scale->shape), " but the ", br,
                      "x", bc, " blocks of ", printable_name(t.name), " need F32 ",
                      shape_string(scale_shape),
                      "; check quantization_config.weight_block_size in config.json");
  }
  return *view;
}

/// Reads tensor `t` as floats, checked as checked_hf_tensor() does; dequantises GGUF blocks
/// (`stored` receives their format) and FP8 blockwise weights (w = q * scale_inv of its block).
inline std::vector<float> read_hf_tensor(ShardedCheckpoint const& ckpt, HfTensor const& t,
                                         HfMoeConfig const& c, Index layer,
                                         std::string const& prefix,
                                         experts::WeightFormat* stored = nullptr) {
  TensorView const& view = checked_hf_tensor(ckpt, t, c, layer, prefix);
  if (std::string const* mark = ckpt.shard_metadata(t.name, block_type_key(t.name))) {
    if (t.shape.size() == 2) {
      if (std::optional<BlockTensor> const b =
              find_block_tensor(ckpt, t.name, t.shape[0], t.shape[1])) {
        if (stored) *stored = experts::load_format(b->type);
        return b->dequantize();
      }
    }
    if (stored) *stored = experts::parse_weight_format(*mark);
  }
  std::vector<float> values = to_float(view);
  if (view.dtype != Dtype::kF8E4M3) return values;
  TensorView const& scale = *ckpt.find(concat(t.name, "_scale_inv"));
  std::int64_t const rows = t.shape[0], cols = t.shape[1];
  std::int64_t const br = c.fp8_block_rows > 0 ? c.fp8_block_rows : 128;
  std::int64_t const bc = c.fp8_block_cols > 0 ? c.fp8_block_cols : 128;
  std::int64_t const scale_cols = (cols + bc - 1) / bc;
  std::vector<float> const s = to_float(scale);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t k = 0; k < cols; ++k) {
      values[static_cast<std::size_t>(r * cols + k)] *=
          s[static_cast<std::size_t>((r / br) * scale_cols + k / bc)];
    }
  }
  return values;
}

/// Reads the MXFP4 pair of `blocks` (U8 [E, R, G, 16]) and its scales tensor (the next one in
/// hf_layer_tensors() order, U8 [E, R, G]) as floats [E, R, 32 G]: element 2i of block g is the
/// low nibble of byte i, 2i + 1 the high one, times 2^(scale - 127) (hf_mxfp4_value()).
/// With `expert` >= 0, only that expert's [R, 32 G] slice.
inline std::vector<float> read_mxfp4(ShardedCheckpoint const& ckpt, HfTensor const& blocks,
                                     HfTensor const& scales, HfMoeConfig const& c, Index layer,
                                     std::string const& prefix, Index expert = -1) {
  std::string const& src = ckpt.source();
  TensorView const* bv = &checked_hf_tensor(ckpt, blocks, c, layer, prefix);
  TensorView const* sv = &checked_hf_tensor(ckpt, scales, c, layer, prefix);
  std::size_t groups = static_cast<std::size_t>(scales.num_elements());
  std::size_t first = 0;
  if (expert >= 0) {
    groups /= static_cast<std::size_t>(scales.shape.at(0));
    first = static_cast<std::size_t>(expert) * groups;
  }
  auto const* b = reinterpret_cast<std::uint8_t const*>(bv->bytes.data()) + first * 16;
  auto const* e8 = reinterpret_cast<std::uint8_t const*>(sv->bytes.data()) + first;
  std::vector<float> out(groups * 32);
  for (std::size_t g = 0; g < groups; ++g) {
    if (e8[g] == 255) {
      moe::detail::fail("hf: ", src, ": tensor ", printable_name(scales.name),
                        " holds the E8M0 scale 255 (NaN in the OCP MX format) at flat index ",
                        first + g, "; the checkpoint is corrupt");
    }
    for (std::size_t i = 0; i < 16; ++i) {
      std::uint8_t const byte = b[g * 16 + i];
      out[g * 32 + 2 * i] = hf_mxfp4_value(byte & 0x0Fu, e8[g]);
      out[g * 32 + 2 * i + 1] = hf_mxfp4_value(static_cast<std::uint8_t>(byte >> 4), e8[g]);
    }
  }
  return out;
}

/// The experts' projections a checkpoint stores as blocks of a native format (load_hf_layer
/// re-packs them as stored): per routed expert gate, up and down, and the shared expert's.
class StoredExpertBlocks {
 public:
  explicit StoredExpertBlocks(Index experts) : routed_(static_cast<std::size_t>(experts)) {}
  /// Records that `part` of `expert` (ignored for the shared expert's parts) is stored as
  /// `rows`, blocks of `format`.
  void add(HfPart part, Index expert, std::byte const* rows, experts::WeightFormat format) {
    Stored const s{rows, format};
    switch (part) {
      case HfPart::kExpertGate:
        routed_.at(static_cast<std::size_t>(expert))[0] = s;
        break;
      case HfPart::kExpertUp:
        routed_.at(static_cast<std::size_t>(expert))[1] = s;
        break;
      case HfPart::kExpertDown:
        routed_.at(static_cast<std::size_t>(expert))[2] = s;
        break;
      case HfPart::kSharedGate:
        shared_[0] = s;
        break;
      case HfPart::kSharedUp:
        shared_[1] = s;
        break;
      case HfPart::kSharedDown:
        shared_[2] = s;
        break;
      default:
        break;
    }
  }
  /// The experts::StoredBlocks of the routed experts and of the shared one: a projection's
  /// blocks when they were stored in the format asked for, else nullptr.
  experts::StoredBlocks routed() const {
    return [this](Index e, experts::Projection p, experts::WeightFormat f) {
      return routed_[static_cast<std::size_t>(e)][static_cast<std::size_t>(p)].in(f);
    };
  }
  experts::StoredBlocks shared() const {
    return [this](Index, experts::Projection p, experts::WeightFormat f) {
      return shared_[static_cast<std::size_t>(p)].in(f);
    };
  }

 private:
  struct Stored {
    std::byte const* rows = nullptr;
    experts::WeightFormat format = experts::WeightFormat::kF32;
    std::byte const* in(experts::WeightFormat f) const { return f == format ? rows : nullptr; }
  };
  std::vector<std::array<Stored, 3>> routed_;
  std::array<Stored, 3> shared_{};
};

/// The block format a checkpoint stores tensor `t` in, from its header alone (the format
/// read_hf_tensor reports), or nothing for a tensor stored as floats.
inline std::optional<experts::WeightFormat> stored_format(ShardedCheckpoint const& ckpt,
                                                          HfTensor const& t) {
  std::string const* mark = ckpt.shard_metadata(t.name, block_type_key(t.name));
  if (mark == nullptr) return std::nullopt;
  if (t.shape.size() == 2) {
    if (std::optional<BlockTensor> const b =
            find_block_tensor(ckpt, t.name, t.shape[0], t.shape[1])) {
      return experts::load_format(b->type);
    }
  }
  return experts::parse_weight_format(*mark);
}

/// Does `part` fill a down projection (routed or shared)?
inline bool down_part(HfPart p) {
  return p == HfPart::kExpertDown || p == HfPart::kExpertsDown || p == HfPart::kExpertsDownT ||
         p == HfPart::kExpertsDownBlocks || p == HfPart::kSharedDown;
}

/// Expert `expert`'s fp32 weights (the shared expert's with `shared`) read from the
/// checkpoint into `in` [P, H] and `down` [H, I] (either may be null: not read), converted as
/// load_hf_layer converts them; fused tensors are read as that expert's slice only.
inline void read_one_expert(ShardedCheckpoint const& ckpt, HfMoeConfig const& c, Index layer,
                            std::string const& prefix, std::vector<HfTensor> const& tensors,
                            Index expert, bool shared, OneExpert const& dst) {
  Index const E = c.num_experts;
  for (std::size_t ti = 0; ti < tensors.size(); ++ti) {
    HfTensor const& t = tensors[ti];
    bool const shared_weight = t.part == HfPart::kSharedGate || t.part == HfPart::kSharedUp ||
                               t.part == HfPart::kSharedDown;
    if (shared ? !shared_weight : !hf_is_routed_weight(t.part)) continue;
    if (t.part == HfPart::kExpertsGateUpScales || t.part == HfPart::kExpertsDownScales) continue;
    if (!shared && t.expert >= 0 && t.expert != expert) continue;
    if ((down_part(t.part) ? dst.down : dst.in) == nullptr) continue;
    std::vector<float> values;
    if (t.part == HfPart::kExpertsGateUpBlocks || t.part == HfPart::kExpertsDownBlocks) {
      values = read_mxfp4(ckpt, t, tensors.at(ti + 1), c, layer, prefix, expert);
    } else if (shared || t.expert >= 0) {
      values = read_hf_tensor(ckpt, t, c, layer, prefix);
    } else {  // a fused [E, ...] float tensor: the expert's slice
      TensorView slice = checked_hf_tensor(ckpt, t, c, layer, prefix);
      std::size_t const bytes = slice.bytes.size() / static_cast<std::size_t>(E);
      slice.bytes = slice.bytes.subspan(static_cast<std::size_t>(expert) * bytes, bytes);
      slice.shape.at(0) = 1;
      values = to_float(slice);
    }
    float const* src = values.data();
    switch (t.part) {
      case HfPart::kSharedGate:
        copy_into_view(src, dst.gate_proj(0));
        break;
      case HfPart::kSharedUp:
        copy_into_view(src, dst.up_proj(0));
        break;
      case HfPart::kSharedDown:
        copy_into_view(src, dst.down_proj(0));
        break;
      default:
        scatter_expert_weights(t.part, src, dst, 1, dst.H, dst.I, 0);
        break;
    }
  }
}

/// What a layer's expert tensors are stored as, from the checkpoint's headers alone.
struct StoredExperts {
  /// The stored format of every routed expert (when `routed` was asked) and of the shared
  /// expert, where any tensor of the layer is stored as blocks; empty for float checkpoints.
  std::vector<experts::ExpertFormat> routed, shared;
  StoredExpertBlocks blocks{0};  ///< the projections stored as native blocks
  Index shared_width = 0;        ///< the shared expert's d_ffn (0: none in the checkpoint)
  std::vector<std::string> warnings;
};

/// Scans the layer's `tensors` (checked_hf_layer_tensors) for the formats and blocks its experts
/// are stored in. Gate and up are one in projection of one format: where a file stores them in
/// two (GGUF files may), the one with more bits a weight, with a warning (the other is
/// re-quantized).
inline StoredExperts scan_stored_experts(HfMoeConfig const& config,
                                         ShardedCheckpoint const& checkpoint,
                                         std::vector<HfTensor> const& tensors, bool routed) {
  using experts::WeightFormat;
  Index const E = config.num_experts;
  StoredExperts out;
  out.blocks = StoredExpertBlocks(E);
  std::vector<WeightFormat> gate(static_cast<std::size_t>(E), WeightFormat::kF32), up(gate),
      down(gate);
  WeightFormat shared[3] = {WeightFormat::kF32, WeightFormat::kF32, WeightFormat::kF32};
  bool quantized = false;
  for (HfTensor const& t : tensors) {
    if (t.part == HfPart::kSharedDown) out.shared_width = static_cast<Index>(t.shape.at(1));
    std::optional<WeightFormat> const f = stored_format(checkpoint, t);
    if (!f) continue;
    quantized = true;
    if (t.shape.size() == 2) {
      if (std::optional<BlockTensor> const b =
              find_block_tensor(checkpoint, t.name, t.shape[0], t.shape[1])) {
        if (b->native()) out.blocks.add(t.part, t.expert, b->row(0), *b->native());
      }
    }
    auto const e = static_cast<std::size_t>(std::max<Index>(t.expert, 0));
    if (t.part == HfPart::kExpertGate) gate[e] = *f;
    if (t.part == HfPart::kExpertUp) up[e] = *f;
    if (t.part == HfPart::kExpertDown) down[e] = *f;
    if (t.part == HfPart::kSharedGate) shared[0] = *f;
    if (t.part == HfPart::kSharedUp) shared[1] = *f;
    if (t.part == HfPart::kSharedDown) shared[2] = *f;
  }
  if (!quantized) return out;
  auto in_format = [&](WeightFormat g, WeightFormat u, std::string const& who) {
    if (g == u) return g;
    WeightFormat const f = experts::bits_per_weight(g) >= experts::bits_per_weight(u) ? g : u;
    out.warnings.push_back(concat(who, "'s gate and up projections are stored as ",
                                  experts::name(g), " and ", experts::name(u),
                                  "; moe packs them as one in projection, in ", experts::name(f),
                                  " (the other is re-quantized)"));
    return f;
  };
  for (Index e = 0; e < E && routed; ++e) {
    auto const i = static_cast<std::size_t>(e);
    out.routed.push_back({in_format(gate[i], up[i], concat("expert ", e)), down[i]});
  }
  if (out.shared_width > 0) {
    out.shared.push_back({in_format(shared[0], shared[1], "the shared expert"), shared[2]});
  }
  return out;
}

/// The bytes of fp32 weights the tensors `ts` hold (for messages; saturates instead of
/// overflowing).
inline std::uint64_t hf_layer_bytes(std::vector<HfTensor> const& ts) {
  std::uint64_t total = 0;
  for (HfTensor const& t : ts) {
    std::uint64_t n = 4;
    for (std::int64_t const d : t.shape) {
      auto const u = static_cast<std::uint64_t>(std::max<std::int64_t>(d, 0));
      n = u != 0 && n > UINT64_MAX / u ? UINT64_MAX : n * u;
    }
    total = total > UINT64_MAX - n ? UINT64_MAX : total + n;
  }
  return total;
}

/// make() (which allocates), with std::bad_alloc and std::length_error turned into a moe::Error
/// naming what() -- what was being allocated, and its bytes -- so that running out of memory
/// says what for, instead of a bare "std::bad_alloc".
template <class Make, class What>
auto allocating(Make&& make, What&& what) -> decltype(make()) {
  try {
    return make();
  } catch (std::bad_alloc const&) {
    moe::detail::fail(what(),
                      " cannot be allocated (out of memory); free memory or load a "
                      "smaller model");
  } catch (std::length_error const&) {
    moe::detail::fail(what(), " is more than a vector can hold; check the sizes in config.json");
  }
}

/// Finds the layer's module prefix and whether its experts are fused.
inline HfLayout detect_layout(ShardedCheckpoint const& ckpt, HfMoeConfig const& c, Index layer,
                              HfLoadOptions const& options) {
  std::vector<std::string> candidates;
  if (c.spec().storage != HfExpertStorage::kPerExpertOrFused) {  // fused (Llama 4, gpt-oss)
    HfLayout layout = hf_default_layout(c.family, layer);
    std::string const router = concat(layout.prefix, c.spec().names.router);
    if (!options.prefix.empty()) {
      layout.prefix = options.prefix;
    } else if (std::string const nested = concat("language_model.", layout.prefix);
               !ckpt.contains(router) && ckpt.contains(concat("language_model.", router))) {
      // Llama4ForConditionalGeneration nests the text model under language_model.
      layout.prefix = nested;
    }
    // gpt-oss or Llama 4 one tensor per expert (a GGUF file's split experts,
    // moe/io/gguf/hf_view.hpp).
    if (!ckpt.contains(concat(layout.prefix, "experts.gate_up_proj")) &&
        !ckpt.contains(concat(layout.prefix, "experts.gate_up_proj_blocks")) &&
        ckpt.contains(concat(layout.prefix, "experts.0.gate_proj.weight"))) {
      layout.fused_experts = false;
    }
    return layout;
  }
  if (!options.prefix.empty()) {
    candidates.push_back(options.prefix);
  } else {
    if (hf_mixtral_names(c.family)) {
      candidates.push_back(concat("model.layers.", layer, ".block_sparse_moe."));
    }
    candidates.push_back(concat("model.layers.", layer, ".mlp."));
  }
  HfLayout layout;
  layout.prefix = candidates.front();
  for (std::string const& p : candidates) {
    if (ckpt.contains(concat(p, "gate.weight"))) {
      layout.prefix = p;
      break;
    }
  }
  std::string const gate_up = concat(layout.prefix, "experts.gate_up_proj");
  layout.fused_experts = ckpt.contains(gate_up);
  std::string const first_expert =
      concat(layout.prefix,
             hf_mixtral_names(c.family) ? "experts.0.w1.weight" : "experts.0.gate_proj.weight");
  if (layout.fused_experts && ckpt.contains(first_expert)) {
    moe::detail::fail("hf: ", ckpt.source(), ": layer ", layer, " has both fused (",
                      printable_name(gate_up), ") and per-expert (", printable_name(first_expert),
                      ") expert weights; keep one layout in the checkpoint");
  }
  return layout;
}

/// The layout and tensors of MoE layer `layer`, every tensor's presence, dtype and shape checked
/// against config.json from the checkpoint's headers (checked_hf_tensor()): no tensor data is
/// read and nothing is allocated for the layer.
inline std::pair<HfLayout, std::vector<HfTensor>> checked_hf_layer_tensors(
    HfMoeConfig const& config, ShardedCheckpoint const& checkpoint, Index layer,
    HfLoadOptions const& options = {}) {
  HfLayout layout = detect_layout(checkpoint, config, layer, options);
  std::vector<HfTensor> tensors = hf_layer_tensors(config, layout);
  for (HfTensor const& t : tensors) checked_hf_tensor(checkpoint, t, config, layer, layout.prefix);
  return {std::move(layout), std::move(tensors)};
}

}  // namespace detail

/// Loads MoE layer `layer` of a model whose config.json is `config` from `checkpoint`, into the
/// preset type `Layer` of config.family (see make_hf_layer()).
///
/// Layout: per-expert tensors (on-disk Hugging Face names) or, when the checkpoint has
/// "<prefix>experts.gate_up_proj", the fused [E, 2I, H] / [E, H, I] pair; Mixtral's prefix is
/// "block_sparse_moe." or "mlp." (transformers v5), whichever holds gate.weight. Tensors may be
/// F32, BF16 or F16 (converted to float exactly), or F8_E4M3 with "<name>_scale_inv" block
/// scales (dequantised: w = q * scale_inv of its block).
/// Throws moe::Error naming the checkpoint and tensor when `layer` is not an MoE layer (dense,
/// negative or beyond num_hidden_layers), a tensor is missing, has another shape than
/// config.json implies, or has an unsupported dtype (e.g. I32), and when `Layer` is not the
/// family's preset type.
template <class Layer>
HfLayer<Layer> load_hf_layer(HfMoeConfig const& config, ShardedCheckpoint const& checkpoint,
                             Index layer, HfLoadOptions const& options = {}) {
  detail::validate_hf_config(config, checkpoint.source());
  if (std::string const why = config.dense_reason(layer); !why.empty()) {
    moe::detail::fail("hf: ", checkpoint.source(), ": cannot load layer ", layer, " of this ",
                      config.model_type(), " model as an MoE layer: ", why, "; pick an MoE layer");
  }
  // Every tensor's header against config.json before the layer is allocated: a config.json that
  // implies a huge layer for small tensors is refused by its shapes at once, with no memory
  // committed to (and zero-filled for) the layer it implies.
  auto [layout, tensors] = detail::checked_hf_layer_tensors(config, checkpoint, layer, options);
  std::vector<std::string> warnings =
      detail::hf_load_warnings(config, checkpoint, layout.prefix, tensors);
  if (options.strict && !warnings.empty()) {
    std::string all;
    for (std::string const& w : warnings) all += detail::concat(all.empty() ? "" : "; ", w);
    moe::detail::fail("hf: ", checkpoint.source(), ": ", all,
                      " (strict loading; fix the checkpoint or load without strict)");
  }
  Index const E = config.num_experts, H = config.hidden_size, I = config.expert_intermediate_size;
  moe::detail::check(!(config.has_expert_biases() && layout.fused_experts &&
                       config.spec().storage == HfExpertStorage::kPerExpertOrFused),
                     "hf: ", checkpoint.source(), ": layer ", layer, " stores its ",
                     config.model_type(),
                     " experts fused (experts.gate_up_proj), which has no biases, but "
                     "config.json sets use_bias = true; use a per-expert checkpoint");
  // The formats the checkpoint stores the experts in, and their blocks, from the headers.
  detail::StoredExperts st =
      detail::scan_stored_experts(config, checkpoint, tensors, options.routed_expert_weights);
  warnings.insert(warnings.end(), st.warnings.begin(), st.warnings.end());
  std::vector<experts::ExpertFormat> stored_formats = std::move(st.routed),
                                     stored_shared_formats = std::move(st.shared);
  Index const shared_width = st.shared_width;
  detail::StoredExpertBlocks const& blocks = st.blocks;
  // With pack_formats: the formats asked for, and whether the layer can go without fp32 weights.
  std::vector<experts::ExpertFormat> routed_formats, shared_formats;
  bool empty = false;
  if (options.pack_formats) {
    if (options.routed_expert_weights) {
      routed_formats = options.pack_formats(false, E, I, stored_formats);
    }
    if (shared_width > 0) {
      shared_formats = options.pack_formats(true, 1, shared_width, stored_shared_formats);
    }
    auto serves = [](std::vector<experts::ExpertFormat> const& fs, Index width) {
      if (!Layer::Expert::gated || width % kernels::panel_width() == 0) return true;
      return std::all_of(fs.begin(), fs.end(),
                         [](experts::ExpertFormat const& f) { return is_quantized(f.in); });
    };
    empty = serves(routed_formats, I) && serves(shared_formats, shared_width);
  }
  std::uint64_t const bytes = detail::hf_layer_bytes(tensors);
  HfLayer<Layer> out{config,
                     layer,
                     layout,
                     std::move(tensors),
                     detail::allocating(
                         [&] {
                           std::optional<experts::EmptyWeights> scope;
                           if (empty) scope.emplace();
                           return make_hf_layer<Layer>(config);
                         },
                         [&] {
                           return detail::concat("hf: ", checkpoint.source(), ": layer ", layer,
                                                 " (", bytes, " bytes of fp32 weights)");
                         }),
                     std::move(stored_formats),
                     std::move(stored_shared_formats),
                     std::move(warnings)};
  auto shared_weight = [](HfPart p) {
    return p == HfPart::kSharedGate || p == HfPart::kSharedUp || p == HfPart::kSharedDown;
  };
  for (std::size_t ti = 0; ti < out.tensors.size(); ++ti) {
    HfTensor const& t = out.tensors[ti];
    if ((!options.routed_expert_weights || empty) && hf_is_routed_weight(t.part)) continue;
    if (empty && shared_weight(t.part)) continue;  // read one expert at a time below
    if (t.part == HfPart::kExpertsGateUpScales || t.part == HfPart::kExpertsDownScales) continue;
    if (t.part == HfPart::kExpertsGateUpBlocks || t.part == HfPart::kExpertsDownBlocks) {
      std::vector<float> const values = detail::read_mxfp4(checkpoint, t, out.tensors.at(ti + 1),
                                                           config, layer, out.layout.prefix);
      detail::scatter_tensor(t, values, out.layer);
      continue;
    }
    std::vector<float> const values =
        detail::read_hf_tensor(checkpoint, t, config, layer, out.layout.prefix);
    if (t.part == HfPart::kSelectionBias) {
      for (float const b : values) {
        moe::detail::check(std::isfinite(b), "hf: ", checkpoint.source(), ": tensor ",
                           detail::printable_name(t.name),
                           " holds a non-finite value; the selection bias must be finite");
      }
    }
    detail::scatter_tensor(t, values, out.layer);
  }
  auto& routed_bank = out.layer.experts();
  if (empty) {  // every expert read, converted and packed on its own
    auto source = [&](bool sh, Index width) {
      return experts::ExpertSource{
          sh ? blocks.shared() : blocks.routed(), [&, sh, width](Index e, float* in, float* dn) {
            detail::read_one_expert(checkpoint, config, layer, out.layout.prefix, out.tensors, e,
                                    sh, {in, dn, H, width, Layer::Bank::kInFactor});
          }};
    };
    if (options.routed_expert_weights) {
      routed_bank.pack_from(routed_formats, source(false, I), options.pool);
    }
    if constexpr (Layer::Shared::has_experts) {
      if (shared_width > 0) {
        out.layer.shared_experts().bank().pack_from(shared_formats, source(true, shared_width),
                                                    options.pool);
      }
    }
    return out;
  }
  if (options.routed_expert_weights && (!routed_formats.empty() || !out.stored_formats.empty())) {
    routed_bank.pack(routed_formats.empty() ? out.stored_formats : routed_formats, options.pool,
                     blocks.routed());
  }
  if constexpr (Layer::Shared::has_experts) {
    if (out.layer.shared_experts().count() > 0 &&
        (!shared_formats.empty() || !out.stored_shared_formats.empty())) {
      out.layer.shared_experts().bank().pack(
          shared_formats.empty() ? out.stored_shared_formats : shared_formats, options.pool,
          blocks.shared());
    }
  }
  return out;
}

namespace detail {
/// Throws unless `model_dir` is a directory (a path to config.json or to a .safetensors file is
/// a common slip: say so, instead of failing later on the wrong file).
inline void check_model_dir(std::filesystem::path const& model_dir) {
  std::error_code ec;
  if (std::filesystem::is_directory(model_dir, ec)) return;
  if (std::filesystem::is_symlink(model_dir, ec) && !std::filesystem::exists(model_dir, ec)) {
    moe::detail::fail("hf: '", model_dir.string(),
                      "' is a symbolic link that leads nowhere (a loop or a missing target); "
                      "pass the model's directory or GGUF file itself");
  }
  std::string ext = model_dir.extension().string();
  for (char& ch : ext) ch = static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  if (ext == ".gguf" && std::filesystem::is_regular_file(model_dir, ec)) {
    moe::detail::fail("hf: '", model_dir.string(), "' is named .gguf but is not a GGUF file (",
                      std::filesystem::file_size(model_dir, ec),
                      " bytes, no GGUF magic); pass a complete GGUF file or a model directory");
  }
  if (std::filesystem::exists(model_dir, ec)) {
    moe::detail::fail("hf: '", model_dir.string(),
                      "' is a file; pass the model's directory (the one holding config.json and "
                      "the safetensors weights), e.g. '",
                      model_dir.has_parent_path() ? model_dir.parent_path().string() : ".", "'");
  }
  moe::detail::fail("hf: the model directory '", model_dir.string(),
                    "' does not exist; pass the directory of a Hugging Face model (it holds "
                    "config.json and the safetensors weights)");
}
}  // namespace detail

/// load_hf_layer() from a model directory: `model_dir`/config.json plus model.safetensors or
/// model.safetensors.index.json and its shards.
template <class Layer>
HfLayer<Layer> load_hf_layer(std::filesystem::path const& model_dir, Index layer,
                             HfLoadOptions const& options = {}) {
  detail::check_model_dir(model_dir);
  HfMoeConfig const config = read_hf_config(model_dir);
  moe::detail::check(hf_family_matches<Layer>(config.family), "hf: ", model_dir.string(),
                     ": the model is a ", config.model_type(),
                     " model, which does not load into this layer type; use its family's preset "
                     "type or load_hf_moe_layer()");
  if (std::string const why = config.dense_reason(layer); !why.empty()) {
    moe::detail::fail("hf: ", model_dir.string(), ": cannot load layer ", layer, " of this ",
                      config.model_type(), " model as an MoE layer: ", why, "; pick an MoE layer");
  }
  ShardedCheckpoint const checkpoint = open_checkpoint(model_dir);
  return load_hf_layer<Layer>(config, checkpoint, layer, options);
}

/// Loads MoE layer `layer` of the model in `model_dir` into the preset type its config.json's
/// model_type calls for (see load_hf_layer()).
inline HfAnyLayer load_hf_moe_layer(std::filesystem::path const& model_dir, Index layer,
                                    HfLoadOptions const& options = {}) {
  detail::check_model_dir(model_dir);
  HfMoeConfig const config = read_hf_config(model_dir);
  if (std::string const why = config.dense_reason(layer); !why.empty()) {
    moe::detail::fail("hf: ", model_dir.string(), ": cannot load layer ", layer, " of this ",
                      config.model_type(), " model as an MoE layer: ", why, "; pick an MoE layer");
  }
  ShardedCheckpoint const checkpoint = open_checkpoint(model_dir);
  return visit_hf_layer_type(config.family, [&]<class Layer>(std::type_identity<Layer>) {
    return HfAnyLayer(load_hf_layer<Layer>(config, checkpoint, layer, options));
  });
}

// ---------------------------------------------------------------------------------------------
// Saving.

/// Options of save_hf_layer().
struct HfSaveOptions {
  /// Dtype of the weights: F32, BF16 or F16 (rounded to nearest even). The selection bias
  /// (e_score_correction_bias) is always F32, as transformers keeps it.
  Dtype dtype = Dtype::kF32;
  /// 1: model.safetensors. n > 1: model-0000i-of-0000n.safetensors plus
  /// model.safetensors.index.json, the tensors split in order into n nearly equal groups.
  int shards = 1;
  /// Write experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I] instead of one
  /// tensor per expert and projection (Mixtral then uses the "mlp." prefix, as transformers v5).
  bool fused_experts = false;
};

namespace detail {

inline void write_text_file(std::filesystem::path const& path, std::string_view text) {
  write_file_atomically(path, "hf", [&](std::FILE* f) {
    return std::fwrite(text.data(), 1, text.size(), f) == text.size();
  });
}

/// Throws unless `layer` has the sizes and routing that `c` describes.
template <class Layer>
void check_layer_matches(HfMoeConfig const& c, Layer const& layer, std::string const& where) {
  auto const& r = layer.router();
  bool ok = hf_family_matches<Layer>(c.family) && layer.d_model() == c.hidden_size &&
            layer.num_experts() == c.num_experts && layer.d_ffn() == c.expert_intermediate_size &&
            r.top_k == c.num_experts_per_tok;
  if constexpr (requires { r.normalize; }) ok = ok && r.normalize == c.norm_topk_prob;
  if constexpr (requires { r.scale_input; }) ok = ok && r.scale_input;
  if constexpr (requires { r.n_group; }) {
    routing::GroupLimitedTopK const want = hf_group_router(c);
    ok = ok && r.n_group == want.n_group && r.topk_group == want.topk_group &&
         r.normalize == want.normalize && r.scale == want.scale && r.scoring == want.scoring &&
         r.group_score == want.group_score && r.norm_epsilon == want.norm_epsilon &&
         r.norm_min == want.norm_min && r.bias.size() == want.bias.size();
  } else if constexpr (requires { r.scale; }) {
    ok = ok && r.scale == 1.0f;
  }
  if constexpr (Layer::Shared::has_experts) {
    Index const count = layer.shared_experts().count();
    Index const width = count > 0 ? layer.shared_experts().bank().d_ffn() : 0;
    ok = ok && count == (c.shared_intermediate_size() > 0 ? 1 : 0) &&
         width == c.shared_intermediate_size();
    ok = ok && (count == 0 || layer.shared_experts().bank().has_biases() == c.has_expert_biases());
  }
  ok = ok && layer.experts().has_biases() == c.has_expert_biases() &&
       layer.has_router_bias() == c.has_router_bias();
  if constexpr (experts::is_clamped_glu<typename Layer::Expert>) {
    ok = ok && layer.experts().glu_clamp() == kernels::GluClamp{c.swiglu_alpha, c.swiglu_limit};
  }
  if (!ok) {
    moe::detail::fail("hf: ", where, ": the layer (d_model ", layer.d_model(), ", ",
                      layer.num_experts(), " experts of width ", layer.d_ffn(), ", top-", r.top_k,
                      ") does not match the ", c.model_type(), " config (hidden_size ",
                      c.hidden_size, ", ", c.num_experts, " experts of width ",
                      c.expert_intermediate_size, ", top-", c.num_experts_per_tok,
                      ", and its routing, bias and shared-expert settings); build the layer with "
                      "make_hf_layer(config) or pass the config it was built from");
  }
}

inline char const* torch_dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::kBf16:
      return "bfloat16";
    case Dtype::kF16:
      return "float16";
    default:
      return "float32";
  }
}

/// The checks every save makes: a valid config, a layer that matches it, an MoE layer index.
template <class Layer>
void check_saving(HfMoeConfig const& config, Index layer_index, Layer const& layer,
                  std::string const& where) {
  validate_hf_config(config, where);
  check_layer_matches(config, layer, where);
  if (std::string const why = config.dense_reason(layer_index); !why.empty()) {
    moe::detail::fail("hf: ", where, ": cannot save layer ", layer_index, " as an MoE layer: ", why,
                      "; pick an MoE layer index");
  }
}

/// Creates `dir` and writes its config.json (weights are written unquantised by FP8 rules:
/// fp8 block sizes dropped).
inline void start_checkpoint_dir(std::filesystem::path const& dir, HfMoeConfig const& config,
                                 char const* torch_dtype) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    moe::detail::fail("hf: cannot create the directory '", dir.string(),
                      "': ", ec ? ec.message() : std::string("a file of that name exists"),
                      "; check the path and its permissions");
  }
  HfMoeConfig saved = config;
  saved.fp8_block_rows = saved.fp8_block_cols = 0;
  saved.mxfp4 = false;  // gpt-oss experts are written dequantised
  write_text_file(dir / "config.json", hf_config_json(saved, torch_dtype));
}

}  // namespace detail

/// Saves `layer` as MoE layer `layer_index` of a tiny Hugging Face checkpoint in `dir` (created
/// if needed): config.json (hf_config_json(config); an MXFP4 gpt-oss config is saved without
/// its quantization_config, the experts as their dequantised weights) and model.safetensors, or
/// with options.shards > 1 the shards and model.safetensors.index.json. Only this layer's tensors
/// are written (hf_layer_tensors(); names as the real checkpoints have them). A stale
/// model.safetensors or index of the other form is removed, so that load_hf_layer() reads
/// what was written. Throws moe::Error when the layer does not match `config`, layer_index is
/// not an MoE layer of `config`, the dtype is not F32/BF16/F16, or writing fails.
template <class Layer>
void save_hf_layer(std::filesystem::path const& dir, HfMoeConfig const& config, Index layer_index,
                   Layer const& layer, HfSaveOptions const& options = {}) {
  std::string const where = dir.string();
  detail::check_saving(config, layer_index, layer, where);
  moe::detail::check(
      options.dtype == Dtype::kF32 || options.dtype == Dtype::kBf16 || options.dtype == Dtype::kF16,
      "hf: ", where, ": cannot save weights as ", dtype_name(options.dtype),
      "; use F32, BF16 or F16");
  HfLayout const layout = hf_default_layout(config.family, layer_index, options.fused_experts);
  HfMoeConfig plain = config;
  plain.mxfp4 = false;  // MXFP4 experts are written as the dequantised weights
  std::vector<HfTensor> const tensors = hf_layer_tensors(plain, layout);
  moe::detail::check(
      options.shards >= 1 && static_cast<std::size_t>(options.shards) <= tensors.size(),
      "hf: ", where, ": shards = ", options.shards, " must be in [1, ", tensors.size(),
      "] (the layer has ", tensors.size(), " tensors)");

  detail::start_checkpoint_dir(dir, config, detail::torch_dtype_name(options.dtype));
  std::error_code ec;

  auto const n = static_cast<std::size_t>(options.shards);
  std::vector<std::string> shard_of(tensors.size());
  std::uint64_t total_size = 0;
  for (std::size_t s = 0; s < n; ++s) {
    std::size_t const begin = s * tensors.size() / n, end = (s + 1) * tensors.size() / n;
    SafetensorsWriter writer;
    writer.set_metadata("format", "pt");
    for (std::size_t i = begin; i < end; ++i) {
      HfTensor const& t = tensors[i];
      std::vector<float> const values = hf_tensor_values(layer, t);
      Dtype const dtype = t.part == HfPart::kSelectionBias ? Dtype::kF32 : options.dtype;
      std::vector<std::byte> const bytes = from_float(values, dtype);
      total_size += bytes.size();
      writer.add(t.name, dtype, t.shape, bytes);
    }
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, n);
    std::string const file = n == 1 ? std::string("model.safetensors") : std::string(name);
    for (std::size_t i = begin; i < end; ++i) shard_of[i] = file;
    writer.save(dir / file);
  }
  if (n == 1) {
    std::filesystem::remove(dir / "model.safetensors.index.json", ec);
    return;
  }
  std::filesystem::remove(dir / "model.safetensors", ec);
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return tensors[a].name < tensors[b].name; });
  std::string index =
      detail::concat("{\n  \"metadata\": {\"total_size\": ", total_size, "},\n  \"weight_map\": {");
  for (std::size_t k = 0; k < order.size(); ++k) {
    index += k == 0 ? "\n    " : ",\n    ";
    detail::append_json_string(index, tensors[order[k]].name);
    index += ": ";
    detail::append_json_string(index, shard_of[order[k]]);
  }
  index += "\n  }\n}\n";
  detail::write_text_file(dir / "model.safetensors.index.json", index);
}

/// Saves `layer` like save_hf_layer() (one model.safetensors, per-expert tensors), with every
/// routed expert's projections stored in formats[e] and the shared expert's (if any) in
/// shared_format: a quantized format as a U8 tensor [rows, quant::row_bytes(format, cols)] of
/// GGUF blocks (quant::quantize_row, row by row), bf16 as BF16, fp32 as F32. Every expert and
/// shared-expert projection tensor gets the "__metadata__" entry "moe.quant.<tensor name>" =
/// its format name ("q4_k", "bf16", ...), which load_hf_layer() reads back (dequantizing the
/// blocks exactly and packing the layer in the stored formats). Router, selection bias and the
/// shared-expert gate stay F32. Throws as save_hf_layer(), and for formats.size() != E or a
/// format whose blocks do not divide the projection's input width.
template <class Layer>
void save_hf_layer_quantized(std::filesystem::path const& dir, HfMoeConfig const& config,
                             Index layer_index, Layer const& layer,
                             std::vector<experts::ExpertFormat> const& formats,
                             experts::ExpertFormat shared_format = {}) {
  std::string const where = dir.string();
  detail::check_saving(config, layer_index, layer, where);
  moe::detail::check(static_cast<Index>(formats.size()) == layer.num_experts(), "hf: ", where, ": ",
                     formats.size(), " formats for ", layer.num_experts(),
                     " experts; give one per expert");
  moe::detail::check(config.spec().storage == HfExpertStorage::kPerExpertOrFused, "hf: ", where,
                     ": ", config.model_type(),
                     " stores its experts fused ([E, H, 2I]), which quantized checkpoints "
                     "(one tensor per expert and projection) do not support yet; quantize the "
                     "loaded layer with pack_weights instead");
  HfLayout const layout = hf_default_layout(config.family, layer_index, false);
  std::vector<HfTensor> const tensors = hf_layer_tensors(config, layout);
  detail::start_checkpoint_dir(dir, config, "float32");
  std::error_code ec;
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  for (HfTensor const& t : tensors) {
    std::vector<float> const values = hf_tensor_values(layer, t);
    experts::WeightFormat f = experts::WeightFormat::kF32;
    bool projection = true;
    switch (t.part) {
      case HfPart::kExpertGate:
      case HfPart::kExpertUp:
        f = formats[static_cast<std::size_t>(t.expert)].in;
        break;
      case HfPart::kExpertDown:
        f = formats[static_cast<std::size_t>(t.expert)].down;
        break;
      case HfPart::kSharedGate:
      case HfPart::kSharedUp:
        f = shared_format.in;
        break;
      case HfPart::kSharedDown:
        f = shared_format.down;
        break;
      default:
        projection = false;
    }
    if (projection) writer.set_metadata(block_type_key(t.name), experts::name(f));
    if (experts::is_quantized(f)) {
      quant::Format const q = experts::quant_format(f);
      Index const rows = t.shape[0], cols = t.shape[1];
      quant::check_row_length(q, cols, "hf: save_hf_layer_quantized");
      Index const rb = quant::row_bytes(q, cols);
      std::vector<std::byte> bytes(static_cast<std::size_t>(rows * rb));
      for (Index r = 0; r < rows; ++r) {
        quant::quantize_row(q, values.data() + r * cols, cols, bytes.data() + r * rb);
      }
      writer.add(t.name, Dtype::kU8, {rows, rb}, bytes);
    } else {
      Dtype const dtype = f == experts::WeightFormat::kBf16 ? Dtype::kBf16 : Dtype::kF32;
      writer.add(t.name, dtype, t.shape, from_float(values, dtype));
    }
  }
  writer.save(dir / "model.safetensors");
  std::filesystem::remove(dir / "model.safetensors.index.json", ec);
}

}  // namespace moe::io
