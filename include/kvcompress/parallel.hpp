// Threading policy: how the library runs independent per-KV-head work. Serial unless the caller asks.
//
// Policy (documented in README.md and docs/integration.md):
//   * The library never creates a thread unless the caller sets a thread count > 1
//     (`Pipeline::Arguments::threads`, or the `threads` argument of parallel_for).
//   * Work is split over KV heads only. Each head's result is computed by exactly one thread with the
//     same kernels and the same summation order as the serial run, and written to its own slot, so the
//     output is bit-identical for any thread count.
//   * Threads are plain std::thread, created for one call and joined before it returns (no pool, no
//     OpenMP, no global state). An exception thrown by the work is rethrown in the caller after all
//     threads have joined (the first one by index order of the worker that caught it).
//   * Engines that already run layers or sequences in parallel should leave threads = 1.
#pragma once

#include "kvcompress/core.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace kvc {

namespace detail {

/// parallel_for's threaded part, compiled once rather than once per work type: `body(ctx, i, worker)`
/// runs f(i, worker) for the f behind ctx. workers >= 2, count >= workers.
inline void parallel_run(Index count, Index workers, void* ctx, void (*body)(void*, Index, Index)) {
  std::atomic<Index> next{0};
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
  const auto work = [&](Index worker) {
    try {
      for (Index i = next.fetch_add(1); i < count; i = next.fetch_add(1)) body(ctx, i, worker);
    } catch (...) {
      errors[static_cast<std::size_t>(worker)] = std::current_exception();
      next.store(count);  // stop handing out work
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (Index w = 1; w < workers; ++w) pool.emplace_back(work, w);
  work(0);
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace detail

/// Runs f(i, worker) for every i in [0, count). With threads <= 1 (the default everywhere) it is a plain
/// loop on the calling thread, worker = 0. Otherwise min(threads, count) workers (the caller is worker 0,
/// the others are std::threads joined before return) take indices from a shared counter; `worker` in
/// [0, workers) lets f use per-worker scratch memory. f must only write state owned by index i (or by
/// its worker's scratch); results are then independent of the thread count and of scheduling.
template <class F>
void parallel_for(Index count, Index threads, F&& f) {
  if (count <= 0) return;
  const Index workers = std::min(std::max<Index>(threads, 1), count);
  if (workers == 1) {
    for (Index i = 0; i < count; ++i) f(i, Index{0});
    return;
  }
  using Fn = std::remove_reference_t<F>;
  detail::parallel_run(count, workers, const_cast<void*>(static_cast<const void*>(std::addressof(f))),
                       [](void* ctx, Index i, Index worker) { (*static_cast<Fn*>(ctx))(i, worker); });
}

/// Number of workers parallel_for will use for `count` items and a requested thread count.
inline Index worker_count(Index count, Index threads) {
  return std::max<Index>(1, std::min(std::max<Index>(threads, 1), count));
}

}  // namespace kvc
