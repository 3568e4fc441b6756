#include "core/ring_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/attention_mask.hpp"
#include "core/cu_seqlens.hpp"
#include "core/ring_schedule.hpp"

namespace seqpar {

namespace {

using rows_t = std::vector<std::int64_t>;

/// One attention call of a ring step: which local Q rows and which K rows of the source block
/// take part, their document boundaries, and whether the mask is causal.
struct section_call {
  bool all_q = true;  ///< every local row (no gather)
  rows_t q_rows, k_rows;
  attention_docs docs;
  bool skip = false;
  bool masked_out = false;  ///< skipped because the layer's mask hides the whole block
};

/// Whether some query of the call sees some key under its mask (positions given).
bool any_visible(const attention_docs& d) {
  for (std::size_t i = 0; i + 1 < d.cu_q.size(); ++i) {
    const auto k_first = d.pos_k.begin() + d.cu_k[i], k_last = d.pos_k.begin() + d.cu_k[i + 1];
    if (k_first == k_last) continue;
    for (auto r = d.cu_q[i]; r < d.cu_q[i + 1]; ++r) {
      const auto [lo, hi] = visible_positions(d.causal, d.window_back, d.window_ahead, d.chunk,
                                              d.pos_q[static_cast<std::size_t>(r)]);
      const auto it = std::lower_bound(k_first, k_last, lo);
      if (it != k_last && *it <= hi) return true;
    }
  }
  return false;
}

void push_doc(std::vector<std::int32_t>& cu, std::int64_t len) {
  cu.push_back(static_cast<std::int32_t>(cu.back() + len));
}

// One class of ~340 lines, kept whole on purpose: the forward's schedule (which block each step
// computes, the sections of zigzag, the merge) and the backward's (the same steps in the same
// order, the dK/dV accumulator travelling the ring) must mirror each other line for line, and
// reading them side by side in one class is how a change to one is checked against the other.
class ring_attention final : public inner_attention {
 public:
  ring_attention(communicator& comm, compute& c, ring_setup s, const layer_attention& layer)
      : comm_(comm), c_(c), s_(std::move(s)), opt_(layer.options) {
    sinks_ = layer.sinks;
    R_ = s_.group.size();
    r_ = s_.group.index_of(comm.rank());
    if (r_ < 0) fail<error>("rank {} is not in ring group '{}'", comm.rank(), s_.group.name);
    if (s_.padded_length % R_ != 0)
      fail<shape_error>("ring: padded length {} is not divisible by ring={}", s_.padded_length, R_);
    rows_ = s_.padded_length / R_;
    // Each ring rank holds len/R rows of every document: local cu = cu // R.
    if (s_.zigzag) local_cu_ = scale_cu_seqlens_for_ring(s_.cu_global, R_);
    positioned_ = opt_.local();
    if (positioned_) local_pos_ = block_positions(r_);
  }

  void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
               const std::string& tag) override {
    check_rows(q, "q");
    if (s_.forward == ring_forward_kind::allgather)
      return forward_allgather(q, k, v, out, lse, tag);
    c_.fill(out, 0.0);
    c_.fill(lse, -std::numeric_limits<double>::infinity());
    tensor kv = c_.stack_kv(k, v);
    for (int i = 0; i < R_; ++i) {
      const int src = ring_source(r_, i, R_);
      tensor ks = c_.empty(k.type, k.shape), vs = c_.empty(v.type, v.shape);
      c_.unstack_kv(kv, ks, vs);
      const auto call = section(i, src);
      if (s_.counts)
        ++(call.masked_out ? s_.counts->skipped_mask
           : call.skip     ? s_.counts->skipped_layout
                           : s_.counts->computed);
      if (!call.skip) {
        tensor o_new = c_.zeros(q.type, out.shape);
        tensor l_new = c_.empty(q.type, lse.shape);
        c_.fill(l_new, -std::numeric_limits<double>::infinity());
        run_forward(call, q, ks, vs, o_new, l_new);
        if (s_.tap_step) s_.tap_step(tag, i, src, o_new, l_new);
        merge(out, lse, o_new, l_new);
      }
      if (i + 1 < R_) kv = exchange({kv}, fmt::format("{}.ring.fwd.step{}", tag, i)).front();
    }
    fold_sinks(c_, out, lse);
  }

  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                const std::string& tag) override {
    c_.fill(dq, 0.0);
    sinks_backward(c_, out, lse, dout);
    if (s_.forward == ring_forward_kind::allgather)
      backward_prefix(q, k, v, out, lse, dout, dq, dk, dv, tag);
    else if (s_.backward == ring_backward_kind::allgather)
      backward_allgather(q, k, v, out, lse, dout, dq, dk, dv, tag);
    else
      backward_ring(q, k, v, out, lse, dout, dq, dk, dv, tag);
  }

