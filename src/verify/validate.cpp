#include "verify/validate.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>

#if defined(SEQPAR_HAVE_MPI)
#include "mpi/mpi_comm.hpp"
#endif

#include "core/collate.hpp"
#include "core/flight_recorder.hpp"
#include "core/layout.hpp"
#include "core/mesh.hpp"
#include "core/rng.hpp"
#include "core/timing.hpp"
#include "core/ulysses.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_compute.hpp"
#include "gpu/device_local_comm.hpp"
#include "gpu/kernels/bf16.hpp"
#include "gpu/nccl_comm.hpp"
#include "io/scenario_json.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/inproc_comm.hpp"
#include "sim/sp_setup.hpp"
#include "trace/flight.hpp"
#include "verify/check.hpp"

namespace seqpar::verify {

using namespace seqpar::gpu;

const std::vector<std::string>& validate_stages() {
  static const std::vector<std::string> s = {
      "a2a.q",   "a2a.k",   "a2a.v",   "attn.out", "attn.lse", "out",    "a2a.dout",
      "attn.dq", "attn.dk", "attn.dv", "grad.dq",  "grad.dk",  "grad.dv"};
  return s;
}

namespace {

enum class tol_kind { exact, forward, backward };

tol_kind kind_of(const std::string& stage) {
  if (stage.rfind("a2a.", 0) == 0) return tol_kind::exact;
  if (stage == "attn.out" || stage == "attn.lse" || stage == "out") return tol_kind::forward;
  return tol_kind::backward;
}

std::int64_t longest_doc(const scenario& s) {
  std::int64_t m = 1;
  for (auto d : s.docs) m = std::max(m, d);
  return m;
}

}  // namespace

void validate_tolerances(const scenario& s, dtype t, double max_abs_lse, validate_report& rep) {
  const double L = static_cast<double>(longest_doc(s));
  const double D = s.head_dim;
  const int R = s.ring;
  rep.tol_exact = 0.0;
  if (t == dtype::f32) {
    // Inputs are float32 on both sides, so only the kernels' rounding differs (attention.hpp's
    // model): |err| ≲ c·eps·(sqrt(L) + sqrt(D)·(1 + max|s|)) relative, max|s| ≤ scale·D·1·1 =
    // sqrt(D) for inputs in [−1, 1]; R ring steps add one merge rounding each. c = 4 forward;
    // gradients are sums over L such terms through dS = P∘(dP − D) (cancellation): c = 16.
    const double eps = std::ldexp(1.0, -23);
    const double base = std::sqrt(L) + std::sqrt(D) * (1.0 + std::sqrt(D)) + R;
    rep.tol_forward = 4 * eps * base;
    rep.tol_backward = 16 * eps * base;
    rep.error_model = fmt::format(
        "float32 vs the float64 oracle on the same float32 inputs: all-to-all stages bit-exact; "
        "attention 4·eps·(sqrt(L) + sqrt(D)·(1+sqrt(D)) + R) = {:.2e}, gradients 16·eps·(…) = "
        "{:.2e} (eps = 2^-23, L = {} longest document, D = {}, R = {})",
        rep.tol_forward, rep.tol_backward, static_cast<std::int64_t>(L), s.head_dim, R);
    return;
  }
  // bf16: the inputs are rounded to bf16 once and the reference sees the same rounded values,
  // so input rounding does not count. What remains is storing results in bf16 (relative error
  // ≤ u = 2^-8 each): out, and the LSE, whose absolute error u·|lse| becomes a relative error
  // u·|lse| of every softmax weight e^(s − lse) and of the merge weights e^(−softplus(±δ)), where
  // both sides' LSEs count. Each of the R ring steps re-rounds out and LSE; the backward reuses
  // the rounded out and LSE and sums R partial gradients in bf16. Hence
  //   forward u·(2 + 2·max|lse|)·R,  backward 4·u·(2 + 2·max|lse|)·R.
  const double u = std::ldexp(1.0, -8);
  rep.tol_forward = u * (2.0 + 2.0 * max_abs_lse) * R;
  rep.tol_backward = 4 * rep.tol_forward;
  rep.error_model = fmt::format(
      "bfloat16 vs the float64 oracle on the same bf16-rounded inputs: all-to-all stages "
      "bit-exact; attention u·(2 + 2·max|lse|)·R = {:.2e}, gradients 4× = {:.2e} (u = 2^-8 per "
      "stored bf16 rounding, max|lse| = {:.3g}, R = {})",
      rep.tol_forward, rep.tol_backward, max_abs_lse, R);
}

namespace {

using capture = std::map<std::string, std::vector<double>>;

attention_engine validate_engine(const std::string& name) {
  if (const auto e = attention_engine_named(name)) return *e;
  fail<config_error>("validate: attention engine '{}' is not one of auto, cudnn, simt", name);
}

/// Records the tensors entering and leaving the inner attention (heads-sharded, after the
/// all-to-alls) and forwards to the real one.
class capturing_inner final : public inner_attention {
 public:
  capturing_inner(inner_attention& inner, compute& c, capture& cap)
      : inner_(inner), c_(c), cap_(cap) {}
  void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
               const std::string& tag) override {
    cap_["a2a.q"] = c_.to_host(q);
    cap_["a2a.k"] = c_.to_host(k);
    cap_["a2a.v"] = c_.to_host(v);
    inner_.forward(q, k, v, out, lse, tag);
    cap_["attn.out"] = c_.to_host(out);
    cap_["attn.lse"] = c_.to_host(lse);
  }
  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                const std::string& tag) override {
    cap_["a2a.dout"] = c_.to_host(dout);
    inner_.backward(q, k, v, out, lse, dout, dq, dk, dv, tag);
    cap_["attn.dq"] = c_.to_host(dq);
    cap_["attn.dk"] = c_.to_host(dk);
    cap_["attn.dv"] = c_.to_host(dv);
  }

