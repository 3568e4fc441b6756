#include "core/collate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/zigzag.hpp"

namespace seqpar {
namespace {

std::vector<std::int64_t> slice(const std::vector<std::int64_t>& v, std::int64_t start,
                                std::int64_t len) {
  return {v.begin() + start, v.begin() + start + len};
}

void check_shapes(const packed_batch& b) {
  const auto n = b.input_ids.size();
  if (n == 0) fail<layout_error>("the batch is empty: input_ids has no tokens");
  auto same = [&](const char* key, std::size_t m) {
    if (m != n)
      fail<layout_error>(
          "'{}' has {} entries but input_ids has {}; every key must cover the same "
          "packed row",
          key, m, n);
  };
  same("labels", b.labels.size());
  same("position_ids", b.position_ids.size());
  if (b.attention_mask) same("attention_mask", b.attention_mask->size());
  for (std::size_t i = 0; i < n; ++i)
    if (b.position_ids[i] < 0)
      fail<layout_error>(
          "position_ids[{}] = {} is negative; position ids count 0, 1, 2, … within "
          "each document",
          i, b.position_ids[i]);
}

/// A row that does not start at position 0 (a continuation fragment). Where the framework
/// loses data or merges documents, seqpar refuses; where it only leaves the fragment outside
/// every document, seqpar returns its values with a warning.
void check_row_start(const packed_batch& b, const collate_options& opt, std::int64_t pad,
                     std::vector<std::string>& warnings) {
  if (b.position_ids[0] == 0) return;
  const auto n = b.position_ids.size();
  std::size_t first = 0;
  while (first < n && b.position_ids[first] != 0) ++first;
  if (first == n)
    fail<layout_error>(
        "position_ids contain no 0, so the row has no document start (position_ids[0] = {}); "
        "xorl and VeOmni fail or treat the whole row as one document. Start the row at a "
        "document boundary (position 0)",
        b.position_ids[0]);
  if (opt.profile == profile::xorl && opt.ring > 1)
    fail<layout_error>(
        "position_ids[0] = {}: the row does not start at a document boundary, and xorl's zigzag "
        "(ring={}) silently drops the {} token(s) before the first position 0 (index {}). Start "
        "the row at a document boundary (position 0) or drop the leading fragment upstream",
        b.position_ids[0], opt.ring, first, first);
  if (opt.profile == profile::veomni && pad > 0)
    fail<layout_error>(
        "position_ids[0] = {}: the row does not start at a document boundary; VeOmni's tail "
        "coalescing rebuilds cu_seqlens from 0 and merges the {}-token leading fragment with the "
        "next document (attention would cross a document boundary). Start the row at position 0",
        b.position_ids[0], first);
  warnings.push_back(fmt::format(
      "position_ids[0] = {}: the {} token(s) before index {} belong to no document (cu_seqlens "
      "start at {}, not 0); flash-attention leaves their outputs undefined. Start the row at a "
      "document boundary",
      b.position_ids[0], first, first, first));
}

/// xorl shifts labels per sample before packing; its SP collator checks the shift on the first
/// supervised token whose successor is in the same document.
void check_xorl_shift(const packed_batch& b) {
  const auto n = b.input_ids.size();
  for (std::size_t i = 0; i + 1 < n; ++i) {
    if (b.labels[i] == ignore_index || b.position_ids[i + 1] != b.position_ids[i] + 1) continue;
    if (b.labels[i] != b.input_ids[i + 1])
      fail<layout_error>(
          "labels are not shifted: labels[{}] = {} but input_ids[{}] = {} (xorl expects labels "
          "shifted per document before packing, labels[i] = input_ids[i+1]; its collator asserts "
          "\"Data shift check failed\"). Shift the labels upstream or use --profile veomni, whose "
          "collator shifts them itself",
          i, b.labels[i], i + 1, b.input_ids[i + 1]);
    return;
  }
}

}  // namespace

collated_batch collate(const packed_batch& in, const collate_options& opt) {
  if (opt.ulysses < 1 || opt.ring < 1)
    fail<config_error>("ulysses={} and ring={} must both be at least 1", opt.ulysses, opt.ring);
  require_ring_supported(opt.profile, opt.ring);
  check_shapes(in);
  collated_batch out;
  out.options = opt;
  const int U = opt.ulysses, R = opt.ring, C = U * R;
  const std::int64_t L = static_cast<std::int64_t>(in.input_ids.size());
  out.original_length = L;

  packed_batch b = in;
  const bool has_mask = b.attention_mask.has_value();
  if (!has_mask) b.attention_mask = std::vector<std::int64_t>(L, 1);
  if (opt.profile == profile::deepspeed) require_deepspeed_seqlen(L, U, "the row");
  if (shifts_whole_row(opt.profile)) {
    // Shift on the whole packed row (VeOmni's collator, DeepSpeed's adapter): labels =
    // pad(labels[1:], (0,1), -100).
    std::rotate(b.labels.begin(), b.labels.begin() + 1, b.labels.end());
    b.labels.back() = ignore_index;
  } else if (opt.profile == profile::xorl) {
    check_xorl_shift(b);
  }

  const std::int64_t pm = opt.profile == profile::xorl && R > 1 ? 2 * C
                          : opt.profile == profile::xorl        ? C
                                                                : U;
  const std::int64_t N = (L + pm - 1) / pm * pm;
  const std::int64_t pad = N - L;
  out.padded_length = N;
  check_row_start(b, opt, pad, out.warnings);
  const std::vector<std::int64_t> original_pos = b.position_ids;
  for (std::int64_t i = 0; i < pad; ++i) {
    // VeOmni pads input_ids with 0 whatever the tokenizer's pad id (its SP collator has no
    // pad-id parameter); xorl uses pad_token_id.
    b.input_ids.push_back(opt.profile == profile::xorl ? opt.pad_token_id : 0);
    b.labels.push_back(ignore_index);
    b.attention_mask->push_back(1);
    // xorl: each 1024-token block of padding is its own fake document; veomni: every pad
    // token is a 1-token document (position 0), coalesced into one tail segment below.
    b.position_ids.push_back(opt.profile == profile::xorl ? i % 1024 : 0);
  }
  out.padded = b;

  // Zigzag (xorl, R > 1): boundaries from the padded, pre-zigzag position ids.
  if (R > 1 && opt.zigzag) {
    auto cu_padded = cu_seqlens_from_position_ids(b.position_ids);
    auto docs = doc_ranges(cu_padded);
    out.perm = zigzag_permutation(docs, R, L);
  } else {
    out.perm.resize(static_cast<std::size_t>(N));
    std::iota(out.perm.begin(), out.perm.end(), 0);
  }
  auto ids = apply_permutation<std::int64_t>(b.input_ids, out.perm);
  auto labels = apply_permutation<std::int64_t>(b.labels, out.perm);
  auto pos = apply_permutation<std::int64_t>(b.position_ids, out.perm);
  auto mask = apply_permutation<std::int64_t>(*b.attention_mask, out.perm);

  // cu_seqlens: xorl R > 1 from the original (unpadded) ids; otherwise from the padded ids.
  std::vector<std::int32_t> cu;
  std::optional<std::int64_t> tail;
  if (opt.profile == profile::xorl) {
    cu = R > 1 ? cu_seqlens_from_position_ids(original_pos) : cu_seqlens_from_position_ids(pos);
    if (R > 1 && pad > 0)
      out.warnings.push_back(fmt::format(
          "cu_seqlens end at {} (the unpadded length) but the row is padded to {}: the {} pad "
          "tokens are outside every document (xorl computes cu_seqlens from the original "
          "position_ids when ring > 1); flash-attention leaves their outputs undefined",
          L, N, pad));
  } else {
    cu = cu_seqlens_from_position_ids(b.position_ids);
    if (pad > 0) {
      // Coalesce the per-token pad documents into one tail segment.
      std::vector<std::int32_t> kept;
      for (auto c : cu)
        if (c <= L) kept.push_back(c);
      kept.push_back(static_cast<std::int32_t>(N));
      cu = kept;
      tail = pad;
    }
  }
  const std::int64_t maxlen = max_seqlen(cu);

  // Slicing: xorl ceil(N/C), veomni and deepspeed N/U; N is a multiple of both.
  const std::int64_t chunk = opt.profile == profile::xorl ? (N + C - 1) / C : N / U;
  out.chunk = chunk;
  const int nranks = opt.profile == profile::xorl ? C : U;
  for (int r = 0; r < nranks; ++r) {
    rank_batch rb;
    rb.cp_rank = r;
    rb.input_ids = slice(ids, r * chunk, chunk);
    rb.labels = slice(labels, r * chunk, chunk);
    rb.position_ids = opt.profile == profile::xorl ? pos : slice(pos, r * chunk, chunk);
    // DeepSpeed cuts every 2-D integer key like input_ids; the others pass the whole mask.
    if (has_mask)
      rb.attention_mask = opt.profile == profile::deepspeed ? slice(mask, r * chunk, chunk) : mask;
    rb.cu_seqlens = cu;
    rb.max_seqlen = maxlen;
    rb.tail_padding_length = tail;
    out.ranks.push_back(std::move(rb));
  }
  return out;
}

collate_options options_of(const scenario& s) {
  collate_options o;
  o.profile = s.profile;
  o.ulysses = s.ulysses;
  o.ring = s.ring;
  o.pad_token_id = s.pad_token_id;
  o.zigzag = s.zigzag;
  return o;
}

packed_batch make_batch(const scenario& s) {
  // DeepSpeed: one row per source rank (micro-step), the same documents, different draws.
  rng g(s.seed * 0x51ed27u + 17 + 7919u * static_cast<std::uint64_t>(s.micro_step));
  packed_batch b;
  b.position_ids = position_ids_from_docs(s.docs);
  const auto n = b.position_ids.size();
  // Token ids avoid the pad id so padding is recognisable.
  auto token = [&] {
    std::int64_t t;
    do t = g.between(0, s.vocab - 1);
    while (t == s.pad_token_id && s.vocab > 1);
    return t;
  };
  for (std::size_t i = 0; i < n; ++i) b.input_ids.push_back(token());
  b.labels.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (s.profile == profile::xorl) {
      // Shifted per document upstream: the label is the next token of the same document; the
      // last label of a document is the token the shift cut off.
      bool last = i + 1 == n || b.position_ids[i + 1] == 0;
      b.labels[i] = last ? token() : b.input_ids[i + 1];
    } else {
      // Unshifted; packing sets labels[0] = -100 of every document after the first.
      b.labels[i] = (b.position_ids[i] == 0 && i > 0) ? ignore_index : b.input_ids[i];
    }
  }
  // Runs of ignored labels (prompt masking).
  std::size_t i = 0;
  while (i < n) {
    if (g.unit() < s.ignore_fraction / 4) {
      auto run = static_cast<std::size_t>(g.between(1, 6));
      for (std::size_t j = i; j < std::min(n, i + run); ++j) b.labels[j] = ignore_index;
      i += run;
    } else {
      ++i;
    }
  }
  return b;
}

}  // namespace seqpar
