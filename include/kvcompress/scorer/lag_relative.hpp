// LagKV's scorer (as kvpress's LagKVPress computes it): each partition of tokens is scored against
// the next one, by the spread of its keys and values min-max normalised by that next partition.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvc {

/// LagKV (Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
/// Important", 2025), with kvpress's LagKVPress defaults. After the `sinks` first tokens the cache is
/// cut into partitions P_p = [s + p·L, s + (p+1)·L) of L = `lag` tokens, p = 0..q−1 with
/// q = ⌊(n − s)/L⌋; partition p < q − 1 is scored against its successor P_{p+1}. For X = K_g, then V_g,
/// and each channel c:
///   x̂_{j,c} = (x_{j,c} − min_{i∈P_{p+1}} x_{i,c}) / (max_{i∈P_{p+1}} x_{i,c} − min_{i∈P_{p+1}} x_{i,c})
///   σ_j = std_c(x̂_{j,·}) (divisor d − 1),   s^X_j = softmax_{j∈P_p}(σ_j)
///   s_j = (s^K_j + s^V_j) / 2
///   c_g[j] = rank of s_j among P_p / L    (ascending, ties by position; `rank` on, the default)
///   c_g[j] = s_j                          (`rank` off: kvpress's cross_scoring)
/// kvpress scores the sinks and the unscored tail T = [s + (q−1)·L, n) (the last full partition and the
/// < L tokens after it) 1, leaving ties among them to torch's top-k; here the order among them is
/// fixed, sinks first, then the newest tail tokens: c_g[j] = 2 (j < s), 1 + (j − t)/(n − t) (j ∈ T,
/// t = s + (q−1)·L), above every partition score (< 1). A cache too short for two partitions
/// (n < s + 2L) scores 1 for the sinks and c_g[j] = (j − s)/(n − s) after them, as kvpress, which
/// keeps the newest tokens too. Decisions where kvpress divides by zero: a channel constant over
/// the reference partition gives x̂ = 0; d = 1 gives σ = 0. σ and the partition's softmax are computed
/// in float SIMD arithmetic for float, half and bfloat16 caches (the ranks are those of the scores
/// rounded to float, ties by position), in double for double caches and wherever float would
/// overflow, so any finite cache gives finite scores. Needs no window attention. One pass over K_g and
/// V_g: O(n·d), O(L·d) memory.
struct LagRelative {
  struct Arguments {
    Index sinks = 4;   ///< first tokens scored 1 (kvpress n_sink)
    Index lag = 128;   ///< partition length L (kvpress lag_size)
    bool rank = true;  ///< score by the rank within the partition (kvpress: cross_scoring = false)
  };
  Arguments args;

  Status validate() const {
    using detail::concat;
    if (args.sinks < 0)
      return Status::fail(Status::Code::invalid_argument, concat("scorer.sinks must be >= 0, got ", args.sinks));
    if (args.lag < 1)
      return Status::fail(Status::Code::invalid_argument, concat("scorer.lag must be >= 1, got ", args.lag));
    return Status::ok();
  }

