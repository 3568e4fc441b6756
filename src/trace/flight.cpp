#include "trace/flight.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.hpp"
#include "io/file.hpp"

#include <pthread.h>
#include <signal.h>

namespace seqpar::trace {

std::string flight_text(const flight_recorder& fr, int rank, const flight_meta& m) {
  meta_record meta;
  meta.world_size = m.world_size;
  meta.config = m.config;
  meta.groups = fr.groups();
  meta.source = "seqpar-flight";
  meta.failed_rank = m.failed_rank;
  meta.reason = m.reason;
  if (const auto dropped = fr.dropped(rank))
    meta.notes.push_back(
        fmt::format("rank {} kept its last {} calls; its {} earlier calls are not in this record",
                    rank, fr.capacity(), dropped));
  meta.rank_of_file = rank;
  meta.hosts = m.hosts;
  if (!m.unreachable.empty()) meta.unreachable_by[rank] = m.unreachable;
  std::string out = dump_line(to_json(meta)) + "\n";
  for (const auto& e : fr.calls(rank)) {
    auto j = to_json(from_comm_record(e.call));
    j["t_start"] = e.t_start;
    if (e.t_end >= 0) j["t_end"] = e.t_end;
    if (!e.error.empty()) j["error"] = e.error;
    out += dump_line(j);
    out += '\n';
  }
  return out;
}

std::vector<std::string> write_flight_records(const std::string& dir, const flight_recorder& fr,
                                              std::span<const int> ranks, const flight_meta& m) {
  std::vector<std::string> written;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  for (int r : ranks) {
    const auto path = (std::filesystem::path(dir) / fmt::format("rank-{}.jsonl", r)).string();
    try {
      io::write_atomic(path, flight_text(fr, r, m));
      written.push_back(path);
    } catch (const std::exception&) {
      // The run's own error is what the user needs first; the missing file shows in replay.
    }
  }
  return written;
}

namespace {

// The run the signal watcher writes records for (one at a time: a check runs one SP step).
struct signal_target {
  std::mutex mu;
  const flight_recorder* fr = nullptr;
  std::vector<int> ranks;
  flight_meta meta;
  std::string dir;
  std::function<std::string()> why;
};

signal_target& target() {
  static signal_target t;
  return t;
}

}  // namespace

flight_on_signal::flight_on_signal(const flight_recorder& fr, std::vector<int> ranks, flight_meta m,
                                   std::string dir, std::function<std::string()> why) {
  auto& t = target();
  std::lock_guard lock(t.mu);
  t.fr = dir.empty() ? nullptr : &fr;
  t.ranks = std::move(ranks);
  t.meta = std::move(m);
  t.dir = std::move(dir);
  t.why = std::move(why);
}

flight_on_signal::~flight_on_signal() {
  auto& t = target();
  std::lock_guard lock(t.mu);
  t.fr = nullptr;
}

void watch_signals_for_flight_records() {
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
    if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) return;
    std::thread([set] {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) return;
      auto& t = target();
      std::unique_lock lock(t.mu, std::try_to_lock);
      if (lock.owns_lock() && t.fr) {
        auto m = t.meta;
        m.reason = fmt::format("stopped by signal {} ({})", sig, strsignal(sig));
        auto files = write_flight_records(t.dir, *t.fr, t.ranks, m);
        // What the process can still find out goes in after: the records are on disk first, in
        // case the launcher's SIGKILL follows its SIGTERM closely.
        if (t.why) {
          try {
            if (auto more = t.why(); !more.empty()) {
              m.reason += ": " + more;
              files = write_flight_records(t.dir, *t.fr, t.ranks, m);
            }
          } catch (const std::exception&) {
          }
        }
        std::fflush(stdout);
        fmt::print(stderr,
                   "seqpar: error: {}; flight records of {} rank(s) (their last calls) are in "
                   "{}/: `seqpar replay {}` shows where each rank was\n",
                   m.reason, files.size(), t.dir, t.dir);
        std::fflush(stderr);
      }
      std::_Exit(128 + sig);
    }).detach();
  });
}

std::vector<std::string> trace_files(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return {path};
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(path, ec))
    if (e.is_regular_file(ec) && e.path().extension() == ".jsonl") out.push_back(e.path().string());
  if (ec) fail<trace_error>("{}: the directory cannot be listed: {}", path, ec.message());
  std::sort(out.begin(), out.end());
  if (out.empty())
    fail<trace_error>(
        "{}: the directory holds no *.jsonl trace; give a trace file, or the directory a failed "
        "run wrote its flight records to (rank-<R>.jsonl)",
        path);
  return out;
}

