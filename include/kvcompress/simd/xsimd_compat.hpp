// xsimd 8.1 compatibility shim: the architecture kvcompress compiles its kernels for, horizontal sums,
// and loads that convert float / Eigen::half / Eigen::bfloat16 to a float batch on the fly.
//
// xsimd 8.1 (Debian 12) lacks `reduce_add` (its `hadd` is the horizontal sum), and the free
// `xsimd::load_unaligned<Arch>(ptr)` compiles only for the default architecture; the member
// `batch<T, Arch>::load_unaligned` works for every architecture, so kernels use that.
//
// The architecture is chosen once, here: `kvc::simd::default_arch` is what the compiler was told
// (`-march=native` in this project's own targets; consumers get whatever flags they build with).
// Every kernel in simd/ is a template over the architecture tag, so a test can also instantiate a
// narrower one (e.g. xsimd::sse2) in the same binary.
#pragma once

#include <Eigen/Core>
#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <immintrin.h>
#endif

namespace kvc::simd {

/// The architecture the library's kernels run on (chosen at compile time from the compiler flags).
using default_arch = xsimd::default_arch;

/// The float batch of architecture A.
template <class A>
using fbatch = xsimd::batch<float, A>;

/// Software prefetch: asks for the 64-byte line holding `p` in L1 (prefetch: x86 prefetcht0) or in L2
/// (prefetch_l2: prefetcht1). Hints only, results never depend on them; `p` must point into a live
/// object. On x86 with GCC or Clang they are `asm volatile`, not __builtin_prefetch: GCC 12 (-O2,
/// -O3) may delete a loop whose body is only __builtin_prefetch calls (a loop without side effects),
/// silently, depending on how the surrounding code is inlined and unrolled. The asm reads one byte at
/// `p` as far as the compiler knows, so a pending store the compiler cannot prove unrelated is done
/// before it: keep them out of loops whose results live in memory. MSVC: _mm_prefetch on x86; elsewhere __builtin_prefetch (whose loops may still vanish).
#if (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__x86_64__) || (defined(__i386__) && defined(__SSE__)))
#define KVC_DETAIL_PREFETCH_ASM 1
#else
#define KVC_DETAIL_PREFETCH_ASM 0
#endif

inline void prefetch(const void* p) {
#if KVC_DETAIL_PREFETCH_ASM
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

inline void prefetch_l2(const void* p) {
#if KVC_DETAIL_PREFETCH_ASM
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#else
  (void)p;
#endif
}

/// Makes the compiler materialise `b` in a register here (an empty asm with the register as in/out
/// operand; x86 with AVX, elsewhere a no-op). A batch loaded once and used several times is then not
/// re-read from memory at every use (GCC otherwise folds the load into each FMA, tripling the loads of
/// the decode micro-kernels), and a product is rounded here: the compiler cannot fuse it into the adds
/// that use it, which it does when it contracts floating-point expressions (GCC at -O2), so the
/// result is the same with and without contraction.
template <class A>
inline void pin_register(fbatch<A>& b) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && defined(__AVX__)
  typename fbatch<A>::register_type r = b;
  __asm__("" : "+x"(r));
  b = r;
#else
  (void)b;
#endif
}

/// x·y + z with one rounding, on every build. xsimd 8.1 has no AVX-512 multiply-add: there its
/// xsimd::fma is the generic x * y + z, which the compiler fuses only when it contracts floating-point
/// expressions. GCC 12 does at -O2 (kvc_bench, the demo), not at -O1 (this project's tests) nor -O0,
/// nor with -ffp-contract=off, which numerical codes set for reproducibility: there every
/// multiply-add of the AVX-512 kernels would be two instructions and two roundings, and results would
/// differ with the optimisation level. Elsewhere xsimd's own (fused where the architecture has FMA:
/// fma3<...>, NEON). Call it qualified (simd::fma): unqualified, argument-dependent lookup also finds
/// xsimd::fma.
template <class A>
inline fbatch<A> fma(const fbatch<A>& x, const fbatch<A>& y, const fbatch<A>& z) {
#if defined(__AVX512F__)
  if constexpr (fbatch<A>::size == 16) return fbatch<A>(_mm512_fmadd_ps(x, y, z));
#endif
  return xsimd::fma(x, y, z);
}

/// z − x·y with one rounding (see simd::fma).
template <class A>
inline fbatch<A> fnma(const fbatch<A>& x, const fbatch<A>& y, const fbatch<A>& z) {
#if defined(__AVX512F__)
  if constexpr (fbatch<A>::size == 16) return fbatch<A>(_mm512_fnmadd_ps(x, y, z));
#endif
  return xsimd::fnma(x, y, z);
}

/// Horizontal sum (xsimd 8.1 has no `reduce_add`).
template <class A>
inline float reduce_add(const fbatch<A>& b) {
  return xsimd::hadd(b);
}

/// Transposing horizontal sum of fbatch<A>::size batches: lane r of the result is the sum of the
/// lanes of rows[r]. Every row's lanes are added in the same pattern whatever its position, so equal
/// rows give bit-equal sums.
///
/// xsimd 8.1's AVX-512 float `haddp` returns the rows permuted (lane r holds the sum of row
/// 0 1 4 5 2 3 6 7 8 9 12 13 10 11 14 15 for r = 0..15; found by running the tests on an AVX-512
/// machine), so 16-lane batches use this reduction tree instead: halves, then 128-bit blocks, then
/// pairs, then lanes; it leaves lane 4k + e holding input slot k + 4e, so the rows go in transposed.
/// Other architectures use xsimd::haddp.
template <class A>
inline fbatch<A> haddp(const fbatch<A>* rows) {
#if defined(__AVX512F__)
  if constexpr (fbatch<A>::size == 16) {
    // (z, y, x, w) selectors of _mm512_shuffle_f32x4 (128-bit blocks) and _mm512_shuffle_ps (lanes).
    constexpr int lo = (1 << 6) | (0 << 4) | (1 << 2) | 0, hi = (3 << 6) | (2 << 4) | (3 << 2) | 2;
    constexpr int even = (2 << 6) | (0 << 4) | (2 << 2) | 0, odd = (3 << 6) | (1 << 4) | (3 << 2) | 1;
    __m512 u[8];  // u[i]: 8 partial sums (lane p + lane p+8) of slots 2i (blocks 0,1) and 2i+1 (blocks 2,3)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m512 a = rows[4 * ((2 * i) % 4) + (2 * i) / 4], b = rows[4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4];
      u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, lo), _mm512_shuffle_f32x4(a, b, hi));
    }
    __m512 w[4];  // w[i]: block k holds 4 partial sums of slot 4i + k
