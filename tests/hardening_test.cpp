// Hostile input: finite results or a clear kvc::error for every input, overflow-safe validation of
// views and extents, every option (enums included) range-checked, and compaction that checks every
// entry and every destination before it writes anything.
#include <catch2/catch.hpp>

#include <kvcompress/presets.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)
#include "support/test_presets.hpp"  // double and bfloat16 (kvc_test_presets)
#include <kvcompress/result.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/test_utils.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using namespace kvc;
using kvc::test::error_of;

namespace {

/// K, Q ~ N(0, 1), V ~ N(0, 1)·value_scale (or ±value_scale with `signs`), head-major, in T.
template <class T>
struct Owned {
  Index H, Hq, n, W, d;
  std::vector<T> k, v, q;

  Owned(std::uint64_t stream, Index H_, Index Hq_, Index n_, Index W_, Index d_, double value_scale,
        bool signs = false)
      : H(H_), Hq(Hq_), n(n_), W(W_), d(d_) {
    std::mt19937_64 rng = kvc::test::make_rng(stream);
    std::normal_distribution<double> normal(0.0, 1.0);
    const auto fill = [&](std::vector<T>& buf, Index count, double scale, bool sign_only) {
      buf.resize(static_cast<std::size_t>(count));
      for (T& x : buf) {
        const double z = normal(rng);
        x = from_real<T>(static_cast<float>(sign_only ? (z < 0 ? -scale : scale) : z * scale));
      }
    };
    fill(k, H * n * d, 1.0, false);
    fill(v, H * n * d, value_scale, signs);
    fill(q, Hq * W * d, 1.0, false);
  }
  LayerView<T> view() const {
    return {make_head_major<const T>(k.data(), H, n, d), make_head_major<const T>(v.data(), H, n, d),
            make_head_major<const T>(q.data(), Hq, W, d)};
  }
};

template <class Real>
bool all_finite(const LayerResult<Real>& r) {
  for (const auto& h : r.heads)
    if (!h.keys.allFinite() || !h.values.allFinite() || !h.bias.allFinite()) return false;
  return true;
}

/// Row i of head g of `values` equals the cached value at the kept position (the value step left it).
template <class T, class Real>
bool values_unchanged(const Owned<T>& layer, const HeadResult<Real>& h, Index g) {
  for (Index i = 0; i < h.size(); ++i)
    for (Index c = 0; c < layer.d; ++c)
      if (h.values(i, c) != to_real<Real>(layer.v[static_cast<std::size_t>((g * layer.n + h.positions[i]) * layer.d + c)]))
        return false;
  return true;
}

}  // namespace

// ---- GRKV: the value step's solution is checked before it is cast and written ------------------

TEST_CASE("GRKV on values near the float range: finite result and the value step rejected per head", "[hardening][ridge]") {
  INFO("seed " << kvc::test::test_seed());
  for (Index H : {Index(1), Index(2)}) {
    INFO("KV heads " << H);
    const Owned<float> layer(251, H, H, 40, 8, 8, 1e37);
    // The papers' fixed λ = 0.01 overflows here; the default's λ is chosen per head and may not.
    SnapKVGRKV::Arguments snap_args;
    StreamingLLMGRKV::Arguments stream_args;
    snap_args.merger.lambda_mode = stream_args.merger.lambda_mode = RidgeMerge::Arguments::LambdaMode::fixed;
    snap_args.merger.safeguard = stream_args.merger.safeguard = false;
    for (const auto& r : {SnapKVGRKV{}.run(layer.view(), Budget::tokens(12)),
                          StreamingLLMGRKV{}.run(layer.view(), Budget::tokens(12))}) {
      CHECK(all_finite(r));
      for (Index g = 0; g < H; ++g) {
        const auto& h = r.heads[static_cast<std::size_t>(g)];
        if (h.diagnostics.value_step_rejected) CHECK(values_unchanged(layer, h, g));
      }
    }
    const auto snap = SnapKVGRKV(snap_args).run(layer.view(), Budget::tokens(12));
    const auto stream = StreamingLLMGRKV(stream_args).run(layer.view(), Budget::tokens(12));
    CHECK(all_finite(snap));
    CHECK(all_finite(stream));
    Index rejected = 0;
    for (const auto* r : {&snap, &stream}) {
      for (Index g = 0; g < H; ++g) {
        const auto& h = r->heads[static_cast<std::size_t>(g)];
        if (h.diagnostics.value_step_rejected) {
          ++rejected;
          CHECK(values_unchanged(layer, h, g));
        }
        CHECK(std::isfinite(h.diagnostics.window_error_after));
      }
    }
    CHECK(rejected >= 1);
  }
  // Ordinary values: the value step runs and is not reported.
  const Owned<float> plain(252, 2, 2, 40, 8, 8, 1.0);
  SnapKVGRKV::Arguments fixed;
  fixed.merger.lambda_mode = RidgeMerge::Arguments::LambdaMode::fixed;
  for (const auto& h : SnapKVGRKV(fixed).run(plain.view(), Budget::tokens(12)).heads)
    CHECK_FALSE(h.diagnostics.value_step_rejected);
}

