// RoPE repositioning (SPEC §10, SelKV Eq. 7): re-embed kept keys at new positions.
#pragma once
#include "kvcompress/core.hpp"

#include <cmath>

namespace kvc {

/// Which dimensions RoPE rotates together.
enum class RopeLayout {
  interleaved,  ///< pairs (x[2i], x[2i+1]): Meta, llama2.c, GGML "normal"
  half_split    ///< pairs (x[i], x[i + r/2]): NeoX, HF "rotate_half"
};

inline const char* to_string(RopeLayout l) { return l == RopeLayout::interleaved ? "interleaved" : "half_split"; }

/// Repositioning options. Off by default; when on, kept keys move to positions 0..m−1 and the next
/// decoded token must use position m.
struct RopeArguments {
  bool enabled = false;
  RopeLayout layout = RopeLayout::interleaved;
  double theta = 10000.0;  ///< base
  Index rotary_dim = 0;    ///< rotated dimensions r (even, ≤ d); 0 = d

  /// `used`: a policy reads these arguments (PolicyTraits::reads_rope), so they are checked even
  /// with repositioning off.
  Status validate(Index d, bool used = false) const {
    using detail::concat;
    if (layout != RopeLayout::interleaved && layout != RopeLayout::half_split)
      return Status::fail(Status::Code::invalid_argument,
                          concat("rope.layout must be interleaved or half_split, got ", static_cast<int>(layout)));
    if (!enabled && !used) return Status::ok();
    if (!(theta > 0.0) || !std::isfinite(theta))
      return Status::fail(Status::Code::invalid_argument, concat("rope.theta must be > 0, got ", theta));
    const Index r = rotary_dim == 0 ? d : rotary_dim;
    if (r < 0 || r > d || r % 2 != 0)
      return Status::fail(Status::Code::invalid_argument,
                          concat("rope.rotary_dim must be even and <= d = ", d, ", got ", rotary_dim));
    return Status::ok();
  }
};

/// Rotates x (d) in place by the RoPE angle of a position shift `delta` (p_new − p_old):
/// RoPE(RoPE⁻¹(k, p_old), p_new) = rotation by delta·θ^(−2i/r) on pair i. Angles in double. O(d).
template <class Real>
void rope_shift(Real* x, Index d, const RopeArguments& rope, double delta) {
  const Index r = rope.rotary_dim == 0 ? d : rope.rotary_dim;
  const Index pairs = r / 2;
  for (Index i = 0; i < pairs; ++i) {
    const double freq = std::pow(rope.theta, -2.0 * double(i) / double(r));
    const double angle = delta * freq;
    const double c = std::cos(angle), s = std::sin(angle);
    const Index i0 = rope.layout == RopeLayout::interleaved ? 2 * i : i;
    const Index i1 = rope.layout == RopeLayout::interleaved ? 2 * i + 1 : i + pairs;
    const double x0 = double(x[i0]), x1 = double(x[i1]);
    x[i0] = static_cast<Real>(x0 * c - x1 * s);
    x[i1] = static_cast<Real>(x0 * s + x1 * c);
  }
}

}  // namespace kvc
