// Tests for the GRKV ridge merge (SPEC §9): building blocks against the independent oracle in
// tests/support/ridge_reference.hpp and central finite differences, then the RidgeMerge policy on
// random layers for every element type.
#include <catch2/catch.hpp>

#include "kvcompress/merger/ridge.hpp"
#include "support/random.hpp"
#include "support/ridge_reference.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <iostream>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using kvc::Index;
using kvc::RowMatrix;
using Mat = Eigen::MatrixXd;
namespace ref = kvc::ref::ridge;

// -------------------------------------------------------------------------------------------------
// Tolerances, one row per compute type. Relative Frobenius errors unless stated otherwise.
// -------------------------------------------------------------------------------------------------
template <class Real>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double probs = 1e-12;       // probabilities vs loops
  static constexpr double value_out = 1e-10;   // dual vs primal, on ‖V‖ (both solve in double)
  static constexpr double value_step = 1e-9;   // value update vs the oracle, on ‖ΔV‖
  static constexpr double derivative = 1e-10;  // JVP / VJP vs the explicit Jacobian
  static constexpr double adjoint = 1e-12;     // |<Jx,y> − <x,Jᵀy>| / (‖Jx‖‖y‖)
  static constexpr double key_step = 1e-7;     // key update vs the dense solve, on ‖ΔK‖ (CG tol 1e-12)
  static constexpr double window = 1e-10;      // window errors (absolute)
  static constexpr double cg_tolerance = 1e-12;
};
template <>
struct Tol<float> {
  static constexpr double probs = 1e-5;
  static constexpr double value_out = 1e-6;   // the shared double solve, rounded to float once
  static constexpr double value_step = 1e-4;  // float X and Y, amplified by cond(X_U X_Uᵀ + λI); seen ~1e-5
  static constexpr double derivative = 1e-4;
  static constexpr double adjoint = 1e-5;
  static constexpr double key_step = 1e-3;  // float linearisation + CG at the default 1e-6; seen ~1e-5
  static constexpr double window = 1e-4;
  static constexpr double cg_tolerance = 1e-6;  // the SPEC default
};

// Finite differences (double oracle): central step and agreement with the analytic derivative.
constexpr double kFdStep = 1e-6;
constexpr double kFdTolerance = 1e-6;

double rel(const Mat& a, const Mat& b) {
  const double nb = b.norm();
  return (a - b).norm() / (nb > 0 ? nb : 1.0);
}

template <class Real>
Mat round_to(const Mat& M) {
  return M.cast<Real>().template cast<double>();
}
template <class Real>
RowMatrix<Real> to_rm(const Mat& M) {
  return M.cast<Real>();
}
template <class Real>
Mat to_mat(const RowMatrix<Real>& M) {
  return M.template cast<double>();
}
std::vector<Index> to_index(const std::vector<long>& v) { return {v.begin(), v.end()}; }

/// The papers' setting (and this library's default before the holdout mode): fixed λ, no safeguard.
kvc::RidgeMerge::Arguments fixed_args() {
  kvc::RidgeMerge::Arguments args;
  args.lambda_mode = kvc::RidgeMerge::Arguments::LambdaMode::fixed;
  args.safeguard = false;
  return args;
}

Mat gather(const Mat& full, const std::vector<long>& rows) {
  Mat out(static_cast<Index>(rows.size()), full.cols());
  for (std::size_t k = 0; k < rows.size(); ++k) out.row(static_cast<Index>(k)) = full.row(rows[k]);
  return out;
}

/// A dense head: G·W window rows over n tokens, a kept set with every window position, a free set
/// from the oracle's fixed mask. All inputs are rounded through Real so the oracle sees exactly what
/// the library sees.
struct DenseCase {
  long n = 0, W = 0, G = 0, d = 0;
  double scale = 0, softcap = 0;
  std::vector<long> kept, visible, free;
  Mat Q, K0, V0, Y;  // (R,d) (m,d) (m,d) (R,d)

  kvc::ridge::Attention attention() const {
    return {to_index(visible), scale, softcap};
  }
};

template <class Real>
DenseCase make_case(std::mt19937_64& rng, long n, long W, long G, long d, long m, double softcap,
                    double key_sigma = 1.5) {
  DenseCase c;
  c.n = n;
  c.W = W;
  c.G = G;
  c.d = d;
  c.scale = 1.0 / std::sqrt(static_cast<double>(d));
  c.softcap = softcap;
  c.Q = round_to<Real>(kvc::test::random_matrix(rng, G * W, d, 1.5));
  const Mat Kfull = round_to<Real>(kvc::test::random_matrix(rng, n, d, key_sigma));
  const Mat Vfull = round_to<Real>(kvc::test::random_matrix(rng, n, d));
  std::vector<long> older(static_cast<std::size_t>(n - W));
  std::iota(older.begin(), older.end(), 0L);
  std::shuffle(older.begin(), older.end(), rng);
  c.kept.assign(older.begin(), older.begin() + (m - W));
  for (long p = n - W; p < n; ++p) c.kept.push_back(p);
  std::sort(c.kept.begin(), c.kept.end());
  c.visible = ref::visible_counts(c.kept, n, W, G);
  std::vector<long> visible_full;
  for (long h = 0; h < G; ++h)
    for (long i = 0; i < W; ++i) visible_full.push_back(n - W + i + 1);
  c.K0 = gather(Kfull, c.kept);
  c.V0 = gather(Vfull, c.kept);
  c.Y = round_to<Real>(ref::outputs(c.Q, Kfull, Vfull, visible_full, c.scale, softcap));
  std::vector<double> score(static_cast<std::size_t>(n));
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (double& s : score) s = u01(rng);
  c.free = ref::free_list(ref::fixed_mask(c.kept, n, W, /*sinks=*/2, /*beta=*/0.2, score));
  return c;
}

/// Keys after a previous step: the free rows moved a little, so g = K_U − K_U⁰ ≠ 0.
template <class Real>
Mat moved_keys(std::mt19937_64& rng, const DenseCase& c, double amount = 0.1) {
  Mat K = c.K0;
  const Mat noise = kvc::test::random_matrix(rng, K.rows(), K.cols(), amount);
  for (long j : c.free) K.row(j) += noise.row(j);
  return round_to<Real>(K);
}

}  // namespace

// =================================================================================================
// Building blocks
// =================================================================================================

