#pragma once
// A flat byte message of integers, strings and byte runs, for moving what one process recorded
// to another over a communicator (the MPI check's captures to rank 0). Little-endian as the
// host: both ends run the same build on the same architecture. The reader checks every length
// against what is left and throws seqpar::error on a short or corrupt message.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"

namespace seqpar {

class byte_writer {
 public:
  void i64(std::int64_t v) { raw(&v, sizeof v); }
  void str(std::string_view s) {
    i64(static_cast<std::int64_t>(s.size()));
    raw(s.data(), s.size());
  }
  void blob(const void* p, std::size_t n) {
    i64(static_cast<std::int64_t>(n));
    raw(p, n);
  }
  template <class T>
  void list(const std::vector<T>& v) {  // integers
    i64(static_cast<std::int64_t>(v.size()));
    for (const auto& x : v) i64(static_cast<std::int64_t>(x));
  }
  std::string& bytes() { return out_; }

 private:
  void raw(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};

class byte_reader {
 public:
  explicit byte_reader(std::string_view in) : in_(in) {}
  std::int64_t i64() {
    std::int64_t v;
    std::memcpy(&v, take(sizeof v).data(), sizeof v);
    return v;
  }
  std::string str() { return std::string(take(count())); }
  std::string_view blob() { return take(count()); }
  template <class T>
  std::vector<T> list() {
    const auto n = count_items();
    std::vector<T> v;
    v.reserve(n);
    for (std::size_t i = 0; i < n; ++i) v.push_back(static_cast<T>(i64()));
    return v;
  }
  bool done() const { return in_.empty(); }

 private:
  std::size_t count() {
    const auto n = i64();
    if (n < 0 || static_cast<std::uint64_t>(n) > in_.size())
      fail<error>("a packed record is corrupt: a length of {} with {} bytes left", n, in_.size());
    return static_cast<std::size_t>(n);
  }
  std::size_t count_items() {
    const auto n = i64();
    if (n < 0 || static_cast<std::uint64_t>(n) > in_.size() / sizeof(std::int64_t))
      fail<error>("a packed record is corrupt: {} items with {} bytes left", n, in_.size());
    return static_cast<std::size_t>(n);
  }
  std::string_view take(std::size_t n) {
    if (n > in_.size())
      fail<error>("a packed record is short: {} bytes wanted, {} left", n, in_.size());
    auto s = in_.substr(0, n);
    in_.remove_prefix(n);
    return s;
  }
  std::string_view in_;
};

}  // namespace seqpar
