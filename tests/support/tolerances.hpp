// tests/support/tolerances.hpp — the one table of numerical tolerances used by the test suite.
//
// Three comparisons, one row each:
//   float_vs_double : library in float arithmetic vs kvc::ref (double) on the SAME inputs.
//   half_vs_float   : library on Eigen::half-rounded inputs vs the float/double result on the original
//                     (unrounded) inputs, i.e. the cost of storing K, V, Q in half.
//   bf16_vs_float   : the same for Eigen::bfloat16.
// (Library on half inputs vs kvc::ref on the upcast half values is a pure arithmetic comparison: use
//  float_vs_double for it.)
//
// Each quantity has an elementwise test |got − want| <= abs + rel·|want| and a normwise test
// ‖got − want‖_F / ‖want‖_F <= norm. Prefer normwise; elementwise bounds must cover the tails.
//
// Validity range (what the numbers were measured on, with 4× or more margin): random inputs with
// q, k ~ N(0, σ²), σ <= 2 (logits ~N(0, σ⁴) at scale 1/sqrt(d)), v ~ N(0,1), d in 16..128, n <= 4096,
// W = 32. Sharper attention or larger n needs a new row, not a bigger number here.
//
// Reasoning:
//  * float (u = 2^-24 ≈ 6e-8): a logit carries ≈ u·s·Σ_k|q_k k_k| (≤ 4e-6 for σ = 2, d = 128), and a
//    serially summed softmax denominator ≈ sqrt(n)·u (≈ 4e-6 at n = 4096); a naive float loop measured
//    1.4e-5 elementwise / 6e-6 normwise on attention mass at n = 4096, σ = 2. Hence 5e-5 / 2e-5.
//    Merged values are convex combinations (error ≈ a few u·|v| plus the weights' error): same order.
//  * half (u = 2^-11 ≈ 4.9e-4) and bf16 (u = 2^-8 ≈ 3.9e-3): rounding q and k perturbs each logit by
//    ≈ u·s·Σ|q_k k_k|, which for σ <= 2 is a few u; the relative error of a probability is the
//    difference of two such perturbations. Measured (double arithmetic, rounded vs exact inputs,
//    SoftGate merge + AttentionRatio bias, pinned selection and routing): mass elementwise <= 10u,
//    normwise <= 1.3u; merged values normwise <= 1.5u, elementwise <= 19u·(1+|v|) (tails where a gate
//    cos(v_j, v_i) is near 0 or a small a_i is outweighed); bias <= 16u absolute. Tolerances are 8u
//    normwise and 32u–64u elementwise. Both formats give the same multiples of their own u.
//  * Discrete decisions (selection, routing, gate clamping at 0) can flip under input rounding; a
//    test comparing half/bf16 values must pin kept sets and routes from the reference inputs.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kvc::test {

/// Unit roundoffs of the three storage formats.
inline constexpr double kFloatU = 0x1p-24;
inline constexpr double kHalfU = 0x1p-11;
inline constexpr double kBf16U = 0x1p-8;

/// One tolerance: elementwise |got − want| <= abs + rel·|want|, normwise ‖got − want‖/‖want‖ <= norm.
struct Tol {
  double rel;
  double abs;
  double norm;
};

/// Tolerances for one comparison (one row of the table).
struct PrecisionTols {
  Tol probs;   // window attention probabilities A_h[i][j]
  Tol mass;    // window attention mass a_g[j] and mass-based scores
  Tol values;  // merged values, window / decode attention outputs (data of order 1)
  Tol bias;    // compensation bias (absolute: the bias is a log, often 0)
};

/// RoPE in float vs double: |got − want| <= (base + per_position·|pos|)·‖x‖₂ — the angle pos·θ^(−2i/r)
/// is itself rounded, so the error grows with the position.
struct RopeTol {
  double base;
  double per_position;
};

