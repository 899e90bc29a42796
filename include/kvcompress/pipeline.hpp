// Pipeline<Scorer, Selector, Router, Merger, Compensator, Allocator>: compresses one layer of one sequence.
//
// Read this file first. run_unchecked() (run() after the input checks) is the whole data flow, one
// call per stage (SPEC §2–§11):
//
//   window attention  a_g (n)                  per KV head, from the last W queries
//   Scorer            c_g (n)                  higher = keep
//   Allocator         m_g                      per-head budgets (UniformBudget: m for every head; AdaKV)
//   Selector          kept_g (m_g), evicted_g  forced sinks/recent + top scores (per head or shared)
//   Router            π: evicted → kept        per KV head
//   Merger            K̃_g, Ṽ_g (m_g, d)        Drop / MergeAll / SoftGate / RidgeMerge
//   Compensator       bias_g (m_g)             decode-time additive logit bias
//   (optional) RoPE repositioning of the kept keys to 0..m−1
//
// A view compressed before (LayerView::positions, ::bias): window attention adds the stored bias to
// its logits, the result's positions are the kept entries' stored positions, and each kept entry's
// new bias is its stored bias plus the compensator's term (docs/numerics.md, "Compressing again").
//
// Threads: serial by default. Arguments::threads > 1 runs the per-KV-head stages (window attention +
// scoring, and route + merge + compensate) on that many std::threads; results are bit-identical for
// any thread count (see parallel.hpp). What a policy declares about itself (what it reads, what it
// fills) is read from policy_traits (traits.hpp) and nowhere else.
#pragma once
#include "kvcompress/allocator/budget.hpp"
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#define KVC_INTERNAL_INCLUDE  // admits the private header for this one include
#include "kvcompress/detail/rows.hpp"
#undef KVC_INTERNAL_INCLUDE
#include "kvcompress/parallel.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/result.hpp"
#include "kvcompress/rope.hpp"
#include "kvcompress/router/no_route.hpp"
#include "kvcompress/selector/top_k.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvc {

namespace detail {

// Compile-time checks of a policy's members, for the static_asserts in Pipeline that name what is missing.

template <class P, class = void>
struct has_arguments : std::false_type {};
template <class P>
struct has_arguments<P, std::void_t<typename P::Arguments>> : std::true_type {};

using ProbeContext = HeadContext<float>;

template <class P, class = void>
struct has_score : std::false_type {};
template <class P>
struct has_score<P, std::void_t<decltype(std::declval<const P&>().score(std::declval<const ScoreContext<float>&>(),
                                                                          std::declval<Vector<float>&>()))>>
    : std::true_type {};

/// Whether a scorer also checks the layer itself (`Status validate(const LayerView<T>&) const`): what
/// it needs of the input beyond the shapes every policy needs (ObservedAttention: every prefill query).
template <class P, class T, class = void>
struct has_validate_layer : std::false_type {};
template <class P, class T>
struct has_validate_layer<P, T, std::void_t<decltype(std::declval<const P&>().validate(std::declval<const LayerView<T>&>()))>>
    : std::true_type {};

template <class P, class... Extra>
using select_call = decltype(std::declval<const P&>().select(std::declval<const std::vector<Vector<float>>&>(),
                                                             std::declval<const std::vector<Index>&>(),
                                                             std::declval<Selection<float>&>(), std::declval<Extra>()...));
template <class P, class = void>
struct has_select : std::false_type {};
template <class P>
struct has_select<P, std::void_t<select_call<P>>> : std::true_type {};
template <class P, class = void>
struct has_select_threads : std::false_type {};
template <class P>
struct has_select_threads<P, std::void_t<select_call<P, Index>>> : std::true_type {};

template <class P, class... Extra>
using route_call = decltype(std::declval<const P&>().route(std::declval<const ProbeContext&>(),
                                                           std::declval<Routing&>(), std::declval<Extra>()...));
template <class P, class = void>
struct has_route : std::false_type {};
template <class P>
struct has_route<P, std::void_t<route_call<P>>> : std::true_type {};
template <class P, class = void>
struct has_route_keys : std::false_type {};
template <class P>
struct has_route_keys<P, std::void_t<route_call<P, RowMatrix<float>&>>> : std::true_type {};

template <class P, class = void>
struct has_merge : std::false_type {};
template <class P>
struct has_merge<P, std::void_t<decltype(std::declval<const P&>().merge(
                        std::declval<const ProbeContext&>(), std::declval<const Routing&>(),
                        std::declval<MergeOutput<float>&>()))>> : std::true_type {};

template <class P, class = void>
struct has_compensate : std::false_type {};
template <class P>
struct has_compensate<P, std::void_t<decltype(std::declval<const P&>().compensate(
                             std::declval<const ProbeContext&>(), std::declval<const Routing&>(),
                             std::declval<const MergeOutput<float>&>(), std::declval<Vector<float>&>()))>>
    : std::true_type {};

template <class P, class = void>
struct has_runtime_routes : std::false_type {};
template <class P>
struct has_runtime_routes<P, std::void_t<decltype(std::declval<const P&>().routes())>> : std::true_type {};
template <class P, class = void>
struct has_runtime_needs_routing : std::false_type {};
template <class P>
struct has_runtime_needs_routing<P, std::void_t<decltype(std::declval<const P&>().needs_routing())>> : std::true_type {};

template <class P, class = void>
struct has_runtime_reads_outputs : std::false_type {};
template <class P>
struct has_runtime_reads_outputs<P, std::void_t<decltype(std::declval<const P&>().needs_window_outputs())>>
    : std::true_type {};
template <class P, class = void>
struct has_runtime_needs_mass : std::false_type {};
template <class P>
struct has_runtime_needs_mass<P, std::void_t<decltype(std::declval<const P&>().needs_mass())>> : std::true_type {};
/// Whether a policy reads the window attention mass: its traits say so; one chosen at run time knows.
template <class P>
bool reads_mass(const P& policy) {
  if constexpr (has_runtime_needs_mass<P>::value) return policy.needs_mass();
  else return policy_traits<P>::needs_mass;
}

/// Whether the merger reads Y = A·V: its traits say so; a merger chosen at run time (OneOf) knows.
template <class Merger>
bool merger_reads_outputs(const Merger& merger) {
  if constexpr (has_runtime_reads_outputs<Merger>::value) return merger.needs_window_outputs();
  else return policy_traits<Merger>::needs_window_outputs;
}

template <class P, class = void>
struct has_runtime_reads_rope : std::false_type {};
template <class P>
struct has_runtime_reads_rope<P, std::void_t<decltype(std::declval<const P&>().reads_rope())>> : std::true_type {};
/// Whether the scorer reads the RoPE arguments: its traits say so; one chosen at run time knows.
template <class Scorer>
bool scorer_reads_rope(const Scorer& scorer) {
  if constexpr (has_runtime_reads_rope<Scorer>::value) return scorer.reads_rope();
  else return policy_traits<Scorer>::reads_rope;
}

/// The run-time form of the NoRoute check below, for slots chosen at run time (OneOf).
template <class Router, class Merger>
Status check_routing_pair(const Router& router, const Merger& merger) {
  bool needs = policy_traits<Merger>::needs_routing, routes = !std::is_same_v<Router, NoRoute>;
  if constexpr (has_runtime_needs_routing<Merger>::value) needs = merger.needs_routing();
  if constexpr (has_runtime_routes<Router>::value) routes = router.routes();
  if (needs && !routes)
    return Status::fail(Status::Code::invalid_argument,
                        "this merger pours evicted tokens into routed targets: pair it with a router, not NoRoute");
  return Status::ok();
}

}  // namespace detail

