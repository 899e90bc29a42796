// Window attention (SPEC §1–§2): kvc::window_probabilities and kvc::mass_from_probabilities against
// the double-precision reference (kvc::ref::window_probs / window_mass), over awkward sizes, W > n,
// grouped queries, soft-capping, both memory layouts and half / bfloat16 storage.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <limits>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

/// One window-attention problem: Hkv KV heads, G query heads per KV head, n tokens, W window rows.
struct Problem {
  long Hkv, G, n, d, W;
  double softcap;
  ref::Tensor3 K, V, Q;

  Problem(std::mt19937_64& rng, long Hkv_, long G_, long n_, long d_, long W_, double softcap_,
          double sigma = 1.0)
      : Hkv(Hkv_), G(G_), n(n_), d(d_), W(W_), softcap(softcap_),
        K(kvc::test::random_tensor(rng, Hkv_, n_, d_, sigma)),
        V(kvc::test::random_tensor(rng, Hkv_, n_, d_)),
        Q(kvc::test::random_tensor(rng, Hkv_ * G_, W_, d_, sigma)) {}

  long Weff() const { return std::min(W, n); }
  double scale() const { return 1.0 / std::sqrt(double(d)); }
  AttentionArguments args() const {
    AttentionArguments a;
    a.softcap = softcap;
    return a;
  }
};

/// Reference probabilities of KV head g's query group stacked like the library's: (G·W, n).
Eigen::MatrixXd stacked(const std::vector<Eigen::MatrixXd>& probs, long g, long G) {
  const long W = probs[0].rows(), n = probs[0].cols();
  Eigen::MatrixXd out(G * W, n);  // (G·W, n)
  for (long hl = 0; hl < G; ++hl) out.middleRows(hl * W, W) = probs[static_cast<std::size_t>(g * G + hl)];
  return out;
}

/// The library's probabilities and mass of every KV head for element type T.
template <class Real>
struct LibOut {
  std::vector<RowMatrix<Real>> probs;  // [Hkv](G·W, n)
  std::vector<Vector<Real>> mass;      // [Hkv](n) mass_from_probabilities(window_probabilities)
  std::vector<Vector<Real>> fused;     // [Hkv](n) window_mass straight from the layer (fused kernel)
};

template <class T>
LibOut<compute_t<T>> run_library(const LayerView<T>& layer, const AttentionArguments& args) {
  using Real = compute_t<T>;
  LibOut<Real> out;
  WindowWorkspace<Real> ws;  // shared by the heads, as the pipeline reuses it
  for (Index g = 0; g < layer.kv_heads(); ++g) {
    Vector<Real> fused;
    window_mass<Real>(layer, g, args, fused, ws);
    out.fused.push_back(std::move(fused));
    RowMatrix<Real> p;
    window_probabilities<Real>(layer, g, args, p);
    Vector<Real> a;
    mass_from_probabilities(p, layer.group_size(), a);
    out.probs.push_back(std::move(p));
    out.mass.push_back(std::move(a));
  }
  return out;
}

template <class T>
LibOut<compute_t<T>> run_library(const Problem& pr, Layout layout) {
  kvc::test::LayerBuffers<T> b(pr.K, pr.V, pr.Q, layout);
  return run_library(b.view(), pr.args());
}

template <class Real>
bool bitwise_equal(const LibOut<Real>& x, const LibOut<Real>& y) {
  if (x.probs.size() != y.probs.size()) return false;
  for (std::size_t g = 0; g < x.probs.size(); ++g) {
    if (x.probs[g].rows() != y.probs[g].rows() || x.probs[g].cols() != y.probs[g].cols()) return false;
    if (!(x.probs[g].array() == y.probs[g].array()).all()) return false;
    if (!(x.mass[g].array() == y.mass[g].array()).all()) return false;
    if (!(x.fused[g].array() == y.fused[g].array()).all()) return false;
  }
  return true;
}

