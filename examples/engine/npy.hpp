// Minimal .npy reader/writer: format versions 1.0/2.0/3.0, C order, little-endian, <f4 <f2 <i4 <i8.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace kvc::engine {

enum class NpyDtype { kFloat32, kFloat16, kInt32, kInt64 };

/// The numpy descr string of a dtype ("<f4", "<f2", "<i4", "<i8").
inline const char* npy_descr(NpyDtype t) {
  switch (t) {
    case NpyDtype::kFloat32: return "<f4";
    case NpyDtype::kFloat16: return "<f2";
    case NpyDtype::kInt32: return "<i4";
    case NpyDtype::kInt64: return "<i8";
  }
  return "?";
}

inline std::size_t npy_item_size(NpyDtype t) {
  switch (t) {
    case NpyDtype::kFloat32: return 4;
    case NpyDtype::kFloat16: return 2;
    case NpyDtype::kInt32: return 4;
    case NpyDtype::kInt64: return 8;
  }
  return 0;
}

/// A loaded array. Floating dtypes fill `f` (float16 widened to float), integer dtypes fill `i`
/// (int32 widened to int64); the other vector stays empty. Data in C order.
struct NpyArray {
  std::vector<std::int64_t> shape;
  NpyDtype dtype = NpyDtype::kFloat32;
  std::vector<float> f;
  std::vector<std::int64_t> i;

  bool is_float() const { return dtype == NpyDtype::kFloat32 || dtype == NpyDtype::kFloat16; }
  std::int64_t size() const {
    std::int64_t n = 1;
    for (const std::int64_t s : shape) n *= s;
    return n;
  }
};

/// IEEE binary16 bits -> float (exact).
inline float half_bits_to_float(std::uint16_t h) {
  const bool neg = (h & 0x8000u) != 0;
  const unsigned exp = (h >> 10) & 0x1Fu;
  const unsigned mant = h & 0x3FFu;
  float v = 0;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, static_cast<int>(exp) - 15);
  }
  return neg ? -v : v;
}

/// float -> IEEE binary16 bits, round to nearest, ties to even; overflow gives +-inf, NaN a quiet NaN.
inline std::uint16_t float_to_half_bits(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isnan(x)) return static_cast<std::uint16_t>(sign | 0x7E00u);
  const double a = std::fabs(static_cast<double>(x));
  auto round_even = [](double v) {
    const double r = std::floor(v);
    const double frac = v - r;
    if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) != 0.0)) return r + 1.0;
    return r;
  };
  if (a >= 65520.0) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (a < std::ldexp(1.0, -14)) {                                        // subnormal (or zero)
    const double q = round_even(a * std::ldexp(1.0, 24));                 // 1024 = smallest normal, same bits
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q));
  }
  int e2 = 0;
  const double fr = std::frexp(a, &e2);  // a = fr * 2^e2, fr in [0.5, 1)
  int e = e2 - 1;                          // a = s * 2^e, s in [1, 2)
  double m = round_even((fr * 2.0 - 1.0) * 1024.0);
  if (m >= 1024.0) {
    m = 0;
    ++e;
  }
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>((e + 15) << 10) | static_cast<std::uint16_t>(m));
}

namespace detail {

inline std::runtime_error npy_error(const std::string& path, const std::string& what) {
  return std::runtime_error("kvc::engine: npy file '" + path + "': " + what);
}

/// Parses the Python dict literal of an .npy header: {'descr': '<f4', 'fortran_order': False,
/// 'shape': (2, 3), } with exactly these three keys in any order.
struct NpyHeaderParser {
  const std::string& s;
  const std::string& path;
  std::size_t at = 0;