TEST_CASE("ridge value steps reject a non-finite or out-of-range solution and keep V0", "[hardening][ridge]") {
  using M = RowMatrix<float>;
  M X(2, 3), V0(3, 2), Y(2, 2), V;
  X << 0.5f, 0.25f, 0.25f, 0.2f, 0.3f, 0.5f;
  V0 << 1, 2, 3, 4, 5, 6;
  Y << 3e38f, -3e38f, 3e38f, 3e38f;  // drives the free rows past FLT_MAX
  const std::vector<Index> free{1, 2};
  CHECK_FALSE(ridge::value_step_dual(X, V0, Y, free, 1e-2, V));
  CHECK(V == V0);
  CHECK_FALSE(ridge::value_step_primal(X, V0, Y, free, 1e-2, V));
  CHECK(V == V0);
  Y << 3, 4, 4, 5;
  CHECK(ridge::value_step_dual(X, V0, Y, free, 1e-2, V));
  CHECK_FALSE(ridge::value_step_dual(X, V0, Y, free, 1e-2, V, 1.5f));  // |new value| must stay below the limit
  CHECK(V == V0);
}

// ---- GRKV on a half cache: no value beyond half's range reaches compact_into ------------------

TEST_CASE("GRKV on a half cache never writes Inf into the caller's half cache", "[hardening][ridge][compact]") {
  INFO("seed " << kvc::test::test_seed());
  Owned<Eigen::half> layer(253, 1, 1, 64, 8, 16, 60000.0, /*signs=*/true);
  const auto r = SnapKVGRKV{}.run(layer.view(), Budget::tokens(16));
  const float half_limit = detail::overflow_limit<Eigen::half, float>();
  for (const auto& h : r.heads) {
    CHECK((h.values.array().abs() < half_limit).all());
    CHECK((h.keys.array().abs() < half_limit).all());
    CHECK(h.diagnostics.value_step_rejected);
  }
  std::vector<Eigen::half> kd = layer.k, vd = layer.v;
  compact_into(r, make_head_major(kd.data(), 1, 64, 16), make_head_major(vd.data(), 1, 64, 16));
  for (const auto& x : vd) CHECK(std::isfinite(static_cast<float>(x)));
  for (const auto& x : kd) CHECK(std::isfinite(static_cast<float>(x)));
}

TEST_CASE("overflow_limit is the first magnitude that converts to Inf", "[hardening][compact]") {
  const auto check = [](auto limit, auto convert) {
    using R = decltype(limit);
    const R below = std::nextafter(limit, R(0));
    CHECK(std::isinf(convert(limit)));
    CHECK(std::isinf(convert(-limit)));
    CHECK(std::isfinite(convert(below)));
    CHECK(std::isfinite(convert(-below)));
  };
  CHECK(detail::overflow_limit<Eigen::half, float>() == 65520.0f);
  check(detail::overflow_limit<Eigen::half, float>(), [](float x) { return static_cast<float>(Eigen::half(x)); });
  check(detail::overflow_limit<Eigen::half, double>(),
        [](double x) { return static_cast<float>(from_real<Eigen::half>(x)); });
  check(detail::overflow_limit<Eigen::bfloat16, float>(),
        [](float x) { return static_cast<float>(Eigen::bfloat16(x)); });
  check(detail::overflow_limit<float, double>(), [](double x) { return static_cast<float>(x); });
  CHECK(std::isinf(detail::overflow_limit<float, float>()));
  CHECK(std::isinf(detail::overflow_limit<double, double>()));
}

