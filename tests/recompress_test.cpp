// Compressing again: a view that carries each entry's stored position and bias (a result handed back
// through compact_into / compact_bias_into / compact_positions_into). Biased window attention and bias
// composition against the double reference (ref::window_probs with a bias), positions travelling over
// n → m1 → m2 (window_output_error reading them), a keep-everything first step equal to one step,
// RoPE from the stored positions, GRKV fitted with the bias, and the view's validation.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/metrics.hpp>
#include <kvcompress/pipeline.hpp>
#include <kvcompress/presets.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)
#include "support/test_presets.hpp"  // double and bfloat16 (kvc_test_presets)
#include <kvcompress/result.hpp>

#include "support/bridge.hpp"
#include "support/head_fixtures.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/result_checks.hpp"
#include "support/tolerances.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace kvc;
using kvc::test::check_identical;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

/// A compressed layer in cache memory, as an engine keeps it: keys and values [H][m][d], positions
/// and bias [H][m] (every head keeps m entries).
template <class T>
struct Cache {
  Index H = 0, m = 0, d = 0;
  std::vector<T> keys, values;
  std::vector<Index> positions;
  std::vector<compute_t<T>> bias;

  Cache(const LayerResult<compute_t<T>>& r, Index d_)
      : H(static_cast<Index>(r.heads.size())), m(r.max_size()), d(d_),
        keys(static_cast<std::size_t>(H * m * d)), values(keys.size()), positions(static_cast<std::size_t>(H * m)),
        bias(positions.size()) {
    compact_into(r, make_head_major(keys.data(), H, m, d), make_head_major(values.data(), H, m, d));
    compact_bias_into(r, bias.data(), m, m);
    compact_positions_into(r, positions.data(), m, m);
  }
  /// The next view: these entries, with `queries` as the window queries.
  LayerView<T> view(const TensorView<const T>& queries) const {
    LayerView<T> v{make_head_major<const T>(keys.data(), H, m, d), make_head_major<const T>(values.data(), H, m, d),
                   queries};
    v.positions = {positions.data(), H, m, m};
    v.bias = {bias.data(), H, m, m};
    return v;
  }
};

/// (Hkv, nb) stored bias N(0, σ²) and per-head strictly increasing positions (gaps of 1..4, offset g).
struct Stored {
  Eigen::MatrixXd bias;
  std::vector<std::vector<Index>> positions;
  std::vector<double> bias_data;  // [Hkv][nb]
  std::vector<Index> position_data;  // [Hkv][n]
  Stored(std::mt19937_64& rng, long Hkv, long n, long nb, double sigma) : bias(Hkv, nb) {
    std::normal_distribution<double> normal(0.0, sigma);
    std::uniform_int_distribution<Index> gap(1, 4);
    for (long g = 0; g < Hkv; ++g) {
      for (long j = 0; j < nb; ++j) bias(g, j) = normal(rng);
      std::vector<Index> p(static_cast<std::size_t>(n));
      Index x = g;
      for (long j = 0; j < n; ++j) p[static_cast<std::size_t>(j)] = (x += gap(rng));
      positions.push_back(p);
    }
    for (long g = 0; g < Hkv; ++g) {
      for (long j = 0; j < nb; ++j) bias_data.push_back(bias(g, j));
      position_data.insert(position_data.end(), positions[static_cast<std::size_t>(g)].begin(),
                           positions[static_cast<std::size_t>(g)].end());
    }
  }
  /// The bias rounded to Real, as the view stores it.
  template <class Real>
  std::vector<Real> bias_as() const {
    return std::vector<Real>(bias_data.begin(), bias_data.end());
  }
};

// ---- biased window attention -------------------------------------------------------------------

