// Shared pieces of the benchmark suite: the Llama-3.1-8B layer shape, timers, the plain-GEMM baseline
// every stage is divided by (x_gemm), the peak-FMA and streaming-bandwidth probes, and the allocation
// tracker (alloc_tracker.cpp) that measures peak extra memory.
#pragma once

#include <benchmark/benchmark.h>

#include "../examples/synthetic_demo.hpp"

#include <kvcompress/kvcompress.hpp>
#include "presets_compiled.hpp"  // the presets compiled once (kvc_cli_methods)
#include <kvcompress/parallel.hpp>
#include <kvcompress/simd/kernels.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvc::bench {

// ---- timers -------------------------------------------------------------------------------------------
// Single-thread benchmarks report the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID) as their
// iteration time: the machine is shared, and CPU time is what a stage costs. Threaded benchmarks report
// wall time (the only time that shows a speedup).

inline double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Steal time of the whole machine so far (seconds, summed over its CPUs): time a virtual machine's
/// vCPUs were ready but the hypervisor ran something else, from /proc/stat's "cpu" line (in clock
/// ticks, 10 ms on Linux). 0 where there is no /proc/stat, and always 0 under a hypervisor that does
/// not account steal. A two-thread measurement that coincides with a jump of it did not have two cores.
inline double steal_seconds() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  unsigned long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (!(stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu") return 0.0;
#if defined(__linux__)
  const long ticks = ::sysconf(_SC_CLK_TCK);
#else
  const long ticks = 100;
#endif
  return double(steal) / double(ticks > 0 ? ticks : 100);
}

// ---- the caller's pages -------------------------------------------------------------------------------
// By default the layer (the caller's KV cache and queries) lives in the pages malloc gives it: 4 KiB
// pages on a machine whose transparent huge pages are in "madvise" mode. With the environment variable
// KVC_BENCH_HUGE_PAGES=1 the K, V and Q buffers (and the decode benchmark's caches and the streaming
// probes' buffers) are 2 MiB-aligned and advised MADV_HUGEPAGE before their first touch (CacheBuffer),
// as an engine that wants huge pages holds its cache (docs/performance.md); every layer-sized
// benchmark then reports huge_frac, the fraction of those bytes the kernel actually put in huge pages
// (from /proc/self/smaps). The library's own allocations are not affected either way.

inline bool huge_pages_requested() {
  static const bool on = [] {
    const char* v = std::getenv("KVC_BENCH_HUGE_PAGES");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

/// Bytes of [p, p + bytes) in mappings' AnonHugePages, by /proc/self/smaps (mappings that overlap the range
/// count with their whole AnonHugePages, clipped to the range's size): an estimate for one large buffer.
inline double huge_page_bytes(const void* p, std::size_t bytes) {
  std::ifstream smaps("/proc/self/smaps");
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p), last = first + bytes;
  std::string line;
  bool inside = false;
  double total = 0;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {  // a mapping's header line
      inside = lo < last && hi > first;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      total += std::min(double(bytes), 1024.0 * std::strtod(line.c_str() + 14, nullptr));
    }
  }
  return std::min(total, double(bytes));
}

/// Storage for the benchmark's caches (the layer's K, V and Q, the decode caches). By default a
/// std::vector, in the pages malloc gives it (on glibc a large block starts 16 bytes past a page
/// boundary, so the 512-byte rows straddle cache lines). With KVC_BENCH_HUGE_PAGES=1 (Linux) what
/// docs/performance.md advises an engine to do: 2 MiB-aligned memory advised MADV_HUGEPAGE before its
/// first touch, so that every byte of it, the ends included, can be in huge pages.
template <class T = float>
class CacheBuffer {
 public:
  explicit CacheBuffer(std::size_t count) : count_(count) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge_pages_requested() && count > 0) {
      constexpr std::size_t huge = std::size_t(1) << 21;
      mapped_ = (count * sizeof(T) + 2 * huge - 1) / huge * huge;
      void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p != MAP_FAILED) {
        base_ = p;
        const std::uintptr_t aligned = (reinterpret_cast<std::uintptr_t>(p) + huge - 1) & ~std::uintptr_t(huge - 1);
        data_ = reinterpret_cast<T*>(aligned);
        (void)::madvise(data_, (count * sizeof(T) + huge - 1) / huge * huge, MADV_HUGEPAGE);
        std::fill(data_, data_ + count, T(0.0f));
        return;
      }
      mapped_ = 0;
    }
