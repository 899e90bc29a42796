// Optional window-attention product on Intel AMX (Sapphire Rapids and later): the logits
// X[j][r] = <q_r, k_j> of simd::window_logits_t, in bf16 tiles with float accumulation, each float
// operand split as x = hi + lo (two bf16) and the product taken as hi·hi + hi·lo + lo·hi ("bf16x3").
// Opt-in (AttentionArguments::product = WindowProduct::amx_bf16x3); the default product is float FMA.
//
// Accuracy: hi is x rounded to bf16 (|x − hi| <= 2^-9·|x|) and lo the rest rounded to bf16, so
// x = hi + lo + e with |e| <= 2^-18·|x|; the terms left out (lo·lo and those with e) are below
// 3·2^-18·|q_c·k_c| (plus higher order), and AMX adds the 3d products in float, at most 3d·2^-24 of
// Σ_c |q_c·k_c| in all. A logit is thus within (3·2^-18 + 3d·2^-24) · Σ_c |scale·q_c·k_c| of the exact
// value, which is below 2^-14 · Σ_c |scale·q_c·k_c| for d <= 256: the bound tests/simd/amx_test.cpp
// checks against double (measured: under a tenth of it). Against the float product's error, about ten
// times on the benchmark's layer (1.4e-5 against 1.5e-6 on logits up to 4). AMX treats bf16 denormals as
// zero (an absolute error of order 2^-126 per component); a component beyond ±3.39e38 rounds to ±Inf
// in bf16, which the pipeline reports as an overflow.
//
// Availability: x86-64 Linux with GCC >= 11 (the functions carry their own target attributes, so no
// compile flag is needed; other compilers get the float product), a CPU with AMX-TILE, AMX-BF16 and
// AVX512-BF16, and the kernel's permission for AMX tile data, which amx_bf16_available() requests
// once per process (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), Linux >= 5.16): a
// process-wide side effect, documented in docs/integration.md, taken only when the AMX product is asked for
// and the shape qualifies. Elsewhere amx_bf16_available() is false.
#pragma once

#include "kvcompress/simd/xsimd_compat.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

// GCC only for now: Clang 18-21 need an extra "evex512" target feature for AVX-512 code in target
// attributes, which this has not been built with.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && \
    defined(__has_include)
#if __has_include(<amxtileintrin.h>) && __has_include(<avx512bf16intrin.h>)
#define KVC_DETAIL_AMX 1
#else
#define KVC_DETAIL_AMX 0
#endif
#else
#define KVC_DETAIL_AMX 0
#endif

#if KVC_DETAIL_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#endif

namespace kvc::simd {

using Index = std::ptrdiff_t;

/// The queries of one KV head in the layout of AMX B tiles: per group of 16 queries and chunk of 32
/// head dimensions, 16 rows of (dimension pair) × 32 bf16 (16 queries × the pair), hi and lo parts.
struct AmxQueries {
  /// hi, lo, then the staging scratch of amx_window_logits_t (one block of 16 converted keys; so one
  /// AmxQueries per thread), 64-byte aligned, in one allocation, so their relative placement is fixed
  /// and does not depend on the allocator.
  std::vector<std::uint16_t> storage;
  std::size_t hi_at = 0, lo_at = 0, staging_at = 0;  ///< element offsets into storage
  Index groups = 0;                                  ///< Rp / 16
  Index chunks = 0;                                  ///< d / 32
  const std::uint16_t* hi() const { return storage.data() + hi_at; }
  const std::uint16_t* lo() const { return storage.data() + lo_at; }
  std::uint16_t* staging() { return storage.data() + staging_at; }
};

/// Whether the AMX product can run for head dimension d and Rp padded queries (before availability).
inline bool amx_shape_supported(Index d, Index Rp) { return d > 0 && d % 32 == 0 && Rp > 0 && Rp % 16 == 0; }

#if KVC_DETAIL_AMX

namespace detail {

// One tile configuration for every call: 8 tiles of 16 rows × 64 bytes (16 floats or 32 bf16).
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
  AmxTileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// x (16 floats) -> hi = x rounded to bf16, lo = (x − hi) rounded to bf16. bf16 -> float by the masked
// (zeroing) widen and shift: GCC 12's unmasked forms (_mm512_cvtpbh_ps) use _mm512_undefined_epi32,
// which warns "may be used uninitialized" (GCC bug 105593) in every file that includes this header.
__attribute__((target("avx512f,avx512bf16"))) inline void amx_split16(const float* x, std::uint16_t* hi,
                                                                        std::uint16_t* lo) {
  const __m512 v = _mm512_loadu_ps(x);
  const __m256bh h = _mm512_cvtneps_pbh(v);
  __m256i h_bits;
  std::memcpy(&h_bits, &h, sizeof(h_bits));
  const __m512i h_wide = _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, h_bits), 16);
  const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, _mm512_castsi512_ps(h_wide)));
  std::memcpy(hi, &h, 32);
  std::memcpy(lo, &l, 32);
}

