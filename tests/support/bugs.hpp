#pragma once
// Plausible sequence-parallel bugs, injected from the test side through the seams of
// verify::check_options (transform_collated, wrap_compute, wrap_communicator), to prove that the
// equivalence check catches each of them (mutation testing of the checker). Nothing here is
// reachable from product code.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/collate.hpp"
#include "support/forwarding_communicator.hpp"
#include "support/forwarding_compute.hpp"

namespace seqpar::test {

// ---- collation bugs: transformations of the collated batch (check_options::transform_collated)

/// VeOmni: the label shift applied to each rank's slice instead of the whole packed row (the
/// whole-row shift is undone per rank, then each slice is shifted on its own), so the last
/// label of every slice is -100 instead of the first token of the next slice.
void shift_labels_after_slicing(collated_batch& cb);
/// DeepSpeed: the dataloader's position_ids left out, so each rank makes its own
/// arange(chunk) after sharding (the Trainer's default): the attention then sees every chunk
/// as a document of its own and RoPE restarts per chunk (the hazard the adapter's
/// "Ulysses SP requires position_ids" error guards against).
void position_ids_local_per_rank(collated_batch& cb);
/// Labels of the padded tokens are 0 (a real token id) instead of -100.
void pad_labels_with_zero(collated_batch& cb);
/// cu_seqlens stop at the unpadded length although the padded tail is attended.
void cu_seqlens_stop_before_padding(collated_batch& cb);
/// cu_seqlens extended over the SP padding, which xorl's ring (R > 1) leaves outside every
/// document: the last document swallows the pad tokens (they come after it: no real token
/// attends to them, so only the layout can tell).
void cu_seqlens_cover_padding(collated_batch& cb);
/// Ring: cu_seqlens computed from the zigzagged position ids (the rank-ordered row) instead of
/// the original ones, so document boundaries land in the wrong places.
void ring_cu_seqlens_from_zigzagged_ids(collated_batch& cb);
/// Ring: the local cu_seqlens not divided by R. Ring attention divides what the collator hands
/// it by R, so handing it cu·R makes it use the unscaled cu.
void ring_cu_seqlens_unscaled(collated_batch& cb);

// ---- compute bugs: decorators over an SP rank's compute (check_options::wrap_compute)

/// The ring's LSE merge as a plain exp-sum, without subtracting the maximum:
/// lse = log(e^lse_a + e^lse_b), out = (out_a·e^lse_a + out_b·e^lse_b) / (e^lse_a + e^lse_b),
/// rounded to the tensor's precision at each step. exp overflows float32 once an LSE passes
/// ~88, where the stable form (SEMANTICS.md §4) stays exact.
class merge_without_max_subtraction : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                 const tensor& lse_new) override;
};

/// GQA: KV heads repeated blockwise ([k0,k1,k0,k1], torch .repeat) instead of interleaved
/// ([k0,k0,k1,k1], repeat_interleave); sum_repeated_heads is the matching inverse, so the
/// backward is the true gradient of the wrong forward.
class kv_heads_repeated_blockwise : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor repeat_heads(const tensor& x, int rep) override;
  tensor sum_repeated_heads(const tensor& dx, int rep) override;
};

// ---- GatedDeltaNet bugs (VeOmni's Qwen3_5GatedDeltaNet under Ulysses; SEMANTICS.md §7). The
// scenarios these are used with have R = 1 and no data parallelism, so the Ulysses group is the
// whole world.

/// z (the output gate) sent through the all-to-all with q, k, v, b, a: the gate each rank then
/// holds is `[S, Hv/U, dv]` — the same element count as its `[S/U, Hv, dv]` output — and the
/// gated norm reads it in the output's layout. The backward is the true gradient of that.
class z_through_all_to_all : public forwarding_compute {
 public:
  z_through_all_to_all(std::unique_ptr<compute> inner, communicator& comm);
  tensor gated_rms_norm_forward(const tensor& x, const tensor& z, const tensor& w) override;
  void gated_rms_norm_backward(const tensor& x, const tensor& z, const tensor& w, const tensor& dy,
                               tensor& dx, tensor& dz, tensor& dw) override;

 private:
  tensor exchanged(const tensor& z, const tensor& like);
  communicator& comm_;
  comm_group group_;
};

