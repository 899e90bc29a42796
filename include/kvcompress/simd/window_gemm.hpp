// The window-attention product as a register-blocked SIMD kernel, with the causal online-softmax
// epilogue, in the "transposed" layout the attention-mass path uses: logits are stored key-major,
// X[j][r] = scale·<q_r, k_j> (one row per key, one lane per stacked query r = local_head·W + i).
//
// Why transposed: the keys are read straight from the caller's rows (contiguous in d) and broadcast,
// while the few G·W queries are packed once per head into panels of NV·L columns (L = float lanes),
// so no key is ever copied or transposed (float input); every softmax statistic (row maximum, row
// sum, rescaling) is then a vertical, lane-wise operation, and the attention mass of key j is one dot
// product of its row with a per-tile factor vector. The micro-kernel keeps a 6-key × NV·L-query block
// of accumulators in registers (NV = 2 with AVX2's 16 registers: 12 accumulators, 2 loads + 6
// broadcasts per 12 FMAs; NV = 4 with AVX-512's 32 when a panel fits in 32 KiB: 24 accumulators, 4
// loads + 6 broadcasts per 24 FMAs); the product goes panel by panel (window_logits_t), one panel in L1 while a caller's tile of keys (kSoftmaxTile·d
// floats, 128 KiB at d = 128) is re-read from L2, and the panel passes of one tile prefetch the next
// tile's keys into L2 while they compute, so it runs near the FMA peak. It can also hand the softmax each
// tile's lane maxima from its registers (tile_max), which saves the softmax a pass over the tile.
//
// Summation order is fixed (p = 0..d-1, one FMA chain per output), so results are deterministic.
#pragma once

#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace kvc::simd {

/// Rows of the query panels: R rounded up to a multiple of the float lane count L.
template <class A>
inline Index padded_queries(Index R) {
  constexpr Index L = fbatch<A>::size;
  return (R + L - 1) / L * L;
}

/// Float batches in the widest query panel: 4 where there are 32 vector registers (AVX-512: 6 keys × 4
/// batches = 24 accumulators, + 4 query batches + 1 broadcast), else 2 (12 + 2 + 1 of AVX2's 16).
template <class A>
inline constexpr int kPanelBatches = fbatch<A>::size >= 16 ? 4 : 2;

/// Columns of the query panel that starts where `remaining` padded columns are left (d: the head
/// dimension): the widest of kPanelBatches·L, 2L, L that fits in `remaining` — where kPanelBatches·L
/// columns of d floats are at most 32 KiB (a panel stays in L1 while the keys pass), else at most 2L.
/// The bound suits a 48 KiB L1D; at d = 128 a 4-batch panel is exactly 32 KiB, all of the L1D of
/// Skylake-SP / Cascade Lake (not measured there).
/// pack_queries and window_logits_t both lay panels out this way.
template <class A>
inline Index panel_columns(Index remaining, Index d) {
  constexpr Index L = fbatch<A>::size;
  constexpr Index widest = kPanelBatches<A> * L;
  if (widest > 2 * L && remaining >= widest && widest * d * Index(sizeof(float)) <= (Index(32) << 10)) return widest;
  return remaining >= 2 * L ? 2 * L : L;
}

/// Pack `R` query rows q_r (row stride ldq, d floats each) times `scale` into panels for
/// window_logits_t: panels of P = panel_columns(columns left, d) columns each, laid out [d][P] (the
/// widest first, then at most one of 2L, then at most one of L); columns R..padded_queries(R) are 0.
/// `packed` holds padded_queries(R)·d floats.
template <class A>
inline void pack_queries(const float* q, Index ldq, Index R, Index d, float scale, float* packed) {
  const Index Rp = padded_queries<A>(R);
  for (Index c0 = 0; c0 < Rp;) {
    const Index P = panel_columns<A>(Rp - c0, d);
    for (Index p = 0; p < d; ++p)
      for (Index c = 0; c < P; ++c) {
        const Index r = c0 + c;
        packed[p * P + c] = r < R ? scale * q[r * ldq + p] : 0.0f;
      }
    packed += P * d;
    c0 += P;
  }
}

