// SPDX-License-Identifier: Apache-2.0
// config.json: the keys of each family, their transformers defaults, aliases, which layers are
// MoE layers, and hf_config_json() round trips.
#include <algorithm>
#include <catch2/catch.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "moe/io/hf/config.hpp"

namespace {

using Catch::Contains;
using moe::io::HfFamily;
using moe::io::HfMoeConfig;
using moe::io::parse_hf_config;

bool defaulted(HfMoeConfig const& c, std::string const& key) {
  for (auto const& k : c.defaulted_keys) {
    if (k == key) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("config.json of Mixtral-8x7B", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000})");
  REQUIRE(c.family == HfFamily::kMixtral);
  REQUIRE(std::string(c.model_type()) == "mixtral");
  REQUIRE(c.hidden_size == 4096);
  REQUIRE(c.expert_intermediate_size == 14336);
  REQUIRE(c.num_experts == 8);
  REQUIRE(c.num_experts_per_tok == 2);
  REQUIRE(c.norm_topk_prob);
  REQUIRE(c.num_hidden_layers == 32);
  REQUIRE(c.shared_intermediate_size() == 0);
  REQUIRE(c.defaulted_keys.empty());
  REQUIRE(c.unknown_keys.empty());  // every key of the real config.json is known
  REQUIRE(c.is_moe_layer(0));
  REQUIRE(c.is_moe_layer(31));
  REQUIRE_FALSE(c.is_moe_layer(32));
  REQUIRE_FALSE(c.is_moe_layer(-1));
}

TEST_CASE("config.json of Qwen1.5-MoE-A2.7B (qwen2_moe)", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 5632, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": false, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "shared_expert_intermediate_size": 5632,
    "rope_scaling": {"type": "yarn", "factor": 4.0}, "use_sliding_window": false})");
  REQUIRE(c.family == HfFamily::kQwen2Moe);
  REQUIRE(c.expert_intermediate_size == 1408);
  REQUIRE(c.shared_intermediate_size() == 5632);
  REQUIRE(c.num_experts == 60);
  REQUIRE(c.num_experts_per_tok == 4);
  REQUIRE_FALSE(c.norm_topk_prob);
  REQUIRE(defaulted(c, "mlp_only_layers"));
  REQUIRE(c.is_moe_layer(0));
}

TEST_CASE("config.json of Qwen3-30B-A3B and decoder_sparse_step / mlp_only_layers",
          "[hf][config]") {
  HfMoeConfig c = parse_hf_config(R"({"model_type": "qwen3_moe", "hidden_size": 2048,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "head_dim": 128})");
  REQUIRE(c.family == HfFamily::kQwen3Moe);
  REQUIRE(c.norm_topk_prob);
  REQUIRE(c.num_experts == 128);
  REQUIRE(c.is_moe_layer(47));
  REQUIRE(c.fp8_block_rows == 0);
  REQUIRE(parse_hf_config(R"({"model_type": "qwen3_moe", "quantization_config": {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "weight_block_size": [128, 64]}})")
              .fp8_block_cols == 64);

  c = parse_hf_config(R"({"model_type": "qwen3_moe", "decoder_sparse_step": 2,
    "mlp_only_layers": [3, 5]})");
  REQUIRE_FALSE(c.is_moe_layer(0));  // (0 + 1) % 2 != 0
  REQUIRE(c.is_moe_layer(1));
  REQUIRE_FALSE(c.is_moe_layer(3));  // listed
  REQUIRE_THAT(c.dense_reason(3), Contains("mlp_only_layers"));
  REQUIRE_THAT(c.dense_reason(2), Contains("decoder_sparse_step = 2"));
  REQUIRE(c.num_hidden_layers == -1);  // unknown: no range check
  REQUIRE(c.is_moe_layer(1001));

  c = parse_hf_config(R"({"model_type": "qwen2_moe", "num_experts": 0})");
  REQUIRE_FALSE(c.is_moe_layer(1));
  REQUIRE_THAT(c.dense_reason(1), Contains("num_experts = 0"));
}

