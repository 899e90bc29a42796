// The one Catch2 main shared by the test executables. Prints the random seed used by the tests
// (override with KVC_TEST_SEED).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