 private:
  void check_rows(const tensor& x, const char* name) const {
    if (x.shape.empty() || x.shape[0] != rows_)
      fail<shape_error>(
          "ring attention: {} holds {} rows but ring rank {} should hold N/R = {}/{} "
          "= {}",
          name, x.shape.empty() ? 0 : x.shape[0], r_, s_.padded_length, R_, rows_);
  }

  /// Document positions of ring rank b's rows (zigzag: chunk b, then chunk 2R−1−b, of every
  /// document; contiguous: global rows [b·n, (b+1)·n)); rows outside every document get 0.
  std::vector<std::int32_t> block_positions(int b) const {
    std::vector<std::int32_t> pos(static_cast<std::size_t>(rows_), 0);
    if (s_.zigzag) {
      const auto docs = doc_ranges(local_cu_);
      for (const auto& d : docs) {
        const auto half = d.size() / 2;
        for (std::int64_t t = 0; t < d.size(); ++t) {
          const std::int64_t chunk = t < half ? b : 2 * R_ - 1 - b;
          pos[static_cast<std::size_t>(d.start + t)] =
              static_cast<std::int32_t>(chunk * half + (t < half ? t : t - half));
        }
      }
      return pos;
    }
    for (const auto& d : doc_ranges(s_.cu_global))
      for (auto g = std::max(d.start, b * rows_); g < std::min(d.end, (b + 1) * rows_); ++g)
        pos[static_cast<std::size_t>(g - b * rows_)] = static_cast<std::int32_t>(g - d.start);
    return pos;
  }

  /// The layer's options on a call; with a window or chunk, the rows' positions too, and the call
  /// skipped when its mask hides every key from every query.
  void finish(section_call& call, const std::vector<std::int32_t>& q_pos,
              const std::vector<std::int32_t>& k_pos) const {
    const bool causal = call.docs.causal;
    apply_options(call.docs, opt_);
    call.docs.causal = causal && opt_.causal;  // a section below the diagonal needs no mask
    if (!positioned_ || call.skip) return;
    const auto pick = [](const std::vector<std::int32_t>& all, const rows_t& rows) {
      if (rows.empty()) return all;
      std::vector<std::int32_t> out;
      out.reserve(rows.size());
      for (auto r : rows) out.push_back(all[static_cast<std::size_t>(r)]);
      return out;
    };
    call.docs.pos_q = call.all_q ? q_pos : pick(q_pos, call.q_rows);
    call.docs.pos_k = pick(k_pos, call.k_rows);
    if (!any_visible(call.docs)) call.skip = call.masked_out = true;
  }

  /// The attention call of step i (KV of ring rank src) for this rank's rows.
  section_call section(int step, int src) const {
    section_call call = layout_section(step, src);
    finish(call, local_pos_, positioned_ ? block_positions(src) : std::vector<std::int32_t>{});
    return call;
  }

