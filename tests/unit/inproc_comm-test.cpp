// The in-process communicator and the fault-injecting wrapper. Data are index-derived (as in
// nccl-tests): element values are a function of (seed, rank, global index), so every rank
// computes the block it expects and the tests count wrong elements.
#include "sim/inproc_comm.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "sim/faulty_comm.hpp"
#include "support/comm_values.hpp"

namespace {

using namespace seqpar;
using namespace seqpar::test;
using namespace std::chrono_literals;

/// An op_info carrying only a tag.
op_info tagged(std::string tag) {
  op_info info;
  info.tag = std::move(tag);
  return info;
}

comm_group make_group(std::string name, std::vector<int> ranks) {
  return comm_group{std::move(name), std::move(ranks)};
}

/// How this program's worlds carry their ranks: tests/unit/meson.build runs it three times,
/// with SEQPAR_TEST_CARRIERS unset (one thread per rank), 1 and 2 (the ranks as fibers on that
/// many threads, thread_world::set_carriers).
int test_carriers() {
  static const int carriers = [] {
    const char* e = std::getenv("SEQPAR_TEST_CARRIERS");
    return e ? std::atoi(e) : 0;
  }();
  return carriers;
}

/// seqpar::run_ranks on a world carried as test_carriers() says.
void run_test_ranks(int P, const std::function<void(communicator&)>& body,
                    comm_recorder* recorder = nullptr) {
  inproc_world world(P);
  world.set_carriers(test_carriers());
  seqpar::run_ranks(world, body, recorder);
}

/// World, world in reverse order, evens ({0,2,4,6}), odds, Ulysses-like pairs and the upper
/// half: disjoint groups run their collectives concurrently.
std::vector<comm_group> test_groups(int P) {
  std::vector<comm_group> gs;
  std::vector<int> all(P);
  std::iota(all.begin(), all.end(), 0);
  gs.push_back(make_group("world", all));
  gs.push_back(make_group("world_rev", std::vector<int>(all.rbegin(), all.rend())));
  std::vector<int> even, odd;
  for (int r = 0; r < P; ++r) (r % 2 ? odd : even).push_back(r);
  gs.push_back(make_group("even", even));
  if (!odd.empty()) gs.push_back(make_group("odd", odd));
  for (int r = 0; r + 1 < P; r += 2)
    gs.push_back(make_group(fmt::format("ulysses{}", r / 2), {r, r + 1}));
  gs.push_back(make_group("upper", std::vector<int>(all.begin() + P / 2, all.end())));
  return gs;
}

// Elements member i sends to member j in the uneven all_to_all (zeros included).
/// Runs body(c, g, gi, me) on every rank for every test group it belongs to (gi the group's
/// index, me the rank's index in it); body returns how many received elements were wrong.
template <class Body>
void on_every_group(int P, dtype t, const Body& body) {
  std::atomic<std::int64_t> wrong{0};
  run_test_ranks(P, [&](communicator& c) {
    const auto groups = test_groups(P);
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      const int me = groups[gi].index_of(c.rank());
      if (me >= 0) wrong += body(c, groups[gi], static_cast<std::int64_t>(gi), me);
    }
  });
  EXPECT_EQ(wrong, 0) << "P=" << P << " dtype=" << dtype_name(t);
}

std::int64_t a2a_count(std::uint64_t seed, int i, int j) {
  return static_cast<std::int64_t>((seed + 3 * i + 5 * j + i * j) % 4);
}

template <class T>
void check_all_to_all(int P, dtype t, std::uint64_t seed) {
  std::atomic<std::int64_t> checked{0};
  on_every_group(P, t, [&](communicator& c, const comm_group& g, std::int64_t gi, int me) {
    const int n = g.size();
    std::vector<std::int64_t> sc(n), rc(n);
    std::vector<T> send, want;
    for (int j = 0; j < n; ++j) {
      sc[j] = a2a_count(seed, me, j);
      rc[j] = a2a_count(seed, j, me);
      for (std::int64_t k = 0; k < sc[j]; ++k)
        send.push_back(value<T>(seed, c.rank(), gi * 1000000 + j * 1000 + k));
      for (std::int64_t k = 0; k < rc[j]; ++k)
        want.push_back(value<T>(seed, g.ranks[j], gi * 1000000 + me * 1000 + k));
    }
    std::vector<T> recv(want.size());
    c.all_to_all(g, send.data(), sc, recv.data(), rc, t, tagged("a2a"));
    checked += static_cast<std::int64_t>(want.size());
    return count_wrong(recv, want);
  });
  if (P > 1) {
    EXPECT_GT(checked, 0);
  }
}

template <class T>
void check_all_gather(int P, dtype t, std::uint64_t seed) {
  on_every_group(P, t, [&](communicator& c, const comm_group& g, std::int64_t gi, int) {
    const std::int64_t count = 1 + static_cast<std::int64_t>(gi % 3);
    std::vector<T> send(count), want;
    for (std::int64_t k = 0; k < count; ++k) send[k] = value<T>(seed, c.rank(), gi * 100 + k);
    for (int r : g.ranks)
      for (std::int64_t k = 0; k < count; ++k) want.push_back(value<T>(seed, r, gi * 100 + k));
    std::vector<T> recv(want.size());
    c.all_gather(g, send.data(), count, recv.data(), t);
    return count_wrong(recv, want);
  });
}

// The sum of `terms` left to right: the order the communicator promises.
template <class T>
T sum_in_order(const std::vector<T>& terms) {
  T acc = terms[0];
  for (std::size_t i = 1; i < terms.size(); ++i) acc = acc + terms[i];
  return acc;
}

template <class T>
void check_reduce_scatter(int P, dtype t, std::uint64_t seed) {
  on_every_group(P, t, [&](communicator& c, const comm_group& g, std::int64_t gi, int me) {
    const int n = g.size();
    const std::int64_t count = 5;
    std::vector<T> send(n * count), want(count), recv(count);
    for (std::int64_t i = 0; i < n * count; ++i) send[i] = value<T>(seed, c.rank(), gi * 100 + i);
    for (std::int64_t k = 0; k < count; ++k) {
      std::vector<T> terms;
      for (int r : g.ranks) terms.push_back(value<T>(seed, r, gi * 100 + me * count + k));
      want[k] = sum_in_order(terms);
    }
    c.reduce_scatter(g, send.data(), recv.data(), count, t);
    return count_wrong(recv, want);
  });
}

