// ExpectedAttention and ObservedAttention (H2O) against the reference scorers in every storage type
// and both layouts, GQA groups, the sizes around the sinks, the window and the block, their
// invariances, the errors, and the ExpectedAttentionEvict and H2O presets' selections.
#include <catch2/catch.hpp>

#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/scorer/expected_attention.hpp>
#include <kvcompress/scorer/observed_attention.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

/// Scores of every KV head from `scorer` (which reads no mass): (Hkv, n) in double.
template <class Scorer, class T>
Eigen::MatrixXd scores_of(const Scorer& scorer, const LayerView<T>& layer, const AttentionArguments& attention = {},
                          const RopeArguments& rope = {}) {
  using Real = compute_t<T>;
  Eigen::MatrixXd out(layer.kv_heads(), layer.tokens());
  const Vector<Real> mass = Vector<Real>::Zero(layer.tokens());
  for (Index g = 0; g < layer.kv_heads(); ++g) {
    Vector<Real> s;
    scorer.score(ScoreContext<T>(layer, g, attention, mass, &rope), s);
    REQUIRE(s.size() == layer.tokens());
    out.row(g) = s.template cast<double>().transpose();
  }
  return out;
}

/// The scorer in float, double, half and bfloat16 storage, both layouts, against `reference(K, V, Q)`
/// (called on the original inputs for float / double, on the rounded inputs for half / bfloat16).
template <class Scorer, class Reference>
void check_against_reference(const Scorer& scorer, const ref::Tensor3& K, const ref::Tensor3& V,
                             const ref::Tensor3& Q, const AttentionArguments& attention, const RopeArguments& rope,
                             Reference reference) {
  const kvc::test::Tol& tol = kTol.float_vs_double.mass;
  const Eigen::MatrixXd want = reference(K, V, Q);
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    INFO("layout " << kvc::test::to_string(layout));
    kvc::test::LayerBuffers<float> f(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, f.view(), attention, rope), want, tol) <= 1.0);
    kvc::test::LayerBuffers<double> dd(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, dd.view(), attention, rope), want, {1e-10, 1e-300, 1e-10}) <=
          1.0);
    kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, h.view(), attention, rope),
                                       reference(h.keys.rounded(), h.values.rounded(), h.queries.rounded()), tol) <= 1.0);
    kvc::test::LayerBuffers<Eigen::bfloat16> b(K, V, Q, layout);
    CHECK(kvc::test::elementwise_ratio(scores_of(scorer, b.view(), attention, rope),
                                       reference(b.keys.rounded(), b.values.rounded(), b.queries.rounded()), tol) <= 1.0);
  }
}

/// The reference Expected Attention with a scorer's arguments and the RoPE arguments.
Eigen::MatrixXd ref_expected(const ref::Tensor3& K, const ref::Tensor3& V, const ref::Tensor3& Q,
                             const ExpectedAttention::Arguments& a, const RopeArguments& rope, double scale,
                             const Eigen::MatrixXd* positions = nullptr) {
  return ref::expected_attention(Q, K, V, scale, a.sinks, a.future_positions, a.covariance, a.value_norm, a.epsilon,
                                 rope.layout == RopeLayout::interleaved, rope.theta, rope.rotary_dim, positions);
}

}  // namespace

