// CriticalAttention (CriticalKV's scorer) against the reference in every storage type and both layouts,
// GQA groups and awkward sizes; the CriticalKV and CriticalAdaKV presets' selections against the
// reference selections; the errors of a missing or malformed output projection.
#include <catch2/catch.hpp>

#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/scorer/critical_attention.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::Layout;

namespace {

/// W_o (D, Hq·d) with N(0, 1) entries, as float (its storage type) and as the reference reads it.
struct Projection {
  std::vector<float> data;
  Eigen::MatrixXd ref;
  Projection(std::mt19937_64& rng, Index D, Index cols) : data(static_cast<std::size_t>(D * cols)), ref(D, cols) {
    std::normal_distribution<float> N;
    for (Index r = 0; r < D; ++r)
      for (Index c = 0; c < cols; ++c) ref(r, c) = data[static_cast<std::size_t>(r * cols + c)] = N(rng);
  }
  ProjectionView view() const { return {data.data(), ref.rows(), ref.cols(), ref.cols()}; }
};

/// The scorer on each KV head with the given mass and budget: its scores (Hkv, n) in double, the
/// first-stage entries (those at the type's largest value) per head.
template <class T>
std::pair<Eigen::MatrixXd, std::vector<std::vector<long>>> scores_of(const CriticalAttention& scorer,
                                                                      const LayerView<T>& layer,
                                                                      const Eigen::MatrixXd& mass, Index m) {
  using Real = compute_t<T>;
  Eigen::MatrixXd out(layer.kv_heads(), layer.tokens());
  std::vector<std::vector<long>> first(static_cast<std::size_t>(layer.kv_heads()));
  for (Index g = 0; g < layer.kv_heads(); ++g) {
    const Vector<Real> a = mass.row(g).transpose().cast<Real>();
    ScoreContext<T> ctx(layer, g, AttentionArguments{}, a);
    ctx.set_budget(m);
    Vector<Real> s;
    scorer.score(ctx, s);
    REQUIRE(s.size() == layer.tokens());
    for (Index j = 0; j < s.size(); ++j) {
      if (s[j] == std::numeric_limits<Real>::max()) first[static_cast<std::size_t>(g)].push_back(j);
      out(g, j) = static_cast<double>(s[j]);
    }
  }
  return {out, first};
}

/// The scores off the first stage against the reference's stage 2, the first stage exactly.
template <class T>
void check_scores(const CriticalAttention& scorer, const LayerView<T>& layer, const Eigen::MatrixXd& mass, Index m,
                  const ref::Critical& want, const kvc::test::Tol& tol) {
  const auto [got, first] = scores_of(scorer, layer, mass, m);
  CHECK(first == want.first);
  Eigen::MatrixXd g2 = got, w2 = want.stage2;
  for (std::size_t g = 0; g < first.size(); ++g)
    for (long j : want.first[g]) g2(static_cast<long>(g), j) = w2(static_cast<long>(g), j) = 0.0;
  CHECK(kvc::test::elementwise_ratio(g2, w2, tol) <= 1.0);
}

}  // namespace

TEST_CASE("CriticalAttention: the first stage by pooled mass, the rest (s + eps)·‖W_o v‖₁", "[scorer][critical]") {
  STATIC_REQUIRE(policy_traits<CriticalAttention>::needs_mass);
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(511);
  // {Hkv, G, n, d, W, D, m}: n at and below the window, W = n, GQA groups of 1–3, odd d and D, a
  // budget of 1, of n and above, a first stage below the window.
  const long shapes[][7] = {{1, 1, 3, 4, 2, 1, 2},    {2, 2, 5, 3, 5, 7, 4},    {1, 3, 9, 8, 3, 5, 1},
                            {2, 1, 40, 5, 8, 33, 12}, {3, 2, 37, 16, 32, 9, 30}, {2, 3, 130, 18, 6, 17, 64},
                            {1, 2, 70, 32, 32, 40, 200}};
  const std::vector<CriticalAttention::Arguments> options = {
      CriticalAttention::Arguments{}, {0, 0.0, 0.25, 3}, {3, 0.5, 1.0, 1000}, {1, 1e-4, 0.0, 7}, {7, 1e-4, 0.5, 1}};
  const kvc::test::Tol fl{1e-4, 1e-9, 1e-4}, dbl{1e-11, 1e-300, 1e-11}, lowp{1e-4, 1e-9, 1e-4};
  for (const auto& sh : shapes) {
    const long H = sh[0], G = sh[1], n = sh[2], d = sh[3], W = sh[4], D = sh[5], m = std::min(sh[6], n);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, H, n, d);
    const ref::Tensor3 K = kvc::test::random_tensor(rng, H, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, H * G, W, d);
    const Projection wo(rng, D, H * G * d);
    // The mass as the scorer reads it (from the context): positive, with ties of pooled values unlikely.
    Eigen::MatrixXd mass(H, n);
    std::uniform_real_distribution<double> U(0.0, 2.0);
    for (long g = 0; g < H; ++g)
      for (long j = 0; j < n; ++j) mass(g, j) = U(rng);
    for (std::size_t o = 0; o < options.size(); ++o) {
      const CriticalAttention::Arguments& a = options[o];
      INFO("Hkv " << H << " G " << G << " n " << n << " d " << d << " W " << W << " D " << D << " m " << m
                  << " options " << o);
      const std::vector<long> budgets(static_cast<std::size_t>(H), m);
      const auto want = [&](const ref::Tensor3& v) {
        return ref::critical_kv(mass, v, wo.ref, G, W, budgets, a.pool_kernel, a.epsilon, a.first_stage);
      };
      const ref::Critical exact = want(V);
      for (Layout layout : {Layout::head_major, Layout::token_major}) {
        INFO("layout " << kvc::test::to_string(layout));
        kvc::test::LayerBuffers<float> f(K, V, Q, layout);
        LayerView<float> fv = f.view();
        fv.output_projection = wo.view();
        check_scores(CriticalAttention{a}, fv, mass, m, exact, fl);
        kvc::test::LayerBuffers<double> dd(K, V, Q, layout);
        LayerView<double> dv = dd.view();
        dv.output_projection = wo.view();
        check_scores(CriticalAttention{a}, dv, mass, m, exact, dbl);
        kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, layout);
        LayerView<Eigen::half> hv = h.view();
        hv.output_projection = wo.view();
        check_scores(CriticalAttention{a}, hv, mass, m, want(h.values.rounded()), lowp);
        kvc::test::LayerBuffers<Eigen::bfloat16> b(K, V, Q, layout);
        LayerView<Eigen::bfloat16> bv = b.view();
        bv.output_projection = wo.view();
        check_scores(CriticalAttention{a}, bv, mass, m, want(b.values.rounded()), lowp);
      }
    }
  }
}

