#include "sim/eigen_compute.hpp"

#include <fmt/ranges.h>

#include <Eigen/Core>
#include <cstring>

#include "sim/attention.hpp"
#include "sim/float_dispatch.hpp"

namespace seqpar::sim {

tensor host_tensor(dtype t, shape_t s) {
  tensor x;
  x.type = t;
  x.shape = std::move(s);
  const std::size_t n = std::max<std::size_t>(x.bytes(), 1);
  std::shared_ptr<std::byte[]> bytes(new std::byte[n]);
  x.data = bytes.get();
  x.storage = std::shared_ptr<void>(bytes, bytes.get());
  return x;
}

namespace {

void same_shape(const tensor& a, const tensor& b, const char* op) {
  if (a.shape != b.shape || a.type != b.type)
    fail<shape_error>("{}: tensors of {} [{}] and {} [{}] differ", op, dtype_name(a.type),
                      fmt::join(a.shape, ","), dtype_name(b.type), fmt::join(b.shape, ","));
}

std::int64_t row_size(const tensor& x) { return x.shape.empty() ? 1 : x.numel() / x.shape[0]; }

}  // namespace

tensor eigen_compute::empty(dtype t, shape_t s) { return host_tensor(t, std::move(s)); }

tensor eigen_compute::zeros(dtype t, shape_t s) {
  tensor x = host_tensor(t, std::move(s));
  std::memset(x.data, 0, x.bytes());
  return x;
}

void eigen_compute::pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) {
  if (x.numel() != g.numel_local() || wire.numel() != g.numel_local())
    fail<shape_error>("pack_for_heads: {} and {} elements for a plan of {}", x.numel(),
                      wire.numel(), g.numel_local());
  const auto esz = dtype_size(x.type);
  const auto* src = static_cast<const std::byte*>(x.data);
  auto* dst = static_cast<std::byte*>(wire.data);
  // Copy runs of head_dim elements: d is the innermost index on both sides.
  for (std::int64_t e = 0; e < g.numel_local(); e += g.head_dim)
    std::memcpy(dst + e * esz, src + g.seq_sharded_offset(e) * esz, g.head_dim * esz);
}

void eigen_compute::unpack_to_seq(const a2a_geometry& g, const tensor& wire, tensor& x) {
  if (x.numel() != g.numel_local() || wire.numel() != g.numel_local())
    fail<shape_error>("unpack_to_seq: {} and {} elements for a plan of {}", x.numel(), wire.numel(),
                      g.numel_local());
  const auto esz = dtype_size(x.type);
  const auto* src = static_cast<const std::byte*>(wire.data);
  auto* dst = static_cast<std::byte*>(x.data);
  for (std::int64_t e = 0; e < g.numel_local(); e += g.head_dim)
    std::memcpy(dst + g.seq_sharded_offset(e) * esz, src + e * esz, g.head_dim * esz);
}

tensor eigen_compute::repeat_heads(const tensor& x, int rep) {
  const auto S = x.shape[0], H = x.shape[1], D = x.shape[2];
  tensor out = empty(x.type, {S, H * rep, D});
  const auto esz = dtype_size(x.type);
  const auto* src = static_cast<const std::byte*>(x.data);
  auto* dst = static_cast<std::byte*>(out.data);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t h = 0; h < H; ++h)
      for (int r = 0; r < rep; ++r)
        std::memcpy(dst + ((s * H + h) * rep + r) * D * esz, src + (s * H + h) * D * esz, D * esz);
  return out;
}

tensor eigen_compute::sum_repeated_heads(const tensor& dx, int rep) {
  const auto S = dx.shape[0], He = dx.shape[1], D = dx.shape[2];
  const auto H = He / rep;
  tensor out = zeros(dx.type, {S, H, D});
  by_float(dx.type, [&]<class T>() {
    const T* src = dx.as<T>();
    T* dst = out.as<T>();
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (int r = 0; r < rep; ++r)
          for (std::int64_t d = 0; d < D; ++d)
            dst[(s * H + h) * D + d] += src[((s * H + h) * rep + r) * D + d];
  });
  return out;
}

tensor eigen_compute::stack_kv(const tensor& k, const tensor& v) {
  same_shape(k, v, "stack_kv");
  const auto S = k.shape[0], H = k.shape[1], D = k.shape[2];
  tensor out = empty(k.type, {S, H, 2, D});
  const auto esz = dtype_size(k.type);
  auto* dst = static_cast<std::byte*>(out.data);
  for (std::int64_t i = 0; i < S * H; ++i) {
    std::memcpy(dst + (2 * i) * D * esz, static_cast<const std::byte*>(k.data) + i * D * esz,
                D * esz);
    std::memcpy(dst + (2 * i + 1) * D * esz, static_cast<const std::byte*>(v.data) + i * D * esz,
                D * esz);
  }
  return out;
}

