// Stages swapped at run time (--scorer, --merger, --compensator; examples/composed.hpp over OneOf):
// a composition gives, bit for bit, what the Pipeline of the same policies composed at compile time
// gives, options reach the swapped stages, and bad names and pairings are errors.
#include <catch2/catch.hpp>

#include "cli_commands.hpp"
#include "composed.hpp"
#include "presets_compiled.hpp"  // float and float16 presets and Composed compiled once (kvc_cli_methods)
#include "runner.hpp"
#include "support/random.hpp"
#include "support/result_checks.hpp"
#include "support/test_utils.hpp"

#include <kvcompress/one_of.hpp>
#include <kvcompress/presets.hpp>

#include <random>
#include <string>
#include <vector>

namespace {

using kvc::Budget;
using kvc::Index;
using kvc::cli::MethodOptions;

/// A GQA layer (4 KV heads, 8 query heads) with random keys, values, window queries and output
/// projection W_o [D][Hq·d] (read by criticalkv only).
template <class T>
struct Layer {
  static constexpr Index H = 4, Hq = 8, n = 160, d = 16, W = 12, D = 24;
  std::vector<T> K, V, Q;
  std::vector<float> Wo;
  explicit Layer(std::uint64_t seed) {
    auto rng = kvc::test::make_rng(seed);
    std::normal_distribution<float> N;
    for (auto* v : {&K, &V}) {
      v->resize(H * n * d);
      for (auto& x : *v) x = T(N(rng));
    }
    Q.resize(Hq * W * d);
    for (auto& x : Q) x = T(N(rng));
    Wo.resize(D * Hq * d);
    for (auto& x : Wo) x = N(rng);
  }
  kvc::LayerView<T> view() const {
    kvc::LayerView<T> v{kvc::make_head_major<const T>(K.data(), H, n, d), kvc::make_head_major<const T>(V.data(), H, n, d),
                        kvc::make_head_major<const T>(Q.data(), Hq, W, d)};
    v.output_projection = {Wo.data(), D, Hq * d, Hq * d};
    return v;
  }
};

kvc::LayerResult<float> run(const std::string& method, const MethodOptions& o, const kvc::LayerView<float>& layer,
                            const kvc::cli::BudgetSpec& budget) {
  return kvc::cli::make_runner<float>(method, o, 1)->run(layer, budget);
}

MethodOptions swap(std::optional<std::string> scorer, std::optional<std::string> merger = {},
                   std::optional<std::string> compensator = {}) {
  MethodOptions o;
  o.scorer = std::move(scorer);
  o.merger = std::move(merger);
  o.compensator = std::move(compensator);
  return o;
}

const kvc::cli::BudgetSpec kRatio{false, Budget::ratio(0.3), {}};

}  // namespace

TEST_CASE("every method run as a composition of its own stages equals its preset", "[compose]") {
  INFO("seed " << kvc::test::test_seed());
  const Layer<float> f(5);
  // H2O needs every prefill query: a window of all n rows.
  std::vector<float> all_queries(Layer<float>::Hq * Layer<float>::n * Layer<float>::d);
  auto rng = kvc::test::make_rng(55);
  std::normal_distribution<float> N;
  for (auto& x : all_queries) x = N(rng);
  kvc::LayerView<float> every = f.view();
  every.queries = kvc::make_head_major<const float>(all_queries.data(), Layer<float>::Hq, Layer<float>::n, Layer<float>::d);
  const kvc::cli::BudgetSpec per_head{true, Budget::ratio(1.0), {40, 71, 40, 100}};
  for (const auto& method : kvc::cli::method_names()) {
    INFO(method);
    const kvc::LayerView<float> layer = method == "observed-attention" ? every : f.view();
    CHECK(kvc::cli::swaps_stages(swap(method)));
    kvc::test::check_identical(run(method, swap(method), layer, kRatio), run(method, {}, layer, kRatio));
    if (method.find("selkv") == std::string::npos && method != "chunkkv")  // shared selection: equal budgets
      kvc::test::check_identical(run(method, swap(method), layer, per_head), run(method, {}, layer, per_head));
  }
  CHECK_THROWS_WITH(run("snapkv", swap("observed-attention"), f.view(), kRatio), Catch::Contains("every prefill query"));
}

