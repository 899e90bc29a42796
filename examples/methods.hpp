// Method registry shared by the demo, the kvcompress tool and the benchmarks: maps a method name and
// command-line options one to one onto a preset and its Arguments.
#pragma once

#include <kvcompress/kvcompress.hpp>

#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::cli {

/// Options shared by all subcommands; unset ones keep the preset's defaults.
struct MethodOptions {
  std::optional<Index> pool, recent, sinks, bucket, steps, holdout_every;
  std::optional<std::string> route, selection, pooling, lambda_mode;
  /// Block granularity (composed.hpp): --block-size b swaps the selector for TopBlocks, --block-score.
  std::optional<Index> block_size;
  std::optional<std::string> block_score;
  /// Stages swapped into the method (composed.hpp): --scorer METHOD, --merger, --compensator, --allocation.
  std::optional<std::string> scorer, merger, compensator, allocation;
  std::optional<double> alpha, lambda, beta, r_max, threshold;
  std::optional<bool> safeguard, reposition;
  double rope_theta = 10000.0;  // the model's RoPE base (repositioning, expected-attention)
  /// --rope-base (compress, Python): the keys' RoPE base where no model gives it; applies only where the
  /// keys' RoPE is read (repositioning, or a scorer that reads it, as expected-attention's).
  std::optional<double> rope_base;
  bool record_merges = false;  // fill each head's merge map (compress --explain)
};

using Compressor = std::function<LayerResult<float>(const LayerView<float>&, const Budget&)>;

inline const std::vector<std::string>& method_names() {
  static const std::vector<std::string> names = {"full",           "streaming", "snapkv", "selkv-evict", "selkv",
                                                 "selkv-mergeall", "knorm",     "tova",   "keydiff",     "adakv-snapkv",
                                                 "adakv-selkv",    "grkv",      "grkv-selkv", "grkv-streaming",
                                                 "cur",            "lagkv",     "chunkkv",     "threshold",
                                                 "expected-attention", "observed-attention", "criticalkv",
                                                 "critical-adakv"};
  return names;
}

