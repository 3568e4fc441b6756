#pragma once
// A deadline over a blocking phase the MPI watchdog cannot watch: MPI_Init, duplicating the
// world, MPI_Comm_create_group, MPI_Finalize, writing a flight record. Those calls block inside
// MPI or the file system, where no heartbeat is sent and no control message is read; a rank
// that stopped or died leaves the others inside them. A guard needs no MPI: one monitor thread
// per process watches the phases armed, and when one outlives its deadline (and any grace its
// `expiry` gives) it runs the last words (if set), prints
//   seqpar: error: rank R on HOST: watchdog: <phase> did not finish within T s: <hint>
// runs the guard's `before_exit` (if any) and ends the process with exit code 2 (or the code
// the guard names), so that the launcher ends the job.
#include <chrono>
#include <functional>
#include <string>

namespace seqpar::mpi {

class phase_guard {
 public:
  /// Arms a deadline of `limit` (0: none) for `phase` ("MPI_Init", …); `hint` says what the
  /// user sees and can do. Guards nest; each is disarmed by its destructor. `exit_code` other
  /// than 2: the phase follows a finished job whose result stands — the line is a note, and
  /// the process ends with that code.
  /// What a guard may do at its deadline besides printing: `grace` (asked once, on the monitor
  /// thread) may give the phase more time, e.g. when the blocked thread waits on something that
  /// may still come; `before_exit` runs once the line is printed, just before the process ends,
  /// with the thread that armed the guard parked for good by a signal (park_signal): it may use
  /// what that thread was using, except MPI. Both get that thread's kernel id.
  struct expiry {
    std::function<std::chrono::milliseconds(int tid)> grace;
    std::function<void(int tid)> before_exit;
  };
  phase_guard(std::string phase, std::chrono::milliseconds limit, std::string hint,
              int exit_code = 2, expiry at_expiry = {});
  ~phase_guard();
  phase_guard(const phase_guard&) = delete;
  phase_guard& operator=(const phase_guard&) = delete;

  /// Runs on the monitor thread before the process ends (e.g. leaving a flight record), with
  /// the message and the exit code (2: an error; else a note after a finished job); what it
  /// returns is added to the printed line. It must not call MPI. One per process; empty to
  /// clear.
  static void set_last_words(std::function<std::string(const std::string&, int)> f);
  /// Who this process is, for the message before MPI knows (PMI_RANK / PMI_RANK-less launch).
  static void set_rank(int rank);
  /// The signal that parks a guard's thread before its `at_expiry` (its handler never returns).
  static int park_signal();

 private:
  long id_ = 0;
};

}  // namespace seqpar::mpi
