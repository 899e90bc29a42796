// Block-granular selection for paged caches: whole blocks of b entries are kept or evicted, so that
// an evicted block's page is freed without moving any other entry (compact_paged).
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/selector/top_k.hpp"
#include "kvcompress/traits.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

namespace kvc {

/// How TopBlocks turns its entries' scores into a block's score.
enum class BlockScore { mean, max };

inline const char* to_string(BlockScore s) { return s == BlockScore::mean ? "mean" : "max"; }

/// Block-granular eviction (OpenVINO GenAI's cache eviction, at any scorer). The cache's entries are
/// cut into blocks B_k = [k·b, min((k+1)·b, n)) of b = `block_size` entries, aligned to entry 0 as a
/// sequence's pages are. Per KV head the scores are pooled as TopK pools them (between the forced
/// entries); a block's score is the mean (or max) of its entries' pooled scores, averaged over the KV
/// heads: a page holds every head, so the selection is shared. With m the budget (of head 0) and
/// f = forced_counts(n, m, sinks, recent) as TopK forces them, the blocks holding the first f.sinks
/// and the last f.recent entries are kept (sinks and recent rounded to whole blocks); the other blocks
/// follow in order of their score (descending, NaN last, ties to the lower block), each kept whole
/// when it fits in what is left of m. So a head keeps at most m entries plus the rounding of the forced
/// blocks (< 2b), possibly fewer than m when no remaining block fits (the result's lengths report it),
/// and never nothing: when no block fits at all (m < b, nothing forced) the best block is kept whole.
/// O(Hkv·n + (n/b) log(n/b)).
template <Index DefaultBlock = 16, Index DefaultSinks = 0, Index DefaultRecent = 0>
struct TopBlocks {
  struct Arguments {
    Index block_size = DefaultBlock;  ///< entries per block b (the paged cache's block size)
    Index sinks = DefaultSinks;       ///< first entries always kept (rounded up to whole blocks)
    Index recent = DefaultRecent;     ///< newest entries always kept (rounded to whole blocks)
    Index pool_kernel = 0;            ///< odd pooling kernel P; 0 or 1 = no pooling (as TopK)
    Pooling pooling = Pooling::none;
    BlockScore block_score = BlockScore::mean;
  };
  Arguments args;
  struct traits : PolicyTraits {
    static constexpr bool overwrites_selection = true;
  };

  Status validate() const {
    using detail::concat;
    if (args.block_size < 1)
      return Status::fail(Status::Code::invalid_argument, concat("selector.block_size must be >= 1, got ", args.block_size));
    return TopK<>{{args.sinks, args.recent, args.pool_kernel, args.pooling, Granularity::shared}}.validate();
  }

  bool shares_positions() const { return true; }

  /// scores: [Hkv](n) raw scores; budgets: [Hkv] entries to keep (already clamped to [1, n]).
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out) const {
    const Index H = static_cast<Index>(scores.size());
    const Index n = H > 0 ? scores[0].size() : 0;
    out.kept.resize(static_cast<std::size_t>(H));
    out.evicted.resize(static_cast<std::size_t>(H));
    out.score.resize(static_cast<std::size_t>(H));
    out.shared = true;
    if (H == 0) return;
    const Index m = std::min(budgets[0], n), b = args.block_size;
    const ForcedCounts f = forced_counts(n, m, args.sinks, args.recent);
    const Index pool = args.pooling == Pooling::none ? 0 : args.pool_kernel;
    for (Index g = 0; g < H; ++g) pool_region(scores[g], f.sinks, n - f.recent, pool, args.pooling, out.score[g]);
    const Index blocks = n > 0 ? (n - 1) / b + 1 : 0;
    const auto size = [&](Index k) { return std::min(k * b + b, n) - k * b; };  // |B_k|: the last may be short
    std::vector<Real> block_score(static_cast<std::size_t>(blocks), Real(0));  // S_k, mean over heads
    for (Index g = 0; g < H; ++g)
      for (Index k = 0; k < blocks; ++k) {
        const Index a = k * b;
        Real s = out.score[g][a];
        for (Index j = a + 1; j < a + size(k); ++j)
          s = args.block_score == BlockScore::mean ? s + out.score[g][j] : max_nan(s, out.score[g][j]);
        if (args.block_score == BlockScore::mean) s /= static_cast<Real>(size(k));
        block_score[static_cast<std::size_t>(k)] += s / static_cast<Real>(H);
      }
    std::vector<char> keep(static_cast<std::size_t>(blocks), char(m >= n ? 1 : 0));
    if (m < n) {
      Index left = m;
      const auto take = [&](Index k) {
        keep[static_cast<std::size_t>(k)] = 1;
        left -= size(k);
      };
      const Index sink_blocks = f.sinks > 0 ? (f.sinks - 1) / b + 1 : 0;
      const Index recent_from = f.recent > 0 ? (n - f.recent) / b : blocks;
      for (Index k = 0; k < blocks; ++k)
        if (k < sink_blocks || k >= recent_from) take(k);
      std::vector<Index> order;
      for (Index k = 0; k < blocks; ++k)
        if (!keep[static_cast<std::size_t>(k)]) order.push_back(k);
      std::stable_sort(order.begin(), order.end(), [&](Index x, Index y) {
        return detail::ranks_before(block_score[static_cast<std::size_t>(x)], block_score[static_cast<std::size_t>(y)]);
      });
      for (Index k : order)
        if (size(k) <= left) take(k);
      if (std::find(keep.begin(), keep.end(), char(1)) == keep.end()) take(order.front());  // m < b: the best block
    }
    out.kept[0].clear();
    out.evicted[0].clear();
    for (Index j = 0; j < n; ++j) (keep[static_cast<std::size_t>(j / b)] ? out.kept[0] : out.evicted[0]).push_back(j);
    for (Index g = 1; g < H; ++g) {
      out.kept[static_cast<std::size_t>(g)] = out.kept[0];
      out.evicted[static_cast<std::size_t>(g)] = out.evicted[0];
    }
  }

 private:
  /// max that keeps a NaN (a block with a NaN score ranks last either way).
  template <class Real>
  static Real max_nan(Real x, Real y) {
    return (x != x || y != y) ? x + y : std::max(x, y);
  }
};

}  // namespace kvc
