// Whole-pipeline benchmarks per preset on the Llama-3.1-8B layer shape (Hq 32, Hkv 8, d 128, W 32) at
// ratio 0.25: x_gemm = CPU time / CPU time of the plain Eigen product Qw·K^T for the same layer (same
// process), tokens/s, peak extra heap memory of one run, CG iterations for GRKV; and 1 vs 2 threads.
#include "bench_common.hpp"

#include <numeric>
#include <random>

namespace {

using namespace kvc;
using namespace kvc::bench;

/// The preset with its window product set to P; false (and the benchmark skipped with a message) when P
/// is the AMX product and this process cannot run it, so that no row labelled AMX measures FMA.
template <class Preset, WindowProduct P>
bool make_preset(benchmark::State& state, Preset& preset) {
  if (!skip_unless_available(state, P)) return false;
  typename Preset::Arguments args;
  args.attention.product = P;
  preset = Preset(args);
  return true;
}

template <class Preset, WindowProduct P = WindowProduct::fma>
void BM_Pipeline(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  gemm_seconds(n);  // measure the baseline before the first timed run
  Preset preset;
  if (!make_preset<Preset, P>(state, preset)) return;
  double total = 0;
  double peak_extra = 0;
  double cg_iterations = 0;
  for (auto _ : state) {
    const std::size_t before = live_bytes();
    reset_peak();
    const double t0 = thread_seconds();
    auto r = preset.run(layer, Budget::ratio(0.25));
    const double t = thread_seconds() - t0;
    benchmark::DoNotOptimize(r.heads.data());
    peak_extra = std::max(peak_extra, double(peak_bytes() - before));
    double iters = 0;
    for (const auto& h : r.heads) iters += double(h.diagnostics.cg_iterations);
    cg_iterations = iters / double(r.heads.size());
    total += t;
    state.SetIterationTime(t);
  }
  set_layer_counters(state, n, total / double(state.iterations()));
  state.counters["peak_extra_MB"] = peak_extra / 1e6;  // includes the returned result (m·d per head)
  if (cg_iterations > 0) state.counters["cg_iters"] = cg_iterations;
}

/// BM_Pipeline over the same layer held in a paged cache: pages of b = range(1) entries in shuffled
/// order, read in place through the block table, laid out [pages][b][H][d] (range(2) = 0, vLLM's
/// flash layout: a head's rows H·d apart) or [pages][H][b][d] (1, OpenVINO's: b rows of a head
/// together). The result is BM_Pipeline's bit for bit (tests/paged_test.cpp); `x_contiguous` = this
/// time over BM_Pipeline's (head-major, contiguous) in the same process, measured alternately.
template <class Preset>
void BM_PipelinePaged(benchmark::State& state) {
  const Index n = state.range(0), b = state.range(1);
  const bool head_major = state.range(2) != 0;
  const BenchLayer& flat = layer_of(n);
  const Index H = flat.kv_heads, d = flat.dim, pages = (n + b - 1) / b;
  CacheBuffer<float> keys(static_cast<std::size_t>(pages * b * H * d)), values(keys.size());
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(3));
  for (Index g = 0; g < H; ++g)
    for (Index j = 0; j < n; ++j) {
      const Index page = table[static_cast<std::size_t>(j / b)];
      const Index at = head_major ? ((page * H + g) * b + j % b) * d : ((page * b + j % b) * H + g) * d;
      std::copy_n(flat.keys.data() + (g * n + j) * d, d, keys.data() + at);
      std::copy_n(flat.values.data() + (g * n + j) * d, d, values.data() + at);
    }
  LayerView<float> paged = flat.view();
  if (head_major) {
    paged.keys = make_paged_head_major<const float>(keys.data(), pages, H, b, d, table.data(), n);
    paged.values = make_paged_head_major<const float>(values.data(), pages, H, b, d, table.data(), n);
  } else {
    paged.keys = make_paged_token_major<const float>(keys.data(), pages, b, H, d, table.data(), n);
    paged.values = make_paged_token_major<const float>(values.data(), pages, b, H, d, table.data(), n);
  }
  const LayerView<float> contiguous = flat.view();
  gemm_seconds(n);
  const Preset preset;
  double total = 0, total_flat = 0;
  for (auto _ : state) {
    double t0 = thread_seconds();
    auto r = preset.run(paged, Budget::ratio(0.25));
    const double t = thread_seconds() - t0;
    benchmark::DoNotOptimize(r.heads.data());
    t0 = thread_seconds();
    auto f = preset.run(contiguous, Budget::ratio(0.25));
    total_flat += thread_seconds() - t0;
    benchmark::DoNotOptimize(f.heads.data());
    total += t;
    state.SetIterationTime(t);
  }
  set_layer_counters(state, n, total / double(state.iterations()));
  state.counters["x_contiguous"] = total / total_flat;
}

