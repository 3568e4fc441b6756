#include "support/bugs.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/layout.hpp"
#include "core/ulysses.hpp"

namespace seqpar::test {

// ---- collation

void shift_labels_after_slicing(collated_batch& cb) {
  if (!shifts_whole_row(cb.options.profile))
    fail<config_error>(
        "shift_labels_after_slicing models a whole-row shift (profile veomni or deepspeed)");
  // The unshifted labels of global token t are the shifted ones of token t−1; a slice's first
  // unshifted label comes from the previous rank's last shifted label (rank 0's is rotated out
  // below, so any value does).
  std::int64_t carried = ignore_index;
  for (auto& rb : cb.ranks) {
    std::vector<std::int64_t> unshifted(rb.labels.size());
    for (std::size_t j = 0; j < unshifted.size(); ++j)
      unshifted[j] = j == 0 ? carried : rb.labels[j - 1];
    carried = rb.labels.back();
    // The bug: shift the slice on its own, labels = pad(slice[1:], (0,1), -100).
    std::rotate(unshifted.begin(), unshifted.begin() + 1, unshifted.end());
    unshifted.back() = ignore_index;
    rb.labels = std::move(unshifted);
  }
}

void position_ids_local_per_rank(collated_batch& cb) {
  if (cb.options.profile != profile::deepspeed)
    fail<config_error>(
        "position_ids_local_per_rank models DeepSpeed's adapter (profile deepspeed)");
  std::vector<std::int32_t> cu = {0};
  for (auto& rb : cb.ranks) {
    std::iota(rb.position_ids.begin(), rb.position_ids.end(), 0);
    cu.push_back(static_cast<std::int32_t>(cu.back() + rb.position_ids.size()));
  }
  for (auto& rb : cb.ranks) {
    rb.cu_seqlens = cu;
    rb.max_seqlen = cb.chunk;
  }
}

void pad_labels_with_zero(collated_batch& cb) {
  const auto L = cb.original_length;
  for (std::size_t i = static_cast<std::size_t>(L); i < cb.padded.labels.size(); ++i)
    cb.padded.labels[i] = 0;
  for (int k = 0; k < static_cast<int>(cb.ranks.size()); ++k) {
    const auto tokens = rank_tokens(cb, k);
    auto& labels = cb.ranks[static_cast<std::size_t>(k)].labels;
    for (std::size_t j = 0; j < tokens.size(); ++j)
      if (tokens[j] >= L) labels[j] = 0;
  }
}

void cu_seqlens_stop_before_padding(collated_batch& cb) {
  const auto L = static_cast<std::int32_t>(cb.original_length);
  if (cb.padded_length == cb.original_length) return;  // no padding: nothing to get wrong
  for (auto& rb : cb.ranks) {
    auto& cu = rb.cu_seqlens;
    while (cu.size() > 1 && cu[cu.size() - 2] >= L) cu.erase(cu.end() - 2);
    cu.back() = L;
    rb.max_seqlen = max_seqlen(cu);
  }
}

void cu_seqlens_cover_padding(collated_batch& cb) {
  const auto Lp = static_cast<std::int32_t>(cb.padded_length);
  for (auto& rb : cb.ranks) {
    auto& cu = rb.cu_seqlens;
    if (cu.empty() || cu.back() >= Lp) continue;
    cu.back() = Lp;
    rb.max_seqlen = max_seqlen(cu);
  }
}

void ring_cu_seqlens_from_zigzagged_ids(collated_batch& cb) {
  // xorl's ranks hold the full, zigzagged position ids of the row.
  for (auto& rb : cb.ranks) {
    rb.cu_seqlens = cu_seqlens_from_position_ids(rb.position_ids);
    rb.max_seqlen = max_seqlen(rb.cu_seqlens);
  }
}

void ring_cu_seqlens_unscaled(collated_batch& cb) {
  const int R = cb.options.ring;
  for (auto& rb : cb.ranks)
    for (auto& c : rb.cu_seqlens) c *= R;
}

// ---- compute

void merge_without_max_subtraction::lse_merge(tensor& out_acc, tensor& lse_acc,
                                              const tensor& out_new, const tensor& lse_new) {
  auto oa = to_host(out_acc), la = to_host(lse_acc);
  const auto on = to_host(out_new), ln = to_host(lse_new);
  const auto d = static_cast<std::size_t>(out_acc.shape[2]);
  const bool f32 = out_acc.type == dtype::f32;
  // Every intermediate rounded to the tensor's precision, as a kernel in that precision would.
  auto round = [f32](double x) { return f32 ? static_cast<double>(static_cast<float>(x)) : x; };
  auto ex = [&](double x) {
    return f32 ? static_cast<double>(std::exp(static_cast<float>(x))) : std::exp(x);
  };
  for (std::size_t i = 0; i < la.size(); ++i) {
    const double wa = ex(la[i]), wn = ex(ln[i]);
    for (std::size_t j = 0; j < d; ++j)
      oa[i * d + j] = round(oa[i * d + j] * wa + on[i * d + j] * wn) / (wa + wn);
    la[i] = std::log(wa + wn);
  }
  out_acc = from_host(out_acc.type, out_acc.shape, oa);
  lse_acc = from_host(lse_acc.type, lse_acc.shape, la);
}

tensor kv_heads_repeated_blockwise::repeat_heads(const tensor& x, int rep) {
  const auto S = x.shape[0], H = x.shape[1];
  tensor inter = inner().repeat_heads(x, rep);  // [S, H·rep, D], head e = original e / rep
  const tensor flat = inter.reshaped({S * H * rep, x.shape[2]});
  // Tiled: head e = original e % H, i.e. interleaved head (e % H)·rep.
  std::vector<std::int64_t> rows;
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t e = 0; e < H * rep; ++e) rows.push_back((s * H + e % H) * rep);
  return inner().gather_rows(flat, rows).reshaped(inter.shape);
}

