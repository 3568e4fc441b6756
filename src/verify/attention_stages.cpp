// A failing check's attention judged by the dump engine (attention_stages.hpp).
#include "verify/attention_stages.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/byte_pack.hpp"
#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/layout.hpp"
#include "io/file.hpp"
#include "sim/sp_setup.hpp"

namespace seqpar::verify {

namespace fs = std::filesystem;

attention_stages::attention_stages(const scenario& s, const collated_batch& cb, dtype t)
    : s_(s),
      cb_(cb),
      type_(t == dtype::f32 ? io::st_dtype::f32 : io::st_dtype::f64),
      order_(static_cast<std::size_t>(s.cp())),
      calls_(static_cast<std::size_t>(s.cp())) {}

void attention_stages::tap(int rank, const std::string& call, const std::string& stage, compute& c,
                           const tensor& x) {
  auto values = c.to_host(x);
  std::vector<std::int64_t> shape = x.shape;
  if (stage == "lse" && shape.size() == 2) {  // core [rows, heads] → dump [heads, rows]
    const auto n = shape[0], h = shape[1];
    std::vector<double> t(values.size());
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < h; ++j)
        t[static_cast<std::size_t>(j * n + i)] = values[static_cast<std::size_t>(i * h + j)];
    values = std::move(t);
    shape = {h, n};
  }
  auto tensor = io::make_tensor(stage, shape, values, type_);
  std::lock_guard lock(mu_);
  auto& calls = calls_[static_cast<std::size_t>(rank)];
  if (!calls.count(call)) order_[static_cast<std::size_t>(rank)].push_back(call);
  auto& f = calls[call];
  (stage.starts_with("grad.") ? f.bwd : f.fwd).push_back(std::move(tensor));
}

namespace {

/// Records what enters and leaves the inner attention (the gathered stages) and forwards.
class tapping_inner final : public inner_attention {
 public:
  tapping_inner(attention_stages& st, int rank, compute& c, std::unique_ptr<inner_attention> in)
      : st_(st), rank_(rank), c_(c), in_(std::move(in)) {}
  void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
               const std::string& tag) override {
    st_.tap(rank_, tag, "q.gathered", c_, q);
    st_.tap(rank_, tag, "k.gathered", c_, k);
    st_.tap(rank_, tag, "v.gathered", c_, v);
    in_->forward(q, k, v, out, lse, tag);
    st_.tap(rank_, tag, "out.attn", c_, out);
    st_.tap(rank_, tag, "lse", c_, lse);
  }
  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                const std::string& tag) override {
    st_.tap(rank_, tag, "grad.out.attn", c_, dout);
    in_->backward(q, k, v, out, lse, dout, dq, dk, dv, tag);
    st_.tap(rank_, tag, "grad.q.gathered", c_, dq);
    st_.tap(rank_, tag, "grad.k.gathered", c_, dk);
    st_.tap(rank_, tag, "grad.v.gathered", c_, dv);
  }
  std::vector<double> sink_grad() const override { return in_->sink_grad(); }

 private:
  attention_stages& st_;
  int rank_;
  compute& c_;
  std::unique_ptr<inner_attention> in_;
};

}  // namespace

std::unique_ptr<inner_attention> attention_stages::wrap(int rank, compute& c,
                                                        std::unique_ptr<inner_attention> in) {
  // U = 1: the inner attention's inputs are the local shards themselves (no gathered stages).
  if (s_.ulysses == 1) return in;
  return std::make_unique<tapping_inner>(*this, rank, c, std::move(in));
}

std::string attention_stages::pack(int rank) const {
  std::lock_guard lock(mu_);
  byte_writer w;
  const auto k = static_cast<std::size_t>(rank);
  const auto tensors = [&w](const std::vector<io::st_tensor>& v) {
    w.i64(static_cast<std::int64_t>(v.size()));
    for (const auto& t : v) {
      w.str(t.name);
      w.i64(static_cast<std::int64_t>(t.type));
      w.list(t.shape);
      w.str(t.bytes);
    }
  };
  w.i64(rank);
  w.i64(static_cast<std::int64_t>(order_[k].size()));
  for (const auto& name : order_[k]) {
    const auto& f = calls_[k].at(name);
    w.str(name);
    tensors(f.fwd);
    tensors(f.bwd);
  }
  return std::move(w.bytes());
}

