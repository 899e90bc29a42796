// SPEC §12 evaluation protocol: sampled sequences, teacher-forced KL / top-1 / ΔNLL against the full
// cache, bootstrap intervals and paired differences. Independent of any compression method.
#pragma once

#include "llama2.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::engine {

/// SPEC §12 defaults.
struct ProtocolDefaults {
  static constexpr int kNumSequences = 24;
  static constexpr int kSequenceLength = 512;
  static constexpr int kPrefix = 384;
  static constexpr int kWindow = 32;
  static constexpr int kBootstrapResamples = 1000;
};

/// Samples `num_sequences` sequences of `length` tokens (length >= 1, <= seq_len). Each starts with
/// BOS (id 1); the other tokens are drawn one by one at `temperature` with sample(), feeding every
/// drawn token back, including BOS/EOS (no early stop), so every sequence has the full length.
/// Sequence i uses its own std::mt19937_64 seeded by std::seed_seq{seed low 32 bits, seed high 32
/// bits, i}, so sequence i does not depend on num_sequences; both are specified by the C++ standard,
/// and the draw itself is uniform01 + inverse CDF, so the output is the same on every standard library.
inline std::vector<std::vector<int>> sample_sequences(const Model& model, int num_sequences, int length,
                                                      std::uint64_t seed, double temperature = 1.0) {
  if (num_sequences < 0) throw std::invalid_argument("kvc::engine: num_sequences must be >= 0");
  if (length < 1 || length > model.config().seq_len) {
    throw std::invalid_argument("kvc::engine: sequence length " + std::to_string(length) + " outside [1, seq_len = " +
                                std::to_string(model.config().seq_len) + "]");
  }
  std::vector<std::vector<int>> out;
  out.reserve(static_cast<std::size_t>(num_sequences));
  Session session(model);
  for (int s = 0; s < num_sequences; ++s) {
    std::seed_seq sseq{static_cast<std::uint32_t>(seed & 0xFFFFFFFFu), static_cast<std::uint32_t>(seed >> 32),
                       static_cast<std::uint32_t>(s)};
    std::mt19937_64 rng(sseq);
    session.reset();
    std::vector<int> seq{Tokenizer::kBos};
    seq.reserve(static_cast<std::size_t>(length));
    while (static_cast<int>(seq.size()) < length) {
      const std::vector<float> logits = session.forward(seq.back());
      seq.push_back(sample(logits, temperature, rng));
    }
    out.push_back(std::move(seq));
  }
  return out;
}

/// Which metric of SequenceMetrics to read.
enum class Metric { kKl, kTop1, kDeltaNll };

/// Means over the scored steps of one sequence.
struct SequenceMetrics {
  double kl = 0;         ///< mean KL(full || compressed) in nats
  double top1 = 0;       ///< fraction of steps where both argmaxes agree (first index on ties)
  double delta_nll = 0;  ///< mean of NLL_compressed(x_t) - NLL_full(x_t)
  std::ptrdiff_t steps = 0;

  double get(Metric m) const { return m == Metric::kKl ? kl : (m == Metric::kTop1 ? top1 : delta_nll); }
};

struct EvalResult {
  std::vector<SequenceMetrics> per_sequence;
  double mean_kl = 0, mean_top1 = 0, mean_delta_nll = 0;  ///< means over sequences
  std::ptrdiff_t peak_entries = 0;  ///< the most entries any KV head of any layer held, over sequences
  double compressions = 0;          ///< layer compressions per sequence and layer, mean over sequences
  double pages_freed = 0;           ///< pages a paged cache gave back per sequence, mean over sequences
  std::vector<double> mean_kl_by_step;                     ///< [steps] KL per step, mean over sequences

  /// The per-sequence values of one metric (input to the bootstrap helpers).
  std::vector<double> values(Metric m) const {
    std::vector<double> v;
    v.reserve(per_sequence.size());
    for (const SequenceMetrics& s : per_sequence) v.push_back(s.get(m));
    return v;
  }
};

/// Settings of the teacher-forced comparison.
struct EvalConfig {
  std::ptrdiff_t prefix = ProtocolDefaults::kPrefix;  ///< P tokens prefilled, then compressed
  std::ptrdiff_t window = ProtocolDefaults::kWindow;  ///< W window queries recorded for the compressor
  bool include_prefill_prediction = true;             ///< score the prediction of x_P (see below)
  bool batched_prefill = true;
  /// > 0: the prefix is fed in chunks of this many tokens (the full-cache reference too), and the
  /// cache compressed after each (Compression::chunked) instead of once after the prefix.
  std::ptrdiff_t prefill_chunk = 0;
  /// > 0: the compressed runs keep their cache in pages of this many entries (Session's paged cache).
  std::ptrdiff_t page_size = 0;
};

