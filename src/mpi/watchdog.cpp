#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "mpi/mpi_impl.hpp"
#include "mpi/reachability.hpp"

// ---- the watchdog: control plane and watched waits ----
//
// A rank that waits longer than 0.2 s tells every other rank, on the control plane, what it
// waits in and for whom ("waiting in all_reduce #1 (loss.sum) on 'sp0'" + the ranks that have
// not arrived), and repeats it every quarter of the deadline; a rank doing local work the others
// wait for (while_busy) says "busy: …". When a wait reaches its deadline, the chain of waits is
// followed from the members that never arrived through what each said it waits for, to its
// end: a silent rank (stopped, hung in compute, dead), a busy one, one inside a transfer, or a
// rank already on the chain (a cycle: deadlock). Only "busy" heartbeats of a missing member
// extend the deadline.

namespace seqpar::mpi {

namespace {

// Completes the heartbeat sends that have left.
void reap_beats(mpi_communicator::impl& im) {
  for (auto it = im.beats_out.begin(); it != im.beats_out.end();) {
    int flag = 0;
    MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
    it = flag ? im.beats_out.erase(it) : std::next(it);
  }
}

// A heartbeat's payload: what the rank does, then (after a newline) the world ranks it waits
// for, comma-separated; send_beats adds a third line, the job's data arrived at the sender.
std::string beat_payload(const std::string& what, const std::vector<int>& waits_for) {
  return fmt::format("{}\n{}", what, fmt::join(waits_for, ","));
}

// The job's data that has arrived at this process: its TCP count less the control plane's own
// messages from other hosts (so that heartbeats are not progress); -1 where it cannot be read.
std::int64_t job_rx(const mpi_communicator::impl& im) {
  const auto tcp = process_tcp_rx_bytes();
  return tcp < 0 ? -1 : std::max<std::int64_t>(0, tcp - im.ctl_rx);
}

// Whether world rank r lives on another host than this rank (unknown: counted as another).
bool remote(const mpi_communicator::impl& im, int r) {
  const auto k = static_cast<std::size_t>(r), me = static_cast<std::size_t>(im.me);
  return k >= im.peers.size() || me >= im.peers.size() || im.peers[k].host != im.peers[me].host;
}

// Notes a new count of the job's data at a process: `moving_at` becomes `now` when it grew by
// moving_per_beat or more since the mark (which then moves to it).
void note_rx(std::int64_t& latest, std::int64_t& mark, steady::time_point& moving_at,
             std::int64_t rx, steady::time_point now) {
  if (rx < 0) return;
  latest = rx;
  if (mark >= 0 && rx - mark >= moving_per_beat) moving_at = now;
  if (mark < 0 || rx - mark >= moving_per_beat || rx < mark) mark = rx;
}

}  // namespace

// Tells every other rank `what` (a heartbeat), with the job's data arrived at this process so
// far. A peer that does not take its heartbeats (a stopped process) gets no more once 64 are
// outstanding to it; the others still get theirs.
void send_beats(mpi_communicator::impl& im, int world_size, const std::string& what) {
  reap_beats(im);
  const auto now = steady::now();
  const auto rx = job_rx(im);
  note_rx(im.own_rx, im.own_rx_mark, im.own_moving_at, rx, now);
  const auto text =
      fmt::format("{}{}\n{}", what, what.find('\n') == std::string::npos ? "\n" : "", rx);
  std::vector<int> outstanding(static_cast<std::size_t>(world_size), 0);
  for (const auto& b : im.beats_out) ++outstanding[static_cast<std::size_t>(b.peer)];
  for (int r = 0; r < world_size; ++r) {
    if (r == im.me || outstanding[static_cast<std::size_t>(r)] >= 64) continue;
    auto& b = im.beats_out.emplace_back(text, MPI_REQUEST_NULL, r);
    if (MPI_Isend(b.text.data(), static_cast<int>(b.text.size()), MPI_CHAR, r, tag_heartbeat,
                  im.ctl, &b.request) != MPI_SUCCESS)
      im.beats_out.pop_back();
  }
}

// Receives whatever the control plane holds: heartbeats (noted), acknowledgements (noted),
// an abort notice (peer_abort, unless `in_announce`: then it counts as an acknowledgement).
void poll_control(mpi_communicator::impl& im, bool in_announce) {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, im.ctl, &flag, &st), "MPI_Iprobe");
    if (!flag) return;
    int n = 0;
    MPI_Get_count(&st, MPI_CHAR, &n);
    std::string text(static_cast<std::size_t>(std::max(n, 0)), '\0');
    check_mpi(
        MPI_Recv(text.data(), n, MPI_CHAR, st.MPI_SOURCE, st.MPI_TAG, im.ctl, MPI_STATUS_IGNORE),
        "MPI_Recv");
    const auto src = static_cast<std::size_t>(st.MPI_SOURCE);
    // Its bytes crossed the network as the job's data did: they are not progress.
    if (remote(im, st.MPI_SOURCE)) im.ctl_rx += n + ctl_framing_bytes;
    if (st.MPI_TAG == tag_heartbeat) {
      im.heard[src] = steady::now();
      if (text.rfind("busy", 0) == 0) im.heard_busy[src] = im.heard[src];
      const auto nl = text.find('\n');
      im.waits_for[src].clear();
      if (nl != std::string::npos) {
        auto rest = text.substr(nl + 1);
        if (const auto nl2 = rest.find('\n'); nl2 != std::string::npos) {
          note_rx(im.peer_rx[src], im.peer_rx_mark[src], im.peer_moving_at[src],
                  std::strtoll(rest.c_str() + nl2 + 1, nullptr, 10), im.heard[src]);
          rest.resize(nl2);
        }
        std::istringstream list(rest);
        for (std::string r; std::getline(list, r, ',');)
          if (!r.empty()) im.waits_for[src].push_back(std::stoi(r));
        text.resize(nl);
      }
      im.doing[src] = std::move(text);
    } else if (st.MPI_TAG == tag_ack || (st.MPI_TAG == tag_abort && in_announce)) {
      im.acked[src] = 1;
    } else if (st.MPI_TAG == tag_abort) {
      throw peer_abort(st.MPI_SOURCE,
                       fmt::format("aborted: rank {} failed: {}", st.MPI_SOURCE, text));
    }
  }
}