TEST_CASE("config.json of DeepSeek-V3", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "norm_topk_prob": true, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "hidden_act": "silu", "ep_size": 1, "aux_loss_alpha": 0.001,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]}})");
  REQUIRE(c.family == HfFamily::kDeepseekV3);
  REQUIRE(c.num_experts == 256);
  REQUIRE(c.n_group == 8);
  REQUIRE(c.topk_group == 4);
  REQUIRE(c.routed_scaling_factor == 2.5f);
  REQUIRE(c.shared_intermediate_size() == 2048);
  REQUIRE(c.fp8_block_rows == 128);
  REQUIRE(c.fp8_block_cols == 128);
  REQUIRE(c.defaulted_keys.empty());
  REQUIRE_FALSE(c.is_moe_layer(2));
  REQUIRE_THAT(c.dense_reason(2), Contains("first_k_dense_replace = 3"));
  REQUIRE(c.is_moe_layer(3));
  REQUIRE(c.is_moe_layer(60));
  REQUIRE_FALSE(c.is_moe_layer(61));  // the MTP module is not a decoder layer
  REQUIRE_THAT(c.dense_reason(61), Contains("num_hidden_layers = 61"));

  HfMoeConfig const f = parse_hf_config(
      R"({"model_type": "deepseek_v3", "first_k_dense_replace": 1, "moe_layer_freq": 2})");
  REQUIRE_FALSE(f.is_moe_layer(0));
  REQUIRE_FALSE(f.is_moe_layer(1));
  REQUIRE(f.is_moe_layer(2));
  REQUIRE_THAT(f.dense_reason(3), Contains("moe_layer_freq = 2"));
}

TEST_CASE("config.json of OLMoE-1B-7B", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({"model_type": "olmoe", "hidden_size": 2048,
    "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
    "norm_topk_prob": false, "num_hidden_layers": 16, "clip_qkv": null})");
  REQUIRE(c.family == HfFamily::kOlmoe);
  REQUIRE(c.expert_intermediate_size == 1024);
  REQUIRE(c.num_experts == 64);
  REQUIRE_FALSE(c.norm_topk_prob);
  REQUIRE(c.is_moe_layer(15));
}

TEST_CASE("Absent or null keys take the transformers defaults", "[hf][config]") {
  struct Want {
    char const* type;
    moe::Index H, I, E, k;
    bool norm;
  };
  for (Want const w :
       {Want{"mixtral", 4096, 14336, 8, 2, true}, Want{"qwen2_moe", 2048, 1408, 60, 4, false},
        Want{"qwen3_moe", 2048, 768, 128, 8, false}, Want{"deepseek_v3", 7168, 2048, 256, 8, true},
        Want{"olmoe", 2048, 2048, 64, 8, false}}) {
    INFO(w.type);
    std::string json = R"({"model_type": ")";
    json.append(w.type).append(R"(", "hidden_size": null})");
    HfMoeConfig const c = parse_hf_config(json);
    REQUIRE(c.hidden_size == w.H);
    REQUIRE(c.expert_intermediate_size == w.I);
    REQUIRE(c.num_experts == w.E);
    REQUIRE(c.num_experts_per_tok == w.k);
    REQUIRE(c.norm_topk_prob == w.norm);
    REQUIRE(c.hidden_act == "silu");
    REQUIRE(defaulted(c, "hidden_size"));
    REQUIRE(defaulted(c, "num_experts_per_tok"));
  }
  HfMoeConfig const q = parse_hf_config(R"({"model_type": "qwen2_moe"})");
  REQUIRE(q.shared_expert_intermediate_size == 5632);
  HfMoeConfig const d = parse_hf_config(R"({"model_type": "deepseek_v3"})");
  REQUIRE(d.n_shared_experts == 1);
  REQUIRE(d.n_group == 8);
  REQUIRE(d.topk_group == 4);
  REQUIRE(d.routed_scaling_factor == 2.5f);
  REQUIRE(d.first_k_dense_replace == 3);
  REQUIRE(d.fp8_block_rows == 0);
}

