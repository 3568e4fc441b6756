// NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,COLL) logs → seqpar-trace/1.
//   host:pid:tid [dev] NCCL INFO AllGather: opCount 3 sendbuff 0x… recvbuff 0x… count 1024
//     datatype 7 op 0 root 0 comm 0x… [nranks=4] stream 0x…      (RCCL adds "globalrank N")
//   host:pid:tid [dev] NCCL INFO comm 0x… rank 2 nranks 4 cudaDev 2 … commId 0x… - Init COMPLETE
// Send/Recv lines carry the peer's comm rank in "root".
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "core/error.hpp"
#include "trace/import/import.hpp"

namespace seqpar::import {

namespace {

using trace::call_record;
using trace::dims;

/// ncclDataType_t values (nccl.h).
std::string nccl_dtype(int v) {
  static const char* names[] = {"int8",    "uint8",    "int32",         "uint32",
                                "int64",   "uint64",   "float16",       "float32",
                                "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2"};
  if (v >= 0 && v < 12) return names[v];
  return fmt::format("nccl_datatype_{}", v);
}

struct comm_key {
  std::string proc;  // host:pid
  std::string comm;  // pointer
  bool operator<(const comm_key& o) const {
    return std::tie(proc, comm) < std::tie(o.proc, o.comm);
  }
};

struct comm_info {
  int rank = -1, nranks = 0;
  std::string id;  // commId when logged
  int order = 0;   // creation order within the process
};

struct op_line {
  comm_key key;
  std::string name;
  std::int64_t count;
  int datatype, root, nranks;
  int globalrank;
  std::int64_t line;
  std::string file;
};

bool all_digits(std::string_view t) {
  return !t.empty() && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
}
bool is_hex_pointer(std::string_view t) {
  return t.size() > 2 && t[0] == '0' && (t[1] == 'x' || t[1] == 'X') &&
         std::all_of(t.begin() + 2, t.end(), [](char c) { return std::isxdigit(c) != 0; });
}
// A decimal field as the regex-era parser read it: -1 when longer than 15 digits.
long long number(std::string_view t) { return t.size() > 15 ? -1LL : std::stoll(std::string(t)); }

/// One log line in NCCL's INFO form, split without regular expressions (libstdc++'s std::regex
/// backtracks exponentially on crafted lines: a 3.5 KB line took over 13 s — found by fuzzing):
/// "host:pid:tid [dev] … NCCL INFO <tokens>".
struct info_line {
  std::string proc;                    ///< host:pid
  std::vector<std::string_view> info;  ///< whitespace-separated tokens after "NCCL INFO"
};

// Whitespace-separated tokens of `text`.
std::vector<std::string_view> tokens(std::string_view text) {
  std::vector<std::string_view> out;
  while (!text.empty()) {
    const auto b = text.find_first_not_of(" \t\r");
    if (b == std::string_view::npos) break;
    text.remove_prefix(b);
    const auto e = text.find_first_of(" \t\r");
    out.push_back(text.substr(0, e));
    if (e == std::string_view::npos) break;
    text.remove_prefix(e);
  }
  return out;
}

// "host:pid:tid" (host without ':', pid and tid decimal) → "host:pid", else empty.
std::string_view process_of(std::string_view t) {
  const auto c1 = t.find(':');
  const auto c2 = c1 == std::string_view::npos ? c1 : t.find(':', c1 + 1);
  if (c1 == 0 || c2 == std::string_view::npos) return {};
  if (!all_digits(t.substr(c1 + 1, c2 - c1 - 1)) || !all_digits(t.substr(c2 + 1))) return {};
  return t.substr(0, c2);
}

std::optional<info_line> split_info_line(const std::string& line) {
  const auto at = line.find("NCCL INFO ");
  if (at == std::string::npos) return std::nullopt;
  // Before it (after any prefix such as a timestamp): "host:pid:tid [dev]".
  const auto before = tokens(std::string_view(line).substr(0, at));
  for (std::size_t k = 0; k + 1 < before.size(); ++k) {
    const auto proc = process_of(before[k]);
    const auto dev = before[k + 1];
    if (proc.empty() || dev.size() < 3 || dev.front() != '[' || dev.back() != ']' ||
        !all_digits(dev.substr(1, dev.size() - 2)))
      continue;
    return info_line{std::string(proc), tokens(std::string_view(line).substr(at + 10))};
  }
  return std::nullopt;
}

const std::set<std::string_view> collective_names = {"AllReduce", "AllGather", "ReduceScatter",
                                                     "Broadcast", "Reduce",    "AllToAll",
                                                     "AlltoAll",  "Send",      "Recv"};

}  // namespace

trace::trace_data from_nccl_log(const std::vector<std::string>& files) {
  std::map<comm_key, comm_info> comms;
  std::map<std::string, int> comms_per_proc;
  std::vector<op_line> ops;
  std::set<std::string> notes;
  std::vector<std::string> proc_order;  // first appearance
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail<trace_error>("cannot read '{}': no such file or not readable", path);
    std::string line;
    std::int64_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      if (line.size() > 4096 || line.find("NCCL INFO") == std::string::npos) continue;
      const auto parsed = split_info_line(line);
      if (!parsed) continue;
      const auto& t = parsed->info;
      auto tok = [&](std::size_t i) { return i < t.size() ? t[i] : std::string_view(); };
      // "<Name>: opCount X sendbuff S recvbuff R count N datatype D op O root T comm C
      // [nranks=K] …"
      const auto name = tok(0).empty() ? tok(0) : tok(0).substr(0, tok(0).size() - 1);
      const auto nranks_tok = tok(17);
      const bool op_line_form =
          !tok(0).empty() && tok(0).back() == ':' && collective_names.contains(name) &&
          tok(1) == "opCount" && tok(3) == "sendbuff" && tok(5) == "recvbuff" &&
          tok(7) == "count" && all_digits(tok(8)) && tok(9) == "datatype" && all_digits(tok(10)) &&
          tok(11) == "op" && all_digits(tok(12)) && tok(13) == "root" &&
          (all_digits(tok(14)) ||
           (tok(14).size() > 1 && tok(14)[0] == '-' && all_digits(tok(14).substr(1)))) &&
          tok(15) == "comm" && !tok(16).empty() && nranks_tok.starts_with("[nranks=") &&
          nranks_tok.ends_with("]") && all_digits(nranks_tok.substr(8, nranks_tok.size() - 9));
      if (op_line_form) {
        op_line o;
        o.key = {parsed->proc, std::string(tok(16))};
        o.name = std::string(name);
        o.count = number(tok(8));
        o.datatype = static_cast<int>(number(tok(10)));
        o.root = static_cast<int>(
            std::max<long long>(-1, std::min<long long>(number(tok(14)), 1 << 20)));
        o.nranks = static_cast<int>(
            std::min<long long>(number(nranks_tok.substr(8, nranks_tok.size() - 9)), 1 << 20));
        o.globalrank = -1;
        for (std::size_t i = 18; i + 1 < t.size(); ++i)
          if (t[i] == "globalrank" && all_digits(t[i + 1]) && t[i + 1].size() < 8)
            o.globalrank = std::stoi(std::string(t[i + 1]));
        o.line = n;
        o.file = path;
        if (o.count < 0 || o.nranks <= 0)
          fail<trace_error>("{}:{}: NCCL line with an impossible count or nranks", path, n);
        if (std::find(proc_order.begin(), proc_order.end(), o.key.proc) == proc_order.end())
          proc_order.push_back(o.key.proc);
        ops.push_back(std::move(o));
        continue;
      }
      // "… comm 0x… rank R nranks N …" (the last such run on the line), "commId 0x…" after it.
      std::size_t at = t.size();
      for (std::size_t i = 0; i + 5 < t.size(); ++i)
        if (t[i] == "comm" && is_hex_pointer(t[i + 1]) && t[i + 2] == "rank" &&
            all_digits(t[i + 3]) && t[i + 4] == "nranks" && all_digits(t[i + 5]))
          at = i;
      if (at == t.size()) continue;
      if (t[at + 3].size() > 7 || t[at + 5].size() > 7) continue;
      comm_key k{parsed->proc, std::string(t[at + 1])};
      auto& c = comms[k];
      if (c.nranks == 0) c.order = comms_per_proc[k.proc]++;
      c.rank = std::stoi(std::string(t[at + 3]));
      c.nranks = std::stoi(std::string(t[at + 5]));
      for (std::size_t i = at + 6; i + 1 < t.size(); ++i)
        if (t[i] == "commId" && is_hex_pointer(t[i + 1])) {
          c.id = std::string(t[i + 1]);
          break;
        }
      if (std::find(proc_order.begin(), proc_order.end(), k.proc) == proc_order.end())
        proc_order.push_back(k.proc);
    }
  }
  if (ops.empty())
    fail<trace_error>(
        "no NCCL collective lines found; run with NCCL_DEBUG=INFO "
        "NCCL_DEBUG_SUBSYS=INIT,COLL (lines like 'NCCL INFO AllReduce: opCount …')");
  // Global rank of every process: RCCL's globalrank, else its rank in its largest communicator
  // (the world), else its order of appearance.
  std::map<std::string, int> global;
  for (const auto& o : ops)
    if (o.globalrank >= 0) global[o.key.proc] = o.globalrank;
  std::map<std::string, std::pair<int, int>> best;  // proc → (nranks, rank)
  for (const auto& [k, c] : comms)
    if (c.rank >= 0 && c.nranks > best[k.proc].first) best[k.proc] = {c.nranks, c.rank};
  bool guessed = false;
  for (std::size_t i = 0; i < proc_order.size(); ++i) {
    const auto& p = proc_order[i];
    if (global.contains(p)) continue;
    if (best.contains(p) && best[p].first > 0)
      global[p] = best[p].second;
    else {
      global[p] = static_cast<int>(i);
      guessed = true;
    }
  }
  if (guessed)
    notes.insert(
        "some processes logged no 'Init COMPLETE' line with their rank: their global "
        "rank is their order of appearance in the logs");
  // Communicator identity across processes: commId when logged, else (nranks, creation order).
  auto group_id = [&](const comm_key& k, int nranks) {
    auto it = comms.find(k);
    if (it != comms.end() && !it->second.id.empty()) return "comm" + it->second.id.substr(0, 12);
    const int order = it != comms.end() ? it->second.order : 0;
    notes.insert(
        "communicators without a logged commId are matched across processes by size "
        "and creation order");
    return fmt::format("nccl_n{}_{}", nranks, order);
  };
  trace::trace_data t;
  t.meta.source = "nccl-log";
  std::map<std::string, std::map<int, int>> members;  // group → comm rank → global rank
  std::map<std::pair<int, std::string>, std::int64_t> seq;
  int world = 0;
  for (const auto& o : ops) {
    const int g = global[o.key.proc];
    world = std::max(world, g + 1);
    const auto group = group_id(o.key, o.nranks);
    auto ci = comms.find(o.key);
    if (ci != comms.end() && ci->second.rank >= 0)
      members[group][ci->second.rank] = g;
    else if (o.nranks == 1)
      members[group][0] = g;
    call_record c;
    c.rank = g;
    c.group = group;
    c.seq = seq[{g, group}]++;
    c.dtype = nccl_dtype(o.datatype);
    const std::int64_t P = o.nranks;
    const std::string& n = o.name;
    if (n == "Send" || n == "Recv") {
      c.p2p = true;
      c.op = n == "Send" ? "send" : "recv";
      c.shape = dims{o.count};
      c.tag = fmt::format("peer_comm_rank={}", o.root);  // resolved below
    } else {
      c.op = n == "AllReduce"       ? "all_reduce"
             : n == "AllGather"     ? "all_gather"
             : n == "ReduceScatter" ? "reduce_scatter"
             : n == "Broadcast"     ? "broadcast"
             : n == "Reduce"        ? "all_reduce"
                                    : "all_to_all";
      if (n == "Reduce") notes.insert("NCCL Reduce is recorded as all_reduce (same size law)");
      // NCCL counts: AllGather sendcount, ReduceScatter recvcount, AllToAll count per peer.
      c.in_numel = c.op == "reduce_scatter" || c.op == "all_to_all" ? o.count * P : o.count;
      c.out_numel = c.op == "all_gather" || c.op == "all_to_all" ? o.count * P : o.count;
    }
    t.calls.push_back(std::move(c));
  }
  // Peers: comm rank → global rank.
  for (auto& c : t.calls) {
    if (!c.p2p) continue;
    const int peer_comm = std::stoi(c.tag.substr(c.tag.find('=') + 1));
    c.tag.clear();
    auto& m = members[c.group];
    if (auto it = m.find(peer_comm); it != m.end() && it->second != c.rank)
      c.peer = it->second;
    else
      notes.insert(
          "some Send/Recv peers could not be mapped to global ranks (no Init line for "
          "the peer's communicator); those were not paired");
  }
  for (const auto& [group, m] : members) {
    std::vector<int> ranks;
    for (const auto& [cr, g] : m) ranks.push_back(g);
    // Only list fully known groups (every comm rank 0..n-1 seen).
    bool full = !m.empty() && m.rbegin()->first + 1 == static_cast<int>(m.size());
    std::set<int> uniq(ranks.begin(), ranks.end());
    if (full && uniq.size() == ranks.size()) t.meta.groups[group] = ranks;
  }
  std::stable_sort(t.calls.begin(), t.calls.end(),
                   [](const call_record& a, const call_record& b) { return a.rank < b.rank; });
  t.meta.world_size = std::max(world, 1);
  notes.insert(
      "NCCL logs record element counts, not shapes, and no tags or states: SP shape "
      "rules were not applied; all-to-all exchanged as grouped Send/Recv is checked as "
      "p2p pairs");
  t.meta.notes.assign(notes.begin(), notes.end());
  return t;
}

}  // namespace seqpar::import