template <class Real>
void check_biased_window(long n, long nb, double softcap) {
  INFO("n " << n << " stored bias length " << nb << " softcap " << softcap << " seed " << kvc::test::test_seed());
  kvc::test::HeadData f(2601, 2, 4, n);
  const Stored st(f.rng, f.Hkv, n, nb, 2.0);
  kvc::test::LayerBuffers<Real> b(f.K, f.V, f.Q, Layout::token_major);
  const std::vector<Real> bias = st.bias_as<Real>();
  LayerView<Real> layer = b.view();
  layer.bias = {bias.data(), f.Hkv, nb, nb};
  REQUIRE(validate_layer(layer));
  AttentionArguments args;
  args.softcap = softcap;
  const Eigen::MatrixXd B = st.bias;
  const auto probs = ref::window_probs(f.Q, f.K, f.scale(), softcap, &B);
  const Eigen::MatrixXd mass = ref::window_mass(probs, f.Hkv);
  const auto unbiased = ref::window_probs(f.Q, f.K, f.scale(), softcap);
  const auto& tol = kTol.float_vs_double;
  const long G = f.Hq / f.Hkv, W = f.W;
  WindowWorkspace<Real> ws;
  for (Index g = 0; g < f.Hkv; ++g) {
    INFO("KV head " << g);
    Eigen::MatrixXd A(G * W, n), Y(G * W, f.d);  // the reference rows, stacked as the library stacks them
    for (long h = 0; h < G; ++h) {
      A.middleRows(h * W, W) = probs[static_cast<std::size_t>(g * G + h)];
      Y.middleRows(h * W, W) = probs[static_cast<std::size_t>(g * G + h)] * ref::head_matrix(f.V, g);
    }
    // The bias matters here: the unbiased probabilities are far from the biased ones.
    CHECK((unbiased[static_cast<std::size_t>(g * G)] - probs[static_cast<std::size_t>(g * G)]).cwiseAbs().maxCoeff() > 1e-2);

    Vector<Real> a;
    REQUIRE(window_mass<Real>(layer, g, args, a, ws));
    CHECK(kvc::test::within(a.template cast<double>(), Eigen::VectorXd(mass.row(g).transpose()), tol.mass));
    RowMatrix<Real> Y_after;
    window_outputs_after_mass(layer, g, ws, Y_after);
    CHECK(kvc::test::within(Y_after.template cast<double>(), Y, tol.values));

    RowMatrix<Real> P;
    window_probabilities<Real>(layer, g, args, P);
    CHECK(kvc::test::within(P.template cast<double>(), A, tol.probs));
    RowMatrix<Real> Yf;
    window_outputs<Real>(layer, g, args, Yf);
    CHECK(kvc::test::within(Yf.template cast<double>(), Y, tol.values));
    for (Index r : {Index(0), W - 1, G * W - 1}) {
      Vector<Real> p;
      REQUIRE(window_row_probabilities(layer, g, r, args, p));
      CHECK(kvc::test::within(p.template cast<double>(), Eigen::VectorXd(A.row(r).transpose()), tol.probs));
    }
  }
}

TEMPLATE_TEST_CASE("window attention adds the stored bias after the soft-cap in every path", "[recompress][attention]",
                   float, double) {
  for (double softcap : {0.0, 3.0}) {
    check_biased_window<TestType>(300, 300, softcap);  // two key tiles, every entry biased
    check_biased_window<TestType>(300, 290, softcap);  // entries past the stored length (appended) get 0
    check_biased_window<TestType>(40, 17, softcap);
  }
}

TEST_CASE("the reference's bias multiplies each unnormalised weight by e^b", "[recompress][reference]") {
  kvc::test::HeadData f(2602, 1, 2, 12);
  Eigen::MatrixXd B = Eigen::MatrixXd::Zero(1, 12);
  B(0, 3) = std::log(2.0);
  const auto plain = ref::window_probs(f.Q, f.K, f.scale(), 0.0);
  const auto biased = ref::window_probs(f.Q, f.K, f.scale(), 0.0, &B);
  for (std::size_t h = 0; h < plain.size(); ++h)
    for (long i = 0; i < f.W; ++i) {
      const long visible = 12 - f.W + i + 1;
      const double z = 1.0 + plain[h](i, 3);  // Σ of the weights after doubling entry 3, relative to before
      for (long j = 0; j < visible; ++j)
        CHECK(biased[h](i, j) == Approx(plain[h](i, j) * (j == 3 ? 2.0 : 1.0) / z).epsilon(1e-12));
    }
}

// ---- positions travel ---------------------------------------------------------------------------

