// validate --dump on dumps of real PyTorch SP jobs (tests/jobs/sp_jobs.py, gloo, 2–4
// processes; data/dumps/README.md): every healthy job passes, every broken one is diagnosed at
// the stage, ranks and cause its healthy twin differs at (expected.json, found by comparing the
// two jobs' tensors in Python). Plus the ring emulator against the reference, and test-side
// changes to a healthy dump that must be caught.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/attention_mask.hpp"
#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/zigzag.hpp"
#include "dump/dump.hpp"
#include "dump/emulate.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "sim/attention.hpp"
#include "support/source_dir.hpp"

namespace fs = std::filesystem;
using namespace seqpar;
using namespace seqpar::verify;

namespace {

const fs::path dumps = fs::path(test::source_dir()) / "tests/equivalence/data/dumps";

nlohmann::json expected() {
  return nlohmann::json::parse(io::read_file((dumps / "expected.json").string()));
}

/// The words a diagnosis of each broken variant must contain (its cause, in our words).
const std::map<std::string, std::string> cause_words{
    {"no_kv_repeat", "must be repeated U/Hkv"},
    {"blockwise_repeat", "repeated blockwise"},
    {"a2a_wrong_dims", "token-major"},
    {"local_cu", "local position ids"},
    {"zigzag_swapped", "swapped order"},
    {"no_scale", "scores not multiplied by the scale"},
    {"lse_merge_no_max", "without subtracting their maximum"},
    {"ring_src_off_by_one", "off by one"},
    // The other shifts, each named by its own member (R 4: −1; R 5, where +2 and −2 differ).
    {"ring_src_off_by_minus_one", "(r − i − 1) mod R"},
    {"ring_src_off_by_two", "(r − i + 2) mod R"},
    {"ring_src_off_by_minus_two", "(r − i − 2) mod R"},
    {"zigzag_halves_swapped", "[late chunk | early chunk]"},
    {"kv_grad_not_summed", "did not sum"},
    {"no_causal", "without the causal mask"},
    {"swapped_dims", "the dimensions are swapped"},
    // Named by the families of mistakes (src/dump/families.cpp).
    {"causal_hides_diag", "hides the diagonal"},
    {"scale_inv_d_one_rank", "divided by head_dim instead of its square root"},
    {"last_token_own_doc", "last token is a document of its own"},
    // Fitted (a free softmax scale, another ring rank's block) or emulated ring variants.
    {"scale_padded_d", "head_dim 12 rounded up to 16, a multiple of 8"},
    {"docmask_own_block", "document mask applied only on the ring's own (diagonal) block"},
    // The forward right, only the backward's masks changed: the emulated backward names it.
    {"bwd_docmask_own_block",
     "the backward alone (its forward right) of zigzag ring attention with the document mask "
     "applied only on the ring's own (diagonal) block"},
    {"dq_other_blocks_unscaled", "other ring ranks' KV blocks are not multiplied by the softmax"},
    {"dkv_last_hop_wrong_way",
     "last hop, which returns each accumulator to its owner, went the wrong way"},
    {"kv_grad_not_reduced", "without its reduction over the ring"},
    // Rings under today's attention options and whole-block rings, written in torch and dumped
    // by seqpar.testing (tests/jobs/option_dumps.py).
    {"positions_in_rank_order", "chunk is measured in the order the rank holds its rows"},
    {"positions_rebuilt_locally", "chunk is measured in the rank's local positions"},
    {"sinks_first_slice", "on every Ulysses rank (the first H/U)"},
    {"sinks_negated", "sinks enter with the wrong sign"},
    {"sink_per_step", "folded into every ring step's partial result"},
    {"sink_sigmoid_lse_kept", "renormalised by the sinks (out·sigmoid(lse − sink)) but whose LSE"},
    {"window_off_by_one", "a sliding window one key too wide"},
    {"softcap_without_scale", "logit capping applied before the softmax scale"},
    {"softcap_after_mask", "logit capping applied after the mask"},
    {"window_left_only", "a bidirectional window on its left side only"},
    {"window_symmetric", "a bidirectional window with its right side taken equal to its left"},
    {"whole_blocks_docmask_zigzag",
     "zigzag ring attention over whole blocks (each step's rows against the whole KV block, "
     "masked by the tokens' global order) with the document mask applied only on the ring's own"},
    {"whole_blocks_docmask_contiguous",
     "ring attention with the document mask applied only on the ring's own (diagonal) block: on "
     "the blocks of earlier ranks"},
    {"whole_blocks_bwd_docmask_contiguous",
     "the backward alone (its forward right) of ring attention with the document mask applied "
     "only on the ring's own (diagonal) block"},
};

dump_report run(const fs::path& dir) { return validate_dump(read_dump(dir.string())); }

}  // namespace

