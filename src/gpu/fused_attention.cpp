// fused_attention: cuDNN's fused flash attention through the cudnn-frontend graph API (see the
// header). cuDNN is dlopen'ed on first use; graphs are built once per shape class and device and
// reused by every rank of the process.
#include "gpu/fused_attention.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "gpu/cuda_check.hpp"
#include "gpu/fused_attention_plan.hpp"
#include "gpu/launch.hpp"
#include "gpu/setup_costs.hpp"

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

cudnn_library load_cudnn_now();

const cudnn_library& load_cudnn() {
  static const cudnn_library lib = [] {
    const auto t0 = std::chrono::steady_clock::now();
    cudnn_library l = load_cudnn_now();
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    detail::add_setup_cost([&](setup_costs& c) { c.cudnn_load += dt.count(); });
    return l;
  }();
  return lib;
}

cudnn_library load_cudnn_now() {
  {
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
  }
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

/// (kind: 0 ragged backward, 1 ragged forward, 2 dense backward, 3 dense forward; dtype; batch;
/// Lq; Lk; hq; hkv; d; causal; scale bits; deterministic; Tq; Tk; forward implementation;
/// dynamic shapes).
using graph_key = std::tuple<int, int, std::int64_t, std::int64_t, std::int64_t, int, int, int,
                             bool, std::uint32_t, bool, std::int64_t, std::int64_t, int, bool>;
/// What graphs may share one compiled kernel (dynamic shapes): the key without its sizes.
using cache_key = std::tuple<int, int, int, int, int, bool, std::uint32_t, bool, int>;

fe::AttentionImplementation_t implementation_of(fused_attention_args::forward_impl i) {
  switch (i) {
    case fused_attention_args::forward_impl::composite:
      return fe::AttentionImplementation_t::COMPOSITE;
    case fused_attention_args::forward_impl::unified:
      return fe::AttentionImplementation_t::UNIFIED;
    default:
      return fe::AttentionImplementation_t::AUTO;
  }
}

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

/// A cuDNN handle owned by one graph (destroyed after it): the graph is built with it and every
/// launch of the graph goes through it, so builds and launches of different graphs never wait
/// for each other.
struct owned_handle {
  cudnnHandle_t h = nullptr;
  int device = 0;
  owned_handle() = default;
  owned_handle(const owned_handle&) = delete;
  owned_handle& operator=(const owned_handle&) = delete;
  ~owned_handle() {
    if (!h) return;
    cudaSetDevice(device);
    fe::detail::destroy_handle(h);
  }
};

/// One graph, built or being built: `ready` yields it (null where cuDNN refused a dense graph)
/// or the build's error. `mu` serialises its build and its launches (a launch points the handle
/// at the caller's stream, then enqueues with the caller's workspace).
struct graph_entry {
  owned_handle handle;  ///< declared first: outlives the graph below
  std::mutex mu;
  std::promise<std::shared_ptr<fe::graph::Graph>> made;
  std::shared_future<std::shared_ptr<fe::graph::Graph>> ready = made.get_future().share();
};

/// The graphs built so far on one device, shared by every fused_attention of the device in the
/// process (the virtual ranks of a run build each graph once, not once per rank), and the
/// builds started ahead: a forward call starts the matching backward graph's build on a
/// thread of its own, so the backward finds it built.
struct shared_graphs {
  std::mutex mu;  ///< the maps, the refusals, the background threads
  int device = 0;
  std::map<graph_key, std::shared_ptr<graph_entry>> graphs;
  /// A kernel cache and the lock of the builds that share it (one at a time).
  struct shared_cache {
    std::shared_ptr<fe::KernelCache> cache = std::make_shared<fe::KernelCache>();
    std::mutex build;
  };
  std::map<cache_key, std::shared_ptr<shared_cache>> caches;
  /// cuDNN refused a dynamic-shape forward graph (then every graph is built without) or a dense
  /// one (then single-document calls take the ragged graph).
  std::atomic<bool> dynamic_refused{false}, dense_refused{false};
  std::vector<std::thread> background;
  ~shared_graphs() {
    for (auto& t : background)
      if (t.joinable()) t.join();
    graphs.clear();
    caches.clear();
  }
};

/// The device's shared graphs: made by the first fused_attention of the device, kept while any
/// of them lives.
std::shared_ptr<shared_graphs> graphs_of(int device) {
  static std::mutex registry_mu;
  static std::map<int, std::weak_ptr<shared_graphs>> registry;
  std::lock_guard<std::mutex> lock(registry_mu);
  if (auto live = registry[device].lock()) return live;
  auto g = std::make_shared<shared_graphs>();
  g->device = device;
  registry[device] = g;
  return g;
}

namespace {

[[noreturn]] void refuse(const char* what, fe::error_t e, int rank_) {
  raise(what, static_cast<int>(e.get_code()), e.get_message(), rank_);
}

fe::DataType_t io_type(attn_storage t) {
  return t == attn_storage::f16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16;
}

/// The [b + 1] int32 ragged offsets (elements) of one packed tensor.
std::shared_ptr<fe::graph::Tensor_attributes> offsets(fe::graph::Graph& g, const std::string& name,
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
void output_rows(fe::graph::Graph& g, fe::graph::Tensor_attributes& t, const char* name,
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

/// A [1, h, L, d] tensor of token-major rows (no ragged offsets).
std::shared_ptr<fe::graph::Tensor_attributes> dense_rows(fe::graph::Graph& g, const char* name,
                                                         std::int64_t u, std::int64_t h,
                                                         std::int64_t L, std::int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(u)
                      .set_dim({1, h, L, d})
                      .set_stride({L * h * d, d, h * d, 1}));
}

/// One graph's build, by value: it may run on a thread of its own after the call that started it
/// has returned.
struct graph_build {
  shared_graphs* sh;
  int rank_;
  bool fwd, dense;
  fused_attention_args a;
  fused_attention_plan p;
  bool background = false;

  /// The lengths' classes of a ragged graph.
  std::int64_t Lq() const { return fused_length_class(p.max_q); }
  std::int64_t Lk() const { return fused_length_class(p.max_k); }

  graph_key key() const {
    const bool det = !fwd && a.deterministic;
    const int impl = fwd ? static_cast<int>(a.impl) : 0;
    const auto scale = std::bit_cast<std::uint32_t>(a.scale);
    if (dense)
      return {fwd ? 3 : 2, static_cast<int>(a.type),
              1,           a.sq,
              a.sk,        a.hq,
              a.hkv,       a.d,
              a.causal,    scale,
              det,         a.sq,
              a.sk,        impl,
              false};
    return {fwd ? 1 : 0,
            static_cast<int>(a.type),
            p.batch,
            Lq(),
            Lk(),
            a.hq,
            a.hkv,
            a.d,
            a.causal,
            scale,
            det,
            fused_length_class(a.sq),
            fused_length_class(a.sk),
            impl,
            fwd && a.dynamic_shapes};
  }

  /// The kernel cache that dynamic forward graphs of one mask, head layout and dtype share.
  std::shared_ptr<shared_graphs::shared_cache> cache() const {
    const cache_key k{fwd,
                      static_cast<int>(a.type),
                      a.hq,
                      a.hkv,
                      a.d,
                      a.causal,
                      std::bit_cast<std::uint32_t>(a.scale),
                      !fwd && a.deterministic,
                      fwd ? static_cast<int>(a.impl) : 0};
    std::lock_guard<std::mutex> lock(sh->mu);
    auto& c = sh->caches[k];
    if (!c) c = std::make_shared<shared_graphs::shared_cache>();
    return c;
  }

  /// Builds g with handle h, timed into setup_costs; throws backend_error where cuDNN refuses.
  void finish(fe::graph::Graph& g, cudnnHandle_t h, const char* what, bool dynamic) const {
    const auto t0 = std::chrono::steady_clock::now();
    const auto e = g.build(h, {fe::HeurMode_t::A});
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    detail::add_setup_cost([&](setup_costs& c) {
      c.graph_builds += dt.count();
      if (e.is_bad()) return;
      ++c.graphs;
      c.dynamic_graphs += dynamic ? 1 : 0;
      c.dense_graphs += dense ? 1 : 0;
      c.background_graphs += background ? 1 : 0;
      c.builds.push_back(fmt::format("{} {}{} b={} q={} k={}{}: {:.3f} s", fwd ? "fwd" : "bwd",
                                     dense ? "dense" : "ragged", dynamic ? " dynamic" : "",
                                     dense ? 1 : p.batch, dense ? a.sq : Lq(), dense ? a.sk : Lk(),
                                     background ? " (ahead)" : "", dt.count()));
    });
    if (e.is_bad()) refuse(what, e, rank_);
  }

  /// The ragged graph of the call's shape class: packed rows with ragged offsets and a padding
  /// mask, bottom-right causal.
  std::shared_ptr<fe::graph::Graph> ragged(cudnnHandle_t h, bool dynamic) const {
    const std::int64_t b = p.batch, hq = a.hq, hkv = a.hkv, d = a.d, Lq_ = Lq(), Lk_ = Lk();
    const std::int64_t Tq = fused_length_class(a.sq), Tk = fused_length_class(a.sk);
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io_type(a.type))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const auto shared_kernels = dynamic ? cache() : nullptr;
    if (dynamic) g->set_dynamic_shape_enabled(true).set_kernel_cache(shared_kernels->cache);
    auto q = rows(*g, "q", u_q, u_ro_q, b, hq, Lq_, d);
    auto k = rows(*g, "k", u_k, u_ro_k, b, hkv, Lk_, d);
    auto v = rows(*g, "v", u_v, u_ro_v, b, hkv, Lk_, d);
    auto seq_q = lengths(*g, "seq_q", u_seq_q, b);
    auto seq_k = lengths(*g, "seq_k", u_seq_k, b);
    auto ro_stats = offsets(*g, "ro_stats", u_ro_stats, b);
    const std::vector<std::int64_t> stats_dim{b, hq, Lq_, 1}, stats_stride{Lq_ * hq, 1, hq, 1};
    if (fwd) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("seqpar_attention_forward")
                      .set_generate_stats(true)
                      .set_attn_scale(a.scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seq_q)
                      .set_seq_len_kv(seq_k)
                      .set_max_total_seq_len_q(Tq)
                      .set_max_total_seq_len_kv(Tk)
                      .set_implementation(implementation_of(a.impl));
      if (a.causal) opts.set_causal_mask_bottom_right(true);
      auto [o, stats] = g->sdpa(q, k, v, opts);
      output_rows(*g, *o, "o", u_o, u_ro_o, b, hq, Lq_, d);
      stats->set_output(true)
          .set_uid(u_stats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(stats_dim)
          .set_stride(stats_stride)
          .set_ragged_offset(ro_stats);
      // Graphs sharing a kernel cache build one at a time (the first fills it).
      std::unique_lock<std::mutex> one_at_a_time;
      if (shared_kernels) one_at_a_time = std::unique_lock<std::mutex>(shared_kernels->build);
      finish(*g, h, "cuDNN attention forward graph", dynamic);
    } else {
      auto o = rows(*g, "o", u_o, u_ro_o, b, hq, Lq_, d);
      auto dout = rows(*g, "do", u_do, u_ro_do, b, hq, Lq_, d);
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
      output_rows(*g, *dq, "dq", u_dq, u_ro_dq, b, hq, Lq_, d);
      output_rows(*g, *dk, "dk", u_dk, u_ro_dk, b, hkv, Lk_, d);
      output_rows(*g, *dv, "dv", u_dv, u_ro_dv, b, hkv, Lk_, d);
      finish(*g, h, "cuDNN attention backward graph", false);
    }
    return g;
  }

  /// The dense graph of a call that is one document over every row (sq, sk exact): no ragged
  /// offsets, no padding mask, causal top-left when sq = sk (the same mask as bottom-right
  /// there), and the LSE head-major [1, hq, sq, 1] as torch's SDPA has it.
  std::shared_ptr<fe::graph::Graph> dense_graph(cudnnHandle_t h) const {
    const std::int64_t Lq_ = a.sq, Lk_ = a.sk, hq = a.hq, hkv = a.hkv, d = a.d;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(io_type(a.type))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = dense_rows(*g, "q", u_q, hq, Lq_, d);
    auto k = dense_rows(*g, "k", u_k, hkv, Lk_, d);
    auto v = dense_rows(*g, "v", u_v, hkv, Lk_, d);
    const std::vector<std::int64_t> stats_dim{1, hq, Lq_, 1}, stats_stride{hq * Lq_, Lq_, 1, 1};
    const auto mask = [&](auto& opts) {
      if (!a.causal) return;
      if (Lq_ == Lk_)
        opts.set_causal_mask(true);
      else
        opts.set_causal_mask_bottom_right(true);
    };
    const auto output = [&](fe::graph::Tensor_attributes& t, std::int64_t u, std::int64_t hh,
                            std::int64_t L) {
      t.set_output(true).set_uid(u).set_dim({1, hh, L, d}).set_stride({L * hh * d, d, hh * d, 1});
    };
    if (fwd) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("seqpar_dense_attention_forward")
                      .set_generate_stats(true)
                      .set_attn_scale(a.scale)
                      .set_implementation(implementation_of(a.impl));
      mask(opts);
      auto [o, stats] = g->sdpa(q, k, v, opts);
      output(*o, u_o, hq, Lq_);
      stats->set_output(true)
          .set_uid(u_stats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim(stats_dim)
          .set_stride(stats_stride);
      finish(*g, h, "cuDNN dense attention forward graph", false);
    } else {
      auto o = dense_rows(*g, "o", u_o, hq, Lq_, d);
      auto dout = dense_rows(*g, "do", u_do, hq, Lq_, d);
      auto stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("stats")
                                 .set_uid(u_stats)
                                 .set_dim(stats_dim)
                                 .set_stride(stats_stride)
                                 .set_data_type(fe::DataType_t::FLOAT));
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("seqpar_dense_attention_backward")
                      .set_attn_scale(a.scale)
                      .set_deterministic_algorithm(a.deterministic);
      mask(opts);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
      output(*dq, u_dq, hq, Lq_);
      output(*dk, u_dk, hkv, Lk_);
      output(*dv, u_dv, hkv, Lk_);
      finish(*g, h, "cuDNN dense attention backward graph", false);
    }
    return g;
  }

  /// The graph, on its own new handle: dense (null where cuDNN refuses it: then no dense
  /// graph is tried again in this process), or ragged with dynamic shapes for a forward where
  /// cuDNN takes them (cuDNN 9.19's Hopper backward engines take none).
  std::shared_ptr<fe::graph::Graph> operator()(owned_handle& h) const {
    const auto t0 = std::chrono::steady_clock::now();
    h.device = sh->device;
    if (const auto st = fe::detail::create_handle(&h.h); st != CUDNN_STATUS_SUCCESS) {
      h.h = nullptr;
      raise("cudnnCreate", static_cast<int>(st), fe::detail::get_error_string(st), rank_);
    }
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    detail::add_setup_cost([&](setup_costs& c) { c.cudnn_handle += dt.count(); });
    if (dense) {
      try {
        return dense_graph(h.h);
      } catch (const backend_error&) {
        sh->dense_refused = true;
        return nullptr;
      }
    }
    if (fwd && a.dynamic_shapes && !sh->dynamic_refused) {
      try {
        return ragged(h.h, true);
      } catch (const backend_error& e) {
        sh->dynamic_refused = true;
        detail::add_setup_cost([&](setup_costs& c) {
          // cuDNN's message runs to a page of engine dumps: its first line and, where it
          // says one, which engine refused and why.
          if (!c.dynamic_refused.empty()) return;
          const std::string what = e.what();
          c.dynamic_refused = what.substr(0, what.find('\n'));
          if (const auto at = what.find("Reason: This engine"); at != std::string::npos)
            c.dynamic_refused += "; " + what.substr(at + 8, what.find(" at: ", at) - at - 8);
        });
      }
    }
    return ragged(h.h, false);
  }
};

/// The entry of b's graph: found, or made and built — here, or on a thread of its own when
/// b.background (the caller then does not wait).
std::shared_ptr<graph_entry> obtain(const graph_build& b) {
  shared_graphs& sh = *b.sh;
  const graph_key key = b.key();
  std::shared_ptr<graph_entry> e;
  {
    std::lock_guard<std::mutex> lock(sh.mu);
    auto& slot = sh.graphs[key];
    if (slot) return slot;
    slot = e = std::make_shared<graph_entry>();
  }
  auto run = [b, e] {
    std::lock_guard<std::mutex> lock(e->mu);
    try {
      e->made.set_value(b(e->handle));
    } catch (...) {
      e->made.set_exception(std::current_exception());
    }
  };
  if (!b.background) {
    run();
    return e;
  }
  std::vector<std::thread> done;  // earlier builds, joined outside the lock (long since ended)
  {
    std::lock_guard<std::mutex> lock(sh.mu);
    if (sh.background.size() >= 16) done.swap(sh.background);
    sh.background.emplace_back([run, device = sh.device] {
      cudaSetDevice(device);
      run();
    });
  }
  for (auto& t : done) t.join();
  return e;
}

}  // namespace

