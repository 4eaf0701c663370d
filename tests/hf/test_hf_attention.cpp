// SPDX-License-Identifier: Apache-2.0
// Qwen3-Next's full-attention layer from a checkpoint: config.json keys (layer_types, RoPE in
// both transformers layouts), the loader against a double-precision transcription of
// transformers' Qwen3NextAttention computed from the checkpoint's tensors, the errors, and
// moe_run_hf_attention's forward and --grad against the library's backward.
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "hf/hf_test_support.hpp"
#include "io/io_test_support.hpp"
#include "moe/core/random.hpp"
#include "moe/io/hf/attention.hpp"

namespace {

using Catch::Contains;
using moe::Index;
using moe::io::HfAttentionConfig;
namespace fs = std::filesystem;

/// A tiny Qwen3-Next config: D 24, 4 heads over 2 KV heads of 8 dims, 4 of them rotated,
/// layers 0..3 with the full-attention layers 1 and 3.
HfAttentionConfig tiny() {
  HfAttentionConfig c = moe::io::parse_hf_attention_config(R"({"model_type": "qwen3_next",
    "hidden_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "rms_norm_eps": 1e-6, "num_hidden_layers": 4, "full_attention_interval": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0,
                        "partial_rotary_factor": 0.5}})");
  return c;
}

/// A layer of `c` with random weights (norm weights around 0: the (1 + w) form).
moe::io::Qwen3NextAttention random_layer(HfAttentionConfig const& c, std::uint64_t seed) {
  moe::io::Qwen3NextAttention layer(c.layer_config());
  std::uint64_t s = seed;
  for (auto& p : layer.parameters()) moe::fill_uniform(p.values, -0.4f, 0.4f, ++s);
  return layer;
}

