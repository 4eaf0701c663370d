// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// fill_uniform: fast, seeded, reproducible random weights for examples, tests and benchmarks.
#pragma once

#include <cstdint>
#include <span>

namespace moe {

/// Fills `out` with values uniform in [lo, hi) from a SplitMix64 stream seeded with `seed`.
/// The same seed gives the same values on every platform. Not for cryptography.
inline void fill_uniform(std::span<float> out, float lo, float hi, std::uint64_t seed) {
  std::uint64_t state = seed;
  float const scale = (hi - lo) / 16777216.0f;  // 2^24
  for (float& v : out) {
    state += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    v = lo + static_cast<float>(z >> 40) * scale;
  }
}

}  // namespace moe
