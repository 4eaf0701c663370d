// SPDX-License-Identifier: Apache-2.0
// Runs one expert of an ExpertBank over rows of x through the routed-experts engine (the code
// every layer runs its experts with), single-threaded, inference mode.
#pragma once

#include <algorithm>
#include <vector>

#include "moe/layers/stages/routed_experts.hpp"

namespace test {

/// y = E_e(x) for the rows of x [n, D] into y [n, D].
template <class Bank>
void run_expert(Bank const& bank, moe::Index e, moe::ConstMatrixView<float> x,
                moe::MatrixView<float> y) {
  using X = typename Bank::Expert;
  moe::Index const n = x.rows, D = bank.d_model();
  // Expert e has every row; the others none.
  std::vector<moe::Index> offsets(static_cast<std::size_t>(bank.num_experts() + 1), 0);
  for (moe::Index k = e + 1; k <= bank.num_experts(); ++k) offsets[k] = n;
  moe::stages::ExpertRows const rows{offsets.data(), bank.num_experts()};
  moe::stages::ExpertMode const mode{};
  moe::stages::RoutedExperts r;
  moe::stages::ProjectionQueue q;
  r.prepare(bank, n, mode, false);
  r.enqueue_in(q, bank, rows, {x.data, x.row_stride, nullptr}, mode);
  q.run<X, X>(nullptr);
  r.enqueue_down(q, bank, rows, nullptr, mode);
  q.run<X, X>(nullptr);
  for (moe::Index i = 0; i < n; ++i) {
    std::copy(r.out.data() + i * D, r.out.data() + (i + 1) * D, y.row(i));
  }
}

}  // namespace test
