#pragma once
// Importers of other tools' communication records into seqpar-trace/1: PyTorch Flight
// Recorder JSON dumps, PyTorch profiler (Kineto) chrome traces, NCCL_DEBUG=INFO COLL logs.
// A field the source does not record is left absent, and the trace says so (replay then
// reports what it could not check) — nothing is guessed.
#include <optional>
#include <string>
#include <vector>

#include "trace/trace_io.hpp"

namespace seqpar::import {

/// Files of `inputs`, a directory standing for its regular files in name order.
/// trace_error when an input does not exist.
std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs);

/// One Flight Recorder JSON dump per rank (`_dump_nccl_trace_json` / the dump files of
/// TORCH_NCCL_DEBUG_INFO_TEMP_FILE converted with tools/fr_pickle_to_json.py). The rank is the
/// dump's "rank" key, else the trailing number of the file name (nccl_trace_rank_3 → 3).
trace::trace_data from_fr(const std::vector<std::string>& files);

/// PyTorch profiler chrome traces (one per rank, .json or .json.gz), in every generation:
/// torch ≥ ~2.1 (`record_param_comms` with "Collective name", element counts, splits, process
/// groups), torch ~2.0 (the collective named and sized by the backend's `nccl:*`/`gloo:*`
/// annotation: "Input Dims", "Input type"; no groups, no splits), and the legacy export (the
/// backend's events by name only). The files of one job must be of one generation.
trace::trace_data from_kineto(const std::vector<std::string>& files);

/// NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL logs (one or more files, any number of ranks).
trace::trace_data from_nccl_log(const std::vector<std::string>& files);

/// Shared helpers.
/// PyTorch's c10 scalar type names ("Float", "BFloat16", …) → trace dtype names ("float32", …);
/// unknown names are kept lowercased.
std::string dtype_from_c10(const std::string& name);
/// The C++ element type names the profiler writes in "Input type" ("float", "c10::BFloat16",
/// "long int", …) → trace dtype names; "" for anything else (a TensorList, a Scalar).
std::string dtype_from_cpp(const std::string& name);
/// c10::ScalarType as an integer (Flight Recorder 2.1 wrote dtypes so: 6 = Float, 15 =
/// BFloat16) → trace dtype name; nullopt for the types no collective of SP moves.
std::optional<std::string> dtype_from_scalar_type(int t);
/// c10d collective names in their many spellings → trace op ("" when not a recorded kind).
std::string op_from_c10d(const std::string& name);
/// "[0, 1, 2]" or a JSON array → ranks; trace_error naming `what` otherwise.
std::vector<int> parse_rank_list(const std::string& text, const std::string& what);

}  // namespace seqpar::import
