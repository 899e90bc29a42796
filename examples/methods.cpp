// The tool's compressor for a method name: the float runner (runner.hpp), compiled in runner_float.cpp.
#include "methods.hpp"
#include "runner.hpp"

#include <memory>
#include <string>

namespace kvc::cli {

Compressor make_method(const std::string& name, const MethodOptions& o) {
  std::shared_ptr<const Runner<float>> runner = make_runner<float>(name, o, 1);  // serial, as the presets default
  const bool needs_all_queries = name == "observed-attention";  // H2O reads every prefill query
  const auto critical = [](const std::string& m) { return m == "criticalkv" || m == "critical-adakv"; };
  const bool needs_wo = o.scorer ? critical(*o.scorer) : critical(name);  // CriticalKV's scorer reads W_o
  return [runner, needs_all_queries, needs_wo](const LayerView<float>& layer, const Budget& budget) {
    if (needs_wo && layer.output_projection.data == nullptr)
      throw std::invalid_argument("criticalkv's scorer needs the layer's output projection W_o: give --wo WO.npy "
                                  "([model dim][Hq*d]) to compress");
    if (needs_all_queries && layer.queries.tokens < layer.tokens())
      throw std::invalid_argument("observed-attention needs the queries of all " + std::to_string(layer.tokens()) +
                                  " prefill positions, got " + std::to_string(layer.queries.tokens) +
                                  ": give --window at least the prompt or prefix length (generate, eval), or "
                                  "--queries of shape [Hq][n][d] (compress)");
    return runner->run(layer, BudgetSpec{false, budget, {}});
  };
}

}  // namespace kvc::cli
