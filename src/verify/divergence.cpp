// The first departure of an SP step (divergence.hpp): capture, then check every call against
// its senders.
#include "verify/divergence.hpp"

#include "core/attention_mask.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>

#include "core/byte_pack.hpp"
#include "core/ring_schedule.hpp"

namespace seqpar::verify {

void capture_log::add(call_capture c) {
  std::lock_guard lock(mu_);
  calls_.push_back(std::move(c));
}

std::vector<call_capture> capture_log::calls() const {
  std::lock_guard lock(mu_);
  return calls_;
}

/// Element i of a buffer as a double (floating dtypes; integers as their value).
double captured_value(const std::vector<unsigned char>& b, std::size_t i, dtype t) {
  switch (t) {
    case dtype::f64: {
      double x;
      std::memcpy(&x, b.data() + i * 8, 8);
      return x;
    }
    case dtype::f32: {
      float x;
      std::memcpy(&x, b.data() + i * 4, 4);
      return x;
    }
    case dtype::bf16: {
      std::uint16_t h;
      std::memcpy(&h, b.data() + i * 2, 2);
      const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
      float x;
      std::memcpy(&x, &w, 4);
      return x;
    }
    case dtype::i32: {
      std::int32_t x;
      std::memcpy(&x, b.data() + i * 4, 4);
      return x;
    }
    case dtype::i64: {
      std::int64_t x;
      std::memcpy(&x, b.data() + i * 8, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

namespace {

using bytes = std::vector<unsigned char>;

class capturing final : public communicator {
 public:
  capturing(communicator& inner, capture_log& log, compute* memory)
      : inner_(inner), log_(log), memory_(memory) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override {
    auto c = start("all_to_all", g, t);
    const auto esz = static_cast<std::int64_t>(dtype_size(t));
    std::int64_t off = 0;
    for (auto n : send_counts) {
      c.sent.push_back(copy_of(static_cast<const unsigned char*>(send) + off * esz, n, t));
      off += n;
    }
    inner_.all_to_all(g, send, send_counts, recv, recv_counts, t, call_info());
    off = 0;
    for (auto n : recv_counts) {
      c.received.push_back(copy_of(static_cast<const unsigned char*>(recv) + off * esz, n, t));
      off += n;
    }
    log_.add(std::move(c));
  }
  void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                     dtype t) override {
    auto c = start("all_gather", g, t);
    c.sent.push_back(copy_of(send, count, t));
    inner_.all_gather(g, send, count, recv, t, call_info());
    const auto esz = static_cast<std::int64_t>(dtype_size(t));
    for (int j = 0; j < g.size(); ++j)
      c.received.push_back(
          copy_of(static_cast<const unsigned char*>(recv) + j * count * esz, count, t));
    log_.add(std::move(c));
  }
  void do_reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                         dtype t) override {
    auto c = start("reduce_scatter", g, t);
    c.sent.push_back(copy_of(send, count * g.size(), t));
    inner_.reduce_scatter(g, send, recv, count, t, call_info());
    c.received.push_back(copy_of(recv, count, t));
    log_.add(std::move(c));
  }
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override {
    auto c = start("all_reduce", g, t);
    c.sent.push_back(copy_of(buf, count, t));
    inner_.all_reduce(g, buf, count, t, call_info());
    c.received.push_back(copy_of(buf, count, t));
    log_.add(std::move(c));
  }
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override {
    auto c = start("send_recv", g, t);
    for (const auto& o : ops)
      if (o.dir == p2p_op::kind::send) {
        c.sent.push_back(copy_of(o.buf, o.count, t));
        c.send_peer.push_back(o.peer);
      }
    inner_.send_recv(g, ops, t, call_info());
    for (const auto& o : ops)
      if (o.dir == p2p_op::kind::recv) {
        c.received.push_back(copy_of(o.buf, o.count, t));
        c.recv_peer.push_back(o.peer);
      }
    log_.add(std::move(c));
  }
  void do_barrier(const comm_group& g) override { inner_.barrier(g, call_info()); }

 private:
  /// count elements at p, read from host memory or through the backend that owns them.
  bytes copy_of(const void* p, std::int64_t count, dtype t) const {
    bytes out(static_cast<std::size_t>(count) * dtype_size(t));
    if (out.empty()) return out;
    if (memory_ != nullptr)
      memory_->read_bytes(out.data(), p, out.size());
    else
      std::memcpy(out.data(), p, out.size());
    return out;
  }
  compute* memory_;

  call_capture start(const char* op, const comm_group& g, dtype t) {
    call_capture c;
    c.rank = inner_.rank();
    c.order = order_++;
    c.op = op;
    c.tag = call_info().tag;
    c.group = g.name;
    c.members = g.ranks;
    c.seq = seq_[g.name]++;
    c.type = t;
    c.in_shape = call_info().in_shape;
    c.out_shape = call_info().out_shape;
    return c;
  }

  communicator& inner_;
  capture_log& log_;
  std::int64_t order_ = 0;
  std::map<std::string, std::int64_t> seq_;
};

std::size_t elements(const bytes& b, dtype t) { return b.size() / dtype_size(t); }

bool all_zero(const bytes& b) {
  return std::all_of(b.begin(), b.end(), [](unsigned char x) { return x == 0; });
}

}  // namespace

std::string value_runs(std::vector<std::int64_t> xs) {
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  std::vector<std::string> out;
  for (std::size_t i = 0; i < xs.size();) {
    std::size_t j = i;
    while (j + 1 < xs.size() && xs[j + 1] == xs[j] + 1) ++j;
    if (out.size() == 6) {
      out.push_back("…");
      break;
    }
    out.push_back(i == j ? fmt::format("{}", xs[i]) : fmt::format("{}–{}", xs[i], xs[j]));
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(out, ", "));
}

namespace {

/// One rank's mismatch in a call: what it received wrong, in words, and the element ranges.
struct mismatch {
  const call_capture* call;
  std::string what;
  /// (chunk index, first element, last element + 1) of the wrong data, for the tokens.
  std::vector<std::tuple<int, std::size_t, std::size_t>> spans;
};

using key = std::tuple<std::string, std::int64_t, int>;  // group, seq, rank

class checker {
 public:
  checker(const std::vector<call_capture>& calls) {
    for (const auto& c : calls) by_[{c.group, c.seq, c.rank}] = &c;
  }

  std::optional<mismatch> check(const call_capture& c) const {
    const int me = index_of(c, c.rank);
    if (me < 0) return std::nullopt;
    if (c.op == "all_to_all" || c.op == "all_gather") return chunks(c, me);
    if (c.op == "all_reduce" || c.op == "reduce_scatter") return reduction(c, me);
    if (c.op == "send_recv") return messages(c, me);
    return std::nullopt;
  }

 private:
  static int index_of(const call_capture& c, int rank) {
    const auto it = std::find(c.members.begin(), c.members.end(), rank);
    return it == c.members.end() ? -1 : static_cast<int>(it - c.members.begin());
  }
  const call_capture* peer(const call_capture& c, int member) const {
    if (member < 0 || member >= static_cast<int>(c.members.size())) return nullptr;
    const auto it = by_.find({c.group, c.seq, c.members[static_cast<std::size_t>(member)]});
    return it == by_.end() ? nullptr : it->second;
  }

  std::optional<mismatch> chunks(const call_capture& c, int me) const {
    const int n = static_cast<int>(c.members.size());
    std::vector<bytes> want(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j) {
      const auto* d = peer(c, j);
      if (!d) return std::nullopt;  // a member without the call: the transport names that
      const auto& src = d->sent;
      const std::size_t at = c.op == "all_to_all" ? static_cast<std::size_t>(me) : 0;
      if (at >= src.size()) return std::nullopt;
      want[static_cast<std::size_t>(j)] = src[at];
    }
    if (static_cast<int>(c.received.size()) != n) return std::nullopt;
    std::vector<int> wrong;
    for (int j = 0; j < n; ++j)
      if (c.received[static_cast<std::size_t>(j)] != want[static_cast<std::size_t>(j)])
        wrong.push_back(j);
    if (wrong.empty()) return std::nullopt;
    mismatch m{&c, "", {}};
    const auto name = [&](int j) {
      return fmt::format("member {} (rank {})", j, c.members[static_cast<std::size_t>(j)]);
    };
    bool reversed = wrong.size() > 1;
    for (int j : wrong)
      reversed = reversed && c.received[static_cast<std::size_t>(j)] ==
                                 want[static_cast<std::size_t>(n - 1 - j)];
    std::vector<std::string> parts;
    for (int j : wrong) {
      const auto& got = c.received[static_cast<std::size_t>(j)];
      const auto& exp = want[static_cast<std::size_t>(j)];
      // The element span that differs (the chunk's length when the lengths differ).
      std::size_t first = 0, last = 0;
      const std::size_t esz = dtype_size(c.type);
      const std::size_t len = std::min(got.size(), exp.size()) / esz;
      for (std::size_t e = 0; e < len; ++e)
        if (std::memcmp(got.data() + e * esz, exp.data() + e * esz, esz) != 0) {
          if (last == 0) first = e;
          last = e + 1;
        }
      if (got.size() != exp.size()) last = std::max(got.size(), exp.size()) / esz;
      m.spans.emplace_back(j, first, last);
      if (reversed) continue;
      if (all_zero(got) && !all_zero(exp)) {
        parts.push_back(fmt::format("zeros from {}: a dropped chunk", name(j)));
        continue;
      }
      int other = -1;
      for (int i = 0; i < n && other < 0; ++i)
        if (i != j && got == want[static_cast<std::size_t>(i)]) other = i;
      if (other >= 0) {
        const bool swapped =
            std::find(wrong.begin(), wrong.end(), other) != wrong.end() &&
            c.received[static_cast<std::size_t>(other)] == want[static_cast<std::size_t>(j)];
        parts.push_back(fmt::format(
            "{}'s chunk in place of {}'s: {}", name(other), name(j),
            swapped ? "two members' chunks swapped places" : "a chunk duplicated over another"));
        continue;
      }
      parts.push_back(
          fmt::format("from {} data that are no member's chunk for it ({} of {} "
                      "elements differ)",
                      name(j), last - first, exp.size() / esz));
    }
    if (reversed && n == 2)
      parts.push_back(
          "the two members' chunks in swapped places (with two members: the reverse order)");
    else if (reversed)
      parts.push_back("every member's chunk in reverse member order: the chunks were permuted");
    m.what = fmt::format("{}", fmt::join(parts, "; "));
    return m;
  }

  std::optional<mismatch> reduction(const call_capture& c, int me) const {
    const int n = static_cast<int>(c.members.size());
    if (c.received.empty() || c.sent.empty()) return std::nullopt;
    const auto& got = c.received[0];
    const std::size_t count = elements(got, c.type);
    const std::size_t base = c.op == "reduce_scatter" ? static_cast<std::size_t>(me) * count : 0;
    std::vector<double> sum(count, 0.0), mag(count, 0.0);
    for (int j = 0; j < n; ++j) {
      const auto* d = peer(c, j);
      if (!d || d->sent.empty() || elements(d->sent[0], c.type) < base + count) return std::nullopt;
      for (std::size_t e = 0; e < count; ++e) {
        const double x = captured_value(d->sent[0], base + e, c.type);
        sum[e] += x;
        mag[e] += std::abs(x);
      }
    }
    // Summed in the dtype in some order: within n roundings of the magnitudes; integers (token
    // counts) exactly.
    const bool integral = c.type == dtype::i32 || c.type == dtype::i64;
    const double u = integral               ? 0.0
                     : c.type == dtype::f64 ? 0x1p-53
                     : c.type == dtype::f32 ? 0x1p-24
                                            : 0x1p-8;
    bool zero = true, twice = true, reversed = true;
    std::optional<double> off;  // integers: every wrong element off by the same amount
    bool same_off = integral;
    std::size_t wrong = 0, first = 0, last = 0;
    for (std::size_t e = 0; e < count; ++e) {
      const double g = captured_value(got, e, c.type), tol = 2.0 * n * u * mag[e];
      const bool ok = std::abs(g - sum[e]) <= tol;
      if (!ok) {
        if (wrong++ == 0) first = e;
        last = e + 1;
        if (!off) off = g - sum[e];
        same_off = same_off && g - sum[e] == *off;
      }
      zero = zero && g == 0;
      twice = twice && std::abs(g - 2 * sum[e]) <= 2 * tol;
      reversed = reversed && std::abs(g - sum[count - 1 - e]) <= 2.0 * n * u * mag[count - 1 - e];
    }
    if (wrong == 0) return std::nullopt;
    mismatch m{&c, "", {{0, first, last}}};
    if (integral && same_off && off && !zero && !(twice && wrong == count)) {
      m.what = fmt::format(
          "an integer sum off by {:+g}: the members' {} add up to {:.0f}, the result holds "
          "{:.0f}{} (a count — of tokens, labels — must add up exactly; an off-by-one count "
          "moves every mean divided by it)",
          *off, wrong == 1 ? "values" : "first values", sum[first], sum[first] + *off,
          wrong > 1 ? fmt::format(" ({} of {} elements off)", wrong, count) : std::string{});
      return m;
    }
    m.what = zero       ? "zeros where the sum was expected: the reduction's result was dropped"
             : twice    ? "twice the sum: the reduction's result was counted twice"
             : reversed ? "the sum in reverse element order: the result was permuted"
                        : fmt::format(
                              "a result that is not the sum of the members' inputs ({} "
                              "of {} elements differ)",
                              wrong, count);
    return m;
  }

  std::optional<mismatch> messages(const call_capture& c, int me) const {
    std::map<int, int> seen;  // per peer: its sends to me matched so far
    mismatch m{&c, "", {}};
    std::vector<std::string> parts;
    for (std::size_t k = 0; k < c.received.size(); ++k) {
      const int p = c.recv_peer[k];
      const auto* d = peer(c, p);
      if (!d) return std::nullopt;
      const int nth = seen[p]++;
      int found = -1, count = 0;
      for (std::size_t s = 0; s < d->sent.size() && found < 0; ++s)
        if (d->send_peer[s] == me && count++ == nth) found = static_cast<int>(s);
      if (found < 0) continue;
      const auto& exp = d->sent[static_cast<std::size_t>(found)];
      const auto& got = c.received[k];
      if (got == exp) continue;
      m.spans.emplace_back(static_cast<int>(k), 0, got.size() / dtype_size(c.type));
      std::string from =
          fmt::format("member {} (rank {})", p, c.members[static_cast<std::size_t>(p)]);
      if (all_zero(got) && !all_zero(exp))
        parts.push_back(fmt::format("zeros in the message from {}: a dropped message", from));
      else
        parts.push_back(fmt::format("a message from {} that is not what it sent", from));
    }
    if (parts.empty()) return std::nullopt;
    m.what = fmt::format("{}", fmt::join(parts, "; "));
    return m;
  }

  std::map<key, const call_capture*> by_;
};

/// The global tokens of elements [first, last) of a call's chunk. The Ulysses all-to-all's
/// chunks are [s, heads, D] pieces: gathering the sequence (out_shape[0] = U·in_shape[0])
/// member j's chunk holds member j's local rows; scattering it back, the receiver's own. A
/// ring group's all-gather chunk j holds ring rank j's gathered rows. Other calls: none.
std::vector<std::int64_t> chunk_tokens(const call_capture& c, int chunk, std::size_t first,
                                       std::size_t last, std::size_t chunk_elems,
                                       const token_map& tokens) {
  if (!tokens) return {};
  std::int64_t row_elems = 0;
  std::vector<std::int64_t> rows;
  if (c.op == "all_to_all" && c.in_shape.size() == 3 && c.out_shape.size() == 3) {
    const auto U = static_cast<std::int64_t>(c.members.size());
    if (c.out_shape[0] == U * c.in_shape[0]) {
      row_elems = c.out_shape[1] * c.out_shape[2];
      rows = tokens(c.members[static_cast<std::size_t>(chunk)], false);
    } else if (c.in_shape[0] == U * c.out_shape[0]) {
      row_elems = c.in_shape[1] * c.in_shape[2];
      rows = tokens(c.rank, false);
    }
  } else if (c.op == "all_gather" && c.group.starts_with("ring")) {
    rows = tokens(c.members[static_cast<std::size_t>(chunk)], true);
    if (!rows.empty() && chunk_elems % rows.size() == 0)
      row_elems = static_cast<std::int64_t>(chunk_elems / rows.size());
  }
  if (row_elems <= 0) return {};
  std::vector<std::int64_t> out;
  for (auto r = static_cast<std::int64_t>(first) / row_elems;
       r < (static_cast<std::int64_t>(last) + row_elems - 1) / row_elems &&
       r < static_cast<std::int64_t>(rows.size());
       ++r)
    out.push_back(rows[static_cast<std::size_t>(r)]);
  return out;
}

}  // namespace

std::unique_ptr<communicator> capturing_communicator(communicator& inner, capture_log& log,
                                                     compute* memory) {
  return std::make_unique<capturing>(inner, log, memory);
}

std::optional<divergence> first_divergence(const std::vector<call_capture>& calls,
                                           const token_map& tokens, std::int64_t row_length) {
  const checker ck(calls);
  std::vector<mismatch> found;
  for (const auto& c : calls)
    if (auto m = ck.check(c)) found.push_back(std::move(*m));
  if (found.empty()) return std::nullopt;
  // The earliest call any rank issued (a departure's consequences are delivered faithfully, so
  // only the departing call itself is inconsistent; the order settles ties between calls).
  const auto first = std::min_element(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::tie(a.call->order, a.call->rank) < std::tie(b.call->order, b.call->rank);
  });
  const call_capture& c = *first->call;
  divergence d;
  d.op = c.op;
  d.tag = c.tag;
  d.group = c.group;
  d.call = c.seq;
  const auto dot = c.tag.find('.');
  if (c.tag.size() > 1 && c.tag[0] == 'L' && dot != std::string::npos)
    d.layer = c.tag.substr(0, dot);
  const std::string dotted = "." + c.tag + ".";
  if (dotted.find(".fwd.") != std::string::npos) d.pass = "forward";
  if (dotted.find(".bwd.") != std::string::npos) d.pass = "backward";
  std::vector<std::pair<std::string, std::vector<int>>> said;  // what → ranks, in first order
  std::vector<std::int64_t> toks;
  bool pad = false;
  for (const auto& m : found) {
    if (m.call->group != c.group || m.call->seq != c.seq) continue;
    d.ranks.push_back(m.call->rank);
    auto it =
        std::find_if(said.begin(), said.end(), [&](const auto& w) { return w.first == m.what; });
    if (it == said.end()) it = said.insert(said.end(), {m.what, {}});
    it->second.push_back(m.call->rank);
    for (const auto& [chunk, lo, hi] : m.spans)
      for (auto t : chunk_tokens(*m.call, chunk, lo, hi,
                                 chunk < static_cast<int>(m.call->received.size())
                                     ? m.call->received[static_cast<std::size_t>(chunk)].size() /
                                           dtype_size(m.call->type)
                                     : 0,
                                 tokens)) {
        if (t < row_length) {
          toks.push_back(t);
          d.wrong_tokens.emplace_back(m.call->rank, t);
        } else {
          pad = true;
        }
      }
  }
  std::sort(d.ranks.begin(), d.ranks.end());
  std::vector<std::string> per_rank;
  for (auto& [what, ranks] : said) {
    std::sort(ranks.begin(), ranks.end());
    per_rank.push_back(fmt::format("rank{} {} received {}", ranks.size() > 1 ? "s" : "",
                                   fmt::join(ranks, ", "), what));
  }
  if (!toks.empty())
    d.tokens = fmt::format("tokens {}{}", value_runs(toks), pad ? " (and padding)" : "");
  else if (pad)
    d.tokens = "padding tokens only";
  d.cause = first->what;
  const std::string where =
      d.pass.empty() ? std::string("the step")
                     : fmt::format("the {} pass{}", d.pass,
                                   d.layer.empty() ? "" : fmt::format(", layer {}", d.layer));
  d.line =
      fmt::format("first departure: {} at {} {} (call {} of group {}): {}{}", where, d.op,
                  d.tag.empty() ? "(untagged)" : d.tag, d.call, d.group, fmt::join(per_rank, "; "),
                  d.tokens.empty() ? "" : fmt::format(" — {}", d.tokens));
  return d;
}

void layer_trace::add(int rank, int layer, const std::string& stage, Eigen::MatrixXd rows) {
  std::lock_guard lock(mu_);
  rows_[{rank, layer, stage}] = std::move(rows);
}

std::string layer_trace::pack() const {
  std::lock_guard lock(mu_);
  byte_writer w;
  w.i64(static_cast<std::int64_t>(rows_.size()));
  for (const auto& [key, m] : rows_) {
    const auto& [rank, layer, stage] = key;
    w.i64(rank);
    w.i64(layer);
    w.str(stage);
    w.i64(m.rows());
    w.i64(m.cols());
    w.blob(m.data(), static_cast<std::size_t>(m.size()) * sizeof(double));
  }
  return std::move(w.bytes());
}

void layer_trace::merge(std::string_view packed) {
  byte_reader r(packed);
  for (auto n = r.i64(); n > 0; --n) {
    const auto rank = static_cast<int>(r.i64()), layer = static_cast<int>(r.i64());
    auto stage = r.str();
    const auto rows = r.i64(), cols = r.i64();
    const auto data = r.blob();
    if (rows < 0 || cols < 0 || data.size() != static_cast<std::size_t>(rows * cols) * 8)
      fail<error>("a packed layer boundary is corrupt: {}×{} with {} bytes", rows, cols,
                  data.size());
    Eigen::MatrixXd m(rows, cols);
    std::memcpy(m.data(), data.data(), data.size());
    add(rank, layer, stage, std::move(m));
  }
}

std::string pack_calls(const std::vector<call_capture>& calls) {
  byte_writer w;
  const auto runs = [&w](const std::vector<bytes>& v) {
    w.i64(static_cast<std::int64_t>(v.size()));
    for (const auto& b : v) w.blob(b.data(), b.size());
  };
  w.i64(static_cast<std::int64_t>(calls.size()));
  for (const auto& c : calls) {
    w.i64(c.rank);
    w.i64(c.order);
    w.str(c.op);
    w.str(c.tag);
    w.str(c.group);
    w.list(c.members);
    w.i64(c.seq);
    w.i64(static_cast<std::int64_t>(c.type));
    w.list(c.in_shape);
    w.list(c.out_shape);
    runs(c.sent);
    runs(c.received);
    w.list(c.send_peer);
    w.list(c.recv_peer);
  }
  return std::move(w.bytes());
}

std::vector<call_capture> unpack_calls(std::string_view packed) {
  byte_reader r(packed);
  const auto runs = [&r] {
    std::vector<bytes> v(static_cast<std::size_t>(std::max<std::int64_t>(0, r.i64())));
    for (auto& b : v) {
      const auto s = r.blob();
      b.assign(s.begin(), s.end());
    }
    return v;
  };
  std::vector<call_capture> calls;
  for (auto n = r.i64(); n > 0; --n) {
    call_capture c;
    c.rank = static_cast<int>(r.i64());
    c.order = r.i64();
    c.op = r.str();
    c.tag = r.str();
    c.group = r.str();
    c.members = r.list<int>();
    c.seq = r.i64();
    c.type = static_cast<dtype>(r.i64());
    c.in_shape = r.list<std::int64_t>();
    c.out_shape = r.list<std::int64_t>();
    c.sent = runs();
    c.received = runs();
    c.send_peer = r.list<int>();
    c.recv_peer = r.list<int>();
    calls.push_back(std::move(c));
  }
  return calls;
}

std::vector<std::string> gather_to_first(communicator& comm, const comm_group& g,
                                         const std::string& mine, const std::string& tag) {
  const auto P = static_cast<std::size_t>(g.size());
  const int me = g.index_of(comm.rank());
  const std::int64_t mine_bytes = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(P);
  comm.all_gather(g, &mine_bytes, 1, sizes.data(), dtype::i64, op_info{tag + ".sizes", {1}, {1}});
  const auto words = [](std::int64_t n) { return (n + 7) / 8; };
  std::vector<std::int64_t> send(static_cast<std::size_t>(words(mine_bytes)), 0);
  if (!mine.empty()) std::memcpy(send.data(), mine.data(), mine.size());
  std::vector<std::int64_t> send_counts(P, 0), recv_counts(P, 0);
  send_counts[0] = static_cast<std::int64_t>(send.size());
  std::int64_t total = 0;
  if (me == 0)
    for (std::size_t k = 0; k < P; ++k) total += recv_counts[k] = words(sizes[k]);
  std::vector<std::int64_t> recv(static_cast<std::size_t>(total));
  comm.all_to_all(g, send.data(), send_counts, recv.data(), recv_counts, dtype::i64,
                  op_info{tag, {static_cast<std::int64_t>(send.size())}, {total}});
  std::vector<std::string> out;
  if (me != 0) return out;
  std::int64_t at = 0;
  for (std::size_t k = 0; k < P; ++k) {
    out.emplace_back(reinterpret_cast<const char*>(recv.data() + at),
                     static_cast<std::size_t>(sizes[k]));
    at += recv_counts[k];
  }
  return out;
}

const Eigen::MatrixXd* layer_trace::get(int rank, int layer, const std::string& stage) const {
  std::lock_guard lock(mu_);
  const auto it = rows_.find({rank, layer, stage});
  return it == rows_.end() ? nullptr : &it->second;
}

}  // namespace seqpar::verify
