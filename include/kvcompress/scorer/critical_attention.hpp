// CriticalKV's scorer (as kvpress's CriticalKVPress over SnapKV computes it): SnapKV's pooled window
// mass, whose top share of the budget is kept first, and the rest rescaled by ‖W_o v‖₁.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/selector/top_k.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace kvc {

/// CriticalKV (Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation
/// Perspective", 2025), in kvpress's two stages over SnapKV's score. For KV head g with budget m
/// (ScoreContext::budget(), before any allocator) and window W:
///   s_j  = average-pooled (kernel `pool_kernel`, zero padding) a_g over the entries before the
///          window; the W window entries get the largest of those (kvpress's SnapKV)
///   S₁   = the ⌊first_stage·m⌋ entries of largest s (window entries first, then ties: lower position)
///   w_j  = (1/G) Σ_{h in g} ‖W_o[:, h·d:(h+1)·d] · v_j‖₁          (kvpress's vwl1norm)
///   c_j  = Real's largest finite value for j in S₁, (s_j + ε) · w_j otherwise
/// so a selector's top m keeps S₁, then the entries of largest (s + ε)·w. W_o is the layer's
/// output_projection ([D][Hq·d], float), required (validate(layer)). A context without a budget
/// (0) has no first stage. The scores are final: pair it with a selector that does not pool them.
/// O(n·G·d·D) for the products (blocks of `block` tokens, O(block·D + d·D) memory) and O(n·kernel).
struct CriticalAttention {
  struct Arguments {
    Index pool_kernel = 5;     ///< odd average-pooling kernel of the window mass; 0 or 1 = none
    double epsilon = 1e-4;     ///< ε added to s before the rescaling (kvpress's default)
    double first_stage = 0.5;  ///< share of the budget kept by s alone, in [0, 1]
    Index block = 256;         ///< tokens per W_o·v product (memory only, not a result option)
  };
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;
  };
  Arguments args;

  Status validate() const {
    using detail::concat;
    if (args.pool_kernel < 0 || (args.pool_kernel > 1 && args.pool_kernel % 2 == 0))
      return Status::fail(Status::Code::invalid_argument,
                          concat("scorer.pool_kernel must be odd, 0 or 1, got ", args.pool_kernel));
    if (!(args.epsilon >= 0.0) || !std::isfinite(args.epsilon))
      return Status::fail(Status::Code::invalid_argument, concat("scorer.epsilon must be finite and >= 0, got ", args.epsilon));
    if (!(args.first_stage >= 0.0 && args.first_stage <= 1.0))
      return Status::fail(Status::Code::invalid_argument,
                          concat("scorer.first_stage must be in [0, 1], got ", args.first_stage));
    if (args.block < 1)
      return Status::fail(Status::Code::invalid_argument, concat("scorer.block must be >= 1, got ", args.block));
    return Status::ok();
  }

  /// The layer must carry its output projection W_o, [D][Hq·d], every entry finite.
  template <class T>
  Status validate(const LayerView<T>& layer) const {
    return detail::check_output_projection(layer, /*required=*/true, /*scan=*/true, "CriticalKV's scorer");
  }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    validate().throw_if_error();
    detail::check_output_projection(ctx.layer(), /*required=*/true, /*scan=*/false, "CriticalKV's scorer")
        .throw_if_error();
    const Index n = ctx.tokens(), W = ctx.window(), lo = n - W;
    // Stage 1's ranking score s.
    Vector<Real> s;
    pool_region(ctx.mass(), 0, lo, args.pool_kernel, args.pool_kernel > 1 ? Pooling::average : Pooling::none, s);
    Real top = 0;
    for (Index j = 0; j < lo; ++j) top = j == 0 ? s[j] : std::max(top, s[j]);
    for (Index j = lo; j < n; ++j) s[j] = top;
    // Stage 2: (s + ε)·w.
    value_weights(ctx, out);
    const Real eps = static_cast<Real>(args.epsilon);
    for (Index j = 0; j < n; ++j) out[j] = (s[j] + eps) * out[j];
    if (!out.allFinite()) check_overflow(ctx, s);
    // S₁: the window, then the largest s (a NaN, possible only with check_finite off, ranks last).
    const Index k1 = std::min<Index>(n, static_cast<Index>(std::floor(args.first_stage * double(ctx.budget()))));
    if (k1 <= 0) return;
    std::vector<std::pair<Real, Index>> cand;
    cand.reserve(static_cast<std::size_t>(n));
    for (Index j = 0; j < n; ++j)
      cand.emplace_back(j >= lo ? std::numeric_limits<Real>::infinity() : s[j], j);
    const auto better = [](const std::pair<Real, Index>& a, const std::pair<Real, Index>& b) {
      const bool a_nan = std::isnan(a.first), b_nan = std::isnan(b.first);
      if (a_nan || b_nan) return a_nan == b_nan ? a.second < b.second : b_nan;
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    if (k1 < n) std::nth_element(cand.begin(), cand.begin() + k1, cand.end(), better);
    for (Index i = 0; i < k1; ++i) out[cand[static_cast<std::size_t>(i)].second] = std::numeric_limits<Real>::max();
  }

  /// Error path: a non-finite stage-2 score from a finite value row and mass is an overflow (a value
  /// row that is not finite is reported by the pipeline's own scan).
  template <class T>
  static void check_overflow(const ScoreContext<T>& ctx, const Vector<compute_t<T>>& s) {
    const Index d = ctx.head_dim();
    for (Index j = 0; j < ctx.tokens(); ++j) {
      if (!std::isfinite(s[j])) continue;
      bool finite = true;
      for (Index c = 0; c < d; ++c) finite = finite && std::isfinite(to_real<double>(ctx.value(j)[c]));
      if (finite)
        throw error(detail::concat("the CriticalKV score of entry ", j, " of KV head ", ctx.head(),
                                   " is not finite although its value and mass are: (s + eps)·‖W_o v‖₁ overflows ",
                                   "the arithmetic type"));
    }
  }

  /// w (n) <- (1/G) Σ_{h in g} ‖W_h v_j‖₁, W_h the (D, d) column slice of W_o for query head h.
  template <class T>
  void value_weights(const ScoreContext<T>& ctx, Vector<compute_t<T>>& w) const {
    using Real = compute_t<T>;
    const LayerView<T>& layer = ctx.layer();
    const ProjectionView& wo = layer.output_projection;
    const Index n = ctx.tokens(), d = ctx.head_dim(), G = ctx.group_size(), D = wo.rows, g = ctx.head();
    const Index block = std::min(args.block, std::max<Index>(n, 1));
    w.setZero(n);
    RowMatrix<Real> wt(d, D), vb(block, d), prod(block, D);  // W_hᵀ, a block of V_g, their product
    for (Index h = 0; h < G; ++h) {
      const Index col0 = (g * G + h) * d;
      for (Index r = 0; r < D; ++r)
        for (Index c = 0; c < d; ++c) wt(c, r) = static_cast<Real>(wo.at(r, col0 + c));
      for (Index j0 = 0; j0 < n; j0 += block) {
        const Index b = std::min(block, n - j0);
        for (Index i = 0; i < b; ++i) {
          const T* v = ctx.value(j0 + i);
          for (Index c = 0; c < d; ++c) vb(i, c) = to_real<Real>(v[c]);
        }
        prod.topRows(b).noalias() = vb.topRows(b) * wt;
        w.segment(j0, b) += prod.topRows(b).cwiseAbs().rowwise().sum();
      }
    }
    w /= static_cast<Real>(G);
  }
};

}  // namespace kvc
