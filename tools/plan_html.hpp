#pragma once
// `seqpar plan --html`: the plan drawn as one self-contained page (inline CSS and SVG).
#include <nlohmann/json.hpp>

#include <string>

namespace seqpar::cli {

/// The page of a plan as `seqpar plan --json` writes it: tokens on ranks (documents, padding,
/// zigzag chunks), heads after the all-to-all (KV repeats marked), the ring schedule step by
/// step, causal work per ring rank (zigzag vs contiguous), bytes per collective, and the
/// GatedDeltaNet layers' heads and conv rows when the scenario has them.
std::string plan_html(const nlohmann::json& plan);

}  // namespace seqpar::cli
