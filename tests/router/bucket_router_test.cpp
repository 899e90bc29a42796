// BucketRouter (SPEC §6) against the reference router kvc::ref::route: the three statistics, bucket
// sizes 1, 4, 32 and 0 (Global), the empty-bucket fallback, ties and zero-norm keys.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/router/bucket_router.hpp>

#include "support/bridge.hpp"
#include "support/dots_against.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::complement;
using kvc::test::Layout;
using kvc::test::library_mass;
using kvc::test::random_subset;

namespace {

RouteStatistic library_stat(int s) {
  return s == ref::RouteKeyCosine ? RouteStatistic::key_cosine
         : s == ref::RouteWindowMass ? RouteStatistic::window_mass : RouteStatistic::co_attention;
}

/// Routes head g with the library and returns, per evicted token (ascending), the kept POSITION it
/// was sent to. `mass` is what the context hands the router (window_mass statistic). Also routes with
/// the overload that writes the kept keys (fills_keys) into a NaN-filled matrix: the routing must be
/// the same and every kept key row bit-identical to the cache's row, converted; once with ordinary
/// stores and once with `streaming` (streaming stores where the rows are aligned for them).
template <class T>
std::vector<long> library_route(const LayerView<T>& layer, Index g, const Vector<compute_t<T>>& mass,
                                const std::vector<Index>& kept, Index bucket, RouteStatistic stat) {
  const AttentionArguments attn;
  const std::vector<Index> evicted = complement(kept, layer.tokens());
  HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
  typename BucketRouter<>::Arguments args;
  args.bucket = bucket;
  args.statistic = stat;
  Routing routing;
  BucketRouter<>{args}.route(ctx, routing);
  using Real = compute_t<T>;
  for (const bool streaming : {false, true}) {
    INFO("streaming " << streaming);
    RowMatrix<Real> kept_keys = RowMatrix<Real>::Constant(static_cast<Index>(kept.size()), layer.head_dim(),
                                                          std::numeric_limits<Real>::quiet_NaN());
    Routing routing_fill;
    ctx.set_streaming_stores(streaming);
    BucketRouter<>{args}.route(ctx, routing_fill, kept_keys);
    CHECK(routing_fill.target == routing.target);
    for (std::size_t i = 0; i < kept.size(); ++i) {
      bool row_equal = true;
      for (Index k = 0; k < layer.head_dim(); ++k)
        row_equal = row_equal && kept_keys(static_cast<Index>(i), k) == to_real<Real>(layer.keys.row(g, kept[i])[k]);
      if (!row_equal) FAIL_CHECK("kept key row " << i << " (position " << kept[i] << ") not written as the cache's row");
    }
  }
  std::vector<long> out;
  if (routing.target.size() != evicted.size()) return out;  // the caller checks the size
  for (Index t : routing.target)
    out.push_back(t >= 0 && t < static_cast<Index>(kept.size()) ? static_cast<long>(kept[t]) : -1L);
  return out;
}

/// The reference route restricted to the evicted positions (ascending).
std::vector<long> reference_route(long g, const std::vector<Index>& kept, long n, int stat, long bucket,
                                  const ref::Tensor3& K, const Eigen::MatrixXd& a,
                                  const std::vector<Eigen::MatrixXd>& probs, long G) {
  const std::vector<long> full = ref::route(g, kvc::test::to_long(kept), n, stat, bucket, K, a, probs, G);
  std::vector<long> out;
  for (Index j : complement(kept, n)) out.push_back(full[static_cast<std::size_t>(j)]);
  return out;
}

/// 2 KV heads, 4 query heads, n = 80, d = 16, W = 8.
struct Layer : kvc::test::HeadData {
  explicit Layer(std::uint64_t stream) : HeadData(stream, 2, 4, 80) {}
};

}  // namespace

