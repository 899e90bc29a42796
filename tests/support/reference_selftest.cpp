// tests/support/reference_selftest.cpp — checks kvc::ref itself against answers derived by hand.
// Linked with the shared Catch2 main (support/catch_main.cpp, as tests/CMakeLists.txt does); standalone:
//   g++ -std=c++17 -I/usr/include/eigen3 -Itests tests/support/reference_selftest.cpp tests/support/catch_main.cpp
#include <catch2/catch.hpp>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <cstdlib>
#include <vector>

namespace ref = kvc::ref;
using ref::Tensor3;
using Positions = std::vector<long>;

namespace {

constexpr double kExact = 1e-13;  // hand-derived values in double

bool near(double x, double y, double tol = kExact) { return std::abs(x - y) <= tol; }

/// Tensor3 [H][n][d] from a flat list.
Tensor3 tensor(long H, long n, long d, std::vector<double> values) {
  Tensor3 T(H, n, d);
  REQUIRE(static_cast<long>(values.size()) == H * n * d);
  T.data = std::move(values);
  return T;
}

Eigen::MatrixXd matrix(long rows, long cols, std::vector<double> row_major) {
  Eigen::MatrixXd M(rows, cols);
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c) M(r, c) = row_major[static_cast<std::size_t>(r * cols + c)];
  return M;
}

bool near(const Eigen::MatrixXd& A, const Eigen::MatrixXd& B, double tol = kExact) {
  return A.rows() == B.rows() && A.cols() == B.cols() && (A - B).cwiseAbs().maxCoeff() <= tol;
}

}  // namespace

// ---------------------------------------------------------------------------------------------- §2

TEST_CASE("window_probs: 3 tokens, d = 2, by hand", "[ref][window]") {
  // q = (1,0); keys (0,0), (ln2,0), (ln3,0): logits 0, ln2, ln3 -> exp 1, 2, 3.
  const Tensor3 Q = tensor(1, 2, 2, {1, 0, 1, 0});
  const Tensor3 K = tensor(1, 3, 2, {0, 0, std::log(2.0), 0, std::log(3.0), 0});
  const auto P = ref::window_probs(Q, K, 1.0, 0.0);
  REQUIRE(P.size() == 1);
  // row 0 sits at position 1 (sees j <= 1), row 1 at position 2.
  CHECK(near(P[0], matrix(2, 3, {1. / 3, 2. / 3, 0, 1. / 6, 2. / 6, 3. / 6})));
  const Eigen::MatrixXd a = ref::window_mass(P, 1);
  CHECK(near(a, matrix(1, 3, {0.5, 1.0, 0.5})));

  // scale 1/2 with keys doubled gives the same logits.
  const Tensor3 K2 = tensor(1, 3, 2, {0, 0, 2 * std::log(2.0), 0, 2 * std::log(3.0), 0});
  CHECK(near(ref::window_probs(Q, K2, 0.5, 0.0)[0], P[0]));
}

TEST_CASE("window_probs: soft-cap c·tanh(logit/c)", "[ref][window]") {
  // logit ln3, c = 1: tanh(ln3) = (9-1)/(9+1) = 0.8.
  const Tensor3 Q = tensor(1, 1, 2, {1, 0});
  const Tensor3 K = tensor(1, 2, 2, {0, 0, std::log(3.0), 0});
  const auto P = ref::window_probs(Q, K, 1.0, 1.0);
  const double e = std::exp(0.8);
  CHECK(near(P[0](0, 0), 1.0 / (1.0 + e)));
  CHECK(near(P[0](0, 1), e / (1.0 + e)));
  // a huge cap is (almost) no cap: 3/4
  CHECK(near(ref::window_probs(Q, K, 1.0, 1e8)[0](0, 1), 0.75, 1e-12));
}

TEST_CASE("window_probs: W > n uses the last n query rows", "[ref][window]") {
  // 4 query rows, n = 2: rows 0 and 1 are ignored (huge values would dominate otherwise).
  const Tensor3 Q = tensor(1, 4, 2, {100, 0, -100, 0, 1, 0, 1, 0});
  const Tensor3 K = tensor(1, 2, 2, {0, 0, std::log(2.0), 0});
  const auto P = ref::window_probs(Q, K, 1.0, 0.0);
  REQUIRE(P[0].rows() == 2);
  CHECK(near(P[0], matrix(2, 2, {1, 0, 1. / 3, 2. / 3})));
}

