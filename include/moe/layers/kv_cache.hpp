// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// KvCache: the keys and values an attention layer keeps for decoding (GatedAttention::
/// forward_cached, MoeAttention::forward_cached).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
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
/// d_model wide (with_widths); MlaAttention's rows are its latent [c^ | k_pe], with no separate
/// values (keys_only). Rows [0, length(s) - first(s)) hold the tokens at positions
/// [first(s), length(s)). Appending past the capacity grows every sequence's block to
/// max(2 * capacity, needed) (one copy of the filled rows), so a decode loop reallocates
/// O(log n) times, not per step; reserve() sizes it up front.
///
/// Window (a sliding-window layer's cache, `window` W > 0): the cache keeps only the tokens a
/// new query can still see. When appending would pass the capacity it first drops the tokens
/// before position length(s) - W + 1 (moving the last W - 1 rows to the front: one copy of W
/// rows every capacity - W + 1 tokens), and grows only if a call brings more than that. A decode
/// loop then holds about 2 W rows per sequence however long it runs (gpt-oss's sliding layers:
/// 128 tokens, not the whole context). first(s) is the oldest kept position; truncate() cannot
/// go back before it. Only GatedAttention serves windowed caches, and only for a layer whose
/// sliding window is at most W.
/// Memory: bytes_per_token() = (key width + value width) * 4 bytes per cached token and layer
/// (2 with KvFormat::kBf16), in HugePageAllocator storage (2 MiB pages from 2 MiB up: a decode
/// step streams the whole cached prefix once).
class KvCache {
 public:
  KvCache() = default;
  /// `sequences` empty sequences of keys and values of width kv_dim (>= 1), room for
  /// `capacity` tokens each, stored as `format`. Throws moe::Error on negative sizes.
  /// `window` > 0: keep only what a sliding window of that many tokens can still see (above).
  KvCache(Index sequences, Index kv_dim, Index capacity = 0, KvFormat format = KvFormat::kF32,
          Index window = 0)
      : KvCache(sequences, kv_dim, kv_dim, capacity, format, window) {}
  /// Keys of key_dim and values of value_dim values (MoeAttention: d_qk and d_model).
  static KvCache with_widths(Index sequences, Index key_dim, Index value_dim, Index capacity = 0,
                             KvFormat format = KvFormat::kF32) {
    return KvCache(sequences, key_dim, value_dim, capacity, format, 0);
  }
  /// Rows of key_dim values and no separate values (value_dim() == 0): a layer whose values are
  /// part of its key rows (MlaAttention's latent cache: [c^ | k_pe] a token, the values c^).
  static KvCache keys_only(Index sequences, Index key_dim, Index capacity = 0,
                           KvFormat format = KvFormat::kF32) {
    return KvCache(sequences, key_dim, 0, capacity, format, 0);
  }

  Index sequences() const { return static_cast<Index>(length_.size()); }
  /// Key width (GatedAttention: also the value width).
  Index kv_dim() const { return key_dim_; }
  Index key_dim() const { return key_dim_; }
  Index value_dim() const { return value_dim_; }
  /// Tokens every sequence can hold before the next growth.
  Index capacity() const { return capacity_; }
  /// Tokens sequence s has seen (its next token's position).
  Index length(Index s) const { return length_[checked(s)]; }
  /// The oldest position sequence s still holds (0 without a window).
  Index first(Index s) const { return first_[checked(s)]; }
  /// Rows held for sequence s: length(s) - first(s).
  Index rows(Index s) const { return length(s) - first(s); }
  /// The sliding window the cache keeps (0: every token).
  Index window() const { return window_; }
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

  /// Sequence s's keys [rows(s), key_dim] and values [rows(s), value_dim] of positions
  /// [first(s), length(s)) (KvFormat::kF32; moe::Error for a bf16 cache: keys_bf16 / values_bf16).
  std::span<float const> keys(Index s) const {
    require(KvFormat::kF32, "keys");
    return {k_.data() + kblock(s), static_cast<std::size_t>(rows(s) * key_dim_)};
  }
  std::span<float const> values(Index s) const {
    require(KvFormat::kF32, "values");
    return {v_.data() + vblock(s), static_cast<std::size_t>(rows(s) * value_dim_)};
  }
  /// The same of a KvFormat::kBf16 cache, as bf16 bits (moe::Error for an fp32 cache).
  std::span<std::uint16_t const> keys_bf16(Index s) const {
    require(KvFormat::kBf16, "keys_bf16");
    return {k16_.data() + kblock(s), static_cast<std::size_t>(rows(s) * key_dim_)};
  }
  std::span<std::uint16_t const> values_bf16(Index s) const {
    require(KvFormat::kBf16, "values_bf16");
    return {v16_.data() + vblock(s), static_cast<std::size_t>(rows(s) * value_dim_)};
  }

