// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// MappedFile: a read-only memory mapping of a whole file (POSIX mmap; a read() fallback).
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/output_file.hpp"

#if __has_include(<sys/mman.h>) && __has_include(<unistd.h>) && __has_include(<fcntl.h>)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define MOE_IO_HAVE_MMAP 1
#else
#include <fstream>
#define MOE_IO_HAVE_MMAP 0
#endif

namespace moe::io::detail {

/// The bytes of a file, mapped read-only (PROT_READ, MAP_PRIVATE) or, where mmap does not
/// exist, read into memory. Move-only; unmaps on destruction.
///
/// Errors throw moe::Error "moe: <context>: cannot <step> '<path>': <strerror>; <hint>".
/// A file that shrinks while mapped makes later reads fault (SIGBUS): do not truncate a
/// checkpoint that is being read.
class MappedFile {
 public:
  MappedFile() = default;

  /// `expected` ends the message for a path that is not a regular file: what to pass instead.
  MappedFile(std::filesystem::path const& path, std::string const& context,
             char const* expected = "the path of a .safetensors file") {
#if MOE_IO_HAVE_MMAP
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (forever); on a
    // regular file it changes nothing, and the mapping never reads through the descriptor.
    int fd = -1;
    do {
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) fail_errno(context, "open", path, errno);
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) {
      int const err = errno;
      ::close(fd);
      fail_errno(context, "stat", path, err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      not_regular(context, path, file_kind(st), expected);
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {  // mmap of length 0 fails with EINVAL; an empty file maps to no bytes
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        int const err = errno;
        ::close(fd);
        fail_errno(context, "mmap", path, err);
      }
      data_ = static_cast<std::byte const*>(p);
    }
    ::close(fd);  // the mapping stays valid
#else
    std::error_code ec;
    if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
      not_regular(context, path, "a directory or device", expected);
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) fail_errno(context, "open", path, errno);
    in.seekg(0, std::ios::end);
    auto const end = in.tellg();
    in.seekg(0, std::ios::beg);
    buffer_.resize(static_cast<std::size_t>(end));
    if (!buffer_.empty() &&
        !in.read(reinterpret_cast<char*>(buffer_.data()), static_cast<std::streamsize>(end))) {
      fail_errno(context, "read", path, errno);
    }
    data_ = buffer_.data();
    size_ = buffer_.size();
#endif
  }

  MappedFile(MappedFile const&) = delete;
  MappedFile& operator=(MappedFile const&) = delete;
  MappedFile(MappedFile&& other) noexcept { swap(other); }
  MappedFile& operator=(MappedFile&& other) noexcept {
    MappedFile tmp(std::move(other));
    swap(tmp);
    return *this;
  }
  ~MappedFile() { release(); }

  std::span<std::byte const> bytes() const noexcept { return {data_, size_}; }

 private:
  void swap(MappedFile& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
#if !MOE_IO_HAVE_MMAP
    std::swap(buffer_, other.buffer_);
#endif
  }

  void release() noexcept {
#if MOE_IO_HAVE_MMAP
    if (data_ != nullptr && size_ > 0) {
      ::munmap(const_cast<std::byte*>(data_), size_);  // NOLINT: munmap takes void*
    }
#endif
    data_ = nullptr;
    size_ = 0;
  }

  [[noreturn]] static void not_regular(std::string const& context,
                                       std::filesystem::path const& path, char const* kind,
                                       char const* expected) {
    moe::detail::fail(context, ": '", path.string(), "' is not a regular file (", kind,
                      "; moe maps whole files, it does not read pipes or devices); pass ",
                      expected);
  }

  [[noreturn]] static void fail_errno(std::string const& context, char const* step,
                                      std::filesystem::path const& path, int err) {
    moe::detail::fail(context, ": cannot ", step, " '", path.string(), "': ", std::strerror(err),
                      "; check that the path exists and is readable");
  }

  std::byte const* data_ = nullptr;
  std::size_t size_ = 0;
#if !MOE_IO_HAVE_MMAP
  std::vector<std::byte> buffer_;
#endif
};

}  // namespace moe::io::detail
