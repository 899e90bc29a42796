// RoPE repositioning (SPEC §10, SelKV Eq. 7): kvc::rope_shift against kvc::ref::reposition for both
// pair layouts and partial rotary dimensions, and the pipeline's `reposition` option.
#include <catch2/catch.hpp>

#include <kvcompress/presets.hpp>
#include "presets_compiled.hpp"       // float and float16 presets compiled once (kvc_cli_methods)
#include "support/test_presets.hpp"  // double and bfloat16 (kvc_test_presets)
#include <kvcompress/result.hpp>
#include <kvcompress/rope.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/tolerances.hpp"

#include <cmath>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

/// Largest violation ratio of |got − want| <= (base + per_position·pos)·‖x‖₂ over one vector; <= 1 passes.
template <class Real>
double rope_ratio(const Real* got, const double* want, long d, double pos, double x_norm) {
  const double bound = (kTol.rope_float.base + kTol.rope_float.per_position * std::abs(pos)) * x_norm;
  double worst = 0.0;
  for (long k = 0; k < d; ++k) worst = std::max(worst, std::abs(double(got[k]) - want[k]) / bound);
  return worst;
}

RopeArguments rope_args(RopeLayout layout, long rotary_dim, double theta = 10000.0) {
  RopeArguments r;
  r.enabled = true;
  r.layout = layout;
  r.rotary_dim = rotary_dim;
  r.theta = theta;
  return r;
}

struct RopeCase {
  long d, rotary_dim;  // rotary_dim 0 = d
};

const std::vector<RopeCase>& rope_cases() {
  static const std::vector<RopeCase> cases = {{2, 0},  {8, 0},  {16, 0},  {32, 0},  {64, 0}, {130, 0},
                                              {16, 8}, {33, 16}, {7, 4}, {65, 2}, {64, 32}, {130, 64}};
  return cases;
}

}  // namespace

TEST_CASE("rope_shift matches RoPE(RoPE⁻¹(k, p_old), p_new) from the reference", "[rope]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(501);
  const std::pair<long, long> moves[] = {{0, 0}, {5, 0}, {0, 7}, {17, 3}, {100, 99}, {4095, 11}, {1234, 2000}, {3, 4096}};
  for (const RopeCase& c : rope_cases()) {
    const long r = c.rotary_dim == 0 ? c.d : c.rotary_dim;
    for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::half_split}) {
      for (double theta : {10000.0, 500000.0}) {
        const RopeArguments args = rope_args(layout, c.rotary_dim, theta);
        for (const auto& mv : moves) {
          INFO("d " << c.d << " rotary_dim " << c.rotary_dim << " " << to_string(layout) << " theta " << theta
                    << " p_old " << mv.first << " p_new " << mv.second);
          const Eigen::MatrixXd x = kvc::test::random_matrix(rng, 1, c.d, 2.0);
          const Eigen::MatrixXd want = ref::reposition(x, {mv.first}, {mv.second}, r, theta,
                                                       layout == RopeLayout::half_split);
          const double pos = double(std::max(mv.first, mv.second));
          const double nx = x.norm();

          std::vector<float> xf(static_cast<std::size_t>(c.d));
          std::vector<double> xd(static_cast<std::size_t>(c.d));
          for (long k = 0; k < c.d; ++k) {
            xf[static_cast<std::size_t>(k)] = float(x(0, k));
            xd[static_cast<std::size_t>(k)] = x(0, k);
          }
          // The reference on the float-rounded input, so only the arithmetic is compared.
          Eigen::MatrixXd xr(1, c.d);
          for (long k = 0; k < c.d; ++k) xr(0, k) = double(xf[static_cast<std::size_t>(k)]);
          const Eigen::MatrixXd want_f = ref::reposition(xr, {mv.first}, {mv.second}, r, theta,
                                                         layout == RopeLayout::half_split);
          rope_shift(xf.data(), c.d, args, double(mv.second) - double(mv.first));
          rope_shift(xd.data(), c.d, args, double(mv.second) - double(mv.first));
          const std::vector<double> wf = ref::row_vector(want_f, 0), wd = ref::row_vector(want, 0);
          CHECK(rope_ratio(xf.data(), wf.data(), c.d, pos, nx) <= 1.0);
          CHECK(rope_ratio(xd.data(), wd.data(), c.d, pos, nx) <= 1.0);
          // Dimensions beyond rotary_dim are not touched.
          for (long k = r; k < c.d; ++k) CHECK(xd[static_cast<std::size_t>(k)] == x(0, k));
        }
      }
    }
  }
}

