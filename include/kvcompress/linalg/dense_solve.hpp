// Small dense symmetric positive definite solves in double precision.
#pragma once

#include "kvcompress/core.hpp"

#include <Eigen/Cholesky>

namespace kvc::linalg {

/// Solves A·X = B in place (B ← X) for a small symmetric positive definite A (N, N), B (N, k), both
/// in double. Cholesky (LLT) first; if it fails (A only semi-definite after round-off) a pivoted LDLT.
/// Returns false, leaving B unchanged, when neither succeeds or the solution is not finite.
///
/// Only the lower triangle of A is read. Complexity O(N³/3 + N²·k).
inline bool solve_spd(const Eigen::MatrixXd& A, Eigen::MatrixXd& B) {
  if (A.rows() != A.cols() || A.rows() != B.rows()) return false;
  if (A.rows() == 0) return true;
  Eigen::LLT<Eigen::MatrixXd> llt(A);
  if (llt.info() == Eigen::Success) {
    Eigen::MatrixXd X = llt.solve(B);
    if (X.allFinite()) {
      B = std::move(X);
      return true;
    }
  }
  Eigen::LDLT<Eigen::MatrixXd> ldlt(A);
  if (ldlt.info() != Eigen::Success || !ldlt.isPositive()) return false;
  Eigen::MatrixXd X = ldlt.solve(B);
  if (!X.allFinite()) return false;
  B = std::move(X);
  return true;
}

}  // namespace kvc::linalg