tensor kv_heads_repeated_blockwise::sum_repeated_heads(const tensor& dx, int rep) {
  const auto S = dx.shape[0], E = dx.shape[1], H = E / rep;
  const tensor flat = dx.reshaped({S * E, dx.shape[2]});
  // Back to interleaved order (head h·rep + j ← tiled head j·H + h), then the usual sum.
  std::vector<std::int64_t> rows;
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < rep; ++j) rows.push_back(s * E + j * H + h);
  return inner().sum_repeated_heads(inner().gather_rows(flat, rows).reshaped(dx.shape), rep);
}

// ---- transport

namespace {

template <class T>
void divide(void* buf, std::int64_t count, int by) {
  auto* p = static_cast<T*>(buf);
  for (std::int64_t i = 0; i < count; ++i) p[i] /= static_cast<T>(by);
}

}  // namespace

void grad_sync_averaged::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                       dtype t) {
  forwarding_communicator::do_all_reduce(g, buf, count, t);
  if (call_info().tag.rfind("grad.", 0) != 0) return;
  switch (t) {
    case dtype::f64:
      return divide<double>(buf, count, g.size());
    case dtype::f32:
      return divide<float>(buf, count, g.size());
    default:
      fail<error>("grad_sync_averaged: gradients of {} are not modelled", dtype_name(t));
  }
}

void all_to_all_blocks_one_peer_off::do_all_to_all(const comm_group& g, const void* send,
                                                   std::span<const std::int64_t> send_counts,
                                                   void* recv,
                                                   std::span<const std::int64_t> recv_counts,
                                                   dtype t) {
  forwarding_communicator::do_all_to_all(g, send, send_counts, recv, recv_counts, t);
  const int n = g.size();
  if (n < 2) return;
  const auto esz = dtype_size(t);
  std::vector<std::size_t> offset(static_cast<std::size_t>(n) + 1, 0);
  for (int j = 0; j < n; ++j)
    offset[j + 1] = offset[j] + static_cast<std::size_t>(recv_counts[j]) * esz;
  auto* bytes = static_cast<std::byte*>(recv);
  const std::vector<std::byte> got(bytes, bytes + offset[n]);
  // Chunks laid out in order 1, 2, …, n−1, 0 (chunk lengths travel with their data).
  std::size_t at = 0;
  for (int k = 1; k <= n; ++k) {
    const int j = k % n;
    const auto len = offset[j + 1] - offset[j];
    if (len != 0) std::memcpy(bytes + at, got.data() + offset[j], len);
    at += len;
  }
}