template <class T>
void check_all_reduce(int P, dtype t, std::uint64_t seed) {
  on_every_group(P, t, [&](communicator& c, const comm_group& g, std::int64_t gi, int) {
    const std::int64_t count = 7;
    std::vector<T> buf(count), want(count);
    for (std::int64_t k = 0; k < count; ++k) {
      buf[k] = value<T>(seed, c.rank(), gi * 100 + k);
      std::vector<T> terms;
      for (int r : g.ranks) terms.push_back(value<T>(seed, r, gi * 100 + k));
      want[k] = sum_in_order(terms);
    }
    c.all_reduce(g, buf.data(), count, t);
    return count_wrong(buf, want);
  });
}

// Each member sends two messages (3 + me % 2 and me elements) to the next member of the ring
// and receives the previous member's two, in posting order.
template <class T>
void check_send_recv(int P, dtype t, std::uint64_t seed) {
  on_every_group(P, t, [&](communicator& c, const comm_group& g, std::int64_t gi, int me) {
    const int n = g.size();
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    auto len = [](int member, int msg) -> std::int64_t {
      return msg == 0 ? 3 + member % 2 : member;
    };
    std::vector<std::vector<T>> out(2), in(2), want(2);
    for (int m = 0; m < 2; ++m) {
      for (std::int64_t k = 0; k < len(me, m); ++k)
        out[m].push_back(value<T>(seed, c.rank(), gi * 100 + m * 10 + k));
      for (std::int64_t k = 0; k < len(prev, m); ++k)
        want[m].push_back(value<T>(seed, g.ranks[prev], gi * 100 + m * 10 + k));
      in[m].resize(want[m].size());
    }
    std::vector<p2p_op> ops;
    for (int m = 0; m < 2; ++m) {
      ops.push_back({p2p_op::kind::recv, prev, in[m].data(), len(prev, m), {}});
      ops.push_back({p2p_op::kind::send, next, out[m].data(), len(me, m), {}});
    }
    c.send_recv(g, ops, t, tagged("ring"));
    return count_wrong(in[0], want[0]) + count_wrong(in[1], want[1]);
  });
}

template <class T>
void check_every_op(dtype t) {
  for (int P = 1; P <= 8; ++P) {
    const std::uint64_t seed = 17 + P;
    check_all_to_all<T>(P, t, seed);
    check_all_gather<T>(P, t, seed);
    check_reduce_scatter<T>(P, t, seed);
    check_all_reduce<T>(P, t, seed);
    check_send_recv<T>(P, t, seed);
  }
}

TEST(inproc_comm, every_op_on_world_and_subgroups_f64) { check_every_op<double>(dtype::f64); }
TEST(inproc_comm, every_op_on_world_and_subgroups_f32) { check_every_op<float>(dtype::f32); }
TEST(inproc_comm, every_op_on_world_and_subgroups_i32) { check_every_op<std::int32_t>(dtype::i32); }
TEST(inproc_comm, every_op_on_world_and_subgroups_i64) { check_every_op<std::int64_t>(dtype::i64); }

TEST(inproc_comm, bf16_moves_as_raw_bytes) {
  for (int P : {1, 3, 8}) {
    check_all_to_all<std::uint16_t>(P, dtype::bf16, 5);
    check_all_gather<std::uint16_t>(P, dtype::bf16, 5);
    check_send_recv<std::uint16_t>(P, dtype::bf16, 5);
  }
}

TEST(inproc_comm, bf16_reduction_is_a_clear_error) {
  try {
    run_test_ranks(2, [](communicator& c) {
      std::uint16_t x[2] = {0, 0};
      c.all_reduce(make_group("world", {0, 1}), x, 2, dtype::bf16);
    });
    FAIL() << "expected an error";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos) << e.what();
  }
}

TEST(inproc_comm, all_to_all_with_all_counts_zero_to_one_peer) {
  // Member 1 receives nothing from anyone and sends nothing: empty chunks in the middle.
  std::atomic<std::int64_t> wrong{0};
  run_test_ranks(3, [&](communicator& c) {
    const auto g = make_group("world", {0, 1, 2});
    const int me = c.rank();
    auto cnt = [](int i, int j) -> std::int64_t { return i == 1 || j == 1 ? 0 : 2 + i; };
    std::vector<std::int64_t> sc(3), rc(3);
    std::vector<double> send, want;
    for (int j = 0; j < 3; ++j) {
      sc[j] = cnt(me, j), rc[j] = cnt(j, me);
      for (int k = 0; k < sc[j]; ++k) send.push_back(value<double>(1, me, j * 10 + k));
      for (int k = 0; k < rc[j]; ++k) want.push_back(value<double>(1, j, me * 10 + k));
    }
    std::vector<double> recv(want.size());
    c.all_to_all(g, send.data(), sc, recv.data(), rc, dtype::f64);
    wrong += count_wrong(recv, want);
  });
  EXPECT_EQ(wrong, 0);
}

TEST(inproc_comm, in_place_all_gather_and_aliased_all_to_all) {
  std::atomic<std::int64_t> wrong{0};
  run_test_ranks(4, [&](communicator& c) {
    const auto g = make_group("world", {0, 1, 2, 3});
    // NCCL-style in-place all_gather: the send block is this rank's block of recv.
    std::vector<float> buf(4 * 3), want;
    for (int k = 0; k < 3; ++k) buf[c.rank() * 3 + k] = value<float>(2, c.rank(), k);
    for (int r = 0; r < 4; ++r)
      for (int k = 0; k < 3; ++k) want.push_back(value<float>(2, r, k));
    c.all_gather(g, buf.data() + c.rank() * 3, 3, buf.data(), dtype::f32);
    wrong += count_wrong(buf, want);
    // all_to_all with recv == send.
    std::vector<std::int64_t> counts(4, 2);
    std::vector<std::int32_t> x(8), w(8);
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 2; ++k) {
        x[j * 2 + k] = value<std::int32_t>(3, c.rank(), j * 2 + k);
        w[j * 2 + k] = value<std::int32_t>(3, j, c.rank() * 2 + k);
      }
    c.all_to_all(g, x.data(), counts, x.data(), counts, dtype::i32);
    wrong += count_wrong(x, w);
  });
  EXPECT_EQ(wrong, 0);
}