/// The steady state of an engine compressing layer after layer: run(layer, budget, out, ws) with the
/// result and the workspace kept from the previous call (one untimed warm-up call fills them). Same
/// x_gemm definition; `held_MB` = the memory kept between calls (result + workspace).
template <class Preset, WindowProduct P = WindowProduct::fma>
void BM_PipelineReuse(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  gemm_seconds(n);
  Preset preset;
  if (!make_preset<Preset, P>(state, preset)) return;
  LayerResult<float> out;
  Workspace<float> ws;
  const double per = time_iterations(state, [&] {  // its untimed first call allocates out and ws
    preset.run(layer, Budget::ratio(0.25), out, ws);
    benchmark::DoNotOptimize(out.heads.data());
  });
  set_layer_counters(state, n, per);
  double held = double(ws.bytes());
  for (const auto& h : out.heads) held += double(h.keys.size() + h.values.size() + h.bias.size()) * sizeof(float);
  state.counters["held_MB"] = held / 1e6;
  // What one more reused call still allocates (untimed): the policies' per-call temporaries.
  const std::size_t count0 = allocation_count(), bytes0 = allocated_bytes(), live0 = live_bytes();
  reset_peak();
  preset.run(layer, Budget::ratio(0.25), out, ws);
  // All three read before the counters are set (each new counter's map node is an allocation).
  const std::size_t count = allocation_count() - count0, bytes = allocated_bytes() - bytes0;
  const std::size_t peak = peak_bytes() - live0;
  state.counters["allocs_per_call"] = double(count);
  state.counters["alloc_MB_per_call"] = double(bytes) / 1e6;
  state.counters["transient_peak_MB"] = double(peak) / 1e6;
}

/// x_gemm measured robustly against the machine's jitter: every iteration runs kPairedRounds rounds of
/// {one pipeline call, one plain product gemm_pass over the same layer}, alternately and each timed by
/// the thread's CPU time, so that both sides see the same drift of the machine's speed, and takes
/// medians, which single slow calls do not move. On shared virtual machines single calls of either can
/// run much longer than the fastest, at random and independently of each other, while x_gemm
/// elsewhere divides one call by the best of 5 products. One iteration per repetition
/// (Iterations(1)), whose time is the median call. Counters: x_gemm_paired = median call / median
/// product, x_gemm_best = fastest call / fastest product, call_ms and product_ms (the two medians),
/// spread / gemm_spread = slowest / fastest call / product (the jitter), x_gemm = the median call /
/// gemm_seconds (best of 5 products taken before).
/// Reuse: run(layer, ratio, out, ws) with both kept from an untimed first call, as BM_PipelineReuse;
/// else the one-shot run(layer, ratio), as BM_Pipeline (the result is freed outside the timing).
template <class Preset, bool Reuse>
void BM_PipelinePaired(benchmark::State& state) {
  constexpr int kPairedRounds = 7;
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  gemm_seconds(n);
  const Preset preset;
  LayerResult<float> out;
  Workspace<float> ws;
  if constexpr (Reuse) preset.run(layer, Budget::ratio(0.25), out, ws);
  RowMatrix<float> logits;
  gemm_pass(layer, logits);  // its (G·W, n) output allocated and written before the timing
  std::vector<double> calls, products, these;
  double total = 0;
  for (auto _ : state) {
    these.clear();
    for (int round = 0; round < kPairedRounds; ++round) {
      double t0 = thread_seconds();
      if constexpr (Reuse) {
        preset.run(layer, Budget::ratio(0.25), out, ws);
        these.push_back(thread_seconds() - t0);
        benchmark::DoNotOptimize(out.heads.data());
      } else {
        auto result = preset.run(layer, Budget::ratio(0.25));
        these.push_back(thread_seconds() - t0);
        benchmark::DoNotOptimize(result.heads.data());
      }
      t0 = thread_seconds();
      gemm_pass(layer, logits);
      products.push_back(thread_seconds() - t0);
    }
    calls.insert(calls.end(), these.begin(), these.end());
    const double median_call = median_of(these);
    total += median_call;
    state.SetIterationTime(median_call);
  }
  set_layer_counters(state, n, total / double(state.iterations()));
  const auto [call_min, call_max] = std::minmax_element(calls.begin(), calls.end());
  const auto [product_min, product_max] = std::minmax_element(products.begin(), products.end());
  state.counters["x_gemm_paired"] = median_of(calls) / median_of(products);
  state.counters["call_ms"] = median_of(calls) * 1e3;
  state.counters["product_ms"] = median_of(products) * 1e3;
  state.counters["x_gemm_best"] = *call_min / *product_min;
  state.counters["spread"] = *call_max / *call_min;
  state.counters["gemm_spread"] = *product_max / *product_min;
}

