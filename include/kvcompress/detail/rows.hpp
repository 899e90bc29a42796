// Private: gathering rows of strided views into dense compute-type matrices, mapping them without
// copies when the element type already is the compute type, and prefetching a head's rows ahead of a
// sweep by position.
#pragma once
#ifndef KVC_INTERNAL_INCLUDE
#error "kvcompress/detail/rows.hpp is private: include <kvcompress/kvcompress.hpp> instead"
#endif

#include "kvcompress/core.hpp"
#include "kvcompress/simd/kernels.hpp"

#include <cstdint>

// Non-temporal stores (copy_row_streaming): x86 with SSE, any compiler.
#if defined(__x86_64__) || defined(_M_X64) || defined(__SSE__) || (defined(_M_IX86_FP) && _M_IX86_FP >= 1)
#include <immintrin.h>
#define KVC_DETAIL_STREAM_STORES 1
#else
#define KVC_DETAIL_STREAM_STORES 0
#endif

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvc::detail {

/// Row-major map of `count` rows of head `h` starting at token `first`, usable when T == Real.
template <class Real>
using ConstRowsMap =
    Eigen::Map<const RowMatrix<Real>, Eigen::Unaligned, Eigen::OuterStride<Eigen::Dynamic>>;

template <class Real, class T>
ConstRowsMap<Real> map_rows(const TensorView<const T>& v, Index h, Index first, Index count) {
  static_assert(std::is_same_v<T, Real>, "map_rows needs the element type to be the compute type");
  KVC_ASSERT(v.contiguous(first, count));  // a paged view's rows are token_stride apart only inside a block
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

/// Rows [first, first+count) of head h as a (count, dim) map: in place when T is Real and the rows
/// are token_stride apart (not spanning blocks of a paged view), else converted / gathered into
/// `tile` (resized when smaller). The map is valid until `tile` changes.
template <class Real, class T>
ConstRowsMap<Real> rows_at(const TensorView<const T>& v, Index h, Index first, Index count, RowMatrix<Real>& tile) {
  if constexpr (std::is_same_v<T, Real>) {
    if (v.contiguous(first, count)) return map_rows<Real>(v, h, first, count);
  }
  if (tile.rows() < count || tile.cols() != v.dim) tile.resize(count, v.dim);
  auto rows = tile.topRows(count);
  gather_rows<Real>(v, h, first, count, rows);
  return ConstRowsMap<Real>(tile.data(), count, v.dim, Eigen::OuterStride<Eigen::Dynamic>(v.dim));
}

/// Copies the d floats at src to dst with non-temporal (streaming) stores, which write whole cache
/// lines to memory without first reading them (the read-for-ownership of an ordinary store) and
/// without keeping them in cache: the widest of 64-byte (AVX-512), 32-byte (AVX) and 16-byte (SSE)
/// stores for which dst is aligned and d is a multiple of the lane count (x86 only). Returns false,
/// having copied nothing, when none applies. The caller ends its streaming copies with
/// streaming_done() before anything else reads those rows.
inline bool copy_row_streaming(const float* src, float* dst, Index d) {
#if KVC_DETAIL_STREAM_STORES
  const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(dst);
#if defined(__AVX512F__)
  if (d % 16 == 0 && at % 64 == 0) {
    for (Index k = 0; k < d; k += 16) _mm512_stream_ps(dst + k, _mm512_loadu_ps(src + k));
    return true;
  }
#endif
#if defined(__AVX__)
  if (d % 8 == 0 && at % 32 == 0) {
    for (Index k = 0; k < d; k += 8) _mm256_stream_ps(dst + k, _mm256_loadu_ps(src + k));
    return true;
  }
#endif
  if (d % 4 == 0 && at % 16 == 0) {
    for (Index k = 0; k < d; k += 4) _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
    return true;
  }
  return false;
#else
  (void)src, (void)dst, (void)d;
  return false;
#endif
}

/// The smallest result (K and V rows of all heads, in bytes) the pipeline writes with streaming stores:
/// a smaller one may still be in cache when the caller reads it.
inline constexpr std::size_t kStreamMinBytes = std::size_t(16) << 20;

/// Bytes of a result's key and value rows: 2·m_g·d elements of `element_bytes` summed over the heads'
/// kept lists. What the pipeline compares with kStreamMinBytes.
template <class KeptLists>
std::size_t result_rows_bytes(const KeptLists& kept_per_head, Index d, std::size_t element_bytes) {
  std::size_t bytes = 0;
  for (const auto& kept : kept_per_head) bytes += kept.size() * 2 * static_cast<std::size_t>(d) * element_bytes;
  return bytes;
}

/// Orders the streaming stores before any later store (sfence), so that whoever reads the rows next
/// (another thread after a join included) sees them.
inline void streaming_done() {
#if KVC_DETAIL_STREAM_STORES
  _mm_sfence();
#endif
}

/// out (positions.size(), dim) <- rows at the given positions of head h, converted to Real.
/// Rows are requested a few positions ahead (the positions are usually ascending but need not be);
/// when no conversion is needed and out's rows are contiguous, each row is one memcpy, or with
/// `streaming` one streaming copy (copy_row_streaming, when out's rows are aligned for it): for
/// rows nobody reads soon after (the pipeline's result when no merger or compensator reads it), it
/// saves reading the destination from memory first and evicting cached data for it.
template <class Real, class T, class Positions, class Derived>
void gather_positions(const TensorView<const T>& v, Index h, const Positions& positions,
                      Eigen::MatrixBase<Derived>& out, bool streaming = false) {
  using Row = Eigen::Matrix<T, 1, Eigen::Dynamic>;
  constexpr Index kAhead = 8;
  const Index count = static_cast<Index>(positions.size());
  const auto pos = std::begin(positions);  // random access
  constexpr bool can_copy = std::is_same_v<T, Real> && bool(Derived::IsRowMajor) &&
                            bool(Derived::Flags & Eigen::DirectAccessBit);
  bool streamed = false;
  for (Index r = 0; r < count; ++r) {
    if (r + kAhead < count) {
      const T* p = v.row(h, pos[r + kAhead]);
      for (Index k = 0; k < v.dim; k += Index(64 / sizeof(T))) simd::prefetch(p + k);
    }
    if constexpr (can_copy) {
      if (out.innerStride() == 1) {
        Real* dst = &out.derived().coeffRef(r, 0);
        if constexpr (std::is_same_v<Real, float>)
          if (streaming && copy_row_streaming(v.row(h, pos[r]), dst, v.dim)) {
            streamed = true;
            continue;
          }
        std::memcpy(dst, v.row(h, pos[r]), static_cast<std::size_t>(v.dim) * sizeof(T));
        continue;
      }
    }
    out.row(r) = Eigen::Map<const Row>(v.row(h, pos[r]), v.dim).template cast<Real>();
  }
  if (streamed) streaming_done();
}

/// Writes out.row(i) = the row of head h at positions[i] (ascending), converted to Real, from inside a
/// sweep over the head by increasing position: copy_before(end, want) copies every row not passed yet
/// whose position is below `end` and for which want(i) holds, while the sweep has those rows in cache
/// (the policies that fill the result rows themselves use it instead of the pipeline's gather pass).
template <class T, class Real>
class KeptRowWriter {
 public:
  /// With `streaming`, float rows are copied with streaming stores where out's rows are aligned for
  /// them (copy_row_streaming), for a result that nothing reads soon after; finish() (or the
  /// destructor) then orders them before anything else reads the rows.
  KeptRowWriter(const TensorView<const T>& v, Index h, const std::vector<Index>& positions, RowMatrix<Real>& out,
                bool streaming = false)
      : view_(v), head_(h), positions_(positions), out_(out), streaming_(streaming) {}
  KeptRowWriter(const KeptRowWriter&) = delete;
  KeptRowWriter& operator=(const KeptRowWriter&) = delete;
  ~KeptRowWriter() { finish(); }

  void copy(Index i) {
    const T* src = view_.row(head_, positions_[static_cast<std::size_t>(i)]);
    Real* dst = out_.row(i).data();
    if constexpr (std::is_same_v<T, float> && std::is_same_v<Real, float>)
      if (streaming_ && copy_row_streaming(src, dst, view_.dim)) {
        streamed_ = true;
        return;
      }
    if constexpr (std::is_same_v<T, Real>) std::memcpy(dst, src, static_cast<std::size_t>(view_.dim) * sizeof(Real));
    else for (Index k = 0; k < view_.dim; ++k) dst[k] = to_real<Real>(src[k]);
  }

  /// Ends the streaming copies made so far (streaming_done); a no-op when there were none.
  void finish() {
    if (streamed_) streaming_done();
    streamed_ = false;
  }

  /// Rows are requested kAhead rows before they are copied (a hint; the sweep's own prefetch may
  /// already have brought them, and the last rows of a head lie past the sweep's end).
  template <class Want>
  void copy_before(Index end, Want&& want) {
    const Index m = static_cast<Index>(positions_.size());
    for (; next_ < m && positions_[static_cast<std::size_t>(next_)] < end; ++next_) {
      if (next_ + kAhead < m) {
        const T* p = view_.row(head_, positions_[static_cast<std::size_t>(next_ + kAhead)]);
        for (Index k = 0; k < view_.dim; k += Index(64 / sizeof(T))) simd::prefetch(p + k);
      }
      if (want(next_)) copy(next_);
    }
  }
  void copy_before(Index end) {
    copy_before(end, [](Index) { return true; });
  }
  void copy_rest() { copy_before(std::numeric_limits<Index>::max()); }

 private:
  static constexpr Index kAhead = 8;
  TensorView<const T> view_;
  Index head_;
  const std::vector<Index>& positions_;
  RowMatrix<Real>& out_;
  bool streaming_ = false, streamed_ = false;
  Index next_ = 0;
};

/// Software prefetch of the rows of one head of a view, in position order, a fixed number of rows
/// ahead of a front that only moves forward. For sweeps that read the head's rows roughly by
/// increasing position (evicted tokens ascending, the kept tokens of their bucket): every row is
/// requested once, `distance` positions before the sweep reaches it, so the DRAM latency of a row
/// overlaps the arithmetic on the rows before it. A hint only: results never depend on it.
template <class T>
class RowPrefetcher {
 public:
  RowPrefetcher(const TensorView<const T>& v, Index h, Index distance)
      : view_(v), head_(h), distance_(distance), line_elems_(std::max<Index>(1, Index(64 / sizeof(T)))) {}

  /// Requests every row up to position `front + distance` (exclusive) not requested yet.
  void advance_to(Index front) {
    const Index end = std::min(front + distance_, view_.tokens);
    for (; next_ < end; ++next_) {
      const T* p = view_.row(head_, next_);
      for (Index k = 0; k < view_.dim; k += line_elems_) simd::prefetch(p + k);
      if (view_.dim > 0) simd::prefetch(p + view_.dim - 1);  // last line of an unaligned row
    }
  }

 private:
  TensorView<const T> view_;
  Index head_, distance_, line_elems_;
  Index next_ = 0;
};

/// Every element of head h of v is finite: the answer of detail::head_finite. For float rows one SIMD
/// pass tests the exponent bits and reduces once per head (not once per row), with the rows
/// kScanPrefetchRows ahead prefetched; other element types go to detail::head_finite. The pipeline's
/// NaN/Inf scan of V when the scorer does not read V (SnapKV).
inline constexpr Index kScanPrefetchRows = 4;

template <class T>
bool head_finite_scan(const TensorView<const T>& v, Index h) {
  if constexpr (!std::is_same_v<T, float>) {
    return head_finite(v, h);
  } else {
    using A = simd::default_arch;
    using IB = xsimd::batch<std::uint32_t, A>;
    constexpr Index L = static_cast<Index>(IB::size);
    const IB exponent(0x7f800000u);
    auto bad = IB(0u) != IB(0u);  // all false
    bool tail_ok = true;
    RowPrefetcher<float> prefetch(v, h, kScanPrefetchRows);
    for (Index j = 0; j < v.tokens; ++j) {
      prefetch.advance_to(j + 1);
      const float* r = v.row(h, j);
      Index k = 0;
      for (; k + L <= v.dim; k += L)
        bad = bad | ((xsimd::bitwise_cast<IB>(simd::fbatch<A>::load_unaligned(r + k)) & exponent) == exponent);
      if (k < v.dim) tail_ok &= row_finite(r + k, v.dim - k);
    }
    return tail_ok && xsimd::none(bad);
  }
}

/// Row reductions in double arithmetic for the scorers that guarantee finite scores for any finite
/// cache: eight independent partial sums, which compilers vectorise, added pairwise at the end.
/// Σ x_c² over d elements of x; a float, half or bfloat16 row cannot overflow it.
template <class T>
double squared_norm_double(const T* x, Index d) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  Index c = 0;
  for (; c + 8 <= d; c += 8)
    for (int k = 0; k < 8; ++k) {
      const double v = to_real<double>(x[c + k]);
      acc[k] += v * v;
    }
  double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; c < d; ++c) {
    const double v = to_real<double>(x[c]);
    s += v * v;
  }
  return s;
}

/// Σ x_c·y_c over d elements, y in double.
template <class T>
double dot_double(const T* x, const double* y, Index d) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  Index c = 0;
  for (; c + 8 <= d; c += 8)
    for (int k = 0; k < 8; ++k) acc[k] += to_real<double>(x[c + k]) * y[c + k];
  double s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; c < d; ++c) s += to_real<double>(x[c]) * y[c];
  return s;
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
