#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace seqpar {

/// Base of every error seqpar raises. The message names what was wrong, the actual
/// values and how to fix it; tools/ turns it into exit code 2 (invalid input) or 1.
class error : public std::runtime_error {
 public:
  explicit error(const std::string& what) : std::runtime_error(what) {}
};

/// An invalid scenario / configuration (heads, sizes, mesh, profile).
class config_error : public error {
 public:
  using error::error;
};

/// A batch that cannot be laid out (lengths, position_ids, document alignment).
class layout_error : public error {
 public:
  using error::error;
};

/// Tensor shapes that do not agree with a plan.
class shape_error : public error {
 public:
  using error::error;
};

/// An unreadable or malformed trace / input file.
class trace_error : public error {
 public:
  using error::error;
};

/// A failure reported by a transport or device backend (MPI, NCCL, CUDA).
class backend_error : public error {
 public:
  backend_error(std::string call, int code, const std::string& message, int rank, std::string host)
      : error(fmt::format("rank {} on {}: {} failed with code {}: {}", rank, host, call, code,
                          message)),
        call_(std::move(call)),
        code_(code),
        rank_(rank),
        host_(std::move(host)) {}
  const std::string& call() const { return call_; }
  int code() const { return code_; }
  int rank() const { return rank_; }
  const std::string& host() const { return host_; }

 private:
  std::string call_;
  int code_;
  int rank_;
  std::string host_;
};

/// Raise E with a fmt-formatted message: the one error path of the library.
template <class E = error, class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw E(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace seqpar
