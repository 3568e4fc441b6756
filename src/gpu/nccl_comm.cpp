#include "gpu/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <cstring>
#include <map>
#include <thread>

#if defined(SEQPAR_HAVE_MPI)
#include <mpi.h>
#endif

#include "core/comm_checks.hpp"
#include "core/thread_world.hpp"  // watchdog_deadline
#include "gpu/cuda_check.hpp"

namespace seqpar::gpu {

static_assert(sizeof(ncclUniqueId) == sizeof(nccl_id), "ncclUniqueId is 128 bytes");

namespace {

ncclDataType_t nccl_type(dtype t) {
  switch (t) {
    case dtype::f64:
      return ncclFloat64;
    case dtype::f32:
      return ncclFloat32;
    case dtype::bf16:
      return ncclBfloat16;
    case dtype::i32:
      return ncclInt32;
    case dtype::i64:
      return ncclInt64;
  }
  return ncclFloat32;
}

}  // namespace

nccl_id nccl_make_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) raise("ncclGetUniqueId", static_cast<int>(r), ncclGetErrorString(r), -1);
  nccl_id out;
  std::memcpy(out.bytes, &id, sizeof id);
  return out;
}

struct nccl_communicator::impl {
  ncclComm_t world = nullptr;
  struct sub {
    ncclComm_t comm = nullptr;  ///< null for groups of one, or for non-members
    bool owned = false;
    std::vector<int> ranks;
  };
  std::map<std::string, sub> groups;
  cudaStream_t compute = nullptr;  ///< the caller's compute stream (work before each call)
  cudaStream_t stream = nullptr;   ///< NCCL's stream
  cudaEvent_t ready = nullptr;
  void* one = nullptr;  ///< a float on the device for barrier()
  std::chrono::milliseconds timeout{60000};
  bool failed = false;
  std::string failure;
  /// A nonblocking all_to_all issued on `stream` and not yet waited.
  struct pending_op {
    cudaEvent_t done = nullptr;  ///< recorded on `stream` right after the call
    comm_group group;            ///< by value: the caller's may be gone by the wait
    std::string what;            ///< "all_to_all on 'g' (tag)", for the watchdog's messages
    std::int64_t bytes = 0;      ///< scales the deadline
  };
  std::map<std::int64_t, pending_op> pending;  ///< by token (do_start_all_to_all's)
  std::int64_t next_token = 0;
};

namespace {

/// Aborts every communicator (no rank stays blocked in NCCL) and raises.
[[noreturn]] void abort_all(nccl_communicator::impl& im, const char* call, int code,
                            const std::string& msg, int rank_) {
  if (!im.failed) {
    im.failed = true;
    im.failure = fmt::format("{}: {}", call, msg);
    for (auto& [name, s] : im.groups)
      if (s.owned && s.comm) ncclCommAbort(s.comm);
    if (im.world) ncclCommAbort(im.world);
    im.world = nullptr;
    for (auto& [name, s] : im.groups) s.comm = nullptr;
  }
  raise(call, code, msg, rank_);
}

void check_nccl(nccl_communicator::impl& im, ncclResult_t r, const char* call, ncclComm_t comm,
                int rank_) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  std::string msg = ncclGetErrorString(r);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += fmt::format(" ({})", last);
  }
  abort_all(im, call, static_cast<int>(r), msg, rank_);
}

}  // namespace

/// SEQPAR_NCCL_ON(im, comm, ncclSend, …): calls fn(args…) and on failure aborts every
/// communicator of `im` and raises; needs a `rank_` in scope.
#define SEQPAR_NCCL_ON(im, comm, fn, ...) check_nccl((im), fn(__VA_ARGS__), #fn, (comm), rank_)
#define SEQPAR_NCCL(comm, fn, ...) SEQPAR_NCCL_ON(*impl_, comm, fn, __VA_ARGS__)

