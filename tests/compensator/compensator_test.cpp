// Compensators (SPEC §8) against the reference biases: AttentionRatio (with and without R_max),
// MergeCount, NoCompensation; bias exactly 0 when nothing merges; shared selection gives one bias per
// position (the mean over KV heads), per-head selection one per head.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/compensator/compensators.hpp>
#include <kvcompress/merger/gated_merge.hpp>
#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/router/bucket_router.hpp>
#include <kvcompress/scorer/scorers.hpp>
#include <kvcompress/selector/top_k.hpp>

#include "support/bridge.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/tolerances.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::complement;
using kvc::test::kTol;
using kvc::test::Layout;
using kvc::test::library_mass;
using kvc::test::random_subset;
using kvc::test::routing_from;

namespace {

using Data = kvc::test::HeadData;

/// The SelKV-style reference chain (ValueWeighted, TopK<0, recent, 5>, key-cosine routing, merge,
/// compensation) on the stored values; returns per head the kept positions and the per-head bias
/// (before any averaging).
struct RefChain {
  std::vector<std::vector<long>> kept;
  std::vector<std::vector<double>> bias;
};
RefChain ref_chain(const ref::Tensor3& K, const ref::Tensor3& V, const ref::Tensor3& Q, long m, bool shared,
                   int merge_kind, bool merge_count, double scale) {
  const auto probs = ref::window_probs(Q, K, scale, 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, K.H);
  RefChain out;
  out.kept = ref::select(ref::value_weighted(a, V), std::vector<long>(static_cast<std::size_t>(K.H), m), 0, 16, 5,
                         false, shared);
  for (long g = 0; g < K.H; ++g) {
    const auto& kg = out.kept[static_cast<std::size_t>(g)];
    const auto route = ref::route(g, kg, K.n, ref::RouteKeyCosine, 32, K, a, probs, Q.H / K.H);
    const ref::Merged mg = ref::merge(g, kg, route, K, V, a, merge_kind);
    out.bias.push_back(merge_count ? ref::bias_merge_count(kg, route, mg.gate)
                                   : ref::bias_attention_ratio(g, kg, route, mg.gate, a, 0.5, 0.0));
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("AttentionRatio and MergeCount match the reference", "[compensator]", float, double) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(301);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();
  const auto probs = ref::window_probs(b.queries.rounded(), K, f.scale(), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  const auto& tol = kTol.float_vs_double.bias;
  long capped = 0, uncapped_positive = 0;
  for (long g = 0; g < f.Hkv; ++g) {
    const std::vector<Index> kept = random_subset(f.rng, f.n, 24);
    const std::vector<Index> evicted = complement(kept, f.n);
    const auto kl = kvc::test::to_long(kept);
    const auto route = ref::route(g, kl, f.n, ref::RouteKeyCosine, 16, K, a, probs, 2);
    const Routing routing = routing_from(route, kept, evicted);
    const auto mass = library_mass(layer, g);
    const AttentionArguments attn;
    const HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
    for (int kind : {ref::MergeAll, ref::MergeSoftGate}) {
      const ref::Merged mg = ref::merge(g, kl, route, K, V, a, kind);
      MergeOutput<Real> merged;  // the compensators read only the gates
      merged.gate.resize(static_cast<Index>(evicted.size()));
      for (std::size_t e = 0; e < evicted.size(); ++e)
        merged.gate[static_cast<Index>(e)] = static_cast<Real>(mg.gate[static_cast<std::size_t>(evicted[e])]);
      for (double alpha : {0.5, 1.0}) {
        for (double r_max : {0.0, 1.5}) {
          INFO("head " << g << " merge " << kind << " alpha " << alpha << " r_max " << r_max);
          typename AttentionRatio::Arguments args;
          args.alpha = alpha;
          args.r_max = r_max;
          REQUIRE(AttentionRatio{args}.validate());
          Vector<Real> bias;
          AttentionRatio{args}.compensate(ctx, routing, merged, bias);
          const auto want = ref::bias_attention_ratio(g, kl, route, mg.gate, a, alpha, r_max);
          CHECK(kvc::test::within(kvc::test::to_std(bias), want, tol));
          if (r_max > 0.0) {
            const auto uncapped = ref::bias_attention_ratio(g, kl, route, mg.gate, a, alpha, 0.0);
            for (std::size_t i = 0; i < want.size(); ++i) {
              capped += uncapped[i] > want[i];
              CHECK(want[i] <= alpha * std::log(r_max));  // the cap, as the reference applies it
              CHECK(double(bias[static_cast<Index>(i)]) <= alpha * std::log(r_max) + tol.abs);
            }
          } else {
            for (double x : want) uncapped_positive += x > 0.0;
          }
        }
      }
      Vector<Real> bias;
      MergeCount{}.compensate(ctx, routing, merged, bias);
      CHECK(kvc::test::within(kvc::test::to_std(bias), ref::bias_merge_count(kl, route, mg.gate), tol));
      NoCompensation{}.compensate(ctx, routing, merged, bias);
      CHECK(bias.size() == static_cast<Index>(kept.size()));
      CHECK((bias.array() == Real(0)).all());
    }
  }
  CHECK(capped > 0);  // the cap was exercised
  CHECK(uncapped_positive > 10);
}

TEMPLATE_TEST_CASE("AttentionRatio with the library's own merge gates matches the reference chain",
                   "[compensator]", float, double) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(302);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded();
  const auto probs = ref::window_probs(b.queries.rounded(), K, f.scale(), 0.0);
  const Eigen::MatrixXd a = ref::window_mass(probs, f.Hkv);
  for (long g = 0; g < f.Hkv; ++g) {
    const std::vector<Index> kept = random_subset(f.rng, f.n, 20);
    const std::vector<Index> evicted = complement(kept, f.n);
    const auto kl = kvc::test::to_long(kept);
    const auto mass = library_mass(layer, g);
    const AttentionArguments attn;
    const HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
    Routing routing;
    BucketRouter<16>{}.route(ctx, routing);
    const auto route = ref::route(g, kl, f.n, ref::RouteKeyCosine, 16, K, a, probs, 2);
    REQUIRE(routing_from(route, kept, evicted).target == routing.target);
    MergeOutput<Real> merged;
    merged.keys.setZero(static_cast<Index>(kept.size()), f.d);
    merged.values.setZero(static_cast<Index>(kept.size()), f.d);
    SoftGate{}.merge(ctx, routing, merged);
    Vector<Real> bias;
    AttentionRatio{}.compensate(ctx, routing, merged, bias);
    const ref::Merged mg = ref::merge(g, kl, route, K, V, a, ref::MergeSoftGate);
    CHECK(kvc::test::within(kvc::test::to_std(bias), ref::bias_attention_ratio(g, kl, route, mg.gate, a, 0.5, 0.0),
                            kTol.float_vs_double.bias));
  }
}

TEMPLATE_TEST_CASE("the bias is exactly 0 when nothing merges", "[compensator][zero]", float, double,
                   Eigen::half) {
  using T = TestType;
  using Real = compute_t<T>;
  INFO("seed " << kvc::test::test_seed());
  Data f(303);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const LayerView<T> layer = b.view();

  SECTION("per head: Drop gates, NoRoute, nothing evicted") {
    const long g = 0;
    const auto mass = library_mass(layer, g);
    const AttentionArguments attn;
    for (bool evict : {true, false}) {
      std::vector<Index> kept;
      if (evict) kept = random_subset(f.rng, f.n, 30);
      else
        for (Index j = 0; j < f.n; ++j) kept.push_back(j);
      const std::vector<Index> evicted = complement(kept, f.n);
      const HeadContext<T> ctx(layer, g, attn, mass, mass, kept, evicted);
      MergeOutput<Real> merged;
      merged.keys.setZero(static_cast<Index>(kept.size()), f.d);
      merged.values.setZero(static_cast<Index>(kept.size()), f.d);
      Routing routed, none;
      BucketRouter<8>{}.route(ctx, routed);
      NoRoute{}.route(ctx, none);
      Drop{}.merge(ctx, routed, merged);
      for (const Routing* r : {&routed, &none}) {
        INFO("evict " << evict << " routed " << r->routed());
        Vector<Real> bias;
        AttentionRatio{}.compensate(ctx, *r, merged, bias);
        CHECK(bias.size() == static_cast<Index>(kept.size()));
        CHECK((bias.array() == Real(0)).all());
        MergeCount{}.compensate(ctx, *r, merged, bias);
        CHECK(bias.size() == static_cast<Index>(kept.size()));
        CHECK((bias.array() == Real(0)).all());
      }
    }
  }
  SECTION("pipelines: Drop with a router, and budgets m >= n") {
    using DropRatio = Pipeline<ValueWeighted, TopK<0, 4, 0>, BucketRouter<8>, Drop, AttentionRatio>;
    const auto r = DropRatio{}.run(layer, Budget::tokens(30));
    for (const auto& h : r.heads) {
      CHECK(h.size() == 30);
      CHECK((h.bias.array() == Real(0)).all());
      CHECK(h.diagnostics.merged == 0);
    }
    for (Budget budget : {Budget::tokens(f.n), Budget::tokens(f.n + 3), Budget::ratio(1.0)}) {
      for (const auto& h : SelKV{}.run(layer, budget).heads) {
        CHECK(h.size() == f.n);
        CHECK((h.bias.array() == Real(0)).all());
      }
      using CountPipe = Pipeline<ValueWeighted, TopK<0, 16, 5>, BucketRouter<32>, MergeAll, MergeCount>;
      for (const auto& h : CountPipe{}.run(layer, budget).heads) CHECK((h.bias.array() == Real(0)).all());
    }
  }
}

TEMPLATE_TEST_CASE("shared selection: one bias per position, the mean over KV heads", "[compensator][shared]",
                   float, double) {
  using T = TestType;
  INFO("seed " << kvc::test::test_seed());
  Data f(304, /*Hkv=*/3, /*Hq=*/6, /*n=*/128);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::token_major);
  const LayerView<T> layer = b.view();
  const ref::Tensor3 K = b.keys.rounded(), V = b.values.rounded(), Q = b.queries.rounded();
  const auto& tol = kTol.float_vs_double.bias;
  const long m = 40;

  SECTION("SelKV (AttentionRatio)") {
    const auto r = SelKV{}.run(layer, Budget::tokens(m));
    const RefChain want = ref_chain(K, V, Q, m, true, ref::MergeSoftGate, false, f.scale());
    const auto mean = ref::shared_bias(want.bias);
    REQUIRE(r.shared_positions);
    for (long g = 0; g < f.Hkv; ++g) {
      INFO("head " << g);
      const auto& h = r.heads[static_cast<std::size_t>(g)];
      CHECK(kvc::test::to_long(h.positions) == want.kept[static_cast<std::size_t>(g)]);
      CHECK(kvc::test::within(kvc::test::to_std(h.bias), mean, tol));
      CHECK(h.bias == r.heads[0].bias);  // one value per position, bit-identical across heads
    }
    // Heads disagree before averaging, so the mean is not any single head's bias.
    CHECK_FALSE(kvc::test::within(mean, want.bias[0], tol));
  }
  SECTION("shared MergeCount") {
    using Pipe = Pipeline<ValueWeighted, TopK<0, 16, 5, Granularity::shared>, BucketRouter<32>, SoftGate, MergeCount>;
    const auto r = Pipe{}.run(layer, Budget::tokens(m));
    const RefChain want = ref_chain(K, V, Q, m, true, ref::MergeSoftGate, true, f.scale());
    const auto mean = ref::shared_bias(want.bias);
    for (long g = 0; g < f.Hkv; ++g) {
      const auto& h = r.heads[static_cast<std::size_t>(g)];
      CHECK(kvc::test::within(kvc::test::to_std(h.bias), mean, tol));
      CHECK(h.bias == r.heads[0].bias);
    }
  }
  SECTION("per-head selection keeps per-head biases") {
    using Pipe = Pipeline<ValueWeighted, TopK<0, 16, 5>, BucketRouter<32>, SoftGate, AttentionRatio>;
    const auto r = Pipe{}.run(layer, Budget::tokens(m));
    const RefChain want = ref_chain(K, V, Q, m, false, ref::MergeSoftGate, false, f.scale());
    REQUIRE_FALSE(r.shared_positions);
    for (long g = 0; g < f.Hkv; ++g) {
      INFO("head " << g);
      const auto& h = r.heads[static_cast<std::size_t>(g)];
      CHECK(kvc::test::to_long(h.positions) == want.kept[static_cast<std::size_t>(g)]);
      CHECK(kvc::test::within(kvc::test::to_std(h.bias), want.bias[static_cast<std::size_t>(g)], tol));
    }
    CHECK_FALSE(r.heads[0].bias == r.heads[1].bias);
  }
}

TEST_CASE("AttentionRatio options are validated", "[compensator][errors]") {
  typename AttentionRatio::Arguments args;
  CHECK(AttentionRatio{args}.validate());
  args.r_max = 0.5;
  CHECK(AttentionRatio{args}.validate().code() == Status::Code::invalid_argument);
  args.r_max = 1.0;
  CHECK(AttentionRatio{args}.validate());
  args.alpha = std::nan("");
  CHECK_FALSE(AttentionRatio{args}.validate());
}