/// The whole conv weight used on every rank: channel c of the local q|k|v convolved with row c
/// of the unsliced `[2K+V, kernel]` weight (what a kernel indexing channels by position does
/// with it), instead of the rank's rows (_get_local_conv1d_weight).
class conv_weight_not_sliced : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor causal_conv_forward(const tensor& x, const tensor& w_full,
                             std::span<const std::int64_t> rows,
                             const attention_docs& docs) override;
  void causal_conv_backward(const tensor& x, const tensor& w_full,
                            std::span<const std::int64_t> rows, const attention_docs& docs,
                            const tensor& dy, tensor& dx, tensor& dw_full) override;
};

/// A_log and dt_bias not sliced to the rank's value heads: every rank reads heads [0, Hv/U).
class gates_not_sliced : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void delta_gates_forward(const tensor& a, const tensor& b, const tensor& A_log,
                           const tensor& dt_bias, std::int64_t head_offset, tensor& g,
                           tensor& beta) override;
  void delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                            const tensor& dt_bias, std::int64_t head_offset, const tensor& dg,
                            const tensor& dbeta, tensor& da, tensor& db, tensor& dA_log,
                            tensor& ddt_bias) override;
};

/// The causal convolution run over the gathered row as one sequence (cu_seqlens not passed):
/// a document's first kernel−1 tokens read the previous document's last ones.
class conv_crosses_documents : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor causal_conv_forward(const tensor& x, const tensor& w_full,
                             std::span<const std::int64_t> rows,
                             const attention_docs& docs) override;
  void causal_conv_backward(const tensor& x, const tensor& w_full,
                            std::span<const std::int64_t> rows, const attention_docs& docs,
                            const tensor& dy, tensor& dx, tensor& dw_full) override;
};

/// The delta rule run over the gathered row as one sequence: the recurrent state carries from
/// one document into the next.
class state_crosses_documents : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void gated_delta_forward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                           const tensor& beta, const attention_docs& docs, tensor& out) override;
  void gated_delta_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                            const tensor& beta, const attention_docs& docs, const tensor& dout,
                            tensor& dq, tensor& dk, tensor& dv, tensor& dg, tensor& dbeta) override;
};

// ---- transport bugs: decorators over an SP rank's communicator (check_options::wrap_communicator)

/// b and a scattered on the wrong heads: every all_to_all whose tag ends in ".b.fwd" or ".a.fwd"
/// sends member j the block of heads meant for member j+1, so rank u's gates are computed from
/// rank u+1's heads of b and a (as with b/a sliced at the wrong head offset).
class b_a_on_wrong_heads : public forwarding_communicator {
 public:
  using forwarding_communicator::forwarding_communicator;

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;
};

/// Gradient sync with AVG instead of SUM: every all_reduce whose tag starts with "grad." is
/// divided by its group size after the (correct) sum.
class grad_sync_averaged : public forwarding_communicator {
 public:
  using forwarding_communicator::forwarding_communicator;

 protected:
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override;
};

/// An all-to-all plan whose receive displacements are one peer off: the block received from
/// member p+1 lands where member p's belongs (cyclically), on every all_to_all of every rank.
class all_to_all_blocks_one_peer_off : public forwarding_communicator {
 public:
  using forwarding_communicator::forwarding_communicator;

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;
};

/// Ring neighbours off by one: every send_recv whose tag contains `tag` sends to member r+2 and
/// receives from r−2 instead of r±1 (consistently on every rank, so messages still pair up).
/// The KV (and dK/dV) a ring step holds then comes from another source than the one its
/// zigzag section (diagonal / lower / upper) was computed for — the same symptom as section
/// logic that is off by one ring rank, seen from the transport side. Needs R ≥ 3.
class ring_peers_off_by_one : public forwarding_communicator {
 public:
  ring_peers_off_by_one(communicator& inner, std::string tag)
      : forwarding_communicator(inner), tag_(std::move(tag)) {}

 protected:
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override;

 private:
  std::string tag_;
};

// ---- async Ulysses bugs (VeOmni's AsyncUlyssesQKVProjection; issue: overlap is where SP bugs
// hide)

