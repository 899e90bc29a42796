// Compression during decoding: a layer's cache, compressed again whenever it grows past a size (or
// every k steps), with its first and newest entries never evicted.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/one_of.hpp"
#include "kvcompress/pipeline.hpp"
#include "kvcompress/selector/top_k.hpp"

#include <algorithm>
#include <type_traits>
#include <variant>

namespace kvc {

/// When and how far DecodingCompressor compresses (OpenVINO GenAI's start / recent / max sizes,
/// kvpress DecodingPress's every / target).
struct DecodingArguments {
  Index max_size = 0;     ///< compress when the cache holds more than this many entries per KV head (0: off)
  Index target_size = 0;  ///< entries per KV head after a compression, >= 1
  Index every = 0;        ///< also compress every `every` steps when above target_size (0: off)
  Index sinks = 4;        ///< the first entries are never evicted
  Index recent = 32;      ///< the newest entries are never evicted

  Status validate() const {
    using detail::concat;
    if (target_size < 1)
      return Status::fail(Status::Code::invalid_argument, concat("decoding target_size must be >= 1, got ", target_size));
    if (max_size < 0 || every < 0 || sinks < 0 || recent < 0)
      return Status::fail(Status::Code::invalid_argument,
                          concat("decoding max_size, every, sinks and recent must be >= 0, got ", max_size, ", ", every,
                                 ", ", sinks, ", ", recent));
    if (max_size == 0 && every == 0)
      return Status::fail(Status::Code::invalid_argument, "decoding needs max_size or every (both are 0: it never compresses)");
    if (max_size != 0 && max_size < target_size)
      return Status::fail(Status::Code::invalid_argument,
                          concat("decoding max_size (", max_size, ") must be >= target_size (", target_size, ")"));
    if (sinks + recent > target_size)
      return Status::fail(Status::Code::invalid_argument,
                          concat("decoding sinks + recent (", sinks + recent, ") must fit in target_size (", target_size, ")"));
    return Status::ok();
  }
};

namespace detail {

template <class A, class = void>
struct has_forced_sinks : std::false_type {};
template <class A>
struct has_forced_sinks<A, std::void_t<decltype(std::declval<A&>().sinks)>> : std::true_type {};
template <class A, class = void>
struct has_forced_recent : std::false_type {};
template <class A>
struct has_forced_recent<A, std::void_t<decltype(std::declval<A&>().recent)>> : std::true_type {};

template <class A, class = void>
struct is_one_of_arguments : std::false_type {};
template <class A>
struct is_one_of_arguments<A, std::void_t<decltype(std::declval<A&>().policy.index())>> : std::true_type {};

/// A selector's Arguments (a OneOf's: its chosen selector's) with at least `sinks` first and `recent`
/// newest tokens forced; false when it cannot force what is asked.
template <class A>
bool force_tokens(A& a, Index sinks, Index recent) {
  if constexpr (is_one_of_arguments<A>::value) {
    return std::visit([&](auto& p) { return force_tokens(p.args, sinks, recent); }, a.policy);
  } else if constexpr (std::is_same_v<A, KeepAll::Arguments>) {
    return true;  // keeps every entry: the forced ones too
  } else {
    bool ok = true;
    if constexpr (has_forced_sinks<A>::value) a.sinks = std::max(a.sinks, sinks);
    else ok = ok && sinks == 0;
    if constexpr (has_forced_recent<A>::value) a.recent = std::max(a.recent, recent);
    else ok = ok && recent == 0;
    return ok;
  }
}

}  // namespace detail

/// Compresses one layer's cache during decoding. The engine calls step() once per decoded token, after
/// appending that token's key and value, with a view of the layer's whole cache: keys, values, every
/// entry's original position and current bias (LayerView::positions, ::bias: what earlier compressions
/// returned, then the appended tokens), and as window queries the last W decoded tokens' post-RoPE
/// queries (the engine keeps a ring of them). When the cache holds more than max_size entries per
/// KV head, or `every` steps have passed since the last compression and it holds more than
/// target_size, step() runs the pipeline at budget target_size with its selector forcing at least
/// `sinks` first and `recent` newest entries, writes the result into `out` and returns true; the engine
/// then writes `out` back into its cache (compact_into, with positions and bias) and keeps decoding.
/// Otherwise it returns false and `out` is untouched. Any preset composes (merging and GRKV included):
/// the kept entries' bias adds to their stored bias, positions travel (docs/numerics.md). A result
/// equals Pipeline::run of the same cache at the same step, with the forced tokens. One compressor
/// per layer (it counts that layer's steps); not for concurrent use.
template <class Pipeline>
class DecodingCompressor {
 public:
  DecodingCompressor(const Pipeline& pipeline, const DecodingArguments& args) : pipeline_(pipeline), args_(args) {
    args_.validate().throw_if_error();
    if (!detail::force_tokens(pipeline_.arguments().selector, args_.sinks, args_.recent))
      throw error(detail::concat("this pipeline's selector cannot keep the first ", args_.sinks, " and the newest ",
                                 args_.recent, " entries: set decoding sinks and recent to 0, or use a selector with "
                                 "sinks and recent (TopK, TopChunks)"));
  }

  /// Whether a cache of n entries per KV head is compressed at the next step.
  bool due(Index n) const {
    if (args_.max_size > 0 && n > args_.max_size) return true;
    return args_.every > 0 && since_ + 1 >= args_.every && n > args_.target_size;
  }

  /// One decoded step (see the class comment). Throws kvc::error on bad input; `out` is then untouched.
  template <class T>
  bool step(const LayerView<T>& cache, LayerResult<compute_t<T>>& out, Workspace<compute_t<T>>& ws) {
    if (!due(cache.tokens())) {
      ++since_;
      return false;
    }
    pipeline_.run(cache, Budget::tokens(args_.target_size), out, ws);
    since_ = 0;
    ++compressions_;
    return true;
  }

  /// The pipeline as it runs (the forced tokens applied).
  const Pipeline& pipeline() const { return pipeline_; }
  const DecodingArguments& arguments() const { return args_; }
  /// Compressions run so far.
  Index compressions() const { return compressions_; }

 private:
  Pipeline pipeline_;
  DecodingArguments args_;
  Index since_ = 0, compressions_ = 0;
};

}  // namespace kvc