namespace {

// Whether rank r counts as alive: a rank that waits, or works for others (while_busy), beats
// every quarter of the deadline, so one not heard for half the deadline is silent.
bool alive(const mpi_communicator::impl& im, int r, steady::time_point now,
           std::chrono::milliseconds limit) {
  const auto h = im.heard[static_cast<std::size_t>(r)];
  return h != steady::time_point{} && now - h < limit / 2;
}

// "rank 2 (silent for 2.1 s: …)" or "rank 3 (alive 0.2 s ago, waiting in …)".
std::string describe_member(const mpi_communicator::impl& im, int r, steady::time_point start,
                            steady::time_point now, std::chrono::milliseconds limit) {
  const auto k = static_cast<std::size_t>(r);
  if (alive(im, r, now, limit))
    return fmt::format("rank {} (alive {:.2g} s ago, {})", r, seconds(now - im.heard[k]),
                       im.doing[k]);
  const auto silent_for = seconds(now - std::max(start, im.heard[k]));
  if (im.reached[k] != reach::unknown)
    return fmt::format("rank {} (silent for {:.3g} s; {})", r, silent_for,
                       explain(im.reached[k], im.peers[k], im.opt.probe_budget));
  return fmt::format("rank {} (silent for {:.3g} s: stopped, hung in local work, or dead)", r,
                     silent_for);
}

// The ranks not heard for half the deadline (at most 256: what a probe asks at once).
std::vector<int> silent_ranks(const mpi_communicator::impl& im, int world_size,
                              steady::time_point now, std::chrono::milliseconds limit) {
  std::vector<int> quiet;
  for (int r = 0; r < world_size && quiet.size() < 256; ++r)
    if (r != im.me && !alive(im, r, now, limit)) quiet.push_back(r);
  return quiet;
}

// What a probe found, kept: each probed rank's answer (describe_member says it), and the ranks
// cut off or gone marked silent (announce_abort does not wait for them).
void note_findings(mpi_communicator::impl& im, const assessment& a) {
  for (std::size_t r = 0; r < a.found.size(); ++r)
    if (a.found[r] != reach::unknown) im.reached[r] = a.found[r];
  im.cut_off = a.cut_off;
  for (int r : a.cut_off) im.silent[static_cast<std::size_t>(r)] = 1;
  for (int r : a.gone) im.silent[static_cast<std::size_t>(r)] = 1;
}

// Network or process (reachability.hpp's assess): notes what each probed rank answered
// (describe_member says it), marks every rank cut off by the network or gone silent (so that
// announce_abort does not wait for them), and returns the lead of the watchdog's message ("" when
// every probed host answered and every process still holds its socket).
std::string probe_network(mpi_communicator::impl& im, const std::vector<int>& quiet) {
  if (im.opt.probe_budget.count() <= 0 || im.peers.empty()) return "";
  const auto a = assess(im.peers, im.me, quiet, im.opt.probe_budget);
  note_findings(im, a);
  return a.lead;
}

// Where the waits from this rank lead, as the lead of the watchdog's message. From the members
// that never arrived, what each live rank said it waits for is followed, breadth first (so each
// rank is reached by its shortest path), to the ranks where the chains end: silent ones
// (stopped, hung, dead), busy ones, or ones inside a transfer every member joined. Silent ends
// come first: "the wait ends at rank 2 (silent for 11 s: …) — rank 1 waits for rank 0, which
// waits in reduce_scatter #5 (…) on 'ring0' for rank 2". Where every chain returns to a rank
// already on it, that is a deadlock: "a cycle of waits (deadlock): rank 0 waits for rank 1,
// which waits in … for rank 0".
std::string chain_summary(mpi_communicator::impl& im, const std::vector<int>& missing,
                          steady::time_point start, steady::time_point now,
                          std::chrono::milliseconds limit) {
  struct node {
    int rank;
    std::string path;
    std::vector<int> on_path;  ///< this rank's ancestors, starting with this process
  };
  const auto world = static_cast<int>(im.waits_for.size());
  std::vector<char> seen(im.waits_for.size(), 0);
  seen[static_cast<std::size_t>(im.me)] = 1;
  std::deque<node> queue;
  for (int r : missing) {
    if (seen[static_cast<std::size_t>(r)]) continue;
    seen[static_cast<std::size_t>(r)] = 1;
    queue.push_back({r, fmt::format("rank {} waits for rank {}", im.me, r), {im.me}});
  }
  std::vector<node> ends;
  std::string cycle;
  while (!queue.empty()) {
    auto n = std::move(queue.front());
    queue.pop_front();
    const auto k = static_cast<std::size_t>(n.rank);
    if (!alive(im, n.rank, now, limit) || im.waits_for[k].empty()) {
      ends.push_back(std::move(n));
      continue;
    }
    auto doing = im.doing[k];
    if (doing.rfind("waiting in ", 0) == 0) doing.replace(0, 7, "waits");
    n.on_path.push_back(n.rank);
    for (int f : im.waits_for[k]) {
      if (f < 0 || f >= world) continue;
      auto path = fmt::format("{}, which {} for rank {}", n.path, doing, f);
      if (std::find(n.on_path.begin(), n.on_path.end(), f) != n.on_path.end()) {
        if (cycle.empty()) cycle = std::move(path);
      } else if (!seen[static_cast<std::size_t>(f)]) {
        seen[static_cast<std::size_t>(f)] = 1;
        queue.push_back({f, std::move(path), n.on_path});
      }
    }
  }
  std::stable_partition(ends.begin(), ends.end(),
                        [&](const node& n) { return !alive(im, n.rank, now, limit); });
  std::vector<std::string> parts;
  for (const auto& e : ends) {
    if (!alive(im, e.rank, now, limit)) im.silent[static_cast<std::size_t>(e.rank)] = 1;
    parts.push_back(fmt::format("the wait ends at {} — {}",
                                describe_member(im, e.rank, start, now, limit), e.path));
  }
  if (!cycle.empty()) parts.push_back(fmt::format("a cycle of waits (deadlock): {}", cycle));
  return fmt::format("{}", fmt::join(parts, "; "));
}

// Where every rank answers, when the job's data last arrived anywhere (what held the deadline
// back while it did): "every rank answers; the job's data last arrived 2.9 s ago (at rank 5),
// 18.2 s into the wait; ".
std::string last_data_clause(const mpi_communicator::impl& im, steady::time_point start,
                             steady::time_point now) {
  auto latest = im.own_moving_at;
  int at = im.me;
  for (std::size_t r = 0; r < im.peer_moving_at.size(); ++r)
    if (static_cast<int>(r) != im.me && im.peer_moving_at[r] > latest) {
      latest = im.peer_moving_at[r];
      at = static_cast<int>(r);
    }
  if (latest <= start)
    return "every rank answers, and no data of the job arrived at any of them during the wait "
           "(as their heartbeats tell); ";
  return fmt::format(
      "every rank answers; the job's data last arrived {:.3g} s ago (at rank {}), {:.3g} s "
      "into the wait; ",
      seconds(now - latest), at, seconds(latest - start));
}

}  // namespace