TEST_CASE("compact_into fails before writing anything when an entry does not fit the destination type",
          "[hardening][compact]") {
  const Owned<float> layer(254, 2, 2, 24, 8, 8, 1.0);
  const auto base = SnapKV{}.run(layer.view(), Budget::tokens(10));
  const auto attempt = [&](auto poison, auto& k, auto& v, auto fill) {
    auto r = base;
    r.heads[1].values(9, 7) = poison;  // the last entry written: everything before it would be written first
    for (auto& x : k) x = fill;
    for (auto& x : v) x = fill;
    const std::string message = error_of([&] {
      compact_into(r, make_head_major(k.data(), 2, 24, 8), make_head_major(v.data(), 2, 24, 8));
    });
    bool untouched = true;
    for (auto& x : k) untouched &= x == fill;
    for (auto& x : v) untouched &= x == fill;
    CHECK(untouched == !message.empty());
    return message;
  };
  std::vector<Eigen::half> kh(2 * 24 * 8), vh(2 * 24 * 8);
  CHECK_THAT(attempt(70000.0f, kh, vh, Eigen::half(-3.0f)), Catch::Contains("values[1][9][7] = 70000"));
  CHECK_THAT(attempt(65520.0f, kh, vh, Eigen::half(-3.0f)), Catch::Contains("values[1][9][7]"));
  CHECK(attempt(65519.0f, kh, vh, Eigen::half(-3.0f)).empty());  // rounds to 65504
  std::vector<float> kf(2 * 24 * 8), vf(2 * 24 * 8);
  CHECK_THAT(attempt(std::numeric_limits<float>::infinity(), kf, vf, -3.0f), Catch::Contains("values[1][9][7] = inf"));
  CHECK_THAT(attempt(std::numeric_limits<float>::quiet_NaN(), kf, vf, -3.0f), Catch::Contains("values[1][9][7]"));
  // A double result into a float cache.
  LayerResult<double> rd;
  rd.heads.resize(1);
  rd.heads[0].positions = {0};
  rd.heads[0].keys = RowMatrix<double>::Zero(1, 2);
  rd.heads[0].values = RowMatrix<double>::Constant(1, 2, 1e39);
  rd.heads[0].bias = Vector<double>::Zero(1);
  std::vector<float> k1(2, 5.f), v1(2, 5.f);
  CHECK_THAT(error_of([&] { compact_into(rd, make_head_major(k1.data(), 1, 1, 2), make_head_major(v1.data(), 1, 1, 2)); }),
             Catch::Contains("values[0][0][0] = 1e+39"));
  CHECK((k1 == std::vector<float>{5.f, 5.f} && v1 == std::vector<float>{5.f, 5.f}));
}

// ---- views: overflow-checked aliasing test and byte span ----------------------------------

TEST_CASE("views whose strides or extents overflow are rejected", "[hardening][view]") {
  std::vector<float> buf(64, 1.f);
  const TensorView<const float> wrap{buf.data(), 8, 2, 1, Index(1) << 61, Index(1) << 62};
  CHECK_FALSE(detail::rows_disjoint(wrap));  // 8 · 2^61 overflows: the token stride 2^62 is inside the heads' span
  const auto st = detail::check_view(wrap, "keys");
  CHECK_FALSE(st.is_ok());
  CHECK_THAT(st.message(), Catch::Contains("keys"));

  // [1][2^58][64] floats: the byte span overflows; [1][2^52][64]: 2^60 bytes, beyond any address space.
  for (Index tokens : {Index(1) << 58, Index(1) << 55, Index(1) << 52}) {
    INFO("tokens " << tokens);
    const TensorView<const float> huge{buf.data(), 1, tokens, 64, 0, 64};
    const Status s = detail::check_view(huge, "keys");
    CHECK(s.code() == Status::Code::invalid_shape);
    CHECK_THAT(s.message(), Catch::Contains("keys") && Catch::Contains("tokens=" + std::to_string(tokens)));
  }
  const TensorView<const float> fits{buf.data(), 1, 8, 8, 64, 8};
  CHECK(detail::check_view(fits, "keys").is_ok());
}