 private:
  inner_attention& inner_;
  compute& c_;
  capture& cap_;
};

/// Input `which` (0 q, 1 k, 2 v, 3 dout) of the rank holding global tokens `tokens`: uniform in
/// [−1, 1] from (seed, which, token, head, dim) — every rank derives its block from global
/// indices — rounded to the GPU's dtype so both sides see identical values.
std::vector<double> input_block(const scenario& s, int which,
                                const std::vector<std::int64_t>& tokens, int heads, dtype t) {
  std::vector<double> v;
  v.reserve(tokens.size() * static_cast<std::size_t>(heads * s.head_dim));
  for (auto tok : tokens)
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < s.head_dim; ++c) {
        const auto idx = (static_cast<std::uint64_t>(tok) * heads + h) * s.head_dim + c;
        const double x = uniform_pm1(s.seed, 7000 + which, idx);
        v.push_back(t == dtype::bf16 ? round_bf16(x) : static_cast<double>(static_cast<float>(x)));
      }
  return v;
}

/// One rank's attention sub-layer forward and backward through the core algorithms. Inputs are
/// index-derived values rounded to `values`, held in `storage` (the GPU: the run's dtype for
/// both; the reference: float64 storage of the same rounded values).
void run_rank(communicator& comm, compute& c, const scenario& s, const collated_batch& cb,
              dtype storage, dtype values, capture& cap) {
  sim::sp_env env = sim::cp_rank_env(comm, c, s, cb);
  auto inner = env.make_inner(c, layer_attention{});
  capturing_inner wrap(*inner, c, cap);
  const auto tokens = rank_tokens(cb, comm.rank());
  const auto n = static_cast<std::int64_t>(tokens.size());
  auto input = [&](int which, int heads) {
    return c.from_host(storage, {n, heads, s.head_dim},
                       input_block(s, which, tokens, heads, values));
  };
  const tensor q = input(0, s.heads), k = input(1, s.kv_heads), v = input(2, s.kv_heads);
  const tensor dout = input(3, s.heads);
  ulysses_saved saved;
  const tensor out = ulysses_forward(comm, c, env.ulysses, wrap, q, k, v, saved, "L0.attn");
  cap["out"] = c.to_host(out);
  const qkv_grads g = ulysses_backward(comm, c, env.ulysses, wrap, saved, dout, "L0.attn");
  cap["grad.dq"] = c.to_host(g.dq);
  cap["grad.dk"] = c.to_host(g.dk);
  cap["grad.dv"] = c.to_host(g.dv);
}

