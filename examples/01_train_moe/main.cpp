// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// 01_train_moe: train a small MoE layer with AdamW under three routing schemes, watch the load.
//
// What it shows:
//   - a training loop: MoeFfn::forward_train, an MSE loss, backward into Gradients,
//     optim::AdamW::step(layer.parameters(), grads.groups(), &pool), layer.end_step();
//   - a task that rewards specialisation: x = mu_c + noise (uniform in [-0.5, 0.5)) comes from one
//     of C clusters (random centres mu_c), the target is y = x + A_c x with a random matrix A_c per
//     cluster; the model is y_hat = x + MoE(x) (residual), E SwiGLU experts, top-2;
//   - three variants on the same data, seed and initial weights:
//       softmax   routing::SoftmaxTopK: softmax over the experts, top-2, weights renormalised;
//       default   the same router with Default MoE (layer.default_moe(): dense router gradient);
//       aux-free  routing::GroupLimitedTopK (one group, softmax scores, renormalised, so the same
//                 routing as `softmax` at bias 0) + balance::AuxFreeBias, DeepSeek-V3's
//                 auxiliary-loss-free balancing through a selection-only bias;
//   - routing_stats per step: imbalance = max / mean tokens per expert (1 = balanced).
// Output: a progress line every few steps, DIR/train_load.csv (variant, step, loss, imbalance,
// load share of each expert), DIR/train_load.svg (one heatmap per variant on a white background:
// x = training step, y = expert, with ticks and axis labels; colour = load share x E on a log
// scale, explained by a colour bar with its scale and the run's min and max), and a summary table
// whose legend says what each column is (final = mean over the last 10% of the steps).
//
// Command line:
//   cmake --preset release && cmake --build build/release --target moe_train_example
//   ./build/release/examples/moe_train_example [--small] [--out DIR]    (DIR defaults to ".")
//   default: D 32, E 8, 300 steps (about a second); --small: D 16, E 4, 60 steps (the ctest test).
//   --help / -h lists the options, one line each.
// Exit status: 0 on success (and for --help); 1 if a variant's final loss is not below half its
// initial loss (see kMaxLossRatio) or moe reports an error; 2 on an unknown argument or --out
// without a directory (one line on stderr).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "../common/cli.hpp"
#include "moe/balance/aux_free_bias.hpp"
#include "moe/core/random.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/optim/adamw.hpp"
#include "moe/routing/group_limited_top_k.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "moe/routing/stats.hpp"

namespace {

using moe::Index;
namespace routing = moe::routing;

// Pass mark: final loss (mean of the last 10% of steps) < kMaxLossRatio * initial loss (step 0).
// With --small every variant ends at about 0.18 of its initial loss at these seeds, and at 0.16 to
// 0.24 over six other seed sets (the run is deterministic for a given build), so a failure means a
// broken training step, not an unlucky draw.
constexpr double kMaxLossRatio = 0.5;

struct Sizes {
  Index D, F, E, C, T;  // d_model, d_ffn, experts, clusters, tokens per step
  int steps, print_every;
};

/// The data: C clusters with random centres [C, D] and random maps A_c [C, D, D].
struct Task {
  Index D, C;
  std::vector<float> centres, maps;
  Task(Index d, Index c) : D(d), C(c), centres(c * d), maps(c * d * d) {
    moe::fill_uniform(centres, -1.0f, 1.0f, 100);
    float const b = std::sqrt(3.0f / static_cast<float>(D));  // |A_c x| ~ |x|
    moe::fill_uniform(maps, -b, b, 101);
  }
  /// The batch of step `step` (the same for every variant): x, y [T, D].
  void batch(int step, Index T, std::vector<float>& x, std::vector<float>& y) const {
    std::vector<float> pick(T);
    moe::fill_uniform(pick, 0.0f, static_cast<float>(C), 1000 + 2 * step);
    moe::fill_uniform(x, -0.5f, 0.5f, 1001 + 2 * step);  // noise, then + centre
    for (Index t = 0; t < T; ++t) {
      Index const c = std::min(C - 1, static_cast<Index>(pick[t]));
      float* xt = x.data() + t * D;
      for (Index i = 0; i < D; ++i) xt[i] += centres[c * D + i];
      for (Index i = 0; i < D; ++i) {
        float const* a = maps.data() + (c * D + i) * D;
        float s = xt[i];
        for (Index j = 0; j < D; ++j) s += a[j] * xt[j];
        y[t * D + i] = s;
      }
    }
  }
};

/// What we record per step, for the CSV, the heatmap and the summary.
struct History {
  std::string name;
  std::vector<double> loss, imbalance, share;  // share: [steps, E] load share of each expert
};

/// One model being trained: layer, optimizer, workspace, gradients, history. Every variant starts
/// from the same weights: uniform in [-1/sqrt(D), 1/sqrt(D)) from fixed seeds.
template <class Layer>
struct Variant {
  Layer layer;
  History h;
  moe::optim::AdamW opt{3e-3, 0.9, 0.999, 1e-8, 0.0};
  moe::MoeFfnWorkspace ws;
  typename Layer::Gradients grads = layer.make_gradients();
  std::vector<float> out, dy, dx;  // [T, D] MoE(x), dL/dMoE(x), dL/dx (unused here)

