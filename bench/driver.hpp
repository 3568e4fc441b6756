#pragma once
// The shared benchmark driver (nccl-tests' common.cu): every binary under bench/ fills one
// `operation` (what to allocate, how to fill it, one iteration, how to verify it, how to turn a
// time into a rate) and the driver does the rest: the same flags, the size sweep, warm-up and
// timing, reduction over ranks, the baseline of the same run, one fixed table, JSON, progress.
//
// Flags (every binary): -b/--minbytes -e/--maxbytes -f/--stepfactor -n/--iters
// -w/--warmup_iters -c/--check 0|1 -J/--json FILE --quick, and -t/--nthreads where the binary
// runs ranks on threads. Sizes accept K/M/G suffixes (powers of 1024).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;  // CLI11's: the binaries that add flags of their own include it
}

namespace seqpar::bench {

/// The shared flags. A binary gives its own defaults (normal and --quick); explicit flags win.
struct options {
  std::int64_t min_bytes = 32 << 20;
  std::int64_t max_bytes = 32 << 20;
  std::int64_t step_factor = 2;
  int iters = 20;
  int warmup = 5;
  bool check = true;
  std::string json_path;  ///< -J: write the JSON report there ("-": stdout instead of the table)
  bool quick = false;
  int threads = 1;  ///< -t: ranks on threads (binaries that register it)
};

/// Host-side coordination of the ranks of one run: a barrier around the timed loop and the
/// reductions of times and #wrong. Not part of what is measured.
class rank_group {
 public:
  virtual ~rank_group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  virtual double max(double v) = 0;
  virtual std::int64_t sum(std::int64_t v) = 0;
};

/// One process, one rank.
std::unique_ptr<rank_group> single_rank();
/// P ranks on threads of this process: member(r) is rank r's view (the team outlives them).
class thread_team {
 public:
  explicit thread_team(int ranks);
  ~thread_team();
  rank_group& member(int rank);

  struct state;

 private:
  std::unique_ptr<state> s_;
  std::vector<std::unique_ptr<rank_group>> members_;
};
#ifdef SEQPAR_HAVE_MPI
/// MPI_COMM_WORLD (MPI initialised by the caller).
std::unique_ptr<rank_group> mpi_world();
#endif
/// True when launched by mpiexec (PMI/PMIx/Open MPI environment).
bool under_mpiexec();

// ---- index-derived data (nccl-tests): every value is a function of (seed, rank, index) ----

/// A 64-bit hash of (seed, rank, global index).
std::uint64_t mix(std::uint64_t seed, int rank, std::int64_t index);
/// k/128 for k in [−128, 128): exact in bfloat16, float and double, so a receiver or a host
/// reference recomputes the very value that was sent or read.
double exact_value(std::uint64_t seed, int rank, std::int64_t index);

// ---- the operation a binary measures ----

enum class table_kind {
  transport,  ///< size count type time algbw busbw #wrong busbw/baseline
  compute,    ///< size count type case time rate ratio #wrong
};

/// One variant swept over every size: a data type (nccl-tests' names: float, double, bfloat16)
/// and an op-specific case label ("d=64", "R=4 U=2"; empty for transports).
struct variant {
  std::string type;
  std::string label;
};

/// One point of the sweep: a variant at a size.
struct point {
  std::size_t variant = 0;
  std::int64_t bytes = 0;  ///< the size column: bytes per rank the operation sends or reads
  std::int64_t count = 0;  ///< elements per rank (transport) or tokens (compute)
  int ranks = 1;
};

/// A baseline measured in the same run, e.g. {"Eigen GEMM 1024^3 float, 1 thread", 42, "GFLOP/s"}.
struct baseline {
  std::string what;
  double value = 0;
  std::string unit;
};

/// A table measured besides the sweep (e.g. peak memory per token), printed after it as
/// '#'-comment lines and stored under "side" in the JSON.
struct side_table {
  std::string title;
  std::vector<std::string> columns;
  std::vector<std::vector<double>> rows;
};

/// One printed row.
struct row {
  std::int64_t size = 0, count = 0;
  std::string type, label;
  double time_us = 0;
  double algbw = 0, busbw = 0;        ///< transport (GB/s)
  double rate = 0;                    ///< compute (rate_unit)
  double ratio = 0;                   ///< busbw or rate over the baseline of this type
  std::optional<std::int64_t> wrong;  ///< empty with -c 0
  std::vector<double> extra;          ///< operation::extra_columns
};

/// What a binary supplies (nccl-tests' testColl). Every function runs on every rank (SPMD);
/// the driver calls init → warmup × run → sync → barrier → iters × run → sync → max time over
/// ranks → check → sum of #wrong, for every variant and size.
struct operation {
  std::string name;     ///< "alltoall", "attention fwd+bwd"
  std::string backend;  ///< "in-process", "mpi", "nccl", "eigen", "cuda"
  table_kind kind = table_kind::transport;
  std::vector<variant> variants;
  /// bytes → {count, actual bytes} for a variant; count 0 skips the size.
  std::function<std::pair<std::int64_t, std::int64_t>(std::int64_t bytes, std::size_t variant,
                                                      int ranks)>
      size;
  /// Allocates the buffers of `p` and fills the inputs from (seed, rank, global index).
  std::function<void(const point& p, std::uint64_t seed)> init;
  /// One iteration (may only enqueue: see sync).
  std::function<void()> run;
  /// Waits for the work run() issued (GPU streams). Optional.
  std::function<void()> sync;
  /// This rank's output elements that differ from what (seed, rank, index) predicts.
  std::function<std::int64_t(const point& p, std::uint64_t seed)> check;
  /// transport: busbw = algbw · bus_factor(ranks) (nccl-tests; alltoall: (n−1)/n).
  std::function<double(int ranks)> bus_factor;
  /// compute: the work of one iteration in rate_unit·seconds (e.g. GFLOP); rate = work / time.
  std::function<double(const point& p)> work;
  std::string rate_unit = "GFLOP/s";
  /// The baseline of a type, measured once per distinct type on rank 0 before the sweep.
  std::function<baseline(const std::string& type)> measure_baseline;
  /// Optional: adjust a finished row on rank 0 (own timing, ratio, extra columns).
  std::function<void(const point& p, row& r)> finish;
  std::vector<std::string> extra_columns;
  /// What ratio means, for the header ("rate / GEMM of the same type").
  std::string ratio_meaning;
  /// Header lines: conventions (FLOP counting), problem shape, what #wrong compares.
  std::vector<std::string> notes;
  /// Optional: measured on rank 0 before the sweep, printed after it.
  std::function<side_table()> side;
  /// Optional: derived on rank 0 from the finished rows (e.g. a fit over the variants), printed
  /// after the side table and stored under "summary" in the JSON.
  std::function<side_table(const std::vector<row>& rows)> summary;
};

/// Flag parsing and reporting around one operation.
class driver {
 public:
  /// `defaults` / `quick` are this binary's flag defaults without and with --quick.
  driver(std::string program, std::string description, options defaults, options quick);
  ~driver();
  /// Registers -t/--nthreads (binaries that run ranks on threads).
  void add_threads_flag(const std::string& what);
  /// For binary-specific flags (e.g. attention tile sizes).
  CLI::App& app() { return *app_; }
  /// Parses argv; returns an exit code when the program should stop (help: 0, bad flags: 2).
  std::optional<int> parse(int argc, char** argv);
  const options& opts() const { return opts_; }
  const std::string& program() const { return program_; }