TEST_CASE("window_mass: GQA grouping h / G and the 1/G mean", "[ref][window]") {
  // Hq = 2, Hkv = 1: head 0 q = (1,0) -> [1/3, 2/3]; head 1 q = (-1,0) -> [2/3, 1/3].
  const Tensor3 Q = tensor(2, 1, 2, {1, 0, -1, 0});
  const Tensor3 K = tensor(1, 2, 2, {0, 0, std::log(2.0), 0});
  const auto P = ref::window_probs(Q, K, 1.0, 0.0);
  CHECK(near(P[0], matrix(1, 2, {1. / 3, 2. / 3})));
  CHECK(near(P[1], matrix(1, 2, {2. / 3, 1. / 3})));
  CHECK(near(ref::window_mass(P, 1), matrix(1, 2, {0.5, 0.5})));

  // Hq = 4, Hkv = 2: query heads 0,1 read KV head 0 and heads 2,3 read KV head 1.
  const Tensor3 Q4 = tensor(4, 1, 2, {1, 0, 1, 0, 1, 0, 1, 0});
  const Tensor3 K2 = tensor(2, 2, 2, {0, 0, std::log(2.0), 0, /*head 1*/ 0, 0, std::log(3.0), 0});
  const auto P4 = ref::window_probs(Q4, K2, 1.0, 0.0);
  CHECK(near(P4[1](0, 1), 2. / 3));
  CHECK(near(P4[2](0, 1), 3. / 4));
  CHECK(near(ref::window_mass(P4, 2), matrix(2, 2, {1. / 3, 2. / 3, 1. / 4, 3. / 4})));
}

TEST_CASE("window_probs: rows sum to 1, causal zeros, mass sums to W (random)", "[ref][window][property]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(1);
  const long Hq = 4, Hkv = 2, n = 17, W = 5, d = 7;
  const Tensor3 Q = kvc::test::random_tensor(rng, Hq, W, d, 2.0);
  const Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d, 2.0);
  const auto P = ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0);
  for (const auto& A : P)
    for (long i = 0; i < W; ++i) {
      CHECK(near(A.row(i).sum(), 1.0));
      for (long j = n - W + i + 1; j < n; ++j) CHECK(A(i, j) == 0.0);
    }
  const Eigen::MatrixXd a = ref::window_mass(P, Hkv);
  for (long g = 0; g < Hkv; ++g) CHECK(near(a.row(g).sum(), double(W), 1e-12));
}

// ---------------------------------------------------------------------------------------------- §4 scorers

TEST_CASE("scorers by hand", "[ref][scorer]") {
  const Eigen::MatrixXd a = matrix(1, 2, {0.5, 2.0});
  const Tensor3 V = tensor(1, 2, 2, {3, 4, 0, 1});
  CHECK(near(ref::attention_mass(a), a));
  CHECK(near(ref::value_weighted(a, V), matrix(1, 2, {2.5, 2.0})));
  CHECK(near(ref::key_norm(V), matrix(1, 2, {-5.0, -1.0})));
  CHECK(near(ref::position(2, 3), matrix(2, 3, {0, 1, 2, 0, 1, 2})));
}

// ---------------------------------------------------------------------------------------------- §3 budget