TEMPLATE_TEST_CASE("the range and finite checks see every entry of a row-major matrix", "[ridge]", float, double) {
  using R = TestType;
  const R limit = R(8);
  for (const Index rows : {Index(1), Index(3), Index(5)}) {
    for (const Index cols : {Index(1), Index(7), Index(33)}) {
      INFO(rows << " x " << cols);
      RowMatrix<R> m = RowMatrix<R>::Constant(rows, cols, R(-7.5));
      CHECK(kvc::detail::row_finite(m.data(), m.size()));
      CHECK(kvc::ridge::detail::all_below(m, limit));
      for (Index i = 0; i < m.size(); ++i) {  // one bad coefficient at each place in turn
        for (const R bad : {std::numeric_limits<R>::quiet_NaN(), std::numeric_limits<R>::infinity(), R(-8)}) {
          m.data()[i] = bad;
          CHECK(kvc::detail::row_finite(m.data(), m.size()) == std::isfinite(bad));
          CHECK_FALSE(kvc::ridge::detail::all_below(m, limit));
          CHECK(kvc::detail::row_finite(m.data(), m.size()) == m.allFinite());  // Eigen's column-by-column walk
          CHECK(kvc::ridge::detail::all_below(m, limit) == (m.array().abs() < limit).all());
        }
        m.data()[i] = R(-7.5);
      }
    }
  }
  CHECK(kvc::ridge::detail::all_below(RowMatrix<R>(0, 4), limit));  // empty: nothing to reject
}

TEST_CASE("visible_counts and fixed_mask match the oracle", "[ridge]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(201);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (int trial = 0; trial < 40; ++trial) {
    const long n = 20 + trial, W = 1 + trial % 7, G = 1 + trial % 3;
    std::vector<long> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), 0L);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<long> kept(all.begin(), all.begin() + n / 2);
    std::sort(kept.begin(), kept.end());
    std::vector<double> score(static_cast<std::size_t>(n));
    for (double& s : score) s = std::floor(4.0 * u01(rng)) / 4.0;  // many ties
    kvc::Vector<float> score_f(n);
    for (long j = 0; j < n; ++j) score_f(j) = static_cast<float>(score[static_cast<std::size_t>(j)]);
    const long sinks = trial % 5;
    const double beta = (trial % 4) / 3.0;
    INFO("trial " << trial << " n " << n << " W " << W << " sinks " << sinks << " beta " << beta);

    CHECK(to_index(ref::visible_counts(kept, n, W, G)) == kvc::ridge::visible_counts(to_index(kept), n, W, G));
    CHECK(ref::fixed_mask(kept, n, W, sinks, beta, score) ==
          kvc::ridge::fixed_mask(to_index(kept), n, W, sinks, beta, score_f));
  }
}

TEST_CASE("fixed_mask: sinks, window, and ⌈β·c⌉ by score with ties to the lower position", "[ridge]") {
  // n = 40, W = 4, kept non-window = {0,1,2,...,29} (c = 30) plus the window 36..39.
  std::vector<Index> kept;
  for (Index p = 0; p < 30; ++p) kept.push_back(p);
  for (Index p = 36; p < 40; ++p) kept.push_back(p);
  kvc::Vector<double> score = kvc::Vector<double>::Zero(40);
  score(10) = 5.0;
  score(20) = 5.0;  // tie with 10: 10 wins
  score(25) = 4.0;
  score(5) = 4.0;  // tie with 25: 5 wins
  const auto fixed = kvc::ridge::fixed_mask(kept, 40, 4, /*sinks=*/2, /*beta=*/0.1, score);
  // ⌈0.1·30⌉ = 3 (not 4 from 3.0000000000000004): positions 10, 20, 5.
  std::vector<Index> fixed_positions;
  for (std::size_t k = 0; k < kept.size(); ++k)
    if (fixed[k]) fixed_positions.push_back(kept[k]);
  CHECK(fixed_positions == std::vector<Index>{0, 1, 5, 10, 20, 36, 37, 38, 39});

  const auto none = kvc::ridge::fixed_mask(kept, 40, 4, 0, 0.0, score);
  CHECK(std::count(none.begin(), none.end(), true) == 4);  // the window only
  const auto all = kvc::ridge::fixed_mask(kept, 40, 4, 0, 1.0, score);
  CHECK(std::count(all.begin(), all.end(), true) == static_cast<long>(kept.size()));
}

TEMPLATE_TEST_CASE("probabilities match the oracle, with soft-cap and empty rows", "[ridge]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(202);
  for (double softcap : {0.0, 2.0}) {
    INFO("softcap " << softcap);
    DenseCase c = make_case<Real>(rng, 40, 6, 2, 8, 18, softcap, 3.0);
    c.visible[0] = 0;  // a row that sees nothing
    c.visible[7] = 1;
    RowMatrix<Real> X, chain;
    kvc::ridge::probabilities(to_rm<Real>(c.Q), to_rm<Real>(c.K0), c.attention(), X, &chain);
    const Mat expected = ref::probabilities(c.Q, c.K0, c.visible, c.scale, c.softcap);
    CHECK(rel(to_mat(X), expected) <= Tol<Real>::probs);
    CHECK(X.row(0).isZero(0));
    CHECK(X(7, 0) == Real(1));
    CHECK(X.allFinite());
    // The chain factor 1 − tanh²(s·qk/c).
    for (Index r = 0; r < X.rows(); ++r)
      for (Index j = 0; j < X.cols(); ++j) {
        const double z = c.scale * c.Q.row(r).dot(c.K0.row(j));
        CHECK(chain(r, j) == Approx(ref::capped_slope(z, softcap)).epsilon(Tol<Real>::probs * 10).margin(1e-6));
      }
  }
}

TEMPLATE_TEST_CASE("value step: the dual equals the primal and the oracle", "[ridge]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(203);
  struct Shape { long n, W, G, d, m; };
  // u < R and u > R (R = G·W) both covered.
  for (const Shape s : {Shape{40, 4, 2, 8, 20}, Shape{80, 8, 4, 16, 40}, Shape{30, 3, 1, 5, 25}}) {
    for (double lambda : {1e-2, 1.0}) {
      INFO("n " << s.n << " W " << s.W << " G " << s.G << " m " << s.m << " lambda " << lambda);
      const DenseCase c = make_case<Real>(rng, s.n, s.W, s.G, s.d, s.m, 0.0);
      REQUIRE(!c.free.empty());
      RowMatrix<Real> X;
      kvc::ridge::probabilities(to_rm<Real>(c.Q), to_rm<Real>(c.K0), c.attention(), X);
      const RowMatrix<Real> V0 = to_rm<Real>(c.V0), Y = to_rm<Real>(c.Y);
      RowMatrix<Real> dual, primal;
      kvc::ridge::value_step_dual(X, V0, Y, to_index(c.free), lambda, dual);
      kvc::ridge::value_step_primal(X, V0, Y, to_index(c.free), lambda, primal);
      CHECK(rel(to_mat(dual), to_mat(primal)) <= Tol<Real>::value_out);

      // The oracle on the same X (loops + LDLT).
      const Mat oracle_same_x = ref::value_step_primal(to_mat(X), c.V0, c.Y, c.free, lambda);
      CHECK(rel(to_mat(dual), oracle_same_x) <= Tol<Real>::value_out);
      // The oracle from scratch in double: compare the updates V − V⁰.
      const Mat X_ref = ref::probabilities(c.Q, c.K0, c.visible, c.scale, c.softcap);
      const Mat oracle = ref::value_step_primal(X_ref, c.V0, c.Y, c.free, lambda);
      CHECK(rel(to_mat(dual) - c.V0, oracle - c.V0) <= Tol<Real>::value_step);

      // Fixed rows are bit-identical; the update is not trivial.
      std::vector<bool> is_free(c.kept.size(), false);
      for (long k : c.free) is_free[static_cast<std::size_t>(k)] = true;
      for (Index j = 0; j < V0.rows(); ++j)
        if (!is_free[static_cast<std::size_t>(j)]) CHECK((dual.row(j).array() == V0.row(j).array()).all());
      CHECK((oracle - c.V0).norm() > 1e-3 * c.V0.norm());

      // In place (V aliases V0) gives the same result.
      RowMatrix<Real> in_place = V0;
      kvc::ridge::value_step_dual(X, in_place, Y, to_index(c.free), lambda, in_place);
      CHECK(rel(to_mat(in_place), to_mat(dual)) <= Tol<Real>::value_out);

      // The window objective never increases: ‖Y − XV‖ <= ‖Y − XV⁰‖ (ridge optimality).
      const double before = (c.Y - X_ref * c.V0).norm(), after = (c.Y - X_ref * oracle).norm();
      CHECK(after <= before);
      const auto att = c.attention();
      CHECK(kvc::ridge::window_error(to_rm<Real>(c.Q), to_rm<Real>(c.K0), dual, att, Y) <=
            kvc::ridge::window_error(to_rm<Real>(c.Q), to_rm<Real>(c.K0), V0, att, Y) + Tol<Real>::window);
    }
  }
}

