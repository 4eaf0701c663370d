// SPDX-License-Identifier: Apache-2.0
// Differential libFuzzer target for MoeFfn: the input bytes decode into a small layer (router
// policy, E, k, groups, capacity, top-p threshold, shared experts, T, D, F, weight format,
// routing controls) whose weights come from a seeded RNG. Configurations that the policies'
// documented preconditions rule out must be rejected with moe::Error; the others must run, and
//   - the router logits equal x W_r^T (+ logit_offset, -inf where masked) within 1e-4,
//   - the routing equals the naive double reference of tests/support/reference.hpp (run on the
//     layer's own logits, so near-ties are judged the same way; a routing that only a tiny
//     perturbation of the reference's inputs reproduces is a near-tie and accepted),
//   - y equals the double reference forward of that routing (tests/support/layer_reference.hpp)
//     within 2e-5 (fp32) or 1e-2 (bf16 panels) of max |y|,
//   - y is bitwise the same for 1 and 2 threads and from a reused workspace.
// Anything else (a crash, a sanitizer report, another exception, a mismatch) aborts. Built with
// clang -fsanitize=fuzzer,address,undefined by the "fuzz: moe_ffn libFuzzer" test, and with the
// normal compiler into moe_fuzz_replay_moe_ffn (tests/fuzz/replay_main.cpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/capacity.hpp"
#include "moe/routing/controls.hpp"
#include "moe/routing/expert_choice.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/one_per_group_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/top_k_softmax.hpp"
#include "moe/routing/top_p.hpp"
#include "support/layer_reference.hpp"

namespace {

using moe::ConstMatrixView;
using moe::Index;
using moe::MatrixView;
namespace routing = moe::routing;
namespace experts = moe::experts;

// A broken invariant: say which, and abort, so that libFuzzer and the sanitizers record the
// input.
[[noreturn]] void fail(char const* what, int line) {
  std::fprintf(stderr, "fuzz_moe_ffn.cpp:%d: %s does not hold\n", line, what);
  std::abort();
}
#define MOE_FUZZ_REQUIRE(...) ((__VA_ARGS__) ? void() : fail(#__VA_ARGS__, __LINE__))

struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

/// Reads the input front to back; zeros once it is exhausted.
class Bytes {
 public:
  Bytes(std::uint8_t const* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t next() { return pos_ < size_ ? data_[pos_++] : 0; }
  Index below(Index n) { return n <= 0 ? 0 : static_cast<Index>(next()) % n; }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = v << 8 | next();
    return v;
  }