/// q's all-to-all waited only after the attention used it (the wait moved past the layer's
/// output all-to-all): the attention reads q's receive buffer before the data arrived.
class q_used_before_its_wait : public forwarding_communicator {
 public:
  using forwarding_communicator::forwarding_communicator;

 protected:
  void do_wait(std::int64_t token) override;
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;

 private:
  std::vector<std::int64_t> deferred_;
};

/// The wait for q completes v's all-to-all and the wait for v completes q's (handles mixed up):
/// every call is waited once, but q is read before its own call completed.
class q_and_v_waits_swapped : public forwarding_communicator {
 public:
  using forwarding_communicator::forwarding_communicator;

 protected:
  void do_wait(std::int64_t token) override;
};

/// The per-head q/k norm computed over all of the rank's heads together (one RMS over H/U·D
/// values, the weight tiled) instead of over each head: the norm "over the wrong heads".
class qk_norm_over_all_local_heads : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor head_norm_forward(const tensor& x, const tensor& w, const tensor& b, norm_kind k,
                           double eps) override;
  tensor head_norm_backward(const tensor& x, const tensor& w, norm_kind k, double eps,
                            const tensor& dy, std::vector<double>& dw,
                            std::vector<double>& db) override;
};

/// A projection's bias added twice (F.linear with the bias, then the bias again).
class bias_added_twice : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void add_bias(tensor& x, const tensor& b) override;
};

/// The embedding's backward assigning where it must accumulate (dtable[id] = dy[i] instead of
/// +=): an id held by several of the rank's tokens keeps the last one's gradient. Planted
/// through the tensor step's scatter_add_rows (its one use: the embedding's backward).
class embedding_grad_assigned : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void scatter_add_rows(tensor& acc, const tensor& x, std::span<const std::int64_t> rows) override;
};

// ---- precision (issue 37): an error of a stated size, to pin check's bound from the failing side

/// The attention's own rounding error multiplied by k: every output of attention_forward (out,
/// lse) and attention_backward (dq, dk, dv) becomes exact + k·(result − exact), exact being the
/// same call in float64 on the same inputs. k = 1 is the kernel as it is; k = 10 a kernel ten
/// times less precise. No effect on a float64 run (its error is already ~0).
///
/// planted: instead, every output becomes exact·(1 + k·u·σ), u = 2⁻²⁴ (float32's unit
/// roundoff) and σ = ±1 drawn from the element's index: an error of k roundoffs per element
/// that does not depend on the CPU's own rounding (AVX2 or AVX-512, FMA or not), so a test that
/// plants it measures the same fraction of the bound on every x86-64.
class attention_error_amplified : public forwarding_compute {
 public:
  attention_error_amplified(std::unique_ptr<compute> inner, double k, bool planted = false)
      : forwarding_compute(std::move(inner)), k_(k), planted_(planted) {}
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override;
  void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const tensor& dout, const attention_docs& docs,
                          tensor& dq, tensor& dk, tensor& dv) override;

 private:
  tensor widened(const tensor& x);
  void amplify(tensor& x, const tensor& exact);
  double k_;
  bool planted_;
  std::uint64_t calls_ = 0;  ///< tensors planted so far: each gets its own signs
};

/// An all-to-all plan that scatters heads strided: peer j receives heads j, j + U, j + 2U, …
/// instead of the contiguous block [j·H/U, (j+1)·H/U) (every pre-attention all-to-all, the
/// backward's included).
class heads_scattered_strided : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) override;
};

/// V built by repeating K's heads (U > Hkv): the second of each pair of KV repeats (K, then V,
/// as the Ulysses step makes them) returns the first's.
class v_repeated_from_k : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor repeat_heads(const tensor& x, int rep) override;

 private:
  std::optional<tensor> k_;
};

/// K/V heads not repeated before the all-to-all (U > Hkv): the repeat left for after it.
class kv_not_repeated_before_all_to_all : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor repeat_heads(const tensor& x, int rep) override;
};

// ---- today's attention options (docs/attention.md): the mistakes SP code makes with them in
// public

/// Sinks dropped: the attention runs without them (a Ulysses wrapper that swallows the keyword
/// Hugging Face passes them as), and their gradient stays 0.
class sink_dropped : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void attention_sink_forward(tensor& out, tensor& lse, std::span<const double> sinks) override;
  std::vector<double> attention_sink_backward(const tensor& out, const tensor& lse,
                                              const tensor& dout,
                                              std::span<const double> sinks) override;
};

