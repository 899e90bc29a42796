// Window attention over the observation window (SPEC §2): causal probabilities of the last W
// prefill queries over the whole cache, and the per-KV-head attention mass `a`.
// A view compressed before (LayerView::bias) adds its stored bias to every logit after the soft-cap,
// as decode attention does: softcap(scale·<q, k_j>) + bias_j.
#pragma once
#include "kvcompress/core.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE
#include "kvcompress/simd/amx_window.hpp"
#include "kvcompress/simd/kernels.hpp"
#include "kvcompress/simd/window_gemm.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace kvc {

/// The arithmetic of the window product <q, k> in the float attention-mass path (window_mass, which
/// SnapKV, SelKV and every preset that scores by window attention run).
enum class WindowProduct {
  fma,        ///< float FMA (simd::window_logits_t): the default
  amx_bf16x3  ///< Intel AMX tiles, each float split into two bf16, three products (simd/amx_window.hpp):
              ///< about ten times the float product's error, in 0.7–0.8 of the FMA product's time
              ///< (docs/performance.md). Float FMA where it cannot run (window_product_in_effect).
              ///< Everything computed from the window exponentials carries its error: the mass and,
              ///< for RidgeMerge, the window outputs Y.
};

inline const char* to_string(WindowProduct p) { return p == WindowProduct::fma ? "fma" : "amx_bf16x3"; }

/// How logits are formed: `scale * <q, k>`, then the optional tanh soft-cap `c * tanh(x / c)`.
struct AttentionArguments {
  double scale = 0.0;    ///< 0 means 1/sqrt(d)
  double softcap = 0.0;  ///< 0 means off
  /// Opt-in AMX bf16x3 product for float keys (see WindowProduct); asking for it requests the AMX
  /// tile-data permission for the process on its first use (simd::amx_bf16_available()).
  WindowProduct product = WindowProduct::fma;

  Status validate() const {
    if (!(scale >= 0.0) || !std::isfinite(scale))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("attention.scale must be finite and >= 0, got ", scale));
    if (!(softcap >= 0.0) || !std::isfinite(softcap))
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("attention.softcap must be finite and >= 0, got ", softcap));
    if (product != WindowProduct::fma && product != WindowProduct::amx_bf16x3)
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("attention.product must be fma or amx_bf16x3, got ", static_cast<int>(product)));
    return Status::ok();
  }
  double resolved_scale(Index d) const { return scale > 0.0 ? scale : 1.0 / std::sqrt(double(d)); }
};

namespace detail {
inline constexpr Index kKeyTile = 256;  // keys converted per tile for half/bfloat16 input

/// KV head g's stored bias (LayerView::bias): `data` <- its first entry, returns how many entries are
/// stored (0: unbiased; entries beyond are 0). Paths branch on it once per head.
template <class T>
Index head_bias(const LayerView<T>& layer, Index g, const compute_t<T>*& data) {
  data = layer.biased() ? layer.bias.data + g * layer.bias.head_stride : nullptr;
  return data ? layer.bias.length : 0;
}

/// The stored bias of tile [j0, j0 + cnt): its pointer and length (0 when the tile has none).
template <class Real>
Index tile_bias(const Real* bias, Index bias_len, Index j0, Index cnt, const Real*& out) {
  const Index len = std::clamp<Index>(bias_len - j0, 0, cnt);
  out = len > 0 ? bias + j0 : nullptr;
  return len;
}
}

/// The product window_mass uses under `args` for a head dimension d and R = G·W window query rows
/// when the keys are float (other key types always use fma): amx_bf16x3 when asked for and it can run
/// here (d a multiple of 32, the padded row count a multiple of 16, simd::amx_bf16_available(), which
/// requests the AMX permission on its first call), else fma.
inline WindowProduct window_product_in_effect(const AttentionArguments& args, Index d, Index R) {
  return args.product == WindowProduct::amx_bf16x3 &&
                 simd::amx_shape_supported(d, simd::padded_queries<simd::default_arch>(R)) &&
                 simd::amx_bf16_available()
             ? WindowProduct::amx_bf16x3
             : WindowProduct::fma;
}

namespace detail {
/// The product window_mass runs for keys of element type T: window_product_in_effect for float keys,
/// fma for every other type. The one condition window_exp_tiles_t and the pipeline's record
/// (LayerResult::window_product) both use.
template <class T>
WindowProduct window_product_for(const AttentionArguments& args, Index d, Index R) {
  if constexpr (std::is_same_v<T, float>)
    return window_product_in_effect(args, d, R);
  else
    return WindowProduct::fma;
}
}  // namespace detail

