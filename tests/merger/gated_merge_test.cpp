// Drop, MergeAll and SoftGate (SPEC §7) against the reference merge kvc::ref::merge, and their
// invariants: identity when nothing is evicted, untouched rows and keys, the gate limits (SoftGate =
// Drop when every gate is 0, = MergeAll when every gate is 1) and the mass floor τ.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/merger/gated_merge.hpp>
#include <kvcompress/pipeline.hpp>  // the pipeline's reading of a merger's declarations
#include <kvcompress/router/bucket_router.hpp>

#include "support/bridge.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/tolerances.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

using namespace kvc;
using kvc::test::complement;
using kvc::test::kTol;
using kvc::test::Layout;
using kvc::test::library_mass;
using kvc::test::random_subset;
using kvc::test::routing_from;

namespace {

/// Runs `Merger` on head g the way the pipeline does: out.keys / out.values start as the kept rows,
/// except out.values of a merger that fills them (PolicyTraits::fills_values), which then starts as NaN:
/// a row it forgets to write fails every comparison. For those, the result with the kept rows
/// gathered first must be bit-identical (the merger may not depend on what out.values held).
/// `route`: the reference route (n entries, kept positions); converted to indices into `kept`.
template <class Merger, class T>
MergeOutput<compute_t<T>> run_merge(const LayerView<T>& layer, Index g, const Vector<compute_t<T>>& mass,
                                    const std::vector<Index>& kept, const std::vector<long>& route) {
  using Real = compute_t<T>;
  const std::vector<Index> evicted = complement(kept, layer.tokens());
  const Routing routing = routing_from(route, kept, evicted);
  const AttentionArguments attn;
  const HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
  const Index m = static_cast<Index>(kept.size()), d = layer.head_dim();
  MergeOutput<Real> out;
  out.keys.resize(m, d);
  out.values.resize(m, d);
  for (Index i = 0; i < m; ++i)
    for (Index k = 0; k < d; ++k) {
      out.keys(i, k) = to_real<Real>(layer.keys.row(g, kept[static_cast<std::size_t>(i)])[k]);
      out.values(i, k) = to_real<Real>(layer.values.row(g, kept[static_cast<std::size_t>(i)])[k]);
    }
  if constexpr (policy_traits<Merger>::fills_values) {
    MergeOutput<Real> gathered = out;
    Merger{}.merge(ctx, routing, gathered);
    out.values.setConstant(std::numeric_limits<Real>::quiet_NaN());
    Merger{}.merge(ctx, routing, out);
    CHECK(out.values.cwiseEqual(gathered.values).all());
    CHECK(out.gate.cwiseEqual(gathered.gate).all());
    MergeOutput<Real> misshapen = out;  // values of the wrong shape are resized, then written
    misshapen.values = RowMatrix<Real>::Constant(1, 1, std::numeric_limits<Real>::quiet_NaN());
    Merger{}.merge(ctx, routing, misshapen);
    REQUIRE(misshapen.values.rows() == m);
    REQUIRE(misshapen.values.cols() == d);
    CHECK(misshapen.values.cwiseEqual(gathered.values).all());
  } else {
    Merger{}.merge(ctx, routing, out);
  }
  return out;
}

/// The kept rows of head g as stored (converted to Real), for bit-exact comparisons.
template <class Real, class T>
RowMatrix<Real> kept_rows(const TensorView<const T>& v, Index g, const std::vector<Index>& kept) {
  RowMatrix<Real> out(static_cast<Index>(kept.size()), v.dim);
  for (std::size_t i = 0; i < kept.size(); ++i)
    for (Index k = 0; k < v.dim; ++k) out(static_cast<Index>(i), k) = to_real<Real>(v.row(g, kept[i])[k]);
  return out;
}

/// Reference gates at the evicted positions (the library's gate order).
Eigen::VectorXd evicted_gates(const ref::Merged& m, const std::vector<Index>& evicted) {
  Eigen::VectorXd g(static_cast<Index>(evicted.size()));
  for (std::size_t e = 0; e < evicted.size(); ++e) g[static_cast<Index>(e)] = m.gate[static_cast<std::size_t>(evicted[e])];
  return g;
}

int ref_kind(int which) { return which == 0 ? ref::MergeDrop : which == 1 ? ref::MergeAll : ref::MergeSoftGate; }
const char* kind_name(int which) { return which == 0 ? "Drop" : which == 1 ? "MergeAll" : "SoftGate"; }

template <class T>
MergeOutput<compute_t<T>> run_kind(int which, const LayerView<T>& layer, Index g, const Vector<compute_t<T>>& mass,
                                   const std::vector<Index>& kept, const std::vector<long>& route) {
  if (which == 0) return run_merge<Drop>(layer, g, mass, kept, route);
  if (which == 1) return run_merge<MergeAll>(layer, g, mass, kept, route);
  return run_merge<SoftGate>(layer, g, mass, kept, route);
}

using Data = kvc::test::HeadData;

}  // namespace

