#include "sim/faulty_comm.hpp"

#include <charconv>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "core/error.hpp"

namespace seqpar {

std::string_view fault_kind_name(fault_kind k) {
  switch (k) {
    case fault_kind::none:
      return "none";
    case fault_kind::drop_chunk:
      return "drop_chunk";
    case fault_kind::duplicate_chunk:
      return "duplicate_chunk";
    case fault_kind::permute_chunks:
      return "permute_chunks";
    case fault_kind::wrong_count:
      return "wrong_count";
    case fault_kind::swap_peers:
      return "swap_peers";
    case fault_kind::sum_off_by_one:
      return "sum_off_by_one";
  }
  return "?";
}

fault_spec parse_fault(std::string_view text) {
  static constexpr fault_kind kinds[] = {fault_kind::drop_chunk,     fault_kind::duplicate_chunk,
                                         fault_kind::permute_chunks, fault_kind::wrong_count,
                                         fault_kind::swap_peers,     fault_kind::sum_off_by_one};
  const auto colon = text.find(':');
  const auto kind = text.substr(0, colon);
  fault_spec f;
  for (auto k : kinds)
    if (fault_kind_name(k) == kind) f.kind = k;
  if (f.kind == fault_kind::none)
    fail<config_error>(
        "--fault '{}': the kind '{}' is unknown; use drop_chunk, duplicate_chunk, "
        "permute_chunks, wrong_count, swap_peers or sum_off_by_one, then :key=value,… (rank, "
        "op, tag, call, peer, other, every)",
        text, kind);
  if (colon == std::string_view::npos) return f;
  auto rest = text.substr(colon + 1);
  const auto number = [&](std::string_view key, std::string_view v, std::int64_t lo) {
    std::int64_t x = 0;
    const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec != std::errc{} || p != v.data() + v.size() || x < lo || x > (1 << 20))
      fail<config_error>("--fault '{}': {}={} is not an integer in [{}, {}]", text, key, v, lo,
                         1 << 20);
    return x;
  };
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const auto part = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const auto eq = part.find('=');
    const auto key = part.substr(0, eq);
    const auto value = eq == std::string_view::npos ? std::string_view{} : part.substr(eq + 1);
    if (key == "every" && eq == std::string_view::npos) {
      f.every_call = true;
    } else if (eq == std::string_view::npos) {
      fail<config_error>(
          "--fault '{}': '{}' is not key=value; keys: rank, op, tag, call, peer, "
          "other, and the flag every",
          text, part);
    } else if (key == "rank") {
      f.rank = static_cast<int>(number(key, value, 0));
    } else if (key == "op") {
      f.op = std::string(value);
    } else if (key == "tag") {
      f.tag = std::string(value);
    } else if (key == "call") {
      f.call = number(key, value, 0);
    } else if (key == "peer") {
      f.peer = static_cast<int>(number(key, value, 0));
    } else if (key == "other") {
      f.other_peer = static_cast<int>(number(key, value, 0));
    } else {
      fail<config_error>(
          "--fault '{}': the key '{}' is unknown; keys: rank, op, tag, call, "
          "peer, other, and the flag every",
          text, key);
    }
  }
  return f;
}

namespace {

struct chunk {
  std::byte* data;
  std::size_t bytes;
};

// The count a wrong_count fault hands to the transport instead of c.
std::int64_t off_by_one(std::int64_t c) { return c > 0 ? c - 1 : c + 1; }

// Applies drop/duplicate/permute/swap to chunks a and b of `chunks`. When `contiguous`, the
// chunks tile one region in order and a reordering re-lays the whole region (chunk lengths
// move with their data); otherwise chunk i receives the leading bytes of its new source.
void corrupt_chunks(fault_kind kind, std::vector<chunk>& chunks, int a, int b, bool contiguous) {
  if (kind == fault_kind::drop_chunk) {
    if (chunks[a].bytes != 0) std::memset(chunks[a].data, 0, chunks[a].bytes);
    return;
  }
  if (kind == fault_kind::duplicate_chunk) {
    const auto n = std::min(chunks[a].bytes, chunks[b].bytes);
    if (n != 0) std::memmove(chunks[b].data, chunks[a].data, n);
    return;
  }
  std::vector<int> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  if (kind == fault_kind::permute_chunks) std::reverse(order.begin(), order.end());
  if (kind == fault_kind::swap_peers) std::swap(order[a], order[b]);
  std::vector<std::vector<std::byte>> snap;
  for (const auto& c : chunks) snap.emplace_back(c.data, c.data + c.bytes);
  if (contiguous) {
    std::byte* out = chunks.empty() ? nullptr : chunks[0].data;
    for (int src : order) {
      if (!snap[src].empty()) std::memcpy(out, snap[src].data(), snap[src].size());
      out += snap[src].size();
    }
  } else {
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      const auto& src = snap[order[i]];
      const auto n = std::min(chunks[i].bytes, src.size());
      if (n != 0) std::memcpy(chunks[i].data, src.data(), n);
    }
  }
}