/// transformers' Qwen3NextAttention.forward (eager, causal, positions 0..T-1) in double, from
/// the tensors of `file` under `prefix`.
std::vector<double> hf_attention(HfAttentionConfig const& c, fs::path const& file,
                                 std::string const& prefix, std::vector<float> const& xf) {
  moe::io::SafetensorsFile const ck(file);
  auto get = [&](char const* name) {
    std::vector<float> const f = moe::io::to_float(ck.tensor(prefix + name));
    return std::vector<double>(f.begin(), f.end());
  };
  std::vector<double> const wq = get("q_proj.weight"), wk = get("k_proj.weight"),
                            wv = get("v_proj.weight"), wo = get("o_proj.weight"),
                            qn = get("q_norm.weight"), kn = get("k_norm.weight");
  Index const D = c.hidden_size, H = c.num_attention_heads, KV = c.num_key_value_heads,
              dh = c.head_dim, T = static_cast<Index>(xf.size()) / D, G = H / KV;
  Index const rd = static_cast<Index>(dh * static_cast<double>(c.partial_rotary_factor));
  auto linear = [&](std::vector<double> const& w, Index out, Index t) {
    std::vector<double> y(static_cast<std::size_t>(out), 0.0);
    for (Index o = 0; o < out; ++o) {
      for (Index d = 0; d < D; ++d) y[o] += w[o * D + d] * xf[t * D + d];
    }
    return y;
  };
  // Qwen3NextRMSNorm: x / sqrt(mean x^2 + eps) * (1 + w), per head.
  auto norm = [&](double* v, std::vector<double> const& w) {
    double ms = 0.0;
    for (Index i = 0; i < dh; ++i) ms += v[i] * v[i];
    double const r = 1.0 / std::sqrt(ms / dh + c.rms_norm_eps);
    for (Index i = 0; i < dh; ++i) v[i] = v[i] * r * (1.0 + w[i]);
  };
  // Partial rotate-half RoPE on the first rd dims; inv_freq in float as transformers has it.
  auto rope = [&](double* v, Index pos) {
    std::vector<double> out(v, v + rd);
    for (Index i = 0; i < rd / 2; ++i) {
      float const inv = 1.0f / std::pow(c.rope_theta, static_cast<float>(2 * i) / rd);
      double const a = static_cast<double>(static_cast<float>(pos) * inv);
      out[i] = v[i] * std::cos(a) - v[i + rd / 2] * std::sin(a);
      out[i + rd / 2] = v[i + rd / 2] * std::cos(a) + v[i] * std::sin(a);
    }
    std::copy(out.begin(), out.end(), v);
  };
  std::vector<double> q(static_cast<std::size_t>(T * H * dh)), gate(q.size()),
      k(static_cast<std::size_t>(T * KV * dh)), v(k.size());
  for (Index t = 0; t < T; ++t) {
    std::vector<double> const qg = linear(wq, H * 2 * dh, t);
    // view(T, H, 2 d_h).chunk(2, -1): per head, its query then its gate.
    for (Index h = 0; h < H; ++h) {
      for (Index i = 0; i < dh; ++i) {
        q[(t * H + h) * dh + i] = qg[h * 2 * dh + i];
        gate[(t * H + h) * dh + i] = qg[h * 2 * dh + dh + i];
      }
      norm(&q[(t * H + h) * dh], qn);
      rope(&q[(t * H + h) * dh], t);
    }
    std::vector<double> const kt = linear(wk, KV * dh, t), vt = linear(wv, KV * dh, t);
    for (Index g = 0; g < KV; ++g) {
      std::copy(kt.begin() + g * dh, kt.begin() + (g + 1) * dh, &k[(t * KV + g) * dh]);
      std::copy(vt.begin() + g * dh, vt.begin() + (g + 1) * dh, &v[(t * KV + g) * dh]);
      norm(&k[(t * KV + g) * dh], kn);
      rope(&k[(t * KV + g) * dh], t);
    }
  }
  std::vector<double> attn(q.size(), 0.0), y(static_cast<std::size_t>(T * D), 0.0);
  double const scale = 1.0 / std::sqrt(static_cast<double>(dh));
  for (Index t = 0; t < T; ++t) {
    for (Index h = 0; h < H; ++h) {
      Index const g = h / G;  // repeat_kv
      std::vector<double> s(static_cast<std::size_t>(t + 1));
      double m = -INFINITY, sum = 0.0;
      for (Index j = 0; j <= t; ++j) {
        double d = 0.0;
        for (Index i = 0; i < dh; ++i) d += q[(t * H + h) * dh + i] * k[(j * KV + g) * dh + i];
        m = std::max(m, s[j] = d * scale);
      }
      for (double& e : s) sum += (e = std::exp(e - m));
      for (Index j = 0; j <= t; ++j) {
        for (Index i = 0; i < dh; ++i) {
          attn[(t * H + h) * dh + i] += s[j] / sum * v[(j * KV + g) * dh + i];
        }
      }
    }
    // attn_output * sigmoid(gate), then o_proj.
    for (Index d = 0; d < D; ++d) {
      for (Index i = 0; i < H * dh; ++i) {
        double const gated = attn[t * H * dh + i] / (1.0 + std::exp(-gate[t * H * dh + i]));
        y[t * D + d] += wo[d * H * dh + i] * gated;
      }
    }
  }
  return y;
}

}  // namespace

