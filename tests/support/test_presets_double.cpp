// See test_presets.hpp.
#include "support/test_presets.hpp"

#define KVC_TEST_INSTANTIATE_DOUBLE(Preset) KVC_INSTANTIATE_PIPELINE(double, Preset)
KVC_TEST_PRESETS(KVC_TEST_INSTANTIATE_DOUBLE)
