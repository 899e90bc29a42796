// Threading policy (parallel.hpp, Pipeline::Arguments::threads): results are bit-identical for 1, 2 and
// 3 threads, for every preset, float and half input; the fused window mass equals the probabilities'
// column sums; parallel_for runs every index once and propagates exceptions.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/presets.hpp>
#include <kvcompress/result.hpp>

#include <kvcompress/parallel.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <atomic>
#include <stdexcept>
#include <vector>

using namespace kvc;
using kvc::test::Layout;

namespace {

template <class Real>
bool identical(const LayerResult<Real>& a, const LayerResult<Real>& b) {
  if (a.heads.size() != b.heads.size() || a.next_position != b.next_position) return false;
  for (std::size_t g = 0; g < a.heads.size(); ++g) {
    const auto &x = a.heads[g], &y = b.heads[g];
    if (x.positions != y.positions) return false;
    if (x.keys.rows() != y.keys.rows() || x.values.rows() != y.values.rows() || x.bias.size() != y.bias.size())
      return false;
    if (!(x.keys.array() == y.keys.array()).all() || !(x.values.array() == y.values.array()).all()) return false;
    if (!(x.bias.array() == y.bias.array()).all()) return false;
    if (x.diagnostics.cg_iterations != y.diagnostics.cg_iterations) return false;
  }
  return true;
}

template <class Preset, class T>
void check_thread_counts(const LayerView<T>& layer) {
  typename Preset::Arguments args;
  args.threads = 1;
  const auto serial = Preset(args).run(layer, Budget::ratio(0.3));
  for (Index threads : {2, 3, 16}) {
    INFO("threads " << threads);
    args.threads = threads;
    CHECK(identical(serial, Preset(args).run(layer, Budget::ratio(0.3))));
  }
}

}  // namespace

TEST_CASE("pipeline results are bit-identical for any thread count", "[simd][threads]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(601);
  const long Hkv = 4, G = 2, n = 301, d = 40, W = 16;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d, 1.5);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d, 1.5);
  for (Layout layout : {Layout::head_major, Layout::token_major}) {
    INFO("layout " << kvc::test::to_string(layout));
    const kvc::test::LayerBuffers<float> f(K, V, Q, layout);
    check_thread_counts<SnapKV>(f.view());
    check_thread_counts<SelKV>(f.view());
    check_thread_counts<SelKVMergeAll>(f.view());
    check_thread_counts<KNorm>(f.view());
    check_thread_counts<StreamingLLM>(f.view());
    check_thread_counts<SnapKVGRKV>(f.view());
    const kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, layout);
    check_thread_counts<SelKV>(h.view());
  }
}

TEST_CASE("fused window mass equals the column sums of the probabilities", "[simd][attention]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(602);
  for (long n : {1L, 7L, 33L, 255L, 256L, 257L, 700L}) {
    INFO("n " << n);
    const long Hkv = 2, G = 3, d = 24, W = 9;
    const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d, 1.5);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d, 1.5);
    const kvc::test::LayerBuffers<float> f(K, V, Q, Layout::head_major);
    const auto layer = f.view();
    const auto want = ref::window_mass(ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0), Hkv);
    WindowWorkspace<float> ws;
    for (Index g = 0; g < Hkv; ++g) {
      Vector<float> fused, from_probs;
      window_mass<float>(layer, g, AttentionArguments{}, fused, ws);
      RowMatrix<float> probs;
      window_probabilities<float>(layer, g, AttentionArguments{}, probs);
      mass_from_probabilities(probs, layer.group_size(), from_probs);
      const Eigen::VectorXd w = want.row(g).transpose();
      CHECK(kvc::test::within(fused, w, kvc::test::kTol.float_vs_double.mass));
      CHECK(kvc::test::within(from_probs, w, kvc::test::kTol.float_vs_double.mass));
    }
  }
}

TEST_CASE("parallel_for runs each index once and rethrows", "[threads]") {
  for (Index threads : {0, 1, 2, 5}) {
    std::vector<std::atomic<int>> hits(37);
    parallel_for(37, threads, [&](Index i, Index worker) {
      CHECK(worker < worker_count(37, threads));
      hits[std::size_t(i)]++;
    });
    for (auto& h : hits) CHECK(h.load() == 1);
  }
  CHECK_THROWS_AS(parallel_for(10, 2, [](Index i, Index) {
                    if (i == 7) throw std::runtime_error("boom");
                  }),
                  std::runtime_error);
}
