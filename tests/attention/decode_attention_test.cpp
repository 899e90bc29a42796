// Decode attention with the compensation bias (SPEC §8): kvc::decode_attention against
// kvc::ref::decode_attention, the bias semantics an engine relies on, and the error paths.
#include <catch2/catch.hpp>

#include <kvcompress/attention/decode_attention.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/test_utils.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

using namespace kvc;
using kvc::test::error_of;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

template <class Real>
RowMatrix<Real> to_lib(const Eigen::MatrixXd& m) {
  return m.cast<Real>();
}

/// Library decode attention on a reference problem. bias: (Hkv, b) or empty (no bias).
template <class T>
RowMatrix<compute_t<T>> lib_decode(const Eigen::MatrixXd& q, const ref::Tensor3& K, const ref::Tensor3& V,
                                   const Eigen::MatrixXd& bias, const AttentionArguments& args,
                                   Layout layout = Layout::head_major) {
  using Real = compute_t<T>;
  kvc::test::Buffer<T> kb(K, layout), vb(V, layout);
  const RowMatrix<Real> bias_rm = bias.cast<Real>();  // (Hkv, b) row-major: head stride b
  BiasView<Real> bv;
  if (bias.size() > 0) bv = {bias_rm.data(), bias.rows(), bias.cols(), bias.cols()};
  RowMatrix<Real> out;
  decode_attention<T>(to_lib<Real>(q), kb.cview(), vb.cview(), bv, args, out);
  return out;
}

double default_scale(long d) { return 1.0 / std::sqrt(double(d)); }

}  // namespace

TEST_CASE("decode attention matches the reference with and without bias", "[attention][decode]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(201);
  const long shapes[][3] = {{1, 1, 1}, {1, 3, 7}, {2, 2, 16}, {2, 4, 33}, {4, 1, 64}, {1, 2, 130}};  // Hkv, G, d
  long combo = 0;
  for (const auto& s : shapes) {
    for (long t : kvc::test::awkward_sizes(1, 130)) {
      ++combo;
      const long Hkv = s[0], G = s[1], d = s[2], Hq = Hkv * G;
      const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d, 1.5);
      const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
      const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hq, d, 1.5);
      // A compensation bias on the first b entries (b < t: the rest are appended tokens, bias 0).
      const long b = combo % 3 == 0 ? t : (t * 2) / 3;
      const Eigen::MatrixXd bias = kvc::test::random_matrix(rng, Hkv, b, 1.0).cwiseAbs();
      const double softcap = combo % 2 == 0 ? 0.0 : 3.0;
      AttentionArguments args;
      args.softcap = softcap;
      INFO("Hkv " << Hkv << " G " << G << " d " << d << " t " << t << " bias length " << b << " softcap " << softcap);

      // tolerances.hpp's normwise bounds hold for d in 16..128. Below that an output can be a single
      // near-cancelling sum (d = 1, G = 1: one element whose norm is ~1e-3 of its terms'), where float
      // rounding alone exceeds the normwise bound; such shapes get the elementwise test only.
      const auto close = [&](const auto& got, const Eigen::MatrixXd& want) {
        const auto& tol = kTol.float_vs_double.values;
        return d >= 16 ? kvc::test::within(got, want, tol)
                       : got.rows() == want.rows() && got.cols() == want.cols() &&
                             kvc::test::elementwise_ratio(got, want, tol) <= 1.0;
      };
      for (const Eigen::MatrixXd& bb : {Eigen::MatrixXd(), bias}) {
        INFO("with bias " << (bb.size() > 0));
        const Eigen::MatrixXd want = ref::decode_attention(q, K, V, bb, default_scale(d), softcap);
        const auto got_f = lib_decode<float>(q, K, V, bb, args);
        INFO("float: normwise error " << kvc::test::normwise_error(got_f, want) << ", elementwise ratio "
                                      << kvc::test::elementwise_ratio(got_f, want, kTol.float_vs_double.values));
        CHECK(close(got_f, want));
        const auto got_f_tm = lib_decode<float>(q, K, V, bb, args, Layout::token_major);
        CHECK((got_f_tm.array() == got_f.array()).all());
        const auto got_d = lib_decode<double>(q, K, V, bb, args, Layout::token_major);
        CHECK(kvc::test::within(got_d, want, kTol.float_vs_double.values));
      }
      // The bias changes the output (so the checks above are not vacuous).
      if (t > 1) {
        const Eigen::MatrixXd no_bias = ref::decode_attention(q, K, V, Eigen::MatrixXd(), default_scale(d), softcap);
        CHECK_FALSE(kvc::test::within(lib_decode<double>(q, K, V, bias, args), no_bias, kTol.float_vs_double.values));
      }
    }
  }
}

