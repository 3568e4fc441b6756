#include "verify/check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>

#include "core/byte_pack.hpp"
#include "core/collate.hpp"
#include "core/error.hpp"
#include "core/flight_recorder.hpp"
#include "core/forwarding_compute.hpp"
#include "core/layout.hpp"
#include "core/mesh.hpp"
#include "core/thread_pool.hpp"
#include "core/timing.hpp"
#include "core/ulysses.hpp"
#include "io/scenario_json.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/inproc_comm.hpp"
#include "sim/isa.hpp"
#include "sim/model.hpp"
#include "sim/sp_setup.hpp"
#include "sim/tensor_step.hpp"
#include "trace/flight.hpp"
#include "verify/check_steps.hpp"

namespace seqpar::verify {

// The reference model, the Eigen compute backend and the in-process communicator.
using namespace seqpar::sim;

double tolerance_for(const scenario& s, dtype t, std::string* model) {
  if (t == dtype::f64) {
    if (model)
      *model =
          "float64: SP and non-SP differ only in summation order, so they agree to ~1e-10 "
          "relative";
    return 1e-10;
  }
  if (t == dtype::bf16) {
    // bfloat16 storage with float32 accumulation (the GPU's tensor step): every activation and
    // gradient the step stores is rounded to bfloat16, unit roundoff u = 2^-8, which dwarfs the
    // float32 sums' own error; each stage (2 per softmax layer, 2 for the head) can amplify the
    // error it receives by the conditioning of softmax and RMSNorm, taken as 8 as in float32's
    // model: tol = 8·u·stages.
    const double u = std::ldexp(1.0, -8);
    const int stages = 2 * s.layers + 2;
    const double tol = 8.0 * u * stages;
    if (model)
      *model = fmt::format(
          "bfloat16 storage, float32 accumulation, vs the float64 oracle: 8·u·(2·layers+2) with "
          "u = 2^-8 (every stored tensor rounded), {} stages → {:.2e}",
          stages, tol);
    return tol;
  }
  // float32 against the float64 oracle. Rounding errors of a length-K reduction grow like
  // sqrt(K)·eps (random-walk model), K = the longest reduction in the step (attention over a
  // document, or GatedDeltaNet's state accumulated over a document, hidden, intermediate,
  // vocabulary or q|k|v projection width); each residual sub-layer and the head
  // can amplify them by the conditioning of softmax and RMSNorm (taken as 8 per stage).
  const double eps = std::numeric_limits<float>::epsilon();
  std::int64_t k =
      std::max<std::int64_t>({s.hidden, s.intermediate, s.vocab, s.heads * s.head_dim});
  for (auto d : s.docs) k = std::max(k, d);  // softmax over a document; the delta-rule state
  if (s.has_linear_layers())                 // GatedDeltaNet's q|k|v projection width
    k = std::max<std::int64_t>(k, 2 * std::int64_t{s.linear_k_heads} * s.linear_k_dim +
                                      std::int64_t{s.linear_v_heads} * s.linear_v_dim);
  // A GatedDeltaNet layer counts 20 stages where a softmax layer counts 2. Its sub-layer has
  // five operations (convolution+SiLU, l2 normalisation of q and k over dk, the gates, the
  // delta-rule recurrence, the gated RMSNorm over dv); the two normalisations of short vectors
  // and the per-head parameters A_log and dt_bias, whose gradients are sums over every token
  // that largely cancel, make float32's error heavy-tailed on small models. The weight is
  // empirical: 3000 generated scenarios (tests/property, dk and dv in 8..16) stayed within
  // it; a weight of 12 was exceeded (by 1.05×) on generated scenarios with dk, dv ≥ 4.
  int stages = 2;
  for (int l = 0; l < s.layers; ++l) stages += s.layer_is_linear(l) ? 20 : 2;
  const double tol = 8.0 * eps * std::sqrt(static_cast<double>(k)) * stages;
  if (model && !s.has_linear_layers())
    *model = fmt::format(
        "float32 vs the float64 oracle: 8·eps·sqrt(K)·(2·layers+2) with eps = 2^-23, K = {} "
        "(longest reduction), {} stages → {:.2e}",
        k, stages, tol);
  else if (model)
    *model = fmt::format(
        "float32 vs the float64 oracle: 8·eps·sqrt(K)·stages with eps = 2^-23, K = {} "
        "(longest reduction), {} stages (2 per softmax layer, 20 per GatedDeltaNet layer, 2 for "
        "the head) → {:.2e}",
        k, stages, tol);
  return tol;
}

/// The reference's parameters: the same float64 values, as plain named matrices.
ref::weights as_reference_weights(const model_params<double>& p) {
  ref::weights w;
  w.names = p.names;
  w.values.assign(p.values.begin(), p.values.end());
  return w;
}

ref::batch reference_batch(const scenario& s, const packed_batch& b) {
  ref::batch rb;
  rb.input_ids = b.input_ids;
  rb.labels = b.labels;
  // The shift VeOmni's collator and DeepSpeed's adapter apply to the whole row (xorl's labels
  // come shifted per document).
  if (shifts_whole_row(s.profile) && !rb.labels.empty()) {
    std::rotate(rb.labels.begin(), rb.labels.begin() + 1, rb.labels.end());
    rb.labels.back() = ignore_index;
  }
  rb.position_ids = b.position_ids;
  return rb;
}

ring_step_layout ring_step_layout_of(const scenario& s, const ref::batch& rb,
                                     const collated_batch& cb, const ref::weights& w) {
  ring_step_layout g;
  g.scen = s;
  g.sinks.resize(static_cast<std::size_t>(s.layers));
  for (int l = 0; l < s.layers; ++l)
    if (!s.layer_is_linear(l) && s.attention_of(l).sinks) {
      const auto& row = w.at(fmt::format("L{}.sinks", l));
      g.sinks[static_cast<std::size_t>(l)].assign(row.data(), row.data() + row.size());
    }
  g.row_length = cb.original_length;
  g.doc_of.assign(static_cast<std::size_t>(cb.original_length), 0);
  std::int64_t doc = 0;
  for (const auto& [b, e] : ref::documents(rb.position_ids)) {
    for (auto t = b; t < e && t < cb.original_length; ++t)
      g.doc_of[static_cast<std::size_t>(t)] = doc;
    ++doc;
  }
  g.ring_rows = [&cb](int rr) { return ring_rank_tokens(cb, rr); };
  return g;
}

reference_inputs reference_inputs_of(const scenario& s) {
  validate(s);
  reference_inputs in;
  in.weights = as_reference_weights(model_params<double>::init(s));
  in.batch = reference_batch(s, make_batch(s));
  return in;
}

namespace {

compared_tensor compare(std::string name, const std::vector<double>& got,
                        const std::vector<double>& want, double tol, double floor = 0) {
  return compare_values(std::move(name), got, want, tol, floor);
}

template <class M>
std::vector<double> values_of(const M& m) {
  std::vector<double> v(static_cast<std::size_t>(m.size()));
  using row_major = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<row_major>(v.data(), m.rows(), m.cols()) = m.template cast<double>();
  return v;
}

/// A row-major matrix's values as float64: its own storage for double, else converted into
/// `scratch`.
template <class T>
std::span<const double> as_doubles(const mat<T>& m, std::vector<double>& scratch) {
  if constexpr (std::is_same_v<T, double>) {
    return {m.data(), static_cast<std::size_t>(m.size())};
  } else {
    scratch.assign(m.data(), m.data() + m.size());
    return scratch;
  }
}

/// Whether two matrices have the same shape and the same bits.
template <class T>
bool same_bits(const mat<T>& a, const mat<T>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), sizeof(T) * static_cast<std::size_t>(a.size())) == 0);
}

