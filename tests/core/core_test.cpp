// Views, layouts, budgets and input validation (core.hpp), and the pipeline's error paths.
#include <catch2/catch.hpp>

#include <kvcompress/presets.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)
#include "support/test_presets.hpp"  // double and bfloat16 (kvc_test_presets)
#include <kvcompress/result.hpp>
#include <kvcompress/rope.hpp>
#include <kvcompress/scorer/scorers.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/test_utils.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

using namespace kvc;
using kvc::test::error_of;
using kvc::test::Layout;

TEST_CASE("views address both layouts without copies", "[core][view]") {
  std::vector<float> buf(3 * 5 * 4);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = float(i);
  const auto hm = make_head_major<const float>(buf.data(), 3, 5, 4);  // [H][n][d]
  const auto tm = make_token_major<const float>(buf.data(), 5, 3, 4);  // [n][H][d]
  CHECK(hm.row(2, 3) == buf.data() + (2 * 5 + 3) * 4);
  CHECK(tm.row(2, 3) == buf.data() + (3 * 3 + 2) * 4);
  CHECK(hm.token_range(1, 2).row(0, 0) == hm.row(0, 1));
  CHECK(detail::rows_disjoint(hm));
  CHECK(detail::rows_disjoint(tm));
}

TEST_CASE("aliasing strides are detected", "[core][view][errors]") {
  std::vector<float> buf(1000);
  TensorView<const float> v{buf.data(), 2, 4, 8, 8, 8};  // heads and tokens share rows
  CHECK_FALSE(detail::rows_disjoint(v));
  v = {buf.data(), 2, 4, 8, 32, 4};  // token stride shorter than a vector
  CHECK_FALSE(detail::rows_disjoint(v));
  v = {buf.data(), 2, 4, 8, -32, 8};  // negative stride
  CHECK_FALSE(detail::rows_disjoint(v));
  v = {buf.data(), 1, 4, 8, 0, 8};  // one head: head stride irrelevant
  CHECK(detail::rows_disjoint(v));
  v = {buf.data(), 2, 4, 8, 40, 10};  // padded rows
  CHECK(detail::rows_disjoint(v));
}

TEST_CASE("budget resolution follows SPEC §3", "[core][budget]") {
  CHECK(Budget::ratio(0.25).resolve(100) == 25);
  CHECK(Budget::ratio(0.3).resolve(10) == 3);  // floor(2.9999999) must not bite
  CHECK(Budget::ratio(0.1).resolve(9) == 0);
  CHECK(Budget::tokens(7).resolve(3) == 7);
  CHECK_FALSE(Budget::ratio(0.0).validate());
  CHECK_FALSE(Budget::ratio(1.5).validate());
  CHECK_FALSE(Budget::ratio(std::nan("")).validate());
  CHECK_FALSE(Budget::tokens(0).validate());
  CHECK_FALSE(Budget::tokens(-3).validate());
  CHECK(Budget::ratio(1.0).validate());
  CHECK(Budget::tokens(1).validate());
}

namespace {

struct Fixture {
  long Hkv = 2, Hq = 4, n = 40, d = 8, W = 6;
  std::mt19937_64 rng = kvc::test::make_rng(11);
  ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
  ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
  ref::Tensor3 Q = kvc::test::random_tensor(rng, Hq, W, d);
};

}  // namespace

