// GRKV ridge merge (SPEC §9): re-fit the kept values, then keys, so the compressed cache reproduces
// the full cache's window attention outputs.
#pragma once

#include "kvcompress/policy.hpp"  // first: defines KVC_INTERNAL_INCLUDE for the private headers

#include "kvcompress/core.hpp"
#include "kvcompress/detail/rows.hpp"
#include "kvcompress/linalg/conjugate_gradient.hpp"
#include "kvcompress/linalg/dense_solve.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kvc {

/// Merger policy `Ridge` (GRKV, SPEC §9). Evicted tokens are not routed anywhere (the routing is
/// ignored and every gate is 0); instead the free kept entries U are re-fitted by ridge regression so
/// that the compressed cache reproduces Y = A_full·V, the full cache's attention outputs of the
/// G·W window queries of the KV head:
///
///   value step (closed form):  V_U ← argmin_Z ‖Y − X_F V_F − X_U Z‖² + λ_v ‖Z − V_U⁰‖²
///   key step (one linearised): K_U ← argmin_Z ‖Y − f(K) − J (Z − K_U)‖² + λ_k ‖Z − K_U⁰‖²
///
/// with X = masked softmax(s·Qw K_Sᵀ) over the kept set S and f(K) = X·V. The fixed entries F
/// (sinks, window positions, the top ⌈β·|S \ window|⌉ non-window entries by score) come out
/// bit-identical. The building blocks are the free functions in `kvc::ridge` below.
///
/// Cost per head and step, R = G·W rows, m kept, u = |U|, d head dimension:
///   value step O(R²·u + R³ + R·m·d); key step O(R·m·d) to linearise plus, per CG iteration, one JVP and
///   one VJP, each two (R×d×u) products (u <= m). Y costs one R×n×d product. Memory O(R·(n + m + d)).
struct RidgeMerge {
  struct Arguments {
    double lambda_v = 1e-2;  ///< ridge weight of the value step (> 0)
    double lambda_k = 1e-2;  ///< ridge weight of the key step (> 0)
    double beta = 0.1;       ///< share of kept non-window entries fixed by score, in [0, 1]
    Index sinks = 4;         ///< kept positions < sinks are fixed
    Index steps = 1;         ///< alternations S (0 = identity)
    enum class Order { value_then_key, key_then_value } order = Order::value_then_key;
    bool value_step = true;
    bool key_step = true;
    double cg_tolerance = 1e-6;       ///< relative residual of the key-step CG
    Index cg_max_iterations = 100;    ///< CG iteration budget per key step
    bool safeguard = false;  ///< keep a key step only if it lowers ‖Y − f(K)‖ (our extension)
  };

  Arguments args;

  /// Checks the arguments for a head of n tokens compressed to m entries. Never throws.
  Status validate(Index n, Index m) const;

  /// Re-fits `out.keys` / `out.values` (m, d), which hold the kept tokens' original rows on entry,
  /// and sets `out.gate` (n − m) to 0. `routing` is ignored. Fills the ridge fields of
  /// `out.diagnostics` (window errors, CG statistics) and kept / evicted / merged = 0 / dropped.
  /// m = n (nothing evicted) leaves keys and values untouched (SPEC §3).
  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing& routing, MergeOutput<compute_t<T>>& out) const;
};

