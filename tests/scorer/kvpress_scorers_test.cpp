// LocalLeverage (CUR) and LagRelative (LagKV) against the reference scorers in every storage type and
// both layouts, their invariances, the sizes around the window and the partition, ties, and the CUR
// and LagKV presets' selections.
#include <catch2/catch.hpp>

#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/scorer/lag_relative.hpp>
#include <kvcompress/scorer/local_leverage.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

/// Scores of every KV head from `scorer` (which reads no mass): (Hkv, n) in double.
template <class Scorer, class T>
Eigen::MatrixXd scores_of(const Scorer& scorer, const LayerView<T>& layer) {
  using Real = compute_t<T>;
  Eigen::MatrixXd out(layer.kv_heads(), layer.tokens());
  const AttentionArguments attention;
  const Vector<Real> mass = Vector<Real>::Zero(layer.tokens());
  for (Index g = 0; g < layer.kv_heads(); ++g) {
    Vector<Real> s;
    scorer.score(ScoreContext<T>(layer, g, attention, mass), s);
    REQUIRE(s.size() == layer.tokens());
    out.row(g) = s.template cast<double>().transpose();
  }
  return out;
}

/// The scorer in float, double, half and bfloat16 storage, both layouts, against `reference` (called
/// on the original inputs for float / double, on the rounded inputs for half / bfloat16).
template <class Scorer, class Reference>
void check_against_reference(const Scorer& scorer, const ref::Tensor3& K, const ref::Tensor3& V,
                             const ref::Tensor3& Q, Reference reference) {
  const kvc::test::Tol& tol = kTol.float_vs_double.mass;  // double arithmetic, one rounding to float
  const Eigen::MatrixXd want = reference(K, V);
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    INFO("layout " << kvc::test::to_string(layout));
    kvc::test::LayerBuffers<float> f(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, f.view()), want, tol) <= 1.0);
    kvc::test::LayerBuffers<double> dd(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, dd.view()), want, {1e-12, 1e-15, 1e-12}) <= 1.0);
    kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, h.view()), reference(h.keys.rounded(), h.values.rounded()),
                                       tol) <= 1.0);
    kvc::test::LayerBuffers<Eigen::bfloat16> b(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, b.view()), reference(b.keys.rounded(), b.values.rounded()),
                                       tol) <= 1.0);
  }
}

/// LagRelative's rank scores `got` from float arithmetic against the reference on the inputs k, v:
/// the same scores (within the rounding of r/L to float), except that an entry of a scored partition may take the rank of another entry of
/// that partition whose reference score (rank off) is within float tolerance of its own: float
/// rounding decides the order of near-ties.
void compare_lag_ranks(const Eigen::MatrixXd& got, const ref::Tensor3& k, const ref::Tensor3& v,
                       const LagRelative::Arguments& args) {
  const Eigen::MatrixXd rank = ref::lag_relative(k, v, args.sinks, args.lag, true);
  const Eigen::MatrixXd score = ref::lag_relative(k, v, args.sinks, args.lag, false);
  const long n = rank.cols(), s = std::min<long>(args.sinks, n), L = args.lag;
  REQUIRE(got.rows() == rank.rows());
  REQUIRE(got.cols() == n);
  for (long g = 0; g < rank.rows(); ++g)
    for (long j = 0; j < n; ++j) {
      const kvc::test::Tol& tol = kTol.float_vs_double.mass;  // a rank r/L rounded to float
      if (kvc::test::within(got(g, j), rank(g, j), tol)) continue;
      INFO("head " << g << " entry " << j << " score " << got(g, j) << " reference " << rank(g, j));
      REQUIRE(j >= s);
      const long lo = s + (j - s) / L * L, hi = std::min(lo + L, n);
      long i = lo;
      while (i < hi && !kvc::test::within(got(g, j), rank(g, i), tol)) ++i;
      REQUIRE(i < hi);  // a rank of j's own partition
      CHECK(kvc::test::within(score(g, i), score(g, j), tol));
    }
}

