#pragma once
// A communicator that forwards every call (with its tag) to an inner one: the base of
// test-side decorators that change one kind of call (tests/support/bugs.hpp, failing_comm.hpp).
#include <map>
#include <string>

#include "core/communicator.hpp"

namespace seqpar::test {

/// Forwards every call and its op_info to `inner()`; a decorator overrides what it changes and
/// reads the call's tag with call_info().
class forwarding_communicator : public communicator {
 public:
  explicit forwarding_communicator(communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void while_busy(const comm_group& g, const std::function<void()>& work) override {
    inner_.while_busy(g, work);
  }

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override {
    inner_.all_to_all(g, send, send_counts, recv, recv_counts, t, call_info());
  }
  void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                     dtype t) override {
    inner_.all_gather(g, send, count, recv, t, call_info());
  }
  void do_reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                         dtype t) override {
    inner_.reduce_scatter(g, send, recv, count, t, call_info());
  }
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override {
    inner_.all_reduce(g, buf, count, t, call_info());
  }
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override {
    inner_.send_recv(g, ops, t, call_info());
  }
  void do_barrier(const comm_group& g) override { inner_.barrier(g, call_info()); }
  std::int64_t do_start_all_to_all(const comm_group& g, const void* send,
                                   std::span<const std::int64_t> send_counts, void* recv,
                                   std::span<const std::int64_t> recv_counts, dtype t) override {
    const auto token = next_token_++;
    handles_.emplace(
        token, inner_.start_all_to_all(g, send, send_counts, recv, recv_counts, t, call_info()));
    tags_[token] = call_info().tag;
    return token;
  }
  void do_wait(std::int64_t token) override {
    auto it = handles_.find(token);
    comm_handle h = std::move(it->second);
    handles_.erase(it);
    inner_.wait(h);
  }
  /// The tag of the nonblocking call `token` names (for decorators that reorder waits).
  const std::string& tag_of(std::int64_t token) const { return tags_.at(token); }
  /// The token of the latest nonblocking call started with `tag`.
  std::int64_t token_of(const std::string& tag) const {
    std::int64_t found = -1;
    for (const auto& [token, t] : tags_)
      if (t == tag) found = token;
    return found;
  }

  communicator& inner() { return inner_; }

 private:
  communicator& inner_;
  std::map<std::int64_t, comm_handle> handles_;
  std::map<std::int64_t, std::string> tags_;
  std::int64_t next_token_ = 0;
};

}  // namespace seqpar::test
