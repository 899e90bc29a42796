// tests/support/ridge_reference.hpp — independent double-precision oracle for the GRKV ridge merge
// (SPEC §9), written from the equations with plain loops and dense solves.
//
// Independence is the point: no kvcompress header is included and the algorithms differ from the
// library's on purpose:
//  * value step: the PRIMAL normal equations (X_Uᵀ X_U + λ I) V_U = X_Uᵀ (Y − X_F V_F) + λ V_U⁰ by a
//    dense LDLT (the library uses the dual R×R form);
//  * key step: the Jacobian J = ∂ vec f / ∂ vec K_U is built entry by entry from the analytic formula
//      ∂f[r][c] / ∂K_U[k][e] = s · Q[r][e] · C[r][u] · A[r][u] · (V[u][c] − f[r][c]),   u = free[k]
//    (C = 1 − tanh² of the soft-cap, 1 without), and (J Jᵀ + λ I) α = e + J g is solved densely
//    (the library runs matrix-free CG).
// vec(·) is the row-major flattening (index row·cols + col), as in the library.
//
// Reference decision (fixed set, SPEC §9): F = {p < sinks} ∪ {p >= n − W} ∪ the top ⌈β·c⌉ of the c
// kept non-window positions by score (higher first, ties to the lower position); the sinks take part
// in that ranking. ⌈β·c⌉ is taken with a 1e-9 slack so that 0.1·30 counts as 3.
#pragma once

#include <Eigen/Cholesky>
#include <Eigen/Core>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::ref::ridge {

using Mat = Eigen::MatrixXd;

inline void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("kvc::ref::ridge: " + what);
}

/// How many kept positions each of the G·W window rows sees: row r = h·W + i sits at n − W + i.
inline std::vector<long> visible_counts(const std::vector<long>& kept, long n, long W, long G) {
  std::vector<long> out;
  for (long h = 0; h < G; ++h)
    for (long i = 0; i < W; ++i) {
      long c = 0;
      for (long p : kept)
        if (p <= n - W + i) ++c;
      out.push_back(c);
    }
  return out;
}

/// Logit after the optional soft-cap, and its derivative with respect to the raw logit.
inline double capped(double z, double softcap) { return softcap > 0 ? softcap * std::tanh(z / softcap) : z; }
inline double capped_slope(double z, double softcap) {
  if (softcap <= 0) return 1.0;
  const double t = std::tanh(z / softcap);
  return 1.0 - t * t;
}

/// A (R,m): row r is the softmax over kept entries 0..visible[r)-1 of capped(scale·<q_r, k_j>); a row
/// seeing nothing is 0.
inline Mat probabilities(const Mat& Q, const Mat& K, const std::vector<long>& visible, double scale,
                         double softcap) {
  check(Q.cols() == K.cols(), "Q and K widths differ");
  check(static_cast<long>(visible.size()) == Q.rows(), "visible has the wrong length");
  const long R = Q.rows(), m = K.rows(), d = Q.cols();
  Mat A = Mat::Zero(R, m);
  for (long r = 0; r < R; ++r) {
    const long len = std::min(visible[static_cast<std::size_t>(r)], m);
    if (len <= 0) continue;
    std::vector<double> logit(static_cast<std::size_t>(len));
    double mx = -std::numeric_limits<double>::infinity();
    for (long j = 0; j < len; ++j) {
      double z = 0;
      for (long e = 0; e < d; ++e) z += Q(r, e) * K(j, e);
      logit[static_cast<std::size_t>(j)] = capped(scale * z, softcap);
      mx = std::max(mx, logit[static_cast<std::size_t>(j)]);
    }
    double sum = 0;
    for (long j = 0; j < len; ++j) sum += std::exp(logit[static_cast<std::size_t>(j)] - mx);
    for (long j = 0; j < len; ++j) A(r, j) = std::exp(logit[static_cast<std::size_t>(j)] - mx) / sum;
  }
  return A;
}

/// f = A·V (R,d) with plain loops.
inline Mat outputs(const Mat& Q, const Mat& K, const Mat& V, const std::vector<long>& visible,
                   double scale, double softcap) {
  const Mat A = probabilities(Q, K, visible, scale, softcap);
  Mat f = Mat::Zero(Q.rows(), V.cols());
  for (long r = 0; r < A.rows(); ++r)
    for (long j = 0; j < A.cols(); ++j)
      for (long c = 0; c < V.cols(); ++c) f(r, c) += A(r, j) * V(j, c);
  return f;
}

