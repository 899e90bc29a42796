// Real-model tests of the examples/engine harness (TinyStories-260K). Exits 77 (skip) without the model.
#include <catch2/catch.hpp>

#include "support/model_dir.hpp"
#include "support/test_main.hpp"

#include "engine/eval.hpp"
#include "engine/llama2.hpp"
#include "engine/model_path.hpp"
#include "support/test_utils.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using namespace kvc::engine;

namespace {

const std::string& g_model_dir = kvc::test::model_dir();

std::string checkpoint_path() { return g_model_dir + "/" + kCheckpointFile; }
std::string tokenizer_path() { return g_model_dir + "/" + kTokenizerFile; }

const Model& model() {
  static const Model m = Model::load(checkpoint_path());
  return m;
}
const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::load(tokenizer_path(), model().config().vocab_size);
  return t;
}

// The greedy text from the model's README (an external reference, not produced by this code).
const std::string kReadmeGreedy =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
    "she saw a big, red ball. She wanted to play with it, but it was too high.";

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void put_i32(std::vector<unsigned char>& b, std::size_t at, std::int32_t v) { std::memcpy(b.data() + at, &v, 4); }
void put_f32(std::vector<unsigned char>& b, std::size_t at, float v) { std::memcpy(b.data() + at, &v, 4); }

using kvc::test::TempDir;

// ---------------------------------------------------------------------------------------------
// Independent double-precision reference forward pass, written from the README's description.
// RoPE uses the checkpoint's own freq_cis tables; the cache is a list of (key, value, bias) entries per
// KV head, so eviction and biases are modelled by editing that list.
// ---------------------------------------------------------------------------------------------
struct RefEntry {
  std::vector<double> k, v;
  double bias = 0;
};
using RefCache = std::vector<std::vector<std::vector<RefEntry>>>;  // [layer][kv head][entry]

std::vector<double> ref_matvec(const float* w, const std::vector<double>& x, int out_dim) {
  std::vector<double> y(static_cast<std::size_t>(out_dim), 0.0);
  const std::size_t in_dim = x.size();
  for (int o = 0; o < out_dim; ++o) {
    double s = 0;
    for (std::size_t i = 0; i < in_dim; ++i) s += static_cast<double>(w[static_cast<std::size_t>(o) * in_dim + i]) * x[i];
    y[static_cast<std::size_t>(o)] = s;
  }
  return y;
}

std::vector<double> ref_rmsnorm(const std::vector<double>& x, const float* w) {
  double ss = 0;
  for (const double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + 1e-5);
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = static_cast<double>(w[i]) * x[i] * inv;
  return y;
}

void ref_rope(std::vector<double>& x, int head_size, int pos, const Model& m = model()) {
  const Config& c = m.config();
  const int half = head_size / 2;
  for (std::size_t base = 0; base < x.size(); base += static_cast<std::size_t>(head_size)) {
    for (int i = 0; i < half; ++i) {
      const double fr = m.freq_cis_real()[pos * half + i];
      const double fi = m.freq_cis_imag()[pos * half + i];
      const double a = x[base + 2 * static_cast<std::size_t>(i)];
      const double b = x[base + 2 * static_cast<std::size_t>(i) + 1];
      x[base + 2 * static_cast<std::size_t>(i)] = a * fr - b * fi;
      x[base + 2 * static_cast<std::size_t>(i) + 1] = a * fi + b * fr;
    }
  }
  (void)c;
}

RefCache ref_empty_cache() {
  const Config& c = model().config();
  return RefCache(static_cast<std::size_t>(c.n_layers), std::vector<std::vector<RefEntry>>(static_cast<std::size_t>(c.n_kv_heads)));
}

// Feeds `token` at RoPE position `pos`, appending to `cache`; returns the logits.
std::vector<double> ref_step(RefCache& cache, int token, int pos) {
  const Config& c = model().config();
  const int d = c.head_size();
  const int group = c.n_heads / c.n_kv_heads;
  std::vector<double> x(static_cast<std::size_t>(c.dim));
  for (int i = 0; i < c.dim; ++i) x[static_cast<std::size_t>(i)] = model().token_embedding()[token * c.dim + i];
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights w = model().layer(l);
    const std::vector<double> xb = ref_rmsnorm(x, w.rms_att);
    std::vector<double> q = ref_matvec(w.wq, xb, c.dim);
    std::vector<double> k = ref_matvec(w.wk, xb, c.kv_dim());
    const std::vector<double> v = ref_matvec(w.wv, xb, c.kv_dim());
    ref_rope(q, d, pos);
    ref_rope(k, d, pos);
    for (int g = 0; g < c.n_kv_heads; ++g) {
      RefEntry e;
      e.k.assign(k.begin() + g * d, k.begin() + (g + 1) * d);
      e.v.assign(v.begin() + g * d, v.begin() + (g + 1) * d);
      cache[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)].push_back(e);
    }
    std::vector<double> att(static_cast<std::size_t>(c.dim), 0.0);
    for (int h = 0; h < c.n_heads; ++h) {
      const std::vector<RefEntry>& entries = cache[static_cast<std::size_t>(l)][static_cast<std::size_t>(h / group)];
      std::vector<double> s(entries.size());
      double mx = -1e300;
      for (std::size_t j = 0; j < entries.size(); ++j) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += q[static_cast<std::size_t>(h * d + i)] * entries[j].k[static_cast<std::size_t>(i)];
        s[j] = dot / std::sqrt(static_cast<double>(d)) + entries[j].bias;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (std::size_t j = 0; j < entries.size(); ++j) {
        for (int i = 0; i < d; ++i) att[static_cast<std::size_t>(h * d + i)] += s[j] / sum * entries[j].v[static_cast<std::size_t>(i)];
      }
    }
    const std::vector<double> o = ref_matvec(w.wo, att, c.dim);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    const std::vector<double> xf = ref_rmsnorm(x, w.rms_ffn);
    std::vector<double> h1 = ref_matvec(w.w1, xf, c.hidden_dim);
    const std::vector<double> h3 = ref_matvec(w.w3, xf, c.hidden_dim);
    for (std::size_t i = 0; i < h1.size(); ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
    const std::vector<double> f = ref_matvec(w.w2, h1, c.dim);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += f[i];
  }
  return ref_matvec(model().classifier(), ref_rmsnorm(x, model().rms_final()), c.vocab_size);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// Tolerance for float engine vs double reference on logits (|logits| ~ 10).
constexpr double kLogitTol = 2e-3;