/// The fresh memory a one-shot run() allocates for its result: 2 · Hkv matrices of (n/4, d) floats,
/// resized as run() resizes them, then written once, as run() fills them; freed outside the timed part.
/// BM_Pipeline pays this, BM_PipelineReuse does not. Iteration time: allocation + first write.
/// Counters: prep_ms (the allocation), first_write_ms (the first write of every byte: the page faults
/// of fresh memory), rewrite_ms (the same write again: the plain cost of writing the bytes),
/// window_buffer_ms (allocation + first write of one (n, 128) block, the window workspace's size).
void BM_FreshResultMemory(benchmark::State& state) {
  const Index n = state.range(0), H = 8, d = 128;
  double prep = 0, first = 0, again = 0, window = 0;
  const auto write_all = [](std::vector<RowMatrix<float>>& ms, float value) {
    for (auto& x : ms) x.setConstant(value);
    benchmark::ClobberMemory();
  };
  for (auto _ : state) {
    std::vector<RowMatrix<float>> result(static_cast<std::size_t>(2 * H));
    std::vector<RowMatrix<float>> buffer(1);
    const double t0 = thread_seconds();
    for (auto& x : result) x.resize(n / 4, d);
    const double t1 = thread_seconds();
    write_all(result, 1.0f);
    const double t2 = thread_seconds();
    write_all(result, 2.0f);
    const double t3 = thread_seconds();
    buffer[0].resize(n, 128);
    write_all(buffer, 1.0f);
    const double t4 = thread_seconds();
    benchmark::DoNotOptimize(result.data());
    benchmark::DoNotOptimize(buffer.data());
    prep += t1 - t0;
    first += t2 - t1;
    again += t3 - t2;
    window += t4 - t3;
    state.SetIterationTime(t2 - t0);
  }
  const double iters = double(state.iterations());
  set_layer_counters(state, n, (prep + first) / iters);
  state.counters["MB"] = double(2 * H * (n / 4) * d) * sizeof(float) / 1e6;
  state.counters["prep_ms"] = prep / iters * 1e3;
  state.counters["first_write_ms"] = first / iters * 1e3;
  state.counters["rewrite_ms"] = again / iters * 1e3;
  state.counters["window_buffer_ms"] = window / iters * 1e3;
}

