#include "mpi/mpi_comm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <type_traits>
#include <vector>

#include "core/comm_checks.hpp"
#include "core/error.hpp"

namespace seqpar::mpi {

// ---- session and error conversion ----

bool mpi_active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

std::string processor_name() {
  if (mpi_active()) {
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS) return std::string(name, len);
  }
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) == 0) return name;
  return "unknown-host";
}

namespace {

int world_rank() {
  int r = -1;
  if (mpi_active()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

}  // namespace

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  std::string message;
  if (MPI_Error_string(code, text, &len) == MPI_SUCCESS)
    message.assign(text, static_cast<std::size_t>(len));
  else
    message = "unknown MPI error code";
  throw backend_error(call, code, message, world_rank(), processor_name());
}

mpi_session::mpi_session(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    // Only the thread that created the session calls MPI; the CPU reference may run on other
    // threads of rank 0 (run_ranks(1, …)), which never touch MPI.
    const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS)
      throw backend_error("MPI_Init_thread", rc, "MPI could not start (run under mpiexec?)", -1,
                          processor_name());
    owns_ = true;
    if (provided < MPI_THREAD_FUNNELED) {
      MPI_Finalize();
      throw backend_error("MPI_Init_thread", MPI_ERR_OTHER,
                          fmt::format("this MPI provides thread level {}, seqpar needs "
                                      "MPI_THREAD_FUNNELED ({}): use an MPI built with threads",
                                      provided, MPI_THREAD_FUNNELED),
                          -1, processor_name());
    }
  }
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  host_ = processor_name();
}

mpi_session::~mpi_session() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (owns_ && !fin) MPI_Finalize();
}

