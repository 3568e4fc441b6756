#include "io/safetensors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "io/file.hpp"

namespace seqpar::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors buffers are little-endian; seqpar reads them in place");

namespace {

using ojson = nlohmann::ordered_json;

struct dtype_info {
  st_dtype type;
  std::string_view name;
  std::size_t size;
};
constexpr std::array<dtype_info, 10> dtypes{{{st_dtype::f64, "F64", 8},
                                             {st_dtype::f32, "F32", 4},
                                             {st_dtype::f16, "F16", 2},
                                             {st_dtype::bf16, "BF16", 2},
                                             {st_dtype::i64, "I64", 8},
                                             {st_dtype::i32, "I32", 4},
                                             {st_dtype::i16, "I16", 2},
                                             {st_dtype::i8, "I8", 1},
                                             {st_dtype::u8, "U8", 1},
                                             {st_dtype::boolean, "BOOL", 1}}};

// Safetensors' own bound on the header (the Rust reader's): anything larger is not a dump.
constexpr std::uint64_t max_header = 100'000'000;

std::string known_dtypes() {
  std::string s;
  for (const auto& d : dtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

const dtype_info& info(st_dtype t) {
  for (const auto& d : dtypes)
    if (d.type == t) return d;
  fail<error>("safetensors: unknown dtype code {}", static_cast<int>(t));
}

// The product of the dims times `size`, or false when a dim is negative or it overflows int64.
bool checked_bytes(const std::vector<std::int64_t>& shape, std::int64_t size, std::int64_t& numel,
                   std::int64_t& bytes) {
  numel = 1;
  for (auto d : shape)
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) return false;
  return !__builtin_mul_overflow(numel, size, &bytes);
}

// An IEEE binary float with `eb` exponent and `mb` mantissa bits from its bits.
double widen(std::uint32_t bits, int eb, int mb) {
  const int bias = (1 << (eb - 1)) - 1;
  const std::uint32_t e = (bits >> mb) & ((1u << eb) - 1), m = bits & ((1u << mb) - 1);
  const bool neg = (bits >> (eb + mb)) & 1;
  double v;
  if (e == (1u << eb) - 1)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(m, 1 - bias - mb);  // subnormal (or zero)
  else
    v = std::ldexp(m + (1u << mb), static_cast<int>(e) - bias - mb);
  return neg ? -v : v;
}

// x rounded to nearest even into that format (overflow to ±inf, NaN to the quiet NaN).
std::uint32_t narrow(double x, int eb, int mb) {
  const std::uint64_t sign = std::signbit(x) ? std::uint64_t{1} << (eb + mb) : 0;
  const std::uint64_t inf = ((std::uint64_t{1} << eb) - 1) << mb;
  if (std::isnan(x)) return static_cast<std::uint32_t>(sign | inf | (std::uint64_t{1} << (mb - 1)));
  const double a = std::fabs(x);
  if (a == 0) return static_cast<std::uint32_t>(sign);
  if (std::isinf(a)) return static_cast<std::uint32_t>(sign | inf);
  const int bias = (1 << (eb - 1)) - 1;
  int e;
  std::frexp(a, &e);                        // a = f·2^e, f in [0.5, 1)
  const int u = std::max(e - 1, 1 - bias);  // the exponent, the subnormal one at least
  const double q = std::ldexp(a, mb - u);   // the significand: [2^mb, 2^(mb+1)) or below
  double r = std::floor(q);
  if (const double d = q - r; d > 0.5 || (d == 0.5 && std::fmod(r, 2.0) != 0)) r += 1;
  // A normal significand carries its implicit bit into the exponent field; rounding up to
  // 2^(mb+1) bumps the exponent, and a subnormal rounding up to 2^mb becomes the smallest normal.
  const std::uint64_t bits =
      (static_cast<std::uint64_t>(u + bias - 1) << mb) + static_cast<std::uint64_t>(r);
  return static_cast<std::uint32_t>(sign | std::min(bits, inf));
}

template <class T>
void widen_all(const std::string& b, std::vector<double>& out) {
  for (std::size_t i = 0; i < out.size(); ++i) {
    T x;
    std::memcpy(&x, b.data() + i * sizeof(T), sizeof(T));
    if constexpr (std::is_same_v<T, std::uint16_t>)
      out[i] = widen(x, 5, 10);
    else
      out[i] = static_cast<double>(x);
  }
}

template <class T>
void put(std::string& out, T x) {
  out.append(reinterpret_cast<const char*>(&x), sizeof(T));
}

template <class T>
void put_int(std::string& out, double v, std::string_view name, std::size_t i, st_dtype t) {
  constexpr double lo = static_cast<double>(std::numeric_limits<T>::min());
  constexpr double hi = static_cast<double>(std::numeric_limits<T>::max()) + 1;  // exact: 2^k
  const bool ok =
      t == st_dtype::boolean ? (v == 0 || v == 1) : (v == std::trunc(v) && v >= lo && v < hi);
  if (!ok)
    fail<error>("tensor '{}': value [{}] = {} is not representable in {}", name, i, v,
                st_dtype_name(t));
  put(out, static_cast<T>(v));
}

// The header as ordered JSON; a key repeated in any object (JSON allows it, safetensors has one
// meaning per name) is a trace_error.
ojson parse_header(std::string_view text, const std::string& what) {
  std::vector<std::set<std::string>> keys;
  std::string dup;
  const ojson::parser_callback_t cb = [&](int, ojson::parse_event_t ev, ojson& parsed) {
    if (ev == ojson::parse_event_t::object_start)
      keys.emplace_back();
    else if (ev == ojson::parse_event_t::object_end)
      keys.pop_back();
    else if (ev == ojson::parse_event_t::key && dup.empty() &&
             !keys.back().insert(parsed.get<std::string>()).second)
      dup = parsed.get<std::string>();
    return true;
  };
  ojson j;
  try {
    j = ojson::parse(text.begin(), text.end(), cb);
  } catch (const nlohmann::json::exception& e) {
    fail<trace_error>("{}: the safetensors header is not valid JSON: {}", what, e.what());
  }
  if (!dup.empty()) fail<trace_error>("{}: the safetensors header repeats the key '{}'", what, dup);
  if (!j.is_object())
    fail<trace_error>("{}: the safetensors header must be a JSON object, got {}", what,
                      j.type_name());
  return j;
}

struct entry {
  st_tensor t;
  std::uint64_t begin, end;
};

entry parse_entry(const std::string& name, const ojson& v, std::size_t buffer,
                  const std::string& what) {
  if (!v.is_object())
    fail<trace_error>(
        "{}: tensor '{}' must be an object with dtype, shape and data_offsets, got {}", what, name,
        v.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key))
      fail<trace_error>("{}: tensor '{}' has no '{}' (an entry needs dtype, shape, data_offsets)",
                        what, name, key);
  entry e{{name, st_dtype::f32, {}, {}}, 0, 0};
  const auto& dt = v["dtype"];
  const auto d = std::find_if(dtypes.begin(), dtypes.end(), [&](const dtype_info& x) {
    return dt.is_string() && x.name == dt.get_ref<const std::string&>();
  });
  if (d == dtypes.end())
    fail<trace_error>("{}: tensor '{}' has dtype {}; known dtypes are {}", what, name, dt.dump(),
                      known_dtypes());
  e.t.type = d->type;
  const auto& sh = v["shape"];
  if (!sh.is_array())
    fail<trace_error>("{}: tensor '{}' has shape {}; it must be an array of integers", what, name,
                      sh.dump());
  for (std::size_t i = 0; i < sh.size(); ++i) {
    const auto& x = sh[i];
    if (!x.is_number_integer())
      fail<trace_error>("{}: tensor '{}' has shape[{}] = {}, not an integer", what, name, i,
                        x.dump());
    if (x.is_number_unsigned() ? x.get<std::uint64_t>() > std::numeric_limits<std::int64_t>::max()
                               : x.get<std::int64_t>() < 0)
      fail<trace_error>("{}: tensor '{}' has shape[{}] = {}; dimensions must be in [0, 2^63)", what,
                        name, i, x.dump());
    e.t.shape.push_back(x.get<std::int64_t>());
  }
  std::int64_t numel = 0, bytes = 0;
  if (!checked_bytes(e.t.shape, static_cast<std::int64_t>(d->size), numel, bytes))
    fail<trace_error>("{}: tensor '{}' of dtype {} and shape {} has more bytes than int64 holds",
                      what, name, d->name, e.t.shape);
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    fail<trace_error>(
        "{}: tensor '{}' has data_offsets {}; it must be [begin, end], two "
        "non-negative integers",
        what, name, off.dump());
  e.begin = off[0].get<std::uint64_t>();
  e.end = off[1].get<std::uint64_t>();
  if (e.begin > e.end)
    fail<trace_error>("{}: tensor '{}' has data_offsets [{}, {}]: begin after end", what, name,
                      e.begin, e.end);
  if (e.end > buffer)
    fail<trace_error>(
        "{}: tensor '{}' has data_offsets [{}, {}] beyond the {}-byte data buffer (truncated "
        "file?)",
        what, name, e.begin, e.end, buffer);
  if (e.end - e.begin != static_cast<std::uint64_t>(bytes))
    fail<trace_error>(
        "{}: tensor '{}' has data_offsets [{}, {}] but dtype {} × shape {} needs {} "
        "bytes",
        what, name, e.begin, e.end, d->name, e.t.shape, bytes);
  return e;
}

}  // namespace

