// All-to-all bandwidth of seqpar's communicators, in nccl-tests' format (alltoall_perf):
// size per rank, count, type, time, algbw = size/time, busbw = algbw·(n−1)/n, #wrong from
// index-derived verification, next to a memcpy GB/s baseline measured in the same run.
//
//   a2a_bench [-b 1K] [-e 64M] [-f 2] [-t 4] [-n 20] [-w 5] [-c 1] [-J]
//   mpiexec -n 4 a2a_bench …      (a build with MPI: the MPI communicator, one rank per process)
//
// Without mpiexec the in-process communicator runs with -t P threads as ranks.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "core/error.hpp"
#include "sim/inproc_comm.hpp"
#ifdef SEQPAR_HAVE_MPI
#include "mpi/mpi_comm.hpp"
#endif

namespace {

using namespace seqpar;
using clock_type = std::chrono::steady_clock;

struct config {
  std::int64_t min_bytes = 1 << 10, max_bytes = 64 << 20, factor = 2;
  int threads = 4, iters = 20, warmup = 5;
  bool check = true, json = false;
};

struct row {
  std::int64_t size = 0, count = 0;
  double time_us = 0, algbw = 0, busbw = 0;
  std::int64_t wrong = 0;
};

std::int64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  std::int64_t mult = 1;
  if (end && *end) {
    switch (*end) {
      case 'K': case 'k': mult = 1 << 10; break;
      case 'M': case 'm': mult = 1 << 20; break;
      case 'G': case 'g': mult = std::int64_t{1} << 30; break;
      default: fail<config_error>("size '{}' is not a number with an optional K/M/G suffix", s);
    }
  }
  if (!(v > 0)) fail<config_error>("size '{}' must be positive", s);
  return static_cast<std::int64_t>(v * static_cast<double>(mult));
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail<config_error>("{} needs a value", a);
      return argv[++i];
    };
    if (a == "-b" || a == "--minbytes") c.min_bytes = parse_size(next());
    else if (a == "-e" || a == "--maxbytes") c.max_bytes = parse_size(next());
    else if (a == "-f" || a == "--stepfactor") c.factor = std::atoll(next().c_str());
    else if (a == "-t" || a == "--nthreads") c.threads = std::atoi(next().c_str());
    else if (a == "-n" || a == "--iters") c.iters = std::atoi(next().c_str());
    else if (a == "-w" || a == "--warmup_iters") c.warmup = std::atoi(next().c_str());
    else if (a == "-c" || a == "--check") c.check = std::atoi(next().c_str()) != 0;
    else if (a == "-J" || a == "--json") c.json = true;
    else if (a == "-h" || a == "--help") {
      fmt::print(
          "a2a_bench [-b minbytes] [-e maxbytes] [-f stepfactor] [-t ranks (in-process)] "
          "[-n iters] [-w warmup] [-c 0|1] [-J]\n"
          "Under mpiexec (MPI builds) the MPI communicator runs, one rank per process.\n");
      std::exit(0);
    } else {
      fail<config_error>("unknown flag '{}'; see -h", a);
    }
  }
  if (c.factor < 2) fail<config_error>("-f {} must be at least 2", c.factor);
  if (c.threads < 1) fail<config_error>("-t {} must be at least 1", c.threads);
  if (c.iters < 1 || c.warmup < 0) fail<config_error>("-n must be ≥ 1 and -w ≥ 0");
  if (c.min_bytes > c.max_bytes) fail<config_error>("-b {} exceeds -e {}", c.min_bytes, c.max_bytes);
  return c;
}

/// Element `index` of the block rank `src` sends to rank `dst`: exact in float (< 2^24).
float value(int src, int dst, std::int64_t index) {
  return static_cast<float>((static_cast<std::int64_t>(src) * 7919 + dst * 104729 + index) %
                            16777213);
}

/// The benchmark body, run by every rank (threads or processes). Results land in `rows` on
/// rank 0.
void run(communicator& comm, const config& cfg, std::vector<row>& rows) {
  const int n = comm.world_size(), me = comm.rank();
  comm_group world{"bench.world", {}};
  for (int r = 0; r < n; ++r) world.ranks.push_back(r);
  const auto esz = static_cast<std::int64_t>(sizeof(float));
  for (std::int64_t size = cfg.min_bytes; size <= cfg.max_bytes; size *= cfg.factor) {
    // nccl-tests: size = bytes each rank sends in total, count = its elements; each peer gets
    // count/n of them.
    const std::int64_t per_peer = std::max<std::int64_t>(size / esz / n, 1);
    const std::int64_t count = per_peer * n;
    std::vector<float> send(static_cast<std::size_t>(count)), recv(send.size(), -1.0f);
    for (int j = 0; j < n; ++j)
      for (std::int64_t e = 0; e < per_peer; ++e) send[j * per_peer + e] = value(me, j, e);
    const std::vector<std::int64_t> counts(static_cast<std::size_t>(n), per_peer);
    for (int w = 0; w < cfg.warmup; ++w)
      comm.all_to_all(world, send.data(), counts, recv.data(), counts, dtype::f32);
    comm.barrier(world);
    const auto t0 = clock_type::now();
    for (int it = 0; it < cfg.iters; ++it)
      comm.all_to_all(world, send.data(), counts, recv.data(), counts, dtype::f32);
    comm.barrier(world);
    const double secs = std::chrono::duration<double>(clock_type::now() - t0).count() / cfg.iters;
    std::int64_t wrong = 0;
    if (cfg.check)
      for (int j = 0; j < n; ++j)
        for (std::int64_t e = 0; e < per_peer; ++e) wrong += recv[j * per_peer + e] != value(j, me, e);
    comm.all_reduce(world, &wrong, 1, dtype::i64);
    if (me == 0) {
      row r;
      r.size = count * esz;
      r.count = count;
      r.time_us = secs * 1e6;
      r.algbw = static_cast<double>(r.size) / secs / 1e9;
      r.busbw = r.algbw * (n - 1) / n;
      r.wrong = wrong;
      rows.push_back(r);
    }
  }
}

