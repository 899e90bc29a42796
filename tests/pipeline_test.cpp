// The whole pipeline and its presets (SPEC §2–§8, §11) against the reference chain
// ref::window_probs → window_mass → scores → select → route → merge → bias, plus budgets, the m >= n
// identity, memory layouts, half / bfloat16 inputs, compact_into, window_output_error and diagnostics.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/compensator/compensators.hpp>
#include <kvcompress/merger/gated_merge.hpp>
#include <kvcompress/merger/ridge.hpp>
#include <kvcompress/metrics.hpp>
#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)
#include "support/test_presets.hpp"  // double and bfloat16 (kvc_test_presets)
#include <kvcompress/result.hpp>
#include <kvcompress/router/bucket_router.hpp>
#include <kvcompress/scorer/scorers.hpp>
#include <kvcompress/selector/top_k.hpp>

#include "support/bridge.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/result_checks.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace kvc;
using kvc::test::complement;
using kvc::test::check_identical;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

// ---- the reference chain ------------------------------------------------------------------------

enum ScoreKind { kMass, kValueWeighted, kKeyNorm, kPosition };
enum CompKind { kNoComp, kRatio, kCount };

/// One method as the reference sees it (the preset defaults of presets.hpp, written out by hand).
struct RefSpec {
  ScoreKind scorer;
  long sinks, recent, pool;
  bool shared;
  bool routed = false;
  int stat = ref::RouteKeyCosine;
  long bucket = 32;
  int merge = ref::MergeDrop;
  CompKind comp = kNoComp;
  double alpha = 0.5, r_max = 0.0;
  double scale = 0.0, softcap = 0.0;  // scale 0: 1/sqrt(d)
};

const RefSpec kStreamingLLM{kPosition, 4, 0, 0, false};
const RefSpec kSnapKV{kMass, 0, 32, 5, false};
const RefSpec kSelKVEvict{kValueWeighted, 0, 16, 5, true};
const RefSpec kSelKV{kValueWeighted, 0, 16, 5, true, true, ref::RouteKeyCosine, 32, ref::MergeSoftGate, kRatio};
const RefSpec kSelKVMergeAll{kValueWeighted, 0, 16, 5, true, true, ref::RouteKeyCosine, 32, ref::MergeAll, kRatio};
const RefSpec kKNorm{kKeyNorm, 0, 32, 0, false};
const RefSpec kSnapKVNearestKey{kMass, 0, 32, 5, false, true, ref::RouteKeyCosine, 0, ref::MergeNearestKey};
const RefSpec kSnapKVCAM{kMass, 0, 32, 5, false, false, ref::RouteKeyCosine, 32, ref::MergeCam};

struct RefResult {
  std::vector<ref::CompressedHead> heads;
  std::vector<std::vector<double>> gates;  // per head, at the evicted positions (ascending)
};

/// m: per-head budgets, already clamped to n.
RefResult ref_run(const ref::Tensor3& K, const ref::Tensor3& V, const ref::Tensor3& Q, const std::vector<long>& m,
                  const RefSpec& s) {
  const long Hkv = K.H, n = K.n, G = Q.H / K.H;
  const double scale = s.scale > 0.0 ? s.scale : 1.0 / std::sqrt(double(K.d));
  const auto probs = ref::window_probs(Q, K, scale, s.softcap);
  const Eigen::MatrixXd a = ref::window_mass(probs, Hkv);
  const Eigen::MatrixXd scores = s.scorer == kMass            ? ref::attention_mass(a)
                                 : s.scorer == kValueWeighted ? ref::value_weighted(a, V)
                                 : s.scorer == kKeyNorm       ? ref::key_norm(K)
                                                              : ref::position(Hkv, n);
  const auto kept = ref::select(scores, m, s.sinks, s.recent, s.pool, false, s.shared);
  RefResult out;
  std::vector<std::vector<double>> biases;
  for (long g = 0; g < Hkv; ++g) {
    const auto& kg = kept[static_cast<std::size_t>(g)];
    std::vector<long> route(static_cast<std::size_t>(n), kg[0]);
    if (s.routed) route = ref::route(g, kg, n, s.stat, s.bucket, K, a, probs, G);
    const ref::Merged mg = s.merge == ref::MergeNearestKey ? ref::merge_nearest_key(g, kg, route, K, V, 0.0)
                           : s.merge == ref::MergeCam      ? ref::merge_cam(g, kg, K, V, a, 32)
                                                           : ref::merge(g, kg, route, K, V, a, s.routed ? s.merge : ref::MergeDrop);
    std::vector<double> bias(kg.size(), 0.0);
    if (s.routed && s.comp == kRatio) bias = ref::bias_attention_ratio(g, kg, route, mg.gate, a, s.alpha, s.r_max);
    if (s.routed && s.comp == kCount) bias = ref::bias_merge_count(kg, route, mg.gate);
    biases.push_back(bias);
    std::vector<double> gates;
    for (long j : complement(kg, n)) gates.push_back(mg.gate[static_cast<std::size_t>(j)]);
    out.gates.push_back(gates);
    out.heads.push_back({kg, mg.keys, mg.values, bias});
  }
  if (s.shared && Hkv > 1) {
    const auto mean = ref::shared_bias(biases);
    for (auto& h : out.heads) h.bias = mean;
  }
  return out;
}

// ---- library results as reference types --------------------------------------------------------

template <class Real>
std::vector<ref::CompressedHead> as_ref(const LayerResult<Real>& r) {
  std::vector<ref::CompressedHead> out;
  for (const auto& h : r.heads)
    out.push_back({kvc::test::to_long(h.positions), h.keys.template cast<double>(), h.values.template cast<double>(),
                   kvc::test::to_std(h.bias)});
  return out;
}

/// Full comparison of a library result with the reference chain: positions exactly, keys exactly (no
/// preset changes keys; the reference keys are the stored inputs), values and bias within `tol`.
template <class Real>
void check_result(const LayerResult<Real>& got, const RefResult& want, const kvc::test::PrecisionTols& tol) {
  REQUIRE(got.heads.size() == want.heads.size());
  for (std::size_t g = 0; g < want.heads.size(); ++g) {
    INFO("head " << g);
    const auto& h = got.heads[g];
    const auto& w = want.heads[g];
    REQUIRE(kvc::test::to_long(h.positions) == w.positions);
    REQUIRE(h.keys.rows() == w.keys.rows());
    REQUIRE(h.values.rows() == w.values.rows());
    CHECK(h.keys.template cast<double>() == w.keys);
    const Eigen::MatrixXd hv = h.values.template cast<double>();
    INFO("values: elementwise ratio " << kvc::test::elementwise_ratio(hv, w.values, tol.values) << ", normwise "
                                      << kvc::test::normwise_error(hv, w.values));
    CHECK(kvc::test::within(hv, w.values, tol.values));
    CHECK(kvc::test::within(kvc::test::to_std(h.bias), w.bias, tol.bias));
  }
}