/// The CPU reference of every rank: the same algorithms, eigen_compute in float64.
std::vector<capture> run_reference(const scenario& s, const collated_batch& cb, dtype t) {
  std::vector<capture> caps(static_cast<std::size_t>(s.cp()));
  run_ranks(s.cp(), [&](communicator& comm) {
    sim::eigen_compute c;
    run_rank(comm, c, s, cb, dtype::f64, t, caps[static_cast<std::size_t>(comm.rank())]);
  });
  return caps;
}

compared_tensor compare(int rank, const std::string& stage, const std::vector<double>& got,
                        const std::vector<double>& want, double tol) {
  auto r = compare_values(stage, got, want, tol);
  r.rank = rank;
  return r;
}

double max_abs_lse(const std::vector<capture>& ref) {
  double m = 0;
  for (const auto& cap : ref)
    for (double x : cap.at("attn.lse"))
      if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

void compare_rank(int rank, const capture& got, const capture& want, validate_report& rep) {
  for (const auto& st : validate_stages()) {
    const double tol = kind_of(st) == tol_kind::exact     ? rep.tol_exact
                       : kind_of(st) == tol_kind::forward ? rep.tol_forward
                                                          : rep.tol_backward;
    auto g = got.find(st), w = want.find(st);
    if (g == got.end() || w == want.end()) {
      compared_tensor r;
      r.rank = rank;
      r.tensor = st;
      r.note = "stage not reached";
      rep.rows.push_back(r);
      continue;
    }
    rep.rows.push_back(compare(rank, st, g->second, w->second, tol));
  }
}

void check_inputs(const scenario& s, dtype t) {
  validate(s);
  if (t != dtype::f32 && t != dtype::bf16)
    fail<config_error>("validate runs the GPU in float32 or bfloat16, not {}; use --dtype f32|bf16",
                       dtype_name(t));
  if (s.head_dim > 128)
    fail<config_error>("head_dim={} exceeds the GPU attention kernels' 128; use --head-dim ≤ 128",
                       s.head_dim);
  if (s.has_attention_options())
    fail<config_error>(
        "validate compares the attention sub-layer with causal, full attention only (the "
        "scenario asks for {}); check these options with the whole step on the GPU (seqpar "
        "check --backend gpu with the same flags) or on the CPU reference (seqpar check)",
        s.describe_attention());
}

}  // namespace

