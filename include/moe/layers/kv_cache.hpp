// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// KvCache: the keys and values an attention layer keeps for decoding (GatedAttention::
/// forward_cached, MoeAttention::forward_cached).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/types.hpp"

namespace moe {

/// The keys (after q/k norm and RoPE, at their absolute positions) and values of one attention
/// layer for `sequences` independent sequences, for decoding: a prefill appends a prompt, each
/// step appends one or a few tokens, and attention reads the whole cached prefix.
///
/// Layout: sequence s owns one contiguous block of `capacity()` rows for its keys and one for
/// its values. GatedAttention's rows are kv_dim = num_kv_heads * head_dim floats (head-major,
/// as k_proj's output); MoeAttention's keys are d_qk wide and its values are the hidden states,
/// d_model wide (with_widths). Rows [0, length(s)) are filled. Appending past the capacity
/// grows every sequence's block to max(2 * capacity, needed) (one copy of the filled rows), so
/// a decode loop reallocates O(log n) times, not per step; reserve() sizes it up front.
/// Memory: bytes_per_token() = (key width + value width) * 4 bytes per cached token and layer,
/// in HugePageAllocator storage (2 MiB pages from 2 MiB up: a decode step streams the whole
/// cached prefix once).
class KvCache {
 public:
  KvCache() = default;
  /// `sequences` empty sequences of keys and values of width kv_dim (>= 1), room for
  /// `capacity` tokens each. Throws moe::Error on negative sizes.
  KvCache(Index sequences, Index kv_dim, Index capacity = 0)
      : KvCache(sequences, kv_dim, kv_dim, capacity, 0) {}
  /// Keys of key_dim and values of value_dim floats (MoeAttention: d_qk and d_model).
  static KvCache with_widths(Index sequences, Index key_dim, Index value_dim, Index capacity = 0) {
    return KvCache(sequences, key_dim, value_dim, capacity, 0);
  }

  Index sequences() const { return static_cast<Index>(length_.size()); }
  /// Key width (GatedAttention: also the value width).
  Index kv_dim() const { return key_dim_; }
  Index key_dim() const { return key_dim_; }
  Index value_dim() const { return value_dim_; }
  /// Tokens every sequence can hold before the next growth.
  Index capacity() const { return capacity_; }
  /// Tokens cached for sequence s (its next token's position).
  Index length(Index s) const { return length_[checked(s)]; }
  /// Bytes of keys and values per cached token (one layer).
  std::size_t bytes_per_token() const {
    return static_cast<std::size_t>(key_dim_ + value_dim_) * sizeof(float);
  }
  /// Bytes held (every sequence's capacity).
  std::size_t bytes() const { return (k_.size() + v_.size()) * sizeof(float); }

  /// Sequence s's keys [length(s), key_dim] and values [length(s), value_dim].
  std::span<float const> keys(Index s) const {
    return {k_.data() + kblock(s), static_cast<std::size_t>(length(s) * key_dim_)};
  }
  std::span<float const> values(Index s) const {
    return {v_.data() + vblock(s), static_cast<std::size_t>(length(s) * value_dim_)};
  }

  /// Room for `capacity` tokens per sequence (never shrinks; keeps the cached rows).
  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    HugePageVector<float> k(static_cast<std::size_t>(sequences() * capacity * key_dim_), 0.0f);
    HugePageVector<float> v(static_cast<std::size_t>(sequences() * capacity * value_dim_), 0.0f);
    for (Index s = 0; s < sequences(); ++s) {
      Index const len = length_[static_cast<std::size_t>(s)];
      std::copy(k_.begin() + kblock(s), k_.begin() + kblock(s) + len * key_dim_,
                k.begin() + s * capacity * key_dim_);
      std::copy(v_.begin() + vblock(s), v_.begin() + vblock(s) + len * value_dim_,
                v.begin() + s * capacity * value_dim_);
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
  float* key_row(Index s, Index pos) { return k_.data() + kblock(s) + pos * key_dim_; }
  float* value_row(Index s, Index pos) { return v_.data() + vblock(s) + pos * value_dim_; }
  float const* key_data(Index s) const { return k_.data() + kblock(s); }
  float const* value_data(Index s) const { return v_.data() + vblock(s); }
  void advance(Index s, Index n) { length_[checked(s)] += n; }

 private:
  KvCache(Index sequences, Index key_dim, Index value_dim, Index capacity, int)
      : key_dim_(key_dim), value_dim_(value_dim) {
    detail::check(sequences >= 0 && key_dim >= 1 && value_dim >= 1 && capacity >= 0,
                  "KvCache: sequences = ", sequences, ", key width = ", key_dim,
                  ", value width = ", value_dim, ", capacity = ", capacity,
                  "; the widths must be >= 1 and the others >= 0");
    length_.assign(static_cast<std::size_t>(sequences), 0);
    reserve(capacity);
  }
  std::size_t checked(Index s) const {
    detail::check(s >= 0 && s < sequences(), "KvCache: sequence ", s, " out of range (",
                  sequences(), " sequences)");
    return static_cast<std::size_t>(s);
  }
  std::ptrdiff_t kblock(Index s) const {
    return static_cast<std::ptrdiff_t>(s * capacity_ * key_dim_);
  }
  std::ptrdiff_t vblock(Index s) const {
    return static_cast<std::ptrdiff_t>(s * capacity_ * value_dim_);
  }

  Index key_dim_ = 1, value_dim_ = 1;
  Index capacity_ = 0;
  std::vector<Index> length_;
  HugePageVector<float> k_, v_;
};

namespace detail {
/// The checks of a forward_cached call (who: the layer's name): one count per sequence of
/// `cache`, none negative, summing to the rows of x.
inline void check_new_tokens(KvCache const& cache, std::span<Index const> new_tokens, Index rows,
                             char const* who) {
  check(static_cast<Index>(new_tokens.size()) == cache.sequences(), who,
        "::forward_cached: new_tokens has ", new_tokens.size(), " entries for a cache of ",
        cache.sequences(), " sequences; give one count per sequence (0 for none)");
  Index total = 0;
  for (Index const n : new_tokens) {
    check(n >= 0, who, "::forward_cached: a negative token count (", n, ")");
    total += n;
  }
  check(total == rows, who, "::forward_cached: new_tokens sum to ", total, " but x has ", rows,
        " rows; x holds the new tokens of every sequence in order");
}
}  // namespace detail

}  // namespace moe
