#pragma once
// validate --dump's sampled mode (dump_sampled.cpp) and the search of families of likely
// mistakes on sampled rows, shared with the exhaustive mode's diagnosis.
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "verify/dump_rows.hpp"

namespace seqpar::verify::dump_detail {

/// The position ids every rank should hold (the layout stage), one row per rank.
std::vector<compared_tensor> layout_rows(const dump_set& d, const geometry& g);

/// Checks one call in sampled mode: rows into rep, and its first difference diagnosed.
void validate_call_sampled(const dump_set& d, const geometry& g, int call, dump_report& rep,
                           const dump_options& opt);

/// The families of likely mistakes, simplest members first, as (the mistake in words, the
/// attention it computes): softmax scale 1/d^α and constant factors; the causal mask removed or
/// its diagonal shifted; document boundaries moved, split off or removed; for key gradients of
/// ring jobs the missing ring reduction; for forward stages of zigzag ring jobs the ring schedule
/// emulated with its KV source shifted or cu_seqlens from local position ids.
std::vector<std::pair<std::string, attention_variant>> family_members(const geometry& g,
                                                                      const dump_meta& m,
                                                                      const attention_variant& base,
                                                                      bool key, bool grad);

/// The member of the families of likely mistakes (softmax scale d^-α or a constant factor, the
/// causal diagonal shifted, document boundaries moved or split, a KV gradient not reduced over
/// the ring) that reproduces the failing ranks' values of a computed stage on sampled rows, as a
/// clause ("…; it equals attention with …"), or a sentence saying none does and what was
/// searched. nullopt for a stage the families do not apply to.
std::optional<std::string> search_families(const dump_set& d, const geometry& g, int call,
                                           const std::string& stage, const std::vector<int>& ranks,
                                           const dump_options& opt);

}  // namespace seqpar::verify::dump_detail
