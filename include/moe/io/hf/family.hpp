// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// HfFamilySpec: everything moe knows about one Hugging Face model family, in one record. The
/// config parser, its JSON writer, the tensor names, the layer loader (which preset type, how
/// its router differs) and the whole-model decoder read a family's facts from its record
/// (moe/io/hf/families/<family>.hpp), never from a switch over the family. Adding a family is
/// one new file there plus its line in moe/io/hf/families.hpp (docs/design.md lists the steps).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "moe/core/types.hpp"

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
  kQwen35Moe,   ///< "qwen3_5_moe_text" (or "qwen3_5_moe"'s text_config): Qwen3-Next's block
};

/// Every family, in HfFamily order (the order of the registry, moe/io/hf/families.hpp).
inline constexpr HfFamily kHfFamilies[] = {
    HfFamily::kMixtral,   HfFamily::kQwen2Moe,   HfFamily::kQwen3Moe, HfFamily::kDeepseekV3,
    HfFamily::kOlmoe,     HfFamily::kQwen3Next,  HfFamily::kGlm4Moe,  HfFamily::kDeepseekV2,
    HfFamily::kMinimaxM2, HfFamily::kErnie45Moe, HfFamily::kLlama4,   HfFamily::kGptOss,
    HfFamily::kQwen35Moe};

struct HfMoeConfig;
namespace detail {
class HfConfigReader;
class HfJsonWriter;
}  // namespace detail

/// The preset MoE layer type (moe/layers/presets.hpp) that holds a family's layers.
enum class HfLayerType : std::uint8_t {
  kMixtral,     ///< presets::MixtralMoe
  kQwen2Moe,    ///< presets::Qwen2Moe (sigmoid-gated shared expert)
  kQwen3Moe,    ///< presets::Qwen3Moe (== OlmoeMoe: routed experts only)
  kDeepseekV3,  ///< presets::DeepseekV3Moe (GroupLimitedTopK, ungated shared experts)
  kLlama4,      ///< presets::Llama4Moe
  kGptOss,      ///< presets::GptOssMoe
};

/// Whether the top-k weights are renormalised: always (the family's block does it without a
/// key), never, or as config.json's norm_topk_prob says.
enum class HfNormTopK : std::uint8_t { kAlways, kNever, kKey };

/// A family's shared expert.
enum class HfShared : std::uint8_t {
  kNone,         ///< none
  kGated,        ///< one, of width shared_expert_intermediate_size, with a sigmoid gate
                 ///< (shared_expert_gate.weight [1, H]): Qwen2-MoE, Qwen3-Next
  kCount,        ///< one ungated expert of width n * I for n = the shared-count key
  kExpertWidth,  ///< one ungated expert of the routed experts' width (Llama 4)
};

/// Which decoder layers are MoE layers (HfMoeConfig::dense_reason() says why one is not).
enum class HfLayerRule : std::uint8_t {
  kEvery,       ///< every layer
  kSparseStep,  ///< not in mlp_only_layers, E > 0 and (L + 1) % decoder_sparse_step == 0 (Qwen)
  kFirstKFreq,  ///< L >= first_k_dense_replace and L % moe_layer_freq == 0 (DeepSeek-V3)
  kFirstK,      ///< L >= first_k_dense_replace (GLM-4.5, DeepSeek-V2)
  kRange,       ///< moe_layer_start_index <= L <= moe_layer_end_index and (L + 1) %
                ///< moe_layer_interval == 0 (ERNIE 4.5)
  kInterleave,  ///< L in moe_layers, else (L + 1) % interleave_moe_layer_step == 0 (Llama 4)
};

/// How a checkpoint stores the routed experts.
enum class HfExpertStorage : std::uint8_t {
  kPerExpertOrFused,  ///< experts.j.<proj>.weight, or experts.gate_up_proj [E, 2I, H] and
                      ///< experts.down_proj [E, H, I] (transformers v5)
  kFusedTransposed,   ///< always experts.gate_up_proj [E, H, 2I], down_proj [E, I, H] (Llama 4)
  kFusedInterleaved,  ///< always fused, x @ W with gate/up columns interleaved, biases, and
                      ///< optional MXFP4 blocks (gpt-oss)
};