TEMPLATE_TEST_CASE("Drop, MergeAll and SoftGate match the reference merge", "[merger]", float, double) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(201);
  const auto& tol = kTol.float_vs_double;
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, layout);
    const LayerView<T> layer = b.view();
    const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded(), Q = b.queries.rounded();
    const auto probs = ref::window_probs(Q, K, f.scale(), 0.0);
    const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
    long positive = 0, zero = 0;
    for (long g = 0; g < f.Hkv; ++g) {
      const std::vector<Index> kept = random_subset(f.rng, f.n, 30);
      const std::vector<Index> evicted = complement(kept, f.n);
      const auto route = ref::route(g, kvc::test::to_long(kept), f.n, ref::RouteKeyCosine, 16, K, a, probs, 2);
      const auto mass = library_mass(layer, g);
      for (int which : {0, 1, 2}) {
        INFO(kvc::test::to_string(layout) << " head " << g << " " << kind_name(which));
        const ref::Merged want = ref::merge(g, kvc::test::to_long(kept), route, K, V, a, ref_kind(which));
        const auto got = run_kind(which, layer, g, mass, kept, route);
        REQUIRE(got.values.rows() == static_cast<Index>(kept.size()));
        REQUIRE(got.gate.size() == static_cast<Index>(evicted.size()));
        const Eigen::MatrixXd gv = got.values.template cast<double>();
        INFO("values: elementwise ratio " << kvc::test::elementwise_ratio(gv, want.values, tol.values)
                                          << ", normwise " << kvc::test::normwise_error(gv, want.values));
        CHECK(kvc::test::within(gv, want.values, tol.values));
        CHECK(kvc::test::within(got.gate.template cast<double>(), evicted_gates(want, evicted), tol.values));
        CHECK(got.keys == kept_rows<Real>(layer.keys, g, kept));  // keys never change
        if (which == 2)
          for (Index e = 0; e < got.gate.size(); ++e) (got.gate[e] > 0 ? positive : zero) += 1;
      }
    }
    CHECK(positive > 20);  // the soft gate both merges and drops on this data
    CHECK(zero > 20);
  }
}