void attention_stages::merge(std::string_view packed) {
  byte_reader r(packed);
  const auto tensors = [&r] {
    std::vector<io::st_tensor> v(static_cast<std::size_t>(std::max<std::int64_t>(0, r.i64())));
    for (auto& t : v) {
      t.name = r.str();
      t.type = static_cast<io::st_dtype>(r.i64());
      t.shape = r.list<std::int64_t>();
      t.bytes = r.str();
    }
    return v;
  };
  const auto rank = r.i64();
  if (rank < 0 || rank >= static_cast<std::int64_t>(calls_.size()))
    fail<error>("a packed attention record names rank {} of {}", rank, calls_.size());
  const auto k = static_cast<std::size_t>(rank);
  std::lock_guard lock(mu_);
  for (auto n = r.i64(); n > 0; --n) {
    auto name = r.str();
    call_files f;
    f.fwd = tensors();
    f.bwd = tensors();
    if (!calls_[k].count(name)) order_[k].push_back(name);
    calls_[k][name] = std::move(f);
  }
}

bool attention_stages::empty() const {
  std::lock_guard lock(mu_);
  for (const auto& o : order_)
    if (!o.empty()) return false;
  return true;
}

int layer_of_call(const std::string& name) {
  if (name.size() < 2 || name[0] != 'L') return -1;
  int l = 0;
  std::size_t i = 1;
  for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])); ++i)
    l = l * 10 + (name[i] - '0');
  return i > 1 ? l : -1;
}

