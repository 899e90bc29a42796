// The tool's --scorer / --merger / --compensator: a method's policies with stages swapped, run by one
// Pipeline of OneOf slots (one_of.hpp), compiled once per element type (presets_compiled.hpp), where
// a Pipeline per combination would be compiled each.
#pragma once

#include "methods.hpp"

#include <kvcompress/one_of.hpp>
#include <kvcompress/presets.hpp>

#include <stdexcept>
#include <string>

namespace kvc::cli {

using ComposedScorer = OneOf<Position, AttentionMass, ValueWeighted, KeyNorm, LastQueryAttention, KeyDiversity,
                             LocalLeverage, LagRelative, ExpectedAttention, ObservedAttention, CriticalAttention>;
using ComposedSelector = OneOf<TopK<>, TopChunks<>, KeepAll, ThresholdSelect<>, TopBlocks<>>;
using ComposedRouter = OneOf<NoRoute, BucketRouter<>>;
using ComposedMerger = OneOf<Drop, SoftGate, MergeAll, RidgeMerge, NearestKeyMerge, CacheMerge>;
using ComposedCompensator = OneOf<NoCompensation, AttentionRatio, MergeCount>;
using ComposedAllocator = OneOf<UniformBudget, AdaKV>;
using Composed = Pipeline<ComposedScorer, ComposedSelector, ComposedRouter, ComposedMerger, ComposedCompensator,
                          ComposedAllocator>;

/// The names --merger and --compensator take.
inline const std::vector<std::string>& merger_names() {
  static const std::vector<std::string> names = {"drop", "merge-all", "soft-gate", "ridge", "nearest-key", "cam"};
  return names;
}
inline const std::vector<std::string>& compensator_names() {
  static const std::vector<std::string> names = {"none", "log-ratio", "merge-count"};
  return names;
}

namespace detail {

// A preset's policy as the alternative of its slot: the templates' parameters are only defaults of
// their Arguments, so TopK<4, 0, 0> becomes TopK<> with the same Arguments.
template <class P>
P as_alternative(const P& p) {
  return p;
}
template <Index S, Index R, Index P, Granularity G>
TopK<> as_alternative(const TopK<S, R, P, G>& p) {
  return TopK<>{{p.args.sinks, p.args.recent, p.args.pool_kernel, p.args.pooling, p.args.granularity}};
}
template <Index C, Index S, Index R, Index P, Granularity G>
TopChunks<> as_alternative(const TopChunks<C, S, R, P, G>& p) {
  return TopChunks<>{{p.args.chunk, p.args.sinks, p.args.recent, p.args.pool_kernel, p.args.pooling, p.args.granularity}};
}
template <Index B, RouteStatistic St>
BucketRouter<> as_alternative(const BucketRouter<B, St>& p) {
  return BucketRouter<>{{p.args.bucket, p.args.statistic}};
}

inline std::string choices(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace detail

/// Whether the options swap a stage (the method then runs as a Composed pipeline).
inline bool swaps_stages(const MethodOptions& o) {
  return o.scorer || o.merger || o.compensator || o.allocation || o.block_size;
}

/// Method `method`'s preset as Composed::Arguments with the stages the options name swapped in, then
/// the options applied to the stages that take them. Rules:
/// - --scorer M: the scorer of method M (its defaults); criticalkv's pools its own mass and its scores
///   are final, so it turns the selector's pooling off (an explicit --pool / --pooling still applies);
/// - --merger: drop, merge-all, soft-gate (SelKV's), ridge (GRKV's), nearest-key (kvpress MergingPress),
///   cam (CaM); nearest-key routes every evicted token to its most key-similar kept token (global key
///   cosine), merge-all and soft-gate get SelKV's router (32-token buckets, key cosine) when the method
///   has none, and the others run without one;
/// - --compensator: none, log-ratio (SelKV's α·log R), merge-count (log(1 + merged));
/// - --block-size b: the selector becomes TopBlocks (whole blocks of b entries, one selection for
///   every head) with the method's sinks, recent and pooling; methods that keep everything or select by
///   a threshold have no ranking to cut into blocks and reject it;
/// - --allocation: uniform (every KV head keeps m), adakv (AdaKV's per-head budgets; needs per-head
///   selection).
/// Throws std::invalid_argument for an unknown name or an option that does not apply.
inline Composed::Arguments composed_arguments(const std::string& method, const MethodOptions& o) {
  Composed::Arguments c = visit_method(method, [](auto tag) {
    using Preset = typename decltype(tag)::type;
    const typename Preset::Arguments a;
    Composed::Arguments r;
    r.attention = a.attention;
    r.reposition = a.reposition;
    r.check_finite = a.check_finite;
    r.scorer.policy = detail::as_alternative(typename Preset::scorer_type{a.scorer});
    r.selector.policy = detail::as_alternative(typename Preset::selector_type{a.selector});
    r.router.policy = detail::as_alternative(typename Preset::router_type{a.router});
    r.merger.policy = detail::as_alternative(typename Preset::merger_type{a.merger});
    r.compensator.policy = detail::as_alternative(typename Preset::compensator_type{a.compensator});
    r.allocator.policy = detail::as_alternative(typename Preset::allocator_type{a.allocator});
    return r;
  });
  std::string label = method;
  if (o.scorer) {
    c.scorer = visit_method(*o.scorer, [](auto tag) {
      using Preset = typename decltype(tag)::type;
      return ComposedScorer::Arguments{detail::as_alternative(typename Preset::scorer_type{typename Preset::Arguments{}.scorer})};
    });
    label += " --scorer " + *o.scorer;
    if (std::holds_alternative<CriticalAttention>(c.scorer.policy))
      std::visit(
          [](auto& p) {
            if constexpr (detail::has_pool<std::decay_t<decltype(p.args)>>::value) p.args.pooling = Pooling::none;
          },
          c.selector.policy);
  }
  if (o.merger) {
    const std::string& m = *o.merger;
    if (m == "drop") c.merger.policy = Drop{};
    else if (m == "merge-all") c.merger.policy = MergeAll{};
    else if (m == "soft-gate") c.merger.policy = SoftGate{};
    else if (m == "ridge") c.merger.policy = RidgeMerge{};
    else if (m == "nearest-key") c.merger.policy = NearestKeyMerge{};
    else if (m == "cam") c.merger.policy = CacheMerge{};
    else throw std::invalid_argument("--merger must be one of " + detail::choices(merger_names()) + ", got '" + m + "'");
    if (!ComposedMerger{c.merger}.needs_routing()) c.router.policy = NoRoute{};
    else if (m == "nearest-key") c.router.policy = BucketRouter<>{{0, RouteStatistic::key_cosine}};  // global
    else if (!ComposedRouter{c.router}.routes()) c.router.policy = BucketRouter<>{};
    label += " --merger " + m;
  }
  if (o.compensator) {
    const std::string& m = *o.compensator;
    if (m == "none") c.compensator.policy = NoCompensation{};
    else if (m == "log-ratio") c.compensator.policy = AttentionRatio{};
    else if (m == "merge-count") c.compensator.policy = MergeCount{};
    else
      throw std::invalid_argument("--compensator must be one of " + detail::choices(compensator_names()) + ", got '" +
                                  m + "'");
    label += " --compensator " + m;
  }
  if (o.allocation) {
    const std::string& m = *o.allocation;
    if (m == "uniform") c.allocator.policy = UniformBudget{};
    else if (m == "adakv") c.allocator.policy = AdaKV{};
    else throw std::invalid_argument("--allocation must be uniform or adakv, got '" + m + "'");
    label += " --allocation " + m;
  }
  if (o.block_size && !ComposedAllocator{c.allocator}.keeps_budgets())
    throw std::invalid_argument("--block-size keeps the same whole blocks for every KV head, which per-head budgets (" +
                                label + ": AdaKV) cannot");
  if (o.block_size) {
    TopBlocks<> blocks;
    std::visit(
        [&](auto& p) {
          using A = std::decay_t<decltype(p.args)>;
          if constexpr (detail::has_pool<A>::value) {
            blocks.args.sinks = p.args.sinks;
            blocks.args.recent = p.args.recent;
            blocks.args.pool_kernel = p.args.pool_kernel;
            blocks.args.pooling = p.args.pooling;
          } else {
            throw std::invalid_argument("--block-size does not apply to method '" + label +
                                        "': its selector keeps everything or a threshold's outcome, not a budget of ranked entries");
          }
        },
        c.selector.policy);
    c.selector.policy = blocks;
    label += " --block-size " + std::to_string(*o.block_size);
  }
  std::visit([&](auto& p) { detail::apply_selector(p.args, o, label); }, c.selector.policy);
  std::visit([&](auto& p) { detail::apply_router(p.args, o, label); }, c.router.policy);
  std::visit([&](auto& p) { detail::apply_compensator(p.args, o, label); }, c.compensator.policy);
  std::visit([&](auto& p) { detail::apply_merger(p.args, o, label); }, c.merger.policy);
  detail::apply_reposition(c, o);
  if (!ComposedAllocator{c.allocator}.keeps_budgets() && ComposedSelector{c.selector}.shares_positions())
    throw std::invalid_argument("method '" + label + "' selects the same positions for every KV head, which per-head "
                                "budgets cannot: add --selection per-head");
  return c;
}

}  // namespace kvc::cli
