#include "io/mapped.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.hpp"

namespace seqpar::io {

namespace {

template <class T>
void widen(const unsigned char* p, std::int64_t n, double* out) {
  for (std::int64_t i = 0; i < n; ++i) {
    T x;
    std::memcpy(&x, p + static_cast<std::size_t>(i) * sizeof(T), sizeof(T));
    out[i] = static_cast<double>(x);
  }
}

}  // namespace

void to_f64(st_dtype type, const unsigned char* p, std::int64_t n, double* out) {
  switch (type) {
    case st_dtype::f64:
      std::memcpy(out, p, static_cast<std::size_t>(n) * 8);
      return;
    case st_dtype::f32:
      return widen<float>(p, n, out);
    case st_dtype::bf16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);  // exact
      }
      return;
    case st_dtype::f16:
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = f16_to_f64(h);
      }
      return;
    case st_dtype::i64:
      return widen<std::int64_t>(p, n, out);
    case st_dtype::i32:
      return widen<std::int32_t>(p, n, out);
    case st_dtype::i16:
      return widen<std::int16_t>(p, n, out);
    case st_dtype::i8:
      return widen<std::int8_t>(p, n, out);
    case st_dtype::u8:
    case st_dtype::boolean:
      return widen<std::uint8_t>(p, n, out);
  }
}

double st_view::at(std::int64_t i) const {
  double x;
  to_f64(type, bytes(i), 1, &x);
  return x;
}

void st_view::read(std::int64_t i, std::int64_t n, double* out) const {
  to_f64(type, bytes(i), n, out);
}

mapped_safetensors::mapped_safetensors(const std::string& path) : path_(path) {
  if (std::error_code ec; std::filesystem::is_directory(path, ec))
    fail<trace_error>("cannot read '{}': it is a directory, not a safetensors file", path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail<error>("cannot read '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail<error>("cannot read '{}': {}", path, std::strerror(e));
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ > 0) {
    base_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (base_ == MAP_FAILED) {
      const int e = errno;
      base_ = nullptr;
      ::close(fd);
      fail<error>("cannot map '{}' ({} bytes): {}", path, size_, std::strerror(e));
    }
  }
  ::close(fd);
  try {
    const std::string_view bytes(static_cast<const char*>(base_), size_);
    auto idx = index_safetensors(bytes, path);
    const auto* data = static_cast<const unsigned char*>(base_) + idx.data_start;
    for (auto& e : idx.tensors) {
      st_view v;
      v.name = std::move(e.name);
      v.type = e.type;
      v.shape = std::move(e.shape);
      v.data = data + e.begin;
      v.numel = static_cast<std::int64_t>((e.end - e.begin) / st_dtype_size(e.type));
      views_.push_back(std::move(v));
    }
  } catch (...) {
    if (base_) ::munmap(base_, size_);
    throw;
  }
}

mapped_safetensors::~mapped_safetensors() {
  if (base_) ::munmap(base_, size_);
}

const st_view* mapped_safetensors::find(std::string_view name) const {
  for (const auto& v : views_)
    if (v.name == name) return &v;
  return nullptr;
}

void mapped_safetensors::release() const {
  // The raw system call: an MPI build links UCX, whose memory hooks intercept madvise() and
  // make every call cost far more than the page-table walk it asks for.
  if (base_) ::syscall(SYS_madvise, base_, size_, MADV_DONTNEED);
}

}  // namespace seqpar::io
