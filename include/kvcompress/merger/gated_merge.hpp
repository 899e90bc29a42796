// Mergers that pour evicted tokens into their routed kept token (SPEC §7): Drop, MergeAll, SoftGate.
#pragma once
#include "kvcompress/core.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE
#include "kvcompress/policy.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvc {

namespace detail {

/// τ = 1e-12 · max_j a_g[j]: the floor on a kept token's own mass (SPEC §7, §8).
template <class Real>
Real mass_floor(const Vector<Real>& mass) {
  return mass.size() > 0 ? static_cast<Real>(1e-12) * mass.maxCoeff() : Real(0);
}

/// cos(x, y) with 0 for a zero-norm vector.
template <class Real, class T>
Real cosine(const T* x, const T* y, Index d) {
  if constexpr (std::is_same_v<Real, float> && !std::is_same_v<T, double>)
    return simd::cosine<simd::default_arch>(x, y, d);
  Real xy = 0, xx = 0, yy = 0;
  for (Index k = 0; k < d; ++k) {
    const Real a = to_real<Real>(x[k]), b = to_real<Real>(y[k]);
    xy += a * b;
    xx += a * a;
    yy += b * b;
  }
  if (xx <= Real(0) || yy <= Real(0)) return Real(0);
  return xy / (std::sqrt(xx) * std::sqrt(yy));
}

/// For four pairs (x_r, y_r) at once, the parts of cos(x_r, y_r) that depend on x_r: <x_r, y_r> and
/// Σ x_r,k², each pair with exactly the arithmetic of simd::cosine (one accumulator each over whole
/// batches, horizontal sum, serial tail); the four pairs only interleave (eight independent FMA
/// chains instead of two). Combined with Σ y_k² from `sum_squares_like_cosine` as xy / (√xx·√yy) they
/// reproduce simd::cosine bit for bit, while Σ y_k² of a kept row is computed once instead of once per
/// evicted token routed to it.
template <class A, class T>
inline void dot_and_sum_squares4(const T* const* x, const T* const* y, Index d, float* xy_out, float* xx_out) {
  using B = simd::fbatch<A>;
  constexpr Index S = B::size;
  B xy[4], xx[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) xy[r] = xx[r] = B(0.0f);
  Index k = 0;
  for (; k + S <= d; k += S)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const B a = simd::load<A>(x[r] + k), b = simd::load<A>(y[r] + k);
      xy[r] = simd::fma(a, b, xy[r]);
      xx[r] = simd::fma(a, a, xx[r]);
    }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    float sxy = simd::reduce_add<A>(xy[r]), sxx = simd::reduce_add<A>(xx[r]);
    for (Index t = k; t < d; ++t) {
      const float a = simd::to_float(x[r][t]), b = simd::to_float(y[r][t]);
      sxy += a * b;
      sxx += a * a;
    }
    xy_out[r] = sxy;
    xx_out[r] = sxx;
  }
}

/// Σ y_k² with the arithmetic simd::cosine uses for its second argument.
template <class A, class T>
inline float sum_squares_like_cosine(const T* y, Index d) {
  using B = simd::fbatch<A>;
  constexpr Index S = B::size;
  B yy(0.0f);
  Index k = 0;
  for (; k + S <= d; k += S) {
    const B b = simd::load<A>(y + k);
    yy = simd::fma(b, b, yy);
  }
  float s = simd::reduce_add<A>(yy);
  for (; k < d; ++k) {
    const float b = simd::to_float(y[k]);
    s += b * b;
  }
  return s;
}

/// Tag types for the gate of GatedMerge.
struct UnitGate {};    // g = 1
struct CosineGate {};  // g = max(cos(v_j, v_π(j)), 0)

}  // namespace detail

