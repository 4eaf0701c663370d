// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// AlphaQ building blocks (calibration-free mixed precision, Yang et al. 2026): the HT-SR metric
/// alpha of a weight matrix, and the exact bit allocation that minimises an importance-weighted
/// total quantization error under an average-bits budget.
///
/// alpha (Heavy-Tailed Self-Regularization, Martin & Mahoney; fitted as WeightWatcher does): the
/// eigenvalues lambda of W^T W (its empirical spectral density) have a power-law tail
/// p(lambda) ~ lambda^-alpha for lambda >= x_min. For every candidate x_min among the eigenvalues
/// (all but the largest), the maximum-likelihood exponent of the tail is
///   alpha = 1 + n / sum_{lambda_i >= x_min} ln(lambda_i / x_min)      (n = tail size)
/// and x_min is the candidate whose fit has the smallest Kolmogorov-Smirnov distance
///   D = max_i |F_n(lambda_i) - (1 - (lambda_i / x_min)^(1 - alpha))|  (both sides of each step)
/// between the tail's empirical CDF and the fitted one (Clauset, Shalizi & Newman 2009). Small
/// alpha (2-4) is a heavy tail (a well-trained layer by HT-SR); a random Gaussian matrix has a
/// Marchenko-Pastur spectrum, whose "tail" fits a large alpha.
///
/// Allocation: units u (e.g. each expert's projections) of n_u weights, a candidate set of formats
/// with bits b_f, a measured error e_u(f) per unit and format, and an importance w_u; choose f_u
/// to minimise sum_u w_u e_u(f_u) subject to sum_u n_u b_{f_u} <= B sum_u n_u. Solved exactly by
/// dynamic programming over units and the budget in integer steps (bits are multiples of 1/32 and
/// n_u multiples of a common unit), a multiple-choice knapsack: O(U x F x budget steps).
#pragma once

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/core/views.hpp"