/// LagRelative with `rank` on, in every storage type and both layouts, against the reference: double
/// storage exactly, float, half and bfloat16 (float arithmetic; half and bfloat16 against the
/// reference on their rounded inputs) by compare_lag_ranks.
void check_lag_ranks(const LagRelative::Arguments& args, const ref::Tensor3& K, const ref::Tensor3& V,
                     const ref::Tensor3& Q) {
  const LagRelative scorer{args};
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    INFO("layout " << kvc::test::to_string(layout));
    kvc::test::LayerBuffers<double> dd(K, V, Q, layout);
    CHECK(scores_of(scorer, dd.view()) == ref::lag_relative(K, V, args.sinks, args.lag, true));
    kvc::test::LayerBuffers<float> f(K, V, Q, layout);
    compare_lag_ranks(scores_of(scorer, f.view()), K, V, args);
    kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, layout);
    compare_lag_ranks(scores_of(scorer, h.view()), h.keys.rounded(), h.values.rounded(), args);
    kvc::test::LayerBuffers<Eigen::bfloat16> b(K, V, Q, layout);
    compare_lag_ranks(scores_of(scorer, b.view()), b.keys.rounded(), b.values.rounded(), args);
  }
}

ref::Tensor3 scaled(ref::Tensor3 t, double a) {
  for (double& x : t.data) x *= a;
  return t;
}

}  // namespace

TEST_CASE("LocalLeverage (CUR) scores are windowed key times value squared norms, summing to 1", "[scorer]") {
  STATIC_REQUIRE_FALSE(policy_traits<LocalLeverage>::needs_mass);
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(311);
  // n around the window w (1, w − 1, w, w + 1, 3w + 2) and d around the vector width.
  const long shapes[][3] = {{1, 1, 1}, {2, 15, 7}, {1, 16, 8}, {2, 17, 16}, {3, 50, 33}, {1, 130, 64}};
  for (const auto& sh : shapes) {
    ref::Tensor3 K = kvc::test::random_tensor(rng, sh[0], sh[1], sh[2]);
    ref::Tensor3 V = kvc::test::random_tensor(rng, sh[0], sh[1], sh[2]);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, sh[0], 2, sh[2]);
    if (sh[1] >= 32)  // a window of zero keys (its κ̂ is 0, not 0/0) and a zero value
      for (long j = 16; j < 32; ++j)
        for (long k = 0; k < sh[2]; ++k) K.at(0, j, k) = 0.0;
    for (long k = 0; k < sh[2]; ++k) V.at(sh[0] - 1, sh[1] - 1, k) = 0.0;
    for (const LocalLeverage::Arguments args : {LocalLeverage::Arguments{}, LocalLeverage::Arguments{0, 1},
                                                LocalLeverage::Arguments{2, 5}, LocalLeverage::Arguments{0, 200}}) {
      INFO("Hkv " << sh[0] << " n " << sh[1] << " d " << sh[2] << " sinks " << args.sinks << " window " << args.window);
      check_against_reference(LocalLeverage{args}, K, V, Q, [&](const ref::Tensor3& k, const ref::Tensor3& v) {
        return ref::local_leverage(k, v, args.sinks, args.window);
      });
      // Without sinks the scores are a distribution over the head's tokens (n = 1: its value is zero).
      if (args.sinks == 0 && sh[1] > 1) {
        kvc::test::LayerBuffers<double> dd(K, V, Q, Layout::head_major);
        const Eigen::MatrixXd got = scores_of(LocalLeverage{args}, dd.view());
        CHECK((got.rowwise().sum().array() - 1.0).abs().maxCoeff() <= 1e-12);
        CHECK(got.minCoeff() >= 0.0);
      }
    }
  }
}

TEST_CASE("LocalLeverage: invariant to scaling the keys or the values of one window", "[scorer]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(312);
  const ref::Tensor3 K = kvc::test::random_tensor(rng, 2, 40, 8), V = kvc::test::random_tensor(rng, 2, 40, 8);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, 2, 2, 8);
  ref::Tensor3 K2 = scaled(K, 1e20), V2 = V;  // every key: huge, whose squares overflow float
  for (long j = 16; j < 32; ++j)                // the values of the second window only
    for (long k = 0; k < 8; ++k) V2.at(1, j, k) *= 1e-3;
  kvc::test::LayerBuffers<float> a(K, V, Q, Layout::head_major), b(K2, V2, Q, Layout::head_major);
  const Eigen::MatrixXd sa = scores_of(LocalLeverage{}, a.view()), sb = scores_of(LocalLeverage{}, b.view());
  REQUIRE(sb.allFinite());
  CHECK(kvc::test::elementwise_ratio(sb, sa, kTol.float_vs_double.mass) <= 1.0);
}