TEST_CASE("decode attention over several key tiles (online softmax rescaling)", "[attention][decode]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(206);
  const long t = 2 * detail::kDecodeTile + 77;  // three tiles, the last one partial
  const long shapes[][3] = {{2, 4, 128}, {1, 6, 40}, {1, 3, 20}};  // Hkv, G (a block of 4 + 2, 3), d (tails)
  for (const auto& s : shapes) {
    const long Hkv = s[0], G = s[1], d = s[2], Hq = Hkv * G;
    ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d, 1.0);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
    // Larger keys in the last tile: the running maximum rises there, so the earlier tiles' sums and
    // outputs must be rescaled.
    for (long g = 0; g < Hkv; ++g)
      for (long j = 2 * detail::kDecodeTile; j < t; ++j)
        for (long k = 0; k < d; ++k) K.at(g, j, k) *= 2.0;
    const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hq, d, 1.0);
    const Eigen::MatrixXd bias = kvc::test::random_matrix(rng, Hkv, detail::kDecodeTile + 500, 1.0).cwiseAbs();
    for (double softcap : {0.0, 5.0}) {
      AttentionArguments args;
      args.softcap = softcap;
      INFO("Hkv " << Hkv << " G " << G << " d " << d << " softcap " << softcap);
      for (const Eigen::MatrixXd& bb : {Eigen::MatrixXd(), bias}) {
        INFO("with bias " << (bb.size() > 0));
        const Eigen::MatrixXd want = ref::decode_attention(q, K, V, bb, default_scale(d), softcap);
        const auto got = lib_decode<float>(q, K, V, bb, args);
        CHECK(kvc::test::within(got, want, kTol.float_vs_double.values));
        CHECK((lib_decode<float>(q, K, V, bb, args, Layout::token_major).array() == got.array()).all());
        CHECK((lib_decode<float>(q, K, V, bb, args).array() == got.array()).all());  // deterministic
      }
    }
    // A −inf bias on the whole first tile: the running maximum stays −inf through it.
    Eigen::MatrixXd mask = Eigen::MatrixXd::Zero(Hkv, t);
    mask.leftCols(detail::kDecodeTile).setConstant(-std::numeric_limits<double>::infinity());
    ref::Tensor3 K2(Hkv, t - detail::kDecodeTile, d), V2(Hkv, t - detail::kDecodeTile, d);
    for (long g = 0; g < Hkv; ++g)
      for (long j = detail::kDecodeTile; j < t; ++j)
        for (long k = 0; k < d; ++k) {
          K2.at(g, j - detail::kDecodeTile, k) = K.at(g, j, k);
          V2.at(g, j - detail::kDecodeTile, k) = V.at(g, j, k);
        }
    const auto masked = lib_decode<float>(q, K, V, mask, AttentionArguments{});
    CHECK(masked.allFinite());
    CHECK(kvc::test::within(masked, ref::decode_attention(q, K2, V2, Eigen::MatrixXd(), default_scale(d), 0.0),
                            kTol.float_vs_double.values));
  }
  SECTION("half cache over several tiles") {
    const long Hkv = 1, G = 4, d = 64;
    const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
    const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hkv * G, d);
    kvc::test::Buffer<Eigen::half> kh(K, Layout::head_major), vh(V, Layout::head_major);
    const auto h = lib_decode<Eigen::half>(q, K, V, Eigen::MatrixXd(), AttentionArguments{});
    const Eigen::MatrixXd want =
        ref::decode_attention(q, kh.rounded(), vh.rounded(), Eigen::MatrixXd(), default_scale(d), 0.0);
    CHECK(kvc::test::within(h, want, kTol.float_vs_double.values));
  }
}