TEST_CASE("the oracle's explicit Jacobian matches central finite differences", "[ridge]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(204);
  for (double softcap : {0.0, 1.5}) {
    INFO("softcap " << softcap);
    const DenseCase c = make_case<double>(rng, 30, 4, 2, 6, 14, softcap, 3.0);
    const Mat J = ref::jacobian(c.Q, c.K0, c.V0, c.visible, c.scale, softcap, c.free);
    const long u = static_cast<long>(c.free.size()), d = c.d;
    for (long col = 0; col < u * d; ++col) {
      Mat Kp = c.K0, Km = c.K0;
      Kp(c.free[static_cast<std::size_t>(col / d)], col % d) += kFdStep;
      Km(c.free[static_cast<std::size_t>(col / d)], col % d) -= kFdStep;
      const Mat fd = (ref::outputs(c.Q, Kp, c.V0, c.visible, c.scale, softcap) -
                      ref::outputs(c.Q, Km, c.V0, c.visible, c.scale, softcap)) /
                     (2 * kFdStep);
      const Eigen::VectorXd column = J.col(col);
      CHECK((column - ref::vec(fd)).norm() <= kFdTolerance * std::max(1.0, fd.norm()));
    }
  }
}

TEMPLATE_TEST_CASE("JVP and VJP match finite differences and the explicit Jacobian", "[ridge]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(205);
  for (double softcap : {0.0, 1.5, 20.0}) {
    INFO("softcap " << softcap);
    const DenseCase c = make_case<Real>(rng, 36, 5, 3, 8, 17, softcap, 3.0);
    const long u = static_cast<long>(c.free.size()), R = c.G * c.W, d = c.d;
    REQUIRE(u > 0);
    const auto jac = kvc::ridge::key_jacobian(to_rm<Real>(c.Q), to_rm<Real>(c.K0), to_rm<Real>(c.V0),
                                              c.attention(), to_index(c.free));
    const Mat J = ref::jacobian(c.Q, c.K0, c.V0, c.visible, c.scale, softcap, c.free);

    // JVP against central differences of the oracle's forward pass, along a random direction.
    const Mat dK = round_to<Real>(kvc::test::random_matrix(rng, u, d));
    RowMatrix<Real> df;
    kvc::ridge::jvp(jac, to_rm<Real>(dK), df);
    Mat Kp = c.K0, Km = c.K0;
    for (long k = 0; k < u; ++k) {
      Kp.row(c.free[static_cast<std::size_t>(k)]) += kFdStep * dK.row(k);
      Km.row(c.free[static_cast<std::size_t>(k)]) -= kFdStep * dK.row(k);
    }
    const Mat fd = (ref::outputs(c.Q, Kp, c.V0, c.visible, c.scale, softcap) -
                    ref::outputs(c.Q, Km, c.V0, c.visible, c.scale, softcap)) /
                   (2 * kFdStep);
    CHECK(rel(to_mat(df), fd) <= std::max(Tol<Real>::derivative, kFdTolerance));
    CHECK(rel(to_mat(df), ref::unvec(J * ref::vec(dK), R, d)) <= Tol<Real>::derivative);
    CHECK(fd.norm() > 1e-3);  // the direction actually moves the outputs

    // VJP against Jᵀ of the explicit Jacobian.
    const Mat gamma = round_to<Real>(kvc::test::random_matrix(rng, R, d));
    RowMatrix<Real> dK_back;
    kvc::ridge::vjp(jac, to_rm<Real>(gamma), dK_back);
    REQUIRE(dK_back.rows() == u);
    CHECK(rel(to_mat(dK_back), ref::unvec(J.transpose() * ref::vec(gamma), u, d)) <= Tol<Real>::derivative);

    // Adjoint identity <J x, y> = <x, Jᵀ y> on the library's own products.
    const double lhs = (to_mat(df).array() * gamma.array()).sum();
    const double rhs = (dK.array() * to_mat(dK_back).array()).sum();
    CHECK(std::abs(lhs - rhs) <= Tol<Real>::adjoint * to_mat(df).norm() * gamma.norm());
  }
}

TEMPLATE_TEST_CASE("the fused normal operator equals J Jᵀ + λI and exposes Jᵀ", "[ridge]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(207);
  struct Shape { long n, W, G, d, m; double softcap; };
  // R <= 2d (Gram path Q Qᵀ) and R > 2d (two products through ΔK_U).
  for (const Shape s : {Shape{40, 4, 2, 8, 18, 0.0}, Shape{36, 5, 3, 6, 17, 2.0}, Shape{36, 5, 3, 4, 17, 0.0}}) {
    const long R = s.G * s.W;
    INFO("R " << R << " d " << s.d << " softcap " << s.softcap);
    const DenseCase c = make_case<Real>(rng, s.n, s.W, s.G, s.d, s.m, s.softcap, 3.0);
    const long u = static_cast<long>(c.free.size()), d = c.d;
    REQUIRE(u > 0);
    const auto jac = kvc::ridge::key_jacobian(to_rm<Real>(c.Q), to_rm<Real>(c.K0), to_rm<Real>(c.V0),
                                              c.attention(), to_index(c.free));
    const Mat J = ref::jacobian(c.Q, c.K0, c.V0, c.visible, c.scale, s.softcap, c.free);
    const double lambda = 0.05;
    kvc::ridge::detail::KeyNormalOperator<Real> op(jac, lambda);
    const Mat gamma = round_to<Real>(kvc::test::random_matrix(rng, R, d));
    const RowMatrix<Real> in = to_rm<Real>(gamma);
    RowMatrix<Real> out(R, d);
    op.apply(in.data(), out.data());
    const Mat expected = ref::unvec(J * (J.transpose() * ref::vec(gamma)) + lambda * ref::vec(gamma), R, d);
    CHECK(rel(to_mat(out), expected) <= Tol<Real>::derivative);
    // Jᵀγ = M'ᵀ Q from the same application.
    const RowMatrix<Real> dK = op.last_vjp().transpose() * jac.queries;
    CHECK(rel(to_mat(dK), ref::unvec(J.transpose() * ref::vec(gamma), u, d)) <= Tol<Real>::derivative);
  }
}

