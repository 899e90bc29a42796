// Selector (SPEC §3, §4 pooling, §5): kvc::TopK against kvc::ref::select per KV head and shared, with
// every pooling mode and kernel, forced sinks / recent tokens under small budgets, exact ties, the
// selection invariants, and the StreamingLLM / SnapKV presets.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/selector/top_k.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

using Selector = TopK<>;

struct Config {
  long sinks, recent, kernel;
  Pooling pooling;
  bool shared;
};

std::string describe(const Config& c) {
  return detail::concat("sinks ", c.sinks, " recent ", c.recent, " pooling ", to_string(c.pooling), " kernel ",
                        c.kernel, " ", c.shared ? "shared" : "per_head");
}

Selector make_selector(const Config& c) {
  Selector s;
  s.args.sinks = c.sinks;
  s.args.recent = c.recent;
  s.args.pool_kernel = c.kernel;
  s.args.pooling = c.pooling;
  s.args.granularity = c.shared ? Granularity::shared : Granularity::per_head;
  return s;
}

template <class Real>
std::vector<Vector<Real>> to_lib_scores(const Eigen::MatrixXd& scores) {
  std::vector<Vector<Real>> out;
  for (long g = 0; g < scores.rows(); ++g) out.push_back(scores.row(g).transpose().cast<Real>());
  return out;
}

/// Runs the library selector and the reference on the same scores and checks the kept sets agree and
/// that the selection invariants hold. budgets are the (already clamped to n) per-head budgets.
template <class Real>
void check_selection(const Eigen::MatrixXd& scores, const std::vector<long>& budgets, const Config& c,
                     bool check_threads = true) {
  const long H = scores.rows(), n = scores.cols();
  Selection<Real> sel;
  const std::vector<Index> lib_budgets(budgets.begin(), budgets.end());
  make_selector(c).select(to_lib_scores<Real>(scores), lib_budgets, sel);
  const auto want = ref::select(scores, budgets, c.sinks, c.recent, c.kernel, c.pooling == Pooling::max, c.shared);

  REQUIRE(static_cast<long>(sel.kept.size()) == H);
  REQUIRE(static_cast<long>(sel.evicted.size()) == H);
  CHECK(sel.shared == c.shared);
  for (long g = 0; g < H; ++g) {
    INFO("KV head " << g << " budget " << budgets[static_cast<std::size_t>(g)]);
    const std::vector<long> kept = kvc::test::to_long(sel.kept[g]);
    CHECK(kept == want[static_cast<std::size_t>(g)]);

    // Invariants: size, ascending and unique, in range, forced tokens kept, evicted = complement.
    const long m = std::min(budgets[static_cast<std::size_t>(g)], n);
    CHECK(static_cast<long>(kept.size()) == m);
    CHECK(std::adjacent_find(kept.begin(), kept.end(), [](long a, long b) { return a >= b; }) == kept.end());
    CHECK((kept.empty() || (kept.front() >= 0 && kept.back() < n)));
    const ForcedCounts f = forced_counts(n, m, c.sinks, c.recent);
    CHECK(f.sinks + f.recent <= m);
    std::vector<char> is_kept(static_cast<std::size_t>(n), 0);
    for (long j : kept)
      if (j >= 0 && j < n) is_kept[static_cast<std::size_t>(j)] = 1;
    long missing_forced = 0;
    for (long j = 0; j < f.sinks; ++j) missing_forced += is_kept[static_cast<std::size_t>(j)] ? 0 : 1;
    for (long j = n - f.recent; j < n; ++j) missing_forced += is_kept[static_cast<std::size_t>(j)] ? 0 : 1;
    CHECK(missing_forced == 0);
    std::vector<long> complement;
    for (long j = 0; j < n; ++j)
      if (!is_kept[static_cast<std::size_t>(j)]) complement.push_back(j);
    CHECK(kvc::test::to_long(sel.evicted[g]) == complement);
    if (c.shared) CHECK(sel.kept[g] == sel.kept[0]);
  }
  // The per-head part on 2 or 3 threads: the same selection and pooled scores, bit for bit, into a
  // Selection reused from a call with other budgets (and then from the previous thread count). One
  // head has no other worker.
  if (H == 1 || !check_threads) return;
  Selection<Real> par;
  make_selector(c).select(to_lib_scores<Real>(scores), std::vector<Index>(lib_budgets.size(), 1), par);
  for (Index threads : {2, 3}) {
    INFO("threads " << threads);
    make_selector(c).select(to_lib_scores<Real>(scores), lib_budgets, par, threads);
    CHECK(par.shared == sel.shared);
    CHECK(par.kept == sel.kept);
    CHECK(par.evicted == sel.evicted);
    REQUIRE(par.score.size() == sel.score.size());
    for (std::size_t g = 0; g < sel.score.size(); ++g) {
      REQUIRE(par.score[g].size() == sel.score[g].size());
      CHECK(std::memcmp(par.score[g].data(), sel.score[g].data(),
                        static_cast<std::size_t>(sel.score[g].size()) * sizeof(Real)) == 0);
    }
  }
}

}  // namespace

