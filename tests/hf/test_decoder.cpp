// SPDX-License-Identifier: Apache-2.0
// moe::models::Decoder on tiny random whole-model checkpoints of every decoding family, written
// here under the Hugging Face tensor names (Qwen3-MoE with a dense layer; Mixtral with a sliding
// window and tied embeddings; Qwen2-MoE with q/k/v biases, a gated shared expert and a dense
// layer; OLMoE with q/k norms over all heads and biased projections; GLM-4.5 with partial RoPE,
// per-head norms, a dense first layer and group-limited sigmoid routing; MiniMax-M2 with partial
// RoPE and norms over all heads; gpt-oss with YaRN RoPE, sinks, biases, alternating sliding
// windows and clamped biased experts; ERNIE 4.5 with interleaved RoPE, a dense first layer and
// shared experts): greedy generation with the KV cache against an independent
// double-precision decoder that recomputes the whole sequence at every step (the transformers
// forward transcribed; the MoE blocks by hf_moe_reference.hpp), a batch of sequences against
// each alone, and the errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <numbers>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attention/deltanet_reference.hpp"
#include "attention/mla_reference.hpp"
#include "hf/decoder_tiny.hpp"
#include "hf/hf_moe_reference.hpp"
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

namespace {

// ---- The independent reference: transformers' forward in double, whole sequence each time.

using Vec = std::vector<double>;

Vec matvec(std::vector<float> const& w, Vec const& x, Index rows, Index cols) {
  Vec y(static_cast<std::size_t>(rows), 0.0);
  for (Index r = 0; r < rows; ++r) {
    for (Index c = 0; c < cols; ++c) y[r] += w[r * cols + c] * x[c];
  }
  return y;
}
/// RMSNorm of x[0, n) in place with weight w[0, n) (the slice a q/k norm covers).
void rms_inplace(double* x, std::vector<float> const& w, Index n, double eps) {
  double ss = 0.0;
  for (Index i = 0; i < n; ++i) ss += x[i] * x[i];
  double const r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  for (Index i = 0; i < n; ++i) x[i] *= r * w[i];
}
Vec rms(Vec x, std::vector<float> const& w, double eps) {
  rms_inplace(x.data(), w, static_cast<Index>(x.size()), eps);
  return x;
}
double silu(double z) { return z / (1.0 + std::exp(-z)); }

/// h[i] += DeepseekV3Attention / DeepseekV2Attention(RMSNorm(h[i])) over the whole sequence, by
/// the double transcription of the attention tests (tests/attention/mla_reference.hpp).
void add_mla_attention(Tiny const& t, Mla const& ml, Tensors const& m, std::string const& p,
                       std::vector<Vec>& h) {
  Index const T = static_cast<Index>(h.size()), H = t.H;
  aref::DoubleMla a;
  a.D = H;
  a.H = t.heads;
  a.ql = ml.ql;
  a.R = ml.R;
  a.dn = ml.dn;
  a.dr = ml.dr;
  a.dv = ml.dv;
  a.theta = t.theta;
  a.rope = ml.v3 ? aref::DoubleMla::kV3Interleave : aref::DoubleMla::kV2Complex;
  a.v3_scaling = ml.v3;
  if (ml.v3) a.factor = 4.0, a.original_max = 8, a.mscale = 1.0, a.mscale_all_dim = 1.0;
  auto get = [&](char const* name) {
    std::vector<float> const& v = m.at(p + "self_attn." + name);
    return aref::Vec(v.begin(), v.end());
  };
  if (ml.ql > 0) {
    a.q_a_proj = get("q_a_proj.weight");
    a.q_a_norm = get("q_a_layernorm.weight");
    a.q_b_proj = get("q_b_proj.weight");
  } else {
    a.q_proj = get("q_proj.weight");
  }
  a.kv_a_proj = get("kv_a_proj_with_mqa.weight");
  a.kv_a_norm = get("kv_a_layernorm.weight");
  a.kv_b_proj = get("kv_b_proj.weight");
  a.o_proj = get("o_proj.weight");
  aref::Vec x;
  for (Index i = 0; i < T; ++i) {
    Vec const xi = rms(h[i], m.at(p + "input_layernorm.weight"), t.eps);
    x.insert(x.end(), xi.begin(), xi.end());
  }
  aref::Vec const y = a.forward(x, T);
  for (Index i = 0; i < T; ++i) {
    for (Index c = 0; c < H; ++c) h[i][c] += y[i * H + c];
  }
}

/// h[i] += Qwen3NextGatedDeltaNet(RMSNorm(h[i]) with weight `norm`) over the whole sequence,
/// from the zero state (the chunked rule), by the double transcription of the attention tests
/// (tests/attention/deltanet_reference.hpp).
void add_deltanet(Tiny const& t, Tensors const& m, std::string const& p,
                  std::vector<float> const& norm, std::vector<Vec>& h) {
  Index const T = static_cast<Index>(h.size()), H = t.H;
  Gdn const g;
  dnref::DeltaNet a;
  a.D = H;
  a.Hk = g.Hk;
  a.Hv = g.Hv;
  a.dk = g.dk;
  a.dv = g.dv;
  a.kernel = g.kernel;
  a.eps = t.eps;
  auto get = [&](char const* name) {
    std::vector<float> const& v = m.at(p + "linear_attn." + name);
    return dnref::Vec(v.begin(), v.end());
  };
  a.qwen35 = split_projections(t);
  if (a.qwen35) {
    a.in_proj_qkv = get("in_proj_qkv.weight");
    a.in_proj_z = get("in_proj_z.weight");
    a.in_proj_b = get("in_proj_b.weight");
    a.in_proj_a = get("in_proj_a.weight");
  } else {
    a.in_proj_qkvz = get("in_proj_qkvz.weight");
    a.in_proj_ba = get("in_proj_ba.weight");
  }
  a.conv1d = get("conv1d.weight");
  a.A_log = get("A_log");
  a.dt_bias = get("dt_bias");
  a.norm = get("norm.weight");
  a.out_proj = get("out_proj.weight");
  dnref::Vec x;
  for (Index i = 0; i < T; ++i) {
    Vec const xi = rms(h[i], norm, t.eps);
    x.insert(x.end(), xi.begin(), xi.end());
  }
  dnref::Vec const y = a.forward(x, T);
  for (Index i = 0; i < T; ++i) {
    for (Index c = 0; c < H; ++c) h[i][c] += y[i * H + c];
  }
}

/// Next-token logits after ids (the last position), by the transformers forward; the MoE
/// blocks read from the checkpoint written in `dir`.
Vec reference_logits(Tiny const& t, Tensors const& m, fs::path const& dir,
                     std::vector<std::int64_t> const& ids) {
  Index const T = static_cast<Index>(ids.size()), H = t.H, dh = t.dh, G = t.heads / t.kv;
  Index const HD = t.heads * dh, KD = t.kv * dh;
  Attention const at = attention_of(t);
  // A norm's weight as it multiplies: w, or Qwen3NextRMSNorm's 1 + w.
  auto nw = [&](std::string const& name) {
    std::vector<float> w = m.at(name);
    if (one_plus(t)) {
      for (float& v : w) v = 1.0f + v;
    }
    return w;
  };
  moe::io::HfMoeConfig const mc = moe_config(t);
  hfref::Checkpoint const ck(dir / "model.safetensors");
  std::vector<Vec> h(static_cast<std::size_t>(T));
  for (Index i = 0; i < T; ++i) {
    auto const& e = m.at("model.embed_tokens.weight");
    h[i].assign(e.begin() + ids[i] * H, e.begin() + (ids[i] + 1) * H);
  }
  // rotate_half over the first rd dimensions, inv_freq = theta^(-2i/rd) (YaRN: blended with
  // theta^(-2i/rd) / s by the ramp of transformers' _compute_yarn_parameters, cos and sin scaled
  // by 0.1 ln s + 1); the rest passes.
  auto inv_freq = [&](Index i) {
    double const d = static_cast<double>(at.rd);
    double const extrapolated = std::pow(t.theta, -2.0 * static_cast<double>(i) / d);
    if (at.llama4) {  // _compute_llama3_parameters: factor 4, low 1, high 2, L0 8
      double const wavelen = 2.0 * std::numbers::pi / extrapolated;
      if (wavelen < 8.0 / 2.0) return extrapolated;
      if (wavelen > 8.0 / 1.0) return extrapolated / 4.0;
      double const smooth = (8.0 / wavelen - 1.0) / (2.0 - 1.0);
      return (1.0 - smooth) * extrapolated / 4.0 + smooth * extrapolated;
    }
    if (!at.yarn) return extrapolated;
    double const s = 32.0, pi = std::numbers::pi;
    auto dim_of = [&](double rot) {
      return d * std::log(static_cast<double>(kYarnOriginal) / (rot * 2.0 * pi)) /
             (2.0 * std::log(t.theta));
    };
    double const low = std::max(dim_of(32.0), 0.0), high = std::min(dim_of(1.0), d - 1.0);
    double const ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    return extrapolated / s * ramp + extrapolated * (1.0 - ramp);
  };
  double const mscale = at.yarn ? 0.1 * std::log(32.0) + 1.0 : 1.0;
  auto rope = [&](double* x, Index pos) {
    Index const rd = at.rd;
    for (Index i = 0; i < rd / 2; ++i) {
      double const f = inv_freq(i);
      double const c = std::cos(pos * f) * mscale, s = std::sin(pos * f) * mscale;
      // rotate_half pairs (i, i + rd/2); ERNIE's interleaved form pairs (2i, 2i + 1)
      Index const i0 = at.interleaved ? 2 * i : i, i1 = at.interleaved ? 2 * i + 1 : i + rd / 2;
      double const a = x[i0], b = x[i1];
      x[i0] = a * c - b * s;
      x[i1] = b * c + a * s;
    }
  };
  auto add = [&](Vec& y, std::string const& name) {
    if (m.count(name) == 0) return;
    std::vector<float> const& b = m.at(name);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += b[i];
  };
  for (Index l = 0; l < t.L; ++l) {
    std::string const p = concat("model.layers.", l, ".");
    if (linear_layer(t, l)) {
      add_deltanet(t, m, p, nw(p + "input_layernorm.weight"), h);
    } else if (std::optional<Mla> const ml = mla_of(t)) {
      add_mla_attention(t, *ml, m, p, h);
    } else {
      std::vector<Vec> q(T), k(T), v(T), gate(T);
      for (Index i = 0; i < T; ++i) {
        Vec const x = rms(h[i], nw(p + "input_layernorm.weight"), t.eps);
        q[i] = matvec(m.at(p + "self_attn.q_proj.weight"), x, at.gate ? 2 * HD : HD, H);
        if (at.gate) {  // view(T, heads, 2 dh), chunk: [q_h | gate_h] per head
          Vec qq(static_cast<std::size_t>(HD)), gg(static_cast<std::size_t>(HD));
          for (Index hh = 0; hh < t.heads; ++hh) {
            for (Index d = 0; d < dh; ++d) {
              qq[hh * dh + d] = q[i][hh * 2 * dh + d];
              gg[hh * dh + d] = q[i][hh * 2 * dh + dh + d];
            }
          }
          q[i] = qq;
          gate[i] = gg;
        }
        k[i] = matvec(m.at(p + "self_attn.k_proj.weight"), x, KD, H);
        v[i] = matvec(m.at(p + "self_attn.v_proj.weight"), x, KD, H);
        add(q[i], p + "self_attn.q_proj.bias");
        add(k[i], p + "self_attn.k_proj.bias");
        add(v[i], p + "self_attn.v_proj.bias");
        if (at.norm && at.norm_all) {  // q_norm(q_proj(x)) before the view into heads
          rms_inplace(q[i].data(), m.at(p + "self_attn.q_norm.weight"), HD, t.eps);
          rms_inplace(k[i].data(), m.at(p + "self_attn.k_norm.weight"), KD, t.eps);
        }
        bool const roped = rope_layer(t, l);
        // Llama4TextL2Norm after RoPE on the RoPE layers; the NoPE layers' queries scaled by
        // log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1.
        std::vector<float> const ones(static_cast<std::size_t>(dh), 1.0f);
        double const temp =
            at.llama4 && !roped
                ? std::log1p(std::floor(static_cast<double>(i + 1) / kLlama4Floor)) * kLlama4Temp +
                      1.0
                : 1.0;
        for (Index hh = 0; hh < t.heads; ++hh) {
          double* qh = q[i].data() + hh * dh;
          if (at.norm && !at.norm_all)
            rms_inplace(qh, nw(p + "self_attn.q_norm.weight"), dh, t.eps);
          if (roped) rope(qh, i);
          if (at.llama4 && roped) rms_inplace(qh, ones, dh, t.eps);
          for (Index d = 0; d < dh; ++d) qh[d] *= temp;
        }
        for (Index g = 0; g < t.kv; ++g) {
          double* kg = k[i].data() + g * dh;
          if (at.norm && !at.norm_all)
            rms_inplace(kg, nw(p + "self_attn.k_norm.weight"), dh, t.eps);
          if (roped) rope(kg, i);
          if (at.llama4 && roped) rms_inplace(kg, ones, dh, t.eps);
        }
      }
      for (Index i = 0; i < T; ++i) {
        Vec attn(static_cast<std::size_t>(HD), 0.0);
        for (Index hh = 0; hh < t.heads; ++hh) {
          Index const g = hh / G;
          Index const w = at.llama4 ? 0 : window_of(t, l);
          Index j0 = w > 0 ? std::max<Index>(0, i - w + 1) : 0;
          if (at.llama4 && rope_layer(t, l)) j0 = i / kLlama4Chunk * kLlama4Chunk;  // its chunk
          Vec s;
          for (Index j = j0; j <= i; ++j) {
            double z = 0.0;
            for (Index d = 0; d < dh; ++d) z += q[i][hh * dh + d] * k[j][g * dh + d];
            s.push_back(z / std::sqrt(static_cast<double>(dh)));
          }
          // gpt-oss: the head's sink logit joins the softmax, its probability is dropped.
          double const sink = at.sinks ? m.at(p + "self_attn.sinks")[hh] : -INFINITY;
          double const mx = std::max(*std::max_element(s.begin(), s.end()), sink);
          double sum = at.sinks ? std::exp(sink - mx) : 0.0;
          for (double& z : s) sum += (z = std::exp(z - mx));
          for (Index j = j0; j <= i; ++j) {
            for (Index d = 0; d < dh; ++d) {
              attn[hh * dh + d] += s[j - j0] / sum * v[j][g * dh + d];
            }
          }
        }
        if (at.gate) {  // attn_output * sigmoid(gate)
          for (Index c = 0; c < HD; ++c) attn[c] *= 1.0 / (1.0 + std::exp(-gate[i][c]));
        }
        Vec o = matvec(m.at(p + "self_attn.o_proj.weight"), attn, H, HD);
        add(o, p + "self_attn.o_proj.bias");
        for (Index c = 0; c < H; ++c) h[i][c] += o[c];
      }
    }
    if (is_dense(t, l)) {
      for (Index i = 0; i < T; ++i) {
        Vec const x = rms(h[i], nw(p + "post_attention_layernorm.weight"), t.eps);
        std::string const mlp = p + dense_module(t);
        Vec const g = matvec(m.at(mlp + "gate_proj.weight"), x, t.I_dense, H);
        Vec const u = matvec(m.at(mlp + "up_proj.weight"), x, t.I_dense, H);
        Vec a(static_cast<std::size_t>(t.I_dense));
        for (Index j = 0; j < t.I_dense; ++j) a[j] = silu(g[j]) * u[j];
        Vec const y = matvec(m.at(mlp + "down_proj.weight"), a, H, t.I_dense);
        for (Index c = 0; c < H; ++c) h[i][c] += y[c];
      }
      continue;
    }
    std::vector<float> x(static_cast<std::size_t>(T * H));  // the MoE block's input, all tokens
    for (Index i = 0; i < T; ++i) {
      Vec const xi = rms(h[i], nw(p + "post_attention_layernorm.weight"), t.eps);
      for (Index c = 0; c < H; ++c) x[i * H + c] = static_cast<float>(xi[c]);
    }
    hfref::Reference const y =
        hfref::hf_forward(mc, ck, moe::io::hf_default_layout(mc.family, l).prefix, x);
    for (Index i = 0; i < T; ++i) {
      for (Index c = 0; c < H; ++c) h[i][c] += y.y[i * H + c];
    }
  }
  Vec const x = rms(h[T - 1], nw("model.norm.weight"), t.eps);
  return matvec(m.at(t.tie ? "model.embed_tokens.weight" : "lm_head.weight"), x, t.V, H);
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
        // F32 checkpoint: the embedding is read in place from the mapped file, the LM head (the
        // embedding's values when tied) packed as fp32 panels; no fallback.
        REQUIRE(dec.embed.f32_view != nullptr);
        REQUIRE(dec.embed.f32.empty());
        REQUIRE(dec.mapped != nullptr);
        REQUIRE(dec.lm_head.format() == moe::experts::WeightFormat::kF32);
        REQUIRE(dec.lm_head.rows() == t.V);
        REQUIRE(dec.fallbacks.empty());
        Attention const at = attention_of(t);
        for (Index l = 0; l < t.L; ++l) {
          auto const& b = dec.blocks[static_cast<std::size_t>(l)];
          REQUIRE((b.mla() != nullptr) == mla_of(t).has_value());
          if (b.mla()) {
            REQUIRE(b.mla()->weight_format() == moe::experts::WeightFormat::kF32);
            REQUIRE(b.mla()->has_q_lora() == (mla_of(t)->ql > 0));
            continue;
          }
          REQUIRE((b.deltanet() != nullptr) == linear_layer(t, l));
          if (auto const* dn = b.deltanet()) {  // the packs alone, in the stored fp32
            REQUIRE(dn->weight_format() == moe::experts::WeightFormat::kF32);
            REQUIRE(dn->master_weights_discarded());
            REQUIRE(dn->config().conv_kernel == Gdn{}.kernel);
            continue;
          }
          REQUIRE((b.gated_attention() != nullptr) == at.gate);
          auto const& ac =
              b.gated_attention() ? b.gated_attention()->config() : b.attention()->config();
          REQUIRE(ac.qkv_bias == at.qkv_bias);
          REQUIRE(ac.o_bias == at.o_bias);
          REQUIRE((ac.qk_norm == moe::QkNorm::kRmsNorm) == (at.norm && !one_plus(t)));
          REQUIRE((ac.qk_norm == moe::QkNorm::kRmsNormOnePlus) == (at.norm && one_plus(t)));
          bool const roped = rope_layer(t, l);
          REQUIRE(ac.rope == roped);
          REQUIRE((ac.qk_norm == moe::QkNorm::kRmsNormUnweighted) == (at.llama4 && roped));
          REQUIRE(ac.attention_chunk == (at.llama4 && roped ? kLlama4Chunk : 0));
          REQUIRE(ac.temperature_floor == (at.llama4 && !roped ? kLlama4Floor : 0));
          REQUIRE((ac.llama3.factor == 4.0f) == at.llama4);
          REQUIRE((ac.qk_norm_scope == moe::QkNormScope::kAllHeads) == at.norm_all);
          REQUIRE(ac.rotary_dim == at.rd);
          REQUIRE(ac.sinks == at.sinks);
          REQUIRE((ac.yarn.factor == 32.0f) == at.yarn);
          REQUIRE(ac.rope_interleaved == at.interleaved);
          REQUIRE(b.attention_format() == moe::experts::WeightFormat::kF32);
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
          Vec const want = reference_logits(t, m, dir, ids);
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
        // MLA: the latent [c | k_pe] rows alone; Qwen3-Next: the full-attention layers only, and
        // a recurrent state of a fixed size per linear layer.
        std::optional<Mla> const ml = mla_of(t);
        Index linear = 0;
        for (Index l = 0; l < t.L; ++l) linear += linear_layer(t, l) ? 1 : 0;
        REQUIRE(st.kv_bytes_per_token() ==
                static_cast<std::size_t>(ml ? t.L * (ml->R + ml->dr)
                                            : (t.L - linear) * 2 * t.kv * t.dh) *
                    sizeof(float));
        Gdn const g;
        REQUIRE(
            st.recurrent_bytes() ==
            static_cast<std::size_t>(
                linear * ((g.kernel - 1) * (2 * g.Hk * g.dk + g.Hv * g.dv) + g.Hv * g.dk * g.dv)) *
                sizeof(float));
        for (Index l = 0; l < t.L; ++l) {  // a sliding layer's cache dropped what it cannot see
          moe::KvCache const& c = st.caches[static_cast<std::size_t>(l)];
          if (linear_layer(t, l)) {
            REQUIRE(c.sequences() == 0);
            REQUIRE(st.recurrent[static_cast<std::size_t>(l)].at(0).tokens ==
                    static_cast<Index>(ids.size()));
            continue;
          }
          REQUIRE(c.window() == window_of(t, l));
          REQUIRE((c.first(0) > 0) == (c.window() > 0));
          REQUIRE(c.length(0) == static_cast<Index>(ids.size()));
        }
      },
      any);
}

}  // namespace

