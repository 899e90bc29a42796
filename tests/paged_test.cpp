// Paged caches: views over a pool of blocks and a block table read exactly as the contiguous cache
// (every preset, float and half, both paged layouts, bit for bit), their checks, block-granular
// selection (TopBlocks) against a reference written from its definition, and compact_paged.
#include <catch2/catch.hpp>

#include <kvcompress/attention/decode_attention.hpp>
#include <kvcompress/decoding.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/result.hpp>
#include "presets_compiled.hpp"  // float and float16 presets compiled once (kvc_cli_methods)
#include "runner.hpp"
#include "support/test_presets.hpp"  // double and bfloat16 presets compiled once (kvc_test_presets)

#include "support/random.hpp"
#include "support/result_checks.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {

using kvc::Index;

/// One layer's cache three ways: contiguous [H][n][d], paged [blocks][b][H][d] and paged
/// [blocks][H][b][d], the pages in shuffled order, with spare pages in the pool.
template <class T>
struct PagedLayer {
  Index H, Hq, n, d, W, b, pool_blocks;
  std::vector<T> K, V, Q;               // contiguous
  std::vector<T> Kt, Vt, Kh, Vh;        // the two paged pools
  std::vector<std::int32_t> table;      // block k of the sequence is page table[k]
  std::vector<Index> pos;               // [H][n] stored positions (recompression), when used
  std::vector<kvc::compute_t<T>> bias;  // [H][n]
  std::vector<float> wo;                // [D][Hq·d] output projection (CriticalKV)
  bool stored = false;

  PagedLayer(Index H_, Index Hq_, Index n_, Index d_, Index W_, Index b_, std::uint64_t seed, bool stored_ = false)
      : H(H_), Hq(Hq_), n(n_), d(d_), W(W_), b(b_), stored(stored_) {
    auto rng = kvc::test::make_rng(seed);
    std::normal_distribution<float> N;
    const Index used = (n + b - 1) / b;
    pool_blocks = used + 5;
    K.resize(static_cast<std::size_t>(H * n * d));
    V.resize(K.size());
    Q.resize(static_cast<std::size_t>(Hq * W * d));
    for (auto* v : {&K, &V, &Q})
      for (auto& x : *v) x = static_cast<T>(N(rng));
    std::vector<std::int32_t> pages(static_cast<std::size_t>(pool_blocks));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    table.assign(pages.begin(), pages.begin() + used);
    const std::size_t pool = static_cast<std::size_t>(pool_blocks * b * H * d);
    Kt.assign(pool, T(0));
    Vt = Kt;
    Kh = Kt;
    Vh = Kt;
    for (Index g = 0; g < H; ++g)
      for (Index j = 0; j < n; ++j)
        for (Index c = 0; c < d; ++c) {
          const std::size_t src = static_cast<std::size_t>((g * n + j) * d + c);
          const Index page = table[static_cast<std::size_t>(j / b)], r = j % b;
          Kt[static_cast<std::size_t>(((page * b + r) * H + g) * d + c)] = K[src];
          Vt[static_cast<std::size_t>(((page * b + r) * H + g) * d + c)] = V[src];
          Kh[static_cast<std::size_t>(((page * H + g) * b + r) * d + c)] = K[src];
          Vh[static_cast<std::size_t>(((page * H + g) * b + r) * d + c)] = V[src];
        }
    pos.resize(static_cast<std::size_t>(H * n));
    bias.resize(pos.size());
    wo.resize(static_cast<std::size_t>(24 * Hq * d));
    for (auto& x : wo) x = N(rng);
    std::uniform_real_distribution<float> U(-0.5f, 0.5f);
    for (Index g = 0; g < H; ++g)
      for (Index j = 0; j < n; ++j) {
        pos[static_cast<std::size_t>(g * n + j)] = 2 * j + g;
        bias[static_cast<std::size_t>(g * n + j)] = U(rng);
      }
  }

