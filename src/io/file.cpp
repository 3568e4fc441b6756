#include "io/file.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace seqpar::io {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail<error>("cannot read '{}': no such file or not readable", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_atomic(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return;
  }
  namespace fs = std::filesystem;
  const fs::path target(path);
  fs::path tmp = target;
  tmp += fmt::format(".seqpar-tmp-{}", static_cast<long>(::getpid()));
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out)
      fail<error>("cannot write '{}': the directory does not exist or is not writable", path);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      fs::remove(tmp, ec);
      fail<error>("cannot write '{}': write failed (disk full?)", path);
    }
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::error_code ignore;
    fs::remove(tmp, ignore);
    fail<error>("cannot write '{}': {}", path, ec.message());
  }
}

}  // namespace seqpar::io
