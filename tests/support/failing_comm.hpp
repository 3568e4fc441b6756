#pragma once
// A rank that fails mid-run, for the never-hang tests of the MPI backend (tests/mpi).
#include <cstdint>
#include <string>

#include "support/forwarding_communicator.hpp"

namespace seqpar::test {

/// Where and how one rank fails: at the `call`-th (from 0) call of global rank `rank` whose tag
/// equals `tag` (`*` = any call), before the call reaches the transport, so the other ranks are
/// left inside that collective.
struct failure_spec {
  /// throw_error: throws seqpar::error; kill: SIGKILL on its own process; stop: SIGSTOP on its
  /// own process (stalled, not dead: the watchdog's case); stall: this thread sleeps
  /// `stall_ms` before going on (a stalled rank of the in-process backend); mark: tells a test
  /// harness the moment has come by creating `mark_file` (before the call: then waits until
  /// the harness removes it; inside: goes on into the call at once; after: once the call
  /// returned, then waits) — the harness then breaks the network at that moment.
  enum class action { none, throw_error, kill, stop, stall, mark } what = action::none;
  enum class moment { before, inside, after } when = moment::before;
  std::string mark_file;
  int rank = 0;
  std::string tag = "*";
  std::int64_t call = 0;
  std::int64_t stall_ms = 0;
};

/// Parses "R:TAG" or "R:TAG:N" (N = call index among the matches, default 0); throws
/// config_error on anything else.
failure_spec parse_failure(failure_spec::action what, const std::string& text);

/// Forwards every call; at the configured one throws seqpar::error ("injected failure: rank R
/// throws at OP (TAG) on group 'G'") or raises SIGKILL on its own process (stdout and stderr
/// flushed first).
class failing_communicator : public forwarding_communicator {
 public:
  failing_communicator(communicator& inner, failure_spec spec)
      : forwarding_communicator(inner), spec_(std::move(spec)) {}

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                     dtype t) override;
  void do_reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                         dtype t) override;
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override;
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override;
  void do_barrier(const comm_group& g) override;

 private:
  /// Fails here if this call is the configured one; true when it is the call to mark.
  bool maybe_fail(const char* op, const comm_group& g);
  /// After the marked call returned (moment after).
  void after(bool hit);

  failure_spec spec_;
  std::int64_t matches_ = 0;
};

}  // namespace seqpar::test