TEMPLATE_TEST_CASE("key step: CG solution matches the dense (J Jᵀ + λI) solve", "[ridge]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(206);
  struct Shape { long n, W, G, d, m; double softcap; };
  for (const Shape s : {Shape{30, 4, 2, 6, 14, 0.0}, Shape{48, 6, 2, 8, 20, 3.0}, Shape{25, 3, 1, 4, 10, 0.0}}) {
    for (double lambda : {1e-2, 1e-1}) {
      INFO("n " << s.n << " W " << s.W << " G " << s.G << " softcap " << s.softcap << " lambda " << lambda);
      const DenseCase c = make_case<Real>(rng, s.n, s.W, s.G, s.d, s.m, s.softcap);
      const Mat K = moved_keys<Real>(rng, c);                       // current keys, K_U ≠ K_U⁰
      const Mat V = round_to<Real>(c.V0 + 0.1 * kvc::test::random_matrix(rng, c.V0.rows(), c.d));
      RowMatrix<Real> K_lib = to_rm<Real>(K);
      const auto report = kvc::ridge::key_step(to_rm<Real>(c.Q), to_rm<Real>(c.K0), to_rm<Real>(V),
                                               to_rm<Real>(c.Y), c.attention(), to_index(c.free), lambda,
                                               {Tol<Real>::cg_tolerance, 2000}, K_lib);
      CHECK(report.status == kvc::SolverStatus::converged);
      CHECK(report.iterations > 0);
      CHECK(report.residual <= Tol<Real>::cg_tolerance);

      const Mat K_ref = ref::key_step(c.Q, K, c.K0, V, c.Y, c.visible, c.scale, c.softcap, c.free, lambda);
      CHECK(rel(to_mat(K_lib) - c.K0, K_ref - c.K0) <= Tol<Real>::key_step);
      CHECK((K_ref - K).norm() > 1e-4 * K.norm());  // the step is not trivial
      std::vector<bool> is_free(c.kept.size(), false);
      for (long k : c.free) is_free[static_cast<std::size_t>(k)] = true;
      for (Index j = 0; j < K_lib.rows(); ++j)
        if (!is_free[static_cast<std::size_t>(j)]) CHECK((to_mat(K_lib).row(j).array() == K.row(j).array()).all());
    }
  }
}

TEST_CASE("regress: no free entries, zero steps or both steps off is the identity", "[ridge]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(207);
  const DenseCase c = make_case<double>(rng, 30, 4, 2, 6, 14, 0.0);
  const RowMatrix<double> Q = to_rm<double>(c.Q), Y = to_rm<double>(c.Y);
  const double error = ref::window_error(c.Q, c.K0, c.V0, c.visible, c.scale, c.softcap, c.Y);
  const auto check_identity = [&](const std::vector<long>& free, const kvc::RidgeMerge::Arguments& args) {
    RowMatrix<double> K = to_rm<double>(c.K0), V = to_rm<double>(c.V0);
    kvc::HeadDiagnostics diag;
    kvc::ridge::regress(Q, Y, c.attention(), to_index(free), args, K, V, diag);
    CHECK((to_mat(K).array() == c.K0.array()).all());
    CHECK((to_mat(V).array() == c.V0.array()).all());
    CHECK(diag.window_error_before == Approx(error).epsilon(1e-10));
    CHECK(diag.window_error_after == diag.window_error_before);
    CHECK(diag.cg_status == kvc::SolverStatus::not_run);
  };
  kvc::RidgeMerge::Arguments args;
  check_identity({}, args);
  args.steps = 0;
  check_identity(c.free, args);
  args.steps = 2;
  args.value_step = false;
  args.key_step = false;
  check_identity(c.free, args);
}

// =================================================================================================
// The RidgeMerge policy on random layers
// =================================================================================================

namespace {

/// A random layer [Hkv][n][d] / [Hq][W][d] in element type T, plus the same numbers in double.
template <class T>
struct Layer {
  long Hkv, G, n, W, d;
  std::vector<T> k, v, q;
  kvc::LayerView<T> view;
  std::vector<Mat> K, V;  // per KV head (n,d), exactly the stored values
  std::vector<Mat> Q;     // per KV head (G·W, d) stacked group queries