trace_data merge_traces(const std::vector<std::string>& paths) {
  trace_data out;
  bool have_meta = false;
  std::string first_with_meta;
  std::set<int> recorded;  // ranks whose flight record was read (their meta names them)
  for (const auto& path : paths) {
    auto in = reader::open(path);
    while (auto rec = in->next()) {
      if (auto* m = std::get_if<meta_record>(&*rec)) {
        if (m->rank_of_file >= 0) recorded.insert(m->rank_of_file);
        if (!have_meta) {
          out.meta = *m;
          out.meta.rank_of_file = -1;
          have_meta = true;
          first_with_meta = path;
          continue;
        }
        if (m->world_size != out.meta.world_size)
          fail<trace_error>(
              "{} is a trace of a world of {} ranks but {} of {}: replay the files of one run "
              "together",
              path, m->world_size, first_with_meta, out.meta.world_size);
        if (!out.meta.config && m->config) out.meta.config = m->config;
        if (out.meta.failed_rank < 0) out.meta.failed_rank = m->failed_rank;
        if (out.meta.reason.empty()) out.meta.reason = m->reason;
        if (out.meta.hosts.empty()) out.meta.hosts = m->hosts;
        for (const auto& [r, cut] : m->unreachable_by) out.meta.unreachable_by[r] = cut;
        for (const auto& [name, ranks] : m->groups) {
          auto [it, fresh] = out.meta.groups.emplace(name, ranks);
          if (!fresh && it->second != ranks)
            fail<trace_error>("{} lists group '{}' as {} but {} lists it as {}", path, name, ranks,
                              first_with_meta, it->second);
        }
        for (const auto& n : m->notes)
          if (std::find(out.meta.notes.begin(), out.meta.notes.end(), n) == out.meta.notes.end())
            out.meta.notes.push_back(n);
      } else if (auto* c = std::get_if<call_record>(&*rec)) {
        out.calls.push_back(std::move(*c));
      } else if (auto* l = std::get_if<layout_record>(&*rec)) {
        out.layouts.push_back(std::move(*l));
      } else if (auto* w = std::get_if<wait_record>(&*rec)) {
        out.add_wait(std::move(*w));
      }
    }
  }
  if (!have_meta) {
    // Without a meta the world is what the files show.
    int top = 0;
    for (const auto& c : out.calls) top = std::max(top, c.rank + 1);
    for (const auto& l : out.layouts) top = std::max(top, l.rank + 1);
    out.meta.world_size = std::max(top, 1);
  }
  // Windows: on each group, the calls every member that left records still holds.
  std::map<std::string, std::map<int, std::int64_t>> first_seq;  // group → rank → lowest seq
  for (const auto& c : out.calls) {
    auto& f = first_seq[c.group];
    auto it = f.find(c.rank);
    if (it == f.end() || c.seq < it->second) f[c.rank] = c.seq;
  }
  std::map<std::string, std::int64_t> cut;
  for (const auto& [group, f] : first_seq) {
    std::int64_t hi = 0;
    for (const auto& [rank, seq] : f) hi = std::max(hi, seq);
    if (hi > 0) {
      cut[group] = hi;
      out.meta.notes.push_back(fmt::format(
          "group {}: calls before seq {} are not in every member's record (each rank keeps its "
          "last calls only), so they were not compared",
          group, hi));
    }
  }
  if (!cut.empty())
    std::erase_if(out.calls, [&](const call_record& c) {
      auto it = cut.find(c.group);
      return it != cut.end() && c.seq < it->second;
    });
  out.meta.ranks_recorded.assign(recorded.begin(), recorded.end());
  std::set<int> ranks_seen(recorded.begin(), recorded.end());
  for (const auto& c : out.calls) ranks_seen.insert(c.rank);
  for (const auto& l : out.layouts) ranks_seen.insert(l.rank);
  std::vector<int> absent;
  for (int r = 0; r < out.meta.world_size; ++r)
    if (!ranks_seen.contains(r)) absent.push_back(r);
  if (!absent.empty() && paths.size() > 1)
    out.meta.notes.push_back(fmt::format(
        "rank(s) {} left no record in these {} files (stopped or killed before writing one, or "
        "its file was not given)",
        absent, paths.size()));
  // Rank by rank, each rank's calls in its own order (the files may come in any order).
  std::stable_sort(out.calls.begin(), out.calls.end(),
                   [](const call_record& a, const call_record& b) { return a.rank < b.rank; });
  return out;
}

}  // namespace seqpar::trace