/// ‖Y − f‖_F / ‖Y‖_F.
inline double window_error(const Mat& Q, const Mat& K, const Mat& V, const std::vector<long>& visible,
                           double scale, double softcap, const Mat& Y) {
  return (Y - outputs(Q, K, V, visible, scale, softcap)).norm() / Y.norm();
}

/// Fixed mask over kept positions (see the Reference decision at the top): repeated arg-max selection.
inline std::vector<bool> fixed_mask(const std::vector<long>& kept, long n, long W, long sinks, double beta,
                                    const std::vector<double>& score) {
  const std::size_t m = kept.size();
  std::vector<bool> fixed(m, false), taken(m, false);
  long c = 0;
  for (std::size_t k = 0; k < m; ++k) {
    if (kept[k] < sinks || kept[k] >= n - W) fixed[k] = true;
    if (kept[k] < n - W) ++c;
  }
  long top = 0;
  while (top < c && static_cast<double>(top) < beta * static_cast<double>(c) - 1e-9) ++top;
  for (long t = 0; t < top; ++t) {
    long best = -1;
    for (std::size_t k = 0; k < m; ++k) {
      if (taken[k] || kept[k] >= n - W) continue;
      if (best < 0 || score[static_cast<std::size_t>(kept[k])] >
                          score[static_cast<std::size_t>(kept[static_cast<std::size_t>(best)])])
        best = static_cast<long>(k);  // strict '>' keeps the lower position on ties (ascending scan)
    }
    taken[static_cast<std::size_t>(best)] = true;
    fixed[static_cast<std::size_t>(best)] = true;
  }
  return fixed;
}

inline std::vector<long> free_list(const std::vector<bool>& fixed) {
  std::vector<long> out;
  for (std::size_t k = 0; k < fixed.size(); ++k)
    if (!fixed[k]) out.push_back(static_cast<long>(k));
  return out;
}

/// Primal value step: V_U = (X_Uᵀ X_U + λ I)⁻¹ (X_Uᵀ (Y − X_F V_F) + λ V_U⁰), V_F = V_F⁰ (dense LDLT).
inline Mat value_step_primal(const Mat& X, const Mat& V0, const Mat& Y, const std::vector<long>& free,
                             double lambda) {
  const long R = X.rows(), m = X.cols(), d = V0.cols(), u = static_cast<long>(free.size());
  std::vector<bool> is_free(static_cast<std::size_t>(m), false);
  for (long k : free) is_free[static_cast<std::size_t>(k)] = true;
  Mat rest = Y;  // Y − X_F V_F
  for (long r = 0; r < R; ++r)
    for (long j = 0; j < m; ++j)
      if (!is_free[static_cast<std::size_t>(j)])
        for (long c = 0; c < d; ++c) rest(r, c) -= X(r, j) * V0(j, c);
  Mat normal = Mat::Zero(u, u), rhs = Mat::Zero(u, d);
  for (long a = 0; a < u; ++a) {
    const long ja = free[static_cast<std::size_t>(a)];
    for (long b = 0; b < u; ++b) {
      const long jb = free[static_cast<std::size_t>(b)];
      for (long r = 0; r < R; ++r) normal(a, b) += X(r, ja) * X(r, jb);
    }
    normal(a, a) += lambda;
    for (long c = 0; c < d; ++c) {
      for (long r = 0; r < R; ++r) rhs(a, c) += X(r, ja) * rest(r, c);
      rhs(a, c) += lambda * V0(ja, c);
    }
  }
  Mat V = V0;
  if (u == 0) return V;
  Eigen::LDLT<Mat> ldlt(normal);
  check(ldlt.info() == Eigen::Success, "LDLT failed in value_step_primal");
  const Mat VU = ldlt.solve(rhs);
  for (long a = 0; a < u; ++a) V.row(free[static_cast<std::size_t>(a)]) = VU.row(a);
  return V;
}

