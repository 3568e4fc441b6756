#include "core/flight_recorder.hpp"

#include <algorithm>

namespace seqpar {

flight_recorder::flight_recorder(std::size_t capacity)
    : capacity_(std::max<std::size_t>(capacity, 1)), t0_(std::chrono::steady_clock::now()) {}

std::uint64_t flight_recorder::begin(const comm_record& r, const comm_group& g) {
  if (frozen_.load()) return not_recorded;
  const std::chrono::duration<double> t = std::chrono::steady_clock::now() - t0_;
  std::lock_guard lock(mu_);
  if (!groups_.contains(g.name)) groups_[g.name] = g.ranks;
  auto& ring = rings_[r.rank];
  const auto token = ring.next++;
  // The ring fills by appending (no default-constructed slots to touch), then wraps around.
  if (ring.slots.size() < capacity_) ring.slots.emplace_back();
  auto& e = ring.slots[token % capacity_];
  e.call = r;
  e.call.state = "started";
  e.t_start = t.count();
  e.t_end = -1;
  e.error.clear();
  return token;
}

void flight_recorder::end(int rank, std::uint64_t token, const std::string& error) {
  const std::chrono::duration<double> t = std::chrono::steady_clock::now() - t0_;
  if (token == not_recorded) return;
  std::lock_guard lock(mu_);
  auto it = rings_.find(rank);
  if (it == rings_.end() || token >= it->second.next || it->second.next - token > capacity_)
    return;  // overwritten meanwhile
  auto& e = it->second.slots[token % capacity_];
  e.t_end = t.count();
  if (error.empty())
    e.call.state = "completed";
  else
    e.error = error;
}

std::vector<flight_recorder::entry> flight_recorder::calls(int rank) const {
  std::lock_guard lock(mu_);
  std::vector<entry> out;
  auto it = rings_.find(rank);
  if (it == rings_.end()) return out;
  const auto& ring = it->second;
  const std::uint64_t first = ring.next > capacity_ ? ring.next - capacity_ : 0;
  for (auto t = first; t < ring.next; ++t) out.push_back(ring.slots[t % capacity_]);
  return out;
}

std::vector<int> flight_recorder::ranks() const {
  std::lock_guard lock(mu_);
  std::vector<int> out;
  for (const auto& [r, ring] : rings_) out.push_back(r);
  return out;
}

std::map<std::string, std::vector<int>> flight_recorder::groups() const {
  std::lock_guard lock(mu_);
  return groups_;
}

std::uint64_t flight_recorder::dropped(int rank) const {
  std::lock_guard lock(mu_);
  auto it = rings_.find(rank);
  if (it == rings_.end()) return 0;
  return it->second.next > capacity_ ? it->second.next - capacity_ : 0;
}

}  // namespace seqpar
