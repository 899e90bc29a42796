// The types the pipeline's policies exchange: per-head context, routing, merge output, diagnostics.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace kvc {

/// Outcome of an iterative solve, reported as a value (never thrown).
enum class SolverStatus { not_run, converged, max_iterations, breakdown };

inline const char* to_string(SolverStatus s) {
  switch (s) {
    case SolverStatus::not_run: return "not_run";
    case SolverStatus::converged: return "converged";
    case SolverStatus::max_iterations: return "max_iterations";
    case SolverStatus::breakdown: return "breakdown";
  }
  return "?";
}

/// Per-KV-head diagnostics (SPEC §11).
struct HeadDiagnostics {
  Index kept = 0;     ///< entries in the compressed head (m_g)
  Index evicted = 0;  ///< n - m_g
  Index merged = 0;   ///< evicted tokens merged with a gate > 0
  Index dropped = 0;  ///< evicted tokens that vanished (gate 0)
  double gate_mean = 0.0;  ///< mean gate over evicted tokens (0 when none)

  // Ridge merge (GRKV) only.
  double window_error_before = std::numeric_limits<double>::quiet_NaN();  ///< ‖Y − f‖_F / ‖Y‖_F
  double window_error_after = std::numeric_limits<double>::quiet_NaN();
  Index cg_iterations = 0;
  double cg_residual = 0.0;  ///< final relative residual of the key-step CG
  SolverStatus cg_status = SolverStatus::not_run;
  bool key_step_rejected = false;  ///< the optional safeguard, or non-finite / out-of-range keys, undid a key step
  bool value_step_rejected = false;  ///< a value step failed or gave non-finite / out-of-range values: kept V⁰
};

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
    if constexpr (!std::is_same_v<T, float>) {
      ktile.resize(std::min(tile, n), d);
      vtile.resize(std::min(tile, n), d);
    }
    Vector<float> row_max = Vector<float>::Constant(R, -std::numeric_limits<float>::infinity());
    Vector<float> row_sum = Vector<float>::Zero(R), shift(R);
    Vector<float> applied = row_max;  // (R) the maximum Y's rows are currently relative to
    std::vector<Index> live(static_cast<std::size_t>(R));
    Y.setZero(R, d);
    for (Index j0 = 0; j0 < n; j0 += tile) {
      const Index cnt = std::min(tile, n - j0);
      auto block = exps.leftCols(cnt);
      if constexpr (std::is_same_v<T, float>) {
        block.noalias() = scale * (q * detail::map_rows<float>(layer.keys, g, j0, cnt).transpose());
      } else {
        auto keys = ktile.topRows(cnt);
        detail::gather_rows<float>(layer.keys, g, j0, cnt, keys);
        block.noalias() = scale * (q * keys.transpose());
      }
      for (Index r = 0; r < R; ++r) live[static_cast<std::size_t>(r)] = n - W + r % W + 1 - j0;
      simd::softmax_tile<Arch>(exps.data(), tile, R, cnt, live.data(), cap, row_max.data(), row_sum.data(),
                               shift.data());
      if constexpr (std::is_same_v<T, float>) {
        part.noalias() = block * detail::map_rows<float>(layer.values, g, j0, cnt);
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

/// Everything a per-head policy (router, merger, compensator) may read about KV head `head`.
/// Views point into the caller's memory (read only). Window probabilities are computed on first use.
template <class T>
class HeadContext {
 public:
  using Real = compute_t<T>;

  HeadContext(const LayerView<T>& layer, Index head, const AttentionArguments& attention,
              const Vector<Real>& mass, const Vector<Real>& score, const std::vector<Index>& kept,
              const std::vector<Index>& evicted, const RowMatrix<Real>* window_outputs = nullptr)
      : layer_(layer), head_(head), attention_(attention), mass_(mass), score_(score), kept_(kept),
        evicted_(evicted), given_outputs_(window_outputs) {}

  const LayerView<T>& layer() const { return layer_; }
  Index head() const { return head_; }
  Index tokens() const { return layer_.tokens(); }     // n
  Index window() const { return layer_.window(); }     // W
  Index group_size() const { return layer_.group_size(); }  // G
  Index head_dim() const { return layer_.head_dim(); }  // d
  const AttentionArguments& attention() const { return attention_; }
  Real scale() const { return static_cast<Real>(attention_.resolved_scale(head_dim())); }

  const T* key(Index j) const { return layer_.keys.row(head_, j); }
  const T* value(Index j) const { return layer_.values.row(head_, j); }

  /// (n) raw window attention mass a_g.
  const Vector<Real>& mass() const { return mass_; }
  /// (n) the score the selector ranked by (pooled where pooling is on).
  const Vector<Real>& score() const { return score_; }
  /// (m) kept positions, ascending.
  const std::vector<Index>& kept() const { return kept_; }
  /// (n - m) evicted positions, ascending.
  const std::vector<Index>& evicted() const { return evicted_; }

  /// (G·W, n) causal window probabilities of this head's query group, row r = local_head*W + i.
  const RowMatrix<Real>& probabilities() const {
    if (!probs_) {
      probs_.emplace();
      window_probabilities<Real>(layer_, head_, attention_, *probs_);
    }
    return *probs_;
  }

  /// (G·W, d) window outputs Y = A·V_g of this head's query group (rows as in probabilities()): the
  /// matrix handed to the constructor (a pipeline that still holds the head's window exponentials
  /// from the scorer stage can form it with one (G·W × n × d) product), else from probabilities()
  /// when they are already cached, else computed on first use by the fused window_outputs (no
  /// (G·W, n) matrix).
  const RowMatrix<Real>& window_outputs() const {
    if (given_outputs_) return *given_outputs_;
    if (!outputs_) {
      outputs_.emplace();
      if (probs_) {
        outputs_from_probabilities(*probs_, *outputs_);
      } else {
        kvc::window_outputs<Real>(layer_, head_, attention_, *outputs_);
      }
    }
    return *outputs_;
  }

 private:
  const LayerView<T>& layer_;
  Index head_;
  const AttentionArguments& attention_;
  const Vector<Real>& mass_;
  const Vector<Real>& score_;
  const std::vector<Index>& kept_;
  const std::vector<Index>& evicted_;
  // Y = A·V from normalised probabilities A (R, n).
  void outputs_from_probabilities(const RowMatrix<Real>& A, RowMatrix<Real>& Y) const {
    detail::probabilities_times_values(layer_, head_, A, Y);
  }

  const RowMatrix<Real>* given_outputs_ = nullptr;
  mutable std::optional<RowMatrix<Real>> probs_;
  mutable std::optional<RowMatrix<Real>> outputs_;
};

namespace detail {

/// A router's working memory, kept in the Routing it fills (BucketRouter: its current bucket's
/// candidate rows, their inverse norms and the dots against them), so that a reused Routing (the
/// pipeline keeps one per worker in its Workspace) needs no allocation.
struct RouteScratch {
  std::tuple<std::vector<const float*>, std::vector<const double*>, std::vector<const Eigen::half*>,
             std::vector<const Eigen::bfloat16*>>
      rows;
  std::tuple<std::vector<float>, std::vector<double>> reals;
  std::vector<float> dots;
  template <class T>
  std::vector<const T*>& rows_of() { return std::get<std::vector<const T*>>(rows); }
  template <class Real>
  std::vector<Real>& reals_of() { return std::get<std::vector<Real>>(reals); }
  std::size_t bytes() const {
    return std::get<0>(rows).capacity() * sizeof(void*) + std::get<1>(rows).capacity() * sizeof(void*) +
           std::get<2>(rows).capacity() * sizeof(void*) + std::get<3>(rows).capacity() * sizeof(void*) +
           std::get<0>(reals).capacity() * sizeof(float) + std::get<1>(reals).capacity() * sizeof(double) +
           dots.capacity() * sizeof(float);
  }
};

/// A merger's working memory, kept in the MergeOutput it fills (GatedMerge: each kept entry's last
/// contribution, its added weight and its target's Σ v²), so that the pipeline's per-head
/// MergeOutput needs no allocation on a reused call.
template <class Real>
struct MergeScratch {
  std::vector<Index> last;
  Vector<Real> added, target_ss;
  std::size_t bytes() const {
    return last.capacity() * sizeof(Index) + static_cast<std::size_t>(added.size() + target_ss.size()) * sizeof(Real);
  }
};

}  // namespace detail

/// Router output for one head: for each evicted token (in ctx.evicted() order) the index into
/// ctx.kept() of its target, or -1 when the router routes nothing (NoRoute). The pipeline reuses one
/// Routing per worker from head to head and call (a router must write all of `target`); a router may
/// keep working memory in `scratch` (BucketRouter does) or allocate its own.
struct Routing {
  std::vector<Index> target;
  bool routed() const { return !target.empty(); }
  /// The router's working memory (not part of the value: copies start without it).
  detail::NotCopied<detail::RouteScratch> scratch;
};

/// How a router that fills the kept keys should store them (see MergeOutput): with `streaming`,
/// non-temporal stores where the rows are aligned for them, for a result that nothing reads soon
/// after. A hint for speed only: the stored values are the same either way.
struct KeptKeyStores {
  bool streaming = false;
};

/// Merger output for one head. The pipeline fills keys and values with the kept tokens' original
/// rows before calling the merger, so a merger that does nothing (Drop) is the identity. Two opt-ins
/// save the pipeline's pass over those rows (gathering them from the cache) by writing them inside
/// a sweep over the cache that reads them anyway:
/// - a router with `static constexpr bool fills_keys = true` provides
///   route(ctx, routing, RowMatrix<Real>& kept_keys), which must also write every kept key row
///   (BucketRouter);
/// - a merger with `static constexpr bool fills_values = true` gets `values` as (m, d) storage of
///   unspecified contents and must write every row itself (GatedMerge).
/// A merger or compensator that never reads `keys` may say `static constexpr bool reads_kept_keys =
/// false` (GatedMerge, Drop and the compensators here do): when both say so, the pipeline writes the
/// kept keys of a large result with streaming stores (a hint for speed only; the values are the same),
/// through the gather or, for a fills_keys router that also provides
/// route(ctx, routing, kept_keys, KeptKeyStores), through the router (BucketRouter).
/// Every merger must set `gate` to one entry per evicted token (Drop: zeros), writing every entry on
/// every path, and for finite input never NaN. The pipeline hands `gate` over already sized one per
/// evicted token with every entry NaN, and after each merge checks the gate's size and, with
/// Arguments::check_finite (the default), that no entry is NaN (for example one left unwritten),
/// throwing kvc::error if not. The pipeline keeps one MergeOutput per KV head from call to call, so
/// `scratch` keeps its storage too; keys, values and diagnostics are the current call's.
/// A merger may keep working memory in `scratch` (GatedMerge does) or allocate its own.
template <class Real>
struct MergeOutput {
  RowMatrix<Real> keys;    // (m, d)
  RowMatrix<Real> values;  // (m, d)
  Vector<Real> gate;       // (n - m) gate of each evicted token (0 = dropped)
  HeadDiagnostics diagnostics;
  /// The merger's working memory (not part of the value: copies start without it).
  detail::NotCopied<detail::MergeScratch<Real>> scratch;
};

}  // namespace kvc
