// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// TensorView (a named, typed, shaped byte span) and its conversions to and from float.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/safetensors/convert.hpp"
#include "moe/io/safetensors/dtype.hpp"

namespace moe::io {

/// One tensor of a safetensors file: a non-owning view of its little-endian, row-major bytes.
///
/// Views handed out by SafetensorsFile point into the file's mapping and live as long as that
/// object; `bytes` has exactly the size dtype x shape implies, and may be unaligned (read it
/// with memcpy or to_float(), never through a reinterpret_cast'ed pointer). The writer takes
/// views too: then `bytes` is the caller's memory.
struct TensorView {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<std::int64_t> shape;  // row-major; [] is a scalar (1 element)
  std::span<std::byte const> bytes;

  /// Product of the shape (1 for a scalar). Throws moe::Error on a negative dimension or when
  /// the product overflows 64 bits (which no view from a validated file has).
  std::int64_t num_elements() const;
};

namespace detail {

/// "[2, 3]".
inline std::string shape_string(std::span<std::int64_t const> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

/// Byte size of a tensor, computed the way the reference reader validates it: the element
/// count is folded left to right with overflow checks, then multiplied by the bit size, which
/// must come out as whole bytes.
struct ByteSize {
  enum class Status : std::uint8_t { kOk, kOverflow, kMisaligned } status = Status::kOk;
  std::uint64_t elements = 0;
  std::uint64_t bytes = 0;
};

template <class Dim>
ByteSize byte_size(Dtype dtype, std::span<Dim const> shape) noexcept {
  ByteSize size;
  std::uint64_t n = 1;
  for (Dim const d : shape) {
    auto const dim = static_cast<std::uint64_t>(d);  // callers reject negative dims first
    if (dim != 0 && n > UINT64_MAX / dim) {
      size.status = ByteSize::Status::kOverflow;
      return size;
    }
    n *= dim;
  }
  size.elements = n;
  std::uint64_t const bits_per = dtype_bits(dtype);
  if (n > UINT64_MAX / bits_per) {
    size.status = ByteSize::Status::kOverflow;
    return size;
  }
  std::uint64_t const bits = n * bits_per;
  if (bits % 8 != 0) {
    size.status = ByteSize::Status::kMisaligned;
    return size;
  }
  size.bytes = bits / 8;
  return size;
}

/// Checks a caller-made view (non-negative dims, no overflow, whole bytes, `bytes` of the right
/// size) and returns its element count; `where` prefixes the error message.
inline std::uint64_t checked_elements(TensorView const& t, std::string const& where) {
  for (std::int64_t const d : t.shape) {
    moe::detail::check(d >= 0, where, ": tensor ", printable_name(t.name), ": shape ",
                       shape_string(t.shape), " has a negative dimension; dimensions are >= 0");
  }
  ByteSize const size = byte_size<std::int64_t>(t.dtype, t.shape);
  moe::detail::check(size.status != ByteSize::Status::kOverflow, where, ": tensor ",
                     printable_name(t.name), ": ", dtype_name(t.dtype), " ", shape_string(t.shape),
                     " has more bytes than fit 64 bits; check the shape");
  moe::detail::check(size.status != ByteSize::Status::kMisaligned, where, ": tensor ",
                     printable_name(t.name), ": ", dtype_name(t.dtype), " ", shape_string(t.shape),
                     " is ", size.elements, " x ", dtype_bits(t.dtype),
                     " bits, not a whole number of bytes; pad the last dimension");
  moe::detail::check(size.bytes == t.bytes.size(), where, ": tensor ", printable_name(t.name),
                     ": holds ", t.bytes.size(), " bytes but ", dtype_name(t.dtype), " ",
                     shape_string(t.shape), " needs ", size.bytes,
                     "; pass exactly (product of shape) x (element size) bytes");
  return size.elements;
}

// Little-endian loads from possibly unaligned memory.
template <class U>
U load_le(std::byte const* p) noexcept {
  U v;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, sizeof(U));
  } else {
    v = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) {
      v = static_cast<U>(v | (static_cast<U>(std::to_integer<unsigned>(p[i])) << (8 * i)));
    }
  }
  return v;
}

