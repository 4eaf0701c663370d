// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ExpertPlacement: which rank owns which routed expert in an expert-parallel layer. Plain C++
/// (no MPI), so it can be built, inspected and tested anywhere.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"

namespace moe::dist {

/// The owner rank of each of E routed experts, over P ranks. A rank's *local* experts are the
/// experts it owns, in ascending expert id; `local_index(e)` is e's position among its owner's
/// experts (the index into that rank's ExpertBank). A rank may own no expert (P > E, or a map
/// that leaves it out); every expert has exactly one owner (no replicas).
///
/// | member                 | shape | meaning                                              |
/// |------------------------|-------|------------------------------------------------------|
/// | owner(e)               | [E]   | rank that stores and runs expert e                   |
/// | experts_of(r)          | [L_r] | experts of rank r, ascending                         |
/// | local_index(e)         | [E]   | position of e in experts_of(owner(e))                |
///
/// The placement must be identical on every rank; ExpertParallelMoeFfn checks that with a
/// collective when it is constructed.
class ExpertPlacement {
 public:
  ExpertPlacement() = default;

  /// Contiguous blocks (the default, as in DeepSeek's and Megatron-LM's expert parallelism):
  /// rank r owns experts [first(r), first(r + 1)) with first(r) = r * (E / P) + min(r, E % P),
  /// so block sizes differ by at most one and the first E % P ranks own one expert more. With
  /// P > E, ranks E .. P-1 own no expert. Preconditions: E >= 1, P >= 1.
  static ExpertPlacement contiguous(Index num_experts, int num_ranks) {
    check_sizes(num_experts, num_ranks, "contiguous");
    std::vector<int> owner(static_cast<std::size_t>(num_experts));
    Index const base = num_experts / num_ranks, extra = num_experts % num_ranks;
    for (int r = 0; r < num_ranks; ++r) {
      Index const first = r * base + std::min<Index>(r, extra);
      Index const last = (r + 1) * base + std::min<Index>(r + 1, extra);
      for (Index e = first; e < last; ++e) owner[static_cast<std::size_t>(e)] = r;
    }
    return ExpertPlacement(std::move(owner), num_ranks);
  }

  /// Round robin: expert e on rank e % P (spreads neighbouring experts, e.g. one DeepSeek expert
  /// group, over all ranks). Preconditions: E >= 1, P >= 1.
  static ExpertPlacement round_robin(Index num_experts, int num_ranks) {
    check_sizes(num_experts, num_ranks, "round_robin");
    std::vector<int> owner(static_cast<std::size_t>(num_experts));
    for (Index e = 0; e < num_experts; ++e) {
      owner[static_cast<std::size_t>(e)] = static_cast<int>(e % num_ranks);
    }
    return ExpertPlacement(std::move(owner), num_ranks);
  }

  /// Any map: owner[e] in [0, num_ranks) for every expert (e.g. from an expert-placement
  /// balancer such as DeepSeek's EPLB, without its replicas). Throws moe::Error otherwise.
  static ExpertPlacement from_owners(std::vector<int> owner, int num_ranks) {
    check_sizes(static_cast<Index>(owner.size()), num_ranks, "from_owners");
    for (std::size_t e = 0; e < owner.size(); ++e) {
      ::moe::detail::check(owner[e] >= 0 && owner[e] < num_ranks,
                           "ExpertPlacement::from_owners: expert ", e, " is given to rank ",
                           owner[e], " but there are ", num_ranks,
                           " ranks; give every expert an owner in [0, ", num_ranks, ")");
    }
    return ExpertPlacement(std::move(owner), num_ranks);
  }

