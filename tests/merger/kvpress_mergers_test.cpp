// NearestKeyMerge (with global key-cosine routing) and CacheMerge (CaM in expectation) against the
// references ref::merge_nearest_key and ref::merge_cam (float, double, half, bfloat16, both layouts),
// and their edge cases: nothing evicted, zero keys and values, equal keys (ties), a threshold no
// cosine reaches (kvpress issue #287), zero mass, windows past the last kept token, bad options.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/merger/cache_merge.hpp>
#include <kvcompress/merger/nearest_key_merge.hpp>
#include <kvcompress/pipeline.hpp>
#include <kvcompress/router/bucket_router.hpp>

#include "support/bridge.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <limits>
#include <vector>

using namespace kvc;
using kvc::test::complement;
using kvc::test::kTol;
using kvc::test::Layout;
using kvc::test::library_mass;
using kvc::test::random_subset;

namespace {

/// out.keys / out.values as the pipeline hands them to a merger: the kept rows, converted.
template <class T>
MergeOutput<compute_t<T>> gathered(const LayerView<T>& layer, Index g, const std::vector<Index>& kept) {
  using Real = compute_t<T>;
  const Index m = static_cast<Index>(kept.size()), d = layer.head_dim();
  MergeOutput<Real> out;
  out.keys.resize(m, d);
  out.values.resize(m, d);
  for (Index i = 0; i < m; ++i)
    for (Index k = 0; k < d; ++k) {
      out.keys(i, k) = to_real<Real>(layer.keys.row(g, kept[static_cast<std::size_t>(i)])[k]);
      out.values(i, k) = to_real<Real>(layer.values.row(g, kept[static_cast<std::size_t>(i)])[k]);
    }
  out.gate.setConstant(static_cast<Index>(layer.tokens() - m), std::numeric_limits<Real>::quiet_NaN());
  return out;
}

/// Global key-cosine routing (the library's BucketRouter<0>) and NearestKeyMerge on head g. `route`
/// (out): the routing as n kept positions (kept positions map to themselves), for the reference.
template <class T>
MergeOutput<compute_t<T>> run_nearest_key(const LayerView<T>& layer, Index g, const std::vector<Index>& kept,
                                          std::vector<long>& route, double threshold = 0.0) {
  using Real = compute_t<T>;
  const std::vector<Index> evicted = complement(kept, layer.tokens());
  const Vector<Real> mass = Vector<Real>::Zero(layer.tokens());  // neither policy reads it here
  const AttentionArguments attn;
  const HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
  Routing routing;
  BucketRouter<0>{}.route(ctx, routing);
  REQUIRE(routing.target.size() == evicted.size());
  route.assign(static_cast<std::size_t>(layer.tokens()), -1);
  for (Index i : kept) route[static_cast<std::size_t>(i)] = i;
  for (std::size_t e = 0; e < evicted.size(); ++e)
    route[static_cast<std::size_t>(evicted[e])] = kept[static_cast<std::size_t>(routing.target[e])];
  MergeOutput<Real> out = gathered(layer, g, kept);
  NearestKeyMerge merger{{threshold}};
  REQUIRE(merger.validate(layer.tokens(), static_cast<Index>(kept.size())).is_ok());
  merger.merge(ctx, routing, out);
  return out;
}

/// CacheMerge on head g with window B and the given mass.
template <class T>
MergeOutput<compute_t<T>> run_cam(const LayerView<T>& layer, Index g, const std::vector<Index>& kept,
                                  const Vector<compute_t<T>>& mass, Index B) {
  const std::vector<Index> evicted = complement(kept, layer.tokens());
  const AttentionArguments attn;
  const HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
  auto out = gathered(layer, g, kept);
  CacheMerge merger{{B}};
  REQUIRE(merger.validate(layer.tokens(), static_cast<Index>(kept.size())).is_ok());
  merger.merge(ctx, Routing{}, out);
  return out;
}

/// Reference gates at the evicted positions (the library's gate order).
Eigen::VectorXd evicted_gates(const ref::Merged& m, const std::vector<Index>& evicted) {
  Eigen::VectorXd g(static_cast<Index>(evicted.size()));
  for (std::size_t e = 0; e < evicted.size(); ++e) g[static_cast<Index>(e)] = m.gate[static_cast<std::size_t>(evicted[e])];
  return g;
}

/// Values, gates and keys of `got` against `want` (keys bit-exact: neither merger changes them).
template <class Real>
void check_merged(const MergeOutput<Real>& got, const ref::Merged& want, const std::vector<Index>& evicted) {
  const auto& tol = kTol.float_vs_double.values;
  const Eigen::MatrixXd gv = got.values.template cast<double>();
  INFO("values: elementwise ratio " << kvc::test::elementwise_ratio(gv, want.values, tol) << ", normwise "
                                    << kvc::test::normwise_error(gv, want.values));
  CHECK(kvc::test::within(gv, want.values, tol));
  REQUIRE(got.gate.size() == static_cast<Index>(evicted.size()));
  CHECK(got.gate.allFinite());
  CHECK(kvc::test::within(got.gate.template cast<double>(), evicted_gates(want, evicted), tol));
  CHECK(got.keys.template cast<double>() == want.keys);
}

/// The reference route by global key cosine on the stored keys (ties to the lower position).
std::vector<long> ref_route(long g, const std::vector<Index>& kept, const ref::Tensor3& K) {
  return ref::route(g, kvc::test::to_long(kept), K.n, ref::RouteKeyCosine, 0, K, Eigen::MatrixXd::Zero(K.H, K.n), {},
                    1);
}

using Data = kvc::test::HeadData;

}  // namespace

