// Float inference engine for llama2.c legacy checkpoints, with a compressible per-layer KV cache.
//
// Contents: Config, Model (validated checkpoint loader), Tokenizer (tok*.bin loader, decode, greedy
// BPE encode), Session (KV cache + RoPE position, forward, prefill recording the window queries,
// compress hook, extend/feed: a batched multi-token step over a possibly compressed cache,
// keep_queries/cache_input/compress_grown: compression while the cache grows, chunk by chunk or
// token by token),
// full_compressor(), sampling helpers (argmax, softmax, log_softmax, seeded
// temperature sampling) and generate().
//
// Numerics follow the llama2.c reference: RMSNorm eps 1e-5, RoPE on interleaved pairs
// (x[2i], x[2i+1]) with frequency θ^(-2i/head_size) (θ read off the file's freq_cis tables: 10000 in
// llama2.c's models), grouped-query attention (query head h reads KV head h / (n_heads / n_kv_heads)),
// SwiGLU FFN w2(silu(w1 x) * w3 x), classifier shared with the token embedding when vocab_size > 0 in
// the header.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvc::engine {

// ---------------------------------------------------------------------------------------------
// Small file helpers shared by the loaders
// ---------------------------------------------------------------------------------------------
namespace detail {

inline std::runtime_error file_error(const std::string& path, const std::string& what) {
  return std::runtime_error("kvc::engine: '" + path + "': " + what);
}

inline bool host_is_little_endian() {
  const std::uint32_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

inline std::uint32_t load_le_u32(const unsigned char* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}

inline std::int32_t load_le_i32(const unsigned char* p) {
  const std::uint32_t u = load_le_u32(p);
  std::int32_t v = 0;
  std::memcpy(&v, &u, 4);
  return v;
}

inline float load_le_f32(const unsigned char* p) {
  const std::uint32_t u = load_le_u32(p);
  float v = 0;
  std::memcpy(&v, &u, 4);
  return v;
}

/// Size of a regular file in bytes; throws naming the file when it is missing or not a file.
inline std::uint64_t regular_file_size(const std::string& path, const char* kind) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (!std::filesystem::exists(p, ec)) throw file_error(path, std::string(kind) + " file does not exist");
  if (!std::filesystem::is_regular_file(p, ec)) {
    throw file_error(path, std::string(kind) + " path is not a regular file");
  }
  const std::uintmax_t size = std::filesystem::file_size(p, ec);
  if (ec) throw file_error(path, std::string("cannot query the size of the ") + kind + " file: " + ec.message());
  return static_cast<std::uint64_t>(size);
}

/// Reads exactly `n` bytes or throws naming the file.
inline void read_exact(std::istream& in, char* dst, std::uint64_t n, const std::string& path, const char* what) {
  in.read(dst, static_cast<std::streamsize>(n));
  if (!in || static_cast<std::uint64_t>(in.gcount()) != n) {
    throw file_error(path, std::string("read error while reading ") + what);
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Config and Model
// ---------------------------------------------------------------------------------------------

/// The seven-int32 header of a llama2.c legacy checkpoint (vocab_size stored as its absolute value).
struct Config {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int seq_len = 0;
  bool shared_classifier = true;  ///< header vocab_size > 0: the classifier is the token embedding

  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return head_size() * n_kv_heads; }
  int group() const { return n_heads / n_kv_heads; }  ///< G = Hq / Hkv
};

/// Upper bounds accepted in a checkpoint header (anything larger is treated as a corrupt header).
struct ConfigLimits {
  static constexpr int kMaxDim = 1 << 16;
  static constexpr int kMaxHiddenDim = 1 << 20;
  static constexpr int kMaxLayers = 1 << 12;
  static constexpr int kMaxHeads = 1 << 12;
  static constexpr int kMaxVocab = 1 << 22;
  static constexpr int kMaxSeqLen = 1 << 22;
};

/// Frequency of RoPE pair i (dimensions 2i, 2i+1) for a head of `head_size`: base^(-2i/head_size).
inline double rope_frequency(int pair, int head_size, double base) {
  return std::pow(base, -2.0 * static_cast<double>(pair) / static_cast<double>(head_size));
}

/// Rotates each of `n_heads` vectors of `head_size` floats (contiguous) in place by RoPE at `position`,
/// interleaved pairs: (x0, x1) <- (x0 cos a - x1 sin a, x0 sin a + x1 cos a), a = position * freq_i.
/// Angles are computed in double. O(n_heads * head_size).
inline void rope_rotate(float* v, int n_heads, int head_size, std::ptrdiff_t position, double base) {
  for (int i = 0; i < head_size / 2; ++i) {
    const double angle = static_cast<double>(position) * rope_frequency(i, head_size, base);
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    for (int h = 0; h < n_heads; ++h) {
      float* x = v + static_cast<std::ptrdiff_t>(h) * head_size + 2 * i;
      const float x0 = x[0];
      const float x1 = x[1];
      x[0] = x0 * c - x1 * s;
      x[1] = x0 * s + x1 * c;
    }
  }
}

/// Weights of one transformer block (row-major [out][in] matrices, pointers into Model storage).
struct LayerWeights {
  const float* rms_att;  // (dim)
  const float* wq;       // (dim, dim)
  const float* wk;       // (kv_dim, dim)
  const float* wv;       // (kv_dim, dim)
  const float* wo;       // (dim, dim)
  const float* rms_ffn;  // (dim)
  const float* w1;       // (hidden, dim)
  const float* w2;       // (dim, hidden)
  const float* w3;       // (hidden, dim)
};

/// Weights and config of a llama2.c legacy checkpoint. Movable, not copyable (LayerWeights point into it).
class Model {
 public:
  /// Loads and validates `path`. Throws std::runtime_error naming the file and the problem when the
  /// file is missing or unreadable, a header value is invalid, the size is not exactly what the header
  /// implies (truncated or trailing bytes), a tensor holds NaN/Inf, or the freq_cis tables are not
  /// RoPE tables of one base (rope_base()).
  static Model load(const std::string& path) {
    const std::uint64_t file_size = detail::regular_file_size(path, "checkpoint");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw detail::file_error(path, "cannot open the checkpoint for reading");
    return load(in, file_size, path);
  }

  /// Loads a checkpoint of `file_size` bytes from `in` (the same checks as load(path); `path` names
  /// the source in messages). Used by the fuzz target on in-memory input.
  static Model load(std::istream& in, std::uint64_t file_size, const std::string& path) {
    Model model;
    model.path_ = path;
    if (!detail::host_is_little_endian()) {
      throw detail::file_error(path, "checkpoints are little-endian; big-endian hosts are not supported");
    }
    constexpr std::uint64_t kHeaderBytes = 7 * 4;
    if (file_size < kHeaderBytes) {
      throw detail::file_error(path, "checkpoint is " + std::to_string(file_size) +
                                         " bytes, too short for the 28-byte header (truncated?)");
    }
    unsigned char header[kHeaderBytes];
    detail::read_exact(in, reinterpret_cast<char*>(header), kHeaderBytes, path, "the header");
    std::int32_t h[7];
    for (int i = 0; i < 7; ++i) h[i] = detail::load_le_i32(header + 4 * i);
    model.config_ = validate_header(path, h);
    const Config& c = model.config_;

    // Tensor table in file order: (name, element count).
    const std::uint64_t L = static_cast<std::uint64_t>(c.n_layers);
    const std::uint64_t dim = static_cast<std::uint64_t>(c.dim);
    const std::uint64_t kv = static_cast<std::uint64_t>(c.kv_dim());
    const std::uint64_t hid = static_cast<std::uint64_t>(c.hidden_dim);
    const std::uint64_t voc = static_cast<std::uint64_t>(c.vocab_size);
    const std::uint64_t half = static_cast<std::uint64_t>(c.seq_len) * static_cast<std::uint64_t>(c.head_size() / 2);
    std::vector<std::pair<const char*, std::uint64_t>> tensors = {
        {"token_embedding", voc * dim}, {"rms_att", L * dim},       {"wq", L * dim * dim},
        {"wk", L * kv * dim},           {"wv", L * kv * dim},       {"wo", L * dim * dim},
        {"rms_ffn", L * dim},           {"w1", L * hid * dim},      {"w2", L * dim * hid},
        {"w3", L * hid * dim},          {"rms_final", dim},         {"freq_cis_real", half},
        {"freq_cis_imag", half}};
    if (!c.shared_classifier) tensors.push_back({"wclassifier", voc * dim});
    std::uint64_t total = 0;
    for (const auto& t : tensors) total += t.second;
    const std::uint64_t expected = kHeaderBytes + 4 * total;
    const std::string cfg = describe(c);
    if (file_size < expected) {
      throw detail::file_error(path, "checkpoint is truncated: the header (" + cfg + ") implies " +
                                         std::to_string(expected) + " bytes, the file has " +
                                         std::to_string(file_size));
    }
    if (file_size > expected) {
      throw detail::file_error(path, "checkpoint is too long: the header (" + cfg + ") implies " +
                                         std::to_string(expected) + " bytes, the file has " +
                                         std::to_string(file_size) + " (" +
                                         std::to_string(file_size - expected) +
                                         " trailing bytes; wrong header or not a llama2.c legacy checkpoint)");
    }
    model.data_.resize(static_cast<std::size_t>(total));
    detail::read_exact(in, reinterpret_cast<char*>(model.data_.data()), 4 * total, path, "the tensors");

    // Offsets and a finiteness check per tensor.
    std::vector<std::uint64_t> offset(tensors.size());
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      offset[i] = at;
      for (std::uint64_t e = 0; e < tensors[i].second; ++e) {
        if (!std::isfinite(model.data_[static_cast<std::size_t>(at + e)])) {
          throw detail::file_error(path, std::string("tensor '") + tensors[i].first +
                                             "' holds a non-finite value at element " + std::to_string(e));
        }
      }
      at += tensors[i].second;
    }
    model.off_embedding_ = offset[0];
    model.off_rms_att_ = offset[1];
    model.off_wq_ = offset[2];
    model.off_wk_ = offset[3];
    model.off_wv_ = offset[4];
    model.off_wo_ = offset[5];
    model.off_rms_ffn_ = offset[6];
    model.off_w1_ = offset[7];
    model.off_w2_ = offset[8];
    model.off_w3_ = offset[9];
    model.off_rms_final_ = offset[10];
    model.off_freq_real_ = offset[11];
    model.off_freq_imag_ = offset[12];
    model.off_classifier_ = c.shared_classifier ? offset[0] : offset[13];

    // The RoPE base is read off the tables (the format has no field for it); then every entry must match
    // what the forward pass computes with it. The tables were written in float32, whose angle error
    // grows with the position: allow for it.
    model.rope_base_ = model.estimate_rope_base();
    model.rope_error_ = model.compute_rope_table_error();
    const double tol = 1e-3 + 1e-6 * c.seq_len;
    if (!(model.rope_error_ <= tol)) {
      throw detail::file_error(path, "freq_cis tables differ from RoPE base " + std::to_string(model.rope_base_) +
                                         " (read off their second pair) by " + std::to_string(model.rope_error_) +
                                         " (tolerance " + std::to_string(tol) +
                                         "); unsupported RoPE variant or corrupt file");
    }
    return model;
  }

  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const Config& config() const { return config_; }
  const std::string& path() const { return path_; }

  const float* token_embedding() const { return ptr(off_embedding_); }  // (vocab, dim)
  const float* rms_final() const { return ptr(off_rms_final_); }        // (dim)
  const float* classifier() const { return ptr(off_classifier_); }      // (vocab, dim)
  const float* freq_cis_real() const { return ptr(off_freq_real_); }    // (seq_len, head_size/2)
  const float* freq_cis_imag() const { return ptr(off_freq_imag_); }    // (seq_len, head_size/2)

  LayerWeights layer(int l) const {
    const Config& c = config_;
    const std::uint64_t L = static_cast<std::uint64_t>(l);
    const std::uint64_t dim = static_cast<std::uint64_t>(c.dim);
    const std::uint64_t kv = static_cast<std::uint64_t>(c.kv_dim());
    const std::uint64_t hid = static_cast<std::uint64_t>(c.hidden_dim);
    return LayerWeights{ptr(off_rms_att_ + L * dim),         ptr(off_wq_ + L * dim * dim),
                        ptr(off_wk_ + L * kv * dim),         ptr(off_wv_ + L * kv * dim),
                        ptr(off_wo_ + L * dim * dim),        ptr(off_rms_ffn_ + L * dim),
                        ptr(off_w1_ + L * hid * dim),        ptr(off_w2_ + L * dim * hid),
                        ptr(off_w3_ + L * hid * dim)};
  }

  /// The RoPE base θ of the freq_cis tables: pair i turns by θ^(-2i/head_size) per position (10000 in
  /// llama2.c's models; 10000 also where the tables cannot tell, head size 2 or a context of 1).
  double rope_base() const { return rope_base_; }
  /// Max |file table - cos/sin(pos * rope_base()^(-2i/head_size))| over the freq_cis tables.
  double rope_table_max_error() const { return rope_error_; }

  /// "dim=64 hidden_dim=172 ..." for messages.
  static std::string describe(const Config& c) {
    return "dim=" + std::to_string(c.dim) + " hidden_dim=" + std::to_string(c.hidden_dim) +
           " n_layers=" + std::to_string(c.n_layers) + " n_heads=" + std::to_string(c.n_heads) +
           " n_kv_heads=" + std::to_string(c.n_kv_heads) + " vocab_size=" +
           std::to_string(c.shared_classifier ? c.vocab_size : -c.vocab_size) +
           " seq_len=" + std::to_string(c.seq_len);
  }

 private:
  Model() = default;

  const float* ptr(std::uint64_t offset) const { return data_.data() + offset; }

  static Config validate_header(const std::string& path, const std::int32_t* h) {
    const char* names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    const int limits[7] = {ConfigLimits::kMaxDim,   ConfigLimits::kMaxHiddenDim, ConfigLimits::kMaxLayers,
                           ConfigLimits::kMaxHeads, ConfigLimits::kMaxHeads,     ConfigLimits::kMaxVocab,
                           ConfigLimits::kMaxSeqLen};
    auto bad = [&](const std::string& what) {
      return detail::file_error(path, "invalid checkpoint header: " + what);
    };
    for (int i = 0; i < 7; ++i) {
      const std::int64_t v = (i == 5) ? std::abs(static_cast<std::int64_t>(h[i])) : h[i];
      if (v <= 0) {
        throw bad(std::string(names[i]) + " = " + std::to_string(h[i]) +
                  (i == 5 ? " (must be non-zero)" : " (must be positive)"));
      }
      if (v > limits[i]) {
        throw bad(std::string(names[i]) + " = " + std::to_string(h[i]) + " exceeds the limit " +
                  std::to_string(limits[i]));
      }
    }
    Config c;
    c.dim = h[0];
    c.hidden_dim = h[1];
    c.n_layers = h[2];
    c.n_heads = h[3];
    c.n_kv_heads = h[4];
    c.shared_classifier = h[5] > 0;
    c.vocab_size = h[5] > 0 ? h[5] : -h[5];
    c.seq_len = h[6];
    if (c.dim % c.n_heads != 0) {
      throw bad("dim = " + std::to_string(c.dim) + " is not divisible by n_heads = " + std::to_string(c.n_heads));
    }
    if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0) {
      throw bad("n_heads = " + std::to_string(c.n_heads) + " is not a multiple of n_kv_heads = " +
                std::to_string(c.n_kv_heads));
    }
    if (c.head_size() % 2 != 0) {
      throw bad("head size dim / n_heads = " + std::to_string(c.head_size()) + " is odd (RoPE needs pairs)");
    }
    return c;
  }

