// SPDX-License-Identifier: Apache-2.0
// GGUF file images built byte by byte, independently of moe's writer: for the hand-built and
// malformed-file tests and the fuzz corpus generator. No Catch2 here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace iotest {

/// Appends little-endian fields to a byte vector.
struct GgufBytes {
  std::vector<std::byte> bytes;

  GgufBytes& raw(std::string_view s) {
    for (char const c : s) bytes.push_back(static_cast<std::byte>(c));
    return *this;
  }
  GgufBytes& u8(std::uint8_t v) {
    bytes.push_back(static_cast<std::byte>(v));
    return *this;
  }
  GgufBytes& u16(std::uint16_t v) { return le(v, 2); }
  GgufBytes& u32(std::uint32_t v) { return le(v, 4); }
  GgufBytes& u64(std::uint64_t v) { return le(v, 8); }
  GgufBytes& i64(std::int64_t v) { return le(static_cast<std::uint64_t>(v), 8); }
  GgufBytes& f32(float v) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &v, 4);
    return u32(bits);
  }
  /// A GGUF string: u64 length, bytes.
  GgufBytes& str(std::string_view s) { return u64(s.size()).raw(s); }
  /// Zero bytes up to a multiple of `alignment`.
  GgufBytes& pad(std::size_t alignment) {
    while (bytes.size() % alignment != 0) bytes.push_back(std::byte{0});
    return *this;
  }
  /// "GGUF", version, tensor count, metadata count.
  GgufBytes& header(std::uint32_t version, std::uint64_t n_tensors, std::uint64_t n_kv) {
    return raw("GGUF").u32(version).u64(n_tensors).u64(n_kv);
  }
  /// A tensor info: name, n_dims, ne..., type, offset.
  GgufBytes& tensor(std::string_view name, std::vector<std::int64_t> const& ne, std::uint32_t type,
                    std::uint64_t offset) {
    str(name).u32(static_cast<std::uint32_t>(ne.size()));
    for (std::int64_t const d : ne) i64(d);
    return u32(type).u64(offset);
  }

 private:
  GgufBytes& le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xFF));
    return *this;
  }
};

}  // namespace iotest