/// 2 KV heads, 4 query heads, n tokens (100 by default), d = 16, W = 8.
struct Data : kvc::test::HeadData {
  explicit Data(std::uint64_t stream, long n_ = 100) : HeadData(stream, 2, 4, n_) {}
};

struct BudgetCase {
  Budget budget;
  long m;  // floor(ρ·n) or the absolute count, worked out by hand for n = 100
};
const std::vector<BudgetCase> kBudgets = {{Budget::ratio(0.5), 50}, {Budget::ratio(0.3), 30}, {Budget::ratio(0.01), 1},
                                          {Budget::tokens(41), 41}, {Budget::tokens(3), 3}};

template <class Preset, class T>
void check_preset(const char* name, const RefSpec& spec, const Data& f, Layout layout,
                  const kvc::test::PrecisionTols& tol, typename Preset::Arguments args = {}) {
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, layout);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded(), Q = b.queries.rounded();
  for (const BudgetCase& bc : kBudgets) {
    INFO(name << " " << kvc::test::to_string(layout) << " m " << bc.m);
    const auto got = Preset(args).run(layer, bc.budget);
    const RefResult want = ref_run(K, V, Q, std::vector<long>(static_cast<std::size_t>(f.Hkv), bc.m), spec);
    check_result(got, want, tol);
    CHECK(got.next_position == f.n);
    CHECK(got.shared_positions == spec.shared);
    for (std::size_t g = 0; g < got.heads.size(); ++g) {
      const auto& h = got.heads[g];
      const auto& dg = h.diagnostics;
      INFO("head " << g);
      CHECK(h.size() == bc.m);  // kept count == budget
      CHECK(dg.kept == bc.m);
      CHECK(dg.evicted == f.n - bc.m);
      CHECK(dg.merged + dg.dropped == dg.evicted);
      CHECK(dg.gate_mean >= 0.0);
      CHECK(dg.gate_mean <= 1.0);
      // Against the reference gates: merged = gates > 0, gate_mean = their mean.
      const auto& gates = want.gates[g];
      long merged = 0;
      double sum = 0.0;
      for (double x : gates) {
        merged += x > 0.0 ? 1 : 0;
        sum += x;
      }
      CHECK(dg.merged == merged);
      CHECK(kvc::test::within(dg.gate_mean, sum / double(gates.size()), kTol.float_vs_double.values));
      if (spec.merge == ref::MergeAll) CHECK(dg.merged == dg.evicted);
      if (!spec.routed && spec.merge == ref::MergeDrop) CHECK(dg.merged == 0);
      if (spec.merge == ref::MergeNearestKey || spec.merge == ref::MergeCam) CHECK(dg.merged > 0);
    }
  }
}

template <class T>
void check_all_presets(const Data& f, Layout layout, const kvc::test::PrecisionTols& tol) {
  check_preset<StreamingLLM, T>("StreamingLLM", kStreamingLLM, f, layout, tol);
  check_preset<SnapKV, T>("SnapKV", kSnapKV, f, layout, tol);
  check_preset<SelKVEvict, T>("SelKVEvict", kSelKVEvict, f, layout, tol);
  check_preset<SelKV, T>("SelKV", kSelKV, f, layout, tol);
  check_preset<SelKVMergeAll, T>("SelKVMergeAll", kSelKVMergeAll, f, layout, tol);
  check_preset<KNorm, T>("KNorm", kKNorm, f, layout, tol);
}

}  // namespace

TEMPLATE_TEST_CASE("every preset matches the reference chain (budgets, diagnostics)", "[pipeline][presets]", float,
                   double) {
  INFO("seed " << kvc::test::test_seed());
  Data f(401);
  check_all_presets<TestType>(f, Layout::head_major, kTol.float_vs_double);
}

TEMPLATE_TEST_CASE("the merge presets after SnapKV's eviction match the reference chain", "[pipeline][presets][merge]",
                   float, double) {
  INFO("seed " << kvc::test::test_seed());
  Data f(404);
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    check_preset<SnapKVNearestKey, TestType>("SnapKVNearestKey", kSnapKVNearestKey, f, layout, kTol.float_vs_double);
    check_preset<SnapKVCAM, TestType>("SnapKVCAM", kSnapKVCAM, f, layout, kTol.float_vs_double);
  }
  kvc::test::LayerBuffers<TestType> b(f.K, f.V, f.Q, Layout::head_major);
  SECTION("m >= n: nothing evicted, the same result as SnapKV's eviction alone") {
    const auto evict = SnapKV{}.run(b.view(), Budget::tokens(f.n));
    check_identical(SnapKVNearestKey{}.run(b.view(), Budget::tokens(f.n)), evict);
    check_identical(SnapKVCAM{}.run(b.view(), Budget::tokens(f.n + 5)), evict);
  }
  SECTION("m = 0 and bad merger options are errors") {
    CHECK_THROWS_AS(SnapKVNearestKey{}.run(b.view(), Budget::tokens(0)), kvc::error);
    CHECK_THROWS_AS(SnapKVCAM{}.run(b.view(), Budget::tokens(0)), kvc::error);
    SnapKVNearestKey::Arguments nk;
    nk.merger.threshold = 2.0;
    CHECK_THROWS_WITH(SnapKVNearestKey(nk).run(b.view(), Budget::tokens(10)), Catch::Contains("merger.threshold"));
    SnapKVCAM::Arguments cam;
    cam.merger.window = 0;
    CHECK_THROWS_WITH(SnapKVCAM(cam).run(b.view(), Budget::tokens(10)), Catch::Contains("merger.window"));
  }
}

TEST_CASE("presets on half and bfloat16 inputs match the reference on the stored values", "[pipeline][half]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(402);
  // Same inputs (the rounded values), float vs double arithmetic: the float_vs_double row.
  SECTION("half") { check_all_presets<Eigen::half>(f, Layout::token_major, kTol.float_vs_double); }
  SECTION("bfloat16") { check_all_presets<Eigen::bfloat16>(f, Layout::head_major, kTol.float_vs_double); }
}

