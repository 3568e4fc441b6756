// seqpar-trace/1: every example trace under traces/ gives its diagnostic (category, rank, seq,
// tag, observed vs expected, cause); the reader names the line of every malformed record; the
// writer is atomic; the importers read the documented formats (traces/import-samples/).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <unistd.h>

#include "core/error.hpp"
#include "core/scenario.hpp"
#include "io/scenario_json.hpp"
#include "scenario_flags.hpp"
#include "support/source_dir.hpp"
#include "trace/import/chrome_scan.hpp"
#include "trace/import/import.hpp"
#include "trace/replay.hpp"
#include "trace/synth.hpp"
#include "trace/trace_io.hpp"

using namespace seqpar;

namespace {

const std::string root = test::source_dir();

replay::report replay_file(const std::string& name) {
  auto in = trace::reader::open(root + "/traces/" + name);
  return replay::run(*in);
}

replay::report replay_text(const std::string& text) {
  std::istringstream s(text);
  trace::reader r(s, "test");
  return replay::run(r);
}

const replay::problem* find(const replay::report& r, const std::string& category) {
  for (const auto& p : r.problems)
    if (p.category == category) return &p;
  return nullptr;
}

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

std::string error_of(const std::string& text) {
  try {
    replay_text(text);
  } catch (const trace_error& e) {
    return e.what();
  }
  return "";
}

const std::string meta2 =
    R"({"type":"meta","schema":"seqpar-trace/1","world_size":2,"groups":{"g":[0,1]}})";

}  // namespace

TEST(traces, healthy_examples_are_consistent_and_match_the_plans) {
  for (const auto* name : {"healthy_xorl_u4_gqa.jsonl", "healthy_xorl_u2_r2_zigzag.jsonl",
                           "healthy_veomni_u2_mha.jsonl", "healthy_xorl_u4_kv1_repeat.jsonl",
                           "healthy_xorl_u4_async_qknorm.jsonl"}) {
    SCOPED_TRACE(name);
    const auto rep = replay_file(name);
    EXPECT_TRUE(rep.consistent) << replay::to_text(rep);
    EXPECT_GT(rep.checked.at("sp_shape_checks"), 0);
    EXPECT_GT(rep.checked.at("layout_vs_plan"), 0);
    // The committed file is exactly what the plans give today (no drift).
    std::ifstream f(root + "/traces/" + name);
    std::string first;
    std::getline(f, first);
    const auto meta = nlohmann::json::parse(first);
    const auto s = io::scenario_from_json(meta.at("config"), scenario{});
    std::stringstream all;
    all << first << '\n' << f.rdbuf();
    EXPECT_EQ(all.str(), trace::synthesize(s).text());
  }
}

TEST(traces, sequence_not_divisible_by_ulysses) {
  const auto rep = replay_file("broken_seq_not_divisible_by_u.jsonl");
  ASSERT_FALSE(rep.consistent);
  const auto* p = find(rep, replay::category::sp_shape);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->rank, 3);
  EXPECT_EQ(p->group, "ulysses0");
  EXPECT_EQ(p->seq, 0);
  EXPECT_EQ(p->tag, "L0.attn.q.fwd");
  EXPECT_EQ(p->observed, "in_shape [255,8,16]");
  EXPECT_EQ(p->expected, "[257,8,16]");
  EXPECT_EQ(p->cause, "sequence 1026 is not padded to a multiple of ulysses=4 (pad to 1028)");
  // The collator output shows it first, with the same cause.
  EXPECT_EQ(rep.problems.front().category, replay::category::cu_seqlens);
  EXPECT_TRUE(contains(rep.problems.front().cause, "sequence 1026 is not padded"));
  // And every disagreeing all-to-all link has rank 3 on one end: rank 3 is named, not its peers.
  const auto* s = find(rep, replay::category::size_mismatch);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->rank, 3);
  EXPECT_TRUE(
      contains(s->observed, "rank 3's in_splits and out_splits disagree with 6 of its links"))
      << s->observed;
  EXPECT_TRUE(contains(s->observed, "0→3: 8224 sent, 8160 expected")) << s->observed;
}

