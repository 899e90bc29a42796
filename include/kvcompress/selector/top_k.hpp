// Selector (SPEC §3, §5): forced sinks and recent tokens, then the top scores, per KV head or
// shared by all KV heads; optional SnapKV-style pooling of the scores over the candidate region.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/parallel.hpp"
#include "kvcompress/traits.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvc {

enum class Pooling { none, average, max };
enum class Granularity { per_head, shared };

inline const char* to_string(Pooling p) {
  return p == Pooling::none ? "none" : p == Pooling::average ? "average" : "max";
}
inline const char* to_string(Granularity g) { return g == Granularity::per_head ? "per_head" : "shared"; }

/// How many tokens are forced for a budget m (SPEC §3): min(sinks, m) first tokens, then up to
/// `recent` most recent tokens while budget and cache last.
struct ForcedCounts {
  Index sinks = 0;
  Index recent = 0;
};
inline ForcedCounts forced_counts(Index n, Index m, Index sinks, Index recent) {
  ForcedCounts f;
  f.sinks = std::min({sinks, m, n});
  f.recent = std::max<Index>(0, std::min({recent, m - f.sinks, n - f.sinks}));
  return f;
}

namespace detail {

/// Whether score x ranks before y: higher first, NaN below every number; equal scores (and two NaNs)
/// are left to the caller. The order TopChunks and TopBlocks rank chunks and blocks by.
template <class Real>
bool ranks_before(Real x, Real y) {
  const bool x_nan = x != x, y_nan = y != y;
  if (x_nan || y_nan) return !x_nan && y_nan;
  return x > y;
}

/// Working memory of TopK::select, kept in the Selection it fills (Selection::scratch) so that a
/// reused Selection needs no allocation: every buffer is resized, never shrunk.
template <class Real>
struct SelectScratch {
  /// Per worker of parallel_for: the top-candidate buffers of one head.
  struct Worker {
    std::vector<char> flag;                      // (n) kept flags (keep_one)
    std::vector<Index> top;                      // the head's top candidates (keep_one)
    std::vector<std::uint32_t> key, bin_of;      // (len) rank keys and their bins (float path)
    std::vector<std::uint32_t> hist;             // histogram of the current radix step (float path)
    std::vector<std::uint64_t> edge;             // the candidates of the edge bin (float path)
    std::vector<std::pair<Real, Index>> cand;    // (score, position) pairs (other paths)
  };
  std::vector<ForcedCounts> forced;              // [Hkv]
  std::vector<Worker> worker;                    // [workers]
  std::vector<std::vector<Index>> proposal;      // [Hkv] each head's top candidates (shared)
  std::vector<char> proposed;                    // (n) union of the proposals (shared)
  Vector<Real> mean;                             // (n) mean pooled score (shared)

  /// Bytes currently held (capacities).
  std::size_t bytes() const {
    std::size_t b = forced.capacity() * sizeof(ForcedCounts) + proposed.capacity() +
                    static_cast<std::size_t>(mean.size()) * sizeof(Real);
    for (const auto& w : worker)
      b += w.flag.capacity() + w.top.capacity() * sizeof(Index) +
           (w.key.capacity() + w.bin_of.capacity() + w.hist.capacity()) * sizeof(std::uint32_t) +
           w.edge.capacity() * sizeof(std::uint64_t) + w.cand.capacity() * sizeof(std::pair<Real, Index>);
    for (const auto& p : proposal) b += p.capacity() * sizeof(Index);
    return b;
  }
};

}  // namespace detail

/// The selector's output: per KV head the kept positions (ascending) and the score it ranked by.
template <class Real>
struct Selection {
  std::vector<std::vector<Index>> kept;     // [Hkv][m_g]
  std::vector<std::vector<Index>> evicted;  // [Hkv][n - m_g]
  std::vector<Vector<Real>> score;          // [Hkv](n) pooled score (the head mean when shared)
  bool shared = false;                      // all heads keep the same positions
  /// TopK's working memory, kept so that a reused Selection needs no allocation (not part of the
  /// value: copies start without it).
  detail::NotCopied<detail::SelectScratch<Real>> scratch;
};