/// Scratch memory of the float window-attention path for one KV head at a time; reuse one per thread
/// across heads and calls to avoid reallocation. `bytes()` is the peak extra memory of one head in
/// flight: O(G·W·n) for the exponentials plus O(G·W·d + tile·d) (SPEC §2). R = G·W below; the mass
/// path pads it to Rp = simd::padded_queries(R) lanes and stores the exponentials key-major.
template <class Real>
struct WindowWorkspace {
  RowMatrix<Real> queries;   // (R, d)     stacked group queries
  Vector<Real> packed;       // (Rp·d)     scaled query panels (mass path)
  RowMatrix<Real> exps;      // (R, n) e^(logit − running max), tile by tile; (n, Rp) in the mass path
  RowMatrix<Real> key_tile;  // (tile, d)  converted keys (half / bfloat16 input only)
  RowMatrix<Real> shift;     // (tiles, R or Rp) running max each tile was exponentiated with
  Vector<Real> row_max;      // (R or Rp) final maximum M_r
  Vector<Real> row_sum;      // (R or Rp) final denominator Z_r
  Vector<Real> lane_last;    // (Rp) last visible window offset of each lane (mass path)
  Vector<Real> factor;       // (Rp) per-tile rescaling factors (mass path)
  Vector<Real> tile_max;     // (Rp) lane maxima of the current tile, from the product (mass path)
  std::vector<Index> live;   // (R) visible columns of the current tile
  simd::AmxQueries amx;      // queries as AMX tiles, (Rp·d) bf16 twice + a 16-key staging block (AMX product)

  std::size_t bytes() const {
    const auto b = [](const auto& m) { return static_cast<std::size_t>(m.size()) * sizeof(Real); };
    return b(queries) + b(packed) + b(exps) + b(key_tile) + b(shift) + b(row_max) + b(row_sum) +
           b(lane_last) + b(factor) + b(tile_max) + live.capacity() * sizeof(Index) +
           amx.storage.capacity() * sizeof(std::uint16_t);
  }
};

/// Group queries of KV head `g`, stacked: (G·W, d), row r = local_head * W + i, where window row i
/// is absolute position n - W + i. Only the last W = layer.window() query rows are read.
/// Into `q`, resized only when its shape differs (no allocation when reused).
template <class Real, class T>
void gather_group_queries_into(const LayerView<T>& layer, Index g, RowMatrix<Real>& q) {
  const Index G = layer.group_size(), W = layer.window(), d = layer.head_dim();
  const Index first = layer.queries.tokens - W;
  if (q.rows() != G * W || q.cols() != d) q.resize(G * W, d);
  for (Index hl = 0; hl < G; ++hl) {
    auto block = q.middleRows(hl * W, W);
    detail::gather_rows<Real>(layer.queries, g * G + hl, first, W, block);
  }
}
template <class Real, class T>
RowMatrix<Real> gather_group_queries(const LayerView<T>& layer, Index g) {
  RowMatrix<Real> q;
  gather_group_queries_into<Real>(layer, g, q);
  return q;
}

