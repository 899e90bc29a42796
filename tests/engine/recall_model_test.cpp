// The recall task (examples/engine/recall.hpp) and `kvcompress eval --task recall`: tasks hold what
// their questions ask for, the committed recall model answers them over the full cache, a compression
// that keeps everything changes no answer, and the tool's errors name the option. Filler comes from
// TinyStories-260K: exits 77 without it.
#include <catch2/catch.hpp>

#include "support/model_dir.hpp"
#include "support/test_main.hpp"

#include "cli_commands.hpp"
#include "engine_bridge.hpp"
#include "support/test_utils.hpp"

#include <algorithm>
#include <sstream>

using namespace kvc::engine;
using Catch::Matchers::Contains;

namespace {
const std::string& g_model_dir = kvc::test::model_dir();

const Model& story_model() {
  static const Model m = Model::load(g_model_dir + "/" + kCheckpointFile);
  return m;
}

const std::vector<int>& filler() {
  static const std::vector<int> f = recall_filler(story_model(), 3, 3);  // 1536 tokens
  return f;
}

// Index of `needle` in `hay` at or after `from`, or -1.
std::ptrdiff_t find(const std::vector<int>& hay, const std::vector<int>& needle, std::size_t from = 0) {
  const auto it = std::search(hay.begin() + static_cast<std::ptrdiff_t>(from), hay.end(), needle.begin(), needle.end());
  return it == hay.end() ? -1 : it - hay.begin();
}

int run(std::vector<std::string> args, std::string& out, std::string& err) {
  return kvc::test::run_tool(kvc::cli::run_command, std::move(args), out, err);
}
}  // namespace

TEST_CASE("recall tasks hold the facts their questions ask for, at the requested length", "[recall][model]") {
  using T = RecallTokens;
  for (const int t : filler()) REQUIRE_FALSE(T::reserved(t));
  for (const int L : {256, 1024}) {
    const auto tasks = make_recall_tasks(filler(), 9, L, 11);
    REQUIRE(tasks.size() == 9);
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      const RecallTask& t = tasks[i];
      INFO("length " << L << " task " << i);
      CHECK(static_cast<int>(t.kind) == static_cast<int>(i % 3));
      CHECK(t.context.size() + t.question.size() + t.answer.size() == static_cast<std::size_t>(L));
      CHECK(t.context.front() == Tokenizer::kBos);
      CHECK(t.answer.back() == T::kEnd);
      const int facts = static_cast<int>(std::count(t.context.begin(), t.context.end(), T::kFact));
      CHECK(facts == recall_facts(L) + 1);  // the hop's fact too
      for (int v = T::kFirstValue; v < T::kFirstValue + T::kValues; ++v)  // values are distinct
        CHECK(std::count(t.context.begin(), t.context.end(), v) <= 1);
      for (int d = T::kFirstDigit; d < T::kFirstDigit + T::kDigits; ++d)  // so are the passkey's digits
        CHECK(std::count(t.context.begin(), t.context.end(), d) <= 1);
      if (t.kind == RecallKind::kFact) {
        CHECK(find(t.context, {T::kFact, t.question[1], t.answer[0], t.answer[1], T::kEnd}) >= 0);
        CHECK(std::count(t.context.begin(), t.context.end(), t.question[1]) == 1);  // keys are distinct
      } else if (t.kind == RecallKind::kPasskey) {
        std::vector<int> pass{T::kPass};
        pass.insert(pass.end(), t.answer.begin(), t.answer.end());
        CHECK(find(t.context, pass) >= 0);
      } else {
        const std::ptrdiff_t link = find(t.context, {T::kLink, t.question[1]});
        REQUIRE(link >= 0);
        const int b = t.context[static_cast<std::size_t>(link + 2)];
        CHECK(t.answer == std::vector<int>{b, T::kFact, b, t.answer[3], t.answer[4], T::kEnd});
        CHECK(find(t.context, {T::kFact, b, t.answer[3], t.answer[4], T::kEnd}, static_cast<std::size_t>(link)) > link);
      }
    }
  }
  // Task i depends on the seed and i only.
  const auto a = make_recall_tasks(filler(), 3, 512, 5), b = make_recall_tasks(filler(), 5, 512, 5);
  const auto c = make_recall_tasks(filler(), 3, 512, 6);
  for (std::size_t i = 0; i < 3; ++i) CHECK(a[i].context == b[i].context);
  CHECK(a[0].context != c[0].context);
  CHECK_THROWS_WITH(make_recall_tasks(filler(), 1, 30, 1), Contains("below the shortest task"));
  CHECK_THROWS_WITH(make_recall_tasks(std::vector<int>(100, 20), 1, 512, 1), Contains("too short"));
  CHECK_THROWS_WITH(make_recall_tasks(filler(), -1, 512, 1), Contains(">= 0"));
}

