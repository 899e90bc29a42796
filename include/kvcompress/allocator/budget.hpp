// Budget allocation (SPEC §5): how many entries each KV head keeps, between scoring and selection.
#pragma once
#include "kvcompress/core.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvc {

/// Every KV head keeps its own budget m_g as given (one budget for every head unless the caller
/// passes per-head budgets). The no-op allocator and the default.
struct UniformBudget {
  struct Arguments {};
  Arguments args;
  Status validate() const { return Status::ok(); }
  /// Whether allocate() keeps the budgets as they are (shared selection needs equal budgets).
  bool keeps_budgets() const { return true; }
  template <class Real>
  void allocate(const std::vector<Vector<Real>>& /*scores*/, std::vector<Index>& /*budgets*/) const {}
};

/// AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
/// Efficient LLM Inference", 2024), with kvpress's AdaKVPress rule: the layer keeps B = Σ_g m_g
/// entries in all; each head g first keeps its top f_g = max(1, ⌊floor·m_g⌋) scores, and the other
/// B − Σ_g f_g entries are the top scores over all heads' remaining entries (one top-k over the
/// layer). m_g = f_g + head g's share. Ties: higher score, then lower head, then lower position; a NaN
/// score ranks lowest. The scores are the scorer's (before any pooling by the selector).
/// O(Hkv·n) time and memory.
struct AdaKV {
  struct Arguments {
    double floor = 0.2;  ///< per-head floor as a fraction of m_g, in [0, 1]
  };
  Arguments args;

  Status validate() const {
    if (!(args.floor >= 0.0 && args.floor <= 1.0))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("allocator.floor must be in [0, 1], got ", args.floor));
    return Status::ok();
  }
  bool keeps_budgets() const { return false; }

  /// budgets [Hkv] (each in [1, n]) <- the AdaKV allocation over scores [Hkv](n); Σ budgets is kept.
  template <class Real>
  void allocate(const std::vector<Vector<Real>>& scores, std::vector<Index>& budgets) const {
    const Index H = static_cast<Index>(scores.size());
    if (H == 0) return;
    const Index n = scores[0].size();
    struct Entry {
      Real score;
      Index head, position;
    };
    const auto key = [](Real s) { return std::isnan(s) ? -std::numeric_limits<Real>::infinity() : s; };
    const auto before = [&](const Entry& a, const Entry& b) {
      const Real x = key(a.score), y = key(b.score);
      if (x != y) return x > y;
      return a.head != b.head ? a.head < b.head : a.position < b.position;
    };
    Index total = 0, floors = 0;
    std::vector<Entry> rest;  // entries not kept by a head's floor
    rest.reserve(static_cast<std::size_t>(H * n));
    std::vector<Entry> head;
    std::vector<Index> floor_of(static_cast<std::size_t>(H));
    for (Index g = 0; g < H; ++g) {
      const Index m = budgets[static_cast<std::size_t>(g)];
      const Index f = std::min(m, std::max<Index>(1, static_cast<Index>(std::floor(args.floor * double(m)))));
      floor_of[static_cast<std::size_t>(g)] = f;
      total += m;
      floors += f;
      head.clear();
      for (Index j = 0; j < n; ++j) head.push_back({scores[static_cast<std::size_t>(g)][j], g, j});
      std::nth_element(head.begin(), head.begin() + f, head.end(), before);  // the first f are its floor
      rest.insert(rest.end(), head.begin() + f, head.end());
    }
    const Index share = std::min<Index>(total - floors, static_cast<Index>(rest.size()));
    std::nth_element(rest.begin(), rest.begin() + share, rest.end(), before);
    for (Index g = 0; g < H; ++g) budgets[static_cast<std::size_t>(g)] = floor_of[static_cast<std::size_t>(g)];
    for (Index e = 0; e < share; ++e) ++budgets[static_cast<std::size_t>(rest[static_cast<std::size_t>(e)].head)];
  }
};

}  // namespace kvc
