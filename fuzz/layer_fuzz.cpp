// libFuzzer target: every preset of include/kvcompress/presets.hpp on a small layer built from the
// input: Hkv, Hq = G·Hkv, n, d, W, the layout and padding of K, V and Q (padding is filled with NaN,
// so a read outside the view shows), float or half elements, finite values over a wide range of
// magnitudes, the budget, and every stage's options (in range or not). A call may fail with
// kvc::error; anything else is a finding and traps: a crash, a sanitizer report, another exception,
// or a result (or a compact_into / compact_bias_into output) that is not finite from finite input.
#include <kvcompress/kvcompress.hpp>
#include "presets_compiled.hpp"  // the presets compiled once (kvc_cli_methods)

#include <fuzzer/FuzzedDataProvider.h>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace {

using kvc::Index;

/// KVC_FUZZ_VERBOSE=1 prints each case (to reproduce a finding as a plain test).
const bool verbose = std::getenv("KVC_FUZZ_VERBOSE") != nullptr;
/// KVC_FUZZ_CHECKED_ONLY=1 runs every preset with check_finite on (triage: the default also fuzzes
/// check_finite = false, and demands a finite result from finite input there too).
const bool checked_only = std::getenv("KVC_FUZZ_CHECKED_ONLY") != nullptr;

[[noreturn]] void finding(const char* preset, const char* what) {
  std::fprintf(stderr, "layer_fuzz: %s: %s\n", preset, what);
  __builtin_trap();
}

/// With KVC_FUZZ_VERBOSE, the result of a head (positions, keys, values, bias) before a finding.
template <class H>
void dump_head(const H& h) {
  for (Index i = 0; i < h.size(); ++i) {
    std::fprintf(stderr, "    kept %lld: key", static_cast<long long>(h.positions[static_cast<std::size_t>(i)]));
    for (Index c = 0; c < h.keys.cols(); ++c) std::fprintf(stderr, " %g", static_cast<double>(h.keys(i, c)));
    std::fprintf(stderr, " value");
    for (Index c = 0; c < h.values.cols(); ++c) std::fprintf(stderr, " %g", static_cast<double>(h.values(i, c)));
    std::fprintf(stderr, " bias %g\n", static_cast<double>(h.bias[i]));
  }
}

template <class A, class = void> struct has_threshold_select_args : std::false_type {};
template <class A> struct has_threshold_select_args<A, std::void_t<decltype(A{}.selector.threshold)>> : std::true_type {};
template <class A, class = void> struct has_one_of_slots : std::false_type {};
template <class A> struct has_one_of_slots<A, std::void_t<decltype(A{}.scorer.policy.index())>> : std::true_type {};

/// The alternative `i` of variant V, default-constructed.
template <class V, std::size_t... I>
V variant_at(std::size_t i, std::index_sequence<I...>) {
  V v;
  ((i == I ? (v = V(std::in_place_index<I>), 0) : 0), ...);
  return v;
}
template <class V>
void choose(V& v, FuzzedDataProvider& p) {
  constexpr std::size_t size = std::variant_size_v<V>;
  v = variant_at<V>(p.ConsumeIntegralInRange<std::size_t>(0, size - 1), std::make_index_sequence<size>{});
}

