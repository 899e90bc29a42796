// Quality metrics of a compressed layer against the full cache on the observation window.
#pragma once
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/result.hpp"

namespace kvc {

/// Relative attention-output error on the window, over all query heads:
///   ‖Y_full − Y_comp‖_F / ‖Y_full‖_F,  Y_full = A V (SPEC §2), Y_comp = softmax(logits + bias) Ṽ
/// where window row i (entry n − W + i at position p_i: its stored position, or n − W + i) sees the
/// compressed entries whose original position is ≤ p_i (a merged entry sits at its kept token's
/// position). O(Hq·W·(n + m)·d). Throws kvc::error
/// when the result does not belong to the layer's shape.
template <class T, class Real>
double window_output_error(const LayerView<T>& layer, const LayerResult<Real>& result,
                           const AttentionArguments& args = {}) {
  static_assert(std::is_same_v<Real, compute_t<T>>, "result must come from a layer of the same element type");
  validate_layer(layer, false).throw_if_error();
  const Index H = layer.kv_heads(), n = layer.tokens(), W = layer.window(), d = layer.head_dim();
  if (static_cast<Index>(result.heads.size()) != H)
    throw error(detail::concat("window_output_error: result has ", result.heads.size(), " heads, layer has ", H));
  const Real scale = static_cast<Real>(args.resolved_scale(d));
  double num = 0.0, den = 0.0;
  for (Index g = 0; g < H; ++g) {
    const auto& hr = result.heads[g];
    if (hr.keys.cols() != d)
      throw error(detail::concat("window_output_error: head ", g, " has dim ", hr.keys.cols(), ", layer has ", d));
    RowMatrix<Real> probs;
    window_probabilities<Real>(layer, g, args, probs);  // (G·W, n)
    RowMatrix<Real> v(n, d);
    detail::gather_rows<Real>(layer.values, g, 0, n, v);
    const RowMatrix<Real> y_full = probs * v;  // (G·W, d)
    const RowMatrix<Real> qg = gather_group_queries<Real>(layer, g);
    RowMatrix<Real> logits = scale * (qg * hr.keys.transpose());  // (G·W, m)
    if (args.softcap > 0.0) {
      const Real c = static_cast<Real>(args.softcap);
      logits = (c * (logits.array() / c).tanh()).matrix();
    }
    for (Index r = 0; r < qg.rows(); ++r) {
      const Index p = layer.positions.at(g, n - W + (r % W));  // stored positions, when the view has them
      Real mx = -std::numeric_limits<Real>::infinity();
      for (Index i = 0; i < hr.size(); ++i)
        if (hr.positions[i] <= p) mx = std::max(mx, logits(r, i) + hr.bias[i]);
      Real sum = 0;
      Vector<Real> y = Vector<Real>::Zero(d);
      for (Index i = 0; i < hr.size(); ++i) {
        if (hr.positions[i] > p) continue;
        const Real w = std::exp(logits(r, i) + hr.bias[i] - mx);
        sum += w;
        y += w * hr.values.row(i).transpose();
      }
      if (sum > Real(0)) y /= sum;
      num += (y_full.row(r).transpose() - y).squaredNorm();
      den += y_full.row(r).squaredNorm();
    }
  }
  return den > 0.0 ? std::sqrt(num / den) : 0.0;
}

}  // namespace kvc