template <class T>
void double_in_place(void* buf, std::int64_t count) {
  auto* p = static_cast<T*>(buf);
  for (std::int64_t k = 0; k < count; ++k) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      p[k] = static_cast<T>(static_cast<U>(p[k]) + static_cast<U>(p[k]));
    } else {
      p[k] = p[k] + p[k];
    }
  }
}

// The corruption of a reduced block (reduce_scatter output, all_reduce buffer).
void corrupt_reduced(fault_kind kind, void* buf, std::int64_t count, dtype t) {
  const auto esz = dtype_size(t);
  auto* bytes = static_cast<std::byte*>(buf);
  switch (kind) {
    case fault_kind::drop_chunk:
      if (count != 0) std::memset(buf, 0, count * esz);
      break;
    case fault_kind::duplicate_chunk:
      switch (t) {
        case dtype::f64:
          double_in_place<double>(buf, count);
          break;
        case dtype::f32:
          double_in_place<float>(buf, count);
          break;
        case dtype::i32:
          double_in_place<std::int32_t>(buf, count);
          break;
        case dtype::i64:
          double_in_place<std::int64_t>(buf, count);
          break;
        case dtype::bf16:
          fail<error>("fault duplicate_chunk cannot double a bfloat16 reduction result");
      }
      break;
    case fault_kind::permute_chunks:
      for (std::int64_t i = 0, j = count - 1; i < j; ++i, --j)
        std::swap_ranges(bytes + i * esz, bytes + (i + 1) * esz, bytes + j * esz);
      break;
    case fault_kind::sum_off_by_one:
      if (count == 0) break;
      switch (t) {
        case dtype::f64:
          *static_cast<double*>(buf) += 1;
          break;
        case dtype::f32:
          *static_cast<float*>(buf) += 1;
          break;
        case dtype::i32:
          *static_cast<std::int32_t*>(buf) += 1;
          break;
        case dtype::i64:
          *static_cast<std::int64_t*>(buf) += 1;
          break;
        case dtype::bf16:
          fail<error>("fault sum_off_by_one cannot add to a bfloat16 reduction result");
      }
      break;
    default:
      break;
  }
}

}  // namespace

faulty_communicator::faulty_communicator(communicator& inner, fault_spec spec)
    : inner_(inner), spec_(std::move(spec)) {
  if (spec_.rank < 0 || spec_.call < 0 || spec_.peer < 0 || spec_.other_peer < 0)
    fail<config_error>(
        "fault {}: rank {}, call {}, peer {} and other_peer {} must all be non-negative",
        fault_kind_name(spec_.kind), spec_.rank, spec_.call, spec_.peer, spec_.other_peer);
  const bool two_peers =
      spec_.kind == fault_kind::duplicate_chunk || spec_.kind == fault_kind::swap_peers;
  if (two_peers && spec_.peer == spec_.other_peer)
    fail<config_error>("fault {} needs two different members, got peer = other_peer = {}",
                       fault_kind_name(spec_.kind), spec_.peer);
}

bool faulty_communicator::hit(const char* op, bool meaningful) {
  if (spec_.kind == fault_kind::none || !meaningful || rank() != spec_.rank) return false;
  if (!spec_.op.empty() && spec_.op != op) return false;
  if (!spec_.tag.empty() && call_info().tag.find(spec_.tag) == std::string::npos) return false;
  const auto index = matches_++;
  const bool h = spec_.every_call ? index >= spec_.call : index == spec_.call;
  if (h) ++hits_;
  return h;
}

void faulty_communicator::do_all_to_all(const comm_group& g, const void* send,
                                        std::span<const std::int64_t> send_counts, void* recv,
                                        std::span<const std::int64_t> recv_counts, dtype t) {
  const int n = g.size();
  const bool two =
      spec_.kind == fault_kind::duplicate_chunk || spec_.kind == fault_kind::swap_peers;
  const bool meaningful = spec_.peer < n && (!two || spec_.other_peer < n) &&
                          (spec_.kind != fault_kind::permute_chunks || n >= 2) &&
                          spec_.kind != fault_kind::sum_off_by_one;
  if (!hit("all_to_all", meaningful)) {
    inner_.all_to_all(g, send, send_counts, recv, recv_counts, t, call_info());
    return;
  }
  if (spec_.kind == fault_kind::wrong_count) {
    std::vector<std::int64_t> wrong(send_counts.begin(), send_counts.end());
    wrong[spec_.peer] = off_by_one(wrong[spec_.peer]);
    inner_.all_to_all(g, send, wrong, recv, recv_counts, t, call_info());
    return;
  }
  inner_.all_to_all(g, send, send_counts, recv, recv_counts, t, call_info());
  const auto esz = dtype_size(t);
  std::vector<chunk> chunks;
  auto* p = static_cast<std::byte*>(recv);
  for (auto c : recv_counts) {
    chunks.push_back({p, static_cast<std::size_t>(c) * esz});
    p += c * esz;
  }
  corrupt_chunks(spec_.kind, chunks, spec_.peer, spec_.other_peer, true);
}