/// Dense building blocks of the ridge merge, one KV head at a time. Matrices are row-major
/// (`RowMatrix`); "kept" matrices have one row per kept entry in ascending position order; the free
/// set is given as indices into those rows (ascending). `vec(M)` of an (a, b) matrix is its row-major
/// flattening (index i·b + j).
namespace ridge {

/// How the R stacked window rows attend over the kept set: logits softcap(scale·<q_r, k_j>) for the
/// first `visible[r]` kept entries (a causal prefix, since kept positions ascend), nothing beyond.
struct Attention {
  std::vector<Index> visible;  // (R)
  double scale = 1.0;
  double softcap = 0.0;  ///< 0 = off
};

/// (G·W) causal prefix lengths: row r = local_head·W + i sits at position p_i = n − W + i and sees the
/// kept positions p <= p_i. O(G·W·log m).
inline std::vector<Index> visible_counts(const std::vector<Index>& kept, Index n, Index W, Index G) {
  std::vector<Index> visible(static_cast<std::size_t>(G * W));
  for (Index r = 0; r < G * W; ++r) {
    const Index position = n - W + r % W;
    visible[static_cast<std::size_t>(r)] =
        std::upper_bound(kept.begin(), kept.end(), position) - kept.begin();
  }
  return visible;
}

/// (m) fixed mask over the kept positions (ascending): F = {p < sinks} ∪ {p >= n − W} ∪ the top
/// ⌈β·c⌉ of the c kept non-window positions ranked by `score` (higher first, ties to the lower
/// position; NaN ranks last; positions beyond score.size() rank as −∞).
///
/// Decision (SPEC §9 leaves it open): the sinks take part in the ranking, so F is the union of the
/// three sets and the top-β entries may overlap the sinks. ⌈·⌉ tolerates round-off (β = 0.1, c = 30
/// fixes 3, not 4). O(m log m).
template <class Real>
std::vector<bool> fixed_mask(const std::vector<Index>& kept, Index n, Index W, Index sinks, double beta,
                             const Vector<Real>& score) {
  const std::size_t m = kept.size();
  std::vector<bool> fixed(m, false);
  std::vector<std::size_t> candidates;  // indices into kept of non-window entries
  for (std::size_t k = 0; k < m; ++k) {
    const Index p = kept[k];
    if (p < sinks || p >= n - W) fixed[k] = true;
    if (p < n - W) candidates.push_back(k);
  }
  const double x = beta * static_cast<double>(candidates.size());
  const double top = std::ceil(x - 1e-9 * (x + 1.0));
  const std::size_t count =
      std::min(candidates.size(), static_cast<std::size_t>(std::max(0.0, top)));
  const auto value = [&](std::size_t k) {
    const Index p = kept[k];
    constexpr double lowest = -std::numeric_limits<double>::infinity();
    const double v = p < score.size() ? static_cast<double>(score[p]) : lowest;
    return std::isnan(v) ? lowest : v;
  };
  std::partial_sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(count),
                    candidates.end(), [&](std::size_t a, std::size_t b) {
                      const double va = value(a), vb = value(b);
                      return va != vb ? va > vb : kept[a] < kept[b];
                    });
  for (std::size_t t = 0; t < count; ++t) fixed[candidates[t]] = true;
  return fixed;
}

/// Indices k with !fixed[k] (the free set U), ascending.
inline std::vector<Index> free_indices(const std::vector<bool>& fixed) {
  std::vector<Index> out;
  for (std::size_t k = 0; k < fixed.size(); ++k)
    if (!fixed[k]) out.push_back(static_cast<Index>(k));
  return out;
}

/// X = masked softmax(softcap(s·Q Kᵀ)) (R, m); a row that sees nothing is all zero. When `chain` is
/// given it receives ∂softcap/∂logit = 1 − tanh²(s·<q,k>/c) (R, m), all ones without soft-cap.
/// O(R·m·d).
template <class Real>
void probabilities(const RowMatrix<Real>& Q,  // (R, d)
                   const RowMatrix<Real>& K,  // (m, d)
                   const Attention& att, RowMatrix<Real>& probs, RowMatrix<Real>* chain = nullptr) {
  const Index R = Q.rows(), m = K.rows();
  KVC_ASSERT(static_cast<Index>(att.visible.size()) == R);
  probs.resize(R, m);
  probs.noalias() = static_cast<Real>(att.scale) * (Q * K.transpose());
  if (att.softcap > 0.0) {
    const Real c = static_cast<Real>(att.softcap);
    probs = (c * (probs.array() / c).tanh()).matrix();
    if (chain) *chain = (Real(1) - (probs.array() / c).square()).matrix();
  } else if (chain) {
    chain->setOnes(R, m);
  }
  for (Index r = 0; r < R; ++r) {
    const Index len = std::min<Index>(att.visible[static_cast<std::size_t>(r)], m);
    auto row = probs.row(r);
    if (len <= 0) {
      row.setZero();
      continue;
    }
    auto live = row.head(len).array();
    live = (live - live.maxCoeff()).exp();
    live *= Real(1) / live.sum();
    row.tail(m - len).setZero();
  }
}