  /// Room for `capacity` tokens per sequence (never shrinks; keeps the cached rows). Throws
  /// moe::Error naming the tokens and bytes when they cannot be allocated (the cache is then
  /// unchanged).
  void reserve(Index capacity) {
    if (capacity <= capacity_) return;
    // The bytes asked for, in double (no overflow for any Index); more than 2^62 cannot be
    // addressed, and std::bad_alloc or std::length_error from the allocation itself are caught
    // here, so a caller asking for 2^50 tokens hears what and how much, not a bare bad_alloc.
    double const bytes = static_cast<double>(sequences()) * static_cast<double>(capacity) *
                         static_cast<double>(bytes_per_token());
    auto too_big = [&](auto const& shown, char const* why) {
      detail::fail("KvCache::reserve: room for ", capacity, " tokens x ", sequences(),
                   " sequence(s) x ", bytes_per_token(), " bytes a token = ", shown, " bytes ", why,
                   "; reserve fewer tokens (the context the model will see)");
    };
    if (bytes > 0x1p62) too_big(bytes, "is more than a process can address");
    auto const exact = static_cast<std::uint64_t>(bytes_per_token()) *
                       static_cast<std::uint64_t>(sequences()) *
                       static_cast<std::uint64_t>(capacity);
    // The stores are zero-filled at once: more than the machine's memory cannot be had (and is
    // refused before asking the allocator, which a sanitizer would abort on).
    if (std::uint64_t const ram = physical_memory_bytes(); ram > 0 && exact > ram) {
      std::string const why =
          "is more than this machine's " + std::to_string(ram) + " bytes of memory";
      too_big(exact, why.c_str());
    }
    auto grown = [&](auto const& store, Index width) {
      std::remove_cvref_t<decltype(store)> bigger(
          static_cast<std::size_t>(sequences() * capacity * width));
      for (Index s = 0; s < sequences(); ++s) {
        auto const from = store.begin() + static_cast<std::ptrdiff_t>(s * capacity_ * width);
        std::copy(from, from + rows(s) * width, bigger.begin() + s * capacity * width);
      }
      return bigger;
    };
    try {  // both stores are allocated before either replaces the old one
      if (is_bf16()) {
        auto k = grown(k16_, key_dim_);
        auto v = grown(v16_, value_dim_);
        k16_ = std::move(k);
        v16_ = std::move(v);
      } else {
        auto k = grown(k_, key_dim_);
        auto v = grown(v_, value_dim_);
        k_ = std::move(k);
        v_ = std::move(v);
      }
    } catch (std::bad_alloc const&) {
      too_big(exact, "cannot be allocated (out of memory)");
    } catch (std::length_error const&) {
      too_big(exact, "is more than a vector can hold");
    }
    capacity_ = capacity;
  }
  /// Empties every sequence (the memory stays).
  void clear() {
    std::fill(length_.begin(), length_.end(), 0);
    std::fill(first_.begin(), first_.end(), 0);
  }
  /// Empties sequence s.
  void reset(Index s) { length_[checked(s)] = first_[checked(s)] = 0; }
  /// Keeps the first n tokens of sequence s (first(s) <= n <= length(s)), e.g. to roll back a
  /// step. With a window the tokens before first(s) are gone: n must not go below it.
  void truncate(Index s, Index n) {
    detail::check(n >= first(s) && n <= length(s), "KvCache::truncate: ", n,
                  " tokens for sequence ", s, " of length ", length(s), "; keep between ", first(s),
                  first(s) > 0 ? " (the window's oldest kept token)" : "", " and its length");
    length_[checked(s)] = n;
  }