TEST_CASE("LagRelative (LagKV) scores: partitions against their successor, then the sinks and the tail", "[scorer]") {
  STATIC_REQUIRE_FALSE(policy_traits<LagRelative>::needs_mass);
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(313);
  // With L = 8 and s sinks: n < s + 2L (no partition scored), n = s + 2L (one), + 3, + 5L + 7.
  for (const LagRelative::Arguments args : {LagRelative::Arguments{4, 8, true}, LagRelative::Arguments{4, 8, false},
                                            LagRelative::Arguments{0, 8, true}, LagRelative::Arguments{2, 1, false},
                                            LagRelative::Arguments{}}) {
    const long s = args.sinks, L = args.lag;
    for (long n : {1L, s + 1, s + 2 * L - 1, s + 2 * L, s + 2 * L + 3, s + 5 * L + 7, 300L}) {
      // 64 and 128: eight SIMD batches of channels with AVX2 and with AVX-512 (x̂ kept in registers).
      for (long d : {1L, 3L, 16L, 35L, 64L, 128L}) {
        INFO("sinks " << s << " lag " << L << " rank " << args.rank << " n " << n << " d " << d);
        ref::Tensor3 K = kvc::test::random_tensor(rng, 2, n, d), V = kvc::test::random_tensor(rng, 2, n, d);
        const ref::Tensor3 Q = kvc::test::random_tensor(rng, 2, 1, d);
        if (n > s + 2 * L)  // a channel constant over a reference partition: x̂ = 0, not 0/0
          for (long j = s + L; j < s + 2 * L; ++j) K.at(1, j, 0) = 0.5;
        if (args.rank) {
          check_lag_ranks(args, K, V, Q);
        } else {
          check_against_reference(LagRelative{args}, K, V, Q, [&](const ref::Tensor3& k, const ref::Tensor3& v) {
            return ref::lag_relative(k, v, args.sinks, args.lag, false);
          });
        }
      }
    }
  }
}

TEST_CASE("LagRelative on float caches: where float cannot normalise or its spreads overflow, double takes over", "[scorer]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(315);
  const long s = 2, L = 8, n = s + 4 * L + 3;
  auto as_float = [](ref::Tensor3 t, double a) {  // scaled, then rounded to float: the cache's exact values
    for (double& x : t.data) x = static_cast<double>(static_cast<float>(x * a));
    return t;
  };
  for (int c = 0; c < 3; ++c) {
    for (long d : {35L, 64L, 128L}) {
      INFO("case " << c << " d " << d);
      const ref::Tensor3 Q = kvc::test::random_tensor(rng, 2, 1, d);
      ref::Tensor3 K = kvc::test::random_tensor(rng, 2, n, d), V = kvc::test::random_tensor(rng, 2, n, d);
      if (c == 0) {  // ranges of about 1e-40: their reciprocals overflow float
        K = as_float(K, 1e-40);
        V = as_float(V, 1e-40);
      } else if (c == 1) {  // ranges of about 1e38: reciprocals below the normal floats
        K = as_float(K, 4e37);
        V = as_float(V, 1.0);
      } else {  // partition 0 about 1e36 times partition 1's range: x̂² overflows float
        for (long g = 0; g < 2; ++g)
          for (long j = s; j < s + L; ++j)
            for (long k = 0; k < d; ++k) K.at(g, j, k) *= 1e36;
        K = as_float(K, 1.0);
        V = as_float(V, 1.0);
      }
      kvc::test::LayerBuffers<float> f(K, V, Q, Layout::head_major);
      for (const bool rank : {true, false}) {
        INFO("rank " << rank);
        const LagRelative::Arguments args{s, L, rank};
        const Eigen::MatrixXd got = scores_of(LagRelative{args}, f.view());
        REQUIRE(got.allFinite());
        if (rank)
          compare_lag_ranks(got, K, V, args);
        else
          CHECK(kvc::test::elementwise_ratio(got, ref::lag_relative(K, V, s, L, false), kTol.float_vs_double.mass) <= 1.0);
      }
    }
  }
}

