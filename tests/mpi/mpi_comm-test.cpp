// The MPI communicator under mpiexec -n 2 and -n 4: every op on the world and on sub-groups
// (reversed order, evens/odds, pairs, singletons), index-derived data as in nccl-tests (element
// values are a function of (seed, rank, index), so every rank computes what it must receive),
// call validation errors, and reductions bitwise equal to the in-process communicator's.
#include "mpi/mpi_comm.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/flight_recorder.hpp"
#include "sim/inproc_comm.hpp"
#include "support/comm_values.hpp"

namespace {

using namespace seqpar;
using namespace seqpar::test;

mpi::mpi_communicator* g_comm = nullptr;  // one per process, created in main

mpi::mpi_communicator& comm() { return *g_comm; }

op_info tagged(std::string tag) {
  op_info info;
  info.tag = std::move(tag);
  return info;
}

/// World, world reversed, evens, odds, consecutive pairs, every singleton: listed in one order
/// on every rank, so overlapping groups never wait on each other in a cycle.
std::vector<comm_group> test_groups(int P) {
  std::vector<comm_group> gs;
  std::vector<int> all(P);
  std::iota(all.begin(), all.end(), 0);
  gs.push_back({"t.world", all});
  gs.push_back({"t.world_rev", std::vector<int>(all.rbegin(), all.rend())});
  std::vector<int> even, odd;
  for (int r = 0; r < P; ++r) (r % 2 ? odd : even).push_back(r);
  gs.push_back({"t.even", even});
  if (!odd.empty()) gs.push_back({"t.odd", odd});
  for (int r = 0; r + 1 < P; r += 2) gs.push_back({"t.pair" + std::to_string(r), {r, r + 1}});
  for (int r = 0; r < P; ++r) gs.push_back({"t.self" + std::to_string(r), {r}});
  return gs;
}

std::vector<comm_group> my_groups() {
  std::vector<comm_group> out;
  for (auto& g : test_groups(comm().world_size()))
    if (g.index_of(comm().rank()) >= 0) out.push_back(g);
  return out;
}

/// Elements member i sends to member j in the uneven all_to_all (zeros included).
std::int64_t a2a_count(int i, int j) { return (3 * i + 5 * j + 1) % 4; }

template <class T>
void check_all_to_all(std::uint64_t seed) {
  for (const auto& g : my_groups()) {
    const int n = g.size(), me = g.index_of(comm().rank());
    std::vector<std::int64_t> sc(n), rc(n);
    std::vector<T> send, want;
    for (int j = 0; j < n; ++j) {
      sc[j] = a2a_count(me, j);
      rc[j] = a2a_count(j, me);
      for (std::int64_t e = 0; e < sc[j]; ++e)
        send.push_back(value<T>(seed, comm().rank(), j * 16 + e));
      for (std::int64_t e = 0; e < rc[j]; ++e)
        want.push_back(value<T>(seed, g.ranks[j], me * 16 + e));
    }
    std::vector<T> recv(want.size());
    comm().all_to_all(g, send.data(), sc, recv.data(), rc, type_of<T>(), tagged("t.a2a"));
    EXPECT_EQ(count_wrong(recv, want), 0) << "group " << g.name;
  }
}

TEST(mpi_comm, all_to_all_uneven_counts_every_dtype) {
  check_all_to_all<double>(1);
  check_all_to_all<float>(2);
  check_all_to_all<std::uint16_t>(3);
  check_all_to_all<std::int32_t>(4);
  check_all_to_all<std::int64_t>(5);
}

TEST(mpi_comm, all_gather_in_member_order) {
  for (std::int64_t count : {7, 0}) {
    for (const auto& g : my_groups()) {
      const int n = g.size();
      std::vector<double> send(count), want;
      for (std::int64_t e = 0; e < count; ++e) send[e] = value<double>(11, comm().rank(), e);
      for (int j = 0; j < n; ++j)
        for (std::int64_t e = 0; e < count; ++e) want.push_back(value<double>(11, g.ranks[j], e));
      std::vector<double> recv(want.size());
      comm().all_gather(g, send.data(), count, recv.data(), dtype::f64);
      EXPECT_EQ(count_wrong(recv, want), 0) << "group " << g.name << " count " << count;
    }
  }
}

/// The SUM of every member's contribution in member order, left to right.
template <class T>
std::vector<T> group_sum(std::uint64_t seed, const comm_group& g, std::int64_t offset,
                         std::int64_t count) {
  std::vector<T> out(count);
  for (int j = 0; j < g.size(); ++j)
    for (std::int64_t e = 0; e < count; ++e) {
      const T v = value<T>(seed, g.ranks[j], offset + e);
      if constexpr (std::is_integral_v<T>)
        out[e] = static_cast<T>(static_cast<std::make_unsigned_t<T>>(out[e]) +
                                static_cast<std::make_unsigned_t<T>>(v));
      else
        out[e] = j == 0 ? v : out[e] + v;
    }
  return out;
}

template <class T>
void check_reductions(std::uint64_t seed) {
  const std::int64_t count = 5;
  for (const auto& g : my_groups()) {
    const int n = g.size(), me = g.index_of(comm().rank());
    std::vector<T> send(count * n);
    for (std::int64_t e = 0; e < count * n; ++e) send[e] = value<T>(seed, comm().rank(), e);
    std::vector<T> recv(count);
    comm().reduce_scatter(g, send.data(), recv.data(), count, dtype_of<T>());
    EXPECT_EQ(count_wrong(recv, group_sum<T>(seed, g, me * count, count)), 0)
        << "reduce_scatter on " << g.name;

    std::vector<T> buf(count);
    for (std::int64_t e = 0; e < count; ++e) buf[e] = value<T>(seed, comm().rank(), e);
    comm().all_reduce(g, buf.data(), count, dtype_of<T>());
    EXPECT_EQ(count_wrong(buf, group_sum<T>(seed, g, 0, count)), 0) << "all_reduce on " << g.name;
  }
}

TEST(mpi_comm, reductions_sum_in_group_order_every_dtype) {
  check_reductions<double>(21);
  check_reductions<float>(22);
  check_reductions<std::int32_t>(23);
  check_reductions<std::int64_t>(24);
}

TEST(mpi_comm, reductions_equal_the_inproc_communicator_bitwise_run_to_run) {
  // Values of very different magnitudes: any other summation order changes the bits.
  const int P = comm().world_size();
  const std::int64_t count = 64;
  auto contribution = [](int rank, std::int64_t e) {
    const double scale[] = {1e16, 1.0, -1e16, 3.0};
    return scale[rank % 4] * (1.0 + value<double>(31, rank, e));
  };
  comm_group world{"t.world", {}};
  for (int r = 0; r < P; ++r) world.ranks.push_back(r);
  std::vector<double> inproc(count);
  run_ranks(P, [&](communicator& c) {
    std::vector<double> buf(count);
    for (std::int64_t e = 0; e < count; ++e) buf[e] = contribution(c.rank(), e);
    c.all_reduce(world, buf.data(), count, dtype::f64);
    if (c.rank() == 0) inproc = buf;
  });
  for (int run = 0; run < 3; ++run) {
    std::vector<double> buf(count);
    for (std::int64_t e = 0; e < count; ++e) buf[e] = contribution(comm().rank(), e);
    comm().all_reduce(world, buf.data(), count, dtype::f64);
    EXPECT_EQ(count_wrong(buf, inproc), 0) << "run " << run;
  }
}

TEST(mpi_comm, send_recv_ring_and_empty_lists) {
  for (const auto& g : my_groups()) {
    const int n = g.size(), me = g.index_of(comm().rank());
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    // Two messages to the next member, in posting order; recvs posted before sends.
    std::vector<float> a(3), b(4), ra(3), rb(4);
    for (int e = 0; e < 3; ++e) a[e] = value<float>(41, comm().rank(), e);
    for (int e = 0; e < 4; ++e) b[e] = value<float>(41, comm().rank(), 100 + e);
    std::vector<p2p_op> ops = {{p2p_op::kind::recv, prev, ra.data(), 3, {}},
                               {p2p_op::kind::recv, prev, rb.data(), 4, {}},
                               {p2p_op::kind::send, next, a.data(), 3, {}},
                               {p2p_op::kind::send, next, b.data(), 4, {}}};
    comm().send_recv(g, ops, dtype::f32, tagged("t.ring"));
    std::vector<float> wa(3), wb(4);
    for (int e = 0; e < 3; ++e) wa[e] = value<float>(41, g.ranks[prev], e);
    for (int e = 0; e < 4; ++e) wb[e] = value<float>(41, g.ranks[prev], 100 + e);
    EXPECT_EQ(count_wrong(ra, wa) + count_wrong(rb, wb), 0) << "group " << g.name;

    // Only member 0 sends (to the last member); everyone else passes an empty list.
    std::vector<double> x = {value<double>(42, comm().rank(), 0)}, y(1, 0.0);
    std::vector<p2p_op> some;
    if (me == 0) some.push_back({p2p_op::kind::send, n - 1, x.data(), 1, {}});
    if (me == n - 1) some.push_back({p2p_op::kind::recv, 0, y.data(), 1, {}});
    comm().send_recv(g, some, dtype::f64);
    if (me == n - 1) {
      EXPECT_EQ(y[0], value<double>(42, g.ranks[0], 0)) << g.name;
    }
  }
}

TEST(mpi_comm, aliasing_buffers) {
  for (const auto& g : my_groups()) {
    const int n = g.size(), me = g.index_of(comm().rank());
    // all_gather whose send block lies inside recv (torch's in-place pattern).
    std::vector<double> buf(3 * n, 0.0), want;
    for (int e = 0; e < 3; ++e) buf[me * 3 + e] = value<double>(51, comm().rank(), e);
    for (int j = 0; j < n; ++j)
      for (int e = 0; e < 3; ++e) want.push_back(value<double>(51, g.ranks[j], e));
    comm().all_gather(g, buf.data() + me * 3, 3, buf.data(), dtype::f64);
    EXPECT_EQ(count_wrong(buf, want), 0) << g.name;
    // all_to_all in place with equal splits.
    std::vector<std::int64_t> counts(n, 2);
    std::vector<double> io(2 * n), wio(2 * n);
    for (int j = 0; j < n; ++j)
      for (int e = 0; e < 2; ++e) {
        io[j * 2 + e] = value<double>(52, comm().rank(), j * 2 + e);
        wio[j * 2 + e] = value<double>(52, g.ranks[j], me * 2 + e);
      }
    comm().all_to_all(g, io.data(), counts, io.data(), counts, dtype::f64);
    EXPECT_EQ(count_wrong(io, wio), 0) << g.name;
    // send_recv where the recv buffer is the send buffer.
    std::vector<double> ring = {value<double>(53, comm().rank(), 0)};
    std::vector<p2p_op> ops = {{p2p_op::kind::send, (me + 1) % n, ring.data(), 1, {}},
                               {p2p_op::kind::recv, (me + n - 1) % n, ring.data(), 1, {}}};
    comm().send_recv(g, ops, dtype::f64);
    EXPECT_EQ(ring[0], value<double>(53, g.ranks[(me + n - 1) % n], 0)) << g.name;
  }
}

TEST(mpi_comm, barrier_on_every_group) {
  for (const auto& g : my_groups()) EXPECT_NO_THROW(comm().barrier(g, tagged("t.barrier")));
}

// ---- validation: every member throws the same error, nobody is left inside MPI ----

comm_group world_group() {
  comm_group g{"t.world", {}};
  for (int r = 0; r < comm().world_size(); ++r) g.ranks.push_back(r);
  return g;
}

template <class E, class F>
std::string expect_throw(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception";
  return {};
}

TEST(mpi_comm, count_mismatch_is_a_shape_error_naming_both_ranks) {
  const auto g = world_group();
  const std::int64_t count = comm().rank() == 1 ? 4 : 3;
  std::vector<double> send(count, 1.0), recv(4 * g.size());
  const auto msg = expect_throw<shape_error>([&] {
    comm().all_gather(g, send.data(), count, recv.data(), dtype::f64, tagged("t.bad_gather"));
  });
  EXPECT_NE(msg.find("count mismatch in all_gather"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0 (member 0) passes count 3 but rank 1 (member 1) passes 4"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("t.bad_gather"), std::string::npos) << msg;
  // The communicator is still usable: nothing was posted.
  std::vector<double> one = {1.0};
  comm().all_reduce(g, one.data(), 1, dtype::f64);
  EXPECT_EQ(one[0], g.size());
}

TEST(mpi_comm, all_to_all_split_mismatch_names_sender_and_receiver) {
  const auto g = world_group();
  const int n = g.size(), me = comm().rank();
  std::vector<std::int64_t> sc(n, 1), rc(n, 1);
  if (me == 0) sc[1] = 2;  // rank 0 sends 2 to rank 1, which expects 1
  std::vector<double> send(n + 1, 0.0), recv(n, 0.0);
  const auto msg = expect_throw<shape_error>(
      [&] { comm().all_to_all(g, send.data(), sc, recv.data(), rc, dtype::f64); });
  EXPECT_NE(msg.find("rank 0 (member 0) sends 2 elements to rank 1 (member 1) but rank 1 "
                     "expects 1 from rank 0"),
            std::string::npos)
      << msg;
}

TEST(mpi_comm, different_ops_or_dtypes_are_errors_not_hangs) {
  const auto g = world_group();
  std::vector<double> buf(2, 1.0);
  auto msg = expect_throw<error>([&] {
    if (comm().rank() == 0)
      comm().barrier(g);
    else
      comm().all_reduce(g, buf.data(), 2, dtype::f64);
  });
  EXPECT_NE(msg.find("collective mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 0 (member 0) called barrier but rank 1 (member 1) called all_reduce"),
            std::string::npos)
      << msg;
  msg = expect_throw<error>([&] {
    comm().all_reduce(g, buf.data(), comm().rank() == 0 ? 2 : 1,
                      comm().rank() == 0 ? dtype::f64 : dtype::i64);
  });
  EXPECT_NE(msg.find("dtype mismatch"), std::string::npos) << msg;
}

TEST(mpi_comm, unmatched_send_is_reported_on_every_member) {
  const auto g = world_group();
  const int n = g.size(), me = comm().rank();
  std::vector<double> x(2, 0.0);
  std::vector<p2p_op> ops;
  if (me == 0) ops.push_back({p2p_op::kind::send, n - 1, x.data(), 2, {}});  // nobody receives
  const auto msg = expect_throw<error>([&] { comm().send_recv(g, ops, dtype::f64); });
  EXPECT_NE(msg.find(fmt::format("unmatched send in send_recv #")), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("rank 0 posts 1 send(s) to rank {}", n - 1)), std::string::npos)
      << msg;
}

TEST(mpi_comm, group_name_reused_for_other_ranks_is_an_error) {
  comm_group g = world_group();
  std::reverse(g.ranks.begin(), g.ranks.end());  // "t.world" is already {0, 1, …}
  const auto msg = expect_throw<error>([&] { comm().barrier(g); });
  EXPECT_NE(msg.find("group 't.world' was first used with ranks"), std::string::npos) << msg;
}

TEST(mpi_comm, mpi_error_codes_become_backend_errors_with_rank_and_host) {
  try {
    mpi::check_mpi(MPI_ERR_COUNT, "MPI_Allgather_c");
    FAIL() << "no exception";
  } catch (const backend_error& e) {
    EXPECT_EQ(e.call(), "MPI_Allgather_c");
    EXPECT_EQ(e.code(), MPI_ERR_COUNT);
    EXPECT_EQ(e.rank(), comm().rank());
    EXPECT_EQ(e.host(), mpi::processor_name());
    EXPECT_FALSE(e.host().empty());
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("rank {} on {}: MPI_Allgather_c failed with code",
                                    comm().rank(), e.host())),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("count"), std::string::npos) << what;  // MPI_Error_string's text
  }
  EXPECT_NO_THROW(mpi::check_mpi(MPI_SUCCESS, "MPI_Barrier"));
}

