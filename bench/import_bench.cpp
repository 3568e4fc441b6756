// import_bench: `seqpar import --from kineto` on large synthetic profiler traces, one per rank,
// in each format it reads (torch >= 2.1 Kineto, torch ~2.0 Kineto, the legacy export), against
// reading the same file (`cat` to /dev/null: read() into a buffer, the page cache warm) in the
// same run.
//
// size = the trace file's bytes; count = its events. A file is ~99 % what real traces are
// mostly made of (cpu_op, cuda_runtime and kernel events with their args) and one collective
// per 100 events (in the format's own shape: record_param_comms with its args; c10d::op ⊃
// record_param_comms ⊃ nccl:all_reduce with Input Dims; a bare gloo:all_reduce). Each import
// runs in a child process of its own: rss/file = its peak RSS above its start / the file size.
// ratio = import MB/s / read MB/s; #wrong = calls imported ≠ collectives written.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/driver.hpp"
#include "trace/import/import.hpp"

namespace {

using namespace seqpar;

const char* const formats[] = {"kineto-2.1", "kineto-2.0", "legacy"};

std::string filler(std::int64_t i) {
  // A CPU op, its launch and its kernel, as Kineto writes them.
  return fmt::format(
      R"({{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 4037, "tid": 4037, "ts": {}, "dur": 12, "args": {{"External id": {}, "Ev Idx": {}, "Input Dims": [[4096, 1024], [1024, 4096]], "Input type": ["float", "float"]}}}},
{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 4037, "tid": 4037, "ts": {}, "dur": 5, "args": {{"External id": {}, "cbid": 211, "correlation": {}}}}},
{{"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7, "ts": {}, "dur": 80, "args": {{"External id": {}, "queued": 0, "device": 0, "context": 1, "stream": 7, "correlation": {}, "registers per thread": 128, "shared memory": 16384, "grid": [64, 32, 1], "block": [256, 1, 1]}}}})",
      10 * i, i, i, 10 * i + 1, i, i, 10 * i + 2, i, i);
}

std::string collective(const std::string& format, std::int64_t i) {
  if (format == "kineto-2.1")
    return fmt::format(
        R"({{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 4037, "tid": 4037, "ts": {}, "dur": 30, "args": {{"External id": {}, "Collective name": "allreduce", "dtype": "Float", "In msg nelems": 394241, "Out msg nelems": 394241, "Group size": 2, "In split size": "[]", "Out split size": "[]", "Process Group Name": "0", "Process Group Description": "default_pg", "Process Group Ranks": "[0, 1]", "Rank": 0}}}})",
        10 * i + 3, i);
  if (format == "kineto-2.0")
    return fmt::format(
        R"({{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 4037, "tid": 4037, "ts": {}, "dur": 40, "args": {{"External id": {}, "Ev Idx": {}, "Input Dims": [[], [], [], []], "Input type": ["TensorList", "", "", "Scalar"]}}}},
{{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 4037, "tid": 4037, "ts": {}, "dur": 35, "args": {{"External id": {}, "Ev Idx": {}, "Input Dims": [[], [], [], [], [], [], []], "Input type": ["TensorList", "Scalar", "Scalar", "Scalar", "", "", ""]}}}},
{{"ph": "X", "cat": "user_annotation", "name": "nccl:all_reduce", "pid": 4037, "tid": 4037, "ts": {}, "dur": 30, "args": {{"External id": {}, "Ev Idx": {}, "Input Dims": [[394241]], "Input type": ["float"]}}}})",
        10 * i + 3, i, i, 10 * i + 4, i, i, 10 * i + 5, i, i);
  return fmt::format(
      R"({{"name": "gloo:all_reduce", "ph": "X", "ts": {}, "dur": 30, "tid": 1, "pid": "CPU functions", "args": {{}}}})",
      10 * i + 3);
}

/// Writes a trace of about `bytes` to `path`; returns {events, collectives}.
std::pair<std::int64_t, std::int64_t> write_trace(const std::string& path,
                                                  const std::string& format, std::int64_t bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::string head = R"({"schemaVersion": 1, "traceEvents": [)";
  if (format != "legacy")
    head =
        R"({"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}, "traceEvents": [)";
  std::fputs(head.c_str(), f);
  std::int64_t written = static_cast<std::int64_t>(head.size()), events = 0, colls = 0;
  std::string block;
  for (std::int64_t i = 0; written < bytes; ++i) {
    block.clear();
    for (int k = 0; k < 33; ++k) block += (events || k ? ",\n" : "\n") + filler(i * 40 + k);
    events += 99;
    block += ",\n" + collective(format, i);
    events += format == "kineto-2.0" ? 3 : 1;
    ++colls;
    std::fwrite(block.data(), 1, block.size(), f);
    written += static_cast<std::int64_t>(block.size());
  }
  std::fputs("\n], \"traceName\": \"bench\"}\n", f);
  std::fclose(f);
  return {events, colls};
}