namespace detail {

/// Rows a panel pass prefetches into L2 while it computes (see window_logits_t): of the rows at
/// `rows` (row stride of the keys, `count` of them), the 64-byte lines first_line, first_line + line_step, ...
struct KeyPrefetch {
  const float* rows = nullptr;  // null: none
  Index count = 0;
  Index first_line = 0, line_step = 1;
};

/// Prefetches, into L2, the assigned lines of rows [j, j + MR) of `pf` (all of them must be < pf.count).
template <int MR>
inline void prefetch_key_rows(const KeyPrefetch& pf, Index j, Index ldk, Index d) {
  constexpr Index per_line = 64 / static_cast<Index>(sizeof(float));
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
    for (Index p = pf.first_line * per_line; p < d; p += pf.line_step * per_line)
      prefetch_l2(pf.rows + (j + i) * ldk + p);
}

/// Per-lane statistics of the logits a panel pass writes (window_logits_t's tile_max): the maximum
/// over the keys, and x − x summed (0 while every logit is finite, NaN once one is NaN or ±Inf).
template <class A, int NV>
struct LaneStats {
  fbatch<A> max[NV], nonfinite[NV];
};

/// MR keys × NV·L queries: out[i][c] = Σ_p k[i·ldk + p] · qp[p·NV·L + c], written with row stride ldo;
/// with STATS, also folded into `stats` from the registers.
template <class A, int MR, int NV, bool STATS = false>
inline void logits_block(const float* k, Index ldk, Index d, const float* qp, float* out, Index ldo,
                         LaneStats<A, NV>* stats = nullptr) {
  using B = fbatch<A>;
  constexpr Index L = B::size, P = NV * L;
  B acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = B(0.0f);
  for (Index p = 0; p < d; ++p) {
    B q[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) q[v] = B::load_unaligned(qp + p * P + v * L);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const B kb(k[i * ldk + p]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = simd::fma(kb, q[v], acc[i][v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v].store_unaligned(out + i * ldo + v * L);
  if constexpr (STATS) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        stats->max[v] = xsimd::max(stats->max[v], acc[i][v]);
        stats->nonfinite[v] += acc[i][v] - acc[i][v];
      }
  }
}

}  // namespace detail

inline constexpr int kLogitsKeys = 6;  // keys per micro-kernel block

namespace detail {
/// All `count` keys against one panel of NV·L query columns: blocks of kLogitsKeys keys, then the rest.
/// Before each full block of MR keys, prefetches the lines `pf` assigns it of rows [j, j + MR) of pf.rows
/// when they all exist.
/// With STATS, writes the panel's lanes of tile_max (see window_logits_t).
template <class A, int NV, bool STATS>
inline void logits_panel(const float* k, Index ldk, Index count, Index d, const float* panel, float* out, Index ldo,
                         const KeyPrefetch& pf, float* tile_max) {
  using B = fbatch<A>;
  constexpr Index L = B::size;
  constexpr int MR = kLogitsKeys;
  LaneStats<A, NV> st;
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    st.max[v] = B(-std::numeric_limits<float>::infinity());
    st.nonfinite[v] = B(0.0f);
  }
  Index j = 0;
  for (; j + MR <= count; j += MR) {
    if (pf.rows != nullptr && j + MR <= pf.count) prefetch_key_rows<MR>(pf, j, ldk, d);
    logits_block<A, MR, NV, STATS>(k + j * ldk, ldk, d, panel, out + j * ldo, ldo, &st);
  }
  const float* kr = k + j * ldk;
  float* o = out + j * ldo;
  switch (count - j) {
    case 5: logits_block<A, 5, NV, STATS>(kr, ldk, d, panel, o, ldo, &st); break;
    case 4: logits_block<A, 4, NV, STATS>(kr, ldk, d, panel, o, ldo, &st); break;
    case 3: logits_block<A, 3, NV, STATS>(kr, ldk, d, panel, o, ldo, &st); break;
    case 2: logits_block<A, 2, NV, STATS>(kr, ldk, d, panel, o, ldo, &st); break;
    case 1: logits_block<A, 1, NV, STATS>(kr, ldk, d, panel, o, ldo, &st); break;
    default: break;
  }
  if constexpr (STATS) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) (st.max[v] + st.nonfinite[v]).store_unaligned(tile_max + v * L);
  }
}
}  // namespace detail