/// Scratch memory of Pipeline::run reused across calls: the per-worker window-attention buffers
/// (O(G·W·n) floats each), the per-head mass and score vectors, for a selector that overwrites it
/// (PolicyTraits::overwrites_selection: TopK, KeepAll) the selection, a Routing per worker and a MergeOutput per head. The policies here
/// keep their working memory in those (Selection::scratch, Routing::scratch, MergeOutput::scratch).
/// An engine that compresses layer after layer keeps one Workspace (per thread calling run) and
/// passes it with a reused LayerResult: with repeating shapes and threads = 1, a reused call of
/// the presets tests/pipeline_alloc_test.cpp lists then allocates nothing with float arithmetic
/// (tests/pipeline_alloc_test.cpp; double arithmetic: Eigen's product allocates its blocking buffer
/// once per head; threads > 1: the threads). RidgeMerge still allocates its per-head matrices in
/// each call (bench: BM_PipelineReuse's allocs_per_call).
/// Holds no results: any content is overwritten by the next call.
template <class Real>
struct Workspace {
  std::vector<WindowWorkspace<Real>> window;
  std::vector<Vector<Real>> mass, score;
  std::vector<Routing> routing;  // per worker: evicted → kept targets of its current head (and the router's scratch)
  std::vector<MergeOutput<Real>> merged;  // per head: its gates and the merger's scratch (keys and values empty between calls)
  std::vector<RowMatrix<Real>> outputs;  // per head (G·W, d): window outputs Y, for mergers that read them
  Selection<Real> selection;  // the selector's output, for selectors that overwrite it (TopK, KeepAll)
  std::vector<Index> budgets;  // per head, clamped to n
  std::vector<char> finite, values_finite;  // per head: the folded NaN/Inf scans
  Vector<Real> shared_bias;  // shared selection: the mean bias

  /// Bytes currently held.
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& w : window) b += w.bytes();
    for (const auto* vs : {&mass, &score, &selection.score})
      for (const auto& v : *vs) b += static_cast<std::size_t>(v.size()) * sizeof(Real);
    for (const auto& r : routing) b += r.target.capacity() * sizeof(Index) + r.scratch->bytes();
    for (const auto& mo : merged)
      b += static_cast<std::size_t>(mo.keys.size() + mo.values.size() + mo.gate.size()) * sizeof(Real) + mo.scratch->bytes();
    b += budgets.capacity() * sizeof(Index) + finite.capacity() + values_finite.capacity() +
         static_cast<std::size_t>(shared_bias.size()) * sizeof(Real);
    for (const auto& y : outputs) b += static_cast<std::size_t>(y.size()) * sizeof(Real);
    for (const auto* lists : {&selection.kept, &selection.evicted})
      for (const auto& l : *lists) b += l.capacity() * sizeof(Index);
    return b + selection.scratch->bytes();
  }
};