  kvc::LayerView<T> with(kvc::TensorView<const T> k, kvc::TensorView<const T> v) const {
    kvc::LayerView<T> l{k, v, kvc::make_head_major<const T>(Q.data(), Hq, W, d)};
    l.output_projection = {wo.data(), 24, Hq * d, Hq * d};
    if (stored) {
      l.positions = {pos.data(), H, n, n};
      l.bias = {bias.data(), H, n, n};
    }
    return l;
  }
  kvc::LayerView<T> contiguous() const {
    return with(kvc::make_head_major<const T>(K.data(), H, n, d), kvc::make_head_major<const T>(V.data(), H, n, d));
  }
  kvc::LayerView<T> paged_token_major() const {
    return with(kvc::make_paged_token_major<const T>(Kt.data(), pool_blocks, b, H, d, table.data(), n),
                kvc::make_paged_token_major<const T>(Vt.data(), pool_blocks, b, H, d, table.data(), n));
  }
  kvc::LayerView<T> paged_head_major() const {
    return with(kvc::make_paged_head_major<const T>(Kh.data(), pool_blocks, H, b, d, table.data(), n),
                kvc::make_paged_head_major<const T>(Vh.data(), pool_blocks, H, b, d, table.data(), n));
  }
};

template <class Preset, class T>
void check_preset_paged(const PagedLayer<T>& c, const kvc::Budget& budget, const char* name) {
  INFO("preset " << name << ", block size " << c.b << ", W = " << c.W << (c.stored ? ", stored positions and bias" : ""));
  const Preset preset;
  const auto want = preset.run(c.contiguous(), budget);
  kvc::test::check_identical(preset.run(c.paged_token_major(), budget), want);
  kvc::test::check_identical(preset.run(c.paged_head_major(), budget), want);
}

template <class T>
void check_every_preset(const PagedLayer<T>& c, const kvc::Budget& budget) {
// With every prefill query as the window, only H2O (which needs them); the others run with W < n.
#define KVC_PAGED_CHECK(Preset)                                   \
  if ((c.W >= c.n) == std::is_same_v<Preset, kvc::H2O>) check_preset_paged<Preset>(c, budget, #Preset);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, Eigen::half>) {
    KVC_CLI_PRESETS(KVC_PAGED_CHECK)
  } else {
    KVC_TEST_PRESETS(KVC_PAGED_CHECK)
  }
#undef KVC_PAGED_CHECK
}

}  // namespace

