// tests/support/test_main.hpp — lets a test file make its whole executable conditional.
//
//   static const kvc::test::RunOnlyIf guard([]() -> std::string {
//     return have_model() ? "" : "the model files are missing";   // "" runs the tests
//   });
//
// The shared main (catch_main.cpp) calls every condition before any test: the first non-empty message
// is printed as "skipped: ..." and the executable exits with 77, which ctest reports as skipped.
#pragma once

#include <string>
#include <vector>

namespace kvc::test {

using Precondition = std::string (*)();

inline std::vector<Precondition>& preconditions() {
  static std::vector<Precondition> all;
  return all;
}

struct RunOnlyIf {
  explicit RunOnlyIf(Precondition p) { preconditions().push_back(p); }
};

}  // namespace kvc::test