/// Logits (R, n) = softcap(scale * Qg K_g^T) + bias_g for KV head g, with Qg from
/// gather_group_queries and bias_g the view's stored bias (0 when absent). Half and bfloat16 keys are
/// converted tile by tile (no full-size float copy).
template <class Real, class T>
void window_logits(const LayerView<T>& layer, Index g, const RowMatrix<Real>& qg,
                   const AttentionArguments& args, RowMatrix<Real>& logits) {
  const Index n = layer.tokens(), d = layer.head_dim();
  const Real scale = static_cast<Real>(args.resolved_scale(d));
  logits.resize(qg.rows(), n);
  if (std::is_same_v<T, Real>) {
    // In place; a paged cache's head is gathered once, so that the product (and its rounding) is the same.
    RowMatrix<Real> gathered;
    logits.noalias() = scale * (qg * detail::rows_at<Real>(layer.keys, g, 0, n, gathered).transpose());
  } else {  // another element type: a tile of rows at a time
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
  const compute_t<T>* bias = nullptr;
  if (const Index len = detail::head_bias(layer, g, bias); len > 0)
    logits.leftCols(len).rowwise() +=
        Eigen::Map<const Vector<compute_t<T>>>(bias, len).template cast<Real>().transpose();
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
  gather_group_queries_into<float>(layer, g, ws.queries);  // (R, d)
  ws.exps.resize(R, n);
  ws.shift.resize(tiles, R);
  ws.row_max.setConstant(R, -std::numeric_limits<float>::infinity());
  ws.row_sum.setZero(R);
  ws.live.resize(static_cast<std::size_t>(R));
  if (!std::is_same_v<T, float> || layer.keys.paged()) ws.key_tile.resize(std::min(kSoftmaxTile, n), d);
  const float* bias = nullptr;
  const Index bias_len = head_bias(layer, g, bias);
  for (Index t = 0; t < tiles; ++t) {
    const Index j0 = t * kSoftmaxTile, cnt = std::min(kSoftmaxTile, n - j0);
    auto block = ws.exps.middleCols(j0, cnt);  // (R, cnt)
    if constexpr (std::is_same_v<T, float>) {  // in place, or gathered where a paged tile spans blocks
      block.noalias() = scale * (ws.queries * rows_at<float>(layer.keys, g, j0, cnt, ws.key_tile).transpose());
    } else {
      auto keys = ws.key_tile.topRows(cnt);
      gather_rows<float>(layer.keys, g, j0, cnt, keys);
      block.noalias() = scale * (ws.queries * keys.transpose());
    }
    // Row r = local_head·W + i sees keys j <= n − W + i.
    for (Index r = 0; r < R; ++r) ws.live[static_cast<std::size_t>(r)] = n - W + r % W + 1 - j0;
    const float* tb = nullptr;
    const Index tb_len = tile_bias(bias, bias_len, j0, cnt, tb);
    simd::softmax_tile<Arch>(block.data(), n, R, cnt, ws.live.data(), cap, ws.row_max.data(),
                             ws.row_sum.data(), ws.shift.row(t).data(), tb, tb_len);
  }
}

/// factor (R) for tile t: e^(shift[t][r] − M_r) / (Z_r · divisor).
inline void tile_factors(const WindowWorkspace<float>& ws, Index t, float divisor, float* factor) {
  const Index R = ws.row_max.size();
  for (Index r = 0; r < R; ++r)
    factor[r] = std::exp(ws.shift(t, r) - ws.row_max[r]) / (ws.row_sum[r] * divisor);
}

/// The plain path of the window probabilities (double arithmetic): the group queries gathered into
/// `queries` (G·W, d), the logits into `probs` (G·W, n), then the causal softmax of its rows in place.
/// Both keep their storage when their shape is unchanged.
template <class Real, class T>
void window_probabilities_plain(const LayerView<T>& layer, Index g, const AttentionArguments& args,
                                RowMatrix<Real>& queries, RowMatrix<Real>& probs) {
  gather_group_queries_into<Real>(layer, g, queries);
  window_logits(layer, g, queries, args, probs);
  causal_softmax_rows(probs, layer.tokens(), layer.window());
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
    RowMatrix<Real> queries;
    detail::window_probabilities_plain(layer, g, args, queries, probs);
  }
}

/// p (n) <- the causal probabilities of window row r = local_head·W + i of KV head g's query group
/// (SPEC §2): softmax_j(softcap(scale·<q, k_j>) + bias_j) over j <= n − W + i, exactly 0 beyond
/// (bias_j: the view's stored bias, 0 when absent). One pass of
/// dots over the visible keys (O(n·d)), SIMD in float arithmetic; O(d) memory besides p. Returns false when a logit is NaN or ±Inf
/// (p is then meaningless).
template <class Real, class T>
bool window_row_probabilities(const LayerView<T>& layer, Index g, Index r, const AttentionArguments& args,
                              Vector<Real>& p) {
  const Index n = layer.tokens(), d = layer.head_dim(), W = layer.window(), G = layer.group_size();
  KVC_ASSERT(r >= 0 && r < G * W);
  const Index i = r % W, visible = n - W + i + 1;
  const T* q = layer.queries.row(g * G + r / W, layer.queries.tokens - W + i);
  const Real scale = static_cast<Real>(args.resolved_scale(d));
  const Real cap = static_cast<Real>(args.softcap);
  const compute_t<T>* bias = nullptr;
  const Index bias_len = detail::head_bias(layer, g, bias);
  p.setZero(n);
  constexpr bool simd_dot = std::is_same_v<Real, float> && !std::is_same_v<T, double>;
  Vector<float> qf;  // (d) the query in float, for the SIMD dot
  if constexpr (simd_dot) qf = Eigen::Map<const Vector<T>>(q, d).template cast<float>();
  Real mx = -std::numeric_limits<Real>::infinity();
  for (Index j = 0; j < visible; ++j) {
    const T* k = layer.keys.row(g, j);
    Real s = 0;
    if constexpr (simd_dot) {
      s = simd::dot<simd::default_arch>(qf.data(), k, d);
    } else {
      for (Index c = 0; c < d; ++c) s += to_real<Real>(q[c]) * to_real<Real>(k[c]);
    }
    s *= scale;
    if (cap > 0) s = cap * std::tanh(s / cap);
    if (!std::isfinite(s)) return false;
    if (j < bias_len) s += static_cast<Real>(bias[j]);
    p[j] = s;
    mx = std::max(mx, s);
  }
  Real sum = 0;
  for (Index j = 0; j < visible; ++j) sum += (p[j] = std::exp(p[j] - mx));
  p.head(visible) *= Real(1) / sum;
  return true;
}

