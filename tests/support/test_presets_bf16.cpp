// See test_presets.hpp.
#include "support/test_presets.hpp"

#define KVC_TEST_INSTANTIATE_BF16(Preset) KVC_INSTANTIATE_PIPELINE(Eigen::bfloat16, Preset)
KVC_TEST_PRESETS(KVC_TEST_INSTANTIATE_BF16)
