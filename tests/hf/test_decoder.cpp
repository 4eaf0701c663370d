// SPDX-License-Identifier: Apache-2.0
// moe::models::Decoder on tiny random whole-model checkpoints (Qwen3-MoE with a dense layer,
// Mixtral with a sliding window and tied embeddings) written here under the Hugging Face tensor
// names: greedy generation with the KV cache against an independent double-precision decoder
// that recomputes the whole sequence at every step (the transformers forward transcribed), a
// batch of sequences against each alone, and the errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "io/io_test_support.hpp"
#include "moe/core/random.hpp"
#include "moe/models/decoder.hpp"

namespace {

using moe::Index;
namespace fs = std::filesystem;
using Tensors = std::map<std::string, std::vector<float>>;

struct Tiny {
  bool qwen = true;
  Index V = 40, H = 16, L = 3, heads = 4, kv = 2, dh = 8, I_dense = 20, I_moe = 8, E = 4, k = 2;
  double theta = 1000.0, eps = 1e-6;
  Index window = 0;  // Mixtral sliding_window
  bool tie = false;
  std::vector<Index> dense_layers = {1};  // Qwen3-MoE mlp_only_layers
};

std::string config_json(Tiny const& t) {
  using moe::io::detail::concat;
  std::string j = concat(
      "{\"model_type\": \"", t.qwen ? "qwen3_moe" : "mixtral", "\", \"vocab_size\": ", t.V,
      ", \"hidden_size\": ", t.H, ", \"num_hidden_layers\": ", t.L,
      ", \"num_attention_heads\": ", t.heads, ", \"num_key_value_heads\": ", t.kv,
      ", \"head_dim\": ", t.dh, ", \"rope_theta\": ", t.theta, ", \"rms_norm_eps\": ", t.eps,
      ", \"num_experts_per_tok\": ", t.k, ", \"tie_word_embeddings\": ", t.tie ? "true" : "false");
  if (t.qwen) {
    j += concat(", \"intermediate_size\": ", t.I_dense, ", \"moe_intermediate_size\": ", t.I_moe,
                ", \"num_experts\": ", t.E, ", \"norm_topk_prob\": true, \"mlp_only_layers\": [");
    for (std::size_t i = 0; i < t.dense_layers.size(); ++i) {
      j += concat(i ? ", " : "", t.dense_layers[i]);
    }
    j += "]";
  } else {
    j += concat(", \"intermediate_size\": ", t.I_moe, ", \"num_local_experts\": ", t.E,
                ", \"sliding_window\": ", t.window == 0 ? std::string("null") : concat(t.window));
  }
  return j + "}";
}

bool is_dense(Tiny const& t, Index layer) {
  return t.qwen &&
         std::find(t.dense_layers.begin(), t.dense_layers.end(), layer) != t.dense_layers.end();
}

/// Random tensors under the HF names of the whole model.
Tensors make_tensors(Tiny const& t, std::uint64_t seed) {
  Tensors m;
  auto add = [&](std::string const& name, Index n, float lo, float hi) {
    std::vector<float> v(static_cast<std::size_t>(n));
    moe::fill_uniform(v, lo, hi, seed++);
    m[name] = v;
  };
  add("model.embed_tokens.weight", t.V * t.H, -1.0f, 1.0f);
  add("model.norm.weight", t.H, 0.5f, 1.5f);
  if (!t.tie) add("lm_head.weight", t.V * t.H, -0.5f, 0.5f);
  for (Index l = 0; l < t.L; ++l) {
    std::string const p = moe::io::detail::concat("model.layers.", l, ".");
    float const a = 0.4f;
    add(p + "self_attn.q_proj.weight", t.heads * t.dh * t.H, -a, a);
    add(p + "self_attn.k_proj.weight", t.kv * t.dh * t.H, -a, a);
    add(p + "self_attn.v_proj.weight", t.kv * t.dh * t.H, -a, a);
    add(p + "self_attn.o_proj.weight", t.H * t.heads * t.dh, -a, a);
    if (t.qwen) {
      add(p + "self_attn.q_norm.weight", t.dh, 0.5f, 1.5f);
      add(p + "self_attn.k_norm.weight", t.dh, 0.5f, 1.5f);
    }
    add(p + "input_layernorm.weight", t.H, 0.5f, 1.5f);
    add(p + "post_attention_layernorm.weight", t.H, 0.5f, 1.5f);
    if (is_dense(t, l)) {
      add(p + "mlp.gate_proj.weight", t.I_dense * t.H, -a, a);
      add(p + "mlp.up_proj.weight", t.I_dense * t.H, -a, a);
      add(p + "mlp.down_proj.weight", t.H * t.I_dense, -a, a);
      continue;
    }
    std::string const b = p + (t.qwen ? "mlp." : "block_sparse_moe.");
    add(b + "gate.weight", t.E * t.H, -1.0f, 1.0f);
    for (Index e = 0; e < t.E; ++e) {
      std::string const x = moe::io::detail::concat(b, "experts.", e, ".");
      add(x + (t.qwen ? "gate_proj.weight" : "w1.weight"), t.I_moe * t.H, -a, a);
      add(x + (t.qwen ? "up_proj.weight" : "w3.weight"), t.I_moe * t.H, -a, a);
      add(x + (t.qwen ? "down_proj.weight" : "w2.weight"), t.H * t.I_moe, -a, a);
    }
  }
  return m;
}

std::vector<std::int64_t> shape_of(Tiny const& t, std::string const& name) {
  std::int64_t const V = t.V, H = t.H, q = t.heads * t.dh, kvd = t.kv * t.dh;
  auto ends = [&](std::string_view s) { return name.ends_with(s); };
  if (ends("embed_tokens.weight") || name == "lm_head.weight") return {V, H};
  if (ends("norm.weight") && !ends("q_norm.weight") && !ends("k_norm.weight")) return {H};
  if (ends("q_norm.weight") || ends("k_norm.weight")) return {t.dh};
  if (ends("q_proj.weight")) return {q, H};
  if (ends("k_proj.weight") || ends("v_proj.weight")) return {kvd, H};
  if (ends("o_proj.weight")) return {H, q};
  if (ends("gate.weight")) return {t.E, H};
  bool const dense = name.find("experts") == std::string::npos;
  std::int64_t const I = dense ? t.I_dense : t.I_moe;
  if (ends("gate_proj.weight") || ends("up_proj.weight") || ends("w1.weight") ||
      ends("w3.weight")) {
    return {I, H};
  }
  return {H, I};  // down_proj / w2
}

/// The checkpoint of `m` as F32 tensors, or as BF16 ones (rounded to nearest even).
fs::path write_model(Tiny const& t, Tensors const& m, std::string const& name, bool bf16 = false) {
  fs::path const dir = iotest::scratch_dir(name);
  moe::io::SafetensorsWriter w;
  for (auto const& [n, v] : m) {
    if (bf16) {
      w.add_bf16(n, shape_of(t, n), v);
    } else {
      w.add_f32(n, shape_of(t, n), v);
    }
  }
  w.save(dir / "model.safetensors");
  iotest::write_text(dir / "config.json", config_json(t));
  return dir;
}

// ---- The independent reference: transformers' forward in double, whole sequence each time.

using Vec = std::vector<double>;

Vec matvec(std::vector<float> const& w, Vec const& x, Index rows, Index cols) {
  Vec y(static_cast<std::size_t>(rows), 0.0);
  for (Index r = 0; r < rows; ++r) {
    for (Index c = 0; c < cols; ++c) y[r] += w[r * cols + c] * x[c];
  }
  return y;
}
Vec rms(Vec const& x, std::vector<float> const& w, double eps) {
  double ss = 0.0;
  for (double v : x) ss += v * v;
  double const r = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  Vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[i];
  return y;
}
double silu(double z) { return z / (1.0 + std::exp(-z)); }

/// Next-token logits after ids (the last position), by the transformers forward.
Vec reference_logits(Tiny const& t, Tensors const& m, std::vector<std::int64_t> const& ids) {
  Index const T = static_cast<Index>(ids.size()), H = t.H, dh = t.dh, G = t.heads / t.kv;
  std::vector<Vec> h(static_cast<std::size_t>(T));
  for (Index i = 0; i < T; ++i) {
    auto const& e = m.at("model.embed_tokens.weight");
    h[i].assign(e.begin() + ids[i] * H, e.begin() + (ids[i] + 1) * H);
  }
  auto rope = [&](double* x, Index pos) {  // rotate_half, inv_freq = theta^(-2i/d)
    for (Index i = 0; i < dh / 2; ++i) {
      double const f = std::pow(t.theta, -2.0 * static_cast<double>(i) / static_cast<double>(dh));
      double const c = std::cos(pos * f), s = std::sin(pos * f);
      double const a = x[i], b = x[i + dh / 2];
      x[i] = a * c - b * s;
      x[i + dh / 2] = b * c + a * s;
    }
  };
  for (Index l = 0; l < t.L; ++l) {
    std::string const p = moe::io::detail::concat("model.layers.", l, ".");
    std::vector<Vec> q(T), k(T), v(T);
    for (Index i = 0; i < T; ++i) {
      Vec const x = rms(h[i], m.at(p + "input_layernorm.weight"), t.eps);
      q[i] = matvec(m.at(p + "self_attn.q_proj.weight"), x, t.heads * dh, H);
      k[i] = matvec(m.at(p + "self_attn.k_proj.weight"), x, t.kv * dh, H);
      v[i] = matvec(m.at(p + "self_attn.v_proj.weight"), x, t.kv * dh, H);
      for (Index hh = 0; hh < t.heads; ++hh) {
        if (t.qwen) {
          Vec const qh(q[i].begin() + hh * dh, q[i].begin() + (hh + 1) * dh);
          Vec const n = rms(qh, m.at(p + "self_attn.q_norm.weight"), t.eps);
          std::copy(n.begin(), n.end(), q[i].begin() + hh * dh);
        }
        rope(q[i].data() + hh * dh, i);
      }
      for (Index g = 0; g < t.kv; ++g) {
        if (t.qwen) {
          Vec const kh(k[i].begin() + g * dh, k[i].begin() + (g + 1) * dh);
          Vec const n = rms(kh, m.at(p + "self_attn.k_norm.weight"), t.eps);
          std::copy(n.begin(), n.end(), k[i].begin() + g * dh);
        }
        rope(k[i].data() + g * dh, i);
      }
    }
    for (Index i = 0; i < T; ++i) {
      Vec attn(static_cast<std::size_t>(t.heads * dh), 0.0);
      for (Index hh = 0; hh < t.heads; ++hh) {
        Index const g = hh / G;
        Index const j0 = t.window > 0 ? std::max<Index>(0, i - t.window + 1) : 0;
        Vec s;
        for (Index j = j0; j <= i; ++j) {
          double z = 0.0;
          for (Index d = 0; d < dh; ++d) z += q[i][hh * dh + d] * k[j][g * dh + d];
          s.push_back(z / std::sqrt(static_cast<double>(dh)));
        }
        double const mx = *std::max_element(s.begin(), s.end());
        double sum = 0.0;
        for (double& z : s) sum += (z = std::exp(z - mx));
        for (Index j = j0; j <= i; ++j) {
          for (Index d = 0; d < dh; ++d) {
            attn[hh * dh + d] += s[j - j0] / sum * v[j][g * dh + d];
          }
        }
      }
      Vec const o = matvec(m.at(p + "self_attn.o_proj.weight"), attn, H, t.heads * dh);
      for (Index c = 0; c < H; ++c) h[i][c] += o[c];
    }
    for (Index i = 0; i < T; ++i) {
      Vec const x = rms(h[i], m.at(p + "post_attention_layernorm.weight"), t.eps);
      Vec y(static_cast<std::size_t>(H), 0.0);
      auto expert = [&](std::string const& base, bool mixtral_names, Index I) {
        Vec const g =
            matvec(m.at(base + (mixtral_names ? "w1.weight" : "gate_proj.weight")), x, I, H);
        Vec const u =
            matvec(m.at(base + (mixtral_names ? "w3.weight" : "up_proj.weight")), x, I, H);
        Vec a(static_cast<std::size_t>(I));
        for (Index j = 0; j < I; ++j) a[j] = silu(g[j]) * u[j];
        return matvec(m.at(base + (mixtral_names ? "w2.weight" : "down_proj.weight")), a, H, I);
      };
      if (is_dense(t, l)) {
        y = expert(p + "mlp.", false, t.I_dense);
      } else {
        std::string const b = p + (t.qwen ? "mlp." : "block_sparse_moe.");
        Vec const z = matvec(m.at(b + "gate.weight"), x, t.E, H);
        // softmax over all, top-k, renormalised (Qwen3 norm_topk_prob; Mixtral's softmax over
        // the chosen logits is the same).
        std::vector<Index> order(static_cast<std::size_t>(t.E));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](Index a, Index c) { return z[a] > z[c]; });
        double sum = 0.0;
        for (Index j = 0; j < t.k; ++j) sum += std::exp(z[order[j]] - z[order[0]]);
        for (Index j = 0; j < t.k; ++j) {
          double const w = std::exp(z[order[j]] - z[order[0]]) / sum;
          Vec const ye =
              expert(moe::io::detail::concat(b, "experts.", order[j], "."), !t.qwen, t.I_moe);
          for (Index c = 0; c < H; ++c) y[c] += w * ye[c];
        }
      }
      for (Index c = 0; c < H; ++c) h[i][c] += y[c];
    }
  }
  Vec const x = rms(h[T - 1], m.at("model.norm.weight"), t.eps);
  return matvec(m.at(t.tie ? "model.embed_tokens.weight" : "lm_head.weight"), x, t.V, H);
}