TEST_CASE("paged views: rows, sub-ranges and runs follow the block table", "[paged]") {
  const PagedLayer<float> c(2, 4, 23, 4, 4, 5, 11);
  const auto tm = kvc::make_paged_token_major<const float>(c.Kt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
  const auto hm = kvc::make_paged_head_major<const float>(c.Kh.data(), c.pool_blocks, c.H, c.b, c.d, c.table.data(), c.n);
  for (Index g = 0; g < c.H; ++g)
    for (Index j = 0; j < c.n; ++j) {
      const Index page = c.table[static_cast<std::size_t>(j / c.b)], r = j % c.b;
      CHECK(tm.row(g, j) == c.Kt.data() + ((page * c.b + r) * c.H + g) * c.d);
      CHECK(hm.row(g, j) == c.Kh.data() + ((page * c.H + g) * c.b + r) * c.d);
      CHECK(tm.row(g, j)[1] == c.K[static_cast<std::size_t>((g * c.n + j) * c.d + 1)]);
    }
  const auto sub = tm.token_range(7, 12);
  CHECK(sub.tokens == 12);
  CHECK(sub.offset == 2);
  for (Index j = 0; j < 12; ++j) CHECK(sub.row(1, j) == tm.row(1, 7 + j));
  CHECK(sub.contiguous_from(0) == 3);  // rows 7, 8, 9 of the layer share a block
  CHECK(sub.contiguous(0, 3));
  CHECK_FALSE(sub.contiguous(0, 4));
  CHECK(tm.contiguous_from(20) == 3);  // the last, partial block
  const auto flat = kvc::make_head_major<const float>(c.K.data(), c.H, c.n, c.d);
  CHECK_FALSE(flat.paged());
  CHECK(flat.contiguous_from(5) == c.n - 5);
}

TEST_CASE("paged views: a bad block table or block geometry is an error, never a read", "[paged]") {
  PagedLayer<float> c(2, 4, 23, 4, 4, 5, 12);
  const kvc::SnapKV snap;
  const auto status = [&](const kvc::LayerView<float>& l) { return snap.validate(l, kvc::Budget::ratio(0.5)); };
  REQUIRE(status(c.paged_token_major()).is_ok());
  {
    auto l = c.paged_token_major();
    const std::int32_t saved = c.table[2];
    c.table[2] = static_cast<std::int32_t>(c.pool_blocks);
    const auto s = status(l);
    CHECK(s.code() == kvc::Status::Code::invalid_argument);
    CHECK_THAT(s.message(), Catch::Contains("block table entry 2") && Catch::Contains("outside [0, "));
    c.table[2] = -1;
    CHECK(status(l).code() == kvc::Status::Code::invalid_argument);
    c.table[2] = c.table[0];
    const auto dup = status(l);
    CHECK(dup.code() == kvc::Status::Code::aliasing);
    CHECK_THAT(dup.message(), Catch::Contains("appears twice"));
    c.table[2] = saved;
  }
  {
    auto l = c.paged_token_major();
    l.keys.block_size = 0;
    CHECK(status(l).code() == kvc::Status::Code::invalid_shape);
  }
  {
    auto l = c.paged_token_major();
    l.values.offset = c.b;
    CHECK(status(l).code() == kvc::Status::Code::invalid_shape);
  }
  {
    auto l = c.paged_token_major();
    l.keys.block_stride = c.b * c.H * c.d - 1;  // blocks overlap
    CHECK(status(l).code() == kvc::Status::Code::aliasing);
  }
  {
    auto l = c.paged_token_major();
    l.keys.token_stride = c.d;  // rows of two heads of a block overlap
    CHECK(status(l).code() == kvc::Status::Code::aliasing);
  }
  {
    auto l = c.paged_token_major();
    l.keys.num_blocks = Index(1) << 60;  // a pool beyond any address space
    CHECK(status(l).code() == kvc::Status::Code::invalid_shape);
  }
  {
    auto l = c.paged_token_major();  // a pool far larger than the table: its ids are checked sorted
    l.keys.num_blocks = Index(1) << 20;
    CHECK(status(l).is_ok());
    const std::int32_t saved = c.table[4];
    c.table[4] = c.table[1];
    CHECK(status(l).code() == kvc::Status::Code::aliasing);
    c.table[4] = saved;
  }
  {
    auto l = c.paged_token_major();
    l.keys.tokens = l.values.tokens = c.pool_blocks * c.b + 1;  // more tokens than the pool holds
    CHECK(status(l).code() == kvc::Status::Code::invalid_shape);
  }
  auto bad = c.paged_token_major();
  bad.keys.block_size = 0;
  CHECK_THROWS_AS(snap.run(bad, kvc::Budget::ratio(0.5)), kvc::error);
}

TEST_CASE("paged views: every preset gives the contiguous cache's result, bit for bit", "[paged]") {
  const kvc::Budget budget = kvc::Budget::ratio(0.3);
  SECTION("float, blocks of 7 (tiles span blocks), W = 8") { check_every_preset(PagedLayer<float>(2, 4, 300, 16, 8, 7, 21), budget); }
  SECTION("float, blocks of 16, every prefill query (H2O)") { check_every_preset(PagedLayer<float>(2, 4, 300, 16, 300, 16, 22), budget); }
  SECTION("float, stored positions and bias") { check_every_preset(PagedLayer<float>(2, 4, 300, 16, 8, 16, 23, true), budget); }
  SECTION("half, blocks of 7") { check_every_preset(PagedLayer<Eigen::half>(2, 4, 300, 16, 8, 7, 24), budget); }
  SECTION("double, blocks of 7") { check_every_preset(PagedLayer<double>(2, 4, 300, 16, 8, 7, 25), budget); }
  SECTION("bfloat16, blocks of 16") { check_every_preset(PagedLayer<Eigen::bfloat16>(2, 4, 300, 16, 8, 16, 26), budget); }
}

TEST_CASE("paged views: window logits, probabilities and outputs are the contiguous cache's, bit for bit",
          "[paged]") {
  const PagedLayer<double> c(2, 4, 300, 16, 8, 7, 27, true);
  const auto flat = c.contiguous(), paged = c.paged_head_major();
  const kvc::AttentionArguments args;
  for (Index g = 0; g < c.H; ++g) {
    kvc::RowMatrix<double> a, b;
    kvc::window_probabilities<double>(flat, g, args, a);
    kvc::window_probabilities<double>(paged, g, args, b);
    CHECK(a == b);
    kvc::window_outputs<double>(flat, g, args, a);
    kvc::window_outputs<double>(paged, g, args, b);
    CHECK(a == b);
  }
  const PagedLayer<float> f(2, 4, 300, 16, 8, 7, 28, true);
  for (Index g = 0; g < f.H; ++g) {
    kvc::RowMatrix<float> a, b;
    kvc::window_outputs<float>(f.contiguous(), g, args, a);
    kvc::window_outputs<float>(f.paged_token_major(), g, args, b);
    CHECK(a == b);
  }
}

TEST_CASE("paged views: the tool's compositions and threads read them as the contiguous cache", "[paged]") {
  const PagedLayer<float> c(2, 4, 300, 16, 8, 16, 31);
  kvc::cli::BudgetSpec spec;
  spec.budget = kvc::Budget::ratio(0.25);
  for (const char* method : {"snapkv", "selkv", "grkv", "adakv-snapkv", "chunkkv"}) {
    INFO(method);
    kvc::cli::MethodOptions o;
    if (std::string(method) == "snapkv" || std::string(method) == "selkv") o.block_size = 16;
    for (const Index threads : {Index(1), Index(2)}) {
      const auto runner = kvc::cli::make_runner<float>(method, o, threads);
      kvc::test::check_identical(runner->run(c.paged_token_major(), spec), runner->run(c.contiguous(), spec));
    }
  }
}

TEST_CASE("paged views: decode attention reads them as the contiguous cache", "[paged]") {
  for (const Index b : {Index(5), Index(16), Index(1000)}) {
    const PagedLayer<float> c(2, 4, 2100, 16, 1, b, 41);  // > one 1024-key decode tile
    auto rng = kvc::test::make_rng(42);
    std::normal_distribution<float> N;
    kvc::RowMatrix<float> q(c.Hq, c.d), want, got;
    for (Index i = 0; i < q.size(); ++i) q.data()[i] = N(rng);
    const kvc::BiasView<float> no_bias{};
    const kvc::AttentionArguments args;
    const auto flat = c.contiguous(), paged = c.paged_head_major();
    kvc::decode_attention<float>(q, flat.keys, flat.values, no_bias, args, want);
    kvc::decode_attention<float>(q, paged.keys, paged.values, no_bias, args, got);
    CHECK(got == want);
    const std::vector<Index> lengths = {c.n - 3, c.n - 1000};
    kvc::decode_attention<float>(q, flat.keys, flat.values, no_bias, args, lengths, want);
    kvc::decode_attention<float>(q, paged.keys, paged.values, no_bias, args, lengths, got);
    CHECK(got == want);
  }
}

namespace {

/// TopBlocks from its definition (selector/top_blocks.hpp), in double, without pooling: block score =
/// mean over heads of the mean (or max) of the block's scores; forced blocks, then the best blocks
/// that fit.
std::vector<Index> reference_blocks(const std::vector<kvc::Vector<float>>& s, Index m, Index b, Index sinks,
                                    Index recent, bool use_max) {
  const Index H = static_cast<Index>(s.size()), n = s[0].size(), nb = (n + b - 1) / b;
  if (m >= n) {
    std::vector<Index> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), Index(0));
    return all;
  }
  const Index fs = std::min(sinks, m), fr = std::max<Index>(0, std::min(recent, m - fs));
  std::vector<double> score(static_cast<std::size_t>(nb), 0.0);
  for (Index k = 0; k < nb; ++k)
    for (Index g = 0; g < H; ++g) {
      double acc = use_max ? -1e300 : 0.0;
      const Index e = std::min(n, (k + 1) * b);
      for (Index j = k * b; j < e; ++j) acc = use_max ? std::max(acc, double(s[g][j])) : acc + s[g][j];
      score[k] += (use_max ? acc : acc / double(e - k * b)) / H;
    }
  std::vector<bool> keep(static_cast<std::size_t>(nb), false);
  Index left = m;
  for (Index k = 0; k < nb; ++k) {
    const bool forced = k * b < fs || (fr > 0 && (k + 1) * b > n - fr);
    if (forced) {
      keep[k] = true;
      left -= std::min(n, (k + 1) * b) - k * b;
    }
  }
  std::vector<Index> order;
  for (Index k = 0; k < nb; ++k)
    if (!keep[k]) order.push_back(k);
  std::stable_sort(order.begin(), order.end(), [&](Index x, Index y) { return score[x] > score[y]; });
  for (Index k : order) {
    const Index size = std::min(n, (k + 1) * b) - k * b;
    if (size <= left) {
      keep[k] = true;
      left -= size;
    }
  }
  if (std::find(keep.begin(), keep.end(), true) == keep.end()) keep[order.front()] = true;  // never nothing
  std::vector<Index> kept;
  for (Index j = 0; j < n; ++j)
    if (keep[j / b]) kept.push_back(j);
  return kept;
}

}  // namespace