#endif
    vec_.assign(count, T(0.0f));
    data_ = vec_.data();
  }
  CacheBuffer(const CacheBuffer&) = delete;
  CacheBuffer& operator=(const CacheBuffer&) = delete;
  ~CacheBuffer() {
#if defined(__linux__)
    if (base_) ::munmap(base_, mapped_);
#endif
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

 private:
  std::size_t count_ = 0, mapped_ = 0;
  void* base_ = nullptr;
  T* data_ = nullptr;
  std::vector<T> vec_;
};

// ---- the layer ------------------------------------------------------------------------------------------
/// Llama-3.1-8B: Hq 32, Hkv 8, d 128, W 32: the data of examples/synthetic_demo.hpp's SyntheticLayer
/// (seed 7), copied into CacheBuffers (while the copy runs the layer is held twice: 2 GiB of K and V
/// at n = 131072).
struct BenchLayer {
  Index kv_heads, query_heads, tokens, dim, window;
  CacheBuffer<float> keys, values, queries;
  explicit BenchLayer(const demo::SyntheticLayer& l)
      : kv_heads(l.kv_heads), query_heads(l.query_heads), tokens(l.tokens), dim(l.dim), window(l.window),
        keys(l.keys.size()), values(l.values.size()), queries(l.queries.size()) {
    std::copy(l.keys.begin(), l.keys.end(), keys.data());
    std::copy(l.values.begin(), l.values.end(), values.data());
    std::copy(l.queries.begin(), l.queries.end(), queries.data());
  }
  LayerView<float> view() const {
    return {make_head_major<const float>(keys.data(), kv_heads, tokens, dim),
            make_head_major<const float>(values.data(), kv_heads, tokens, dim),
            make_head_major<const float>(queries.data(), query_heads, window, dim)};
  }
};

/// The layer of n tokens, built once per n and cached.
inline const BenchLayer& layer_of(Index n) {
  static std::map<Index, std::unique_ptr<BenchLayer>> cache;
  auto& slot = cache[n];
  if (!slot) slot = std::make_unique<BenchLayer>(demo::SyntheticLayer(7, n));
  return *slot;
}

/// Fraction of a K and a V buffer of `bytes` each that is in huge pages (see huge_pages_requested).
inline double kv_huge_fraction(const void* keys, const void* values, std::size_t bytes) {
  return (huge_page_bytes(keys, bytes) + huge_page_bytes(values, bytes)) / (2.0 * double(bytes));
}

/// The same for the layer of n tokens.
inline double layer_huge_fraction(Index n) {
  const auto& l = layer_of(n);
  return kv_huge_fraction(l.keys.data(), l.values.data(), l.keys.size() * sizeof(float));
}

/// FLOPs of the unavoidable product of one layer: Hkv · (G·W × d × n) multiply-adds.
inline double layer_gemm_flops(const LayerView<float>& layer) {
  return 2.0 * double(layer.query_heads()) * double(layer.window()) * double(layer.head_dim()) *
         double(layer.tokens());
}

/// One plain Eigen product Qw·K^T for the whole layer: one (G·W, d)×(d, n) per KV head into `logits`
/// ((G·W, n), resized on first use).
inline void gemm_pass(const LayerView<float>& layer, RowMatrix<float>& logits) {
  const Index n = layer.tokens(), d = layer.head_dim();
  logits.resize(layer.group_size() * layer.window(), n);
  for (Index g = 0; g < layer.kv_heads(); ++g) {
    const RowMatrix<float> q = gather_group_queries<float>(layer, g);
    Eigen::Map<const RowMatrix<float>> k(layer.keys.row(g, 0), n, d);
    logits.noalias() = q * k.transpose();
    benchmark::DoNotOptimize(logits.data());
  }
}

/// CPU seconds of gemm_pass for the layer of n tokens, best of 5, measured once per n in this process:
/// the denominator of every x_gemm.
inline double gemm_seconds(Index n) {
  static std::map<Index, double> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  const auto layer = layer_of(n).view();
  RowMatrix<float> logits;
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = thread_seconds();
    gemm_pass(layer, logits);
    best = std::min(best, thread_seconds() - t0);
  }
  return cache[n] = best;
}

/// The median of `v` (the upper one of the middle two for an even count); 0 for an empty `v`.
inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

