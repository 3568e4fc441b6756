#include "driver.hpp"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <Eigen/Core>
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "sim/isa.hpp"
#ifdef SEQPAR_HAVE_MPI
#include <mpi.h>
#endif

namespace seqpar::bench {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

class single final : public rank_group {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void barrier() override {}
  double max(double v) override { return v; }
  std::int64_t sum(std::int64_t v) override { return v; }
};

}  // namespace

std::unique_ptr<rank_group> single_rank() { return std::make_unique<single>(); }

// Reductions on threads: every member writes its slot, meets the others at the barrier, reads
// all slots, and meets them again before a slot may be overwritten.
struct thread_team::state {
  explicit state(int n) : size(n), sync(n), slots(static_cast<std::size_t>(n)) {}
  int size;
  std::barrier<> sync;
  std::vector<double> slots;
};

namespace {

class team_member final : public rank_group {
 public:
  team_member(thread_team::state& s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_.size; }
  void barrier() override { s_.sync.arrive_and_wait(); }
  double max(double v) override {
    return reduce(v, [](double a, double b) { return std::max(a, b); });
  }
  std::int64_t sum(std::int64_t v) override {
    // Exact for the counts this carries (#wrong ≤ 2^53).
    return static_cast<std::int64_t>(
        reduce(static_cast<double>(v), [](double a, double b) { return a + b; }));
  }

 private:
  template <class F>
  double reduce(double v, F f) {
    s_.slots[static_cast<std::size_t>(rank_)] = v;
    s_.sync.arrive_and_wait();
    double acc = s_.slots[0];
    for (int r = 1; r < s_.size; ++r) acc = f(acc, s_.slots[static_cast<std::size_t>(r)]);
    s_.sync.arrive_and_wait();
    return acc;
  }
  thread_team::state& s_;
  int rank_;
};

}  // namespace

thread_team::thread_team(int ranks) : s_(std::make_unique<state>(ranks)) {
  for (int r = 0; r < ranks; ++r) members_.push_back(std::make_unique<team_member>(*s_, r));
}
thread_team::~thread_team() = default;
rank_group& thread_team::member(int rank) { return *members_.at(static_cast<std::size_t>(rank)); }

#ifdef SEQPAR_HAVE_MPI
namespace {
class mpi_group final : public rank_group {
 public:
  mpi_group() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { MPI_Barrier(MPI_COMM_WORLD); }
  double max(double v) override {
    double out = 0;
    MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return out;
  }
  std::int64_t sum(std::int64_t v) override {
    std::int64_t out = 0;
    MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    return out;
  }

 private:
  int rank_ = 0, size_ = 1;
};
}  // namespace
std::unique_ptr<rank_group> mpi_world() { return std::make_unique<mpi_group>(); }
#endif