TEST_CASE("ExpectedAttention scores are the expected future attention times the value norm", "[scorer][expected]") {
  STATIC_REQUIRE_FALSE(policy_traits<ExpectedAttention>::needs_mass);
  STATIC_REQUIRE(policy_traits<ExpectedAttention>::reads_rope);
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(411);
  // {Hkv, G, n, d, W}: n at and around the sinks (4), W > n, window rows inside the sinks, N > d (the
  // LDLᵀ factor), d around the vector width, GQA groups of 1–3.
  const long shapes[][5] = {{1, 1, 3, 4, 2},  {2, 2, 4, 2, 3},   {1, 3, 5, 8, 8},   {2, 1, 6, 6, 6},
                            {1, 2, 40, 8, 20}, {2, 3, 33, 16, 7}, {1, 1, 130, 18, 1}, {2, 2, 70, 32, 32}};
  RopeArguments half_split;
  half_split.layout = RopeLayout::half_split;
  half_split.theta = 500000.0;
  RopeArguments partial;
  partial.rotary_dim = 2;
  const std::vector<ExpectedAttention::Arguments> options = {
      ExpectedAttention::Arguments{}, ExpectedAttention::Arguments{1, 0, true, true, 0.0},
      ExpectedAttention::Arguments{7, 2, false, true, 0.0}, ExpectedAttention::Arguments{512, 4, true, false, 0.0},
      ExpectedAttention::Arguments{64, 1, true, true, 0.05}};
  for (const auto& sh : shapes) {
    const ref::Tensor3 K = kvc::test::random_tensor(rng, sh[0], sh[2], sh[3]);
    ref::Tensor3 V = kvc::test::random_tensor(rng, sh[0], sh[2], sh[3]);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, sh[0] * sh[1], sh[4], sh[3]);
    for (long c = 0; c < sh[3]; ++c) V.at(0, sh[2] - 1, c) = 0.0;  // a zero value
    for (std::size_t o = 0; o < options.size(); ++o)
      for (const RopeArguments& rope : {RopeArguments{}, half_split, partial}) {
        const ExpectedAttention::Arguments& a = options[o];
        INFO("Hkv " << sh[0] << " G " << sh[1] << " n " << sh[2] << " d " << sh[3] << " W " << sh[4] << " options " << o
                    << " rope " << to_string(rope.layout) << " theta " << rope.theta << " rotary " << rope.rotary_dim);
        AttentionArguments attention;
        attention.scale = o == 2 ? 0.3 : 0.0;
        const double scale = attention.resolved_scale(sh[3]);
        check_against_reference(ExpectedAttention{a}, K, V, Q, attention, rope,
                                [&](const ref::Tensor3& k, const ref::Tensor3& v, const ref::Tensor3& q) {
                                  return ref_expected(k, v, q, a, rope, scale);
                                });
      }
  }
}

TEST_CASE("ExpectedAttention: invariant to a common RoPE shift, scales with the values", "[scorer][expected]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(412);
  const long Hkv = 2, G = 2, n = 50, d = 16, W = 12, shift = 1000;
  const RopeArguments rope;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d);
  // Every key and query rotated on by `shift` positions, and the positions moved with them: the
  // pre-RoPE queries, hence the statistics, are unchanged, and <R̄'μ, R(δ)k> = <R̄μ, k>.
  ref::Tensor3 K2 = K, Q2 = Q;
  const Eigen::MatrixXd R = ref::rope_matrix(d, double(shift), true, rope.theta, 0);
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < n; ++j) Eigen::Map<Eigen::VectorXd>(K2.vec(g, j), d) = R * Eigen::Map<const Eigen::VectorXd>(K.vec(g, j), d);
  for (long h = 0; h < Hkv * G; ++h)
    for (long i = 0; i < W; ++i) Eigen::Map<Eigen::VectorXd>(Q2.vec(h, i), d) = R * Eigen::Map<const Eigen::VectorXd>(Q.vec(h, i), d);
  std::vector<Index> positions(static_cast<std::size_t>(Hkv * n));
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < n; ++j) positions[static_cast<std::size_t>(g * n + j)] = j + shift;
  kvc::test::LayerBuffers<double> a(K, V, Q, Layout::head_major), b(K2, V, Q2, Layout::token_major);
  LayerView<double> shifted = b.view();
  shifted.positions = PositionView{positions.data(), Hkv, n, n};
  const Eigen::MatrixXd base = scores_of(ExpectedAttention{}, a.view(), {}, rope);
  CHECK(kvc::test::elementwise_ratio(scores_of(ExpectedAttention{}, shifted, {}, rope), base, {1e-9, 1e-300, 1e-9}) <= 1.0);
  Eigen::MatrixXd pos(Hkv, n);
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < n; ++j) pos(g, j) = double(j + shift);
  CHECK(kvc::test::elementwise_ratio(base, ref_expected(K2, V, Q2, {}, rope, 1.0 / std::sqrt(double(d)), &pos),
                                     {1e-9, 1e-300, 1e-9}) <= 1.0);
  // Values scaled by 3: every score (value norm times attention, ε = 0) scales by 3.
  ref::Tensor3 V3 = V;
  for (double& x : V3.data) x *= 3.0;
  kvc::test::LayerBuffers<double> c(K, V3, Q, Layout::head_major);
  CHECK(kvc::test::elementwise_ratio(scores_of(ExpectedAttention{}, c.view(), {}, rope), 3.0 * base,
                                     {1e-12, 1e-300, 1e-12}) <= 1.0);
  // The sinks score the head's highest score; without the value norm the rest is a distribution.
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < 4; ++j) CHECK(base(g, j) == base.row(g).tail(n - 4).maxCoeff());
  const Eigen::MatrixXd p = scores_of(ExpectedAttention{{512, 4, true, false, 0.0}}, a.view(), {}, rope);
  CHECK((p.rightCols(n - 4).rowwise().sum().array() - 1.0).abs().maxCoeff() <= 1e-12);
}