TEST_CASE("CriticalAttention: a row stride beyond the columns, and no first stage without a budget",
          "[scorer][critical]") {
  auto rng = kvc::test::make_rng(512);
  const long H = 2, G = 2, n = 30, d = 6, W = 4, D = 5, stride = H * G * d + 3;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, H, n, d), V = kvc::test::random_tensor(rng, H, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, H * G, W, d);
  const Projection wo(rng, D, H * G * d);
  std::vector<float> strided(static_cast<std::size_t>(D * stride), std::numeric_limits<float>::quiet_NaN());
  for (long r = 0; r < D; ++r)
    for (long c = 0; c < H * G * d; ++c)
      strided[static_cast<std::size_t>(r * stride + c)] = wo.data[static_cast<std::size_t>(r * H * G * d + c)];
  Eigen::MatrixXd mass = Eigen::MatrixXd::Random(H, n).cwiseAbs();
  kvc::test::LayerBuffers<double> buf(K, V, Q, Layout::head_major);
  LayerView<double> layer = buf.view();
  layer.output_projection = {strided.data(), D, H * G * d, stride};
  const std::vector<long> budgets(static_cast<std::size_t>(H), 10);
  check_scores(CriticalAttention{}, layer, mass, 10, ref::critical_kv(mass, V, wo.ref, G, W, budgets, 5, 1e-4, 0.5),
               {1e-11, 1e-300, 1e-11});
  const std::vector<long> none(static_cast<std::size_t>(H), 0);
  const ref::Critical unbudgeted = ref::critical_kv(mass, V, wo.ref, G, W, none, 5, 1e-4, 0.5);
  REQUIRE(unbudgeted.first[0].empty());
  check_scores(CriticalAttention{}, layer, mass, 0, unbudgeted, {1e-11, 1e-300, 1e-11});
}

TEST_CASE("CriticalKV and CriticalAdaKV select as the reference does", "[scorer][critical][preset]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(513);
  // {Hkv, G, n, d, W, D}
  const long shapes[][6] = {{2, 2, 120, 16, 32, 24}, {4, 1, 90, 8, 16, 11}, {1, 4, 200, 12, 40, 7}};
  for (const auto& sh : shapes) {
    const long H = sh[0], G = sh[1], n = sh[2], d = sh[3], W = sh[4], D = sh[5];
    const ref::Tensor3 K = kvc::test::random_tensor(rng, H, n, d), V = kvc::test::random_tensor(rng, H, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, H * G, W, d);
    const Projection wo(rng, D, H * G * d);
    const double scale = 1.0 / std::sqrt(double(d));
    const Eigen::MatrixXd mass = ref::window_mass(ref::window_probs(Q, K, scale, 0.0), H);
    for (Layout layout : {Layout::head_major, Layout::token_major})
      for (long m : {1L, 20L, 45L, 70L, n}) {
        INFO("Hkv " << H << " G " << G << " n " << n << " W " << W << " m " << m << " layout "
                    << kvc::test::to_string(layout));
        kvc::test::LayerBuffers<float> f(K, V, Q, layout);
        LayerView<float> layer = f.view();
        layer.output_projection = wo.view();
        const std::vector<long> budgets(static_cast<std::size_t>(H), m);
        const Eigen::MatrixXd c = ref::critical_kv(mass, V, wo.ref, G, W, budgets, 5, 1e-4, 0.5).scores();
        const auto want = ref::select(c, budgets, 0, 32, 0, false, false);
        const LayerResult<float> got = CriticalKV{}.run(layer, Budget::tokens(m));
        for (long g = 0; g < H; ++g) CHECK(kvc::test::to_long(got.heads[g].positions) == want[g]);
        const std::vector<long> ada = ref::adakv_budgets(c, budgets, 0.2);
        const auto want_ada = ref::select(c, ada, 0, 32, 0, false, false);
        const LayerResult<float> got_ada = CriticalAdaKV{}.run(layer, Budget::tokens(m));
        for (long g = 0; g < H; ++g) CHECK(kvc::test::to_long(got_ada.heads[g].positions) == want_ada[g]);
      }
  }
}