  Layer(std::mt19937_64& rng, long Hkv_, long G_, long n_, long W_, long d_, double key_sigma)
      : Hkv(Hkv_), G(G_), n(n_), W(W_), d(d_) {
    const auto fill = [&](std::vector<T>& buf, long heads, long tokens, double sigma) {
      std::normal_distribution<double> dist(0.0, sigma);
      buf.resize(static_cast<std::size_t>(heads * tokens * d));
      for (T& x : buf) x = kvc::from_real<T>(static_cast<float>(dist(rng)));
    };
    fill(k, Hkv, n, key_sigma);
    fill(v, Hkv, n, 1.0);
    fill(q, Hkv * G, W, 1.5);
    view.keys = kvc::make_head_major<const T>(k.data(), Hkv, n, d);
    view.values = kvc::make_head_major<const T>(v.data(), Hkv, n, d);
    view.queries = kvc::make_head_major<const T>(q.data(), Hkv * G, W, d);
    const auto at = [&](const std::vector<T>& buf, long tokens, long h, long j, long e) {
      return kvc::to_real<double>(buf[static_cast<std::size_t>((h * tokens + j) * d + e)]);
    };
    for (long g = 0; g < Hkv; ++g) {
      Mat Kg(n, d), Vg(n, d), Qg(G * W, d);
      for (long j = 0; j < n; ++j)
        for (long e = 0; e < d; ++e) {
          Kg(j, e) = at(k, n, g, j, e);
          Vg(j, e) = at(v, n, g, j, e);
        }
      for (long hl = 0; hl < G; ++hl)
        for (long i = 0; i < W; ++i)
          for (long e = 0; e < d; ++e) Qg(hl * W + i, e) = at(q, W, g * G + hl, i, e);
      K.push_back(Kg);
      V.push_back(Vg);
      Q.push_back(Qg);
    }
  }
};

/// Result of one policy call plus everything the checks need.
template <class Real>
struct PolicyRun {
  std::vector<long> kept, free;
  Mat K0, V0;  // (m,d) originals
  kvc::MergeOutput<Real> out;
};

/// Scores by window mass (library window attention), keeps 4 sinks + the window + the top by mass,
/// builds the HeadContext and calls RidgeMerge::merge for head g.
template <class T>
PolicyRun<kvc::compute_t<T>> run_policy(const Layer<T>& layer, long g, long m,
                                        const kvc::AttentionArguments& attention,
                                        const kvc::RidgeMerge::Arguments& args) {
  using Real = kvc::compute_t<T>;
  const long n = layer.n, W = layer.W;
  RowMatrix<Real> probs;
  kvc::window_probabilities<Real>(layer.view, g, attention, probs);
  kvc::Vector<Real> mass;
  kvc::mass_from_probabilities(probs, layer.G, mass);
  const kvc::Vector<Real> score = mass;

  std::vector<long> kept;
  for (long p = 0; p < std::min(4L, n - W); ++p) kept.push_back(p);
  std::vector<long> candidates;
  for (long p = static_cast<long>(kept.size()); p < n - W; ++p) candidates.push_back(p);
  std::stable_sort(candidates.begin(), candidates.end(), [&](long a, long b) { return score(a) > score(b); });
  const long extra = std::max(0L, m - W - static_cast<long>(kept.size()));
  for (long t = 0; t < extra && t < static_cast<long>(candidates.size()); ++t)
    kept.push_back(candidates[static_cast<std::size_t>(t)]);
  for (long p = n - W; p < n; ++p) kept.push_back(p);
  std::sort(kept.begin(), kept.end());
  std::vector<long> evicted;
  for (long p = 0, k = 0; p < n; ++p) {
    if (k < static_cast<long>(kept.size()) && kept[static_cast<std::size_t>(k)] == p)
      ++k;
    else
      evicted.push_back(p);
  }
  const std::vector<Index> kept_i = to_index(kept), evicted_i = to_index(evicted);
  const kvc::HeadContext<T> ctx(layer.view, g, attention, mass, score, kept_i, evicted_i);

  PolicyRun<Real> run;
  run.kept = kept;
  run.K0 = gather(layer.K[static_cast<std::size_t>(g)], kept);
  run.V0 = gather(layer.V[static_cast<std::size_t>(g)], kept);
  run.out.keys = to_rm<Real>(run.K0);
  run.out.values = to_rm<Real>(run.V0);
  run.out.gate = kvc::Vector<Real>::Constant(n - static_cast<long>(kept.size()), Real(0.5));
  std::vector<double> score_d(static_cast<std::size_t>(n));
  for (long j = 0; j < n; ++j) score_d[static_cast<std::size_t>(j)] = static_cast<double>(score(j));
  run.free = ref::free_list(ref::fixed_mask(kept, n, W, args.sinks, args.beta, score_d));

  const kvc::RidgeMerge merger{args};
  REQUIRE(merger.validate(n, static_cast<Index>(kept.size())).is_ok());
  merger.merge(ctx, kvc::Routing{}, run.out);
  return run;
}

/// Y (G·W, d): the window outputs of head g over the full cache, in double.
template <class T>
Mat full_outputs(const Layer<T>& layer, long g, const kvc::AttentionArguments& attention) {
  const long n = layer.n, W = layer.W, G = layer.G;
  std::vector<long> visible_full;
  for (long h = 0; h < G; ++h)
    for (long i = 0; i < W; ++i) visible_full.push_back(n - W + i + 1);
  return ref::outputs(layer.Q[static_cast<std::size_t>(g)], layer.K[static_cast<std::size_t>(g)],
                      layer.V[static_cast<std::size_t>(g)], visible_full, attention.resolved_scale(layer.d),
                      attention.softcap);
}

/// Oracle for one head: Y from the full cache, then value/key steps with the dense solves.
template <class T>
void oracle(const Layer<T>& layer, long g, const std::vector<long>& kept, const std::vector<long>& free,
            const kvc::AttentionArguments& attention, const kvc::RidgeMerge::Arguments& args, Mat& K, Mat& V,
            double& error_before, double& error_after, ref::HoldoutDecisions* decisions = nullptr) {
  const long n = layer.n, W = layer.W, G = layer.G;
  const double scale = attention.resolved_scale(layer.d);
  const Mat& Qg = layer.Q[static_cast<std::size_t>(g)];
  const Mat Y = full_outputs(layer, g, attention);
  const std::vector<long> visible = ref::visible_counts(kept, n, W, G);
  K = gather(layer.K[static_cast<std::size_t>(g)], kept);
  V = gather(layer.V[static_cast<std::size_t>(g)], kept);
  error_before = ref::window_error(Qg, K, V, visible, scale, attention.softcap, Y);
  const bool value_first = args.order == kvc::RidgeMerge::Arguments::Order::value_then_key;
  if (args.lambda_mode == kvc::RidgeMerge::Arguments::LambdaMode::holdout && W >= 2) {
    const ref::HoldoutDecisions dec = ref::regress_holdout(
        Qg, Y, visible, scale, attention.softcap, free, {args.lambda_grid.begin(), args.lambda_grid.end()},
        args.lambda_k, args.steps, value_first, args.value_step, args.key_step, W, G, args.holdout_every,
        args.safeguard, K, V);
    if (decisions) *decisions = dec;
  } else {
    ref::regress(Qg, Y, visible, scale, attention.softcap, free, args.lambda_v, args.lambda_k, args.steps,
                 value_first, args.value_step, args.key_step, K, V);
  }
  error_after = ref::window_error(Qg, K, V, visible, scale, attention.softcap, Y);
}

}  // namespace

TEMPLATE_TEST_CASE("window outputs Y = A·V: fused and through the head context",
                   "[ridge][policy]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Real = kvc::compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(304);
  const Layer<T> layer(rng, 2, 2, 600, 8, 8, 3.0);  // several key tiles; maxima move between tiles
  for (const double softcap : {0.0, 5.0}) {
    kvc::AttentionArguments attention;
    attention.softcap = softcap;
    for (long g = 0; g < layer.Hkv; ++g) {
      INFO("head " << g << " softcap " << softcap);
      RowMatrix<Real> A;
      kvc::window_probabilities<Real>(layer.view, g, attention, A);
      const Mat expected = to_mat(A) * layer.V[static_cast<std::size_t>(g)];
      RowMatrix<Real> fused;
      kvc::window_outputs<Real>(layer.view, g, attention, fused);
      CHECK(rel(to_mat(fused), expected) <= Tol<Real>::probs);
      // The context: computed on first use (fused, or from cached probabilities), or handed to it.
      const kvc::Vector<Real> mass = kvc::Vector<Real>::Zero(layer.n);
      const std::vector<Index> kept{0, 1}, evicted;
      const kvc::HeadContext<T> ctx(layer.view, g, attention, mass, mass, kept, evicted);
      CHECK(rel(to_mat(ctx.window_outputs()), expected) <= Tol<Real>::probs);
      const kvc::HeadContext<T> cached(layer.view, g, attention, mass, mass, kept, evicted);
      CHECK(to_mat(cached.probabilities()) == to_mat(A));
      CHECK(rel(to_mat(cached.window_outputs()), expected) <= Tol<Real>::probs);
      const kvc::HeadContext<T> given(layer.view, g, attention, mass, mass, kept, evicted, &fused);
      CHECK(&given.window_outputs() == &fused);
    }
  }
}

