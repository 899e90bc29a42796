// Connects the example engine's compression hook to the library: an engine layer becomes a zero-copy
// kvc::LayerView, the library's LayerResult becomes the engine's CompressedLayer.
#pragma once

#include "engine/llama2.hpp"
#include "methods.hpp"

#include <stdexcept>

namespace kvc::cli {

/// Zero-copy view of one engine layer: keys/values [Hkv][capacity][d] (first n rows used),
/// queries [Hq][W][d].
inline LayerView<float> view_of(const engine::LayerInput& in) {
  LayerView<float> layer;
  layer.keys = {in.keys, in.Hkv, in.n, in.d, in.head_stride, in.d};
  layer.values = {in.values, in.Hkv, in.n, in.d, in.head_stride, in.d};
  layer.queries = make_head_major<const float>(in.queries, in.Hq, in.W, in.d);
  return layer;
}

/// Library result → engine layer ([Hkv][m][d] keys and values, [Hkv][m] bias, m = the longest head,
/// and each head's length: per-head budgets, e.g. AdaKV, keep different numbers of entries; rows
/// beyond a head's length are zero padding that the engine never reads).
inline engine::CompressedLayer to_engine(const LayerResult<float>& r) {
  engine::CompressedLayer out;
  const Index H = static_cast<Index>(r.heads.size());
  const Index m = r.max_size();
  const Index d = H > 0 ? r.heads[0].keys.cols() : 0;
  out.m = m;
  out.next_position = r.next_position;
  out.keys.assign(static_cast<std::size_t>(H * m * d), 0.0f);
  out.values.assign(out.keys.size(), 0.0f);
  out.bias.assign(static_cast<std::size_t>(H * m), 0.0f);
  if (m == 0) return out;
  const std::vector<Index> lengths =
      compact_into(r, make_head_major(out.keys.data(), H, m, d), make_head_major(out.values.data(), H, m, d));
  compact_bias_into(r, out.bias.data(), m, m);
  out.lengths.assign(lengths.begin(), lengths.end());
  return out;
}

/// Layer in.layer's budget of a model of `layers` layers: `budget` for every layer (uniform), or its
/// share of the schedule (model.hpp's layer_budgets, window = the run's observation window).
inline Budget layer_budget(const Budget& budget, LayerScheduleArguments schedule, int layers,
                           const engine::LayerInput& in) {
  if (schedule.schedule == LayerSchedule::uniform) return budget;
  schedule.window = in.W;
  const Index m = budget.resolve(in.n);
  if (m < 1) return budget;  // the library reports it
  return Budget::tokens(layer_budgets(schedule, layers, in.n, m)[static_cast<std::size_t>(in.layer)]);
}

/// An engine compression hook running `method` at `budget` on every layer, shared out by `schedule`.
inline engine::LayerCompressor engine_compressor(Compressor method, Budget budget,
                                                 const LayerScheduleArguments& schedule = {}, int layers = 1) {
  return [method = std::move(method), budget, schedule, layers](const engine::LayerInput& in) {
    return to_engine(method(view_of(in), layer_budget(budget, schedule, layers, in)));
  };
}

}  // namespace kvc::cli
