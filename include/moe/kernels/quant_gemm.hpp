// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// Integer kernels for quantized expert weights (moe/quant/blocks.hpp formats).
///
/// Activations are quantized once per row to int8 in 32-blocks (quantize_rows_q8): for block b,
/// da_b = amax_b / 127 and a_k = round_even(x_k / da_b), with the block sums s32_b = sum a_k (and
/// per 16: s16) kept beside them. Weights are re-packed once (pack_quant_panels) from GGUF rows
/// into panels of 32 output columns, every weight an unsigned level u with
///   w = s * (u - offset)  (Q8_0: u = q + 128, offset 128;  Q4_0: offset 8;  Q5_0: offset 16;
///                          Q6_K: offset 32;  IQ4_NL, IQ4_XS: u = kvalues_iq4nl[q] + 128,
///                          offset 128, the table looked up by vpshufb;  MXFP4: likewise
///                          u = kvalues_mxfp4[q] + 128, s = 2^(e - 128) from its E8M0 byte)
///   w = s * u - m         (Q4_K, Q5_K: s = d * sc, m = dmin * mn;  Q2_K likewise;
///                          Q4_1, Q5_1: s = d, m = -(the block's fp16 min), stored negated)
/// per column and scale block, the values exactly those ggml's dequantizers give. A dot product
/// is then, per scale block, one integer sum by `vpdpbusd` (unsigned weight bytes times signed
/// activation bytes, exact in int32) folded into an fp32 accumulator:
///   acc = fma((float)(isum - offset * s) * s_col, da_b, acc)        (offset formats)
///   acc = fma((float)isum * s_col, da_b, acc); acc = fma(-m_col, da_b * s32_b, acc)   (Q4_K, Q5_K)
/// over the blocks in ascending k. The ymm (AVX2) and portable kernels do the same integer
/// sums and the same float operations in the same order, so both give the same bits, for any
/// row split, tiling or thread count.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <utility>

#include "moe/core/config.hpp"
#include "moe/core/cpu.hpp"
#include "moe/core/types.hpp"
#include "moe/kernels/detail/amx.hpp"
#include "moe/kernels/detail/diagnostics_push.hpp"
#include "moe/kernels/dispatch.hpp"
#include "moe/kernels/gemm_packed.hpp"
#include "moe/kernels/row_source.hpp"
#include "moe/kernels/simd.hpp"
#include "moe/quant/blocks.hpp"

#if MOE_HAS_AVX512VNNI || MOE_HAS_AVX2_INT8
#include <immintrin.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MOE_QUANT_NOINLINE __attribute__((noinline))
#else
#define MOE_QUANT_NOINLINE
#endif

namespace moe::kernels {

/// Does this build multiply quantized weights with AVX512-VNNI (otherwise: AVX-VNNI or the
/// portable kernel)?
constexpr bool has_avx512_vnni() { return MOE_HAS_AVX512VNNI != 0; }
/// Does this build multiply quantized weights with AVX-VNNI on ymm (an AVX2 build with
/// -mavxvnni and without AVX-512)?
constexpr bool has_avx_vnni() { return MOE_HAS_AVXVNNI != 0; }
/// Does this build multiply quantized weights with the ymm integer kernel (AVX2, FMA and F16C
/// without AVX512-VNNI: AVX-VNNI vpdpbusd, or vpmaddubsw + vpmaddwd)?
constexpr bool has_avx2_int8() { return MOE_HAS_AVX2_INT8 != 0; }

/// Output columns of one quantized weight panel.
inline constexpr Index kQuantPanelCols = 32;

// ----------------------------------------------------------------------------------------------
// Activations: int8 rows in 32-blocks.

/// Bytes of one quantized activation row of depth K (K % 32 == 0), 64-byte multiple:
/// int8 a[K], float da[K/32], float ds[K/32] (= da * s32), int32 s32[K/32], int32 s16[K/16].
constexpr Index q8_row_bytes(Index K) { return (K + 5 * K / 8 + 63) / 64 * 64; }

/// The parts of a quantized activation row.
struct Q8Row {
  std::int8_t const* a;
  float const* d;
  float const* ds;
  std::int32_t const* s32;
  std::int32_t const* s16;
};
inline Q8Row q8_row(std::byte const* row, Index K) {
  return {reinterpret_cast<std::int8_t const*>(row), reinterpret_cast<float const*>(row + K),
          reinterpret_cast<float const*>(row + K + K / 8),
          reinterpret_cast<std::int32_t const*>(row + K + K / 4),
          reinterpret_cast<std::int32_t const*>(row + K + 3 * K / 8)};
}

/// Quantizes one row of K floats (K % 32 == 0) into q8_row_bytes(K) bytes at dst (64-byte
/// aligned). A block holding a NaN or an infinity gets da = NaN (so every output it feeds is
/// NaN, as in fp32) and zero levels.
inline void quantize_row_q8(float const* x, Index K, std::byte* dst) {
  auto* a = reinterpret_cast<std::int8_t*>(dst);
  auto* d = reinterpret_cast<float*>(dst + K);
  auto* ds = reinterpret_cast<float*>(dst + K + K / 8);
  auto* s32 = reinterpret_cast<std::int32_t*>(dst + K + K / 4);
  auto* s16 = reinterpret_cast<std::int32_t*>(dst + K + 3 * K / 8);
  constexpr float kMax = std::numeric_limits<float>::max();
  for (Index b = 0; b < K / 32; ++b) {
    float const* xb = x + 32 * b;
    std::int8_t* ab = a + 32 * b;
#if MOE_HAS_AVX512VNNI
    __m512 const x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    __m512 const ax0 = _mm512_abs_ps(x0), ax1 = _mm512_abs_ps(x1);
    __mmask16 const bad = _mm512_cmp_ps_mask(ax0, _mm512_set1_ps(kMax), _CMP_NLE_UQ) |
                          _mm512_cmp_ps_mask(ax1, _mm512_set1_ps(kMax), _CMP_NLE_UQ);
    float const amax = _mm512_reduce_max_ps(_mm512_max_ps(ax0, ax1));
#elif MOE_HAS_AVX2_INT8
    __m256 xv[4], ax[4];
    __m256 const sign = _mm256_set1_ps(-0.0f);
    int badbits = 0;
    for (int j = 0; j < 4; ++j) {
      xv[j] = _mm256_loadu_ps(xb + 8 * j);
      ax[j] = _mm256_andnot_ps(sign, xv[j]);
      badbits |= _mm256_movemask_ps(_mm256_cmp_ps(ax[j], _mm256_set1_ps(kMax), _CMP_NLE_UQ));
    }
    bool const bad = badbits != 0;
    __m256 const m8 = _mm256_max_ps(_mm256_max_ps(ax[0], ax[1]), _mm256_max_ps(ax[2], ax[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float const amax = _mm_cvtss_f32(m4);  // max is exact: the order does not matter
#else
    float amax = 0.0f;
    bool bad = false;
    for (int j = 0; j < 32; ++j) {
      float const v = std::fabs(xb[j]);
      if (!(v <= kMax)) bad = true;
      amax = v > amax ? v : amax;
    }
#endif
    if (bad) {
      std::memset(ab, 0, 32);
      d[b] = ds[b] = std::numeric_limits<float>::quiet_NaN();
      s32[b] = s16[2 * b] = s16[2 * b + 1] = 0;
      continue;
    }
    float const db = amax / 127.0f;
    float const id = quant::detail::inverse(db);  // 0 for an all-zero or subnormal block
#if MOE_HAS_AVX512VNNI
    // vcvtps2dq rounds to nearest even (the default MXCSR mode), as std::nearbyint does.
    __m512i const q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
    __m512i const q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + 16), _mm512_cvtsepi32_epi8(q1));
    std::int32_t const lo = _mm512_reduce_add_epi32(q0), hi = _mm512_reduce_add_epi32(q1);
#elif MOE_HAS_AVX2_INT8
    // vcvtps2dq rounds to nearest even, as std::nearbyint does; |x * id| <= 127 (+ rounding), so
    // the saturating packs never saturate and the sums are the portable path's.
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[j], _mm256_set1_ps(id)));
    __m256i const b16 =
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(ab),
        _mm256_permutevar8x32_epi32(b16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    auto hsum = [](__m256i v) {
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      return _mm_cvtsi128_si32(s4);
    };
    std::int32_t const lo = hsum(_mm256_add_epi32(q[0], q[1])),
                       hi = hsum(_mm256_add_epi32(q[2], q[3]));
#else
    std::int32_t lo = 0, hi = 0;
    for (int j = 0; j < 32; ++j) {
      float const r = std::nearbyint(xb[j] * id);
      int const q = static_cast<int>(r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r));
      ab[j] = static_cast<std::int8_t>(q);
      (j < 16 ? lo : hi) += q;
    }
#endif
    d[b] = db;
    s16[2 * b] = lo;
    s16[2 * b + 1] = hi;
    s32[b] = lo + hi;
    ds[b] = db * static_cast<float>(lo + hi);
  }
}

/// Rows [0, n) of `a` quantized, row r at dst + r * ldq bytes (ldq >= q8_row_bytes(K)).
inline void quantize_rows_q8(RowSource a, Index n, Index K, std::byte* dst, Index ldq) {
  for (Index r = 0; r < n; ++r) quantize_row_q8(a.row(r), K, dst + r * ldq);
}

// ----------------------------------------------------------------------------------------------
// Weight panels.