TEST_CASE("Expert-count aliases are accepted and must agree", "[hf][config]") {
  REQUIRE(parse_hf_config(R"({"model_type": "mixtral", "num_experts": 4})").num_experts == 4);
  REQUIRE(parse_hf_config(R"({"model_type": "deepseek_v3", "num_local_experts": 16,
                              "n_group": 4, "topk_group": 2})")
              .num_experts == 16);
  REQUIRE(parse_hf_config(R"({"model_type": "olmoe", "num_experts": 8, "num_local_experts": 8,
                              "num_experts_per_tok": 2})")
              .num_experts == 8);
  REQUIRE_THROWS_WITH(
      parse_hf_config(R"({"model_type": "mixtral", "num_local_experts": 8, "num_experts": 4})"),
      Contains("\"num_local_experts\" = 8 and \"num_experts\" = 4") && Contains("disagree"));
}

TEST_CASE("hf_config_json round-trips through parse_hf_config", "[hf][config]") {
  HfMoeConfig c = parse_hf_config(R"({"model_type": "deepseek_v3", "hidden_size": 64,
    "moe_intermediate_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 1.5, "n_shared_experts": 2, "norm_topk_prob": false,
    "first_k_dense_replace": 1, "moe_layer_freq": 2, "num_hidden_layers": 5,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}})");
  HfMoeConfig const back = parse_hf_config(moe::io::hf_config_json(c, "bfloat16"));
  REQUIRE(back.defaulted_keys.empty());
  REQUIRE(back.unknown_keys.empty());
  for (HfMoeConfig const* x : {static_cast<HfMoeConfig const*>(&c), &back}) {
    REQUIRE(x->hidden_size == 64);
    REQUIRE(x->expert_intermediate_size == 16);
    REQUIRE(x->num_experts == 16);
    REQUIRE(x->num_experts_per_tok == 4);
    REQUIRE(x->n_group == 4);
    REQUIRE(x->topk_group == 2);
    REQUIRE(x->routed_scaling_factor == 1.5f);
    REQUIRE(x->n_shared_experts == 2);
    REQUIRE_FALSE(x->norm_topk_prob);
    REQUIRE(x->first_k_dense_replace == 1);
    REQUIRE(x->moe_layer_freq == 2);
    REQUIRE(x->num_hidden_layers == 5);
    REQUIRE(x->fp8_block_rows == 64);
    REQUIRE(x->fp8_block_cols == 32);
  }
  c = parse_hf_config(R"({"model_type": "qwen2_moe", "mlp_only_layers": [0, 2],
    "decoder_sparse_step": 3, "norm_topk_prob": true})");
  HfMoeConfig const q = parse_hf_config(moe::io::hf_config_json(c));
  REQUIRE(q.mlp_only_layers == std::vector<moe::Index>{0, 2});
  REQUIRE(q.decoder_sparse_step == 3);
  REQUIRE(q.norm_topk_prob);
  REQUIRE(q.shared_expert_intermediate_size == 5632);
  for (char const* type : {"mixtral", "qwen3_moe", "olmoe"}) {
    std::string json = R"({"model_type": ")";
    json.append(type).append(R"(", "hidden_size": 32, "num_experts_per_tok": 1})");
    HfMoeConfig const a = parse_hf_config(json);
    HfMoeConfig const b = parse_hf_config(moe::io::hf_config_json(a));
    REQUIRE(b.family == a.family);
    REQUIRE(b.hidden_size == 32);
    REQUIRE(b.num_experts == a.num_experts);
    REQUIRE(b.expert_intermediate_size == a.expert_intermediate_size);
    REQUIRE(b.norm_topk_prob == a.norm_topk_prob);
    REQUIRE(b.num_experts_per_tok == 1);
  }
}

