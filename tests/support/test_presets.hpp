// The presets the pipeline tests run on double and bfloat16 caches, compiled once (test_presets.cpp,
// target kvc_test_presets) for every test that includes this header. float and float16 come from
// presets_compiled.hpp (kvc_cli_methods).
#pragma once

#include <kvcompress/presets.hpp>

#define KVC_TEST_PRESETS(X) \
  X(kvc::FullCache) X(kvc::StreamingLLM) X(kvc::SnapKV) X(kvc::SelKVEvict) X(kvc::SelKV) X(kvc::SelKVMergeAll) X(kvc::KNorm)

#ifndef KVC_COMPILE_PRESETS
#define KVC_TEST_EXTERN_DOUBLE(Preset) KVC_EXTERN_PIPELINE(double, Preset)
#define KVC_TEST_EXTERN_BF16(Preset) KVC_EXTERN_PIPELINE(Eigen::bfloat16, Preset)
KVC_TEST_PRESETS(KVC_TEST_EXTERN_DOUBLE)
KVC_TEST_PRESETS(KVC_TEST_EXTERN_BF16)
#undef KVC_TEST_EXTERN_DOUBLE
#undef KVC_TEST_EXTERN_BF16
#endif
