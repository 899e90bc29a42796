// Routers (SPEC §6): send every evicted token of a KV head to one kept token.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/core.hpp"
#include "kvcompress/detail/rows.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/router/no_route.hpp"

#include <algorithm>
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

/// Positional-bucket router. Candidates for evicted j are the kept tokens in j's bucket
/// [b·B, (b+1)·B); when the bucket has none, the nearest kept position (ties to the earlier one).
/// `bucket = 0` routes over all kept tokens (the Global option). Ties go to the lower position.
template <Index DefaultBucket = 32, RouteStatistic DefaultStatistic = RouteStatistic::key_cosine>
struct BucketRouter {
  struct Arguments {
    Index bucket = DefaultBucket;  ///< B; 0 = Global
    RouteStatistic statistic = DefaultStatistic;
  };
  static constexpr bool needs_mass = true;  // window_mass reads a; harmless otherwise
  Arguments args;

  Status validate() const {
    if (args.bucket < 0)
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("router.bucket must be >= 0 (0 = global), got ", args.bucket));
    return Status::ok();
  }

  /// Fills routing.target (n − m) with indices into ctx.kept().
  /// Cost: O((n − m)·c·d) for key_cosine with c candidates per token; co_attention first computes
  /// the head's window probabilities (one G·W × d × n product).
  template <class T>
  void route(const HeadContext<T>& ctx, Routing& routing) const {
    using Real = compute_t<T>;
    const auto& kept = ctx.kept();
    const auto& evicted = ctx.evicted();
    const Index m = static_cast<Index>(kept.size()), d = ctx.head_dim();
    routing.target.assign(evicted.size(), -1);
    if (evicted.empty() || m == 0) return;

    // Unit-normalised kept keys (m, d) for key_cosine; zero-norm rows stay zero (cosine 0).
    RowMatrix<Real> unit_kept;
    const RowMatrix<Real>* probs = nullptr;
    if (args.statistic == RouteStatistic::key_cosine) {
      unit_kept.resize(m, d);
      detail::gather_positions<Real>(ctx.layer().keys, ctx.head(), kept, unit_kept);
      for (Index i = 0; i < m; ++i) {
        const Real nrm = unit_kept.row(i).norm();
        if (nrm > Real(0)) unit_kept.row(i) /= nrm;
      }
    } else if (args.statistic == RouteStatistic::co_attention) {
      probs = &ctx.probabilities();
    }

    Vector<Real> kj(d);
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const Index j = evicted[e];
      // Candidate range [lo, hi) of indices into kept.
      Index lo = 0, hi = m;
      if (args.bucket > 0) {
        const Index b0 = (j / args.bucket) * args.bucket, b1 = b0 + args.bucket;
        lo = std::lower_bound(kept.begin(), kept.end(), b0) - kept.begin();
        hi = std::lower_bound(kept.begin(), kept.end(), b1) - kept.begin();
        if (lo == hi) {  // empty bucket: nearest kept position, ties to the earlier one
          const Index after = std::lower_bound(kept.begin(), kept.end(), j) - kept.begin();
          Index pick;
          if (after == 0) pick = 0;
          else if (after == m) pick = m - 1;
          else pick = (j - kept[after - 1] <= kept[after] - j) ? after - 1 : after;
          routing.target[e] = pick;
          continue;
        }
      }
      if (hi - lo == 1) {
        routing.target[e] = lo;
        continue;
      }
      if (args.statistic == RouteStatistic::key_cosine) {
        const T* k = ctx.key(j);
        for (Index c = 0; c < d; ++c) kj[c] = to_real<Real>(k[c]);
      }
      Index best = lo;
      Real best_stat = statistic(ctx, probs, unit_kept, kj, j, lo);
      for (Index i = lo + 1; i < hi; ++i) {
        const Real s = statistic(ctx, probs, unit_kept, kj, j, i);
        if (s > best_stat) {
          best_stat = s;
          best = i;
        }
      }
      routing.target[e] = best;
    }
  }

 private:
  template <class T, class Real>
  Real statistic(const HeadContext<T>& ctx, const RowMatrix<Real>* probs,
                 const RowMatrix<Real>& unit_kept, const Vector<Real>& kj, Index j, Index i) const {
    switch (args.statistic) {
      case RouteStatistic::key_cosine:
        return unit_kept.row(i).dot(kj.transpose());  // ∝ cosine: ‖k_j‖ is common to all candidates
      case RouteStatistic::window_mass:
        return ctx.mass()[ctx.kept()[i]];
      case RouteStatistic::co_attention:
        return probs->col(j).dot(probs->col(ctx.kept()[i]));
    }
    return Real(0);
  }
};

}  // namespace kvc
