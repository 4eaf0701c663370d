// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Storage for expert weights: 64-byte aligned, and large blocks backed by transparent huge
/// pages where the system has them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace moe {

/// The machine's physical memory in bytes (sysconf), or 0 when it cannot be read: a buffer
/// that is zero-filled at once (a KV cache, a layer's weights) and larger than this cannot be
/// had, whatever the allocator's overcommit would promise.
inline std::uint64_t physical_memory_bytes() noexcept {
#if defined(__unix__) && defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  long const pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
  }
#endif
  return 0;
}

/// Bytes of one transparent huge page on x86-64 Linux.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

/// Allocator of 64-byte aligned storage. Blocks of at least kHugePageBytes are aligned to and
/// padded to whole 2 MiB pages and, on Linux, advised as transparent huge pages
/// (madvise(MADV_HUGEPAGE); honoured when /sys/kernel/mm/transparent_hugepage/enabled is
/// `always` or `madvise`, ignored otherwise). Streaming an expert's weights then walks one page
/// table entry per 2 MiB instead of per 4 KiB: with 256 experts the weights of a layer are
/// hundreds of MB, touched once per forward, so 4 KiB pages miss the TLB on nearly every page.
/// Elsewhere (or if madvise fails) the storage is plain aligned memory; results never depend on
/// which. Stateless: every instance compares equal.
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() noexcept = default;
  template <class U>
  HugePageAllocator(HugePageAllocator<U> const&) noexcept {}  // NOLINT: rebinding is implicit

  static std::size_t block_bytes(std::size_t n) {
    std::size_t const bytes = n * sizeof(T);
    std::size_t const align = alignment(bytes);
    return (bytes + align - 1) / align * align;
  }
  static std::size_t alignment(std::size_t bytes) {
    return bytes >= kHugePageBytes ? kHugePageBytes : std::size_t{64};
  }

  T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T) - kHugePageBytes) {
      throw std::bad_array_new_length();
    }
    std::size_t const bytes = block_bytes(n);
    void* p = std::aligned_alloc(alignment(n * sizeof(T)), bytes == 0 ? 64 : bytes);
    if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= kHugePageBytes) (void)madvise(p, bytes, MADV_HUGEPAGE);  // a hint only
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }

  template <class U>
  bool operator==(HugePageAllocator<U> const&) const noexcept {
    return true;
  }
};

/// A vector of weights in HugePageAllocator storage.
template <class T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace moe