template <class A, class = void> struct has_selector_args : std::false_type {};
template <class A> struct has_selector_args<A, std::void_t<decltype(A{}.selector.pool_kernel)>> : std::true_type {};
template <class A, class = void> struct has_router_args : std::false_type {};
template <class A> struct has_router_args<A, std::void_t<decltype(A{}.router.bucket)>> : std::true_type {};
template <class A, class = void> struct has_compensator_args : std::false_type {};
template <class A> struct has_compensator_args<A, std::void_t<decltype(A{}.compensator.alpha)>> : std::true_type {};
template <class A, class = void> struct has_ridge_args : std::false_type {};
template <class A> struct has_ridge_args<A, std::void_t<decltype(A{}.merger.lambda_v)>> : std::true_type {};
template <class A, class = void> struct has_chunk_args : std::false_type {};
template <class A> struct has_chunk_args<A, std::void_t<decltype(A{}.selector.chunk)>> : std::true_type {};
template <class A, class = void> struct has_window_scorer_args : std::false_type {};
template <class A> struct has_window_scorer_args<A, std::void_t<decltype(A{}.scorer.window)>> : std::true_type {};
template <class A, class = void> struct has_lag_args : std::false_type {};
template <class A> struct has_lag_args<A, std::void_t<decltype(A{}.scorer.lag)>> : std::true_type {};
template <class A, class = void> struct has_threshold_args : std::false_type {};
template <class A> struct has_threshold_args<A, std::void_t<decltype(A{}.merger.threshold)>> : std::true_type {};
template <class A, class = void> struct has_merge_window_args : std::false_type {};
template <class A> struct has_merge_window_args<A, std::void_t<decltype(A{}.merger.window)>> : std::true_type {};
template <class A, class = void> struct has_future_args : std::false_type {};
template <class A> struct has_future_args<A, std::void_t<decltype(A{}.scorer.future_positions)>> : std::true_type {};
template <class A, class = void> struct has_block_args : std::false_type {};
template <class A> struct has_block_args<A, std::void_t<decltype(A{}.scorer.block)>> : std::true_type {};
template <class A, class = void> struct has_floor_args : std::false_type {};
template <class A> struct has_floor_args<A, std::void_t<decltype(A{}.allocator.floor)>> : std::true_type {};

/// A double from a short menu: mostly ordinary values, sometimes edge ones (0, negative, huge, tiny).
double pick(FuzzedDataProvider& p, std::initializer_list<double> menu) {
  const std::size_t k = p.ConsumeIntegralInRange<std::size_t>(0, menu.size() - 1);
  return *(menu.begin() + k);
}

/// A size or count in [lo, hi], or 1 in 16 an extreme value that validation must reject or handle:
/// -1 and, with `huge`, INT64_MAX (not for iteration counts: 2^63 ridge steps or CG iterations are
/// valid options that run for ever, not a finding).
Index pick_index(FuzzedDataProvider& p, Index lo, Index hi, bool huge = true) {
  switch (p.ConsumeIntegralInRange<int>(0, 15)) {
    case 0: return -1;
    case 1: return huge ? std::numeric_limits<Index>::max() : hi + 1;
    default: return p.ConsumeIntegralInRange<Index>(lo, hi);
  }
}

