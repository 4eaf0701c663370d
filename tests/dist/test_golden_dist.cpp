// SPDX-License-Identifier: Apache-2.0
// Golden digests of ExpertParallelMoeFfn at 1, 2 and 4 ranks (tests/support/golden.hpp): each
// rank's y, dx and gradients (its experts, and the replicated parameters summed over ranks),
// inference in fp32 and bf16 and one training step, folded in rank order. Recorded before the
// pipeline was split into stages (issue 16); every rank checks the same folded digest.
#include <mpi.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "moe/balance/switch_aux.hpp"
#include "moe/core/random.hpp"
#include "moe/dist/expert_parallel.hpp"
#include "moe/experts/expert_types.hpp"
#include "moe/experts/shared_experts.hpp"
#include "moe/layers/moe_ffn.hpp"
#include "moe/routing/softmax_top_k.hpp"
#include "support/golden.hpp"
#include "support/helpers.hpp"

using moe::Index;
namespace dist = moe::dist;
namespace experts = moe::experts;
namespace routing = moe::routing;

namespace {

// clang-format off
test::GoldenEntry const kGolden[] = {
#include "dist/golden_digests.inc"
};
// clang-format on

/// This rank's digest, folded with every other rank's in rank order (collective).
std::uint64_t fold_ranks(std::uint64_t mine) {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(p));
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  test::Digest d;
  for (std::uint64_t v : all) {
    float f[2];
    std::memcpy(f, &v, sizeof v);
    d.add(f, 2);
  }
  return d.value();
}

}  // namespace

TEST_CASE("golden: expert-parallel layer", "[golden]") {
  int p = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  using Layer = moe::MoeFfn<routing::SoftmaxTopK, experts::SwiGlu,
                            experts::GatedSharedExperts<experts::SwiGlu>, moe::balance::SwitchAux>;
  Index const D = 64, T = 150;
  Layer layer(D, 64, routing::SoftmaxTopK{8, 2, true, 1.0f},
              experts::GatedSharedExperts<experts::SwiGlu>(1, D, 32));
  {
    auto params = layer.parameters();  // holds the banks' edit scopes until the block ends
    for (std::size_t i = 0; i < params.size(); ++i) {
      float const a = params[i].name == "router.weight" ? 1.0f : 0.5f;
      moe::fill_uniform(params[i].values, -a, a, 1000 + i);
    }
  }
  // Uneven split: rank r holds tokens [T r^2 / p^2, T (r+1)^2 / p^2).
  auto begin = [&](int r) { return T * r * r / (p * p); };
  Index const O = begin(me), Tr = begin(me + 1) - O;
  auto X = test::random_vector(T * D, 11);
  auto dY = test::random_vector(T * D, 12);
  moe::ConstMatrixView<float> x(X.data() + O * D, Tr, D), dy(dY.data() + O * D, Tr, D);
  std::vector<float> y(static_cast<std::size_t>(Tr * D)), dx(y.size());
  moe::MatrixView<float> yv(y.data(), Tr, D), dxv(dx.data(), Tr, D);
  moe::ThreadPool pool(2);
  dist::ExpertParallelWorkspace ws;

  auto ep = dist::ExpertParallelOf<Layer>::from_layer(MPI_COMM_WORLD, layer);
  test::Digest infer;
  ep.forward(x, yv, ws, {.pool = &pool});
  infer.add(y.data(), y.size());
  test::Digest train;
  auto grads = ep.make_gradients();
  ep.forward_train(x, yv, ws, {.pool = &pool});
  ep.backward(ws, dy, dxv, grads, &pool);
  train.add(y.data(), y.size());
  train.add(dx.data(), dx.size());
  train.add(ws.aux_loss);
  for (auto const& g : grads.groups()) train.add(g.values);
  layer.pack_weights(experts::WeightFormat::kBf16);
  auto ep16 = dist::ExpertParallelOf<Layer>::from_layer(MPI_COMM_WORLD, layer);
  ep16.pack_weights(experts::WeightFormat::kBf16);
  ep16.forward(x, yv, ws);
  test::Digest bf16;
  bf16.add(y.data(), y.size());

  std::uint64_t const d_infer = fold_ranks(infer.value());
  std::uint64_t const d_train = fold_ranks(train.value());
  std::uint64_t const d_bf16 = fold_ranks(bf16.value());
  std::string const suffix = "_P" + std::to_string(p);
  test::check_golden(kGolden, "ep_forward" + suffix, d_infer);
  test::check_golden(kGolden, "ep_train" + suffix, d_train);
  test::check_golden(kGolden, "ep_forward_bf16" + suffix, d_bf16);
}
