// Private: gathering rows of strided views into dense compute-type matrices, and mapping them
// without copies when the element type already is the compute type.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#error "kvcompress/detail/rows.hpp is private: include <kvcompress/kvcompress.hpp> instead"
#endif

#include "kvcompress/core.hpp"

namespace kvc::detail {

/// Row-major map of `count` rows of head `h` starting at token `first`, usable when T == Real.
template <class Real>
using ConstRowsMap =
    Eigen::Map<const RowMatrix<Real>, Eigen::Unaligned, Eigen::OuterStride<Eigen::Dynamic>>;

template <class Real, class T>
ConstRowsMap<Real> map_rows(const TensorView<const T>& v, Index h, Index first, Index count) {
  static_assert(std::is_same_v<T, Real>, "map_rows needs the element type to be the compute type");
  return ConstRowsMap<Real>(v.row(h, first), count, v.dim, Eigen::OuterStride<Eigen::Dynamic>(v.token_stride));
}

/// out (count, dim) <- rows [first, first+count) of head h, converted to Real.
template <class Real, class T, class Derived>
void gather_rows(const TensorView<const T>& v, Index h, Index first, Index count,
                 Eigen::MatrixBase<Derived>& out) {
  for (Index j = 0; j < count; ++j) {
    const T* src = v.row(h, first + j);
    for (Index k = 0; k < v.dim; ++k) out(j, k) = to_real<Real>(src[k]);
  }
}

/// out (positions.size(), dim) <- rows at the given positions of head h, converted to Real.
template <class Real, class T, class Positions, class Derived>
void gather_positions(const TensorView<const T>& v, Index h, const Positions& positions,
                      Eigen::MatrixBase<Derived>& out) {
  Index r = 0;
  for (Index p : positions) {
    const T* src = v.row(h, p);
    for (Index k = 0; k < v.dim; ++k) out(r, k) = to_real<Real>(src[k]);
    ++r;
  }
}

/// Euclidean norm of one row, in Real.
template <class Real, class T>
Real row_norm(const T* x, Index d) {
  Real s = 0;
  for (Index k = 0; k < d; ++k) {
    const Real v = to_real<Real>(x[k]);
    s += v * v;
  }
  return std::sqrt(s);
}

}  // namespace kvc::detail