// Async Ulysses: rank 1's wait for q moved after the layer's output all-to-all (the trace of
// healthy_xorl_u4_async_qknorm.jsonl with that one line moved).
TEST(traces, async_q_waited_after_the_attention_used_it) {
  const auto rep = replay_file("broken_async_q_waited_after_use.jsonl");
  ASSERT_EQ(rep.problems.size(), 1u);
  const auto& p = rep.problems.front();
  EXPECT_EQ(p.category, replay::category::async_wait);
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.tag, "L0.attn.q.fwd");
  EXPECT_EQ(p.expected, "waited before L0.attn.out.fwd");
}

TEST(traces, kv_heads_below_ulysses_without_repeat) {
  const auto rep = replay_file("broken_kv_heads_not_repeated.jsonl");
  const auto& p = rep.problems.front();
  EXPECT_EQ(p.category, replay::category::sp_heads);
  EXPECT_EQ(p.rank, 0);
  EXPECT_EQ(p.seq, 1);
  EXPECT_EQ(p.tag, "L0.attn.kv.fwd");
  EXPECT_EQ(p.observed, "in_shape [50,4,16]");
  EXPECT_EQ(p.expected, "[50,8,16]");
  EXPECT_TRUE(contains(p.cause, "kv_heads=2 < ulysses=4 and the KV heads were not repeated"));
}

TEST(traces, document_misaligned_for_zigzag) {
  const auto rep = replay_file("broken_zigzag_misaligned_doc.jsonl");
  const auto* p = find(rep, replay::category::zigzag);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->rank, 0);
  EXPECT_EQ(p->tag, "collate");
  EXPECT_EQ(p->observed, "document 0 at position 0 has length 10");
  EXPECT_EQ(p->expected, "a multiple of 2·ring=4");
  EXPECT_TRUE(contains(p->cause, "not divisible by 2*ringattn_size=4"));
  EXPECT_EQ(rep.problems.front().category, replay::category::sp_config);
}

TEST(traces, cu_seqlens_from_zigzagged_ids) {
  const auto rep = replay_file("broken_cu_from_zigzag_ids.jsonl");
  const auto& p = rep.problems.front();
  EXPECT_EQ(p.category, replay::category::cu_seqlens);
  EXPECT_EQ(p.rank, 0);
  EXPECT_EQ(p.observed, "cu_seqlens [0,8,12,32]");
  EXPECT_TRUE(contains(p.cause, "computed from zigzagged position_ids"));
}

TEST(traces, mismatched_all_to_all_splits) {
  const auto rep = replay_file("broken_a2a_split_mismatch.jsonl");
  const auto* p = find(rep, replay::category::size_mismatch);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->rank, 1);
  EXPECT_EQ(p->seq, 2);
  EXPECT_EQ(p->tag, "L0.attn.out.fwd");
  EXPECT_EQ(p->observed,
            "rank 1's in_splits disagree with 2 of its links (1→2: 1568 sent, 1600 expected; "
            "1→3: 1632 sent, 1600 expected)");
  EXPECT_EQ(p->expected, "the counts every peer agrees on");
  EXPECT_TRUE(contains(p->cause, "rank 1's split list is stale")) << p->cause;
  const auto* sp = find(rep, replay::category::sp_shape);
  ASSERT_NE(sp, nullptr);
  EXPECT_EQ(sp->observed, "in_splits[2] = 1568");
}

TEST(traces, missing_rank_is_the_hang) {
  const auto rep = replay_file("broken_missing_rank_hang.jsonl");
  const auto& p = rep.problems.front();
  EXPECT_EQ(p.category, replay::category::missing_rank);
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.group, "ulysses0");
  EXPECT_EQ(p.seq, 17);
  EXPECT_EQ(p.tag, "L0.attn.kv.bwd");
  EXPECT_TRUE(contains(p.cause,
                       "rank 3 never reached seq 17 of ulysses0 (last seen seq 16, tag "
                       "L0.attn.q.bwd)"));
}

