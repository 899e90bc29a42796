// Scorers (SPEC §4): one score per cached token and KV head, higher = keep.
//
// Every scorer has a nested `Arguments`, a non-throwing `validate`, the verb
// `score(const ScoreContext<T>& ctx, Vector<Real>& out)` and, where it reads the window attention mass
// a_g or covers the NaN/Inf scan, a `traits` (PolicyTraits). One scorer per file for new ones
// (last_query_attention.hpp, key_diversity.hpp); the four here share this one.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE

namespace kvc {

/// SnapKV: c_g[j] = a_g[j], the window attention mass.
struct AttentionMass {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;
  };
  Arguments args;

  Status validate() const { return Status::ok(); }

  /// score (n) <- mass (n). O(n).
  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    out = ctx.mass();
  }
};

/// SelKV Eq. 1: c_g[j] = a_g[j] · ‖v_{g,j}‖₂.
struct ValueWeighted {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;
    /// Its score is NaN/Inf whenever a value row is (through the row norm), so the pipeline checks
    /// the scores instead of reading V a second time for the NaN/Inf scan.
    static constexpr bool covers_values = true;
  };
  Arguments args;

  Status validate() const { return Status::ok(); }

  /// score (n) <- mass (n) ⊙ row norms of V_g (n, d). O(n·d).
  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const LayerView<T>& layer = ctx.layer();
    const Vector<Real>& mass = ctx.mass();
    const Index n = layer.tokens(), d = layer.head_dim(), g = ctx.head();
    out.resize(n);
    detail::RowPrefetcher<T> prefetch(layer.values, g, detail::kScanPrefetchRows);
    for (Index j = 0; j < n; ++j) {
      prefetch.advance_to(j + 1);
      out[j] = mass[j] * detail::row_norm<Real>(layer.values.row(g, j), d);
    }
  }
};

/// KNorm: c_g[j] = −‖k_{g,j}‖₂ (low-norm keys attract attention). Does not need window attention.
struct KeyNorm {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool covers_keys = true;  // its score is NaN/Inf whenever a key row is
  };
  Arguments args;

  Status validate() const { return Status::ok(); }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const LayerView<T>& layer = ctx.layer();
    const Index n = layer.tokens(), d = layer.head_dim(), g = ctx.head();
    out.resize(n);
    detail::RowPrefetcher<T> prefetch(layer.keys, g, detail::kScanPrefetchRows);
    for (Index j = 0; j < n; ++j) {
      prefetch.advance_to(j + 1);
      out[j] = -detail::row_norm<Real>(layer.keys.row(g, j), d);
    }
  }
};

/// StreamingLLM: no content score. c_g[j] = j, so that filling the budget "by score" keeps the most
/// recent tokens after the sinks. The no-op scorer.
struct Position {
  struct Arguments {};
  Arguments args;

  Status validate() const { return Status::ok(); }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    out.resize(ctx.tokens());
    for (Index j = 0; j < ctx.tokens(); ++j) out[j] = static_cast<Real>(j);  // exact integers
  }
};

}  // namespace kvc
