// A reused Pipeline::run(layer, budget, out, workspace) allocates nothing once the shapes repeat, for
// every preset except the GRKV ones (whose per-head matrices are still per call). Counted by wrapping
// glibc's malloc family for this binary (Eigen allocates through malloc, std containers through
// operator new -> malloc); not built with the sanitizers, which wrap malloc themselves.
#include <catch2/catch.hpp>

#include "synthetic_demo.hpp"

#include <kvcompress/kvcompress.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)
#include "support/test_presets.hpp"  // double and bfloat16 (kvc_test_presets)

#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);
}

namespace {
std::atomic<long> g_allocations{0};
void* volatile g_sink = nullptr;  // keeps the sanity check's allocations from being optimised away
}  // namespace

extern "C" {
void* malloc(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(n);
}
void* calloc(std::size_t c, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(c, n);
}
void* realloc(void* p, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(p, n);
}
void* memalign(std::size_t a, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(a, n);
}
void* aligned_alloc(std::size_t a, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_memalign(a, n);
}
int posix_memalign(void** p, std::size_t a, std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  *p = __libc_memalign(a, n);
  return *p ? 0 : 12;  // ENOMEM
}
void free(void* p) { __libc_free(p); }
}

namespace {

using kvc::Index;

/// The layer in element type T (converted from the float synthetic layer).
template <class T>
struct TypedLayer {
  kvc::demo::SyntheticLayer src;
  std::vector<T> keys, values, queries;
  explicit TypedLayer(Index n) : src(11, n) {
    const auto convert = [](const std::vector<float>& from, std::vector<T>& to) {
      to.reserve(from.size());
      for (float x : from) to.push_back(static_cast<T>(x));
    };
    convert(src.keys, keys);
    convert(src.values, values);
    convert(src.queries, queries);
  }
  kvc::LayerView<T> view() const {
    return {kvc::make_head_major<const T>(keys.data(), src.kv_heads, src.tokens, src.dim),
            kvc::make_head_major<const T>(values.data(), src.kv_heads, src.tokens, src.dim),
            kvc::make_head_major<const T>(queries.data(), src.query_heads, src.window, src.dim)};
  }
};

/// Allocations made by the second of two calls with the same result and workspace (the first fills
/// them), after a call with other budgets has left other sizes in them (so the scratch is resized
/// but not reallocated). Both reused results must equal the one-shot ones.
template <class Preset, class T, class B>
long allocations_of_reused_call(const kvc::LayerView<T>& layer, const B& budget) {
  const Preset preset;
  kvc::LayerResult<kvc::compute_t<T>> out;
  kvc::Workspace<kvc::compute_t<T>> ws;
  const auto check_equal = [&](const auto& fresh) {
    REQUIRE(fresh.heads.size() == out.heads.size());
    CHECK(fresh.shared_positions == out.shared_positions);
    CHECK(fresh.next_position == out.next_position);
    CHECK(fresh.window_product == out.window_product);
    for (std::size_t g = 0; g < out.heads.size(); ++g) {
      CHECK(fresh.heads[g].positions == out.heads[g].positions);
      CHECK(fresh.heads[g].keys == out.heads[g].keys);
      CHECK(fresh.heads[g].values == out.heads[g].values);
      CHECK(fresh.heads[g].bias == out.heads[g].bias);
      const auto &a = fresh.heads[g].diagnostics, &b = out.heads[g].diagnostics;
      CHECK(a.kept == b.kept);
      CHECK(a.evicted == b.evicted);
      CHECK(a.merged == b.merged);
      CHECK(a.dropped == b.dropped);
      CHECK(a.gate_mean == b.gate_mean);
    }
  };
  preset.run(layer, budget, out, ws);
  const long before = g_allocations.load();
  preset.run(layer, budget, out, ws);
  const long made = g_allocations.load() - before;
  check_equal(preset.run(layer, budget));
  // A smaller budget in between, then the same again: the same result as one-shot both times.
  preset.run(layer, kvc::Budget::tokens(std::max<Index>(1, layer.tokens() / 7)), out, ws);
  check_equal(preset.run(layer, kvc::Budget::tokens(std::max<Index>(1, layer.tokens() / 7))));
  preset.run(layer, budget, out, ws);
  check_equal(preset.run(layer, budget));
  return made;
}

/// `window_allowance`: allocations allowed to presets that run window attention (0 for float
/// arithmetic; for double, Eigen's product allocates its blocking buffer once per KV head).
template <class T>
void check_presets(Index n, long window_allowance = 0) {
  const TypedLayer<T> layer(n);
  const auto view = layer.view();
  const auto ratio = kvc::Budget::ratio(0.25);
  CHECK(allocations_of_reused_call<kvc::FullCache>(view, ratio) == 0);
  CHECK(allocations_of_reused_call<kvc::StreamingLLM>(view, ratio) == 0);
  CHECK(allocations_of_reused_call<kvc::KNorm>(view, ratio) == 0);
  CHECK(allocations_of_reused_call<kvc::SnapKV>(view, ratio) <= window_allowance);
  CHECK(allocations_of_reused_call<kvc::SelKVEvict>(view, ratio) <= window_allowance);
  CHECK(allocations_of_reused_call<kvc::SelKV>(view, ratio) <= window_allowance);
  CHECK(allocations_of_reused_call<kvc::SelKVMergeAll>(view, ratio) <= window_allowance);
  // Per-head budgets (different on every head), and a budget that keeps everything.
  std::vector<Index> per_head;
  for (Index g = 0; g < view.kv_heads(); ++g) per_head.push_back(n / 3 + 17 * g);
  CHECK(allocations_of_reused_call<kvc::SnapKV>(view, per_head) <= window_allowance);
  CHECK(allocations_of_reused_call<kvc::KNorm>(view, per_head) == 0);
  CHECK(allocations_of_reused_call<kvc::SelKV>(view, kvc::Budget::tokens(n)) <= window_allowance);
}

}  // namespace