TEMPLATE_TEST_CASE("RidgeMerge matches the oracle on random layers", "[ridge][policy]", float, double, Eigen::half,
                   Eigen::bfloat16) {
  using T = TestType;
  using Real = kvc::compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(301);
  const Layer<T> layer(rng, /*Hkv=*/2, /*G=*/2, /*n=*/64, /*W=*/8, /*d=*/16, /*key_sigma=*/2.0);

  using Order = kvc::RidgeMerge::Arguments::Order;
  struct Config { const char* name; double softcap; Index steps; Order order; double lambda; };
  for (const Config cfg : {Config{"default value->key", 0.0, 1, Order::value_then_key, 1e-2},
                           Config{"lambda 0.1, soft-cap 4", 4.0, 1, Order::value_then_key, 1e-1},
                           Config{"key->value, 2 steps", 0.0, 2, Order::key_then_value, 1e-1}}) {
    kvc::AttentionArguments attention;
    attention.softcap = cfg.softcap;
    kvc::RidgeMerge::Arguments args = fixed_args();
    args.lambda_v = args.lambda_k = cfg.lambda;
    args.steps = cfg.steps;
    args.order = cfg.order;
    args.cg_tolerance = Tol<Real>::cg_tolerance;
    args.cg_max_iterations = 5000;
    for (long g = 0; g < layer.Hkv; ++g) {
      INFO(cfg.name << ", head " << g);
      const long m = 24;
      const auto run = run_policy(layer, g, m, attention, args);
      const auto& out = run.out;
      REQUIRE(static_cast<long>(run.kept.size()) == m);
      REQUIRE(run.free.size() > 0);

      Mat K_ref, V_ref;
      double before_ref = 0, after_ref = 0;
      oracle(layer, g, run.kept, run.free, attention, args, K_ref, V_ref, before_ref, after_ref);
      CHECK(rel(to_mat(out.values) - run.V0, V_ref - run.V0) <= std::max(Tol<Real>::value_step, Tol<Real>::key_step));
      CHECK(rel(to_mat(out.keys) - run.K0, K_ref - run.K0) <= Tol<Real>::key_step);
      CHECK((V_ref - run.V0).norm() > 1e-3 * run.V0.norm());
      CHECK((K_ref - run.K0).norm() > 1e-4 * run.K0.norm());

      // Fixed entries are bit-identical to the originals.
      std::vector<bool> is_free(run.kept.size(), false);
      for (long k : run.free) is_free[static_cast<std::size_t>(k)] = true;
      for (Index j = 0; j < m; ++j) {
        if (is_free[static_cast<std::size_t>(j)]) continue;
        INFO("fixed row " << j << " (position " << run.kept[static_cast<std::size_t>(j)] << ")");
        CHECK((to_mat(out.keys).row(j).array() == run.K0.row(j).array()).all());
        CHECK((to_mat(out.values).row(j).array() == run.V0.row(j).array()).all());
      }

      // Gate and diagnostics.
      CHECK(out.gate.size() == layer.n - m);
      CHECK(out.gate.isZero(0));
      CHECK(out.diagnostics.kept == m);
      CHECK(out.diagnostics.evicted == layer.n - m);
      CHECK(out.diagnostics.merged == 0);
      CHECK(out.diagnostics.dropped == layer.n - m);
      CHECK(out.diagnostics.window_error_before == Approx(before_ref).epsilon(10 * Tol<Real>::window));
      CHECK(out.diagnostics.window_error_after == Approx(after_ref).epsilon(Tol<Real>::key_step));
      // No "after < before" here: at λ = 1e-2 the linearised key step can overshoot (SPEC §9); the
      // monotone cases are tested below (value step alone, safeguard).
      CHECK(out.diagnostics.cg_status == kvc::SolverStatus::converged);
      CHECK(out.diagnostics.cg_iterations > 0);
      CHECK(out.diagnostics.cg_residual <= Tol<Real>::cg_tolerance);
      CHECK_FALSE(out.diagnostics.key_step_rejected);
    }
  }
}

TEMPLATE_TEST_CASE("RidgeMerge: identity cases and the window objective", "[ridge][policy]", float, double,
                   Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Real = kvc::compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(302);
  const Layer<T> layer(rng, 2, 2, 48, 8, 8, 2.0);
  const kvc::AttentionArguments attention;
  const auto unchanged = [](const PolicyRun<Real>& run) {
    CHECK((to_mat(run.out.keys).array() == run.K0.array()).all());
    CHECK((to_mat(run.out.values).array() == run.V0.array()).all());
  };

  SECTION("nothing evicted (m = n) changes nothing") {
    const auto run = run_policy(layer, 1, layer.n, attention, {});
    unchanged(run);
    CHECK(run.out.gate.size() == 0);
    CHECK(run.out.diagnostics.evicted == 0);
    CHECK(run.out.diagnostics.window_error_before <= 10 * Tol<Real>::window);
    CHECK(run.out.diagnostics.window_error_after == run.out.diagnostics.window_error_before);
  }
  SECTION("S = 0 is the identity") {
    kvc::RidgeMerge::Arguments args;
    args.steps = 0;
    const auto run = run_policy(layer, 0, 20, attention, args);
    unchanged(run);
    CHECK(run.out.gate.isZero(0));
    CHECK(run.out.diagnostics.window_error_before > 0);
    CHECK(run.out.diagnostics.window_error_after == run.out.diagnostics.window_error_before);
    CHECK(run.out.diagnostics.cg_status == kvc::SolverStatus::not_run);
  }
  SECTION("the value step alone never increases the window error") {
    kvc::RidgeMerge::Arguments args = fixed_args();
    args.key_step = false;
    for (long g = 0; g < layer.Hkv; ++g)
      for (long m : {12L, 20L, 30L}) {
        INFO("head " << g << " m " << m);
        const auto run = run_policy(layer, g, m, attention, args);
        CHECK(run.out.diagnostics.window_error_after <= run.out.diagnostics.window_error_before);
        if (run.free.empty())  // m = 12: 4 sinks + 8 window positions, all fixed
          CHECK(run.out.diagnostics.window_error_after == run.out.diagnostics.window_error_before);
        else
          CHECK(run.out.diagnostics.window_error_after < 0.999 * run.out.diagnostics.window_error_before);
        CHECK((to_mat(run.out.keys).array() == run.K0.array()).all());  // keys untouched
        CHECK(run.out.diagnostics.cg_status == kvc::SolverStatus::not_run);
      }
  }
  SECTION("with the safeguard the key step never increases the window error") {
    kvc::RidgeMerge::Arguments args = fixed_args();
    args.safeguard = true;
    args.lambda_k = 1e-4;  // small λ: the linearised step may overshoot
    // S = 1: the value step cannot increase the error and the safeguarded key step only lowers it.
    for (long g = 0; g < layer.Hkv; ++g)
      for (long m : {12L, 20L, 30L}) {
        INFO("head " << g << " m " << m);
        const auto run = run_policy(layer, g, m, attention, args);
        CHECK(run.out.diagnostics.window_error_after <= run.out.diagnostics.window_error_before);
        // The oracle's value step alone bounds the result from above.
        kvc::RidgeMerge::Arguments value_only = args;
        value_only.key_step = false;
        Mat K_ref, V_ref;
        double before_ref = 0, after_ref = 0;
        oracle(layer, g, run.kept, run.free, attention, value_only, K_ref, V_ref, before_ref, after_ref);
        CHECK(run.out.diagnostics.window_error_after <= after_ref * (1 + Tol<Real>::key_step));
      }
  }
}