inline bool amx_cpu_and_os_support() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512 = (b >> 16 & 1u) && (b >> 30 & 1u) && (b >> 31 & 1u);  // F, BW, VL
  const bool amx = (d >> 24 & 1u) && (d >> 22 & 1u);                       // AMX-TILE, AMX-BF16
  if (!avx512 || !amx || a < 1) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a >> 5 & 1u)) return false;  // AVX512-BF16
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1u)) return false;          // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const std::uint64_t xcr0 = (std::uint64_t(hi) << 32) | lo;
  const std::uint64_t need = 0xE6u | (std::uint64_t(3) << 17);  // SSE, AVX, AVX-512 and AMX tile state
  return (xcr0 & need) == need;
}

}  // namespace detail

/// True when this process can run the AMX product: CPU and OS support it and the kernel granted the
/// AMX tile-data permission (requested here on the first call, once per process; thread-safe).
inline bool amx_bf16_available() {
  static const bool ok = [] {
    if (!detail::amx_cpu_and_os_support()) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return ::syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

/// Packs the R query rows q (ldq apart; rows R..Rp are zero), each multiplied by `scale` in float, as
/// AMX B tiles. Needs amx_shape_supported(d, Rp).
__attribute__((target("avx512f,avx512bf16"))) inline void amx_pack_queries(const float* q, Index ldq, Index R,
                                                                             Index Rp, Index d, float scale,
                                                                             AmxQueries& out) {
  out.groups = Rp / 16;
  out.chunks = d / 32;
  const std::size_t size = static_cast<std::size_t>(out.groups * out.chunks * 512);
  const std::size_t staging = static_cast<std::size_t>(out.chunks * 2 * 512);
  out.storage.assign(staging + 2 * size + 32, 0);
  const std::size_t align = (64 - reinterpret_cast<std::uintptr_t>(out.storage.data()) % 64) % 64 / 2;
  out.hi_at = align;
  out.lo_at = align + size;
  out.staging_at = out.lo_at + size;
  alignas(64) float row[32];
  alignas(64) std::uint16_t h[32], l[32];
  for (Index r = 0; r < R; ++r)
    for (Index c = 0; c < out.chunks; ++c) {
      for (Index k = 0; k < 32; ++k) row[k] = q[r * ldq + c * 32 + k] * scale;
      detail::amx_split16(row, h, l);
      detail::amx_split16(row + 16, h + 16, l + 16);
      // Tile (group r/16, chunk c): row p holds dimensions 2p, 2p+1 of the 16 queries, interleaved.
      const std::size_t tile = static_cast<std::size_t>(((r / 16) * out.chunks + c) * 512);
      for (Index k = 0; k < 32; ++k) {
        const std::size_t at = tile + static_cast<std::size_t>((k / 2) * 32 + 2 * (r % 16) + k % 2);
        out.storage[out.hi_at + at] = h[k];
        out.storage[out.lo_at + at] = l[k];
      }
    }
}

/// x[j·ldx + r] = the bf16x3 product <q_r, k_j> for `count` key rows (keys + j·ldk, float, d = 32·chunks)
/// and every padded query r < Rp = 16·groups of `q`: what window_logits_t computes, to the accuracy in
/// this file's header. At each block of 16 keys the block two ahead is requested (to L2); rows up to
/// `prefetch_end` (count ≤ prefetch_end, relative to `keys`) may be requested.
/// Needs amx_bf16_available() (the caller checks) and q from amx_pack_queries (its staging is scratch).
__attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16"))) inline void amx_window_logits_t(
    const float* keys, Index ldk, Index count, AmxQueries& q, float* x, Index ldx, Index prefetch_end) {
  const Index chunks = q.chunks, groups = q.groups, d = 32 * chunks;
  const detail::AmxTileConfig config;
  // GCC's tile intrinsics are asm statements that do not tell the compiler they read memory (tile
  // loads, the configuration): these barriers keep the preceding writes before them.
  __asm__ volatile("" ::: "memory");
  _tile_loadconfig(&config);
  // The converted keys of one block of 16: per chunk an A tile (16 keys × 32 bf16), hi and lo.
  std::uint16_t* const staging = q.staging();
  alignas(64) float tail[16 * 16];
  for (Index j0 = 0; j0 < count; j0 += 16) {
    const Index live = std::min<Index>(16, count - j0);
    for (Index i = 0; i < 16; ++i) {
      const Index ahead = j0 + 32 + i;
      if (ahead < prefetch_end)
        for (Index c = 0; c < d; c += 16) prefetch_l2(keys + ahead * ldk + c);
    }
    for (Index i = 0; i < 16; ++i)
      for (Index c = 0; c < chunks; ++c) {
        std::uint16_t* hi = staging + (2 * c) * 512 + i * 32;
        std::uint16_t* lo = staging + (2 * c + 1) * 512 + i * 32;
        if (i < live) {
          const float* k = keys + (j0 + i) * ldk + c * 32;
          detail::amx_split16(k, hi, lo);
          detail::amx_split16(k + 16, hi + 16, lo + 16);
        } else {
          std::memset(hi, 0, 64);
          std::memset(lo, 0, 64);
        }
      }
    __asm__ volatile("" ::: "memory");  // the staging writes above precede the tile loads below
    // Two groups of 16 queries at a time: tiles 0, 1 accumulate, 2, 3 hold the keys' hi and lo,
    // 4, 5 the first group's hi and lo, 6, 7 the second's.
    for (Index g = 0; g < groups; g += 2) {
      const bool pair = g + 1 < groups;
      _tile_zero(0);
      _tile_zero(1);
      for (Index c = 0; c < chunks; ++c) {
        const std::uint16_t* qh0 = q.hi() + (g * chunks + c) * 512;
        const std::uint16_t* ql0 = q.lo() + (g * chunks + c) * 512;
        _tile_loadd(2, staging + (2 * c) * 512, 64);
        _tile_loadd(3, staging + (2 * c + 1) * 512, 64);
        _tile_loadd(4, qh0, 64);
        _tile_loadd(5, ql0, 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(0, 2, 5);
        _tile_dpbf16ps(0, 3, 4);
        if (pair) {
          _tile_loadd(6, qh0 + chunks * 512, 64);
          _tile_loadd(7, ql0 + chunks * 512, 64);
          _tile_dpbf16ps(1, 2, 6);
          _tile_dpbf16ps(1, 2, 7);
          _tile_dpbf16ps(1, 3, 6);
        }
      }
      for (int t = 0; t < (pair ? 2 : 1); ++t) {
        float* out = x + j0 * ldx + (g + t) * 16;
        if (live == 16) {
          if (t == 0) _tile_stored(0, out, ldx * static_cast<Index>(sizeof(float)));
          else _tile_stored(1, out, ldx * static_cast<Index>(sizeof(float)));
        } else {
          if (t == 0) _tile_stored(0, tail, 64);
          else _tile_stored(1, tail, 64);
          for (Index i = 0; i < live; ++i) std::memcpy(out + i * ldx, tail + i * 16, 64);
        }
      }
    }
  }
  _tile_release();
}

#else  // no AMX with this platform or compiler: never available, so the functions below are never called

inline bool amx_bf16_available() { return false; }
inline void amx_pack_queries(const float*, Index, Index, Index, Index, float, AmxQueries&) {}
inline void amx_window_logits_t(const float*, Index, Index, AmxQueries&, float*, Index, Index) {}

#endif

}  // namespace kvc::simd