// ---- GatedDeltaNet

namespace {

/// The documents of a row of `rows` tokens as one.
attention_docs as_one_document(const attention_docs& docs, std::int64_t rows) {
  attention_docs one = docs;
  one.cu_q = {0, static_cast<std::int32_t>(rows)};
  one.cu_k = one.cu_q;
  return one;
}

}  // namespace

z_through_all_to_all::z_through_all_to_all(std::unique_ptr<compute> inner, communicator& comm)
    : forwarding_compute(std::move(inner)), comm_(comm), group_{"bug.z", {}} {
  for (int r = 0; r < comm.world_size(); ++r) group_.ranks.push_back(r);
}

tensor z_through_all_to_all::exchanged(const tensor& z, const tensor& like) {
  return gather_seq_scatter_heads(comm_, *this, group_, z, "bug.z").reshaped(like.shape);
}

tensor z_through_all_to_all::gated_rms_norm_forward(const tensor& x, const tensor& z,
                                                    const tensor& w) {
  return forwarding_compute::gated_rms_norm_forward(x, exchanged(z, x), w);
}

void z_through_all_to_all::gated_rms_norm_backward(const tensor& x, const tensor& z,
                                                   const tensor& w, const tensor& dy, tensor& dx,
                                                   tensor& dz, tensor& dw) {
  const tensor z_held = exchanged(z, x);
  tensor dz_held;
  forwarding_compute::gated_rms_norm_backward(x, z_held, w, dy, dx, dz_held, dw);
  // Back through the exchange: the held gate is [S, Hv/U, dv] in truth.
  const int U = group_.size();
  const shape_t heads_sharded{x.shape[0] * U, x.shape[1] / U, x.shape[2]};
  dz = gather_heads_scatter_seq(comm_, *this, group_, dz_held.reshaped(heads_sharded), "bug.dz");
}

tensor conv_weight_not_sliced::causal_conv_forward(const tensor& x, const tensor& w_full,
                                                   std::span<const std::int64_t> rows,
                                                   const attention_docs& docs) {
  std::vector<std::int64_t> first(rows.size());
  std::iota(first.begin(), first.end(), 0);
  return forwarding_compute::causal_conv_forward(x, w_full, first, docs);
}

void conv_weight_not_sliced::causal_conv_backward(const tensor& x, const tensor& w_full,
                                                  std::span<const std::int64_t> rows,
                                                  const attention_docs& docs, const tensor& dy,
                                                  tensor& dx, tensor& dw_full) {
  std::vector<std::int64_t> first(rows.size());
  std::iota(first.begin(), first.end(), 0);
  forwarding_compute::causal_conv_backward(x, w_full, first, docs, dy, dx, dw_full);
}

void gates_not_sliced::delta_gates_forward(const tensor& a, const tensor& b, const tensor& A_log,
                                           const tensor& dt_bias, std::int64_t, tensor& g,
                                           tensor& beta) {
  forwarding_compute::delta_gates_forward(a, b, A_log, dt_bias, 0, g, beta);
}

void gates_not_sliced::delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                                            const tensor& dt_bias, std::int64_t, const tensor& dg,
                                            const tensor& dbeta, tensor& da, tensor& db,
                                            tensor& dA_log, tensor& ddt_bias) {
  forwarding_compute::delta_gates_backward(a, b, A_log, dt_bias, 0, dg, dbeta, da, db, dA_log,
                                           ddt_bias);
}

tensor conv_crosses_documents::causal_conv_forward(const tensor& x, const tensor& w_full,
                                                   std::span<const std::int64_t> rows,
                                                   const attention_docs& docs) {
  return forwarding_compute::causal_conv_forward(x, w_full, rows,
                                                 as_one_document(docs, x.shape[0]));
}

void conv_crosses_documents::causal_conv_backward(const tensor& x, const tensor& w_full,
                                                  std::span<const std::int64_t> rows,
                                                  const attention_docs& docs, const tensor& dy,
                                                  tensor& dx, tensor& dw_full) {
  forwarding_compute::causal_conv_backward(x, w_full, rows, as_one_document(docs, x.shape[0]), dy,
                                           dx, dw_full);
}

