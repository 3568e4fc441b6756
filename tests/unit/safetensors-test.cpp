// The safetensors reader and writer (src/io/safetensors.hpp): round trips, the format's bytes,
// half / bfloat16 rounding, every validation error, and interop with a Python writer and reader.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "core/error.hpp"
#include "io/safetensors.hpp"

namespace {

using namespace seqpar;
using namespace seqpar::io;
namespace fs = std::filesystem;

constexpr double inf = std::numeric_limits<double>::infinity();

// A file from its header text and data buffer, as the format lays it out.
std::string file(const std::string& header, const std::string& data = {}) {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// A header with one entry `name` of the given fields.
std::string one(const std::string& fields, const std::string& name = "a") {
  return "{\"" + name + "\":{" + fields + "}}";
}

// The parse fails with a trace_error whose message contains every one of `words`.
void expect_invalid(const std::string& bytes, std::initializer_list<std::string_view> words) {
  try {
    (void)parse_safetensors(bytes, "dump/x.safetensors");
    ADD_FAILURE() << "accepted; expected an error mentioning " << *words.begin();
  } catch (const trace_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("dump/x.safetensors"), std::string::npos) << msg;
    for (auto w : words) EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' in: " << msg;
  }
}

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("seqpar-st-test-" + std::to_string(getpid()));
  temp_dir() { fs::create_directories(path); }
  ~temp_dir() { fs::remove_all(path); }
};

TEST(safetensors, every_dtype_round_trips_through_bytes_and_a_file) {
  const std::vector<double> floats{0, -0.0, 1, -2.5, 0.375, 1024, -inf, inf};
  const std::vector<double> ints{0, 1, -1, 127, -128, 5, -7, 100};
  st_file f;
  f.metadata = {{"format", "pt"}, {"schema", "seqpar-dump/1"}};
  for (auto t : {st_dtype::f64, st_dtype::f32, st_dtype::f16, st_dtype::bf16})
    f.tensors.push_back(make_tensor(std::string(st_dtype_name(t)), {2, 4}, floats, t));
  for (auto t : {st_dtype::i64, st_dtype::i32, st_dtype::i16, st_dtype::i8})
    f.tensors.push_back(make_tensor(std::string(st_dtype_name(t)), {4, 2}, ints, t));
  const std::vector<double> small{0, 1, 255, 3};
  f.tensors.push_back(make_tensor("U8", {4}, small, st_dtype::u8));
  const std::vector<double> bits{1, 0, 0, 1};
  f.tensors.push_back(make_tensor("BOOL", {2, 2}, bits, st_dtype::boolean));
  const auto bytes = serialize_safetensors(f);
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  const auto g = parse_safetensors(bytes, "mem");
  EXPECT_EQ(g, f);
  for (const auto& t : g.tensors) {
    EXPECT_EQ(t.bytes.size(), static_cast<std::size_t>(t.numel()) * st_dtype_size(t.type));
    const auto v = t.to_f64();
    const auto& want = t.name == "U8"             ? small
                       : t.name == "BOOL"         ? bits
                       : t.type <= st_dtype::bf16 ? floats
                                                  : ints;
    ASSERT_EQ(v.size(), want.size()) << t.name;
    for (std::size_t i = 0; i < v.size(); ++i) {
      EXPECT_EQ(v[i], want[i]) << t.name << "[" << i << "]";
      EXPECT_EQ(std::signbit(v[i]), std::signbit(want[i])) << t.name << "[" << i << "]";
    }
  }
  ASSERT_NE(g.find("BF16"), nullptr);
  EXPECT_EQ(g.find("BF16")->type, st_dtype::bf16);
  EXPECT_EQ(g.find("nope"), nullptr);
  temp_dir d;
  const auto path = (d.path / "f.safetensors").string();
  write_safetensors(path, f);
  EXPECT_EQ(read_safetensors(path), f);
  EXPECT_EQ(std::distance(fs::directory_iterator(d.path), fs::directory_iterator()), 1);
}

