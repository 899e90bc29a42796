// Compensators (SPEC §8): one additive decode-time logit bias per kept entry.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/merger/gated_merge.hpp"
#include "kvcompress/policy.hpp"

#include <cmath>

namespace kvc {

/// No compensation: bias 0. The no-op compensator.
struct NoCompensation {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool reads_kept_keys = false;  // no rows at all
    static constexpr bool reads_kept_values = false;
  };
  Arguments args;
  Status validate() const { return Status::ok(); }
  template <class T>
  void compensate(const HeadContext<T>& ctx, const Routing&, const MergeOutput<compute_t<T>>&,
                  Vector<compute_t<T>>& bias) const {
    bias.setZero(static_cast<Index>(ctx.kept().size()));
  }
};

/// SelKV Eq. 6, the attention-sag correction:
///   R_i = (max(a_i,τ) + Σ_{j→i} g_j·a_j) / max(a_i,τ),   bias_i = α·log R_i   (R_i ≤ R_max if set)
struct AttentionRatio {
  struct Arguments {
    double alpha = 0.5;
    double r_max = 0.0;  ///< cap on R; 0 = off (the default: R is heavy-tailed in practice)
  };
  struct traits : PolicyTraits {
    static constexpr bool needs_mass = true;
    static constexpr bool reads_kept_keys = false;  // no rows at all
    static constexpr bool reads_kept_values = false;
  };
  Arguments args;

  /// log R <= log(1 + 1e12·n) < 70 for any n a view can hold (R <= (τ + W)/τ, τ >= 1e-12·W/n), so
  /// |α| <= kMaxAlpha keeps every bias below 7e31, finite in float.
  static constexpr double kMaxAlpha = 1e30;

  Status validate() const {
    if (!(std::abs(args.alpha) <= kMaxAlpha))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("compensator.alpha must be finite with |alpha| <= ", kMaxAlpha, ", got ",
                                         args.alpha));
    if (!(args.r_max == 0.0 || args.r_max >= 1.0) || !std::isfinite(args.r_max))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("compensator.r_max must be 0 (off) or >= 1, got ", args.r_max));
    return Status::ok();
  }

  template <class T>
  void compensate(const HeadContext<T>& ctx, const Routing& routing,
                  const MergeOutput<compute_t<T>>& merged, Vector<compute_t<T>>& bias) const {
    using Real = compute_t<T>;
    const auto& kept = ctx.kept();
    const auto& a = ctx.mass();
    const Index m = static_cast<Index>(kept.size());
    bias.setZero(m);
    if (!routing.routed()) return;
    const Real tau = detail::mass_floor(a);
    // The added mass Σ_{π(j)=i} g_j·a_j is summed in `bias` itself, then replaced by the bias.
    const auto& evicted = ctx.evicted();
    for (std::size_t e = 0; e < evicted.size(); ++e)
      bias[routing.target[e]] += merged.gate[static_cast<Index>(e)] * a[evicted[e]];
    for (Index i = 0; i < m; ++i) {
      const Real added = bias[i];
      bias[i] = Real(0);
      if (added <= Real(0)) continue;
      const Real own = std::max(a[kept[i]], tau);
      double r = (double(own) + double(added)) / double(own);
      if (args.r_max > 0.0) r = std::min(r, args.r_max);
      bias[i] = static_cast<Real>(args.alpha * std::log(r));
    }
  }
};

/// KeepKV-style merge count: bias_i = log(1 + M_i), M_i = Σ_{j→i} g_j.
struct MergeCount {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool reads_kept_keys = false;  // no rows at all
    static constexpr bool reads_kept_values = false;
  };
  Arguments args;
  Status validate() const { return Status::ok(); }

  template <class T>
  void compensate(const HeadContext<T>& ctx, const Routing& routing,
                  const MergeOutput<compute_t<T>>& merged, Vector<compute_t<T>>& bias) const {
    using Real = compute_t<T>;
    const Index m = static_cast<Index>(ctx.kept().size());
    bias.setZero(m);
    if (!routing.routed()) return;
    // M_i is summed in `bias` itself, then replaced by the bias.
    for (std::size_t e = 0; e < routing.target.size(); ++e)
      bias[routing.target[e]] += merged.gate[static_cast<Index>(e)];
    for (Index i = 0; i < m; ++i) {
      const Real count = bias[i];
      bias[i] = count > Real(0) ? static_cast<Real>(std::log1p(double(count))) : Real(0);
    }
  }
};

}  // namespace kvc
