// tests/support/reference.hpp — naive double-precision oracle written straight from SPEC.md §2–§8 and §10.
//
// Independence is the point: this header includes no kvcompress header and shares no code with the
// library. Everything is plain loops in `double`, O(n²) where that is clearer; speed does not matter.
// Shapes are written as right-aligned comments, e.g. `// (Hkv,n)`.
//
// Resolved SPEC ambiguities (each marked "Reference decision" at its function):
//  * W > n: only the LAST n query rows of Qw are used (row i then sits at position i).
//  * forced_counts with m >= n returns {min(sinks,n), n - min(sinks,n)}: every position is forced.
//  * Pooling runs over the region [sinks_f, n - recent_f) built from the EFFECTIVE forced counts of §3.
//    Average pooling: zero padding, divisor = kernel everywhere (avg_pool1d count_include_pad=true).
//    Max pooling: padding is -inf (PyTorch max_pool1d), i.e. the max over in-region elements only.
//    kernel 0 or 1 = no pooling; an even kernel > 1 is rejected (SPEC: odd kernel).
//  * Shared selection: the mean is over ALL KV heads of their pooled scores, candidates are restricted
//    to the union of the per-head proposals.
//  * Router fallback (no kept token in the bucket) picks the nearest kept position directly; the
//    statistic is not consulted. `bucket = 0` means Global (all kept tokens are candidates).
//  * CoAttention statistic: plain sum over query heads of the group and window rows (no 1/G; argmax
//    is unaffected).
//  * Mergers: a kept entry with no positive contribution (Σ g_j a_j = 0) keeps v_i bit-exactly.
//  * Half-split RoPE with rotary_dim < d pairs (x[i], x[i + rotary_dim/2]) (HF partial rotary), which
//    equals SPEC's (x[i], x[i + d/2]) when rotary_dim = d.
//  * Shared-selection bias: mean over KV heads, offered for both AttentionRatio and MergeCount.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::ref {

// ----------------------------------------------------------------------------------------------------
// Data model
// ----------------------------------------------------------------------------------------------------

/// Dense row-major 3-D tensor `[H][n][d]` (heads, tokens, head dimension).
struct Tensor3 {
  long H = 0, n = 0, d = 0;
  std::vector<double> data;

  Tensor3() = default;
  Tensor3(long H_, long n_, long d_)
      : H(H_), n(n_), d(d_), data(static_cast<std::size_t>(H_ * n_ * d_), 0.0) {}

  std::size_t index(long h, long j, long k) const {
    return static_cast<std::size_t>((h * n + j) * d + k);
  }
  double& at(long h, long j, long k) { return data[index(h, j, k)]; }
  double at(long h, long j, long k) const { return data[index(h, j, k)]; }
  /// Pointer to the contiguous vector `[h][j][0..d)`.
  double* vec(long h, long j) { return data.data() + index(h, j, 0); }
  const double* vec(long h, long j) const { return data.data() + index(h, j, 0); }
};

/// Router statistic (SPEC §6); the functions take it as `int`.
enum RouteStat : int { RouteKeyCosine = 0, RouteWindowMass = 1, RouteCoAttention = 2 };
/// Merger kind (SPEC §7): `merge` takes the first three as `int`; merge_nearest_key and merge_cam
/// compute the last two (docs/methods.md).
enum MergeKind : int { MergeDrop = 0, MergeAll = 1, MergeSoftGate = 2, MergeNearestKey = 3, MergeCam = 4 };

// ----------------------------------------------------------------------------------------------------
// Small helpers
// ----------------------------------------------------------------------------------------------------

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("kvc::ref: " + what);
}

inline double dot(const double* x, const double* y, long d) {
  double s = 0.0;
  for (long k = 0; k < d; ++k) s += x[k] * y[k];
  return s;
}

inline double norm2(const double* x, long d) { return std::sqrt(dot(x, x, d)); }

/// cos(x, y); a zero-norm vector has cosine 0 (SPEC §7).
inline double cosine(const double* x, const double* y, long d) {
  const double nx = norm2(x, d), ny = norm2(y, d);
  if (nx == 0.0 || ny == 0.0) return 0.0;
  return dot(x, y, d) / (nx * ny);
}

/// logit ← c·tanh(logit/c) for c > 0, identity for c = 0 (SPEC §1).
inline double apply_softcap(double logit, double softcap) {
  return softcap > 0.0 ? softcap * std::tanh(logit / softcap) : logit;
}

/// Numerically stable softmax of a vector (empty in → empty out).
inline std::vector<double> softmax(const std::vector<double>& logits) {
  std::vector<double> p(logits.size(), 0.0);
  if (logits.empty()) return p;
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (std::size_t j = 0; j < logits.size(); ++j) {
    p[j] = std::exp(logits[j] - mx);
    sum += p[j];
  }
  for (double& x : p) x /= sum;
  return p;
}

/// Copy of head h of a tensor as an (n,d) matrix.
inline Eigen::MatrixXd head_matrix(const Tensor3& T, long h) {
  Eigen::MatrixXd M(T.n, T.d);  // (n,d)
  for (long j = 0; j < T.n; ++j)
    for (long k = 0; k < T.d; ++k) M(j, k) = T.at(h, j, k);
  return M;
}

/// Row r of a matrix as a std::vector (Eigen::MatrixXd is column-major, rows are strided).
inline std::vector<double> row_vector(const Eigen::MatrixXd& M, long r) {
  std::vector<double> v(static_cast<std::size_t>(M.cols()));
  for (long k = 0; k < M.cols(); ++k) v[static_cast<std::size_t>(k)] = M(r, k);
  return v;
}

// ----------------------------------------------------------------------------------------------------
// §2 Window attention
// ----------------------------------------------------------------------------------------------------

/// Window attention probabilities, one (W,n) matrix per query head (SPEC §2).
///   Q: [Hq][Wq][d] post-RoPE window queries, K: [Hkv][n][d] keys; Hq % Hkv == 0.
///   A_h[i][j] = softmax_j(softcap(scale·<q_{h,i}, k_{h/G,j}>) + b_{h/G,j}) for j <= p_i = n - W + i,
///   else 0. bias: (Hkv, nb) with nb <= n, the stored bias of a cache compressed before (entries
///   j >= nb, and every entry without it, have b = 0), added after the soft-cap as decode attention does.
/// Reference decision: if Wq > n, W = n and only the LAST n rows of Q are used (they are the queries
/// of positions 0..n-1). Returned matrices have W = min(Wq, n) rows.
inline std::vector<Eigen::MatrixXd> window_probs(const Tensor3& Q, const Tensor3& K, double scale,
                                                 double softcap, const Eigen::MatrixXd* bias = nullptr) {
  require(K.n > 0 && K.d > 0, "n and d must be positive");
  require(Q.d == K.d, "Q and K head dimensions differ");
  require(K.H > 0 && Q.H > 0 && Q.H % K.H == 0, "Hq must be a positive multiple of Hkv");
  require(Q.n > 0, "window must be non-empty");
  require(bias == nullptr || (bias->rows() == K.H && bias->cols() <= K.n), "bias must be (Hkv, nb <= n)");
  const long n = K.n, d = K.d, Hq = Q.H, G = Q.H / K.H;
  const long W = std::min(Q.n, n);
  const long row_offset = Q.n - W;  // first used row of Q
  std::vector<Eigen::MatrixXd> probs;
  for (long h = 0; h < Hq; ++h) {
    const long g = h / G;
    Eigen::MatrixXd A = Eigen::MatrixXd::Zero(W, n);  // (W,n)
    for (long i = 0; i < W; ++i) {
      const long p_i = n - W + i;
      std::vector<double> logits;
      for (long j = 0; j <= p_i; ++j) {
        const double b = bias != nullptr && j < bias->cols() ? (*bias)(g, j) : 0.0;
        logits.push_back(apply_softcap(scale * dot(Q.vec(h, row_offset + i), K.vec(g, j), d), softcap) + b);
      }
      const std::vector<double> p = softmax(logits);
      for (long j = 0; j <= p_i; ++j) A(i, j) = p[static_cast<std::size_t>(j)];
    }
    probs.push_back(A);
  }
  return probs;
}