  /// The section of step i as the layout alone gives it (causal or bidirectional, no window).
  section_call layout_section(int step, int src) const {
    section_call call;
    call.docs.scale = s_.scale;
    call.docs.cu_q = {0};
    call.docs.cu_k = {0};
    if (!opt_.causal) {  // bidirectional: each query row against every key of its document
      call.docs.causal = false;
      if (s_.zigzag) {
        call.docs.cu_q = call.docs.cu_k = local_cu_;
        return call;
      }
      contiguous_blocks(call, src, false);
      call.skip = call.docs.cu_k.back() == 0 || call.docs.cu_q.back() == 0;
      return call;
    }
    if (s_.zigzag) {
      const ring_section sec = zigzag_section(r_, step, R_);
      const auto docs = doc_ranges(local_cu_);
      switch (sec) {
        case ring_section::diagonal:
          call.docs.cu_q = call.docs.cu_k = local_cu_;
          call.docs.causal = true;
          break;
        case ring_section::lower:  // all Q rows vs the early half of every document's KV
          call.docs.cu_q = local_cu_;
          call.docs.causal = false;
          for (const auto& d : docs) {
            const auto mid = d.start + d.size() / 2;
            for (auto j = d.start; j < mid; ++j) call.k_rows.push_back(j);
            push_doc(call.docs.cu_k, mid - d.start);
          }
          break;
        default:  // upper: the late half of every document's Q vs all its KV
          call.all_q = false;
          call.docs.cu_k = local_cu_;
          call.docs.causal = false;
          for (const auto& d : docs) {
            const auto mid = d.start + d.size() / 2;
            for (auto j = mid; j < d.end; ++j) call.q_rows.push_back(j);
            push_doc(call.docs.cu_q, d.end - mid);
          }
          break;
      }
      return call;
    }
    // Contiguous: ring rank b holds global rows [b·n, (b+1)·n); documents cut at block edges.
    const ring_section sec = contiguous_section(r_, step, R_);
    if (sec == ring_section::skip) {
      call.skip = true;
      return call;
    }
    call.docs.causal = sec == ring_section::causal;
    contiguous_blocks(call, src, call.docs.causal);
    return call;
  }

  /// A contiguous ring's call between this rank's block and src's: each document cut at the
  /// blocks' edges (diagonal: the same cuts on both sides), the key rows its documents cover.
  void contiguous_blocks(section_call& call, int src, bool diagonal) const {
    const std::int64_t q0 = r_ * rows_, k0 = static_cast<std::int64_t>(src) * rows_;
    for (const auto& d : doc_ranges(s_.cu_global)) {
      auto overlap = [&](std::int64_t b0) {
        return std::max<std::int64_t>(0, std::min(d.end, b0 + rows_) - std::max(d.start, b0));
      };
      push_doc(call.docs.cu_q, overlap(q0));
      push_doc(call.docs.cu_k, overlap(k0));
    }
    if (diagonal) call.docs.cu_k = call.docs.cu_q;
    for (std::int64_t j = 0; j < call.docs.cu_k.back(); ++j) call.k_rows.push_back(j);
    if (call.k_rows.size() == static_cast<std::size_t>(rows_)) call.k_rows.clear();
  }

  tensor rows_of(const tensor& x, const rows_t& rows) const {
    return rows.empty() ? x : c_.gather_rows(x, rows);
  }

  void run_forward(const section_call& call, const tensor& q, const tensor& k, const tensor& v,
                   tensor& o_new, tensor& l_new) {
    const tensor qs = call.all_q ? q : c_.gather_rows(q, call.q_rows);
    const tensor ks = rows_of(k, call.k_rows), vs = rows_of(v, call.k_rows);
    if (call.all_q) {
      c_.attention_forward(qs, ks, vs, call.docs, o_new, l_new);
      return;
    }
    tensor o = c_.empty(q.type, qs.shape);
    tensor l = c_.empty(q.type, {qs.shape[0], qs.shape[1]});
    c_.attention_forward(qs, ks, vs, call.docs, o, l);
    c_.scatter_rows(o_new, o, call.q_rows);
    c_.scatter_rows(l_new, l, call.q_rows);
  }

  /// acc ⊕ new (online-softmax merge, SEMANTICS.md §4).
  void merge(tensor& out, tensor& lse, const tensor& o_new, const tensor& l_new) {
    c_.lse_merge(out, lse, o_new, l_new);
  }

  /// Sends `msgs` to ring rank r+1 and receives the same shapes from r−1.
  std::vector<tensor> exchange(const std::vector<tensor>& msgs, const std::string& tag) {
    std::vector<tensor> got;
    std::vector<p2p_op> ops;
    const int next = (r_ + 1) % R_, prev = (r_ - 1 + R_) % R_;
    for (const auto& m : msgs) {
      got.push_back(c_.empty(m.type, m.shape));
      ops.push_back({p2p_op::kind::send, next, m.data, m.numel(), m.shape});
      ops.push_back({p2p_op::kind::recv, prev, got.back().data, m.numel(), m.shape});
    }
    comm_.send_recv(s_.group, ops, msgs.front().type, {tag, {}, {}});
    return got;
  }