template <class U>
void store_le(std::byte* p, U v) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, sizeof(U));
  } else {
    for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
  }
}

// out[i] = convert(load_le<U>(bytes + i * sizeof(U))).
template <class U, class Convert>
void convert_elements(std::byte const* bytes, std::span<float> out, Convert convert) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = convert(load_le<U>(bytes + i * sizeof(U)));
}

}  // namespace detail

inline std::int64_t TensorView::num_elements() const {
  for (std::int64_t const d : shape) {
    moe::detail::check(d >= 0, "safetensors: tensor ", detail::printable_name(name), ": shape ",
                       detail::shape_string(shape),
                       " has a negative dimension; dimensions are >= 0");
  }
  detail::ByteSize const size = detail::byte_size<std::int64_t>(Dtype::kU8, shape);
  moe::detail::check(size.status == detail::ByteSize::Status::kOk && size.elements <= INT64_MAX,
                     "safetensors: tensor ", detail::printable_name(name), ": shape ",
                     detail::shape_string(shape),
                     " has more elements than fit 63 bits; check the shape");
  return static_cast<std::int64_t>(size.elements);
}

/// Converts a tensor to float: out[i] = element i, for every dtype but F4, F6_* and C64
/// (see converts_to_float()).
///
/// F32 is copied, F64 rounded to nearest, F16/BF16/F8_* converted exactly (binary32 holds all
/// their values), integers converted with rounding to nearest, BOOL to 0 or 1 (any non-zero
/// byte is 1). NaN and inf are passed through as stored; nothing is checked or clamped.
/// Preconditions (checked, moe::Error otherwise): `t.bytes` has the size dtype x shape implies
/// and out.size() == t.num_elements(). O(elements); thread-safe (reads `t`, writes `out`).
inline void to_float(TensorView const& t, std::span<float> out) {
  std::string const where = "safetensors: to_float";
  moe::detail::check(converts_to_float(t.dtype), where, ": tensor ", detail::printable_name(t.name),
                     " is ", dtype_name(t.dtype),
                     ", which has no conversion to float; read its bytes directly");
  std::uint64_t const n = detail::checked_elements(t, where);
  moe::detail::check(out.size() == n, where, ": tensor ", detail::printable_name(t.name), " has ",
                     n, " elements but the output span holds ", out.size(),
                     "; size the output with num_elements()");
  std::byte const* p = t.bytes.data();
  switch (t.dtype) {
    case Dtype::kF32:
      if constexpr (std::endian::native == std::endian::little) {
        if (n > 0) std::memcpy(out.data(), p, n * sizeof(float));
      } else {
        detail::convert_elements<std::uint32_t>(
            p, out, [](std::uint32_t v) { return std::bit_cast<float>(v); });
      }
      return;
    case Dtype::kF16:
      detail::convert_elements<std::uint16_t>(p, out, f16_to_float);
      return;
    case Dtype::kBf16:
      detail::convert_elements<std::uint16_t>(p, out, bf16_to_float);
      return;
    case Dtype::kF64:
      detail::convert_elements<std::uint64_t>(
          p, out, [](std::uint64_t v) { return static_cast<float>(std::bit_cast<double>(v)); });
      return;
    case Dtype::kF8E4M3:
      detail::convert_elements<std::uint8_t>(p, out, f8_e4m3_to_float);
      return;
    case Dtype::kF8E5M2:
      detail::convert_elements<std::uint8_t>(p, out, f8_e5m2_to_float);
      return;
    case Dtype::kF8E8M0:
      detail::convert_elements<std::uint8_t>(p, out, f8_e8m0_to_float);
      return;
    case Dtype::kF8E4M3Fnuz:
      detail::convert_elements<std::uint8_t>(p, out, f8_e4m3fnuz_to_float);
      return;
    case Dtype::kF8E5M2Fnuz:
      detail::convert_elements<std::uint8_t>(p, out, f8_e5m2fnuz_to_float);
      return;
    case Dtype::kBool:
      detail::convert_elements<std::uint8_t>(p, out,
                                             [](std::uint8_t v) { return v != 0 ? 1.0f : 0.0f; });
      return;
    case Dtype::kU8:
      detail::convert_elements<std::uint8_t>(p, out,
                                             [](std::uint8_t v) { return static_cast<float>(v); });
      return;
    case Dtype::kI8:
      detail::convert_elements<std::uint8_t>(
          p, out, [](std::uint8_t v) { return static_cast<float>(std::bit_cast<std::int8_t>(v)); });
      return;
    case Dtype::kU16:
      detail::convert_elements<std::uint16_t>(
          p, out, [](std::uint16_t v) { return static_cast<float>(v); });
      return;
    case Dtype::kI16:
      detail::convert_elements<std::uint16_t>(p, out, [](std::uint16_t v) {
        return static_cast<float>(std::bit_cast<std::int16_t>(v));
      });
      return;
    case Dtype::kU32:
      detail::convert_elements<std::uint32_t>(
          p, out, [](std::uint32_t v) { return static_cast<float>(v); });
      return;
    case Dtype::kI32:
      detail::convert_elements<std::uint32_t>(p, out, [](std::uint32_t v) {
        return static_cast<float>(std::bit_cast<std::int32_t>(v));
      });
      return;
    case Dtype::kU64:
      detail::convert_elements<std::uint64_t>(
          p, out, [](std::uint64_t v) { return static_cast<float>(v); });
      return;
    case Dtype::kI64:
      detail::convert_elements<std::uint64_t>(p, out, [](std::uint64_t v) {
        return static_cast<float>(std::bit_cast<std::int64_t>(v));
      });
      return;
    case Dtype::kF4:
    case Dtype::kF6E2M3:
    case Dtype::kF6E3M2:
    case Dtype::kC64:
      break;  // rejected above
  }
}