validate_report run_validate_local(const scenario& s, const validate_options& opt) {
  check_inputs(s, opt.type);
  auto say = [&](std::string_view l) {
    if (opt.progress) opt.progress(l);
  };
  validate_report rep;
  rep.scen = s;
  rep.type = opt.type;
  rep.transport = fmt::format("device-local ({} virtual ranks on GPU {})", s.cp(), opt.device);
  rep.device = device_name(opt.device);
  const collated_batch cb = collate(make_batch(s), options_of(s));

  say(fmt::format("GPU: {} virtual ranks (ulysses {} × ring {}) on {}, {}", s.cp(), s.ulysses,
                  s.ring, rep.device, dtype_name(opt.type)));
  auto t0 = std::chrono::steady_clock::now();
  const auto costs0 = setup_costs_so_far();
  std::vector<capture> got(static_cast<std::size_t>(s.cp()));
  flight_recorder flight;
  try {
    run_device_ranks(
        s.cp(), opt.device,
        [&](communicator& comm, cuda_compute& c) {
          comm.set_flight_recorder(&flight);
          c.set_attention_engine(validate_engine(opt.attention_engine));
          run_rank(comm, c, s, cb, opt.type, opt.type, got[static_cast<std::size_t>(comm.rank())]);
          if (comm.rank() == 0) rep.attention_engine = c.attention_engine_used();
        },
        nullptr, opt.timeout.count() > 0 ? opt.timeout : std::chrono::seconds(60));
  } catch (const std::exception& e) {
    if (opt.flight_dir.empty()) throw;
    std::vector<int> ranks(static_cast<std::size_t>(s.cp()));
    for (int r = 0; r < s.cp(); ++r) ranks[static_cast<std::size_t>(r)] = r;
    const auto files = trace::write_flight_records(
        opt.flight_dir, flight, ranks, {s.cp(), io::scenario_to_json(s), e.what(), -1, {}, {}});
    rethrow_with_note(std::current_exception(), flight_note(opt.flight_dir, files.size()));
  }
  rep.gpu_seconds = seconds_since(t0);
  rep.setup = setup_costs_so_far().since(costs0);

  say("CPU reference: the same algorithms in float64");
  t0 = std::chrono::steady_clock::now();
  const auto ref = run_reference(s, cb, opt.type);
  rep.reference_seconds = seconds_since(t0);

  validate_tolerances(s, opt.type, max_abs_lse(ref), rep);
  for (int k = 0; k < s.cp(); ++k)
    compare_rank(k, got[static_cast<std::size_t>(k)], ref[static_cast<std::size_t>(k)], rep);
  rep.pass = std::all_of(rep.rows.begin(), rep.rows.end(), [](const auto& r) { return r.pass; });
  return rep;
}