TEST(mpi_comm, unverified_transport_still_reports_short_messages) {
  // verify_calls off (benchmarks): a message shorter than the posted recv is a shape_error on
  // the receiver from the received count, not silent garbage.
  mpi::mpi_options o;
  o.verify_calls = false;
  mpi::mpi_communicator raw(o);
  const auto g = world_group();
  const int n = g.size(), me = raw.rank();
  std::vector<double> x(3, 1.0), y(5, 0.0);
  std::vector<p2p_op> ops;
  if (me == 0) ops.push_back({p2p_op::kind::send, n - 1, x.data(), 3, {}});
  if (me == n - 1) ops.push_back({p2p_op::kind::recv, 0, y.data(), 5, {}});
  if (me == n - 1) {
    const auto msg = expect_throw<shape_error>([&] { raw.send_recv(g, ops, dtype::f64); });
    EXPECT_NE(msg.find("expected 5 elements from rank 0 but received 3"), std::string::npos) << msg;
  } else {
    raw.send_recv(g, ops, dtype::f64);
  }
  // And the plain ops are correct without the descriptor exchange.
  std::vector<double> buf = {static_cast<double>(me)};
  raw.all_reduce(g, buf.data(), 1, dtype::f64);
  EXPECT_EQ(buf[0], n * (n - 1) / 2.0);
}