TEST_CASE("Decoder: Qwen3-MoE (q/k norms, a dense layer) generates as the reference",
          "[models][decoder]") {
  check_generation(family_tiny("qwen3_moe"), "decoder_qwen3");
}

TEST_CASE("Decoder: Mixtral (sliding window, tied embeddings) generates as the reference",
          "[models][decoder]") {
  check_generation(family_tiny("mixtral"), "decoder_mixtral");
}

TEST_CASE(
    "Decoder: Qwen2-MoE (q/k/v biases, gated shared expert, a dense layer) generates as the "
    "reference",
    "[models][decoder]") {
  check_generation(family_tiny("qwen2_moe"), "decoder_qwen2");
}

TEST_CASE("Decoder: OLMoE (q/k norms over all heads, q/k/v/o biases) generates as the reference",
          "[models][decoder]") {
  check_generation(family_tiny("olmoe"), "decoder_olmoe");
}

TEST_CASE(
    "Decoder: GLM-4.5 (partial RoPE, biases, per-head norms, dense first layer, "
    "group-limited sigmoid routing) generates as the reference",
    "[models][decoder]") {
  check_generation(family_tiny("glm4_moe"), "decoder_glm4");
}

TEST_CASE(
    "Decoder: gpt-oss (YaRN RoPE, sinks, q/k/v/o biases, alternating sliding windows, "
    "biased clamped experts) generates as the reference",
    "[models][decoder]") {
  check_generation(family_tiny("gpt_oss"), "decoder_gpt_oss");
}

TEST_CASE(
    "Decoder: ERNIE 4.5 (interleaved RoPE, a dense first layer, shared experts, a selection "
    "bias on the probabilities) generates as the reference",
    "[models][decoder]") {
  check_generation(family_tiny("ernie4_5_moe"), "decoder_ernie");
}

TEST_CASE(
    "Decoder: Llama 4 (chunked RoPE layers with an unweighted q/k norm and Llama 3 scaling, a "
    "NoPE layer with temperature tuning, dense layers under feed_forward, sigmoid-scaled expert "
    "inputs) generates as the reference",
    "[models][decoder][llama4]") {
  check_generation(family_tiny("llama4_text"), "decoder_llama4");
}

TEST_CASE(
    "Decoder: DeepSeek-V3 (multi-head latent attention with q LoRA, interleaved RoPE, YaRN and "
    "its softmax mscale; a dense first layer; noaux_tc routing, a shared expert) generates as "
    "the reference",
    "[models][decoder][mla]") {
  check_generation(family_tiny("deepseek_v3"), "decoder_deepseek_v3");
}

TEST_CASE(
    "Decoder: DeepSeek-V2-Lite-like (MLA without q LoRA, complex RoPE; group-limited greedy "
    "softmax routing) generates as the reference",
    "[models][decoder][mla]") {
  check_generation(family_tiny("deepseek_v2"), "decoder_deepseek_v2");
}

