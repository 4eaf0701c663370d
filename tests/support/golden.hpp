// SPDX-License-Identifier: Apache-2.0
// Golden hashes: 64-bit FNV-1a digests of a layer's outputs and gradients on fixed inputs,
// recorded before a refactoring of the pipeline and checked after it, bit for bit.
//
// The bits depend on the SIMD arch the kernels were compiled for (lane counts change the
// dot-product path's sums) and on the bf16 kernel this process chose (moe::bf16_kernel(): dot
// products round the activations), so a digest is recorded per arch key (golden_arch()):
// "avx512bw+bf16dp" for dot products, "avx512bw" for widened bf16 (Intel's default; recorded on
// a Zen 5 with MOE_BF16_KERNEL=widen), "avx512bw+bf16amx" for AMX tiles (recorded on a Sapphire
// Rapids), "fma3+avx2" (a release build on an AVX2-only AMD EPYC), and "+nocontract" after any of
// them where the compiler does not contract a * b + c into FMAs (GCC at -O1: the sanitizer
// presets; "fma3+avx2+nocontract" is theirs). On an arch with no recorded digests the test
// says so (WARN) and prints what to record; on a recorded arch any difference fails. Print every
// digest with MOE_GOLDEN_PRINT=1 in the environment.
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "moe/kernels/expert_gemm.hpp"
#include "moe/kernels/simd.hpp"

namespace test {

/// Running FNV-1a 64 digest over float buffers (their bytes, so -0 and NaN payloads count).
class Digest {
 public:
  void add(float const* p, std::size_t n) {
    auto const* b = reinterpret_cast<unsigned char const*>(p);
    for (std::size_t i = 0; i < n * sizeof(float); ++i) {
      h_ = (h_ ^ b[i]) * 0x100000001b3ull;
    }
  }
  void add(std::span<float const> s) { add(s.data(), s.size()); }
  void add(std::span<float> s) { add(s.data(), s.size()); }
  void add(double v) {
    float const f = static_cast<float>(v);
    add(&f, 1);
  }
  std::uint64_t value() const { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

/// Does the compiler contract a * b + c into one FMA in code compiled with this translation
/// unit's flags (GCC's default -ffp-contract=fast does at -O2 and above, not at -O1)? The
/// kernels' scalar and generic xsimd code is compiled with the same flags, and their bits
/// depend on it. a * a = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 (a tie, to even), so the sum is
/// 0 unless fused.
inline bool compiler_contracts_fma() {
  float volatile va = 1.0f + 0x1p-12f, vc = -(1.0f + 0x1p-11f);
  float const a = va, c = vc;
  return a * a + c != 0.0f;
}

/// The arch key digests are recorded under: xsimd's default arch, "+bf16dp" when bf16 panels
/// are multiplied by AVX512-BF16 dot products in this process, "+bf16amx" by AMX tiles, then
/// "+nocontract" where compiler_contracts_fma() is false.
inline std::string golden_arch() {
  std::string a = moe::kernels::simd::DefaultArch::name();
  if (moe::kernels::bf16_amx()) {
    a += "+bf16amx";
  } else if (moe::kernels::bf16_dot_products()) {
    a += "+bf16dp";
  }
  if (!compiler_contracts_fma()) a += "+nocontract";
  return a;
}

struct GoldenEntry {
  char const* arch;
  char const* name;
  std::uint64_t digest;
};

/// Checks `digest` of case `name` against the table: equal where the arch has digests.
template <std::size_t N>
void check_golden(GoldenEntry const (&table)[N], std::string_view name, std::uint64_t digest) {
  std::string const arch = golden_arch();
  bool arch_known = false;
  GoldenEntry const* hit = nullptr;
  for (auto const& e : table) {
    if (arch != e.arch) continue;
    arch_known = true;
    if (name == e.name) hit = &e;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(digest));
  if (std::getenv("MOE_GOLDEN_PRINT")) {
    std::printf("    {\"%s\", \"%.*s\", %sull},\n", arch.c_str(), static_cast<int>(name.size()),
                name.data(), buf);
  }
  if (!arch_known) {
    WARN("no golden digests recorded for arch " << arch << "; case " << name << " = " << buf);
    return;
  }
  INFO("golden case " << name << " on " << arch << ": got " << buf);
  REQUIRE(hit != nullptr);
  CHECK(hit->digest == digest);
}

}  // namespace test
