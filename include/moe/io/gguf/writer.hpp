// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GgufWriter: writes GGUF files (version 3, or 2 on request) that llama.cpp and GgufFile read:
/// metadata of every type (nested arrays too), tensors of any ggml type given as raw bytes,
/// the alignment honoured, written atomically; and the split.* keys of a sharded model.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/output_file.hpp"
#include "moe/io/gguf/file.hpp"
#include "moe/io/gguf/value.hpp"
#include "moe/quant/ggml_type.hpp"

namespace moe::io {

/// An owned GGUF metadata value, for GgufWriter: a scalar, a string or an array.
///
///   GgufMetadataValue(std::uint32_t{32})        uint32 (the C++ type picks the GGUF type)
///   GgufMetadataValue(1.0e-6f)                  float32
///   GgufMetadataValue("llama")                  string
///   GgufMetadataValue::array<std::int32_t>({1, 2, 3})
///   GgufMetadataValue::array(std::vector<std::string>{"<s>", "</s>"})
///   GgufMetadataValue::array(std::vector<GgufMetadataValue>{...})   an array of arrays
class GgufMetadataValue {
 public:
  /// A uint8 0.
  GgufMetadataValue() : raw_(1) {}

  /// A scalar: bool -> bool, (u)int8..(u)int64 by size and signedness, float -> float32,
  /// double -> float64.
  template <class T>
  requires std::is_arithmetic_v<T> GgufMetadataValue(
      T value)  // NOLINT(google-explicit-constructor): a value is its scalar
      : type_(type_of<T>()), element_type_(type_), raw_(sizeof(T)) {
    store(raw_.data(), value);
  }
  /// A string.
  GgufMetadataValue(std::string value)  // NOLINT(google-explicit-constructor)
      : type_(GgufValueType::kString), element_type_(type_), string_(std::move(value)) {}
  GgufMetadataValue(std::string_view value)  // NOLINT(google-explicit-constructor)
      : GgufMetadataValue(std::string(value)) {}
  GgufMetadataValue(char const* value)  // NOLINT(google-explicit-constructor)
      : GgufMetadataValue(std::string(value)) {}

  /// An array of scalars of one type.
  template <class T>
  requires std::is_arithmetic_v<T>
  static GgufMetadataValue array(std::span<T const> values) {
    GgufMetadataValue v = array_of(type_of<T>(), values.size());
    v.raw_.resize(values.size() * sizeof(T));
    for (std::size_t i = 0; i < values.size(); ++i) store(v.raw_.data() + i * sizeof(T), values[i]);
    return v;
  }
  template <class T>
  requires std::is_arithmetic_v<T>
  static GgufMetadataValue array(std::initializer_list<T> values) {
    return array(std::span<T const>(values.begin(), values.size()));
  }
  template <class T>
  requires std::is_arithmetic_v<T>
  static GgufMetadataValue array(std::vector<T> const& values) {
    return array(std::span<T const>(values));
  }
  /// An array of bools (std::vector<bool> has no span).
  static GgufMetadataValue bools(std::vector<bool> const& values) {
    GgufMetadataValue v = array_of(GgufValueType::kBool, values.size());
    v.raw_.resize(values.size());
    for (std::size_t i = 0; i < values.size(); ++i)
      v.raw_[i] = values[i] ? std::byte{1} : std::byte{0};
    return v;
  }
  /// An array of strings.
  static GgufMetadataValue array(std::vector<std::string> values) {
    GgufMetadataValue v = array_of(GgufValueType::kString, values.size());
    v.strings_ = std::move(values);
    return v;
  }
  /// An array of arrays (each element must itself be an array; their element types may differ).
  static GgufMetadataValue array(std::vector<GgufMetadataValue> values) {
    for (GgufMetadataValue const& e : values) {
      moe::detail::check(e.type_ == GgufValueType::kArray,
                         "gguf: GgufMetadataValue::array: ", "an element is a ",
                         gguf_value_type_name(e.type_),
                         "; an array of values holds arrays only (pass scalars as a span)");
    }
    GgufMetadataValue v = array_of(GgufValueType::kArray, values.size());
    v.arrays_ = std::move(values);
    return v;
  }
  /// An empty array of `element` (for kArray: an empty array of arrays).
  static GgufMetadataValue empty_array(GgufValueType element) { return array_of(element, 0); }