template <class Scorer, class Selector, class Router, class Merger, class Compensator, class Allocator = UniformBudget>
class Pipeline {
  static_assert(detail::has_arguments<Scorer>::value && detail::has_score<Scorer>::value,
                "Scorer must have a nested `Arguments` and `score(ctx, out)` (see scorer/scorers.hpp)");
  static_assert(detail::has_arguments<Selector>::value && detail::has_select<Selector>::value,
                "Selector must have a nested `Arguments` and `select(scores, budgets, selection)` (see selector/top_k.hpp)");
  static_assert(detail::has_arguments<Router>::value && detail::has_route<Router>::value,
                "Router must have a nested `Arguments` and `route(ctx, routing)` (see router/bucket_router.hpp)");
  static_assert(detail::has_arguments<Merger>::value && detail::has_merge<Merger>::value,
                "Merger must have a nested `Arguments` and `merge(ctx, routing, out)` (see merger/gated_merge.hpp)");
  static_assert(detail::has_arguments<Compensator>::value && detail::has_compensate<Compensator>::value,
                "Compensator must have a nested `Arguments` and `compensate(ctx, routing, merged, bias)` (see compensator/compensators.hpp)");
  static_assert(detail::has_arguments<Allocator>::value,
                "Allocator must have a nested `Arguments` and `allocate(scores, budgets)` (see allocator/budget.hpp)");
  static_assert(!policy_traits<Router>::fills_keys || detail::has_route_keys<Router>::value,
                "a Router with traits::fills_keys must have `route(ctx, routing, kept_keys)` (see router/bucket_router.hpp)");
  static_assert(!policy_traits<Selector>::takes_threads || detail::has_select_threads<Selector>::value,
                "a Selector with traits::takes_threads must have `select(scores, budgets, selection, Index threads)`");
  static_assert(!policy_traits<Merger>::needs_routing || !std::is_same_v<Router, NoRoute>,
                "this Merger pours evicted tokens into routed targets: pair it with a Router (e.g. BucketRouter<>), not NoRoute");

 public:
  using scorer_type = Scorer;
  using selector_type = Selector;
  using router_type = Router;
  using merger_type = Merger;
  using compensator_type = Compensator;
  using allocator_type = Allocator;

  /// Every stage's options with the preset's defaults, plus the attention and RoPE options.
  struct Arguments {
    AttentionArguments attention;
    typename Scorer::Arguments scorer{};
    typename Selector::Arguments selector{};
    typename Router::Arguments router{};
    typename Merger::Arguments merger{};
    typename Compensator::Arguments compensator{};
    typename Allocator::Arguments allocator{};
    RopeArguments reposition;  ///< off by default
    bool check_finite = true;  ///< reject NaN/Inf in K, V and the window queries; K and V are checked
                               ///< through the logits / scores when a stage reads them anyway. Off
                               ///< waives these input checks only: results are always checked
    Index threads = 1;  ///< worker threads over KV heads; <= 1 = serial, no thread is created (parallel.hpp)
    bool record_merges = false;  ///< fill each HeadResult::merges (where the evicted entries went)
  };

  Pipeline() = default;
  explicit Pipeline(const Arguments& args) : args_(args) {}

  const Arguments& arguments() const { return args_; }
  Arguments& arguments() { return args_; }

  /// Non-throwing check of the layer, the budget and every stage's options.
  template <class T>
  Status validate(const LayerView<T>& layer, const Budget& budget) const {
    return validate_impl(layer, budget, /*scan_keys=*/true, /*scan_values=*/true);
  }

  /// Per-head budgets (one entry per KV head, each ≥ 1; values ≥ n keep everything).
  template <class T>
  Status validate(const LayerView<T>& layer, const std::vector<Index>& budgets) const {
    return validate_impl(layer, budgets, /*scan_keys=*/true, /*scan_values=*/true);
  }


  /// Compresses one layer. Throws kvc::error on bad input (nothing of the caller's memory is
  /// written in any case: the result is returned by value). Arithmetic in compute_t<T>.
  template <class T>
  LayerResult<compute_t<T>> run(const LayerView<T>& layer, const Budget& budget) const {
    LayerResult<compute_t<T>> out;
    Workspace<compute_t<T>> ws;
    run_unchecked(layer, checked_budgets(layer, budget, ws.budgets), out, ws, /*release_scratch=*/true);
    return out;
  }

  template <class T>
  LayerResult<compute_t<T>> run(const LayerView<T>& layer, const std::vector<Index>& budgets) const {
    LayerResult<compute_t<T>> out;
    Workspace<compute_t<T>> ws;
    run_unchecked(layer, checked_budgets(layer, budgets, ws.budgets), out, ws, /*release_scratch=*/true);
    return out;
  }

  /// As run(layer, budget), writing into `out` and taking scratch memory from `ws`: both keep their
  /// allocations from call to call, so compressing layer after layer with the same shapes allocates
  /// nothing after the first call (threads = 1, float arithmetic, any preset but GRKV: see Workspace). `out` is overwritten entirely (its previous content is not read);
  /// on a validation error it is left untouched. Neither may be shared by concurrent calls.
  template <class T>
  void run(const LayerView<T>& layer, const Budget& budget, LayerResult<compute_t<T>>& out,
           Workspace<compute_t<T>>& ws) const {
    run_unchecked(layer, checked_budgets(layer, budget, ws.budgets), out, ws);
  }

  /// Per-head budgets, writing into `out` with scratch memory from `ws` (see above).
  template <class T>
  void run(const LayerView<T>& layer, const std::vector<Index>& budgets, LayerResult<compute_t<T>>& out,
           Workspace<compute_t<T>>& ws) const {
    run_unchecked(layer, checked_budgets(layer, budgets, ws.budgets), out, ws);
  }

