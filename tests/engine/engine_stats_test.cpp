// Tests of the engine's sampling helpers and bootstrap statistics (no model needed).
#include <catch2/catch.hpp>

#include "engine/eval.hpp"
#include "engine/llama2.hpp"

#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <vector>

using namespace kvc::engine;

TEST_CASE("softmax and log_softmax in double", "[engine][sampling]") {
  const std::vector<float> logits = {1.0f, -2.0f, 0.5f, 3.0f, 3.0f};
  const std::vector<double> p = softmax(logits);
  const std::vector<double> lp = log_softmax(logits);
  double sum = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    sum += p[i];
    CHECK(std::exp(lp[i]) == Approx(p[i]).epsilon(1e-14));
  }
  CHECK(sum == Approx(1.0).epsilon(1e-15));
  // Direct formula: p_i = e^{x_i} / sum_j e^{x_j} (small logits, no overflow).
  double z = 0;
  for (const float x : logits) z += std::exp(static_cast<double>(x));
  for (std::size_t i = 0; i < p.size(); ++i) CHECK(p[i] == Approx(std::exp(static_cast<double>(logits[i])) / z).epsilon(1e-14));
  // Temperature divides the logits.
  std::vector<float> halved;
  for (const float x : logits) halved.push_back(x / 2);
  const std::vector<double> pt = softmax(logits, 2.0);
  const std::vector<double> ph = softmax(halved);
  for (std::size_t i = 0; i < p.size(); ++i) CHECK(pt[i] == Approx(ph[i]).epsilon(1e-14));
  // Large logits do not overflow.
  const std::vector<double> big = log_softmax(std::vector<float>{1000.0f, 0.0f});
  CHECK(big[0] == Approx(0.0).margin(1e-12));
  CHECK(big[1] == Approx(-1000.0).epsilon(1e-12));
  CHECK(argmax(logits) == 3);  // first of the tied maxima
  CHECK(argmax(std::vector<double>{0.1, 0.7, 0.7}) == 1);
}

TEST_CASE("categorical sampling is an exact inverse CDF", "[engine][sampling]") {
  const std::vector<double> p = {0.0, 0.2, 0.0, 0.5, 0.3, 0.0};
  CHECK(sample_categorical(p, 0.0) == 1);
  CHECK(sample_categorical(p, 0.1999) == 1);
  CHECK(sample_categorical(p, 0.2001) == 3);
  CHECK(sample_categorical(p, 0.6999) == 3);
  CHECK(sample_categorical(p, 0.7001) == 4);
  CHECK(sample_categorical(p, 0.9999999) == 4);
  // Unnormalised weights work the same.
  CHECK(sample_categorical({0.0, 2.0, 0.0, 5.0, 3.0}, 0.75) == 4);

  std::mt19937_64 rng(123);
  std::vector<int> counts(p.size(), 0);
  const int draws = 200000;
  for (int k = 0; k < draws; ++k) ++counts[static_cast<std::size_t>(sample_categorical(p, uniform01(rng)))];
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double expected = p[i] * draws;
    const double sigma = std::sqrt(draws * p[i] * (1 - p[i]));
    INFO("category " << i);
    CHECK(std::abs(counts[i] - expected) <= 5 * sigma + 1e-9);
  }
  for (int k = 0; k < 1000; ++k) {
    const double u = uniform01(rng);
    CHECK(u >= 0.0);
    CHECK(u < 1.0);
    const std::uint64_t j = uniform_index(rng, 7);
    CHECK(j < 7u);
  }
  CHECK(uniform_index(rng, 1) == 0u);
}

TEST_CASE("sample(): temperature 0 is argmax without a draw; otherwise one seeded draw", "[engine][sampling]") {
  const std::vector<float> logits = {0.3f, 2.0f, -1.0f, 1.5f};
  std::mt19937_64 a(9), b(9);
  CHECK(sample(logits, 0.0, a) == 1);
  CHECK(a() == b());  // no draw consumed
  std::mt19937_64 c(77), d(77);
  for (int k = 0; k < 50; ++k) {
    const int got = sample(logits, 0.8, c);
    const int want = sample_categorical(softmax(logits, 0.8), uniform01(d));
    CHECK(got == want);
  }
}

TEST_CASE("bootstrap interval of a mean", "[engine][bootstrap]") {
  const std::uint64_t seed = 2024;
  std::cout << "bootstrap test seed " << seed << std::endl;
  const Interval constant = bootstrap_mean(std::vector<double>(10, 0.25), seed);
  CHECK(constant.mean == 0.25);
  CHECK(constant.lo == 0.25);
  CHECK(constant.hi == 0.25);

  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(1.0, 2.0);
  std::vector<double> x(400);
  for (double& v : x) v = normal(rng);
  double mean = 0;
  for (const double v : x) mean += v;
  mean /= static_cast<double>(x.size());
  double var = 0;
  for (const double v : x) var += (v - mean) * (v - mean);
  var /= static_cast<double>(x.size() - 1);
  const Interval ci = bootstrap_mean(x, seed);
  CHECK(ci.mean == Approx(mean).epsilon(1e-14));
  CHECK(ci.lo < mean);
  CHECK(ci.hi > mean);
  // Close to the normal-theory interval mean ± 1.96 sd / sqrt(n).
  const double half = 1.96 * std::sqrt(var / static_cast<double>(x.size()));
  CHECK((ci.hi - ci.lo) / 2 == Approx(half).epsilon(0.15));
  CHECK((ci.hi + ci.lo) / 2 == Approx(mean).margin(0.3 * half));
  // Deterministic for a seed; a narrower level gives a nested interval.
  const Interval again = bootstrap_mean(x, seed);
  CHECK(again.lo == ci.lo);
  CHECK(again.hi == ci.hi);
  const Interval narrow = bootstrap_mean(x, seed, 1000, 0.5);
  CHECK(narrow.lo > ci.lo);
  CHECK(narrow.hi < ci.hi);
  CHECK_THROWS_AS(bootstrap_mean({}, seed), std::invalid_argument);
  CHECK_THROWS_AS(bootstrap_mean(x, seed, 0), std::invalid_argument);
  CHECK_THROWS_AS(bootstrap_mean(x, seed, 1000, 1.0), std::invalid_argument);
}

TEST_CASE("paired bootstrap differences remove the shared per-sequence variation", "[engine][bootstrap]") {
  const std::uint64_t seed = 5;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> wide(0.0, 10.0), tiny(0.0, 0.01);
  std::vector<double> a(24), b(24);
  for (std::size_t i = 0; i < a.size(); ++i) {
    b[i] = wide(rng);
    a[i] = b[i] + 0.1 + tiny(rng);  // a is worse by 0.1 on every sequence
  }
  const Interval d = bootstrap_paired_difference(a, b, seed);
  CHECK(d.lo > 0.0);
  CHECK(d.lo < 0.1);
  CHECK(d.hi > 0.1);
  CHECK(d.hi - d.lo < 0.05);
  const Interval ia = bootstrap_mean(a, seed);
  const Interval ib = bootstrap_mean(b, seed);
  CHECK(ia.lo < ib.hi);  // unpaired intervals overlap: the difference is invisible without pairing
  // Integer-valued shift: exact.
  const Interval exact = bootstrap_paired_difference({3, 4, 5}, {1, 2, 3}, seed);
  CHECK(exact.mean == 2.0);
  CHECK(exact.lo == 2.0);
  CHECK(exact.hi == 2.0);
  CHECK_THROWS_AS(bootstrap_paired_difference({1, 2}, {1}, seed), std::invalid_argument);
}
