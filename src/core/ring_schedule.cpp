#include "core/ring_schedule.hpp"

namespace seqpar {

std::string_view section_name(ring_section s) {
  switch (s) {
    case ring_section::diagonal:
      return "diagonal";
    case ring_section::lower:
      return "lower";
    case ring_section::upper:
      return "upper";
    case ring_section::causal:
      return "causal";
    case ring_section::full:
      return "full";
    case ring_section::skip:
      return "skip";
  }
  return "?";
}

std::vector<ring_step> ring_schedule(int r, int ring, bool zigzag) {
  std::vector<ring_step> out;
  for (int i = 0; i < ring; ++i)
    out.push_back({i, ring_source(r, i, ring),
                   zigzag ? zigzag_section(r, i, ring) : contiguous_section(r, i, ring)});
  return out;
}

}  // namespace seqpar