/// Shape, causal zeros (exactly 0), row sums, and agreement with the reference within `probs_tol` /
/// `mass_tol`.
template <class Real>
void check_against_reference(const LibOut<Real>& lib, const std::vector<Eigen::MatrixXd>& ref_probs,
                             const Eigen::MatrixXd& ref_mass, long G, long n, long W,
                             const kvc::test::Tol& probs_tol, const kvc::test::Tol& mass_tol) {
  for (std::size_t g = 0; g < lib.probs.size(); ++g) {
    INFO("KV head " << g);
    const RowMatrix<Real>& p = lib.probs[g];
    REQUIRE(p.rows() == G * W);
    REQUIRE(p.cols() == n);
    const Eigen::MatrixXd want = stacked(ref_probs, static_cast<long>(g), G);
    CHECK(kvc::test::elementwise_ratio(p, want, probs_tol) <= 1.0);
    CHECK(kvc::test::normwise_error(p, want) <= probs_tol.norm);

    long nonzero_beyond_causal = 0, bad_row_sums = 0;
    for (long r = 0; r < G * W; ++r) {
      const long p_i = n - W + r % W;
      for (long j = p_i + 1; j < n; ++j) nonzero_beyond_causal += p(r, j) != Real(0) ? 1 : 0;
      const double sum = static_cast<double>(p.row(r).template cast<double>().sum());
      bad_row_sums += kvc::test::within(sum, 1.0, kTol.float_vs_double.probs) ? 0 : 1;
    }
    CHECK(nonzero_beyond_causal == 0);
    CHECK(bad_row_sums == 0);

    REQUIRE(lib.mass[g].size() == n);
    const Eigen::VectorXd want_mass = ref_mass.row(static_cast<long>(g)).transpose();
    CHECK(kvc::test::elementwise_ratio(lib.mass[g], want_mass, mass_tol) <= 1.0);
    CHECK(kvc::test::normwise_error(lib.mass[g], want_mass) <= mass_tol.norm);
    // Σ_j a_g[j] = W (each of the G·W rows sums to 1, divided by G).
    CHECK(kvc::test::within(static_cast<double>(lib.mass[g].template cast<double>().sum()), double(W),
                            kTol.float_vs_double.mass));
    // The fused mass kernel (window_mass) against the same reference.
    REQUIRE(lib.fused[g].size() == n);
    CHECK(kvc::test::elementwise_ratio(lib.fused[g], want_mass, mass_tol) <= 1.0);
    CHECK(kvc::test::normwise_error(lib.fused[g], want_mass) <= mass_tol.norm);
    CHECK(kvc::test::within(static_cast<double>(lib.fused[g].template cast<double>().sum()), double(W),
                            kTol.float_vs_double.mass));
  }
}

}  // namespace

TEST_CASE("window probabilities and mass match the reference over awkward sizes", "[attention][window]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(101);
  const std::vector<long> sizes = kvc::test::awkward_sizes();
  const long groups[] = {1, 2, 4};
  long combo = 0;
  for (long n : sizes) {
    for (long d : sizes) {
      // W below, equal to and above n (SPEC §1: W > n means W = n, the last n query rows).
      std::vector<long> windows = {1, std::min<long>(7, n), n, n + 5};
      windows.erase(std::unique(windows.begin(), windows.end()), windows.end());
      for (long W : windows) {
        ++combo;
        const long G = groups[combo % 3];
        const long Hkv = combo % 2 == 0 ? 1 : 2;
        const double softcap = combo % 4 < 2 ? 0.0 : 1.5;
        Problem pr(rng, Hkv, G, n, d, W, softcap);
        INFO("n " << n << " d " << d << " W " << W << " G " << G << " Hkv " << Hkv << " softcap " << softcap);
        const auto ref_probs = ref::window_probs(pr.Q, pr.K, pr.scale(), softcap);
        const auto ref_mass = ref::window_mass(ref_probs, Hkv);

        const auto f_hm = run_library<float>(pr, Layout::head_major);
        const auto f_tm = run_library<float>(pr, Layout::token_major);
        check_against_reference(f_hm, ref_probs, ref_mass, G, n, pr.Weff(), kTol.float_vs_double.probs,
                                kTol.float_vs_double.mass);
        CHECK(bitwise_equal(f_hm, f_tm));

        const auto d_hm = run_library<double>(pr, Layout::head_major);
        const auto d_tm = run_library<double>(pr, Layout::token_major);
        check_against_reference(d_hm, ref_probs, ref_mass, G, n, pr.Weff(), kTol.float_vs_double.probs,
                                kTol.float_vs_double.mass);
        CHECK(bitwise_equal(d_hm, d_tm));
      }
    }
  }
}