/// to_float() into a new vector of num_elements() floats.
inline std::vector<float> to_float(TensorView const& t) {
  std::vector<float> out(static_cast<std::size_t>(t.num_elements()));
  to_float(t, out);
  return out;
}

/// Encodes floats as F32, F16, BF16 (both round-to-nearest-even, see float_to_f16() and
/// float_to_bf16()) or F64 (exact), little-endian: the inverse of to_float() for those dtypes.
/// Other dtypes throw moe::Error.
inline std::vector<std::byte> from_float(std::span<float const> values, Dtype dtype) {
  std::vector<std::byte> out;
  switch (dtype) {
    case Dtype::kF32:
      out.resize(values.size() * 4);
      for (std::size_t i = 0; i < values.size(); ++i) {
        detail::store_le(out.data() + 4 * i, std::bit_cast<std::uint32_t>(values[i]));
      }
      return out;
    case Dtype::kF16:
      out.resize(values.size() * 2);
      for (std::size_t i = 0; i < values.size(); ++i) {
        detail::store_le(out.data() + 2 * i, float_to_f16(values[i]));
      }
      return out;
    case Dtype::kBf16:
      out.resize(values.size() * 2);
      for (std::size_t i = 0; i < values.size(); ++i) {
        detail::store_le(out.data() + 2 * i, float_to_bf16(values[i]));
      }
      return out;
    case Dtype::kF64:
      out.resize(values.size() * 8);
      for (std::size_t i = 0; i < values.size(); ++i) {
        detail::store_le(out.data() + 8 * i,
                         std::bit_cast<std::uint64_t>(static_cast<double>(values[i])));
      }
      return out;
    default:
      moe::detail::fail("safetensors: from_float: cannot encode floats as ", dtype_name(dtype),
                        "; use F32, F16, BF16 or F64, or pass the encoded bytes yourself");
  }
}

}  // namespace moe::io
