// CacheMerge (CaM): each evicted value spread over the next kept tokens, weighted by its window attention mass.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace kvc {

/// CaM (Zhang et al., ICML 2024) after any eviction, with its Bernoulli merge replaced by its
/// expectation. For evicted token e, its window is the next b_e = min(B, #kept after e) kept tokens
/// (B = Arguments::window), and
///   p_e = min(a_e / ā_e, 1),   ā_e = (1/b_e)·Σ_{t in window(e)} a_t       (window attention mass a)
///   ṽ_t = v_t + Σ_{e: t in window(e)} (p_e / b_e)·v_e
/// Keys are unchanged; no routing (the targets follow from the positions). Edge rules: p_e = 0 when
/// a_e = 0 or e has no kept token after it (b_e = 0); p_e = 1 when a_e > 0 = ā_e. So gate = p_e is
/// finite, in [0, 1], for any mass. A row that receives nothing (or only p = 0) is bit-identical to the
/// kept value.
/// Evicted tokens between two consecutive kept tokens share a window: their Σ (p_e/b)·v_e is formed once
/// and added to each row of the window. Cost O((n − m)·d + r·B·d) for r runs of evicted tokens (r <= m),
/// extra memory O(d) (in out.scratch).
struct CacheMerge {
  struct Arguments {
    Index window = 32;  ///< B: the kept tokens after an evicted one that share its value (CaM's merge budget)
  };
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;
    static constexpr bool reads_kept_keys = false;
  };
  Arguments args;

  Status validate(Index /*n*/, Index /*m*/) const {
    if (args.window < 1)
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("merger.window must be >= 1, got ", args.window));
    return Status::ok();
  }

  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing& /*routing*/, MergeOutput<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const auto& kept = ctx.kept();
    const auto& evicted = ctx.evicted();
    const auto& a = ctx.mass();
    const Index m = static_cast<Index>(kept.size()), d = ctx.head_dim();
    out.gate.setZero(static_cast<Index>(evicted.size()));
    Vector<Real>& run = out.scratch->added;  // (d) Σ (p_e / b)·v_e of the current run
    Index s = 0;  // the first kept index after the current evicted token
    std::size_t e = 0;
    while (e < evicted.size()) {
      while (s < m && kept[static_cast<std::size_t>(s)] < evicted[e]) ++s;
      const Index b = std::min(args.window, m - s);
      if (b == 0) break;  // no kept token after e (nor after any later one): gates stay 0
      // ā over the window kept[s, s + b), shared by the run of evicted tokens before kept[s].
      double mean = 0;
      for (Index t = s; t < s + b; ++t) mean += static_cast<double>(a[kept[static_cast<std::size_t>(t)]]);
      mean /= static_cast<double>(b);
      run.setZero(d);
      bool any = false;
      for (; e < evicted.size() && evicted[e] < kept[static_cast<std::size_t>(s)]; ++e) {
        const double ae = static_cast<double>(a[evicted[e]]);
        const double p = !(ae > 0.0) ? 0.0 : ae >= mean ? 1.0 : ae / mean;
        out.gate[static_cast<Index>(e)] = static_cast<Real>(p);
        if (!(p > 0.0)) continue;
        any = true;
        const Real w = static_cast<Real>(p / static_cast<double>(b));
        const T* v = ctx.value(evicted[e]);
        // Fused multiply-adds whatever the unit's contraction flags, so every build gives the same bits.
        if constexpr (std::is_same_v<Real, float>)
          simd::axpy<simd::default_arch>(w, v, run.data(), d);
        else
          for (Index c = 0; c < d; ++c) run[c] = std::fma(w, to_real<Real>(v[c]), run[c]);
      }
      if (any)
        for (Index t = s; t < s + b; ++t) out.values.row(t) += run.transpose();
    }
  }
};

}  // namespace kvc