TEST_CASE("TopBlocks keeps whole blocks: forced ones, then the best that fit", "[paged][selector]") {
  auto rng = kvc::test::make_rng(51);
  std::normal_distribution<float> N;
  for (int trial = 0; trial < 60; ++trial) {
    const Index H = 1 + trial % 3, n = 20 + trial * 7, b = 1 + trial % 9 + (trial % 10 == 3 ? 40 : 0);
    const Index m = 1 + (trial * 13) % n, sinks = trial % 4 == 1 ? 0 : trial % 4, recent = trial % 4 == 1 ? 0 : (trial * 5) % 11;
    const bool use_max = trial % 2 == 1;
    INFO("trial " << trial << ": H " << H << " n " << n << " b " << b << " m " << m << " sinks " << sinks << " recent " << recent);
    std::vector<kvc::Vector<float>> s(static_cast<std::size_t>(H), kvc::Vector<float>(n));
    for (auto& v : s)
      for (Index j = 0; j < n; ++j) v[j] = N(rng);
    kvc::TopBlocks<> sel;
    sel.args.block_size = b;
    sel.args.sinks = sinks;
    sel.args.recent = recent;
    sel.args.block_score = use_max ? kvc::BlockScore::max : kvc::BlockScore::mean;
    REQUIRE(sel.validate().is_ok());
    kvc::Selection<float> out;
    sel.select(s, std::vector<Index>(static_cast<std::size_t>(H), m), out);
    CHECK(out.shared);
    const auto want = reference_blocks(s, m, b, sinks, recent, use_max);
    for (Index g = 0; g < H; ++g) {
      CHECK(out.kept[static_cast<std::size_t>(g)] == want);
      CHECK(static_cast<Index>(out.kept[g].size() + out.evicted[g].size()) == n);
    }
  }
  {  // a budget below one block, nothing forced: the best block, whole (never an empty cache)
    std::vector<kvc::Vector<float>> s(2, kvc::Vector<float>::Zero(40));
    s[0][20] = 5.0f;
    s[1][21] = 1.0f;
    kvc::TopBlocks<> sel;
    kvc::Selection<float> out;
    sel.select(s, {5, 5}, out);
    std::vector<Index> want(16);
    std::iota(want.begin(), want.end(), Index(16));
    CHECK(out.kept[0] == want);
    CHECK(out.kept[1] == want);
    CHECK(reference_blocks(s, 5, 16, 0, 0, false) == want);
  }
  kvc::TopBlocks<> bad;
  bad.args.block_size = 0;
  CHECK_FALSE(bad.validate().is_ok());
}