TEMPLATE_TEST_CASE("NearestKeyMerge after global key-cosine routing matches the reference", "[merger][nearest-key]",
                   float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Data f(211);
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, layout);
    const LayerView<T> layer = b.view();
    const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();  // the stored values
    long merged = 0, dropped = 0;
    for (long g = 0; g < f.Hkv; ++g)
      for (Index m : {Index(1), Index(7), Index(30), f.n - 1}) {
        INFO(kvc::test::to_string(layout) << " head " << g << " m " << m);
        const std::vector<Index> kept = random_subset(f.rng, f.n, m);
        const std::vector<Index> evicted = complement(kept, f.n);
        std::vector<long> route;
        const auto got = run_nearest_key(layer, g, kept, route);
        CHECK(route == ref_route(g, kept, K));
        check_merged(got, ref::merge_nearest_key(g, kvc::test::to_long(kept), route, K, V, 0.0), evicted);
        for (Index e = 0; e < got.gate.size(); ++e) (got.gate[e] > 0 ? merged : dropped) += 1;
        // A threshold drops the tokens below it and keeps the others' weights.
        const auto high = run_nearest_key(layer, g, kept, route, 0.3);
        check_merged(high, ref::merge_nearest_key(g, kvc::test::to_long(kept), route, K, V, 0.3), evicted);
      }
    CHECK(merged > 50);  // negative cosines drop, positive ones merge: both occur on this data
    CHECK(dropped > 5);
  }
}

