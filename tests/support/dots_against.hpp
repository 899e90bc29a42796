// Test helper: dots_against, the one-row form of the router's kvc::detail::dots_against_n, which the
// router test compares the multi-row forms against.
#pragma once

#include <kvcompress/router/bucket_router.hpp>

namespace kvc::test {

/// out[c] = <rows[c], y> for `count` rows (dots_against_n with one y).
template <class A, class T>
inline void dots_against(const T* const* rows, Index count, const T* y, Index d, float* out) {
  detail::dots_against_n<A, 1>(rows, count, &y, d, &out);
}

}  // namespace kvc::test
