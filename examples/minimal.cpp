// The README quick start: compress one layer of a cache with SelKV and write it back in place.
#include <kvcompress/kvcompress.hpp>

#include <cstdio>
#include <vector>

int main() {
  const kvc::Index Hkv = 4, Hq = 8, n = 1024, d = 64, W = 32;  // one layer of a GQA model
  std::vector<float> K(Hkv * n * d, 0.01f), V(Hkv * n * d, 0.02f), Q(Hq * W * d, 0.03f);

  kvc::LayerView<float> layer{kvc::make_head_major<const float>(K.data(), Hkv, n, d),   // [Hkv][n][d]
                              kvc::make_head_major<const float>(V.data(), Hkv, n, d),   // [Hkv][n][d]
                              kvc::make_head_major<const float>(Q.data(), Hq, W, d)};   // [Hq][W][d]
  auto result = kvc::SelKV{}.run(layer, kvc::Budget::ratio(0.25));  // throws kvc::error on bad input

  // Write the m kept entries back into the engine's own cache; add heads[g].bias to their logits.
  kvc::compact_into(result, kvc::make_head_major(K.data(), Hkv, n, d), kvc::make_head_major(V.data(), Hkv, n, d));
  std::printf("kept %td of %td tokens per head, next position %td\n", result.max_size(), n, result.next_position);
}
