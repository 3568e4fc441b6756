#pragma once
// Running detached from a launcher's kill (`seqpar launch`).
//
// MPICH's Hydra kills every rank's process group with SIGKILL, at once, when any proxy of the
// job is lost — a host that dies takes the whole job with it before any survivor can leave a
// flight record. Under `seqpar launch` (which sets SEQPAR_DETACH_FROM_LAUNCHER=1 for the job)
// each rank process splits in two at its start: the process the launcher started stays as a
// shim that forwards signals and exits with the rank's status, and the rank itself runs in a
// session of its own, out of reach of that group kill. A rank whose shim was killed goes on
// until its own watchdog names the lost ranks, writes its record and exits; its launcher
// sentinel (mpi/sentinel.hpp) ends it if it stays stopped or outlives its deadline.
namespace seqpar {

/// The environment variable `seqpar launch` sets for its job.
inline constexpr const char* detach_env = "SEQPAR_DETACH_FROM_LAUNCHER";

/// Where SEQPAR_DETACH_FROM_LAUNCHER=1: splits this process (call first thing in main, before
/// any thread). Returns in the rank (the child, in a new session, SIGPIPE ignored: its output
/// pipes may outlive their reader); the shim never returns. Elsewhere a no-op.
void detach_from_launcher_if_asked();

/// Waits for process `child`, forwarding the signals a launcher sends (SIGINT, SIGTERM, SIGHUP,
/// SIGQUIT, SIGUSR1/2, SIGCONT) to it meanwhile; returns its wait status, or -1 if it cannot be
/// waited for. For one child per process (the shim, `seqpar launch`).
int wait_forwarding_signals(int child);

}  // namespace seqpar