TEST_CASE("half and bfloat16 inputs agree with the unrounded result within the table", "[pipeline][half]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(403);
  // Selection and routing are pinned by construction: Position scoring keeps sinks 0..3 and the
  // recent 64..99 (m = 40); 4-token buckets of the evicted 4..63 hold no kept token, so every route is
  // the positional fallback. Only continuous quantities (mass, gates, merged values, bias) move.
  using Pinned = Pipeline<Position, TopK<4, 0, 0>, BucketRouter<4>, SoftGate, AttentionRatio>;
  using PinnedAll = Pipeline<Position, TopK<4, 0, 0>, BucketRouter<4>, MergeAll, AttentionRatio>;
  RefSpec soft{kPosition, 4, 0, 0, false, true, ref::RouteKeyCosine, 4, ref::MergeSoftGate, kRatio};
  RefSpec all = soft;
  all.merge = ref::MergeAll;
  const std::vector<long> m(2, 40);
  const RefResult want_soft = ref_run(f.K, f.V, f.Q, m, soft), want_all = ref_run(f.K, f.V, f.Q, m, all);
  auto check = [&](auto tag, const kvc::test::PrecisionTols& tol) {
    using T = decltype(tag);
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
    const auto r_soft = Pinned{}.run(b.view(), Budget::tokens(40));
    const auto r_all = PinnedAll{}.run(b.view(), Budget::tokens(40));
    for (std::size_t g = 0; g < 2; ++g) {
      INFO("head " << g);
      for (const auto& [got, want] : {std::pair{&r_soft, &want_soft}, std::pair{&r_all, &want_all}}) {
        const auto& h = got->heads[g];
        const auto& w = want->heads[g];
        REQUIRE(kvc::test::to_long(h.positions) == w.positions);
        const Eigen::MatrixXd hv = h.values.template cast<double>();
        INFO("values: elementwise ratio " << kvc::test::elementwise_ratio(hv, w.values, tol.values)
                                          << ", normwise " << kvc::test::normwise_error(hv, w.values));
        CHECK(kvc::test::within(hv, w.values, tol.values));
        CHECK(kvc::test::within(h.keys.template cast<double>(), w.keys, tol.values));
        CHECK(kvc::test::within(kvc::test::to_std(h.bias), w.bias, tol.bias));
        CHECK(h.diagnostics.merged > 0);
      }
    }
  };
  SECTION("half") { check(Eigen::half{}, kTol.half_vs_float); }
  SECTION("bfloat16") { check(Eigen::bfloat16{}, kTol.bf16_vs_float); }
}

TEST_CASE("attention options reach every stage", "[pipeline][options]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(404);
  RefSpec spec = kSelKV;
  spec.scale = 0.3;
  spec.softcap = 2.5;
  spec.bucket = 8;
  spec.stat = ref::RouteCoAttention;
  spec.alpha = 1.0;
  spec.r_max = 4.0;
  SelKV::Arguments args;
  args.attention.scale = 0.3;
  args.attention.softcap = 2.5;
  args.router.bucket = 8;
  args.router.statistic = RouteStatistic::co_attention;
  args.compensator.alpha = 1.0;
  args.compensator.r_max = 4.0;
  check_preset<SelKV, double>("SelKV(options)", spec, f, Layout::head_major, kTol.float_vs_double, args);
  check_preset<SelKV, float>("SelKV(options)", spec, f, Layout::token_major, kTol.float_vs_double, args);
}

TEST_CASE("the result records the window product that ran", "[pipeline][amx]") {
  // AttentionArguments::product = amx_bf16x3 is a request: the result says what stage 1 ran. d = 20
  // (not a multiple of 32), half and double keys, and presets without a window stage always run fma;
  // d = 32 float keys run AMX exactly where this process can (simd::amx_bf16_available()).
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(2718);
  const long Hkv = 2, G = 2, n = 64, W = 8;
  for (long d : {20L, 32L}) {
    INFO("d " << d);
    const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d);
    kvc::test::LayerBuffers<float> f(K, V, Q, Layout::head_major);
    kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, Layout::head_major);
    kvc::test::LayerBuffers<double> x(K, V, Q, Layout::head_major);
    SnapKV::Arguments snap;
    snap.attention.product = WindowProduct::amx_bf16x3;
    const bool amx_here = d % 32 == 0 && simd::amx_bf16_available();
    CHECK(SnapKV(snap).run(f.view(), Budget::ratio(0.5)).window_product ==
          (amx_here ? WindowProduct::amx_bf16x3 : WindowProduct::fma));
    CHECK(SnapKV{}.run(f.view(), Budget::ratio(0.5)).window_product == WindowProduct::fma);
    CHECK(SnapKV(snap).run(h.view(), Budget::ratio(0.5)).window_product == WindowProduct::fma);
    CHECK(SnapKV(snap).run(x.view(), Budget::ratio(0.5)).window_product == WindowProduct::fma);
    SelKV::Arguments sel;
    sel.attention.product = WindowProduct::amx_bf16x3;
    sel.threads = 2;
    CHECK(SelKV(sel).run(f.view(), Budget::ratio(0.5)).window_product ==
          (amx_here ? WindowProduct::amx_bf16x3 : WindowProduct::fma));
    StreamingLLM::Arguments stream;  // no window stage at all
    stream.attention.product = WindowProduct::amx_bf16x3;
    CHECK(StreamingLLM(stream).run(f.view(), Budget::ratio(0.5)).window_product == WindowProduct::fma);
    // A reused result is overwritten, in both directions.
    LayerResult<float> out;
    Workspace<float> ws;
    SnapKV(snap).run(f.view(), Budget::ratio(0.5), out, ws);
    SnapKV{}.run(f.view(), Budget::ratio(0.5), out, ws);
    CHECK(out.window_product == WindowProduct::fma);
    SnapKV(snap).run(f.view(), Budget::ratio(0.5), out, ws);
    CHECK(out.window_product == (amx_here ? WindowProduct::amx_bf16x3 : WindowProduct::fma));
    // A call rejected by the folded NaN/Inf scan (after stage 1 ran) leaves `out` as it was, this
    // field included, with either product.
    ref::Tensor3 K_nan = K;
    K_nan.at(1, n / 2, 0) = std::numeric_limits<double>::quiet_NaN();
    kvc::test::LayerBuffers<float> bad(K_nan, V, Q, Layout::head_major);
    for (const SnapKV& rejected : {SnapKV{}, SnapKV(snap)}) {
      const LayerResult<float> before = out;
      CHECK_THROWS_WITH(rejected.run(bad.view(), Budget::ratio(0.5), out, ws), Catch::Contains("keys"));
      check_identical(out, before);
      SnapKV{}.run(f.view(), Budget::ratio(0.5), out, ws);  // an fma result before the AMX attempt
    }
  }
}