TEST(Dumps, EveryRealJobIsJudgedAtTheRightStageRankAndCause) {
  const auto exp = expected();
  ASSERT_GE(exp.size(), 12u);
  int healthy = 0, broken = 0;
  for (const auto& [dir, e] : exp.items()) {
    SCOPED_TRACE(dir);
    const auto rep = run(dumps / dir);
    if (e.at("healthy").get<bool>()) {
      ++healthy;
      EXPECT_TRUE(rep.pass) << dump_report_text(rep);
      EXPECT_FALSE(rep.first);
      EXPECT_GE(rep.rows.size(), 10u);  // a pass is about something
      continue;
    }
    ++broken;
    ASSERT_FALSE(rep.pass);
    ASSERT_TRUE(rep.first) << dump_report_text(rep);
    EXPECT_EQ(rep.first->stage, e.at("first_stage").get<std::string>()) << rep.first->diagnosis;
    EXPECT_EQ(rep.first->ranks, e.at("ranks").get<std::vector<int>>()) << rep.first->diagnosis;
    const auto& words = cause_words.at(e.at("variant").get<std::string>());
    EXPECT_NE(rep.first->diagnosis.find(words), std::string::npos)
        << "diagnosis lacks '" << words << "': " << rep.first->diagnosis;
  }
  EXPECT_GE(healthy, 5);
  EXPECT_GE(broken, 13);
}

// The emulated zigzag ring with the correct schedule attends exactly the reference's keys: the
// emulator encodes the ring (sections, sources, local cu_seqlens), so its variants are
// meaningful.
TEST(Dumps, TheRingEmulatorWithTheCorrectScheduleIsTheReferenceMask) {
  for (int R : {2, 3, 4})
    for (const std::vector<std::int32_t>& cu :
         {std::vector<std::int32_t>{0, 8 * R}, {0, 4 * R, 10 * R, 12 * R}, {0, 2 * R, 4 * R}}) {
      const auto docs = doc_ranges(cu);
      const auto perm = zigzag_permutation(docs, R);
      const std::int64_t n = cu.back() / R;
      ring_job job;
      job.ring = R;
      const auto local = scale_cu_seqlens_for_ring(cu, R);
      for (int r = 0; r < R; ++r) {
        job.tokens.emplace_back(perm.begin() + r * n, perm.begin() + (r + 1) * n);
        job.local_cu.emplace_back(local.begin(), local.end());
      }
      for (int r = 0; r < R; ++r) {
        auto got = ring_key_sets(job, r, 0, n);
        auto want = reference_key_sets(job.tokens[static_cast<std::size_t>(r)], cu, true);
        for (std::size_t i = 0; i < got.size(); ++i) {
          std::sort(got[i].begin(), got[i].end());
          ASSERT_EQ(got[i], want[i]) << "R=" << R << " rank " << r << " row " << i;
        }
      }
      // One step chosen for the wrong source changes the keys of some row.
      job.section_shift = 1;
      bool differs = false;
      for (int r = 0; r < R && !differs; ++r) {
        auto got = ring_key_sets(job, r, 0, n);
        const auto want = reference_key_sets(job.tokens[static_cast<std::size_t>(r)], cu, true);
        for (std::size_t i = 0; i < got.size(); ++i) {
          std::sort(got[i].begin(), got[i].end());
          differs |= got[i] != want[i];
        }
      }
      EXPECT_TRUE(differs) << "R=" << R;
    }
}