/// The sink as out·sigmoid(lse − sink) with the LSE left as it was: the forward's output is the
/// sinked one, but the backward's softmax P = exp(s − lse) and the sink's share are not.
class sink_sigmoid_lse_kept : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void attention_sink_forward(tensor& out, tensor& lse, std::span<const double> sinks) override;
};

/// The sinks' gradient taken twice (a backward that adds it on each of R = 2 ring steps).
class sink_gradient_doubled : public forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  std::vector<double> attention_sink_backward(const tensor& out, const tensor& lse,
                                              const tensor& dout,
                                              std::span<const double> sinks) override;
};

/// Sinks folded into every ring step's partial result before the merge (so counted once per
/// step that runs) and not after it. The sink values of the rank's heads come from the test.
class sink_on_every_step : public forwarding_compute {
 public:
  sink_on_every_step(std::unique_ptr<compute> inner, std::vector<double> sinks)
      : forwarding_compute(std::move(inner)), sinks_(std::move(sinks)) {}
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override;
  void attention_sink_forward(tensor&, tensor&, std::span<const double>) override {}

 private:
  std::vector<double> sinks_;
};

/// An attention call's documents changed before the kernel sees them (forward and backward):
/// the mistakes of passing a layer's options on.
class attention_docs_changed : public forwarding_compute {
 public:
  attention_docs_changed(std::unique_ptr<compute> inner, std::function<void(attention_docs&)> f)
      : forwarding_compute(std::move(inner)), f_(std::move(f)) {}
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override;
  void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const tensor& dout, const attention_docs& docs,
                          tensor& dq, tensor& dk, tensor& dv) override;

 private:
  std::function<void(attention_docs&)> f_;
};

/// attention_docs_changed on the backward only (the forward as it should be): a ring whose
/// backward step loop differs from its forward's.
class backward_docs_changed : public attention_docs_changed {
 public:
  using attention_docs_changed::attention_docs_changed;
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override {
    forwarding_compute::attention_forward(q, k, v, docs, out, lse);
  }
};

/// The changes attention_docs_changed is used with:
/// transformers' sliding_window W passed to a flash-attn style kernel as window_size = (W, 0)
/// instead of (W − 1, 0): every query sees one key too many.
void window_off_by_one(attention_docs& d);
/// The rows' document positions dropped: a window or chunk measured in the order the rank holds
/// its rows (zigzag: chunk r, then chunk 2R−1−r; a ring block: from its own first row), so
/// chunk boundaries fall per rank.
void positions_dropped(attention_docs& d);
/// Gemma 2's capping applied to the unscaled score, then scaled: scale·cap·tanh(q·k/cap).
void softcap_without_scale(attention_docs& d);
/// A bidirectional layer's attention run with the causal mask left in.
void causal_mask_left_in(attention_docs& d);
/// A ring's off-diagonal sections (its non-causal calls) run without their documents: one
/// document over the section's rows, so queries attend across document boundaries there.
void doc_mask_dropped_off_diagonal(attention_docs& d);

// ---- helpers for check_options

/// A check_options::wrap_compute that installs decorator D on every SP rank (D built from the
/// inner compute, or from the inner compute and the rank's communicator).
template <class D>
std::function<std::unique_ptr<compute>(std::unique_ptr<compute>, communicator&)> wrap_compute_in() {
  return [](std::unique_ptr<compute> inner, communicator& comm) -> std::unique_ptr<compute> {
    if constexpr (std::is_constructible_v<D, std::unique_ptr<compute>, communicator&>)
      return std::make_unique<D>(std::move(inner), comm);
    else
      return std::make_unique<D>(std::move(inner));
  };
}

/// A check_options::wrap_communicator that installs decorator D (built from the inner
/// communicator and `args`) on every SP rank.
template <class D, class... Args>
std::function<std::unique_ptr<communicator>(communicator&)> wrap_communicator_in(Args... args) {
  return [=](communicator& inner) -> std::unique_ptr<communicator> {
    return std::make_unique<D>(inner, args...);
  };
}

}  // namespace seqpar::test