TEMPLATE_TEST_CASE("m >= n is the identity", "[pipeline][identity]", float, double, Eigen::half) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(405);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<T> layer = b.view();
  auto check = [&](const auto& r, const char* name) {
    INFO(name);
    REQUIRE(r.heads.size() == 2);
    CHECK(r.next_position == f.n);
    for (Index g = 0; g < 2; ++g) {
      INFO("head " << g);
      const auto& h = r.heads[static_cast<std::size_t>(g)];
      REQUIRE(h.size() == f.n);
      bool keys_same = true, values_same = true;
      for (Index j = 0; j < f.n; ++j) {
        CHECK(h.positions[static_cast<std::size_t>(j)] == j);
        for (Index k = 0; k < f.d; ++k) {
          keys_same &= h.keys(j, k) == to_real<Real>(layer.keys.row(g, j)[k]);
          values_same &= h.values(j, k) == to_real<Real>(layer.values.row(g, j)[k]);
        }
      }
      CHECK(keys_same);
      CHECK(values_same);
      CHECK(h.bias.size() == f.n);
      CHECK((h.bias.array() == Real(0)).all());
      CHECK(h.diagnostics.kept == f.n);
      CHECK(h.diagnostics.evicted == 0);
      CHECK(h.diagnostics.merged == 0);
      CHECK(h.diagnostics.dropped == 0);
      CHECK(h.diagnostics.gate_mean == 0.0);
    }
  };
  for (Budget budget : {Budget::tokens(f.n), Budget::tokens(f.n + 7), Budget::ratio(1.0)}) {
    check(StreamingLLM{}.run(layer, budget), "StreamingLLM");
    check(SnapKV{}.run(layer, budget), "SnapKV");
    check(SelKVEvict{}.run(layer, budget), "SelKVEvict");
    check(SelKV{}.run(layer, budget), "SelKV");
    check(SelKVMergeAll{}.run(layer, budget), "SelKVMergeAll");
    check(KNorm{}.run(layer, budget), "KNorm");
  }
  check(SnapKV{}.run(layer, std::vector<Index>{f.n, f.n + 1}), "SnapKV per-head budgets");
}

TEST_CASE("both memory layouts give identical results", "[pipeline][layout]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(406);
  kvc::test::LayerBuffers<float> hm(f.K, f.V, f.Q, Layout::head_major), tm(f.K, f.V, f.Q, Layout::token_major);
  for (const BudgetCase& bc : kBudgets) {
    INFO("m " << bc.m);
    {
      INFO("StreamingLLM");
      check_identical(StreamingLLM{}.run(hm.view(), bc.budget), StreamingLLM{}.run(tm.view(), bc.budget));
    }
    {
      INFO("SnapKV");
      check_identical(SnapKV{}.run(hm.view(), bc.budget), SnapKV{}.run(tm.view(), bc.budget));
    }
    {
      INFO("SelKV");
      check_identical(SelKV{}.run(hm.view(), bc.budget), SelKV{}.run(tm.view(), bc.budget));
    }
    {
      INFO("SelKVMergeAll");
      check_identical(SelKVMergeAll{}.run(hm.view(), bc.budget), SelKVMergeAll{}.run(tm.view(), bc.budget));
    }
    {
      INFO("KNorm");
      check_identical(KNorm{}.run(hm.view(), bc.budget), KNorm{}.run(tm.view(), bc.budget));
    }
  }
  kvc::test::LayerBuffers<Eigen::half> hh(f.K, f.V, f.Q, Layout::head_major), ht(f.K, f.V, f.Q, Layout::token_major);
  check_identical(SelKV{}.run(hh.view(), Budget::ratio(0.3)), SelKV{}.run(ht.view(), Budget::ratio(0.3)));
}

TEMPLATE_TEST_CASE("compact_into writes rows 0..m_g-1 in either layout, in place too", "[pipeline][compact]", float,
                   Eigen::half) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Data f(407);
  for (Layout src_layout : {Layout::head_major, Layout::token_major}) {
    kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, src_layout);
    const ref::Tensor3 K0 = b.keys.rounded(), V0 = b.values.rounded(), Q0 = b.queries.rounded();
    // SelKV (shared, merged values) and SnapKV with different budgets per head (m_0 != m_1).
    const auto selkv = SelKV{}.run(b.view(), Budget::tokens(37));
    const auto snap = SnapKV{}.run(b.view(), std::vector<Index>{45, 60});
    const RefResult want_selkv = ref_run(K0, V0, Q0, {37, 37}, kSelKV);
    const RefResult want_snap = ref_run(K0, V0, Q0, {45, 60}, kSnapKV);

    // Checks that rows < m_g of `dst` hold the result (converted to T) and agree with the reference,
    // and that rows >= m_g still hold `before`.
    auto verify = [&](const auto& result, const RefResult& want, const TensorView<T>& kd, const TensorView<T>& vd,
                      const ref::Tensor3& kb, const ref::Tensor3& vb) {
      for (Index g = 0; g < f.Hkv; ++g) {
        const auto& h = result.heads[static_cast<std::size_t>(g)];
        const auto& w = want.heads[static_cast<std::size_t>(g)];
        REQUIRE(kvc::test::to_long(h.positions) == w.positions);
        bool copied = true, untouched = true;
        Eigen::MatrixXd kv(h.size(), f.d), vv(h.size(), f.d);
        for (Index i = 0; i < f.n; ++i)
          for (Index k = 0; k < f.d; ++k) {
            const double kx = to_real<double>(kd.row(g, i)[k]), vx = to_real<double>(vd.row(g, i)[k]);
            if (i < h.size()) {
              copied &= kd.row(g, i)[k] == from_real<T>(h.keys(i, k)) && vd.row(g, i)[k] == from_real<T>(h.values(i, k));
              kv(i, k) = kx;
              vv(i, k) = vx;
            } else {
              untouched &= kx == kb.at(g, i, k) && vx == vb.at(g, i, k);
            }
          }
        INFO("head " << g << " m " << h.size());
        CHECK(copied);
        CHECK(untouched);
        CHECK(kv == w.keys);  // keys are never changed, and survive the round trip exactly
        // Merged values are stored in T: the reference up to the input's own rounding.
        CHECK(kvc::test::within(vv, w.values,
                                std::is_same_v<T, float> ? kTol.float_vs_double.values : kTol.half_vs_float.values));
      }
    };

    for (Layout dst_layout : {Layout::head_major, Layout::token_major}) {
      INFO("source " << kvc::test::to_string(src_layout) << " destination " << kvc::test::to_string(dst_layout));
      ref::Tensor3 fill(f.Hkv, f.n, f.d);
      for (double& x : fill.data) x = -3.0;
      kvc::test::Buffer<T> kd(fill, dst_layout), vd(fill, dst_layout);
      compact_into(selkv, kd.view, vd.view);
      verify(selkv, want_selkv, kd.view, vd.view, fill, fill);
      kvc::test::Buffer<T> kd2(fill, dst_layout), vd2(fill, dst_layout);
      compact_into(snap, kd2.view, vd2.view);
      verify(snap, want_snap, kd2.view, vd2.view, fill, fill);
    }
    {
      INFO("in place into " << kvc::test::to_string(src_layout) << " source buffers");
      compact_into(snap, b.keys.view, b.values.view);
      verify(snap, want_snap, b.keys.view, b.values.view, K0, V0);
      CHECK(b.queries.rounded().data == Q0.data);
    }
  }
}

