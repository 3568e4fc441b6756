#include "trace/import/chrome_scan.hpp"

#include <fmt/format.h>

#include <cstring>

#include "core/error.hpp"

namespace seqpar::import {

namespace {

class scanner {
 public:
  scanner(std::string_view text, const std::string& path)
      : begin_(text.data()), p_(text.data()), end_(text.data() + text.size()), path_(path) {}

  [[noreturn]] void fail(const char* what) const {
    seqpar::fail<trace_error>("{}: not a chrome-trace JSON file: {} at byte {}{}", path_, what,
                              p_ - begin_,
                              p_ >= end_ ? " (the file ends there: is it cut short?)" : "");
  }

  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  bool at_end() const { return p_ >= end_; }
  char peek() {
    ws();
    if (p_ >= end_) fail("unexpected end");
    return *p_;
  }
  void expect(char c) {
    if (peek() != c) fail(c == ':' ? "':' expected" : c == '{' ? "'{' expected" : "bad syntax");
    ++p_;
  }
  /// After '"': past the closing quote; the raw contents (escapes left as they are).
  std::string_view string_body() {
    const char* start = p_;
    for (;;) {
      const void* q = std::memchr(p_, '"', static_cast<std::size_t>(end_ - p_));
      if (!q) {
        p_ = end_;
        fail("unterminated string");
      }
      const char* quote = static_cast<const char*>(q);
      const char* b = quote;
      while (b > start && b[-1] == '\\') --b;
      p_ = quote + 1;
      if ((quote - b) % 2 == 0) return {start, static_cast<std::size_t>(quote - start)};
    }
  }
  std::string_view string() {
    expect('"');
    return string_body();
  }
  /// Skips one value; returns its text.
  std::string_view value() {
    ws();
    if (p_ >= end_) fail("a value expected");
    const char* start = p_;
    const char c = *p_;
    if (c == '"') {
      ++p_;
      string_body();
    } else if (c == '{' || c == '[') {
      int depth = 0;
      while (p_ < end_) {
        const char x = *p_++;
        if (x == '"') {
          string_body();
        } else if (x == '{' || x == '[') {
          ++depth;
        } else if (x == '}' || x == ']') {
          if (--depth == 0) break;
        }
      }
      if (depth != 0) fail("unbalanced brackets");
    } else {
      while (p_ < end_ && *p_ != ',' && *p_ != '}' && *p_ != ']' && *p_ != ' ' && *p_ != '\n' &&
             *p_ != '\r' && *p_ != '\t')
        ++p_;
      if (p_ == start) fail("a value expected");
    }
    return {start, static_cast<std::size_t>(p_ - start)};
  }
  /// The top-level "name" of the object at p_ (empty when absent or escaped), p_ past it.
  std::string_view object_name() {
    expect('{');
    std::string_view name;
    if (peek() == '}') {
      ++p_;
      return name;
    }
    for (;;) {
      const auto key = string();
      expect(':');
      if (key == "name" && peek() == '"') {
        ++p_;
        name = string_body();
        if (name.find('\\') != std::string_view::npos) name = {};
      } else {
        value();
      }
      const char c = peek();
      ++p_;
      if (c == '}') return name;
      if (c != ',') fail("',' or '}' expected in an event");
    }
  }

  const char* pos() const { return p_; }

 private:
  const char* begin_;
  const char* p_;
  const char* end_;
  const std::string& path_;
};

nlohmann::json parse_part(std::string_view text, const std::string& path, const char* what) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail<trace_error>("{}: not a chrome-trace JSON file: {} does not parse: {}", path, what,
                      e.what());
  }
}

void scan_events(scanner& s, chrome_events& out, const std::function<bool(std::string_view)>& keep,
                 const std::string& path) {
  s.expect('[');
  if (s.peek() == ']') {
    s.expect(']');
    return;
  }
  for (;;) {
    const char* start = (s.peek(), s.pos());
    ++out.total_events;
    if (*start == '{') {
      const auto name = s.object_name();
      if (!name.empty() && keep(name))
        out.events.push_back(parse_part({start, static_cast<std::size_t>(s.pos() - start)}, path,
                                        fmt::format("event {}", out.total_events).c_str()));
    } else {
      s.value();
    }
    const char c = s.peek();
    s.expect(c);
    if (c == ']') return;
    if (c != ',') s.fail("',' or ']' expected between events");
  }
}

}  // namespace

chrome_events scan_chrome_trace(std::string_view text,
                                const std::function<bool(std::string_view)>& keep,
                                const std::string& path) {
  chrome_events out;
  scanner s(text, path);
  if (s.peek() == '[') {
    scan_events(s, out, keep, path);
  } else {
    bool events_seen = false;
    s.expect('{');
    if (s.peek() != '}')
      for (;;) {
        const auto key = s.string();
        s.expect(':');
        if (key == "traceEvents" && s.peek() == '[') {
          scan_events(s, out, keep, path);
          events_seen = true;
        } else if (key == "distributedInfo") {
          out.distributed_info = parse_part(s.value(), path, "distributedInfo");
        } else {
          s.value();
        }
        if (s.peek() != ',') break;
        s.expect(',');
      }
    s.expect('}');
    if (!events_seen)
      fail<trace_error>("{}: no 'traceEvents' list (is this a PyTorch profiler trace?)", path);
  }
  s.ws();
  if (!s.at_end()) s.fail("text after the end of the trace");
  return out;
}

}  // namespace seqpar::import
