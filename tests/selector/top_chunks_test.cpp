// TopChunks (ChunkKV's selector) against kvc::ref::select_chunks per KV head and shared, with forced
// tokens and pooling, chunks longer than the cache, ties, exact budgets, whole chunks, and the ChunkKV
// preset (SnapKV's scores) with a window longer than the cache.
#include <catch2/catch.hpp>

#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/selector/top_chunks.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::Layout;

namespace {

template <class Real>
std::vector<Vector<Real>> rows_of(const Eigen::MatrixXd& scores) {
  std::vector<Vector<Real>> out;
  for (long g = 0; g < scores.rows(); ++g) out.push_back(scores.row(g).transpose().cast<Real>());
  return out;
}

/// The selection's invariants: kept and evicted ascending, disjoint, covering [0, n); |kept| = m.
void check_invariants(const Selection<double>& sel, long n, long m) {
  for (std::size_t g = 0; g < sel.kept.size(); ++g) {
    std::vector<Index> all = sel.kept[g];
    all.insert(all.end(), sel.evicted[g].begin(), sel.evicted[g].end());
    std::sort(all.begin(), all.end());
    CHECK(std::is_sorted(sel.kept[g].begin(), sel.kept[g].end()));
    CHECK(std::is_sorted(sel.evicted[g].begin(), sel.evicted[g].end()));
    CHECK(static_cast<long>(sel.kept[g].size()) == std::min(m, n));
    bool cover = static_cast<long>(all.size()) == n;
    for (long j = 0; cover && j < n; ++j) cover = all[static_cast<std::size_t>(j)] == j;
    CHECK(cover);
  }
}

}  // namespace

TEST_CASE("TopChunks matches the reference chunk selection over sizes, budgets, chunks and forced tokens", "[selector]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(321);
  std::normal_distribution<double> normal(0.0, 1.0);
  struct Config {
    long chunk, sinks, recent, kernel;
    bool shared;
  };
  const Config configs[] = {{20, 0, 0, 0, true}, {20, 0, 32, 5, true}, {3, 2, 5, 3, false}, {1, 0, 0, 0, false},
                            {7, 1, 0, 0, true},  {64, 0, 4, 0, false}};
  for (long Hkv : {1L, 3L})
    for (long n : {1L, 5L, 19L, 20L, 21L, 47L, 100L})
      for (const Config& c : configs) {
        Eigen::MatrixXd scores(Hkv, n);
        for (long g = 0; g < Hkv; ++g)
          for (long j = 0; j < n; ++j) scores(g, j) = normal(rng);
        TopChunks<> sel;
        sel.args.chunk = c.chunk;
        sel.args.sinks = c.sinks;
        sel.args.recent = c.recent;
        sel.args.pool_kernel = c.kernel;
        sel.args.pooling = c.kernel > 1 ? Pooling::average : Pooling::none;
        sel.args.granularity = c.shared ? Granularity::shared : Granularity::per_head;
        REQUIRE(sel.validate().is_ok());
        for (long m : {1L, 7L, 20L, 33L, n - 1, n}) {
          if (m < 1 || m > n) continue;
          INFO("Hkv " << Hkv << " n " << n << " m " << m << " chunk " << c.chunk << " sinks " << c.sinks << " recent "
                      << c.recent << " kernel " << c.kernel << " shared " << c.shared);
          std::vector<Index> budgets(static_cast<std::size_t>(Hkv), m);
          Selection<double> out;
          sel.select(rows_of<double>(scores), budgets, out);
          const auto want = ref::select_chunks(scores, std::vector<long>(static_cast<std::size_t>(Hkv), m), c.sinks,
                                               c.recent, c.kernel, c.chunk, c.shared);
          for (long g = 0; g < Hkv; ++g) CHECK(kvc::test::to_long(out.kept[g]) == want[g]);
          CHECK(out.shared == c.shared);
          check_invariants(out, n, m);
        }
      }
}