TEST_CASE("half-split pairs (x[i], x[i + r/2]) and interleaved pairs (x[2i], x[2i+1])", "[rope]") {
  // A unit vector on dimension 0 rotates into its pair partner only.
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::half_split}) {
    std::vector<double> x(12, 0.0);
    x[0] = 1.0;
    const double delta = 0.5;  // pair 0 has frequency 1: angle 0.5
    rope_shift(x.data(), 12, rope_args(layout, 8), delta);
    const std::size_t partner = layout == RopeLayout::interleaved ? 1 : 4;
    INFO(to_string(layout));
    CHECK(x[0] == Approx(std::cos(delta)).margin(kTol.rope_float.base));
    CHECK(x[partner] == Approx(std::sin(delta)).margin(kTol.rope_float.base));
    double others = 0.0;
    for (std::size_t k = 0; k < x.size(); ++k)
      if (k != 0 && k != partner) others += std::abs(x[k]);
    CHECK(others == 0.0);
  }
}

TEST_CASE("a shift by 0 is the identity and shifts preserve norms and compose", "[rope]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(502);
  for (const RopeCase& c : rope_cases()) {
    for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::half_split}) {
      INFO("d " << c.d << " rotary_dim " << c.rotary_dim << " " << to_string(layout));
      const RopeArguments args = rope_args(layout, c.rotary_dim);
      const Eigen::MatrixXd x0 = kvc::test::random_matrix(rng, 1, c.d);
      std::vector<float> x(static_cast<std::size_t>(c.d));
      for (long k = 0; k < c.d; ++k) x[static_cast<std::size_t>(k)] = float(x0(0, k));
      const std::vector<float> orig = x;

      rope_shift(x.data(), c.d, args, 0.0);
      CHECK(x == orig);

      const auto norm = [](const std::vector<float>& v) {
        double s = 0.0;
        for (float e : v) s += double(e) * double(e);
        return std::sqrt(s);
      };
      const double n0 = norm(orig);
      rope_shift(x.data(), c.d, args, 1000.0);
      CHECK(std::abs(norm(x) - n0) <= (kTol.rope_float.base + kTol.rope_float.per_position * 1000.0) * n0);
      // Shift by 1000 then −1000: back to the start.
      rope_shift(x.data(), c.d, args, -1000.0);
      std::vector<double> back(orig.begin(), orig.end());
      CHECK(rope_ratio(x.data(), back.data(), c.d, 1000.0, n0) <= 1.0);
      // Two shifts compose: (+300) then (+45) equals (+345).
      std::vector<float> a = orig, b = orig;
      rope_shift(a.data(), c.d, args, 300.0);
      rope_shift(a.data(), c.d, args, 45.0);
      rope_shift(b.data(), c.d, args, 345.0);
      std::vector<double> bd(b.begin(), b.end());
      CHECK(rope_ratio(a.data(), bd.data(), c.d, 345.0, n0) <= 1.0);
    }
  }
}

