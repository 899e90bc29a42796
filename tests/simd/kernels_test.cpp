// simd/ kernels against serial double loops over awkward sizes around the vector width, misaligned
// offsets, and float / half / bfloat16 inputs, for the default architecture and a narrower one.
#include <catch2/catch.hpp>

#include <kvcompress/core.hpp>
#define KVC_INTERNAL_INCLUDE  // this test checks the private row helpers too
#include <kvcompress/detail/rows.hpp>
#undef KVC_INTERNAL_INCLUDE
#include <kvcompress/simd/kernels.hpp>
#include <kvcompress/simd/window_gemm.hpp>

#include "support/random.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace simd = kvc::simd;

// Relative accuracy expected of a float kernel of length len against double on the same (rounded)
// inputs: a few ulp per term, growing like len for the serial tails (generous, still ~1e-5 at 130).
double float_bound(long len) { return 8e-7 * (4.0 + double(len)); }

const std::vector<long> kSizes = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 130, 257};
const std::vector<long> kOffsets = {0, 1, 3};  // elements of misalignment

template <class T>
std::vector<T> random_row(std::mt19937_64& rng, long len, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<T> v(static_cast<std::size_t>(len));
  for (auto& x : v) x = T(static_cast<float>(normal(rng)));
  return v;
}

template <class T>
double as_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}

template <class A, class T>
void check_row_kernels(std::mt19937_64& rng) {
  for (long len : kSizes)
    for (long off : kOffsets) {
      INFO("arch " << A::name() << " len " << len << " offset " << off);
      const auto xs = random_row<float>(rng, len + off);
      const auto ys = random_row<T>(rng, len + off);
      const float* x = xs.data() + off;
      const T* y = ys.data() + off;
      double dot = 0, yy = 0, xy_abs = 0;
      for (long k = 0; k < len; ++k) {
        dot += double(x[k]) * as_double(y[k]);
        xy_abs += std::abs(double(x[k]) * as_double(y[k]));
        yy += as_double(y[k]) * as_double(y[k]);
      }
      CHECK(std::abs(simd::dot<A>(x, y, len) - dot) <= float_bound(len) * xy_abs);
      CHECK(std::abs(simd::sum_squares<A>(y, len) - yy) <= float_bound(len) * yy);
      CHECK(std::abs(simd::norm<A>(y, len) - std::sqrt(yy)) <= float_bound(len) * std::sqrt(yy));

      // cosine of y against itself shifted: compare with double.
      const auto zs = random_row<T>(rng, len + off);
      const T* z = zs.data() + off;
      double yz = 0, zz = 0, yz_abs = 0;
      for (long k = 0; k < len; ++k) {
        yz += as_double(y[k]) * as_double(z[k]);
        yz_abs += std::abs(as_double(y[k]) * as_double(z[k]));
        zz += as_double(z[k]) * as_double(z[k]);
      }
      const double cos_want = yz / (std::sqrt(yy) * std::sqrt(zz));
      CHECK(std::abs(simd::cosine<A>(y, z, len) - cos_want) <=
            float_bound(len) * (1.0 + yz_abs / (std::sqrt(yy) * std::sqrt(zz))));

      // axpy: y_out = acc + w·y, elementwise.
      std::vector<float> acc(static_cast<std::size_t>(len + off), 0.5f);
      simd::axpy<A>(0.75f, y, acc.data() + off, len);
      for (long k = 0; k < len; ++k)
        CHECK(std::abs(acc[std::size_t(off + k)] - (0.5 + 0.75 * as_double(y[k]))) <=
              1e-6 * (1.0 + std::abs(as_double(y[k]))));
      for (long k = 0; k < off; ++k) CHECK(acc[std::size_t(k)] == 0.5f);  // nothing written before

      // scale_into: out = w·y exactly as converting y to float and then multiplying (one rounding),
      // whatever out held; nothing written outside [off, off + len).
      std::vector<float> out(static_cast<std::size_t>(len + off + 1), std::numeric_limits<float>::quiet_NaN());
      simd::scale_into<A>(y, 0.7f, out.data() + off, len);
      long wrong = 0;
      for (long k = 0; k < len; ++k) wrong += out[std::size_t(off + k)] == static_cast<float>(y[k]) * 0.7f ? 0 : 1;
      CHECK(wrong == 0);
      for (long k = 0; k < off; ++k) CHECK(std::isnan(out[std::size_t(k)]));
      CHECK(std::isnan(out[std::size_t(off + len)]));
    }
}

template <class A>
void check_softmax_kernels(std::mt19937_64& rng) {
  for (long len : kSizes)
    for (long off : kOffsets) {
      INFO("arch " << A::name() << " len " << len << " offset " << off);
      auto xs = random_row<float>(rng, len + off, 4.0);
      float* x = xs.data() + off;
      const std::vector<float> orig(x, x + len);
      double mx = -1e300;
      for (float v : orig) mx = std::max(mx, double(v));
      CHECK(simd::max<A>(x, len) == static_cast<float>(mx));
      const float sum = simd::exp_shift_sum<A>(x, len, static_cast<float>(mx));
      double want_sum = 0;
      for (long k = 0; k < len; ++k) {
        const double want = std::exp(double(orig[std::size_t(k)]) - mx);
        want_sum += want;
        // the float subtraction x − max rounds by up to |x − max|·2^-24, which e^(.) turns into a relative error
        const double arg = std::abs(double(orig[std::size_t(k)]) - mx);
        CHECK(std::abs(x[k] - want) <= (3e-7 + 1.2e-7 * arg) * want);
      }
      CHECK(std::abs(sum - want_sum) <= float_bound(len) * want_sum);
      // divide
      simd::divide<A>(x, sum, len);
      double total = 0;
      for (long k = 0; k < len; ++k) total += x[k];
      CHECK(std::abs(total - 1.0) <= float_bound(len));
    }
}

