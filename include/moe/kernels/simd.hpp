// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// The one place that touches version-sensitive xsimd API (8.1 in Debian 12 vs 9+ upstream).
#pragma once

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

}  // namespace moe::kernels::simd
