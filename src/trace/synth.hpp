#pragma once
// What the reference records for one SP training step, derived from the core plans (collation,
// Ulysses all-to-all geometry, KV repeat, ring schedule): the traces under traces/ and the
// replay tests are built from it. `seqpar record` runs the algorithms themselves and writes the
// same records.
#include <string>
#include <vector>

#include "core/collate.hpp"
#include "core/scenario.hpp"
#include "trace/trace_io.hpp"

namespace seqpar::trace {

using synth_trace = trace_data;

/// One training step of `s` on its cp ranks (world = ulysses·ring, xorl rank layout
/// cp_rank = ring_rank·U + ulysses_rank): per layer the Ulysses all-to-alls of Q, fused KV and
/// the output (forward, then backward in reverse layer order), ring p2p steps and the
/// backward all_gather/reduce_scatter of K,V when ring > 1, the loss all-reduces and the FSDP
/// gradient reduce-scatter, plus each rank's collator output. Groups: ulysses{i}, ring{i}, sp0.
synth_trace synthesize(const scenario& s);

}  // namespace seqpar::trace
