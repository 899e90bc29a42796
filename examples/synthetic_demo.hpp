// The synthetic demo: compresses a structured random cache with each preset and prints a table.
// Used by kvc_demo when the real model is absent.
#pragma once

#include <kvcompress/kvcompress.hpp>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace kvc::demo {

/// A layer-sized random cache with structure: a few "heavy hitter" tokens whose keys align with the
/// window queries, so that attention is concentrated as in real models.
struct SyntheticLayer {
  Index kv_heads = 8, query_heads = 32, tokens = 4096, dim = 128, window = 32;
  std::vector<float> keys, values, queries;

  explicit SyntheticLayer(std::uint64_t seed, Index n = 4096) : tokens(n) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal;
    keys.resize(kv_heads * tokens * dim);
    values.resize(keys.size());
    queries.resize(query_heads * window * dim);
    for (auto& x : queries) x = normal(rng);
    for (auto& x : values) x = normal(rng);
    std::bernoulli_distribution heavy(0.05);
    const Index G = query_heads / kv_heads;
    for (Index g = 0; g < kv_heads; ++g)
      for (Index j = 0; j < tokens; ++j) {
        const bool h = heavy(rng);
        const float* q = &queries[(g * G) * window * dim];  // align with the group's first query
        for (Index c = 0; c < dim; ++c)
          keys[(g * tokens + j) * dim + c] = normal(rng) * 0.5f + (h ? 0.25f * q[c] : 0.0f);
      }
  }

  LayerView<float> view() const {
    return {make_head_major<const float>(keys.data(), kv_heads, tokens, dim),
            make_head_major<const float>(values.data(), kv_heads, tokens, dim),
            make_head_major<const float>(queries.data(), query_heads, window, dim)};
  }
};

template <class Preset>
void demo_row(const char* name, const LayerView<float>& layer, double ratio) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = Preset{}.run(layer, Budget::ratio(ratio));
  const auto t1 = std::chrono::steady_clock::now();
  const double err = window_output_error(layer, result);
  std::printf("  %-14s %5.2f %8td %12.4f %10.1f\n", name, ratio, result.max_size(), err,
              std::chrono::duration<double, std::milli>(t1 - t0).count());
}

inline void run_synthetic_demo() {
  const SyntheticLayer synth(2026);
  const auto layer = synth.view();
  std::printf("Synthetic layer: Hkv=%td Hq=%td n=%td d=%td W=%td (float)\n", synth.kv_heads, synth.query_heads,
              synth.tokens, synth.dim, synth.window);
  std::printf("  %-14s %5s %8s %12s %10s\n", "method", "ratio", "kept", "window_err", "time_ms");
  for (double ratio : {0.1, 0.25, 0.5}) {
    demo_row<StreamingLLM>("streaming", layer, ratio);
    demo_row<SnapKV>("snapkv", layer, ratio);
    demo_row<SelKVEvict>("selkv-evict", layer, ratio);
    demo_row<SelKV>("selkv", layer, ratio);
    demo_row<SelKVMergeAll>("selkv-mergeall", layer, ratio);
  }
  std::printf("window_err = ||Y_full - Y_compressed||_F / ||Y_full||_F on the observation window.\n");
}

}  // namespace kvc::demo