template <class A>
void check_exp() {
  using B = simd::fbatch<A>;
  double worst = 0;
  for (float v = -87.0f; v <= 88.0f; v += 0.01237f) {
    const double want = std::exp(double(v));
    worst = std::max(worst, std::abs(double(simd::exp<A>(B(v)).get(0)) - want) / want);
  }
  INFO("arch " << A::name() << " worst relative error " << worst);
  CHECK(worst <= 2.0 * 0x1p-24);
  CHECK(simd::exp<A>(B(-100.0f)).get(0) == 0.0f);
  CHECK(simd::exp<A>(B(0.0f)).get(0) == 1.0f);
}

template <class A>
void check_exp2() {
  using B = simd::fbatch<A>;
  double worst = 0;
  for (float v = -126.0f; v <= 127.0f; v += 0.00731f) {
    const double want = std::exp2(double(v));
    worst = std::max(worst, std::abs(double(simd::exp2<A>(B(v)).get(0)) - want) / want);
  }
  INFO("arch " << A::name() << " worst relative error of exp2 " << worst);
  CHECK(worst <= 1.5 * 0x1p-24);
  for (int k = -126; k <= 127; ++k) CHECK(simd::exp2<A>(B(float(k))).get(0) == std::ldexp(1.0f, k));
  CHECK(simd::exp2<A>(B(-126.0f)).get(0) == std::ldexp(1.0f, -126));  // the smallest result: never a denormal
  CHECK(simd::exp2<A>(B(-126.0001f)).get(0) == 0.0f);
  CHECK(simd::exp2<A>(B(-127.0f)).get(0) == 0.0f);
  CHECK(simd::exp2<A>(B(-1000.0f)).get(0) == 0.0f);
  CHECK(simd::exp2<A>(B(-std::numeric_limits<float>::infinity())).get(0) == 0.0f);
#if defined(__x86_64__) || defined(__i386__)
  CHECK(simd::exp2<A>(B(std::numeric_limits<float>::quiet_NaN())).get(0) == 0.0f);  // x86 max drops the NaN
#endif
  CHECK(simd::exp2<A>(B(1000.0f)).get(0) == std::ldexp(1.0f, 127));
  CHECK(simd::exp2<A>(B(std::numeric_limits<float>::infinity())).get(0) == std::ldexp(1.0f, 127));
  // e^x through it: rounding x·log2 e, and log2 e itself, add up to 1.5·|x|·2^-24 to the relative error
  // (the order of the error the logits already carry from their product).
  worst = 0;
  for (float v = -87.0f; v <= 88.0f; v += 0.01237f) {
    const double want = std::exp(double(v));
    const double rel = std::abs(double(simd::exp_via2<A>(B(v)).get(0)) - want) / want;
    worst = std::max(worst, rel / (2.0 + 1.5 * std::abs(double(v))));
  }
  INFO("worst relative error of exp_via2 over (2 + 1.5·|x|) ulp " << worst);
  CHECK(worst <= 0x1p-24);
  CHECK(simd::exp_via2<A>(B(0.0f)).get(0) == 1.0f);
  CHECK(simd::exp_via2<A>(B(-100.0f)).get(0) == 0.0f);
}

/// The causal tile epilogue over several tiles reproduces softmax rows computed in double.
template <class A>
void check_softmax_tile(std::mt19937_64& rng) {
  for (long cols : {1L, 7L, 9L, 33L, 130L})
    for (long tile : {1L, 8L, 17L, 64L}) {
      INFO("arch " << A::name() << " cols " << cols << " tile " << tile);
      const long rows = 5;
      std::vector<long> visible(rows);
      for (long r = 0; r < rows; ++r) visible[std::size_t(r)] = std::max(1L, cols - (rows - 1 - r) * 2);
      auto logits = random_row<float>(rng, rows * cols, 3.0);
      const std::vector<float> orig = logits;
      std::vector<float> row_max(rows, -std::numeric_limits<float>::infinity()), row_sum(rows, 0.0f);
      const long tiles = (cols + tile - 1) / tile;
      std::vector<float> shift(std::size_t(rows * tiles));
      std::vector<simd::Index> live(static_cast<std::size_t>(rows));
      for (long t = 0; t < tiles; ++t) {
        const long j0 = t * tile, cnt = std::min(tile, cols - j0);
        for (long r = 0; r < rows; ++r) live[std::size_t(r)] = visible[std::size_t(r)] - j0;
        simd::softmax_tile<A>(logits.data() + j0, cols, rows, cnt, live.data(), 0.0f, row_max.data(),
                              row_sum.data(), shift.data() + t * rows);
      }
      for (long r = 0; r < rows; ++r) {
        double mx = -1e300, z = 0;
        for (long j = 0; j < visible[std::size_t(r)]; ++j) mx = std::max(mx, double(orig[std::size_t(r * cols + j)]));
        for (long j = 0; j < visible[std::size_t(r)]; ++j) z += std::exp(double(orig[std::size_t(r * cols + j)]) - mx);
        for (long j = 0; j < cols; ++j) {
          const long t = j / tile;
          const double got = double(logits[std::size_t(r * cols + j)]) *
                             std::exp(double(shift[std::size_t(t * rows + r)]) - double(row_max[std::size_t(r)])) /
                             double(row_sum[std::size_t(r)]);
          const double want = j < visible[std::size_t(r)] ? std::exp(double(orig[std::size_t(r * cols + j)]) - mx) / z : 0.0;
          const double arg = j < visible[std::size_t(r)] ? std::abs(double(orig[std::size_t(r * cols + j)]) - mx) : 0.0;
          CHECK(std::abs(got - want) <= (2e-6 + 1.2e-7 * arg) * want + 1e-30);
        }
      }
    }
}