void eigen_compute::unstack_kv(const tensor& kv, tensor& k, tensor& v) {
  same_shape(k, v, "unstack_kv");
  const auto S = k.shape[0], H = k.shape[1], D = k.shape[2];
  if (kv.numel() != 2 * k.numel())
    fail<shape_error>("unstack_kv: {} elements cannot split into two of [{}]", kv.numel(),
                      fmt::join(k.shape, ","));
  const auto esz = dtype_size(k.type);
  const auto* src = static_cast<const std::byte*>(kv.data);
  for (std::int64_t i = 0; i < S * H; ++i) {
    std::memcpy(static_cast<std::byte*>(k.data) + i * D * esz, src + (2 * i) * D * esz, D * esz);
    std::memcpy(static_cast<std::byte*>(v.data) + i * D * esz, src + (2 * i + 1) * D * esz,
                D * esz);
  }
}

tensor eigen_compute::gather_rows(const tensor& x, std::span<const std::int64_t> rows) {
  shape_t s = x.shape;
  s[0] = static_cast<std::int64_t>(rows.size());
  tensor out = empty(x.type, s);
  const auto rb = row_size(x) * static_cast<std::int64_t>(dtype_size(x.type));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= x.shape[0])
      fail<shape_error>("gather_rows: row {} outside a tensor of {} rows", rows[i], x.shape[0]);
    std::memcpy(static_cast<std::byte*>(out.data) + static_cast<std::int64_t>(i) * rb,
                static_cast<const std::byte*>(x.data) + rows[i] * rb, static_cast<std::size_t>(rb));
  }
  return out;
}

void eigen_compute::scatter_rows(tensor& dst, const tensor& x, std::span<const std::int64_t> rows) {
  const auto rb = row_size(dst) * static_cast<std::int64_t>(dtype_size(dst.type));
  if (row_size(x) != row_size(dst) || x.shape[0] != static_cast<std::int64_t>(rows.size()) ||
      x.type != dst.type)
    fail<shape_error>("scatter_rows: {} rows of {} into rows of {}", x.shape[0], row_size(x),
                      row_size(dst));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= dst.shape[0])
      fail<shape_error>("scatter_rows: row {} outside a tensor of {} rows", rows[i], dst.shape[0]);
    std::memcpy(static_cast<std::byte*>(dst.data) + rows[i] * rb,
                static_cast<const std::byte*>(x.data) + static_cast<std::int64_t>(i) * rb,
                static_cast<std::size_t>(rb));
  }
}

void eigen_compute::fill(tensor& x, double value) {
  by_float(x.type, [&]<class T>() {
    T* p = x.as<T>();
    std::fill(p, p + x.numel(), static_cast<T>(value));
  });
}

void eigen_compute::scatter_add_rows(tensor& acc, const tensor& x,
                                     std::span<const std::int64_t> rows) {
  const auto rs = row_size(acc);
  if (row_size(x) != rs || x.shape[0] != static_cast<std::int64_t>(rows.size()))
    fail<shape_error>("scatter_add_rows: {} rows of {} into rows of {}", x.shape[0], row_size(x),
                      rs);
  by_float(acc.type, [&]<class T>() {
    T* a = acc.as<T>();
    const T* b = x.as<T>();
    for (std::size_t i = 0; i < rows.size(); ++i)
      for (std::int64_t j = 0; j < rs; ++j)
        a[rows[i] * rs + j] += b[static_cast<std::int64_t>(i) * rs + j];
  });
}

void eigen_compute::add(tensor& acc, const tensor& x) {
  if (acc.numel() != x.numel() || acc.type != x.type)
    fail<shape_error>("add: {} and {} elements", acc.numel(), x.numel());
  by_float(acc.type, [&]<class T>() {
    T* a = acc.as<T>();
    const T* b = x.as<T>();
    for (std::int64_t i = 0; i < acc.numel(); ++i) a[i] += b[i];
  });
}

void eigen_compute::gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
                         double alpha, double beta) {
  if (a.shape.size() != 2 || b.shape.size() != 2 || c.shape.size() != 2 || a.type != b.type ||
      a.type != c.type)
    fail<shape_error>("gemm: a [{}], b [{}], c [{}] must be 2-D of one dtype",
                      fmt::join(a.shape, ","), fmt::join(b.shape, ","), fmt::join(c.shape, ","));
  by_float(a.type, [&]<class T>() {
    using M = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const Eigen::Map<const M> A(a.as<T>(), a.shape[0], a.shape[1]);
    const Eigen::Map<const M> B(b.as<T>(), b.shape[0], b.shape[1]);
    Eigen::Map<M> C(c.as<T>(), c.shape[0], c.shape[1]);
    const Eigen::Index m = trans_a ? A.cols() : A.rows(), k = trans_a ? A.rows() : A.cols();
    const Eigen::Index kb = trans_b ? B.cols() : B.rows(), n = trans_b ? B.rows() : B.cols();
    if (k != kb || C.rows() != m || C.cols() != n)
      fail<shape_error>("gemm: op(a) is [{}, {}], op(b) [{}, {}], c [{}, {}]", m, k, kb, n,
                        C.rows(), C.cols());
    M product = trans_a ? (trans_b ? M(A.transpose() * B.transpose()) : M(A.transpose() * B))
                        : (trans_b ? M(A * B.transpose()) : M(A * B));
    if (beta == 0.0)
      C = product * static_cast<T>(alpha);
    else
      C = product * static_cast<T>(alpha) + C * static_cast<T>(beta);
  });
}

