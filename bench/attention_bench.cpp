// attention_bench: GFLOP/s of the tiled CPU attention (sim/attention.hpp; forward + backward,
// one causal document, H = 1) next to Eigen's square GEMM measured in the same run on the same
// core, and the peak memory per token at two sizes 8× apart to show O(S) memory.
//
//   attention_bench [common flags] [--tile-q N] [--tile-k N] [--no-memory]
//
// size = bytes of Q (S·H·d·sizeof(type)), count = S tokens. FLOP convention (FlashAttention's):
// forward = 4·S²·H·d (two GEMMs), backward = 2.5 × forward, causal halves both; so fwd+bwd
// causal = 3.5·4·S²·H·d/2 = 7·S²·H·d. Masked/skipped work and the exp/rowsum passes are not
// counted. GEMM: 2·n³ for an n×n by n×n product. #wrong: sampled forward rows against a direct
// double-precision softmax (bench/attention_oracle.hpp).
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bench/attention_oracle.hpp"
#include "bench/driver.hpp"
#include "sim/attention.hpp"

namespace {

using namespace seqpar;

/// Peak resident set (VmHWM) of this process in bytes, 0 if /proc is unavailable.
std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // kB
  return 0;
}

/// One causal single-document problem of s tokens, h heads (GQA off), index-derived inputs.
template <class T>
struct problem {
  std::int64_t s = 0;
  int h = 1, d = 64;
  std::vector<T> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<std::int32_t> cu;

  problem(std::int64_t s_, int h_, int d_, std::uint64_t seed) : s(s_), h(h_), d(d_) {
    const auto n = static_cast<std::size_t>(s * h * d);
    auto fill = [&](std::vector<T>& x, int tensor) {
      x.resize(n);
      for (std::size_t i = 0; i < n; ++i)
        x[i] = static_cast<T>(bench::exact_value(seed + static_cast<std::uint64_t>(tensor), 0,
                                                 static_cast<std::int64_t>(i)));
    };
    fill(q, 1);
    fill(k, 2);
    fill(v, 3);
    fill(dout, 4);
    out.assign(n, T(0));
    dq.assign(n, T(0));
    dk.assign(n, T(0));
    dv.assign(n, T(0));
    lse.assign(static_cast<std::size_t>(s * h), T(0));
    cu = {0, static_cast<std::int32_t>(s)};
  }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(d)); }
  sim::attention_args<T> args() const {
    return {q.data(), k.data(), v.data(), s, s, h, h, d, cu.data(), cu.data(), 1, scale(), true};
  }
  void forward(sim::attention_tiles t) {
    sim::attention_forward(args(), out.data(), lse.data(), t);
  }
  void backward(sim::attention_tiles t) {
    sim::attention_backward(args(), out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                            dv.data(), t);
  }
  std::int64_t wrong() const {
    auto at = [](const std::vector<T>& x) {
      return [&x](std::int64_t i) { return static_cast<double>(x[static_cast<std::size_t>(i)]); };
    };
    const double u = std::ldexp(1.0, -std::numeric_limits<T>::digits);
    return bench::attention_forward_wrong(s, h, h, d, scale(), at(q), at(k), at(v), at(out), u, u);
  }
};

struct attention {
  static constexpr int heads = 1;
  static constexpr int head_dims[2] = {64, 128};
  sim::attention_tiles tiles;
  std::vector<std::int64_t> memory_sizes;
  // The current point's problem (one of the two types).
  std::unique_ptr<problem<float>> pf;
  std::unique_ptr<problem<double>> pd;

