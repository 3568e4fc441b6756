#include "trace/replay_checker.hpp"

namespace seqpar::replay::detail {

int checker::cp_rank_of(int rank) const {
  if (const auto* sp = group_ranks("sp0")) {
    const int i = index_in(*sp, rank);
    if (i < static_cast<int>(sp->size())) return i;
  }
  return model_ ? rank % model_->s.cp() : rank;
}

void checker::layout_problem(const layout_record& l, const char* cat, std::string observed,
                             std::string expected, std::string cause) {
  add({cat, l.rank, "", -1, l.tag, "", std::move(observed), std::move(expected), std::move(cause),
       l.line, 0});
}

int checker::ring_size() const {
  if (model_) return model_->R;
  if (meta_ && meta_->config && meta_->config->contains("ring") &&
      meta_->config->at("ring").is_number_integer())
    return std::max(1, meta_->config->at("ring").get<int>());
  if (const auto* r = group_ranks("ring0")) return static_cast<int>(r->size());
  return 1;
}

void checker::check_layouts() {
  if (layouts_.empty()) {
    note("cu_seqlens: the trace has no layout records");
    return;
  }
  const int R = ring_size();
  const bool zig = R > 1 && (!model_ || model_->s.zigzag);
  std::set<int> reported;
  auto once = [&](int rank) { return reported.insert(rank).second; };
  for (const auto& l : layouts_) {
    ++rep_.checked["layout_checks"];
    const auto& cu = l.cu_seqlens;
    if (cu.empty()) {
      layout_problem(l, category::cu_seqlens, "cu_seqlens []", "[0, …, length]",
                     "cu_seqlens must hold at least the start 0 and the total length");
      continue;
    }
    if (cu.front() != 0 && once(l.rank)) {
      layout_problem(l, category::cu_seqlens, fmt::format("cu_seqlens[0] = {}", cu.front()), "0",
                     "cu_seqlens must start at 0 (flash-attention reads cu[0] as the "
                     "first document's start)");
      continue;
    }
    bool mono = true;
    for (std::size_t i = 1; i < cu.size(); ++i)
      if (cu[i] < cu[i - 1]) {
        layout_problem(
            l, category::cu_seqlens,
            fmt::format("cu_seqlens[{}] = {} < cu_seqlens[{}] = {}", i, cu[i], i - 1, cu[i - 1]),
            "non-decreasing offsets", "cu_seqlens must be monotone");
        mono = false;
        break;
      }
    if (!mono) {
      once(l.rank);
      continue;
    }
    std::int64_t mx = 0;
    for (std::size_t i = 1; i < cu.size(); ++i) mx = std::max(mx, cu[i] - cu[i - 1]);
    if (l.max_seqlen && *l.max_seqlen != mx && once(l.rank))
      layout_problem(l, category::cu_seqlens, fmt::format("max_seqlen {}", *l.max_seqlen),
                     fmt::format("{} = max(diff(cu_seqlens))", mx),
                     "max_seqlen must be the longest document of cu_seqlens");
    // cu_seqlens computed from zigzagged position ids: boundaries at zigzag chunk edges.
    if (l.position_ids && !l.position_ids->empty() && (*l.position_ids)[0] == 0) {
      const auto& pos = *l.position_ids;
      bool zigzagged = false;
      for (std::size_t i = 1; i < pos.size() && !zigzagged; ++i)
        zigzagged = pos[i] != 0 && pos[i] != pos[i - 1] + 1;
      if (zigzagged && pos.size() < (std::size_t{1} << 28)) {
        auto from_pos = cu_seqlens_from_position_ids(pos);
        if (dims(from_pos.begin(), from_pos.end()) == cu && once(l.rank))
          layout_problem(
              l, category::cu_seqlens, fmt::format("cu_seqlens {}", show(cu)),
              "boundaries of the original documents",
              "cu_seqlens were computed from zigzagged position_ids: every document's early "
              "chunk restarts at position 0, so the boundaries fall at zigzag chunk edges; "
              "compute cu_seqlens from the position ids before zigzag");
      }
    }
    // Every document divisible by 2R under zigzag (xorl R > 1 cu comes from the original ids).
    if (zig && (!model_ || model_->s.profile == profile::xorl)) {
      for (std::size_t i = 1; i < cu.size(); ++i) {
        const auto len = cu[i] - cu[i - 1];
        if (len % (2 * R) != 0) {
          if (once(l.rank))
            layout_problem(
                l, category::zigzag,
                fmt::format("document {} at position {} has length {}", i - 1, cu[i - 1], len),
                fmt::format("a multiple of 2·ring={}", 2 * R),
                fmt::format("Document at position {} has length {} which is not "
                            "divisible by 2*ringattn_size={}: zigzag cuts every "
                            "document into 2R equal chunks; pad or split it to a "
                            "multiple of {}",
                            cu[i - 1], len, 2 * R, 2 * R));
          break;
        }
      }
    }
    if (model_) check_layout_vs_model(l, once);
  }
  // Identical cu_seqlens across each Ulysses group.
  if (meta_)
    for (const auto& [name, ranks] : meta_->groups) {
      if (name.rfind("ulysses", 0) != 0) continue;
      const layout_record* first = nullptr;
      for (int r : ranks)
        for (const auto& l : layouts_)
          if (l.rank == r && l.tag == "collate") {
            if (!first)
              first = &l;
            else if (l.cu_seqlens != first->cu_seqlens && once(l.rank))
              add({category::cu_seqlens, l.rank, name, -1, l.tag, "",
                   fmt::format("cu_seqlens {}", show(l.cu_seqlens)),
                   fmt::format("{} as rank {} of {}", show(first->cu_seqlens), first->rank, name),
                   "cu_seqlens must be identical on every rank of a Ulysses group: after the "
                   "all-to-all each rank attends over the same gathered sequence",
                   l.line, 0});
          }
    }
}

template <class Once>
void checker::check_layout_vs_model(const layout_record& l, Once& once) {
  const auto& m = *model_;
  const int k = cp_rank_of(l.rank);
  if (k < 0 || k >= static_cast<int>(m.cb.ranks.size())) return;
  const auto& want = m.cb.ranks[static_cast<std::size_t>(k)];
  ++rep_.checked["layout_vs_plan"];
  if (l.local_tokens != m.chunk && once(l.rank)) {
    const std::int64_t seen = l.local_tokens * m.s.cp();
    layout_problem(l, category::cu_seqlens, fmt::format("local_tokens {}", l.local_tokens),
                   fmt::format("{} = padded length {} / cp {}", m.chunk, m.N, m.s.cp()),
                   seen % m.pm != 0 || l.local_tokens * m.s.cp() < m.L
                       ? fmt::format("sequence {} is not padded to a multiple of {} (pad to {})",
                                     m.L, m.pm_name, m.N)
                       : "the rank holds a different share of the padded row than the collator "
                         "gives it");
    return;
  }
  const dims want_cu(want.cu_seqlens.begin(), want.cu_seqlens.end());
  if (l.cu_seqlens == want_cu) return;
  if (!once(l.rank)) return;
  std::string cause;
  const bool xorl_ring = m.s.profile == profile::xorl && m.R > 1;
  if (xorl_ring && !m.cb.perm.empty()) {
    auto zpos = apply_permutation<std::int64_t>(m.cb.padded.position_ids, m.cb.perm);
    auto from_zig = cu_seqlens_from_position_ids(zpos);
    if (dims(from_zig.begin(), from_zig.end()) == l.cu_seqlens)
      cause =
          "cu_seqlens were computed from zigzagged position_ids (boundaries at zigzag chunk "
          "edges); compute them from the position ids before zigzag";
  }
  if (cause.empty() && !l.cu_seqlens.empty()) {
    const auto last = l.cu_seqlens.back();
    if (last == m.L && m.L != m.N && want_cu.back() == m.N)
      cause = fmt::format(
          "sequence {} is not padded to a multiple of {} (pad to {}): cu_seqlens "
          "cover only the unpadded tokens",
          m.L, m.pm_name, m.N);
    else if (last != want_cu.back())
      cause = fmt::format("cu_seqlens cover {} tokens but the collator covers {} ({})", last,
                          want_cu.back(),
                          xorl_ring ? "xorl ring: the unpadded length" : "the padded length");
    else
      cause = "document boundaries differ from the collator's";
  }
  layout_problem(l, category::cu_seqlens, fmt::format("cu_seqlens {}", show(l.cu_seqlens)),
                 show(want_cu), cause);
}

void checker::build_token_layout() {
  if (model_) {
    const auto& m = *model_;
    // Document of every padded-row token (original order), -1 for padding.
    std::vector<int> doc(static_cast<std::size_t>(m.N), -1);
    std::int64_t at = 0;
    for (std::size_t d = 0; d < m.s.docs.size(); ++d)
      for (std::int64_t i = 0; i < m.s.docs[d] && at < m.N; ++i)
        doc[static_cast<std::size_t>(at++)] = static_cast<int>(d);
    const int C = m.s.cp();
    for (int k = 0; k < C && k < 64; ++k) {
      rank_tokens_view v;
      v.rank = k;
      for (std::int64_t i = 0; i < m.chunk; ++i) {
        const std::int64_t g = k * m.chunk + i;
        const std::int64_t src = m.cb.perm.empty() ? g : m.cb.perm[static_cast<std::size_t>(g)];
        v.doc_of_token.push_back(src < m.N ? doc[static_cast<std::size_t>(src)] : -1);
      }
      v.note = fmt::format("cp rank {}: {} tokens (from the scenario)", k, m.chunk);
      rep_.token_layout.push_back(std::move(v));
    }
    return;
  }
  // Without a scenario: documents of each rank's cu_seqlens and its local token count
  // (contiguous slicing assumed).
  for (const auto& l : layouts_) {
    if (rep_.token_layout.size() >= 64) break;
    rank_tokens_view v;
    v.rank = l.rank;
    const int k = cp_rank_of(l.rank);
    const std::int64_t start = static_cast<std::int64_t>(k) * l.local_tokens;
    for (std::int64_t i = 0; i < std::min<std::int64_t>(l.local_tokens, 1 << 16); ++i) {
      const std::int64_t g = start + i;
      int d = -1;
      for (std::size_t j = 1; j < l.cu_seqlens.size(); ++j)
        if (g >= l.cu_seqlens[j - 1] && g < l.cu_seqlens[j]) d = static_cast<int>(j - 1);
      v.doc_of_token.push_back(d);
    }
    v.note = fmt::format("rank {}: {} tokens (from its layout record, contiguous slice assumed)",
                         l.rank, l.local_tokens);
    rep_.token_layout.push_back(std::move(v));
  }
}

}  // namespace seqpar::replay::detail