TEST_CASE("swapped stages equal the preset that composes them", "[compose]") {
  INFO("seed " << kvc::test::test_seed());
  const Layer<float> f(6);
  const auto same = [&](const std::string& method, const MethodOptions& o, const std::string& preset) {
    INFO(method << " as " << preset);
    kvc::test::check_identical(run(method, o, f.view(), kRatio), run(preset, {}, f.view(), kRatio));
  };
  same("snapkv", swap({}, "ridge"), "grkv");
  same("streaming", swap({}, "ridge"), "grkv-streaming");
  same("selkv-evict", swap({}, "ridge"), "grkv-selkv");
  same("selkv-evict", swap({}, "soft-gate", "log-ratio"), "selkv");
  same("selkv-evict", swap({}, "merge-all", "log-ratio"), "selkv-mergeall");
  same("selkv", swap({}, "drop", "none"), "selkv-evict");
  same("grkv", swap({}, "drop"), "snapkv");
  MethodOptions snap = swap("snapkv", "drop", "none");
  snap.recent = 32;
  same("adakv-selkv", snap, "adakv-snapkv");
  MethodOptions ada;
  ada.allocation = "adakv";
  same("snapkv", ada, "adakv-snapkv");
  ada.selection = "per-head";
  same("selkv", ada, "adakv-selkv");
  MethodOptions uniform;
  uniform.allocation = "uniform";
  same("adakv-snapkv", uniform, "snapkv");
  same("critical-adakv", uniform, "criticalkv");
  MethodOptions critical_ada;
  critical_ada.allocation = "adakv";
  same("criticalkv", critical_ada, "critical-adakv");
  // CriticalKV's scorer pools its own mass: it turns SnapKV's selector pooling off.
  same("snapkv", swap("criticalkv"), "criticalkv");
}

TEST_CASE("a composition no preset has equals the same policies composed at compile time", "[compose]") {
  INFO("seed " << kvc::test::test_seed());
  // TOVA's scorer and selection with SelKV's router, soft gate and bias; KNorm's with GRKV's merge.
  using TovaSoftGate = kvc::Pipeline<kvc::LastQueryAttention, kvc::TopK<0, 1, 0>, kvc::BucketRouter<32>, kvc::SoftGate,
                                     kvc::AttentionRatio>;
  using KNormRidge = kvc::Pipeline<kvc::KeyNorm, kvc::TopK<0, 32, 0>, kvc::NoRoute, kvc::RidgeMerge, kvc::MergeCount>;
  const Layer<float> f(7);
  kvc::test::check_identical(run("tova", swap({}, "soft-gate", "log-ratio"), f.view(), kRatio),
                             TovaSoftGate{}.run(f.view(), kRatio.budget));
  kvc::test::check_identical(run("knorm", swap({}, "ridge", "merge-count"), f.view(), kRatio),
                             KNormRidge{}.run(f.view(), kRatio.budget));
  // The merging presets that are not tool methods: SnapKV's eviction with kvpress's and CaM's merges.
  {
    INFO("nearest-key");
    kvc::test::check_identical(run("snapkv", swap({}, "nearest-key"), f.view(), kRatio),
                               kvc::SnapKVNearestKey{}.run(f.view(), kRatio.budget));
  }
  {
    INFO("cam");
    kvc::test::check_identical(run("snapkv", swap({}, "cam"), f.view(), kRatio),
                               kvc::SnapKVCAM{}.run(f.view(), kRatio.budget));
  }

  {
    INFO("criticalkv with SelKV's merge and GRKV's");
    using CriticalSoftGate = kvc::Pipeline<kvc::CriticalAttention, kvc::TopK<0, 32, 0>, kvc::BucketRouter<32>,
                                           kvc::SoftGate, kvc::AttentionRatio>;
    using CriticalRidge = kvc::Pipeline<kvc::CriticalAttention, kvc::TopK<0, 32, 0>, kvc::NoRoute, kvc::RidgeMerge,
                                        kvc::MergeCount>;
    kvc::test::check_identical(run("criticalkv", swap({}, "soft-gate", "log-ratio"), f.view(), kRatio),
                               CriticalSoftGate{}.run(f.view(), kRatio.budget));
    kvc::test::check_identical(run("snapkv", swap("criticalkv", "ridge", "merge-count"), f.view(), kRatio),
                               CriticalRidge{}.run(f.view(), kRatio.budget));
  }

  SECTION("options reach the swapped stages") {
    MethodOptions o = swap({}, "soft-gate", "log-ratio");
    o.bucket = 8;
    o.alpha = 0.25;
    o.recent = 3;
    TovaSoftGate::Arguments a;
    a.router.bucket = 8;
    a.compensator.alpha = 0.25;
    a.selector.recent = 3;
    kvc::test::check_identical(run("tova", o, f.view(), kRatio), TovaSoftGate(a).run(f.view(), kRatio.budget));
    MethodOptions r = swap({}, "ridge", "merge-count");
    r.lambda = 0.3;
    KNormRidge::Arguments b;
    b.merger.lambda_v = b.merger.lambda_k = 0.3;
    b.merger.lambda_mode = kvc::RidgeMerge::Arguments::LambdaMode::fixed;  // --lambda: the papers' fixed λ
    kvc::test::check_identical(run("knorm", r, f.view(), kRatio), KNormRidge(b).run(f.view(), kRatio.budget));
    r.lambda_mode = "holdout";  // named explicitly, the mode stays; --lambda then sets λ_k
    r.holdout_every = 3;
    b.merger.lambda_mode = kvc::RidgeMerge::Arguments::LambdaMode::holdout;
    b.merger.holdout_every = 3;
    kvc::test::check_identical(run("knorm", r, f.view(), kRatio), KNormRidge(b).run(f.view(), kRatio.budget));
    r.lambda_mode = "gcv";
    CHECK_THROWS_WITH(run("knorm", r, f.view(), kRatio), Catch::Contains("--lambda-mode must be fixed or holdout, got 'gcv'"));
    MethodOptions every = swap({}, "soft-gate");
    every.holdout_every = 2;
    CHECK_THROWS_WITH(run("selkv", every, f.view(), kRatio), Catch::Contains("--holdout-every does not apply"));
  }
}