/// Window attention mass per KV head (SPEC §2): a_g[j] = (1/G)·Σ_{h: h/G = g} Σ_i A_h[i][j].
///   probs: Hq matrices (W,n) → (Hkv,n).
inline Eigen::MatrixXd window_mass(const std::vector<Eigen::MatrixXd>& probs, long Hkv) {
  const long Hq = static_cast<long>(probs.size());
  require(Hkv > 0 && Hq > 0 && Hq % Hkv == 0, "Hq must be a positive multiple of Hkv");
  const long G = Hq / Hkv, n = probs[0].cols();
  Eigen::MatrixXd a = Eigen::MatrixXd::Zero(Hkv, n);  // (Hkv,n)
  for (long h = 0; h < Hq; ++h) {
    const Eigen::MatrixXd& A = probs[static_cast<std::size_t>(h)];
    for (long i = 0; i < A.rows(); ++i)
      for (long j = 0; j < n; ++j) a(h / G, j) += A(i, j);
  }
  return a / static_cast<double>(G);
}

// ----------------------------------------------------------------------------------------------------
// §4 Scorers (higher = keep), each (Hkv,n)
// ----------------------------------------------------------------------------------------------------

/// AttentionMass (SnapKV): c_g[j] = a_g[j].
inline Eigen::MatrixXd attention_mass(const Eigen::MatrixXd& a) { return a; }

/// ValueWeighted (SelKV Eq. 1): c_g[j] = a_g[j]·‖v_{g,j}‖₂.
inline Eigen::MatrixXd value_weighted(const Eigen::MatrixXd& a, const Tensor3& V) {
  require(a.rows() == V.H && a.cols() == V.n, "a and V shapes differ");
  Eigen::MatrixXd c(V.H, V.n);  // (Hkv,n)
  for (long g = 0; g < V.H; ++g)
    for (long j = 0; j < V.n; ++j) c(g, j) = a(g, j) * norm2(V.vec(g, j), V.d);
  return c;
}

/// KeyNorm (KNorm): c_g[j] = −‖k_{g,j}‖₂.
inline Eigen::MatrixXd key_norm(const Tensor3& K) {
  Eigen::MatrixXd c(K.H, K.n);  // (Hkv,n)
  for (long g = 0; g < K.H; ++g)
    for (long j = 0; j < K.n; ++j) c(g, j) = -norm2(K.vec(g, j), K.d);
  return c;
}

/// TOVA: c_g[j] = (1/G)·Σ_{h: h/G = g} A_h[W−1][j], the attention of the last window query (position
/// n − 1, which sees every key), averaged over the group's query heads. probs: Hq matrices (W,n).
inline Eigen::MatrixXd last_query_attention(const std::vector<Eigen::MatrixXd>& probs, long Hkv) {
  const long Hq = static_cast<long>(probs.size());
  require(Hkv > 0 && Hq > 0 && Hq % Hkv == 0, "Hq must be a positive multiple of Hkv");
  const long G = Hq / Hkv, n = probs[0].cols();
  Eigen::MatrixXd c = Eigen::MatrixXd::Zero(Hkv, n);  // (Hkv,n)
  for (long h = 0; h < Hq; ++h) {
    const Eigen::MatrixXd& A = probs[static_cast<std::size_t>(h)];
    for (long j = 0; j < n; ++j) c(h / G, j) += A(A.rows() - 1, j);
  }
  return c / static_cast<double>(G);
}

/// KeyDiff: c_g[j] = −cos(k_{g,j}, ā_g), ā_g = (1/n)·Σ_j k_{g,j}/‖k_{g,j}‖ (a zero key contributes 0;
/// a cosine with a zero vector is 0).
inline Eigen::MatrixXd key_diversity(const Tensor3& K) {
  Eigen::MatrixXd c(K.H, K.n);  // (Hkv,n)
  for (long g = 0; g < K.H; ++g) {
    std::vector<double> anchor(static_cast<std::size_t>(K.d), 0.0);
    for (long j = 0; j < K.n; ++j) {
      const double norm = norm2(K.vec(g, j), K.d);
      if (norm > 0.0)
        for (long k = 0; k < K.d; ++k) anchor[static_cast<std::size_t>(k)] += K.vec(g, j)[k] / norm / double(K.n);
    }
    for (long j = 0; j < K.n; ++j) c(g, j) = -cosine(K.vec(g, j), anchor.data(), K.d);
  }
  return c;
}

/// CUR (CurDKV, kvpress CURPress defaults): κ_j = ‖k_j‖², ν_j = ‖v_j‖², each divided by its sum over
/// the window [⌊j/w⌋·w, min(⌊j/w⌋·w + w, n)) (0 when that sum is 0), p_j = κ̂_j·ν̂_j,
/// c_g[j] = p_j / Σ_i p_i (0 when the sum is 0); c_g[j] = 1 for j < sinks.
inline Eigen::MatrixXd local_leverage(const Tensor3& K, const Tensor3& V, long sinks, long window) {
  Eigen::MatrixXd c(K.H, K.n);  // (Hkv,n)
  for (long g = 0; g < K.H; ++g) {
    std::vector<double> p(static_cast<std::size_t>(K.n));
    for (long j = 0; j < K.n; ++j) {
      const long start = (j / window) * window, end = std::min(start + window, K.n);
      double key_sum = 0.0, value_sum = 0.0;
      for (long i = start; i < end; ++i) {
        key_sum += dot(K.vec(g, i), K.vec(g, i), K.d);
        value_sum += dot(V.vec(g, i), V.vec(g, i), V.d);
      }
      const double kappa = key_sum > 0.0 ? dot(K.vec(g, j), K.vec(g, j), K.d) / key_sum : 0.0;
      const double nu = value_sum > 0.0 ? dot(V.vec(g, j), V.vec(g, j), V.d) / value_sum : 0.0;
      p[static_cast<std::size_t>(j)] = kappa * nu;
    }
    double total = 0.0;
    for (double x : p) total += x;
    for (long j = 0; j < K.n; ++j) c(g, j) = j < sinks ? 1.0 : (total > 0.0 ? p[static_cast<std::size_t>(j)] / total : 0.0);
  }
  return c;
}

/// LagKV (kvpress LagKVPress): s = min(sinks, n); n − s < 2L: c[j] = 1 (j < s), (j − s)/(n − s) after.
/// Else partitions P_p = [s + p·L, s + (p+1)·L), p < q = ⌊(n − s)/L⌋; for p < q − 1 and X = K, V:
/// x̂_{j,c} = (x_{j,c} − min_{P_{p+1}} x_{·,c}) / (max − min) (0 when max = min),
/// σ_j = sample std over c (0 when d = 1), s^X = softmax over P_p of σ; s_j = (s^K_j + s^V_j)/2;
/// c[j] = s_j, or with `rank` #{i ∈ P_p: s_i < s_j or (s_i = s_j and i < j)} / L. The sinks score 2,
/// the tail [t, n), t = s + (q − 1)·L, scores 1 + (j − t)/(n − t).
inline Eigen::MatrixXd lag_relative(const Tensor3& K, const Tensor3& V, long sinks, long lag, bool rank) {
  const long n = K.n, d = K.d, s = std::min(sinks, n), L = lag;
  Eigen::MatrixXd c(K.H, n);  // (Hkv,n)
  auto spread_softmax = [&](const Tensor3& X, long g, long lo) {
    std::vector<double> sigma(static_cast<std::size_t>(L));
    for (long j = lo; j < lo + L; ++j) {
      std::vector<double> xhat(static_cast<std::size_t>(d));
      for (long k = 0; k < d; ++k) {
        double mn = X.at(g, lo + L, k), mx = mn;
        for (long i = lo + L; i < lo + 2 * L; ++i) {
          mn = std::min(mn, X.at(g, i, k));
          mx = std::max(mx, X.at(g, i, k));
        }
        xhat[static_cast<std::size_t>(k)] = mx > mn ? (X.at(g, j, k) - mn) / (mx - mn) : 0.0;
      }
      double mean = 0.0, var = 0.0;
      for (double x : xhat) mean += x / static_cast<double>(d);
      for (double x : xhat) var += (x - mean) * (x - mean);
      sigma[static_cast<std::size_t>(j - lo)] = d > 1 ? std::sqrt(var / static_cast<double>(d - 1)) : 0.0;
    }
    return softmax(sigma);
  };
  for (long g = 0; g < K.H; ++g) {
    if (n - s < 2 * L) {
      for (long j = 0; j < n; ++j) c(g, j) = j < s ? 1.0 : static_cast<double>(j - s) / static_cast<double>(n - s);
      continue;
    }
    const long q = (n - s) / L, t = s + (q - 1) * L;
    for (long j = 0; j < s; ++j) c(g, j) = 2.0;
    for (long j = t; j < n; ++j) c(g, j) = 1.0 + static_cast<double>(j - t) / static_cast<double>(n - t);
    for (long p = 0; p + 1 < q; ++p) {
      const long lo = s + p * L;
      const std::vector<double> sk = spread_softmax(K, g, lo), sv = spread_softmax(V, g, lo);
      for (long j = 0; j < L; ++j) {
        const double sj = (sk[static_cast<std::size_t>(j)] + sv[static_cast<std::size_t>(j)]) / 2.0;
        if (!rank) {
          c(g, lo + j) = sj;
          continue;
        }
        long below = 0;
        for (long i = 0; i < L; ++i) {
          const double si = (sk[static_cast<std::size_t>(i)] + sv[static_cast<std::size_t>(i)]) / 2.0;
          below += (si < sj || (si == sj && i < j)) ? 1 : 0;
        }
        c(g, lo + j) = static_cast<double>(below) / static_cast<double>(L);
      }
    }
  }
  return c;
}