/// Every option of a preset's Arguments from the input (when the input asks for options at all).
template <class Args>
void configure(Args& a, FuzzedDataProvider& p, Index n, Index d) {
  if constexpr (has_one_of_slots<Args>::value) {  // stages chosen at run time (the tool's --scorer, --merger, ...)
    choose(a.scorer.policy, p);
    choose(a.selector.policy, p);
    choose(a.router.policy, p);
    choose(a.merger.policy, p);
    choose(a.compensator.policy, p);
    choose(a.allocator.policy, p);
  }
  if (!p.ConsumeBool()) return;  // the preset's defaults
  a.attention.scale = pick(p, {0.0, 0.0, 1.0, 0.125, 1e-30, 1e30, -1.0});
  a.attention.softcap = pick(p, {0.0, 0.0, 30.0, 1.0, 1e-30, -1.0});
  if constexpr (has_selector_args<Args>::value) {
    a.selector.sinks = pick_index(p, 0, 6);
    a.selector.recent = pick_index(p, 0, n + 2);
    a.selector.pool_kernel = pick_index(p, 0, 9);
    a.selector.pooling = static_cast<kvc::Pooling>(p.ConsumeIntegralInRange<int>(0, 2));
    a.selector.granularity = static_cast<kvc::Granularity>(p.ConsumeIntegralInRange<int>(0, 1));
  }
  if constexpr (has_chunk_args<Args>::value) a.selector.chunk = pick_index(p, 0, n + 3);
  if constexpr (has_threshold_select_args<Args>::value) {  // Threshold
    a.selector.threshold = pick(p, {0.02, 0.0, -1.0, 1e300, 0.5, std::numeric_limits<double>::quiet_NaN()});
    a.selector.recent = pick_index(p, 0, n + 2);
  }
  if constexpr (has_window_scorer_args<Args>::value) {  // CUR
    a.scorer.sinks = pick_index(p, 0, n + 2);
    a.scorer.window = pick_index(p, 0, n + 3);
  }
  if constexpr (has_lag_args<Args>::value) {  // LagKV
    a.scorer.sinks = pick_index(p, 0, n + 2);
    a.scorer.lag = pick_index(p, 0, n + 3);
    a.scorer.rank = p.ConsumeBool();
  }
  if constexpr (has_future_args<Args>::value) {  // Expected Attention
    a.scorer.future_positions = pick_index(p, 0, 600);
    a.scorer.sinks = pick_index(p, 0, n + 2);
    a.scorer.covariance = p.ConsumeBool();
    a.scorer.value_norm = p.ConsumeBool();
    a.scorer.epsilon = pick(p, {0.0, 0.0, 1e-3, 1.0, -1.0, 1e300});
  }
  if constexpr (has_block_args<Args>::value) a.scorer.block = pick_index(p, 0, n + 3);  // H2O
  if constexpr (has_router_args<Args>::value) {
    a.router.bucket = pick_index(p, 0, n + 4);
    a.router.statistic = static_cast<kvc::RouteStatistic>(p.ConsumeIntegralInRange<int>(0, 2));
  }
  if constexpr (has_compensator_args<Args>::value) {
    a.compensator.alpha = pick(p, {0.5, 0.0, 1.0, -0.5, 4.0, 1e300});
    a.compensator.r_max = pick(p, {0.0, 0.0, 1.0, 4.0, 0.5, 1e300});
  }
  if constexpr (has_ridge_args<Args>::value) {
    a.merger.lambda_v = pick(p, {1e-2, 1e-6, 1.0, 1e3, 0.0, -1.0});
    a.merger.lambda_k = pick(p, {1e-2, 1e-6, 1.0, 1e3, 0.0});
    a.merger.beta = pick(p, {0.1, 0.0, 0.5, 1.0, 1.5});
    a.merger.sinks = pick_index(p, 0, 6);
    a.merger.steps = pick_index(p, 0, 3, false);
    a.merger.order = p.ConsumeBool() ? decltype(a.merger.order)::value_then_key : decltype(a.merger.order)::key_then_value;
    a.merger.value_step = p.ConsumeBool();
    a.merger.key_step = p.ConsumeBool();
    a.merger.cg_tolerance = pick(p, {1e-6, 1e-12, 1e-2, 0.0});
    a.merger.cg_max_iterations = pick_index(p, 0, 100, false);
    a.merger.safeguard = p.ConsumeBool();
    a.merger.lambda_mode = static_cast<decltype(a.merger.lambda_mode)>(p.ConsumeIntegralInRange<int>(0, 2));
    a.merger.lambda_grid[0] = pick(p, {1e-3, 1e-12, 1e3, 0.0, std::numeric_limits<double>::quiet_NaN()});
    a.merger.holdout_every = pick_index(p, 0, 40);
  }
  if constexpr (has_threshold_args<Args>::value)  // NearestKeyMerge
    a.merger.threshold = pick(p, {0.0, 0.5, 1.0, -0.1, 1.5, std::numeric_limits<double>::quiet_NaN()});
  if constexpr (has_merge_window_args<Args>::value) a.merger.window = pick_index(p, 0, n + 2);  // CacheMerge
  if constexpr (has_floor_args<Args>::value) a.allocator.floor = pick(p, {0.2, 0.0, 1.0, 0.5, -0.1, 1.5});
  if (p.ConsumeBool()) {
    a.reposition.enabled = true;
    a.reposition.layout = static_cast<kvc::RopeLayout>(p.ConsumeIntegralInRange<int>(0, 1));
    a.reposition.theta = pick(p, {10000.0, 500000.0, 1.0, 0.0});
    a.reposition.rotary_dim = p.ConsumeBool() ? 0 : p.ConsumeIntegralInRange<Index>(0, d + 1);
  }
  a.check_finite = p.ConsumeIntegralInRange<int>(0, 3) != 0 || checked_only;
  a.threads = p.ConsumeIntegralInRange<int>(0, 7) == 0 ? 2 : 1;
  if (!verbose) return;
  std::fprintf(stderr, "    options: scale %g softcap %g check_finite %d threads %lld", a.attention.scale,
               a.attention.softcap, int(a.check_finite), static_cast<long long>(a.threads));
  if constexpr (has_selector_args<Args>::value)
    std::fprintf(stderr, "; selector sinks %lld recent %lld pool %lld pooling %d granularity %d",
                 static_cast<long long>(a.selector.sinks), static_cast<long long>(a.selector.recent),
                 static_cast<long long>(a.selector.pool_kernel), int(a.selector.pooling), int(a.selector.granularity));
  if constexpr (has_router_args<Args>::value)
    std::fprintf(stderr, "; router bucket %lld statistic %d", static_cast<long long>(a.router.bucket), int(a.router.statistic));
  if constexpr (has_compensator_args<Args>::value)
    std::fprintf(stderr, "; compensator alpha %g r_max %g", a.compensator.alpha, a.compensator.r_max);
  if constexpr (has_ridge_args<Args>::value)
    std::fprintf(stderr, "; ridge lambda_v %g lambda_k %g beta %g sinks %lld steps %lld order %d value_step %d "
                 "key_step %d cg_tolerance %g cg_max_iterations %lld safeguard %d lambda_mode %d lambda_grid[0] %g "
                 "holdout_every %lld",
                 a.merger.lambda_v, a.merger.lambda_k, a.merger.beta, static_cast<long long>(a.merger.sinks),
                 static_cast<long long>(a.merger.steps), int(a.merger.order), int(a.merger.value_step),
                 int(a.merger.key_step), a.merger.cg_tolerance, static_cast<long long>(a.merger.cg_max_iterations),
                 int(a.merger.safeguard), int(a.merger.lambda_mode), a.merger.lambda_grid[0],
                 static_cast<long long>(a.merger.holdout_every));
  if constexpr (has_threshold_args<Args>::value) std::fprintf(stderr, "; merger threshold %g", a.merger.threshold);
  if constexpr (has_merge_window_args<Args>::value)
    std::fprintf(stderr, "; merger window %lld", static_cast<long long>(a.merger.window));
  if (a.reposition.enabled)
    std::fprintf(stderr, "; reposition layout %d theta %g rotary_dim %lld", int(a.reposition.layout),
                 a.reposition.theta, static_cast<long long>(a.reposition.rotary_dim));
  std::fprintf(stderr, "\n");
}