TEST_CASE("compositions on float16 caches equal the presets", "[compose][half]") {
  const Layer<Eigen::half> f(8);
  const auto composed = kvc::cli::composed_arguments("snapkv", swap({}, "ridge"));
  kvc::test::check_identical(kvc::cli::Composed(composed).run(f.view(), Budget::ratio(0.3)),
                             kvc::SnapKVGRKV{}.run(f.view(), Budget::ratio(0.3)));
  const auto selkv = kvc::cli::composed_arguments("selkv-evict", swap({}, "soft-gate", "log-ratio"));
  kvc::test::check_identical(kvc::cli::Composed(selkv).run(f.view(), Budget::ratio(0.3)),
                             kvc::SelKV{}.run(f.view(), Budget::ratio(0.3)));
}

TEST_CASE("bad stage names, options that do not apply and unrouted merges are errors", "[compose][errors]") {
  using Catch::Matchers::Contains;
  const Layer<float> f(9);
  CHECK_THROWS_WITH(run("snapkv", swap({}, "nearest"), f.view(), kRatio),
                    Contains("--merger must be one of") && Contains("'nearest'"));
  CHECK_THROWS_WITH(run("snapkv", swap({}, {}, "bias"), f.view(), kRatio), Contains("--compensator must be one of"));
  CHECK_THROWS_WITH(run("snapkv", swap("snap"), f.view(), kRatio), Contains("unknown method 'snap'"));
  MethodOptions alpha = swap({}, "drop");
  alpha.alpha = 0.5;
  CHECK_THROWS_WITH(run("snapkv", alpha, f.view(), kRatio),
                    Contains("--alpha does not apply to method 'snapkv --merger drop'"));
  MethodOptions lambda = swap({}, "soft-gate");
  lambda.lambda = 0.5;
  CHECK_THROWS_WITH(run("selkv", lambda, f.view(), kRatio), Contains("--lambda does not apply"));

  // The library's slot chosen at run time: a merger that needs routing with NoRoute fails validate.
  using Slots = kvc::Pipeline<kvc::OneOf<kvc::AttentionMass>, kvc::OneOf<kvc::TopK<>>,
                              kvc::OneOf<kvc::NoRoute, kvc::BucketRouter<>>, kvc::OneOf<kvc::Drop, kvc::SoftGate>,
                              kvc::OneOf<kvc::NoCompensation>>;
  Slots::Arguments a;
  a.merger.policy = kvc::SoftGate{};
  const Slots p(a);
  CHECK_THAT(p.validate(f.view(), Budget::ratio(0.5)).message(), Contains("pair it with a router"));
  CHECK_THROWS_AS(p.run(f.view(), Budget::ratio(0.5)), kvc::error);
  a.router.policy = kvc::BucketRouter<>{};
  CHECK(Slots(a).validate(f.view(), Budget::ratio(0.5)));
}