TEST_CASE("TopK matches the reference selection over sizes, budgets, pooling and granularity", "[selector]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(401);
  std::uniform_int_distribution<int> small_int(0, 5);
  const std::vector<std::pair<Pooling, long>> poolings = {
      {Pooling::none, 0}, {Pooling::average, 1}, {Pooling::average, 3}, {Pooling::average, 5},
      {Pooling::average, 7}, {Pooling::max, 1},  {Pooling::max, 3},     {Pooling::max, 5},
      {Pooling::max, 7}};
  long cases = 0;
  for (long n : {1L, 2L, 7L, 16L, 33L, 65L, 130L}) {
    for (long H : {1L, 3L}) {
      // Continuous scores (double run) and small integers times 105 = 3·5·7 with many exact ties (float
      // run: pooled sums, their division by any kernel and the shared mean keep float and double
      // orderings identical).
      Eigen::MatrixXd cont = kvc::test::random_matrix(rng, H, n);
      Eigen::MatrixXd ints(H, n);
      for (long g = 0; g < H; ++g)
        for (long j = 0; j < n; ++j) ints(g, j) = 105.0 * small_int(rng);
      for (long sinks : {0L, 1L, 4L}) {
        for (long recent : {0L, 3L, 32L}) {
          for (const auto& pk : poolings) {
            for (bool shared : {false, true}) {
              const Config c{sinks, recent, pk.second, pk.first, shared};
              for (long m : {1L, 2L, 5L, n / 2, n - 1, n, n + 5}) {
                if (m < 1) continue;
                std::vector<long> budgets(static_cast<std::size_t>(H), std::min(m, n));
                if (!shared && H > 1) budgets[1] = std::max(1L, std::min(n, m / 2 + 1));  // per-head budgets differ
                INFO(describe(c) << " n " << n << " H " << H << " m " << m);
                ++cases;
                // Threads for two budgets per configuration (each call starts threads).
                const bool threads = m == n / 2 || m == n - 1;
                check_selection<double>(cont, budgets, c, threads);
                check_selection<float>(ints, budgets, c, threads);
              }
            }
          }
        }
      }
    }
  }
  CHECK(cases > 1000);
}