/// The RoPE rotation of position p as a (d,d) matrix: pair i (dims (2i, 2i+1) interleaved, or
/// (i, i + r/2) half-split; r = rotary, 0 meaning d) rotated by the angle p·θ^(−2i/r); the other dims
/// unchanged. RoPE(x, p) = R(p)·x.
inline Eigen::MatrixXd rope_matrix(long d, double p, bool interleaved, double theta, long rotary) {
  const long r = rotary == 0 ? d : rotary;
  Eigen::MatrixXd R = Eigen::MatrixXd::Identity(d, d);  // (d,d)
  for (long i = 0; i < r / 2; ++i) {
    const long a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + r / 2;
    const double angle = p * std::pow(theta, -2.0 * double(i) / double(r));
    R(a, a) = std::cos(angle);
    R(a, b) = -std::sin(angle);
    R(b, a) = std::sin(angle);
    R(b, b) = std::cos(angle);
  }
  return R;
}

/// Expected Attention (kvpress ExpectedAttentionPress). Window rows i (entries e_i = n − W + i, W =
/// min(Wq, n), the last W rows of Q) with e_i >= sinks give the pre-RoPE queries u_i = R(p_i)ᵀ·q_{h,i}
/// (p_i: the entry's position, `positions` (Hkv, n) or e_i); μ_h = mean, Σ_h = (1/N)·Σ (u − μ)(u − μ)ᵀ;
/// R̄ = (1/T)·Σ_{t<T} R(P + t), P = p_{n−1} + 1 (summed matrix by matrix);
/// z_h[j] = s·<R̄μ_h, k_j> + [covariance] (s²/2)·k_jᵀ R̄Σ_hR̄ᵀ k_j + b_j for j >= sinks;
/// c[j] = ((1/G)·Σ_h softmax_{j >= sinks}(z_h)[j] + ε)·‖v_j‖ (without value_norm: the mean alone);
/// c[j < sinks] = max over j >= sinks of c. n <= sinks: every score 1.
inline Eigen::MatrixXd expected_attention(const Tensor3& Q, const Tensor3& K, const Tensor3& V, double scale,
                                          long sinks, long T, bool covariance, bool value_norm, double epsilon,
                                          bool interleaved, double theta, long rotary,
                                          const Eigen::MatrixXd* positions = nullptr,
                                          const Eigen::MatrixXd* bias = nullptr) {
  require(Q.H % K.H == 0 && Q.d == K.d && V.n == K.n, "shapes");
  const long Hkv = K.H, n = K.n, d = K.d, G = Q.H / K.H, W = std::min(Q.n, n), s0 = std::min(sinks, n);
  Eigen::MatrixXd out = Eigen::MatrixXd::Ones(Hkv, n);  // (Hkv,n)
  if (s0 == n) return out;
  for (long g = 0; g < Hkv; ++g) {
    const auto pos = [&](long e) { return positions != nullptr ? (*positions)(g, e) : double(e); };
    Eigen::MatrixXd Rbar = Eigen::MatrixXd::Zero(d, d);  // (d,d)
    for (long t = 0; t < T; ++t) Rbar += rope_matrix(d, pos(n - 1) + 1.0 + double(t), interleaved, theta, rotary);
    Rbar /= double(T);
    std::vector<double> mean_p(static_cast<std::size_t>(n - s0), 0.0);
    for (long h = g * G; h < (g + 1) * G; ++h) {
      std::vector<Eigen::VectorXd> u;
      for (long i = 0; i < W; ++i) {
        const long e = n - W + i;
        if (e < s0) continue;
        Eigen::VectorXd q(d);
        for (long c = 0; c < d; ++c) q[c] = Q.at(h, Q.n - W + i, c);
        u.push_back(rope_matrix(d, pos(e), interleaved, theta, rotary).transpose() * q);
      }
      const double N = double(u.size());
      Eigen::VectorXd mu = Eigen::VectorXd::Zero(d);
      for (const auto& x : u) mu += x / N;
      Eigen::MatrixXd cov = Eigen::MatrixXd::Zero(d, d);  // (d,d)
      for (const auto& x : u) cov += (x - mu) * (x - mu).transpose() / N;
      const Eigen::VectorXd mu_bar = Rbar * mu;
      const Eigen::MatrixXd cov_bar = Rbar * cov * Rbar.transpose();
      std::vector<double> z;
      for (long j = s0; j < n; ++j) {
        Eigen::VectorXd k(d);
        for (long c = 0; c < d; ++c) k[c] = K.at(g, j, c);
        double x = scale * mu_bar.dot(k);
        if (covariance) x += scale * scale / 2.0 * k.dot(cov_bar * k);
        if (bias != nullptr && j < bias->cols()) x += (*bias)(g, j);
        z.push_back(x);
      }
      const std::vector<double> p = softmax(z);
      for (std::size_t j = 0; j < p.size(); ++j) mean_p[j] += p[j] / double(G);
    }
    double top = -std::numeric_limits<double>::infinity();
    for (long j = s0; j < n; ++j) {
      double c = mean_p[static_cast<std::size_t>(j - s0)];
      if (value_norm) c = (c + epsilon) * norm2(V.vec(g, j), d);
      out(g, j) = c;
      top = std::max(top, c);
    }
    for (long j = 0; j < s0; ++j) out(g, j) = top;
  }
  return out;
}

/// H2O (kvpress ObservedAttentionPress): Q holds a query for every entry (Wq >= n; its last n rows are
/// the queries of entries 0..n−1). c[j] = (1/G)·Σ_{h in g} Σ_{i >= j} A_h[i][j] / (n − j), A_h the
/// causal attention of window_probs over all n rows.
inline Eigen::MatrixXd observed_attention(const Tensor3& Q, const Tensor3& K, double scale, double softcap,
                                          const Eigen::MatrixXd* bias = nullptr) {
  require(Q.n >= K.n, "H2O needs a query for every entry");
  Eigen::MatrixXd c = window_mass(window_probs(Q, K, scale, softcap, bias), K.H);  // (Hkv,n)
  for (long j = 0; j < K.n; ++j) c.col(j) /= double(K.n - j);
  return c;
}

/// Position (StreamingLLM): c_g[j] = j, so the top-by-score candidates are the most recent tokens.
inline Eigen::MatrixXd position(long Hkv, long n) {
  Eigen::MatrixXd c(Hkv, n);  // (Hkv,n)
  for (long g = 0; g < Hkv; ++g)
    for (long j = 0; j < n; ++j) c(g, j) = static_cast<double>(j);
  return c;
}

// ----------------------------------------------------------------------------------------------------
// §3 Budget: forced tokens
// ----------------------------------------------------------------------------------------------------

/// Effective forced counts: the first `sinks` positions and the last `recent` positions.
struct Forced {
  long sinks, recent;
};

/// SPEC §3: keep min(sinks, m) first tokens, then up to `recent` most recent tokens while the budget
/// lasts, never overlapping the sinks. Reference decision: for m >= n every position is forced and the
/// result is {min(sinks,n), n − min(sinks,n)} (so sinks + recent = n).
inline Forced forced_counts(long n, long m, long sinks, long recent) {
  require(n > 0, "n must be positive");
  require(m > 0, "m must be positive");
  require(sinks >= 0 && recent >= 0, "sinks and recent must be non-negative");
  if (m >= n) {
    const long s = std::min(sinks, n);
    return {s, n - s};
  }
  const long s = std::min(sinks, m);
  const long r = std::min(recent, m - s);  // m < n, so s + r <= m < n: no overlap with the sinks
  return {s, r};
}

