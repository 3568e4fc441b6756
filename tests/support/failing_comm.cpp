#include "support/failing_comm.hpp"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "core/error.hpp"

namespace seqpar::test {

failure_spec parse_failure(failure_spec::action what, const std::string& text) {
  failure_spec f;
  f.what = what;
  const auto c1 = text.find(':');
  const auto c2 = c1 == std::string::npos ? c1 : text.find(':', c1 + 1);
  try {
    if (c1 == std::string::npos || c1 == 0 || c1 + 1 == text.size())
      throw std::invalid_argument("");
    std::size_t used = 0;
    f.rank = std::stoi(text.substr(0, c1), &used);
    if (used != c1 || f.rank < 0) throw std::invalid_argument("");
    f.tag = text.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
    if (c2 != std::string::npos) {
      f.call = std::stoll(text.substr(c2 + 1), &used);
      if (used != text.size() - c2 - 1 || f.call < 0) throw std::invalid_argument("");
    }
  } catch (const std::logic_error&) {
    fail<config_error>("failure point '{}' is not RANK:TAG or RANK:TAG:N (e.g. 1:loss.sum)", text);
  }
  return f;
}

namespace {

// Creates the mark file; with `wait`, blocks until the harness removes it (at most 20 s).
void mark(const std::string& file, bool wait) {
  if (std::FILE* f = std::fopen(file.c_str(), "w")) std::fclose(f);
  for (int k = 0; wait && k < 4000; ++k) {
    if (std::FILE* f = std::fopen(file.c_str(), "r")) {
      std::fclose(f);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } else {
      break;
    }
  }
}

}  // namespace

void failing_communicator::after(bool hit) {
  if (hit && spec_.when == failure_spec::moment::after) mark(spec_.mark_file, true);
}

bool failing_communicator::maybe_fail(const char* op, const comm_group& g) {
  if (spec_.what == failure_spec::action::none || rank() != spec_.rank) return false;
  const auto& tag = call_info().tag;
  if (spec_.tag != "*" && spec_.tag != tag) return false;
  if (matches_++ != spec_.call) return false;
  if (spec_.what == failure_spec::action::mark) {
    if (spec_.when != failure_spec::moment::after)
      mark(spec_.mark_file, spec_.when == failure_spec::moment::before);
    return true;
  }
  if (spec_.what == failure_spec::action::kill) {
    std::fflush(stdout);
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  if (spec_.what == failure_spec::action::stop) {
    std::fflush(stdout);
    std::fflush(stderr);
    std::raise(SIGSTOP);
    return false;  // resumed (SIGCONT): go on with the call
  }
  if (spec_.what == failure_spec::action::stall) {
    std::this_thread::sleep_for(std::chrono::milliseconds(spec_.stall_ms));
    return false;
  }
  fail<error>("injected failure: rank {} throws at {} ({}) on group '{}'", rank(), op, tag, g.name);
}

void failing_communicator::do_all_to_all(const comm_group& g, const void* send,
                                         std::span<const std::int64_t> send_counts, void* recv,
                                         std::span<const std::int64_t> recv_counts, dtype t) {
  const bool hit = maybe_fail("all_to_all", g);
  forwarding_communicator::do_all_to_all(g, send, send_counts, recv, recv_counts, t);
  after(hit);
}

void failing_communicator::do_all_gather(const comm_group& g, const void* send, std::int64_t count,
                                         void* recv, dtype t) {
  const bool hit = maybe_fail("all_gather", g);
  forwarding_communicator::do_all_gather(g, send, count, recv, t);
  after(hit);
}

void failing_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                             std::int64_t count, dtype t) {
  const bool hit = maybe_fail("reduce_scatter", g);
  forwarding_communicator::do_reduce_scatter(g, send, recv, count, t);
  after(hit);
}

void failing_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                         dtype t) {
  const bool hit = maybe_fail("all_reduce", g);
  forwarding_communicator::do_all_reduce(g, buf, count, t);
  after(hit);
}

void failing_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  const bool hit = maybe_fail("send_recv", g);
  forwarding_communicator::do_send_recv(g, ops, t);
  after(hit);
}

void failing_communicator::do_barrier(const comm_group& g) {
  const bool hit = maybe_fail("barrier", g);
  forwarding_communicator::do_barrier(g);
  after(hit);
}

}  // namespace seqpar::test
