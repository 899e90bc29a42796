// libFuzzer target: the llama2.c checkpoint loader (examples/engine/llama2.hpp, Model::load from a
// stream), then one forward step and a prefill on what it accepts. The input is the checkpoint file.
// A malformed file must fail with std::runtime_error naming the source; a crash, a sanitizer report
// or another exception is a finding. (Finite weights may still overflow to non-finite logits: the
// loader's contract is finiteness of the file, so the logits are not checked.)
#include "engine/llama2.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string name = "fuzz-input-model.bin";
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  try {
    const kvc::engine::Model model = kvc::engine::Model::load(in, size, name);
    const kvc::engine::Config& c = model.config();
    // Small models only: the forward pass is O(layers * dim * hidden) per token.
    if (static_cast<std::uint64_t>(c.n_layers) * c.dim * (c.dim + c.hidden_dim + c.vocab_size) > (1u << 20)) return 0;
    kvc::engine::Session s(model);
    const auto logits = s.forward(1 % c.vocab_size);
    if (logits.size() != static_cast<std::size_t>(c.vocab_size)) __builtin_trap();
    if (c.seq_len >= 3) {
      s.reset();
      (void)s.prefill({1 % c.vocab_size, 2 % c.vocab_size, 0}, 2);
    }
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find(name) == std::string::npos) {
      std::fprintf(stderr, "model error without the file name: %s\n", e.what());
      __builtin_trap();
    }
  }
  return 0;
}