void state_crosses_documents::gated_delta_forward(const tensor& q, const tensor& k, const tensor& v,
                                                  const tensor& g, const tensor& beta,
                                                  const attention_docs& docs, tensor& out) {
  forwarding_compute::gated_delta_forward(q, k, v, g, beta, as_one_document(docs, q.shape[0]), out);
}

void state_crosses_documents::gated_delta_backward(const tensor& q, const tensor& k,
                                                   const tensor& v, const tensor& g,
                                                   const tensor& beta, const attention_docs& docs,
                                                   const tensor& dout, tensor& dq, tensor& dk,
                                                   tensor& dv, tensor& dg, tensor& dbeta) {
  forwarding_compute::gated_delta_backward(q, k, v, g, beta, as_one_document(docs, q.shape[0]),
                                           dout, dq, dk, dv, dg, dbeta);
}

void b_a_on_wrong_heads::do_all_to_all(const comm_group& g, const void* send,
                                       std::span<const std::int64_t> send_counts, void* recv,
                                       std::span<const std::int64_t> recv_counts, dtype t) {
  const std::string& tag = call_info().tag;
  const auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return tag.size() >= s.size() && tag.compare(tag.size() - s.size(), s.size(), s) == 0;
  };
  const int n = g.size();
  if (n < 2 || !(ends_with(".b.fwd") || ends_with(".a.fwd")))
    return forwarding_communicator::do_all_to_all(g, send, send_counts, recv, recv_counts, t);
  // Ulysses blocks are equal: the block for member j becomes the one meant for j+1.
  const auto block = static_cast<std::size_t>(send_counts[0]) * dtype_size(t);
  const auto* in = static_cast<const std::byte*>(send);
  std::vector<std::byte> rotated(block * static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j)
    std::memcpy(rotated.data() + static_cast<std::size_t>(j) * block,
                in + static_cast<std::size_t>((j + 1) % n) * block, block);
  forwarding_communicator::do_all_to_all(g, rotated.data(), send_counts, recv, recv_counts, t);
}

void ring_peers_off_by_one::do_send_recv(const comm_group& g, std::span<const p2p_op> ops,
                                         dtype t) {
  if (call_info().tag.find(tag_) == std::string::npos)
    return forwarding_communicator::do_send_recv(g, ops, t);
  const int n = g.size();
  std::vector<p2p_op> shifted(ops.begin(), ops.end());
  for (auto& op : shifted)
    op.peer = op.dir == p2p_op::kind::send ? (op.peer + 1) % n : (op.peer - 1 + n) % n;
  forwarding_communicator::do_send_recv(g, shifted, t);
}

// ---- async Ulysses bugs

void q_used_before_its_wait::do_wait(std::int64_t token) {
  if (tag_of(token).ends_with(".q.fwd")) return deferred_.push_back(token);
  forwarding_communicator::do_wait(token);
}

void q_used_before_its_wait::do_all_to_all(const comm_group& g, const void* send,
                                           std::span<const std::int64_t> send_counts, void* recv,
                                           std::span<const std::int64_t> recv_counts, dtype t) {
  forwarding_communicator::do_all_to_all(g, send, send_counts, recv, recv_counts, t);
  if (!call_info().tag.ends_with(".out.fwd")) return;
  for (auto token : deferred_) forwarding_communicator::do_wait(token);
  deferred_.clear();
}

void q_and_v_waits_swapped::do_wait(std::int64_t token) {
  std::string tag = tag_of(token);
  const auto swap = [&](const char* from, const char* to) {
    if (!tag.ends_with(from)) return false;
    tag.replace(tag.size() - std::string(from).size(), std::string::npos, to);
    return true;
  };
  if (swap(".q.fwd", ".v.fwd") || swap(".v.fwd", ".q.fwd"))
    return forwarding_communicator::do_wait(token_of(tag));
  forwarding_communicator::do_wait(token);
}

