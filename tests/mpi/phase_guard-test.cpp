// phase_guard (src/mpi/phase_guard.hpp) from the failing side: a phase that outlives its limit
// ends the process — with exit code 2 and an error by default, or, for a phase after a finished
// job (MPI_Finalize after the verdict), with the job's own exit code and a note. No MPI needed.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "mpi/phase_guard.hpp"

namespace {

using seqpar::mpi::phase_guard;
using namespace std::chrono_literals;

void outlive(int exit_code) {
  const phase_guard guard("the test phase", 100ms, "what the user can do", exit_code);
  std::this_thread::sleep_for(5s);
}

TEST(phase_guard_death, a_phase_past_its_limit_is_an_error_with_exit_code_2) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(outlive(2), testing::ExitedWithCode(2),
              "seqpar: error: .*watchdog: the test phase did not finish within 0.1 s: what the "
              "user can do");
}

TEST(phase_guard_death, after_a_finished_job_it_ends_with_the_jobs_code_and_a_note) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(outlive(0), testing::ExitedWithCode(0),
              "seqpar: note: .*watchdog: the test phase did not finish within 0.1 s");
  EXPECT_EXIT(outlive(1), testing::ExitedWithCode(1), "seqpar: note: ");
}

TEST(phase_guard, a_phase_within_its_limit_ends_nothing) {
  { const phase_guard guard("a quick phase", 2000ms, "unused", 0); }
  std::this_thread::sleep_for(200ms);
  SUCCEED();
}

}  // namespace