TEST_CASE("compact_bias_into writes one row per head", "[pipeline][compact]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(408);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  const auto r = SelKV{}.run(b.view(), Budget::tokens(30));
  const RefResult want = ref_run(b.keys.rounded(), b.values.rounded(), b.queries.rounded(), {30, 30}, kSelKV);
  std::vector<float> bias(2 * 40, 9.f);
  compact_bias_into(r, bias.data(), 40, 40);
  for (std::size_t g = 0; g < 2; ++g) {
    const std::vector<double> row(bias.begin() + long(g) * 40, bias.begin() + long(g) * 40 + 30);
    CHECK(kvc::test::within(row, want.heads[g].bias, kTol.float_vs_double.bias));
    for (long i = 30; i < 40; ++i) CHECK(bias[g * 40 + static_cast<std::size_t>(i)] == 9.f);
  }
  CHECK_THROWS_AS(compact_bias_into(r, bias.data(), 40, 29), kvc::error);
}

TEMPLATE_TEST_CASE("window_output_error matches the reference", "[pipeline][metrics]", float, double) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Data f(409);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded(), Q = b.queries.rounded();
  const auto& tol = kTol.float_vs_double.values;
  for (double softcap : {0.0, 3.0}) {
    INFO("softcap " << softcap);
    SelKV::Arguments sa;
    sa.attention.softcap = softcap;
    SnapKV::Arguments na;
    na.attention.softcap = softcap;
    RefSpec ss = kSelKV, ns = kSnapKV;
    ss.softcap = ns.softcap = softcap;
    const double scale = 1.0 / std::sqrt(double(f.d));
    for (long m : {20L, 45L}) {
      INFO("m " << m);
      const auto rs = SelKV(sa).run(layer, Budget::tokens(m));
      const auto rn = SnapKV(na).run(layer, Budget::tokens(m));
      const std::vector<long> ms(2, m);
      const double got_s = window_output_error(layer, rs, sa.attention);
      const double got_n = window_output_error(layer, rn, na.attention);
      // The metric itself (on the library's result) and the whole chain (on the reference result).
      CHECK(kvc::test::within(got_s, ref::window_output_error(Q, K, V, as_ref(rs), scale, softcap), tol));
      CHECK(kvc::test::within(got_n, ref::window_output_error(Q, K, V, as_ref(rn), scale, softcap), tol));
      CHECK(kvc::test::within(got_s, ref::window_output_error(Q, K, V, ref_run(K, V, Q, ms, ss).heads, scale, softcap),
                              tol));
      CHECK(kvc::test::within(got_n, ref::window_output_error(Q, K, V, ref_run(K, V, Q, ms, ns).heads, scale, softcap),
                              tol));
      CHECK(got_s > 0.0);
    }
    const auto full = SelKV(sa).run(layer, Budget::ratio(1.0));
    CHECK(kvc::test::within(window_output_error(layer, full, sa.attention),
                            ref::window_output_error(Q, K, V, as_ref(full), scale, softcap), tol));
  }
}

TEMPLATE_TEST_CASE("a window longer than the cache uses the last n queries", "[pipeline][window]", float, double) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(410);
  const long Hkv = 2, Hq = 4, n = 12, d = 16, Wq = 20;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hq, Wq, d, 1.5);
  kvc::test::LayerBuffers<T> b(K, V, Q, Layout::head_major);
  using Pipe = Pipeline<ValueWeighted, TopK<1, 2, 3, Granularity::shared>, BucketRouter<4>, SoftGate, AttentionRatio>;
  const RefSpec spec{kValueWeighted, 1, 2, 3, true, true, ref::RouteKeyCosine, 4, ref::MergeSoftGate, kRatio};
  for (long m : {1L, 4L, 7L}) {
    INFO("m " << m);
    const auto got = Pipe{}.run(b.view(), Budget::tokens(m));
    check_result(got, ref_run(b.keys.rounded(), b.values.rounded(), b.queries.rounded(), {m, m}, spec),
                 kTol.float_vs_double);
  }
}

TEST_CASE("long caches: half and bfloat16 keys spanning several conversion tiles", "[pipeline][half]") {
  INFO("seed " << kvc::test::test_seed());
  // The library converts half / bfloat16 keys in tiles of 256 tokens; n = 300 and 513 cross tile edges.
  for (long n : {300L, 513L}) {
    Data f(411, n);
    const long m = n / 4;
    auto check = [&](auto tag) {
      using T = decltype(tag);
      kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
      const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded(), Q = b.queries.rounded();
      const std::vector<long> ms(2, m);
      {
        INFO("n " << n << " SelKV");
        check_result(SelKV{}.run(b.view(), Budget::tokens(m)), ref_run(K, V, Q, ms, kSelKV), kTol.float_vs_double);
      }
      {
        INFO("n " << n << " SnapKV");
        check_result(SnapKV{}.run(b.view(), Budget::tokens(m)), ref_run(K, V, Q, ms, kSnapKV), kTol.float_vs_double);
      }
    };
    check(Eigen::half{});
    check(Eigen::bfloat16{});
    check(float{});
  }
}