nccl_communicator::nccl_communicator(const nccl_id& id, int rank, int world_size, int device,
                                     void* stream, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<impl>()), rank_(rank), world_(world_size), device_(device) {
  SEQPAR_CUDA(cudaSetDevice, device);
  impl_->compute = static_cast<cudaStream_t>(stream);
  impl_->timeout = timeout;
  SEQPAR_CUDA(cudaStreamCreateWithFlags, &impl_->stream, cudaStreamNonBlocking);
  SEQPAR_CUDA(cudaEventCreateWithFlags, &impl_->ready, cudaEventDisableTiming);
  SEQPAR_CUDA(cudaMalloc, &impl_->one, sizeof(float));
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes, sizeof uid);
  SEQPAR_NCCL(nullptr, ncclCommInitRank, &impl_->world, world_size, uid, rank);
}

nccl_communicator::~nccl_communicator() {
  cudaSetDevice(device_);
  if (!impl_->failed) {
    for (auto& [name, s] : impl_->groups)
      if (s.owned && s.comm) ncclCommDestroy(s.comm);
    if (impl_->world) ncclCommDestroy(impl_->world);
  }
  for (auto& [token, p] : impl_->pending) cudaEventDestroy(p.done);
  if (impl_->one) cudaFree(impl_->one);
  if (impl_->ready) cudaEventDestroy(impl_->ready);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

void nccl_communicator::prepare_groups(std::span<const comm_group> groups) {
  SEQPAR_CUDA(cudaSetDevice, device_);
  int color = 0;
  for (const auto& g : groups) {
    if (impl_->groups.count(g.name)) {
      if (impl_->groups[g.name].ranks != g.ranks)
        fail<config_error>("prepare_groups: group '{}' listed twice with ranks {} and {}", g.name,
                           impl_->groups[g.name].ranks, g.ranks);
      continue;
    }
    impl::sub s;
    s.ranks = g.ranks;
    const int me = g.index_of(rank_);
    bool is_world = g.size() == world_;
    for (int i = 0; is_world && i < g.size(); ++i)
      is_world = g.ranks[static_cast<std::size_t>(i)] == i;
    if (is_world) {
      s.comm = impl_->world;
    } else if (g.size() > 1) {
      // World-collective: non-members take part with NCCL_SPLIT_NOCOLOR and get no comm.
      ncclComm_t sub = nullptr;
      SEQPAR_NCCL(impl_->world, ncclCommSplit, impl_->world, me >= 0 ? color : NCCL_SPLIT_NOCOLOR,
                  me >= 0 ? me : 0, &sub, nullptr);
      s.comm = sub;
      s.owned = sub != nullptr;
      ++color;
    }
    impl_->groups.emplace(g.name, std::move(s));
  }
}

namespace {

struct call_ctx {
  nccl_communicator::impl& im;
  ncclComm_t comm;  ///< null: a group of one (local copies)
  int rank_;
};

/// The group's communicator; fails if the group was not prepared or this rank is no member.
ncclComm_t comm_of(nccl_communicator::impl& im, const comm_group& g, int rank_) {
  if (im.failed)
    fail<error>("rank {}: the NCCL communicator was aborted after an earlier failure ({})", rank_,
                im.failure);
  auto it = im.groups.find(g.name);
  if (it == im.groups.end())
    fail<config_error>(
        "group '{}' {} was not prepared: call nccl_communicator::prepare_groups "
        "with every group on every rank first",
        g.name, g.ranks);
  if (it->second.ranks != g.ranks)
    fail<config_error>("group '{}' was prepared with ranks {} but is used with {}", g.name,
                       it->second.ranks, g.ranks);
  return it->second.comm;
}

/// The compute stream's work (the send data) precedes the NCCL call.
void after_compute(nccl_communicator::impl& im, int rank_) {
  SEQPAR_CUDA(cudaEventRecord, im.ready, im.compute);
  SEQPAR_CUDA(cudaStreamWaitEvent, im.stream, im.ready, 0);
}

/// Waits for the NCCL stream (or, given `until`, for that event recorded on it), polling the
/// communicator's async error; on error or timeout aborts every communicator of this rank and
/// raises.
void wait_done(nccl_communicator::impl& im, ncclComm_t comm, const std::string& what, int rank_,
               std::int64_t bytes, cudaEvent_t until = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto limit = watchdog_deadline(im.timeout, bytes);
  for (int spins = 0;; ++spins) {
    const cudaError_t q = until ? cudaEventQuery(until) : cudaStreamQuery(im.stream);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady)
      abort_all(im, until ? "cudaEventQuery" : "cudaStreamQuery", static_cast<int>(q),
                fmt::format("{} ({})", cudaGetErrorString(q), what), rank_);
    if (comm) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        abort_all(im, "ncclCommGetAsyncError", static_cast<int>(async),
                  fmt::format("{} during {}", ncclGetErrorString(async), what), rank_);
    }
    if (std::chrono::steady_clock::now() - t0 > limit)
      abort_all(im, "timeout", -1,
                fmt::format("watchdog: {} did not complete within {} ms (a peer stopped, died or "
                            "never called it; raise --timeout if it is merely slow); "
                            "communicators aborted",
                            what, limit.count()),
                rank_);
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void copy_local(nccl_communicator::impl& im, void* dst, const void* src, std::int64_t count,
                dtype t, int rank_) {
  if (count > 0 && dst != src)
    SEQPAR_CUDA(cudaMemcpyAsync, dst, src, static_cast<std::size_t>(count) * dtype_size(t),
                cudaMemcpyDeviceToDevice, im.stream);
}

std::string what_of(const char* op, const comm_group& g, const op_info& info) {
  return info.tag.empty() ? fmt::format("{} on '{}'", op, g.name)
                          : fmt::format("{} on '{}' ({})", op, g.name, info.tag);
}

/// The frame of every call on group g: the device, the communication stream ordered after the
/// compute stream's work, `issue(comm)` with the group's communicator, then the wait with its
/// deadline (the message names the op, the group and the call's tag).
template <class Issue>
void on_stream(nccl_communicator::impl& im, int device, int rank_, const comm_group& g,
               const char* op, const op_info& info, std::int64_t bytes, const Issue& issue) {
  ncclComm_t comm = comm_of(im, g, rank_);
  SEQPAR_CUDA(cudaSetDevice, device);
  after_compute(im, rank_);
  issue(comm);
  wait_done(im, comm, what_of(op, g, info), rank_, bytes);
}

std::int64_t total_of(std::span<const std::int64_t> counts) {
  std::int64_t n = 0;
  for (auto c : counts) n += c;
  return n;
}

/// Enqueues an all_to_all on the communication stream (blocking and nonblocking calls alike):
/// a local copy for a group of one, ncclAlltoAll for equal splits, else one group of per-peer
/// sends and receives.
void issue_all_to_all(nccl_communicator::impl& im, ncclComm_t comm, const comm_group& g,
                      const void* send, std::span<const std::int64_t> send_counts, void* recv,
                      std::span<const std::int64_t> recv_counts, dtype t, int rank_) {
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  if (g.size() == 1) {
    copy_local(im, recv, send, recv_counts[0], t, rank_);
    return;
  }
  bool uniform = true;
  for (std::size_t j = 0; j < send_counts.size(); ++j)
    uniform = uniform && send_counts[j] == send_counts[0] && recv_counts[j] == send_counts[0];
  if (uniform) {
    SEQPAR_NCCL_ON(im, comm, ncclAlltoAll, send, recv, static_cast<std::size_t>(send_counts[0]),
                   nccl_type(t), comm, im.stream);
    return;
  }
  // Per-peer counts: one group of sends and receives (NCCL matches them per peer pair).
  SEQPAR_NCCL_ON(im, comm, ncclGroupStart);
  std::int64_t so = 0, ro = 0;
  for (int j = 0; j < g.size(); ++j) {
    const auto sc = send_counts[static_cast<std::size_t>(j)];
    const auto rc = recv_counts[static_cast<std::size_t>(j)];
    if (sc > 0)
      SEQPAR_NCCL_ON(im, comm, ncclSend, static_cast<const std::byte*>(send) + so * esz,
                     static_cast<std::size_t>(sc), nccl_type(t), j, comm, im.stream);
    if (rc > 0)
      SEQPAR_NCCL_ON(im, comm, ncclRecv, static_cast<std::byte*>(recv) + ro * esz,
                     static_cast<std::size_t>(rc), nccl_type(t), j, comm, im.stream);
    so += sc;
    ro += rc;
  }
  SEQPAR_NCCL_ON(im, comm, ncclGroupEnd);
}

}  // namespace

void nccl_communicator::do_all_to_all(const comm_group& g, const void* send,
                                      std::span<const std::int64_t> send_counts, void* recv,
                                      std::span<const std::int64_t> recv_counts, dtype t) {
  const auto bytes =
      (total_of(send_counts) + total_of(recv_counts)) * static_cast<std::int64_t>(dtype_size(t));
  on_stream(*impl_, device_, rank_, g, "all_to_all", call_info(), bytes, [&](ncclComm_t comm) {
    issue_all_to_all(*impl_, comm, g, send, send_counts, recv, recv_counts, t, rank_);
  });
}

std::int64_t nccl_communicator::do_start_all_to_all(const comm_group& g, const void* send,
                                                    std::span<const std::int64_t> send_counts,
                                                    void* recv,
                                                    std::span<const std::int64_t> recv_counts,
                                                    dtype t) {
  auto& im = *impl_;
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  const auto total_send = total_of(send_counts), total_recv = total_of(recv_counts);
  ncclComm_t comm = comm_of(im, g, rank_);
  SEQPAR_CUDA(cudaSetDevice, device_);
  cudaEvent_t done = nullptr;
  SEQPAR_CUDA(cudaEventCreateWithFlags, &done, cudaEventDisableTiming);
  try {
    // The compute stream's work so far (the send data) precedes the call on the
    // communication stream; the compute stream itself does not wait.
    after_compute(im, rank_);
    issue_all_to_all(im, comm, g, send, send_counts, recv, recv_counts, t, rank_);
    SEQPAR_CUDA(cudaEventRecord, done, im.stream);
  } catch (...) {
    cudaEventDestroy(done);
    throw;
  }
  const auto token = im.next_token++;
  im.pending.emplace(token, impl::pending_op{done, g, what_of("all_to_all", g, call_info()),
                                             (total_send + total_recv) * esz});
  return token;
}

void nccl_communicator::do_wait(std::int64_t token) {
  auto& im = *impl_;
  auto node = im.pending.extract(token);
  if (node.empty())
    fail<error>("rank {}: the NCCL communicator has no nonblocking call {}", rank_, token);
  const auto& p = node.mapped();
  // Released when the wait returns or throws (CUDA frees an event still pending on completion).
  struct event_guard {
    cudaEvent_t e;
    ~event_guard() { cudaEventDestroy(e); }
  } guard{p.done};
  if (im.failed)
    fail<error>(
        "rank {}: nonblocking {} cannot complete: the NCCL communicator was aborted after an "
        "earlier failure ({})",
        rank_, p.what, im.failure);
  ncclComm_t comm = comm_of(im, p.group, rank_);
  SEQPAR_CUDA(cudaSetDevice, device_);
  // The compute stream's later work reads the received data: it waits for the call on the
  // device, and the host waits too, under the blocking calls' watchdog (async errors, deadline
  // from now), so a dead peer aborts instead of hanging.
  SEQPAR_CUDA(cudaStreamWaitEvent, im.compute, p.done, 0);
  wait_done(im, comm, "nonblocking " + p.what, rank_, p.bytes, p.done);
}

void nccl_communicator::do_all_gather(const comm_group& g, const void* send, std::int64_t count,
                                      void* recv, dtype t) {
  const auto bytes = count * (1 + g.size()) * static_cast<std::int64_t>(dtype_size(t));
  on_stream(*impl_, device_, rank_, g, "all_gather", call_info(), bytes, [&](ncclComm_t comm) {
    if (g.size() == 1)
      copy_local(*impl_, recv, send, count, t, rank_);
    else
      SEQPAR_NCCL(comm, ncclAllGather, send, recv, static_cast<std::size_t>(count), nccl_type(t),
                  comm, impl_->stream);
  });
}

void nccl_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                          std::int64_t count, dtype t) {
  const auto bytes = count * (1 + g.size()) * static_cast<std::int64_t>(dtype_size(t));
  on_stream(*impl_, device_, rank_, g, "reduce_scatter", call_info(), bytes, [&](ncclComm_t comm) {
    if (g.size() == 1)
      copy_local(*impl_, recv, send, count, t, rank_);
    else
      SEQPAR_NCCL(comm, ncclReduceScatter, send, recv, static_cast<std::size_t>(count),
                  nccl_type(t), ncclSum, comm, impl_->stream);
  });
}

