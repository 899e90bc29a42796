// Names the README's C++ fragments use without declaring them (tests/CMakeLists.txt wraps each
// fragment in a function after this header and compiles it; nothing runs).
#pragma once

#include <kvcompress/kvcompress.hpp>

#include <vector>

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