/// dot_rows / axpy_rows: several query rows against one key row, one value row into several outputs.
template <class A, class T>
void check_multi_row(std::mt19937_64& rng) {
  for (long count : {1L, 3L, 4L, 5L, 8L})
    for (long d : {1L, 7L, 8L, 9L, 33L, 128L}) {
      INFO("arch " << A::name() << " rows " << count << " d " << d);
      const auto q = random_row<float>(rng, count * d + 1);
      const auto k = random_row<T>(rng, d + 1);
      std::vector<float> out(static_cast<std::size_t>(count));
      simd::dot_rows<A>(q.data() + 1, d, count, k.data() + 1, d, out.data());
      for (long h = 0; h < count; ++h) {
        double want = 0, mag = 0;
        for (long c = 0; c < d; ++c) {
          want += double(q[std::size_t(1 + h * d + c)]) * as_double(k[std::size_t(1 + c)]);
          mag += std::abs(double(q[std::size_t(1 + h * d + c)]) * as_double(k[std::size_t(1 + c)]));
        }
        CHECK(std::abs(out[std::size_t(h)] - want) <= float_bound(d) * mag);
      }
      std::vector<float> w = {0.5f, -1.25f, 2.0f, 0.125f, -0.75f, 1.5f, 3.0f, -2.0f};
      std::vector<float> y(std::size_t(count * d), 1.0f);
      simd::axpy_rows<A>(w.data(), 1, count, k.data() + 1, d, y.data(), d);
      for (long h = 0; h < count; ++h)
        for (long c = 0; c < d; ++c) {
          const double want = 1.0 + double(w[std::size_t(h)]) * as_double(k[std::size_t(1 + c)]);
          CHECK(std::abs(y[std::size_t(h * d + c)] - want) <= 1e-6 * (1.0 + std::abs(want)));
        }
    }
}