/// Attention mass of KV head g: a_g[j] = (1/G) Σ_{h in g} Σ_i A_h[i][j] (SPEC §2), from probabilities.
/// Rows are summed in order (deterministic). O(G·W·n).
template <class Real>
void mass_from_probabilities(const RowMatrix<Real>& probs, Index G, Vector<Real>& mass) {
  mass.setZero(probs.cols());
  for (Index r = 0; r < probs.rows(); ++r) mass += probs.row(r).transpose();
  mass /= static_cast<Real>(G);
}

namespace detail {

/// Pass 1 of the float attention-mass path (see window_mass): per tile of keys, the transposed logits
/// X[j][r] = scale·<q_r, k_j> by simd::window_logits_t (keys broadcast from the caller's rows, queries
/// packed once), or by simd::amx_window_logits_t when args.product asks for it and it can run, then the
/// online causal softmax epilogue simd::softmax_tile_t on the tile while it is in cache. Leaves in
/// `ws` the exponentials (n, Rp), each tile's shift, and the final row maxima and sums. Returns false
/// when a logit was NaN or ±Inf.
template <class Arch, class T>
bool window_exp_tiles_t(const LayerView<T>& layer, Index g, const AttentionArguments& args, WindowWorkspace<float>& ws) {
  const Index n = layer.tokens(), d = layer.head_dim(), W = layer.window(), G = layer.group_size();
  const Index R = G * W, Rp = simd::padded_queries<Arch>(R);
  const Index tiles = (n + kSoftmaxTile - 1) / kSoftmaxTile, base = n - W;
  const float cap = static_cast<float>(args.softcap);
  gather_group_queries_into<float>(layer, g, ws.queries);  // (R, d)
  // The opt-in AMX product (float keys only), else the FMA kernel's query panels.
  const bool amx = Rp == simd::padded_queries<simd::default_arch>(R) &&
                   window_product_for<T>(args, d, R) == WindowProduct::amx_bf16x3;
  if (amx) {
    simd::amx_pack_queries(ws.queries.data(), d, R, Rp, d, static_cast<float>(args.resolved_scale(d)), ws.amx);
  } else {
    ws.packed.resize(Rp * d);
    simd::pack_queries<Arch>(ws.queries.data(), d, R, d, static_cast<float>(args.resolved_scale(d)),
                             ws.packed.data());
  }
  ws.exps.resize(n, Rp);
  ws.shift.resize(tiles, Rp);
  ws.row_max.setConstant(Rp, -std::numeric_limits<float>::infinity());
  ws.row_sum.setZero(Rp);
  ws.lane_last.resize(Rp);
  ws.tile_max.resize(Rp);
  for (Index c = 0; c < Rp; ++c) ws.lane_last[c] = static_cast<float>(c < R ? c % W : W);
  // Float keys are read in place (a paged cache's run by run); other types, and a paged cache's tiles
  // for the AMX product, are gathered into ws.key_tile first.
  if (!std::is_same_v<T, float> || (layer.keys.paged() && amx)) ws.key_tile.resize(std::min(kSoftmaxTile, n), d);
  const float* bias = nullptr;
  const Index bias_len = head_bias(layer, g, bias);
  bool finite = true;
  for (Index t = 0; t < tiles; ++t) {
    const Index j0 = t * kSoftmaxTile, cnt = std::min(kSoftmaxTile, n - j0);
    float* x = ws.exps.row(j0).data();
    const bool masked = j0 + cnt > base;
    const float* tb = nullptr;
    const Index tb_len = tile_bias(bias, bias_len, j0, cnt, tb);
    // The product's lane maxima spare the softmax a pass, except where it masks, soft-caps or biases.
    float* tile_max = masked || cap > 0.0f || amx || tb_len > 0 ? nullptr : ws.tile_max.data();
    bool in_place = false;
    if constexpr (std::is_same_v<T, float>) {
      if (!amx && !layer.keys.contiguous(j0, cnt)) {  // a paged tile: one product per run of rows in a block
        in_place = true;
        tile_max = nullptr;  // the softmax finds the maxima itself (the same values)
        for (Index j = j0, run = 0; j < j0 + cnt; j += run) {
          run = std::min(layer.keys.contiguous_from(j), j0 + cnt - j);
          simd::window_logits_t<Arch>(layer.keys.row(g, j), layer.keys.token_stride, run, d, ws.packed.data(), Rp,
                                      x + (j - j0) * Rp, Rp, nullptr, 0, nullptr);
        }
      } else if (layer.keys.contiguous(j0, cnt)) {  // the tile's rows are token_stride apart
        in_place = true;
        const Index run = layer.keys.contiguous_from(j0);  // rows that may be prefetched
        if (amx) {
          simd::amx_window_logits_t(layer.keys.row(g, j0), layer.keys.token_stride, cnt, ws.amx, x, Rp, run);
        } else {
          const Index next = std::min(kSoftmaxTile, run - cnt);  // rows of the next tile, prefetched
          simd::window_logits_t<Arch>(layer.keys.row(g, j0), layer.keys.token_stride, cnt, d, ws.packed.data(), Rp,
                                      x, Rp, next > 0 ? layer.keys.row(g, j0 + cnt) : nullptr, next, tile_max);
        }
      }
    }
    if (!in_place) {
      auto keys = ws.key_tile.topRows(cnt);
      gather_rows<float>(layer.keys, g, j0, cnt, keys);
      if (amx) simd::amx_window_logits_t(keys.data(), d, cnt, ws.amx, x, Rp, cnt);
      else simd::window_logits_t<Arch>(keys.data(), d, cnt, d, ws.packed.data(), Rp, x, Rp, nullptr, 0, tile_max);
    }
    finite &= simd::softmax_tile_t<Arch>(x, Rp, cnt, Rp, j0 - base, masked, ws.lane_last.data(), cap,
                                         ws.row_max.data(), ws.row_sum.data(), ws.shift.row(t).data(), tile_max,
                                         tb, tb_len);
  }
  return finite;
}

/// The float attention-mass path (see window_mass): window_exp_tiles_t, then pass 2,
/// a[j] = Σ_r e^(shift_t[r] − M_r)/(G·Z_r) · X[j][r], one weighted row sum per key (simd::row_dots).
template <class Arch, class T>
bool window_mass_fused(const LayerView<T>& layer, Index g, const AttentionArguments& args, Vector<float>& mass,
                       WindowWorkspace<float>& ws) {
  const bool finite = window_exp_tiles_t<Arch>(layer, g, args, ws);
  const Index n = layer.tokens(), W = layer.window(), G = layer.group_size();
  const Index R = G * W, Rp = simd::padded_queries<Arch>(R), tiles = (n + kSoftmaxTile - 1) / kSoftmaxTile;
  mass.resize(n);
  ws.factor.resize(Rp);
  for (Index t = 0; t < tiles; ++t) {
    const Index j0 = t * kSoftmaxTile, cnt = std::min(kSoftmaxTile, n - j0);
    for (Index c = 0; c < Rp; ++c)
      ws.factor[c] = c < R ? std::exp(ws.shift(t, c) - ws.row_max[c]) / (ws.row_sum[c] * static_cast<float>(G)) : 0.0f;
    simd::row_dots<Arch>(ws.exps.row(j0).data(), Rp, cnt, ws.factor.data(), Rp, mass.data() + j0);
  }
  return finite;
}

}  // namespace detail