 private:
  /// validate(); scan_keys / scan_values = false leave the NaN/Inf scan of K / V to the stage that
  /// reads them anyway (run() checks the window logits or the scores, which are non-finite whenever
  /// a key or value row is: see fold_key_scan, kScanValuesPerHead).
  template <class T>
  Status validate_impl(const LayerView<T>& layer, const Budget& budget, bool scan_keys, bool scan_values) const {
    KVC_RETURN_IF_ERROR(budget.validate());
    KVC_RETURN_IF_ERROR(detail::validate_layer_impl(layer, args_.check_finite && scan_keys,
                                                    args_.check_finite && scan_values, args_.check_finite));
    const Index m = budget.resolve(layer.tokens());
    if (m <= 0)
      return Status::fail(Status::Code::invalid_budget,
                          detail::concat("budget resolves to ", m, " tokens for a cache of ", layer.tokens(),
                                         " (ratio ", budget.rho(), "): it must keep at least one"));
    const Index clamped = std::min(m, layer.tokens());
    return validate_options(layer, [clamped](Index) { return clamped; });
  }

  template <class T>
  Status validate_impl(const LayerView<T>& layer, const std::vector<Index>& budgets, bool scan_keys,
                       bool scan_values) const {
    KVC_RETURN_IF_ERROR(detail::validate_layer_impl(layer, args_.check_finite && scan_keys,
                                                    args_.check_finite && scan_values, args_.check_finite));
    if (static_cast<Index>(budgets.size()) != layer.kv_heads())
      return Status::fail(Status::Code::invalid_budget,
                          detail::concat("budgets has ", budgets.size(), " entries, expected one per KV head (",
                                         layer.kv_heads(), ")"));
    for (std::size_t g = 0; g < budgets.size(); ++g)
      if (budgets[g] <= 0)
        return Status::fail(Status::Code::invalid_budget,
                            detail::concat("budgets[", g, "] = ", budgets[g], ": must be >= 1"));
    return validate_options(layer, [&](Index g) { return std::min(budgets[static_cast<std::size_t>(g)], layer.tokens()); });
  }

  using ScorerTraits = policy_traits<Scorer>;
  using SelectorTraits = policy_traits<Selector>;
  using RouterTraits = policy_traits<Router>;
  using MergerTraits = policy_traits<Merger>;
  using CompensatorTraits = policy_traits<Compensator>;

  /// Whether the window attention stage runs (else a_g = 0).
  static constexpr bool kNeedsMass = ScorerTraits::needs_mass || RouterTraits::needs_mass ||
                                     MergerTraits::needs_mass || CompensatorTraits::needs_mass;

  /// Window attention's logits (float arithmetic) or a key-covering scorer's scores stand in for the
  /// NaN/Inf scan of the keys; a value-covering scorer's scores for the scan of the values. Otherwise
  /// V is scanned head by head inside stage 1 (so the scan runs on the worker threads too), K up front.
  /// Whether this call runs the window attention stage: kNeedsMass, and a policy chosen at run time
  /// (a OneOf slot) needs it.
  bool mass_needed() const {
    if constexpr (!kNeedsMass) return false;
    else
      return detail::reads_mass(scorer()) || detail::reads_mass(router()) || detail::reads_mass(merger()) ||
             detail::reads_mass(compensator());
  }
  template <class T>
  bool fold_key_scan() const {  // the keys' scan is folded into this call's logits or scores
    return (std::is_same_v<compute_t<T>, float> && mass_needed()) || ScorerTraits::covers_keys;
  }
  static constexpr bool kScanValuesPerHead = !ScorerTraits::covers_values;
  /// Nothing after the values' gather reads or changes the kept values: the gather then writes them
  /// with streaming stores (detail::gather_positions), for a result of at least kStreamMinBytes (K and
  /// V of all heads, detail::result_rows_bytes), which would not stay in cache for the caller anyway; a
  /// smaller one is written with ordinary stores, so that the caller (compact_into) finds it in cache.
  static constexpr bool kStreamGathers =
      MergerTraits::keeps_values && !MergerTraits::reads_kept_values && !CompensatorTraits::reads_kept_values;
  /// Nothing after the router (or the keys' gather) reads the kept keys: with the same size rule and
  /// no RoPE repositioning, the kept keys are written with streaming stores, by the gather or by a
  /// router that fills them.
  static constexpr bool kStreamKeys = !MergerTraits::reads_kept_keys && !CompensatorTraits::reads_kept_keys;
  static constexpr std::size_t kStreamMinBytes = detail::kStreamMinBytes;
  /// The merger reads Y = A·V: form it in stage 1 from the window-mass workspace (one product).
  static constexpr bool kOutputsFromMass = kNeedsMass && MergerTraits::needs_window_outputs;
  /// Whether this call forms Y in stage 1: kOutputsFromMass, and the merger chosen at run time reads Y
  /// (a merger slot chosen at run time, OneOf, says which).
  bool outputs_from_mass() const {
    if constexpr (!kOutputsFromMass) return false;
    else return mass_needed() && detail::merger_reads_outputs(merger());
  }

