// A method behind a virtual call per element type: the preset the CLI's table (methods.hpp) names, with
// its options. The presets are compiled once per element type: runner_float.cpp (target
// kvc_cli_methods: the tool, the tests and the Python module) and runner_half.cpp (the module).
#pragma once

#include "methods.hpp"
#include "presets_compiled.hpp"

#include <memory>
#include <string>
#include <vector>

namespace kvc::cli {

/// Per-KV-head token counts, or one ratio / count for every head.
struct BudgetSpec {
  bool per_head = false;
  Budget budget = Budget::ratio(0.25);
  std::vector<Index> budgets;
};

/// The library's DecodingCompressor of a runner's method, behind a virtual call.
template <class T>
class Decoder {
 public:
  virtual ~Decoder() = default;
  /// DecodingCompressor::step: compresses `cache` into `out` when due, and says whether it did.
  virtual bool step(const LayerView<T>& cache, LayerResult<float>& out, Workspace<float>& ws) = 0;
};

template <class T>
class Runner {
 public:
  virtual ~Runner() = default;
  /// One-shot: the library's run(layer, budget), new memory.
  virtual LayerResult<float> run(const LayerView<T>& layer, const BudgetSpec& budget) const = 0;
  /// Reusing out and ws: the library's run(layer, budget, out, ws).
  virtual void run(const LayerView<T>& layer, const BudgetSpec& budget, LayerResult<float>& out,
                   Workspace<float>& ws) const = 0;
  /// A compressor of a growing cache with this method (throws kvc::error when the method's selector
  /// cannot keep the sinks and recent entries `args` asks for).
  virtual std::unique_ptr<Decoder<T>> decoder(const DecodingArguments& args) const = 0;
};

namespace detail {

template <class T, class Preset>
class PresetDecoder final : public Decoder<T> {
 public:
  PresetDecoder(const Preset& preset, const DecodingArguments& args) : compressor_(preset, args) {}
  bool step(const LayerView<T>& cache, LayerResult<float>& out, Workspace<float>& ws) override {
    return compressor_.step(cache, out, ws);
  }

 private:
  DecodingCompressor<Preset> compressor_;
};

template <class T, class Preset>
class PresetRunner final : public Runner<T> {
 public:
  explicit PresetRunner(const typename Preset::Arguments& args) : preset_(args) {}
  LayerResult<float> run(const LayerView<T>& layer, const BudgetSpec& b) const override {
    return b.per_head ? preset_.run(layer, b.budgets) : preset_.run(layer, b.budget);
  }
  void run(const LayerView<T>& layer, const BudgetSpec& b, LayerResult<float>& out, Workspace<float>& ws) const override {
    if (b.per_head) preset_.run(layer, b.budgets, out, ws);
    else preset_.run(layer, b.budget, out, ws);
  }
  std::unique_ptr<Decoder<T>> decoder(const DecodingArguments& args) const override {
    return std::make_unique<PresetDecoder<T, Preset>>(preset_, args);
  }

 private:
  Preset preset_;
};

}  // namespace detail

/// The runner for a method name and the CLI's options (with stages swapped: composed.hpp), `threads` worker threads; throws
/// std::invalid_argument (the CLI's messages) for an unknown method or an option that does not apply.
template <class T>
std::unique_ptr<Runner<T>> make_runner(const std::string& method, const MethodOptions& options, Index threads) {
  if (swaps_stages(options)) {
    auto args = composed_arguments(method, options);
    check_rope_base<Composed>(args, options, method);
    args.threads = threads;
    args.record_merges = options.record_merges;
    return std::make_unique<detail::PresetRunner<T, Composed>>(args);
  }
  return visit_method(method, [&](auto tag) -> std::unique_ptr<Runner<T>> {
    using Preset = typename decltype(tag)::type;
    auto args = method_arguments<Preset>(options, method);
    check_rope_base<Preset>(args, options, method);
    args.threads = threads;
    args.record_merges = options.record_merges;
    return std::make_unique<detail::PresetRunner<T, Preset>>(args);
  });
}

// Instantiated once each, in runner_float.cpp and runner_half.cpp.
extern template std::unique_ptr<Runner<float>> make_runner<float>(const std::string&, const MethodOptions&, Index);
extern template std::unique_ptr<Runner<Eigen::half>> make_runner<Eigen::half>(const std::string&,
                                                                              const MethodOptions&, Index);

}  // namespace kvc::cli
