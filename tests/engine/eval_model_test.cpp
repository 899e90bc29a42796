// The kvcompress tool's methods on the real model (TinyStories-260K): at ratio 1.0 (and for `full`)
// every method leaves the cache untouched, so KL is exactly 0 and top-1 agreement exactly 1; at a real
// ratio the compressed run differs. `generate` and `eval` run end to end. Exits 77 without the model.
#include <catch2/catch.hpp>

#include "support/model_dir.hpp"
#include "support/test_main.hpp"

#include "cli_commands.hpp"
#include "engine_bridge.hpp"
#include "support/test_utils.hpp"

#include <cstring>
#include <iostream>
#include <sstream>

namespace {
const std::string& g_model_dir = kvc::test::model_dir();

int run(std::vector<std::string> args, std::string& out, std::string& err) {
  args.insert(args.end(), {"--model", g_model_dir + "/stories260K.bin", "--tokenizer", g_model_dir + "/tok512.bin"});
  return kvc::test::run_tool(kvc::cli::run_command, std::move(args), out, err);
}
}  // namespace

TEST_CASE("every method at ratio 1.0 gives KL exactly 0 and top-1 exactly 1", "[eval][model]") {
  const auto model = kvc::engine::Model::load(g_model_dir + "/stories260K.bin");
  const auto seqs = kvc::engine::sample_sequences(model, kvc::test::kSanitizerBuild ? 1 : 2, 160, 5);
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
using kvc::engine::Session;
const kvc::engine::Model& shared_model() {
  static const kvc::engine::Model m = kvc::engine::Model::load(g_model_dir + "/stories260K.bin");
  return m;
}
std::vector<int> some_tokens(int n) {
  return kvc::engine::sample_sequences(shared_model(), 1, n, 11)[0];
}
}  // namespace

TEST_CASE("a growing cache hands over its newest tokens' queries, positions and bias", "[engine][model]") {
  const auto& model = shared_model();
  const kvc::engine::Config& c = model.config();
  const std::vector<int> seq = some_tokens(70);
  const std::ptrdiff_t W = 16;
  Session whole(model), grown(model);
  whole.prefill(seq, W, false);  // token by token: the same arithmetic as forward()
  CHECK_THROWS_WITH(grown.cache_input(0), Catch::Contains("keep_queries"));
  grown.keep_queries(W);
  grown.prefill(std::vector<int>(seq.begin(), seq.end() - 5), W, false);
  for (int t = 5; t > 0; --t) grown.forward(seq[seq.size() - static_cast<std::size_t>(t)]);
  for (int l = 0; l < c.n_layers; ++l) {
    const kvc::engine::LayerInput a = whole.layer_input(l), b = grown.cache_input(l);
    REQUIRE(b.W == W);
    REQUIRE(b.n == 70);
    for (std::ptrdiff_t h = 0; h < c.n_heads; ++h)
      for (std::ptrdiff_t w = 0; w < W; ++w)
        REQUIRE(std::memcmp(a.queries + (h * W + w) * a.d, b.queries + h * b.queries_head_stride + w * b.d,
                            sizeof(float) * static_cast<std::size_t>(a.d)) == 0);
    for (std::ptrdiff_t g = 0; g < c.n_kv_heads; ++g)
      for (std::ptrdiff_t j = 0; j < b.n; ++j) {
        REQUIRE(b.positions[g * b.state_stride + j] == j);
        REQUIRE(b.bias[g * b.state_stride + j] == 0.0f);
      }
  }
}