/// Bytes of one panel group (block_elems(f) depth x 32 columns): header then weights.
constexpr Index quant_header_bytes(quant::Format f) {
  switch (f) {
    case quant::Format::kQ8_0:
    case quant::Format::kQ4_0:
    case quant::Format::kQ5_0:
      return 64;  // fp16 d[32]
    case quant::Format::kQ4_K:
    case quant::Format::kQ5_K:
      return 640;  // fp16 d[32], fp16 dmin[32], u8 sc[8][32], u8 m[8][32]
    case quant::Format::kQ6_K:
    case quant::Format::kQ3_K:
      return 576;  // fp16 d[32], i8 sc[16][32]
    case quant::Format::kQ2_K:
      return 640;  // fp16 d[32], fp16 dmin[32], u8 (sc | m << 4)[16][32] (GGUF's scale bytes)
    case quant::Format::kQ4_1:
    case quant::Format::kQ5_1:
      return 128;  // fp16 d[32], fp16 -m[32]
    case quant::Format::kIQ4_NL:
      return 64;  // fp16 d[32]
    case quant::Format::kIQ4_XS:
      return 320;  // fp16 d[32], i8 (ls - 32)[8][32]
    case quant::Format::kMXFP4:
      return 64;  // u8 e[32] (E8M0), 32 zero bytes: a group stays a whole number of zmm lines
  }
  return 0;
}
/// Bits of one level in the kernel layout (the format's own width).
constexpr Index quant_level_bits(quant::Format f) {
  switch (f) {
    case quant::Format::kQ8_0:
      return 8;
    case quant::Format::kQ6_K:
      return 6;
    case quant::Format::kQ5_K:
    case quant::Format::kQ5_0:
    case quant::Format::kQ5_1:
      return 5;
    case quant::Format::kQ3_K:
      return 3;
    case quant::Format::kQ2_K:
      return 2;
    default:
      return 4;
  }
}
/// Are the levels stored as nibbles, 8 depths per 128 bytes (Q4_0, Q4_1, Q4_K; IQ4_NL, IQ4_XS
/// and MXFP4, whose nibbles index a table)?
constexpr bool quant_is_4bit(quant::Format f) {
  return f == quant::Format::kQ4_0 || f == quant::Format::kQ4_1 || f == quant::Format::kQ4_K ||
         f == quant::Format::kIQ4_NL || f == quant::Format::kIQ4_XS || f == quant::Format::kMXFP4;
}
/// Do the stored nibbles index 16 non-uniform levels (IQ4_NL, IQ4_XS: ggml's kvalues_iq4nl;
/// MXFP4: kvalues_mxfp4)? The kernels look the level up (vpshufb) as the unsigned byte
/// quant_table(f)[q] = value + 128, an offset format with Q8_0's offset.
constexpr bool quant_has_table(quant::Format f) {
  return f == quant::Format::kIQ4_NL || f == quant::Format::kIQ4_XS || f == quant::Format::kMXFP4;
}
/// The table formats' levels: kvalues_iq4nl + 128 (1 .. 241), kvalues_mxfp4 + 128 (116 .. 140;
/// codes 0 and 8, +0 and -0, both 128).
inline constexpr std::array<std::uint8_t, 16> kIq4nlLevels = [] {
  std::array<std::uint8_t, 16> t{};
  for (int i = 0; i < 16; ++i) t[i] = static_cast<std::uint8_t>(quant::kIq4nlValues[i] + 128);
  return t;
}();
inline constexpr std::array<std::uint8_t, 16> kMxfp4Levels = [] {
  std::array<std::uint8_t, 16> t{};
  for (int i = 0; i < 16; ++i) t[i] = static_cast<std::uint8_t>(quant::kMxfp4Values[i] + 128);
  return t;
}();
/// The levels table of a table format.
constexpr std::array<std::uint8_t, 16> const& quant_table(quant::Format f) {
  return f == quant::Format::kMXFP4 ? kMxfp4Levels : kIq4nlLevels;
}
/// Is the block scale an E8M0 exponent byte e, s = 2^(e - 128) (MXFP4), rather than an fp16?
constexpr bool quant_has_e8m0(quant::Format f) { return f == quant::Format::kMXFP4; }
/// Are the K-quant sub-block scales signed (Q6_K's and Q3_K's; IQ4_XS's ls - 32)?
constexpr bool quant_signed_scales(quant::Format f) {
  return f == quant::Format::kQ6_K || f == quant::Format::kQ3_K || f == quant::Format::kIQ4_XS;
}
/// Are the levels Q4_K's nibbles plus a plane of fifth bits, per 32-deep sub-block (Q5_K; Q5_0
/// and Q5_1, whose block is one such sub-block)?
constexpr bool quant_is_5bit(quant::Format f) {
  return f == quant::Format::kQ5_K || f == quant::Format::kQ5_0 || f == quant::Format::kQ5_1;
}
/// Level bytes of one 32-deep 5-bit sub-block: 512 of nibbles, then 128 of fifth bits.
inline constexpr Index kQ5kSubBytes = 640;
/// Are the levels stored in bit planes per 16-deep sub-block (Q6_K: nibbles and a 2-bit plane;
/// Q3_K: a 2-bit and a 1-bit plane; Q2_K: a 2-bit plane)?
constexpr bool quant_is_planar(quant::Format f) {
  return f == quant::Format::kQ6_K || f == quant::Format::kQ3_K || f == quant::Format::kQ2_K;
}
/// Does the format have a min per sub-block (w = s u - m) rather than an offset? (Q4_1 and Q5_1
/// add theirs: the header holds it negated.)
constexpr bool quant_has_min(quant::Format f) {
  return f == quant::Format::kQ4_K || f == quant::Format::kQ5_K || f == quant::Format::kQ2_K ||
         f == quant::Format::kQ4_1 || f == quant::Format::kQ5_1;
}
/// Does the format have per-sub-block scales under a super-block scale (the K-quants)?
constexpr bool quant_has_sub_scales(quant::Format f) { return quant::block_elems(f) == 256; }
constexpr Index quant_group_bytes(quant::Format f) {
  Index const G = quant::block_elems(f);
  return quant_header_bytes(f) + G * 4 * quant_level_bits(f);
}
/// Bytes of one panel of depth K.
constexpr Index quant_panel_bytes(quant::Format f, Index K) {
  return K / quant::block_elems(f) * quant_group_bytes(f);
}

/// Level u of depth k (within a group) and column c from a group's level bytes `w` (the layout
/// of pack_quant_panels): the scalar definition the SIMD kernels unpack in vectors.
constexpr int quant_level(quant::Format f, std::uint8_t const* w, Index k, Index c) {
  if (quant_is_4bit(f)) {
    std::uint8_t const v = w[((k / 8) * 32 + c) * 4 + k % 4];
    int const nib = (k % 8) >= 4 ? v >> 4 : v & 0xF;
    return quant_has_table(f) ? quant_table(f)[static_cast<std::size_t>(nib)] : nib;
  }
  if (quant_is_5bit(f)) {  // a 32-deep sub-block: 512 bytes of nibbles, 128 of fifth bits
    std::uint8_t const* sub = w + k / 32 * kQ5kSubBytes;
    Index const kk = k % 32;
    std::uint8_t const v = sub[((kk / 8) * 32 + c) * 4 + kk % 4];
    int const nib = (kk % 8) >= 4 ? v >> 4 : v & 0xF;
    return nib | ((sub[512 + c * 4 + kk % 4] >> (kk / 4)) & 1) << 4;
  }
  if (!quant_is_planar(f)) return w[((k / 4) * 32 + c) * 4 + k % 4];
  Index const t = k % 16 / 4, j = k % 4;
  std::uint8_t const* sub = w + k / 16 * 64 * quant_level_bits(f);
  if (f == quant::Format::kQ6_K) {
    std::uint8_t const v = sub[((t / 2) * 32 + c) * 4 + j];
    int const nib = t % 2 ? v >> 4 : v & 0xF;
    return nib | ((sub[256 + c * 4 + j] >> (2 * t)) & 3) << 4;
  }
  int const lo = (sub[c * 4 + j] >> (2 * t)) & 3;
  if (f == quant::Format::kQ2_K) return lo;
  return lo | ((sub[128 + (c % 16) * 4 + j] >> (4 * (c / 16) + t)) & 1) << 2;  // Q3_K
}

/// The block scale of column c from a group's header `grp` (the layout of pack_quant_panels):
/// the fp16 d, or MXFP4's 2^(e - 128) from its E8M0 byte, bit for bit ggml_e8m0_to_fp32_half
/// (e = 0, 1: the subnormals 2^-128, 2^-127; e = 255: 2^127). The scalar definition the SIMD
/// kernels unpack in vectors.
inline float quant_scale(quant::Format f, std::byte const* grp, Index c) {
  if (quant_has_e8m0(f)) return quant::detail::e8m0_to_fp32_half(static_cast<std::uint8_t>(grp[c]));
  std::uint16_t d;
  std::memcpy(&d, grp + 2 * c, sizeof d);
  return quant::detail::fp32(d);
}

/// Packs N GGUF rows of depth K (row n at rows + n * row_bytes(f, K)) into ceil(N / 32) panels at
/// dst (64-byte aligned, ceil(N / 32) * quant_panel_bytes(f, K) bytes). Columns past N are zero.
/// A group is its header (fp16 d[32] first; MXFP4: u8 e[32]), then its levels (quant_level
/// reads them):
///   8-bit (Q8_0): byte (q * 32 + c) * 4 + j holds level u of k = 4 q + j, column c;
///   4-bit (Q4_0, Q4_1, Q4_K; IQ4_NL, IQ4_XS, MXFP4: the index q): byte (o * 32 + c) * 4 + j
///     holds k = 8 o + j (low nibble) and k = 8 o + 4 + j (high);
///   5-bit (Q5_K, Q5_0, Q5_1), 640 bytes per 32-deep sub-block (Q5_0, Q5_1: the whole group), k = 4
///   t + j within it (t = 0..7): bytes
///     [0, 512) the low 4 bits as the 4-bit layout (quad t in octet t / 2), bytes [512, 640) the
///     fifth bits, byte c * 4 + j bit t;
///   planar (Q6_K, Q3_K, Q2_K), 64 x bits bytes per 16-deep sub-block, k = 4 t + j within it:
///     Q6_K: bytes [0, 256) the low 4 bits as the 4-bit layout (quad t in octet t / 2), bytes
///       [256, 384) the high 2 bits, byte c * 4 + j bits 2 t + 1 .. 2 t;
///     Q3_K: bytes [0, 128) the low 2 bits as Q6_K's high ones, bytes [128, 192) the high bit,
///       byte (c % 16) * 4 + j bit 4 (c / 16) + t;
///     Q2_K: bytes [0, 128) the 2 bits, as Q3_K's low ones.
/// So every format is stored at its own width (Q6_K 6.56, Q5_K 5.63, Q3_K 3.56, Q2_K 2.63 bits a
/// weight with the header), and a vector of 8 or 16 columns x 4 depths unpacks from aligned
/// loads. Q8_0, the 4-bit formats and Q6_K move their levels four at a time (a re-pack runs at
/// memory speed: it is what loading a GGUF file or streaming an expert from one costs); the
/// others level by level.
inline void pack_quant_panels(quant::Format f, std::byte const* rows, Index N, Index K,
                              std::byte* dst);