/// window_gemm.hpp: packed-query logits (every panel shape and key-row remainder) against double dot
/// products, zero padding lanes, and the transposed causal softmax tile against direct formulas.
template <class A>
void check_window_gemm(std::mt19937_64& rng) {
  const long L = long(simd::fbatch<A>::size);
  // Rp = L, 2L, 3L, 5L, 6L, 7L, 128: every mix of the panel widths (simd::panel_columns); d = 129 is too
  // deep for AVX-512's 4-batch panels to fit in 32 KiB, so it takes the 2-batch ones there.
  for (long R : {1L, 3L, L, L + 1, 2 * L, 2 * L + 3, 5 * L, 6 * L - 1, 7 * L, 128L})
    for (long d : {1L, 7L, 64L, 129L})
      for (long count : {1L, 5L, 6L, 7L, 13L}) {
        INFO("arch " << A::name() << " R " << R << " d " << d << " keys " << count);
        const long ldq = d + 2, ldk = d + 3, Rp = simd::padded_queries<A>(R), ldo = Rp + L;
        REQUIRE(Rp % L == 0);
        REQUIRE(Rp >= R);
        REQUIRE(Rp < R + L);
        const auto q = random_row<float>(rng, R * ldq);
        const auto k = random_row<float>(rng, count * ldk);
        std::vector<float> packed(std::size_t(Rp * d), -9.f), out(std::size_t(count * ldo), -7.f);
        const float scale = 0.37f;
        simd::pack_queries<A>(q.data(), ldq, R, d, scale, packed.data());
        simd::window_logits_t<A>(k.data(), ldk, count, d, packed.data(), Rp, out.data(), ldo);
        for (long j = 0; j < count; ++j) {
          for (long c = 0; c < R; ++c) {
            double want = 0, mag = 0;
            for (long p = 0; p < d; ++p) {
              const double t = double(scale * q[std::size_t(c * ldq + p)]) * double(k[std::size_t(j * ldk + p)]);
              want += t;
              mag += std::abs(t);
            }
            CHECK(std::abs(out[std::size_t(j * ldo + c)] - want) <= float_bound(d) * mag);
          }
          for (long c = R; c < Rp; ++c) CHECK(out[std::size_t(j * ldo + c)] == 0.f);
          for (long c = Rp; c < ldo; ++c) CHECK(out[std::size_t(j * ldo + c)] == -7.f);  // untouched
        }
        // Prefetching a next tile of keys (a hint; fewer, as many or more rows than this tile) changes
        // nothing, bit for bit.
        for (long next_count : {1L, 6L, 13L}) {
          const auto next = random_row<float>(rng, next_count * ldk);
          std::vector<float> again(out.size(), -7.f);
          simd::window_logits_t<A>(k.data(), ldk, count, d, packed.data(), Rp, again.data(), ldo, next.data(),
                                   next_count);
          CHECK(again == out);
        }
        // tile_max: the lane maxima of the logits written (same outputs, bit for bit), NaN in the lanes
        // of a non-finite logit (a NaN or an Inf key element reaches every lane; query padding is 0).
        std::vector<float> with_max(out.size(), -7.f), tile_max(std::size_t(Rp), -5.f);
        simd::window_logits_t<A>(k.data(), ldk, count, d, packed.data(), Rp, with_max.data(), ldo, nullptr, 0,
                                 tile_max.data());
        CHECK(with_max == out);
        for (long c = 0; c < Rp; ++c) {
          float want = -std::numeric_limits<float>::infinity();
          for (long j = 0; j < count; ++j) want = std::max(want, out[std::size_t(j * ldo + c)]);
          CHECK(tile_max[std::size_t(c)] == want);
        }
        for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
          auto kb = k;
          kb[std::size_t((count - 1) * ldk + d / 2)] = bad;
          simd::window_logits_t<A>(kb.data(), ldk, count, d, packed.data(), Rp, with_max.data(), ldo, nullptr, 0,
                                   tile_max.data());
          for (long c = 0; c < Rp; ++c) CHECK(std::isnan(tile_max[std::size_t(c)]));
        }
      }

  // softmax_tile_t over two tiles (3 + 4 keys) of Rp = 2L lanes (single batches) and Rp = 5L lanes
  // (one group of four batches, then one), W = 5 window, soft-cap 3: lane c sees relative key position
  // rel iff rel <= last[c].
  for (const long Rp : {2 * L, 5 * L}) {
    const long W = 5, n = 7;
    std::vector<float> last(static_cast<std::size_t>(Rp));
    for (long c = 0; c < Rp; ++c) last[std::size_t(c)] = float(c < Rp - 1 ? c % W : W);
    const auto x0 = random_row<float>(rng, n * Rp);
    std::vector<float> x = x0;
    for (float& v : x) v *= 4.f;
    const std::vector<float> raw = x;
    std::vector<float> run_max(std::size_t(Rp), -std::numeric_limits<float>::infinity()), run_sum(std::size_t(Rp), 0.f);
    std::vector<float> shift(std::size_t(2 * Rp));
    const long base = n - W;  // rel = j - base
    CHECK(simd::softmax_tile_t<A>(x.data(), Rp, 3, Rp, 0 - base, true, last.data(), 3.f, run_max.data(),
                                  run_sum.data(), shift.data()));
    CHECK(simd::softmax_tile_t<A>(x.data() + 3 * Rp, Rp, 4, Rp, 3 - base, true, last.data(), 3.f, run_max.data(),
                                  run_sum.data(), shift.data() + Rp));
    for (long c = 0; c < Rp; ++c) {
      INFO("arch " << A::name() << " Rp " << Rp << " lane " << c);
      double mx = -1e300, z = 0;
      const auto capped = [&](long j) { return 3.0 * std::tanh(double(raw[std::size_t(j * Rp + c)]) / 3.0); };
      const auto visible = [&](long j) { return double(j - base) <= double(last[std::size_t(c)]); };
      for (long j = 0; j < n; ++j)
        if (visible(j)) mx = std::max(mx, capped(j));
      for (long j = 0; j < n; ++j)
        if (visible(j)) z += std::exp(capped(j) - mx);
      CHECK(std::abs(run_max[std::size_t(c)] - mx) <= 1e-6 * (1 + std::abs(mx)));
      CHECK(std::abs(run_sum[std::size_t(c)] - z) <= 1e-5 * z);
      for (long j = 0; j < n; ++j) {
        const double got = double(x[std::size_t(j * Rp + c)]) *
                           std::exp(double(shift[std::size_t((j < 3 ? 0 : 1) * Rp + c)]) - double(run_max[std::size_t(c)])) /
                           double(run_sum[std::size_t(c)]);
        const double want = visible(j) ? std::exp(capped(j) - mx) / z : 0.0;
        if (!visible(j)) CHECK(x[std::size_t(j * Rp + c)] == 0.f);
        CHECK(std::abs(got - want) <= 1e-5 * want + 1e-30);
      }
    }
    // With the product's lane maxima (tile_max) an unmasked, uncapped tile gives the same results bit for
    // bit as the pass over it; a masked or capped one ignores them; a NaN maximum is reported.
    for (const bool use_max : {false, true})
      for (const bool masked : {false, true})
        for (const float cap : {0.f, 3.f}) {
          INFO("arch " << A::name() << " Rp " << Rp << " masked " << masked << " cap " << cap);
          std::vector<float> lane_max(std::size_t(Rp), -std::numeric_limits<float>::infinity());
          for (long j = 0; j < 3; ++j)
            for (long c = 0; c < Rp; ++c) lane_max[std::size_t(c)] = std::max(lane_max[std::size_t(c)], raw[std::size_t(j * Rp + c)]);
          if (masked || cap > 0.f) std::fill(lane_max.begin(), lane_max.end(), 1e30f);  // must be ignored
          std::vector<float> xa = raw, xb = raw, ma(std::size_t(Rp), -std::numeric_limits<float>::infinity()), mb = ma;
          std::vector<float> sa(std::size_t(Rp), 0.f), sb = sa, ha = sa, hb = sa;
          CHECK(simd::softmax_tile_t<A>(xa.data(), Rp, 3, Rp, -base, masked, last.data(), cap, ma.data(), sa.data(),
                                        ha.data()));
          CHECK(simd::softmax_tile_t<A>(xb.data(), Rp, 3, Rp, -base, masked, last.data(), cap, mb.data(), sb.data(),
                                        hb.data(), use_max ? lane_max.data() : nullptr));
          CHECK(xa == xb);
          CHECK(ma == mb);
          CHECK(sa == sb);
          CHECK(ha == hb);
          if (!masked && cap == 0.f) {
            for (const long lane : {1L, Rp - 1}) {  // in a group of four batches and in the single-batch tail
              auto poisoned = lane_max;
              poisoned[std::size_t(lane)] = std::numeric_limits<float>::quiet_NaN();
              CHECK_FALSE(simd::softmax_tile_t<A>(xb.data(), Rp, 3, Rp, -base, false, last.data(), 0.f, mb.data(),
                                                  sb.data(), hb.data(), poisoned.data()));
            }
          }
        }
    // Non-finite raw logits are reported (NaN and Inf; the soft-cap would hide the Inf), in every lane group.
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
      for (long lane : {1L, Rp - 1}) {
        INFO("arch " << A::name() << " Rp " << Rp << " bad lane " << lane);
        std::vector<float> y = raw;
        y[std::size_t(2 * Rp + lane)] = bad;
        std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
        std::fill(run_sum.begin(), run_sum.end(), 0.f);
        CHECK_FALSE(simd::softmax_tile_t<A>(y.data(), Rp, 3, Rp, -10, false, last.data(), 3.f, run_max.data(),
                                            run_sum.data(), shift.data()));
      }
  }
}