TEST_CASE("decode attention on half and bfloat16 caches", "[attention][decode][half]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(202);
  const long Hkv = 2, G = 2, t = 97, d = 64;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
  const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hkv * G, d);
  const Eigen::MatrixXd bias = kvc::test::random_matrix(rng, Hkv, 60, 0.5).cwiseAbs();
  AttentionArguments args;
  const auto f = lib_decode<float>(q, K, V, bias, args);

  kvc::test::Buffer<Eigen::half> kh(K, Layout::head_major), vh(V, Layout::head_major);
  const auto h = lib_decode<Eigen::half>(q, K, V, bias, args);
  CHECK(kvc::test::within(h, f, kTol.half_vs_float.values));
  CHECK(kvc::test::within(h, ref::decode_attention(q, kh.rounded(), vh.rounded(), bias, default_scale(d), 0.0),
                          kTol.float_vs_double.values));

  kvc::test::Buffer<Eigen::bfloat16> kbf(K, Layout::head_major), vbf(V, Layout::head_major);
  const auto bf = lib_decode<Eigen::bfloat16>(q, K, V, bias, args);
  CHECK(kvc::test::within(bf, f, kTol.bf16_vs_float.values));
  CHECK(kvc::test::within(bf, ref::decode_attention(q, kbf.rounded(), vbf.rounded(), bias, default_scale(d), 0.0),
                          kTol.float_vs_double.values));
}

TEST_CASE("a bias of zeros equals no bias, bitwise", "[attention][decode]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(203);
  const long Hkv = 2, G = 3, t = 45, d = 17;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
  const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hkv * G, d);
  for (double softcap : {0.0, 2.0}) {
    AttentionArguments args;
    args.softcap = softcap;
    const auto none = lib_decode<float>(q, K, V, Eigen::MatrixXd(), args);
    CHECK((lib_decode<float>(q, K, V, Eigen::MatrixXd::Zero(Hkv, t), args).array() == none.array()).all());
    CHECK((lib_decode<float>(q, K, V, Eigen::MatrixXd::Zero(Hkv, 10), args).array() == none.array()).all());
  }
}

TEST_CASE("bias b on an entry multiplies its softmax weight by e^b", "[attention][decode][engine]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(204);
  const long Hkv = 2, G = 2, t = 23, d = 16, Hq = Hkv * G;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
  const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hq, d);
  const Eigen::MatrixXd bias = kvc::test::random_matrix(rng, Hkv, t - 5, 1.0);  // last 5: appended, bias 0
  const double softcap = 4.0;
  AttentionArguments args;
  args.softcap = softcap;
  const double s = default_scale(d);

  SECTION("explicit weights: w_i ∝ exp(logit_i)·e^{b_i}, normalised afterwards") {
    Eigen::MatrixXd want = Eigen::MatrixXd::Zero(Hq, d);  // (Hq, d)
    for (long h = 0; h < Hq; ++h) {
      const long g = h / G;
      const std::vector<double> qh = ref::row_vector(q, h);
      std::vector<double> w(static_cast<std::size_t>(t));
      double sum = 0.0;
      for (long i = 0; i < t; ++i) {
        const double logit = softcap * std::tanh(s * ref::dot(qh.data(), K.vec(g, i), d) / softcap);
        const double mult = i < bias.cols() ? std::exp(bias(g, i)) : 1.0;
        w[static_cast<std::size_t>(i)] = std::exp(logit) * mult;
        sum += w[static_cast<std::size_t>(i)];
      }
      for (long i = 0; i < t; ++i)
        for (long k = 0; k < d; ++k) want(h, k) += w[static_cast<std::size_t>(i)] / sum * V.at(g, i, k);
    }
    CHECK(kvc::test::within(lib_decode<double>(q, K, V, bias, args), want, kTol.float_vs_double.values));
    CHECK(kvc::test::within(lib_decode<float>(q, K, V, bias, args), want, kTol.float_vs_double.values));
  }

  SECTION("bias log(c) on an entry equals c copies of it without bias") {
    const long e = 7, copies = 3;
    // The cache with entry e duplicated `copies` times (all of them at the end, order is irrelevant).
    ref::Tensor3 K2(Hkv, t + copies - 1, d), V2(Hkv, t + copies - 1, d);
    for (long g = 0; g < Hkv; ++g) {
      for (long j = 0; j < t; ++j)
        for (long k = 0; k < d; ++k) {
          K2.at(g, j, k) = K.at(g, j, k);
          V2.at(g, j, k) = V.at(g, j, k);
        }
      for (long c = 0; c < copies - 1; ++c)
        for (long k = 0; k < d; ++k) {
          K2.at(g, t + c, k) = K.at(g, e, k);
          V2.at(g, t + c, k) = V.at(g, e, k);
        }
    }
    Eigen::MatrixXd log_c = Eigen::MatrixXd::Zero(Hkv, e + 1);
    log_c.col(e).setConstant(std::log(double(copies)));
    const auto biased = lib_decode<double>(q, K, V, log_c, args);
    const auto duplicated = lib_decode<double>(q, K2, V2, Eigen::MatrixXd(), args);
    CHECK(kvc::test::within(biased, duplicated, kTol.float_vs_double.values));
    CHECK_FALSE(kvc::test::within(biased, lib_decode<double>(q, K, V, Eigen::MatrixXd(), args),
                                  kTol.float_vs_double.values));
  }

  SECTION("bias −inf hides an entry, as an engine's additive mask does") {
    const long e = 4;
    Eigen::MatrixXd mask = Eigen::MatrixXd::Zero(Hkv, t);
    mask.col(e).setConstant(-std::numeric_limits<double>::infinity());
    ref::Tensor3 K2(Hkv, t - 1, d), V2(Hkv, t - 1, d);
    for (long g = 0; g < Hkv; ++g)
      for (long j = 0, r = 0; j < t; ++j) {
        if (j == e) continue;
        for (long k = 0; k < d; ++k) {
          K2.at(g, r, k) = K.at(g, j, k);
          V2.at(g, r, k) = V.at(g, j, k);
        }
        ++r;
      }
    const auto masked = lib_decode<float>(q, K, V, mask, args);
    CHECK(masked.allFinite());
    CHECK(kvc::test::within(masked, ref::decode_attention(q, K2, V2, Eigen::MatrixXd(), s, softcap),
                            kTol.float_vs_double.values));
  }
}