  // For the attention layers: room for `extra` more tokens of sequence s (with a window, first
  // dropping the tokens no query at position >= length(s) can see), and its rows.
  void make_room(Index s, Index extra) {
    if (window_ > 0 && rows(s) + extra > capacity_) {
      Index const keep_from = std::max(first(s), length(s) - window_ + 1);
      Index const drop = keep_from - first(s), kept = rows(s) - drop;
      if (drop > 0) {
        auto shift = [&](auto& store, std::ptrdiff_t block, Index width) {
          auto const base = store.begin() + block;
          std::copy(base + drop * width, base + (drop + kept) * width, base);
        };
        if (is_bf16()) {
          shift(k16_, kblock(s), key_dim_);
          shift(v16_, vblock(s), value_dim_);
        } else {
          shift(k_, kblock(s), key_dim_);
          shift(v_, vblock(s), value_dim_);
        }
        first_[static_cast<std::size_t>(s)] = keep_from;
      }
    }
    Index const need = rows(s) + extra;
    if (need > capacity_) reserve(std::max(need, 2 * capacity_));
  }
  /// The key (value) of sequence s at position pos = key[0, key_dim) (value[0, value_dim)),
  /// rounded to bf16 in a bf16 cache; first(s) <= pos < first(s) + capacity() (make_room first).
  void store_key(Index s, Index pos, float const* key) {
    store(k_, k16_, kblock(s) + (pos - first(s)) * key_dim_, key, key_dim_);
  }
  void store_value(Index s, Index pos, float const* value) {
    store(v_, v16_, vblock(s) + (pos - first(s)) * value_dim_, value, value_dim_);
  }
  /// Sequence s's key and value rows from position first(s) (fp32 cache; null in a bf16 one) ...
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
  KvCache(Index sequences, Index key_dim, Index value_dim, Index capacity, KvFormat format,
          Index window)
      : key_dim_(key_dim), value_dim_(value_dim), window_(window), format_(format) {
    detail::check(sequences >= 0 && key_dim >= 1 && value_dim >= 0 && capacity >= 0 && window >= 0,
                  "KvCache: sequences = ", sequences, ", key width = ", key_dim,
                  ", value width = ", value_dim, ", capacity = ", capacity, ", window = ", window,
                  "; the key width must be >= 1 and the others >= 0 (value width 0: keys_only)");
    length_.assign(static_cast<std::size_t>(sequences), 0);
    first_.assign(static_cast<std::size_t>(sequences), 0);
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
  Index window_ = 0;
  KvFormat format_ = KvFormat::kF32;
  Index capacity_ = 0;
  std::vector<Index> length_;
  std::vector<Index> first_;                 ///< the position of each sequence's row 0
  HugePageVector<float> k_, v_;              // KvFormat::kF32
  HugePageVector<std::uint16_t> k16_, v16_;  // KvFormat::kBf16
};

namespace detail {
/// Points SDPA parameters `p` (kernels::SdpaParams) at sequence s's cached keys from column
/// key_col and values from column value_col: k / v in an fp32 cache, k_bf16 / v_bf16 in a bf16
/// one (a template so that this header does not need the kernel's).
template <class Params>
void bind_cached_kv(Params& p, KvCache const& cache, Index s, Index key_col, Index value_col) {
  if (cache.is_bf16()) {
    p.k_bf16 = cache.key_data_bf16(s) + key_col;
    p.v_bf16 = cache.value_data_bf16(s) + value_col;
  } else {
    p.k = cache.key_data(s) + key_col;
    p.v = cache.value_data(s) + value_col;
  }
}

/// Lays out the new rows of a forward_cached call (after check_new_tokens): room in `cache` for
/// each sequence's new tokens (make_room), row_seq[t] the sequence of new row t, row_pos[t] its
/// position (length(s) + i), seq_row0[s] the first new row of sequence s ([sequences + 1]).
inline void place_new_rows(KvCache& cache, std::span<Index const> new_tokens, Index rows,
                           std::vector<Index>& row_seq, std::vector<Index>& row_pos,
                           std::vector<Index>& seq_row0) {
  Index const B = cache.sequences();
  row_seq.resize(static_cast<std::size_t>(rows));
  row_pos.resize(static_cast<std::size_t>(rows));
  seq_row0.assign(static_cast<std::size_t>(B + 1), 0);
  for (Index s = 0, t = 0; s < B; ++s) {
    Index const n = new_tokens[static_cast<std::size_t>(s)];
    cache.make_room(s, n);
    seq_row0[static_cast<std::size_t>(s + 1)] = seq_row0[static_cast<std::size_t>(s)] + n;
    for (Index i = 0; i < n; ++i, ++t) {
      row_seq[static_cast<std::size_t>(t)] = s;
      row_pos[static_cast<std::size_t>(t)] = cache.length(s) + i;
    }
  }
}

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