TEST(safetensors, reads_a_file_built_by_hand_from_the_spec) {
  const float v[2] = {1.5f, -2.0f};
  std::string data(8, '\0');
  std::memcpy(data.data(), v, 8);
  const auto f = parse_safetensors(
      file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data), "hand");
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].name, "a");
  EXPECT_EQ(f.tensors[0].shape, (std::vector<std::int64_t>{2}));
  EXPECT_EQ(f.tensors[0].to_f64(), (std::vector<double>{1.5, -2.0}));
  EXPECT_TRUE(f.metadata.empty());
  // The exact bytes we write for it: the 54-byte header padded with spaces to 56.
  EXPECT_EQ(serialize_safetensors(f),
            file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  )", data));
}

TEST(safetensors, tensors_come_in_data_order_whatever_the_header_order) {
  const std::string data = "\x01\x02\x03\x04";
  const auto f = parse_safetensors(
      file(R"({"__metadata__":{"k":"v"},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
           R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
           data),
      "order");
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].name, "a");
  EXPECT_EQ(f.tensors[1].to_f64(), (std::vector<double>{3, 4}));
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"k", "v"}}));
}

TEST(safetensors, padded_unpadded_gapped_empty_and_scalar_tensors_are_accepted) {
  const std::string h = R"({"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_EQ(parse_safetensors(file(h + "       ", "\x05"), "pad").tensors[0].to_f64()[0], 5);
  EXPECT_EQ(parse_safetensors(file(h, "\x05"), "nopad").tensors[0].to_f64()[0], 5);
  // A gap before a buffer and trailing bytes after the last one.
  const auto g = parse_safetensors(
      file(R"({"a":{"dtype":"I8","shape":[1],"data_offsets":[2,3]}})", "xx\x07yy"), "gap");
  EXPECT_EQ(g.tensors[0].to_f64(), (std::vector<double>{7}));
  // [0, 4] holds nothing; it may sit anywhere in the buffer, even inside another tensor.
  const auto z = parse_safetensors(
      file(R"({"z":{"dtype":"F32","shape":[0,4],"data_offsets":[1,1]},)"
           R"("s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}, "__metadata__": null})",
           std::string(8, '\0')),
      "empty");
  ASSERT_EQ(z.tensors.size(), 2u);
  EXPECT_EQ(z.find("z")->numel(), 0);
  EXPECT_TRUE(z.find("z")->to_f64().empty());
  EXPECT_EQ(z.find("s")->numel(), 1);
  EXPECT_EQ(z.find("s")->to_f64(), (std::vector<double>{0}));
  EXPECT_EQ(parse_safetensors(serialize_safetensors(z), "again"), z);
  EXPECT_TRUE(parse_safetensors(file("{}"), "none").tensors.empty());
}