// ---- nonblocking all_to_all ----

/// Elements member i sends to member j in nonblocking call k (zeros included; differs per k).
std::int64_t a2a_count_k(int k, int i, int j) { return (3 * i + 5 * j + 1 + k) % 4 + k; }

TEST(mpi_comm, nonblocking_all_to_alls_waited_out_of_start_order) {
  constexpr int calls = 3;
  for (const auto& g : my_groups()) {
    const int n = g.size(), me = g.index_of(comm().rank());
    std::vector<std::vector<std::int64_t>> sc(calls, std::vector<std::int64_t>(n)), rc = sc;
    std::vector<std::vector<double>> send(calls), want(calls), recv(calls);
    for (int k = 0; k < calls; ++k) {
      for (int j = 0; j < n; ++j) {
        sc[k][j] = a2a_count_k(k, me, j);
        rc[k][j] = a2a_count_k(k, j, me);
        for (std::int64_t e = 0; e < sc[k][j]; ++e)
          send[k].push_back(value<double>(60 + k, comm().rank(), j * 16 + e));
        for (std::int64_t e = 0; e < rc[k][j]; ++e)
          want[k].push_back(value<double>(60 + k, g.ranks[j], me * 16 + e));
      }
      recv[k].assign(want[k].size(), -1.0);
    }
    std::vector<comm_handle> h;
    for (int k = 0; k < calls; ++k)
      h.push_back(comm().start_all_to_all(g, send[k].data(), sc[k], recv[k].data(), rc[k],
                                          dtype::f64, tagged("t.ia2a" + std::to_string(k))));
    EXPECT_EQ(comm().pending(), (std::vector<std::string>{"t.ia2a0", "t.ia2a1", "t.ia2a2"}));
    // A blocking call on the same group while the three are in flight.
    double one = 1.0;
    comm().all_reduce(g, &one, 1, dtype::f64, tagged("t.between"));
    EXPECT_EQ(one, n) << "group " << g.name;
    for (int k : {2, 0, 1}) {
      comm().wait(h[k]);
      EXPECT_FALSE(h[k].valid());
      EXPECT_EQ(count_wrong(recv[k], want[k]), 0) << "group " << g.name << " call " << k;
    }
    EXPECT_TRUE(comm().pending().empty());
  }
}