TEST_CASE("worker threads give bit-identical results", "[pipeline][threads]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(412);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::token_major);
  for (Index threads : {2, 4}) {
    INFO("threads " << threads);
    SelKV::Arguments sa;
    sa.threads = threads;
    SnapKV::Arguments na;
    na.threads = threads;
    check_identical(SelKV{}.run(b.view(), Budget::ratio(0.3)), SelKV(sa).run(b.view(), Budget::ratio(0.3)));
    check_identical(SnapKV{}.run(b.view(), std::vector<Index>{20, 70}),
                    SnapKV(na).run(b.view(), std::vector<Index>{20, 70}));
  }
}

TEST_CASE("run into a reused result and workspace equals a fresh run, and recycles the memory", "[pipeline][reuse]") {
  INFO("seed " << kvc::test::test_seed());
  // Two layers with different n (and budgets), compressed alternately into the same out / ws.
  Data small(413, 60), large(414, 130);
  kvc::test::LayerBuffers<float> bs(small.K, small.V, small.Q, Layout::token_major);
  kvc::test::LayerBuffers<float> bl(large.K, large.V, large.Q, Layout::head_major);
  const auto check = [&](const auto& preset, const char* name) {
    INFO(name);
    LayerResult<float> out;
    Workspace<float> ws;
    for (int round = 0; round < 2; ++round) {
      INFO("round " << round);
      preset.run(bl.view(), Budget::ratio(0.3), out, ws);
      check_identical(out, preset.run(bl.view(), Budget::ratio(0.3)));
      const float* keys_before = out.heads[1].keys.data();
      // Stale contents must not survive: a policy that fills the kept rows itself (fills_keys /
      // fills_values) has to write every row, and the gathers every other row.
      for (auto& h : out.heads) {
        h.keys.setConstant(std::numeric_limits<float>::quiet_NaN());
        h.values.setConstant(std::numeric_limits<float>::quiet_NaN());
      }
      preset.run(bl.view(), Budget::ratio(0.3), out, ws);  // same shapes: no reallocation
      CHECK(out.heads[1].keys.data() == keys_before);
      check_identical(out, preset.run(bl.view(), Budget::ratio(0.3)));
      preset.run(bs.view(), Budget::tokens(25), out, ws);
      check_identical(out, preset.run(bs.view(), Budget::tokens(25)));
    }
    // A rejected call leaves `out` as it was.
    const LayerResult<float> before = out;
    CHECK_THROWS_AS(preset.run(bs.view(), Budget::tokens(0), out, ws), kvc::error);
    check_identical(out, before);
  };
  check(StreamingLLM{}, "StreamingLLM");
  check(SnapKV{}, "SnapKV");
  {  // per-head budgets of different sizes, then a uniform one
    LayerResult<float> out;
    Workspace<float> ws;
    SnapKV{}.run(bl.view(), std::vector<Index>{7, 90}, out, ws);
    check_identical(out, SnapKV{}.run(bl.view(), std::vector<Index>{7, 90}));
    SnapKV{}.run(bl.view(), Budget::tokens(40), out, ws);
    check_identical(out, SnapKV{}.run(bl.view(), Budget::tokens(40)));
  }
  check(SelKV{}, "SelKV");
  check(SelKVMergeAll{}, "SelKVMergeAll");
  SnapKV::Arguments threaded;
  threaded.threads = 2;
  check(SnapKV(threaded), "SnapKV, 2 threads");
  SelKV::Arguments selkv_threaded;
  selkv_threaded.threads = 2;
  check(SelKV(selkv_threaded), "SelKV, 2 threads");
  check(SnapKVGRKV{}, "SnapKVGRKV");
  check(FullCache{}, "FullCache");
  {  // TopK writes into the workspace's Selection: a reused call of the same shape keeps its lists
    LayerResult<float> out;
    Workspace<float> ws;
    SnapKV{}.run(bl.view(), Budget::ratio(0.3), out, ws);
    REQUIRE(ws.selection.kept.size() == 2);
    const Index* kept_before = ws.selection.kept[0].data();
    SnapKV{}.run(bl.view(), Budget::ratio(0.3), out, ws);
    CHECK(ws.selection.kept[0].data() == kept_before);
    CHECK(ws.bytes() >= ws.selection.kept[0].capacity() * sizeof(Index));
  }
  {  // one workspace and result across presets whose selections differ in kind: shared (SelKV),
     // per head (SnapKV), all positions (FullCache), and back
    LayerResult<float> out;
    Workspace<float> ws;
    SelKV{}.run(bl.view(), Budget::ratio(0.3), out, ws);
    check_identical(out, SelKV{}.run(bl.view(), Budget::ratio(0.3)));
    SnapKV{}.run(bs.view(), std::vector<Index>{7, 30}, out, ws);
    check_identical(out, SnapKV{}.run(bs.view(), std::vector<Index>{7, 30}));
    FullCache{}.run(bl.view(), Budget::ratio(0.3), out, ws);
    check_identical(out, FullCache{}.run(bl.view(), Budget::ratio(0.3)));
    SelKV{}.run(bs.view(), Budget::tokens(25), out, ws);
    check_identical(out, SelKV{}.run(bs.view(), Budget::tokens(25)));
  }
}

namespace {
/// Custom selectors that declare nothing (no traits). Both keep the first m_g positions.
/// AppendingSelector appends to the lists it is given, so it relies on a fresh Selection (it does not
/// declare overwrites_selection): a reused one would hold the previous call's positions as well.
struct AppendingSelector {
  struct Arguments {};
  Arguments args;
  Status validate() const { return Status::ok(); }
  bool shares_positions() const { return false; }
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out) const {
    const Index H = static_cast<Index>(scores.size()), n = H > 0 ? scores[0].size() : 0;
    out.kept.resize(static_cast<std::size_t>(H));
    out.evicted.resize(static_cast<std::size_t>(H));
    out.score = scores;
    for (Index g = 0; g < H; ++g)
      for (Index j = 0; j < n; ++j) (j < budgets[static_cast<std::size_t>(g)] ? out.kept : out.evicted)[static_cast<std::size_t>(g)].push_back(j);
  }
};
/// `last_seed` records the fourth argument SeededSelector::select() received.
inline Index last_seed = -1;
/// AppendingSelector into a cleared Selection, with a fourth parameter that is not a thread count:
/// the pipeline must not fill it.
struct SeededSelector : AppendingSelector {
  template <class Real>
  void select(const std::vector<Vector<Real>>& scores, const std::vector<Index>& budgets, Selection<Real>& out,
              Index seed = 7) const {
    last_seed = seed;
    out = Selection<Real>{};
    AppendingSelector::select(scores, budgets, out);
  }
};
}  // namespace

