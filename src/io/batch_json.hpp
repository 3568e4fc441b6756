#pragma once
// JSON in and out for packed batches and collated batches (DESIGN.md `collate` contract).
#include <nlohmann/json.hpp>

#include "core/collate.hpp"

namespace seqpar::io {

/// Parses `{"input_ids":[…],"labels":[…],"position_ids":[…],"attention_mask":[…]?}`; every
/// problem is a layout_error naming the key and index. `source` names the file in messages.
packed_batch batch_from_json(const nlohmann::json& j, const std::string& source);

/// The collate contract: {"profile","ulysses","ring","cp_size","original_length",
/// "padded_length","ranks":[{"cp_rank","input_ids","labels","position_ids","attention_mask",
/// "cu_seqlens","max_seqlen"(,"tail_padding_length")}…]}.
nlohmann::json collated_to_json(const collated_batch& cb);

}  // namespace seqpar::io