  /// Gradients of one section: dq rows accumulate into dq, dk/dv rows into the source block
  /// (dk_acc, dv_acc hold `block_rows` rows per source, this source at `k_offset`). With the
  /// setup's backward tap, the step's own contributions are made whole first (zeros where the
  /// section leaves rows out), shown, then added: the same sums as scattering them directly.
  void section_backward(const section_call& call, const tensor& q, const tensor& ks,
                        const tensor& vs, const tensor& out, const tensor& lse, const tensor& dout,
                        tensor& dq, tensor& dk_acc, tensor& dv_acc, std::int64_t k_offset,
                        const std::string& tag = {}, int step = -1, int src = -1) {
    if (s_.tap_step_backward && step >= 0) {
      tensor dq_step = c_.zeros(dq.type, dq.shape);
      shape_t kshape = ks.shape;
      kshape[0] = rows_;
      tensor dk_step = c_.zeros(ks.type, kshape), dv_step = c_.zeros(vs.type, kshape);
      section_backward(call, q, ks, vs, out, lse, dout, dq_step, dk_step, dv_step, 0);
      s_.tap_step_backward(tag, step, src, dq_step, dk_step, dv_step);
      c_.add(dq, dq_step);
      rows_t krows;
      for (std::int64_t j = 0; j < rows_; ++j) krows.push_back(k_offset + j);
      c_.scatter_add_rows(dk_acc, dk_step, krows);
      c_.scatter_add_rows(dv_acc, dv_step, krows);
      return;
    }
    const tensor qs = call.all_q ? q : c_.gather_rows(q, call.q_rows);
    const tensor os = call.all_q ? out : c_.gather_rows(out, call.q_rows);
    const tensor ls = call.all_q ? lse : c_.gather_rows(lse, call.q_rows);
    const tensor dos = call.all_q ? dout : c_.gather_rows(dout, call.q_rows);
    const tensor kk = rows_of(ks, call.k_rows), vv = rows_of(vs, call.k_rows);
    tensor dqs = c_.empty(q.type, qs.shape);
    tensor dks = c_.empty(kk.type, kk.shape), dvs = c_.empty(vv.type, vv.shape);
    c_.attention_backward(qs, kk, vv, os, ls, dos, call.docs, dqs, dks, dvs);
    if (call.all_q)
      c_.add(dq, dqs);
    else
      c_.scatter_add_rows(dq, dqs, call.q_rows);
    rows_t krows;
    const auto n = call.k_rows.empty() ? rows_ : static_cast<std::int64_t>(call.k_rows.size());
    for (std::int64_t j = 0; j < n; ++j)
      krows.push_back(k_offset +
                      (call.k_rows.empty() ? j : call.k_rows[static_cast<std::size_t>(j)]));
    c_.scatter_add_rows(dk_acc, dks, krows);
    c_.scatter_add_rows(dv_acc, dvs, krows);
  }

  void backward_allgather(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                          const std::string& tag) {
    const tensor kv = c_.stack_kv(k, v);
    shape_t all_shape = kv.shape;
    all_shape[0] *= R_;
    tensor kv_all = c_.empty(kv.type, all_shape);
    comm_.all_gather(s_.group, kv.data, kv.numel(), kv_all.data, kv.type,
                     {tag + ".ring.kv.bwd", kv.shape, all_shape});
    shape_t kshape = k.shape;
    kshape[0] *= R_;
    tensor k_all = c_.empty(k.type, kshape), v_all = c_.empty(v.type, kshape);
    c_.unstack_kv(kv_all, k_all, v_all);
    tensor dk_all = c_.zeros(k.type, kshape), dv_all = c_.zeros(v.type, kshape);
    for (int i = 0; i < R_; ++i) {
      const int src = ring_source(r_, i, R_);
      const auto call = section(i, src);
      if (call.skip) continue;
      rows_t block;
      for (std::int64_t j = 0; j < rows_; ++j) block.push_back(src * rows_ + j);
      section_backward(call, q, c_.gather_rows(k_all, block), c_.gather_rows(v_all, block), out,
                       lse, dout, dq, dk_all, dv_all, src * rows_, tag, i, src);
    }
    const tensor dkv_all = c_.stack_kv(dk_all, dv_all);
    tensor dkv = c_.empty(kv.type, kv.shape);
    comm_.reduce_scatter(s_.group, dkv_all.data, dkv.data, kv.numel(), kv.type,
                         {tag + ".ring.dkv.bwd", all_shape, kv.shape});
    c_.unstack_kv(dkv, dk, dv);
  }

