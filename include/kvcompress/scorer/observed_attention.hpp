// H2O's scorer (as kvpress's ObservedAttentionPress computes it): the attention each token received
// from every prefill query that sees it, averaged over those queries and the KV head's query group.
#pragma once
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>

namespace kvc {

/// H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
/// Models", 2023), with kvpress's ObservedAttentionPress normalisation:
///   c_g[j] = (1/G) · Σ_{h in g} Σ_{i ≥ j} A_h[i][j] / (n − j)
/// where A_h is the causal attention of all n prefill queries (softcap, scale and stored bias as the
/// window attention, SPEC §2) and n − j counts the queries that see token j. It needs the queries of
/// every prefill position: the layer's window must cover the cache (queries.tokens ≥ n), which
/// validate(layer) checks; with only the last W < n queries it is an error, not an approximation.
/// Computed in blocks of `block` query rows per query head with the window-attention kernels (each
/// block is the window of the cache prefix it sees): O(G·n²·d / 2) time, O(G·block·n) memory.
struct ObservedAttention {
  struct Arguments {
    Index block = 32;  ///< query rows per query head and block (memory O(G·block·n), not a result option)
  };
  Arguments args;

  Status validate() const {
    if (args.block < 1)
      return Status::fail(Status::Code::invalid_argument, detail::concat("scorer.block must be >= 1, got ", args.block));
    return Status::ok();
  }

  /// The layer must carry a query for every cached entry (its window covers the cache).
  template <class T>
  Status validate(const LayerView<T>& layer) const {
    if (layer.queries.tokens < layer.tokens())
      return Status::fail(Status::Code::invalid_argument,
                          detail::concat("ObservedAttention needs the queries of all n = ", layer.tokens(),
                                         " prefill positions (queries [Hq][n][d]), got W = ", layer.queries.tokens,
                                         ": pass every prefill query as the window"));
    return Status::ok();
  }

  /// out (n) <- the averaged causal attention each token received. Throws kvc::error when the layer
  /// lacks queries (see validate(layer)) or a logit overflows the arithmetic type.
  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const LayerView<T>& layer = ctx.layer();
    validate(layer).throw_if_error();
    const Index n = ctx.tokens(), g = ctx.head();
    const Index block = std::min(args.block, n);
    out.setZero(n);
    // Block [i0, i1) of query rows is the window of the prefix [0, i1): its window mass is
    // (1/G)·Σ_h Σ_{i in block} A_h[i][j] for j < i1.
    const Index first = layer.queries.tokens - n;  // the queries of entries 0..n−1
    Vector<Real> mass;
    WindowWorkspace<Real> ws;
    for (Index i0 = 0; i0 < n; i0 += block) {
      const Index i1 = std::min(n, i0 + block);
      LayerView<T> prefix{layer.keys.token_range(0, i1), layer.values.token_range(0, i1),
                          layer.queries.token_range(first + i0, i1 - i0), layer.positions, layer.bias};
      prefix.bias.length = std::min(prefix.bias.length, i1);
      if (!window_mass<Real>(prefix, g, ctx.attention(), mass, ws))
        throw error(detail::concat("an attention logit of KV head ", g, ", query rows ", i0, "..", i1 - 1,
                                   " is not finite: |scale·<q, k>| overflows the arithmetic type"));
      out.head(i1) += mass;
    }
    for (Index j = 0; j < n; ++j) out[j] /= static_cast<Real>(n - j);
  }
};

}  // namespace kvc
