#pragma once
// A chrome-trace JSON file (the PyTorch profiler's export) read without a DOM of the whole file:
// one pass over the text finds the top-level "distributedInfo" and every element of
// "traceEvents"; only the events whose "name" an importer wants are parsed (each on its own).
// Memory stays the file's text plus the kept events, however large the trace.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace seqpar::import {

struct chrome_events {
  std::optional<nlohmann::json> distributed_info;  ///< the top-level object, when present
  std::vector<nlohmann::json> events;              ///< the kept events, in file order
  std::int64_t total_events = 0;                   ///< every element of traceEvents
};

/// Scans `text` (a chrome-trace object with "traceEvents", or a bare event array) and keeps the
/// events for which keep(name) holds. trace_error naming `path` and the byte offset when the
/// text is not such a file (or ends early).
chrome_events scan_chrome_trace(std::string_view text,
                                const std::function<bool(std::string_view name)>& keep,
                                const std::string& path);

}  // namespace seqpar::import