/// memcpy GB/s (bytes copied per second) over the largest size, capped at 64 MiB.
double memcpy_gbps(std::int64_t bytes) {
  bytes = std::min<std::int64_t>(std::max<std::int64_t>(bytes, 1 << 20), 64 << 20);
  std::vector<char> a(static_cast<std::size_t>(bytes), 1), b(static_cast<std::size_t>(bytes), 0);
  std::memcpy(b.data(), a.data(), a.size());  // touch
  int reps = 0;
  const auto t0 = clock_type::now();
  double secs = 0;
  do {
    std::memcpy(b.data(), a.data(), a.size());
    a[static_cast<std::size_t>(reps) % a.size()] = b[0];  // keep the copies observable
    ++reps;
    secs = std::chrono::duration<double>(clock_type::now() - t0).count();
  } while (secs < 0.3 || reps < 3);
  return static_cast<double>(bytes) * reps / secs / 1e9;
}

void print(const config& cfg, const std::string& backend, int n, double memcpy_bw,
           const std::vector<row>& rows) {
  if (cfg.json) {
    std::string o = fmt::format(
        "{{\"op\":\"alltoall\",\"backend\":\"{}\",\"ranks\":{},\"type\":\"float\","
        "\"memcpy_gbps\":{:.3f},\"rows\":[",
        backend, n, memcpy_bw);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      o += fmt::format(
          "{}{{\"size\":{},\"count\":{},\"type\":\"float\",\"time_us\":{:.2f},\"algbw\":{:.3f},"
          "\"busbw\":{:.3f},\"busbw_over_memcpy\":{:.3f},\"wrong\":{}}}",
          i ? "," : "", r.size, r.count, r.time_us, r.algbw, r.busbw, r.busbw / memcpy_bw, r.wrong);
    }
    fmt::print("{}]}}\n", o);
    return;
  }
  fmt::print("# seqpar a2a_bench: alltoall, {} communicator, {} ranks\n", backend, n);
  fmt::print("# iters {}  warmup {}  check {}\n", cfg.iters, cfg.warmup, cfg.check ? 1 : 0);
  fmt::print("# memcpy baseline: {:.2f} GB/s (single thread, same run)\n#\n", memcpy_bw);
  fmt::print("# {:>10} {:>12} {:>6} {:>10} {:>8} {:>8} {:>7} {:>8}\n", "size", "count", "type",
             "time", "algbw", "busbw", "#wrong", "busbw/");
  fmt::print("# {:>10} {:>12} {:>6} {:>10} {:>8} {:>8} {:>7} {:>8}\n", "(B)", "(elements)", "",
             "(us)", "(GB/s)", "(GB/s)", "", "memcpy");
  std::int64_t wrong = 0;
  double sum_bw = 0;
  for (const auto& r : rows) {
    fmt::print("  {:>10} {:>12} {:>6} {:>10.1f} {:>8.2f} {:>8.2f} {:>7} {:>8.3f}\n", r.size,
               r.count, "float", r.time_us, r.algbw, r.busbw, r.wrong, r.busbw / memcpy_bw);
    wrong += r.wrong;
    sum_bw += r.busbw;
  }
  fmt::print("# Out of bounds values : {} {}\n", wrong, wrong ? "FAILED" : "OK");
  fmt::print("# Avg bus bandwidth    : {:.3f}\n#\n", rows.empty() ? 0.0 : sum_bw / rows.size());
}

bool under_mpiexec() {
  for (const char* v : {"PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const config cfg = parse(argc, argv);
    std::vector<row> rows;
    if (under_mpiexec()) {
#ifdef SEQPAR_HAVE_MPI
      mpi::mpi_session session(&argc, &argv);
      mpi::mpi_options o;
      o.verify_calls = false;  // the raw transport
      mpi::mpi_communicator comm(o);
      const double bw = session.rank() == 0 ? memcpy_gbps(cfg.max_bytes) : 0.0;
      run(comm, cfg, rows);
      if (session.rank() == 0) print(cfg, "mpi", session.size(), bw, rows);
      const bool bad = std::any_of(rows.begin(), rows.end(), [](const row& r) { return r.wrong; });
      return bad ? 1 : 0;
#else
      fail<config_error>("a2a_bench was built without MPI; rebuild with -Dmpi=enabled");
#endif
    }
    const double bw = memcpy_gbps(cfg.max_bytes);
    run_ranks(cfg.threads, [&](communicator& c) { run(c, cfg, rows); });
    print(cfg, "in-process", cfg.threads, bw, rows);
    const bool bad = std::any_of(rows.begin(), rows.end(), [](const row& r) { return r.wrong; });
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "a2a_bench: error: {}\n", e.what());
    return 2;
  }
}
