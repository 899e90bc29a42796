// A downstream program: compresses a small synthetic layer and checks the result's shape. StreamingLLM:
// the packaging is under test here, and it compiles fastest.
#include <kvcompress/kvcompress.hpp>

#include <cstdio>
#include <vector>

int main() {
  const kvc::Index kv_heads = 2, query_heads = 4, n = 64, d = 8, window = 8;
  std::vector<float> keys(kv_heads * n * d), values(kv_heads * n * d), queries(query_heads * window * d);
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = float((i * 37) % 11) / 11.0f - 0.5f;
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = float((i * 17) % 13) / 13.0f - 0.5f;
  for (std::size_t i = 0; i < queries.size(); ++i) queries[i] = float((i * 7) % 5) / 5.0f - 0.5f;
  kvc::LayerView<float> layer{kvc::make_head_major<const float>(keys.data(), kv_heads, n, d),
                              kvc::make_head_major<const float>(values.data(), kv_heads, n, d),
                              kvc::make_head_major<const float>(queries.data(), query_heads, window, d)};
  const auto result = kvc::StreamingLLM{}.run(layer, kvc::Budget::tokens(16));
  for (const auto& head : result.heads)
    if (head.size() != 16) return 1;
  std::printf("kvcompress %s consumer ok\n", kvc::version_string());
  return 0;
}