namespace detail {
/// pack_quant_panels; `fast` = false places every level one at a time (the definition the word
/// paths are tested against).
inline void pack_quant_panels(quant::Format f, std::byte const* rows, Index N, Index K,
                              std::byte* dst, bool fast) {
  using quant::Format;
  Index const G = quant::block_elems(f), rb = quant::row_bytes(f, K);
  Index const panels = (N + kQuantPanelCols - 1) / kQuantPanelCols;
  Index const HB = quant_header_bytes(f), GB = quant_group_bytes(f);
  std::memset(dst, 0, static_cast<std::size_t>(panels * quant_panel_bytes(f, K)));
  for (Index p = 0; p < panels; ++p) {
    for (Index g = 0; g < K / G; ++g) {
      std::byte* grp = dst + p * quant_panel_bytes(f, K) + g * GB;
      auto* w = reinterpret_cast<std::uint8_t*>(grp + HB);
      auto* d16 = reinterpret_cast<std::uint16_t*>(grp);
      for (Index c = 0; c < kQuantPanelCols; ++c) {
        Index const n = p * kQuantPanelCols + c;
        if (n >= N) break;
        std::byte const* blk = rows + n * rb + g * quant::block_bytes(f);
        auto set = [&](Index byte, int bits) {
          w[byte] = static_cast<std::uint8_t>(w[byte] | bits);
        };
        auto load4 = [](std::uint8_t const* src) {
          std::uint32_t v;
          std::memcpy(&v, src, sizeof v);
          return v;
        };
        auto store4 = [&](Index byte, std::uint32_t v) { std::memcpy(w + byte, &v, sizeof v); };
        // 4-bit levels of a G-deep group, four at a time: octet o's word ((o * 32 + c) * 4)
        // holds k = 8 o + j in its low nibbles and k = 8 o + 4 + j in its high ones, where level
        // k is bits at(k).second.. of byte qs[at(k).first] (contiguous over 4 aligned k).
        auto nibbles = [&](std::uint8_t const* qs, Index depth, auto at) {
          for (Index o = 0; o < depth / 8; ++o) {
            auto const [b0, s0] = at(8 * o);
            auto const [b1, s1] = at(8 * o + 4);
            std::uint32_t const lo = (load4(qs + b0) >> s0) & 0x0F0F0F0Fu;
            std::uint32_t const hi = (load4(qs + b1) >> s1) & 0x0F0F0F0Fu;
            store4((o * 32 + c) * 4, lo | hi << 4);
          }
        };
        // Q4_0, Q4_1, IQ4_NL, MXFP4 (one 32-deep run) and IQ4_XS (per 32): k % 16 in the byte,
        // low nibbles first; Q4_K: per 64, k % 32 in the byte, low nibbles first.
        auto by_32 = [](Index k) {
          return std::pair<Index, int>{k / 32 * 16 + k % 16, k % 32 >= 16 ? 4 : 0};
        };
        auto by_64 = [](Index k) {
          return std::pair<Index, int>{32 * (k / 64) + k % 32, k % 64 >= 32 ? 4 : 0};
        };
        auto put = [&](Index k, int u) {
          if (quant_is_4bit(f)) {
            set(((k / 8) * 32 + c) * 4 + k % 4, (k % 8) >= 4 ? u << 4 : u);
          } else if (quant_is_5bit(f)) {
            Index const sub = k / 32 * kQ5kSubBytes, kk = k % 32;
            set(sub + ((kk / 8) * 32 + c) * 4 + kk % 4, (kk % 8) >= 4 ? (u & 0xF) << 4 : u & 0xF);
            set(sub + 512 + c * 4 + kk % 4, (u >> 4) << (kk / 4));
          } else if (!quant_is_planar(f)) {
            set(((k / 4) * 32 + c) * 4 + k % 4, u);
          } else {
            Index const t = k % 16 / 4, j = k % 4, sub = k / 16 * 64 * quant_level_bits(f);
            if (f == Format::kQ6_K) {
              set(sub + ((t / 2) * 32 + c) * 4 + j, t % 2 ? (u & 0xF) << 4 : u & 0xF);
              set(sub + 256 + c * 4 + j, (u >> 4) << (2 * t));
            } else {
              set(sub + c * 4 + j, (u & 3) << (2 * t));
              if (f == Format::kQ3_K)
                set(sub + 128 + (c % 16) * 4 + j, (u >> 2) << (4 * (c / 16) + t));
            }
          }
        };
        // Q4_K and Q5_K: d and dmin, the 6-bit scales and mins per 32 depths, then the levels.
        auto k_header_and_levels = [&](auto b, auto level) {
          std::memcpy(&b, blk, sizeof b);
          d16[c] = b.d;
          d16[32 + c] = b.dmin;
          auto* sc = reinterpret_cast<std::uint8_t*>(grp + 128);
          for (int j = 0; j < 8; ++j) {
            std::uint8_t s, m;
            quant::get_scale_min(j, b.scales, &s, &m);
            sc[j * 32 + c] = s;
            sc[256 + j * 32 + c] = m;
          }
          if constexpr (std::is_same_v<decltype(b), quant::BlockQ4_K>) {
            if (fast) return nibbles(b.qs, 256, by_64);
          }
          for (Index k = 0; k < 256; ++k) put(k, level(b, static_cast<int>(k)));
        };
        // Q4_1 and Q5_1: d and the negated min (an exact sign flip), then the 32 levels.
        auto d_negated_min_and_levels = [&](auto b, auto level) {
          std::memcpy(&b, blk, sizeof b);
          d16[c] = b.d;
          d16[32 + c] = static_cast<std::uint16_t>(b.m ^ 0x8000u);
          if constexpr (std::is_same_v<decltype(b), quant::BlockQ4_1>) {  // Q4_0's nibbles
            if (fast) return nibbles(b.qs, 32, by_32);
          }
          for (Index k = 0; k < 32; ++k) put(k, level(b, static_cast<int>(k)));
        };
        switch (f) {
          case Format::kQ8_0: {
            quant::BlockQ8_0 b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            if (fast) {  // u = q + 128: the sign bit flipped
              auto const* q = reinterpret_cast<std::uint8_t const*>(b.qs);
              for (Index o = 0; o < 8; ++o)
                store4((o * 32 + c) * 4, load4(q + 4 * o) ^ 0x80808080u);
              break;
            }
            for (Index k = 0; k < 32; ++k) put(k, b.qs[k] + 128);
            break;
          }
          case Format::kQ4_0:
          case Format::kIQ4_NL: {  // the same bytes: d, 16 bytes of nibbles (levels or indices)
            quant::BlockQ4_0 b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            if (fast) {
              nibbles(b.qs, 32, by_32);
              break;
            }
            for (Index k = 0; k < 32; ++k) put(k, k < 16 ? b.qs[k] & 0xF : b.qs[k - 16] >> 4);
            break;
          }
          case Format::kMXFP4: {  // the E8M0 byte, then the codes as Q4_0's nibbles
            quant::BlockMXFP4 b;
            std::memcpy(&b, blk, sizeof b);
            reinterpret_cast<std::uint8_t*>(grp)[c] = b.e;
            if (fast) {
              nibbles(b.qs, 32, by_32);
              break;
            }
            for (Index k = 0; k < 32; ++k) put(k, k < 16 ? b.qs[k] & 0xF : b.qs[k - 16] >> 4);
            break;
          }
          case Format::kQ5_0: {
            quant::BlockQ5_0 b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            for (Index k = 0; k < 32; ++k) put(k, quant::q5_level(b, static_cast<int>(k)));
            break;
          }
          case Format::kQ4_1:  // d, then the min negated (w = d u - (-m)): the K-quants' fold
            d_negated_min_and_levels(quant::BlockQ4_1{}, [](auto const& b, int k) {
              return k < 16 ? b.qs[k] & 0xF : b.qs[k - 16] >> 4;
            });
            break;
          case Format::kQ5_1:
            d_negated_min_and_levels(quant::BlockQ5_1{},
                                     [](auto const& b, int k) { return quant::q5_level(b, k); });
            break;
          case Format::kQ4_K:
            k_header_and_levels(quant::BlockQ4_K{},
                                [](auto const& b, int k) { return quant::q4k_level(b, k); });
            break;
          case Format::kQ5_K:  // Q4_K's header, 5-bit levels
            k_header_and_levels(quant::BlockQ5_K{},
                                [](auto const& b, int k) { return quant::q5k_level(b, k); });
            break;
          case Format::kIQ4_XS: {  // d, the signed 6-bit scales as int8, the indices
            quant::BlockIQ4_XS b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            auto* sc = reinterpret_cast<std::int8_t*>(grp + 64);
            for (int j = 0; j < 8; ++j)
              sc[j * 32 + c] = static_cast<std::int8_t>(quant::iq4xs_scale(b, j) - 32);
            if (fast) {
              nibbles(b.qs, 256, by_32);
              break;
            }
            for (Index k = 0; k < 256; ++k) {
              std::uint8_t const v = b.qs[k / 32 * 16 + k % 16];
              put(k, k % 32 < 16 ? v & 0xF : v >> 4);
            }
            break;
          }
          case Format::kQ3_K: {
            quant::BlockQ3_K b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            auto* sc = reinterpret_cast<std::int8_t*>(grp + 64);
            for (int j = 0; j < 16; ++j)
              sc[j * 32 + c] = static_cast<std::int8_t>(quant::q3k_scale(b, j));
            for (Index k = 0; k < 256; ++k) put(k, quant::q3k_level(b, static_cast<int>(k)));
            break;
          }
          case Format::kQ2_K: {
            quant::BlockQ2_K b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            d16[32 + c] = b.dmin;
            auto* sc = reinterpret_cast<std::uint8_t*>(grp + 128);
            for (int j = 0; j < 16; ++j) sc[j * 32 + c] = b.scales[j];
            for (Index k = 0; k < 256; ++k) put(k, quant::q2k_level(b, static_cast<int>(k)));
            break;
          }
          case Format::kQ6_K: {
            quant::BlockQ6_K b;
            std::memcpy(&b, blk, sizeof b);
            d16[c] = b.d;
            auto* sc = reinterpret_cast<std::int8_t*>(grp + 64);
            for (int j = 0; j < 16; ++j) sc[j * 32 + c] = b.scales[j];
            if (fast) {
              // 16-deep sub-block s: k = 128 n + 32 m + l; the low 4 bits in ql[64 n + 32 (m % 2)
              // + l] (nibble m / 2), the high 2 in qh[32 n + l] (bits 2 m).
              for (Index sb = 0; sb < 16; ++sb) {
                Index const k0 = 16 * sb, half = k0 / 128, m = k0 % 128 / 32, l0 = k0 % 32;
                std::uint8_t const* ql = b.ql + 64 * half + 32 * (m % 2) + l0;
                std::uint8_t const* qh = b.qh + 32 * half + l0;
                auto const lo_shift = static_cast<int>(4 * (m / 2)),
                           hi_shift = static_cast<int>(2 * m);
                std::uint32_t nib[4], hi[4];
                for (int t = 0; t < 4; ++t) {
                  nib[t] = (load4(ql + 4 * t) >> lo_shift) & 0x0F0F0F0Fu;
                  hi[t] = (load4(qh + 4 * t) >> hi_shift) & 0x03030303u;
                }
                Index const sub = sb * 64 * 6;
                store4(sub + c * 4, nib[0] | nib[1] << 4);
                store4(sub + (32 + c) * 4, nib[2] | nib[3] << 4);
                store4(sub + 256 + c * 4, hi[0] | hi[1] << 2 | hi[2] << 4 | hi[3] << 6);
              }
              break;
            }
            for (Index k = 0; k < 256; ++k) put(k, quant::q6_level(b, static_cast<int>(k)));
            break;
          }
        }
      }
    }
  }
}

}  // namespace detail

inline void pack_quant_panels(quant::Format f, std::byte const* rows, Index N, Index K,
                              std::byte* dst) {
  detail::pack_quant_panels(f, rows, N, K, dst, true);
}

/// A quantized weight operand as the kernels read it: panel p at data + p * panel_bytes.
struct QuantWeights {
  std::byte const* data = nullptr;
  quant::Format format = quant::Format::kQ8_0;
  Index panel_bytes = 0;
};

namespace detail {

/// log2 of the level offset of an offset format (Q8_0 128, Q6_K 32, Q5_0 16, Q4_0 8, Q3_K 4);
/// Q4_K, Q5_K and Q2_K have a min instead.
constexpr int quant_offset_shift(quant::Format f) {
  switch (f) {
    case quant::Format::kQ8_0:
      return 7;
    case quant::Format::kQ6_K:
      return 5;
    case quant::Format::kQ5_0:
      return 4;
    case quant::Format::kIQ4_NL:
    case quant::Format::kIQ4_XS:
    case quant::Format::kMXFP4:
      return 7;
    case quant::Format::kQ3_K:
      return 2;
    default:
      return 3;
  }
}
/// Depth of one integer sum (a scale block of the weights).
constexpr Index quant_fold_depth(quant::Format f) {
  return f == quant::Format::kQ6_K || f == quant::Format::kQ3_K || f == quant::Format::kQ2_K ? 16
                                                                                             : 32;
}
/// Sub-blocks per group, and where their scales and mins start in the group header.
constexpr Index quant_sub_blocks(quant::Format f) {
  return quant::block_elems(f) / quant_fold_depth(f);
}
constexpr Index quant_scales_at(quant::Format f) { return quant_has_min(f) ? 128 : 64; }
/// Do a sub-block's scale and min share a byte, the scale in the low nibble (Q2_K)?
constexpr bool quant_scale_min_nibbles(quant::Format f) { return f == quant::Format::kQ2_K; }
constexpr Index quant_mins_at(quant::Format f) {
  return quant_scale_min_nibbles(f) ? quant_scales_at(f) : 128 + quant_sub_blocks(f) * 32;
}
/// The activation term the min multiplies: da * (sum of the sub-block's levels).
inline float quant_min_term(Q8Row const& a, Index k0, Index depth) {
  return depth == 32 ? a.ds[k0 / 32] : a.d[k0 / 32] * static_cast<float>(a.s16[k0 / 16]);
}

#if MOE_HAS_AVX512VNNI || MOE_HAS_AVX2_INT8
/// The byte-vector operations of the planar unpacker, on ymm and zmm: one algorithm for both
/// widths (shifts are per 16-bit lane; the unpacker masks every result to bits of its own byte).
template <int Bytes>
struct ByteOps;
template <>
struct ByteOps<32> {
  using V = __m256i;
  static V load(void const* p) { return _mm256_load_si256(static_cast<V const*>(p)); }
  static V set1(int b) { return _mm256_set1_epi8(static_cast<char>(b)); }
  static V and_(V a, V b) { return _mm256_and_si256(a, b); }
  static V or_(V a, V b) { return _mm256_or_si256(a, b); }
  static V srl(V a, int n) { return _mm256_srli_epi16(a, n); }
  static V sll(V a, int n) { return _mm256_slli_epi16(a, n); }
};
#if MOE_HAS_AVX512VNNI
template <>
struct ByteOps<64> {
  using V = __m512i;
  static V load(void const* p) { return _mm512_load_si512(p); }
  static V set1(int b) { return _mm512_set1_epi8(static_cast<char>(b)); }
  static V and_(V a, V b) { return _mm512_and_si512(a, b); }
  static V or_(V a, V b) { return _mm512_or_si512(a, b); }
  static V srl(V a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
  static V sll(V a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
};
/// quant_table(F) in every 128-bit lane of a zmm, for vpshufb.
template <quant::Format F>
MOE_ALWAYS_INLINE __m512i quant_table_zmm() {
  return _mm512_broadcast_i32x4(
      _mm_loadu_si128(reinterpret_cast<__m128i const*>(quant_table(F).data())));
}
/// The block scales of columns [c0, c0 + 16) (c0 = 0, 16) from a group's header `grp` (64-byte
/// aligned): quant_scale's values. MXFP4's E8M0 bytes become float bits as
/// ggml_e8m0_to_fp32_half makes them: (e - 1) << 23 (the exponent field), 0x00200000 << e for
/// e < 2.
template <quant::Format F>
MOE_ALWAYS_INLINE __m512 quant_scales_zmm(std::byte const* grp, Index c0) {
  if constexpr (quant_has_e8m0(F)) {
    __m512i const e =
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<__m128i const*>(grp + c0)));
    __m512i const normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    __m512i const small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    __mmask16 const below2 = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(below2, normal, small));
  } else {
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<__m256i const*>(grp + 2 * c0)));
  }
}
#endif