  /// θ from pair 1's angle: its turn per position, read at position 1 (below π as long as θ > 1), then
  /// refined at the last position, unwrapped by the first reading (float32 tables: the angle's error
  /// divides by the position).
  double estimate_rope_base() const {
    const int half = config_.head_size() / 2;
    const std::ptrdiff_t last = config_.seq_len - 1;
    if (half < 2 || last < 1) return 10000.0;
    auto angle = [&](std::ptrdiff_t p) {
      const std::size_t k = static_cast<std::size_t>(p) * static_cast<std::size_t>(half) + 1;
      return std::atan2(static_cast<double>(freq_cis_imag()[k]), static_cast<double>(freq_cis_real()[k]));
    };
    const double pi = 3.14159265358979323846;
    double turn = angle(1);
    if (!(turn > 0.0)) return 10000.0;  // no base > 1 gives this: the table check reports the mismatch
    const double predicted = turn * static_cast<double>(last);
    turn = (angle(last) + 2.0 * pi * std::round((predicted - angle(last)) / (2.0 * pi))) / static_cast<double>(last);
    return std::pow(turn, -static_cast<double>(config_.head_size()) / 2.0);
  }

  double compute_rope_table_error() const {
    const int hs = config_.head_size();
    const int half = hs / 2;
    double err = 0;
    for (int p = 0; p < config_.seq_len; ++p) {
      for (int i = 0; i < half; ++i) {
        const double a = static_cast<double>(p) * rope_frequency(i, hs, rope_base_);
        const std::size_t k = static_cast<std::size_t>(p) * static_cast<std::size_t>(half) + static_cast<std::size_t>(i);
        err = std::max(err, std::abs(static_cast<double>(freq_cis_real()[k]) - std::cos(a)));
        err = std::max(err, std::abs(static_cast<double>(freq_cis_imag()[k]) - std::sin(a)));
      }
    }
    return err;
  }

  Config config_;
  std::string path_;
  std::vector<float> data_;
  std::uint64_t off_embedding_ = 0, off_rms_att_ = 0, off_wq_ = 0, off_wk_ = 0, off_wv_ = 0, off_wo_ = 0,
                off_rms_ffn_ = 0, off_w1_ = 0, off_w2_ = 0, off_w3_ = 0, off_rms_final_ = 0,
                off_freq_real_ = 0, off_freq_imag_ = 0, off_classifier_ = 0;
  double rope_base_ = 10000.0;
  double rope_error_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------------

/// llama2.c tokenizer: int32 max_token_length, then per token float32 score, int32 length, bytes.
class Tokenizer {
 public:
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;