  /// After stage 1 with check_finite: the folded K / V scans (fold_key_scan, kScanValuesPerHead). A
  /// non-finite window logit or covering score means a non-finite key or value row (named as validate()
  /// names it) or, when the rows are finite, an overflow. Nothing has been written to the result yet.
  template <class T, class Real>
  void check_folded_scans(const LayerView<T>& layer, const std::vector<char>& finite,
                          const std::vector<char>& values_finite, const std::vector<Vector<Real>>& score) const {
    constexpr bool covers = ScorerTraits::covers_keys || ScorerTraits::covers_values;
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      const bool logits_ok = finite[static_cast<std::size_t>(g)] != 0;
      const bool score_ok = !covers || score[static_cast<std::size_t>(g)].allFinite();
      if (logits_ok && score_ok && values_finite[static_cast<std::size_t>(g)] != 0) continue;
      if (fold_key_scan<T>()) detail::check_finite(layer.keys, "keys").throw_if_error();
      detail::check_finite(layer.values, "values").throw_if_error();
      throw error(detail::concat(logits_ok ? "a score" : "a window-attention logit", " of KV head ", g,
                                 " is not finite although keys, values and queries are: ",
                                 logits_ok ? "a row norm overflows" : "|scale·<q, k>| overflows", " the arithmetic type"));
    }
  }

  /// validate_impl with the folded scans left out; when that fails, the full validate() runs and its
  /// error is thrown (error path only), so the message is exactly validate()'s whatever else is wrong
  /// too (a non-finite value and a budget that resolves to 0, a non-finite key and query, ...).
  template <class T, class B>
  void throw_if_invalid(const LayerView<T>& layer, const B& budget) const {
    const Status s = validate_impl(layer, budget, !fold_key_scan<T>(), /*scan_values=*/false);
    if (s) return;
    validate_impl(layer, budget, /*scan_keys=*/true, /*scan_values=*/true).throw_if_error();
    s.throw_if_error();  // not reached: the full check fails whenever the partial one does
  }

  /// validate() or throw; `out` <- the per-head budgets clamped to n (returned; `budgets` may be `out`).
  template <class T>
  std::vector<Index>& checked_budgets(const LayerView<T>& layer, const Budget& budget, std::vector<Index>& out) const {
    throw_if_invalid(layer, budget);
    out.assign(static_cast<std::size_t>(layer.kv_heads()), std::min(budget.resolve(layer.tokens()), layer.tokens()));
    return out;
  }
  template <class T>
  std::vector<Index>& checked_budgets(const LayerView<T>& layer, const std::vector<Index>& budgets,
                                      std::vector<Index>& out) const {
    throw_if_invalid(layer, budgets);
    out.resize(budgets.size());
    for (std::size_t g = 0; g < budgets.size(); ++g) out[g] = std::min(budgets[g], layer.tokens());
    return out;
  }

  /// budget_of(g): KV head g's budget, clamped to n.
  template <class T, class BudgetOf>
  Status validate_options(const LayerView<T>& layer, const BudgetOf& budget_of) const {
    const Index H = layer.kv_heads();
    KVC_RETURN_IF_ERROR(args_.attention.validate());
    KVC_RETURN_IF_ERROR(scorer().validate());
    KVC_RETURN_IF_ERROR(selector().validate());
    KVC_RETURN_IF_ERROR(router().validate());
    KVC_RETURN_IF_ERROR(detail::check_routing_pair(router(), merger()));
    for (Index g = 0; g < H; ++g) KVC_RETURN_IF_ERROR(merger().validate(layer.tokens(), budget_of(g)));
    KVC_RETURN_IF_ERROR(compensator().validate());
    KVC_RETURN_IF_ERROR(allocator().validate());
    KVC_RETURN_IF_ERROR(args_.reposition.validate(layer.head_dim(), detail::scorer_reads_rope(scorer())));
    if constexpr (detail::has_validate_layer<Scorer, T>::value) KVC_RETURN_IF_ERROR(scorer().validate(layer));
    if (selector().shares_positions() && !allocator().keeps_budgets())
      return Status::fail(Status::Code::invalid_argument,
                          "this allocator gives KV heads different budgets: pair it with per-head selection, "
                          "not shared selection");
    if (selector().shares_positions())
      for (Index g = 1; g < H; ++g)
        if (budget_of(g) != budget_of(0))
          return Status::fail(Status::Code::invalid_budget,
                              "shared selection needs the same budget for every KV head");
    return Status::ok();
  }

  Scorer scorer() const { return Scorer{args_.scorer}; }
  Selector selector() const { return Selector{args_.selector}; }
  Router router() const { return Router{args_.router}; }
  Merger merger() const { return Merger{args_.merger}; }
  Compensator compensator() const { return Compensator{args_.compensator}; }
  Allocator allocator() const { return Allocator{args_.allocator}; }

  /// Whether KV head g's keys and values and its group's window queries are finite: known when
  /// check_finite validated them, scanned otherwise (on error paths only).
  template <class T>
  bool input_finite(const LayerView<T>& layer, Index g) const {
    if (args_.check_finite) return true;
    if (!detail::head_finite(layer.keys, g) || !detail::head_finite(layer.values, g)) return false;
    const Index group = layer.query_heads() / layer.kv_heads();
    for (Index q = g * group; q < (g + 1) * group; ++q)
      if (!detail::head_finite(layer.queries, q)) return false;
    return true;
  }

  /// The whole data flow (SPEC §2–§11), defined below the class. Each stage is one function of this class.
  template <class T>
  void run_unchecked(const LayerView<T>& layer, std::vector<Index>& budgets, LayerResult<compute_t<T>>& result,
                     Workspace<compute_t<T>>& ws, bool release_scratch = false) const;

  /// Stage 1: ws.mass[g] <- a_g (when a policy needs it, else 0), ws.score[g] <- the scorer's scores
  /// (its context holds the head's budget before allocation, budgets[g]),
  /// and ws.outputs[g] <- Y = A·V for a merger that reads it. Scratch: one (G·W, n) window workspace
  /// per worker, reused across its heads (and calls).
  template <class T>
  void score_heads(const LayerView<T>& layer, const std::vector<Index>& budgets, Workspace<compute_t<T>>& ws,
                   bool release_scratch) const {
    using Real = compute_t<T>;
    const Index H = layer.kv_heads(), n = layer.tokens();
    const auto heads = static_cast<std::size_t>(H);
    ws.mass.resize(heads);
    ws.score.resize(heads);
    const bool mass = mass_needed();
    if (mass && static_cast<Index>(ws.window.size()) < worker_count(H, args_.threads))
      ws.window.resize(static_cast<std::size_t>(worker_count(H, args_.threads)));
    ws.finite.assign(heads, 1);         // per head: every window logit finite
    ws.values_finite.assign(heads, 1);  // per head: every value row finite
    const bool outputs = outputs_from_mass();
    if (outputs) ws.outputs.resize(heads);
    parallel_for(H, args_.threads, [&](Index g, Index worker) {
      const auto h = static_cast<std::size_t>(g);
      if (kScanValuesPerHead && args_.check_finite) ws.values_finite[h] = detail::head_finite_scan(layer.values, g);
      bool computed = false;
      if constexpr (kNeedsMass)
        if (mass) {
          ws.finite[h] = window_mass<Real>(layer, g, args_.attention, ws.mass[h], ws.window[worker]);
          if constexpr (kOutputsFromMass)
            if (outputs) window_outputs_after_mass(layer, g, ws.window[worker], ws.outputs[h]);
          computed = true;
        }
      if (!computed) ws.mass[h].setZero(n);
      ScoreContext<T> ctx(layer, g, args_.attention, ws.mass[h], &args_.reposition);
      ctx.set_budget(budgets[h]);
      scorer().score(ctx, ws.score[h]);
    });
    if (release_scratch) std::vector<WindowWorkspace<Real>>().swap(ws.window);  // one-shot run(): free it now
    if (args_.check_finite) check_folded_scans(layer, ws.finite, ws.values_finite, ws.score);
  }

  /// Stage 3: the selector's output, in the workspace's Selection when the selector overwrites all of
  /// it (its vectors keep their capacity across calls), else in `fresh`.
  template <class Real>
  const Selection<Real>& select(Workspace<Real>& ws, const std::vector<Index>& budgets, Selection<Real>& fresh) const {
    Selection<Real>& sel = SelectorTraits::overwrites_selection ? ws.selection : fresh;
    if constexpr (SelectorTraits::takes_threads)
      selector().select(ws.score, budgets, sel, args_.threads);
    else
      selector().select(ws.score, budgets, sel);
    return sel;
  }

  /// Stage 4: every head's result from its selection (heads in parallel). The result's previous
  /// buffers are recycled.
  template <class T>
  void compress_heads(const LayerView<T>& layer, const Selection<compute_t<T>>& sel, Workspace<compute_t<T>>& ws,
                      LayerResult<compute_t<T>>& result) const {
    const Index H = layer.kv_heads();
    result.heads.resize(static_cast<std::size_t>(H));
    result.shared_positions = sel.shared;
    // The condition window_exp_tiles_t applied (only float keys can take AMX); fma without a window stage.
    result.window_product = WindowProduct::fma;
    if (mass_needed())
      result.window_product =
          detail::window_product_for<T>(args_.attention, layer.head_dim(), layer.group_size() * layer.window());
    const bool large = detail::result_rows_bytes(sel.kept, layer.head_dim(), sizeof(compute_t<T>)) >= kStreamMinBytes;
    const Stores stores{kStreamGathers && large, kStreamKeys && large && !args_.reposition.enabled};
    if (static_cast<Index>(ws.routing.size()) < worker_count(H, args_.threads))
      ws.routing.resize(static_cast<std::size_t>(worker_count(H, args_.threads)));
    if (static_cast<Index>(ws.merged.size()) < H) ws.merged.resize(static_cast<std::size_t>(H));
    const bool outputs = outputs_from_mass();
    parallel_for(H, args_.threads, [&](Index g, Index worker) {
      const auto h = static_cast<std::size_t>(g);
      HeadContext<T> ctx(layer, g, args_.attention, ws.mass[h], sel.score[h], sel.kept[h], sel.evicted[h],
                         outputs ? &ws.outputs[h] : nullptr, &args_.reposition);
      ctx.set_streaming_stores(stores.keys);
      compress_head(ctx, stores, ws.routing[static_cast<std::size_t>(worker)], ws.merged[h], result.heads[h]);
    });
  }

  /// Whether the kept rows are written with streaming stores (see kStreamGathers, kStreamKeys).
  struct Stores {
    bool values = false, keys = false;
  };

  /// One head of stage 4: route (π: evicted → kept), gather the kept rows, merge, compensate.
  /// `merged` is the head's MergeOutput: its gate and merger scratch keep their storage from call to
  /// call; its keys and values are `out`'s own storage, lent for this head and handed back at the end
  /// of this scope, also when a policy throws.
  template <class T>
  void compress_head(const HeadContext<T>& ctx, Stores stores, Routing& routing, MergeOutput<compute_t<T>>& merged,
                     HeadResult<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const Index g = ctx.head(), d = ctx.head_dim();
    const auto& kept = ctx.kept();
    merged.diagnostics = HeadDiagnostics{};
    merged.keys.swap(out.keys);
    merged.values.swap(out.values);
    struct GiveBack {
      MergeOutput<Real>& from;
      HeadResult<Real>& to;
      ~GiveBack() {
        to.keys.swap(from.keys);
        to.values.swap(from.values);
      }
    } give_back{merged, out};
    const Index m = static_cast<Index>(kept.size());
    merged.keys.resize(m, d);    // (m_g, d): the kept rows, written below by the
    merged.values.resize(m, d);  // router / merger or by the gathers
    if constexpr (RouterTraits::fills_keys) {
      router().route(ctx, routing, merged.keys);  // (n − m_g) targets, and the kept keys
    } else {
      router().route(ctx, routing);  // (n − m_g) targets
      detail::gather_positions<Real>(ctx.layer().keys, g, kept, merged.keys, stores.keys);
    }
    if constexpr (!MergerTraits::fills_values)
      detail::gather_positions<Real>(ctx.layer().values, g, kept, merged.values, stores.values);
    // The gates arrive sized one per evicted token and poisoned, so that one the merger leaves
    // unwritten shows as NaN in check_merge (instead of passing with last call's value).
    merged.gate.setConstant(static_cast<Index>(ctx.evicted().size()), std::numeric_limits<Real>::quiet_NaN());
    merger().merge(ctx, routing, merged);  // keys, values: (m_g, d), gate: (n − m_g)
    check_merge(ctx, merged);
    compensator().compensate(ctx, routing, merged, out.bias);  // (m_g)
    check_bias(ctx, out.bias);
    if (ctx.layer().positions.data == nullptr) {
      out.positions = kept;
    } else {  // a view compressed before: the kept entries' stored positions
      out.positions.resize(kept.size());
      for (std::size_t i = 0; i < kept.size(); ++i) out.positions[i] = ctx.position(kept[i]);
    }
    MergeMap<Real>& mm = out.merges;  // empty unless recorded; resized in place when out is reused
    const std::size_t E = args_.record_merges ? ctx.evicted().size() : 0;
    mm.evicted.resize(E);
    mm.target.resize(E);
    mm.gate.resize(E);
    for (std::size_t e = 0; e < E; ++e) {
      const Index t = routing.routed() ? routing.target[e] : Index(-1);
      mm.evicted[e] = ctx.position(ctx.evicted()[e]);
      mm.target[e] = t < 0 ? Index(-1) : out.positions[static_cast<std::size_t>(t)];
      mm.gate[e] = merged.gate[static_cast<Index>(e)];
    }
    out.diagnostics = merged.diagnostics;
    fill_counts(merged, out.diagnostics);
  }

  /// A gate per evicted token, none NaN (with check_finite), and merged values that are finite
  /// whenever the head's input is.
  template <class T>
  void check_merge(const HeadContext<T>& ctx, const MergeOutput<compute_t<T>>& merged) const {
    const Index g = ctx.head();
    if (merged.gate.size() != static_cast<Index>(ctx.evicted().size()))
      throw error(detail::concat("the merger set ", merged.gate.size(), " gates for KV head ", g, ", which evicts ",
                                 ctx.evicted().size(), " tokens: MergeOutput::gate needs one per evicted token"));
    // Part of the input checks: with check_finite off (results unspecified for non-finite input),
    // neither is a NaN gate reported.
    if (args_.check_finite)
      for (Index e = 0; e < merged.gate.size(); ++e)
        if (std::isnan(merged.gate[e]))
          throw error(detail::concat("gate ", e, " of KV head ", g, " is NaN: the merger left it unset (a merger must "
                                     "write every gate on every path) or computed it from sums that overflow"));
    // Results are checked whatever check_finite says (it waives the input scans only): a merge of
    // finite values near the type's limit can overflow, and finite input never gives a non-finite
    // result. With check_finite off the input is scanned on that error path alone, and non-finite
    // input keeps its unspecified (non-finite) result. A merger that keeps the gathered values skips it.
    if constexpr (!MergerTraits::keeps_values) {  // O(m_g·d)
      Index i = 0, c = 0;
      if (detail::find_unrepresentable<compute_t<T>>(merged.values, i, c) && input_finite(ctx.layer(), g))
        throw error(detail::concat("merged value [", g, "][", i, "][", c, "] = ", merged.values(i, c),
                                   " is not finite: merging values this large overflows the arithmetic type"));
    }
  }

  /// A bias that is finite whenever the head's input is. O(m_g).
  template <class T>
  void check_bias(const HeadContext<T>& ctx, const Vector<compute_t<T>>& bias) const {
    if (bias.allFinite() || !input_finite(ctx.layer(), ctx.head())) return;
    Index i = 0;
    while (std::isfinite(bias[i])) ++i;
    throw error(detail::concat("bias[", i, "] = ", bias[i], " of KV head ", ctx.head(), " is not finite although the ",
                               "input is: the compensator's arithmetic overflows"));
  }

  /// Stage 5: each head's bias <- the mean over heads (shared selection: every head keeps the same
  /// positions, SPEC §8).
  template <class Real>
  static void share_bias(LayerResult<Real>& result, Vector<Real>& mean) {
    if (result.heads.size() <= 1) return;
    mean.setZero(result.heads[0].size());
    for (const auto& h : result.heads) mean += h.bias;
    mean /= static_cast<Real>(result.heads.size());
    for (auto& h : result.heads) h.bias = mean;
  }

  /// Stage 5b (a view compressed before): each kept entry's stored bias added to its new bias, so
  /// that the bias composes over compressions (docs/numerics.md, "Compressing again"). O(Σ m_g).
  template <class T>
  static void add_stored_bias(const LayerView<T>& layer, const Selection<compute_t<T>>& sel,
                              LayerResult<compute_t<T>>& result) {
    for (std::size_t g = 0; g < result.heads.size(); ++g) {
      auto& bias = result.heads[g].bias;
      const auto& kept = sel.kept[g];
      for (std::size_t i = 0; i < kept.size(); ++i) {
        const auto k = static_cast<Index>(i);
        const auto stored = layer.bias.at(static_cast<Index>(g), kept[i]), term = bias[k];
        bias[k] = term + stored;
        if (!std::isfinite(bias[k]) && std::isfinite(stored) && std::isfinite(term))
          throw error(detail::concat("bias[", k, "] = ", bias[k], " of KV head ", g, " is not finite: the stored bias ",
                                     stored, " plus the new term ", term, " overflows"));
      }
    }
  }

  /// Whether every head kept the same stored positions (shared selection over a view with positions).
  template <class Real>
  static bool same_positions(const LayerResult<Real>& result) {
    for (const auto& h : result.heads)
      if (h.positions != result.heads[0].positions) return false;
    return true;
  }

  /// Stage 6: kept keys re-embedded at positions 0..m_g−1 (SPEC §10), rotated from their stored
  /// positions (or indices); the next token uses max m_g.
  template <class T>
  void reposition(const LayerView<T>& layer, LayerResult<compute_t<T>>& result) const {
    const Index d = layer.head_dim();
    for (std::size_t g = 0; g < result.heads.size(); ++g) {
      auto& h = result.heads[g];
      for (Index i = 0; i < h.size(); ++i)
        rope_shift(h.keys.row(i).data(), d, args_.reposition, double(i) - double(h.positions[i]));
      // A rotation grows a pair's larger entry by up to √2: keys near the type's largest value overflow.
      Index i = 0, c = 0;
      if (detail::find_unrepresentable<compute_t<T>>(h.keys, i, c) && input_finite(layer, static_cast<Index>(g)))
        throw error(detail::concat("repositioned key [", g, "][", i, "][", c, "] = ", h.keys(i, c), " (position ",
                                   h.positions[static_cast<std::size_t>(i)], ") is not finite although the input is: ",
                                   "rotating keys this large overflows the arithmetic type"));
    }
    result.next_position = result.max_size();
  }

  template <class Real>
  static void fill_counts(const MergeOutput<Real>& merged, HeadDiagnostics& diag) {
    diag.kept = merged.keys.rows();
    diag.evicted = merged.gate.size();
    diag.merged = 0;
    for (Index e = 0; e < merged.gate.size(); ++e) diag.merged += merged.gate[e] > Real(0) ? 1 : 0;
    diag.dropped = diag.evicted - diag.merged;
    diag.gate_mean = diag.evicted > 0 ? double(merged.gate.sum()) / double(diag.evicted) : 0.0;
  }

  Arguments args_;
};

