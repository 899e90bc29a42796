// libFuzzer target: the kvcompress tool's .npy reader (examples/engine/npy.hpp) on arbitrary bytes.
// A malformed file must fail with std::runtime_error naming the source; anything else (a crash, a
// sanitizer report, another exception, an array inconsistent with its shape) is a finding.
#include "engine/npy.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<unsigned char> bytes(data, data + size);
  const std::string name = "fuzz-input.npy";
  kvc::engine::NpyArray arr;
  try {
    arr = kvc::engine::parse_npy(bytes, name);
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find(name) == std::string::npos) {
      std::fprintf(stderr, "npy error without the file name: %s\n", e.what());
      __builtin_trap();
    }
    return 0;
  }
  // Accepted: the data matches the shape and the dtype.
  std::uint64_t count = 1;
  for (const std::int64_t s : arr.shape) {
    if (s < 0) __builtin_trap();
    count *= static_cast<std::uint64_t>(s);
  }
  const std::size_t got = arr.is_float() ? arr.f.size() : arr.i.size();
  if (got != count || (arr.is_float() ? !arr.i.empty() : !arr.f.empty())) {
    std::fprintf(stderr, "npy array of %zu elements for a shape of %llu\n", got, static_cast<unsigned long long>(count));
    __builtin_trap();
  }
  return 0;
}
