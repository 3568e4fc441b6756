#pragma once
// Where an SP step first departs: every collective of a rerun of the step is captured (what each
// rank sent and received), and each call's received data is checked against what the senders'
// data imply (an all-to-all delivers member j's j-th… chunk, an all-gather concatenates, a
// reduction sums, a message arrives as sent). The first call, in the order the ranks issue
// them, whose received data differ is the first departure; its wrong chunks are classified
// (dropped: zeros; another member's chunk; reversed order; a reduction doubled or zeroed) and,
// for the Ulysses all-to-alls, mapped to the global tokens they carry.
#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/communicator.hpp"
#include "core/compute.hpp"
#include "core/heatmap.hpp"
#include "core/scenario.hpp"

namespace seqpar::verify {

/// Sorted distinct values as runs: "3–7, 12" (at most six runs, then "…"); the tokens of a
/// departure's message.
std::string value_runs(std::vector<std::int64_t> xs);

/// Element i of a captured buffer as a double (floating dtypes; integers as their value).
double captured_value(const std::vector<unsigned char>& b, std::size_t i, dtype t);

/// One collective of one rank, with its data.
struct call_capture {
  int rank = 0;            ///< global rank that issued it
  std::int64_t order = 0;  ///< its position among this rank's calls
  std::string op, tag, group;
  std::vector<int> members;  ///< the group's global ranks
  std::int64_t seq = 0;      ///< calls of this rank in this group before it
  dtype type = dtype::f32;
  std::vector<std::int64_t> in_shape, out_shape;
  /// all_to_all: per member (send / receive chunk); all_gather: sent[0] and one received chunk
  /// per member; reductions: sent[0] (the input) and received[0] (the result); send_recv: the
  /// sends and the receives in posting order, with peers (member indices) in send_peer /
  /// recv_peer.
  std::vector<std::vector<unsigned char>> sent, received;
  std::vector<int> send_peer, recv_peer;
};

/// Every call captured by the capturing communicators of one step. Thread-safe.
class capture_log {
 public:
  void add(call_capture c);
  std::vector<call_capture> calls() const;

 private:
  mutable std::mutex mu_;
  std::vector<call_capture> calls_;
};

/// Captured calls as one message and back (the MPI check moves each rank's to rank 0).
std::string pack_calls(const std::vector<call_capture>& calls);
std::vector<call_capture> unpack_calls(std::string_view packed);

/// Every member's `mine` on member 0 of `g` (in member order; the others get an empty list), of
/// any lengths: the lengths are gathered first, then the bytes (as 8-byte words) by one
/// all-to-all in which only member 0 receives.
std::vector<std::string> gather_to_first(communicator& comm, const comm_group& g,
                                         const std::string& mine, const std::string& tag);

/// A communicator that forwards every call to `inner` and adds what was sent and received to
/// `log` (tags and groups as given). Nonblocking all-to-alls complete at once through it.
/// Buffers in a backend's memory (a device) are read through `memory` (compute::read_bytes);
/// none: host memory.
std::unique_ptr<communicator> capturing_communicator(communicator& inner, capture_log& log,
                                                     compute* memory = nullptr);

/// The first departure of a step.
struct divergence {
  std::string pass;   ///< "forward", "backward" (from the tag) or "" (gradient sync, other)
  std::string layer;  ///< "L0", … or ""
  std::string op, tag, group;
  std::int64_t call = 0;   ///< the call's index among the group's calls (seq)
  std::vector<int> ranks;  ///< global ranks whose received data differ
  std::string tokens;      ///< "tokens 14–20" (global, of the unpadded row) or ""
  std::string cause;       ///< what the wrong data are, e.g. "a chunk was dropped"
  std::string line;        ///< the whole sentence the report leads with
  /// (receiving global rank, token of the unpadded row) of every wrong value's row, for the
  /// picture of the departure (padding left out).
  std::vector<std::pair<int, std::int64_t>> wrong_tokens;
};

/// The global tokens a rank's rows hold, for the token ranges of a divergence: row i of global
/// rank k → position in the unpadded row (≥ the row's length: padding). `gathered`: the rows
/// after the Ulysses all-to-all (every token of the rank's ring rank), else its local rows.
using token_map = std::function<std::vector<std::int64_t>(int rank, bool gathered)>;

/// The first call whose received data differ from what its senders' data imply; nullopt when
/// every captured call is consistent (the departure is then in computation, not transport).
std::optional<divergence> first_divergence(const std::vector<call_capture>& calls,
                                           const token_map& tokens, std::int64_t row_length);

/// Every rank's (or the reference's, as rank −1) layer stages of one step, float64 rows:
/// (rank, layer, stage) → [tokens, hidden] (sim::sp_env::tap_layer, ref::layer_tap). Thread-safe.
class layer_trace {
 public:
  void add(int rank, int layer, const std::string& stage, Eigen::MatrixXd rows);
  const Eigen::MatrixXd* get(int rank, int layer, const std::string& stage) const;
  /// Every boundary recorded here as one message (pack), and another trace's added (merge).
  std::string pack() const;
  void merge(std::string_view packed);