TEST_CASE("CriticalKV without W_o or with a malformed one is an error naming output_projection; overflow",
          "[scorer][critical][errors]") {
  using Catch::Matchers::Contains;
  auto rng = kvc::test::make_rng(514);
  const long H = 2, G = 2, n = 40, d = 8, W = 8, D = 6;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, H, n, d), V = kvc::test::random_tensor(rng, H, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, H * G, W, d);
  Projection wo(rng, D, H * G * d);
  kvc::test::LayerBuffers<float> f(K, V, Q, Layout::head_major);
  LayerView<float> layer = f.view();
  const Budget budget = Budget::ratio(0.5);
  // Absent.
  CHECK_THAT(CriticalKV{}.validate(layer, budget).message(),
             Contains("output_projection") && Contains("CriticalKV") && Contains("absent"));
  CHECK_THROWS_WITH(CriticalKV{}.run(layer, budget), Contains("output_projection"));
  CHECK_THROWS_WITH(CriticalAdaKV{}.run(layer, budget), Contains("output_projection"));
  {
    const Vector<float> a = Vector<float>::Ones(n);
    Vector<float> s;
    CHECK_THROWS_WITH(CriticalAttention{}.score(ScoreContext<float>(layer, 0, AttentionArguments{}, a), s),
                      Contains("output_projection"));
  }
  // Wrong number of columns, no rows, a short stride, a null pointer with a shape.
  layer.output_projection = {wo.data.data(), D, H * G * d - 1, H * G * d - 1};
  CHECK_THROWS_WITH(CriticalKV{}.run(layer, budget), Contains("output_projection: shape [6][31]") && Contains("query heads=4 x head dim=8"));
  layer.output_projection = {wo.data.data(), 0, H * G * d, H * G * d};
  CHECK_THROWS_WITH(CriticalKV{}.run(layer, budget), Contains("output_projection: shape [0][32]"));
  layer.output_projection = {wo.data.data(), D, H * G * d, H * G * d - 2};
  CHECK_THROWS_WITH(CriticalKV{}.run(layer, budget), Contains("output_projection: row_stride 30"));
  layer.output_projection = {nullptr, D, H * G * d, H * G * d};
  CHECK_THROWS_WITH(CriticalKV{}.run(layer, budget), Contains("output_projection: data is null"));
  // A malformed W_o is an error for every method (the shape is checked whenever it is given).
  CHECK_THROWS_WITH(SnapKV{}.run(layer, budget), Contains("output_projection: data is null"));
  // A non-finite entry.
  wo.data[13] = std::numeric_limits<float>::infinity();
  layer.output_projection = wo.view();
  CHECK_THROWS_WITH(CriticalKV{}.run(layer, budget), Contains("output_projection[0][13] is not finite"));
  // ‖W_o v‖₁ beyond float from finite values and W_o: an overflow error, not an infinite score.
  wo.data[13] = 0.5f;
  {
    ref::Tensor3 big = V;
    for (double& x : big.data) x *= 1e30;
    std::vector<float> huge = wo.data;
    for (float& x : huge) x *= 1e30f;
    kvc::test::LayerBuffers<float> b(K, big, Q, Layout::head_major);
    LayerView<float> overflowing = b.view();
    overflowing.output_projection = {huge.data(), D, H * G * d, H * G * d};
    CHECK_THROWS_WITH(CriticalKV{}.run(overflowing, budget), Contains("overflows"));
  }
  // Options.
  CriticalKV::Arguments args;
  args.scorer.first_stage = 1.5;
  CHECK_THROWS_WITH(CriticalKV(args).run(layer, budget), Contains("scorer.first_stage must be in [0, 1]"));
  args.scorer = {};
  args.scorer.pool_kernel = 4;
  CHECK_THROWS_WITH(CriticalKV(args).run(layer, budget), Contains("scorer.pool_kernel must be odd"));
  args.scorer = {};
  args.scorer.epsilon = -1.0;
  CHECK_THROWS_WITH(CriticalKV(args).run(layer, budget), Contains("scorer.epsilon"));
  args.scorer = {};
  CHECK_NOTHROW(CriticalKV(args).run(layer, budget));
}