/// Storage and view of one tensor [heads][tokens][dim], head-major or token-major, with padding
/// between rows and between heads (filled with NaN).
template <class T>
struct Tensor {
  std::vector<T> buf;
  kvc::TensorView<const T> view;
};

template <class T>
Tensor<T> make_tensor(FuzzedDataProvider& p, Index heads, Index tokens, Index dim, double max_abs) {
  Tensor<T> t;
  const bool token_major = p.ConsumeBool();
  const Index pad_row = p.ConsumeIntegralInRange<Index>(0, 2), pad_head = p.ConsumeIntegralInRange<Index>(0, 3);
  Index head_stride, token_stride;
  if (token_major) {
    head_stride = dim + pad_row;
    token_stride = heads * head_stride + pad_head;
  } else {
    token_stride = dim + pad_row;
    head_stride = tokens * token_stride + pad_head;
  }
  const Index extent = (heads - 1) * head_stride + (tokens - 1) * token_stride + dim;
  t.buf.assign(static_cast<std::size_t>(extent), T(std::numeric_limits<float>::quiet_NaN()));
  // Magnitude: 10^e, e in [-38, log10(max_abs)], mostly near 1.
  const int e_max = static_cast<int>(std::floor(std::log10(max_abs)));
  int e = 0;
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: e = p.ConsumeIntegralInRange<int>(-38, e_max); break;
    case 1: e = p.ConsumeIntegralInRange<int>(-3, 3); break;
    default: break;
  }
  const double scale = std::pow(10.0, e);
  std::uint32_t s = p.ConsumeIntegral<std::uint32_t>() | 1u;  // xorshift32 fills the rest
  const bool constant_rows = p.ConsumeIntegralInRange<int>(0, 7) == 0;  // duplicate rows (ties, singular systems)
  for (Index h = 0; h < heads; ++h)
    for (Index j = 0; j < tokens; ++j)
      for (Index c = 0; c < dim; ++c) {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        double x = (static_cast<double>(s % 2001) - 1000.0) / 1000.0;
        if (constant_rows) x = (c % 2 == 0) ? 0.5 : -0.25;
        double v = x * scale;
        if (std::fabs(v) > max_abs) v = std::copysign(max_abs, v);
        t.buf[static_cast<std::size_t>(h * head_stride + j * token_stride + c)] = T(static_cast<float>(v));
      }
  // A few elements set by the input directly (zeros, the largest finite value, subnormals).
  const int edits = p.ConsumeIntegralInRange<int>(0, 4);
  for (int k = 0; k < edits; ++k) {
    const Index h = p.ConsumeIntegralInRange<Index>(0, heads - 1), j = p.ConsumeIntegralInRange<Index>(0, tokens - 1),
                c = p.ConsumeIntegralInRange<Index>(0, dim - 1);
    const double v = pick(p, {0.0, -0.0, max_abs, -max_abs, 1e-40, 1.0, -1.0});
    t.buf[static_cast<std::size_t>(h * head_stride + j * token_stride + c)] = T(static_cast<float>(v));
    if (verbose)
      std::fprintf(stderr, "  edit [%lld][%lld][%lld] = %g\n", static_cast<long long>(h), static_cast<long long>(j),
                   static_cast<long long>(c), v);
  }
  t.view = {t.buf.data(), heads, tokens, dim, head_stride, token_stride};
  if (verbose)
    std::fprintf(stderr, "  tensor [%lld][%lld][%lld] strides head %lld token %lld, scale 1e%d%s, %d edits\n",
                 static_cast<long long>(heads), static_cast<long long>(tokens), static_cast<long long>(dim),
                 static_cast<long long>(head_stride), static_cast<long long>(token_stride), e,
                 constant_rows ? ", constant rows" : "", edits);
  if (verbose)
    for (Index h = 0; h < heads; ++h)
      for (Index j = 0; j < tokens; ++j) {
        std::fprintf(stderr, "    [%lld][%lld]", static_cast<long long>(h), static_cast<long long>(j));
        for (Index c = 0; c < dim; ++c)
          std::fprintf(stderr, " %.9g", static_cast<double>(static_cast<float>(t.buf[static_cast<std::size_t>(h * head_stride + j * token_stride + c)])));
        std::fprintf(stderr, "\n");
      }
  return t;
}