struct ToleranceTable {
  PrecisionTols float_vs_double{
      /*probs */ {5e-5, 1e-30, 2e-5},
      /*mass  */ {5e-5, 1e-30, 2e-5},
      /*values*/ {2e-5, 2e-5, 1e-5},
      /*bias  */ {0.0, 5e-5, 2e-5},
  };
  PrecisionTols half_vs_float{
      /*probs */ {32 * kHalfU, 1e-12, 8 * kHalfU},
      /*mass  */ {32 * kHalfU, 1e-12, 8 * kHalfU},
      /*values*/ {64 * kHalfU, 64 * kHalfU, 8 * kHalfU},
      /*bias  */ {0.0, 32 * kHalfU, 8 * kHalfU},
  };
  PrecisionTols bf16_vs_float{
      /*probs */ {32 * kBf16U, 1e-12, 8 * kBf16U},
      /*mass  */ {32 * kBf16U, 1e-12, 8 * kBf16U},
      /*values*/ {64 * kBf16U, 64 * kBf16U, 8 * kBf16U},
      /*bias  */ {0.0, 32 * kBf16U, 8 * kBf16U},
  };
  RopeTol rope_float{1e-6, 8 * kFloatU};
  /// The opt-in AMX bf16x3 window product (simd/amx_window.hpp) against double.
  /// A logit: within amx_bf16x3_logit · Σ_c |scale·q_c·k_c|, the bound derived in amx_window.hpp
  /// ((3·2^-18 + 3d·2^-24) of it, below 2^-14 for d <= 256).
  /// The attention mass: the float row's reasoning with that per-logit error in place of u·s·Σ|q k|.
  /// Measured logit errors are about ten times the float product's on these inputs (σ = 1.5, d <= 128),
  /// so the float row's numbers times ten.
  double amx_bf16x3_logit = 0x1p-14;
  Tol amx_bf16x3_mass{5e-4, 1e-30, 2e-4};
};

/// The table. Tests read kTol.float_vs_double.mass etc.; add rows here, never inline numbers in tests.
inline constexpr ToleranceTable kTol{};

// ---- comparison helpers -----------------------------------------------------------------------------

inline bool within(double got, double want, const Tol& t) {
  return std::abs(got - want) <= t.abs + t.rel * std::abs(want);
}

/// Largest elementwise violation ratio |got − want| / (abs + rel·|want|); <= 1 passes.
template <class A, class B>
double elementwise_ratio(const Eigen::MatrixBase<A>& got, const Eigen::MatrixBase<B>& want, const Tol& t) {
  double worst = 0.0;
  for (Eigen::Index c = 0; c < want.cols(); ++c)
    for (Eigen::Index r = 0; r < want.rows(); ++r) {
      const double w = static_cast<double>(want(r, c));
      const double e = std::abs(static_cast<double>(got(r, c)) - w);
      worst = std::max(worst, e / (t.abs + t.rel * std::abs(w)));
    }
  return worst;
}

/// ‖got − want‖_F / ‖want‖_F (0 when both are 0).
template <class A, class B>
double normwise_error(const Eigen::MatrixBase<A>& got, const Eigen::MatrixBase<B>& want) {
  const double num = (got.template cast<double>() - want.template cast<double>()).norm();
  const double den = want.template cast<double>().norm();
  return den == 0.0 ? num : num / den;
}

/// Both tests of `t` at once.
template <class A, class B>
bool within(const Eigen::MatrixBase<A>& got, const Eigen::MatrixBase<B>& want, const Tol& t) {
  return got.rows() == want.rows() && got.cols() == want.cols() && elementwise_ratio(got, want, t) <= 1.0 &&
         normwise_error(got, want) <= t.norm;
}

inline bool within(const std::vector<double>& got, const std::vector<double>& want, const Tol& t) {
  if (got.size() != want.size()) return false;
  const Eigen::Map<const Eigen::VectorXd> g(got.data(), static_cast<Eigen::Index>(got.size()));
  const Eigen::Map<const Eigen::VectorXd> w(want.data(), static_cast<Eigen::Index>(want.size()));
  return within(g, w, t);
}

}  // namespace kvc::test