std::vector<int> test_sequence(int length, std::uint64_t seed) {
  return sample_sequences(model(), 1, length, seed)[0];
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("checkpoint header and RoPE tables match the README", "[engine][model]") {
  const Config& c = model().config();
  CHECK(c.dim == 64);
  CHECK(c.hidden_dim == 172);
  CHECK(c.n_layers == 5);
  CHECK(c.n_heads == 8);
  CHECK(c.n_kv_heads == 4);
  CHECK(c.vocab_size == 512);
  CHECK(c.seq_len == 512);
  CHECK(c.shared_classifier);
  CHECK(c.head_size() == 8);
  CHECK(c.group() == 2);
  // The file's freq_cis tables equal cos/sin(pos * 10000^(-2i/8)) up to float32 rounding.
  CHECK(model().rope_table_max_error() < 1e-4);
  for (int p : {0, 1, 7, 511}) {
    for (int i = 0; i < 4; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * i / 8.0);
      CHECK(std::abs(model().freq_cis_real()[p * 4 + i] - std::cos(a)) < 1e-4);
      CHECK(std::abs(model().freq_cis_imag()[p * 4 + i] - std::sin(a)) < 1e-4);
    }
  }
}

TEST_CASE("greedy decoding from BOS reproduces the README text", "[engine][model]") {
  for (const bool batched : {true, false}) {
    Session session(model());
    const std::vector<int> out = generate(session, {Tokenizer::kBos}, 64, 0.0, 0, batched);
    REQUIRE(out.size() == 64);
    const std::string text = tokenizer().decode(out);
    INFO("greedy text: " << text);
    const std::size_t common = std::min(text.size(), kReadmeGreedy.size());
    CHECK(common >= 100);
    CHECK(text.compare(0, common, kReadmeGreedy, 0, common) == 0);
  }
}

TEST_CASE("greedy continuation after a multi-token prefill matches greedy from BOS", "[engine][model]") {
  Session s0(model());
  const std::vector<int> full = generate(s0, {Tokenizer::kBos}, 60, 0.0);
  std::vector<int> prompt{Tokenizer::kBos};
  prompt.insert(prompt.end(), full.begin(), full.begin() + 20);
  Session s1(model());
  const std::vector<int> rest = generate(s1, prompt, 40, 0.0);
  CHECK(std::equal(rest.begin(), rest.end(), full.begin() + 20));
  CHECK(s1.position() == 21 + 39);
}

TEST_CASE("tokenizer decode and encode", "[engine][tokenizer]") {
  const Tokenizer& tok = tokenizer();
  REQUIRE(tok.vocab_size() == 512);
  CHECK(tok.max_token_length() > 0);
  // Byte-fallback pieces <0xNN> decode to the raw byte (ids 3..258 per the README).
  for (int b : {0x0A, 0x41, 0xC3, 0xFF}) {
    const int id = 3 + b;
    REQUIRE(Tokenizer::byte_of_piece(tok.piece(id)) == b);
    CHECK(tok.decode(5, id) == std::string(1, static_cast<char>(b)));
  }
  // Leading space dropped right after BOS only.
  const std::vector<int> once = tok.encode("Once", false);
  REQUIRE(!once.empty());
  REQUIRE(tok.piece(once[0])[0] == ' ');
  CHECK(tok.decode(Tokenizer::kBos, once[0])[0] != ' ');
  CHECK(tok.decode(100, once[0])[0] == ' ');
  // Round trips (non-ASCII text goes through byte fallback).
  for (const std::string& text : {std::string("Once upon a time, there was a little girl named Lily."),
                                 std::string("Tom said: \"Hi!\"\n  The end."), std::string("caf\xC3\xA9 \xE2\x98\x83 ok")}) {
    const std::vector<int> ids = tok.encode(text, true, true);
    REQUIRE(ids.size() >= 3);
    CHECK(ids.front() == Tokenizer::kBos);
    CHECK(ids.back() == Tokenizer::kEos);
    CHECK(tok.decode(ids) == text);
    // BPE merged something: fewer tokens than bytes + the dummy space.
    CHECK(ids.size() - 2 < text.size() + 1);
  }
  CHECK(tok.encode("", true) == std::vector<int>{Tokenizer::kBos});
  CHECK_THROWS_AS(tok.decode(0, 512), std::out_of_range);
  CHECK_THROWS_AS(tok.decode(0, -1), std::out_of_range);
}

TEST_CASE("forward and prefill agree with an independent double-precision reference", "[engine][model]") {
  const std::vector<int> seq = test_sequence(48, 11);
  const int P = 40;
  const std::vector<int> prefix(seq.begin(), seq.begin() + P);

  RefCache ref = ref_empty_cache();
  std::vector<std::vector<double>> ref_logits;
  for (int t = 0; t < static_cast<int>(seq.size()); ++t) ref_logits.push_back(ref_step(ref, seq[static_cast<std::size_t>(t)], t));

  for (const bool batched : {true, false}) {
    Session s(model());
    const std::vector<float> logits = s.prefill(prefix, 8, batched);
    CHECK(max_abs_diff(logits, ref_logits[P - 1]) < kLogitTol);
    CHECK(s.position() == P);
    for (int l = 0; l < model().config().n_layers; ++l) CHECK(s.length(l) == P);
    for (int t = P; t < static_cast<int>(seq.size()); ++t) {
      const std::vector<float> step = s.forward(seq[static_cast<std::size_t>(t)]);
      CHECK(max_abs_diff(step, ref_logits[static_cast<std::size_t>(t)]) < kLogitTol);
    }
  }
  // Token-by-token forward() from an empty session.
  Session s(model());
  for (int t = 0; t < 12; ++t) {
    CHECK(max_abs_diff(s.forward(seq[static_cast<std::size_t>(t)]), ref_logits[static_cast<std::size_t>(t)]) < kLogitTol);
  }
}

TEST_CASE("batched prefill equals token-by-token prefill", "[engine][model]") {
  const std::vector<int> seq = test_sequence(200, 5);
  Session a(model());
  Session b(model());
  const std::vector<float> la = a.prefill(seq, 32, true);
  const std::vector<float> lb = b.prefill(seq, 32, false);
  CHECK(max_abs_diff(la, lb) < 1e-4);
  CHECK(argmax(la) == argmax(lb));
  const Config& c = model().config();
  REQUIRE(a.window() == 32);
  REQUIRE(b.window() == 32);
  for (int l = 0; l < c.n_layers; ++l) {
    double dk = 0, dv = 0, dq = 0;
    for (int g = 0; g < c.n_kv_heads; ++g) {
      for (std::ptrdiff_t e = 0; e < 200 * a.head_dim(); ++e) {
        const std::ptrdiff_t at = g * a.head_stride() + e;
        dk = std::max(dk, static_cast<double>(std::abs(a.keys(l)[at] - b.keys(l)[at])));
        dv = std::max(dv, static_cast<double>(std::abs(a.values(l)[at] - b.values(l)[at])));
      }
    }
    for (std::ptrdiff_t e = 0; e < c.n_heads * 32 * a.head_dim(); ++e) {
      dq = std::max(dq, static_cast<double>(std::abs(a.queries(l)[e] - b.queries(l)[e])));
    }
    CHECK(dk < 1e-4);
    CHECK(dv < 1e-4);
    CHECK(dq < 1e-4);
  }
  // Continuing both sessions stays in agreement.
  CHECK(max_abs_diff(a.forward(7), b.forward(7)) < 1e-4);
}