/// f(K, V) = X·V (R, d), the attention outputs over the kept set. O(R·m·d).
template <class Real>
RowMatrix<Real> outputs(const RowMatrix<Real>& Q,  // (R, d)
                        const RowMatrix<Real>& K,  // (m, d)
                        const RowMatrix<Real>& V,  // (m, d)
                        const Attention& att) {
  RowMatrix<Real> X;
  probabilities(Q, K, att, X);
  return X * V;
}

/// ‖Y − f(K, V)‖_F / ‖Y‖_F (the absolute error when Y = 0), accumulated in double. O(R·m·d).
template <class Real>
double window_error(const RowMatrix<Real>& Q,  // (R, d)
                    const RowMatrix<Real>& K,  // (m, d)
                    const RowMatrix<Real>& V,  // (m, d)
                    const Attention& att,
                    const RowMatrix<Real>& Y) {  // (R, d)
  const RowMatrix<Real> f = outputs(Q, K, V, att);
  const double err = (Y.template cast<double>() - f.template cast<double>()).norm();
  const double ref = Y.template cast<double>().norm();
  return ref > 0.0 ? err / ref : err;
}

namespace detail {
/// (R, u) columns `free` of X, in double.
template <class Real>
Eigen::MatrixXd free_columns(const RowMatrix<Real>& X, const std::vector<Index>& free) {
  Eigen::MatrixXd XU(X.rows(), static_cast<Index>(free.size()));
  for (std::size_t k = 0; k < free.size(); ++k)
    XU.col(static_cast<Index>(k)) = X.col(free[k]).template cast<double>();
  return XU;
}
}  // namespace detail

/// Value step through the dual (Woodbury) form, SPEC §9:
///
///   V_U ← V_U⁰ + X_Uᵀ (X_U X_Uᵀ + λ I)⁻¹ (Y − X V⁰),   V_F ← V_F⁰
///
/// The (R, R) system is formed and solved in double by Cholesky (LDLT fallback): its eigenvalues lie
/// in [λ, λ + ‖X_U‖²] with ‖X_U‖² up to R, so with λ = 1e-2 the condition number reaches ~100·R, and the
/// residual Y − X V⁰ is a difference of nearly equal outputs; in float both would lose most of the
/// digits of the update. Inputs and result stay in Real. `V` may be the same object as `V0`. If the
/// solve fails (non-finite input) V = V⁰.
///
/// O(R²·u + R³/3 + R·m·d + R·u·d) time, O(R·(R + u + d)) memory.
template <class Real>
void value_step_dual(const RowMatrix<Real>& X,   // (R, m) probabilities at the current keys
                     const RowMatrix<Real>& V0,  // (m, d) original kept values
                     const RowMatrix<Real>& Y,   // (R, d) full-cache targets
                     const std::vector<Index>& free, double lambda,
                     RowMatrix<Real>& V) {  // (m, d) out
  const Eigen::MatrixXd XU = detail::free_columns(X, free);                           // (R, u)
  Eigen::MatrixXd Z = Y.template cast<double>() -
                      X.template cast<double>() * V0.template cast<double>();         // (R, d)
  Eigen::MatrixXd gram(X.rows(), X.rows());                                            // (R, R)
  gram.setZero();
  gram.template selfadjointView<Eigen::Lower>().rankUpdate(XU);
  gram.diagonal().array() += lambda;
  const bool solved = !free.empty() && linalg::solve_spd(gram, Z);
  if (&V != &V0) V = V0;
  if (!solved) return;
  const Eigen::MatrixXd delta = XU.transpose() * Z;  // (u, d)
  for (std::size_t k = 0; k < free.size(); ++k)
    V.row(free[k]) = (V0.row(free[k]).template cast<double>() + delta.row(static_cast<Index>(k)))
                         .template cast<Real>();
}