TEST_CASE("LagRelative: ranks are a permutation per partition; invariant to per-channel affine maps", "[scorer]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(314);
  const long s = 4, L = 16, n = s + 4 * L + 5, d = 8;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, 1, n, d), V = kvc::test::random_tensor(rng, 1, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, 1, 1, d);
  const LagRelative scorer{{s, L, true}};
  kvc::test::LayerBuffers<double> b(K, V, Q, Layout::head_major);
  const Eigen::MatrixXd got = scores_of(scorer, b.view());
  for (long p = 0; p < 3; ++p) {  // partitions 0..2 are scored (3 is the last full one: tail)
    std::vector<double> ranks(got.row(0).data() + s + p * L, got.row(0).data() + s + (p + 1) * L);
    std::sort(ranks.begin(), ranks.end());
    for (long r = 0; r < L; ++r) CHECK(ranks[static_cast<std::size_t>(r)] == double(r) / double(L));
  }
  for (long j = 0; j < s; ++j) CHECK(got(0, j) == 2.0);  // the sinks first, then the tail, newest first
  for (long j = s + 3 * L; j < n; ++j) CHECK(got(0, j) == 1.0 + double(j - s - 3 * L) / double(n - s - 3 * L));
  // x_{j,c} → a_c·x_{j,c} + b_c with a_c > 0 leaves every x̂, hence every score, unchanged.
  std::uniform_real_distribution<double> scale(0.1, 10.0), shift(-5.0, 5.0);
  ref::Tensor3 K2 = K, V2 = V;
  for (long c = 0; c < d; ++c) {
    const double ka = scale(rng), kb = shift(rng), va = scale(rng), vb = shift(rng);
    for (long j = 0; j < n; ++j) {
      K2.at(0, j, c) = ka * K.at(0, j, c) + kb;
      V2.at(0, j, c) = va * V.at(0, j, c) + vb;
    }
  }
  kvc::test::LayerBuffers<double> b2(K2, V2, Q, Layout::head_major);
  CHECK(scores_of(scorer, b2.view()) == got);
  const LagRelative soft{{s, L, false}};
  CHECK(kvc::test::elementwise_ratio(scores_of(soft, b2.view()), scores_of(soft, b.view()), {1e-9, 1e-15, 1e-9}) <= 1.0);
}

TEST_CASE("LagRelative on float caches ranks its own scores: ascending, ties by position, at every lag", "[scorer]") {
  // Lags below, at and above the sizes up to which the ranks come from pairwise comparisons (16 vectors:
  // 64, 128 or 256 scores), odd ones (not a multiple of the vector width); every third row repeats the
  // one before it, so scores tie.
  auto rng = kvc::test::make_rng(2718);
  for (const long L : {1L, 37L, 64L, 65L, 128L, 129L, 256L, 257L, 1100L}) {
    const long s = 3, n = s + 3 * L + 5, d = 4;
    ref::Tensor3 K = kvc::test::random_tensor(rng, 1, n, d), V = kvc::test::random_tensor(rng, 1, n, d);
    for (long j = 1; j < n; j += 3)
      for (long c = 0; c < d; ++c) {
        K.at(0, j, c) = K.at(0, j - 1, c);
        V.at(0, j, c) = V.at(0, j - 1, c);
      }
    const ref::Tensor3 Q(1, 1, d);
    kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
    const Eigen::MatrixXd rank = scores_of(LagRelative{{s, L, true}}, b.view());
    const Eigen::MatrixXd soft = scores_of(LagRelative{{s, L, false}}, b.view());  // float scores
    long ties = 0;
    for (long p = 0; p < 2; ++p)  // the scored partitions; the third is the tail
      for (long j = s + p * L; j < s + (p + 1) * L; ++j) {
        long r = 0;
        for (long i = s + p * L; i < s + (p + 1) * L; ++i) {
          r += soft(0, i) < soft(0, j) || (soft(0, i) == soft(0, j) && i < j);
          ties += i != j && soft(0, i) == soft(0, j);
        }
        INFO("lag " << L << " entry " << j);
        REQUIRE(rank(0, j) == double(static_cast<float>(double(r) / double(L))));
      }
    if (L >= 37) CHECK(ties > 0);
  }
}

TEST_CASE("LagRelative: identical tokens tie, and ties rank by position", "[scorer]") {
  const long s = 2, L = 4, n = s + 3 * L, d = 4;
  ref::Tensor3 K(1, n, d), V(1, n, d);
  for (long j = 0; j < n; ++j)
    for (long c = 0; c < d; ++c) {
      K.at(0, j, c) = double(c) + (j >= s + L ? double(j % 3) : 0.0);  // partition 0: identical rows
      V.at(0, j, c) = double(c % 2) + (j >= s + L ? double(j % 2) : 0.0);
    }
  const ref::Tensor3 Q(1, 1, d);
  kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
  const Eigen::MatrixXd got = scores_of(LagRelative{{s, L, true}}, b.view());
  for (long j = 0; j < L; ++j) CHECK(got(0, s + j) == double(j) / double(L));
}