bool under_mpiexec() {
  for (const char* v : {"PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

std::uint64_t mix(std::uint64_t seed, int rank, std::int64_t index) {
  // splitmix64 of a combination that differs for every (rank, index) of a run.
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ull +
                    static_cast<std::uint64_t>(rank) * 0xD1B54A32D192ED03ull +
                    static_cast<std::uint64_t>(index);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double exact_value(std::uint64_t seed, int rank, std::int64_t index) {
  return static_cast<double>(static_cast<int>(mix(seed, rank, index) >> 56) - 128) / 128.0;
}

std::int64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  std::int64_t mult = 1;
  if (end == s.c_str())
    fail<config_error>("size '{}' is not a number with an optional K/M/G suffix", s);
  if (*end) {
    switch (*end) {
      case 'K':
      case 'k':
        mult = std::int64_t{1} << 10;
        break;
      case 'M':
      case 'm':
        mult = std::int64_t{1} << 20;
        break;
      case 'G':
      case 'g':
        mult = std::int64_t{1} << 30;
        break;
      default:
        fail<config_error>("size '{}' is not a number with an optional K/M/G suffix", s);
    }
    if (end[1]) fail<config_error>("size '{}' has trailing characters after '{}'", s, *end);
  }
  if (!(v > 0)) fail<config_error>("size '{}' must be positive", s);
  return static_cast<std::int64_t>(v * static_cast<double>(mult));
}

driver::driver(std::string program, std::string description, options defaults, options quick)
    : program_(std::move(program)),
      app_(std::make_unique<CLI::App>(std::move(description), program_)),
      defaults_(std::move(defaults)),
      quick_(std::move(quick)),
      opts_(defaults_) {
  app_->add_option("-b,--minbytes", min_s_, "smallest size (bytes, K/M/G suffix)")
      ->type_name("SIZE");
  app_->add_option("-e,--maxbytes", max_s_, "largest size (bytes, K/M/G suffix)")
      ->type_name("SIZE");
  app_->add_option("-f,--stepfactor", opts_.step_factor, "size multiplier between rows")
      ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 20));
  app_->add_option("-n,--iters", opts_.iters, "timed iterations per row")
      ->check(CLI::Range(1, 1 << 30));
  app_->add_option("-w,--warmup_iters", opts_.warmup, "untimed iterations before each row")
      ->check(CLI::Range(0, 1 << 30));
  app_->add_option("-c,--check", check_, "verify results from index-derived data (#wrong)")
      ->check(CLI::Range(0, 1));
  app_->add_option("-J,--json", opts_.json_path, "write the JSON report to FILE ('-': stdout)")
      ->type_name("FILE");
  app_->add_flag("--quick", opts_.quick, "small sizes and few iterations (smoke run)");
}

driver::~driver() = default;

void driver::add_threads_flag(const std::string& what) {
  app_->add_option("-t,--nthreads", opts_.threads, what)->check(CLI::Range(1, 1024));
}

std::optional<int> driver::parse(int argc, char** argv) {
  try {
    app_->parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app_->exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    // --quick replaces the defaults; flags given explicitly keep their values.
    const options& base = opts_.quick ? quick_ : defaults_;
    opts_.check = check_ != 0;
    if (!app_->count("-n")) opts_.iters = base.iters;
    if (!app_->count("-w")) opts_.warmup = base.warmup;
    if (!app_->count("-f")) opts_.step_factor = base.step_factor;
    if (app_->get_option_no_throw("-t") && !app_->count("-t")) opts_.threads = base.threads;
    opts_.min_bytes = min_s_.empty() ? base.min_bytes : parse_size(min_s_);
    opts_.max_bytes = max_s_.empty() ? base.max_bytes : parse_size(max_s_);
    if (!min_s_.empty() && max_s_.empty())
      opts_.max_bytes = std::max(opts_.max_bytes, opts_.min_bytes);
    if (opts_.min_bytes > opts_.max_bytes)
      fail<config_error>("-b {} exceeds -e {}; give -b ≤ -e", opts_.min_bytes, opts_.max_bytes);
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", program_, e.what());
    return 2;
  }
  return std::nullopt;
}

std::vector<row> driver::run(rank_group& g, operation& op) {
  const std::uint64_t seed = 1;
  const int ranks = g.size();
  const bool root = g.rank() == 0;
  const auto start = clock_type::now();
  if (root) {
    // The side table first: it may measure peak memory, which the baselines would raise.
    if (op.side) side_ = op.side();
    baselines_.clear();
    for (const auto& v : op.variants)
      if (op.measure_baseline && !baselines_.count(v.type))
        baselines_.emplace(v.type, op.measure_baseline(v.type));
  }
  g.barrier();
  auto baseline_of = [&](const std::string& type) {
    const auto it = baselines_.find(type);
    return it == baselines_.end() ? 0.0 : it->second.value;
  };

  std::vector<point> points;
  for (std::size_t v = 0; v < op.variants.size(); ++v)
    for (std::int64_t bytes = opts_.min_bytes; bytes <= opts_.max_bytes;
         bytes *= opts_.step_factor) {
      const auto [count, actual] = op.size(bytes, v, ranks);
      if (count > 0) points.push_back({v, actual, count, ranks});
    }

  std::vector<row> rows;
  double last_progress = 0;
  for (std::size_t i = 0; i < points.size(); ++i) {
    const point& p = points[i];
    op.init(p, seed);
    for (int w = 0; w < opts_.warmup; ++w) op.run();
    if (op.sync) op.sync();
    g.barrier();
    const auto t0 = clock_type::now();
    for (int it = 0; it < opts_.iters; ++it) op.run();
    if (op.sync) op.sync();
    // nccl-tests: a collective takes as long as its slowest rank.
    const double secs = g.max(seconds_since(t0) / opts_.iters);
    std::optional<std::int64_t> wrong;
    if (opts_.check) wrong = g.sum(op.check(p, seed));
    if (root) {
      const variant& v = op.variants[p.variant];
      row r;
      r.size = p.bytes;
      r.count = p.count;
      r.type = v.type;
      r.label = v.label;
      r.time_us = secs * 1e6;
      const double base = baseline_of(v.type);
      if (op.kind == table_kind::transport) {
        r.algbw = static_cast<double>(p.bytes) / secs / 1e9;
        r.busbw = r.algbw * (op.bus_factor ? op.bus_factor(ranks) : 1.0);
        r.ratio = base > 0 ? r.busbw / base : 0;
      } else {
        r.rate = op.work ? op.work(p) / secs : 0;
        r.ratio = base > 0 ? r.rate / base : 0;
      }
      r.wrong = wrong;
      r.extra.assign(op.extra_columns.size(), 0.0);
      if (op.finish) op.finish(p, r);
      rows.push_back(std::move(r));
      const double elapsed = seconds_since(start);
      if (elapsed > 2.0 && elapsed - last_progress > 1.0) {  // long runs, once a second
        last_progress = elapsed;
        fmt::print(stderr, "{}: {}/{} rows, {} {} B, {:.1f} s\n", program_, i + 1, points.size(),
                   v.type, p.bytes, elapsed);
      }
    }
  }
  if (root) seconds_ = seconds_since(start);
  return rows;
}

namespace {

std::string wrong_text(const std::optional<std::int64_t>& w) {
  return w ? fmt::format("{}", *w) : std::string("N/A");
}

}  // namespace

namespace {

void print_side(const side_table& t) {
  fmt::print("#\n# {}\n#", t.title);
  for (const auto& c : t.columns) fmt::print(" {:>16}", c);
  fmt::print("\n");
  for (const auto& r : t.rows) {
    fmt::print(" ");
    for (double x : r) fmt::print(" {:>16.6g}", x);
    fmt::print("\n");
  }
}

nlohmann::json side_json(const side_table& t) {
  nlohmann::json s = {{"title", t.title}, {"rows", nlohmann::json::array()}};
  for (const auto& r : t.rows) {
    nlohmann::json o;
    for (std::size_t i = 0; i < r.size() && i < t.columns.size(); ++i) o[t.columns[i]] = r[i];
    s["rows"].push_back(std::move(o));
  }
  return s;
}

}  // namespace

int driver::report(const operation& op, int ranks, const std::vector<row>& rows) {
  std::int64_t wrong_total = 0;
  for (const auto& r : rows) wrong_total += r.wrong.value_or(0);
  const bool transport = op.kind == table_kind::transport;
  const std::optional<side_table> summary =
      op.summary ? std::optional<side_table>(op.summary(rows)) : std::nullopt;

  if (opts_.json_path != "-") {
    fmt::print("# {}: {}, {} backend, {} rank{}\n", program_, op.name, op.backend, ranks,
               ranks == 1 ? "" : "s");
    fmt::print("# CPU ISA: {}\n", sim::cpu_isa());
    fmt::print("# minbytes {} maxbytes {} step {} iters {} warmup {} check {}{}\n", opts_.min_bytes,
               opts_.max_bytes, opts_.step_factor, opts_.iters, opts_.warmup, opts_.check ? 1 : 0,
               opts_.quick ? " (quick)" : "");
    for (const auto& [type, b] : baselines_)
      fmt::print("# baseline: {} = {:.2f} {} (same run)\n", b.what, b.value, b.unit);
    for (const auto& n : op.notes) fmt::print("# {}\n", n);
    if (!op.ratio_meaning.empty()) fmt::print("# ratio: {}\n", op.ratio_meaning);
    fmt::print("#\n");
    std::string head1, head2;
    if (transport) {
      head1 = fmt::format("# {:>12} {:>12} {:>8} {:>10} {:>8} {:>8} {:>7} {:>7}", "size", "count",
                          "type", "time", "algbw", "busbw", "#wrong", "ratio");
      head2 = fmt::format("# {:>12} {:>12} {:>8} {:>10} {:>8} {:>8} {:>7} {:>7}", "(B)",
                          "(elements)", "", "(us)", "(GB/s)", "(GB/s)", "", "");
    } else {
      head1 = fmt::format("# {:>12} {:>10} {:>8} {:>10} {:>12} {:>10} {:>7} {:>7}", "size", "count",
                          "type", "case", "time", "rate", "ratio", "#wrong");
      head2 = fmt::format("# {:>12} {:>10} {:>8} {:>10} {:>12} {:>10} {:>7} {:>7}", "(B)", "", "",
                          "", "(us)", fmt::format("({})", op.rate_unit), "", "");
    }
    for (const auto& c : op.extra_columns) {
      head1 += fmt::format(" {:>10}", c);
      head2 += fmt::format(" {:>10}", "");
    }
    fmt::print("{}\n{}\n", head1, head2);
    double sum_bw = 0;
    for (const auto& r : rows) {
      std::string line;
      if (transport) {
        line =
            fmt::format("  {:>12} {:>12} {:>8} {:>10.1f} {:>8.2f} {:>8.2f} {:>7} {:>7.3f}", r.size,
                        r.count, r.type, r.time_us, r.algbw, r.busbw, wrong_text(r.wrong), r.ratio);
        sum_bw += r.busbw;
      } else {
        line =
            fmt::format("  {:>12} {:>10} {:>8} {:>10} {:>12.1f} {:>10.2f} {:>7.3f} {:>7}", r.size,
                        r.count, r.type, r.label, r.time_us, r.rate, r.ratio, wrong_text(r.wrong));
        sum_bw += r.ratio;
      }
      for (double x : r.extra) line += fmt::format(" {:>10.5g}", x);
      fmt::print("{}\n", line);
    }
    fmt::print("# Out of bounds values : {} {}\n",
               opts_.check ? fmt::format("{}", wrong_total) : "N/A",
               !opts_.check  ? "(check off)"
               : wrong_total ? "FAILED"
                             : "OK");
    const double avg = rows.empty() ? 0.0 : sum_bw / static_cast<double>(rows.size());
    if (transport)
      fmt::print("# Avg bus bandwidth    : {:.3f}\n", avg);
    else
      fmt::print("# Avg ratio            : {:.3f}\n", avg);
    if (side_) print_side(*side_);
    if (summary) print_side(*summary);
    fmt::print("# {:.1f} s\n", seconds_);
    std::fflush(stdout);
  }

  if (!opts_.json_path.empty()) {
    nlohmann::json j;
    j["program"] = program_;
    j["op"] = op.name;
    j["backend"] = op.backend;
    j["kind"] = transport ? "transport" : "compute";
    j["ranks"] = ranks;
    j["isa"] = sim::cpu_isa();
    j["options"] = {{"minbytes", opts_.min_bytes},
                    {"maxbytes", opts_.max_bytes},
                    {"stepfactor", opts_.step_factor},
                    {"iters", opts_.iters},
                    {"warmup_iters", opts_.warmup},
                    {"check", opts_.check},
                    {"quick", opts_.quick}};
    j["baselines"] = nlohmann::json::array();
    for (const auto& [type, b] : baselines_)
      j["baselines"].push_back(
          {{"type", type}, {"what", b.what}, {"value", b.value}, {"unit", b.unit}});
    j["notes"] = op.notes;
    j["ratio"] = op.ratio_meaning;
    if (!transport) j["rate_unit"] = op.rate_unit;
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows) {
      nlohmann::json o = {{"size", r.size},
                          {"count", r.count},
                          {"type", r.type},
                          {"time_us", r.time_us},
                          {"ratio", r.ratio}};
      if (transport) {
        o["algbw"] = r.algbw;
        o["busbw"] = r.busbw;
      } else {
        o["case"] = r.label;
        o["rate"] = r.rate;
      }
      o["wrong"] = r.wrong ? nlohmann::json(*r.wrong) : nlohmann::json(nullptr);
      for (std::size_t i = 0; i < r.extra.size() && i < op.extra_columns.size(); ++i)
        o[op.extra_columns[i]] = r.extra[i];
      j["rows"].push_back(std::move(o));
    }
    if (side_) j["side"] = side_json(*side_);
    if (summary) j["summary"] = side_json(*summary);
    j["wrong"] = opts_.check ? nlohmann::json(wrong_total) : nlohmann::json(nullptr);
    const std::string text = j.dump() + "\n";
    if (opts_.json_path == "-") {
      fmt::print("{}", text);
    } else {
      std::ofstream f(opts_.json_path);
      f << text;
      if (!f) fail<config_error>("cannot write the JSON report to '{}'", opts_.json_path);
    }
  }
  return wrong_total ? 1 : 0;
}

