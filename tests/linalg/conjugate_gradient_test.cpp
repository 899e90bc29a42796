// Tests for kvc::ConjugateGradient against a dense Cholesky solve.
#include <catch2/catch.hpp>

#include "kvcompress/linalg/conjugate_gradient.hpp"
#include "support/random.hpp"

#include <Eigen/Cholesky>

#include <cmath>
#include <iostream>
#include <limits>

namespace {

using kvc::Index;
using kvc::SolverStatus;

// Tolerances (relative solution error vs the dense LLT solve), one row per scalar type.
template <class Real>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double cg = 1e-12;        // CG tolerance requested
  static constexpr double solution = 1e-9;   // ‖x − x*‖ / ‖x*‖ (cond(A) <= ~10 here)
};
template <>
struct Tol<float> {
  static constexpr double cg = 1e-5;
  static constexpr double solution = 1e-4;
};

/// Well-conditioned SPD matrix A = B Bᵀ / N + I (eigenvalues in [1, ~5]).
Eigen::MatrixXd random_spd(std::mt19937_64& rng, Index N) {
  const Eigen::MatrixXd B = kvc::test::random_matrix(rng, N, N);
  Eigen::MatrixXd A = B * B.transpose() / static_cast<double>(N);
  A.diagonal().array() += 1.0;
  return A;
}

template <class Real>
auto dense_operator(const Eigen::MatrixXd& A) {
  const kvc::RowMatrix<Real> Ar = A.cast<Real>();
  return [Ar](const kvc::Vector<Real>& in, kvc::Vector<Real>& out) { out.noalias() = Ar * in; };
}

}  // namespace

TEMPLATE_TEST_CASE("CG matches a dense LLT solve on random SPD systems", "[linalg][cg]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(101);
  for (Index N : {1, 2, 3, 7, 8, 16, 17, 33, 64, 130}) {
    INFO("N = " << N);
    const Eigen::MatrixXd A = random_spd(rng, N);
    const Eigen::VectorXd b = kvc::test::random_matrix(rng, N, 1);
    const Eigen::VectorXd expected = A.llt().solve(b);

    kvc::ConjugateGradient<Real> cg;
    cg.set_tolerance(Tol<Real>::cg).set_max_iterations(10 * N + 10);
    kvc::Vector<Real> x;  // empty guess: resized and zeroed
    const SolverStatus status = cg.solve(dense_operator<Real>(A), b.cast<Real>().eval(), x);

    CHECK(status == SolverStatus::converged);
    CHECK(cg.info() == SolverStatus::converged);
    CHECK(cg.iterations() >= 1);
    CHECK(cg.error() <= Tol<Real>::cg);
    REQUIRE(x.size() == N);
    const double err = (x.template cast<double>() - expected).norm() / expected.norm();
    CHECK(err <= Tol<Real>::solution);
    // The reported error is the recursive residual; the true residual must agree with it in double.
    if constexpr (std::is_same_v<Real, double>) {
      const double true_residual = (b - A * x).norm() / b.norm();
      CHECK(true_residual <= 10 * Tol<Real>::cg);
    }
  }
}

TEST_CASE("CG defaults follow Eigen: tolerance 1e-6, 100 iterations", "[linalg][cg]") {
  kvc::ConjugateGradient<float> cg;
  CHECK(cg.tolerance() == 1e-6);
  CHECK(cg.max_iterations() == 100);
  CHECK(cg.info() == SolverStatus::not_run);
  kvc::ConjugateGradient<double> cg2({1e-3, 7});
  CHECK(cg2.tolerance() == 1e-3);
  CHECK(cg2.max_iterations() == 7);
}

TEST_CASE("CG uses the initial guess", "[linalg][cg]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(102);
  const Index N = 20;
  const Eigen::MatrixXd A = random_spd(rng, N);
  const Eigen::VectorXd b = kvc::test::random_matrix(rng, N, 1);
  const Eigen::VectorXd exact = A.llt().solve(b);

  kvc::ConjugateGradient<double> cg({1e-8, 100});
  kvc::Vector<double> x = exact;  // already the solution: no iteration needed
  CHECK(cg.solve(dense_operator<double>(A), b, x) == SolverStatus::converged);
  CHECK(cg.iterations() == 0);
  CHECK((x - exact).norm() <= 1e-12 * exact.norm());

  kvc::Vector<double> y = exact + 1e-3 * Eigen::VectorXd::Ones(N);  // close guess
  CHECK(cg.solve(dense_operator<double>(A), b, y) == SolverStatus::converged);
  CHECK((y - exact).norm() <= 1e-6 * exact.norm());
}

TEST_CASE("CG with a zero right-hand side returns x = 0 without iterating", "[linalg][cg]") {
  const Index N = 5;
  const Eigen::MatrixXd A = Eigen::MatrixXd::Identity(N, N) * 3.0;
  kvc::ConjugateGradient<double> cg;
  kvc::Vector<double> x = Eigen::VectorXd::Constant(N, 7.0);  // non-zero guess must be discarded
  int applications = 0;
  const auto op = [&](const kvc::Vector<double>& in, kvc::Vector<double>& out) {
    ++applications;
    out = A * in;
  };
  CHECK(cg.solve(op, Eigen::VectorXd::Zero(N).eval(), x) == SolverStatus::converged);
  CHECK(cg.iterations() == 0);
  CHECK(cg.error() == 0.0);
  CHECK(applications == 0);
  CHECK(x.size() == N);
  CHECK(x.isZero(0.0));
}