#pragma GCC unroll 8
    for (int i = 0; i < 4; ++i)
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], even),
                           _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], odd));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], even), _mm512_shuffle_ps(w[0], w[1], odd));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], even), _mm512_shuffle_ps(w[2], w[3], odd));
    return fbatch<A>(_mm512_add_ps(_mm512_shuffle_ps(x, y, even), _mm512_shuffle_ps(x, y, odd)));
  }
#endif
  return xsimd::haddp(rows);
}

/// Horizontal maximum.
template <class A>
inline float reduce_max(const fbatch<A>& b) {
  alignas(64) float lanes[fbatch<A>::size];
  b.store_aligned(lanes);
  float m = lanes[0];
  for (std::size_t i = 1; i < fbatch<A>::size; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

namespace detail {
template <class A, class T>
inline fbatch<A> load_generic(const T* p) {
  alignas(64) float lanes[fbatch<A>::size];
  for (std::size_t i = 0; i < fbatch<A>::size; ++i) lanes[i] = static_cast<float>(p[i]);
  return fbatch<A>::load_aligned(lanes);
}
}  // namespace detail

/// fbatch<A>::size consecutive elements at `p` (no alignment needed), converted to float.
template <class A>
inline fbatch<A> load(const float* p) {
  return fbatch<A>::load_unaligned(p);
}

template <class A>
inline fbatch<A> load(const Eigen::half* p) {
#if defined(__AVX512F__)
  if constexpr (fbatch<A>::size == 16)
    return fbatch<A>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#endif
#if defined(__F16C__)
  if constexpr (fbatch<A>::size == 8)
    return fbatch<A>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  return detail::load_generic<A>(p);
}

template <class A>
inline fbatch<A> load(const Eigen::bfloat16* p) {
  // bfloat16 is the high half of a float: widen to 32 bits and shift into place.
#if defined(__AVX512F__)
  if constexpr (fbatch<A>::size == 16)
    return fbatch<A>(_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
#endif
#if defined(__AVX2__)
  if constexpr (fbatch<A>::size == 8)
    return fbatch<A>(_mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#endif
  return detail::load_generic<A>(p);
}

/// Scalar conversion of one element (tails of the kernels).
template <class T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

}  // namespace kvc::simd