TEMPLATE_TEST_CASE("mergers: kept rows that receive nothing stay bit-identical", "[merger][identity]", float,
                   double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(202);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded();
  const auto probs = ref::window_probs(b.queries.rounded(), K, f.scale(), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  const long g = 1;
  const auto mass = library_mass(layer, g);

  SECTION("nothing evicted: every merger is the identity") {
    std::vector<Index> kept(static_cast<std::size_t>(f.n));
    for (Index j = 0; j < f.n; ++j) kept[static_cast<std::size_t>(j)] = j;
    const std::vector<long> route = kvc::test::to_long(kept);
    for (int which : {0, 1, 2}) {
      INFO(kind_name(which));
      const auto got = run_kind(which, layer, g, mass, kept, route);
      CHECK(got.gate.size() == 0);
      CHECK(got.values == kept_rows<Real>(layer.values, g, kept));
      CHECK(got.keys == kept_rows<Real>(layer.keys, g, kept));
    }
  }
  SECTION("rows without a (positive-gate) contribution and all keys are unchanged") {
    // Global window-mass routing sends every evicted token to one kept entry; the others get nothing.
    const std::vector<Index> kept = random_subset(f.rng, f.n, 25);
    const auto route = ref::route(g, kvc::test::to_long(kept), f.n, ref::RouteWindowMass, 0, K, a, probs, 2);
    const RowMatrix<Real> orig_v = kept_rows<Real>(layer.values, g, kept);
    const RowMatrix<Real> orig_k = kept_rows<Real>(layer.keys, g, kept);
    for (int which : {0, 1, 2}) {
      INFO(kind_name(which));
      const auto got = run_kind(which, layer, g, mass, kept, route);
      const std::vector<Index> evicted = complement(kept, f.n);
      std::vector<char> receives(kept.size(), 0);
      for (std::size_t e = 0; e < evicted.size(); ++e)
        if (got.gate[static_cast<Index>(e)] > 0) {
          const auto i = std::lower_bound(kept.begin(), kept.end(), route[static_cast<std::size_t>(evicted[e])]) -
                         kept.begin();
          receives[static_cast<std::size_t>(i)] = 1;
        }
      long untouched = 0;
      for (std::size_t i = 0; i < kept.size(); ++i)
        if (!receives[i]) {
          ++untouched;
          INFO("kept entry " << i);
          CHECK(got.values.row(static_cast<Index>(i)) == orig_v.row(static_cast<Index>(i)));
        }
      CHECK(untouched >= static_cast<long>(kept.size()) - 1);
      CHECK(got.keys == orig_k);
      if (which == 0) CHECK(got.values == orig_v);
    }
  }
}

TEMPLATE_TEST_CASE("SoftGate reduces to Drop when every gate is 0 and to MergeAll when every gate is 1",
                   "[merger][gate]", float, double) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(203);
  const long g = 0, half = f.d / 2;
  const std::vector<Index> kept = random_subset(f.rng, f.n, 24);
  const std::vector<Index> evicted = complement(kept, f.n);
  // Routing by key cosine depends on the keys only, so the values can be shaped after routing.
  const auto probs0 = ref::window_probs(f.Q, f.K, f.scale(), 0.0);
  const Eigen::MatrixXd a0 = ref::window_mass(probs0, f.Hkv);
  const auto route = ref::route(g, kvc::test::to_long(kept), f.n, ref::RouteKeyCosine, 16, f.K, a0, probs0, 2);

  // SoftGate on head g of `layer`: every gate 0, so values bit-identical to Drop's. Returns Drop's.
  const auto soft_gate_drops_all = [&](const LayerView<T>& layer, const Vector<Real>& mass) {
    const auto soft = run_merge<SoftGate>(layer, g, mass, kept, route);
    auto drop = run_merge<Drop>(layer, g, mass, kept, route);
    CHECK(soft.gate.size() == static_cast<Index>(evicted.size()));
    CHECK((soft.gate.array() == Real(0)).all());
    CHECK(soft.values == drop.values);  // bit-identical: nothing was poured in
    CHECK(soft.keys == drop.keys);
    return drop;
  };

  SECTION("gates 0: values whose sums of squares overflow the arithmetic type") {
    // Finite values, but Σ v² overflows: the cosine is inf/inf = NaN, and the gate must be 0, not NaN.
    const double big = std::is_same_v<Real, float> ? 2e19 : 1e160;
    for (long j = 0; j < f.n; ++j)
      for (long k = 0; k < f.d; ++k) f.V.at(g, j, k) = big;
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
    const LayerView<T> layer = b.view();
    soft_gate_drops_all(layer, library_mass(layer, g));
  }
  SECTION("gates 0: opposite, orthogonal and zero-norm evicted values") {
    // Kept values live in the first half of the dimensions; evicted values are either −2·target
    // (cosine −1), supported on the second half only (cosine exactly 0), or zero.
    for (Index i : kept)
      for (long k = half; k < f.d; ++k) f.V.at(g, i, k) = 0.0;
    // One target has a zero value altogether: a zero-norm vector has cosine 0 with anything.
    const long zero_target = route[static_cast<std::size_t>(evicted[1])];
    for (long k = 0; k < f.d; ++k) f.V.at(g, zero_target, k) = 0.0;
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const long j = evicted[e], t = route[static_cast<std::size_t>(j)];
      for (long k = 0; k < f.d; ++k) {
        if (e % 3 == 0) f.V.at(g, j, k) = -2.0 * f.V.at(g, t, k);
        else if (e % 3 == 1) f.V.at(g, j, k) = k < half ? 0.0 : f.V.at(g, j, k);
        else f.V.at(g, j, k) = 0.0;
      }
    }
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
    const LayerView<T> layer = b.view();
    const auto mass = library_mass(layer, g);
    const auto drop = soft_gate_drops_all(layer, mass);
    // MergeAll on the same data does change values (the construction is not vacuous).
    const auto all = run_merge<MergeAll>(layer, g, mass, kept, route);
    CHECK_FALSE(all.values == drop.values);
  }
  SECTION("gates 1: evicted values parallel to their targets") {
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const long j = evicted[e], t = route[static_cast<std::size_t>(j)];
      const double c = 0.5 + static_cast<double>(e % 4);  // positive multiples
      for (long k = 0; k < f.d; ++k) f.V.at(g, j, k) = c * f.V.at(g, t, k);
    }
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
    const LayerView<T> layer = b.view();
    const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();
    const auto probs = ref::window_probs(b.queries.rounded(), K, f.scale(), 0.0);
    const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
    const auto mass = library_mass(layer, g);
    const auto soft = run_merge<SoftGate>(layer, g, mass, kept, route);
    const auto all = run_merge<MergeAll>(layer, g, mass, kept, route);
    const auto& tol = kTol.float_vs_double.values;
    CHECK(kvc::test::within(soft.gate.template cast<double>(), Eigen::VectorXd::Ones(soft.gate.size()), tol));
    CHECK((all.gate.array() == Real(1)).all());
    const Eigen::MatrixXd sv = soft.values.template cast<double>(), av = all.values.template cast<double>();
    CHECK(kvc::test::within(sv, av, tol));
    const ref::Merged want = ref::merge(g, kvc::test::to_long(kept), route, K, V, a, ref::MergeAll);
    CHECK(kvc::test::within(av, want.values, tol));
    CHECK_FALSE(all.values == kept_rows<Real>(layer.values, g, kept));  // something was merged
  }
}