/// The same pipeline with Arguments::threads = range(1), wall time. speedup = best wall time of
/// threads = 1 / best wall time of threads = range(1), each over three runs taken alternately before
/// the timed iterations (so both sides have the same number of samples and see the same machine
/// state; the timed iterations only give the benchmark its time).
/// speedup_reuse: the same ratio for run(layer, ratio, out, workspace) with each side's own result and
/// workspace kept from a first untimed call, an engine's steady state. The one-shot ratio includes the
/// fresh result's page faults, whose cost depends on the allocator's state when the benchmark starts.
/// steal_ms: the machine's steal time (steal_seconds) over the
/// 14 calls that give both ratios; well above 0, the second vCPU was not always there.
template <class Preset>
void BM_PipelineThreads(benchmark::State& state) {
  const Index n = state.range(0), threads = state.range(1);
  const auto layer = layer_of(n).view();
  typename Preset::Arguments serial_args, threaded_args;
  serial_args.threads = 1;
  threaded_args.threads = threads;
  const Preset serial_preset(serial_args), preset(threaded_args);
  const auto wall_of = [&](const Preset& p) {
    const double t0 = wall_seconds();
    auto r = p.run(layer, Budget::ratio(0.25));
    benchmark::DoNotOptimize(r.heads.data());
    return wall_seconds() - t0;
  };
  const double steal0 = steal_seconds();
  double serial = 1e30, best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    serial = std::min(serial, wall_of(serial_preset));
    best = std::min(best, wall_of(preset));
  }
  LayerResult<float> serial_out, out;
  Workspace<float> serial_ws, ws;
  const auto reuse_wall_of = [&](const Preset& p, LayerResult<float>& o, Workspace<float>& w) {
    const double t0 = wall_seconds();
    p.run(layer, Budget::ratio(0.25), o, w);
    benchmark::DoNotOptimize(o.heads.data());
    return wall_seconds() - t0;
  };
  reuse_wall_of(serial_preset, serial_out, serial_ws);  // first calls: allocate
  reuse_wall_of(preset, out, ws);
  double serial_reuse = 1e30, best_reuse = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    serial_reuse = std::min(serial_reuse, reuse_wall_of(serial_preset, serial_out, serial_ws));
    best_reuse = std::min(best_reuse, reuse_wall_of(preset, out, ws));
  }
  const double steal = steal_seconds() - steal0;
  for (auto _ : state) state.SetIterationTime(wall_of(preset));
  state.counters["steal_ms"] = steal * 1e3;
  state.counters["speedup"] = serial / best;
  state.counters["serial_ms"] = serial * 1e3;
  state.counters["speedup_reuse"] = serial_reuse / best_reuse;
  state.counters["serial_reuse_ms"] = serial_reuse * 1e3;
}

/// layer_sizes with one iteration (of kPairedRounds rounds) per repetition.
void paired_sizes(benchmark::internal::Benchmark* b) { kvc::bench::layer_sizes(b->Iterations(1)); }

void thread_sizes(benchmark::internal::Benchmark* b) {
  b->Args({4096, 2})->Args({32768, 2})->UseManualTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_FreshResultMemory)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::StreamingLLM)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::KNorm)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SnapKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SelKVEvict)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SelKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SelKVMergeAll)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SnapKVGRKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Pipeline, kvc::SelKVEvictGRKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_PipelinePaged, kvc::SnapKV)->ArgsProduct({{4096, 32768}, {16}, {0, 1}})->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_PipelinePaged, kvc::SelKV)->ArgsProduct({{4096, 32768}, {16}, {0, 1}})->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_PipelineReuse, kvc::StreamingLLM)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_PipelineReuse, kvc::SnapKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_PipelineReuse, kvc::SelKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_PipelineReuse, kvc::SnapKVGRKV)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_PipelinePaired, kvc::SnapKV, true)->Apply(paired_sizes);
BENCHMARK_TEMPLATE(BM_PipelinePaired, kvc::SelKV, true)->Apply(paired_sizes);
BENCHMARK_TEMPLATE(BM_PipelinePaired, kvc::SnapKV, false)->Apply(paired_sizes);
BENCHMARK_TEMPLATE(BM_PipelinePaired, kvc::SelKV, false)->Apply(paired_sizes);
// The opt-in AMX bf16x3 window product (AttentionArguments::product), where the process can run it.
BENCHMARK_TEMPLATE2(BM_Pipeline, kvc::SnapKV, kvc::WindowProduct::amx_bf16x3)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE2(BM_Pipeline, kvc::SelKV, kvc::WindowProduct::amx_bf16x3)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE2(BM_PipelineReuse, kvc::SnapKV, kvc::WindowProduct::amx_bf16x3)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE2(BM_PipelineReuse, kvc::SelKV, kvc::WindowProduct::amx_bf16x3)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_PipelineThreads, kvc::SnapKV)->Apply(thread_sizes);
BENCHMARK_TEMPLATE(BM_PipelineThreads, kvc::SelKV)->Apply(thread_sizes);
BENCHMARK_TEMPLATE(BM_PipelineThreads, kvc::SnapKVGRKV)->Apply(thread_sizes);

BENCHMARK_MAIN();