  std::runtime_error fail(const std::string& what) const {
    return npy_error(path, "header parse error at offset " + std::to_string(at) + ": " + what + " in header \"" + s + "\"");
  }
  void ws() {
    while (at < s.size() && (s[at] == ' ' || s[at] == '\t' || s[at] == '\n' || s[at] == '\r')) ++at;
  }
  void expect(char c) {
    ws();
    if (at >= s.size() || s[at] != c) throw fail(std::string("expected '") + c + "'");
    ++at;
  }
  bool peek(char c) {
    ws();
    return at < s.size() && s[at] == c;
  }
  std::string string_literal() {
    ws();
    if (at >= s.size() || (s[at] != '\'' && s[at] != '"')) throw fail("expected a quoted string");
    const char q = s[at++];
    std::string out;
    while (at < s.size() && s[at] != q) {
      if (s[at] == '\\') throw fail("escape sequences are not supported");
      out += s[at++];
    }
    if (at >= s.size()) throw fail("unterminated string");
    ++at;
    return out;
  }
  bool boolean() {
    ws();
    if (s.compare(at, 4, "True") == 0) {
      at += 4;
      return true;
    }
    if (s.compare(at, 5, "False") == 0) {
      at += 5;
      return false;
    }
    throw fail("expected True or False");
  }
  std::int64_t integer() {
    ws();
    if (at < s.size() && s[at] == '-') throw fail("negative dimension");
    if (at >= s.size() || s[at] < '0' || s[at] > '9') throw fail("expected a dimension");
    std::int64_t v = 0;
    while (at < s.size() && s[at] >= '0' && s[at] <= '9') {
      const int digit = s[at] - '0';
      if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10) throw fail("dimension overflows int64");
      v = v * 10 + digit;
      ++at;
    }
    if (at < s.size() && s[at] == 'L') ++at;  // Python 2 long suffix
    return v;
  }
  std::vector<std::int64_t> tuple() {
    expect('(');
    std::vector<std::int64_t> dims;
    if (peek(')')) {
      ++at;
      return dims;
    }
    while (true) {
      dims.push_back(integer());
      if (peek(',')) {
        ++at;
        if (peek(')')) {
          ++at;
          return dims;
        }
        continue;
      }
      expect(')');
      return dims;
    }
  }
};

