#pragma once
// The MPI communicator's state (mpi_communicator::impl) and the watchdog's interface to it: the
// control plane's heartbeats and the watched waits (watchdog.cpp), used by every call of the
// communicator (mpi_comm.cpp). Internal to src/mpi.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mpi/mpi_comm.hpp"
#include "mpi/reachability.hpp"

namespace seqpar::mpi {

/// The point-to-point messages of one call on a group, posted and not yet complete: per
/// request, the group member it receives from (-1: a send) and the elements it must bring.
struct posted {
  std::vector<MPI_Request> reqs;
  std::vector<int> from;  ///< receives: the member it is from; sends: -1
  std::vector<int> peer;  ///< the member at the other end (sends and receives)
  std::vector<MPI_Count> expect;
};

struct mpi_communicator::impl {
  /// A group's calls are point-to-point messages on `world` under the group's own tags (data,
  /// and data + 1 for the call descriptors): no communicator is created for it, so no blocking
  /// MPI call (MPI_Comm_create_group) stands between the members and the watchdog.
  struct group_entry {
    std::vector<int> ranks;
    int tag = 0;             ///< data messages; tag + 1: call descriptors
    std::int64_t calls = 0;  ///< calls made on this group, for messages
  };
  int tag_ub = 32767;                    ///< MPI_TAG_UB of the world
  std::map<int, std::string> tag_owner;  ///< group tags in use by this rank

  mpi_options opt;
  MPI_Comm world = MPI_COMM_NULL;
  /// The control plane, a duplicate of the world: heartbeats, abort notices and their
  /// acknowledgements, polled by every watched wait.
  MPI_Comm ctl = MPI_COMM_NULL;
  int me = 0;
  std::map<std::string, group_entry> groups;
  /// Per world rank: when it last sent a heartbeat, when it last said it was busy (local
  /// work the others wait for), and what it said it was doing.
  std::vector<std::chrono::steady_clock::time_point> heard, heard_busy;
  std::vector<std::string> doing;
  /// Per world rank: the ranks it said it waits for (members of its call that had not arrived;
  /// empty when it is busy, or waits in a transfer every member has joined). The watchdog
  /// follows these to the end of a wait chain.
  std::vector<std::vector<int>> waits_for;
  /// Progress end to end. Every heartbeat carries the job's data that has arrived at the
  /// sender's process (process_tcp_rx_bytes less the control plane's own messages from other
  /// hosts, ctl_rx): per world rank, the last count heard (-1: none) and when it last grew by
  /// moving_per_beat or more from one heartbeat to the next; this rank's own, sampled at its
  /// heartbeats. A wait whose deadline passes while data arrives anywhere in the job is extended.
  /// (`*_rx`: the latest count; `*_rx_mark`: the count the next growth is measured from.)
  std::vector<std::int64_t> peer_rx, peer_rx_mark;
  std::vector<std::chrono::steady_clock::time_point> peer_moving_at;
  std::int64_t own_rx = -1, own_rx_mark = -1;
  std::chrono::steady_clock::time_point own_moving_at{};
  std::int64_t ctl_rx = 0;  ///< bytes of control messages received from other hosts
  /// Waits that outlived their deadline because data kept arriving (a slow link): how many,
  /// and the longest (its call, seconds, deadline, bytes that arrived meanwhile and where).
  struct slow_wait {
    int count = 0;
    std::string call;
    double seconds = 0, limit = 0;
    std::int64_t bytes = 0;
    std::string where;  ///< "at this host", "at ranks 3, 7"
  } slow;
  std::vector<char> acked;   ///< per world rank (announce_abort)
  std::vector<char> silent;  ///< per world rank: named silent by this rank's watchdog
  /// Network or process (reachability.hpp): this rank's listening port, every rank's endpoint
  /// (exchanged when the communicator is made), and what the last probe found per world rank
  /// (unknown: not probed).
  std::unique_ptr<liveness_port> port;
  std::vector<endpoint> peers;
  std::vector<reach> reached;
  std::vector<int> cut_off;  ///< world ranks on hosts the last probe found unreachable
  /// Heartbeats in flight, with their payloads (kept until each send completes).
  struct beat {
    std::string text;
    MPI_Request request = MPI_REQUEST_NULL;
    int peer = 0;
  };
  std::list<beat> beats_out;
  std::string notice;  ///< abort notice payload
  const char ack = 1;  ///< acknowledgement payload
  /// A nonblocking all_to_all started and not yet waited: its request, the count and
  /// displacement arrays MPI may read until it completes, and what the watchdog's messages
  /// name (the group by value: the caller's may be gone by the wait).
  struct pending_op {
    posted p;
    dtype type = dtype::f64;
    int me = 0;  ///< this rank's index in the group
    comm_group group;
    std::string call;                    ///< "nonblocking all_to_all #3 (L0.attn.q.fwd)"
    std::chrono::milliseconds limit{0};  ///< the watchdog's deadline; 0 = none
    bool arrivals_known = false;         ///< verify_calls: every member arrived at start
  };
  std::map<std::int64_t, pending_op> pending;  ///< by token (do_start_all_to_all's)
  std::int64_t next_token = 0;

