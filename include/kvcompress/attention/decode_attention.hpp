// Reference decode attention with the compensation bias (SPEC §8): one decode step of Hq query
// heads over a (compressed) layer plus any appended tokens.
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

#include <algorithm>
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

/// out (Hq, d) <- Σ_i softmax_i(softcap(scale·<q_h, k_{g,i}>) + bias_{g,i}) v_{g,i},  g = h / G.
/// queries (Hq, d); keys, values [Hkv][t][d] (t = compressed entries + appended tokens).
/// Throws kvc::error on inconsistent shapes. O(Hq·t·d) time, O(t) extra memory.
template <class T>
void decode_attention(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                      const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                      const AttentionArguments& args, RowMatrix<compute_t<T>>& out) {
  using Real = compute_t<T>;
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

}  // namespace kvc
