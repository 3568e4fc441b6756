#pragma once
// Where a GPU run's fixed seconds go: the CUDA context, loading cuDNN and making its handle,
// cuBLAS handles, and building cuDNN's attention graphs (each a plan build, often with a kernel
// compiled at run time). Process totals, added to as the costs are paid; a report takes the
// difference of two snapshots. Plain C++: no CUDA include.
#include <mutex>
#include <string>
#include <vector>

namespace seqpar::gpu {

struct setup_costs {
  double context = 0;         ///< the device's CUDA context (the process's first call on it)
  double cudnn_load = 0;      ///< dlopen of cuDNN and its version read
  double cudnn_handle = 0;    ///< cudnnCreate (one per graph), summed
  double blas_handles = 0;    ///< cublasCreate, summed over the ranks that ran a GEMM
  double graph_builds = 0;    ///< cuDNN attention graphs built, summed
  int graphs = 0;             ///< how many
  int dynamic_graphs = 0;     ///< of those, built with dynamic shapes (sharing a kernel cache)
  int dense_graphs = 0;       ///< of those, dense single-document graphs
  int background_graphs = 0;  ///< of those, built ahead on a thread of their own (backwards)
  std::vector<std::string> builds;  ///< each build: "bwd ragged b=3 q=8192 k=8192: 0.412 s"
  std::string dynamic_refused;      ///< why cuDNN refused dynamic shapes, when it did

  /// What was paid since `before` (the notes are this snapshot's).
  setup_costs since(const setup_costs& before) const;
  /// One line: "context 0.21 s, cuDNN load 0.15 s + handles 0.02 s, 6 attention graphs built in
  /// 0.31 s (summed; 3 with dynamic shapes, 3 ahead), cuBLAS handles 0.04 s".
  std::string describe() const;
};

/// The process's totals so far.
setup_costs setup_costs_so_far();

namespace detail {
std::mutex& setup_costs_mutex();
setup_costs& setup_costs_totals();
/// Adds to the process's totals under a lock (f receives them).
template <class F>
void add_setup_cost(F&& f) {
  std::lock_guard<std::mutex> lock(setup_costs_mutex());
  f(setup_costs_totals());
}
}  // namespace detail

/// Makes the device's CUDA context now (timed into setup_costs::context the first time) so that
/// the ranks that follow do not pay it inside their first call. Throws backend_error. (Defined
/// with the CUDA code, gpu/cuda_compute.cpp; the rest of this header is plain C++, tested on
/// every machine by tests/gpu/kernels-test.)
void initialize_device(int device);

}  // namespace seqpar::gpu
