// Decode attention with the compensation bias (SPEC §8): one decode step of Hq query heads over a
// (compressed) layer plus any appended tokens. Float arithmetic runs a single-pass, tiled SIMD kernel
// with an online softmax (the G query heads of a KV head together, so K and V are each read once);
// double arithmetic runs the plain reference loops.
//
// How an engine consumes the bias without this kernel: most engines already add a mask to the
// logits before the softmax (0 for visible, −inf for hidden). Store the bias of compressed entry i
// of KV head g in that additive mask, at column i, for every query head h with h / G == g; tokens
// appended after compression get 0. The logit of entry i is then softcap(scale·<q,k_i>) + bias_i.
#pragma once
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/simd/decode_kernels.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvc {

namespace detail {

/// The plain loops (double reference runs): per query head, logits, softmax, weighted sum of values.
/// `lengths` (one per KV head, or null for keys.tokens each): the entries head g attends to.
template <class T>
void decode_attention_reference(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                                const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                                const AttentionArguments& args, RowMatrix<compute_t<T>>& out,
                                const Index* lengths = nullptr) {
  using Real = compute_t<T>;
  const Index Hq = queries.rows(), G = Hq / keys.heads, d = keys.dim;
  const Real scale = static_cast<Real>(args.resolved_scale(d));
  const Real cap = static_cast<Real>(args.softcap);
  out.setZero(Hq, d);
  std::vector<Real> logit(static_cast<std::size_t>(keys.tokens));
  for (Index h = 0; h < Hq; ++h) {
    const Index g = h / G, t = lengths ? lengths[g] : keys.tokens;
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

/// Keys per tile of the float kernel (its logits, G × kDecodeTile floats, stay in L1/L2), value rows
/// per register block of the value pass, and how many rows ahead K and V rows are prefetched.
inline constexpr Index kDecodeTile = 1024;
inline constexpr Index kDecodeRowBlock = 16;
inline constexpr Index kDecodePrefetchRows = 16;

/// Calls f(std::integral_constant<int, nh>{}) for nh in 1..4 (the heads of one register block).
template <class F>
void with_head_block(Index nh, F&& f) {
  switch (nh) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

/// Raw scores e[h · kDecodeTile + j] = <q_h, k_{g, i0+j}> for NH query rows q_h = q + h·d and the len
/// keys of one tile, two keys per reduction (simd::dots_block). With `prefetch`, the key rows
/// kDecodePrefetchRows ahead (when below t) are prefetched while reading.
template <class Arch, int NH, class T>
void decode_tile_scores(const float* q, const TensorView<const T>& keys, Index g, Index i0, Index len,
                        bool prefetch, float* e) {
  const Index d = keys.dim, t = keys.tokens;
  alignas(32) float s[8];
  Index j = 0;
  for (; j + 2 <= len; j += 2) {
    const Index ahead = prefetch && i0 + j + 1 + kDecodePrefetchRows < t && keys.contiguous(i0 + j, kDecodePrefetchRows + 2)
                            ? kDecodePrefetchRows * keys.token_stride
                            : 0;
    const T* k[2] = {keys.row(g, i0 + j), keys.row(g, i0 + j + 1)};
    simd::dots_block<Arch, 2, NH>(q, d, k, d, s, ahead);
    for (int h = 0; h < NH; ++h) {
      e[h * kDecodeTile + j] = s[h];
      e[h * kDecodeTile + j + 1] = s[4 + h];
    }
  }
  if (j < len) {
    const T* k[1] = {keys.row(g, i0 + j)};
    simd::dots_block<Arch, 1, NH>(q, d, k, d, s);
    for (int h = 0; h < NH; ++h) e[h * kDecodeTile + j] = s[h];
  }
}

/// o_h (d) += Σ_{j < rows} w[h · w_stride + j] · v_j for NH output rows o_h = o + h·d and `rows`
/// value rows v_j = v + j·v_stride: sweeps of two batches of columns over the rows, accumulated in
/// registers (simd::axpy_block), then one batch, then the scalar column tail. While sweeping, the
/// `prefetch_bytes` at `prefetch` (the next block of rows, or null) are prefetched front to back, as
/// many lines per row read as it takes to cover them in the vector sweeps (2 for float rows with
/// 16-lane batches and d = 128: 64 row reads for a 16-row block of 128 lines; one line per read would
/// leave the second half of every next block to the hardware prefetcher).
template <class Arch, int NH, class T>
void decode_block_values(const float* w, Index w_stride, const T* v, Index v_stride, Index rows, Index d, float* o,
                         const char* prefetch, Index prefetch_bytes) {
  constexpr Index S = simd::fbatch<Arch>::size;
  const Index sweeps = d / (2 * S) + (d % (2 * S) >= S ? 1 : 0), reads = sweeps * rows;
  const Index lines = reads > 0 ? std::max<Index>(1, ((prefetch_bytes + 63) / 64 + reads - 1) / reads) : 1;
  Index c = 0, step = 0;
  for (; c + 2 * S <= d; c += 2 * S, step += rows)
    simd::axpy_block<Arch, NH, 2>(w, w_stride, v, v_stride, rows, c, o, d, prefetch, prefetch_bytes, step, lines);
  if (c + S <= d) {
    simd::axpy_block<Arch, NH, 1>(w, w_stride, v, v_stride, rows, c, o, d, prefetch, prefetch_bytes, step, lines);
    c += S;
  }
  for (; c < d; ++c)
    for (Index j = 0; j < rows; ++j) {
      const float vc = to_real<float>(v[j * v_stride + c]);
      for (int h = 0; h < NH; ++h) o[h * d + c] += w[h * w_stride + j] * vc;
    }
}

/// One tile of the online softmax for one query head: x (len raw scores) <- scale·x, soft-cap
/// cap·tanh(x / cap) when cap > 0, + bias
/// (`bias_len` <= len leading entries), then e^(x − m) where m, the running maximum, is raised to the
/// tile's maximum first; the running sum l is rescaled by e^(m_old − m_new) and the tile's Σ e added.
/// Returns that rescale factor (1 when m did not move; the caller rescales its output row by it). While
/// every logit seen so far is −inf, the tile's weights are set to 0 and m stays −inf.
template <class Arch>
float decode_tile_softmax(float* x, Index len, float scale, float cap, const float* bias, Index bias_len,
                          float& m, float& l) {
  using B = simd::fbatch<Arch>;
  constexpr Index S = B::size;
  if (cap > 0.0f) {  // scale·x, then cap·tanh(· / cap): the reference's operations (a true division)
    const B sb(scale), cb(cap);
    Index k = 0;
    for (; k + S <= len; k += S) (cb * xsimd::tanh((B::load_unaligned(x + k) * sb) / cb)).store_unaligned(x + k);
    for (; k < len; ++k) x[k] = cap * std::tanh((x[k] * scale) / cap);
  } else {
    simd::scale<Arch>(x, scale, len);
  }
  if (bias_len > 0) simd::axpy<Arch>(1.0f, bias, x, bias_len);  // fma(1, b, x): exactly x + b
  const float m_new = std::max(m, simd::max<Arch>(x, len));
  if (m_new == -std::numeric_limits<float>::infinity()) {
    std::fill(x, x + len, 0.0f);
    return 1.0f;
  }
  float factor = 1.0f;
  if (m_new > m && m != -std::numeric_limits<float>::infinity()) {
    factor = std::exp(m - m_new);
    l *= factor;
  }
  m = m_new;
  l += simd::exp_shift_sum<Arch>(x, len, m_new);
  return factor;
}

/// Float kernel, one pass over K and V in tiles of kDecodeTile keys (flash-decoding style online
/// softmax). Per KV head g and tile: raw scores of the G query heads of g, in register blocks of 4
/// heads × 2 keys (8 vertical FMA chains, one transposing reduction per block, each key row loaded once
/// per 4 heads); per head scale, soft-cap, bias, tile maximum, running maximum m_h and running sum l_h
/// (rescaled by e^(m_old − m_new) when the maximum rises, together with the output row), weights
/// e^(x − m_h); then out_h += Σ_i e_h,i · v_i over blocks of kDecodeRowBlock value rows, accumulated in
/// registers (4 heads × 2 batches of columns). At the end out_h /= l_h. Key rows are prefetched
/// kDecodePrefetchRows ahead as they are read; with contiguous value rows (head-major), each block of
/// value rows prefetches the next block front to back while it is swept column by column. Every tile
/// and block has a fixed order, so the result is deterministic (and independent of the layout); it
/// differs from the reference loops only by float rounding (the softmax is normalised once at the end
/// instead of per weight). A head whose every logit is −inf gets 0/0 = NaN, as in the reference.
/// O(Hq·t·d) flops, one read of K and V, O(G·kDecodeTile) floats of scratch.
template <class Arch, class T>
void decode_attention_blocked(const RowMatrix<float>& queries, const TensorView<const T>& keys,
                              const TensorView<const T>& values, const BiasView<float>& bias,
                              const AttentionArguments& args, RowMatrix<float>& out, const Index* lengths = nullptr) {
  const Index Hq = queries.rows(), G = Hq / keys.heads, d = keys.dim;
  const float scale = static_cast<float>(args.resolved_scale(d));
  const float cap = static_cast<float>(args.softcap);
  out.setZero(Hq, d);
  std::vector<float> e(static_cast<std::size_t>(G * kDecodeTile));  // (G, kDecodeTile) weights of one tile
  std::vector<float> m(static_cast<std::size_t>(G)), l(static_cast<std::size_t>(G));
  std::vector<T> vgather;  // (16, d): a block of value rows that spans pages (allocated when one does)
  for (Index g = 0; g < keys.heads; ++g) {
    const Index t = lengths ? lengths[g] : keys.tokens;  // entries of head g
    const float* q = queries.row(g * G).data();  // (G, d), row stride d
    float* o = out.row(g * G).data();            // (G, d)
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.0f);
    const float* bias_row = bias.data ? bias.data + g * bias.head_stride : nullptr;
    for (Index i0 = 0; i0 < t; i0 += kDecodeTile) {
      const Index len = std::min(kDecodeTile, t - i0);
      for (Index h0 = 0; h0 < G; h0 += 4)
        with_head_block(G - h0, [&](auto nh) {
          decode_tile_scores<Arch, decltype(nh)::value>(q + h0 * d, keys, g, i0, len, h0 == 0,
                                                        e.data() + h0 * kDecodeTile);
        });
      const Index bias_len = bias_row ? std::clamp<Index>(bias.length - i0, 0, len) : 0;
      for (Index h = 0; h < G; ++h) {
        const float factor = decode_tile_softmax<Arch>(e.data() + h * kDecodeTile, len, scale, cap,
                                                       bias_row + (bias_len > 0 ? i0 : 0), bias_len,
                                                       m[static_cast<std::size_t>(h)], l[static_cast<std::size_t>(h)]);
        if (factor != 1.0f) simd::scale<Arch>(o + h * d, factor, d);
      }
      for (Index r0 = 0; r0 < len; r0 += kDecodeRowBlock) {
        const Index rows = std::min(kDecodeRowBlock, len - r0);
        const Index next = i0 + r0 + kDecodeRowBlock;  // first row of the next block
        const Index pf_rows = next < t ? std::min(kDecodeRowBlock, t - next) : 0;
        const bool contiguous = values.token_stride == d && pf_rows > 0 && values.contiguous(next, pf_rows);
        const char* pf = contiguous ? reinterpret_cast<const char*>(values.row(g, next)) : nullptr;
        const Index pf_bytes = pf ? pf_rows * d * static_cast<Index>(sizeof(T)) : 0;
        // A block of rows that spans blocks of a paged cache is gathered first (same arithmetic).
        const T* vrows = values.row(g, i0 + r0);
        Index vstride = values.token_stride;
        if (!values.contiguous(i0 + r0, rows)) {
          vgather.resize(static_cast<std::size_t>(kDecodeRowBlock * d));
          for (Index r = 0; r < rows; ++r) std::copy_n(values.row(g, i0 + r0 + r), d, vgather.data() + r * d);
          vrows = vgather.data();
          vstride = d;
        }
        for (Index h0 = 0; h0 < G; h0 += 4)
          with_head_block(G - h0, [&](auto nh) {
            decode_block_values<Arch, decltype(nh)::value>(e.data() + h0 * kDecodeTile + r0, kDecodeTile, vrows,
                                                           vstride, rows, d, o + h0 * d, h0 == 0 ? pf : nullptr,
                                                           pf_bytes);
          });
      }
    }
    for (Index h = 0; h < G; ++h) simd::divide<Arch>(o + h * d, l[static_cast<std::size_t>(h)], d);
  }
}

}  // namespace detail

namespace detail {
template <class T>
void check_decode_shapes(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                         const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                         const AttentionArguments& args) {
  check_view(keys, "keys").throw_if_error();
  check_view(values, "values").throw_if_error();
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
}
}  // namespace detail

/// out (Hq, d) <- Σ_i softmax_i(softcap(scale·<q_h, k_{g,i}>) + bias_{g,i}) v_{g,i},  g = h / G.
/// queries (Hq, d); keys, values [Hkv][t][d] (t = compressed entries + appended tokens).
/// Throws kvc::error on inconsistent shapes. O(Hq·t·d) time; extra memory O(G·min(t, kDecodeTile)) in
/// float (detail::decode_attention_blocked), O(t) in double (the reference loops).
template <class T>
void decode_attention(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                      const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                      const AttentionArguments& args, RowMatrix<compute_t<T>>& out) {
  detail::check_decode_shapes(queries, keys, values, bias, args);
  if constexpr (std::is_same_v<compute_t<T>, float>)
    detail::decode_attention_blocked<simd::default_arch>(queries, keys, values, bias, args, out);
  else
    detail::decode_attention_reference(queries, keys, values, bias, args, out);
}

/// As above over a ragged cache (per-head budgets): KV head g attends to its first lengths[g] entries
/// (rows 0 .. lengths[g] − 1 of keys, values and bias; rows beyond are not read). lengths: one per KV
/// head, each in [1, t]; otherwise kvc::error, and nothing is written. O(Hq·Σ_g lengths[g]·d / Hkv).
template <class T>
void decode_attention(const RowMatrix<compute_t<T>>& queries, const TensorView<const T>& keys,
                      const TensorView<const T>& values, const BiasView<compute_t<T>>& bias,
                      const AttentionArguments& args, const std::vector<Index>& lengths,
                      RowMatrix<compute_t<T>>& out) {
  using detail::concat;
  detail::check_decode_shapes(queries, keys, values, bias, args);
  if (static_cast<Index>(lengths.size()) != keys.heads)
    throw error(concat("decode_attention: lengths has ", lengths.size(), " entries, expected one per KV head (",
                       keys.heads, ")"));
  for (std::size_t g = 0; g < lengths.size(); ++g)
    if (lengths[g] < 1 || lengths[g] > keys.tokens)
      throw error(concat("decode_attention: lengths[", g, "] = ", lengths[g], " outside [1, ", keys.tokens, "]"));
  if constexpr (std::is_same_v<compute_t<T>, float>)
    detail::decode_attention_blocked<simd::default_arch>(queries, keys, values, bias, args, out, lengths.data());
  else
    detail::decode_attention_reference(queries, keys, values, bias, args, out, lengths.data());
}

}  // namespace kvc