/// How a run compresses the cache. `once`: after an unchunked prefix (Session::compress). `chunked`:
/// after every chunk of a chunked prefix. `decoding`: after every token fed after the prefix. The last
/// two make one engine::CacheCompressor per sequence (it counts steps). Empty members do nothing.
struct Compression {
  LayerCompressor once;
  std::function<CacheCompressor()> chunked;
  std::function<CacheCompressor()> decoding;
};

/// What one compressed run did.
struct RunStats {
  std::ptrdiff_t peak_entries = 0;  ///< Session::peak_length()
  std::ptrdiff_t compressions = 0;  ///< Session::compressions()
  std::ptrdiff_t pages_freed = 0;   ///< Session::pages_freed()
};

/// Teacher-forced comparison of a compressed cache with the full cache on fixed sequences.
///
/// Convention (sequence x_0 .. x_{L-1}, prefix P, 1 <= P < L):
///  - prefill(x_0 .. x_{P-1}) with window W, then session.compress(fn) (the reference skips this);
///    with a prefill chunk C, the prefix is fed C tokens at a time, compressed after each chunk;
///  - a decoding compression runs after every token fed after the prefix;
///  - the prediction for continuation token x_t (t = P .. L-1) is log_softmax of the logits returned
///    after feeding x_{t-1}: for t = P these are prefill()'s logits, computed before compression, so
///    this step is identical for every method (KL 0, same top-1, ΔNLL 0) and is counted only when
///    include_prefill_prediction (default true, as the protocol asks); for t > P they come from
///    forward(x_{t-1}) over the compressed cache, appended at RoPE position next_position + (t-1-P);
///  - so steps() = L - P scored predictions (L - P - 1 without the prefill prediction). x_{L-1} is
///    only a target; nothing is predicted after it.
/// Per step: KL = Σ_v p_v (log p_v - log q_v) with p = full, q = compressed, in double;
/// top-1 = [argmax p == argmax q]; ΔNLL = log p(x_t) - log q(x_t). Each sequence reports the mean over
/// its steps; EvalResult means are over sequences (each sequence weighs the same).
/// The full-cache log-probabilities are computed once (lazily) and reused by every evaluate() call.
class TeacherForcedEval {
 public:
  TeacherForcedEval(const Model& model, std::vector<std::vector<int>> sequences, EvalConfig config = {})
      : model_(&model), sequences_(std::move(sequences)), config_(config) {
    if (sequences_.empty()) throw std::invalid_argument("kvc::engine: TeacherForcedEval needs at least one sequence");
    const std::size_t L = sequences_[0].size();
    if (config_.prefix < 1 || config_.prefix >= static_cast<std::ptrdiff_t>(L)) {
      throw std::invalid_argument("kvc::engine: prefix " + std::to_string(config_.prefix) + " outside [1, length = " +
                                  std::to_string(L) + ")");
    }
    if (static_cast<std::ptrdiff_t>(L) > model.config().seq_len) {
      throw std::invalid_argument("kvc::engine: sequence length " + std::to_string(L) + " exceeds seq_len " +
                                  std::to_string(model.config().seq_len));
    }
    if (config_.window < 0) throw std::invalid_argument("kvc::engine: window must be >= 0");
    if (config_.prefill_chunk < 0) throw std::invalid_argument("kvc::engine: prefill_chunk must be >= 0");
    for (std::size_t s = 0; s < sequences_.size(); ++s) {
      if (sequences_[s].size() != L) {
        throw std::invalid_argument("kvc::engine: sequence " + std::to_string(s) + " has length " +
                                    std::to_string(sequences_[s].size()) + ", expected " + std::to_string(L));
      }
      for (const int t : sequences_[s]) {
        if (t < 0 || t >= model.config().vocab_size) {
          throw std::invalid_argument("kvc::engine: sequence " + std::to_string(s) + " holds token id " + std::to_string(t));
        }
      }
    }
  }

  const std::vector<std::vector<int>>& sequences() const { return sequences_; }
  const EvalConfig& config() const { return config_; }
  std::ptrdiff_t length() const { return static_cast<std::ptrdiff_t>(sequences_[0].size()); }
  /// Scored predictions per sequence.
  std::ptrdiff_t steps() const { return length() - config_.prefix - (config_.include_prefill_prediction ? 0 : 1); }