/// Value step in the primal form (SPEC §9), mathematically equal to value_step_dual:
///
///   V_U ← (X_Uᵀ X_U + λ I)⁻¹ (X_Uᵀ (Y − X_F V_F) + λ V_U⁰),   V_F ← V_F⁰
///
/// A (u, u) solve in double: cheaper than the dual when u < R. O(R·u² + u³/3 + R·m·d).
template <class Real>
void value_step_primal(const RowMatrix<Real>& X,   // (R, m)
                       const RowMatrix<Real>& V0,  // (m, d)
                       const RowMatrix<Real>& Y,   // (R, d)
                       const std::vector<Index>& free, double lambda,
                       RowMatrix<Real>& V) {  // (m, d) out
  const Index m = X.cols(), u = static_cast<Index>(free.size());
  std::vector<bool> is_free(static_cast<std::size_t>(m), false);
  for (Index k : free) is_free[static_cast<std::size_t>(k)] = true;
  Eigen::MatrixXd rest = Y.template cast<double>();  // (R, d)  Y − X_F V_F
  for (Index j = 0; j < m; ++j)
    if (!is_free[static_cast<std::size_t>(j)])
      rest.noalias() -= X.col(j).template cast<double>() * V0.row(j).template cast<double>();
  const Eigen::MatrixXd XU = detail::free_columns(X, free);  // (R, u)
  Eigen::MatrixXd rhs = XU.transpose() * rest;                // (u, d)
  for (Index k = 0; k < u; ++k)
    rhs.row(k) += lambda * V0.row(free[static_cast<std::size_t>(k)]).template cast<double>();
  Eigen::MatrixXd normal(u, u);  // (u, u)
  normal.setZero();
  normal.template selfadjointView<Eigen::Lower>().rankUpdate(XU.transpose());
  normal.diagonal().array() += lambda;
  const bool solved = u > 0 && linalg::solve_spd(normal, rhs);
  if (&V != &V0) V = V0;
  if (!solved) return;
  for (Index k = 0; k < u; ++k)
    V.row(free[static_cast<std::size_t>(k)]) = rhs.row(k).template cast<Real>();
}

/// The Jacobian J = ∂ vec f / ∂ vec K_U of f(K) = X(K)·V at fixed (K, V), kept implicitly: products with
/// J and Jᵀ cost O(R·u·d) each and J (R·d × u·d) is never formed.
template <class Real>
struct KeyJacobian {
  using ConstRef = Eigen::Ref<const RowMatrix<Real>>;

  RowMatrix<Real> queries;      // (R, d)  Q
  RowMatrix<Real> weights;      // (R, u)  s · X_U ⊙ (1 − tanh²): ∂ logit-before-softmax / ∂(s·q·k)
  RowMatrix<Real> free_values;  // (u, d)  V_U
  RowMatrix<Real> outputs;      // (R, d)  f = X·V

  Index rows() const { return queries.rows(); }
  Index dim() const { return queries.cols(); }
  Index free_count() const { return free_values.rows(); }
};

/// Linearises f at (K, V) for the free rows `free` of K. O(R·m·d).
template <class Real>
KeyJacobian<Real> key_jacobian(const RowMatrix<Real>& Q,  // (R, d)
                               const RowMatrix<Real>& K,  // (m, d) current keys
                               const RowMatrix<Real>& V,  // (m, d) current values
                               const Attention& att, const std::vector<Index>& free) {
  const Index R = Q.rows(), d = Q.cols(), u = static_cast<Index>(free.size());
  RowMatrix<Real> X, chain;  // (R, m)
  probabilities(Q, K, att, X, &chain);
  KeyJacobian<Real> jac;
  jac.queries = Q;
  jac.outputs.noalias() = X * V;
  jac.weights.resize(R, u);
  jac.free_values.resize(u, d);
  const Real s = static_cast<Real>(att.scale);
  for (Index k = 0; k < u; ++k) {
    const Index j = free[static_cast<std::size_t>(k)];
    jac.weights.col(k) = s * X.col(j).cwiseProduct(chain.col(j));
    jac.free_values.row(k) = V.row(j);
  }
  return jac;
}

