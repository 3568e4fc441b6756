// fused_attention: cuDNN's fused flash attention through the cudnn-frontend graph API (see the
// header). cuDNN is dlopen'ed on first use; graphs are built once per shape class and device and
// reused by every rank of the process.
#include "gpu/fused_attention.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "gpu/cuda_check.hpp"
#include "gpu/fused_attention_plan.hpp"
#include "gpu/launch.hpp"

#ifdef SEQPAR_HAVE_CUDNN
#include <dlfcn.h>

#include <cudnn_frontend.h>

// The frontend's dynamic-loading mode reads cuDNN's entry points through this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
#endif

namespace seqpar::gpu {

namespace {

struct cudnn_library {
  int version = 0;
  std::string why;
};

const cudnn_library& load_cudnn() {
  static const cudnn_library lib = [] {
    cudnn_library l;
#ifdef SEQPAR_HAVE_CUDNN
    void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!h) h = dlopen("libcudnn.so", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      const char* e = dlerror();
      l.why = fmt::format(
          "cuDNN 9 is not loadable ({}); put the directory of libcudnn.so.9 on "
          "LD_LIBRARY_PATH (torch's wheels carry it under site-packages/nvidia/cudnn/lib)",
          e ? e : "dlopen failed");
      return l;
    }
    cudnn_frontend::cudnn_dlhandle = h;
    try {
      l.version = static_cast<int>(cudnn_frontend::detail::get_backend_version());
    } catch (const std::exception& e) {
      l.why = fmt::format("cuDNN loaded but its version could not be read: {}", e.what());
      l.version = 0;
    }
    if (l.version && l.version < 90000) {
      l.why = fmt::format("cuDNN {} is older than 9.0, which fused attention needs", l.version);
      l.version = 0;
    }
#else
    l.why =
        "this build has no cuDNN attention (the cudnn-frontend headers were not found at "
        "configure time; ./setup.sh fetches them)";
#endif
    return l;
  }();
  return lib;
}

}  // namespace

int cudnn_version(std::string* why) {
  const auto& l = load_cudnn();
  if (why) *why = l.why;
  return l.version;
}

std::string fused_attention_unsupported(const fused_attention_args& a) {
  std::string why;
  if (!cudnn_version(&why)) return why;
  if (a.d % 8 != 0 || a.d < 8 || a.d > 128)
    return fmt::format("head_dim {} (cuDNN's fused attention takes multiples of 8 up to 128)", a.d);
  if (a.hkv <= 0 || a.hq % a.hkv != 0)
    return fmt::format("hq {} is not a multiple of hkv {}", a.hq, a.hkv);
  const std::int64_t limit = std::int64_t{1} << 31;
  if (a.sq * a.hq * a.d >= limit || a.sk * a.hkv * a.d >= limit)
    return fmt::format("{} q or {} k rows of {}·{} elements pass int32 offsets", a.sq, a.sk, a.hq,
                       a.d);
  return {};
}

#ifdef SEQPAR_HAVE_CUDNN

namespace fe = cudnn_frontend;

namespace {

// Tensor uids of the graphs (variant-pack keys).
enum uid : std::int64_t {
  u_q = 1,
  u_k,
  u_v,
  u_o,
  u_stats,
  u_do,
  u_dq,
  u_dk,
  u_dv,
  u_seq_q,
  u_seq_k,
  u_ro_q,
  u_ro_k,
  u_ro_v,
  u_ro_o,
  u_ro_stats,
  u_ro_do,
  u_ro_dq,
  u_ro_dk,
  u_ro_dv
};

// Layout of the per-call int32 table on the device: seq_q[b], seq_k[b], q_offset[b+1],
// k_offset[b+1], stats_offset[b+1].
struct table_layout {
  std::int64_t seq_q, seq_k, ro_q, ro_k, ro_s, total;
  explicit table_layout(std::int64_t b)
      : seq_q(0), seq_k(b), ro_q(2 * b), ro_k(3 * b + 1), ro_s(4 * b + 2), total(5 * b + 3) {}
};

using graph_key = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, int, int, int,
                             bool, std::uint32_t, bool, std::int64_t, std::int64_t>;

/// The variant-pack entries the forward and backward graphs share: q, k, v, the lengths and the
/// ragged offsets of q-shaped (q, o), k-shaped (k, v) and LSE rows.
std::unordered_map<std::int64_t, void*> variant_pack(const fused_attention_args& a, std::int32_t* t,
                                                     const table_layout& L) {
  return {{u_q, const_cast<void*>(a.q)}, {u_k, const_cast<void*>(a.k)},
          {u_v, const_cast<void*>(a.v)}, {u_seq_q, t + L.seq_q},
          {u_seq_k, t + L.seq_k},        {u_ro_q, t + L.ro_q},
          {u_ro_k, t + L.ro_k},          {u_ro_v, t + L.ro_k},
          {u_ro_o, t + L.ro_q},          {u_ro_stats, t + L.ro_s}};
}

}  // namespace