TEMPLATE_TEST_CASE("mergers: tiny and zero mass use the floor τ = 1e-12·max a", "[merger][tau]", float, double) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(204);
  const long g = 1;
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();
  const std::vector<Index> kept = {0, 10, 20, 30, 40, 50, 60, 70, 80, 90};
  const std::vector<Index> evicted = complement(kept, f.n);
  // Bucket 10 puts every evicted token with the kept token at the start of its bucket.
  const auto probs = ref::window_probs(b.queries.rounded(), K, f.scale(), 0.0);
  const auto route = ref::route(g, kvc::test::to_long(kept), f.n, ref::RouteKeyCosine, 10, K,
                                ref::window_mass(probs, f.Hkv), probs, 2);

  struct Case {
    const char* name;
    std::vector<double> mass;
  };
  std::vector<Case> cases;
  std::vector<double> m0(static_cast<std::size_t>(f.n));
  for (long j = 0; j < f.n; ++j) m0[static_cast<std::size_t>(j)] = 0.5 + 0.01 * double(j % 7);
  {
    // Kept tokens with zero own mass: the floor τ = 1e-12·max a takes their place. Kept 40 receives
    // only contributions far below τ (41..49 at 1e-30), so it must stay ≈ v_40, not their average.
    auto m = m0;
    for (long i : {10L, 40L, 70L}) m[static_cast<std::size_t>(i)] = 0.0;
    for (long j = 41; j < 50; ++j) m[static_cast<std::size_t>(j)] = 1e-30;
    cases.push_back({"zero own mass", m});
  }
  {
    std::vector<double> m(static_cast<std::size_t>(f.n), 0.0);  // all zero: τ = 0, nothing moves
    cases.push_back({"all mass zero", m});
  }
  {
    auto m = m0;  // everything tiny (τ ≈ 1e-42, subnormal in float), some kept masses exactly 0
    for (double& x : m) x *= 1e-30;
    for (long i : {0L, 20L, 50L}) m[static_cast<std::size_t>(i)] = 0.0;
    cases.push_back({"tiny mass", m});
  }
  {
    auto m = m0;  // every evicted token has zero mass: nothing is poured in although gates may be > 0
    for (Index j : evicted) m[static_cast<std::size_t>(j)] = 0.0;
    cases.push_back({"zero evicted mass", m});
  }
  for (const Case& c : cases) {
    Vector<Real> mass(f.n);
    Eigen::MatrixXd a = Eigen::MatrixXd::Ones(f.Hkv, f.n);  // head 0's row is never read
    for (long j = 0; j < f.n; ++j) {
      mass[j] = static_cast<Real>(c.mass[static_cast<std::size_t>(j)]);
      a(g, j) = static_cast<double>(mass[j]);
    }
    for (int which : {1, 2}) {
      INFO(c.name << " " << kind_name(which));
      const auto got = run_kind(which, layer, g, mass, kept, route);
      const ref::Merged want = ref::merge(g, kvc::test::to_long(kept), route, K, V, a, ref_kind(which));
      CHECK(got.values.allFinite());
      const Eigen::MatrixXd gv = got.values.template cast<double>();
      INFO("elementwise ratio " << kvc::test::elementwise_ratio(gv, want.values, kTol.float_vs_double.values));
      CHECK(kvc::test::within(gv, want.values, kTol.float_vs_double.values));
      if (c.mass == cases[0].mass) {  // kept 40 (entry 4): τ outweighs the 1e-30 contributions
        const Eigen::MatrixXd v40 = kept_rows<Real>(layer.values, g, {40}).template cast<double>();
        CHECK(kvc::test::within(gv.row(4), v40, kTol.float_vs_double.values));
      }
      if (c.mass == cases[1].mass || c.mass == cases[3].mass)
        CHECK(got.values == kept_rows<Real>(layer.values, g, kept));  // no positive weight anywhere
    }
  }
}

