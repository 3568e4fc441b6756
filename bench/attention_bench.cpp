// attention_bench: GFLOP/s of the tiled CPU attention (forward + backward, one causal document)
// next to Eigen's square GEMM measured in the same run on the same core, and the peak memory at
// S = 32K to show O(S) memory.
//
//   attention_bench [--quick] [--json] [--tile-q N] [--tile-k N] [--no-memory]
//
// FLOP convention (FlashAttention's): forward = 4·S²·H·d (two GEMMs), backward = 2.5 × forward,
// causal halves both; so fwd+bwd causal = 3.5 · 4·S²·H·d / 2 = 7·S²·H·d. Masked/skipped work and
// the exp/rowsum passes are not counted. GEMM: 2·n³ for an n×n by n×n product.
#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "sim/attention.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Peak resident set (VmHWM) of this process in bytes, 0 if /proc is unavailable.
std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

template <class T>
std::vector<T> filled(std::size_t n, std::uint32_t seed) {
  std::vector<T> x(n);
  std::uint32_t s = seed * 2654435761u + 1;
  for (auto& e : x) {
    s = s * 1664525u + 1013904223u;  // LCG: cheap, deterministic
    e = static_cast<T>(static_cast<double>(s >> 8) / double(1 << 24) * 2.0 - 1.0);
  }
  return x;
}

template <class T>
const char* dtype_name() {
  return sizeof(T) == 4 ? "f32" : "f64";
}

/// Single-threaded Eigen GEMM rate (best of a few runs) for n×n row-major operands.
template <class T>
double gemm_gflops(int n) {
  using mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const mat a = mat::Random(n, n), b = mat::Random(n, n);
  mat c(n, n);
  double best = 1e30;
  const auto start = clock_type::now();
  for (int rep = 0; rep < 20 && (rep < 3 || seconds_since(start) < 0.3); ++rep) {
    const auto t0 = clock_type::now();
    c.noalias() = a * b;
    best = std::min(best, seconds_since(t0));
  }
  if (c(0, 0) == T(12345)) std::puts("");  // keep the product alive
  return 2.0 * n * n * double(n) / best * 1e-9;
}

/// The buffers of one causal single-document problem of s tokens and h heads (GQA off).
template <class T>
struct problem {
  std::int64_t s;
  int h, d;
  std::vector<T> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<std::int32_t> cu;
  problem(std::int64_t s_, int h_, int d_) : s(s_), h(h_), d(d_) {
    const std::size_t n = static_cast<std::size_t>(s) * h * d;
    q = filled<T>(n, 1);
    k = filled<T>(n, 2);
    v = filled<T>(n, 3);
    dout = filled<T>(n, 4);
    out.assign(n, T(0));
    dq.assign(n, T(0));
    dk.assign(n, T(0));
    dv.assign(n, T(0));
    lse.assign(static_cast<std::size_t>(s) * h, T(0));
    cu = {0, static_cast<std::int32_t>(s)};
  }
  seqpar::sim::attention_args<T> args() const {
    return {q.data(), k.data(), v.data(),  s,         s, h,
            h,        d,        cu.data(), cu.data(), 1, 1.0 / std::sqrt(static_cast<double>(d)),
            true};
  }
};

struct row {
  const char* dtype;
  int d, h;
  std::int64_t s;
  double fwd_s, bwd_s, gemm;
  double fwd_flop() const { return 4.0 * double(s) * double(s) * h * d / 2; }  // causal
  double fwd_gflops() const { return fwd_flop() / fwd_s * 1e-9; }
  double bwd_gflops() const { return 2.5 * fwd_flop() / bwd_s * 1e-9; }
  double gflops() const { return 3.5 * fwd_flop() / (fwd_s + bwd_s) * 1e-9; }
};

/// Times forward and backward (best over repetitions within ~0.3 s, at least one).
template <class T>
row time_attention(std::int64_t s, int h, int d, seqpar::sim::attention_tiles tiles, double gemm) {
  problem<T> p(s, h, d);
  const auto a = p.args();
  double fwd = 1e30, bwd = 1e30;
  const auto start = clock_type::now();
  for (int rep = 0; rep < 10 && (rep == 0 || seconds_since(start) < 0.3); ++rep) {
    auto t0 = clock_type::now();
    seqpar::sim::attention_forward(a, p.out.data(), p.lse.data(), tiles);
    fwd = std::min(fwd, seconds_since(t0));
    t0 = clock_type::now();
    seqpar::sim::attention_backward(a, p.out.data(), p.lse.data(), p.dout.data(), p.dq.data(),
                                    p.dk.data(), p.dv.data(), tiles);
    bwd = std::min(bwd, seconds_since(t0));
  }
  return {dtype_name<T>(), d, h, s, fwd, bwd, gemm};
}

struct memory_row {
  std::int64_t s;
  std::int64_t peak_delta;    // VmHWM after - VmHWM at program start of the measurement
  std::int64_t tensor_bytes;  // q, k, v, out, dout, dq, dk, dv, lse
};

