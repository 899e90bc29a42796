// Connects the example engine's compression hook to the library: an engine layer becomes a zero-copy
// kvc::LayerView, the library's LayerResult becomes the engine's CompressedLayer.
#pragma once

#include "engine/llama2.hpp"
#include "methods.hpp"

#include <limits>
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

/// Library result → engine layer ([Hkv][m][d] keys and values, [Hkv][m] bias, m = the longest head).
/// The engine keeps one length per layer, so a head that kept fewer entries (per-head budgets: AdaKV)
/// is padded to m with zero rows whose bias is −inf: they take no attention, now or after decoding
/// appends tokens behind them. The padding occupies cache memory; an engine with per-head lengths
/// (compact_into's lengths, decode_attention's per-head overload) stores none.
inline engine::CompressedLayer to_engine(const LayerResult<float>& r) {
  engine::CompressedLayer out;
  const Index H = static_cast<Index>(r.heads.size());
  const Index m = r.max_size();
  const Index d = H > 0 ? r.heads[0].keys.cols() : 0;
  out.m = m;
  out.next_position = r.next_position;
  out.keys.assign(static_cast<std::size_t>(H * m * d), 0.0f);
  out.values.assign(out.keys.size(), 0.0f);
  out.bias.assign(static_cast<std::size_t>(H * m), -std::numeric_limits<float>::infinity());
  if (m == 0) return out;
  compact_into(r, make_head_major(out.keys.data(), H, m, d), make_head_major(out.values.data(), H, m, d));
  compact_bias_into(r, out.bias.data(), m, m);  // rows beyond a head's length keep −inf
  return out;
}

/// An engine compression hook running `method` at `budget` on every layer.
inline engine::LayerCompressor engine_compressor(Compressor method, Budget budget) {
  return [method = std::move(method), budget](const engine::LayerInput& in) {
    return to_engine(method(view_of(in), budget));
  };
}

}  // namespace kvc::cli
