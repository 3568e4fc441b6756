// The in-process watchdog and flight records (issue 18): a rank that stalls, or throws, at each
// stage of the SP step (test-side communicator wrapper, tests/support/failing_comm.hpp) ends the
// in-process check with the stalled rank named within the deadline, every rank's flight record
// is written, and `replay` on the records names the same rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <string>

#include "core/error.hpp"
#include "support/failing_comm.hpp"
#include "trace/flight.hpp"
#include "trace/replay.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;
namespace fs = std::filesystem;

scenario hybrid() {
  scenario s;
  s.name = "flight";
  s.ulysses = 2;
  s.ring = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 8;
  s.hidden = 32;
  s.intermediate = 48;
  s.vocab = 40;
  s.layers = 1;
  s.docs = {12, 16};
  return s;
}

struct scratch {
  fs::path dir;
  explicit scratch(const std::string& name)
      : dir(fs::temp_directory_path() /
            fmt::format("seqpar-flight-test-{}-{}", name,
                        std::chrono::steady_clock::now().time_since_epoch().count())) {}
  ~scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

replay::report replay_dir(const fs::path& dir) {
  std::istringstream merged(trace::merge_traces(trace::trace_files(dir.string())).text());
  trace::reader in(merged, dir.string());
  return replay::run(in);
}

// The replay's first finding names `rank`: the rank whose own error ended the run, or the first
// MISSING_RANK finding is about it, or, at a point-to-point step, the first unmatched message
// waits for it.
void expect_replay_names(const fs::path& dir, int rank, int world) {
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(fs::exists(dir / fmt::format("rank-{}.jsonl", r))) << "rank " << r;
  const auto rep = replay_dir(dir);
  EXPECT_FALSE(rep.consistent);
  std::string all;
  for (const auto& p : rep.problems) all += p.message() + "\n";
  for (const auto& p : rep.problems) {
    if (p.category == replay::category::rank_failed) {
      EXPECT_EQ(p.rank, rank) << all;
      return;
    }
    if (p.category == replay::category::missing_rank) {
      EXPECT_EQ(p.rank, rank) << all;
      return;
    }
    if (p.category == replay::category::p2p_mismatch) {
      EXPECT_NE(p.cause.find(fmt::format("rank {} never posted", rank)), std::string::npos) << all;
      return;
    }
  }
  ADD_FAILURE() << "no hang finding:\n" << all;
}

// Each stage of the hybrid step where a rank can fail (tags of its calls).
const char* const stages[] = {"L0.attn.q.fwd", "L0.attn.ring.fwd.step0", "loss.sum",
                              "L0.attn.out.bwd"};

TEST(Flight, StalledRankIsNamedAtEveryStage) {
  for (const char* stage : stages) {
    SCOPED_TRACE(stage);
    scratch tmp("stall");
    verify::check_options opt;
    opt.timeout = std::chrono::milliseconds(300);
    opt.flight_dir = tmp.dir.string();
    test::failure_spec spec;
    spec.what = test::failure_spec::action::stall;
    spec.rank = 3;
    spec.tag = stage;
    spec.stall_ms = 1500;
    opt.wrap_communicator = [spec](communicator& inner) -> std::unique_ptr<communicator> {
      return std::make_unique<test::failing_communicator>(inner, spec);
    };
    const auto t0 = std::chrono::steady_clock::now();
    try {
      verify::run_check(hybrid(), opt);
      ADD_FAILURE() << "the check did not fail";
    } catch (const error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("watchdog"), std::string::npos) << what;
      // Named directly or at the end of a chain ("rank 2 (waiting in …), which waits for
      // rank 3 (…)").
      EXPECT_NE(what.find("rank 3 (busy in its own code, in no call)"), std::string::npos) << what;
      EXPECT_NE(what.find("seqpar replay"), std::string::npos) << what;
    }
    // The watchdog fired at 300 ms; the run ends once the stalled thread wakes (1.5 s).
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    expect_replay_names(tmp.dir, 3, 4);
  }
}

TEST(Flight, ThrowingRankIsNamedAtEveryStage) {
  for (const char* stage : stages) {
    SCOPED_TRACE(stage);
    scratch tmp("throw");
    verify::check_options opt;
    opt.flight_dir = tmp.dir.string();
    test::failure_spec spec;
    spec.what = test::failure_spec::action::throw_error;
    spec.rank = 1;
    spec.tag = stage;
    opt.wrap_communicator = [spec](communicator& inner) -> std::unique_ptr<communicator> {
      return std::make_unique<test::failing_communicator>(inner, spec);
    };
    EXPECT_THROW(verify::run_check(hybrid(), opt), error);
    expect_replay_names(tmp.dir, 1, 4);
  }
}

TEST(Flight, NoRecordWithoutFailureOrWithoutDirectory) {
  scratch tmp("none");
  verify::check_options opt;
  opt.flight_dir = tmp.dir.string();
  EXPECT_TRUE(verify::run_check(hybrid(), opt).pass);
  EXPECT_FALSE(fs::exists(tmp.dir));
}

}  // namespace