TEST_CASE("float scores at long lengths: the same sets as the reference (the 64-bit key path)", "[selector][long]") {
  // Float scores take TopK's 64-bit-key path (a histogram of the keys' top bits, nth_element only
  // inside the bin holding the k-th best); double scores the (score, position) pairs. Long caches
  // with many exact ties (a few distinct values), negative scores, ±0 (equal, so a tie), ±infinity,
  // a tie that straddles the cut, and budgets at the edges; per head and shared (whose proposal mask
  // restricts the candidates). `narrow` values all share the keys' top bits and differ only below them,
  // with exact ties: a grid of 2^17 values in [1, 1.125) spreads over the next 11 bits (one split by
  // refine_edge), a grid of 2^13 values in [1, 1.002) over only 4 of them and the last 10 (two splits,
  // the bin holding the k-th best then still has some 2500 candidates) before nth_element.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(409);
  std::uniform_int_distribution<int> pick(0, 9);
  std::uniform_real_distribution<double> cont(-1.0, 1.0);
  std::uniform_int_distribution<int> grid(0, (1 << 17) - 1), fine_grid(0, (1 << 13) - 1);
  long cases = 0;
  for (long n : {3000L, 40000L}) {
    const long H = 2;
    Eigen::MatrixXd few(H, n), wide(H, n), narrow(H, n), narrower(H, n);
    for (long g = 0; g < H; ++g)
      for (long j = 0; j < n; ++j) {
        const int v = pick(rng);
        // multiples of 105 = 3·5·7: pooled sums, their division by any kernel and the shared mean of
        // two heads order the same in float and double (as in the test above)
        few(g, j) = 105.0 * (v == 0 ? -0.0 : v == 1 ? 0.0 : v == 2 ? -3.0 : v == 9 ? 7.0 : double(v));
        wide(g, j) = double(float(cont(rng) * std::pow(10.0, pick(rng) - 5)));
        // exact in float, and so are the shared mean of two heads and max pooling
        narrow(g, j) = 1.0 + std::ldexp(double(grid(rng)), -20);
        narrower(g, j) = 1.0 + std::ldexp(double(fine_grid(rng)), -22);
      }
    few(0, n / 2) = std::numeric_limits<double>::infinity();
    few(1, n / 3) = -std::numeric_limits<double>::infinity();
    wide(0, 7) = -0.0;
    wide(0, 8) = 0.0;
    for (const Eigen::MatrixXd* scores : {&few, &wide, &narrow, &narrower})
      for (long m : {1L, 2L, n / 10, n / 4, n / 2, 4 * n / 5, n - 1})
        for (bool shared : {false, true})
          for (const Config& c : {Config{0, 0, 0, Pooling::none, shared}, Config{4, 32, 5, Pooling::average, shared},
                                  Config{1, 3, 3, Pooling::max, shared}}) {
            // wide values: only where no arithmetic touches the scores (float and double may round a
            // pooled average or a mean differently)
            if (scores == &wide && (shared || c.pooling == Pooling::average)) continue;
            if ((scores == &narrow || scores == &narrower) && c.pooling == Pooling::average) continue;
            INFO(describe(c) << " n " << n << " m " << m
                             << (scores == &few    ? " few values"
                                 : scores == &wide ? " wide values"
                                 : scores == &narrow ? " narrow values"
                                                     : " narrower values"));
            std::vector<long> budgets(static_cast<std::size_t>(H), m);
            if (!shared) budgets[1] = std::max(1L, m / 3);
            check_selection<float>(*scores, budgets, c, /*check_threads=*/m == n / 2);
            ++cases;
          }
  }
  CHECK(cases == 2 * 7 * (6 + 2 + 4 + 4));
}

TEST_CASE("a Selection reused across calls of other shapes holds exactly a fresh call's result", "[selector][reuse]") {
  // TopK::select overwrites every field and keeps the vectors' capacity: a Selection left by a call
  // with more or fewer heads, another n, budgets of n or more (nothing evicted) or the other
  // granularity must not leak into the next result.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(417);
  struct Call { long H, n, m; bool shared; };
  const std::vector<Call> calls = {{3, 700, 100, false}, {2, 300, 400, true}, {4, 900, 50, true},
                                   {1, 200, 200, false}, {3, 650, 600, false}, {2, 1000, 999, true}};
  for (Pooling pooling : {Pooling::none, Pooling::average}) {
    Selection<float> reused;
    for (const Call& c : calls) {
      INFO("H " << c.H << " n " << c.n << " m " << c.m << " shared " << c.shared << " pooling " << to_string(pooling));
      std::vector<Vector<float>> scores(static_cast<std::size_t>(c.H));
      for (auto& sc : scores) sc = kvc::test::random_matrix(rng, 1, c.n).row(0).transpose().cast<float>();
      typename TopK<>::Arguments a;
      a.sinks = 2;
      a.recent = 5;
      a.pooling = pooling;
      a.pool_kernel = pooling == Pooling::none ? 0 : 3;
      a.granularity = c.shared ? Granularity::shared : Granularity::per_head;
      const std::vector<Index> budgets(static_cast<std::size_t>(c.H), c.m);
      Selection<float> fresh;
      TopK<>{a}.select(scores, budgets, fresh);
      TopK<>{a}.select(scores, budgets, reused);
      CHECK(reused.shared == fresh.shared);
      CHECK(reused.kept == fresh.kept);
      CHECK(reused.evicted == fresh.evicted);
      REQUIRE(reused.score.size() == fresh.score.size());
      for (std::size_t g = 0; g < fresh.score.size(); ++g) CHECK(reused.score[g] == fresh.score[g]);
    }
  }
}