TEST_CASE("the recall model answers over the full cache; keeping everything changes no answer", "[recall][model]") {
  const auto path = find_recall_model();
  if (!path) {
    WARN("SKIPPED: " << recall_model_missing_message());
    return;
  }
  const Model model = Model::load(*path);
  // The sanitizer build (-O0): the machinery on 2 short tasks; accuracy in the normal build.
  const int n_tasks = kvc::test::kSanitizerBuild ? 2 : 12, length = kvc::test::kSanitizerBuild ? 256 : 1024;
  const auto tasks = make_recall_tasks(filler(), n_tasks, length, 21);
  const LayerCompressor keep_all = kvc::cli::engine_compressor(kvc::cli::make_method("snapkv", {}), kvc::Budget::ratio(1.0));
  const LayerCompressor tenth = kvc::cli::engine_compressor(kvc::cli::make_method("streaming", {}), kvc::Budget::ratio(0.05));
  int full_hits = 0, tenth_hits = 0;
  for (const RecallSetting s : {RecallSetting::kQuestionLast, RecallSetting::kQuestionLater}) {
    for (const RecallTask& t : tasks) {
      std::vector<RunStats> stats;
      const std::vector<bool> h = recall_hits(model, t, s, 32, {nullptr, &keep_all, &tenth}, &stats);
      REQUIRE(h.size() == 3);
      CHECK(h[0] == h[1]);
      full_hits += h[0];
      tenth_hits += h[2];
      CHECK(stats[0].compressions == 0);
      CHECK(stats[2].compressions == model.config().n_layers);
    }
  }
  INFO("full cache " << full_hits << " of " << 2 * n_tasks << ", 5% recent window " << tenth_hits);
  if (!kvc::test::kSanitizerBuild) {
    CHECK(full_hits >= 21);         // of 24: the model retrieves (0.994 over 500 tasks of 1024 tokens, docs/recall.md)
    CHECK(tenth_hits < full_hits);  // a recent window of 5% forgets the facts
  }
  RecallTask empty;
  CHECK_THROWS_WITH(recall_hits(model, empty, RecallSetting::kQuestionLast, 32, {nullptr}), Contains("needs a context"));
}

TEST_CASE("eval --task recall reports every setting, method and ratio, and rejects what does not apply", "[recall][cli][model]") {
  std::string out, err;
  const std::string story = g_model_dir + "/" + kCheckpointFile;
  // The story model stands in for the recall model: the output's shape, not its accuracy, is tested.
  const std::vector<std::string> base{"eval", "--task", "recall", "--model", story, "--filler-model", story,
                                      "--length", "256", "--samples", "2", "--quiet"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  REQUIRE(run(with({"--methods", "snapkv,selkv", "--ratios", "0.25,0.5", "--csv"}), out, err) == 0);
  std::istringstream lines(out);
  std::string line;
  std::getline(lines, line);
  CHECK(line == "setting,method,ratio,accuracy,accuracy_lo,accuracy_hi,fact,passkey,hop,kept,accuracy_minus_snapkv,"
                "accuracy_minus_snapkv_lo,accuracy_minus_snapkv_hi");
  int rows = 0, full = 0, paired = 0;
  while (std::getline(lines, line)) {
    ++rows;
    full += line.find(",full,") != std::string::npos;
    paired += line.back() != ',';  // selkv against snapkv at its ratio, and full against snapkv at ratio 1: none
  }
  CHECK(rows == 2 * (1 + 2 * 2));
  CHECK(full == 2);
  CHECK(paired == 2 * 2);
  const std::string one_thread = out;
  REQUIRE(run(with({"--methods", "snapkv,selkv", "--ratios", "0.25,0.5", "--csv", "--threads", "2"}), out, err) == 0);
  CHECK(out == one_thread);
  REQUIRE(run(with({"--methods", "snapkv", "--ratios", "0.25", "--settings", "question-later", "--json"}), out, err) == 0);
  CHECK_THAT(out, Contains("\"setting\": \"question-later\"") && Contains("\"method\": \"snapkv\""));
  CHECK_THAT(out, !Contains("question-last"));
  CHECK(run(with({"--prefix", "100"}), out, err) == 2);
  CHECK_THAT(err, Contains("--prefix does not apply with --task recall"));
  CHECK(run(with({"--settings", "question-first"}), out, err) == 2);
  CHECK_THAT(err, Contains("question-first"));
  CHECK(run({"eval", "--task", "recall", "--model", story, "--filler-model", story, "--length", "4096"}, out, err) == 2);
  CHECK_THAT(err, Contains("exceeds the model's context"));
  CHECK(run({"eval", "--task", "needle"}, out, err) == 2);
  CHECK_THAT(err, Contains("--task must be kl or recall"));
}

namespace {
const kvc::test::RunOnlyIf needs_model(kvc::test::model_dir_missing);
}  // namespace