  /// A deep copy of a value read from a file.
  static GgufMetadataValue from(GgufValue const& value) {
    if (!value.is_array()) {
      GgufMetadataValue v;
      v.type_ = v.element_type_ = value.type();
      if (value.type() == GgufValueType::kString) {
        v.raw_.clear();
        v.string_ = std::string(*value.to_string());
      } else {
        std::span<std::byte const> const raw = value.raw();
        v.raw_.assign(raw.begin(), raw.end());
      }
      return v;
    }
    GgufMetadataValue v = array_of(value.element_type(), value.size());
    if (value.element_type() == GgufValueType::kString) {
      std::span<std::string_view const> const s = value.strings();
      v.strings_.assign(s.begin(), s.end());
    } else if (value.element_type() == GgufValueType::kArray) {
      v.arrays_.reserve(value.size());
      for (std::size_t i = 0; i < value.size(); ++i) v.arrays_.push_back(from(value[i]));
    } else {
      std::span<std::byte const> const raw = value.raw();
      v.raw_.assign(raw.begin(), raw.end());
    }
    return v;
  }

  GgufValueType type() const noexcept { return type_; }
  /// An array's element type (a scalar's or string's own type).
  GgufValueType element_type() const noexcept { return element_type_; }
  /// An array's element count; 1 otherwise.
  std::size_t size() const noexcept { return type_ == GgufValueType::kArray ? count_ : 1; }

  /// Appends the value's encoding (without the leading type id) to `out`.
  void encode(std::vector<std::byte>& out) const {
    if (type_ == GgufValueType::kString) {
      append_string(out, string_);
    } else if (type_ != GgufValueType::kArray) {
      out.insert(out.end(), raw_.begin(), raw_.end());
    } else {
      append_u32(out, static_cast<std::uint32_t>(element_type_));
      append_u64(out, count_);
      if (element_type_ == GgufValueType::kString) {
        for (std::string const& s : strings_) append_string(out, s);
      } else if (element_type_ == GgufValueType::kArray) {
        for (GgufMetadataValue const& a : arrays_) a.encode(out);
      } else {
        out.insert(out.end(), raw_.begin(), raw_.end());
      }
    }
  }

  static void append_u32(std::vector<std::byte>& out, std::uint32_t v) { append_le(out, v); }
  static void append_u64(std::vector<std::byte>& out, std::uint64_t v) { append_le(out, v); }
  static void append_string(std::vector<std::byte>& out, std::string_view s) {
    append_u64(out, s.size());
    auto const* p = reinterpret_cast<std::byte const*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }

 private:
  template <class T>
  static constexpr GgufValueType type_of() {
    if constexpr (std::is_same_v<T, bool>) {
      return GgufValueType::kBool;
    } else if constexpr (std::is_floating_point_v<T>) {
      static_assert(sizeof(T) == 4 || sizeof(T) == 8, "GGUF has float32 and float64 only");
      return sizeof(T) == 4 ? GgufValueType::kFloat32 : GgufValueType::kFloat64;
    } else {
      constexpr bool s = std::is_signed_v<T>;
      if constexpr (sizeof(T) == 1) return s ? GgufValueType::kInt8 : GgufValueType::kUint8;
      if constexpr (sizeof(T) == 2) return s ? GgufValueType::kInt16 : GgufValueType::kUint16;
      if constexpr (sizeof(T) == 4) return s ? GgufValueType::kInt32 : GgufValueType::kUint32;
      if constexpr (sizeof(T) == 8) return s ? GgufValueType::kInt64 : GgufValueType::kUint64;
      static_assert(sizeof(T) <= 8, "GGUF integers are at most 64 bits");
    }
  }

