// Pipeline<Scorer, Selector, Router, Merger, Compensator>: compresses one layer of one sequence.
//
// Read this file first. run() is the whole data flow (SPEC §2–§11):
//
//   window attention  a_g (n)                  per KV head, from the last W queries
//   Scorer            c_g (n)                  higher = keep
//   Selector          kept_g (m_g), evicted_g  forced sinks/recent + top scores (per head or shared)
//   Router            π: evicted → kept        per KV head
//   Merger            K̃_g, Ṽ_g (m_g, d)        Drop / MergeAll / SoftGate / RidgeMerge
//   Compensator       bias_g (m_g)             decode-time additive logit bias
//   (optional) RoPE repositioning of the kept keys to 0..m−1
//
// Threads: serial by default. Arguments::threads > 1 runs the per-KV-head stages (window attention +
// scoring, and route + merge + compensate) on that many std::threads; results are bit-identical for
// any thread count (see parallel.hpp).
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#define KVC_INTERNAL_INCLUDE
#endif

#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/detail/rows.hpp"
#include "kvcompress/parallel.hpp"
#include "kvcompress/policy.hpp"
#include "kvcompress/result.hpp"
#include "kvcompress/rope.hpp"
#include "kvcompress/router/no_route.hpp"
#include "kvcompress/selector/top_k.hpp"

#include <type_traits>
#include <vector>

namespace kvc {

namespace detail {

template <class P, class = void>
struct needs_mass : std::false_type {};
template <class P>
struct needs_mass<P, std::void_t<decltype(P::needs_mass)>> : std::bool_constant<P::needs_mass> {};

template <class P, class = void>
struct needs_routing : std::false_type {};
template <class P>
struct needs_routing<P, std::void_t<decltype(P::needs_routing)>> : std::bool_constant<P::needs_routing> {};

template <class P, class = void>
struct has_arguments : std::false_type {};
template <class P>
struct has_arguments<P, std::void_t<typename P::Arguments>> : std::true_type {};

using ProbeLayer = LayerView<float>;
using ProbeContext = HeadContext<float>;

template <class P, class = void>
struct has_score : std::false_type {};
template <class P>
struct has_score<P, std::void_t<decltype(std::declval<const P&>().score(
                        std::declval<const ProbeLayer&>(), Index{}, std::declval<const Vector<float>&>(),
                        std::declval<Vector<float>&>()))>> : std::true_type {};

template <class P, class = void>
struct has_select : std::false_type {};
template <class P>
struct has_select<P, std::void_t<decltype(std::declval<const P&>().select(
                         std::declval<const std::vector<Vector<float>>&>(),
                         std::declval<const std::vector<Index>&>(), std::declval<Selection<float>&>()))>>
    : std::true_type {};

template <class P, class = void>
struct has_route : std::false_type {};
template <class P>
struct has_route<P, std::void_t<decltype(std::declval<const P&>().route(
                        std::declval<const ProbeContext&>(), std::declval<Routing&>()))>> : std::true_type {};

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

}  // namespace detail

template <class Scorer, class Selector, class Router, class Merger, class Compensator>
class Pipeline {
  static_assert(detail::has_arguments<Scorer>::value && detail::has_score<Scorer>::value,
                "Scorer must have a nested `Arguments` and `score(layer, g, mass, out)` (see scorer/scorers.hpp)");
  static_assert(detail::has_arguments<Selector>::value && detail::has_select<Selector>::value,
                "Selector must have a nested `Arguments` and `select(scores, budgets, selection)` (see selector/top_k.hpp)");
  static_assert(detail::has_arguments<Router>::value && detail::has_route<Router>::value,
                "Router must have a nested `Arguments` and `route(ctx, routing)` (see router/bucket_router.hpp)");
  static_assert(detail::has_arguments<Merger>::value && detail::has_merge<Merger>::value,
                "Merger must have a nested `Arguments` and `merge(ctx, routing, out)` (see merger/gated_merge.hpp)");
  static_assert(detail::has_arguments<Compensator>::value && detail::has_compensate<Compensator>::value,
                "Compensator must have a nested `Arguments` and `compensate(ctx, routing, merged, bias)` (see compensator/compensators.hpp)");
  static_assert(!detail::needs_routing<Merger>::value || !std::is_same_v<Router, NoRoute>,
                "this Merger pours evicted tokens into routed targets: pair it with a Router (e.g. BucketRouter<>), not NoRoute");

