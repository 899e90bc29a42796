// The recall task (docs/recall.md): story filler with retrieval facts inserted, a question at the end,
// and exact-match accuracy of the answer over a full or compressed cache. Independent of any
// compression method; the token format is the one examples/recall/train_recall_model.py trains on.
#pragma once

#include "eval.hpp"
#include "llama2.hpp"

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::engine {

/// tok512 ids of the task's tokens: bytes that TinyStories text never uses (id = byte + 3).
struct RecallTokens {
  static constexpr int kFact = 4, kArrow = 5, kEnd = 6, kQuery = 7, kPass = 8, kPassQuery = 9, kHopQuery = 10,
                       kLink = 11;
  static constexpr int kFirstDigit = 3 + 0x30, kDigits = 10;  ///< '0'..'9'
  static constexpr int kFirstKey = 3 + 0x80, kKeys = 64;      ///< bytes 0x80..0xBF
  static constexpr int kFirstValue = 3 + 0xC0, kValues = 64;  ///< bytes 0xC0..0xFF
  /// True for an id the task reserves (removed from the filler).
  static bool reserved(int id) {
    return (id >= kFact && id <= kLink) || (id >= kFirstDigit && id < kFirstDigit + kDigits) ||
           (id >= kFirstKey && id < kFirstValue + kValues);
  }
};

/// What a question asks for.
enum class RecallKind { kFact = 0, kPasskey = 1, kHop = 2 };
inline const char* recall_kind_name(RecallKind k) {
  return k == RecallKind::kFact ? "fact" : (k == RecallKind::kPasskey ? "passkey" : "hop");
}

/// One task: context (starts with BOS, holds every fact), then the question, then the answer
/// (the answer tokens and END). context + question + answer have the task's length.
struct RecallTask {
  RecallKind kind = RecallKind::kFact;
  std::vector<int> context, question, answer;
};

/// When the cache is compressed. `kQuestionLast`: after the context and the question but its last
/// token (that token is fed over the compressed cache and predicts the first answer token), as
/// question-aware evaluations do. `kQuestionLater`: after the context alone, before the question.
enum class RecallSetting { kQuestionLast, kQuestionLater };
inline const char* recall_setting_name(RecallSetting s) {
  return s == RecallSetting::kQuestionLast ? "question-last" : "question-later";
}

/// A stream of filler tokens: `stories` sequences of the model's full length sampled as
/// sample_sequences(model, stories, seq_len, seed) and concatenated, the task's reserved ids removed.
inline std::vector<int> recall_filler(const Model& story_model, int stories, std::uint64_t seed) {
  std::vector<int> out;
  for (const auto& s : sample_sequences(story_model, stories, story_model.config().seq_len, seed))
    for (const int t : s)
      if (!RecallTokens::reserved(t)) out.push_back(t);
  return out;
}

/// Facts per task of `length` tokens: 8 from length 1024 on, else length / 48 (at least 1).
inline int recall_facts(int length) { return length >= 1024 ? 8 : std::max(1, std::min(16, length / 48)); }

/// `n` tasks of `length` tokens from `filler` (each a window of it at a random offset). Task i asks a
/// question of kind i % 3; it draws from std::mt19937_64 seeded by std::seed_seq{seed low, seed high,
/// i}, so task i does not depend on n. The context holds recall_facts(length) facts `FACT k v1 v2 END`
/// (keys distinct, values distinct), a passkey `PASS d1..d5 END` (digits distinct), and a link `LINK a b END` in the first half of the
/// filler whose fact `FACT b c1 c2 END` comes later, at random places in the filler. Questions:
/// `QUERY k FACT k` (answer v1 v2 END), `PASSQ PASS` (d1..d5 END), `HOPQ a LINK a` (b FACT b c1 c2
/// END: the key it passes through, then that key's fact, as a fact question asks it); each ends in the
/// item it asks about as the context wrote it.
inline std::vector<RecallTask> make_recall_tasks(const std::vector<int>& filler, int n, int length, std::uint64_t seed) {
  using T = RecallTokens;
  if (n < 0) throw std::invalid_argument("kvc::engine: recall task count must be >= 0");
  const int facts = recall_facts(length);
  const int fact_tokens = 5 * facts + 7 + 4 + 5;  // facts, passkey, link, the hop's fact
  const int longest_query = 4 + 6;                // HOPQ a LINK a, b FACT b c1 c2 END
  const int min_fill = 8;
  if (length < 1 + fact_tokens + longest_query + min_fill)
    throw std::invalid_argument("kvc::engine: recall length " + std::to_string(length) + " is below the shortest task (" +
                                std::to_string(1 + fact_tokens + longest_query + min_fill) + " tokens)");
  std::vector<RecallTask> tasks;
  tasks.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    std::seed_seq sseq{static_cast<std::uint32_t>(seed & 0xFFFFFFFFu), static_cast<std::uint32_t>(seed >> 32),
                       static_cast<std::uint32_t>(i)};
    std::mt19937_64 rng(sseq);
    auto pick = [&rng](int count) { return static_cast<int>(uniform_index(rng, static_cast<std::uint64_t>(count))); };
    // The first `count` entries of a random permutation of first .. first + total - 1.
    auto distinct = [&pick](int first, int total, int count) {
      std::vector<int> v(static_cast<std::size_t>(total));
      for (int k = 0; k < total; ++k) v[static_cast<std::size_t>(k)] = first + k;
      for (int k = 0; k < count; ++k) std::swap(v[static_cast<std::size_t>(k)], v[static_cast<std::size_t>(k + pick(total - k))]);
      v.resize(static_cast<std::size_t>(count));
      return v;
    };
    const std::vector<int> keys = distinct(T::kFirstKey, T::kKeys, facts + 2);
    const std::vector<int> values = distinct(T::kFirstValue, T::kValues, 2 * facts + 2);
    std::vector<std::vector<int>> items;
    for (int f = 0; f < facts; ++f)
      items.push_back({T::kFact, keys[static_cast<std::size_t>(f)], values[static_cast<std::size_t>(2 * f)],
                       values[static_cast<std::size_t>(2 * f + 1)], T::kEnd});
    const std::vector<int> digits = distinct(T::kFirstDigit, T::kDigits, 5);
    std::vector<int> pass{T::kPass};
    pass.insert(pass.end(), digits.begin(), digits.end());
    pass.push_back(T::kEnd);
    items.push_back(pass);
    const int a = keys[static_cast<std::size_t>(facts)], b = keys[static_cast<std::size_t>(facts + 1)];
    const int c1 = values[static_cast<std::size_t>(2 * facts)], c2 = values[static_cast<std::size_t>(2 * facts + 1)];
    RecallTask task;
    task.kind = static_cast<RecallKind>(i % 3);
    if (task.kind == RecallKind::kFact) {
      const std::vector<int>& f = items[static_cast<std::size_t>(pick(facts))];
      task.question = {T::kQuery, f[1], T::kFact, f[1]};
      task.answer = {f[2], f[3], T::kEnd};
    } else if (task.kind == RecallKind::kPasskey) {
      task.question = {T::kPassQuery, T::kPass};
      task.answer = digits;
      task.answer.push_back(T::kEnd);
    } else {
      task.question = {T::kHopQuery, a, T::kLink, a};
      task.answer = {b, T::kFact, b, c1, c2, T::kEnd};
    }
    const int n_fill = length - 1 - fact_tokens - static_cast<int>(task.question.size() + task.answer.size());
    if (static_cast<int>(filler.size()) <= n_fill)
      throw std::invalid_argument("kvc::engine: recall filler of " + std::to_string(filler.size()) +
                                  " tokens is too short for tasks of " + std::to_string(length));
    const int start = pick(static_cast<int>(filler.size()) - n_fill);
    // Insertion points in [0, n_fill]: the items in random order at sorted random cuts, the link in
    // the first half, the hop's fact after the link.
    struct Event {
      int at, rank;
      std::vector<int> tokens;
    };
    std::vector<Event> events;
    std::vector<int> order(items.size()), cuts(items.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int>(k);
    for (std::size_t k = order.size(); k > 1; --k) std::swap(order[k - 1], order[static_cast<std::size_t>(pick(static_cast<int>(k)))]);
    for (int& c : cuts) c = pick(n_fill + 1);
    std::sort(cuts.begin(), cuts.end());
    for (std::size_t k = 0; k < items.size(); ++k) events.push_back({cuts[k], 1, items[static_cast<std::size_t>(order[k])]});
    const int link_at = pick(n_fill / 2 + 1);
    events.push_back({link_at, 0, {T::kLink, a, b, T::kEnd}});
    events.push_back({link_at + pick(n_fill - link_at + 1), 2, {T::kFact, b, c1, c2, T::kEnd}});
    std::stable_sort(events.begin(), events.end(),
                     [](const Event& x, const Event& y) { return x.at != y.at ? x.at < y.at : x.rank < y.rank; });
    task.context.reserve(static_cast<std::size_t>(length));
    task.context.push_back(Tokenizer::kBos);
    int at = 0;
    const auto fill = filler.begin() + start;
    for (const Event& e : events) {
      task.context.insert(task.context.end(), fill + at, fill + e.at);
      at = e.at;
      task.context.insert(task.context.end(), e.tokens.begin(), e.tokens.end());
    }
    task.context.insert(task.context.end(), fill + at, fill + n_fill);
    tasks.push_back(std::move(task));
  }
  return tasks;
}

/// Whether the model answers `task` exactly under each of `fns`: every answer token is the argmax of
/// the logits before it (teacher forcing; equal to greedy decoding's exact match). A null entry is the
/// full cache; any other compresses every layer once, at the point `setting` names, with `window`
/// observation queries. The prefill runs once and each entry continues from a copy of it. `stats`
/// (optional) gets, per entry, what its run did.
inline std::vector<bool> recall_hits(const Model& model, const RecallTask& task, RecallSetting setting,
                                     std::ptrdiff_t window, const std::vector<const LayerCompressor*>& fns,
                                     std::vector<RunStats>* stats = nullptr) {
  if (task.question.empty() || task.answer.empty() || task.context.empty())
    throw std::invalid_argument("kvc::engine: a recall task needs a context, a question and an answer");
  Session prefilled(model);
  std::vector<int> prompt = task.context, rest = task.question;
  if (setting == RecallSetting::kQuestionLast) {
    prompt.insert(prompt.end(), task.question.begin(), task.question.end() - 1);
    rest = {task.question.back()};
  }
  prefilled.prefill(prompt, window);
  std::vector<bool> hits;
  if (stats) stats->clear();
  for (const LayerCompressor* fn : fns) {
    Session session = prefilled;
    if (fn != nullptr) session.compress(*fn);
    std::vector<float> logits = session.feed(rest);
    bool hit = true;
    for (std::size_t i = 0; i < task.answer.size() && hit; ++i) {
      hit = argmax(logits) == task.answer[i];
      if (hit && i + 1 < task.answer.size()) logits = session.forward(task.answer[i]);
    }
    hits.push_back(hit);
    if (stats) stats->push_back({session.peak_length(), session.compressions(), session.pages_freed()});
  }
  return hits;
}

}  // namespace kvc::engine
