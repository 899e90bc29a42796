// SIMD kernels on xsimd 8.1, templated over the architecture tag A (see simd/xsimd_compat.hpp): dot
// products, norms, cosine, axpy, the exponential, the causal softmax-row epilogue of window attention,
// and the multi-row dot / axpy used by decode attention. Arithmetic in float; the `T` inputs may be
// float, Eigen::half or Eigen::bfloat16 and are converted inside the loads (never copied).
//
// Every kernel has a fixed summation order for a given A and length, so results are deterministic
// (bit-identical from run to run and across thread counts). They differ from a serial scalar loop only
// by float rounding (tests/simd/ checks them against double loops over awkward sizes).
#pragma once

#include "kvcompress/simd/xsimd_compat.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc::simd {

using Index = std::ptrdiff_t;

/// e^x for x in [-88, 88] (below -88 the result is 0). Cephes-style: x = n·ln2 + r, |r| <= ln2/2,
/// degree-6 polynomial, 2^n put into the exponent bits. Relative error <= 2 ulp-ish (tested against
/// std::exp in double). About 12 instructions per batch, no special-value branches.
template <class A>
inline fbatch<A> exp(const fbatch<A>& x_in) {
  using B = fbatch<A>;
  using IB = xsimd::batch<std::int32_t, A>;
  const B x = xsimd::min(xsimd::max(x_in, B(-88.0f)), B(88.0f));
  const B fx = xsimd::nearbyint(x * B(1.44269504088896341f));
  B r = simd::fnma(fx, B(0.693359375f), x);
  r = simd::fnma(fx, B(-2.12194440e-4f), r);
  B p = B(1.9875691500e-4f);
  p = simd::fma(p, r, B(1.3981999507e-3f));
  p = simd::fma(p, r, B(8.3334519073e-3f));
  p = simd::fma(p, r, B(4.1665795894e-2f));
  p = simd::fma(p, r, B(1.6666665459e-1f));
  p = simd::fma(p, r, B(5.0000001201e-1f));
  const B y = B(1.0f) + simd::fma(p, r * r, r);  // one rounding of the small part, then 1 + (.)
  const IB n = xsimd::to_int(fx);
  const B pow2n = xsimd::bitwise_cast<B>((n + IB(127)) << 23);
  return y * pow2n;
}

/// 2^y for y <= 127 (clamped there): y = n + r with n = floor(y) and r = y - n exact (0 <= r < 1), 2^r
/// by a degree-6 polynomial (coefficients fitted for relative error on [0, 1]; 1.04·2^-24 in float
/// arithmetic, and the test bounds the whole function by 1.5·2^-24), times 2^n; exactly 0 for y < -126
/// (so never a denormal) and for -inf; NaN gives 0 on x86 (where max(NaN, c) is c) and on AVX-512, NaN
/// on ARM (the library reports NaN logits through its finite checks before using any result).
/// Cheaper than simd::exp (no two-step ln 2 reduction, one polynomial term less), so the softmax
/// kernels take e^x as 2^(x·log2 e): on AVX-512, where the reduction is one vreduceps and 2^n is
/// applied by vscalefps (which takes floor(y) itself), cheaper than rounding y to nearest.
/// vscalefps gives the same correctly rounded product as the multiply by the power of two elsewhere, so architectures with a fused
/// multiply-add return the same bits (tested against a scalar mirror).
template <class A>
inline fbatch<A> exp2(const fbatch<A>& y_in) {
  using B = fbatch<A>;
  const auto poly = [](const B& r) {
    B p = B(2.1702255685e-4f);
    p = simd::fma(p, r, B(1.2439687760e-3f));
    p = simd::fma(p, r, B(9.6788410037e-3f));
    p = simd::fma(p, r, B(5.5483341981e-2f));
    p = simd::fma(p, r, B(2.4022983627e-1f));
    p = simd::fma(p, r, B(6.9314698384e-1f));
    return simd::fma(p, r, B(1.0f));
  };
#if defined(__AVX512F__)
  if constexpr (B::size == 16) {
    const __mmask16 keep = _mm512_cmp_ps_mask(y_in, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);  // NaN: false
    const B y = xsimd::min(y_in, B(127.0f));
#if defined(__AVX512DQ__)
    const B r(_mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));  // y - floor(y)
#else
    const B r = y - xsimd::floor(y);
#endif
    return B(_mm512_maskz_scalef_ps(keep, poly(r), y));
  }
#endif
  using IB = xsimd::batch<std::int32_t, A>;
  const B y = xsimd::min(xsimd::max(y_in, B(-127.0f)), B(127.0f));  // NaN: -127 (x86 max), so 0
  const B n = xsimd::floor(y);
  return poly(y - n) * xsimd::bitwise_cast<B>((xsimd::to_int(n) + IB(127)) << 23);  // n = -127: 0
}

