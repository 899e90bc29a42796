// DecodingCompressor (decoding.hpp) in a decode loop over an engine-like cache: it compresses exactly
// when due, each compression equals Pipeline::run of the same cache with the forced tokens, the first
// and newest entries survive, positions and bias travel, and bad arguments are errors.
#include <catch2/catch.hpp>

#include <kvcompress/decoding.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/result.hpp>
#include "presets_compiled.hpp"  // float and float16 presets compiled once (kvc_cli_methods)

#include "support/random.hpp"
#include "support/result_checks.hpp"

#include <algorithm>
#include <random>
#include <vector>

namespace {

using kvc::Index;

/// A cache as an engine keeps it: [H][capacity][d] keys and values, [H][capacity] positions and bias,
/// n entries per head, and a ring of the last W decoded queries [Hq][W][d].
struct Cache {
  static constexpr Index H = 2, Hq = 4, d = 8, W = 4, capacity = 256;
  std::vector<float> K = std::vector<float>(H * capacity * d), V = K, Q = std::vector<float>(Hq * W * d);
  std::vector<Index> pos = std::vector<Index>(H * capacity);
  std::vector<float> bias = std::vector<float>(H * capacity);
  Index n = 0, next = 0;
  std::mt19937_64 rng;
  std::normal_distribution<float> N;

  explicit Cache(std::uint64_t seed) : rng(kvc::test::make_rng(seed)) {}

  void append() {  // one decoded token: its key, value and query
    REQUIRE(n < capacity);
    for (Index g = 0; g < H; ++g) {
      for (Index c = 0; c < d; ++c) {
        K[(g * capacity + n) * d + c] = N(rng);
        V[(g * capacity + n) * d + c] = N(rng);
      }
      pos[g * capacity + n] = next;
      bias[g * capacity + n] = 0.0f;
    }
    for (Index h = 0; h < Hq; ++h) {  // the last W queries, oldest first: shift, then the new row
      float* rows = Q.data() + h * W * d;
      std::copy(rows + d, rows + W * d, rows);
      for (Index c = 0; c < d; ++c) rows[(W - 1) * d + c] = N(rng);
    }
    ++n;
    ++next;
  }

  kvc::LayerView<float> view() const {
    kvc::LayerView<float> v;
    v.keys = {K.data(), H, n, d, capacity * d, d};
    v.values = {V.data(), H, n, d, capacity * d, d};
    v.queries = kvc::make_head_major<const float>(Q.data(), Hq, W, d);
    v.positions = {pos.data(), H, n, capacity};
    v.bias = {bias.data(), H, n, capacity};
    return v;
  }

  void write_back(const kvc::LayerResult<float>& r) {
    const auto lengths = kvc::compact_into(r, kvc::TensorView<float>{K.data(), H, r.max_size(), d, capacity * d, d},
                                           kvc::TensorView<float>{V.data(), H, r.max_size(), d, capacity * d, d});
    kvc::compact_positions_into(r, pos.data(), capacity, capacity);
    kvc::compact_bias_into(r, bias.data(), capacity, capacity);
    REQUIRE(std::all_of(lengths.begin(), lengths.end(), [&](Index l) { return l == lengths[0]; }));
    n = lengths[0];
    next = r.next_position;
  }
};

template <class Preset>
void decode_loop(const kvc::DecodingArguments& args, Index prompt, Index steps, std::uint64_t seed) {
  Cache c(seed);
  for (Index t = 0; t < prompt; ++t) c.append();
  kvc::DecodingCompressor<Preset> dc(Preset{}, args);
  // The pipeline it runs: the preset with at least `sinks` and `recent` forced.
  typename Preset::Arguments forced;
  forced.selector.sinks = std::max(forced.selector.sinks, args.sinks);
  forced.selector.recent = std::max(forced.selector.recent, args.recent);
  const Preset reference(forced);
  kvc::LayerResult<float> out;
  kvc::Workspace<float> ws;
  Index since = 0, compressions = 0, peak = 0;
  for (Index t = 0; t < steps; ++t) {
    c.append();
    peak = std::max(peak, c.n);
    const bool due = (args.max_size > 0 && c.n > args.max_size) ||
                     (args.every > 0 && since + 1 >= args.every && c.n > args.target_size);
    INFO("step " << t << " entries " << c.n);
    const kvc::LayerView<float> view = c.view();
    REQUIRE(dc.step(view, out, ws) == due);
    if (!due) {
      ++since;
      continue;
    }
    since = 0;
    ++compressions;
    kvc::test::check_identical(out, reference.run(view, kvc::Budget::tokens(args.target_size)));
    for (const auto& h : out.heads) {
      REQUIRE(static_cast<Index>(h.positions.size()) == std::min(args.target_size, c.n));
      for (Index i = 0; i < args.sinks; ++i) CHECK(h.positions[static_cast<std::size_t>(i)] == c.pos[i]);
      for (Index i = 0; i < args.recent; ++i)
        CHECK(h.positions[h.positions.size() - 1 - static_cast<std::size_t>(i)] == c.next - 1 - i);
      CHECK(std::is_sorted(h.positions.begin(), h.positions.end()));
    }
    CHECK(out.next_position == c.next);
    c.write_back(out);
  }
  CHECK(dc.compressions() == compressions);
  CHECK(compressions > 0);
  if (args.max_size > 0) CHECK(peak <= args.max_size + 1);  // compressed as soon as it passes max_size
}

}  // namespace