std::int64_t argmax(float const* v, Index n) {
  return static_cast<std::int64_t>(std::max_element(v, v + n) - v);
}

/// Greedy decoding of `steps` tokens through the cache, each step's logits checked against
/// the reference.
void check_generation(Tiny const& t, std::string const& name) {
  Tensors const m = make_tensors(t, 500);
  fs::path const dir = write_model(t, m, name);
  moe::models::AnyDecoder any = moe::models::load_hf_decoder(dir);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(dec.blocks.size() == static_cast<std::size_t>(t.L));
        // F32 checkpoint: the embedding (and LM head) are read in place from the mapped file.
        REQUIRE(dec.embed.f32_view != nullptr);
        REQUIRE(dec.embed.f32.empty());
        REQUIRE(dec.mapped != nullptr);
        REQUIRE((dec.lm_head.f32_view != nullptr) == !t.tie);
        REQUIRE(dec.lm_head.empty() == t.tie);
        for (auto const& b : dec.blocks) {
          REQUIRE(b.attention.weight_format() == moe::experts::WeightFormat::kF32);
          // I_moe = 8 splits a panel: the GLU's gate and up run from the fp32 weights, kept.
          if (b.moe) REQUIRE(b.moe->experts().has_master_weights());
        }
        for (Index l = 0; l < t.L; ++l) REQUIRE(dec.blocks[l].moe.has_value() == !is_dense(t, l));
        std::vector<std::int64_t> ids = {3, 17, 5, 9, 30};
        auto st = dec.make_state(1);
        std::vector<float> logits(static_cast<std::size_t>(t.V));
        std::vector<Index> counts = {static_cast<Index>(ids.size())};
        dec.forward(ids, counts, st, {logits.data(), 1, t.V});
        for (int step = 0; step < 6; ++step) {
          INFO("step " << step << ", " << ids.size() << " tokens");
          Vec const want = reference_logits(t, m, ids);
          double scale = 0.0, diff = 0.0;
          for (Index i = 0; i < t.V; ++i) {
            scale = std::max(scale, std::fabs(want[i]));
            diff = std::max(diff, std::fabs(logits[i] - want[i]));
          }
          INFO("max |diff| " << diff << " of max |logit| " << scale);
          REQUIRE(scale > 0.1);
          REQUIRE(diff <= 1e-4 * scale);
          std::int64_t const next = argmax(logits.data(), t.V);
          REQUIRE(next == static_cast<std::int64_t>(std::max_element(want.begin(), want.end()) -
                                                    want.begin()));
          ids.push_back(next);
          counts = {1};
          std::vector<std::int64_t> const one = {next};
          dec.forward(one, counts, st, {logits.data(), 1, t.V});
          REQUIRE(st.length(0) == static_cast<Index>(ids.size()));
        }
        REQUIRE(st.kv_bytes_per_token() ==
                static_cast<std::size_t>(t.L * 2 * t.kv * t.dh) * sizeof(float));
      },
      any);
}

}  // namespace

