// GRKV ridge merge (SPEC §9): re-fit the kept values, then keys, so the compressed cache reproduces
// the full cache's window attention outputs.
#pragma once

#include "kvcompress/core.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE
#include "kvcompress/linalg/conjugate_gradient.hpp"
#include "kvcompress/linalg/dense_solve.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <array>
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
/// with X = masked softmax(s·Qw K_Sᵀ) over the kept set S and f(K) = X·V. By default
/// (lambda_mode = holdout, our extension) both steps are fitted on three quarters of the window rows:
/// λ_v and the key step's length are chosen per head by the error on the other quarter, and a step
/// that does not lower it is undone (ridge::regress_holdout). lambda_mode = fixed is the papers' λ.
/// The fixed entries F (sinks, window positions, the top ⌈β·|S \ window|⌉ non-window entries by
/// score) come out bit-identical. The building blocks are the free functions in `kvc::ridge` below.
///
/// Cost per head and step, R = G·W rows, m kept, u = |U|, d head dimension:
///   value step O(R²·u + R³ + R·m·d); key step O(R·m·d) to linearise plus, per CG iteration, one JVP and
///   one VJP fused into three (R×d×u)-sized products (R <= 2d; u <= m). Y = A_full·V costs one R×n×d
///   product when the caller hands it over (HeadContext's window_outputs), else the window attention
///   again (two R×n×d products, fused per key tile). Memory O(R·(m + d)) plus O(R·n) only when the
///   context already holds the probabilities.
struct RidgeMerge {
  /// Reads HeadContext::window_outputs() (Y = A·V): a pipeline that still holds the scorer's window
  /// exponentials of the head can form Y with one product and hand it to the context, which saves
  /// the merger a second window attention pass.
  struct traits : PolicyTraits {
    static constexpr bool needs_window_outputs = true;
  };