/// Rows of per-rank matrices placed at their global token index, real tokens only.
template <class T>
std::vector<double> gather_tokens(const collated_batch& cb, const std::vector<mat<T>>& per_rank) {
  const auto L = cb.original_length;
  const auto cols = per_rank.front().cols();
  std::vector<double> out(static_cast<std::size_t>(L * cols),
                          std::numeric_limits<double>::quiet_NaN());
  for (std::size_t k = 0; k < per_rank.size(); ++k) {
    const auto tokens = rank_tokens(cb, static_cast<int>(k));
    for (std::size_t j = 0; j < tokens.size(); ++j) {
      if (tokens[j] >= L) continue;
      for (Eigen::Index c = 0; c < cols; ++c)
        out[static_cast<std::size_t>(tokens[j] * cols + c)] =
            static_cast<double>(per_rank[k](static_cast<Eigen::Index>(j), c));
    }
  }
  return out;
}

/// A tensor [rows, …] as float64 rows [rows, the rest].
Eigen::MatrixXd host_rows(compute& c, const tensor& x) {
  const auto values = c.to_host(x);
  const auto rows = x.shape.empty() ? Eigen::Index{0} : static_cast<Eigen::Index>(x.shape[0]);
  const auto cols = rows > 0 ? static_cast<Eigen::Index>(values.size()) / rows : Eigen::Index{0};
  using row_major = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  return Eigen::Map<const row_major>(values.data(), rows, cols);
}

}  // namespace

/// The non-SP step: the independent oracle (sim/reference.hpp) on the unpadded row, as training
/// without SP sees it. It shares no code with the SP step; the two meet only in add_rows.
step_output<double> run_reference(const scenario& s, const packed_batch& b,
                                  const model_params<double>& p, int threads) {
  const auto r = ref::train_step(s, as_reference_weights(p), reference_batch(s, b), threads);
  step_output<double> out;
  out.loss = r.loss;
  out.valid_tokens = r.valid_tokens;
  out.logits = r.logits;
  out.embed_out_grad = r.embed_out_grad;
  out.grads = p.zeros_like();
  for (std::size_t i = 0; i < p.names.size(); ++i) out.grads.values[i] = r.grads.at(p.names[i]);
  return out;
}