TEST_CASE("config.json keys transformers does not know are listed (a misspelt key)",
          "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({"model_type": "qwen3_moe", "hidden_size": 64,
    "moe_intermediate_size": 16, "num_experts": 8, "num_expert_per_tok": 4,
    "norm_topk_probs": true, "vocab_size": 100, "rope_theta": 1e6, "head_dim": 8})");
  REQUIRE(c.unknown_keys == std::vector<std::string>{"num_expert_per_tok", "norm_topk_probs"});
  REQUIRE(defaulted(c, "num_experts_per_tok"));  // what the typo cost: the default 8 ...
  REQUIRE(c.num_experts_per_tok == 8);
  REQUIRE(defaulted(c, "norm_topk_prob"));  // ... and false
  // Keys of another family are unknown to this one.
  REQUIRE(parse_hf_config(R"({"model_type": "mixtral", "n_group": 2})").unknown_keys ==
          std::vector<std::string>{"n_group"});
  // DeepSeek-V3's Hub config.json keys (remote code included) are all known.
  REQUIRE(parse_hf_config(R"({"model_type": "deepseek_v3", "ep_size": 1, "kv_lora_rank": 512,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "auto_map": {}, "rope_scaling": {}})")
              .unknown_keys.empty());
}

TEST_CASE("config.json of Qwen3-Next-80B-A3B (qwen3_next)", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512,
    "norm_topk_prob": true, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "output_router_logits": false, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
  REQUIRE(c.family == HfFamily::kQwen3Next);
  REQUIRE(c.num_experts == 512);
  REQUIRE(c.num_experts_per_tok == 10);
  REQUIRE(c.expert_intermediate_size == 512);
  REQUIRE(c.shared_intermediate_size() == 512);
  REQUIRE(c.has_shared_expert_gate());
  REQUIRE_FALSE(c.has_selection_bias());
  REQUIRE(c.norm_topk_prob);
  REQUIRE(c.defaulted_keys.empty());
  REQUIRE(c.unknown_keys.empty());
  // layer_types picks the attention (linear / full), not the MLP: every layer is MoE.
  REQUIRE(c.is_moe_layer(0));
  REQUIRE(c.is_moe_layer(3));
  REQUIRE(c.is_moe_layer(47));
  HfMoeConfig const d = parse_hf_config(R"({"model_type": "qwen3_next"})");
  REQUIRE(d.norm_topk_prob);  // Qwen3NextConfig's default, unlike Qwen3MoeConfig's
  REQUIRE(d.num_experts_per_tok == 10);
  HfMoeConfig const m = parse_hf_config(
      R"({"model_type": "qwen3_next", "mlp_only_layers": [1], "decoder_sparse_step": 2})");
  REQUIRE_FALSE(m.is_moe_layer(0));
  REQUIRE_FALSE(m.is_moe_layer(1));
  REQUIRE_THAT(m.dense_reason(1), Contains("mlp_only_layers"));
  REQUIRE(m.is_moe_layer(3));
}

TEST_CASE("config.json of GLM-4.5 (glm4_moe)", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": true,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": true, "use_qk_norm": true,
    "vocab_size": 151552})");
  REQUIRE(c.family == HfFamily::kGlm4Moe);
  REQUIRE(c.num_experts == 160);
  REQUIRE(c.expert_intermediate_size == 1536);
  REQUIRE(c.shared_intermediate_size() == 1536);
  REQUIRE_FALSE(c.has_shared_expert_gate());
  REQUIRE(c.has_selection_bias());
  REQUIRE(c.routed_scaling_factor == 2.5f);
  REQUIRE(c.defaulted_keys.empty());
  REQUIRE(c.unknown_keys.empty());
  REQUIRE_FALSE(c.is_moe_layer(2));
  REQUIRE_THAT(c.dense_reason(2), Contains("first_k_dense_replace = 3"));
  REQUIRE(c.is_moe_layer(3));
  REQUIRE(c.is_moe_layer(91));
  REQUIRE_FALSE(c.is_moe_layer(92));  // the MTP layer is not a decoder layer
  HfMoeConfig const d = parse_hf_config(R"({"model_type": "glm4_moe"})");  // GLM-4.5-Air
  REQUIRE(d.num_experts == 128);
  REQUIRE(d.expert_intermediate_size == 1408);
  REQUIRE(d.first_k_dense_replace == 1);
  REQUIRE(d.routed_scaling_factor == 1.0f);
  REQUIRE(d.n_group == 1);
  // GLM has no moe_layer_freq: every layer from first_k_dense_replace on is MoE.
  HfMoeConfig const f = parse_hf_config(R"({"model_type": "glm4_moe", "moe_layer_freq": 2})");
  REQUIRE(f.unknown_keys == std::vector<std::string>{"moe_layer_freq"});
  REQUIRE(f.is_moe_layer(3));
}

