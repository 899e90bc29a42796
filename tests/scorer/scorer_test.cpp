// Scorers (SPEC §4, docs/methods.md): AttentionMass, ValueWeighted, KeyNorm, Position,
// LastQueryAttention (TOVA) and KeyDiversity (KeyDiff) against the reference scorers, fed with the
// library's own window attention mass, and through a pipeline's selection; ScoreContext's window rows.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/compensator/compensators.hpp>
#include <kvcompress/merger/gated_merge.hpp>
#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/router/bucket_router.hpp>
#include <kvcompress/scorer/key_diversity.hpp>
#include <kvcompress/scorer/last_query_attention.hpp>
#include <kvcompress/scorer/scorers.hpp>
#include <kvcompress/selector/top_k.hpp>

#include "support/bridge.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;
using kvc::test::library_mass;

namespace {

struct Problem {
  long Hkv, G, n, d, W;
  ref::Tensor3 K, V, Q;
  Problem(std::mt19937_64& rng, long Hkv_, long G_, long n_, long d_, long W_)
      : Hkv(Hkv_), G(G_), n(n_), d(d_), W(W_), K(kvc::test::random_tensor(rng, Hkv_, n_, d_)),
        V(kvc::test::random_tensor(rng, Hkv_, n_, d_)), Q(kvc::test::random_tensor(rng, Hkv_ * G_, W_, d_)) {
    // A zero value vector and a zero key: ‖·‖ = 0 edge cases.
    for (long k = 0; k < d; ++k) {
      V.at(0, n / 2, k) = 0.0;
      K.at(Hkv - 1, n / 3, k) = 0.0;
    }
  }
};

/// Scores of every KV head from Scorer, with the library's mass: (Hkv, n) in double.
template <class Scorer, class T>
Eigen::MatrixXd library_scores(const LayerView<T>& layer) {
  using Real = compute_t<T>;
  Eigen::MatrixXd out(layer.kv_heads(), layer.tokens());
  const AttentionArguments attention;
  for (Index g = 0; g < layer.kv_heads(); ++g) {
    const Vector<Real> mass = library_mass(layer, g);
    Vector<Real> s;
    Scorer{}.score(ScoreContext<T>(layer, g, attention, mass), s);
    REQUIRE(s.size() == layer.tokens());
    out.row(g) = s.template cast<double>().transpose();
  }
  return out;
}

/// Reference scores for each scorer, from the reference mass.
Eigen::MatrixXd reference_scores(const char* which, const ref::Tensor3& K, const ref::Tensor3& V,
                                 const ref::Tensor3& Q) {
  const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(K.d)), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, K.H);
  const std::string w = which;
  if (w == "AttentionMass") return ref::attention_mass(a);
  if (w == "ValueWeighted") return ref::value_weighted(a, V);
  if (w == "KeyNorm") return ref::key_norm(K);
  if (w == "LastQueryAttention") return ref::last_query_attention(probs, K.H);
  if (w == "KeyDiversity") return ref::key_diversity(K);
  return ref::position(K.H, K.n);
}

template <class Scorer>
void check_scorer(const char* name, const kvc::test::Tol& tol) {
  INFO("seed " << kvc::test::test_seed());
  INFO("scorer " << name);
  auto rng = kvc::test::make_rng(301);
  const long shapes[][5] = {{1, 1, 1, 1, 1}, {1, 2, 17, 7, 4}, {2, 2, 65, 16, 32}, {2, 4, 130, 33, 8}, {3, 1, 31, 64, 40}};
  for (const auto& sh : shapes) {
    Problem pr(rng, sh[0], sh[1], sh[2], sh[3], sh[4]);
    INFO("Hkv " << pr.Hkv << " G " << pr.G << " n " << pr.n << " d " << pr.d << " W " << pr.W);
    const Eigen::MatrixXd want = reference_scores(name, pr.K, pr.V, pr.Q);
    for (Layout layout : {Layout::head_major, Layout::token_major}) {
      INFO("layout " << kvc::test::to_string(layout));
      kvc::test::LayerBuffers<float> f(pr.K, pr.V, pr.Q, layout);
      const Eigen::MatrixXd got_f = library_scores<Scorer>(f.view());
      CHECK(kvc::test::elementwise_ratio(got_f, want, tol) <= 1.0);
      CHECK(kvc::test::normwise_error(got_f, want) <= tol.norm);
      kvc::test::LayerBuffers<double> dd(pr.K, pr.V, pr.Q, layout);
      const Eigen::MatrixXd got_d = library_scores<Scorer>(dd.view());
      CHECK(kvc::test::elementwise_ratio(got_d, want, tol) <= 1.0);
      CHECK(kvc::test::normwise_error(got_d, want) <= tol.norm);

      // Half storage: the library on rounded inputs vs the reference on the same rounded values.
      kvc::test::LayerBuffers<Eigen::half> h(pr.K, pr.V, pr.Q, layout);
      const Eigen::MatrixXd got_h = library_scores<Scorer>(h.view());
      const Eigen::MatrixXd want_h = reference_scores(name, h.keys.rounded(), h.values.rounded(), h.queries.rounded());
      CHECK(kvc::test::elementwise_ratio(got_h, want_h, tol) <= 1.0);
      CHECK(kvc::test::normwise_error(got_h, want_h) <= tol.norm);
    }
  }
}

}  // namespace

