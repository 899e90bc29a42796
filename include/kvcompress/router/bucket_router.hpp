// Routers (SPEC §6): send every evicted token of a KV head to one kept token.
#pragma once
#include "kvcompress/core.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE
#include "kvcompress/policy.hpp"
#include "kvcompress/router/no_route.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace kvc {

/// Statistic that picks the target among the candidates of an evicted token j.
enum class RouteStatistic {
  key_cosine,   ///< argmax_i cos(k_j, k_i) on the cached keys (default)
  window_mass,  ///< argmax_i a_g[i]
  co_attention  ///< argmax_i Σ_{rows r of group g} A[r][j]·A[r][i]
};

inline const char* to_string(RouteStatistic s) {
  return s == RouteStatistic::key_cosine ? "key_cosine"
         : s == RouteStatistic::window_mass ? "window_mass" : "co_attention";
}

namespace detail {

/// out[t][c] = <rows[c], y[t]> for `count` rows of element type T (pointers into the cache) and NY
/// rows y[t] (d) of type T, in float. Rows go in groups of G = fbatch<A>::size / NY (16 / NY on
/// AVX-512), one accumulator per (row, y) pair: S = G·NY independent FMA chains, each row's batch
/// loaded once for all y; simd::haddp reduces the accumulators into one batch (lane t·G + c holds
/// the sum of row c against y[t], computed from that pair alone, in the same order for every lane),
/// then the serial tail. A short last group is padded by repeating its last row. So every (row, y)
/// pair gets the same arithmetic whatever its place among the rows and whatever NY — equal rows give
/// bit-equal dots, which the router's tie rule depends on, and every NY gives NY = 1's values. The
/// router passes NY = 4 evicted tokens of a bucket at once with AVX-512 (BucketRouter::kGroup): a block
/// of 4 tokens × 4 candidates loads 8 batches per 16 FMAs and pads the candidates to a multiple of 4
/// only, where NY = 1 loads 17 per 16 and pads them to 16 (a default 32-token bucket at ratio 0.25 has
/// about 8). The loops over the group are unrolled by pragma, so the accumulators stay in registers
/// at -O2 as well.
template <class A, int NY, class T>
inline void dots_against_n(const T* const* rows, Index count, const T* const* y, Index d, float* const* out) {
  using B = simd::fbatch<A>;
  constexpr Index S = B::size, G = S / NY;
  static_assert(NY >= 1 && S % NY == 0, "NY must divide the lane count");
  const Index body = d - d % S;
  for (Index c0 = 0; c0 < count; c0 += G) {
    const T* x[G];
#pragma GCC unroll 16
    for (Index r = 0; r < G; ++r) x[r] = rows[std::min(c0 + r, count - 1)];
    B acc[S];
#pragma GCC unroll 16
    for (Index r = 0; r < S; ++r) acc[r] = B(0.0f);
    for (Index k = 0; k < body; k += S) {
      B yv[NY];
#pragma GCC unroll 16
      for (int t = 0; t < NY; ++t) yv[t] = simd::load<A>(y[t] + k);
#pragma GCC unroll 16
      for (Index r = 0; r < G; ++r) {
        const B xr = simd::load<A>(x[r] + k);
#pragma GCC unroll 16
        for (int t = 0; t < NY; ++t) acc[t * G + r] = simd::fma(xr, yv[t], acc[t * G + r]);
      }
    }
    alignas(64) float sums[S];
    simd::haddp<A>(acc).store_aligned(sums);
    const Index live = std::min(G, count - c0);
    for (int t = 0; t < NY; ++t)
      for (Index r = 0; r < live; ++r) {
        float s = sums[t * G + r];
        for (Index k = body; k < d; ++k) s += simd::to_float(x[r][k]) * simd::to_float(y[t][k]);
        out[t][c0 + r] = s;
      }
  }
}

/// <x, y> of two rows of element type T in Real (the serial loop used for double arithmetic).
template <class Real, class T>
Real dot_serial(const T* x, const T* y, Index d) {
  Real s = 0;
  for (Index k = 0; k < d; ++k) s += to_real<Real>(x[k]) * to_real<Real>(y[k]);
  return s;
}

}  // namespace detail

