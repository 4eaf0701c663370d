// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The checkpoint tensors of one Hugging Face MoE layer: names, shapes, and what each one is.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/types.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/hf/config.hpp"

namespace moe::io {

namespace detail {
/// The index L of a tensor named "<prefix>L.<rest>" ("blk." in GGUF, "model.layers." in a
/// Hugging Face checkpoint), or nullopt for any other name (no digits, more than 9 of them, or no
/// dot after them).
inline std::optional<Index> indexed_name(std::string_view name, std::string_view prefix) {
  if (!name.starts_with(prefix)) return std::nullopt;
  std::size_t const at = prefix.size(), dot = name.find('.', at);
  if (dot == std::string_view::npos || dot == at || dot > at + 9) return std::nullopt;
  Index L = 0;
  for (char const ch : name.substr(at, dot - at)) {
    if (ch < '0' || ch > '9') return std::nullopt;
    L = L * 10 + (ch - '0');
  }
  return L;
}
}  // namespace detail

/// What a checkpoint tensor of an MoE layer holds (I: expert width, Is: shared expert width).
enum class HfPart : std::uint8_t {
  kRouter,             ///< gate.weight [E, H] (Llama 4: router.weight)
  kSelectionBias,      ///< gate.e_score_correction_bias [E] (DeepSeek-V3, GLM-4.5),
                       ///< e_score_correction_bias [E] (MiniMax-M2) or
                       ///< moe_statics.e_score_correction_bias [1, E] (ERNIE 4.5); a buffer
  kExpertGate,         ///< experts.j.w1 / gate_proj .weight [I, H]
  kExpertUp,           ///< experts.j.w3 / up_proj .weight [I, H]
  kExpertDown,         ///< experts.j.w2 / down_proj .weight [H, I]
  kExpertsGateUp,      ///< experts.gate_up_proj [E, 2I, H] (fused: gate rows, then up rows)
  kExpertsDown,        ///< experts.down_proj [E, H, I] (fused)
  kExpertsGateUpT,     ///< experts.gate_up_proj [E, H, 2I] (Llama 4: x @ W; gate columns, then up)
  kExpertsDownT,       ///< experts.down_proj [E, I, H] (Llama 4: h @ W)
  kSharedGate,         ///< shared_expert(s).gate_proj.weight [Is, H]
  kSharedUp,           ///< shared_expert(s).up_proj.weight [Is, H]
  kSharedDown,         ///< shared_expert(s).down_proj.weight [H, Is]
  kSharedExpertGate,   ///< shared_expert_gate.weight [1, H] (Qwen2-MoE, Qwen3-Next)
  kRouterBias,         ///< router.bias [E] (gpt-oss)
  kExpertsGateUpI,     ///< experts.gate_up_proj [E, H, 2I] (gpt-oss: x @ W, column 2j is gate j,
                       ///< 2j + 1 up j)
  kExpertsGateUpBias,  ///< experts.gate_up_proj_bias [E, 2I] (gpt-oss, interleaved likewise)
  kExpertsDownBias,    ///< experts.down_proj_bias [E, H] (gpt-oss)
  /// gpt-oss MXFP4 (quantization_config.quant_method "mxfp4"): U8 [E, 2I, H/32, 16] FP4 E2M1
  /// pairs (low nibble first) of the [E, 2I, H] (out, in; rows interleaved as above) weights,
  /// and their U8 E8M0 scales [E, 2I, H/32]; read together, dequantised (hf_mxfp4_value()).
  kExpertsGateUpBlocks,
  kExpertsGateUpScales,
  kExpertsDownBlocks,  ///< U8 [E, H, I/32, 16] of the [E, H, I] down weights
  kExpertsDownScales,  ///< U8 [E, H, I/32]
  kExpertGateBias,     ///< experts.j.gate_proj.bias [I] (ERNIE 4.5 use_bias)
  kExpertUpBias,       ///< experts.j.up_proj.bias [I]
  kExpertDownBias,     ///< experts.j.down_proj.bias [H]
  kSharedGateBias,     ///< shared_experts.gate_proj.bias [Is] (ERNIE 4.5 use_bias)
  kSharedUpBias,       ///< shared_experts.up_proj.bias [Is]
  kSharedDownBias,     ///< shared_experts.down_proj.bias [H]
};

/// Is `part` a weight of the routed experts (per expert or fused, MXFP4 blocks and scales
/// included; not their biases)?
constexpr bool hf_is_routed_weight(HfPart part) noexcept {
  switch (part) {
    case HfPart::kExpertGate:
    case HfPart::kExpertUp:
    case HfPart::kExpertDown:
    case HfPart::kExpertsGateUp:
    case HfPart::kExpertsDown:
    case HfPart::kExpertsGateUpT:
    case HfPart::kExpertsDownT:
    case HfPart::kExpertsGateUpI:
    case HfPart::kExpertsGateUpBlocks:
    case HfPart::kExpertsGateUpScales:
    case HfPart::kExpertsDownBlocks:
    case HfPart::kExpertsDownScales:
      return true;
    default:
      return false;
  }
}

/// Is `part` one of the MXFP4 block or scale tensors (U8; read, never written or trained)?
constexpr bool hf_is_mxfp4(HfPart part) noexcept {
  return part == HfPart::kExpertsGateUpBlocks || part == HfPart::kExpertsGateUpScales ||
         part == HfPart::kExpertsDownBlocks || part == HfPart::kExpertsDownScales;
}

/// The FP4 E2M1 value of a nibble (bit 3 sign, then 2 exponent and 1 mantissa bits) times
/// 2^(scale - 127) for an E8M0 scale byte, as transformers' integrations/mxfp4.py decodes it
/// (FP4_VALUES, torch.ldexp). Exact in float for scale < 255 (255 is NaN in the OCP MX spec).
inline float hf_mxfp4_value(std::uint8_t nibble, std::uint8_t scale) noexcept {
  static constexpr float kFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return std::ldexp(kFp4[nibble & 0x0Fu], static_cast<int>(scale) - 127);
}

/// One tensor of an MoE layer as the checkpoint stores it.
struct HfTensor {
  std::string name;                 ///< checkpoint name, e.g. "model.layers.3.mlp.gate.weight"
  HfPart part = HfPart::kRouter;    ///< what it holds
  Index expert = -1;                ///< routed expert of a per-expert tensor, else -1
  std::vector<std::int64_t> shape;  ///< shape on disk