TEST_CASE("a layer claiming 2^58 rows fails validation and the unchecked run throws kvc::error (no bad_alloc)",
          "[hardening][view]") {
  std::vector<float> k(64, 0.5f), v(64, 0.5f), q(64, 0.25f);
  const Index n = Index(1) << 58;
  LayerView<float> layer{{k.data(), 1, n, 64, 0, 64}, {v.data(), 1, n, 64, 0, 64},
                         make_head_major<const float>(q.data(), 1, 1, 64)};
  SnapKV::Arguments unchecked;
  unchecked.check_finite = false;
  CHECK_THAT(SnapKV{}.validate(layer, Budget::tokens(4)).message(), Catch::Contains("tokens=" + std::to_string(n)));
  CHECK_THAT(error_of([&] { SnapKV(unchecked).run(layer, Budget::tokens(4)); }), Catch::Contains("keys"));
  CHECK_THAT(error_of([&] { SnapKV{}.run(layer, Budget::tokens(4)); }), Catch::Contains("keys"));
  CHECK_THAT(error_of([&] { StreamingLLM(StreamingLLM::Arguments{}).run(layer, Budget::tokens(4)); }),
             Catch::Contains("keys"));

  // Plausible views whose window workspace (G·W, n) cannot be counted in an Index.
  const Index big = Index(1) << 40;
  LayerView<float> wide{{k.data(), 1, big, 1, big, 1}, {v.data(), 1, big, 1, big, 1}, {q.data(), 1, big, 1, big, 1}};
  CHECK_THAT(SnapKV{}.validate(wide, Budget::tokens(4)).message(), Catch::Contains("window attention"));
}

// ---- options: overflowing buckets, unbounded alpha, enums out of range ----------------------

TEST_CASE("router.bucket near INT64_MAX routes like one bucket of n tokens", "[hardening][router]") {
  const Owned<float> layer(255, 2, 4, 64, 8, 8, 1.0);
  SelKV::Arguments huge, whole;
  huge.router.bucket = std::numeric_limits<Index>::max();
  whole.router.bucket = 64;
  REQUIRE(SelKV(huge).validate(layer.view(), Budget::tokens(20)).is_ok());
  const auto a = SelKV(huge).run(layer.view(), Budget::tokens(20));
  const auto b = SelKV(whole).run(layer.view(), Budget::tokens(20));
  for (std::size_t g = 0; g < 2; ++g) {
    CHECK(a.heads[g].positions == b.heads[g].positions);
    CHECK(a.heads[g].values == b.heads[g].values);
    CHECK(a.heads[g].bias == b.heads[g].bias);
  }
}

TEST_CASE("compensator.alpha is bounded so that the bias stays finite", "[hardening][compensator]") {
  const Owned<float> layer(256, 2, 2, 48, 8, 8, 1.0);
  SelKV::Arguments args;
  args.compensator.alpha = 1e300;
  CHECK_THAT(SelKV(args).validate(layer.view(), Budget::tokens(12)).message(),
             Catch::Contains("compensator.alpha") && Catch::Contains("1e+300"));
  CHECK_THROWS_AS(SelKV(args).run(layer.view(), Budget::tokens(12)), kvc::error);
  args.compensator.alpha = -AttentionRatio::kMaxAlpha;
  const auto r = SelKV(args).run(layer.view(), Budget::tokens(12));
  CHECK(all_finite(r));
  bool some = false;
  for (const auto& h : r.heads) some |= (h.bias.array() != 0.0f).any();
  CHECK(some);
}

namespace {
/// A compensator whose bias overflows: the pipeline must not pass it on.
struct InfiniteBias {
  struct Arguments {};
  Arguments args;
  Status validate() const { return Status::ok(); }
  template <class T>
  void compensate(const HeadContext<T>& ctx, const Routing&, const MergeOutput<compute_t<T>>&,
                  Vector<compute_t<T>>& bias) const {
    bias.setConstant(static_cast<Index>(ctx.kept().size()), std::numeric_limits<compute_t<T>>::infinity());
  }
};
}  // namespace

