// The compressed layer (SPEC §11) and its compaction into caller-provided cache memory.
#pragma once
#include "kvcompress/attention/window_attention.hpp"
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace kvc {

/// Where one head's evicted entries went, filled when Pipeline::Arguments::record_merges is set (else
/// empty): per evicted entry, in ascending position, its position, the position of the kept entry the
/// router sent it to (-1 when the method routes nothing) and its merge gate (0: dropped).
template <class Real>
struct MergeMap {
  std::vector<Index> evicted;
  std::vector<Index> target;
  std::vector<Real> gate;
};

/// One compressed KV head.
template <class Real>
struct HeadResult {
  std::vector<Index> positions;  // (m_g) kept original positions, ascending
  RowMatrix<Real> keys;          // (m_g, d)
  RowMatrix<Real> values;        // (m_g, d)
  Vector<Real> bias;             // (m_g) additive decode-time logit bias
  HeadDiagnostics diagnostics;
  MergeMap<Real> merges;         // with Pipeline::Arguments::record_merges

  Index size() const { return static_cast<Index>(positions.size()); }
};

/// One compressed layer: per KV head results, and the RoPE position the next decoded token uses
/// (n, or m when keys were repositioned).
template <class Real>
struct LayerResult {
  std::vector<HeadResult<Real>> heads;
  Index next_position = 0;
  bool shared_positions = false;  ///< every head kept the same positions (shared selection)
  /// The arithmetic of the window product that stage 1 actually ran: amx_bf16x3 only when
  /// AttentionArguments::product asked for it and it could run (float keys and
  /// window_product_in_effect), else fma, also when no stage computed window attention. A caller that
  /// needs the AMX path (or must not get it) checks this after the call.
  WindowProduct window_product = WindowProduct::fma;

  /// Largest m_g over heads (the cache length an engine needs for this layer).
  Index max_size() const {
    Index m = 0;
    for (const auto& h : heads) m = std::max(m, h.size());
    return m;
  }
};

namespace detail {

/// Whether two views (each alias-free, check_view) share a byte. Their byte ranges are compared
/// first; when those intersect (interleaved layouts), the rows of both, visited in address order,
/// are merged: O(heads·tokens) of each, no allocation.
template <class T>
bool views_overlap(const TensorView<T>& a, const TensorView<T>& b) {
  using U = std::uintptr_t;
  const U row_bytes_a = static_cast<U>(a.dim) * sizeof(T), row_bytes_b = static_cast<U>(b.dim) * sizeof(T);
  Index span_a = 0, span_b = 0;
  if (!view_span_bytes(a, span_a) || !view_span_bytes(b, span_b)) return true;
  const U a0 = reinterpret_cast<U>(a.data), b0 = reinterpret_cast<U>(b.data);
  if (a0 + static_cast<U>(span_a) <= b0 || b0 + static_cast<U>(span_b) <= a0) return false;
  if (a.paged() || b.paged()) {  // every row's start, sorted, then merged: O(rows log rows)
    std::vector<U> ra, rb;
    for (const auto* v : {&a, &b}) {
      auto& r = v == &a ? ra : rb;
      r.reserve(static_cast<std::size_t>(v->heads * v->tokens));
      for (Index h = 0; h < v->heads; ++h)
        for (Index j = 0; j < v->tokens; ++j) r.push_back(reinterpret_cast<U>(v->row(h, j)));
      std::sort(r.begin(), r.end());
    }
    std::size_t i = 0, k = 0;
    while (i < ra.size() && k < rb.size()) {
      if (ra[i] + row_bytes_a <= rb[k]) ++i;
      else if (rb[k] + row_bytes_b <= ra[i]) ++k;
      else return true;
    }
    return false;
  }
  // Rows in address order: outer index over the larger stride, inner over the smaller.
  struct Walk {
    U base;
    Index inner_stride, inner_count, outer_stride, outer_count;
    Index outer = 0, inner = 0;
    Walk(const TensorView<T>& v, U b) : base(b) {
      const bool heads_inner = v.head_stride < v.token_stride || v.tokens == 1;
      inner_stride = heads_inner ? v.head_stride : v.token_stride;
      inner_count = heads_inner ? v.heads : v.tokens;
      outer_stride = heads_inner ? v.token_stride : v.head_stride;
      outer_count = heads_inner ? v.tokens : v.heads;
    }
    bool done() const { return outer >= outer_count; }
    U start() const {
      return base + (static_cast<U>(outer) * static_cast<U>(outer_stride) +
                     static_cast<U>(inner) * static_cast<U>(inner_stride)) * sizeof(T);
    }
    void next() {
      if (++inner == inner_count) {
        inner = 0;
        ++outer;
      }
    }
  } wa(a, a0), wb(b, b0);
  while (!wa.done() && !wb.done()) {
    const U sa = wa.start(), sb = wb.start();
    if (sa + row_bytes_a <= sb) wa.next();
    else if (sb + row_bytes_b <= sa) wb.next();
    else return true;
  }
  return false;
}

}  // namespace detail

/// Writes head g's compressed keys and values into rows 0..m_g−1 of `keys_out` / `values_out`,
/// converting to the cache's element type, and returns the lengths m_g (one per head: with per-head
/// budgets, e.g. AdaKV, they differ, and a ragged cache keeps head g's first m_g rows). Either layout works (the views carry the strides). The
/// destination may be the very cache the layer was read from (in-place compaction): the result
/// already holds its own copy. Rows ≥ m_g are not touched. Throws kvc::error, and writes nothing,
/// when shapes do not fit, when the rows written to keys_out and values_out would share memory, or
/// when an entry does not convert to a finite T (NaN, Inf, or beyond T's range, as merged values
/// of a half cache can be): every entry is checked before the first is written, nothing is clamped.
/// O(Σ m_g·d).
template <class Real, class T>
std::vector<Index> compact_into(const LayerResult<Real>& result, const TensorView<T>& keys_out,
                                const TensorView<T>& values_out) {
  static_assert(!std::is_const_v<T>, "compact_into needs writable views");
  using detail::concat;
  detail::check_view(keys_out, "keys_out").throw_if_error();
  detail::check_view(values_out, "values_out").throw_if_error();
  const Index H = static_cast<Index>(result.heads.size());
  const Index m = result.max_size();
  for (const auto* v : {&keys_out, &values_out}) {
    if (v->heads != H)
      throw error(concat("compact_into: destination has ", v->heads, " heads, result has ", H));
    if (v->tokens < m)
      throw error(concat("compact_into: destination holds ", v->tokens, " tokens, result needs ", m));
    if (H > 0 && v->dim != result.heads[0].keys.cols())
      throw error(concat("compact_into: destination dim ", v->dim, " != result dim ",
                         result.heads[0].keys.cols()));
  }
  if (m > 0 && detail::views_overlap(keys_out.token_range(0, m), values_out.token_range(0, m)))
    throw error(concat("compact_into: keys_out (data=", static_cast<const void*>(keys_out.data),
                       ") and values_out (data=", static_cast<const void*>(values_out.data),
                       ") share memory in the rows to be written"));
  for (Index g = 0; g < H; ++g) {
    const auto& hr = result.heads[g];
    for (const auto* part : {&hr.keys, &hr.values}) {
      Index i = 0, c = 0;
      if (detail::find_unrepresentable<T>(part->topRows(hr.size()), i, c))
        throw error(concat("compact_into: ", part == &hr.keys ? "keys" : "values", "[", g, "][", i, "][", c,
                           "] = ", (*part)(i, c), " does not convert to a finite destination element",
                           " (|x| must be below ", detail::overflow_limit<T, Real>(), "); nothing was written"));
    }
  }
  for (Index g = 0; g < H; ++g) {
    const auto& hr = result.heads[g];
    for (Index i = 0; i < hr.size(); ++i) {
      T* k = keys_out.row(g, i);
      T* v = values_out.row(g, i);
      for (Index c = 0; c < keys_out.dim; ++c) {
        k[c] = from_real<T>(hr.keys(i, c));
        v[c] = from_real<T>(hr.values(i, c));
      }
    }
  }
  std::vector<Index> lengths(static_cast<std::size_t>(H));
  for (Index g = 0; g < H; ++g) lengths[static_cast<std::size_t>(g)] = result.heads[static_cast<std::size_t>(g)].size();
  return lengths;
}

/// What compact_paged did to a paged layer.
struct PagedCompaction {
  std::vector<Index> lengths;       ///< entries of each KV head (as compact_into returns them)
  Index blocks = 0;                 ///< block-table entries now in use: ceil(max length / block_size)
  std::vector<std::int32_t> freed;  ///< block ids no longer referenced, for the engine's free list
  bool moved = false;               ///< entries moved to other rows (token granularity), else in place
};

/// Compacts a compressed layer into the paged cache it was read from (views with paged(), offset 0,
/// over the pool and the block table `block_table` they point to, e.g. from make_paged_token_major)
/// and rewrites the table. `stored`: the positions the layer was compressed with (LayerView::positions;
/// absent: entry j at position j), which locate each kept entry in the cache.
///   - Whole blocks kept by every head (block granularity, TopBlocks with the cache's block size): every kept entry
///     stays in its row; the table keeps the kept blocks in order, the evicted blocks' ids are freed.
///     Only the kept rows are written (a merger may have changed them).
///   - Otherwise (token granularity): compact_into through the same table, rows 0..m_g−1 of head g,
///     then the table's first ceil(max m_g / block_size) entries stay and the rest are freed.
/// The table is rewritten in its first `blocks` entries; entries beyond are left as they were. Throws
/// kvc::error, and changes nothing, on what compact_into rejects, on views that are not paged with
/// offset 0 or do not share the table, or when a kept position is not in `stored`. O(Σ m_g·d + n).
template <class Real, class T>
PagedCompaction compact_paged(const LayerResult<Real>& result, const TensorView<T>& keys, const TensorView<T>& values,
                              std::int32_t* block_table, const PositionView& stored = {}) {
  using detail::concat;
  if (!keys.paged() || !values.paged() || keys.blocks != block_table || values.blocks != block_table ||
      keys.offset != 0 || values.offset != 0 || keys.block_size != values.block_size || keys.tokens != values.tokens)
    throw error("compact_paged: keys and values must be paged views (offset 0, one block size, one length) over "
                "block_table");
  detail::check_view(keys, "keys").throw_if_error();
  detail::check_view(values, "values").throw_if_error();
  const Index b = keys.block_size, n = keys.tokens, H = static_cast<Index>(result.heads.size());
  const Index used = (n - 1) / b + 1;  // table entries the layer had
  const Index m = result.max_size();
  if (m > n) throw error(concat("compact_paged: the result holds ", m, " entries, the cache ", n));
  if (H != keys.heads) throw error(concat("compact_paged: the result has ", H, " heads, the cache ", keys.heads));
  if (stored.data != nullptr && (stored.heads != H || stored.length != n || (H > 1 && stored.head_stride < n)))
    throw error(concat("compact_paged: stored positions [", stored.heads, "][", stored.length, "] (head stride ",
                       stored.head_stride, ") do not describe the cache's [", H, "][", n, "] entries"));
  if (m == 0) {  // nothing kept: every page is freed
    PagedCompaction none;
    none.lengths.assign(static_cast<std::size_t>(H), 0);
    none.freed.assign(block_table, block_table + used);
    return none;
  }
  // Each kept entry's index in the cache, from its stored position, per head.
  std::vector<std::vector<Index>> index(static_cast<std::size_t>(H));
  for (Index g = 0; g < H; ++g) {
    const auto& pos = result.heads[static_cast<std::size_t>(g)].positions;
    auto& idx = index[static_cast<std::size_t>(g)];
    idx.resize(pos.size());
    for (std::size_t i = 0; i < pos.size(); ++i) {
      if (stored.data == nullptr) {
        idx[i] = pos[i];
      } else {
        const Index* first = stored.data + g * stored.head_stride;
        const Index* last = first + n;
        const Index* at = std::lower_bound(first, last, pos[i]);
        if (at == last || *at != pos[i])
          throw error(concat("compact_paged: kept position ", pos[i], " of head ", g,
                             " is not among the stored positions"));
        idx[i] = at - first;
      }
      if (idx[i] < 0 || idx[i] >= n)
        throw error(concat("compact_paged: kept position ", pos[i], " is outside the cache's ", n, " entries"));
    }
  }
  // In place when every head kept the same entries and entry i sits at row i % b of the block that
  // new block i / b maps to.
  bool whole_blocks = H > 0;
  for (Index g = 1; g < H && whole_blocks; ++g) whole_blocks = index[static_cast<std::size_t>(g)] == index[0];
  for (std::size_t i = 0; whole_blocks && i < index[0].size(); ++i) {
    const Index k = static_cast<Index>(i), at = index[0][i];
    whole_blocks = at % b == k % b && (i == 0 || at > index[0][i - 1]) && (k % b == 0 || at == index[0][i - 1] + 1);
  }
  PagedCompaction pc;
  pc.blocks = m > 0 ? (m - 1) / b + 1 : 0;
  std::vector<std::int32_t> table(block_table, block_table + used);
  if (whole_blocks) {
    std::vector<std::int32_t> kept_table(static_cast<std::size_t>(pc.blocks));
    for (Index k = 0; k < pc.blocks; ++k) kept_table[static_cast<std::size_t>(k)] = table[static_cast<std::size_t>(index[0][static_cast<std::size_t>(k * b)] / b)];
    TensorView<T> k_out = keys, v_out = values;
    k_out.blocks = v_out.blocks = kept_table.data();
    k_out.tokens = v_out.tokens = m;
    pc.lengths = compact_into(result, k_out, v_out);  // each row onto itself
    std::copy(kept_table.begin(), kept_table.end(), block_table);
    std::vector<char> live(static_cast<std::size_t>(used), 0);
    for (Index k = 0; k < pc.blocks; ++k) live[static_cast<std::size_t>(index[0][static_cast<std::size_t>(k * b)] / b)] = 1;
    for (Index k = 0; k < used; ++k)
      if (!live[k]) pc.freed.push_back(table[k]);
  } else {
    pc.lengths = compact_into(result, keys, values);
    pc.moved = true;
    pc.freed.assign(table.begin() + pc.blocks, table.end());
  }
  return pc;
}

namespace detail {
/// The checks of compact_bias_into / compact_positions_into (rows of `m` <= capacity elements of
/// `elem` bytes, head_stride apart, for H heads); false when there is nothing to write.
inline bool check_head_rows(const char* fn, const char* what, Index H, Index m, const void* out, Index head_stride,
                            Index capacity, std::size_t elem) {
  if (capacity < 0) throw error(concat(fn, ": capacity must be >= 0, got ", capacity));
  if (m > capacity) throw error(concat(fn, ": capacity ", capacity, " < ", m));
  if (H == 0 || m == 0) return false;
  if (out == nullptr) throw error(concat(fn, ": ", what, " is null"));
  if (head_stride < 0) throw error(concat(fn, ": head_stride must be >= 0, got ", head_stride));
  if (H > 1 && head_stride < capacity)
    throw error(concat(fn, ": head_stride ", head_stride, " < capacity ", capacity, ": the rows of ", H,
                       " heads would overlap"));
  Index span = 0, bytes = 0;
  if (!checked_mul(H - 1, head_stride, span) || !checked_add(span, capacity, span) ||
      !checked_mul(span, static_cast<Index>(elem), bytes) || bytes > kMaxViewBytes ||
      reinterpret_cast<std::uintptr_t>(out) > std::numeric_limits<std::uintptr_t>::max() - static_cast<std::uintptr_t>(bytes))
    throw error(concat(fn, ": ", H, " heads with head_stride=", head_stride, " and capacity=", capacity,
                       " span more than ", kMaxViewBytes, " bytes"));
  return true;
}
}  // namespace detail

/// Writes the bias of head g into bias_out[g * head_stride + i] for i < m_g (e.g. an engine's
/// additive attention-mask row), converted to B (float, double, Eigen::half or Eigen::bfloat16).
/// Throws kvc::error, and writes nothing, when a row does not fit `capacity`, `bias_out` is null,
/// `head_stride` is negative or below `capacity` (rows would overlap; any value with one head), the
/// extent overflows, or a bias does not convert to a finite B.
template <class Real, class B>
void compact_bias_into(const LayerResult<Real>& result, B* bias_out, Index head_stride, Index capacity) {
  static_assert(is_element_type_v<B>, "compact_bias_into writes float, double, Eigen::half or Eigen::bfloat16");
  using detail::concat;
  const Index H = static_cast<Index>(result.heads.size());
  if (!detail::check_head_rows("compact_bias_into", "bias_out", H, result.max_size(), bias_out, head_stride, capacity,
                               sizeof(B)))
    return;
  for (Index g = 0; g < H; ++g) {
    const auto& bias = result.heads[static_cast<std::size_t>(g)].bias;
    Index i = 0, c = 0;
    if (detail::find_unrepresentable<B>(bias.transpose(), i, c))
      throw error(concat("compact_bias_into: bias[", g, "][", c, "] = ", bias[c],
                         " does not convert to a finite destination element; nothing was written"));
  }
  for (std::size_t g = 0; g < result.heads.size(); ++g)
    for (Index i = 0; i < result.heads[g].size(); ++i)
      bias_out[static_cast<Index>(g) * head_stride + i] = from_real<B>(result.heads[g].bias[i]);
}

/// Writes the positions of head g into positions_out[g * head_stride + i] for i < m_g: with
/// compact_into and compact_bias_into, the memory of the next compression's LayerView (its
/// `positions`). Throws kvc::error, and writes nothing, on the shapes compact_bias_into rejects.
template <class Real>
void compact_positions_into(const LayerResult<Real>& result, Index* positions_out, Index head_stride, Index capacity) {
  const Index H = static_cast<Index>(result.heads.size());
  if (!detail::check_head_rows("compact_positions_into", "positions_out", H, result.max_size(), positions_out,
                               head_stride, capacity, sizeof(Index)))
    return;
  for (std::size_t g = 0; g < result.heads.size(); ++g)
    std::copy(result.heads[g].positions.begin(), result.heads[g].positions.end(),
              positions_out + static_cast<Index>(g) * head_stride);
}

}  // namespace kvc