template <class Real>
bool all_finite(const Real* x, Index count) {
  for (Index i = 0; i < count; ++i)
    if (!std::isfinite(static_cast<float>(x[i]))) return false;
  return true;
}

template <class Preset, class T>
void run_preset(const char* name, const kvc::LayerView<T>& layer, const kvc::Budget& budget, FuzzedDataProvider& p) {
  typename Preset::Arguments args;
  configure(args, p, layer.tokens(), layer.head_dim());
  if (verbose) std::fprintf(stderr, "  %s\n", name);
  const Preset preset(args);
  using Real = kvc::compute_t<T>;
  kvc::LayerResult<Real> r;
  try {
    r = preset.run(layer, budget);
  } catch (const kvc::error&) {
    return;  // rejected: allowed
  }
  const Index H = layer.kv_heads(), n = layer.tokens(), d = layer.head_dim();
  if (static_cast<Index>(r.heads.size()) != H) finding(name, "result has the wrong number of heads");
  for (const auto& h : r.heads) {
    const Index m = h.size();
    if (verbose) dump_head(h);
    if (m < 1 || m > n) finding(name, "a head keeps no entry or more than n");
    if (h.keys.rows() != m || h.values.rows() != m || h.keys.cols() != d || h.values.cols() != d || h.bias.size() != m)
      finding(name, "result sizes disagree");
    for (Index i = 0; i < m; ++i) {
      if (h.positions[static_cast<std::size_t>(i)] < 0 || h.positions[static_cast<std::size_t>(i)] >= n)
        finding(name, "kept position outside [0, n)");
      if (i > 0 && h.positions[static_cast<std::size_t>(i)] <= h.positions[static_cast<std::size_t>(i - 1)])
        finding(name, "kept positions not ascending");
    }
    if (!all_finite(h.keys.data(), m * d)) finding(name, "non-finite kept key from finite input");
    if (!all_finite(h.values.data(), m * d)) finding(name, "non-finite kept value from finite input");
    if (!all_finite(h.bias.data(), m)) finding(name, "non-finite bias from finite input");
  }
  // Written back into a cache of the input's type: finite values or kvc::error, nothing else.
  const Index m = r.max_size();
  std::vector<T> keys(static_cast<std::size_t>(H * m * d)), values(keys.size());
  std::vector<float> bias(static_cast<std::size_t>(H * m));
  try {
    kvc::compact_into(r, kvc::TensorView<T>::head_major(keys.data(), H, m, d),
                      kvc::TensorView<T>::head_major(values.data(), H, m, d));
    kvc::compact_bias_into(r, bias.data(), m, m);
  } catch (const kvc::error&) {
    return;
  }
  Index g = 0;
  for (const auto& h : r.heads) {
    if (!all_finite(keys.data() + g * m * d, h.size() * d) || !all_finite(values.data() + g * m * d, h.size() * d))
      finding(name, "compact_into wrote a non-finite value into the cache");
    if (!all_finite(bias.data() + g * m, h.size())) finding(name, "compact_bias_into wrote a non-finite bias");
    ++g;
  }
}