TEST_CASE("compact_paged: whole blocks stay in their pages and the evicted pages are freed", "[paged]") {
  for (const bool stored : {false, true}) {
    INFO((stored ? "stored positions" : "positions 0..n-1"));
    PagedLayer<float> c(2, 4, 203, 16, 8, 16, 61, stored);
    const std::vector<std::int32_t> before = c.table;
    kvc::cli::MethodOptions o;
    o.block_size = 16;
    o.sinks = 4;
    o.recent = 16;
    kvc::cli::BudgetSpec spec;
    spec.budget = kvc::Budget::tokens(100);
    const auto runner = kvc::cli::make_runner<float>("selkv", o, 1);  // merges into kept rows
    const auto r = runner->run(c.paged_token_major(), spec);
    auto K = kvc::make_paged_token_major<float>(c.Kt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
    auto V = kvc::make_paged_token_major<float>(c.Vt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
    const kvc::PositionView stored_pos = stored ? kvc::PositionView{c.pos.data(), c.H, c.n, c.n} : kvc::PositionView{};
    const std::vector<float> untouched_pool = c.Kt;
    const auto pc = kvc::compact_paged(r, K, V, c.table.data(), stored_pos);
    CHECK_FALSE(pc.moved);
    const Index m = r.max_size();
    CHECK(m <= 100);
    CHECK(pc.blocks == (m + 15) / 16);
    CHECK(pc.lengths == std::vector<Index>(2, m));
    // The table holds the kept pages in order; the freed ones are the others, each once.
    std::vector<std::int32_t> all(c.table.begin(), c.table.begin() + pc.blocks);
    all.insert(all.end(), pc.freed.begin(), pc.freed.end());
    std::vector<std::int32_t> sorted_before(before.begin(), before.end());
    std::sort(all.begin(), all.end());
    std::sort(sorted_before.begin(), sorted_before.end());
    CHECK(all == sorted_before);
    // Every kept entry is still in its own row of its own page, and now holds the result.
    K.tokens = V.tokens = m;
    for (Index g = 0; g < c.H; ++g)
      for (Index i = 0; i < m; ++i) {
        const Index p = r.heads[g].positions[static_cast<std::size_t>(i)];
        const Index j = stored ? (p - g) / 2 : p;  // the entry's index in the layer
        const Index page = before[static_cast<std::size_t>(j / c.b)];
        CHECK(K.row(g, i) == c.Kt.data() + ((page * c.b + j % c.b) * c.H + g) * c.d);
        for (Index col = 0; col < c.d; ++col) {
          CHECK(K.row(g, i)[col] == r.heads[g].keys(i, col));
          CHECK(V.row(g, i)[col] == r.heads[g].values(i, col));
        }
      }
  }
}

TEST_CASE("compact_paged: a token-granular result is compacted into the first pages, the rest freed", "[paged]") {
  PagedLayer<float> c(2, 4, 203, 16, 8, 16, 71);
  const std::vector<std::int32_t> before = c.table;
  const auto r = kvc::AdaKVSnapKV{}.run(c.paged_token_major(), kvc::Budget::tokens(50));  // ragged
  auto K = kvc::make_paged_token_major<float>(c.Kt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
  auto V = kvc::make_paged_token_major<float>(c.Vt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
  const auto pc = kvc::compact_paged(r, K, V, c.table.data());
  CHECK(pc.moved);
  const Index m = r.max_size();
  CHECK(pc.blocks == (m + 15) / 16);
  CHECK(std::vector<std::int32_t>(c.table.begin(), c.table.begin() + pc.blocks) ==
        std::vector<std::int32_t>(before.begin(), before.begin() + pc.blocks));
  CHECK(pc.freed == std::vector<std::int32_t>(before.begin() + pc.blocks, before.end()));
  for (Index g = 0; g < c.H; ++g) {
    CHECK(pc.lengths[static_cast<std::size_t>(g)] == r.heads[g].size());
    for (Index i = 0; i < r.heads[g].size(); ++i)
      for (Index col = 0; col < c.d; ++col) CHECK(K.row(g, i)[col] == r.heads[g].keys(i, col));
  }
}

TEST_CASE("compact_paged: bad input throws and changes nothing", "[paged]") {
  PagedLayer<float> c(2, 4, 64, 8, 8, 16, 81);
  const auto r = kvc::SnapKV{}.run(c.paged_token_major(), kvc::Budget::tokens(20));
  const std::vector<std::int32_t> table = c.table;
  const std::vector<float> pool = c.Kt;
  auto K = kvc::make_paged_token_major<float>(c.Kt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
  auto V = kvc::make_paged_token_major<float>(c.Vt.data(), c.pool_blocks, c.b, c.H, c.d, c.table.data(), c.n);
  std::vector<std::int32_t> other = c.table;
  CHECK_THROWS_WITH(kvc::compact_paged(r, K, V, other.data()), Catch::Contains("over block_table"));
  auto flat = kvc::make_head_major<float>(c.K.data(), c.H, c.n, c.d);
  CHECK_THROWS_AS(kvc::compact_paged(r, flat, flat, c.table.data()), kvc::error);
  std::vector<Index> wrong(static_cast<std::size_t>(c.H * c.n), 0);
  for (Index j = 0; j < c.H * c.n; ++j) wrong[static_cast<std::size_t>(j)] = 1000 + j;
  CHECK_THROWS_WITH(kvc::compact_paged(r, K, V, c.table.data(), kvc::PositionView{wrong.data(), c.H, c.n, c.n}),
                    Catch::Contains("not among the stored positions"));
  CHECK_THROWS_WITH(kvc::compact_paged(r, K, V, c.table.data(), kvc::PositionView{wrong.data(), c.H, c.n - 1, c.n}),
                    Catch::Contains("do not describe the cache"));
  auto huge = r;
  huge.heads[0].values(0, 0) = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(kvc::compact_paged(huge, K, V, c.table.data()), kvc::error);
  CHECK(c.table == table);
  CHECK(c.Kt == pool);
}

TEST_CASE("DecodingCompressor over a paged cache: block-granular eviction frees pages as it decodes", "[paged][decoding]") {
  // A decode loop as docs/integration.md writes it: append into the page of the newest entry, compress
  // when due, hand the freed pages back.
  constexpr Index H = 2, Hq = 4, d = 8, W = 4, b = 8, pages = 12;
  std::vector<float> Kp(static_cast<std::size_t>(pages * b * H * d)), Vp(Kp.size()), Q(static_cast<std::size_t>(Hq * W * d));
  std::vector<std::int32_t> table, free_list(pages);
  std::iota(free_list.rbegin(), free_list.rend(), 0);
  constexpr Index cap = pages * b;
  std::vector<Index> pos(static_cast<std::size_t>(H * cap));  // [H][cap] each entry's position
  std::vector<float> bias(static_cast<std::size_t>(H * cap));  // [H][cap] and bias
  Index n = 0, next = 0;
  auto rng = kvc::test::make_rng(91);
  std::normal_distribution<float> N;
  kvc::cli::MethodOptions o;  // SnapKV's scores, whole blocks, the decoding's forced entries
  o.block_size = b;
  o.sinks = 4;
  o.recent = 8;
  const auto runner = kvc::cli::make_runner<float>("snapkv", o, 1);
  const auto compressor = runner->decoder({/*max_size=*/48, /*target_size=*/32, 0, /*sinks=*/4, /*recent=*/8});
  kvc::cli::BudgetSpec spec;
  spec.budget = kvc::Budget::tokens(32);
  Index compressions = 0;
  kvc::LayerResult<float> out;
  kvc::Workspace<float> ws;
  Index peak_pages = 0;
  for (int step = 0; step < 200; ++step) {
    if (n % b == 0) {  // a new page
      REQUIRE_FALSE(free_list.empty());
      table.push_back(free_list.back());
      free_list.pop_back();
    }
    peak_pages = std::max<Index>(peak_pages, static_cast<Index>(table.size()));
    float* krow = Kp.data() + (table[static_cast<std::size_t>(n / b)] * b + n % b) * H * d;
    float* vrow = Vp.data() + (table[static_cast<std::size_t>(n / b)] * b + n % b) * H * d;
    for (Index i = 0; i < H * d; ++i) {
      krow[i] = N(rng);
      vrow[i] = N(rng);
    }
    for (Index h = 0; h < Hq; ++h) {
      float* rows = Q.data() + h * W * d;
      std::copy(rows + d, rows + W * d, rows);
      for (Index c = 0; c < d; ++c) rows[(W - 1) * d + c] = N(rng);
    }
    for (Index g = 0; g < H; ++g) {
      pos[static_cast<std::size_t>(g * cap + n)] = next;
      bias[static_cast<std::size_t>(g * cap + n)] = 0.0f;
    }
    ++next;
    ++n;
    const auto K = kvc::make_paged_token_major<float>(Kp.data(), pages, b, H, d, table.data(), n);
    const auto V = kvc::make_paged_token_major<float>(Vp.data(), pages, b, H, d, table.data(), n);
    kvc::LayerView<float> layer{K.as_const(), V.as_const(), kvc::make_head_major<const float>(Q.data(), Hq, W, d)};
    layer.positions = {pos.data(), H, n, cap};
    layer.bias = {bias.data(), H, n, cap};
    if (compressor->step(layer, out, ws)) {
      ++compressions;
      kvc::test::check_identical(out, runner->run(layer, spec));
      const auto pc = kvc::compact_paged(out, K, V, table.data(), layer.positions);
      CHECK_FALSE(pc.moved);
      for (const std::int32_t id : pc.freed) free_list.push_back(id);
      table.resize(static_cast<std::size_t>(pc.blocks));
      kvc::compact_positions_into(out, pos.data(), cap, cap);
      kvc::compact_bias_into(out, bias.data(), cap, cap);
      n = out.max_size();
      CHECK(n <= 32 + 2 * b);
      CHECK(pos[0] == 0);             // the sinks' block
      CHECK(pos[n - 1] == next - 1);  // the newest entry
    }
  }
  CHECK(compressions > 5);
  CHECK(peak_pages <= 48 / b + 1);
  CHECK(table.size() + free_list.size() == static_cast<std::size_t>(pages));
}
