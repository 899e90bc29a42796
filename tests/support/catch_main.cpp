// The one Catch2 main shared by the test executables. Prints the random seed of the tests' data
// (override with KVC_TEST_SEED) and honours a test file's RunOnlyIf condition (support/test_main.hpp).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "support/random.hpp"
#include "support/test_main.hpp"

#include <cstdio>
#include <exception>

int main(int argc, char* argv[]) {
  for (const kvc::test::Precondition condition : kvc::test::preconditions()) {
    const std::string why = condition();
    if (!why.empty()) {
      std::printf("skipped: %s\n", why.c_str());
      return 77;
    }
  }
  try {
    std::printf("KVC_TEST_SEED=%llu\n", static_cast<unsigned long long>(kvc::test::test_seed()));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  std::fflush(stdout);
  return Catch::Session().run(argc, argv);
}