TEST_CASE("NaN scores (check_finite off) rank below every number, in float and double", "[selector][nan]") {
  // Only reachable with check_finite = false; the selection must stay defined (nth_element needs a
  // strict weak order) and the same in both arithmetic types.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Eigen::MatrixXd scores(1, 12);
  scores << 1, nan, 2, -5, nan, 3, -std::numeric_limits<double>::infinity(), 0, nan, 4, -0.0, 2;
  for (long m : {3L, 6L, 9L, 10L, 11L}) {
    INFO("m " << m);
    Selection<float> sf;
    Selection<double> sd;
    make_selector({0, 0, 0, Pooling::none, false}).select(to_lib_scores<float>(scores), {m}, sf);
    make_selector({0, 0, 0, Pooling::none, false}).select(to_lib_scores<double>(scores), {m}, sd);
    CHECK(sf.kept[0] == sd.kept[0]);
    // the numbers first (best first: 4, 3, 2, 2, 1, 0 / -0 by position, -5, -inf), then NaNs by position
    const std::vector<Index> order = {9, 5, 2, 11, 0, 7, 10, 3, 6, 1, 4, 8};
    std::vector<Index> want(order.begin(), order.begin() + m);
    std::sort(want.begin(), want.end());
    CHECK(sf.kept[0] == want);
  }
}

TEST_CASE("forced tokens never exceed the budget", "[selector][budget]") {
  const long n = 50;
  Eigen::MatrixXd scores = Eigen::MatrixXd::Zero(1, n);
  scores(0, 20) = 100.0;  // a strong candidate that must lose to forced tokens when the budget is tiny
  struct Case {
    long sinks, recent, m;
    std::vector<long> want;
  };
  const std::vector<Case> cases = {
      {4, 8, 1, {0}},                              // sinks only, truncated to m
      {4, 8, 4, {0, 1, 2, 3}},                     // sinks fill the budget
      {4, 8, 6, {0, 1, 2, 3, 48, 49}},             // then the most recent tokens
      {4, 8, 12, {0, 1, 2, 3, 42, 43, 44, 45, 46, 47, 48, 49}},
      {4, 8, 13, {0, 1, 2, 3, 20, 42, 43, 44, 45, 46, 47, 48, 49}},  // one slot left for the score
      {0, 3, 1, {49}},
      {0, 0, 1, {20}},
      {60, 0, 10, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}},  // sinks > n
  };
  for (const auto& c : cases) {
    INFO("sinks " << c.sinks << " recent " << c.recent << " m " << c.m);
    for (Pooling p : {Pooling::none, Pooling::max}) {
      const Config cfg{c.sinks, c.recent, p == Pooling::none ? 0 : 5, p, false};
      if (p == Pooling::none) {  // (max pooling spreads the strong score to its neighbours)
        Selection<double> sel;
        make_selector(cfg).select(to_lib_scores<double>(scores), {c.m}, sel);
        CHECK(kvc::test::to_long(sel.kept[0]) == c.want);
      }
      check_selection<double>(scores, {c.m}, cfg);
    }
  }
}

TEST_CASE("budgets of n or more keep everything", "[selector][budget]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(402);
  const Eigen::MatrixXd scores = kvc::test::random_matrix(rng, 2, 20);
  for (bool shared : {false, true}) {
    for (long m : {20L, 21L, 1000L}) {
      Selection<double> sel;
      make_selector({4, 8, 5, Pooling::average, shared}).select(to_lib_scores<double>(scores), {m, m}, sel);
      std::vector<Index> all(20);
      std::iota(all.begin(), all.end(), Index(0));
      for (int g = 0; g < 2; ++g) {
        CHECK(sel.kept[g] == all);
        CHECK(sel.evicted[g].empty());
      }
    }
  }
  Selection<double> sel;
  KeepAll{}.select(to_lib_scores<double>(scores), {3, 3}, sel);
  CHECK(sel.kept[1].size() == 20);
  CHECK(sel.evicted[1].empty());
}