/// The SP step of cp rank comm.rank() (the fault wrapper, the seams and the recorder as the
/// options say).
template <class T>
step_output<T> sp_rank_step(communicator& comm, const scenario& s, const collated_batch& cb,
                            const model_params<T>& p, const check_options& opt,
                            int attention_workers, compute* backend) {
  const int k = comm.rank();
  std::optional<faulty_communicator> faulty;
  communicator* link = &comm;
  if (opt.fault.kind != fault_kind::none) link = &faulty.emplace(comm, opt.fault);
  std::unique_ptr<communicator> wrapped;
  if (opt.wrap_communicator) link = (wrapped = opt.wrap_communicator(*link)).get();
  std::unique_ptr<communicator> captured;
  if (opt.capture) link = (captured = capturing_communicator(*link, *opt.capture, backend)).get();
  if (opt.recorder) link->set_recorder(opt.recorder);
  std::unique_ptr<compute> comp;
  if (backend != nullptr)
    comp = std::make_unique<forwarding_compute>(*backend);
  else
    comp = std::make_unique<eigen_compute>(opt.naive_attention, attention_workers);
  if (opt.wrap_compute) comp = opt.wrap_compute(std::move(comp), *link);
  sp_env env = cp_rank_env(*link, *comp, s, cb);
  if (env.ring && opt.ring_counts) {  // the ring rebuilt with the tally
    env.ring->counts = opt.ring_counts;
    env.make_inner = [link, rs = *env.ring](compute& c, const layer_attention& la) {
      return make_ring_attention(*link, c, rs, la);
    };
  }
  if (opt.layers) {
    env.tap_layer = [&opt, k](int layer, const std::string& stage, const Eigen::MatrixXd& rows) {
      opt.layers->add(k, layer, stage, rows);
    };
    // A p2p ring: each step's partial output and LSE too (the ring rebuilt with a tap).
    if (env.ring && env.ring->forward == ring_forward_kind::p2p)
      env.make_inner = [&opt, k, link, rs = *env.ring](compute& c, const layer_attention& la) {
        auto tapped = rs;
        tapped.tap_step = [&opt, k, &c](const std::string& tag, int step, int, const tensor& out,
                                        const tensor& lse) {
          const int layer = layer_of_call(tag);
          if (layer < 0) return;
          opt.layers->add(k, layer, fmt::format("ring_out.step{}", step), host_rows(c, out));
          opt.layers->add(k, layer, fmt::format("ring_lse.step{}", step), host_rows(c, lse));
        };
        // … and each step's own dQ, dK, dV contributions in the backward.
        tapped.tap_step_backward = [&opt, k, &c](const std::string& tag, int step, int,
                                                 const tensor& dq, const tensor& dk,
                                                 const tensor& dv) {
          const int layer = layer_of_call(tag);
          if (layer < 0) return;
          opt.layers->add(k, layer, fmt::format("ring_dq.step{}", step), host_rows(c, dq));
          opt.layers->add(k, layer, fmt::format("ring_dk.step{}", step), host_rows(c, dk));
          opt.layers->add(k, layer, fmt::format("ring_dv.step{}", step), host_rows(c, dv));
        };
        return make_ring_attention(*link, c, tapped, la);
      };
  }
  if (opt.attention) {
    auto make = env.make_inner;
    env.make_inner = [&opt, k, make](compute& c, const layer_attention& la) {
      return opt.attention->wrap(k, c, make(c, la));
    };
    env.tap_attention = [&opt, k, &comp](const std::string& call, const std::string& stage,
                                         const tensor& x) {
      opt.attention->tap(k, call, stage, *comp, x);
    };
  }
  if (opt.tensor_step) return tensor_train_step(p, s, rank_input(s, cb, k), env, opt.type);
  return train_step(p, s, rank_input(s, cb, k), env);
}

void rethrow_with_note(std::exception_ptr e, const std::string& note) {
  try {
    std::rethrow_exception(e);
  } catch (const shape_error& x) {
    throw shape_error(x.what() + note);
  } catch (const config_error& x) {
    throw config_error(x.what() + note);
  } catch (const layout_error& x) {
    throw layout_error(x.what() + note);
  } catch (const trace_error& x) {
    throw trace_error(x.what() + note);
  } catch (const std::exception& x) {
    throw error(x.what() + note);
  }
}

std::string flight_note(const std::string& dir, std::size_t files) {
  if (files == 0) return fmt::format(" (no flight record could be written to {})", dir);
  return fmt::format(
      ". Flight records of {} rank(s) (their last calls) are in {}/: `seqpar replay {}` names "
      "the rank that diverged or never arrived",
      files, dir, dir);
}

