#pragma once
// `seqpar check --backend mpi`: one cp rank per MPI process (mpiexec -n U·R).
#include <functional>

#include "core/scenario.hpp"
#include "verify/check.hpp"

namespace seqpar::verify {

/// Runs the check on this process as one rank of mpiexec's world and returns this process's
/// exit code, the same on every rank: 0 all rows pass, 1 a difference, 2 invalid input (the
/// scenario, or a process count other than U·R; printed once, by the lowest failing rank).
/// `resolve` builds the scenario and the options from the flags (each process parses its own
/// argv, identically); `print`
/// is called on rank 0 only with the report. A failure during the run on any rank prints
/// `seqpar: error: rank R on HOST: …` and aborts the whole job (MPI_Abort, exit 2), so no rank
/// is left waiting. Builds without MPI throw config_error saying how to enable it.
int check_mpi(const std::function<scenario(verify::check_options&)>& resolve,
              verify::check_options opt,
              const std::function<void(const verify::check_report&)>& print);

}  // namespace seqpar::verify
