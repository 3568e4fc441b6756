#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "core/communicator.hpp"

namespace seqpar {

/// The one fault a faulty_communicator injects. "Chunk" = the block a rank receives from one
/// group member (all_to_all, all_gather) or the message of a recv (send_recv).
enum class fault_kind {
  none,
  drop_chunk,       ///< the chunk from member `peer` arrives as zeros
  duplicate_chunk,  ///< the chunk from `peer` is also written over `other_peer`'s chunk
  permute_chunks,   ///< received chunks come in reverse member order
  wrong_count,      ///< the count for `peer` is off by one, as given to the transport
  swap_peers,       ///< the chunks from `peer` and `other_peer` trade places
  sum_off_by_one,   ///< a reduction's first result element one too large (a count off by one)
};

/// "drop_chunk", … (the enumerator's name).
std::string_view fault_kind_name(fault_kind k);

/// Which call a fault hits and how. Only calls issued by global rank `rank` that match `op`
/// and `tag` and for which the kind is meaningful (see faulty_communicator) are counted;
/// the `call`-th of them (from 0) is hit, or, with `every_call`, that one and all later ones.
struct fault_spec {
  fault_kind kind = fault_kind::none;
  int rank = 0;             ///< global rank whose results are corrupted
  std::string op;           ///< all_to_all, all_gather, …; empty = any op
  std::string tag;          ///< substring the call's tag must contain; empty = any tag
  std::int64_t call = 0;    ///< index among the matching calls of `rank`
  bool every_call = false;  ///< hit every matching call from `call` on
  int peer = 0;             ///< group member index (not global rank) of the chunk hit
  int other_peer = 1;       ///< second member index: duplicate_chunk target, swap_peers partner
};

/// A fault from its text, as `seqpar check --fault` and `seqpar record --fault` take it:
/// KIND[:key=value,…] with KIND one of drop_chunk, duplicate_chunk, permute_chunks, wrong_count,
/// swap_peers and keys rank, op, tag, call, peer, other (the other_peer) and the flag every
/// (every matching call from `call` on), e.g. "drop_chunk:rank=1,op=all_to_all,tag=q.fwd".
/// config_error naming the part, the value and what is allowed.
fault_spec parse_fault(std::string_view text);

/// A communicator that forwards every call (with its tag) to `inner` and corrupts the result
/// of the configured call on the configured rank, to test that checkers catch transport and
/// layout bugs. Records go through this object's own recorder; a recorder attached to `inner`
/// instead sees what reached the transport (wrong_count shows there).
///
/// Per op (member indices a = peer, b = other_peer; a call where the named members or
/// messages do not exist is not a match):
/// - all_to_all, all_gather: drop zeroes chunk a; duplicate copies chunk a over chunk b (the
///   shorter length); permute lays the chunks out in reverse member order; swap lays them out
///   with a and b exchanged; wrong_count passes send count a (all_to_all) or the count
///   (all_gather) one lower (one higher when 0), which the transport must reject.
/// - reduce_scatter, all_reduce (one reduced block): drop zeroes the result; duplicate adds it
///   twice (result + result); permute reverses its element order; wrong_count as above;
///   swap_peers is not meaningful.
/// - send_recv: chunks are the recvs in posting order, "chunk a" the first recv from member a;
///   drop/duplicate/swap act on those buffers (shorter length), permute gives recv i the data
///   of recv n-1-i; wrong_count changes the count of the first op (send or recv) with peer a.
/// - barrier: never hit.
class faulty_communicator : public communicator {
 public:
  faulty_communicator(communicator& inner, fault_spec spec);
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }

  const fault_spec& spec() const { return spec_; }
  /// Number of calls corrupted so far.
  std::int64_t hits() const { return hits_; }

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                     dtype t) override;
  void do_reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                         dtype t) override;
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override;
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override;
  void do_barrier(const comm_group& g) override;

 private:
  /// Counts a matching call and says whether it is the one (or one of those) to corrupt.
  bool hit(const char* op, bool meaningful);

  communicator& inner_;
  fault_spec spec_;
  std::int64_t matches_ = 0;
  std::int64_t hits_ = 0;
};

}  // namespace seqpar
