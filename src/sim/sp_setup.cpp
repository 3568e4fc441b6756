#include "sim/sp_setup.hpp"

#include <cmath>

#include "core/cu_seqlens.hpp"
#include "core/mesh.hpp"
#include "core/ring_attention.hpp"
#include "core/ulysses.hpp"

namespace seqpar::sim {

namespace {

attention_docs causal_docs(const scenario& s, std::vector<std::int32_t> cu) {
  attention_docs d;
  d.cu_q = cu;
  d.cu_k = std::move(cu);
  d.causal = true;
  d.scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  return d;
}

comm_group named(group_kind kind, const device_mesh& m, int rank) {
  return comm_group{group_name(kind, m.group_index(kind, rank)), m.group_of(kind, rank)};
}

}  // namespace

sp_env single_rank_env(communicator& comm, compute& comp, const scenario& s,
                       std::vector<std::int32_t> cu) {
  sp_env env;
  env.comm = &comm;
  env.comp = &comp;
  env.profile = s.profile;
  const comm_group self{"world", {comm.rank()}};
  env.loss_group = self;
  env.ulysses = ulysses_config{self, s.heads, s.kv_heads, s.head_dim, true};
  auto docs = causal_docs(s, std::move(cu));
  env.linear_docs = docs;
  env.make_inner = [docs](compute& c, const layer_attention& layer) {
    return std::make_unique<local_attention>(c, docs, layer);
  };
  env.fsdp_group = self;
  env.fsdp_divide = 1.0;
  return env;
}

sp_env cp_rank_env(communicator& comm, compute& comp, const scenario& s, const collated_batch& cb) {
  mesh_config mc;
  mc.ring = s.ring;
  mc.ulysses = s.ulysses;
  mc.mode = shifts_whole_row(s.profile) ? cp_fsdp_mode::all : parse_cp_fsdp_mode(s.cp_fsdp_mode);
  const device_mesh mesh(mc);
  const int k = comm.rank();
  sp_env env;
  env.comm = &comm;
  env.comp = &comp;
  env.profile = s.profile;
  env.loss_group = named(group_kind::sp, mesh, k);
  env.ulysses = ulysses_config{named(group_kind::ulysses, mesh, k), s.heads, s.kv_heads, s.head_dim,
                               fused_kv_exchange(s.profile)};
  env.fsdp_group = named(group_kind::fsdp, mesh, k);
  if (!mesh.group_of(group_kind::sp_grad_sync, k).empty())
    env.sp_grad_sync_group = named(group_kind::sp_grad_sync, mesh, k);
  // xorl sets FSDP's gradient divide factor to 1 (a sum); VeOmni's FSDP and DeepSpeed's ZeRO
  // average, and their loss backward multiplies by the SP size to undo it (SEMANTICS.md §5;
  // DeepSpeed: the differentiable all_gather of the per-rank losses).
  env.fsdp_divide = shifts_whole_row(s.profile) ? static_cast<double>(env.fsdp_group.size()) : 1.0;
  const auto cu = cb.ranks.front().cu_seqlens;
  env.linear_docs = causal_docs(s, cu);
  env.async_ulysses = resolve_ulysses_strategy(s).async;
  if (env.async_ulysses)
    for (int member : env.ulysses.group.ranks) {
      const auto pos = rank_input(s, cb, member).positions;
      env.ulysses_positions.insert(env.ulysses_positions.end(), pos.begin(), pos.end());
    }
  if (s.ring == 1) {
    auto docs = causal_docs(s, cu);
    env.make_inner = [docs](compute& c, const layer_attention& layer) {
      return std::make_unique<local_attention>(c, docs, layer);
    };
  } else {
    ring_setup rs;
    rs.group = named(group_kind::ring, mesh, k);
    rs.zigzag = s.zigzag;
    rs.backward =
        s.ring_backward == "ring" ? ring_backward_kind::ring : ring_backward_kind::allgather;
    rs.forward =
        s.ring_forward == "allgather" ? ring_forward_kind::allgather : ring_forward_kind::p2p;
    rs.cu_global = cu;
    rs.scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
    rs.padded_length = cb.padded_length;
    env.make_inner = [rs, &comm](compute& c, const layer_attention& layer) {
      return make_ring_attention(comm, c, rs, layer);
    };
    env.ring = rs;
  }
  return env;
}

rank_tokens_input rank_input(const scenario& s, const collated_batch& cb, int k) {
  const auto& rb = cb.ranks[static_cast<std::size_t>(k)];
  rank_tokens_input in;
  in.input_ids = rb.input_ids;
  in.labels = rb.labels;
  if (s.profile != profile::xorl) {
    in.positions = rb.position_ids;
  } else {
    const auto first = rb.position_ids.begin() + k * cb.chunk;
    in.positions.assign(first, first + cb.chunk);
  }
  return in;
}

}  // namespace seqpar::sim