// row_dots against a double loop over row counts around the block size (short last blocks) and
// awkward lengths, with a row stride longer than the row; every row gets the same arithmetic wherever
// it is (a row copied to every position gives the same float everywhere, last short block included).
template <class A>
void check_row_dots(std::mt19937_64& rng) {
  constexpr long S = long(simd::fbatch<A>::size);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (long rows : {1L, 2L, S - 1, S, S + 1, 2 * S + 3, 37L})
    for (long cols : {1L, 7L, 16L, 17L, 33L, 64L, 128L, 130L}) {
      INFO("arch " << A::name() << " rows " << rows << " cols " << cols);
      const long ldx = cols + 5;
      std::vector<float> x(static_cast<std::size_t>(rows * ldx)), w(static_cast<std::size_t>(cols));
      std::vector<float> out(static_cast<std::size_t>(rows + 1), -7.0f);
      for (auto& v : x) v = normal(rng);
      for (auto& v : w) v = normal(rng);
      simd::row_dots<A>(x.data(), ldx, rows, w.data(), cols, out.data());
      for (long r = 0; r < rows; ++r) {
        double want = 0, scale = 0;
        for (long c = 0; c < cols; ++c) {
          want += double(w[std::size_t(c)]) * double(x[std::size_t(r * ldx + c)]);
          scale += std::abs(double(w[std::size_t(c)]) * double(x[std::size_t(r * ldx + c)]));
        }
        CHECK(std::abs(double(out[std::size_t(r)]) - want) <= float_bound(cols) * scale);
      }
      CHECK(out[std::size_t(rows)] == -7.0f);  // nothing written past `rows`
      // The same row at every position: the same float at every position.
      for (long r = 1; r < rows; ++r)
        std::copy(x.begin(), x.begin() + cols, x.begin() + std::ptrdiff_t(r * ldx));
      simd::row_dots<A>(x.data(), ldx, rows, w.data(), cols, out.data());
      for (long r = 1; r < rows; ++r) {
        INFO("position " << r);
        CHECK(out[std::size_t(r)] == out[0]);
      }
    }
}

