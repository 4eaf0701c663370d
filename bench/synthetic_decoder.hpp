// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The synthetic decoder of the decoding benchmarks (bench_decode.cpp, bench_offload.cpp):
// Qwen3-30B-A3B's shapes with random weights (moe::models::Decoder<presets::Qwen3Moe>): hidden
// 2048, 32 query heads over 4 KV heads of head_dim 128, q/k RMSNorm, RoPE; 128 experts of width
// 768, top-8; vocabulary 151936 with an untied LM head; every matrix in the format `opt` asks
// for (DecoderOptions::format_of, as the loader chooses). One routed-expert layer per ffn_down
// format is quantized (30-60 s for 600 M weights); the layers are copies of it (separate memory:
// each step still streams every layer's experts). Fp32 expert weights are discarded once packed,
// as load_hf_decoder does.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/models/decoder.hpp"

namespace moe::bench {

using SyntheticDecoder = moe::models::Decoder<moe::presets::Qwen3Moe>;
inline constexpr Index kH = 2048, kHeads = 32, kKv = 4, kDh = 128, kE = 128, kI = 768, kTopK = 8,
                       kVocab = 151936;

inline SyntheticDecoder make_synthetic_decoder(Index layers, moe::models::DecoderOptions const& opt,
                                               moe::ThreadPool* pool) {
  using moe::models::MatrixClass;
  auto fill = [](std::span<float> v, float bound, std::uint64_t seed) {
    moe::fill_uniform(v, -bound, bound, seed);
  };
  SyntheticDecoder dec;
  moe::models::DecoderConfig& c = dec.config;
  c.moe.family = moe::io::HfFamily::kQwen3Moe;
  c.moe.hidden_size = kH;
  c.moe.num_experts = kE;
  c.moe.num_experts_per_tok = kTopK;
  c.moe.expert_intermediate_size = kI;
  c.moe.norm_topk_prob = true;
  c.moe.num_hidden_layers = layers;
  c.vocab_size = kVocab;
  c.num_hidden_layers = layers;
  c.num_attention_heads = kHeads;
  c.num_key_value_heads = kKv;
  c.head_dim = kDh;
  c.rope_theta = 1e6f;
  c.rms_norm_eps = 1e-6f;
  c.qk_norm = true;
  auto format = [&](MatrixClass m, Index L, Index depth) {
    return moe::experts::resolve_format(
        opt.format_of(m, L, layers, kE, false, moe::experts::WeightFormat::kBf16), depth);
  };
  {
    std::vector<float> v(static_cast<std::size_t>(kVocab * kH));
    fill(v, 1.0f, 1);
    dec.embed = moe::models::Embedding::pack({v.data(), kVocab, kH},
                                             format(MatrixClass::kEmbedding, 0, kH));
    fill(v, 0.02f, 2);
    dec.lm_head =
        moe::Linear({v.data(), kVocab, kH}, format(MatrixClass::kLmHead, layers - 1, kH), {}, pool);
  }
  dec.norm.assign(static_cast<std::size_t>(kH), 1.0f);
  moe::GatedAttentionConfig ac;
  ac.d_model = kH;
  ac.num_heads = kHeads;
  ac.num_kv_heads = kKv;
  ac.head_dim = kDh;
  ac.qk_norm = moe::QkNorm::kRmsNorm;
  ac.rope = true;
  ac.rope_theta = 1e6f;
  // One routed-expert layer per ffn_down format the options ask for, quantized once, then copied.
  std::optional<moe::presets::Qwen3Moe> moe_layers[2];
  for (Index L = 0; L < layers; ++L) {
    SyntheticDecoder::Block b;
    auto& attention = b.mixer.emplace<moe::GatedAttention<moe::gating::NoGate>>(ac);
    std::uint64_t seed = 100 * static_cast<std::uint64_t>(L + 1);
    for (auto const& p : attention.parameters()) {
      if (std::string_view(p.name).find("norm") == std::string_view::npos) {
        fill(p.values, 0.02f, seed++);
      }
    }
    attention.pack_weights(
        {format(MatrixClass::kAttnQ, L, kH), format(MatrixClass::kAttnK, L, kH),
         format(MatrixClass::kAttnV, L, kH), format(MatrixClass::kAttnO, L, kHeads * kDh)},
        pool);
    attention.discard_master_weights();
    b.input_norm.assign(static_cast<std::size_t>(kH), 1.0f);
    b.post_norm.assign(static_cast<std::size_t>(kH), 1.0f);
    moe::experts::ExpertFormat const ef{format(MatrixClass::kExpertsIn, L, kH),
                                        format(MatrixClass::kExpertsDown, L, kI)};
    std::optional<moe::presets::Qwen3Moe>& m =
        moe_layers[ef.down == moe::experts::WeightFormat::kQ6_K ? 1 : 0];
    if (!m) {
      m.emplace(moe::presets::make_qwen3_moe({kH, kI, kE, kTopK, true}));
      fill(m->experts().edit().parameters(), 0.02f, 1000);
      auto rw = m->router_weight();
      fill({rw.data, static_cast<std::size_t>(rw.rows * rw.cols)}, 0.05f, 1001);
      m->pack_weights(ef, ef, pool);
      m->discard_master_weights();  // as load_hf_decoder: only the pack stays
    }
    b.moe.emplace(*m);
    dec.blocks.push_back(std::move(b));
  }
  return dec;
}

/// n token ids in [0, kVocab), a fixed pseudo-random sequence for `seed`.
inline std::vector<std::int64_t> synthetic_tokens(Index n, std::uint64_t seed) {
  std::vector<std::int64_t> t(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    t[static_cast<std::size_t>(i)] = static_cast<std::int64_t>((seed >> 33) % kVocab);
  }
  return t;
}

}  // namespace moe::bench
