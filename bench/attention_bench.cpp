// attention_bench: GFLOP/s of the tiled CPU attention (sim/attention.hpp; forward + backward,
// one causal document, H = 1, and GQA with 4 q heads sharing 1 KV head) next to Eigen's square
// GEMM measured in the same run on the same core, and the peak memory per token at two sizes 8×
// apart to show O(S) memory.
//
//   attention_bench [common flags] [--tile-q N] [--tile-k N] [--no-memory]
//
// size = bytes of K (S·Hkv·d·sizeof(type); the bytes of Q when H = 1), so a GQA row has the S of
// the H = 1 row of the same size; count = S tokens. FLOP convention (FlashAttention's): forward =
// 4·S²·Hq·d (two GEMMs), backward = 2.5 × forward, causal halves both; so fwd+bwd causal =
// 3.5·4·S²·Hq·d/2 = 7·S²·Hq·d. Masked/skipped work and the exp/rowsum passes are not
// counted. GEMM: 2·n³ for an n×n by n×n product. #wrong: sampled forward rows against a direct
// double-precision softmax (bench/attention_oracle.hpp).
#include <fmt/format.h>
#include <CLI/CLI.hpp>

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

/// One causal single-document problem of s tokens, hq q heads sharing hkv KV heads,
/// index-derived inputs.
template <class T>
struct problem {
  std::int64_t s = 0;
  int hq = 1, hkv = 1, d = 64;
  std::vector<T> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<std::int32_t> cu;

  problem(std::int64_t s_, int hq_, int hkv_, int d_, std::uint64_t seed)
      : s(s_), hq(hq_), hkv(hkv_), d(d_) {
    const auto nq = static_cast<std::size_t>(s * hq * d),
               nkv = static_cast<std::size_t>(s * hkv * d);
    auto fill = [&](std::vector<T>& x, std::size_t n, int tensor) {
      x.resize(n);
      for (std::size_t i = 0; i < n; ++i)
        x[i] = static_cast<T>(bench::exact_value(seed + static_cast<std::uint64_t>(tensor), 0,
                                                 static_cast<std::int64_t>(i)));
    };
    fill(q, nq, 1);
    fill(k, nkv, 2);
    fill(v, nkv, 3);
    fill(dout, nq, 4);
    out.assign(nq, T(0));
    dq.assign(nq, T(0));
    dk.assign(nkv, T(0));
    dv.assign(nkv, T(0));
    lse.assign(static_cast<std::size_t>(s * hq), T(0));
    cu = {0, static_cast<std::int32_t>(s)};
  }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(d)); }
  sim::attention_args<T> args() const {
    return {q.data(), k.data(), v.data(), s, s, hq, hkv, d, cu.data(), cu.data(), 1, scale(), true};
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
    return bench::attention_forward_wrong(s, hq, hkv, d, scale(), at(q), at(k), at(v), at(out), u,
                                          u);
  }
};

/// A family of table rows: element type, head dim, q heads on the one KV head (1: H = 1; 4: GQA).
struct shape {
  bool is_float;
  int d, hq;
};
constexpr shape shapes[] = {{true, 64, 1}, {true, 128, 1}, {false, 64, 1}, {false, 128, 1},
                            {true, 64, 4}, {true, 128, 4}, {false, 64, 4}, {false, 128, 4}};

struct attention {
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
    for (const shape& sh : shapes) {
      o.variants.push_back({sh.is_float ? "float" : "double",
                            fmt::format("d={}{}", sh.d, sh.hq > 1 ? " GQA4" : "")});
    }
    o.size = [](std::int64_t bytes, std::size_t v, int) {
      const shape& sh = shapes[v];
      const std::int64_t per_token = std::int64_t{sh.d} * (sh.is_float ? 4 : 8);  // one KV head
      const std::int64_t s = bytes / per_token;
      return std::pair{s, s * per_token};
    };
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      pf.reset();
      pd.reset();
      const shape& sh = shapes[p.variant];
      if (sh.is_float)
        pf = std::make_unique<problem<float>>(p.count, sh.hq, 1, sh.d, seed);
      else
        pd = std::make_unique<problem<double>>(p.count, sh.hq, 1, sh.d, seed);
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
    o.work = [](const bench::point& p) {
      const shape& sh = shapes[p.variant];
      const double fwd =
          4.0 * static_cast<double>(p.count) * static_cast<double>(p.count) * sh.hq * sh.d / 2;
      return 3.5 * fwd * 1e-9;
    };
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning = "GFLOP/s / Eigen GEMM GFLOP/s of the same type";
    o.notes = {
        fmt::format("one causal document, H=1 (GQA4: Hq=4 sharing Hkv=1), tiles {}x{}; size = "
                    "bytes of K, count = tokens S",
                    tiles.q, tiles.k),
        "FLOPs: causal fwd = 4*S^2*Hq*d/2, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd; gemm = 2*n^3; one "
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
            problem<float> p(s, 1, 1, 64, 1);
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
  d.app()
      .add_option("--tile-q", a.tiles.q, "q rows per tile (a GQA group's heads together)")
      ->check(CLI::PositiveNumber);
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
