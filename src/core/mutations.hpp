#pragma once

namespace seqpar {

/// Plausible bugs that can be switched on to prove the equivalence suite catches them
/// (mutation testing of the checker). All off in normal runs; set before a run starts and
/// read-only while ranks run.
struct mutation_switches {
  bool grad_sync_avg = false;            ///< AVG instead of SUM when syncing SP gradients
  bool labels_shift_after_slice = false;  ///< veomni shift applied per rank after slicing
  bool wrong_pad_value = false;           ///< pad labels with 0 instead of -100
  bool kv_repeat_blockwise = false;       ///< repeat KV heads [k0,k1,k0,k1] not [k0,k0,k1,k1]
  bool cu_not_covering_padding = false;   ///< cu_seqlens stop before the padded tail
  bool a2a_off_by_one = false;            ///< received all-to-all blocks placed one peer off
  bool ring_section_off_by_one = false;   ///< zigzag lower/upper decided with r-1
  bool merge_without_max = false;         ///< LSE merge by exp-sum without max subtraction
  bool cu_from_zigzag_ids = false;        ///< ring cu_seqlens from the zigzagged position ids
  bool no_ring_scaling = false;           ///< ring: cu_seqlens not divided by R
};

/// The process-wide switches (tests only).
inline mutation_switches& mutations() {
  static mutation_switches m;
  return m;
}

}  // namespace seqpar
