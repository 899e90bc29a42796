// Model-level compression (model.hpp): the layer schedules against PyramidKV's rule written from its
// formula, and compress_layers against one pipeline call per layer.
#include <catch2/catch.hpp>

#include <kvcompress/model.hpp>
#include <kvcompress/presets.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)

#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/result_checks.hpp"

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

namespace {

using kvc::Index;
using kvc::LayerSchedule;
using kvc::LayerScheduleArguments;

LayerScheduleArguments pyramid(Index window, double beta) { return {LayerSchedule::pyramid, window, beta}; }

}  // namespace

TEST_CASE("pyramid budgets follow PyramidKV's rule and keep the uniform total", "[model][schedule]") {
  struct Case {
    Index L, n, m, w;
    double beta;
  };
  // Active, clamped at n − w, flat (β = 1), and fallbacks: m/β below w, one layer, m ≥ n.
  const std::vector<Case> cases = {{4, 4096, 1600, 64, 20},   {32, 8192, 2048, 32, 8},  {7, 1000, 900, 16, 3},
                                   {5, 512, 200, 8, 1},        {6, 2000, 300, 64, 20},   {1, 4096, 1600, 64, 20},
                                   {3, 100, 400, 8, 2},        {9, 777, 333, 0, 4.5},    {2, 64, 63, 0, 1.5}};
  for (const auto& c : cases) {
    INFO("L " << c.L << " n " << c.n << " m " << c.m << " w " << c.w << " beta " << c.beta);
    const auto got = kvc::layer_budgets(pyramid(c.w, c.beta), c.L, c.n, c.m);
    const auto exact = kvc::ref::pyramid_exact(c.L, c.n, c.m, c.w, c.beta);
    REQUIRE(static_cast<Index>(got.size()) == c.L);
    const Index kept = std::min(c.m, c.n);
    CHECK(std::accumulate(got.begin(), got.end(), Index{0}) == c.L * kept);
    for (std::size_t l = 0; l < got.size(); ++l) {
      INFO("layer " << l);
      CHECK(got[l] >= 1);
      CHECK(got[l] <= c.n);
      if (exact.empty()) CHECK(got[l] == kept);
      else CHECK(std::abs(double(got[l]) - exact[l]) < 1.0);
      if (l > 0) CHECK(got[l] <= got[l - 1]);  // decreasing from the first layer to the last
    }
  }
  // The first case by hand: lo = 1600/20 = 80, hi = 3200 − 80 = 3120, steps of 3040/3: 3120, 2106.67,
  // 1093.33, 80, whose floors leave one entry to the largest remainder.
  CHECK(kvc::layer_budgets(pyramid(64, 20), 4, 4096, 1600) == std::vector<Index>{3120, 2107, 1093, 80});
}

TEST_CASE("uniform budgets and bad schedule arguments", "[model][schedule]") {
  CHECK(kvc::layer_budgets({}, 3, 100, 40) == std::vector<Index>{40, 40, 40});
  CHECK(kvc::layer_budgets({}, 2, 100, 400) == std::vector<Index>{100, 100});
  CHECK_THROWS_WITH(kvc::layer_budgets(pyramid(64, 0.5), 4, 100, 10), Catch::Contains("beta must be >= 1"));
  CHECK_THROWS_WITH(kvc::layer_budgets(pyramid(-1, 2), 4, 100, 10), Catch::Contains("window must be >= 0"));
  CHECK_THROWS_WITH(kvc::layer_budgets({}, 0, 100, 10), Catch::Contains("at least one layer"));
  CHECK_THROWS_WITH(kvc::layer_budgets({}, 2, 100, 0), Catch::Contains("m >= 1"));
}

TEST_CASE("compress_layers equals one pipeline call per layer at its scheduled budget", "[model]") {
  INFO("seed " << kvc::test::test_seed());
  const Index L = 5, H = 2, Hq = 4, n = 600, d = 8, W = 8;
  auto rng = kvc::test::make_rng(41);
  std::normal_distribution<float> N;
  std::vector<std::vector<float>> K(L), V(L), Q(L);
  std::vector<kvc::LayerView<float>> layers;
  for (Index l = 0; l < L; ++l) {
    for (auto* v : {&K[l], &V[l]}) {
      v->resize(H * n * d);
      for (auto& x : *v) x = N(rng);
    }
    Q[l].resize(Hq * W * d);
    for (auto& x : Q[l]) x = N(rng);
    layers.push_back({kvc::make_head_major<const float>(K[l].data(), H, n, d),
                      kvc::make_head_major<const float>(V[l].data(), H, n, d),
                      kvc::make_head_major<const float>(Q[l].data(), Hq, W, d)});
  }
  const kvc::SnapKV snap;
  const auto schedule = pyramid(8, 4);
  const auto budgets = kvc::layer_budgets(schedule, L, n, 150);
  REQUIRE(budgets.front() > budgets.back());
  for (const Index threads : {1, 3}) {
    INFO("layer threads " << threads);
    const auto out = kvc::compress_layers(snap, layers, kvc::Budget::ratio(0.25), schedule, threads);
    REQUIRE(out.size() == layers.size());
    for (std::size_t l = 0; l < out.size(); ++l) {
      INFO("layer " << l);
      CHECK(out[l].max_size() == budgets[l]);
      kvc::test::check_identical(out[l], snap.run(layers[l], kvc::Budget::tokens(budgets[l])));
    }
  }
  // A uniform schedule is the per-layer call at the same budget.
  const auto uniform = kvc::compress_layers(kvc::SelKV{}, layers, kvc::Budget::tokens(100));
  for (std::size_t l = 0; l < uniform.size(); ++l)
    kvc::test::check_identical(uniform[l], kvc::SelKV{}.run(layers[l], kvc::Budget::tokens(100)));

  SECTION("a bad layer is an error naming the layer") {
    auto bad = layers;
    bad[3].values = kvc::make_head_major<const float>(V[3].data(), H, n - 1, d);
    CHECK_THROWS_WITH(kvc::compress_layers(snap, bad, kvc::Budget::ratio(0.25)), Catch::Contains("layer 3"));
    std::vector<float> nan_keys = K[2];
    nan_keys[17] = std::nanf("");
    bad = layers;
    bad[2].keys = kvc::make_head_major<const float>(nan_keys.data(), H, n, d);
    CHECK_THROWS_WITH(kvc::compress_layers(snap, bad, kvc::Budget::ratio(0.25)), Catch::Contains("layer 2"));
    bad = layers;
    bad[1] = {kvc::make_head_major<const float>(K[1].data(), H, n / 2, d),
              kvc::make_head_major<const float>(V[1].data(), H, n / 2, d),
              kvc::make_head_major<const float>(Q[1].data(), Hq, W, d)};
    CHECK_THROWS_WITH(kvc::compress_layers(snap, bad, kvc::Budget::ratio(0.25)), Catch::Contains("same length"));
    CHECK_THROWS_AS(kvc::compress_layers(snap, layers, kvc::Budget::ratio(0.0)), kvc::error);
    CHECK(kvc::compress_layers(snap, std::vector<kvc::LayerView<float>>{}, kvc::Budget::ratio(0.5)).empty());
  }
}