bool launched_with_several_ranks() {
  for (const char* var : {"PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(var);
    if (v && std::atoi(v) > 1) return true;
  }
  return false;
}

#if defined(SEQPAR_HAVE_MPI)
namespace {

/// One rank's capture as one float64 message for the gather to rank 0: per stage of
/// validate_stages(), its length (−1 when the stage was not reached) and then its values.
std::vector<double> pack(const capture& cap) {
  std::vector<double> out;
  for (const auto& st : validate_stages()) {
    const auto it = cap.find(st);
    out.push_back(it == cap.end() ? -1.0 : static_cast<double>(it->second.size()));
    if (it != cap.end()) out.insert(out.end(), it->second.begin(), it->second.end());
  }
  return out;
}

capture unpack(const double* p) {
  capture cap;
  for (const auto& st : validate_stages()) {
    const auto n = static_cast<std::int64_t>(*p++);
    if (n < 0) continue;
    cap[st].assign(p, p + n);
    p += n;
  }
  return cap;
}

/// Every group of the attention sub-layer of every rank, in one order on all ranks.
std::vector<comm_group> attention_groups(const scenario& s) {
  mesh_config mc;
  mc.ring = s.ring;
  mc.ulysses = s.ulysses;
  mc.mode = shifts_whole_row(s.profile) ? cp_fsdp_mode::all : parse_cp_fsdp_mode(s.cp_fsdp_mode);
  const device_mesh mesh(mc);
  std::vector<comm_group> out;
  for (group_kind kind : {group_kind::ulysses, group_kind::ring})
    for (int k = 0; k < s.cp(); ++k) {
      const int idx = mesh.group_index(kind, k);
      if (idx < 0) continue;
      comm_group g{group_name(kind, idx), mesh.group_of(kind, k)};
      bool seen = false;
      for (const auto& o : out) seen = seen || o.name == g.name;
      if (!seen) out.push_back(std::move(g));
    }
  return out;
}

}  // namespace

validate_report run_validate_mpi(const scenario& s, const validate_options& opt, bool* is_root) {
  // The same MPI start (and error handler, and finalize) as check --backend mpi.
  mpi::mpi_session session(nullptr, nullptr);
  const int rank = session.rank(), size = session.size();
  if (is_root) *is_root = rank == 0;
  check_inputs(s, opt.type);
  if (size != s.cp())
    fail<config_error>(
        "mpiexec started {} ranks but the scenario needs cp = ulysses·ring = {}·{} = "
        "{}; run mpiexec -n {}",
        size, s.ulysses, s.ring, s.cp(), s.cp());
  validate_report rep;
  rep.scen = s;
  rep.type = opt.type;
  rep.transport = fmt::format("nccl ({} processes, one GPU each)", size);
  const collated_batch cb = collate(make_batch(s), options_of(s));

  const int device = nccl_communicator::mpi_local_device();
  rep.device = device_name(device);
  auto t0 = std::chrono::steady_clock::now();
  const auto costs0 = setup_costs_so_far();
  capture got;
  {
    cuda_compute c(device, rank);
    c.set_attention_engine(validate_engine(opt.attention_engine));
    auto comm = nccl_communicator::from_mpi(
        device, c.stream(), opt.timeout.count() > 0 ? opt.timeout : std::chrono::seconds(60));
    const auto groups = attention_groups(s);
    comm->prepare_groups(groups);
    flight_recorder flight;
    comm->set_flight_recorder(&flight);
    try {
      run_rank(*comm, c, s, cb, opt.type, opt.type, got);
      c.synchronize();
    } catch (const std::exception& e) {
      // NCCL aborts every rank's communicators on an error or the deadline: each rank leaves
      // its own record.
      if (opt.flight_dir.empty()) throw;
      const int mine[] = {rank};
      const auto files = trace::write_flight_records(
          opt.flight_dir, flight, mine, {size, io::scenario_to_json(s), e.what(), -1, {}, {}});
      rethrow_with_note(std::current_exception(), flight_note(opt.flight_dir, files.size()));
    }
  }
  rep.gpu_seconds = seconds_since(t0);
  rep.setup = setup_costs_so_far().since(costs0);

  // Every rank's capture to rank 0 over the communicator (host buffers, MPI), padded to the
  // longest; rank 0 compares every rank with the reference, as the device-local run does.
  mpi::mpi_communicator world;
  comm_group all{"validate.world", {}};
  for (int r = 0; r < size; ++r) all.ranks.push_back(r);
  auto mine = pack(got);
  std::int64_t len = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lens(static_cast<std::size_t>(size));
  world.all_gather(all, &len, 1, lens.data(), dtype::i64, op_info{"validate.sizes", {}, {}});
  const auto longest = *std::max_element(lens.begin(), lens.end());
  mine.resize(static_cast<std::size_t>(longest), 0.0);
  std::vector<double> gathered(static_cast<std::size_t>(longest * size));
  world.all_gather(all, mine.data(), longest, gathered.data(), dtype::f64,
                   op_info{"validate.gather", {}, {}});

  std::int32_t verdict = 0;
  if (rank == 0) {
    t0 = std::chrono::steady_clock::now();
    const auto ref = run_reference(s, cb, opt.type);
    rep.reference_seconds = seconds_since(t0);
    validate_tolerances(s, opt.type, max_abs_lse(ref), rep);
    for (int r = 0; r < size; ++r)
      compare_rank(r, unpack(gathered.data() + r * longest), ref[static_cast<std::size_t>(r)], rep);
    rep.pass = std::all_of(rep.rows.begin(), rep.rows.end(), [](const auto& x) { return x.pass; });
    verdict = rep.pass ? 1 : 0;
  }
  // Every process learns rank 0's verdict (rank 0 contributes it, the others 0).
  world.all_reduce(all, &verdict, 1, dtype::i32, op_info{"validate.verdict", {}, {}});
  rep.pass = verdict == 1;
  return rep;
}
#else
validate_report run_validate_mpi(const scenario&, const validate_options&, bool* is_root) {
  if (is_root) *is_root = true;
  fail<config_error>(
      "this seqpar was built without MPI, so it cannot run one rank per GPU under mpiexec; run "
      "`seqpar validate` without mpiexec (all ranks on one GPU) or rebuild with -Dmpi=enabled");
}
#endif

}  // namespace seqpar::verify
