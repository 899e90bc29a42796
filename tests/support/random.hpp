// tests/support/random.hpp — seeded random test data (seed printed and overridable via KVC_TEST_SEED).
//
// Usage in a test:
//   INFO("seed " << kvc::test::test_seed());
//   auto rng = kvc::test::make_rng(/*stream=*/1);
//   auto K = kvc::test::random_tensor(rng, Hkv, n, d, 1.0);
#pragma once

#include "reference.hpp"

#include <Eigen/Core>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::test {

/// Seed used when KVC_TEST_SEED is not set.
inline constexpr std::uint64_t kDefaultSeed = 20240601ULL;

/// The run's seed: KVC_TEST_SEED (decimal, or hex with 0x) if set and non-empty, else kDefaultSeed.
/// A malformed value throws std::invalid_argument rather than silently using another seed.
inline std::uint64_t test_seed() {
  const char* env = std::getenv("KVC_TEST_SEED");
  if (env == nullptr || *env == '\0') return kDefaultSeed;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(env, &end, 0);
  if (end == env || *end != '\0')
    throw std::invalid_argument(std::string("KVC_TEST_SEED is not an integer: ") + env);
  return static_cast<std::uint64_t>(v);
}

/// Independent generator for one test/stream, derived from test_seed() and `stream`, so tests do not
/// perturb each other's data when one of them draws more numbers.
inline std::mt19937_64 make_rng(std::uint64_t stream = 0) {
  const std::uint64_t s = test_seed();
  std::seed_seq seq{static_cast<std::uint32_t>(s), static_cast<std::uint32_t>(s >> 32),
                    static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32)};
  return std::mt19937_64(seq);
}

/// [H][n][d] tensor with i.i.d. N(mean, scale²) entries. With q, k ~ N(0, σ²) and logit scale 1/sqrt(d),
/// logits are ~N(0, σ⁴): σ = 1 gives mild attention, σ ≈ 2 sharp attention.
inline kvc::ref::Tensor3 random_tensor(std::mt19937_64& rng, long H, long n, long d, double scale = 1.0,
                                       double mean = 0.0) {
  kvc::ref::Tensor3 T(H, n, d);
  std::normal_distribution<double> dist(mean, scale);
  for (double& x : T.data) x = dist(rng);
  return T;
}

/// [H][n][d] tensor with i.i.d. U(lo, hi) entries.
inline kvc::ref::Tensor3 random_uniform_tensor(std::mt19937_64& rng, long H, long n, long d, double lo,
                                               double hi) {
  kvc::ref::Tensor3 T(H, n, d);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (double& x : T.data) x = dist(rng);
  return T;
}

/// (rows,cols) matrix with i.i.d. N(0, scale²) entries.
inline Eigen::MatrixXd random_matrix(std::mt19937_64& rng, long rows, long cols, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  Eigen::MatrixXd M(rows, cols);
  for (long c = 0; c < cols; ++c)
    for (long r = 0; r < rows; ++r) M(r, c) = dist(rng);
  return M;
}

/// Sizes around the SIMD widths (1, 3, 7, N−1, N, N+1 for N = 8, 16, 32, 64, and 2N+2 for N = 64):
/// use for n and d in tests of vectorised kernels.
inline std::vector<long> awkward_sizes() { return {1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 130}; }

/// awkward_sizes() restricted to [lo, hi].
inline std::vector<long> awkward_sizes(long lo, long hi) {
  std::vector<long> out;
  for (long s : awkward_sizes())
    if (s >= lo && s <= hi) out.push_back(s);
  return out;
}

}  // namespace kvc::test