/// SPEC §4 pooling of one score row over the candidate region [sinks_f, n − recent_f) only.
///   avg: out[j] = (1/kernel)·Σ_{t=j−P/2}^{j+P/2} row[t], out-of-region terms are 0 (zero padding,
///        divisor always = kernel, as avg_pool1d with count_include_pad=true).
///   max: out[j] = max over in-region t of that window (PyTorch max_pool1d pads with −inf, so padding
///        never wins, which matters for negative scores such as KeyNorm).
/// Positions outside the region keep their raw score. kernel 0 or 1: no pooling. O(n·kernel).
inline std::vector<double> pool(const std::vector<double>& score_row, long n, long sinks_f,
                                long recent_f, long kernel, bool max_pool) {
  require(static_cast<long>(score_row.size()) == n, "score row length differs from n");
  require(kernel >= 0, "kernel must be non-negative");
  std::vector<double> out = score_row;
  if (kernel <= 1) return out;
  require(kernel % 2 == 1, "pooling kernel must be odd");
  const long lo = sinks_f, hi = n - recent_f, half = kernel / 2;
  for (long j = lo; j < hi; ++j) {
    double sum = 0.0, mx = -std::numeric_limits<double>::infinity();
    for (long t = j - half; t <= j + half; ++t) {
      if (t < lo || t >= hi) continue;  // padding: 0 for avg, -inf for max
      sum += score_row[static_cast<std::size_t>(t)];
      mx = std::max(mx, score_row[static_cast<std::size_t>(t)]);
    }
    out[static_cast<std::size_t>(j)] = max_pool ? mx : sum / static_cast<double>(kernel);
  }
  return out;
}

/// The rank order of SPEC §5: higher score first, ties to the lower position.
inline auto better_by(const std::vector<double>& score) {
  return [&score](long x, long y) {
    const double sx = score[static_cast<std::size_t>(x)], sy = score[static_cast<std::size_t>(y)];
    if (sx != sy) return sx > sy;
    return x < y;
  };
}

/// `candidates` in rank order (better_by).
inline std::vector<long> ranked(const std::vector<double>& score, std::vector<long> candidates) {
  std::sort(candidates.begin(), candidates.end(), better_by(score));
  return candidates;
}

/// The k best of `candidates` by `score` (better_by), returned in ascending position order.
inline std::vector<long> top_k(const std::vector<double>& score, std::vector<long> candidates, long k) {
  const auto better = better_by(score);
  if (k < static_cast<long>(candidates.size())) {
    const auto cut = candidates.begin() + std::max(k, 0L);
    std::nth_element(candidates.begin(), cut, candidates.end(), better);  // a strict total order: exact
    candidates.erase(cut, candidates.end());
  }
  std::sort(candidates.begin(), candidates.end());
  return candidates;
}

// ----------------------------------------------------------------------------------------------------
// §5 Selector
// ----------------------------------------------------------------------------------------------------

/// SPEC §5 selection. scores: (Hkv,n) raw scores; m_per_head: Hkv budgets.
/// Per head: forced (§3) + top (m − |forced|) non-forced positions by pooled score (§4), ties: higher
/// score, then lower position. Shared: each head proposes its own top m' = m − |forced| by its pooled
/// score, the union is trimmed to m' by the mean over ALL heads of the pooled score (raw mean), same
/// tie rule; every head gets the same set (requires equal m). m >= n keeps every position.
/// Returns Hkv ascending position lists. O(Hkv·n log n).
inline std::vector<std::vector<long>> select(const Eigen::MatrixXd& scores, std::vector<long> m_per_head,
                                             long sinks, long recent, long pool_kernel, bool max_pool,
                                             bool shared) {
  const long Hkv = scores.rows(), n = scores.cols();
  require(Hkv > 0 && n > 0, "empty score matrix");
  require(static_cast<long>(m_per_head.size()) == Hkv, "one budget per KV head required");

  auto all_positions = [n] {
    std::vector<long> v(static_cast<std::size_t>(n));
    for (long j = 0; j < n; ++j) v[static_cast<std::size_t>(j)] = j;
    return v;
  };
  auto candidates_of = [n](const Forced& f) {
    std::vector<long> c;
    for (long j = f.sinks; j < n - f.recent; ++j) c.push_back(j);
    return c;
  };
  auto forced_of = [n](const Forced& f) {
    std::vector<long> v;
    for (long j = 0; j < f.sinks; ++j) v.push_back(j);
    for (long j = n - f.recent; j < n; ++j) v.push_back(j);
    return v;
  };

  std::vector<std::vector<long>> kept(static_cast<std::size_t>(Hkv));
  if (!shared) {
    for (long h = 0; h < Hkv; ++h) {
      const long m = m_per_head[static_cast<std::size_t>(h)];
      const Forced f = forced_counts(n, m, sinks, recent);
      std::vector<long>& out = kept[static_cast<std::size_t>(h)];
      if (m >= n) {
        out = all_positions();
        continue;
      }
      const std::vector<double> pooled = pool(row_vector(scores, h), n, f.sinks, f.recent, pool_kernel, max_pool);
      out = forced_of(f);
      for (long j : top_k(pooled, candidates_of(f), m - f.sinks - f.recent)) out.push_back(j);
      std::sort(out.begin(), out.end());
    }
    return kept;
  }

  const long m = m_per_head[0];
  for (long mh : m_per_head) require(mh == m, "shared selection needs equal budgets on all heads");
  const Forced f = forced_counts(n, m, sinks, recent);
  if (m >= n) {
    for (auto& v : kept) v = all_positions();
    return kept;
  }
  const long m_prime = m - f.sinks - f.recent;
  std::set<long> proposals;
  std::vector<double> mean(static_cast<std::size_t>(n), 0.0);
  for (long h = 0; h < Hkv; ++h) {
    const std::vector<double> pooled = pool(row_vector(scores, h), n, f.sinks, f.recent, pool_kernel, max_pool);
    for (long j : top_k(pooled, candidates_of(f), m_prime)) proposals.insert(j);
    for (long j = 0; j < n; ++j) mean[static_cast<std::size_t>(j)] += pooled[static_cast<std::size_t>(j)];
  }
  for (double& x : mean) x /= static_cast<double>(Hkv);
  std::vector<long> out = forced_of(f);
  for (long j : top_k(mean, std::vector<long>(proposals.begin(), proposals.end()), m_prime)) out.push_back(j);
  std::sort(out.begin(), out.end());
  for (auto& v : kept) v = out;
  return kept;
}