/// The cuDNN handle and the graphs built so far, shared by every fused_attention of one device
/// in the process (the virtual ranks of a run build each graph once, not once per rank). The
/// mutex serialises graph builds and launches: a launch points the handle at the caller's
/// stream, then enqueues; each caller brings its own workspace and tables.
struct shared_graphs {
  std::mutex mu;
  cudnnHandle_t handle = nullptr;
  std::map<graph_key, std::shared_ptr<fe::graph::Graph>> graphs;
  int device = 0;
  ~shared_graphs() {
    graphs.clear();
    if (handle) {
      cudaSetDevice(device);
      fe::detail::destroy_handle(handle);
    }
  }
};

/// The device's shared graphs: made by the first fused_attention of the device, kept while any
/// of them lives.
std::shared_ptr<shared_graphs> graphs_of(int device, int rank_) {
  static std::mutex registry_mu;
  static std::map<int, std::weak_ptr<shared_graphs>> registry;
  std::lock_guard<std::mutex> lock(registry_mu);
  if (auto live = registry[device].lock()) return live;
  auto g = std::make_shared<shared_graphs>();
  g->device = device;
  SEQPAR_CUDA(cudaSetDevice, device);
  if (const auto st = fe::detail::create_handle(&g->handle); st != CUDNN_STATUS_SUCCESS)
    raise("cudnnCreate", static_cast<int>(st), fe::detail::get_error_string(st), rank_);
  registry[device] = g;
  return g;
}

struct fused_attention::impl {
  int device = 0, rank_ = 0;
  cudaStream_t stream = nullptr;
  std::shared_ptr<shared_graphs> shared;
  struct buffer {
    void* p = nullptr;
    std::size_t cap = 0;
  };
  buffer workspace, table, ranges, stats;

  void* grow(buffer& b, std::size_t bytes) {
    bytes = std::max<std::size_t>(bytes, 16);
    if (b.cap < bytes) {
      if (b.p) SEQPAR_CUDA(cudaFree, b.p);  // synchronises: no kernel still reads it
      b.p = nullptr;
      b.cap = 0;
      SEQPAR_CUDA(cudaMalloc, &b.p, bytes);
      b.cap = bytes;
    }
    return b.p;
  }

  [[noreturn]] void refuse(const char* what, fe::error_t e) const {
    raise(what, static_cast<int>(e.get_code()), e.get_message(), rank_);
  }

  fe::DataType_t io_type(attn_storage t) const {
    return t == attn_storage::f16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
  }