TEST_CASE("AttentionMass scores are the window mass", "[scorer]") {
  STATIC_REQUIRE(policy_traits<AttentionMass>::needs_mass);
  check_scorer<AttentionMass>("AttentionMass", kTol.float_vs_double.mass);
}

TEST_CASE("ValueWeighted scores are mass times value norm (SelKV Eq. 1)", "[scorer]") {
  STATIC_REQUIRE(policy_traits<ValueWeighted>::needs_mass);
  check_scorer<ValueWeighted>("ValueWeighted", kTol.float_vs_double.mass);
}

TEST_CASE("KeyNorm scores are minus the key norm", "[scorer]") {
  STATIC_REQUIRE_FALSE(policy_traits<KeyNorm>::needs_mass);
  check_scorer<KeyNorm>("KeyNorm", kTol.float_vs_double.values);
}

TEST_CASE("Position scores are the positions, exactly", "[scorer]") {
  STATIC_REQUIRE_FALSE(policy_traits<Position>::needs_mass);
  check_scorer<Position>("Position", kTol.float_vs_double.values);
  // Exact integers, whatever the mass says.
  auto rng = kvc::test::make_rng(302);
  Problem pr(rng, 2, 1, 40, 8, 4);
  kvc::test::LayerBuffers<float> b(pr.K, pr.V, pr.Q, Layout::head_major);
  Vector<float> garbage = Vector<float>::Constant(40, 123.f), s;
  const AttentionArguments attention;
  Position{}.score(ScoreContext<float>(b.view(), 1, attention, garbage), s);
  REQUIRE(s.size() == 40);
  for (Index j = 0; j < 40; ++j) CHECK(s[j] == float(j));
}

TEST_CASE("scorers without mass ignore it; scorers with mass use it", "[scorer]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(303);
  Problem pr(rng, 2, 2, 24, 8, 6);
  kvc::test::LayerBuffers<double> b(pr.K, pr.V, pr.Q, Layout::token_major);
  const auto layer = b.view();
  const Vector<double> zeros = Vector<double>::Zero(24), ones = Vector<double>::Ones(24);
  const AttentionArguments attention;
  const auto ctx = [&](Index g, const Vector<double>& mass) { return ScoreContext<double>(layer, g, attention, mass); };
  Vector<double> s0, s1;
  KeyNorm{}.score(ctx(1, zeros), s0);
  KeyNorm{}.score(ctx(1, ones), s1);
  CHECK((s0.array() == s1.array()).all());
  CHECK((s0.array() <= 0.0).all());
  // ValueWeighted with a = 1 is exactly the value norm.
  ValueWeighted{}.score(ctx(0, ones), s1);
  for (long j = 0; j < 24; ++j) CHECK(s1[j] == Approx(ref::norm2(pr.V.vec(0, j), 8)).epsilon(kTol.float_vs_double.values.rel));
  CHECK(s1[12] == 0.0);  // the zero value vector
  ValueWeighted{}.score(ctx(0, zeros), s0);
  CHECK(s0.isZero(0.0));
  AttentionMass{}.score(ctx(0, ones), s0);
  CHECK((s0.array() == ones.array()).all());
  for (auto* scorer_output : {&s0, &s1}) scorer_output->setConstant(5.0);
  LastQueryAttention{}.score(ctx(1, zeros), s0);
  LastQueryAttention{}.score(ctx(1, ones), s1);
  CHECK((s0.array() == s1.array()).all());
  KeyDiversity{}.score(ctx(1, zeros), s0);
  KeyDiversity{}.score(ctx(1, ones), s1);
  CHECK((s0.array() == s1.array()).all());
}

