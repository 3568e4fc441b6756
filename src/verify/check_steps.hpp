#pragma once
// The pieces of a check that its drivers share: the in-process check (check.cpp), the
// distributed one (check_distributed.cpp) and the search for where a failing step first departs
// (departure.cpp). Internal to src/verify.
#include <functional>
#include <optional>
#include <type_traits>
#include <vector>

#include "core/collate.hpp"
#include "sim/model.hpp"
#include "verify/check.hpp"

namespace seqpar::verify {

/// The reference's parameters: the same float64 values, as plain named matrices.
ref::weights as_reference_weights(const sim::model_params<double>& p);

/// The parameters in the SP step's precision: p64 itself for float64 (no copy), else a cast
/// kept in `store`.
template <class T>
const sim::model_params<T>& params_as(const sim::model_params<double>& p64,
                                      std::optional<sim::model_params<T>>& store) {
  if constexpr (std::is_same_v<T, double>)
    return p64;
  else
    return store.emplace(p64.template cast<T>());
}

/// The non-SP step: the independent oracle (sim/reference.hpp) on the unpadded row.
sim::step_output<double> run_reference(const scenario& s, const packed_batch& b,
                                       const sim::model_params<double>& p, int threads);

/// The SP step of cp rank comm.rank() (the fault wrapper, the seams and the recorder as the
/// options say), on `backend` when given (a rank of check_options::rank_world), else on an
/// eigen_compute. Instantiated for double and float.
template <class T>
sim::step_output<T> sp_rank_step(communicator& comm, const scenario& s, const collated_batch& cb,
                                 const sim::model_params<T>& p, const check_options& opt,
                                 int attention_workers = 1, compute* backend = nullptr);

/// The compared rows of a check, from the reference step and every cp rank's SP step (in cp
/// rank order). Instantiated for double and float.
template <class T>
void add_rows(check_report& rep, const scenario& s, const collated_batch& cb,
              const sim::step_output<double>& ref, const std::vector<sim::step_output<T>>& outs);

/// The document boundaries of the unpadded row (the reference's token order).
std::vector<double> doc_bounds(const scenario& s);

/// One SP-over-DP micro-step: the oracle on its sample and every SP rank's output.
template <class T>
struct micro_result {
  sim::step_output<double> ref;
  std::vector<sim::step_output<T>> outs;
};

/// Whether a check of `s` adds the SP-over-DP rows (DeepSpeed ALST's claim).
bool wants_sp_over_dp(const scenario& s, const check_options& opt);

/// The SP-over-DP rows; `micro` runs one further micro-step. Instantiated for double and float.
template <class T>
void add_sp_over_dp_rows(check_report& rep, const scenario& s, const check_options& opt,
                         const sim::model_params<double>& p64,
                         const sim::step_output<double>& ref_here,
                         const std::vector<sim::step_output<T>>& outs_here,
                         const std::function<micro_result<T>(const scenario& sm)>& micro);

/// What every check starts from: the report header, the batch, its collation (after the
/// options' transform, which only the SP side sees) and the float64 parameters.
struct check_run {
  check_report rep;
  packed_batch batch;
  collated_batch cb;
  sim::model_params<double> p64;

  check_run(const scenario& s, const check_options& opt);
};

/// What a failing step's rerun records on every rank: each collective with its data, the
/// layer boundaries and the attention's stages.
struct step_record {
  capture_log log;
  attention_stages stages;
  layer_trace layers;

  step_record(const scenario& s, const collated_batch& cb, dtype t) : stages(s, cb, t) {}
  /// `opt` with every recorder pointing here (and no other output).
  check_options recording(const check_options& opt) {
    check_options o = opt;
    o.capture = &log;
    o.attention = &stages;
    o.layers = &layers;
    o.recorder = nullptr;
    o.flight_dir.clear();
    o.progress = {};
    return o;
  }
};

/// Names where the step first departs, from every rank's record (departure.cpp).
void judge_departure(check_report& rep, const scenario& s, const packed_batch& batch,
                     const collated_batch& cb, const sim::model_params<double>& p64,
                     const check_options& opt, const std::vector<call_capture>& calls,
                     step_record& rec);

}  // namespace seqpar::verify