TEST_CASE("compression while the cache grows equals a one-shot compression of the same cache at that step",
          "[engine][model]") {
  const auto& model = shared_model();
  const kvc::engine::Config& c = model.config();
  const std::vector<int> seq = some_tokens(200);
  const std::ptrdiff_t W = 16, budget = 48, every = 8;
  const auto args = kvc::cli::decoding_arguments(budget, every, c.n_layers, W);
  auto check = [&](const std::string& method, auto preset) {
    INFO(method);
    using Preset = decltype(preset);
    const kvc::DecodingCompressor<Preset> reference(preset, args[0]);  // its pipeline has the forced tokens
    const auto make = kvc::cli::grown_compressor(kvc::cli::method_runner(method, {}), args);
    const kvc::engine::CacheCompressor grown = make();
    Session s(model);
    s.keep_queries(W);
    s.prefill(std::vector<int>(seq.begin(), seq.begin() + 40), W);
    int compressed = 0;
    for (std::size_t t = 40; t < seq.size(); ++t) {
      s.forward(seq[t]);
      std::vector<kvc::engine::CompressedLayer> want;
      for (int l = 0; l < c.n_layers; ++l)
        want.push_back(kvc::cli::to_engine(
            reference.pipeline().run(kvc::cli::view_of(s.cache_input(l)), kvc::Budget::tokens(budget))));
      const std::ptrdiff_t n = s.length(0);
      const int done = s.compress_grown(grown);
      if (done == 0) continue;
      REQUIRE(done == c.n_layers);
      REQUIRE(n > budget);
      ++compressed;
      for (int l = 0; l < c.n_layers; ++l) {
        const auto& r = want[static_cast<std::size_t>(l)];
        for (int g = 0; g < c.n_kv_heads; ++g) {
          REQUIRE(s.length(l, g) == r.m);
          for (std::ptrdiff_t i = 0; i < r.m; ++i) {
            REQUIRE(s.entry_position(l, g, i) == r.positions[static_cast<std::size_t>(g * r.m + i)]);
            REQUIRE(s.bias(l)[g * s.capacity() + i] == r.bias[static_cast<std::size_t>(g * r.m + i)]);
          }
          REQUIRE(std::memcmp(s.keys(l) + g * s.head_stride(), r.keys.data() + g * r.m * s.head_dim(),
                              sizeof(float) * static_cast<std::size_t>(r.m * s.head_dim())) == 0);
          REQUIRE(std::memcmp(s.values(l) + g * s.head_stride(), r.values.data() + g * r.m * s.head_dim(),
                              sizeof(float) * static_cast<std::size_t>(r.m * s.head_dim())) == 0);
        }
      }
      REQUIRE(s.window_rows(0) == W);  // the newest W entries were forced into the selection
    }
    CHECK(compressed >= 10);  // 160 decoded tokens, every 8 above 48 entries
    CHECK(s.peak_length() <= budget + every);
    CHECK(s.position() == 200);
  };
  check("snapkv", kvc::SnapKV{});
  check("selkv", kvc::SelKV{});  // merges and a bias that composes over compressions
}

TEST_CASE("chunked prefill and decoding change no logit while the budget holds the sequence, and bound the peak",
          "[eval][model]") {
  const auto& model = shared_model();
  const int L = model.config().n_layers;
  const auto seqs = kvc::engine::sample_sequences(model, kvc::test::kSanitizerBuild ? 1 : 2, 160, 5);
  kvc::engine::EvalConfig config;
  config.prefix = 128;
  config.window = 16;
  config.prefill_chunk = 48;
  kvc::engine::TeacherForcedEval ev(model, seqs, config);
  kvc::LayerScheduleArguments pyramid;
  pyramid.schedule = kvc::LayerSchedule::pyramid;
  for (const auto& method : kvc::cli::method_names()) {
    if (method == "observed-attention") continue;  // reads every prefill query: not a growing cache's window
    INFO(method);
    kvc::cli::MethodOptions keep_all;
    if (method == "threshold") keep_all.threshold = -1.0;
    const auto runner = kvc::cli::method_runner(method, keep_all);
    for (const auto& schedule : {kvc::LayerScheduleArguments{}, pyramid}) {
      kvc::engine::Compression plan;
      plan.chunked = kvc::cli::grown_compressor(
          runner, kvc::cli::chunked_prefill_arguments(kvc::Budget::ratio(1.0), schedule, L, config.prefix, config.window));
      plan.decoding = kvc::cli::grown_compressor(runner, kvc::cli::decoding_arguments(1000, 0, L, config.window));
      const auto res = ev.evaluate(plan);
      CHECK(res.mean_kl == 0.0);
      CHECK(res.mean_top1 == 1.0);
      CHECK(res.compressions == 0.0);
      CHECK(res.peak_entries == 159);
    }
  }
  // Budgets below the sequence: compressions run, and the cache never holds more than budget + chunk
  // in the prefill, budget + every in decoding.
  for (const std::string method : {"snapkv", "selkv", "grkv"}) {
    INFO(method);
    const auto runner = kvc::cli::method_runner(method, {});
    kvc::engine::Compression plan;
    plan.chunked = kvc::cli::grown_compressor(
        runner, kvc::cli::chunked_prefill_arguments(kvc::Budget::ratio(0.25), {}, L, config.prefix, config.window));
    auto res = ev.evaluate(plan);
    CHECK(res.mean_kl > 0.0);
    CHECK(res.peak_entries == 32 + 48);  // the kept 32 and the next chunk of 48
    CHECK(res.compressions == 3.0);      // after each chunk: 48, then 32 + 48, then 32 + 32 entries
    plan.decoding = kvc::cli::grown_compressor(runner, kvc::cli::decoding_arguments(20, 4, L, config.window));
    res = ev.evaluate(plan);
    CHECK(res.peak_entries <= std::max<std::ptrdiff_t>(32 + 48, 20 + 4));
    CHECK(res.compressions > 2.0);
  }
}