namespace {

template <class Scorer>
using ScoreOnly = Pipeline<Scorer, TopK<>, NoRoute, Drop, NoCompensation>;

template <class Scorer>
void check_pipeline_selection(const char* name) {
  INFO("seed " << kvc::test::test_seed());
  INFO("scorer " << name);
  auto rng = kvc::test::make_rng(304);
  Problem pr(rng, 2, 2, 90, 16, 12);
  const Eigen::MatrixXd scores = reference_scores(name, pr.K, pr.V, pr.Q);
  kvc::test::LayerBuffers<double> b(pr.K, pr.V, pr.Q, Layout::head_major);
  typename ScoreOnly<Scorer>::Arguments args;
  args.selector.sinks = 2;
  args.selector.recent = 5;
  args.selector.pool_kernel = 3;
  args.selector.pooling = Pooling::average;
  for (long m : {1L, 10L, 30L, 89L, 90L, 200L}) {
    INFO("budget " << m);
    const auto result = ScoreOnly<Scorer>(args).run(b.view(), Budget::tokens(m));
    const long mm = std::min<long>(m, pr.n);
    const auto want = ref::select(scores, {mm, mm}, 2, 5, 3, false, false);
    for (long g = 0; g < pr.Hkv; ++g) CHECK(kvc::test::to_long(result.heads[g].positions) == want[g]);
  }
}

}  // namespace

TEST_CASE("each scorer drives the pipeline's selection like the reference", "[scorer][pipeline]") {
  check_pipeline_selection<AttentionMass>("AttentionMass");
  check_pipeline_selection<ValueWeighted>("ValueWeighted");
  check_pipeline_selection<KeyNorm>("KeyNorm");
  check_pipeline_selection<Position>("Position");
  check_pipeline_selection<LastQueryAttention>("LastQueryAttention");
  check_pipeline_selection<KeyDiversity>("KeyDiversity");
}

TEST_CASE("LastQueryAttention (TOVA) scores are the group mean of the last window row's probabilities", "[scorer]") {
  STATIC_REQUIRE_FALSE(policy_traits<LastQueryAttention>::needs_mass);  // one row per query head, not the window
  check_scorer<LastQueryAttention>("LastQueryAttention", kTol.float_vs_double.mass);
}

TEST_CASE("KeyDiversity (KeyDiff) scores are minus the cosine to the mean unit key", "[scorer]") {
  STATIC_REQUIRE_FALSE(policy_traits<KeyDiversity>::needs_mass);
  STATIC_REQUIRE(policy_traits<KeyDiversity>::covers_keys);
  check_scorer<KeyDiversity>("KeyDiversity", kTol.float_vs_double.values);
}