TEST_CASE("Decoder: Qwen3-MoE (q/k norms, a dense layer) generates as the reference",
          "[models][decoder]") {
  Tiny t;
  check_generation(t, "decoder_qwen3");
}

TEST_CASE("Decoder: Mixtral (sliding window, tied embeddings) generates as the reference",
          "[models][decoder]") {
  Tiny t;
  t.qwen = false;
  t.window = 4;
  t.tie = true;
  t.theta = 1e6;
  t.eps = 1e-5;
  check_generation(t, "decoder_mixtral");
}

namespace {

/// Greedy decoding of a prompt and `steps` tokens; every step's logits, concatenated.
template <class Dec>
std::vector<float> greedy_logits(Dec const& dec, Index V, int steps, moe::ThreadPool* pool) {
  std::vector<std::int64_t> ids = {3, 17, 5, 9, 30};
  auto st = dec.make_state(1);
  std::vector<float> logits(static_cast<std::size_t>(V)), all;
  std::vector<Index> counts = {static_cast<Index>(ids.size())};
  dec.forward(ids, counts, st, {logits.data(), 1, V}, pool);
  for (int step = 0; step < steps; ++step) {
    all.insert(all.end(), logits.begin(), logits.end());
    std::vector<std::int64_t> const one = {argmax(logits.data(), V)};
    counts = {1};
    dec.forward(one, counts, st, {logits.data(), 1, V}, pool);
  }
  all.insert(all.end(), logits.begin(), logits.end());
  return all;
}

void check_bf16_checkpoint(Tiny t, std::string const& name) {
  t.H = 32;  // q8_0 experts below need depths that are multiples of 32
  t.I_moe = 32;
  using moe::experts::WeightFormat;
  using moe::models::DenseWeights;
  Tensors m = make_tensors(t, 800);
  for (auto& [n, v] : m) {  // the values a BF16 checkpoint holds
    for (float& x : v) x = moe::kernels::bf16_to_float(moe::kernels::float_to_bf16(x));
  }
  fs::path const d16 = write_model(t, m, name + "_bf16", true);
  fs::path const d32 = write_model(t, m, name + "_f32", false);
  moe::ThreadPool pool(2);
  auto load = [&](fs::path const& dir, DenseWeights dense, moe::ThreadPool* p = nullptr) {
    moe::models::DecoderOptions o;
    o.dense = dense;
    return moe::models::load_hf_decoder(dir, p, o);
  };
  auto const as_stored16 = load(d16, DenseWeights::kAsStored);
  auto const as_stored32 = load(d32, DenseWeights::kAsStored);
  auto const forced32 = load(d16, DenseWeights::kF32);
  auto const forced16 = load(d32, DenseWeights::kBf16, &pool);
  std::visit(
      [&](auto const& dec) {
        // BF16 tensors stay bf16, read in place from the mapped file.
        REQUIRE(dec.embed.bf16_view != nullptr);
        REQUIRE(dec.mapped != nullptr);
        REQUIRE(dec.lm_head.empty() == t.tie);
        REQUIRE((dec.lm_head.bf16_view != nullptr) == !t.tie);
        for (Index l = 0; l < t.L; ++l) {
          auto const& b = dec.blocks[static_cast<std::size_t>(l)];
          REQUIRE(b.attention.weight_format() == WeightFormat::kBf16);
          if (!b.moe) REQUIRE((b.mlp.gate.is_bf16() && b.mlp.up.is_bf16() && b.mlp.down.is_bf16()));
          // The experts' fp32 weights are gone once packed (I_moe = 32 fills whole panels): the
          // logits compared below come from the packs alone.
          if (b.moe) REQUIRE_FALSE(b.moe->experts().has_master_weights());
        }
      },
      as_stored16);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(!dec.embed.is_bf16());
        REQUIRE(dec.embed.f32.size() == static_cast<std::size_t>(t.V * t.H));  // converted, held
        REQUIRE(dec.blocks.front().attention.weight_format() == WeightFormat::kF32);
      },
      forced32);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(dec.embed.bf16.size() == static_cast<std::size_t>(t.V * t.H));  // rounded, held
        REQUIRE(dec.blocks.front().attention.weight_format() == WeightFormat::kBf16);
      },
      forced16);
  auto logits = [&](moe::models::AnyDecoder const& any, moe::ThreadPool* p) {
    return std::visit([&](auto const& dec) { return greedy_logits(dec, t.V, 5, p); }, any);
  };
  // The fp32 decoder of the same values is checked against the double reference above; the bf16
  // ones must give its bits (the kernels widen each weight and compute in fp32), for any threads.
  std::vector<float> const want = logits(as_stored32, nullptr);
  REQUIRE(logits(as_stored16, nullptr) == want);
  REQUIRE(logits(as_stored16, &pool) == want);
  REQUIRE(logits(forced32, nullptr) == want);
  REQUIRE(logits(forced16, &pool) == want);
  // Quantized experts at load time: the layers report the format, the logits stay close.
  moe::models::DecoderOptions q;
  q.experts = WeightFormat::kQ8_0;
  auto const quant = moe::models::load_hf_decoder(d16, nullptr, q);
  std::visit(
      [&](auto const& dec) {
        for (auto const& b : dec.blocks) {
          if (b.moe) REQUIRE(b.moe->experts().packed_format() == WeightFormat::kQ8_0);
          if (b.moe) REQUIRE_FALSE(b.moe->experts().has_master_weights());
        }
      },
      quant);
  std::vector<float> const ql = logits(quant, nullptr);
  double scale = 0.0, diff = 0.0;
  for (Index i = 0; i < t.V; ++i) {  // the prefill's logits (later steps may pick other ids)
    scale = std::max(scale, static_cast<double>(std::fabs(want[static_cast<std::size_t>(i)])));
    diff = std::max(diff, static_cast<double>(std::fabs(ql[static_cast<std::size_t>(i)] -
                                                        want[static_cast<std::size_t>(i)])));
  }
  INFO("q8_0 experts: max |diff| " << diff << " of max |logit| " << scale);
  REQUIRE(diff > 0.0);
  REQUIRE(diff <= 0.05 * scale);
}

}  // namespace