TEST_CASE("generate and eval compress while the cache grows, and refuse what cannot", "[cli][model]") {
  std::string out, err;
  REQUIRE(run({"generate", "--prompt", "Once upon a time there was a girl", "--method", "snapkv", "--budget", "6",
               "--prefill-chunk", "4", "--decode-budget", "12", "--compress-every", "4", "--window", "4",
               "--max-tokens", "30"},
              out, err) == 0);
  CHECK_THAT(out, Catch::Contains("peak entries per layer and head: 16"));
  REQUIRE(run({"eval", "--samples", "2", "--length", "200", "--prefix", "160", "--methods", "snapkv,selkv",
               "--ratios", "0.25", "--prefill-chunk", "64", "--decode-budget", "48", "--compress-every", "8",
               "--window", "16", "--json", "--quiet"},
              out, err) == 0);
  CHECK_THAT(out, Catch::Contains("\"peak_entries\": ") && Catch::Contains("\"compressions\": "));
  CHECK(run({"eval", "--samples", "2", "--methods", "snapkv", "--compress-every", "8"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--compress-every needs --decode-budget"));
  CHECK(run({"eval", "--samples", "2", "--methods", "snapkv", "--decode-budget", "64", "--reposition"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--reposition does not apply"));
  // The model's RoPE base comes from its file: --rope-base is compress's.
  CHECK(run({"generate", "--prompt", "Once", "--method", "expected-attention", "--rope-base", "500000", "--max-tokens", "2"},
            out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--rope-base does not apply to generate and eval"));
  CHECK(run({"eval", "--samples", "2", "--length", "200", "--prefix", "160", "--methods", "snapkv", "--allocation",
             "adakv", "--decode-budget", "64", "--quiet"},
            out, err) != 0);
  CHECK_THAT(err, Catch::Contains("same number of entries"));
}

TEST_CASE("a paged engine cache gives the contiguous cache's logits, and block eviction frees its pages",
          "[engine][model][paged]") {
  const auto& model = shared_model();
  const int L = model.config().n_layers;
  const auto seqs = kvc::engine::sample_sequences(model, 1, 170, 7);
  kvc::engine::EvalConfig flat;
  flat.prefix = 128;
  flat.window = 16;
  kvc::engine::EvalConfig paged = flat;
  paged.page_size = 16;
  const kvc::engine::TeacherForcedEval ev_flat(model, seqs, flat), ev_paged(model, seqs, paged);
  kvc::cli::MethodOptions blocks;
  blocks.block_size = 16;
  struct Case {
    const char* method;
    kvc::cli::MethodOptions options;
    bool decoding;
  };
  // Whole pages (block granularity) once and while decoding; token granularity, ragged per-head
  // lengths (AdaKV) and a merging method into the first pages.
  for (const Case& c : {Case{"snapkv", blocks, false}, Case{"snapkv", blocks, true}, Case{"adakv-snapkv", {}, false},
                        Case{"grkv", {}, false}}) {
    INFO(c.method << (c.options.block_size ? " --block-size 16" : "") << (c.decoding ? ", while decoding" : ""));
    kvc::engine::Compression plan;
    if (c.decoding)
      plan.decoding = kvc::cli::grown_compressor(kvc::cli::method_runner(c.method, c.options),
                                                 kvc::cli::decoding_arguments(48, 8, L, flat.window));
    else
      plan.once = kvc::cli::engine_compressor(kvc::cli::make_method(c.method, c.options), kvc::Budget::ratio(0.25));
    kvc::engine::RunStats a, b;
    CHECK(ev_paged.log_probs(0, plan, &b) == ev_flat.log_probs(0, plan, &a));
    CHECK(a.pages_freed == 0);
    CHECK(b.pages_freed > 0);
  }
  // Pages in use follow the cache: whole pages kept after a block-granular compression.
  kvc::engine::Session session(model, 0, 16);
  const std::vector<int> prompt(seqs[0].begin(), seqs[0].begin() + 150);
  session.prefill(prompt, 16);
  CHECK(session.pages_in_use(0) == 10);
  kvc::cli::MethodOptions o;
  o.block_size = 16;
  session.compress(kvc::cli::engine_compressor(kvc::cli::make_method("snapkv", o), kvc::Budget::tokens(64)));
  for (int l = 0; l < L; ++l) {
    CHECK(session.pages_in_use(l) == (session.length(l) + 15) / 16);
    CHECK(session.length(l) <= 64 + 2 * 16);
  }
  CHECK(session.pages_freed() > 0);
  for (int t = 0; t < 40; ++t) session.forward(prompt[static_cast<std::size_t>(t)]);
  CHECK(session.pages_in_use(0) == (session.length(0) + 15) / 16);
  CHECK_THROWS_AS(kvc::engine::Session(model, 0, -1), std::invalid_argument);
  CHECK_THROWS_AS(kvc::engine::Session(model, 0, model.config().seq_len + 1), std::invalid_argument);
  CHECK_THROWS_AS(session.keys(0), std::logic_error);  // [Hkv][capacity][d] describes no paged cache
  // Results a compressor may return that are not whole pages of the cache: an entry repeated (the
  // same page twice) and padding rows beyond the cache's length. The paged session holds what the
  // contiguous one holds.
  const auto repeat = [](const kvc::engine::LayerInput& in) {  // entries 0..3, then each again, halved
    kvc::engine::CompressedLayer r;
    r.m = 8;
    r.next_position = in.n;
    r.keys.assign(static_cast<std::size_t>(in.Hkv * r.m * in.d), 0.0f);
    r.values = r.keys;
    r.positions.assign(static_cast<std::size_t>(in.Hkv * r.m), 0);
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g)
      for (std::ptrdiff_t i = 0; i < r.m; ++i) {
        const std::ptrdiff_t j = i % 4;
        std::copy_n(in.key_row(g, j), in.d, r.keys.begin() + (g * r.m + i) * in.d);
        for (std::ptrdiff_t c = 0; c < in.d; ++c)  // written onto the first copy's row, the repeat would change it
          r.values[static_cast<std::size_t>((g * r.m + i) * in.d + c)] = in.value_row(g, j)[c] * (i < 4 ? 1.0f : 0.5f);
        r.positions[static_cast<std::size_t>(g * r.m + i)] = j;
      }
    return r;
  };
  const auto padded = [](const kvc::engine::LayerInput& in) {  // every entry, then 20 rows of padding
    kvc::engine::CompressedLayer r;
    r.m = in.n + 20;
    r.next_position = in.n;
    r.lengths.assign(static_cast<std::size_t>(in.Hkv), in.n);
    r.keys.assign(static_cast<std::size_t>(in.Hkv * r.m * in.d), 0.0f);
    r.values = r.keys;
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g)
      for (std::ptrdiff_t i = 0; i < in.n; ++i) {
        std::copy_n(in.key_row(g, i), in.d, r.keys.begin() + (g * r.m + i) * in.d);
        std::copy_n(in.value_row(g, i), in.d, r.values.begin() + (g * r.m + i) * in.d);
      }
    return r;
  };
  const std::vector<int> short_prompt(seqs[0].begin(), seqs[0].begin() + 12);
  kvc::engine::Session b(model, 0, 4);
  for (const kvc::engine::LayerCompressor& fn : {kvc::engine::LayerCompressor(repeat), kvc::engine::LayerCompressor(padded)}) {
    kvc::engine::Session a(model);
    b.reset();
    a.prefill(short_prompt, 4);
    b.prefill(short_prompt, 4);
    a.compress(fn);
    b.compress(fn);
    for (int t = 0; t < 6; ++t)
      CHECK(b.forward(seqs[0][static_cast<std::size_t>(20 + t)]) == a.forward(seqs[0][static_cast<std::size_t>(20 + t)]));
  }
  b.reset();  // every page back in the pool exactly once: a full prefill fits again
  CHECK_NOTHROW(b.prefill(std::vector<int>(seqs[0].begin(), seqs[0].begin() + 150), 4));
}

TEST_CASE("generate and eval keep a paged cache with --block-size", "[cli][model][paged]") {
  std::string out, err;
  REQUIRE(run({"generate", "--prompt", "Once upon a time there was a girl", "--method", "snapkv", "--ratio", "0.5",
               "--block-size", "4", "--decode-budget", "16", "--compress-every", "4", "--window", "4",
               "--max-tokens", "30"},
              out, err) == 0);
  CHECK_THAT(out, Catch::Contains("paged cache, pages of 4 entries: "));
  REQUIRE(run({"eval", "--samples", "1", "--length", "160", "--prefix", "128", "--methods", "snapkv", "--ratios",
               "0.25", "--block-size", "16", "--decode-budget", "48", "--compress-every", "16", "--window", "16",
               "--json", "--quiet"},
              out, err) == 0);
  CHECK_THAT(out, Catch::Contains("\"page_size\": 16, \"pages_freed\": "));
  CHECK(run({"eval", "--samples", "2", "--methods", "threshold", "--block-size", "16", "--quiet"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--block-size does not apply to method 'threshold'"));
  CHECK(run({"eval", "--samples", "2", "--methods", "snapkv", "--block-size", "16", "--selection", "per-head",
             "--quiet"},
            out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--selection must be shared"));
  CHECK(run({"eval", "--samples", "2", "--methods", "adakv-snapkv", "--block-size", "16", "--quiet"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("per-head budgets"));
  CHECK(run({"eval", "--samples", "2", "--methods", "snapkv", "--block-score", "max", "--quiet"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--block-score does not apply"));
}

namespace {
const kvc::test::RunOnlyIf needs_model(kvc::test::model_dir_missing);
}  // namespace
