// The method table's presets (methods.hpp) and the composition of swapped stages (composed.hpp) for
// float and float16 caches, compiled once:
// runner_float.cpp and presets_half.cpp instantiate each (KVC_INSTANTIATE_PIPELINE) and a unit that
// includes this header links to those (target kvc_cli_methods) instead of compiling them again. A unit
// built with flags of its own (the AVX-512 test copies) defines KVC_COMPILE_PRESETS and compiles them
// itself.
#pragma once

#include "composed.hpp"

#include <kvcompress/presets.hpp>

#define KVC_CLI_PRESETS(X)                                                                                   \
  X(kvc::FullCache) X(kvc::StreamingLLM) X(kvc::SnapKV) X(kvc::SelKVEvict) X(kvc::SelKV) X(kvc::SelKVMergeAll) \
  X(kvc::KNorm) X(kvc::TOVA) X(kvc::KeyDiff) X(kvc::AdaKVSnapKV) X(kvc::AdaKVSelKV) X(kvc::SnapKVGRKV)          \
  X(kvc::SelKVEvictGRKV) X(kvc::StreamingLLMGRKV) X(kvc::CUR) X(kvc::LagKV) X(kvc::ChunkKV) X(kvc::Threshold)      \
  X(kvc::ExpectedAttentionEvict) X(kvc::H2O) X(kvc::CriticalKV) X(kvc::CriticalAdaKV) X(kvc::cli::Composed)

#ifndef KVC_COMPILE_PRESETS
#define KVC_CLI_EXTERN_FLOAT(Preset) KVC_EXTERN_PIPELINE(float, Preset)
#define KVC_CLI_EXTERN_HALF(Preset) KVC_EXTERN_PIPELINE(Eigen::half, Preset)
KVC_CLI_PRESETS(KVC_CLI_EXTERN_FLOAT)
KVC_CLI_PRESETS(KVC_CLI_EXTERN_HALF)
#undef KVC_CLI_EXTERN_FLOAT
#undef KVC_CLI_EXTERN_HALF
#endif