// Not inline, so that KVC_EXTERN_PIPELINE can keep a unit from compiling it (see below).
template <class Scorer, class Selector, class Router, class Merger, class Compensator, class Allocator>
template <class T>
void Pipeline<Scorer, Selector, Router, Merger, Compensator, Allocator>::run_unchecked(
    const LayerView<T>& layer, std::vector<Index>& budgets, LayerResult<compute_t<T>>& result,
    Workspace<compute_t<T>>& ws, bool release_scratch) const {
  using Real = compute_t<T>;
  // 1. Window attention and scores, per KV head.     ws.mass[g], ws.score[g]: (n)
  score_heads(layer, budgets, ws, release_scratch);
  // 2. Budget allocation.                            budgets: [Hkv] m_g, Σ m_g kept
  allocator().allocate(ws.score, budgets);
  // 3. Selection.                                    kept[g]: (m_g) ascending, evicted[g]: (n − m_g)
  Selection<Real> fresh;
  const Selection<Real>& sel = select(ws, budgets, fresh);
  // 4. Per KV head: route, merge, compensate.        keys, values: (m_g, d), bias: (m_g)
  compress_heads(layer, sel, ws, result);
  // 5. Shared selection: one bias per position, the mean over KV heads (SPEC §8).
  if (sel.shared) share_bias(result, ws.shared_bias);
  //    A view compressed before: + the kept entries' stored bias (after the mean: it is per head).
  if (layer.biased()) add_stored_bias(layer, sel, result);
  if (sel.shared && layer.positions.data != nullptr) result.shared_positions = same_positions(result);
  // 6. Optional RoPE repositioning to positions 0..m−1 (SPEC §10). Else the next token follows the
  //    cache's last entry: n, or its largest last stored position + 1.
  result.next_position = layer.tokens();
  if (layer.positions.data != nullptr) {
    result.next_position = 0;
    for (Index g = 0; g < layer.kv_heads(); ++g)
      result.next_position = std::max(result.next_position, layer.positions.at(g, layer.tokens() - 1) + 1);
  }
  if (args_.reposition.enabled) reposition(layer, result);
}

}  // namespace kvc

/// Compile time. Every unit that runs a preset compiles its whole data flow for the element type it
/// reads. A project that runs one preset from many units can compile it once: one .cpp says
///   KVC_INSTANTIATE_PIPELINE(float, kvc::SnapKV)
/// and a header the other units include (before they run it) says
///   KVC_EXTERN_PIPELINE(float, kvc::SnapKV)
/// The arguments: the element type T of the LayerView, then the Pipeline type (an alias or a full
/// Pipeline<...>). Results are the same either way.
#define KVC_PIPELINE_INSTANTIATION_(prefix, T, ...)                                                           \
  prefix template void __VA_ARGS__::run_unchecked<T>(                                                         \
      const ::kvc::LayerView<T>&, std::vector<::kvc::Index>&, ::kvc::LayerResult<::kvc::compute_t<T>>&,       \
      ::kvc::Workspace<::kvc::compute_t<T>>&, bool) const;
#define KVC_INSTANTIATE_PIPELINE(T, ...) KVC_PIPELINE_INSTANTIATION_(, T, __VA_ARGS__)
#define KVC_EXTERN_PIPELINE(T, ...) KVC_PIPELINE_INSTANTIATION_(extern, T, __VA_ARGS__)
