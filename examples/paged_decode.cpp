// An engine's decode loop over a paged KV cache (docs/integration.md shows this file): pages of 16
// entries from a shared pool, a block table per layer, compression during decoding with whole pages
// evicted and handed back to the free list, and decode attention reading the pages in place.
#include <kvcompress/kvcompress.hpp>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  constexpr kvc::Index Hkv = 2, Hq = 8, d = 64, W = 16, page = 16, pages = 64, capacity = pages * page;
  // The pool, [pages][page][Hkv][d] as vLLM lays it out, and the layer's pages in order.
  std::vector<float> k_pool(pages * page * Hkv * d), v_pool(k_pool.size());
  std::vector<std::int32_t> table, free_pages;
  for (std::int32_t p = pages - 1; p >= 0; --p) free_pages.push_back(p);
  std::vector<kvc::Index> positions(Hkv * capacity);  // [Hkv][capacity] each entry's RoPE position
  std::vector<float> bias(Hkv * capacity);            // [Hkv][capacity] each entry's logit bias
  std::vector<float> ring(Hq * W * d);                // the last W decoded queries, oldest first

  // SnapKV's scores and pooling, whole pages kept or evicted: 4 sinks and the 32 newest entries stay.
  using PagedSnapKV = kvc::Pipeline<kvc::AttentionMass, kvc::TopBlocks<page, 4, 32>, kvc::NoRoute, kvc::Drop,
                                    kvc::NoCompensation>;
  PagedSnapKV::Arguments args;
  args.selector.pool_kernel = 7;
  args.selector.pooling = kvc::Pooling::max;
  kvc::DecodingArguments when;
  when.max_size = 512;     // compress once a layer holds more than 512 entries
  when.target_size = 256;  // ... back to 256
  kvc::DecodingCompressor<PagedSnapKV> compressor(PagedSnapKV(args), when);
  kvc::LayerResult<float> out;
  kvc::Workspace<float> ws;

  std::mt19937 rng(1);
  std::normal_distribution<float> noise;
  kvc::Index n = 0, freed = 0, peak = 0;
  kvc::RowMatrix<float> q(Hq, d), attended;
  for (kvc::Index step = 0; step < 2000; ++step) {
    // The model's new key, value and query (random here), the key and value into the newest page.
    if (n % page == 0) {
      if (free_pages.empty()) {
        std::puts("out of pages");
        return 1;
      }
      table.push_back(free_pages.back());
      free_pages.pop_back();
    }
    float* k_row = k_pool.data() + (table[n / page] * page + n % page) * Hkv * d;
    float* v_row = v_pool.data() + (table[n / page] * page + n % page) * Hkv * d;
    for (kvc::Index i = 0; i < Hkv * d; ++i) {
      k_row[i] = noise(rng);
      v_row[i] = noise(rng);
    }
    for (kvc::Index g = 0; g < Hkv; ++g) {
      positions[g * capacity + n] = step;
      bias[g * capacity + n] = 0.0f;
    }
    for (kvc::Index i = 0; i < Hq * d; ++i) q.data()[i] = noise(rng);
    for (kvc::Index h = 0; h < Hq; ++h) {  // the ring: drop the oldest query, append this one
      float* rows = ring.data() + h * W * d;
      std::copy(rows + d, rows + W * d, rows);
      std::copy(q.row(h).data(), q.row(h).data() + d, rows + (W - 1) * d);
    }
    ++n;
    peak = std::max(peak, n);

    // The cache as the library reads it: the pages through the table, positions and bias.
    const auto keys = kvc::make_paged_token_major(k_pool.data(), pages, page, Hkv, d, table.data(), n);
    const auto values = kvc::make_paged_token_major(v_pool.data(), pages, page, Hkv, d, table.data(), n);
    kvc::LayerView<float> cache{keys.as_const(), values.as_const(), kvc::make_head_major<const float>(ring.data(), Hq, W, d)};
    cache.positions = {positions.data(), Hkv, n, capacity};
    cache.bias = {bias.data(), Hkv, n, capacity};

    // Attention of this token over the cache (the bias added to its logits), read in place.
    kvc::decode_attention<float>(q, cache.keys, cache.values, {bias.data(), Hkv, n, capacity}, {}, attended);

    if (compressor.step(cache, out, ws)) {  // due: whole pages evicted, the kept rows stay where they are
      const kvc::PagedCompaction done = kvc::compact_paged(out, keys, values, table.data(), cache.positions);
      kvc::compact_positions_into(out, positions.data(), capacity, capacity);
      kvc::compact_bias_into(out, bias.data(), capacity, capacity);
      table.resize(done.blocks);
      free_pages.insert(free_pages.end(), done.freed.begin(), done.freed.end());
      freed += static_cast<kvc::Index>(done.freed.size());
      n = out.max_size();
    }
  }
  std::printf("2000 steps: %ld compressions, %ld pages freed, at most %ld entries (%ld pages of %ld)\n",
              static_cast<long>(compressor.compressions()), static_cast<long>(freed), static_cast<long>(peak),
              static_cast<long>((peak + page - 1) / page), static_cast<long>(pages));
  return compressor.compressions() > 0 && table.size() + free_pages.size() == pages ? 0 : 1;
}
