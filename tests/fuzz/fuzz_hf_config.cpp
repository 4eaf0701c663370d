// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the Hugging Face config.json parser (moe::io::parse_hf_config and the
// JSON reader under it): arbitrary bytes must either be rejected with moe::Error or give an
// HfMoeConfig that passes the documented checks, answers is_moe_layer() for any layer, and
// survives hf_config_json() -> parse_hf_config() unchanged; and the whole-model decoder's
// parse_decoder_config on the same bytes is rejected with moe::Error or gives sizes a decoder
// can be built from. Any other outcome (a crash, a
// sanitizer report, another exception, a broken invariant) is a bug. Built with clang
// -fsanitize=fuzzer,address,undefined by the "fuzz: hf_config libFuzzer" test, and with the
// normal compiler into moe_fuzz_replay_hf_config (tests/fuzz/replay_main.cpp).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "moe/core/error.hpp"
#include "moe/io/hf/config.hpp"
#include "moe/models/decoder_config.hpp"

namespace {

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

bool same(moe::io::HfMoeConfig const& a, moe::io::HfMoeConfig const& b) {
  return a.family == b.family && a.hidden_size == b.hidden_size && a.num_experts == b.num_experts &&
         a.num_experts_per_tok == b.num_experts_per_tok &&
         a.expert_intermediate_size == b.expert_intermediate_size &&
         a.norm_topk_prob == b.norm_topk_prob && a.hidden_act == b.hidden_act &&
         a.num_hidden_layers == b.num_hidden_layers &&
         a.shared_expert_intermediate_size == b.shared_expert_intermediate_size &&
         a.decoder_sparse_step == b.decoder_sparse_step && a.mlp_only_layers == b.mlp_only_layers &&
         a.n_shared_experts == b.n_shared_experts && a.n_group == b.n_group &&
         a.topk_group == b.topk_group && a.routed_scaling_factor == b.routed_scaling_factor &&
         a.scoring_func == b.scoring_func && a.topk_method == b.topk_method &&
         a.first_k_dense_replace == b.first_k_dense_replace &&
         a.moe_layer_freq == b.moe_layer_freq && a.fp8_block_rows == b.fp8_block_rows &&
         a.fp8_block_cols == b.fp8_block_cols &&
         a.moe_layer_start_index == b.moe_layer_start_index &&
         a.moe_layer_end_index == b.moe_layer_end_index &&
         a.moe_layer_interval == b.moe_layer_interval && a.moe_norm_min == b.moe_norm_min &&
         a.interleave_moe_layer_step == b.interleave_moe_layer_step &&
         a.moe_layers_given == b.moe_layers_given && a.moe_layers == b.moe_layers &&
         a.swiglu_limit == b.swiglu_limit && a.swiglu_alpha == b.swiglu_alpha &&
         a.mxfp4 == b.mxfp4 && a.use_bias == b.use_bias;
}

/// parse_decoder_config on an accepted MoE config: moe::Error, or sizes a decoder can use.
void check_decoder(std::string_view text) {
  moe::models::DecoderConfig d;
  try {
    d = moe::models::parse_decoder_config(text, "fuzz/config.json");
  } catch (moe::Error const&) {
    return;
  }
  require(d.num_hidden_layers >= 1 && d.vocab_size >= 1 && d.head_dim >= 1);
  require(d.num_attention_heads >= 1 && d.num_key_value_heads >= 1 &&
          d.num_attention_heads % d.num_key_value_heads == 0);
  require(d.rotary_dim == 0 ||
          (d.rotary_dim >= 2 && d.rotary_dim % 2 == 0 && d.rotary_dim <= d.head_dim));
  require(static_cast<moe::Index>(d.layer_windows.size()) == d.num_hidden_layers);
  for (moe::Index const w : d.layer_windows) require(w == 0 || w == d.sliding_window);
  require(std::isfinite(d.rope_theta) && d.rope_theta >= 1.0f);
  require(std::isfinite(d.rms_norm_eps) && d.rms_norm_eps > 0.0f);
  require(d.intermediate_size >= 0);
  auto const& y = d.yarn;
  require(y.factor == 0.0f ||
          (std::isfinite(y.factor) && y.factor > 0.0f && y.original_max_position >= 1 &&
           y.beta_fast > 0.0f && y.beta_slow > 0.0f && y.attention_factor >= 0.0f));
}

}  // namespace

/// Parses `data` as a config.json; returns 1 if it was accepted, 0 if it was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  std::string_view const text(reinterpret_cast<char const*>(data), size);
  moe::io::HfMoeConfig c;
  try {
    c = moe::io::parse_hf_config(text, "fuzz/config.json");
  } catch (moe::Error const&) {
    return 0;
  }
  // What parse_hf_config promises about an accepted config.
  require(c.hidden_size >= 1 && c.expert_intermediate_size >= 1);
  require(c.num_experts >= 0 && c.num_experts_per_tok >= 1);
  require(c.num_experts == 0 || c.num_experts_per_tok <= c.num_experts);
  require(c.hidden_act == "silu" || c.hidden_act == "swish");
  require(c.decoder_sparse_step >= 1 && c.moe_layer_freq >= 1);
  require(c.n_group >= 1 && c.topk_group >= 1);
  require((c.fp8_block_rows == 0) == (c.fp8_block_cols == 0));
  require(c.num_hidden_layers == -1 || c.num_hidden_layers >= 1);
  require(c.shared_intermediate_size() >= 0);
  require(c.moe_layer_interval >= 1 && c.moe_layer_end_index >= -1);
  require(c.moe_norm_min >= 0.0f && c.moe_norm_min <= 1.0f);
  require(std::isfinite(c.swiglu_limit) && c.swiglu_limit > 0.0f);
  require(std::isfinite(c.swiglu_alpha) && c.swiglu_alpha > 0.0f);
  require(!c.mxfp4 || (c.family == moe::io::HfFamily::kGptOss && c.hidden_size % 32 == 0 &&
                       c.expert_intermediate_size % 32 == 0));
  if (c.family == moe::io::HfFamily::kDeepseekV3 || c.family == moe::io::HfFamily::kGlm4Moe ||
      c.family == moe::io::HfFamily::kDeepseekV2) {
    require(c.num_experts % c.n_group == 0 && c.topk_group <= c.n_group);
    require(c.routed_scaling_factor > 0.0f && c.routed_scaling_factor <= 1e6f);
    require(c.num_experts_per_tok <= c.topk_group * (c.num_experts / c.n_group));
  }
  // Every layer question has an answer (no division by zero, no overflow in the messages).
  for (moe::Index layer : {moe::Index{-1}, moe::Index{0}, moe::Index{1}, moe::Index{2},
                           moe::Index{3}, moe::Index{61}, moe::Index{INT32_MAX}}) {
    require(c.is_moe_layer(layer) == c.dense_reason(layer).empty());
  }
  // The writer writes what the parser reads, and the parser reads it back.
  std::string const json = moe::io::hf_config_json(c, "bfloat16");
  moe::io::HfMoeConfig again;
  try {
    again = moe::io::parse_hf_config(json, "fuzz/rewritten config.json");
  } catch (moe::Error const&) {
    std::abort();  // hf_config_json wrote something parse_hf_config rejects
  }
  require(same(c, again));
  check_decoder(text);
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