// The contiguous ring ("basic": one chunk per rank) emulated with the correct schedule is the
// reference mask too, causal or not, over several documents; each step's block lies wholly
// before, at or after the rank's own.
TEST(Dumps, TheContiguousRingEmulatorIsTheReferenceMask) {
  for (int R : {2, 3, 4})
    for (bool causal : {true, false})
      for (const std::vector<std::int32_t>& cu :
           {std::vector<std::int32_t>{0, 8 * R}, {0, 3 * R, 5 * R + 1, 8 * R}}) {
        const std::int64_t n = cu.back() / R;
        ring_job job;
        job.ring = R;
        job.causal = causal;
        job.zigzag = false;
        job.global_cu = cu;
        for (int r = 0; r < R; ++r) {
          job.tokens.emplace_back();
          for (std::int64_t t = r * n; t < (r + 1) * n; ++t) job.tokens.back().push_back(t);
        }
        for (int r = 0; r < R; ++r) {
          const auto want = reference_key_sets(job.tokens[static_cast<std::size_t>(r)], cu, causal);
          for (std::int64_t i = 0; i < n; ++i) {
            const auto blocks = ring_key_blocks(job, r, i);
            ASSERT_EQ(blocks.size(), static_cast<std::size_t>(R));
            std::vector<std::int64_t> got;
            for (int step = 0; step < R; ++step)
              for (auto t : blocks[static_cast<std::size_t>(step)]) {
                const int held = ((r - step) % R + R) % R;
                EXPECT_EQ(t / n, held) << "a key of step " << step << " from another block";
                got.push_back(t);
              }
            std::sort(got.begin(), got.end());
            ASSERT_EQ(got, want[static_cast<std::size_t>(i)])
                << "R=" << R << " causal " << causal << " rank " << r << " row " << i;
          }
        }
      }
}

// Under a layer's options the emulated ring with the correct schedule is still the reference
// mask — sections intersected with the window and chunk by document positions, both layouts,
// causal and bidirectional — and the layout-order mistakes (each step's call without position
// ids, the rank's row order) change it.
TEST(Dumps, TheRingEmulatorUnderOptionsIsTheReferenceMask) {
  struct mask {
    std::int64_t back, ahead, chunk;
  };
  int differing = 0, configs = 0;
  for (int R : {2, 3, 4})
    for (bool zigzag : {true, false})
      for (bool causal : {true, false})
        for (const mask& mk :
             {mask{3, -1, 0}, mask{5, 2, 0}, mask{-1, -1, 4}, mask{6, 1, 5}, mask{0, 0, 0}})
          for (const std::vector<std::int32_t>& cu :
               {std::vector<std::int32_t>{0, 8 * R}, {0, 4 * R, 10 * R, 12 * R}}) {
            SCOPED_TRACE(fmt::format("R {} {} {} back {} ahead {} chunk {} cu [{}]", R,
                                     zigzag ? "zigzag" : "contiguous",
                                     causal ? "causal" : "bidirectional", mk.back, mk.ahead,
                                     mk.chunk, fmt::join(cu, ",")));
            const std::int64_t n = cu.back() / R;
            ring_job job;
            job.ring = R;
            job.causal = causal;
            job.zigzag = zigzag;
            job.global_cu = cu;
            job.window_back = mk.back;
            job.window_ahead = causal ? -1 : mk.ahead;
            job.chunk = mk.chunk;
            const auto perm = zigzag_permutation(doc_ranges(cu), R);
            const auto local = scale_cu_seqlens_for_ring(cu, R);
            for (int r = 0; r < R; ++r) {
              job.tokens.emplace_back();
              for (std::int64_t t = r * n; t < (r + 1) * n; ++t)
                job.tokens.back().push_back(zigzag ? perm[static_cast<std::size_t>(t)] : t);
              if (zigzag) job.local_cu.emplace_back(local.begin(), local.end());
            }
            // The reference: same document, within the mask by document positions.
            const auto want = [&](std::int64_t t) {
              const auto d = std::upper_bound(cu.begin(), cu.end(), t) - cu.begin() - 1;
              const std::int64_t a = cu[static_cast<std::size_t>(d)],
                                 b = cu[static_cast<std::size_t>(d) + 1];
              const auto [lo, hi] =
                  visible_positions(causal, job.window_back, job.window_ahead, job.chunk, t - a);
              std::vector<std::int64_t> keys;
              for (std::int64_t j = a; j < b; ++j)
                if (j - a >= lo && j - a <= hi) keys.push_back(j);
              return keys;
            };
            const auto keys_of = [&](const ring_job& jb, int r) {
              auto got = ring_key_sets(jb, r, 0, n);
              for (auto& k : got) std::sort(k.begin(), k.end());
              return got;
            };
            for (int r = 0; r < R; ++r) {
              const auto got = keys_of(job, r);
              for (std::int64_t i = 0; i < n; ++i)
                ASSERT_EQ(
                    got[static_cast<std::size_t>(i)],
                    want(job.tokens[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)]))
                    << "rank " << r << " row " << i;
            }
            // Measured in the layout's rows, the mask differs somewhere (where it can: a window
            // of 0 keys back and ahead, or one reaching every key, is the same in any order).
            bool differs = false;
            for (int mode : {1, 2}) {
              auto wrong = job;
              wrong.call_positions = mode;
              for (int r = 0; r < R && !differs; ++r) {
                const auto got = keys_of(wrong, r);
                for (std::int64_t i = 0; i < n; ++i)
                  differs |=
                      got[static_cast<std::size_t>(i)] !=
                      want(job.tokens[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)]);
              }
            }
            ++configs;
            differing += differs;
          }
  EXPECT_GE(differing, configs * 3 / 4) << "of " << configs;
}