/// Peak single-core float FMA throughput (GFLOP/s) of the compiled architecture: 12 independent
/// accumulator chains of simd::fbatch FMAs, best of 5 (measured once per process).
inline double peak_gflops() {
  static double peak = 0.0;
  if (peak > 0.0) return peak;
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  constexpr int chains = 12;
  const long iters = 4'000'000;
  for (int rep = 0; rep < 5; ++rep) {
    B acc[chains];
#pragma GCC unroll 12
    for (int c = 0; c < chains; ++c) acc[c] = B(float(c) * 1e-3f);
    const B x(0.999999f), y(1e-7f);
    const double t0 = thread_seconds();
    for (long i = 0; i < iters; ++i)
#pragma GCC unroll 12
      for (int c = 0; c < chains; ++c) acc[c] = simd::fma(acc[c], x, y);  // fused at any -O
    const double t = thread_seconds() - t0;
    float sink = 0;
    for (int c = 0; c < chains; ++c) sink += simd::reduce_add<A>(acc[c]);
    benchmark::DoNotOptimize(sink);
    peak = std::max(peak, 2.0 * double(B::size) * chains * double(iters) / t * 1e-9);
  }
  return peak;
}

/// Runs `body` once untimed, then once per benchmark iteration, timed by the thread's CPU time, which
/// becomes the iteration's time (benchmarks registered with UseManualTime); returns the mean seconds per
/// iteration. The untimed call sizes (and first writes) whatever buffers the body keeps between calls,
/// so that no timed call pays for them, also when a repetition runs a single iteration
/// (--benchmark_min_time=0.001).
template <class F>
double time_iterations(benchmark::State& state, F&& body) {
  body();
  double total = 0;
  for (auto _ : state) {
    const double t0 = thread_seconds();
    body();
    const double t = thread_seconds() - t0;
    total += t;
    state.SetIterationTime(t);
  }
  return total / double(state.iterations());
}

/// Streaming read bandwidth (bytes/s) of one core: a SIMD sum over `bytes` of float data, best of 3 (in
/// huge pages when the layer is, see huge_pages_requested).
inline double stream_bytes_per_second(std::size_t bytes) {
  static std::map<std::size_t, double> cache;
  auto it = cache.find(bytes);
  if (it != cache.end()) return it->second;
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  CacheBuffer<float> buf(bytes / sizeof(float));  // in huge pages when the caches are
  std::fill(buf.data(), buf.data() + buf.size(), 1.0f);
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = thread_seconds();
    B a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    const std::size_t S = B::size;
    for (std::size_t i = 0; i + 4 * S <= buf.size(); i += 4 * S) {
      a0 += B::load_unaligned(&buf[i]);
      a1 += B::load_unaligned(&buf[i + S]);
      a2 += B::load_unaligned(&buf[i + 2 * S]);
      a3 += B::load_unaligned(&buf[i + 3 * S]);
    }
    const float sum = simd::reduce_add<A>(a0 + a1 + a2 + a3);
    benchmark::DoNotOptimize(sum);
    best = std::max(best, double(bytes) / (thread_seconds() - t0));
  }
  return cache[bytes] = best;
}

// ---- memory -----------------------------------------------------------------------------------------
// alloc_tracker.cpp wraps malloc/free (glibc) and keeps the live and peak byte counts.
std::size_t live_bytes();
std::size_t peak_bytes();
void reset_peak();  ///< peak := live
std::size_t allocation_count();  ///< allocations made so far (cumulative)
std::size_t allocated_bytes();   ///< their bytes (cumulative)

/// n = 4096, 32768, 131072 with manual (CPU or wall) time in milliseconds.
inline void layer_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMillisecond);
}

/// Registers the common counters of a layer-sized benchmark.
inline void set_layer_counters(benchmark::State& state, Index n, double seconds_per_iter) {
  state.counters["tokens/s"] = benchmark::Counter(double(n) / seconds_per_iter);
  state.counters["gemm_ms"] = gemm_seconds(n) * 1e3;
  state.counters["x_gemm"] = seconds_per_iter / gemm_seconds(n);
  if (huge_pages_requested()) state.counters["huge_frac"] = layer_huge_fraction(n);
}

/// False, with the benchmark marked as an error, when the window product P cannot run in this process
/// (the opt-in AMX product needs the CPU, the OS and the process's tile-data permission; see
/// simd::amx_bf16_available). The float FMA product always runs.
inline bool skip_unless_available(benchmark::State& state, WindowProduct P) {
  if (P != WindowProduct::amx_bf16x3 || simd::amx_bf16_available()) return true;
  state.SkipWithError("the AMX product cannot run in this process (CPU, OS or permission)");
  return false;
}

/// Evicts [p, p + bytes) from every cache level (clflush, x86-64 only; elsewhere a no-op that returns
/// false): the state a buffer is in when a pass over other memory ran since it was last touched.
inline bool evict_from_caches(const void* p, std::size_t bytes) {
#if defined(__SSE2__)
  const char* c = static_cast<const char*>(p);
  for (std::size_t i = 0; i < bytes; i += 64) _mm_clflush(c + i);
  if (bytes > 0) _mm_clflush(c + bytes - 1);
  _mm_mfence();
  return true;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

}  // namespace kvc::bench