/// Weighted merge of routed evicted tokens into kept values (SelKV Eq. 4–5):
///   ṽ_i = (max(a_i,τ)·v_i + Σ_{π(j)=i} g_j·a_j·v_j) / (max(a_i,τ) + Σ_{π(j)=i} g_j·a_j)
/// Keys are unchanged. Rows that receive nothing are bit-identical copies of the kept values.
/// traits::fills_values: out.values may hold anything on entry (it is resized to (m, d) when its shape
/// differs); every row is written from the cache.
/// One sweep over the evicted tokens (ascending j) in blocks of four: the block's gates first (they
/// read only the cache: g is computed against the target's original value, whose Σ v_i² is computed
/// once), then its contributions, accumulated in place in out.values: a row becomes max(a_i,τ)·v_i
/// (v_i read from the cache; the cosine gate has just read it) at its first contribution of
/// positive weight, g_j·a_j·v_j is added in ascending j, and the row is divided by its denominator
/// right after its last contribution (while it is still in cache); a row whose contributions all
/// have weight 0 is copied from the cache at its last one. A kept row that is routed nothing is
/// copied from the cache when the sweep passes its position (its cache row is being prefetched
/// then). So the pipeline has no separate pass over the kept values. Value rows are prefetched
/// ahead of the sweep.
/// Deterministic: the order of every sum is fixed by the routing. Cost O(n·d), extra memory O(m) (no
/// (m, d) temporary), kept in out.scratch.
template <class Gate>
struct GatedMerge {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;
    static constexpr bool needs_routing = true;
    static constexpr bool fills_values = true;
    static constexpr bool reads_kept_keys = false;
  };
  Arguments args;

  /// How far (in positions) value rows are requested ahead of the sweep.
  static constexpr Index kPrefetchRows = 32;

  Status validate(Index /*n*/, Index /*m*/) const { return Status::ok(); }

  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing& routing, MergeOutput<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    constexpr bool simd_float = std::is_same_v<Real, float>;
    constexpr bool cosine_gate = std::is_same_v<Gate, detail::CosineGate>;
    const auto& kept = ctx.kept();
    const auto& evicted = ctx.evicted();
    const auto& a = ctx.mass();
    const Index m = static_cast<Index>(kept.size()), d = ctx.head_dim();
    const Real tau = detail::mass_floor(a);
    out.gate.setZero(static_cast<Index>(evicted.size()));
    if (out.values.rows() != m || out.values.cols() != d) out.values.resize(m, d);
    KVC_ASSERT(routing.target.size() == evicted.size());
    KVC_ASSERT(m > 0 || evicted.empty());  // evicted tokens need a kept token to go to
    detail::KeptRowWriter<T, Real> writer(ctx.layer().values, ctx.head(), kept, out.values);

    // last[i]: the last evicted index e routed to kept entry i (−1: none).
    std::vector<Index>& last = out.scratch->last;
    last.assign(static_cast<std::size_t>(m), Index(-1));
    for (std::size_t e = 0; e < evicted.size(); ++e) last[static_cast<std::size_t>(routing.target[e])] = Index(e);
    const auto unrouted = [&](Index i) { return last[static_cast<std::size_t>(i)] < 0; };

    Vector<Real>& added = out.scratch->added;          // Σ g_j·a_j per kept entry
    added.setZero(m);
    Vector<Real>& target_ss = out.scratch->target_ss;  // CosineGate: Σ v_i² of each target (−1 = not yet)
    if constexpr (cosine_gate) target_ss.setConstant(m, Real(-1));
    detail::RowPrefetcher<T> prefetch(ctx.layer().values, ctx.head(), kPrefetchRows);
    const std::size_t E = evicted.size();
    for (std::size_t e0 = 0; e0 < E; e0 += 4) {
      // Gates of evicted e0 .. e0+3 (they read only the cache, never out.values) ...
      const std::size_t nb = std::min<std::size_t>(4, E - e0);
      prefetch.advance_to(evicted[e0 + nb - 1]);
      writer.copy_before(evicted[e0 + nb - 1], unrouted);  // kept rows that receive nothing
      Real g[4] = {Real(1), Real(1), Real(1), Real(1)};
      if constexpr (cosine_gate) {
        const T* vj[4];
        const T* vi[4];
        for (std::size_t r = 0; r < 4; ++r) {
          const std::size_t e = e0 + std::min(r, nb - 1);  // a short last block repeats its last pair
          const Index i = routing.target[e];
          vj[r] = ctx.value(evicted[e]);
          vi[r] = ctx.value(kept[static_cast<std::size_t>(i)]);
          if constexpr (simd_float)
            if (target_ss[i] < Real(0)) target_ss[i] = detail::sum_squares_like_cosine<simd::default_arch>(vi[r], d);
        }
        if constexpr (simd_float) {
          float sxy[4], sxx[4];
          detail::dot_and_sum_squares4<simd::default_arch>(vj, vi, d, sxy, sxx);
          for (std::size_t r = 0; r < nb; ++r) {
            const float syy = target_ss[routing.target[e0 + r]];
            const float c = (sxx[r] <= 0.0f || syy <= 0.0f) ? 0.0f : sxy[r] / (std::sqrt(sxx[r]) * std::sqrt(syy));
            g[r] = c > 0.0f ? c : 0.0f;  // max(c, 0), and 0 where c is NaN (sums that overflow)
          }
        } else {
          for (std::size_t r = 0; r < nb; ++r) {
            const Real c = detail::cosine<Real>(vj[r], vi[r], d);
            g[r] = c > Real(0) ? c : Real(0);  // as above
          }
        }
      }
      // ... then their contributions, in ascending j.
      for (std::size_t r = 0; r < nb; ++r) {
        const std::size_t e = e0 + r;
        const Index j = evicted[e], i = routing.target[e];
        out.gate[static_cast<Index>(e)] = g[r];
        const Real w = g[r] * a[j];
        Real* row = out.values.row(i).data();
        if (w > Real(0)) {
          if (added[i] <= Real(0)) {  // first contribution: the row becomes max(a_i,τ)·v_i
            const Real own = std::max(a[kept[static_cast<std::size_t>(i)]], tau);
            const T* vi = ctx.value(kept[static_cast<std::size_t>(i)]);
            if constexpr (simd_float) simd::scale_into<simd::default_arch>(vi, own, row, d);
            else for (Index k = 0; k < d; ++k) row[k] = to_real<Real>(vi[k]) * own;
          }
          added[i] += w;
          const T* vj = ctx.value(j);
          if constexpr (simd_float)
            simd::axpy<simd::default_arch>(w, vj, row, d);
          else
            for (Index k = 0; k < d; ++k) row[k] += w * to_real<Real>(vj[k]);
        }
        if (last[static_cast<std::size_t>(i)] == Index(e)) {  // row i is complete
          if (added[i] > Real(0)) {
            const Real den = std::max(a[kept[static_cast<std::size_t>(i)]], tau) + added[i];
            if constexpr (simd_float) simd::divide<simd::default_arch>(row, den, d);
            else for (Index k = 0; k < d; ++k) row[k] /= den;
          } else {
            writer.copy(i);  // routed to, but every contribution had weight 0
          }
        }
      }
    }
    writer.copy_before(std::numeric_limits<Index>::max(), unrouted);
  }
};

/// Merge every evicted token fully (g = 1).
using MergeAll = GatedMerge<detail::UnitGate>;
/// SelKV soft cosine gate g = max(cos(v_j, v_π(j)), 0) against the target's original value.
using SoftGate = GatedMerge<detail::CosineGate>;

/// Pure eviction: evicted tokens vanish (gate 0). The no-op merger.
struct Drop {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool keeps_values = true;
    static constexpr bool reads_kept_keys = false;
    static constexpr bool reads_kept_values = false;
  };
  Arguments args;
  Status validate(Index, Index) const { return Status::ok(); }
  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing&, MergeOutput<compute_t<T>>& out) const {
    out.gate.setZero(static_cast<Index>(ctx.evicted().size()));
  }
};

}  // namespace kvc