inline void npy_write(const std::string& path, const std::vector<std::int64_t>& shape, const char* descr,
                      const void* data, std::size_t item_size, std::size_t count) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (std::size_t k = 0; k < shape.size(); ++k) {
    dict += std::to_string(shape[k]);
    if (shape.size() == 1 || k + 1 < shape.size()) dict += ",";
    if (k + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  // Pad with spaces and end with '\n' so the data starts at a multiple of 64 bytes.
  std::size_t prefix = 10;  // magic(6) + version(2) + uint16 length
  bool v2 = false;
  std::size_t total = prefix + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  if (total - prefix > 65535) {
    v2 = true;
    prefix = 12;
    total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  }
  const std::size_t hlen = total - prefix;
  dict.append(hlen - dict.size() - 1, ' ');
  dict += '\n';
  std::string head = "\x93NUMPY";
  head += static_cast<char>(v2 ? 2 : 1);
  head += static_cast<char>(0);
  if (v2) {
    for (int b = 0; b < 4; ++b) head += static_cast<char>((hlen >> (8 * b)) & 0xFF);
  } else {
    for (int b = 0; b < 2; ++b) head += static_cast<char>((hlen >> (8 * b)) & 0xFF);
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw npy_error(path, "cannot open for writing");
  out.write(head.data(), static_cast<std::streamsize>(head.size()));
  out.write(dict.data(), static_cast<std::streamsize>(dict.size()));
  // Little-endian output, byte by byte (independent of the host order).
  const unsigned char* src = static_cast<const unsigned char*>(data);
  std::vector<unsigned char> buf(item_size * count);
  const std::uint32_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  for (std::size_t e = 0; e < count; ++e) {
    for (std::size_t b = 0; b < item_size; ++b) {
      buf[e * item_size + b] = first == 1 ? src[e * item_size + b] : src[e * item_size + item_size - 1 - b];
    }
  }
  out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
  out.flush();
  if (!out) throw npy_error(path, "write failed");
}

/// "(2, 3)" for messages.
inline std::string npy_shape_string(const std::vector<std::int64_t>& shape) {
  std::string out = "(";
  for (std::size_t k = 0; k < shape.size(); ++k) out += (k ? ", " : "") + std::to_string(shape[k]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

inline std::size_t npy_count(const std::string& path, const std::vector<std::int64_t>& shape) {
  std::uint64_t n = 1;
  for (const std::int64_t s : shape) {
    if (s < 0) throw npy_error(path, "negative dimension " + std::to_string(s));
    if (s != 0 && n > (std::uint64_t{1} << 62) / static_cast<std::uint64_t>(s)) throw npy_error(path, "shape too large");
    n *= static_cast<std::uint64_t>(s);
  }
  return static_cast<std::size_t>(n);
}

}  // namespace detail

/// Reads an .npy file. Throws std::runtime_error naming the file and the reason: cannot open, wrong
/// magic, unsupported version, header parse error, Fortran order, big-endian or unsupported dtype
/// (named), truncated data, or trailing bytes after the data.
inline NpyArray parse_npy(const std::vector<unsigned char>& bytes, const std::string& path);

inline NpyArray read_npy(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw detail::npy_error(path, "does not exist or is not a regular file");
  const std::uint64_t size = static_cast<std::uint64_t>(std::filesystem::file_size(path, ec));
  if (ec) throw detail::npy_error(path, "cannot query the size: " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) throw detail::npy_error(path, "cannot open for reading");
  std::vector<unsigned char> bytes(static_cast<std::size_t>(size));
  if (size > 0) {
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
    if (!in) throw detail::npy_error(path, "read error");
  }
  return parse_npy(bytes, path);
}

/// Parses the bytes of an .npy file (the checks of read_npy; `path` names the source in messages).
inline NpyArray parse_npy(const std::vector<unsigned char>& bytes, const std::string& path) {
  const std::uint64_t size = bytes.size();
  static const unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (size < 10 || std::memcmp(bytes.data(), kMagic, 6) != 0) {
    throw detail::npy_error(path, "wrong magic (not an .npy file)");
  }
  const int major = bytes[6];
  const int minor = bytes[7];
  if (major < 1 || major > 3 || minor != 0) {
    throw detail::npy_error(path, "unsupported format version " + std::to_string(major) + "." + std::to_string(minor));
  }
  std::size_t at = 8;
  std::uint64_t hlen = 0;
  if (major == 1) {
    hlen = static_cast<std::uint64_t>(bytes[8]) | (static_cast<std::uint64_t>(bytes[9]) << 8);
    at = 10;
  } else {
    if (size < 12) throw detail::npy_error(path, "truncated header length");
    for (int b = 0; b < 4; ++b) hlen |= static_cast<std::uint64_t>(bytes[8 + static_cast<std::size_t>(b)]) << (8 * b);
    at = 12;
  }
  if (hlen > size - at) {
    throw detail::npy_error(path, "truncated header (" + std::to_string(hlen) + " bytes announced, " +
                                      std::to_string(size - at) + " present)");
  }
  const std::string header(reinterpret_cast<const char*>(bytes.data() + at), static_cast<std::size_t>(hlen));
  at += static_cast<std::size_t>(hlen);

  detail::NpyHeaderParser p{header, path};
  std::string descr;
  bool fortran = false;
  std::vector<std::int64_t> shape;
  bool has_descr = false, has_fortran = false, has_shape = false;
  p.expect('{');
  while (true) {
    if (p.peek('}')) {
      ++p.at;
      break;
    }
    const std::string key = p.string_literal();
    p.expect(':');
    if (key == "descr" && !has_descr) {
      descr = p.string_literal();
      has_descr = true;
    } else if (key == "fortran_order" && !has_fortran) {
      fortran = p.boolean();
      has_fortran = true;
    } else if (key == "shape" && !has_shape) {
      shape = p.tuple();
      has_shape = true;
    } else {
      throw p.fail("unexpected or repeated key '" + key + "'");
    }
    if (p.peek(',')) {
      ++p.at;
      continue;
    }
    p.expect('}');
    break;
  }
  p.ws();
  if (p.at != header.size()) {
    std::size_t rest = p.at;
    while (rest < header.size() && header[rest] == '\0') ++rest;  // tolerate NUL padding
    if (rest != header.size()) throw p.fail("unexpected text after the dictionary");
  }
  if (!has_descr || !has_fortran || !has_shape) throw p.fail("missing one of the keys descr, fortran_order, shape");
  if (fortran) throw detail::npy_error(path, "Fortran order (fortran_order: True) is not supported; save in C order");
  if (!descr.empty() && descr[0] == '>') {
    throw detail::npy_error(path, "big-endian dtype '" + descr + "' is not supported; save as little-endian");
  }
  NpyArray arr;
  if (descr == "<f4") arr.dtype = NpyDtype::kFloat32;
  else if (descr == "<f2") arr.dtype = NpyDtype::kFloat16;
  else if (descr == "<i4") arr.dtype = NpyDtype::kInt32;
  else if (descr == "<i8") arr.dtype = NpyDtype::kInt64;
  else throw detail::npy_error(path, "unsupported dtype '" + descr + "' (supported: <f4, <f2, <i4, <i8)");
  arr.shape = shape;
  const std::size_t count = detail::npy_count(path, shape);
  const std::size_t item = npy_item_size(arr.dtype);
  const std::uint64_t present = size - at;
  // count <= 2^62 but count * item may wrap: compare by division before multiplying.
  if (static_cast<std::uint64_t>(count) > present / item) {
    throw detail::npy_error(path, "truncated data: shape " + detail::npy_shape_string(shape) + " of '" + descr +
                                      "' needs " + std::to_string(count) + " x " + std::to_string(item) +
                                      " bytes, " + std::to_string(present) + " present");
  }
  const std::uint64_t data_bytes = static_cast<std::uint64_t>(count) * item;  // <= present: no wrap
  if (present > data_bytes) {
    throw detail::npy_error(path, std::to_string(present - data_bytes) + " trailing bytes after the data");
  }
  const unsigned char* d = bytes.data() + at;
  auto le = [d, item](std::size_t e) {
    std::uint64_t u = 0;
    for (std::size_t b = 0; b < item; ++b) u |= static_cast<std::uint64_t>(d[e * item + b]) << (8 * b);
    return u;
  };
  if (arr.is_float()) {
    arr.f.resize(count);
    for (std::size_t e = 0; e < count; ++e) {
      if (arr.dtype == NpyDtype::kFloat16) {
        arr.f[e] = half_bits_to_float(static_cast<std::uint16_t>(le(e)));
      } else {
        const std::uint32_t u = static_cast<std::uint32_t>(le(e));
        std::memcpy(&arr.f[e], &u, 4);
      }
    }
  } else {
    arr.i.resize(count);
    for (std::size_t e = 0; e < count; ++e) {
      if (arr.dtype == NpyDtype::kInt32) {
        const std::uint32_t u = static_cast<std::uint32_t>(le(e));
        std::int32_t v = 0;
        std::memcpy(&v, &u, 4);
        arr.i[e] = v;
      } else {
        const std::uint64_t u = le(e);
        std::memcpy(&arr.i[e], &u, 8);
      }
    }
  }
  return arr;
}

/// Writes `data` (C order, product(shape) elements) as '<f4'. Throws std::runtime_error on I/O errors.
inline void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const float* data) {
  detail::npy_write(path, shape, "<f4", data, 4, detail::npy_count(path, shape));
}
/// Writes `data` as '<i4'.
inline void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const std::int32_t* data) {
  detail::npy_write(path, shape, "<i4", data, 4, detail::npy_count(path, shape));
}
/// Writes `data` as '<i8'.
inline void write_npy(const std::string& path, const std::vector<std::int64_t>& shape, const std::int64_t* data) {
  detail::npy_write(path, shape, "<i8", data, 8, detail::npy_count(path, shape));
}
/// Writes `data` rounded to float16 (nearest, ties to even) as '<f2'.
inline void write_npy_f16(const std::string& path, const std::vector<std::int64_t>& shape, const float* data) {
  const std::size_t n = detail::npy_count(path, shape);
  std::vector<std::uint16_t> h(n);
  for (std::size_t e = 0; e < n; ++e) h[e] = float_to_half_bits(data[e]);
  detail::npy_write(path, shape, "<f2", h.data(), 2, n);
}

}  // namespace kvc::engine