// A rank whose last call another rank's abort cut short (its flight record's error says
// "aborted: rank N failed") is named as a consequence of rank N's failure, behind the causes;
// the same record without that error is the hang.
TEST(traces, a_rank_cut_short_by_an_abort_is_a_consequence) {
  const std::string meta3 =
      R"({"type":"meta","schema":"seqpar-trace/1","world_size":3,"groups":{"g":[0,1]}})";
  const std::string rank1 =
      R"({"type":"collective","rank":1,"group":"g","seq":0,"op":"barrier","tag":"a","state":"completed"})"
      "\n"
      R"({"type":"collective","rank":1,"group":"g","seq":1,"op":"barrier","tag":"b","state":"started"})"
      "\n";
  const auto rank0 = [](const std::string& extra) {
    return R"({"type":"collective","rank":0,"group":"g","seq":0,"op":"barrier","tag":"a","state":"started")" +
           extra + "}\n";
  };
  const auto missing_rank0 = [](const replay::report& rep) -> const replay::problem* {
    for (const auto& p : rep.problems)
      if (p.category == replay::category::missing_rank && p.rank == 0) return &p;
    return nullptr;
  };
  auto rep = replay_text(meta3 + "\n" + rank1 +
                         rank0(R"(,"error":"aborted: rank 2 failed: rank 2 on h2: boom")"));
  const auto* p = missing_rank0(rep);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(contains(p->cause,
                       "rank 0 left seq 0 of g (tag a) unfinished when rank 2 aborted "
                       "the job"))
      << p->cause;
  EXPECT_TRUE(contains(p->cause, "a consequence of rank 2's failure")) << p->cause;
  EXPECT_EQ(p->phase, 2);
  rep = replay_text(meta3 + "\n" + rank1 + rank0(""));
  p = missing_rank0(rep);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(contains(p->cause, "rank 0 never reached seq 1 of g")) << p->cause;
}

TEST(traces, dtype_mismatch) {
  const auto rep = replay_file("broken_dtype_mismatch.jsonl");
  ASSERT_EQ(rep.problems.size(), 1u);
  const auto& p = rep.problems.front();
  EXPECT_EQ(p.category, replay::category::dtype_mismatch);
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.seq, 4);
  EXPECT_EQ(p.tag, "L1.attn.kv.fwd");
  EXPECT_EQ(p.observed, "dtype bfloat16");
  EXPECT_EQ(p.expected, "dtype float32 like the other members");
}

TEST(traces, type_state_and_size_laws) {
  const std::string c0 = R"({"type":"collective","rank":0,"group":"g","seq":0,)";
  const std::string c1 = R"({"type":"collective","rank":1,"group":"g","seq":0,)";
  auto rep =
      replay_text(meta2 + "\n" + c0 + R"("op":"all_reduce","in_shape":[4],"out_shape":[4]})" +
                  "\n" + c1 + R"("op":"all_gather","in_shape":[4],"out_shape":[8]})" + "\n");
  EXPECT_EQ(rep.problems.front().category, replay::category::type_mismatch);
  rep = replay_text(meta2 + "\n" + c0 + R"("op":"all_gather","in_shape":[4],"out_shape":[8]})" +
                    "\n" + c1 + R"("op":"all_gather","in_shape":[4],"out_shape":[6]})" + "\n");
  ASSERT_FALSE(rep.consistent);
  EXPECT_EQ(rep.problems.front().category, replay::category::size_mismatch);
  EXPECT_EQ(rep.problems.front().expected, "out = in·2 = 8");
  rep = replay_text(meta2 + "\n" + c0 + R"("op":"barrier","state":"completed"})" + "\n" + c1 +
                    R"("op":"barrier","state":"completed"})" + "\n");
  EXPECT_TRUE(rep.consistent);
}