TEST_CASE("KeyDiversity: scale invariance, finite scores for huge keys, NaN for a non-finite key", "[scorer]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(305);
  Problem pr(rng, 2, 1, 33, 8, 4);
  const Eigen::MatrixXd want = ref::key_diversity(pr.K);
  // Every key scaled by 1e30 (its squares overflow float): the cosines are unchanged.
  ref::Tensor3 big = pr.K;
  for (long g = 0; g < big.H; ++g)
    for (long j = 0; j < big.n; ++j)
      for (long k = 0; k < big.d; ++k) big.at(g, j, k) *= 1e30;
  kvc::test::LayerBuffers<float> b(big, pr.V, pr.Q, Layout::head_major);
  const Eigen::MatrixXd got = library_scores<KeyDiversity>(b.view());
  REQUIRE(got.allFinite());
  CHECK(kvc::test::normwise_error(got, want) <= kTol.float_vs_double.values.norm);
  // A NaN key: the pipeline reports it (the scorer covers the key scan) instead of selecting by NaN.
  kvc::test::LayerBuffers<float> bad(pr.K, pr.V, pr.Q, Layout::head_major);
  bad.keys.data[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(KeyDiff{}.run(bad.view(), Budget::tokens(8)), kvc::error);
}

TEST_CASE("ScoreContext: window rows, queries, arguments and positions", "[scorer]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(306);
  for (double softcap : {0.0, 3.0}) {
    INFO("softcap " << softcap);
    Problem pr(rng, 2, 3, 41, 9, 6);
    const double scale = 0.4;
    const auto probs = ref::window_probs(pr.Q, pr.K, scale, softcap);  // Hq matrices (W, n)
    AttentionArguments attention;
    attention.scale = scale;
    attention.softcap = softcap;
    RopeArguments rope;
    rope.theta = 500000.0;
    kvc::test::LayerBuffers<float> f(pr.K, pr.V, pr.Q, Layout::token_major);
    kvc::test::LayerBuffers<double> dd(pr.K, pr.V, pr.Q, Layout::head_major);
    const Vector<float> mf = Vector<float>::Zero(pr.n);
    const Vector<double> md = Vector<double>::Zero(pr.n);
    const LayerView<float> lf = f.view();  // the contexts hold references to the views
    const LayerView<double> ld = dd.view();
    for (Index g = 0; g < pr.Hkv; ++g) {
      const ScoreContext<float> cf(lf, g, attention, mf, &rope);
      const ScoreContext<double> cd(ld, g, attention, md);
      CHECK(cf.rope().theta == 500000.0);
      CHECK(cd.rope().theta == RopeArguments{}.theta);  // none given: the defaults
      CHECK(cf.position(17) == 17);
      for (Index h = 0; h < pr.G; ++h)
        for (Index i = 0; i < pr.W; ++i) {
          INFO("g " << g << " h " << h << " i " << i);
          CHECK(cf.query(h, i) == lf.queries.row(g * pr.G + h, i));
          Vector<float> pf;
          Vector<double> pd;
          cf.row_probabilities(h * pr.W + i, pf);
          cd.row_probabilities(h * pr.W + i, pd);
          const Eigen::MatrixXd want = probs[static_cast<std::size_t>(g * pr.G + h)].row(i);
          CHECK(kvc::test::elementwise_ratio(Eigen::MatrixXd(pf.cast<double>().transpose()), want,
                                             kTol.float_vs_double.mass) <= 1.0);
          CHECK(kvc::test::normwise_error(Eigen::MatrixXd(pd.transpose()), want) <= 1e-14);
          // Causal: exactly 0 beyond position n − W + i.
          CHECK(pf.tail(pr.W - 1 - i).isZero(0.0f));
        }
      // The full matrix on request, rows as in row_probabilities.
      Vector<double> row;
      cd.row_probabilities(pr.W + 2, row);
      CHECK((cd.probabilities().row(pr.W + 2).transpose() - row).cwiseAbs().maxCoeff() <= 1e-15);
    }
  }
  // A logit that overflows float is an error naming the head, not NaN scores.
  Problem pr(rng, 1, 2, 20, 4, 3);
  for (long k = 0; k < pr.d; ++k) pr.K.at(0, 7, k) = 1e30;
  for (long k = 0; k < pr.d; ++k) pr.Q.at(1, 2, k) = 1e30;
  kvc::test::LayerBuffers<float> f(pr.K, pr.V, pr.Q, Layout::head_major);
  CHECK_THROWS_WITH(TOVA{}.run(f.view(), Budget::tokens(5)), Catch::Contains("KV head 0") && Catch::Contains("overflows"));
}

TEST_CASE("TOVA and KeyDiff presets select like the reference", "[scorer][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(307);
  Problem pr(rng, 2, 2, 70, 8, 10);
  kvc::test::LayerBuffers<double> b(pr.K, pr.V, pr.Q, Layout::head_major);
  for (long m : {1L, 9L, 35L, 70L}) {
    INFO("budget " << m);
    const auto tova = TOVA{}.run(b.view(), Budget::tokens(m));
    const auto want_tova = ref::select(reference_scores("LastQueryAttention", pr.K, pr.V, pr.Q), {m, m}, 0, 1, 0, false, false);
    const auto keydiff = KeyDiff{}.run(b.view(), Budget::tokens(m));
    const auto want_keydiff = ref::select(reference_scores("KeyDiversity", pr.K, pr.V, pr.Q), {m, m}, 0, 0, 0, false, false);
    for (long g = 0; g < pr.Hkv; ++g) {
      CHECK(kvc::test::to_long(tova.heads[g].positions) == want_tova[g]);
      CHECK(tova.heads[g].positions.back() == pr.n - 1);  // the last token is always kept
      CHECK(kvc::test::to_long(keydiff.heads[g].positions) == want_keydiff[g]);
    }
  }
}
