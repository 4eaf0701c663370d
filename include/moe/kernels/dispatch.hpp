// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Which kernels this process runs: the rules that choose the bf16 and quantized-weight kernels
/// from the CPU's facts (moe/core/cpu.hpp), the build's compiled kernels and the MOE_BF16_KERNEL /
/// MOE_QUANT_KERNEL overrides; fixed for the process.
#pragma once

#include <cstdlib>
#include <string>

#include "moe/core/config.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/error.hpp"

namespace moe {

/// How bf16 weight panels are multiplied (fixed for the process; see bf16_kernel()).
enum class Bf16Kernel {
  kDotProducts,  ///< vdpbf16ps: activations rounded to bf16 pairs, fp32 accumulation
  kWiden,        ///< weights widened to fp32 in registers, fp32 FMAs (activations stay fp32)
  kAmx,          ///< AMX tdpbf16ps tiles: activations rounded to bf16 pairs, fp32 accumulation
};

/// The rule bf16_kernel() applies (a pure function, so that it can be tested on any CPU):
///   - `compiled_dp` false (the build has no AVX512-BF16 kernels): kWiden, whatever is asked;
///   - `env` (MOE_BF16_KERNEL) "dot", "widen" or "amx": that kernel ("amx" only where `amx` is
///     true, else the CPU's default below); empty or null: the CPU decides; anything else:
///     moe::Error naming the accepted values;
///   - `amx` (the build has the AMX kernels, the CPU has AMX-BF16 tiles and Linux granted their
///     use: amx_bf16_usable()): kAmx. One tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16
///     one (3.3 to 3.9 TFLOP/s a Sapphire Rapids core, 13 to 16x its fp32 FMA rate);
///   - an Intel CPU without AMX: kWiden. Its cores run vdpbf16ps at about half the fp32 FMA rate
///     (Sapphire Rapids, 2 vCPUs: 190 against 246 GFLOP/s a core with 8 chains), so widening,
///     which reads the same bf16 bytes and runs at the FMA rate, is faster and bf16 is never
///     slower than fp32;
///   - any other CPU (AMD Zen 4 and 5 run vdpbf16ps at twice the fp32 FMA rate): kDotProducts.
/// Never chosen by timing: a machine gives the same bits run after run. The kernels round
/// differently (dot products and AMX round the activations to bf16; vdpbf16ps and tdpbf16ps
/// accumulate a pair's products differently), so bf16 layers give different last bits on CPUs
/// that choose differently.
inline Bf16Kernel choose_bf16_kernel(CpuFeatures const& f, char const* env, bool compiled_dp,
                                     bool amx = false) {
  std::string const e = env ? env : "";
  if (!e.empty() && e != "dot" && e != "widen" && e != "amx") {
    throw Error("MOE_BF16_KERNEL is \"" + e +
                "\"; set it to \"dot\" (vdpbf16ps dot products), \"widen\" (bf16 weights "
                "widened to fp32) or \"amx\" (AMX tiles), or unset it to let the CPU decide");
  }
  if (!compiled_dp) return Bf16Kernel::kWiden;
  if (e == "dot") return Bf16Kernel::kDotProducts;
  if (e == "widen") return Bf16Kernel::kWiden;
  if (amx) return Bf16Kernel::kAmx;
  return f.vendor == "GenuineIntel" ? Bf16Kernel::kWiden : Bf16Kernel::kDotProducts;
}

/// Does this build have the AVX512-BF16 dot-product kernels (AVX-512 with 32-column panels and
/// -mavx512bf16)?
constexpr bool compiled_bf16_dot_products() { return MOE_HAS_AVX512BF16 != 0; }

/// Does this build have the AMX bf16 expert kernels (AVX-512 and -mamx-tile -mamx-bf16, which
/// -march=native implies on a CPU with AMX)? A build with them still runs on a CPU without AMX:
/// bf16_kernel() then never chooses them.
constexpr bool compiled_amx_bf16() { return MOE_HAS_AMX_BF16 != 0; }

/// Can this process run the AMX bf16 kernels: compiled in, the CPU and the OS support AMX-BF16
/// tiles, and Linux granted tile data to the process (request_amx(), asked here)?
inline bool amx_bf16_usable() {
  return compiled_amx_bf16() && cpu_features().amx_tile && cpu_features().amx_bf16 && request_amx();
}

/// The bf16 kernel of this process: choose_bf16_kernel(cpu_features(), getenv("MOE_BF16_KERNEL"),
/// compiled_bf16_dot_products(), amx_bf16_usable()), decided on first use and fixed from then on
/// (workspaces are sized for it). Throws moe::Error on a malformed MOE_BF16_KERNEL.
inline Bf16Kernel bf16_kernel() {
  static Bf16Kernel const k = choose_bf16_kernel(cpu_features(), std::getenv("MOE_BF16_KERNEL"),
                                                 compiled_bf16_dot_products(), amx_bf16_usable());
  return k;
}

/// How quantized expert weights (moe/quant formats) are multiplied (fixed for the process; see
/// quant_kernel()). Every kernel forms the same exact int32 sums of a scale block and folds them
/// into fp32 with the same operations in the same order: all give the same bits.
enum class QuantKernel {
  kPortable,  ///< scalar C++ (builds without AVX2 or AVX512-VNNI)
  kAvx2,      ///< ymm, AVX2 builds without VNNI: vpmaddubsw + vpmaddwd, a few rows at a time
  kVnni,      ///< vpdpbusd, a few rows at a time: AVX512-VNNI on zmm, or AVX-VNNI on ymm in an
              ///< AVX2 build (-mavxvnni)
  kAmx,       ///< AMX tdpbssd tiles for row tiles of 16 (vpdpbusd for the rows of a short tail)
};

/// The kernel of quantized weights this build compiled, before the run-time AMX choice: kVnni
/// (MOE_HAS_AVX512VNNI or MOE_HAS_AVXVNNI), kAvx2 (MOE_HAS_AVX2_INT8) or kPortable.
constexpr QuantKernel compiled_quant_kernel() {
  if (MOE_HAS_AVX512VNNI || MOE_HAS_AVXVNNI) return QuantKernel::kVnni;
  return MOE_HAS_AVX2_INT8 ? QuantKernel::kAvx2 : QuantKernel::kPortable;
}

/// The rule quant_kernel() applies (a pure function, so that it can be tested on any CPU):
///   - `compiled` (compiled_quant_kernel()) not kVnni: `compiled`, whatever is asked;
///   - `env` (MOE_QUANT_KERNEL) "vnni" or "amx": that kernel ("amx" only where `amx` is true,
///     else kVnni); empty or null: kAmx where `amx` is true, else kVnni; anything else:
///     moe::Error naming the accepted values.
/// `amx`: the build has the AMX int8 kernels, the CPU AMX-INT8 tiles and Linux granted their use
/// (amx_int8_usable()). Since the kernels agree bit for bit, the choice changes speed only.
inline QuantKernel choose_quant_kernel(char const* env, QuantKernel compiled, bool amx) {
  std::string const e = env ? env : "";
  if (!e.empty() && e != "vnni" && e != "amx") {
    throw Error("MOE_QUANT_KERNEL is \"" + e +
                "\"; set it to \"vnni\" (AVX512-VNNI vpdpbusd) or \"amx\" (AMX int8 tiles), "
                "or unset it to let the CPU decide");
  }
  if (compiled != QuantKernel::kVnni) return compiled;
  if (e == "vnni" || !amx) return QuantKernel::kVnni;
  return QuantKernel::kAmx;
}

/// Does this build have the AMX int8 kernels for quantized experts (AVX512-VNNI and -mamx-tile
/// -mamx-int8, which -march=native implies on a CPU with AMX)?
constexpr bool compiled_amx_int8() { return MOE_HAS_AMX_INT8 != 0; }

/// Can this process run the AMX int8 kernels: compiled in, the CPU and the OS support AMX-INT8
/// tiles, and Linux granted tile data to the process (request_amx(), asked here)?
inline bool amx_int8_usable() {
  return compiled_amx_int8() && cpu_features().amx_tile && cpu_features().amx_int8 && request_amx();
}

/// The quantized-weight kernel of this process: choose_quant_kernel(getenv("MOE_QUANT_KERNEL"),
/// compiled_quant_kernel(), amx_int8_usable()), decided on first use and fixed from then on.
/// Throws moe::Error on a malformed MOE_QUANT_KERNEL.
inline QuantKernel quant_kernel() {
  static QuantKernel const k = choose_quant_kernel(std::getenv("MOE_QUANT_KERNEL"),
                                                   compiled_quant_kernel(), amx_int8_usable());
  return k;
}

/// The kernels this build compiled (the -march it was built for) and the run-time choices among
/// them: the SIMD width, the units the expert kernels use and how bf16 weights are multiplied
/// (bf16_kernel()), e.g. "avx512 (zmm), AVX512-BF16, bf16 weights by vdpbf16ps dot products,
/// AVX512-VNNI". A unit the CPU has but the build was not compiled for is not used (see
/// docs/performance.md).
inline std::string compiled_kernels() {
  std::string s;
#if defined(__AVX512F__)
  s = "avx512 (zmm)";
#elif defined(__AVX2__)
  s = "avx2 (ymm)";
#elif defined(__SSE2__)
  s = "sse2 (xmm)";
#else
  s = "scalar";
#endif
#if MOE_HAS_AVX512BF16
  s += ", AVX512-BF16";
#endif
  switch (bf16_kernel()) {
    case Bf16Kernel::kDotProducts:
      s += ", bf16 weights by vdpbf16ps dot products";
      break;
    case Bf16Kernel::kAmx:
      s += ", bf16 weights by AMX tiles (tdpbf16ps)";
      break;
    case Bf16Kernel::kWiden:
      s += ", bf16 weights widened to fp32";
      break;
  }
#if defined(__AVX512VNNI__)
  s += ", AVX512-VNNI";
#elif defined(__AVXVNNI__)
  s += ", AVX-VNNI";
#endif
#if MOE_HAS_AMX_BF16
  s += ", AMX bf16 tiles compiled";
#endif
#if MOE_HAS_AMX_INT8
  s += ", AMX int8 tiles compiled";
#endif
  switch (quant_kernel()) {
    case QuantKernel::kAmx:
      s += ", quantized weights by AMX tiles (tdpbssd)";
      break;
    case QuantKernel::kAvx2:
      s += ", quantized weights by AVX2 vpmaddubsw";
      break;
    case QuantKernel::kPortable:
      s += ", quantized weights by portable C++";
      break;
    case QuantKernel::kVnni:  // named by the AVX512-VNNI / AVX-VNNI unit above
      break;
  }
  return s;
}

}  // namespace moe