void faulty_communicator::do_all_gather(const comm_group& g, const void* send, std::int64_t count,
                                        void* recv, dtype t) {
  const int n = g.size();
  const bool two =
      spec_.kind == fault_kind::duplicate_chunk || spec_.kind == fault_kind::swap_peers;
  const bool meaningful = spec_.peer < n && (!two || spec_.other_peer < n) &&
                          (spec_.kind != fault_kind::permute_chunks || n >= 2) &&
                          (spec_.kind != fault_kind::wrong_count || n >= 2) &&
                          spec_.kind != fault_kind::sum_off_by_one;
  if (!hit("all_gather", meaningful)) {
    inner_.all_gather(g, send, count, recv, t, call_info());
    return;
  }
  if (spec_.kind == fault_kind::wrong_count) {
    inner_.all_gather(g, send, off_by_one(count), recv, t, call_info());
    return;
  }
  inner_.all_gather(g, send, count, recv, t, call_info());
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<chunk> chunks;
  for (int j = 0; j < n; ++j) chunks.push_back({static_cast<std::byte*>(recv) + j * block, block});
  corrupt_chunks(spec_.kind, chunks, spec_.peer, spec_.other_peer, true);
}

void faulty_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                            std::int64_t count, dtype t) {
  const bool meaningful = spec_.kind != fault_kind::swap_peers &&
                          (spec_.kind != fault_kind::wrong_count || g.size() >= 2);
  if (!hit("reduce_scatter", meaningful)) {
    inner_.reduce_scatter(g, send, recv, count, t, call_info());
    return;
  }
  if (spec_.kind == fault_kind::wrong_count) {
    inner_.reduce_scatter(g, send, recv, off_by_one(count), t, call_info());
    return;
  }
  inner_.reduce_scatter(g, send, recv, count, t, call_info());
  corrupt_reduced(spec_.kind, recv, count, t);
}

void faulty_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                        dtype t) {
  const bool meaningful = spec_.kind != fault_kind::swap_peers &&
                          (spec_.kind != fault_kind::wrong_count || g.size() >= 2);
  if (!hit("all_reduce", meaningful)) {
    inner_.all_reduce(g, buf, count, t, call_info());
    return;
  }
  if (spec_.kind == fault_kind::wrong_count) {
    inner_.all_reduce(g, buf, off_by_one(count), t, call_info());
    return;
  }
  inner_.all_reduce(g, buf, count, t, call_info());
  corrupt_reduced(spec_.kind, buf, count, t);
}

void faulty_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  // Chunks: the recvs in posting order; "chunk of member m" is the first recv from m.
  std::vector<std::size_t> recv_ops;
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].dir == p2p_op::kind::recv) recv_ops.push_back(i);
  auto first_recv_from = [&](int member) -> int {
    for (std::size_t c = 0; c < recv_ops.size(); ++c)
      if (ops[recv_ops[c]].peer == member) return static_cast<int>(c);
    return -1;
  };
  const int ca = first_recv_from(spec_.peer), cb = first_recv_from(spec_.other_peer);
  auto first_op_with_peer =
      std::find_if(ops.begin(), ops.end(), [&](const p2p_op& o) { return o.peer == spec_.peer; });
  bool meaningful = false;
  switch (spec_.kind) {
    case fault_kind::none:
    case fault_kind::sum_off_by_one:  // a reduction's fault
      break;
    case fault_kind::drop_chunk:
      meaningful = ca >= 0;
      break;
    case fault_kind::duplicate_chunk:
    case fault_kind::swap_peers:
      meaningful = ca >= 0 && cb >= 0;
      break;
    case fault_kind::permute_chunks:
      meaningful = recv_ops.size() >= 2;
      break;
    case fault_kind::wrong_count:
      meaningful = first_op_with_peer != ops.end();
      break;
  }
  if (!hit("send_recv", meaningful)) {
    inner_.send_recv(g, ops, t, call_info());
    return;
  }
  if (spec_.kind == fault_kind::wrong_count) {
    std::vector<p2p_op> wrong(ops.begin(), ops.end());
    auto& o = wrong[first_op_with_peer - ops.begin()];
    o.count = off_by_one(o.count);
    inner_.send_recv(g, wrong, t, call_info());
    return;
  }
  inner_.send_recv(g, ops, t, call_info());
  const auto esz = dtype_size(t);
  std::vector<chunk> chunks;
  for (auto i : recv_ops)
    chunks.push_back(
        {static_cast<std::byte*>(ops[i].buf), static_cast<std::size_t>(ops[i].count) * esz});
  corrupt_chunks(spec_.kind, chunks, ca, cb, false);
}

void faulty_communicator::do_barrier(const comm_group& g) { inner_.barrier(g, call_info()); }

}  // namespace seqpar
