#pragma once
// Buffer and reduction helpers every host-side communicator shares (argument checks are done
// once, in communicator's public calls), so the
// in-process and MPI transports reduce to the same bits.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

#include "core/communicator.hpp"
#include "core/error.hpp"

namespace seqpar::comm_checks {

/// Whether two byte ranges overlap (in-place or aliased buffers need a scratch copy).
inline bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) {
  if (na == 0 || nb == 0) return false;
  auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + nb && pb < pa + na;
}

/// Bytes to stage the receives of one send_recv in: every recv's bytes when any recv buffer
/// overlaps a buffer the same call sends from (the sends must read the old values), else 0.
inline std::size_t recv_stage_bytes(std::span<const p2p_op> ops, std::size_t esz) {
  bool staged = false;
  std::size_t bytes = 0;
  for (const auto& r : ops) {
    if (r.dir != p2p_op::kind::recv) continue;
    bytes += static_cast<std::size_t>(r.count) * esz;
    for (const auto& s : ops)
      if (s.dir == p2p_op::kind::send && overlaps(r.buf, static_cast<std::size_t>(r.count) * esz,
                                                  s.buf, static_cast<std::size_t>(s.count) * esz))
        staged = true;
  }
  return staged ? bytes : 0;
}

/// Sum of per-peer counts (each already checked non-negative by communicator's public call).
inline std::int64_t total(std::span<const std::int64_t> counts) {
  std::int64_t sum = 0;
  for (auto c : counts) sum += c;
  return sum;
}

/// `backend` names the transport in the message ("the MPI communicator", …).
inline void check_reducible(dtype t, const char* op, const comm_group& g,
                            std::string_view backend) {
  if (t == dtype::bf16)
    fail<error>(
        "{} on group '{}': {} does not reduce bfloat16 (the rounding of each partial sum is "
        "backend-specific); reduce in float32 and convert",
        op, g.name, backend);
}

/// a + b; integers wrap (no undefined behaviour on overflow).
template <class T>
T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

}  // namespace seqpar::comm_checks
