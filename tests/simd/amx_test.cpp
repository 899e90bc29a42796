// The opt-in AMX bf16x3 window product (simd/amx_window.hpp, AttentionArguments::product): its logits
// against double within the bound of its header, its attention mass against the double reference,
// non-finite keys, and a whole SnapKV run. Reported as skipped (exit 77, with a message) where this
// process cannot use AMX; the fallback to the FMA product is tested everywhere, in
// window_attention_test.
#include <catch2/catch.hpp>

#include <kvcompress/attention/window_attention.hpp>
#include <kvcompress/presets.hpp>

#include "support/bridge.hpp"
#include "support/random.hpp"
#include "support/test_main.hpp"
#include "support/tolerances.hpp"

#include <kvcompress/simd/amx_window.hpp>

#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

using namespace kvc;
using kvc::test::kTol;
using kvc::test::Layout;

namespace {

AttentionArguments amx_args() {
  AttentionArguments a;
  a.product = WindowProduct::amx_bf16x3;
  return a;
}

}  // namespace

TEST_CASE("amx_window_logits_t: every logit within the bf16x3 bound of the double product", "[amx]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(901);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  // R = 40 (Rp 48: three query groups, the last without a partner), 37 keys (a short last block of
  // 16), a key stride longer than the row, d = 64 and 128.
  for (long d : {64L, 128L})
    for (long count : {16L, 37L}) {
      const long R = 40, Rp = 48, ldk = d + 8;
      INFO("d " << d << " keys " << count);
      std::vector<float> q(static_cast<std::size_t>(R * d)), k(static_cast<std::size_t>(count * ldk));
      for (auto& x : q) x = normal(rng);
      for (auto& x : k) x = normal(rng);
      const float scale = 1.0f / std::sqrt(float(d));
      REQUIRE(simd::amx_shape_supported(d, Rp));
      simd::AmxQueries packed;
      simd::amx_pack_queries(q.data(), d, R, Rp, d, scale, packed);
      std::vector<float> x(static_cast<std::size_t>((count + 1) * Rp), -7.0f);
      simd::amx_window_logits_t(k.data(), ldk, count, packed, x.data(), Rp, count);
      long outside = 0, padded_nonzero = 0;
      double worst = 0.0;
      for (long j = 0; j < count; ++j)
        for (long r = 0; r < Rp; ++r) {
          const float got = x[static_cast<std::size_t>(j * Rp + r)];
          if (r >= R) {
            padded_nonzero += got != 0.0f ? 1 : 0;
            continue;
          }
          double exact = 0.0, size = 0.0;
          for (long c = 0; c < d; ++c) {
            const double qc = double(q[static_cast<std::size_t>(r * d + c)] * scale);
            exact += qc * double(k[static_cast<std::size_t>(j * ldk + c)]);
            size += std::abs(qc * double(k[static_cast<std::size_t>(j * ldk + c)]));
          }
          const double ratio = std::abs(double(got) - exact) / (kTol.amx_bf16x3_logit * size);
          worst = std::max(worst, ratio);
          outside += ratio <= 1.0 ? 0 : 1;
        }
      INFO("worst error / bound " << worst);
      CHECK(outside == 0);
      CHECK(padded_nonzero == 0);
      long past_end = 0;  // nothing written past the last key row
      for (long r = 0; r < Rp; ++r) past_end += x[static_cast<std::size_t>(count * Rp + r)] != -7.0f ? 1 : 0;
      CHECK(past_end == 0);
    }
}

