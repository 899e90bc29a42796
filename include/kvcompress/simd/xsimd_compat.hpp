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

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvc::simd {

/// The architecture the library's kernels run on (chosen at compile time from the compiler flags).
using default_arch = xsimd::default_arch;

/// The float batch of architecture A.
template <class A>
using fbatch = xsimd::batch<float, A>;

/// Horizontal sum (xsimd 8.1 has no `reduce_add`).
template <class A>
inline float reduce_add(const fbatch<A>& b) {
  return xsimd::hadd(b);
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