TEST_CASE("config.json of DeepSeek-V2 and V2-Lite (deepseek_v2)", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001,
    "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 12288, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1536,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 160, "n_shared_experts": 2,
    "norm_topk_prob": false, "num_attention_heads": 128, "num_experts_per_tok": 6,
    "num_hidden_layers": 60, "num_key_value_heads": 128, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "routed_scaling_factor": 16.0, "scoring_func": "softmax",
    "seq_aux": true, "tie_word_embeddings": false, "topk_group": 3,
    "topk_method": "group_limited_greedy", "torch_dtype": "bfloat16", "use_cache": true,
    "v_head_dim": 128, "vocab_size": 102400})");
  REQUIRE(c.family == HfFamily::kDeepseekV2);
  REQUIRE(c.num_experts == 160);
  REQUIRE(c.num_experts_per_tok == 6);
  REQUIRE(c.n_group == 8);
  REQUIRE(c.topk_group == 3);
  REQUIRE(c.topk_method == "group_limited_greedy");
  REQUIRE(c.routed_scaling_factor == 16.0f);
  REQUIRE(c.shared_intermediate_size() == 2 * 1536);
  REQUIRE_FALSE(c.has_selection_bias());
  REQUIRE_FALSE(c.norm_topk_prob);
  REQUIRE(c.defaulted_keys.empty());
  REQUIRE(c.unknown_keys.empty());
  REQUIRE(c.ignored_settings.empty());
  REQUIRE_FALSE(c.is_moe_layer(0));
  REQUIRE(c.is_moe_layer(1));
  // V2-Lite: greedy (DeepSeek's remote code spells it "gready"), no groups.
  HfMoeConfig const lite = parse_hf_config(R"({"model_type": "deepseek_v2",
    "n_routed_experts": 64, "num_experts_per_tok": 6, "topk_method": "gready", "n_group": 1,
    "topk_group": 1, "moe_intermediate_size": 1408})");
  REQUIRE(lite.topk_method == "greedy");
  REQUIRE(lite.n_group == 1);
  // Settings transformers ignores for this family are reported, not applied.
  HfMoeConfig const odd = parse_hf_config(R"({"model_type": "deepseek_v2",
    "num_experts_per_tok": 6, "norm_topk_prob": true, "moe_layer_freq": 2})");
  REQUIRE_FALSE(odd.norm_topk_prob);
  REQUIRE(odd.ignored_settings.size() == 2);
  REQUIRE_THAT(odd.ignored_settings[0], Contains("norm_topk_prob = true"));
  REQUIRE_THAT(odd.ignored_settings[1], Contains("moe_layer_freq = 2"));
  REQUIRE(odd.is_moe_layer(1));  // transformers: every layer from first_k_dense_replace on
  // transformers' defaults for top-k and the groups are None: required.
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v2"})"),
                      Contains("lacks \"num_experts_per_tok\"") && Contains("None"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 2,
    "topk_method": "group_limited_greedy", "topk_group": 2})"),
                      Contains("lacks \"n_group\""));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 2,
    "topk_method": "noaux_tc"})"),
                      Contains("topk_method 'noaux_tc' is not supported"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "deepseek_v2", "num_experts_per_tok": 2,
    "scoring_func": "sigmoid"})"),
                      Contains("scoring_func 'sigmoid' is not supported"));
}

