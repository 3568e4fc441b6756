#pragma once
// Network or process? When the watchdog finds a rank silent, the rank's host is asked over
// plain TCP whether it still answers. Every rank listens on a port of its own (never accepting:
// the kernel completes a connection for a listening socket whatever the process does), and the
// ranks exchange where they listen when the communicator is made. A probe then tells three
// cases apart:
//   answers    the host's kernel completed the connection: the host and the network are up and
//              the process still holds its socket — it is stopped, hung or busy, not cut off;
//   refused    the host answered with a reset: the network is up but nothing listens there any
//              more — the process is gone;
//   no_answer  no answer within the budget: the link, the network between, or the host itself
//              is down — not the process.
// No MPI here: the watchdog passes what it knows.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace seqpar::mpi {

/// Where one rank can be asked: its host name and the IPv4 addresses of its host's interfaces
/// that are up (loopback only where it has no other), with the port it listens on.
struct endpoint {
  std::string host;
  std::uint16_t port = 0;
  std::vector<std::uint32_t> ipv4;  ///< network byte order

  /// Fixed-size wire form, for an all-gather: `wire_size` bytes.
  static constexpr std::size_t wire_size = 96;
  void to_wire(char* out) const;
  static endpoint from_wire(const char* in);
  /// "10.77.0.3:41234" (the first address), or "no address".
  std::string where() const;
};

/// The listening socket of this rank (closed on destruction). A host with no usable socket
/// (no IPv4 at all, a sandbox without sockets) yields an endpoint with port 0, and probes of it
/// answer `unknown`.
class liveness_port {
 public:
  explicit liveness_port(std::string host);
  ~liveness_port();
  liveness_port(const liveness_port&) = delete;
  liveness_port& operator=(const liveness_port&) = delete;
  const endpoint& self() const { return self_; }

 private:
  int fd_ = -1;
  endpoint self_;
};

enum class reach { unknown, answers, refused, no_answer };

/// Probes every endpoint at once (each of its addresses; the first answer wins) and waits at
/// most `budget` for all of them.
std::vector<reach> probe(const std::vector<endpoint>& targets, std::chrono::milliseconds budget);

/// What probing the peers of rank `me` found: per world rank (unknown where not probed), the
/// ranks on hosts that gave no answer (cut off: the network), the ranks whose own port refused
/// (gone: their process died, their host is up), and the lead of a message naming them by host
/// ("the network: host h3 (ranks 4, 5) at … gives no answer within 1 s — cut off …; " or, where
/// no other host answers, that this host is the one cut off; "the process: ranks 2, 6 on host
/// h2 are gone — …; "); "" when every probed rank answered.
struct assessment {
  std::vector<reach> found;
  std::vector<int> cut_off, gone;
  std::string lead;
};
/// Probes `ranks` (all other ranks when empty) and one rank of every other host, at once.
assessment assess(const std::vector<endpoint>& peers, int me, const std::vector<int>& ranks,
                  std::chrono::milliseconds budget);

/// Bytes received so far by this host's interfaces other than loopback (/proc/net/dev); -1 where
/// that cannot be read. The watchdog's progress signal: a transfer over a slow link keeps this
/// growing, a stalled one does not.
std::int64_t host_rx_bytes();

/// Bytes this process has received over the TCP connections it holds (the kernel's count per
/// socket, tcp_info's tcpi_bytes_received, summed over /proc/self/fd): the job's own data
/// arriving at this rank from other hosts — other jobs' traffic on the host is not in it, and
/// neither is shared memory within the host. -1 where no TCP socket could be read (a
/// transport without kernel sockets, such as InfiniBand verbs). Connections that closed drop
/// out of the sum: compare readings taken close together.
std::int64_t process_tcp_rx_bytes();

/// What a probe result says, for the watchdog's message: "its host answers and its process
/// holds its socket: stopped or hung, not the network", ….
std::string explain(reach r, const endpoint& e, std::chrono::milliseconds budget);

}  // namespace seqpar::mpi
