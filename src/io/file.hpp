#pragma once
// Whole-file reads and atomic writes: every file seqpar reads or writes goes through these, so
// that a failed run never leaves a partial output file and every message names the path.
#include <string>

namespace seqpar::io {

/// Reads a whole file; throws seqpar::error naming the path when it cannot.
std::string read_file(const std::string& path);

/// Reads a whole file, gunzipping it when it starts with the gzip magic (PyTorch profiler
/// traces are often saved as .json.gz); throws seqpar::error naming the path when it cannot.
std::string read_file_maybe_gzip(const std::string& path);

/// Writes `text` to `path` atomically (temp file in the same directory, then rename); the temp
/// file is removed on any failure. "-" writes to stdout.
void write_atomic(const std::string& path, const std::string& text);

}  // namespace seqpar::io
