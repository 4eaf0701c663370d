// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Included at the top of the kernel headers whose SIMD code GCC 12 misreports; pair with
/// diagnostics_pop.hpp at the bottom (not public API; no include guard: pushes and pops nest).
/// GCC 12 reports the deliberately undefined pass-through operand of AVX-512 intrinsics
/// (`_mm512_undefined_ps()` in shuffles and in xsimd's exp and rounding) as (maybe-)uninitialised
/// once they are inlined into our kernels (GCC PR 105593, fixed in GCC 13), so a consumer
/// building with `-Wall -Werror -march=native` would fail on our headers. Nothing else is
/// silenced, and only for GCC < 13.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