  /// Runs the sweep on this rank of `g` (call it on every rank); returns the rows on rank 0.
  std::vector<row> run(rank_group& g, operation& op);
  /// Rank 0: prints the table (stdout) and writes the JSON (-J); returns the exit code:
  /// 0, or 1 when any #wrong is nonzero.
  int report(const operation& op, int ranks, const std::vector<row>& rows);

  /// Runs body, turning exceptions into `program: error: …` and exit code 2.
  int guarded(const std::function<int()>& body) const;

 private:
  std::string program_;
  std::unique_ptr<CLI::App> app_;  // CLI11 compiled in driver.cpp (and where app() is used) only
  options defaults_, quick_, opts_;
  std::string min_s_, max_s_;
  int check_ = 1;
  std::map<std::string, baseline> baselines_;  ///< per type of the operation's variants
  std::optional<side_table> side_;
  double seconds_ = 0;
};

// ---- baselines ----

/// Single-threaded Eigen GEMM GFLOP/s (2n³ per product, best of runs within ~0.3 s) for
/// type "float" or "double".
double eigen_gemm_gflops(const std::string& type, int n = 1024);
/// The compute benches' baseline: eigen_gemm_gflops(type, 1024) as "Eigen GEMM 1024^3 TYPE,
/// 1 thread" in GFLOP/s (operation::measure_baseline).
baseline gemm_baseline(const std::string& type);
/// Single-threaded memcpy GB/s (bytes copied per second) over `bytes`, within ~0.3 s.
double memcpy_gbps(std::int64_t bytes);
/// GB/s of each of `threads` threads copying `bytes` with memcpy at the same time (the slowest
/// thread's rate): what a copy gets while others copy too (they share caches and memory).
double concurrent_memcpy_gbps(int threads, std::int64_t bytes);
/// "1K", "64M", "3G" or a plain number of bytes.
std::int64_t parse_size(const std::string& s);

/// Runs f(out) in a forked child process — a fresh copy of this one: only the calling thread,
/// the allocator as it stood, its own peak RSS — and copies the `size` bytes f left at `out`
/// (a trivially copyable result) back into `out`. False when the child failed (f threw: the
/// message goes to stderr) or died. Fork before the process starts threads of its own.
bool run_in_child(const std::function<void(void* out)>& f, void* out, std::size_t size);

}  // namespace seqpar::bench