TEST_CASE("forced_counts: sinks first, then recent, never over the budget", "[ref][budget]") {
  auto same = [](ref::Forced f, long s, long r) { return f.sinks == s && f.recent == r; };
  CHECK(same(ref::forced_counts(10, 3, 4, 2), 3, 0));   // budget smaller than the sinks
  CHECK(same(ref::forced_counts(10, 5, 4, 2), 4, 1));   // recent cut short
  CHECK(same(ref::forced_counts(10, 8, 4, 2), 4, 2));   // two left for the scorer
  CHECK(same(ref::forced_counts(10, 10, 4, 2), 4, 6));  // m >= n: everything forced
  CHECK(same(ref::forced_counts(10, 20, 4, 2), 4, 6));
  CHECK(same(ref::forced_counts(10, 20, 20, 0), 10, 0));
  CHECK(same(ref::forced_counts(10, 6, 0, 0), 0, 0));
  CHECK_THROWS_AS(ref::forced_counts(10, 0, 4, 2), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------- §4 pooling

TEST_CASE("pool: region edges, zero padding, divisor = kernel", "[ref][pool]") {
  // region [2, 8) holds 1..6; the outside values 10, 20, 70, 80 must neither move nor leak in.
  const std::vector<double> s = {10, 20, 1, 2, 3, 4, 5, 6, 70, 80};
  const auto avg3 = ref::pool(s, 10, 2, 2, 3, false);
  const std::vector<double> want3 = {10, 20, 1, 2, 3, 4, 5, 11. / 3, 70, 80};
  for (std::size_t j = 0; j < s.size(); ++j) CHECK(near(avg3[j], want3[j]));
  const auto avg5 = ref::pool(s, 10, 2, 2, 5, false);
  CHECK(near(avg5[2], 6. / 5));   // (0 + 0 + 1 + 2 + 3) / 5
  CHECK(near(avg5[4], 3.0));      // (1 + 2 + 3 + 4 + 5) / 5
  CHECK(near(avg5[7], 15. / 5));  // (4 + 5 + 6 + 0 + 0) / 5
  const auto max3 = ref::pool(s, 10, 2, 2, 3, true);
  const std::vector<double> wantm = {10, 20, 2, 3, 4, 5, 6, 6, 70, 80};
  for (std::size_t j = 0; j < s.size(); ++j) CHECK(max3[j] == wantm[j]);
  CHECK(ref::pool(s, 10, 2, 2, 1, false) == s);
  CHECK(ref::pool(s, 10, 2, 2, 0, true) == s);
  CHECK_THROWS_AS(ref::pool(s, 10, 2, 2, 4, false), std::invalid_argument);
}

TEST_CASE("pool: max pooling pads with -inf (negative scores)", "[ref][pool]") {
  const std::vector<double> s = {-1, -2, -3};
  CHECK(ref::pool(s, 3, 0, 0, 3, true) == std::vector<double>{-1, -1, -2});
  const auto avg = ref::pool(s, 3, 0, 0, 3, false);
  CHECK(near(avg[0], -1.0));  // (0 - 1 - 2) / 3: zero padding does count for avg
  CHECK(near(avg[2], -5. / 3));
}

// ---------------------------------------------------------------------------------------------- §5 selector

TEST_CASE("select per head: forced + top by score, ties to lower position", "[ref][select]") {
  const Eigen::MatrixXd s = matrix(1, 6, {5, 1, 3, 3, 2, 9});
  CHECK(ref::select(s, {4}, 1, 1, 0, false, false)[0] == Positions{0, 2, 3, 5});
  CHECK(ref::select(s, {3}, 1, 1, 0, false, false)[0] == Positions{0, 2, 5});  // tie 2 vs 3
  CHECK(ref::select(s, {2}, 0, 0, 0, false, false)[0] == Positions{0, 5});
  CHECK(ref::select(s, {6}, 1, 1, 0, false, false)[0] == Positions{0, 1, 2, 3, 4, 5});
  CHECK(ref::select(s, {9}, 0, 0, 0, false, false)[0] == Positions{0, 1, 2, 3, 4, 5});
  CHECK(ref::select(s, {2}, 4, 2, 0, false, false)[0] == Positions{0, 1});  // budget < sinks
  const Eigen::MatrixXd flat = Eigen::MatrixXd::Constant(1, 6, 0.25);
  CHECK(ref::select(flat, {2}, 0, 0, 0, false, false)[0] == Positions{0, 1});
  // different budgets per head
  const Eigen::MatrixXd two = matrix(2, 5, {1, 2, 3, 4, 5, 5, 4, 3, 2, 1});
  const auto kept = ref::select(two, {2, 3}, 0, 0, 0, false, false);
  CHECK(kept[0] == Positions{3, 4});
  CHECK(kept[1] == Positions{0, 1, 2});
}

TEST_CASE("select: pooling changes the choice", "[ref][select][pool]") {
  const Eigen::MatrixXd s = matrix(1, 10, {0, 0, 0, 9, 0, 0, 0, 5, 5, 0});
  CHECK(ref::select(s, {1}, 0, 0, 0, false, false)[0] == Positions{3});  // raw: the spike
  // avg 3: 2,3,4 -> 3; 7,8 -> 10/3 (tie -> 7)
  CHECK(ref::select(s, {1}, 0, 0, 3, false, false)[0] == Positions{7});
  // max 3: 2,3,4 -> 9 (tie -> 2)
  CHECK(ref::select(s, {1}, 0, 0, 3, true, false)[0] == Positions{2});
}

TEST_CASE("select: Position scorer gives StreamingLLM", "[ref][select]") {
  const Eigen::MatrixXd s = ref::position(1, 10);
  CHECK(ref::select(s, {5}, 2, 0, 0, false, false)[0] == Positions{0, 1, 7, 8, 9});
  CHECK(ref::select(s, {5}, 2, 1, 0, false, false)[0] == Positions{0, 1, 7, 8, 9});
}

TEST_CASE("select shared: union of proposals trimmed by the mean", "[ref][select][shared]") {
  // m = 3, 1 sink -> m' = 2. Head 0 proposes {1,2}, head 1 proposes {3,4}; means 5, 3, 3.5, 3.5.
  const Eigen::MatrixXd s = matrix(2, 5, {0, 10, 6, 0, 0, 0, 0, 0, 7, 7});
  const auto kept = ref::select(s, {3, 3}, 1, 0, 0, false, true);
  CHECK(kept[0] == Positions{0, 1, 3});
  CHECK(kept[1] == kept[0]);
  // Position 3 has the best mean (9) but no head proposes it (m' = 1): the union {1,2} ties at 5 -> 1.
  const Eigen::MatrixXd t = matrix(2, 5, {0, 10, 0, 9, 0, 0, 0, 10, 9, 0});
  const auto shared = ref::select(t, {2, 2}, 1, 0, 0, false, true);
  CHECK(shared[0] == Positions{0, 1});
  CHECK(shared[1] == Positions{0, 1});
  const auto per_head = ref::select(t, {2, 2}, 1, 0, 0, false, false);
  CHECK(per_head[0] == Positions{0, 1});
  CHECK(per_head[1] == Positions{0, 2});
  CHECK_THROWS_AS(ref::select(t, {2, 3}, 1, 0, 0, false, true), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------- §6 router

TEST_CASE("route: bucket fallback to the nearest kept position, ties earlier", "[ref][route]") {
  const Tensor3 K = tensor(1, 8, 1, {1, 1, 1, 1, 1, 1, 1, 1});
  const Eigen::MatrixXd a = Eigen::MatrixXd::Ones(1, 8);
  // B = 2, kept {0,1,6}: buckets [2,4) and [4,6) are empty.
  CHECK(ref::route(0, {0, 1, 6}, 8, ref::RouteKeyCosine, 2, K, a, {}, 1) == Positions{0, 1, 1, 1, 6, 6, 6, 6});
  // B = 1: every evicted bucket is empty; j = 3 is 2 away from both 1 and 5 -> 1.
  CHECK(ref::route(0, {1, 5}, 8, ref::RouteWindowMass, 1, K, a, {}, 1) == Positions{1, 1, 1, 1, 5, 5, 5, 5});
}

TEST_CASE("route: KeyCosine within the bucket, zero key, Global", "[ref][route]") {
  // k0 = (1,0), k1 = (0,1), k2 = (1,0.1) -> 0, k3 = (-1,2) -> 1 (2/sqrt5 > -1/sqrt5), k4 = 0 -> tie -> 0
  const Tensor3 K = tensor(1, 5, 2, {1, 0, 0, 1, 1, 0.1, -1, 2, 0, 0});
  const Eigen::MatrixXd a = Eigen::MatrixXd::Ones(1, 5);
  CHECK(ref::route(0, {0, 1}, 5, ref::RouteKeyCosine, 32, K, a, {}, 1) == Positions{0, 1, 0, 1, 0});
  CHECK(ref::route(0, {0, 1}, 5, ref::RouteKeyCosine, 0, K, a, {}, 1) == Positions{0, 1, 0, 1, 0});
  // bucket restriction: k5 equals k0 but only kept 4 shares its bucket [4,8).
  const Tensor3 K8 = tensor(1, 8, 2, {1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1});
  const Eigen::MatrixXd a8 = Eigen::MatrixXd::Ones(1, 8);
  CHECK(ref::route(0, {0, 4}, 8, ref::RouteKeyCosine, 4, K8, a8, {}, 1)[5] == 4);
  CHECK(ref::route(0, {0, 4}, 8, ref::RouteKeyCosine, 0, K8, a8, {}, 1)[5] == 0);
}

TEST_CASE("route: WindowMass and CoAttention", "[ref][route]") {
  const Tensor3 K(1, 4, 2);
  CHECK(ref::route(0, {0, 1}, 4, ref::RouteWindowMass, 0, K, matrix(1, 4, {0.1, 0.5, 0.3, 0.2}), {}, 1) ==
        Positions{0, 1, 1, 1});
  CHECK(ref::route(0, {0, 1}, 4, ref::RouteWindowMass, 0, K, matrix(1, 4, {0.5, 0.5, 0.3, 0.2}), {}, 1) ==
        Positions{0, 1, 0, 0});
  // G = 2, W = 2. j = 2: i=0 -> .3*.1 + 0*.5 = .03, i=1 -> .3*.2 + 0*.1 = .06 -> 1.
  //              j = 3: i=0 -> .4*.1 + .4*.5 = .24, i=1 -> .4*.2 + .4*.1 = .12 -> 0.
  const std::vector<Eigen::MatrixXd> P = {matrix(2, 4, {.5, .5, 0, 0, .1, .2, .3, .4}),
                                          matrix(2, 4, {.2, .8, 0, 0, .5, .1, 0, .4})};
  const Eigen::MatrixXd a = Eigen::MatrixXd::Ones(1, 4);
  CHECK(ref::route(0, {0, 1}, 4, ref::RouteCoAttention, 0, K, a, P, 2) == Positions{0, 1, 1, 0});
  // KV head 1 reads query heads 2 and 3.
  const Tensor3 K2(2, 4, 2);
  const Eigen::MatrixXd a2 = Eigen::MatrixXd::Ones(2, 4);
  const Eigen::MatrixXd junk = Eigen::MatrixXd::Constant(2, 4, 0.25);
  CHECK(ref::route(1, {0, 1}, 4, ref::RouteCoAttention, 0, K2, a2, {junk, junk, P[0], P[1]}, 2) ==
        Positions{0, 1, 1, 0});
}

// ---------------------------------------------------------------------------------------------- §7 mergers

TEST_CASE("merge: MergeAll and SoftGate by hand", "[ref][merge]") {
  const Tensor3 K = tensor(1, 2, 2, {7, 8, 9, 10});
  const Eigen::MatrixXd a = matrix(1, 2, {1, 3});
  const Positions kept = {0}, route = {0, 0};
  {
    const Tensor3 V = tensor(1, 2, 2, {1, 0, 0, 1});
    const ref::Merged all = ref::merge(0, kept, route, K, V, a, ref::MergeAll);
    CHECK(near(all.values, matrix(1, 2, {0.25, 0.75})));
    CHECK(near(all.keys, matrix(1, 2, {7, 8})));
    CHECK(all.gate == std::vector<double>{0, 1});
    // orthogonal values: the soft gate is 0, so SoftGate == Drop exactly.
    const ref::Merged soft = ref::merge(0, kept, route, K, V, a, ref::MergeSoftGate);
    const ref::Merged drop = ref::merge(0, kept, route, K, V, a, ref::MergeDrop);
    CHECK(soft.gate == std::vector<double>{0, 0});
    CHECK(soft.values == drop.values);
    CHECK(drop.values == matrix(1, 2, {1, 0}));
    CHECK(drop.gate == std::vector<double>{0, 0});
  }
  {
    const Tensor3 V = tensor(1, 2, 2, {1, 0, 1, 1});  // cos = 1/sqrt2
    const ref::Merged soft = ref::merge(0, kept, route, K, V, a, ref::MergeSoftGate);
    const double g = 1 / std::sqrt(2.0), den = 1 + 3 * g;
    CHECK(near(soft.gate[1], g));
    CHECK(near(soft.values, matrix(1, 2, {(1 + 3 * g) / den, 3 * g / den})));
  }
  for (const std::vector<double>& v1 : {std::vector<double>{-2, 0}, std::vector<double>{0, 0}}) {
    const Tensor3 V = tensor(1, 2, 2, {1, 0, v1[0], v1[1]});  // anti-parallel (clamped), zero norm
    const ref::Merged soft = ref::merge(0, kept, route, K, V, a, ref::MergeSoftGate);
    CHECK(soft.gate[1] == 0.0);
    CHECK(soft.values == matrix(1, 2, {1, 0}));
  }
}

TEST_CASE("merge: gates use the target's original value; KV head g", "[ref][merge]") {
  // Head 1 holds the data (head 0 is junk). v0 = (1,0) kept; v1 = (1,1) -> gate 1/sqrt2;
  // v2 = (0,1) is orthogonal to the ORIGINAL v0 -> gate 0 (against a running merge it would be > 0).
  const Tensor3 V = tensor(2, 3, 2, {9, 9, 9, 9, 9, 9, /*head 1*/ 1, 0, 1, 1, 0, 1});
  const Tensor3 K(2, 3, 2);
  const Eigen::MatrixXd a = matrix(2, 3, {5, 5, 5, 1, 1, 1});
  const ref::Merged m = ref::merge(1, {0}, {0, 0, 0}, K, V, a, ref::MergeSoftGate);
  const double g = 1 / std::sqrt(2.0);
  CHECK(near(m.gate[1], g));
  CHECK(m.gate[2] == 0.0);
  CHECK(near(m.values, matrix(1, 2, {(1 + g) / (1 + g), g / (1 + g)})));
}

TEST_CASE("merge and AttentionRatio: mass floor tau = 1e-12 max a", "[ref][merge][compensate]") {
  const Tensor3 K(1, 2, 2);
  const Tensor3 V = tensor(1, 2, 2, {1, 0, 0, 1});
  const Eigen::MatrixXd a = matrix(1, 2, {0, 2});
  const ref::Merged m = ref::merge(0, {0}, {0, 0}, K, V, a, ref::MergeAll);
  const double tau = 2e-12;
  CHECK(near(m.values(0, 0), tau / (tau + 2)));
  CHECK(near(m.values(0, 1), 2 / (tau + 2)));
  const auto b = ref::bias_attention_ratio(0, {0}, {0, 0}, m.gate, a, 0.5, 0.0);
  CHECK(near(b[0], 0.5 * std::log((tau + 2) / tau), 1e-12));
}

// ---------------------------------------------------------------------------------------------- §8 compensators

TEST_CASE("compensators by hand", "[ref][compensate]") {
  const Eigen::MatrixXd a = matrix(1, 3, {1, 3, 1});
  const Positions kept = {0, 2}, route = {0, 0, 2};
  const std::vector<double> gate = {0, 1, 0};
  // R_0 = (1 + 3) / 1 = 4; entry 2 received nothing -> R = 1.
  CHECK(near(ref::bias_attention_ratio(0, kept, route, gate, a, 0.5, 0)[0], std::log(2.0)));
  CHECK(ref::bias_attention_ratio(0, kept, route, gate, a, 0.5, 0)[1] == 0.0);
  CHECK(near(ref::bias_attention_ratio(0, kept, route, gate, a, 1.0, 0)[0], std::log(4.0)));
  CHECK(near(ref::bias_attention_ratio(0, kept, route, gate, a, 0.5, 2.0)[0], 0.5 * std::log(2.0)));
  CHECK(near(ref::bias_attention_ratio(0, kept, route, {0, 0.5, 0}, a, 1.0, 0)[0], std::log(2.5)));
  CHECK(near(ref::bias_merge_count(kept, route, gate)[0], std::log(2.0)));
  CHECK(near(ref::bias_merge_count(kept, route, {0, 0.5, 0})[0], std::log(1.5)));
  CHECK(ref::bias_merge_count(kept, route, gate)[1] == 0.0);
  CHECK(ref::shared_bias({{1, 2}, {3, 6}}) == std::vector<double>{2, 4});
}

// ---------------------------------------------------------------------------------------------- §10 RoPE

TEST_CASE("RoPE by hand: interleaved vs half-split, partial rotary", "[ref][rope]") {
  const double pi = std::acos(-1.0);
  {
    std::vector<double> x = {1, 0};
    ref::rope_rotate(x.data(), 2, 2, pi / 2, 10000.0, false);  // frequency θ^0 = 1
    CHECK(near(x[0], 0.0));
    CHECK(near(x[1], 1.0));
  }
  // θ = 100, rotary_dim 4: frequencies 1 and 100^(-1/2) = 0.1; pos 5π -> angles 5π and π/2.
  // d = 6: x[4], x[5] are beyond rotary_dim and stay.
  {
    std::vector<double> x = {1, 2, 3, 4, 5, 6};
    ref::rope_rotate(x.data(), 6, 4, 5 * pi, 100.0, false);  // pairs (0,1), (2,3)
    const std::vector<double> want = {-1, -2, -4, 3, 5, 6};
    for (std::size_t k = 0; k < 6; ++k) CHECK(near(x[k], want[k], 1e-12));
  }
  {
    std::vector<double> x = {1, 2, 3, 4, 5, 6};
    ref::rope_rotate(x.data(), 6, 4, 5 * pi, 100.0, true);  // pairs (0,2), (1,3)
    const std::vector<double> want = {-1, -4, -3, 2, 5, 6};
    for (std::size_t k = 0; k < 6; ++k) CHECK(near(x[k], want[k], 1e-12));
  }
  std::vector<double> x = {1, 2, 3};
  CHECK_THROWS_AS(ref::rope_rotate(x.data(), 3, 3, 1.0, 10000.0, false), std::invalid_argument);
  CHECK_THROWS_AS(ref::rope_rotate(x.data(), 2, 4, 1.0, 10000.0, false), std::invalid_argument);
}

TEST_CASE("RoPE properties: inverse, norm, relative position", "[ref][rope][property]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(2);
  const long d = 16, r = 12;
  for (bool half : {false, true}) {
    const Tensor3 T = kvc::test::random_tensor(rng, 1, 2, d);
    const std::vector<double> q(T.vec(0, 0), T.vec(0, 0) + d), k(T.vec(0, 1), T.vec(0, 1) + d);
    std::vector<double> x = q;
    ref::rope_rotate(x.data(), d, r, 37.0, 10000.0, half);
    CHECK(near(ref::norm2(x.data(), d), ref::norm2(q.data(), d), 1e-12));
    ref::rope_unrotate(x.data(), d, r, 37.0, 10000.0, half);
    for (long c = 0; c < d; ++c) CHECK(near(x[c], q[c], 1e-12));
    auto rotated_dot = [&](double pq, double pk) {
      std::vector<double> a = q, b = k;
      ref::rope_rotate(a.data(), d, r, pq, 10000.0, half);
      ref::rope_rotate(b.data(), d, r, pk, 10000.0, half);
      return ref::dot(a.data(), b.data(), d);
    };
    CHECK(near(rotated_dot(5, 2), rotated_dot(13, 10), 1e-12));
    CHECK(!near(rotated_dot(5, 2), rotated_dot(5, 3), 1e-6));
  }
}

TEST_CASE("reposition = RoPE at the new position of the raw key", "[ref][rope]") {
  auto rng = kvc::test::make_rng(3);
  const long m = 3, d = 8, r = 8;
  const Eigen::MatrixXd raw = kvc::test::random_matrix(rng, m, d);
  const Positions old_pos = {4, 9, 30}, new_pos = ref::contiguous_positions(m);
  for (bool half : {false, true}) {
    Eigen::MatrixXd cached(m, d), want(m, d);
    for (long e = 0; e < m; ++e) {
      std::vector<double> x = ref::row_vector(raw, e), y = x;
      ref::rope_rotate(x.data(), d, r, double(old_pos[e]), 500.0, half);
      ref::rope_rotate(y.data(), d, r, double(new_pos[e]), 500.0, half);
      for (long k = 0; k < d; ++k) {
        cached(e, k) = x[k];
        want(e, k) = y[k];
      }
    }
    CHECK(near(ref::reposition(cached, old_pos, new_pos, r, 500.0, half), want, 1e-12));
  }
}

// ---------------------------------------------------------------------------------------------- decode, window error

TEST_CASE("decode_attention with bias by hand", "[ref][decode]") {
  const Eigen::MatrixXd q = matrix(2, 2, {1, 0, -1, 0});
  const Tensor3 K = tensor(1, 2, 2, {0, 0, std::log(3.0), 0});
  const Tensor3 V = tensor(1, 2, 2, {1, 0, 0, 1});
  const Eigen::MatrixXd none(0, 0);
  CHECK(near(ref::decode_attention(q, K, V, none, 1.0, 0.0), matrix(2, 2, {0.25, 0.75, 0.75, 0.25})));
  // bias only on the first (compressed) entry; the second has no bias column -> 0.
  CHECK(near(ref::decode_attention(q, K, V, matrix(1, 1, {std::log(3.0)}), 1.0, 0.0),
             matrix(2, 2, {0.5, 0.5, 0.9, 0.1})));
  // soft-cap 1: logits 0 and tanh(ln3) = 0.8, then the bias is added after the cap.
  const double e = std::exp(0.8);
  CHECK(near(ref::decode_attention(q.topRows(1), K, V, none, 1.0, 1.0), matrix(1, 2, {1 / (1 + e), e / (1 + e)})));
  CHECK(near(ref::decode_attention(q.topRows(1), K, V, matrix(1, 2, {0.8, 0}), 1.0, 1.0), matrix(1, 2, {0.5, 0.5})));
}

TEST_CASE("window_output_error: 0 uncompressed; exact identity for merged duplicates", "[ref][error]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(4);
  const long Hq = 2, Hkv = 1, n = 12, W = 4, d = 8;
  const double s = 1 / std::sqrt(double(d));
  const Tensor3 Q = kvc::test::random_tensor(rng, Hq, W, d);
  Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
  const Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
  for (long k = 0; k < d; ++k) K.at(0, 3, k) = K.at(0, 2, k);  // duplicate key, both before the window

  Positions all(n);
  for (long j = 0; j < n; ++j) all[j] = j;
  const ref::CompressedHead full{all, ref::head_matrix(K, 0), ref::head_matrix(V, 0), {}};
  CHECK(ref::window_output_error(Q, K, V, {full}, s, 0.0) < 1e-14);

  // Merge 3 into 2 (identical keys, identical attention in every row): MergeAll + α = 1 ratio bias
  // reproduces the full output exactly: e^{l + log 2}·(v2 + v3)/2 = e^l v2 + e^l v3.
  const auto P = ref::window_probs(Q, K, s, 0.0);
  const Eigen::MatrixXd a = ref::window_mass(P, Hkv);
  Positions kept;
  for (long j = 0; j < n; ++j)
    if (j != 3) kept.push_back(j);
  const Positions route = ref::route(0, kept, n, ref::RouteKeyCosine, 0, K, a, P, Hq / Hkv);
  CHECK(route[3] == 2);
  const ref::Merged m = ref::merge(0, kept, route, K, V, a, ref::MergeAll);
  const auto bias1 = ref::bias_attention_ratio(0, kept, route, m.gate, a, 1.0, 0.0);
  CHECK(near(bias1[2], std::log(2.0), 1e-12));
  CHECK(ref::window_output_error(Q, K, V, {{kept, m.keys, m.values, bias1}}, s, 0.0) < 1e-13);
  const auto bias05 = ref::bias_attention_ratio(0, kept, route, m.gate, a, 0.5, 0.0);
  CHECK(ref::window_output_error(Q, K, V, {{kept, m.keys, m.values, bias05}}, s, 0.0) > 1e-6);
  const ref::Merged drop = ref::merge(0, kept, route, K, V, a, ref::MergeDrop);
  CHECK(ref::window_output_error(Q, K, V, {{kept, drop.keys, drop.values, {}}}, s, 0.0) > 1e-6);
}

// ---------------------------------------------------------------------------------------------- support headers

TEST_CASE("random.hpp: deterministic streams, seed override, awkward sizes", "[support]") {
  auto r1 = kvc::test::make_rng(5), r2 = kvc::test::make_rng(5), r3 = kvc::test::make_rng(6);
  const auto x = r1(), y = r2(), z = r3();
  CHECK(x == y);
  CHECK(x != z);
  const char* old = std::getenv("KVC_TEST_SEED");
  const std::string saved = old ? old : "";
  setenv("KVC_TEST_SEED", "0x2A", 1);
  CHECK(kvc::test::test_seed() == 42);
  setenv("KVC_TEST_SEED", "12abc", 1);
  CHECK_THROWS_AS(kvc::test::test_seed(), std::invalid_argument);
  if (old) setenv("KVC_TEST_SEED", saved.c_str(), 1);
  else unsetenv("KVC_TEST_SEED");
  CHECK(kvc::test::awkward_sizes().size() == 14);
  CHECK(kvc::test::awkward_sizes(8, 32) == std::vector<long>{8, 15, 16, 17, 31, 32});
  const Tensor3 T = kvc::test::random_tensor(r1, 2, 3, 4, 1e-9, 1.5);
  CHECK(T.data.size() == 24);
  for (double v : T.data) CHECK(near(v, 1.5, 1e-6));
}

TEST_CASE("tolerances.hpp: table and helpers", "[support]") {
  using kvc::test::kTol;
  static_assert(kTol.half_vs_float.mass.norm == 8 * kvc::test::kHalfU, "table is constexpr");
  CHECK(kvc::test::within(1.0 + 1e-6, 1.0, kTol.float_vs_double.mass));
  CHECK(!kvc::test::within(1.0 + 1e-3, 1.0, kTol.float_vs_double.mass));
  const Eigen::MatrixXd A = matrix(1, 2, {1, 2});
  CHECK(kvc::test::within(A, A, kTol.float_vs_double.values));
  CHECK(!kvc::test::within(Eigen::MatrixXd(A * 1.01), A, kTol.float_vs_double.values));
  CHECK(kvc::test::within(std::vector<double>{0.5}, std::vector<double>{0.5 + 1e-3}, kTol.bf16_vs_float.bias));
}
