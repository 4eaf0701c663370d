// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Pieces shared by the optimizers: list checks and blocked loops over parameters (not public API).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/parameters.hpp"
#include "moe/core/thread_pool.hpp"
#include "moe/core/types.hpp"

namespace moe::optim::detail {

using moe::detail::check;

/// Throws moe::Error unless params and grads have the same count, names and sizes (in order),
/// and, once an optimizer has bound itself to a list (`names`, `sizes` non-empty), unless params
/// is that same list. Binds on the first call (empty `names`).
inline void check_lists(char const* who, ParameterList const& params, ParameterList const& grads,
                        std::vector<std::string>& names, std::vector<std::size_t>& sizes) {
  check(params.size() == grads.size(), who, ": ", params.size(), " parameters but ", grads.size(),
        " gradients; pass layer.parameters() with the gradients' groups() of the same layer");
  for (std::size_t i = 0; i < params.size(); ++i) {
    ParameterRef const& p = params[i];
    ParameterRef const& g = grads[i];
    check(p.name == g.name, who, ": parameter ", i, " is \"", p.name, "\" but gradient ", i,
          " is \"", g.name, "\"; list parameters and gradients in the same order");
    check(p.values.size() == g.values.size(), who, ": parameter \"", p.name, "\" has ",
          p.values.size(), " values but its gradient has ", g.values.size(),
          "; make the gradients from the same layer (make_gradients())");
    check(p.values.data() != g.values.data() || p.values.empty(), who, ": parameter \"", p.name,
          "\" and its gradient are the same buffer; pass the gradients, not the parameters twice");
  }
  if (names.empty() && sizes.empty()) {
    for (ParameterRef const& p : params) {
      names.emplace_back(p.name);
      sizes.push_back(p.values.size());
    }
    return;
  }
  check(params.size() == names.size(), who, ": stepped with ", params.size(),
        " parameters but its state was made for ", names.size(),
        "; use one optimizer per parameter list (or reset() it)");
  for (std::size_t i = 0; i < params.size(); ++i) {
    check(params[i].name == names[i] && params[i].values.size() == sizes[i], who, ": parameter ", i,
          " is \"", params[i].name, "\" of ", params[i].values.size(),
          " values but the optimizer state was made for \"", names[i], "\" of ", sizes[i],
          "; use one optimizer per parameter list (or reset() it)");
  }
}

/// Elements per work item of an optimizer step (128 KB of floats).
inline constexpr std::size_t kBlock = std::size_t{1} << 15;

/// Calls f(i, begin, end) for consecutive blocks [begin, end) of at most kBlock elements of every
/// parameter i, on `pool` if given (serially otherwise). Optimizer updates are elementwise, so the
/// result does not depend on the pool or the order of the blocks.
template <class F>
void for_each_block(ParameterList const& params, ThreadPool* pool, F&& f) {
  std::vector<std::size_t> first(params.size() + 1, 0);  // first block of each parameter
  for (std::size_t i = 0; i < params.size(); ++i) {
    first[i + 1] = first[i] + (params[i].values.size() + kBlock - 1) / kBlock;
  }
  auto run = [&](std::size_t b) {
    auto const i = static_cast<std::size_t>(std::upper_bound(first.begin(), first.end(), b) -
                                            first.begin() - 1);
    std::size_t const begin = (b - first[i]) * kBlock;
    f(i, begin, std::min(params[i].values.size(), begin + kBlock));
  };
  if (pool == nullptr || first.back() <= 1) {
    for (std::size_t b = 0; b < first.back(); ++b) run(b);
    return;
  }
  pool->parallel_for(static_cast<Index>(first.back()),
                     [&](Index b, int) { run(static_cast<std::size_t>(b)); });
}

}  // namespace moe::optim::detail
