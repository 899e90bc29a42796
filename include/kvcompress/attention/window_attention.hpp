// Window attention over the observation window (SPEC §2): causal probabilities of the last W
// prefill queries over the whole cache, and the per-KV-head attention mass `a`.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/core.hpp"
#include "kvcompress/detail/rows.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

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

/// Scratch memory of the float window-attention path for one KV head at a time; reuse one per thread
/// across heads and calls to avoid reallocation. `bytes()` is the peak extra memory of one head in
/// flight: O(G·W·n) for the exponentials plus O(G·W·d + tile·d) (SPEC §2).
template <class Real>
struct WindowWorkspace {
  RowMatrix<Real> queries;   // (G·W, d)   stacked group queries
  RowMatrix<Real> exps;      // (G·W, n)   e^(logit − running max), tile by tile
  RowMatrix<Real> key_tile;  // (tile, d)  converted keys (half / bfloat16 input only)
  RowMatrix<Real> shift;     // (tiles, G·W) running max each tile was exponentiated with
  Vector<Real> row_max;      // (G·W) final maximum M_r
  Vector<Real> row_sum;      // (G·W) final denominator Z_r
  std::vector<Index> live;   // (G·W) visible columns of the current tile

  std::size_t bytes() const {
    const auto b = [](const auto& m) { return static_cast<std::size_t>(m.size()) * sizeof(Real); };
    return b(queries) + b(exps) + b(key_tile) + b(shift) + b(row_max) + b(row_sum) +
           live.capacity() * sizeof(Index);
  }
};

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

namespace detail {

inline constexpr Index kSoftmaxTile = 256;  // keys per fused product + softmax tile (fits in L2)

/// Pass 1 of the float path, fused: per tile of keys, logits (G·W, tile) = scale·Qg·K_tileᵀ by one Eigen
/// GEMM written straight into ws.exps, then the online causal softmax epilogue on the tile while it is
/// in cache (simd::softmax_tile). Afterwards A[r][j] = exps[r][j] · e^(shift[t][r] − M_r) / Z_r for j in
/// tile t. Cost: one (G·W × d × n) product, one exponential per visible logit, O(G·W·n) memory.
template <class Arch, class T>
void window_exp_tiles(const LayerView<T>& layer, Index g, const AttentionArguments& args,
                      WindowWorkspace<float>& ws) {
  const Index n = layer.tokens(), d = layer.head_dim(), W = layer.window(), G = layer.group_size();
  const Index R = G * W, tiles = (n + kSoftmaxTile - 1) / kSoftmaxTile;
  const float scale = static_cast<float>(args.resolved_scale(d));
  const float cap = static_cast<float>(args.softcap);
  ws.queries = gather_group_queries<float>(layer, g);  // (R, d)
  ws.exps.resize(R, n);
  ws.shift.resize(tiles, R);
  ws.row_max.setConstant(R, -std::numeric_limits<float>::infinity());
  ws.row_sum.setZero(R);
  ws.live.resize(static_cast<std::size_t>(R));
  if constexpr (!std::is_same_v<T, float>) ws.key_tile.resize(std::min(kSoftmaxTile, n), d);
  for (Index t = 0; t < tiles; ++t) {
    const Index j0 = t * kSoftmaxTile, cnt = std::min(kSoftmaxTile, n - j0);
    auto block = ws.exps.middleCols(j0, cnt);  // (R, cnt)
    if constexpr (std::is_same_v<T, float>) {
      block.noalias() = scale * (ws.queries * map_rows<float>(layer.keys, g, j0, cnt).transpose());
    } else {
      auto keys = ws.key_tile.topRows(cnt);
      gather_rows<float>(layer.keys, g, j0, cnt, keys);
      block.noalias() = scale * (ws.queries * keys.transpose());
    }
    // Row r = local_head·W + i sees keys j <= n − W + i.
    for (Index r = 0; r < R; ++r) ws.live[static_cast<std::size_t>(r)] = n - W + r % W + 1 - j0;
    simd::softmax_tile<Arch>(block.data(), n, R, cnt, ws.live.data(), cap, ws.row_max.data(),
                             ws.row_sum.data(), ws.shift.row(t).data());
  }
}

/// factor (R) for tile t: e^(shift[t][r] − M_r) / (Z_r · divisor).
inline void tile_factors(const WindowWorkspace<float>& ws, Index t, float divisor, float* factor) {
  const Index R = ws.row_max.size();
  for (Index r = 0; r < R; ++r)
    factor[r] = std::exp(ws.shift(t, r) - ws.row_max[r]) / (ws.row_sum[r] * divisor);
}

}  // namespace detail