TEST(Dumps, RoundingToBitsIsTheDtypesRounding) {
  // bfloat16 keeps 8 significant bits, float16 11; ties go to even.
  EXPECT_EQ(round_to_bits(1.0 + 1.0 / 512, 8), 1.0);             // below half an ulp (2^-7)
  EXPECT_EQ(round_to_bits(1.0 + 3.0 / 256, 8), 1.0 + 1.0 / 64);  // 1.01171875: a tie, to even
  EXPECT_EQ(round_to_bits(1.0 + 1.0 / 256, 8), 1.0);             // a tie, to even (1.0)
  EXPECT_EQ(round_to_bits(-23.37, 8), -23.375);
  EXPECT_EQ(round_to_bits(-23.37, 11), -23.375);
  EXPECT_EQ(round_to_bits(-23.3701, 11), -23.375);
  EXPECT_EQ(round_to_bits(2049.0, 11), 2048.0);  // float16's spacing is 2 above 2048: a tie
  EXPECT_EQ(round_to_bits(2051.0, 11), 2052.0);
  EXPECT_EQ(round_to_bits(0.1, 0), 0.1);
}

TEST(Dumps, AttentionOverKeySetsIsTheReferenceKernel) {
  const int S = 24, H = 4, Hkv = 2, D = 8;
  const std::vector<std::int32_t> cu{0, 10, 24};
  std::mt19937_64 gen(7);
  std::normal_distribution<double> nd;
  std::vector<double> q(S * H * D), k(S * Hkv * D), v(S * Hkv * D);
  for (auto* x : {&q, &k, &v})
    for (auto& y : *x) y = nd(gen);
  std::vector<std::int64_t> rows(S);
  for (int i = 0; i < S; ++i) rows[static_cast<std::size_t>(i)] = i;
  std::vector<double> out, lse, ref_out(q.size()), ref_lse(S * H);
  attention_over_keys(q, k, v, H, Hkv, D, 0.3, rows, reference_key_sets(rows, cu, true), out, lse);
  const sim::attention_args<double> a{q.data(), k.data(),  v.data(),  S, S,   H,   Hkv,
                                      D,        cu.data(), cu.data(), 2, 0.3, true};
  sim::attention_forward_naive(a, ref_out.data(), ref_lse.data());
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref_out[i], 1e-13);
  for (std::size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-13);
}