TEMPLATE_TEST_CASE("NearestKeyMerge edge cases: nothing evicted, zero vectors, equal keys, unreachable threshold",
                   "[merger][nearest-key][edge]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(212);
  const long g = 1;
  const std::vector<Index> kept = random_subset(f.rng, f.n, 20);
  const std::vector<Index> evicted = complement(kept, f.n);
  auto run = [&](const ref::Tensor3& K, const ref::Tensor3& V, const std::vector<Index>& kp, double threshold) {
    kvc::test::LayerBuffers<T> b(K, V, f.Q, Layout::token_major);
    const LayerView<T> layer = b.view();
    std::vector<long> route;
    const auto got = run_nearest_key(layer, g, kp, route, threshold);
    const ref::Tensor3 Kr = b.keys.rounded(), Vr = b.values.rounded();
    CHECK(route == ref_route(g, kp, Kr));
    const ref::Merged want = ref::merge_nearest_key(g, kvc::test::to_long(kp), route, Kr, Vr, threshold);
    check_merged(got, want, complement(kp, f.n));
    return std::make_pair(got, want);
  };

  SECTION("nothing evicted (m = n): the identity") {
    std::vector<Index> all(static_cast<std::size_t>(f.n));
    for (Index j = 0; j < f.n; ++j) all[static_cast<std::size_t>(j)] = j;
    const auto [got, want] = run(f.K, f.V, all, 0.0);
    CHECK(got.gate.size() == 0);
    CHECK(got.values.template cast<double>() == want.values);
  }
  SECTION("zero keys and zero values: weight 0, the kept rows unchanged") {
    // Every evicted key zero (cosine 0 with anything, routed to kept[0] by the tie rule) ...
    ref::Tensor3 K = f.K, V = f.V;
    for (Index j : evicted)
      for (long k = 0; k < f.d; ++k) K.at(g, j, k) = 0.0;
    const auto [got, want] = run(K, V, kept, 0.0);
    CHECK((got.gate.array() == Real(0)).all());
    CHECK(got.values.template cast<double>() == want.values);  // unchanged, bit-exact
    // ... every evicted value zero (weight 0 although the cosine is positive) ...
    ref::Tensor3 V0 = f.V;
    for (Index j : evicted)
      for (long k = 0; k < f.d; ++k) V0.at(g, j, k) = 0.0;
    const auto [got0, want0] = run(f.K, V0, kept, 0.0);
    CHECK((got0.gate.array() == Real(0)).all());
    CHECK(got0.values.template cast<double>() == want0.values);
    // ... and every value zero (‖v_e‖ + ‖v_t‖ = 0): finite, nothing moves; zero kept keys: cosine 0.
    ref::Tensor3 Vz(f.Hkv, f.n, f.d), Kz = f.K;
    for (Index i : kept)
      for (long k = 0; k < f.d; ++k) Kz.at(g, i, k) = 0.0;
    const auto [gz, wz] = run(f.K, Vz, kept, 0.0);
    CHECK((gz.gate.array() == Real(0)).all());
    CHECK(gz.values.allFinite());
    const auto [gk, wk] = run(Kz, f.V, kept, 0.0);
    CHECK((gk.gate.array() == Real(0)).all());
  }
  SECTION("zero kept values: the weight is the cosine") {
    ref::Tensor3 V = f.V;
    for (Index i : kept)
      for (long k = 0; k < f.d; ++k) V.at(g, i, k) = 0.0;
    const auto [got, want] = run(f.K, V, kept, 0.0);
    long merged = 0;
    for (Index e = 0; e < got.gate.size(); ++e) merged += got.gate[e] > 0 ? 1 : 0;
    CHECK(merged > 0);
  }
  SECTION("equal keys: every token goes to the first kept entry with weight ‖v_e‖ / (‖v_e‖ + ‖v_t‖)") {
    ref::Tensor3 K = f.K;
    for (long j = 0; j < f.n; ++j)
      for (long k = 0; k < f.d; ++k) K.at(g, j, k) = f.K.at(g, 0, k);
    const auto [got, want] = run(K, f.V, kept, 0.0);
    for (Index j : evicted) CHECK(want.gate[static_cast<std::size_t>(j)] > 0.0);
    // Only the first kept row moved.
    kvc::test::LayerBuffers<T> b(K, f.V, f.Q, Layout::token_major);
    const ref::Tensor3 Vr = b.values.rounded();
    for (std::size_t i = 1; i < kept.size(); ++i)
      for (long k = 0; k < f.d; ++k) CHECK(got.values(static_cast<Index>(i), k) == static_cast<Real>(Vr.at(g, kept[i], k)));
  }
  SECTION("a threshold no cosine reaches (kvpress #287): nothing merged, finite, unchanged") {
    const auto [got, want] = run(f.K, f.V, kept, 1.0);
    CHECK((got.gate.array() == Real(0)).all());
    CHECK(got.values.allFinite());
    CHECK(got.values.template cast<double>() == want.values);
  }
}

TEMPLATE_TEST_CASE("CacheMerge matches the reference", "[merger][cam]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Data f(213);
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, layout);
    const LayerView<T> layer = b.view();
    const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();
    // The reference reads the mass the merger is given (the window stage's, tested against
    // ref::window_mass in window_attention_test): this compares the merge arithmetic alone.
    Eigen::MatrixXd a(f.Hkv, f.n);
    long partial = 0, full = 0;
    for (long g = 0; g < f.Hkv; ++g) {
      const auto mass = library_mass(layer, g);
      for (long j = 0; j < f.n; ++j) a(g, j) = static_cast<double>(mass[j]);
      for (Index m : {Index(1), Index(9), Index(40), f.n - 1})
        for (Index B : {Index(1), Index(3), Index(32), Index(200)}) {
          INFO(kvc::test::to_string(layout) << " head " << g << " m " << m << " window " << B);
          const std::vector<Index> kept = random_subset(f.rng, f.n, m);
          const std::vector<Index> evicted = complement(kept, f.n);
          const auto got = run_cam(layer, g, kept, mass, B);
          check_merged(got, ref::merge_cam(g, kvc::test::to_long(kept), K, V, a, B), evicted);
          for (Index e = 0; e < got.gate.size(); ++e) {
            partial += got.gate[e] > 0 && got.gate[e] < 1 ? 1 : 0;
            full += got.gate[e] == 1 ? 1 : 0;
          }
        }
    }
    CHECK(partial > 50);  // both sides of min(a_e / ā, 1) occur on this data
    CHECK(full > 50);
  }
}