/// 1-D pooling of `x` over [lo, hi) only, in place of `out` (other entries copied from x):
/// average with zero padding at the region's edges and divisor `kernel` (avg_pool1d default), or
/// max over the in-region part of the window. O(n·kernel). `out` may be `x` (then x is copied
/// first); otherwise nothing is allocated when `out` already has x's size.
template <class Real>
void pool_region(const Vector<Real>& x, Index lo, Index hi, Index kernel, Pooling kind,
                 Vector<Real>& out) {
  if (&x == &out) {  // the in-place sums below read x while writing out
    const Vector<Real> copy = x;
    pool_region(copy, lo, hi, kernel, kind, out);
    return;
  }
  out = x;
  if (kind == Pooling::none || kernel <= 1 || hi - lo <= 0) return;
  const Index half = kernel / 2;
  if (kind == Pooling::average) {
    // Each output is ((x[j−h] + x[j−h+1]) + …) + x[j+h] over the in-region part, then / kernel. The
    // interior (full windows) is summed a whole shifted segment at a time: the same additions in the
    // same order per element, vectorised.
    auto edge = [&](Index j) {
      Real s = 0;
      for (Index t = std::max(lo, j - half); t <= std::min(hi - 1, j + half); ++t) s += x[t];
      out[j] = s / static_cast<Real>(kernel);
    };
    const Index in_lo = std::min(hi, lo + half), in_hi = std::max(in_lo, hi - half);  // full windows
    for (Index j = lo; j < in_lo; ++j) edge(j);
    if (in_hi > in_lo) {
      const Index len = in_hi - in_lo;
      auto acc = out.segment(in_lo, len).array();  // summed in place (x and out are different vectors)
      acc = Real(0) + x.segment(in_lo - half, len).array();
      for (Index t = 1; t < kernel; ++t) acc += x.segment(in_lo - half + t, len).array();
      acc /= static_cast<Real>(kernel);
    }
    for (Index j = in_hi; j < hi; ++j) edge(j);
  } else {
    for (Index j = lo; j < hi; ++j) {
      Real mx = x[j];
      for (Index t = std::max(lo, j - half); t <= std::min(hi - 1, j + half); ++t) mx = std::max(mx, x[t]);
      out[j] = mx;
    }
  }
}

/// The selector. Template parameters are the preset's defaults (sinks, recent, average-pooling
/// kernel, granularity); every one of them can be changed at run time through `Arguments`.
template <Index DefaultSinks = 0, Index DefaultRecent = 0, Index DefaultPool = 0,
          Granularity DefaultGranularity = Granularity::per_head>
struct TopK {
  struct Arguments {
    Index sinks = DefaultSinks;    ///< first tokens always kept (StreamingLLM attention sinks)
    Index recent = DefaultRecent;  ///< most recent tokens always kept (SnapKV keeps its window)
    Index pool_kernel = DefaultPool;  ///< odd pooling kernel P; 0 or 1 = no pooling
    Pooling pooling = DefaultPool > 1 ? Pooling::average : Pooling::none;
    Granularity granularity = DefaultGranularity;
  };
  Arguments args;
  struct traits : PolicyTraits {
    /// select() overwrites every field of the Selection and keeps its vectors' capacity.
    static constexpr bool overwrites_selection = true;
    static constexpr bool takes_threads = true;
  };

