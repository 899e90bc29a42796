// Decode attention with the compensation bias (SPEC §8): one decode step of Hq query heads over a
// (compressed) layer plus any appended tokens. Float arithmetic runs a single-pass SIMD kernel (the G
// query heads of a KV head together, so K and V are each read once);
// double arithmetic runs the plain reference loops.
//
// How an engine consumes the bias without this kernel: most engines already add a mask to the
// logits before the softmax (0 for visible, −inf for hidden). Store the bias of compressed entry i
// of KV head g in that additive mask, at column i, for every query head h with h / G == g; tokens
// appended after compression get 0. The logit of entry i is then softcap(scale·<q,k_i>) + bias_i.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kvc {

/// Additive logit bias `[heads][length]` with a head stride; entries at or beyond `length` are 0.
template <class Real>
struct BiasView {
  const Real* data = nullptr;
  Index heads = 0;
  Index length = 0;
  Index head_stride = 0;
  Real at(Index g, Index i) const { return (data && i < length) ? data[g * head_stride + i] : Real(0); }
};

namespace detail {

/// The plain loops (double reference runs): per query head, logits, softmax, weighted sum of values.
template <class T>
void decode_attention_reference(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                                const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                                const AttentionArguments& args, RowMatrix<compute_t<T>>& out) {
  using Real = compute_t<T>;
  const Index Hq = queries.rows(), G = Hq / keys.heads, t = keys.tokens, d = keys.dim;
  const Real scale = static_cast<Real>(args.resolved_scale(d));
  const Real cap = static_cast<Real>(args.softcap);
  out.setZero(Hq, d);
  std::vector<Real> logit(static_cast<std::size_t>(t));
  for (Index h = 0; h < Hq; ++h) {
    const Index g = h / G;
    Real mx = -std::numeric_limits<Real>::infinity();
    for (Index i = 0; i < t; ++i) {
      const T* k = keys.row(g, i);
      Real s = 0;
      for (Index c = 0; c < d; ++c) s += queries(h, c) * to_real<Real>(k[c]);
      s *= scale;
      if (cap > Real(0)) s = cap * std::tanh(s / cap);
      s += bias.at(g, i);
      logit[i] = s;
      mx = std::max(mx, s);
    }
    Real sum = 0;
    for (Index i = 0; i < t; ++i) sum += (logit[i] = std::exp(logit[i] - mx));
    for (Index i = 0; i < t; ++i) {
      const Real p = logit[i] / sum;
      const T* v = values.row(g, i);
      for (Index c = 0; c < d; ++c) out(h, c) += p * to_real<Real>(v[c]);
    }
  }
}

/// Float kernel: per KV head g, its G query heads together. Pass over K: logits (G, t) by
/// simd::dot_rows (each key row read once for the G heads), soft-cap and bias; then per head the max,
/// e^(x − max) and the sum while the (G, t) logits are in cache, p = e / sum; pass over V:
/// out_h += p_h,i · v_i by simd::axpy_rows (each value row read once). The same operations and order
/// per output element as the reference loops (p normalised before the weighted sum), vectorised.
/// O(Hq·t·d) flops, one read of K and V, O(G·t) floats of scratch.
template <class Arch, class T>
void decode_attention_blocked(const RowMatrix<float>& queries, const TensorView<const T>& keys,
                              const TensorView<const T>& values, const BiasView<float>& bias,
                              const AttentionArguments& args, RowMatrix<float>& out) {
  const Index Hq = queries.rows(), G = Hq / keys.heads, t = keys.tokens, d = keys.dim;
  const float scale = static_cast<float>(args.resolved_scale(d));
  const float cap = static_cast<float>(args.softcap);
  out.setZero(Hq, d);
  std::vector<float> logit(static_cast<std::size_t>(G * t));  // (G, t)
  std::vector<float> key_logits(static_cast<std::size_t>(G));
  for (Index g = 0; g < keys.heads; ++g) {
    const float* q = queries.row(g * G).data();  // (G, d), row stride d
    float* o = out.row(g * G).data();            // (G, d)
    for (Index i = 0; i < t; ++i) {
      simd::dot_rows<Arch>(q, d, G, keys.row(g, i), d, key_logits.data());
      const float b = bias.at(g, i);
      for (Index h = 0; h < G; ++h) {
        float s = key_logits[static_cast<std::size_t>(h)] * scale;
        if (cap > 0.0f) s = cap * std::tanh(s / cap);
        logit[static_cast<std::size_t>(h * t + i)] = s + b;
      }
    }
    for (Index h = 0; h < G; ++h) {
      float* x = logit.data() + h * t;
      const float mx = simd::max<Arch>(x, t);
      const float sum = simd::exp_shift_sum<Arch>(x, t, mx);
      simd::divide<Arch>(x, sum, t);
    }
    for (Index i = 0; i < t; ++i) simd::axpy_rows<Arch>(logit.data() + i, t, G, values.row(g, i), d, o, d);
  }
}

}  // namespace detail

/// out (Hq, d) <- Σ_i softmax_i(softcap(scale·<q_h, k_{g,i}>) + bias_{g,i}) v_{g,i},  g = h / G.
/// queries (Hq, d); keys, values [Hkv][t][d] (t = compressed entries + appended tokens).
/// Throws kvc::error on inconsistent shapes. O(Hq·t·d) time, O(G·t) extra memory.
template <class T>
void decode_attention(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                      const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                      const AttentionArguments& args, RowMatrix<compute_t<T>>& out) {
  using detail::concat;
  detail::check_view(keys, "keys").throw_if_error();
  detail::check_view(values, "values").throw_if_error();
  args.validate().throw_if_error();
  if (values.heads != keys.heads || values.tokens != keys.tokens || values.dim != keys.dim)
    throw error("decode_attention: values shape differs from keys");
  if (queries.cols() != keys.dim)
    throw error(concat("decode_attention: queries have ", queries.cols(), " columns, keys.dim = ", keys.dim));
  if (queries.rows() % keys.heads != 0)
    throw error(concat("decode_attention: query heads (", queries.rows(), ") not a multiple of KV heads (",
                       keys.heads, ")"));
  if (bias.data && bias.heads != keys.heads)
    throw error(concat("decode_attention: bias.heads = ", bias.heads, ", expected ", keys.heads));
  if constexpr (std::is_same_v<compute_t<T>, float>)
    detail::decode_attention_blocked<simd::default_arch>(queries, keys, values, bias, args, out);
  else
    detail::decode_attention_reference(queries, keys, values, bias, args, out);
}

}  // namespace kvc
