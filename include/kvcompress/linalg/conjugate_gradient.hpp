// Matrix-free conjugate gradients for small symmetric positive definite operators.
#pragma once

#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"  // SolverStatus

#include <cmath>
#include <limits>

namespace kvc {

/// Conjugate gradients (Hestenes–Stiefel, no preconditioner) for `A x = b` where `A` is symmetric
/// positive definite and only available as a product `apply(in, out)`: out = A·in.
///
/// Modelled on Eigen's `ConjugateGradient`: the tolerance is relative to ‖b‖, the outcome is read back
/// with `iterations()`, `error()` and `info()` (a value, never an exception).
///
///   ConjugateGradient<float> cg({1e-6, 100});
///   cg.solve([&](const Vector<float>& p, Vector<float>& Ap) { Ap = ...; }, b, x);
///   if (cg.info() != SolverStatus::converged) ...
///
/// Stopping: converged when the recursively updated residual satisfies ‖r‖ <= tolerance·‖b‖;
/// max_iterations when the budget is spent first; breakdown when pᵀAp <= 0 or a non-finite number shows
/// up (A is not positive definite on the Krylov space, or the input holds NaN/Inf). On breakdown `x` is
/// the last finite iterate. `b = 0` gives x = 0, converged, 0 iterations.
///
/// Complexity: per iteration one operator application plus 5 vector operations of length N; at most
/// `max_iterations` iterations (in exact arithmetic at most N). Memory: 3 work vectors of length N.
template <class Real>
class ConjugateGradient {
 public:
  struct Arguments {
    double tolerance = 1e-6;     ///< relative residual ‖r‖/‖b‖ to reach
    Index max_iterations = 100;  ///< iteration budget (0 = only check the initial guess)
  };

  ConjugateGradient() = default;
  explicit ConjugateGradient(const Arguments& args) : args_(args) {}

  ConjugateGradient& set_tolerance(double tolerance) {
    args_.tolerance = tolerance;
    return *this;
  }
  ConjugateGradient& set_max_iterations(Index max_iterations) {
    args_.max_iterations = max_iterations;
    return *this;
  }
  double tolerance() const { return args_.tolerance; }
  Index max_iterations() const { return args_.max_iterations; }
  const Arguments& arguments() const { return args_; }

  /// Solves apply(x) = rhs. `x` is the initial guess on entry (resized to rhs.size() and zeroed when
  /// its size differs) and the solution on exit. `apply(const Vector<Real>& in, Vector<Real>& out)`
  /// must write out = A·in (out arrives sized N; `in` and `out` never alias).
  /// Returns info().
  template <class Operator>
  SolverStatus solve(const Operator& apply, const Vector<Real>& rhs, Vector<Real>& x) {
    return solve(apply, rhs, x, [](Real) {});
  }

  /// As above, and `on_step(Real a)` is called right after every update x ← x + a·p, while `out` of the
  /// operator application that produced it (A·p) is still the caller's last one; a step undone on
  /// breakdown is reported as on_step(−a). A caller that needs a linear image L·x of the solution can
  /// accumulate a·(L·p) alongside the operator instead of applying L to x afterwards (GRKV's key step
  /// does this for Jᵀ·x). `x` starts from zero in that use (the initial guess is not reported).
  template <class Operator, class StepObserver>
  SolverStatus solve(const Operator& apply, const Vector<Real>& rhs, Vector<Real>& x,
                     const StepObserver& on_step) {
    const Index N = rhs.size();
    iterations_ = 0;
    if (x.size() != N) x.setZero(N);

    const double rhs_norm = static_cast<double>(rhs.norm());
    if (!std::isfinite(rhs_norm)) return finish(SolverStatus::breakdown, rhs_norm);
    if (rhs_norm == 0.0) {
      x.setZero();
      return finish(SolverStatus::converged, 0.0);
    }

    Vector<Real> r(N), p(N), Ap(N);  // (N) residual, search direction, A·p
    if (x.isZero(0)) {
      r = rhs;  // skip one product for the common zero guess
    } else {
      apply(static_cast<const Vector<Real>&>(x), Ap);
      r = rhs - Ap;
    }
    double rr = static_cast<double>(r.squaredNorm());
    if (!std::isfinite(rr)) return finish(SolverStatus::breakdown, rr);
    const double threshold = args_.tolerance * rhs_norm;
    const auto relative = [&](double squared) { return std::sqrt(squared) / rhs_norm; };
    if (std::sqrt(rr) <= threshold) return finish(SolverStatus::converged, relative(rr));

    p = r;
    while (iterations_ < args_.max_iterations) {
      apply(static_cast<const Vector<Real>&>(p), Ap);
      const double pAp = static_cast<double>(p.dot(Ap));
      if (!(pAp > 0.0) || !std::isfinite(pAp)) return finish(SolverStatus::breakdown, relative(rr));
      const Real alpha = static_cast<Real>(rr / pAp);
      x.noalias() += alpha * p;
      on_step(alpha);
      r.noalias() -= alpha * Ap;
      ++iterations_;
      const double rr_new = static_cast<double>(r.squaredNorm());
      if (!std::isfinite(rr_new)) {
        x.noalias() -= alpha * p;  // back to the last finite iterate
        on_step(-alpha);
        return finish(SolverStatus::breakdown, relative(rr));
      }
      if (std::sqrt(rr_new) <= threshold) return finish(SolverStatus::converged, relative(rr_new));
      const Real beta = static_cast<Real>(rr_new / rr);
      p = r + beta * p;
      rr = rr_new;
    }
    return finish(SolverStatus::max_iterations, relative(rr));
  }

  /// Iterations run by the last solve (operator applications inside the loop).
  Index iterations() const { return iterations_; }
  /// Final relative residual ‖r‖/‖b‖ of the last solve (recursively updated residual).
  double error() const { return error_; }
  /// Outcome of the last solve; not_run before the first.
  SolverStatus info() const { return info_; }

 private:
  SolverStatus finish(SolverStatus status, double error) {
    info_ = status;
    error_ = error;
    return status;
  }

  Arguments args_;
  Index iterations_ = 0;
  double error_ = 0.0;
  SolverStatus info_ = SolverStatus::not_run;
};

}  // namespace kvc