void attention_stages::write(const std::string& dir) const {
  std::lock_guard lock(mu_);
  // The row's true documents, not what a collator handed the kernel (the engine judges the
  // kernel against them): the real tokens' from their position ids; the padded tail's as the
  // collator placed it (its own document, or the last document's continuation). Where the
  // kernel's cu_seqlens end before the row does (xorl with a ring: cu_seqlens from the unpadded
  // position ids), the rest is padding outside every document: its placement blocks (the
  // padded position ids' segments, which the zigzag cut) follow, and padding_from says where
  // they start.
  const auto L = cb_.original_length, N = cb_.padded_length;
  const auto& kernel_cu = cb_.ranks.front().cu_seqlens;
  const std::span<const std::int64_t> real(cb_.padded.position_ids.data(),
                                           static_cast<std::size_t>(L));
  std::vector<std::int32_t> cu;
  for (auto b : cu_seqlens_from_position_ids(real))
    if (b < L) cu.push_back(b);
  for (auto b : kernel_cu)
    if (b >= L) cu.push_back(b);
  // The real tokens' documents end at L even where the kernel's cu_seqlens stop earlier (a
  // collation bug the engine then finds).
  if (cu.empty() || cu.back() < L) cu.push_back(static_cast<std::int32_t>(L));
  const std::int64_t padding_from = cu.back();
  if (padding_from < N)
    for (auto b : cu_seqlens_from_position_ids(cb_.padded.position_ids))
      if (b > padding_from) cu.push_back(b);
  if (cu.empty() || cu.back() != N || padding_from <= 0)
    fail<error>("the collated row's cu_seqlens {} do not place the row of {} tokens", kernel_cu, N);
  for (const auto& rank : calls_)
    for (const auto& [name, f] : rank)
      if (std::none_of(f.fwd.begin(), f.fwd.end(),
                       [](const io::st_tensor& t) { return t.name == "q.local"; }))
        fail<error>(
            "attention call {} recorded no local shard (q.local): its stages cannot be "
            "judged one by one",
            name);
  for (int k = 0; k < s_.cp(); ++k) {
    const auto rank_dir = fmt::format("rank{}", k);
    fs::create_directories(fs::path(dir) / rank_dir);
    nlohmann::json calls = nlohmann::json::array();
    int index = 0;
    for (const auto& name : order_[static_cast<std::size_t>(k)]) {
      const auto& f = calls_[static_cast<std::size_t>(k)].at(name);
      nlohmann::json call{{"index", index}, {"name", name}};
      // The layer's own attention options (its letter of the pattern, sinks and capping).
      if (const int l = layer_of_call(name); l >= 0 && s_.has_attention_options()) {
        const attention_options o = s_.attention_of(l);
        call["attention"] = {{"causal", o.causal},
                             {"window_back", o.back},
                             {"window_ahead", o.ahead},
                             {"chunk", o.chunk},
                             {"softcap", o.softcap}};
      }
      const auto put = [&](const std::vector<io::st_tensor>& ts, const char* side) {
        if (ts.empty()) return;
        const auto file = fmt::format("{}/call{:04d}.{}.safetensors", rank_dir, index, side);
        io::st_file sf;
        sf.tensors = ts;
        io::write_safetensors((fs::path(dir) / file).string(), sf);
        call[side == std::string("fwd") ? "forward" : "backward"] = file;
      };
      put(f.fwd, "fwd");
      put(f.bwd, "bwd");
      calls.push_back(std::move(call));
      ++index;
    }
    // The positions the rank's step used (RoPE), one per local row; pad rows (whose positions
    // conventions differ between collators and touch no real token) as the layout places them.
    auto positions = sim::rank_input(s_, cb_, k).positions;
    const auto held = rank_tokens(cb_, k);
    for (std::size_t i = 0; i < held.size() && i < positions.size(); ++i)
      if (held[i] >= L) {
        const auto it = std::upper_bound(cu.begin(), cu.end(), static_cast<std::int32_t>(held[i]));
        positions[i] = held[i] - *(it - 1);
      }
    const nlohmann::json meta{{"schema", "seqpar-dump/1"},
                              {"rank", k},
                              {"world_size", s_.cp()},
                              {"ulysses", s_.ulysses},
                              {"ring", s_.ring},
                              {"ulysses_rank", k % s_.ulysses},
                              {"ring_rank", k / s_.ulysses},
                              {"ring_layout", s_.zigzag ? "zigzag" : "contiguous"},
                              {"heads", s_.heads},
                              {"kv_heads", s_.kv_heads},
                              {"head_dim", s_.head_dim},
                              {"scale", 1.0 / std::sqrt(static_cast<double>(s_.head_dim))},
                              {"causal", !s_.bidirectional},
                              {"cu_seqlens", cu},
                              {"padding_from", padding_from},
                              {"position_ids", positions},
                              {"dtype", type_ == io::st_dtype::f32 ? "float32" : "float64"},
                              {"job", "seqpar check: the SP step's own attention"},
                              {"calls", calls}};
    io::write_atomic((fs::path(dir) / fmt::format("rank{}.json", k)).string(), meta.dump());
  }
}

attention_verdict judge_attention(const attention_stages& st, int threads) {
  // A private directory under the system's temporary one, removed whatever happens.
  std::random_device rd;
  const auto dir = fs::temp_directory_path() /
                   fmt::format("seqpar-attention-{:016x}", (std::uint64_t{rd()} << 32) | rd());
  struct remover {
    fs::path p;
    ~remover() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{dir};
  st.write(dir.string());
  const auto set = read_dump(dir.string());
  dump_options opt;
  opt.mode = dump_options::mode_t::exhaustive;
  opt.threads = threads;
  const auto rep = validate_dump(set, opt);
  attention_verdict v;
  v.first = rep.first;
  if (rep.first)
    for (const auto& r : rep.rows)
      if (r.call == rep.first->call && r.row.tensor == rep.first->stage && r.heat)
        v.heatmaps.push_back(*r.heat);
  // The stages no call recorded, by name (async Ulysses holds no grad.q/k.local): said, not
  // counted as matching.
  std::set<std::string> absent;
  for (const auto& n : rep.not_dumped)
    if (const auto colon = n.rfind(": "); colon != std::string::npos)
      absent.insert(n.substr(colon + 2));
  v.what = fmt::format(
      "{} attention call(s) of {} ranks, every recorded stage against its float64 "
      "reference given the call's own inputs (the validate --dump engine){}",
      rep.call_names.size(), set.ranks.size(),
      absent.empty() ? std::string()
                     : fmt::format("; not recorded in this order, so not judged: {}",
                                   fmt::join(absent, ", ")));
  return v;
}

}  // namespace seqpar::verify