  bench::operation op() {
    bench::operation o;
    o.name = "attention fwd+bwd";
    o.backend = "eigen";
    o.kind = bench::table_kind::compute;
    o.variants = {{"float", "d=64"}, {"float", "d=128"}, {"double", "d=64"}, {"double", "d=128"}};
    auto head_dim = [](std::size_t v) { return head_dims[v % 2]; };
    auto esz = [](std::size_t v) { return v < 2 ? 4 : 8; };
    o.size = [=](std::int64_t bytes, std::size_t v, int) {
      const std::int64_t per_token = std::int64_t{heads} * head_dim(v) * esz(v);
      const std::int64_t s = bytes / per_token;
      return std::pair{s, s * per_token};
    };
    o.init = [=, this](const bench::point& p, std::uint64_t seed) {
      pf.reset();
      pd.reset();
      if (p.variant < 2)
        pf = std::make_unique<problem<float>>(p.count, heads, head_dim(p.variant), seed);
      else
        pd = std::make_unique<problem<double>>(p.count, heads, head_dim(p.variant), seed);
    };
    o.run = [this] {
      if (pf) {
        pf->forward(tiles);
        pf->backward(tiles);
      } else {
        pd->forward(tiles);
        pd->backward(tiles);
      }
    };
    o.check = [this](const bench::point&, std::uint64_t) { return pf ? pf->wrong() : pd->wrong(); };
    o.work = [=](const bench::point& p) {
      const double fwd = 4.0 * static_cast<double>(p.count) * static_cast<double>(p.count) * heads *
                         head_dim(p.variant) / 2;
      return 3.5 * fwd * 1e-9;
    };
    o.measure_baseline = [](const std::string& type) {
      return bench::baseline{"Eigen GEMM 1024^3 " + type + ", 1 thread",
                             bench::eigen_gemm_gflops(type, 1024), "GFLOP/s"};
    };
    o.ratio_meaning = "GFLOP/s / Eigen GEMM GFLOP/s of the same type";
    o.notes = {
        fmt::format("one causal document, H={}, tiles {}x{}; size = bytes of Q, count = tokens S",
                    heads, tiles.q, tiles.k),
        "FLOPs: causal fwd = 4*S^2*H*d/2, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd; gemm = 2*n^3; one "
        "core, no OpenMP",
        "#wrong: 8 sampled forward rows vs a direct double softmax, tol = (S+16)*u + u"};
    if (!memory_sizes.empty()) {
      o.side = [this] {
        // VmHWM never decreases: measured first and in increasing S, each size sees its own
        // peak. Equal bytes/token at two sizes 8x apart means O(S); S^2 scores would grow 8x.
        bench::side_table t;
        t.title = fmt::format(
            "peak memory, float, d=64, H=1, fwd+bwd (VmHWM growth; S^2 scores at S={} would be "
            "{} MiB)",
            memory_sizes.back(), memory_sizes.back() * memory_sizes.back() * 4 >> 20);
        t.columns = {"S", "peak_MiB", "bytes/token", "tensor_bytes/tok"};
        const std::int64_t base = peak_rss_bytes();
        for (std::int64_t s : memory_sizes) {
          {
            problem<float> p(s, 1, 64, 1);
            p.forward(tiles);
            p.backward(tiles);
          }
          const double peak = static_cast<double>(peak_rss_bytes() - base);
          const double tensors = 4.0 * static_cast<double>(8 * s * 64 + s);  // 8 tensors + lse
          t.rows.push_back({static_cast<double>(s), peak / 1048576.0, peak / static_cast<double>(s),
                            tensors / static_cast<double>(s)});
        }
        return t;
      };
    }
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 256 << 10;  // float d=64: S = 1K … 16K
  defaults.max_bytes = 4 << 20;
  defaults.iters = 2;
  defaults.warmup = 1;
  bench::options quick = defaults;
  quick.max_bytes = 1 << 20;  // float d=64: S = 1K … 4K
  quick.iters = 1;
  quick.warmup = 0;
  bench::driver d("attention_bench",
                  "Tiled CPU attention fwd+bwd GFLOP/s next to Eigen GEMM GFLOP/s of the same run.",
                  defaults, quick);
  attention a;
  bool no_memory = false;
  d.app().add_option("--tile-q", a.tiles.q, "q rows per tile")->check(CLI::PositiveNumber);
  d.app().add_option("--tile-k", a.tiles.k, "k rows per tile")->check(CLI::PositiveNumber);
  d.app().add_flag("--no-memory", no_memory, "skip the peak-memory-per-token table");
  if (auto rc = d.parse(argc, argv)) return *rc;
  return d.guarded([&] {
    if (!no_memory)
      a.memory_sizes = d.opts().quick ? std::vector<std::int64_t>{1024, 8192}
                                      : std::vector<std::int64_t>{4096, 32768};
    auto op = a.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