void mpi_session::abort_world(const std::string& message, int code) {
  // backend_error messages already start with "rank R on HOST: ".
  const auto prefix = fmt::format("rank {} on {}: ", world_rank(), processor_name());
  const bool named = message.rfind(prefix, 0) == 0;
  std::fflush(stdout);
  fmt::print(stderr, "seqpar: error: {}{}\n", named ? "" : prefix, message);
  std::fflush(stderr);
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// ---- communicator ----

namespace {

MPI_Datatype mpi_type(dtype t) {
  switch (t) {
    case dtype::f64:
      return MPI_DOUBLE;
    case dtype::f32:
      return MPI_FLOAT;
    case dtype::bf16:
      return MPI_UINT16_T;  // moved as 16-bit words, never reduced
    case dtype::i32:
      return MPI_INT32_T;
    case dtype::i64:
      return MPI_INT64_T;
  }
  return MPI_BYTE;
}

// Call descriptors exchanged by verify_calls, one per member.
enum op_code : std::int64_t {
  op_all_to_all = 1,
  op_all_gather,
  op_reduce_scatter,
  op_all_reduce,
  op_send_recv,
  op_barrier
};

const char* op_name(std::int64_t op) {
  switch (op) {
    case op_all_to_all:
      return "all_to_all";
    case op_all_gather:
      return "all_gather";
    case op_reduce_scatter:
      return "reduce_scatter";
    case op_all_reduce:
      return "all_reduce";
    case op_send_recv:
      return "send_recv";
    case op_barrier:
      return "barrier";
  }
  return "?";
}

const char* dtype_label(std::int64_t t) {
  return std::string_view(dtype_name(static_cast<dtype>(t))).data();
}

/// Fixed-size part: op, dtype, count (or number of p2p ops), then n send and n recv counts
/// (all_to_all only; zero otherwise).
struct descriptor {
  std::int64_t op = 0, type = 0, count = 0;
  std::vector<std::int64_t> send_counts, recv_counts;
};

using comm_checks::add;
using comm_checks::overlaps;

void check_reducible(dtype t, const char* op, const comm_group& g) {
  comm_checks::check_reducible(t, op, g, "the MPI communicator");
}

// out[k] = blocks[0][k] + blocks[1][k] + … in member order, left to right: the same order as
// inproc_communicator, hence the same bits.
template <class T>
void sum_blocks(const std::byte* blocks, int members, std::int64_t count, std::byte* out_bytes) {
  auto* out = reinterpret_cast<T*>(out_bytes);
  const auto* in = reinterpret_cast<const T*>(blocks);
  std::copy(in, in + count, out);
  for (int j = 1; j < members; ++j) {
    const T* b = in + static_cast<std::size_t>(j) * count;
    for (std::int64_t k = 0; k < count; ++k) out[k] = add(out[k], b[k]);
  }
}

void sum_in_group_order(dtype t, const std::byte* blocks, int members, std::int64_t count,
                        std::byte* out) {
  switch (t) {
    case dtype::f64:
      return sum_blocks<double>(blocks, members, count, out);
    case dtype::f32:
      return sum_blocks<float>(blocks, members, count, out);
    case dtype::i32:
      return sum_blocks<std::int32_t>(blocks, members, count, out);
    case dtype::i64:
      return sum_blocks<std::int64_t>(blocks, members, count, out);
    case dtype::bf16:
      break;  // rejected before any data moves
  }
}

void copy_bytes(std::byte* dst, const std::byte* src, std::size_t n) {
  if (n != 0 && dst != src) std::memmove(dst, src, n);
}

}  // namespace

struct mpi_communicator::impl {
  struct group_entry {
    std::vector<int> ranks;
    MPI_Comm comm = MPI_COMM_NULL;
    std::int64_t calls = 0;  ///< calls made on this group, for messages
  };

  mpi_options opt;
  MPI_Comm world = MPI_COMM_NULL;
  std::map<std::string, group_entry> groups;

  ~impl() {
    if (!mpi_active()) return;
    for (auto& [name, e] : groups)
      if (e.comm != MPI_COMM_NULL) MPI_Comm_free(&e.comm);
    if (world != MPI_COMM_NULL) MPI_Comm_free(&world);
  }
};

mpi_communicator::mpi_communicator(mpi_options opt) : impl_(std::make_unique<impl>()) {
  if (!mpi_active())
    fail<error>("mpi_communicator needs MPI to be initialised first (hold an mpi_session)");
  impl_->opt = opt;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->world), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(impl_->world, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(impl_->world, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(impl_->world, &size_), "MPI_Comm_size");
  host_ = processor_name();
}

mpi_communicator::~mpi_communicator() = default;

namespace {

std::string describe(const comm_group& g) { return fmt::format("'{}' {}", g.name, g.ranks); }

std::string call_name(const char* op, std::int64_t seq, const std::string& tag) {
  return tag.empty() ? fmt::format("{} #{}", op, seq) : fmt::format("{} #{} ({})", op, seq, tag);
}

struct call_context {
  MPI_Comm comm;
  int me;
  std::int64_t seq;
};

// The whole-call validation of verify_calls: every member holds every descriptor, so all reach
// the same verdict and throw the same error (nobody is left inside MPI). The messages follow
// inproc_communicator's.
void validate(const comm_group& g, std::int64_t seq, const std::string& tag,
              const std::vector<descriptor>& d, const std::vector<std::vector<std::int64_t>>& p2p) {
  const int n = g.size();
  const auto& d0 = d[0];
  const auto name0 = call_name(op_name(d0.op), seq, tag);
  for (int j = 1; j < n; ++j) {
    if (d[j].op != d0.op)
      fail<error>(
          "collective mismatch on group {} at call #{}: rank {} (member 0) called {} but rank {} "
          "(member {}) called {}; every member must make the same calls on a group in the same "
          "order",
          describe(g), seq, g.ranks[0], op_name(d0.op), g.ranks[j], j, op_name(d[j].op));
    if (d[j].type != d0.type)
      fail<error>("dtype mismatch in {} on group {}: rank {} passes {} but rank {} passes {}",
                  name0, describe(g), g.ranks[0], dtype_label(d0.type), g.ranks[j],
                  dtype_label(d[j].type));
  }
  if (d0.op == op_all_gather || d0.op == op_reduce_scatter || d0.op == op_all_reduce) {
    for (int j = 1; j < n; ++j)
      if (d[j].count != d0.count)
        fail<shape_error>(
            "count mismatch in {} on group {}: rank {} (member 0) passes count {} but rank {} "
            "(member {}) passes {}",
            name0, describe(g), g.ranks[0], d0.count, g.ranks[j], j, d[j].count);
  } else if (d0.op == op_all_to_all) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const auto sent = d[i].send_counts[j], expected = d[j].recv_counts[i];
        if (sent != expected)
          fail<shape_error>(
              "all_to_all split mismatch in {} on group {}: rank {} (member {}) sends {} "
              "elements to rank {} (member {}) but rank {} expects {} from rank {}; "
              "send_counts[{}] on rank {} must equal recv_counts[{}] on rank {}",
              name0, describe(g), g.ranks[i], i, sent, g.ranks[j], j, g.ranks[j], expected,
              g.ranks[i], j, g.ranks[i], i, g.ranks[j]);
      }
  } else if (d0.op == op_send_recv) {
    // p2p[m] = (dir, peer, count) triples of member m, in posting order; dir 0 send, 1 recv.
    for (int src = 0; src < n; ++src)
      for (int dst = 0; dst < n; ++dst) {
        std::vector<std::int64_t> sends, recvs;
        for (std::size_t k = 0; k < p2p[src].size(); k += 3)
          if (p2p[src][k] == 0 && p2p[src][k + 1] == dst) sends.push_back(p2p[src][k + 2]);
        for (std::size_t k = 0; k < p2p[dst].size(); k += 3)
          if (p2p[dst][k] == 1 && p2p[dst][k + 1] == src) recvs.push_back(p2p[dst][k + 2]);
        const auto common = std::min(sends.size(), recvs.size());
        for (std::size_t k = 0; k < common; ++k)
          if (sends[k] != recvs[k])
            fail<shape_error>(
                "count mismatch in {} on group {}: send #{} from rank {} to rank {} carries {} "
                "elements but the matching recv posted by rank {} expects {}",
                name0, describe(g), k, g.ranks[src], g.ranks[dst], sends[k], g.ranks[dst],
                recvs[k]);
        if (sends.size() > common)
          fail<error>(
              "unmatched send in {} on group {}: rank {} posts {} send(s) to rank {} but rank {} "
              "posts {} recv(s) from rank {}; send #{} ({} elements) has no matching recv",
              name0, describe(g), g.ranks[src], sends.size(), g.ranks[dst], g.ranks[dst],
              recvs.size(), g.ranks[src], common, sends[common]);
        if (recvs.size() > common)
          fail<error>(
              "unmatched recv in {} on group {}: rank {} posts {} recv(s) from rank {} but rank "
              "{} posts {} send(s) to rank {}; recv #{} ({} elements) has no matching send",
              name0, describe(g), g.ranks[dst], recvs.size(), g.ranks[src], g.ranks[src],
              sends.size(), g.ranks[dst], common, recvs[common]);
      }
  }
}

}  // namespace

