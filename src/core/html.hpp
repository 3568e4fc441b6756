#pragma once
// The one HTML escape of the reports seqpar writes (replay, validate --dump).
#include <string>
#include <string_view>

namespace seqpar {

inline std::string html_escape(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  return o;
}

}  // namespace seqpar