/// JVP, Δf = J·ΔK_U (R, d) (SPEC §9):  ΔS = s·Q ΔKᵀ (⊙ (1 − tanh²) with soft-cap),
/// ΔA = A ⊙ (ΔS − rowsum(A ⊙ ΔS)), Δf = ΔA·V — evaluated as P = W ⊙ (Q ΔK_Uᵀ), Δf = P V_U − rowsum(P) ⊙ f
/// since ΔS vanishes outside U. O(2·R·u·d).
template <class Real>
void jvp(const KeyJacobian<Real>& jac, typename KeyJacobian<Real>::ConstRef dK,  // (u, d)
         RowMatrix<Real>& df) {                                                   // (R, d) out
  const RowMatrix<Real> P = jac.weights.cwiseProduct(jac.queries * dK.transpose());  // (R, u)
  const Vector<Real> mass = P.rowwise().sum();                                       // (R)
  df.noalias() = P * jac.free_values;
  df.noalias() -= mass.asDiagonal() * jac.outputs;
}

/// VJP, ΔK_U = Jᵀ·Γ (u, d) (SPEC §9):  ΔA' = Γ Vᵀ, ΔS' = A ⊙ (ΔA' − rowsum(A ⊙ ΔA')) (⊙ (1 − tanh²)),
/// ΔK_U = s·(ΔS'_U)ᵀ Q — with rowsum(A ⊙ Γ Vᵀ) = rowwise <Γ, f>. O(2·R·u·d).
template <class Real>
void vjp(const KeyJacobian<Real>& jac, typename KeyJacobian<Real>::ConstRef gamma,  // (R, d)
         RowMatrix<Real>& dK) {                                                       // (u, d) out
  const Vector<Real> t = gamma.cwiseProduct(jac.outputs).rowwise().sum();  // (R)
  RowMatrix<Real> M = gamma * jac.free_values.transpose();                 // (R, u)
  M.colwise() -= t;
  M.array() *= jac.weights.array();
  dK.noalias() = M.transpose() * jac.queries;
}

/// Outcome of one key step's CG solve.
struct KeyStepReport {
  Index iterations = 0;
  double residual = 0.0;  ///< final relative residual
  SolverStatus status = SolverStatus::not_run;
};

/// Key step (one linearised ridge step, SPEC §9) at the current keys K and values V:
///
///   e = vec(Y − f(K)),  g = vec(K_U − K_U⁰),  (J Jᵀ + λ I) α = e + J g  (CG, matrix-free),
///   K_U ← K_U⁰ + unvec(Jᵀ α),   K_F unchanged
///
/// The system has size R·d; on CG breakdown the last finite iterate α is used. O(R·m·d) plus
/// O(4·R·u·d) per CG iteration.
template <class Real>
KeyStepReport key_step(const RowMatrix<Real>& Q,   // (R, d)
                       const RowMatrix<Real>& K0,  // (m, d) original kept keys (the ridge anchor)
                       const RowMatrix<Real>& V,   // (m, d) current values
                       const RowMatrix<Real>& Y,   // (R, d)
                       const Attention& att, const std::vector<Index>& free, double lambda,
                       const typename ConjugateGradient<Real>::Arguments& cg_args,
                       RowMatrix<Real>& K) {  // (m, d) in: current keys, out: updated
  KeyStepReport report;
  const Index R = Q.rows(), d = Q.cols(), u = static_cast<Index>(free.size());
  if (u == 0) return report;
  const KeyJacobian<Real> jac = key_jacobian(Q, K, V, att, free);

  RowMatrix<Real> g(u, d);  // (u, d)  K_U − K_U⁰
  for (Index k = 0; k < u; ++k) {
    const Index j = free[static_cast<std::size_t>(k)];
    g.row(k) = K.row(j) - K0.row(j);
  }
  RowMatrix<Real> df;  // (R, d)
  jvp(jac, g, df);
  Vector<Real> rhs(R * d);  // (R·d)  e + J g
  Eigen::Map<RowMatrix<Real>>(rhs.data(), R, d) = Y - jac.outputs + df;

  const Real lam = static_cast<Real>(lambda);
  RowMatrix<Real> dk_buffer(u, d), df_buffer(R, d);
  const auto normal_operator = [&](const Vector<Real>& in, Vector<Real>& out) {
    vjp(jac, Eigen::Map<const RowMatrix<Real>>(in.data(), R, d), dk_buffer);
    jvp(jac, dk_buffer, df_buffer);
    out = Eigen::Map<const Vector<Real>>(df_buffer.data(), R * d) + lam * in;
  };
  ConjugateGradient<Real> cg(cg_args);
  Vector<Real> alpha = Vector<Real>::Zero(R * d);
  cg.solve(normal_operator, rhs, alpha);
  report.iterations = cg.iterations();
  report.residual = cg.error();
  report.status = cg.info();

  vjp(jac, Eigen::Map<const RowMatrix<Real>>(alpha.data(), R, d), dk_buffer);
  for (Index k = 0; k < u; ++k) {
    const Index j = free[static_cast<std::size_t>(k)];
    K.row(j) = K0.row(j) + dk_buffer.row(k);
  }
  return report;
}