TEST_CASE("several key tiles, sharp attention, window straddling a tile edge", "[attention][window][tiles]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(105);
  // 256-key tiles: the window [n - W, n) crosses the edge at 512 in the first two cases; G·W is not a
  // multiple of the SIMD width in most; σ = 3 makes the running maximum change from tile to tile.
  const long cases[][5] = {
      // Hkv, G, n, d, W
      {1, 4, 520, 64, 12}, {2, 3, 515, 40, 33}, {1, 1, 769, 128, 64}, {1, 8, 300, 16, 5}, {2, 2, 1030, 7, 1},
  };
  for (const auto& c : cases) {
    Problem pr(rng, c[0], c[1], c[2], c[3], c[4], 0.0, 3.0);
    for (double softcap : {0.0, 2.0}) {
      pr.softcap = softcap;
      INFO("Hkv " << pr.Hkv << " G " << pr.G << " n " << pr.n << " d " << pr.d << " W " << pr.W << " softcap " << softcap);
      const auto ref_probs = ref::window_probs(pr.Q, pr.K, pr.scale(), softcap);
      const auto lib = run_library<float>(pr, Layout::token_major);
      check_against_reference(lib, ref_probs, ref::window_mass(ref_probs, pr.Hkv), pr.G, pr.n, pr.Weff(),
                              kTol.float_vs_double.probs, kTol.float_vs_double.mass);
    }
  }
}

TEST_CASE("W > n uses the last n query rows", "[attention][window]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(102);
  const long n = 9, d = 16, W = 14, G = 2;
  Problem pr(rng, 1, G, n, d, W, 0.0);
  kvc::test::LayerBuffers<double> b(pr.K, pr.V, pr.Q, Layout::head_major);
  const auto full = run_library(b.view(), pr.args());
  REQUIRE(full.probs[0].rows() == G * n);

  // The same queries with the first W - n rows cut off: an exact W = n problem.
  LayerView<double> cut = b.view();
  cut.queries = cut.queries.token_range(W - n, n);
  const auto trimmed = run_library(cut, pr.args());
  CHECK(bitwise_equal(full, trimmed));
  // Row i of a W = n window sits at position i: row 0 sees only key 0.
  for (long hl = 0; hl < G; ++hl) {
    CHECK(full.probs[0](hl * n, 0) == 1.0);
    CHECK(full.probs[0].row(hl * n).tail(n - 1).isZero(0.0));
  }
}

