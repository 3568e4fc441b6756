// The oracle's public vector functions (reference.hpp): exp_shifted and softcap_span, by the
// primitives of reference_lanes.hpp.
#include "sim/reference_lanes.hpp"

#include "sim/reference.hpp"

namespace seqpar::ref::ops {

using namespace lanes_detail;

double exp_shifted(double* x, std::ptrdiff_t n, double m) { return exp_span(x, n, m); }

// softcap_span (reference.hpp): by vectors, each lane's tanh by its own formula (tanh_lanes),
// so that a value's result does not depend on its place. The largest capped value is taken on
// the way, as `largest` takes it (a NaN skipped, a NaN `init` kept): the forward's row maximum
// without a pass of its own.
double softcap_span(double* x, double* slope, std::ptrdiff_t n, double cap, double init) {
  lanes_f64 top = lanes_f64{} + init;
  // One vector at x + i, `count` of its lanes real (the tail padded with zeros); its capped
  // values returned. Inlined by force: as a call, its copies of a variable size became calls to
  // memcpy for every vector.
  const auto one = [&](std::ptrdiff_t i, std::ptrdiff_t count) __attribute__((always_inline)) {
    const lanes_f64 t = tanh_lanes(load_lanes(x + i, count));
    if (slope) store_lanes(slope + i, 1.0 - t * t, count);
    const lanes_f64 capped = cap * t;
    store_lanes(x + i, capped, count);
    return capped;
  };
  std::ptrdiff_t i = 0;
  for (; i + lanes <= n; i += lanes) top = lanes_larger(one(i, lanes), top);
  double most = lanes_max(top);  // init is in every lane
  if (i < n) {
    one(i, n - i);
    for (; i < n; ++i) most = std::max(most, x[i]);
  }
  return most;
}

}  // namespace seqpar::ref::ops