namespace detail {

template <class A, class = void> struct has_pool : std::false_type {};
template <class A> struct has_pool<A, std::void_t<decltype(A{}.pool_kernel)>> : std::true_type {};
template <class A, class = void> struct has_block_size : std::false_type {};
template <class A> struct has_block_size<A, std::void_t<decltype(A{}.block_size)>> : std::true_type {};
template <class A, class = void> struct has_threshold : std::false_type {};
template <class A> struct has_threshold<A, std::void_t<decltype(A{}.threshold)>> : std::true_type {};
template <class A, class = void> struct has_bucket : std::false_type {};
template <class A> struct has_bucket<A, std::void_t<decltype(A{}.bucket)>> : std::true_type {};
template <class A, class = void> struct has_alpha : std::false_type {};
template <class A> struct has_alpha<A, std::void_t<decltype(A{}.alpha)>> : std::true_type {};
template <class A, class = void> struct has_ridge : std::false_type {};
template <class A> struct has_ridge<A, std::void_t<decltype(A{}.lambda_v)>> : std::true_type {};

[[noreturn]] inline void not_applicable(const std::string& option, const std::string& method) {
  throw std::invalid_argument("option --" + option + " does not apply to method '" + method + "'");
}

// One function per slot, over that slot's Arguments: sets the options that apply, rejects the others.
template <class A>
void apply_selector(A& a, const MethodOptions& o, const std::string& method) {
  if constexpr (!has_block_size<A>::value) {
    if (o.block_score) not_applicable("block-score", method);
  }
  if constexpr (has_pool<A>::value) {  // TopK, TopChunks, TopBlocks
    if (o.pool) {
      a.pool_kernel = *o.pool;
      a.pooling = *o.pool > 1 ? (a.pooling == Pooling::none ? Pooling::average : a.pooling) : Pooling::none;
    }
    if (o.pooling) {
      if (*o.pooling == "avg" || *o.pooling == "average") a.pooling = Pooling::average;
      else if (*o.pooling == "max") a.pooling = Pooling::max;
      else if (*o.pooling == "none") a.pooling = Pooling::none;
      else throw std::invalid_argument("--pooling must be avg, max or none, got '" + *o.pooling + "'");
    }
    if (o.recent) a.recent = *o.recent;
    if (o.sinks) a.sinks = *o.sinks;
    if (o.threshold) not_applicable("threshold", method);
    if constexpr (has_block_size<A>::value) {  // TopBlocks: whole blocks, one selection for every head
      if (o.block_size) a.block_size = *o.block_size;
      if (o.block_score) {
        if (*o.block_score == "mean") a.block_score = BlockScore::mean;
        else if (*o.block_score == "max") a.block_score = BlockScore::max;
        else throw std::invalid_argument("--block-score must be mean or max, got '" + *o.block_score + "'");
      }
      if (o.selection && *o.selection != "shared")
        throw std::invalid_argument("--block-size selects whole blocks for every KV head at once (a block holds every "
                                    "head): --selection must be shared");
    } else if (o.selection) {
      if (*o.selection == "shared") a.granularity = Granularity::shared;
      else if (*o.selection == "per-head" || *o.selection == "per_head") a.granularity = Granularity::per_head;
      else throw std::invalid_argument("--selection must be shared or per-head, got '" + *o.selection + "'");
    }
  } else if constexpr (has_threshold<A>::value) {
    if (o.threshold) a.threshold = *o.threshold;
    if (o.recent) a.recent = *o.recent;
    if (o.pool) not_applicable("pool", method);
    if (o.pooling) not_applicable("pooling", method);
    if (o.sinks) not_applicable("sinks", method);
    if (o.selection) not_applicable("selection", method);
  } else {
    if (o.threshold) not_applicable("threshold", method);
    if (o.pool) not_applicable("pool", method);
    if (o.pooling) not_applicable("pooling", method);
    if (o.recent) not_applicable("recent", method);
    if (o.sinks) not_applicable("sinks", method);
    if (o.selection) not_applicable("selection", method);
  }
}

template <class A>
void apply_router(A& a, const MethodOptions& o, const std::string& method) {
  if constexpr (has_bucket<A>::value) {
    if (o.bucket) a.bucket = *o.bucket;
    if (o.route) {
      if (*o.route == "key-cosine" || *o.route == "key_cosine") a.statistic = RouteStatistic::key_cosine;
      else if (*o.route == "window-mass" || *o.route == "window_mass") a.statistic = RouteStatistic::window_mass;
      else if (*o.route == "co-attention" || *o.route == "co_attention") a.statistic = RouteStatistic::co_attention;
      else if (*o.route == "global") a.bucket = 0;
      else throw std::invalid_argument("--route must be key-cosine, window-mass, co-attention or global, got '" + *o.route + "'");
    }
  } else {
    if (o.bucket) not_applicable("bucket", method);
    if (o.route) not_applicable("route", method);
  }
}

template <class A>
void apply_compensator(A& a, const MethodOptions& o, const std::string& method) {
  if constexpr (has_alpha<A>::value) {
    if (o.alpha) a.alpha = *o.alpha;
    if (o.r_max) a.r_max = *o.r_max;
  } else {
    if (o.alpha) not_applicable("alpha", method);
    if (o.r_max) not_applicable("r-max", method);
  }
}

template <class A>
void apply_merger(A& a, const MethodOptions& o, const std::string& method) {
  if constexpr (has_ridge<A>::value) {
    using Mode = RidgeMerge::Arguments::LambdaMode;
    if (o.lambda) {  // the papers' fixed λ, unless --lambda-mode says otherwise
      a.lambda_v = a.lambda_k = *o.lambda;
      a.lambda_mode = Mode::fixed;
    }
    if (o.lambda_mode) {
      if (*o.lambda_mode == "fixed") a.lambda_mode = Mode::fixed;
      else if (*o.lambda_mode == "holdout") a.lambda_mode = Mode::holdout;
      else throw std::invalid_argument("--lambda-mode must be fixed or holdout, got '" + *o.lambda_mode + "'");
    }
    if (o.holdout_every) a.holdout_every = *o.holdout_every;
    if (o.beta) a.beta = *o.beta;
    if (o.steps) a.steps = *o.steps;
    if (o.safeguard) a.safeguard = *o.safeguard;
  } else {
    if (o.lambda) not_applicable("lambda", method);
    if (o.lambda_mode) not_applicable("lambda-mode", method);
    if (o.holdout_every) not_applicable("holdout-every", method);
    if (o.beta) not_applicable("beta", method);
    if (o.steps) not_applicable("steps", method);
    if (o.safeguard) not_applicable("safeguard", method);
  }
}

template <class Args>
void apply_reposition(Args& a, const MethodOptions& o) {
  a.reposition.theta = o.rope_base.value_or(o.rope_theta);  // the keys' RoPE, also read by expected-attention's scorer
  if (o.reposition && *o.reposition) a.reposition.enabled = true;
}

template <class Args>
void apply(Args& a, const MethodOptions& o, const std::string& method) {
  apply_selector(a.selector, o, method);
  apply_router(a.router, o, method);
  apply_compensator(a.compensator, o, method);
  apply_merger(a.merger, o, method);
  apply_reposition(a, o);
}

}  // namespace detail