TEST_CASE("ExpectedAttention: huge keys are an error, not NaN scores", "[scorer][expected]") {
  ref::Tensor3 K(1, 10, 4), V(1, 10, 4), Q(1, 3, 4);
  for (double& x : V.data) x = 1.0;
  for (long i = 0; i < 3; ++i)
    for (long c = 0; c < 4; ++c) Q.at(0, i, c) = double(i * 4 + c);
  for (long c = 0; c < 4; ++c) K.at(0, 7, c) = 3e38;
  kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
  CHECK_THROWS_WITH(scores_of(ExpectedAttention{}, b.view()), Catch::Contains("expected-attention logit of KV head 0"));
  CHECK_THROWS_AS(ExpectedAttentionEvict{}.run(b.view(), Budget::tokens(5)), kvc::error);
}

TEST_CASE("ExpectedAttention: options and the keys' RoPE arguments are validated", "[scorer][expected]") {
  CHECK(ExpectedAttention{}.validate().is_ok());
  CHECK_FALSE(ExpectedAttention{{0, 4, true, true, 0.0}}.validate().is_ok());
  CHECK_FALSE(ExpectedAttention{{512, -1, true, true, 0.0}}.validate().is_ok());
  CHECK_FALSE(ExpectedAttention{{512, 4, true, true, -1.0}}.validate().is_ok());
  CHECK_FALSE(ExpectedAttention{{512, 4, true, true, std::nan("")}}.validate().is_ok());
  auto rng = kvc::test::make_rng(413);
  const ref::Tensor3 K = kvc::test::random_tensor(rng, 1, 20, 5), V = K, Q = kvc::test::random_tensor(rng, 1, 4, 5);
  kvc::test::LayerBuffers<float> odd(K, V, Q, Layout::head_major);
  // d = 5 cannot be all rotary: the scorer reads the RoPE arguments even with repositioning off.
  CHECK_THAT(ExpectedAttentionEvict{}.validate(odd.view(), Budget::tokens(5)).message(), Catch::Contains("rotary_dim"));
  CHECK(SnapKV{}.validate(odd.view(), Budget::tokens(5)).is_ok());
  ExpectedAttentionEvict::Arguments args;
  args.reposition.rotary_dim = 4;
  CHECK(ExpectedAttentionEvict{args}.validate(odd.view(), Budget::tokens(5)).is_ok());
  args.reposition.theta = 0.0;
  CHECK_THAT(ExpectedAttentionEvict{args}.validate(odd.view(), Budget::tokens(5)).message(), Catch::Contains("theta"));
  args.reposition.theta = 10000.0;
  args.scorer.future_positions = 0;
  CHECK_THROWS_WITH(ExpectedAttentionEvict{args}.run(odd.view(), Budget::tokens(5)),
                    Catch::Contains("scorer.future_positions"));
}

TEST_CASE("ObservedAttention (H2O) scores are the causal attention received, per seeing query", "[scorer][observed]") {
  STATIC_REQUIRE_FALSE(policy_traits<ObservedAttention>::needs_mass);
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(421);
  // {Hkv, G, n, d, extra query rows}: n around the block, Wq > n (the last n rows are used).
  const long shapes[][5] = {{1, 1, 1, 1, 0}, {2, 2, 3, 5, 2}, {1, 3, 17, 8, 0}, {2, 1, 33, 16, 1}, {1, 2, 70, 7, 0}};
  for (const auto& sh : shapes)
    for (const Index block : {Index(1), Index(3), Index(32), Index(200)})
      for (const double softcap : {0.0, 2.0}) {
        INFO("Hkv " << sh[0] << " G " << sh[1] << " n " << sh[2] << " d " << sh[3] << " block " << block << " softcap "
                    << softcap);
        const ref::Tensor3 K = kvc::test::random_tensor(rng, sh[0], sh[2], sh[3], 1.5);
        const ref::Tensor3 V = kvc::test::random_tensor(rng, sh[0], sh[2], sh[3]);
        const ref::Tensor3 Q = kvc::test::random_tensor(rng, sh[0] * sh[1], sh[2] + sh[4], sh[3], 1.5);
        AttentionArguments attention;
        attention.softcap = softcap;
        check_against_reference(ObservedAttention{{block}}, K, V, Q, attention, {},
                                [&](const ref::Tensor3& k, const ref::Tensor3&, const ref::Tensor3& q) {
                                  return ref::observed_attention(q, k, attention.resolved_scale(sh[3]), softcap);
                                });
      }
}

