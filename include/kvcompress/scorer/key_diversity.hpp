// KeyDiff's scorer: keys that point away from the head's mean key direction are kept.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvc {

/// KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
/// Inference in Resource-Constrained Environments", 2025):
///   c_g[j] = −cos(k_{g,j}, ā_g),   ā_g = (1/n) · Σ_j k_{g,j} / ‖k_{g,j}‖
/// A zero key contributes 0 to ā_g, and a cosine with a zero vector is 0. Needs no window attention.
/// Each key is scaled to unit length in double arithmetic through its largest entry, so that any
/// finite key gives a finite score and a NaN/Inf key a NaN one. Two passes over K_g: O(n·d), O(d)
/// memory.
struct KeyDiversity {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool covers_keys = true;  // a NaN/Inf key makes ā_g, hence every score, NaN
  };
  Arguments args;

  Status validate() const { return Status::ok(); }

  /// u (d) <- x / ‖x‖ (0 for x = 0, NaN when x holds a NaN or Inf), computed through x / max|x_c|.
  template <class E>
  static void unit_vector(const E* x, Vector<double>& u) {
    const Index d = u.size();
    double top = 0;
    for (Index c = 0; c < d; ++c) top = std::max(top, std::abs(to_real<double>(x[c])));
    if (!(top < std::numeric_limits<double>::infinity())) {  // NaN or Inf
      u.setConstant(std::numeric_limits<double>::quiet_NaN());
      return;
    }
    if (top == 0.0) {
      u.setZero();
      return;
    }
    for (Index c = 0; c < d; ++c) u[c] = to_real<double>(x[c]) / top;
    u /= u.norm();
  }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const Index n = ctx.tokens(), d = ctx.head_dim();
    Vector<double> unit(d), anchor = Vector<double>::Zero(d);  // (d)
    for (Index j = 0; j < n; ++j) {
      unit_vector(ctx.key(j), unit);
      anchor += unit;
    }
    anchor /= static_cast<double>(n);  // ā_g
    unit_vector(anchor.data(), anchor);
    out.resize(n);
    for (Index j = 0; j < n; ++j) {
      unit_vector(ctx.key(j), unit);
      out[j] = static_cast<Real>(-unit.dot(anchor));
    }
  }
};

}  // namespace kvc
