// The method registry's one compiled unit: every preset the tool offers is instantiated here only.
#include "methods.hpp"

namespace kvc::cli {

Compressor make_method(const std::string& name, const MethodOptions& o) {
  return visit_method(name, [&](auto tag) -> Compressor {
    using Preset = typename decltype(tag)::type;
    const Preset preset(method_arguments<Preset>(o, name));
    return [preset](const LayerView<float>& layer, const Budget& budget) { return preset.run(layer, budget); };
  });
}

}  // namespace kvc::cli