TEST_CASE(
    "Decoder: Llama 4's multimodal checkpoint (text_config, tensors under language_model.) "
    "decodes as its text-only one",
    "[models][decoder][llama4]") {
  Tiny const t = family_tiny("llama4_text");
  Tensors const m = make_tensors(t, 970);
  fs::path const plain = write_model(t, m, "decoder_llama4_plain");
  // Llama4ForConditionalGeneration: config.json nests the text model's keys, the checkpoint its
  // tensors (language_model.model.layers..., language_model.lm_head.weight).
  fs::path const nested = iotest::scratch_dir("decoder_llama4_nested");
  moe::io::SafetensorsWriter w;
  for (TensorSpec const& spec : tensor_specs(t)) {
    w.add_f32("language_model." + spec.name, spec.shape, m.at(spec.name));
  }
  w.save(nested / "model.safetensors");
  iotest::write_text(nested / "config.json",
                     concat(R"({"architectures": ["Llama4ForConditionalGeneration"], )",
                            R"("model_type": "llama4", "text_config": )", config_json(t), "}"));
  auto logits_of = [&](fs::path const& dir) {
    moe::models::AnyDecoder const any = moe::models::load_hf_decoder(dir);
    return std::visit(
        [&](auto const& dec) {
          std::vector<std::int64_t> const ids = {3, 17, 5, 9, 30};
          std::vector<Index> const counts = {5};
          auto st = dec.make_state(1);
          std::vector<float> out(static_cast<std::size_t>(t.V));
          dec.forward(ids, counts, st, {out.data(), 1, t.V});
          return out;
        },
        any);
  };
  std::vector<float> const a = logits_of(plain), b = logits_of(nested);
  REQUIRE(a == b);
  Vec const want = reference_logits(t, m, plain, {3, 17, 5, 9, 30});
  double scale = 0.0, diff = 0.0;
  for (Index v = 0; v < t.V; ++v) {
    scale = std::max(scale, std::fabs(want[v]));
    diff = std::max(diff, std::fabs(b[v] - want[v]));
  }
  REQUIRE(diff <= 1e-4 * scale);
}

TEST_CASE(
    "Decoder: Qwen3-Next (Gated DeltaNet layers from layer 0 with a recurrent state, gated full "
    "attention with (1 + w) q/k norms and partial RoPE, (1 + w) layer norms, a dense layer, a "
    "gated shared expert) generates as the reference",
    "[models][decoder][deltanet]") {
  check_generation(family_tiny("qwen3_next"), "decoder_qwen3_next");
}

TEST_CASE(
    "Decoder: Qwen3.5-MoE (split Gated DeltaNet projections, every layer MoE with always "
    "renormalised top-k weights) generates as the reference; its multimodal checkpoint "
    "(text_config, tensors under model.language_model.) decodes as the text-only one",
    "[models][decoder][deltanet]") {
  Tiny const t = family_tiny("qwen3_5_moe_text");
  check_generation(t, "decoder_qwen3_5");
  Tensors const m = make_tensors(t, 980);
  fs::path const plain = write_model(t, m, "decoder_qwen3_5_plain");
  // Qwen3_5MoeForConditionalGeneration: model.language_model.{embed_tokens, layers, norm},
  // lm_head at the root, config.json's text model in text_config.
  fs::path const nested = iotest::scratch_dir("decoder_qwen3_5_nested");
  moe::io::SafetensorsWriter w;
  for (TensorSpec const& spec : tensor_specs(t)) {
    std::string name = spec.name;
    if (name.starts_with("model.")) name = "model.language_model." + name.substr(6);
    w.add_f32(name, spec.shape, m.at(spec.name));
  }
  w.save(nested / "model.safetensors");
  iotest::write_text(
      nested / "config.json",
      concat(R"({"architectures": ["Qwen3_5MoeForConditionalGeneration"], )",
             R"("model_type": "qwen3_5_moe", "text_config": )", config_json(t), "}"));
  auto logits_of = [&](fs::path const& dir) {
    moe::models::AnyDecoder const any = moe::models::load_hf_decoder(dir);
    return std::visit(
        [&](auto const& dec) {
          std::vector<std::int64_t> const ids = {3, 17, 5, 9, 30};
          std::vector<Index> const counts = {5};
          auto st = dec.make_state(1);
          std::vector<float> out(static_cast<std::size_t>(t.V));
          dec.forward(ids, counts, st, {out.data(), 1, t.V});
          return out;
        },
        any);
  };
  REQUIRE(logits_of(plain) == logits_of(nested));
}

TEST_CASE(
    "Decoder: MiniMax-M2 (partial RoPE, q/k norms over all heads, sigmoid routing with a "
    "selection bias) generates as the reference",
    "[models][decoder]") {
  check_generation(family_tiny("minimax_m2"), "decoder_minimax_m2");
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
  using Dense = std::optional<WeightFormat>;
  Tensors m = make_tensors(t, 800);
  for (auto& [n, v] : m) {  // the values a BF16 checkpoint holds
    for (float& x : v) x = moe::kernels::bf16_to_float(moe::kernels::float_to_bf16(x));
  }
  fs::path const d16 = write_model(t, m, name + "_bf16", true);
  fs::path const d32 = write_model(t, m, name + "_f32", false);
  moe::ThreadPool pool(2);
  auto load = [&](fs::path const& dir, Dense dense, moe::ThreadPool* p = nullptr) {
    moe::models::DecoderOptions o;
    o.dense = dense;
    return moe::models::load_hf_decoder(dir, p, o);
  };
  auto const as_stored16 = load(d16, std::nullopt);
  auto const as_stored32 = load(d32, std::nullopt);
  auto const forced32 = load(d16, WeightFormat::kF32);
  auto const forced16 = load(d32, WeightFormat::kBf16, &pool);
  std::visit(
      [&](auto const& dec) {
        // BF16 tensors stay bf16: the embedding read in place from the mapped file, every
        // multiplied matrix packed as bf16.
        REQUIRE(dec.embed.bf16_view != nullptr);
        REQUIRE(dec.mapped != nullptr);
        REQUIRE(dec.lm_head.format() == WeightFormat::kBf16);
        for (Index l = 0; l < t.L; ++l) {
          auto const& b = dec.blocks[static_cast<std::size_t>(l)];
          REQUIRE(b.attention()->formats() == moe::AttentionFormats(WeightFormat::kBf16));
          REQUIRE(b.attention()->master_weights_discarded());
          if (!b.moe) {
            REQUIRE(b.mlp.gate.format() == WeightFormat::kBf16);
            REQUIRE(b.mlp.up.format() == WeightFormat::kBf16);
            REQUIRE(b.mlp.down.format() == WeightFormat::kBf16);
          }
          // The experts' fp32 weights are gone once packed (I_moe = 32 fills whole panels): the
          // logits compared below come from the packs alone.
          if (b.moe) REQUIRE_FALSE(b.moe->experts().has_master_weights());
        }
      },
      as_stored16);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(dec.embed.format == WeightFormat::kF32);
        REQUIRE(dec.embed.f32.size() == static_cast<std::size_t>(t.V * t.H));  // converted, held
        REQUIRE(dec.blocks.front().attention()->weight_format() == WeightFormat::kF32);
      },
      forced32);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(dec.embed.bf16.size() == static_cast<std::size_t>(t.V * t.H));  // rounded, held
        REQUIRE(dec.blocks.front().attention()->weight_format() == WeightFormat::kBf16);
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
  // Every matrix quantized: the formats asked for, the fallbacks where a depth is not whole
  // blocks (I_dense = 20: the dense down_proj has no 32-block format; bf16), the logits within
  // the documented bound (docs/decoding.md: q8_0 within 10% of the largest logit on these
  // random tiny models of width 32; real models: perplexity, not measured here).
  auto prefill_diff = [&](std::vector<float> const& l) {
    double d = 0.0;
    for (Index i = 0; i < t.V; ++i) {
      d = std::max(d, static_cast<double>(std::fabs(l[static_cast<std::size_t>(i)] -
                                                    want[static_cast<std::size_t>(i)])));
    }
    return d;
  };
  moe::models::DecoderOptions all8;
  all8.dense = WeightFormat::kQ8_0;
  all8.experts = WeightFormat::kQ8_0;
  auto const q8 = moe::models::load_hf_decoder(d16, &pool, all8);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(dec.embed.format == WeightFormat::kQ8_0);
        REQUIRE(dec.lm_head.format() == WeightFormat::kQ8_0);
        for (auto const& b : dec.blocks) {
          REQUIRE(b.attention()->formats() == moe::AttentionFormats(WeightFormat::kQ8_0));
          if (!b.moe) {
            REQUIRE(b.mlp.gate.format() == WeightFormat::kQ8_0);
            REQUIRE(b.mlp.down.format() == WeightFormat::kBf16);  // depth 20
          }
        }
        for (moe::models::Fallback const& f : dec.fallbacks) {
          INFO(f.matrix);
          REQUIRE(f.asked == WeightFormat::kQ8_0);
          REQUIRE(f.chosen == WeightFormat::kBf16);
          REQUIRE(f.depth % 32 != 0);
          REQUIRE_THAT(f.matrix, Catch::Contains("mlp.down_proj.weight"));
        }
        REQUIRE(dec.dense_bytes_per_step() > 0);
      },
      q8);
  double const d8 = prefill_diff(logits(q8, &pool));
  INFO("q8_0 everywhere: max |diff| " << d8 << " of max |logit| " << scale);
  REQUIRE(d8 > 0.0);
  REQUIRE(d8 <= 0.1 * scale);
  REQUIRE(logits(q8, nullptr) == logits(q8, &pool));  // one thread or two: the same bits
  auto const mix = moe::models::load_hf_decoder(d16, &pool, moe::models::DecoderOptions::q4_k_m());
  std::visit(
      [&](auto const& dec) {
        // H = 32: no K-quant holds it; q6_k falls back to q8_0, q4_k to q4_0.
        REQUIRE(dec.lm_head.format() == WeightFormat::kQ8_0);
        auto const head = std::find_if(dec.fallbacks.begin(), dec.fallbacks.end(),
                                       [](auto const& f) { return f.matrix.find("lm_head") == 0; });
        REQUIRE(head != dec.fallbacks.end());
        REQUIRE(head->asked == WeightFormat::kQ6_K);
        REQUIRE(head->chosen == WeightFormat::kQ8_0);
        REQUIRE(head->depth == t.H);
        REQUIRE(dec.embed.format == (t.tie ? WeightFormat::kQ8_0 : WeightFormat::kQ4_0));
        for (Index l = 0; l < t.L; ++l) {
          auto const& b = dec.blocks[static_cast<std::size_t>(l)];
          bool const more = moe::models::DecoderOptions::more_bits(l, t.L);
          bool const eight = t.E == 8;
          moe::AttentionFormats const f = b.attention()->formats();
          REQUIRE(f.q == WeightFormat::kQ4_0);
          REQUIRE(f.v == (eight || more ? WeightFormat::kQ8_0 : WeightFormat::kQ4_0));
          if (b.moe) {
            REQUIRE(b.moe->experts().packed_formats()[0] ==
                    moe::experts::ExpertFormat{WeightFormat::kQ4_0,
                                               more ? WeightFormat::kQ8_0 : WeightFormat::kQ4_0});
          }
        }
        REQUIRE_FALSE(dec.fallbacks.empty());
      },
      mix);
  // 4-bit blocks of 32 uniform random weights flip this toy model's routing: no useful logit
  // bound here (each format's error is bounded per matrix in the Linear and attention tests);
  // the mix runs, finite, on fewer bytes than q8_0.
  for (float const v : logits(mix, &pool)) REQUIRE(std::isfinite(v));
  auto const bytes = [](moe::models::AnyDecoder const& any) {
    return std::visit([](auto const& dec) { return dec.dense_bytes_per_step(); }, any);
  };
  REQUIRE(bytes(mix) < bytes(q8));
}

}  // namespace