  template <class T>
  static void store(std::byte* p, T value) {
    if constexpr (std::is_same_v<T, bool>) {
      p[0] = value ? std::byte{1} : std::byte{0};
    } else {
      using U = std::conditional_t<
          sizeof(T) == 1, std::uint8_t,
          std::conditional_t<sizeof(T) == 2, std::uint16_t,
                             std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>>;
      auto const bits = std::bit_cast<U>(value);
      for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::byte>(bits >> (8 * i));
    }
  }

  template <class U>
  static void append_le(std::vector<std::byte>& out, U v) {
    for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<std::byte>(v >> (8 * i)));
  }

  static GgufMetadataValue array_of(GgufValueType element, std::size_t count) {
    GgufMetadataValue v;
    v.type_ = GgufValueType::kArray;
    v.element_type_ = element;
    v.count_ = count;
    v.raw_.clear();
    return v;
  }

  GgufValueType type_ = GgufValueType::kUint8;
  GgufValueType element_type_ = GgufValueType::kUint8;
  std::size_t count_ = 0;                  // arrays
  std::vector<std::byte> raw_;             // fixed-size scalar, or the elements of such an array
  std::string string_;                     // kString
  std::vector<std::string> strings_;       // array of strings
  std::vector<GgufMetadataValue> arrays_;  // array of arrays
};

/// Collects metadata and tensors and writes one GGUF file.
///
///   GgufWriter w;
///   w.set("general.architecture", "qwen3moe").set("qwen3moe.block_count", std::uint32_t{48});
///   w.add_tensor("blk.0.ffn_down_exps.weight", GgmlType::kQ4_K, {768, 2048, 128}, bytes);
///   w.save("model.gguf");
///
/// Layout: tensors in the order added, each at an offset that is a multiple of the alignment
/// (32 unless set_alignment() or a "general.alignment" key says otherwise), zero padding after
/// the tensor infos and after every tensor, as ggml's gguf_write does. Metadata keys keep the
/// order of their first set(). Checks, each with a moe::Error naming the key or tensor: keys
/// non-empty UTF-8; "general.alignment" a uint32 power of two; tensor names 1..63 bytes of
/// UTF-8 (63: ggml's limit) and unique; 1..4 dimensions, each >= 0, fewer than 2^63 elements;
/// ne[0] a multiple of the type's block; the bytes exactly what type and dimensions need.
class GgufWriter {
 public:
  /// Sets metadata `key` (replacing an earlier value, which keeps its position).
  GgufWriter& set(std::string key, GgufMetadataValue value) {
    std::string const where =
        detail::concat("gguf: GgufWriter: metadata key ", detail::printable_name(key));
    moe::detail::check(!key.empty(), "gguf: GgufWriter: a metadata key is empty; name it");
    moe::detail::check(detail::find_invalid_utf8(key) == std::string_view::npos, where,
                       " is not valid UTF-8; keys are UTF-8 (by convention ASCII)");
    if (key == "general.alignment") {
      std::uint64_t a = 0;
      bool const is_u32 = value.type() == GgufValueType::kUint32;
      if (is_u32) {
        std::vector<std::byte> raw;
        value.encode(raw);
        a = detail::gguf_load<std::uint32_t>(raw.data());
      }
      moe::detail::check(is_u32 && a != 0 && (a & (a - 1)) == 0, where,
                         " must be a uint32 power of two; use set_alignment()");
    }
    if (auto const it = key_index_.find(key); it != key_index_.end()) {
      kvs_[it->second].second = std::move(value);
    } else {
      key_index_.emplace(key, kvs_.size());
      kvs_.emplace_back(std::move(key), std::move(value));
    }
    return *this;
  }

  /// Sets "general.alignment" (a power of two; 32 is the default and then needs no key).
  GgufWriter& set_alignment(std::uint32_t alignment) {
    return set("general.alignment", GgufMetadataValue(alignment));
  }

  /// The format version written: 3 (default) or 2 (the same layout; for old readers and tests).
  GgufWriter& set_version(std::uint32_t version) {
    moe::detail::check(version == 2 || version == 3, "gguf: GgufWriter: version ", version,
                       " cannot be written; pass 2 or 3");
    version_ = version;
    return *this;
  }

