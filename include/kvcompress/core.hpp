// kvcompress core: version, macros, errors, element types, strided views and shape checks.
//
// This header depends on Eigen/Core only (no SIMD, no threads) so that an engine can include it in
// the translation units that merely describe its cache memory.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// The one place the version is written (CMakeLists.txt reads these three lines).
#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 1
#define KVC_VERSION_PATCH 0
#define KVC_DETAIL_STR(x) #x
#define KVC_DETAIL_XSTR(x) KVC_DETAIL_STR(x)
/// "MAJOR.MINOR.PATCH", made from the three macros above.
#define KVC_VERSION_STRING \
  KVC_DETAIL_XSTR(KVC_VERSION_MAJOR) "." KVC_DETAIL_XSTR(KVC_VERSION_MINOR) "." KVC_DETAIL_XSTR(KVC_VERSION_PATCH)

/// Internal invariant check. Off unless KVC_ENABLE_ASSERTS is defined (or NDEBUG is not defined and
/// KVC_DISABLE_ASSERTS is not). Override by defining KVC_ASSERT before including any kvcompress header.
#ifndef KVC_ASSERT
#if defined(KVC_ENABLE_ASSERTS) || (!defined(NDEBUG) && !defined(KVC_DISABLE_ASSERTS))
#include <cassert>
#define KVC_ASSERT(cond) assert(cond)
#else
#define KVC_ASSERT(cond) ((void)0)
#endif
#endif

namespace kvc {

using Index = std::ptrdiff_t;

inline constexpr const char* version_string() { return KVC_VERSION_STRING; }

// -------------------------------------------------------------------------------------------------
// Errors
// -------------------------------------------------------------------------------------------------

/// Thrown by the throwing entry points (`Pipeline::run`, `compact_into`, ...) for bad caller input.
/// The message names the offending field and its value.
class error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Result of a non-throwing `validate(...)`: ok, or the first problem found with a message.
class Status {
 public:
  enum class Code { ok, invalid_shape, invalid_budget, invalid_argument, non_finite, aliasing };

  Status() = default;
  static Status ok() { return {}; }
  static Status fail(Code code, std::string message) { return Status(code, std::move(message)); }

  bool is_ok() const { return code_ == Code::ok; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  /// Throws kvc::error with the message unless ok.
  void throw_if_error() const {
    if (!is_ok()) throw error(message_);
  }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::ok;
  std::string message_;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

/// Working memory a value type carries for the policy that fills it (Selection, Routing,
/// MergeOutput), so that a reused object needs no allocation. It is not part of the owner's value:
/// a copy starts with an empty T, and a copy assignment leaves the target's own T in place (moves
/// move it).
template <class T>
class NotCopied {
 public:
  NotCopied() = default;
  NotCopied(const NotCopied&) : value_() {}
  NotCopied(NotCopied&&) = default;
  NotCopied& operator=(const NotCopied&) { return *this; }
  NotCopied& operator=(NotCopied&&) = default;
  ~NotCopied() = default;
  T& operator*() { return value_; }
  const T& operator*() const { return value_; }
  T* operator->() { return &value_; }
  const T* operator->() const { return &value_; }

 private:
  T value_;
};
}  // namespace detail

/// Evaluates a Status-returning expression and returns it from the enclosing function if it failed.
#define KVC_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kvc::Status kvc_status_ = (expr);        \
    if (!kvc_status_.is_ok()) return kvc_status_; \
  } while (0)

// -------------------------------------------------------------------------------------------------
// Element types
// -------------------------------------------------------------------------------------------------

/// The element types a cache may hold. Arithmetic happens in `compute_t<T>`: float, or double for
/// reference runs on double input.
template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, Eigen::half> ||
    std::is_same_v<T, Eigen::bfloat16>;

template <class T>
using compute_t = std::conditional_t<std::is_same_v<std::remove_const_t<T>, double>, double, float>;

template <class Real, class T>
inline Real to_real(T x) {
  return static_cast<Real>(x);
}
template <class Real>
inline Real to_real(Eigen::half x) {
  return static_cast<Real>(static_cast<float>(x));
}
template <class Real>
inline Real to_real(Eigen::bfloat16 x) {
  return static_cast<Real>(static_cast<float>(x));
}

template <class T, class Real>
inline T from_real(Real x) {
  if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    return T(static_cast<float>(x));
  } else {
    return static_cast<T>(x);
  }
}

