// SPDX-License-Identifier: Apache-2.0
// The main of the test binaries built for another -march than the host's (the ymm
// quantized kernels: moe_tests_avx2, moe_tests_avxvnni, moe_tests_avx512novnni), compiled
// without -m flags: where the CPU lacks a unit the binary was built for (AVX2, FMA, F16C;
// AVX-VNNI when MOE_TEST_NEEDS_AVXVNNI is 1, AVX-512 when MOE_TEST_NEEDS_AVX512 is 1), it prints
// which and exits with 77, which CTest reports as skipped (SKIP_RETURN_CODE), instead of running
// code compiled for it. Listing the tests (catch_discover_tests) always works. The check reads
// CPUID itself rather than calling moe::cpu_features(): that is an inline function the test
// code, compiled with the binary's -march, instantiates too, and the linker may keep that copy.
// (The test code's static initializers, compiled for x86-64-v3 or more, run before main: the
// binaries need an AVX2 CPU to start at all.)
#include <cpuid.h>

#include <cstdio>
#include <cstring>

#include "support/catch_session.hpp"

#ifndef MOE_TEST_NEEDS_AVXVNNI
#define MOE_TEST_NEEDS_AVXVNNI 0
#endif
#ifndef MOE_TEST_NEEDS_AVX512
#define MOE_TEST_NEEDS_AVX512 0  // AVX512 F, CD, BW, DQ and VL (-march=skylake-avx512)
#endif

namespace {

/// The first unit of the build this CPU lacks (CPUID, with the OS saving ymm state), or null.
char const* missing_unit() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return "CPUID leaf 1";
  if (!((c >> 27) & 1) || !((c >> 28) & 1)) return "AVX";
  unsigned xlo = 0, xhi = 0;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  if ((xlo & 6u) != 6u) return "AVX (the OS does not save ymm state)";
  if (!((c >> 12) & 1)) return "FMA";
  if (!((c >> 29) & 1)) return "F16C";
  unsigned max7 = 0;
  if (!__get_cpuid_count(7, 0, &max7, &b, &c, &d) || !((b >> 5) & 1)) return "AVX2";
  if (MOE_TEST_NEEDS_AVX512) {
    // F (EBX 16), DQ (17), CD (28), BW (30), VL (31); the OS saves opmask and zmm (XCR0 5-7).
    if ((b & 0xD0030000u) != 0xD0030000u) return "AVX-512 (F, CD, BW, DQ and VL)";
    if ((xlo & 0xE0u) != 0xE0u) return "AVX-512 (the OS does not save zmm state)";
  }
  if (MOE_TEST_NEEDS_AVXVNNI) {
    if (max7 < 1 || !__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 4) & 1)) {
      return "AVX-VNNI (CPUID leaf 7 subleaf 1, EAX bit 4)";
    }
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--list", 6) == 0) listing = true;
  }
  if (char const* unit = missing_unit(); !listing && unit) {
    std::printf("skipped: this CPU has no %s, which this build of the tests needs\n", unit);
    return 77;
  }
  return moe::test::run_catch_session(argc, argv);
}