/// n = 200 → 120 → 60 with the preset P: the second result's positions are the first result's
/// positions at the entries the second step kept (the same step over the view without positions gives
/// those entries' indices, and otherwise the same result).
template <class Preset>
void check_positions_travel(const char* name, typename Preset::Arguments args = {}) {
  INFO(name << " seed " << kvc::test::test_seed());
  kvc::test::HeadData f(2603, 2, 4, 200);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  const Preset p(args);
  const auto r1 = p.run(b.view(), Budget::tokens(120));
  const Cache<float> c1(r1, f.d);
  const LayerView<float> v1 = c1.view(b.queries.cview());
  const auto r2 = p.run(v1, Budget::tokens(60));
  LayerView<float> v1_indices = v1;
  v1_indices.positions = {};
  const auto r2_indices = p.run(v1_indices, Budget::tokens(60));
  REQUIRE(r2.heads.size() == r1.heads.size());
  bool moved = false;  // not vacuous: some entry's position differs from its index
  for (std::size_t g = 0; g < r2.heads.size(); ++g) {
    INFO("head " << g);
    const auto& h = r2.heads[g];
    REQUIRE(h.size() == 60);
    REQUIRE(r2_indices.heads[g].size() == 60);
    for (Index i = 0; i < h.size(); ++i) {
      const Index at = r2_indices.heads[g].positions[static_cast<std::size_t>(i)];
      REQUIRE(at < r1.heads[g].size());
      CHECK(h.positions[static_cast<std::size_t>(i)] == r1.heads[g].positions[static_cast<std::size_t>(at)]);
      moved = moved || h.positions[static_cast<std::size_t>(i)] != at;
    }
    CHECK(h.keys == r2_indices.heads[g].keys);
    CHECK(h.values == r2_indices.heads[g].values);
    CHECK(h.bias == r2_indices.heads[g].bias);
  }
  CHECK(moved);
  // The window error sees the same entries through stored positions as through indices.
  CHECK(window_output_error(v1, r2) == window_output_error(v1_indices, r2_indices));
  CHECK(r2.next_position == f.n);  // the last entry (position n − 1) is kept by every preset here
  CHECK(r2_indices.next_position == 120);
}

TEST_CASE("compressing n → m1 → m2 keeps the original positions", "[recompress][positions]") {
  check_positions_travel<SnapKV>("SnapKV");
  check_positions_travel<SelKV>("SelKV");
  check_positions_travel<KNorm>("KNorm");
  check_positions_travel<TOVA>("TOVA");
  check_positions_travel<SnapKVGRKV>("SnapKVGRKV");
}

// ---- a first step that keeps everything ---------------------------------------------------------

template <class Preset, class First>
void check_keep_all_first(const char* name, const First& first, const Budget& first_budget) {
  INFO(name << " seed " << kvc::test::test_seed());
  kvc::test::HeadData f(2604, 2, 4, 150);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  const Preset p;
  const auto one = p.run(b.view(), Budget::tokens(70));
  const auto r0 = first.run(b.view(), first_budget);
  REQUIRE(r0.max_size() == f.n);
  const Cache<float> c0(r0, f.d);
  const auto two = p.run(c0.view(b.queries.cview()), Budget::tokens(70));
  check_identical(two, one);
}

TEST_CASE("a first step that keeps everything makes two steps equal one", "[recompress][identity]") {
  check_keep_all_first<SnapKV>("FullCache, SnapKV", FullCache{}, Budget::tokens(150));
  check_keep_all_first<SelKV>("FullCache, SelKV", FullCache{}, Budget::tokens(150));
  check_keep_all_first<KNorm>("FullCache, KNorm", FullCache{}, Budget::tokens(150));
  check_keep_all_first<TOVA>("FullCache, TOVA", FullCache{}, Budget::tokens(150));
  check_keep_all_first<SnapKVGRKV>("FullCache, SnapKVGRKV", FullCache{}, Budget::tokens(150));
  check_keep_all_first<SelKV>("SelKV with m >= n, SelKV", SelKV{}, Budget::ratio(1.0));
  check_keep_all_first<SnapKV>("SnapKV with m > n, SnapKV", SnapKV{}, Budget::tokens(400));
}

// ---- bias composition against the double reference ----------------------------------------------

enum class Scored { mass, value_weighted };