/// Positional-bucket router. Candidates for evicted j are the kept tokens in j's bucket
/// [b·B, (b+1)·B); when the bucket has none, the nearest kept position (ties to the earlier one).
/// `bucket = 0` routes over all kept tokens (the Global option). Ties go to the lower position.
template <Index DefaultBucket = 32, RouteStatistic DefaultStatistic = RouteStatistic::key_cosine>
struct BucketRouter {
  struct Arguments {
    Index bucket = DefaultBucket;  ///< B; 0 = Global
    RouteStatistic statistic = DefaultStatistic;
  };
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;  // window_mass reads a; harmless otherwise
    static constexpr bool fills_keys = true;  // route(ctx, routing, kept_keys) also writes the kept keys
  };
  Arguments args;

  /// How far (in positions) key rows are requested ahead of the sweep.
  static constexpr Index kPrefetchRows = 32;
  /// Evicted tokens whose key_cosine dots are computed together (float): 4 tokens × 4 candidates per
  /// register block with 16-lane batches (8 loads per 16 FMAs, whatever the candidate count); 2 tokens
  /// × 4 candidates with 8-lane batches, 2 × 2 with 4-lane ones.
  static constexpr int kGroup = simd::fbatch<simd::default_arch>::size >= 16 ? 4 : 2;

  Status validate() const {
    if (args.bucket < 0)
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("router.bucket must be >= 0 (0 = global), got ", args.bucket));
    if (args.statistic != RouteStatistic::key_cosine && args.statistic != RouteStatistic::window_mass &&
        args.statistic != RouteStatistic::co_attention)
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("router.statistic must be key_cosine, window_mass or co_attention, got ",
                                         static_cast<int>(args.statistic)));
    return Status::ok();
  }

  /// Fills routing.target (n − m) with indices into ctx.kept().
  /// One sweep over the evicted tokens (ascending) with the bucket's candidate range [lo, hi) of
  /// ctx.kept() advanced alongside (no search). key_cosine ranks candidates by <k_i, k_j> / ‖k_i‖
  /// (∝ cosine: ‖k_j‖ is common to all of them; a zero-norm candidate scores 0), with ‖k_i‖
  /// computed once per kept token and the keys read in place from the cache (routing copies none).
  /// window_mass picks its argmax once per bucket. Extra memory O(B) (O(m) for Global).
  /// Cost: O((n − m)·c·d) for key_cosine with c candidates per token; co_attention first computes
  /// the head's window probabilities (one G·W × d × n product) and costs O((n − m)·c·G·W).
  template <class T>
  void route(const HeadContext<T>& ctx, Routing& routing) const {
    route_impl(ctx, routing, static_cast<RowMatrix<compute_t<T>>*>(nullptr));
  }

  /// The same routing, and kept_keys <- the kept tokens' keys (m, d), converted: each is copied as
  /// the sweep passes its position, while the sweep has it in cache (a candidate's row has just been
  /// read), so the pipeline needs no separate pass over the kept keys. kept_keys is resized to (m, d)
  /// when its shape differs; its previous contents do not matter. With ctx.streaming_stores(), float keys
  /// are written with streaming stores where kept_keys' rows are aligned for them (the pipeline asks
  /// for it when nothing after the router reads the kept keys and the result is too large to stay in
  /// cache): the same values, without reading kept_keys' memory first or keeping it in cache.
  template <class T>
  void route(const HeadContext<T>& ctx, Routing& routing, RowMatrix<compute_t<T>>& kept_keys) const {
    const Index m = static_cast<Index>(ctx.kept().size());
    if (kept_keys.rows() != m || kept_keys.cols() != ctx.head_dim()) kept_keys.resize(m, ctx.head_dim());
    route_impl(ctx, routing, &kept_keys, ctx.streaming_stores());
  }

 private:
  template <class T>
  void route_impl(const HeadContext<T>& ctx, Routing& routing, RowMatrix<compute_t<T>>* kept_keys,
                  bool streaming = false) const {
    using Real = compute_t<T>;
    routing.target.assign(ctx.evicted().size(), -1);
    if (kept_keys == nullptr) {
      route_sweep(ctx, routing, [](Index) {});
      return;
    }
    detail::KeptRowWriter<T, Real> writer(ctx.layer().keys, ctx.head(), ctx.kept(), *kept_keys, streaming);
    route_sweep(ctx, routing, [&](Index end) { writer.copy_before(end); });
    writer.copy_rest();
    writer.finish();
  }

  /// The sweep of route(). At each evicted token j (ascending) it calls passed(end): the sweep has
  /// gone past every position below `end` (the end of j's bucket; j itself for Global). With
  /// key_cosine and buckets, the kept keys there are in cache (the bucket's candidates were just
  /// loaded, the rest prefetched); KeptRowWriter prefetches its own rows a few ahead otherwise.
  template <class T, class Passed>
  void route_sweep(const HeadContext<T>& ctx, Routing& routing, Passed&& passed) const {
    using Real = compute_t<T>;
    const auto& kept = ctx.kept();
    const auto& evicted = ctx.evicted();
    const Index m = static_cast<Index>(kept.size()), d = ctx.head_dim();
    // A bucket of n or more tokens holds every position, as one of n does: clamped, so that j + B and
    // the bucket ends below cannot overflow (any bucket >= 0 is valid).
    const Index B = std::min(args.bucket, ctx.tokens());
    if (evicted.empty() || m == 0) return;

    const RouteStatistic stat = args.statistic;
    const RowMatrix<Real>* probs = stat == RouteStatistic::co_attention ? &ctx.probabilities() : nullptr;

    // Candidate range [lo, hi) of the current bucket, and per-candidate data for it (index c − lo),
    // in the Routing's scratch (kept across calls).
    Index lo = 0, hi = B > 0 ? 0 : m, bucket_start = -1;
    std::vector<const T*>& cand_key = routing.scratch->rows_of<T>();  // key rows in the cache
    std::vector<Real>& inv_norm = routing.scratch->reals_of<Real>();  // 1 / ‖k_i‖, 0 for a zero-norm key
    // float: the dots of evicted indices [group_first, group_end) against the candidates, (kGroup, c)
    std::vector<float>& dots = routing.scratch->dots;
    std::size_t group_first = 0, group_end = 0;
    Index mass_best = -1;            // window_mass: the bucket's argmax (independent of j)
    auto load_candidates = [&] {
      mass_best = -1;
      if (hi - lo < 2) return;
      if (stat == RouteStatistic::key_cosine) {
        cand_key.resize(static_cast<std::size_t>(hi - lo));
        inv_norm.resize(static_cast<std::size_t>(hi - lo));
        dots.resize(static_cast<std::size_t>(kGroup * (hi - lo)));
        group_first = group_end = 0;  // none computed against these candidates
        for (Index i = lo; i < hi; ++i) {
          const T* k = ctx.key(kept[static_cast<std::size_t>(i)]);
          const Real nrm = detail::row_norm<Real>(k, d);
          cand_key[static_cast<std::size_t>(i - lo)] = k;
          inv_norm[static_cast<std::size_t>(i - lo)] = nrm > Real(0) ? Real(1) / nrm : Real(0);
        }
      } else if (stat == RouteStatistic::window_mass) {
        const auto& a = ctx.mass();
        mass_best = lo;
        for (Index i = lo + 1; i < hi; ++i)
          if (a[kept[static_cast<std::size_t>(i)]] > a[kept[static_cast<std::size_t>(mass_best)]]) mass_best = i;
      }
    };
    // key_cosine reads the head's keys roughly by position: request them ahead of the sweep.
    detail::RowPrefetcher<T> prefetch(ctx.layer().keys, ctx.head(), kPrefetchRows);
    const bool read_keys = stat == RouteStatistic::key_cosine;
    if (B == 0) load_candidates();

    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const Index j = evicted[e];
      if (read_keys) prefetch.advance_to(j + B);  // past the end of j's bucket, whose kept keys it reads
      if (B > 0) {
        const Index b0 = (j / B) * B;
        if (b0 != bucket_start) {  // entering a new bucket: advance [lo, hi) (both only move forward)
          bucket_start = b0;
          lo = hi;
          while (lo < m && kept[static_cast<std::size_t>(lo)] < b0) ++lo;
          hi = lo;
          while (hi < m && kept[static_cast<std::size_t>(hi)] < b0 + B) ++hi;
          load_candidates();
        }
        passed(b0 + B);
        if (lo == hi) {  // empty bucket: nearest kept position, ties to the earlier one
          // kept[lo − 1] < b0 <= j < b0 + B <= kept[lo]: the neighbours of j are lo − 1 and lo.
          Index pick;
          if (lo == 0) pick = 0;
          else if (lo == m) pick = m - 1;
          else pick = (j - kept[static_cast<std::size_t>(lo - 1)] <= kept[static_cast<std::size_t>(lo)] - j) ? lo - 1 : lo;
          routing.target[e] = pick;
          continue;
        }
      }
      if (B == 0) passed(j);
      if (hi - lo == 1) {
        routing.target[e] = lo;
        continue;
      }
      Index best = lo;
      switch (stat) {
        case RouteStatistic::key_cosine: {
          const Index c = hi - lo;
          Real best_stat;
          if constexpr (std::is_same_v<Real, float>) {
            // kGroup evicted tokens of the same bucket at once (dots_against_n<kGroup>; a short last
            // group repeats its last token). Bit-equal dots for any grouping, so the same routing.
            if (e < group_first || e >= group_end) {
              group_first = e;
              group_end = e + 1;
              while (group_end < evicted.size() && group_end - e < std::size_t(kGroup) &&
                     (B == 0 || evicted[group_end] < bucket_start + B))
                ++group_end;
              const T* ys[kGroup];
              float* outs[kGroup];
              for (int t = 0; t < kGroup; ++t) {
                ys[t] = ctx.key(evicted[std::min(e + std::size_t(t), group_end - 1)]);
                outs[t] = dots.data() + t * c;
              }
              detail::dots_against_n<simd::default_arch, kGroup>(cand_key.data(), c, ys, d, outs);
            }
            const float* row = dots.data() + (e - group_first) * static_cast<std::size_t>(c);
            best_stat = row[0] * inv_norm[0];
            for (Index i = 1; i < c; ++i) {
              const Real s = row[i] * inv_norm[static_cast<std::size_t>(i)];
              if (s > best_stat) {
                best_stat = s;
                best = lo + i;
              }
            }
          } else {
            const T* kj = ctx.key(j);
            best_stat = detail::dot_serial<Real>(cand_key[0], kj, d) * inv_norm[0];
            for (Index i = 1; i < c; ++i) {
              const Real s = detail::dot_serial<Real>(cand_key[static_cast<std::size_t>(i)], kj, d) *
                             inv_norm[static_cast<std::size_t>(i)];
              if (s > best_stat) {
                best_stat = s;
                best = lo + i;
              }
            }
          }
          break;
        }
        case RouteStatistic::window_mass:
          best = mass_best;
          break;
        case RouteStatistic::co_attention: {
          Real best_stat = probs->col(j).dot(probs->col(kept[static_cast<std::size_t>(lo)]));
          for (Index i = lo + 1; i < hi; ++i) {
            const Real s = probs->col(j).dot(probs->col(kept[static_cast<std::size_t>(i)]));
            if (s > best_stat) {
              best_stat = s;
              best = i;
            }
          }
          break;
        }
      }
      routing.target[e] = best;
    }
  }
};

}  // namespace kvc