TEST_CASE("config.json of MiniMax-M2 (minimax_m2)", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1, 1, 1],
    "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config"},
    "bos_token_id": null, "eos_token_id": null, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
    "model_type": "minimax_m2", "mtp_transformer_layers": 1, "num_attention_heads": 48,
    "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "num_mtp_modules": 3, "output_router_logits": false,
    "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000,
    "rotary_dim": 64, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": false,
    "transformers_version": "4.46.1", "use_cache": true, "use_mtp": true, "use_qk_norm": true,
    "use_routing_bias": true, "vocab_size": 200064})");
  REQUIRE(c.family == HfFamily::kMinimaxM2);
  REQUIRE(c.num_experts == 256);
  REQUIRE(c.expert_intermediate_size == 1536);
  REQUIRE(c.num_experts_per_tok == 8);
  REQUIRE(c.norm_topk_prob);
  REQUIRE(c.has_selection_bias());
  REQUIRE(c.shared_intermediate_size() == 0);
  REQUIRE(c.defaulted_keys.empty());
  REQUIRE(c.unknown_keys.empty());
  REQUIRE(c.ignored_settings.empty());
  REQUIRE(c.is_moe_layer(0));
  REQUIRE(c.is_moe_layer(61));
  HfMoeConfig const odd = parse_hf_config(R"({"model_type": "minimax_m2",
    "scoring_func": "softmax", "use_routing_bias": false, "shared_intermediate_size": 512})");
  REQUIRE(odd.ignored_settings.size() == 3);
  REQUIRE_THAT(odd.ignored_settings[0], Contains("always scores with sigmoid"));
}

TEST_CASE("config.json of ERNIE-4.5-21B-A3B (ernie4_5_moe)", "[hf][config]") {
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "ernie4_5_moe", "num_attention_heads": 20,
    "num_key_value_heads": 4, "num_hidden_layers": 28, "pad_token_id": 0, "rms_norm_eps": 1e-05,
    "use_cache": false, "vocab_size": 103424, "rope_theta": 500000, "use_bias": false,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "moe_num_experts": 64,
    "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_intermediate_size": 1536,
    "moe_capacity": [64, 64, 64], "moe_gate": "topk", "moe_k": 6, "moe_layer_interval": 1,
    "moe_use_aux_free": true, "head_dim": 128})");
  REQUIRE(c.family == HfFamily::kErnie45Moe);
  REQUIRE(c.num_experts == 64);
  REQUIRE(c.num_experts_per_tok == 6);
  REQUIRE(c.expert_intermediate_size == 1536);
  REQUIRE(c.shared_intermediate_size() == 2 * 1536);
  REQUIRE(c.has_selection_bias());
  REQUIRE(c.moe_norm_min == 1e-12f);
  REQUIRE(c.moe_layer_end_index == -1);
  REQUIRE(c.unknown_keys.empty());
  REQUIRE_FALSE(c.is_moe_layer(0));
  REQUIRE_THAT(c.dense_reason(0), Contains("moe_layer_start_index = 1"));
  REQUIRE(c.is_moe_layer(1));
  REQUIRE(c.is_moe_layer(27));
  REQUIRE_FALSE(c.is_moe_layer(28));
  HfMoeConfig const r = parse_hf_config(R"({"model_type": "ernie4_5_moe", "num_hidden_layers": 12,
    "moe_layer_start_index": 2, "moe_layer_end_index": 9, "moe_layer_interval": 2})");
  for (moe::Index L = 0; L < 12; ++L) {
    INFO("layer " << L);
    REQUIRE(r.is_moe_layer(L) == (L >= 2 && L <= 9 && (L + 1) % 2 == 0));
  }
  REQUIRE_THAT(r.dense_reason(11), Contains("moe_layer_end_index = 9"));
  REQUIRE_THAT(r.dense_reason(4), Contains("moe_layer_interval = 2"));
  // Aliases (attribute_map): num_experts, num_experts_per_tok.
  HfMoeConfig const a = parse_hf_config(
      R"({"model_type": "ernie4_5_moe", "num_experts": 16, "num_experts_per_tok": 2})");
  REQUIRE(a.num_experts == 16);
  REQUIRE(a.num_experts_per_tok == 2);
  REQUIRE_FALSE(a.use_bias);
  REQUIRE_FALSE(a.has_expert_biases());
  HfMoeConfig const biased = parse_hf_config(R"({"model_type": "ernie4_5_moe", "use_bias": true})");
  REQUIRE(biased.use_bias);
  REQUIRE(biased.has_expert_biases());
  REQUIRE_FALSE(biased.has_router_bias());
  REQUIRE_THROWS_WITH(
      parse_hf_config(R"({"model_type": "ernie4_5_moe", "moe_layer_end_index": -2})"),
      Contains("moe_layer_end_index"));
}

