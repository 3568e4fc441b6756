#include "core/ring_attention.hpp"

#include <cmath>
#include <limits>

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
};

void push_doc(std::vector<std::int32_t>& cu, std::int64_t len) {
  cu.push_back(static_cast<std::int32_t>(cu.back() + len));
}

// One class of ~340 lines, kept whole on purpose: the forward's schedule (which block each step
// computes, the sections of zigzag, the merge) and the backward's (the same steps in the same
// order, the dK/dV accumulator travelling the ring) must mirror each other line for line, and
// reading them side by side in one class is how a change to one is checked against the other.
class ring_attention final : public inner_attention {
 public:
  ring_attention(communicator& comm, compute& c, ring_setup s)
      : comm_(comm), c_(c), s_(std::move(s)) {
    R_ = s_.group.size();
    r_ = s_.group.index_of(comm.rank());
    if (r_ < 0) fail<error>("rank {} is not in ring group '{}'", comm.rank(), s_.group.name);
    if (s_.padded_length % R_ != 0)
      fail<shape_error>("ring: padded length {} is not divisible by ring={}", s_.padded_length, R_);
    rows_ = s_.padded_length / R_;
    // Each ring rank holds len/R rows of every document: local cu = cu // R.
    if (s_.zigzag) local_cu_ = scale_cu_seqlens_for_ring(s_.cu_global, R_);
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
  }

  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                const std::string& tag) override {
    c_.fill(dq, 0.0);
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

  /// The attention call of step i (KV of ring rank src) for this rank's rows.
  section_call section(int step, int src) const {
    section_call call;
    call.docs.scale = s_.scale;
    call.docs.cu_q = {0};
    call.docs.cu_k = {0};
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
    const std::int64_t q0 = r_ * rows_, k0 = static_cast<std::int64_t>(src) * rows_;
    for (const auto& d : doc_ranges(s_.cu_global)) {
      auto overlap = [&](std::int64_t b0) {
        return std::max<std::int64_t>(0, std::min(d.end, b0 + rows_) - std::max(d.start, b0));
      };
      push_doc(call.docs.cu_q, overlap(q0));
      push_doc(call.docs.cu_k, overlap(k0));
    }
    if (call.docs.causal) call.docs.cu_k = call.docs.cu_q;
    for (std::int64_t j = 0; j < call.docs.cu_k.back(); ++j) call.k_rows.push_back(j);
    if (call.k_rows.size() == static_cast<std::size_t>(rows_)) call.k_rows.clear();
    return call;
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
  /// (dk_acc, dv_acc hold `block_rows` rows per source, this source at `k_offset`).
  void section_backward(const section_call& call, const tensor& q, const tensor& ks,
                        const tensor& vs, const tensor& out, const tensor& lse, const tensor& dout,
                        tensor& dq, tensor& dk_acc, tensor& dv_acc, std::int64_t k_offset) {
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
                       lse, dout, dq, dk_all, dv_all, src * rows_);
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
        section_backward(call, q, ks, vs, out, lse, dout, dq, dks, dvs, 0);
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
  std::vector<section_call> prefix_calls() const {
    std::vector<section_call> calls;
    auto start = [&](bool all_q) {
      section_call c;
      c.all_q = all_q;
      c.docs.scale = s_.scale;
      c.docs.causal = true;
      c.docs.cu_q = {0};
      c.docs.cu_k = {0};
      return c;
    };
    if (!s_.zigzag) {  // contiguous: global order is the gathered order
      section_call c = start(true);
      const std::int64_t q0 = r_ * rows_;
      for (const auto& d : doc_ranges(s_.cu_global)) {
        const auto q_len =
            std::max<std::int64_t>(0, std::min(d.end, q0 + rows_) - std::max(d.start, q0));
        const auto k_end = std::min(d.end, q0 + rows_);
        push_doc(c.docs.cu_q, q_len);
        const auto k_len = q_len > 0 ? k_end - d.start : 0;
        for (auto j = d.start; j < d.start + k_len; ++j) c.k_rows.push_back(j);
        push_doc(c.docs.cu_k, k_len);
      }
      c.skip = c.k_rows.empty();
      calls.push_back(std::move(c));
      return calls;
    }
    // Zigzag: global chunk j of a document lives on ring rank j (early half) or 2R−1−j (late).
    for (int piece = 0; piece < 2; ++piece) {
      const int j_q = piece == 0 ? r_ : 2 * R_ - 1 - r_;
      section_call c = start(false);
      for (const auto& d : doc_ranges(local_cu_)) {
        const auto half = d.size() / 2;
        for (auto i = d.start + piece * half; i < d.start + (piece + 1) * half; ++i)
          c.q_rows.push_back(i);
        push_doc(c.docs.cu_q, half);
        for (int j = 0; j <= j_q; ++j) {
          const int owner = j < R_ ? j : 2 * R_ - 1 - j;
          const auto first = owner * rows_ + d.start + (j < R_ ? 0 : half);
          for (auto i = first; i < first + half; ++i) c.k_rows.push_back(i);
        }
        push_doc(c.docs.cu_k, (j_q + 1) * half);
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
  int R_ = 1, r_ = 0;
  std::int64_t rows_ = 0;
  std::vector<std::int32_t> local_cu_;
};

}  // namespace

std::unique_ptr<inner_attention> make_ring_attention(communicator& comm, compute& c,
                                                     const ring_setup& setup) {
  return std::make_unique<ring_attention>(comm, c, setup);
}

}  // namespace seqpar
