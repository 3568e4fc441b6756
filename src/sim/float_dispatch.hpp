#pragma once
// The CPU backend's dispatch from a tensor's dtype to its C++ scalar.
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace seqpar::sim {

/// Runs f.template operator()<T>() for the tensor's floating dtype (double or float); any
/// other dtype is a shape_error naming it.
template <class F>
decltype(auto) by_float(dtype t, F&& f) {
  switch (t) {
    case dtype::f64:
      return f.template operator()<double>();
    case dtype::f32:
      return f.template operator()<float>();
    default:
      break;
  }
  fail<shape_error>("the CPU reference computes in float64 or float32, not {}", dtype_name(t));
}

}  // namespace seqpar::sim