 private:
  std::uint8_t const* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// A float parameter from one byte: code < 250 maps linearly onto [lo, lo + 250 * step), the
// rest are the special values that validate() must catch or cope with. `huge` is what the
// routing weights can take without overflowing when scale and a multiplier are both huge.
float decode(std::uint8_t code, float lo, float step, float huge = 1e30f) {
  switch (code) {
    case 250:
      return std::numeric_limits<float>::quiet_NaN();
    case 251:
      return std::numeric_limits<float>::infinity();
    case 252:
      return -std::numeric_limits<float>::infinity();
    case 253:
      return 0.0f;
    case 254:
      return huge;
    case 255:
      return -0.0f;
    default:
      return lo + static_cast<float>(code) * step;
  }
}

bool finite(float v) { return std::isfinite(v); }

enum class Kind : std::uint8_t {
  kSoftmaxTopK,
  kTopKSoftmax,
  kGroupLimited,
  kOnePerGroup,
  kExpertChoice,
  kTopP,
  kCapacity,
  kCount
};

/// Everything the input decodes into.
struct Config {
  Kind kind = Kind::kSoftmaxTopK;
  int variant = 0;  // SoftmaxTopK only: 0 no shared experts, 1 gated ones, 2 ungated ones
  Index E = 0, k = 0, n_group = 0, topk_group = 0, min_capacity = 0, max_experts = 0;
  bool normalize = false, sigmoid = true, top_two_sum = true, prioritized = false;
  float scale = 1.0f, threshold = 0.5f, capacity_factor = 1.0f;
  std::vector<float> bias;
  Index T = 0, D = 1, F = 1, shared_count = 0, shared_F = 1;
  int format = 0;     // 0: unpacked fp32, 1: packed fp32, 2: packed bf16
  bool grid = false;  // weights and x on a coarse grid: exact logits, exact ties
  std::vector<float> offset, multiplier;
  std::vector<std::uint8_t> mask;
  std::uint64_t seed = 0;
};

Config decode_config(Bytes& in) {
  Config c;
  c.kind = static_cast<Kind>(in.below(static_cast<Index>(Kind::kCount)));
  c.variant = static_cast<int>(in.below(3));
  c.E = in.below(10);  // 0 is invalid
  if (in.below(4) == 0) c.E = 12 + 4 * in.below(2);
  c.k = in.below(c.E + 3) - 1;
  c.n_group = in.below(c.E + 2);
  c.topk_group = in.below(c.n_group + 2);
  std::uint8_t const flags = in.next();
  c.normalize = flags & 1;
  c.sigmoid = (flags & 2) == 0;
  c.top_two_sum = (flags & 4) == 0;
  c.prioritized = (flags & 8) != 0;
  c.grid = (flags & 16) != 0;
  c.format = (flags >> 5) % 3;
  c.scale = decode(in.next(), -1.0f, 1.0f / 64, 1e15f);
  c.threshold = decode(in.next(), -0.1f, 1.0f / 200);
  c.capacity_factor = decode(in.next(), -0.5f, 1.0f / 64);
  c.min_capacity = in.below(8) - 1;
  c.max_experts = in.below(c.E + 3) - 1;
  c.T = in.below(18);
  c.D = 1 + in.below(in.below(4) == 0 ? 40 : 12);
  c.F = 1 + in.below(in.below(4) == 0 ? 40 : 10);
  c.shared_count = in.below(3);
  c.shared_F = 1 + in.below(9);
  std::uint8_t const controls = in.next();
  auto size_of = [&](int bits) -> Index {
    switch (bits & 3) {
      case 0:
        return 0;
      case 3:
        return std::max<Index>(0, c.E + (in.below(2) == 0 ? -1 : 1));  // wrong size
      default:
        return c.E;
    }
  };
  Index const n_bias = size_of(controls), n_offset = size_of(controls >> 2),
              n_mult = size_of(controls >> 4), n_mask = size_of(controls >> 6);
  c.seed = in.u64();
  for (Index e = 0; e < n_bias; ++e) c.bias.push_back(decode(in.next(), -2.0f, 1.0f / 64));
  for (Index e = 0; e < n_offset; ++e) c.offset.push_back(decode(in.next(), -4.0f, 1.0f / 32));
  for (Index e = 0; e < n_mult; ++e)
    c.multiplier.push_back(decode(in.next(), -1.0f, 1.0f / 64, 1e15f));
  for (Index e = 0; e < n_mask; ++e) c.mask.push_back(in.below(4) == 0 ? 0 : 1);
  return c;
}

/// The documented preconditions (the routers' validate(), RoutingControls::validate()).
// The routed scaling factor the routers accept (routing::detail::check_scale).
bool scale_ok(float s) { return s > 0.0f && s <= 1e6f; }

bool valid(Config const& c) {
  bool const token_choice = c.kind != Kind::kExpertChoice && c.kind != Kind::kTopP;
  if (c.E < 1) return false;
  if (token_choice && (c.k < 1 || c.k > c.E)) return false;
  switch (c.kind) {
    case Kind::kSoftmaxTopK:
      if (!scale_ok(c.scale)) return false;
      break;
    case Kind::kTopKSoftmax:
      break;
    case Kind::kGroupLimited:
      if (c.n_group < 1 || c.E % c.n_group != 0) return false;
      if (c.topk_group < 1 || c.topk_group > c.n_group) return false;
      if (c.k > c.topk_group * (c.E / c.n_group)) return false;
      if (!c.bias.empty() && static_cast<Index>(c.bias.size()) != c.E) return false;
      if (!std::all_of(c.bias.begin(), c.bias.end(), finite) || !scale_ok(c.scale)) return false;
      break;
    case Kind::kOnePerGroup:
      if (c.n_group < 1 || c.E % c.n_group != 0 || c.k > c.n_group) return false;
      if (!scale_ok(c.scale)) return false;
      break;
    case Kind::kExpertChoice:
    case Kind::kCapacity:
      // +inf (or any factor with C >= T) means no limit.
      if (!(c.capacity_factor > 0.0f) || c.min_capacity < 0) return false;
      if (c.kind == Kind::kCapacity && !scale_ok(c.scale)) return false;
      break;
    case Kind::kTopP:
      if (!(c.threshold >= 0.0f && c.threshold <= 1.0f)) return false;
      if (c.max_experts < 0 || c.max_experts > c.E) return false;
      break;
    case Kind::kCount:
      return false;
  }
  auto size_ok = [&](std::size_t n) { return n == 0 || static_cast<Index>(n) == c.E; };
  if (!size_ok(c.offset.size()) || !size_ok(c.multiplier.size()) || !size_ok(c.mask.size())) {
    return false;
  }
  if (!std::all_of(c.offset.begin(), c.offset.end(), finite)) return false;
  if (!std::all_of(c.multiplier.begin(), c.multiplier.end(), finite)) return false;
  if (!c.mask.empty() && std::count(c.mask.begin(), c.mask.end(), 0) == c.E) return false;
  return true;
}

routing::SoftmaxTopK softmax_top_k(Config const& c) { return {c.E, c.k, c.normalize, c.scale}; }

template <class Router>
Router make_router(Config const& c) {
  if constexpr (std::is_same_v<Router, routing::SoftmaxTopK>) {
    return softmax_top_k(c);
  } else if constexpr (std::is_same_v<Router, routing::TopKSoftmax>) {
    return {c.E, c.k};
  } else if constexpr (std::is_same_v<Router, routing::GroupLimitedTopK>) {
    routing::GroupLimitedTopK r;
    r.num_experts = c.E;
    r.top_k = c.k;
    r.n_group = c.n_group;
    r.topk_group = c.topk_group;
    r.normalize = c.normalize;
    r.scale = c.scale;
    r.scoring = c.sigmoid ? routing::ScoreFunction::kSigmoid : routing::ScoreFunction::kSoftmax;
    r.group_score = c.top_two_sum ? routing::GroupScore::kTopTwoSum : routing::GroupScore::kMax;
    r.bias = c.bias;
    return r;
  } else if constexpr (std::is_same_v<Router, routing::OnePerGroupTopK>) {
    return {c.E, c.k, c.n_group, c.normalize, c.scale, routing::ScoreFunction::kSoftmax};
  } else if constexpr (std::is_same_v<Router, routing::ExpertChoice>) {
    return {c.E, c.capacity_factor, c.min_capacity};
  } else if constexpr (std::is_same_v<Router, routing::TopP>) {
    return {c.E, c.threshold, c.max_experts, c.normalize};
  } else {
    return {softmax_top_k(c), c.capacity_factor, c.min_capacity, c.prioritized};
  }
}

/// C of ExpertChoice / WithCapacity, from their documentation (saturating at 2^62).
Index capacity(Config const& c, bool at_most_t) {
  double const v = std::nearbyint(static_cast<double>(c.capacity_factor) *
                                  static_cast<double>(c.T) / static_cast<double>(c.E));
  Index const cap = std::max(v < 0x1p62 ? static_cast<Index>(v) : Index{1} << 62, c.min_capacity);
  return at_most_t ? std::min(c.T, cap) : cap;
}

/// The reference routing of `z` ([T, E], after the controls) for the layer `c` describes.
/// `bias` and `threshold` are passed separately so that the caller can perturb them.
ref::Routing reference_routing(Config const& c, ConstMatrixView<double> z,
                               std::vector<float> const& bias, double threshold,
                               std::vector<float> const& priority = {}) {
  ref::Routing r;
  switch (c.kind) {
    case Kind::kSoftmaxTopK:
      r = ref::softmax_top_k(z, static_cast<int>(c.k), c.normalize, c.scale);
      break;
    case Kind::kTopKSoftmax:
      r = ref::softmax_top_k(z, static_cast<int>(c.k), true, 1.0);
      break;
    case Kind::kGroupLimited:
      r = ref::group_limited(z, static_cast<int>(c.k), static_cast<int>(c.n_group),
                             static_cast<int>(c.topk_group), c.normalize, c.scale, c.sigmoid, bias,
                             c.top_two_sum);
      break;
    case Kind::kOnePerGroup:
      r = ref::one_per_group(z, static_cast<int>(c.k), static_cast<int>(c.n_group), c.normalize);
      for (auto& token : r) {
        for (auto& [e, w] : token) w *= c.scale;
      }
      break;
    case Kind::kExpertChoice:
      r = ref::expert_choice(z, capacity(c, true));
      break;
    case Kind::kTopP: {
      r = ref::top_p(z, threshold);
      for (auto& token : r) {
        if (c.max_experts > 0 && static_cast<Index>(token.size()) > c.max_experts) {
          token.erase(token.begin() + c.max_experts, token.end());
        }
        double sum = 0.0;
        for (auto const& [e, w] : token) sum += w;
        if (c.normalize) {
          for (auto& [e, w] : token) w /= sum;
        }
      }
      break;
    }
    case Kind::kCapacity: {
      // `priority`: the layer's own float slot-0 weights, which order the tokens of a batch-
      // prioritized capacity (tokens whose weights tie in exact arithmetic are ordered by float
      // rounding). The reference orders by them, then gets its own weights back.
      Index dropped = 0;
      r = ref::softmax_top_k(z, static_cast<int>(c.k), c.normalize, c.scale);
      ref::Routing const own = r;
      for (std::size_t t = 0; t < priority.size() && t < r.size(); ++t) {
        if (!r[t].empty()) r[t][0].second = priority[t];
      }
      r = ref::with_capacity(r, c.E, capacity(c, false), c.prioritized, &dropped);
      for (std::size_t t = 0; t < r.size(); ++t) {
        for (auto& [e, w] : r[t]) {
          for (auto const& [oe, ow] : own[t]) {
            if (oe == e) w = ow;
          }
        }
      }
      break;
    }
    case Kind::kCount:
      break;
  }
  if (!c.multiplier.empty()) {
    for (auto& token : r) {
      for (auto& [e, w] : token) w *= c.multiplier[static_cast<std::size_t>(e)];
    }
  }
  return r;
}

/// Same experts in the same slot order; weights within tol (relative to max(1, |w|)).
bool same_token(ref::TokenChoice const& got, ref::TokenChoice const& want, double tol) {
  if (got.size() != want.size()) return false;
  for (std::size_t s = 0; s < got.size(); ++s) {
    if (got[s].first != want[s].first) return false;
    double const w = want[s].second;
    if (!(std::fabs(got[s].second - w) <= tol * std::max(1.0, std::fabs(w)))) return false;
  }
  return true;
}

/// Does the reference, run on the layer's logits or on a tiny perturbation of them (and of the
/// bias and threshold), give the layer's routing? Perturbations of 1e-5 decide the near-ties
/// that float and double arithmetic may break differently; they cannot explain a real error.
/// Each perturbation is a function of the value it perturbs, so exact ties (which both sides
/// break by index) stay ties.
/// Routers that decide each token alone are matched token by token (each token's near-ties
/// by any perturbation); expert choice and capacity couple the tokens, so one perturbation must
/// explain the whole batch.
bool routing_matches(Config const& c, std::vector<float> const& logits, ref::Routing const& got) {
  bool const coupled = c.kind == Kind::kExpertChoice || c.kind == Kind::kCapacity;
  std::vector<double> z(logits.begin(), logits.end());
  ConstMatrixView<double> zv(z.data(), c.T, c.E);
  std::vector<bool> matched(got.size(), false);
  auto match = [&](ref::Routing const& want, double tol) {
    if (want.size() != got.size()) return false;
    bool all = true;
    for (std::size_t t = 0; t < got.size(); ++t) {
      bool const same = same_token(got[t], want[t], tol);
      all = all && same;
      if (!coupled && same) matched[t] = true;
    }
    return all || std::all_of(matched.begin(), matched.end(), [](bool m) { return m; });
  };
  std::vector<float> priority;
  if (c.kind == Kind::kCapacity && c.prioritized) {
    moe::Selection inner;
    softmax_top_k(c).select(ConstMatrixView<float>(logits.data(), c.T, c.E), inner);
    for (Index t = 0; t < c.T; ++t) priority.push_back(inner.weight_row(t)[0]);
  }
  if (match(reference_routing(c, zv, c.bias, c.threshold, priority), 1e-5)) return true;
  constexpr double kEps = 1e-5;
  for (std::uint64_t trial = 1; trial <= 64; ++trial) {
    auto jitter = [&](float v) {  // in [-kEps, kEps), the same for equal values
      std::uint32_t bits = 0;
      std::memcpy(&bits, &v, sizeof bits);
      SplitMix64 h{(trial << 32 | bits) ^ c.seed};
      return kEps * (static_cast<double>(h.next() >> 11) * 0x1p-52 - 1.0);
    };
    for (std::size_t i = 0; i < z.size(); ++i) {
      z[i] = logits[i] == -INFINITY ? z[i] : logits[i] * (1.0 + jitter(logits[i]));
      if (logits[i] == 0.0f) z[i] = jitter(1e-30f);
    }
    std::vector<float> bias = c.bias;
    for (float& b : bias) b += static_cast<float>(jitter(b));
    if (match(reference_routing(c, zv, bias, c.threshold + jitter(c.threshold), priority), 1e-3)) {
      return true;
    }
  }
  return false;
}

template <class Layer>
void randomize(Layer& layer, Config const& c) {
  auto snap = [&](std::span<float> v, float step) {
    if (!c.grid) return;
    for (float& f : v) f = std::round(f / step) * step;
  };
  auto const fill = [&](std::span<float> v, float lo, float hi, std::uint64_t seed, float step) {
    moe::fill_uniform(v, lo, hi, seed);
    snap(v, step);
  };
  {
    auto edit = layer.experts().edit();
    fill(edit.parameters(), -0.5f, 0.5f, c.seed, 1.0f / 16);
  }
  auto wr = layer.router_weight();
  fill(std::span<float>(wr.data, static_cast<std::size_t>(wr.rows * wr.cols)), -0.5f, 0.5f,
       c.seed + 1, 1.0f / 8);
  if constexpr (Layer::Shared::has_experts) {
    {
      auto edit = layer.shared_experts().bank().edit();
      fill(edit.parameters(), -0.5f, 0.5f, c.seed + 2, 1.0f / 16);
    }
    if constexpr (Layer::Shared::gated) {
      auto g = layer.shared_experts().gate_weight();
      fill(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)), -0.5f, 0.5f,
           c.seed + 3, 1.0f / 8);
    }
  }
}