TEMPLATE_TEST_CASE("BucketRouter matches the reference for every statistic and bucket size", "[router]", float,
                   double) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Layer f(101);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), Q = b.queries.rounded();
  const double scale = 1.0 / std::sqrt(double(f.d));
  const auto probs = ref::window_probs(Q, K, scale, 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);

  // Kept patterns: a random subset (most buckets populated) and spans with empty buckets between.
  std::vector<std::vector<Index>> patterns;
  patterns.push_back(random_subset(f.rng, f.n, 20));
  patterns.push_back({0, 1, 2, 3, 40, 41, 43, 44, 47, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79});

  long multi_candidate = 0, fallback = 0, stats_differ = 0;
  for (std::size_t p = 0; p < patterns.size(); ++p) {
    const std::vector<Index>& kept = patterns[p];
    for (long g = 0; g < f.Hkv; ++g) {
      const auto mass = library_mass(layer, g, AttentionArguments{});
      for (long bucket : {1L, 4L, 32L, 0L}) {
        std::vector<long> ref_cos;
        for (int stat : {ref::RouteKeyCosine, ref::RouteWindowMass, ref::RouteCoAttention}) {
          INFO("pattern " << p << " head " << g << " bucket " << bucket << " statistic "
                          << to_string(library_stat(stat)));
          const auto want = reference_route(g, kept, f.n, stat, bucket, K, a, probs, f.Hq / f.Hkv);
          const auto got = library_route(layer, g, mass, kept, bucket, library_stat(stat));
          REQUIRE(got.size() == want.size());
          CHECK(got == want);
          if (stat == ref::RouteKeyCosine) ref_cos = want;
          else if (want != ref_cos) ++stats_differ;
        }
        // Count what the inputs exercise (so the comparison above is not vacuous).
        for (Index j : complement(kept, f.n)) {
          long c = 0;
          for (Index i : kept) c += (bucket == 0 || i / bucket == j / bucket) ? 1 : 0;
          multi_candidate += c > 1;
          fallback += c == 0;
        }
      }
    }
  }
  CHECK(multi_candidate > 100);
  CHECK(fallback > 100);
  CHECK(stats_differ > 0);
}

TEST_CASE("BucketRouter: an empty bucket falls back to the nearest kept position, ties to the earlier",
          "[router][fallback]") {
  INFO("seed " << kvc::test::test_seed());
  Layer f(102);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<float> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), Q = b.queries.rounded();
  const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(f.d)), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  const auto mass = library_mass(layer, 0, AttentionArguments{});

  struct Case {
    std::vector<Index> kept;
    long bucket;
    std::vector<std::pair<long, long>> expect;  // (evicted j, target position), worked out by hand
  };
  const std::vector<Case> cases = {
      // bucket 4: [4,8) is empty; j = 6 is 4 from both 2 and 10 -> 2; j = 7 -> 10.
      {{2, 10, 13, 30},
       4,
       {{0, 2}, {1, 2}, {3, 2}, {4, 2}, {5, 2}, {6, 2}, {7, 10}, {8, 10}, {11, 10}, {12, 13}, {16, 13},
        {21, 13}, {22, 30}, {24, 30}, {29, 30}, {32, 30}, {79, 30}}},
      // bucket 1: every bucket of an evicted token is empty. Before the first / after the last kept.
      {{5, 11, 20},
       1,
       {{0, 5}, {4, 5}, {7, 5}, {8, 5}, {9, 11}, {14, 11}, {15, 11}, {16, 20}, {21, 20}, {79, 20}}},
      // bucket 32: [32,64) is empty; j = 48 is 17 from both 31 and 65 -> 31; j = 49 -> 65.
      {{31, 65}, 32, {{0, 31}, {30, 31}, {32, 31}, {48, 31}, {49, 65}, {63, 65}, {64, 65}, {79, 65}}},
  };
  for (const Case& c : cases) {
    const std::vector<Index> evicted = complement(c.kept, f.n);
    for (int stat : {ref::RouteKeyCosine, ref::RouteWindowMass, ref::RouteCoAttention}) {
      INFO("bucket " << c.bucket << " statistic " << to_string(library_stat(stat)));
      const auto got = library_route(layer, 0, mass, c.kept, c.bucket, library_stat(stat));
      const auto want = reference_route(0, c.kept, f.n, stat, c.bucket, K, a, probs, f.Hq / f.Hkv);
      REQUIRE(got.size() == evicted.size());
      CHECK(got == want);
      for (const auto& [j, target] : c.expect) {
        const auto e = std::lower_bound(evicted.begin(), evicted.end(), j) - evicted.begin();
        INFO("evicted " << j);
        REQUIRE(evicted[static_cast<std::size_t>(e)] == j);
        CHECK(got[static_cast<std::size_t>(e)] == target);
      }
    }
  }
}