std::string_view st_dtype_name(st_dtype t) { return info(t).name; }
std::size_t st_dtype_size(st_dtype t) { return info(t).size; }

double f16_to_f64(std::uint16_t h) { return widen(h, 5, 10); }
double bf16_to_f64(std::uint16_t h) { return widen(h, 8, 7); }
std::uint16_t f64_to_f16(double x) { return static_cast<std::uint16_t>(narrow(x, 5, 10)); }
std::uint16_t f64_to_bf16(double x) { return static_cast<std::uint16_t>(narrow(x, 8, 7)); }

std::int64_t st_tensor::numel() const {
  std::int64_t n = 0, b = 0;
  if (!checked_bytes(shape, static_cast<std::int64_t>(st_dtype_size(type)), n, b))
    fail<error>("tensor '{}': shape {} has a negative dimension or overflows int64", name, shape);
  return n;
}

std::vector<double> st_tensor::to_f64() const {
  const auto n = numel();
  if (bytes.size() != static_cast<std::uint64_t>(n) * st_dtype_size(type))
    fail<error>("tensor '{}': {} bytes for {} × shape {}", name, bytes.size(), st_dtype_name(type),
                shape);
  std::vector<double> out(static_cast<std::size_t>(n));
  switch (type) {
    case st_dtype::f64:
      widen_all<double>(bytes, out);
      break;
    case st_dtype::f32:
      widen_all<float>(bytes, out);
      break;
    case st_dtype::f16:
      widen_all<std::uint16_t>(bytes, out);
      break;
    case st_dtype::bf16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        std::uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);  // exact
      }
      break;
    case st_dtype::i64:
      widen_all<std::int64_t>(bytes, out);
      break;
    case st_dtype::i32:
      widen_all<std::int32_t>(bytes, out);
      break;
    case st_dtype::i16:
      widen_all<std::int16_t>(bytes, out);
      break;
    case st_dtype::i8:
      widen_all<std::int8_t>(bytes, out);
      break;
    case st_dtype::u8:
    case st_dtype::boolean:
      widen_all<std::uint8_t>(bytes, out);
      break;
  }
  return out;
}