int driver::guarded(const std::function<int()>& body) const {
  try {
    return body();
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", program_, e.what());
    return 2;
  }
}

baseline gemm_baseline(const std::string& type) {
  return {"Eigen GEMM 1024^3 " + type + ", 1 thread", eigen_gemm_gflops(type, 1024), "GFLOP/s"};
}

double eigen_gemm_gflops(const std::string& type, int n) {
  auto rate = [n](auto zero) {
    using T = decltype(zero);
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
    if (c(0, 0) == T(12345)) std::puts("");  // keep the product observable
    return 2.0 * n * n * static_cast<double>(n) / best * 1e-9;
  };
  if (type == "float") return rate(0.0f);
  if (type == "double") return rate(0.0);
  fail<config_error>("no Eigen GEMM baseline for type '{}'; use float or double", type);
}

namespace {

/// GB/s of memcpy between two buffers of `bytes` (touched first), repeated for ~0.3 s;
/// `ready` is called once the buffers are touched, before the clock starts.
double timed_copies(std::int64_t bytes, const std::function<void()>& ready = {}) {
  std::vector<char> a(static_cast<std::size_t>(bytes), 1), b(static_cast<std::size_t>(bytes), 0);
  std::memcpy(b.data(), a.data(), a.size());  // touch
  if (ready) ready();
  int reps = 0;
  const auto t0 = clock_type::now();
  double secs = 0;
  do {
    std::memcpy(b.data(), a.data(), a.size());
    a[static_cast<std::size_t>(reps) % a.size()] = b[0];  // keep the copies observable
    ++reps;
    secs = seconds_since(t0);
  } while (secs < 0.3 || reps < 3);
  return static_cast<double>(bytes) * reps / secs / 1e9;
}

}  // namespace