namespace {

/// Below this many token·hidden·layer units a step's ranks exchange far more often than they
/// compute: one carrier runs them fastest (no hand-off between threads at all). Measured with
/// bench/reference_bench --whole-check and bench/property_bench.
constexpr double small_step_units = 1 << 15;

/// The threads that carry the SP ranks: rank_threads, else threads, else every core (one for a
/// small step).
int core_count() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

int rank_carriers(const scenario& s, const check_options& opt) {
  if (opt.rank_threads > 0) return opt.rank_threads;
  if (opt.threads > 0) return opt.threads;
  const double units = static_cast<double>(s.total_tokens()) * s.hidden * s.layers;
  if (units < small_step_units) return 1;
  return core_count();
}

template <class T>
std::vector<step_output<T>> run_sp(const scenario& s, const collated_batch& cb,
                                   const model_params<T>& p, const check_options& opt) {
  std::vector<step_output<T>> outs(static_cast<std::size_t>(s.cp()));
  if (opt.rank_world) {  // another backend's ranks (its own watchdog and failure handling)
    opt.rank_world(s.cp(), [&](communicator& comm, compute& c) {
      outs[static_cast<std::size_t>(comm.rank())] = sp_rank_step(comm, s, cb, p, opt, 1, &c);
    });
    return outs;
  }
  inproc_world world(s.cp());
  if (opt.timeout.count() > 0) world.set_timeout(opt.timeout);
  const int carriers = rank_carriers(s, opt);
  world.set_carriers(carriers);
  // Ranks on threads of their own with cores to spare: each rank's attention takes a share of
  // them (its work items are fixed by the sizes, so the result does not change).
  const int attention_workers = carriers >= 2 * s.cp() ? carriers / s.cp() : 1;
  flight_recorder flight;
  // After a watchdog abort, a stalled rank that wakes up must not appear to have made the call
  // it missed; after an error, ranks still arriving at the call are victims and are recorded.
  std::vector<int> all_ranks(static_cast<std::size_t>(s.cp()));
  std::iota(all_ranks.begin(), all_ranks.end(), 0);
  const trace::flight_on_signal on_signal(
      flight, all_ranks, {s.cp(), io::scenario_to_json(s), {}, -1, {}, {}}, opt.flight_dir);
  world.set_abort_hook([&flight](int, const std::string& message) {
    if (message.starts_with("watchdog")) flight.freeze();
  });
  try {
    run_ranks(world, [&](communicator& comm) {
      comm.set_flight_recorder(&flight);
      outs[static_cast<std::size_t>(comm.rank())] =
          sp_rank_step(comm, s, cb, p, opt, attention_workers);
    });
  } catch (const std::exception& e) {
    if (opt.flight_dir.empty()) throw;
    // The rank whose own error ended the run; none when the watchdog did (the waiter that
    // fired is not the culprit: the records name the rank that never arrived).
    const int failed = world.abort_message().starts_with("watchdog") ? -1 : world.failed_rank();
    const auto files =
        trace::write_flight_records(opt.flight_dir, flight, all_ranks,
                                    {s.cp(), io::scenario_to_json(s), e.what(), failed, {}, {}});
    rethrow_with_note(std::current_exception(), flight_note(opt.flight_dir, files.size()));
  }
  return outs;
}

/// One scenario's two steps: the non-SP reference and the SP step.
template <class T>
struct both_steps {
  step_output<double> ref;
  std::vector<step_output<T>> outs;
  double reference_seconds = 0, sp_seconds = 0;
};

/// Progress: `starting_reference(beside)` and `starting_sp()` are called as each step starts.
struct step_announcer {
  std::function<void(bool beside)> starting_reference;
  std::function<void()> starting_sp;
};

/// Runs the reference and the SP step of `s`. When neither thread count is given and the SP
/// ranks leave cores idle (a small step runs on one carrier), the oracle runs meanwhile on a
/// pool thread with the idle cores as its workers: the two steps share nothing but their
/// read-only inputs, and each result is the same bits as when they run one after the other
/// (the comparison starts once both are done). Otherwise the reference runs first, on
/// opt.threads workers. An error of the reference is reported before one of the SP step, as
/// when they run in turn.
template <class T>
both_steps<T> run_both(const scenario& s, const packed_batch& b, const collated_batch& cb,
                       const model_params<double>& p64, const model_params<T>& p,
                       const check_options& opt, const step_announcer& announce = {}) {
  both_steps<T> r;
  const int idle = core_count() - rank_carriers(s, opt);
  const bool beside = opt.threads == 0 && opt.rank_threads == 0 && idle >= 1;
  if (announce.starting_reference) announce.starting_reference(beside);
  auto reference = [&](int threads) {
    const auto t0 = std::chrono::steady_clock::now();
    r.ref = run_reference(s, b, p64, threads);
    r.reference_seconds = seconds_since(t0);
  };
  auto sp = [&] {
    if (announce.starting_sp) announce.starting_sp();
    const auto t0 = std::chrono::steady_clock::now();
    r.outs = run_sp<T>(s, cb, p, opt);
    r.sp_seconds = seconds_since(t0);
  };
  if (!beside) {
    reference(opt.threads);
    sp();
    return r;
  }
  std::exception_ptr ref_error;
  const std::function<void(int)> side_job = [&](int) {
    try {
      reference(idle);
    } catch (...) {
      ref_error = std::current_exception();
    }
  };
  auto side = thread_pool::shared().start(1, side_job);
  if (side.started() < 1) {  // no thread to be had: in turn
    side.wait();
    reference(opt.threads);
    sp();
    return r;
  }
  std::exception_ptr sp_error;
  try {
    sp();
  } catch (...) {
    sp_error = std::current_exception();
  }
  side.wait();
  if (ref_error) std::rethrow_exception(ref_error);
  if (sp_error) std::rethrow_exception(sp_error);
  return r;
}

/// Layout invariants of the collated batch the SP run used.
std::vector<compared_tensor> layout_rows(const scenario& s, const collated_batch& cb) {
  std::vector<compared_tensor> rows;
  compared_tensor held;
  held.tensor = "layout.tokens_held_once";
  held.numel = cb.padded_length;
  std::vector<int> seen(static_cast<std::size_t>(cb.padded_length), 0);
  for (int k = 0; k < static_cast<int>(cb.ranks.size()); ++k)
    for (auto t : rank_tokens(cb, k)) ++seen[static_cast<std::size_t>(t)];
  std::int64_t bad = 0;
  for (int c : seen) bad += c != 1;
  held.max_abs = held.max_rel = static_cast<double>(bad);
  held.pass = bad == 0;
  if (bad) held.note = fmt::format("{} padded tokens held by no rank or by several", bad);
  rows.push_back(held);

  // Attention coverage: tokens of the gathered sequence outside every document. xorl with
  // ring > 1 leaves the SP padding uncovered by design (collate warns); elsewhere none.
  const auto& cu = cb.ranks.front().cu_seqlens;
  const std::int64_t uncovered = cb.padded_length - (cu.back() - cu.front());
  const std::int64_t expected =
      s.profile == profile::xorl && s.ring > 1 ? cb.padded_length - cb.original_length : 0;
  compared_tensor cov;
  cov.tensor = "layout.uncovered_tokens";
  cov.numel = cb.padded_length;
  cov.max_abs = cov.max_rel = static_cast<double>(std::abs(uncovered - expected));
  cov.pass = uncovered == expected;
  cov.note = fmt::format("{} tokens outside cu_seqlens, expected {}", uncovered, expected);
  rows.push_back(cov);
  return rows;
}

/// A failing row's error map: got and want row-major [rows × cols], the error over the row's
/// normwise bound (tol · max(max|want|, floor)); tokens along the columns where the rows are
/// tokens (transpose), the document boundaries (`docs`, in the columns' units) drawn.
error_heatmap error_map(std::string title, std::span<const double> got,
                        std::span<const double> want, std::int64_t rows, std::int64_t cols,
                        double tol, double floor, bool rows_are_tokens, std::string row_label,
                        std::string col_label) {
  double scale = floor;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  const double bound = tol * std::max(scale, 1e-300);
  error_heatmap m(std::move(title), rows_are_tokens ? "token" : col_label,
                  rows_are_tokens ? rows : cols, rows_are_tokens ? col_label : row_label,
                  rows_are_tokens ? cols : rows);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const auto i = static_cast<std::size_t>(r * cols + c);
      const double d = got[i] == want[i] ? 0.0 : std::abs(got[i] - want[i]);
      const double e = std::isnan(d) ? INFINITY : d / bound;
      if (rows_are_tokens)
        m.add(r, c, e);
      else
        m.add(c, r, e);
    }
  return m;
}

}  // namespace