TEST_CASE("Qwen3-Next attention config: layer types, RoPE keys, defaults, errors",
          "[hf][attention]") {
  HfAttentionConfig const d = moe::io::parse_hf_attention_config(R"({"model_type": "qwen3_next"})");
  REQUIRE(d.hidden_size == 2048);
  REQUIRE(d.num_attention_heads == 16);
  REQUIRE(d.num_key_value_heads == 2);
  REQUIRE(d.head_dim == 256);
  REQUIRE(d.rotary_dim() == 64);  // int(256 * 0.25)
  REQUIRE(d.rope_theta == 10000.0f);
  REQUIRE(d.layer_types.size() == 48);
  REQUIRE(d.not_full_attention_reason(3).empty());
  REQUIRE(d.not_full_attention_reason(47).empty());
  REQUIRE_THAT(d.not_full_attention_reason(0),
               Contains("linear_attention (Gated DeltaNet)") && Contains("3, 7, 11"));
  REQUIRE_THAT(d.not_full_attention_reason(48), Contains("does not exist"));

  // The released config.json: v4 keys (rope_theta, partial_rotary_factor at the top level).
  HfAttentionConfig const r = moe::io::parse_hf_attention_config(R"({"model_type": "qwen3_next",
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "rope_theta": 10000000, "partial_rotary_factor": 0.25, "rope_scaling": null,
    "full_attention_interval": 4, "num_hidden_layers": 48, "attention_bias": false,
    "rms_norm_eps": 1e-06, "linear_num_value_heads": 32})");
  REQUIRE(r.rope_theta == 1e7f);
  REQUIRE(r.unknown_keys.empty());
  // layer_types given explicitly wins over the interval.
  HfAttentionConfig const l = moe::io::parse_hf_attention_config(R"({"model_type": "qwen3_next",
    "num_hidden_layers": 3, "layer_types": ["full_attention", "linear_attention",
    "full_attention"]})");
  REQUIRE(l.not_full_attention_reason(0).empty());
  REQUIRE_FALSE(l.not_full_attention_reason(1).empty());

  using moe::io::parse_hf_attention_config;
  REQUIRE_THROWS_WITH(parse_hf_attention_config(R"({"model_type": "qwen3_moe"})"),
                      Contains("\"qwen3_next\""));
  REQUIRE_THROWS_WITH(
      parse_hf_attention_config(R"({"model_type": "qwen3_next", "attention_bias": true})"),
      Contains("attention_bias = true"));
  REQUIRE_THROWS_WITH(
      parse_hf_attention_config(R"({"model_type": "qwen3_next", "head_dim": 8, "head_dim": 16})"),
      Contains("appears twice"));
  REQUIRE_THROWS_WITH(parse_hf_attention_config(
                          R"({"model_type": "qwen3_next", "rope_scaling": {"rope_type": "yarn"}})"),
                      Contains("'yarn' is not supported"));
  REQUIRE_THROWS_WITH(
      parse_hf_attention_config(R"({"model_type": "qwen3_next", "num_key_value_heads": 3})"),
      Contains("does not divide num_attention_heads = 16"));
  REQUIRE_THROWS_WITH(
      parse_hf_attention_config(R"({"model_type": "qwen3_next", "partial_rotary_factor": 0.001})"),
      Contains("even number in [2, head_dim]"));
  REQUIRE_THROWS_WITH(parse_hf_attention_config(
                          R"({"model_type": "qwen3_next", "num_hidden_layers": 2,
                              "layer_types": ["full_attention"]})"),
                      Contains("layer_types has 1 entries"));
}

TEST_CASE("Qwen3-Next attention: the loaded layer computes transformers' Qwen3NextAttention",
          "[hf][attention]") {
  HfAttentionConfig const c = tiny();
  REQUIRE(c.rotary_dim() == 4);
  moe::io::Qwen3NextAttention const layer = random_layer(c, 71);
  fs::path const dir = iotest::scratch_dir("qwen3_next_attention");
  moe::io::save_hf_attention(dir, c, 3, layer);
  moe::io::HfAttentionLayer const hf = moe::io::load_hf_attention(dir, 3, {{}, true});
  REQUIRE(hf.warnings.empty());
  REQUIRE(hf.tensors.front().name == "model.layers.3.self_attn.q_proj.weight");
  REQUIRE(hf.tensors.front().shape == std::vector<std::int64_t>{4 * 2 * 8, 24});
  for (auto const& t : hf.tensors) {
    REQUIRE(moe::io::hf_attention_values(hf.layer, t) == moe::io::hf_attention_values(layer, t));
  }
  Index const T = 11, D = c.hidden_size;
  std::vector<float> const x = hftest::random_input(T, D, 72);
  std::vector<double> const want =
      hf_attention(c, dir / "model.safetensors", "model.layers.3.self_attn.", x);
  std::vector<float> y(x.size());
  moe::GatedAttentionWorkspace ws;
  hf.layer.forward({x.data(), T, D}, {y.data(), T, D}, ws);
  double scale = 0.0, diff = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    scale = std::max(scale, std::fabs(want[i]));
    diff = std::max(diff, std::fabs(y[i] - want[i]));
  }
  REQUIRE(scale > 0.01);
  REQUIRE(diff / scale < 1e-5);

  REQUIRE_THROWS_WITH(moe::io::load_hf_attention(dir, 2),
                      Contains("cannot load layer 2 as attention") && Contains("linear_attention"));
  REQUIRE_THROWS_WITH(moe::io::load_hf_attention(dir, 1),
                      Contains("tensor") && Contains("q_proj.weight") && Contains("is missing"));
}

