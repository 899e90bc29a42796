// Model-level compression: every layer of a sequence's cache in one call, with a budget schedule across
// layers (uniform or PyramidKV's).
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/parallel.hpp"
#include "kvcompress/result.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kvc {

/// How a model's budget is shared out across its layers.
enum class LayerSchedule {
  uniform,  ///< every layer keeps m
  pyramid,  ///< PyramidKV: linearly decreasing from the first layer to the last, L·m in all
};

struct LayerScheduleArguments {
  LayerSchedule schedule = LayerSchedule::uniform;
  Index window = 64;  ///< pyramid: the observation window w of the rule below
  double beta = 20;   ///< pyramid: the ratio of the largest to the smallest share above w, >= 1

  Status validate() const {
    if (window < 0)
      return Status::fail(Status::Code::invalid_argument, detail::concat("schedule window must be >= 0, got ", window));
    if (!(beta >= 1.0) || !std::isfinite(beta))
      return Status::fail(Status::Code::invalid_argument, detail::concat("schedule beta must be >= 1, got ", beta));
    return Status::ok();
  }
};

/// Per-layer budgets for `layers` layers of n tokens whose average budget is m (1 <= m).
///
/// uniform: m for every layer. pyramid (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on
/// Pyramidal Information Funneling", 2024, with kvpress's PyramidKVPress rule): with m' = min(m, n),
///   lo = m'/β,  hi = 2m' − lo;  if hi ≥ n − w: hi = n − w, lo = 2m' − hi;
///   m_l = hi − l·(hi − lo)/(L − 1)                                          (l = 0 … L − 1)
/// and every layer keeps m' (SnapKV's uniform budget) unless n ≥ hi ≥ lo ≥ max(w, 1) and L ≥ 2. The m_l are
/// rounded so that they sum to exactly L·m' (largest remainders, ties to the earlier layer), where
/// kvpress rounds each layer on its own; each is in [1, n]. Throws kvc::error for bad arguments.
inline std::vector<Index> layer_budgets(const LayerScheduleArguments& args, Index layers, Index n, Index m) {
  args.validate().throw_if_error();
  if (layers < 1) throw error(detail::concat("layer_budgets needs at least one layer, got ", layers));
  if (n < 1 || m < 1) throw error(detail::concat("layer_budgets needs n >= 1 and m >= 1, got n = ", n, ", m = ", m));
  const Index kept = std::min(m, n);
  std::vector<Index> out(static_cast<std::size_t>(layers), kept);
  if (args.schedule == LayerSchedule::uniform || layers < 2) return out;
  const double mm = static_cast<double>(kept), w = static_cast<double>(args.window), nn = static_cast<double>(n);
  double lo = mm / args.beta, hi = 2.0 * mm - lo;
  if (hi >= nn - w) {
    hi = nn - w;
    lo = 2.0 * mm - hi;
  }
  if (!(nn >= hi && hi >= lo && lo >= std::max(w, 1.0))) return out;
  const double step = (hi - lo) / static_cast<double>(layers - 1);
  std::vector<double> exact(out.size());
  Index total = 0;
  for (std::size_t l = 0; l < out.size(); ++l) {
    exact[l] = hi - static_cast<double>(l) * step;
    out[l] = static_cast<Index>(std::floor(exact[l]));
    total += out[l];
  }
  // Largest remainders get the entries the floors left over (at most L − 1 of them).
  std::vector<std::size_t> order(out.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return exact[a] - std::floor(exact[a]) > exact[b] - std::floor(exact[b]);
  });
  for (std::size_t i = 0; total < layers * kept && i < order.size(); ++i, ++total) ++out[order[i]];
  return out;
}

/// Compresses every layer of one sequence's cache: layer l with budget layer_budgets(schedule, L, n, m_l)
/// where m = budget.resolve(n) (n = layers[0].tokens(); every layer must have the same n). Each layer
/// runs pipeline.run (its own Arguments: allocator, threads over KV heads); `layer_threads` layers run
/// at once. A bad layer throws kvc::error prefixed with its index ("layer 3: ..."); results are in new
/// memory, one per layer, so a failed call leaves nothing behind.
template <class Pipeline, class T>
std::vector<LayerResult<compute_t<T>>> compress_layers(const Pipeline& pipeline, const std::vector<LayerView<T>>& layers,
                                                       const Budget& budget,
                                                       const LayerScheduleArguments& schedule = {},
                                                       Index layer_threads = 1) {
  budget.validate().throw_if_error();
  schedule.validate().throw_if_error();
  if (layers.empty()) return {};
  const Index n = layers[0].tokens();
  const Index m = budget.resolve(n);
  if (m < 1)
    throw error(detail::concat("budget resolves to ", m, " tokens for a cache of ", n, ": it must keep at least one"));
  const std::vector<Index> budgets = layer_budgets(schedule, static_cast<Index>(layers.size()), n, m);
  for (std::size_t l = 0; l < layers.size(); ++l)
    if (layers[l].tokens() != n)
      throw error(detail::concat("layer ", l, " holds ", layers[l].tokens(), " tokens, layer 0 holds ", n,
                                 ": every layer of a sequence has the same length"));
  std::vector<LayerResult<compute_t<T>>> out(layers.size());
  parallel_for(static_cast<Index>(layers.size()), layer_threads, [&](Index l, Index) {
    const auto i = static_cast<std::size_t>(l);
    try {  // run validates the layer (and folds its NaN scans into its own passes over K and V)
      out[i] = pipeline.run(layers[i], Budget::tokens(budgets[i]));
    } catch (const error& e) {
      throw error(detail::concat("layer ", l, ": ", e.what()));
    }
  });
  return out;
}

}  // namespace kvc