  /// Full-cache log-probabilities of sequence s, [steps][vocab] row-major.
  const std::vector<double>& reference_log_probs(std::size_t s) {
    ensure_reference();
    return reference_.at(s);
  }

  /// Log-probabilities [steps][vocab] of sequence s under `fn` (nullptr = no compression).
  std::vector<double> log_probs(std::size_t s, const LayerCompressor* fn) const {
    Compression plan;
    if (fn != nullptr) plan.once = *fn;
    return log_probs(s, plan);
  }

  /// Log-probabilities [steps][vocab] of sequence s under `plan`; `stats` (optional) gets what it did.
  std::vector<double> log_probs(std::size_t s, const Compression& plan, RunStats* stats = nullptr) const {
    const std::vector<int>& seq = sequences_.at(s);
    const std::ptrdiff_t P = config_.prefix;
    const std::ptrdiff_t L = length();
    const std::ptrdiff_t V = model_->config().vocab_size;
    const std::ptrdiff_t C = config_.prefill_chunk;
    if (C > 0 && plan.once)
      throw std::invalid_argument("kvc::engine: a chunked prefill compresses after each chunk (Compression::chunked), not once");
    if (C <= 0 && plan.chunked)
      throw std::invalid_argument("kvc::engine: Compression::chunked needs EvalConfig::prefill_chunk > 0");
    Session session(*model_, 0, config_.page_size);
    const std::vector<int> prefix(seq.begin(), seq.begin() + P);
    std::vector<float> logits;
    if (C > 0 || plan.decoding) session.keep_queries(config_.window);
    if (C > 0) {
      const CacheCompressor chunked = plan.chunked ? plan.chunked() : CacheCompressor();
      for (std::ptrdiff_t at = 0; at < P; at += C) {
        logits = session.feed(std::vector<int>(prefix.begin() + at, prefix.begin() + std::min(P, at + C)));
        if (chunked) session.compress_grown(chunked);
      }
    } else {
      logits = session.prefill(prefix, config_.window, config_.batched_prefill);
      if (plan.once) session.compress(plan.once);
    }
    const CacheCompressor decoding = plan.decoding ? plan.decoding() : CacheCompressor();
    std::vector<double> out;
    out.reserve(static_cast<std::size_t>(steps() * V));
    if (config_.include_prefill_prediction) {
      const std::vector<double> lp = log_softmax(logits);
      out.insert(out.end(), lp.begin(), lp.end());
    }
    for (std::ptrdiff_t t = P + 1; t < L; ++t) {  // predicts x_t from x_{t-1}
      logits = session.forward(seq[static_cast<std::size_t>(t - 1)]);
      if (decoding) session.compress_grown(decoding);
      const std::vector<double> lp = log_softmax(logits);
      out.insert(out.end(), lp.begin(), lp.end());
    }
    if (stats) *stats = {session.peak_length(), session.compressions(), session.pages_freed()};
    return out;
  }

  /// Runs every sequence with `fn` and compares it with the cached full-cache reference.
  EvalResult evaluate(const LayerCompressor& fn) {
    Compression plan;
    plan.once = fn;
    return evaluate(plan);
  }