  /// The [b + 1] int32 ragged offsets (elements) of one packed tensor.
  static std::shared_ptr<fe::graph::Tensor_attributes> offsets(fe::graph::Graph& g,
                                                               const std::string& name,
                                                               std::int64_t uid, std::int64_t b) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_dim({b + 1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  }

  /// A [b, h, L, d] input in token-major packed rows, with its ragged offsets.
  std::shared_ptr<fe::graph::Tensor_attributes> rows(fe::graph::Graph& g, const char* name,
                                                     std::int64_t u, std::int64_t ro_uid,
                                                     std::int64_t b, std::int64_t h, std::int64_t L,
                                                     std::int64_t d) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(u)
                        .set_dim({b, h, L, d})
                        .set_stride({L * h * d, d, h * d, 1})
                        .set_ragged_offset(offsets(g, std::string("ro_") + name, ro_uid, b)));
  }

  /// Marks a graph output as [b, h, L, d] token-major packed rows with its ragged offsets.
  static void output_rows(fe::graph::Graph& g, fe::graph::Tensor_attributes& t, const char* name,
                          std::int64_t u, std::int64_t ro_uid, std::int64_t b, std::int64_t h,
                          std::int64_t L, std::int64_t d) {
    t.set_output(true)
        .set_uid(u)
        .set_dim({b, h, L, d})
        .set_stride({L * h * d, d, h * d, 1})
        .set_ragged_offset(offsets(g, std::string("ro_") + name, ro_uid, b));
  }

  std::shared_ptr<fe::graph::Tensor_attributes> lengths(fe::graph::Graph& g, const char* name,
                                                        std::int64_t u, std::int64_t b) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(u)
                        .set_dim({b, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
  }

  /// Builds g with the shared handle (the caller holds shared->mu).
  void finish(fe::graph::Graph& g, const char* what) {
    if (auto e = g.build(shared->handle, {fe::HeurMode_t::A}); e.is_bad()) refuse(what, e);
  }

  std::shared_ptr<fe::graph::Graph> graph(bool fwd, const fused_attention_args& a,
                                          const fused_attention_plan& p) {
    const std::int64_t Lq = fused_length_class(p.max_q), Lk = fused_length_class(p.max_k);
    const std::int64_t Tq = fused_length_class(a.sq), Tk = fused_length_class(a.sk);
    const graph_key key{fwd,
                        static_cast<int>(a.type),
                        p.batch,
                        Lq,
                        Lk,
                        a.hq,
                        a.hkv,
                        a.d,
                        a.causal,
                        std::bit_cast<std::uint32_t>(a.scale),
                        !fwd && a.deterministic,
                        Tq,
                        Tk};
    std::lock_guard<std::mutex> lock(shared->mu);
    auto& graphs = shared->graphs;
    if (auto it = graphs.find(key); it != graphs.end()) return it->second;
    const std::int64_t b = p.batch, hq = a.hq, hkv = a.hkv, d = a.d;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io_type(a.type))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = rows(*g, "q", u_q, u_ro_q, b, hq, Lq, d);
    auto k = rows(*g, "k", u_k, u_ro_k, b, hkv, Lk, d);
    auto v = rows(*g, "v", u_v, u_ro_v, b, hkv, Lk, d);
    auto seq_q = lengths(*g, "seq_q", u_seq_q, b);
    auto seq_k = lengths(*g, "seq_k", u_seq_k, b);
    auto ro_stats = offsets(*g, "ro_stats", u_ro_stats, b);
    const std::vector<std::int64_t> stats_dim{b, hq, Lq, 1}, stats_stride{Lq * hq, 1, hq, 1};
    if (fwd) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("seqpar_attention_forward")
                      .set_generate_stats(true)
                      .set_attn_scale(a.scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seq_q)
                      .set_seq_len_kv(seq_k)
                      .set_max_total_seq_len_q(Tq)
                      .set_max_total_seq_len_kv(Tk);
      if (a.causal) opts.set_causal_mask_bottom_right(true);
      auto [o, stats] = g->sdpa(q, k, v, opts);
      output_rows(*g, *o, "o", u_o, u_ro_o, b, hq, Lq, d);
      stats->set_output(true)
          .set_uid(u_stats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(stats_dim)
          .set_stride(stats_stride)
          .set_ragged_offset(ro_stats);
      finish(*g, "cuDNN attention forward graph");
    } else {
      auto o = rows(*g, "o", u_o, u_ro_o, b, hq, Lq, d);
      auto dout = rows(*g, "do", u_do, u_ro_do, b, hq, Lq, d);
      auto stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("stats")
                                 .set_uid(u_stats)
                                 .set_dim(stats_dim)
                                 .set_stride(stats_stride)
                                 .set_data_type(fe::DataType_t::FLOAT)
                                 .set_ragged_offset(ro_stats));
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("seqpar_attention_backward")
                      .set_attn_scale(a.scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seq_q)
                      .set_seq_len_kv(seq_k)
                      .set_max_total_seq_len_q(Tq)
                      .set_max_total_seq_len_kv(Tk)
                      .set_deterministic_algorithm(a.deterministic);
      if (a.causal) opts.set_causal_mask_bottom_right(true);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
      output_rows(*g, *dq, "dq", u_dq, u_ro_dq, b, hq, Lq, d);
      output_rows(*g, *dk, "dk", u_dk, u_ro_dk, b, hkv, Lk, d);
      output_rows(*g, *dv, "dv", u_dv, u_ro_dv, b, hkv, Lk, d);
      finish(*g, "cuDNN attention backward graph");
    }
    graphs.emplace(key, g);
    return g;
  }

  /// Uploads the plan's table; returns its device base.
  std::int32_t* upload_table(const fused_attention_plan& p) {
    const table_layout t(p.batch);
    std::vector<std::int32_t> host(static_cast<std::size_t>(t.total));
    std::copy(p.seq_q.begin(), p.seq_q.end(), host.begin() + t.seq_q);
    std::copy(p.seq_k.begin(), p.seq_k.end(), host.begin() + t.seq_k);
    std::copy(p.q_offset.begin(), p.q_offset.end(), host.begin() + t.ro_q);
    std::copy(p.k_offset.begin(), p.k_offset.end(), host.begin() + t.ro_k);
    std::copy(p.stats_offset.begin(), p.stats_offset.end(), host.begin() + t.ro_s);
    auto* dev = static_cast<std::int32_t*>(grow(table, host.size() * sizeof(std::int32_t)));
    SEQPAR_CUDA(cudaMemcpyAsync, dev, host.data(), host.size() * sizeof(std::int32_t),
                cudaMemcpyHostToDevice, stream);
    return dev;
  }

  /// Writes `pattern` into every 32-bit word of the rows in `r` (row_words words per row).
  void fill_rows(void* base, std::int64_t row_words,
                 const std::vector<std::pair<std::int64_t, std::int64_t>>& r,
                 std::uint32_t pattern) {
    if (r.empty() || row_words == 0) return;
    std::vector<std::int64_t> flat;
    flat.reserve(2 * r.size());
    for (const auto& [b, e] : r) {
      flat.push_back(b);
      flat.push_back(e);
    }
    // One ranges buffer per call: the launches below read it in stream order before the next
    // call overwrites it; a second fill in the same call gets its own region.
    const std::size_t bytes = flat.size() * sizeof(std::int64_t);
    auto* dev = static_cast<std::int64_t*>(grow(ranges, bytes));
    SEQPAR_CUDA(cudaMemcpyAsync, dev, flat.data(), bytes, cudaMemcpyHostToDevice, stream);
    const int code =
        launch::fill_row_ranges(base, row_words, dev, static_cast<int>(r.size()), pattern, stream);
    if (code)
      raise("fill_row_ranges", code, cudaGetErrorString(static_cast<cudaError_t>(code)), rank_);
  }

  void execute(fe::graph::Graph& g, std::unordered_map<std::int64_t, void*>& pack,
               const char* what) {
    // The shared handle runs this launch on this rank's stream (with this rank's workspace).
    std::lock_guard<std::mutex> lock(shared->mu);
    std::int64_t ws = 0;
    if (auto e = g.get_workspace_size(ws); e.is_bad()) refuse(what, e);
    void* w = grow(workspace, static_cast<std::size_t>(ws));
    if (const auto st = fe::detail::set_stream(shared->handle, stream); st != CUDNN_STATUS_SUCCESS)
      raise("cudnnSetStream", static_cast<int>(st), fe::detail::get_error_string(st), rank_);
    if (auto e = g.execute(shared->handle, pack, w); e.is_bad()) refuse(what, e);
  }
};

