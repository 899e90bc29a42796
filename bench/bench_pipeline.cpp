// Whole-pipeline benchmarks per preset on a Llama-3.1-8B layer shape (Hq 32, Hkv 8, d 128, W 32),
// with x_gemm = time / time of the plain Eigen product Qw·K^T for the same layer, in the same run.
#include <benchmark/benchmark.h>

#include "../examples/synthetic_demo.hpp"

namespace {

double gemm_seconds(const kvc::LayerView<float>& layer) {
  // One plain product per KV head: (G·W, d) × (d, n).
  const kvc::Index G = layer.group_size(), W = layer.window(), n = layer.tokens(), d = layer.head_dim();
  kvc::RowMatrix<float> s(G * W, n);
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (kvc::Index g = 0; g < layer.kv_heads(); ++g) {
      const auto q = kvc::gather_group_queries<float>(layer, g);
      Eigen::Map<const kvc::RowMatrix<float>> k(layer.keys.row(g, 0), n, d);
      s.noalias() = q * k.transpose();
      benchmark::DoNotOptimize(s.data());
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

template <class Preset>
void BM_Pipeline(benchmark::State& state) {
  const kvc::demo::SyntheticLayer synth(7, state.range(0));
  const auto layer = synth.view();
  const double gemm = gemm_seconds(layer);
  Preset preset;
  double total = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = preset.run(layer, kvc::Budget::ratio(0.25));
    benchmark::DoNotOptimize(r.heads.data());
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  state.counters["tokens/s"] = benchmark::Counter(double(synth.tokens) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["gemm_ms"] = gemm * 1e3;
  state.counters["x_gemm"] = total / double(state.iterations()) / gemm;
}

}  // namespace

BENCHMARK_TEMPLATE(BM_Pipeline, kvc::StreamingLLM)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SnapKV)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SelKV)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