TEST_CASE("Decoder: a BF16 checkpoint stays bf16 and decodes with the bits of its fp32 copy",
          "[models][decoder][bf16]") {
  SECTION("Qwen3-MoE, a dense layer") {
    Tiny t;
    check_bf16_checkpoint(t, "decoder_bf16_qwen3");
  }
  SECTION("Mixtral, tied embeddings") {
    Tiny t;
    t.qwen = false;
    t.window = 4;
    t.tie = true;
    check_bf16_checkpoint(t, "decoder_bf16_mixtral");
  }
}

TEST_CASE("Decoder: a batch of sequences decodes as each alone", "[models][decoder]") {
  Tiny t;
  Tensors const m = make_tensors(t, 700);
  fs::path const dir = write_model(t, m, "decoder_batch");
  auto const any = moe::models::load_hf_decoder(dir);
  auto const& dec = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(any);
  std::vector<std::vector<std::int64_t>> const prompts = {{1, 2, 3}, {7, 8, 9, 10, 11, 12}, {5}};
  // Alone: each prompt, then 3 greedy steps.
  std::vector<std::vector<float>> alone;
  for (auto const& p : prompts) {
    auto st = dec.make_state(1);
    std::vector<float> lg(static_cast<std::size_t>(t.V));
    std::vector<Index> n = {static_cast<Index>(p.size())};
    dec.forward(p, n, st, {lg.data(), 1, t.V});
    for (int s = 0; s < 3; ++s) {
      alone.push_back(lg);
      std::vector<std::int64_t> const one = {argmax(lg.data(), t.V)};
      n = {1};
      dec.forward(one, n, st, {lg.data(), 1, t.V});
    }
  }
  // Together: one prefill of the three prompts, then steps of one token each.
  auto st = dec.make_state(3);
  std::vector<float> lg(static_cast<std::size_t>(3 * t.V));
  std::vector<std::int64_t> all;
  std::vector<Index> n;
  for (auto const& p : prompts) {
    all.insert(all.end(), p.begin(), p.end());
    n.push_back(static_cast<Index>(p.size()));
  }
  dec.forward(all, n, st, {lg.data(), 3, t.V});
  for (int s = 0; s < 3; ++s) {
    std::vector<std::int64_t> next;
    for (Index q = 0; q < 3; ++q) {
      float const* row = lg.data() + q * t.V;
      std::vector<float> const& want = alone[static_cast<std::size_t>(q * 3 + s)];
      for (Index i = 0; i < t.V; ++i) REQUIRE(std::fabs(row[i] - want[i]) <= 1e-5f);
      next.push_back(argmax(row, t.V));
    }
    n = {1, 1, 1};
    dec.forward(next, n, st, {lg.data(), 3, t.V});
  }
}

