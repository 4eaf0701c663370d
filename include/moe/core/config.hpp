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