TEST_CASE("exact ties go to the lower position", "[selector][ties]") {
  SECTION("all scores equal: the earliest candidates win") {
    const Eigen::MatrixXd scores = Eigen::MatrixXd::Constant(2, 30, 0.25);
    for (Pooling p : {Pooling::none, Pooling::max}) {
      Selection<float> sel;
      make_selector({2, 3, 3, p, false}).select(to_lib_scores<float>(scores), {9, 7}, sel);
      CHECK(kvc::test::to_long(sel.kept[0]) == std::vector<long>{0, 1, 2, 3, 4, 5, 27, 28, 29});
      CHECK(kvc::test::to_long(sel.kept[1]) == std::vector<long>{0, 1, 2, 3, 27, 28, 29});
    }
  }
  SECTION("repeated values: earlier copies win") {
    Eigen::MatrixXd scores(1, 12);
    scores << 1, 3, 2, 3, 1, 3, 2, 3, 0, 2, 3, 1;  // 3 at 1, 3, 5, 7, 10; 2 at 2, 6, 9
    Selection<double> sel;
    make_selector({0, 0, 0, Pooling::none, false}).select(to_lib_scores<double>(scores), {3}, sel);
    CHECK(kvc::test::to_long(sel.kept[0]) == std::vector<long>{1, 3, 5});
    make_selector({0, 0, 0, Pooling::none, false}).select(to_lib_scores<double>(scores), {6}, sel);
    CHECK(kvc::test::to_long(sel.kept[0]) == std::vector<long>{1, 2, 3, 5, 7, 10});
    check_selection<double>(scores, {6}, {0, 0, 0, Pooling::none, false});
  }
  SECTION("shared: the union of proposals is trimmed by the mean, ties to the lower position") {
    // Head 0 proposes {0}, head 1 proposes {1}; position 2 has the best mean but nobody proposed it.
    Eigen::MatrixXd scores(2, 5);
    scores << 10, 0, 6, 0, 0,  //
        0, 10, 6, 0, 0;
    Selection<double> sel;
    make_selector({0, 0, 0, Pooling::none, true}).select(to_lib_scores<double>(scores), {1, 1}, sel);
    CHECK(kvc::test::to_long(sel.kept[0]) == std::vector<long>{0});
    CHECK(kvc::test::to_long(sel.kept[1]) == std::vector<long>{0});
    check_selection<double>(scores, {1, 1}, {0, 0, 0, Pooling::none, true});
    check_selection<double>(scores, {2, 2}, {0, 0, 0, Pooling::none, true});
    // The shared score is the raw mean of the heads' scores.
    CHECK(sel.score[0][2] == 6.0);
    CHECK(sel.score[1][0] == 5.0);
  }
}

TEST_CASE("pooled scores follow SPEC §4 and stay inside the candidate region", "[selector][pooling]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(403);
  const long n = 40;
  const Eigen::MatrixXd scores = kvc::test::random_matrix(rng, 1, n);  // negative values too (max padding)
  for (Pooling p : {Pooling::average, Pooling::max}) {
    for (long kernel : {1L, 3L, 5L, 7L}) {
      for (long m : {10L, 25L}) {
        INFO(to_string(p) << " kernel " << kernel << " m " << m);
        Selection<double> sel;
        make_selector({3, 6, kernel, p, false}).select(to_lib_scores<double>(scores), {m}, sel);
        const ForcedCounts f = forced_counts(n, m, 3, 6);
        const std::vector<double> want =
            ref::pool(ref::row_vector(scores, 0), n, f.sinks, f.recent, kernel, p == Pooling::max);
        CHECK(kvc::test::within(kvc::test::to_std(sel.score[0]), want, kTol.float_vs_double.mass));
        // Outside [sinks, n - recent) the raw score is kept.
        for (long j = 0; j < f.sinks; ++j) CHECK(sel.score[0][j] == scores(0, j));
        for (long j = n - f.recent; j < n; ++j) CHECK(sel.score[0][j] == scores(0, j));
      }
    }
  }
}

TEST_CASE("TopK::validate rejects bad options", "[selector][errors]") {
  Selector s;
  CHECK(s.validate());
  s.args.pooling = Pooling::average;
  s.args.pool_kernel = 4;
  CHECK(s.validate().code() == Status::Code::invalid_argument);
  CHECK_THAT(s.validate().message(), Catch::Contains("pool_kernel"));
  s.args.pool_kernel = 0;
  CHECK_FALSE(s.validate());
  s.args.pool_kernel = 5;
  CHECK(s.validate());
  s.args.sinks = -1;
  CHECK_THAT(s.validate().message(), Catch::Contains("sinks"));
  s.args.sinks = 0;
  s.args.recent = -2;
  CHECK_THAT(s.validate().message(), Catch::Contains("recent"));
}

namespace {

struct Layer {
  ref::Tensor3 K, V, Q;
};

Layer random_layer(std::mt19937_64& rng, long Hkv, long G, long n, long d, long W) {
  Layer l{kvc::test::random_tensor(rng, Hkv, n, d), kvc::test::random_tensor(rng, Hkv, n, d),
          kvc::test::random_tensor(rng, Hkv * G, W, d)};
  return l;
}

}  // namespace

