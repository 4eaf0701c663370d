// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// What the CPU running this process has: instruction-set features from CPUID (with the
/// operating system's XCR0 state), Linux's permission for AMX tiles, and cache sizes (sysfs,
/// else CPUID). One place that knows the machine's facts; which kernel runs on them is decided
/// in moe/kernels/dispatch.hpp.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MOE_CPU_X86 1
#else
#define MOE_CPU_X86 0
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "moe/core/config.hpp"
#include "moe/core/error.hpp"

namespace moe {

/// The CPU's features as this process may use them: a unit counts only when CPUID reports it
/// *and* the operating system saves its registers (XCR0: AVX state for AVX/AVX2/FMA, opmask and
/// ZMM state for AVX-512, tile state for AMX; for AMX, Linux also wants a per-process request,
/// see request_amx()). Cache sizes in bytes are per core's view (L1d, L2, last level), from
/// /sys/devices/system/cpu/cpu0/cache, else from CPUID's deterministic cache leaves (AMD's legacy
/// leaves 0x80000005/6 where those are empty); 0 when neither says. A VM's figures can describe
/// the host's whole socket (a 2-vCPU guest told of 508 MiB of L3): benches check them by a read
/// sweep (bench/machine.hpp).
struct CpuFeatures {
  std::string vendor;  ///< "GenuineIntel", "AuthenticAMD", ... (empty off x86)
  std::string brand;   ///< the CPUID brand string, e.g. "AMD EPYC 9R14 96-Core Processor"
  int family = 0;      ///< display family (base + extended)
  int model = 0;       ///< display model
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false;  ///< vdpbf16ps
  bool avx512_vnni = false;  ///< vpdpbusd on zmm
  bool avx_vnni = false;     ///< vpdpbusd on ymm (VEX; AVX2 machines such as Alder Lake)
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;  ///< CPU and OS support
  std::int64_t l1d_bytes = 0, l2_bytes = 0, llc_bytes = 0;
  int llc_level = 0;                  ///< level of llc_bytes (3 usually, 2 where there is no L3)
  char const* cache_source = "none";  ///< "sysfs", "cpuid" or "none"

  /// One line: vendor, family/model, brand, the units, the caches.
  std::string describe() const {
    std::string units;
    auto add = [&](bool on, char const* name) {
      if (on) units += units.empty() ? name : std::string(" ") + name;
    };
    add(avx2, "avx2");
    add(fma, "fma");
    add(avx512f, "avx512f");
    add(avx512bw, "avx512bw");
    add(avx512_bf16, "avx512_bf16");
    add(avx512_vnni, "avx512_vnni");
    add(avx_vnni, "avx_vnni");
    add(amx_tile, "amx_tile");
    add(amx_bf16, "amx_bf16");
    add(amx_int8, "amx_int8");
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s family %d model %d (%s): %s; L1d %lld KiB, L2 %lld KiB, L%d %lld KiB (%s)",
                  vendor.empty() ? "unknown CPU" : vendor.c_str(), family, model, brand.c_str(),
                  units.empty() ? "no AVX" : units.c_str(),
                  static_cast<long long>(l1d_bytes / 1024), static_cast<long long>(l2_bytes / 1024),
                  llc_level, static_cast<long long>(llc_bytes / 1024), cache_source);
    return buf;
  }
};

namespace detail {

#if MOE_CPU_X86
struct CpuidRegs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
inline CpuidRegs cpuid(unsigned leaf, unsigned sub = 0) {
  CpuidRegs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = {};
  return r;
}
inline std::uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}
#endif

/// "32K", "1024K", "32768K" or "2M" (sysfs cache size) in bytes; 0 if unreadable.
inline std::int64_t read_cache_size(std::string const& file) {
  std::ifstream in(file);
  std::string s;
  if (!(in >> s) || s.empty()) return 0;
  std::int64_t v = 0;
  std::size_t i = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) v = v * 10 + (s[i] - '0');
  if (i < s.size() && (s[i] == 'K' || s[i] == 'k')) v *= 1024;
  if (i < s.size() && (s[i] == 'M' || s[i] == 'm')) v *= 1024 * 1024;
  return v;
}

inline void read_caches_sysfs(CpuFeatures& f) {
  for (int index = 0; index < 8; ++index) {
    std::string const dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_in(dir + "/level"), type_in(dir + "/type");
    int level = 0;
    std::string type;
    if (!(level_in >> level) || !(type_in >> type)) continue;
    std::int64_t const size = read_cache_size(dir + "/size");
    if (size <= 0 || type == "Instruction") continue;
    if (level == 1) f.l1d_bytes = size;
    if (level == 2) f.l2_bytes = size;
    if (level >= 2 && level >= f.llc_level) f.llc_level = level, f.llc_bytes = size;
  }
  if (f.llc_bytes > 0) f.cache_source = "sysfs";
}