 public:
  using scorer_type = Scorer;
  using selector_type = Selector;
  using router_type = Router;
  using merger_type = Merger;
  using compensator_type = Compensator;

  /// Every stage's options with the preset's defaults, plus the attention and RoPE options.
  struct Arguments {
    AttentionArguments attention;
    typename Scorer::Arguments scorer{};
    typename Selector::Arguments selector{};
    typename Router::Arguments router{};
    typename Merger::Arguments merger{};
    typename Compensator::Arguments compensator{};
    RopeArguments reposition;  ///< off by default
    bool check_finite = true;  ///< scan K, V and the window queries for NaN/Inf (one read of each)
    Index threads = 1;  ///< worker threads over KV heads; <= 1 = serial, no thread is created (parallel.hpp)
  };

  Pipeline() = default;
  explicit Pipeline(const Arguments& args) : args_(args) {}

  const Arguments& arguments() const { return args_; }
  Arguments& arguments() { return args_; }

  /// Non-throwing check of the layer, the budget and every stage's options.
  template <class T>
  Status validate(const LayerView<T>& layer, const Budget& budget) const {
    KVC_RETURN_IF_ERROR(budget.validate());
    KVC_RETURN_IF_ERROR(validate_layer(layer, args_.check_finite));
    const Index m = budget.resolve(layer.tokens());
    if (m <= 0)
      return Status::fail(Status::Code::invalid_budget,
                          detail::concat("budget resolves to ", m, " tokens for a cache of ", layer.tokens(),
                                         " (ratio ", budget.rho(), "): it must keep at least one"));
    return validate_options(layer, std::vector<Index>(layer.kv_heads(), std::min(m, layer.tokens())));
  }

  /// Per-head budgets (one entry per KV head, each ≥ 1; values ≥ n keep everything).
  template <class T>
  Status validate(const LayerView<T>& layer, const std::vector<Index>& budgets) const {
    KVC_RETURN_IF_ERROR(validate_layer(layer, args_.check_finite));
    if (static_cast<Index>(budgets.size()) != layer.kv_heads())
      return Status::fail(Status::Code::invalid_budget,
                          detail::concat("budgets has ", budgets.size(), " entries, expected one per KV head (",
                                         layer.kv_heads(), ")"));
    for (std::size_t g = 0; g < budgets.size(); ++g)
      if (budgets[g] <= 0)
        return Status::fail(Status::Code::invalid_budget,
                            detail::concat("budgets[", g, "] = ", budgets[g], ": must be >= 1"));
    std::vector<Index> clamped(budgets);
    for (auto& b : clamped) b = std::min(b, layer.tokens());
    return validate_options(layer, clamped);
  }

  /// Compresses one layer. Throws kvc::error on bad input (nothing of the caller's memory is
  /// written in any case: the result is returned by value). Arithmetic in compute_t<T>.
  template <class T>
  LayerResult<compute_t<T>> run(const LayerView<T>& layer, const Budget& budget) const {
    validate(layer, budget).throw_if_error();
    const Index m = std::min(budget.resolve(layer.tokens()), layer.tokens());
    return run_unchecked(layer, std::vector<Index>(layer.kv_heads(), m));
  }

  template <class T>
  LayerResult<compute_t<T>> run(const LayerView<T>& layer, const std::vector<Index>& budgets) const {
    validate(layer, budgets).throw_if_error();
    std::vector<Index> clamped(budgets);
    for (auto& b : clamped) b = std::min(b, layer.tokens());
    return run_unchecked(layer, clamped);
  }

 private:
  static constexpr bool kNeedsMass = detail::needs_mass<Scorer>::value || detail::needs_mass<Router>::value ||
                                     detail::needs_mass<Merger>::value || detail::needs_mass<Compensator>::value;

