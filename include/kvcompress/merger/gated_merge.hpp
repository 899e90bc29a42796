// Mergers that pour evicted tokens into their routed kept token (SPEC §7): Drop, MergeAll, SoftGate.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
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

/// Tag types for the gate of GatedMerge.
struct UnitGate {};    // g = 1
struct CosineGate {};  // g = max(cos(v_j, v_π(j)), 0)

}  // namespace detail

/// Weighted merge of routed evicted tokens into kept values (SelKV Eq. 4–5):
///   ṽ_i = (max(a_i,τ)·v_i + Σ_{π(j)=i} g_j·a_j·v_j) / (max(a_i,τ) + Σ_{π(j)=i} g_j·a_j)
/// Keys are unchanged. Rows that receive nothing stay bit-identical. Cost O((n − m)·d).
template <class Gate>
struct GatedMerge {
  struct Arguments {};
  static constexpr bool needs_mass = true;
  static constexpr bool needs_routing = true;
  Arguments args;

  Status validate(Index /*n*/, Index /*m*/) const { return Status::ok(); }

  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing& routing, MergeOutput<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const auto& kept = ctx.kept();
    const auto& evicted = ctx.evicted();
    const auto& a = ctx.mass();
    const Index m = static_cast<Index>(kept.size()), d = ctx.head_dim();
    const Real tau = detail::mass_floor(a);
    out.gate.setZero(static_cast<Index>(evicted.size()));
    if (evicted.empty()) return;
    KVC_ASSERT(routing.target.size() == evicted.size());

    Vector<Real> added = Vector<Real>::Zero(m);  // Σ g_j·a_j per kept entry
    RowMatrix<Real> num = RowMatrix<Real>::Zero(m, d);
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const Index j = evicted[e], i = routing.target[e];
      Real g;
      if constexpr (std::is_same_v<Gate, detail::CosineGate>)
        g = std::max(detail::cosine<Real>(ctx.value(j), ctx.value(kept[i]), d), Real(0));
      else
        g = Real(1);
      out.gate[static_cast<Index>(e)] = g;
      const Real w = g * a[j];
      if (w <= Real(0)) continue;
      added[i] += w;
      const T* vj = ctx.value(j);
      if constexpr (std::is_same_v<Real, float>)
        simd::axpy<simd::default_arch>(w, vj, num.row(i).data(), d);
      else
        for (Index k = 0; k < d; ++k) num(i, k) += w * to_real<Real>(vj[k]);
    }
    for (Index i = 0; i < m; ++i) {
      if (added[i] <= Real(0)) continue;
      const Real own = std::max(a[kept[i]], tau);
      out.values.row(i) = (own * out.values.row(i) + num.row(i)) / (own + added[i]);
    }
  }
};

/// Merge every evicted token fully (g = 1).
using MergeAll = GatedMerge<detail::UnitGate>;
/// SelKV soft cosine gate g = max(cos(v_j, v_π(j)), 0) against the target's original value.
using SoftGate = GatedMerge<detail::CosineGate>;

/// Pure eviction: evicted tokens vanish (gate 0). The no-op merger.
struct Drop {
  struct Arguments {};
  static constexpr bool needs_mass = false;
  static constexpr bool needs_routing = false;
  Arguments args;
  Status validate(Index, Index) const { return Status::ok(); }
  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing&, MergeOutput<compute_t<T>>& out) const {
    out.gate.setZero(static_cast<Index>(ctx.evicted().size()));
  }
};

}  // namespace kvc