 private:
  mutable std::mutex mu_;
  std::map<std::tuple<int, int, std::string>, Eigen::MatrixXd> rows_;
};

/// What the reference of a ring's steps needs: the layout and the row's documents.
struct ring_step_layout {
  scenario scen;                ///< layers, U, R, heads, KV heads, head_dim (scale 1/√head_dim)
  std::int64_t row_length = 0;  ///< tokens of the unpadded row
  std::vector<std::int64_t> doc_of;  ///< document index of each token (< row_length)
  /// The padded-row index of each row a ring rank holds, in the gathered order.
  std::function<std::vector<std::int64_t>(int ring_rank)> ring_rows;
  /// Each layer's sink logit per query head (empty: the layer has no sinks).
  std::vector<std::vector<double>> sinks;
};

/// Each ring step's partial result as the correct schedule makes it, per SP rank, from the
/// reference's own q, k, v (rank −1's "q", "k", "v" of `trace`): global rank k's step i is its
/// ring rank's rows against the KV block of ring rank (r − i) mod R, its Ulysses head slice,
/// each query seeing the keys of the block in its own document at or before it (softmax in
/// float64; a row that sees none: 0 and −∞). Added as rank −2 − k, stages "ring_out.step<i>"
/// [rows, heads·d] and "ring_lse.step<i>" [rows, heads]. Where the trace also holds the
/// reference's attention output and its gradient ("attn", "d_attn"), each step's own backward
/// contributions too, from the whole row's softmax (P = e^(S − LSE) with the row's full LSE —
/// a layer's sink column in it, which has no value and no key —; dS = P∘(dO·Vᵀ − D), D = dO·O,
/// through the cap's slope):
/// "ring_dq.step<i>" [rows, heads·d] (scale·dS·K over the block's keys), "ring_dk.step<i>" and
/// "ring_dv.step<i>" [block rows, local KV heads·d] (scale·dSᵀ·Q and Pᵀ·dO of the rank's
/// queries, summed over each local KV head's query heads; rows in the block owner's gathered
/// order). Memory O(256 × keys) per product.
void add_ring_step_references(layer_trace& trace, const ring_step_layout& layout);

/// GatedDeltaNet's stages sharded by heads (between its all-to-alls: "gdn_mixed", "gdn_conv",
/// "gdn_g", "gdn_beta", "gdn_core" and their gradients "d_gdn_…"): the columns of the whole
/// row's reference stage that Ulysses rank u holds, in its order (q|k|v channels as the rank's
/// convolution takes them; its value heads of the gates and of the delta rule's output). Empty
/// for every other stage.
std::vector<Eigen::Index> gdn_head_columns(const scenario& s, const std::string& stage, int u);

/// The first layer stage, in the order the step makes them (each layer's forward stages, a
/// ring's steps among them, then the backward's from the last layer down; sim::sp_env::tap_layer
/// names them), where an SP rank's rows differ from the reference's rows of the same tokens
/// (rank −1 of `trace`, or the rank's own reference −2 − rank for a ring step, rows in the
/// gathered order of `gathered_rows_of`) by more than `tol` × the stage's largest reference
/// value; nullopt when every stage agrees. `rows_of(rank)`: the padded-row index of each local
/// row (≥ row_length: padding, skipped). `step_block_rows_of(rank, step)`: the rows of the KV
/// block a rank's ring step works on (its dK, dV contributions), in their owner's order.
struct layer_departure {
  std::string line;  ///< "layer L0, forward: q projected … differs on ranks 0, 1 at tokens …"
  /// The stage's error over tokens (unpadded row) × ranks, as a fraction of the bound.
  error_heatmap map;
};
std::optional<layer_departure> first_layer_departure(
    const layer_trace& trace, int layers, int ranks,
    const std::function<std::vector<std::int64_t>(int)>& rows_of, std::int64_t row_length,
    double tol, int ring_steps = 0,
    const std::function<std::vector<std::int64_t>(int)>& gathered_rows_of = {},
    const std::function<std::vector<std::int64_t>(int, int)>& step_block_rows_of = {});

/// Where every stage's rows match and the embedding's gradient still fails: each rank's share
/// of it (its input to the step's first "grad." all_reduce, the flat buffer from element
/// `offset`, [vocab, hidden] row-major) against the scatter-add of the rank's own recorded
/// "d_embed" rows (layer −1 of `trace`, divided by `grad_scale`, the factor the backward's
/// taps carry) into the rows of its token ids (`ids_of(rank)`, local order). Says which ranks'
/// shares differ at which ids and why (one token's gradient where the sum of the id's tokens
/// belongs: assigned, not accumulated; rows of ids the rank does not hold); that every share is
/// right (the reduction, or what follows it, is then to blame); nullopt where no reduction or
/// no rows were recorded.
std::optional<std::string> embedding_share_finding(
    const std::vector<call_capture>& calls, const layer_trace& trace,
    const std::function<std::vector<std::int64_t>(int)>& ids_of, int ranks, std::int64_t offset,
    std::int64_t vocab, std::int64_t hidden, double grad_scale);

}  // namespace seqpar::verify
