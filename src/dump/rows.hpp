#pragma once
// The float64 reference of chosen rows of a dumped attention call, read in place from the
// mapped local shards (io/mapped.hpp): O(L·D) per query row and per key row (L its document),
// never the whole row. The engine (engine.hpp) checks the computed stages on it, every row or a
// stratified sample, and the family search (families.hpp) evaluates its mistakes with it.
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "dump/emulate.hpp"
#include "dump/geometry.hpp"
#include "io/mapped.hpp"

namespace seqpar::verify::dump_detail {

/// One call's files, mapped, and where every global token lies in them.
class mapped_call {
 public:
  mapped_call(const dump_set& d, const geometry& g, int call);
  double scale() const { return scale_; }
  bool causal() const { return att_.causal; }
  /// The call's attention options (its own, or the job's).
  const dump_attention& attention() const { return att_; }
  /// The sink logit of every query head ("sinks" [H] in rank 0's forward file); empty without.
  const std::vector<double>& sinks() const { return sinks_; }

  const geometry& g() const { return g_; }
  /// Rank k's tensor of a stage ("grad.*" from the backward file), or nullptr.
  const io::st_view* get(int k, const std::string& stage) const;
  bool any(const std::string& stage) const;
  /// Every rank has the stage with this shape.
  bool all_shaped(const std::string& stage, const std::vector<std::int64_t>& shape) const;
  /// Rank-ordered position of a global token: cp rank = at / s, local row = at % s; ring rank =
  /// at / Sg, gathered row = at % Sg.
  std::int64_t at(std::int64_t token) const { return where_[static_cast<std::size_t>(token)]; }

  /// D values of a global [S, X, D] tensor held as local shards [s, X, D] of `stage`.
  void read_local(const std::string& stage, int X, std::int64_t token, int head, double* out) const;
  /// D values of the job's attention output at (token, head): out.attn where every rank has it
  /// (U > 1), else out.local.
  void read_out(std::int64_t token, int head, double* out) const;
  /// The job's LSE at (token, head), when every rank dumped it; nullopt otherwise.
  bool has_lse() const { return lse_ok_; }
  double read_lse(std::int64_t token, int head) const;
  bool has_backward() const { return backward_; }
  /// Drops the pages read so far from the resident set (every file).
  void release() const;
  /// Counts n row reads; every ~128 MB of pages they may have touched, release(). Reads of one
  /// head's row touch a page each (a token's heads share pages), so the resident set stays at
  /// that much per process whatever the dump's size. Safe from any thread.
  void touched(std::int64_t n = 1) const;
  /// Bytes of the call's files over all ranks, and of the largest rank's.
  std::uint64_t bytes() const { return bytes_; }
  std::uint64_t largest_rank_bytes() const { return largest_; }

