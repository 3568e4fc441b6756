#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "sim/allocator.hpp"
#include "sim/reference.hpp"
using namespace seqpar;
int main(int argc, char** argv) {
  seqpar::sim::keep_freed_memory();
  char kind = argv[1][0];
  int d = atoi(argv[2]);
  int reps = atoi(argv[3]);
  if (kind == 'E') {  // exp_shifted on rows of d values (arg 2), best of reps
    std::vector<double> x(d), y(d);
    for (int i = 0; i < d; ++i) x[i] = -8.0 * i / d;
    double best = 1e30, acc = 0;
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 20000; ++i) {
        y = x;
        acc += ref::ops::exp_shifted(y.data(), d, 0.0);
        x[0] = -y[1] * 1e-9;
      }
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("%.7f s  %.3f ns/value  chk %.6g\n", best, best / (20000.0 * d) * 1e9, acc);
    return 0;
  }
  double cap = argc > 4 ? atof(argv[4]) : 0;
  int S = argc > 5 ? atoi(argv[5]) : 4096;
  const int Hq = 8, Hkv = 2;
  std::vector<std::int64_t> pos;
  for (int n : {S / 2, S / 4, S / 4})
    for (int i = 0; i < n; ++i) pos.push_back(i);
  ref::matrix q = ref::matrix::Random(S, Hq * d), k = ref::matrix::Random(S, Hkv * d),
              v = ref::matrix::Random(S, Hkv * d), dout = ref::matrix::Random(S, Hq * d);
  ref::ops::attention_rule r;
  r.kind = kind;
  r.causal = true;
  r.window = 128;
  r.chunk = 256;
  r.softcap = cap;
  double pairs = 0;
  for (int n : {S / 2, S / 4, S / 4})
    for (int p = 0; p < n; ++p) {
      long lo = 0, hi = p + 1;
      if (kind == 'W') lo = std::max(0, p - 127);
      if (kind == 'C') lo = p / 256 * 256;
      pairs += hi - lo;
    }
  double best = 1e30, chk = 0;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    ref::ops::softmax_rows keep;
    ref::matrix o = ref::ops::attention(q, k, v, Hq, Hkv, d, pos, 1, r,
                                        getenv("NOKEEP") ? nullptr : &keep),
                dq, dk, dv;
    ref::ops::attention_backward(q, k, v, dout, Hq, Hkv, d, pos, dq, dk, dv, 1, r, nullptr,
                                 getenv("NOKEEP") ? nullptr : &keep,
                                 getenv("NOKEEP") ? nullptr : &o);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    chk = o.sum() + dq.sum() + dk.sum() + dv.sum();
  }
  printf("%.4f s  %.2f GFLOP/s  chk %.17g\n", best, 14 * pairs * Hq * d / best / 1e9, chk);
}