#ifdef MOE_RUN_HF_ATTENTION
TEST_CASE("moe_run_hf_attention: forward and --grad match the layer; bad input exits 1",
          "[hf][attention][runner]") {
  HfAttentionConfig const c = tiny();
  moe::io::Qwen3NextAttention const layer = random_layer(c, 81);
  fs::path const dir = iotest::scratch_dir("qwen3_next_attention_runner");
  moe::io::save_hf_attention(dir, c, 1, layer);
  Index const T = 9, D = c.hidden_size;
  std::vector<float> const x = hftest::random_input(T, D, 82), dy = hftest::random_input(T, D, 83);
  moe::io::SafetensorsWriter().add_f32("x", {T, D}, x).save(dir / "x.safetensors");
  moe::io::SafetensorsWriter().add_f32("dy", {T, D}, dy).save(dir / "dy.safetensors");
  auto run = [&](std::string const& args) {
    std::string command = "'";
    command.append(MOE_RUN_HF_ATTENTION).append("' ").append(args).append(" 2>'");
    command.append((dir / "stderr.txt").string()).append("'");
    int const status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string const base = moe::io::detail::concat("--model '", dir.string(), "' --input '",
                                                   (dir / "x.safetensors").string(), "' --output '",
                                                   (dir / "y.safetensors").string(), "'");
  REQUIRE(run(base + " --layer 1 --threads 2 --grad '" + (dir / "dy.safetensors").string() + "'") ==
          0);

  std::vector<float> y(x.size()), dx(x.size());
  moe::GatedAttentionWorkspace ws;
  layer.forward_train({x.data(), T, D}, {y.data(), T, D}, ws);
  auto grads = layer.make_gradients();
  layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads);
  moe::io::SafetensorsFile const out(dir / "y.safetensors");
  auto close = [](std::vector<float> const& got, std::vector<float> const& want) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(got[i] == Approx(want[i]).epsilon(1e-5).margin(1e-6));
    }
  };
  close(moe::io::to_float(out.tensor("y")), y);
  close(moe::io::to_float(out.tensor("dx")), dx);
  for (auto const& t : moe::io::hf_attention_tensors(c, 1)) {
    INFO(t.name);
    moe::io::TensorView const& g = out.tensor("grad." + t.name);
    REQUIRE(g.shape == t.shape);
    close(moe::io::to_float(g), moe::io::hf_attention_gradient(grads, t));
  }
  REQUIRE(out.size() == 2 + 6);

  // Bad input: exit 1 and one line naming the problem.
  REQUIRE(run(base + " --layer 0") == 1);
  std::string const err = [&] {
    std::vector<std::byte> const b = iotest::read_file(dir / "stderr.txt");
    return std::string(reinterpret_cast<char const*>(b.data()), b.size());
  }();
  REQUIRE_THAT(err, Contains("moe_run_hf_attention: ") && Contains("linear_attention"));
  REQUIRE(std::count(err.begin(), err.end(), '\n') == 1);
  REQUIRE(run(base + " --layer 1 --threads 0") == 1);
  REQUIRE(run("--layer 1") == 1);
}
#endif