// Max |engine - direct| over layer 0's cached keys and values and its last W queries after `s`
// prefilled `seq` with window W. Layer 0's input at every position is the token embedding, so they can
// be computed directly: q = RoPE(Wq rmsnorm(e)), rotated by the file's freq_cis tables.
double layer0_error(const Model& m, const Session& s, const std::vector<int>& seq, int W) {
  const Config& c = m.config();
  const int n = static_cast<int>(seq.size()), d = c.head_size();
  const LayerInput in = s.layer_input(0);
  const LayerWeights w = m.layer(0);
  double err = 0;
  for (int j = 0; j < n; ++j) {
    std::vector<double> x(static_cast<std::size_t>(c.dim));
    for (int i = 0; i < c.dim; ++i) x[static_cast<std::size_t>(i)] = m.token_embedding()[seq[static_cast<std::size_t>(j)] * c.dim + i];
    const std::vector<double> xb = ref_rmsnorm(x, w.rms_att);
    std::vector<double> q = ref_matvec(w.wq, xb, c.dim);
    std::vector<double> k = ref_matvec(w.wk, xb, c.kv_dim());
    const std::vector<double> v = ref_matvec(w.wv, xb, c.kv_dim());
    ref_rope(q, d, j, m);
    ref_rope(k, d, j, m);
    for (int g = 0; g < c.n_kv_heads; ++g) {
      for (int i = 0; i < d; ++i) {
        err = std::max(err, std::abs(in.keys[g * in.head_stride + j * d + i] - k[static_cast<std::size_t>(g * d + i)]));
        err = std::max(err, std::abs(in.values[g * in.head_stride + j * d + i] - v[static_cast<std::size_t>(g * d + i)]));
      }
    }
    if (j >= n - W) {
      for (int h = 0; h < c.n_heads; ++h) {
        for (int i = 0; i < d; ++i) {
          err = std::max(err, std::abs(in.queries[(h * W + (j - (n - W))) * d + i] - q[static_cast<std::size_t>(h * d + i)]));
        }
      }
    }
  }
  return err;
}

TEST_CASE("cache and window-query layout match a direct layer-0 computation", "[engine][model]") {
  const Config& c = model().config();
  const std::vector<int> seq = test_sequence(30, 3);
  const int n = 30, W = 6, d = c.head_size();
  Session s(model());
  s.prefill(seq, W);
  const LayerInput in = s.layer_input(0);
  REQUIRE(in.n == n);
  REQUIRE(in.W == W);
  REQUIRE(in.Hkv == c.n_kv_heads);
  REQUIRE(in.Hq == c.n_heads);
  REQUIRE(in.d == d);
  REQUIRE(in.head_stride == s.capacity() * d);
  CHECK(layer0_error(model(), s, seq, W) < 1e-4);
  // A window larger than the prompt is clipped to the prompt length.
  Session s2(model());
  s2.prefill({1, 2, 3}, 32);
  CHECK(s2.window() == 3);
}

TEST_CASE("a checkpoint's RoPE base is read off its freq_cis tables", "[engine][model][files]") {
  // stories260K.bin with tables of base 10^6 (as models trained for long contexts use): the forward pass
  // rotates by them, not by 10000; a table mixing two bases is refused.
  const std::size_t tables = 28 + 4 * (512 * 64 + 5 * 64 + 2 * 5 * 64 * 64 + 2 * 5 * 32 * 64 + 5 * 64 +
                                       3 * 5 * 172 * 64 + 64);  // bytes before freq_cis_real [512][4]
  auto with_base = [&](double pair3_base) {
    std::vector<unsigned char> bytes = read_bytes(checkpoint_path());
    for (int p = 0; p < 512; ++p)
      for (int i = 0; i < 4; ++i) {
        const double a = p * std::pow(i == 3 ? pair3_base : 1e6, -2.0 * i / 8.0);
        put_f32(bytes, tables + 4 * static_cast<std::size_t>(p * 4 + i), static_cast<float>(std::cos(a)));
        put_f32(bytes, tables + 4 * static_cast<std::size_t>(512 * 4 + p * 4 + i), static_cast<float>(std::sin(a)));
      }
    return bytes;
  };
  TempDir tmp;
  write_bytes(tmp.file("base1e6.bin"), with_base(1e6));
  const Model m = Model::load(tmp.file("base1e6.bin"));
  CHECK(std::abs(m.rope_base() / 1e6 - 1.0) < 1e-6);
  CHECK(m.rope_table_max_error() < 1e-4);
  CHECK(model().rope_base() == Approx(10000.0).epsilon(1e-6));
  // Layer 0 follows the file's tables, and its keys differ visibly from those of base 10000.
  const int n = 40;
  const std::vector<int> seq = test_sequence(n, 4);
  Session s(m), s_10000(model());
  s.prefill(seq, n);
  s_10000.prefill(seq, n);
  CHECK(layer0_error(m, s, seq, n) < 1e-4);
  const LayerInput in = s.layer_input(0), in_10000 = s_10000.layer_input(0);
  double moved = 0;
  for (int g = 0; g < in.Hkv; ++g)
    for (std::ptrdiff_t i = 0; i < n * in.d; ++i)
      moved = std::max(moved, static_cast<double>(std::abs(in.keys[g * in.head_stride + i] - in_10000.keys[g * in_10000.head_stride + i])));
  CHECK(moved > 1e-2);
  write_bytes(tmp.file("mixed.bin"), with_base(1e4));
  CHECK_THROWS_WITH(Model::load(tmp.file("mixed.bin")), Contains("freq_cis tables differ from RoPE base"));
}

TEST_CASE("identity compressor leaves every logit bit-identical", "[engine][model]") {
  const std::vector<int> seq = test_sequence(100, 21);
  const std::vector<int> prefix(seq.begin(), seq.begin() + 80);
  Session plain(model());
  Session compressed(model());
  const std::vector<float> a0 = plain.prefill(prefix, 16);
  const std::vector<float> b0 = compressed.prefill(prefix, 16);
  CHECK(a0 == b0);
  compressed.compress(full_compressor());
  CHECK(compressed.position() == 80);
  CHECK(compressed.length(0) == 80);
  for (int t = 80; t < 100; ++t) {
    const std::vector<float> a = plain.forward(seq[static_cast<std::size_t>(t)]);
    const std::vector<float> b = compressed.forward(seq[static_cast<std::size_t>(t)]);
    CHECK(a == b);
  }
}