// Calls an MPI function and turns a non-success code into backend_error naming it.
#define SEQPAR_MPI(fn, ...) check_mpi(fn(__VA_ARGS__), #fn)

namespace {

// Resolves the group (creating its MPI communicator on first use) and, with verify_calls,
// exchanges and validates the call descriptors.
call_context enter(mpi_communicator::impl& im, const comm_group& g, int rank, int world_size,
                   const std::string& tag, const descriptor& mine, std::span<const p2p_op> ops) {
  auto it = im.groups.find(g.name);
  if (it == im.groups.end()) {
    auto sorted = g.ranks;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      fail<error>("group '{}' lists a rank twice: {}", g.name, g.ranks);
    for (int r : g.ranks)
      if (r < 0 || r >= world_size)
        fail<error>("group '{}' {} names rank {} outside a world of {}", g.name, g.ranks, r,
                    world_size);
    MPI_Group world_group = MPI_GROUP_NULL, sub = MPI_GROUP_NULL;
    SEQPAR_MPI(MPI_Comm_group, im.world, &world_group);
    const int rc_incl = MPI_Group_incl(world_group, g.size(), g.ranks.data(), &sub);
    MPI_Group_free(&world_group);
    check_mpi(rc_incl, "MPI_Group_incl");
    // Only the members call MPI_Comm_create_group; the tag keeps concurrent creations of
    // different groups by overlapping members apart (a hash of the name and ranks).
    std::size_t h = std::hash<std::string>{}(fmt::format("{}|{}", g.name, g.ranks));
    const int tag_id = static_cast<int>(h % 32000);
    MPI_Comm c = MPI_COMM_NULL;
    const int rc = MPI_Comm_create_group(im.world, sub, tag_id, &c);
    MPI_Group_free(&sub);
    check_mpi(rc, "MPI_Comm_create_group");
    SEQPAR_MPI(MPI_Comm_set_errhandler, c, MPI_ERRORS_RETURN);
    auto& e = im.groups[g.name];
    e.ranks = g.ranks;
    e.comm = c;
    it = im.groups.find(g.name);
  } else if (it->second.ranks != g.ranks) {
    fail<error>(
        "group '{}' was first used with ranks {} but rank {} now uses it with ranks {}; a group "
        "name must always denote the same ordered ranks",
        g.name, it->second.ranks, rank, g.ranks);
  }
  auto& e = it->second;
  call_context ctx{e.comm, g.index_of(rank), e.calls++};
  if (!im.opt.verify_calls) return ctx;

  const int n = g.size();
  const std::size_t width = 3 + 2 * static_cast<std::size_t>(n);
  std::vector<std::int64_t> out(width, 0), all(width * n, 0);
  out[0] = mine.op;
  out[1] = mine.type;
  out[2] = mine.count;
  for (std::size_t j = 0; j < mine.send_counts.size(); ++j) out[3 + j] = mine.send_counts[j];
  for (std::size_t j = 0; j < mine.recv_counts.size(); ++j) out[3 + n + j] = mine.recv_counts[j];
  SEQPAR_MPI(MPI_Allgather_c, out.data(), static_cast<MPI_Count>(width), MPI_INT64_T, all.data(),
             static_cast<MPI_Count>(width), MPI_INT64_T, ctx.comm);
  std::vector<descriptor> d(n);
  for (int j = 0; j < n; ++j) {
    const auto* row = all.data() + j * width;
    d[j].op = row[0];
    d[j].type = row[1];
    d[j].count = row[2];
    d[j].send_counts.assign(row + 3, row + 3 + n);
    d[j].recv_counts.assign(row + 3 + n, row + 3 + 2 * n);
  }
  std::vector<std::vector<std::int64_t>> p2p(n);
  const bool all_p2p =
      std::all_of(d.begin(), d.end(), [](const descriptor& x) { return x.op == op_send_recv; });
  if (all_p2p) {
    // Second round: every member's (dir, peer, count) list, so all can pair the messages.
    std::vector<std::int64_t> mine_ops;
    for (const auto& o : ops) {
      mine_ops.push_back(o.dir == p2p_op::kind::send ? 0 : 1);
      mine_ops.push_back(o.peer);
      mine_ops.push_back(o.count);
    }
    std::vector<MPI_Count> counts(n);
    std::vector<MPI_Aint> displs(n);
    MPI_Aint total = 0;
    for (int j = 0; j < n; ++j) {
      counts[j] = 3 * d[j].count;
      displs[j] = total;
      total += counts[j];
    }
    std::vector<std::int64_t> flat(static_cast<std::size_t>(std::max<MPI_Aint>(total, 1)));
    SEQPAR_MPI(MPI_Allgatherv_c, mine_ops.data(), static_cast<MPI_Count>(mine_ops.size()),
               MPI_INT64_T, flat.data(), counts.data(), displs.data(), MPI_INT64_T, ctx.comm);
    for (int j = 0; j < n; ++j)
      p2p[j].assign(flat.begin() + displs[j], flat.begin() + displs[j] + counts[j]);
  }
  validate(g, ctx.seq, tag, d, p2p);
  return ctx;
}

}  // namespace