  /// Runs every sequence with `plan` and compares it with the cached full-cache reference.
  EvalResult evaluate(const Compression& plan) {
    ensure_reference();
    const std::ptrdiff_t V = model_->config().vocab_size;
    const std::ptrdiff_t C = steps();
    const std::ptrdiff_t first_target = config_.prefix + (config_.include_prefill_prediction ? 0 : 1);
    EvalResult result;
    result.mean_kl_by_step.assign(static_cast<std::size_t>(C), 0.0);
    for (std::size_t s = 0; s < sequences_.size(); ++s) {
      RunStats stats;
      const std::vector<double> q = log_probs(s, plan, &stats);
      result.peak_entries = std::max(result.peak_entries, stats.peak_entries);
      result.pages_freed += static_cast<double>(stats.pages_freed) / static_cast<double>(sequences_.size());
      result.compressions += static_cast<double>(stats.compressions) /
                             (static_cast<double>(model_->config().n_layers) * static_cast<double>(sequences_.size()));
      const std::vector<double>& p = reference_[s];
      SequenceMetrics m;
      m.steps = C;
      for (std::ptrdiff_t c = 0; c < C; ++c) {
        const double* lp = p.data() + c * V;
        const double* lq = q.data() + c * V;
        double kl = 0;
        std::ptrdiff_t ap = 0, aq = 0;
        for (std::ptrdiff_t v = 0; v < V; ++v) {
          kl += std::exp(lp[v]) * (lp[v] - lq[v]);
          if (lp[v] > lp[ap]) ap = v;
          if (lq[v] > lq[aq]) aq = v;
        }
        const int target = sequences_[s][static_cast<std::size_t>(first_target + c)];
        m.kl += kl;
        m.top1 += (ap == aq) ? 1.0 : 0.0;
        m.delta_nll += lp[target] - lq[target];
        result.mean_kl_by_step[static_cast<std::size_t>(c)] += kl;
      }
      if (C > 0) {
        m.kl /= static_cast<double>(C);
        m.top1 /= static_cast<double>(C);
        m.delta_nll /= static_cast<double>(C);
      }
      result.per_sequence.push_back(m);
    }
    const double n = static_cast<double>(sequences_.size());
    for (const SequenceMetrics& m : result.per_sequence) {
      result.mean_kl += m.kl / n;
      result.mean_top1 += m.top1 / n;
      result.mean_delta_nll += m.delta_nll / n;
    }
    for (double& k : result.mean_kl_by_step) k /= n;
    return result;
  }

 private:
  void ensure_reference() {
    if (!reference_.empty()) return;
    std::vector<std::vector<double>> ref;
    ref.reserve(sequences_.size());
    for (std::size_t s = 0; s < sequences_.size(); ++s) ref.push_back(log_probs(s, Compression{}));
    reference_ = std::move(ref);
  }

  const Model* model_;
  std::vector<std::vector<int>> sequences_;
  EvalConfig config_;
  std::vector<std::vector<double>> reference_;
};

/// A mean with a bootstrap confidence interval.
struct Interval {
  double mean = 0;
  double lo = 0;
  double hi = 0;
};

/// Percentile-method bootstrap interval of the mean of `values` (non-empty): `resamples` resamples of
/// size N drawn with replacement by uniform_index on std::mt19937_64(seed); the bounds are the
/// (1-level)/2 and 1-(1-level)/2 quantiles of the resampled means, linear interpolation between order
/// statistics at h = (resamples-1)·q. O(resamples · N).
inline Interval bootstrap_mean(const std::vector<double>& values, std::uint64_t seed,
                               int resamples = ProtocolDefaults::kBootstrapResamples, double level = 0.95) {
  if (values.empty()) throw std::invalid_argument("kvc::engine: bootstrap_mean needs at least one value");
  if (resamples < 1) throw std::invalid_argument("kvc::engine: bootstrap resamples must be >= 1");
  if (!(level > 0 && level < 1)) throw std::invalid_argument("kvc::engine: bootstrap level must be in (0, 1)");
  const std::size_t n = values.size();
  Interval out;
  for (const double v : values) out.mean += v;
  out.mean /= static_cast<double>(n);
  std::mt19937_64 rng(seed);
  std::vector<double> means(static_cast<std::size_t>(resamples));
  for (double& m : means) {
    double sum = 0;
    for (std::size_t k = 0; k < n; ++k) sum += values[static_cast<std::size_t>(uniform_index(rng, n))];
    m = sum / static_cast<double>(n);
  }
  std::sort(means.begin(), means.end());
  auto quantile = [&](double q) {
    const double h = static_cast<double>(means.size() - 1) * q;
    const std::size_t lo = static_cast<std::size_t>(std::floor(h));
    const std::size_t hi = std::min(lo + 1, means.size() - 1);
    return means[lo] + (h - static_cast<double>(lo)) * (means[hi] - means[lo]);
  };
  out.lo = quantile((1 - level) / 2);
  out.hi = quantile(1 - (1 - level) / 2);
  return out;
}

/// Bootstrap interval of the mean paired difference a_i - b_i (same sequences, same order).
inline Interval bootstrap_paired_difference(const std::vector<double>& a, const std::vector<double>& b,
                                            std::uint64_t seed, int resamples = ProtocolDefaults::kBootstrapResamples,
                                            double level = 0.95) {
  if (a.size() != b.size()) {
    throw std::invalid_argument("kvc::engine: paired difference needs equal sizes, got " + std::to_string(a.size()) +
                                " and " + std::to_string(b.size()));
  }
  std::vector<double> d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return bootstrap_mean(d, seed, resamples, level);
}

}  // namespace kvc::engine
