// SPDX-License-Identifier: Apache-2.0
// moe::cpu_features against the kernel's own view of the CPU (/proc/cpuinfo: the flags Linux
// reports are the ones CPUID and XCR0 enable for user space) and glibc's cache sizes.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "moe/core/cpu.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/kernels/expert_gemm.hpp"

namespace {

/// The value of the first "key : value" line of /proc/cpuinfo, or empty.
std::string cpuinfo(std::string const& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::size_t const colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    while (!k.empty() && (k.back() == ' ' || k.back() == '\t')) k.pop_back();
    if (k == key) return colon + 2 <= line.size() ? line.substr(colon + 2) : std::string();
  }
  return {};
}

}  // namespace

TEST_CASE("cpu_features: the units Linux reports in /proc/cpuinfo", "[core][cpu]") {
  moe::CpuFeatures const& f = moe::cpu_features();
  INFO(f.describe());
  std::string const flags_line = cpuinfo("flags");
  if (flags_line.empty()) {
    WARN("no /proc/cpuinfo flags on this system: the comparison is skipped");
    return;
  }
  std::set<std::string> flags;
  std::istringstream words(flags_line);
  for (std::string w; words >> w;) flags.insert(w);
  auto has = [&](char const* name) { return flags.count(name) > 0; };
  CHECK(f.avx2 == has("avx2"));
  CHECK(f.fma == has("fma"));
  CHECK(f.f16c == has("f16c"));
  CHECK(f.avx512f == has("avx512f"));
  CHECK(f.avx512bw == has("avx512bw"));
  CHECK(f.avx512vl == has("avx512vl"));
  CHECK(f.avx512dq == has("avx512dq"));
  CHECK(f.avx512_bf16 == has("avx512_bf16"));
  CHECK(f.avx512_vnni == has("avx512_vnni"));
  CHECK(f.avx_vnni == has("avx_vnni"));
  CHECK(f.amx_tile == has("amx_tile"));
  CHECK(f.amx_bf16 == has("amx_bf16"));
  CHECK(f.amx_int8 == has("amx_int8"));
  CHECK(f.vendor == cpuinfo("vendor_id"));
  CHECK(std::to_string(f.family) == cpuinfo("cpu family"));
  CHECK(std::to_string(f.model) == cpuinfo("model"));
  // The brand is CPUID's string (leaves 0x80000002-4, trimmed), which Linux usually shows as the
  // model name; but a guest kernel may show another (one Turin VM: CPUID "Oxide Virtual
  // Turin-like Processor", /proc/cpuinfo "AMD EPYC"), so a difference is only reported.
  CHECK_FALSE(f.brand.empty());
  for (char c : f.brand) CHECK((c >= 0x20 && c < 0x7f));
  if (f.brand != cpuinfo("model name")) {
    WARN("CPUID brand \"" << f.brand << "\" differs from /proc/cpuinfo's model name \""
                          << cpuinfo("model name") << "\"");
  }
  // AMX needs the per-process permission before use; without AMX it is refused.
  if (!f.amx_tile) CHECK_FALSE(moe::request_amx());
  if (f.amx_tile) CHECK(moe::request_amx());
}

TEST_CASE("cpu_features: cache sizes", "[core][cpu]") {
  moe::CpuFeatures const& f = moe::cpu_features();
  INFO(f.describe());
  if (f.llc_bytes == 0) {
    WARN("this machine reports no cache sizes (sysfs and CPUID)");
    return;
  }
  CHECK(f.l1d_bytes > 0);
  CHECK(f.l2_bytes >= f.l1d_bytes);
  CHECK(f.llc_bytes >= f.l2_bytes);
  CHECK(f.llc_level >= 2);
  // glibc reads L1d and L2 from CPUID: they agree with sysfs (the last level need not: a VM's
  // CPUID may describe the host's whole L3).
  long const l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l1 > 0) CHECK(f.l1d_bytes == l1);
  if (l2 > 0) CHECK(f.l2_bytes == l2);
  CHECK(moe::detail::read_cache_size("/nonexistent") == 0);
}

TEST_CASE("compiled_kernels names the build's SIMD width", "[core][cpu]") {
  std::string const k = moe::compiled_kernels();
  CHECK((k.rfind("avx512", 0) == 0 || k.rfind("avx2", 0) == 0 || k.rfind("sse2", 0) == 0 ||
         k.rfind("scalar", 0) == 0));
#if defined(__AVX512F__)
  CHECK(moe::cpu_features().avx512f);  // a build for AVX-512 runs on a CPU that has it
#endif
}

