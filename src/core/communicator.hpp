#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace seqpar {

class flight_recorder;

/// A process group: an ordered list of global ranks and a name ("ulysses0", "ring1", …).
/// Group-relative index i means ranks[i]; per-peer counts are in that order.
struct comm_group {
  std::string name;
  std::vector<int> ranks;

  int size() const { return static_cast<int>(ranks.size()); }
  /// Position of global rank `global` in this group, or -1.
  int index_of(int global) const;
};

/// One recorded call: the same record is a `seqpar-trace/1` line (DESIGN.md).
struct comm_record {
  std::string kind = "collective";  ///< "collective" or "p2p"
  int rank = 0;                     ///< global rank that issued the call
  std::string group;
  std::int64_t seq = 0;  ///< calls per (rank, group), from 0
  std::string op;  ///< all_to_all, all_gather, reduce_scatter, all_reduce, barrier, send, recv
  dtype type = dtype::f32;
  std::vector<std::int64_t> in_shape, out_shape;    ///< collectives
  std::vector<std::int64_t> in_splits, out_splits;  ///< all_to_all: elements per peer
  int peer = -1;                                    ///< p2p: global rank of the peer
  std::vector<std::int64_t> shape;                  ///< p2p: message shape
  std::string tag;                                  ///< e.g. "L0.attn.qkv.fwd"
  std::string state = "completed";
  /// Nonblocking calls: the handle of a call started with start_all_to_all (kind "collective",
  /// `async` true) and of its completion (kind "wait"); -1 for blocking calls.
  std::int64_t handle = -1;
  bool async = false;
};

/// Receives every call made through a communicator when attached. Thread-safe.
class comm_recorder {
 public:
  void add(comm_record r);
  std::vector<comm_record> records() const;  ///< in (rank, arrival) order
  void clear();

 private:
  mutable std::mutex mu_;
  std::vector<comm_record> recs_;
};

/// Shapes and tag describing a call, for recording and for error messages.
struct op_info {
  std::string tag;
  std::vector<std::int64_t> in_shape, out_shape;
};

/// A point-to-point message in a batched send/recv (group-relative peer index).
struct p2p_op {
  enum class kind { send, recv } dir;
  int peer;   ///< index into the group
  void* buf;  ///< const for sends
  std::int64_t count;
  std::vector<std::int64_t> shape;  ///< for recording; empty = {count}
};

/// A nonblocking call in flight (communicator::start_all_to_all). Complete it with
/// communicator::wait exactly once, before reading its receive buffer or writing its send
/// buffer; waiting invalidates it. Move-only.
class comm_handle {
 public:
  comm_handle() = default;
  comm_handle(const comm_handle&) = delete;
  comm_handle& operator=(const comm_handle&) = delete;
  comm_handle(comm_handle&& o) noexcept : id_(o.id_) { o.id_ = -1; }
  comm_handle& operator=(comm_handle&& o) noexcept {
    id_ = o.id_;
    o.id_ = -1;
    return *this;
  }
  bool valid() const { return id_ >= 0; }
  std::int64_t id() const { return id_; }

 private:
  friend class communicator;
  explicit comm_handle(std::int64_t id) : id_(id) {}
  std::int64_t id_ = -1;
};

/// Transport interface the SP algorithms are written against (SPMD: one object per rank).
/// Buffers live in the backend's memory space (host for sim/MPI, device for NCCL).
/// The public calls record (when a recorder is attached) and forward to the backend.
/// Reductions are SUM. Every member of `g` must make the same calls in the same order.
class communicator {
 public:
  virtual ~communicator() = default;
  virtual int rank() const = 0;  ///< global rank
  virtual int world_size() const = 0;

