// The no-op router: routes nothing.
#pragma once
#include "kvcompress/core.hpp"
#include "kvcompress/policy.hpp"

namespace kvc {

/// The no-op router: routes nothing (for Drop and for mergers that ignore routing, e.g. RidgeMerge).
struct NoRoute {
  struct Arguments {};
  Arguments args;
  Status validate() const { return Status::ok(); }
  template <class T>
  void route(const HeadContext<T>&, Routing& routing) const {
    routing.target.clear();
  }
};

}  // namespace kvc