#if MOE_CPU_X86
/// CPUID leaf 4 (Intel) or 0x8000001D (AMD): ways x partitions x line size x sets per level.
inline void read_caches_cpuid(CpuFeatures& f) {
  unsigned const leaf = f.vendor == "AuthenticAMD" ? 0x8000001Du : 4u;
  if (leaf == 0x8000001Du && cpuid(0x80000000u).a < leaf) return;
  if (leaf == 4u && cpuid(0).a < 4u) return;
  for (unsigned sub = 0; sub < 16; ++sub) {
    CpuidRegs const r = cpuid(leaf, sub);
    unsigned const type = r.a & 0x1f;  // 1 data, 2 instruction, 3 unified, 0 none
    if (type == 0) break;
    if (type == 2) continue;
    int const level = static_cast<int>((r.a >> 5) & 0x7);
    std::int64_t const size = static_cast<std::int64_t>((r.b >> 22) + 1) *
                              (((r.b >> 12) & 0x3ff) + 1) * ((r.b & 0xfff) + 1) *
                              (static_cast<std::int64_t>(r.c) + 1);
    if (level == 1) f.l1d_bytes = size;
    if (level == 2) f.l2_bytes = size;
    if (level >= 2 && level >= f.llc_level) f.llc_level = level, f.llc_bytes = size;
  }
  // AMD without topology extensions (some VMs: leaf 0x8000001D all zero): the legacy leaves,
  // L1d KiB in 0x80000005 ECX[31:24], L2 KiB in 0x80000006 ECX[31:16], L3 in 512 KiB units in
  // 0x80000006 EDX[31:18] (what glibc reads there too).
  if (f.llc_bytes == 0 && f.vendor == "AuthenticAMD" && cpuid(0x80000000u).a >= 0x80000006u) {
    CpuidRegs const l1 = cpuid(0x80000005u), l23 = cpuid(0x80000006u);
    f.l1d_bytes = static_cast<std::int64_t>(l1.c >> 24) * 1024;
    f.l2_bytes = static_cast<std::int64_t>(l23.c >> 16) * 1024;
    std::int64_t const l3 = static_cast<std::int64_t>(l23.d >> 18) * 512 * 1024;
    if (l3 > 0) {
      f.llc_level = 3, f.llc_bytes = l3;
    } else if (f.l2_bytes > 0) {
      f.llc_level = 2, f.llc_bytes = f.l2_bytes;
    }
  }
  if (f.llc_bytes > 0) f.cache_source = "cpuid";
}
#endif

inline CpuFeatures detect_cpu() {
  CpuFeatures f;
#if MOE_CPU_X86
  CpuidRegs const v = cpuid(0);
  char vendor[13] = {};
  for (int i = 0; i < 4; ++i) {
    vendor[i] = static_cast<char>(v.b >> (8 * i));
    vendor[4 + i] = static_cast<char>(v.d >> (8 * i));
    vendor[8 + i] = static_cast<char>(v.c >> (8 * i));
  }
  f.vendor = vendor;
  unsigned const max_leaf = v.a;
  CpuidRegs const l1 = cpuid(1);
  int const base_family = static_cast<int>((l1.a >> 8) & 0xf);
  int const base_model = static_cast<int>((l1.a >> 4) & 0xf);
  f.family = base_family == 0xf ? base_family + static_cast<int>((l1.a >> 20) & 0xff) : base_family;
  f.model = base_family == 0x6 || base_family == 0xf
                ? base_model + (static_cast<int>((l1.a >> 16) & 0xf) << 4)
                : base_model;
  if (cpuid(0x80000000u).a >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      CpuidRegs const r = cpuid(0x80000002u + i);
      unsigned const w[4] = {r.a, r.b, r.c, r.d};
      for (int j = 0; j < 16; ++j) brand[i * 16 + j] = static_cast<char>(w[j / 4] >> (8 * (j % 4)));
    }
    f.brand = brand;
    while (!f.brand.empty() && f.brand.back() == ' ') f.brand.pop_back();
    while (!f.brand.empty() && f.brand.front() == ' ') f.brand.erase(f.brand.begin());
  }
  bool const osxsave = (l1.c >> 27) & 1;
  std::uint64_t const xcr0 = osxsave ? xgetbv0() : 0;
  bool const os_avx = (xcr0 & 0x6) == 0x6;                 // XMM, YMM
  bool const os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  bool const os_amx = (xcr0 & 0x60000) == 0x60000;         // XTILECFG, XTILEDATA
  f.fma = os_avx && ((l1.c >> 12) & 1);
  f.f16c = os_avx && ((l1.c >> 29) & 1);
  if (max_leaf >= 7) {
    CpuidRegs const l7 = cpuid(7, 0);
    CpuidRegs const l71 = cpuid(7, 1);
    f.avx2 = os_avx && ((l7.b >> 5) & 1);
    f.avx512f = os_avx512 && ((l7.b >> 16) & 1);
    f.avx512dq = os_avx512 && ((l7.b >> 17) & 1);
    f.avx512bw = os_avx512 && ((l7.b >> 30) & 1);
    f.avx512vl = os_avx512 && ((l7.b >> 31) & 1);
    f.avx512_vnni = os_avx512 && ((l7.c >> 11) & 1);
    f.avx512_bf16 = os_avx512 && ((l71.a >> 5) & 1);
    f.avx_vnni = os_avx && ((l71.a >> 4) & 1);
    f.amx_bf16 = os_amx && ((l7.d >> 22) & 1);
    f.amx_tile = os_amx && ((l7.d >> 24) & 1);
    f.amx_int8 = os_amx && ((l7.d >> 25) & 1);
  }
#endif
  read_caches_sysfs(f);
#if MOE_CPU_X86
  if (f.llc_bytes == 0) read_caches_cpuid(f);
#endif
  return f;
}

}  // namespace detail

/// The features of the CPU this process runs on (detected once, thread-safe).
inline CpuFeatures const& cpu_features() {
  static CpuFeatures const f = detail::detect_cpu();
  return f;
}

/// Asks Linux for permission to use AMX tile data in this process (arch_prctl
/// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; required before the first tile instruction since
/// Linux 5.16). True when granted (or already granted); false on a CPU or kernel without AMX,
/// or off Linux. Safe to call more than once.
inline bool request_amx() {
#if MOE_CPU_X86 && defined(__linux__) && defined(SYS_arch_prctl)
  if (!cpu_features().amx_tile) return false;
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static bool const granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

}  // namespace moe