/// Attention mass a_g (n) of KV head g straight from the layer (SPEC §2), without materialising the
/// normalised probabilities. For float arithmetic: per tile of keys one register-blocked SIMD product
/// (simd/window_gemm.hpp) with the online causal softmax as its epilogue, then one weighted row sum
/// per key (detail::window_mass_fused). `ws` is scratch memory (reuse it across heads). Equals
/// mass_from_probabilities(window_probabilities(...)) up to float rounding.
/// Cost: one (G·W × d × n) product + G·W·n exponentials + one read of the G·W·n buffer.
/// Returns false when a logit was NaN or ±Inf (for float arithmetic every raw logit is checked, so a
/// non-finite key always shows; the double path checks only the resulting mass); the mass is then
/// meaningless. The pipeline uses this instead of a separate scan of the keys.
template <class Real, class T>
bool window_mass(const LayerView<T>& layer, Index g, const AttentionArguments& args, Vector<Real>& mass,
                 WindowWorkspace<Real>& ws) {
  if constexpr (std::is_same_v<Real, float>) {
    return detail::window_mass_fused<simd::default_arch>(layer, g, args, mass, ws);
  } else {
    detail::window_probabilities_plain(layer, g, args, ws.queries, ws.exps);  // in the workspace
    mass_from_probabilities(ws.exps, layer.group_size(), mass);
    return mass.allFinite();
  }
}

