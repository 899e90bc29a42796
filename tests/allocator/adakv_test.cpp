// Budget allocation (SPEC §5): UniformBudget keeps the budgets; AdaKV against the double reference
// (kvpress's AdaKVPress rule), its invariants, and through the AdaKV presets.
#include <catch2/catch.hpp>

#include <kvcompress/allocator/budget.hpp>
#include <kvcompress/presets.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/test_utils.hpp"

#include <numeric>
#include <vector>

using namespace kvc;
using kvc::test::Layout;

namespace {

std::vector<Vector<double>> rows_of(const Eigen::MatrixXd& s) {
  std::vector<Vector<double>> out;
  for (Index g = 0; g < s.rows(); ++g) out.push_back(s.row(g).transpose());
  return out;
}

}  // namespace

TEST_CASE("AdaKV allocates like the reference: one top-k over the layer above a per-head floor", "[allocator]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(501);
  std::uniform_int_distribution<int> coarse(0, 6);
  for (long H : {1L, 2L, 4L, 7L})
    for (long n : {1L, 5L, 33L, 200L})
      for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
        INFO("H " << H << " n " << n << " floor " << alpha);
        // Coarse scores: many ties across heads and positions; one head much more peaked.
        Eigen::MatrixXd s(H, n);
        for (long g = 0; g < H; ++g)
          for (long j = 0; j < n; ++j) s(g, j) = coarse(rng) * (g == 0 ? 3.0 : 1.0);
        for (long m : {1L, 2L, n / 3 + 1, n}) {
          if (m > n) continue;  // budgets arrive clamped to n
          INFO("m " << m);
          std::vector<Index> budgets(static_cast<std::size_t>(H), m);
          AdaKV::Arguments a;
          a.floor = alpha;
          AdaKV{a}.allocate(rows_of(s), budgets);
          const std::vector<long> want = ref::adakv_budgets(s, std::vector<long>(static_cast<std::size_t>(H), m), alpha);
          CHECK(kvc::test::to_long(budgets) == want);
          CHECK(std::accumulate(budgets.begin(), budgets.end(), Index(0)) == H * m);
          for (Index b : budgets) CHECK((b >= std::max<Index>(1, Index(alpha * double(m))) && b <= n));
          std::vector<Index> same(static_cast<std::size_t>(H), m);
          UniformBudget{}.allocate(rows_of(s), same);
          CHECK(same == std::vector<Index>(static_cast<std::size_t>(H), m));
        }
      }
  // A head whose scores dominate takes the budget down to the others' floors.
  Eigen::MatrixXd s = Eigen::MatrixXd::Zero(3, 50);
  s.row(1).setConstant(1.0);
  std::vector<Index> budgets(3, 10);
  AdaKV{}.allocate(rows_of(s), budgets);
  CHECK(budgets == std::vector<Index>{2, 26, 2});
  CHECK_FALSE(AdaKV{AdaKV::Arguments{1.5}}.validate().is_ok());
  CHECK_FALSE(AdaKV{AdaKV::Arguments{-0.1}}.validate().is_ok());
}

TEST_CASE("AdaKV presets keep per-head budgets from the layer's scores", "[allocator][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(502);
  const long Hkv = 4, G = 2, n = 300, d = 16, W = 8;
  ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d, 2.0), V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d, 2.0);
  // Head 2's keys are small: its attention is flat, so it needs more entries.
  for (long j = 0; j < n; ++j)
    for (long k = 0; k < d; ++k) K.at(2, j, k) *= 0.05;
  kvc::test::LayerBuffers<double> b(K, V, Q, Layout::head_major);
  const long m = 60;
  const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0);
  const Eigen::MatrixXd mass = ref::window_mass(probs, Hkv);
  const std::vector<long> want = ref::adakv_budgets(mass, std::vector<long>(Hkv, m), 0.2);
  const LayerResult<double> r = AdaKVSnapKV{}.run(b.view(), Budget::tokens(m));
  const std::vector<std::vector<long>> want_pos = ref::select(mass, want, 0, 32, 5, false, false);
  Index total = 0;
  for (long g = 0; g < Hkv; ++g) {
    INFO("head " << g);
    CHECK(r.heads[g].size() == want[static_cast<std::size_t>(g)]);
    CHECK(kvc::test::to_long(r.heads[g].positions) == want_pos[static_cast<std::size_t>(g)]);
    total += r.heads[g].size();
  }
  CHECK(total == Hkv * m);
  CHECK(r.heads[2].size() > m);  // the flat head got more than the uniform budget
  const LayerResult<double> s = AdaKVSelKV{}.run(b.view(), Budget::tokens(m));
  CHECK_FALSE(s.shared_positions);
  total = 0;
  for (const auto& h : s.heads) total += h.size();
  CHECK(total == Hkv * m);

  // Shared selection needs equal budgets: AdaKV with it is a configuration error.
  using SharedAdaKV = Pipeline<ValueWeighted, TopK<0, 16, 5, Granularity::shared>, NoRoute, Drop, NoCompensation, AdaKV>;
  CHECK_THROWS_WITH(SharedAdaKV{}.run(b.view(), Budget::tokens(m)), Catch::Contains("per-head selection"));
}
