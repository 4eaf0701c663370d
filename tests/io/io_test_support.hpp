// SPDX-License-Identifier: Apache-2.0
// Helpers for the safetensors tests and the fuzz-corpus generator: hand-built file images and
// a per-test scratch directory. No Catch2 here (make_corpus.cpp uses it too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace iotest {

/// Bytes from a string literal (which may hold NULs when given with its size).
inline std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> out(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) out[i] = static_cast<std::byte>(s[i]);
  return out;
}

/// A file image: the little-endian u64 `header_length`, then `header`, then `data`.
inline std::vector<std::byte> image(std::uint64_t header_length, std::string_view header,
                                    std::vector<std::byte> const& data = {}) {
  std::vector<std::byte> out;
  for (int i = 0; i < 8; ++i)
    out.push_back(static_cast<std::byte>((header_length >> (8 * i)) & 0xFF));
  for (char const c : header) out.push_back(static_cast<std::byte>(c));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

/// A file image whose length field is the header's real length.
inline std::vector<std::byte> image(std::string_view header,
                                    std::vector<std::byte> const& data = {}) {
  return image(header.size(), header, data);
}

/// `n` bytes 0, 1, 2, ... (mod 256).
inline std::vector<std::byte> ramp(std::size_t n) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>(i & 0xFF);
  return out;
}

inline void write_file(std::filesystem::path const& path, std::span<std::byte const> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

inline void write_text(std::filesystem::path const& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

inline std::vector<std::byte> read_file(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(chars.size());
  for (std::size_t i = 0; i < chars.size(); ++i) out[i] = static_cast<std::byte>(chars[i]);
  return out;
}

#ifdef MOE_IO_TEST_TMP
/// A fresh, empty directory under the build tree for one test (ctest runs tests in parallel,
/// so each test names its own).
inline std::filesystem::path scratch_dir(std::string const& name) {
  std::filesystem::path const dir = std::filesystem::path(MOE_IO_TEST_TMP) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
#endif

}  // namespace iotest
