// Names the C++ fragments of README.md and docs/*.md use without declaring them (tests/CMakeLists.txt
// wraps each fragment in a function after this header and compiles it; nothing runs).
#pragma once

#include <kvcompress/kvcompress.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__linux__)
#include <malloc.h>    // mallopt (docs/integration.md)
#include <sys/mman.h>  // madvise (docs/integration.md)
#endif

namespace readme {

inline std::vector<float> keys(2 * 64 * 16), values(2 * 64 * 16), queries(4 * 8 * 16);

inline kvc::LayerView<float> layer_view(int /*layer*/) {
  return {kvc::make_head_major<const float>(keys.data(), 2, 64, 16),
          kvc::make_head_major<const float>(values.data(), 2, 64, 16),
          kvc::make_head_major<const float>(queries.data(), 4, 8, 16)};
}
inline kvc::TensorView<float> keys_view(int /*layer*/) { return kvc::make_head_major(keys.data(), 2, 64, 16); }
inline kvc::TensorView<float> values_view(int /*layer*/) { return kvc::make_head_major(values.data(), 2, 64, 16); }

}  // namespace readme