namespace {

/// A copy of a healthy fixture in a temporary directory, for test-side changes.
fs::path copy_fixture(const std::string& name) {
  const auto dst =
      fs::temp_directory_path() / ("seqpar-dump-test-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dst);
  fs::copy(dumps / name, dst, fs::copy_options::recursive);
  return dst;
}

/// Applies f to tensor `stage` of rank k's call-0 file (forward or backward) and writes it back.
void edit(const fs::path& dir, int k, const std::string& stage,
          const std::function<void(std::vector<double>&)>& f) {
  const auto file = dir / fmt::format("rank{}/call0000.{}.safetensors", k,
                                      stage.starts_with("grad.") ? "bwd" : "fwd");
  auto st = io::read_safetensors(file.string());
  for (auto& t : st.tensors)
    if (t.name == stage) {
      auto v = t.to_f64();
      f(v);
      t = io::make_tensor(t.name, t.shape, v, t.type);
    }
  io::write_safetensors(file.string(), st);
}

std::string healthy_named(const std::string& job) {
  const auto exp = expected();
  for (const auto& [dir, e] : exp.items())
    if (e.at("healthy").get<bool>() && dir.starts_with(job)) return dir;
  return "";
}

}  // namespace

// Changes made on the test side to a healthy job's dump, each caught at its stage.
TEST(Dumps, ChangesToAHealthyDumpAreCaughtWhereTheyAre) {
  const auto name = healthy_named("ulysses");
  ASSERT_FALSE(name.empty());
  {  // one element of one rank's gathered V off by one unit in the last place: bit-exact stage
    const auto d = copy_fixture(name);
    edit(d, 1, "v.gathered", [](auto& v) {
      v[5] = std::nextafter(static_cast<float>(v[5]), 1e9f);  // the dump is float32
    });
    const auto rep = run(d);
    ASSERT_TRUE(rep.first);
    EXPECT_EQ(rep.first->stage, "v.gathered");
    EXPECT_EQ(rep.first->ranks, std::vector<int>{1});
    fs::remove_all(d);
  }
  {  // two ranks' outputs exchanged after the reverse all-to-all
    const auto d = copy_fixture(name);
    auto a = io::read_safetensors((d / "rank0/call0000.fwd.safetensors").string());
    auto b = io::read_safetensors((d / "rank1/call0000.fwd.safetensors").string());
    std::swap(const_cast<io::st_tensor&>(*a.find("out.local")).bytes,
              const_cast<io::st_tensor&>(*b.find("out.local")).bytes);
    io::write_safetensors((d / "rank0/call0000.fwd.safetensors").string(), a);
    io::write_safetensors((d / "rank1/call0000.fwd.safetensors").string(), b);
    const auto rep = run(d);
    ASSERT_TRUE(rep.first);
    EXPECT_EQ(rep.first->stage, "out.local");
    EXPECT_NE(rep.first->diagnosis.find("where tokens"), std::string::npos) << rep.first->diagnosis;
    fs::remove_all(d);
  }
  {  // a gradient scaled by 1 + 1e-3: far above the float32 tolerance
    const auto d = copy_fixture(name);
    edit(d, 0, "grad.q.gathered", [](auto& v) {
      for (auto& x : v) x *= 1.001;
    });
    const auto rep = run(d);
    ASSERT_TRUE(rep.first);
    EXPECT_EQ(rep.first->stage, "grad.q.gathered");
    fs::remove_all(d);
  }
}

TEST(Dumps, InvalidDumpsAreNamedErrors) {
  const auto name = healthy_named("ring");
  ASSERT_FALSE(name.empty());
  EXPECT_THROW(read_dump("/nonexistent/dump"), trace_error);
  {
    const auto d = copy_fixture(name);
    fs::remove(d / "rank1.json");
    try {
      (void)read_dump(d.string());
      ADD_FAILURE() << "no error";
    } catch (const trace_error& e) {
      EXPECT_NE(std::string(e.what()).find("no meta for cp rank 1"), std::string::npos) << e.what();
    }
    fs::remove_all(d);
  }
  {
    const auto d = copy_fixture(name);
    auto meta = nlohmann::json::parse(io::read_file((d / "rank1.json").string()));
    meta["heads"] = 6;
    io::write_atomic((d / "rank1.json").string(), meta.dump());
    EXPECT_THROW((void)read_dump(d.string()), config_error);
    fs::remove_all(d);
  }
  {
    const auto d = copy_fixture(name);
    const auto f = d / "rank0/call0000.fwd.safetensors";
    const auto bytes = io::read_file(f.string());
    io::write_atomic(f.string(), bytes.substr(0, bytes.size() / 2));
    EXPECT_THROW((void)run(d), trace_error);
    fs::remove_all(d);
  }
}
