#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <exception>
#include <optional>

#include "core/layout.hpp"
#include "core/ring_schedule.hpp"
#include "verify/check_steps.hpp"

// Where a failing check's SP step first departs: transport (the first collective whose received
// data are not what was sent), then the layers against the reference's own boundaries (and a
// p2p ring's steps one by one), then the attention's stages judged by the dump engine. The
// searches themselves are in divergence.cpp; check.cpp and check_distributed.cpp record a rerun
// of the step and hand it here.

namespace seqpar::verify {

using namespace seqpar::sim;

/// Names where the step first departs, from every rank's record: the first call whose received
/// data are not what its senders sent; else the first layer boundary that differs from the
/// reference's own, and the attention's first differing stage (the dump engine's verdict).
void judge_departure(check_report& rep, const scenario& s, const packed_batch& batch,
                     const collated_batch& cb, const model_params<double>& p64,
                     const check_options& opt, const std::vector<call_capture>& calls,
                     step_record& rec) {
  rep.first = first_divergence(
      calls,
      [&cb, &s](int k, bool gathered) {
        return gathered ? ring_rank_tokens(cb, k / s.ulysses) : rank_tokens(cb, k);
      },
      cb.original_length);
  if (rep.first) {
    // The picture: which tokens each rank received wrong, over the ranks of the call.
    error_heatmap map(fmt::format("first departure: {} {} — tokens received wrong, per rank",
                                  rep.first->op, rep.first->tag),
                      "token", cb.original_length, "rank", s.cp());
    for (const auto& c : calls)
      if (c.group == rep.first->group && c.seq == rep.first->call)
        for (std::int64_t t = 0; t < cb.original_length; ++t) map.add(t, c.rank, 0);
    for (const auto& [k, t] : rep.first->wrong_tokens) map.add(t, k, 1e3);
    map.solid = doc_bounds(s);
    if (!rep.first->wrong_tokens.empty()) rep.heatmaps.insert(rep.heatmaps.begin(), map);
    return;
  }
  auto transport = fmt::format(
      "all {} collectives of the SP step delivered what their senders sent", calls.size());
  // Layer by layer against the reference's own boundaries (the oracle, rows in token order).
  try {
    const auto rb = reference_batch(s, batch);
    // GatedDeltaNet's stages between its all-to-alls: each rank's own reference, the columns
    // it holds of the gathered sequence's rows (padding rows: zero, never compared).
    (void)ref::train_step(s, as_reference_weights(p64), rb, opt.threads,
                          [&rec, &s, &cb](int l, const std::string& st, const ref::matrix& m) {
                            if (gdn_head_columns(s, st, 0).empty()) {
                              rec.layers.add(-1, l, st, Eigen::MatrixXd(m));
                              return;
                            }
                            for (int k = 0; k < s.cp(); ++k) {
                              const auto cols = gdn_head_columns(s, st, k % s.ulysses);
                              const auto rows = ring_rank_tokens(cb, k / s.ulysses);
                              Eigen::MatrixXd own =
                                  Eigen::MatrixXd::Zero(static_cast<Eigen::Index>(rows.size()),
                                                        static_cast<Eigen::Index>(cols.size()));
                              for (std::size_t i = 0; i < rows.size(); ++i)
                                if (rows[i] < m.rows())
                                  for (std::size_t c = 0; c < cols.size(); ++c)
                                    own(static_cast<Eigen::Index>(i),
                                        static_cast<Eigen::Index>(c)) = m(rows[i], cols[c]);
                              rec.layers.add(-2 - k, l, st, std::move(own));
                            }
                          });
    const double tol = std::max(rep.tolerance, 1e-10);
    const bool p2p_ring = s.ring > 1 && s.ring_forward != "allgather";
    // Each ring step's partial as the correct schedule makes it, from the oracle's q, k, v.
    if (p2p_ring)
      add_ring_step_references(rec.layers,
                               ring_step_layout_of(s, rb, cb, as_reference_weights(p64)));
    if (auto where = first_layer_departure(
            rec.layers, s.layers, s.cp(), [&cb](int k) { return rank_tokens(cb, k); },
            cb.original_length, tol, p2p_ring ? s.ring : 0,
            [&cb, &s](int k) { return ring_rank_tokens(cb, k / s.ulysses); },
            [&cb, &s](int k, int step) {
              return ring_rank_tokens(cb, ring_source(k / s.ulysses, step, s.ring));
            })) {
      rep.layer_departure = where->line;
      transport += "; " + where->line;
      where->map.solid = doc_bounds(s);
      rep.heatmaps.insert(rep.heatmaps.begin(), std::move(where->map));
    } else {
      // What still fails is then made wrong from right rows: a parameter's gradient
      // accumulated (an embedding backward that assigns where repeated ids must add up) or
      // reduced across ranks wrongly.
      std::vector<std::string> grads;
      for (const auto& r : rep.rows)
        if (!r.pass && r.tensor.starts_with("grad.")) grads.push_back(r.tensor);
      // Which accumulation, where the parameter's share on each rank can be rebuilt from that
      // rank's own (matching) rows: the embedding's scatter-add.
      std::optional<std::string> embed;
      if (std::find(grads.begin(), grads.end(), "grad.embed") != grads.end()) {
        // Its place in the flat gradient buffer: the parameters in their order.
        std::int64_t offset = 0;
        for (std::size_t i = 0; i < p64.index_of("embed"); ++i)
          offset += static_cast<std::int64_t>(p64.values[i].size());
        // The loss group of an SP step is its SP group (cp ranks).
        embed = embedding_share_finding(
            calls, rec.layers,
            [&cb](int k) { return cb.ranks[static_cast<std::size_t>(k)].input_ids; }, s.cp(),
            offset, s.vocab, s.hidden, backward_tap_scale(s.profile, s.cp()));
      }
      transport += fmt::format(
          "; every stage of the step (the embedding, each layer's boundaries, the final norm, "
          "the logits and the loss's gradient), forward and backward, matches the reference's{}",
          grads.empty() ? std::string()
                        : fmt::format(": {} {} made wrong from right rows (the accumulation "
                                      "into the parameter, or its reduction across ranks)",
                                      fmt::join(grads, ", "), grads.size() > 1 ? "are" : "is"));
      if (embed) transport += "; " + *embed;
    }
  } catch (const std::exception&) {
    // The boundaries are a refinement: without them the attention's verdict still stands.
  }
  if (rec.stages.empty()) {
    rep.departure = transport +
                    ": it departs in what the ranks compute or hold, not in transport (the "
                    "attention's stages are recorded for softmax layers only: "
                    "GatedDeltaNet's inner stages are compared with the layer stages)";
    return;
  }
  try {
    const auto v = judge_attention(rec.stages, opt.threads);
    if (v.first) {
      rep.attention = v.first;
      // The first differing stage per rank, before the end results' consequences.
      // (after the first differing layer stage's map, when there is one)
      rep.heatmaps.insert(rep.heatmaps.begin() + (rep.layer_departure.empty() ? 0 : 1),
                          v.heatmaps.begin(), v.heatmaps.end());
      rep.departure =
          fmt::format("{}; in attention: call {} first differs at stage {} on ranks {} ({}): {}",
                      transport, v.first->call_name, v.first->stage,
                      fmt::join(v.first->ranks, ", "), v.first->where, v.first->diagnosis);
    } else {
      rep.departure = fmt::format(
          "{}, and {} match: it departs outside attention, in what the ranks compute or hold "
          "(projections, norms, MLP, loss, labels, positions)",
          transport, v.what);
    }
  } catch (const std::exception& e) {
    rep.departure =
        fmt::format("{}: it departs in what the ranks compute or hold, not in transport ({})",
                    transport, e.what());
  }
}

}  // namespace seqpar::verify
