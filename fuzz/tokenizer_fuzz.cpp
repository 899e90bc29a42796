// libFuzzer target: the llama2.c tokenizer loader (examples/engine/llama2.hpp, Tokenizer::parse),
// then encode() and decode() with the loaded vocabulary. Input: byte 0 picks vocab_size (3..66),
// byte 1 the length t of a text (0..31), bytes 2..2+t the text, the rest the tokenizer file.
// A malformed file must fail with std::runtime_error naming the source; a crash, a sanitizer report,
// another exception, or a token id outside the vocabulary is a finding.
#include "engine/llama2.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const int vocab = 3 + data[0] % 64;
  const std::size_t t = std::min<std::size_t>(data[1] % 32, size - 2);
  const std::string text(reinterpret_cast<const char*>(data + 2), t);
  const std::vector<unsigned char> bytes(data + 2 + t, data + size);
  const std::string name = "fuzz-input-tok.bin";
  try {
    const kvc::engine::Tokenizer tok = kvc::engine::Tokenizer::parse(bytes, name, vocab);
    std::vector<int> ids;
    try {
      ids = tok.encode(text, true, true);
    } catch (const std::runtime_error&) {
      return 0;  // no piece and no byte fallback for a byte of the text: a documented error
    }
    for (const int id : ids)
      if (id < 0 || id >= vocab) {
        std::fprintf(stderr, "encode gave token id %d outside [0, %d)\n", id, vocab);
        __builtin_trap();
      }
    (void)tok.decode(ids);
    for (int id = 0; id < vocab; ++id) (void)tok.decode(1, id);
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find(name) == std::string::npos) {
      std::fprintf(stderr, "tokenizer error without the file name: %s\n", e.what());
      __builtin_trap();
    }
  }
  return 0;
}
