// KeyDiff's scorer: keys that point away from the head's mean key direction are kept.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace kvc {

/// KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
/// Inference in Resource-Constrained Environments", 2025):
///   c_g[j] = −cos(k_{g,j}, ā_g),   ā_g = (1/n) · Σ_j k_{g,j} / ‖k_{g,j}‖
/// A zero key contributes 0 to ā_g, and a cosine with a zero vector is 0. Needs no window attention.
/// Float caches: norms and dots in float SIMD, the unit keys summed in blocks of 64 into a double sum;
/// a key whose squared norm is not a normal float (zero, tiny, huge, NaN/Inf) and double caches go
/// through double (double keys scaled through their largest entry), so that any finite key gives a
/// finite score and a NaN/Inf key a NaN one. Two passes over K_g: O(n·d), O(d)
/// memory.
struct KeyDiversity {
  struct Arguments {};
  struct traits : PolicyTraits {
    static constexpr bool covers_keys = true;  // a NaN/Inf key makes ā_g, hence every score, NaN
  };
  Arguments args;

  /// Unit keys summed in float before each addition to the double sum.
  static constexpr Index kBlock = 64;

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
    Vector<double> anchor = Vector<double>::Zero(d);  // (d)
    out.resize(n);
    if constexpr (std::is_same_v<T, double>) {  // keys whose squares may overflow: scaled first
      Vector<double> unit(d);  // (d)
      for (Index j = 0; j < n; ++j) {
        unit_vector(ctx.key(j), unit);
        anchor += unit;
      }
      anchor /= static_cast<double>(n);  // ā_g
      unit_vector(anchor.data(), anchor);
      for (Index j = 0; j < n; ++j) {
        unit_vector(ctx.key(j), unit);
        out[j] = static_cast<Real>(-unit.dot(anchor));
      }
    } else {  // float, half, bfloat16: float SIMD, double for a key whose ‖k‖² is not a normal float
      using A = simd::default_arch;
      constexpr float lo = std::numeric_limits<float>::min(), hi = std::numeric_limits<float>::max();
      Vector<float> part = Vector<float>::Zero(d);  // (d) Σ of up to kBlock unit keys, then added to anchor
      Index in_part = 0;
      for (Index j = 0; j < n; ++j) {
        const T* k = ctx.key(j);
        const float s = simd::sum_squares<A>(k, d);
        out[j] = static_cast<Real>(s);  // kept for the second pass
        if (s >= lo && s <= hi) {
          simd::axpy<A>(1.0f / std::sqrt(s), k, part.data(), d);
          if (++in_part == kBlock) {
            anchor += part.template cast<double>();
            part.setZero();
            in_part = 0;
          }
        } else {  // zero (contributes 0), tiny, huge, NaN or Inf: exact in double
          const double s2 = detail::squared_norm_double(k, d);
          if (s2 == 0.0) continue;
          const double inv = 1.0 / std::sqrt(s2);
          for (Index c = 0; c < d; ++c) anchor[c] += to_real<double>(k[c]) * inv;
        }
      }
      anchor += part.template cast<double>();
      anchor /= static_cast<double>(n);  // ā_g
      unit_vector(anchor.data(), anchor);
      const Vector<float> unit_anchor = anchor.template cast<float>();  // (d), entries in [−1, 1]
      for (Index j = 0; j < n; ++j) {
        const T* k = ctx.key(j);
        const float s = static_cast<float>(out[j]);
        if (s >= lo && s <= hi) {
          out[j] = static_cast<Real>(-simd::dot<A>(unit_anchor.data(), k, d) / std::sqrt(s));
        } else {
          const double s2 = detail::squared_norm_double(k, d);
          out[j] = s2 == 0.0 ? Real(0) : static_cast<Real>(-detail::dot_double(k, anchor.data(), d) / std::sqrt(s2));
        }
      }
    }
  }
};

}  // namespace kvc