  /// Marks this file as shard `split_no` (from 0) of `split_count`, of a model of
  /// `total_tensors` tensors: "split.no" and "split.count" (uint16) and "split.tensors.count"
  /// (int32), as llama.cpp's gguf-split writes them. Name the file gguf_split_path(...)
  /// (moe/io/gguf/model.hpp).
  GgufWriter& set_split(std::uint16_t split_no, std::uint16_t split_count,
                        std::int32_t total_tensors) {
    moe::detail::check(split_count >= 1 && split_no < split_count, "gguf: GgufWriter: split ",
                       split_no, " of ", split_count,
                       " does not exist; split_no counts from 0 to split_count - 1");
    set("split.no", GgufMetadataValue(split_no));
    set("split.count", GgufMetadataValue(split_count));
    return set("split.tensors.count", GgufMetadataValue(total_tensors));
  }

  /// Adds a tensor, copying `bytes`. `ne` is in ggml order (ne[0] the contiguous dimension: a
  /// row-major [rows, cols] matrix is {cols, rows}).
  GgufWriter& add_tensor(std::string name, quant::GgmlType type, std::vector<std::int64_t> ne,
                         std::span<std::byte const> bytes) {
    owned_.emplace_back(std::make_unique<std::vector<std::byte>>(bytes.begin(), bytes.end()));
    return add_tensor_view(std::move(name), type, std::move(ne), *owned_.back());
  }

  /// Adds a tensor whose bytes the caller keeps alive (and unchanged) until the last
  /// serialize() or save(): nothing is copied.
  GgufWriter& add_tensor_view(std::string name, quant::GgmlType type, std::vector<std::int64_t> ne,
                              std::span<std::byte const> bytes) {
    std::string const where =
        detail::concat("gguf: GgufWriter: tensor ", detail::printable_name(name));
    moe::detail::check(!name.empty(), "gguf: GgufWriter: a tensor name is empty; name it");
    moe::detail::check(name.size() < kGgufMaxTensorName, where, ": the name is ", name.size(),
                       " bytes; ggml (llama.cpp) reads names of at most ", kGgufMaxTensorName - 1,
                       " bytes, shorten it");
    moe::detail::check(detail::find_invalid_utf8(name) == std::string_view::npos, where,
                       ": the name is not valid UTF-8");
    moe::detail::check(!tensor_index_.contains(name), where,
                       " is added twice; tensor names must be unique");
    moe::detail::check(ne.size() >= 1 && ne.size() <= kGgufMaxDims, where, " has ", ne.size(),
                       " dimensions; GGUF tensors have 1 to ", kGgufMaxDims);
    quant::GgmlTypeInfo const* info = quant::ggml_type_info(static_cast<std::uint32_t>(type));
    moe::detail::check(info != nullptr, where, ": ggml type ", static_cast<std::uint32_t>(type),
                       " does not exist; pass a GgmlType enumerator");
    std::uint64_t product = 1;
    bool empty = false;
    for (std::size_t d = 0; d < ne.size(); ++d) {
      moe::detail::check(ne[d] >= 0, where, ": ne[", d, "] = ", ne[d], " is negative");
      auto const u = static_cast<std::uint64_t>(ne[d]);
      if (u == 0) {
        empty = true;
        continue;
      }
      moe::detail::check(product <= static_cast<std::uint64_t>(INT64_MAX) / u, where,
                         " has 2^63 or more elements");
      product *= u;
    }
    moe::detail::check(ne[0] % info->block_elements == 0, where, ": ne[0] = ", ne[0],
                       " is not a multiple of ", info->name, "'s block of ", info->block_elements,
                       " elements");
    std::uint64_t const blocks = (empty ? 0 : product) / info->block_elements;
    moe::detail::check(blocks <= UINT64_MAX / info->block_bytes, where,
                       " takes more bytes than fit 64 bits");
    std::uint64_t const expected = blocks * info->block_bytes;
    moe::detail::check(bytes.size() == expected, where, ": ", info->name, " with ", ne.size(),
                       " dimensions needs ", expected, " bytes but ", bytes.size(),
                       " were given; check ne (ggml order: ne[0] is the row length)");
    tensor_index_.emplace(name, tensors_.size());
    tensors_.push_back({std::move(name), type, std::move(ne), bytes});
    return *this;
  }