TEST_CASE("bf16 kernel rule: AMX where it runs, else Intel widens and other CPUs use dot products",
          "[core][cpu][bf16]") {
  moe::CpuFeatures intel, amd;
  intel.vendor = "GenuineIntel";
  amd.vendor = "AuthenticAMD";
  using K = moe::Bf16Kernel;
  CHECK(moe::choose_bf16_kernel(intel, nullptr, true) == K::kWiden);
  CHECK(moe::choose_bf16_kernel(amd, nullptr, true) == K::kDotProducts);
  CHECK(moe::choose_bf16_kernel(amd, "", true) == K::kDotProducts);
  CHECK(moe::choose_bf16_kernel(intel, "dot", true) == K::kDotProducts);
  CHECK(moe::choose_bf16_kernel(amd, "widen", true) == K::kWiden);
  // Without AVX512-BF16 kernels in the build there is only widening.
  CHECK(moe::choose_bf16_kernel(amd, nullptr, false) == K::kWiden);
  CHECK(moe::choose_bf16_kernel(amd, "dot", false) == K::kWiden);
  // AMX tiles wherever they can run, unless another kernel is asked for; "amx" where they
  // cannot run is the CPU's default.
  CHECK(moe::choose_bf16_kernel(intel, nullptr, true, true) == K::kAmx);
  CHECK(moe::choose_bf16_kernel(intel, "amx", true, true) == K::kAmx);
  CHECK(moe::choose_bf16_kernel(intel, "dot", true, true) == K::kDotProducts);
  CHECK(moe::choose_bf16_kernel(intel, "widen", true, true) == K::kWiden);
  CHECK(moe::choose_bf16_kernel(intel, "amx", true, false) == K::kWiden);
  CHECK(moe::choose_bf16_kernel(amd, "amx", true, false) == K::kDotProducts);
  CHECK(moe::choose_bf16_kernel(amd, "amx", false, false) == K::kWiden);
  CHECK_THROWS_WITH(moe::choose_bf16_kernel(amd, "fast", true),
                    Catch::Contains("MOE_BF16_KERNEL is \"fast\"") && Catch::Contains("\"dot\"") &&
                        Catch::Contains("\"widen\"") && Catch::Contains("\"amx\""));
  // The process's choice is the rule applied to this CPU and environment, and the kernels and
  // the description follow it.
  K const k = moe::choose_bf16_kernel(moe::cpu_features(), std::getenv("MOE_BF16_KERNEL"),
                                      moe::compiled_bf16_dot_products(), moe::amx_bf16_usable());
  CHECK(moe::bf16_kernel() == k);
  CHECK(moe::kernels::bf16_dot_products() == (k != K::kWiden));
  CHECK(moe::kernels::bf16_amx() == (k == K::kAmx));
  char const* const described = k == K::kDotProducts ? "vdpbf16ps dot products"
                                : k == K::kAmx       ? "AMX tiles"
                                                     : "widened to fp32";
  CHECK(moe::compiled_kernels().find(described) != std::string::npos);
  // A build with AMX kernels running on an AMX CPU under Linux gets tile data.
  if (moe::compiled_amx_bf16() && moe::cpu_features().amx_bf16) CHECK(moe::amx_bf16_usable());
}

TEST_CASE("quant kernel rule: AMX tiles where they run, else VNNI, else portable",
          "[core][cpu][quant]") {
  using K = moe::QuantKernel;
  CHECK(moe::choose_quant_kernel(nullptr, K::kVnni, true) == K::kAmx);
  CHECK(moe::choose_quant_kernel("", K::kVnni, false) == K::kVnni);
  CHECK(moe::choose_quant_kernel("vnni", K::kVnni, true) == K::kVnni);
  CHECK(moe::choose_quant_kernel("amx", K::kVnni, true) == K::kAmx);
  CHECK(moe::choose_quant_kernel("amx", K::kVnni, false) == K::kVnni);  // AMX cannot run here
  CHECK(moe::choose_quant_kernel(nullptr, K::kPortable, false) == K::kPortable);
  CHECK(moe::choose_quant_kernel("amx", K::kPortable, false) == K::kPortable);
  CHECK(moe::choose_quant_kernel(nullptr, K::kAvx2, true) == K::kAvx2);  // AMX needs VNNI builds
  CHECK(moe::choose_quant_kernel("vnni", K::kAvx2, false) == K::kAvx2);
  // What this build compiled: zmm VNNI, ymm (AVX-VNNI or vpmaddubsw) or portable.
  CHECK(moe::compiled_quant_kernel() == (MOE_HAS_AVX512VNNI || MOE_HAS_AVXVNNI ? K::kVnni
                                         : MOE_HAS_AVX2_INT8                   ? K::kAvx2
                                                                               : K::kPortable));
  CHECK(moe::kernels::has_avx2_int8() == (MOE_HAS_AVX2_INT8 != 0));
  CHECK_THROWS_WITH(moe::choose_quant_kernel("avx2", K::kVnni, true),
                    Catch::Contains("MOE_QUANT_KERNEL is \"avx2\"") &&
                        Catch::Contains("\"vnni\"") && Catch::Contains("\"amx\""));
  // The process's choice is the rule applied here; the kernels and the description follow it.
  K const k = moe::choose_quant_kernel(std::getenv("MOE_QUANT_KERNEL"),
                                       moe::compiled_quant_kernel(), moe::amx_int8_usable());
  CHECK(moe::quant_kernel() == k);
  CHECK(moe::kernels::quant_amx() == (k == K::kAmx));
  CHECK((moe::compiled_kernels().find("quantized weights by AMX tiles") != std::string::npos) ==
        (k == K::kAmx));
  CHECK((moe::compiled_kernels().find("quantized weights by AVX2 vpmaddubsw") !=
         std::string::npos) == (k == K::kAvx2));
  CHECK((moe::compiled_kernels().find("quantized weights by portable C++") != std::string::npos) ==
        (k == K::kPortable));
  if (moe::compiled_amx_int8() && moe::cpu_features().amx_int8) CHECK(moe::amx_int8_usable());
}