TEST_CASE("Decoder: a BF16 checkpoint stays bf16 and decodes with the bits of its fp32 copy",
          "[models][decoder][bf16]") {
  SECTION("Qwen3-MoE, a dense layer") {
    Tiny t;
    check_bf16_checkpoint(t, "decoder_bf16_qwen3");
  }
  SECTION("GLM-4.5: biases, partial RoPE, group-limited routing, a shared expert") {
    Tiny t;
    t.type = "glm4_moe";
    check_bf16_checkpoint(t, "decoder_bf16_glm4");
  }
  SECTION("Mixtral, tied embeddings") {
    Tiny t;
    t.type = "mixtral";
    t.window = 4;
    t.tie = true;
    check_bf16_checkpoint(t, "decoder_bf16_mixtral");
  }
}

TEST_CASE("Decoder: F8_E4M3 attention weights with weight_scale_inv blocks (MiniMax-M2's release)",
          "[models][decoder][fp8]") {
  Tiny t;
  t.type = "minimax_m2";
  t.fp8_block = 4;
  Tensors m = make_tensors(t, 950);
  std::map<std::string, Shape> shapes;
  for (TensorSpec const& sp : tensor_specs(t)) shapes[sp.name] = sp.shape;
  // FP8 codes and 4x4 block scales for every attention projection; the F32 checkpoint holds
  // their dequantised values (code value x block scale), so both must decode alike.
  struct Fp8 {
    std::vector<std::byte> codes;
    std::vector<float> scales;
    Shape scale_shape;
  };
  std::map<std::string, Fp8> fp8;
  for (auto& [name, v] : m) {
    if (name.find("self_attn.") == std::string::npos || !name.ends_with("_proj.weight")) continue;
    Shape const& sh = shapes.at(name);
    std::int64_t const rows = sh[0], cols = sh[1], sr = (rows + 3) / 4, sc = (cols + 3) / 4;
    Fp8 f;
    f.scale_shape = {sr, sc};
    for (std::int64_t i = 0; i < sr * sc; ++i)
      f.scales.push_back(1e-3f * static_cast<float>(1 + i % 3));
    for (std::int64_t i = 0; i < rows * cols; ++i) {
      auto const code = static_cast<std::uint8_t>((i * 37 + 11) % 0x7E | (i % 2 ? 0x80 : 0));
      f.codes.push_back(static_cast<std::byte>(code));
      std::int64_t const r = i / cols, c = i % cols;
      v[static_cast<std::size_t>(i)] = moe::io::f8_e4m3_to_float(code) *
                                       f.scales[static_cast<std::size_t>((r / 4) * sc + c / 4)];
    }
    fp8[name] = std::move(f);
  }
  REQUIRE(fp8.size() == static_cast<std::size_t>(4 * t.L));
  fs::path const d32 = write_model(t, m, "decoder_fp8_as_f32");
  fs::path const d8 = iotest::scratch_dir("decoder_fp8");
  moe::io::SafetensorsWriter w;
  for (auto const& [name, v] : m) {
    if (auto it = fp8.find(name); it != fp8.end()) {
      w.add(name, moe::io::Dtype::kF8E4M3, shapes.at(name), it->second.codes);
      w.add_f32(name + "_scale_inv", it->second.scale_shape, it->second.scales);
    } else {
      w.add_f32(name, shapes.at(name), v);
    }
  }
  w.save(d8 / "model.safetensors");
  iotest::write_text(d8 / "config.json", config_json(t));
  REQUIRE_THAT(config_json(t), Catch::Contains("\"quant_method\": \"fp8\""));
  auto logits = [&](fs::path const& dir) {
    return std::visit([&](auto const& dec) { return greedy_logits(dec, t.V, 4, nullptr); },
                      moe::models::load_hf_decoder(dir));
  };
  std::vector<float> const want = logits(d32);
  REQUIRE(logits(d8) == want);
  // And the F32 one is the reference decoder's.
  Vec const ref = reference_logits(t, m, d32, {3, 17, 5, 9, 30});
  double scale = 0.0, diff = 0.0;
  for (Index i = 0; i < t.V; ++i) {
    scale = std::max(scale, std::fabs(ref[i]));
    diff = std::max(diff, std::fabs(want[i] - ref[i]));
  }
  REQUIRE(scale > 0.1);
  REQUIRE(diff <= 1e-4 * scale);
}

TEST_CASE(
    "Decoder: gpt-oss with MXFP4 experts (its release's format) decodes as the same model "
    "with the experts in F32",
    "[models][decoder][mxfp4]") {
  // The released gpt-oss checkpoints keep the experts as MXFP4 blocks (experts.gate_up_proj_blocks
  // [E, 2I, H/32, 16] nibbles, _scales [E, 2I, H/32] E8M0) beside BF16 attention. Random blocks
  // and scales here; the F32 twin holds their values, decoded with transformers' FP4_VALUES table
  // (low nibble first, ldexp(value, scale - 127)) and transposed to the x @ W layout. The loader
  // decodes exactly, so the two must give the same logits, bit for bit; the F32 model itself is
  // the reference decoder's (the gpt-oss generation test above).
  Tiny t;
  t.type = "gpt_oss";
  t.theta = 150000.0;
  t.eps = 1e-5;
  t.window = 3;
  t.H = 32;  // MXFP4 rows are whole 32-blocks
  t.I_moe = 32;
  Tensors m = make_tensors(t, 960);
  std::map<std::string, Shape> shapes;
  for (TensorSpec const& sp : tensor_specs(t)) shapes[sp.name] = sp.shape;
  Index const E = t.E, H = t.H, I = t.I_moe;
  std::uint64_t state = 961;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<unsigned>(state >> 33);
  };
  static constexpr float kFp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  struct Blocks {
    std::vector<std::byte> blocks, scales;
  };
  // [E, rows, cols] MXFP4 -> the x @ W tensor [E, cols, rows] of the F32 twin.
  auto make = [&](Index rows, Index cols, std::vector<float>& twin) {
    Blocks b;
    b.blocks.resize(static_cast<std::size_t>(E * rows * cols / 2));
    b.scales.resize(static_cast<std::size_t>(E * rows * cols / 32));
    for (auto& x : b.blocks) x = static_cast<std::byte>(next() & 0xFFu);
    for (auto& x : b.scales) x = static_cast<std::byte>(121u + next() % 4u);
    for (Index e = 0; e < E; ++e) {
      for (Index r = 0; r < rows; ++r) {
        for (Index c = 0; c < cols; ++c) {
          Index const flat = (e * rows + r) * cols + c;
          auto const byte = static_cast<unsigned>(b.blocks[static_cast<std::size_t>(flat / 2)]);
          unsigned const nib = c % 2 == 0 ? byte & 0xFu : byte >> 4;
          int const sc = static_cast<int>(b.scales[static_cast<std::size_t>(flat / 32)]) - 127;
          twin[static_cast<std::size_t>((e * cols + c) * rows + r)] = std::ldexp(kFp4[nib], sc);
        }
      }
    }
    return b;
  };
  std::vector<Blocks> gate_up, down;
  for (Index l = 0; l < t.L; ++l) {
    std::string const p = concat("model.layers.", l, ".mlp.experts.");
    gate_up.push_back(make(2 * I, H, m.at(p + "gate_up_proj")));
    down.push_back(make(H, I, m.at(p + "down_proj")));
  }
  fs::path const d32 = write_model(t, m, "decoder_gpt_oss_f32");
  fs::path const d4 = iotest::scratch_dir("decoder_gpt_oss_mxfp4");
  moe::io::SafetensorsWriter w;
  for (auto const& [name, v] : m) {
    if (name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj")) continue;
    w.add_f32(name, shapes.at(name), v);
  }
  for (Index l = 0; l < t.L; ++l) {
    std::string const p = concat("model.layers.", l, ".mlp.experts.");
    auto const u8 = moe::io::Dtype::kU8;
    auto const L = static_cast<std::size_t>(l);
    w.add(p + "gate_up_proj_blocks", u8, {E, 2 * I, H / 32, 16}, gate_up[L].blocks);
    w.add(p + "gate_up_proj_scales", u8, {E, 2 * I, H / 32}, gate_up[L].scales);
    w.add(p + "down_proj_blocks", u8, {E, H, I / 32, 16}, down[L].blocks);
    w.add(p + "down_proj_scales", u8, {E, H, I / 32}, down[L].scales);
  }
  w.save(d4 / "model.safetensors");
  Tiny t4 = t;
  t4.mxfp4 = true;
  REQUIRE_THAT(config_json(t4), Catch::Contains("\"quant_method\": \"mxfp4\""));
  iotest::write_text(d4 / "config.json", config_json(t4));
  auto logits = [&](fs::path const& dir, moe::experts::WeightFormat experts) {
    moe::models::DecoderOptions o;
    o.experts = experts;
    return std::visit([&](auto const& dec) { return greedy_logits(dec, t.V, 4, nullptr); },
                      moe::models::load_hf_decoder(dir, nullptr, o));
  };
  REQUIRE(logits(d4, moe::experts::WeightFormat::kF32) ==
          logits(d32, moe::experts::WeightFormat::kF32));
  // Quantized at load (what a 24 GB machine does with gpt-oss-20b): the same bits from both.
  REQUIRE(logits(d4, moe::experts::WeightFormat::kQ8_0) ==
          logits(d32, moe::experts::WeightFormat::kQ8_0));
}

TEST_CASE("generate: greedy is the argmax loop; sampling is seeded, top-p and can stop",
          "[models][decoder]") {
  Tiny t;
  fs::path const dir = write_model(t, make_tensors(t, 908), "generate_helper");
  moe::models::AnyDecoder const any = moe::models::load_hf_decoder(dir);
  auto const& d = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(any);
  std::vector<std::int64_t> const prompt = {3, 17, 5};
  // The oracle: forward and argmax by hand.
  std::vector<std::int64_t> want;
  std::vector<float> first(static_cast<std::size_t>(t.V));
  {
    auto st = d.make_state(1);
    std::vector<float> z(static_cast<std::size_t>(t.V));
    std::vector<Index> n = {3};
    d.forward(prompt, n, st, {z.data(), 1, t.V});
    first = z;
    n = {1};
    for (int i = 0; i < 6; ++i) {
      want.push_back(argmax(z.data(), t.V));
      d.forward(std::span<std::int64_t const>(&want.back(), 1), n, st, {z.data(), 1, t.V});
    }
  }
  moe::models::GenerateOptions o;
  o.max_new_tokens = 6;
  moe::models::GenerateResult const g = moe::models::generate(any, prompt, o);
  REQUIRE(g.ids == want);
  REQUIRE(g.steps == 5);
  REQUIRE(g.kv_bytes_per_token > 0);
  o.cache = false;
  REQUIRE(moe::models::generate(d, prompt, o).ids == want);
  o.cache = true;
  // A top_p below the likeliest token's probability: greedy at any temperature.
  o.sampling = {5.0, 1e-9, 7};
  REQUIRE(moe::models::generate(d, prompt, o).ids == want);
  // Seeded: the same ids again; another seed, other ids (at a high temperature).
  o.sampling = {50.0, 1.0, 7};
  std::vector<std::int64_t> const s7 = moe::models::generate(d, prompt, o).ids;
  REQUIRE(moe::models::generate(d, prompt, o).ids == s7);
  bool differs = false;
  for (std::uint64_t seed = 8; seed < 16 && !differs; ++seed) {
    o.sampling.seed = seed;
    differs = moe::models::generate(d, prompt, o).ids != s7;
  }
  REQUIRE(differs);
  // on_token: every id with the logits it came from; true stops after that token.
  o.sampling = {};
  std::vector<std::int64_t> seen;
  o.on_token = [&](std::int64_t id, std::span<float const> z) {
    if (seen.empty()) REQUIRE(std::equal(z.begin(), z.end(), first.begin(), first.end()));
    seen.push_back(id);
    return seen.size() == 2;
  };
  REQUIRE(moe::models::generate(d, prompt, o).ids ==
          std::vector<std::int64_t>(want.begin(), want.begin() + 2));
  REQUIRE(seen.size() == 2);
  o.on_token = {};
  // Bad calls.
  REQUIRE_THROWS_WITH(moe::models::generate(d, {}, o), Catch::Contains("the prompt is empty"));
  o.max_new_tokens = -1;
  REQUIRE_THROWS_WITH(moe::models::generate(d, prompt, o), Catch::Contains("must be >= 0"));
  o.max_new_tokens = 0;
  REQUIRE(moe::models::generate(d, prompt, o).ids.empty());
  REQUIRE_THROWS_WITH(moe::models::Sampler({-1.0, 1.0, 0}), Catch::Contains("temperature = -1"));
  REQUIRE_THROWS_WITH(moe::models::Sampler({std::nan(""), 1.0, 0}),
                      Catch::Contains("must be finite"));
  REQUIRE_THROWS_WITH(moe::models::Sampler({1.0, 0.0, 0}), Catch::Contains("top_p = 0"));
  REQUIRE_THROWS_WITH(moe::models::Sampler({1.0, 1.5, 0}), Catch::Contains("(0, 1]"));
  // Sampler: the first maximum, NaN never picked; softmax(z / T) frequencies.
  moe::models::Sampler greedy;
  float const nan = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(greedy.pick(std::vector<float>{1.0f, nan, 3.0f, 3.0f}) == 2);
  REQUIRE(greedy.pick(std::vector<float>{nan, nan}) == 0);
  moe::models::Sampler s({1.0, 1.0, 1});
  std::vector<float> const z = {0.0f, std::log(3.0f), nan};  // p = 1/4, 3/4, 0
  int ones = 0;
  for (int i = 0; i < 4000; ++i) {
    std::int64_t const id = s.pick(z);
    REQUIRE(id != 2);
    ones += id == 1;
  }
  REQUIRE(std::abs(ones / 4000.0 - 0.75) < 0.03);  // 4.4 standard deviations
}

