// Threshold selection: every token whose score reaches τ, per KV head; the budget is the outcome.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/selector/top_k.hpp"
#include "kvcompress/traits.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kvc {

/// kvpress's ThresholdPress (the DMS-style rule: evict what scores below τ, never the most recent
/// tokens): per KV head g, kept_g = the `recent` newest tokens ∪ {j : c_g[j] ≥ τ} (a NaN score is
/// below every τ). The number kept is the outcome (LayerResult's per-head lengths report it), capped
/// by the head's budget: when more qualify than m_g, the recent tokens (the newest first) and then
/// the highest scores (ties to the lower position) fill m_g. At least one token is kept (the newest).
/// The scores are the scorer's, unpooled. O(n) per head, O(n log n) when the cap binds.
template <Index DefaultRecent = 64>
struct ThresholdSelect {
  struct Arguments {
    double threshold = 0.02;       ///< τ: tokens scoring at least τ are kept
    Index recent = DefaultRecent;  ///< newest tokens always kept (kvpress eviction_delay)
  };
  Arguments args;
  struct traits : PolicyTraits {
    static constexpr bool overwrites_selection = true;
  };

  Status validate() const {
    if (!std::isfinite(args.threshold))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("selector.threshold must be finite, got ", args.threshold));
    if (args.recent < 0)
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("selector.recent must be >= 0, got ", args.recent));
    return Status::ok();
  }
  bool shares_positions() const { return false; }

  /// scores: [Hkv](n); budgets: [Hkv] caps (already clamped to [1, n]).
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out) const {
    const Index H = static_cast<Index>(scores.size());
    out.kept.resize(static_cast<std::size_t>(H));
    out.evicted.resize(static_cast<std::size_t>(H));
    out.score.resize(static_cast<std::size_t>(H));
    out.shared = false;
    const Real tau = static_cast<Real>(args.threshold);
    for (Index g = 0; g < H; ++g) {
      const auto h = static_cast<std::size_t>(g);
      const Vector<Real>& s = scores[h];
      const Index n = s.size(), m = std::min(budgets[h], n);
      const Index recent = std::min(args.recent, n);
      out.score[h] = s;
      std::vector<Index>& kept = out.kept[h];
      std::vector<Index>& evicted = out.evicted[h];
      kept.clear();
      evicted.clear();
      const auto qualifies = [&](Index j) { return j >= n - recent || s[j] >= tau; };  // NaN >= τ is false
      Index count = 0;
      for (Index j = 0; j < n; ++j) count += qualifies(j) ? 1 : 0;
      if (count == 0) {  // nothing qualifies and no recent window: the newest token
        for (Index j = 0; j + 1 < n; ++j) evicted.push_back(j);
        kept.push_back(n - 1);
      } else if (count <= m) {
        for (Index j = 0; j < n; ++j) (qualifies(j) ? kept : evicted).push_back(j);
      } else {  // the cap: newest recent tokens first, then the highest scores
        std::vector<Index> order;
        order.reserve(static_cast<std::size_t>(count));
        for (Index j = n - 1; j >= n - recent; --j) order.push_back(j);
        const std::size_t forced = order.size();
        for (Index j = 0; j < n - recent; ++j)
          if (qualifies(j)) order.push_back(j);
        std::stable_sort(order.begin() + static_cast<std::ptrdiff_t>(forced), order.end(),
                         [&](Index x, Index y) { return s[x] > s[y]; });
        std::vector<char> keep(static_cast<std::size_t>(n), 0);
        for (Index i = 0; i < m; ++i) keep[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = 1;
        for (Index j = 0; j < n; ++j) (keep[static_cast<std::size_t>(j)] ? kept : evicted).push_back(j);
      }
    }
  }
};

}  // namespace kvc