/// Biases on the experts' projections.
enum class HfExpertBiases : std::uint8_t {
  kNone,
  kAlways,   ///< gpt-oss
  kUseBias,  ///< when config.json's use_bias is true (ERNIE 4.5)
};

/// The names of an MoE layer's tensors, relative to "model.layers.L." (see hf_layer_tensors()).
struct HfTensorNames {
  std::string_view module = "mlp.";  ///< the MoE block's module
  /// The module of the per-expert (transformers v4) layout when it differs from `module`
  /// (Mixtral: "block_sparse_moe."; v5 names both layouts "mlp.").
  std::string_view v4_module = {};
  std::string_view router = "gate.weight";  ///< [E, H]
  std::string_view selection_bias = {};     ///< the selection-only bias (empty: none)
  bool selection_bias_row = false;          ///< stored [1, E] (ERNIE 4.5), else [E]
  /// experts.j.<gate>.weight, <up>, <down>: gate_proj / up_proj / down_proj, or Mixtral's
  /// w1 / w3 / w2.
  std::string_view gate = "gate_proj", up = "up_proj", down = "down_proj";
  std::string_view shared_module = "shared_experts.";  ///< the shared expert's module
};

/// How a DeepseekV3Moe-type family's router differs from DeepSeek-V3's (GroupLimitedTopK; the
/// scores follow scoring_func, groups and scaling the config).
struct HfGroupRouting {
  bool group_max = false;   ///< a group's score is its best expert (DeepSeek-V2), not the top 2
  bool exact_norm = false;  ///< renormalise by the plain sum (no +1e-20 epsilon)
  bool norm_min = false;    ///< clamp the sum to at least moe_norm_min (ERNIE 4.5)
};

/// q/k RMSNorm of a family's attention: weighted per head or over all heads, or unweighted per
/// head on the RoPE layers only (Llama 4's Llama4TextL2Norm).
enum class HfQkNorm : std::uint8_t { kNone, kPerHead, kAllHeads, kUnweightedOnRope };

/// Projection biases of a family's attention (attention_bias true is refused for kNone).
enum class HfAttentionBias : std::uint8_t {
  kNone,
  kQkvKey,          ///< q/k/v biases as qkv_bias says (default true; Qwen2-MoE)
  kQkv,             ///< q/k/v biases as attention_bias says (default false; GLM-4.5)
  kAll,             ///< q/k/v/o biases as attention_bias says (default false; OLMoE)
  kAllOnByDefault,  ///< q/k/v/o biases as attention_bias says (default true; gpt-oss)
};

/// Which dimensions of a head RoPE rotates.
enum class HfRotary : std::uint8_t {
  kFull,       ///< all (partial_rotary_factor other than 1 is refused)
  kFactor,     ///< int(head_dim * partial_rotary_factor), default `rotary_factor` (GLM-4.5)
  kRotaryDim,  ///< partial_rotary_factor if given, else rotary_dim (default head_dim / 2)
};

/// Sliding-window attention.
enum class HfSliding : std::uint8_t {
  kRefused,     ///< use_sliding_window must be false
  kEveryLayer,  ///< sliding_window (null: none) on every layer (Mixtral)
  kLayerTypes,  ///< sliding_window (default `sliding_window`) on the layers layer_types calls
                ///< "sliding_attention" (default: the even ones; gpt-oss)
};