TEST(mpi_comm, waiting_a_handle_twice_is_an_error) {
  const auto g = world_group();
  const int n = g.size(), me = comm().rank();
  std::vector<std::int64_t> counts(n, 2);
  std::vector<double> send(2 * n), recv(2 * n), want(2 * n);
  for (int j = 0; j < n; ++j)
    for (int e = 0; e < 2; ++e) {
      send[j * 2 + e] = value<double>(70, me, j * 2 + e);
      want[j * 2 + e] = value<double>(70, g.ranks[j], me * 2 + e);
    }
  auto h = comm().start_all_to_all(g, send.data(), counts, recv.data(), counts, dtype::f64,
                                   tagged("t.twice"));
  comm().wait(h);
  EXPECT_EQ(count_wrong(recv, want), 0);
  const auto msg = expect_throw<error>([&] { comm().wait(h); });
  EXPECT_NE(msg.find("already waited"), std::string::npos) << msg;
  // Nothing was posted: the communicator goes on.
  double one = 1.0;
  comm().all_reduce(g, &one, 1, dtype::f64);
  EXPECT_EQ(one, n);
}

TEST(mpi_comm, nonblocking_all_to_all_rejects_overlapping_buffers) {
  const auto g = world_group();
  const int n = g.size();
  std::vector<std::int64_t> counts(n, 1);
  std::vector<double> io(n, 1.0);
  const auto msg = expect_throw<error>([&] {
    auto h = comm().start_all_to_all(g, io.data(), counts, io.data(), counts, dtype::f64,
                                     tagged("t.in_place"));
    comm().wait(h);
  });
  EXPECT_NE(msg.find("send and receive buffers overlap"), std::string::npos) << msg;
  EXPECT_NE(msg.find("t.in_place"), std::string::npos) << msg;
  EXPECT_TRUE(comm().pending().empty());
}

