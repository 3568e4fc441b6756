#pragma once
// The families of likely mistakes of a computed stage, and the search among them: softmax scale
// 1/d^α and constant factors; the causal mask removed or its diagonal shifted; document
// boundaries moved, split off or removed; for key gradients of ring jobs the missing ring
// reduction; for forward stages of zigzag ring jobs the ring schedule emulated with its KV source
// shifted or cu_seqlens from local position ids; for forward stages of bf16/f16 ring jobs each
// step's LSE rounded to the input dtype before the merge. A member is named only when it reproduces
// the failing ranks' rows within the stage's bound.
#include <string>
#include <utility>
#include <vector>

#include "dump/engine.hpp"

namespace seqpar::verify::dump_detail {

/// The dump's ring job as each rank runs it (emulate.hpp), with the section of step i chosen
/// for source (r − i + section_shift) mod R; zigzag: each rank's attention cu_seqlens either the
/// global ones // R (correct) or rebuilt from its local position ids (local_cu); contiguous
/// (zigzag false): one chunk per rank, documents by global token.
ring_job dump_ring_job(const geometry& g, bool causal, int section_shift, bool local_cu,
                       bool zigzag = true);

/// The members, simplest first, as (the mistake in words, the attention it computes).
std::vector<std::pair<std::string, attention_variant>> family_members(const geometry& g,
                                                                      const dump_meta& m,
                                                                      const attention_variant& base,
                                                                      bool key, bool grad);

/// The member that reproduces the failing ranks' values of a computed stage on a sample of
/// their rows (failing and passing), as a clause ("; it equals attention with …"), or a clause
/// saying none does and what was searched; "" where the sample saw no failing row or the stage
/// has no family (a gradient without a dumped backward).
std::string search_families(const call_context& c, const std::string& stage,
                            const std::vector<int>& ranks);

}  // namespace seqpar::verify::dump_detail
