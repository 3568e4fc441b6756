#include <fmt/format.h>

#include <chrono>
#include <map>
#include <optional>
#include <vector>

#include "core/byte_pack.hpp"
#include "core/collate.hpp"
#include "core/error.hpp"
#include "core/timing.hpp"
#include "verify/check_steps.hpp"

// The distributed check: one cp rank per process (MPI), each running its own rank's SP step;
// rank 0 gathers every output, runs the reference and builds the same rows as the in-process
// check (check.cpp), and a failing step's records are judged there (departure.cpp).

namespace seqpar::verify {

using namespace seqpar::sim;

namespace {

/// One rank's step output as float64 values (exact for f32 and f64):
/// [loss, valid_tokens, logits rows, logits cols, embed rows, embed cols, logits…, embed…,
/// every gradient…] — the same length on every rank (all hold cb.chunk tokens).
template <class T>
std::vector<double> pack(const step_output<T>& o) {
  std::vector<double> v = {o.loss,
                           static_cast<double>(o.valid_tokens),
                           static_cast<double>(o.logits.rows()),
                           static_cast<double>(o.logits.cols()),
                           static_cast<double>(o.embed_out_grad.rows()),
                           static_cast<double>(o.embed_out_grad.cols())};
  auto put = [&v](const mat<T>& m) {
    for (Eigen::Index i = 0; i < m.size(); ++i) v.push_back(static_cast<double>(m.data()[i]));
  };
  put(o.logits);
  put(o.embed_out_grad);
  for (const auto& g : o.grads.values) put(g);
  return v;
}

/// The inverse of pack; `like` gives the gradient names and shapes.
template <class T>
step_output<T> unpack(const double* v, const model_params<T>& like) {
  step_output<T> o;
  o.loss = v[0];
  o.valid_tokens = static_cast<std::int64_t>(v[1]);
  std::size_t at = 6;
  auto take = [&](mat<T>& m, Eigen::Index rows, Eigen::Index cols) {
    m.resize(rows, cols);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(v[at++]);
  };
  take(o.logits, static_cast<Eigen::Index>(v[2]), static_cast<Eigen::Index>(v[3]));
  take(o.embed_out_grad, static_cast<Eigen::Index>(v[4]), static_cast<Eigen::Index>(v[5]));
  o.grads = like.zeros_like();
  for (auto& g : o.grads.values) take(g, g.rows(), g.cols());
  return o;
}

template <class T>
check_report run_distributed_typed(communicator& world, const scenario& s,
                                   const check_options& opt) {
  const int P = world.world_size(), me = world.rank();
  if (P != s.cp())
    fail<config_error>(
        "the distributed check runs one cp rank per process: {} processes for ulysses={} × "
        "ring={} = {} cp ranks; launch mpiexec -n {}",
        P, s.ulysses, s.ring, s.cp(), s.cp());
  // Every process collates the same batch (deterministic) and keeps its own rank's tokens.
  auto t0 = std::chrono::steady_clock::now();
  check_run run(s, opt);
  auto& rep = run.rep;  // named references: lambdas below capture them (clang < 16)
  auto& batch = run.batch;
  auto& cb = run.cb;
  auto& p64 = run.p64;
  auto say = [&](std::string_view line) {
    if (opt.progress) opt.progress(line);
  };
  std::optional<model_params<T>> cast_store;
  const auto& p = params_as<T>(p64, cast_store);
  rep.setup_seconds = seconds_since(t0);

  say(fmt::format("SP step: {} processes (ulysses {} × ring {}), {} tokens each ({})", P, s.ulysses,
                  s.ring, cb.chunk, dtype_name(opt.type)));
  t0 = std::chrono::steady_clock::now();
  const auto mine = pack(sp_rank_step<T>(world, s, cb, p, opt));
  rep.sp_seconds = seconds_since(t0);

  comm_group all{"check.world", {}};
  for (int r = 0; r < P; ++r) all.ranks.push_back(r);
  say("gathering every rank's loss, logits and gradients on rank 0");
  std::vector<double> gathered(mine.size() * static_cast<std::size_t>(P));
  world.all_gather(all, mine.data(), static_cast<std::int64_t>(mine.size()), gathered.data(),
                   dtype::f64, op_info{"check.gather", {}, {}});

  // --profile deepspeed: the other micro-steps (SP rank m's sample on every rank), each SP step
  // run by every process and gathered to rank 0, which compares SP over DP with DP over the same
  // samples once all have run.
  std::map<int, std::vector<step_output<T>>> micro_outs;
  if (wants_sp_over_dp(s, opt))
    for (int m = 0; m < s.ulysses; ++m) {
      if (m == s.micro_step) continue;
      scenario sm = s;
      sm.micro_step = m;
      say(fmt::format("SP over DP: micro-step {} of {} (SP rank {}'s sample)", m + 1, s.ulysses,
                      m));
      auto cm = collate(make_batch(sm), options_of(sm));
      if (opt.transform_collated) opt.transform_collated(cm);
      const auto part = pack(sp_rank_step<T>(world, sm, cm, p, opt));
      std::vector<double> all_parts(part.size() * static_cast<std::size_t>(P));
      world.all_gather(all, part.data(), static_cast<std::int64_t>(part.size()), all_parts.data(),
                       dtype::f64, op_info{"check.gather.micro", {}, {}});
      if (me == 0)
        for (int r = 0; r < P; ++r)
          micro_outs[m].push_back(unpack(all_parts.data() + r * part.size(), p));
    }

  std::int32_t verdict = 0;
  if (me == 0) {
    std::vector<step_output<T>> outs;
    for (int r = 0; r < P; ++r) outs.push_back(unpack(gathered.data() + r * mine.size(), p));
    say(fmt::format("non-SP reference on rank 0: {} tokens (float64, in process)",
                    cb.original_length));
    t0 = std::chrono::steady_clock::now();
    // The others wait for the verdict meanwhile: heartbeats keep their watchdogs informed.
    world.while_busy(all, [&] {
      const auto ref = run_reference(s, batch, p64, opt.threads);
      rep.reference_seconds = seconds_since(t0);
      t0 = std::chrono::steady_clock::now();
      double micro_seconds = 0;
      add_rows(rep, s, cb, ref, outs);
      if (wants_sp_over_dp(s, opt))
        add_sp_over_dp_rows<T>(rep, s, opt, p64, ref, outs, [&](const scenario& sm) {
          const auto t1 = std::chrono::steady_clock::now();
          const auto b = make_batch(sm);
          auto r = run_reference(sm, b, p64, opt.threads);
          micro_seconds += seconds_since(t1);
          rep.reference_seconds += seconds_since(t1);
          return micro_result<T>{std::move(r), std::move(micro_outs.at(sm.micro_step))};
        });
      rep.compare_seconds = std::max(0.0, seconds_since(t0) - micro_seconds);
    });
    verdict = rep.pass ? 1 : 0;
  }
  // Every process learns rank 0's verdict (rank 0 contributes it, the others 0).
  world.all_reduce(all, &verdict, 1, dtype::i32, op_info{"check.verdict", {}, {}});
  rep.pass = verdict == 1;
  if (!rep.pass && opt.find_departure) {
    // Every process reruns its rank's step with everything recorded; the records go to rank 0,
    // which judges them as the in-process check does.
    say("first departure: the SP step again, every collective captured with its data");
    step_record rec(s, cb, opt.type);
    (void)sp_rank_step<T>(world, s, cb, p, rec.recording(opt));
    byte_writer w;
    w.str(pack_calls(rec.log.calls()));
    w.str(rec.layers.pack());
    w.str(rec.stages.pack(me));
    say("gathering every rank's captured calls, layer boundaries and attention stages on rank 0");
    const auto records = gather_to_first(world, all, w.bytes(), "check.departure");
    if (me == 0)
      world.while_busy(all, [&] {
        step_record merged(s, cb, opt.type);
        std::vector<call_capture> calls;
        for (const auto& m : records) {
          byte_reader r(m);
          for (auto& c : unpack_calls(r.str())) calls.push_back(std::move(c));
          merged.layers.merge(r.str());
          merged.stages.merge(r.str());
        }
        judge_departure(rep, s, batch, cb, p64, opt, calls, merged);
      });
    world.barrier(all, op_info{"check.departure.done", {}, {}});
  }
  return rep;
}

}  // namespace

check_report run_check_distributed(communicator& process_world, const scenario& s,
                                   const check_options& opt) {
  validate(s);
  std::unique_ptr<communicator> wrapped;
  if (opt.wrap_world) wrapped = opt.wrap_world(process_world);
  communicator& world = wrapped ? *wrapped : process_world;
  if (opt.type == dtype::f64) return run_distributed_typed<double>(world, s, opt);
  if (opt.type == dtype::f32) return run_distributed_typed<float>(world, s, opt);
  fail<config_error>("the CPU reference checks float64 or float32, not {}; use --dtype f64|f32",
                     dtype_name(opt.type));
}

}  // namespace seqpar::verify