TEST(traces, send_recv_pair_in_order) {
  const std::string s =
      R"({"type":"p2p","rank":0,"group":"g","op":"send","peer":1,"dtype":"float32",)";
  const std::string r =
      R"({"type":"p2p","rank":1,"group":"g","op":"recv","peer":0,"dtype":"float32",)";
  auto rep = replay_text(meta2 + "\n" + s + R"("seq":0,"shape":[4,2],"tag":"a"})" + "\n" + s +
                         R"("seq":1,"shape":[6],"tag":"b"})" + "\n" + r +
                         R"("seq":0,"shape":[6],"tag":"b"})" + "\n" + r +
                         R"("seq":1,"shape":[8],"tag":"a"})" + "\n");
  ASSERT_FALSE(rep.consistent);
  const auto& p = rep.problems.front();
  EXPECT_EQ(p.category, replay::category::p2p_mismatch);
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.seq, 0);
  // A send nobody receives is a hang.
  rep = replay_text(meta2 + "\n" + s + R"("seq":0,"shape":[4]})" + "\n");
  EXPECT_TRUE(contains(rep.problems.front().cause, "rank 1 never posted the matching recv"));
}

TEST(trace_reader, names_the_line_and_what_is_wrong) {
  EXPECT_TRUE(
      contains(error_of(meta2 + "\n{\"type\":\"collective\",\n"), "test:2: not valid JSON"));
  EXPECT_TRUE(contains(error_of(meta2 + "\n\n[1,2]\n"), "test:3: a record must be a JSON object"));
  EXPECT_TRUE(contains(
      error_of(meta2 + "\n" + R"({"type":"collective","rank":0,"group":"g","op":"all_reduce"})"),
      "test:2: collective record has no 'seq'"));
  EXPECT_TRUE(
      contains(error_of(meta2 + "\n" +
                        R"({"type":"collective","rank":5,"group":"g","seq":0,"op":"all_reduce"})"),
               "test:2: 'rank' = 5 is not a rank of a world of 2"));
  EXPECT_TRUE(
      contains(error_of(meta2 + "\n" +
                        R"({"type":"collective","rank":0,"group":"g","seq":0,"op":"allreduce"})"),
               "collective op 'allreduce' is unknown"));
  EXPECT_TRUE(
      contains(error_of(meta2 + "\n" +
                        R"({"type":"collective","rank":0,"group":"g","seq":"3","op":"barrier"})"),
               "'seq' must be an integer"));
  EXPECT_TRUE(contains(
      error_of(
          meta2 + "\n" +
          R"({"type":"collective","rank":0,"group":"g","seq":0,"op":"barrier","in_shape":[-1]})"),
      "'in_shape[0]' = -1 is out of range"));
  EXPECT_TRUE(contains(error_of(meta2 + "\n" + meta2 + "\n"),
                       "test:2: a meta record may only be the first line"));
  EXPECT_TRUE(contains(error_of(R"({"type":"meta","schema":"seqpar-trace/2","world_size":1})"),
                       "schema 'seqpar-trace/2' is not supported"));
  EXPECT_TRUE(contains(error_of(R"({"type":"span"})"), "record type 'span' is unknown"));
  EXPECT_TRUE(contains(error_of(""), "the trace is empty"));
  EXPECT_TRUE(contains(error_of(meta2 + "\n" + R"({"type":"layout","rank":0,"cu_seqlens":[0,4]})"),
                       "layout record has no 'local_tokens'"));
}

