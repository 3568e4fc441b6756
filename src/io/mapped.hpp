#pragma once
// Safetensors files read in place through mmap: a dump of a long-context job is many times the
// machine's memory in float64, so `validate --dump` reads rows where they lie and converts them
// per block. Pages read are file-backed; release() hands them back (the page cache keeps them),
// so the resident set stays at what one block of work touches.
#include <cstddef>
#include <cstdint>
#include <string>

#include "io/safetensors.hpp"

namespace seqpar::io {

/// One tensor of a mapped file: its dtype, shape and bytes (row-major, little-endian).
struct st_view {
  std::string name;
  st_dtype type = st_dtype::f32;
  std::vector<std::int64_t> shape;
  const unsigned char* data = nullptr;
  std::int64_t numel = 0;
  /// Element i as a double (exact for the float types; see st_tensor::to_f64).
  double at(std::int64_t i) const;
  /// n elements from element i, as doubles.
  void read(std::int64_t i, std::int64_t n, double* out) const;
  /// The bytes of elements [i, i + n).
  const unsigned char* bytes(std::int64_t i) const {
    return data + static_cast<std::size_t>(i) * st_dtype_size(type);
  }
};

/// A safetensors file mapped read-only. The header is checked as parse_safetensors does; a
/// file that cannot be opened or mapped is a seqpar::error naming the path.
class mapped_safetensors {
 public:
  explicit mapped_safetensors(const std::string& path);
  ~mapped_safetensors();
  mapped_safetensors(const mapped_safetensors&) = delete;
  mapped_safetensors& operator=(const mapped_safetensors&) = delete;

  const std::string& path() const { return path_; }
  std::uint64_t size() const { return size_; }
  const std::vector<st_view>& tensors() const { return views_; }
  /// The tensor named `name`, or nullptr.
  const st_view* find(std::string_view name) const;
  /// Drops the pages read so far from this process's resident set (they stay in the page cache).
  void release() const;

 private:
  std::string path_;
  void* base_ = nullptr;
  std::uint64_t size_ = 0;
  std::vector<st_view> views_;
};

/// Converts n elements of `type` at p to doubles (exact for the float types).
void to_f64(st_dtype type, const unsigned char* p, std::int64_t n, double* out);

}  // namespace seqpar::io
