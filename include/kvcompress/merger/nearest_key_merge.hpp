// NearestKeyMerge: each evicted value folded into its routed kept token, weighted by key cosine and value norms (kvpress MergingPress).
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvc {

/// The merge of kvpress's MergingPress, after any eviction. With the routing's target t = π(e) of
/// evicted token e (BucketRouter<0>: the kept token of largest key cosine, ties to the lower position),
///   w_e = max(cos(k_e, k_t), 0) · ‖v_e‖ / (‖v_e‖ + ‖v_t‖)        (0 when cos(k_e, k_t) < threshold)
///   ṽ_t = (v_t + Σ_{π(e)=t} w_e·v_e) / (1 + Σ_{π(e)=t} w_e)
/// with the targets' original values v_t; keys are unchanged. A zero-norm key has cosine 0, so w_e = 0;
/// w_e = 0 when ‖v_e‖ = 0 (also covers ‖v_e‖ + ‖v_t‖ = 0), and when a sum of squares overflows
/// (double caches with entries above ~1e154). So every w_e is finite, in [0, 1]; gate = w_e. A row that
/// receives no positive weight is bit-identical to the kept value.
/// The weights are computed in double from the cache, the values accumulated in Real in ascending e.
/// Cost O((n − m)·d), extra memory O(m) (in out.scratch).
struct NearestKeyMerge {
  struct Arguments {
    double threshold = 0.0;  ///< the smallest key cosine that merges, in [0, 1] (kvpress: similarity_threshold)
  };
  struct traits : PolicyTraits {
    static constexpr bool needs_routing = true;
    static constexpr bool reads_kept_keys = false;  // keys are read from the cache
  };
  Arguments args;

  Status validate(Index /*n*/, Index /*m*/) const {
    if (!(args.threshold >= 0.0 && args.threshold <= 1.0))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("merger.threshold must be in [0, 1], got ", args.threshold));
    return Status::ok();
  }

  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing& routing, MergeOutput<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const auto& kept = ctx.kept();
    const auto& evicted = ctx.evicted();
    const Index m = static_cast<Index>(kept.size()), d = ctx.head_dim();
    out.gate.setZero(static_cast<Index>(evicted.size()));
    KVC_ASSERT(routing.target.size() == evicted.size());
    Vector<Real>& added = out.scratch->added;  // Σ w_e per kept entry
    added.setZero(m);
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const Index i = routing.target[e];
      const T* ke = ctx.key(evicted[e]);
      const T* kt = ctx.key(kept[static_cast<std::size_t>(i)]);
      const T* ve = ctx.value(evicted[e]);
      const T* vt = ctx.value(kept[static_cast<std::size_t>(i)]);
      double kk = 0, ee = 0, tt = 0, vv = 0, ww = 0;  // <k_e,k_t>, ‖k_e‖², ‖k_t‖², ‖v_e‖², ‖v_t‖²
      for (Index c = 0; c < d; ++c) {
        const double a = to_real<double>(ke[c]), b = to_real<double>(kt[c]);
        const double x = to_real<double>(ve[c]), y = to_real<double>(vt[c]);
        kk += a * b;
        ee += a * a;
        tt += b * b;
        vv += x * x;
        ww += y * y;
      }
      // cos rounded to at most 1; NaN (sums that overflow) fails every comparison below: w = 0.
      const double cos = (ee > 0.0 && tt > 0.0) ? std::min(kk / (std::sqrt(ee) * std::sqrt(tt)), 1.0) : 0.0;
      const double ne = std::sqrt(vv), nt = std::sqrt(ww);
      double w = cos >= args.threshold && cos > 0.0 && ne > 0.0 ? cos * ne / (ne + nt) : 0.0;
      if (!(w > 0.0)) w = 0.0;
      const Real wr = static_cast<Real>(w);
      out.gate[static_cast<Index>(e)] = wr;
      if (!(wr > Real(0))) continue;
      added[i] += wr;
      Real* row = out.values.row(i).data();
      for (Index c = 0; c < d; ++c) row[c] += wr * to_real<Real>(ve[c]);
    }
    for (Index i = 0; i < m; ++i)
      if (added[i] > Real(0)) out.values.row(i) /= Real(1) + added[i];
  }
};

}  // namespace kvc