TEST_CASE("compression: per-head eviction, biases and a position offset match the reference", "[engine][model]") {
  const Config& c = model().config();
  const std::vector<int> seq = test_sequence(72, 8);
  const int n = 60;
  const std::ptrdiff_t next_position = n + 5;  // a gap: decoding resumes at RoPE position 65
  const std::vector<int> prefix(seq.begin(), seq.begin() + n);

  // Head g keeps the 4 sinks, every 4th position starting at 4 + g, and the last 6 (same count per head).
  auto kept = [&](int g) {
    std::vector<int> pos{0, 1, 2, 3};
    for (int j = 4 + g; j < n - 8; j += 4) pos.push_back(j);
    for (int j = n - 6; j < n; ++j) pos.push_back(j);
    return pos;
  };
  auto bias_of = [](int layer, int g, int slot) { return 0.3 * std::sin(1.0 + layer + 2.0 * g + 0.7 * slot); };
  const std::ptrdiff_t m = static_cast<std::ptrdiff_t>(kept(0).size());
  for (int g = 1; g < c.n_kv_heads; ++g) REQUIRE(static_cast<std::ptrdiff_t>(kept(g).size()) == m);

  int calls = 0;
  const LayerCompressor evict = [&](const LayerInput& in) {
    ++calls;
    CompressedLayer out;
    out.m = m;
    out.next_position = next_position;
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g) {
      const std::vector<int> pos = kept(static_cast<int>(g));
      for (std::size_t s = 0; s < pos.size(); ++s) {
        const float* k = in.keys + g * in.head_stride + pos[s] * in.d;
        const float* v = in.values + g * in.head_stride + pos[s] * in.d;
        out.keys.insert(out.keys.end(), k, k + in.d);
        out.values.insert(out.values.end(), v, v + in.d);
        out.bias.push_back(static_cast<float>(bias_of(in.layer, static_cast<int>(g), static_cast<int>(s))));
      }
    }
    return out;
  };
  Session s(model());
  s.prefill(prefix, 8);
  s.compress(evict);
  CHECK(calls == c.n_layers);
  CHECK(s.position() == next_position);
  for (int l = 0; l < c.n_layers; ++l) CHECK(s.length(l) == m);

  // Reference: full prefix, then the same selection and biases on the entry lists.
  RefCache ref = ref_empty_cache();
  for (int t = 0; t < n; ++t) ref_step(ref, seq[static_cast<std::size_t>(t)], t);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int g = 0; g < c.n_kv_heads; ++g) {
      std::vector<RefEntry>& entries = ref[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)];
      std::vector<RefEntry> picked;
      const std::vector<int> pos = kept(g);
      for (std::size_t j = 0; j < pos.size(); ++j) {
        picked.push_back(entries[static_cast<std::size_t>(pos[j])]);
        picked.back().bias = static_cast<float>(bias_of(l, g, static_cast<int>(j)));
      }
      entries = picked;
    }
  }
  double worst = 0;
  double drift = 0;  // how far the compressed run moved from the uncompressed one (must be visible)
  Session full(model());
  full.prefill(prefix, 8);
  for (int t = n; t < 72; ++t) {
    const int tok = seq[static_cast<std::size_t>(t)];
    const std::vector<float> got = s.forward(tok);
    const std::vector<double> want = ref_step(ref, tok, static_cast<int>(next_position) + (t - n));
    worst = std::max(worst, max_abs_diff(got, want));
    drift = std::max(drift, max_abs_diff(got, full.forward(tok)));
  }
  CHECK(worst < kLogitTol);
  CHECK(drift > 100 * kLogitTol);
  CHECK(s.position() == next_position + 12);
  CHECK(s.length(0) == m + 12);
}

TEST_CASE("compression with per-head lengths: each head keeps its own count and matches the reference", "[engine][model]") {
  const Config& c = model().config();
  const std::vector<int> seq = test_sequence(72, 9);
  const int n = 60;
  const std::vector<int> prefix(seq.begin(), seq.begin() + n);
  // Head g keeps the 4 sinks, every (3 + g)-th position from 4, and the last 6: a different count per head.
  auto kept = [&](int g) {
    std::vector<int> pos{0, 1, 2, 3};
    for (int j = 4; j < n - 8; j += 3 + g) pos.push_back(j);
    for (int j = n - 6; j < n; ++j) pos.push_back(j);
    return pos;
  };
  std::ptrdiff_t m = 0;
  for (int g = 0; g < c.n_kv_heads; ++g) m = std::max<std::ptrdiff_t>(m, static_cast<std::ptrdiff_t>(kept(g).size()));
  REQUIRE(c.n_kv_heads > 1);
  REQUIRE(kept(1).size() < kept(0).size());
  // Padding rows hold NaN-free garbage with a large bias: the engine must not read them.
  const LayerCompressor ragged = [&](const LayerInput& in) {
    CompressedLayer out;
    out.m = m;
    out.next_position = n;
    out.keys.assign(static_cast<std::size_t>(in.Hkv * m * in.d), 5.0f);
    out.values.assign(out.keys.size(), 5.0f);
    out.bias.assign(static_cast<std::size_t>(in.Hkv * m), 50.0f);
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g) {
      const std::vector<int> pos = kept(static_cast<int>(g));
      out.lengths.push_back(static_cast<std::ptrdiff_t>(pos.size()));
      for (std::size_t s = 0; s < pos.size(); ++s) {
        std::copy_n(in.keys + g * in.head_stride + pos[s] * in.d, in.d, out.keys.begin() + (g * m + static_cast<std::ptrdiff_t>(s)) * in.d);
        std::copy_n(in.values + g * in.head_stride + pos[s] * in.d, in.d, out.values.begin() + (g * m + static_cast<std::ptrdiff_t>(s)) * in.d);
        out.bias[static_cast<std::size_t>(g * m) + s] = 0.0f;
      }
    }
    return out;
  };
  Session s(model());
  s.prefill(prefix, 8);
  s.compress(ragged);
  std::ptrdiff_t entries = 0;
  for (int l = 0; l < c.n_layers; ++l)
    for (int g = 0; g < c.n_kv_heads; ++g) {
      CHECK(s.length(l, g) == static_cast<std::ptrdiff_t>(kept(g).size()));
      entries += s.length(l, g);
    }
  CHECK(s.length(0) == m);
  CHECK(s.entries() == entries);
  CHECK(entries < c.n_layers * c.n_kv_heads * m);  // fewer than one length per layer would hold

  RefCache ref = ref_empty_cache();
  for (int t = 0; t < n; ++t) ref_step(ref, seq[static_cast<std::size_t>(t)], t);
  for (int l = 0; l < c.n_layers; ++l)
    for (int g = 0; g < c.n_kv_heads; ++g) {
      std::vector<RefEntry>& list = ref[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)];
      std::vector<RefEntry> picked;
      for (const int p : kept(g)) picked.push_back(list[static_cast<std::size_t>(p)]);
      list = picked;
    }
  double worst = 0;
  for (int t = n; t < 72; ++t) {
    const int tok = seq[static_cast<std::size_t>(t)];
    worst = std::max(worst, max_abs_diff(s.forward(tok), ref_step(ref, tok, t)));
  }
  CHECK(worst < kLogitTol);
  for (int g = 0; g < c.n_kv_heads; ++g) CHECK(s.length(0, g) == static_cast<std::ptrdiff_t>(kept(g).size()) + 12);

  // Lengths that do not fit are refused and the session is unchanged.
  Session bad(model());
  bad.prefill(prefix, 8);
  const LayerCompressor too_long = [&](const LayerInput& in) {
    CompressedLayer out = ragged(in);
    out.lengths[0] = m + 1;
    return out;
  };
  CHECK_THROWS_WITH(bad.compress(too_long), Catch::Contains("outside [1, m"));
  CHECK(bad.length(0, 0) == n);
}