/// The reference chain over a view with stored bias B (Hkv, nb) and positions: biased window
/// probabilities → mass → scores → select → route → merge → compensator term (shared: its mean over
/// heads) → + the kept entries' stored bias; positions are the stored positions of the kept entries.
std::vector<ref::CompressedHead> ref_recompress(const ref::Tensor3& K, const ref::Tensor3& V, const ref::Tensor3& Q,
                                                const Stored& st, long m, Scored scorer, long recent, bool shared,
                                                bool routed) {
  const long Hkv = K.H, n = K.n, G = Q.H / K.H;
  const double scale = 1.0 / std::sqrt(double(K.d));
  const auto probs = ref::window_probs(Q, K, scale, 0.0, &st.bias);
  const Eigen::MatrixXd a = ref::window_mass(probs, Hkv);
  const Eigen::MatrixXd scores = scorer == Scored::mass ? ref::attention_mass(a) : ref::value_weighted(a, V);
  const long pool = 5;
  const auto kept = ref::select(scores, std::vector<long>(static_cast<std::size_t>(Hkv), m), 0, recent, pool, false,
                                shared);
  std::vector<ref::CompressedHead> out;
  std::vector<std::vector<double>> terms;
  for (long g = 0; g < Hkv; ++g) {
    const auto& kg = kept[static_cast<std::size_t>(g)];
    std::vector<long> route(static_cast<std::size_t>(n), kg[0]);
    if (routed) route = ref::route(g, kg, n, ref::RouteKeyCosine, 32, K, a, probs, G);
    const ref::Merged mg = ref::merge(g, kg, route, K, V, a, routed ? ref::MergeSoftGate : ref::MergeDrop);
    std::vector<double> term(kg.size(), 0.0);
    if (routed) term = ref::bias_attention_ratio(g, kg, route, mg.gate, a, 0.5, 0.0);
    terms.push_back(term);
    std::vector<long> positions;
    for (long j : kg) positions.push_back(static_cast<long>(st.positions[static_cast<std::size_t>(g)][static_cast<std::size_t>(j)]));
    out.push_back({positions, mg.keys, mg.values, {}});
  }
  if (shared && Hkv > 1) {
    const auto mean = ref::shared_bias(terms);
    for (auto& t : terms) t = mean;
  }
  for (long g = 0; g < Hkv; ++g) {
    auto& h = out[static_cast<std::size_t>(g)];
    const auto& kg = kept[static_cast<std::size_t>(g)];
    h.bias = terms[static_cast<std::size_t>(g)];
    for (std::size_t i = 0; i < kg.size(); ++i) h.bias[i] += kg[i] < st.bias.cols() ? st.bias(g, kg[i]) : 0.0;
  }
  return out;
}

template <class Preset, class T>
void check_composition(const char* name, Scored scorer, long recent, bool shared, bool routed, long nb) {
  INFO(name << " stored bias length " << nb << " seed " << kvc::test::test_seed());
  kvc::test::HeadData f(2605, 2, 4, 100);
  const Stored st(f.rng, f.Hkv, f.n, nb, 1.0);
  kvc::test::LayerBuffers<T> b(f.K, f.V, f.Q, Layout::head_major);
  const std::vector<compute_t<T>> bias = st.bias_as<compute_t<T>>();
  LayerView<T> layer = b.view();
  layer.bias = {bias.data(), f.Hkv, nb, nb};
  layer.positions = {st.position_data.data(), f.Hkv, f.n, f.n};
  const long m = 40;
  const auto got = Preset().run(layer, Budget::tokens(m));
  const auto want = ref_recompress(b.keys.rounded(), b.values.rounded(), b.queries.rounded(), st, m, scorer, recent,
                                   shared, routed);
  const auto& tol = kTol.float_vs_double;
  REQUIRE(got.heads.size() == want.size());
  long compensated = 0;  // not vacuous with a compensator: entries whose bias is more than the stored one
  for (std::size_t g = 0; g < want.size(); ++g) {
    INFO("head " << g);
    const auto& h = got.heads[g];
    REQUIRE(kvc::test::to_long(h.positions) == want[g].positions);
    CHECK(kvc::test::within(h.values.template cast<double>(), want[g].values, tol.values));
    CHECK(kvc::test::within(kvc::test::to_std(h.bias), want[g].bias, tol.bias));
    // The kept entries' stored bias, found through their stored positions.
    const auto& sp = st.positions[g];
    for (Index i = 0; i < h.size(); ++i) {
      const auto j = std::lower_bound(sp.begin(), sp.end(), h.positions[static_cast<std::size_t>(i)]) - sp.begin();
      const compute_t<T> stored = j < nb ? bias[static_cast<std::size_t>(static_cast<long>(g) * nb + j)] : compute_t<T>(0);
      if (!routed) CHECK(h.bias[i] == stored);  // no compensator: the stored bias, exactly
      compensated += h.bias[i] != stored ? 1 : 0;
    }
  }
  if (routed) CHECK(compensated > 0);
  CHECK(got.next_position == std::max(st.positions[0].back(), st.positions[1].back()) + 1);
}

TEMPLATE_TEST_CASE("bias composes over compressions as the double reference says", "[recompress][bias]", float,
                   double) {
  for (long nb : {100L, 93L}) {
    check_composition<SnapKV, TestType>("SnapKV", Scored::mass, 32, false, false, nb);
    check_composition<SelKV, TestType>("SelKV", Scored::value_weighted, 16, true, true, nb);
    check_composition<SelKVEvict, TestType>("SelKVEvict", Scored::value_weighted, 16, true, false, nb);
  }
}