  struct Arguments {
    double lambda_v = 1e-2;  ///< ridge weight of the value step (> 0; lambda_mode fixed)
    double lambda_k = 1e-2;  ///< ridge weight of the key step (> 0)
    double beta = 0.1;       ///< share of kept non-window entries fixed by score, in [0, 1]
    Index sinks = 4;         ///< kept positions < sinks are fixed
    Index steps = 1;         ///< alternations S (0 = identity)
    enum class Order { value_then_key, key_then_value } order = Order::value_then_key;
    bool value_step = true;
    bool key_step = true;
    double cg_tolerance = 1e-6;       ///< relative residual of the key-step CG
    Index cg_max_iterations = 100;    ///< CG iteration budget per key step
    /// How λ_v is set (our extension). `fixed`: lambda_v, every window row fitted (the papers'
    /// setting). `holdout`: the window rows are split into fit and check rows (holdout_every); λ_v is
    /// the value of lambda_grid whose value step, fitted on the fit rows, leaves the smallest error on
    /// the check rows, and the key step's length is chosen from {1, 1/2, 1/4} the same way.
    enum class LambdaMode { fixed, holdout } lambda_mode = LambdaMode::holdout;
    std::array<double, 4> lambda_grid = {1e-3, 1e-2, 1e-1, 1.0};  ///< holdout: λ_v candidates (> 0)
    Index holdout_every = 4;  ///< holdout: every k-th window position, counting back from the last, is checked
    /// holdout: keep a value or key step only if it lowers the check rows' error ‖Y_C − f_C‖; fixed: keep
    /// a key step only if it lowers the whole window's error ‖Y − f(K)‖.
    bool safeguard = true;
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

/// How the R stacked window rows attend over the kept set: logits softcap(scale·<q_r, k_j>) + bias_j
/// for the first `visible[r]` kept entries (a causal prefix, since kept positions ascend), nothing
/// beyond. bias_j: the kept entry's stored bias (a view compressed before); empty = 0. It is a
/// constant per column, so the Jacobians (which differentiate the soft-cap only) are unchanged.
struct Attention {
  std::vector<Index> visible;  // (R)
  double scale = 1.0;
  double softcap = 0.0;  ///< 0 = off
  std::vector<double> bias{};  ///< (m) or empty
  Index window = 0;  ///< W: the rows are G·W, row r at window position r % W; 0 = one query head (W = R)
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

/// X = masked softmax(softcap(s·Q Kᵀ) + bias) (R, m); a row that sees nothing is all zero. When `chain` is
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
  if (!att.bias.empty()) {
    KVC_ASSERT(static_cast<Index>(att.bias.size()) == m);
    for (Index r = 0; r < R; ++r)
      for (Index j = 0; j < m; ++j) probs(r, j) += static_cast<Real>(att.bias[static_cast<std::size_t>(j)]);
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
/// Whether every entry of the row-major matrix m is below `limit` in magnitude (false for NaN), read
/// in storage order: Eigen 3.4's all() walks column by column, one row stride per entry here. Its
/// finite-only twin is kvc::detail::row_finite over m.data().
template <class Real>
bool all_below(const RowMatrix<Real>& m, Real limit) {
  return (Eigen::Map<const Eigen::Array<Real, Eigen::Dynamic, 1>>(m.data(), m.size()).abs() < limit).all();
}

/// (R, u) columns `free` of X, in double.
template <class Real>
Eigen::MatrixXd free_columns(const RowMatrix<Real>& X, const std::vector<Index>& free) {
  Eigen::MatrixXd XU(X.rows(), static_cast<Index>(free.size()));
  for (std::size_t k = 0; k < free.size(); ++k)
    XU.col(static_cast<Index>(k)) = X.col(free[k]).template cast<double>();
  return XU;
}

/// out (R, u) = the columns `free` (ascending) of X, gathered row by row (contiguous writes). O(R·u).
template <class Real>
void gather_columns(const RowMatrix<Real>& X, const std::vector<Index>& free, RowMatrix<Real>& out) {
  const Index R = X.rows(), m = X.cols(), u = static_cast<Index>(free.size());
  out.resize(R, u);
  for (Index r = 0; r < R; ++r) {
    const Real* x = X.data() + r * m;
    Real* o = out.data() + r * u;
    for (Index k = 0; k < u; ++k) o[k] = x[free[static_cast<std::size_t>(k)]];
  }
}

/// The value step's dual system in double (SPEC §9): Z = Y − X V⁰ (R, d) and gram = X_U X_Uᵀ + λ I
/// (R, R; lower triangle), streamed over chunks of kept columns cast to double, so no (R, m) double copy
/// exists. Products of two floats are exact in double: both are accurate to double rounding.
/// O(R·m·d + R²·u/2) double multiply-adds, O(R·(R + d) + chunk·(R + d)) memory.
template <class Real>
void dual_system(const RowMatrix<Real>& X,   // (R, m)
                 const RowMatrix<Real>& V0,  // (m, d)
                 const RowMatrix<Real>& Y,   // (R, d)
                 const std::vector<Index>& free, double lambda, Eigen::MatrixXd& gram, Eigen::MatrixXd& Z) {
  constexpr Index kChunk = 128;  // kept columns per chunk: (R, chunk) and (chunk, d) doubles stay in L2
  const Index R = X.rows(), m = X.cols(), d = V0.cols();
  Z = Y.template cast<double>();
  gram.setZero(R, R);
  const Index width = std::min(kChunk, m);
  Eigen::MatrixXd xc(R, width), xu(R, width);                                 // (R, chunk)
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> vc(width, d);  // (chunk, d)
  std::size_t next = 0;  // first free index not yet in gram
  for (Index j0 = 0; j0 < m; j0 += kChunk) {
    const Index c = std::min(kChunk, m - j0);
    xc.leftCols(c) = X.middleCols(j0, c).template cast<double>();
    vc.topRows(c) = V0.middleRows(j0, c).template cast<double>();
    Z.noalias() -= xc.leftCols(c) * vc.topRows(c);
    Index cu = 0;
    for (; next < free.size() && free[next] < j0 + c; ++next) xu.col(cu++) = xc.col(free[next] - j0);
    if (cu > 0) gram.template selfadjointView<Eigen::Lower>().rankUpdate(xu.leftCols(cu));
  }
  gram.diagonal().array() += lambda;
}

/// V_U ← V_U⁰ + X_Uᵀ·sol, V_F ← V_F⁰, with XU (R, u) the free columns of X and sol (R, d) the dual
/// solution. The product is in Real: it is well conditioned (X ≥ 0, rows sum to <= 1) and its rounding
/// is that of the stored result. `V` may be the same object as `V0`. Returns false, and writes
/// nothing, when a new row has an entry that is not below `limit` in magnitude (Inf, NaN, or beyond the
/// cache's element type: see kvc::detail::overflow_limit). O(R·u·d).
template <class Real>
bool apply_value_update(const RowMatrix<Real>& XU, const Eigen::MatrixXd& sol, const RowMatrix<Real>& V0,
                        const std::vector<Index>& free, RowMatrix<Real>& V,
                        Real limit = std::numeric_limits<Real>::infinity()) {
  const RowMatrix<Real> z = sol.template cast<Real>();  // (R, d)
  RowMatrix<Real> rows = XU.transpose() * z;            // (u, d)  the update, then V_U⁰ + update
  for (std::size_t k = 0; k < free.size(); ++k) rows.row(static_cast<Index>(k)) += V0.row(free[k]);
  if (!detail::all_below(rows, limit)) return false;
  if (&V != &V0) V = V0;
  for (std::size_t k = 0; k < free.size(); ++k) V.row(free[k]) = rows.row(static_cast<Index>(k));
  return true;
}
}  // namespace detail

/// Value step through the dual (Woodbury) form, SPEC §9:
///
///   V_U ← V_U⁰ + X_Uᵀ (X_U X_Uᵀ + λ I)⁻¹ (Y − X V⁰),   V_F ← V_F⁰
///
/// The (R, R) system and its right-hand side are formed and solved in double by Cholesky (LDLT
/// fallback): its eigenvalues lie in [λ, λ + ‖X_U‖²] with ‖X_U‖² up to R, so with λ = 1e-2 the
/// condition number reaches ~100·R, and the residual Y − X V⁰ is a difference of nearly equal outputs;
/// in float both would lose most of the digits of the update. The final product X_Uᵀ·solution is in
/// Real (detail::apply_value_update). Inputs and result stay in Real. `V` may be the same object as
/// `V0`. If the solve fails (non-finite input) or a new entry is not below `limit` in magnitude
/// (non-finite, or beyond the cache's element type) V = V⁰ and false is returned.
///
/// O(R²·u/2 + R³/3 + R·m·d) double and O(R·u·d) Real time, O(R·(R + u + d)) memory.
template <class Real>
bool value_step_dual(const RowMatrix<Real>& X,   // (R, m) probabilities at the current keys
                     const RowMatrix<Real>& V0,  // (m, d) original kept values
                     const RowMatrix<Real>& Y,   // (R, d) full-cache targets
                     const std::vector<Index>& free, double lambda,
                     RowMatrix<Real>& V,  // (m, d) out
                     Real limit = std::numeric_limits<Real>::infinity()) {
  bool solved = false;
  Eigen::MatrixXd gram, Z;  // (R, R), (R, d)
  if (!free.empty()) {
    detail::dual_system(X, V0, Y, free, lambda, gram, Z);
    solved = linalg::solve_spd(gram, Z);
  }
  RowMatrix<Real> XU;  // (R, u)
  if (solved) detail::gather_columns(X, free, XU);
  if (!solved || !detail::apply_value_update(XU, Z, V0, free, V, limit)) {
    if (&V != &V0) V = V0;
    return false;
  }
  return true;
}

/// Value step in the primal form (SPEC §9), mathematically equal to value_step_dual:
///
///   V_U ← (X_Uᵀ X_U + λ I)⁻¹ (X_Uᵀ (Y − X_F V_F) + λ V_U⁰),   V_F ← V_F⁰
///
/// A (u, u) solve in double: cheaper than the dual when u < R. O(R·u² + u³/3 + R·m·d). As
/// value_step_dual, V = V⁰ and false when the solve fails or a new entry is not below `limit`.
template <class Real>
bool value_step_primal(const RowMatrix<Real>& X,   // (R, m)
                       const RowMatrix<Real>& V0,  // (m, d)
                       const RowMatrix<Real>& Y,   // (R, d)
                       const std::vector<Index>& free, double lambda,
                       RowMatrix<Real>& V,  // (m, d) out
                       Real limit = std::numeric_limits<Real>::infinity()) {
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
  if (!solved) return false;
  const RowMatrix<Real> rows = rhs.template cast<Real>();  // (u, d)
  if (!detail::all_below(rows, limit)) return false;
  for (Index k = 0; k < u; ++k) V.row(free[static_cast<std::size_t>(k)]) = rows.row(k);
  return true;
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

namespace detail {
/// KeyJacobian from a linearisation point already evaluated: XU (R, u) the free columns of the
/// probabilities X (taken over: it becomes the weights in place), chain (R, m) the soft-cap slope
/// (nullptr without soft-cap), f = X·V (R, d). O(R·u + u·d).
template <class Real>
KeyJacobian<Real> jacobian_from(const RowMatrix<Real>& Q, RowMatrix<Real> XU, const RowMatrix<Real>* chain,
                                const RowMatrix<Real>& V, RowMatrix<Real> f, const Attention& att,
                                const std::vector<Index>& free) {
  const Index R = Q.rows(), d = Q.cols(), u = static_cast<Index>(free.size());
  KVC_ASSERT(XU.rows() == R && XU.cols() == u);
  KeyJacobian<Real> jac;
  jac.queries = Q;
  jac.outputs = std::move(f);
  const Real s = static_cast<Real>(att.scale);
  jac.weights = std::move(XU);
  for (Index r = 0; r < R; ++r) {
    Real* w = jac.weights.data() + r * u;
    if (chain) {
      const Real* c = chain->data() + r * chain->cols();
      for (Index k = 0; k < u; ++k) w[k] = s * (w[k] * c[free[static_cast<std::size_t>(k)]]);
    } else {
      for (Index k = 0; k < u; ++k) w[k] = s * w[k];
    }
  }
  jac.free_values.resize(u, d);
  for (Index k = 0; k < u; ++k) jac.free_values.row(k) = V.row(free[static_cast<std::size_t>(k)]);
  return jac;
}
}  // namespace detail

/// Linearises f at (K, V) for the free rows `free` of K. O(R·m·d).
template <class Real>
KeyJacobian<Real> key_jacobian(const RowMatrix<Real>& Q,  // (R, d)
                               const RowMatrix<Real>& K,  // (m, d) current keys
                               const RowMatrix<Real>& V,  // (m, d) current values
                               const Attention& att, const std::vector<Index>& free) {
  const bool capped = att.softcap > 0.0;
  RowMatrix<Real> X, chain, XU;  // (R, m), (R, m) with soft-cap only, (R, u)
  probabilities(Q, K, att, X, capped ? &chain : nullptr);
  detail::gather_columns(X, free, XU);
  RowMatrix<Real> f = X * V;  // (R, d)
  return detail::jacobian_from(Q, std::move(XU), capped ? &chain : nullptr, V, std::move(f), att, free);
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

namespace detail {
/// The key step's normal operator Γ ↦ (J Jᵀ + λ I) Γ on (R, d) matrices, the VJP and the JVP fused:
///
///   M' = W ⊙ (Γ V_Uᵀ − rowsum(Γ ⊙ f) 1ᵀ)   (R, u)   the VJP is ΔK_U = M'ᵀ Q
///   P  = W ⊙ (Q Qᵀ M')                       (R, u)   = W ⊙ (Q ΔK_Uᵀ), the JVP's logit change
///   out = P V_U − rowsum(P) ⊙ f + λ Γ
///
/// With R <= 2d the (R, R) Gram matrix Q Qᵀ turns the two (R×d×u) products through ΔK_U into one
/// (R×R×u): three products per application instead of four (R = d = 128 for Llama-style GQA). Buffers
/// are allocated once. `last_vjp()` is M' of the last application, so Jᵀ of a CG iterate can be
/// accumulated step by step (Jᵀ x = (Σ a·M')ᵀ Q) instead of paying a VJP at the end.
template <class Real>
class KeyNormalOperator {
 public:
  KeyNormalOperator(const KeyJacobian<Real>& jac, double lambda)
      : jac_(jac), lambda_(static_cast<Real>(lambda)), use_gram_(jac.rows() <= 2 * jac.dim()) {
    const Index R = jac.rows(), u = jac.free_count();
    if (use_gram_) gram_.noalias() = jac.queries * jac.queries.transpose();  // (R, R)
    M_.resize(R, u);
    N_.resize(R, u);
    t_.resize(R);
    mass_.resize(R);
  }

  /// out = (J Jᵀ + λ I)·in, both (R, d) row-major (R·d contiguous values).
  void apply(const Real* in, Real* out) {
    const Index R = jac_.rows(), d = jac_.dim();
    const Eigen::Map<const RowMatrix<Real>> gamma(in, R, d);
    Eigen::Map<RowMatrix<Real>> result(out, R, d);
    const RowMatrix<Real>& f = jac_.outputs;
    const RowMatrix<Real>& W = jac_.weights;
    const RowMatrix<Real>& VU = jac_.free_values;
    t_.noalias() = gamma.cwiseProduct(f).rowwise().sum();
    M_.noalias() = gamma * VU.transpose();
    for (Index r = 0; r < R; ++r) M_.row(r).array() = (M_.row(r).array() - t_[r]) * W.row(r).array();
    if (use_gram_) {
      N_.noalias() = gram_ * M_;
    } else {
      dK_.noalias() = M_.transpose() * jac_.queries;  // (u, d)
      N_.noalias() = jac_.queries * dK_.transpose();
    }
    for (Index r = 0; r < R; ++r) {
      N_.row(r).array() *= W.row(r).array();
      mass_[r] = N_.row(r).sum();
    }
    result.noalias() = N_ * VU;
    for (Index r = 0; r < R; ++r) result.row(r) += lambda_ * gamma.row(r) - mass_[r] * f.row(r);
  }

  /// (R, u) M' of the last apply(): Jᵀ·in = M'ᵀ Q.
  const RowMatrix<Real>& last_vjp() const { return M_; }

 private:
  const KeyJacobian<Real>& jac_;
  Real lambda_;
  bool use_gram_;
  RowMatrix<Real> gram_;     // (R, R) Q Qᵀ
  RowMatrix<Real> M_, N_;    // (R, u)
  RowMatrix<Real> dK_;       // (u, d), only when R > 2d
  Vector<Real> t_, mass_;    // (R)
};

/// The key step at a linearisation `jac` (at the current keys K) with e = Y − f(K) (R, d), SPEC §9.
/// `K0` may be the same object as `K` (anchor = current keys). With `finite` given, new rows with an
/// entry not below `limit` in magnitude (non-finite, or beyond the cache's element type) are not
/// written (K unchanged, *finite = false); without it K is written in any case.
template <class Real>
KeyStepReport key_step_at(const KeyJacobian<Real>& jac, const RowMatrix<Real>& e,
                          const RowMatrix<Real>& K0, const std::vector<Index>& free, double lambda,
                          const typename ConjugateGradient<Real>::Arguments& cg_args, RowMatrix<Real>& K,
                          bool* finite = nullptr, Real limit = std::numeric_limits<Real>::infinity()) {
  KeyStepReport report;
  const Index R = jac.rows(), d = jac.dim(), u = jac.free_count();
  Vector<Real> rhs(R * d);  // (R·d)  e + J g
  Eigen::Map<RowMatrix<Real>> rhs_matrix(rhs.data(), R, d);
  rhs_matrix = e;
  bool moved = false;  // g = K_U − K_U⁰ ≠ 0 (NaN counts as moved)
  if (&K0 != &K)
    for (Index k = 0; k < u && !moved; ++k) {
      const Index j = free[static_cast<std::size_t>(k)];
      moved = (K.row(j).array() != K0.row(j).array()).any();
    }
  if (moved) {  // J·0 = 0: the first key step from the anchor skips this JVP
    RowMatrix<Real> g(u, d);  // (u, d)  K_U − K_U⁰
    for (Index k = 0; k < u; ++k) {
      const Index j = free[static_cast<std::size_t>(k)];
      g.row(k) = K.row(j) - K0.row(j);
    }
    RowMatrix<Real> df;  // (R, d)
    jvp(jac, g, df);
    rhs_matrix += df;
  }

  KeyNormalOperator<Real> op(jac, lambda);
  RowMatrix<Real> accumulated = RowMatrix<Real>::Zero(R, u);  // (R, u) Σ a·M' over CG steps
  ConjugateGradient<Real> cg(cg_args);
  Vector<Real> alpha = Vector<Real>::Zero(R * d);
  cg.solve([&](const Vector<Real>& in, Vector<Real>& out) { op.apply(in.data(), out.data()); }, rhs, alpha,
           [&](Real a) { accumulated.noalias() += a * op.last_vjp(); });
  report.iterations = cg.iterations();
  report.residual = cg.error();
  report.status = cg.info();

  RowMatrix<Real> rows = accumulated.transpose() * jac.queries;  // (u, d)  Jᵀ α, then K_U⁰ + Jᵀ α
  for (Index k = 0; k < u; ++k) rows.row(k) += K0.row(free[static_cast<std::size_t>(k)]);
  const bool ok = detail::all_below(rows, limit);
  if (finite) *finite = ok;
  if (ok || !finite)
    for (Index k = 0; k < u; ++k) K.row(free[static_cast<std::size_t>(k)]) = rows.row(k);
  return report;
}
}  // namespace detail

/// Key step (one linearised ridge step, SPEC §9) at the current keys K and values V:
///
///   e = vec(Y − f(K)),  g = vec(K_U − K_U⁰),  (J Jᵀ + λ I) α = e + J g  (CG, matrix-free),
///   K_U ← K_U⁰ + unvec(Jᵀ α),   K_F unchanged
///
/// The system has size R·d; on CG breakdown the last finite iterate α is used. Each CG iteration
/// applies J Jᵀ fused (detail::KeyNormalOperator: three (R×d×u)-sized products when R <= 2d, four
/// otherwise); Jᵀ α is accumulated along the iterations. O(R·m·d) to linearise plus O(3·R·u·d) per
/// CG iteration.
template <class Real>
KeyStepReport key_step(const RowMatrix<Real>& Q,   // (R, d)
                       const RowMatrix<Real>& K0,  // (m, d) original kept keys (the ridge anchor)
                       const RowMatrix<Real>& V,   // (m, d) current values
                       const RowMatrix<Real>& Y,   // (R, d)
                       const Attention& att, const std::vector<Index>& free, double lambda,
                       const typename ConjugateGradient<Real>::Arguments& cg_args,
                       RowMatrix<Real>& K) {  // (m, d) in: current keys, out: updated
  if (free.empty()) return {};
  const KeyJacobian<Real> jac = key_jacobian(Q, K, V, att, free);
  const RowMatrix<Real> e = Y - jac.outputs;  // (R, d)
  return detail::key_step_at(jac, e, K0, free, lambda, cg_args, K);
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

/// The holdout split of the G·W stacked window rows (row r = h·W + i): window position i is a check
/// row when (W − 1 − i) % every == 0, so the last position is always checked; the rest are fit rows.
/// Both lists ascend. W < 2 (or every < 2) leaves no fit row beside a check row: `check` is empty.
inline void holdout_rows(Index W, Index G, Index every, std::vector<Index>& fit, std::vector<Index>& check) {
  fit.clear();
  check.clear();
  if (W < 2 || every < 2) return;
  for (Index r = 0; r < G * W; ++r) ((W - 1 - r % W) % every == 0 ? check : fit).push_back(r);
}

namespace detail {
/// Rows `rows` of M.
template <class Real>
RowMatrix<Real> take_rows(const RowMatrix<Real>& M, const std::vector<Index>& rows) {
  RowMatrix<Real> out(static_cast<Index>(rows.size()), M.cols());
  for (std::size_t k = 0; k < rows.size(); ++k) out.row(static_cast<Index>(k)) = M.row(rows[k]);
  return out;
}

inline Attention take_rows(const Attention& att, const std::vector<Index>& rows) {
  Attention out = att;
  out.visible.resize(rows.size());
  for (std::size_t k = 0; k < rows.size(); ++k) out.visible[k] = att.visible[static_cast<std::size_t>(rows[k])];
  return out;
}

}  // namespace detail

/// regress() with lambda_mode = holdout (fit / check split from holdout_rows, `check` not empty).
/// Value step, with Z_F = Y_F − X_F V⁰ and Z_C = Y_C − X_C V⁰: for each λ of lambda_grid the value step
/// on the fit rows, ΔV_U(λ) = (X_FUᵀ X_FU + λ I)⁻¹ X_FUᵀ Z_F = X_FUᵀ (X_FU X_FUᵀ + λ I)⁻¹ Z_F (primal
/// when u < R_F, else dual), and its check residual Z_C − X_CU ΔV_U(λ); the λ with the smallest
/// residual norm is taken (ties to the larger λ) and V_U ← V_U⁰ + ΔV_U(λ). One Gram matrix serves the
/// grid. Key step: the key step of SPEC §9 on the fit rows (CG at lambda_k) gives K¹; of
/// K + t·(K¹ − K), t ∈ {1, 1/2, 1/4}, the smallest check error is taken (ties to the longer step).
/// With `safeguard` a step whose check error ‖Y_C − X_C(K) V‖ is not below the one before it is
/// undone (value_step_rejected / key_step_rejected, key_step_length 0); so the check error after the
/// merge never exceeds the eviction's. Check errors are formed in double.
///
/// Cost against the fixed mode (value then key, S = 1): the fixed mode's products on the R_F fit rows
/// (CG included) and on the R_C = R − R_F check rows once more for Z_C, plus the check rows' outputs
/// at the three key candidates (six R_C×m×d products) and |grid| Cholesky solves of size min(u, R_F).
template <class Real>
void regress_holdout(const RowMatrix<Real>& Q, const RowMatrix<Real>& Y, const Attention& att,
                     const std::vector<Index>& free, const RidgeMerge::Arguments& args,
                     const std::vector<Index>& fit_rows, const std::vector<Index>& check_rows, RowMatrix<Real>& K,
                     RowMatrix<Real>& V, HeadDiagnostics& diag, Real limit) {
  using Order = RidgeMerge::Arguments::Order;
  const bool capped = att.softcap > 0.0;
  const RowMatrix<Real> QF = detail::take_rows(Q, fit_rows), YF = detail::take_rows(Y, fit_rows);    // (R_F, d)
  const RowMatrix<Real> QC = detail::take_rows(Q, check_rows), YC = detail::take_rows(Y, check_rows);  // (R_C, d)
  const Attention attF = detail::take_rows(att, fit_rows), attC = detail::take_rows(att, check_rows);
  const Eigen::MatrixXd YC_d = YC.template cast<double>();  // (R_C, d)
  const Index RF = static_cast<Index>(fit_rows.size()), u = static_cast<Index>(free.size());
  const double y_norm = Y.template cast<double>().norm();
  const auto relative = [&](double err) { return y_norm > 0.0 ? err / y_norm : err; };
  const auto residual = [&](const RowMatrix<Real>& XC_, const RowMatrix<Real>& V_) {  // Y_C − X_C V in double
    return Eigen::MatrixXd(YC_d - XC_.template cast<double>() * V_.template cast<double>());
  };

  // Known at the current (K, V); invalidated when K or V changes.
  RowMatrix<Real> XF, chainF, XFU, XC;  // (R_F, m), (R_F, m) capped only, (R_F, u), (R_C, m)
  bool have_xf = false, have_xfu = false, have_xc = false;
  RowMatrix<Real> fF;  // (R_F, d) X_F·V
  Eigen::MatrixXd EF;  // (R_F, d) Y_F − f_F in double
  bool have_f = false;
  double check_err = 0.0;  // ‖Y_C − X_C V‖
  bool have_check = false;
  const auto ensure_xf = [&] {
    if (have_xf) return;
    probabilities(QF, K, attF, XF, capped ? &chainF : nullptr);
    have_xf = true;
    have_xfu = false;
  };
  const auto ensure_xfu = [&] {
    ensure_xf();
    if (!have_xfu) detail::gather_columns(XF, free, XFU);
    have_xfu = true;
  };
  const auto ensure_f = [&] {
    if (have_f) return;
    ensure_xf();
    fF.noalias() = XF * V;
    EF = YF.template cast<double>() - fF.template cast<double>();
    have_f = true;
  };
  const auto ensure_xc = [&] {
    if (!have_xc) probabilities(QC, K, attC, XC);
    have_xc = true;
  };
  const auto checked = [&] {
    if (!have_check) {
      ensure_xc();
      check_err = residual(XC, V).norm();
    }
    have_check = true;
    return check_err;
  };
  const auto whole_error = [&] {
    ensure_f();
    const double c = checked();
    return relative(std::sqrt(EF.squaredNorm() + c * c));
  };

  const bool single = args.steps == 1;
  RowMatrix<Real> K0_copy, V0_copy;
  if (!single) {
    K0_copy = K;
    V0_copy = V;
  }
  const RowMatrix<Real>& K0 = single ? K : K0_copy;
  const RowMatrix<Real>& V0 = single ? V : V0_copy;
  bool before_pending = true;  // window_error_before not yet recorded (K = K⁰, V = V⁰)

  const auto run_value_step = [&] {
    ensure_xf();
    ensure_xc();
    const bool primal = u < RF;
    Eigen::MatrixXd gram, ZF;  // (R_F, R_F) lower (dual only), (R_F, d)
    detail::dual_system(XF, V0, YF, primal ? std::vector<Index>{} : free, 0.0, gram, ZF);
    const Eigen::MatrixXd ZC = residual(XC, V0);  // (R_C, d)
    const bool at_anchor = before_pending || &V == &V0;  // V = V⁰: Z_C is the check residual
    if (before_pending) {
      diag.window_error_before = relative(std::sqrt(ZF.squaredNorm() + ZC.squaredNorm()));
      before_pending = false;
    }
    const double before = at_anchor ? ZC.norm() : checked();
    const Eigen::MatrixXd XFU_d = detail::free_columns(XF, free), XCU_d = detail::free_columns(XC, free);
    Eigen::MatrixXd N, B, P;  // primal: (u, u) lower, (u, d); dual: (R_C, R_F)
    if (primal) {
      N.setZero(u, u);
      N.template selfadjointView<Eigen::Lower>().rankUpdate(XFU_d.transpose());
      B = XFU_d.transpose() * ZF;
    } else {
      P = XCU_d * XFU_d.transpose();
    }
    Eigen::MatrixXd A, D, R, best_D;  // D: primal ΔV_U (u, d), dual S (R_F, d)
    double best_lambda = 0.0, best = std::numeric_limits<double>::infinity();
    for (const double lambda : args.lambda_grid) {
      A = primal ? N : gram;
      A.diagonal().array() += lambda;
      D = primal ? B : ZF;
      if (!linalg::solve_spd(A, D)) continue;
      R = ZC;  // Z_C − X_CU ΔV_U(λ)
      if (primal)
        R.noalias() -= XCU_d * D;
      else
        R.noalias() -= P * D;
      const double e = R.norm();
      if (e <= best) {
        best = e;
        best_lambda = lambda;
        best_D = D;
      }
    }
    diag.lambda_v = best_lambda;
    check_err = before;
    have_check = true;
    const bool reject = best_D.size() == 0 || (args.safeguard && !(best < before));
    bool written = false;
    if (!reject && primal) {
      RowMatrix<Real> rows(u, V0.cols());  // (u, d) V_U⁰ + ΔV_U
      for (Index k = 0; k < u; ++k)
        rows.row(k) = (V0.row(free[static_cast<std::size_t>(k)]).template cast<double>() + best_D.row(k))
                          .template cast<Real>();
      written = detail::all_below(rows, limit);
      if (written) {
        if (&V != &V0) V = V0;
        for (Index k = 0; k < u; ++k) V.row(free[static_cast<std::size_t>(k)]) = rows.row(k);
        EF = ZF - XFU_d * best_D;  // Y_F − X_F V
      }
    } else if (!reject) {
      ensure_xfu();
      written = detail::apply_value_update(XFU, best_D, V0, free, V, limit);
      if (written) EF = best_lambda * best_D;  // Y_F − X_F V = λ S
    }
    if (!written) {  // nothing written: V kept
      diag.value_step_rejected = true;
      return;
    }
    fF = (YF.template cast<double>() - EF).template cast<Real>();
    have_f = true;
    check_err = best;
  };

  const auto run_key_step = [&] {
    if (before_pending) {
      diag.window_error_before = whole_error();
      before_pending = false;
    }
    ensure_xfu();
    ensure_f();
    const double before = checked();
    const RowMatrix<Real> K_prev = K;  // (m, d)
    KeyStepReport rep;
    bool finite = true;
    {
      have_xfu = false;
      const KeyJacobian<Real> jac =
          detail::jacobian_from(QF, std::move(XFU), capped ? &chainF : nullptr, V, fF, attF, free);
      const RowMatrix<Real> e = EF.template cast<Real>();  // (R_F, d)
      rep = detail::key_step_at(jac, e, K0, free, args.lambda_k, {args.cg_tolerance, args.cg_max_iterations}, K,
                                &finite, limit);
    }
    diag.cg_iterations += rep.iterations;
    diag.cg_residual = std::max(diag.cg_residual, rep.residual);
    if (detail::severity(rep.status) > detail::severity(diag.cg_status)) diag.cg_status = rep.status;
    diag.key_step_length = 0.0;
    if (!finite || !kvc::detail::row_finite(K.data(), K.size())) {
      K = K_prev;
      diag.key_step_rejected = true;
      return;
    }
    const RowMatrix<Real> K_full = K;  // (m, d) the full step
    RowMatrix<Real> XC_try, XC_best;   // (R_C, m)
    double best = std::numeric_limits<double>::infinity();
    Real best_t = 0;
    for (const Real t : {Real(1), Real(0.5), Real(0.25)}) {
      for (const Index j : free) K.row(j) = K_prev.row(j) + t * (K_full.row(j) - K_prev.row(j));
      probabilities(QC, K, attC, XC_try);
      const double e = residual(XC_try, V).norm();
      if (e < best) {
        best = e;
        best_t = t;
        XC_best.swap(XC_try);
      }
    }
    if (best_t == Real(0) || (args.safeguard && !(best < before))) {
      K = K_prev;  // XC, check_err still describe K
      diag.key_step_rejected = true;
      return;
    }
    for (const Index j : free) K.row(j) = K_prev.row(j) + best_t * (K_full.row(j) - K_prev.row(j));
    diag.key_step_length = static_cast<double>(best_t);
    have_xf = have_xfu = have_f = false;
    XC.swap(XC_best);
    check_err = best;
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
  diag.window_error_after = whole_error();
}

/// The whole per-head regression on dense data: `steps` alternations of the value and key steps in
/// `args.order`, anchored at the entry values K⁰ = K, V⁰ = V. Fills the ridge fields of `diag`:
/// window errors before/after, cg_iterations (sum over key steps), cg_residual (largest), cg_status
/// (worst: breakdown > max_iterations > converged), key_step_rejected (the safeguard undid a key step,
/// or a key step produced keys not below `limit` in magnitude and was undone), value_step_rejected (a
/// value step's solve failed or produced values not below `limit`: V kept). `limit` is the magnitude
/// from which an entry stops converting to a finite element of the cache's type (+Inf: any finite
/// entry passes). An empty free set, steps = 0 or both steps off leave K and V untouched. With
/// args.lambda_mode = holdout and at least two window positions (att.window; 0 = Q.rows()) the work is
/// regress_holdout's; below, the fixed λ, where `safeguard` keeps a key step only if it lowers the
/// whole window error. diag.lambda_v: the λ of the last value step run.
///
/// Nothing is evaluated twice: the probabilities X at the current keys (and their free columns) serve
/// the window error, the value step and the key step's linearisation until the keys change; the value
/// step's dual residual Z = Y − X V⁰ is the window error before (when it runs first), and after it the
/// outputs need no product: f = X V = Y − λ_v·(X_U X_Uᵀ + λ_v I)⁻¹ Z exactly, which also gives the key
/// step its residual e = Y − f in double rather than as a float difference of nearly equal outputs.
/// Default cost (value then key, S = 1): one (R×d×m) product for X, the dual system (double
/// R×m×d + R²·u/2), one (R×u×d) product for the value update, per CG iteration three (R×d×u)-sized
/// products, one (R×u×d) for Jᵀα, and one X·V at the new keys (two R×m×d products) for the error after.
template <class Real>
void regress(const RowMatrix<Real>& Q,  // (R, d) stacked group queries
             const RowMatrix<Real>& Y,  // (R, d) full-cache targets
             const Attention& att, const std::vector<Index>& free, const RidgeMerge::Arguments& args,
             RowMatrix<Real>& K,  // (m, d) in: K⁰, out: merged keys
             RowMatrix<Real>& V,  // (m, d) in: V⁰, out: merged values
             HeadDiagnostics& diag, Real limit = std::numeric_limits<Real>::infinity()) {
  using Order = RidgeMerge::Arguments::Order;
  diag.cg_iterations = 0;
  diag.cg_residual = 0.0;
  diag.cg_status = SolverStatus::not_run;
  diag.key_step_rejected = false;
  diag.value_step_rejected = false;
  const double y_norm = Y.template cast<double>().norm();
  const auto relative = [&](double err) { return y_norm > 0.0 ? err / y_norm : err; };
  const bool capped = att.softcap > 0.0;

  // What is known at the current (K, V); invalidated when K or V changes.
  RowMatrix<Real> X, chain, XU;  // (R, m) probabilities, (R, m) soft-cap slope (capped only), (R, u) X_U
  bool have_x = false, have_xu = false;
  RowMatrix<Real> f;   // (R, d) f(K, V) = X·V
  Eigen::MatrixXd E;   // (R, d) Y − f, in double
  bool have_f = false;
  double err = 0.0;    // ‖Y − f‖ / ‖Y‖
  bool have_err = false;
  const auto ensure_x = [&] {
    if (have_x) return;
    probabilities(Q, K, att, X, capped ? &chain : nullptr);
    have_x = true;
    have_xu = false;
  };
  const auto ensure_xu = [&] {
    ensure_x();
    if (!have_xu) detail::gather_columns(X, free, XU);
    have_xu = true;
  };
  const auto ensure_f = [&] {
    if (have_f) return;
    ensure_x();
    f.noalias() = X * V;
    E = Y.template cast<double>() - f.template cast<double>();  // as window_error
    have_f = true;
  };
  const auto error = [&] {
    if (!have_err) {
      ensure_f();
      err = relative(E.norm());
      have_err = true;
    }
    return err;
  };
  const auto keys_changed = [&] { have_x = have_xu = have_f = have_err = false; };

  diag.lambda_v = diag.key_step_length = std::numeric_limits<double>::quiet_NaN();
  const bool active = !free.empty() && args.steps > 0 && (args.value_step || args.key_step);
  if (!active) {
    diag.window_error_before = diag.window_error_after = error();
    return;
  }
  if (args.lambda_mode == RidgeMerge::Arguments::LambdaMode::holdout) {
    const Index W = att.window > 0 ? att.window : Q.rows();
    std::vector<Index> fit_rows, check_rows;
    holdout_rows(W, W > 0 ? Q.rows() / W : 0, args.holdout_every, fit_rows, check_rows);
    if (!check_rows.empty()) {
      regress_holdout(Q, Y, att, free, args, fit_rows, check_rows, K, V, diag, limit);
      return;
    }  // W < 2: no split, the fixed λ below with the whole-window safeguard
  }

  // Ridge anchors K⁰, V⁰ (m, d). With S = 1 each step runs once, before anything changed what it
  // anchors to (the value step leaves K alone, the key step V), so K and V themselves serve.
  const bool single = args.steps == 1;
  RowMatrix<Real> K0_copy, V0_copy;
  if (!single) {
    K0_copy = K;
    V0_copy = V;
  }
  const RowMatrix<Real>& K0 = single ? K : K0_copy;
  const RowMatrix<Real>& V0 = single ? V : V0_copy;
  bool before_pending = true;            // window_error_before not yet recorded (K = K⁰, V = V⁰)
  const auto run_value_step = [&] {
    ensure_x();
    Eigen::MatrixXd gram, Z;  // (R, R), (R, d)
    detail::dual_system(X, V0, Y, free, args.lambda_v, gram, Z);  // Z = Y − X V⁰
    if (before_pending) {  // V = V⁰ and K = K⁰ here: Z is the window residual
      diag.window_error_before = relative(Z.norm());
      before_pending = false;
    }
    diag.lambda_v = args.lambda_v;
    if (linalg::solve_spd(gram, Z)) {  // Z ← (X_U X_Uᵀ + λ I)⁻¹ (Y − X V⁰)
      ensure_xu();
      if (detail::apply_value_update(XU, Z, V0, free, V, limit)) {
        E = args.lambda_v * Z;  // Y − X V = Y − X V⁰ − X_U X_Uᵀ Z = λ Z
      } else {  // new values not finite or beyond the element type: V = V⁰, f and E recomputed on demand
        if (&V != &V0) V = V0;
        diag.value_step_rejected = true;
        have_f = have_err = false;
        return;
      }
    } else {  // unchanged Z = Y − X V⁰
      if (&V != &V0) V = V0;
      diag.value_step_rejected = true;
      E = std::move(Z);
    }
    f = (Y.template cast<double>() - E).template cast<Real>();
    have_f = true;
    have_err = false;
  };
  const auto run_key_step = [&] {
    if (before_pending) {
      diag.window_error_before = error();
      before_pending = false;
    }
    ensure_xu();
    ensure_f();
    const double err_prev = args.safeguard ? error() : 0.0;
    RowMatrix<Real> K_prev;  // (m, d) for the safeguard, or to undo over non-finite entry keys
    if (args.safeguard || !kvc::detail::row_finite(K.data(), K.size())) K_prev = K;
    KeyStepReport rep;
    bool finite = true;
    {
      have_xu = false;  // X_U becomes the Jacobian's weights
      const KeyJacobian<Real> jac =
          detail::jacobian_from(Q, std::move(XU), capped ? &chain : nullptr, V, f, att, free);
      const RowMatrix<Real> e = E.template cast<Real>();  // (R, d) Y − f(K)
      rep = detail::key_step_at(jac, e, K0, free, args.lambda_k, {args.cg_tolerance, args.cg_max_iterations},
                                K, &finite, limit);
    }
    diag.cg_iterations += rep.iterations;
    diag.cg_residual = std::max(diag.cg_residual, rep.residual);
    if (detail::severity(rep.status) > detail::severity(diag.cg_status)) diag.cg_status = rep.status;
    if (!finite || !kvc::detail::row_finite(K.data(), K.size())) {  // new rows not written, or undone: the caches still describe K
      if (K_prev.size() > 0) K = K_prev;
      diag.key_step_rejected = true;
      return;
    }
    keys_changed();
    if (args.safeguard && !(error() < err_prev)) {
      K = K_prev;
      diag.key_step_rejected = true;
      keys_changed();
      err = err_prev;
      have_err = true;
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
  diag.window_error_after = error();
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
  // Bounded so that no valid option runs for ever (each step and iteration costs O(G·W·n·d)).
  if (args.steps < 0 || args.steps > 1000) return bad("steps", args.steps, "in [0, 1000]");
  if (args.order != Arguments::Order::value_then_key && args.order != Arguments::Order::key_then_value)
    return bad("order", static_cast<int>(args.order), "value_then_key or key_then_value");
  if (!(args.cg_tolerance >= 0.0) || !std::isfinite(args.cg_tolerance))
    return bad("cg_tolerance", args.cg_tolerance, "finite and >= 0");
  if (args.cg_max_iterations < 0 || args.cg_max_iterations > 100000)
    return bad("cg_max_iterations", args.cg_max_iterations, "in [0, 100000]");
  if (args.lambda_mode != Arguments::LambdaMode::fixed && args.lambda_mode != Arguments::LambdaMode::holdout)
    return bad("lambda_mode", static_cast<int>(args.lambda_mode), "fixed or holdout");
  for (std::size_t i = 0; i < args.lambda_grid.size(); ++i)
    if (!(args.lambda_grid[i] > 0.0) || !std::isfinite(args.lambda_grid[i]))
      return bad(concat("lambda_grid[", i, "]").c_str(), args.lambda_grid[i], "finite and > 0");
  if (args.holdout_every < 2 || args.holdout_every > 1000000)
    return bad("holdout_every", args.holdout_every, "in [2, 1000000]");
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
  const RowMatrix<Real>& Y = ctx.window_outputs();                // (R, d)  Y = A_full · V
  KVC_ASSERT(Y.rows() == Q.rows() && Y.cols() == d);

  ridge::Attention att;
  att.visible = ridge::visible_counts(kept, n, W, G);
  att.scale = ctx.attention().resolved_scale(d);
  att.softcap = ctx.attention().softcap;
  att.window = W;
  if (layer.biased()) {  // the kept entries' stored bias (Y above already includes every entry's)
    att.bias.resize(kept.size());
    for (std::size_t k = 0; k < kept.size(); ++k) att.bias[k] = static_cast<double>(ctx.entry_bias(kept[k]));
  }
  const Vector<Real>& score = ctx.score().size() == n ? ctx.score() : ctx.mass();
  std::vector<Index> free;  // nothing evicted: identity (SPEC §3)
  if (m < n) free = ridge::free_indices(ridge::fixed_mask(kept, n, W, args.sinks, args.beta, score));
  // Steps whose new keys or values would not convert to a finite T (the cache's type, which
  // compact_into writes; half holds |x| < 65520) are rejected for this head like non-finite ones.
  ridge::regress(Q, Y, att, free, args, out.keys, out.values, diag, kvc::detail::overflow_limit<T, Real>());
}

}  // namespace kvc