TEST_CASE("the counter sees Eigen's and the containers' allocations", "[pipeline][alloc]") {
  const long before = g_allocations.load();
  {
    std::vector<int> v(100);
    g_sink = v.data();
    kvc::Vector<float> x = kvc::Vector<float>::Zero(100);
    g_sink = x.data();
    CHECK(v.size() + std::size_t(x.size()) == 200);
  }
  CHECK(g_allocations.load() - before == 2);
}

TEST_CASE("a reused run allocates nothing (float cache)", "[pipeline][alloc]") { check_presets<float>(1024); }

TEST_CASE("a reused run allocates nothing (half and bfloat16 caches)", "[pipeline][alloc]") {
  check_presets<Eigen::half>(768);
  check_presets<Eigen::bfloat16>(768);
}

TEST_CASE("a reused run allocates nothing but Eigen's product buffers (double cache)", "[pipeline][alloc]") {
  check_presets<double>(512, /*window_allowance=*/8);  // one per KV head
}

TEST_CASE("policy scratch is not part of the value", "[pipeline][alloc]") {
  const TypedLayer<float> layer(512);
  kvc::LayerResult<float> out;
  kvc::Workspace<float> ws;
  kvc::SelKV{}.run(layer.view(), kvc::Budget::ratio(0.25), out, ws);
  REQUIRE(!ws.selection.scratch->worker.empty());
  REQUIRE(!ws.routing[0].scratch->dots.empty());
  REQUIRE(ws.merged.size() == 8);  // one per KV head
  REQUIRE(ws.merged[0].scratch->last.size() > 0);
  CHECK(ws.merged[0].keys.size() == 0);  // the result's storage went back to the result
  // A copy has the value and no scratch; a copy assignment keeps the target's own scratch.
  const kvc::Selection<float> copy = ws.selection;
  CHECK(copy.kept == ws.selection.kept);
  CHECK(copy.scratch->worker.empty());
  kvc::Routing r = ws.routing[0];
  CHECK(r.target == ws.routing[0].target);
  CHECK(r.scratch->dots.empty());
  kvc::Routing other;
  other.scratch->dots.assign(3, 1.0f);
  other = ws.routing[0];
  CHECK(other.target == ws.routing[0].target);
  CHECK(other.scratch->dots.size() == 3);
  // Workspace::bytes counts the scratch.
  const std::size_t held = ws.bytes();
  ws.selection.scratch->proposed.clear();
  ws.selection.scratch->proposed.shrink_to_fit();
  CHECK(ws.bytes() < held);
}

TEST_CASE("a reused run of the merging presets allocates nothing (float cache)", "[pipeline][alloc]") {
  const TypedLayer<float> layer(1024);
  const auto view = layer.view();
  CHECK(allocations_of_reused_call<kvc::SnapKVNearestKey>(view, kvc::Budget::ratio(0.25)) == 0);
  CHECK(allocations_of_reused_call<kvc::SnapKVCAM>(view, kvc::Budget::ratio(0.25)) == 0);
  CHECK(allocations_of_reused_call<kvc::SnapKVCAM>(view, kvc::Budget::ratio(0.1)) == 0);
}
