// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The one place that touches version-sensitive xsimd API (8.1 in Debian 12 vs 9+ upstream).
#pragma once

#include <type_traits>
#include <xsimd/xsimd.hpp>

namespace moe::kernels::simd {

/// The SIMD instruction set moe's kernels are compiled for: xsimd's best arch enabled by the
/// consumer's compiler flags (sse2 with no -m flags, avx512bw with -march=native on this CPU).
using DefaultArch = xsimd::default_arch;

template <class T, class Arch = DefaultArch>
using Batch = xsimd::batch<T, Arch>;

/// Horizontal sum of a batch (xsimd::hadd in 8.x, reduce_add from 9.0 on).
template <class B>
inline typename B::value_type reduce_add(B const& b) {
#if XSIMD_VERSION_MAJOR < 9
  return xsimd::hadd(b);
#else
  return xsimd::reduce_add(b);
#endif
}

/// Horizontal maximum of a batch (8.1 has no reduce_max).
template <class B>
inline typename B::value_type reduce_max(B const& b) {
  alignas(64) typename B::value_type lanes[B::size];
  b.store_aligned(lanes);
  typename B::value_type m = lanes[0];
  for (std::size_t i = 1; i < B::size; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

/// Stores b at p (aligned to the batch's size) with a non-temporal (streaming) store where the
/// target has one for this width: the line goes to memory without being read first and without
/// displacing cached data, for large outputs that are not read again soon. Ordinary aligned
/// store otherwise. Follow a run of streaming stores with stream_fence() before another thread
/// reads them.
template <class B>
inline void store_stream(typename B::value_type* p, B const& b) {
  if constexpr (std::is_same_v<typename B::value_type, float>) {
#if defined(__AVX512F__)
    if constexpr (B::size == 16) {
      _mm512_stream_ps(p, b);
      return;
    }
#endif
#if defined(__AVX__)
    if constexpr (B::size == 8) {
      _mm256_stream_ps(p, b);
      return;
    }
#endif
#if defined(__SSE2__)
    if constexpr (B::size == 4) {
      _mm_stream_ps(p, b);
      return;
    }
#endif
  }
  b.store_aligned(p);
}

/// Orders this thread's earlier streaming stores before its later stores (sfence), so that a
/// thread that synchronises with it afterwards sees them.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace moe::kernels::simd