namespace detail {

/// The smallest positive Real that from_real<T> turns into ±Inf (found once by bisection over the
/// bit patterns of positive Reals, whose order is their values' order), or +Inf when every finite
/// Real converts to a finite T. |x| < limit ⇔ x converts to a finite T (false for NaN too).
template <class T, class Real>
Real overflow_limit() {
  static const Real limit = [] {
    using Bits = std::conditional_t<sizeof(Real) == 8, std::uint64_t, std::uint32_t>;
    static_assert(sizeof(Real) == sizeof(Bits), "Real must be float or double");
    const auto finite_as_t = [](Bits b) {
      Real x;
      std::memcpy(&x, &b, sizeof x);
      return std::isfinite(to_real<double>(from_real<T>(x)));
    };
    const Real top = std::numeric_limits<Real>::max();
    Bits lo, hi;  // finite_as_t(lo), !finite_as_t(hi)
    std::memcpy(&hi, &top, sizeof hi);
    if (finite_as_t(hi)) return std::numeric_limits<Real>::infinity();
    const Real one = 1;
    std::memcpy(&lo, &one, sizeof lo);
    while (hi - lo > 1) {
      const Bits mid = lo + (hi - lo) / 2;
      (finite_as_t(mid) ? lo : hi) = mid;
    }
    Real x;
    std::memcpy(&x, &hi, sizeof x);
    return x;
  }();
  return limit;
}

/// The first entry of M (rows, cols) that does not convert to a finite T: its row and column, or
/// false when every entry does. One branch-free pass per row (vectorised by the compiler; Eigen's
/// all() would test coefficient by coefficient); the search runs on the error path only.
template <class T, class Derived>
bool find_unrepresentable(const Eigen::MatrixBase<Derived>& M, Index& row, Index& col) {
  using Real = typename Derived::Scalar;
  const Real limit = overflow_limit<T, Real>();
  for (Index i = 0; i < M.rows(); ++i) {
    unsigned bad = 0;
    for (Index c = 0; c < M.cols(); ++c) bad |= static_cast<unsigned>(!(std::abs(M(i, c)) < limit));  // NaN too
    if (bad == 0) continue;
    for (Index c = 0; c < M.cols(); ++c)
      if (!(std::abs(M(i, c)) < limit)) {
        row = i;
        col = c;
        return true;
      }
  }
  return false;
}

}  // namespace detail

// Dense row-major helpers used throughout (row = token or query, column = feature).
template <class Real>
using RowMatrix = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class Real>
using Vector = Eigen::Matrix<Real, Eigen::Dynamic, 1>;

// -------------------------------------------------------------------------------------------------
// Views
// -------------------------------------------------------------------------------------------------

/// Zero-copy strided view of a rank-3 tensor `[heads][tokens][dim]` with unit stride inside a vector.
/// `T` may be const-qualified. Strides are in elements.
///
///   HF / vLLM per layer  [H][n][d]: head_stride = n*d, token_stride = d   (make_head_major)
///   llama.cpp            [n][H][d]: head_stride = d,   token_stride = H*d (make_token_major)
///
/// Paged (`blocks` non-null): a pool of `num_blocks` fixed-size blocks of `block_size` tokens, block b
/// at data + b·block_stride, and a block table: token j lives in block blocks[(offset + j) / block_size]
/// at row (offset + j) % block_size, where head_stride and token_stride apply (make_paged_token_major,
/// make_paged_head_major). Every stage reads such a view in place; runs of rows inside one block are
/// token_stride apart (contiguous_from).
template <class T>
struct TensorView {
  T* data = nullptr;
  Index heads = 0;
  Index tokens = 0;
  Index dim = 0;
  Index head_stride = 0;
  Index token_stride = 0;
  const std::int32_t* blocks = nullptr;  ///< block table (paged views only), one id per block of tokens
  Index block_size = 0;                  ///< tokens per block (paged)
  Index block_stride = 0;                ///< elements between blocks of the pool (paged)
  Index num_blocks = 0;                  ///< blocks in the pool: every id is below it (paged)
  Index offset = 0;                      ///< row of token 0 in blocks[0], < block_size (paged)

  using element_type = std::remove_const_t<T>;

  bool paged() const { return blocks != nullptr; }

  /// Pointer to the vector of head `h`, token `j` (`dim` contiguous elements).
  T* row(Index h, Index j) const {
    if (blocks == nullptr) return data + h * head_stride + j * token_stride;
    const Index t = offset + j;
    return data + static_cast<Index>(blocks[block_of(t)]) * block_stride + h * head_stride +
           (t - block_of(t) * block_size) * token_stride;
  }

  /// How many rows from token j on lie token_stride apart (all the remaining ones unless paged).
  Index contiguous_from(Index j) const {
    if (blocks == nullptr) return tokens - j;
    const Index t = offset + j, left = (block_of(t) + 1) * block_size - t;
    return left < tokens - j ? left : tokens - j;
  }
  /// Whether rows [first, first + count) lie token_stride apart.
  bool contiguous(Index first, Index count) const { return blocks == nullptr || contiguous_from(first) >= count; }