TEST_CASE("Decoder: a bf16 KV cache holds half the bytes; the logits move by its rounding",
          "[models][decoder][bf16]") {
  Tiny t;
  Tensors const m = make_tensors(t, 720);
  auto const any = moe::models::load_hf_decoder(write_model(t, m, "decoder_kv_bf16"));
  auto const& dec = std::get<moe::models::Decoder<moe::presets::Qwen3Moe>>(any);
  std::vector<std::int64_t> const ids = {3, 17, 5, 9, 30, 2, 11, 4};
  std::vector<Index> const n = {static_cast<Index>(ids.size())};
  auto s32 = dec.make_state(1);
  auto s16 = dec.make_state(1, 0, moe::KvFormat::kBf16);
  REQUIRE(s16.kv_bytes_per_token() * 2 == s32.kv_bytes_per_token());
  std::vector<float> l32(static_cast<std::size_t>(t.V)), l16(l32.size());
  moe::ThreadPool pool(2);
  // A prefill, then steps: the cache rounds every key and value it stores, the prefill's too
  // (attention reads them back from the cache).
  dec.forward(ids, n, s32, {l32.data(), 1, t.V}, &pool);
  dec.forward(ids, n, s16, {l16.data(), 1, t.V}, &pool);
  for (int step = 0; step < 4; ++step) {
    double scale = 0.0, diff = 0.0;
    for (Index i = 0; i < t.V; ++i) {
      scale = std::max(scale, static_cast<double>(std::fabs(l32[i])));
      diff = std::max(diff, static_cast<double>(std::fabs(l16[i] - l32[i])));
    }
    INFO("step " << step << ": max |diff| " << diff << " of max |logit| " << scale);
    REQUIRE(diff > 0.0);  // the rounding shows
    REQUIRE(diff <= 2e-2 * scale);
    std::vector<std::int64_t> const one = {argmax(l32.data(), t.V)};
    std::vector<Index> const n1 = {1};
    dec.forward(one, n1, s32, {l32.data(), 1, t.V}, &pool);
    dec.forward(one, n1, s16, {l16.data(), 1, t.V}, &pool);
  }
  // 1 and 2 threads: the same bits.
  auto s16b = dec.make_state(1, 0, moe::KvFormat::kBf16);
  std::vector<float> a(l16.size()), b(l16.size());
  dec.forward(ids, n, s16b, {a.data(), 1, t.V});
  auto s16c = dec.make_state(1, 0, moe::KvFormat::kBf16);
  dec.forward(ids, n, s16c, {b.data(), 1, t.V}, &pool);
  REQUIRE(a == b);
}

namespace {

template <class Dec>
void check_batch(Tiny const& t, Dec const& dec) {
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

}  // namespace

TEST_CASE("Decoder: a batch of sequences decodes as each alone", "[models][decoder]") {
  // Qwen3-MoE (KV caches); Qwen3-Next (DeltaNet states: a prompt runs the chunked rule, a step
  // the recurrent one, per sequence, whatever the others in the call do).
  std::string const type = GENERATE(as<std::string>{}, "qwen3_moe", "qwen3_next");
  INFO(type);
  Tiny const t = family_tiny(type);
  Tensors const m = make_tensors(t, 700);
  fs::path const dir = write_model(t, m, "decoder_batch_" + type);
  auto const any = moe::models::load_hf_decoder(dir);
  std::visit([&](auto const& dec) { check_batch(t, dec); }, any);
}

namespace {
/// The logits of a prompt of 5 tokens and 4 greedy steps (batch of one), in order.
template <class Dec>
std::vector<float> greedy_logits(Tiny const& t, Dec const& dec, moe::ThreadPool* pool) {
  auto st = dec.make_state(1);
  std::vector<float> lg(static_cast<std::size_t>(t.V)), all;
  std::vector<std::int64_t> tokens = {1, 2, 3, 4, 5};
  std::vector<Index> n = {5};
  for (int s = 0; s < 5; ++s) {
    dec.forward(tokens, n, st, {lg.data(), 1, t.V}, pool);
    all.insert(all.end(), lg.begin(), lg.end());
    tokens = {argmax(lg.data(), t.V)};
    n = {1};
  }
  return all;
}
}  // namespace

TEST_CASE("Decoder: experts streamed from an expert store decode as resident ones, bit for bit",
          "[models][decoder][offload]") {
  // Qwen3-MoE (a dense layer among the MoE ones), Qwen2-MoE (a shared expert stays resident),
  // gpt-oss (expert biases stay resident); fp32 and q8_0 experts (d_ffn 32: whole panels).
  std::string const type = GENERATE(as<std::string>{}, "qwen3_moe", "qwen2_moe", "gpt_oss");
  bool const q8 = GENERATE(false, true);
  INFO(type << (q8 ? ", q8_0 experts" : ", fp32 experts"));
  Tiny t = family_tiny(type);
  t.H = 32;
  t.I_moe = 32;
  Tensors const m = make_tensors(t, 910);
  fs::path const dir = write_model(t, m, "decoder_stream_" + type);
  moe::models::DecoderOptions o;
  if (q8) o.experts = moe::experts::WeightFormat::kQ8_0;
  moe::ThreadPool pool(2);
  auto const any = moe::models::load_hf_decoder(dir, &pool, o);
  std::visit(
      [&](auto const& dec) {
        std::vector<float> const want = greedy_logits(t, dec, &pool);
        std::string const path = (dir / "experts.moex").string();
        dec.write_expert_store(path);
        auto const store = std::make_shared<moe::offload::ExpertStore const>(path);
        CHECK(store->shape().num_layers == static_cast<Index>(dec.moe_blocks().size()));
        // Written one layer at a time from the checkpoint: the same bytes.
        std::string const layered = (dir / "layered.moex").string();
        CHECK(moe::models::write_hf_expert_store(dir, layered, &pool, o).empty());
        auto bytes = [](std::string const& f) {
          std::ifstream in(f, std::ios::binary);
          return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        };
        CHECK(bytes(layered) == bytes(path));
        std::uint64_t const record = store->record(0, 0).read_bytes();
        for (std::string const policy : {"lru", "lfu", "layer-lru"}) {
          // Nothing cached; less than one token's top-2; two layers' worth; everything.
          for (std::uint64_t const budget :
               {std::uint64_t{0}, record, 2 * record * static_cast<std::uint64_t>(t.E),
                record * 1000}) {
            INFO(policy << ", budget " << budget);
            moe::offload::StreamerOptions so;
            so.policy = policy;
            so.budget_bytes = budget;
            so.reader_threads = budget == record ? 0 : 2;
            so.prefetch = policy == "lru" ? "both" : policy == "lfu" ? "previous" : "none";
            auto streamed = dec;
            streamed.stream_experts(std::make_shared<moe::offload::ExpertStreamer>(store, so));
            std::vector<float> const got = greedy_logits(t, streamed, &pool);
            REQUIRE(got.size() == want.size());
            CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
            moe::offload::StreamStats const& st = streamed.streamer->stats();
            CHECK(st.tokens == 9);
            CHECK(st.accesses == st.hits + st.misses + st.bypasses);
            CHECK(streamed.streamer->resident_bytes() <= budget);
            if (budget == 0) CHECK(st.hits == 0);
            if (budget == record * 1000) CHECK(st.bypasses == 0);
          }
        }
        // A routing trace of a streamed generation: the prompt's 3 tokens and 3 of the 4 new
        // ones (the last is not run); each step's experts are its top-K candidates, and the
        // last token's experts are what the streamer read for it.
        {
          auto traced = dec;
          moe::offload::StreamerOptions so;
          so.budget_bytes = 0;
          traced.stream_experts(std::make_shared<moe::offload::ExpertStreamer>(store, so));
          moe::offload::Trace trace(traced.trace_shape(3));
          moe::models::GenerateOptions go;
          go.max_new_tokens = 4;
          go.trace = &trace;
          std::vector<std::int64_t> const prompt = {1, 2, 3};
          (void)moe::models::generate(traced, prompt, go);
          REQUIRE(trace.num_tokens() == 6);
          Index const Lm = trace.shape().num_layers, K = trace.shape().top_k;
          for (Index step = 0; step < trace.num_steps(); ++step) {
            moe::offload::TraceRecord const r = trace.step(step);
            for (Index k = 0; k < K; ++k) {
              CHECK(r.experts[static_cast<std::size_t>(k)] ==
                    r.candidates[static_cast<std::size_t>(k)]);
            }
            if (r.token == 5) {
              std::vector<std::int32_t> a(r.experts.begin(), r.experts.end());
              auto const last = traced.streamer->last_experts(r.layer);
              std::vector<std::int32_t> b(last.begin(), last.end());
              std::sort(a.begin(), a.end());
              std::sort(b.begin(), b.end());
              CHECK(a == b);
            }
          }
          CHECK(trace.num_steps() == 6 * Lm);
          go.cache = false;
          CHECK_THROWS_WITH(moe::models::generate(traced, prompt, go),
                            Catch::Contains("needs the KV cache"));
        }
        // Cache-aware routing: tau 0 swaps nothing (the same bits); a wide rule swaps experts
        // for cached ones and still decodes (finite logits, the same shapes).
        for (float const tau : {0.0f, 1.0f}) {
          auto aware = dec;
          moe::offload::StreamerOptions so;
          so.budget_bytes = record * static_cast<std::uint64_t>(t.E);
          so.cache_routing = moe::offload::parse_cache_routing("keep=0,swaps=2,candidates=4,tau=" +
                                                               std::to_string(tau));
          aware.stream_experts(std::make_shared<moe::offload::ExpertStreamer>(store, so));
          std::vector<float> const got = greedy_logits(t, aware, &pool);
          if (tau == 0.0f) {
            CHECK(aware.streamer->stats().swaps == 0);
            CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
          } else {
            CHECK(aware.streamer->stats().swaps > 0);
            CHECK(std::all_of(got.begin(), got.end(), [](float v) { return std::isfinite(v); }));
          }
        }
        // Loaded with the store: the checkpoint's routed expert weights are never read (here
        // NaN) and the logits are the same bits; a format asked for the experts is ignored,
        // with a warning.
        Tensors nan = m;
        for (auto& [name, v] : nan) {
          if (name.find("mlp.experts.") != std::string::npos &&
              name.find("bias") == std::string::npos) {
            std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
          }
        }
        fs::path const nan_dir = write_model(t, nan, "decoder_stream_nan_" + type);
        moe::models::DecoderOptions lo = o;
        lo.expert_store = path;
        lo.streaming.budget_bytes = 3 * record;
        auto const loaded = moe::models::load_hf_decoder(nan_dir, &pool, lo);
        std::visit(
            [&](auto const& ld) {
              REQUIRE(ld.streamer != nullptr);
              std::vector<float> const got = greedy_logits(t, ld, &pool);
              CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
              CHECK(ld.warnings.size() == (q8 ? 1u : 0u));
            },
            loaded);
        // A store of another shape is refused when the model loads.
        Tiny wide = t;
        wide.I_moe = 64;
        fs::path const wide_dir = write_model(wide, make_tensors(wide, 911), "decoder_stream_wide");
        CHECK_THROWS_WITH(moe::models::load_hf_decoder(wide_dir, &pool, lo),
                          Catch::Contains("the store belongs to another model"));
        // Another model's store is refused before anything is freed.
        auto other = dec;
        moe::offload::StreamerOptions so;
        auto const bad = std::make_shared<moe::offload::ExpertStore const>(path);
        other.blocks.erase(other.blocks.begin() +
                           static_cast<std::ptrdiff_t>(other.moe_blocks().front()));
        CHECK_THROWS_WITH(
            other.stream_experts(std::make_shared<moe::offload::ExpertStreamer>(bad, so)),
            Catch::Contains("another model"));
      },
      any);
}

TEST_CASE("Decoder: Llama 4 config.json (Scout's multimodal text_config, Maverick-like keys)",
          "[models][decoder][llama4]") {
  using Catch::Contains;
  // Llama-4-Scout-17B-16E-Instruct's config.json, trimmed: the text model in text_config,
  // Llama 3 RoPE scaling, no_rope_layers left to its default (every 4th layer NoPE).
  std::string const scout = R"({"architectures": ["Llama4ForConditionalGeneration"],
      "model_type": "llama4", "text_config": {"attention_bias": false,
      "attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": true,
      "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
      "interleave_moe_layer_step": 1, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
      "max_position_embeddings": 10485760, "model_type": "llama4_text",
      "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
      "num_key_value_heads": 8, "num_local_experts": 16, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
      "use_qk_norm": true, "vocab_size": 202048}})";
  auto const c = moe::models::parse_decoder_config(scout, "scout/config.json");
  REQUIRE(c.moe.family == HfFamily::kLlama4);
  REQUIRE(c.vocab_size == 202048);
  REQUIRE(c.num_hidden_layers == 48);
  REQUIRE(c.head_dim == 128);
  REQUIRE(c.intermediate_size == 16384);
  REQUIRE(c.rope_interleaved);
  REQUIRE(c.llama3.factor == 16.0f);
  REQUIRE(c.llama3.original_max_position == 8192);
  REQUIRE(c.qk_norm_unweighted);
  REQUIRE_FALSE(c.qk_norm);
  REQUIRE(c.temperature_floor == 8192);
  REQUIRE(c.temperature_scale == 0.1f);
  for (Index L = 0; L < 48; ++L) {
    bool const nope = (L + 1) % 4 == 0;
    REQUIRE(c.rope_layer(L) == !nope);
    REQUIRE(c.chunk_of(L) == (nope ? 0 : 8192));
  }
  // llama4_text with explicit layer types, no chunks, no tuning, no q/k norm.
  auto const m = moe::models::parse_decoder_config(
      R"({"model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 64,
          "intermediate_size": 32, "num_local_experts": 4, "interleave_moe_layer_step": 2,
          "no_rope_layers": [1, 1, 0, 1], "attention_chunk_size": null,
          "layer_types": ["chunked_attention", "full_attention", "full_attention",
                          "chunked_attention"],
          "attn_temperature_tuning": false, "use_qk_norm": false, "rope_scaling": null})");
  REQUIRE(m.intermediate_size == 16384);  // intermediate_size_mlp's default
  REQUIRE(m.llama3.factor == 0.0f);
  REQUIRE_FALSE(m.qk_norm_unweighted);
  REQUIRE(m.temperature_floor == 0);
  REQUIRE(m.rope_layer(1));
  REQUIRE_FALSE(m.rope_layer(2));
  for (Index L = 0; L < 4; ++L) REQUIRE(m.chunk_of(L) == 0);
  // Bad keys name themselves.
  auto bad = [](std::string const& keys) {
    return concat(R"({"model_type": "llama4_text", "num_hidden_layers": 2, )", keys, "}");
  };
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(bad(R"("no_rope_layers": [1, 1, 1])")),
                      Contains("no_rope_layers has 3 entries") && Contains("= 2"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(bad(R"("no_rope_layers": [1, 2])")),
                      Contains("no_rope_layers") && Contains("0 (a NoPE layer) or 1"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(bad(R"("layer_types": ["chunked_attention", "sliding"])")),
      Contains("layer_types") && Contains("chunked_attention"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          bad(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})")),
                      Contains("Llama 3 RoPE scaling") && Contains("low_freq_factor"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          bad(R"("rope_scaling": {"rope_type": "linear", "factor": 8.0})")),
                      Contains("'linear' is not supported") && Contains("llama3"));
}