  Variant(char const* name, Layer l) : layer(std::move(l)), h{name, {}, {}, {}} {
    float const b = 1.0f / std::sqrt(static_cast<float>(layer.d_model()));
    auto w = layer.router_weight();
    moe::fill_uniform({w.data, static_cast<std::size_t>(w.rows * w.cols)}, -b, b, 1);
    moe::fill_uniform(layer.experts().edit().parameters(), -b, b, 2);
  }

  /// forward_train, loss, backward, AdamW, end_step; records loss and load.
  void step(std::vector<float> const& x, std::vector<float> const& y, moe::ThreadPool& pool) {
    Index const D = layer.d_model(), T = static_cast<Index>(x.size()) / D;
    for (auto* v : {&out, &dy, &dx}) v->resize(x.size());
    layer.forward_train({x.data(), T, D}, {out.data(), T, D}, ws, {.pool = &pool});
    // y_hat = x + MoE(x);  L = mean (y_hat - y)^2;  dL/dMoE(x) = 2 (y_hat - y) / (T D).
    double sum = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      float const r = x[i] + out[i] - y[i];
      sum += static_cast<double>(r) * r;
      dy[i] = 2.0f * r / static_cast<float>(x.size());
    }
    h.loss.push_back(sum / static_cast<double>(x.size()));
    auto const st = routing::routing_stats(ws.plan, ws.selection);
    h.imbalance.push_back(st.imbalance);
    for (Index n : st.tokens_per_expert) {
      h.share.push_back(static_cast<double>(n) / static_cast<double>(ws.plan.num_rows()));
    }
    grads.zero();
    layer.backward(ws, {dy.data(), T, D}, {dx.data(), T, D}, grads, &pool);
    opt.step(layer.parameters(), grads.groups(), &pool);
    layer.end_step();  // AuxFreeBias: bias += rate * sign(mean load - load); others: nothing
  }
};

double mean_tail(std::vector<double> const& v) {  // mean over the last 10% of the steps
  std::size_t const n = std::max<std::size_t>(1, v.size() / 10);
  double s = 0.0;
  for (std::size_t i = v.size() - n; i < v.size(); ++i) s += v[i];
  return s / static_cast<double>(n);
}

/// The heatmap's colour of v = share * E on a log scale: white at v = 1 (balanced), blue towards
/// v = 0 (idle), red towards v = E / k (every token); |log v| >= top is fully saturated.
struct LoadColour {
  double top;  // log of the saturating ratio, log(max(2, E / k))
  void write(std::ostream& f, double v) const {
    double const a = v <= 0.0 ? 1.0 : std::min(1.0, std::fabs(std::log(v)) / top);
    int const fade = static_cast<int>(255.0 * (1.0 - a));
    f << "rgb(" << (v < 1.0 ? fade : 255) << ',' << fade << ',' << (v < 1.0 ? 255 : fade) << ')';
  }
};

