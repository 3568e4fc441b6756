// libFuzzer harness for every reader of a file a user feeds seqpar. The first byte picks the
// target (byte % 9); the rest is the file:
//   0 the seqpar-trace/1 reader, and replay on whatever it accepts (text, JSON, HTML reports)
//   1 the collate batch reader (xorl / VeOmni rows)
//   2 the Flight Recorder JSON importer        3 the profiler importer (Kineto and legacy export)
//   4 the NCCL INFO log importer               5 the DeepSpeed samples reader (collate input)
//   6 flight-record merge: the input cut in two at its first 0xff byte, read as two rank files
//   7 the safetensors reader (tensor dumps): what it accepts converts, and writes back and reads
//     back to the same file
//   8 a tensor dump directory (validate --dump, exhaustive and sampled): the input cut at its
//     first 0xff byte into
//     rank0.json (the meta) and the one safetensors file every call of it names; what reads is
//     validated and reported
// Importer output is replayed too. Any exception other than seqpar::error, a crash, a hang or
// unbounded memory is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "dump/dump.hpp"
#include "io/batch_json.hpp"
#include "io/safetensors.hpp"
#include "trace/flight.hpp"
#include "trace/import/import.hpp"
#include "trace/replay.hpp"
#include "trace/trace_io.hpp"

namespace {

void replay_text(const std::string& text, bool html) {
  std::istringstream in(text);
  seqpar::trace::reader r(in, "fuzz");
  seqpar::replay::options opt;
  opt.timeline_limit = 64;
  auto rep = seqpar::replay::run(r, opt);
  (void)seqpar::replay::to_text(rep);
  (void)seqpar::replay::to_json(rep).dump();
  if (html) (void)seqpar::replay::to_html(rep);
}

// The importers read files: one scratch file per fuzzing process.
std::string scratch(int k, const std::string& text) {
  const auto path = "/tmp/seqpar-fuzz-" + std::to_string(getpid()) + "-" + std::to_string(k);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const int target = data[0] % 9;
  try {
    switch (target) {
      case 0:
        replay_text(text, data[0] % 4 == 0);
        break;
      case 1:
      case 5: {
        nlohmann::ordered_json j;
        try {
          j = nlohmann::ordered_json::parse(text);
        } catch (const nlohmann::json::exception&) {
          return 0;  // the CLI reports a parse error as invalid input
        }
        if (target == 1)
          (void)seqpar::io::batch_from_json(nlohmann::json(j), "fuzz");
        else
          (void)seqpar::io::samples_from_json(j, 1 + data[0] % 4, "fuzz");
        break;
      }
      case 2:
      case 3:
      case 4: {
        const std::vector<std::string> files{scratch(0, text)};
        const auto t = target == 2   ? seqpar::import::from_fr(files)
                       : target == 3 ? seqpar::import::from_kineto(files)
                                     : seqpar::import::from_nccl_log(files);
        replay_text(t.text(), false);
        break;
      }
      case 6: {
        const auto cut = text.find('\xff');
        const std::vector<std::string> files{
            scratch(0, text.substr(0, cut)),
            scratch(1, cut == std::string::npos ? std::string() : text.substr(cut + 1))};
        replay_text(seqpar::trace::merge_traces(files).text(), false);
        break;
      }
      case 7: {
        const auto f = seqpar::io::parse_safetensors(text, "fuzz");
        try {  // what the reader accepts converts, writes and reads back unchanged
          for (const auto& t : f.tensors) (void)t.to_f64();
          if (seqpar::io::parse_safetensors(seqpar::io::serialize_safetensors(f), "again") != f)
            __builtin_trap();
        } catch (const seqpar::error&) {
          __builtin_trap();
        }
        break;
      }
      case 8: {
        const auto cut = text.find('\xff');
        namespace fs = std::filesystem;
        const auto dir = "/tmp/seqpar-fuzz-dump-" + std::to_string(getpid());
        fs::remove_all(dir);
        fs::create_directories(dir + "/rank0");
        std::ofstream(dir + "/rank0.json", std::ios::binary) << text.substr(0, cut);
        std::ofstream(dir + "/rank0/t.safetensors", std::ios::binary)
            << (cut == std::string::npos ? std::string() : text.substr(cut + 1));
        const auto dump = seqpar::verify::read_dump(dir);
        const auto rep = seqpar::verify::validate_dump(dump);
        (void)seqpar::verify::dump_report_text(rep, true);
        (void)seqpar::verify::dump_report_html(rep);
        // The sampled mode reads the same files mapped, row by row.
        seqpar::verify::dump_options opt;
        opt.mode = seqpar::verify::dump_options::mode_t::sampled;
        opt.rows = 16;
        opt.threads = 1;
        const auto sampled = seqpar::verify::validate_dump(dump, opt);
        (void)seqpar::verify::dump_report_text(sampled, true);
        (void)seqpar::verify::dump_report_html(sampled);
        break;
      }
    }
  } catch (const seqpar::error&) {
  }
  return 0;
}
