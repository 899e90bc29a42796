// tests/support/bridge.hpp — copies reference tensors (double, [H][n][d]) into library-typed buffers in
// either memory layout, and library results back into doubles, so tests can compare the two.
#pragma once

#include <kvcompress/core.hpp>

#include "support/reference.hpp"

#include <vector>

namespace kvc::test {

enum class Layout { head_major, token_major };

inline const char* to_string(Layout l) { return l == Layout::head_major ? "head_major" : "token_major"; }

/// Owns a buffer of element type T holding a reference tensor in the given layout.
template <class T>
struct Buffer {
  std::vector<T> data;
  TensorView<T> view;

  Buffer() = default;
  Buffer(const ref::Tensor3& t, Layout layout) : data(static_cast<std::size_t>(t.H * t.n * t.d)) {
    view = layout == Layout::head_major ? make_head_major(data.data(), t.H, t.n, t.d)
                                        : make_token_major(data.data(), t.n, t.H, t.d);
    for (long h = 0; h < t.H; ++h)
      for (long j = 0; j < t.n; ++j)
        for (long k = 0; k < t.d; ++k) view.row(h, j)[k] = from_real<T>(t.at(h, j, k));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  TensorView<const T> cview() const { return view.as_const(); }

  /// The stored (rounded) values back as a reference tensor.
  ref::Tensor3 rounded() const {
    ref::Tensor3 t(view.heads, view.tokens, view.dim);
    for (long h = 0; h < t.H; ++h)
      for (long j = 0; j < t.n; ++j)
        for (long k = 0; k < t.d; ++k) t.at(h, j, k) = to_real<double>(view.row(h, j)[k]);
    return t;
  }
};

/// K, V, Q of one layer in library form.
template <class T>
struct LayerBuffers {
  Buffer<T> keys, values, queries;
  LayerBuffers(const ref::Tensor3& K, const ref::Tensor3& V, const ref::Tensor3& Q, Layout layout)
      : keys(K, layout), values(V, layout), queries(Q, layout) {}
  LayerView<T> view() const { return {keys.cview(), values.cview(), queries.cview()}; }
};

/// Library (n) vector → std::vector<double>.
template <class Real>
std::vector<double> to_std(const Vector<Real>& v) {
  std::vector<double> out(static_cast<std::size_t>(v.size()));
  for (Index i = 0; i < v.size(); ++i) out[static_cast<std::size_t>(i)] = static_cast<double>(v[i]);
  return out;
}

inline std::vector<long> to_long(const std::vector<Index>& v) { return std::vector<long>(v.begin(), v.end()); }

}  // namespace kvc::test