TEST_CASE("CG reports max_iterations when the budget runs out", "[linalg][cg]") {
  // Diagonal with 50 distinct eigenvalues spread over [1, 1e4]: exact CG needs 50 iterations.
  const Index N = 50;
  Eigen::VectorXd diag(N);
  for (Index i = 0; i < N; ++i) diag(i) = std::pow(1e4, static_cast<double>(i) / (N - 1));
  const Eigen::VectorXd b = Eigen::VectorXd::Ones(N);
  const auto op = [&](const kvc::Vector<double>& in, kvc::Vector<double>& out) {
    out = diag.cwiseProduct(in);
  };
  kvc::ConjugateGradient<double> cg({1e-12, 3});
  kvc::Vector<double> x;
  CHECK(cg.solve(op, b, x) == SolverStatus::max_iterations);
  CHECK(cg.iterations() == 3);
  CHECK(cg.error() > 1e-12);
  CHECK(std::isfinite(cg.error()));
  // The reported residual is the real one (up to round-off).
  CHECK(cg.error() == Approx((b - diag.cwiseProduct(x)).norm() / b.norm()).epsilon(1e-8));

  kvc::ConjugateGradient<double> none({1e-12, 0});
  kvc::Vector<double> z;
  CHECK(none.solve(op, b, z) == SolverStatus::max_iterations);
  CHECK(none.iterations() == 0);
  CHECK(none.error() == Approx(1.0));
}

TEST_CASE("CG reports breakdown on an indefinite operator or non-finite input", "[linalg][cg]") {
  // A = diag(1, −2), b = (1, 1): the first direction p = b has pᵀAp = −1.
  Eigen::VectorXd diag(2);
  diag << 1.0, -2.0;
  const auto op = [&](const kvc::Vector<double>& in, kvc::Vector<double>& out) {
    out = diag.cwiseProduct(in);
  };
  kvc::ConjugateGradient<double> cg;
  kvc::Vector<double> x;
  CHECK(cg.solve(op, Eigen::VectorXd::Ones(2).eval(), x) == SolverStatus::breakdown);
  CHECK(cg.iterations() == 0);
  CHECK(x.allFinite());

  // A zero operator: pᵀAp = 0.
  const auto zero = [](const kvc::Vector<double>& in, kvc::Vector<double>& out) { out.setZero(in.size()); };
  CHECK(cg.solve(zero, Eigen::VectorXd::Ones(3).eval(), x) == SolverStatus::breakdown);

  // NaN in the right-hand side.
  Eigen::VectorXd bad = Eigen::VectorXd::Ones(3);
  bad(1) = std::numeric_limits<double>::quiet_NaN();
  const auto id = [](const kvc::Vector<double>& in, kvc::Vector<double>& out) { out = in; };
  CHECK(cg.solve(id, bad, x) == SolverStatus::breakdown);

  // An operator that returns Inf.
  const auto inf = [](const kvc::Vector<double>& in, kvc::Vector<double>& out) {
    out = in;
    out(0) = std::numeric_limits<double>::infinity();
  };
  kvc::Vector<double> y;
  CHECK(cg.solve(inf, Eigen::VectorXd::Ones(3).eval(), y) == SolverStatus::breakdown);
  CHECK(y.allFinite());
}

TEST_CASE("CG on a matrix-free normal operator J Jᵀ + λI", "[linalg][cg]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(103);
  const Index rows = 24, cols = 9;  // J Jᵀ has rank 9 < 24: λ keeps it SPD
  const Eigen::MatrixXd J = kvc::test::random_matrix(rng, rows, cols);
  const double lambda = 1e-2;
  const Eigen::VectorXd b = kvc::test::random_matrix(rng, rows, 1);
  Eigen::MatrixXd dense = J * J.transpose();
  dense.diagonal().array() += lambda;
  const Eigen::VectorXd expected = dense.ldlt().solve(b);
  const auto op = [&](const kvc::Vector<double>& in, kvc::Vector<double>& out) {
    const Eigen::VectorXd t = J.transpose() * in;
    out = J * t + lambda * in;
  };
  kvc::ConjugateGradient<double> cg({1e-12, 200});
  kvc::Vector<double> x;
  CHECK(cg.solve(op, b, x) == SolverStatus::converged);
  // cond ≈ (σ_max² + λ)/λ ≈ 4e3: the error is bounded by cond · tolerance.
  CHECK((x - expected).norm() <= 1e-7 * expected.norm());
}

TEMPLATE_TEST_CASE("CG step observer: Σ a·p over the reported steps is the solution", "[linalg][cg]", float, double) {
  using Real = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(108);
  const Index N = 40;
  const Eigen::MatrixXd A = random_spd(rng, N);
  const kvc::Vector<Real> b = kvc::test::random_matrix(rng, N, 1).cast<Real>();
  const kvc::RowMatrix<Real> Ar = A.cast<Real>();
  // A linear image L·x accumulated along the steps, as GRKV's key step does for Jᵀx.
  const kvc::RowMatrix<Real> L = kvc::test::random_matrix(rng, 7, N).cast<Real>();
  kvc::Vector<Real> last_Lp(7), Lx = kvc::Vector<Real>::Zero(7), x;
  Index steps = 0;
  kvc::ConjugateGradient<Real> cg({Tol<Real>::cg, 200});
  cg.solve(
      [&](const kvc::Vector<Real>& in, kvc::Vector<Real>& out) {
        out.noalias() = Ar * in;
        last_Lp.noalias() = L * in;
      },
      b, x, [&](Real a) {
        Lx += a * last_Lp;
        ++steps;
      });
  CHECK(cg.info() == SolverStatus::converged);
  CHECK(steps == cg.iterations());
  const kvc::Vector<Real> expected = L * x;
  CHECK((Lx - expected).norm() <= Tol<Real>::solution * expected.norm());  // rounding only
}