namespace {

struct Layer {
  long Hkv, G, n, d, W;
  ref::Tensor3 K, V, Q;
};

Layer random_layer(std::mt19937_64& rng, long Hkv, long G, long n, long d, long W) {
  return {Hkv, G, n, d, W, kvc::test::random_tensor(rng, Hkv, n, d), kvc::test::random_tensor(rng, Hkv, n, d),
          kvc::test::random_tensor(rng, Hkv * G, W, d)};
}

/// With reposition on: next_position == m and head g's keys == ref::reposition(original kept keys,
/// old positions, 0..m−1); values untouched. `K` holds the (rounded) keys the library read.
template <class Real>
void check_repositioned(const LayerResult<Real>& r, const ref::Tensor3& K, const ref::Tensor3& V,
                        const RopeArguments& rope, long m) {
  CHECK(r.next_position == m);
  const long d = K.d, rd = rope.rotary_dim == 0 ? d : rope.rotary_dim;
  for (long g = 0; g < static_cast<long>(r.heads.size()); ++g) {
    INFO("KV head " << g);
    const HeadResult<Real>& h = r.heads[static_cast<std::size_t>(g)];
    REQUIRE(h.size() == m);
    const std::vector<long> old_pos = kvc::test::to_long(h.positions);
    Eigen::MatrixXd kept(m, d);
    for (long e = 0; e < m; ++e)
      for (long k = 0; k < d; ++k) kept(e, k) = K.at(g, old_pos[static_cast<std::size_t>(e)], k);
    const Eigen::MatrixXd want = ref::reposition(kept, old_pos, ref::contiguous_positions(m), rd, rope.theta,
                                                 rope.layout == RopeLayout::half_split);
    double worst = 0.0;
    long values_changed = 0;
    for (long e = 0; e < m; ++e) {
      const std::vector<double> w = ref::row_vector(want, e);
      const RowMatrix<double> ge = h.keys.row(e).template cast<double>();
      worst = std::max(worst, rope_ratio(ge.data(), w.data(), d, double(old_pos[static_cast<std::size_t>(e)]),
                                         kept.row(e).norm()));
      for (long k = 0; k < d; ++k)
        values_changed += double(h.values(e, k)) != double(Real(V.at(g, old_pos[static_cast<std::size_t>(e)], k)));
    }
    CHECK(worst <= 1.0);
    CHECK(values_changed == 0);
    // Not vacuous: some kept key moved, so repositioning really rotated it.
    bool moved = false;
    for (long e = 0; e < m; ++e) moved = moved || old_pos[static_cast<std::size_t>(e)] != e;
    if (moved) CHECK_FALSE((h.keys.template cast<double>() - kept).isZero(0.0));
  }
}

}  // namespace

TEST_CASE("the pipeline's reposition option moves kept keys to 0..m−1", "[rope][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(503);
  const Layer l = random_layer(rng, 2, 2, 77, 16, 8);
  const std::vector<RopeArguments> ropes = {rope_args(RopeLayout::interleaved, 0),
                                            rope_args(RopeLayout::half_split, 0),
                                            rope_args(RopeLayout::half_split, 8, 500000.0),
                                            rope_args(RopeLayout::interleaved, 4)};
  for (const RopeArguments& rope : ropes) {
    INFO(to_string(rope.layout) << " rotary_dim " << rope.rotary_dim << " theta " << rope.theta);
    for (long m : {1L, 9L, 40L}) {
      INFO("m " << m);
      {
        INFO("SnapKV, float, token-major");
        kvc::test::LayerBuffers<float> b(l.K, l.V, l.Q, Layout::token_major);
        SnapKV::Arguments args;
        args.reposition = rope;
        check_repositioned(SnapKV(args).run(b.view(), Budget::tokens(m)), b.keys.rounded(), b.values.rounded(),
                           rope, m);
      }
      {
        INFO("StreamingLLM, double, head-major");
        kvc::test::LayerBuffers<double> b(l.K, l.V, l.Q, Layout::head_major);
        StreamingLLM::Arguments args;
        args.reposition = rope;
        check_repositioned(StreamingLLM(args).run(b.view(), Budget::tokens(m)), l.K, l.V, rope, m);
      }
      {
        INFO("KNorm, half");
        kvc::test::LayerBuffers<Eigen::half> b(l.K, l.V, l.Q, Layout::head_major);
        KNorm::Arguments args;
        args.reposition = rope;
        check_repositioned(KNorm(args).run(b.view(), Budget::tokens(m)), b.keys.rounded(), b.values.rounded(),
                           rope, m);
      }
    }
  }
}