TEST_CASE("decode attention rejects inconsistent shapes and writes nothing", "[attention][decode][errors]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(205);
  const long Hkv = 2, G = 2, t = 12, d = 8;
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
  kvc::test::Buffer<float> kb(K, Layout::head_major), vb(V, Layout::head_major);
  const RowMatrix<float> q = kvc::test::random_matrix(rng, Hkv * G, d).cast<float>();
  const std::vector<float> bias_data(static_cast<std::size_t>(3 * t), 0.5f);
  const BiasView<float> no_bias{};
  AttentionArguments args;
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 3, -7.f);
  const RowMatrix<float> out_before = out;
  auto run = [&](const RowMatrix<float>& qq, TensorView<const float> kk, TensorView<const float> vv,
                 const BiasView<float>& bb, const AttentionArguments& aa) {
    decode_attention<float>(qq, kk, vv, bb, aa, out);
  };

  // Sanity: the valid call works.
  RowMatrix<float> ok_out;
  decode_attention<float>(q, kb.cview(), vb.cview(), no_bias, args, ok_out);
  CHECK(ok_out.rows() == Hkv * G);

  SECTION("query columns differ from d") {
    const RowMatrix<float> q_bad = RowMatrix<float>::Ones(Hkv * G, d + 1);
    CHECK_THAT(error_of([&] { run(q_bad, kb.cview(), vb.cview(), no_bias, args); }), Catch::Contains("columns"));
  }
  SECTION("query heads not a multiple of KV heads") {
    const RowMatrix<float> q_bad = RowMatrix<float>::Ones(3, d);
    CHECK_THAT(error_of([&] { run(q_bad, kb.cview(), vb.cview(), no_bias, args); }), Catch::Contains("multiple"));
  }
  SECTION("values shape differs from keys") {
    auto v_bad = vb.cview();
    v_bad.tokens = t - 1;
    CHECK_THROWS_AS(run(q, kb.cview(), v_bad, no_bias, args), kvc::error);
    v_bad = vb.cview().token_range(0, t);
    v_bad.heads = 1;
    CHECK_THROWS_AS(run(q, kb.cview(), v_bad, no_bias, args), kvc::error);
  }
  SECTION("bias with the wrong number of heads") {
    const BiasView<float> bad{bias_data.data(), 3, t, t};
    CHECK_THAT(error_of([&] { run(q, kb.cview(), vb.cview(), bad, args); }), Catch::Contains("bias.heads"));
  }
  SECTION("empty or null caches") {
    auto k_empty = kb.cview();
    k_empty.tokens = 0;
    auto v_empty = vb.cview();
    v_empty.tokens = 0;
    CHECK_THROWS_AS(run(q, k_empty, v_empty, no_bias, args), kvc::error);
    auto k_null = kb.cview();
    k_null.data = nullptr;
    CHECK_THROWS_AS(run(q, k_null, vb.cview(), no_bias, args), kvc::error);
  }
  SECTION("bad attention arguments") {
    AttentionArguments bad;
    bad.scale = -1.0;
    CHECK_THAT(error_of([&] { run(q, kb.cview(), vb.cview(), no_bias, bad); }), Catch::Contains("scale"));
    bad = {};
    bad.softcap = std::numeric_limits<double>::quiet_NaN();
    CHECK_THAT(error_of([&] { run(q, kb.cview(), vb.cview(), no_bias, bad); }), Catch::Contains("softcap"));
  }
  CHECK((out.array() == out_before.array()).all());
  CHECK(out.rows() == 2);
}