  std::size_t size() const noexcept { return tensors_.size(); }
  std::size_t metadata_size() const noexcept { return kvs_.size(); }

  /// The whole file.
  std::vector<std::byte> serialize() const {
    std::vector<std::byte> out = header();
    std::uint32_t const a = alignment();
    for (Tensor const& t : tensors_) {
      out.insert(out.end(), t.bytes.begin(), t.bytes.end());
      out.resize(padded(out.size(), a));
    }
    return out;
  }

  /// Writes serialize() to `path` atomically (a temporary file next to it, renamed at the end),
  /// streaming the tensor data. An existing `path` must be a regular file.
  void save(std::filesystem::path const& path) const {
    std::string const where = detail::concat("gguf: ", path.string());
    std::vector<std::byte> const head = header();
    std::uint32_t const a = alignment();
    detail::write_file_atomically(path, where, [&](std::FILE* f) {
      static constexpr std::byte kZeros[256] = {};
      bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size();
      for (Tensor const& t : tensors_) {
        if (!ok) break;
        ok = t.bytes.empty() || std::fwrite(t.bytes.data(), 1, t.bytes.size(), f) == t.bytes.size();
        for (std::size_t pad = padded(t.bytes.size(), a) - t.bytes.size(); ok && pad > 0;) {
          std::size_t const n = pad < sizeof kZeros ? pad : sizeof kZeros;
          ok = std::fwrite(kZeros, 1, n, f) == n;
          pad -= n;
        }
      }
      return ok;
    });
  }

 private:
  struct Tensor {
    std::string name;
    quant::GgmlType type;
    std::vector<std::int64_t> ne;
    std::span<std::byte const> bytes;
  };

  static std::uint64_t padded(std::uint64_t n, std::uint32_t a) { return (n + a - 1) / a * a; }

  std::uint32_t alignment() const {
    auto const it = key_index_.find("general.alignment");
    if (it == key_index_.end()) return kGgufDefaultAlignment;
    std::vector<std::byte> raw;
    kvs_[it->second].second.encode(raw);
    return detail::gguf_load<std::uint32_t>(raw.data());
  }

  // Everything before the data section, padded to the alignment.
  std::vector<std::byte> header() const {
    std::vector<std::byte> out;
    for (char const c : kGgufMagic) out.push_back(static_cast<std::byte>(c));
    GgufMetadataValue::append_u32(out, version_);
    GgufMetadataValue::append_u64(out, tensors_.size());
    GgufMetadataValue::append_u64(out, kvs_.size());
    for (auto const& [key, value] : kvs_) {
      GgufMetadataValue::append_string(out, key);
      GgufMetadataValue::append_u32(out, static_cast<std::uint32_t>(value.type()));
      value.encode(out);
    }
    std::uint32_t const a = alignment();
    std::uint64_t offset = 0;
    for (Tensor const& t : tensors_) {
      GgufMetadataValue::append_string(out, t.name);
      GgufMetadataValue::append_u32(out, static_cast<std::uint32_t>(t.ne.size()));
      for (std::int64_t const d : t.ne)
        GgufMetadataValue::append_u64(out, static_cast<std::uint64_t>(d));
      GgufMetadataValue::append_u32(out, static_cast<std::uint32_t>(t.type));
      GgufMetadataValue::append_u64(out, offset);
      moe::detail::check(offset <= UINT64_MAX - padded(t.bytes.size(), a),
                         "gguf: GgufWriter: the tensors hold more than 2^64 bytes");
      offset += padded(t.bytes.size(), a);
    }
    out.resize(padded(out.size(), a));
    return out;
  }

  std::uint32_t version_ = kGgufVersion;
  std::vector<std::pair<std::string, GgufMetadataValue>> kvs_;
  std::map<std::string, std::size_t, std::less<>> key_index_;
  std::vector<Tensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;
  std::vector<std::unique_ptr<std::vector<std::byte>>> owned_;  // add_tensor()'s copies
};

}  // namespace moe::io