TEST_CASE("ObservedAttention: a stored bias, the block size, and the first token's score", "[scorer][observed]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(422);
  const long Hkv = 2, G = 2, n = 45, d = 8, nb = 30;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, n, d);
  const Eigen::MatrixXd bias = kvc::test::random_matrix(rng, Hkv, nb);
  std::vector<double> stored(static_cast<std::size_t>(Hkv * nb));
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < nb; ++j) stored[static_cast<std::size_t>(g * nb + j)] = bias(g, j);
  kvc::test::LayerBuffers<double> b(K, V, Q, Layout::token_major);
  LayerView<double> biased = b.view();
  biased.bias = BiasView<double>{stored.data(), Hkv, nb, nb};
  const Eigen::MatrixXd want = ref::observed_attention(Q, K, 1.0 / std::sqrt(double(d)), 0.0, &bias);
  for (const Index block : {Index(1), Index(4), Index(29), Index(64)})
    CHECK(kvc::test::elementwise_ratio(scores_of(ObservedAttention{{block}}, biased), want, {1e-10, 1e-300, 1e-10}) <= 1.0);
  // Every query sees token 0 and gives it its share of a probability: c[0] is the mean over the
  // group of the mean attention to the first token, in (0, 1]; the last token's score is the
  // probability the last query gives itself.
  const Eigen::MatrixXd got = scores_of(ObservedAttention{}, b.view());
  CHECK(got.minCoeff() > 0.0);
  CHECK(got.col(0).maxCoeff() <= 1.0);
  const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0);
  for (long g = 0; g < Hkv; ++g)
    CHECK(got(g, n - 1) == Approx((probs[static_cast<std::size_t>(g * G)](n - 1, n - 1) +
                                   probs[static_cast<std::size_t>(g * G + 1)](n - 1, n - 1)) / 2.0)
                               .epsilon(1e-12));
}

TEST_CASE("ObservedAttention (H2O) needs every prefill query: a window is an error", "[scorer][observed]") {
  auto rng = kvc::test::make_rng(423);
  const ref::Tensor3 K = kvc::test::random_tensor(rng, 2, 20, 4), V = kvc::test::random_tensor(rng, 2, 20, 4);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, 4, 19, 4);
  kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
  const Status s = H2O{}.validate(b.view(), Budget::ratio(0.5));
  CHECK_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Contains("needs the queries of all n = 20") && Catch::Contains("got W = 19"));
  CHECK_THROWS_WITH(H2O{}.run(b.view(), Budget::ratio(0.5)), Catch::Contains("needs the queries of all n = 20"));
  CHECK_THROWS_AS(scores_of(ObservedAttention{}, b.view()), kvc::error);
  CHECK_FALSE(ObservedAttention{{0}}.validate().is_ok());
  H2O::Arguments args;
  args.scorer.block = -3;
  kvc::test::LayerBuffers<float> full(K, V, kvc::test::random_tensor(rng, 4, 20, 4), Layout::head_major);
  CHECK_THAT(H2O{args}.validate(full.view(), Budget::ratio(0.5)).message(), Catch::Contains("scorer.block"));
  CHECK(H2O{}.validate(full.view(), Budget::ratio(0.5)).is_ok());
}

TEST_CASE("ExpectedAttentionEvict and H2O presets select like the reference", "[scorer][pipeline][expected][observed]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(424);
  const long Hkv = 2, G = 2, n = 120, d = 8;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, n, d);
  kvc::test::LayerBuffers<double> b(K, V, Q, Layout::head_major);
  const double scale = 1.0 / std::sqrt(double(d));
  const Eigen::MatrixXd expected = ref_expected(K, V, Q, {}, {}, scale), observed = ref::observed_attention(Q, K, scale, 0.0);
  for (long m : {1L, 4L, 9L, 60L, 119L, 120L}) {
    INFO("budget " << m);
    const auto ea = ExpectedAttentionEvict{}.run(b.view(), Budget::tokens(m));
    const auto h2o = H2O{}.run(b.view(), Budget::tokens(m));
    const auto want_ea = ref::select(expected, {m, m}, 0, 0, 0, false, false);
    const auto want_h2o = ref::select(observed, {m, m}, 0, 0, 0, false, false);
    for (long g = 0; g < Hkv; ++g) {
      CHECK(kvc::test::to_long(ea.heads[g].positions) == want_ea[g]);
      CHECK(kvc::test::to_long(h2o.heads[g].positions) == want_h2o[g]);
    }
  }
}