// A communicator never freed: a test whose wait the watchdog ended leaves a member's unmatched
// message in flight, and a freed communicator's context id may be reused by the next one,
// whose first receive would take it.
mpi::mpi_communicator& leaked_communicator(mpi::mpi_options o = {}) {
  return *new mpi::mpi_communicator(o);
}

TEST(mpi_comm, nonblocking_wait_watchdog_names_the_call_and_abandons_it) {
  std::vector<std::int64_t> counts(2, 2);
  std::vector<double> send(4), recv(4, -1.0), want(4);
  const int me = comm().rank();
  const bool member = me < 2;
  for (int j = 0; j < 2 && member; ++j)
    for (int e = 0; e < 2; ++e) {
      send[j * 2 + e] = value<double>(80, me, j * 2 + e);
      want[j * 2 + e] = value<double>(80, j, me * 2 + e);
    }
  // verify_calls off: nothing is exchanged at start, so a member that never starts the call is
  // noticed by the waiting member's watchdog (with verify_calls it is named at the start).
  mpi::mpi_options o;
  o.verify_calls = false;
  auto& raw = leaked_communicator(o);
  flight_recorder fr;
  raw.set_flight_recorder(&fr);
  const comm_group pair{"t.nb_pair", {0, 1}};
  if (member) raw.barrier(pair);
  if (me == 0) {
    raw.set_timeout(std::chrono::milliseconds(300));
    auto h = raw.start_all_to_all(pair, send.data(), counts, recv.data(), counts, dtype::f64,
                                  tagged("t.nb_late"));
    const auto msg = expect_throw<error>([&] { raw.wait(h); });
    EXPECT_NE(msg.find("watchdog: nonblocking all_to_all #1 (t.nb_late) on group 't.nb_pair'"),
              std::string::npos)
        << msg;
    EXPECT_TRUE(raw.pending().empty());
    // The flight record shows the call started and never completed: its wait failed.
    const auto calls = fr.calls(0);
    ASSERT_FALSE(calls.empty());
    EXPECT_EQ(calls.back().call.tag, "t.nb_late");
    EXPECT_TRUE(calls.back().call.async);
    EXPECT_EQ(calls.back().call.state, "started");
    EXPECT_NE(calls.back().error.find("watchdog"), std::string::npos) << calls.back().error;
  }
  comm().barrier(world_group());  // rank 1 starts its call only after rank 0 gave up
  if (me == 1) {
    // Rank 0's send was let go, so the late member still gets its block.
    auto h = raw.start_all_to_all(pair, send.data(), counts, recv.data(), counts, dtype::f64,
                                  tagged("t.nb_late"));
    raw.wait(h);
    EXPECT_EQ(count_wrong(recv, want), 0);
  }
  comm().barrier(world_group());
  if (me == 0) {
    // Its receive was cancelled: the late block never lands in the buffer the call gave up.
    EXPECT_EQ(recv[2], -1.0);
    EXPECT_EQ(recv[3], -1.0);
  }
}

