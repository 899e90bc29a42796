// Window attention over the observation window (SPEC §2): causal probabilities of the last W
// prefill queries over the whole cache, and the per-KV-head attention mass `a`.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/core.hpp"
#include "kvcompress/detail/rows.hpp"

#include <algorithm>

namespace kvc {

/// How logits are formed: `scale * <q, k>`, then the optional tanh soft-cap `c * tanh(x / c)`.
struct AttentionArguments {
  double scale = 0.0;    ///< 0 means 1/sqrt(d)
  double softcap = 0.0;  ///< 0 means off

  Status validate() const {
    if (!(scale >= 0.0) || !std::isfinite(scale))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("attention.scale must be finite and >= 0, got ", scale));
    if (!(softcap >= 0.0) || !std::isfinite(softcap))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("attention.softcap must be finite and >= 0, got ", softcap));
    return Status::ok();
  }
  double resolved_scale(Index d) const { return scale > 0.0 ? scale : 1.0 / std::sqrt(double(d)); }
};

namespace detail {
inline constexpr Index kKeyTile = 256;  // keys converted per tile for half/bfloat16 input
}

/// Group queries of KV head `g`, stacked: (G·W, d), row r = local_head * W + i, where window row i
/// is absolute position n - W + i. Only the last W = layer.window() query rows are read.
template <class Real, class T>
RowMatrix<Real> gather_group_queries(const LayerView<T>& layer, Index g) {
  const Index G = layer.group_size(), W = layer.window(), d = layer.head_dim();
  const Index first = layer.queries.tokens - W;
  RowMatrix<Real> q(G * W, d);
  for (Index hl = 0; hl < G; ++hl) {
    auto block = q.middleRows(hl * W, W);
    detail::gather_rows<Real>(layer.queries, g * G + hl, first, W, block);
  }
  return q;
}

/// Logits (R, n) = softcap(scale * Qg K_g^T) for KV head g, with Qg from gather_group_queries.
/// Half and bfloat16 keys are converted tile by tile (no full-size float copy).
template <class Real, class T>
void window_logits(const LayerView<T>& layer, Index g, const RowMatrix<Real>& qg,
                   const AttentionArguments& args, RowMatrix<Real>& logits) {
  const Index n = layer.tokens(), d = layer.head_dim();
  const Real scale = static_cast<Real>(args.resolved_scale(d));
  logits.resize(qg.rows(), n);
  if constexpr (std::is_same_v<T, Real>) {
    auto k = detail::map_rows<Real>(layer.keys, g, 0, n);  // (n, d)
    logits.noalias() = scale * (qg * k.transpose());
  } else {
    RowMatrix<Real> tile(std::min<Index>(detail::kKeyTile, n), d);
    for (Index j0 = 0; j0 < n; j0 += detail::kKeyTile) {
      const Index cnt = std::min<Index>(detail::kKeyTile, n - j0);
      auto t = tile.topRows(cnt);
      detail::gather_rows<Real>(layer.keys, g, j0, cnt, t);
      logits.middleCols(j0, cnt).noalias() = scale * (qg * t.transpose());
    }
  }
  if (args.softcap > 0.0) {
    const Real c = static_cast<Real>(args.softcap);
    logits = (c * (logits.array() / c).tanh()).matrix();
  }
}

/// In place: each row r (window row i = r % W) becomes the causal softmax over keys j <= n - W + i,
/// exactly 0 beyond. Rows are independent.
template <class Real>
void causal_softmax_rows(RowMatrix<Real>& s, Index n, Index W) {
  for (Index r = 0; r < s.rows(); ++r) {
    const Index i = r % W;
    const Index len = n - W + i + 1;
    auto row = s.row(r);
    auto live = row.head(len).array();
    const Real mx = live.maxCoeff();
    live = (live - mx).exp();
    const Real sum = live.sum();
    live *= Real(1) / sum;
    row.tail(n - len).setZero();
  }
}

/// Window probabilities of KV head g's query group: (G·W, n), rows as in gather_group_queries.
/// Memory O(G·W·n). Cost: one (G·W × d × n) product plus the softmax.
template <class Real, class T>
void window_probabilities(const LayerView<T>& layer, Index g, const AttentionArguments& args,
                          RowMatrix<Real>& probs) {
  const RowMatrix<Real> qg = gather_group_queries<Real>(layer, g);
  window_logits(layer, g, qg, args, probs);
  causal_softmax_rows(probs, layer.tokens(), layer.window());
}

/// Attention mass of KV head g: a_g[j] = (1/G) Σ_{h in g} Σ_i A_h[i][j] (SPEC §2), from probabilities.
template <class Real>
void mass_from_probabilities(const RowMatrix<Real>& probs, Index G, Vector<Real>& mass) {
  mass = probs.colwise().sum().transpose() / static_cast<Real>(G);
}

}  // namespace kvc
