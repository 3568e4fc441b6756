#include "io/file.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace seqpar::io {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail<error>("cannot read '{}': no such file or not readable", path);
  // Straight into a string of the file's size (no stream buffer doubling: a large trace is
  // held once); a file that is not regular (a pipe) is read in blocks.
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  std::string text;
  if (!ec && std::filesystem::is_regular_file(path, ec)) {
    text.resize(static_cast<std::size_t>(size));
    in.read(text.data(), static_cast<std::streamsize>(size));
    text.resize(static_cast<std::size_t>(in.gcount()));
  }
  if (in.good()) {
    char buf[1 << 16];
    while (in.read(buf, sizeof buf) || in.gcount() > 0)
      text.append(buf, static_cast<std::size_t>(in.gcount()));
  }
  if (in.bad()) fail<error>("cannot read '{}': a read error", path);
  return text;
}

std::string read_file_maybe_gzip(const std::string& path) {
  std::string raw = read_file(path);
  if (raw.size() < 2 || static_cast<unsigned char>(raw[0]) != 0x1f ||
      static_cast<unsigned char>(raw[1]) != 0x8b)
    return raw;
  z_stream z{};
  // 15 + 32: a gzip (or zlib) header, detected.
  if (inflateInit2(&z, 15 + 32) != Z_OK) fail<error>("cannot read '{}': zlib did not start", path);
  std::string out;
  std::string buf(1 << 20, '\0');
  z.next_in = reinterpret_cast<Bytef*>(raw.data());
  z.avail_in = static_cast<uInt>(raw.size());
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    z.next_out = reinterpret_cast<Bytef*>(buf.data());
    z.avail_out = static_cast<uInt>(buf.size());
    rc = inflate(&z, Z_NO_FLUSH);
    if (rc == Z_STREAM_END && z.avail_in > 0) {  // another gzip member follows
      out.append(buf.data(), buf.size() - z.avail_out);
      inflateReset(&z);
      rc = Z_OK;
      continue;
    }
    if (rc != Z_OK && rc != Z_STREAM_END) {
      const std::string why = z.msg ? z.msg : fmt::format("zlib error {}", rc);
      inflateEnd(&z);
      fail<error>("cannot read '{}': a gzip file that does not decompress ({}); is it complete?",
                  path, rc == Z_BUF_ERROR ? "it ends early" : why);
    }
    out.append(buf.data(), buf.size() - z.avail_out);
  }
  inflateEnd(&z);
  return out;
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