/// What the whole-model decoder (moe/models/decoder_config.hpp) needs of a family: the
/// transformers defaults of its decoder keys and its attention's kind.
struct HfDecoderFacts {
  /// Empty when the family decodes; else what moe lacks to decode it (for the error message).
  std::string_view lacks = {};
  Index vocab_size = 0, heads = 0;
  Index kv_heads = 0;  ///< 0: = heads
  double rope_theta = 10000.0, rms_norm_eps = 1e-6;
  Index dense_width = 0;  ///< the dense MLP layers' intermediate_size default; 0: none
  Index head_dim = 0;     ///< 0: hidden_size / heads
  bool tie_word_embeddings = false;
  HfQkNorm qk_norm = HfQkNorm::kNone;
  std::string_view qk_norm_key = {};  ///< empty: always as qk_norm says; else its switch
  bool qk_norm_default = false;       ///< the switch's default
  HfAttentionBias bias = HfAttentionBias::kNone;
  HfRotary rotary = HfRotary::kFull;
  double rotary_factor = 1.0;     ///< kFactor's default partial_rotary_factor
  bool rope_interleaved = false;  ///< RoPE on pairs (2i, 2i + 1) (ERNIE 4.5)
  bool sinks = false;             ///< a learned sink logit per head (gpt-oss)
  /// YaRN RoPE is read (rope_type "yarn"); and when rope_scaling is absent this default:
  bool yarn = false;
  double yarn_factor = 0.0;
  Index yarn_original_max_position = 0;
  bool yarn_truncate = true;
  HfSliding sliding = HfSliding::kRefused;
  Index sliding_window = 0;  ///< kLayerTypes' default window
  /// Llama 4's layers: no RoPE on the layers no_rope_layers marks 0 (default: every
  /// no_rope_layer_interval-th, 4), chunked attention (attention_chunk_size, 8192) on the layers
  /// layer_types calls "chunked_attention" (default: the RoPE ones), temperature tuning of the
  /// NoPE layers' queries (attn_temperature_tuning, floor_scale, attn_scale), and Llama 3 RoPE
  /// scaling read (rope_type "llama3").
  bool llama4_layers = false;
  /// Multi-head latent attention (DeepSeek-V2 / V3, Kimi K2): q_lora_rank (null: one q_proj),
  /// kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave (V3's key;
  /// V2's complex RoPE is the interleaved one), YaRN rope_scaling with mscale / mscale_all_dim.
  bool mla = false;
  /// V3's softmax correction by yarn_get_mscale(factor, mscale_all_dim)^2 (DeepseekV3Attention;
  /// transformers' DeepseekV2Attention has none).
  bool mla_softmax_mscale = false;
  Index q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0,
        v_head_dim = 0;  ///< their defaults (q_lora_rank 0: null)
  /// The dense MLP layers' module and width key ("mlp." and "intermediate_size"; Llama 4:
  /// "feed_forward." and "intermediate_size_mlp").
  /// Qwen3-Next's hybrid layers: layer_types ("linear_attention" or "full_attention" per layer;
  /// default: every full_attention_interval-th layer (4) full), Gated DeltaNet on the linear ones
  /// (linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
  /// linear_value_head_dim 128, linear_conv_kernel_dim 4), on the full ones a sigmoid output
  /// gate packed per head in q_proj, and every RMSNorm (layer, final, q/k) in the (1 + w) form.
  bool gated_deltanet = false;
  /// The Gated DeltaNet's input projections split as Qwen3.5's (in_proj_qkv, in_proj_z,
  /// in_proj_b, in_proj_a) instead of Qwen3-Next's head-grouped in_proj_qkvz and in_proj_ba.
  bool deltanet_split_projections = false;
  std::string_view dense_module = "mlp.";
  std::string_view dense_width_key = "intermediate_size";
  /// Refusals beyond the facts above (keys the decoder cannot honour), or nullptr.
  void (*check)(detail::HfConfigReader& r, HfMoeConfig const& moe, bool qk_norm,
                std::string const& source) = nullptr;
};

