// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The one place that touches version-sensitive xsimd API (8.1 in Debian 12 vs 9+ upstream).
#pragma once

#include <cstdint>
#include <cstring>
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

/// bf16 (the top 16 bits of a float) -> float, exact.
inline float widen_bf16(std::uint16_t h) {
  std::uint32_t const u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// B::size bf16 values at p (no alignment needed) widened to floats, lane i = p[i]: the same
/// batch B::load_unaligned would give from the widened array, so a kernel that reads bf16
/// weights through it computes exactly what it computes from their fp32 copies.
template <class B>
inline B load_bf16(std::uint16_t const* p) {
  static_assert(std::is_same_v<typename B::value_type, float>);
#if defined(__AVX512F__)
  if constexpr (B::size == 16) {
    __m256i const h = _mm256_loadu_si256(reinterpret_cast<__m256i const*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
#if defined(__AVX2__)
  if constexpr (B::size == 8) {
    __m128i const h = _mm_loadu_si128(reinterpret_cast<__m128i const*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
#if defined(__SSE2__)
  if constexpr (B::size == 4) {
    __m128i const h = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(p));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
  }
#endif
  alignas(64) float lanes[B::size];
  for (std::size_t i = 0; i < B::size; ++i) lanes[i] = widen_bf16(p[i]);
  return B::load_aligned(lanes);
}

/// Orders this thread's earlier streaming stores before its later stores (sfence), so that a
/// thread that synchronises with it afterwards sees them.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace moe::kernels::simd