TEST_CASE("Decoder: DeepSeek-V3 and Kimi K2 config.json files give their MLA layers",
          "[models][decoder][mla]") {
  // DeepSeek-V3's config.json (trimmed of auto_map and token ids) and Kimi K2's (its own
  // model_type over DeepSeek-V3's architecture).
  std::string const v3 = R"({"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
      "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
      "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
      "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
      "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
      "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
      "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
      "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
      "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
      "v_head_dim": 128, "vocab_size": 129280})";
  auto const c = moe::models::parse_decoder_config(v3, "DeepSeek-V3/config.json");
  REQUIRE(c.mla.enabled);
  REQUIRE(c.mla.q_lora_rank == 1536);
  REQUIRE(c.mla.kv_lora_rank == 512);
  REQUIRE(c.mla.qk_rope_head_dim == 64);
  REQUIRE(c.mla.v_head_dim == 128);
  REQUIRE(c.mla.rope_interleave);
  REQUIRE(c.yarn.factor == 40.0f);
  REQUIRE(c.yarn.original_max_position == 4096);
  REQUIRE(c.mla.softmax_mscale_all_dim == 1.0f);
  REQUIRE(c.intermediate_size == 18432);
  REQUIRE(c.moe.first_k_dense_replace == 3);
  moe::MlaAttention const layer(moe::models::detail::mla_config(c));
  double const m = 0.1 * std::log(40.0) + 1.0;  // yarn_get_mscale(40, 1)
  REQUIRE(layer.scale() == Approx(m * m / std::sqrt(192.0)).epsilon(1e-6));
  REQUIRE(layer.make_cache(1).bytes_per_token() == 576 * sizeof(float));
  auto const kimi = moe::models::parse_decoder_config(
      R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
          "first_k_dense_replace": 1, "hidden_size": 7168, "intermediate_size": 18432,
          "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048,
          "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": true,
          "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61,
          "num_key_value_heads": 64, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0,
          "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
          "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 50000.0,
          "routed_scaling_factor": 2.827, "topk_group": 1, "v_head_dim": 128,
          "vocab_size": 163840})",
      "Kimi-K2/config.json");
  REQUIRE(kimi.moe.family == HfFamily::kDeepseekV3);
  REQUIRE(kimi.moe.num_experts == 384);
  REQUIRE(kimi.num_attention_heads == 64);
  REQUIRE(kimi.yarn.factor == 32.0f);
  REQUIRE(kimi.rope_theta == 50000.0f);
  // DeepSeek-V2-Lite: q_lora_rank null (one q_proj); V2 has no softmax mscale.
  auto const lite = moe::models::parse_decoder_config(
      R"({"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
          "num_attention_heads": 16, "q_lora_rank": null, "kv_lora_rank": 512,
          "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
          "intermediate_size": 10944, "first_k_dense_replace": 1,
          "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}})");
  REQUIRE(lite.mla.q_lora_rank == 0);
  REQUIRE(lite.mla.softmax_mscale_all_dim == 0.0f);
  REQUIRE(lite.yarn.factor == 40.0f);
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          R"({"model_type": "deepseek_v3", "num_hidden_layers": 2,
                              "qk_rope_head_dim": 5})"),
                      Catch::Contains("qk_rope_head_dim = 5") && Catch::Contains("even"));
}

