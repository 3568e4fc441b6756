#pragma once
// What a ring attention job computes, emulated as explicit key sets: for every query row of a
// ring rank, the global keys its merged output averages over. With the correct schedule this is
// the reference's mask (same document, causal); with one thing changed (the KV source off by one,
// cu_seqlens from local position ids) it is what such a broken job computes, which lets
// `validate --dump` name the cause of a difference. Row-wise, O(S) memory per query row.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace seqpar::verify {

/// A zigzag ring (xorl, SEMANTICS.md §4) as one rank's job sees it.
struct ring_job {
  int ring = 1;
  bool causal = true;
  /// Global token ids of every ring rank's local rows, in local order.
  std::vector<std::vector<std::int64_t>> tokens;
  /// The cu_seqlens each ring rank's attention uses on its local rows (q and KV blocks alike);
  /// correct: global cu // R.
  std::vector<std::vector<std::int32_t>> local_cu;
  /// Step 0 is the diagonal (causal) block; the section of step i > 0 is chosen for source
  /// (r − i + section_shift) mod R ("lower" when below r, else "upper") while the KV held is that
  /// of (r − i) mod R; 0 is correct.
  int section_shift = 0;
  /// The document mask applied on the diagonal block only: other steps' sections (lower: the
  /// early half of each document's KV rows; upper: the late half of each document's query rows)
  /// without the same-document condition.
  bool doc_mask_own_block_only = false;
  /// Zigzag: every step computes the rank's rows against the whole KV block, masked by the
  /// tokens' global order (causal) and documents, instead of xorl's sections (a plain
  /// whole-block ring; the same keys when the schedule is right).
  bool whole_blocks = false;
  /// The layout: zigzag (two chunks per rank, a section per step, as above) or contiguous (one
  /// chunk per rank: step i's KV block lies wholly before the rank's own, at it (step 0) or
  /// after it; the "basic" rings of yunchang and ring-flash-attention). A contiguous job's
  /// documents are those of `global_cu`, by global token (local_cu unused).
  bool zigzag = true;
  std::vector<std::int32_t> global_cu;
  /// The layer's mask beyond causal-or-not (docs/attention.md): a key of a step's section is
  /// seen only within the query's window and chunk, measured in document positions of
  /// `global_cu` (left unset: no window, no chunk).
  std::int64_t window_back = -1, window_ahead = -1, chunk = 0;
  /// The window and chunk measured in the rows a rank holds instead of document positions:
  /// 1, in each step's attention call — a query's position is its index among the call's query
  /// rows of its document plus lk − lq (a kernel's bottom-right alignment of lq query rows to lk
  /// key rows), a key's its index among the call's key rows: a kernel given no position ids;
  /// 2, the row's index in the rank's rows and the key's in its block's (a mask built from the
  /// local row order); 3, a row's index from its document's first row among the rank's rows,
  /// a key's from its document's first row in its block (position ids rebuilt locally, per
  /// document). On a zigzag rank a document's two chunks then count as neighbours, and
  /// chunk boundaries fall per rank. 0: document positions (correct).
  int call_positions = 0;
  /// Every attention call masked causal over its own rows, bottom-right aligned: a
  /// bidirectional ring (causal false) whose kernel calls keep causal=True.
  bool calls_causal = false;
  /// [ring rank][step]: whether the rank computes the step (empty: every step). A ring that
  /// skips the steps whose block no query of the rank sees under the layer's mask.
  std::vector<std::vector<char>> computed;
  /// Sinks folded into the partial result of every step in which the row sees a key, before
  /// the merge (a fold that passes over rows whose LSE is −∞), not once after it.
  bool sink_per_step = false;
  /// Each step's LSE rounded to this many significant bits before the steps are merged (0: not
  /// rounded; 8: bfloat16; 11: float16): a kernel that returns its LSE in the input dtype.
  int lse_bits = 0;
  /// Zigzag: each local document taken as [late chunk | early chunk] by the masks (a lower
  /// section sees the KV's late half, an upper one the queries' early half).
  bool halves_swapped = false;
  /// A step whose assumed source is the rank itself (section_shift ≠ 0) masked as the diagonal
  /// block (causal over local indices) instead of as an upper section.
  bool own_source_as_diagonal = false;
  /// The steps merged through exp(lse) without subtracting the maximum, every operation rounded
  /// to this many significant bits (8: bfloat16, 11: float16; 0: the exact merge):
  /// out = (e^lse·out + e^lse_b·out_b) / (e^lse + e^lse_b), lse = log(e^lse + e^lse_b).
  int merge_exp_bits = 0;
  /// Where set, the forward (out, LSE) ran this job — the schedule as it should be — and only
  /// the backward's key sets are those above: a backward whose own step loop differs from the
  /// forward's (its dQ then sums P = e^(s − LSE) of the forward's LSE over other keys).
  std::shared_ptr<const ring_job> forward;
};

/// The keys of local row i of ring rank r, one set per ring step (step s: the KV block of
/// ring rank (r − s) mod R), as global token ids.
std::vector<std::vector<std::int64_t>> ring_key_blocks(const ring_job& job, int r, std::int64_t i);

/// [r][step] of `job`: whether some local row of ring rank r sees some key of the step's block
/// (the steps a ring that skips fully masked blocks computes). O(S²) key tests.
std::vector<std::vector<char>> ring_steps_computed(const ring_job& job);

/// x rounded to `bits` significant bits, ties to even (bits ≤ 0: x).
double round_to_bits(double x, int bits);

/// The key multisets of local rows [i0, i1) of ring rank r, as global token ids (callers walk
/// the rows in blocks, so memory stays O(block · S)).
std::vector<std::vector<std::int64_t>> ring_key_sets(const ring_job& job, int r, std::int64_t i0,
                                                     std::int64_t i1);

/// The reference's key sets of the same rows: same document (global cu), causal when asked.
std::vector<std::vector<std::int64_t>> reference_key_sets(std::span<const std::int64_t> rows,
                                                          std::span<const std::int32_t> cu,
                                                          bool causal);

/// Attention of query rows over explicit key multisets in float64. q: [S, H, D], k/v:
/// [S, Hkv, D] (global, row-major); query row i is global token rows[i]; q head h uses KV head
/// h / (H / Hkv). out: [rows, H, D], lse: [rows, H] (−inf and 0 where a row has no key).
void attention_over_keys(std::span<const double> q, std::span<const double> k,
                         std::span<const double> v, int H, int Hkv, int D, double scale,
                         std::span<const std::int64_t> rows,
                         const std::vector<std::vector<std::int64_t>>& keys,
                         std::vector<double>& out, std::vector<double>& lse);

}  // namespace seqpar::verify
