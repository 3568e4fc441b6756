#pragma once
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/collate.hpp"
#include "core/communicator.hpp"
#include "core/compare.hpp"
#include "core/compute.hpp"
#include "core/dtype.hpp"
#include "core/heatmap.hpp"
#include "core/ring_attention.hpp"
#include "core/scenario.hpp"
#include "sim/faulty_comm.hpp"
#include "sim/reference.hpp"
#include "verify/attention_stages.hpp"
#include "verify/divergence.hpp"

namespace seqpar::verify {

struct check_options {
  dtype type = dtype::f64;       ///< SP run precision; the reference is always float64
  bool naive_attention = false;  ///< the materialising oracle kernels instead of the tiled ones
  /// Workers of the non-SP reference's attention (0 = every core); its result is bitwise
  /// identical at any count. Also the threads that carry the SP ranks unless rank_threads is
  /// set.
  int threads = 0;
  /// Threads that carry the SP ranks (0 = as many as `threads`; when both are 0, every core,
  /// or one for a small step): at least the number of ranks runs one thread per rank, fewer
  /// runs the ranks as fibers on them (thread_world::set_carriers). What the ranks compute does
  /// not depend on it.
  int rank_threads = 0;
  /// Called with a short line at each stage of a run (for progress output).
  std::function<void(std::string_view)> progress;
  comm_recorder* recorder = nullptr;  ///< records every collective of the SP run
  /// Records every collective of the SP run with its data (what the first-departure search
  /// reads); the outermost layer of each rank's communicator, so it sees what the step sees.
  capture_log* capture = nullptr;
  /// Records every rank's softmax attention stages (seqpar-dump/1 names) for the dump engine.
  attention_stages* attention = nullptr;
  /// Records every rank's layer boundaries (sim::sp_env::tap_layer) for the first departure.
  layer_trace* layers = nullptr;
  /// When the check fails, rerun the SP step with every collective captured and name where it
  /// first departs (check_report::first); off: the end results only.
  bool find_departure = true;
  /// The watchdog's deadline per collective: a call may wait this long for its group per
  /// 64 MiB it moves (at least once) before the run is aborted naming the members that never
  /// arrived. 0 = the default, 60 s.
  std::chrono::milliseconds timeout{0};
  /// Where a run whose transport fails (an error, the watchdog) leaves the flight records of
  /// its ranks, rank-<R>.jsonl each (every rank's last calls, seqpar-trace/1), for `seqpar
  /// replay DIR`; the error message names them. Empty = none written.
  std::string flight_dir;
  /// --profile deepspeed: also run every micro-step (SP rank i's sample, i < U) and compare SP
  /// over DP (the micro-steps' losses and gradients averaged, as gradient accumulation over
  /// the U micro-steps does) with DP over the same U samples (the oracle on each sample,
  /// averaged as DP's gradient all-reduce does): rows "sp_over_dp.*". Off while recording (the
  /// trace holds one micro-step).
  bool sp_over_dp = true;
  /// Corrupt one transport call of the SP run (tests of the checker itself).
  fault_spec fault;

  // Seams of the SP side, for checking the checker (tests/support injects plausible bugs
  // through them and expects the check to fail) and for what-if experiments. All empty in
  // normal runs; the non-SP reference never sees them.

