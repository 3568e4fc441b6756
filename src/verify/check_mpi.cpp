// `seqpar check --backend mpi`: every process is one cp rank; rank 0 compares and prints.
#include "verify/check_mpi.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/flight_recorder.hpp"
#include "io/scenario_json.hpp"
#include "mpi/mpi_comm.hpp"
#include "mpi/phase_guard.hpp"
#include "mpi/sentinel.hpp"
#include "trace/flight.hpp"

namespace seqpar::verify {

namespace {

// A failed rank's way out — its record (bounded by its guard), the peers asked (the probe
// budget), the abort announced (3 s for the acknowledgements) or acknowledged (2 s) and 4 s for
// mpiexec, MPI_Abort (2 s for the launcher) — takes about 6.5 s. Every step has its own bound,
// yet an MPI call towards a peer that died can block inside the transport: whatever happens,
// the rank is gone 8 s after its failure, not when its sentinel kills the orphan 20 s later.
void ends_after_failure(const mpi::mpi_session& session, int code) {
  const std::string note = fmt::format(
      "seqpar: error: rank {} on {}: the MPI transport held this rank's exit after its failure "
      "for 8 s (a call towards a peer that is gone blocked); ended — what it printed and "
      "recorded above stands\n",
      session.rank(), session.host());
  mpi::end_within(std::chrono::seconds(8), code, note.c_str());
}

}  // namespace

int check_mpi(const std::function<scenario(verify::check_options&)>& resolve,
              verify::check_options opt,
              const std::function<void(const verify::check_report&)>& print) {
  mpi::mpi_session session(nullptr, nullptr, opt.timeout);
  mpi::mpi_options mo;
  mo.timeout = opt.timeout.count() > 0 ? opt.timeout : mo.timeout;
  mpi::mpi_communicator world(mo);
  const int P = session.size(), me = session.rank();
  comm_group all{"cli.world", {}};
  for (int r = 0; r < P; ++r) all.ranks.push_back(r);

  // Phase 1, local to each process: flags, scenario rules, the process count. Every process
  // normally reaches the same verdict; the flags are still shared so that one process that
  // cannot read a file (another node) does not leave the others waiting.
  scenario s;
  std::string problem;
  try {
    s = resolve(opt);
    validate(s);
    if (P != s.cp())
      fail<config_error>(
          "mpiexec started P={} processes but --backend mpi runs one cp rank per process and "
          "ulysses U={} × ring R={} needs {}; launch mpiexec -n {} (or change --ulysses/--ring "
          "so that U·R = {})",
          P, s.ulysses, s.ring, s.cp(), s.cp(), P);
  } catch (const seqpar::error& e) {
    problem = e.what();
  }
  // With the flags, every process's pid: the launcher names a process that died by its PID
  // ("BAD TERMINATION … PID 4242 … EXIT CODE: 9"), the progress line maps it to its rank.
  const std::int32_t mine[2] = {problem.empty() ? 0 : 1, static_cast<std::int32_t>(getpid())};
  std::vector<std::int32_t> flags(2 * static_cast<std::size_t>(P));
  try {
    world.all_gather(all, mine, 2, flags.data(), dtype::i32, op_info{"cli.validate", {}, {}});
  } catch (const std::exception& e) {
    mpi::mpi_session::abort_world(e.what(), 2);
  }
  if (me == 0 && opt.progress) {
    // Each rank's host as the communicator's endpoint exchange learnt it, hosts in the order of
    // their first rank: "6 processes on 3 hosts: a (rank:pid 0:1510 1:1513), b (…), c (…)".
    std::vector<std::pair<std::string, std::vector<std::string>>> by_host;
    for (int r = 0; r < P; ++r) {
      const auto& h = world.host_of(r);
      auto it = std::find_if(by_host.begin(), by_host.end(),
                             [&h](const auto& e) { return e.first == h; });
      if (it == by_host.end()) it = by_host.insert(by_host.end(), {h, {}});
      it->second.push_back(fmt::format("{}:{}", r, flags[2 * static_cast<std::size_t>(r) + 1]));
    }
    std::vector<std::string> parts;
    for (const auto& [h, pids] : by_host)
      parts.push_back(fmt::format("{} (rank:pid {})", h, fmt::join(pids, " ")));
    opt.progress(by_host.size() == 1 ? fmt::format("{} processes on {}", P, parts.front())
                                     : fmt::format("{} processes on {} hosts: {}", P,
                                                   by_host.size(), fmt::join(parts, ", ")));
  }
  for (int r = 0; r < P; ++r) {
    if (!flags[2 * static_cast<std::size_t>(r)]) continue;
    if (r == me)
      fmt::print(stderr, "seqpar: error: {}{}\n",
                 r == 0 ? "" : fmt::format("rank {} on {}: ", r, session.host()), problem);
    return 2;  // every process, after a clean MPI_Finalize
  }

  // Phase 2, distributed: a failure on one rank aborts the job instead of leaving the others
  // inside a collective. The watchdog ends a wait for a rank that stopped without dying; every
  // rank it can reach leaves its flight record first.
  if (opt.timeout.count() > 0) world.set_timeout(opt.timeout);
  // Shared: the record a stalled MPI_Finalize leaves (below) is written after this function's
  // locals are gone.
  const auto flight_p = std::make_shared<flight_recorder>();
  auto& flight = *flight_p;
  world.set_flight_recorder(&flight);
  std::vector<std::string> hosts;
  for (int r = 0; r < P; ++r) hosts.push_back(world.host_of(r));
  // The launcher's SIGTERM usually means another process of the job died: the record says
  // which peers are gone or cut off, asked over TCP (no MPI on the signal's thread).
  const auto& peers = world.endpoints();
  const auto probe_peers = [&peers, me] {
    return mpi::assess(peers, me, {}, std::chrono::milliseconds(500)).lead;
  };
  const trace::flight_on_signal on_signal(
      flight, {me}, {P, io::scenario_to_json(s), {}, -1, hosts, {}}, opt.flight_dir, probe_peers);
  const auto write_record = [&](const std::string& reason, int failed) -> std::size_t {
    if (opt.flight_dir.empty()) return 0;
    const int ranks[] = {me};
    return trace::write_flight_records(
               opt.flight_dir, flight, ranks,
               {P, io::scenario_to_json(s), reason, failed, hosts, world.cut_off()})
        .size();
  };
  // A phase the MPI watchdog cannot watch (group creation, MPI_Finalize) that outlives its
  // deadline leaves this rank's record before the process ends.
  mpi::phase_guard::set_last_words([&](const std::string& why, int) {
    write_record(why, -1);
    return std::string();
  });
  // Writing the record has a deadline of its own (a stalled file system): the guard ends the
  // process instead of leaving the job waiting for this rank's acknowledgement.
  const auto leave_record = [&](const std::string& reason, int failed) -> std::size_t {
    mpi::phase_guard::set_last_words(nullptr);
    const mpi::phase_guard guard(
        fmt::format("writing the flight record to {}/", opt.flight_dir),
        std::max(opt.timeout, std::chrono::milliseconds(10000)),
        "the file system did not complete the write (stalled, full, or a FIFO in its place); "
        "this rank leaves no record");
    return write_record(reason, failed);
  };
  // A watchdog's finding names the rank that never arrived, not the one that waited.
  // So do the probes' findings: a peer gone or cut off, not this rank.
  const auto by_watchdog = [](const std::string& m) {
    return m.find("watchdog: ") != std::string::npos ||
           m.find("the network: ") != std::string::npos ||
           m.find("the process: ") != std::string::npos;
  };

  // Once every rank holds the verdict (rank 0 prints it next), a failure of the job's end — a
  // host cut or a rank stopped before the last barrier — is still reported, records and all,
  // but the job ends with the verdict's exit code: the result was gathered and judged whole.
  int exit_code = 2;
  try {
    if (me != 0) opt.progress = nullptr;
    auto rep = verify::run_check_distributed(world, s, opt);
    exit_code = rep.pass ? 0 : 1;
    // From here a rank that stays stopped is killed by its sentinel after 10 s: stopped inside
    // the last barrier (its messages sent, the others through it), it would hold mpiexec for
    // ever once the others have ended.
    mpi::note_job_finished();
    rep.backend = "mpi";
    if (me == 0) print(rep);
    // The end, together: a rank that stops after the verdict is named here, not left for
    // mpiexec to wait on.
    world.barrier(all, op_info{"check.done", {}, {}});
    session.finished(rep.pass ? 0 : 1);
    // Finished here. Should MPI_Finalize then stall past its deadline, the peers' hosts are
    // asked why: a link cut just after the last barrier lets this rank pass it while the
    // others fail theirs and name this rank's host — this rank then leaves its record too, so
    // that none is missing. Peers whose ports refuse are not a finding here (a rank that
    // finished has closed its port), nor is a teardown that stalls with every host answering.
    mpi::phase_guard::set_last_words(
        [flight_p, peers, me, dir = opt.flight_dir,
         meta = trace::flight_meta{P, io::scenario_to_json(s), {}, -1, hosts, {}}](
            const std::string& why, int) mutable {
          // Half a second (as on the launcher's signal): the process is past its deadline.
          const auto found = mpi::assess(peers, me, {}, std::chrono::milliseconds(500));
          if (found.cut_off.empty()) return std::string();
          // The network's part of the finding ("this host … reaches none of the other hosts",
          // or "host h3 … gives no answer"), not the refused ports.
          auto network = found.lead.substr(0, found.lead.find("the process: "));
          network.erase(network.find_last_not_of("; ") + 1);
          const auto finding = fmt::format(
              "asked after the stall, {} — after the job's last barrier, which the ranks cut "
              "off from this one may not have passed (they then report the job as failed)",
              network);
          std::string where;
          if (!dir.empty()) {
            meta.reason = fmt::format("{}; {}", why, finding);
            meta.unreachable = found.cut_off;
            const int ranks[] = {me};
            if (const auto paths = trace::write_flight_records(dir, *flight_p, ranks, meta);
                !paths.empty())
              where = fmt::format("; this rank's record: {}", paths.front());
          }
          return fmt::format(" — {}{}", finding, where);
        });
    // A slow link is not a fault, but the run says what it cost (each rank, for its own waits).
    if (const auto slow = world.slow_network_note(); !slow.empty()) {
      std::fflush(stdout);
      fmt::print(stderr, "seqpar: note: rank {} on {}: {}\n", me, session.host(), slow);
      std::fflush(stderr);
    }
    return rep.pass ? 0 : 1;
  } catch (const mpi::peer_abort& e) {
    // Another rank failed and reports it; leave this rank's record and wait for the end (the
    // announcer's MPI_Abort, through mpiexec). Where mpiexec cannot reach this host (a link
    // down), nothing comes: the process ends on its own.
    ends_after_failure(session, exit_code);
    leave_record(e.what(), by_watchdog(e.what()) ? -1 : e.rank());
    world.acknowledge_abort(e.rank());
    // The announcer waits up to 3 s for the acknowledgements, prints, then asks mpiexec to end
    // the job. Hydra does not end a job whose ranks exit with an error code while one of them
    // is stopped (it waits for that one forever): still here after 4 s, this rank ends its
    // launcher proxy, which makes mpiexec end every process of the job (mpi/sentinel.hpp).
    std::this_thread::sleep_for(std::chrono::seconds(4));
    mpi::end_launcher_proxy();
    std::_Exit(exit_code);
  } catch (const std::exception& e) {
    ends_after_failure(session, exit_code);
    std::string message = e.what();
    int failed = by_watchdog(message) ? -1 : me;
    // An MPI call that failed (UCX: "Endpoint timeout", a reset connection) usually failed
    // because of its peer: ask the peers whether they are gone or cut off before blaming this
    // rank.
    if (dynamic_cast<const backend_error*>(&e) != nullptr) {
      if (auto lead = mpi::assess(peers, me, {}, mo.probe_budget).lead; !lead.empty()) {
        message = fmt::format("rank {} on {}: {}{}", me, session.host(), lead, message);
        failed = -1;
      }
    }
    if (exit_code != 2)  // rank 0's printed verdict may not reach the console (its host cut)
      message += fmt::format(
          " — after the verdict ({}, every rank holds it), which stands: the job ends with its "
          "exit code {}",
          exit_code == 0 ? "PASS" : "FAIL", exit_code);
    const auto own = leave_record(message, failed);
    const int acks = world.announce_abort(message, std::chrono::seconds(3));
    mpi::mpi_session::abort_world(
        opt.flight_dir.empty()
            ? message
            : message + flight_note(opt.flight_dir, own + static_cast<std::size_t>(acks)),
        exit_code);
  }
}

}  // namespace seqpar::verify
