// ChunkKV's selector (as kvpress's ChunkKVPress selects): whole chunks of consecutive tokens, ranked
// by their mean score, composable with any scorer.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/selector/top_k.hpp"
#include "kvcompress/traits.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

namespace kvc {

/// ChunkKV (Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
/// Long-Context LLM Inference", 2025). For a budget m the forced sinks and recent tokens are kept
/// (SPEC §3, as TopK), the scores are pooled over the region between them (as TopK), and the region
/// [s, n − r) is cut into chunks C_b = [s + b·c, min(s + (b+1)·c, n − r)) of c = `chunk` tokens:
///   S_b = (1/|C_b|) · Σ_{j∈C_b} score_j
/// Chunks are taken whole in order of S_b (descending, ties by lower b) while they fit in what is
/// left of m; the rest of the budget, smaller than the chunks that did not fit, goes to the best
/// single tokens not yet kept (descending score, ties by lower position), so every head keeps exactly
/// m. With shared granularity (the default, as kvpress sums the scores over heads) every head ranks by
/// the mean pooled score over heads. A NaN score ranks below every number. O(Hkv · n log n).
template <Index DefaultChunk = 20, Index DefaultSinks = 0, Index DefaultRecent = 0, Index DefaultPool = 0,
          Granularity DefaultGranularity = Granularity::shared>
struct TopChunks {
  struct Arguments {
    Index chunk = DefaultChunk;    ///< tokens per chunk c (kvpress chunk_length)
    Index sinks = DefaultSinks;    ///< first tokens always kept
    Index recent = DefaultRecent;  ///< most recent tokens always kept
    Index pool_kernel = DefaultPool;  ///< odd pooling kernel P; 0 or 1 = no pooling
    Pooling pooling = DefaultPool > 1 ? Pooling::average : Pooling::none;
    Granularity granularity = DefaultGranularity;
  };
  Arguments args;

  Status validate() const {
    using detail::concat;
    if (args.chunk < 1)
      return Status::fail(Status::Code::invalid_argument, concat("selector.chunk must be >= 1, got ", args.chunk));
    // The options shared with TopK are checked as TopK checks them.
    return TopK<>{{args.sinks, args.recent, args.pool_kernel, args.pooling, args.granularity}}.validate();
  }

  bool shares_positions() const { return args.granularity == Granularity::shared; }

  /// scores: [Hkv](n) raw scores; budgets: [Hkv] entries to keep (already clamped to [1, n]).
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out) const {
    const Index H = static_cast<Index>(scores.size());
    const Index n = H > 0 ? scores[0].size() : 0;
    out.kept.resize(static_cast<std::size_t>(H));
    out.evicted.resize(static_cast<std::size_t>(H));
    out.score.resize(static_cast<std::size_t>(H));
    out.shared = shares_positions();
    const Index pool = args.pooling == Pooling::none ? 0 : args.pool_kernel;
    for (Index g = 0; g < H; ++g) {
      const ForcedCounts f = forced_counts(n, budgets[g], args.sinks, args.recent);
      pool_region(scores[g], f.sinks, n - f.recent, pool, args.pooling, out.score[g]);
    }
    if (!out.shared) {
      for (Index g = 0; g < H; ++g) keep_chunks(out.score[g], n, budgets[g], out.kept[g], out.evicted[g]);
      return;
    }
    if (H == 0) return;
    Vector<Real> mean = Vector<Real>::Zero(n);  // (n)
    for (Index g = 0; g < H; ++g) mean += out.score[g];
    mean /= static_cast<Real>(H);
    keep_chunks(mean, n, budgets[0], out.kept[0], out.evicted[0]);
    for (Index g = 0; g < H; ++g) {
      out.score[g] = mean;
      if (g > 0) {
        out.kept[g] = out.kept[0];
        out.evicted[g] = out.evicted[0];
      }
    }
  }

 private:
  /// kept (ascending) <- the forced tokens, the best whole chunks that fit and the best single tokens
  /// for the rest of the budget m; evicted (ascending) <- the other positions.
  template <class Real>
  void keep_chunks(const Vector<Real>& s, Index n, Index m, std::vector<Index>& kept, std::vector<Index>& evicted) const {
    kept.clear();
    evicted.clear();
    std::vector<char> flag(static_cast<std::size_t>(n), char(m >= n ? 1 : 0));
    if (m < n) {
      const ForcedCounts f = forced_counts(n, m, args.sinks, args.recent);
      const Index lo = f.sinks, hi = n - f.recent, c = args.chunk;
      for (Index j = 0; j < lo; ++j) flag[static_cast<std::size_t>(j)] = 1;
      for (Index j = hi; j < n; ++j) flag[static_cast<std::size_t>(j)] = 1;
      Index left = m - f.sinks - f.recent;
      const Index chunks = hi > lo ? (hi - lo) / c + ((hi - lo) % c != 0) : 0;  // no overflow for any c
      std::vector<Real> mean(static_cast<std::size_t>(chunks));  // S_b
      for (Index b = 0; b < chunks; ++b) {
        const Index a = lo + b * c, e = a + std::min(c, hi - a);
        Real sum = 0;
        for (Index j = a; j < e; ++j) sum += s[j];
        mean[static_cast<std::size_t>(b)] = sum / static_cast<Real>(e - a);
      }
      std::vector<Index> order(static_cast<std::size_t>(chunks));
      std::iota(order.begin(), order.end(), Index(0));
      std::sort(order.begin(), order.end(), [&](Index x, Index y) {
        const Real sx = mean[static_cast<std::size_t>(x)], sy = mean[static_cast<std::size_t>(y)];
        return detail::ranks_before(sx, sy) || (!detail::ranks_before(sy, sx) && x < y);
      });
      for (Index b : order) {
        const Index a = lo + b * c, e = a + std::min(c, hi - a);
        if (e - a > left) continue;
        for (Index j = a; j < e; ++j) flag[static_cast<std::size_t>(j)] = 1;
        left -= e - a;
      }
      if (left > 0) {
        std::vector<Index> rest;
        for (Index j = lo; j < hi; ++j)
          if (!flag[static_cast<std::size_t>(j)]) rest.push_back(j);
        std::sort(rest.begin(), rest.end(),
                  [&](Index x, Index y) {
                  return detail::ranks_before(s[x], s[y]) || (!detail::ranks_before(s[y], s[x]) && x < y);
                });
        for (Index i = 0; i < left && i < static_cast<Index>(rest.size()); ++i)
          flag[static_cast<std::size_t>(rest[static_cast<std::size_t>(i)])] = 1;
      }
    }
    for (Index j = 0; j < n; ++j) (flag[static_cast<std::size_t>(j)] ? kept : evicted).push_back(j);
  }
};

}  // namespace kvc