TEST(trace_writer, round_trips_comm_records_and_is_atomic) {
  comm_record a;
  a.rank = 1;
  a.group = "ulysses0";
  a.seq = 3;
  a.op = "all_to_all";
  a.type = dtype::bf16;
  a.in_shape = {4, 8, 16};
  a.out_shape = {8, 4, 16};
  a.in_splits = {256, 256};
  a.out_splits = {256, 256};
  a.tag = "L0.attn.q.fwd";
  comm_record b;
  b.kind = "p2p";
  b.rank = 1;
  b.group = "ring0";
  b.op = "send";
  b.peer = 0;
  b.shape = {8, 4, 16};
  trace::meta_record m;
  m.world_size = 2;
  m.groups = {{"ulysses0", {0, 1}}, {"ring0", {0, 1}}};
  trace::writer w(m);
  w.add(a);
  w.add(b);
  trace::layout_record l;
  l.rank = 1;
  l.local_tokens = 4;
  l.cu_seqlens = {0, 3, 8};
  l.max_seqlen = 5;
  w.add(l);
  std::istringstream in(w.text());
  trace::reader r(in, "mem");
  auto m2 = std::get<trace::meta_record>(*r.next());
  EXPECT_EQ(m2.groups, m.groups);
  auto a2 = std::get<trace::call_record>(*r.next());
  EXPECT_EQ(trace::to_json(a2), trace::to_json(trace::from_comm_record(a)));
  EXPECT_EQ(*a2.dtype, "bfloat16");
  auto b2 = std::get<trace::call_record>(*r.next());
  EXPECT_TRUE(b2.p2p);
  EXPECT_EQ(*b2.peer, 0);
  auto l2 = std::get<trace::layout_record>(*r.next());
  EXPECT_EQ(l2.cu_seqlens, l.cu_seqlens);
  EXPECT_FALSE(r.next().has_value());

  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / "seqpar-trace-test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  w.write((dir / "t.jsonl").string());
  EXPECT_TRUE(fs::exists(dir / "t.jsonl"));
  EXPECT_THROW(w.write((dir / "missing" / "t.jsonl").string()), seqpar::error);
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
  EXPECT_EQ(n, 1u);  // no temp file left behind
  fs::remove_all(dir);
}

TEST(trace_import, flight_recorder_dumps) {
  const auto files = import::expand_inputs({root + "/traces/import-samples/fr"});
  const auto t = import::from_fr(files);
  EXPECT_EQ(t.meta.world_size, 2);
  EXPECT_EQ(t.meta.groups.at("ulysses0"), (std::vector<int>{0, 1}));
  ASSERT_EQ(t.calls.size(), 10u);
  EXPECT_EQ(t.calls[0].op, "all_to_all");
  EXPECT_EQ(t.calls[0].group, "ulysses0");
  EXPECT_EQ(*t.calls[0].in_shape, (trace::dims{50, 8, 16}));
  EXPECT_EQ(*t.calls[0].dtype, "float32");
  EXPECT_FALSE(t.calls[0].in_splits.has_value());  // FR does not record splits
  std::istringstream in(t.text());
  trace::reader r(in, "fr");
  const auto rep = replay::run(r);
  EXPECT_TRUE(rep.consistent) << replay::to_text(rep);
  EXPECT_FALSE(rep.unchecked.empty());

  const auto broken =
      import::from_fr(import::expand_inputs({root + "/traces/import-samples/fr_broken"}));
  std::istringstream in2(broken.text());
  trace::reader r2(in2, "fr_broken");
  const auto rep2 = replay::run(r2);
  EXPECT_NE(find(rep2, replay::category::state_mismatch), nullptr);
  EXPECT_NE(find(rep2, replay::category::dtype_mismatch), nullptr);
  const auto* miss = find(rep2, replay::category::missing_rank);
  ASSERT_NE(miss, nullptr);
  EXPECT_EQ(miss->rank, 1);
  EXPECT_EQ(miss->seq, 2);
}

TEST(trace_import, kineto_record_param_comms) {
  const auto t = import::from_kineto(
      import::expand_inputs({root + "/traces/import-samples/kineto_split_mismatch"}));
  ASSERT_EQ(t.calls.size(), 8u);
  EXPECT_EQ(t.calls[0].op, "all_to_all");
  EXPECT_EQ(*t.calls[0].in_numel, 6400);
  EXPECT_EQ(*t.calls[0].in_splits, (trace::dims{3200, 3200}));
  EXPECT_TRUE(t.calls[3].splits_truncated);
  std::istringstream in(t.text());
  trace::reader r(in, "kineto");
  const auto rep = replay::run(r);
  const auto* p = find(rep, replay::category::size_mismatch);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->rank, 1);
  EXPECT_TRUE(contains(p->observed,
                       "rank 1's in_splits and out_splits disagree with 2 of its "
                       "links (1→0: 3000 sent, 3200 expected"))
      << p->observed;
}

