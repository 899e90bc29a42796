// Connects the example engine's compression hook to the library: an engine layer becomes a zero-copy
// kvc::LayerView, the library's LayerResult becomes the engine's CompressedLayer.
#pragma once

#include "engine/llama2.hpp"
#include "methods.hpp"
#include "runner.hpp"

#include <memory>
#include <optional>
#include <stdexcept>

namespace kvc::cli {

/// Zero-copy view of one engine layer: keys/values [Hkv][capacity][d] (first n rows used), or the
/// pages of a paged session through its block table, queries [Hq][W][d], and the entries' positions,
/// bias and the layer's W_o when the engine gives them.
inline LayerView<float> view_of(const engine::LayerInput& in) {
  LayerView<float> layer;
  if (in.blocks) {
    layer.keys = make_paged_token_major(in.keys, in.num_blocks, in.block_size, in.Hkv, in.d, in.blocks, in.n);
    layer.values = make_paged_token_major(in.values, in.num_blocks, in.block_size, in.Hkv, in.d, in.blocks, in.n);
  } else {
    layer.keys = {in.keys, in.Hkv, in.n, in.d, in.head_stride, in.d};
    layer.values = {in.values, in.Hkv, in.n, in.d, in.head_stride, in.d};
  }
  layer.queries = {in.queries, in.Hq, in.W, in.d, in.queries_head_stride > 0 ? in.queries_head_stride : in.W * in.d, in.d};
  if (in.positions) layer.positions = {in.positions, in.Hkv, in.n, in.state_stride};
  if (in.bias) layer.bias = {in.bias, in.Hkv, in.n, in.state_stride};
  if (in.wo) layer.output_projection = {in.wo, in.dim, in.Hq * in.d, in.Hq * in.d};
  return layer;
}

/// Library result → engine layer ([Hkv][m][d] keys and values, [Hkv][m] bias and positions, m = the
/// longest head, and each head's length: per-head budgets, e.g. AdaKV, keep different numbers of
/// entries; rows beyond a head's length are padding that the engine never reads). The positions are
/// the RoPE positions of the kept keys: their original ones, or 0..m_g−1 when `repositioned`.
inline engine::CompressedLayer to_engine(const LayerResult<float>& r, bool repositioned = false) {
  engine::CompressedLayer out;
  const Index H = static_cast<Index>(r.heads.size());
  const Index m = r.max_size();
  const Index d = H > 0 ? r.heads[0].keys.cols() : 0;
  out.m = m;
  out.next_position = r.next_position;
  out.keys.assign(static_cast<std::size_t>(H * m * d), 0.0f);
  out.values.assign(out.keys.size(), 0.0f);
  out.bias.assign(static_cast<std::size_t>(H * m), 0.0f);
  out.positions.assign(static_cast<std::size_t>(H * m), 0);
  if (m == 0) return out;
  for (Index g = 0; g < H; ++g) {
    const auto& p = r.heads[static_cast<std::size_t>(g)].positions;
    for (std::size_t i = 0; i < p.size(); ++i)
      out.positions[static_cast<std::size_t>(g * m) + i] = repositioned ? static_cast<Index>(i) : p[i];
  }
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
                                                 const LayerScheduleArguments& schedule = {}, int layers = 1,
                                                 bool repositioned = false) {
  return [method = std::move(method), budget, schedule, layers, repositioned](const engine::LayerInput& in) {
    return to_engine(method(view_of(in), layer_budget(budget, schedule, layers, in)), repositioned);
  };
}

/// The shared runner of a method, serial (grown_compressor makes its DecodingCompressors).
inline std::shared_ptr<const Runner<float>> method_runner(const std::string& method, const MethodOptions& o) {
  return make_runner<float>(method, o, 1);
}

/// Compression while the cache grows: each call of the returned factory gives one sequence's
/// engine::CacheCompressor, which runs the library's DecodingCompressor of `runner` on every layer,
/// with `per_layer[l]` (its target_size the layer's budget). `observe` (optional) sees each
/// compression's input and result.
using Observer = std::function<void(const LayerView<float>&, const LayerResult<float>&)>;
inline std::function<engine::CacheCompressor()> grown_compressor(std::shared_ptr<const Runner<float>> runner,
                                                                 std::vector<DecodingArguments> per_layer,
                                                                 Observer observe = {}) {
  for (const DecodingArguments& a : per_layer) runner->decoder(a);  // bad arguments fail here, not mid-run
  return [runner = std::move(runner), per_layer = std::move(per_layer), observe]() -> engine::CacheCompressor {
    struct State {
      std::vector<std::unique_ptr<Decoder<float>>> layers;
      LayerResult<float> out;
      Workspace<float> ws;
    };
    auto state = std::make_shared<State>();
    for (const DecodingArguments& a : per_layer) state->layers.push_back(runner->decoder(a));
    return [state, observe](const engine::LayerInput& in) -> std::optional<engine::CompressedLayer> {
      if (in.layer < 0 || static_cast<std::size_t>(in.layer) >= state->layers.size())
        throw std::invalid_argument("grown_compressor: layer " + std::to_string(in.layer) + " outside [0, " +
                                    std::to_string(state->layers.size()) + ")");
      const LayerView<float> layer = view_of(in);
      if (!state->layers[static_cast<std::size_t>(in.layer)]->step(layer, state->out, state->ws)) return std::nullopt;
      if (observe) observe(layer, state->out);
      return to_engine(state->out);
    };
  };
}

/// The per-layer arguments of a chunked prefill of `prefix` tokens to `budget` (shared out by
/// `schedule` over `layers`, as the one-shot compression would): a layer is compressed to its budget
/// whenever a chunk leaves it above it, keeping the newest `window` entries (the next window).
inline std::vector<DecodingArguments> chunked_prefill_arguments(const Budget& budget, LayerScheduleArguments schedule,
                                                                int layers, Index prefix, Index window) {
  const Index m = budget.resolve(prefix);
  if (m < 1) throw std::invalid_argument("the budget keeps no entry of the " + std::to_string(prefix) + "-token prefix");
  std::vector<Index> targets(static_cast<std::size_t>(layers), m);
  if (schedule.schedule != LayerSchedule::uniform) {
    schedule.window = window;
    targets = layer_budgets(schedule, layers, prefix, m);
  }
  std::vector<DecodingArguments> out;
  for (const Index t : targets) {
    DecodingArguments a;
    a.target_size = std::min(t, prefix);
    a.max_size = a.target_size;
    a.sinks = 0;
    a.recent = std::min(window, a.target_size);
    out.push_back(a);
  }
  return out;
}

/// The per-layer arguments of compression during decoding: to `budget` entries once a layer holds
/// more, then every `every` tokens (never more than budget + every entries), keeping the newest
/// `window` entries (the next compression's window; the method's own sinks apply).
inline std::vector<DecodingArguments> decoding_arguments(Index budget, Index every, int layers, Index window) {
  DecodingArguments a;
  a.target_size = budget;
  a.every = every;
  a.max_size = budget + every;
  a.sinks = 0;
  a.recent = std::min(window, budget);
  a.validate().throw_if_error();
  return std::vector<DecodingArguments>(static_cast<std::size_t>(layers), a);
}

}  // namespace kvc::cli