/// Window probabilities of KV head g's query group: (G·W, n), rows as in gather_group_queries.
/// Memory O(G·W·n). Cost: one (G·W × d × n) product plus the softmax (fused per key tile for float
/// arithmetic; double runs the plain reference path).
template <class Real, class T>
void window_probabilities(const LayerView<T>& layer, Index g, const AttentionArguments& args,
                          RowMatrix<Real>& probs) {
  if constexpr (std::is_same_v<Real, float>) {
    using Arch = simd::default_arch;
    WindowWorkspace<float> ws;
    ws.exps.swap(probs);  // reuse the caller's storage
    detail::window_exp_tiles<Arch>(layer, g, args, ws);
    const Index n = layer.tokens(), R = ws.exps.rows();
    std::vector<float> factor(static_cast<std::size_t>(R));
    for (Index t = 0, j0 = 0; j0 < n; ++t, j0 += detail::kSoftmaxTile) {
      const Index cnt = std::min(detail::kSoftmaxTile, n - j0);
      detail::tile_factors(ws, t, 1.0f, factor.data());
      for (Index r = 0; r < R; ++r) simd::scale<Arch>(&ws.exps(r, j0), factor[static_cast<std::size_t>(r)], cnt);
    }
    probs.swap(ws.exps);
  } else {
    const RowMatrix<Real> qg = gather_group_queries<Real>(layer, g);
    window_logits(layer, g, qg, args, probs);
    causal_softmax_rows(probs, layer.tokens(), layer.window());
  }
}

/// Attention mass of KV head g: a_g[j] = (1/G) Σ_{h in g} Σ_i A_h[i][j] (SPEC §2), from probabilities.
/// Rows are summed in order (deterministic). O(G·W·n).
template <class Real>
void mass_from_probabilities(const RowMatrix<Real>& probs, Index G, Vector<Real>& mass) {
  mass.setZero(probs.cols());
  for (Index r = 0; r < probs.rows(); ++r) mass += probs.row(r).transpose();
  mass /= static_cast<Real>(G);
}

/// Attention mass a_g (n) of KV head g straight from the layer (SPEC §2), without materialising the
/// normalised probabilities: for float arithmetic the fused tile pass (window_exp_tiles) followed by
/// one weighted column sum a[j] = Σ_r e^(shift − M_r)/(G·Z_r) · exps[r][j]. `ws` is scratch memory
/// (reuse it across heads). Equals mass_from_probabilities(window_probabilities(...)) up to rounding.
/// Cost: one (G·W × d × n) product + G·W·n exponentials + one read of the G·W·n buffer.
template <class Real, class T>
void window_mass(const LayerView<T>& layer, Index g, const AttentionArguments& args, Vector<Real>& mass,
                 WindowWorkspace<Real>& ws) {
  if constexpr (std::is_same_v<Real, float>) {
    using Arch = simd::default_arch;
    detail::window_exp_tiles<Arch>(layer, g, args, ws);
    const Index n = layer.tokens(), R = ws.exps.rows();
    mass.setZero(n);
    std::vector<float> factor(static_cast<std::size_t>(R));
    for (Index t = 0, j0 = 0; j0 < n; ++t, j0 += detail::kSoftmaxTile) {
      const Index cnt = std::min(detail::kSoftmaxTile, n - j0);
      detail::tile_factors(ws, t, static_cast<float>(layer.group_size()), factor.data());
      for (Index r = 0; r < R; ++r)
        simd::axpy<Arch>(factor[static_cast<std::size_t>(r)], &ws.exps(r, j0), mass.data() + j0, cnt);
    }
  } else {
    window_probabilities<Real>(layer, g, args, ws.exps);
    mass_from_probabilities(ws.exps, layer.group_size(), mass);
  }
}

}  // namespace kvc