fused_attention::fused_attention(int device, void* stream, int rank) : impl_(new impl) {
  impl_->device = device;
  impl_->rank_ = rank;
  impl_->stream = static_cast<cudaStream_t>(stream);
  std::string why;
  if (!cudnn_version(&why)) raise("dlopen(libcudnn.so.9)", 0, why, rank);
  impl_->shared = graphs_of(device, rank);
}

fused_attention::~fused_attention() {
  cudaSetDevice(impl_->device);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  for (auto* b : {&impl_->workspace, &impl_->table, &impl_->ranges, &impl_->stats})
    if (b->p) cudaFree(b->p);
}

std::size_t fused_attention::graphs_built() const {
  std::lock_guard<std::mutex> lock(impl_->shared->mu);
  return impl_->shared->graphs.size();
}

void fused_attention::forward(const fused_attention_args& a) {
  auto& im = *impl_;
  const int rank_ = im.rank_;
  SEQPAR_CUDA(cudaSetDevice, im.device);
  const auto p = plan_fused_attention(a.cu_q, a.cu_k, a.sq, a.sk, a.hq, a.hkv, a.d, a.causal);
  const std::int64_t out_words = static_cast<std::int64_t>(a.hq) * a.d / 2;  // 16-bit storage
  if (p.batch > 0) {
    auto g = im.graph(true, a, p);
    std::int32_t* t = im.upload_table(p);
    const table_layout L(p.batch);
    auto pack = variant_pack(a, t, L);
    pack[u_o] = a.out;
    pack[u_stats] = a.stats;
    im.execute(*g, pack, "cuDNN attention forward");
  }
  // Rows cuDNN does not own (or that see no key): out 0, LSE −inf.
  im.fill_rows(a.out, out_words, p.q_blank, 0u);
  im.fill_rows(a.stats, a.hq, p.q_blank, 0xff800000u);
}