  /// Rank i sends send_counts[j] elements (contiguous, in peer order) to group member j and
  /// receives recv_counts[j] from member j, stored contiguously in peer order.
  void all_to_all(const comm_group& g, const void* send, std::span<const std::int64_t> send_counts,
                  void* recv, std::span<const std::int64_t> recv_counts, dtype t,
                  const op_info& info = {});
  /// recv = concatenation over members of their `count` elements.
  void all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv, dtype t,
                  const op_info& info = {});
  /// send holds size·count elements; member i receives the SUM over members of block i.
  void reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                      dtype t, const op_info& info = {});
  /// In-place SUM over the group.
  void all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t,
                  const op_info& info = {});
  /// Posts all ops, then completes them all (no ordering deadlock between sends and recvs).
  void send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t,
                 const op_info& info = {});
  void barrier(const comm_group& g, const op_info& info = {});

  /// Nonblocking all_to_all (MPI_Ialltoallv / NCCL on a communication stream): the same
  /// contract as all_to_all, completed by wait(). Every member starts its calls in the same
  /// order; waits may come in any order. Until the wait, the send buffer must not change and
  /// the receive buffer holds no defined data (the in-process backend fills it with a NaN
  /// pattern). The handle numbers a rank's nonblocking calls from 0.
  comm_handle start_all_to_all(const comm_group& g, const void* send,
                               std::span<const std::int64_t> send_counts, void* recv,
                               std::span<const std::int64_t> recv_counts, dtype t,
                               const op_info& info = {});
  /// Completes a started call; `h` becomes invalid. A handle that is invalid, already waited
  /// or not this communicator's throws, naming it.
  void wait(comm_handle& h);
  /// Tags of the calls started and not yet waited, in start order.
  std::vector<std::string> pending() const;

  /// Runs `work`, local to this rank, while the other members of `g` may be waiting for it in
  /// a call: backends with a watchdog keep them informed that this rank is alive (MPI sends
  /// heartbeats); the default just runs it.
  virtual void while_busy(const comm_group& g, const std::function<void()>& work) {
    (void)g;
    work();
  }

  void set_recorder(comm_recorder* r) { recorder_ = r; }
  comm_recorder* recorder() const { return recorder_; }
  /// Keeps this rank's recent calls, each marked started before the transport runs it and
  /// completed (or failed) after (core/flight_recorder.hpp). Attach it to the transport, not
  /// to a decorator, so that a call a decorator drops is not in the record.
  void set_flight_recorder(flight_recorder* f) { flight_ = f; }
  flight_recorder* flight() const { return flight_; }

 protected:
  virtual void do_all_to_all(const comm_group& g, const void* send,
                             std::span<const std::int64_t> send_counts, void* recv,
                             std::span<const std::int64_t> recv_counts, dtype t) = 0;
  virtual void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                             dtype t) = 0;
  virtual void do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                 std::int64_t count, dtype t) = 0;
  virtual void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) = 0;
  virtual void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) = 0;
  virtual void do_barrier(const comm_group& g) = 0;
  /// Starts a nonblocking all_to_all; returns a token that do_wait receives. The default
  /// completes the call at once with do_all_to_all (correct, without overlap), for backends
  /// with no nonblocking transport.
  virtual std::int64_t do_start_all_to_all(const comm_group& g, const void* send,
                                           std::span<const std::int64_t> send_counts, void* recv,
                                           std::span<const std::int64_t> recv_counts, dtype t);
  /// Completes the call `token` names (default: nothing left to do).
  virtual void do_wait(std::int64_t token) { (void)token; }

  /// The op_info of the public call being served: valid only inside a do_* override
  /// (wrappers forward it, backends name the tag in their errors).
  const op_info& call_info() const { return info_ ? *info_ : no_info_; }

 private:
  comm_record base_record(const comm_group& g, const char* op, dtype t, const op_info& info);
  /// base_record of an all_to_all, its counts checked and recorded as splits.
  comm_record all_to_all_record(const comm_group& g, std::span<const std::int64_t> send_counts,
                                std::span<const std::int64_t> recv_counts, dtype t,
                                const op_info& info);
  /// Runs the transport call `run` between the flight recorder's begin and end.
  template <class F>
  void in_flight(const comm_record& r, const comm_group& g, F&& run);
  comm_recorder* recorder_ = nullptr;
  flight_recorder* flight_ = nullptr;
  const op_info* info_ = nullptr;  ///< the current call's; see call_info()
  static inline const op_info no_info_{};
  std::map<std::string, std::int64_t> seq_;  ///< per group name
  /// A started nonblocking call: its record (for the wait's), the backend's token, the flight
  /// recorder's token and the op_info (its tag stays valid for do_wait's call_info()).
  struct started_call {
    comm_record rec;
    comm_group group;
    op_info info;
    std::int64_t token = 0;
    std::uint64_t flight_token = 0;
  };
  std::map<std::int64_t, started_call> started_;
  std::int64_t next_handle_ = 0;
};

}  // namespace seqpar