/// Explicit Jacobian J (R·d, u·d) of vec f with respect to vec K_U at (K, V), entry by entry.
inline Mat jacobian(const Mat& Q, const Mat& K, const Mat& V, const std::vector<long>& visible, double scale,
                    double softcap, const std::vector<long>& free) {
  const long R = Q.rows(), d = Q.cols(), dv = V.cols(), u = static_cast<long>(free.size());
  const Mat A = probabilities(Q, K, visible, scale, softcap);
  const Mat f = outputs(Q, K, V, visible, scale, softcap);
  Mat J = Mat::Zero(R * dv, u * d);
  for (long k = 0; k < u; ++k) {
    const long j = free[static_cast<std::size_t>(k)];
    for (long r = 0; r < R; ++r) {
      if (j >= visible[static_cast<std::size_t>(r)]) continue;
      double z = 0;
      for (long e = 0; e < d; ++e) z += Q(r, e) * K(j, e);
      const double slope = capped_slope(scale * z, softcap);
      for (long c = 0; c < dv; ++c)
        for (long e = 0; e < d; ++e)
          J(r * dv + c, k * d + e) = scale * Q(r, e) * slope * A(r, j) * (V(j, c) - f(r, c));
    }
  }
  return J;
}

/// Row-major vec of a matrix.
inline Eigen::VectorXd vec(const Mat& M) {
  Eigen::VectorXd v(M.size());
  for (long r = 0; r < M.rows(); ++r)
    for (long c = 0; c < M.cols(); ++c) v(r * M.cols() + c) = M(r, c);
  return v;
}
inline Mat unvec(const Eigen::VectorXd& v, long rows, long cols) {
  Mat M(rows, cols);
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c) M(r, c) = v(r * cols + c);
  return M;
}

/// Dense key step: α = (J Jᵀ + λ I)⁻¹ (e + J g), K_U = K_U⁰ + unvec(Jᵀ α), K_F unchanged. Returns the new
/// keys; `alpha_out`, when given, receives α (R·d).
inline Mat key_step(const Mat& Q, const Mat& K, const Mat& K0, const Mat& V, const Mat& Y,
                    const std::vector<long>& visible, double scale, double softcap,
                    const std::vector<long>& free, double lambda, Eigen::VectorXd* alpha_out = nullptr) {
  const long d = Q.cols(), u = static_cast<long>(free.size());
  Mat Knew = K;
  if (u == 0) return Knew;
  const Mat J = jacobian(Q, K, V, visible, scale, softcap, free);
  const Eigen::VectorXd e = vec(Y - outputs(Q, K, V, visible, scale, softcap));
  Eigen::VectorXd g(u * d);
  for (long k = 0; k < u; ++k)
    for (long c = 0; c < d; ++c)
      g(k * d + c) = K(free[static_cast<std::size_t>(k)], c) - K0(free[static_cast<std::size_t>(k)], c);
  Mat system = J * J.transpose();
  system.diagonal().array() += lambda;
  Eigen::LDLT<Mat> ldlt(system);
  check(ldlt.info() == Eigen::Success, "LDLT failed in key_step");
  const Eigen::VectorXd alpha = ldlt.solve(e + J * g);
  if (alpha_out) *alpha_out = alpha;
  const Eigen::VectorXd delta = J.transpose() * alpha;
  for (long k = 0; k < u; ++k)
    for (long c = 0; c < d; ++c)
      Knew(free[static_cast<std::size_t>(k)], c) = K0(free[static_cast<std::size_t>(k)], c) + delta(k * d + c);
  return Knew;
}

/// The whole regression: `steps` alternations (value→key when value_first), anchors K0, V0, no
/// safeguard. K and V are in/out.
inline void regress(const Mat& Q, const Mat& Y, const std::vector<long>& visible, double scale,
                    double softcap, const std::vector<long>& free, double lambda_v, double lambda_k,
                    long steps, bool value_first, bool value_on, bool key_on, Mat& K, Mat& V) {
  const Mat K0 = K, V0 = V;
  for (long s = 0; s < steps; ++s)
    for (int phase = 0; phase < 2; ++phase) {
      const bool value_phase = (phase == 0) == value_first;
      if (value_phase && value_on)
        V = value_step_primal(probabilities(Q, K, visible, scale, softcap), V0, Y, free, lambda_v);
      if (!value_phase && key_on)
        K = key_step(Q, K, K0, V, Y, visible, scale, softcap, free, lambda_k);
    }
}

// ---------------------------------------------------------------------------------------------------
// λ chosen on held-out window rows, and the safeguard (RidgeMerge lambda_mode = holdout).
// ---------------------------------------------------------------------------------------------------