/// printf-formats one number.
std::string number(char const* format, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

/// Step between x tick labels: 1, 2, 5, 10, 20, 50, ... giving at most 10 ticks over `steps`.
int tick_step(int steps) {
  for (int base = 1;; base *= 10) {
    for (int m : {1, 2, 5}) {
      if (steps <= 10 * m * base) return m * base;
    }
  }
}

/// Heatmap, one panel per variant: x = training step, y = expert, colour = v = share * E (see
/// LoadColour), on a white background with a title, axes, ticks, axis labels and a colour bar
/// whose ticks give the scale (and the smallest and largest v of the run).
void write_svg(std::string const& path, std::vector<History const*> const& hs, Index E, Index k) {
  int const steps = static_cast<int>(hs[0]->loss.size()), cw = std::max(1, 600 / steps);
  int const ch = 14, rows = static_cast<int>(E) * ch, left = 70, top_margin = 40;
  int const panel = rows + 70;  // panel title, heatmap, x ticks and axis label
  int const width = left + steps * cw, bar_x = width + 40, bar_h = std::max(rows, 120);
  int const svg_w = bar_x + 200, svg_h = top_margin + panel * static_cast<int>(hs.size()) + 10;
  LoadColour const colour{std::log(std::max(2.0, static_cast<double>(E) / static_cast<double>(k)))};
  double v_min = 1e300, v_max = 0.0;
  for (auto* h : hs) {
    for (double share : h->share) {
      v_min = std::min(v_min, share * static_cast<double>(E));
      v_max = std::max(v_max, share * static_cast<double>(E));
    }
  }
  std::ofstream f(path);
  f << "<?xml version='1.0' encoding='UTF-8'?>\n"
    << "<svg xmlns='http://www.w3.org/2000/svg' width='" << svg_w << "' height='" << svg_h
    << "' viewBox='0 0 " << svg_w << ' ' << svg_h << "' font-family='sans-serif' font-size='11'>\n"
    << "<rect id='background' x='0' y='0' width='" << svg_w << "' height='" << svg_h
    << "' fill='white'/>\n"
    << "<text id='title' x='" << svg_w / 2 << "' y='20' text-anchor='middle' font-size='14'>"
    << "Expert load during training (E = " << E << ", top-" << k << "): load share x E per "
    << "step</text>\n";
  int const dx = tick_step(steps), de = std::max<Index>(1, (E + 15) / 16);
  for (std::size_t p = 0; p < hs.size(); ++p) {
    int const y0 = top_margin + static_cast<int>(p) * panel + 16;  // heatmap top
    f << "<text class='panel-title' x='" << left << "' y='" << y0 - 5 << "' font-weight='bold'>"
      << hs[p]->name << "</text>\n<g class='heatmap'>\n";
    for (int s = 0; s < steps; ++s) {
      for (Index e = 0; e < E; ++e) {
        f << "<rect x='" << left + s * cw << "' y='" << y0 + e * ch << "' width='" << cw
          << "' height='" << ch << "' fill='";
        colour.write(f, hs[p]->share[s * E + e] * static_cast<double>(E));
        f << "'/>\n";
      }
    }
    f << "</g>\n<g class='axes' stroke='black' fill='none'>\n"
      << "<rect x='" << left << "' y='" << y0 << "' width='" << steps * cw << "' height='" << rows
      << "'/>\n";
    for (int s = 0; s < steps; s += dx) {
      int const x = left + s * cw + cw / 2;
      f << "<line x1='" << x << "' y1='" << y0 + rows << "' x2='" << x << "' y2='" << y0 + rows + 4
        << "'/>\n";
    }
    for (Index e = 0; e < E; e += de) {
      int const y = static_cast<int>(y0 + e * ch + ch / 2);
      f << "<line x1='" << left - 4 << "' y1='" << y << "' x2='" << left << "' y2='" << y
        << "'/>\n";
    }
    f << "</g>\n<g class='tick-labels'>\n";
    for (int s = 0; s < steps; s += dx) {
      f << "<text class='x-tick' x='" << left + s * cw + cw / 2 << "' y='" << y0 + rows + 16
        << "' text-anchor='middle'>" << s << "</text>\n";
    }
    for (Index e = 0; e < E; e += de) {
      f << "<text class='y-tick' x='" << left - 7 << "' y='" << y0 + e * ch + ch / 2 + 4
        << "' text-anchor='end'>" << e << "</text>\n";
    }
    f << "</g>\n<text class='x-label' x='" << left + steps * cw / 2 << "' y='" << y0 + rows + 32
      << "' text-anchor='middle'>training step</text>\n"
      << "<text class='y-label' x='" << left - 38 << "' y='" << y0 + rows / 2
      << "' text-anchor='middle' transform='rotate(-90 " << left - 38 << ' ' << y0 + rows / 2
      << ")'>expert</text>\n";
  }
  // Colour bar: v on a log scale from exp(-top) (bottom, blue; smaller v are as blue) to
  // exp(top) (top, red), 1 (white) in the middle.
  int const bar_y = top_margin + 16, slices = 64;
  f << "<g class='colour-bar'>\n";
  for (int i = 0; i < slices; ++i) {
    double const lv = colour.top * (1.0 - 2.0 * (i + 0.5) / slices);
    f << "<rect x='" << bar_x << "' y='" << bar_y + i * bar_h / slices << "' width='16' height='"
      << bar_h / slices + 1 << "' fill='";
    colour.write(f, std::exp(lv));
    f << "'/>\n";
  }
  f << "<rect x='" << bar_x << "' y='" << bar_y << "' width='16' height='" << bar_h
    << "' fill='none' stroke='black'/>\n";
  double const hi = std::exp(colour.top);  // max(2, E / k); E / k: an expert takes every token
  struct Tick {
    double frac;  // 0 = top of the bar
    std::string text;
  };
  bool const full = hi == static_cast<double>(E) / static_cast<double>(k);
  std::vector<Tick> const ticks{{0.0, number("%.3g", hi) + (full ? " (every token)" : "")},
                                {0.5, "1 (balanced)"},
                                {1.0, "&lt;= " + number("%.3g", 1.0 / hi) + " (0: idle)"}};
  for (Tick const& t : ticks) {
    int const y = bar_y + static_cast<int>(t.frac * bar_h);
    f << "<line x1='" << bar_x + 16 << "' y1='" << y << "' x2='" << bar_x + 20 << "' y2='" << y
      << "' stroke='black'/>\n<text class='bar-tick' x='" << bar_x + 23 << "' y='" << y + 4 << "'>"
      << t.text << "</text>\n";
  }
  f << "<text class='bar-label' x='" << bar_x << "' y='" << bar_y + bar_h + 18
    << "'>load share x E (log scale)</text>\n<text class='bar-range' x='" << bar_x << "' y='"
    << bar_y + bar_h + 32 << "'>this run: min " << number("%.2f", v_min) << ", max "
    << number("%.2f", v_max) << "</text>\n</g>\n"
    << "</svg>\n";
}

int run(bool small, std::string const& dir) {
  Sizes const z = small ? Sizes{16, 32, 4, 4, 64, 60, 10} : Sizes{32, 64, 8, 8, 256, 300, 25};
  Index const k = 2;
  moe::ThreadPool pool(2);
  routing::GroupLimitedTopK aux_router;  // one group: plain top-k on softmax scores + bias
  aux_router.num_experts = z.E;
  aux_router.top_k = k;
  aux_router.scoring = routing::ScoreFunction::kSoftmax;
  using Plain = moe::MoeFfn<routing::SoftmaxTopK, moe::experts::SwiGlu>;
  using AuxFree = moe::MoeFfn<routing::GroupLimitedTopK, moe::experts::SwiGlu,
                              moe::experts::NoSharedExperts, moe::balance::AuxFreeBias>;
  routing::SoftmaxTopK const softmax{z.E, k, true, 1.0f};
  Variant<Plain> plain("softmax", Plain(z.D, z.F, softmax));
  Variant<Plain> dflt("default", Plain(z.D, z.F, softmax));
  dflt.layer.default_moe() = {true, 0.9f, moe::DefaultMoe::Mode::kGradOnly};
  Variant<AuxFree> aux("aux-free", AuxFree(z.D, z.F, aux_router, {}, {1e-3f, {}}));
  std::vector<History const*> const hs{&plain.h, &dflt.h, &aux.h};

  std::printf("MoE D %td, F %td, E %td, top-%td; %td clusters; %td tokens per step; %d steps\n",
              z.D, z.F, z.E, k, z.C, z.T, z.steps);
  Task const task(z.D, z.C);
  std::vector<float> x(z.T * z.D), y(x.size());
  for (int s = 0; s < z.steps; ++s) {
    task.batch(s, z.T, x, y);
    plain.step(x, y, pool);
    dflt.step(x, y, pool);
    aux.step(x, y, pool);
    if (s % z.print_every == 0 || s == z.steps - 1) {
      std::printf("step %4d  loss", s);
      for (auto* h : hs) std::printf("  %s %.4f", h->name.c_str(), h->loss.back());
      std::printf("  | imbalance");
      for (auto* h : hs) std::printf(" %.2f", h->imbalance.back());
      std::printf("\n");
    }
  }

  std::filesystem::create_directories(dir);
  std::ofstream csv(dir + "/train_load.csv");
  csv << "variant,step,loss,imbalance";
  for (Index e = 0; e < z.E; ++e) csv << ",share_" << e;
  csv << "\n";
  for (auto* h : hs) {
    for (int s = 0; s < z.steps; ++s) {
      csv << h->name << ',' << s << ',' << h->loss[s] << ',' << h->imbalance[s];
      for (Index e = 0; e < z.E; ++e) csv << ',' << h->share[s * z.E + e];
      csv << "\n";
    }
  }
  write_svg(dir + "/train_load.svg", hs, z.E, k);
  std::printf("wrote %s/train_load.csv and %s/train_load.svg\n\n", dir.c_str(), dir.c_str());

  int const tail = static_cast<int>(std::max<std::size_t>(1, plain.h.loss.size() / 10));
  std::printf(
      "Columns: initial loss = MSE at step 0; final loss = mean loss over the last 10%% of steps "
      "(steps %d-%d);\n"
      "final/initial = their ratio (pass: below %.2f); imbalance = max / mean tokens per expert "
      "(1 = balanced),\nmean over the same last 10%% of steps.\n",
      z.steps - tail, z.steps - 1, kMaxLossRatio);
  std::printf("%-10s %12s %22s %14s %22s\n", "variant", "initial loss", "final loss (last 10%)",
              "final/initial", "imbalance (last 10%)");
  bool ok = true;
  for (auto* h : hs) {
    double const first = h->loss.front(), last = mean_tail(h->loss);
    std::printf("%-10s %12.4f %22.4f %14.3f %22.3f\n", h->name.c_str(), first, last, last / first,
                mean_tail(h->imbalance));
    ok = ok && std::isfinite(last) && last < kMaxLossRatio * first;
  }
  if (!ok)
    std::fprintf(stderr, "error: a final loss is not below %.2f x its initial loss\n",
                 kMaxLossRatio);
  return ok ? 0 : 1;
}

constexpr moe_cli::Option kOptions[] = {
    {"--small", "D 16, E 4, 60 steps (the ctest run) instead of D 32, E 8, 300 steps"},
    {"--out DIR", "write train_load.csv and train_load.svg there (default: the current directory)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {"moe_train_example", "[--small] [--out DIR]", kOptions};

}  // namespace

int main(int argc, char** argv) {
  bool small = false;
  std::string dir = ".";
  for (int i = 1; i < argc; ++i) {
    if (moe_cli::is_help(argv[i])) return moe_cli::print_help(kUsage);
    if (std::strcmp(argv[i], "--small") == 0) {
      small = true;
    } else if (std::strcmp(argv[i], "--out") == 0) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "moe_train_example: --out needs a directory; %s\n",
                     "moe_train_example --help lists the options");
        return moe_cli::kExitUsage;
      }
      dir = argv[++i];
    } else {
      return moe_cli::print_unknown_argument(kUsage, argv[i]);
    }
  }
  try {
    return run(small, dir);
  } catch (std::exception const& e) {  // moe::Error: a precondition failed (message says which)
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