TEST(trace_import, nccl_debug_log) {
  const auto t = import::from_nccl_log({root + "/traces/import-samples/nccl/nccl_debug.log"});
  EXPECT_EQ(t.meta.world_size, 2);
  ASSERT_EQ(t.calls.size(), 10u);
  EXPECT_EQ(t.calls[1].op, "all_gather");
  EXPECT_EQ(*t.calls[1].out_numel, 2048);
  EXPECT_EQ(*t.calls[2].peer, 1);
  std::istringstream in(t.text());
  trace::reader r(in, "nccl");
  const auto rep = replay::run(r);
  ASSERT_EQ(rep.problems.size(), 1u);
  EXPECT_EQ(rep.problems.front().category, replay::category::size_mismatch);
  EXPECT_EQ(rep.problems.front().rank, 1);
  EXPECT_EQ(rep.checked.at("p2p_pairs"), 2);
}

// Every ncclDataType_t number maps to its dtype as nccl.h defines it (0 int8 … 9 bfloat16 …),
// and a rank whose all_reduce is bfloat16 against one whose is float16 — two 16-bit types of
// equal size, the mix a mapping that merges them would hide — is a dtype mismatch.
TEST(trace_import, nccl_log_datatypes) {
  const char* want[] = {"int8",    "uint8",    "int32",         "uint32",
                        "int64",   "uint64",   "float16",       "float32",
                        "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2"};
  const auto path =
      (std::filesystem::temp_directory_path() / fmt::format("seqpar-nccl-{}.log", ::getpid()))
          .string();
  {
    std::ofstream f(path);
    for (int r = 0; r < 2; ++r)
      f << fmt::format(
          "n1:{0}:{0} [{1}] NCCL INFO comm 0x10{1} rank {1} nranks 2 cudaDev {1} nvmlDev {1} "
          "busId {1}000 commId 0xabc - Init COMPLETE\n",
          4000 + r, r);
    for (int d = 0; d < 12; ++d)
      for (int r = 0; r < 2; ++r)
        f << fmt::format(
            "n1:{0}:{0} [{1}] NCCL INFO AllReduce: opCount {2:x} sendbuff 0x7f0 recvbuff 0x7f0 "
            "count 4 datatype {3} op 0 root 0 comm 0x10{1} [nranks=2] stream 0x600\n",
            4000 + r, r, d, d == 11 ? (r == 0 ? 9 : 6) : d);
  }
  const auto t = import::from_nccl_log({path});
  std::filesystem::remove(path);
  ASSERT_EQ(t.calls.size(), 24u);
  int seen = 0;
  for (const auto& c : t.calls) {
    if (c.seq >= 11) continue;  // the last all_reduce: bfloat16 against float16
    ASSERT_TRUE(c.dtype.has_value());
    EXPECT_EQ(*c.dtype, want[c.seq]) << "datatype " << c.seq << " on rank " << c.rank;
    ++seen;
  }
  EXPECT_EQ(seen, 22);
  std::istringstream in(t.text());
  trace::reader rd(in, "nccl");
  const auto rep = replay::run(rd);
  ASSERT_FALSE(rep.problems.empty());
  EXPECT_EQ(rep.problems.front().category, replay::category::dtype_mismatch)
      << rep.problems.front().message();
}