TEST_CASE("RidgeMerge::validate rejects bad arguments without throwing", "[ridge]") {
  const auto status = [](auto mutate) {
    kvc::RidgeMerge merger;
    mutate(merger.args);
    return merger.validate(100, 10);
  };
  using A = kvc::RidgeMerge::Arguments;
  CHECK(status([](A&) {}).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_v = 0; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_k = -1; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_v = std::numeric_limits<double>::infinity(); }).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_k = std::numeric_limits<double>::quiet_NaN(); }).is_ok());
  CHECK_FALSE(status([](A& a) { a.beta = 1.5; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.beta = -0.1; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.steps = -1; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.sinks = -1; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.cg_tolerance = -1e-6; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.cg_max_iterations = -1; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_mode = static_cast<A::LambdaMode>(7); }).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_grid[2] = 0.0; }).is_ok());
  CHECK_FALSE(status([](A& a) { a.lambda_grid[0] = std::numeric_limits<double>::infinity(); }).is_ok());
  CHECK_FALSE(status([](A& a) { a.holdout_every = 1; }).is_ok());
  CHECK(status([](A& a) { a.lambda_grid[3] = -1.0; }).message().find("lambda_grid[3]") != std::string::npos);
  CHECK(status([](A& a) { a.holdout_every = 0; }).message().find("holdout_every") != std::string::npos);
  CHECK(status([](A& a) { a.lambda_mode = A::LambdaMode::fixed; }).is_ok());
  const auto message = status([](A& a) { a.lambda_v = -2; }).message();
  CHECK(message.find("lambda_v") != std::string::npos);
  kvc::RidgeMerge merger;
  CHECK_FALSE(merger.validate(0, 10).is_ok());
  CHECK_FALSE(merger.validate(10, 0).is_ok());
  // Defaults are the SPEC's, but for the λ rule (issue 28: holdout with the safeguard).
  CHECK(merger.args.lambda_v == 1e-2);
  CHECK(merger.args.lambda_k == 1e-2);
  CHECK(merger.args.beta == 0.1);
  CHECK(merger.args.sinks == 4);
  CHECK(merger.args.steps == 1);
  CHECK(merger.args.order == A::Order::value_then_key);
  CHECK(merger.args.cg_tolerance == 1e-6);
  CHECK(merger.args.cg_max_iterations == 100);
  CHECK(merger.args.lambda_mode == A::LambdaMode::holdout);
  CHECK(merger.args.lambda_grid == std::array<double, 4>{1e-3, 1e-2, 1e-1, 1.0});
  CHECK(merger.args.holdout_every == 4);
  CHECK(merger.args.safeguard);
}

// =================================================================================================
// λ chosen on held-out window rows, and the safeguard (lambda_mode = holdout, the default)
// =================================================================================================

namespace {

/// ‖Y_C − f_C(K, V)‖ on the check rows of head g, in double from the stored numbers.
template <class T>
double check_error(const Layer<T>& layer, long g, const std::vector<long>& kept,
                   const kvc::AttentionArguments& attention, Index every, const Mat& K, const Mat& V) {
  const long n = layer.n, W = layer.W, G = layer.G;
  const double scale = attention.resolved_scale(layer.d);
  const Mat& Qg = layer.Q[static_cast<std::size_t>(g)];
  const Mat Y = full_outputs(layer, g, attention);
  std::vector<long> fit, chk;
  ref::holdout_rows(W, G, every, fit, chk);
  const std::vector<long> visible = ref::visible_counts(kept, n, W, G);
  return (ref::rows_of(Y, chk) - ref::outputs(ref::rows_of(Qg, chk), K, V, ref::rows_of(visible, chk), scale,
                                              attention.softcap))
      .norm();
}

}  // namespace

TEST_CASE("holdout_rows matches the oracle", "[ridge]") {
  for (long W : {1L, 2L, 3L, 4L, 5L, 8L, 32L})
    for (long G : {1L, 2L, 4L})
      for (long every : {2L, 3L, 4L, 40L}) {
        INFO("W " << W << " G " << G << " every " << every);
        std::vector<long> fit, chk;
        ref::holdout_rows(W, G, every, fit, chk);
        std::vector<Index> lib_fit, lib_chk;
        kvc::ridge::holdout_rows(W, G, every, lib_fit, lib_chk);
        CHECK(lib_fit == to_index(fit));
        CHECK(lib_chk == to_index(chk));
        CHECK(chk.empty() == (W < 2));
        CHECK(static_cast<long>(fit.size() + chk.size()) == (W < 2 ? 0 : G * W));
        if (W >= 2) {
          CHECK(std::find(chk.begin(), chk.end(), W - 1) != chk.end());  // the last position is checked
          CHECK_FALSE(fit.empty());
        }
      }
}

