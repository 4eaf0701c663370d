// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Choosing a weight format per expert projection: uniform, or AlphaQ (calibration-free mixed
/// precision from the weights' spectra, moe/quant/alphaq.hpp), with a report per expert.
///
/// AlphaQ here: every expert has two units, its in projection (gate and up) and its down
/// projection. Each unit gets alpha (the mean of its matrices' ht_alpha), an importance
/// w_u = (mean(alpha) / alpha_u)^p (more heavy-tailed: smaller alpha, more important; p =
/// QuantOptions::alpha_power, our parameterisation: the paper's exact weighting is not public in
/// a form we could check), and its error
/// under every candidate format, e_u(f) = ||W_u - deq_f(W_u)||_F^2 measured by quantizing it.
/// The formats minimise sum_u w_u e_u(f_u) under the average-bits budget, exactly
/// (quant::allocate_bits). Uniform: every projection in the candidate of most bits within the
/// budget (and the shapes). Both report alpha, the format, its bits and the relative error
/// ||W - deq(W)||_F / ||W||_F of every projection.
#pragma once

#include <algorithm>
#include <cmath>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/kernels/gemm_bf16.hpp"
#include "moe/quant/alphaq.hpp"
#include "moe/quant/matrix.hpp"

namespace moe::experts {

/// How plan_quantization chooses formats.
enum class AllocationMethod { kUniform, kAlphaQ };

/// One projection's part of a plan.
struct ProjectionReport {
  double alpha = 0;  ///< HT-SR alpha (mean over the projection's matrices)
  WeightFormat format = WeightFormat::kF32;
  double bits = 32;           ///< bits a weight of that format
  double relative_error = 0;  ///< ||W - deq(W)||_F / ||W||_F
};
/// One expert's part.
struct ExpertReport {
  ProjectionReport in, down;
};

/// Formats for every expert of a bank, with the report.
struct QuantPlan {
  std::vector<ExpertFormat> formats;  ///< for ExpertBank::pack
  std::vector<ExpertReport> experts;
  double average_bits = 0;  ///< over all expert weights
  /// AlphaQ's objective sum_u w_u e_u(f_u) of the chosen formats (for either method, so that
  /// plans compare).
  double objective = 0;
};

/// The default candidates: q2_k, q3_k, q4_0, q4_k, q5_k, q6_k, q8_0, bf16 (GGUF's common formats
/// and bf16).
inline std::vector<WeightFormat> default_candidates() {
  return {WeightFormat::kQ2_K, WeightFormat::kQ3_K, WeightFormat::kQ4_0, WeightFormat::kQ4_K,
          WeightFormat::kQ5_K, WeightFormat::kQ6_K, WeightFormat::kQ8_0, WeightFormat::kBf16};
}

/// Options of plan_quantization.
struct QuantOptions {
  std::vector<WeightFormat> candidates = default_candidates();
  /// p in the importance (mean(alpha) / alpha_u)^p. Squared quantization error falls ~4x a bit,
  /// so a unit moves 2 bits (q4 -> q6 -> q8) only when its importance is ~16x another's: with
  /// the alpha spread of real experts (~2 to ~6) that takes p ~ 3. p = 0: error-only allocation.
  double alpha_power = 3.0;
  ThreadPool* pool = nullptr;  ///< spectra and errors expert by expert on this pool
};

namespace detail {

/// Squared Frobenius error of w stored in format f (inf if f's blocks do not divide its rows).
inline double squared_error(ConstMatrixView<float> w, WeightFormat f) {
  if (f == WeightFormat::kF32) return 0.0;
  double se = 0;
  if (f == WeightFormat::kBf16) {
    for (Index r = 0; r < w.rows; ++r) {
      for (Index c = 0; c < w.cols; ++c) {
        double const e =
            static_cast<double>(w(r, c)) - kernels::bf16_to_float(kernels::float_to_bf16(w(r, c)));
        se += e * e;
      }
    }
    return se;
  }
  quant::Format const q = quant_format(f);
  if (w.cols % quant::block_elems(q) != 0) return std::numeric_limits<double>::infinity();
  std::vector<std::byte> buf(static_cast<std::size_t>(quant::row_bytes(q, w.cols)));
  std::vector<float> back(static_cast<std::size_t>(w.cols));
  for (Index r = 0; r < w.rows; ++r) {
    quant::quantize_row(q, w.row(r), w.cols, buf.data());
    quant::dequantize_row(q, buf.data(), w.cols, back.data());
    for (Index c = 0; c < w.cols; ++c) {
      double const e = static_cast<double>(w(r, c)) - back[static_cast<std::size_t>(c)];
      se += e * e;
    }
  }
  return se;
}

inline double squared_norm(ConstMatrixView<float> w) {
  double s = 0;
  for (Index r = 0; r < w.rows; ++r) {
    for (Index c = 0; c < w.cols; ++c) s += static_cast<double>(w(r, c)) * w(r, c);
  }
  return s;
}

}  // namespace detail

/// Chooses a format per expert projection of `bank` for an average of at most `average_bits`
/// bits a weight (see the file comment), among options.candidates. Spectra and errors are
/// computed expert by expert on options.pool. Throws moe::Error when no candidate fits the
/// budget or the shapes. Deterministic: the same bank, budget and candidates give the same plan.
template <class Bank>
QuantPlan plan_quantization(Bank const& bank, double average_bits, AllocationMethod method,
                            QuantOptions const& options = {}) {
  std::vector<WeightFormat> candidates = options.candidates;
  ThreadPool* const pool = options.pool;
  moe::detail::check(std::isfinite(options.alpha_power) && options.alpha_power >= 0,
                     "plan_quantization: alpha_power = ", options.alpha_power,
                     " must be finite and >= 0");
  Index const E = bank.num_experts(), F = static_cast<Index>(candidates.size());
  moe::detail::check(E >= 1, "plan_quantization: the bank has no experts");
  moe::detail::check(F >= 1, "plan_quantization: no candidate formats");
  std::sort(candidates.begin(), candidates.end(),
            [](WeightFormat a, WeightFormat b) { return bits_per_weight(a) < bits_per_weight(b); });
  // The shapes before the budget (and before any spectrum): a depth no candidate's blocks divide
  // is not cured by more bits; say which formats hold it. `min_bits`: the cheapest candidate
  // that holds each depth (what the budget must at least allow).
  double min_bits[2] = {};
  for (int unit = 0; unit < 2; ++unit) {
    Index const depth = unit == 0 ? bank.d_model() : bank.d_ffn();
    auto const held = std::find_if(candidates.begin(), candidates.end(),
                                   [&](WeightFormat f) { return holds_depth(f, depth); });
    if (held != candidates.end()) {
      min_bits[unit] = bits_per_weight(*held);
      continue;
    }
    std::string asked, holding;
    for (WeightFormat const f : candidates)
      asked += (asked.empty() ? "" : ", ") + std::string(name(f));
    auto hold = [&](WeightFormat f) {
      if (holds_depth(f, depth)) holding += (holding.empty() ? "" : ", ") + std::string(name(f));
    };
    for (auto f = std::rbegin(kBlockFormats); f != std::rend(kBlockFormats); ++f) hold(*f);
    hold(WeightFormat::kBf16);
    hold(WeightFormat::kF32);
    moe::detail::fail(
        "plan_quantization: no candidate format (", asked, ") holds the ",
        unit == 0 ? "in projections' depth d_model = " : "down projections' depth d_ffn = ", depth,
        ": their blocks do not divide it, so the shape is the problem, not the "
        "budget; add a format that holds it to the candidates (",
        holding, ")");
  }
  Index const F_rows = Bank::Expert::gated ? 2 : 1;
  auto matrices = [&](Index e, int unit) {
    std::vector<ConstMatrixView<float>> m;
    if (unit == 1) {
      m.push_back(bank.down_proj(e));
    } else {
      auto const in = bank.in_proj(e);
      for (Index h = 0; h < F_rows; ++h)
        m.push_back(in.middle_rows(h * bank.d_ffn(), bank.d_ffn()));
    }
    return m;
  };
  // Per unit (2 per expert): alpha, squared norm, squared error per candidate.
  std::vector<double> alpha(static_cast<std::size_t>(2 * E), 0.0), norm2(alpha.size(), 0.0);
  std::vector<std::vector<double>> err(alpha.size(),
                                       std::vector<double>(static_cast<std::size_t>(F)));
  parallel_for(pool, 2 * E, [&](Index u, int) {
    auto const ms = matrices(u / 2, static_cast<int>(u % 2));
    double a = 0;
    for (auto const& m : ms) {
      a += quant::ht_alpha(m).alpha;
      norm2[static_cast<std::size_t>(u)] += detail::squared_norm(m);
      for (Index f = 0; f < F; ++f) {
        err[static_cast<std::size_t>(u)][static_cast<std::size_t>(f)] +=
            detail::squared_error(m, candidates[static_cast<std::size_t>(f)]);
      }
    }
    alpha[static_cast<std::size_t>(u)] = a / static_cast<double>(ms.size());
  });
  Index const in_weights = F_rows * bank.d_ffn() * bank.d_model(),
              down_weights = bank.d_ffn() * bank.d_model();
  std::vector<int> choice(static_cast<std::size_t>(2 * E), 0);
  double mean_alpha = 0;
  for (double a : alpha) mean_alpha += a;
  mean_alpha /= static_cast<double>(alpha.size());
  auto importance = [&](Index u) {
    return std::pow(mean_alpha / alpha[static_cast<std::size_t>(u)], options.alpha_power);
  };
  QuantPlan plan;
  if (method == AllocationMethod::kUniform) {
    int best = -1;
    for (Index f = 0; f < F; ++f) {
      bool fits = bits_per_weight(candidates[static_cast<std::size_t>(f)]) <= average_bits + 1e-9;
      for (Index u = 0; u < 2 * E && fits; ++u) {
        fits = std::isfinite(err[static_cast<std::size_t>(u)][static_cast<std::size_t>(f)]);
      }
      if (fits) best = static_cast<int>(f);
    }
    moe::detail::check(best >= 0, "plan_quantization: no candidate format has at most ",
                       average_bits,
                       " bits a weight and fits the bank's shapes (d_model = ", bank.d_model(),
                       ", d_ffn = ", bank.d_ffn(), "); raise the budget to at least ",
                       std::max(min_bits[0], min_bits[1]), " bits");
    std::fill(choice.begin(), choice.end(), best);
    for (Index u = 0; u < 2 * E; ++u) {
      plan.objective +=
          importance(u) * err[static_cast<std::size_t>(u)][static_cast<std::size_t>(best)];
    }
    plan.average_bits = bits_per_weight(candidates[static_cast<std::size_t>(best)]);
  } else {
    std::vector<quant::AllocationUnit> units(static_cast<std::size_t>(2 * E));
    for (Index u = 0; u < 2 * E; ++u) {
      auto& un = units[static_cast<std::size_t>(u)];
      un.weights = u % 2 == 0 ? in_weights : down_weights;
      un.importance = importance(u);
      un.errors = err[static_cast<std::size_t>(u)];
    }
    std::vector<double> bits;
    for (WeightFormat f : candidates) bits.push_back(bits_per_weight(f));
    quant::Allocation const a = quant::allocate_bits(units, bits, average_bits);
    double const least = (static_cast<double>(in_weights) * min_bits[0] +
                          static_cast<double>(down_weights) * min_bits[1]) /
                         static_cast<double>(in_weights + down_weights);
    moe::detail::check(std::isfinite(a.objective), "plan_quantization: no choice of ",
                       "formats fits both the budget of ", average_bits,
                       " bits a weight and the bank's shapes (d_model = ", bank.d_model(),
                       ", d_ffn = ", bank.d_ffn(), "); raise the budget to at least ", least,
                       " bits");
    choice = a.choice;
    plan.objective = a.objective;
    plan.average_bits = a.average_bits;
  }
  plan.formats.resize(static_cast<std::size_t>(E));
  plan.experts.resize(static_cast<std::size_t>(E));
  for (Index u = 0; u < 2 * E; ++u) {
    WeightFormat const f =
        candidates[static_cast<std::size_t>(choice[static_cast<std::size_t>(u)])];
    ProjectionReport r;
    r.alpha = alpha[static_cast<std::size_t>(u)];
    r.format = f;
    r.bits = bits_per_weight(f);
    double const n2 = norm2[static_cast<std::size_t>(u)];
    r.relative_error =
        n2 > 0 ? std::sqrt(err[static_cast<std::size_t>(u)]
                              [static_cast<std::size_t>(choice[static_cast<std::size_t>(u)])] /
                           n2)
               : 0.0;
    auto& ex = plan.experts[static_cast<std::size_t>(u / 2)];
    auto& fm = plan.formats[static_cast<std::size_t>(u / 2)];
    if (u % 2 == 0) {
      ex.in = r;
      fm.in = f;
    } else {
      ex.down = r;
      fm.down = f;
    }
  }
  return plan;
}

}  // namespace moe::experts
