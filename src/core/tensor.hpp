#pragma once
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace seqpar {

using shape_t = std::vector<std::int64_t>;

inline std::int64_t numel_of(const shape_t& s) {
  return std::accumulate(s.begin(), s.end(), std::int64_t{1}, std::multiplies<>());
}

/// A dense row-major tensor in some backend's memory (host for the CPU reference, device for
/// CUDA). Copies share storage; the backend that allocated it knows how to read it.
struct tensor {
  seqpar::dtype type = dtype::f64;
  shape_t shape;
  std::shared_ptr<void> storage;  ///< owner of the bytes
  void* data = nullptr;

  std::int64_t numel() const { return numel_of(shape); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(type); }
  template <class T>
  T* as() const {
    if (dtype_of<T>() != type)
      fail<shape_error>("tensor of {} read as {}", dtype_name(type), dtype_name(dtype_of<T>()));
    return static_cast<T*>(data);
  }
  /// Same storage, new shape with the same element count.
  tensor reshaped(shape_t s) const {
    if (numel_of(s) != numel())
      fail<shape_error>("cannot view {} elements as a tensor of {}", numel(), numel_of(s));
    tensor t = *this;
    t.shape = std::move(s);
    return t;
  }
};

}  // namespace seqpar