TEST_CASE("a non-finite bias or repositioned key from finite input is an error", "[hardening][pipeline]") {
  const Owned<float> layer(257, 2, 2, 32, 8, 8, 1.0);
  using P = Pipeline<AttentionMass, TopK<0, 4, 0>, NoRoute, Drop, InfiniteBias>;
  CHECK_THAT(error_of([&] { P{}.run(layer.view(), Budget::tokens(8)); }), Catch::Contains("bias[0] = inf of KV head 0"));
  P::Arguments unchecked;  // check_finite waives the input checks only
  unchecked.check_finite = false;
  CHECK_THAT(error_of([&] { P(unchecked).run(layer.view(), Budget::tokens(8)); }),
             Catch::Contains("bias[0] = inf of KV head 0"));

  // Keys finite but so large that rotating a pair overflows float.
  Owned<float> big(258, 1, 1, 32, 8, 8, 1.0);
  for (float& x : big.k) x = 3.3e38f;
  StreamingLLM::Arguments rope;
  rope.reposition.enabled = true;
  CHECK_THAT(error_of([&] { StreamingLLM(rope).run(big.view(), Budget::tokens(8)); }),
             Catch::Contains("repositioned key [0][") && Catch::Contains("inf"));
}

TEST_CASE("merged values that overflow are an error, whatever check_finite says", "[hardening][pipeline]") {
  // Finite values near FLT_MAX, all of one sign: the mass-weighted sums of a merge overflow float.
  Owned<float> layer(259, 1, 2, 32, 8, 8, 1.0);
  for (float& x : layer.v) x = 3e38f;
  using P = Pipeline<AttentionMass, TopK<0, 4, 0>, BucketRouter<32>, MergeAll, NoCompensation>;
  for (const bool checked : {true, false}) {
    INFO("check_finite " << checked);
    P::Arguments args;
    args.check_finite = checked;
    CHECK_THAT(error_of([&] { P(args).run(layer.view(), Budget::tokens(8)); }),
               Catch::Contains("merged value [0][") && Catch::Contains("is not finite"));
  }
  // Values of ordinary size merge as before.
  const Owned<float> ordinary(260, 1, 2, 32, 8, 8, 1.0);
  P::Arguments unchecked;
  unchecked.check_finite = false;
  CHECK(all_finite(P(unchecked).run(ordinary.view(), Budget::tokens(8))));
}

TEST_CASE("GRKV's iteration counts are bounded", "[hardening][ridge]") {
  SnapKVGRKV::Arguments args;
  args.merger.steps = 1001;
  const Owned<float> layer(261, 1, 1, 32, 8, 8, 1.0);
  CHECK_THAT(SnapKVGRKV(args).validate(layer.view(), Budget::tokens(8)).message(), Catch::Contains("steps"));
  args.merger.steps = 1;
  args.merger.cg_max_iterations = std::numeric_limits<Index>::max();
  CHECK_THAT(SnapKVGRKV(args).validate(layer.view(), Budget::tokens(8)).message(),
             Catch::Contains("cg_max_iterations"));
}

TEST_CASE("every enum option is range-checked", "[hardening][options]") {
  const Owned<float> layer(259, 2, 2, 32, 8, 8, 1.0);
  const auto message = [&](const auto& pipeline) { return pipeline.validate(layer.view(), Budget::tokens(8)).message(); };
  {
    SnapKV::Arguments a;
    a.reposition.enabled = true;
    a.reposition.layout = static_cast<RopeLayout>(9);
    CHECK_THAT(message(SnapKV(a)), Catch::Contains("rope.layout") && Catch::Contains("9"));
    CHECK_THROWS_AS(SnapKV(a).run(layer.view(), Budget::tokens(8)), kvc::error);
  }
  {
    SnapKV::Arguments a;
    a.selector.pooling = static_cast<Pooling>(7);
    CHECK_THAT(message(SnapKV(a)), Catch::Contains("selector.pooling") && Catch::Contains("7"));
  }
  {
    SnapKV::Arguments a;
    a.selector.granularity = static_cast<Granularity>(5);
    CHECK_THAT(message(SnapKV(a)), Catch::Contains("selector.granularity") && Catch::Contains("5"));
  }
  {
    SnapKV::Arguments a;
    a.attention.product = static_cast<WindowProduct>(4);
    CHECK_THAT(message(SnapKV(a)), Catch::Contains("attention.product") && Catch::Contains("4"));
  }
  {
    SelKV::Arguments a;
    a.router.statistic = static_cast<RouteStatistic>(6);
    CHECK_THAT(message(SelKV(a)), Catch::Contains("router.statistic") && Catch::Contains("6"));
  }
  {
    SnapKVGRKV::Arguments a;
    a.merger.order = static_cast<RidgeMerge::Arguments::Order>(3);
    CHECK_THAT(message(SnapKVGRKV(a)), Catch::Contains("order") && Catch::Contains("3"));
  }
}