  /// Loads `path` holding exactly `vocab_size` entries. Throws std::runtime_error naming the file and
  /// the problem (missing, truncated, bad lengths, non-finite scores, trailing bytes).
  static Tokenizer load(const std::string& path, int vocab_size) {
    if (vocab_size < 3 || vocab_size > ConfigLimits::kMaxVocab) {
      throw detail::file_error(path, "tokenizer vocab_size " + std::to_string(vocab_size) +
                                         " out of range [3, " + std::to_string(ConfigLimits::kMaxVocab) + "]");
    }
    const std::uint64_t size = detail::regular_file_size(path, "tokenizer");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw detail::file_error(path, "cannot open the tokenizer for reading");
    std::vector<unsigned char> bytes(static_cast<std::size_t>(size));
    if (size > 0) detail::read_exact(in, reinterpret_cast<char*>(bytes.data()), size, path, "the tokenizer");
    return parse(bytes, path, vocab_size);
  }

  /// Parses the bytes of a tokenizer file (the checks of load(); `path` names the source in messages).
  static Tokenizer parse(const std::vector<unsigned char>& bytes, const std::string& path, int vocab_size) {
    if (vocab_size < 3 || vocab_size > ConfigLimits::kMaxVocab) {
      throw detail::file_error(path, "tokenizer vocab_size " + std::to_string(vocab_size) +
                                         " out of range [3, " + std::to_string(ConfigLimits::kMaxVocab) + "]");
    }
    Tokenizer tok;
    std::size_t at = 0;
    auto need = [&](std::size_t n, const std::string& what) {
      if (bytes.size() - at < n) {
        throw detail::file_error(path, "tokenizer is truncated at byte " + std::to_string(at) + " while reading " + what);
      }
    };
    need(4, "max_token_length");
    const std::int32_t max_len = detail::load_le_i32(bytes.data());
    at += 4;
    if (max_len <= 0 || max_len > (1 << 20)) {
      throw detail::file_error(path, "tokenizer max_token_length = " + std::to_string(max_len) + " is invalid");
    }
    tok.max_token_length_ = max_len;
    tok.pieces_.resize(static_cast<std::size_t>(vocab_size));
    tok.scores_.resize(static_cast<std::size_t>(vocab_size));
    for (int id = 0; id < vocab_size; ++id) {
      const std::string which = "token " + std::to_string(id);
      need(8, which + " score and length");
      const float score = detail::load_le_f32(bytes.data() + at);
      const std::int32_t len = detail::load_le_i32(bytes.data() + at + 4);
      at += 8;
      if (!std::isfinite(score)) throw detail::file_error(path, "tokenizer " + which + " has a non-finite score");
      if (len < 0 || len > max_len) {
        throw detail::file_error(path, "tokenizer " + which + " has length " + std::to_string(len) +
                                           " outside [0, max_token_length = " + std::to_string(max_len) + "]");
      }
      need(static_cast<std::size_t>(len), which + " bytes");
      tok.pieces_[static_cast<std::size_t>(id)].assign(reinterpret_cast<const char*>(bytes.data() + at),
                                                       static_cast<std::size_t>(len));
      tok.scores_[static_cast<std::size_t>(id)] = score;
      at += static_cast<std::size_t>(len);
    }
    if (at != bytes.size()) {
      throw detail::file_error(path, "tokenizer has " + std::to_string(bytes.size() - at) +
                                         " trailing bytes after " + std::to_string(vocab_size) +
                                         " tokens (vocab size mismatch?)");
    }
    tok.byte_ids_.fill(-1);
    for (int id = 0; id < vocab_size; ++id) {
      const std::string& p = tok.pieces_[static_cast<std::size_t>(id)];
      tok.lookup_.emplace(p, id);  // first id wins for duplicate pieces
      const int b = byte_of_piece(p);
      if (b >= 0 && tok.byte_ids_[static_cast<std::size_t>(b)] < 0) tok.byte_ids_[static_cast<std::size_t>(b)] = id;
    }
    return tok;
  }

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  int max_token_length() const { return max_token_length_; }
  const std::string& piece(int id) const { return pieces_.at(checked(id)); }
  float score(int id) const { return scores_.at(checked(id)); }

  /// Text of `token` following `prev_token`: a byte-fallback piece `<0xNN>` becomes that byte, and a
  /// leading space is dropped right after BOS (SentencePiece's dummy prefix). Throws std::out_of_range
  /// for ids outside [0, vocab_size).
  std::string decode(int prev_token, int token) const {
    const std::string& p = pieces_[checked(token)];
    const int b = byte_of_piece(p);
    if (b >= 0) return std::string(1, static_cast<char>(static_cast<unsigned char>(b)));
    if (prev_token == kBos && !p.empty() && p[0] == ' ') return p.substr(1);
    return p;
  }

  /// Concatenated text of a token sequence: tokens[i] is decoded after tokens[i-1] (after BOS for
  /// i = 0); BOS and EOS tokens themselves produce no text.
  std::string decode(const std::vector<int>& tokens) const {
    std::string out;
    int prev = kBos;
    for (const int t : tokens) {
      if (t != kBos && t != kEos) out += decode(prev, t);
      prev = t;
    }
    return out;
  }

  /// Greedy BPE: prepend a space (dummy prefix) to non-empty text, split into UTF-8 code points
  /// (unknown ones fall back to `<0xNN>` byte pieces), then repeatedly merge the adjacent pair whose
  /// concatenation is a vocabulary piece with the highest score (leftmost on ties). Optional BOS/EOS.
  /// O(n^2) in the text length; meant for prompts.
  std::vector<int> encode(const std::string& text, bool bos, bool eos = false) const {
    std::vector<int> ids;
    if (!text.empty()) {
      const std::string s = " " + text;
      std::size_t i = 0;
      while (i < s.size()) {
        std::size_t n = 1;
        const unsigned char lead = static_cast<unsigned char>(s[i]);
        if (lead >= 0xC0) {
          while (n < 4 && i + n < s.size() && (static_cast<unsigned char>(s[i + n]) & 0xC0) == 0x80) ++n;
        }
        const std::string cp = s.substr(i, n);
        const auto it = lookup_.find(cp);
        if (it != lookup_.end()) {
          ids.push_back(it->second);
        } else {
          for (const char ch : cp) {
            const int id = byte_ids_[static_cast<unsigned char>(ch)];
            if (id < 0) {
              throw std::runtime_error("kvc::engine: tokenizer has no piece and no byte fallback for byte " +
                                       std::to_string(static_cast<unsigned char>(ch)));
            }
            ids.push_back(id);
          }
        }
        i += n;
      }
      while (ids.size() >= 2) {
        float best = -std::numeric_limits<float>::infinity();
        int best_id = -1;
        std::size_t best_at = 0;
        for (std::size_t k = 0; k + 1 < ids.size(); ++k) {
          const auto it = lookup_.find(pieces_[static_cast<std::size_t>(ids[k])] +
                                       pieces_[static_cast<std::size_t>(ids[k + 1])]);
          if (it != lookup_.end() && (best_id < 0 || scores_[static_cast<std::size_t>(it->second)] > best)) {
            best = scores_[static_cast<std::size_t>(it->second)];
            best_id = it->second;
            best_at = k;
          }
        }
        if (best_id < 0) break;
        ids[best_at] = best_id;
        ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
      }
    }
    if (bos) ids.insert(ids.begin(), kBos);
    if (eos) ids.push_back(kEos);
    return ids;
  }

  /// 0..255 when `p` is exactly a byte-fallback piece `<0xNN>` (hex, either case), else -1.
  static int byte_of_piece(const std::string& p) {
    if (p.size() != 6 || p[0] != '<' || p[1] != '0' || p[2] != 'x' || p[5] != '>') return -1;
    auto hex = [](char ch) {
      if (ch >= '0' && ch <= '9') return ch - '0';
      if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
      if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
      return -1;
    };
    const int hi = hex(p[3]);
    const int lo = hex(p[4]);
    return (hi < 0 || lo < 0) ? -1 : hi * 16 + lo;
  }