tensor eigen_compute::clone(const tensor& x) {
  tensor out = empty(x.type, x.shape);
  std::memcpy(out.data, x.data, x.bytes());
  return out;
}

void eigen_compute::scale(tensor& acc, double s) {
  by_float(acc.type, [&]<class T>() {
    T* a = acc.as<T>();
    for (std::int64_t i = 0; i < acc.numel(); ++i) a[i] = static_cast<T>(a[i] * s);
  });
}

namespace {
template <class T>
attention_args<T> args_of(const tensor& q, const tensor& k, const tensor& v,
                          const attention_docs& docs) {
  if (docs.cu_q.size() != docs.cu_k.size() || docs.cu_q.empty())
    fail<shape_error>(
        "attention: cu_q has {} entries and cu_k {}; they must match and be non-empty",
        docs.cu_q.size(), docs.cu_k.size());
  if (q.shape.size() != 3 || k.shape != v.shape || k.shape.size() != 3 || q.shape[2] != k.shape[2])
    fail<shape_error>("attention: q [{}], k [{}], v [{}] are not [tokens, heads, head_dim] alike",
                      fmt::join(q.shape, ","), fmt::join(k.shape, ","), fmt::join(v.shape, ","));
  attention_args<T> a{};
  a.q = q.as<T>();
  a.k = k.as<T>();
  a.v = v.as<T>();
  a.sq = q.shape[0];
  a.sk = k.shape[0];
  a.hq = static_cast<int>(q.shape[1]);
  a.hkv = static_cast<int>(k.shape[1]);
  a.d = static_cast<int>(q.shape[2]);
  a.cu_q = docs.cu_q.data();
  a.cu_k = docs.cu_k.data();
  a.n_docs = static_cast<int>(docs.cu_q.size()) - 1;
  a.scale = docs.scale;
  a.causal = docs.causal;
  a.back = docs.window_back;
  a.ahead = docs.window_ahead;
  a.chunk = docs.chunk;
  a.softcap = docs.softcap;
  const auto positions = [](const std::vector<std::int32_t>& pos, std::int64_t rows,
                            const char* name) -> const std::int32_t* {
    if (pos.empty()) return nullptr;
    if (static_cast<std::int64_t>(pos.size()) != rows)
      fail<shape_error>("attention: {} holds {} positions for {} rows; give one per row or none",
                        name, pos.size(), rows);
    return pos.data();
  };
  a.pos_q = positions(docs.pos_q, a.sq, "pos_q");
  a.pos_k = positions(docs.pos_k, a.sk, "pos_k");
  return a;
}
}  // namespace

void eigen_compute::attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                      const attention_docs& docs, tensor& out, tensor& lse) {
  by_float(q.type, [&]<class T>() {
    auto a = args_of<T>(q, k, v, docs);
    if (naive_)
      sim::attention_forward_naive(a, out.as<T>(), lse.as<T>());
    else
      sim::attention_forward(a, out.as<T>(), lse.as<T>(), workers_);
  });
}

void eigen_compute::attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                       const tensor& out, const tensor& lse, const tensor& dout,
                                       const attention_docs& docs, tensor& dq, tensor& dk,
                                       tensor& dv) {
  by_float(q.type, [&]<class T>() {
    auto a = args_of<T>(q, k, v, docs);
    if (naive_)
      sim::attention_backward_naive(a, out.as<T>(), lse.as<T>(), dout.as<T>(), dq.as<T>(),
                                    dk.as<T>(), dv.as<T>());
    else
      sim::attention_backward(a, out.as<T>(), lse.as<T>(), dout.as<T>(), dq.as<T>(), dk.as<T>(),
                              dv.as<T>(), workers_);
  });
}

void eigen_compute::lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                              const tensor& lse_new) {
  same_shape(out_acc, out_new, "lse_merge");
  same_shape(lse_acc, lse_new, "lse_merge");
  by_float(out_acc.type, [&]<class T>() {
    sim::lse_merge(out_acc.as<T>(), lse_acc.as<T>(), out_new.as<T>(), lse_new.as<T>(),
                   out_acc.shape[0], static_cast<int>(out_acc.shape[1]),
                   static_cast<int>(out_acc.shape[2]));
  });
}

std::vector<double> eigen_compute::to_host(const tensor& x) {
  return by_float(x.type, [&]<class T>() {
    const T* p = x.as<T>();
    return std::vector<double>(p, p + x.numel());
  });
}

tensor eigen_compute::from_host(dtype t, shape_t s, std::span<const double> values) {
  tensor x = empty(t, std::move(s));
  if (static_cast<std::int64_t>(values.size()) != x.numel())
    fail<shape_error>("from_host: {} values for {} elements", values.size(), x.numel());
  by_float(t, [&]<class T>() {
    T* p = x.as<T>();
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return x;
}

}  // namespace seqpar::sim
