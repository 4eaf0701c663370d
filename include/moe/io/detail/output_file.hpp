// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Safe output files: what may be replaced, whether two paths are one file, and the atomic
/// write (temporary file + rename) every moe writer uses.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>

#include "moe/core/error.hpp"

namespace moe::io {

namespace detail {

/// What kind of file `st` describes, for messages.
inline char const* file_kind(struct stat const& st) {
  if (S_ISREG(st.st_mode)) return "a regular file";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISLNK(st.st_mode)) return "a symbolic link";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  return "not a regular file";
}

}  // namespace detail

/// Throws moe::Error unless `path` either does not exist or is a regular file (not a directory,
/// symbolic link, FIFO, socket or device): moe replaces outputs with a new regular file by
/// rename, which would silently replace such an entry (or, for a device as root, destroy it).
/// `where` starts the message.
inline void check_output_path(std::filesystem::path const& path, std::string const& where) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    int const err = errno;
    if (err == ENOENT) return;
    moe::detail::fail(where, ": cannot check the output '", path.string(),
                      "': ", std::strerror(err), "; pass a path in a directory you can write");
  }
  if (!S_ISREG(st.st_mode)) {
    moe::detail::fail(where, ": the output '", path.string(), "' exists and is ",
                      detail::file_kind(st),
                      "; moe writes outputs as new regular files and will not replace it, pass "
                      "another path");
  }
}

/// Whether `a` and `b` name the same file: the same device and inode (symbolic links followed)
/// when both exist; otherwise the same path once made absolute and normalised (two outputs of
/// one run spelt alike, neither written yet).
inline bool same_file(std::filesystem::path const& a, std::filesystem::path const& b) {
  struct stat sa {
  }, sb{};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) {
    std::error_code ea, eb;  // one is missing: the same path, spelt alike once made absolute
    std::filesystem::path const pa = std::filesystem::absolute(a, ea).lexically_normal();
    std::filesystem::path const pb = std::filesystem::absolute(b, eb).lexically_normal();
    return !ea && !eb && pa == pb;
  }
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/// check_output_path(), and throws moe::Error when `output` is (by device and inode) one of
/// `inputs`: writing it would destroy an input the run reads.
inline void check_output_file(std::filesystem::path const& output,
                              std::span<std::filesystem::path const> inputs,
                              std::string const& where) {
  check_output_path(output, where);
  for (std::filesystem::path const& in : inputs) {
    if (same_file(output, in)) {
      moe::detail::fail(where, ": the output '", output.string(), "' is the input '", in.string(),
                        "'; writing it would destroy that input, pass another output path");
    }
  }
}

namespace detail {

/// Writes a file atomically: `write(FILE*)` fills a new temporary file next to `path` (created
/// exclusively, mode 0666 & ~umask), which is renamed over `path` when everything succeeded;
/// on any failure the temporary is removed and moe::Error names the step and the errno text.
/// `write` returns false when a write failed (errno set). An existing `path` must be a regular
/// file (check_output_path).
template <class Write>
void write_file_atomically(std::filesystem::path const& path, std::string const& where,
                           Write&& write) {
  check_output_path(path, where);
  static std::atomic<unsigned> counter{0};
  std::filesystem::path tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = path;
    tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && (errno != EEXIST || attempt >= 100)) {
      moe::detail::fail(where, ": cannot create '", tmp.string(), "': ", std::strerror(errno),
                        "; check that the directory exists and is writable");
    }
  }
  std::FILE* f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    int const err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    moe::detail::fail(where, ": cannot open '", tmp.string(), "': ", std::strerror(err),
                      "; check the process's limits");
  }
  errno = 0;
  bool ok = write(f);
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  std::error_code ec;
  if (ok) std::filesystem::rename(tmp, path, ec);
  if (!ok || ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    std::string const why = ok ? ec.message() : std::strerror(err != 0 ? err : EIO);
    moe::detail::fail(where, ": writing '", path.string(), "' failed: ", why,
                      ok ? "; check that the output path is a writable file path"
                         : "; check free disk space and permissions");
  }
}

}  // namespace detail
}  // namespace moe::io