TEMPLATE_TEST_CASE("CacheMerge edge cases: nothing evicted, zero mass, no kept token after, sinks only",
                   "[merger][cam][edge]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(214);
  const long g = 0;
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();
  const auto stored_mass = library_mass(layer, g);
  auto check_against_ref = [&](const std::vector<Index>& kept, const Vector<Real>& mass, Index B) {
    Eigen::MatrixXd a = Eigen::MatrixXd::Zero(f.Hkv, f.n);
    for (long j = 0; j < f.n; ++j) a(g, j) = static_cast<double>(mass[j]);
    const auto got = run_cam(layer, g, kept, mass, B);
    const ref::Merged want = ref::merge_cam(g, kvc::test::to_long(kept), K, V, a, B);
    check_merged(got, want, complement(kept, f.n));
    return got;
  };
  const std::vector<Index> kept = random_subset(f.rng, f.n, 24);

  SECTION("nothing evicted (m = n): the identity") {
    std::vector<Index> all(static_cast<std::size_t>(f.n));
    for (Index j = 0; j < f.n; ++j) all[static_cast<std::size_t>(j)] = j;
    const auto got = check_against_ref(all, stored_mass, 32);
    CHECK(got.gate.size() == 0);
  }
  SECTION("a zero-mass head: every gate 0, values bit-identical") {
    const auto got = check_against_ref(kept, Vector<Real>::Zero(f.n), 32);
    CHECK((got.gate.array() == Real(0)).all());
    CHECK(got.values == gathered(layer, g, kept).values);
  }
  SECTION("zero mass on the kept tokens only: every evicted token with mass merges fully") {
    Vector<Real> mass = stored_mass;
    for (Index i : kept) mass[i] = 0;
    const auto got = check_against_ref(kept, mass, 4);
    const std::vector<Index> evicted = complement(kept, f.n);
    for (std::size_t e = 0; e < evicted.size(); ++e)
      if (evicted[e] < kept.back()) CHECK(got.gate[static_cast<Index>(e)] == Real(1));
  }
  SECTION("evicted tokens after the last kept one have no window: gate 0") {
    const std::vector<Index> early = {0, 1, 2, 3, 10, 20};  // tokens 21.. follow no kept token
    const auto got = check_against_ref(early, stored_mass, 3);
    const std::vector<Index> evicted = complement(early, f.n);
    for (std::size_t e = 0; e < evicted.size(); ++e)
      if (evicted[e] > 20) CHECK(got.gate[static_cast<Index>(e)] == Real(0));
  }
  SECTION("the newest token kept alone (m = 1): the whole cache spread over it") {
    const auto got = check_against_ref({f.n - 1}, stored_mass, 32);
    CHECK(got.values.allFinite());
  }
  SECTION("zero values: finite, unchanged") {
    ref::Tensor3 Vz(f.Hkv, f.n, f.d);
    kvc::test::LayerBuffers<T> bz(f.K, Vz, f.Q, Layout::head_major);
    const auto got = run_cam(bz.view(), g, kept, stored_mass, 32);
    CHECK((got.values.array() == Real(0)).all());
  }
}

TEST_CASE("NearestKeyMerge and CacheMerge reject bad options", "[merger][nearest-key][cam][validate]") {
  for (double t : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    INFO("threshold " << t);
    CHECK_FALSE(NearestKeyMerge{{t}}.validate(10, 5).is_ok());
  }
  CHECK(NearestKeyMerge{{1.0}}.validate(10, 5).is_ok());
  CHECK_FALSE(CacheMerge{{0}}.validate(10, 5).is_ok());
  CHECK_FALSE(CacheMerge{{-3}}.validate(10, 5).is_ok());
  CHECK(CacheMerge{{1}}.validate(10, 5).is_ok());
}