// The stored bias of a view compressed before (no soft-cap): softmax_tile and softmax_tile_t with a
// bias equal, bit for bit, the same kernel without one on logits x + b (rows or columns past bias_len
// unbiased), masked or not, in every lane group.
template <class A>
void check_biased_softmax_tiles(std::mt19937_64& rng) {
  constexpr long L = long(simd::fbatch<A>::size);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (const long Rp : {2 * L, 5 * L}) {
    const long W = 5, n = 7, base = n - W, count = 3;
    std::vector<float> last(static_cast<std::size_t>(Rp));
    for (long c = 0; c < Rp; ++c) last[std::size_t(c)] = float(c < Rp - 1 ? c % W : W);
    const auto raw = random_row<float>(rng, count * Rp, 4.0);
    const auto b = random_row<float>(rng, count, 2.0);
    for (const bool masked : {false, true})
      for (const long bias_len : {count, count - 1}) {
        INFO("arch " << A::name() << " Rp " << Rp << " masked " << masked << " bias_len " << bias_len);
        std::vector<float> xa = raw, xb = raw, ma(std::size_t(Rp), ninf), mb = ma;
        std::vector<float> sa(std::size_t(Rp), 0.f), sb = sa, ha = sa, hb = sa;
        for (long j = 0; j < bias_len; ++j)
          for (long c = 0; c < Rp; ++c) xb[std::size_t(j * Rp + c)] += b[std::size_t(j)];
        CHECK(simd::softmax_tile_t<A>(xa.data(), Rp, count, Rp, -base, masked, last.data(), 0.f, ma.data(), sa.data(),
                                      ha.data(), nullptr, b.data(), bias_len));
        CHECK(simd::softmax_tile_t<A>(xb.data(), Rp, count, Rp, -base, masked, last.data(), 0.f, mb.data(), sb.data(),
                                      hb.data()));
        CHECK(xa == xb);
        CHECK(ma == mb);
        CHECK(sa == sb);
        CHECK(ha == hb);
      }
  }
  const long rows = 3, cols = 2 * L + 3;
  const auto raw = random_row<float>(rng, rows * cols, 4.0);
  const auto b = random_row<float>(rng, cols, 2.0);
  for (const long bias_len : {cols, cols - 2, 1L}) {
    INFO("arch " << A::name() << " softmax_tile bias_len " << bias_len);
    const std::vector<simd::Index> live = {cols, cols - 1, 2};
    std::vector<float> xa = raw, xb = raw, ma(std::size_t(rows), ninf), mb = ma;
    std::vector<float> sa(std::size_t(rows), 0.f), sb = sa, ha = sa, hb = sa;
    for (long r = 0; r < rows; ++r)
      for (long j = 0; j < bias_len; ++j) xb[std::size_t(r * cols + j)] += b[std::size_t(j)];
    simd::softmax_tile<A>(xa.data(), cols, rows, cols, live.data(), 0.f, ma.data(), sa.data(), ha.data(), b.data(),
                          bias_len);
    simd::softmax_tile<A>(xb.data(), cols, rows, cols, live.data(), 0.f, mb.data(), sb.data(), hb.data());
    CHECK(xa == xb);
    CHECK(ma == mb);
    CHECK(sa == sb);
    CHECK(ha == hb);
  }
}

template <class A>
void check_all_types(std::mt19937_64& rng) {
  check_window_gemm<A>(rng);
  check_row_kernels<A, float>(rng);
  check_row_kernels<A, Eigen::half>(rng);
  check_row_kernels<A, Eigen::bfloat16>(rng);
  check_softmax_kernels<A>(rng);
  check_row_dots<A>(rng);
  check_exp<A>();
  check_exp2<A>();
  check_softmax_tile<A>(rng);
  check_biased_softmax_tiles<A>(rng);
  check_multi_row<A, float>(rng);
  check_multi_row<A, Eigen::half>(rng);
  check_multi_row<A, Eigen::bfloat16>(rng);
}

}  // namespace

TEST_CASE("simd kernels match double loops on the default architecture", "[simd]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(501);
  check_all_types<simd::default_arch>(rng);
}

#if XSIMD_WITH_SSE2
TEST_CASE("simd kernels match double loops on SSE2 (narrower batches)", "[simd]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(502);
  check_all_types<xsimd::sse2>(rng);
}
#endif

#if defined(__FMA__)
TEST_CASE("simd::fma and simd::fnma round once, whether or not the compiler contracts", "[simd]") {
  // This file is compiled with -ffp-contract=off. xsimd 8.1's AVX-512 fma is the generic x * y + z, so
  // without simd::fma's own vfmadd the AVX-512 build would round twice here. (Only an AVX-512 build can
  // fail this: xsimd's fma3<...> architectures are fused already.)
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  const float x = 1.0f + 0x1p-12f;  // x·x = 1 + 2^-11 + 2^-24: the last term is lost when x·x is rounded
  const float z = 1.0f + 0x1p-11f;
  INFO("arch " << A::name());
  CHECK(simd::fma(B(x), B(x), B(-z)).get(0) == 0x1p-24f);
  CHECK(simd::fnma(B(x), B(x), B(z)).get(0) == -0x1p-24f);
  for (std::size_t i = 0; i < B::size; ++i) CHECK(simd::fma(B(x), B(x), B(-z)).get(i) == std::fma(x, x, -z));
}