/// The document boundaries of the unpadded row (the reference's token order).
std::vector<double> doc_bounds(const scenario& s) {
  std::vector<double> b{0};
  for (auto d : s.docs) b.push_back(b.back() + static_cast<double>(d));
  return b;
}

namespace {

/// Head edges along a projection's heads·head_dim axis (q, k, v, gate: the out features; o:
/// the in features).
std::vector<double> head_edges(const scenario& s, std::int64_t extent) {
  std::vector<double> e;
  if (s.head_dim <= 0 || extent % s.head_dim != 0) return e;
  for (std::int64_t x = s.head_dim; x < extent; x += s.head_dim)
    e.push_back(static_cast<double>(x));
  return e;
}

}  // namespace

/// The compared rows of a check, from the reference step and every cp rank's SP step (in cp
/// rank order): shared by the in-process and the distributed checks, so both report the same.
template <class T>
void add_rows(check_report& rep, const scenario& s, const collated_batch& cb,
              const step_output<double>& ref, const std::vector<step_output<T>>& outs) {
  const double tol = rep.tolerance;
  double worst_loss = 0;
  for (const auto& o : outs) worst_loss = std::max(worst_loss, std::abs(o.loss - ref.loss));
  compared_tensor loss = compare("loss", {ref.loss + worst_loss}, {ref.loss}, tol);
  loss.note = fmt::format("reference {:.12g} over {} valid tokens", ref.loss, ref.valid_tokens);
  if (outs.front().valid_tokens != ref.valid_tokens) {
    loss.pass = false;
    loss.note = fmt::format("SP counted {} valid tokens, reference {}", outs.front().valid_tokens,
                            ref.valid_tokens);
  }
  rep.rows.push_back(loss);

  std::vector<mat<T>> logits, embed;
  for (const auto& o : outs) {
    logits.push_back(o.logits);
    embed.push_back(o.embed_out_grad);
  }
  {
    const auto got_logits = gather_tokens(cb, logits), want_logits = values_of(ref.logits);
    rep.rows.push_back(compare("logits", got_logits, want_logits, tol));
    if (!rep.rows.back().pass && got_logits.size() == want_logits.size()) {
      rep.heatmaps.push_back(error_map("logits — error over tokens × vocabulary", got_logits,
                                       want_logits, ref.logits.rows(), ref.logits.cols(), tol, 0,
                                       true, "token", "vocab"));
      rep.heatmaps.back().solid = doc_bounds(s);
    }
    const auto got_embed = gather_tokens(cb, embed), want_embed = values_of(ref.embed_out_grad);
    rep.rows.push_back(compare("embedding.output.grad", got_embed, want_embed, tol));
    if (!rep.rows.back().pass && got_embed.size() == want_embed.size()) {
      rep.heatmaps.push_back(error_map("embedding.output.grad — error over tokens × hidden",
                                       got_embed, want_embed, ref.embed_out_grad.rows(),
                                       ref.embed_out_grad.cols(), tol, 0, true, "token", "hidden"));
      rep.heatmaps.back().solid = doc_bounds(s);
    }
  }
  // Parameter gradients far below the largest one are judged against a floor (gradient_floor).
  double grad_scale = 0;
  for (const auto& g : ref.grads.values)
    grad_scale = std::max(grad_scale, static_cast<double>(g.cwiseAbs().maxCoeff()));
  const auto floor_of = [&](const std::string& name) { return gradient_floor(name, grad_scale); };
  std::vector<double> scratch;
  for (std::size_t i = 0; i < ref.grads.values.size(); ++i) {
    compared_tensor worst;
    const auto& want = ref.grads.values[i];
    for (std::size_t k = 0; k < outs.size(); ++k) {
      // After the gradient sync the ranks usually hold the same bits: a rank whose gradient
      // is rank 0's, bit for bit, compares as rank 0 did and cannot change the row.
      const auto& got = outs[k].grads.values[i];
      if (k > 0 && same_bits(got, outs.front().grads.values[i])) continue;
      auto c = compare_values("grad." + ref.grads.names[i], as_doubles(got, scratch),
                              {want.data(), static_cast<std::size_t>(want.size())}, tol,
                              floor_of(ref.grads.names[i]));
      if (k == 0 || c.max_rel > worst.max_rel || !c.pass) {
        c.rank = static_cast<int>(k);
        if (!c.pass) c.note = fmt::format("worst on cp rank {}: {}", k, c.note);
        if (k == 0 || worst.pass) worst = c;
      }
    }
    rep.rows.push_back(worst);
    if (!worst.pass && worst.rank >= 0) {
      const auto& got = outs[static_cast<std::size_t>(worst.rank)].grads.values[i];
      const auto& name = ref.grads.names[i];
      if (got.size() == want.size()) {
        auto m = error_map(
            fmt::format("grad.{} on cp rank {} — error over in × out features", name, worst.rank),
            as_doubles(got, scratch), {want.data(), static_cast<std::size_t>(want.size())},
            want.rows(), want.cols(), tol, floor_of(name), false, "in", "out");
        // Heads along the projections' heads·head_dim axis: out for q, k, v, gate; in for o.
        if (name.ends_with(".wo"))
          m.row_lines = head_edges(s, want.rows());
        else if (name.ends_with(".wq") || name.ends_with(".wk") || name.ends_with(".wv") ||
                 name.ends_with(".wg"))
          m.dotted = head_edges(s, want.cols());
        rep.heatmaps.push_back(std::move(m));
      }
    }
  }
  for (auto& r : layout_rows(s, cb)) rep.rows.push_back(std::move(r));
  rep.pass = std::all_of(rep.rows.begin(), rep.rows.end(), [](const auto& r) { return r.pass; });
}

