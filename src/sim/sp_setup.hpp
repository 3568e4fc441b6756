#pragma once
// How one emulated rank is wired for a training step: its tokens and its groups.
#include <vector>

#include "core/collate.hpp"
#include "core/communicator.hpp"
#include "core/compute.hpp"
#include "sim/model.hpp"

namespace seqpar::sim {

/// Non-SP: every group is {0}; attention over `cu` on the whole row.
sp_env single_rank_env(communicator& comm, compute& comp, const scenario& s,
                       std::vector<std::int32_t> cu);

/// cp rank comm.rank() of one SP group (dp = 1): Ulysses group (ranks r·U … r·U+U-1), ring
/// group, loss group (all cp ranks), FSDP group and sp_grad_sync group per cp_fsdp_mode (xorl)
/// or FSDP over the whole SP group (veomni), and the inner attention: local varlen over the
/// collated cu_seqlens (R = 1) or ring attention over the ring group with cu // R (R > 1).
sp_env cp_rank_env(communicator& comm, compute& comp, const scenario& s, const collated_batch& cb);

/// What the collator handed cp rank k, as the model consumes it (RoPE positions: the rank's
/// slice of xorl's full, zigzagged position_ids; VeOmni's sliced ones).
rank_tokens_input rank_input(const scenario& s, const collated_batch& cb, int k);

}  // namespace seqpar::sim
