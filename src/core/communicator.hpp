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

  /// The op_info of the public call being served: valid only inside a do_* override
  /// (wrappers forward it, backends name the tag in their errors).
  const op_info& call_info() const { return info_ ? *info_ : no_info_; }

 private:
  comm_record base_record(const comm_group& g, const char* op, dtype t, const op_info& info);
  /// Runs the transport call `run` between the flight recorder's begin and end.
  template <class F>
  void in_flight(const comm_record& r, const comm_group& g, F&& run);
  comm_recorder* recorder_ = nullptr;
  flight_recorder* flight_ = nullptr;
  const op_info* info_ = nullptr;  ///< the current call's; see call_info()
  static inline const op_info no_info_{};
  std::map<std::string, std::int64_t> seq_;  ///< per group name
};

}  // namespace seqpar