/// out[j][c] (row stride ldo ≥ Rp) = Σ_p k_j[p] · packed column c, for `count` key rows
/// k_j = k + j·ldk (d floats each) and every packed query column c < Rp = padded_queries(R).
/// Panel by panel (panel_columns): each panel (P·d floats: 8 KiB on AVX2 and 32 KiB on AVX-512 at
/// d = 128) stays in L1 while all the keys pass (re-read from L2 once per panel when a caller's tile
/// of keys fits there). Panels outer, keys inner: the other order would stream all Rp·d panel floats
/// from L2 for every block of kLogitsKeys keys. Every output has the same arithmetic either way.
///
/// `next` (optional, same row stride ldk) names the `next_count` key rows the caller will pass in its
/// next call: they are prefetched into L2 while this tile computes, each panel pass taking its share
/// of their 64-byte lines (panel i of P: lines i, i + P, ...), so the next tile's first pass finds its
/// keys in L2 instead of waiting on DRAM (the hardware prefetchers alone do not keep the first panel
/// pass fed). Rows of a last partial block of kLogitsKeys are not prefetched.
///
/// `tile_max` (optional, Rp floats): receives, lane by lane, the maximum of the `count` logits written,
/// or NaN when one of them is NaN or ±Inf; taken from the registers, so softmax_tile_t can skip its
/// own pass over the tile for it (count ≥ 1).
template <class A>
inline void window_logits_t(const float* k, Index ldk, Index count, Index d, const float* packed, Index Rp,
                            float* out, Index ldo, const float* next = nullptr, Index next_count = 0,
                            float* tile_max = nullptr) {
  constexpr Index L = fbatch<A>::size;
  Index panels = 0;
  for (Index c0 = 0; c0 < Rp; c0 += panel_columns<A>(Rp - c0, d)) ++panels;
  const auto all_panels = [&](auto stats) {  // stats: std::bool_constant, whether tile_max is written
    constexpr bool S = decltype(stats)::value;
    detail::KeyPrefetch pf{next, next_count, 0, panels};
    for (Index c0 = 0; c0 < Rp; ++pf.first_line) {
      const Index P = panel_columns<A>(Rp - c0, d);
      const float* panel = packed + c0 * d;
      float* const tm = S ? tile_max + c0 : nullptr;
      if constexpr (kPanelBatches<A> >= 4) {
        if (P == 4 * L) {
          detail::logits_panel<A, 4, S>(k, ldk, count, d, panel, out + c0, ldo, pf, tm);
          c0 += P;
          continue;
        }
      }
      if (P == 2 * L)
        detail::logits_panel<A, 2, S>(k, ldk, count, d, panel, out + c0, ldo, pf, tm);
      else
        detail::logits_panel<A, 1, S>(k, ldk, count, d, panel, out + c0, ldo, pf, tm);
      c0 += P;
    }
  };
  if (tile_max != nullptr)
    all_panels(std::true_type{});
  else
    all_panels(std::false_type{});
}