// A fuzzer finding: a 3.5 KB crafted log line made the regex-based NCCL line parser backtrack
// for more than 13 s (ASan build). The tokenizer reads it at once; it holds no collective.
TEST(trace_import, nccl_log_line_that_made_regex_backtrack) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(
      import::from_nccl_log({root + "/tests/equivalence/data/fuzz/nccl_log_backtracking.log"}),
      trace_error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

// A fuzzer finding: a trace whose meta.config has kv_heads 0 divided by zero (SIGFPE) while
// replay described the valid Ulysses sizes. Now the config is reported and the malformed line
// after it is a trace_error.
TEST(trace_replay, config_with_zero_kv_heads_is_reported_not_a_crash) {
  auto in =
      trace::reader::open(root + "/tests/equivalence/data/fuzz/replay_config_kv_heads_zero.jsonl");
  EXPECT_THROW((void)replay::run(*in), trace_error);
  EXPECT_TRUE(valid_ulysses_sizes(4, 0).empty());
}

// Long digit runs and long names are read without std::regex recursion (stack depth).
TEST(trace_import, long_fields_do_not_exhaust_the_stack) {
  const auto dir = std::filesystem::temp_directory_path();
  const auto path = (dir / "seqpar-kineto-long-digits.json").string();
  {
    std::ofstream out(path);
    out << R"({"traceEvents":[{"name":"record_param_comms","ph":"X","args":{"Rank":0,)"
        << R"("Collective name":"all_to_allv","In split size":")" << std::string(2000000, '7')
        << R"("}}]})";
  }
  try {
    (void)import::from_kineto({path});
  } catch (const trace_error&) {
  }
  std::filesystem::remove(path);
  SUCCEED();
}

TEST(trace_replay, html_is_self_contained) {
  const auto rep = replay_file("broken_missing_rank_hang.jsonl");
  const auto html = replay::to_html(rep);
  EXPECT_TRUE(contains(html, "<svg"));
  EXPECT_TRUE(contains(html, "never reached"));
  EXPECT_FALSE(contains(html, "src=\"http"));
  EXPECT_FALSE(contains(html, "<script src"));
  EXPECT_FALSE(contains(html, "<link"));
}

namespace {

/// One all-to-all on a group of 4 with per-rank splits and states, as the recorder writes it.
std::string a2a4(int rank, const char* in_splits, const char* state) {
  return fmt::format(
      R"({{"type":"collective","rank":{},"group":"u","seq":0,"op":"all_to_all","tag":"L0.attn.q.fwd","in_shape":[16,8],"out_shape":[16,8],"in_splits":{},"out_splits":[32,32,32,32],"state":"{}"}})",
      rank, in_splits, state);
}

}  // namespace

TEST(replay, the_cause_of_a_call_comes_before_its_consequences_on_other_ranks) {
  // Rank 3 sends with a stale split list; gloo aborts rank 0's call (state started while the
  // others completed). The first line names rank 3, the cause; rank 0's state follows it.
  const std::string meta =
      R"({"type":"meta","schema":"seqpar-trace/1","world_size":4,"groups":{"u":[0,1,2,3]}})";
  const std::string text = meta + "\n" + a2a4(0, "[32,32,32,32]", "started") + "\n" +
                           a2a4(1, "[32,32,32,32]", "completed") + "\n" +
                           a2a4(2, "[32,32,32,32]", "completed") + "\n" +
                           a2a4(3, "[40,24,32,32]", "completed") + "\n";
  const auto rep = replay_text(text);
  ASSERT_GE(rep.problems.size(), 2u) << replay::to_text(rep);
  EXPECT_EQ(rep.problems[0].rank, 3) << replay::to_text(rep);
  EXPECT_EQ(rep.problems[0].category, replay::category::size_mismatch);
  const auto* state = find(rep, replay::category::state_mismatch);
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->rank, 0);
}