const st_tensor* st_file::find(std::string_view name) const {
  const auto it = std::find_if(tensors.begin(), tensors.end(),
                               [&](const st_tensor& t) { return t.name == name; });
  return it == tensors.end() ? nullptr : &*it;
}

st_index index_safetensors(std::string_view bytes, const std::string& what) {
  if (bytes.size() < 8)
    fail<trace_error>(
        "{}: {} bytes; a safetensors file starts with an 8-byte little-endian header length", what,
        bytes.size());
  std::uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  if (n > max_header)
    fail<trace_error>("{}: header length {} exceeds safetensors' limit of {} bytes", what, n,
                      max_header);
  if (n > bytes.size() - 8)
    fail<trace_error>("{}: header length {} but only {} bytes follow it (truncated file?)", what, n,
                      bytes.size() - 8);
  const auto buffer = bytes.size() - 8 - n;
  const ojson j = parse_header(bytes.substr(8, n), what);
  st_index f;
  f.data_start = 8 + n;
  std::vector<entry> entries;
  for (const auto& [name, v] : j.items()) {
    if (name != "__metadata__") {
      entries.push_back(parse_entry(name, v, buffer, what));
      continue;
    }
    if (v.is_null()) continue;
    if (!v.is_object())
      fail<trace_error>("{}: __metadata__ must be an object of strings, got {}", what,
                        v.type_name());
    for (const auto& [k, s] : v.items()) {
      if (!s.is_string())
        fail<trace_error>("{}: __metadata__ '{}' is {}; metadata values must be strings", what, k,
                          s.dump());
      f.metadata.emplace(k, s.get<std::string>());
    }
  }
  // File order (header order among equal offsets); empty tensors never overlap anything.
  std::stable_sort(entries.begin(), entries.end(), [](const entry& a, const entry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  const entry* last = nullptr;
  for (auto& e : entries) {
    if (e.begin == e.end) continue;
    if (last && e.begin < last->end)
      fail<trace_error>("{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", what, last->t.name,
                        last->begin, last->end, e.t.name, e.begin, e.end);
    last = &e;
  }
  for (auto& e : entries)
    f.tensors.push_back({std::move(e.t.name), e.t.type, std::move(e.t.shape), e.begin, e.end});
  return f;
}

st_file parse_safetensors(std::string_view bytes, const std::string& what) {
  auto idx = index_safetensors(bytes, what);
  st_file f;
  f.metadata = std::move(idx.metadata);
  const auto buffer = bytes.substr(idx.data_start);
  for (auto& e : idx.tensors)
    f.tensors.push_back({std::move(e.name), e.type, std::move(e.shape),
                         std::string(buffer.substr(e.begin, e.end - e.begin))});
  return f;
}

st_file read_safetensors(const std::string& path) {
  if (std::error_code ec; std::filesystem::is_directory(path, ec))
    fail<trace_error>("cannot read '{}': it is a directory, not a safetensors file", path);
  return parse_safetensors(read_file(path), path);
}

std::string serialize_safetensors(const st_file& f) {
  ojson h = ojson::object();
  if (!f.metadata.empty()) h["__metadata__"] = f.metadata;
  std::uint64_t off = 0;
  for (const auto& t : f.tensors) {
    if (t.name == "__metadata__" || h.contains(t.name))
      fail<error>("cannot write safetensors: tensor name '{}' is reserved or repeated", t.name);
    if (t.bytes.size() != static_cast<std::uint64_t>(t.numel()) * st_dtype_size(t.type))
      fail<error>("cannot write safetensors: tensor '{}' has {} bytes but {} × shape {} needs {}",
                  t.name, t.bytes.size(), st_dtype_name(t.type), t.shape,
                  t.numel() * static_cast<std::int64_t>(st_dtype_size(t.type)));
    h[t.name] = {{"dtype", st_dtype_name(t.type)},
                 {"shape", t.shape},
                 {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::string header;
  try {
    header = h.dump();
  } catch (const nlohmann::json::exception& e) {
    fail<error>("cannot write safetensors: a name or metadata entry is not UTF-8: {}", e.what());
  }
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + header.size() + off);
  put(out, static_cast<std::uint64_t>(header.size()));
  out += header;
  for (const auto& t : f.tensors) out += t.bytes;
  return out;
}

void write_safetensors(const std::string& path, const st_file& f) {
  write_atomic(path, serialize_safetensors(f));
}

st_tensor make_tensor(std::string name, std::vector<std::int64_t> shape,
                      std::span<const double> values, st_dtype type) {
  st_tensor t{std::move(name), type, std::move(shape), {}};
  if (static_cast<std::uint64_t>(t.numel()) != values.size())
    fail<shape_error>("tensor '{}': {} values for shape {} ({} elements)", t.name, values.size(),
                      t.shape, t.numel());
  t.bytes.reserve(values.size() * st_dtype_size(type));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (type) {
      case st_dtype::f64:
        put(t.bytes, v);
        break;
      case st_dtype::f32:
        put(t.bytes, std::bit_cast<float>(narrow(v, 8, 23)));
        break;
      case st_dtype::f16:
        put(t.bytes, f64_to_f16(v));
        break;
      case st_dtype::bf16:
        put(t.bytes, f64_to_bf16(v));
        break;
      case st_dtype::i64:
        put_int<std::int64_t>(t.bytes, v, t.name, i, type);
        break;
      case st_dtype::i32:
        put_int<std::int32_t>(t.bytes, v, t.name, i, type);
        break;
      case st_dtype::i16:
        put_int<std::int16_t>(t.bytes, v, t.name, i, type);
        break;
      case st_dtype::i8:
        put_int<std::int8_t>(t.bytes, v, t.name, i, type);
        break;
      case st_dtype::u8:
      case st_dtype::boolean:
        put_int<std::uint8_t>(t.bytes, v, t.name, i, type);
        break;
    }
  }
  return t;
}

}  // namespace seqpar::io