TEST_CASE("bad input is rejected with the field and value, and nothing is written", "[core][errors]") {
  INFO("seed " << kvc::test::test_seed());
  Fixture f;
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  const std::vector<float> k_before = b.keys.data, v_before = b.values.data, q_before = b.queries.data;
  auto layer = b.view();
  SelKV selkv;

  SECTION("valid input passes") { CHECK(selkv.validate(layer, Budget::ratio(0.5))); }
  SECTION("budget 0 and ratios that resolve to 0") {
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::tokens(0)); }), Catch::Contains("budget") && Catch::Contains("0"));
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.01)); }), Catch::Contains("resolves to 0"));
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(2.0)); }), Catch::Contains("(0, 1]"));
  }
  SECTION("Hq not a multiple of Hkv") {
    layer.queries.heads = 3;
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("multiple of KV heads"));
    CHECK(selkv.validate(layer, Budget::ratio(0.5)).code() == Status::Code::invalid_shape);
  }
  SECTION("zero-size dimensions") {
    layer.keys.tokens = 0;
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys") && Catch::Contains("tokens=0"));
    layer = b.view();
    layer.keys.dim = 0;
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("dim=0"));
    layer = b.view();
    layer.queries.tokens = 0;
    CHECK_FALSE(selkv.validate(layer, Budget::ratio(0.5)));
  }
  SECTION("shape mismatches") {
    layer.values.tokens = f.n - 1;
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values: shape"));
    layer = b.view();
    layer.queries.dim = f.d - 1;
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("queries.dim"));
  }
  SECTION("null data and aliasing strides") {
    layer.values.data = nullptr;
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("null"));
    layer = b.view();
    layer.keys.token_stride = 4;
    CHECK(selkv.validate(layer, Budget::ratio(0.5)).code() == Status::Code::aliasing);
  }
  SECTION("NaN and Inf anywhere in K, V or the window queries") {
    b.keys.view.row(1, 17)[3] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[1][17][3]"));
    b.keys.view.row(1, 17)[3] = 0.f;
    b.values.view.row(0, 39)[7] = std::numeric_limits<float>::infinity();
    CHECK_THAT(error_of([&] { selkv.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[0][39][7]"));
    b.values.view.row(0, 39)[7] = 0.f;
    b.queries.view.row(3, 0)[0] = -std::numeric_limits<float>::infinity();
    CHECK(selkv.validate(layer, Budget::ratio(0.5)).code() == Status::Code::non_finite);
    b.queries.view.row(3, 0)[0] = 0.f;
    CHECK(selkv.validate(layer, Budget::ratio(0.5)));
    // restore the originals for the untouched-memory check below
    b.keys.data = k_before;
    b.values.data = v_before;
    b.queries.data = q_before;
  }
  SECTION("non-finite keys are found through the window logits too; overflowing logits are an error") {
    // Presets with window attention leave the key scan to the fused kernel (float arithmetic).
    b.keys.view.row(0, 5)[2] = std::numeric_limits<float>::infinity();
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[0][5][2]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, std::vector<Index>{3, 4}); }), Catch::Contains("keys[0][5][2]"));
    CHECK_THAT(error_of([&] { StreamingLLM{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[0][5][2]"));
    CHECK(SnapKV{}.validate(layer, Budget::ratio(0.5)).code() == Status::Code::non_finite);
    b.keys.view.row(0, 5)[2] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THAT(error_of([&] { SelKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[0][5][2]"));
    // Finite but huge: scale·<q, k> overflows float.
    b.keys.view.row(1, 30)[4] = 1e30f;
    b.keys.view.row(0, 5)[2] = 0.f;
    b.queries.view.row(2, f.W - 1)[4] = 1e30f;
    CHECK(SnapKV{}.validate(layer, Budget::ratio(0.5)));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("overflows"));
    b.keys.data = k_before;
    b.queries.data = q_before;
    // Scorers that read every row fold the scan of what they read: ValueWeighted (V), KeyNorm (K).
    // Presets whose scorer does not read V scan it head by head in stage 1, with validate()'s message.
    b.values.view.row(1, 3)[1] = -std::numeric_limits<float>::infinity();
    CHECK_THAT(error_of([&] { SelKVEvict{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[1][3][1]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[1][3][1]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, std::vector<Index>{3, 4}); }), Catch::Contains("values[1][3][1]"));
    CHECK_THAT(error_of([&] { StreamingLLM{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[1][3][1]"));
    SnapKV::Arguments two_threads;
    two_threads.threads = 2;
    CHECK_THAT(error_of([&] { SnapKV(two_threads).run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[1][3][1]"));
    b.values.view.row(1, 3)[1] = 0.f;
    b.values.view.row(1, f.n - 1)[0] = std::numeric_limits<float>::quiet_NaN();  // the last row
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }),
               Catch::Contains(kvc::detail::concat("values[1][", f.n - 1, "][0]")));
    b.values.data = v_before;
    b.values.view.row(1, 3)[1] = -std::numeric_limits<float>::infinity();
    CHECK(SnapKV{}.validate(layer, Budget::ratio(0.5)).code() == Status::Code::non_finite);
    b.keys.view.row(1, 2)[0] = std::numeric_limits<float>::quiet_NaN();  // K and V: named in validate()'s order
    CHECK_THAT(SnapKV{}.validate(layer, Budget::ratio(0.5)).message(), Catch::Contains("keys[1][2][0]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[1][2][0]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, std::vector<Index>{3, 4}); }), Catch::Contains("keys[1][2][0]"));
    CHECK_THAT(error_of([&] { SelKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[1][2][0]"));
    CHECK_THAT(error_of([&] { StreamingLLM{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[1][2][0]"));
    CHECK_THAT(error_of([&] { KNorm{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[1][2][0]"));
    b.keys.data = k_before;  // V and a budget that resolves to 0: validate() names the value first
    CHECK_THAT(SnapKV{}.validate(layer, Budget::ratio(1e-9)).message(), Catch::Contains("values[1][3][1]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(1e-9)); }), Catch::Contains("values[1][3][1]"));
    b.keys.view.row(1, 2)[0] = std::numeric_limits<float>::quiet_NaN();
    b.values.data = v_before;
    b.queries.view.row(2, f.W - 1)[0] = std::numeric_limits<float>::quiet_NaN();  // K and the queries
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[1][2][0]"));
    b.keys.data = k_before;
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("queries[2]"));
    b.values.view.row(1, 6)[5] = std::numeric_limits<float>::quiet_NaN();  // V and the queries
    CHECK_THAT(SnapKV{}.validate(layer, Budget::ratio(0.5)).message(), Catch::Contains("values[1][6][5]"));
    CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[1][6][5]"));
    CHECK_THAT(error_of([&] { SelKV{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("values[1][6][5]"));
    b.values.data = v_before;
    b.queries.data = q_before;
    b.values.view.row(1, 3)[1] = 3e19f;  // finite, but its squared norm overflows
    CHECK(SelKV{}.validate(layer, Budget::ratio(0.5)));
    CHECK_THAT(error_of([&] { SelKV{}.run(layer, Budget::ratio(0.5)); }),
               Catch::Contains("score of KV head 1") && Catch::Contains("overflows"));
    b.values.data = v_before;
    b.keys.view.row(0, 11)[6] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THAT(error_of([&] { KNorm{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("keys[0][11][6]"));
    b.keys.view.row(0, 11)[6] = 3e19f;
    CHECK_THAT(error_of([&] { KNorm{}.run(layer, Budget::ratio(0.5)); }), Catch::Contains("overflows"));
    b.keys.data = k_before;
    // half storage (float arithmetic, folded) and double arithmetic (scanned up front) name it too.
    ref::Tensor3 K = f.K;
    K.at(1, 9, 0) = std::numeric_limits<double>::quiet_NaN();
    kvc::test::LayerBuffers<Eigen::half> bh(K, f.V, f.Q, Layout::token_major);
    CHECK_THAT(error_of([&] { SnapKV{}.run(bh.view(), Budget::ratio(0.5)); }), Catch::Contains("keys[1][9][0]"));
    kvc::test::LayerBuffers<double> bd(K, f.V, f.Q, Layout::head_major);
    CHECK_THAT(error_of([&] { SnapKV{}.run(bd.view(), Budget::ratio(0.5)); }), Catch::Contains("keys[1][9][0]"));
    ref::Tensor3 V = f.V;
    V.at(0, 4, 2) = std::numeric_limits<double>::infinity();
    kvc::test::LayerBuffers<Eigen::half> bhv(f.K, V, f.Q, Layout::head_major);
    CHECK_THAT(error_of([&] { SnapKV{}.run(bhv.view(), Budget::ratio(0.5)); }), Catch::Contains("values[0][4][2]"));
    kvc::test::LayerBuffers<double> bdv(f.K, V, f.Q, Layout::token_major);
    CHECK_THAT(error_of([&] { SnapKV{}.run(bdv.view(), Budget::ratio(0.5)); }), Catch::Contains("values[0][4][2]"));
  }
  SECTION("bad options") {
    SelKV::Arguments args;
    args.selector.pool_kernel = 4;
    CHECK_THAT(error_of([&] { SelKV(args).run(layer, Budget::ratio(0.5)); }), Catch::Contains("pool_kernel"));
    args = {};
    args.router.bucket = -1;
    CHECK_THAT(error_of([&] { SelKV(args).run(layer, Budget::ratio(0.5)); }), Catch::Contains("bucket"));
    args = {};
    args.compensator.r_max = 0.5;
    CHECK_THAT(error_of([&] { SelKV(args).run(layer, Budget::ratio(0.5)); }), Catch::Contains("r_max"));
    args = {};
    args.attention.scale = -1.0;
    CHECK_THAT(error_of([&] { SelKV(args).run(layer, Budget::ratio(0.5)); }), Catch::Contains("scale"));
    args = {};
    args.reposition.enabled = true;
    args.reposition.rotary_dim = 3;
    CHECK_THAT(error_of([&] { SelKV(args).run(layer, Budget::ratio(0.5)); }), Catch::Contains("rotary_dim"));
    args = {};
    args.selector.sinks = -2;
    CHECK_THAT(error_of([&] { SelKV(args).run(layer, Budget::ratio(0.5)); }), Catch::Contains("sinks"));
  }
  SECTION("per-head budgets") {
    SnapKV snap;
    CHECK_THAT(error_of([&] { snap.run(layer, std::vector<Index>{5}); }), Catch::Contains("one per KV head"));
    CHECK_THAT(error_of([&] { snap.run(layer, std::vector<Index>{5, 0}); }), Catch::Contains("budgets[1]"));
    CHECK_THAT(error_of([&] { selkv.run(layer, std::vector<Index>{5, 6}); }), Catch::Contains("shared selection"));
    const auto r = snap.run(layer, std::vector<Index>{5, 9});
    CHECK(r.heads[0].size() == 5);
    CHECK(r.heads[1].size() == 9);
  }
  CHECK(b.keys.data == k_before);
  CHECK(b.values.data == v_before);
  CHECK(b.queries.data == q_before);
}

TEST_CASE("compact_into writes each head's own length over a ragged result and returns the lengths", "[core][compact]") {
  Fixture f;
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  const auto r = SnapKV{}.run(b.view(), std::vector<Index>{7, 12});
  REQUIRE(r.heads[0].size() == 7);
  REQUIRE(r.heads[1].size() == 12);
  std::vector<float> k(2 * 12 * 8, -7.f), v(2 * 12 * 8, -7.f);
  const std::vector<Index> lengths = compact_into(r, make_head_major(k.data(), 2, 12, 8), make_head_major(v.data(), 2, 12, 8));
  CHECK(lengths == std::vector<Index>{7, 12});
  for (Index g = 0; g < 2; ++g)
    for (Index i = 0; i < 12; ++i)
      for (Index c = 0; c < 8; ++c) {
        const std::size_t at = static_cast<std::size_t>((g * 12 + i) * 8 + c);
        if (i < lengths[static_cast<std::size_t>(g)]) {
          CHECK(k[at] == r.heads[g].keys(i, c));
          CHECK(v[at] == r.heads[g].values(i, c));
        } else {  // beyond the head's length: untouched
          CHECK(k[at] == -7.f);
          CHECK(v[at] == -7.f);
        }
      }
}

TEST_CASE("compact_into rejects destinations that do not fit and writes nothing", "[core][errors][compact]") {
  Fixture f;
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::token_major);
  const auto r = SnapKV{}.run(b.view(), Budget::tokens(10));
  std::vector<float> k(2 * 9 * 8, -7.f), v(2 * 9 * 8, -7.f);
  CHECK_THROWS_AS(compact_into(r, make_head_major(k.data(), 2, 9, 8), make_head_major(v.data(), 2, 9, 8)), kvc::error);
  std::vector<float> k3(3 * 10 * 8, -7.f);
  CHECK_THROWS_AS(compact_into(r, make_head_major(k3.data(), 3, 10, 8), make_head_major(k3.data(), 3, 10, 8)), kvc::error);
  for (float x : k) CHECK(x == -7.f);
  for (float x : k3) CHECK(x == -7.f);
}

namespace {

/// Runs preset P with check_finite = false on `layer` and checks the result's shapes (what a caller
/// indexes by); the values are unspecified for non-finite input.
template <class P>
void run_unchecked_input(const LayerView<float>& layer, Index m, const char* name) {
  INFO(name);
  typename P::Arguments args;
  args.check_finite = false;
  LayerResult<float> r;
  CHECK_NOTHROW(r = P(args).run(layer, Budget::tokens(m)));
  REQUIRE(r.heads.size() == static_cast<std::size_t>(layer.kv_heads()));
  for (const auto& h : r.heads) {
    CHECK(h.size() == m);
    CHECK(h.keys.rows() == m);
    CHECK(h.values.rows() == m);
    CHECK(h.bias.size() == m);
    CHECK(std::is_sorted(h.positions.begin(), h.positions.end()));
    CHECK((h.positions.empty() || (h.positions.front() >= 0 && h.positions.back() < layer.tokens())));
  }
}

}  // namespace

TEST_CASE("check_finite = false: non-finite input gives a result of the right shape, never a crash", "[core][errors]") {
  // README: with the checks off, NaN/Inf input gives unspecified values but a well-formed result
  // (the selection's order stays strict with NaN scores; the sanitizer build checks the memory).
  INFO("seed " << kvc::test::test_seed());
  Fixture f;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int variant = 0; variant < 4; ++variant) {
    kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
    if (variant == 0) b.keys.view.row(0, 5)[2] = nan;          // one key
    if (variant == 1) b.values.view.row(1, 3)[1] = -inf;       // one value
    if (variant == 2) b.queries.view.row(1, 2)[0] = inf;       // one window query
    if (variant == 3) std::fill(b.values.data.begin(), b.values.data.end(), nan);  // every value
    INFO("variant " << variant);
    const LayerView<float> layer = b.view();
    for (Index m : {Index(1), Index(10), Index(39)}) {
      INFO("m " << m);
      run_unchecked_input<StreamingLLM>(layer, m, "StreamingLLM");
      run_unchecked_input<SnapKV>(layer, m, "SnapKV");
      run_unchecked_input<SelKVEvict>(layer, m, "SelKVEvict");
      run_unchecked_input<SelKV>(layer, m, "SelKV");
      run_unchecked_input<SelKVMergeAll>(layer, m, "SelKVMergeAll");
      run_unchecked_input<KNorm>(layer, m, "KNorm");
      run_unchecked_input<SnapKVGRKV>(layer, m, "SnapKVGRKV");
      run_unchecked_input<SelKVEvictGRKV>(layer, m, "SelKVEvictGRKV");
    }
  }
}
