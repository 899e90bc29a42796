// The kvcompress tool's `compress` subcommand: .npy round trip equals the library called directly;
// bad files and options are rejected with clear messages. Needs no model.
#include <catch2/catch.hpp>

#include "cli_commands.hpp"
#include "support/random.hpp"
#include "support/test_utils.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace {

using kvc::test::TempDir;


int run(std::vector<std::string> args, std::string& out, std::string& err) {
  return kvc::test::run_tool(kvc::cli::run_command, std::move(args), out, err);
}

std::vector<float> random_floats(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> N;
  std::vector<float> v(n);
  for (auto& x : v) x = N(rng);
  return v;
}

/// A random layer (K, V [H][n][d], Q [Hq][W][d]) written as tmp/K.npy, V.npy, Q.npy in float32.
struct NpyLayer {
  std::vector<float> K, V, Q;
};
NpyLayer write_layer(const TempDir& tmp, std::mt19937_64& rng, std::int64_t H, std::int64_t Hq, std::int64_t n,
                     std::int64_t d, std::int64_t W) {
  NpyLayer l{random_floats(H * n * d, rng), random_floats(H * n * d, rng), random_floats(Hq * W * d, rng)};
  kvc::engine::write_npy(tmp / "K.npy", {H, n, d}, l.K.data());
  kvc::engine::write_npy(tmp / "V.npy", {H, n, d}, l.V.data());
  kvc::engine::write_npy(tmp / "Q.npy", {Hq, W, d}, l.Q.data());
  return l;
}

}  // namespace

TEST_CASE("compress round-trips through .npy and matches the library", "[cli][npy]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(77);
  const std::int64_t H = 2, Hq = 4, n = 96, d = 8, W = 16;
  TempDir tmp;
  const auto [K, V, Q] = write_layer(tmp, rng, H, Hq, n, d, W);

  // adakv-snapkv keeps a different number of entries per head: rows beyond a head's length are
  // padding (position -1, zeros), lengths.npy says how many are real.
  for (const std::string method : {"selkv", "snapkv", "grkv", "streaming", "adakv-snapkv", "adakv-selkv"}) {
    INFO(method);
    std::string out, err;
    REQUIRE(run({"compress", "--keys", tmp / "K.npy", "--values", tmp / "V.npy", "--queries", tmp / "Q.npy",
                 "--method", method, "--budget", "24", "--out", tmp / method},
                out, err) == 0);
    CHECK(err.empty());
    const auto pos = kvc::engine::read_npy(tmp / (method + "/positions.npy"));
    const auto keys = kvc::engine::read_npy(tmp / (method + "/keys.npy"));
    const auto values = kvc::engine::read_npy(tmp / (method + "/values.npy"));
    const auto bias = kvc::engine::read_npy(tmp / (method + "/bias.npy"));
    const auto lengths = kvc::engine::read_npy(tmp / (method + "/lengths.npy"));

    const kvc::LayerView<float> layer{kvc::make_head_major<const float>(K.data(), H, n, d),
                                      kvc::make_head_major<const float>(V.data(), H, n, d),
                                      kvc::make_head_major<const float>(Q.data(), Hq, W, d)};
    const auto direct = kvc::cli::make_method(method)(layer, kvc::Budget::tokens(24));
    const std::int64_t m = direct.max_size();
    if (method.rfind("adakv", 0) != 0) CHECK(m == 24);
    REQUIRE(lengths.shape == std::vector<std::int64_t>{H});
    CHECK(pos.shape == std::vector<std::int64_t>{H, m});
    CHECK(keys.shape == std::vector<std::int64_t>{H, m, d});
    CHECK(values.shape == std::vector<std::int64_t>{H, m, d});
    CHECK(bias.shape == std::vector<std::int64_t>{H, m});
    std::int64_t total = 0;
    for (std::int64_t g = 0; g < H; ++g) {
      const std::int64_t len = direct.heads[g].size();
      CHECK(lengths.i[g] == len);
      total += len;
      for (std::int64_t i = 0; i < m; ++i) {
        const bool real = i < len;
        CHECK(pos.i[g * m + i] == (real ? direct.heads[g].positions[i] : -1));
        CHECK(bias.f[g * m + i] == (real ? direct.heads[g].bias[i] : 0.0f));
        for (std::int64_t c = 0; c < d; ++c) {
          CHECK(keys.f[(g * m + i) * d + c] == (real ? direct.heads[g].keys(i, c) : 0.0f));
          CHECK(values.f[(g * m + i) * d + c] == (real ? direct.heads[g].values(i, c) : 0.0f));
        }
      }
    }
    CHECK(total == H * 24);
  }
}