  /// Is it a trainable parameter of the layer (everything but the selection bias and the MXFP4
  /// blocks and scales, which are read-only storage)?
  bool is_parameter() const noexcept {
    return part != HfPart::kSelectionBias && !hf_is_mxfp4(part);
  }
  /// Number of elements.
  std::int64_t num_elements() const noexcept {
    std::int64_t n = 1;
    for (std::int64_t const d : shape) n *= d;
    return n;
  }
};

/// Does the family name its experts' projections w1 (gate), w3 (up), w2 (down) under a
/// "block_sparse_moe." module, as Mixtral does (Mixtral, MiniMax-M2)?
inline bool hf_mixtral_names(HfFamily family) noexcept {
  return !hf_family(family).names.v4_module.empty();
}

/// Where a layer's tensors live in the checkpoint.
struct HfLayout {
  /// Module prefix ending in '.': "model.layers.L.block_sparse_moe." (Mixtral and MiniMax-M2,
  /// v4 names) or "model.layers.L.mlp." (every other family; Mixtral in the transformers v5
  /// naming).
  std::string prefix;
  /// Experts stored fused as experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]
  /// (transformers v5 in-memory layout) instead of one tensor per expert and projection.
  bool fused_experts = false;
};

/// The default layout of layer `layer`: per-expert tensors under "model.layers.L.mlp." (or
/// "model.layers.L.block_sparse_moe." for Mixtral, unless `fused_experts`, which transformers
/// v5 names "model.layers.L.mlp."); families that always fuse their experts (Llama 4 under
/// "feed_forward.", gpt-oss) are fused whatever `fused_experts` says.
inline HfLayout hf_default_layout(HfFamily family, Index layer, bool fused_experts = false) {
  HfTensorNames const& names = hf_family(family).names;
  HfLayout layout;
  layout.fused_experts =
      fused_experts || hf_family(family).storage != HfExpertStorage::kPerExpertOrFused;
  bool const v4 = !names.v4_module.empty() && !layout.fused_experts;
  layout.prefix = detail::concat("model.layers.", layer, ".", v4 ? names.v4_module : names.module);
  return layout;
}

/// Every tensor of one MoE layer of a model with config `c`, in `layout`: the router, the
/// selection bias (DeepSeek-V3), the routed experts (per expert: gate, up, down; or the two
/// fused tensors), the shared expert and its gate. Names follow ECOSYSTEM.md section 2:
///   Mixtral:     gate.weight, experts.j.{w1,w3,w2}.weight
///   Qwen2-MoE:   gate.weight, experts.j.{gate,up,down}_proj.weight,
///                shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight
///   Qwen3-MoE, OLMoE: gate.weight, experts.j.{gate,up,down}_proj.weight
///   DeepSeek-V3: gate.weight, gate.e_score_correction_bias, experts.j.{gate,up,down}_proj.weight,
///                shared_experts.{gate,up,down}_proj.weight (when n_shared_experts > 0)
///   Qwen3-Next:  as Qwen2-MoE
///   GLM-4.5:     as DeepSeek-V3
///   DeepSeek-V2: as DeepSeek-V3 without the correction bias
///   MiniMax-M2:  gate.weight, e_score_correction_bias, experts.j.{w1,w3,w2}.weight
///   ERNIE 4.5:   gate.weight, moe_statics.e_score_correction_bias [1, E],
///                experts.j.{gate,up,down}_proj.weight, shared_experts.{gate,up,down}_proj.weight
///   Llama 4:     router.weight, experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]
///                (fused, transposed; or, with layout.fused_experts false (a GGUF file's split
///                experts), experts.j.{gate,up,down}_proj.weight),
///                shared_expert.{gate,up,down}_proj.weight
///   gpt-oss:     router.weight, router.bias, experts.gate_up_proj [E, H, 2I] (interleaved),
///                experts.gate_up_proj_bias [E, 2I], experts.down_proj [E, I, H],
///                experts.down_proj_bias [E, H]; with MXFP4 experts.gate_up_proj_blocks /
///                _scales and experts.down_proj_blocks / _scales instead of the two weights;
///                or, with layout.fused_experts false (a GGUF file's split experts),
///                experts.j.{gate,up,down}_proj.{weight,bias}
///   ERNIE 4.5 with use_bias: also experts.j.{gate,up,down}_proj.bias and
///                shared_experts.{gate,up,down}_proj.bias (per-expert layout only)
inline std::vector<HfTensor> hf_layer_tensors(HfMoeConfig const& c, HfLayout const& layout) {
  std::vector<HfTensor> out;
  std::int64_t const H = c.hidden_size, E = c.num_experts, I = c.expert_intermediate_size;
  std::string const& p = layout.prefix;
  HfFamilySpec const& spec = c.spec();
  HfTensorNames const& names = spec.names;
  auto add = [&](std::string name, HfPart part, Index expert, std::vector<std::int64_t> shape) {
    out.push_back(HfTensor{std::move(name), part, expert, std::move(shape)});
  };
  add(detail::concat(p, names.router), HfPart::kRouter, -1, {E, H});
  if (c.has_router_bias()) add(p + "router.bias", HfPart::kRouterBias, -1, {E});
  if (c.has_selection_bias()) {
    add(detail::concat(p, names.selection_bias), HfPart::kSelectionBias, -1,
        names.selection_bias_row ? std::vector<std::int64_t>{1, E} : std::vector<std::int64_t>{E});
  }
  // gpt-oss's and Llama 4's experts one tensor per expert (a GGUF file's split experts) are read
  // as the per-expert layout of the other families, biases included.
  HfExpertStorage const storage =
      spec.storage != HfExpertStorage::kPerExpertOrFused && !layout.fused_experts
          ? HfExpertStorage::kPerExpertOrFused
          : spec.storage;
  switch (storage) {
    case HfExpertStorage::kFusedInterleaved:
      if (c.mxfp4) {
        add(p + "experts.gate_up_proj_blocks", HfPart::kExpertsGateUpBlocks, -1,
            {E, 2 * I, H / 32, 16});
        add(p + "experts.gate_up_proj_scales", HfPart::kExpertsGateUpScales, -1,
            {E, 2 * I, H / 32});
      } else {
        add(p + "experts.gate_up_proj", HfPart::kExpertsGateUpI, -1, {E, H, 2 * I});
      }
      add(p + "experts.gate_up_proj_bias", HfPart::kExpertsGateUpBias, -1, {E, 2 * I});
      if (c.mxfp4) {
        add(p + "experts.down_proj_blocks", HfPart::kExpertsDownBlocks, -1, {E, H, I / 32, 16});
        add(p + "experts.down_proj_scales", HfPart::kExpertsDownScales, -1, {E, H, I / 32});
      } else {
        add(p + "experts.down_proj", HfPart::kExpertsDownT, -1, {E, I, H});
      }
      add(p + "experts.down_proj_bias", HfPart::kExpertsDownBias, -1, {E, H});
      break;
    case HfExpertStorage::kFusedTransposed:
      add(p + "experts.gate_up_proj", HfPart::kExpertsGateUpT, -1, {E, H, 2 * I});
      add(p + "experts.down_proj", HfPart::kExpertsDownT, -1, {E, I, H});
      break;
    case HfExpertStorage::kPerExpertOrFused:
      if (layout.fused_experts) {
        add(p + "experts.gate_up_proj", HfPart::kExpertsGateUp, -1, {E, 2 * I, H});
        add(p + "experts.down_proj", HfPart::kExpertsDown, -1, {E, H, I});
        break;
      }
      for (Index e = 0; e < E; ++e) {
        std::string const base = detail::concat(p, "experts.", e, ".");
        add(detail::concat(base, names.gate, ".weight"), HfPart::kExpertGate, e, {I, H});
        add(detail::concat(base, names.up, ".weight"), HfPart::kExpertUp, e, {I, H});
        add(detail::concat(base, names.down, ".weight"), HfPart::kExpertDown, e, {H, I});
        if (c.has_expert_biases()) {
          add(detail::concat(base, names.gate, ".bias"), HfPart::kExpertGateBias, e, {I});
          add(detail::concat(base, names.up, ".bias"), HfPart::kExpertUpBias, e, {I});
          add(detail::concat(base, names.down, ".bias"), HfPart::kExpertDownBias, e, {H});
        }
      }
      break;
  }
  std::int64_t const Is = c.shared_intermediate_size();
  if (Is > 0) {
    std::string const sh = detail::concat(p, names.shared_module);
    add(sh + "gate_proj.weight", HfPart::kSharedGate, -1, {Is, H});
    add(sh + "up_proj.weight", HfPart::kSharedUp, -1, {Is, H});
    add(sh + "down_proj.weight", HfPart::kSharedDown, -1, {H, Is});
    if (c.has_expert_biases()) {
      add(sh + "gate_proj.bias", HfPart::kSharedGateBias, -1, {Is});
      add(sh + "up_proj.bias", HfPart::kSharedUpBias, -1, {Is});
      add(sh + "down_proj.bias", HfPart::kSharedDownBias, -1, {H});
    }
  }
  if (c.has_shared_expert_gate()) {
    add(p + "shared_expert_gate.weight", HfPart::kSharedExpertGate, -1, {1, H});
  }
  return out;
}

}  // namespace moe::io