TEMPLATE_TEST_CASE("BucketRouter: ties among candidates go to the lower position", "[router][ties]", float,
                   double) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Layer f(103);
  // Head 0: positions 9 and 13 (bucket [8,16), both before the window) carry the same key; evicted
  // 10 and 15 have that key too, so both candidates are the argmax of key cosine and, having equal
  // attention columns, of co-attention. Position 11 (kept) has another key.
  const long lo = 9, hi = 13;
  for (long k = 0; k < f.d; ++k) {
    f.K.at(0, hi, k) = f.K.at(0, lo, k);
    f.K.at(0, 10, k) = f.K.at(0, lo, k);
    f.K.at(0, 15, k) = f.K.at(0, lo, k);
  }
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), Q = b.queries.rounded();
  const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(f.d)), 0.0);
  Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  // window_mass: the crafted mass gives 9 and 13 the same, largest value.
  Vector<Real> mass = library_mass(layer, 0, AttentionArguments{});
  const Real top = Real(2) * mass.maxCoeff();
  mass[lo] = mass[hi] = top;
  a(0, lo) = a(0, hi) = static_cast<double>(top);

  const std::vector<Index> kept = {2, lo, 11, hi, 20, 40, 60, 79};
  const std::vector<Index> evicted = complement(kept, f.n);
  for (int stat : {ref::RouteKeyCosine, ref::RouteWindowMass, ref::RouteCoAttention}) {
    for (long bucket : {8L, 0L}) {
      INFO("statistic " << to_string(library_stat(stat)) << " bucket " << bucket);
      const auto got = library_route(layer, 0, mass, kept, bucket, library_stat(stat));
      const auto want = reference_route(0, kept, f.n, stat, bucket, K, a, probs, f.Hq / f.Hkv);
      REQUIRE(got.size() == evicted.size());
      CHECK(got == want);
      for (long j : {10L, 15L}) {
        const auto e = std::lower_bound(evicted.begin(), evicted.end(), j) - evicted.begin();
        const long target = got[static_cast<std::size_t>(e)];
        INFO("evicted " << j << " -> " << target);
        CHECK(target != hi);  // 9 and 13 are indistinguishable: 13 may never win over 9
        // Key cosine (duplicated key: cosine 1 with both) and window mass (crafted equal maxima)
        // make the pair the argmax by construction; for co-attention, when the reference says so.
        bool pair_is_argmax = stat != ref::RouteCoAttention;
        if (!pair_is_argmax) {
          auto co = [&](long i) {
            double s = 0.0;
            for (long h = 0; h < f.Hq / f.Hkv; ++h)  // the query heads of KV head 0
              for (long r = 0; r < probs[static_cast<std::size_t>(h)].rows(); ++r)
                s += probs[static_cast<std::size_t>(h)](r, j) * probs[static_cast<std::size_t>(h)](r, i);
            return s;
          };
          double best = -1.0;
          for (Index i : kept)
            if (bucket == 0 || i / bucket == j / bucket) best = std::max(best, co(i));
          pair_is_argmax = co(lo) == best;
        }
        if (pair_is_argmax) CHECK(target == lo);
      }
    }
  }
}

TEMPLATE_TEST_CASE("BucketRouter: zero-norm keys have cosine 0", "[router][zero]", float, double) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Layer f(104);
  // Bucket [16,24): kept 17 has k_17 = -k_21 (cosine -1 with the evicted 21), kept 19 has a zero key.
  // Evicted 21 must go to 19 (cosine 0 beats -1). Evicted 18 has a zero key: every candidate has
  // cosine 0 and the tie goes to the lower position, 17. Bucket [32,40): kept 33 and 36; evicted 35
  // is parallel to 36 (cosine 1) and 33 gets a zero key: 36 wins over the zero-norm candidate.
  for (long k = 0; k < f.d; ++k) {
    f.K.at(0, 17, k) = -f.K.at(0, 21, k);
    f.K.at(0, 19, k) = 0.0;
    f.K.at(0, 18, k) = 0.0;
    f.K.at(0, 33, k) = 0.0;
    f.K.at(0, 36, k) = 0.5 * f.K.at(0, 35, k);
  }
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), Q = b.queries.rounded();
  const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(f.d)), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  const auto mass = library_mass(layer, 0, AttentionArguments{});

  const std::vector<Index> kept = {0, 17, 19, 33, 36, 50, 79};
  const std::vector<Index> evicted = complement(kept, f.n);
  const auto got = library_route(layer, 0, mass, kept, 8, RouteStatistic::key_cosine);
  const auto want = reference_route(0, kept, f.n, ref::RouteKeyCosine, 8, K, a, probs, f.Hq / f.Hkv);
  REQUIRE(got.size() == evicted.size());
  CHECK(got == want);
  auto target_of = [&](long j) {
    const auto e = std::lower_bound(evicted.begin(), evicted.end(), j) - evicted.begin();
    return got[static_cast<std::size_t>(e)];
  };
  CHECK(target_of(21) == 19);
  CHECK(target_of(18) == 17);
  CHECK(target_of(35) == 36);
  for (long x : got) CHECK(x >= 0);  // zero norms never produce an invalid target (no NaN compare)
}

