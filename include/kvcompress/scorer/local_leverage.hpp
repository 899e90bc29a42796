// CUR's scorer (CurDKV, as kvpress's CURPress computes it): the product of the keys' and the values'
// squared norms, each normalised within local windows of tokens.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <vector>

namespace kvc {

/// CurDKV (Sengupta et al., "Value-Guided KV Compression for LLMs via Approximated CUR
/// Decomposition", 2025), with kvpress's CURPress defaults (kv_product, local approximation, no
/// random projection). With the squared row norms κ_j = ‖k_{g,j}‖², ν_j = ‖v_{g,j}‖² (the leverage
/// scores' approximation) and the windows B_b = [b·w, min((b+1)·w, n)):
///   κ̂_j = κ_j / Σ_{i∈B(j)} κ_i,   ν̂_j = ν_j / Σ_{i∈B(j)} ν_i,   p_j = κ̂_j · ν̂_j
///   c_g[j] = p_j / Σ_i p_i          (j ≥ sinks),       c_g[j] = 1          (j < sinks)
/// A window whose norms are all zero gives 0 (kvpress: 0/0), as does a head whose p is all zero. The
/// normalised scores are at most 1, so the sinks rank first. Computed in double: any finite
/// cache gives finite scores; a NaN/Inf key or value gives NaN (unless every token is a sink).
/// Needs no window attention. One pass over K_g and V_g: O(n·d), O(n) memory.
struct LocalLeverage {
  struct Arguments {
    Index sinks = 4;    ///< first tokens scored 1 (kvpress num_sinks)
    Index window = 16;  ///< tokens per normalisation window (kvpress local_window_size)
  };
  Arguments args;

  Status validate() const {
    using detail::concat;
    if (args.sinks < 0)
      return Status::fail(Status::Code::invalid_argument, concat("scorer.sinks must be >= 0, got ", args.sinks));
    if (args.window < 1)
      return Status::fail(Status::Code::invalid_argument, concat("scorer.window must be >= 1, got ", args.window));
    return Status::ok();
  }

  template <class T>
  void score(const ScoreContext<T>& ctx, Vector<compute_t<T>>& out) const {
    using Real = compute_t<T>;
    const Index n = ctx.tokens(), d = ctx.head_dim(), w = args.window;
    std::vector<double> p(static_cast<std::size_t>(n));  // (n) κ_j, then p_j
    double total = 0;
    std::vector<double> nu(static_cast<std::size_t>(std::min(w, n)));  // (w) ν of the current window
    for (Index lo = 0; lo < n; lo += w) {
      const Index hi = std::min(n, lo + w);
      double key_sum = 0, value_sum = 0;
      for (Index j = lo; j < hi; ++j) {
        p[static_cast<std::size_t>(j)] = detail::squared_norm_double(ctx.key(j), d);
        nu[static_cast<std::size_t>(j - lo)] = detail::squared_norm_double(ctx.value(j), d);
        key_sum += p[static_cast<std::size_t>(j)];
        value_sum += nu[static_cast<std::size_t>(j - lo)];
      }
      for (Index j = lo; j < hi; ++j) {
        double& pj = p[static_cast<std::size_t>(j)];
        const double key_part = key_sum == 0.0 ? 0.0 : pj / key_sum;
        const double value_part = value_sum == 0.0 ? 0.0 : nu[static_cast<std::size_t>(j - lo)] / value_sum;
        pj = key_part * value_part;
        total += pj;
      }
    }
    out.resize(n);
    for (Index j = 0; j < n; ++j)
      out[j] = j < args.sinks ? Real(1) : static_cast<Real>(total == 0.0 ? 0.0 : p[static_cast<std::size_t>(j)] / total);
  }
};

}  // namespace kvc
