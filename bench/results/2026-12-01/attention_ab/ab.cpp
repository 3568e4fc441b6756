// In-process A/B of two builds of the oracle's attention (src/sim/reference_attention.cpp of two
// trees, each built as a shared object: a.so and b.so in the working directory). One process
// loads both, makes one set of inputs (Hq 8 / Hkv 2, documents 2:1:1 as oracle_bench, 1 thread),
// and times the forward + backward (given the forward's softmax rows and output) of A and B one
// right after the other, A first and B first in turn. On a VM whose speed moves by ×1.3 within
// seconds, the ratio of two adjacent runs cancels most of that: A against itself reads 0.99-1.01.
// Arguments: kind (F full, W window 128, C chunk 256) d pairs tokens [softcap]. Prints each
// side's best and median seconds, the median of the adjacent B/A ratios, and whether the two
// sides' checksums (the sums of o, dq, dk and dv) are the same.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sim/allocator.hpp"
#include "sim/reference.hpp"

using namespace seqpar;
using forward_fn = decltype(&ref::ops::attention);
using backward_fn = decltype(&ref::ops::attention_backward);

struct side {
  forward_fn forward;
  backward_fn backward;
};

side load(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    std::fprintf(stderr, "%s\n", dlerror());
    std::exit(1);
  }
  // the mangled names of ref::ops::attention and ref::ops::attention_backward (nm on the library)
  side s{reinterpret_cast<forward_fn>(
             dlsym(h,
                   "_ZN6seqpar3ref3ops9attentionERKN5Eigen6MatrixIdLin1ELin1ELi1ELin1ELin1EEES6_S6_"
                   "iiiSt4spanIKlLm18446744073709551615EEiRKNS1_14attention_ruleEPNS1_12softmax_"
                   "rowsE")),
         reinterpret_cast<backward_fn>(dlsym(
             h,
             "_ZN6seqpar3ref3ops18attention_backwardERKN5Eigen6MatrixIdLin1ELin1ELi1ELin1ELin1"
             "EEES6_S6_S6_iiiSt4spanIKlLm18446744073709551615EERS4_SA_SA_iRKNS1_14attention_"
             "ruleEPS4_PKNS1_12softmax_rowsEPS5_"))};
  if (!s.forward || !s.backward) {
    std::fprintf(stderr, "%s: the attention's symbols are missing\n", path);
    std::exit(1);
  }
  return s;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: ab KIND(F|W|C) d pairs tokens [softcap]\n");
    return 2;
  }
  sim::keep_freed_memory();
  const char kind = argv[1][0];
  const int d = std::atoi(argv[2]), pairs = std::atoi(argv[3]), S = std::atoi(argv[4]);
  side A = load("./a.so"), B = load("./b.so");
  const int Hq = 8, Hkv = 2;
  std::vector<std::int64_t> pos;
  for (int n : {S / 2, S / 4, S / 4})
    for (int i = 0; i < n; ++i) pos.push_back(i);
  const ref::matrix q = ref::matrix::Random(S, Hq * d), k = ref::matrix::Random(S, Hkv * d),
                    v = ref::matrix::Random(S, Hkv * d), dout = ref::matrix::Random(S, Hq * d);
  ref::ops::attention_rule rule;
  rule.kind = kind;
  rule.causal = true;
  rule.window = 128;
  rule.chunk = 256;
  rule.softcap = argc > 5 ? std::atof(argv[5]) : 0;
  const auto run = [&](const side& s, double& checksum) {
    const auto t0 = std::chrono::steady_clock::now();
    ref::ops::softmax_rows keep;
    ref::matrix o = s.forward(q, k, v, Hq, Hkv, d, pos, 1, rule, &keep), dq, dk, dv;
    s.backward(q, k, v, dout, Hq, Hkv, d, pos, dq, dk, dv, 1, rule, nullptr, &keep, &o);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    checksum = o.sum() + dq.sum() + dk.sum() + dv.sum();
    return secs;
  };
  double ca = 0, cb = 0;
  run(A, ca);  // each side once untimed: its pages touched
  run(B, cb);
  std::vector<double> ta, tb, ratio;
  for (int i = 0; i < pairs; ++i) {
    double a, b;
    if (i % 2 == 0) {
      a = run(A, ca);
      b = run(B, cb);
    } else {
      b = run(B, cb);
      a = run(A, ca);
    }
    ta.push_back(a);
    tb.push_back(b);
    ratio.push_back(b / a);
  }
  const auto median = [](std::vector<double> x) {
    std::ranges::sort(x);
    return x[x.size() / 2];
  };
  std::printf(
      "%c d %d, %d tokens%s: A best %.4f s, median %.4f | B best %.4f s, median %.4f | B/A median "
      "%.3f (best/best %.3f) | checksums %s\n",
      kind, d, S, rule.softcap > 0 ? ", capped" : "", std::ranges::min(ta), median(ta),
      std::ranges::min(tb), median(tb), median(ratio), std::ranges::min(tb) / std::ranges::min(ta),
      ca == cb ? "the same" : "DIFFERENT");
}