  /// s (L) <- σ_j of the rows [lo, lo + L) min-max normalised by the rows [lo + L, lo + 2L), in double.
  /// `row(j)` gives row j (d elements); shift, scale and x are scratch (d).
  template <class Row>
  static void spreads_double(Row row, Index lo, Index L, Index d, std::vector<double>& shift,
                             std::vector<double>& scale, std::vector<double>& x, std::vector<double>& s) {
    shift.resize(static_cast<std::size_t>(d));
    scale.resize(static_cast<std::size_t>(d));
    x.resize(static_cast<std::size_t>(d));
    for (Index c = 0; c < d; ++c) shift[static_cast<std::size_t>(c)] = scale[static_cast<std::size_t>(c)] = to_real<double>(row(lo + L)[c]);
    double* low = shift.data();
    double* high = scale.data();
    for (Index i = lo + L + 1; i < lo + 2 * L; ++i) {  // shift <- min, scale <- max over the reference rows
      const auto* r = row(i);
      for (Index c = 0; c < d; ++c) {
        const double v = to_real<double>(r[c]);
        low[c] = v < low[c] ? v : low[c];  // std::min, std::max
        high[c] = high[c] < v ? v : high[c];
      }
    }
    for (Index c = 0; c < d; ++c) {  // scale <- 1 / (max − min), 0 for a constant channel (x̂ = 0)
      const std::size_t k = static_cast<std::size_t>(c);
      const double range = scale[k] - shift[k];
      scale[k] = range == 0.0 ? 0.0 : 1.0 / range;
    }
    double* v = x.data();
    for (Index j = 0; j < L; ++j) {
      const auto* r = row(lo + j);
      for (Index c = 0; c < d; ++c) v[c] = (to_real<double>(r[c]) - shift[static_cast<std::size_t>(c)]) * scale[static_cast<std::size_t>(c)];
      // Σ v and Σ v² in eight partial sums each (vectorised), added pairwise.
      double a1[8] = {0, 0, 0, 0, 0, 0, 0, 0}, a2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      Index c = 0;
      for (; c + 8 <= d; c += 8)
        for (int k = 0; k < 8; ++k) {
          a1[k] += v[c + k];
          a2[k] += v[c + k] * v[c + k];
        }
      double sum = ((a1[0] + a1[4]) + (a1[1] + a1[5])) + ((a1[2] + a1[6]) + (a1[3] + a1[7]));
      double sum2 = ((a2[0] + a2[4]) + (a2[1] + a2[5])) + ((a2[2] + a2[6]) + (a2[3] + a2[7]));
      for (; c < d; ++c) {
        sum += v[c];
        sum2 += v[c] * v[c];
      }
      double sigma = 0;
      if (d > 1) {
        const double mean = sum / static_cast<double>(d);
        sigma = std::sqrt(std::max(0.0, (sum2 - sum * mean) / static_cast<double>(d - 1)));
      }
      s[static_cast<std::size_t>(j)] = sigma;
    }
  }

  /// The per-channel min and max of a reference partition's rows, in float (exact for float, half and
  /// bfloat16 rows).
  struct Reference {
    std::vector<float> low, high;
  };

