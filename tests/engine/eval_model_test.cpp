// The kvcompress tool's methods on the real model (TinyStories-260K): at ratio 1.0 (and for `full`)
// every method leaves the cache untouched, so KL is exactly 0 and top-1 agreement exactly 1; at a real
// ratio the compressed run differs. `generate` and `eval` run end to end. Exits 77 without the model.
#include <catch2/catch.hpp>

#include "support/test_main.hpp"

#include "cli_commands.hpp"
#include "support/test_utils.hpp"

#include <iostream>
#include <sstream>

namespace {
std::string g_model_dir;

int run(std::vector<std::string> args, std::string& out, std::string& err) {
  args.insert(args.end(), {"--model", g_model_dir + "/stories260K.bin", "--tokenizer", g_model_dir + "/tok512.bin"});
  return kvc::test::run_tool(kvc::cli::run_command, std::move(args), out, err);
}
}  // namespace

TEST_CASE("every method at ratio 1.0 gives KL exactly 0 and top-1 exactly 1", "[eval][model]") {
  const auto model = kvc::engine::Model::load(g_model_dir + "/stories260K.bin");
  const auto seqs = kvc::engine::sample_sequences(model, 2, 160, 5);
  kvc::engine::EvalConfig config;
  config.prefix = 128;
  kvc::engine::TeacherForcedEval windowed(model, seqs, config);
  config.window = config.prefix;  // observed-attention (H2O) reads every prefill query
  kvc::engine::TeacherForcedEval every_query(model, seqs, config);
  for (const auto& method : kvc::cli::method_names()) {
    INFO(method);
    kvc::engine::TeacherForcedEval& ev = method == "observed-attention" ? every_query : windowed;
    // threshold keeps what reaches τ whatever the budget: τ below every score keeps everything.
    kvc::cli::MethodOptions keep_all;
    if (method == "threshold") keep_all.threshold = -1.0;
    const auto res =
        ev.evaluate(kvc::cli::engine_compressor(kvc::cli::make_method(method, keep_all), kvc::Budget::ratio(1.0)));
    CHECK(res.mean_kl == 0.0);
    CHECK(res.mean_top1 == 1.0);
    CHECK(res.mean_delta_nll == 0.0);
    if (method != "full") {
      const auto compressed =
          ev.evaluate(kvc::cli::engine_compressor(kvc::cli::make_method(method), kvc::Budget::ratio(0.25)));
      CHECK(compressed.mean_kl > 0.0);  // the comparison can tell a compressed cache apart
    }
  }
}

TEST_CASE("generate and eval run end to end on the model", "[cli][model]") {
  std::string out, err;
  REQUIRE(run({"generate", "--prompt", "Once upon a time", "--method", "selkv", "--ratio", "1.0", "--max-tokens", "40"},
              out, err) == 0);
  CHECK_THAT(out, Catch::Contains("there was a little girl named Lily"));
  CHECK_THAT(out, Catch::Contains("identical over 40 tokens"));
  // At ratio 1.0 every entry stays; AdaKV's per-head budgets keep Hkv·m per layer in all.
  const auto model = kvc::engine::Model::load(g_model_dir + "/stories260K.bin");
  const kvc::engine::Config& c = model.config();
  std::string want = "cache after compression: ";
  REQUIRE(run({"generate", "--prompt", "Once upon a time", "--method", "adakv-snapkv", "--budget", "3", "--max-tokens", "5"},
              out, err) == 0);
  const std::vector<int> prompt = kvc::engine::Tokenizer::load(g_model_dir + "/tok512.bin", c.vocab_size)
                                      .encode("Once upon a time", true);
  want += std::to_string(c.n_layers * c.n_kv_heads * 3) + " of " +
          std::to_string(c.n_layers * c.n_kv_heads * static_cast<int>(prompt.size())) + " entries";
  CHECK_THAT(out, Catch::Contains(want));
  REQUIRE(run({"eval", "--samples", "2", "--length", "200", "--prefix", "160", "--methods", "snapkv,selkv,grkv",
               "--ratios", "0.25", "--csv", "--quiet"},
              out, err) == 0);
  std::istringstream lines(out);
  std::string header, row;
  std::getline(lines, header);
  CHECK_THAT(header, Catch::StartsWith("method,ratio,kl,"));
  int rows = 0;
  while (std::getline(lines, row)) rows += row.empty() ? 0 : 1;
  CHECK(rows == 3);
  CHECK(run({"eval", "--samples", "2", "--methods", "snapkv", "--lambda", "0.1"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--lambda does not apply to method 'snapkv'"));
}

TEST_CASE("eval --tokens names the file and the element of a token id outside the vocabulary", "[cli][model]") {
  kvc::test::TempDir tmp;
  const std::vector<std::int64_t> ids = {1, 5, 9, 12, 1, 7, 512, 3};  // the model's vocabulary is 512
  kvc::engine::write_npy(tmp / "tok.npy", {2, 4}, ids.data());
  std::string out, err;
  CHECK(run({"eval", "--tokens", tmp / "tok.npy", "--prefix", "2", "--methods", "snapkv", "--ratios", "0.5", "--quiet"},
            out, err) == 2);
  CHECK_THAT(err, Catch::Contains(tmp / "tok.npy") && Catch::Contains("token [1][2] = 512") &&
                      Catch::Contains("vocabulary [0, 512)"));
}

namespace {
const kvc::test::RunOnlyIf needs_model([]() -> std::string {
  const auto dir = kvc::engine::find_model_dir();
  if (!dir) return kvc::engine::model_missing_message();
  g_model_dir = *dir;
  return "";
});
}  // namespace
