// TOVA's scorer: the attention of the last window query, averaged over the KV head's query group.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

namespace kvc {

/// TOVA (Oren et al., "Transformers are Multi-State RNNs", 2024):
///   c_g[j] = (1/G) · Σ_{h in g} A_h[W−1][j]
/// the causal window probability of the last window query (position n − 1, which sees every key) of
/// each query head of KV head g's group, averaged over the group. Reads one window row per query
/// head (ScoreContext::row_probabilities), not the window attention mass. O(G·n·d).
struct LastQueryAttention {
  struct Arguments {};
  Arguments args;

  Status validate() const { return Status::ok(); }

  /// out (n) <- the group mean of the last window row's probabilities. Throws kvc::error when a
  /// logit overflows the arithmetic type.
  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const Index G = ctx.group_size(), W = ctx.window();
    out.setZero(ctx.tokens());
    Vector<Real> row;  // (n)
    for (Index h = 0; h < G; ++h) {
      ctx.row_probabilities(h * W + W - 1, row);
      out += row;
    }
    out /= static_cast<Real>(G);
  }
};

}  // namespace kvc