void nccl_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) {
  const auto bytes = 2 * count * static_cast<std::int64_t>(dtype_size(t));
  on_stream(*impl_, device_, rank_, g, "all_reduce", call_info(), bytes, [&](ncclComm_t comm) {
    if (g.size() > 1)
      SEQPAR_NCCL(comm, ncclAllReduce, buf, buf, static_cast<std::size_t>(count), nccl_type(t),
                  ncclSum, comm, impl_->stream);
  });
}

void nccl_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  std::int64_t elements = 0;
  for (const auto& op : ops) elements += op.count;
  const auto bytes = elements * static_cast<std::int64_t>(dtype_size(t));
  on_stream(*impl_, device_, rank_, g, "send_recv", call_info(), bytes, [&](ncclComm_t comm) {
    if (g.size() == 1) {
      // A ring of one: the k-th recv takes the k-th send.
      std::vector<const p2p_op*> sends;
      for (const auto& op : ops)
        if (op.dir == p2p_op::kind::send) sends.push_back(&op);
      std::size_t k = 0;
      for (const auto& op : ops) {
        if (op.dir != p2p_op::kind::recv) continue;
        if (k >= sends.size() || sends[k]->count != op.count)
          fail<error>(
              "send_recv on '{}': rank {} receives {} elements from itself without a matching send",
              g.name, rank_, op.count);
        copy_local(*impl_, op.buf, sends[k++]->buf, op.count, t, rank_);
      }
    } else if (!ops.empty()) {
      SEQPAR_NCCL(comm, ncclGroupStart);
      for (const auto& op : ops) {
        if (op.count <= 0) continue;
        if (op.dir == p2p_op::kind::send)
          SEQPAR_NCCL(comm, ncclSend, op.buf, static_cast<std::size_t>(op.count), nccl_type(t),
                      op.peer, comm, impl_->stream);
        else
          SEQPAR_NCCL(comm, ncclRecv, op.buf, static_cast<std::size_t>(op.count), nccl_type(t),
                      op.peer, comm, impl_->stream);
      }
      SEQPAR_NCCL(comm, ncclGroupEnd);
    }
  });
}

void nccl_communicator::do_barrier(const comm_group& g) {
  on_stream(*impl_, device_, rank_, g, "barrier", call_info(), 0, [&](ncclComm_t comm) {
    if (g.size() > 1)
      SEQPAR_NCCL(comm, ncclAllReduce, impl_->one, impl_->one, 1, ncclFloat32, ncclSum, comm,
                  impl_->stream);
  });
}

#if defined(SEQPAR_HAVE_MPI)
int nccl_communicator::mpi_local_device() {
  int rank_ = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
  int local_rank = 0;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_free(&local);
  int n = 0;
  SEQPAR_CUDA(cudaGetDeviceCount, &n);
  if (n <= 0) raise("cudaGetDeviceCount", 0, "no CUDA device", rank_);
  return local_rank % n;
}

std::unique_ptr<nccl_communicator> nccl_communicator::from_mpi(int device, void* stream,
                                                               std::chrono::milliseconds timeout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  nccl_id id{};
  if (rank == 0) id = nccl_make_id();
  MPI_Bcast(id.bytes, sizeof id.bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
  return std::make_unique<nccl_communicator>(id, rank, size, device, stream, timeout);
}
#endif

}  // namespace seqpar::gpu
