// libFuzzer harness for the readers of untrusted files: the seqpar-trace/1 reader (and replay,
// which consumes whatever the reader accepts) and the collate batch reader. The first byte
// picks the target; the rest is the file. Any exception other than seqpar::error, a crash, a
// hang or unbounded memory is a finding.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "io/batch_json.hpp"
#include "trace/replay.hpp"
#include "trace/trace_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    std::istringstream in(text);
    seqpar::trace::reader r(in, "fuzz");
    seqpar::replay::options opt;
    opt.timeline_limit = 64;
    try {
      auto rep = seqpar::replay::run(r, opt);
      (void)seqpar::replay::to_text(rep);
      (void)seqpar::replay::to_json(rep).dump();
      if (data[0] % 4 == 0) (void)seqpar::replay::to_html(rep);
    } catch (const seqpar::error&) {
    }
  } else {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      return 0;  // the CLI reports a parse error as invalid input
    }
    try {
      (void)seqpar::io::batch_from_json(j, "fuzz");
    } catch (const seqpar::error&) {
    }
  }
  return 0;
}
