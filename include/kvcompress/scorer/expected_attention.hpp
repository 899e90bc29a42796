// Expected Attention's scorer (as kvpress's ExpectedAttentionPress computes it): the attention that
// future queries, modelled as a Gaussian fitted to the window queries, are expected to pay each token,
// times the token's value norm.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE
#include "kvcompress/simd/kernels.hpp"
#include "kvcompress/simd/window_gemm.hpp"

#include <Eigen/Cholesky>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvc {

/// Expected Attention (Devoto et al., "Expected Attention: KV Cache Compression by Estimating
/// Attention from Future Queries Distribution", 2025), with kvpress's ExpectedAttentionPress defaults.
/// Per query head h of KV head g's group, from the window queries at entries ≥ sinks:
///   u_i = RoPE⁻¹(q_{h,i}, p_i)                          pre-RoPE queries (p_i: the entry's position)
///   μ = mean u_i,  Σ = (1/N)·Σ_i (u_i − μ)(u_i − μ)ᵀ   (population covariance, N rows)
///   R̄ = (1/T)·Σ_{t<T} R(P + t)                         the RoPE rotation averaged over the next T
///                                                        positions, P = p_{n−1} + 1
///   z_h[j] = s·<R̄μ, k_j> + (s²/2)·k_jᵀ R̄ΣR̄ᵀ k_j + b_j    (s the logit scale, b_j the stored bias)
///   c_g[j] = ((1/G)·Σ_h softmax_{j ≥ sinks}(z_h)[j] + ε)·‖v_{g,j}‖    (j ≥ sinks)
/// and the sinks score the head's highest score. RoPE layout, base and rotary dimension are the
/// pipeline's Arguments::reposition (traits::reads_rope). k_jᵀ R̄ΣR̄ᵀ k_j is a sum of squares of
/// min(N, d) dot products (R̄ΣR̄ᵀ = FᵀF, F the scaled rotated centred queries, or an LDLᵀ factor when
/// N > d), so the head costs one (G·(1 + min(N, d)) × d × n) product: about the window product.
/// O(G·N·d² + n·G·min(N, d)·d), memory O(G·min(N, d)·(d + tile)) and O(G·n).
struct ExpectedAttention {
  struct Arguments {
    Index future_positions = 512;  ///< T: future positions the RoPE rotation is averaged over (kvpress n_future_positions)
    Index sinks = 4;               ///< first tokens left out of the softmax and the statistics, scored first (kvpress n_sink)
    bool covariance = true;        ///< include the (s²/2)·kᵀΣk term (kvpress use_covariance)
    bool value_norm = true;        ///< multiply by ‖v_j‖ after adding ε (kvpress use_vnorm)
    double epsilon = 0.0;          ///< ε added to the attention before the value norm (kvpress epsilon)
  };
  struct traits : PolicyTraits {
    static constexpr bool reads_rope = true;  // un-rotates the window queries and averages the rotation
  };
  Arguments args;

  Status validate() const {
    using detail::concat;
    if (args.future_positions < 1)
      return Status::fail(Status::Code::invalid_argument,
                          concat("scorer.future_positions must be >= 1, got ", args.future_positions));
    if (args.sinks < 0)
      return Status::fail(Status::Code::invalid_argument, concat("scorer.sinks must be >= 0, got ", args.sinks));
    if (!(args.epsilon >= 0.0) || !std::isfinite(args.epsilon))
      return Status::fail(Status::Code::invalid_argument,
                          concat("scorer.epsilon must be finite and >= 0, got ", args.epsilon));
    return Status::ok();
  }

  /// The RoPE pairs of a head dimension d: pair i rotates dims first(i) and second(i) by angle p·ω_i.
  struct RopePairs {
    std::vector<Index> first, second;
    std::vector<double> omega;
    RopePairs(const RopeArguments& rope, Index d) {
      const Index r = rope.rotary_dim == 0 ? d : rope.rotary_dim, pairs = r / 2;
      for (Index i = 0; i < pairs; ++i) {
        first.push_back(rope.layout == RopeLayout::interleaved ? 2 * i : i);
        second.push_back(rope.layout == RopeLayout::interleaved ? 2 * i + 1 : i + pairs);
        omega.push_back(std::pow(rope.theta, -2.0 * double(i) / double(r)));
      }
    }
    std::size_t size() const { return omega.size(); }
  };