double read_seconds(const std::string& path) {
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY);
  std::vector<char> buf(1 << 20);
  while (::read(fd, buf.data(), buf.size()) > 0) {
  }
  ::close(fd);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

struct result {
  double seconds = 0, rss = 0;
  std::int64_t calls = -1;
};

struct import_scaling {
  std::string dir;
  std::string path;
  std::int64_t file_bytes = 0, collectives = 0, events = 0;
  result last;

  bench::operation op() {
    bench::operation o;
    o.name = "seqpar import --from kineto (one rank's profiler trace)";
    o.backend = "cpu";
    o.kind = bench::table_kind::compute;
    for (const char* f : formats) o.variants.push_back({f, f});
    // The file is written when its row comes (init); finish puts its actual size and events.
    o.size = [](std::int64_t bytes, std::size_t, int) { return std::pair{bytes / 300, bytes}; };
    o.init = [this](const bench::point& p, std::uint64_t) {
      path = fmt::format("{}/seqpar-import-bench-{}.{}.rank0.json", dir, ::getpid(),
                         formats[p.variant]);
      const auto [n, colls] = write_trace(path, formats[p.variant], p.bytes);
      file_bytes = static_cast<std::int64_t>(std::filesystem::file_size(path));
      events = n;
      collectives = colls;
    };
    o.run = [this] {
      result r;
      const std::string file = path;
      const bool ok = bench::run_in_child(
          [&file](void* out) {
            auto& res = *static_cast<result*>(out);
            const double rss0 = peak_rss_bytes();
            const auto t0 = std::chrono::steady_clock::now();
            const auto t = import::from_kineto({file});
            res.seconds =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            res.rss = peak_rss_bytes() - rss0;
            res.calls = static_cast<std::int64_t>(t.calls.size());
          },
          &r, sizeof r);
      if (!ok) throw std::runtime_error("the import's child process failed");
      last = r;
    };
    o.check = [this](const bench::point&, std::uint64_t) {
      return last.calls == collectives
                 ? 0
                 : std::max<std::int64_t>(1, std::abs(last.calls - collectives));
    };
    o.rate_unit = "MB/s";
    o.finish = [this](const bench::point&, bench::row& r) {
      const double mb = static_cast<double>(file_bytes) / 1e6;
      const double read_s = std::min(read_seconds(path), read_seconds(path));
      r.size = file_bytes;
      r.count = events;
      r.time_us = last.seconds * 1e6;
      r.rate = mb / std::max(last.seconds, 1e-9);
      r.ratio = r.rate / (mb / std::max(read_s, 1e-9));
      r.extra = {mb / std::max(read_s, 1e-9), last.rss / static_cast<double>(file_bytes),
                 static_cast<double>(last.calls)};
      std::filesystem::remove(path);
    };
    o.extra_columns = {"read_MB/s", "rss/file", "calls"};
    o.ratio_meaning = "import MB/s / read MB/s of the same file in the same run";
    o.notes = {
        "one rank's file; 1 collective per 100 events; the import in a child process "
        "(rss/file: its peak RSS above its start / the file's size)"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 16 << 20;
  defaults.max_bytes = 1 << 30;
  defaults.step_factor = 4;
  defaults.iters = 1;
  defaults.warmup = 0;
  bench::options quick = defaults;
  quick.min_bytes = quick.max_bytes = 4 << 20;
  bench::driver d("import_bench",
                  "seqpar import --from kineto on large synthetic traces vs reading the file.",
                  defaults, quick);
  std::string dir = std::filesystem::temp_directory_path().string();
  d.app().add_option("--dir", dir, "where the synthetic traces are written (default: TMPDIR)");
  if (auto rc = d.parse(argc, argv)) return *rc;
  return d.guarded([&] {
    import_scaling s;
    s.dir = dir;
    auto op = s.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