 private:
  std::size_t checked(int id) const {
    if (id < 0 || id >= vocab_size()) {
      throw std::out_of_range("kvc::engine: token id " + std::to_string(id) + " outside [0, " +
                              std::to_string(vocab_size()) + ")");
    }
    return static_cast<std::size_t>(id);
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;
  std::array<int, 256> byte_ids_{};
  int max_token_length_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Compression hook types
// ---------------------------------------------------------------------------------------------

/// One layer's cache handed to a compressor. keys/values: element (g, j, c) at
/// `g * head_stride + j * d + c` for g < Hkv, j < n, c < d (post-RoPE keys as cached); in a paged
/// session (`blocks` non-null) they are pools [num_blocks][block_size][Hkv][d] and entry j lives in
/// row j % block_size of block blocks[j / block_size] (key_row, value_row).
/// queries: [Hq][W][d], row w of head h at `h * queries_head_stride + w * d` (0: W * d), the
/// post-RoPE queries of the tokens at cache entries n-W .. n-1 (SPEC §1 Qw).
/// positions, bias: [Hkv][n] with head stride `state_stride`, each entry's RoPE position and additive
/// logit bias; null after a prefill that nothing compressed yet (entry j at position j, bias 0).
struct LayerInput {
  int layer = 0;
  const float* keys = nullptr;
  const float* values = nullptr;
  const float* queries = nullptr;
  std::ptrdiff_t n = 0, W = 0, Hkv = 0, Hq = 0, d = 0;
  std::ptrdiff_t head_stride = 0;  ///< elements between heads in keys/values
  std::ptrdiff_t queries_head_stride = 0;
  const std::ptrdiff_t* positions = nullptr;
  const float* bias = nullptr;
  std::ptrdiff_t state_stride = 0;  ///< elements between heads in positions and bias
  const float* wo = nullptr;  ///< the layer's output projection [dim][Hq·d] (row-major, as the checkpoint's)
  std::ptrdiff_t dim = 0;     ///< its rows, the model dimension
  const std::int32_t* blocks = nullptr;  ///< paged session: the layer's block table
  std::ptrdiff_t block_size = 0, num_blocks = 0;

  /// The d keys / values of entry j of KV head g.
  const float* key_row(std::ptrdiff_t g, std::ptrdiff_t j) const { return row(keys, g, j); }
  const float* value_row(std::ptrdiff_t g, std::ptrdiff_t j) const { return row(values, g, j); }

 private:
  const float* row(const float* base, std::ptrdiff_t g, std::ptrdiff_t j) const {
    if (blocks == nullptr) return base + g * head_stride + j * d;
    return base + ((static_cast<std::ptrdiff_t>(blocks[j / block_size]) * block_size + j % block_size) * Hkv + g) * d;
  }
};

/// A compressor's result for one layer. keys/values: [Hkv][m][d]; bias: [Hkv][m] additive logit bias
/// (may be empty = all zeros; -inf is allowed to mask padding slots, NaN/+inf are not);
/// lengths: the entries of each KV head (<= m; rows beyond are padding and never read), or empty
/// when every head keeps m; next_position: RoPE position of the next decoded token (must agree
/// across layers); positions: [Hkv][m] each kept entry's RoPE position (that of its key), or empty:
/// head g's entry i at next_position − length_g + i.
struct CompressedLayer {
  std::ptrdiff_t m = 0;
  std::vector<std::ptrdiff_t> lengths;
  std::vector<std::ptrdiff_t> positions;
  std::vector<float> keys, values;
  std::vector<float> bias;
  std::ptrdiff_t next_position = 0;
};

using LayerCompressor = std::function<CompressedLayer(const LayerInput&)>;

/// Compression while the cache grows (chunked prefill, decoding): called with a layer's current cache
/// (Session::cache_input) after tokens were appended; returns the layer's new cache when it compressed
/// it, or nothing. Keeps its own state (steps since its last compression), so one per sequence.
using CacheCompressor = std::function<std::optional<CompressedLayer>(const LayerInput&)>;

/// Identity compressor: copies every entry, bias 0, next_position = n.
inline LayerCompressor full_compressor() {
  return [](const LayerInput& in) {
    CompressedLayer out;
    out.m = in.n;
    out.next_position = in.n;
    const std::size_t count = static_cast<std::size_t>(in.Hkv * in.n * in.d);
    out.keys.resize(count);
    out.values.resize(count);
    out.bias.assign(static_cast<std::size_t>(in.Hkv * in.n), 0.0f);
    for (std::ptrdiff_t g = 0; g < in.Hkv; ++g)
      for (std::ptrdiff_t j = 0; j < in.n; ++j) {
        std::copy_n(in.key_row(g, j), in.d, out.keys.begin() + (g * in.n + j) * in.d);
        std::copy_n(in.value_row(g, j), in.d, out.values.begin() + (g * in.n + j) * in.d);
      }
    return out;
  };
}

// ---------------------------------------------------------------------------------------------
// Session: KV cache, RoPE position, forward, prefill, compress
// ---------------------------------------------------------------------------------------------

/// Inference state over one Model (which must outlive the session). Per layer: keys and values
/// [Hkv][capacity][d], an additive logit bias and each entry's RoPE position [Hkv][capacity], a length
/// per KV head (equal until a compressor keeps different numbers of entries per head), the window
/// queries [Hq][W][d] recorded by the last prefill(), and with keep_queries() the queries of the
/// newest tokens. Head g's entries are its slots 0 .. length(layer, g) − 1; a new token goes to slot
/// length(layer, g) of every head g. One RoPE position counter `position()` for the next token; after
/// compression the lengths may be smaller than it.
///
/// Paged (page_size > 0): each layer keeps its keys and values in pages of page_size entries from a
/// pool of its own, [pages][page_size][Hkv][d] (vLLM's layout), listed in order by the layer's block
/// table; a page is taken when the cache grows into it, and a compression gives back the pages it no
/// longer needs: whole pages when it kept whole pages (block granularity), else the pages past its
/// longest head. The compressor reads the pages in place (LayerInput::blocks).
class Session {
 public:
  using MatRM = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  /// capacity: cache slots per head (0 = the model's seq_len); page_size: entries per page of a paged
  /// cache (0 = one contiguous [Hkv][capacity][d] buffer per layer).
  explicit Session(const Model& model, std::ptrdiff_t capacity = 0, std::ptrdiff_t page_size = 0) : model_(&model) {
    const Config& c = model.config();
    capacity_ = capacity > 0 ? capacity : c.seq_len;
    if (page_size < 0 || page_size > capacity_)
      throw std::invalid_argument("kvc::engine: page_size must be in [0, capacity = " + std::to_string(capacity_) +
                                  "], got " + std::to_string(page_size));
    d_ = c.head_size();
    page_ = page_size;
    const std::ptrdiff_t pages = page_ > 0 ? (capacity_ + page_ - 1) / page_ : 0;
    layers_.resize(static_cast<std::size_t>(c.n_layers));
    for (LayerState& s : layers_) {
      s.keys.assign(static_cast<std::size_t>(c.n_kv_heads * (page_ > 0 ? pages * page_ : capacity_) * d_), 0.0f);
      s.len.assign(static_cast<std::size_t>(c.n_kv_heads), 0);
      s.values.assign(s.keys.size(), 0.0f);
      s.bias.assign(static_cast<std::size_t>(c.n_kv_heads * capacity_), 0.0f);
      s.positions.assign(static_cast<std::size_t>(c.n_kv_heads * capacity_), 0);
      for (std::ptrdiff_t p = pages - 1; p >= 0; --p) s.free_pages.push_back(static_cast<std::int32_t>(p));
    }
  }

  const Model& model() const { return *model_; }
  std::ptrdiff_t capacity() const { return capacity_; }
  std::ptrdiff_t position() const { return pos_; }                 ///< RoPE position of the next token
  /// Cache entries of the longest KV head of `layer`.
  std::ptrdiff_t length(int layer) const {
    const LayerState& s = state(layer);
    return *std::max_element(s.len.begin(), s.len.end());
  }
  /// Cache entries of KV head g of `layer`.
  std::ptrdiff_t length(int layer, int g) const {
    const LayerState& s = state(layer);
    if (g < 0 || g >= static_cast<int>(s.len.size()))
      throw std::out_of_range("kvc::engine: KV head " + std::to_string(g) + " outside [0, " +
                              std::to_string(s.len.size()) + ")");
    return s.len[static_cast<std::size_t>(g)];
  }
  /// Entries held by every head of every layer: what a cache with per-head lengths stores (each entry
  /// a key and a value of head_dim() floats and a bias).
  std::ptrdiff_t entries() const {
    std::ptrdiff_t total = 0;
    for (const LayerState& s : layers_)
      for (const std::ptrdiff_t l : s.len) total += l;
    return total;
  }
  std::ptrdiff_t head_dim() const { return d_; }
  /// Elements between heads in keys()/values() (contiguous sessions; a paged one throws).
  std::ptrdiff_t head_stride() const {
    contiguous_only("head_stride()");
    return capacity_ * d_;
  }
  std::ptrdiff_t page_size() const { return page_; }  ///< entries per page (0: contiguous cache)
  /// Pages `layer` holds now (paged sessions).
  std::ptrdiff_t pages_in_use(int layer) const { return static_cast<std::ptrdiff_t>(state(layer).table.size()); }
  /// Pages given back by compressions since the session was created or reset, over all layers.
  std::ptrdiff_t pages_freed() const { return pages_freed_; }
  /// The d keys / values of entry i of KV head g of `layer` (either layout).
  const float* key_row(int layer, int g, std::ptrdiff_t i) const { return row(state(layer), state(layer).keys, g, i); }
  const float* value_row(int layer, int g, std::ptrdiff_t i) const { return row(state(layer), state(layer).values, g, i); }
  std::ptrdiff_t window() const { return window_; }              ///< rows of the recorded window queries
  bool window_valid() const { return window_valid_; }            ///< queries describe the current cache tail

  /// [Hkv][capacity][d] (contiguous sessions; a paged one throws: key_row / value_row read either).
  const float* keys(int layer) const {
    contiguous_only("keys()");
    return state(layer).keys.data();
  }
  const float* values(int layer) const {
    contiguous_only("values()");
    return state(layer).values.data();
  }
  const float* bias(int layer) const { return state(layer).bias.data(); }      // [Hkv][capacity]
  const float* queries(int layer) const { return state(layer).queries.data(); }  // [Hq][W][d]

  /// Empties the cache, zeroes the biases, resets the position to 0 and the counters
  /// (compressions(), peak_length()); keep_queries() stays set, with nothing kept.
  void reset() {
    for (LayerState& s : layers_) {
      std::fill(s.len.begin(), s.len.end(), 0);
      std::fill(s.bias.begin(), s.bias.end(), 0.0f);
      s.queries.clear();
      s.tail = 0;
      for (auto it = s.table.rbegin(); it != s.table.rend(); ++it) s.free_pages.push_back(*it);
      s.table.clear();
    }
    pos_ = 0;
    pages_freed_ = 0;
    ring_filled_ = 0;
    compressions_ = 0;
    peak_ = 0;
    window_ = 0;
    window_valid_ = false;
  }

  /// Feeds one token at position(), appends its key/value at slot len(layer) of every layer with bias
  /// 0, and returns the next-token logits (vocab). Throws std::out_of_range for a bad id and
  /// std::runtime_error when the cache is full or position() reached seq_len; nothing changes then.
  std::vector<float> forward(int token) {
    const MatRM logits = run_block(&token, 1, kNoWindowRows, LogitRows::kLast);
    window_valid_ = false;
    return row_vector(logits, 0);
  }

  /// Feeds `tokens` in one batched pass over the current cache, which may be compressed (its biases
  /// apply): token t goes to slot len(layer) + t of every layer with bias 0, at RoPE position
  /// position() + t, and attends to the existing cache plus tokens 0..t (causal). Returns the
  /// next-token logits after every token ([tokens.size()][vocab]); equals calling forward() on each
  /// token in turn, to float rounding. Records no window queries (a following compress() is refused).
  /// Throws like forward() (bad id, cache full, seq_len reached) before anything is written. An empty
  /// `tokens` returns no rows and changes nothing.
  std::vector<std::vector<float>> extend(const std::vector<int>& tokens) {
    const std::ptrdiff_t T = static_cast<std::ptrdiff_t>(tokens.size());
    if (T == 0) return {};
    const MatRM logits = run_block(tokens.data(), T, kNoWindowRows, LogitRows::kAll);
    window_valid_ = false;
    std::vector<std::vector<float>> out(static_cast<std::size_t>(T));
    for (std::ptrdiff_t t = 0; t < T; ++t) out[static_cast<std::size_t>(t)] = row_vector(logits, t);
    return out;
  }

  /// extend() returning only the logits after the last token (empty `tokens`: an error).
  std::vector<float> feed(const std::vector<int>& tokens) {
    if (tokens.empty()) throw std::invalid_argument("kvc::engine: feed() needs at least one token");
    const MatRM logits = run_block(tokens.data(), static_cast<std::ptrdiff_t>(tokens.size()), kNoWindowRows, LogitRows::kLast);
    window_valid_ = false;
    return row_vector(logits, 0);
  }

  /// Runs `tokens` (non-empty) and returns the logits after the last one. Records, for every layer,
  /// the post-RoPE queries of the last W = min(window, tokens.size()) tokens as [Hq][W][d].
  /// `batched` runs all tokens through each layer at once (GEMMs); otherwise token by token. The two
  /// agree to float rounding. Requires an uncompressed session (len == position in every layer).
  std::vector<float> prefill(const std::vector<int>& tokens, std::ptrdiff_t window, bool batched = true) {
    if (tokens.empty()) throw std::invalid_argument("kvc::engine: prefill() needs at least one token");
    if (window < 0) throw std::invalid_argument("kvc::engine: prefill() window must be >= 0, got " + std::to_string(window));
    for (const LayerState& s : layers_) {
      for (const std::ptrdiff_t len : s.len) {
        if (len != pos_) {
          throw std::runtime_error("kvc::engine: prefill() on a compressed session (cache length " +
                                   std::to_string(len) + " != position " + std::to_string(pos_) + ")");
        }
      }
    }
    check_room(static_cast<std::ptrdiff_t>(tokens.size()));
    check_tokens(tokens.data(), static_cast<std::ptrdiff_t>(tokens.size()));
    const std::ptrdiff_t T = static_cast<std::ptrdiff_t>(tokens.size());
    const std::ptrdiff_t W = std::min(window, T);
    const Config& c = model_->config();
    for (LayerState& s : layers_) s.queries.assign(static_cast<std::size_t>(c.n_heads * W * d_), 0.0f);
    window_ = W;
    window_valid_ = false;
    MatRM logits;
    if (batched) {
      logits = run_block(tokens.data(), T, W - T, LogitRows::kLast);
    } else {
      for (std::ptrdiff_t t = 0; t < T; ++t) {
        logits = run_block(tokens.data() + t, 1, W - T + t, t + 1 == T ? LogitRows::kLast : LogitRows::kNone);
      }
    }
    window_valid_ = true;
    return row_vector(logits, 0);
  }

  /// The compressor's view of `layer` (requires window queries from a prefill() just before).
  LayerInput layer_input(int layer) const {
    const Config& c = model_->config();
    const LayerState& s = state(layer);
    LayerInput in;
    in.layer = layer;
    in.keys = s.keys.data();
    in.values = s.values.data();
    in.queries = s.queries.data();
    in.n = s.len[0];  // every head's: compress() requires the prefill just before
    in.W = window_;
    in.Hkv = c.n_kv_heads;
    in.Hq = c.n_heads;
    in.d = d_;
    in.head_stride = capacity_ * d_;
    in.wo = model_->layer(layer).wo;
    in.dim = c.dim;
    set_pages(s, in);
    return in;
  }

  /// Calls `fn` for every layer on the cache left by the last prefill(), validates all results
  /// (sizes, m <= capacity, lengths in [1, m], finite keys/values, bias not NaN/+inf, one
  /// next_position >= 0 for all layers) and only then writes them: slots 0..m_g-1 of head g get its
  /// compressed keys, values and bias, its length is m_g (lengths[g], or m), position() =
  /// next_position. On any error the session is unchanged. Decoded tokens afterwards go to slot
  /// length(layer, g) of each head g with bias 0 at RoPE position position().
  void compress(const LayerCompressor& fn) {
    if (!window_valid_) {
      throw std::runtime_error("kvc::engine: compress() must directly follow prefill() (window queries are stale)");
    }
    const Config& c = model_->config();
    std::vector<CompressedLayer> out(layers_.size());
    for (int l = 0; l < c.n_layers; ++l) {
      out[static_cast<std::size_t>(l)] = fn(layer_input(l));
      const CompressedLayer& r = out[static_cast<std::size_t>(l)];
      check_result(l, r);
      if (r.next_position != out[0].next_position) {
        throw std::runtime_error("kvc::engine: compressor output for layer " + std::to_string(l) + ": next_position = " +
                                 std::to_string(r.next_position) + " differs from layer 0's " +
                                 std::to_string(out[0].next_position));
      }
    }
    pos_ = out.empty() ? pos_ : out[0].next_position;
    for (int l = 0; l < c.n_layers; ++l) write_layer(l, out[static_cast<std::size_t>(l)]);
    window_valid_ = false;
    compressions_ += c.n_layers;
  }

  /// Keeps, from the next token fed on (prefill, extend, forward), the post-RoPE queries of the last
  /// `rows` tokens of every layer: the window of cache_input(). 0 stops it. Forgets what was kept.
  void keep_queries(std::ptrdiff_t rows) {
    if (rows < 0) throw std::invalid_argument("kvc::engine: keep_queries() rows must be >= 0, got " + std::to_string(rows));
    const Config& c = model_->config();
    for (LayerState& s : layers_) s.ring.assign(static_cast<std::size_t>(c.n_heads * rows * d_), 0.0f);
    ring_rows_ = rows;
    ring_filled_ = 0;
  }

  /// Window rows cache_input(layer) hands over now: the kept queries of the newest tokens that are
  /// still the layer's last entries, in order (a compression may have evicted some of them).
  std::ptrdiff_t window_rows(int layer) const {
    const LayerState& s = state(layer);
    return std::min({ring_filled_, s.tail, length(layer)});
  }

  /// RoPE position of entry i of KV head g of `layer` (the position its key was rotated at).
  std::ptrdiff_t entry_position(int layer, int g, std::ptrdiff_t i) const {
    if (i < 0 || i >= length(layer, g))
      throw std::out_of_range("kvc::engine: entry " + std::to_string(i) + " outside [0, " +
                              std::to_string(length(layer, g)) + ")");
    return state(layer).positions[static_cast<std::size_t>(g * capacity_ + i)];
  }

  /// The view of `layer` as it is now for a compression while the cache grows: every entry with its
  /// RoPE position and bias, and as window the last window_rows(layer) kept queries. Throws
  /// std::runtime_error when the KV heads hold different numbers of entries (a view has one length)
  /// or no window query is available (keep_queries()).
  LayerInput cache_input(int layer) const {
    const Config& c = model_->config();
    const LayerState& s = state(layer);
    const std::ptrdiff_t n = s.len[0];
    for (const std::ptrdiff_t len : s.len) {
      if (len != n) {
        throw std::runtime_error("kvc::engine: layer " + std::to_string(layer) +
                                 ": compressing a grown cache needs every KV head to hold the same number of entries "
                                 "(per-head budgets left them at " + std::to_string(len) + " and " + std::to_string(n) + ")");
      }
    }
    const std::ptrdiff_t w = window_rows(layer);
    if (w < 1) {
      throw std::runtime_error("kvc::engine: layer " + std::to_string(layer) + ": no window queries for the cache's newest entries (" +
                               (ring_rows_ == 0 ? std::string("call keep_queries() before feeding tokens")
                                                : std::string("none fed since the last compression")) + ")");
    }
    LayerInput in;
    in.layer = layer;
    in.keys = s.keys.data();
    in.values = s.values.data();
    in.queries = s.ring.data() + (ring_rows_ - w) * d_;
    in.queries_head_stride = ring_rows_ * d_;
    in.n = n;
    in.W = w;
    in.Hkv = c.n_kv_heads;
    in.Hq = c.n_heads;
    in.d = d_;
    in.head_stride = capacity_ * d_;
    in.wo = model_->layer(layer).wo;
    in.dim = c.dim;
    in.positions = s.positions.data();
    in.bias = s.bias.data();
    in.state_stride = capacity_;
    set_pages(s, in);
    return in;
  }

  /// Writes `r` as the new cache of `layer` after a compression while the cache grew: the checks of
  /// compress(), and next_position must equal position() (RoPE positions stay). On error nothing changes.
  void replace_layer(int layer, const CompressedLayer& r) {
    state(layer);
    check_result(layer, r);
    if (r.next_position != pos_) {
      throw std::runtime_error("kvc::engine: compressor output for layer " + std::to_string(layer) + ": next_position = " +
                               std::to_string(r.next_position) + " differs from position() = " + std::to_string(pos_) +
                               " (a cache compressed while it grows keeps its RoPE positions: no repositioning)");
    }
    write_layer(layer, r);
    ++compressions_;
  }

  /// Calls `fn` on every layer's cache_input() and writes what it returns (replace_layer). Returns how
  /// many layers it compressed. A throwing `fn` or result leaves the layers before it compressed.
  int compress_grown(const CacheCompressor& fn) {
    int done = 0;
    for (int l = 0; l < model_->config().n_layers; ++l) {
      std::optional<CompressedLayer> r = fn(cache_input(l));
      if (!r) continue;
      replace_layer(l, *r);
      ++done;
    }
    return done;
  }

  /// Layer compressions written so far (compress() counts each layer, replace_layer() one).
  std::ptrdiff_t compressions() const { return compressions_; }
  /// The largest entries any KV head of any layer held since the session was created or reset.
  std::ptrdiff_t peak_length() const { return peak_; }

 private:
  struct LayerState {
    std::vector<float> keys, values, bias, queries;
    std::vector<std::ptrdiff_t> len;        // per KV head
    std::vector<std::ptrdiff_t> positions;  // [Hkv][capacity] RoPE position of each entry
    std::vector<float> ring;                // [Hq][ring_rows_][d] queries of the newest tokens, oldest first
    std::ptrdiff_t tail = 0;                // the last `tail` entries of every head are the newest tokens, in order
    std::vector<std::int32_t> table;        // paged: the layer's pages in order
    std::vector<std::int32_t> free_pages;   // paged: pages of the pool not in the table
  };

  void contiguous_only(const char* what) const {
    if (page_ > 0)
      throw std::logic_error(std::string("kvc::engine: ") + what + " describes a contiguous cache; this session is paged " +
                             "(key_row, value_row)");
  }

  /// Pointer to entry i of KV head g in `base` (s.keys or s.values), either layout.
  template <class F>
  F* row(const LayerState& s, std::vector<F>& base, int g, std::ptrdiff_t i) const {
    if (page_ == 0) return base.data() + (g * capacity_ + i) * d_;
    const std::ptrdiff_t Hkv = model_->config().n_kv_heads;
    return base.data() + ((static_cast<std::ptrdiff_t>(s.table[static_cast<std::size_t>(i / page_)]) * page_ + i % page_) * Hkv + g) * d_;
  }
  template <class F>
  const F* row(const LayerState& s, const std::vector<F>& base, int g, std::ptrdiff_t i) const {
    return row(s, const_cast<std::vector<F>&>(base), g, i);
  }

  void set_pages(const LayerState& s, LayerInput& in) const {
    if (page_ == 0) return;
    in.blocks = s.table.data();
    in.block_size = page_;
    in.num_blocks = (capacity_ + page_ - 1) / page_;
    in.head_stride = d_;
  }

  /// Paged: takes pages from the free list until the table covers `entries` entries.
  void ensure_pages(LayerState& s, std::ptrdiff_t entries) {
    while (page_ > 0 && static_cast<std::ptrdiff_t>(s.table.size()) * page_ < entries) {
      if (s.free_pages.empty()) throw std::runtime_error("kvc::engine: no free page left");
      s.table.push_back(s.free_pages.back());
      s.free_pages.pop_back();
    }
  }

  /// The checks every compressor result passes before anything is written.
  void check_result(int l, const CompressedLayer& r) const {
    const Config& c = model_->config();
    const std::string where = "kvc::engine: compressor output for layer " + std::to_string(l) + ": ";
    if (r.m < 0 || r.m > capacity_) {
      throw std::runtime_error(where + "m = " + std::to_string(r.m) + " outside [0, capacity = " + std::to_string(capacity_) + "]");
    }
    const std::size_t kv_size = static_cast<std::size_t>(c.n_kv_heads * r.m * d_);
    if (r.keys.size() != kv_size || r.values.size() != kv_size) {
      throw std::runtime_error(where + "keys/values have " + std::to_string(r.keys.size()) + "/" +
                               std::to_string(r.values.size()) + " elements, expected Hkv*m*d = " + std::to_string(kv_size));
    }
    if (!r.bias.empty() && r.bias.size() != static_cast<std::size_t>(c.n_kv_heads * r.m)) {
      throw std::runtime_error(where + "bias has " + std::to_string(r.bias.size()) +
                               " elements, expected Hkv*m = " + std::to_string(c.n_kv_heads * r.m) + " (or none)");
    }
    if (!r.positions.empty() && r.positions.size() != static_cast<std::size_t>(c.n_kv_heads * r.m)) {
      throw std::runtime_error(where + "positions has " + std::to_string(r.positions.size()) +
                               " elements, expected Hkv*m = " + std::to_string(c.n_kv_heads * r.m) + " (or none)");
    }
    for (std::size_t i = 0; i < kv_size; ++i) {
      if (!std::isfinite(r.keys[i]) || !std::isfinite(r.values[i])) {
        throw std::runtime_error(where + "non-finite key or value at element " + std::to_string(i));
      }
    }
    for (std::size_t i = 0; i < r.bias.size(); ++i) {
      if (std::isnan(r.bias[i]) || r.bias[i] == std::numeric_limits<float>::infinity()) {
        throw std::runtime_error(where + "bias is NaN or +inf at element " + std::to_string(i));
      }
    }
    if (!r.lengths.empty() && r.lengths.size() != static_cast<std::size_t>(c.n_kv_heads)) {
      throw std::runtime_error(where + "lengths has " + std::to_string(r.lengths.size()) +
                               " entries, expected one per KV head (" + std::to_string(c.n_kv_heads) + ") or none");
    }
    for (const std::ptrdiff_t len : r.lengths) {
      if (len < 1 || len > r.m) {
        throw std::runtime_error(where + "a head length " + std::to_string(len) + " is outside [1, m = " +
                                 std::to_string(r.m) + "]");
      }
    }
    if (r.next_position < 0) {
      throw std::runtime_error(where + "next_position = " + std::to_string(r.next_position) + " is negative");
    }
    for (std::size_t i = 0; i < r.positions.size(); ++i) {
      if (r.positions[i] < 0 || r.positions[i] >= r.next_position) {
        throw std::runtime_error(where + "position " + std::to_string(r.positions[i]) + " at element " + std::to_string(i) +
                                 " is outside [0, next_position = " + std::to_string(r.next_position) + ")");
      }
    }
  }

  /// Paged: the table for a checked result r of layer s, before r is written. When every head kept
  /// the same entries and they are whole pages (entry i at row i % page of the page that new page
  /// i / page is; found from their RoPE positions), the table lists those pages and each entry is
  /// written onto itself; otherwise the first pages stay, rows 0..m−1 are rewritten through them. The
  /// pages no longer listed go back to the free list.
  void repage(LayerState& s, const CompressedLayer& r) {
    const std::ptrdiff_t Hkv = model_->config().n_kv_heads, n = s.len[0];
    std::vector<std::ptrdiff_t> at(static_cast<std::size_t>(r.m), -1);  // entry i's index in the cache
    bool whole = !r.positions.empty() && r.m > 0;
    for (std::ptrdiff_t g = 0; g < Hkv && whole; ++g) {
      const std::ptrdiff_t len = r.lengths.empty() ? r.m : r.lengths[static_cast<std::size_t>(g)];
      const std::ptrdiff_t* first = s.positions.data() + g * capacity_;
      const std::ptrdiff_t* last = first + s.len[static_cast<std::size_t>(g)];
      whole = len == r.m && s.len[static_cast<std::size_t>(g)] == n;
      for (std::ptrdiff_t i = 0; i < r.m && whole; ++i) {
        const std::ptrdiff_t p = r.positions[static_cast<std::size_t>(g * r.m + i)];
        const std::ptrdiff_t* hit = std::lower_bound(first, last, p);
        const std::ptrdiff_t j = hit != last && *hit == p ? hit - first : -1;
        whole = j >= 0 && (g == 0 || at[static_cast<std::size_t>(i)] == j);
        at[static_cast<std::size_t>(i)] = j;
      }
    }
    for (std::ptrdiff_t i = 0; i < r.m && whole; ++i)
      whole = at[static_cast<std::size_t>(i)] % page_ == i % page_ &&
              (i == 0 || at[static_cast<std::size_t>(i)] > at[static_cast<std::size_t>(i - 1)]) &&
              (i % page_ == 0 || at[static_cast<std::size_t>(i)] == at[static_cast<std::size_t>(i - 1)] + 1);
    const std::ptrdiff_t keep = (r.m + page_ - 1) / page_;
    std::vector<std::int32_t> table;
    if (whole) {
      for (std::ptrdiff_t k = 0; k < keep; ++k)
        table.push_back(s.table[static_cast<std::size_t>(at[static_cast<std::size_t>(k * page_)] / page_)]);
    } else {
      table.assign(s.table.begin(), s.table.begin() + std::min<std::ptrdiff_t>(keep, static_cast<std::ptrdiff_t>(s.table.size())));
    }
    for (const std::int32_t p : s.table)
      if (std::find(table.begin(), table.end(), p) == table.end()) {
        s.free_pages.push_back(p);
        ++pages_freed_;
      }
    s.table = std::move(table);
    ensure_pages(s, r.m);  // a result longer than the cache it replaces (padding rows) gets pages too
  }

  /// Writes a checked result into layer l (position() already final) and finds its tail: the last
  /// entries of every head that are the newest tokens, in order.
  void write_layer(int l, const CompressedLayer& r) {
    const Config& c = model_->config();
    LayerState& s = layers_[static_cast<std::size_t>(l)];
    if (page_ > 0) repage(s, r);
    std::ptrdiff_t tail = std::numeric_limits<std::ptrdiff_t>::max();
    for (std::ptrdiff_t g = 0; g < c.n_kv_heads; ++g) {
      const std::ptrdiff_t rows = r.m * d_;
      const std::ptrdiff_t len = r.lengths.empty() ? r.m : r.lengths[static_cast<std::size_t>(g)];
      for (std::ptrdiff_t i = 0; i < r.m; ++i) {
        std::copy_n(r.keys.begin() + g * rows + i * d_, d_, row(s, s.keys, static_cast<int>(g), i));
        std::copy_n(r.values.begin() + g * rows + i * d_, d_, row(s, s.values, static_cast<int>(g), i));
      }
      float* b = s.bias.data() + g * capacity_;
      std::fill(b, b + capacity_, 0.0f);
      if (!r.bias.empty()) std::copy(r.bias.begin() + g * r.m, r.bias.begin() + (g + 1) * r.m, b);
      std::ptrdiff_t* p = s.positions.data() + g * capacity_;
      for (std::ptrdiff_t i = 0; i < len; ++i)
        p[i] = r.positions.empty() ? r.next_position - len + i : r.positions[static_cast<std::size_t>(g * r.m + i)];
      s.len[static_cast<std::size_t>(g)] = len;
      std::ptrdiff_t k = 0;
      while (k < len && p[len - 1 - k] == pos_ - 1 - k) ++k;
      tail = std::min(tail, k);
    }
    s.tail = c.n_kv_heads > 0 ? tail : 0;
  }

  /// Which rows' logits run_block() computes: none, the last token's, or every token's.
  enum class LogitRows { kNone, kLast, kAll };
  /// window_row_of_first value that records no window queries.
  static constexpr std::ptrdiff_t kNoWindowRows = std::numeric_limits<std::ptrdiff_t>::min();

  static std::vector<float> row_vector(const MatRM& m, Eigen::Index r) {
    return std::vector<float>(m.row(r).data(), m.row(r).data() + m.cols());
  }

  const LayerState& state(int layer) const {
    if (layer < 0 || layer >= static_cast<int>(layers_.size())) {
      throw std::out_of_range("kvc::engine: layer " + std::to_string(layer) + " outside [0, " +
                              std::to_string(layers_.size()) + ")");
    }
    return layers_[static_cast<std::size_t>(layer)];
  }

  void check_room(std::ptrdiff_t T) const {
    const Config& c = model_->config();
    if (pos_ + T > c.seq_len) {
      throw std::runtime_error("kvc::engine: position " + std::to_string(pos_ + T - 1) +
                               " would exceed the model's seq_len " + std::to_string(c.seq_len));
    }
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const std::ptrdiff_t len = length(static_cast<int>(l));
      if (len + T > capacity_) {
        throw std::runtime_error("kvc::engine: KV cache of layer " + std::to_string(l) + " is full (" +
                                 std::to_string(len) + " + " + std::to_string(T) + " > capacity " +
                                 std::to_string(capacity_) + ")");
      }
    }
  }

  void check_tokens(const int* tokens, std::ptrdiff_t T) const {
    const int V = model_->config().vocab_size;
    for (std::ptrdiff_t t = 0; t < T; ++t) {
      if (tokens[t] < 0 || tokens[t] >= V) {
        throw std::out_of_range("kvc::engine: token id " + std::to_string(tokens[t]) + " outside [0, " +
                                std::to_string(V) + ")");
      }
    }
  }

  static void rmsnorm_rows(const MatRM& x, const float* w, MatRM& out) {
    out.resize(x.rows(), x.cols());
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      double ss = 0;
      for (Eigen::Index i = 0; i < x.cols(); ++i) ss += static_cast<double>(x(r, i)) * x(r, i);
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(x.cols()) + 1e-5));
      for (Eigen::Index i = 0; i < x.cols(); ++i) out(r, i) = w[i] * (inv * x(r, i));
    }
  }

  /// Y (T, out) = X (T, in) * W^T for a row-major W (out, in).
  static void linear(const MatRM& x, const float* w, int out_dim, MatRM& y) {
    const Eigen::Map<const MatRM> wm(w, out_dim, x.cols());
    y.resize(x.rows(), out_dim);
    y.noalias() = x * wm.transpose();
  }

  /// Runs T >= 1 tokens at positions pos_.. through all layers, appending them at slots len.. with
  /// bias 0 after whatever the cache holds (compressed or not). Row t's query is recorded at window
  /// row window_row_of_first + t when that lies in [0, window_) (never for kNoWindowRows). Returns the
  /// logits selected by `rows` as a (0, 1 or T) x vocab matrix. Validates before writing anything.
  MatRM run_block(const int* tokens, std::ptrdiff_t T, std::ptrdiff_t window_row_of_first, LogitRows rows) {
    check_room(T);
    check_tokens(tokens, T);
    const Config& c = model_->config();
    const int dim = c.dim;
    const int Hq = c.n_heads;
    const int Hkv = c.n_kv_heads;
    const int G = c.group();
    const std::ptrdiff_t d = d_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));

    MatRM x(T, dim);
    for (std::ptrdiff_t t = 0; t < T; ++t) {
      const float* e = model_->token_embedding() + static_cast<std::ptrdiff_t>(tokens[t]) * dim;
      std::copy(e, e + dim, x.row(t).data());
    }
    MatRM xb, q, k, v, att(T, dim), proj, h1, h3;
    std::vector<float> scores(static_cast<std::size_t>(capacity_));
    for (int l = 0; l < c.n_layers; ++l) {
      const LayerWeights w = model_->layer(l);
      LayerState& s = layers_[static_cast<std::size_t>(l)];
      rmsnorm_rows(x, w.rms_att, xb);
      linear(xb, w.wq, dim, q);
      linear(xb, w.wk, c.kv_dim(), k);
      linear(xb, w.wv, c.kv_dim(), v);
      ensure_pages(s, *std::max_element(s.len.begin(), s.len.end()) + T);
      for (std::ptrdiff_t t = 0; t < T; ++t) {
        rope_rotate(q.row(t).data(), Hq, static_cast<int>(d), pos_ + t, model_->rope_base());
        rope_rotate(k.row(t).data(), Hkv, static_cast<int>(d), pos_ + t, model_->rope_base());
        for (int g = 0; g < Hkv; ++g) {
          const std::ptrdiff_t slot = s.len[static_cast<std::size_t>(g)] + t;
          std::copy(k.row(t).data() + g * d, k.row(t).data() + (g + 1) * d, row(s, s.keys, g, slot));
          std::copy(v.row(t).data() + g * d, v.row(t).data() + (g + 1) * d, row(s, s.values, g, slot));
          s.bias[static_cast<std::size_t>(g * capacity_ + slot)] = 0.0f;
          s.positions[static_cast<std::size_t>(g * capacity_ + slot)] = pos_ + t;
        }
        const std::ptrdiff_t wrow = window_row_of_first == kNoWindowRows ? -1 : window_row_of_first + t;
        if (wrow >= 0 && wrow < window_) {
          for (int h = 0; h < Hq; ++h) {
            std::copy(q.row(t).data() + h * d, q.row(t).data() + (h + 1) * d,
                      s.queries.data() + (static_cast<std::ptrdiff_t>(h) * window_ + wrow) * d);
          }
        }
      }
      if (ring_rows_ > 0) {  // the ring keeps the newest ring_rows_ queries, oldest first
        const std::ptrdiff_t fresh = std::min(T, ring_rows_);
        for (int h = 0; h < Hq; ++h) {
          float* r = s.ring.data() + static_cast<std::ptrdiff_t>(h) * ring_rows_ * d;
          std::copy(r + fresh * d, r + ring_rows_ * d, r);
          for (std::ptrdiff_t i = 0; i < fresh; ++i)
            std::copy(q.row(T - fresh + i).data() + h * d, q.row(T - fresh + i).data() + (h + 1) * d,
                      r + (ring_rows_ - fresh + i) * d);
        }
      }
      // Causal attention: row t sees slots 0 .. len_g + t of its KV head g. A head's rows are rs floats
      // apart within a page (the whole cache when not paged); run_of(j, end) rows from j share one.
      const std::ptrdiff_t rs = page_ > 0 ? Hkv * d : d;
      const auto run_of = [this](std::ptrdiff_t j, std::ptrdiff_t end) {
        return page_ > 0 ? std::min(page_ - j % page_, end - j) : end - j;
      };
      for (std::ptrdiff_t t = 0; t < T; ++t) {
        for (int h = 0; h < Hq; ++h) {
          const int g = h / G;
          const std::ptrdiff_t visible = s.len[static_cast<std::size_t>(g)] + t + 1;
          const float* qh = q.row(t).data() + h * d;
          const float* bg = s.bias.data() + g * capacity_;
          float mx = -std::numeric_limits<float>::infinity();
          for (std::ptrdiff_t j0 = 0; j0 < visible; j0 += run_of(j0, visible)) {  // rows rs apart
            const float* k0 = row(s, s.keys, g, j0);
            for (std::ptrdiff_t r = 0, n_run = run_of(j0, visible); r < n_run; ++r) {
              const float* kj = k0 + r * rs;
              float dot = 0;
              for (std::ptrdiff_t i = 0; i < d; ++i) dot += qh[i] * kj[i];
              scores[static_cast<std::size_t>(j0 + r)] = scale * dot + bg[j0 + r];
              mx = std::max(mx, scores[static_cast<std::size_t>(j0 + r)]);
            }
          }
          float sum = 0;
          for (std::ptrdiff_t j = 0; j < visible; ++j) {
            const float e = std::exp(scores[static_cast<std::size_t>(j)] - mx);
            scores[static_cast<std::size_t>(j)] = e;
            sum += e;
          }
          float* o = att.row(t).data() + h * d;
          std::fill(o, o + d, 0.0f);
          for (std::ptrdiff_t j0 = 0; j0 < visible; j0 += run_of(j0, visible)) {
            const float* v0 = row(s, s.values, g, j0);
            for (std::ptrdiff_t r = 0, n_run = run_of(j0, visible); r < n_run; ++r) {
              const float p = scores[static_cast<std::size_t>(j0 + r)] / sum;
              const float* vj = v0 + r * rs;
              for (std::ptrdiff_t i = 0; i < d; ++i) o[i] += p * vj[i];
            }
          }
        }
      }
      linear(att, w.wo, dim, proj);
      x += proj;
      rmsnorm_rows(x, w.rms_ffn, xb);
      linear(xb, w.w1, c.hidden_dim, h1);
      linear(xb, w.w3, c.hidden_dim, h3);
      for (Eigen::Index r = 0; r < h1.rows(); ++r) {
        for (Eigen::Index i = 0; i < h1.cols(); ++i) {
          const float a = h1(r, i);
          h1(r, i) = a / (1.0f + std::exp(-a)) * h3(r, i);
        }
      }
      linear(h1, w.w2, dim, proj);
      x += proj;
    }
    for (LayerState& s : layers_) {
      for (std::ptrdiff_t& len : s.len) {
        len += T;
        peak_ = std::max(peak_, len);
      }
      s.tail += T;
    }
    ring_filled_ = std::min(ring_rows_, ring_filled_ + T);
    pos_ += T;
    MatRM logits;
    if (rows == LogitRows::kNone) return logits;
    const MatRM hidden = rows == LogitRows::kAll ? x : MatRM(x.bottomRows(1));
    rmsnorm_rows(hidden, model_->rms_final(), xb);
    linear(xb, model_->classifier(), c.vocab_size, logits);
    return logits;
  }

  const Model* model_;
  std::ptrdiff_t capacity_ = 0;
  std::ptrdiff_t d_ = 0;
  std::ptrdiff_t pos_ = 0;
  std::ptrdiff_t window_ = 0;
  bool window_valid_ = false;
  std::ptrdiff_t ring_rows_ = 0, ring_filled_ = 0;
  std::ptrdiff_t compressions_ = 0, peak_ = 0;
  std::ptrdiff_t page_ = 0, pages_freed_ = 0;
  std::vector<LayerState> layers_;
};

