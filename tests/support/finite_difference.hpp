// SPDX-License-Identifier: Apache-2.0
// Central finite differences of a double-precision twin's objective, and the tolerance the
// layer tests hold an analytic gradient to.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <string_view>
#include <vector>

#include "moe/core/types.hpp"

namespace ref {

/// Central difference of m.objective(x, dy, T) in v[i] (step 1e-6 max(1, |v[i]|)); v may be x
/// or one of m's parameter buffers.
template <class Model>
double central_difference(Model& m, std::vector<double>& v, moe::Index i,
                          std::vector<double> const& x, std::vector<double> const& dy,
                          moe::Index T) {
  double const old = v[i];
  double const h = 1e-6 * std::max(1.0, std::fabs(old));
  v[i] = old + h;
  double const lp = m.objective(x, dy, T);
  v[i] = old - h;
  double const lm = m.objective(x, dy, T);
  v[i] = old;
  return (lp - lm) / (2.0 * h);
}

/// |analytic - fd| <= 2e-4 + 2e-3 |fd|, naming the entry otherwise.
inline void require_close(float analytic, double fd, std::string_view what, moe::Index i) {
  INFO(what << "[" << i << "]: analytic " << analytic << ", finite difference " << fd);
  REQUIRE(std::fabs(analytic - fd) <= 2e-4 + 2e-3 * std::fabs(fd));
}

/// Every buffer of `groups` (name, values: a layer's gradients) against central differences of m
/// in the twin's buffer of that name (`buffer_of(m, name)` -> std::vector<double>*), then dx
/// [x.size()] against those in x.
template <class Model, class Groups, class BufferOf>
void require_gradients(Model& m, Groups const& groups, BufferOf&& buffer_of, std::vector<double>& x,
                       std::vector<double> const& dy, moe::Index T, float const* dx) {
  for (auto const& g : groups) {
    std::vector<double>* v = buffer_of(m, g.name);
    REQUIRE(v->size() == g.values.size());
    for (moe::Index i = 0; i < static_cast<moe::Index>(g.values.size()); ++i) {
      require_close(g.values[i], central_difference(m, *v, i, x, dy, T), g.name, i);
    }
  }
  for (moe::Index i = 0; i < static_cast<moe::Index>(x.size()); ++i) {
    require_close(dx[i], central_difference(m, x, i, x, dy, T), "dx", i);
  }
}

}  // namespace ref