  /// mn, mx [c0, c0 + NB·W) <- the per-channel min and max of rows [lo, lo + L), the running values in
  /// registers while the rows stream by (no chain through memory, many loads in flight). Each row is
  /// folded as min(running, row), max(running, row) in row order, as a scalar std::min/std::max fold.
  template <int NB, class Row>
  static void fold_block(Row row, Index lo, Index L, Index c0, float* mn, float* mx) {
    using A = simd::default_arch;
    using B = simd::fbatch<A>;
    constexpr Index W = B::size;
    B low[NB], high[NB];
    const auto* first = row(lo);
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) low[b] = high[b] = simd::load<A>(first + c0 + b * W);
    for (Index i = lo + 1; i < lo + L; ++i) {
      const auto* r = row(i);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const B e = simd::load<A>(r + c0 + b * W);
        low[b] = xsimd::min(low[b], e);
        high[b] = xsimd::max(high[b], e);
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      low[b].store_unaligned(mn + c0 + b * W);
      high[b].store_unaligned(mx + c0 + b * W);
    }
  }

  /// ref <- the per-channel min and max of rows [lo, lo + L), in blocks of 8, 4, 2 and 1 SIMD batches of
  /// channels (fold_block), then the channels after the last whole batch one at a time.
  template <class Row>
  static void fold_rows(Row row, Index lo, Index L, Index d, Reference& ref) {
    constexpr Index W = simd::fbatch<simd::default_arch>::size;
    ref.low.resize(static_cast<std::size_t>(d));
    ref.high.resize(static_cast<std::size_t>(d));
    float* mn = ref.low.data();
    float* mx = ref.high.data();
    Index c = 0;
    for (; c + 8 * W <= d; c += 8 * W) fold_block<8>(row, lo, L, c, mn, mx);
    if (c + 4 * W <= d) fold_block<4>(row, lo, L, c, mn, mx), c += 4 * W;
    if (c + 2 * W <= d) fold_block<2>(row, lo, L, c, mn, mx), c += 2 * W;
    if (c + W <= d) fold_block<1>(row, lo, L, c, mn, mx), c += W;
    for (; c < d; ++c) {
      float low = to_real<float>(row(lo)[c]), high = low;
      for (Index i = lo + 1; i < lo + L; ++i) {
        const float e = to_real<float>(row(i)[c]);
        low = std::min(low, e);
        high = std::max(high, e);
      }
      mn[c] = low;
      mx[c] = high;
    }
  }

  /// spreads_double's σ_j in float SIMD arithmetic, for float, half and bfloat16 rows: the reference
  /// rows' per-channel min and max (exact; fold_rows), 1/(max − min) rounded to float, then per row the
  /// mean and the centred sum of squares of x̂ (two passes over the row, in L1). While the rows are
  /// scored, the rows the next call folds, [lo + 2L, lo + 3L) below `ahead_end`, are requested into L2
  /// (a hint), so that every row comes from memory once, spread over the scoring, and the fold and the
  /// scoring read from cache. Returns false, leaving the partition to spreads_double, when a
  /// reciprocal range is not a normal float or a σ_j is not finite (overflow, or a NaN/Inf entry).
  /// ref, inv and v are scratch (d).
  template <class Row>
  static bool spreads_float(Row row, Index lo, Index L, Index d, Index ahead_end, Reference& ref,
                            std::vector<float>& inv, std::vector<float>& v, std::vector<double>& s) {
    using A = simd::default_arch;
    using B = simd::fbatch<A>;
    constexpr Index W = B::size;
    fold_rows(row, lo + L, L, d, ref);
    inv.resize(static_cast<std::size_t>(d));
    v.resize(static_cast<std::size_t>(d));
    const float* mn = ref.low.data();
    const float* mx = ref.high.data();
    float* sc = inv.data();
    float* x = v.data();
    for (Index c = 0; c < d; ++c) {
      const double range = static_cast<double>(mx[c]) - static_cast<double>(mn[c]);
      if (range == 0.0) {
        sc[c] = 0.0f;  // a constant channel: x̂ = 0
        continue;
      }
      const double r = 1.0 / range;
      if (!(r >= static_cast<double>(std::numeric_limits<float>::min()) &&
            r <= static_cast<double>(std::numeric_limits<float>::max())))
        return false;  // NaN, or a range float cannot invert as a normal number
      sc[c] = static_cast<float>(r);
    }
    const auto request_ahead = [&](Index j) {  // the next call's reference, into L2
      if (lo + 2 * L + j < ahead_end) {
        const auto* a = row(lo + 2 * L + j);
        for (Index c = 0; c < d; c += Index(64 / sizeof(*a))) simd::prefetch_l2(a + c);
      }
    };
    if (d == 8 * W) {  // the same arithmetic with x̂, the minima and the reciprocal ranges in registers
      B low[8], inv_range[8];
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        low[b] = B::load_unaligned(mn + b * W);
        inv_range[b] = B::load_unaligned(sc + b * W);
      }
      for (Index j = 0; j < L; ++j) {
        request_ahead(j);
        const auto* r = row(lo + j);
        B e[8];
        B acc(0.0f);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          e[b] = (simd::load<A>(r + b * W) - low[b]) * inv_range[b];
          simd::pin_register<A>(e[b]);  // rounded, as stored: not fused into the sums below
          acc += e[b];
        }
        const float mean = simd::reduce_add<A>(acc) / static_cast<float>(d);
        const B m(mean);
        B sq(0.0f);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) sq = simd::fma(e[b] - m, e[b] - m, sq);
        const double sigma = std::sqrt(static_cast<double>(simd::reduce_add<A>(sq)) / static_cast<double>(d - 1));
        if (!std::isfinite(sigma)) return false;
        s[static_cast<std::size_t>(j)] = sigma;
      }
      return true;
    }
    for (Index j = 0; j < L; ++j) {
      request_ahead(j);
      const auto* r = row(lo + j);
      B acc(0.0f);
      float tail = 0.0f;
      Index c = 0;
      for (; c + W <= d; c += W) {
        const B e = (simd::load<A>(r + c) - B::load_unaligned(mn + c)) * B::load_unaligned(sc + c);
        e.store_unaligned(x + c);
        acc += e;
      }
      for (; c < d; ++c) tail += (x[c] = (to_real<float>(r[c]) - mn[c]) * sc[c]);
      double sigma = 0;
      if (d > 1) {
        const float mean = (simd::reduce_add<A>(acc) + tail) / static_cast<float>(d);
        const B m(mean);
        B sq(0.0f);
        float sq_tail = 0.0f;
        for (c = 0; c + W <= d; c += W) {
          const B e = B::load_unaligned(x + c) - m;
          sq = simd::fma(e, e, sq);
        }
        for (; c < d; ++c) sq_tail += (x[c] - mean) * (x[c] - mean);
        sigma = std::sqrt(static_cast<double>(simd::reduce_add<A>(sq) + sq_tail) / static_cast<double>(d - 1));
      }
      if (!std::isfinite(sigma)) return false;
      s[static_cast<std::size_t>(j)] = sigma;
    }
    return true;
  }

  /// Scratch of partition_softmax and of the ranking.
  struct Scratch {
    std::vector<double> shift, scale, x;
    std::vector<float> inv, v, e;
    Reference ref;
    std::vector<std::uint64_t> keys;
    std::vector<std::int32_t> bits, rank;
  };

  /// s (L) <- softmax over partition [lo, lo + L) of the spread of its rows min-max normalised by the
  /// rows [lo + L, lo + 2L): float SIMD arithmetic (spreads and exponentials) for float, half and
  /// bfloat16 rows, else double.
  template <class Row>
  static void partition_softmax(Row row, Index lo, Index L, Index d, Index ahead_end, Scratch& w,
                                std::vector<double>& s) {
    using E = std::remove_cv_t<std::remove_pointer_t<decltype(row(lo))>>;
    if constexpr (!std::is_same_v<E, double>) {
      if (spreads_float(row, lo, L, d, ahead_end, w.ref, w.inv, w.v, s)) {
        w.e.resize(static_cast<std::size_t>(L));
        float top = -std::numeric_limits<float>::infinity();
        for (Index j = 0; j < L; ++j) top = std::max(top, w.e[static_cast<std::size_t>(j)] = static_cast<float>(s[static_cast<std::size_t>(j)]));
        const float z = simd::exp_shift_sum<simd::default_arch>(w.e.data(), L, top);  // >= 1: the top's term
        for (Index j = 0; j < L; ++j) s[static_cast<std::size_t>(j)] = static_cast<double>(w.e[static_cast<std::size_t>(j)] / z);
        return;
      }
    }
    spreads_double(row, lo, L, d, w.shift, w.scale, w.x, s);
    double top = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < L; ++j) top = std::max(top, s[static_cast<std::size_t>(j)]);
    double z = 0;
    for (Index j = 0; j < L; ++j) z += (s[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] - top));
    for (Index j = 0; j < L; ++j) s[static_cast<std::size_t>(j)] /= z;
  }

  /// rank (L) <- the rank of score j among the partition's, ascending by the score rounded to float (−0
  /// as +0), ties by position. False, ranking nothing, when a score is NaN or negative or L does not
  /// fit 31 bits. Non-negative floats order as their bits: up to 16 vectors of scores (256 with
  /// AVX-512, 128 with AVX2), rank_j = #{i : b_i < b_j} + #{i < j : b_i = b_j} by vectorised
  /// comparisons (O(L²/width), cheaper than a sort up to that size); above, one integer sort of
  /// b · 2^32 + j.
  static bool rank_scores(const std::vector<double>& score, Index L, Scratch& w) {
    using IB = xsimd::batch<std::int32_t, simd::default_arch>;
    constexpr Index W = IB::size;
    if (L > Index(0x7FFFFFFF) - W) return false;
    const Index padded = (L + W - 1) / W * W;
    w.bits.resize(static_cast<std::size_t>(padded));
    w.rank.resize(static_cast<std::size_t>(L));
    for (Index j = 0; j < L; ++j) {
      const float f = static_cast<float>(score[static_cast<std::size_t>(j)]) + 0.0f;  // −0 → +0
      if (!(f >= 0.0f)) return false;
      std::memcpy(&w.bits[static_cast<std::size_t>(j)], &f, sizeof f);
    }
    std::int32_t* b = w.bits.data();
    if (L <= 16 * W) {
      for (Index i = L; i < padded; ++i) b[i] = std::numeric_limits<std::int32_t>::max();  // above every score
      // Lane masks by arithmetic (−1 where true; every difference fits 32 bits): b_i < b_j, b_i ≤ b_j, i < j.
      alignas(64) std::int32_t lane[W];
      for (Index k = 0; k < W; ++k) lane[k] = static_cast<std::int32_t>(k);
      const IB iota = IB::load_aligned(lane);
      for (Index j = 0; j < L; ++j) {
        const IB bj(b[j]), bj1(b[j] + 1), jj(static_cast<std::int32_t>(j));
        IB count(0);
        for (Index i = 0; i < padded; i += W) {
          const IB bi = IB::load_unaligned(b + i);
          const IB before = (iota + IB(static_cast<std::int32_t>(i)) - jj) >> 31;
          count -= ((bi - bj) >> 31) | (((bi - bj1) >> 31) & before);
        }
        w.rank[static_cast<std::size_t>(j)] = xsimd::hadd(count);
      }
      return true;
    }
    w.keys.resize(static_cast<std::size_t>(L));
    for (Index j = 0; j < L; ++j)
      w.keys[static_cast<std::size_t>(j)] = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(b[j])) << 32) |
                                            static_cast<std::uint64_t>(j);
    std::sort(w.keys.begin(), w.keys.end());
    for (Index r = 0; r < L; ++r)
      w.rank[static_cast<std::size_t>(w.keys[static_cast<std::size_t>(r)] & 0xFFFFFFFFu)] = static_cast<std::int32_t>(r);
    return true;
  }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const Index n = ctx.tokens(), d = ctx.head_dim(), S = std::min(args.sinks, n), L = args.lag;
    out.resize(n);
    if ((n - S) / 2 < L) {  // fewer than 2L tokens after the sinks (2L may overflow)
      for (Index j = 0; j < S; ++j) out[j] = Real(1);
      for (Index j = S; j < n; ++j) out[j] = static_cast<Real>(static_cast<double>(j - S) / static_cast<double>(n - S));
      return;
    }
    const Index q = (n - S) / L, t = S + (q - 1) * L;  // the tail T = [t, n)
    for (Index j = 0; j < S; ++j) out[j] = Real(2);
    for (Index j = t; j < n; ++j) out[j] = static_cast<Real>(1.0 + static_cast<double>(j - t) / static_cast<double>(n - t));
    Scratch scratch;
    std::vector<double> key_s(static_cast<std::size_t>(L)), value_s(static_cast<std::size_t>(L));
    std::vector<Index> order(static_cast<std::size_t>(L));
    for (Index p = 0; p + 1 < q; ++p) {
      const Index lo = S + p * L;
      partition_softmax([&](Index j) { return ctx.key(j); }, lo, L, d, n, scratch, key_s);
      partition_softmax([&](Index j) { return ctx.value(j); }, lo, L, d, n, scratch, value_s);
      for (Index j = 0; j < L; ++j) key_s[static_cast<std::size_t>(j)] = (key_s[static_cast<std::size_t>(j)] + value_s[static_cast<std::size_t>(j)]) / 2;
      if (!args.rank) {
        for (Index j = 0; j < L; ++j) out[lo + j] = static_cast<Real>(key_s[static_cast<std::size_t>(j)]);
        continue;
      }
      if constexpr (!std::is_same_v<T, double>) {
        if (rank_scores(key_s, L, scratch)) {  // the float path's scores, ranked as floats
          for (Index j = 0; j < L; ++j)
            out[lo + j] = static_cast<Real>(static_cast<double>(scratch.rank[static_cast<std::size_t>(j)]) / static_cast<double>(L));
          continue;
        }
      }
      std::iota(order.begin(), order.end(), Index(0));
      // Ascending score, ties (and NaN, placed first) by position: a strict weak order.
      std::sort(order.begin(), order.end(), [&](Index a, Index b) {
        const double sa = key_s[static_cast<std::size_t>(a)], sb = key_s[static_cast<std::size_t>(b)];
        const bool a_nan = sa != sa, b_nan = sb != sb;
        if (a_nan || b_nan) return a_nan == b_nan ? a < b : a_nan;
        return sa < sb || (sa == sb && a < b);
      });
      for (Index r = 0; r < L; ++r)
        out[lo + order[static_cast<std::size_t>(r)]] = static_cast<Real>(static_cast<double>(r) / static_cast<double>(L));
    }
  }
};

}  // namespace kvc