// ---- RoPE from the stored positions ---------------------------------------------------------------

TEST_CASE("repositioning rotates kept keys from their stored positions", "[recompress][rope]") {
  kvc::test::HeadData f(2606, 2, 4, 90);
  const Stored st(f.rng, f.Hkv, f.n, f.n, 0.5);
  kvc::test::LayerBuffers<double> b(f.K, f.V, f.Q, Layout::head_major);
  const std::vector<double> bias = st.bias_as<double>();
  LayerView<double> layer = b.view();
  layer.positions = {st.position_data.data(), f.Hkv, f.n, f.n};
  layer.bias = {bias.data(), f.Hkv, f.n, f.n};
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::half_split}) {
    INFO(to_string(layout));
    SnapKV::Arguments args;
    args.reposition.enabled = true;
    args.reposition.layout = layout;
    const long m = 30;
    const auto r = SnapKV(args).run(layer, Budget::tokens(m));
    LayerView<double> indices = layer;
    indices.positions = {};
    const auto plain = SnapKV().run(indices, Budget::tokens(m));  // the same selection, keys not rotated
    CHECK(r.next_position == m);
    for (std::size_t g = 0; g < r.heads.size(); ++g) {
      INFO("head " << g);
      const auto& h = r.heads[g];
      REQUIRE(h.size() == m);
      std::vector<long> old_pos;
      Eigen::MatrixXd kept(m, f.d);
      for (long e = 0; e < m; ++e) {
        const Index j = plain.heads[g].positions[static_cast<std::size_t>(e)];
        old_pos.push_back(static_cast<long>(st.positions[g][static_cast<std::size_t>(j)]));
        kept.row(e) = plain.heads[g].keys.row(e);
      }
      CHECK(kvc::test::to_long(h.positions) == old_pos);
      const Eigen::MatrixXd want = ref::reposition(kept, old_pos, ref::contiguous_positions(m), f.d, 10000.0,
                                                   layout == RopeLayout::half_split);
      CHECK((h.keys - want).cwiseAbs().maxCoeff() <= 1e-9 * (1.0 + want.cwiseAbs().maxCoeff()));
    }
  }
}

// ---- GRKV fits with the stored bias --------------------------------------------------------------

TEST_CASE("RidgeMerge fits the kept entries with their stored bias", "[recompress][grkv]") {
  kvc::test::HeadData f(2607, 2, 4, 120);
  const Stored st(f.rng, f.Hkv, f.n, f.n, 1.0);
  kvc::test::LayerBuffers<double> b(f.K, f.V, f.Q, Layout::head_major);
  const std::vector<double> bias = st.bias_as<double>();
  LayerView<double> layer = b.view();
  layer.bias = {bias.data(), f.Hkv, f.n, f.n};
  const long m = 50, G = f.Hq / f.Hkv;
  const auto r = SnapKVGRKV().run(layer, Budget::tokens(m));
  // The window error it reports, recomputed from the equations: the full biased cache against the
  // compressed one whose logits carry the result's bias (= the kept entries' stored bias here).
  const auto probs = ref::window_probs(f.Q, f.K, f.scale(), 0.0, &st.bias);
  std::vector<ref::CompressedHead> heads;
  for (const auto& h : r.heads)
    heads.push_back({kvc::test::to_long(h.positions), h.keys, h.values, kvc::test::to_std(h.bias)});
  const auto comp = ref::window_output_compressed(f.Q, f.n, heads, f.scale(), 0.0);
  for (long g = 0; g < f.Hkv; ++g) {
    INFO("head " << g);
    const auto& h = r.heads[static_cast<std::size_t>(g)];
    for (long i = 0; i < m; ++i)
      CHECK(h.bias[i] == bias[static_cast<std::size_t>(g * f.n + h.positions[static_cast<std::size_t>(i)])]);
    double num = 0.0, den = 0.0;
    for (long hl = 0; hl < G; ++hl) {
      const auto q = static_cast<std::size_t>(g * G + hl);
      const Eigen::MatrixXd Y = probs[q] * ref::head_matrix(f.V, g);
      num += (Y - comp[q]).squaredNorm();
      den += Y.squaredNorm();
    }
    const double err = std::sqrt(num / den);
    CHECK(h.diagnostics.window_error_after == Approx(err).epsilon(1e-6));
    CHECK(h.diagnostics.window_error_after < h.diagnostics.window_error_before);
  }
}