/// Runs a scenario timed in wall-clock milliseconds at a time unit u = 1, then 2, then 4 (every
/// deadline, pause and bound of the scenario times u, on a fresh communicator each time) until
/// one run passes on every rank. The scenarios' claims are about order and naming (who is
/// silent, where a chain ends), and hold at any u; what breaks them on a loaded machine is a
/// rank starved of its core for longer than half a deadline (its heartbeats late, a busy rank
/// then reads as silent). A loaded machine gets a slower verdict, not a different one: a
/// mistake in the watchdog fails at every u, and the last run's failures are the test's.
/// Before each run the members of `groups` meet in each of them on the fresh communicator, and
/// every rank at a world barrier; `scenario(raw, u)` returns what went wrong on this rank (""
/// when nothing); every rank then meets the others at a barrier.
void at_growing_time_units(
    const std::vector<comm_group>& groups,
    const std::function<std::string(mpi::mpi_communicator&, int)>& scenario) {
  for (int u = 1;; u *= 2) {
    std::string problem;
    try {
      auto& raw = leaked_communicator();
      for (const auto& g : groups)  // every group's communicator exists before the scenario
        if (g.index_of(comm().rank()) >= 0) raw.barrier(g);
      comm().barrier(world_group());
      problem = scenario(raw, u);
    } catch (const std::exception& e) {
      problem = fmt::format("unexpected error: {}", e.what());
    }
    comm().barrier(world_group());
    int failed = problem.empty() ? 0 : 1;
    comm().all_reduce(world_group(), &failed, 1, dtype::i32, tagged("t.unit"));
    if (failed == 0) return;
    if (u == 4) {
      EXPECT_EQ(problem, "") << "at time units 1, 2 and 4";
      return;
    }
    if (!problem.empty())
      fmt::print(stderr, "[rank {}] at time unit {}: {} — again at {}\n", comm().rank(), u, problem,
                 2 * u);
  }
}