  template <class T>
  Status validate_options(const LayerView<T>& layer, const std::vector<Index>& budgets) const {
    KVC_RETURN_IF_ERROR(args_.attention.validate());
    KVC_RETURN_IF_ERROR(scorer().validate());
    KVC_RETURN_IF_ERROR(selector().validate());
    KVC_RETURN_IF_ERROR(router().validate());
    for (Index b : budgets) KVC_RETURN_IF_ERROR(merger().validate(layer.tokens(), b));
    KVC_RETURN_IF_ERROR(compensator().validate());
    KVC_RETURN_IF_ERROR(args_.reposition.validate(layer.head_dim()));
    if (selector().shares_positions())
      for (Index b : budgets)
        if (b != budgets[0])
          return Status::fail(Status::Code::invalid_budget,
                              "shared selection needs the same budget for every KV head");
    return Status::ok();
  }

  Scorer scorer() const { return Scorer{args_.scorer}; }
  Selector selector() const { return Selector{args_.selector}; }
  Router router() const { return Router{args_.router}; }
  Merger merger() const { return Merger{args_.merger}; }
  Compensator compensator() const { return Compensator{args_.compensator}; }

  template <class T>
  LayerResult<compute_t<T>> run_unchecked(const LayerView<T>& layer, const std::vector<Index>& budgets) const {
    using Real = compute_t<T>;
    const Index H = layer.kv_heads(), n = layer.tokens(), d = layer.head_dim();

    // 1. Window attention and scores, per KV head. mass[g]: (n), score[g]: (n)
    //    scratch: one (G·W, n) workspace per worker, reused across its heads.
    std::vector<Vector<Real>> mass(H), score(H);
    std::vector<WindowWorkspace<Real>> scratch(kNeedsMass ? worker_count(H, args_.threads) : 0);
    parallel_for(H, args_.threads, [&](Index g, Index worker) {
      if constexpr (kNeedsMass) {
        window_mass<Real>(layer, g, args_.attention, mass[g], scratch[worker]);
      } else {
        mass[g].setZero(n);
      }
      scorer().score(layer, g, mass[g], score[g]);
    });
    scratch.clear();

    // 2. Selection. kept[g]: (m_g) ascending
    Selection<Real> sel;
    selector().select(score, budgets, sel);

    // 3. Per KV head: route, merge, compensate.
    LayerResult<Real> result;
    result.heads.resize(H);
    result.shared_positions = sel.shared;
    parallel_for(H, args_.threads, [&](Index g, Index /*worker*/) {
      const HeadContext<T> ctx(layer, g, args_.attention, mass[g], sel.score[g], sel.kept[g], sel.evicted[g]);
      Routing routing;
      router().route(ctx, routing);  // π: (n − m_g) → kept index

      MergeOutput<Real> merged;
      const Index m = static_cast<Index>(sel.kept[g].size());
      merged.keys.resize(m, d);  // (m_g, d) starts as the kept rows
      merged.values.resize(m, d);
      detail::gather_positions<Real>(layer.keys, g, sel.kept[g], merged.keys);
      detail::gather_positions<Real>(layer.values, g, sel.kept[g], merged.values);
      merger().merge(ctx, routing, merged);

      HeadResult<Real>& out = result.heads[g];
      compensator().compensate(ctx, routing, merged, out.bias);  // (m_g)

      out.positions = sel.kept[g];
      out.diagnostics = merged.diagnostics;
      fill_counts(merged, out.diagnostics);
      out.keys = std::move(merged.keys);
      out.values = std::move(merged.values);
    });

    // 4. Shared selection: one bias per position, the mean over KV heads (SPEC §8).
    if (sel.shared && H > 1) {
      Vector<Real> mean = Vector<Real>::Zero(result.heads[0].size());
      for (const auto& h : result.heads) mean += h.bias;
      mean /= static_cast<Real>(H);
      for (auto& h : result.heads) h.bias = mean;
    }

    // 5. Optional RoPE repositioning to contiguous positions 0..m−1 (SPEC §10).
    result.next_position = n;
    if (args_.reposition.enabled) {
      for (auto& h : result.heads)
        for (Index i = 0; i < h.size(); ++i)
          rope_shift(h.keys.row(i).data(), d, args_.reposition, double(i) - double(h.positions[i]));
      result.next_position = result.max_size();
    }
    return result;
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

}  // namespace kvc