// max |a - b| relative to max(1, max |b|).
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double scale = 1;
  for (const float v : b) scale = std::max(scale, static_cast<double>(std::abs(v)));
  return max_abs_diff(a, b) / scale;
}

// Keeps sinks 0..3, (n - 12) / 3 positions 3 apart from 4 + g % 3, and the last 8 of each head (same
// count per head);
// kept slot i of every head and layer gets bias 0.3 * (i % 3). Decoding resumes at n + gap.
LayerCompressor evict_with_bias(std::ptrdiff_t gap, bool with_bias = true) {
  return [gap, with_bias](const LayerInput& in) {
    CompressedLayer out;
    out.next_position = in.n + gap;
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g) {
      std::vector<std::ptrdiff_t> pos{0, 1, 2, 3};
      for (std::ptrdiff_t i = 0; i < (in.n - 12) / 3; ++i) pos.push_back(4 + g % 3 + 3 * i);
      for (std::ptrdiff_t j = in.n - 8; j < in.n; ++j) pos.push_back(j);
      out.m = static_cast<std::ptrdiff_t>(pos.size());
      for (std::size_t i = 0; i < pos.size(); ++i) {
        const float* k = in.keys + g * in.head_stride + pos[i] * in.d;
        const float* v = in.values + g * in.head_stride + pos[i] * in.d;
        out.keys.insert(out.keys.end(), k, k + in.d);
        out.values.insert(out.values.end(), v, v + in.d);
        out.bias.push_back(with_bias ? 0.3f * static_cast<float>(i % 3) : 0.0f);
      }
    }
    return out;
  };
}

TEST_CASE("extend: one batched pass over a compressed, biased cache equals token-by-token forward", "[engine][model]") {
  const Config& c = model().config();
  const std::vector<int> seq = test_sequence(96, 13);
  const int n = 64, T = 32;
  const std::ptrdiff_t gap = 3;
  const std::vector<int> prefix(seq.begin(), seq.begin() + n);
  const std::vector<int> cont(seq.begin() + n, seq.end());
  REQUIRE(static_cast<int>(cont.size()) == T);

  Session chunk(model());
  Session step(model());
  chunk.prefill(prefix, 8);
  step.prefill(prefix, 8);
  chunk.compress(evict_with_bias(gap));
  step.compress(evict_with_bias(gap));
  const std::ptrdiff_t m = chunk.length(0);
  REQUIRE(m < n);  // tokens were evicted
  REQUIRE(chunk.bias(0)[1] != 0.0f);
  REQUIRE(chunk.position() == n + gap);

  const std::vector<std::vector<float>> got = chunk.extend(cont);
  REQUIRE(static_cast<int>(got.size()) == T);
  double worst = 0;
  int argmax_mismatch = 0;
  std::vector<std::vector<float>> want;
  for (int t = 0; t < T; ++t) {
    want.push_back(step.forward(cont[static_cast<std::size_t>(t)]));
    worst = std::max(worst, max_rel_diff(got[static_cast<std::size_t>(t)], want.back()));
    argmax_mismatch += argmax(got[static_cast<std::size_t>(t)]) != argmax(want.back());
  }
  CHECK(worst < 1e-4);
  CHECK(argmax_mismatch == 0);
  CHECK(chunk.position() == n + gap + T);
  CHECK(step.position() == chunk.position());
  CHECK(!chunk.window_valid());
  CHECK_THROWS_WITH(chunk.compress(full_compressor()), Contains("prefill"));
  // Same cache afterwards: kept entries and their biases untouched, new slots m.. hold the
  // continuation with bias 0.
  for (int l = 0; l < c.n_layers; ++l) {
    REQUIRE(chunk.length(l) == m + T);
    double dk = 0, dv = 0;
    for (int g = 0; g < c.n_kv_heads; ++g) {
      for (std::ptrdiff_t e = 0; e < (m + T) * chunk.head_dim(); ++e) {
        const std::ptrdiff_t at = g * chunk.head_stride() + e;
        dk = std::max(dk, static_cast<double>(std::abs(chunk.keys(l)[at] - step.keys(l)[at])));
        dv = std::max(dv, static_cast<double>(std::abs(chunk.values(l)[at] - step.values(l)[at])));
      }
      for (std::ptrdiff_t j = 0; j < m + T; ++j) {
        const float b = chunk.bias(l)[g * chunk.capacity() + j];
        CHECK(b == step.bias(l)[g * step.capacity() + j]);
        CHECK(b == (j < m ? 0.3f * static_cast<float>(j % 3) : 0.0f));
      }
    }
    CHECK(dk < 1e-4);
    CHECK(dv < 1e-4);
  }
  // Continuing both stays in agreement.
  CHECK(max_rel_diff(chunk.forward(7), step.forward(7)) < 1e-4);

  // The eviction and the biases both matter (so the agreement above is not vacuous).
  Session full(model());
  full.prefill(prefix, 8);
  Session unbiased(model());
  unbiased.prefill(prefix, 8);
  unbiased.compress(evict_with_bias(gap, false));
  const std::vector<std::vector<float>> full_rows = full.extend(cont);
  const std::vector<std::vector<float>> unbiased_rows = unbiased.extend(cont);
  double drift_full = 0, drift_bias = 0;
  for (int t = 0; t < T; ++t) {
    drift_full = std::max(drift_full, max_abs_diff(got[static_cast<std::size_t>(t)], full_rows[static_cast<std::size_t>(t)]));
    drift_bias = std::max(drift_bias, max_abs_diff(got[static_cast<std::size_t>(t)], unbiased_rows[static_cast<std::size_t>(t)]));
  }
  CHECK(drift_full > 100 * kLogitTol);
  CHECK(drift_bias > 100 * kLogitTol);

  // Against the double-precision reference with the same selection and biases.
  RefCache ref = ref_empty_cache();
  for (int t = 0; t < n; ++t) ref_step(ref, seq[static_cast<std::size_t>(t)], t);
  for (int g = 0; g < c.n_kv_heads; ++g) {
    std::vector<int> pos{0, 1, 2, 3};
    for (int i = 0; i < (n - 12) / 3; ++i) pos.push_back(4 + g % 3 + 3 * i);
    for (int j = n - 8; j < n; ++j) pos.push_back(j);
    for (int l = 0; l < c.n_layers; ++l) {
      std::vector<RefEntry>& entries = ref[static_cast<std::size_t>(l)][static_cast<std::size_t>(g)];
      std::vector<RefEntry> picked;
      for (std::size_t i = 0; i < pos.size(); ++i) {
        picked.push_back(entries[static_cast<std::size_t>(pos[i])]);
        picked.back().bias = static_cast<double>(0.3f * static_cast<float>(i % 3));
      }
      entries = picked;
    }
  }
  double ref_worst = 0;
  for (int t = 0; t < T; ++t) {
    const std::vector<double> r = ref_step(ref, cont[static_cast<std::size_t>(t)], n + static_cast<int>(gap) + t);
    ref_worst = std::max(ref_worst, max_abs_diff(got[static_cast<std::size_t>(t)], r));
  }
  CHECK(ref_worst < kLogitTol);
}