std::string reproduce_command(const check_report& r) {
  std::string cmd = io::scenario_command(r.scen);
  if (r.type != dtype::f64) cmd += r.type == dtype::f32 ? " --dtype f32" : " --dtype bf16";
  if (r.backend == "gpu") cmd += " --backend gpu";
  return cmd;
}

double gradient_floor(const std::string& name, double grad_scale) {
  // GatedDeltaNet's A_log and dt_bias hold one value per head whose gradient sums every
  // token's gate derivative, terms of both signs that largely cancel: rounding is relative to
  // the terms, not to the sum, so those rows are judged against 1e-2 of the largest gradient.
  // So is gpt-oss's sink logit, one per head: its gradient −Σ_rows p_sink·(pᵀdp) sums every
  // query row's term, of both signs (a float32 step at 1e-3 failed at 1.41 of its bound on
  // a gradient of 1.2e-4 against a largest of 0.26, every stage of the step matching).
  const bool per_head_sum =
      name.ends_with(".A_log") || name.ends_with(".dt_bias") || name.ends_with(".sinks");
  return (per_head_sum ? 1e-2 : 1e-3) * grad_scale;
}

/// DeepSpeed ALST's claim (seed 001): SP over DP — U micro-steps, micro-step i running SP rank
/// i's sample on all U ranks, gradients accumulated over the micro-steps — equals DP over the
/// same U samples, one per rank, gradients averaged. Both sides are token-normalised per sample
/// (each micro-step's loss is its sample's mean over valid tokens), so they agree for any token
/// budgets. Micro-step `s.micro_step` reuses the step the main rows compared.
/// Whether a check of `s` adds the SP-over-DP rows.
bool wants_sp_over_dp(const scenario& s, const check_options& opt) {
  return s.profile == profile::deepspeed && opt.sp_over_dp && !opt.recorder && s.ulysses > 1;
}