TEST_CASE("the tool takes --scorer, --merger and --compensator", "[compose][cli]") {
  const Layer<float> f(10);
  kvc::test::TempDir tmp;
  const std::int64_t H = f.H, Hq = f.Hq, n = f.n, d = f.d, W = f.W;
  kvc::engine::write_npy(tmp / "K.npy", {H, n, d}, f.K.data());
  kvc::engine::write_npy(tmp / "V.npy", {H, n, d}, f.V.data());
  kvc::engine::write_npy(tmp / "Q.npy", {Hq, W, d}, f.Q.data());
  const auto compress = [&](std::vector<std::string> extra, const std::string& dir) {
    std::vector<std::string> args = {"compress", "--keys", tmp / "K.npy", "--values", tmp / "V.npy", "--queries",
                                     tmp / "Q.npy", "--budget", "40", "--out", tmp / dir};
    args.insert(args.end(), extra.begin(), extra.end());
    std::string out, err;
    const int rc = kvc::test::run_tool(kvc::cli::run_command, args, out, err);
    INFO(err);
    return rc;
  };
  REQUIRE(compress({"--method", "selkv-evict", "--merger", "soft-gate", "--compensator", "log-ratio", "--scorer",
                    "selkv"}, "composed") == 0);
  REQUIRE(compress({"--method", "selkv"}, "preset") == 0);
  for (const std::string file : {"positions", "keys", "values", "bias", "lengths"}) {
    INFO(file);
    const auto x = kvc::engine::read_npy(tmp / ("composed/" + file + ".npy"));
    const auto y = kvc::engine::read_npy(tmp / ("preset/" + file + ".npy"));
    CHECK(x.shape == y.shape);
    CHECK(x.f == y.f);
    CHECK(x.i == y.i);
  }
  CHECK(compress({"--method", "snapkv", "--merger", "nearest"}, "bad") != 0);
  // criticalkv reads the layer's W_o: --wo, [D][Hq·d].
  CHECK(compress({"--method", "criticalkv"}, "no-wo") != 0);
  kvc::engine::write_npy(tmp / "Wo.npy", {f.D, Hq * d}, f.Wo.data());
  kvc::engine::write_npy(tmp / "Wo_bad.npy", {f.D, Hq * d - 1}, f.Wo.data());
  CHECK(compress({"--method", "criticalkv", "--wo", tmp / "Wo_bad.npy"}, "bad-wo") != 0);
  REQUIRE(compress({"--method", "criticalkv", "--wo", tmp / "Wo.npy"}, "critical") == 0);
  const kvc::LayerResult<float> want = kvc::CriticalKV{}.run(f.view(), Budget::tokens(40));
  const auto positions = kvc::engine::read_npy(tmp / "critical/positions.npy");
  REQUIRE(positions.shape == std::vector<std::int64_t>{H, 40});
  for (Index g = 0; g < H; ++g)
    for (Index i = 0; i < 40; ++i) CHECK(positions.i[static_cast<std::size_t>(g * 40 + i)] == want.heads[g].positions[i]);
  std::string out, usage;
  CHECK(kvc::test::run_tool(kvc::cli::run_command, {}, out, usage) == 2);
  CHECK_THAT(usage, Catch::Contains("--merger drop|merge-all|soft-gate|ridge|nearest-key|cam"));
  CHECK_THAT(usage, Catch::Contains("--compensator none|log-ratio|merge-count"));
}

TEST_CASE("the tool's layer schedule gives each engine layer its share of the budget", "[cli][schedule]") {
  kvc::engine::LayerInput in;
  in.n = 2000;
  in.W = 32;
  const kvc::LayerScheduleArguments pyramid{kvc::LayerSchedule::pyramid, 0, 4};
  const auto expected = kvc::layer_budgets({kvc::LayerSchedule::pyramid, 32, 4}, 6, 2000, 500);
  REQUIRE(expected.front() > expected.back());
  for (int l = 0; l < 6; ++l) {
    in.layer = l;
    const Budget b = kvc::cli::layer_budget(Budget::ratio(0.25), pyramid, 6, in);
    CHECK(b.resolve(in.n) == expected[static_cast<std::size_t>(l)]);
    CHECK(kvc::cli::layer_budget(Budget::ratio(0.25), {}, 6, in).resolve(in.n) == 500);
  }
  // Parsed before anything is loaded: bad names and a β without the pyramid are errors.
  std::string out, err;
  CHECK(kvc::test::run_tool(kvc::cli::run_command, {"eval", "--layer-budgets", "cone"}, out, err) != 0);
  CHECK_THAT(err, Catch::Contains("--layer-budgets must be uniform or pyramid"));
  err.clear();
  CHECK(kvc::test::run_tool(kvc::cli::run_command, {"eval", "--pyramid-beta", "3"}, out, err) != 0);
  CHECK_THAT(err, Catch::Contains("--pyramid-beta needs --layer-budgets pyramid"));
  err.clear();
  CHECK(kvc::test::run_tool(kvc::cli::run_command, {"eval", "--layer-budgets", "pyramid", "--pyramid-beta", "0.5"},
                            out, err) != 0);
  CHECK_THAT(err, Catch::Contains("beta must be >= 1"));
  err.clear();
  CHECK(kvc::test::run_tool(kvc::cli::run_command, {"eval", "--allocation", "even", "--methods", "snapkv"}, out, err) != 0);
  CHECK_THAT(err, Catch::Contains("--allocation must be uniform or adakv"));
  err.clear();
  CHECK(kvc::test::run_tool(kvc::cli::run_command, {"eval", "--allocation", "adakv", "--methods", "selkv"}, out, err) != 0);
  CHECK_THAT(err, Catch::Contains("add --selection per-head"));
}
