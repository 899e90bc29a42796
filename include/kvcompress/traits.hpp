// PolicyTraits: what a policy declares about itself, with the defaults of a policy that declares nothing.
#pragma once
#include "kvcompress/core.hpp"

#include <type_traits>

namespace kvc {

/// What a policy declares about itself, read by the pipeline in one place (policy_traits). A policy
/// declares nothing, or a nested `struct traits : kvc::PolicyTraits { ... }` that redefines the
/// members it needs; the rest keep these defaults. The first three and reads_rope change what the
/// pipeline computes or checks and must be declared when they hold; the others only buy speed and come
/// with the obligation stated.
struct PolicyTraits {
  /// Reads the window attention mass a_g (ctx.mass()): the window attention stage runs (else a_g = 0).
  static constexpr bool needs_mass = false;
  /// Merger: reads routing.target, so composing it with NoRoute is a compile error.
  static constexpr bool needs_routing = false;
  /// Merger: reads ctx.window_outputs() (Y = A·V): formed in the window stage for one product.
  static constexpr bool needs_window_outputs = false;

  /// Scorer: its score is non-finite whenever a key / value row is, so the pipeline checks the scores
  /// instead of scanning K / V for NaN and Inf.
  static constexpr bool covers_keys = false;
  static constexpr bool covers_values = false;
  /// Scorer: reads ctx.rope() (the keys' RoPE layout, base and rotary dimension), so the pipeline
  /// validates those arguments even with repositioning off.
  static constexpr bool reads_rope = false;
  /// Selector: select() overwrites every field of the Selection (keeping capacity): the pipeline
  /// passes the Workspace's instead of a fresh one.
  static constexpr bool overwrites_selection = false;
  /// Selector: provides select(scores, budgets, out, Index threads), which may use that many threads
  /// (Pipeline::Arguments::threads); the selection must not depend on it.
  static constexpr bool takes_threads = false;
  /// Router: provides route(ctx, routing, RowMatrix<Real>& kept_keys), which also writes every kept
  /// key row (resized to (m, d)), saving the pipeline's gather; with ctx.streaming_stores() it may
  /// write them with non-temporal stores.
  static constexpr bool fills_keys = false;
  /// Merger: out.values arrives (m, d) with unspecified contents and it writes every row.
  static constexpr bool fills_values = false;
  /// Merger: leaves out.values exactly as gathered (Drop): the pipeline skips its overflow check.
  static constexpr bool keeps_values = false;
  /// Merger, compensator: whether it reads out.keys / out.values; when nothing does, a large result
  /// is written with streaming stores.
  static constexpr bool reads_kept_keys = true;
  static constexpr bool reads_kept_values = true;
};

/// P::traits when P declares it (it must derive from PolicyTraits), else PolicyTraits.
template <class P, class = void>
struct policy_traits_of {
  using type = PolicyTraits;
};
template <class P>
struct policy_traits_of<P, std::void_t<typename P::traits>> {
  static_assert(std::is_base_of_v<PolicyTraits, typename P::traits>,
                "a policy's nested `traits` must derive from kvc::PolicyTraits");
  using type = typename P::traits;
};
template <class P>
using policy_traits = typename policy_traits_of<P>::type;

}  // namespace kvc