namespace detail {
/// Y (R, d) = A (R, n) · V_g (n, d) from probabilities A; values of another element type are
/// converted one key tile at a time (no full-size copy).
template <class Real, class T>
void probabilities_times_values(const LayerView<T>& layer, Index g, const RowMatrix<Real>& A, RowMatrix<Real>& Y) {
  const Index n = layer.tokens(), d = layer.head_dim();
  if (std::is_same_v<T, Real>) {
    // In place; a paged cache's head is gathered once, so that the product (and its rounding) is the same.
    RowMatrix<Real> gathered;
    Y.noalias() = A * rows_at<Real>(layer.values, g, 0, n, gathered);
  } else {  // another element type: a tile of rows at a time
    Y.setZero(A.rows(), d);
    RowMatrix<Real> tile(std::min<Index>(kKeyTile, n), d);
    for (Index j0 = 0; j0 < n; j0 += kKeyTile) {
      const Index count = std::min<Index>(kKeyTile, n - j0);
      auto rows = tile.topRows(count);
      gather_rows<Real>(layer.values, g, j0, count, rows);
      Y.noalias() += A.middleCols(j0, count) * rows;
    }
  }
}
}  // namespace detail

/// Window outputs Y = A·V_g (G·W, d) of KV head g straight from the layer. For float arithmetic one
/// fused pass per key tile (flash-attention style): logits (G·W, tile) by one product, the online causal
/// softmax epilogue (simd::softmax_tile), the tile's contribution exps·V_tile, the running outputs
/// rescaled when a row's maximum grows; the (G·W, n) probabilities are never stored. Equals
/// window_probabilities(...)·V up to rounding. Cost: two (G·W × d × n) products + G·W·n exponentials;
/// memory O(G·W·(tile + d)).
template <class Real, class T>
void window_outputs(const LayerView<T>& layer, Index g, const AttentionArguments& args, RowMatrix<Real>& Y) {
  const Index n = layer.tokens(), d = layer.head_dim(), W = layer.window(), G = layer.group_size();
  const Index R = G * W;
  if constexpr (std::is_same_v<Real, float>) {
    using Arch = simd::default_arch;
    constexpr Index tile = detail::kSoftmaxTile;
    const float scale = static_cast<float>(args.resolved_scale(d));
    const float cap = static_cast<float>(args.softcap);
    const RowMatrix<float> q = gather_group_queries<float>(layer, g);  // (R, d)
    RowMatrix<float> exps(R, tile), part(R, d), ktile, vtile;           // (R, tile), (R, d)
    if (!std::is_same_v<T, float> || layer.keys.paged()) ktile.resize(std::min(tile, n), d);
    if (!std::is_same_v<T, float> || layer.values.paged()) vtile.resize(std::min(tile, n), d);
    Vector<float> row_max = Vector<float>::Constant(R, -std::numeric_limits<float>::infinity());
    Vector<float> row_sum = Vector<float>::Zero(R), shift(R);
    Vector<float> applied = row_max;  // (R) the maximum Y's rows are currently relative to
    std::vector<Index> live(static_cast<std::size_t>(R));
    const float* bias = nullptr;
    const Index bias_len = detail::head_bias(layer, g, bias);
    Y.setZero(R, d);
    for (Index j0 = 0; j0 < n; j0 += tile) {
      const Index cnt = std::min(tile, n - j0);
      auto block = exps.leftCols(cnt);
      if constexpr (std::is_same_v<T, float>) {
        block.noalias() = scale * (q * detail::rows_at<float>(layer.keys, g, j0, cnt, ktile).transpose());
      } else {
        auto keys = ktile.topRows(cnt);
        detail::gather_rows<float>(layer.keys, g, j0, cnt, keys);
        block.noalias() = scale * (q * keys.transpose());
      }
      for (Index r = 0; r < R; ++r) live[static_cast<std::size_t>(r)] = n - W + r % W + 1 - j0;
      const float* tb = nullptr;
      const Index tb_len = detail::tile_bias(bias, bias_len, j0, cnt, tb);
      simd::softmax_tile<Arch>(exps.data(), tile, R, cnt, live.data(), cap, row_max.data(), row_sum.data(),
                               shift.data(), tb, tb_len);
      if constexpr (std::is_same_v<T, float>) {
        part.noalias() = block * detail::rows_at<float>(layer.values, g, j0, cnt, vtile);
      } else {
        auto values = vtile.topRows(cnt);
        detail::gather_rows<float>(layer.values, g, j0, cnt, values);
        part.noalias() = block * values;
      }
      for (Index r = 0; r < R; ++r) {
        if (shift[r] != applied[r]) {  // the row's maximum grew: rescale what was accumulated
          if (applied[r] != -std::numeric_limits<float>::infinity())
            Y.row(r) *= std::exp(applied[r] - shift[r]);
          applied[r] = shift[r];
        }
        Y.row(r) += part.row(r);
      }
    }
    for (Index r = 0; r < R; ++r)
      if (row_sum[r] > 0.0f) Y.row(r) *= 1.0f / row_sum[r];
  } else {  // the reference path: probabilities, then one product
    RowMatrix<Real> A;  // (R, n)
    window_probabilities<Real>(layer, g, args, A);
    KVC_ASSERT(A.rows() == R);
    (void)R;
    detail::probabilities_times_values(layer, g, A, Y);
  }
}