TEST_CASE("custom selectors: the thread count goes only to a selector that declares takes_threads, and a fresh selection to one that appends",
          "[pipeline][policy]") {
  INFO("seed " << kvc::test::test_seed());
  STATIC_REQUIRE(policy_traits<TopK<>>::takes_threads);
  STATIC_REQUIRE(!policy_traits<SeededSelector>::takes_threads);  // its fourth parameter is a seed
  STATIC_REQUIRE(policy_traits<TopK<>>::overwrites_selection);
  STATIC_REQUIRE(policy_traits<KeepAll>::overwrites_selection);
  STATIC_REQUIRE(!policy_traits<AppendingSelector>::overwrites_selection);
  Data f(415, 40);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  {
    using Pipe = Pipeline<ValueWeighted, SeededSelector, NoRoute, Drop, NoCompensation>;
    Pipe::Arguments a;
    a.threads = 3;
    last_seed = -1;
    const LayerResult<float> r = Pipe(a).run(b.view(), Budget::tokens(10));
    CHECK(last_seed == 7);  // its own default, not the pipeline's 3 threads
    for (const auto& h : r.heads) CHECK(h.size() == 10);
  }
  {
    using Pipe = Pipeline<ValueWeighted, AppendingSelector, NoRoute, Drop, NoCompensation>;
    LayerResult<float> out;
    Workspace<float> ws;
    for (Index m : {12, 5, 12}) {
      INFO("m " << m);
      Pipe{}.run(b.view(), Budget::tokens(m), out, ws);
      check_identical(out, Pipe{}.run(b.view(), Budget::tokens(m)));
      for (const auto& h : out.heads) {
        REQUIRE(h.size() == m);
        for (Index i = 0; i < m; ++i) CHECK(h.positions[static_cast<std::size_t>(i)] == i);
      }
    }
    CHECK(ws.selection.kept.empty());  // the workspace's selection was not used
  }
}

namespace {
/// A custom merger that breaks the MergeOutput contract: it sets no gates.
struct GatelessMerger {
  struct Arguments {};
  Arguments args;
  Status validate(Index, Index) const { return Status::ok(); }
  template <class T>
  void merge(const HeadContext<T>&, const Routing&, MergeOutput<compute_t<T>>&) const {}
};

/// Breaks it by resizing the gates to one entry whatever the evictions.
struct OneGateMerger : GatelessMerger {
  template <class T>
  void merge(const HeadContext<T>&, const Routing&, MergeOutput<compute_t<T>>& out) const {
    out.gate.setZero(1);
  }
};

/// Breaks it on some paths only: writes the gates of even-numbered evicted tokens, after a resize
/// (which keeps whatever the storage held).
struct EvenGateMerger : GatelessMerger {
  template <class T>
  void merge(const HeadContext<T>& ctx, const Routing&, MergeOutput<compute_t<T>>& out) const {
    out.gate.resize(static_cast<Index>(ctx.evicted().size()));
    for (Index e = 0; e < out.gate.size(); e += 2) out.gate[e] = 0;
  }
};
}  // namespace

TEST_CASE("a merger that does not set one gate per evicted token is reported", "[pipeline][policy]") {
  Data f(416, 40);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  using Gateless = Pipeline<ValueWeighted, TopK<>, NoRoute, GatelessMerger, NoCompensation>;
  using OneGate = Pipeline<ValueWeighted, TopK<>, NoRoute, OneGateMerger, NoCompensation>;
  using EvenGates = Pipeline<ValueWeighted, TopK<>, NoRoute, EvenGateMerger, NoCompensation>;
  CHECK_THROWS_WITH(Gateless{}.run(b.view(), Budget::tokens(10)),
                    Catch::Contains("gate 0 of KV head 0 is NaN: the merger left it unset"));
  CHECK_THROWS_WITH(OneGate{}.run(b.view(), Budget::tokens(10)),
                    Catch::Contains("the merger set 1 gates for KV head 0, which evicts 30 tokens"));
  // Some gates unwritten: caught in a one-shot call, and in a reused call after a correct one (whose
  // gates, all written, would otherwise still be there).
  CHECK_THROWS_WITH(EvenGates{}.run(b.view(), Budget::tokens(10)), Catch::Contains("gate 1 of KV head 0 is NaN"));
  LayerResult<float> out;
  Workspace<float> ws;
  Pipeline<ValueWeighted, TopK<>, NoRoute, Drop, NoCompensation>{}.run(b.view(), Budget::tokens(10), out, ws);
  CHECK(out.heads[0].diagnostics.dropped == 30);
  CHECK_THROWS_WITH(EvenGates{}.run(b.view(), Budget::tokens(10), out, ws), Catch::Contains("gate 1 of KV head 0 is NaN"));
  const LayerResult<float> all = Gateless{}.run(b.view(), Budget::tokens(40));  // nothing evicted: no gate needed
  for (const auto& h : all.heads) CHECK(h.size() == 40);
  // The NaN check is one of the input checks: check_finite = false turns it off (README, Errors).
  Gateless::Arguments unchecked;
  unchecked.check_finite = false;
  LayerResult<float> r;
  CHECK_NOTHROW(r = Gateless(unchecked).run(b.view(), Budget::tokens(10)));
  for (const auto& h : r.heads) CHECK(h.diagnostics.evicted == 30);
}