  /// Rotates each pair of x by (cos, sin) = (c[i], s[i]) (a rotation, or the averaged rotation R̄).
  static void rotate(double* x, const RopePairs& pairs, const std::vector<double>& c, const std::vector<double>& s) {
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const double x0 = x[pairs.first[i]], x1 = x[pairs.second[i]];
      x[pairs.first[i]] = c[i] * x0 - s[i] * x1;
      x[pairs.second[i]] = s[i] * x0 + c[i] * x1;
    }
  }

  /// (c̄_i, s̄_i) of R̄ = (1/T)·Σ_{t<T} R(P + t), closed form per pair: Σ_t e^{i(P+t)ω} =
  /// e^{i(P + (T−1)/2)ω}·sin(Tω/2)/sin(ω/2).
  static void average_rotation(const RopePairs& pairs, double P, double T, std::vector<double>& c,
                               std::vector<double>& s) {
    c.resize(pairs.size());
    s.resize(pairs.size());
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const double w = pairs.omega[i], half = std::sin(w / 2);
      const double phase = half == 0.0 ? P * w : (P + (T - 1) / 2) * w;
      const double damp = half == 0.0 ? 1.0 : std::sin(T * w / 2) / (T * half);
      c[i] = std::cos(phase) * damp;
      s[i] = std::sin(phase) * damp;
    }
  }

  /// rows (G·(1 + rank), d): per query head, s·R̄μ, then `rank` rows f with Σ_f <f, k>² =
  /// (s²/2)·kᵀR̄ΣR̄ᵀk. Returns rank (the same for every head).
  template <class T>
  Index factor_rows(const ScoreContext<T>& ctx, Index sinks, RowMatrix<double>& rows) const {
    const Index n = ctx.tokens(), d = ctx.head_dim(), W = ctx.window(), G = ctx.group_size();
    const Index first = std::max<Index>(0, sinks - (n - W));  // first window row at an entry ≥ sinks
    const Index N = W - first;                                // ≥ 1: entry n − 1 ≥ sinks
    const double s = ctx.attention().resolved_scale(d);
    const RopePairs pairs(ctx.rope(), d);
    std::vector<double> cb, sb, c(pairs.size()), sn(pairs.size());
    average_rotation(pairs, double(ctx.position(n - 1)) + 1.0, double(args.future_positions), cb, sb);
    const Index rank = args.covariance ? std::min(N, d) : 0;
    rows.resize(G * (1 + rank), d);
    RowMatrix<double> U(N, d);  // (N, d) pre-RoPE queries, then centred and rotated by R̄
    for (Index h = 0; h < G; ++h) {
      for (Index i = 0; i < N; ++i) {
        const T* q = ctx.query(h, first + i);
        for (Index k = 0; k < d; ++k) U(i, k) = to_real<double>(q[k]);
        const double p = double(ctx.position(n - W + first + i));
        for (std::size_t m = 0; m < pairs.size(); ++m) {
          c[m] = std::cos(p * pairs.omega[m]);
          sn[m] = -std::sin(p * pairs.omega[m]);
        }
        rotate(U.row(i).data(), pairs, c, sn);
      }
      const Eigen::RowVectorXd mu = U.colwise().mean();
      double* head = rows.row(h * (1 + rank)).data();
      Eigen::Map<Eigen::RowVectorXd>(head, d) = s * mu;
      rotate(head, pairs, cb, sb);
      if (rank == 0) continue;
      U.rowwise() -= mu;
      for (Index i = 0; i < N; ++i) rotate(U.row(i).data(), pairs, cb, sb);
      auto f = rows.middleRows(h * (1 + rank) + 1, rank);
      const double weight = s / std::sqrt(2.0 * double(N));
      if (N <= d) {
        f = weight * U;  // Σ_i <f_i, k>² = (s²/2N)·Σ_i <R̄(u_i − μ), k>²
      } else {           // R̄ΣR̄ᵀ·N = UᵀU = Pᵀ L D Lᵀ P: rows sqrt(D_m)·(PᵀL)_{·,m}
        const Eigen::MatrixXd gram = U.transpose() * U;
        const Eigen::LDLT<Eigen::MatrixXd> ldlt(gram);
        const Eigen::MatrixXd lower = ldlt.transpositionsP().transpose() * Eigen::MatrixXd(ldlt.matrixL());
        for (Index m = 0; m < d; ++m)
          f.row(m) = (weight * std::sqrt(std::max(0.0, ldlt.vectorD()[m]))) * lower.col(m).transpose();
      }
    }
    return rank;
  }

  /// out (n) <- the expected-attention scores of KV head ctx.head(). Throws kvc::error when an
  /// expected logit or a score overflows the arithmetic type.
  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const Index n = ctx.tokens(), d = ctx.head_dim(), G = ctx.group_size(), g = ctx.head();
    const Index sinks = std::min(args.sinks, n);
    out.resize(n);
    if (sinks == n) {  // nothing to rank
      out.setOnes();
      return;
    }
    RowMatrix<double> rows;
    const Index rank = factor_rows(ctx, sinks, rows);
    const Index R = rows.rows(), per_head = 1 + rank;
    RowMatrix<Real> z(G, n);  // (G, n) expected logits
    const RowMatrix<Real> M = rows.cast<Real>();
    constexpr Index tile = 256;
    const auto combine = [&](const Real* x, Index ldx, Index j0, Index cnt) {  // x (cnt, ≥ R)
      for (Index j = 0; j < cnt; ++j, x += ldx) {
        const Real bias = ctx.entry_bias(j0 + j);
        for (Index h = 0; h < G; ++h) {
          const Real* xh = x + h * per_head;
          Real quad = 0;
          if constexpr (std::is_same_v<Real, float>)
            quad = simd::sum_squares<simd::default_arch>(xh + 1, rank);
          else
            for (Index m = 1; m < per_head; ++m) quad += xh[m] * xh[m];
          z(h, j0 + j) = xh[0] + quad + bias;
        }
      }
    };
    if constexpr (std::is_same_v<Real, float>) {
      using Arch = simd::default_arch;
      const Index Rp = simd::padded_queries<Arch>(R);
      std::vector<float> packed(static_cast<std::size_t>(Rp * d)), x(static_cast<std::size_t>(tile * Rp));
      simd::pack_queries<Arch>(M.data(), d, R, d, 1.0f, packed.data());
      RowMatrix<float> keys;
      const TensorView<const T>& K = ctx.layer().keys;
      if (!std::is_same_v<T, float> || K.paged()) keys.resize(std::min(tile, n), d);
      for (Index j0 = 0; j0 < n; j0 += tile) {
        const Index cnt = std::min(tile, n - j0);
        if (std::is_same_v<T, float> && K.contiguous(j0, cnt)) {  // in place
          const float* first = nullptr;
          if constexpr (std::is_same_v<T, float>) first = K.row(g, j0);
          simd::window_logits_t<Arch>(first, K.token_stride, cnt, d, packed.data(), Rp, x.data(), Rp);
        } else {
          auto rows_f = keys.topRows(cnt);
          detail::gather_rows<float>(K, g, j0, cnt, rows_f);
          simd::window_logits_t<Arch>(keys.data(), d, cnt, d, packed.data(), Rp, x.data(), Rp);
        }
        combine(x.data(), Rp, j0, cnt);
      }
    } else {
      RowMatrix<Real> keys(std::min(tile, n), d), x;
      for (Index j0 = 0; j0 < n; j0 += tile) {
        const Index cnt = std::min(tile, n - j0);
        auto k = keys.topRows(cnt);
        detail::gather_rows<Real>(ctx.layer().keys, g, j0, cnt, k);
        x.noalias() = k * M.transpose();  // (cnt, R)
        combine(x.data(), R, j0, cnt);
      }
    }
    const Index live = n - sinks;
    if (!z.rightCols(live).allFinite())
      throw error(detail::concat("an expected-attention logit of KV head ", g,
                                 " is not finite: the window queries' statistics or the keys overflow the arithmetic type"));
    Vector<Real> attention = Vector<Real>::Zero(live);
    for (Index h = 0; h < G; ++h) {
      auto e = z.row(h).tail(live).array();
      e = (e - e.maxCoeff()).exp();
      attention += (e / e.sum()).matrix().transpose();
    }
    attention /= static_cast<Real>(G);
    for (Index j = sinks; j < n; ++j) {
      Real c = attention[j - sinks];
      if (args.value_norm) c = (c + static_cast<Real>(args.epsilon)) * detail::row_norm<Real>(ctx.value(j), d);
      out[j] = c;
    }
    if (!out.tail(live).allFinite())
      throw error(detail::concat("an expected-attention score of KV head ", g,
                                 " is not finite: (attention + epsilon) times a value norm overflows the arithmetic type"));
    out.head(sinks).setConstant(out.tail(live).maxCoeff());
  }
};

}  // namespace kvc
