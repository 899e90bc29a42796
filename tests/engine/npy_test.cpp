// Tests of examples/engine/npy.hpp (no model needed).
#include <catch2/catch.hpp>

#include "engine/npy.hpp"
#include "support/test_utils.hpp"

#include <Eigen/Core>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using namespace kvc::engine;

namespace {

using kvc::test::TempDir;

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Builds an .npy file by hand (independently of write_npy): magic, version, header length, the dict
// padded with spaces + '\n' to a multiple of 64 bytes, then `data`.
std::vector<unsigned char> make_npy(int major, const std::string& dict, const std::vector<unsigned char>& data) {
  const std::size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict;
  const std::size_t total = (prefix + header.size() + 1 + 63) / 64 * 64;
  header.append(total - prefix - header.size() - 1, ' ');
  header += '\n';
  std::vector<unsigned char> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  const std::size_t len = header.size();
  for (std::size_t b = 0; b < (major == 1 ? 2u : 4u); ++b) out.push_back(static_cast<unsigned char>((len >> (8 * b)) & 0xFF));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::vector<unsigned char> le_f32(const std::vector<float>& v) {
  std::vector<unsigned char> out;
  for (const float f : v) {
    std::uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    for (int b = 0; b < 4; ++b) out.push_back(static_cast<unsigned char>((u >> (8 * b)) & 0xFF));
  }
  return out;
}

std::uint16_t eigen_half_bits(float x) {
  return Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(x));
}

}  // namespace

TEST_CASE("float32 round trip over several shapes", "[npy]") {
  TempDir tmp;
  const std::vector<std::vector<std::int64_t>> shapes = {{}, {0}, {1}, {5}, {2, 3, 4}, {3, 0, 2}, {1, 1, 1, 7}};
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const auto& shape : shapes) {
    std::int64_t n = 1;
    for (const auto s : shape) n *= s;
    std::vector<float> data(static_cast<std::size_t>(n));
    for (float& x : data) x = normal(rng);
    if (n > 2) {
      data[0] = -0.0f;
      data[1] = std::numeric_limits<float>::infinity();
      data[2] = std::numeric_limits<float>::denorm_min();
    }
    const std::string p = tmp.file("f32.npy");
    write_npy(p, shape, data.data());
    // numpy layout rules: magic, version 1.0, data aligned to 64 bytes, header ends in '\n'.
    const std::vector<unsigned char> bytes = read_bytes(p);
    REQUIRE(bytes.size() >= 10);
    CHECK(bytes[0] == 0x93);
    CHECK(std::string(bytes.begin() + 1, bytes.begin() + 6) == "NUMPY");
    CHECK(bytes[6] == 1);
    const std::size_t hlen = bytes[8] | (static_cast<std::size_t>(bytes[9]) << 8);
    CHECK((10 + hlen) % 64 == 0);
    CHECK(bytes[10 + hlen - 1] == '\n');
    CHECK(bytes.size() == 10 + hlen + 4 * static_cast<std::size_t>(n));

    const NpyArray a = read_npy(p);
    CHECK(a.shape == shape);
    CHECK(a.dtype == NpyDtype::kFloat32);
    CHECK(a.is_float());
    CHECK(a.i.empty());
    CHECK(a.size() == n);
    REQUIRE(a.f.size() == data.size());
    int bit_mismatches = 0;  // compare bit patterns (keeps -0.0 apart from 0.0)
    for (std::size_t k = 0; k < data.size(); ++k) {
      std::uint32_t x = 0, y = 0;
      std::memcpy(&x, &a.f[k], 4);
      std::memcpy(&y, &data[k], 4);
      bit_mismatches += (x != y);
    }
    CHECK(bit_mismatches == 0);
  }
}

TEST_CASE("int32 and int64 round trips", "[npy]") {
  TempDir tmp;
  const std::vector<std::int32_t> i32 = {0, 1, -1, 123456, std::numeric_limits<std::int32_t>::min(),
                                         std::numeric_limits<std::int32_t>::max()};
  write_npy(tmp.file("i32.npy"), {2, 3}, i32.data());
  const NpyArray a = read_npy(tmp.file("i32.npy"));
  CHECK(a.dtype == NpyDtype::kInt32);
  CHECK(!a.is_float());
  CHECK(a.shape == std::vector<std::int64_t>{2, 3});
  REQUIRE(a.i.size() == 6);
  for (std::size_t k = 0; k < 6; ++k) CHECK(a.i[k] == i32[k]);

  const std::vector<std::int64_t> i64 = {std::numeric_limits<std::int64_t>::min(), -5, 0, 1LL << 40,
                                         std::numeric_limits<std::int64_t>::max()};
  write_npy(tmp.file("i64.npy"), {5}, i64.data());
  const NpyArray b = read_npy(tmp.file("i64.npy"));
  CHECK(b.dtype == NpyDtype::kInt64);
  CHECK(b.i == i64);
}