TEMPLATE_TEST_CASE("RidgeMerge holdout: the chosen λ, the decisions and the result match the oracle",
                   "[ridge][policy]", float, double) {
  using T = TestType;
  using Real = kvc::compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(303);
  const Layer<T> layer(rng, /*Hkv=*/3, /*G=*/2, /*n=*/64, /*W=*/8, /*d=*/16, /*key_sigma=*/2.0);
  struct Config { const char* name; double softcap; bool safeguard; double lambda_k; Index every; double grid_scale; };
  std::array<int, 4> lambda_seen{};  // how often each grid index was chosen
  int value_kept = 0, key_kept = 0, value_undone = 0, key_undone = 0;
  for (const Config cfg : {Config{"default", 0.0, true, 1e-2, 4, 1.0}, Config{"no safeguard", 0.0, false, 1e-2, 4, 1.0},
                           Config{"soft-cap 4, every 2", 4.0, true, 1e-1, 2, 1.0},
                           Config{"tiny lambdas", 0.0, true, 1e-5, 3, 1e-6}}) {
    kvc::AttentionArguments attention;
    attention.softcap = cfg.softcap;
    kvc::RidgeMerge::Arguments args;
    args.safeguard = cfg.safeguard;
    args.lambda_k = cfg.lambda_k;
    args.holdout_every = cfg.every;
    for (double& lambda : args.lambda_grid) lambda *= cfg.grid_scale;
    args.cg_tolerance = Tol<Real>::cg_tolerance;
    args.cg_max_iterations = 5000;
    for (long g = 0; g < layer.Hkv; ++g)
      for (long m : {20L, 32L}) {
        INFO(cfg.name << ", head " << g << ", m " << m);
        const auto run = run_policy(layer, g, m, attention, args);
        REQUIRE(run.free.size() > 0);
        Mat K_ref, V_ref;
        double before_ref = 0, after_ref = 0;
        ref::HoldoutDecisions dec;
        oracle(layer, g, run.kept, run.free, attention, args, K_ref, V_ref, before_ref, after_ref, &dec);
        const auto& diag = run.out.diagnostics;
        CHECK(diag.lambda_v == dec.lambda_v);
        CHECK(diag.value_step_rejected == dec.value_rejected);
        CHECK(diag.key_step_length == dec.key_length);
        CHECK(diag.key_step_rejected == dec.key_rejected);
        for (std::size_t i = 0; i < 4; ++i) lambda_seen[i] += diag.lambda_v == args.lambda_grid[i];
        value_kept += !diag.value_step_rejected;
        key_kept += !diag.key_step_rejected;
        value_undone += diag.value_step_rejected;
        key_undone += diag.key_step_rejected;
        if (dec.value_rejected)
          CHECK((to_mat(run.out.values).array() == run.V0.array()).all());
        else
          CHECK(rel(to_mat(run.out.values) - run.V0, V_ref - run.V0) <=
                std::max(Tol<Real>::value_step, Tol<Real>::key_step));
        if (dec.key_rejected)
          CHECK((to_mat(run.out.keys).array() == run.K0.array()).all());
        else
          CHECK(rel(to_mat(run.out.keys) - run.K0, K_ref - run.K0) <= Tol<Real>::key_step);
        CHECK(diag.window_error_before == Approx(before_ref).epsilon(10 * Tol<Real>::window));
        CHECK(diag.window_error_after == Approx(after_ref).epsilon(Tol<Real>::key_step));
        CHECK(diag.cg_status == kvc::SolverStatus::converged);
      }
  }
  // The cases exercise the choice: more than one λ wins, and steps are kept as well as undone.
  INFO("grid choices " << lambda_seen[0] << " " << lambda_seen[1] << " " << lambda_seen[2] << " " << lambda_seen[3]
                       << ", value steps undone " << value_undone << ", key steps undone " << key_undone);
  CHECK(std::count_if(lambda_seen.begin(), lambda_seen.end(), [](int c) { return c > 0; }) >= 2);
  CHECK(value_kept > 0);
  CHECK(key_kept > 0);
  CHECK(key_undone > 0);
}

TEMPLATE_TEST_CASE("RidgeMerge holdout with the safeguard never leaves a larger check error than the eviction",
                   "[ridge][policy]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using Real = kvc::compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(304);
  // Relative slack on the comparison: the merger compares check errors evaluated in Real.
  const double slack = std::is_same_v<Real, double> ? 1e-12 : 1e-5;
  struct Config { const char* name; double key_sigma; double lambda_k; std::array<double, 4> grid; };
  const Config configs[] = {
      {"random", 2.0, 1e-2, {1e-3, 1e-2, 1e-1, 1.0}},
      // Adversarial: sharp attention, λ far too small for both steps: unguarded steps overshoot.
      {"tiny lambdas, sharp keys", 4.0, 1e-7, {1e-9, 1e-8, 1e-7, 1e-6}},
  };
  int worse_without = 0;
  for (const Config& cfg : configs)
    for (long W : {2L, 5L, 8L}) {
      const Layer<T> layer(rng, 3, 2, 48, W, 8, cfg.key_sigma);
      const kvc::AttentionArguments attention;
      for (long g = 0; g < layer.Hkv; ++g)
        for (long m : {W + 6, W + 14, W + 24}) {
          INFO(cfg.name << ", W " << W << ", head " << g << ", m " << m);
          kvc::RidgeMerge::Arguments args;
          args.lambda_k = cfg.lambda_k;
          args.lambda_grid = cfg.grid;
          const auto run = run_policy(layer, g, m, attention, args);
          const double evicted = check_error(layer, g, run.kept, attention, args.holdout_every, run.K0, run.V0);
          const double merged = check_error(layer, g, run.kept, attention, args.holdout_every,
                                            to_mat(run.out.keys), to_mat(run.out.values));
          CHECK(std::isfinite(merged));
          CHECK(merged <= evicted * (1 + slack));
          args.safeguard = false;
          const auto unguarded = run_policy(layer, g, m, attention, args);
          worse_without += check_error(layer, g, run.kept, attention, args.holdout_every,
                                       to_mat(unguarded.out.keys), to_mat(unguarded.out.values)) >
                           evicted * (1 + 1e-3);
        }
    }
  // The adversarial heads are adversarial: without the safeguard some end worse than the eviction.
  CHECK(worse_without > 0);
}

TEMPLATE_TEST_CASE("RidgeMerge holdout edge cases", "[ridge][policy]", float, double) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(305);
  const kvc::AttentionArguments attention;
  SECTION("W = 1 has no check row: the fixed λ with the whole-window safeguard, bit for bit") {
    const Layer<T> layer(rng, 2, 2, 40, 1, 8, 2.0);
    for (bool safeguard : {false, true}) {
      kvc::RidgeMerge::Arguments holdout;
      holdout.safeguard = safeguard;
      kvc::RidgeMerge::Arguments fixed = fixed_args();
      fixed.safeguard = safeguard;
      for (long g = 0; g < layer.Hkv; ++g) {
        INFO("safeguard " << safeguard << " head " << g);
        const auto a = run_policy(layer, g, 16, attention, holdout);
        const auto b = run_policy(layer, g, 16, attention, fixed);
        REQUIRE(a.free.size() > 0);
        CHECK((a.out.keys.array() == b.out.keys.array()).all());
        CHECK((a.out.values.array() == b.out.values.array()).all());
        CHECK(a.out.diagnostics.lambda_v == fixed.lambda_v);
      }
    }
  }
  SECTION("zero values: nothing to fit, nothing moves") {
    Layer<T> layer(rng, 1, 2, 40, 8, 8, 2.0);
    std::fill(layer.v.begin(), layer.v.end(), kvc::from_real<T>(0.0f));
    for (Mat& V : layer.V) V.setZero();
    const auto run = run_policy(layer, 0, 20, attention, kvc::RidgeMerge::Arguments{});
    CHECK((to_mat(run.out.values).array() == 0.0).all());
    CHECK((to_mat(run.out.keys).array() == run.K0.array()).all());
    CHECK(run.out.diagnostics.window_error_after == 0.0);
  }
  SECTION("one free entry, and m = n") {
    const Layer<T> layer(rng, 1, 2, 40, 8, 8, 2.0);
    kvc::RidgeMerge::Arguments args;
    args.beta = 0.0;
    const auto one = run_policy(layer, 0, 13, attention, args);  // 4 sinks + 8 window + 1 free
    CHECK(one.free.size() == 1);
    CHECK(one.out.keys.allFinite());
    CHECK(one.out.values.allFinite());
    const auto all = run_policy(layer, 0, 40, attention, args);
    CHECK((to_mat(all.out.keys).array() == all.K0.array()).all());
    CHECK((to_mat(all.out.values).array() == all.V0.array()).all());
  }
}