/// ChunkKV selection (kvpress ChunkKVPress, with the forced tokens and pooling of SPEC §3–§4): per head
/// (or, shared, on the mean over heads of the pooled scores) the forced tokens, then the region
/// [s_f, n − r_f) in chunks [s_f + b·c, min(s_f + (b+1)·c, n − r_f)) ranked by their mean pooled score
/// (higher first, ties to the lower b); each chunk is kept whole if it fits in the budget left; what
/// is left then goes to the best single tokens not kept (§5 order). m >= n keeps every position.
inline std::vector<std::vector<long>> select_chunks(const Eigen::MatrixXd& scores, std::vector<long> m_per_head,
                                                    long sinks, long recent, long pool_kernel, long chunk,
                                                    bool shared) {
  const long Hkv = scores.rows(), n = scores.cols();
  require(Hkv > 0 && n > 0 && chunk > 0, "empty score matrix or chunk < 1");
  auto keep = [&](const std::vector<double>& score, long m) {
    std::vector<long> out;
    if (m >= n) {
      for (long j = 0; j < n; ++j) out.push_back(j);
      return out;
    }
    const Forced f = forced_counts(n, m, sinks, recent);
    const long lo = f.sinks, hi = n - f.recent;
    std::vector<char> kept(static_cast<std::size_t>(n), 0);
    for (long j = 0; j < n; ++j) kept[static_cast<std::size_t>(j)] = (j < lo || j >= hi) ? 1 : 0;
    std::vector<double> chunk_mean;
    std::vector<long> chunks;
    for (long a = lo, b = 0; a < hi; a += chunk, ++b) {
      double sum = 0.0;
      for (long j = a; j < std::min(hi, a + chunk); ++j) sum += score[static_cast<std::size_t>(j)];
      chunk_mean.push_back(sum / static_cast<double>(std::min(hi, a + chunk) - a));
      chunks.push_back(b);
    }
    long left = m - f.sinks - f.recent;
    for (long b : ranked(chunk_mean, chunks)) {
      const long a = lo + b * chunk, e = std::min(hi, a + chunk);
      if (e - a > left) continue;
      for (long j = a; j < e; ++j) kept[static_cast<std::size_t>(j)] = 1;
      left -= e - a;
    }
    std::vector<long> rest;
    for (long j = lo; j < hi; ++j)
      if (!kept[static_cast<std::size_t>(j)]) rest.push_back(j);
    for (long j : top_k(score, rest, left)) kept[static_cast<std::size_t>(j)] = 1;
    for (long j = 0; j < n; ++j)
      if (kept[static_cast<std::size_t>(j)]) out.push_back(j);
    return out;
  };
  std::vector<std::vector<long>> kept(static_cast<std::size_t>(Hkv));
  if (!shared) {
    for (long h = 0; h < Hkv; ++h) {
      const long m = m_per_head[static_cast<std::size_t>(h)];
      const Forced f = forced_counts(n, m, sinks, recent);
      kept[static_cast<std::size_t>(h)] = keep(pool(row_vector(scores, h), n, f.sinks, f.recent, pool_kernel, false), m);
    }
    return kept;
  }
  const long m = m_per_head[0];
  for (long mh : m_per_head) require(mh == m, "shared selection needs equal budgets on all heads");
  const Forced f = forced_counts(n, m, sinks, recent);
  std::vector<double> mean(static_cast<std::size_t>(n), 0.0);
  for (long h = 0; h < Hkv; ++h) {
    const std::vector<double> pooled = pool(row_vector(scores, h), n, f.sinks, f.recent, pool_kernel, false);
    for (long j = 0; j < n; ++j) mean[static_cast<std::size_t>(j)] += pooled[static_cast<std::size_t>(j)] / static_cast<double>(Hkv);
  }
  const std::vector<long> out = keep(mean, m);
  for (auto& v : kept) v = out;
  return kept;
}

// ----------------------------------------------------------------------------------------------------
// §5 Budget allocation
// ----------------------------------------------------------------------------------------------------

/// AdaKV (kvpress AdaKVPress): B = Σ_g m_g entries in all; head g keeps its top f_g = max(1, ⌊α·m_g⌋)
/// scores; the other B − Σ f_g are the top of all remaining (head, position) entries by score.
/// Order everywhere: higher score, then lower head, then lower position. Returns m_g per head.
///   scores: (Hkv, n); m: Hkv budgets in [1, n].
inline std::vector<long> adakv_budgets(const Eigen::MatrixXd& scores, const std::vector<long>& m, double alpha) {
  const long H = scores.rows(), n = scores.cols();
  require(static_cast<long>(m.size()) == H, "one budget per head");
  struct E {
    double s;
    long g, j;
  };
  const auto before = [](const E& a, const E& b) {
    if (a.s != b.s) return a.s > b.s;
    return a.g != b.g ? a.g < b.g : a.j < b.j;
  };
  std::vector<long> out(static_cast<std::size_t>(H), 0);
  std::vector<E> rest;
  long total = 0, floors = 0;
  for (long g = 0; g < H; ++g) {
    const long mg = m[static_cast<std::size_t>(g)];
    require(mg >= 1 && mg <= n, "budgets must be in [1, n]");
    const long f = std::min(mg, std::max(1L, static_cast<long>(std::floor(alpha * double(mg)))));
    std::vector<E> head;
    for (long j = 0; j < n; ++j) head.push_back({scores(g, j), g, j});
    std::sort(head.begin(), head.end(), before);
    rest.insert(rest.end(), head.begin() + f, head.end());
    out[static_cast<std::size_t>(g)] = f;
    total += mg;
    floors += f;
  }
  std::sort(rest.begin(), rest.end(), before);
  for (long e = 0; e < total - floors && e < static_cast<long>(rest.size()); ++e) ++out[static_cast<std::size_t>(rest[static_cast<std::size_t>(e)].g)];
  return out;
}

/// CriticalKV (Feng et al. 2025, kvpress CriticalKVPress over SnapKV), per KV head g:
///   s_j = avg-pool (kernel P, zero padding, divisor P) of a_g over [0, n − W); the last W entries get
///         the largest pooled value of [0, n − W) (0 when there is none);
///   w_j = (1/G)·Σ_{h in g} Σ_r |Σ_c Wo(r, h·d + c)·v_{g,j,c}|;   stage 2: (s_j + eps)·w_j;
///   first[g] = the ⌊r·m_g⌋ entries ranked first by (window entries, then s descending, then lower position).
///   a: (Hkv,n) window mass, V: [Hkv][n][d], Wo: (D, Hq·d), m: Hkv budgets (0 = no first stage).
struct Critical {
  Eigen::MatrixXd stage2;                 // (Hkv,n)
  std::vector<std::vector<long>> first;   // per head, ascending
  /// The scores as a selector sees them: stage 2, the first-stage entries at +max.
  Eigen::MatrixXd scores() const {
    Eigen::MatrixXd c = stage2;
    for (std::size_t g = 0; g < first.size(); ++g)
      for (long j : first[g]) c(static_cast<long>(g), j) = std::numeric_limits<double>::max();
    return c;
  }
};
inline Critical critical_kv(const Eigen::MatrixXd& a, const Tensor3& V, const Eigen::MatrixXd& Wo, long G, long W,
                            const std::vector<long>& m, long kernel, double eps, double r) {
  const long H = V.H, n = V.n, d = V.d, D = Wo.rows();
  require(a.rows() == H && a.cols() == n && Wo.cols() == H * G * d, "critical_kv: shapes differ");
  const long lo = n - std::min(W, n);
  Critical out;
  out.stage2 = Eigen::MatrixXd::Zero(H, n);
  out.first.resize(static_cast<std::size_t>(H));
  for (long g = 0; g < H; ++g) {
    std::vector<double> s = pool(row_vector(a, g), n, 0, n - lo, kernel, false);
    double top = 0.0;
    for (long j = 0; j < lo; ++j) top = j == 0 ? s[static_cast<std::size_t>(j)] : std::max(top, s[static_cast<std::size_t>(j)]);
    for (long j = lo; j < n; ++j) s[static_cast<std::size_t>(j)] = top;
    for (long j = 0; j < n; ++j) {
      double w = 0.0;
      for (long h = g * G; h < (g + 1) * G; ++h)
        for (long row = 0; row < D; ++row) {
          double u = 0.0;
          for (long c = 0; c < d; ++c) u += Wo(row, h * d + c) * V.at(g, j, c);
          w += std::abs(u);
        }
      out.stage2(g, j) = (s[static_cast<std::size_t>(j)] + eps) * (w / double(G));
    }
    std::vector<long> order(static_cast<std::size_t>(n));
    for (long j = 0; j < n; ++j) order[static_cast<std::size_t>(j)] = j;
    std::sort(order.begin(), order.end(), [&](long x, long y) {
      const bool wx = x >= lo, wy = y >= lo;
      if (wx != wy) return wx;
      if (!wx && s[static_cast<std::size_t>(x)] != s[static_cast<std::size_t>(y)])
        return s[static_cast<std::size_t>(x)] > s[static_cast<std::size_t>(y)];
      return x < y;
    });
    const long k1 = std::min(n, static_cast<long>(std::floor(r * double(m[static_cast<std::size_t>(g)]))));
    out.first[static_cast<std::size_t>(g)].assign(order.begin(), order.begin() + k1);
    std::sort(out.first[static_cast<std::size_t>(g)].begin(), out.first[static_cast<std::size_t>(g)].end());
  }
  return out;
}

// ----------------------------------------------------------------------------------------------------
// §6 Router
// ----------------------------------------------------------------------------------------------------

