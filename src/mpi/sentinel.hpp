#pragma once
// A rank never outlives its job: the launcher sentinel.
//
// mpiexec (MPICH's Hydra) ends a job whose rank called MPI_Abort by killing its own children,
// the per-host launcher proxies; the ranks, each in a session of its own, are killed by their
// proxy only while the proxy lives. A rank that is stopped (SIGSTOP, a debugger's stop) when its
// proxy goes cannot end itself — no thread of it runs — and it held mpiexec (its output pipes)
// for as long as it stayed stopped: the job never ended.
//
// The sentinel is a small process forked before MPI starts (it never touches MPI and holds none
// of the rank's descriptors). It watches the rank through /proc: once the rank's launcher is
// gone (the rank re-parented), a stopped rank is killed at once, and any rank still there after
// a grace (its own watchdog ends a running one within its deadline, writing its flight record)
// is killed then. It ends with the rank.
//
// And a rank stopped after its job has finished — past the last barrier, where its result
// already stands, typically inside MPI_Finalize — holds mpiexec just the same while its launcher
// lives: the other ranks end (their teardown guard), mpiexec waits for this one forever. Once
// the rank has said it passed its last barrier (note_job_finished), the sentinel resumes it
// (SIGCONT) when it stays stopped for finished_stop_grace: its guards of the last steps have
// expired meanwhile, so it ends at once with the job's result, and mpiexec with the verdict's
// exit code. One still there finished_resume_grace later (stopped again, or held by a tracer,
// which SIGCONT does not release) is killed: nothing a debugger could want is left to see there.
#include <chrono>

namespace seqpar::mpi {

/// Starts the sentinel for this process (once; no-op where /proc is missing). grace: how long a
/// running rank may outlive its launcher before the sentinel kills it.
void start_launcher_sentinel(std::chrono::milliseconds grace);

/// Where mpiexec did not end the job after this rank asked it to (MPI_Abort): ends this rank's
/// launcher proxy (MPICH's hydra_pmi_proxy, this process's parent; nothing else is touched).
/// mpiexec, losing a proxy, ends the whole job, and every other proxy kills its ranks — stopped
/// ones too, which a job that only exits with an error code leaves waiting forever (Hydra ends
/// a job at once for a rank killed by a signal, not for one that exits non-zero). Returns
/// whether a proxy was found and signalled.
bool end_launcher_proxy();

/// A rank that failed ends within `limit` whatever the transport does meanwhile: a detached
/// thread that, should the process still be there after `limit`, writes `note` to stderr
/// without blocking (the pipe's reader may be gone or stalled, and another thread may hold
/// stdio's lock inside a blocked write) and ends it with `code`. For the failure paths, whose
/// every step has a bound of its own — a send to a dead peer or an abort that the launcher never
/// answers can still hold an MPI call past them.
void end_within(std::chrono::milliseconds limit, int code, const char* note);

/// How long a rank that passed its last barrier may stay stopped before its sentinel kills it:
/// the other ranks' MPI_Finalize guard (10 s), so that the whole job ends at about the moment
/// they do.
inline constexpr std::chrono::seconds finished_stop_grace{10};

/// How long a rank resumed after finished_stop_grace may take to end before its sentinel kills
/// it: more than its own longest guard of the last steps (MPI_Finalize's 10 s, extended by 10 s
/// while it waits on its launcher's socket, then 2 s for the launcher's answer).
inline constexpr std::chrono::seconds finished_resume_grace{15};

/// This rank's job has its result (every rank holds the verdict, or passed the last barrier):
/// from now on its sentinel resumes it if it stays stopped for finished_stop_grace (and kills it
/// if it has not ended finished_resume_grace later). No-op without a sentinel.
void note_job_finished();

}  // namespace seqpar::mpi
