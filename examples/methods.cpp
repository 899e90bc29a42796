// The tool's compressor for a method name: the float runner (runner.hpp), compiled in runner_float.cpp.
#include "methods.hpp"
#include "runner.hpp"

#include <memory>

namespace kvc::cli {

Compressor make_method(const std::string& name, const MethodOptions& o) {
  std::shared_ptr<const Runner<float>> runner = make_runner<float>(name, o, 1);  // serial, as the presets default
  return [runner](const LayerView<float>& layer, const Budget& budget) {
    return runner->run(layer, BudgetSpec{false, budget, {}});
  };
}

}  // namespace kvc::cli