namespace detail {
inline int severity(SolverStatus s) {
  switch (s) {
    case SolverStatus::not_run: return 0;
    case SolverStatus::converged: return 1;
    case SolverStatus::max_iterations: return 2;
    case SolverStatus::breakdown: return 3;
  }
  return 3;
}
}  // namespace detail

/// The whole per-head regression on dense data: `steps` alternations of the value and key steps in
/// `args.order`, anchored at the entry values K⁰ = K, V⁰ = V. Fills the ridge fields of `diag`:
/// window errors before/after, cg_iterations (sum over key steps), cg_residual (largest), cg_status
/// (worst: breakdown > max_iterations > converged), key_step_rejected (the safeguard undid a key step,
/// or a key step produced non-finite keys and was undone). An empty free set, steps = 0 or both steps
/// off leave K and V untouched.
template <class Real>
void regress(const RowMatrix<Real>& Q,  // (R, d) stacked group queries
             const RowMatrix<Real>& Y,  // (R, d) full-cache targets
             const Attention& att, const std::vector<Index>& free, const RidgeMerge::Arguments& args,
             RowMatrix<Real>& K,  // (m, d) in: K⁰, out: merged keys
             RowMatrix<Real>& V,  // (m, d) in: V⁰, out: merged values
             HeadDiagnostics& diag) {
  using Order = RidgeMerge::Arguments::Order;
  diag.cg_iterations = 0;
  diag.cg_residual = 0.0;
  diag.cg_status = SolverStatus::not_run;
  diag.key_step_rejected = false;
  diag.window_error_before = window_error(Q, K, V, att, Y);
  const bool active = !free.empty() && args.steps > 0 && (args.value_step || args.key_step);
  if (!active) {
    diag.window_error_after = diag.window_error_before;
    return;
  }

  const RowMatrix<Real> K0 = K, V0 = V;  // (m, d) ridge anchors
  RowMatrix<Real> X;                     // (R, m)
  const auto run_value_step = [&] {
    probabilities(Q, K, att, X);
    value_step_dual(X, V0, Y, free, args.lambda_v, V);
  };
  const auto run_key_step = [&] {
    const RowMatrix<Real> K_prev = K;
    const double err_prev = args.safeguard ? window_error(Q, K, V, att, Y) : 0.0;
    const KeyStepReport rep = key_step(Q, K0, V, Y, att, free, args.lambda_k,
                                       {args.cg_tolerance, args.cg_max_iterations}, K);
    diag.cg_iterations += rep.iterations;
    diag.cg_residual = std::max(diag.cg_residual, rep.residual);
    if (detail::severity(rep.status) > detail::severity(diag.cg_status)) diag.cg_status = rep.status;
    bool reject = !K.allFinite();
    if (!reject && args.safeguard) reject = !(window_error(Q, K, V, att, Y) < err_prev);
    if (reject) {
      K = K_prev;
      diag.key_step_rejected = true;
    }
  };
  for (Index step = 0; step < args.steps; ++step) {
    if (args.order == Order::value_then_key) {
      if (args.value_step) run_value_step();
      if (args.key_step) run_key_step();
    } else {
      if (args.key_step) run_key_step();
      if (args.value_step) run_value_step();
    }
  }
  diag.window_error_after = window_error(Q, K, V, att, Y);
}

}  // namespace ridge

// -------------------------------------------------------------------------------------------------
// RidgeMerge members
// -------------------------------------------------------------------------------------------------