  /// Applied to the collated batch right after collation, before any SP rank runs; the layout
  /// rows judge the transformed batch.
  std::function<void(collated_batch&)> transform_collated;
  /// Given each SP rank's compute backend and the communicator its step uses, returns the
  /// compute that rank uses (e.g. a decorator forwarding to it; one that models a tensor sent
  /// where it should not go may call the communicator). Called once per rank, on that rank's
  /// thread or process.
  std::function<std::unique_ptr<compute>(std::unique_ptr<compute>, communicator&)> wrap_compute;
  /// Given each SP rank's communicator (after the fault injector, if any), returns the one its
  /// training step uses; the wrapper must forward to it. Called once per rank. The distributed
  /// check's own gathers (rows to rank 0, the verdict) bypass it.
  std::function<std::unique_ptr<communicator>(communicator&)> wrap_communicator;
  /// The distributed check only: given the process's world, returns the communicator its whole
  /// job uses — the SP step's calls (under the fault injector and wrap_communicator) and the
  /// check's own (the rows gathered to rank 0, the verdict, the departure's records); the
  /// wrapper must forward to it, while_busy included. Called once per process.
  std::function<std::unique_ptr<communicator>(communicator&)> wrap_world;
  /// Where the SP ranks run: empty = the CPU simulator (one in-process world, each rank with
  /// an eigen_compute). Another backend (check_gpu.hpp) sets it: it runs `body` once per cp
  /// rank, on that rank's thread, with the rank's communicator and compute, and returns when
  /// every rank has (rethrowing the first failure).
  std::function<void(int ranks, const std::function<void(communicator&, compute&)>& body)>
      rank_world;
  /// The SP step on tensors in the compute backend's memory, stored in `type`
  /// (sim::tensor_train_step: f64, f32 or bf16) instead of the host step (sim::train_step).
  bool tensor_step = false;
  /// Where the SP step's p2p ring tallies its steps (computed, skipped); run_check sets its own
  /// for the main step and reports the totals (check_report::ring_steps).
  std::shared_ptr<ring_step_counts> ring_counts;
};

/// The p2p ring's steps of a check, over every rank and softmax layer (forward).
struct ring_step_totals {
  std::int64_t computed = 0, skipped_mask = 0, skipped_layout = 0;
};

struct check_report {
  scenario scen;
  dtype type = dtype::f64;
  std::vector<compared_tensor> rows;
  std::vector<std::string> warnings;  ///< from collation (data intact but unsafe)
  bool pass = false;
  double tolerance = 0;     ///< the relative tolerance used for numeric rows
  std::string error_model;  ///< how the tolerance was derived
  /// Wall time of each phase: setup (batch, collation, parameters), the SP step(s), the float64
  /// reference(s), compare (the rows; SP over DP's sums). DeepSpeed's further micro-steps add to
  /// sp and reference.
  double setup_seconds = 0, sp_seconds = 0, reference_seconds = 0, compare_seconds = 0;
  /// Every failing row over a tensor's axes (logits and the embedding gradient: tokens × their
  /// width; a parameter gradient: its out × in features, head edges marked), for --html.
  std::vector<error_heatmap> heatmaps;
  std::string backend = "sim";  ///< which transport ran the SP step (set by the caller)
  /// The device that ran the SP step, in words (GPU backend), and its attention kernels.
  std::string device;
  /// GPU backend: where the SP step's fixed seconds went (CUDA context, cuDNN, its graphs,
  /// cuBLAS handles), in words.
  std::string device_setup;
  /// A failed check: the first collective whose received data differ from what its senders
  /// sent (divergence.hpp); with `departure` saying what was searched when none does.
  std::optional<divergence> first;
  /// No collective departs: the dump engine's verdict on the step's attention calls (its first
  /// differing stage, diagnosed), when one differs.
  std::optional<dump_finding> attention;
  /// No collective departs: the first layer boundary where an SP rank's rows differ from the
  /// reference's (forward layer by layer, then the backward), in words; empty when none does.
  std::string layer_departure;
  std::string departure;
  std::string isa;  ///< the CPU vector instruction sets (sim::cpu_isa)
  /// With a p2p ring: its steps, computed and skipped (by the mask: no query sees the block;
  /// by the layout: a later block under a causal mask in a contiguous ring).
  std::optional<ring_step_totals> ring_steps;
};

/// The command that runs the report's check again: the scenario (io::scenario_command) and the
/// run's own choices that change the numbers — its dtype (a float32 failure reproduced in float64
/// would pass) and the GPU backend.
std::string reproduce_command(const check_report& r);

/// What the non-SP reference of a check trains on: the scenario's row unpadded, labels aligned
/// to tokens (VeOmni's whole-row shift applied; xorl's labels come shifted per document).
ref::batch reference_batch(const scenario& s, const packed_batch& b);

/// The reference's whole input for a scenario: its float64 parameters (model_params::init) as
/// plain named matrices, and reference_batch(s, make_batch(s)). For tools that run the same
/// step elsewhere (tests/jobs/torch_reference.py).
struct reference_inputs {
  ref::weights weights;
  ref::batch batch;
};
reference_inputs reference_inputs_of(const scenario& s);

/// What add_ring_step_references needs of a scenario: its layout, the row's documents (from
/// the reference batch's position ids) and the sink logits of layers with sinks (from `w`);
/// ring_rows reads `cb`, which must outlive the result.
ring_step_layout ring_step_layout_of(const scenario& s, const ref::batch& rb,
                                     const collated_batch& cb, const ref::weights& w);

/// The relative tolerance for a scenario and precision, and the model behind it.
/// float64: 1e-10 (only summation order differs). float32: see error_model in the report.
double tolerance_for(const scenario& s, dtype t, std::string* model = nullptr);

/// The floor under a parameter gradient's scale: check judges gradient `name` by its largest
/// error relative to max(its largest |value|, floor), the floor 1e-3 of the step's largest
/// parameter gradient `grad_scale` (1e-2 for the per-head sums over every token, of terms that
/// largely cancel: GatedDeltaNet's A_log and dt_bias, the sink logits), so that a gradient far
/// below the others is not judged by rounding relative to its own tiny size.
double gradient_floor(const std::string& name, double grad_scale);

/// The sentence a failed run's error ends with: where its flight records went (`files` of
/// them) and how to judge them.
std::string flight_note(const std::string& dir, std::size_t files);

/// Rethrows `e` with `note` after its message, keeping seqpar's error types.
[[noreturn]] void rethrow_with_note(std::exception_ptr e, const std::string& note);

/// One training step of `s`, SP (cp = U·R ranks emulated as threads, the batch collated by the
/// core) and non-SP (the independent oracle ref::train_step on the unpadded row: what training
/// without SP computes, sharing no SP code), compared:
/// loss, logits (gathered and unpadded), embedding-output gradients per token, every
/// parameter gradient (on every rank after the gradient sync), and the layout invariants;
/// with --profile deepspeed also the SP-over-DP rows (check_options::sp_over_dp).
check_report run_check(const scenario& s, const check_options& opt = {});

/// The same check with one cp rank per process of `world` (e.g. MPI under mpiexec): world
/// rank k runs cp rank k's SP step (world.world_size() must equal s.cp(), else config_error),
/// every rank's loss, logits, embedding-output gradients and parameter gradients are gathered
/// (with --profile deepspeed every micro-step's, for the SP-over-DP rows)
/// (all_gather on group "check.world"), and world rank 0 runs the non-SP reference in process
/// and builds the same rows as run_check. Every rank must call it with the same arguments.
/// Returns on every rank; `rows` (and reference_seconds) are filled on rank 0 only, `pass` on
/// every rank (rank 0's verdict, shared with an all_reduce). Reductions summed in group order
/// (inproc and MPI communicators) give rows bitwise identical to run_check's.
check_report run_check_distributed(communicator& world, const scenario& s,
                                   const check_options& opt = {});

}  // namespace seqpar::verify