template <class T>
void add_sp_over_dp_rows(check_report& rep, const scenario& s, const check_options& opt,
                         const model_params<double>& p64, const step_output<double>& ref_here,
                         const std::vector<step_output<T>>& outs_here,
                         const std::function<micro_result<T>(const scenario& sm)>& micro) {
  const double inv = 1.0 / s.ulysses;
  double dp_loss = 0, sp_loss = 0;
  std::vector<std::vector<double>> dp_grads(p64.size()), sp_grads(p64.size());
  std::vector<int> worst_rank(p64.size(), 0);
  auto accumulate = [&](const step_output<double>& ref, const std::vector<step_output<T>>& outs) {
    dp_loss += inv * ref.loss;
    sp_loss += inv * outs.front().loss;
    for (std::size_t i = 0; i < p64.size(); ++i) {
      auto add = [&](std::vector<double>& acc, const std::vector<double>& v) {
        if (acc.empty()) acc.assign(v.size(), 0.0);
        for (std::size_t e = 0; e < v.size(); ++e) acc[e] += inv * v[e];
      };
      add(dp_grads[i], values_of(ref.grads.values[i]));
      // Every rank holds the same gradient after the sync; rank 0's is accumulated and the
      // others are held to it by the main rows of each micro-step.
      add(sp_grads[i], values_of(outs.front().grads.values[i]));
    }
  };
  for (int m = 0; m < s.ulysses; ++m) {
    if (m == s.micro_step) {
      accumulate(ref_here, outs_here);
      continue;
    }
    scenario sm = s;
    sm.micro_step = m;
    if (opt.progress)
      opt.progress(fmt::format("SP over DP: micro-step {} of {} (SP rank {}'s sample)", m + 1,
                               s.ulysses, m));
    const auto r = micro(sm);
    accumulate(r.ref, r.outs);
  }
  const double tol = rep.tolerance;
  auto loss = compare("sp_over_dp.loss", {sp_loss}, {dp_loss}, tol);
  loss.note =
      fmt::format("mean over {} micro-steps vs DP over the same {} samples, reference {:.12g}",
                  s.ulysses, s.ulysses, dp_loss);
  rep.rows.push_back(loss);
  double grad_scale = 0;
  for (const auto& g : dp_grads)
    for (double v : g) grad_scale = std::max(grad_scale, std::abs(v));
  for (std::size_t i = 0; i < p64.size(); ++i)
    rep.rows.push_back(compare("sp_over_dp.grad." + p64.names[i], sp_grads[i], dp_grads[i], tol,
                               gradient_floor(p64.names[i], grad_scale)));
  rep.pass = std::all_of(rep.rows.begin(), rep.rows.end(), [](const auto& r) { return r.pass; });
}

/// What every check starts from (check_steps.hpp).
check_run::check_run(const scenario& s, const check_options& opt)
    : batch(make_batch(s)), cb(collate(batch, options_of(s))), p64(model_params<double>::init(s)) {
  rep.scen = s;
  rep.type = opt.type;
  rep.isa = sim::cpu_isa();
  rep.tolerance = tolerance_for(s, opt.type, &rep.error_model);
  if (opt.transform_collated) opt.transform_collated(cb);
  rep.warnings = cb.warnings;
}