/// SPEC §6 routing for KV head g. kept: ascending kept positions of that head (non-empty).
/// Returns, for every position j in [0,n), the kept POSITION it routes to; kept positions map to
/// themselves. Evicted j: candidates = kept positions in bucket floor(j/bucket) (bucket = 0: Global, all
/// kept positions); if none, the nearest kept position (ties to the earlier), statistic not consulted.
/// Among candidates: argmax of the statistic, ties to the lower position.
///   RouteKeyCosine:  cos(k_{g,j}, k_{g,i})               (K: [Hkv][n][d] cached keys)
///   RouteWindowMass: a_g[i]                               (a: (Hkv,n))
///   RouteCoAttention: Σ_{h in group g} Σ_r A_h[r][j]·A_h[r][i]   (probs: Hq matrices (W,n), G = Hq/Hkv)
/// O(n·|kept|·(d + G·W)).
inline std::vector<long> route(long g, const std::vector<long>& kept, long n, int stat, long bucket,
                               const Tensor3& K, const Eigen::MatrixXd& a,
                               const std::vector<Eigen::MatrixXd>& probs, long G) {
  require(!kept.empty(), "kept set must be non-empty");
  require(bucket >= 0, "bucket size must be non-negative");
  require(std::is_sorted(kept.begin(), kept.end()), "kept positions must be ascending");
  std::vector<bool> is_kept(static_cast<std::size_t>(n), false);
  for (long i : kept) {
    require(i >= 0 && i < n, "kept position out of range");
    is_kept[static_cast<std::size_t>(i)] = true;
  }

  auto statistic = [&](long j, long i) -> double {
    switch (stat) {
      case RouteKeyCosine: return cosine(K.vec(g, j), K.vec(g, i), K.d);
      case RouteWindowMass: return a(g, i);
      case RouteCoAttention: {
        double s = 0.0;
        for (long h = g * G; h < (g + 1) * G; ++h) {
          const Eigen::MatrixXd& A = probs[static_cast<std::size_t>(h)];
          for (long r = 0; r < A.rows(); ++r) s += A(r, j) * A(r, i);
        }
        return s;
      }
      default: throw std::invalid_argument("kvc::ref: unknown router statistic");
    }
  };

  std::vector<long> target(static_cast<std::size_t>(n));
  for (long j = 0; j < n; ++j) {
    if (is_kept[static_cast<std::size_t>(j)]) {
      target[static_cast<std::size_t>(j)] = j;
      continue;
    }
    std::vector<long> cands;
    for (long i : kept)
      if (bucket == 0 || i / bucket == j / bucket) cands.push_back(i);
    if (cands.empty()) {  // nearest kept position, ties to the earlier one
      long best = kept[0];
      for (long i : kept)
        if (std::labs(i - j) < std::labs(best - j)) best = i;
      target[static_cast<std::size_t>(j)] = best;
      continue;
    }
    long best = cands[0];
    double best_stat = statistic(j, best);
    for (std::size_t c = 1; c < cands.size(); ++c) {
      const double s = statistic(j, cands[c]);
      if (s > best_stat) {  // strict: ties stay with the lower position
        best = cands[c];
        best_stat = s;
      }
    }
    target[static_cast<std::size_t>(j)] = best;
  }
  return target;
}

// ----------------------------------------------------------------------------------------------------
// §7 Mergers
// ----------------------------------------------------------------------------------------------------

/// Compressed keys/values of one KV head and the per-position gate g_j (0 for kept positions and for
/// Drop).
struct Merged {
  Eigen::MatrixXd keys, values;  // (m,d)
  std::vector<double> gate;      // (n)
};

/// τ = 1e-12 · max_j a_g[j] (SPEC §7, §8).
inline double mass_floor(const Eigen::MatrixXd& a, long g) { return 1e-12 * a.row(g).maxCoeff(); }

/// The kept rows of head g as a merge starts from them: keys and values copied, every gate 0;
/// entry_of[j] = j's index among the kept (−1 when evicted).
inline Merged kept_rows(long g, const std::vector<long>& kept, const Tensor3& K, const Tensor3& V,
                        std::vector<long>& entry_of) {
  const long n = K.n, d = K.d, m = static_cast<long>(kept.size());
  Merged out;
  out.keys.resize(m, d);
  out.values.resize(m, d);
  out.gate.assign(static_cast<std::size_t>(n), 0.0);
  entry_of.assign(static_cast<std::size_t>(n), -1);
  for (long e = 0; e < m; ++e) {
    const long i = kept[static_cast<std::size_t>(e)];
    entry_of[static_cast<std::size_t>(i)] = e;
    for (long k = 0; k < d; ++k) {
      out.keys(e, k) = K.at(g, i, k);
      out.values(e, k) = V.at(g, i, k);
    }
  }
  return out;
}

/// SPEC §7 merge for KV head g. route: n kept positions from `route`. Keys are copied unchanged.
///   Drop: values unchanged, gates 0.  MergeAll: g_j = 1.  SoftGate: g_j = max(cos(v_j, v_π(j)), 0)
///   against the target's ORIGINAL value.
///   ṽ_i = (max(a_i,τ)·v_i + Σ_{π(j)=i} g_j a_j v_j) / (max(a_i,τ) + Σ_{π(j)=i} g_j a_j).
/// O(n·d).
inline Merged merge(long g, const std::vector<long>& kept, const std::vector<long>& route,
                    const Tensor3& K, const Tensor3& V, const Eigen::MatrixXd& a, int kind) {
  require(kind == MergeDrop || kind == MergeAll || kind == MergeSoftGate, "unknown merge kind");
  const long n = K.n, d = K.d, m = static_cast<long>(kept.size());
  require(static_cast<long>(route.size()) == n, "route must have n entries");
  std::vector<long> entry_of;
  Merged out = kept_rows(g, kept, K, V, entry_of);
  if (kind == MergeDrop) return out;

  const double tau = mass_floor(a, g);
  Eigen::MatrixXd num = Eigen::MatrixXd::Zero(m, d);  // Σ g_j a_j v_j per entry
  Eigen::VectorXd den = Eigen::VectorXd::Zero(m);     // Σ g_j a_j per entry
  for (long j = 0; j < n; ++j) {
    if (entry_of[static_cast<std::size_t>(j)] >= 0) continue;  // kept
    const long i = route[static_cast<std::size_t>(j)];
    const long e = entry_of[static_cast<std::size_t>(i)];
    require(e >= 0, "route target is not a kept position");
    const double gj = kind == MergeAll ? 1.0 : std::max(cosine(V.vec(g, j), V.vec(g, i), d), 0.0);
    out.gate[static_cast<std::size_t>(j)] = gj;
    for (long k = 0; k < d; ++k) num(e, k) += gj * a(g, j) * V.at(g, j, k);
    den(e) += gj * a(g, j);
  }
  for (long e = 0; e < m; ++e) {
    if (den(e) == 0.0) continue;  // nothing merged in: v_i unchanged, bit-exact
    const long i = kept[static_cast<std::size_t>(e)];
    const double ai = std::max(a(g, i), tau);
    for (long k = 0; k < d; ++k) out.values(e, k) = (ai * V.at(g, i, k) + num(e, k)) / (ai + den(e));
  }
  return out;
}

/// Nearest-key merge (kvpress MergingPress; docs/methods.md) for KV head g. route: n kept positions
/// (from `route` with RouteKeyCosine, bucket 0: the kept key of largest cosine). For evicted j with
/// target t = route[j]:
///   w_j = max(cos(k_j, k_t), 0)·‖v_j‖ / (‖v_j‖ + ‖v_t‖), and 0 when cos(k_j, k_t) < threshold or ‖v_j‖ = 0
///   ṽ_t = (v_t + Σ_{route[j]=t} w_j·v_j) / (1 + Σ_{route[j]=t} w_j)       (v_t: the original value)
/// Keys copied unchanged; an entry with Σ w_j = 0 keeps v_t. gate[j] = w_j. O(n·d).
inline Merged merge_nearest_key(long g, const std::vector<long>& kept, const std::vector<long>& route,
                                const Tensor3& K, const Tensor3& V, double threshold) {
  const long n = K.n, d = K.d, m = static_cast<long>(kept.size());
  require(static_cast<long>(route.size()) == n, "route must have n entries");
  std::vector<long> entry_of;
  Merged out = kept_rows(g, kept, K, V, entry_of);
  Eigen::MatrixXd num = Eigen::MatrixXd::Zero(m, d);  // Σ w_j v_j per entry
  Eigen::VectorXd den = Eigen::VectorXd::Zero(m);     // Σ w_j per entry
  for (long j = 0; j < n; ++j) {
    if (entry_of[static_cast<std::size_t>(j)] >= 0) continue;  // kept
    const long t = route[static_cast<std::size_t>(j)];
    const long e = entry_of[static_cast<std::size_t>(t)];
    require(e >= 0, "route target is not a kept position");
    const double c = cosine(K.vec(g, j), K.vec(g, t), d);
    const double nj = norm2(V.vec(g, j), d), nt = norm2(V.vec(g, t), d);
    const double w = (c < threshold || nj == 0.0) ? 0.0 : std::max(c, 0.0) * nj / (nj + nt);
    out.gate[static_cast<std::size_t>(j)] = w;
    for (long k = 0; k < d; ++k) num(e, k) += w * V.at(g, j, k);
    den(e) += w;
  }
  for (long e = 0; e < m; ++e) {
    if (den(e) == 0.0) continue;
    for (long k = 0; k < d; ++k) out.values(e, k) = (out.values(e, k) + num(e, k)) / (1.0 + den(e));
  }
  return out;
}