  /// Contiguous head-major view over a buffer laid out `[heads][tokens][dim]`.
  static TensorView head_major(T* data, Index heads, Index tokens, Index dim) {
    return {data, heads, tokens, dim, tokens * dim, dim};
  }
  /// Contiguous token-major view over a buffer laid out `[tokens][heads][dim]`.
  static TensorView token_major(T* data, Index tokens, Index heads, Index dim) {
    return {data, heads, tokens, dim, dim, heads * dim};
  }

  /// The same memory seen as const.
  TensorView<const element_type> as_const() const {
    return {data, heads, tokens, dim, head_stride, token_stride, blocks, block_size, block_stride, num_blocks, offset};
  }

  /// Sub-view of tokens [first, first + count) of every head (no copy).
  TensorView token_range(Index first, Index count) const {
    TensorView r = *this;
    r.tokens = count;
    if (blocks == nullptr) {
      r.data = data + first * token_stride;
    } else {
      const Index t = offset + first;
      r.blocks = blocks + block_of(t);
      r.offset = t - block_of(t) * block_size;
    }
    return r;
  }

 private:
  /// t / block_size: a shift when block_size is a power of two (as engines' page sizes are).
  Index block_of(Index t) const {
    if ((block_size & (block_size - 1)) != 0) return t / block_size;
#if defined(__GNUC__) || defined(__clang__)
    return t >> __builtin_ctzll(static_cast<unsigned long long>(block_size));
#else
    Index s = 0;
    while ((Index(1) << s) < block_size) ++s;
    return t >> s;
#endif
  }
};

template <class T>
TensorView<T> make_head_major(T* data, Index heads, Index tokens, Index dim) {
  return TensorView<T>::head_major(data, heads, tokens, dim);
}
template <class T>
TensorView<T> make_token_major(T* data, Index tokens, Index heads, Index dim) {
  return TensorView<T>::token_major(data, tokens, heads, dim);
}

/// Paged cache laid out `[num_blocks][block_size][heads][dim]` (vLLM's flash-attention layout),
/// `tokens` entries reached through `block_table` (ceil(tokens / block_size) block ids).
template <class T>
TensorView<T> make_paged_token_major(T* pool, Index num_blocks, Index block_size, Index heads, Index dim,
                                     const std::int32_t* block_table, Index tokens) {
  return {pool, heads, tokens, dim, dim, heads * dim, block_table, block_size, block_size * heads * dim, num_blocks, 0};
}
/// Paged cache laid out `[num_blocks][heads][block_size][dim]` (OpenVINO's and vLLM's paged-attention
/// layout), `tokens` entries reached through `block_table`.
template <class T>
TensorView<T> make_paged_head_major(T* pool, Index num_blocks, Index heads, Index block_size, Index dim,
                                    const std::int32_t* block_table, Index tokens) {
  return {pool, heads, tokens, dim, block_size * dim, dim, block_table, block_size, heads * block_size * dim, num_blocks, 0};
}

/// Additive logit bias `[heads][length]` with a head stride; entries at or beyond `length` are 0.
template <class Real>
struct BiasView {
  const Real* data = nullptr;
  Index heads = 0;
  Index length = 0;
  Index head_stride = 0;
  Real at(Index g, Index i) const { return (data && i < length) ? data[g * head_stride + i] : Real(0); }
};

/// Original positions `[heads][length]` with a head stride (entry i of head g at
/// data[g * head_stride + i]); absent (data null): entry i is at position i.
struct PositionView {
  const Index* data = nullptr;
  Index heads = 0;
  Index length = 0;
  Index head_stride = 0;
  Index at(Index g, Index i) const { return data ? data[g * head_stride + i] : i; }
};

/// A layer's attention output projection W_o `[D][Hq·d]` in float for every cache type (row r at
/// data + r·row_stride; column h·d + c multiplies channel c of query head h): llama2.c's `wo`, HF's
/// `o_proj.weight`. Absent (data null): only scorers that read it (CriticalKV) need it.
struct ProjectionView {
  const float* data = nullptr;
  Index rows = 0;        // D, the model dimension
  Index cols = 0;        // Hq·d
  Index row_stride = 0;  // >= cols
  float at(Index r, Index c) const { return data[r * row_stride + c]; }
};

/// One layer of one sequence as the engine cached it (SPEC §1).
///   keys, values : [Hkv][n][d]   post-RoPE keys and values
///   queries      : [Hq][W][d]    post-RoPE queries of the last W positions (cache entries n-W .. n-1)
///   positions    : [Hkv][n]      optional: the RoPE position each key was rotated at (absent: 0..n-1)
///   bias         : [Hkv][<=n]    optional: each entry's additive logit bias from an earlier
///                                compression (absent, or entries beyond its length: 0)
///   output_projection : [D][Hq·d] optional: the layer's W_o, float (read by CriticalKV's scorer)
/// A LayerResult handed back as the next view: docs/integration.md ("Compressing again").
template <class T>
struct LayerView {
  TensorView<const T> keys;
  TensorView<const T> values;
  TensorView<const T> queries;
  PositionView positions{};
  BiasView<compute_t<T>> bias{};
  ProjectionView output_projection{};

