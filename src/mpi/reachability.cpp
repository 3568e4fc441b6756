#include "mpi/reachability.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_received (glibc's lacks it)
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace seqpar::mpi {

namespace {

constexpr std::size_t host_bytes = 63, max_addresses = 6;

std::vector<std::uint32_t> interface_addresses() {
  std::vector<std::uint32_t> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (auto* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
      if (!(a->ifa_flags & IFF_UP) || (a->ifa_flags & IFF_LOOPBACK)) continue;
      const auto addr = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr;
      if (std::find(out.begin(), out.end(), addr) == out.end() && out.size() < max_addresses)
        out.push_back(addr);
    }
    freeifaddrs(list);
  }
  if (out.empty()) out.push_back(htonl(INADDR_LOOPBACK));
  return out;
}

std::string dotted(std::uint32_t addr) {
  char text[INET_ADDRSTRLEN] = {};
  in_addr a{};
  a.s_addr = addr;
  inet_ntop(AF_INET, &a, text, sizeof text);
  return text;
}

}  // namespace

void endpoint::to_wire(char* out) const {
  std::memset(out, 0, wire_size);
  std::memcpy(out, host.data(), std::min(host.size(), host_bytes));
  std::memcpy(out + 64, &port, sizeof port);
  const auto n = static_cast<std::uint8_t>(std::min(ipv4.size(), max_addresses));
  std::memcpy(out + 66, &n, 1);
  for (std::size_t k = 0; k < n; ++k) std::memcpy(out + 68 + 4 * k, &ipv4[k], 4);
}

endpoint endpoint::from_wire(const char* in) {
  endpoint e;
  e.host.assign(in, strnlen(in, host_bytes));
  std::memcpy(&e.port, in + 64, sizeof e.port);
  std::uint8_t n = 0;
  std::memcpy(&n, in + 66, 1);
  n = static_cast<std::uint8_t>(std::min<std::size_t>(n, max_addresses));
  e.ipv4.resize(n);
  for (std::size_t k = 0; k < n; ++k) std::memcpy(&e.ipv4[k], in + 68 + 4 * k, 4);
  return e;
}

std::string endpoint::where() const {
  if (ipv4.empty() || port == 0) return "no address";
  return fmt::format("{}:{}", dotted(ipv4.front()), port);
}

liveness_port::liveness_port(std::string host) {
  self_.host = std::move(host);
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd_, SOMAXCONN) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd_);
    fd_ = -1;
    return;
  }
  self_.port = ntohs(a.sin_port);
  self_.ipv4 = interface_addresses();
}

liveness_port::~liveness_port() {
  if (fd_ >= 0) close(fd_);
}