TEST_CASE("Decoder: the released models' config.json files parse to their architectures",
          "[models][decoder]") {
  // config.json of released checkpoints (keys as published, trimmed of tokenizer ids), and what
  // the decoder must make of them.
  std::string layer_types;
  for (int i = 0; i < 24; ++i) {
    layer_types +=
        concat(i ? ", " : "", i % 2 == 0 ? "\"sliding_attention\"" : "\"full_attention\"");
  }
  auto const gpt_oss = moe::models::parse_decoder_config(
      concat(
          R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true, "experts_per_token": 4,
          "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
          "initial_context_length": 4096, "intermediate_size": 2880, "layer_types": [)",
          layer_types,
          R"(], "max_position_embeddings": 131072, "model_type": "gpt_oss",
          "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
          "num_key_value_heads": 8, "num_local_experts": 32,
          "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
            "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"},
          "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0,
            "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
            "truncate": false}, "rope_theta": 150000, "sliding_window": 128,
          "swiglu_limit": 7.0, "tie_word_embeddings": false, "vocab_size": 201088})"),
      "gpt-oss-20b/config.json");
  REQUIRE(gpt_oss.head_dim == 64);
  REQUIRE(gpt_oss.qkv_bias);
  REQUIRE(gpt_oss.o_bias);
  REQUIRE(gpt_oss.sinks);
  REQUIRE(gpt_oss.yarn.factor == 32.0f);
  REQUIRE(gpt_oss.yarn.original_max_position == 4096);
  REQUIRE_FALSE(gpt_oss.yarn.truncate);
  REQUIRE(gpt_oss.layer_windows[0] == 128);
  REQUIRE(gpt_oss.layer_windows[1] == 0);
  REQUIRE(gpt_oss.moe.mxfp4);
  REQUIRE(gpt_oss.moe.num_experts == 32);

  // Qwen3-Next-80B-A3B-Instruct's config.json (trimmed of keys the decoder does not read).
  auto const next = moe::models::parse_decoder_config(
      R"({"architectures": ["Qwen3NextForCausalLM"], "attention_bias": false,
          "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256,
          "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5120,
          "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
          "linear_num_value_heads": 32, "linear_value_head_dim": 128,
          "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
          "moe_intermediate_size": 512, "norm_topk_prob": true, "num_attention_heads": 16,
          "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
          "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
          "rope_scaling": null, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
          "tie_word_embeddings": false, "use_sliding_window": false, "vocab_size": 151936})",
      "Qwen3-Next-80B-A3B-Instruct/config.json");
  REQUIRE(next.deltanet.layers.size() == 48);
  for (Index l = 0; l < 48; ++l) REQUIRE(next.linear_layer(l) == ((l + 1) % 4 != 0));
  REQUIRE(next.deltanet.num_key_heads == 16);
  REQUIRE(next.deltanet.num_value_heads == 32);
  REQUIRE(next.deltanet.key_head_dim == 128);
  REQUIRE(next.deltanet.value_head_dim == 128);
  REQUIRE(next.deltanet.conv_kernel == 4);
  REQUIRE(next.attention_gate);
  REQUIRE(next.norm_one_plus);
  REQUIRE(next.qk_norm);
  REQUIRE(next.rotary_dim == 64);
  REQUIRE(next.rope_theta == 1e7f);
  REQUIRE(next.moe.num_experts == 512);
  REQUIRE(next.moe.is_moe_layer(0));
  // Qwen3.5-35B-A3B's config.json, shaped as published (trimmed; the vision tower's keys
  // aside): the text model in text_config, its multimodal RoPE keys in rope_parameters.
  auto const q35 = moe::models::parse_decoder_config(
      R"({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
          "image_token_id": 248056, "tie_word_embeddings": false,
          "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048,
            "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "vocab_size": 248320, "num_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4, "rms_norm_eps": 1e-06,
            "max_position_embeddings": 262144, "tie_word_embeddings": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
              "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
              "mrope_interleaved": true}},
          "vision_config": {"depth": 27, "hidden_size": 1152}})",
      "Qwen3.5-35B-A3B/config.json");
  REQUIRE(q35.moe.family == HfFamily::kQwen35Moe);
  REQUIRE(q35.deltanet.split_projections);
  REQUIRE(q35.num_hidden_layers == 40);
  for (Index l = 0; l < 40; ++l) {
    REQUIRE(q35.linear_layer(l) == ((l + 1) % 4 != 0));
    REQUIRE(q35.moe.is_moe_layer(l));
  }
  REQUIRE(q35.moe.num_experts == 256);
  REQUIRE(q35.moe.norm_topk_prob);
  REQUIRE(q35.rotary_dim == 64);
  REQUIRE(q35.vocab_size == 248320);
  REQUIRE(q35.attention_gate);
  REQUIRE(q35.norm_one_plus);
  // layer_types given: as written (transformers' remapped names only).
  auto const typed = moe::models::parse_decoder_config(
      R"({"model_type": "qwen3_next", "num_hidden_layers": 3,
          "layer_types": ["full_attention", "linear_attention", "full_attention"]})");
  REQUIRE_FALSE(typed.linear_layer(0));
  REQUIRE(typed.linear_layer(1));
  REQUIRE_FALSE(typed.linear_layer(2));

  auto const glm_air = moe::models::parse_decoder_config(
      R"({"architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "first_k_dense_replace": 1,
          "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
          "max_position_embeddings": 131072, "model_type": "glm4_moe",
          "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
          "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 96,
          "num_experts_per_tok": 8, "num_hidden_layers": 46, "num_key_value_heads": 8,
          "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
          "rope_scaling": null, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
          "tie_word_embeddings": false, "topk_group": 1, "use_qk_norm": false,
          "vocab_size": 151552})",
      "GLM-4.5-Air/config.json");
  REQUIRE(glm_air.rotary_dim == 64);
  REQUIRE(glm_air.qkv_bias);
  REQUIRE_FALSE(glm_air.o_bias);
  REQUIRE_FALSE(glm_air.qk_norm);
  REQUIRE_FALSE(glm_air.moe.is_moe_layer(0));
  REQUIRE(glm_air.moe.is_moe_layer(45));

  auto const olmoe = moe::models::parse_decoder_config(
      R"({"architectures": ["OlmoeForCausalLM"], "attention_bias": false, "clip_qkv": null,
          "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024,
          "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": false,
          "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
          "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-05,
          "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false,
          "vocab_size": 50304})",
      "OLMoE-1B-7B-0924/config.json");
  REQUIRE(olmoe.qk_norm_scope == moe::QkNormScope::kAllHeads);
  REQUIRE_FALSE(olmoe.qkv_bias);
  REQUIRE(olmoe.head_dim == 128);

  auto const qwen15 = moe::models::parse_decoder_config(
      R"({"architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu",
          "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192,
          "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
          "norm_topk_prob": false, "num_attention_heads": 16, "num_experts": 60,
          "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
          "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "shared_expert_intermediate_size": 5632,
          "sliding_window": 32768, "tie_word_embeddings": false, "use_sliding_window": false,
          "vocab_size": 151936})",
      "Qwen1.5-MoE-A2.7B/config.json");
  REQUIRE(qwen15.qkv_bias);
  REQUIRE(qwen15.layer_windows[0] == 0);
  REQUIRE(qwen15.moe.shared_expert_intermediate_size == 5632);

  auto const ernie = moe::models::parse_decoder_config(
      R"({"architectures": ["Ernie4_5_MoeForCausalLM"], "hidden_act": "silu", "hidden_size": 2560,
          "intermediate_size": 12288, "max_position_embeddings": 131072,
          "model_type": "ernie4_5_moe", "moe_intermediate_size": 1536, "moe_k": 6,
          "moe_layer_interval": 1, "moe_layer_start_index": 1, "moe_num_experts": 64,
          "moe_num_shared_experts": 2, "num_attention_heads": 20, "num_hidden_layers": 28,
          "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "rope_theta": 500000,
          "tie_word_embeddings": true, "use_bias": false, "vocab_size": 103424})",
      "ERNIE-4.5-21B-A3B-PT/config.json");
  REQUIRE(ernie.rope_interleaved);
  REQUIRE(ernie.tie_word_embeddings);
  REQUIRE(ernie.head_dim == 128);
  REQUIRE_FALSE(ernie.moe.is_moe_layer(0));
  REQUIRE(ernie.moe.is_moe_layer(27));

  auto const minimax = moe::models::parse_decoder_config(
      R"({"architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu",
          "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
          "model_type": "minimax_m2", "num_attention_heads": 48, "num_experts_per_tok": 8,
          "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
          "qk_norm_type": "per_layer", "quantization_config": {"activation_scheme": "dynamic",
            "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
          "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64,
          "scoring_func": "sigmoid", "tie_word_embeddings": false, "use_qk_norm": true,
          "use_routing_bias": true, "vocab_size": 200064})",
      "MiniMax-M2/config.json");
  REQUIRE(minimax.rotary_dim == 64);
  REQUIRE(minimax.qk_norm_scope == moe::QkNormScope::kAllHeads);
  REQUIRE(minimax.moe.fp8_block_rows == 128);
}

TEST_CASE("Decoder: bad models and calls are errors", "[models][decoder]") {
  using Catch::Contains;
  // Qwen3-Next's hybrid layers: layer_types and the Gated DeltaNet sizes.
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "qwen3_next", "num_hidden_layers": 2, "layer_types": ["linear_attention"]})"),
      Contains("layer_types has 1 entries but num_hidden_layers = 2"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "qwen3_next", "num_hidden_layers": 2,
              "layer_types": ["linear_attention", "sliding_attention"]})"),
      Contains("layer_types") && Contains("\"linear_attention\" or \"full_attention\""));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "qwen3_next", "num_hidden_layers": 2, "linear_num_key_heads": 3})"),
      Contains("linear_num_value_heads = 32 must be a multiple of linear_num_key_heads = 3"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "qwen3_next", "num_hidden_layers": 2, "full_attention_interval": 0})"),
      Contains("full_attention_interval"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(R"({"model_type": "mixtral"})"),
                      Contains("num_hidden_layers"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "mixtral", "num_hidden_layers": 2, "rope_scaling": {"type": "yarn"}})"),
      Contains("rope_scaling") && Contains("yarn"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          R"({"model_type": "olmoe", "num_hidden_layers": 2, "clip_qkv": 8})"),
                      Contains("clip_qkv"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "minimax_m2", "num_hidden_layers": 2, "qk_norm_type": "per_head"})"),
      Contains("qk_norm_type"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "qwen3_moe", "num_hidden_layers": 2, "attention_bias": true})"),
      Contains("attention_bias"));
  REQUIRE_THROWS_WITH(
      moe::models::parse_decoder_config(
          R"({"model_type": "qwen3_moe", "num_hidden_layers": 2, "partial_rotary_factor": 0.5})"),
      Contains("partial_rotary_factor"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          R"({"model_type": "glm4_moe", "num_hidden_layers": 2, "head_dim": 6,
              "partial_rotary_factor": 0.5})"),
                      Contains("rotary dimension 3"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          R"({"model_type": "qwen2_moe", "num_hidden_layers": 2,
                              "use_sliding_window": true})"),
                      Contains("use_sliding_window"));
  // Numbers out of range say so (they read as 0 or overflow), not "must be a finite number".
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          R"({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                              "rms_norm_eps": 1e-999})"),
                      Contains("rms_norm_eps") && Contains("out of range"));
  REQUIRE_THROWS_WITH(moe::models::parse_decoder_config(
                          R"({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                              "rms_norm_eps": 1e-60})"),
                      Contains("rms_norm_eps = 1e-60 is so small that it reads as 0 in a float"));
  {  // The released configs' keys: rope_scaling null, v5 rope_parameters, GLM's head_dim
    auto const glm = moe::models::parse_decoder_config(
        R"({"model_type": "glm4_moe", "num_hidden_layers": 46, "hidden_size": 4096,
            "head_dim": 128, "num_attention_heads": 96, "partial_rotary_factor": 0.5,
            "attention_bias": true, "use_qk_norm": false, "rope_theta": 1000000,
            "rope_scaling": null, "first_k_dense_replace": 1, "intermediate_size": 10944})");
    REQUIRE(glm.rotary_dim == 64);
    REQUIRE(glm.qkv_bias);
    REQUIRE_FALSE(glm.o_bias);
    REQUIRE_FALSE(glm.qk_norm);
    REQUIRE(glm.rope_theta == 1e6f);
    REQUIRE(glm.intermediate_size == 10944);
    auto const mm = moe::models::parse_decoder_config(
        R"({"model_type": "minimax_m2", "num_hidden_layers": 62, "hidden_size": 3072,
            "head_dim": 128, "rotary_dim": 64, "use_qk_norm": true,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000}})");
    REQUIRE(mm.rotary_dim == 64);
    REQUIRE(mm.qk_norm);
    REQUIRE(mm.qk_norm_scope == moe::QkNormScope::kAllHeads);
    REQUIRE(mm.rope_theta == 5e6f);
    auto const olmoe = moe::models::parse_decoder_config(
        R"({"model_type": "olmoe", "num_hidden_layers": 16, "num_attention_heads": 16,
            "clip_qkv": null})");
    REQUIRE(olmoe.num_key_value_heads == 16);  // defaults to the heads
    REQUIRE(olmoe.vocab_size == 50304);
    REQUIRE(olmoe.rms_norm_eps == 1e-5f);
    auto const q2 = moe::models::parse_decoder_config(
        R"({"model_type": "qwen2_moe", "num_hidden_layers": 24})");
    REQUIRE(q2.qkv_bias);  // transformers' qkv_bias default
    REQUIRE(q2.rotary_dim == 0);
  }
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

TEST_CASE("Decoder: experts streamed straight from the model's file decode as resident ones",
          "[models][decoder][offload]") {
  // No expert store: each miss packs the expert from the checkpoint (fp32 panels from an F32
  // file, bf16 panels from a BF16 one), for a family with a dense layer, one with a shared
  // expert, one with expert biases and fused, interleaved tensors.
  std::string const type = GENERATE(as<std::string>{}, "qwen3_moe", "qwen2_moe", "gpt_oss");
  bool const bf16 = GENERATE(false, true);
  INFO(type << (bf16 ? ", BF16 file" : ", F32 file"));
  Tiny t = family_tiny(type);
  t.H = 32;
  t.I_moe = 32;
  fs::path const dir = write_model(t, make_tensors(t, 911), "decoder_stream_file_" + type, bf16);
  moe::ThreadPool pool(2);
  std::vector<float> const want =
      std::visit([&](auto const& dec) { return greedy_logits(t, dec, &pool); },
                 moe::models::load_hf_decoder(dir, &pool));
  for (std::uint64_t const budget :
       {std::uint64_t{0}, std::uint64_t{40000}, std::uint64_t{1} << 30}) {
    INFO("budget " << budget);
    moe::models::DecoderOptions o;
    o.stream_experts = true;
    o.streaming.budget_bytes = budget;
    o.streaming.reader_threads = budget == 40000 ? 0 : 2;
    std::visit(
        [&](auto const& dec) {
          REQUIRE(dec.streamer != nullptr);
          REQUIRE(dynamic_cast<moe::offload::ExpertStore const*>(&dec.streamer->store()) ==
                  nullptr);
          std::vector<float> const got = greedy_logits(t, dec, &pool);
          REQUIRE(got.size() == want.size());
          CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
          moe::offload::StreamStats const& st = dec.streamer->stats();
          CHECK(st.accesses == st.hits + st.misses + st.bypasses);
          CHECK(st.misses + st.bypasses > 0);
          CHECK(dec.streamer->resident_bytes() <= budget);
          if (budget == 0) CHECK(st.hits == 0);
          for (std::size_t const i : dec.moe_blocks()) {
            CHECK(dec.blocks[i].moe->experts().records_streamed());
            CHECK_FALSE(dec.blocks[i].moe->experts().has_master_weights());
          }
        },
        moe::models::load_hf_decoder(dir, &pool, o));
  }
  // Quantizing on every miss is refused, saying what to do instead; and one source at a time.
  moe::models::DecoderOptions q8;
  q8.stream_experts = true;
  q8.experts = moe::experts::WeightFormat::kQ8_0;
  REQUIRE_THROWS_WITH(moe::models::load_hf_decoder(dir, &pool, q8),
                      Catch::Contains(dir.string()) && Catch::Contains("stores it as floats") &&
                          Catch::Contains("--write-expert-store"));
  q8.experts.reset();
  q8.expert_store = (dir / "none.moex").string();
  REQUIRE_THROWS_WITH(moe::models::load_hf_decoder(dir, &pool, q8), Catch::Contains("not both"));
}