inline Status RidgeMerge::validate(Index n, Index m) const {
  using detail::concat;
  const auto bad = [](const char* field, auto value, const char* rule) {
    return Status::fail(Status::Code::invalid_argument,
                        concat("RidgeMerge.", field, " must be ", rule, ", got ", value));
  };
  if (n <= 0)
    return Status::fail(Status::Code::invalid_shape, concat("RidgeMerge: n must be positive, got ", n));
  if (m <= 0)
    return Status::fail(Status::Code::invalid_budget, concat("RidgeMerge: m must be positive, got ", m));
  if (!(args.lambda_v > 0.0) || !std::isfinite(args.lambda_v))
    return bad("lambda_v", args.lambda_v, "finite and > 0");
  if (!(args.lambda_k > 0.0) || !std::isfinite(args.lambda_k))
    return bad("lambda_k", args.lambda_k, "finite and > 0");
  if (!(args.beta >= 0.0 && args.beta <= 1.0)) return bad("beta", args.beta, "in [0, 1]");
  if (args.sinks < 0) return bad("sinks", args.sinks, ">= 0");
  if (args.steps < 0) return bad("steps", args.steps, ">= 0");
  if (args.order != Arguments::Order::value_then_key && args.order != Arguments::Order::key_then_value)
    return bad("order", static_cast<int>(args.order), "value_then_key or key_then_value");
  if (!(args.cg_tolerance >= 0.0) || !std::isfinite(args.cg_tolerance))
    return bad("cg_tolerance", args.cg_tolerance, "finite and >= 0");
  if (args.cg_max_iterations < 0) return bad("cg_max_iterations", args.cg_max_iterations, ">= 0");
  return Status::ok();
}

template <class T>
void RidgeMerge::merge(const HeadContext<T>& ctx, const Routing& /*routing: unused*/,
                       MergeOutput<compute_t<T>>& out) const {
  static_assert(is_element_type_v<T>,
                "RidgeMerge::merge: the element type must be float, double, Eigen::half or "
                "Eigen::bfloat16");
  using Real = compute_t<T>;
  const LayerView<T>& layer = ctx.layer();
  const Index g = ctx.head(), n = ctx.tokens(), W = ctx.window(), G = ctx.group_size(),
              d = ctx.head_dim();
  const std::vector<Index>& kept = ctx.kept();
  const Index m = static_cast<Index>(kept.size());
  KVC_ASSERT(out.keys.rows() == m && out.values.rows() == m && out.keys.cols() == d);

  out.gate.setZero(n - m);
  HeadDiagnostics& diag = out.diagnostics;
  diag.kept = m;
  diag.evicted = n - m;
  diag.merged = 0;
  diag.dropped = n - m;
  diag.gate_mean = 0.0;

  const RowMatrix<Real> Q = gather_group_queries<Real>(layer, g);  // (R, d), R = G·W
  const RowMatrix<Real>& A = ctx.probabilities();                  // (R, n)
  RowMatrix<Real> Y(Q.rows(), d);                                  // (R, d)  Y = A_full · V
  if constexpr (std::is_same_v<T, Real>) {
    Y.noalias() = A * kvc::detail::map_rows<Real>(layer.values, g, 0, n);
  } else {
    Y.setZero();
    RowMatrix<Real> tile(std::min<Index>(kvc::detail::kKeyTile, n), d);
    for (Index j0 = 0; j0 < n; j0 += kvc::detail::kKeyTile) {
      const Index count = std::min<Index>(kvc::detail::kKeyTile, n - j0);
      auto rows = tile.topRows(count);
      kvc::detail::gather_rows<Real>(layer.values, g, j0, count, rows);
      Y.noalias() += A.middleCols(j0, count) * rows;
    }
  }

  ridge::Attention att;
  att.visible = ridge::visible_counts(kept, n, W, G);
  att.scale = ctx.attention().resolved_scale(d);
  att.softcap = ctx.attention().softcap;
  const Vector<Real>& score = ctx.score().size() == n ? ctx.score() : ctx.mass();
  std::vector<Index> free;  // nothing evicted: identity (SPEC §3)
  if (m < n) free = ridge::free_indices(ridge::fixed_mask(kept, n, W, args.sinks, args.beta, score));
  ridge::regress(Q, Y, att, free, args, out.keys, out.values, diag);
}

}  // namespace kvc