/// The levels of one 16-deep sub-block of a planar format (`sub`: its level bytes, 64-byte
/// aligned; pack_quant_panels' layout) for the columns [c0, c0 + L) of a vector of W bytes, L =
/// W / 4 = 8 (ymm) or 16 (zmm) columns x 4 depths: fn(t, u) for the quads t = 0, 1, 2, 3 in order,
/// u the unsigned levels of depths 4 t .. 4 t + 3, column c's at bytes 4 (c - c0) .. 4 (c - c0) + 3
/// (quant_level's values; the tests check every format and width against it).
template <quant::Format F, int W, class Fn>
MOE_ALWAYS_INLINE void planar_quads(std::uint8_t const* sub, Index c0, Fn const& fn) {
  static_assert(quant_is_planar(F));
  using O = ByteOps<W>;
  using V = typename O::V;
  V const three = O::set1(3);
  V h2 = O::load(sub + (F == quant::Format::kQ6_K ? 256 : 0) + c0 * 4);  // 2 bits of quad t at 2 t
  if constexpr (F == quant::Format::kQ6_K) {
    V const nib = O::set1(0x0F);
    for (int o = 0; o < 2; ++o) {
      V const n = O::load(sub + (o * 32 + c0) * 4);
      fn(2 * o, O::or_(O::and_(n, nib), O::sll(O::and_(h2, three), 4)));
      h2 = O::srl(h2, 2);
      fn(2 * o + 1, O::or_(O::and_(O::srl(n, 4), nib), O::sll(O::and_(h2, three), 4)));
      h2 = O::srl(h2, 2);
    }
  } else {
    [[maybe_unused]] V h1, four;
    if constexpr (F == quant::Format::kQ3_K) {  // the high bit of quad t at bit 4 (c0 / 16) + t
      h1 = O::load(sub + 128 + (c0 % 16) * 4);
      if (c0 >= 16) h1 = O::srl(h1, 4);
      four = O::set1(4);
    }
    for (int t = 0; t < 4; ++t) {
      V u = O::and_(h2, three);
      if constexpr (F == quant::Format::kQ3_K) {
        u = O::or_(u, O::and_(O::sll(h1, 2), four));
        h1 = O::srl(h1, 1);
      }
      fn(t, u);
      h2 = O::srl(h2, 2);
    }
  }
}

/// The levels of one 32-deep sub-block of Q5_K (`sub`: its 640 level bytes, 64-byte aligned;
/// pack_quant_panels' layout) for the columns [c0, c0 + L) of a vector of W bytes (L = W / 4):
/// fn(t, u) for the quads t = 0 .. 7 in order, u the unsigned levels of depths 4 t .. 4 t + 3,
/// column c's at bytes 4 (c - c0) .. 4 (c - c0) + 3 (quant_level's values). Q4_K's nibble
/// unpack, and per quad the fifth bit (bit t of the plane's byte) moved to bit 4 by one shift of
/// at most 4 left or 3 right, which keeps it inside its byte (the shifts are per 16-bit lane; the
/// mask drops what crosses), masked and or-ed in. Where the build has GFNI (AVX-512 builds for
/// Ice Lake, Zen 4 and later), the zmm width moves bits with byte-wise affine transforms
/// instead (vgf2p8affineqb: result bit i of each byte = parity(row 7 - i of an 8 x 8 bit matrix
/// AND the byte)): one picks quad t's fifth bit to bit 4 and clears the rest, one moves the high
/// nibble down, and a ternary-logic select merges the low nibble: 5 vector operations an octet,
/// where the shifts take 7 (GCC fusing each and-or into one vpternlogd) and Q4_K's unpack 3.
template <int W, class Fn>
MOE_ALWAYS_INLINE void q5k_quads(std::uint8_t const* sub, Index c0, Fn const& fn) {
#if MOE_HAS_AVX512VNNI && defined(__GFNI__)
  if constexpr (W == 64) {
    __m512i const h = _mm512_load_si512(sub + 512 + c0 * 4);
    __m512i const nib = _mm512_set1_epi8(0x0F);
    __m512i const down = _mm512_set1_epi64(0x1020408000000000);  // bits 7..4 -> 3..0
    auto high = [&]<int t>() {  // bit t -> bit 4 (matrix row 3), every other bit 0
      return _mm512_gf2p8affine_epi64_epi8(h, _mm512_set1_epi64(std::int64_t{1} << (24 + t)), 0);
    };
    auto octet = [&]<int o>() {
      __m512i const n = _mm512_load_si512(sub + (o * 32 + c0) * 4);
      // nib ? n : high (0xCA): the low nibble of n, the fifth bit, zeros above.
      fn(2 * o, _mm512_ternarylogic_epi32(nib, n, high.template operator()<2 * o>(), 0xCA));
      fn(2 * o + 1, _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(n, down, 0),
                                    high.template operator()<2 * o + 1>()));
    };
    octet.template operator()<0>();
    octet.template operator()<1>();
    octet.template operator()<2>();
    octet.template operator()<3>();
    return;
  }
#endif
  using O = ByteOps<W>;
  using V = typename O::V;
  V const nib = O::set1(0x0F), five = O::set1(0x10);
  V const h = O::load(sub + 512 + c0 * 4);
  auto high = [&]<int t>() {  // quad t's fifth bits at bit 4
    if constexpr (t <= 4) {
      return O::and_(O::sll(h, 4 - t), five);
    } else {
      return O::and_(O::srl(h, t - 4), five);
    }
  };
  auto octet = [&]<int o>() {
    V const n = O::load(sub + (o * 32 + c0) * 4);
    fn(2 * o, O::or_(O::and_(n, nib), high.template operator()<2 * o>()));
    fn(2 * o + 1, O::or_(O::and_(O::srl(n, 4), nib), high.template operator()<2 * o + 1>()));
  };
  octet.template operator()<0>();
  octet.template operator()<1>();
  octet.template operator()<2>();
  octet.template operator()<3>();
}
#endif

/// Portable kernel: MR rows x Ops operands x 32 columns, into out[r][o * 32 + c].
template <quant::Format F, int Ops>
void quant_tile_portable(Q8Row const* rows, Index MR, Index K, std::byte const* const* panels,
                         float (*out)[2 * kQuantPanelCols]) {
  using quant::Format;
  constexpr Index G = quant::block_elems(F), GB = quant_group_bytes(F), HB = quant_header_bytes(F);
  constexpr Index SB = quant_fold_depth(F);
  for (Index r = 0; r < MR; ++r) {
    Q8Row const& a = rows[r];
    for (int o = 0; o < Ops; ++o) {
      for (Index c = 0; c < kQuantPanelCols; ++c) {
        float acc = 0.0f;
        for (Index g = 0; g < K / G; ++g) {
          std::byte const* grp = panels[o] + g * GB;
          auto const* w = reinterpret_cast<std::uint8_t const*>(grp + HB);
          auto const* d16 = reinterpret_cast<std::uint16_t const*>(grp);
          for (Index sb = 0; sb < G / SB; ++sb) {
            Index const k0 = g * G + sb * SB;
            std::int32_t isum = 0;
            for (Index kk = 0; kk < SB; ++kk) {
              Index const k = sb * SB + kk;  // depth within the group
              isum += quant_level(F, w, k, c) * a.a[k0 + kk];
            }
            float const da = a.d[k0 / 32];
            float s = quant_scale(F, grp, c);
            if constexpr (quant_has_sub_scales(F)) {
              if constexpr (quant_signed_scales(F)) {
                auto const* sc = reinterpret_cast<std::int8_t const*>(grp + quant_scales_at(F));
                s = s * static_cast<float>(sc[sb * 32 + c]);
              } else {
                auto const* sc = reinterpret_cast<std::uint8_t const*>(grp + quant_scales_at(F));
                int const v = sc[sb * 32 + c];
                s = s * static_cast<float>(quant_scale_min_nibbles(F) ? v & 0xF : v);
              }
            }
            if constexpr (quant_has_min(F)) {
              float m = quant::detail::fp32(d16[32 + c]);  // Q4_1, Q5_1: -min
              if constexpr (quant_has_sub_scales(F)) {
                auto const* mn = reinterpret_cast<std::uint8_t const*>(grp + quant_mins_at(F));
                int const v = mn[sb * 32 + c];
                m = m * static_cast<float>(quant_scale_min_nibbles(F) ? v >> 4 : v);
              }
              acc = std::fma(static_cast<float>(isum) * s, da, acc);
              acc = std::fma(-m, quant_min_term(a, k0, SB), acc);
            } else {
              std::int32_t const corr = SB == 16 ? a.s16[k0 / 16] : a.s32[k0 / 32];
              std::int32_t const t = isum - corr * (1 << quant_offset_shift(F));
              acc = std::fma(static_cast<float>(t) * s, da, acc);
            }
          }
        }
        out[r][o * kQuantPanelCols + c] = acc;
      }
    }
  }
}