/// CaM (docs/methods.md) for KV head g, its Bernoulli merge replaced by the expectation. For evicted j,
/// window(j) = the first min(B, #kept after j) kept positions after j (b_j of them):
///   p_j = min(a_j / ā_j, 1),  ā_j = (1/b_j)·Σ_{t∈window(j)} a_t;  p_j = 0 when a_j = 0 or b_j = 0,
///   p_j = 1 when a_j > 0 = ā_j
///   ṽ_t = v_t + Σ_{j: t∈window(j)} (p_j / b_j)·v_j
/// Keys copied unchanged. gate[j] = p_j. Written per evicted token, O(n·B·d).
inline Merged merge_cam(long g, const std::vector<long>& kept, const Tensor3& K, const Tensor3& V,
                        const Eigen::MatrixXd& a, long B) {
  require(B >= 1, "the window must be >= 1");
  const long n = K.n, d = K.d, m = static_cast<long>(kept.size());
  std::vector<long> entry_of;
  Merged out = kept_rows(g, kept, K, V, entry_of);
  for (long j = 0; j < n; ++j) {
    if (entry_of[static_cast<std::size_t>(j)] >= 0) continue;
    std::vector<long> window;  // entries (indices into kept)
    for (long e = 0; e < m && static_cast<long>(window.size()) < B; ++e)
      if (kept[static_cast<std::size_t>(e)] > j) window.push_back(e);
    if (window.empty()) continue;
    const double b = static_cast<double>(window.size());
    double mean = 0.0;
    for (long e : window) mean += a(g, kept[static_cast<std::size_t>(e)]);
    mean /= b;
    double p = 0.0;
    if (a(g, j) > 0.0) p = mean == 0.0 ? 1.0 : std::min(a(g, j) / mean, 1.0);
    out.gate[static_cast<std::size_t>(j)] = p;
    for (long e : window)
      for (long k = 0; k < d; ++k) out.values(e, k) += p / b * V.at(g, j, k);
  }
  return out;
}

// ----------------------------------------------------------------------------------------------------
// §8 Compensators (one bias per kept entry)
// ----------------------------------------------------------------------------------------------------

/// AttentionRatio (SelKV Eq. 6) for KV head g: R_i = (max(a_i,τ) + Σ_{j→i} g_j a_j) / max(a_i,τ),
/// optionally capped R_i <= r_max (r_max = 0: off); bias α·log R_i. gate: n entries from `merge`.
inline std::vector<double> bias_attention_ratio(long g, const std::vector<long>& kept,
                                                const std::vector<long>& route, const std::vector<double>& gate,
                                                const Eigen::MatrixXd& a, double alpha, double r_max) {
  const long n = static_cast<long>(route.size());
  const double tau = mass_floor(a, g);
  std::vector<double> bias;
  for (long i : kept) {
    double merged = 0.0;
    for (long j = 0; j < n; ++j)
      if (j != i && route[static_cast<std::size_t>(j)] == i) merged += gate[static_cast<std::size_t>(j)] * a(g, j);
    const double ai = std::max(a(g, i), tau);
    double R = (ai + merged) / ai;
    if (r_max > 0.0) R = std::min(R, r_max);
    bias.push_back(alpha * std::log(R));
  }
  return bias;
}

/// MergeCount (KeepKV style): bias log(1 + M_i), M_i = Σ_{j→i} g_j.
inline std::vector<double> bias_merge_count(const std::vector<long>& kept, const std::vector<long>& route,
                                            const std::vector<double>& gate) {
  const long n = static_cast<long>(route.size());
  std::vector<double> bias;
  for (long i : kept) {
    double M = 0.0;
    for (long j = 0; j < n; ++j)
      if (j != i && route[static_cast<std::size_t>(j)] == i) M += gate[static_cast<std::size_t>(j)];
    bias.push_back(std::log(1.0 + M));
  }
  return bias;
}

/// Shared selection: one bias per position, the mean over KV heads of the per-head biases
/// (all heads have the same kept set, so the vectors align entry by entry).
inline std::vector<double> shared_bias(const std::vector<std::vector<double>>& per_head) {
  require(!per_head.empty(), "no heads");
  std::vector<double> mean(per_head[0].size(), 0.0);
  for (const auto& b : per_head) {
    require(b.size() == mean.size(), "per-head bias lengths differ");
    for (std::size_t e = 0; e < b.size(); ++e) mean[e] += b[e];
  }
  for (double& x : mean) x /= static_cast<double>(per_head.size());
  return mean;
}

// ----------------------------------------------------------------------------------------------------
// §10 RoPE
// ----------------------------------------------------------------------------------------------------

/// Frequency of rotary pair i: θ^(−2i/rotary_dim).
inline double rope_frequency(long i, long rotary_dim, double theta) {
  return std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
}

/// Indices of rotary pair i: interleaved (2i, 2i+1); half-split (i, i + rotary_dim/2).
inline void rope_pair(long i, long rotary_dim, bool half_split, long& first, long& second) {
  first = half_split ? i : 2 * i;
  second = half_split ? i + rotary_dim / 2 : 2 * i + 1;
}

inline void rope_check(long d, long rotary_dim) {
  require(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= d, "rotary_dim must be even and in (0, d]");
}

/// RoPE at position pos, in place on x[0..d): each pair (x_a, x_b) becomes
/// (x_a cos φ − x_b sin φ, x_a sin φ + x_b cos φ), φ = pos·θ^(−2i/rotary_dim). x[rotary_dim..d) untouched.
inline void rope_rotate(double* x, long d, long rotary_dim, double pos, double theta, bool half_split) {
  rope_check(d, rotary_dim);
  for (long i = 0; i < rotary_dim / 2; ++i) {
    long p, q;
    rope_pair(i, rotary_dim, half_split, p, q);
    const double phi = pos * rope_frequency(i, rotary_dim, theta);
    const double c = std::cos(phi), s = std::sin(phi), xa = x[p], xb = x[q];
    x[p] = xa * c - xb * s;
    x[q] = xa * s + xb * c;
  }
}

/// RoPE⁻¹ at position pos (the transpose rotation), in place.
inline void rope_unrotate(double* x, long d, long rotary_dim, double pos, double theta, bool half_split) {
  rope_check(d, rotary_dim);
  for (long i = 0; i < rotary_dim / 2; ++i) {
    long p, q;
    rope_pair(i, rotary_dim, half_split, p, q);
    const double phi = pos * rope_frequency(i, rotary_dim, theta);
    const double c = std::cos(phi), s = std::sin(phi), xa = x[p], xb = x[q];
    x[p] = xa * c + xb * s;
    x[q] = -xa * s + xb * c;
  }
}

/// SPEC §10 repositioning: k̃_e = RoPE(RoPE⁻¹(k_e, old_pos[e]), new_pos[e]), done literally as two
/// rotations. keys: (m,d) → (m,d).
inline Eigen::MatrixXd reposition(const Eigen::MatrixXd& keys, const std::vector<long>& old_pos,
                                  const std::vector<long>& new_pos, long rotary_dim, double theta,
                                  bool half_split) {
  const long m = keys.rows(), d = keys.cols();
  require(static_cast<long>(old_pos.size()) == m && static_cast<long>(new_pos.size()) == m,
          "one old and one new position per key");
  Eigen::MatrixXd out(m, d);  // (m,d)
  for (long e = 0; e < m; ++e) {
    std::vector<double> x = row_vector(keys, e);
    rope_unrotate(x.data(), d, rotary_dim, static_cast<double>(old_pos[static_cast<std::size_t>(e)]), theta, half_split);
    rope_rotate(x.data(), d, rotary_dim, static_cast<double>(new_pos[static_cast<std::size_t>(e)]), theta, half_split);
    for (long k = 0; k < d; ++k) out(e, k) = x[static_cast<std::size_t>(k)];
  }
  return out;
}

