// Private: gathering rows of strided views into dense compute-type matrices, and mapping them
// without copies when the element type already is the compute type.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#error "kvcompress/detail/rows.hpp is private: include <kvcompress/kvcompress.hpp> instead"
#endif

#include "kvcompress/core.hpp"
#include "kvcompress/simd/kernels.hpp"

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
  using Row = Eigen::Matrix<T, 1, Eigen::Dynamic>;
  for (Index j = 0; j < count; ++j)  // one vectorised copy / conversion per row
    out.row(j) = Eigen::Map<const Row>(v.row(h, first + j), v.dim).template cast<Real>();
}

/// out (positions.size(), dim) <- rows at the given positions of head h, converted to Real.
template <class Real, class T, class Positions, class Derived>
void gather_positions(const TensorView<const T>& v, Index h, const Positions& positions,
                      Eigen::MatrixBase<Derived>& out) {
  using Row = Eigen::Matrix<T, 1, Eigen::Dynamic>;
  Index r = 0;
  for (Index p : positions) out.row(r++) = Eigen::Map<const Row>(v.row(h, p), v.dim).template cast<Real>();
}

/// Euclidean norm of one row, in Real (SIMD for float arithmetic, a serial loop for double).
template <class Real, class T>
Real row_norm(const T* x, Index d) {
  if constexpr (std::is_same_v<Real, float> && !std::is_same_v<T, double>)
    return simd::norm<simd::default_arch>(x, d);
  Real s = 0;
  for (Index k = 0; k < d; ++k) {
    const Real v = to_real<Real>(x[k]);
    s += v * v;
  }
  return std::sqrt(s);
}

}  // namespace kvc::detail