TEST_CASE("mergers on half and bfloat16 inputs agree with the double result within the table",
          "[merger][half]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(205);
  // Kept sets and routes are pinned from the reference on the original inputs (SPEC decisions may
  // flip under input rounding; the values may not move more than the table allows).
  const auto probs = ref::window_probs(f.Q, f.K, f.scale(), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  std::vector<std::vector<Index>> kept(2);
  std::vector<std::vector<long>> route(2);
  for (long g = 0; g < f.Hkv; ++g) {
    kept[static_cast<std::size_t>(g)] = random_subset(f.rng, f.n, 32);
    route[static_cast<std::size_t>(g)] =
        ref::route(g, kvc::test::to_long(kept[static_cast<std::size_t>(g)]), f.n, ref::RouteKeyCosine, 32, f.K, a,
                   probs, 2);
  }
  auto check = [&](auto tag, const kvc::test::PrecisionTols& tol) {
    using T = decltype(tag);
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
    const LayerView<T> layer = b.view();
    for (long g = 0; g < f.Hkv; ++g) {
      const auto& kg = kept[static_cast<std::size_t>(g)];
      const auto mass = library_mass(layer, g);
      for (int which : {1, 2}) {
        INFO("head " << g << " " << kind_name(which));
        const ref::Merged want = ref::merge(g, kvc::test::to_long(kg), route[static_cast<std::size_t>(g)], f.K, f.V,
                                            a, ref_kind(which));
        const auto got = run_kind(which, layer, g, mass, kg, route[static_cast<std::size_t>(g)]);
        const Eigen::MatrixXd gv = got.values.template cast<double>();
        INFO("elementwise ratio " << kvc::test::elementwise_ratio(gv, want.values, tol.values) << ", normwise "
                                  << kvc::test::normwise_error(gv, want.values));
        CHECK(kvc::test::within(gv, want.values, tol.values));
      }
    }
  };
  SECTION("half") { check(Eigen::half{}, kTol.half_vs_float); }
  SECTION("bfloat16") { check(Eigen::bfloat16{}, kTol.bf16_vs_float); }
}

TEMPLATE_TEST_CASE("MergeAll and SoftGate on arbitrary routes and head dims with a SIMD tail",
                   "[merger][routes]", float, double, Eigen::half) {
  // The merger sweeps evicted tokens in blocks and finishes a kept row right after its last
  // contribution. Here routes are arbitrary (targets far from their tokens, interleaved, revisited after
  // long gaps, one row receiving the very last token, a short last block) and d has a tail past
  // the SIMD batches. Reference: kvc::ref::merge on the values the library reads (rounded for half).
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  std::mt19937_64 rng = kvc::test::make_rng(206);
  const long Hkv = 2, Hq = 4, W = 8;
  for (long d : {20L, 37L}) {
    for (long n : {97L, 98L, 99L, 100L}) {  // (n − m) mod 4 = 2, 3, 0, 1: every short last block
      const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
      const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
      const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hq, W, d, 1.5);
      kvc::test::LayerBuffers<T> b(K, V, Q, Layout::token_major);
      const LayerView<T> layer = b.view();
      const ref::Tensor3 Kr = b.keys.rounded(), Vr = b.values.rounded();
      const auto probs = ref::window_probs(b.queries.rounded(), Kr, 1.0 / std::sqrt(double(d)), 0.0);
      const Eigen::MatrixXd a = ref::window_mass(probs, Hkv);
      for (long g = 0; g < Hkv; ++g) {
        const std::vector<Index> kept = random_subset(rng, n, 23);
        const std::vector<Index> evicted = complement(kept, n);
        std::vector<long> route(static_cast<std::size_t>(n));
        for (Index i : kept) route[static_cast<std::size_t>(i)] = i;
        std::uniform_int_distribution<std::size_t> pick(0, kept.size() - 1);
        for (std::size_t e = 0; e < evicted.size(); ++e) {
          std::size_t t = pick(rng);
          if (e < 6) t = 3;                                           // a run of one target
          if (e + 1 == evicted.size() || e == evicted.size() / 2) t = 0;  // revisited after a gap, and last
          route[static_cast<std::size_t>(evicted[e])] = kept[t];
        }
        const auto mass = library_mass(layer, g);
        for (int which : {1, 2}) {
          INFO("d " << d << " n " << n << " head " << g << " " << kind_name(which));
          const ref::Merged want = ref::merge(g, kvc::test::to_long(kept), route, Kr, Vr, a, ref_kind(which));
          const auto got = run_kind(which, layer, g, mass, kept, route);
          const Eigen::MatrixXd gv = got.values.template cast<double>();
          INFO("values: elementwise ratio " << kvc::test::elementwise_ratio(gv, want.values, kTol.float_vs_double.values)
                                            << ", normwise " << kvc::test::normwise_error(gv, want.values));
          CHECK(kvc::test::within(gv, want.values, kTol.float_vs_double.values));
          CHECK(kvc::test::within(got.gate.template cast<double>(), evicted_gates(want, evicted),
                                  kTol.float_vs_double.values));
        }
      }
    }
  }
}