TEST_CASE("extend on an uncompressed session equals prefill", "[engine][model]") {
  const std::vector<int> seq = test_sequence(60, 17);
  const std::vector<int> head(seq.begin(), seq.begin() + 40);
  Session e(model());
  const std::vector<std::vector<float>> rows = e.extend(head);
  REQUIRE(rows.size() == 40);
  for (const bool batched : {true, false}) {
    Session p(model());
    const std::vector<float> last = p.prefill(head, 4, batched);
    CHECK(max_rel_diff(rows.back(), last) < 1e-4);
    CHECK(argmax(rows.back()) == argmax(last));
  }
  // Every row is the prefill of the tokens up to it.
  for (const int t : {0, 1, 9, 25}) {
    Session p(model());
    const std::vector<float> want = p.prefill(std::vector<int>(head.begin(), head.begin() + t + 1), 0);
    CHECK(max_rel_diff(rows[static_cast<std::size_t>(t)], want) < 1e-4);
  }
  CHECK(e.position() == 40);
  CHECK(e.length(0) == 40);
  // extend after prefill continues it: equals prefill of the whole sequence.
  Session a(model());
  a.prefill(head, 4);
  const std::vector<std::vector<float>> tail = a.extend(std::vector<int>(seq.begin() + 40, seq.end()));
  Session b(model());
  CHECK(max_rel_diff(tail.back(), b.prefill(seq, 4)) < 1e-4);
  CHECK(a.position() == 60);
  // An empty extend returns nothing and changes nothing.
  CHECK(a.extend({}).empty());
  CHECK(a.position() == 60);
  CHECK(a.length(0) == 60);
}

TEST_CASE("extend refuses overflow and bad ids without writing anything", "[engine][model]") {
  const Config& c = model().config();
  const std::vector<int> seq = test_sequence(40, 19);
  Session s(model(), 40);
  s.prefill(std::vector<int>(seq.begin(), seq.begin() + 32), 8);
  s.compress(evict_with_bias(5));
  const std::ptrdiff_t m = s.length(0);
  const std::ptrdiff_t pos = s.position();
  REQUIRE(m + 8 <= 40);
  auto snapshot = [&] {
    std::vector<float> all;
    for (int l = 0; l < c.n_layers; ++l) {
      const std::size_t kv = static_cast<std::size_t>(c.n_kv_heads * s.head_stride());
      all.insert(all.end(), s.keys(l), s.keys(l) + kv);
      all.insert(all.end(), s.values(l), s.values(l) + kv);
      all.insert(all.end(), s.bias(l), s.bias(l) + c.n_kv_heads * s.capacity());
    }
    return all;
  };
  const std::vector<float> before = snapshot();
  const std::vector<int> too_many(static_cast<std::size_t>(40 - m + 1), 5);
  CHECK_THROWS_WITH(s.extend(too_many), Contains("full"));
  CHECK_THROWS_AS(s.extend({5, 6, 512}), std::out_of_range);
  CHECK_THROWS_AS(s.extend({-1, 5}), std::out_of_range);
  CHECK(s.length(0) == m);
  CHECK(s.position() == pos);
  CHECK(snapshot() == before);
  // Exactly filling the cache works.
  const std::vector<std::vector<float>> rows = s.extend(std::vector<int>(static_cast<std::size_t>(40 - m), 5));
  CHECK(static_cast<std::ptrdiff_t>(rows.size()) == 40 - m);
  CHECK(s.length(0) == 40);
  CHECK_THROWS_WITH(s.extend({5}), Contains("full"));

  // Past the model's seq_len (position after compression may run ahead of the cache length).
  Session r(model());
  r.prefill(std::vector<int>(seq.begin(), seq.begin() + 32), 8);
  r.compress(evict_with_bias(c.seq_len - 32 - 2));
  REQUIRE(r.position() == c.seq_len - 2);
  const std::ptrdiff_t rm = r.length(0);
  CHECK_THROWS_WITH(r.extend({5, 6, 7}), Contains("seq_len"));
  CHECK(r.length(0) == rm);
  CHECK(r.position() == c.seq_len - 2);
  CHECK(r.extend({5, 6}).size() == 2);
  CHECK(r.position() == c.seq_len);
}

TEST_CASE("session rejects bad input without changing state", "[engine][model]") {
  Session s(model(), 8);
  s.prefill({1, 5, 6}, 2);
  CHECK_THROWS_AS(s.forward(-1), std::out_of_range);
  CHECK_THROWS_AS(s.forward(512), std::out_of_range);
  CHECK(s.position() == 3);
  CHECK(s.window_valid());
  CHECK_THROWS_AS(s.prefill({}, 2), std::invalid_argument);

  // Compressor output errors leave the cache alone.
  const LayerCompressor wrong_size = [](const LayerInput& in) {
    CompressedLayer out;
    out.m = 2;
    out.keys.assign(static_cast<std::size_t>(in.Hkv * 2 * in.d), 0.0f);
    out.values.assign(3, 0.0f);
    out.next_position = 2;
    return out;
  };
  CHECK_THROWS_WITH(s.compress(wrong_size), Contains("keys/values"));
  const LayerCompressor disagreeing = [](const LayerInput& in) {
    CompressedLayer out = full_compressor()(in);
    out.next_position = in.layer;  // differs across layers
    return out;
  };
  CHECK_THROWS_WITH(s.compress(disagreeing), Contains("next_position"));
  const LayerCompressor nan_bias = [](const LayerInput& in) {
    CompressedLayer out = full_compressor()(in);
    out.bias[0] = std::nanf("");
    return out;
  };
  CHECK_THROWS_WITH(s.compress(nan_bias), Contains("NaN"));
  CHECK(s.length(0) == 3);
  CHECK(s.position() == 3);
  CHECK(s.window_valid());

  // Compression needs a fresh prefill window.
  s.compress(full_compressor());
  CHECK_THROWS_WITH(s.compress(full_compressor()), Contains("prefill"));
  // Cache full: capacity 8.
  for (int t = 0; t < 5; ++t) s.forward(10 + t);
  CHECK(s.length(0) == 8);
  CHECK_THROWS_WITH(s.forward(1), Contains("full"));
  CHECK(s.position() == 8);
  // Prefill after compression with len != position is refused.
  Session r(model());
  r.prefill({1, 2, 3, 4}, 4);
  r.compress([](const LayerInput& in) {
    CompressedLayer out = full_compressor()(in);
    out.next_position = in.n + 3;
    return out;
  });
  CHECK_THROWS_WITH(r.prefill({5}, 1), Contains("compressed"));
  // reset() empties the cache.
  r.reset();
  CHECK(r.position() == 0);
  CHECK(r.length(0) == 0);
  CHECK(r.prefill({1}, 1).size() == 512);
}