struct fused_attention::impl {
  int device = 0, rank_ = 0;
  cudaStream_t stream = nullptr;
  std::shared_ptr<shared_graphs> shared;
  struct buffer {
    void* p = nullptr;
    std::size_t cap = 0;
  };
  buffer workspace, table, ranges, stats, head_stats;

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

  graph_build build_of(bool fwd, bool dense, const fused_attention_args& a,
                       const fused_attention_plan& p) const {
    return graph_build{shared.get(), rank_, fwd, dense, a, p};
  }

  /// The graph of a call (built here if no one has), and — a forward's — the matching backward
  /// graph's build started ahead. Null: cuDNN refused the dense graph.
  std::pair<std::shared_ptr<graph_entry>, std::shared_ptr<fe::graph::Graph>> graph(
      bool fwd, bool dense, const fused_attention_args& a, const fused_attention_plan& p) {
    auto e = obtain(build_of(fwd, dense, a, p));
    if (fwd) {
      auto ahead = build_of(false, dense, a, p);
      ahead.background = true;
      obtain(ahead);
    }
    return {e, e->ready.get()};
  }

  /// Whether a call is one document over every row (a dense graph's case).
  bool dense_call(const fused_attention_args& a, const fused_attention_plan& p) const {
    return a.dense && !shared->dense_refused && p.batch == 1 && p.q_blank.empty() &&
           p.k_blank.empty() && p.seq_q[0] == a.sq && p.seq_k[0] == a.sk;
  }