TEST_CASE("config.json of gpt-oss-20b (gpt_oss, MXFP4 experts)", "[hf][config]") {
  // openai/gpt-oss-20b config.json (layer_types shortened to its pattern's first four).
  HfMoeConfig const c = parse_hf_config(R"({
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
      "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
      "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088})");
  REQUIRE(c.family == HfFamily::kGptOss);
  REQUIRE(c.unknown_keys.empty());
  REQUIRE(c.hidden_size == 2880);
  REQUIRE(c.expert_intermediate_size == 2880);
  REQUIRE(c.num_experts == 32);
  REQUIRE(c.num_experts_per_tok == 4);
  REQUIRE(c.swiglu_limit == 7.0f);
  REQUIRE(c.swiglu_alpha == 1.702f);  // transformers' hard-coded alpha (v5: swiglu_alpha)
  REQUIRE(c.mxfp4);
  REQUIRE(c.has_router_bias());
  REQUIRE(c.has_expert_biases());
  REQUIRE(c.shared_intermediate_size() == 0);
  for (moe::Index L = 0; L < 24; ++L) REQUIRE(c.is_moe_layer(L));
  REQUIRE_FALSE(c.is_moe_layer(24));
  // gpt-oss-120b's sizes, and the defaults of GptOssConfig.
  HfMoeConfig const d = parse_hf_config(R"({"model_type": "gpt_oss"})");
  REQUIRE(d.num_experts == 128);
  REQUIRE(d.num_experts_per_tok == 4);
  REQUIRE(d.hidden_size == 2880);
  REQUIRE_FALSE(d.mxfp4);
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "gpt_oss", "swiglu_limit": 0})"),
                      Contains("swiglu_limit"));
  REQUIRE_THROWS_WITH(parse_hf_config(R"({"model_type": "gpt_oss", "hidden_size": 48,
                          "quantization_config": {"quant_method": "mxfp4"}})"),
                      Contains("multiples of 32"));
  REQUIRE_THROWS_WITH(
      parse_hf_config(
          R"({"model_type": "mixtral", "quantization_config": {"quant_method": "mxfp4"}})"),
      Contains("mxfp4") && Contains("not supported"));
}