  void backward_ring(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                     const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                     const std::string& tag) {
    tensor kv = c_.stack_kv(k, v);
    tensor dkv = c_.zeros(kv.type, kv.shape);
    for (int i = 0; i < R_; ++i) {
      const int src = ring_source(r_, i, R_);
      const auto call = section(i, src);
      if (!call.skip) {
        tensor ks = c_.empty(k.type, k.shape), vs = c_.empty(v.type, v.shape);
        c_.unstack_kv(kv, ks, vs);
        tensor dks = c_.zeros(k.type, k.shape), dvs = c_.zeros(v.type, v.shape);
        section_backward(call, q, ks, vs, out, lse, dout, dq, dks, dvs, 0, tag, i, src);
        c_.add(dkv, c_.stack_kv(dks, dvs));
      }
      // dK,dV of `src` travel on with its K,V; after the last step they reach their owner.
      if (i + 1 < R_) {
        auto got = exchange({kv, dkv}, fmt::format("{}.ring.bwd.step{}", tag, i));
        kv = got[0];
        dkv = got[1];
      } else if (R_ > 1) {
        dkv = exchange({dkv}, tag + ".ring.bwd.return").front();
      }
    }
    c_.unstack_kv(dkv, dk, dv);
  }

  // ---- llama3-style: all-gather K,V once; each Q row attends to its document's prefix. ----

  /// The prefix calls of this rank: rows of the gathered K,V (ring-rank blocks of `rows_`) in
  /// global order, per document, up to the end of each Q piece (bottom-right causal).
  /// A bidirectional mask takes every key of the document, not the prefix; with a window or a
  /// chunk the rows' positions go with the calls (the gathered keys of a document are its
  /// positions 0, 1, … in order).
  std::vector<section_call> prefix_calls() const {
    std::vector<section_call> calls;
    auto start = [&](bool all_q) {
      section_call c;
      c.all_q = all_q;
      c.docs.scale = s_.scale;
      apply_options(c.docs, opt_);
      c.docs.cu_q = {0};
      c.docs.cu_k = {0};
      return c;
    };
    const auto positions = [&](section_call& c, std::int64_t q_first, std::int64_t q_len,
                               std::int64_t k_len) {
      if (!positioned_) return;
      for (auto t = q_first; t < q_first + q_len; ++t)
        c.docs.pos_q.push_back(static_cast<std::int32_t>(t));
      for (std::int64_t t = 0; t < k_len; ++t) c.docs.pos_k.push_back(static_cast<std::int32_t>(t));
    };
    if (!s_.zigzag) {  // contiguous: global order is the gathered order
      section_call c = start(true);
      const std::int64_t q0 = r_ * rows_;
      for (const auto& d : doc_ranges(s_.cu_global)) {
        const auto q_len =
            std::max<std::int64_t>(0, std::min(d.end, q0 + rows_) - std::max(d.start, q0));
        const auto k_end = opt_.causal ? std::min(d.end, q0 + rows_) : d.end;
        push_doc(c.docs.cu_q, q_len);
        const auto k_len = q_len > 0 ? k_end - d.start : 0;
        for (auto j = d.start; j < d.start + k_len; ++j) c.k_rows.push_back(j);
        push_doc(c.docs.cu_k, k_len);
        positions(c, std::max(d.start, q0) - d.start, q_len, k_len);
      }
      if (positioned_) {  // the local rows past the documents (padding)
        c.docs.pos_q.resize(static_cast<std::size_t>(rows_), 0);
      }
      c.skip = c.k_rows.empty();
      calls.push_back(std::move(c));
      return calls;
    }
    // Zigzag: global chunk j of a document lives on ring rank j (early half) or 2R−1−j (late).
    for (int piece = 0; piece < 2; ++piece) {
      const int j_q = piece == 0 ? r_ : 2 * R_ - 1 - r_;
      const int j_last = opt_.causal ? j_q : 2 * R_ - 1;
      section_call c = start(false);
      for (const auto& d : doc_ranges(local_cu_)) {
        const auto half = d.size() / 2;
        for (auto i = d.start + piece * half; i < d.start + (piece + 1) * half; ++i)
          c.q_rows.push_back(i);
        push_doc(c.docs.cu_q, half);
        for (int j = 0; j <= j_last; ++j) {
          const int owner = j < R_ ? j : 2 * R_ - 1 - j;
          const auto first = owner * rows_ + d.start + (j < R_ ? 0 : half);
          for (auto i = first; i < first + half; ++i) c.k_rows.push_back(i);
        }
        push_doc(c.docs.cu_k, (j_last + 1) * half);
        positions(c, j_q * half, half, (j_last + 1) * half);
      }
      c.skip = c.k_rows.empty();
      calls.push_back(std::move(c));
    }
    return calls;
  }