namespace {

/// Reruns the SP step with everything recorded and names where it first departs (the SP step
/// is deterministic: the same faults and seams hit the same calls).
template <class T>
void find_departure(check_report& rep, const scenario& s, const packed_batch& batch,
                    const collated_batch& cb, const model_params<double>& p64,
                    const model_params<T>& p, const check_options& opt) {
  step_record rec(s, cb, opt.type);
  try {
    run_sp<T>(s, cb, p, rec.recording(opt));
  } catch (const std::exception& e) {
    rep.departure =
        fmt::format("the SP step's rerun with its collectives captured failed: {}", e.what());
    return;
  }
  judge_departure(rep, s, batch, cb, p64, opt, rec.log.calls(), rec);
}

template <class T>
check_report run_typed(const scenario& s, const check_options& opt) {
  auto t0 = std::chrono::steady_clock::now();
  check_run run(s, opt);
  // Named references, not a structured binding: lambdas below capture them (clang before 16
  // cannot capture structured bindings).
  auto& rep = run.rep;
  auto& batch = run.batch;
  auto& cb = run.cb;
  auto& p64 = run.p64;
  auto say = [&](std::string_view line) {
    if (opt.progress) opt.progress(line);
  };

  std::optional<model_params<T>> cast_store;
  const auto& p = params_as<T>(p64, cast_store);
  rep.setup_seconds = seconds_since(t0);
  step_announcer announce;
  announce.starting_reference = [&](bool beside) {
    say(fmt::format("non-SP reference: {} tokens on one rank (float64{})", cb.original_length,
                    beside ? ", beside the SP step" : ""));
  };
  announce.starting_sp = [&] {
    say(fmt::format("SP step: {} ranks (ulysses {} × ring {}), {} tokens each ({})", s.cp(),
                    s.ulysses, s.ring, cb.chunk, dtype_name(opt.type)));
  };
  check_options tallied = opt;
  tallied.ring_counts = std::make_shared<ring_step_counts>();
  const auto both = run_both<T>(s, batch, cb, p64, p, tallied, announce);
  rep.reference_seconds = both.reference_seconds;
  rep.sp_seconds = both.sp_seconds;
  if (s.ring > 1 && s.ring_forward == "p2p")
    rep.ring_steps = ring_step_totals{tallied.ring_counts->computed.load(),
                                      tallied.ring_counts->skipped_mask.load(),
                                      tallied.ring_counts->skipped_layout.load()};

  t0 = std::chrono::steady_clock::now();
  double micro_seconds = 0;  // the further micro-steps' own steps, counted as sp and reference
  add_rows(rep, s, cb, both.ref, both.outs);
  if (wants_sp_over_dp(s, opt))
    add_sp_over_dp_rows<T>(rep, s, opt, p64, both.ref, both.outs, [&](const scenario& sm) {
      const auto t1 = std::chrono::steady_clock::now();
      const auto b = make_batch(sm);
      auto c = collate(b, options_of(sm));
      if (opt.transform_collated) opt.transform_collated(c);
      auto m = run_both<T>(sm, b, c, p64, p, opt);
      rep.reference_seconds += m.reference_seconds;
      rep.sp_seconds += m.sp_seconds;
      micro_seconds += seconds_since(t1);
      return micro_result<T>{std::move(m.ref), std::move(m.outs)};
    });
  rep.compare_seconds = std::max(0.0, seconds_since(t0) - micro_seconds);
  if (!rep.pass && opt.find_departure) {
    say("first departure: the SP step again, every collective captured with its data");
    find_departure<T>(rep, s, batch, cb, p64, p, opt);
  }
  return rep;
}

}  // namespace

template step_output<double> sp_rank_step<double>(communicator&, const scenario&,
                                                  const collated_batch&,
                                                  const model_params<double>&, const check_options&,
                                                  int, compute*);
template step_output<float> sp_rank_step<float>(communicator&, const scenario&,
                                                const collated_batch&, const model_params<float>&,
                                                const check_options&, int, compute*);
template void add_rows<double>(check_report&, const scenario&, const collated_batch&,
                               const step_output<double>&, const std::vector<step_output<double>>&);
template void add_rows<float>(check_report&, const scenario&, const collated_batch&,
                              const step_output<double>&, const std::vector<step_output<float>>&);
template void add_sp_over_dp_rows<double>(
    check_report&, const scenario&, const check_options&, const model_params<double>&,
    const step_output<double>&, const std::vector<step_output<double>>&,
    const std::function<micro_result<double>(const scenario&)>&);
template void add_sp_over_dp_rows<float>(
    check_report&, const scenario&, const check_options&, const model_params<double>&,
    const step_output<double>&, const std::vector<step_output<float>>&,
    const std::function<micro_result<float>(const scenario&)>&);

check_report run_check(const scenario& s, const check_options& opt) {
  validate(s);
  if (opt.tensor_step)
    if (const auto why = tensor_step_unsupported(s, resolve_ulysses_strategy(s).async);
        !why.empty())
      fail<config_error>("{} cannot run this scenario: {}",
                         opt.rank_world ? "the GPU backend" : "the tensor step", why);
  if (opt.type == dtype::f64) return run_typed<double>(s, opt);
  if (opt.type == dtype::f32) return run_typed<float>(s, opt);
  // bfloat16 storage: a backend with its kernels (the GPU), outputs widened to float.
  if (opt.type == dtype::bf16 && opt.tensor_step && opt.rank_world) return run_typed<float>(s, opt);
  fail<config_error>(
      "the CPU backends run the SP step in float64 or float32, not {}; use --dtype f64|f32, or "
      "--backend gpu for bf16",
      dtype_name(opt.type));
}

}  // namespace seqpar::verify