// ---------------------------------------------------------------------------------------------
// Sampling helpers (all deterministic across standard libraries)
// ---------------------------------------------------------------------------------------------

/// Index of the largest value (first on ties). n >= 1.
inline int argmax(const float* x, std::ptrdiff_t n) {
  std::ptrdiff_t best = 0;
  for (std::ptrdiff_t i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return static_cast<int>(best);
}
inline int argmax(const std::vector<float>& x) { return argmax(x.data(), static_cast<std::ptrdiff_t>(x.size())); }
inline int argmax(const std::vector<double>& x) {
  return static_cast<int>(std::max_element(x.begin(), x.end()) - x.begin());
}

/// softmax(logits / temperature) in double. temperature > 0.
inline std::vector<double> softmax(const float* logits, std::ptrdiff_t n, double temperature = 1.0) {
  std::vector<double> p(static_cast<std::size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (std::ptrdiff_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]) / temperature);
  double sum = 0;
  for (std::ptrdiff_t i = 0; i < n; ++i) {
    p[static_cast<std::size_t>(i)] = std::exp(static_cast<double>(logits[i]) / temperature - mx);
    sum += p[static_cast<std::size_t>(i)];
  }
  for (double& x : p) x /= sum;
  return p;
}
inline std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  return softmax(logits.data(), static_cast<std::ptrdiff_t>(logits.size()), temperature);
}