  /// Is this a placement at all (default-constructed placements are empty)?
  bool empty() const { return owner_.empty(); }
  Index num_experts() const { return static_cast<Index>(owner_.size()); }
  int num_ranks() const { return num_ranks_; }
  int owner(Index e) const { return owner_[static_cast<std::size_t>(e)]; }
  std::span<int const> owners() const { return owner_; }
  /// The experts rank r owns, in ascending id (empty if none).
  std::span<Index const> experts_of(int r) const {
    auto const b = static_cast<std::size_t>(rank_offsets_[static_cast<std::size_t>(r)]);
    auto const n = static_cast<std::size_t>(rank_offsets_[static_cast<std::size_t>(r) + 1]) - b;
    return std::span<Index const>(by_rank_).subspan(b, n);
  }
  Index num_local(int r) const { return static_cast<Index>(experts_of(r).size()); }
  /// Position of expert e among its owner's experts.
  Index local_index(Index e) const { return local_index_[static_cast<std::size_t>(e)]; }
  /// max over ranks of num_local(r).
  Index max_local() const {
    Index m = 0;
    for (int r = 0; r < num_ranks_; ++r) m = std::max(m, num_local(r));
    return m;
  }
  /// Are the owners non-decreasing in e (true for contiguous blocks)? Then the rows of a
  /// RoutingPlan, sorted by expert, are already grouped by destination rank.
  bool monotone() const { return std::is_sorted(owner_.begin(), owner_.end()); }

  /// A 64-bit FNV-1a hash of (P, owners): equal placements have equal fingerprints.
  std::uint64_t fingerprint() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&](std::uint64_t v) {
      for (int i = 0; i < 8; ++i) {
        h ^= (v >> (8 * i)) & 0xffu;
        h *= 0x100000001b3ull;
      }
    };
    mix(static_cast<std::uint64_t>(num_ranks_));
    for (int o : owner_) mix(static_cast<std::uint64_t>(o));
    return h;
  }

  /// "[0,0,1,1]" for short maps, "E experts over P ranks, hash ..." beyond 16 experts.
  std::string describe() const {
    std::string s;
    if (owner_.size() <= 16) {
      s = "[";
      for (std::size_t e = 0; e < owner_.size(); ++e) {
        if (e) s += ",";
        s += std::to_string(owner_[e]);
      }
      return s + "]";
    }
    return std::to_string(owner_.size()) + " experts, hash " +
           std::to_string(fingerprint() % 100000);
  }

 private:
  ExpertPlacement(std::vector<int> owner, int num_ranks)
      : owner_(std::move(owner)), num_ranks_(num_ranks) {
    Index const E = static_cast<Index>(owner_.size());
    rank_offsets_.assign(static_cast<std::size_t>(num_ranks) + 1, 0);
    for (int o : owner_) ++rank_offsets_[static_cast<std::size_t>(o) + 1];
    for (int r = 0; r < num_ranks; ++r) {
      rank_offsets_[static_cast<std::size_t>(r) + 1] += rank_offsets_[static_cast<std::size_t>(r)];
    }
    by_rank_.assign(static_cast<std::size_t>(E), 0);
    local_index_.assign(static_cast<std::size_t>(E), 0);
    std::vector<Index> fill(rank_offsets_.begin(), rank_offsets_.end() - 1);
    for (Index e = 0; e < E; ++e) {
      auto const r = static_cast<std::size_t>(owner_[static_cast<std::size_t>(e)]);
      local_index_[static_cast<std::size_t>(e)] = fill[r] - rank_offsets_[r];
      by_rank_[static_cast<std::size_t>(fill[r]++)] = e;
    }
  }

  static void check_sizes(Index num_experts, int num_ranks, char const* what) {
    ::moe::detail::check(
        num_experts >= 1 && num_ranks >= 1, "ExpertPlacement::", what, ": ", num_experts,
        " experts over ", num_ranks,
        " ranks; both must be at least 1 (use the communicator's size for the ranks)");
  }

  std::vector<int> owner_;           // [E]
  int num_ranks_ = 0;                // P
  std::vector<Index> rank_offsets_;  // [P+1] into by_rank_
  std::vector<Index> by_rank_;       // [E] experts grouped by owner, ascending within a rank
  std::vector<Index> local_index_;   // [E]
};

}  // namespace moe::dist