namespace moe::quant {

/// The eigenvalues of W^T W for W [m, n] (the non-zero ones are those of W W^T: the smaller Gram
/// matrix is decomposed, in Real: double unless given), ascending; min(m, n) values. A template
/// so that Eigen's eigensolver is compiled only in the translation units that call it (an inline
/// function would instantiate it in every one that includes this header: ~4 s of compile each).
template <class Real = double>
std::vector<double> spectrum(ConstMatrixView<float> w) {
  using Matrix = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic>;
  moe::detail::check(w.rows >= 1 && w.cols >= 1, "quant::spectrum: W is [", w.rows, ", ", w.cols,
                     "]; it needs at least one row and column");
  Index const m = std::min(w.rows, w.cols);
  Matrix a(w.rows, w.cols);
  for (Index r = 0; r < w.rows; ++r) {
    for (Index c = 0; c < w.cols; ++c) {
      double const v = w(r, c);
      moe::detail::check(std::isfinite(v), "quant::spectrum: W(", r, ", ", c, ") = ", v,
                         "; the spectrum of a non-finite matrix is undefined");
      a(r, c) = static_cast<Real>(v);
    }
  }
  Matrix const gram = w.rows <= w.cols ? Matrix(a * a.transpose()) : Matrix(a.transpose() * a);
  Eigen::SelfAdjointEigenSolver<Matrix> es(gram, Eigen::EigenvaluesOnly);
  std::vector<double> ev(static_cast<std::size_t>(m));
  for (Index i = 0; i < m; ++i)
    ev[static_cast<std::size_t>(i)] = std::max(0.0, static_cast<double>(es.eigenvalues()(i)));
  std::sort(ev.begin(), ev.end());
  return ev;
}

/// A power-law fit of the tail of a spectrum.
struct PowerLawFit {
  double alpha = 0;  ///< tail exponent (p(lambda) ~ lambda^-alpha)
  double x_min = 0;  ///< where the tail starts
  double ks = 1;     ///< Kolmogorov-Smirnov distance of the fit on the tail
  Index tail = 0;    ///< eigenvalues >= x_min
};

/// Fits alpha and x_min to `values` (any order; eigenvalues <= 0 are dropped). Needs at least
/// two positive values; moe::Error otherwise. Ties in D keep the smaller x_min (the longer tail).
inline PowerLawFit fit_power_law(std::vector<double> values) {
  values.erase(std::remove_if(values.begin(), values.end(), [](double v) { return !(v > 0.0); }),
               values.end());
  std::sort(values.begin(), values.end());
  Index const n = static_cast<Index>(values.size());
  moe::detail::check(n >= 2, "quant::fit_power_law: ", n,
                     " positive eigenvalues; a tail fit needs at least 2 (a matrix of rank >= 2)");
  // suffix[j] = sum_{i >= j} ln(values[i]).
  std::vector<double> suffix(static_cast<std::size_t>(n + 1), 0.0);
  for (Index i = n - 1; i >= 0; --i) {
    suffix[static_cast<std::size_t>(i)] =
        suffix[static_cast<std::size_t>(i + 1)] + std::log(values[static_cast<std::size_t>(i)]);
  }
  PowerLawFit best;
  for (Index j = 0; j + 1 < n; ++j) {
    double const xmin = values[static_cast<std::size_t>(j)];
    if (j > 0 && xmin == values[static_cast<std::size_t>(j - 1)]) continue;  // unique candidates
    Index const tail = n - j;
    double const logs =
        suffix[static_cast<std::size_t>(j)] - static_cast<double>(tail) * std::log(xmin);
    if (!(logs > 0.0)) continue;  // every tail value equal to x_min
    double const alpha = 1.0 + static_cast<double>(tail) / logs;
    double d = 0.0;
    for (Index i = 0; i < tail; ++i) {
      double const x = values[static_cast<std::size_t>(j + i)];
      double const fit = 1.0 - std::pow(x / xmin, 1.0 - alpha);
      double const lo = static_cast<double>(i) / static_cast<double>(tail);
      double const hi = static_cast<double>(i + 1) / static_cast<double>(tail);
      d = std::max({d, std::fabs(fit - lo), std::fabs(hi - fit)});
    }
    if (d < best.ks) best = {alpha, xmin, d, tail};
  }
  moe::detail::check(best.tail > 0,
                     "quant::fit_power_law: every eigenvalue is the same; the "
                     "spectrum has no tail to fit");
  return best;
}

/// alpha of a weight matrix: fit_power_law(spectrum<Real>(w)) (a template for spectrum's reason).
template <class Real = double>
PowerLawFit ht_alpha(ConstMatrixView<float> w) {
  return fit_power_law(spectrum<Real>(w));
}

/// One unit of an allocation: its weight count, importance and error under each candidate.
struct AllocationUnit {
  Index weights = 0;           ///< n_u (a positive multiple of the common unit)
  double importance = 1.0;     ///< w_u
  std::vector<double> errors;  ///< e_u(f) per candidate format, in the candidates' order
};

/// The chosen candidate per unit, its objective sum_u w_u e_u(f_u) and average bits a weight.
struct Allocation {
  std::vector<int> choice;
  double objective = 0;
  double average_bits = 0;
};

/// Exact minimum of sum_u w_u e_u(f_u) over one candidate per unit subject to
/// sum_u n_u bits[f_u] <= budget_bits * sum_u n_u. bits[f] must be multiples of 1/32 (every GGUF
/// and float format is); moe::Error if no choice fits the budget. An error may be +infinity (the
/// format cannot hold the unit); when every choice within the budget has one, the result's
/// objective is +infinity (and its choice all 0). Ties keep the lower-index candidate of the
/// last unit first (deterministic).
inline Allocation allocate_bits(std::vector<AllocationUnit> const& units,
                                std::vector<double> const& bits, double budget_bits) {
  Index const U = static_cast<Index>(units.size());
  Index const F = static_cast<Index>(bits.size());
  moe::detail::check(U >= 1 && F >= 1, "quant::allocate_bits: ", U, " units and ", F,
                     " candidate formats; both must be at least 1");
  std::vector<Index> cost(static_cast<std::size_t>(F));
  for (Index f = 0; f < F; ++f) {
    double const c = bits[static_cast<std::size_t>(f)] * 32.0;
    moe::detail::check(c >= 1.0 - 1e-9 && c <= 64.0 * 32.0 && std::fabs(c - std::round(c)) < 1e-9,
                       "quant::allocate_bits: ", bits[static_cast<std::size_t>(f)],
                       " bits is not a positive multiple of 1/32 of at most 64 bits");
    cost[static_cast<std::size_t>(f)] = static_cast<Index>(std::llround(c));
  }
  Index g = 0;
  for (auto const& u : units) {
    moe::detail::check(u.weights >= 1 && static_cast<Index>(u.errors.size()) == F,
                       "quant::allocate_bits: a unit has ", u.weights, " weights and ",
                       u.errors.size(), " errors; it needs >= 1 weight and one error per format");
    g = std::gcd(g, u.weights);
  }
  std::vector<Index> size(static_cast<std::size_t>(U));
  Index total = 0;
  for (Index u = 0; u < U; ++u) {
    size[static_cast<std::size_t>(u)] = units[static_cast<std::size_t>(u)].weights / g;
    total += size[static_cast<std::size_t>(u)];
  }
  moe::detail::check(std::isfinite(budget_bits) && budget_bits > 0, "quant::allocate_bits: budget ",
                     budget_bits, " bits a weight must be positive and finite");
  // A budget above 64 bits a weight buys every candidate: clamped there before the integer cast.
  Index const cap = static_cast<Index>(
      std::floor(std::min(budget_bits, 64.0) * 32.0 * static_cast<double>(total) + 1e-6));
  Index const min_cost = *std::min_element(cost.begin(), cost.end());
  moe::detail::check(min_cost * total <= cap, "quant::allocate_bits: a budget of ", budget_bits,
                     " bits a weight is below the smallest candidate (",
                     static_cast<double>(min_cost) / 32.0,
                     " bits); raise it or add a smaller format");
  Index const B = std::min(cap, *std::max_element(cost.begin(), cost.end()) * total);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // best[u][b]: minimum objective of units [0, u) spending exactly b steps; choice kept per unit.
  std::vector<double> prev(static_cast<std::size_t>(B + 1), kInf), cur(prev.size());
  std::vector<std::int8_t> pick(static_cast<std::size_t>(U * (B + 1)), -1);
  prev[0] = 0.0;
  for (Index u = 0; u < U; ++u) {
    std::fill(cur.begin(), cur.end(), kInf);
    AllocationUnit const& un = units[static_cast<std::size_t>(u)];
    for (Index f = 0; f < F; ++f) {
      Index const c = cost[static_cast<std::size_t>(f)] * size[static_cast<std::size_t>(u)];
      double const e = un.importance * un.errors[static_cast<std::size_t>(f)];
      for (Index b = c; b <= B; ++b) {
        double const v = prev[static_cast<std::size_t>(b - c)] + e;
        if (v < cur[static_cast<std::size_t>(b)]) {
          cur[static_cast<std::size_t>(b)] = v;
          pick[static_cast<std::size_t>(u * (B + 1) + b)] = static_cast<std::int8_t>(f);
        }
      }
    }
    std::swap(prev, cur);
  }
  Index bstar = 0;
  for (Index b = 1; b <= B; ++b) {
    if (prev[static_cast<std::size_t>(b)] < prev[static_cast<std::size_t>(bstar)]) bstar = b;
  }
  Allocation out;
  out.choice.assign(static_cast<std::size_t>(U), 0);
  out.objective = prev[static_cast<std::size_t>(bstar)];
  if (!std::isfinite(out.objective)) {
    // Every choice within the budget has an infinite error (a unit whose depth only formats
    // above the budget can hold): nothing to trace back; the caller says why.
    out.objective = kInf;
    return out;
  }
  Index b = bstar;
  double used = 0;
  for (Index u = U - 1; u >= 0; --u) {
    int const f = pick[static_cast<std::size_t>(u * (B + 1) + b)];
    out.choice[static_cast<std::size_t>(u)] = f;
    Index const c = cost[static_cast<std::size_t>(f)] * size[static_cast<std::size_t>(u)];
    used += static_cast<double>(c);
    b -= c;
  }
  out.average_bits = used / 32.0 / static_cast<double>(total);
  return out;
}

}  // namespace moe::quant