TEST_CASE("exp2 gives the bits of a scalar mirror of its arithmetic (vscalefps on AVX-512, a multiply elsewhere)",
          "[simd]") {
  // simd::exp2 reduces by vreduceps and applies 2^floor(y) by vscalefps on AVX-512, and elsewhere
  // subtracts floor(y) and multiplies by the power of two built in the exponent bits; both must be the
  // one correctly rounded p·2^n (ldexp), so that architectures with a fused multiply-add agree bit for bit.
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  const auto mirror = [](float v) {
    if (!(v >= -126.0f)) return 0.0f;  // NaN too
    const float y = std::min(v, 127.0f), n = std::floor(y), r = y - n;
    float p = 2.1702255685e-4f;
    for (const float c : {1.2439687760e-3f, 9.6788410037e-3f, 5.5483341981e-2f, 2.4022983627e-1f, 6.9314698384e-1f,
                          1.0f})
      p = std::fma(p, r, c);
    return std::ldexp(p, int(n));
  };
  auto rng = kvc::test::make_rng(503);
  std::uniform_real_distribution<float> wide(-140.0f, 130.0f), low(-127.5f, -124.0f), unit(-1.0f, 1.0f);
  long differ = 0;
  std::vector<float> in(B::size), out(B::size);
  for (int i = 0; i < 200000 / int(B::size); ++i) {
    for (std::size_t l = 0; l < B::size; ++l) {  // a different input in every lane
      const std::size_t k = std::size_t(i) * B::size + l;
      in[l] = k % 3 == 0 ? wide(rng) : k % 3 == 1 ? low(rng) : unit(rng);
    }
    if (i == 0) in[0] = -std::numeric_limits<float>::infinity();
    if (i == 1) in[B::size - 1] = std::numeric_limits<float>::infinity();
    simd::exp2<A>(B::load_unaligned(in.data())).store_unaligned(out.data());
    for (std::size_t l = 0; l < B::size; ++l) {
      const float b = mirror(in[l]);
      if (std::memcmp(&out[l], &b, sizeof b) != 0) {
        ++differ;
        UNSCOPED_INFO("2^" << in[l] << " in lane " << l << ": " << out[l] << " against " << b);
      }
    }
  }
  INFO("arch " << A::name());
  CHECK(differ == 0);
}
#endif