/// Runs forward + backward at growing S in f32 (d = 64, H = 1) and records the peak RSS growth.
/// VmHWM only grows, so measuring in increasing S order gives each size's own peak.
std::vector<memory_row> measure_memory(const std::vector<std::int64_t>& sizes,
                                       seqpar::sim::attention_tiles tiles) {
  std::vector<memory_row> rows;
  const std::int64_t base = peak_rss_bytes();
  for (std::int64_t s : sizes) {
    std::int64_t tensor_bytes = 0;
    {
      problem<float> p(s, 1, 64);
      const auto a = p.args();
      seqpar::sim::attention_forward(a, p.out.data(), p.lse.data(), tiles);
      seqpar::sim::attention_backward(a, p.out.data(), p.lse.data(), p.dout.data(), p.dq.data(),
                                      p.dk.data(), p.dv.data(), tiles);
      tensor_bytes = static_cast<std::int64_t>(sizeof(float)) * (8 * s * 64 + s);
    }
    rows.push_back({s, peak_rss_bytes() - base, tensor_bytes});
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, json = false, memory = true;
  seqpar::sim::attention_tiles tiles;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--json") {
      json = true;
    } else if (arg == "--no-memory") {
      memory = false;
    } else if ((arg == "--tile-q" || arg == "--tile-k") && i + 1 < argc) {
      (arg == "--tile-q" ? tiles.q : tiles.k) = std::stoi(argv[++i]);
    } else {
      fmt::print(stderr,
                 "usage: attention_bench [--quick] [--json] [--tile-q N] [--tile-k N] "
                 "[--no-memory]; got '{}'\n",
                 arg);
      return 2;
    }
  }
  const std::vector<std::int64_t> seqs =
      quick ? std::vector<std::int64_t>{1024, 2048, 4096}
            : std::vector<std::int64_t>{1024, 2048, 4096, 8192, 16384};
  const int gemm_n = 1024, heads = 1;
  const char* convention =
      "causal fwd = 4*S^2*H*d/2, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd; gemm = 2*n^3, n = 1024; "
      "one core, Eigen, no OpenMP";

  std::vector<memory_row> mem;
  if (memory) {
    // First, while VmHWM still reflects only start-up: VmHWM never decreases.
    // Two sizes 8x apart: equal bytes/token means O(S); S^2 scores would grow it 8x.
    mem = measure_memory(
        quick ? std::vector<std::int64_t>{1024, 8192} : std::vector<std::int64_t>{4096, 32768},
        tiles);
  }
  std::vector<row> rows;
  if (!json) {
    fmt::print("# attention_bench: tiled attention (tiles {}x{}), one causal document, H={}\n",
               tiles.q, tiles.k, heads);
    fmt::print("# FLOPs: {}\n", convention);
    fmt::print("# {:>5} {:>4} {:>6} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>6}\n", "dtype", "d",
               "S", "fwd_ms", "bwd_ms", "fwd_GF/s", "bwd_GF/s", "GF/s", "gemm_GF/s", "ratio");
  }
  for (int type = 0; type < 2; ++type) {
    for (int d : {64, 128}) {
      for (std::int64_t s : seqs) {
        // GEMM is re-measured next to every row so that both see the same machine load.
        const row r = type == 0
                          ? time_attention<float>(s, heads, d, tiles, gemm_gflops<float>(gemm_n))
                          : time_attention<double>(s, heads, d, tiles, gemm_gflops<double>(gemm_n));
        rows.push_back(r);
        if (!json) {
          fmt::print(
              "  {:>5} {:>4} {:>6} {:>10.2f} {:>10.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f} "
              "{:>6.2f}\n",
              r.dtype, r.d, r.s, r.fwd_s * 1e3, r.bwd_s * 1e3, r.fwd_gflops(), r.bwd_gflops(),
              r.gflops(), r.gemm, r.gflops() / r.gemm);
          std::fflush(stdout);
        }
      }
    }
  }

  if (!json) {
    if (memory) {
      fmt::print(
          "# peak memory, f32, d=64, H=1, fwd+bwd (VmHWM growth; S^2 scores at 32K would "
          "be {} MiB)\n",
          32768ll * 32768 * 4 >> 20);
      fmt::print("# {:>6} {:>12} {:>14} {:>16}\n", "S", "peak_MiB", "bytes/token",
                 "tensor_bytes/tok");
      for (const auto& m : mem) {
        fmt::print("  {:>6} {:>12.1f} {:>14.1f} {:>16.1f}\n", m.s, m.peak_delta / 1048576.0,
                   double(m.peak_delta) / m.s, double(m.tensor_bytes) / m.s);
      }
    }
    return 0;
  }
  fmt::print("{{\"convention\":\"{}\",\"tiles\":{{\"q\":{},\"k\":{}}},\"gemm_n\":{},\"rows\":[",
             convention, tiles.q, tiles.k, gemm_n);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    fmt::print(
        "{}{{\"dtype\":\"{}\",\"d\":{},\"heads\":{},\"seq\":{},\"causal\":true,"
        "\"fwd_ms\":{:.3f},\"bwd_ms\":{:.3f},\"fwd_gflops\":{:.3f},\"bwd_gflops\":{:.3f},"
        "\"gflops\":{:.3f},\"gemm_gflops\":{:.3f},\"ratio\":{:.4f}}}",
        i ? "," : "", r.dtype, r.d, r.h, r.s, r.fwd_s * 1e3, r.bwd_s * 1e3, r.fwd_gflops(),
        r.bwd_gflops(), r.gflops(), r.gemm, r.gflops() / r.gemm);
  }
  fmt::print("],\"memory\":[");
  for (std::size_t i = 0; i < mem.size(); ++i) {
    fmt::print(
        "{}{{\"seq\":{},\"dtype\":\"f32\",\"d\":64,\"heads\":1,\"peak_bytes\":{},"
        "\"bytes_per_token\":{:.1f},\"tensor_bytes_per_token\":{:.1f}}}",
        i ? "," : "", mem[i].s, mem[i].peak_delta, double(mem[i].peak_delta) / mem[i].s,
        double(mem[i].tensor_bytes) / mem[i].s);
  }
  fmt::print("]}}\n");
  return 0;
}