TEST(inproc_comm, barrier_orders_writes_before_reads) {
  constexpr int P = 6;
  std::vector<std::atomic<int>> stage(P);
  std::atomic<int> early{0};
  run_test_ranks(P, [&](communicator& c) {
    std::vector<int> all(P);
    std::iota(all.begin(), all.end(), 0);
    const auto g = make_group("world", all);
    std::mt19937 rng(c.rank());
    for (int round = 1; round <= 20; ++round) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
      stage[c.rank()].store(round);
      c.barrier(g);
      for (int r = 0; r < P; ++r) early += stage[r].load() < round;
      c.barrier(g);
    }
  });
  EXPECT_EQ(early, 0);
}

TEST(inproc_comm, disjoint_groups_run_concurrently) {
  // Ranks {0,1} reduce on ulysses0 while {2,3} reduce on ulysses1 and rings {0,2}, {1,3}
  // exchange, interleaved; ulysses1 is slowed down so the groups are out of step.
  std::atomic<std::int64_t> wrong{0};
  run_test_ranks(4, [&](communicator& c) {
    const int r = c.rank();
    const auto ulysses = make_group(fmt::format("ulysses{}", r / 2), {r / 2 * 2, r / 2 * 2 + 1});
    const auto ring = make_group(fmt::format("ring{}", r % 2), {r % 2, r % 2 + 2});
    std::mt19937 rng(r);
    for (int it = 0; it < 100; ++it) {
      if (r >= 2) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 100));
      std::int64_t x[3] = {r * 1000 + it, it, 1};
      c.all_reduce(ulysses, x, 3, dtype::i64);
      const std::int64_t base = ulysses.ranks[0] * 1000 + ulysses.ranks[1] * 1000;
      wrong += x[0] != base + 2 * it || x[1] != 2 * it || x[2] != 2;
      double mine = r + it * 0.5, theirs = -1;
      const int peer = ring.index_of(r) ^ 1;
      std::vector<p2p_op> ops{{p2p_op::kind::send, peer, &mine, 1, {}},
                              {p2p_op::kind::recv, peer, &theirs, 1, {}}};
      c.send_recv(ring, ops, dtype::f64);
      wrong += theirs != ring.ranks[peer] + it * 0.5;
    }
  });
  EXPECT_EQ(wrong, 0);
}

// ---- determinism ----

TEST(inproc_comm, reductions_are_bitwise_reproducible_under_random_schedules) {
  constexpr int P = 8, count = 257, reps = 20;
  std::vector<std::vector<float>> ar(reps * P), rs(reps * P);
  std::vector<float> want_ar(count), want_rs(P * 4);
  for (int k = 0; k < count; ++k) {
    std::vector<float> terms;
    for (int r = 0; r < P; ++r) terms.push_back(value<float>(9, r, k));
    want_ar[k] = sum_in_order(terms);
  }
  for (int k = 0; k < P * 4; ++k) {
    std::vector<float> terms;
    for (int r = 0; r < P; ++r) terms.push_back(value<float>(9, r, 1000 + k));
    want_rs[k] = sum_in_order(terms);
  }
  for (int rep = 0; rep < reps; ++rep) {
    run_test_ranks(P, [&](communicator& c) {
      std::vector<int> all(P);
      std::iota(all.begin(), all.end(), 0);
      const auto g = make_group("world", all);
      std::mt19937 rng(rep * 131 + c.rank());
      std::vector<float> buf(count), send(P * 4), recv(4);
      for (int k = 0; k < count; ++k) buf[k] = value<float>(9, c.rank(), k);
      for (int k = 0; k < P * 4; ++k) send[k] = value<float>(9, c.rank(), 1000 + k);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
      c.all_reduce(g, buf.data(), count, dtype::f32);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
      c.reduce_scatter(g, send.data(), recv.data(), 4, dtype::f32);
      ar[rep * P + c.rank()] = buf;
      rs[rep * P + c.rank()] = recv;
    });
  }
  for (int rep = 0; rep < reps; ++rep)
    for (int r = 0; r < P; ++r) {
      EXPECT_EQ(count_wrong(ar[rep * P + r], want_ar), 0) << "rep " << rep << " rank " << r;
      std::vector<float> want(want_rs.begin() + r * 4, want_rs.begin() + r * 4 + 4);
      EXPECT_EQ(count_wrong(rs[rep * P + r], want), 0) << "rep " << rep << " rank " << r;
    }
}

TEST(inproc_comm, sum_order_is_group_order_not_rank_order) {
  // In float32 (1e8 + -1e8) + 1 = 1 but (1 + -1e8) + 1e8 = 0: group {2, 1, 0} must give 1.
  const float v[3] = {1.0f, -1e8f, 1e8f};  // by global rank
  ASSERT_NE((v[0] + v[1]) + v[2], (v[2] + v[1]) + v[0]) << "the test data must be order-sensitive";
  std::vector<float> got(3, -7), got_rs(3, -7);
  run_test_ranks(3, [&](communicator& c) {
    const auto g = make_group("reversed", {2, 1, 0});
    float x = v[c.rank()];
    c.all_reduce(g, &x, 1, dtype::f32);
    got[c.rank()] = x;
    float send[3] = {v[c.rank()], v[c.rank()], v[c.rank()]}, recv = -7;
    c.reduce_scatter(g, send, &recv, 1, dtype::f32);
    got_rs[c.rank()] = recv;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r], 1.0f) << "rank " << r;
    EXPECT_EQ(got_rs[r], 1.0f) << "rank " << r;
  }
}