double memcpy_gbps(std::int64_t bytes) {
  return timed_copies(std::clamp<std::int64_t>(bytes, 1 << 20, 64 << 20));
}

double concurrent_memcpy_gbps(int threads, std::int64_t bytes) {
  bytes = std::clamp<std::int64_t>(bytes, 1 << 20, 64 << 20);
  const auto n = static_cast<std::size_t>(std::max(threads, 1));
  std::vector<double> rate(n, 0.0);
  std::barrier start(static_cast<std::ptrdiff_t>(n));
  std::vector<std::thread> team;
  for (std::size_t t = 0; t < n; ++t)
    team.emplace_back([&, t] { rate[t] = timed_copies(bytes, [&] { start.arrive_and_wait(); }); });
  for (auto& th : team) th.join();
  return *std::min_element(rate.begin(), rate.end());
}

bool run_in_child(const std::function<void(void* out)>& f, void* out, std::size_t size) {
  int fd[2];
  if (pipe(fd) != 0) throw std::runtime_error("pipe failed");
  std::fflush(nullptr);  // nothing buffered is printed twice
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    close(fd[0]);
    try {
      f(out);
    } catch (const std::exception& e) {
      fmt::print(stderr, "child process: {}\n", e.what());
      _exit(1);
    }
    const auto n = write(fd[1], out, size);
    _exit(n == static_cast<ssize_t>(size) ? 0 : 1);
  }
  close(fd[1]);
  std::vector<char> got(size);
  const auto n = read(fd[0], got.data(), size);
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (n != static_cast<ssize_t>(size) || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return false;
  std::memcpy(out, got.data(), size);
  return true;
}

}  // namespace seqpar::bench