// ---- compaction destinations ---------------------------------------------------------------

TEST_CASE("compact_into rejects keys and values that share memory and accepts interleaved ones", "[hardening][compact]") {
  const Owned<float> layer(260, 2, 2, 24, 8, 8, 1.0);
  const auto r = SelKV{}.run(layer.view(), Budget::tokens(10));
  std::vector<float> kv(2 * 24 * 8, -7.f);
  const auto view = make_head_major(kv.data(), 2, 24, 8);
  CHECK_THAT(error_of([&] { compact_into(r, view, view); }), Catch::Contains("share memory"));
  // Offset by half a row: the rows overlap partially.
  const TensorView<float> shifted{kv.data() + 4, 2, 20, 8, 24 * 8, 8};
  CHECK_THAT(error_of([&] { compact_into(r, view, shifted); }), Catch::Contains("share memory"));
  for (float x : kv) CHECK(x == -7.f);

  // [m][2][H][d]: keys and values interleaved token by token, disjoint rows in one buffer.
  std::vector<float> both(10 * 2 * 2 * 8, -7.f);
  const TensorView<float> keys{both.data(), 2, 10, 8, 8, 2 * 2 * 8}, values{both.data() + 2 * 8, 2, 10, 8, 8, 2 * 2 * 8};
  REQUIRE_NOTHROW(compact_into(r, keys, values));
  for (Index g = 0; g < 2; ++g)
    for (Index i = 0; i < 10; ++i)
      for (Index c = 0; c < 8; ++c) {
        CHECK(keys.row(g, i)[c] == r.heads[g].keys(i, c));
        CHECK(values.row(g, i)[c] == r.heads[g].values(i, c));
      }
}

TEST_CASE("compact_bias_into checks the pointer and the stride and the extent before writing", "[hardening][compact]") {
  const Owned<float> layer(261, 2, 2, 40, 8, 8, 1.0);
  const auto r = SelKV{}.run(layer.view(), Budget::tokens(30));
  std::vector<float> bias(2 * 40, 9.f);
  CHECK_THAT(error_of([&] { compact_bias_into(r, static_cast<float*>(nullptr), 40, 40); }), Catch::Contains("null"));
  CHECK_THAT(error_of([&] { compact_bias_into(r, bias.data(), 1, 30); }),
             Catch::Contains("head_stride 1 < capacity 30"));
  CHECK_THAT(error_of([&] { compact_bias_into(r, bias.data(), -40, 40); }), Catch::Contains("head_stride must be >= 0, got -40"));
  CHECK_THAT(error_of([&] { compact_bias_into(r, bias.data(), std::numeric_limits<Index>::max(), 40); }),
             Catch::Contains("span more than"));
  for (float x : bias) CHECK(x == 9.f);
  // Half: a bias beyond its range is an error, nothing written.
  auto r2 = r;
  r2.heads[1].bias[29] = 1e6f;
  std::vector<Eigen::half> hb(2 * 40, Eigen::half(9.f));
  CHECK_THAT(error_of([&] { compact_bias_into(r2, hb.data(), 40, 40); }), Catch::Contains("bias[1][29] = 1e+06"));
  for (const auto& x : hb) CHECK(static_cast<float>(x) == 9.f);
  // One head: any stride, the row fits.
  LayerResult<float> one = r;
  one.heads.resize(1);
  std::vector<float> row(30, 9.f);
  compact_bias_into(one, row.data(), 0, 30);
  for (Index i = 0; i < 30; ++i) CHECK(row[static_cast<std::size_t>(i)] == one.heads[0].bias[i]);
}