TEST(safetensors, half_and_bfloat16_of_specific_bit_patterns) {
  struct row {
    double x;
    std::uint16_t f16, bf16;
  };
  const double bf16_max = std::ldexp(255, 120);  // (2 − 2⁻⁷)·2¹²⁷
  for (const auto& r : std::initializer_list<row>{
           {1.0, 0x3c00, 0x3f80},
           {-2.5, 0xc100, 0xc020},
           {-0.0, 0x8000, 0x8000},
           {65504, 0x7bff, 0x4780},               // f16 max; in bf16 it rounds up to 2¹⁶
           {std::ldexp(1, -24), 0x0001, 0x3380},  // f16 min subnormal
           {std::ldexp(1023, -24), 0x03ff, 0x3880},
           {std::ldexp(1, -14), 0x0400, 0x3880},   // f16 min normal
           {std::ldexp(1, -133), 0x0000, 0x0001},  // bf16 min subnormal
           {std::ldexp(1, -126), 0x0000, 0x0080},  // bf16 min normal
           {bf16_max, 0x7c00, 0x7f7f},
           {inf, 0x7c00, 0x7f80},
           {-inf, 0xfc00, 0xff80},
       }) {
    EXPECT_EQ(f64_to_f16(r.x), r.f16) << r.x;
    EXPECT_EQ(f64_to_bf16(r.x), r.bf16) << r.x;
  }
  for (std::uint16_t h : {0x3c00, 0xc100, 0x7bff, 0x0001, 0x03ff, 0x0400, 0x8000}) {
    const double x = f16_to_f64(h);
    EXPECT_EQ(f64_to_f16(x), h);
  }
  EXPECT_EQ(f16_to_f64(0x0001), std::ldexp(1, -24));
  EXPECT_EQ(f16_to_f64(0x7bff), 65504);
  EXPECT_EQ(f16_to_f64(0xfc00), -inf);
  EXPECT_TRUE(std::isnan(f16_to_f64(0x7e00)) && std::isnan(f16_to_f64(0x7c01)));
  EXPECT_EQ(bf16_to_f64(0x0001), std::ldexp(1, -133));
  EXPECT_EQ(bf16_to_f64(0x7f7f), bf16_max);
  EXPECT_EQ(bf16_to_f64(0xc020), -2.5);
  EXPECT_TRUE(std::isnan(bf16_to_f64(0xffc1)));
  // NaN stays NaN (the quiet one), with its sign.
  EXPECT_EQ(f64_to_f16(std::numeric_limits<double>::quiet_NaN()), 0x7e00);
  EXPECT_EQ(f64_to_bf16(-std::numeric_limits<double>::quiet_NaN()), 0xffc0);
  // Ties go to the even significand; anything past the tie to the nearer value.
  EXPECT_EQ(f64_to_f16(1 + std::ldexp(1, -11)), 0x3c00);
  EXPECT_EQ(f64_to_f16(1 + std::ldexp(3, -11)), 0x3c02);
  EXPECT_EQ(f64_to_f16(1 + std::ldexp(1, -11) + std::ldexp(1, -40)), 0x3c01);
  EXPECT_EQ(f64_to_f16(std::ldexp(1, -25)), 0x0000);  // half the min subnormal → 0
  EXPECT_EQ(f64_to_f16(std::ldexp(3, -25)), 0x0002);
  EXPECT_EQ(f64_to_f16(65519.99), 0x7bff);
  EXPECT_EQ(f64_to_f16(65520), 0x7c00);  // the tie between max and 2¹⁶ overflows
  EXPECT_EQ(f64_to_f16(1e300), 0x7c00);
  EXPECT_EQ(f64_to_f16(-1e-300), 0x8000);
  EXPECT_EQ(f64_to_bf16(1 + std::ldexp(1, -8)), 0x3f80);
  EXPECT_EQ(f64_to_bf16(1 + std::ldexp(3, -8)), 0x3f82);
  EXPECT_EQ(f64_to_bf16(std::ldexp(511, 119)), 0x7f80);  // the tie above max
  EXPECT_EQ(f64_to_bf16(std::nextafter(std::ldexp(511, 119), 0)), 0x7f7f);
}

// Every finite pattern: widen, narrow back; every midpoint between neighbours goes to the even
// one, and a hair either side of it to the nearer.
void exhaustive(double (*widen)(std::uint16_t), std::uint16_t (*narrow)(double),
                std::uint16_t inf_bits) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const double x = widen(static_cast<std::uint16_t>(h));
    if (std::isnan(x)) continue;
    ASSERT_EQ(narrow(x), h) << std::hex << h;
    if ((h & 0x7fff) >= inf_bits) continue;
    const auto next = static_cast<std::uint16_t>(h + 1);  // away from zero; may be ±inf
    const double mid = (x + widen(next)) / 2;             // exact: a double holds it
    if (std::isinf(mid)) continue;
    ASSERT_EQ(narrow(mid), h % 2 == 0 ? h : next) << std::hex << h;
    ASSERT_EQ(narrow(std::nextafter(mid, 0)), h) << std::hex << h;
    ASSERT_EQ(narrow(std::nextafter(mid, 2 * mid)), next) << std::hex << h;
  }
}

TEST(safetensors, half_and_bfloat16_round_to_nearest_even_exhaustively) {
  exhaustive(f16_to_f64, f64_to_f16, 0x7c00);
  exhaustive(bf16_to_f64, f64_to_bf16, 0x7f80);
}

TEST(safetensors, f32_rounding_agrees_with_the_hardware_cast) {
  std::mt19937_64 rng(7);
  std::vector<double> xs;
  for (int i = 0; i < 200000; ++i) {
    const auto x = std::bit_cast<double>(rng());
    if (!std::isfinite(x) || x == 0) continue;
    // Exponents from below float's subnormals to its largest binade.
    xs.push_back(std::ldexp(x, -std::ilogb(x) + static_cast<int>(rng() % 278) - 152));
  }
  const auto t = make_tensor("x", {static_cast<std::int64_t>(xs.size())}, xs, st_dtype::f32);
  const auto v = t.to_f64();
  for (std::size_t i = 0; i < xs.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(static_cast<float>(v[i])),
              std::bit_cast<std::uint32_t>(static_cast<float>(xs[i])))
        << xs[i];
}