#if MOE_HAS_AVX512VNNI
/// AVX512-VNNI kernel: MR rows x Ops operands x 32 columns (2 vectors each), accumulators in
/// registers over the whole depth, stored to out[r * 64 + o * 32 + c] (64-byte aligned). Not
/// templated on the epilogue, which quant_cols applies: one instantiation per format and tile
/// serves every epilogue.
template <quant::Format F, Index MR, int Ops>
MOE_QUANT_NOINLINE void quant_tile_vnni(Q8Row const* rows, Index K, std::byte const* const* panels,
                                        float* out) {
  using quant::Format;
  constexpr Index G = quant::block_elems(F), GB = quant_group_bytes(F), HB = quant_header_bytes(F);
  constexpr Index SB = quant_fold_depth(F);
  __m512 acc[Ops][2][MR];
  for (int o = 0; o < Ops; ++o)
    for (int v = 0; v < 2; ++v)
      for (Index r = 0; r < MR; ++r) acc[o][v][r] = _mm512_setzero_ps();
  std::int8_t const* a[MR];
  for (Index r = 0; r < MR; ++r) a[r] = rows[r].a;
  __m512i const nib = _mm512_set1_epi8(0x0F);
  [[maybe_unused]] __m512i const tab = quant_table_zmm<F>();
  // K-quants: the scales (and mins) of a group's sub-blocks, decoded once per group from the
  // packed header (fp16 super-block scale times the integer sub-block scale, exact).
  constexpr Index NS = quant_has_sub_scales(F) ? quant_sub_blocks(F) : 1;
  constexpr int NM = quant_has_min(F) ? 2 : 1;
  alignas(64) float subs[Ops][2][NM][NS][16];
  for (Index g = 0; g < K / G; ++g) {
    std::byte const* grp[Ops];
    for (int o = 0; o < Ops; ++o) grp[o] = panels[o] + g * GB;
    if constexpr (quant_has_sub_scales(F)) {
      for (int o = 0; o < Ops; ++o) {
        for (int v = 0; v < 2; ++v) {
          __m512 const d =
              _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<__m256i const*>(grp[o] + v * 32)));
          auto const* sc = reinterpret_cast<std::uint8_t const*>(grp[o] + quant_scales_at(F));
          for (Index j = 0; j < NS; ++j) {
            __m128i const s8 =
                _mm_load_si128(reinterpret_cast<__m128i const*>(sc + j * 32 + v * 16));
            __m512i s32 =
                quant_signed_scales(F) ? _mm512_cvtepi8_epi32(s8) : _mm512_cvtepu8_epi32(s8);
            if constexpr (quant_scale_min_nibbles(F))
              s32 = _mm512_and_si512(s32, _mm512_set1_epi32(0xF));
            _mm512_store_ps(subs[o][v][0][j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s32)));
          }
          if constexpr (quant_has_min(F)) {
            __m512 const dmin = _mm512_cvtph_ps(
                _mm256_load_si256(reinterpret_cast<__m256i const*>(grp[o] + 64 + v * 32)));
            auto const* mn = reinterpret_cast<std::uint8_t const*>(grp[o] + quant_mins_at(F));
            for (Index j = 0; j < NS; ++j) {
              __m128i const m8 =
                  _mm_load_si128(reinterpret_cast<__m128i const*>(mn + j * 32 + v * 16));
              __m512i m32 = _mm512_cvtepu8_epi32(m8);
              if constexpr (quant_scale_min_nibbles(F)) m32 = _mm512_srli_epi32(m32, 4);
              _mm512_store_ps(subs[o][v][NM - 1][j], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m32)));
            }
          }
        }
      }
    }
    for (Index sb = 0; sb < G / SB; ++sb) {
      Index const k0 = g * G + sb * SB;
      // The next group's bytes, a slice per sub-block (a burst per group stalls the L2 queue).
      if (g + 1 < K / G) {
        constexpr Index per = (GB / (G / SB) + 63) / 64 * 64;
        for (int o = 0; o < Ops; ++o) {
          for (Index l = sb * per; l < std::min(GB, (sb + 1) * per); l += 64) {
            MOE_PREFETCH_L2(grp[o] + GB + l);
          }
        }
      }
      // Offset formats start each sum at -offset * (activation sum): exact, and no subtraction.
      __m512i start[MR];
      for (Index r = 0; r < MR; ++r) {
        if constexpr (quant_has_min(F)) {
          start[r] = _mm512_setzero_si512();
        } else {
          std::int32_t const sum = SB == 16 ? rows[r].s16[k0 / 16] : rows[r].s32[k0 / 32];
          start[r] = _mm512_set1_epi32(-sum * (1 << quant_offset_shift(F)));
        }
      }
      __m512i iacc[Ops][2][MR];
      for (int o = 0; o < Ops; ++o)
        for (int v = 0; v < 2; ++v)
          for (Index r = 0; r < MR; ++r) iacc[o][v][r] = start[r];
      if constexpr (quant_is_4bit(F)) {
        for (Index oct = 0; oct < SB / 8; ++oct) {
          for (int o = 0; o < Ops; ++o) {
            for (int v = 0; v < 2; ++v) {
              __m512i const packed =
                  _mm512_load_si512(grp[o] + HB + ((sb * SB / 8 + oct) * 32 + v * 16) * 4);
              __m512i lo = _mm512_and_si512(packed, nib);
              __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nib);
              if constexpr (quant_has_table(F)) {
                lo = _mm512_shuffle_epi8(tab, lo);
                hi = _mm512_shuffle_epi8(tab, hi);
              }
              for (Index r = 0; r < MR; ++r) {
                std::int32_t q0, q1;
                std::memcpy(&q0, a[r] + k0 + 8 * oct, 4);
                std::memcpy(&q1, a[r] + k0 + 8 * oct + 4, 4);
                iacc[o][v][r] = _mm512_dpbusd_epi32(iacc[o][v][r], lo, _mm512_set1_epi32(q0));
                iacc[o][v][r] = _mm512_dpbusd_epi32(iacc[o][v][r], hi, _mm512_set1_epi32(q1));
              }
            }
          }
        }
      } else if constexpr (quant_is_5bit(F)) {
        for (int o = 0; o < Ops; ++o) {
          for (int v = 0; v < 2; ++v) {
            auto const* sub =
                reinterpret_cast<std::uint8_t const*>(grp[o] + HB) + sb * kQ5kSubBytes;
            q5k_quads<64>(sub, 16 * v, [&](int t, __m512i u) {
              for (Index r = 0; r < MR; ++r) {
                std::int32_t q;
                std::memcpy(&q, a[r] + k0 + 4 * t, 4);
                iacc[o][v][r] = _mm512_dpbusd_epi32(iacc[o][v][r], u, _mm512_set1_epi32(q));
              }
            });
          }
        }
      } else if constexpr (quant_is_planar(F)) {
        for (int o = 0; o < Ops; ++o) {
          for (int v = 0; v < 2; ++v) {
            auto const* sub =
                reinterpret_cast<std::uint8_t const*>(grp[o] + HB) + sb * 64 * quant_level_bits(F);
            planar_quads<F, 64>(sub, 16 * v, [&](int t, __m512i u) {
              for (Index r = 0; r < MR; ++r) {
                std::int32_t q;
                std::memcpy(&q, a[r] + k0 + 4 * t, 4);
                iacc[o][v][r] = _mm512_dpbusd_epi32(iacc[o][v][r], u, _mm512_set1_epi32(q));
              }
            });
          }
        }
      } else {
        for (Index qd = 0; qd < SB / 4; ++qd) {
          for (int o = 0; o < Ops; ++o) {
            for (int v = 0; v < 2; ++v) {
              __m512i const wv =
                  _mm512_load_si512(grp[o] + HB + ((sb * SB / 4 + qd) * 32 + v * 16) * 4);
              for (Index r = 0; r < MR; ++r) {
                std::int32_t q;
                std::memcpy(&q, a[r] + k0 + 4 * qd, 4);
                iacc[o][v][r] = _mm512_dpbusd_epi32(iacc[o][v][r], wv, _mm512_set1_epi32(q));
              }
            }
          }
        }
      }
      // Fold the block's integer sums into the fp32 accumulators.
      __m512 da[MR];
      for (Index r = 0; r < MR; ++r) da[r] = _mm512_set1_ps(rows[r].d[k0 / 32]);
      for (int o = 0; o < Ops; ++o) {
        for (int v = 0; v < 2; ++v) {
          __m512 s;
          if constexpr (quant_has_sub_scales(F)) {
            s = _mm512_load_ps(subs[o][v][0][sb]);
          } else {
            s = quant_scales_zmm<F>(grp[o], 16 * v);
          }
          for (Index r = 0; r < MR; ++r) {
            __m512 const f = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[o][v][r]), s);
            acc[o][v][r] = _mm512_fmadd_ps(f, da[r], acc[o][v][r]);
          }
          if constexpr (quant_has_min(F)) {
            __m512 const m = quant_has_sub_scales(F)
                                 ? _mm512_load_ps(subs[o][v][NM - 1][sb])
                                 : _mm512_cvtph_ps(_mm256_load_si256(
                                       reinterpret_cast<__m256i const*>(grp[o] + 64 + v * 32)));
            for (Index r = 0; r < MR; ++r) {
              acc[o][v][r] = _mm512_fnmadd_ps(m, _mm512_set1_ps(quant_min_term(rows[r], k0, SB)),
                                              acc[o][v][r]);
            }
          }
        }
      }
    }
  }
  for (Index r = 0; r < MR; ++r) {
    for (int o = 0; o < Ops; ++o) {
      for (int v = 0; v < 2; ++v)
        _mm512_store_ps(out + r * 2 * kQuantPanelCols + o * 32 + v * 16, acc[o][v][r]);
    }
  }
}
#endif

#if MOE_HAS_AVX2_INT8
/// acc + the sums of 4 products u_j a_j per 32-bit lane (u unsigned, a signed bytes), exact:
/// AVX-VNNI vpdpbusd, or vpmaddubsw (pairs into int16: exact while u <= 127, as every level of
/// the formats but Q8_0 is, and |a| <= 127, as quantize_row_q8 makes them) and vpmaddwd.
MOE_ALWAYS_INLINE __m256i quant_dot_ymm(__m256i acc, __m256i u, __m256i a) {
#if MOE_HAS_AVXVNNI
  return _mm256_dpbusd_avx_epi32(acc, u, a);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}

/// The block scales of columns [c0, c0 + 8) (c0 a multiple of 8) from a group's header `grp`:
/// quant_scale's values, MXFP4's as quant_scales_zmm makes them.
template <quant::Format F>
MOE_ALWAYS_INLINE __m256 quant_scales_ymm(std::byte const* grp, Index c0) {
  if constexpr (quant_has_e8m0(F)) {
    __m256i const e =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(grp + c0)));
    __m256i const normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i const small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i const below2 = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, below2));
  } else {
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<__m128i const*>(grp + 2 * c0)));
  }
}