void mpi_communicator::do_all_to_all(const comm_group& g, const void* send,
                                     std::span<const std::int64_t> send_counts, void* recv,
                                     std::span<const std::int64_t> recv_counts, dtype t) {
  const auto esz = dtype_size(t);
  const std::int64_t total_send = comm_checks::total(send_counts);
  const std::int64_t total_recv = comm_checks::total(recv_counts);
  descriptor mine{op_all_to_all,
                  static_cast<std::int64_t>(t),
                  0,
                  {send_counts.begin(), send_counts.end()},
                  {recv_counts.begin(), recv_counts.end()}};
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag, mine, {});
  const int n = g.size();
  std::vector<MPI_Count> sc(n), rc(n);
  std::vector<MPI_Aint> sd(n), rd(n);
  MPI_Aint so = 0, ro = 0;
  for (int j = 0; j < n; ++j) {
    sc[j] = send_counts[j];
    rc[j] = recv_counts[j];
    sd[j] = so;
    rd[j] = ro;
    so += sc[j];
    ro += rc[j];
  }
  // MPI forbids overlapping send and recv buffers: send from a copy then.
  std::vector<std::byte> copy;
  const void* src = send;
  if (overlaps(send, total_send * esz, recv, total_recv * esz)) {
    copy.assign(static_cast<const std::byte*>(send),
                static_cast<const std::byte*>(send) + total_send * esz);
    src = copy.data();
  }
  const auto type = mpi_type(t);
  SEQPAR_MPI(MPI_Alltoallv_c, src, sc.data(), sd.data(), type, recv, rc.data(), rd.data(), type,
             ctx.comm);
}