  Status validate() const {
    using detail::concat;
    if (args.sinks < 0)
      return Status::fail(Status::Code::invalid_argument, concat("selector.sinks must be >= 0, got ", args.sinks));
    if (args.recent < 0)
      return Status::fail(Status::Code::invalid_argument, concat("selector.recent must be >= 0, got ", args.recent));
    if (args.pooling != Pooling::none && (args.pool_kernel < 1 || args.pool_kernel % 2 == 0))
      return Status::fail(Status::Code::invalid_argument,
                          concat("selector.pool_kernel must be odd and >= 1 when pooling, got ", args.pool_kernel));
    if (args.pooling != Pooling::none && args.pooling != Pooling::average && args.pooling != Pooling::max)
      return Status::fail(Status::Code::invalid_argument,
                          concat("selector.pooling must be none, average or max, got ", static_cast<int>(args.pooling)));
    if (args.granularity != Granularity::per_head && args.granularity != Granularity::shared)
      return Status::fail(Status::Code::invalid_argument, concat("selector.granularity must be per_head or shared, got ",
                                                                 static_cast<int>(args.granularity)));
    return Status::ok();
  }

  bool shares_positions() const { return args.granularity == Granularity::shared; }

  /// scores: [Hkv](n) raw scores; budgets: [Hkv] entries to keep (already clamped to [1, n]).
  /// `threads` as Pipeline::Arguments::threads (the pipeline passes its own): the per-head part,
  /// the pooling and each head's top m' (per head) or proposal (shared), runs on parallel_for; the
  /// shared trim after it is serial. The same selection, bit for bit, for any thread count.
  /// Complexity O(Hkv · n log n).
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets,
              Selection<Real>& out, Index threads = 1) const {
    const Index H = static_cast<Index>(scores.size());
    const Index n = H > 0 ? scores[0].size() : 0;
    // Every field is overwritten; a reused `out` keeps its vectors' capacity.
    out.kept.resize(static_cast<std::size_t>(H));
    out.evicted.resize(static_cast<std::size_t>(H));
    out.score.resize(static_cast<std::size_t>(H));
    out.shared = shares_positions();

    auto& scratch = *out.scratch;
    auto& forced = scratch.forced;
    forced.resize(static_cast<std::size_t>(H));
    for (Index g = 0; g < H; ++g) forced[g] = forced_counts(n, budgets[g], args.sinks, args.recent);
    const Index pool = args.pooling == Pooling::none ? 0 : args.pool_kernel;
    const auto pooled = [&](Index g) {
      pool_region(scores[g], forced[g].sinks, n - forced[g].recent, pool, args.pooling, out.score[g]);
    };
    const Index workers = worker_count(H, threads);
    if (static_cast<Index>(scratch.worker.size()) < workers) scratch.worker.resize(static_cast<std::size_t>(workers));

    if (!out.shared) {
      parallel_for(H, threads, [&](Index g, Index worker) {
        pooled(g);
        keep_one(out.score[g], n, budgets[g], forced[g], nullptr, scratch.worker[static_cast<std::size_t>(worker)],
                 out.kept[g], out.evicted[g]);
      });
    } else {
      // Each head proposes its own top m'; the union is trimmed to m' by the mean pooled score.
      auto& proposal = scratch.proposal;
      proposal.resize(static_cast<std::size_t>(H));
      parallel_for(H, threads, [&](Index g, Index worker) {
        pooled(g);
        top_candidates(out.score[g], n, budgets[g], forced[g], nullptr, scratch.worker[static_cast<std::size_t>(worker)],
                       proposal[static_cast<std::size_t>(g)]);
      });
      Vector<Real>& mean = scratch.mean;
      mean.setZero(n);
      for (Index g = 0; g < H; ++g) mean += out.score[g];
      mean /= static_cast<Real>(H);
      auto& proposed = scratch.proposed;
      proposed.assign(static_cast<std::size_t>(n), 0);
      for (const auto& heads_top : proposal)
        for (Index p : heads_top) proposed[static_cast<std::size_t>(p)] = 1;
      if (H > 0) keep_one(mean, n, budgets[0], forced[0], &proposed, scratch.worker[0], out.kept[0], out.evicted[0]);
      for (Index g = 0; g < H; ++g) {
        if (g > 0) {
          out.kept[g] = out.kept[0];
          out.evicted[g] = out.evicted[0];
        }
        out.score[g] = mean;
      }
    }
  }

 private:
  /// Top (m − forced) candidates in [sinks, n − recent) by score (ties: lower position; a NaN score
  /// ranks below every number), restricted to `allowed` positions when given. Unsorted. The order is
  /// strict and total, so the set is unique; it is found by nth_element on (score, position) pairs
  /// (contiguous keys), or for float scores by top_candidates_float (the same set).
  /// `out` <- the candidates; `w` holds the scratch (its buffers keep their capacity).
  template <class Real>
  static void top_candidates(const Vector<Real>& s, Index n, Index m, ForcedCounts f, const std::vector<char>* allowed,
                             typename detail::SelectScratch<Real>::Worker& w, std::vector<Index>& out) {
    out.clear();
    if (m >= n) return;
    if constexpr (std::is_same_v<Real, float>)
      if (static_cast<std::uint64_t>(n) <= 0xffffffffu) return top_candidates_float(s, n, m, f, allowed, w, out);
    auto& cand = w.cand;
    cand.clear();
    cand.reserve(static_cast<std::size_t>(std::max<Index>(0, n - f.sinks - f.recent)));
    for (Index j = f.sinks; j < n - f.recent; ++j)
      if (!allowed || (*allowed)[static_cast<std::size_t>(j)]) cand.emplace_back(s[j], j);
    const Index k = std::min<Index>(m - f.sinks - f.recent, static_cast<Index>(cand.size()));
    // A strict weak order even with NaN scores (only possible with check_finite = false): NaN ranks
    // below every number, as in rank_key; NaNs among themselves by position.
    auto better = [](const std::pair<Real, Index>& a, const std::pair<Real, Index>& b) {
      const bool a_nan = a.first != a.first, b_nan = b.first != b.first;
      if (a_nan || b_nan) return a_nan == b_nan ? a.second < b.second : b_nan;
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    if (k < static_cast<Index>(cand.size())) std::nth_element(cand.begin(), cand.begin() + k, cand.end(), better);
    out.resize(static_cast<std::size_t>(k));
    for (Index i = 0; i < k; ++i) out[static_cast<std::size_t>(i)] = cand[static_cast<std::size_t>(i)].second;
  }

  /// Order key of a float score: a smaller key is a better score (the IEEE bits mapped to an unsigned
  /// order, then inverted). −0 becomes +0 first, so the two compare equal as the floats do (on the
  /// bits, which -ffast-math cannot fold away); every NaN (only possible with check_finite = false)
  /// gets the largest key, so NaN scores rank below every number.
  static std::uint32_t rank_key(float x) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    if ((b << 1) == 0) b = 0;                                                   // ±0
    if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0) return 0xffffffffu;  // NaN
    return ~((b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u));
  }

  /// top_candidates for float scores and n < 2^32: 64-bit keys (rank_key << 32 | position), whose
  /// integer order is the (score desc, position asc) order. One pass counts the keys' top 11 bits
  /// (2048 bins); every candidate of a bin before the one holding the k-th best is in; a large bin
  /// holding it is split again by the next bits (refine_edge), and only what is left goes through
  /// nth_element. The same set as the pair path (selector_test checks both against the reference).
  /// About twice as fast as the pair path; refine_edge matters when scores crowd into a narrow range
  /// (SelKV's scores often share their top 11 bits).
  static void top_candidates_float(const Vector<float>& s, Index n, Index m, ForcedCounts f,
                                   const std::vector<char>* allowed, detail::SelectScratch<float>::Worker& w,
                                   std::vector<Index>& out) {
    constexpr std::uint32_t kOut = 1u << (32 - kShift);  // the bin of a position `allowed` excludes
    const Index lo = f.sinks, hi = n - f.recent, len = std::max<Index>(0, hi - lo);
    // bin_of is stored rather than derived again from key and `allowed` in the second pass (cheaper).
    auto &key = w.key, &bin_of = w.bin_of, &hist = w.hist;
    key.resize(static_cast<std::size_t>(len));
    bin_of.resize(static_cast<std::size_t>(len));
    hist.assign(kOut + 1, 0);
    for (Index i = 0; i < len; ++i) {
      const std::uint32_t r = rank_key(s[lo + i]);
      const bool in = !allowed || (*allowed)[static_cast<std::size_t>(lo + i)];
      key[static_cast<std::size_t>(i)] = r;
      bin_of[static_cast<std::size_t>(i)] = in ? r >> kShift : kOut;
      ++hist[bin_of[static_cast<std::size_t>(i)]];
    }
    const Index k = std::min<Index>(m - f.sinks - f.recent, len - Index(hist[kOut]));
    if (k <= 0) return;
    std::uint32_t bin = 0;
    Index before = 0;  // candidates in bins < bin: all of them are in
    while (before + Index(hist[bin]) < k) before += Index(hist[bin++]);
    // Branch-free split (which side a position falls on is data-dependent): every position is
    // written to both arrays and the counts advance by the conditions; one slack slot each.
    out.reserve(static_cast<std::size_t>(k) + 1);
    out.resize(static_cast<std::size_t>(before) + 1);
    auto& edge = w.edge;  // the candidates of `bin`
    edge.resize(std::size_t(hist[bin]) + 1);
    std::size_t no = 0, ne = 0;
    for (Index i = 0; i < len; ++i) {
      const std::uint32_t b = bin_of[static_cast<std::size_t>(i)];
      out[no] = lo + i;
      no += b < bin ? 1 : 0;
      edge[ne] = (std::uint64_t(key[static_cast<std::size_t>(i)]) << 32) | std::uint64_t(lo + i);
      ne += b == bin ? 1 : 0;
    }
    out.resize(no);
    edge.resize(ne);
    Index need = k - before;
    // Real scores crowd into few bins (on the n = 32768 benchmark layer, 23 of 32 thousand scores of
    // a head share their top 11 bits), so a large edge bin is split again by the next bits of the
    // key, 11 and then 10, the same way, before nth_element.
    refine_edge(edge, need, out, hist, kMidShift, kShift);
    refine_edge(edge, need, out, hist, 0, kMidShift);
    if (need < static_cast<Index>(edge.size())) std::nth_element(edge.begin(), edge.begin() + need, edge.end());
    for (Index i = 0; i < need; ++i) out.push_back(static_cast<Index>(edge[static_cast<std::size_t>(i)] & 0xffffffffu));
  }

  /// Bits of the 32-bit rank key that top_candidates_float's histograms count: [kShift, 32) first,
  /// then refine_edge's [kMidShift, kShift) and [0, kMidShift).
  static constexpr int kShift = 21, kMidShift = 10;
  static_assert(0 < kMidShift && kMidShift < kShift && kShift < 32, "the three ranges cover the key in order");

  /// One more radix step of top_candidates_float on the candidates `edge` (64-bit keys that agree on
  /// the rank key's bits above `hi_bit`), of which the `need` best are wanted: counts the rank key's
  /// bits [lo_bit, hi_bit); the candidates of every bin before the one holding the need-th best go to
  /// `out`, `edge` keeps that bin's and `need` what is still wanted from it. Skipped for a small
  /// edge, where nth_element alone is cheaper. The same set either way.
  /// `hist` is scratch (overwritten). `out` has room for every candidate pushed (top_candidates_float
  /// reserved k + 1), so nothing is allocated.
  static void refine_edge(std::vector<std::uint64_t>& edge, Index& need, std::vector<Index>& out,
                          std::vector<std::uint32_t>& hist, int lo_bit, int hi_bit) {
    constexpr std::size_t kSmall = 512;
    if (edge.size() <= kSmall || need >= static_cast<Index>(edge.size())) return;
    const std::uint32_t mask = (1u << (hi_bit - lo_bit)) - 1;
    const auto bin_of = [&](std::uint64_t e) { return std::uint32_t(e >> (32 + lo_bit)) & mask; };
    hist.assign(std::size_t(mask) + 1, 0);
    for (std::uint64_t e : edge) ++hist[bin_of(e)];
    std::uint32_t bin = 0;
    Index before = 0;
    while (before + Index(hist[bin]) < need) before += Index(hist[bin++]);
    if (hist[bin] == edge.size()) return;  // all in one bin (e.g. tied scores): nothing to split
    std::size_t ne = 0;
    for (std::uint64_t e : edge) {
      const std::uint32_t b = bin_of(e);
      if (b < bin) out.push_back(static_cast<Index>(e & 0xffffffffu));
      else if (b == bin) edge[ne++] = e;  // ne never passes the read position
    }
    edge.resize(ne);
    need -= before;
  }

  /// kept (ascending) <- forced sinks and recent tokens + the top candidates; evicted (ascending) <- the
  /// rest. `w` is scratch (its buffers keep their capacity).
  template <class Real>
  static void keep_one(const Vector<Real>& s, Index n, Index m, ForcedCounts f, const std::vector<char>* allowed,
                       typename detail::SelectScratch<Real>::Worker& w, std::vector<Index>& kept,
                       std::vector<Index>& evicted) {
    kept.clear();
    evicted.clear();
    if (m >= n) {
      kept.resize(static_cast<std::size_t>(n));
      std::iota(kept.begin(), kept.end(), Index(0));
      return;
    }
    auto& flag = w.flag;
    flag.assign(static_cast<std::size_t>(n), char(0));
    top_candidates(s, n, m, f, allowed, w, w.top);
    for (Index p : w.top) flag[static_cast<std::size_t>(p)] = 1;
    for (Index j = 0; j < f.sinks; ++j) flag[static_cast<std::size_t>(j)] = 1;
    for (Index j = n - f.recent; j < n; ++j) flag[static_cast<std::size_t>(j)] = 1;
    Index count = 0;
    for (char c : flag) count += c;
    // Branch-free split into kept / evicted (one slack slot each; see top_candidates_float).
    kept.resize(static_cast<std::size_t>(count) + 1);
    evicted.resize(static_cast<std::size_t>(n - count) + 1);
    std::size_t nk = 0, ne = 0;
    for (Index j = 0; j < n; ++j) {
      const bool keep = flag[static_cast<std::size_t>(j)] != 0;
      kept[nk] = j;
      evicted[ne] = j;
      nk += keep ? 1 : 0;
      ne += keep ? 0 : 1;
    }
    kept.resize(nk);
    evicted.resize(ne);
  }
};

/// The no-op selector: keeps every token (nothing is evicted).
struct KeepAll {
  struct Arguments {};
  Arguments args;
  struct traits : PolicyTraits {
    static constexpr bool overwrites_selection = true;  // see TopK
  };
  Status validate() const { return Status::ok(); }
  bool shares_positions() const { return false; }

  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>&,
              Selection<Real>& out) const {
    const Index H = static_cast<Index>(scores.size());
    const Index n = H > 0 ? scores[0].size() : 0;
    out.kept.resize(static_cast<std::size_t>(H));  // every field overwritten, capacity kept (see TopK)
    out.evicted.resize(static_cast<std::size_t>(H));
    for (auto& k : out.kept) {
      k.resize(static_cast<std::size_t>(n));
      std::iota(k.begin(), k.end(), Index(0));
    }
    for (auto& e : out.evicted) e.clear();
    out.score = scores;
    out.shared = false;
  }
};

}  // namespace kvc