TEST_CASE("DecodingCompressor compresses when the cache passes max_size, as Pipeline::run would", "[decoding]") {
  INFO("seed " << kvc::test::test_seed());
  kvc::DecodingArguments a;
  a.max_size = 48;
  a.target_size = 32;
  a.sinks = 2;
  a.recent = 6;
  decode_loop<kvc::SnapKV>(a, 40, 100, 1);
  decode_loop<kvc::SelKV>(a, 40, 100, 2);        // merging: the kept entries' bias adds to the stored bias
  decode_loop<kvc::SnapKVGRKV>(a, 40, 60, 3);    // GRKV's ridge re-fit on a cache compressed before
  decode_loop<kvc::StreamingLLM>(a, 10, 80, 4);  // the prompt below target_size
}

TEST_CASE("DecodingCompressor compresses every k steps above the target", "[decoding]") {
  kvc::DecodingArguments a;
  a.every = 16;
  a.target_size = 24;
  a.sinks = 4;
  a.recent = 8;
  decode_loop<kvc::SnapKV>(a, 20, 90, 5);
  a.max_size = 40;  // both rules
  decode_loop<kvc::SelKV>(a, 30, 90, 6);
}

TEST_CASE("DecodingCompressor rejects arguments it cannot honour", "[decoding][errors]") {
  using Catch::Matchers::Contains;
  const auto make = [](kvc::DecodingArguments a) { return kvc::DecodingCompressor<kvc::SnapKV>(kvc::SnapKV{}, a); };
  kvc::DecodingArguments a;
  a.max_size = 10;
  a.target_size = 0;
  CHECK_THROWS_WITH(make(a), Contains("target_size must be >= 1"));
  a.target_size = 20;
  CHECK_THROWS_WITH(make(a), Contains("max_size (10) must be >= target_size (20)"));
  a.max_size = 0;
  CHECK_THROWS_WITH(make(a), Contains("needs max_size or every"));
  a.every = 4;
  a.sinks = 16;
  a.recent = 8;
  CHECK_THROWS_WITH(make(a), Contains("must fit in target_size"));
  a.sinks = 0;
  a.recent = -1;
  CHECK_THROWS_WITH(make(a), Contains(">= 0"));
  a.recent = 2;
  a.sinks = 1;  // ThresholdSelect has no sinks to force
  CHECK_THROWS_WITH(kvc::DecodingCompressor<kvc::Threshold>(kvc::Threshold{}, a), Contains("cannot keep"));
  a.sinks = 0;
  CHECK_NOTHROW(kvc::DecodingCompressor<kvc::Threshold>(kvc::Threshold{}, a));
  CHECK_NOTHROW(kvc::DecodingCompressor<kvc::FullCache>(kvc::FullCache{}, a));  // keeps every entry anyway

  // A bad cache is an error and `out` stays as it was.
  Cache c(9);
  for (int t = 0; t < 30; ++t) c.append();
  a.every = 1;
  a.sinks = 1;
  kvc::DecodingCompressor<kvc::SnapKV> dc(kvc::SnapKV{}, a);
  kvc::LayerResult<float> out;
  kvc::Workspace<float> ws;
  kvc::LayerView<float> bad = c.view();
  bad.positions = {c.pos.data(), c.H, c.n - 1, Cache::capacity};  // one position short
  CHECK_THROWS_AS(dc.step(bad, out, ws), kvc::error);
  CHECK(out.heads.empty());
  CHECK(dc.compressions() == 0);
}