namespace detail {

/// softmax_tile_t on the CG·L lanes starting at c (CG batches side by side, so each row of the tile is
/// read CG·L floats at a time: whole cache lines, instead of one batch per row per pass). Lane by lane
/// the arithmetic is that of CG = 1. Accumulates x − x of every raw logit into `nonfinite`. Biased:
/// key row j < bias_len gets + bias[j] after the soft-cap (exactly x + b).
template <class A, int CG, bool Biased>
inline void softmax_lanes_t(float* x, Index ldx, Index count, Index c, Index rel0, bool masked, const float* last,
                            float softcap_c, float* run_max, float* run_sum, float* shift, fbatch<A>& nonfinite,
                            const float* tile_max, const float* bias, Index bias_len) {
  using B = fbatch<A>;
  constexpr Index L = B::size;
  const B ninf(-std::numeric_limits<float>::infinity());
  B lastc[CG], mx[CG];
#pragma GCC unroll 4
  for (int u = 0; u < CG; ++u) {
    lastc[u] = B::load_unaligned(last + c + u * L);
    mx[u] = ninf;
  }
  if (tile_max != nullptr) {  // the product's own maxima (window_logits_t), NaN for a non-finite logit
#pragma GCC unroll 4
    for (int u = 0; u < CG; ++u) {
      mx[u] = B::load_unaligned(tile_max + c + u * L);
      nonfinite += mx[u] - mx[u];
    }
  }
  for (Index j = 0; j < (tile_max != nullptr ? 0 : count); ++j) {
    float* p = x + j * ldx + c;
    const B row_pos(static_cast<float>(rel0 + j));
#pragma GCC unroll 4
    for (int u = 0; u < CG; ++u) {
      B v = B::load_unaligned(p + u * L);
      nonfinite += v - v;
      if (softcap_c > 0.0f) {
        v = B(softcap_c) * xsimd::tanh(v * B(1.0f / softcap_c));
        v.store_unaligned(p + u * L);
      }
      if constexpr (Biased) {
        if (j < bias_len) {
          v = v + B(bias[j]);
          v.store_unaligned(p + u * L);
        }
      }
      if (masked) v = xsimd::select(row_pos <= lastc[u], v, ninf);
      mx[u] = xsimd::max(mx[u], v);
    }
  }
  B finite_new[CG], sum[CG];
#pragma GCC unroll 4
  for (int u = 0; u < CG; ++u) {
    const B m_old = B::load_unaligned(run_max + c + u * L);
    const B m_new = xsimd::max(m_old, mx[u]);
    // Lanes that have seen nothing yet (m_old = −inf) have run_sum 0; keep them 0 (0·e^(−inf) = NaN).
    const B rescale = xsimd::select(m_old == ninf, B(0.0f), simd::exp<A>(m_old - m_new));
    finite_new[u] = xsimd::select(m_new == ninf, B(0.0f), m_new);
    sum[u] = B::load_unaligned(run_sum + c + u * L) * rescale;
    m_new.store_unaligned(run_max + c + u * L);
    m_new.store_unaligned(shift + c + u * L);
  }
  for (Index j = 0; j < count; ++j) {
    float* p = x + j * ldx + c;
    const B row_pos(static_cast<float>(rel0 + j));
#pragma GCC unroll 4
    for (int u = 0; u < CG; ++u) {
      B e = simd::exp_via2<A>(B::load_unaligned(p + u * L) - finite_new[u]);
      if (masked) e = xsimd::select(row_pos <= lastc[u], e, B(0.0f));
      e.store_unaligned(p + u * L);
      sum[u] += e;
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < CG; ++u) sum[u].store_unaligned(run_sum + c + u * L);
}

}  // namespace detail

/// Causal online-softmax epilogue of one tile in the transposed layout: `x` holds `count` key rows
/// (row stride ldx) of Rp lanes; row j is key number rel0 + j counted from the first window position
/// (rel0 = j0 − (n − W), negative before the window). Lane c sees it iff rel0 + j ≤ last[c], where
/// callers pass last[c] = c mod W for real lanes and W for padding (small integers, exact in float;
/// keys before the window compare as negative numbers). Optional soft-cap c·tanh(x/c) first. Visible entries become
/// e^(x − M_c) with M_c the running lane maximum after this tile, hidden ones exactly 0; `run_max`
/// and `run_sum` (Rp each) are updated online (the old sum rescaled by e^(M_old − M_new)) and `shift`
/// (Rp) receives the M_c used, so a later pass can rescale the tile by e^(shift − M_final) / Z.
/// `masked` = false promises every lane sees every key of the tile (skips the comparisons).
/// Lanes go four batches at a time (detail::softmax_lanes_t), then one at a time; each lane's sum runs
/// over the rows in order, so results do not depend on the grouping.
/// Returns false when a raw logit of the tile (before the soft-cap, padding lanes included) is NaN
/// or ±Inf: the caller's keys or queries were not finite, or the product overflowed.
/// `tile_max` (optional, Rp floats): the lane maxima of the tile as window_logits_t's tile_max gives
/// them (NaN for a non-finite logit); used, instead of a pass over the tile, only when neither
/// `masked`, the soft-cap nor a bias applies. Results are the same either way.
/// `bias` (optional): key row j < bias_len of the tile gets + bias[j] after the soft-cap (the stored
/// bias of a view compressed before); a bias-free call runs the unbiased kernel.
template <class A>
inline bool softmax_tile_t(float* x, Index ldx, Index count, Index Rp, Index rel0, bool masked, const float* last,
                           float softcap_c, float* run_max, float* run_sum, float* shift,
                           const float* tile_max = nullptr, const float* bias = nullptr, Index bias_len = 0) {
  using B = fbatch<A>;
  constexpr Index L = B::size;
  constexpr int CG = 4;
  if (bias == nullptr) bias_len = 0;
  if (masked || softcap_c > 0.0f || bias_len > 0 || count == 0) tile_max = nullptr;
  B nonfinite(0.0f);  // accumulates x − x: 0 for finite x, NaN for NaN and ±Inf
  const auto lanes = [&](auto biased) {
    constexpr bool Biased = decltype(biased)::value;
    Index c = 0;
    for (; c + CG * L <= Rp; c += CG * L)
      detail::softmax_lanes_t<A, CG, Biased>(x, ldx, count, c, rel0, masked, last, softcap_c, run_max, run_sum, shift,
                                             nonfinite, tile_max, bias, bias_len);
    for (; c < Rp; c += L)
      detail::softmax_lanes_t<A, 1, Biased>(x, ldx, count, c, rel0, masked, last, softcap_c, run_max, run_sum, shift,
                                            nonfinite, tile_max, bias, bias_len);
  };
  if (bias_len > 0)
    lanes(std::true_type{});
  else
    lanes(std::false_type{});
  return xsimd::all(nonfinite == B(0.0f));
}

}  // namespace kvc::simd
