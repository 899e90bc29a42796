// kvc_demo: the README's demo. With the real model (KVC_MODEL_DIR, ./models, ../shared/models) it
// runs a greedy generation with the full and a compressed cache side by side, then a short
// evaluation table over the presets; without it, the synthetic demo.
#include "cli_commands.hpp"
#include "synthetic_demo.hpp"

#include <chrono>
#include <cstdio>
#include <iostream>

namespace {

// The presets through the tool's method table (compiled once, in kvc_cli_methods).
void run_synthetic_demo() {
  const kvc::demo::SyntheticLayer synth(2026);
  const auto layer = synth.view();
  std::printf("Synthetic layer: Hkv=%td Hq=%td n=%td d=%td W=%td (float)\n", synth.kv_heads, synth.query_heads,
              synth.tokens, synth.dim, synth.window);
  std::printf("  %-14s %5s %8s %12s %10s\n", "method", "ratio", "kept", "window_err", "time_ms");
  for (double ratio : {0.1, 0.25, 0.5}) {
    for (const char* method : {"streaming", "snapkv", "selkv-evict", "selkv", "selkv-mergeall"}) {
      const auto compress = kvc::cli::make_method(method);
      const auto t0 = std::chrono::steady_clock::now();
      const auto result = compress(layer, kvc::Budget::ratio(ratio));
      const auto t1 = std::chrono::steady_clock::now();
      const double err = kvc::window_output_error(layer, result);
      std::printf("  %-14s %5.2f %8td %12.4f %10.1f\n", method, ratio, result.max_size(), err,
                  std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
  std::printf("window_err = ||Y_full - Y_compressed||_F / ||Y_full||_F on the observation window.\n");
}

}  // namespace

int main() {
  const auto dir = kvc::engine::find_model_dir();
  if (!dir) {
    std::printf("%s\nRunning the synthetic demo instead.\n\n", kvc::engine::model_missing_message().c_str());
    run_synthetic_demo();
    return 0;
  }
  std::printf("Real model found in %s\n\n", dir->c_str());
  const std::string model = *dir + "/stories260K.bin", tok = *dir + "/tok512.bin";
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"kvcompress"});
    args.insert(args.end(), {"--model", model, "--tokenizer", tok});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return kvc::cli::run_command(static_cast<int>(argv.size()), argv.data(), std::cout, std::cerr);
  };
  int rc = 0;
  for (const char* method : {"selkv", "grkv"}) {
    std::printf("== kvcompress generate --method %s --ratio 0.25 (greedy, prompt compressed per layer)\n", method);
    rc |= run({"generate", "--prompt", "Once upon a time, there was a little dog named Max. Max liked to run and play in the park with his",
               "--method", method, "--ratio", "0.25", "--max-tokens", "60", "--window", "8"});
    std::printf("\n");
  }
  std::printf("== kvcompress eval --samples 8 --prefix 384 (SPEC §12 protocol, 8 of its 24 sequences for speed)\n");
  rc |= run({"eval", "--samples", "8", "--seed", "1", "--prefix", "384", "--methods",
             "streaming,snapkv,selkv-evict,selkv,grkv", "--ratios", "0.1,0.25,0.5"});
  std::printf("\nKL in nats per continuation token; window err = relative attention-output error on the window,\n"
              "mean over layers; last column: paired KL difference to SnapKV at the same ratio (negative = better).\n");
  return rc;
}