template <class T>
void run_all(FuzzedDataProvider& p) {
  const Index Hkv = p.ConsumeIntegralInRange<Index>(1, 3), G = p.ConsumeIntegralInRange<Index>(1, 3);
  const Index n = p.ConsumeIntegralInRange<Index>(1, 48), d = p.ConsumeIntegralInRange<Index>(1, 16),
              W = p.ConsumeIntegralInRange<Index>(1, 12);
  // Largest magnitude: below FLT_MAX for float, below the half maximum (65504) for half.
  const double max_abs = std::is_same_v<T, float> ? 3.0e38 : 65000.0;
  const Tensor<T> K = make_tensor<T>(p, Hkv, n, d, max_abs);
  const Tensor<T> V = make_tensor<T>(p, Hkv, n, d, max_abs);
  const Tensor<T> Q = make_tensor<T>(p, Hkv * G, W, d, max_abs);
  const kvc::LayerView<T> layer{K.view, V.view, Q.view};
  kvc::Budget budget = kvc::Budget::ratio(0.5);
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: budget = kvc::Budget::ratio(pick(p, {0.1, 0.25, 0.5, 1.0, 1e-9, 0.0, 1.5})); break;
    case 1: budget = kvc::Budget::tokens(pick_index(p, 1, n + 2)); break;
    default: budget = kvc::Budget::ratio(p.ConsumeFloatingPointInRange<double>(0.01, 1.0)); break;
  }
  if (verbose)
    std::fprintf(stderr, "layer %s Hkv %lld Hq %lld n %lld d %lld W %lld, budget %s %g\n",
                 std::is_same_v<T, float> ? "float" : "half", static_cast<long long>(Hkv), static_cast<long long>(Hkv * G),
                 static_cast<long long>(n), static_cast<long long>(d), static_cast<long long>(W),
                 budget.is_ratio() ? "ratio" : "tokens", budget.is_ratio() ? budget.rho() : double(budget.absolute()));
  run_preset<kvc::FullCache>("FullCache", layer, budget, p);
  run_preset<kvc::StreamingLLM>("StreamingLLM", layer, budget, p);
  run_preset<kvc::SnapKV>("SnapKV", layer, budget, p);
  run_preset<kvc::SelKVEvict>("SelKVEvict", layer, budget, p);
  run_preset<kvc::SelKV>("SelKV", layer, budget, p);
  run_preset<kvc::SelKVMergeAll>("SelKVMergeAll", layer, budget, p);
  run_preset<kvc::KNorm>("KNorm", layer, budget, p);
  run_preset<kvc::TOVA>("TOVA", layer, budget, p);
  run_preset<kvc::KeyDiff>("KeyDiff", layer, budget, p);
  run_preset<kvc::AdaKVSnapKV>("AdaKVSnapKV", layer, budget, p);
  run_preset<kvc::AdaKVSelKV>("AdaKVSelKV", layer, budget, p);
  run_preset<kvc::SnapKVGRKV>("SnapKVGRKV", layer, budget, p);
  run_preset<kvc::SelKVEvictGRKV>("SelKVEvictGRKV", layer, budget, p);
  run_preset<kvc::StreamingLLMGRKV>("StreamingLLMGRKV", layer, budget, p);
  run_preset<kvc::CUR>("CUR", layer, budget, p);
  run_preset<kvc::LagKV>("LagKV", layer, budget, p);
  run_preset<kvc::ChunkKV>("ChunkKV", layer, budget, p);
  run_preset<kvc::Threshold>("Threshold", layer, budget, p);
  run_preset<kvc::cli::Composed>("Composed", layer, budget, p);
  run_preset<kvc::SnapKVNearestKey>("SnapKVNearestKey", layer, budget, p);
  run_preset<kvc::SnapKVCAM>("SnapKVCAM", layer, budget, p);
  run_preset<kvc::ExpectedAttentionEvict>("ExpectedAttentionEvict", layer, budget, p);
  run_preset<kvc::H2O>("H2O", layer, budget, p);  // a window of W < n queries: rejected
  // H2O with a query for every entry (read last, so that the inputs above are read as before).
  const Tensor<T> all_queries = make_tensor<T>(p, Hkv * G, n, d, max_abs);
  run_preset<kvc::H2O>("H2O (every query)", kvc::LayerView<T>{K.view, V.view, all_queries.view}, budget, p);
  // CriticalKV with a float W_o [D][Hq·d] (its rows strided as a tensor's tokens), then Composed with it.
  const Index D = p.ConsumeIntegralInRange<Index>(1, 9);
  const Tensor<float> wo = make_tensor<float>(p, 1, D, Hkv * G * d, 3.0e38);
  kvc::LayerView<T> projected = layer;
  projected.output_projection = {wo.view.data, D, Hkv * G * d, wo.view.token_stride};
  run_preset<kvc::CriticalKV>("CriticalKV", projected, budget, p);
  run_preset<kvc::CriticalAdaKV>("CriticalAdaKV", projected, budget, p);
  run_preset<kvc::cli::Composed>("Composed (W_o)", projected, budget, p);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider p(data, size);
  if (p.ConsumeIntegralInRange<int>(0, 3) == 0) run_all<Eigen::half>(p);
  else run_all<float>(p);
  return 0;
}
