// The types the pipeline's policies exchange: per-head context, routing, merge output, diagnostics.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"

#include <limits>
#include <optional>
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
  bool key_step_rejected = false;  ///< the optional safeguard undid the key step
};

/// Everything a per-head policy (router, merger, compensator) may read about KV head `head`.
/// Views point into the caller's memory (read only). Window probabilities are computed on first use.
template <class T>
class HeadContext {
 public:
  using Real = compute_t<T>;

  HeadContext(const LayerView<T>& layer, Index head, const AttentionArguments& attention,
              const Vector<Real>& mass, const Vector<Real>& score, const std::vector<Index>& kept,
              const std::vector<Index>& evicted)
      : layer_(layer), head_(head), attention_(attention), mass_(mass), score_(score), kept_(kept),
        evicted_(evicted) {}

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

 private:
  const LayerView<T>& layer_;
  Index head_;
  const AttentionArguments& attention_;
  const Vector<Real>& mass_;
  const Vector<Real>& score_;
  const std::vector<Index>& kept_;
  const std::vector<Index>& evicted_;
  mutable std::optional<RowMatrix<Real>> probs_;
};

/// Router output for one head: for each evicted token (in ctx.evicted() order) the index into
/// ctx.kept() of its target, or -1 when the router routes nothing (NoRoute).
struct Routing {
  std::vector<Index> target;
  bool routed() const { return !target.empty(); }
};

/// Merger output for one head. The pipeline fills keys/values with the kept tokens' original rows
/// before calling the merger, so a merger that does nothing (Drop) is the identity.
template <class Real>
struct MergeOutput {
  RowMatrix<Real> keys;    // (m, d)
  RowMatrix<Real> values;  // (m, d)
  Vector<Real> gate;       // (n - m) gate of each evicted token (0 = dropped)
  HeadDiagnostics diagnostics;
};

}  // namespace kvc
