// tests/support/head_fixtures.hpp — helpers shared by the per-KV-head stage tests: kept/evicted sets, window mass, routing, a random layer.
#pragma once

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/core.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

namespace kvc::test {

/// Ascending complement of `kept` in [0, n). I is the position type (Index or long); `n` does not
/// take part in deduction, so any integer converts to it.
template <class I>
std::vector<I> complement(const std::vector<I>& kept, std::common_type_t<I> n) {
  std::vector<char> is_kept(static_cast<std::size_t>(n), 0);
  for (I i : kept) is_kept[static_cast<std::size_t>(i)] = 1;
  std::vector<I> out;
  for (I j = 0; j < n; ++j)
    if (!is_kept[static_cast<std::size_t>(j)]) out.push_back(j);
  return out;
}

/// `count` distinct positions of [0, n) drawn at random, ascending.
inline std::vector<Index> random_subset(std::mt19937_64& rng, Index n, Index count) {
  std::vector<Index> all(static_cast<std::size_t>(n));
  for (Index j = 0; j < n; ++j) all[static_cast<std::size_t>(j)] = j;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(count));
  std::sort(all.begin(), all.end());
  return all;
}

/// The library's window attention mass of KV head g (what the pipeline hands scorers, routers and
/// mergers), computed with `attn`.
template <class T>
Vector<compute_t<T>> library_mass(const LayerView<T>& layer, Index g,
                                  const AttentionArguments& attn = AttentionArguments{}) {
  using Real = compute_t<T>;
  RowMatrix<Real> probs;
  window_probabilities<Real>(layer, g, attn, probs);
  Vector<Real> mass;
  mass_from_probabilities(probs, layer.group_size(), mass);
  return mass;
}

/// Routing (indices into `kept`) from a reference route (n entries, kept positions), one target per
/// position of `evicted`, in that order.
inline Routing routing_from(const std::vector<long>& route, const std::vector<Index>& kept,
                            const std::vector<Index>& evicted) {
  Routing r;
  for (Index j : evicted)
    r.target.push_back(std::lower_bound(kept.begin(), kept.end(), route[static_cast<std::size_t>(j)]) - kept.begin());
  return r;
}

/// A random layer of Hkv KV heads (Hq query heads), n tokens, head dim d, a window of W queries
/// (scaled by 1.5), with the generator it was drawn from for further draws.
struct HeadData {
  long Hkv = 2, Hq = 4, n = 96, d = 16, W = 8;
  std::mt19937_64 rng;
  ref::Tensor3 K, V, Q;
  explicit HeadData(std::uint64_t stream, long Hkv_ = 2, long Hq_ = 4, long n_ = 96)
      : Hkv(Hkv_), Hq(Hq_), n(n_), rng(make_rng(stream)) {
    K = random_tensor(rng, Hkv, n, d);
    V = random_tensor(rng, Hkv, n, d);
    Q = random_tensor(rng, Hq, W, d, 1.5);
  }
  /// The default softmax scale 1/sqrt(d).
  double scale() const { return 1.0 / std::sqrt(double(d)); }
};

}  // namespace kvc::test