TEST_CASE("decode attention over a ragged cache: head g reads its first lengths[g] entries only", "[attention][decode]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(209);
  const long Hkv = 3, G = 2, d = 24, t = 1100;  // crosses a key tile of the float kernel
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, t, d, 1.5);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, t, d);
  const Eigen::MatrixXd q = kvc::test::random_matrix(rng, Hkv * G, d, 1.5);
  const Eigen::MatrixXd bias = kvc::test::random_matrix(rng, Hkv, 700, 1.0);
  const std::vector<Index> lengths = {1, 1100, 613};
  // Reference: each head on its own, over its first lengths[g] entries.
  Eigen::MatrixXd want(Hkv * G, d);
  for (long g = 0; g < Hkv; ++g) {
    const long L = lengths[static_cast<std::size_t>(g)];
    ref::Tensor3 Kg(1, L, d), Vg(1, L, d);
    for (long j = 0; j < L; ++j)
      for (long k = 0; k < d; ++k) {
        Kg.at(0, j, k) = K.at(g, j, k);
        Vg.at(0, j, k) = V.at(g, j, k);
      }
    const Eigen::MatrixXd bg = bias.row(g).head(std::min<long>(L, bias.cols()));
    want.middleRows(g * G, G) = ref::decode_attention(q.middleRows(g * G, G), Kg, Vg, bg, 1.0 / std::sqrt(double(d)), 0.0);
  }
  // The rows beyond each head's length hold NaN: reading one would show.
  ref::Tensor3 Kp = K, Vp = V;
  for (long g = 0; g < Hkv; ++g)
    for (long j = lengths[static_cast<std::size_t>(g)]; j < t; ++j)
      for (long k = 0; k < d; ++k) Kp.at(g, j, k) = Vp.at(g, j, k) = std::numeric_limits<double>::quiet_NaN();
  const AttentionArguments args;
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    using Real = compute_t<T>;
    kvc::test::Buffer<T> kb(Kp, Layout::head_major), vb(Vp, Layout::head_major);
    const RowMatrix<Real> bias_rm = bias.cast<Real>();
    const BiasView<Real> bv{bias_rm.data(), bias.rows(), bias.cols(), bias.cols()};
    RowMatrix<Real> out;
    decode_attention<T>(q.cast<Real>(), kb.cview(), vb.cview(), bv, args, lengths, out);
    return Eigen::MatrixXd(out.template cast<double>());
  };
  const Eigen::MatrixXd got_f = run(float{}), got_d = run(double{});
  REQUIRE(got_f.allFinite());
  CHECK(kvc::test::normwise_error(got_f, want) <= kTol.float_vs_double.values.norm);
  CHECK(kvc::test::normwise_error(got_d, want) <= 1e-13);

  // Bad lengths are errors, and nothing is written.
  kvc::test::Buffer<float> kb(K, Layout::head_major), vb(V, Layout::head_major);
  RowMatrix<float> out = RowMatrix<float>::Constant(2, 2, 7.0f);
  for (const std::vector<Index>& bad : {std::vector<Index>{1, 2}, std::vector<Index>{1, 0, 5}, std::vector<Index>{1, 1101, 5}}) {
    CHECK_THROWS_AS(decode_attention<float>(q.cast<float>(), kb.cview(), vb.cview(), BiasView<float>{}, args, bad, out),
                    kvc::error);
    CHECK(out == RowMatrix<float>::Constant(2, 2, 7.0f));
  }
}
