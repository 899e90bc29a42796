// Decode attention (one step, Hq 32 query heads, Hkv 8, d 128) over a full cache of n entries and over a
// 25% cache (m = n/4) with a compensation bias: speedup_vs_full = full time / compressed time, measured
// in the same benchmark; bytes/s of the compressed decode (K and V read once) and its fraction of the
// streaming-sum probe over the same number of bytes.
#include "bench_common.hpp"

namespace {

using namespace kvc;
using namespace kvc::bench;

template <class T>
struct DecodeCache {
  Index heads = 8, tokens = 0, dim = 128;
  CacheBuffer<T> keys, values;
  DecodeCache(const BenchLayer& layer, Index t)
      : tokens(t), keys(std::size_t(heads * t * dim)), values(std::size_t(heads * t * dim)) {
    for (Index g = 0; g < heads; ++g)
      for (Index j = 0; j < t; ++j)
        for (Index c = 0; c < dim; ++c) {
          const std::size_t src = std::size_t((g * layer.tokens + j) * dim + c), dst = std::size_t((g * t + j) * dim + c);
          keys[dst] = T(layer.keys[src]);
          values[dst] = T(layer.values[src]);
        }
  }
  double huge_fraction() const { return kv_huge_fraction(keys.data(), values.data(), keys.size() * sizeof(T)); }
  TensorView<const T> k() const { return make_head_major<const T>(keys.data(), heads, tokens, dim); }
  TensorView<const T> v() const { return make_head_major<const T>(values.data(), heads, tokens, dim); }
};

template <class T>
double decode_seconds(const RowMatrix<float>& q, const DecodeCache<T>& cache, const BiasView<float>& bias, int reps) {
  RowMatrix<float> out;
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = thread_seconds();
    decode_attention<T>(q, cache.k(), cache.v(), bias, AttentionArguments{}, out);
    benchmark::DoNotOptimize(out.data());
    best = std::min(best, thread_seconds() - t0);
  }
  return best;
}

template <class T>
void BM_Decode(benchmark::State& state) {
  const Index n = state.range(0), m = n / 4;
  const auto& layer = layer_of(n);
  const DecodeCache<T> full(layer, n), compressed(layer, m);
  const RowMatrix<float> q = RowMatrix<float>::Random(32, 128);
  const RowMatrix<float> bias_data = RowMatrix<float>::Random(8, m).cwiseAbs();
  const BiasView<float> bias{bias_data.data(), 8, m, m};
  const double full_s = decode_seconds(q, full, BiasView<float>{}, 3);
  double best = 1e30;
  for (auto _ : state) {
    const double t = decode_seconds(q, compressed, bias, 1);
    best = std::min(best, t);
    state.SetIterationTime(t);
  }
  const double bytes = 2.0 * double(8 * m * 128) * sizeof(T);
  state.counters["speedup_vs_full"] = full_s / best;
  state.counters["full_ms"] = full_s * 1e3;
  state.counters["bytes/s"] = bytes / best;
  state.counters["frac_stream"] = bytes / best / stream_bytes_per_second(std::size_t(bytes));
  if (huge_pages_requested()) state.counters["huge_frac"] = std::min(full.huge_fraction(), compressed.huge_fraction());
}

/// Overlap probe for the decode target: the streaming sum of BM_StreamSum over the bytes of the 25 %
/// cache (as BM_Decode<float> reads them), plus the decode's arithmetic density done in registers —
/// 16 FMA instructions (8 independent chains, 2 rounds) per 4 batches loaded, i.e. one FMA lane per
/// byte, as decode's 2·G·d FMA lanes per 2·d·4 bytes of a key and value row with G = 4 — with no extra
/// loads. frac_stream = its bytes/s over the plain streaming sum's: how much of the stream this core
/// sustains while doing that much arithmetic, an upper bound for BM_Decode's frac_stream.
void BM_StreamFma(benchmark::State& state) {
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  constexpr std::size_t S = B::size;
  const Index n = state.range(0), m = n / 4;
  const std::size_t bytes = std::size_t(2 * 8 * m * 128) * sizeof(float);
  CacheBuffer<float> buf(bytes / sizeof(float));  // in huge pages when the caches are
  std::fill(buf.data(), buf.data() + buf.size(), 1.0f);
  double best = 1e30;
  for (auto _ : state) {
    const double t0 = thread_seconds();
    B s0(0.f), s1(0.f), s2(0.f), s3(0.f), a[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) a[c] = B(1.0f + 0.001f * float(c));
    const B decay(0.999f);
    for (std::size_t i = 0; i + 4 * S <= buf.size(); i += 4 * S) {
      const B v0 = B::load_unaligned(&buf[i]);
      s0 += v0;
      s1 += B::load_unaligned(&buf[i + S]);
      s2 += B::load_unaligned(&buf[i + 2 * S]);
      s3 += B::load_unaligned(&buf[i + 3 * S]);
#pragma GCC unroll 2
      for (int round = 0; round < 2; ++round)
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) a[c] = simd::fma(a[c], decay, v0);
    }
    B total = s0 + s1 + s2 + s3;
    for (int c = 0; c < 8; ++c) total += a[c];
    benchmark::DoNotOptimize(simd::reduce_add<A>(total));
    const double t = thread_seconds() - t0;
    best = std::min(best, t);
    state.SetIterationTime(t);
  }
  state.counters["bytes/s"] = double(bytes) / best;
  state.counters["frac_stream"] = double(bytes) / best / stream_bytes_per_second(bytes);
}