TEST_CASE("soft-cap changes the logits as c·tanh(x/c)", "[attention][window][softcap]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(103);
  // Sharp attention (σ = 2) so that a small cap has a visible effect.
  Problem capped(rng, 2, 2, 40, 16, 8, 0.5, 2.0);
  Problem plain = capped;
  plain.softcap = 0.0;
  const auto lib_capped = run_library<float>(capped, Layout::head_major);
  const auto lib_plain = run_library<float>(plain, Layout::head_major);
  const auto ref_capped = ref::window_probs(capped.Q, capped.K, capped.scale(), 0.5);
  const auto ref_plain = ref::window_probs(plain.Q, plain.K, plain.scale(), 0.0);
  check_against_reference(lib_capped, ref_capped, ref::window_mass(ref_capped, 2), 2, 40, 8,
                          kTol.float_vs_double.probs, kTol.float_vs_double.mass);
  check_against_reference(lib_plain, ref_plain, ref::window_mass(ref_plain, 2), 2, 40, 8,
                          kTol.float_vs_double.probs, kTol.float_vs_double.mass);
  // The cap is not a no-op here: the capped library result differs from the uncapped reference.
  CHECK(kvc::test::normwise_error(lib_capped.probs[0], stacked(ref_plain, 0, 2)) > kTol.float_vs_double.probs.norm);

  // An explicit scale is honoured too.
  AttentionArguments args;
  args.scale = 0.3;
  kvc::test::LayerBuffers<float> b(plain.K, plain.V, plain.Q, Layout::token_major);
  const auto lib_scaled = run_library(b.view(), args);
  const auto ref_scaled = ref::window_probs(plain.Q, plain.K, 0.3, 0.0);
  check_against_reference(lib_scaled, ref_scaled, ref::window_mass(ref_scaled, 2), 2, 40, 8,
                          kTol.float_vs_double.probs, kTol.float_vs_double.mass);
}

namespace {

/// Library on T-rounded inputs vs (a) the library on the original float inputs within `storage`
/// tolerances and (b) the reference on the rounded inputs within float_vs_double.
template <class T>
void check_low_precision(const Problem& pr, Layout layout, const kvc::test::PrecisionTols& storage) {
  kvc::test::LayerBuffers<T> low(pr.K, pr.V, pr.Q, layout);
  const auto lib_low = run_library(low.view(), pr.args());
  const auto lib_float = run_library<float>(pr, layout);
  const long W = pr.Weff();
  for (long g = 0; g < pr.Hkv; ++g) {
    INFO("KV head " << g);
    CHECK(kvc::test::elementwise_ratio(lib_low.probs[g], lib_float.probs[g], storage.probs) <= 1.0);
    CHECK(kvc::test::normwise_error(lib_low.probs[g], lib_float.probs[g]) <= storage.probs.norm);
    CHECK(kvc::test::elementwise_ratio(lib_low.mass[g], lib_float.mass[g], storage.mass) <= 1.0);
    CHECK(kvc::test::normwise_error(lib_low.mass[g], lib_float.mass[g]) <= storage.mass.norm);
  }
  // Pure arithmetic: the library on rounded inputs vs the reference on the same rounded values.
  const ref::Tensor3 Kr = low.keys.rounded(), Qr = low.queries.rounded();
  const auto ref_probs = ref::window_probs(Qr, Kr, pr.scale(), pr.softcap);
  check_against_reference(lib_low, ref_probs, ref::window_mass(ref_probs, pr.Hkv), pr.G, pr.n, W,
                          kTol.float_vs_double.probs, kTol.float_vs_double.mass);
  // Rounding actually happened (otherwise (a) would be vacuous).
  CHECK(kvc::test::normwise_error(Eigen::Map<const Eigen::VectorXd>(Kr.data.data(), Kr.data.size()),
                                  Eigen::Map<const Eigen::VectorXd>(pr.K.data.data(), pr.K.data.size())) > 0.0);
}

}  // namespace