TEST_CASE("Decoder: bad models and calls are errors", "[models][decoder]") {
  using Catch::Contains;
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(R"({"model_type": "deepseek_v3", "num_hidden_layers": 2})"),
      Contains("no decoder in moe yet"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(R"({"model_type": "mixtral"})"),
                      Contains("num_hidden_layers"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "mixtral", "num_hidden_layers": 2, "rope_scaling": {"type": "yarn"}})"),
      Contains("rope_scaling"));
  Tiny t;
  Tensors m = make_tensors(t, 800);
  m.erase("model.layers.2.self_attn.k_proj.weight");
  fs::path const dir = write_model(t, m, "decoder_missing");
  REQUIRE_THROWS_WITH(moe::models::load_hf_decoder(dir),
                      Contains("model.layers.2.self_attn.k_proj.weight") && Contains("missing"));
  Tensors const good = make_tensors(t, 801);
  auto const any = moe::models::load_hf_decoder(write_model(t, good, "decoder_calls"));
  auto const& dec = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(any);
  auto st = dec.make_state(1);
  std::vector<float> lg(static_cast<std::size_t>(t.V));
  std::vector<std::int64_t> const bad = {t.V};
  std::vector<Index> const one = {1};
  REQUIRE_THROWS_WITH(dec.forward(bad, one, st, {lg.data(), 1, t.V}),
                      Contains("outside the vocabulary"));
  std::vector<Index> const two = {1, 0};
  std::vector<std::int64_t> const ok = {1};
  REQUIRE_THROWS_WITH(dec.forward(ok, two, st, {lg.data(), 1, t.V}), Contains("sequences"));
}