TEST_CASE("TopChunks takes a chunk up to the largest Index", "[selector]") {
  // chunk + any length overflows Index there: one chunk holds every candidate, as a chunk of n does.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(323);
  std::normal_distribution<double> normal(0.0, 1.0);
  const long n = 50;
  Eigen::MatrixXd scores(2, n);
  for (long g = 0; g < 2; ++g)
    for (long j = 0; j < n; ++j) scores(g, j) = normal(rng);
  for (const bool shared : {false, true})
    for (const long m : {1L, 17L, 49L}) {
      INFO("shared " << shared << " m " << m);
      TopChunks<> huge, whole;
      huge.args.chunk = std::numeric_limits<Index>::max();
      whole.args.chunk = n;
      huge.args.granularity = whole.args.granularity = shared ? Granularity::shared : Granularity::per_head;
      Selection<double> a, b;
      huge.select(rows_of<double>(scores), {m, m}, a);
      whole.select(rows_of<double>(scores), {m, m}, b);
      CHECK(a.kept == b.kept);
      check_invariants(a, n, m);
    }
}

TEST_CASE("TopChunks: budgets in whole chunks keep whole chunks; float scores; ties to the first chunks", "[selector]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(322);
  std::uniform_int_distribution<int> small(0, 1000);
  const long n = 100, c = 10;
  Eigen::MatrixXd scores(1, n);
  for (long j = 0; j < n; ++j) scores(0, j) = small(rng);  // integers: the same sums in float and double
  TopChunks<10, 0, 0, 0, Granularity::per_head> sel;
  for (long chunks = 1; chunks <= 10; ++chunks) {
    const long m = chunks * c;
    Selection<float> out;
    sel.select(rows_of<float>(scores), {m}, out);
    const auto want = ref::select_chunks(scores, {m}, 0, 0, 0, c, false);
    CHECK(kvc::test::to_long(out.kept[0]) == want[0]);
    for (long b = 0; b < n / c; ++b) {  // each chunk all in or all out
      const auto in = [&](long j) { return std::binary_search(out.kept[0].begin(), out.kept[0].end(), j); };
      bool same = true;
      for (long j = b * c; j < (b + 1) * c; ++j) same = same && in(j) == in(b * c);
      CHECK(same);
    }
  }
  // Equal scores: the lowest chunks, then the lowest positions.
  Selection<double> out;
  sel.select(std::vector<Vector<double>>{Vector<double>::Ones(n)}, {25}, out);
  std::vector<long> first(25);
  for (long j = 0; j < 25; ++j) first[static_cast<std::size_t>(j)] = j;
  CHECK(kvc::test::to_long(out.kept[0]) == first);
}

TEST_CASE("ChunkKV preset: SnapKV's window mass, pooled, chunk by chunk, shared by the KV heads", "[selector][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(323);
  for (long n : {10L, 150L}) {  // n = 10 < W = 16: the window is clamped to the cache
    const long Hkv = 2, G = 2, d = 8, W = 16;
    const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d);
    const Eigen::MatrixXd mass = ref::window_mass(ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0), Hkv);
    kvc::test::LayerBuffers<double> b(K, V, Q, Layout::head_major);
    for (long m : {1L, 9L, 40L, 77L, n}) {
      if (m > n) continue;
      INFO("n " << n << " budget " << m);
      const auto got = ChunkKV{}.run(b.view(), Budget::tokens(m));
      const auto want = ref::select_chunks(mass, {m, m}, 0, 32, 5, 20, true);
      for (long g = 0; g < Hkv; ++g) CHECK(kvc::test::to_long(got.heads[g].positions) == want[g]);
    }
  }
  ChunkKV::Arguments bad;
  bad.selector.chunk = 0;
  CHECK_FALSE(TopChunks<>{{0}}.validate().is_ok());
  const ref::Tensor3 K(1, 4, 2), Q(1, 1, 2);
  kvc::test::LayerBuffers<float> b(K, K, Q, Layout::head_major);
  CHECK_THROWS_AS(ChunkKV(bad).run(b.view(), Budget::tokens(2)), kvc::error);
}