TEST_CASE("float16 conversion matches Eigen::half and round-trips", "[npy]") {
  // Every half bit pattern widens to the same float as Eigen's conversion (NaNs stay NaN).
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const float mine = half_bits_to_float(static_cast<std::uint16_t>(u));
    const Eigen::half h(Eigen::half_impl::raw_uint16_to_half(static_cast<std::uint16_t>(u)));
    const float ref = static_cast<float>(h);
    if (std::isnan(ref)) {
      CHECK(std::isnan(mine));
    } else if (mine != ref || std::signbit(mine) != std::signbit(ref)) {
      FAIL("half bits " << u << ": " << mine << " vs Eigen " << ref);
    }
  }
  // Narrowing: round to nearest even, same bits as Eigen for specials, ties, subnormals and random values.
  std::vector<float> probe = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f,
                              std::numeric_limits<float>::infinity(), 6.1035156e-05f, 5.9604645e-08f,
                              2.9802322e-08f, 2.98023259e-08f, 8.9406967e-08f, 1.00048828125f, 1.00146484375f,
                              1e-10f, -3.0517578e-05f, 0.1f, 0.333333f};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> expo(-26.0f, 17.0f);
  for (int k = 0; k < 100000; ++k) {
    const float x = std::exp2(expo(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    probe.push_back(x);
  }
  int mismatches = 0;
  for (const float x : probe) {
    if (float_to_half_bits(x) != eigen_half_bits(x)) {
      ++mismatches;
      UNSCOPED_INFO("x = " << x << " mine " << float_to_half_bits(x) << " eigen " << eigen_half_bits(x));
    }
  }
  CHECK(mismatches == 0);
  CHECK(std::isnan(half_bits_to_float(float_to_half_bits(std::nanf("")))));

  TempDir tmp;
  std::vector<float> data;
  for (int k = 0; k < 24; ++k) data.push_back(static_cast<float>(k - 12) * 0.37f);
  data.push_back(70000.0f);  // overflows to +inf
  data.push_back(1e-8f);     // rounds to 0 (below half the smallest subnormal)
  write_npy_f16(tmp.file("f16.npy"), {2, 13}, data.data());
  const NpyArray a = read_npy(tmp.file("f16.npy"));
  CHECK(a.dtype == NpyDtype::kFloat16);
  CHECK(a.shape == std::vector<std::int64_t>{2, 13});
  REQUIRE(a.f.size() == data.size());
  for (std::size_t k = 0; k < data.size(); ++k) CHECK(a.f[k] == static_cast<float>(Eigen::half(data[k])));
  CHECK(a.f[24] == std::numeric_limits<float>::infinity());
  CHECK(a.f[25] == 0.0f);
  CHECK(read_bytes(tmp.file("f16.npy")).size() % 64 == 2 * data.size() % 64);
}

TEST_CASE("hand-written headers of versions 1.0, 2.0 and 3.0 are read", "[npy]") {
  TempDir tmp;
  const std::vector<float> v = {1.5f, -2.0f, 3.25f};
  struct Case {
    int major;
    std::string dict;
    std::vector<std::int64_t> shape;
  };
  const std::vector<Case> cases = {
      {1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", {3}},
      {2, "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3), }", {1, 3}},
      {3, "{\"shape\": (3, 1), \"fortran_order\": False, \"descr\": \"<f4\"}", {3, 1}},
      {1, "{ 'fortran_order' : False , 'descr':'<f4','shape':(3L,) }", {3}},
  };
  for (const Case& c : cases) {
    const std::string p = tmp.file("v" + std::to_string(c.major) + ".npy");
    write_bytes(p, make_npy(c.major, c.dict, le_f32(v)));
    INFO(c.dict);
    const NpyArray a = read_npy(p);
    CHECK(a.shape == c.shape);
    CHECK(a.f == v);
  }
  // Scalars: shape ().
  write_bytes(tmp.file("scalar.npy"), make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", le_f32({9.0f})));
  const NpyArray s = read_npy(tmp.file("scalar.npy"));
  CHECK(s.shape.empty());
  CHECK(s.f == std::vector<float>{9.0f});
}

TEST_CASE("malformed .npy files are rejected with messages naming the file and the reason", "[npy]") {
  TempDir tmp;
  const std::vector<unsigned char> data = le_f32({1, 2, 3, 4, 5, 6});
  const std::string good_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  auto rejects = [&](const std::string& name, const std::vector<unsigned char>& bytes, const std::string& what) {
    const std::string p = tmp.file(name);
    write_bytes(p, bytes);
    INFO("case " << name);
    CHECK_THROWS_WITH(read_npy(p), Contains(p) && Contains(what));
  };
  // Sanity: the good file loads.
  write_bytes(tmp.file("good.npy"), make_npy(1, good_dict, data));
  CHECK(read_npy(tmp.file("good.npy")).f.size() == 6);

  CHECK_THROWS_WITH(read_npy(tmp.file("absent.npy")), Contains("absent.npy") && Contains("does not exist"));
  std::vector<unsigned char> bad_magic = make_npy(1, good_dict, data);
  bad_magic[1] = 'X';
  rejects("magic.npy", bad_magic, "wrong magic");
  rejects("tiny.npy", {0x93, 'N', 'U'}, "wrong magic");
  rejects("text.npy", std::vector<unsigned char>(64, 'a'), "wrong magic");
  std::vector<unsigned char> v4 = make_npy(1, good_dict, data);
  v4[6] = 4;
  rejects("version.npy", v4, "unsupported format version 4.0");
  rejects("fortran.npy", make_npy(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", data), "Fortran order");
  rejects("bigendian.npy", make_npy(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", data), "big-endian");
  rejects("f8.npy", make_npy(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", data), "unsupported dtype '<f8'");
  rejects("u1.npy", make_npy(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (24,), }", data), "unsupported dtype '|u1'");
  rejects("obj.npy", make_npy(1, "{'descr': '|O', 'fortran_order': False, 'shape': (3,), }", data), "unsupported dtype '|O'");
  std::vector<unsigned char> cut = make_npy(1, good_dict, data);
  cut.resize(cut.size() - 1);
  rejects("truncated.npy", cut, "truncated data");
  rejects("noshape_data.npy", make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }", data), "truncated data");
  std::vector<unsigned char> header_cut = make_npy(1, good_dict, data);
  header_cut.resize(40);
  rejects("header_cut.npy", header_cut, "truncated header");
  std::vector<unsigned char> extra = make_npy(1, good_dict, data);
  extra.push_back(0);
  rejects("trailing.npy", extra, "trailing bytes");
  rejects("nokey.npy", make_npy(1, "{'descr': '<f4', 'shape': (2, 3), }", data), "missing one of the keys");
  rejects("extrakey.npy", make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", data), "unexpected or repeated key 'x'");
  rejects("dupkey.npy", make_npy(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}", data), "repeated key");
  rejects("unterminated.npy", make_npy(1, "{'descr: <f4, fortran_order: False}", data), "header parse error");
  rejects("nobrace.npy", make_npy(1, "'descr': '<f4'", data), "expected '{'");
  rejects("badbool.npy", make_npy(1, "{'descr': '<f4', 'fortran_order': false, 'shape': (2, 3), }", data), "True or False");
  rejects("negdim.npy", make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }", data), "negative dimension");
  rejects("hugedim.npy", make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999), }", data), "shape too large");
  rejects("junk_after.npy", make_npy(1, good_dict + " junk", data), "unexpected text after the dictionary");
}

TEST_CASE("a shape whose byte count wraps 64 bits is rejected as truncated, naming the file", "[npy]") {
  // count x itemsize = 2^62 x 4 = 2^64 wraps to 0 (no data needed), and (2^61+1) x 8 wraps to 8 (one
  // int64 present): both passed the truncation check and died in vector::resize with no file name.
  TempDir tmp;
  const std::string f4 = tmp.file("wrap_f4.npy"), i8 = tmp.file("wrap_i8.npy");
  write_bytes(f4, make_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2147483648, 2147483648, 1), }", {}));
  write_bytes(i8, make_npy(1, "{'descr': '<i8', 'fortran_order': False, 'shape': (2305843009213693953,), }",
                           std::vector<unsigned char>(8, 1)));
  CHECK_THROWS_WITH(read_npy(f4), Contains(f4) && Contains("truncated data") && Contains("(2147483648, 2147483648, 1)"));
  CHECK_THROWS_WITH(read_npy(i8), Contains(i8) && Contains("truncated data") && Contains("8 present"));
}