namespace {

/// x [S, H, D] viewed as [S, 1, H·D] and w (b) tiled H times.
tensor tiled(compute& c, const tensor& v, std::int64_t times) {
  const auto h = c.to_host(v);
  std::vector<double> out;
  for (std::int64_t i = 0; i < times; ++i) out.insert(out.end(), h.begin(), h.end());
  return c.from_host(v.type, {static_cast<std::int64_t>(out.size())}, out);
}

std::vector<double> fold(const std::vector<double>& g, std::size_t d) {
  std::vector<double> out(d, 0.0);
  for (std::size_t i = 0; i < g.size(); ++i) out[i % d] += g[i];
  return out;
}

}  // namespace

tensor qk_norm_over_all_local_heads::head_norm_forward(const tensor& x, const tensor& w,
                                                       const tensor& b, norm_kind k, double eps) {
  const auto H = x.shape[1];
  const tensor y = forwarding_compute::head_norm_forward(
      x.reshaped({x.shape[0], 1, H * x.shape[2]}), tiled(*this, w, H), tiled(*this, b, H), k, eps);
  return y.reshaped(x.shape);
}

tensor qk_norm_over_all_local_heads::head_norm_backward(const tensor& x, const tensor& w,
                                                        norm_kind k, double eps, const tensor& dy,
                                                        std::vector<double>& dw,
                                                        std::vector<double>& db) {
  const auto H = x.shape[1], D = x.shape[2];
  const shape_t joint{x.shape[0], 1, H * D};
  std::vector<double> dwj, dbj;
  const tensor dx = forwarding_compute::head_norm_backward(x.reshaped(joint), tiled(*this, w, H), k,
                                                           eps, dy.reshaped(joint), dwj, dbj);
  const auto d = static_cast<std::size_t>(D);
  dw.resize(d, 0.0);
  db.resize(d, 0.0);
  const auto fw = fold(dwj, d), fb = fold(dbj, d);
  for (std::size_t j = 0; j < d; ++j) {
    dw[j] += fw[j];
    db[j] += fb[j];
  }
  return dx.reshaped(x.shape);
}

void embedding_grad_assigned::scatter_add_rows(tensor& acc, const tensor& x,
                                               std::span<const std::int64_t> rows) {
  auto a = to_host(acc);
  const auto xs = to_host(x);
  const auto width =
      static_cast<std::size_t>(x.shape.empty() || x.shape[0] == 0 ? 0 : x.numel() / x.shape[0]);
  for (std::size_t i = 0; i < rows.size(); ++i)
    std::copy_n(xs.begin() + static_cast<std::ptrdiff_t>(i * width), width,
                a.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rows[i]) * width));
  assign(acc, from_host(acc.type, acc.shape, a));
}

void bias_added_twice::add_bias(tensor& x, const tensor& b) {
  forwarding_compute::add_bias(x, b);
  forwarding_compute::add_bias(x, b);
}

tensor kv_not_repeated_before_all_to_all::repeat_heads(const tensor& x, int) { return x; }

void heads_scattered_strided::pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) {
  const std::int64_t S = x.shape[0], H = x.shape[1];
  const std::int64_t hl = H / g.peers;
  if (g.a != 1 || hl < 2) return inner().pack_for_heads(g, x, wire);
  // Head j·hl + i of the reordered tensor is head j + peers·i of x.
  std::vector<std::int64_t> rows;
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t j = 0; j < g.peers; ++j)
      for (std::int64_t i = 0; i < hl; ++i) rows.push_back(s * H + j + g.peers * i);
  const tensor strided =
      inner().gather_rows(x.reshaped({S * H, x.shape[2]}), rows).reshaped(x.shape);
  inner().pack_for_heads(g, strided, wire);
}

tensor v_repeated_from_k::repeat_heads(const tensor& x, int rep) {
  if (!k_) {
    k_ = inner().clone(x);
    return inner().repeat_heads(x, rep);
  }
  tensor k = std::move(*k_);
  k_.reset();
  return inner().repeat_heads(k, rep);
}

tensor attention_error_amplified::widened(const tensor& x) {
  return from_host(dtype::f64, x.shape, to_host(x));
}