// ---- validation ----------------------------------------------------------------------------------

TEST_CASE("validate rejects bad stored positions and bias", "[recompress][validate]") {
  kvc::test::HeadData f(2608, 2, 4, 20);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  std::vector<Index> pos(static_cast<std::size_t>(2 * 20));
  for (Index g = 0; g < 2; ++g)
    for (Index j = 0; j < 20; ++j) pos[static_cast<std::size_t>(g * 20 + j)] = 2 * j;
  std::vector<float> bias(static_cast<std::size_t>(2 * 20), 0.25f);
  const LayerView<float> base = b.view();
  const auto status_of = [&](const PositionView& p, const BiasView<float>& bv) {
    LayerView<float> v = base;
    v.positions = p;
    v.bias = bv;
    const Status s = validate_layer(v);
    if (!s) CHECK_THROWS_AS(SnapKV().run(v, Budget::tokens(5)), kvc::error);
    return s;
  };
  const BiasView<float> good_bias{bias.data(), 2, 20, 20};
  const PositionView good_pos{pos.data(), 2, 20, 20};
  CHECK(status_of(good_pos, good_bias));
  CHECK(status_of({}, {bias.data(), 2, 7, 20}));  // a shorter bias: the rest are 0
  CHECK(status_of({}, {}));
  CHECK(status_of({pos.data(), 3, 20, 20}, {}).code() == Status::Code::invalid_shape);
  CHECK(status_of({pos.data(), 2, 19, 20}, {}).code() == Status::Code::invalid_shape);
  CHECK(status_of({pos.data(), 2, 20, 10}, {}).code() == Status::Code::aliasing);
  CHECK(status_of({nullptr, 2, 20, 20}, {}).code() == Status::Code::invalid_argument);
  CHECK(status_of(good_pos, {bias.data(), 1, 20, 20}).code() == Status::Code::invalid_shape);
  CHECK(status_of(good_pos, {bias.data(), 2, 21, 21}).code() == Status::Code::invalid_shape);
  CHECK(status_of(good_pos, {bias.data(), 2, 20, 5}).code() == Status::Code::aliasing);
  CHECK(status_of(good_pos, {nullptr, 2, 20, 20}).code() == Status::Code::invalid_argument);
  {
    auto p = pos;
    p[5] = p[4];  // not strictly increasing
    const Status s = status_of({p.data(), 2, 20, 20}, {});
    CHECK(s.code() == Status::Code::invalid_argument);
    CHECK(s.message().find("positions[0][5]") != std::string::npos);
    p = pos;
    p[20] = -1;  // negative
    CHECK(status_of({p.data(), 2, 20, 20}, {}).message().find("positions[1][0]") != std::string::npos);
  }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto bb = bias;
    bb[33] = bad;
    const Status s = status_of(good_pos, {bb.data(), 2, 20, 20});
    CHECK(s.code() == Status::Code::non_finite);
    CHECK(s.message().find("bias[1][13]") != std::string::npos);
    LayerView<float> v = base;
    v.bias = {bb.data(), 2, 20, 20};
    CHECK(validate_layer(v, /*check_values=*/false));  // the bias scan is part of the finite checks
  }
}

TEST_CASE("compact_positions_into writes one row per head and checks its destination", "[recompress][compact]") {
  kvc::test::HeadData f(2609, 2, 4, 60);
  kvc::test::LayerBuffers<float> b(f.K, f.V, f.Q, Layout::head_major);
  const auto r = AdaKVSnapKV().run(b.view(), Budget::tokens(20));
  std::vector<Index> out(2 * 64, -7);
  compact_positions_into(r, out.data(), 64, 64);
  for (std::size_t g = 0; g < 2; ++g)
    for (Index i = 0; i < 64; ++i)
      CHECK(out[g * 64 + static_cast<std::size_t>(i)] ==
            (i < r.heads[g].size() ? r.heads[g].positions[static_cast<std::size_t>(i)] : Index(-7)));
  CHECK_THROWS_AS(compact_positions_into(r, out.data(), 64, r.max_size() - 1), kvc::error);
  CHECK_THROWS_AS(compact_positions_into(r, out.data(), 10, 64), kvc::error);
  CHECK_THROWS_AS(compact_positions_into(r, static_cast<Index*>(nullptr), 64, 64), kvc::error);
}

}  // namespace
