// tests/support/model_dir.hpp — where the test files that need TinyStories-260K find it.
//
//   const std::string& g_model_dir = kvc::test::model_dir();
//   const kvc::test::RunOnlyIf needs_model(kvc::test::model_dir_missing);
#pragma once

#include "engine/model_path.hpp"
#include "support/test_main.hpp"

#include <string>

namespace kvc::test {

/// The directory holding the model files, looked up once (empty when they are absent).
inline const std::string& model_dir() {
  static const std::string dir = kvc::engine::find_model_dir().value_or("");
  return dir;
}

/// The sanitizer build (-O0, assertions on) runs the slowest model tests on fewer sequences; the normal
/// build runs them in full.
#ifdef KVC_ENABLE_ASSERTS
inline constexpr bool kSanitizerBuild = true;
#else
inline constexpr bool kSanitizerBuild = false;
#endif

/// A RunOnlyIf precondition: where the model was looked for when it is absent, else "".
inline std::string model_dir_missing() { return model_dir().empty() ? kvc::engine::model_missing_message() : ""; }

}  // namespace kvc::test
