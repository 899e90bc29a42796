// ThresholdSelect (kvpress's ThresholdPress) against kvc::ref::select_threshold per KV head: thresholds,
// recent windows, caps, ties, NaN scores, nothing qualifying; the Threshold preset on SnapKV's window
// mass; bad options.
#include <catch2/catch.hpp>

#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/selector/threshold.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::Layout;

TEST_CASE("ThresholdSelect matches the reference over thresholds, recent windows and caps", "[selector][threshold]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(515);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  for (long n : {1L, 2L, 7L, 64L, 200L}) {
    const long H = 3;
    std::vector<Vector<double>> scores(static_cast<std::size_t>(H));
    std::vector<Vector<float>> scores_f(static_cast<std::size_t>(H));
    for (long g = 0; g < H; ++g) {
      Vector<double> s(n);
      for (long j = 0; j < n; ++j) s[j] = std::round(U(rng) * 20) / 20;  // ties
      if (n > 3) s[1] = std::numeric_limits<double>::quiet_NaN();
      scores[static_cast<std::size_t>(g)] = s;
      scores_f[static_cast<std::size_t>(g)] = s.cast<float>();
    }
    for (double tau : {-1.0, 0.0, 0.5, 0.95, 2.0})
      for (long recent : {0L, 1L, 5L, 300L})
        for (long cap : {1L, 3L, n / 2 + 1, n}) {
          INFO("n " << n << " tau " << tau << " recent " << recent << " cap " << cap);
          const ThresholdSelect<> sel{{tau, recent}};
          REQUIRE(sel.validate().is_ok());
          const std::vector<Index> caps(static_cast<std::size_t>(H), std::min(cap, n));
          Selection<double> out;
          sel.select(scores, caps, out);
          Selection<float> out_f;
          sel.select(scores_f, caps, out_f);
          CHECK_FALSE(out.shared);
          for (long g = 0; g < H; ++g) {
            const auto want = ref::select_threshold(scores[static_cast<std::size_t>(g)], tau, recent, cap);
            CHECK(kvc::test::to_long(out.kept[static_cast<std::size_t>(g)]) == want);
            CHECK(kvc::test::to_long(out_f.kept[static_cast<std::size_t>(g)]) == want);  // scores exact in float
            std::vector<Index> all = out.kept[static_cast<std::size_t>(g)];
            all.insert(all.end(), out.evicted[static_cast<std::size_t>(g)].begin(),
                       out.evicted[static_cast<std::size_t>(g)].end());
            std::sort(all.begin(), all.end());
            CHECK(static_cast<long>(all.size()) == n);
            CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
            CHECK(std::is_sorted(out.evicted[static_cast<std::size_t>(g)].begin(),
                                 out.evicted[static_cast<std::size_t>(g)].end()));
          }
        }
  }
}

TEST_CASE("ThresholdSelect: the count is the outcome; a NaN never qualifies; the newest is kept", "[selector][threshold]") {
  Vector<double> s(6);
  s << 0.9, 0.1, std::numeric_limits<double>::quiet_NaN(), 0.5, 0.2, 0.3;
  Selection<double> out;
  ThresholdSelect<>{{0.25, 0}}.select(std::vector<Vector<double>>{s}, {6}, out);
  CHECK(kvc::test::to_long(out.kept[0]) == std::vector<long>{0, 3, 5});
  ThresholdSelect<>{{0.25, 2}}.select(std::vector<Vector<double>>{s}, {6}, out);
  CHECK(kvc::test::to_long(out.kept[0]) == std::vector<long>{0, 3, 4, 5});
  ThresholdSelect<>{{0.95, 0}}.select(std::vector<Vector<double>>{s}, {6}, out);
  CHECK(kvc::test::to_long(out.kept[0]) == std::vector<long>{5});
  ThresholdSelect<>{{0.25, 1}}.select(std::vector<Vector<double>>{s}, {2}, out);  // cap 2: newest, then 0.9
  CHECK(kvc::test::to_long(out.kept[0]) == std::vector<long>{0, 5});
  CHECK_FALSE(ThresholdSelect<>{{std::numeric_limits<double>::infinity(), 4}}.validate().is_ok());
  CHECK_FALSE(ThresholdSelect<>{{std::nan(""), 4}}.validate().is_ok());
  CHECK_FALSE(ThresholdSelect<>{{0.1, -1}}.validate().is_ok());
}

TEST_CASE("Threshold preset: SnapKV's window mass, unpooled, against the reference; ragged lengths", "[selector][threshold][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(616);
  const long Hkv = 2, G = 2, d = 8, W = 16, n = 150;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d);
  const Eigen::MatrixXd mass = ref::window_mass(ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0), Hkv);
  for (const auto layout : {Layout::head_major, Layout::token_major}) {
    kvc::test::LayerBuffers<double> b(K, V, Q, layout);
    kvc::test::LayerBuffers<float> bf(K, V, Q, layout);
    for (double tau : {0.05, 0.1, 0.2})
      for (long cap : {30L, n}) {
        INFO("tau " << tau << " cap " << cap);
        Threshold::Arguments a;
        a.selector.threshold = tau;
        a.selector.recent = 8;
        const auto got = Threshold(a).run(b.view(), Budget::tokens(cap));
        const auto got_f = Threshold(a).run(bf.view(), Budget::tokens(cap));
        for (long g = 0; g < Hkv; ++g) {
          const auto want = ref::select_threshold(mass.row(g).transpose(), tau, 8, cap);
          CHECK(kvc::test::to_long(got.heads[static_cast<std::size_t>(g)].positions) == want);
          // float mass: a token within rounding of τ may flip; the sets differ by at most those
          const auto& pf = got_f.heads[static_cast<std::size_t>(g)].positions;
          CHECK(std::abs(static_cast<long>(pf.size()) - static_cast<long>(want.size())) <= 1);
        }
      }
  }
}