/// "" when `text` holds `part`, else what is missing.
std::string holds(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos ? "" : fmt::format("'{}' not in: {}", part, text);
}

/// The message of the error fn throws, or a problem when it throws none.
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const error& e) {
    return e.what();
  }
  return "";
}

// The watchdog follows waits to their end (issue 33): rank 1 waits for rank 0, which waits for
// rank 2, which is busy in code of its own without heartbeats (silent). Rank 1's deadline is
// the shortest, so it is the first to give up, and it must name rank 2, through rank 0.
TEST(mpi_comm, watchdog_follows_the_wait_chain_to_the_silent_rank) {
  if (comm().world_size() < 3) GTEST_SKIP() << "needs 3 ranks";
  const int me = comm().rank();
  const comm_group x{"t.chain_x", {0, 2}}, y{"t.chain_y", {0, 1}};
  at_growing_time_units({x, y}, [&](mpi::mpi_communicator& raw, int u) -> std::string {
    const auto ms = [u](int n) { return std::chrono::milliseconds(n * u); };
    int value = 1;
    std::string problem;
    if (me == 0) {
      raw.set_timeout(ms(2000));
      const auto msg = error_of([&] { raw.all_reduce(x, &value, 1, dtype::i32, tagged("t.x")); });
      problem = holds(msg, "the wait ends at rank 2 (silent for");
    } else if (me == 1) {
      raw.set_timeout(ms(1000));
      const auto msg = error_of([&] { raw.all_reduce(y, &value, 1, dtype::i32, tagged("t.y")); });
      for (const char* part :
           {"the wait ends at rank 2 (silent for",
            "rank 1 waits for rank 0, which waits in all_reduce #1 (t.x) on 't.chain_x' for rank 2",
            "members that never arrived: rank 0 (alive", " waited "})
        if (problem.empty()) problem = holds(msg, part);
      // The deadline is the deadline: it fired after 1 s of waiting (plus the probe of the
      // silent rank's host), not after twice that.
      if (problem.empty()) {
        const double waited = std::stod(msg.substr(msg.find(" waited ") + 8));
        if (!(waited >= 1.0 * u && waited < 1.6 * u))
          problem =
              fmt::format("waited {} s, not within [{}, {}) s: {}", waited, 1.0 * u, 1.6 * u, msg);
      }
    } else if (me == 2) {
      std::this_thread::sleep_for(ms(2600));  // never joins t.x
    }
    return problem;
  });
}