moe::ThreadPool& pool() {
  static moe::ThreadPool p(2);
  return p;
}

template <class Router, class Expert, class Shared>
int run(Config const& c) {
  using Layer = moe::MoeFfn<Router, Expert, Shared>;
  bool const ok = valid(c);
  Index const T = c.T, D = c.D, E = c.E;
  routing::RoutingControls controls;
  controls.logit_offset = c.offset;
  controls.weight_multiplier = c.multiplier;
  controls.expert_mask = c.mask;
  std::vector<float> x(static_cast<std::size_t>(T * D));
  moe::fill_uniform(x, -1.0f, 1.0f, c.seed + 4);
  if (c.grid) {
    for (float& v : x) v = std::round(v * 4) / 4;
  }
  ConstMatrixView<float> xv(x.data(), T, D);
  std::vector<float> y1(x.size()), y2(x.size()), y3(x.size());
  moe::MoeFfnWorkspace ws1, ws2;
  Layer layer;
  try {
    if constexpr (Shared::has_experts) {
      layer = Layer(D, c.F, make_router<Router>(c), Shared(c.shared_count, D, c.shared_F));
    } else {
      layer = Layer(D, c.F, make_router<Router>(c));
    }
    randomize(layer, c);
    if (c.format == 1) layer.pack_weights(experts::WeightFormat::kF32);
    if (c.format == 2) layer.pack_weights(experts::WeightFormat::kBf16);
    layer.forward(xv, {y1.data(), T, D}, ws1, {&controls, nullptr});
  } catch (moe::Error const&) {
    MOE_FUZZ_REQUIRE(!ok);  // a valid configuration was refused
    return 0;
  }
  MOE_FUZZ_REQUIRE(ok);  // an invalid configuration ran
  layer.forward(xv, {y2.data(), T, D}, ws2, {&controls, &pool()});
  layer.forward(xv, {y3.data(), T, D}, ws2, {&controls, nullptr});
  MOE_FUZZ_REQUIRE(x.empty() || std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
  MOE_FUZZ_REQUIRE(x.empty() || std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)) == 0);

  // Logits: x W_r^T, then the controls.
  std::vector<float> want_logits = ref::logits(xv, std::as_const(layer).router_weight());
  MOE_FUZZ_REQUIRE(ws1.logits.size() == want_logits.size());
  for (std::size_t i = 0; i < want_logits.size(); ++i) {
    auto const e = static_cast<std::size_t>(static_cast<Index>(i) % E);
    float want = want_logits[i] + (c.offset.empty() ? 0.0f : c.offset[e]);
    if (!c.mask.empty() && c.mask[e] == 0) want = -INFINITY;
    float const got = ws1.logits[i];
    MOE_FUZZ_REQUIRE(want == -INFINITY ? got == -INFINITY : std::fabs(got - want) <= 1e-4f);
  }

  // Routing: the reference on the layer's own logits.
  ref::Routing got(static_cast<std::size_t>(T));
  moe::Selection const& sel = ws1.selection;
  MOE_FUZZ_REQUIRE(sel.num_tokens == T && sel.num_experts == E);
  for (Index t = 0; t < T; ++t) {
    for (Index s = 0; s < sel.slots; ++s) {
      moe::ExpertId const e = sel.expert[static_cast<std::size_t>(t * sel.slots + s)];
      MOE_FUZZ_REQUIRE(e >= -1 && e < E);
      if (e >= 0) got[t].emplace_back(e, sel.weight[static_cast<std::size_t>(t * sel.slots + s)]);
    }
  }
  MOE_FUZZ_REQUIRE(routing_matches(c, ws1.logits, got));

  // Output: the double forward of that routing, within fp32 (bf16) rounding of the terms that
  // make each element: `bound` is the same forward with |x|, |weights| and |routing weights|,
  // at least the sum of the terms' magnitudes (the activations are monotone and |act(v)| <=
  // act(|v|)), so cancellation in y cannot fail an exact result.
  bool const bf16 = c.format == 2;
  ref::Bf16Rounding const rounding{bf16, bf16 && moe::kernels::bf16_dot_products()};
  std::vector<double> const want = ref::layer_forward(std::as_const(layer), xv, got, rounding);
  Layer magnitude = layer;
  auto absolute = [](std::span<float> v) {
    for (float& f : v) f = std::fabs(f);
  };
  absolute(magnitude.experts().edit().parameters());
  if constexpr (Shared::has_experts) {
    absolute(magnitude.shared_experts().bank().edit().parameters());
    if constexpr (Shared::gated) {
      auto g = magnitude.shared_experts().gate_weight();
      absolute(std::span<float>(g.data, static_cast<std::size_t>(g.rows * g.cols)));
    }
  }
  std::vector<float> x_abs(x);
  absolute(x_abs);
  ref::Routing got_abs = got;
  for (auto& token : got_abs) {
    for (auto& [e, w] : token) w = std::fabs(w);
  }
  std::vector<double> const bound = ref::layer_forward(
      std::as_const(magnitude), ConstMatrixView<float>(x_abs.data(), T, D), got_abs);
  double scale = 1.0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (std::size_t i = 0; i < want.size(); ++i) {
    MOE_FUZZ_REQUIRE(std::isfinite(y1[i]));
    double const tol = bf16 ? 2e-2 * bound[i] + 2e-5 * scale : 1e-5 * bound[i] + 2e-5 * scale;
    MOE_FUZZ_REQUIRE(std::fabs(y1[i] - want[i]) <= tol);
  }
  return 1;
}