/// Decoding with compression (DecodingCompressor), against decoding over a fixed-size cache. With
/// budget = range(0), the cache starts at its size after a compression (every other token of a
/// 2·budget-token prompt of the bench layer); 2·budget tokens are decoded, each appended (its key and
/// value from the layer's rows), then attended to by 32 query heads (decode_attention, with the stored
/// bias), and every budget/8 tokens the cache is compressed back with Preset (window: the last 32
/// queries, kept in a doubled ring so that they are contiguous; the newest 32 entries forced) and
/// compacted in place. The baseline decodes the same tokens over a cache of `budget` entries, each new
/// token overwriting the oldest slot. range(1) = 1: the cache and bias are flushed from every cache level before each step
/// (untimed), as in a model whose other layers pass through the caches between two steps of this one.
/// range(2) selects what `budget` bounds: 0, the size after a compression (the cache grows to
/// budget + budget/8 between two); 1, the cache's memory (it never holds more than budget entries:
/// compressed to budget − budget/8, as OpenVINO GenAI's max cache size), so that both runs hold the
/// same memory. x_fixed = growing / fixed seconds (the compressions included); x_fixed_decode = the
/// growing run's seconds outside its compressions / fixed seconds; compress_ms: one
/// compression (pipeline run and compaction), mean; mean_entries: the growing cache's mean size.
template <class Preset>
void BM_DecodeGrowing(benchmark::State& state) {
  const Index budget = state.range(0), every = budget / 8, steps = 2 * budget, H = 8, Hq = 32, d = 128, W = 32;
  const bool cold = state.range(1) != 0, capped = state.range(2) != 0;
  const Index target = capped ? budget - every : budget, cap = target + every + 1;
  const BenchLayer& layer = layer_of(2 * budget);
  auto row = [&](const CacheBuffer<float>& src, Index g, Index j) { return src.data() + (g * layer.tokens + j) * d; };
  CacheBuffer<float> keys(std::size_t(H * cap * d)), values(std::size_t(H * cap * d));
  std::vector<float> bias(std::size_t(H * cap)), ring(std::size_t(Hq * 2 * W * d));
  std::vector<Index> positions(std::size_t(H * cap));
  DecodingArguments args;
  args.target_size = target;
  args.every = every;
  args.max_size = target + every;
  args.sinks = 0;
  args.recent = W;
  const TensorView<float> kall = make_head_major(keys.data(), H, cap, d), vall = make_head_major(values.data(), H, cap, d);
  RowMatrix<float> q(Hq, d), out;
  auto query = [&](Index step) {  // the layer's window queries, in turn
    for (Index h = 0; h < Hq; ++h)
      std::copy(layer.queries.data() + (h * layer.window + step % layer.window) * d,
                layer.queries.data() + (h * layer.window + step % layer.window + 1) * d, q.row(h).data());
  };
  auto append = [&](Index slot, Index step) {
    const Index src = (2 * budget - 1 - step % (2 * budget));
    for (Index g = 0; g < H; ++g) {
      std::copy(row(layer.keys, g, src), row(layer.keys, g, src) + d, keys.data() + (g * cap + slot) * d);
      std::copy(row(layer.values, g, src), row(layer.values, g, src) + d, values.data() + (g * cap + slot) * d);
    }
  };
  auto fill = [&](Index count) {
    for (Index g = 0; g < H; ++g)
      for (Index i = 0; i < count; ++i) {
        std::copy(row(layer.keys, g, 2 * i), row(layer.keys, g, 2 * i) + d, keys.data() + (g * cap + i) * d);
        std::copy(row(layer.values, g, 2 * i), row(layer.values, g, 2 * i) + d, values.data() + (g * cap + i) * d);
        positions[std::size_t(g * cap + i)] = 2 * i;
        bias[std::size_t(g * cap + i)] = 0.0f;
      }
  };
  auto flush = [&] {
    if (!cold) return;
    evict_from_caches(keys.data(), keys.size() * sizeof(float));
    evict_from_caches(values.data(), values.size() * sizeof(float));
    evict_from_caches(bias.data(), bias.size() * sizeof(float));
  };
  double best_fixed = 1e30, best_growing = 1e30, compress_s = 0, best_decode = 1e30;
  Index compressions = 0;
  double entries = 0;
  for (auto _ : state) {
    fill(budget);
    double fixed = 0;
    for (Index step = 0; step < steps; ++step) {  // fixed: the new token replaces the oldest slot
      flush();
      const double t0 = thread_seconds();
      append(step % budget, step);
      query(step);
      decode_attention<float>(q, kall.as_const().token_range(0, budget), vall.as_const().token_range(0, budget),
                              BiasView<float>{bias.data(), H, budget, cap}, AttentionArguments{}, out);
      benchmark::DoNotOptimize(out.data());
      fixed += thread_seconds() - t0;
    }
    best_fixed = std::min(best_fixed, fixed);

    fill(target);
    DecodingCompressor<Preset> compressor(Preset{}, args);
    LayerResult<float> result;
    Workspace<float> ws;
    Index n = target;
    double in_compress = 0, growing = 0;
    entries = 0;
    Index count = 0;
    for (Index step = 0; step < steps; ++step) {
      flush();
      const double t0 = thread_seconds();
      append(n, step);
      for (Index g = 0; g < H; ++g) {
        positions[std::size_t(g * cap + n)] = 2 * budget + step;
        bias[std::size_t(g * cap + n)] = 0.0f;
      }
      ++n;
      entries += double(n);
      query(step);
      for (Index h = 0; h < Hq; ++h) {  // the doubled ring: rows step % W and step % W + W
        float* r = ring.data() + h * 2 * W * d;
        std::copy(q.row(h).data(), q.row(h).data() + d, r + (step % W) * d);
        std::copy(q.row(h).data(), q.row(h).data() + d, r + (step % W + W) * d);
      }
      decode_attention<float>(q, kall.as_const().token_range(0, n), vall.as_const().token_range(0, n),
                              BiasView<float>{bias.data(), H, n, cap}, AttentionArguments{}, out);
      benchmark::DoNotOptimize(out.data());
      const Index w = std::min(step + 1, W);
      LayerView<float> cache{kall.as_const().token_range(0, n), vall.as_const().token_range(0, n),
                             {ring.data() + ((step + 1) % W + W - w) * d, Hq, w, d, 2 * W * d, d}};
      cache.positions = {positions.data(), H, n, cap};
      cache.bias = {bias.data(), H, n, cap};
      const double c0 = thread_seconds();
      if (compressor.step(cache, result, ws)) {
        compact_into(result, kall, vall);
        compact_bias_into(result, bias.data(), cap, cap);
        compact_positions_into(result, positions.data(), cap, cap);
        n = result.max_size();
        in_compress += thread_seconds() - c0;
        ++count;
      }
      growing += thread_seconds() - t0;
    }
    best_growing = std::min(best_growing, growing);
    best_decode = std::min(best_decode, growing - in_compress);
    compress_s = in_compress;
    compressions = count;
    state.SetIterationTime(growing);
  }
  state.counters["x_fixed"] = best_growing / best_fixed;
  state.counters["x_fixed_decode"] = best_decode / best_fixed;
  state.counters["fixed_ms"] = best_fixed * 1e3;
  state.counters["compress_ms"] = compressions > 0 ? compress_s / double(compressions) * 1e3 : 0.0;
  state.counters["compressions"] = double(compressions);
  state.counters["mean_entries"] = entries / double(steps);
}

}  // namespace

// budget 2048 (decoding 4096 tokens after a 4096-token prompt, compressed every 256), warm and cold,
// as the size after a compression and as the cache's memory; budget 256 for the smoke run.
void decode_growing_sizes(benchmark::internal::Benchmark* b) {
  b->Args({256, 0, 0})->Args({2048, 0, 0})->Args({2048, 1, 0})->Args({2048, 0, 1})->Args({2048, 1, 1})->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(2);
}
BENCHMARK_TEMPLATE(BM_DecodeGrowing, SnapKV)->Apply(decode_growing_sizes);
BENCHMARK_TEMPLATE(BM_DecodeGrowing, SelKV)->Apply(decode_growing_sizes);
BENCHMARK_TEMPLATE(BM_DecodeGrowing, SnapKVGRKV)->Apply(decode_growing_sizes);
BENCHMARK(BM_StreamFma)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Decode, float)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Decode, Eigen::half)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Decode, Eigen::bfloat16)->Apply(kvc::bench::layer_sizes);