/// Contiguous positions 0..m−1 (the SPEC §10 target positions).
inline std::vector<long> contiguous_positions(long m) {
  std::vector<long> p(static_cast<std::size_t>(m));
  for (long e = 0; e < m; ++e) p[static_cast<std::size_t>(e)] = e;
  return p;
}

// ----------------------------------------------------------------------------------------------------
// §8 decode attention with bias, and window output error
// ----------------------------------------------------------------------------------------------------

/// Decode attention (no causal mask: the decoded token sees every cache entry).
///   q: (Hq,d); K, V: [Hkv][t][d]; bias: (Hkv, b) with b <= t, entries j >= b have bias 0 (tokens
///   appended after compression). logit = softcap(scale·<q,k_j>) + bias_j. Returns (Hq,d).
inline Eigen::MatrixXd decode_attention(const Eigen::MatrixXd& q, const Tensor3& K, const Tensor3& V,
                                        const Eigen::MatrixXd& bias, double scale, double softcap) {
  const long Hq = q.rows(), d = q.cols(), Hkv = K.H, t = K.n;
  require(K.d == d && V.d == d && V.H == Hkv && V.n == t, "q, K, V shapes differ");
  require(Hkv > 0 && Hq % Hkv == 0 && t > 0, "Hq must be a multiple of Hkv, t > 0");
  require(bias.size() == 0 || (bias.rows() == Hkv && bias.cols() <= t), "bias must be (Hkv, <= t)");
  const long G = Hq / Hkv;
  Eigen::MatrixXd out = Eigen::MatrixXd::Zero(Hq, d);  // (Hq,d)
  for (long h = 0; h < Hq; ++h) {
    const long g = h / G;
    const std::vector<double> qh = row_vector(q, h);
    std::vector<double> logits;
    for (long j = 0; j < t; ++j) {
      const double b = j < bias.cols() ? bias(g, j) : 0.0;
      logits.push_back(apply_softcap(scale * dot(qh.data(), K.vec(g, j), d), softcap) + b);
    }
    const std::vector<double> p = softmax(logits);
    for (long j = 0; j < t; ++j)
      for (long k = 0; k < d; ++k) out(h, k) += p[static_cast<std::size_t>(j)] * V.at(g, j, k);
  }
  return out;
}

/// One KV head of a compressed cache: kept ORIGINAL positions (ascending, used for causal visibility),
/// the (possibly merged / repositioned) keys and values (m,d) and the bias (m; empty = 0).
struct CompressedHead {
  std::vector<long> positions;
  Eigen::MatrixXd keys, values;  // (m,d)
  std::vector<double> bias;      // (m) or empty
};

/// Full-cache window outputs Y_h = A_h V_{h/G}, one (W,d) matrix per query head.
inline std::vector<Eigen::MatrixXd> window_output_full(const Tensor3& Q, const Tensor3& K, const Tensor3& V,
                                                       double scale, double softcap) {
  const std::vector<Eigen::MatrixXd> probs = window_probs(Q, K, scale, softcap);
  const long G = Q.H / K.H;
  std::vector<Eigen::MatrixXd> Y;
  for (long h = 0; h < Q.H; ++h) Y.push_back(probs[static_cast<std::size_t>(h)] * head_matrix(V, h / G));
  return Y;
}

/// Window outputs over a compressed cache, one (W,d) matrix per query head: row i (position p_i, same
/// W > n rule as window_probs) attends to entries with original position <= p_i, logit =
/// softcap(scale·<q, key_e>) + bias_e. A row that sees no entry outputs 0.
inline std::vector<Eigen::MatrixXd> window_output_compressed(const Tensor3& Q, long n,
                                                             const std::vector<CompressedHead>& heads,
                                                             double scale, double softcap) {
  const long Hkv = static_cast<long>(heads.size());
  require(Hkv > 0 && Q.H % Hkv == 0, "Hq must be a multiple of the number of compressed heads");
  const long G = Q.H / Hkv, d = Q.d, W = std::min(Q.n, n), row_offset = Q.n - W;
  std::vector<Eigen::MatrixXd> Y;
  for (long h = 0; h < Q.H; ++h) {
    const CompressedHead& c = heads[static_cast<std::size_t>(h / G)];
    const long m = static_cast<long>(c.positions.size());
    require(c.keys.rows() == m && c.values.rows() == m && c.keys.cols() == d && c.values.cols() == d,
            "compressed head shapes differ");
    Eigen::MatrixXd Yh = Eigen::MatrixXd::Zero(W, d);  // (W,d)
    for (long i = 0; i < W; ++i) {
      const long p_i = n - W + i;
      std::vector<long> visible;
      std::vector<double> logits;
      for (long e = 0; e < m; ++e) {
        if (c.positions[static_cast<std::size_t>(e)] > p_i) continue;
        const std::vector<double> key = row_vector(c.keys, e);
        const double b = c.bias.empty() ? 0.0 : c.bias[static_cast<std::size_t>(e)];
        visible.push_back(e);
        logits.push_back(apply_softcap(scale * dot(Q.vec(h, row_offset + i), key.data(), d), softcap) + b);
      }
      const std::vector<double> p = softmax(logits);
      for (std::size_t v = 0; v < visible.size(); ++v)
        for (long k = 0; k < d; ++k) Yh(i, k) += p[v] * c.values(visible[v], k);
    }
    Y.push_back(Yh);
  }
  return Y;
}

/// ‖Y_full − Y_compressed‖_F / ‖Y_full‖_F over all query heads and window rows.
inline double window_output_error(const Tensor3& Q, const Tensor3& K, const Tensor3& V,
                                  const std::vector<CompressedHead>& heads, double scale, double softcap) {
  const std::vector<Eigen::MatrixXd> full = window_output_full(Q, K, V, scale, softcap);
  const std::vector<Eigen::MatrixXd> comp = window_output_compressed(Q, K.n, heads, scale, softcap);
  double diff = 0.0, ref = 0.0;
  for (std::size_t h = 0; h < full.size(); ++h) {
    diff += (full[h] - comp[h]).squaredNorm();
    ref += full[h].squaredNorm();
  }
  return std::sqrt(diff) / std::sqrt(ref);
}

/// PyramidKV's per-layer budgets before rounding (kvpress's PyramidKVPress rule, written from its
/// formula): L layers, n tokens, average budget m, window w, β. Empty when the rule falls back to m for
/// every layer.
inline std::vector<double> pyramid_exact(long L, long n, long m, long w, double beta) {
  const double M = double(std::min(m, n));
  double lo = M / beta, hi = 2 * M - lo;
  if (hi >= double(n - w)) {
    hi = double(n - w);
    lo = 2 * M - hi;
  }
  if (L < 2 || !(double(n) >= hi && hi >= lo && lo >= double(std::max(w, 1L)))) return {};
  std::vector<double> out;
  for (long l = 0; l < L; ++l) out.push_back(hi - double(l) * (hi - lo) / double(L - 1));
  return out;
}

/// Threshold selection (kvpress ThresholdPress) per KV head, written from its definition: the set
/// {the r newest} ∪ {j : score ≥ τ} (NaN never qualifies), the newest token when that is empty; when it
/// exceeds the cap m, the r newest (newest first) and then the highest scores (lower position first on
/// ties) up to m. Returns the kept positions ascending.
inline std::vector<long> select_threshold(const Eigen::VectorXd& s, double tau, long recent, long cap) {
  const long n = s.size(), r = std::min(recent, n), m = std::min(cap, n);
  std::vector<long> forced, rest;
  for (long j = n - 1; j >= n - r; --j) forced.push_back(j);
  for (long j = 0; j < n - r; ++j)
    if (s[j] >= tau) rest.push_back(j);
  if (forced.empty() && rest.empty()) return {n - 1};
  std::stable_sort(rest.begin(), rest.end(), [&](long a, long b) { return s[a] > s[b]; });
  std::vector<long> all = forced;
  all.insert(all.end(), rest.begin(), rest.end());
  if (static_cast<long>(all.size()) > m) all.resize(static_cast<std::size_t>(m));
  std::sort(all.begin(), all.end());
  return all;
}

}  // namespace kvc::ref