void mpi_communicator::do_all_gather(const comm_group& g, const void* send, std::int64_t count,
                                     void* recv, dtype t) {
  const auto ctx =
      enter(*impl_, g, rank_, size_, call_info().tag,
            descriptor{op_all_gather, static_cast<std::int64_t>(t), count, {}, {}}, {});
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<std::byte> copy;
  const void* src = send;
  if (overlaps(send, block, recv, block * g.size())) {
    copy.assign(static_cast<const std::byte*>(send), static_cast<const std::byte*>(send) + block);
    src = copy.data();
  }
  const auto type = mpi_type(t);
  SEQPAR_MPI(MPI_Allgather_c, src, count, type, recv, count, type, ctx.comm);
}

void mpi_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                         std::int64_t count, dtype t) {
  check_reducible(t, "reduce_scatter", g);
  const auto ctx =
      enter(*impl_, g, rank_, size_, call_info().tag,
            descriptor{op_reduce_scatter, static_cast<std::int64_t>(t), count, {}, {}}, {});
  // Deterministic: member i receives block i of every member (Alltoall), then sums them in
  // member order. MPI_Reduce_scatter_block would be free to add them in any order.
  const int n = g.size();
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<std::byte> blocks(block * n);
  const auto type = mpi_type(t);
  SEQPAR_MPI(MPI_Alltoall_c, send, count, type, blocks.data(), count, type, ctx.comm);
  sum_in_group_order(t, blocks.data(), n, count, static_cast<std::byte*>(recv));
}