#ifdef MOE_GENERATE

TEST_CASE(
    "moe_generate: every family's tiny model gives the reference's greedy ids and logits, cached "
    "and recomputed, on 1 and 2 threads",
    "[models][decoder][generate]") {
  for (char const* type : kDecoderFamilies) {
    DYNAMIC_SECTION(type) {
      Tiny const t = family_tiny(type);
      Tensors const m = make_tensors(t, 950);
      fs::path const dir = write_model(t, m, std::string("generate_") + type);
      std::vector<std::int64_t> seq = {1, 2, 3};
      std::vector<Vec> want;
      std::string ids;
      for (int i = 0; i < 4; ++i) {
        want.push_back(reference_logits(t, m, dir, seq));
        seq.push_back(std::max_element(want.back().begin(), want.back().end()) -
                      want.back().begin());
        ids += moe::io::detail::concat(i ? "," : "", seq.back());
      }
      for (std::string const mode : {"--threads 1", "--threads 2", "--no-cache --threads 2"}) {
        INFO(mode);
        fs::path const out = dir / "logits.safetensors";
        REQUIRE(run_generate("--model '" + dir.string() +
                                 "' --prompt-ids 1,2,3 --max-new-tokens 4 --logits '" +
                                 out.string() + "' " + mode,
                             dir) == 0);
        INFO(text_of(dir / "err.txt"));
        REQUIRE(text_of(dir / "out.txt") == ids + "\n");
        moe::io::SafetensorsFile const f(out);
        std::vector<float> const got = moe::io::to_float(f.tensor("logits"));
        REQUIRE(got.size() == want.size() * static_cast<std::size_t>(t.V));
        for (std::size_t step = 0; step < want.size(); ++step) {
          double scale = 0.0, diff = 0.0;
          for (Index v = 0; v < t.V; ++v) {
            scale = std::max(scale, std::fabs(want[step][v]));
            diff = std::max(diff, std::fabs(got[step * t.V + v] - want[step][v]));
          }
          INFO("step " << step << ": max |diff| " << diff << " of max |logit| " << scale);
          REQUIRE(diff <= 1e-4 * scale);
        }
      }
    }
  }
}

TEST_CASE("moe_generate: experts streamed from an expert store give the same ids and logits",
          "[models][decoder][generate][offload]") {
  Tiny t;
  t.H = 32;
  t.I_moe = 32;
  Tensors const m = make_tensors(t, 920);
  fs::path const dir = write_model(t, m, "generate_stream");
  std::string const model = "--model '" + dir.string() + "'";
  std::string const store = (dir / "experts.moex").string();
  std::string const base = model + " --prompt-ids 3,17,5 --max-new-tokens 6 --experts q8_0";
  REQUIRE(run_generate(base + " --logits '" + (dir / "a.safetensors").string() + "'", dir) == 0);
  std::string const ids = text_of(dir / "out.txt");
  INFO(text_of(dir / "err.txt"));
  REQUIRE(run_generate(model + " --experts q8_0 --write-expert-store '" + store + "'", dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"),
               Catch::Contains("2 MoE layers x 4 experts") && Catch::Contains("(experts q8_0)"));
  // A cache smaller than one token's experts, with an emulated drive; and one that holds all.
  for (std::string const opts :
       {" --expert-cache 10KiB --read-bandwidth 2GB --reader-threads 0",
        " --expert-cache 1GiB --cache-policy lfu --direct-io --prefetch both"}) {
    INFO(opts);
    std::string const logits = (dir / "b.safetensors").string();
    REQUIRE(
        run_generate(base + " --expert-store '" + store + "'" + opts + " --logits '" + logits + "'",
                     dir) == 0);
    CHECK(text_of(dir / "out.txt") == ids);
    CHECK(text_of(dir / "a.safetensors") == text_of(logits));
    CHECK_THAT(text_of(dir / "err.txt"),
               Catch::Contains("experts streamed from") && Catch::Contains("hit rate") &&
                   Catch::Contains("read per token") && Catch::Contains("precision") &&
                   Catch::Contains("a format asked for them is ignored"));
  }
  // Misuse: one line, exit status 1, pointing at the fix.
  CHECK(run_generate(base + " --expert-store '" + store + "' --cache-policy belady", dir) == 1);
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("belady needs the future"));
  CHECK(run_generate(base + " --direct-io", dir) == 1);
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("go with --expert-store"));
  CHECK(run_generate(base + " --stream-experts --expert-store '" + store + "'", dir) == 1);
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("give one"));
  // --stream-experts: the same cache, straight from the model's file (q8_0 from its floats
  // would quantize on every miss: refused); fp32 experts give the fp32 run's ids and logits.
  CHECK(run_generate(base + " --stream-experts", dir) == 1);
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("--write-expert-store"));
  std::string const fp32 = model + " --prompt-ids 3,17,5 --max-new-tokens 6";
  REQUIRE(run_generate(fp32 + " --logits '" + (dir / "c.safetensors").string() + "'", dir) == 0);
  std::string const fp32_ids = text_of(dir / "out.txt");
  REQUIRE(
      run_generate(fp32 +
                       " --stream-experts --expert-cache 20KiB --cache-policy lfu --prefetch both "
                       "--logits '" +
                       (dir / "d.safetensors").string() + "'",
                   dir) == 0);
  CHECK(text_of(dir / "out.txt") == fp32_ids);
  CHECK(text_of(dir / "c.safetensors") == text_of(dir / "d.safetensors"));
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("re-packed from the model's file"));
  CHECK(run_generate(base + " --expert-store '" + store + "' --expert-cache 8GB2", dir) == 1);
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("is not a size with a unit"));
  CHECK(run_generate(model + " --write-expert-store '" + store + "' --prompt-ids 1", dir) == 1);
  CHECK(run_generate(base + " --expert-store '" + (dir / "config.json").string() + "'", dir) == 1);
  CHECK_THAT(text_of(dir / "err.txt"), Catch::Contains("not an expert store"));
}

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
    Vec const z = reference_logits(t, m, dir, seq);
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
               Catch::Contains("(qwen3_moe, 3 layers; LM head bf16, attention bf16, experts bf16, "
                               "KV cache fp32)"));
  REQUIRE(run_generate(base, dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"),
               Catch::Contains("LM head fp32, attention fp32, experts fp32, KV cache fp32)"));
  REQUIRE(run_generate(base + " --kv-cache bf16", dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"), Catch::Contains("KV cache bf16)") &&
                                             Catch::Contains("KV cache 192 bytes per token"));
  // Errors: one line on stderr, exit 1.
  for (std::string const& bad :
       {std::string("--model '") + dir.string() + "' --prompt-ids 3,99 --max-new-tokens 2",
        std::string("--model '") + dir.string() + "' --prompt-ids 3,x --max-new-tokens 2",
        std::string("--model '") + dir.string() + "' --max-new-tokens 2",
        std::string("--model '") + dir.string() + "' --prompt-ids 3 --max-new-tokens 2 --dense x",
        std::string("--model '") + dir.string() +
            "' --prompt-ids 3 --max-new-tokens 2 --experts q5",
        std::string("--model '") + dir.string() +
            "' --prompt-ids 3 --max-new-tokens 2 --kv-cache fp8",
        std::string("--model '") + (dir / "none").string() +
            "' --prompt-ids 1 --max-new-tokens 1"}) {
    INFO(bad);
    REQUIRE(run_generate(bad, dir) == 1);
    std::string const err = text_of(dir / "err.txt");
    REQUIRE(std::count(err.begin(), err.end(), '\n') == 1);
    REQUIRE_THAT(err, Catch::StartsWith("moe_generate: "));
  }
}

TEST_CASE(
    "Decoder: tied embeddings with an lm_head.weight in the checkpoint: a warning, the "
    "embedding is the LM head",
    "[models][decoder][generate]") {
  Tiny t;  // untied: the checkpoint holds lm_head.weight
  Tensors const m = make_tensors(t, 950);
  fs::path const dir = write_model(t, m, "decoder_tied_with_head");
  Tiny tied = t;
  tied.tie = true;
  iotest::write_text(dir / "config.json", config_json(tied));
  auto const any = moe::models::load_hf_decoder(dir);
  std::visit(
      [&](auto const& dec) {
        REQUIRE(dec.warnings.size() == 1);
        REQUIRE_THAT(dec.warnings[0], Catch::Contains("lm_head.weight is not read"));
        REQUIRE(dec.lm_head.rows() == t.V);  // packed from the embedding (the tied tests
                                             // check the logits)
      },
      any);
  auto const plain = moe::models::load_hf_decoder(write_model(t, m, "decoder_untied_plain"));
  std::visit([](auto const& dec) { REQUIRE(dec.warnings.empty()); }, plain);
  std::string const base = "--model '" + dir.string() + "' --prompt-ids 3,17 --max-new-tokens 2";
  REQUIRE(run_generate(base, dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"),
               Catch::Contains("moe_generate: warning: config.json sets tie_word_embeddings"));
}
TEST_CASE("Decoder: a context longer than max_position_embeddings is a warning",
          "[models][decoder][generate]") {
  Tiny const t;
  Tensors const m = make_tensors(t, 960);
  fs::path const dir = write_model(t, m, "decoder_max_position");
  auto const plain = moe::models::load_hf_decoder(dir);  // config.json without the key
  std::visit(
      [](auto const& dec) {
        REQUIRE(dec.max_context() == 0);
        REQUIRE(dec.context_warning(1 << 20).empty());
      },
      plain);
  std::string j = config_json(t);
  j.resize(j.rfind('}'));
  iotest::write_text(dir / "config.json", j + ", \"max_position_embeddings\": 4}");
  auto const any = moe::models::load_hf_decoder(dir);
  std::visit(
      [](auto const& dec) {
        REQUIRE(dec.max_context() == 4);
        REQUIRE(dec.context_warning(4).empty());
        REQUIRE_THAT(dec.context_warning(5),
                     Catch::Contains("a context of 5 tokens is longer than the 4 the model was "
                                     "trained for (config.json's max_position_embeddings)"));
      },
      any);
  std::string const model = "--model '" + dir.string() + "' --prompt-ids 3,17 --max-new-tokens ";
  REQUIRE(run_generate(model + "2", dir) == 0);
  REQUIRE_THAT(text_of(dir / "err.txt"), !Catch::Contains("warning"));
  REQUIRE(run_generate(model + "3", dir) == 0);
  std::string const err = text_of(dir / "err.txt");
  REQUIRE_THAT(err, Catch::Contains("moe_generate: warning: a context of 5 tokens is longer than "
                                    "the 4 the model was trained for"));
  REQUIRE(err.find("warning") == err.rfind("warning"));  // one warning line
}
#endif