/// How llama.cpp's GGUF files hold a family (moe/io/gguf/hf_view.hpp reads them as a Hugging
/// Face model). An empty `arch`: moe does not read the family's GGUF files yet.
struct HfGgufFacts {
  std::string_view arch = {};  ///< general.architecture ("qwen3moe")
  /// Whether llama.cpp renormalises the top-k weights when the file has no
  /// {arch}.expert_weights_norm (its build function hard-codes it per architecture).
  bool norm_topk = false;
  /// The metadata key of the experts' width: "expert_feed_forward_length", or
  /// "feed_forward_length" where the converter writes the expert width there (llama, olmoe).
  std::string_view width_key = "expert_feed_forward_length";
  /// q_proj / k_proj rows are stored permuted for ggml's interleaved RoPE (llama.cpp's
  /// LlamaModel.permute): the reader undoes it.
  bool permuted_qk = false;
  /// The pre-MLP norm's tensor: "ffn_norm", or "post_attention_norm" (glm4moe).
  std::string_view mlp_norm = "ffn_norm";
  /// block_count includes this many multi-token-prediction layers (glm4moe:
  /// "nextn_predict_layers"); empty: none.
  std::string_view extra_layers_key = {};
  /// When several families share `arch`: the {arch}.expert_gating_func that selects this one
  /// (1 softmax, 2 sigmoid; an absent key reads as 1); 0: any.
  std::uint32_t gating_func = 0;
};

/// One model family: its names, config.json keys and transformers defaults, layer layout,
/// tensor names, routing and decoder facts. Every field has one reader (see the field's
/// comment); the hooks hold what no field can say.
struct HfFamilySpec {
  HfFamily family = HfFamily::kMixtral;
  std::string_view model_type = {};    ///< config.json "model_type"
  std::string_view architecture = {};  ///< transformers' causal LM class ("MixtralForCausalLM")
  HfLayerType layer_type = HfLayerType::kMixtral;
  /// The model_type of the multimodal config.json that nests this family's keys in text_config
  /// ("llama4", "qwen3_5_moe"); empty: none. Its checkpoints nest the text model's tensors
  /// (language_model.model.* or model.language_model.*).
  std::string_view nested_model_type = {};

  // The MoE keys every family has (config.json aliases in reading order, and defaults).
  Index hidden_size = 0;
  std::string_view width_key = "moe_intermediate_size";  ///< or "intermediate_size"
  Index width = 0;
  std::span<std::string_view const> experts_keys = {};  ///< first: the family's own name
  Index experts = 0;
  bool may_be_dense = false;  ///< 0 experts allowed (every layer dense; Qwen)
  std::span<std::string_view const> top_k_keys = {};
  Index top_k = 0;
  std::string_view top_k_required = {};  ///< non-empty: the key is required, and why
  HfNormTopK norm_topk = HfNormTopK::kKey;
  bool norm_topk_default = false;
  HfShared shared = HfShared::kNone;
  std::string_view shared_key = {};  ///< kGated: its width; kCount: the count
  Index shared_default = 0;
  HfLayerRule layer_rule = HfLayerRule::kEvery;
  Index first_k_dense_default = 0;  ///< kFirstK / kFirstKFreq: first_k_dense_replace's default
  bool grouped = false;  ///< reads n_group, topk_group, routed_scaling_factor (checked together)

  // Layers.
  HfTensorNames names = {};
  HfExpertStorage storage = HfExpertStorage::kPerExpertOrFused;
  HfExpertBiases expert_biases = HfExpertBiases::kNone;
  bool router_bias = false;  ///< router.bias [E] (gpt-oss)
  HfGroupRouting routing = {};

  /// The top-level keys of the family's transformers configuration class beyond the keys
  /// every config has (detail::hf_known_key): unknown keys are reported as likely misspelt.
  std::span<std::string_view const> keys = {};
  std::span<std::string_view const> more_keys = {};  ///< a second list (shared with another family)

  HfDecoderFacts decoder = {};
  HfGgufFacts gguf = {};

  /// Reads the family's keys beyond the fields above (after them, before the layer rule's).
  void (*read)(detail::HfConfigReader& r, HfMoeConfig& c) = nullptr;
  /// Writes what `read` reads (hf_config_json()).
  void (*write)(detail::HfJsonWriter& w, HfMoeConfig const& c) = nullptr;
  /// Checks what `read` read (after the common checks); throws moe::Error naming `where`.
  void (*validate)(HfMoeConfig const& c, std::string const& where) = nullptr;
};

}  // namespace moe::io