TEST_CASE("LagRelative and LocalLeverage take a lag or window up to the largest Index", "[scorer]") {
  // 2·lag and sinks + window overflow Index there: the scores equal those of a lag or window of n.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(317);
  const long n = 40, d = 4;
  const Index huge = std::numeric_limits<Index>::max();
  const ref::Tensor3 K = kvc::test::random_tensor(rng, 2, n, d), V = kvc::test::random_tensor(rng, 2, n, d),
                     Q = kvc::test::random_tensor(rng, 2, 1, d);
  kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
  CHECK((scores_of(LagRelative{{4, huge, true}}, b.view()) == scores_of(LagRelative{{4, n, true}}, b.view())));
  CHECK((scores_of(LagRelative{{huge, 8, false}}, b.view()) == scores_of(LagRelative{{n, 8, false}}, b.view())));
  CHECK((scores_of(LocalLeverage{{4, huge}}, b.view()) == scores_of(LocalLeverage{{4, n}}, b.view())));
  CHECK((scores_of(LocalLeverage{{huge, 16}}, b.view()) == scores_of(LocalLeverage{{n, 16}}, b.view())));
}

TEST_CASE("CUR and LagKV presets select like the reference", "[scorer][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(315);
  const long Hkv = 2, n = 300, d = 8;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * 2, 40, d);  // W = 40 > the n of the short layer
  kvc::test::LayerBuffers<double> b(K, V, Q, Layout::head_major);
  const Eigen::MatrixXd cur_scores = ref::local_leverage(K, V, 4, 16), lag_scores = ref::lag_relative(K, V, 4, 128, true);
  for (long m : {1L, 4L, 9L, 100L, 299L, 300L}) {
    INFO("budget " << m);
    const auto cur = CUR{}.run(b.view(), Budget::tokens(m));
    const auto lag = LagKV{}.run(b.view(), Budget::tokens(m));
    const auto want_cur = ref::select(cur_scores, {m, m}, 0, 0, 0, false, false);
    const auto want_lag = ref::select(lag_scores, {m, m}, 0, 0, 0, false, false);
    for (long g = 0; g < Hkv; ++g) {
      CHECK(kvc::test::to_long(cur.heads[g].positions) == want_cur[g]);
      CHECK(kvc::test::to_long(lag.heads[g].positions) == want_lag[g]);
    }
  }
  // A budget below the sinks and the tail: the sinks, then the newest tokens.
  const auto newest = LagKV{}.run(b.view(), Budget::tokens(10));
  for (long g = 0; g < Hkv; ++g)
    CHECK(kvc::test::to_long(newest.heads[g].positions) == std::vector<long>{0, 1, 2, 3, 294, 295, 296, 297, 298, 299});
  // A layer shorter than the window (W > n) and than two partitions: the sinks, then the newest tokens.
  ref::Tensor3 Ks(Hkv, 20, d), Vs(Hkv, 20, d);
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < 20; ++j)
      for (long c = 0; c < d; ++c) {
        Ks.at(g, j, c) = K.at(g, j, c);
        Vs.at(g, j, c) = V.at(g, j, c);
      }
  kvc::test::LayerBuffers<float> s(Ks, Vs, Q, Layout::token_major);
  const auto lag = LagKV{}.run(s.view(), Budget::tokens(7));
  for (long g = 0; g < Hkv; ++g) CHECK(kvc::test::to_long(lag.heads[g].positions) == std::vector<long>{0, 1, 2, 3, 17, 18, 19});
  const auto cur = CUR{}.run(s.view(), Budget::tokens(7));
  const auto want_cur = ref::select(ref::local_leverage(Ks, Vs, 4, 16), {7, 7}, 0, 0, 0, false, false);
  for (long g = 0; g < Hkv; ++g) CHECK(kvc::test::to_long(cur.heads[g].positions) == want_cur[g]);
}

TEST_CASE("CUR and LagKV reject bad options", "[scorer]") {
  CHECK_FALSE(LocalLeverage{{4, 0}}.validate().is_ok());
  CHECK_FALSE(LocalLeverage{{-1, 16}}.validate().is_ok());
  CHECK_FALSE(LagRelative{{4, 0, true}}.validate().is_ok());
  CHECK_FALSE(LagRelative{{-2, 8, true}}.validate().is_ok());
  CHECK(LagRelative{}.validate().is_ok());
}
