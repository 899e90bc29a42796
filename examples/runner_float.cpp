// Every preset instantiated for float caches (see runner.hpp and presets_compiled.hpp).
#include "runner.hpp"

#define KVC_CLI_INSTANTIATE_FLOAT(Preset) KVC_INSTANTIATE_PIPELINE(float, Preset)
KVC_CLI_PRESETS(KVC_CLI_INSTANTIATE_FLOAT)

namespace kvc::cli {
template std::unique_ptr<Runner<float>> make_runner<float>(const std::string&, const MethodOptions&, Index);
}  // namespace kvc::cli