  /// K,V of the whole ring, gathered: [R·rows, H, D] each.
  std::pair<tensor, tensor> gather_kv(const tensor& k, const tensor& v, const std::string& tag) {
    const tensor kv = c_.stack_kv(k, v);
    shape_t all_shape = kv.shape;
    all_shape[0] *= R_;
    tensor kv_all = c_.empty(kv.type, all_shape);
    comm_.all_gather(s_.group, kv.data, kv.numel(), kv_all.data, kv.type,
                     {tag, kv.shape, all_shape});
    shape_t kshape = k.shape;
    kshape[0] *= R_;
    tensor k_all = c_.empty(k.type, kshape), v_all = c_.empty(v.type, kshape);
    c_.unstack_kv(kv_all, k_all, v_all);
    return {k_all, v_all};
  }

  void forward_allgather(const tensor& q, const tensor& k, const tensor& v, tensor& out,
                         tensor& lse, const std::string& tag) {
    c_.fill(out, 0.0);
    c_.fill(lse, -std::numeric_limits<double>::infinity());
    auto [k_all, v_all] = gather_kv(k, v, tag + ".ring.kv.fwd");
    for (const auto& call : prefix_calls())
      if (!call.skip) run_forward(call, q, k_all, v_all, out, lse);
    fold_sinks(c_, out, lse);
  }

  void backward_prefix(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                       const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                       const std::string& tag) {
    auto [k_all, v_all] = gather_kv(k, v, tag + ".ring.kv.bwd");
    tensor dk_all = c_.zeros(k.type, k_all.shape), dv_all = c_.zeros(v.type, v_all.shape);
    for (const auto& call : prefix_calls())
      if (!call.skip)
        section_backward(call, q, k_all, v_all, out, lse, dout, dq, dk_all, dv_all, 0);
    const tensor dkv_all = c_.stack_kv(dk_all, dv_all);
    const tensor kv_local = c_.stack_kv(k, v);
    tensor dkv = c_.empty(kv_local.type, kv_local.shape);
    comm_.reduce_scatter(s_.group, dkv_all.data, dkv.data, kv_local.numel(), kv_local.type,
                         {tag + ".ring.dkv.bwd", dkv_all.shape, kv_local.shape});
    c_.unstack_kv(dkv, dk, dv);
  }

  communicator& comm_;
  compute& c_;
  ring_setup s_;
  attention_options opt_;
  int R_ = 1, r_ = 0;
  std::int64_t rows_ = 0;
  std::vector<std::int32_t> local_cu_;
  bool positioned_ = false;              ///< a window or chunk: calls carry positions
  std::vector<std::int32_t> local_pos_;  ///< this rank's rows' document positions
};

}  // namespace

std::unique_ptr<inner_attention> make_ring_attention(communicator& comm, compute& c,
                                                     const ring_setup& setup,
                                                     const layer_attention& layer) {
  return std::make_unique<ring_attention>(comm, c, setup, layer);
}

}  // namespace seqpar
