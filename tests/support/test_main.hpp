// tests/support/test_main.hpp — lets a test file make its whole executable conditional.
//
//   static const kvc::test::RunOnlyIf guard([]() -> std::string {
//     return have_model() ? "" : "the model files are missing";   // "" runs the tests
//   });
//
// The shared main (catch_main.cpp) calls the condition before any test: a non-empty message is printed
// as "skipped: ..." and the executable exits with 77, which ctest reports as skipped.
#pragma once

#include <string>

namespace kvc::test {

using Precondition = std::string (*)();

inline Precondition& precondition() {
  static Precondition p = nullptr;
  return p;
}

struct RunOnlyIf {
  explicit RunOnlyIf(Precondition p) { precondition() = p; }
};

}  // namespace kvc::test