#ifdef MOE_GENERATE
#include <sys/wait.h>

#include <cstdlib>

namespace {

/// Runs moe_generate with `args`; stdout and stderr go to files in `dir`.
int run_generate(std::string const& args, fs::path const& dir) {
  std::string command = "'";
  command.append(MOE_GENERATE).append("' ").append(args);
  command.append(" >'").append((dir / "out.txt").string()).append("'");
  command.append(" 2>'").append((dir / "err.txt").string()).append("'");
  int const status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string text_of(fs::path const& p) {
  std::vector<std::byte> const b = iotest::read_file(p);
  return std::string(reinterpret_cast<char const*>(b.data()), b.size());
}

}  // namespace

TEST_CASE("moe_generate: the cache and --no-cache give the same ids and logits",
          "[models][decoder][generate]") {
  Tiny t;
  Tensors const m = make_tensors(t, 900);
  fs::path const dir = write_model(t, m, "generate");
  std::string const base = "--model '" + dir.string() + "' --prompt-ids 3,17,5 --max-new-tokens 5";
  REQUIRE(run_generate(base + " --threads 2 --logits '" + (dir / "a.safetensors").string() + "'",
                       dir) == 0);
  std::string const ids = text_of(dir / "out.txt");
  INFO(text_of(dir / "err.txt"));
  REQUIRE_THAT(text_of(dir / "err.txt"),
               Catch::Contains("tokens/s") && Catch::Contains("KV cache 384 bytes per token"));
  REQUIRE(run_generate(base + " --no-cache --logits '" + (dir / "b.safetensors").string() + "'",
                       dir) == 0);
  REQUIRE(text_of(dir / "out.txt") == ids);
  moe::io::SafetensorsFile const a(dir / "a.safetensors"), b(dir / "b.safetensors");
  REQUIRE(a.tensor("logits").shape == std::vector<std::int64_t>{5, t.V});
  std::vector<float> const la = moe::io::to_float(a.tensor("logits"));
  std::vector<float> const lb = moe::io::to_float(b.tensor("logits"));
  double scale = 0.0;
  for (float v : lb) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (std::size_t i = 0; i < la.size(); ++i) REQUIRE(std::fabs(la[i] - lb[i]) <= 1e-4 * scale);
  // The ids are the reference decoder's greedy ones.
  std::vector<std::int64_t> seq = {3, 17, 5};
  std::string want;
  for (int i = 0; i < 5; ++i) {
    Vec const z = reference_logits(t, m, seq);
    seq.push_back(std::max_element(z.begin(), z.end()) - z.begin());
    want += moe::io::detail::concat(i ? "," : "", seq.back());
  }
  REQUIRE(ids == want + "\n");
  // Sampling is reproducible for a seed.
  std::string const sample = base + " --temperature 0.8 --top-p 0.9 --seed 7";
  REQUIRE(run_generate(sample, dir) == 0);
  std::string const s1 = text_of(dir / "out.txt");
  REQUIRE(run_generate(sample, dir) == 0);
  REQUIRE(text_of(dir / "out.txt") == s1);
  // Weight formats: the F32 checkpoint's dense weights rounded to bf16, bf16 experts.
  REQUIRE(run_generate(base + " --dense bf16 --experts bf16", dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"),
               Catch::Contains("(LM head bf16, attention bf16, experts bf16)"));
  REQUIRE(run_generate(base, dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"),
               Catch::Contains("(LM head fp32, attention fp32, experts fp32)"));
  // Errors: one line on stderr, exit 1.
  for (std::string const& bad :
       {std::string("--model '") + dir.string() + "' --prompt-ids 3,99 --max-new-tokens 2",
        std::string("--model '") + dir.string() + "' --prompt-ids 3,x --max-new-tokens 2",
        std::string("--model '") + dir.string() + "' --max-new-tokens 2",
        std::string("--model '") + dir.string() + "' --prompt-ids 3 --max-new-tokens 2 --dense x",
        std::string("--model '") + dir.string() +
            "' --prompt-ids 3 --max-new-tokens 2 --experts q5",
        std::string("--model '") + (dir / "none").string() +
            "' --prompt-ids 1 --max-new-tokens 1"}) {
    INFO(bad);
    REQUIRE(run_generate(bad, dir) == 1);
    std::string const err = text_of(dir / "err.txt");
    REQUIRE(std::count(err.begin(), err.end(), '\n') == 1);
    REQUIRE_THAT(err, Catch::StartsWith("moe_generate: "));
  }
}
#endif