TEST_CASE("sampled sequences: deterministic, full length, start with BOS", "[engine][eval]") {
  const auto a = sample_sequences(model(), 3, 64, 42);
  const auto b = sample_sequences(model(), 3, 64, 42);
  const auto c = sample_sequences(model(), 2, 64, 43);
  const auto d = sample_sequences(model(), 2, 64, 42);
  REQUIRE(a.size() == 3);
  CHECK(a == b);
  CHECK(a[0] != c[0]);
  CHECK(d[1] == a[1]);  // sequence i does not depend on how many are drawn
  CHECK(a[0] != a[1]);
  for (const auto& s : a) {
    REQUIRE(s.size() == 64);
    CHECK(s[0] == Tokenizer::kBos);
    for (const int t : s) {
      CHECK(t >= 0);
      CHECK(t < 512);
    }
  }
  // Temperature 0 gives the greedy continuation.
  const auto g = sample_sequences(model(), 1, 20, 1, 0.0)[0];
  Session sg(model());
  const std::vector<int> greedy = generate(sg, {Tokenizer::kBos}, 19, 0.0);
  CHECK(std::equal(greedy.begin(), greedy.end(), g.begin() + 1));
}

TEST_CASE("teacher-forced evaluation: full vs full is exact, eviction is not", "[engine][eval]") {
  EvalConfig cfg;
  cfg.prefix = 48;
  cfg.window = 8;
  TeacherForcedEval ev(model(), sample_sequences(model(), 3, 64, 7), cfg);
  CHECK(ev.steps() == 16);
  const EvalResult same = ev.evaluate(full_compressor());
  REQUIRE(same.per_sequence.size() == 3);
  for (const SequenceMetrics& m : same.per_sequence) {
    CHECK(m.kl == 0.0);
    CHECK(m.top1 == 1.0);
    CHECK(m.delta_nll == 0.0);
    CHECK(m.steps == 16);
  }
  CHECK(same.mean_kl == 0.0);
  CHECK(same.mean_top1 == 1.0);

  // Keep 4 sinks + the last 8 (a StreamingLLM-like test compressor).
  const LayerCompressor recent = [](const LayerInput& in) {
    CompressedLayer out;
    std::vector<std::ptrdiff_t> pos{0, 1, 2, 3};
    for (std::ptrdiff_t j = in.n - 8; j < in.n; ++j) pos.push_back(j);
    out.m = static_cast<std::ptrdiff_t>(pos.size());
    out.next_position = in.n;
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g) {
      for (const std::ptrdiff_t j : pos) {
        out.keys.insert(out.keys.end(), in.keys + g * in.head_stride + j * in.d, in.keys + g * in.head_stride + (j + 1) * in.d);
        out.values.insert(out.values.end(), in.values + g * in.head_stride + j * in.d, in.values + g * in.head_stride + (j + 1) * in.d);
      }
    }
    return out;
  };
  const EvalResult r = ev.evaluate(recent);
  CHECK(r.mean_kl > 1e-4);
  CHECK(r.mean_top1 <= 1.0);
  REQUIRE(r.mean_kl_by_step.size() == 16);
  CHECK(r.mean_kl_by_step[0] == 0.0);  // the prediction made by prefill, before compression
  CHECK(r.mean_kl_by_step[5] > 0.0);
  for (const SequenceMetrics& m : r.per_sequence) {
    CHECK(m.kl > 0.0);
    CHECK(m.top1 >= 0.0);
    CHECK(std::isfinite(m.delta_nll));
  }
  // Recompute sequence 0's metrics directly from the log-probabilities.
  const std::vector<double>& p = ev.reference_log_probs(0);
  const std::vector<double> q = ev.log_probs(0, &recent);
  REQUIRE(p.size() == 16u * 512u);
  REQUIRE(q.size() == p.size());
  double kl = 0, dnll = 0;
  for (int step = 0; step < 16; ++step) {
    for (int v = 0; v < 512; ++v) kl += std::exp(p[step * 512 + v]) * (p[step * 512 + v] - q[step * 512 + v]);
    const int target = ev.sequences()[0][static_cast<std::size_t>(48 + step)];
    dnll += (-q[step * 512 + target]) - (-p[step * 512 + target]);
  }
  CHECK(r.per_sequence[0].kl == Approx(kl / 16).epsilon(1e-12));
  CHECK(r.per_sequence[0].delta_nll == Approx(dnll / 16).epsilon(1e-12));
  // The reference log-probs are probabilities and the uncompressed run reproduces them.
  double total = 0;
  for (int v = 0; v < 512; ++v) total += std::exp(p[static_cast<std::size_t>(v)]);
  CHECK(total == Approx(1.0).epsilon(1e-12));
  CHECK(ev.log_probs(0, nullptr) == p);
  // Evaluation is deterministic, and paired differences against itself are exactly 0.
  const EvalResult r2 = ev.evaluate(recent);
  CHECK(r2.values(Metric::kKl) == r.values(Metric::kKl));
  const Interval diff = bootstrap_paired_difference(r.values(Metric::kKl), r2.values(Metric::kKl), 1);
  CHECK(diff.mean == 0.0);
  CHECK(diff.lo == 0.0);
  CHECK(diff.hi == 0.0);
  const Interval worse = bootstrap_paired_difference(r.values(Metric::kKl), same.values(Metric::kKl), 1);
  CHECK(worse.lo > 0.0);

  // Without the prefill prediction: one step fewer, and each remaining step is unchanged.
  EvalConfig cfg2 = cfg;
  cfg2.include_prefill_prediction = false;
  TeacherForcedEval ev2(model(), ev.sequences(), cfg2);
  CHECK(ev2.steps() == 15);
  const EvalResult r3 = ev2.evaluate(recent);
  REQUIRE(r3.mean_kl_by_step.size() == 15);
  for (int step = 0; step < 15; ++step) CHECK(r3.mean_kl_by_step[static_cast<std::size_t>(step)] == Approx(r.mean_kl_by_step[static_cast<std::size_t>(step + 1)]).epsilon(1e-12));
}

// ---------------------------------------------------------------------------------------------
// Malformed files
// ---------------------------------------------------------------------------------------------