TEST_CASE("StreamingLLM keeps the 4 sinks and the most recent tokens", "[selector][presets]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(404);
  const long n = 50;
  const Layer l = random_layer(rng, 2, 2, n, 8, 8);
  kvc::test::LayerBuffers<float> b(l.K, l.V, l.Q, Layout::token_major);
  for (long m : {1L, 3L, 4L, 5L, 10L, 49L, 50L, 80L}) {
    INFO("m " << m);
    const auto r = StreamingLLM{}.run(b.view(), Budget::tokens(m));
    std::vector<long> want;
    const long mm = std::min(m, n);
    for (long j = 0; j < std::min(4L, mm); ++j) want.push_back(j);
    for (long j = n - (mm - std::min(4L, mm)); j < n; ++j) want.push_back(j);
    for (int g = 0; g < 2; ++g) {
      CHECK(kvc::test::to_long(r.heads[g].positions) == want);
      CHECK(r.heads[g].size() == mm);
    }
  }
}

TEST_CASE("SnapKV keeps its 32-token window and selects the rest by pooled mass", "[selector][presets]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(405);
  const long n = 100, W = 32, Hkv = 2, G = 2;
  const Layer l = random_layer(rng, Hkv, G, n, 16, W);
  kvc::test::LayerBuffers<double> b(l.K, l.V, l.Q, Layout::head_major);
  const auto probs = ref::window_probs(l.Q, l.K, 1.0 / 4.0, 0.0);
  const Eigen::MatrixXd mass = ref::window_mass(probs, Hkv);
  for (long m : {32L, 33L, 40L, 64L, 99L}) {
    INFO("m " << m);
    const auto r = SnapKV{}.run(b.view(), Budget::tokens(m));
    const auto want = ref::select(mass, {m, m}, 0, 32, 5, false, false);
    for (long g = 0; g < Hkv; ++g) {
      const std::vector<long> kept = kvc::test::to_long(r.heads[g].positions);
      CHECK(kept == want[static_cast<std::size_t>(g)]);
      REQUIRE(static_cast<long>(kept.size()) == m);
      const std::vector<long> all = ref::contiguous_positions(n);
      CHECK(std::vector<long>(kept.end() - 32, kept.end()) == std::vector<long>(all.end() - 32, all.end()));
    }
  }
  // Below the window size the budget is all recent tokens.
  const auto r = SnapKV{}.run(b.view(), Budget::tokens(10));
  std::vector<long> last10;
  for (long j = n - 10; j < n; ++j) last10.push_back(j);
  CHECK(kvc::test::to_long(r.heads[0].positions) == last10);
}

TEST_CASE("pool_region: average pooling equals the per-position loop bit for bit", "[selector][pooling]") {
  // The interior (full windows) is summed a shifted segment at a time; each output must still be
  // ((x[j−h] + x[j−h+1]) + …) / kernel in that order, like the edges.
  INFO("seed " << kvc::test::test_seed());
  std::mt19937_64 rng = kvc::test::make_rng(307);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (long n : {1L, 2L, 5L, 9L, 33L, 130L}) {
    Vector<float> x(n);
    for (long j = 0; j < n; ++j) x[j] = u(rng) * (j % 3 == 0 ? 1e-3f : 7.0f);
    for (long kernel : {1L, 3L, 5L, 7L, 9L})
      for (long lo = 0; lo <= std::min(n, 4L); ++lo)
        for (long hi = lo; hi <= n; hi += std::max(1L, (n - lo) / 5)) {
          INFO("n " << n << " kernel " << kernel << " region [" << lo << ", " << hi << ")");
          Vector<float> got;
          pool_region(x, lo, hi, kernel, Pooling::average, got);
          Vector<float> want = x;
          if (kernel > 1)
            for (long j = lo; j < hi; ++j) {
              float s = 0.0f;
              for (long t = std::max(lo, j - kernel / 2); t <= std::min(hi - 1, j + kernel / 2); ++t) s += x[t];
              want[j] = s / static_cast<float>(kernel);
            }
          REQUIRE(got.size() == n);
          CHECK((got.array() == want.array()).all());
          // In place (out is x), and into a reused output of another content.
          Vector<float> inplace = x;
          pool_region(inplace, lo, hi, kernel, Pooling::average, inplace);
          CHECK((inplace.array() == want.array()).all());
          Vector<float> reused = Vector<float>::Constant(n, -3.0f);
          pool_region(x, lo, hi, kernel, Pooling::average, reused);
          CHECK((reused.array() == want.array()).all());
        }
  }
}
