// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// KvCache: the keys and values an attention layer keeps for decoding (GatedAttention::
/// forward_cached).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"

namespace moe {

/// The keys (after q/k norm and RoPE, at their absolute positions) and values of one attention
/// layer for `sequences` independent sequences, for decoding: a prefill appends a prompt, each
/// step appends one or a few tokens, and attention reads the whole cached prefix.
///
/// Layout: sequence s owns one contiguous block of `capacity()` rows for its keys and one for
/// its values, each row kv_dim = num_kv_heads * head_dim floats (head-major, as k_proj's
/// output); rows [0, length(s)) are filled. Appending past the capacity grows every sequence's
/// block to max(2 * capacity, needed) (one copy of the filled rows), so a decode loop
/// reallocates O(log n) times, not per step; reserve() sizes it up front. Memory:
/// bytes_per_token() = 2 * kv_dim * 4 bytes per cached token and layer.
class KvCache {
 public:
  KvCache() = default;
  /// `sequences` empty sequences of keys and values of width kv_dim (>= 1), room for
  /// `capacity` tokens each. Throws moe::Error on negative sizes.
  KvCache(Index sequences, Index kv_dim, Index capacity = 0) : kv_dim_(kv_dim) {
    detail::check(sequences >= 0 && kv_dim >= 1 && capacity >= 0,
                  "KvCache: sequences = ", sequences, ", kv_dim = ", kv_dim,
                  ", capacity = ", capacity, "; kv_dim must be >= 1 and the others >= 0");
    length_.assign(static_cast<std::size_t>(sequences), 0);
    reserve(capacity);
  }

  Index sequences() const { return static_cast<Index>(length_.size()); }
  Index kv_dim() const { return kv_dim_; }
  /// Tokens every sequence can hold before the next growth.
  Index capacity() const { return capacity_; }
  /// Tokens cached for sequence s (its next token's position).
  Index length(Index s) const { return length_[checked(s)]; }
  /// Bytes of keys and values per cached token (one layer).
  std::size_t bytes_per_token() const {
    return 2 * static_cast<std::size_t>(kv_dim_) * sizeof(float);
  }
  /// Bytes held (every sequence's capacity).
  std::size_t bytes() const { return (k_.size() + v_.size()) * sizeof(float); }

  /// Sequence s's keys / values [length(s), kv_dim] (row stride kv_dim).
  std::span<float const> keys(Index s) const {
    return {k_.data() + block(s), static_cast<std::size_t>(length(s) * kv_dim_)};
  }
  std::span<float const> values(Index s) const {
    return {v_.data() + block(s), static_cast<std::size_t>(length(s) * kv_dim_)};
  }

  /// Room for `capacity` tokens per sequence (never shrinks; keeps the cached rows).
  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    auto const n = static_cast<std::size_t>(sequences() * capacity * kv_dim_);
    std::vector<float> k(n, 0.0f), v(n, 0.0f);
    for (Index s = 0; s < sequences(); ++s) {
      auto const filled =
          static_cast<std::ptrdiff_t>(length_[static_cast<std::size_t>(s)] * kv_dim_);
      std::copy(k_.begin() + block(s), k_.begin() + block(s) + filled,
                k.begin() + s * capacity * kv_dim_);
      std::copy(v_.begin() + block(s), v_.begin() + block(s) + filled,
                v.begin() + s * capacity * kv_dim_);
    }
    k_ = std::move(k);
    v_ = std::move(v);
    capacity_ = capacity;
  }
  /// Empties every sequence (the memory stays).
  void clear() { std::fill(length_.begin(), length_.end(), 0); }
  /// Empties sequence s.
  void reset(Index s) { length_[checked(s)] = 0; }
  /// Keeps the first n tokens of sequence s (0 <= n <= length(s)), e.g. to roll back a step.
  void truncate(Index s, Index n) {
    detail::check(n >= 0 && n <= length(s), "KvCache::truncate: ", n, " tokens for sequence ", s,
                  " of length ", length(s), "; keep between 0 and its length");
    length_[checked(s)] = n;
  }

  // For the attention layers: room for `extra` more tokens of sequence s, and its rows.
  void make_room(Index s, Index extra) {
    Index const need = length(s) + extra;
    if (need > capacity_) reserve(std::max(need, 2 * capacity_));
  }
  float* key_row(Index s, Index pos) { return k_.data() + block(s) + pos * kv_dim_; }
  float* value_row(Index s, Index pos) { return v_.data() + block(s) + pos * kv_dim_; }
  float const* key_data(Index s) const { return k_.data() + block(s); }
  float const* value_data(Index s) const { return v_.data() + block(s); }
  void advance(Index s, Index n) { length_[checked(s)] += n; }

 private:
  std::size_t checked(Index s) const {
    detail::check(s >= 0 && s < sequences(), "KvCache: sequence ", s, " out of range (",
                  sequences(), " sequences)");
    return static_cast<std::size_t>(s);
  }
  std::ptrdiff_t block(Index s) const {
    return static_cast<std::ptrdiff_t>(s * capacity_ * kv_dim_);
  }

  Index kv_dim_ = 1;
  Index capacity_ = 0;
  std::vector<Index> length_;
  std::vector<float> k_, v_;
};

}  // namespace moe
