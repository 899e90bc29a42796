// docs/policies.md's example: a custom scorer and a custom merger composed with the library's
// selector, router and compensator. ctest runs it as example_custom_policy.
#include <kvcompress/kvcompress.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

// Scorer: keep the tokens with the largest values, c_g[j] = ‖v_{g,j}‖₂ (higher = keep).
struct ValueNorm {
  struct Arguments {};  // no options
  Arguments args;       // the pipeline constructs a policy as ValueNorm{arguments}

  kvc::Status validate() const { return kvc::Status::ok(); }

  // out (n) <- the row norms of V_g (n, d). It does not read ctx.mass() (needs_mass is not declared).
  template <class T>
  void score(const kvc::ScoreContext<T>& ctx, kvc::Vector<kvc::compute_t<T>>& out) const {
    using Real = kvc::compute_t<T>;
    out.resize(ctx.tokens());
    for (kvc::Index j = 0; j < ctx.tokens(); ++j) {
      const T* v = ctx.value(j);  // row j of this KV head: d elements
      Real sum = 0;
      for (kvc::Index c = 0; c < ctx.head_dim(); ++c) sum += kvc::to_real<Real>(v[c]) * kvc::to_real<Real>(v[c]);
      out[j] = std::sqrt(sum);
    }
  }
};

// Merger: each kept value becomes the plain mean of itself and of the evicted values routed to it
// (gate 1 for every evicted token); keys are left as they are.
struct MeanMerge {
  struct Arguments {};
  Arguments args;
  struct traits : kvc::PolicyTraits {
    static constexpr bool needs_routing = true;  // composing it with kvc::NoRoute fails to compile
  };

  kvc::Status validate(kvc::Index /*n*/, kvc::Index /*m*/) const { return kvc::Status::ok(); }

  // On entry out.keys and out.values (m, d) hold the kept rows and out.gate (n - m) is all NaN:
  // every gate must be written.
  template <class T>
  void merge(const kvc::HeadContext<T>& ctx, const kvc::Routing& routing,
             kvc::MergeOutput<kvc::compute_t<T>>& out) const {
    using Real = kvc::compute_t<T>;
    const std::vector<kvc::Index>& evicted = ctx.evicted();  // positions, ascending
    kvc::Vector<Real> count = kvc::Vector<Real>::Ones(out.values.rows());
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const kvc::Index i = routing.target[e];  // index into ctx.kept()
      const T* v = ctx.value(evicted[e]);
      for (kvc::Index c = 0; c < ctx.head_dim(); ++c) out.values(i, c) += kvc::to_real<Real>(v[c]);
      count[i] += 1;
      out.gate[static_cast<kvc::Index>(e)] = 1;
    }
    for (kvc::Index i = 0; i < out.values.rows(); ++i) out.values.row(i) /= count[i];
  }
};

// 4 sinks, 8 recent tokens, the rest by value norm; routing in buckets of 16 by key cosine; bias
// log(1 + M_i) for an entry that absorbed M_i evicted tokens.
using ValueNormMean = kvc::Pipeline<ValueNorm, kvc::TopK<4, 8>, kvc::BucketRouter<16>, MeanMerge, kvc::MergeCount>;

int main() {
  const kvc::Index Hkv = 2, Hq = 4, n = 256, d = 16, W = 8, m = 32;
  std::vector<float> K(Hkv * n * d), V(Hkv * n * d), Q(Hq * W * d);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* x : {&K, &V, &Q})
    for (float& e : *x) e = normal(rng);
  const kvc::Index heavy[] = {40, 100, 170};  // tokens with 20 times larger values in every head
  for (kvc::Index g = 0; g < Hkv; ++g)
    for (kvc::Index j : heavy)
      for (kvc::Index c = 0; c < d; ++c) V[(g * n + j) * d + c] *= 20.0f;

  const kvc::LayerView<float> layer{kvc::make_head_major<const float>(K.data(), Hkv, n, d),
                                    kvc::make_head_major<const float>(V.data(), Hkv, n, d),
                                    kvc::make_head_major<const float>(Q.data(), Hq, W, d)};
  const kvc::LayerResult<float> result = ValueNormMean{}.run(layer, kvc::Budget::tokens(m));

  int failures = 0;
  auto check = [&](bool ok, const char* what, kvc::Index g) {
    if (!ok) std::printf("FAILED: %s (KV head %td)\n", what, g);
    failures += ok ? 0 : 1;
  };
  for (kvc::Index g = 0; g < Hkv; ++g) {
    const kvc::HeadResult<float>& head = result.heads[static_cast<std::size_t>(g)];
    auto kept = [&](kvc::Index j) { return std::binary_search(head.positions.begin(), head.positions.end(), j); };
    check(head.size() == m && std::is_sorted(head.positions.begin(), head.positions.end()), "m positions, ascending", g);
    check(kept(0) && kept(3) && kept(n - 8) && kept(n - 1), "the sinks and the recent tokens are kept", g);
    check(kept(heavy[0]) && kept(heavy[1]) && kept(heavy[2]), "the heavy tokens are kept", g);
    check(head.diagnostics.merged == n - m, "every evicted token is merged", g);
    // The mean merge conserves the sum of the values: Σ_i (1 + M_i)·ṽ_i = Σ_j v_j, with
    // 1 + M_i = exp(bias_i) from MergeCount.
    double error = 0, magnitude = 0;
    for (kvc::Index c = 0; c < d; ++c) {
      double merged = 0, original = 0;
      for (kvc::Index i = 0; i < m; ++i) merged += std::exp(double(head.bias[i])) * head.values(i, c);
      for (kvc::Index j = 0; j < n; ++j) {
        original += V[(g * n + j) * d + c];
        magnitude += std::abs(V[(g * n + j) * d + c]);
      }
      error += std::abs(merged - original);
    }
    check(error <= 1e-5 * magnitude, "the merged values keep the sum of all values", g);
    bool same_keys = true;  // MeanMerge leaves the keys alone
    for (kvc::Index i = 0; i < m; ++i)
      for (kvc::Index c = 0; c < d; ++c)
        same_keys = same_keys && head.keys(i, c) == K[(g * n + head.positions[static_cast<std::size_t>(i)]) * d + c];
    check(same_keys, "the kept keys are the cached keys", g);
  }
  std::printf("%s: kept %td of %td tokens per KV head\n", failures == 0 ? "ok" : "FAILED", result.max_size(), n);
  return failures == 0 ? 0 : 1;
}
