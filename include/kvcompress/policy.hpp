// The types the pipeline's policies exchange: the scorer's and the per-head contexts, routing, merge
// output, diagnostics.
#pragma once
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/rope.hpp"
#include "kvcompress/traits.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
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
  double lambda_v = std::numeric_limits<double>::quiet_NaN();  ///< λ of the last value step run (holdout: chosen)
  double key_step_length = std::numeric_limits<double>::quiet_NaN();  ///< holdout: of the last key step (0 = undone)
};

/// Everything a scorer may read about KV head `head`: the layer, the window attention mass and, on
/// request, the window probabilities (per query row or all rows), the window queries, the attention
/// and RoPE arguments and the entries' original positions. The per-head policies after selection
/// read a HeadContext, which extends it. Views point into the caller's memory (read only).
template <class T>
class ScoreContext {
 public:
  using Real = compute_t<T>;

  ScoreContext(const LayerView<T>& layer, Index head, const AttentionArguments& attention, const Vector<Real>& mass,
               const RopeArguments* rope = nullptr)
      : layer_(layer), head_(head), attention_(attention), mass_(mass), rope_(rope) {}

  const LayerView<T>& layer() const { return layer_; }
  Index head() const { return head_; }
  Index tokens() const { return layer_.tokens(); }          // n
  Index window() const { return layer_.window(); }          // W
  Index group_size() const { return layer_.group_size(); }  // G
  Index head_dim() const { return layer_.head_dim(); }      // d
  const AttentionArguments& attention() const { return attention_; }
  Real scale() const { return static_cast<Real>(attention_.resolved_scale(head_dim())); }
  /// The RoPE arguments of the cached keys (the pipeline's Arguments::reposition: layout, theta,
  /// rotary dimension, whether or not repositioning is on).
  const RopeArguments& rope() const {
    static const RopeArguments defaults;
    return rope_ != nullptr ? *rope_ : defaults;
  }

  const T* key(Index j) const { return layer_.keys.row(head_, j); }      // d elements
  const T* value(Index j) const { return layer_.values.row(head_, j); }  // d elements
  /// Window query row i (absolute position n − W + i) of query head head·G + local_head: d elements.
  const T* query(Index local_head, Index i) const {
    return layer_.queries.row(head_ * group_size() + local_head, layer_.queries.tokens - window() + i);
  }
  /// The original position of entry j (the position its key was rotated at): the view's stored
  /// position, or j when it has none.
  Index position(Index j) const { return layer_.positions.at(head_, j); }
  /// Entry j's stored logit bias from an earlier compression (0 when the view has none); the window
  /// attention (mass(), probabilities, outputs) already includes it.
  Real entry_bias(Index j) const { return layer_.bias.at(head_, j); }

  /// (n) raw window attention mass a_g (zeros unless a policy declares traits::needs_mass).
  const Vector<Real>& mass() const { return mass_; }

  /// KV head's budget m_g as the caller gave it (clamped to n), before any allocator; 0 when unknown
  /// (a context built without one). CriticalKV's first stage reads it.
  Index budget() const { return budget_; }
  void set_budget(Index m) { budget_ = m; }

  /// p (n) <- the causal window probabilities of row r = local_head·W + i of this head's query group
  /// (SPEC §2): softmax_j(softcap(scale·<q, k_j>) + bias_j) for j <= n − W + i, 0 beyond. O(n·d), no other
  /// memory. Throws kvc::error when a logit is not finite (keys or queries too large for the
  /// arithmetic type).
  void row_probabilities(Index r, Vector<Real>& p) const {
    if (!window_row_probabilities(layer_, head_, r, attention_, p))
      throw error(detail::concat("a window-attention logit of KV head ", head_, ", window row ", r,
                                 " is not finite: |scale·<q, k>| overflows the arithmetic type"));
  }

  /// (G·W, n) causal window probabilities of this head's query group, row r = local_head·W + i;
  /// computed on first use (one G·W × d × n product, O(G·W·n) memory).
  const RowMatrix<Real>& probabilities() const {
    if (!has_probs_) {
      window_probabilities<Real>(layer_, head_, attention_, probs_);
      has_probs_ = true;
    }
    return probs_;
  }

 protected:
  const LayerView<T>& layer_;
  Index head_;
  const AttentionArguments& attention_;
  const Vector<Real>& mass_;
  const RopeArguments* rope_;
  Index budget_ = 0;
  // A matrix and a flag rather than std::optional: GCC 12 warns (maybe-uninitialized) on an optional
  // Eigen matrix's destructor.
  mutable RowMatrix<Real> probs_;
  mutable bool has_probs_ = false;
};

/// Everything a per-head policy (router, merger, compensator) may read about KV head `head`: the
/// ScoreContext, the scores the selector ranked by, the kept and evicted positions and the window
/// outputs. Window probabilities and outputs are computed on first use.
template <class T>
class HeadContext : public ScoreContext<T> {
  using Base = ScoreContext<T>;

 public:
  using Real = compute_t<T>;

  HeadContext(const LayerView<T>& layer, Index head, const AttentionArguments& attention,
              const Vector<Real>& mass, const Vector<Real>& score, const std::vector<Index>& kept,
              const std::vector<Index>& evicted, const RowMatrix<Real>* window_outputs = nullptr,
              const RopeArguments* rope = nullptr)
      : Base(layer, head, attention, mass, rope), score_(score), kept_(kept), evicted_(evicted),
        given_outputs_(window_outputs) {}

  /// Whether a policy that fills the kept rows itself (PolicyTraits::fills_keys) may write them with
  /// streaming stores: nothing reads them soon after and the result is too large to stay in cache. A
  /// hint for speed only.
  bool streaming_stores() const { return streaming_stores_; }
  void set_streaming_stores(bool on) { streaming_stores_ = on; }

  /// (n) the score the selector ranked by (pooled where pooling is on).
  const Vector<Real>& score() const { return score_; }
  /// (m) kept positions, ascending.
  const std::vector<Index>& kept() const { return kept_; }
  /// (n - m) evicted positions, ascending.
  const std::vector<Index>& evicted() const { return evicted_; }

  /// (G·W, d) window outputs Y = A·V_g of this head's query group (rows as in probabilities()): the
  /// matrix handed to the constructor (a pipeline that still holds the head's window exponentials
  /// from the scorer stage can form it with one (G·W × n × d) product), else from probabilities()
  /// when they are already cached, else computed on first use by the fused window_outputs (no
  /// (G·W, n) matrix).
  const RowMatrix<Real>& window_outputs() const {
    if (given_outputs_) return *given_outputs_;
    if (!has_outputs_) {
      if (this->has_probs_)
        detail::probabilities_times_values(this->layer_, this->head_, this->probs_, outputs_);
      else
        kvc::window_outputs<Real>(this->layer_, this->head_, this->attention_, outputs_);
      has_outputs_ = true;
    }
    return outputs_;
  }

 private:
  const Vector<Real>& score_;
  const std::vector<Index>& kept_;
  const std::vector<Index>& evicted_;
  const RowMatrix<Real>* given_outputs_ = nullptr;
  bool streaming_stores_ = false;
  mutable RowMatrix<Real> outputs_;
  mutable bool has_outputs_ = false;
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

/// Merger output for one head. The pipeline fills keys and values with the kept tokens' original
/// rows before calling the merger, so a merger that does nothing (Drop) is the identity, unless a
/// policy writes them itself in a sweep that reads the cache anyway (PolicyTraits::fills_keys on the
/// router, fills_values on the merger).
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
