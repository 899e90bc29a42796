// Register-blocked micro-kernels of the float decode-attention kernel (attention/decode_attention.hpp),
// templated over the xsimd architecture tag A like simd/kernels.hpp. Keys and values may be float,
// Eigen::half or Eigen::bfloat16 (converted inside the loads by simd::load<A>, never copied).
//
// * dots_block: the raw dot products of up to 4 query rows with up to 2 key rows (8 vertical FMA
//   accumulators; each key chunk is loaded once for the 4 queries; the 2 rows are read one after the
//   other), finished by ONE transposing reduction of the 8 accumulators (transpose_sums8) instead of
//   one horizontal sum per (key, query).
// * axpy_block: o_h += Σ_j w_h,j · v_j over a block of value rows for up to 4 output rows and 2 batches
//   of columns, the 8 accumulators kept in registers across the rows (o is loaded and stored once per
//   block instead of once per row).
// * Both can issue software prefetches (simd::prefetch) for rows they will read later, in an order
//   that keeps the memory stream sequential; pin_register keeps GCC from re-loading a batch at every
//   use.
// * The loops over a register block carry `#pragma GCC unroll`: GCC unrolls them fully by itself only
//   at -O3, and at -O2 (RelWithDebInfo, common in engines) the accumulator arrays otherwise live on the
//   stack and decode runs much slower.
//
// Every kernel has a fixed summation order for a given A, d and block shape: results are deterministic.
#pragma once

#include "kvcompress/simd/kernels.hpp"

#include <cstddef>
#include <type_traits>

namespace kvc::simd {

/// out[j] = Σ_lanes acc[j] for j < 8. On an 8-lane x86 architecture a transposing hadd tree (6 hadd,
/// 2 lane permutes, 1 add, one store) instead of 8 separate horizontal sums; elsewhere reduce_add.
template <class A>
inline void transpose_sums8(const fbatch<A>* acc, float* out) {
#if defined(__AVX__)
  if constexpr (fbatch<A>::size == 8) {
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]);  // [x0 01, x0 23, x1 01, x1 23 | x0 45, x0 67, ...]
    const __m256 h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]);
    const __m256 h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0 = _mm256_hadd_ps(h01, h23);  // [x0..x3 lanes 0-3 | x0..x3 lanes 4-7]
    const __m256 s1 = _mm256_hadd_ps(h45, h67);  // [x4..x7 lanes 0-3 | x4..x7 lanes 4-7]
    const __m256 lo = _mm256_permute2f128_ps(s0, s1, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(s0, s1, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
    return;
  }
#endif
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) out[j] = reduce_add<A>(acc[j]);
}

/// out[j·4 + h] = <q_h, k_j> for h < NH <= 4 query rows q_h = q + h·q_stride (float) and j < NK <= 2 key
/// rows k[j] of type T, length d (any d; the d % size tail is added in scalar after the reduction).
/// Slots of absent heads / keys receive 0. Writes 8 floats. The key rows are read one after the other,
/// front to back (each chunk loaded once for the NH queries): a purely sequential access pattern, which
/// the hardware prefetchers follow far better than two rows interleaved. With prefetch_offset != 0, the
/// elements prefetch_offset further on from each key row are prefetched as the row is read (one hint
/// per 64 bytes); they must lie inside the caller's buffer.
template <class A, int NK, int NH, class T>
inline void dots_block(const float* q, Index q_stride, const T* const* k, Index d, float* out,
                       Index prefetch_offset = 0) {
  static_assert(NK >= 1 && NK <= 2 && NH >= 1 && NH <= 4, "dots_block: NK <= 2, NH <= 4");
  using B = fbatch<A>;
  constexpr Index S = B::size;
  constexpr Index per_line = 64 / static_cast<Index>(sizeof(T));  // elements per 64-byte line
  B acc[8];
#pragma GCC unroll 8
  for (int x = 0; x < 8; ++x) acc[x] = B(0.0f);
  const Index dv = d - d % S;
  // One row: acc[base + h] += q_h · k_row (base is a compile-time constant, so acc stays in registers).
  auto row = [&](auto base, const T* kj) {
    for (Index c = 0; c < dv; c += S) {
      if (prefetch_offset != 0 && c % per_line == 0) prefetch(kj + prefetch_offset + c);
      B kv = load<A>(kj + c);
      pin_register<A>(kv);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        B& a = acc[decltype(base)::value + h];
        a = simd::fma(B::load_unaligned(q + h * q_stride + c), kv, a);
      }
    }
  };
  row(std::integral_constant<int, 0>{}, k[0]);
  if constexpr (NK == 2) row(std::integral_constant<int, 4>{}, k[1]);
  transpose_sums8<A>(acc, out);
  for (Index c = dv; c < d; ++c)
    for (int j = 0; j < NK; ++j) {
      const float kc = to_float(k[j][c]);
      for (int h = 0; h < NH; ++h) out[j * 4 + h] += q[h * q_stride + c] * kc;
    }
}

/// o_h[c0 + n·S + l] += Σ_{j < rows} w[h·w_stride + j] · v_j[c0 + n·S + l] for h < NH <= 4 output rows
/// o_h = o + h·o_stride, n < NC <= 2 full batches starting at column c0, value rows v_j = v + j·v_stride
/// of type T. Rows are accumulated in order j = 0, 1, ... into registers (o loaded and stored once).
/// A caller sweeping the columns of a block of rows (strided reads) can hand over a region to prefetch
/// in linear order, `prefetch_lines` 64-byte lines per row read: lines (prefetch_step + j)·prefetch_lines
/// + [0, prefetch_lines) of the prefetch_bytes at prefetch_base (null: none; the region must lie inside
/// the caller's buffer). Prefetching the next block front to back this way keeps the memory stream
/// sequential even though the reads are strided.
template <class A, int NH, int NC, class T>
inline void axpy_block(const float* w, Index w_stride, const T* v, Index v_stride, Index rows, Index c0, float* o,
                       Index o_stride, const char* prefetch_base = nullptr, Index prefetch_bytes = 0,
                       Index prefetch_step = 0, Index prefetch_lines = 1) {
  static_assert(NH >= 1 && NH <= 4 && NC >= 1 && NC <= 2, "axpy_block: NH <= 4, NC <= 2");
  using B = fbatch<A>;
  constexpr Index S = B::size;
  B acc[NH][NC];
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 2
    for (int n = 0; n < NC; ++n) acc[h][n] = B::load_unaligned(o + h * o_stride + c0 + n * S);
  for (Index j = 0; j < rows; ++j) {
    const T* vj = v + j * v_stride + c0;
    if (prefetch_base != nullptr)
      for (Index l = 0; l < prefetch_lines; ++l) {
        const Index offset = ((prefetch_step + j) * prefetch_lines + l) * 64;
        if (offset < prefetch_bytes) prefetch(prefetch_base + offset);
      }
    B vv[NC];
#pragma GCC unroll 2
    for (int n = 0; n < NC; ++n) {
      vv[n] = load<A>(vj + n * S);
      pin_register<A>(vv[n]);
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const B wb(w[h * w_stride + j]);
#pragma GCC unroll 2
      for (int n = 0; n < NC; ++n) acc[h][n] = simd::fma(wb, vv[n], acc[h][n]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 2
    for (int n = 0; n < NC; ++n) acc[h][n].store_unaligned(o + h * o_stride + c0 + n * S);
}

}  // namespace kvc::simd