 private:
  const geometry& g_;
  std::vector<std::unique_ptr<io::mapped_safetensors>> fwd_, bwd_;
  std::vector<std::int64_t> where_;
  bool out_attn_ = false, lse_ok_ = false, backward_ = false;
  std::uint64_t bytes_ = 0, largest_ = 0;
  double scale_ = 1;
  dump_attention att_;
  std::vector<double> sinks_;
  mutable std::atomic<std::int64_t> reads_{0};
};

/// What the attention computes, as one of a family of mistakes may change it. The default is the
/// reference: the dump's scale, causal, documents from its cu_seqlens.
struct attention_variant {
  double scale = 0;
  bool causal = true;
  /// The mask's window and chunk, and the capping, as dump_attention says (in positions within
  /// each document of `cu`).
  std::int64_t window_back = -1, window_ahead = -1, chunk = 0;
  double softcap = 0;
  /// The sink logit of every query head (empty: none); sink_in_lse false: the output is
  /// renormalised by the sink but the LSE is not (out·sigmoid(lse − sink), the LSE kept).
  std::vector<double> sinks;
  bool sink_in_lse = true;
  /// Positions counted from the packed row's start instead of each document's (chunk
  /// boundaries not per document).
  bool positions_from_row = false;
  /// Capping applied after the mask: hidden keys score −softcap, not −∞ — 1: the document's
  /// (a varlen kernel's call), 2: every key of the row (a dense mask over the whole sequence).
  int cap_after_mask = 0;
  /// A causal key j is visible to query i when j ≤ i + diag (0 correct; −1 hides the diagonal).
  int diag = 0;
  /// Document boundaries (cu_seqlens) the attention uses.
  std::vector<std::int32_t> cu;
  /// Key-side rows: only queries held by the key's own ring rank contribute (a KV gradient not
  /// reduced over the ring).
  bool own_ring_only = false;
  /// dQ's contributions from keys held by another ring rank than the query's, multiplied by
  /// this factor (1: correct; 1/scale: those blocks' dQ without the softmax scale).
  double other_block_dq_factor = 1;
  /// A ring job with one thing changed (emulate.hpp): query rows attend to the explicit key
  /// sets it gives; the backward (dQ, and dK/dV from every query row whose key sets hold the
  /// key) sums over the same sets with the forward's statistics (its `forward` job where set).
  std::shared_ptr<const ring_job> ring;
};

/// A query row: global token and query head.
struct query_row {
  std::int64_t token;
  int head;
};
/// A key row: global token and the query heads whose gradients it sums ([h0, h0 + nh): one
/// repeated copy, or every copy of a KV head for the local stage).
struct key_row {
  std::int64_t token;
  int h0, nh;
};

struct query_result {
  vec out, lse, dq, aq;  ///< [n, D], [n], [n, D], [n, D] (dq, aq with the backward)
};
struct key_result {
  vec dk, dv, ak, av;  ///< [n, D] each
};

/// The reference rows. Query rows: out, LSE, and with the backward dq and its term magnitudes.
/// The term magnitudes a are what each gradient element sums, in magnitude: the reach of a
/// kernel's roundings into it. For a kernel that rounds P and dS to its input dtype before each
/// matrix product (FlashAttention's tensor-core GEMMs do) and forms D_i = Σ_d dO_id·O_id from its
/// own rounded output:
///   aq = scale·(|dS|·|K| + (P·|K|)∘E),  ak = scale·(|dS|ᵀ·|Q| + Pᵀ·(E∘|Q|)),  av = Pᵀ·|dO|,
/// with E_i = Σ_d |dO_id|·(|O_id| + (P·|V|)_id), the reach of the output's error into D_i. To
/// first order the gradient's error is then at most u_in·a + u_g·|grad| per element (u_in the
/// inputs' unit roundoff, u_g the stored gradient's), plus float32 accumulation (u_int·sqrt(L)·a).
/// The score's own rounding inside the kernel moves row i's weights by a relative
/// eps_i = u_int·(2·scale·Σ_d |q_id|·max_j |k_jd| + |lse_i| + ln L): the row's terms are weighted
/// by 1 + eps_i / u_t, u_t = u_in + u_int·sqrt(L). Below the inputs' smallest normal a rounded
/// P or dS entry is off by up to σ_in/2 whatever its size: the magnitudes carry that too, as
/// (σ_in/2)/u_t times z, the same sums with |dP − D| + 1 for each |dS| entry and 1 for each P
/// entry of a visible pair (bounded through the chunk's largest |K|, |Q| or |dO| per column).
/// Key rows: dk, dv and magnitudes, summed over their query heads, from the job's dumped LSE and
/// output when every rank has them (the key's gradient sums over every later query of its
/// document: their statistics are the job's, themselves checked on the sampled query rows),
/// else from a forward pass over those queries. Work spreads over `threads` by (document, KV
/// head); results do not depend on the thread count.
class row_reference {
 public:
  row_reference(const mapped_call& c, bound_units u, int threads);
  /// backward false: out and LSE only.
  query_result queries(const attention_variant& v, const std::vector<query_row>& rows,
                       bool backward = true) const;
  key_result keys(const attention_variant& v, const std::vector<key_row>& rows) const;
  attention_variant reference() const;

 private:
  const mapped_call& c_;
  bound_units u_;
  int threads_;
  /// The reference's statistics of every query row (token·H + head) whose backward queries()
  /// computed: LSE, D_i = Σ_d dO_id·O_id and E_i. keys() uses them where known (every row, in
  /// exhaustive mode: the key gradients' reference is then exact), and elsewhere the job's
  /// dumped LSE and output, checked on the sampled query rows, with E_i bounded by
  /// Σ_d |dO_id|·(|O_id| + w_i·max_j |v_jd|). Written under the mutex by queries()' work items;
  /// keys() only reads it (no queries() runs meanwhile). Sparse: a sample's rows only.
  /// keys() of a ring variant: every query row of the sequence walked for the key sets that
  /// hold each wanted key (O(S · keys per row)).
  void ring_keys(const attention_variant& v, const std::vector<key_row>& rows, key_result& r) const;
  mutable std::mutex stats_mu_;
  mutable std::unordered_map<std::int64_t, std::array<double, 3>> stats_;
};

}  // namespace seqpar::verify::dump_detail