/// e^x as 2^(x·log2 e) through simd::exp2 (the softmax kernels' exponential). 0 below about -87.3
/// (x·log2 e < -126), where simd::exp gives 0 below about -87.7.
template <class A>
inline fbatch<A> exp_via2(const fbatch<A>& x) {
  return simd::exp2<A>(x * fbatch<A>(1.44269504088896341f));
}

/// Scalar e^x for the tails of vector loops: 0 where x·log2 e < -126 (about x < -87.3), as
/// simd::exp_via2, the vector part of exp_shift_sum, so that an element's value does not depend on
/// whether it falls in a vector or in the tail; saturates at e^88.
inline float exp_scalar(float x) {
  return x * 1.44269504088896341f < -126.0f ? 0.0f : std::exp(std::min(x, 88.0f));
}

/// <x, y> with x float and y of element type T. d >= 0.
template <class A, class T>
inline float dot(const float* x, const T* y, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  B acc0(0.0f), acc1(0.0f);
  Index k = 0;
  for (; k + 2 * S <= d; k += 2 * S) {
    acc0 = simd::fma(B::load_unaligned(x + k), load<A>(y + k), acc0);
    acc1 = simd::fma(B::load_unaligned(x + k + S), load<A>(y + k + S), acc1);
  }
  if (k + S <= d) {
    acc0 = simd::fma(B::load_unaligned(x + k), load<A>(y + k), acc0);
    k += S;
  }
  float s = reduce_add<A>(acc0 + acc1);
  for (; k < d; ++k) s += x[k] * to_float(y[k]);
  return s;
}

/// How many rows ahead row_dots requests its rows.
inline constexpr Index kRowDotsAhead = 8;

/// out[j] = <w, x_j> for `rows` float rows x_j = x + j·ldx of `cols` elements (the attention-mass
/// pass: one weighted sum per key over its row of the window workspace). Rows go in blocks of
/// fbatch<A>::size: per row two accumulators over whole batches (even and odd batches, as simd::dot),
/// added, then simd::haddp reduces the block's accumulators into one batch and the serial tail follows.
/// A short last block repeats its last row, so every row gets the same arithmetic whatever its
/// position; no horizontal sum per row. Rows are requested kRowDotsAhead rows ahead (the buffer is
/// usually larger than L2). rows, cols >= 0; out must not overlap x or w.
template <class A>
inline void row_dots(const float* x, Index ldx, Index rows, const float* w, Index cols, float* out) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const Index body = cols - cols % S;
  for (Index r0 = 0; r0 < rows; r0 += S) {
    B acc[S];
#pragma GCC unroll 16
    for (Index k = 0; k < S; ++k) {
      const float* xr = x + std::min(r0 + k, rows - 1) * ldx;
      if (r0 + k + kRowDotsAhead < rows)
        for (Index c = 0; c < cols; c += Index(64 / sizeof(float))) prefetch(xr + kRowDotsAhead * ldx + c);
      B a0(0.0f), a1(0.0f);
      Index c = 0;
      for (; c + 2 * S <= body; c += 2 * S) {
        a0 = simd::fma(B::load_unaligned(w + c), B::load_unaligned(xr + c), a0);
        a1 = simd::fma(B::load_unaligned(w + c + S), B::load_unaligned(xr + c + S), a1);
      }
      if (c < body) a0 = simd::fma(B::load_unaligned(w + c), B::load_unaligned(xr + c), a0);
      acc[k] = a0 + a1;
    }
    alignas(64) float sums[S];
    simd::haddp<A>(acc).store_aligned(sums);
    const Index live = std::min(S, rows - r0);
    for (Index k = 0; k < live; ++k) {
      const float* xr = x + (r0 + k) * ldx;
      float s = sums[k];
      for (Index c = body; c < cols; ++c) s += w[c] * xr[c];
      out[r0 + k] = s;
    }
  }
}

/// Σ x_k² of one row of element type T.
template <class A, class T>
inline float sum_squares(const T* x, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  B acc0(0.0f), acc1(0.0f);
  Index k = 0;
  for (; k + 2 * S <= d; k += 2 * S) {
    const B a = load<A>(x + k), b = load<A>(x + k + S);
    acc0 = simd::fma(a, a, acc0);
    acc1 = simd::fma(b, b, acc1);
  }
  if (k + S <= d) {
    const B a = load<A>(x + k);
    acc0 = simd::fma(a, a, acc0);
    k += S;
  }
  float s = reduce_add<A>(acc0 + acc1);
  for (; k < d; ++k) {
    const float v = to_float(x[k]);
    s += v * v;
  }
  return s;
}