void fused_attention::backward(const fused_attention_args& a) {
  auto& im = *impl_;
  const int rank_ = im.rank_;
  SEQPAR_CUDA(cudaSetDevice, im.device);
  const auto p = plan_fused_attention(a.cu_q, a.cu_k, a.sq, a.sk, a.hq, a.hkv, a.d, a.causal);
  const std::int64_t q_words = static_cast<std::int64_t>(a.hq) * a.d / 2;
  const std::int64_t k_words = static_cast<std::int64_t>(a.hkv) * a.d / 2;
  if (p.batch > 0) {
    // cuDNN reads exp(s − LSE): a row that saw no key (LSE −inf) would give NaN through −inf −
    // (−inf); such rows are fully masked here too, so any finite LSE gives them p = 0.
    auto* stats = static_cast<float*>(
        im.grow(im.stats, static_cast<std::size_t>(a.sq * a.hq) * sizeof(float)));
    const int code = launch::finite_stats(a.sq * a.hq, a.stats, stats, im.stream);
    if (code)
      raise("finite_stats", code, cudaGetErrorString(static_cast<cudaError_t>(code)), rank_);
    auto g = im.graph(false, a, p);
    std::int32_t* t = im.upload_table(p);
    const table_layout L(p.batch);
    auto pack = variant_pack(a, t, L);
    pack.insert({{u_o, const_cast<void*>(static_cast<const void*>(a.out))},
                 {u_do, const_cast<void*>(a.dout)},
                 {u_stats, stats},
                 {u_dq, a.dq},
                 {u_dk, a.dk},
                 {u_dv, a.dv},
                 {u_ro_do, t + L.ro_q},
                 {u_ro_dq, t + L.ro_q},
                 {u_ro_dk, t + L.ro_k},
                 {u_ro_dv, t + L.ro_k}});
    im.execute(*g, pack, "cuDNN attention backward");
  }
  im.fill_rows(a.dq, q_words, p.q_blank, 0u);
  im.fill_rows(a.dk, k_words, p.k_blank, 0u);
  im.fill_rows(a.dv, k_words, p.k_blank, 0u);
}

#else  // no cuDNN in this build

struct fused_attention::impl {};

fused_attention::fused_attention(int, void*, int rank) {
  std::string why;
  cudnn_version(&why);
  raise("cuDNN attention", 0, why, rank);
}
fused_attention::~fused_attention() = default;
std::size_t fused_attention::graphs_built() const { return 0; }
void fused_attention::forward(const fused_attention_args&) {}
void fused_attention::backward(const fused_attention_args&) {}

#endif

}  // namespace seqpar::gpu