TEST_CASE("the SIMD scan of a head finds every NaN and Inf that the plain scan finds", "[simd][errors]") {
  using kvc::Index;
  // detail::head_finite_scan (float: SIMD, one reduction per head, prefetching) against detail::head_finite,
  // over dims with and without a SIMD tail, both layouts, and a bad element at the first, last, a
  // middle and a tail position; finite extremes (max, denormal, -0) are finite.
  const float bads[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  for (const Index d : {Index(1), Index(7), Index(16), Index(17), Index(40), Index(128)})
    for (const Index n : {Index(1), Index(5), Index(13)})
      for (const bool head_major : {true, false}) {
        const Index H = 3;
        std::vector<float> buf(static_cast<std::size_t>(H * n * d));
        for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = float(i % 11) - 5.f;
        buf[0] = std::numeric_limits<float>::max();
        buf[buf.size() / 2] = std::numeric_limits<float>::denorm_min();
        buf.back() = -0.f;
        const auto v = head_major ? kvc::make_head_major<const float>(buf.data(), H, n, d)
                                  : kvc::make_token_major<const float>(buf.data(), n, H, d);
        INFO("d " << d << " n " << n << " head-major " << head_major);
        for (Index h = 0; h < H; ++h) CHECK(kvc::detail::head_finite_scan(v, h));
        const std::pair<Index, Index> spots[] = {{0, 0}, {n - 1, d - 1}, {n / 2, d / 2}, {n - 1, d - d % 16}};
        for (const auto& [j, k] : spots)
          for (const float bad : bads)
            for (Index h = 0; h < H; ++h) {
              INFO("bad " << bad << " at head " << h << " row " << j << " element " << k);
              float& x = const_cast<float&>(v.row(h, j)[std::min(k, d - 1)]);
              const float keep = x;
              x = bad;
              for (Index other = 0; other < H; ++other) {
                CHECK(kvc::detail::head_finite_scan(v, other) == kvc::detail::head_finite(v, other));
                CHECK(kvc::detail::head_finite_scan(v, other) == (other != h));
              }
              x = keep;
            }
      }
}

TEST_CASE("gathering rows with streaming stores writes exactly the rows the plain gather writes", "[simd]") {
  using kvc::Index;
  // detail::gather_positions(..., streaming = true) (the pipeline's gathers when nothing reads the result
  // rows afterwards) against the source rows, over dims with and without a SIMD tail, both layouts,
  // unsorted and repeated positions, and destinations whose rows are aligned (streamed) or not (memcpy).
  for (const Index d : {Index(1), Index(4), Index(7), Index(16), Index(17), Index(40), Index(128)})
    for (const bool head_major : {true, false}) {
      const Index H = 2, n = 23;
      std::vector<float> buf(static_cast<std::size_t>(H * n * d));
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = float(i) * 0.25f - 7.f;
      const auto v = head_major ? kvc::make_head_major<const float>(buf.data(), H, n, d)
                                : kvc::make_token_major<const float>(buf.data(), n, H, d);
      const std::vector<Index> positions = {0, 5, 6, 22, 3, 3, 17, 1, 9, 10, 11, 12, 21};
      const Index m = static_cast<Index>(positions.size());
      for (const Index shift : {Index(0), Index(1)}) {  // floats of misalignment of the destination
        INFO("d " << d << " head-major " << head_major << " shift " << shift);
        Eigen::Matrix<float, Eigen::Dynamic, 1> storage(m * d + 16 + shift);
        storage.setConstant(-1.f);
        using RowMap = Eigen::Map<kvc::RowMatrix<float>, Eigen::Unaligned>;
        RowMap out(storage.data() + shift, m, d);
        for (const Index h : {Index(0), Index(1)}) {
          kvc::detail::gather_positions<float>(v, h, positions, out, /*streaming=*/true);
          for (Index r = 0; r < m; ++r)
            for (Index k = 0; k < d; ++k) CHECK(out(r, k) == v.row(h, positions[std::size_t(r)])[k]);
          for (Index i = m * d + shift; i < storage.size(); ++i) CHECK(storage[i] == -1.f);  // nothing past the end
          for (Index i = 0; i < shift; ++i) CHECK(storage[i] == -1.f);
        }
      }
    }
#if defined(__x86_64__) || defined(_M_X64) || defined(__SSE__)
  // The streaming path itself runs where the destination allows it: every width this build has (64-byte
  // stores for d = 16·k on AVX-512, 32-byte for 8·k on AVX, 16-byte for 4·k), declined otherwise.
  alignas(64) float dst[128 + 16];
  std::vector<float> src(128);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = float(i) + 0.5f;
  for (const Index dd : {Index(128), Index(40), Index(24), Index(12), Index(4)}) {
    INFO("d " << dd);
    std::fill(std::begin(dst), std::end(dst), -1.f);
    CHECK(kvc::detail::copy_row_streaming(src.data(), dst, dd));
    kvc::detail::streaming_done();
    for (Index k = 0; k < dd; ++k) CHECK(dst[k] == src[std::size_t(k)]);
    for (Index k = dd; k < Index(128 + 16); ++k) CHECK(dst[k] == -1.f);
  }
  CHECK_FALSE(kvc::detail::copy_row_streaming(src.data(), dst, 7));      // not a multiple of 4
  CHECK_FALSE(kvc::detail::copy_row_streaming(src.data(), dst + 1, 16));  // not aligned for any width
#endif
}

TEST_CASE("half and bfloat16 loads convert exactly", "[simd]") {
  using A = simd::default_arch;
  constexpr long S = simd::fbatch<A>::size;
  std::vector<Eigen::half> h(S + 3);
  std::vector<Eigen::bfloat16> b(S + 3);
  for (long i = 0; i < S + 3; ++i) {
    h[std::size_t(i)] = Eigen::half(float(i) * 0.37f - 2.0f);
    b[std::size_t(i)] = Eigen::bfloat16(float(i) * -1.91f + 0.5f);
  }
  for (long off = 0; off < 3; ++off) {
    const auto hb = simd::load<A>(h.data() + off);
    const auto bb = simd::load<A>(b.data() + off);
    for (long i = 0; i < S; ++i) {
      CHECK(hb.get(std::size_t(i)) == static_cast<float>(h[std::size_t(off + i)]));
      CHECK(bb.get(std::size_t(i)) == static_cast<float>(b[std::size_t(off + i)]));
    }
  }
}

namespace {

// simd::haddp: lane r = Σ lanes of row r (integer-valued floats, so every order of summation is exact
// and a permuted result cannot pass), and equal rows give bit-equal sums wherever they sit.
template <class A>
void check_haddp(std::mt19937_64& rng) {
  using B = simd::fbatch<A>;
  constexpr long S = B::size;
  B rows[S];
  std::vector<float> lanes(std::size_t(S * S));
  for (long r = 0; r < S; ++r)
    for (long l = 0; l < S; ++l) lanes[std::size_t(r * S + l)] = float(1000 * r + 3 * l + (l == r ? 7 : 0));
  for (long r = 0; r < S; ++r) rows[r] = B::load_unaligned(lanes.data() + r * S);
  alignas(64) float got[S];
  simd::haddp<A>(rows).store_aligned(got);
  for (long r = 0; r < S; ++r) {
    float want = 0.0f;
    for (long l = 0; l < S; ++l) want += lanes[std::size_t(r * S + l)];
    INFO("lanes " << S << " row " << r);
    CHECK(got[r] == want);
  }
  // One random row copied into every position: all S sums must be the same float.
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  alignas(64) float row[S];
  for (long l = 0; l < S; ++l) row[l] = u(rng);
  for (long r = 0; r < S; ++r) rows[r] = B::load_aligned(row);
  simd::haddp<A>(rows).store_aligned(got);
  double exact = 0.0;
  for (long l = 0; l < S; ++l) exact += double(row[l]);
  for (long r = 0; r < S; ++r) {
    INFO("lanes " << S << " position " << r);
    CHECK(got[r] == got[0]);
    CHECK(std::abs(double(got[r]) - exact) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("haddp sums row r into lane r, the same arithmetic for every position", "[simd]") {
  INFO("seed " << kvc::test::test_seed());
  auto rng = kvc::test::make_rng(503);
  check_haddp<simd::default_arch>(rng);
#if XSIMD_WITH_SSE2
  check_haddp<xsimd::sse2>(rng);
#endif
}