TEST(trace_import, the_chrome_scanner_keeps_the_named_events_and_names_broken_files) {
  const auto keep = [](std::string_view n) { return n == "nccl:all_reduce"; };
  // "name" after "args" (whose own "name" must not count), strings holding brackets, quotes
  // and escapes, distributedInfo after the events, other top-level keys skipped.
  const std::string text = R"({"schemaVersion": 1, "traceEvents": [
    {"args": {"name": "nccl:all_reduce", "x": "]}"}, "ph": "X", "name": "aten::mm"},
    {"ph": "X", "name": "nccl:all_reduce", "args": {"Input Dims": [[4]], "s": "a\"]{\\"}},
    {"name": "process_name", "ph": "M", "args": {"name": "python"}},
    7, [1, {"a": []}], "str"
  ], "distributedInfo": {"rank": 3, "world_size": 8}, "deviceProperties": [{"name": "V100"}]})";
  const auto out = import::scan_chrome_trace(text, keep, "t.json");
  EXPECT_EQ(out.total_events, 6);
  ASSERT_EQ(out.events.size(), 1u);
  EXPECT_EQ(out.events[0]["args"]["Input Dims"][0][0], 4);
  EXPECT_EQ(out.events[0]["args"]["s"], "a\"]{\\");
  ASSERT_TRUE(out.distributed_info.has_value());
  EXPECT_EQ((*out.distributed_info)["rank"], 3);
  // A bare event array.
  EXPECT_EQ(
      import::scan_chrome_trace(R"([{"name": "nccl:all_reduce"}])", keep, "a.json").events.size(),
      1u);
  auto error = [&](const std::string& t) {
    try {
      import::scan_chrome_trace(t, keep, "b.json");
    } catch (const trace_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // A profile cut short (a killed job), text after the end, no events, a broken kept event.
  EXPECT_TRUE(contains(error(text.substr(0, 150)), "is it cut short?"))
      << error(text.substr(0, 150));
  EXPECT_TRUE(contains(error(text + "x"), "text after the end of the trace"));
  EXPECT_TRUE(contains(error(R"({"schemaVersion": 1})"), "no 'traceEvents' list"));
  EXPECT_TRUE(contains(error(R"({"traceEvents": [{"name": "nccl:all_reduce", "ts": 1e99999}]})"),
                       "event 1 does not parse"));
  EXPECT_TRUE(contains(error(R"({"traceEvents": [{"name" "x"}]})"), "':' expected"));
}

// The importers' dtype tables against what a real torch calls each dtype
// (traces/torch-dtype-names/names.json, written by tools/torch_dtype_names.py from torch 2.11:
// the profiler's "Input type", c10's ScalarType name and number), row by row.
TEST(import_dtype_tables, every_torch_dtype_by_every_name_torch_writes) {
  std::ifstream in(root + "/traces/torch-dtype-names/names.json");
  ASSERT_TRUE(in) << "traces/torch-dtype-names/names.json";
  const auto names = nlohmann::json::parse(in);
  ASSERT_GE(names["dtypes"].size(), 12u);
  for (const auto& row : names["dtypes"]) {
    const auto want = row["dtype"].get<std::string>();
    EXPECT_EQ(import::dtype_from_cpp(row["cpp"].get<std::string>()), want) << row.dump();
    EXPECT_EQ(import::dtype_from_c10(row["c10"].get<std::string>()), want) << row.dump();
    const auto number = import::dtype_from_scalar_type(row["number"].get<int>());
    // Flight Recorder 2.1 wrote numbers for the types SP moves; float8 (23, 24) came later.
    if (!want.starts_with("float8")) {
      EXPECT_EQ(number.value_or("(none)"), want) << row.dump();
    } else {
      EXPECT_FALSE(number.has_value()) << row.dump();
    }
  }
}

// The spellings torch does not write on this platform but does elsewhere: the C++ type names
// of other compilers and ABIs (`long long` is int64 where `long` is 32 bits, `short` without
// `int`), and the lower-case `float` of older Flight Recorder dumps.
TEST(import_dtype_tables, the_other_platforms_spellings) {
  for (const auto& [name, want] :
       std::vector<std::pair<std::string, std::string>>{{"short", "int16"},
                                                        {"long", "int64"},
                                                        {"long long", "int64"},
                                                        {"long long int", "int64"}})
    EXPECT_EQ(import::dtype_from_cpp(name), want) << name;
  EXPECT_EQ(import::dtype_from_c10("float"), "float32");
  EXPECT_EQ(import::dtype_from_cpp("c10::complex<float>"), "");  // not a dtype SP moves
}