TEST(inproc_comm, large_all_reduce_summed_in_shares_is_the_group_order_sum) {
  // From 2048 elements per member the sum is split over the members (each sums a share); every
  // element must still be the left-to-right sum in group order, shares of unequal length
  // included (count not a multiple of the group size).
  constexpr int P = 3;
  constexpr std::int64_t count = 2048 * P + 5;
  const std::vector<int> order{2, 0, 1};
  std::vector<std::vector<float>> got(P);
  run_test_ranks(P, [&](communicator& c) {
    std::vector<float> buf(count);
    for (std::int64_t k = 0; k < count; ++k)
      buf[k] = value<float>(5, c.rank(), k) * (k % 3 == c.rank() ? 1e8f : 1.0f);
    c.all_reduce(make_group("mixed", order), buf.data(), count, dtype::f32);
    got[c.rank()] = buf;
  });
  std::vector<float> want(count);
  for (std::int64_t k = 0; k < count; ++k) {
    std::vector<float> terms;
    for (int r : order) terms.push_back(value<float>(5, r, k) * (k % 3 == r ? 1e8f : 1.0f));
    want[k] = sum_in_order(terms);
  }
  for (int r = 0; r < P; ++r) EXPECT_EQ(count_wrong(got[r], want), 0) << "rank " << r;
}