TEST_CASE("half and bfloat16 inputs agree with float within the storage tolerances", "[attention][window][half]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(104);
  // n = 600 spans several 256-key conversion tiles; sizes straddle the tile edge.
  const long cases[][5] = {
      // Hkv, G, n, d, W
      {1, 1, 17, 16, 32}, {2, 2, 65, 33, 8}, {1, 4, 257, 64, 32}, {2, 1, 600, 17, 31}, {1, 2, 256, 128, 16},
  };
  for (const auto& c : cases) {
    for (double softcap : {0.0, 2.0}) {
      Problem pr(rng, c[0], c[1], c[2], c[3], c[4], softcap);
      INFO("Hkv " << c[0] << " G " << c[1] << " n " << c[2] << " d " << c[3] << " W " << c[4]
                  << " softcap " << softcap);
      for (Layout layout : {Layout::head_major, Layout::token_major}) {
        INFO("layout " << kvc::test::to_string(layout));
        check_low_precision<Eigen::half>(pr, layout, kTol.half_vs_float);
        check_low_precision<Eigen::bfloat16>(pr, layout, kTol.bf16_vs_float);
      }
      // Same element type, either layout: bitwise identical.
      kvc::test::LayerBuffers<Eigen::half> h_hm(pr.K, pr.V, pr.Q, Layout::head_major);
      kvc::test::LayerBuffers<Eigen::half> h_tm(pr.K, pr.V, pr.Q, Layout::token_major);
      CHECK(bitwise_equal(run_library(h_hm.view(), pr.args()), run_library(h_tm.view(), pr.args())));
      kvc::test::LayerBuffers<Eigen::bfloat16> b_hm(pr.K, pr.V, pr.Q, Layout::head_major);
      kvc::test::LayerBuffers<Eigen::bfloat16> b_tm(pr.K, pr.V, pr.Q, Layout::token_major);
      CHECK(bitwise_equal(run_library(b_hm.view(), pr.args()), run_library(b_tm.view(), pr.args())));
    }
  }
}

TEST_CASE("padded strides read the same values as dense layouts", "[attention][window][view]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(105);
  Problem pr(rng, 2, 2, 33, 15, 7, 0.0);
  const auto dense = run_library<float>(pr, Layout::head_major);
  // Token-major with 5 floats of padding after every head vector: [n][Hkv][d + 5].
  const long pad = 5, dp = pr.d + pad;
  auto padded = [&](const ref::Tensor3& t) {
    std::vector<float> buf(static_cast<std::size_t>(t.n * t.H * dp), -1e30f);
    for (long h = 0; h < t.H; ++h)
      for (long j = 0; j < t.n; ++j)
        for (long k = 0; k < t.d; ++k) buf[static_cast<std::size_t>((j * t.H + h) * dp + k)] = float(t.at(h, j, k));
    return buf;
  };
  const std::vector<float> kb = padded(pr.K), vb = padded(pr.V), qb = padded(pr.Q);
  auto view_of = [&](const std::vector<float>& buf, const ref::Tensor3& t) {
    return TensorView<const float>{buf.data(), t.H, t.n, t.d, dp, t.H * dp};
  };
  const LayerView<float> layer{view_of(kb, pr.K), view_of(vb, pr.V), view_of(qb, pr.Q)};
  REQUIRE(validate_layer(layer));
  const auto strided = run_library(layer, pr.args());
  CHECK(bitwise_equal(dense, strided));
}

TEST_CASE("a NaN or Inf key in a tile before the window makes window_mass report it", "[attention][window][errors]") {
  // Keys before the window lie in unmasked tiles, where the softmax takes each tile's maxima from the
  // product (window_logits_t's tile_max) instead of its own pass: the non-finite logit must still show.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(107);
  Problem pr(rng, 2, 4, 600, 16, 8, 0.0);
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()})
    for (const long row : {0L, 10L, 300L})
      for (const double softcap : {0.0, 1.5}) {
        INFO("bad " << bad << " at key row " << row << " softcap " << softcap);
        pr.softcap = softcap;
        kvc::test::LayerBuffers<float> b(pr.K, pr.V, pr.Q, Layout::token_major);
        WindowWorkspace<float> ws;
        Vector<float> mass;
        CHECK(window_mass<float>(b.view(), 1, pr.args(), mass, ws));
        b.keys.view.row(1, row)[5] = bad;
        CHECK(window_mass<float>(b.view(), 0, pr.args(), mass, ws));  // the other head is finite
        CHECK_FALSE(window_mass<float>(b.view(), 1, pr.args(), mass, ws));
      }
}