/// The ymm kernel (AVX2 builds): MR rows x 8 NV columns (NV vectors of 8) of one operand, columns
/// [8 NV h, 8 NV (h + 1)) of the panel, accumulators in registers over the whole depth, stored to
/// out[r * 64 + c] (32-byte aligned). The zmm kernel's integer sums and folds, per column in the
/// same order: the same bits. Without AVX-VNNI, Q8_0's levels u = q + 128 exceed vpmaddubsw's
/// exact range, so its sums are formed as sum q a (|q| by sign(a, q)) from a zero start instead
/// of sum u a from -128 sum a: the same integer.
template <quant::Format F, Index MR, int NV>
MOE_QUANT_NOINLINE void quant_cols_ymm(Q8Row const* rows, Index K, std::byte const* panel, Index h,
                                       float* out) {
  using quant::Format;
  constexpr Index G = quant::block_elems(F), GB = quant_group_bytes(F), HB = quant_header_bytes(F);
  constexpr Index SB = quant_fold_depth(F);
  constexpr Index NS = quant_has_sub_scales(F) ? quant_sub_blocks(F) : 1;
  constexpr int NM = quant_has_min(F) ? 2 : 1;
  constexpr bool kSigned =  // see above; the table formats' levels too (up to 241)
      (F == Format::kQ8_0 || quant_has_table(F)) && !MOE_HAS_AVXVNNI;
  // Without VNNI, levels of at most 15 add a sub-block's vpmaddubsw pairs in int16 (at most
  // 8 quads x 2 x 15 x 127 = 30480) and widen once per sub-block; Q6_K's (up to 63) widen per quad.
  constexpr bool kPairs16 = !MOE_HAS_AVXVNNI && !kSigned &&
                            (quant_is_4bit(F) || F == Format::kQ3_K || F == Format::kQ2_K);
  __m256 acc[NV][MR];
  for (int v = 0; v < NV; ++v)
    for (Index r = 0; r < MR; ++r) acc[v][r] = _mm256_setzero_ps();
  __m256i const nib = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] __m256i const tab = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<__m128i const*>(quant_table(F).data())));
  // acc + sum u a over 4 bytes; kSigned: as sum (u - 128) a, the signed level by vpsignb.
  auto dot = [](__m256i sum, __m256i u, std::int32_t q) {
    if constexpr (kSigned) {
      __m256i const w = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
      return quant_dot_ymm(sum, _mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_set1_epi32(q), w));
    } else {
      return quant_dot_ymm(sum, u, _mm256_set1_epi32(q));
    }
  };
  alignas(32) float subs[NV][NM][NS][8];
  for (Index g = 0; g < K / G; ++g) {
    std::byte const* const grp = panel + g * GB;
    if constexpr (quant_has_sub_scales(F)) {
      for (int v = 0; v < NV; ++v) {
        Index const c0 = 8 * (NV * h + v);  // first column of vector v
        __m256 const d =
            _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<__m128i const*>(grp + 2 * c0)));
        auto const* sc = reinterpret_cast<std::uint8_t const*>(grp + quant_scales_at(F));
        for (Index j = 0; j < NS; ++j) {
          __m128i const s8 = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(sc + j * 32 + c0));
          __m256i s32 =
              quant_signed_scales(F) ? _mm256_cvtepi8_epi32(s8) : _mm256_cvtepu8_epi32(s8);
          if constexpr (quant_scale_min_nibbles(F))
            s32 = _mm256_and_si256(s32, _mm256_set1_epi32(0xF));
          _mm256_store_ps(subs[v][0][j], _mm256_mul_ps(d, _mm256_cvtepi32_ps(s32)));
        }
        if constexpr (quant_has_min(F)) {
          __m256 const dmin =
              _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<__m128i const*>(grp + 64 + 2 * c0)));
          auto const* mn = reinterpret_cast<std::uint8_t const*>(grp + quant_mins_at(F));
          for (Index j = 0; j < NS; ++j) {
            __m128i const m8 = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(mn + j * 32 + c0));
            __m256i m32 = _mm256_cvtepu8_epi32(m8);
            if constexpr (quant_scale_min_nibbles(F)) m32 = _mm256_srli_epi32(m32, 4);
            _mm256_store_ps(subs[v][NM - 1][j], _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m32)));
          }
        }
      }
    }
    for (Index sb = 0; sb < G / SB; ++sb) {
      Index const k0 = g * G + sb * SB;
      if (g + 1 < K / G) {  // the next group's half, a slice per sub-block
        constexpr Index per = (GB / (G / SB) + 63) / 64 * 64;
        for (Index l = sb * per; l < std::min(GB, (sb + 1) * per); l += 64) {
          MOE_PREFETCH_L2(grp + GB + l);
        }
      }
      // Offset formats start each sum at -offset * (activation sum): exact, and no subtraction.
      auto start = [&](Index r) {
        if constexpr (!quant_has_min(F) && !kSigned) {
          std::int32_t const sum = SB == 16 ? rows[r].s16[k0 / 16] : rows[r].s32[k0 / 32];
          return _mm256_set1_epi32(-sum * (1 << quant_offset_shift(F)));
        }
        return _mm256_setzero_si256();
      };
      __m256i iacc[NV][MR];
      if constexpr (!kPairs16) {
        for (Index r = 0; r < MR; ++r)
          for (int v = 0; v < NV; ++v) iacc[v][r] = start(r);
      }
      if constexpr (quant_is_4bit(F)) {
        static_assert(SB <= 32, "int16 pair sums of at most 8 quads");
        [[maybe_unused]] __m256i p16[NV][MR];
        if constexpr (kPairs16) {
          for (int v = 0; v < NV; ++v)
            for (Index r = 0; r < MR; ++r) p16[v][r] = _mm256_setzero_si256();
        }
        for (Index oct = 0; oct < SB / 8; ++oct) {
          for (int v = 0; v < NV; ++v) {
            __m256i const packed = _mm256_load_si256(reinterpret_cast<__m256i const*>(
                grp + HB + ((sb * SB / 8 + oct) * 32 + 8 * (NV * h + v)) * 4));
            __m256i lo = _mm256_and_si256(packed, nib);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nib);
            if constexpr (quant_has_table(F)) {
              lo = _mm256_shuffle_epi8(tab, lo);
              hi = _mm256_shuffle_epi8(tab, hi);
            }
            for (Index r = 0; r < MR; ++r) {
              std::int32_t q0, q1;
              std::memcpy(&q0, rows[r].a + k0 + 8 * oct, 4);
              std::memcpy(&q1, rows[r].a + k0 + 8 * oct + 4, 4);
              if constexpr (kPairs16) {
                // 4-bit levels: the vpmaddubsw pairs of a whole sub-block (at most 2 x 15 x 127
                // per quad, 8 quads: 30480) add up in int16 exactly; one vpmaddwd per sub-block.
                p16[v][r] =
                    _mm256_add_epi16(p16[v][r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(q0)));
                p16[v][r] =
                    _mm256_add_epi16(p16[v][r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q1)));
              } else {
                iacc[v][r] = dot(iacc[v][r], lo, q0);
                iacc[v][r] = dot(iacc[v][r], hi, q1);
              }
            }
          }
        }
        if constexpr (kPairs16) {
          for (int v = 0; v < NV; ++v) {  // (iacc is not live over the loop: 16 registers)
            for (Index r = 0; r < MR; ++r) {
              iacc[v][r] =
                  _mm256_add_epi32(start(r), _mm256_madd_epi16(p16[v][r], _mm256_set1_epi16(1)));
            }
          }
        }
      } else if constexpr (quant_is_5bit(F)) {
        // Without VNNI the vpmaddubsw pairs (at most 2 x 31 x 127 = 7874 per quad) add up in int16
        // over 4 quads (31496) and widen twice per sub-block.
        for (int v = 0; v < NV; ++v) {
          auto const* sub = reinterpret_cast<std::uint8_t const*>(grp + HB) + sb * kQ5kSubBytes;
#if !MOE_HAS_AVXVNNI
          __m256i p16[MR];
          for (Index r = 0; r < MR; ++r) p16[r] = _mm256_setzero_si256();
#endif
          q5k_quads<32>(sub, 8 * (NV * h + v), [&](int t, __m256i u) {
            for (Index r = 0; r < MR; ++r) {
              std::int32_t q;
              std::memcpy(&q, rows[r].a + k0 + 4 * t, 4);
#if MOE_HAS_AVXVNNI
              iacc[v][r] = quant_dot_ymm(iacc[v][r], u, _mm256_set1_epi32(q));
#else
              p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(u, _mm256_set1_epi32(q)));
              if (t % 4 == 3) {
                iacc[v][r] =
                    _mm256_add_epi32(iacc[v][r], _mm256_madd_epi16(p16[r], _mm256_set1_epi16(1)));
                p16[r] = _mm256_setzero_si256();
              }
#endif
            }
          });
        }
      } else if constexpr (quant_is_planar(F)) {
        [[maybe_unused]] __m256i p16[NV][MR];
        if constexpr (kPairs16) {
          for (int v = 0; v < NV; ++v)
            for (Index r = 0; r < MR; ++r) p16[v][r] = _mm256_setzero_si256();
        }
        for (int v = 0; v < NV; ++v) {
          auto const* sub =
              reinterpret_cast<std::uint8_t const*>(grp + HB) + sb * 64 * quant_level_bits(F);
          planar_quads<F, 32>(sub, 8 * (NV * h + v), [&](int t, __m256i u) {
            for (Index r = 0; r < MR; ++r) {
              std::int32_t q;
              std::memcpy(&q, rows[r].a + k0 + 4 * t, 4);
              if constexpr (kPairs16) {
                p16[v][r] =
                    _mm256_add_epi16(p16[v][r], _mm256_maddubs_epi16(u, _mm256_set1_epi32(q)));
              } else {
                iacc[v][r] = quant_dot_ymm(iacc[v][r], u, _mm256_set1_epi32(q));
              }
            }
          });
        }
        if constexpr (kPairs16) {
          for (int v = 0; v < NV; ++v) {
            for (Index r = 0; r < MR; ++r) {
              iacc[v][r] =
                  _mm256_add_epi32(start(r), _mm256_madd_epi16(p16[v][r], _mm256_set1_epi16(1)));
            }
          }
        }
      } else {
        for (Index qd = 0; qd < SB / 4; ++qd) {
          for (int v = 0; v < NV; ++v) {
            __m256i const wv = _mm256_load_si256(reinterpret_cast<__m256i const*>(
                grp + HB + ((sb * SB / 4 + qd) * 32 + 8 * (NV * h + v)) * 4));
            for (Index r = 0; r < MR; ++r) {
              std::int32_t q;
              std::memcpy(&q, rows[r].a + k0 + 4 * qd, 4);
              iacc[v][r] = dot(iacc[v][r], wv, q);
            }
          }
        }
      }
      for (int v = 0; v < NV; ++v) {
        __m256 s;
        if constexpr (quant_has_sub_scales(F)) {
          s = _mm256_load_ps(subs[v][0][sb]);
        } else {
          s = quant_scales_ymm<F>(grp, 8 * (NV * h + v));
        }
        for (Index r = 0; r < MR; ++r) {
          __m256 const f = _mm256_mul_ps(_mm256_cvtepi32_ps(iacc[v][r]), s);
          acc[v][r] = _mm256_fmadd_ps(f, _mm256_set1_ps(rows[r].d[k0 / 32]), acc[v][r]);
        }
        if constexpr (quant_has_min(F)) {
          __m256 const m = quant_has_sub_scales(F)
                               ? _mm256_load_ps(subs[v][NM - 1][sb])
                               : _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<__m128i const*>(
                                     grp + 64 + 2 * (8 * (NV * h + v)))));
          for (Index r = 0; r < MR; ++r) {
            acc[v][r] =
                _mm256_fnmadd_ps(m, _mm256_set1_ps(quant_min_term(rows[r], k0, SB)), acc[v][r]);
          }
        }
      }
    }
  }
  for (Index r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) _mm256_store_ps(out + r * 2 * kQuantPanelCols + 8 * v, acc[v][r]);
  }
}

/// The ymm kernel: MR rows x Ops operands x 32 columns into out[r * 64 + o * 32 + c], by
/// quant_cols_ymm per operand: one row over all 32 columns at once (each 128-byte row of levels
/// read whole, in order: one sequential stream from DRAM), 2 or 3 rows per column half (16 ymm
/// registers hold a half's accumulators and integer sums for 3 rows; the activations are re-read
/// from L1 per half, the half's levels from L1 or L2).
template <quant::Format F, Index MR, int Ops>
void quant_tile_ymm(Q8Row const* rows, Index K, std::byte const* const* panels, float* out) {
  for (int o = 0; o < Ops; ++o) {
    if constexpr (MR == 1) {
      quant_cols_ymm<F, 1, 4>(rows, K, panels[o], 0, out + o * kQuantPanelCols);
    } else {
      for (Index h = 0; h < 2; ++h) {
        quant_cols_ymm<F, MR, 2>(rows, K, panels[o], h, out + o * kQuantPanelCols + 16 * h);
      }
    }
  }
}
#endif

}  // namespace detail

/// Rows whose quantized activations a quant_cols call makes at a time (when a.q8 is null).
inline constexpr Index kQuantChunkRows = 128;