TEST(safetensors, every_format_violation_is_a_trace_error_naming_it) {
  const std::string f32 = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  const std::string eight(8, '\0');
  expect_invalid("abc", {"3 bytes", "8-byte"});
  std::string big(16, '\0');
  big[0] = 100;
  expect_invalid(big, {"header length 100", "only 8 bytes"});
  const std::uint64_t huge = 200'000'000;
  std::memcpy(big.data(), &huge, 8);
  expect_invalid(big, {"200000000", "limit"});
  expect_invalid(file("{\"a\":"), {"not valid JSON"});
  expect_invalid(file("\xff\xfe"), {"not valid JSON"});
  expect_invalid(file("[1, 2]"), {"JSON object", "array"});
  expect_invalid(file(R"({"a": 1})"), {"'a'", "must be an object", "number"});
  expect_invalid(file(one(R"("shape":[2],"data_offsets":[0,8])"), eight), {"'a'", "no 'dtype'"});
  expect_invalid(file(one(R"("dtype":"F32","data_offsets":[0,8])"), eight), {"no 'shape'"});
  expect_invalid(file(one(R"("dtype":"F32","shape":[2])"), eight), {"no 'data_offsets'"});
  expect_invalid(file(one(R"("dtype":7,"shape":[2],"data_offsets":[0,8])"), eight),
                 {"dtype 7", "known dtypes", "BF16"});
  expect_invalid(file(one(R"("dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2])"), eight),
                 {"'a'", "F8_E4M3", "known dtypes are F64, F32, F16, BF16"});
  expect_invalid(file(one(R"("dtype":"F32","shape":2,"data_offsets":[0,8])"), eight),
                 {"shape 2", "array of integers"});
  expect_invalid(file(one(R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])"), eight),
                 {"shape[0] = 2.0", "not an integer"});
  expect_invalid(file(one(R"("dtype":"F32","shape":[2,-2],"data_offsets":[0,8])"), eight),
                 {"shape[1] = -2", "[0, 2^63)"});
  expect_invalid(
      file(one(R"("dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8])"), eight),
      {"shape[0] = 18446744073709551615"});
  expect_invalid(
      file(one(R"("dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8])"), eight),
      {"shape [4294967296, 4294967296]", "int64"});
  expect_invalid(
      file(one(R"("dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8])"), eight),
      {"F32", "int64"});  // the elements fit, their bytes do not
  for (const char* bad : {"[0]", "[0,8,9]", "[-1,8]", "[0,8.0]", "\"0,8\"", "null"})
    expect_invalid(
        file(one(R"("dtype":"F32","shape":[2],"data_offsets":)" + std::string(bad)), eight),
        {"data_offsets", "two non-negative integers"});
  expect_invalid(file(one(R"("dtype":"F32","shape":[0],"data_offsets":[8,0])"), eight),
                 {"[8, 0]", "begin after end"});
  expect_invalid(file(one(f32), "1234567"), {"[0, 8]", "beyond the 7-byte data buffer"});
  expect_invalid(
      file(one(R"("dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615])"), eight),
      {"beyond"});
  // The example message of the dump reader's contract, word for word.
  try {
    (void)parse_safetensors(
        file(one(R"("dtype":"F32","shape":[4,8],"data_offsets":[0,100])", "q.local"),
             std::string(128, '\0')),
        "dump/rank0/call0000.fwd.safetensors");
    ADD_FAILURE();
  } catch (const trace_error& e) {
    EXPECT_STREQ(e.what(),
                 "dump/rank0/call0000.fwd.safetensors: tensor 'q.local' has data_offsets [0, 100] "
                 "but dtype F32 × shape [4, 8] needs 128 bytes");
  }
  expect_invalid(
      file(R"({"a":{)" + f32 + R"(},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
      {"'a' [0, 8]", "'b' [4, 8]", "overlap"});
  expect_invalid(file(R"({"a":{)" + f32 + R"(},"a":{)" + f32 + "}}", eight),
                 {"repeats the key 'a'"});
  expect_invalid(file(one(f32 + R"(,"dtype":"F16")"), eight), {"repeats the key 'dtype'"});
  expect_invalid(file(R"({"__metadata__":[1]})"), {"__metadata__", "object of strings", "array"});
  expect_invalid(file(R"({"__metadata__":{"k":1}})"), {"'k' is 1", "must be strings"});
}

TEST(safetensors, files_that_cannot_be_read_and_tensors_that_cannot_be_written) {
  temp_dir d;
  EXPECT_THROW((void)read_safetensors((d.path / "missing").string()), seqpar::error);
  EXPECT_THROW((void)read_safetensors(d.path.string()), trace_error);
  const std::vector<double> v{1.5};
  EXPECT_THROW((void)make_tensor("i", {1}, v, st_dtype::i32), seqpar::error);
  EXPECT_THROW((void)make_tensor("i", {2}, v, st_dtype::f32), shape_error);
  const std::vector<double> big{128};
  EXPECT_THROW((void)make_tensor("i", {1}, big, st_dtype::i8), seqpar::error);
  st_file f;
  f.tensors = {make_tensor("a", {1}, v, st_dtype::f32), make_tensor("a", {1}, v, st_dtype::f32)};
  EXPECT_THROW((void)serialize_safetensors(f), seqpar::error);  // repeated name
  f.tensors.pop_back();
  f.tensors[0].bytes.pop_back();
  EXPECT_THROW((void)serialize_safetensors(f), seqpar::error);  // 3 bytes for one F32
  EXPECT_THROW((void)f.tensors[0].to_f64(), seqpar::error);
}

// A file written by Python's struct and json alone reads back, and one we write Python reads.
TEST(safetensors, interoperates_with_a_python_struct_json_implementation) {
  if (std::system("python3 -c 'import struct, json' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "no python3";
  temp_dir d;
  const auto script = d.path / "st.py", from_py = d.path / "py.safetensors",
             from_cpp = d.path / "cpp.safetensors";
  std::ofstream(script) << R"(import json, struct, sys
h = json.dumps({"__metadata__": {"format": "pt"},
                "n": {"dtype": "I64", "shape": [1, 2], "data_offsets": [12, 28]},
                "x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<3f", 1.5, -2.25, 3.0)
                              + struct.pack("<2q", -7, 2**40))
d = open(sys.argv[2], "rb").read()
n, = struct.unpack("<Q", d[:8])
h, buf = json.loads(d[8:8 + n]), d[8 + n:]
def get(k, f):
    b, e = h[k]["data_offsets"]
    return list(struct.unpack("<%d%s" % ((e - b) // struct.calcsize(f), f), buf[b:e]))
assert n % 8 == 0 and h["__metadata__"] == {"k": "v"}, h
assert h["y"]["dtype"] == "F32" and h["y"]["shape"] == [2] and get("y", "f") == [0.5, -4.0], h
assert h["m"]["dtype"] == "I64" and h["m"]["shape"] == [] and get("m", "q") == [123], h
)";
  st_file ours;
  ours.metadata = {{"k", "v"}};
  const std::vector<double> y{0.5, -4}, m{123};
  ours.tensors = {make_tensor("y", {2}, y, st_dtype::f32), make_tensor("m", {}, m, st_dtype::i64)};
  write_safetensors(from_cpp.string(), ours);
  ASSERT_EQ(
      std::system(("python3 " + script.string() + " " + from_py.string() + " " + from_cpp.string())
                      .c_str()),
      0);
  const auto f = read_safetensors(from_py.string());
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].name, "x");
  EXPECT_EQ(f.tensors[0].to_f64(), (std::vector<double>{1.5, -2.25, 3.0}));
  EXPECT_EQ(f.find("n")->shape, (std::vector<std::int64_t>{1, 2}));
  EXPECT_EQ(f.find("n")->to_f64(), (std::vector<double>{-7, std::ldexp(1, 40)}));
  EXPECT_EQ(f.metadata.at("format"), "pt");
}

}  // namespace