/// ‖x‖₂ of one row of element type T.
template <class A, class T>
inline float norm(const T* x, Index d) {
  return std::sqrt(sum_squares<A>(x, d));
}

/// cos(x, y), 0 when either vector has zero norm (SPEC §7).
template <class A, class T>
inline float cosine(const T* x, const T* y, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  B xy(0.0f), xx(0.0f), yy(0.0f);
  Index k = 0;
  for (; k + S <= d; k += S) {
    const B a = load<A>(x + k), b = load<A>(y + k);
    xy = simd::fma(a, b, xy);
    xx = simd::fma(a, a, xx);
    yy = simd::fma(b, b, yy);
  }
  float sxy = reduce_add<A>(xy), sxx = reduce_add<A>(xx), syy = reduce_add<A>(yy);
  for (; k < d; ++k) {
    const float a = to_float(x[k]), b = to_float(y[k]);
    sxy += a * b;
    sxx += a * a;
    syy += b * b;
  }
  if (sxx <= 0.0f || syy <= 0.0f) return 0.0f;
  return sxy / (std::sqrt(sxx) * std::sqrt(syy));
}

/// y (d) += w · x (d), x of element type T.
template <class A, class T>
inline void axpy(float w, const T* x, float* y, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const B wb(w);
  Index k = 0;
  for (; k + S <= d; k += S) simd::fma(wb, load<A>(x + k), B::load_unaligned(y + k)).store_unaligned(y + k);
  for (; k < d; ++k) y[k] = std::fma(w, to_float(x[k]), y[k]);  // fused like the batches, in every build
}

/// y (d) = w·x for a row x of element type T (converted); y is only written.
template <class A, class T>
inline void scale_into(const T* x, float w, float* y, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const B wb(w);
  Index k = 0;
  for (; k + S <= d; k += S) (load<A>(x + k) * wb).store_unaligned(y + k);
  for (; k < d; ++k) y[k] = to_float(x[k]) * w;
}

/// y (d) *= w.
template <class A>
inline void scale(float* y, float w, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const B wb(w);
  Index k = 0;
  for (; k + S <= d; k += S) (B::load_unaligned(y + k) * wb).store_unaligned(y + k);
  for (; k < d; ++k) y[k] *= w;
}

/// y (d) /= z (a true division, as the reference's p = e / sum).
template <class A>
inline void divide(float* y, float z, Index d) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const B zb(z);
  Index k = 0;
  for (; k + S <= d; k += S) (B::load_unaligned(y + k) / zb).store_unaligned(y + k);
  for (; k < d; ++k) y[k] /= z;
}

/// max_k x_k (len >= 1).
template <class A>
inline float max(const float* x, Index len) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  float m = -std::numeric_limits<float>::infinity();
  Index k = 0;
  if (len >= S) {
    B mb = B::load_unaligned(x);
    for (k = S; k + S <= len; k += S) mb = xsimd::max(mb, B::load_unaligned(x + k));
    m = reduce_max<A>(mb);
  }
  for (; k < len; ++k) m = std::max(m, x[k]);
  return m;
}

/// In place x_k <- c·tanh(x_k / c) (the logit soft-cap).
template <class A>
inline void softcap(float* x, Index len, float c) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const B cb(c), inv(1.0f / c);
  Index k = 0;
  for (; k + S <= len; k += S) (cb * xsimd::tanh(B::load_unaligned(x + k) * inv)).store_unaligned(x + k);
  for (; k < len; ++k) x[k] = c * std::tanh(x[k] / c);
}

/// In place x_k <- e^(x_k − shift); returns Σ_k of the new values (the softmax denominator part).
template <class A>
inline float exp_shift_sum(float* x, Index len, float shift) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  const B sb(shift);
  B acc0(0.0f), acc1(0.0f);
  Index k = 0;
  for (; k + 2 * S <= len; k += 2 * S) {
    const B e0 = simd::exp_via2<A>(B::load_unaligned(x + k) - sb);
    const B e1 = simd::exp_via2<A>(B::load_unaligned(x + k + S) - sb);
    e0.store_unaligned(x + k);
    e1.store_unaligned(x + k + S);
    acc0 += e0;
    acc1 += e1;
  }
  if (k + S <= len) {
    const B e0 = simd::exp_via2<A>(B::load_unaligned(x + k) - sb);
    e0.store_unaligned(x + k);
    acc0 += e0;
    k += S;
  }
  float s = reduce_add<A>(acc0 + acc1);
  for (; k < len; ++k) {
    x[k] = exp_scalar(x[k] - shift);
    s += x[k];
  }
  return s;
}