#if MOE_HAS_AMX_INT8
namespace detail {

/// A last row tile of fewer rows than this goes to the VNNI kernel (one tile of 16 rows costs
/// the AMX kernel about what 10 to 12 rows cost the VNNI kernel: Sapphire Rapids, K 2048).
inline constexpr Index kAmxInt8MinRows = 12;

/// Bytes of the AMX int8 kernel's scratch for depth K (a multiple of 32): a row chunk's A tiles
/// (kQuantChunkRows x K int8), its per-row values of each sub-block (da, min term), a
/// panel's scale and min vectors, its levels as signed bytes (4 column tiles), the rotating C
/// tiles and a row tile's outputs. A multiple of 64.
constexpr Index quant_amx_scratch_bytes(Index K) {
  Index const nsb = K / 16;
  return kQuantChunkRows * K + 2 * kQuantChunkRows * nsb * 4 + 2 * nsb * 4 * 64 + 4 * K * 16 +
         2 * 4 * 1024 + 16 * 4 * 16 * 4;
}

/// The parts of the AMX int8 scratch.
struct AmxInt8Scratch {
  std::int8_t* a;    // [tile][block][16][depth]: A tiles (rows past the chunk zero)
  float* da;         // [tile][sub-block][16]: the activation block's scale
  float* mt;         // [tile][sub-block][16]: the min term da * (level sum), min formats
  float* sv;         // [sub-block][column tile][16]: the weights' scales
  float* mv;         // [sub-block][column tile][16]: the weights' mins
  std::uint8_t* ub;  // [column tile][K / 4][64]: the panel's signed levels, B tile rows
  std::int32_t* cb;  // [4][16][16]: the rotating C tiles, stored for the fold
  float* acc;        // [16][column tiles x 16]: a row tile's outputs, for the epilogue
  AmxInt8Scratch(std::byte* base, Index K) {
    Index const nsb = K / 16;
    auto take = [&](Index bytes) {
      std::byte* p = base;
      base += bytes;
      return p;
    };
    a = reinterpret_cast<std::int8_t*>(take(kQuantChunkRows * K));
    da = reinterpret_cast<float*>(take(kQuantChunkRows * nsb * 4));
    mt = reinterpret_cast<float*>(take(kQuantChunkRows * nsb * 4));
    sv = reinterpret_cast<float*>(take(nsb * 4 * 64));
    mv = reinterpret_cast<float*>(take(nsb * 4 * 64));
    ub = reinterpret_cast<std::uint8_t*>(take(4 * K * 16));
    cb = reinterpret_cast<std::int32_t*>(take(2 * 4 * 1024));
    acc = reinterpret_cast<float*>(take(16 * 4 * 16 * 4));
  }
};

/// Rows [0, n) of a chunk (row_of(i): its Q8Row) into the AMX scratch: the int8 levels as A tile
/// rows, and per row and sub-block of format F the values the fold uses, so that a row tile's
/// are 16 consecutive words. Rows n .. round_up(n, 16) are zero (their outputs are not used).
template <quant::Format F, class RowOf>
void amx_int8_prepare(RowOf const& row_of, Index n, Index K, AmxInt8Scratch const& s) {
  constexpr Index SB = quant_fold_depth(F);
  Index const nsb = K / SB, npad = (n + 15) / 16 * 16;
  for (Index r = 0; r < npad; ++r) {
    Index const at = (r / 16) * nsb * 16 + r % 16;
    // Row r's levels of block b at a + ((tile * nsb + b) * 16 + r % 16) * SB: each A tile is
    // 16 x SB contiguous bytes (a stride of K bytes maps the 16 rows to few L1 sets).
    std::int8_t* const dst = s.a + (r / 16) * 16 * K + (r % 16) * SB;
    if (r >= n) {
      for (Index b = 0; b < nsb; ++b) {
        std::memset(dst + b * 16 * SB, 0, SB);
        s.da[at + b * 16] = s.mt[at + b * 16] = 0.0f;
      }
      continue;
    }
    Q8Row const q = row_of(r);
    for (Index b = 0; b < nsb; ++b) {
      Index const k0 = b * SB;
      std::memcpy(dst + b * 16 * SB, q.a + k0, SB);
      s.da[at + b * 16] = q.d[k0 / 32];
      s.mt[at + b * 16] = quant_has_min(F) ? quant_min_term(q, k0, SB) : 0.0f;
    }
  }
}

/// One quantized panel (Ops operands x 32 columns: NT = 2 Ops column tiles of 16) times the n
/// rows prepared in `s` (amx_int8_prepare), with AMX tdpbssd tiles; emit(i, row) gets row i's
/// NT x 16 outputs.
///   - The panel's levels become signed bytes, u - offset (the offset formats) or u (the min
///     formats), in B tile rows (16 columns x 4 depths), once per panel (during the first row
///     tile); the sum of a scale block, sum a (u - offset), is then exactly the VNNI kernel's
///     integer sum.
///   - Per row tile and column tile, the blocks of depth SB run through C tiles 0-3, A tiles
///     4-5 and B tiles 6-7 in rotation (configured by amx_int8_config), each C tile stored and
///     folded two blocks later into 16 fp32 accumulators in registers, with the VNNI kernel's
///     operations in its order: acc = fma(float(isum) * s, da, acc) [acc = fnmadd(m, mt, acc)].
///     So the results are the VNNI kernel's bits, and the tile unit runs ahead of the folds.
/// `next[0..2)`: the panel the caller multiplies next (each operand's bytes, null for none),
/// `next_bytes` bytes each: prefetched into L2 over this panel's blocks, so that its conversion
/// reads L2, not DRAM. A hint only.
template <quant::Format F, int Ops, class Emit>
void amx_int8_panel(AmxInt8Scratch const& s, Index n, Index K, std::byte const* const* panels,
                    std::byte const* const* next, Index next_bytes, Emit const& emit) {
  constexpr Index G = quant::block_elems(F), GB = quant_group_bytes(F), HB = quant_header_bytes(F);
  constexpr Index SB = quant_fold_depth(F), NS = G / SB;
  constexpr int NT = 2 * Ops;
  constexpr bool kMin = quant_has_min(F);
  Index const nsb = K / SB;
  // Scale (and min) vectors of every sub-block and column tile, as the VNNI kernel makes them.
  for (Index g = 0; g < K / G; ++g) {
    for (int ct = 0; ct < NT; ++ct) {
      std::byte const* grp = panels[ct / 2] + g * GB;
      int const v = ct % 2;
      __m512 const d = quant_scales_zmm<F>(grp, 16 * v);
      if constexpr (quant_has_sub_scales(F)) {
        auto const* sc = reinterpret_cast<std::uint8_t const*>(grp + quant_scales_at(F));
        for (Index j = 0; j < NS; ++j) {
          __m128i const s8 = _mm_load_si128(reinterpret_cast<__m128i const*>(sc + j * 32 + v * 16));
          __m512i s32 =
              quant_signed_scales(F) ? _mm512_cvtepi8_epi32(s8) : _mm512_cvtepu8_epi32(s8);
          if constexpr (quant_scale_min_nibbles(F))
            s32 = _mm512_and_si512(s32, _mm512_set1_epi32(0xF));
          _mm512_store_ps(s.sv + ((g * NS + j) * NT + ct) * 16,
                          _mm512_mul_ps(d, _mm512_cvtepi32_ps(s32)));
        }
        if constexpr (kMin) {
          __m512 const dmin = _mm512_cvtph_ps(
              _mm256_load_si256(reinterpret_cast<__m256i const*>(grp + 64 + v * 32)));
          auto const* mn = reinterpret_cast<std::uint8_t const*>(grp + quant_mins_at(F));
          for (Index j = 0; j < NS; ++j) {
            __m128i const m8 =
                _mm_load_si128(reinterpret_cast<__m128i const*>(mn + j * 32 + v * 16));
            __m512i m32 = _mm512_cvtepu8_epi32(m8);
            if constexpr (quant_scale_min_nibbles(F)) m32 = _mm512_srli_epi32(m32, 4);
            _mm512_store_ps(s.mv + ((g * NS + j) * NT + ct) * 16,
                            _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m32)));
          }
        }
      } else {
        _mm512_store_ps(s.sv + (g * NT + ct) * 16, d);
        if constexpr (kMin) {  // Q4_1, Q5_1: the negated fp16 min
          _mm512_store_ps(s.mv + (g * NT + ct) * 16,
                          _mm512_cvtph_ps(_mm256_load_si256(
                              reinterpret_cast<__m256i const*>(grp + 64 + v * 32))));
        }
      }
    }
  }
  // Signed levels, B tile rows: column tile ct's row q (depths 4 q .. 4 q + 3) at ub + (ct K / 4
  // + q) 64, made block by block during the first row tile (one block ahead of its use, so that
  // the panel's loads overlap the tile unit and the folds) and reused by the others. 4-bit:
  // octet o of a group holds quads 2 o (low nibbles) and 2 o + 1 (high); planar formats: a
  // sub-block's 4 quads from planar_quads.
  __m512i const off = _mm512_set1_epi8(kMin ? 0 : static_cast<char>(1 << quant_offset_shift(F)));
  auto convert = [&](int ct, Index blk) {
    Index const g = blk / NS, j = blk % NS;
    std::byte const* w = panels[ct / 2] + g * GB + HB + (ct % 2) * 64;
    std::int8_t* q = reinterpret_cast<std::int8_t*>(s.ub) + ct * K * 16 + blk * SB / 4 * 64;
    if constexpr (quant_is_planar(F)) {
      auto const* sub = reinterpret_cast<std::uint8_t const*>(panels[ct / 2] + g * GB + HB) +
                        j * 64 * quant_level_bits(F);
      planar_quads<F, 64>(sub, (ct % 2) * 16, [&](int t, __m512i u) {
        _mm512_store_si512(q + t * 64, _mm512_sub_epi8(u, off));
      });
    } else if constexpr (quant_is_5bit(F)) {
      auto const* sub =
          reinterpret_cast<std::uint8_t const*>(panels[ct / 2] + g * GB + HB) + j * kQ5kSubBytes;
      q5k_quads<64>(sub, (ct % 2) * 16, [&](int t, __m512i u) {
        _mm512_store_si512(q + t * 64, _mm512_sub_epi8(u, off));
      });
    } else if constexpr (quant_is_4bit(F)) {
      __m512i const nib = _mm512_set1_epi8(0x0F);
      [[maybe_unused]] __m512i const tab = quant_table_zmm<F>();
      for (Index o = j * SB / 8; o < (j + 1) * SB / 8; ++o, q += 128) {
        __m512i const packed = _mm512_load_si512(w + o * 128);
        __m512i lo = _mm512_and_si512(packed, nib);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nib);
        if constexpr (quant_has_table(F)) {
          lo = _mm512_shuffle_epi8(tab, lo);
          hi = _mm512_shuffle_epi8(tab, hi);
        }
        _mm512_store_si512(q, _mm512_sub_epi8(lo, off));
        _mm512_store_si512(q + 64, _mm512_sub_epi8(hi, off));
      }
    } else {
      for (Index o = j * SB / 4; o < (j + 1) * SB / 4; ++o, q += 64) {
        _mm512_store_si512(q, _mm512_sub_epi8(_mm512_load_si512(w + o * 128), off));
      }
    }
  };
  Index const lines = (next_bytes + 63) / 64;
  Index const pf_total = (next[0] ? lines : 0) + (next[1] ? lines : 0);
  Index const pf_step = (pf_total + (n + 15) / 16 * NT * nsb - 1) / ((n + 15) / 16 * NT * nsb);
  Index pf = 0;
  for (Index t0 = 0; t0 < n; t0 += 16) {
    Index const tile = t0 / 16, rows = std::min<Index>(16, n - t0);
    std::int8_t const* at = s.a + t0 * K;
    float const* da = s.da + tile * nsb * 16;
    float const* mt = s.mt + tile * nsb * 16;
    for (int ct = 0; ct < NT; ++ct) {
      std::int8_t const* bt = reinterpret_cast<std::int8_t const*>(s.ub) + ct * K * 16;
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      if (t0 == 0) convert(ct, 0);
      for (Index b = 0; b < nsb + 2; ++b) {
        if (b < nsb) {
          if (t0 == 0 && b + 1 < nsb) convert(ct, b + 1);
          for (Index i = 0; i < pf_step && pf < pf_total; ++i, ++pf) {
            std::byte const* line = next[0] && pf < lines
                                        ? next[0] + pf * 64
                                        : next[1] + (pf - (next[0] ? lines : 0)) * 64;
            MOE_PREFETCH_L2(line);
          }
          std::int8_t const* ab = at + b * 16 * SB;
          std::int8_t const* bb = bt + b * SB / 4 * 64;
          std::int32_t* cb = s.cb + (b % 4) * 256;
          amx_memory_barrier();
          // One block: C tile = A tile (16 rows x SB levels) x B tile (SB / 4 rows x 16
          // columns x 4 levels), stored for the fold (GCC's tile intrinsics take literal tile
          // numbers, hence the macro).
#define MOE_AMX_INT8_STEP(C, A, B) \
  _tile_loadd(A, ab, SB);          \
  _tile_loadd(B, bb, 64);          \
  _tile_zero(C);                   \
  _tile_dpbssd(C, A, B);           \
  _tile_stored(C, cb, 64)
          switch (b % 4) {
            case 0:
              MOE_AMX_INT8_STEP(0, 4, 6);
              break;
            case 1:
              MOE_AMX_INT8_STEP(1, 5, 7);
              break;
            case 2:
              MOE_AMX_INT8_STEP(2, 4, 6);
              break;
            default:
              MOE_AMX_INT8_STEP(3, 5, 7);
              break;
          }
#undef MOE_AMX_INT8_STEP
          amx_memory_barrier();
        }
        if (b < 2) continue;
        Index const f = b - 2;
        std::int32_t const* cb = s.cb + (f % 4) * 256;
        __m512 const sc = _mm512_load_ps(s.sv + (f * NT + ct) * 16);
        for (int r = 0; r < 16; ++r) {
          __m512 const x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + r * 16)), sc);
          acc[r] = _mm512_fmadd_ps(x, _mm512_set1_ps(da[f * 16 + r]), acc[r]);
        }
        if constexpr (kMin) {
          __m512 const mn = _mm512_load_ps(s.mv + (f * NT + ct) * 16);
          for (int r = 0; r < 16; ++r)
            acc[r] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(mt[f * 16 + r]), acc[r]);
        }
      }
      for (int r = 0; r < 16; ++r) _mm512_store_ps(s.acc + r * NT * 16 + ct * 16, acc[r]);
    }
    for (Index r = 0; r < rows; ++r) emit(t0 + r, s.acc + r * NT * 16);
  }
}