TEST_CASE("malformed checkpoints are rejected with messages naming the file", "[engine][files]") {
  const std::vector<unsigned char> good = read_bytes(checkpoint_path());
  REQUIRE(good.size() == 1056540u);
  TempDir tmp;
  auto rejects = [&](const std::string& name, const std::vector<unsigned char>& bytes, const std::string& what) {
    const std::string p = tmp.file(name);
    write_bytes(p, bytes);
    INFO("case " << name);
    CHECK_THROWS_WITH(Model::load(p), Contains(p) && Contains(what));
  };
  CHECK_THROWS_WITH(Model::load(tmp.file("missing.bin")), Contains("missing.bin") && Contains("does not exist"));
  CHECK_THROWS_WITH(Model::load(tmp.path.string()), Contains("not a regular file"));
  rejects("empty.bin", {}, "too short");
  rejects("header_only_part.bin", std::vector<unsigned char>(good.begin(), good.begin() + 20), "too short");
  rejects("header_only.bin", std::vector<unsigned char>(good.begin(), good.begin() + 28), "truncated");
  rejects("cut4.bin", std::vector<unsigned char>(good.begin(), good.end() - 4), "truncated");
  rejects("cut_half.bin", std::vector<unsigned char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2)), "truncated");
  std::vector<unsigned char> longer = good;
  longer.insert(longer.end(), {0, 0, 0, 0});
  rejects("long.bin", longer, "too long");
  {
    std::mt19937_64 rng(99);
    std::vector<unsigned char> garbage(good.size());
    for (unsigned char& b : garbage) b = static_cast<unsigned char>(rng());
    const std::string p = tmp.file("garbage.bin");
    write_bytes(p, garbage);
    CHECK_THROWS_WITH(Model::load(p), Contains(p));
  }
  struct HeaderCase {
    int field;
    std::int32_t value;
    const char* what;
  };
  const HeaderCase cases[] = {
      {0, 0, "dim = 0"},
      {0, -64, "dim = -64"},
      {0, 1 << 20, "exceeds"},
      {1, 0, "hidden_dim = 0"},
      {2, 0, "n_layers = 0"},
      {2, 6, "truncated"},
      {3, 3, "not divisible"},
      {3, 64, "odd"},
      {4, 3, "multiple of n_kv_heads"},
      {4, 16, "multiple of n_kv_heads"},
      {5, 0, "vocab_size = 0"},
      {5, -512, "truncated"},  // unshared classifier announced but missing
      {5, 511, "too long"},
      {6, 0, "seq_len = 0"},
      {6, -1, "seq_len = -1"},
      {6, 1 << 30, "exceeds"},
      {6, 256, "too long"},
  };
  for (const HeaderCase& hc : cases) {
    std::vector<unsigned char> bytes = good;
    put_i32(bytes, static_cast<std::size_t>(4 * hc.field), hc.value);
    rejects("header_" + std::to_string(hc.field) + "_" + std::to_string(hc.value) + ".bin", bytes, hc.what);
  }
  {
    // A NaN in wq (first float after token_embedding [512][64] and rms_att [5][64]).
    std::vector<unsigned char> bytes = good;
    put_f32(bytes, 28 + 4 * (512 * 64 + 5 * 64 + 3), std::nanf(""));
    rejects("nan.bin", bytes, "'wq' holds a non-finite value");
  }
  {
    // freq_cis_real[1][0] = cos(1) + 0.5.
    const std::size_t floats_before = 512 * 64 + 5 * 64 + 2 * 5 * 64 * 64 + 2 * 5 * 32 * 64 + 5 * 64 + 3 * 5 * 172 * 64 + 64;
    std::vector<unsigned char> bytes = good;
    put_f32(bytes, 28 + 4 * (floats_before + 4), static_cast<float>(std::cos(1.0) + 0.5));
    rejects("rope.bin", bytes, "freq_cis");
  }
}

TEST_CASE("an unshared classifier (negative vocab_size) is loaded and used", "[engine][files]") {
  // The same weights with vocab_size = -512 and a copy of the embedding as wclassifier: same logits.
  std::vector<unsigned char> bytes = read_bytes(checkpoint_path());
  put_i32(bytes, 20, -512);
  const std::vector<unsigned char> emb(bytes.begin() + 28, bytes.begin() + 28 + 512 * 64 * 4);
  bytes.insert(bytes.end(), emb.begin(), emb.end());
  TempDir tmp;
  write_bytes(tmp.file("unshared.bin"), bytes);
  const Model m = Model::load(tmp.file("unshared.bin"));
  CHECK(!m.config().shared_classifier);
  CHECK(m.config().vocab_size == 512);
  CHECK(m.classifier() != m.token_embedding());
  Session a(m);
  Session b(model());
  CHECK(a.prefill({1, 400, 20}, 1) == b.prefill({1, 400, 20}, 1));
  // A classifier that differs changes the logits.
  put_f32(bytes, bytes.size() - 512 * 64 * 4 + 4 * 64 * 400, 5.0f);  // row 400, element 0
  write_bytes(tmp.file("unshared2.bin"), bytes);
  const Model m2 = Model::load(tmp.file("unshared2.bin"));
  Session c(m2);
  const std::vector<float> lc = c.prefill({1, 400, 20}, 1);
  Session a2(m);
  const std::vector<float> la = a2.prefill({1, 400, 20}, 1);
  REQUIRE(lc.size() == 512);
  CHECK(lc[400] != la[400]);
  int other_changed = 0;
  for (int v = 0; v < 512; ++v) other_changed += (v != 400 && lc[static_cast<std::size_t>(v)] != la[static_cast<std::size_t>(v)]);
  CHECK(other_changed == 0);
}

TEST_CASE("malformed tokenizers are rejected with messages naming the file", "[engine][files]") {
  const std::vector<unsigned char> good = read_bytes(tokenizer_path());
  TempDir tmp;
  auto rejects = [&](const std::string& name, const std::vector<unsigned char>& bytes, int vocab, const std::string& what) {
    const std::string p = tmp.file(name);
    write_bytes(p, bytes);
    INFO("case " << name);
    CHECK_THROWS_WITH(Tokenizer::load(p, vocab), Contains(p) && Contains(what));
  };
  CHECK_THROWS_WITH(Tokenizer::load(tmp.file("nope.bin"), 512), Contains("nope.bin") && Contains("does not exist"));
  rejects("empty.bin", {}, 512, "truncated");
  rejects("cut.bin", std::vector<unsigned char>(good.begin(), good.end() - 3), 512, "truncated");
  rejects("cut_half.bin", std::vector<unsigned char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2)), 512, "truncated");
  std::vector<unsigned char> longer = good;
  longer.push_back(0);
  rejects("long.bin", longer, 512, "trailing bytes");
  rejects("vocab511.bin", good, 511, "trailing bytes");
  rejects("vocab513.bin", good, 513, "truncated");
  std::vector<unsigned char> bad_max = good;
  put_i32(bad_max, 0, 0);
  rejects("max0.bin", bad_max, 512, "max_token_length");
  std::vector<unsigned char> neg_len = good;
  put_i32(neg_len, 8, -1);  // token 0's length
  rejects("neglen.bin", neg_len, 512, "token 0 has length -1");
  std::vector<unsigned char> nan_score = good;
  put_f32(nan_score, 4, std::nanf(""));
  rejects("nanscore.bin", nan_score, 512, "non-finite score");
  CHECK_THROWS_WITH(Tokenizer::load(tokenizer_path(), 0), Contains("vocab_size"));
  CHECK_NOTHROW(Tokenizer::load(tokenizer_path(), 512));
}

namespace {
const kvc::test::RunOnlyIf needs_model(kvc::test::model_dir_missing);
}  // namespace