/// One tile of a causal online softmax (the epilogue of window attention). For each of `rows` rows of
/// `tile` (row stride `ld`), only the first `live[r]` columns (clamped to [0, cols]) are visible; the
/// rest are set to 0. Visible logits become e^(x − M_r) where M_r is the running row maximum after this
/// tile, `row_max` / `row_sum` are updated online (the old sum rescaled by e^(M_old − M_new)), and
/// `tile_shift[r]` receives the M_r used for this tile (so a later pass can rescale it by
/// e^(tile_shift − M_final) / Z). Rows with nothing visible in this tile keep the shift of the
/// running max (their entries are all 0 anyway). Optional soft-cap before the maximum, then the
/// optional per-column bias (`bias_len` leading columns get + bias[j], exactly x + b).
template <class A>
inline void softmax_tile(float* tile, Index ld, Index rows, Index cols, const Index* live, float softcap_c,
                         float* row_max, float* row_sum, float* tile_shift, const float* bias = nullptr,
                         Index bias_len = 0) {
  for (Index r = 0; r < rows; ++r) {
    float* x = tile + r * ld;
    const Index len = std::clamp<Index>(live[r], 0, cols);
    std::fill(x + len, x + cols, 0.0f);
    if (len == 0) {
      tile_shift[r] = row_max[r];
      continue;
    }
    if (softcap_c > 0.0f) simd::softcap<A>(x, len, softcap_c);
    if (bias_len > 0) simd::axpy<A>(1.0f, bias, x, std::min(len, bias_len));  // fma(1, b, x): exactly x + b
    const float mt = simd::max<A>(x, len);
    const float m_old = row_max[r];
    const float m_new = std::max(m_old, mt);
    if (m_new > m_old) row_sum[r] = m_old == -std::numeric_limits<float>::infinity() ? 0.0f
                                                                                      : row_sum[r] * std::exp(m_old - m_new);
    row_sum[r] += exp_shift_sum<A>(x, len, m_new);
    row_max[r] = m_new;
    tile_shift[r] = m_new;
  }
}

/// out[h] = <q_h, k> for `count` query rows q_h = q + h·q_stride (float), one key row k (d) of type T.
/// The key is loaded once for up to 4 queries at a time.
template <class A, class T>
inline void dot_rows(const float* q, Index q_stride, Index count, const T* k, Index d, float* out) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  Index h = 0;
  for (; h + 4 <= count; h += 4) {
    const float* q0 = q + h * q_stride;
    const float* q1 = q0 + q_stride;
    const float* q2 = q1 + q_stride;
    const float* q3 = q2 + q_stride;
    B a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
    Index c = 0;
    for (; c + S <= d; c += S) {
      const B kv = load<A>(k + c);
      a0 = simd::fma(B::load_unaligned(q0 + c), kv, a0);
      a1 = simd::fma(B::load_unaligned(q1 + c), kv, a1);
      a2 = simd::fma(B::load_unaligned(q2 + c), kv, a2);
      a3 = simd::fma(B::load_unaligned(q3 + c), kv, a3);
    }
    float s0 = reduce_add<A>(a0), s1 = reduce_add<A>(a1), s2 = reduce_add<A>(a2), s3 = reduce_add<A>(a3);
    for (; c < d; ++c) {
      const float kc = to_float(k[c]);
      s0 += q0[c] * kc;
      s1 += q1[c] * kc;
      s2 += q2[c] * kc;
      s3 += q3[c] * kc;
    }
    out[h] = s0;
    out[h + 1] = s1;
    out[h + 2] = s2;
    out[h + 3] = s3;
  }
  for (; h < count; ++h) out[h] = dot<A>(q + h * q_stride, k, d);
}

/// y_h (d) += w[h · w_stride] · v (d) for `count` output rows y_h = y + h·y_stride; v of type T is
/// loaded once per chunk for all rows.
template <class A, class T>
inline void axpy_rows(const float* w, Index w_stride, Index count, const T* v, Index d, float* y, Index y_stride) {
  using B = fbatch<A>;
  constexpr Index S = B::size;
  Index c = 0;
  for (; c + S <= d; c += S) {
    const B vv = load<A>(v + c);
    for (Index h = 0; h < count; ++h) {
      float* yh = y + h * y_stride + c;
      simd::fma(B(w[h * w_stride]), vv, B::load_unaligned(yh)).store_unaligned(yh);
    }
  }
  for (; c < d; ++c) {
    const float vc = to_float(v[c]);
    for (Index h = 0; h < count; ++h) y[h * y_stride + c] += w[h * w_stride] * vc;
  }
}

}  // namespace kvc::simd
