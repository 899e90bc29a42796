// The kvcompress tool's subcommands (generate, eval, compress). run_command is what the tool, the demo
// and the tests call; the definitions below are compiled once, in cli_commands.cpp (kvc_cli_methods).
#pragma once

#include "engine/eval.hpp"
#include "engine/llama2.hpp"
#include "engine/model_path.hpp"
#include "engine/npy.hpp"
#include "engine/recall.hpp"
#include "engine_bridge.hpp"
#include "methods.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kvc::cli {

/// Runs one subcommand (`argv[1]`); returns the exit code (2 for usage errors, 1 for failures).
int run_command(int argc, char** argv, std::ostream& out, std::ostream& err);

inline int main_entry(int argc, char** argv) { return run_command(argc, argv, std::cout, std::cerr); }

}  // namespace kvc::cli

#ifdef KVC_CLI_COMMANDS_DEFINE
namespace kvc::cli {

/// --key value / --flag arguments after the subcommand.
class Args {
 public:
  Args(int argc, char** argv, int first) {
    for (int i = first; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + a + "'");
      a = a.substr(2);
      const auto eq = a.find('=');
      std::string key = a, value;
      if (eq != std::string::npos) {
        key = a.substr(0, eq);
        value = a.substr(eq + 1);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        value = argv[++i];
      }
      // A repeated option would silently override the first: refuse it.
      if (!values_.emplace(key, value).second) throw std::invalid_argument("option --" + key + " given more than once");
    }
  }
  bool has(const std::string& k) const { return values_.count(k) > 0; }
  std::string str(const std::string& k, const std::string& def = "") {
    used_[k] = true;
    return has(k) ? values_.at(k) : def;
  }
  double num(const std::string& k, double def) {
    if (!has(k)) return def;
    return parse_double(k, str(k));
  }
  Index integer(const std::string& k, Index def) {
    if (!has(k)) return def;
    return parse_int(k, str(k));
  }
  /// An integer option in [lo, hi] (the default is not checked); the message names the option and
  /// the value as given.
  Index integer(const std::string& k, Index def, Index lo, Index hi) {
    if (!has(k)) return def;
    const std::string v = str(k);
    const Index x = parse_int(k, v);
    if (x < lo || x > hi) {
      throw std::invalid_argument("--" + k + " must be " +
                                  (hi == std::numeric_limits<Index>::max() ? ">= " + std::to_string(lo)
                                                                           : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]") +
                                  ", got '" + v + "'");
    }
    return x;
  }
  /// A file name option: absent gives "", present it must not be empty (`--tokens=` is not ignored).
  std::string path(const std::string& k) {
    if (!has(k)) return "";
    const std::string v = str(k);
    if (v.empty()) throw std::invalid_argument("--" + k + " needs a file name");
    return v;
  }
  /// A comma-separated list: neither the list nor an item may be empty.
  std::vector<std::string> list(const std::string& k, const std::string& def) {
    const std::string v = str(k, def);
    std::vector<std::string> out;
    std::string::size_type start = 0;
    while (true) {
      const auto comma = v.find(',', start);
      const std::string item = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (item.empty()) {
        throw std::invalid_argument("--" + k + (v.empty() ? " is empty" : " has an empty item in '" + v + "'"));
      }
      out.push_back(item);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return out;
  }
  /// A budget ratio in (0, 1]; the message shows the value as given (1.0000001, not 1).
  static double parse_ratio(const std::string& k, const std::string& v) {
    const double x = parse_double(k, v);
    if (!(x > 0.0 && x <= 1.0)) throw std::invalid_argument("--" + k + ": ratio '" + v + "' is outside (0, 1]");
    return x;
  }
  bool flag(const std::string& k) {
    if (!has(k)) return false;
    const std::string v = str(k);
    if (v.empty() || v == "1" || v == "true" || v == "on") return true;
    if (v == "0" || v == "false" || v == "off") return false;
    throw std::invalid_argument("--" + k + " takes no value or on/off, got '" + v + "'");
  }
  /// Throws on any option that no subcommand code read (a typo must not pass silently).
  void reject_unused() const {
    for (const auto& [k, v] : values_)
      if (!used_.count(k)) throw std::invalid_argument("unknown option --" + k);
  }
  static double parse_double(const std::string& k, const std::string& v) {
    double x = 0;
    std::size_t pos = 0;
    try {
      x = std::stod(v, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (pos == 0 || pos != v.size()) throw std::invalid_argument("--" + k + " expects a number, got '" + v + "'");
    // nan and inf parse but no option takes them (a NaN would pass a range check written as x < lo).
    if (!std::isfinite(x)) throw std::invalid_argument("--" + k + " expects a finite number, got '" + v + "'");
    return x;
  }
  static Index parse_int(const std::string& k, const std::string& v) {
    try {
      std::size_t pos = 0;
      const long long x = std::stoll(v, &pos);
      if (pos == v.size()) return static_cast<Index>(x);
    } catch (const std::exception&) {
    }
    throw std::invalid_argument("--" + k + " expects an integer, got '" + v + "'");
  }

 private:
  std::map<std::string, std::string> values_;
  mutable std::map<std::string, bool> used_;
};

/// Method options from the command line, one to one onto the presets' Arguments.
inline MethodOptions method_options(Args& a) {
  MethodOptions o;
  if (a.has("pool")) o.pool = a.integer("pool", 0);
  if (a.has("pooling")) o.pooling = a.str("pooling");
  if (a.has("recent")) o.recent = a.integer("recent", 0);
  if (a.has("sinks")) o.sinks = a.integer("sinks", 0);
  if (a.has("bucket")) o.bucket = a.integer("bucket", 0);
  if (a.has("route")) o.route = a.str("route");
  if (a.has("selection")) o.selection = a.str("selection");
  if (a.has("alpha")) o.alpha = a.num("alpha", 0);
  if (a.has("r-max")) o.r_max = a.num("r-max", 0);
  if (a.has("threshold")) o.threshold = a.num("threshold", 0);
  if (a.has("lambda")) o.lambda = a.num("lambda", 0);
  if (a.has("lambda-mode")) o.lambda_mode = a.str("lambda-mode");
  if (a.has("holdout-every")) o.holdout_every = a.integer("holdout-every", 0);
  if (a.has("beta")) o.beta = a.num("beta", 0);
  if (a.has("steps")) o.steps = a.integer("steps", 0);
  if (a.has("safeguard")) o.safeguard = a.flag("safeguard");
  if (a.has("reposition")) o.reposition = a.flag("reposition");
  if (a.has("rope-base")) o.rope_base = a.num("rope-base", 0);
  if (a.has("scorer")) o.scorer = a.str("scorer");
  if (a.has("merger")) o.merger = a.str("merger");
  if (a.has("compensator")) o.compensator = a.str("compensator");
  if (a.has("allocation")) o.allocation = a.str("allocation");
  if (a.has("block-size")) o.block_size = a.integer("block-size", 0, 1, std::numeric_limits<Index>::max());
  if (a.has("block-score")) o.block_score = a.str("block-score");
  return o;
}

/// generate and eval: the keys' RoPE is the model's, read off its file (--rope-base is compress's).
inline void use_model_rope(MethodOptions& o, const engine::Model& model) {
  if (o.rope_base)
    throw std::invalid_argument("--rope-base does not apply to generate and eval: the model's RoPE base (" +
                                std::to_string(model.rope_base()) + ") is read from its file");
  o.rope_theta = model.rope_base();
}

/// --layer-budgets uniform|pyramid and --pyramid-beta (generate, eval): how a model's budget is shared
/// out across its layers (model.hpp); the schedule's window is the run's observation window.
inline LayerScheduleArguments layer_schedule(Args& a) {
  LayerScheduleArguments s;
  const std::string name = a.str("layer-budgets", "uniform");
  if (name == "pyramid") s.schedule = LayerSchedule::pyramid;
  else if (name != "uniform")
    throw std::invalid_argument("--layer-budgets must be uniform or pyramid, got '" + name + "'");
  if (a.has("pyramid-beta")) {
    if (s.schedule != LayerSchedule::pyramid) throw std::invalid_argument("--pyramid-beta needs --layer-budgets pyramid");
    s.beta = a.num("pyramid-beta", s.beta);
    s.validate().throw_if_error();
  }
  return s;
}

/// Compression while the cache grows (generate, eval): --prefill-chunk C feeds the prompt C tokens at a
/// time and compresses after each chunk to the run's budget; --decode-budget N compresses each layer
/// back to N entries once it holds more, then every --compress-every K tokens (0: whenever above N).
struct GrowthOptions {
  Index prefill_chunk = 0, decode_budget = 0, compress_every = 0;
};

inline GrowthOptions growth_options(Args& a) {
  GrowthOptions g;
  if (a.has("prefill-chunk")) g.prefill_chunk = a.integer("prefill-chunk", 0, 1, std::numeric_limits<Index>::max());
  if (a.has("decode-budget")) g.decode_budget = a.integer("decode-budget", 0, 1, std::numeric_limits<Index>::max());
  if (a.has("compress-every")) {
    if (g.decode_budget == 0) throw std::invalid_argument("--compress-every needs --decode-budget");
    g.compress_every = a.integer("compress-every", 0, 0, std::numeric_limits<Index>::max());
  }
  return g;
}

/// Rejects what compression while the cache grows cannot do.
inline void check_growth(const GrowthOptions& g, const MethodOptions& o) {
  if ((g.prefill_chunk > 0 || g.decode_budget > 0) && o.reposition.value_or(false))
    throw std::invalid_argument("--reposition does not apply with --prefill-chunk or --decode-budget (a cache compressed "
                                "while it grows keeps its RoPE positions)");
}

struct ModelFiles {
  std::string model, tokenizer;
};

inline ModelFiles model_files(Args& a) {
  ModelFiles f;
  f.model = a.path("model");
  f.tokenizer = a.path("tokenizer");
  if (f.model.empty() || f.tokenizer.empty()) {
    const auto dir = engine::find_model_dir();
    if (!dir) throw std::runtime_error(engine::model_missing_message());
    if (f.model.empty()) f.model = *dir + "/stories260K.bin";
    if (f.tokenizer.empty()) f.tokenizer = *dir + "/tok512.bin";
  }
  return f;
}

inline Budget budget_from(Args& a) {
  if (a.has("budget") && a.has("ratio")) throw std::invalid_argument("give either --ratio or --budget, not both");
  if (a.has("budget")) return Budget::tokens(a.integer("budget", 0, 1, std::numeric_limits<Index>::max()));
  return Budget::ratio(a.has("ratio") ? Args::parse_ratio("ratio", a.str("ratio")) : 0.25);
}

// ---- generate -------------------------------------------------------------------------------------

inline int cmd_generate(Args& a, std::ostream& out) {
  const ModelFiles files = model_files(a);
  const std::string prompt = a.str("prompt", "");
  const std::string method = a.str("method", "selkv");
  const Index steps = a.integer("max-tokens", 128, 1, std::numeric_limits<Index>::max());
  const Index window = a.integer("window", 32, 1, std::numeric_limits<Index>::max());
  const Budget budget = budget_from(a);
  MethodOptions opts = method_options(a);
  const LayerScheduleArguments schedule = layer_schedule(a);
  const GrowthOptions growth = growth_options(a);
  a.reject_unused();
  check_growth(growth, opts);
  const engine::Model model = engine::Model::load(files.model);
  const engine::Tokenizer tok = engine::Tokenizer::load(files.tokenizer, model.config().vocab_size);
  use_model_rope(opts, model);  // repositioning and expected-attention rotate as the model does
  const int layers = model.config().n_layers;
  const std::vector<int> prompt_tokens = tok.encode(prompt, true);
  const Index P = static_cast<Index>(prompt_tokens.size());
  engine::Compression plan;
  if (growth.prefill_chunk > 0)
    plan.chunked = grown_compressor(method_runner(method, opts),
                                    chunked_prefill_arguments(budget, schedule, layers, P, window));
  else
    plan.once = engine_compressor(make_method(method, opts), budget, schedule, layers, opts.reposition.value_or(false));
  if (growth.decode_budget > 0)
    plan.decoding = grown_compressor(method_runner(method, opts),
                                     decoding_arguments(growth.decode_budget, growth.compress_every, layers, window));

  std::ptrdiff_t entries_before = 0, entries_after = 0;  // cache entries over all layers and KV heads
  engine::RunStats stats;
  auto run = [&](const engine::Compression* compress) {
    engine::Session s(model, 0, compress ? opts.block_size.value_or(0) : 0);  // --block-size: a paged cache
    std::vector<float> logits;
    if (compress && (compress->chunked || compress->decoding)) s.keep_queries(window);
    if (compress && compress->chunked) {
      const engine::CacheCompressor chunked = compress->chunked();
      for (Index at = 0; at < P; at += growth.prefill_chunk) {
        logits = s.feed(std::vector<int>(prompt_tokens.begin() + at, prompt_tokens.begin() + std::min(P, at + growth.prefill_chunk)));
        s.compress_grown(chunked);
      }
      entries_before = P * layers * model.config().n_kv_heads;
      entries_after = s.entries();
    } else {
      logits = s.prefill(prompt_tokens, window);
      if (compress && compress->once) {
        entries_before = s.entries();
        s.compress(compress->once);
        entries_after = s.entries();
      }
    }
    const engine::CacheCompressor decoding = compress && compress->decoding ? compress->decoding() : engine::CacheCompressor();
    std::vector<int> toks;
    for (Index t = 0; t < steps && s.position() < model.config().seq_len; ++t) {
      const int next = engine::argmax(logits);
      toks.push_back(next);
      if (s.position() >= model.config().seq_len) break;
      logits = s.forward(next);
      if (decoding) s.compress_grown(decoding);
    }
    if (compress) stats = {s.peak_length(), s.compressions(), s.pages_freed()};
    return toks;
  };
  const std::vector<int> full = run(nullptr);
  const std::vector<int> comp = run(&plan);
  auto text = [&](const std::vector<int>& toks) {
    std::string s;
    int prev = prompt_tokens.back();
    for (int t : toks) {
      s += tok.decode(prev, t);
      prev = t;
    }
    return s;
  };
  std::size_t diverge = 0;
  while (diverge < full.size() && diverge < comp.size() && full[diverge] == comp[diverge]) ++diverge;
  out << "prompt      : " << prompt << "\n";
  out << "full cache  : " << text(full) << "\n";
  out << method << " @ " << (budget.is_ratio() ? budget.rho() : double(budget.absolute())) << " : " << text(comp)
      << "\n";
  // Each entry holds a key and a value of d floats and a float bias; heads keep their own lengths.
  const double kib_per_entry = double(2 * model.config().head_size() + 1) * sizeof(float) / 1024.0;
  out << "cache after compression: " << entries_after << " of " << entries_before << " entries ("
      << double(entries_after) * kib_per_entry << " of " << double(entries_before) * kib_per_entry
      << " KiB of keys, values and bias)\n";
  if (growth.prefill_chunk > 0 || growth.decode_budget > 0)
    out << "peak entries per layer and head: " << stats.peak_entries << "; compressions per layer: "
        << double(stats.compressions) / layers << "\n";
  if (opts.block_size)
    out << "paged cache, pages of " << *opts.block_size << " entries: " << stats.pages_freed
        << " pages given back by compression over all layers\n";
  if (diverge == full.size() && full.size() == comp.size())
    out << "identical over " << full.size() << " tokens\n";
  else
    out << "first divergence at generated token " << diverge << " of " << full.size() << "\n";
  return 0;
}

// ---- eval -----------------------------------------------------------------------------------------

struct EvalRow {
  std::string method;
  double ratio = 0;
  engine::Interval kl, top1, dnll, werr;
  engine::Interval kl_vs_snapkv;  // paired KL difference (this − snapkv), when has_pair
  double kept = 0;  // entries kept / entries before, over every compression, layer, KV head and sequence
  Index peak_entries = 0;  // the most entries a KV head of a layer held
  double compressions = 0;  // compressions per layer and sequence
  Index page_size = 0;      // > 0: the cache was paged
  double pages_freed = 0;   // pages given back per sequence, over all layers
  bool has_pair = false;
  double seconds = 0;
};

inline std::vector<EvalRow> run_eval(const engine::Model& model, const std::vector<std::vector<int>>& seqs,
                                     const engine::EvalConfig& config, const std::vector<std::string>& methods,
                                     const std::vector<double>& ratios, const MethodOptions& opts,
                                     std::uint64_t seed, bool progress, const LayerScheduleArguments& schedule = {},
                                     const GrowthOptions& growth = {}) {
  engine::EvalConfig cfg = config;
  cfg.prefill_chunk = growth.prefill_chunk;
  cfg.page_size = opts.block_size.value_or(0);  // whole pages of the block size kept or freed
  engine::TeacherForcedEval ev(model, seqs, cfg);
  const int layers = model.config().n_layers;
  std::vector<EvalRow> rows;
  std::vector<engine::EvalResult> results;  // parallel to rows
  const std::size_t total = methods.size() * ratios.size();
  std::size_t done = 0;
  for (double ratio : ratios) {
    for (const auto& method : methods) {
      const Compressor comp = make_method(method, opts);
      // Per sequence: mean over its layer compressions of the window attention-output error.
      std::vector<std::pair<double, int>> err;  // per sequence: sum, count
      int calls = 0;
      const Budget budget = Budget::ratio(ratio);
      double kept_entries = 0, all_entries = 0;
      const Observer observe = [&](const LayerView<float>& layer, const LayerResult<float>& r) {
        err.back().first += window_output_error(layer, r);
        ++err.back().second;
        for (const auto& h : r.heads) kept_entries += static_cast<double>(h.positions.size());
        all_entries += static_cast<double>(layer.kv_heads() * layer.tokens());
      };
      engine::Compression plan;
      if (growth.prefill_chunk > 0) {
        const auto chunked = grown_compressor(
            method_runner(method, opts),
            chunked_prefill_arguments(budget, schedule, layers, config.prefix, config.window), observe);
        plan.chunked = [&err, chunked] {
          err.emplace_back(0.0, 0);  // a new sequence
          return chunked();
        };
      } else {
        plan.once = [&](const engine::LayerInput& in) {
          if (calls++ % layers == 0) err.emplace_back(0.0, 0);  // a new sequence
          const LayerView<float> layer = view_of(in);
          const LayerResult<float> r = comp(layer, layer_budget(budget, schedule, layers, in));
          observe(layer, r);
          return to_engine(r, opts.reposition.value_or(false));
        };
      }
      if (growth.decode_budget > 0)
        plan.decoding = grown_compressor(
            method_runner(method, opts),
            decoding_arguments(growth.decode_budget, growth.compress_every, layers, config.window), observe);
      const auto t0 = std::chrono::steady_clock::now();
      const engine::EvalResult res = ev.evaluate(plan);
      std::vector<double> werr;
      for (const auto& e : err) werr.push_back(e.second > 0 ? e.first / e.second : 0.0);
      EvalRow row;
      row.method = method;
      row.ratio = ratio;
      row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      row.kl = engine::bootstrap_mean(res.values(engine::Metric::kKl), seed);
      row.top1 = engine::bootstrap_mean(res.values(engine::Metric::kTop1), seed);
      row.dnll = engine::bootstrap_mean(res.values(engine::Metric::kDeltaNll), seed);
      row.werr = engine::bootstrap_mean(werr, seed);
      row.kept = all_entries > 0 ? kept_entries / all_entries : 0.0;
      row.peak_entries = res.peak_entries;
      row.compressions = res.compressions;
      row.page_size = cfg.page_size;
      row.pages_freed = res.pages_freed;
      rows.push_back(row);
      results.push_back(res);
      ++done;
      if (progress) {
        const int width = 30;
        const int filled = static_cast<int>(width * done / total);
        std::fprintf(stderr, "\r[%s%s] %zu/%zu %s @ %.2f   ", std::string(filled, '#').c_str(),
                     std::string(width - filled, '.').c_str(), done, total, method.c_str(), ratio);
        if (done == total) std::fprintf(stderr, "\n");
      }
    }
  }
  // Paired KL differences against SnapKV at the same ratio (same sequences, same order).
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (std::size_t j = 0; j < rows.size(); ++j)
      if (rows[j].method == "snapkv" && rows[j].ratio == rows[i].ratio && i != j) {
        rows[i].kl_vs_snapkv = engine::bootstrap_paired_difference(results[i].values(engine::Metric::kKl),
                                                                   results[j].values(engine::Metric::kKl), seed);
        rows[i].has_pair = true;
      }
  return rows;
}

inline void print_table(const std::vector<EvalRow>& rows, std::ostream& out) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "%-15s %5s  %-26s %-22s %-26s %-22s %-26s\n", "method", "ratio",
                "KL(full||comp) [95% CI]", "top-1 [95% CI]", "dNLL [95% CI]", "window err", "KL - snapkv [95% CI]");
  out << buf;
  for (const auto& r : rows) {
    char pair[64] = "-";
    if (r.has_pair) std::snprintf(pair, sizeof pair, "%+.4f [%+.4f,%+.4f]", r.kl_vs_snapkv.mean, r.kl_vs_snapkv.lo, r.kl_vs_snapkv.hi);
    std::snprintf(buf, sizeof buf, "%-15s %5.2f  %.4f [%.4f,%.4f]   %.3f [%.3f,%.3f]    %+.4f [%+.4f,%+.4f] %.3f [%.3f,%.3f]  %s\n",
                  r.method.c_str(), r.ratio, r.kl.mean, r.kl.lo, r.kl.hi, r.top1.mean, r.top1.lo, r.top1.hi,
                  r.dnll.mean, r.dnll.lo, r.dnll.hi, r.werr.mean, r.werr.lo, r.werr.hi, pair);
    out << buf;
  }
}

/// An interval as JSON: {"mean": …, "lo": …, "hi": …}.
inline std::string json_interval(const engine::Interval& i) {
  char b[160];
  std::snprintf(b, sizeof b, "{\"mean\": %.8g, \"lo\": %.8g, \"hi\": %.8g}", i.mean, i.lo, i.hi);
  return b;
}

inline void print_json(const std::vector<EvalRow>& rows, std::ostream& out) {
  const auto iv = json_interval;
  out << "[\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    out << "  {\"method\": \"" << r.method << "\", \"ratio\": " << r.ratio << ", \"kl\": " << iv(r.kl)
        << ", \"top1\": " << iv(r.top1) << ", \"delta_nll\": " << iv(r.dnll) << ", \"window_error\": " << iv(r.werr);
    if (r.has_pair) out << ", \"kl_minus_snapkv\": " << iv(r.kl_vs_snapkv);
    out << ", \"kept\": " << r.kept << ", \"peak_entries\": " << r.peak_entries
        << ", \"compressions\": " << r.compressions;
    if (r.page_size > 0) out << ", \"page_size\": " << r.page_size << ", \"pages_freed\": " << r.pages_freed;
    out << ", \"seconds\": " << r.seconds << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  out << "]\n";
}

inline void print_csv(const std::vector<EvalRow>& rows, std::ostream& out) {
  out << "method,ratio,kl,kl_lo,kl_hi,top1,top1_lo,top1_hi,delta_nll,delta_nll_lo,delta_nll_hi,window_error,"
         "window_error_lo,window_error_hi,kl_minus_snapkv,kl_minus_snapkv_lo,kl_minus_snapkv_hi,kept,peak_entries,"
         "compressions\n";
  for (const auto& r : rows) {
    out << r.method << "," << r.ratio;
    for (const auto* i : {&r.kl, &r.top1, &r.dnll, &r.werr}) out << "," << i->mean << "," << i->lo << "," << i->hi;
    if (r.has_pair)
      out << "," << r.kl_vs_snapkv.mean << "," << r.kl_vs_snapkv.lo << "," << r.kl_vs_snapkv.hi;
    else
      out << ",,,";
    out << "," << r.kept << "," << r.peak_entries << "," << r.compressions << "\n";
  }
}

/// The sequences of an --tokens file: an integer array [N][L], N >= 1, L >= 2, every value an int
/// (token ids are checked against the vocabulary by the evaluation); errors name the file.
inline std::vector<std::vector<int>> read_token_sequences(const std::string& path) {
  const engine::NpyArray arr = engine::read_npy(path);
  if (arr.shape.size() != 2 || arr.is_float())
    throw std::invalid_argument(path + ": --tokens needs an integer array of shape [N][P+C]");
  if (arr.shape[0] < 1 || arr.shape[1] < 2)
    throw std::invalid_argument(path + ": --tokens needs at least one sequence of at least 2 tokens, got shape [" +
                                std::to_string(arr.shape[0]) + "][" + std::to_string(arr.shape[1]) + "]");
  std::vector<std::vector<int>> seqs(static_cast<std::size_t>(arr.shape[0]));
  for (std::int64_t s = 0; s < arr.shape[0]; ++s) {
    seqs[static_cast<std::size_t>(s)].reserve(static_cast<std::size_t>(arr.shape[1]));
    for (std::int64_t t = 0; t < arr.shape[1]; ++t) {
      const std::int64_t v = arr.i[static_cast<std::size_t>(s * arr.shape[1] + t)];
      if (v < 0 || v > INT_MAX)  // never narrowed: 2^40 + 5 must not become token 5
        throw std::invalid_argument(path + ": token [" + std::to_string(s) + "][" + std::to_string(t) + "] = " +
                                    std::to_string(v) + " is not a valid token id");
      seqs[static_cast<std::size_t>(s)].push_back(static_cast<int>(v));
    }
  }
  return seqs;
}

/// The grid and output of an eval: --methods, --ratios (default `ratios`), --json | --csv, --quiet.
struct EvalGrid {
  std::vector<std::string> methods;
  std::vector<double> ratios;
  bool json = false, csv = false, quiet = false;
};

inline EvalGrid eval_grid(Args& a, const std::string& ratios) {
  EvalGrid g;
  g.methods = a.list("methods", "streaming,snapkv,selkv-evict,selkv,grkv");
  for (const auto& r : a.list("ratios", ratios)) g.ratios.push_back(Args::parse_ratio("ratios", r));
  g.json = a.flag("json");
  g.csv = a.flag("csv");
  g.quiet = a.flag("quiet");
  if (g.json && g.csv) throw std::invalid_argument("give either --json or --csv, not both");
  return g;
}

// ---- eval --task recall -----------------------------------------------------------------------------

struct RecallRow {
  std::string method;  // "full": the uncompressed cache
  double ratio = 1;
  engine::RecallSetting setting = engine::RecallSetting::kQuestionLast;
  engine::Interval accuracy;
  double by_kind[3] = {0, 0, 0};  // accuracy on fact, passkey and hop questions
  double kept = 1;  // entries kept / entries before, over every layer, KV head and task
  engine::Interval minus_snapkv;  // paired accuracy difference (this − snapkv), same tasks, when has_pair
  bool has_pair = false;
};

/// Exact-match accuracy of the full cache and of every method at every ratio, in each setting, on the
/// same tasks (one prefill per task and setting; each row continues from a copy of it). `threads`
/// workers take every threads-th task, each with its own compressors; the result does not depend on
/// their number.
inline std::vector<RecallRow> run_recall(const engine::Model& model, const std::vector<engine::RecallTask>& tasks,
                                         const std::vector<engine::RecallSetting>& settings, Index window,
                                         const std::vector<std::string>& methods, const std::vector<double>& ratios,
                                         const MethodOptions& opts, std::uint64_t seed, bool progress,
                                         const LayerScheduleArguments& schedule = {}, int threads = 1) {
  const int layers = model.config().n_layers;
  const std::size_t E = 1 + methods.size() * ratios.size();  // entry 0: the full cache
  const std::size_t N = tasks.size();
  const std::size_t T = static_cast<std::size_t>(std::max(1, std::min<int>(threads, static_cast<int>(std::max<std::size_t>(N, 1)))));
  std::vector<RecallRow> proto(E);
  proto[0].method = "full";
  for (std::size_t r = 0, e = 1; r < ratios.size(); ++r)
    for (std::size_t k = 0; k < methods.size(); ++k, ++e) {
      proto[e].method = methods[k];
      proto[e].ratio = ratios[r];
    }
  std::vector<RecallRow> rows;
  for (const engine::RecallSetting setting : settings) {
    std::vector<std::vector<double>> hits(E, std::vector<double>(N, 0.0));
    std::vector<std::vector<double>> kept(T, std::vector<double>(E, 0.0)), all(T, std::vector<double>(E, 0.0));
    std::vector<std::exception_ptr> failed(T);
    std::atomic<std::size_t> done{0};
    auto work = [&](std::size_t w) {
      try {
        std::vector<engine::LayerCompressor> fns(E);
        std::vector<const engine::LayerCompressor*> ptrs(E, nullptr);
        for (std::size_t e = 1; e < E; ++e) {
          Compressor counted = [comp = make_method(proto[e].method, opts), kept_e = &kept[w][e], all_e = &all[w][e]](
                                   const LayerView<float>& layer, const Budget& budget) {
            LayerResult<float> res = comp(layer, budget);
            for (const auto& h : res.heads) *kept_e += static_cast<double>(h.positions.size());
            *all_e += static_cast<double>(layer.kv_heads() * layer.tokens());
            return res;
          };
          fns[e] = engine_compressor(std::move(counted), Budget::ratio(proto[e].ratio), schedule, layers);
          ptrs[e] = &fns[e];
        }
        for (std::size_t t = w; t < N; t += T) {
          const std::vector<bool> h = engine::recall_hits(model, tasks[t], setting, window, ptrs);
          for (std::size_t e = 0; e < E; ++e) hits[e][t] = h[e] ? 1.0 : 0.0;
          const std::size_t finished = ++done;
          if (progress && w == 0)
            std::fprintf(stderr, "\r%s: %zu/%zu tasks   ", engine::recall_setting_name(setting), finished, N);
        }
      } catch (...) {
        failed[w] = std::current_exception();
      }
    };
    std::vector<std::thread> pool;
    for (std::size_t w = 1; w < T; ++w) pool.emplace_back(work, w);
    work(0);
    for (std::thread& th : pool) th.join();
    for (const std::exception_ptr& f : failed)
      if (f) std::rethrow_exception(f);
    if (progress) std::fprintf(stderr, "\r%s: %zu/%zu tasks\n", engine::recall_setting_name(setting), N, N);
    for (std::size_t e = 0; e < E; ++e) {
      RecallRow row = proto[e];
      row.setting = setting;
      row.accuracy = engine::bootstrap_mean(hits[e], seed);
      std::array<double, 3> kind_hits{0, 0, 0}, kind_count{0, 0, 0};
      for (std::size_t t = 0; t < N; ++t) {
        kind_hits[static_cast<std::size_t>(tasks[t].kind)] += hits[e][t];
        kind_count[static_cast<std::size_t>(tasks[t].kind)] += 1;
      }
      for (std::size_t k = 0; k < 3; ++k) row.by_kind[k] = kind_count[k] > 0 ? kind_hits[k] / kind_count[k] : 0.0;
      double kept_e = 0, all_e = 0;
      for (std::size_t w = 0; w < T; ++w) {
        kept_e += kept[w][e];
        all_e += all[w][e];
      }
      if (e > 0) row.kept = all_e > 0 ? kept_e / all_e : 0.0;
      rows.push_back(row);
    }
    // Paired differences against SnapKV at the same ratio (same tasks, same order).
    const std::size_t first = rows.size() - E;
    for (std::size_t e = 0; e < E; ++e)
      for (std::size_t f = 1; f < E; ++f)
        if (proto[f].method == "snapkv" && proto[f].ratio == proto[e].ratio && e != f) {
          rows[first + e].minus_snapkv = engine::bootstrap_paired_difference(hits[e], hits[f], seed);
          rows[first + e].has_pair = true;
        }
  }
  return rows;
}

inline void print_recall(const std::vector<RecallRow>& rows, bool json, bool csv, std::ostream& out) {
  char buf[512];
  if (json) {
    out << "[\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const RecallRow& r = rows[i];
      std::snprintf(buf, sizeof buf, "  {\"task\": \"recall\", \"setting\": \"%s\", \"method\": \"%s\", \"ratio\": %g, ",
                    engine::recall_setting_name(r.setting), r.method.c_str(), r.ratio);
      out << buf << "\"accuracy\": " << json_interval(r.accuracy);
      std::snprintf(buf, sizeof buf, ", \"fact\": %.8g, \"passkey\": %.8g, \"hop\": %.8g, \"kept\": %.8g", r.by_kind[0],
                    r.by_kind[1], r.by_kind[2], r.kept);
      out << buf;
      if (r.has_pair) out << ", \"accuracy_minus_snapkv\": " << json_interval(r.minus_snapkv);
      out << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "]\n";
    return;
  }
  if (csv) {
    out << "setting,method,ratio,accuracy,accuracy_lo,accuracy_hi,fact,passkey,hop,kept,accuracy_minus_snapkv,"
           "accuracy_minus_snapkv_lo,accuracy_minus_snapkv_hi\n";
    for (const RecallRow& r : rows) {
      std::snprintf(buf, sizeof buf, "%s,%s,%g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g", engine::recall_setting_name(r.setting),
                    r.method.c_str(), r.ratio, r.accuracy.mean, r.accuracy.lo, r.accuracy.hi, r.by_kind[0], r.by_kind[1],
                    r.by_kind[2], r.kept);
      out << buf;
      if (r.has_pair)
        std::snprintf(buf, sizeof buf, ",%.6g,%.6g,%.6g\n", r.minus_snapkv.mean, r.minus_snapkv.lo, r.minus_snapkv.hi);
      else
        std::snprintf(buf, sizeof buf, ",,,\n");
      out << buf;
    }
    return;
  }
  std::snprintf(buf, sizeof buf, "%-15s %-15s %5s  %-22s %5s %7s %5s %6s  %s\n", "setting", "method", "ratio",
                "accuracy [95% CI]", "fact", "passkey", "hop", "kept", "accuracy - snapkv [95% CI]");
  out << buf;
  for (const RecallRow& r : rows) {
    char pair[64] = "-";
    if (r.has_pair)
      std::snprintf(pair, sizeof pair, "%+.3f [%+.3f,%+.3f]", r.minus_snapkv.mean, r.minus_snapkv.lo, r.minus_snapkv.hi);
    std::snprintf(buf, sizeof buf, "%-15s %-15s %5.2f  %.3f [%.3f,%.3f]    %5.3f %7.3f %5.3f %6.3f  %s\n",
                  engine::recall_setting_name(r.setting), r.method.c_str(), r.ratio, r.accuracy.mean, r.accuracy.lo,
                  r.accuracy.hi, r.by_kind[0], r.by_kind[1], r.by_kind[2], r.kept, pair);
    out << buf;
  }
}

/// eval --task recall: the retrieval benchmark on the recall model (docs/recall.md).
inline int cmd_eval_recall(Args& a, std::ostream& out) {
  for (const char* k : {"tokens", "prefix", "prefill-chunk", "decode-budget", "compress-every", "tokenizer"})
    if (a.has(k)) throw std::invalid_argument(std::string("--") + k + " does not apply with --task recall");
  std::string model_path = a.path("model"), filler_path = a.path("filler-model");
  if (model_path.empty()) {
    const auto found = engine::find_recall_model();
    if (!found) throw std::runtime_error(engine::recall_model_missing_message());
    model_path = *found;
  }
  if (filler_path.empty()) {
    const auto dir = engine::find_model_dir();
    if (!dir) throw std::runtime_error(engine::model_missing_message());
    filler_path = *dir + "/" + engine::kCheckpointFile;
  }
  const Index samples = a.integer("samples", 60, 1, INT_MAX);
  const std::uint64_t seed = static_cast<std::uint64_t>(a.integer("seed", 1, 0, std::numeric_limits<Index>::max()));
  const Index length = a.integer("length", 2048, 2, INT_MAX);
  const Index window = a.integer("window", engine::ProtocolDefaults::kWindow, 1, std::numeric_limits<Index>::max());
  const int threads = static_cast<int>(a.integer("threads", 1, 1, 1024));
  std::vector<engine::RecallSetting> settings;
  for (const auto& s : a.list("settings", "question-last,question-later")) {
    if (s == "question-last") settings.push_back(engine::RecallSetting::kQuestionLast);
    else if (s == "question-later") settings.push_back(engine::RecallSetting::kQuestionLater);
    else throw std::invalid_argument("--settings takes question-last and question-later, got '" + s + "'");
  }
  const EvalGrid grid = eval_grid(a, "0.05,0.1,0.25,0.5");
  MethodOptions opts = method_options(a);
  const LayerScheduleArguments schedule = layer_schedule(a);
  a.reject_unused();
  if (opts.reposition.value_or(false))
    throw std::invalid_argument("--reposition does not apply with --task recall (the question follows the compressed cache)");
  for (const auto& m : grid.methods) make_method(m, opts);  // fail fast on a bad name or option
  const engine::Model model = engine::Model::load(model_path);
  use_model_rope(opts, model);
  if (length > model.config().seq_len)
    throw std::invalid_argument("--length " + std::to_string(length) + " exceeds the model's context of " +
                                std::to_string(model.config().seq_len) + " tokens");
  if (model.config().vocab_size < engine::RecallTokens::kFirstValue + engine::RecallTokens::kValues)
    throw std::invalid_argument(model_path + ": the recall task needs tok512's vocabulary (512 ids), the model has " +
                                std::to_string(model.config().vocab_size));
  const engine::Model story = engine::Model::load(filler_path);
  // Filler: a stream as long as a task plus a story per task up to 64, so tasks start at many offsets.
  const Index story_len = std::max(1, story.config().seq_len);
  const int stories = static_cast<int>((length + story_len - 1) / story_len + std::min<Index>(64, samples));
  const std::vector<int> filler = engine::recall_filler(story, stories, seed);
  const auto tasks = engine::make_recall_tasks(filler, static_cast<int>(samples), static_cast<int>(length), seed + 1);
  const auto rows =
      run_recall(model, tasks, settings, window, grid.methods, grid.ratios, opts, seed, !grid.quiet, schedule, threads);
  if (!grid.json && !grid.csv)
    out << "recall: " << tasks.size() << " tasks of " << length << " tokens (fact, passkey, hop in turn), window "
        << window << "; exact-match accuracy with bootstrap 95% intervals\n";
  print_recall(rows, grid.json, grid.csv, out);
  return 0;
}

inline int cmd_eval(Args& a, std::ostream& out) {
  if (a.has("task")) {
    const std::string task = a.str("task");
    if (task == "recall") return cmd_eval_recall(a, out);
    if (task != "kl") throw std::invalid_argument("--task must be kl or recall, got '" + task + "'");
  }
  const ModelFiles files = model_files(a);
  const std::string tokens_path = a.path("tokens");
  if (!tokens_path.empty())
    for (const char* k : {"samples", "length"})
      if (a.has(k)) throw std::invalid_argument(std::string("--") + k + " does not apply with --tokens (the file gives the sequences)");
  const Index samples = a.integer("samples", engine::ProtocolDefaults::kNumSequences, 1, INT_MAX);
  const std::uint64_t seed = static_cast<std::uint64_t>(a.integer("seed", 1, 0, std::numeric_limits<Index>::max()));
  const Index length = a.integer("length", engine::ProtocolDefaults::kSequenceLength, 2, INT_MAX);
  engine::EvalConfig config;
  config.prefix = a.integer("prefix", engine::ProtocolDefaults::kPrefix, 1, std::numeric_limits<Index>::max());
  config.window = a.integer("window", engine::ProtocolDefaults::kWindow, 1, std::numeric_limits<Index>::max());
  const EvalGrid grid = eval_grid(a, "0.1,0.25,0.5");
  MethodOptions opts = method_options(a);
  const LayerScheduleArguments schedule = layer_schedule(a);
  const GrowthOptions growth = growth_options(a);
  a.reject_unused();
  check_growth(growth, opts);
  for (const auto& m : grid.methods) make_method(m, opts);  // fail fast on a bad name or option

  std::vector<std::vector<int>> seqs;
  if (!tokens_path.empty()) seqs = read_token_sequences(tokens_path);  // before the model: fail fast
  const Index seq_length = tokens_path.empty() ? length : static_cast<Index>(seqs[0].size());
  if (config.prefix >= seq_length)
    throw std::invalid_argument("--prefix " + std::to_string(config.prefix) + " must be below the sequence length " +
                                std::to_string(seq_length) + (tokens_path.empty() ? " (--length)" : " (of --tokens)"));
  const engine::Model model = engine::Model::load(files.model);
  use_model_rope(opts, model);
  for (std::size_t s = 0; !tokens_path.empty() && s < seqs.size(); ++s)
    for (std::size_t t = 0; t < seqs[s].size(); ++t)
      if (seqs[s][t] >= model.config().vocab_size)
        throw std::invalid_argument(tokens_path + ": token [" + std::to_string(s) + "][" + std::to_string(t) + "] = " +
                                    std::to_string(seqs[s][t]) + " is outside the model's vocabulary [0, " +
                                    std::to_string(model.config().vocab_size) + ")");
  if (tokens_path.empty()) seqs = engine::sample_sequences(model, static_cast<int>(samples), static_cast<int>(length), seed);
  const auto rows = run_eval(model, seqs, config, grid.methods, grid.ratios, opts, seed, !grid.quiet, schedule, growth);
  if (grid.json) print_json(rows, out);
  else if (grid.csv) print_csv(rows, out);
  else {
    out << seqs.size() << " sequences of " << seqs[0].size() << " tokens, prefix " << config.prefix << " compressed per layer";
    if (growth.prefill_chunk > 0) out << " after each " << growth.prefill_chunk << "-token chunk";
    if (growth.decode_budget > 0)
      out << ", then to " << growth.decode_budget << " entries while decoding"
          << (growth.compress_every > 0 ? " every " + std::to_string(growth.compress_every) + " tokens" : std::string());
    out << ", window " << config.window << "; means over sequences with bootstrap 95% intervals\n";
    print_table(rows, out);
  }
  return 0;
}

// ---- compress -------------------------------------------------------------------------------------

/// compress --explain G: every head's merge map as merge_{evicted,target,gate}.npy ([H][E], E the most
/// entries a head evicted; padding -1, -1, 0), and head G's in words.
inline void write_merge_map(const LayerResult<float>& r, Index g, const std::string& dir, std::ostream& out) {
  const std::int64_t H = static_cast<std::int64_t>(r.heads.size());
  std::int64_t E = 0;
  for (const auto& h : r.heads) E = std::max<std::int64_t>(E, static_cast<std::int64_t>(h.merges.evicted.size()));
  std::vector<std::int32_t> evicted(static_cast<std::size_t>(H * E), -1), target(evicted.size(), -1);
  std::vector<float> gate(evicted.size(), 0.0f);
  for (std::int64_t h = 0; h < H; ++h) {
    const MergeMap<float>& mm = r.heads[static_cast<std::size_t>(h)].merges;
    for (std::size_t e = 0; e < mm.evicted.size(); ++e) {
      const std::size_t at = static_cast<std::size_t>(h * E) + e;
      evicted[at] = static_cast<std::int32_t>(mm.evicted[e]);
      target[at] = static_cast<std::int32_t>(mm.target[e]);
      gate[at] = mm.gate[e];
    }
  }
  engine::write_npy(dir + "/merge_evicted.npy", {H, E}, evicted.data());
  engine::write_npy(dir + "/merge_target.npy", {H, E}, target.data());
  engine::write_npy(dir + "/merge_gate.npy", {H, E}, gate.data());
  // Head g: per kept entry that received merges, the evicted entries folded into it with their gates.
  const MergeMap<float>& mm = r.heads[static_cast<std::size_t>(g)].merges;
  std::map<Index, std::vector<std::size_t>> into;
  std::size_t merged = 0;
  for (std::size_t e = 0; e < mm.evicted.size(); ++e)
    if (mm.target[e] >= 0 && mm.gate[e] > 0.0f) {
      into[mm.target[e]].push_back(e);
      ++merged;
    }
  out << "head " << g << ": " << mm.evicted.size() << " evicted, " << merged << " merged into " << into.size()
      << " kept entries, " << mm.evicted.size() - merged << " dropped\n";
  char buf[64];
  for (const auto& [kept, list] : into) {
    out << "  " << kept << " <-";
    for (const std::size_t e : list) {
      std::snprintf(buf, sizeof buf, " %lld (%.3f)", static_cast<long long>(mm.evicted[e]), static_cast<double>(mm.gate[e]));
      out << buf;
    }
    out << "\n";
  }
}

inline int cmd_compress(Args& a, std::ostream& out) {
  const std::string kp = a.path("keys"), vp = a.path("values"), qp = a.path("queries"), dir = a.path("out");
  const std::string wp = a.path("wo");  // optional: the layer's output projection (criticalkv)
  const std::string method = a.str("method", "selkv");
  if (kp.empty() || vp.empty() || qp.empty() || dir.empty())
    throw std::invalid_argument("compress needs --keys, --values, --queries and --out");
  const Budget budget = budget_from(a);
  MethodOptions opts = method_options(a);
  const Index explain = a.has("explain") ? a.integer("explain", 0, 0, std::numeric_limits<Index>::max()) : -1;
  opts.record_merges = explain >= 0;
  a.reject_unused();
  const engine::NpyArray K = engine::read_npy(kp), V = engine::read_npy(vp), Q = engine::read_npy(qp);
  auto check = [](const engine::NpyArray& arr, const std::string& path, const char* name) {
    if (!arr.is_float() || arr.shape.size() != 3)
      throw std::invalid_argument(path + ": " + name + " must be a float32 or float16 array of rank 3");
  };
  check(K, kp, "keys");
  check(V, vp, "values");
  check(Q, qp, "queries");
  LayerView<float> layer{make_head_major<const float>(K.f.data(), K.shape[0], K.shape[1], K.shape[2]),
                         make_head_major<const float>(V.f.data(), V.shape[0], V.shape[1], V.shape[2]),
                         make_head_major<const float>(Q.f.data(), Q.shape[0], Q.shape[1], Q.shape[2])};
  engine::NpyArray Wo;
  if (!wp.empty()) {
    Wo = engine::read_npy(wp);
    if (!Wo.is_float() || Wo.shape.size() != 2)
      throw std::invalid_argument(wp + ": wo must be a float32 or float16 array of rank 2 ([model dim][Hq·d])");
    layer.output_projection = {Wo.f.data(), Wo.shape[0], Wo.shape[1], Wo.shape[1]};
  }
  const LayerResult<float> r = make_method(method, opts)(layer, budget);
  // Heads may keep different numbers of entries (per-head budgets): every array has room for the
  // longest, and the rows beyond a head's length are padding (position -1, zeros elsewhere).
  const std::int64_t H = static_cast<std::int64_t>(r.heads.size()), m = r.max_size(), d = K.shape[2];
  std::vector<float> keys(static_cast<std::size_t>(H * m * d), 0.0f), values(keys.size(), 0.0f);
  std::vector<float> bias(static_cast<std::size_t>(H * m), 0.0f);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(H * m), -1), lengths(static_cast<std::size_t>(H));
  const std::vector<Index> len = compact_into(r, make_head_major(keys.data(), H, m, d), make_head_major(values.data(), H, m, d));
  compact_bias_into(r, bias.data(), m, m);
  for (std::int64_t g = 0; g < H; ++g) {
    lengths[static_cast<std::size_t>(g)] = static_cast<std::int32_t>(len[static_cast<std::size_t>(g)]);
    for (std::int64_t i = 0; i < len[static_cast<std::size_t>(g)]; ++i)
      pos[static_cast<std::size_t>(g * m + i)] = static_cast<std::int32_t>(r.heads[static_cast<std::size_t>(g)].positions[i]);
  }
  if (explain >= H)
    throw std::invalid_argument("--explain " + std::to_string(explain) + ": the keys have " + std::to_string(H) +
                                " KV heads");
  std::filesystem::create_directories(dir);
  if (explain >= 0) write_merge_map(r, explain, dir, out);
  engine::write_npy(dir + "/positions.npy", {H, m}, pos.data());
  engine::write_npy(dir + "/keys.npy", {H, m, d}, keys.data());
  engine::write_npy(dir + "/values.npy", {H, m, d}, values.data());
  engine::write_npy(dir + "/bias.npy", {H, m}, bias.data());
  engine::write_npy(dir + "/lengths.npy", {H}, lengths.data());
  std::int64_t total = 0;
  for (Index l : len) total += l;
  out << "kept " << total << " of " << H * K.shape[1] << " entries (at most " << m << " per head); next position "
      << r.next_position << "; wrote " << dir << "/{positions,keys,values,bias,lengths}.npy\n";
  return 0;
}

inline std::string usage() {
  std::string methods;
  for (const auto& name : method_names()) methods += " " + name;
  return "usage: kvcompress <generate|eval|compress> [options]\n"
         "  generate --prompt TEXT --method M (--ratio R | --budget M) [--max-tokens 128] [--window 32]\n"
         "  eval     [--tokens F.npy | --samples 24 --seed 1 --length 512] --prefix 384 --methods a,b --ratios r1,r2\n"
         "           [--window 32] [--json | --csv] [--quiet]\n"
         "  eval     --task recall [--model recall-gqa.bin --filler-model stories260K.bin] [--samples 60 --seed 1\n"
         "           --length 2048] [--settings question-last,question-later] [--threads 1] --methods a,b --ratios r1,r2\n"
         "  compress --keys K.npy --values V.npy --queries Q.npy --method M (--ratio R | --budget M) --out DIR\n"
         "           [--wo WO.npy: the layer's output projection [D][Hq*d], for criticalkv]\n"
         "           [--explain G: merge_{evicted,target,gate}.npy, and head G's merges printed]\n"
         "common: --model FILE --tokenizer FILE (default: $KVC_MODEL_DIR, ./models, ../shared/models)\n"
         "method options: --window --pool --pooling avg|max|none --recent --sinks --bucket\n"
         "  --route key-cosine|window-mass|co-attention|global --selection shared|per-head --alpha --r-max\n"
         "  --lambda (fixed λ) --lambda-mode holdout|fixed --holdout-every --beta --steps --safeguard on|off\n"
         "  --reposition --threshold --rope-base B (compress: the keys' RoPE base, default 10000)\n"
         "stages swapped into the method: --scorer METHOD (its scorer) --merger drop|merge-all|soft-gate|ridge|nearest-key|cam\n"
         "  --compensator none|log-ratio|merge-count --allocation uniform|adakv\n"
         "  --block-size b (whole blocks of b entries kept or evicted) --block-score mean|max\n"
         "generate, eval: --layer-budgets uniform|pyramid [--pyramid-beta 20]\n"
         "  --prefill-chunk C (compress after every C prompt tokens) --decode-budget N [--compress-every K]\n"
         "methods:" + methods + "\n";
}

int run_command(int argc, char** argv, std::ostream& out, std::ostream& err) {
  if (argc < 2) {
    err << usage();
    return 2;
  }
  const std::string cmd = argv[1];
  try {
    Args a(argc, argv, 2);
    if (cmd == "generate") return cmd_generate(a, out);
    if (cmd == "eval") return cmd_eval(a, out);
    if (cmd == "compress") return cmd_compress(a, out);
    if (cmd == "--help" || cmd == "help" || cmd == "-h") {
      out << usage();
      return 0;
    }
    err << "unknown subcommand '" << cmd << "'\n" << usage();
    return 2;
  } catch (const std::invalid_argument& e) {
    err << "kvcompress " << cmd << ": " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    err << "kvcompress " << cmd << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace kvc::cli

#endif  // KVC_CLI_COMMANDS_DEFINE