// Completes every request, polling the control plane. arrival_of[k] = the group member whose
// arrival request k shows (its descriptor), -1 for a transfer. At the deadline — measured from
// the start or from the latest "busy" heartbeat of a member that has not arrived — throws the
// watchdog error: where the wait chains through the members that never arrived end (or, once
// all arrived, the silent members). While it waits, this rank's heartbeats say what it waits
// in and for which ranks. statuses (optional) gets each request's status.
void wait_watched(mpi_communicator::impl& im, int world_size, std::vector<MPI_Request>& reqs,
                  const std::vector<int>& arrival_of, const watched& w,
                  std::vector<MPI_Status>* statuses) {
  if (statuses) statuses->assign(reqs.size(), MPI_Status{});
  const auto start = steady::now();
  // Progress, not wall time alone. End to end: while the job's data keeps arriving at any of
  // its processes (this one's, or what the others' heartbeats say of theirs), the deadline
  // counts from the latest arrival, without bound. And while this host keeps receiving data
  // of any kind (a transport the kernel's TCP counts do not see), a deadline that passes is
  // extended, up to 4 × the deadline in all.
  constexpr std::int64_t moving_bytes = 64 << 10;  ///< per deadline, to count as progress
  constexpr auto tcp_backoff_reach = std::chrono::seconds(3);
  std::int64_t rx_mark = host_rx_bytes(), rx_moved = 0;
  auto progress_at = start;
  // The job's data at each process when this wait began (the peers': at its first heartbeat,
  // so that a short wait copies nothing; or when first heard after), for the slow network's
  // note.
  std::vector<std::int64_t> peer_rx_start;
  auto own_rx_start = im.own_rx;
  bool job_extended = false;  // a passed deadline carried by the job's data still arriving
  const auto period = std::max(std::chrono::milliseconds(50), im.opt.timeout / 4);
  auto next_beat = start + std::min(period, std::chrono::milliseconds(200));
  // Past the deadline, the silent members' hosts are asked once per deadline whether their
  // processes are gone (the host answers, the port refuses: the call can never complete); the
  // extensions below are for members that are slow, not for dead ones.
  auto next_gone_probe = start + w.limit;
  std::string gone_lead;
  int idle = 0;
  std::vector<int> missing;  // world ranks
  for (;;) {
    bool all = true;
    for (std::size_t k = 0; k < reqs.size(); ++k) {
      if (reqs[k] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Status st;
      check_mpi(MPI_Test(&reqs[k], &flag, &st), "MPI_Test");
      if (flag) {
        if (statuses) (*statuses)[k] = st;
      } else {
        all = false;
      }
    }
    if (all) {
      // Finished, but only thanks to extensions granted while data kept arriving: a slow
      // network, which the run's end reports (mpi_communicator::slow_network_note).
      if (progress_at != start || job_extended) {
        const double took = seconds(steady::now() - start);
        auto& sw = im.slow;
        ++sw.count;
        if (took > sw.seconds) {
          sw = {sw.count, fmt::format("{} on '{}'", w.call, w.g.name),
                took,     seconds(w.limit),
                rx_moved, "at this host"};
          if (job_extended) {
            // Where the job's data arrived meanwhile: this process and the ranks that said so.
            std::vector<int> at;
            std::int64_t moved = 0;
            if (im.own_moving_at > start) {
              if (own_rx_start >= 0) moved += im.own_rx - own_rx_start;
              at.push_back(im.me);
            }
            for (std::size_t r = 0; r < im.peer_rx.size(); ++r)
              if (im.peer_moving_at[r] > start) {
                if (r < peer_rx_start.size() && peer_rx_start[r] >= 0)
                  moved += im.peer_rx[r] - peer_rx_start[r];
                at.push_back(static_cast<int>(r));
              }
            sw.bytes = std::max(moved, rx_moved);
            if (at.size() > 8)
              sw.where = fmt::format("at ranks {} and {} more",
                                     fmt::join(at.begin(), at.begin() + 8, ", "), at.size() - 8);
            else if (!at.empty())
              sw.where =
                  fmt::format("at rank{} {}", at.size() == 1 ? "" : "s", fmt::join(at, ", "));
          }
        }
      }
      return;
    }
    poll_control(im);
    const auto now = steady::now();
    if (im.opt.timeout.count() <= 0) {
      if (++idle > 2000) std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    missing.clear();
    auto since = start, member_moving = start;
    for (std::size_t k = 0; k < reqs.size(); ++k)
      if (reqs[k] != MPI_REQUEST_NULL && k < arrival_of.size() && arrival_of[k] >= 0) {
        const int r = w.g.ranks[static_cast<std::size_t>(arrival_of[k])];
        if (std::find(missing.begin(), missing.end(), r) != missing.end()) continue;
        missing.push_back(r);
        const auto m = static_cast<std::size_t>(r);
        since = std::max(since, im.heard_busy[m]);
        // A member alive and inside the data phase of a call every member of it joined (a big
        // gather over a slow link) is making progress elsewhere; the ranks in that transfer
        // watch its peers. Counted like data arriving: up to 4 × the deadline.
        if (alive(im, r, now, w.limit) && im.doing[m].rfind("waiting in ", 0) == 0 &&
            im.doing[m].ends_with(", its data in flight"))
          member_moving = std::max(member_moving, im.heard[m]);
      }
    if (now - start < 4 * w.limit) since = std::max(since, member_moving);
    if (now >= next_beat) {
      if (peer_rx_start.empty()) peer_rx_start = im.peer_rx;
      for (std::size_t r = 0; r < peer_rx_start.size(); ++r)
        if (peer_rx_start[r] < 0) peer_rx_start[r] = im.peer_rx[r];
      send_beats(im, world_size,
                 beat_payload(fmt::format("waiting in {} on '{}'{}", w.call, w.g.name,
                                          w.transfer ? ", its data in flight" : ""),
                              missing));
      if (own_rx_start < 0) own_rx_start = im.own_rx;
      next_beat = now + period;
    }
    since = std::max(since, progress_at);
    if (w.limit.count() > 0 && now >= next_gone_probe && im.opt.probe_budget.count() > 0 &&
        !im.peers.empty()) {
      next_gone_probe = now + w.limit;
      const auto quiet = silent_ranks(im, world_size, now, w.limit);
      // A refused port answers within milliseconds; a host that does not answer at all is the
      // deadline's finding (a crawling link delays a probe too), not this one's.
      if (!quiet.empty())
        if (auto a = assess(im.peers, im.me, quiet,
                            std::min(im.opt.probe_budget, std::chrono::milliseconds(250)));
            !a.gone.empty()) {
          note_findings(im, a);
          gone_lead = std::move(a.lead);
        }
    }
    // A link already seen crawling (a deadline carried by data in this wait, below, or an
    // earlier wait of the run that finished so) also stands still for seconds at a time: a
    // rate limiter drops packets and TCP's retransmission timer backs off between tries (0.2,
    // 0.4, 0.8, 1.6 s …, the silence summing them while tries are lost), one connection at a
    // time. Its silences are judged against the deadline plus that reach; a link that stops
    // is still named within deadline + 5 s of its last data.
    const bool crawling = job_extended || progress_at != start || im.slow.count > 0;
    const auto silence_limit = w.limit + (crawling ? tcp_backoff_reach : steady::duration{});
    if (w.limit.count() > 0 && now - since >= w.limit) {
      // End to end: the job's data still arriving somewhere (at most a deadline ago).
      auto moving = im.own_moving_at;
      for (std::size_t r = 0; r < im.peer_moving_at.size(); ++r)
        if (static_cast<int>(r) != im.me && alive(im, static_cast<int>(r), now, w.limit))
          moving = std::max(moving, im.peer_moving_at[r]);
      if (moving > since && now - moving < silence_limit) {
        job_extended = true;
        since = moving;
      }
    }
    if (w.limit.count() > 0 && now - since >= w.limit && now - start < 4 * w.limit) {
      const auto rx = host_rx_bytes();
      if (rx >= 0 && rx_mark >= 0 && rx - rx_mark >= moving_bytes) {
        rx_moved += rx - rx_mark;
        rx_mark = rx;
        progress_at = now;
        continue;
      }
    }
    if (!gone_lead.empty() || (w.limit.count() > 0 && now - since >= silence_limit)) {
      const double waited = seconds(now - start), limit_s = seconds(w.limit);
      // Network or process: the hosts of the members gone silent are asked.
      // (Every silent rank, not only this group's: a wait chain may end at any of them.)
      const auto quiet = silent_ranks(im, world_size, now, w.limit);
      const auto network =
          !gone_lead.empty() ? gone_lead
          : progress_at != start
              ? fmt::format(
                    "the network is slow: data kept arriving at this host ({:.3g} MiB in "
                    "{:.3g} s) but the call did not finish, the deadline extended to {:.3g} s "
                    "while it did (a slow or congested link; raise --timeout if it is merely "
                    "slow); ",
                    static_cast<double>(rx_moved) / (1 << 20), seconds(progress_at - start),
                    seconds(now - start))
          : quiet.empty() ? last_data_clause(im, start, now)
                          : probe_network(im, quiet);
      std::vector<std::string> who;
      const char* inside = w.arrivals_known
                               ? ": every member arrived, the transfer did not finish"
                               : " (which members arrived is known only with verify_calls)";
      if (!missing.empty() && w.transfer)
        // The data phase: the chain runs through the members whose messages are pending.
        fail<error>(
            "watchdog: {}{} on group {} did not complete within {:.3g} s{}: {}; messages still "
            "pending with ranks {}. A member stopped inside the call (stalled, or stopped by "
            "SIGSTOP) or the network stalls; if the transfer is merely slow, raise --timeout",
            network, w.call, describe(w.g), limit_s, inside,
            chain_summary(im, missing, start, now, w.limit), missing);
      if (!missing.empty()) {
        const auto chains = chain_summary(im, missing, start, now, w.limit);
        std::vector<int> arrived;
        for (int r : missing) {
          who.push_back(describe_member(im, r, start, now, w.limit));
          if (!alive(im, r, now, w.limit)) im.silent[static_cast<std::size_t>(r)] = 1;
        }
        for (int r : w.g.ranks)
          if (std::find(missing.begin(), missing.end(), r) == missing.end()) arrived.push_back(r);
        fail<error>(
            "watchdog: {}{} on group {} waited {:.3g} s (deadline {:.3g} s): {}; members that "
            "never arrived: {}; arrived: ranks {}. A rank that stopped without dying (stalled, "
            "deadlocked, stopped by a debugger or SIGSTOP) or that skipped this call leaves "
            "the others waiting here; if the ranks are merely slow, raise --timeout",
            network, w.call, describe(w.g), waited, limit_s, chains, fmt::join(who, ", "), arrived);
      }
      // Every member arrived (or arrivals are unknown): the wait ends at the members gone
      // silent inside the call.
      for (int r : w.g.ranks)
        if (r != im.me && !alive(im, r, now, w.limit)) {
          who.push_back(fmt::format("the wait ends at {} — rank {} waits for it inside the call",
                                    describe_member(im, r, start, now, w.limit), im.me));
          im.silent[static_cast<std::size_t>(r)] = 1;
        }
      fail<error>(
          "watchdog: {}{} on group {} did not complete within {:.3g} s{}{}. A member stopped "
          "inside the call (stalled, or stopped by SIGSTOP) or the network stalls; if the "
          "transfer is merely slow, raise --timeout",
          network, w.call, describe(w.g), limit_s, inside,
          who.empty() ? "" : fmt::format("; {}", fmt::join(who, "; ")));
    }
    // Spin briefly (small calls finish in microseconds), then back off.
    if (++idle > 2000) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace seqpar::mpi
