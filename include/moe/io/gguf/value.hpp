// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GgufValueType and GgufValue: the metadata value types of the GGUF format, and a read-only
/// view of one value of a GgufFile (scalars, strings, arrays, nested arrays).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "moe/core/error.hpp"

namespace moe::io {

/// The type of a GGUF metadata value, with the id the format stores (gguf_type in ggml's gguf.h).
enum class GgufValueType : std::uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,  ///< one byte, 0 or 1
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

/// Whether `id` is a GgufValueType (0..12).
constexpr bool is_gguf_value_type(std::uint32_t id) noexcept { return id <= 12; }

/// "uint8", "int32", "float32", "bool", "string", "array", ... (the names of gguf.md).
constexpr std::string_view gguf_value_type_name(GgufValueType type) noexcept {
  switch (type) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

/// Bytes of a fixed-size value type; 0 for kString and kArray.
constexpr std::size_t gguf_value_type_size(GgufValueType type) noexcept {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

/// Whether `type` is one of the eight integer types (bool is not an integer).
constexpr bool is_gguf_integer(GgufValueType type) noexcept {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

namespace detail {

/// A little-endian unsigned integer of sizeof(U) bytes at `p` (any alignment, any host).
template <class U>
U gguf_load(std::byte const* p) noexcept {
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) {
    v = static_cast<U>(v | (static_cast<U>(std::to_integer<unsigned>(p[i])) << (8 * i)));
  }
  return v;
}

/// One parsed metadata value (GgufFile's storage; GgufValue is the public view of it).
struct GgufNode {
  GgufValueType type = GgufValueType::kUint8;
  GgufValueType element_type = GgufValueType::kUint8;  // arrays
  std::uint64_t count = 0;          // arrays: elements; strings: bytes; scalars: 1
  std::byte const* data = nullptr;  // scalar or string bytes; array of fixed-size elements: first
  std::size_t first = 0;  // array of strings: index into the string pool; of arrays: node index
};

}  // namespace detail

/// A read-only view of one GGUF metadata value: a scalar, a string or an array (whose elements
/// may be arrays). Views of a GgufFile's values stay valid as long as the file object (moves
/// keep them valid); strings point into the file's bytes. Copy it freely.
///
/// The to_*() accessors never throw: they return nullopt when the value is not of a fitting
/// type or out of range. GgufFile's getters (integer(key), string(key), ...) throw moe::Error
/// naming the key instead.
class GgufValue {
 public:
  /// A uint8 0 (a placeholder; GgufFile hands out real values).
  GgufValue() noexcept {
    static constexpr std::byte kZero[8] = {};
    node_.count = 1;
    node_.data = kZero;
  }
  /// For GgufFile: the node and the tables its array elements live in.
  GgufValue(detail::GgufNode const& node, detail::GgufNode const* nodes,
            std::string_view const* strings) noexcept
      : node_(node), nodes_(nodes), strings_(strings) {}

  GgufValueType type() const noexcept { return node_.type; }
  bool is_array() const noexcept { return node_.type == GgufValueType::kArray; }
  /// An array's element type (for a scalar or string: its own type).
  GgufValueType element_type() const noexcept {
    return is_array() ? node_.element_type : node_.type;
  }
  /// An array's element count; 1 for a scalar or a string.
  std::size_t size() const noexcept {
    return is_array() ? static_cast<std::size_t>(node_.count) : 1;
  }

  /// Element `i` of an array. Throws moe::Error when this is not an array or i >= size().
  GgufValue operator[](std::size_t i) const {
    moe::detail::check(is_array() && i < size(), "gguf: element ", i, " of ", describe(),
                       " does not exist; check is_array() and size() first");
    detail::GgufNode const& n = node_;
    if (n.element_type == GgufValueType::kArray) return {nodes_[n.first + i], nodes_, strings_};
    detail::GgufNode element;
    element.type = element.element_type = n.element_type;
    if (n.element_type == GgufValueType::kString) {
      std::string_view const s = strings_[n.first + i];
      element.count = s.size();
      element.data = reinterpret_cast<std::byte const*>(s.data());
    } else {
      element.count = 1;
      element.data = n.data + i * gguf_value_type_size(n.element_type);
    }
    return {element, nodes_, strings_};
  }

  /// The value as an unsigned integer: any integer type holding a value >= 0.
  std::optional<std::uint64_t> to_uint64() const noexcept {
    if (!is_gguf_integer(type())) return std::nullopt;
    if (is_signed()) {
      std::int64_t const v = signed_value();
      if (v < 0) return std::nullopt;
      return static_cast<std::uint64_t>(v);
    }
    return unsigned_value();
  }
  /// The value as a signed integer: any integer type holding a value in int64's range.
  std::optional<std::int64_t> to_int64() const noexcept {
    if (!is_gguf_integer(type())) return std::nullopt;
    if (is_signed()) return signed_value();
    std::uint64_t const v = unsigned_value();
    if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return std::nullopt;
    }
    return static_cast<std::int64_t>(v);
  }
  /// The value as a double: a float32, float64 or any integer (large 64-bit integers round).
  std::optional<double> to_double() const noexcept {
    switch (type()) {
      case GgufValueType::kFloat32:
        return static_cast<double>(std::bit_cast<float>(detail::gguf_load<std::uint32_t>(data())));
      case GgufValueType::kFloat64:
        return std::bit_cast<double>(detail::gguf_load<std::uint64_t>(data()));
      default:
        if (!is_gguf_integer(type())) return std::nullopt;
        return is_signed() ? static_cast<double>(signed_value())
                           : static_cast<double>(unsigned_value());
    }
  }
  /// A bool value.
  std::optional<bool> to_bool() const noexcept {
    if (type() != GgufValueType::kBool) return std::nullopt;
    return std::to_integer<unsigned>(data()[0]) != 0;
  }
  /// A string value (bytes as stored: the format says UTF-8, the reader does not check it).
  std::optional<std::string_view> to_string() const noexcept {
    if (type() != GgufValueType::kString) return std::nullopt;
    return std::string_view(reinterpret_cast<char const*>(node_.data),
                            static_cast<std::size_t>(node_.count));
  }
  /// The elements of an array of strings, as views into the file (empty for anything else).
  /// O(1): the reader indexed them while validating, so a 150k-token vocabulary costs nothing
  /// more here.
  std::span<std::string_view const> strings() const noexcept {
    if (!is_array() || node_.element_type != GgufValueType::kString) return {};
    return {strings_ + node_.first, static_cast<std::size_t>(node_.count)};
  }
  /// The little-endian bytes of a fixed-size scalar, or of all elements of an array of a
  /// fixed-size type (empty for strings and arrays of strings or arrays).
  std::span<std::byte const> raw() const noexcept {
    std::size_t const width = gguf_value_type_size(element_type());
    if (width == 0) return {};
    return {node_.data, width * size()};
  }

  /// "uint32", "string", "array of 3 float32", "array of 2 array": for messages.
  std::string describe() const {
    if (!is_array()) return std::string(gguf_value_type_name(type()));
    std::string out = "array of " + std::to_string(size()) + " ";
    out += gguf_value_type_name(node_.element_type);
    return out;
  }

 private:
  std::byte const* data() const noexcept { return node_.data; }

  bool is_signed() const noexcept {
    GgufValueType const t = type();
    return t == GgufValueType::kInt8 || t == GgufValueType::kInt16 || t == GgufValueType::kInt32 ||
           t == GgufValueType::kInt64;
  }
  std::uint64_t unsigned_value() const noexcept {
    switch (gguf_value_type_size(type())) {
      case 1:
        return detail::gguf_load<std::uint8_t>(data());
      case 2:
        return detail::gguf_load<std::uint16_t>(data());
      case 4:
        return detail::gguf_load<std::uint32_t>(data());
      default:
        return detail::gguf_load<std::uint64_t>(data());
    }
  }
  std::int64_t signed_value() const noexcept {
    switch (gguf_value_type_size(type())) {
      case 1:
        return static_cast<std::int8_t>(detail::gguf_load<std::uint8_t>(data()));
      case 2:
        return static_cast<std::int16_t>(detail::gguf_load<std::uint16_t>(data()));
      case 4:
        return static_cast<std::int32_t>(detail::gguf_load<std::uint32_t>(data()));
      default:
        return static_cast<std::int64_t>(detail::gguf_load<std::uint64_t>(data()));
    }
  }

  // A copy of the node (elements of arrays of scalars and strings have no stored node), and the
  // tables of the file its array elements live in.
  detail::GgufNode node_{};
  detail::GgufNode const* nodes_ = nullptr;
  std::string_view const* strings_ = nullptr;
};

}  // namespace moe::io
