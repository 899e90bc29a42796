// A structured random cache: kvc_demo's data when the real model is absent, and the benchmarks' data.
#pragma once

#include <kvcompress/core.hpp>

#include <cstdint>
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

}  // namespace kvc::demo