TEST(inproc_comm, caught_exception_survives_a_collective_in_its_handler) {
  // A rank that waits in a collective inside a catch block lets other ranks run (on the same
  // thread when the ranks are fibers), which catch exceptions of their own: each must find its
  // own exception again when it resumes.
  std::vector<std::string> rethrown(4);
  run_test_ranks(4, [&](communicator& c) {
    const auto world = make_group("world", {0, 1, 2, 3});
    try {
      try {
        throw std::runtime_error(fmt::format("rank {}", c.rank()));
      } catch (const std::exception&) {
        c.barrier(world);
        EXPECT_EQ(std::uncaught_exceptions(), 0);
        throw;
      }
    } catch (const std::exception& e) {
      rethrown[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(rethrown[r], fmt::format("rank {}", r));
}

TEST(inproc_comm, watchdog_fires_while_a_stalled_rank_holds_every_carrier) {
  // Rank 2 is stuck in its own code for 1.5 s; with one carrier it holds the only thread, yet
  // the others' deadline (200 ms) must still fire and name it, as with one thread per rank.
  inproc_world world(3);
  world.set_carriers(test_carriers());
  world.set_timeout(200ms);
  const auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration fired{};
  world.set_abort_hook(
      [&](int, const std::string&) { fired = std::chrono::steady_clock::now() - start; });
  try {
    run_ranks(world, [](communicator& c) {
      if (c.rank() == 2) std::this_thread::sleep_for(1500ms);
      c.barrier(make_group("world", {0, 1, 2}));
    });
    FAIL() << "expected the watchdog";
  } catch (const error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("watchdog: barrier #0 on group 'world'"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 2 (busy in its own code, in no call)"), std::string::npos) << m;
  }
  EXPECT_LT(fired, 1s);
}

// ---- failures never hang ----
// ---- failures never hang ----

TEST(inproc_comm, throwing_rank_aborts_the_world_and_is_rethrown) {
  const auto start = std::chrono::steady_clock::now();
  std::mutex mu;
  std::vector<std::string> others;
  try {
    run_test_ranks(4, [&](communicator& c) {
      const auto g = make_group("world", {0, 1, 2, 3});
      double x = 1;
      c.all_reduce(g, &x, 1, dtype::f64);
      if (c.rank() == 2) throw std::runtime_error("boom at step 1");
      try {
        c.all_reduce(g, &x, 1, dtype::f64);
      } catch (const error& e) {
        std::lock_guard lock(mu);
        others.push_back(e.what());
        throw;
      }
    });
    FAIL() << "expected run_ranks to throw";
  } catch (const error& e) {
    EXPECT_STREQ(e.what(), "rank 2: boom at step 1");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  ASSERT_EQ(others.size(), 3u);
  for (const auto& m : others) EXPECT_EQ(m, "aborted: rank 2 failed: boom at step 1");
}

TEST(inproc_comm, rethrow_keeps_seqpar_error_type) {
  EXPECT_THROW(run_test_ranks(3,
                              [](communicator& c) {
                                if (c.rank() == 1) fail<shape_error>("bad dim {}", 3);
                                c.barrier(make_group("world", {0, 1, 2}));
                              }),
               shape_error);
}

TEST(inproc_comm, rank_that_returns_without_a_collective_is_named_at_once) {
  inproc_world world(3);
  world.set_carriers(test_carriers());
  world.set_timeout(30s);  // must not be needed
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(world, [](communicator& c) {
      if (c.rank() == 1) return;  // skips the barrier
      c.barrier(make_group("world", {0, 1, 2}), tagged("step0"));
    });
    FAIL() << "expected an error";
  } catch (const error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("barrier #0 (step0) on group 'world'"), std::string::npos) << m;
    EXPECT_NE(m.find("rank(s) [1] left their program"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

TEST(inproc_comm, watchdog_names_the_member_that_never_arrived) {
  // Rank 1 skips the world barrier and waits on pair12, where rank 2 never comes: a deadlock.
  inproc_world world(3);
  world.set_carriers(test_carriers());
  world.set_timeout(200ms);
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(world, [](communicator& c) {
      if (c.rank() == 1) {
        std::this_thread::sleep_for(50ms);  // so that the world barrier times out first
        double x = 0;
        c.all_reduce(make_group("pair12", {1, 2}), &x, 1, dtype::f64);
      }
      c.barrier(make_group("world", {0, 1, 2}));
    });
    FAIL() << "expected the watchdog";
  } catch (const error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("watchdog: barrier #0 on group 'world' [0, 1, 2]"), std::string::npos) << m;
    EXPECT_NE(m.find("never arrived: rank 1 (waiting in all_reduce #0 on group 'pair12')"),
              std::string::npos)
        << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

// ---- validation ----

TEST(inproc_comm, all_to_all_count_mismatch_names_both_ranks) {
  try {
    run_test_ranks(3, [](communicator& c) {
      std::vector<std::int64_t> sc{3, 3, 3}, rc{3, 3, 3};
      if (c.rank() == 1) rc[0] = 2;  // expects 2 from rank 0, which sends 3
      std::vector<double> send(9), recv(9);
      c.all_to_all(make_group("ulysses0", {0, 1, 2}), send.data(), sc, recv.data(), rc, dtype::f64,
                   tagged("L0.attn.qkv.fwd"));
    });
    FAIL() << "expected a shape_error";
  } catch (const shape_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'ulysses0'"), std::string::npos) << m;
    EXPECT_NE(m.find("L0.attn.qkv.fwd"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 (member 0) sends 3 elements to rank 1 (member 1) but rank 1 "
                     "expects 2 from rank 0"),
              std::string::npos)
        << m;
  }
}

TEST(inproc_comm, unmatched_send_is_an_error) {
  try {
    run_test_ranks(2, [](communicator& c) {
      double x = 1;
      std::vector<p2p_op> ops;
      if (c.rank() == 0) ops.push_back({p2p_op::kind::send, 1, &x, 1, {}});
      c.send_recv(make_group("ring0", {0, 1}), ops, dtype::f64);
    });
    FAIL() << "expected an error";
  } catch (const error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("unmatched send"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 posts 1 send(s) to rank 1 but rank 1 posts 0 recv(s)"),
              std::string::npos)
        << m;
  }
}

TEST(inproc_comm, unmatched_recv_and_p2p_count_mismatch_are_errors) {
  auto run = [](std::int64_t send_count, bool post_send) {
    run_test_ranks(2, [=](communicator& c) {
      double x[4] = {};
      std::vector<p2p_op> ops;
      if (c.rank() == 0 && post_send) ops.push_back({p2p_op::kind::send, 1, x, send_count, {}});
      if (c.rank() == 1) ops.push_back({p2p_op::kind::recv, 0, x, 2, {}});
      c.send_recv(make_group("ring0", {0, 1}), ops, dtype::f64);
    });
  };
  EXPECT_NO_THROW(run(2, true));
  EXPECT_THROW(run(3, true), shape_error);
  try {
    run(2, false);
    FAIL() << "expected an error";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("unmatched recv"), std::string::npos) << e.what();
  }
}

TEST(inproc_comm, different_ops_at_the_same_call_are_an_error) {
  try {
    run_test_ranks(2, [](communicator& c) {
      const auto g = make_group("world", {0, 1});
      double x[2] = {};
      if (c.rank() == 0)
        c.all_reduce(g, x, 1, dtype::f64);
      else
        c.all_gather(g, x, 1, x, dtype::f64);
    });
    FAIL() << "expected an error";
  } catch (const error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("collective mismatch on group 'world' [0, 1] at call #0"), std::string::npos)
        << m;
    EXPECT_NE(m.find("all_reduce"), std::string::npos) << m;
    EXPECT_NE(m.find("all_gather"), std::string::npos) << m;
  }
}

TEST(inproc_comm, group_name_with_other_ranks_is_an_error) {
  EXPECT_THROW(run_test_ranks(4,
                              [](communicator& c) {
                                const int r = c.rank();
                                c.barrier(make_group("ulysses", {r / 2 * 2, r / 2 * 2 + 1}));
                              }),
               error);
  EXPECT_THROW(run_test_ranks(0, [](communicator&) {}), config_error);
}

// ---- recording ----

TEST(inproc_comm, recorder_gets_op_group_seq_splits_and_tags) {
  comm_recorder rec;
  run_test_ranks(
      2,
      [](communicator& c) {
        const auto world = make_group("world", {0, 1});
        const auto solo = make_group(fmt::format("solo{}", c.rank()), {c.rank()});
        const int r = c.rank();
        std::vector<std::int64_t> sc{1 + r, 2}, rc{1 + r, 2};  // pairs up for P = 2
        std::vector<float> send(3 + r), recv(3 + r);
        c.all_to_all(world, send.data(), sc, recv.data(), rc, dtype::f32,
                     op_info{"L0.attn.qkv.fwd", {3 + r}, {3 + r}});
        double x = 0;
        c.all_reduce(solo, &x, 1, dtype::f64, tagged("loss"));
        c.all_reduce(world, &x, 1, dtype::f64, tagged("grad"));
        std::vector<p2p_op> ops{{p2p_op::kind::send, 1 - r, &x, 1, {}},
                                {p2p_op::kind::recv, 1 - r, &x, 1, {}}};
        std::vector<double> y(1);
        ops[1].buf = y.data();
        c.send_recv(world, ops, dtype::f64, tagged("ring.kv"));
      },
      &rec);
  const auto recs = rec.records();
  ASSERT_EQ(recs.size(), 10u);
  for (int r = 0; r < 2; ++r) {
    const auto* q = &recs[r * 5];
    EXPECT_EQ(q[0].rank, r);
    EXPECT_EQ(q[0].op, "all_to_all");
    EXPECT_EQ(q[0].group, "world");
    EXPECT_EQ(q[0].seq, 0);
    EXPECT_EQ(q[0].type, dtype::f32);
    EXPECT_EQ(q[0].tag, "L0.attn.qkv.fwd");
    EXPECT_EQ(q[0].in_splits, (std::vector<std::int64_t>{1 + r, 2}));
    EXPECT_EQ(q[0].out_splits, (std::vector<std::int64_t>{1 + r, 2}));
    EXPECT_EQ(q[0].in_shape, (std::vector<std::int64_t>{3 + r}));
    EXPECT_EQ(q[1].op, "all_reduce");
    EXPECT_EQ(q[1].group, fmt::format("solo{}", r));
    EXPECT_EQ(q[1].seq, 0);
    EXPECT_EQ(q[1].tag, "loss");
    EXPECT_EQ(q[2].group, "world");
    EXPECT_EQ(q[2].seq, 1);
    EXPECT_EQ(q[2].tag, "grad");
    EXPECT_EQ(q[3].kind, "p2p");
    EXPECT_EQ(q[3].op, "send");
    EXPECT_EQ(q[3].peer, 1 - r);
    EXPECT_EQ(q[3].seq, 2);
    EXPECT_EQ(q[3].shape, (std::vector<std::int64_t>{1}));
    EXPECT_EQ(q[4].op, "recv");
    EXPECT_EQ(q[4].seq, 3);
    EXPECT_EQ(q[4].tag, "ring.kv");
  }
}

// ---- fault injection ----

// Runs one all_to_all on world(4) with uneven counts (member j sends j + i + 1 elements to
// member i... see cnt) through a faulty_communicator; returns every rank's recv and the
// fault-free expectation.
struct a2a_result {
  std::vector<std::vector<std::int64_t>> got, want;
  std::vector<std::vector<std::int64_t>> counts;  // recv counts per rank
  std::vector<std::int64_t> hits;
};

a2a_result run_faulty_all_to_all(const fault_spec& spec, int calls = 1,
                                 comm_recorder* inner_rec = nullptr) {
  constexpr int P = 4;
  a2a_result res;
  res.got.resize(P);
  res.want.resize(P);
  res.counts.resize(P);
  res.hits.resize(P);
  run_test_ranks(
      P,
      [&](communicator& inner) {
        faulty_communicator c(inner, spec);
        const auto g = make_group("world", {0, 1, 2, 3});
        const int me = c.rank();
        auto cnt = [](int i, int j) -> std::int64_t { return 1 + (i + j) % 3; };
        std::vector<std::int64_t> sc(P), rc(P);
        std::vector<std::int64_t> send, want;
        for (int j = 0; j < P; ++j) {
          sc[j] = cnt(me, j), rc[j] = cnt(j, me);
          for (int k = 0; k < sc[j]; ++k) send.push_back(value<std::int64_t>(4, me, j * 10 + k));
          for (int k = 0; k < rc[j]; ++k) want.push_back(value<std::int64_t>(4, j, me * 10 + k));
        }
        std::vector<std::int64_t> recv(want.size());
        for (int call = 0; call < calls; ++call)
          c.all_to_all(g, send.data(), sc, recv.data(), rc, dtype::i64,
                       tagged(call == calls - 1 ? "L0.attn.qkv.fwd" : "L0.attn.out.fwd"));
        res.got[me] = recv;
        res.want[me] = want;
        res.counts[me] = rc;
        res.hits[me] = c.hits();
      },
      inner_rec);
  return res;
}

// The specification of the chunk faults, written independently of faulty_comm.cpp.
std::vector<std::int64_t> corrupt_expected(fault_kind kind, const std::vector<std::int64_t>& flat,
                                           const std::vector<std::int64_t>& counts, int a, int b) {
  std::vector<std::vector<std::int64_t>> chunks;
  std::size_t off = 0;
  for (auto c : counts) {
    chunks.emplace_back(flat.begin() + off, flat.begin() + off + c);
    off += c;
  }
  std::vector<int> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  switch (kind) {
    case fault_kind::drop_chunk:
      std::fill(chunks[a].begin(), chunks[a].end(), 0);
      break;
    case fault_kind::duplicate_chunk:
      for (std::size_t k = 0; k < std::min(chunks[a].size(), chunks[b].size()); ++k)
        chunks[b][k] = chunks[a][k];
      break;
    case fault_kind::permute_chunks:
      std::reverse(order.begin(), order.end());
      break;
    case fault_kind::swap_peers:
      std::swap(order[a], order[b]);
      break;
    default:
      break;
  }
  std::vector<std::int64_t> out;
  for (int i : order) out.insert(out.end(), chunks[i].begin(), chunks[i].end());
  return out;
}

TEST(faulty_comm, each_chunk_fault_corrupts_only_the_configured_rank_as_specified) {
  for (auto kind : {fault_kind::drop_chunk, fault_kind::duplicate_chunk, fault_kind::permute_chunks,
                    fault_kind::swap_peers}) {
    fault_spec spec;
    spec.kind = kind;
    spec.rank = 1;
    spec.peer = 2;
    spec.other_peer = 0;
    const auto res = run_faulty_all_to_all(spec);
    for (int r = 0; r < 4; ++r) {
      const bool target = r == 1;
      const auto want =
          target ? corrupt_expected(kind, res.want[r], res.counts[r], 2, 0) : res.want[r];
      EXPECT_EQ(res.got[r], want) << fault_kind_name(kind) << " rank " << r;
      EXPECT_EQ(res.hits[r], target ? 1 : 0) << fault_kind_name(kind) << " rank " << r;
      if (target) {
        EXPECT_NE(res.got[r], res.want[r]) << fault_kind_name(kind) << ": no effect";
      }
    }
  }
}

TEST(faulty_comm, wrong_count_reaches_the_transport_which_reports_it) {
  fault_spec spec;
  spec.kind = fault_kind::wrong_count;
  spec.rank = 1;
  spec.peer = 2;
  comm_recorder inner_rec;
  try {
    run_faulty_all_to_all(spec, 1, &inner_rec);
    FAIL() << "expected a shape_error";
  } catch (const shape_error& e) {
    // cnt(1, 2) = 1 + 3 % 3 = 1: rank 1 now sends 0 elements to rank 2, which expects 1.
    EXPECT_NE(std::string(e.what()).find("rank 1 (member 1) sends 0 elements to rank 2 (member "
                                         "2) but rank 2 expects 1 from rank 1"),
              std::string::npos)
        << e.what();
  }
  // The inner communicator's record shows the count the transport received.
  for (const auto& r : inner_rec.records())
    if (r.rank == 1) {
      EXPECT_EQ(r.in_splits, (std::vector<std::int64_t>{2, 3, 0, 2}));
    }
}

TEST(faulty_comm, call_index_tag_and_every_call_select_the_calls_hit) {
  fault_spec spec;
  spec.kind = fault_kind::drop_chunk;
  spec.rank = 3;
  spec.peer = 0;
  // Tag: of 3 calls only the last is tagged qkv; recv holds the result of the last call.
  spec.tag = "qkv";
  auto res = run_faulty_all_to_all(spec, 3);
  EXPECT_EQ(res.hits[3], 1);
  EXPECT_NE(res.got[3], res.want[3]);
  // Call index 1 among untagged matching calls: hit the second of three, the last is clean.
  spec.tag.clear();
  spec.call = 1;
  res = run_faulty_all_to_all(spec, 3);
  EXPECT_EQ(res.hits[3], 1);
  EXPECT_EQ(res.got[3], res.want[3]);
  // every_call from call 1: two hits, last corrupted.
  spec.every_call = true;
  res = run_faulty_all_to_all(spec, 3);
  EXPECT_EQ(res.hits[3], 2);
  EXPECT_NE(res.got[3], res.want[3]);
  // An op filter that does not match: no hit.
  spec.op = "all_gather";
  res = run_faulty_all_to_all(spec, 3);
  EXPECT_EQ(res.hits[3], 0);
  EXPECT_EQ(res.got[3], res.want[3]);
}

TEST(faulty_comm, all_gather_faults) {
  for (auto kind : {fault_kind::drop_chunk, fault_kind::duplicate_chunk, fault_kind::permute_chunks,
                    fault_kind::swap_peers, fault_kind::wrong_count}) {
    fault_spec spec;
    spec.kind = kind;
    spec.rank = 0;
    spec.peer = 1;
    spec.other_peer = 3;
    std::vector<std::vector<std::int64_t>> got(4), want(4);
    auto body = [&](communicator& inner) {
      faulty_communicator c(inner, spec);
      std::vector<std::int64_t> send(2), recv(8);
      for (int k = 0; k < 2; ++k) send[k] = value<std::int64_t>(6, c.rank(), k);
      for (int r = 0; r < 4; ++r)
        for (int k = 0; k < 2; ++k) want[c.rank()].push_back(value<std::int64_t>(6, r, k));
      c.all_gather(make_group("world", {0, 1, 2, 3}), send.data(), 2, recv.data(), dtype::i64);
      got[c.rank()] = recv;
    };
    if (kind == fault_kind::wrong_count) {
      EXPECT_THROW(run_test_ranks(4, body), shape_error);
      continue;
    }
    run_test_ranks(4, body);
    const std::vector<std::int64_t> counts{2, 2, 2, 2};
    EXPECT_EQ(got[0], corrupt_expected(kind, want[0], counts, 1, 3)) << fault_kind_name(kind);
    EXPECT_NE(got[0], want[0]) << fault_kind_name(kind);
    for (int r = 1; r < 4; ++r) EXPECT_EQ(got[r], want[r]) << fault_kind_name(kind);
  }
}

TEST(faulty_comm, reduction_faults) {
  for (const std::string op : {"all_reduce", "reduce_scatter"})
    for (auto kind :
         {fault_kind::drop_chunk, fault_kind::duplicate_chunk, fault_kind::permute_chunks,
          fault_kind::wrong_count, fault_kind::swap_peers}) {
      fault_spec spec;
      spec.kind = kind;
      spec.rank = 2;
      std::vector<std::vector<std::int32_t>> got(3), want(3);
      std::vector<std::int64_t> hits(3);
      auto body = [&](communicator& inner) {
        faulty_communicator c(inner, spec);
        const auto g = make_group("world", {0, 1, 2});
        const int me = c.rank();
        std::vector<std::int32_t> x(9), w(3);
        for (int k = 0; k < 9; ++k) x[k] = value<std::int32_t>(8, me, k);
        const int base = op == "all_reduce" ? 0 : me * 3;
        for (int k = 0; k < 3; ++k)
          for (int r = 0; r < 3; ++r) w[k] += value<std::int32_t>(8, r, base + k);
        if (op == "all_reduce") {
          x.resize(3);
          c.all_reduce(g, x.data(), 3, dtype::i32);
          got[me] = x;
        } else {
          std::vector<std::int32_t> y(3);
          c.reduce_scatter(g, x.data(), y.data(), 3, dtype::i32);
          got[me] = y;
        }
        want[me] = w;
        hits[me] = c.hits();
      };
      if (kind == fault_kind::wrong_count) {
        EXPECT_THROW(run_test_ranks(3, body), shape_error) << op;
        continue;
      }
      run_test_ranks(3, body);
      auto expect = want[2];
      if (kind == fault_kind::drop_chunk) std::fill(expect.begin(), expect.end(), 0);
      if (kind == fault_kind::duplicate_chunk)
        for (auto& e : expect) e *= 2;
      if (kind == fault_kind::permute_chunks) std::reverse(expect.begin(), expect.end());
      EXPECT_EQ(got[2], expect) << op << " " << fault_kind_name(kind);
      EXPECT_EQ(hits[2], kind == fault_kind::swap_peers ? 0 : 1)
          << op << " " << fault_kind_name(kind);
      if (kind != fault_kind::swap_peers) {
        EXPECT_NE(got[2], want[2]) << fault_kind_name(kind);
      }
      EXPECT_EQ(got[0], want[0]);
      EXPECT_EQ(got[1], want[1]);
    }
}

TEST(faulty_comm, send_recv_faults) {
  // Ring of 4: each rank receives from prev (first recv) and from next (second recv).
  for (auto kind : {fault_kind::drop_chunk, fault_kind::duplicate_chunk, fault_kind::permute_chunks,
                    fault_kind::swap_peers, fault_kind::wrong_count}) {
    fault_spec spec;
    spec.kind = kind;
    spec.rank = 1;
    spec.peer = 0;  // prev of rank 1
    spec.other_peer = 2;
    std::vector<std::vector<double>> got(4), want(4);
    auto body = [&](communicator& inner) {
      faulty_communicator c(inner, spec);
      const int me = c.rank(), prev = (me + 3) % 4, next = (me + 1) % 4;
      std::vector<double> out(3), from_prev(3), from_next(3);
      for (int k = 0; k < 3; ++k) out[k] = value<double>(10, me, k);
      std::vector<p2p_op> ops{{p2p_op::kind::recv, prev, from_prev.data(), 3, {}},
                              {p2p_op::kind::recv, next, from_next.data(), 3, {}},
                              {p2p_op::kind::send, next, out.data(), 3, {}},
                              {p2p_op::kind::send, prev, out.data(), 3, {}}};
      c.send_recv(make_group("ring", {0, 1, 2, 3}), ops, dtype::f64);
      got[me] = from_prev;
      got[me].insert(got[me].end(), from_next.begin(), from_next.end());
      for (int src : {prev, next})
        for (int k = 0; k < 3; ++k) want[me].push_back(value<double>(10, src, k));
    };
    if (kind == fault_kind::wrong_count) {
      EXPECT_THROW(run_test_ranks(4, body), shape_error);
      continue;
    }
    run_test_ranks(4, body);
    std::vector<std::int64_t> bits(6), wbits(6);
    std::memcpy(bits.data(), got[1].data(), 48);
    std::memcpy(wbits.data(), want[1].data(), 48);
    EXPECT_EQ(bits, corrupt_expected(kind, wbits, {3, 3}, 0, 1)) << fault_kind_name(kind);
    EXPECT_NE(got[1], want[1]) << fault_kind_name(kind);
    for (int r : {0, 2, 3}) EXPECT_EQ(got[r], want[r]) << fault_kind_name(kind);
  }
}

TEST(faulty_comm, invalid_spec_is_a_config_error) {
  run_test_ranks(1, [](communicator& inner) {
    fault_spec spec;
    spec.kind = fault_kind::swap_peers;
    spec.peer = spec.other_peer = 1;
    EXPECT_THROW(faulty_communicator(inner, spec), config_error);
    spec.peer = -1;
    EXPECT_THROW(faulty_communicator(inner, spec), config_error);
  });
}

}  // namespace

// ---- nonblocking all_to_all

namespace {

/// Rank r sends value 100·r + 10·j + i as the i-th of `n` elements for peer j.
std::vector<double> a2a_payload(int r, int P, int n) {
  std::vector<double> v;
  for (int j = 0; j < P; ++j)
    for (int i = 0; i < n; ++i) v.push_back(100.0 * r + 10.0 * j + i);
  return v;
}

}  // namespace

TEST(inproc_comm, nonblocking_all_to_all_waited_in_any_order) {
  constexpr int P = 3;
  run_test_ranks(P, [](communicator& comm) {
    const comm_group g{"w", {0, 1, 2}};
    const int r = comm.rank();
    std::vector<std::vector<double>> send, recv;
    std::vector<comm_handle> h;
    for (int n = 1; n <= 3; ++n) {
      send.push_back(a2a_payload(r, P, n));
      recv.emplace_back(static_cast<std::size_t>(P * n), -1.0);
    }
    for (int n = 1; n <= 3; ++n) {
      const std::vector<std::int64_t> counts(P, n);
      h.push_back(comm.start_all_to_all(g, send[n - 1].data(), counts, recv[n - 1].data(), counts,
                                        dtype::f64, {fmt::format("t.{}", n)}));
    }
    EXPECT_EQ(comm.pending().size(), 3u);
    // Nothing has arrived before the wait: the receive buffer holds the NaN pattern.
    EXPECT_TRUE(std::isnan(recv[1][0]));
    for (int i : {2, 0, 1}) comm.wait(h[static_cast<std::size_t>(i)]);
    EXPECT_TRUE(comm.pending().empty());
    for (int n = 1; n <= 3; ++n)
      for (int j = 0; j < P; ++j)
        for (int i = 0; i < n; ++i)
          EXPECT_EQ(recv[n - 1][static_cast<std::size_t>(j * n + i)], 100.0 * j + 10.0 * r + i);
  });
}

TEST(inproc_comm, nonblocking_wait_twice_or_on_an_empty_handle_throws) {
  run_test_ranks(2, [](communicator& comm) {
    const comm_group g{"w", {0, 1}};
    std::vector<double> send = a2a_payload(comm.rank(), 2, 1), recv(2);
    const std::vector<std::int64_t> counts{1, 1};
    auto h = comm.start_all_to_all(g, send.data(), counts, recv.data(), counts, dtype::f64, {"x"});
    comm_handle copy_of_id;
    comm.wait(h);
    EXPECT_FALSE(h.valid());
    EXPECT_THROW(comm.wait(h), error);
    EXPECT_THROW(comm.wait(copy_of_id), error);
  });
}

TEST(inproc_comm, nonblocking_send_buffer_changed_before_the_wait_is_reported) {
  EXPECT_THROW(run_test_ranks(2,
                              [](communicator& comm) {
                                const comm_group g{"w", {0, 1}};
                                std::vector<double> send = a2a_payload(comm.rank(), 2, 2), recv(4);
                                const std::vector<std::int64_t> counts{2, 2};
                                auto h = comm.start_all_to_all(g, send.data(), counts, recv.data(),
                                                               counts, dtype::f64, {"reused"});
                                send[0] = -1;  // the buffer reused while the call is in flight
                                comm.wait(h);
                              }),
               error);
}

TEST(inproc_comm, nonblocking_counts_that_do_not_pair_up_are_a_shape_error) {
  EXPECT_THROW(run_test_ranks(2,
                              [](communicator& comm) {
                                const comm_group g{"w", {0, 1}};
                                std::vector<double> send(4, 1.0), recv(4);
                                const std::vector<std::int64_t> s{2, 2},
                                    r = comm.rank() == 0 ? std::vector<std::int64_t>{2, 2}
                                                         : std::vector<std::int64_t>{1, 3};
                                auto h = comm.start_all_to_all(g, send.data(), s, recv.data(), r,
                                                               dtype::f64, {"bad"});
                                comm.wait(h);
                              }),
               shape_error);
}