using SwiGlu = experts::SwiGlu;
using Gated = experts::GatedSharedExperts<experts::SwiGlu>;
using Ungated = experts::UngatedSharedExperts<experts::SwiGlu>;

}  // namespace

/// Decodes `data` into a layer and checks it; returns 1 if the configuration was valid (and
/// ran), 0 if it was rejected. Every MoeFfn type costs seconds of compile time, so only
/// SoftmaxTopK comes with each shared-expert kind; each other policy with one of them (the
/// shared experts do not depend on the routing).
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  Bytes in(data, size);
  Config const c = decode_config(in);
  switch (c.kind) {
    case Kind::kSoftmaxTopK:
      if (c.variant == 1) return run<routing::SoftmaxTopK, experts::GeluMlp, Gated>(c);
      if (c.variant == 2) return run<routing::SoftmaxTopK, SwiGlu, Ungated>(c);
      return run<routing::SoftmaxTopK, SwiGlu, experts::NoSharedExperts>(c);
    case Kind::kTopKSoftmax:
      return run<routing::TopKSoftmax, SwiGlu, experts::NoSharedExperts>(c);
    case Kind::kGroupLimited:
      return run<routing::GroupLimitedTopK, SwiGlu, Ungated>(c);
    case Kind::kOnePerGroup:
      return run<routing::OnePerGroupTopK, experts::GeluMlp, Gated>(c);
    case Kind::kExpertChoice:
      return run<routing::ExpertChoice, SwiGlu, Ungated>(c);
    case Kind::kTopP:
      return run<routing::TopP, experts::GeluMlp, Gated>(c);
    default:
      return run<routing::WithCapacity<routing::SoftmaxTopK>, SwiGlu, experts::NoSharedExperts>(c);
  }
}
extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