void attention_error_amplified::amplify(tensor& x, const tensor& exact) {
  auto a = to_host(x);
  const auto e = to_host(exact);
  const std::uint64_t call = calls_++;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(e[i])) continue;
    if (!planted_) {
      a[i] = e[i] + k_ * (a[i] - e[i]);
      continue;
    }
    std::uint64_t z = (call << 32) + i + 0x9E3779B97F4A7C15ull;  // splitmix64 of (call, i)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    const double sign = ((z ^ (z >> 31)) & 1) ? 1.0 : -1.0;
    a[i] = e[i] * (1.0 + k_ * 0x1.0p-24 * sign);
  }
  x = from_host(x.type, x.shape, a);
}

void attention_error_amplified::attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                                  const attention_docs& docs, tensor& out,
                                                  tensor& lse) {
  forwarding_compute::attention_forward(q, k, v, docs, out, lse);
  tensor out64 = empty(dtype::f64, out.shape), lse64 = empty(dtype::f64, lse.shape);
  forwarding_compute::attention_forward(widened(q), widened(k), widened(v), docs, out64, lse64);
  amplify(out, out64);
  amplify(lse, lse64);
}

void attention_error_amplified::attention_backward(const tensor& q, const tensor& k,
                                                   const tensor& v, const tensor& out,
                                                   const tensor& lse, const tensor& dout,
                                                   const attention_docs& docs, tensor& dq,
                                                   tensor& dk, tensor& dv) {
  forwarding_compute::attention_backward(q, k, v, out, lse, dout, docs, dq, dk, dv);
  tensor dq64 = empty(dtype::f64, dq.shape), dk64 = empty(dtype::f64, dk.shape),
         dv64 = empty(dtype::f64, dv.shape);
  forwarding_compute::attention_backward(widened(q), widened(k), widened(v), widened(out),
                                         widened(lse), widened(dout), docs, dq64, dk64, dv64);
  amplify(dq, dq64);
  amplify(dk, dk64);
  amplify(dv, dv64);
}

void sink_dropped::attention_sink_forward(tensor&, tensor&, std::span<const double>) {}

std::vector<double> sink_dropped::attention_sink_backward(const tensor&, const tensor&,
                                                          const tensor&,
                                                          std::span<const double> sinks) {
  return std::vector<double>(sinks.size(), 0.0);
}

std::vector<double> sink_gradient_doubled::attention_sink_backward(const tensor& out,
                                                                   const tensor& lse,
                                                                   const tensor& dout,
                                                                   std::span<const double> sinks) {
  auto g = forwarding_compute::attention_sink_backward(out, lse, dout, sinks);
  for (auto& x : g) x *= 2;
  return g;
}

void sink_sigmoid_lse_kept::attention_sink_forward(tensor& out, tensor& lse,
                                                   std::span<const double> sinks) {
  const tensor kept = clone(lse);
  forwarding_compute::attention_sink_forward(out, lse, sinks);  // out·sigmoid(lse − sink)
  lse = kept;
}

void sink_on_every_step::attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                           const attention_docs& docs, tensor& out, tensor& lse) {
  forwarding_compute::attention_forward(q, k, v, docs, out, lse);
  forwarding_compute::attention_sink_forward(out, lse, sinks_);
}

void attention_docs_changed::attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                               const attention_docs& docs, tensor& out,
                                               tensor& lse) {
  attention_docs d = docs;
  f_(d);
  forwarding_compute::attention_forward(q, k, v, d, out, lse);
}

void attention_docs_changed::attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                                const tensor& out, const tensor& lse,
                                                const tensor& dout, const attention_docs& docs,
                                                tensor& dq, tensor& dk, tensor& dv) {
  attention_docs d = docs;
  f_(d);
  forwarding_compute::attention_backward(q, k, v, out, lse, dout, d, dq, dk, dv);
}

void window_off_by_one(attention_docs& d) {
  if (d.window_back >= 0) ++d.window_back;
}

void positions_dropped(attention_docs& d) {
  d.pos_q.clear();
  d.pos_k.clear();
}

void softcap_without_scale(attention_docs& d) { d.softcap *= d.scale; }

void causal_mask_left_in(attention_docs& d) { d.causal = true; }

void doc_mask_dropped_off_diagonal(attention_docs& d) {
  if (d.causal || d.cu_q.empty() || d.cu_k.empty()) return;
  d.cu_q = {0, d.cu_q.back()};
  d.cu_k = {0, d.cu_k.back()};
}

}  // namespace seqpar::test
