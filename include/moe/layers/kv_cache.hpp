// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// KvCache: the keys and values an attention layer keeps for decoding (GatedAttention::
/// forward_cached, MoeAttention::forward_cached).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/memory.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/gemm_bf16.hpp"

namespace moe {

/// How a KvCache stores keys and values: fp32, or bf16 (each value rounded to nearest even as it
/// is stored; the attention widens it to fp32 as it loads it). bf16 halves the bytes a decode
/// step reads from a long context; the rounding changes the attention's output by about 2^-9 of
/// its values' scale (relative), as bf16 weights do.
enum class KvFormat { kF32, kBf16 };

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
/// Memory: bytes_per_token() = (key width + value width) * 4 bytes per cached token and layer
/// (2 with KvFormat::kBf16), in HugePageAllocator storage (2 MiB pages from 2 MiB up: a decode
/// step streams the whole cached prefix once).
class KvCache {
 public:
  KvCache() = default;
  /// `sequences` empty sequences of keys and values of width kv_dim (>= 1), room for
  /// `capacity` tokens each, stored as `format`. Throws moe::Error on negative sizes.
  KvCache(Index sequences, Index kv_dim, Index capacity = 0, KvFormat format = KvFormat::kF32)
      : KvCache(sequences, kv_dim, kv_dim, capacity, format) {}
  /// Keys of key_dim and values of value_dim values (MoeAttention: d_qk and d_model).
  static KvCache with_widths(Index sequences, Index key_dim, Index value_dim, Index capacity = 0,
                             KvFormat format = KvFormat::kF32) {
    return KvCache(sequences, key_dim, value_dim, capacity, format);
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
  KvFormat format() const { return format_; }
  bool is_bf16() const { return format_ == KvFormat::kBf16; }
  /// Bytes of keys and values per cached token (one layer).
  std::size_t bytes_per_token() const {
    return static_cast<std::size_t>(key_dim_ + value_dim_) * (is_bf16() ? 2 : 4);
  }
  /// Bytes held (every sequence's capacity).
  std::size_t bytes() const {
    return (k_.size() + v_.size()) * sizeof(float) + (k16_.size() + v16_.size()) * 2;
  }

  /// Sequence s's keys [length(s), key_dim] and values [length(s), value_dim] (KvFormat::kF32;
  /// moe::Error for a bf16 cache: read keys_bf16 / values_bf16).
  std::span<float const> keys(Index s) const {
    require(KvFormat::kF32, "keys");
    return {k_.data() + kblock(s), static_cast<std::size_t>(length(s) * key_dim_)};
  }
  std::span<float const> values(Index s) const {
    require(KvFormat::kF32, "values");
    return {v_.data() + vblock(s), static_cast<std::size_t>(length(s) * value_dim_)};
  }
  /// The same of a KvFormat::kBf16 cache, as bf16 bits (moe::Error for an fp32 cache).
  std::span<std::uint16_t const> keys_bf16(Index s) const {
    require(KvFormat::kBf16, "keys_bf16");
    return {k16_.data() + kblock(s), static_cast<std::size_t>(length(s) * key_dim_)};
  }
  std::span<std::uint16_t const> values_bf16(Index s) const {
    require(KvFormat::kBf16, "values_bf16");
    return {v16_.data() + vblock(s), static_cast<std::size_t>(length(s) * value_dim_)};
  }

  /// Room for `capacity` tokens per sequence (never shrinks; keeps the cached rows).
  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    auto grow = [&](auto& store, Index width) {
      using V = std::remove_reference_t<decltype(store)>;
      V bigger(static_cast<std::size_t>(sequences() * capacity * width));
      for (Index s = 0; s < sequences(); ++s) {
        auto const from = store.begin() + static_cast<std::ptrdiff_t>(s * capacity_ * width);
        Index const len = length_[static_cast<std::size_t>(s)];
        std::copy(from, from + len * width, bigger.begin() + s * capacity * width);
      }
      store = std::move(bigger);
    };
    if (is_bf16()) {
      grow(k16_, key_dim_);
      grow(v16_, value_dim_);
    } else {
      grow(k_, key_dim_);
      grow(v_, value_dim_);
    }
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
  /// Row `pos` of sequence s's keys (values) = key[0, key_dim) (value[0, value_dim)), rounded to
  /// bf16 in a bf16 cache.
  void store_key(Index s, Index pos, float const* key) {
    store(k_, k16_, kblock(s) + pos * key_dim_, key, key_dim_);
  }
  void store_value(Index s, Index pos, float const* value) {
    store(v_, v16_, vblock(s) + pos * value_dim_, value, value_dim_);
  }
  // (pos < capacity(): make_room first.)
  /// Sequence s's key and value rows from 0 (fp32 cache; null in a bf16 one) ...
  float const* key_data(Index s) const { return is_bf16() ? nullptr : k_.data() + kblock(s); }
  float const* value_data(Index s) const { return is_bf16() ? nullptr : v_.data() + vblock(s); }
  /// ... or as bf16 (bf16 cache; null in an fp32 one).
  std::uint16_t const* key_data_bf16(Index s) const {
    return is_bf16() ? k16_.data() + kblock(s) : nullptr;
  }
  std::uint16_t const* value_data_bf16(Index s) const {
    return is_bf16() ? v16_.data() + vblock(s) : nullptr;
  }
  void advance(Index s, Index n) { length_[checked(s)] += n; }

 private:
  KvCache(Index sequences, Index key_dim, Index value_dim, Index capacity, KvFormat format)
      : key_dim_(key_dim), value_dim_(value_dim), format_(format) {
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
  void require(KvFormat f, char const* what) const {
    detail::check(format_ == f, "KvCache::", what, ": the cache holds ",
                  is_bf16() ? "bf16" : "fp32", " values; read ",
                  is_bf16() ? "keys_bf16 / values_bf16" : "keys / values");
  }
  void store(HugePageVector<float>& f32, HugePageVector<std::uint16_t>& b16, std::ptrdiff_t at,
             float const* row, Index n) const {
    if (is_bf16()) {
      kernels::round_to_bf16(row, static_cast<std::size_t>(n), b16.data() + at);
    } else {
      std::copy(row, row + n, f32.data() + at);
    }
  }
  std::ptrdiff_t kblock(Index s) const {
    return static_cast<std::ptrdiff_t>(s * capacity_ * key_dim_);
  }
  std::ptrdiff_t vblock(Index s) const {
    return static_cast<std::ptrdiff_t>(s * capacity_ * value_dim_);
  }

  Index key_dim_ = 1, value_dim_ = 1;
  KvFormat format_ = KvFormat::kF32;
  Index capacity_ = 0;
  std::vector<Index> length_;
  HugePageVector<float> k_, v_;              // KvFormat::kF32
  HugePageVector<std::uint16_t> k16_, v16_;  // KvFormat::kBf16
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