  ~impl() {
    if (!mpi_active()) return;
    // Heartbeats still in flight: a moment to leave, then MPI keeps their buffers (leaked on
    // purpose: a request may not outlive its buffer). Heartbeats received but not read are
    // drained, so no message is left on the control plane.
    // Nonblocking calls never waited (or whose wait failed) get the same moment; those still
    // in flight then keep their arrays (leaked on purpose: MPI may read them until the call
    // completes, and a nonblocking collective's request may not be freed).
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while ((!beats_out.empty() || !pending.empty()) && std::chrono::steady_clock::now() < until) {
      for (auto it = beats_out.begin(); it != beats_out.end();) {
        int flag = 0;
        MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
        it = flag ? beats_out.erase(it) : std::next(it);
      }
      for (auto it = pending.begin(); it != pending.end();) {
        int flag = 0;
        auto& rq = it->second.p.reqs;
        if (MPI_Testall(static_cast<int>(rq.size()), rq.data(), &flag, MPI_STATUSES_IGNORE) !=
            MPI_SUCCESS)
          flag = 1;
        it = flag ? pending.erase(it) : std::next(it);
      }
    }
    if (!beats_out.empty()) {
      auto* kept = new std::list<beat>(std::move(beats_out));
      for (auto& b : *kept) MPI_Request_free(&b.request);
    }
    if (!pending.empty()) new std::map<std::int64_t, pending_op>(std::move(pending));
    if (ctl != MPI_COMM_NULL)
      for (int flag = 1; flag;) {
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, ctl, &flag, &st) != MPI_SUCCESS) break;
        if (!flag) break;
        int n = 0;
        MPI_Get_count(&st, MPI_CHAR, &n);
        std::string text(static_cast<std::size_t>(std::max(n, 0)), '\0');
        MPI_Recv(text.data(), n, MPI_CHAR, st.MPI_SOURCE, st.MPI_TAG, ctl, MPI_STATUS_IGNORE);
      }
    if (ctl != MPI_COMM_NULL) MPI_Comm_free(&ctl);
    if (world != MPI_COMM_NULL) MPI_Comm_free(&world);
  }
};

using steady = std::chrono::steady_clock;
constexpr int tag_heartbeat = 1, tag_abort = 2, tag_ack = 3;  ///< on the control plane
/// The job's data at a process counts as moving when it grew by moving_per_beat or more from
/// one heartbeat to the next (≥ 1 Mbit/s at the shortest period, 50 ms; far less at long
/// deadlines); a control message from another host is counted as its payload plus
/// ctl_framing_bytes of the transport's headers.
constexpr std::int64_t moving_per_beat = 4 << 10, ctl_framing_bytes = 128;

inline double seconds(steady::duration d) { return std::chrono::duration<double>(d).count(); }

/// "'ring0' [0, 2]": a group as messages name it.
std::string describe(const comm_group& g);

// Tells every other rank `what` (a heartbeat). A peer that does not take its heartbeats (a
// stopped process) gets no more once 64 are outstanding to it; the others still get theirs.
void send_beats(mpi_communicator::impl& im, int world_size, const std::string& what);

// Receives whatever the control plane holds: heartbeats (noted), acknowledgements (noted),
// an abort notice (peer_abort, unless `in_announce`: then it counts as an acknowledgement).
void poll_control(mpi_communicator::impl& im, bool in_announce = false);

// What a watched wait waits for.
struct watched {
  const comm_group& g;
  std::string call;                 ///< "all_to_all #3 (L0.attn.q.fwd)"
  std::chrono::milliseconds limit;  ///< the deadline (scaled); 0 = none
  bool arrivals_known;              ///< verify_calls: descriptor receipts show who arrived
  /// The data phase of a call (arrival_of then names the member at the other end of each
  /// message, not one that has not arrived).
  bool transfer = false;
};

// Completes every request, polling the control plane. arrival_of[k] = the group member whose
// arrival request k shows (its descriptor), -1 for a transfer. At the deadline — measured from
// the start or from the latest "busy" heartbeat of a member that has not arrived — throws the
// watchdog error: where the wait chains through the members that never arrived end (or, once
// all arrived, the silent members). While it waits, this rank's heartbeats say what it waits
// in and for which ranks. statuses (optional) gets each request's status.
void wait_watched(mpi_communicator::impl& im, int world_size, std::vector<MPI_Request>& reqs,
                  const std::vector<int>& arrival_of, const watched& w,
                  std::vector<MPI_Status>* statuses = nullptr);

}  // namespace seqpar::mpi
