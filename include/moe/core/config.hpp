// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Version numbers and the few macros moe uses.
#pragma once

#define MOE_VERSION_MAJOR 0
#define MOE_VERSION_MINOR 1
#define MOE_VERSION_PATCH 0

#if defined(__GNUC__) || defined(__clang__)
#define MOE_ALWAYS_INLINE inline __attribute__((always_inline))
#define MOE_RESTRICT __restrict__
#else
#define MOE_ALWAYS_INLINE inline
#define MOE_RESTRICT
#endif

// A build for x86-64 without AVX2 runs every kernel on SSE2, several times slower than the AVX2
// and AVX-512 kernels most machines can run: said at compile time (a note, not a warning, so
// -Werror builds go on). Silence it with -DMOE_NO_ARCH_WARNING (moe's own SSE2 builds do), or
// build with -march=native (or the -march of the machines you target).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__AVX2__) && !defined(MOE_NO_ARCH_WARNING)
#pragma message( \
    "moe: compiled without AVX2 (no -march flag?): the kernels run on SSE2, several times slower than on AVX2 / AVX-512; build with -march=native (CMake: link moe::native) or define MOE_NO_ARCH_WARNING to silence this")
#endif

// The units this build's kernels are compiled for (the compiler's target flags); whether the CPU
// running them has them is asked at run time (kernels/dispatch.hpp: bf16_kernel(),
// amx_bf16_usable(), quant_kernel()).
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define MOE_HAS_AVX512BF16 1  ///< AVX512-BF16 dot products (vdpbf16ps)
#else
#define MOE_HAS_AVX512BF16 0
#endif
#if MOE_HAS_AVX512BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MOE_HAS_AMX_BF16 1  ///< AMX bf16 tiles (tdpbf16ps)
#else
#define MOE_HAS_AMX_BF16 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define MOE_HAS_AVX512VNNI 1  ///< AVX512-VNNI integer dot products (vpdpbusd)
#else
#define MOE_HAS_AVX512VNNI 0
#endif
// AVX-VNNI (VEX vpdpbusd on ymm: Alder Lake and later client cores, Sierra Forest, Zen 5) in a
// build without AVX-512 (-march=alderlake, or -march=x86-64-v3 -mavxvnni): the ymm kernel of
// quantized weights. An AVX-512 build uses the zmm kernel instead.
#if !MOE_HAS_AVX512VNNI && defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#define MOE_HAS_AVXVNNI 1  ///< AVX-VNNI integer dot products on ymm (AVX2 builds)
#else
#define MOE_HAS_AVXVNNI 0
#endif
// The ymm integer kernel of quantized weights in an AVX2 build without AVX512-VNNI (AVX2 machines,
// and AVX-512 ones without VNNI such as Skylake-SP): vpdpbusd where MOE_HAS_AVXVNNI, else the
// same exact int32 sums by vpmaddubsw + vpmaddwd.
#if !MOE_HAS_AVX512VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MOE_HAS_AVX2_INT8 1  ///< AVX2 integer kernels for quantized weights (ymm)
#else
#define MOE_HAS_AVX2_INT8 0
#endif
#if MOE_HAS_AVX512VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define MOE_HAS_AMX_INT8 1  ///< AMX int8 tiles (tdpbssd)
#else
#define MOE_HAS_AMX_INT8 0
#endif
