// Allocation tracker for the benchmark binary only: wraps glibc's malloc family to count live and
// peak heap bytes (Eigen allocates through malloc, std containers through operator new → malloc).
#include <malloc.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void __libc_free(void*);
void* __libc_memalign(std::size_t, std::size_t);
}

namespace {
std::atomic<std::size_t> g_live{0};
std::atomic<std::size_t> g_peak{0};
std::atomic<std::size_t> g_count{0};  // allocations made (malloc, calloc, realloc, aligned), cumulative
std::atomic<std::size_t> g_total{0};  // their bytes, cumulative

void note_alloc(void* p) {
  if (!p) return;
  g_count.fetch_add(1, std::memory_order_relaxed);
  g_total.fetch_add(malloc_usable_size(p), std::memory_order_relaxed);
  const std::size_t now = g_live.fetch_add(malloc_usable_size(p), std::memory_order_relaxed) + malloc_usable_size(p);
  std::size_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
void note_free(void* p) {
  if (p) g_live.fetch_sub(malloc_usable_size(p), std::memory_order_relaxed);
}
}  // namespace

extern "C" {
void* malloc(std::size_t size) {
  void* p = __libc_malloc(size);
  note_alloc(p);
  return p;
}
void* calloc(std::size_t count, std::size_t size) {
  void* p = __libc_calloc(count, size);
  note_alloc(p);
  return p;
}
void* realloc(void* old, std::size_t size) {
  note_free(old);
  void* p = __libc_realloc(old, size);
  note_alloc(p ? p : (size == 0 ? nullptr : old));
  return p;
}
void free(void* p) {
  note_free(p);
  __libc_free(p);
}
int posix_memalign(void** out, std::size_t alignment, std::size_t size) {
  void* p = __libc_memalign(alignment, size);
  if (!p) return 12;  // ENOMEM
  note_alloc(p);
  *out = p;
  return 0;
}
void* aligned_alloc(std::size_t alignment, std::size_t size) {
  void* p = __libc_memalign(alignment, size);
  note_alloc(p);
  return p;
}
}

namespace kvc::bench {
std::size_t live_bytes() { return g_live.load(); }
std::size_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_live.load()); }
std::size_t allocation_count() { return g_count.load(); }
std::size_t allocated_bytes() { return g_total.load(); }
}  // namespace kvc::bench