std::vector<reach> probe(const std::vector<endpoint>& targets, std::chrono::milliseconds budget) {
  std::vector<reach> out(targets.size(), reach::unknown);
  struct attempt {
    std::size_t target;
    int fd;
  };
  std::vector<attempt> open;
  std::vector<char> refused(targets.size(), 0);
  for (std::size_t t = 0; t < targets.size(); ++t) {
    const auto& e = targets[t];
    if (e.port == 0 || e.ipv4.empty()) continue;
    out[t] = reach::no_answer;
    for (auto addr : e.ipv4) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = addr;
      a.sin_port = htons(e.port);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
        out[t] = reach::answers;
        close(fd);
      } else if (errno == EINPROGRESS) {
        open.push_back({t, fd});
      } else {
        if (errno == ECONNREFUSED) refused[t] = 1;
        close(fd);
      }
    }
  }
  const auto until = std::chrono::steady_clock::now() + budget;
  while (!open.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    std::vector<pollfd> fds;
    for (const auto& a : open) fds.push_back({a.fd, POLLOUT, 0});
    if (poll(fds.data(), fds.size(), static_cast<int>(left.count())) <= 0) continue;
    for (std::size_t k = fds.size(); k-- > 0;) {
      if (!fds[k].revents) continue;
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(open[k].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) out[open[k].target] = reach::answers;
      if (err == ECONNREFUSED) refused[open[k].target] = 1;
      close(open[k].fd);
      open.erase(open.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  for (const auto& a : open) close(a.fd);
  for (std::size_t t = 0; t < targets.size(); ++t)
    if (out[t] == reach::no_answer && refused[t]) out[t] = reach::refused;
  return out;
}

assessment assess(const std::vector<endpoint>& peers, int me, const std::vector<int>& ranks,
                  std::chrono::milliseconds budget) {
  assessment a;
  const auto world = static_cast<int>(peers.size());
  a.found.assign(peers.size(), reach::unknown);
  if (world == 0 || me < 0 || me >= world || budget.count() <= 0) return a;
  const auto host = [&](int r) -> const std::string& {
    return peers[static_cast<std::size_t>(r)].host;
  };
  const auto& own = host(me);
  std::vector<int> targets;
  std::vector<std::string> hosts;  // the other hosts, in rank order
  for (int r = 0; r < world; ++r) {
    const bool asked = ranks.empty() || std::find(ranks.begin(), ranks.end(), r) != ranks.end();
    const bool new_host =
        host(r) != own && std::find(hosts.begin(), hosts.end(), host(r)) == hosts.end();
    if (new_host) hosts.push_back(host(r));
    if (r != me && (asked || new_host)) targets.push_back(r);
  }
  std::vector<endpoint> ends;
  for (int r : targets) ends.push_back(peers[static_cast<std::size_t>(r)]);
  const auto got = probe(ends, budget);
  std::vector<std::string> dark;  // hosts that gave no answer
  for (std::size_t t = 0; t < targets.size(); ++t) {
    a.found[static_cast<std::size_t>(targets[t])] = got[t];
    if (got[t] == reach::no_answer && host(targets[t]) != own &&
        std::find(dark.begin(), dark.end(), host(targets[t])) == dark.end())
      dark.push_back(host(targets[t]));
    if (got[t] == reach::refused) a.gone.push_back(targets[t]);
  }
  const auto ranks_on = [&](const std::string& h) {
    std::vector<int> out;
    for (int r = 0; r < world; ++r)
      if (host(r) == h) out.push_back(r);
    return out;
  };
  std::vector<std::string> named;
  for (const auto& h : dark) {
    const auto on = ranks_on(h);
    std::string where;
    for (int r : on) {
      a.cut_off.push_back(r);
      if (a.found[static_cast<std::size_t>(r)] == reach::unknown)
        a.found[static_cast<std::size_t>(r)] = reach::no_answer;
      if (where.empty()) where = peers[static_cast<std::size_t>(r)].where();
    }
    named.push_back(fmt::format("host {} (ranks {}) at {}", h, fmt::join(on, ", "), where));
  }
  const auto secs = std::chrono::duration<double>(budget).count();
  if (hosts.size() >= 2 && dark.size() == hosts.size())
    a.lead = fmt::format(
        "the network: this host, {} (ranks {}), reaches none of the {} other hosts within "
        "{:.3g} s ({}): its own link or network is down, not a process; ",
        own, fmt::join(ranks_on(own), ", "), hosts.size(), secs, fmt::join(named, "; "));
  else if (!dark.empty())
    a.lead = fmt::format(
        "the network: {} {} no answer within {:.3g} s — cut off (a link down, a partition, or "
        "the host down), not a process; ",
        fmt::join(named, " and "), dark.size() == 1 ? "gives" : "give", secs);
  if (!a.gone.empty()) {
    std::vector<std::string> by_host;
    std::vector<std::string> seen;
    for (int r : a.gone) {
      if (std::find(seen.begin(), seen.end(), host(r)) != seen.end()) continue;
      seen.push_back(host(r));
      std::vector<int> on;
      for (int g : a.gone)
        if (host(g) == host(r)) on.push_back(g);
      by_host.push_back(fmt::format("{} {} on host {}", on.size() == 1 ? "rank" : "ranks",
                                    fmt::join(on, ", "), host(r)));
    }
    a.lead += fmt::format(
        "the process: {} {} gone — {} answer{} but refuse{} their ports: their processes died, "
        "not the network; ",
        fmt::join(by_host, " and "), a.gone.size() == 1 ? "is" : "are",
        seen.size() == 1 ? "its host" : "their hosts", seen.size() == 1 ? "s" : "",
        seen.size() == 1 ? "s" : "");
  }
  return a;
}

std::int64_t host_rx_bytes() {
  std::FILE* f = std::fopen("/proc/net/dev", "r");
  if (!f) return -1;
  char line[512];
  std::int64_t total = 0;
  while (std::fgets(line, sizeof line, f)) {
    const char* colon = std::strchr(line, ':');
    if (!colon) continue;  // the two header lines
    std::string name(line, static_cast<std::size_t>(colon - line));
    name.erase(0, name.find_first_not_of(' '));
    if (name == "lo") continue;
    total += std::strtoll(colon + 1, nullptr, 10);
  }
  std::fclose(f);
  return total;
}

std::int64_t process_tcp_rx_bytes() {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  std::int64_t total = 0;
  bool any = false;
  const int own = dirfd(dir);
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == own) continue;
    struct stat st {};
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int proto = 0;
    socklen_t len = sizeof proto;
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_PROTOCOL, &proto, &len) != 0 ||
        proto != IPPROTO_TCP)
      continue;
    tcp_info info{};
    len = sizeof info;
    if (getsockopt(static_cast<int>(fd), IPPROTO_TCP, TCP_INFO, &info, &len) != 0 ||
        len < offsetof(tcp_info, tcpi_bytes_received) + sizeof info.tcpi_bytes_received)
      continue;
    total += static_cast<std::int64_t>(info.tcpi_bytes_received);
    any = true;
  }
  closedir(dir);
  return any ? total : -1;
}

std::string explain(reach r, const endpoint& e, std::chrono::milliseconds budget) {
  switch (r) {
    case reach::answers:
      return fmt::format(
          "host {} answers and the process still holds its socket ({}): stopped or hung, not "
          "the network",
          e.host, e.where());
    case reach::refused:
      return fmt::format(
          "host {} answers but refuses the process's port ({}): the process is gone, not the "
          "network",
          e.host, e.where());
    case reach::no_answer:
      return fmt::format(
          "host {} gives no answer at {} within {:.3g} s: the network (a link down, a lossy or "
          "partitioned network) or the host itself, not the process",
          e.host, e.where(), std::chrono::duration<double>(budget).count());
    case reach::unknown:
      break;
  }
  return fmt::format("whether host {} is reachable is not known (no probe address)", e.host);
}

}  // namespace seqpar::mpi