/// The tile shapes amx_int8_panel uses for format F: C 0-3 (16 x 16 int32), A 4-5 (16 rows x SB
/// levels), B 6-7 (SB / 4 rows x 16 columns x 4 levels).
template <quant::Format F>
MOE_ALWAYS_INLINE void amx_int8_config() {
  constexpr Index SB = quant_fold_depth(F);
  AmxTileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = static_cast<std::uint16_t>(t == 4 || t == 5 ? SB : 64);
    c.rows[t] = static_cast<std::uint8_t>(t >= 6 ? SB / 4 : 16);
  }
  amx_configure(c);
}

}  // namespace detail
#endif

/// Is the AMX int8 kernel quant_cols' choice in this process (moe::quant_kernel() is kAmx, and
/// this build has it)?
inline bool quant_amx() {
#if MOE_HAS_AMX_INT8
  return quant_kernel() == QuantKernel::kAmx;
#else
  return false;
#endif
}

/// Floats of scratch quant_cols needs for depth K: a row chunk's quantized activations (when the
/// caller hands none), one staging tile and, in builds with the AMX int8 kernel, its scratch
/// (detail::quant_amx_scratch_bytes), 64-byte aligned.
constexpr Index quant_scratch_floats(Index K) {
  Index bytes = kQuantChunkRows * q8_row_bytes(K) + 8 * 2 * kQuantPanelCols * 4;
#if MOE_HAS_AMX_INT8
  bytes += detail::quant_amx_scratch_bytes(K);
#endif
  return bytes / 4 + 32;
}

/// Largest row tile of the quantized kernels for Ops operands.
constexpr Index quant_max_mr(int ops) {
  return MOE_HAS_AVX512VNNI ? (ops == 1 ? 6 : 3) : 3;  // ymm: 3 rows of one column half
}

/// Columns [p0 * 32, p1 * 32) of the projection of the M rows of `a` (depth K, K a multiple of
/// the format's block) against Ops = Epi::kOperands quantized operands w[0..Ops), finished by
/// `epi` (StoreEpilogue, GluEpilogue, ActEpilogue; panel index p in units of 32 columns). The
/// rows come quantized in a.q8 (quantize_rows_q8, row stride a.ldq, through a's index), or are
/// quantized here per chunk of kQuantChunkRows rows into scratch (bitwise the same).
/// `scratch`: quant_scratch_floats(K) floats. Allocates nothing. `after` (Ops operands, or
/// null), `after_p`: the panel the caller multiplies next, which the AMX kernel prefetches into
/// L2 during this call's last panel (a hint; results never depend on it).
template <class Epi, class Arch = simd::DefaultArch>
void quant_cols(RowSource a, Index M, Index K, QuantWeights const* w, Index p0, Index p1,
                Epi const& epi, float* scratch,
                [[maybe_unused]] QuantWeights const* after = nullptr,
                [[maybe_unused]] Index after_p = 0) {
  constexpr int Ops = Epi::kOperands;
  using B = simd::Batch<float, Arch>;
  constexpr Index L = static_cast<Index>(B::size);
  if (M <= 0 || p1 <= p0) return;
  quant::Format const f = w[0].format;
  auto const addr = reinterpret_cast<std::uintptr_t>(scratch);
  auto* const base = reinterpret_cast<std::byte*>(scratch) + (64 - addr % 64) % 64;
  Index const rb = q8_row_bytes(K);
  std::byte* const qbuf = base;
  auto* const stage = reinterpret_cast<float(*)[2 * kQuantPanelCols]>(base + kQuantChunkRows * rb);
#if MOE_HAS_AMX_INT8
  // Row tiles of 16 by AMX tiles (bitwise the VNNI kernel's results), where the CPU has them.
  bool const amx = L == 16 && quant_amx();
  detail::AmxInt8Scratch const xs(base + kQuantChunkRows * rb + 8 * 2 * kQuantPanelCols * 4, K);
#endif
  for (Index c0 = 0; c0 < M; c0 += kQuantChunkRows) {
    Index const mc = std::min(kQuantChunkRows, M - c0);
    if (!a.q8) quantize_rows_q8(a.from(c0), mc, K, qbuf, rb);
    auto row_of = [&](Index i) {
      return a.q8 ? q8_row(a.q8 + a.at(c0 + i) * a.ldq, K) : q8_row(qbuf + i * rb, K);
    };
    auto run = [&]<quant::Format F>() {
      // Rows [0, tiled) by AMX tiles (a last tile of at least kAmxInt8MinRows rows included,
      // zero-padded), the rest by the VNNI or portable kernel.
      Index tiled = 0;
#if MOE_HAS_AMX_INT8
      if (amx) {
        tiled = mc % 16 >= detail::kAmxInt8MinRows ? mc : mc / 16 * 16;
        if (tiled > 0) {
          detail::amx_int8_prepare<F>(row_of, tiled, K, xs);
          detail::amx_int8_config<F>();
        }
      }
#endif
      for (Index p = p0; p < p1; ++p) {
        std::byte const* panels[2] = {w[0].data + p * w[0].panel_bytes,
                                      Ops > 1 ? w[1].data + p * w[1].panel_bytes : nullptr};
#if MOE_HAS_AMX_INT8
        if (tiled > 0) {
          // The panel after this one: the call's next, or the caller's next item's first.
          std::byte const* next[2] = {nullptr, nullptr};
          Index next_bytes = w[0].panel_bytes;
          if (p + 1 < p1) {
            next[0] = panels[0] + w[0].panel_bytes;
            next[1] = panels[1] ? panels[1] + w[1].panel_bytes : nullptr;
          } else if (after && after[0].data) {
            next_bytes = after[0].panel_bytes;
            next[0] = after[0].data + after_p * next_bytes;
            next[1] = after[1].data ? after[1].data + after_p * after[1].panel_bytes : nullptr;
          }
          detail::amx_int8_panel<F, Ops>(xs, tiled, K, panels, next, next_bytes,
                                         [&](Index i, float const* row) {
                                           B v[2 * Ops];
                                           for (int j = 0; j < 2 * Ops; ++j)
                                             v[j] = B::load_aligned(row + j * L);
                                           epi.row(c0 + i, p, v);
                                         });
        }
#endif
        Index const rest = mc - tiled;
        if (rest <= 0) continue;
#if MOE_HAS_AVX512VNNI || MOE_HAS_AVX2_INT8
        // The zmm VNNI kernel, or the ymm kernel (AVX2 builds, and AVX-512 builds without VNNI
        // such as Skylake-SP, under zmm epilogues). Both stage MR rows of 32 Ops outputs.
        if constexpr (MOE_HAS_AVX512VNNI ? L == 16 : (L == 8 || L == 16)) {
          ::moe::kernels::detail::for_each_row_tile<quant_max_mr(Ops)>(
              rest, [&]<Index MR>(Index, Index, Index j0) {
                Index const i0 = tiled + j0;
                Q8Row rows[MR];
                for (Index r = 0; r < MR; ++r) rows[r] = row_of(i0 + r);
#if MOE_HAS_AVX512VNNI
                detail::quant_tile_vnni<F, MR, Ops>(rows, K, panels, stage[0]);
#else
                detail::quant_tile_ymm<F, MR, Ops>(rows, K, panels, stage[0]);
#endif
                constexpr int NB = static_cast<int>(Ops * kQuantPanelCols / L);
                for (Index r = 0; r < MR; ++r) {
                  B v[NB];
                  for (int j = 0; j < NB; ++j) v[j] = B::load_aligned(stage[r] + j * L);
                  epi.row(c0 + i0 + r, p, v);
                }
              });
          continue;
        }
#endif
        for (Index i0 = tiled; i0 < mc; i0 += 8) {
          Index const mr = std::min<Index>(8, mc - i0);
          Q8Row rows[8];
          for (Index r = 0; r < mr; ++r) rows[r] = row_of(i0 + r);
          detail::quant_tile_portable<F, Ops>(rows, mr, K, panels, stage);
          for (Index r = 0; r < mr; ++r) {
            constexpr int NB = static_cast<int>(Ops * kQuantPanelCols / L);
            B v[NB];
            for (int j = 0; j < NB; ++j) v[j] = B::load_unaligned(stage[r] + j * L);
            epi.row(c0 + i0 + r, p, v);
          }
        }
      }
#if MOE_HAS_AMX_INT8
      if (tiled > 0) detail::amx_release();
#endif
    };
    // run<F>() for the F of w (a fold over quant::kFormats: no case to add per format).
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (void)((f == quant::kFormats[I] && (run.template operator()<quant::kFormats[I]>(), true)) ||
             ...);
    }
    (std::make_index_sequence<std::size(quant::kFormats)>{});
  }
}

}  // namespace moe::kernels

#include "moe/kernels/detail/diagnostics_pop.hpp"