TEST_CASE("window outputs from the mass workspace equal the reference A·V", "[attention][window][outputs]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(106);
  const long cases[][5] = {
      // Hkv, G, n, d, W  (several tiles; W > n; G·W not a multiple of the SIMD width)
      {2, 4, 530, 32, 12}, {1, 3, 9, 16, 14}, {1, 1, 300, 7, 5},
  };
  const auto check = [&](auto tag, const Problem& pr) {
    using T = decltype(tag);
    using Real = compute_t<T>;
    kvc::test::LayerBuffers<T> b(pr.K, pr.V, pr.Q, Layout::token_major);
    const ref::Tensor3 Kr = b.keys.rounded(), Vr = b.values.rounded(), Qr = b.queries.rounded();
    const auto probs = ref::window_probs(Qr, Kr, pr.scale(), pr.softcap);  // [Hq](W, n)
    WindowWorkspace<Real> ws;
    for (long g = 0; g < pr.Hkv; ++g) {
      Vector<Real> mass;
      REQUIRE(window_mass<Real>(b.view(), g, pr.args(), mass, ws));
      RowMatrix<Real> Y;
      window_outputs_after_mass(b.view(), g, ws, Y);
      const Eigen::MatrixXd P = stacked(probs, g, pr.G);  // (G·W, n)
      Eigen::MatrixXd V(pr.n, pr.d);
      for (long j = 0; j < pr.n; ++j)
        for (long c = 0; c < pr.d; ++c) V(j, c) = Vr.at(g, j, c);
      const Eigen::MatrixXd want = P * V;
      INFO("KV head " << g << " normwise error " << kvc::test::normwise_error(Y, want));
      CHECK(kvc::test::within(Y, want, kTol.float_vs_double.values));
    }
  };
  for (const auto& c : cases) {
    Problem pr(rng, c[0], c[1], c[2], c[3], c[4], 0.0, 2.0);
    for (double softcap : {0.0, 1.5}) {
      pr.softcap = softcap;
      INFO("Hkv " << pr.Hkv << " G " << pr.G << " n " << pr.n << " d " << pr.d << " W " << pr.W << " softcap " << softcap);
      check(float{}, pr);
      check(double{}, pr);
      check(Eigen::half{}, pr);
    }
  }
}

TEST_CASE("the AMX window product falls back to float FMA where it cannot run, bit for bit", "[attention][amx]") {
  // Everywhere: d = 20 (not a multiple of 32) and half keys always take the FMA kernel; where this
  // process cannot use AMX (simd::amx_bf16_available() false), d = 32 float keys do too.
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(113);
  AttentionArguments amx;
  amx.product = WindowProduct::amx_bf16x3;
  const long Hkv = 2, G = 2, n = 77, W = 8;
  CHECK(window_product_in_effect(amx, 20, G * W) == WindowProduct::fma);
  CHECK(window_product_in_effect(AttentionArguments{}, 32, G * W) == WindowProduct::fma);
  CHECK(window_product_in_effect(amx, 32, G * W) ==
        (simd::amx_bf16_available() ? WindowProduct::amx_bf16x3 : WindowProduct::fma));
  for (long d : {20L, 32L}) {
    const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d);
    kvc::test::LayerBuffers<float> f(K, V, Q, Layout::head_major);
    kvc::test::LayerBuffers<Eigen::half> h(K, V, Q, Layout::head_major);
    WindowWorkspace<float> ws;
    for (Index g = 0; g < Hkv; ++g) {
      INFO("d " << d << " head " << g);
      Vector<float> fma, other;
      window_mass<float>(h.view(), g, AttentionArguments{}, fma, ws);
      window_mass<float>(h.view(), g, amx, other, ws);
      CHECK((fma.array() == other.array()).all());  // half keys: FMA whatever is asked
      if (window_product_in_effect(amx, d, G * W) == WindowProduct::fma) {
        window_mass<float>(f.view(), g, AttentionArguments{}, fma, ws);
        window_mass<float>(f.view(), g, amx, other, ws);
        CHECK((fma.array() == other.array()).all());
      }
    }
  }
}