TEST_CASE("window_mass with the AMX product matches the double reference", "[amx][attention]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(902);
  for (long n : {40L, 300L, 1000L})
    for (long d : {32L, 128L}) {
      const long Hkv = 2, G = 4, W = 16;
      INFO("n " << n << " d " << d);
      const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d, 1.5);
      const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
      const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d, 1.5);
      kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
      const auto probs = ref::window_probs(Q, K, 1.0 / std::sqrt(double(d)), 0.0);
      const Eigen::MatrixXd want = ref::window_mass(probs, Hkv);
      REQUIRE(window_product_in_effect(amx_args(), d, G * W) == WindowProduct::amx_bf16x3);
      WindowWorkspace<float> ws;
      for (Index g = 0; g < Hkv; ++g) {
        Vector<float> mass, fma;
        REQUIRE(window_mass<float>(b.view(), g, amx_args(), mass, ws));
        window_mass<float>(b.view(), g, AttentionArguments{}, fma, ws);
        CHECK_FALSE((mass.array() == fma.array()).all());  // the AMX product ran (its rounding differs)
        const Eigen::VectorXd want_g = want.row(g).transpose();
        CHECK(kvc::test::elementwise_ratio(mass, want_g, kTol.amx_bf16x3_mass) <= 1.0);
        CHECK(kvc::test::normwise_error(mass, want_g) <= kTol.amx_bf16x3_mass.norm);
      }
    }
}

TEST_CASE("with the AMX product a non-finite key still shows in the logits", "[amx][errors]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(904);
  const long Hkv = 1, G = 4, n = 50, W = 8, d = 64;
  REQUIRE(window_product_in_effect(amx_args(), d, G * W) == WindowProduct::amx_bf16x3);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
    const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d);
    K.at(0, 21, 5) = double(bad);
    kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
    WindowWorkspace<float> ws;
    Vector<float> mass;
    INFO("key value " << bad);
    CHECK_FALSE(window_mass<float>(b.view(), 0, amx_args(), mass, ws));
    // and the pipeline names the key, as with the FMA product
    SnapKV::Arguments args;
    args.attention = amx_args();
    CHECK_THROWS_WITH(SnapKV(args).run(b.view(), Budget::ratio(0.5)), Catch::Contains("keys"));
  }
}

TEST_CASE("SnapKV with the AMX product keeps the budget and scores like the FMA product", "[amx][pipeline]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(905);
  const long Hkv = 2, G = 4, n = 600, W = 32, d = 128;
  REQUIRE(window_product_in_effect(amx_args(), d, G * W) == WindowProduct::amx_bf16x3);
  const ref::Tensor3 K = kvc::test::random_tensor(rng, Hkv, n, d, 1.5);
  const ref::Tensor3 V = kvc::test::random_tensor(rng, Hkv, n, d);
  const ref::Tensor3 Q = kvc::test::random_tensor(rng, Hkv * G, W, d, 1.5);
  kvc::test::LayerBuffers<float> b(K, V, Q, Layout::head_major);
  SnapKV::Arguments args;
  args.attention = amx_args();
  const auto amx = SnapKV(args).run(b.view(), Budget::ratio(0.25));
  const auto fma = SnapKV{}.run(b.view(), Budget::ratio(0.25));
  REQUIRE(amx.heads.size() == std::size_t(Hkv));
  CHECK(amx.window_product == WindowProduct::amx_bf16x3);
  CHECK(fma.window_product == WindowProduct::fma);
  long same = 0, total = 0;
  for (std::size_t g = 0; g < amx.heads.size(); ++g) {
    CHECK(amx.heads[g].size() == n / 4);
    for (Index p : amx.heads[g].positions)
      same += std::binary_search(fma.heads[g].positions.begin(), fma.heads[g].positions.end(), p) ? 1 : 0;
    total += amx.heads[g].size();
  }
  // Near-ties may flip between the two products; nearly all kept positions agree.
  CHECK(double(same) >= 0.97 * double(total));
}

namespace {
const kvc::test::RunOnlyIf amx_only([]() -> std::string {
  if (kvc::simd::amx_bf16_available()) return "";
  return "this process cannot use AMX-BF16 (CPU without AMX-TILE, AMX-BF16 and AVX512-BF16, or a kernel that "
         "does not grant the tile-data permission); the AMX product is not tested here";
});
}  // namespace