// Where the chains end at a busy rank and at a silent one, the silent one is named first (it is
// the likelier culprit): rank 3 waits for rank 0, which waits in t.sx for ranks 1 and 2; rank 1
// is busy in local work (heartbeats say so), rank 2 sleeps without a word. The breadth-first
// walk meets rank 1 first; the message must still lead with rank 2.
TEST(mpi_comm, watchdog_names_silent_chain_ends_before_busy_ones) {
  if (comm().world_size() < 4) GTEST_SKIP() << "needs 4 ranks";
  const int me = comm().rank();
  const comm_group x{"t.sx", {0, 1, 2}}, w{"t.sw", {0, 3}};
  at_growing_time_units({x, w}, [&](mpi::mpi_communicator& raw, int u) -> std::string {
    const auto ms = [u](int n) { return std::chrono::milliseconds(n * u); };
    int value = 1;
    std::string problem;
    if (me == 0) {
      // Its own deadline keeps moving while rank 1 is busy; its heartbeats (every quarter of
      // the deadline) keep it alive in rank 3's eyes. Ranks 1 and 2 join after the pause: the
      // call completes.
      raw.set_timeout(ms(1000));
      raw.all_reduce(x, &value, 1, dtype::i32, tagged("t.sx"));
      if (value != 3) problem = fmt::format("t.sx summed to {}, not 3", value);
    } else if (me == 1) {
      raw.set_timeout(ms(1000));
      raw.while_busy(x, [&] { std::this_thread::sleep_for(ms(2600)); });
      raw.all_reduce(x, &value, 1, dtype::i32, tagged("t.sx"));
    } else if (me == 2) {
      // Silent until after rank 3 has given up (~1 s), then joins — before rank 1 (else rank
      // 0, left waiting for the silent rank alone, would give up too).
      std::this_thread::sleep_for(ms(2000));
      raw.set_timeout(ms(2000));  // rank 0 may have given up, on a starved run
      raw.all_reduce(x, &value, 1, dtype::i32, tagged("t.sx"));
    } else if (me == 3) {
      raw.set_timeout(ms(1000));
      const auto msg = error_of([&] { raw.all_reduce(w, &value, 1, dtype::i32, tagged("t.sw")); });
      const auto silent = msg.find("the wait ends at rank 2 (silent for");
      const auto busy = msg.find("the wait ends at rank 1 (alive");
      problem = holds(msg,
                      "rank 3 waits for rank 0, which waits in all_reduce #1 (t.sx) on "
                      "'t.sx' for rank");
      if (silent == std::string::npos || busy == std::string::npos || busy < silent)
        problem = fmt::format("the silent rank 2 is not named before the busy rank 1: {}", msg);
    }
    return problem;
  });
}

// Two ranks, each waiting for the other in a different group: a deadlock, named as a cycle.
TEST(mpi_comm, watchdog_names_a_cycle_of_waits_as_a_deadlock) {
  const int me = comm().rank();
  const comm_group a{"t.cycle_a", {0, 1}}, b{"t.cycle_b", {0, 1}};
  at_growing_time_units({a, b}, [&](mpi::mpi_communicator& raw, int u) -> std::string {
    if (me >= 2) return "";
    raw.set_timeout(std::chrono::milliseconds(1200 * u));
    int value = 1;
    const auto msg = error_of([&] {
      if (me == 0)
        raw.all_reduce(a, &value, 1, dtype::i32, tagged("t.a"));
      else
        raw.all_reduce(b, &value, 1, dtype::i32, tagged("t.b"));
    });
    return holds(msg, me == 0 ? "a cycle of waits (deadlock): rank 0 waits for rank 1, which "
                                "waits in all_reduce #1 (t.b) on 't.cycle_b' for rank 0"
                              : "a cycle of waits (deadlock): rank 1 waits for rank 0, which "
                                "waits in all_reduce #1 (t.a) on 't.cycle_a' for rank 1");
  });
}

/// Prints this rank's failures (ranks other than 0 have no default printer).
class rank_failure_printer : public ::testing::EmptyTestEventListener {
 public:
  explicit rank_failure_printer(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      fmt::print(stderr, "[rank {}] {}:{}: failure\n{}\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  // The watchdog tests leave unmatched messages behind on purpose; UCX would list each at exit.
  setenv("UCX_LOG_LEVEL", "error", 0);
  seqpar::mpi::mpi_session session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (session.rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new rank_failure_printer(session.rank()));
  }
  if (session.size() < 2) {
    fmt::print(stderr, "run under mpiexec -n 2 or more (got {} process)\n", session.size());
    return 77;
  }
  int failed = 0;
  {
    seqpar::mpi::mpi_communicator world;
    g_comm = &world;
    failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    // Every process exits with the same code: failed anywhere means failed.
    seqpar::comm_group all{"t.exit", {}};
    for (int r = 0; r < session.size(); ++r) all.ranks.push_back(r);
    world.all_reduce(all, &failed, 1, seqpar::dtype::i32);
    g_comm = nullptr;
  }
  if (session.rank() == 0)
    fmt::print("{} on {} processes\n", failed ? "FAILED" : "PASSED", session.size());
  return failed ? 1 : 0;
}
