#pragma once
// Safetensors (the public format) in and out: an 8-byte little-endian header length N, N bytes
// of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, …, "__metadata__": {…}}
// (offsets relative to the end of the header), then the raw little-endian buffers. The tensor
// dumps of tools/seqpar_dump.py (docs/dump_format.md) are read with it.
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace seqpar::io {

/// The element types read and written (safetensors' names: st_dtype_name).
enum class st_dtype : std::uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean };

/// "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL".
std::string_view st_dtype_name(st_dtype t);
/// Bytes per element.
std::size_t st_dtype_size(st_dtype t);

/// One tensor: its raw little-endian elements, row-major.
struct st_tensor {
  std::string name;
  st_dtype type = st_dtype::f32;
  std::vector<std::int64_t> shape;  ///< [] is a scalar (one element)
  std::string bytes;                ///< numel() · st_dtype_size(type) bytes

  /// The product of the shape; throws seqpar::error when it overflows int64.
  std::int64_t numel() const;
  /// Every element as a double: exact for all types (F16 / BF16 bit-exact, subnormals, ±inf and
  /// NaN payloads included) except I64 beyond ±2^53, which rounds to nearest. Throws
  /// seqpar::error when bytes does not hold numel() elements.
  std::vector<double> to_f64() const;
  bool operator==(const st_tensor&) const = default;
};

/// A whole file: tensors ordered by data offset, and the string metadata.
struct st_file {
  std::vector<st_tensor> tensors;
  std::map<std::string, std::string> metadata;

  /// The tensor named `name`, or nullptr.
  const st_tensor* find(std::string_view name) const;
  bool operator==(const st_file&) const = default;
};

/// Where a tensor's bytes lie in a file, without them.
struct st_entry {
  std::string name;
  st_dtype type = st_dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  ///< relative to st_index::data_start
};
/// A file's header: its tensors (ordered by data offset) and metadata; the buffers start at
/// data_start. Same checks as parse_safetensors.
struct st_index {
  std::vector<st_entry> tensors;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;
};
st_index index_safetensors(std::string_view bytes, const std::string& what);

/// Parses a safetensors file held in memory; every violation of the format (short file, header
/// length, JSON, duplicate keys, dtype, shape, data_offsets out of the buffer, not matching the
/// shape or overlapping) is a trace_error naming `what`, the tensor and the values. Gaps between
/// buffers and trailing bytes are allowed.
st_file parse_safetensors(std::string_view bytes, const std::string& what);

/// Reads and parses the file at `path` (messages name the path).
st_file read_safetensors(const std::string& path);

/// The file's bytes: header (metadata first, then the tensors in the given order) padded with
/// spaces to a multiple of 8, then the buffers contiguously. Throws seqpar::error for a tensor
/// whose bytes do not match its shape, a duplicate name or one named "__metadata__".
std::string serialize_safetensors(const st_file& f);

/// Writes serialize_safetensors(f) to `path` atomically (io::write_atomic).
void write_safetensors(const std::string& path, const st_file& f);

/// A tensor of `type` holding `values` (as many as the shape's product), rounded to nearest
/// even for F32 / F16 / BF16 (overflow gives ±inf, NaN stays NaN); integer types and BOOL need
/// integral values in range. Throws seqpar::error otherwise.
st_tensor make_tensor(std::string name, std::vector<std::int64_t> shape,
                      std::span<const double> values, st_dtype type);

/// IEEE half and bfloat16 from and to double (round to nearest even, overflow to ±inf).
double f16_to_f64(std::uint16_t h);
double bf16_to_f64(std::uint16_t h);
std::uint16_t f64_to_f16(double x);
std::uint16_t f64_to_bf16(double x);

}  // namespace seqpar::io