TEST_CASE("compress --explain writes every head's merge map and prints one head's", "[cli][npy][merge_map]") {
  auto rng = kvc::test::make_rng(78);
  const std::int64_t H = 2, Hq = 4, n = 64, d = 8, W = 8;
  TempDir tmp;
  write_layer(tmp, rng, H, Hq, n, d, W);
  std::string out, err;
  const std::vector<std::string> args{"compress", "--keys", tmp / "K.npy", "--values", tmp / "V.npy", "--queries",
                                      tmp / "Q.npy", "--method", "selkv", "--budget", "16", "--out", tmp / "o"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  REQUIRE(run(with({"--explain", "1"}), out, err) == 0);
  CHECK_THAT(out, Catch::Contains("head 1: 48 evicted, "));
  const auto evicted = kvc::engine::read_npy(tmp / "o/merge_evicted.npy");
  const auto target = kvc::engine::read_npy(tmp / "o/merge_target.npy");
  const auto gate = kvc::engine::read_npy(tmp / "o/merge_gate.npy");
  const auto pos = kvc::engine::read_npy(tmp / "o/positions.npy");
  REQUIRE(evicted.shape == std::vector<std::int64_t>{H, n - 16});
  REQUIRE(target.shape == evicted.shape);
  REQUIRE(gate.shape == evicted.shape);
  for (std::int64_t g = 0; g < H; ++g) {
    std::vector<int> count(static_cast<std::size_t>(n), 0);
    for (std::int64_t i = 0; i < 16; ++i) ++count[static_cast<std::size_t>(pos.i[static_cast<std::size_t>(g * 16 + i)])];
    for (std::int64_t e = 0; e < n - 16; ++e) {
      const std::size_t at = static_cast<std::size_t>(g * (n - 16) + e);
      ++count[static_cast<std::size_t>(evicted.i[at])];
      const std::int64_t t = target.i[at];
      CHECK(std::find(pos.i.begin() + g * 16, pos.i.begin() + (g + 1) * 16, t) != pos.i.begin() + (g + 1) * 16);
      CHECK(gate.f[at] >= 0.0f);
      CHECK(gate.f[at] <= 1.0f);
    }
    CHECK(std::count(count.begin(), count.end(), 1) == n);  // kept and evicted: every position once
  }
  CHECK(run(with({"--explain", "2"}), out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--explain 2: the keys have 2 KV heads"));
  CHECK(run(with({"--explain", "-1"}), out, err) == 2);
}

TEST_CASE("compress accepts float16 .npy inputs", "[cli][npy]") {
  auto rng = kvc::test::make_rng(78);
  const std::int64_t H = 1, Hq = 2, n = 40, d = 4, W = 8;
  auto K = random_floats(H * n * d, rng), V = random_floats(H * n * d, rng), Q = random_floats(Hq * W * d, rng);
  TempDir tmp;
  kvc::engine::write_npy_f16(tmp / "K.npy", {H, n, d}, K.data());
  kvc::engine::write_npy_f16(tmp / "V.npy", {H, n, d}, V.data());
  kvc::engine::write_npy_f16(tmp / "Q.npy", {Hq, W, d}, Q.data());
  std::string out, err;
  REQUIRE(run({"compress", "--keys", tmp / "K.npy", "--values", tmp / "V.npy", "--queries", tmp / "Q.npy",
               "--method", "snapkv", "--ratio", "0.5", "--out", tmp / "o"},
              out, err) == 0);
  const auto keys = kvc::engine::read_npy(tmp / "o/keys.npy");
  CHECK(keys.shape == std::vector<std::int64_t>{H, 20, d});
  // The kept keys are the half-rounded inputs, exactly.
  const auto pos = kvc::engine::read_npy(tmp / "o/positions.npy");
  for (std::int64_t i = 0; i < 20; ++i)
    for (std::int64_t c = 0; c < d; ++c)
      CHECK(keys.f[i * d + c] == static_cast<float>(Eigen::half(K[pos.i[i] * d + c])));
}

TEST_CASE("the tool rejects bad input with a message and a non-zero exit code", "[cli][errors]") {
  auto rng = kvc::test::make_rng(79);
  const std::int64_t H = 2, n = 16, d = 4;
  const auto K = random_floats(H * n * d, rng);
  TempDir tmp;
  kvc::engine::write_npy(tmp / "K.npy", {H, n, d}, K.data());
  kvc::engine::write_npy(tmp / "Q3.npy", {3, 4, d}, K.data());
  std::vector<std::int32_t> ints(H * n * d, 1);
  kvc::engine::write_npy(tmp / "I.npy", {H, n, d}, ints.data());
  { std::ofstream(tmp / "bad.npy") << "not an npy file at all"; }
  std::string out, err;
  auto compress = [&](const std::string& k, const std::string& q, std::vector<std::string> extra) {
    std::vector<std::string> a = {"compress", "--keys", k, "--values", tmp / "K.npy", "--queries", q, "--out", tmp / "o"};
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a, out, err);
  };
  CHECK(compress(tmp / "bad.npy", tmp / "K.npy", {"--method", "snapkv"}) != 0);
  CHECK_THAT(err, Catch::Contains("bad.npy"));
  CHECK(compress(tmp / "I.npy", tmp / "K.npy", {"--method", "snapkv"}) != 0);
  CHECK_THAT(err, Catch::Contains("float32 or float16"));
  CHECK(compress(tmp / "K.npy", tmp / "Q3.npy", {"--method", "snapkv"}) != 0);
  CHECK_THAT(err, Catch::Contains("multiple of KV heads"));
  CHECK(compress(tmp / "K.npy", tmp / "K.npy", {"--method", "nosuch"}) == 2);
  CHECK_THAT(err, Catch::Contains("unknown method 'nosuch'"));
  CHECK(compress(tmp / "K.npy", tmp / "K.npy", {"--method", "snapkv", "--alpha", "0.3"}) == 2);
  CHECK_THAT(err, Catch::Contains("--alpha does not apply to method 'snapkv'"));
  CHECK(compress(tmp / "K.npy", tmp / "K.npy", {"--method", "snapkv", "--rope-base", "500000"}) == 2);
  CHECK_THAT(err, Catch::Contains("--rope-base does not apply to method 'snapkv'"));
  CHECK(compress(tmp / "K.npy", tmp / "K.npy", {"--method", "snapkv", "--ratoi", "0.3"}) == 2);
  CHECK_THAT(err, Catch::Contains("unknown option --ratoi"));
  CHECK(compress(tmp / "K.npy", tmp / "K.npy", {"--method", "snapkv", "--ratio", "abc"}) == 2);
  CHECK_THAT(err, Catch::Contains("expects a number"));
  CHECK(compress(tmp / "K.npy", tmp / "K.npy", {"--method", "snapkv", "--budget", "0"}) == 2);
  CHECK_THAT(err, Catch::Contains("budget"));
  CHECK_FALSE(fs::exists(tmp / "o/keys.npy"));
  CHECK(run({"frobnicate"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("unknown subcommand"));
}

TEST_CASE("options out of range, empty or contradictory are errors naming the option (issue 25)", "[cli][errors]") {
  // Every case fails on the options alone, before a model is loaded: the model paths do not exist.
  TempDir tmp;
  const std::vector<std::string> model = {"--model", tmp / "absent.bin", "--tokenizer", tmp / "absent_tok.bin"};
  std::string out, err;
  auto rejects = [&](std::vector<std::string> args, const std::string& what) {
    args.insert(args.end(), model.begin(), model.end());
    std::string joined;
    for (const auto& s : args) joined += s + " ";
    INFO(joined);
    CHECK(run(args, out, err) == 2);
    CHECK_THAT(err, Catch::Contains(what));
    CHECK(out.empty());
  };
  // generate --max-tokens -5 ran and exited 0 with empty generations.
  rejects({"generate", "--max-tokens", "-5"}, "--max-tokens must be >= 1, got '-5'");
  rejects({"generate", "--max-tokens", "0"}, "--max-tokens must be >= 1, got '0'");
  // --window 0 reached the library ("queries ... tokens=0").
  rejects({"generate", "--window", "0"}, "--window must be >= 1, got '0'");
  rejects({"eval", "--window", "0"}, "--window must be >= 1, got '0'");
  // eval --ratios= / --methods= printed an empty table.
  rejects({"eval", "--ratios="}, "--ratios is empty");
  rejects({"eval", "--methods="}, "--methods is empty");
  rejects({"eval", "--ratios", "0.1,,0.5"}, "--ratios has an empty item in '0.1,,0.5'");
  rejects({"eval", "--methods", "snapkv,"}, "--methods has an empty item");
  // eval --json --csv printed JSON and ignored --csv.
  rejects({"eval", "--json", "--csv"}, "either --json or --csv");
  // A ratio error prints the value as given, not rounded to 1.
  rejects({"eval", "--ratios", "0.5,1.0000001"}, "'1.0000001' is outside (0, 1]");
  rejects({"generate", "--ratio", "1.0000001"}, "'1.0000001' is outside (0, 1]");
  rejects({"generate", "--ratio", "0"}, "--ratio: ratio '0' is outside (0, 1]");
  // The same class: values that were narrowed, wrapped, ignored or taken as NaN.
  rejects({"eval", "--samples", "1099511627781"}, "--samples must be in [1, 2147483647]");
  rejects({"eval", "--samples", "0"}, "--samples must be in [1, 2147483647], got '0'");
  rejects({"eval", "--length", "4294967808"}, "--length must be in [2, 2147483647]");
  rejects({"eval", "--seed", "-1"}, "--seed must be >= 0, got '-1'");
  rejects({"eval", "--prefix", "0"}, "--prefix must be >= 1, got '0'");
  rejects({"eval", "--length", "200"}, "--prefix 384 must be below the sequence length 200");
  rejects({"eval", "--ratios", "nan"}, "--ratios expects a finite number, got 'nan'");
  rejects({"generate", "--ratio", "nan"}, "--ratio expects a finite number, got 'nan'");
  rejects({"generate", "--method", "grkv", "--alpha", "inf"}, "--alpha expects a finite number, got 'inf'");
  rejects({"generate", "--budget", "-3"}, "--budget must be >= 1, got '-3'");
  rejects({"eval", "--tokens="}, "--tokens needs a file name");
  CHECK(run({"eval", "--model=", "--tokenizer", tmp / "absent_tok.bin"}, out, err) == 2);
  CHECK_THAT(err, Catch::Contains("--model needs a file name"));
  rejects({"generate", "--ratio", "0.5", "--ratio", "0.25"}, "option --ratio given more than once");
  rejects({"eval", "--tokens", tmp / "t.npy", "--samples", "4"}, "--samples does not apply with --tokens");
}

TEST_CASE("eval --tokens rejects int64 ids that do not fit an int instead of narrowing them", "[cli][errors][npy]") {
  // 2^40 + 5 was narrowed to token 5 and evaluated.
  TempDir tmp;
  const std::vector<std::int64_t> ids = {1, 7, 9, (std::int64_t{1} << 40) + 5, 3, 4};
  kvc::engine::write_npy(tmp / "tok.npy", {2, 3}, ids.data());
  const std::vector<std::int64_t> neg = {1, -2};
  kvc::engine::write_npy(tmp / "neg.npy", {1, 2}, neg.data());
  const std::vector<std::int64_t> one = {1, 2, 3};
  kvc::engine::write_npy(tmp / "short.npy", {3, 1}, one.data());
  std::string out, err;
  auto eval = [&](const std::string& tokens) {
    return run({"eval", "--tokens", tokens, "--prefix", "1", "--model", tmp / "absent.bin", "--tokenizer",
                tmp / "absent_tok.bin"},
               out, err);
  };
  CHECK(eval(tmp / "tok.npy") == 2);
  CHECK_THAT(err, Catch::Contains(tmp / "tok.npy") && Catch::Contains("token [1][0] = 1099511627781"));
  CHECK(eval(tmp / "neg.npy") == 2);
  CHECK_THAT(err, Catch::Contains(tmp / "neg.npy") && Catch::Contains("token [0][1] = -2"));
  CHECK(eval(tmp / "short.npy") == 2);
  CHECK_THAT(err, Catch::Contains(tmp / "short.npy") && Catch::Contains("at least 2 tokens"));
}