TEMPLATE_TEST_CASE("BucketRouter routes nothing when nothing is evicted", "[router]", float, Eigen::half) {
  using T = TestType;
  Layer f(105);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  std::vector<Index> kept(static_cast<std::size_t>(f.n));
  for (Index j = 0; j < f.n; ++j) kept[static_cast<std::size_t>(j)] = j;
  const std::vector<Index> evicted;
  const auto mass = library_mass(layer, 1, AttentionArguments{});
  const AttentionArguments attn;
  const HeadContext<T> ctx(layer, 1, attn, mass, mass, kept, evicted);
  Routing routing;
  routing.target = {7, 7, 7};  // stale content must be replaced
  BucketRouter<>{}.route(ctx, routing);
  CHECK(routing.target.empty());
  CHECK_FALSE(routing.routed());
  // The overload that writes the kept keys writes all of them (here every key of the head), into a
  // matrix of the wrong shape too (it is resized).
  using Real = compute_t<T>;
  RowMatrix<Real> kept_keys(3, 2);
  BucketRouter<>{}.route(ctx, routing, kept_keys);
  REQUIRE(kept_keys.rows() == f.n);
  REQUIRE(kept_keys.cols() == layer.head_dim());
  CHECK(routing.target.empty());
  RowMatrix<Real> want(f.n, layer.head_dim());
  for (Index j = 0; j < f.n; ++j)
    for (Index k = 0; k < layer.head_dim(); ++k) want(j, k) = to_real<Real>(layer.keys.row(1, j)[k]);
  CHECK(kept_keys.cwiseEqual(want).all());
}

TEST_CASE("BucketRouter on half and bfloat16 keys agrees with the reference on the stored values",
          "[router][half]") {
  INFO("seed " << kvc::test::test_seed());
  Layer f(106);
  const std::vector<Index> kept = random_subset(f.rng, f.n, 24);
  auto check = [&](auto tag) {
    using T = decltype(tag);
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
    const LayerView<T> layer = b.view();
    const ref::Tensor3 K = b.keys.rounded(), Q = b.queries.rounded();
    const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(f.d)), 0.0);
    const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
    for (long g = 0; g < f.Hkv; ++g) {
      const auto mass = library_mass(layer, g, AttentionArguments{});
      for (int stat : {ref::RouteKeyCosine, ref::RouteWindowMass, ref::RouteCoAttention}) {
        INFO("head " << g << " statistic " << to_string(library_stat(stat)));
        const auto got = library_route(layer, g, mass, kept, 32, library_stat(stat));
        CHECK(got == reference_route(g, kept, f.n, stat, 32, K, a, probs, f.Hq / f.Hkv));
      }
    }
  };
  check(Eigen::half{});
  check(Eigen::bfloat16{});
}

