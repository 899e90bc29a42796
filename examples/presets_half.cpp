// Every preset's data flow instantiated for float16 caches (see presets_compiled.hpp).
#include "presets_compiled.hpp"

#define KVC_CLI_INSTANTIATE_HALF(Preset) KVC_INSTANTIATE_PIPELINE(Eigen::half, Preset)
KVC_CLI_PRESETS(KVC_CLI_INSTANTIATE_HALF)