/// The preset type a method name stands for, passed to visit_method's function.
template <class Preset>
struct PresetTag {
  using type = Preset;
};

/// The method table, written once: returns f(PresetTag<Preset>{}) for the preset named `name`;
/// throws std::invalid_argument for an unknown name. Instantiated in runner_float.cpp and
/// runner_half.cpp (runner.hpp) for the tool, the tests and the Python module.
template <class F>
auto visit_method(const std::string& name, F&& f) {
  if (name == "full") return f(PresetTag<FullCache>{});
  if (name == "streaming") return f(PresetTag<StreamingLLM>{});
  if (name == "snapkv") return f(PresetTag<SnapKV>{});
  if (name == "selkv-evict") return f(PresetTag<SelKVEvict>{});
  if (name == "selkv") return f(PresetTag<SelKV>{});
  if (name == "selkv-mergeall") return f(PresetTag<SelKVMergeAll>{});
  if (name == "knorm") return f(PresetTag<KNorm>{});
  if (name == "tova") return f(PresetTag<TOVA>{});
  if (name == "keydiff") return f(PresetTag<KeyDiff>{});
  if (name == "cur") return f(PresetTag<CUR>{});
  if (name == "lagkv") return f(PresetTag<LagKV>{});
  if (name == "chunkkv") return f(PresetTag<ChunkKV>{});
  if (name == "threshold") return f(PresetTag<Threshold>{});
  if (name == "expected-attention") return f(PresetTag<ExpectedAttentionEvict>{});
  if (name == "observed-attention") return f(PresetTag<H2O>{});
  if (name == "criticalkv") return f(PresetTag<CriticalKV>{});
  if (name == "critical-adakv") return f(PresetTag<CriticalAdaKV>{});
  if (name == "adakv-snapkv") return f(PresetTag<AdaKVSnapKV>{});
  if (name == "adakv-selkv") return f(PresetTag<AdaKVSelKV>{});
  if (name == "grkv") return f(PresetTag<SnapKVGRKV>{});
  if (name == "grkv-selkv") return f(PresetTag<SelKVEvictGRKV>{});
  if (name == "grkv-streaming") return f(PresetTag<StreamingLLMGRKV>{});
  std::string known;
  for (const auto& n : method_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown method '" + name + "' (known: " + known + ")");
}

/// The preset's Arguments for a method with the given options (unset ones keep the preset's
/// defaults); throws std::invalid_argument for an option that does not apply to the method.
template <class Preset>
typename Preset::Arguments method_arguments(const MethodOptions& o, const std::string& method) {
  typename Preset::Arguments args;
  detail::apply(args, o, method);
  return args;
}

/// Rejects --rope-base for a method that reads no RoPE (neither repositions nor scores with it).
template <class Preset>
void check_rope_base(const typename Preset::Arguments& a, const MethodOptions& o, const std::string& method) {
  if (o.rope_base && !a.reposition.enabled &&
      !kvc::detail::scorer_reads_rope(typename Preset::scorer_type{a.scorer}))
    detail::not_applicable("rope-base", method);
}

/// The compressor for a method name; throws std::invalid_argument naming the problem for an
/// unknown method or an option that does not apply to it. Defined in methods.cpp, so that the presets
/// are compiled once (target kvc_cli_methods).
Compressor make_method(const std::string& name, const MethodOptions& o = {});

}  // namespace kvc::cli