/// log_softmax(logits) in double: logits - max - log(sum exp(logits - max)).
inline std::vector<double> log_softmax(const float* logits, std::ptrdiff_t n) {
  std::vector<double> out(static_cast<std::size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (std::ptrdiff_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (std::ptrdiff_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (std::ptrdiff_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = static_cast<double>(logits[i]) - lse;
  return out;
}
inline std::vector<double> log_softmax(const std::vector<float>& logits) {
  return log_softmax(logits.data(), static_cast<std::ptrdiff_t>(logits.size()));
}

/// Uniform double in [0, 1) from the top 53 bits of one mt19937_64 draw.
inline double uniform01(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
}

/// Uniform integer in [0, n) by rejection (no modulo bias), n >= 1.
inline std::uint64_t uniform_index(std::mt19937_64& rng, std::uint64_t n) {
  const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % n;
  std::uint64_t r = 0;
  do {
    r = rng();
  } while (r >= limit);
  return r % n;
}

/// Inverse-CDF draw: the first i with u * sum(p) < p_0 + ... + p_i (skipping zero-probability
/// entries at the end if rounding runs past them). u in [0, 1).
inline int sample_categorical(const std::vector<double>& probs, double u) {
  double total = 0;
  for (const double p : probs) total += p;
  const double target = u * total;
  double cum = 0;
  int last_positive = 0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] > 0) last_positive = static_cast<int>(i);
    cum += probs[i];
    if (target < cum) return static_cast<int>(i);
  }
  return last_positive;
}

/// Next token: argmax when temperature <= 0 (no draw), else one uniform01 draw through
/// sample_categorical(softmax(logits / temperature)).
inline int sample(const std::vector<float>& logits, double temperature, std::mt19937_64& rng) {
  if (temperature <= 0) return argmax(logits);
  return sample_categorical(softmax(logits, temperature), uniform01(rng));
}

/// Feeds `prompt` (non-empty, e.g. {BOS}) then samples `n_new` tokens; returns only the new tokens.
inline std::vector<int> generate(Session& session, const std::vector<int>& prompt, int n_new, double temperature,
                                 std::uint64_t seed = 0, bool batched_prefill = true) {
  std::mt19937_64 rng(seed);
  std::vector<float> logits = session.prefill(prompt, 0, batched_prefill);
  std::vector<int> out;
  for (int i = 0; i < n_new; ++i) {
    const int next = sample(logits, temperature, rng);
    out.push_back(next);
    if (i + 1 < n_new) logits = session.forward(next);
  }
  return out;
}

}  // namespace kvc::engine
