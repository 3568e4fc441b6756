// dump_gen: writes a synthetic seqpar-dump/1 directory (docs/dump_format.md) of any size,
// without torch, for bench/dump_scale.sh: a long-context SP job's attention call, healthy or with
// one bug (each document's last token attended as a document of its own).
//
// Exact values without an O(L²) attention: within each (document, KV head) the keys take one of
// C = 4 vectors (a random class per token), values and queries are random, and the output
// gradient of query head h is γ_i·a_h (γ_i = ±1 or ±½, a_h random): then every softmax sums over
// C classes with prefix counts and prefix sums of V, the query gradient over C classes, and the
// key and value gradients are suffix sums — O(S·H·C·D) in all, in float64, each tensor rounded
// once to its dtype. Inputs are drawn in bf16, so the rounded inputs are the exact ones. The
// files are created at their final size and written through mmap, token by token, rank by rank:
// memory is O(longest document · D), not O(S·H·D).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/cu_seqlens.hpp"
#include "core/rng.hpp"
#include "dump/geometry.hpp"
#include "io/safetensors.hpp"

namespace {

using namespace seqpar;
using verify::dump_detail::geometry;
namespace fs = std::filesystem;

constexpr int C = 4;

/// x rounded to bf16 (through float: see out_file::put), as a double.
double bf(double x) {
  std::uint32_t b;
  const float f = static_cast<float>(x);
  std::memcpy(&b, &f, 4);
  b = ((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) << 16;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}

/// One output file: its tensors laid out, created at full size and mapped for writing.
class out_file {
 public:
  struct tensor {
    std::string name;
    io::st_dtype type;
    std::vector<std::int64_t> shape;
    std::uint64_t offset = 0, bytes = 0;
  };
  void add(std::string name, io::st_dtype t, std::vector<std::int64_t> shape) {
    std::uint64_t n = io::st_dtype_size(t);
    for (auto d : shape) n *= static_cast<std::uint64_t>(d);
    tensors_.push_back({std::move(name), t, std::move(shape), data_, n});
    data_ += n;
  }
  void open(const std::string& path) {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    for (const auto& t : tensors_)
      h[t.name] = {{"dtype", io::st_dtype_name(t.type)},
                   {"shape", t.shape},
                   {"data_offsets", {t.offset, t.offset + t.bytes}}};
    std::string header = h.dump();
    header.append((8 - header.size() % 8) % 8, ' ');
    start_ = 8 + header.size();
    size_ = start_ + data_;
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size_)) != 0)
      throw std::runtime_error("cannot create " + path);
    base_ = static_cast<unsigned char*>(
        ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ::close(fd);
    if (base_ == MAP_FAILED) throw std::runtime_error("cannot map " + path);
    const std::uint64_t n = header.size();
    std::memcpy(base_, &n, 8);
    std::memcpy(base_ + 8, header.data(), header.size());
  }
  /// Hands the written pages to the page cache (they leave the resident set, nothing is lost).
  void release() {
    if (base_) ::madvise(base_, size_, MADV_DONTNEED);
  }
  void close() {
    if (base_) ::munmap(base_, size_);
    base_ = nullptr;
  }
  /// Writes n values at element `at` of tensor `name`.
  void put(std::size_t ti, std::int64_t at, const double* v, int n) {
    const auto& t = tensors_[ti];
    unsigned char* p =
        base_ + start_ + t.offset + static_cast<std::uint64_t>(at) * io::st_dtype_size(t.type);
    for (int i = 0; i < n; ++i) {
      if (t.type == io::st_dtype::bf16) {
        // Through float (round to nearest even twice: within one bf16 ulp of the direct rounding,
        // a storage rounding all the same).
        std::uint32_t b;
        const float f = static_cast<float>(v[i]);
        std::memcpy(&b, &f, 4);
        const auto x = static_cast<std::uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
        std::memcpy(p + 2 * i, &x, 2);
      } else {
        const float x = static_cast<float>(v[i]);
        std::memcpy(p + 4 * i, &x, 4);
      }
    }
  }
  std::size_t index(const std::string& name) const {
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].name == name) return i;
    return static_cast<std::size_t>(-1);
  }
  std::uint64_t size() const { return size_; }

 private:
  std::vector<tensor> tensors_;
  std::uint64_t data_ = 0, start_ = 0, size_ = 0;
  unsigned char* base_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dump_gen: a synthetic seqpar-dump/1 directory for bench/dump_scale.sh"};
  std::string out;
  std::int64_t tokens = 8192;
  int U = 8, R = 4, H = 32, Hkv = 8, D = 128;
  std::string bug = "none", stages = "all";
  std::uint64_t seed = 1;
  app.add_option("--out", out, "directory to write (created)")->required();
  app.add_option("--tokens", tokens, "packed row length S")->capture_default_str();
  app.add_option("--ulysses", U)->capture_default_str();
  app.add_option("--ring", R)->capture_default_str();
  app.add_option("--heads", H)->capture_default_str();
  app.add_option("--kv-heads", Hkv)->capture_default_str();
  app.add_option("--head-dim", D)->capture_default_str();
  app.add_option(
         "--bug", bug,
         "none | last-token (each document's last token its own document) | first-token (each "
         "document's first token its own document) | scale:F (the job's softmax scale F × "
         "the meta's) | "
         "edge:doc-first|doc-last|chunk-edge|piece-edge (the output of the rows of that "
         "boundary class alone, and of no other, off by 0.25)")
      ->capture_default_str();
  app.add_option("--stages", stages,
                 "all | local (only the local shards, the LSE and the local gradients: what "
                 "the smallest hook taps; a quarter of the disk)")
      ->capture_default_str();
  app.add_option("--seed", seed)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const int P = U * R;
  const std::int64_t unit = 2LL * R * U;
  if (tokens % unit != 0 || tokens < 16 * unit) {
    fmt::print(stderr, "dump_gen: --tokens must be a multiple of 2·R·U = {} and at least {}\n",
               unit, 16 * unit);
    return 2;
  }
  // Documents: S/4, S/8, … down to 16·unit, the rest in documents of 16·unit (multiples of 2RU).
  std::vector<std::int32_t> cu{0};
  std::int64_t left = tokens;
  for (std::int64_t len = tokens / 4; len >= 16 * unit && left > 0; len /= 2) {
    const std::int64_t l = std::min(left, len / unit * unit);
    cu.push_back(static_cast<std::int32_t>(cu.back() + l));
    left -= l;
  }
  while (left > 0) {
    const std::int64_t l = std::min(left, 16 * unit);
    cu.push_back(static_cast<std::int32_t>(cu.back() + l));
    left -= l;
  }
  // What the job computes with: the meta's documents, or each last token split off.
  std::vector<std::int32_t> compute_cu = cu;
  double scale_factor = 1;  // --bug scale:F: the job's softmax scale F × the meta's
  if (bug == "last-token") {
    for (std::size_t i = 1; i < cu.size(); ++i) compute_cu.push_back(cu[i] - 1);
    std::sort(compute_cu.begin(), compute_cu.end());
  } else if (bug == "first-token") {
    for (std::size_t i = 0; i + 1 < cu.size(); ++i) compute_cu.push_back(cu[i] + 1);
    std::sort(compute_cu.begin(), compute_cu.end());
  } else if (bug.starts_with("scale:")) {
    try {
      scale_factor = std::stod(bug.substr(6));
    } catch (const std::exception&) {
      scale_factor = 0;
    }
    if (!(scale_factor > 0)) {
      fmt::print(stderr, "dump_gen: --bug {} needs a positive factor (scale:2)\n", bug);
      return 2;
    }
  } else if (bug != "none" && bug != "edge:doc-first" && bug != "edge:doc-last" &&
             bug != "edge:chunk-edge" && bug != "edge:piece-edge") {
    fmt::print(stderr,
               "dump_gen: --bug {} is unknown (none | last-token | first-token | scale:F | "
               "edge:doc-first | edge:doc-last | edge:chunk-edge | edge:piece-edge)\n",
               bug);
    return 2;
  }
  verify::dump_meta m;
  m.ulysses = U;
  m.ring = R;
  m.heads = H;
  m.kv_heads = Hkv;
  m.head_dim = D;
  m.scale = 1 / std::sqrt(static_cast<double>(D));
  m.causal = true;
  m.cu_seqlens = cu;
  const geometry g(m);
  const bool all = stages == "all";
  const int Hr = g.Hkv * g.rep, hq = g.hq, hk = g.hk;
  fs::create_directories(out);
  // Files per rank.
  std::vector<out_file> fwd(static_cast<std::size_t>(P)), bwd(static_cast<std::size_t>(P));
  const auto bt = io::st_dtype::bf16;
  for (int k = 0; k < P; ++k) {
    auto& f = fwd[static_cast<std::size_t>(k)];
    auto& b = bwd[static_cast<std::size_t>(k)];
    f.add("q.local", bt, {g.s, H, D});
    f.add("k.local", bt, {g.s, Hkv, D});
    f.add("v.local", bt, {g.s, Hkv, D});
    if (all && U > 1) {
      f.add("q.gathered", bt, {g.Sg, hq, D});
      f.add("k.gathered", bt, {g.Sg, hk, D});
      f.add("v.gathered", bt, {g.Sg, hk, D});
      f.add("out.attn", bt, {g.Sg, hq, D});
    }
    f.add("lse", io::st_dtype::f32, {hq, g.Sg});
    f.add("out.local", bt, {g.s, H, D});
    b.add("grad.out.local", bt, {g.s, H, D});
    if (all && U > 1) {
      b.add("grad.out.attn", bt, {g.Sg, hq, D});
      b.add("grad.q.gathered", bt, {g.Sg, hq, D});
      b.add("grad.k.gathered", bt, {g.Sg, hk, D});
      b.add("grad.v.gathered", bt, {g.Sg, hk, D});
    }
    b.add("grad.q.local", bt, {g.s, H, D});
    b.add("grad.k.local", bt, {g.s, Hkv, D});
    b.add("grad.v.local", bt, {g.s, Hkv, D});
    fs::create_directories(fs::path(out) / fmt::format("rank{}", k));
    f.open((fs::path(out) / fmt::format("rank{}/call0000.fwd.safetensors", k)).string());
    b.open((fs::path(out) / fmt::format("rank{}/call0000.bwd.safetensors", k)).string());
  }
  std::vector<std::int64_t> where(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < g.perm.size(); ++i)
    where[static_cast<std::size_t>(g.perm[i])] = static_cast<std::int64_t>(i);
  // The boundary classes validate --dump's sample always holds, per token, as its ring rank's
  // gathered rows see them: a document's first or last token, a Ulysses piece's first or last
  // row, a zigzag chunk edge (the next or previous row is not the next or previous token).
  // --bug edge:CLASS perturbs the tokens of that class that are in no other.
  std::vector<unsigned char> edge_bug(static_cast<std::size_t>(tokens), 0);
  if (bug.starts_with("edge:")) {
    const std::string want = bug.substr(5);
    std::int64_t marked = 0;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const auto p = where[static_cast<std::size_t>(t)];
      const auto ti = p % g.Sg, base = p - ti;
      const auto at = [&](std::int64_t i) { return g.perm[static_cast<std::size_t>(base + i)]; };
      const bool first = g.pos[static_cast<std::size_t>(t)] == 0;
      const bool last = std::binary_search(cu.begin(), cu.end(), static_cast<std::int32_t>(t + 1));
      const bool piece = ti % g.s == 0 || ti % g.s == g.s - 1;
      const bool jump = (ti > 0 && at(ti - 1) + 1 != t) || (ti + 1 < g.Sg && at(ti + 1) != t + 1);
      const int classes = first + last + piece + jump;
      const bool mine = (want == "doc-first" && first) || (want == "doc-last" && last) ||
                        (want == "piece-edge" && piece) || (want == "chunk-edge" && jump);
      if (mine && classes == 1) {
        edge_bug[static_cast<std::size_t>(t)] = 1;
        ++marked;
      }
    }
    if (marked == 0) {
      fmt::print(stderr, "dump_gen: no token is a {} and nothing else in this layout\n", want);
      return 2;
    }
  }
  // Writes a global [S, X, D] row (token, head) to a local stage and, when dumped, a gathered one.
  const auto put_local = [&](bool backward, const char* st, int X, std::int64_t t, int h,
                             const double* v) {
    (void)X;
    const auto p = where[static_cast<std::size_t>(t)];
    auto& f = (backward ? bwd : fwd)[static_cast<std::size_t>(p / g.s)];
    f.put(f.index(st), ((p % g.s) * X + h) * D, v, D);
  };
  const auto put_gathered = [&](bool backward, const char* st, int hx, std::int64_t t, int h,
                                const double* v, int n = -1) {
    const auto p = where[static_cast<std::size_t>(t)];
    auto& f = (backward ? bwd : fwd)[static_cast<std::size_t>((p / g.Sg) * U + h / hx)];
    const auto ti = f.index(st);
    if (ti == static_cast<std::size_t>(-1)) return;
    if (n == 1)
      f.put(ti, (h % hx) * g.Sg + p % g.Sg, v, 1);
    else
      f.put(ti, ((p % g.Sg) * hx + h % hx) * D, v, D);
  };
  const double scale = m.scale * scale_factor;  // what the job computes with
  const auto docs = doc_ranges(compute_cu);
  const auto sz = [](auto x) { return static_cast<std::size_t>(x); };
  const int per_kv = H / Hkv, per_copy = H / Hr;
  // Written pages leave the resident set every so many tokens (the page cache writes them).
  std::int64_t since_release = 0;
  const auto maybe_release = [&](std::int64_t n) {
    if ((since_release += n) < 16384) return;
    since_release = 0;
    for (auto* side : {&fwd, &bwd})
      for (auto& f : *side) f.release();
  };
  // Inputs from (seed, stream, index), drawn in bf16.
  const auto q_of = [&](std::int64_t t, int h, double* q) {
    for (int e = 0; e < D; ++e) q[e] = bf(2 * uniform_pm1(seed, 1, sz((t * H + h) * D + e)));
  };
  const auto gamma_of = [&](std::int64_t t, int h) {
    const std::uint64_t r = mix64(seed ^ mix64(static_cast<std::uint64_t>(t * H + h)));
    return ((r & 1) ? -1.0 : 1.0) * ((r & 2) ? 0.5 : 1.0);
  };
  std::vector<double> ah(sz(H * D));
  for (int h = 0; h < H; ++h)
    for (int e = 0; e < D; ++e) ah[sz(h * D + e)] = bf(uniform_pm1(seed, 4, sz(h * D + e)));
  std::vector<double> q(sz(D)), o(sz(D)), dq(sz(D)), dO(sz(D)), vrow(sz(D)), dk(sz(D)), dv(sz(D)),
      dks(sz(D)), dvs(sz(D));
  for (std::size_t di = 0; di < docs.size(); ++di) {
    const auto [a, b] = docs[di];
    const std::int64_t L = b - a;
    if (L == 0) continue;
    // Per KV head: C class key vectors; every token's class.
    std::vector<double> kappa(sz(Hkv * C * D));
    for (int kv = 0; kv < Hkv; ++kv)
      for (int c = 0; c < C; ++c)
        for (int e = 0; e < D; ++e)
          kappa[sz((kv * C + c) * D + e)] =
              bf(2 * uniform_pm1(seed, 3, sz(((di * Hkv + kv) * C + c) * D + e)));
    const auto cls = [&](std::int64_t t) { return static_cast<int>(mix64(seed ^ t * 7919) % C); };
    const auto v_of = [&](std::int64_t t, int kv, double* v) {
      for (int e = 0; e < D; ++e) v[e] = bf(2 * uniform_pm1(seed, 2, sz((t * Hkv + kv) * D + e)));
    };
    // Forward, token by token (all heads of a token written together): prefix counts and sums
    // of V per class; per head the class weights Pc and D_i = dO_i·out_i for the backward.
    std::vector<double> cnt(sz(Hkv * C), 0.0), vsum(sz(Hkv * C * D), 0.0);
    std::vector<double> Pc(sz(L * H * C)), Dv(sz(L * H));
    for (std::int64_t i = 0; i < L; ++i) {
      const std::int64_t t = a + i;
      const int ci = cls(t);
      for (int kv = 0; kv < Hkv; ++kv) {
        v_of(t, kv, vrow.data());
        cnt[sz(kv * C + ci)] += 1;
        for (int e = 0; e < D; ++e) vsum[sz((kv * C + ci) * D + e)] += vrow[sz(e)];
        const double* kr = &kappa[sz((kv * C + ci) * D)];
        put_local(false, "k.local", Hkv, t, kv, kr);
        put_local(false, "v.local", Hkv, t, kv, vrow.data());
        for (int c = 0; c < g.rep; ++c) {
          put_gathered(false, "k.gathered", hk, t, kv * g.rep + c, kr);
          put_gathered(false, "v.gathered", hk, t, kv * g.rep + c, vrow.data());
        }
      }
      for (int h = 0; h < H; ++h) {
        const int kv = h / per_kv;
        q_of(t, h, q.data());
        const double gam = gamma_of(t, h);
        double sc[C], mx = -INFINITY;
        for (int c = 0; c < C; ++c) {
          double dot = 0;
          for (int e = 0; e < D; ++e) dot += q[sz(e)] * kappa[sz((kv * C + c) * D + e)];
          sc[c] = scale * dot;
          if (cnt[sz(kv * C + c)] > 0) mx = std::max(mx, sc[c]);
        }
        double l = 0;
        for (int c = 0; c < C; ++c) l += cnt[sz(kv * C + c)] * std::exp(sc[c] - mx);
        const double lse = mx + std::log(l);
        std::fill(o.begin(), o.end(), 0.0);
        for (int c = 0; c < C; ++c) {
          const double p = cnt[sz(kv * C + c)] > 0 ? std::exp(sc[c] - lse) : 0.0;
          Pc[sz((i * H + h) * C + c)] = p;
          for (int e = 0; e < D; ++e) o[sz(e)] += p * vsum[sz((kv * C + c) * D + e)];
        }
        double Di = 0;
        for (int e = 0; e < D; ++e) {
          dO[sz(e)] = gam * ah[sz(h * D + e)];
          Di += dO[sz(e)] * o[sz(e)];
        }
        Dv[sz(i * H + h)] = Di;
        // dQ_i = scale·Σ_c κ_c·P_ic·(γ_i·a_h·Vsum_c − D_i·n_c).
        std::fill(dq.begin(), dq.end(), 0.0);
        for (int c = 0; c < C; ++c) {
          double av = 0;
          for (int e = 0; e < D; ++e) av += ah[sz(h * D + e)] * vsum[sz((kv * C + c) * D + e)];
          const double coef = Pc[sz((i * H + h) * C + c)] * (gam * av - Di * cnt[sz(kv * C + c)]);
          for (int e = 0; e < D; ++e) dq[sz(e)] += scale * coef * kappa[sz((kv * C + c) * D + e)];
        }
        put_local(false, "q.local", H, t, h, q.data());
        put_gathered(false, "q.gathered", hq, t, h, q.data());
        if (edge_bug[static_cast<std::size_t>(t)])
          for (auto& x : o) x += 0.25;
        put_local(false, "out.local", H, t, h, o.data());
        put_gathered(false, "out.attn", hq, t, h, o.data());
        put_gathered(false, "lse", hq, t, h, &lse, 1);
        put_local(true, "grad.out.local", H, t, h, dO.data());
        put_gathered(true, "grad.out.attn", hq, t, h, dO.data());
        put_local(true, "grad.q.local", H, t, h, dq.data());
        put_gathered(true, "grad.q.gathered", hq, t, h, dq.data());
      }
      maybe_release(1);
    }
    // Backward, token by token from the end: per head the suffix sums G_c = Σ P_ic·γ_i,
    // A_c = Σ P_ic·γ_i·q_i, B_c = Σ P_ic·D_i·q_i (i ≥ j); dV_j = a_h·G_c(j),
    // dK_j = scale·((a_h·v_j)·A_c(j) − B_c(j)); summed per repeated copy and per KV head.
    std::vector<double> G(sz(H * C), 0.0), A(sz(H * C * D), 0.0), B(A.size(), 0.0);
    for (std::int64_t j = L - 1; j >= 0; --j) {
      const std::int64_t t = a + j;
      const int cj = cls(t);
      for (int h = 0; h < H; ++h) {
        q_of(t, h, q.data());
        const double gam = gamma_of(t, h);
        for (int c = 0; c < C; ++c) {
          const double p = Pc[sz((j * H + h) * C + c)];
          if (p == 0) continue;
          G[sz(h * C + c)] += p * gam;
          const double dd = p * Dv[sz(j * H + h)];
          for (int e = 0; e < D; ++e) {
            A[sz((h * C + c) * D + e)] += p * gam * q[sz(e)];
            B[sz((h * C + c) * D + e)] += dd * q[sz(e)];
          }
        }
      }
      for (int kv = 0; kv < Hkv; ++kv) {
        v_of(t, kv, vrow.data());
        std::fill(dks.begin(), dks.end(), 0.0);
        std::fill(dvs.begin(), dvs.end(), 0.0);
        for (int c = 0; c < g.rep; ++c) {
          std::fill(dk.begin(), dk.end(), 0.0);
          std::fill(dv.begin(), dv.end(), 0.0);
          for (int hh = 0; hh < per_copy; ++hh) {
            const int h = kv * per_kv + c * per_copy + hh;
            double av = 0;
            for (int e = 0; e < D; ++e) av += ah[sz(h * D + e)] * vrow[sz(e)];
            for (int e = 0; e < D; ++e) {
              dv[sz(e)] += ah[sz(h * D + e)] * G[sz(h * C + cj)];
              dk[sz(e)] += scale * (av * A[sz((h * C + cj) * D + e)] - B[sz((h * C + cj) * D + e)]);
            }
          }
          put_gathered(true, "grad.k.gathered", hk, t, kv * g.rep + c, dk.data());
          put_gathered(true, "grad.v.gathered", hk, t, kv * g.rep + c, dv.data());
          for (int e = 0; e < D; ++e) {
            dks[sz(e)] += dk[sz(e)];
            dvs[sz(e)] += dv[sz(e)];
          }
        }
        put_local(true, "grad.k.local", Hkv, t, kv, dks.data());
        put_local(true, "grad.v.local", Hkv, t, kv, dvs.data());
      }
      maybe_release(1);
    }
  }
  std::uint64_t bytes = 0;
  for (int k = 0; k < P; ++k) {
    bytes += fwd[static_cast<std::size_t>(k)].size() + bwd[static_cast<std::size_t>(k)].size();
    fwd[static_cast<std::size_t>(k)].close();
    bwd[static_cast<std::size_t>(k)].close();
    nlohmann::ordered_json j;
    j["schema"] = "seqpar-dump/1";
    j["rank"] = k;
    j["world_size"] = P;
    j["ulysses"] = U;
    j["ring"] = R;
    j["ulysses_rank"] = k % U;
    j["ring_rank"] = k / U;
    j["ring_layout"] = "zigzag";
    j["heads"] = H;
    j["kv_heads"] = Hkv;
    j["head_dim"] = D;
    j["scale"] = m.scale;  // what the meta says (the job's own may differ: --bug scale:F)
    j["causal"] = true;
    j["cu_seqlens"] = cu;
    std::vector<std::int64_t> pos;
    for (auto t : g.tokens(k)) pos.push_back(g.pos[static_cast<std::size_t>(t)]);
    j["position_ids"] = pos;
    j["dtype"] = "bfloat16";
    j["job"] = fmt::format("bench/dump_gen --tokens {} --ulysses {} --ring {} --bug {}", tokens, U,
                           R, bug);
    j["calls"] = {{{"index", 0},
                   {"name", "L0.attn"},
                   {"forward", fmt::format("rank{}/call0000.fwd.safetensors", k)},
                   {"backward", fmt::format("rank{}/call0000.bwd.safetensors", k)}}};
    std::ofstream(fs::path(out) / fmt::format("rank{}.json", k)) << j.dump(1) << "\n";
  }
  fmt::print("{}: {} tokens, {} documents, U {} × R {}, {} bytes\n", out, tokens, cu.size() - 1, U,
             R, bytes);
  return 0;
}