TEST_CASE("hf_config_json round-trips every family", "[hf][config]") {
  for (HfFamily const family : moe::io::kHfFamilies) {
    INFO(moe::io::hf_model_type(family));
    std::string json = R"({"model_type": ")";
    json.append(moe::io::hf_model_type(family))
        .append(R"(", "hidden_size": 32, "num_experts_per_tok": 2, "num_hidden_layers": 6})");
    HfMoeConfig a = parse_hf_config(json);
    a.routed_scaling_factor =
        a.family == HfFamily::kMinimaxM2 || a.family == HfFamily::kErnie45Moe ? 1.0f : 1.25f;
    a.moe_norm_min = 1e-9f;
    HfMoeConfig const b = parse_hf_config(moe::io::hf_config_json(a));
    REQUIRE(b.family == a.family);
    REQUIRE(b.defaulted_keys.empty());
    REQUIRE(b.unknown_keys.empty());
    REQUIRE(b.hidden_size == 32);
    REQUIRE(b.num_experts == a.num_experts);
    REQUIRE(b.num_experts_per_tok == 2);
    REQUIRE(b.expert_intermediate_size == a.expert_intermediate_size);
    REQUIRE(b.shared_intermediate_size() == a.shared_intermediate_size());
    REQUIRE(b.norm_topk_prob == a.norm_topk_prob);
    REQUIRE(b.n_group == a.n_group);
    REQUIRE(b.topk_group == a.topk_group);
    REQUIRE(b.topk_method == a.topk_method);
    if (a.family == HfFamily::kErnie45Moe) {
      REQUIRE(b.moe_norm_min == 1e-9f);
      REQUIRE(b.moe_layer_end_index == -1);
    }
    REQUIRE(b.swiglu_limit == a.swiglu_limit);
    REQUIRE(b.has_expert_biases() == a.has_expert_biases());
    if (a.family == HfFamily::kDeepseekV3 || a.family == HfFamily::kGlm4Moe ||
        a.family == HfFamily::kDeepseekV2) {
      REQUIRE(b.routed_scaling_factor == 1.25f);
    }
    for (moe::Index L = 0; L < 6; ++L) REQUIRE(b.is_moe_layer(L) == a.is_moe_layer(L));
  }
}

TEST_CASE("every family's description is consistent", "[hf][config]") {
  using moe::io::hf_family;
  using moe::io::HfFamilySpec;
  std::vector<std::string_view> types;
  for (HfFamily const family : moe::io::kHfFamilies) {
    HfFamilySpec const& s = hf_family(family);
    INFO(s.model_type);
    REQUIRE(s.family == family);
    REQUIRE(std::find(types.begin(), types.end(), s.model_type) == types.end());
    types.push_back(s.model_type);
    REQUIRE(s.architecture.ends_with("ForCausalLM"));
    REQUIRE_FALSE(s.experts_keys.empty());
    REQUIRE_FALSE(s.top_k_keys.empty());
    REQUIRE(s.hidden_size > 0);
    REQUIRE(s.width > 0);
    REQUIRE(s.experts > 0);
    REQUIRE((s.top_k > 0) != !s.top_k_required.empty());
    REQUIRE((s.shared == moe::io::HfShared::kNone || s.shared == moe::io::HfShared::kExpertWidth) ==
            s.shared_key.empty());
    // A family that decodes has its decoder defaults; one that does not says what moe lacks.
    if (s.decoder.lacks.empty()) {
      REQUIRE(s.decoder.vocab_size > 0);
      REQUIRE(s.decoder.heads > 0);
      REQUIRE(s.decoder.rms_norm_eps > 0.0);
    }
    // A config.json with the model type alone (DeepSeek-V2 needs its top-k) takes the record's
    // defaults.
    std::string json = std::string(R"({"model_type": ")") + hf_model_type(family) + "\"";
    if (!s.top_k_required.empty()) json += R"(, "num_experts_per_tok": 2)";
    HfMoeConfig const c = parse_hf_config(json + "}");
    REQUIRE(c.hidden_size == s.hidden_size);
    REQUIRE(c.expert_intermediate_size == s.width);
    REQUIRE(c.num_experts == s.experts);
    REQUIRE(c.num_experts_per_tok == (s.top_k_required.empty() ? s.top_k : 2));
    REQUIRE(c.unknown_keys.empty());
    // Every alias the parser reads is read, and is never reported as an unknown key (Mixtral's
    // n_routed_experts once was).
    for (std::string_view const key : s.experts_keys) {
      HfMoeConfig const a =
          parse_hf_config(moe::io::detail::concat(json, ", \"", key, "\": ", 2 * s.experts, "}"));
      REQUIRE(a.num_experts == 2 * s.experts);
      REQUIRE(a.unknown_keys.empty());
    }
  }
}