TEST_CASE("a result large enough for streaming stores holds exactly the cache rows at the kept positions",
          "[pipeline][gather]") {
  // Presets that only drop tokens, and SelKV's kept keys, write a result of >= 16 MiB with non-temporal stores
  // (Pipeline::kStreamMinBytes, detail::copy_row_streaming); smaller ones with memcpy. Either way every
  // kept row must be the cache's row, bit for bit, with one or two threads (the stores of a worker
  // must be visible after the join) and into a reused, poisoned result.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(415);
  std::normal_distribution<float> normal;
  const Index Hkv = 2, Hq = 4, n = 16384, d = 128, W = 8;
  std::vector<float> K(static_cast<std::size_t>(Hkv * n * d)), V(K.size()), Q(static_cast<std::size_t>(Hq * W * d));
  for (auto* buf : {&K, &V, &Q})
    for (auto& x : *buf) x = normal(rng);
  const LayerView<float> layer{make_head_major<const float>(K.data(), Hkv, n, d),
                               make_head_major<const float>(V.data(), Hkv, n, d),
                               make_head_major<const float>(Q.data(), Hq, W, d)};
  // Every kept key row (and with `values`, every value row) is the cache's row at its position.
  const auto check_rows = [&](const LayerResult<float>& out, Index m, bool values = true) {
    REQUIRE(out.heads.size() == std::size_t(Hkv));
    for (Index g = 0; g < Hkv; ++g) {
      const auto& h = out.heads[std::size_t(g)];
      REQUIRE(h.size() == m);
      Index mismatches = 0;
      const std::size_t row_bytes = std::size_t(d) * sizeof(float);
      for (Index i = 0; i < m; ++i) {  // rows of a RowMatrix are contiguous
        mismatches += std::memcmp(h.keys.row(i).data(), layer.keys.row(g, h.positions[i]), row_bytes) != 0;
        if (values) mismatches += std::memcmp(h.values.row(i).data(), layer.values.row(g, h.positions[i]), row_bytes) != 0;
      }
      CHECK(mismatches == 0);
    }
  };
  for (const double rho : {0.6, 0.05}) {  // 2·2·m·d floats: 20 MB (streamed), 1.7 MB (memcpy)
    const Index m = static_cast<Index>(rho * double(n));
    INFO("ratio " << rho << ", result bytes " << 2 * Hkv * m * d * 4);
    for (const Index threads : {1, 2}) {
      INFO("threads " << threads);
      SnapKV::Arguments a;
      a.threads = threads;
      const SnapKV snap(a);
      check_rows(snap.run(layer, Budget::ratio(rho)), m);
      LayerResult<float> out;
      Workspace<float> ws;
      snap.run(layer, Budget::ratio(rho), out, ws);
      for (auto& h : out.heads) {
        h.keys.setConstant(std::numeric_limits<float>::quiet_NaN());
        h.values.setConstant(std::numeric_limits<float>::quiet_NaN());
      }
      snap.run(layer, Budget::ratio(rho), out, ws);
      check_rows(out, m);

      // SelKV: the router writes the kept keys, with streaming stores for the large result (its
      // merger and compensator read no keys: reads_kept_keys = false); the values are merged.
      SelKV::Arguments sa;
      sa.threads = threads;
      const SelKV selkv(sa);
      const LayerResult<float> fresh = selkv.run(layer, Budget::ratio(rho));
      check_rows(fresh, m, false);
      selkv.run(layer, Budget::ratio(rho), out, ws);
      for (auto& h : out.heads) h.keys.setConstant(std::numeric_limits<float>::quiet_NaN());
      selkv.run(layer, Budget::ratio(rho), out, ws);
      check_rows(out, m, false);
      for (Index g = 0; g < Hkv; ++g) CHECK(out.heads[std::size_t(g)].values == fresh.heads[std::size_t(g)].values);
    }
  }
  STATIC_REQUIRE(!policy_traits<SoftGate>::reads_kept_keys);
  STATIC_REQUIRE(!policy_traits<AttentionRatio>::reads_kept_keys);
  STATIC_REQUIRE(policy_traits<RidgeMerge>::reads_kept_keys);  // GRKV reads them: never streamed
  STATIC_REQUIRE(policy_traits<BucketRouter<>>::fills_keys);
}

TEST_CASE("record_merges: each head's merge map follows the reference routing and changes nothing else",
          "[pipeline][merge_map]") {
  INFO("seed " << kvc::test::test_seed());
  Data f(977);
  kvc::test::LayerBuffers<double> b(f.K, f.V, f.Q, Layout::head_major);
  const Budget budget = Budget::ratio(0.3);
  const auto plain = kvc::SelKV{}.run(b.view(), budget);
  kvc::SelKV::Arguments args;
  args.record_merges = true;
  kvc::SelKV recording(args);
  const auto r = recording.run(b.view(), budget);
  check_identical(r, plain);  // positions, keys, values, bias: recording changes no result
  for (const auto& h : plain.heads) CHECK(h.merges.evicted.empty());
  for (long g = 0; g < f.Hkv; ++g) {
    INFO("head " << g);
    const auto& head = r.heads[static_cast<std::size_t>(g)];
    const kvc::MergeMap<double>& mm = head.merges;
    REQUIRE(mm.evicted.size() == static_cast<std::size_t>(f.n) - head.positions.size());
    REQUIRE(mm.target.size() == mm.evicted.size());
    REQUIRE(mm.gate.size() == mm.evicted.size());
    std::vector<long> kept(head.positions.begin(), head.positions.end());
    std::vector<bool> seen(static_cast<std::size_t>(f.n), false);
    for (const long p : kept) seen[static_cast<std::size_t>(p)] = true;
    const std::vector<long> route = ref::route(g, kept, f.n, ref::RouteKeyCosine, 32, f.K, Eigen::MatrixXd(), {}, 2);
    long merged = 0;
    for (std::size_t e = 0; e < mm.evicted.size(); ++e) {
      const long j = static_cast<long>(mm.evicted[e]);
      CHECK_FALSE(seen[static_cast<std::size_t>(j)]);  // evicted and kept partition the positions
      seen[static_cast<std::size_t>(j)] = true;
      if (e > 0) CHECK(mm.evicted[e - 1] < mm.evicted[e]);
      CHECK(mm.target[e] == route[static_cast<std::size_t>(j)]);
      CHECK(mm.gate[e] >= 0.0);
      CHECK(mm.gate[e] <= 1.0);
      merged += mm.gate[e] > 0.0;
    }
    CHECK(merged == head.diagnostics.merged);
  }
  // A method that routes nothing reports every evicted entry unrouted and dropped.
  kvc::SnapKV::Arguments snap;
  snap.record_merges = true;
  for (const auto& h : kvc::SnapKV(snap).run(b.view(), budget).heads) {
    REQUIRE(h.merges.evicted.size() == static_cast<std::size_t>(f.n) - h.positions.size());
    for (std::size_t e = 0; e < h.merges.evicted.size(); ++e) {
      CHECK(h.merges.target[e] == -1);
      CHECK(h.merges.gate[e] == 0.0);
    }
  }
}
