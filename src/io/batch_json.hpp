#pragma once
// JSON in and out for packed batches and collated batches (DESIGN.md `collate` contract).
#include <nlohmann/json.hpp>

#include "core/collate.hpp"
#include "core/collate_deepspeed.hpp"

namespace seqpar::io {

/// Parses `{"input_ids":[…],"labels":[…],"position_ids":[…],"attention_mask":[…]?}`; every
/// problem is a layout_error naming the key and index. `source` names the file in messages.
packed_batch batch_from_json(const nlohmann::json& j, const std::string& source);

/// The collate contract: {"profile","ulysses","ring","cp_size","original_length",
/// "padded_length","ranks":[{"cp_rank","input_ids","labels","position_ids","attention_mask",
/// "cu_seqlens","max_seqlen"(,"tail_padding_length")}…]}.
nlohmann::json collated_to_json(const collated_batch& cb);

/// DeepSpeed's adapter input: one row object (every SP rank's dataloader yields it) or
/// {"rows":[row_0,…,row_{U-1}]}. In a row, an array of integers (or [[…]], batch 1) is a [1, L]
/// tensor; a string, number, boolean, object or null is a non-tensor entry (copied unsliced);
/// anything else (batch > 1, 3-D masks, non-integers in a tensor) is a layout_error.
std::vector<sample> samples_from_json(const nlohmann::ordered_json& j, int ulysses,
                                      const std::string& source);

/// The deepspeed collate contract: {"profile":"deepspeed","ulysses","micro_steps":
/// [{"source_rank","ranks":[{"cp_rank", every entry by key…}]}]}.
nlohmann::ordered_json ds_collated_to_json(const ds_collated& c);

}  // namespace seqpar::io
