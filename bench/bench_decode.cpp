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

}  // namespace

BENCHMARK(BM_StreamFma)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Decode, float)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Decode, Eigen::half)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Decode, Eigen::bfloat16)->Apply(kvc::bench::layer_sizes);