/// Window outputs Y = A·V_g (G·W, d) of KV head g from what window_mass(layer, g, args, mass, ws) left
/// in `ws` (call it right after, with the same layer, head and workspace): the exponentials of every
/// key tile are still there, so Y costs one (G·W × n × d) product and no second pass of window
/// attention. Equals window_probabilities(...)·V up to rounding. Float arithmetic: per tile
/// exps_tileᵀ·V_tile, rescaled by e^(shift − M)/Z; double: the stored probabilities times V.
template <class Real, class T>
void window_outputs_after_mass(const LayerView<T>& layer, Index g, WindowWorkspace<Real>& ws, RowMatrix<Real>& Y) {
  const Index n = layer.tokens(), d = layer.head_dim(), R = layer.group_size() * layer.window();
  Y.setZero(R, d);
  constexpr Index tile = detail::kSoftmaxTile;
  if constexpr (std::is_same_v<Real, float>) {
    RowMatrix<float> part;  // (Rp, d)
    if (!std::is_same_v<T, float> || layer.values.paged()) ws.key_tile.resize(std::min(tile, n), d);  // reused for V rows
    for (Index t = 0, j0 = 0; j0 < n; ++t, j0 += tile) {
      const Index cnt = std::min(tile, n - j0);
      const auto e = ws.exps.middleRows(j0, cnt);  // (cnt, Rp)
      if constexpr (std::is_same_v<T, float>) {
        part.noalias() = e.transpose() * detail::rows_at<float>(layer.values, g, j0, cnt, ws.key_tile);
      } else {
        auto v = ws.key_tile.topRows(cnt);
        detail::gather_rows<float>(layer.values, g, j0, cnt, v);
        part.noalias() = e.transpose() * v;
      }
      for (Index r = 0; r < R; ++r)
        Y.row(r) += (std::exp(ws.shift(t, r) - ws.row_max[r]) / ws.row_sum[r]) * part.row(r);
    }
  } else {
    detail::probabilities_times_values(layer, g, ws.exps, Y);  // ws.exps holds the probabilities (R, n)
  }
}

}  // namespace kvc