void mpi_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) {
  check_reducible(t, "all_reduce", g);
  const auto ctx =
      enter(*impl_, g, rank_, size_, call_info().tag,
            descriptor{op_all_reduce, static_cast<std::int64_t>(t), count, {}, {}}, {});
  // Deterministic: every member gathers every contribution (Allgather), then sums them in
  // member order. MPI_Allreduce would be free to add them in any order.
  const int n = g.size();
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<std::byte> blocks(block * n);
  const auto type = mpi_type(t);
  SEQPAR_MPI(MPI_Allgather_c, buf, count, type, blocks.data(), count, type, ctx.comm);
  sum_in_group_order(t, blocks.data(), n, count, static_cast<std::byte*>(buf));
}

void mpi_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  const auto esz = dtype_size(t);
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag,
                         descriptor{op_send_recv,
                                    static_cast<std::int64_t>(t),
                                    static_cast<std::int64_t>(ops.size()),
                                    {},
                                    {}},
                         ops);
  // Receive into a staging area when a recv buffer overlaps a buffer this rank sends from.
  std::vector<std::byte> stage(comm_checks::recv_stage_bytes(ops, esz));
  const bool staged = !stage.empty();
  const auto type = mpi_type(t);
  // Messages between a pair are matched in posting order: same communicator, same tag, and MPI
  // does not let messages of one (source, tag, comm) overtake each other.
  std::vector<MPI_Request> reqs;
  reqs.reserve(ops.size());
  std::vector<std::int64_t> expect;  // per request: elements expected (recv) or -1 (send)
  std::size_t off = 0;
  for (const auto& o : ops) {
    MPI_Request rq = MPI_REQUEST_NULL;
    if (o.dir == p2p_op::kind::recv) {
      void* dst = staged ? static_cast<void*>(stage.data() + off) : o.buf;
      off += o.count * esz;
      SEQPAR_MPI(MPI_Irecv_c, dst, o.count, type, o.peer, 0, ctx.comm, &rq);
      expect.push_back(o.count);
    } else {
      SEQPAR_MPI(MPI_Isend_c, o.buf, o.count, type, o.peer, 0, ctx.comm, &rq);
      expect.push_back(-1);
    }
    reqs.push_back(rq);
  }
  std::vector<MPI_Status> st(reqs.size());
  const int rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), st.data());
  if (rc == MPI_ERR_IN_STATUS) {
    for (std::size_t k = 0; k < st.size(); ++k)
      if (st[k].MPI_ERROR != MPI_SUCCESS && st[k].MPI_ERROR != MPI_ERR_PENDING)
        check_mpi(st[k].MPI_ERROR, expect[k] < 0 ? "MPI_Isend_c" : "MPI_Irecv_c");
  }
  check_mpi(rc, "MPI_Waitall");
  // Without verify_calls a shorter message than expected arrives silently: report it.
  for (std::size_t k = 0; k < st.size(); ++k) {
    if (expect[k] < 0) continue;
    MPI_Count got = 0;
    SEQPAR_MPI(MPI_Get_count_c, &st[k], type, &got);
    if (got != expect[k])
      fail<shape_error>(
          "count mismatch in send_recv on group {}: rank {} expected {} elements from rank {} "
          "but received {}",
          describe(g), rank_, expect[k], g.ranks[st[k].MPI_SOURCE], got);
  }
  if (!staged) return;
  off = 0;
  for (const auto& r : ops) {
    if (r.dir != p2p_op::kind::recv) continue;
    copy_bytes(static_cast<std::byte*>(r.buf), stage.data() + off, r.count * esz);
    off += r.count * esz;
  }
}

void mpi_communicator::do_barrier(const comm_group& g) {
  const auto ctx =
      enter(*impl_, g, rank_, size_, call_info().tag, descriptor{op_barrier, 0, 0, {}, {}}, {});
  SEQPAR_MPI(MPI_Barrier, ctx.comm);
}

}  // namespace seqpar::mpi