  /// The dense graphs' head-major LSE scratch, [hq, sq] float32.
  float* head_major_stats(const fused_attention_args& a) {
    return static_cast<float*>(
        grow(head_stats, static_cast<std::size_t>(a.sq * a.hq) * sizeof(float)));
  }

  void transpose(std::int64_t rows, std::int64_t cols, const float* x, float* y, bool finite) {
    const int code = launch::transpose_f32(rows, cols, x, y, finite, stream);
    if (code)
      raise("transpose_f32", code, cudaGetErrorString(static_cast<cudaError_t>(code)), rank_);
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

  /// Launches graph g of entry e on this rank's stream with this rank's workspace.
  void execute(graph_entry& e, fe::graph::Graph& g, std::unordered_map<std::int64_t, void*>& pack,
               const char* what) {
    std::lock_guard<std::mutex> lock(e.mu);
    std::int64_t ws = 0;
    if (auto r = g.get_workspace_size(ws); r.is_bad()) refuse(what, r, rank_);
    void* w = grow(workspace, static_cast<std::size_t>(ws));
    if (const auto st = fe::detail::set_stream(e.handle.h, stream); st != CUDNN_STATUS_SUCCESS)
      raise("cudnnSetStream", static_cast<int>(st), fe::detail::get_error_string(st), rank_);
    if (auto r = g.execute(e.handle.h, pack, w); r.is_bad()) refuse(what, r, rank_);
  }
};

fused_attention::fused_attention(int device, void* stream, int rank) : impl_(new impl) {
  impl_->device = device;
  impl_->rank_ = rank;
  impl_->stream = static_cast<cudaStream_t>(stream);
  std::string why;
  if (!cudnn_version(&why)) raise("dlopen(libcudnn.so.9)", 0, why, rank);
  impl_->shared = graphs_of(device);
}

fused_attention::~fused_attention() {
  cudaSetDevice(impl_->device);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  for (auto* b :
       {&impl_->workspace, &impl_->table, &impl_->ranges, &impl_->stats, &impl_->head_stats})
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
  if (im.dense_call(a, p)) {
    if (auto [e, g] = im.graph(true, true, a, p); g) {
      float* hs = im.head_major_stats(a);
      std::unordered_map<std::int64_t, void*> pack{{u_q, const_cast<void*>(a.q)},
                                                   {u_k, const_cast<void*>(a.k)},
                                                   {u_v, const_cast<void*>(a.v)},
                                                   {u_o, a.out},
                                                   {u_stats, hs}};
      im.execute(*e, *g, pack, "cuDNN dense attention forward");
      im.transpose(a.hq, a.sq, hs, a.stats, false);  // [hq, sq] → rows [sq, hq]
      return;                                        // every row is the document's: nothing to fill
    }
  }
  if (p.batch > 0) {
    auto [e, g] = im.graph(true, false, a, p);
    std::int32_t* t = im.upload_table(p);
    const table_layout L(p.batch);
    auto pack = variant_pack(a, t, L);
    pack[u_o] = a.out;
    pack[u_stats] = a.stats;
    im.execute(*e, *g, pack, "cuDNN attention forward");
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
  if (im.dense_call(a, p)) {
    if (auto [e, g] = im.graph(false, true, a, p); g) {
      // Rows [sq, hq] → head-major [hq, sq], −inf (no such row in a dense call) made finite.
      float* hs = im.head_major_stats(a);
      im.transpose(a.sq, a.hq, a.stats, hs, true);
      std::unordered_map<std::int64_t, void*> pack{{u_q, const_cast<void*>(a.q)},
                                                   {u_k, const_cast<void*>(a.k)},
                                                   {u_v, const_cast<void*>(a.v)},
                                                   {u_o, const_cast<void*>(a.out)},
                                                   {u_do, const_cast<void*>(a.dout)},
                                                   {u_stats, hs},
                                                   {u_dq, a.dq},
                                                   {u_dk, a.dk},
                                                   {u_dv, a.dv}};
      im.execute(*e, *g, pack, "cuDNN dense attention backward");
      return;
    }
  }
  if (p.batch > 0) {
    // cuDNN reads exp(s − LSE): a row that saw no key (LSE −inf) would give NaN through −inf −
    // (−inf); such rows are fully masked here too, so any finite LSE gives them p = 0.
    auto* stats = static_cast<float*>(
        im.grow(im.stats, static_cast<std::size_t>(a.sq * a.hq) * sizeof(float)));
    const int code = launch::finite_stats(a.sq * a.hq, a.stats, stats, im.stream);
    if (code)
      raise("finite_stats", code, cudaGetErrorString(static_cast<cudaError_t>(code)), rank_);
    auto [e, g] = im.graph(false, false, a, p);
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
    im.execute(*e, *g, pack, "cuDNN attention backward");
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