  /// Whether entries carry a stored bias (the window attention adds it to its logits).
  bool biased() const { return bias.data != nullptr && bias.length > 0; }

  Index kv_heads() const { return keys.heads; }
  Index query_heads() const { return queries.heads; }
  Index tokens() const { return keys.tokens; }
  Index head_dim() const { return keys.dim; }
  Index group_size() const { return keys.heads > 0 ? queries.heads / keys.heads : 0; }
  /// Effective window: W clamped to n (SPEC §1); the last `window()` query rows are used.
  Index window() const { return queries.tokens < keys.tokens ? queries.tokens : keys.tokens; }
};

// -------------------------------------------------------------------------------------------------
// Shape and content checks (non-throwing)
// -------------------------------------------------------------------------------------------------

namespace detail {

/// out = a * b, or false when the product overflows Index (out is then unspecified).
inline bool checked_mul(Index a, Index b, Index& out) {
#if defined(__GNUC__) || defined(__clang__)
  return !__builtin_mul_overflow(a, b, &out);
#else
  if (a != 0 && b != 0) {
    const Index hi = std::numeric_limits<Index>::max(), lo = std::numeric_limits<Index>::min();
    if (a > 0 ? (b > 0 ? a > hi / b : b < lo / a) : (b > 0 ? a < lo / b : a < hi / b)) return false;
  }
  out = a * b;
  return true;
#endif
}

/// out = a + b, or false when the sum overflows Index (out is then unspecified).
inline bool checked_add(Index a, Index b, Index& out) {
#if defined(__GNUC__) || defined(__clang__)
  return !__builtin_add_overflow(a, b, &out);
#else
  if ((b > 0 && a > std::numeric_limits<Index>::max() - b) || (b < 0 && a < std::numeric_limits<Index>::min() - b))
    return false;
  out = a + b;
  return true;
#endif
}

/// The most bytes a view may span. No 64-bit platform gives a process more than 2^57 bytes of
/// address space (x86-64 with 5-level paging; AArch64 has at most 52 bits), so a view claiming more
/// describes no memory; elsewhere the limit is PTRDIFF_MAX.
inline constexpr Index kMaxViewBytes =
    sizeof(void*) >= 8 ? (Index(1) << (sizeof(void*) >= 8 ? 57 : 0)) : std::numeric_limits<Index>::max();

/// Bytes from the first to one past the last element of a view with non-negative strides and
/// positive extents: ((heads−1)·head_stride + (tokens−1)·token_stride + dim)·sizeof(T), overflow
/// checked; for a paged view, of its whole pool: (num_blocks−1)·block_stride + the span of one block.
/// False when it overflows or exceeds kMaxViewBytes, or when data + span wraps the address space.
template <class T>
bool view_span_bytes(const TensorView<T>& v, Index& bytes) {
  Index a = 0, b = 0, s = 0, p = 0;
  const Index rows = v.paged() ? v.block_size : v.tokens;
  if (!checked_mul(v.heads - 1, v.head_stride, a) || !checked_mul(rows - 1, v.token_stride, b) ||
      !checked_add(a, b, s) || !checked_add(s, v.dim, s))
    return false;
  if (v.paged() && (!checked_mul(v.num_blocks - 1, v.block_stride, p) || !checked_add(s, p, s))) return false;
  if (!checked_mul(s, static_cast<Index>(sizeof(std::remove_const_t<T>)), bytes) || bytes > kMaxViewBytes)
    return false;
  const auto start = reinterpret_cast<std::uintptr_t>(v.data);
  return start <= std::numeric_limits<std::uintptr_t>::max() - static_cast<std::uintptr_t>(bytes);
}

/// Rows of a view must not overlap: with the smaller stride s1 over c1 entries and the larger s2,
/// a view is alias-free when s1 >= dim and s2 >= s1 * c1 (dimensions of extent 1 are ignored).
/// When s1 * c1 overflows it exceeds s2: the rows alias.
/// A paged view: the rows of one block (`block_size` tokens) must not overlap, nor the blocks
/// (block_stride at least one block's span), nor two entries of its block table (checked_blocks).
template <class T>
bool rows_disjoint(const TensorView<T>& v) {
  if (v.head_stride < 0 || v.token_stride < 0) return false;
  Index s[2] = {v.head_stride, v.token_stride};
  Index c[2] = {v.heads, v.paged() ? v.block_size : v.tokens};
  int active = 0;
  Index as[2] = {0, 0}, ac[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    if (c[k] > 1) {
      as[active] = s[k];
      ac[active] = c[k];
      ++active;
    }
  }
  if (active == 0) return true;
  if (active == 1) return as[0] >= v.dim;
  if (as[0] > as[1]) {
    std::swap(as[0], as[1]);
    std::swap(ac[0], ac[1]);
  }
  Index block = 0;
  return as[0] >= v.dim && checked_mul(as[0], ac[0], block) && as[1] >= block;
}

/// The paging of a view: block_size >= 1, 0 <= offset < block_size, num_blocks >= 1, blocks no
/// closer than one block's span, and the table's ceil((offset + tokens) / block_size) entries each in
/// [0, num_blocks) and distinct (a repeated id would make two tokens one row). O(entries), with a
/// bitmap of the pool's ids (or, for a pool much larger than the table, the table's ids sorted) kept
/// per thread and allocated once.
template <class T>
Status check_blocks(const TensorView<T>& v, const char* name) {
  Index a = 0, b = 0, span = 0;
  if (!checked_mul(v.heads - 1, v.head_stride, a) || !checked_mul(v.block_size - 1, v.token_stride, b) ||
      !checked_add(a, b, span) || !checked_add(span, v.dim, span))
    return Status::fail(Status::Code::invalid_shape, concat(name, ": one block's span overflows"));
  if (v.num_blocks > 1 && v.block_stride < span)
    return Status::fail(Status::Code::aliasing,
                        concat(name, ": block_stride=", v.block_stride, " is below one block's span (", span,
                               " elements): blocks would overlap"));
  Index pool_rows = 0;
  if (!checked_mul(v.num_blocks, v.block_size, pool_rows) || v.tokens > pool_rows - v.offset)
    return Status::fail(Status::Code::invalid_shape,
                        concat(name, ": ", v.tokens, " tokens from row ", v.offset, " do not fit in ", v.num_blocks,
                               " blocks of ", v.block_size));
  const Index entries = (v.offset + v.tokens - 1) / v.block_size + 1;
  for (Index e = 0; e < entries; ++e) {
    const Index id = v.blocks[e];
    if (id < 0 || id >= v.num_blocks)
      return Status::fail(Status::Code::invalid_argument,
                          concat(name, ": block table entry ", e, " (tokens ", std::max<Index>(0, e * v.block_size - v.offset),
                                 "..) is block ", id, ", outside [0, ", v.num_blocks, ")"));
  }
  const auto repeated = [&](Index id) {
    for (Index e = 0; e < entries; ++e)
      if (v.blocks[e] == id)
        return Status::fail(Status::Code::aliasing, concat(name, ": block ", id, " appears twice in the block table (entry ",
                                                           e, "): two tokens would share a row"));
    return Status::ok();
  };
  if (v.num_blocks <= 64 * entries + 4096) {  // a bitmap of the pool's ids
    thread_local std::vector<std::uint64_t> seen;
    const std::size_t words = static_cast<std::size_t>((v.num_blocks + 63) / 64);
    if (seen.size() < words) seen.resize(words);
    std::fill(seen.begin(), seen.begin() + static_cast<std::ptrdiff_t>(words), std::uint64_t(0));
    for (Index e = 0; e < entries; ++e) {
      std::uint64_t& w = seen[static_cast<std::size_t>(v.blocks[e] / 64)];
      const std::uint64_t bit = std::uint64_t(1) << (v.blocks[e] % 64);
      if (w & bit) return repeated(v.blocks[e]);
      w |= bit;
    }
  } else {  // a pool much larger than the table: the table's ids, sorted
    thread_local std::vector<std::int32_t> ids;
    ids.assign(v.blocks, v.blocks + entries);
    std::sort(ids.begin(), ids.end());
    for (std::size_t i = 1; i < ids.size(); ++i)
      if (ids[i] == ids[i - 1]) return repeated(ids[i]);
  }
  return Status::ok();
}

template <class T>
Status check_view(const TensorView<T>& v, const char* name) {
  if (v.heads <= 0 || v.tokens <= 0 || v.dim <= 0)
    return Status::fail(Status::Code::invalid_shape,
                        concat(name, ": every dimension must be positive, got [heads=", v.heads,
                               "][tokens=", v.tokens, "][dim=", v.dim, "]"));
  if (v.data == nullptr)
    return Status::fail(Status::Code::invalid_argument, concat(name, ": data is null"));
  if (v.paged() && (v.block_size < 1 || v.num_blocks < 1 || v.offset < 0 || v.offset >= v.block_size || v.block_stride < 0))
    return Status::fail(Status::Code::invalid_shape,
                        concat(name, ": paged view needs block_size >= 1, num_blocks >= 1, block_stride >= 0 and ",
                               "0 <= offset < block_size, got block_size=", v.block_size, ", num_blocks=", v.num_blocks,
                               ", block_stride=", v.block_stride, ", offset=", v.offset));
  if (!rows_disjoint(v))
    return Status::fail(Status::Code::aliasing,
                        concat(name, ": strides alias (head_stride=", v.head_stride,
                               ", token_stride=", v.token_stride, ", dim=", v.dim,
                               "): rows would overlap"));
  Index bytes = 0;
  if (!view_span_bytes(v, bytes))
    return Status::fail(Status::Code::invalid_shape,
                        concat(name, ": [heads=", v.heads, "][tokens=", v.tokens, "][dim=", v.dim,
                               "] with head_stride=", v.head_stride, ", token_stride=", v.token_stride,
                               v.paged() ? concat(", ", v.num_blocks, " blocks of ", v.block_size, " tokens ", v.block_stride, " apart") : std::string(),
                               " spans more than ", kMaxViewBytes, " bytes or past the end of the address space"));
  if (v.paged()) return check_blocks(v, name);
  return Status::ok();
}

/// Bit pattern test for NaN/Inf: the exponent field is all ones. Branch-free over a row, so the
/// compiler vectorises it (a scalar std::isfinite per element costs a fifth of the window product).
template <class T>
bool row_finite(const T* r, Index d) {
  using E = std::remove_const_t<T>;
  if constexpr (std::is_same_v<E, float>) {
    std::uint32_t bad = 0;
    for (Index k = 0; k < d; ++k) {
      std::uint32_t b;
      std::memcpy(&b, r + k, sizeof b);
      bad |= static_cast<std::uint32_t>((b & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
  } else if constexpr (std::is_same_v<E, double>) {
    std::uint64_t bad = 0;
    for (Index k = 0; k < d; ++k) {
      std::uint64_t b;
      std::memcpy(&b, r + k, sizeof b);
      bad |= static_cast<std::uint64_t>((b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull);
    }
    return bad == 0;
  } else {  // Eigen::half (exponent 0x7c00) and Eigen::bfloat16 (exponent 0x7f80), 16 bits each
    static_assert(sizeof(E) == 2, "unexpected element type");
    constexpr std::uint16_t mask = std::is_same_v<E, Eigen::half> ? 0x7c00u : 0x7f80u;
    std::uint32_t bad = 0;
    for (Index k = 0; k < d; ++k) {
      std::uint16_t b;
      std::memcpy(&b, r + k, sizeof b);
      bad |= static_cast<std::uint32_t>((b & mask) == mask);
    }
    return bad == 0;
  }
}

/// Every element of head h of v is finite (one branch-free pass over its rows).
template <class T>
bool head_finite(const TensorView<T>& v, Index h) {
  bool ok = true;
  for (Index j = 0; j < v.tokens; ++j) ok &= row_finite(v.row(h, j), v.dim);
  return ok;
}

template <class T>
Status check_finite(const TensorView<T>& v, const char* name) {
  for (Index h = 0; h < v.heads; ++h) {
    if (head_finite(v, h)) continue;
    for (Index j = 0; j < v.tokens; ++j) {  // locate the first one for the message
      const auto* r = v.row(h, j);
      if (row_finite(r, v.dim)) continue;
      for (Index k = 0; k < v.dim; ++k) {
        const double x = to_real<double>(r[k]);
        if (!std::isfinite(x))
          return Status::fail(Status::Code::non_finite,
                              concat(name, "[", h, "][", j, "][", k, "] is not finite (", x, ")"));
      }
    }
  }
  return Status::ok();
}

}  // namespace detail

namespace detail {

/// The stored positions: [kv heads][n] (length = n), a non-null pointer, head_stride >= n with more
/// than one head, every position >= 0 and strictly increasing along each head (the kept positions of
/// a result ascend, and the causal window mask is by entry order). O(Hkv·n).
template <class T>
Status check_positions(const LayerView<T>& layer) {
  const PositionView& p = layer.positions;
  if (p.data == nullptr) {
    if (p.heads != 0 || p.length != 0)
      return Status::fail(Status::Code::invalid_argument,
                          concat("positions: data is null but the shape is [", p.heads, "][", p.length, "]"));
    return Status::ok();
  }
  if (p.heads != layer.kv_heads() || p.length != layer.tokens())
    return Status::fail(Status::Code::invalid_shape,
                        concat("positions: shape [", p.heads, "][", p.length, "] differs from [kv heads=",
                               layer.kv_heads(), "][tokens=", layer.tokens(), "]"));
  if (p.head_stride < 0 || (p.heads > 1 && p.head_stride < p.length))
    return Status::fail(Status::Code::aliasing,
                        concat("positions: head_stride ", p.head_stride, " must be >= length ", p.length,
                               " (rows would overlap)"));
  for (Index g = 0; g < p.heads; ++g)
    for (Index j = 0; j < p.length; ++j) {
      const Index x = p.at(g, j);
      if (x < 0 || (j > 0 && x <= p.at(g, j - 1)))
        return Status::fail(Status::Code::invalid_argument,
                            concat("positions[", g, "][", j, "] = ", x, ": positions must be >= 0 and strictly ",
                                   "increasing along each head", j > 0 ? concat(" (previous ", p.at(g, j - 1), ")") : ""));
    }
  return Status::ok();
}

/// The output projection when present: [rows >= 1][query heads·head dim], a non-null pointer,
/// row_stride >= cols; with `required`, absent is an error naming `who`. With `scan`, every entry finite.
template <class T>
Status check_output_projection(const LayerView<T>& layer, bool required, bool scan, const char* who = "") {
  const ProjectionView& w = layer.output_projection;
  if (w.data == nullptr) {
    if (w.rows != 0 || w.cols != 0)
      return Status::fail(Status::Code::invalid_shape, concat("output_projection: data is null but the shape is [",
                                                               w.rows, "][", w.cols, "]"));
    if (required)
      return Status::fail(Status::Code::invalid_argument,
                          concat("output_projection: ", who, " needs the layer's output projection W_o ([model dim][",
                                 "query heads=", layer.query_heads(), " x head dim=", layer.head_dim(),
                                 "], LayerView::output_projection), which is absent"));
    return Status::ok();
  }
  Index cols = 0;
  if (!checked_mul(layer.query_heads(), layer.head_dim(), cols) || w.cols != cols || w.rows < 1)
    return Status::fail(Status::Code::invalid_shape,
                        concat("output_projection: shape [", w.rows, "][", w.cols, "] must be [model dim >= 1][query ",
                               "heads=", layer.query_heads(), " x head dim=", layer.head_dim(), "]"));
  if (w.row_stride < w.cols)
    return Status::fail(Status::Code::invalid_shape, concat("output_projection: row_stride ", w.row_stride,
                                                             " must be >= cols ", w.cols));
  Index elements = 0;
  if (!checked_mul(w.rows, w.row_stride, elements) || elements > kMaxViewBytes / static_cast<Index>(sizeof(float)))
    return Status::fail(Status::Code::invalid_shape, concat("output_projection: [", w.rows, "] rows of stride ",
                                                             w.row_stride, " exceed ", kMaxViewBytes, " bytes"));
  if (scan)
    for (Index r = 0; r < w.rows; ++r)
      for (Index c = 0; c < w.cols; ++c)
        if (!std::isfinite(w.at(r, c)))
          return Status::fail(Status::Code::non_finite,
                              concat("output_projection[", r, "][", c, "] is not finite (", w.at(r, c), ")"));
  return Status::ok();
}

/// The stored bias: [kv heads][length <= n], a non-null pointer when length > 0, head_stride >= length
/// with more than one head; with `scan` every entry finite (−inf would hide an entry: evict it instead).
template <class T>
Status check_bias(const LayerView<T>& layer, bool scan) {
  const auto& b = layer.bias;
  if (b.data == nullptr) {
    if (b.heads != 0 || b.length != 0)
      return Status::fail(Status::Code::invalid_argument,
                          concat("bias: data is null but the shape is [", b.heads, "][", b.length, "]"));
    return Status::ok();
  }
  if (b.heads != layer.kv_heads() || b.length < 0 || b.length > layer.tokens())
    return Status::fail(Status::Code::invalid_shape,
                        concat("bias: shape [", b.heads, "][", b.length, "] must be [kv heads=", layer.kv_heads(),
                               "][length <= tokens=", layer.tokens(), "]"));
  if (b.head_stride < 0 || (b.heads > 1 && b.head_stride < b.length))
    return Status::fail(Status::Code::aliasing,
                        concat("bias: head_stride ", b.head_stride, " must be >= length ", b.length,
                               " (rows would overlap)"));
  if (scan)
    for (Index g = 0; g < b.heads; ++g)
      for (Index j = 0; j < b.length; ++j)
        if (!std::isfinite(b.at(g, j)))
          return Status::fail(Status::Code::non_finite, concat("bias[", g, "][", j, "] is not finite (", b.at(g, j), ")"));
  return Status::ok();
}

/// validate_layer with the NaN/Inf scans of K, V and the window queries separable (the pipeline folds
/// the K and V scans into the stages that read them anyway).
template <class T>
Status validate_layer_impl(const LayerView<T>& layer, bool check_keys, bool check_values, bool check_queries) {
  KVC_RETURN_IF_ERROR(detail::check_view(layer.keys, "keys"));
  KVC_RETURN_IF_ERROR(detail::check_view(layer.values, "values"));
  KVC_RETURN_IF_ERROR(detail::check_view(layer.queries, "queries"));
  using detail::concat;
  if (layer.values.heads != layer.keys.heads || layer.values.tokens != layer.keys.tokens ||
      layer.values.dim != layer.keys.dim)
    return Status::fail(Status::Code::invalid_shape,
                        concat("values: shape [", layer.values.heads, "][", layer.values.tokens, "][",
                               layer.values.dim, "] differs from keys [", layer.keys.heads, "][",
                               layer.keys.tokens, "][", layer.keys.dim, "]"));
  if (layer.queries.dim != layer.keys.dim)
    return Status::fail(Status::Code::invalid_shape,
                        concat("queries.dim = ", layer.queries.dim, " differs from keys.dim = ",
                               layer.keys.dim));
  if (layer.queries.heads % layer.keys.heads != 0)
    return Status::fail(Status::Code::invalid_shape,
                        concat("query heads (", layer.queries.heads,
                               ") must be a multiple of KV heads (", layer.keys.heads, ")"));
  // The window stage holds (G·W, n) probabilities of one KV head in compute_t<T>.
  Index rows = 0, elements = 0, bytes = 0;
  if (!checked_mul(layer.group_size(), layer.window(), rows) || !checked_mul(rows, layer.tokens(), elements) ||
      !checked_mul(elements, static_cast<Index>(sizeof(compute_t<T>)), bytes) || bytes > kMaxViewBytes)
    return Status::fail(Status::Code::invalid_shape,
                        concat("window attention of (group size ", layer.group_size(), " x window ", layer.window(),
                               ") rows over tokens=", layer.tokens(), " needs more than ", kMaxViewBytes, " bytes"));
  KVC_RETURN_IF_ERROR(detail::check_positions(layer));
  KVC_RETURN_IF_ERROR(detail::check_bias(layer, check_queries));
  KVC_RETURN_IF_ERROR(detail::check_output_projection(layer, /*required=*/false, /*scan=*/false));
  if (check_keys) KVC_RETURN_IF_ERROR(detail::check_finite(layer.keys, "keys"));
  if (check_values) KVC_RETURN_IF_ERROR(detail::check_finite(layer.values, "values"));
  if (check_queries)  // only the last window() query rows are read
    KVC_RETURN_IF_ERROR(detail::check_finite(
        layer.queries.token_range(layer.queries.tokens - layer.window(), layer.window()), "queries"));
  return Status::ok();
}
}  // namespace detail

/// Checks shapes, strides and (optionally) finiteness of a layer, with its stored positions (always:
/// shape, >= 0, strictly increasing per head) and bias (shape; finite when `check_values`).
/// O(n·d·H) when `check_values`.
template <class T>
Status validate_layer(const LayerView<T>& layer, bool check_values = true) {
  return detail::validate_layer_impl(layer, check_values, check_values, check_values);
}

// -------------------------------------------------------------------------------------------------
// Budget (SPEC §3)
// -------------------------------------------------------------------------------------------------

/// Entries kept per KV head: a retention ratio rho in (0, 1] (m = floor(rho * n)) or an absolute m.
class Budget {
 public:
  static Budget ratio(double rho) { return Budget(true, rho, 0); }
  static Budget tokens(Index m) { return Budget(false, 0.0, m); }

  bool is_ratio() const { return is_ratio_; }
  double rho() const { return rho_; }
  Index absolute() const { return m_; }

  Status validate() const {
    if (is_ratio_) {
      if (!(rho_ > 0.0 && rho_ <= 1.0))
        return Status::fail(Status::Code::invalid_budget,
                            detail::concat("budget ratio must be in (0, 1], got ", rho_));
    } else if (m_ <= 0) {
      return Status::fail(Status::Code::invalid_budget,
                          detail::concat("budget must be a positive token count, got ", m_));
    }
    return Status::ok();
  }

  /// m for a cache of n tokens, before clamping to n. May be 0 for a tiny ratio (invalid).
  Index resolve(Index n) const {
    if (!is_ratio_) return m_;
    // floor(rho * n) with a guard against 0.3 * 10 = 2.9999999
    const double x = rho_ * static_cast<double>(n);
    Index m = static_cast<Index>(std::floor(x + 1e-9 * (x + 1.0)));
    return m;
  }

 private:
  Budget(bool is_ratio, double rho, Index m) : is_ratio_(is_ratio), rho_(rho), m_(m) {}
  bool is_ratio_ = true;
  double rho_ = 1.0;
  Index m_ = 0;
};

}  // namespace kvc