TEMPLATE_TEST_CASE("BucketRouter: crowded buckets (candidates in several SIMD groups), a head dim with a tail",
                   "[router][crowded]", float, double, Eigen::half) {
  // Key cosine scores candidates in groups of one SIMD batch (8 on AVX2, padded): a bucket of 20 kept
  // tokens spans three groups. Exact ties across groups must still go to the lower position, and
  // d = 20 exercises the serial tail of the dot products.
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  std::mt19937_64 rng = kvc::test::make_rng(107);
  const long Hkv = 2, Hq = 4, n = 96, d = 20, W = 8;
  ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hq, W, d, 1.5);
  // Bucket [32, 64): kept 34..53 (20 candidates). Evicted 60 and 61 copy the key of kept 35 (group
  // 0), which kept 44 (group 1) and 52 (group 2) also carry: 35 must win both.
  std::vector<Index> kept = {0, 5, 17};
  for (Index p = 34; p < 54; ++p) kept.push_back(p);
  kept.insert(kept.end(), {70, 71, 88, 95});
  for (long k = 0; k < d; ++k)
    for (long p : {44L, 52L, 60L, 61L}) K.at(0, p, k) = K.at(0, 35, k);
  kvc::test::LayerBuffers<T> b(K, V, Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 Kr = b.keys.rounded();
  const auto probs = ref::window_probs(b.queries.rounded(), Kr, 1.0 / std::sqrt(double(d)), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, Hkv);
  const std::vector<Index> evicted = complement(kept, n);
  for (long g = 0; g < Hkv; ++g) {
    const auto mass = library_mass(layer, g, AttentionArguments{});
    for (long bucket : {32L, 16L, 0L}) {
      INFO("head " << g << " bucket " << bucket);
      const auto got = library_route(layer, g, mass, kept, bucket, RouteStatistic::key_cosine);
      REQUIRE(got.size() == evicted.size());
      CHECK(got == reference_route(g, kept, n, ref::RouteKeyCosine, bucket, Kr, a, probs, Hq / Hkv));
      if (g == 0 && bucket != 16)  // (bucket 16 puts 60, 61 in [48, 64), without 35)
        for (long j : {60L, 61L}) {
          const auto e = std::lower_bound(evicted.begin(), evicted.end(), j) - evicted.begin();
          CHECK(got[static_cast<std::size_t>(e)] == 35);
        }
    }
  }
}

namespace {

/// detail::dots_against_n<A, NY> (NY evicted tokens at once) against NY calls of test::dots_against:
/// the same floats, bit for bit, for counts within one group of S/NY rows and across several, head
/// dims with and without a serial tail, rows at any offset (some repeated), some y repeated (as the
/// router's short last group repeats its last token).
template <class A, int NY, class T>
void check_dots_against_n(std::mt19937_64& rng) {
  constexpr Index S = Index(simd::fbatch<A>::size);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (Index d : {Index(128), Index(2 * S + 3), Index(S), Index(S - 1), Index(1)}) {
    std::vector<T> pool(static_cast<std::size_t>((S + 3 + NY) * d + 1));
    for (auto& x : pool) x = T(u(rng));
    for (Index count = 1; count <= S + 3; ++count) {
      std::vector<const T*> rows;
      for (Index r = 0; r < count; ++r) rows.push_back(pool.data() + 1 + (r * 5 % (S + 1)) * d);  // unaligned, some repeated
      const T* y[NY];
      for (int t = 0; t < NY; ++t) y[t] = pool.data() + 1 + (S + 1 + std::min(t, std::max(NY - 2, 1))) * d;
      std::vector<std::vector<float>> want(NY, std::vector<float>(static_cast<std::size_t>(count)));
      std::vector<std::vector<float>> got(NY, std::vector<float>(static_cast<std::size_t>(count), -1.0f));
      float* out[NY];
      for (int t = 0; t < NY; ++t) {
        kvc::test::dots_against<A>(rows.data(), count, y[t], d, want[static_cast<std::size_t>(t)].data());
        out[t] = got[static_cast<std::size_t>(t)].data();
      }
      detail::dots_against_n<A, NY>(rows.data(), count, y, d, out);
      INFO("lanes " << S << " NY " << NY << " d " << d << " count " << count);
      for (int t = 0; t < NY; ++t) CHECK(got[static_cast<std::size_t>(t)] == want[static_cast<std::size_t>(t)]);
      // and the dots are dots (the comparison above is not between two wrong answers)
      for (Index r = 0; r < count; ++r) {
        double exact = 0.0;
        for (Index k = 0; k < d; ++k)
          exact += double(to_real<float>(rows[r][k])) * double(to_real<float>(y[NY - 1][k]));
        CHECK(std::abs(double(got[NY - 1][static_cast<std::size_t>(r)]) - exact) <= 1e-4 * (1.0 + double(d)));
      }
    }
  }
}

}  // namespace

TEST_CASE("dots_against_n with 2 or 4 rows (evicted tokens at once) gives dots_against's values bit for bit",
          "[router][simd]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(331);
  check_dots_against_n<simd::default_arch, 2, float>(rng);
  check_dots_against_n<simd::default_arch, 4, float>(rng);
  check_dots_against_n<simd::default_arch, 2, Eigen::half>(rng);
  check_dots_against_n<simd::default_arch, 4, Eigen::half>(rng);
#if XSIMD_WITH_SSE2
  check_dots_against_n<xsimd::sse2, 2, float>(rng);
  check_dots_against_n<xsimd::sse2, 4, float>(rng);
#endif
}