TEST_CASE("SelKV with reposition: merged values, original keys repositioned", "[rope][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(504);
  const Layer l = random_layer(rng, 2, 2, 90, 16, 8);
  kvc::test::LayerBuffers<float> b(l.K, l.V, l.Q, Layout::head_major);
  SelKV::Arguments on;
  on.reposition = rope_args(RopeLayout::half_split, 0);
  const long m = 30;
  const auto with = SelKV(on).run(b.view(), Budget::tokens(m));
  const auto without = SelKV{}.run(b.view(), Budget::tokens(m));
  CHECK(with.next_position == m);
  CHECK(without.next_position == l.n);
  const ref::Tensor3 K = b.keys.rounded();
  for (long g = 0; g < 2; ++g) {
    const auto& h = with.heads[static_cast<std::size_t>(g)];
    REQUIRE(h.positions == without.heads[static_cast<std::size_t>(g)].positions);
    // Values and bias are those of the run without repositioning (RoPE touches keys only).
    CHECK((h.values.array() == without.heads[static_cast<std::size_t>(g)].values.array()).all());
    CHECK((h.bias.array() == without.heads[static_cast<std::size_t>(g)].bias.array()).all());
    const std::vector<long> old_pos = kvc::test::to_long(h.positions);
    Eigen::MatrixXd kept(m, l.d);
    for (long e = 0; e < m; ++e)
      for (long k = 0; k < l.d; ++k) kept(e, k) = K.at(g, old_pos[static_cast<std::size_t>(e)], k);
    const Eigen::MatrixXd want = ref::reposition(kept, old_pos, ref::contiguous_positions(m), l.d, 10000.0, true);
    double worst = 0.0;
    for (long e = 0; e < m; ++e) {
      const std::vector<double> w = ref::row_vector(want, e);
      worst = std::max(worst, rope_ratio(h.keys.row(e).data(), w.data(), l.d,
                                         double(old_pos[static_cast<std::size_t>(e)]), kept.row(e).norm()));
    }
    CHECK(worst <= 1.0);
  }
}

TEST_CASE("reposition off: next_position == n and keys untouched", "[rope][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(505);
  const Layer l = random_layer(rng, 2, 1, 50, 8, 8);
  kvc::test::LayerBuffers<float> b(l.K, l.V, l.Q, Layout::token_major);
  SnapKV::Arguments args;
  args.reposition = rope_args(RopeLayout::interleaved, 0);
  args.reposition.enabled = false;
  args.reposition.rotary_dim = 3;  // ignored while disabled
  SnapKV snap(args);
  REQUIRE(snap.validate(b.view(), Budget::tokens(12)));
  for (long m : {1L, 12L, 50L, 70L}) {
    INFO("m " << m);
    const auto r = snap.run(b.view(), Budget::tokens(m));
    CHECK(r.next_position == l.n);
    long changed = 0;
    for (long g = 0; g < 2; ++g) {
      const auto& h = r.heads[static_cast<std::size_t>(g)];
      for (long e = 0; e < h.size(); ++e)
        for (long k = 0; k < l.d; ++k) changed += h.keys(e, k) != b.keys.view.row(g, h.positions[static_cast<std::size_t>(e)])[k];
    }
    CHECK(changed == 0);
  }
}

TEST_CASE("reposition with m >= n keeps every key in place", "[rope][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(506);
  const Layer l = random_layer(rng, 1, 2, 20, 8, 8);
  kvc::test::LayerBuffers<float> b(l.K, l.V, l.Q, Layout::head_major);
  SnapKV::Arguments args;
  args.reposition = rope_args(RopeLayout::half_split, 0);
  const auto r = SnapKV(args).run(b.view(), Budget::tokens(25));
  CHECK(r.next_position == 20);
  REQUIRE(r.heads[0].size() == 20);
  long changed = 0;
  for (long e = 0; e < 20; ++e)
    for (long k = 0; k < 8; ++k) changed += r.heads[0].keys(e, k) != b.keys.view.row(0, e)[k];
  CHECK(changed == 0);
}

TEST_CASE("RopeArguments::validate rejects bad rotary dimensions and bases", "[rope][errors]") {
  RopeArguments r = rope_args(RopeLayout::interleaved, 0);
  CHECK(r.validate(16));
  r.rotary_dim = 18;
  CHECK_THAT(r.validate(16).message(), Catch::Contains("rotary_dim"));
  r.rotary_dim = 5;
  CHECK_FALSE(r.validate(16));
  r.rotary_dim = -2;
  CHECK_FALSE(r.validate(16));
  r.rotary_dim = 0;
  CHECK_FALSE(r.validate(7));  // r = d = 7 is odd
  r.theta = 0.0;
  CHECK_THAT(r.validate(16).message(), Catch::Contains("theta"));
  r.theta = std::nan("");
  CHECK_FALSE(r.validate(16));
  r.enabled = false;
  CHECK(r.validate(16));
}