/// Window position i of each of the G query heads (row h·W + i) is a check row when W − 1 − i is a
/// multiple of `every`; every other row is a fit row. W < 2: no check rows.
inline void holdout_rows(long W, long G, long every, std::vector<long>& fit, std::vector<long>& check) {
  fit.clear();
  check.clear();
  if (W < 2) return;
  for (long h = 0; h < G; ++h)
    for (long i = 0; i < W; ++i) {
      const long r = h * W + i;
      if ((W - 1 - i) % every == 0)
        check.push_back(r);
      else
        fit.push_back(r);
    }
}

inline Mat rows_of(const Mat& M, const std::vector<long>& rows) {
  Mat out(static_cast<long>(rows.size()), M.cols());
  for (std::size_t k = 0; k < rows.size(); ++k) out.row(static_cast<long>(k)) = M.row(rows[k]);
  return out;
}
inline std::vector<long> rows_of(const std::vector<long>& v, const std::vector<long>& rows) {
  std::vector<long> out;
  for (long r : rows) out.push_back(v[static_cast<std::size_t>(r)]);
  return out;
}

/// What the holdout regression decided (the last value / key step).
struct HoldoutDecisions {
  double lambda_v = std::numeric_limits<double>::quiet_NaN();
  bool value_rejected = false;
  double key_length = std::numeric_limits<double>::quiet_NaN();  // 0 = undone
  bool key_rejected = false;
};

/// The holdout regression, from its definition: each step is fitted on the fit rows only. Value step:
/// for every λ of `grid` the primal value step on the fit rows gives V(λ); the λ whose V(λ) has the
/// smallest check error ‖Y_C − f_C(K, V(λ))‖ wins (ties to the later, larger λ). Key step: the dense
/// key step on the fit rows gives K¹; of K + t (K¹ − K), t = 1, 1/2, 1/4, the smallest check error
/// wins (ties to the earlier t). With `safeguard` a step whose check error is not below the one before
/// the step is undone. K, V in/out.
inline HoldoutDecisions regress_holdout(const Mat& Q, const Mat& Y, const std::vector<long>& visible, double scale,
                                        double softcap, const std::vector<long>& free,
                                        const std::vector<double>& grid, double lambda_k, long steps,
                                        bool value_first, bool value_on, bool key_on, long W, long G, long every,
                                        bool safeguard, Mat& K, Mat& V) {
  std::vector<long> fit, chk;
  holdout_rows(W, G, every, fit, chk);
  check(!chk.empty(), "regress_holdout needs W >= 2");
  const Mat QF = rows_of(Q, fit), YF = rows_of(Y, fit), QC = rows_of(Q, chk), YC = rows_of(Y, chk);
  const std::vector<long> visF = rows_of(visible, fit), visC = rows_of(visible, chk);
  const auto check_error = [&](const Mat& Kx, const Mat& Vx) {
    return (YC - outputs(QC, Kx, Vx, visC, scale, softcap)).norm();
  };
  HoldoutDecisions dec;
  const Mat K0 = K, V0 = V;
  for (long s = 0; s < steps; ++s)
    for (int phase = 0; phase < 2; ++phase) {
      const bool value_phase = (phase == 0) == value_first;
      if (value_phase && value_on) {
        const Mat XF = probabilities(QF, K, visF, scale, softcap);
        double best = std::numeric_limits<double>::infinity();
        Mat best_V;
        for (double lambda : grid) {
          const Mat Vl = value_step_primal(XF, V0, YF, free, lambda);
          const double e = check_error(K, Vl);
          if (e <= best) {
            best = e;
            best_V = Vl;
            dec.lambda_v = lambda;
          }
        }
        dec.value_rejected = safeguard && !(best < check_error(K, V));
        if (!dec.value_rejected) V = best_V;
      }
      if (!value_phase && key_on) {
        const Mat K1 = key_step(QF, K, K0, V, YF, visF, scale, softcap, free, lambda_k);
        double best = std::numeric_limits<double>::infinity();
        Mat best_K;
        for (double t : {1.0, 0.5, 0.25}) {
          const Mat Kt = K + t * (K1 - K);
          const double e = check_error(Kt, V);
          if (e < best) {
            best = e;
            best_K = Kt;
            dec.key_length = t;
          }
        }
        dec.key_rejected = safeguard && !(best < check_error(K, V));
        if (dec.key_rejected)
          dec.key_length = 0.0;
        else
          K = best_K;
      }
    }
  return dec;
}

}  // namespace kvc::ref::ridge
