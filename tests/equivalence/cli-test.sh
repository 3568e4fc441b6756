#!/usr/bin/env bash
# CLI contracts: exit codes (0 ok, 1 difference, 2 invalid input), one clear message naming the
# constraint, and no partial output file. Usage: cli-test.sh path/to/seqpar
set -u
seqpar=$1
. "$(dirname "$0")/../support/harness.sh"

# Invalid scenarios: every rule names the values and a fix.
expect 2 "num_heads=30 is not divisible by ulysses=8; use ulysses in {1,2,3,5,6,10,15,30}" -- plan --heads 30 --kv-heads 30 --ulysses 8
expect 2 "ulysses=6 > num_kv_heads=4 needs ulysses % num_kv_heads == 0" -- plan --heads 12 --kv-heads 4 --ulysses 6
expect 2 "num_kv_heads=6 is not divisible by ulysses=4" -- plan --heads 12 --kv-heads 6 --ulysses 4
expect 2 "not a multiple of num_kv_heads=3" -- plan --heads 8 --kv-heads 3 --ulysses 1
expect 2 "has length 7, not divisible by 2*ring=4" -- plan --ulysses 1 --ring 2 --docs 8,7
# GatedDeltaNet layers (SEMANTICS.md §7).
expect 2 "layer_pattern 'LXS' is not a string of S (softmax attention) and L (GatedDeltaNet)" -- plan --ring 1 --layer-pattern LXS
expect 2 "ulysses=4 must divide linear_k_heads=2 and linear_v_heads=4" -- plan --ring 1 --ulysses 4 --heads 8 --kv-heads 4 --layer-pattern LS --linear-heads 2,4
expect 2 "use ulysses in {1,2}" -- check --ring 1 --ulysses 4 --heads 8 --kv-heads 4 --layer-pattern L --linear-heads 2,6
expect 2 "linear_v_heads=6 is not a multiple of linear_k_heads=4" -- plan --ring 1 --ulysses 2 --layer-pattern L --linear-heads 4,6
expect 2 "ring=2 with GatedDeltaNet layers (layer_pattern 'LS'): linear attention has no ring algorithm" -- check --ulysses 2 --ring 2 --layer-pattern LS
expect 2 "conv_kernel=0 is out of range" -- plan --ring 1 --layer-pattern L --conv-kernel 0
expect 2 "linear_k_dim=0 is out of range" -- plan --ring 1 --layer-pattern L --linear-head-dims 0,4
expect 2 "--linear-heads" -- plan --ring 1 --layer-pattern L --linear-heads 2
# The worked example of SEMANTICS.md §7: Hk 2, Hv 4, dk = dv = 4, U 2 → rank 1 convolves rows
# [4,8) [12,16) [24,32) and reads A_log[2:4].
expect 0 "   1  1-1          2-3          [4,8) [12,16) [24,32)                    [2, 4)" -- plan --ring 1 --ulysses 2 --heads 4 --kv-heads 2 --layer-pattern L --linear-heads 2,4 --linear-head-dims 4,4
expect 0 "PASS" -- check --scenario qwen3.5
expect 0 "PASS" -- check --scenario qwen3.5 --dtype f32
# Async Ulysses (issue 14): every built-in passes with the async path; bad values are named.
for name in default ulysses ring qwen3-8b llama3-8b qwen2.5-7b mha-8 alst qwen3.5; do
  expect 0 "PASS" -- check --scenario "$name" --ulysses-strategy async
done
expect 0 "async: xorl's get_cp_strategy picks UlyssesAsyncStrategy when ulysses_size 4 <= num_kv_heads 4" -- plan --scenario qwen3-8b
expect 0 "sync: VeOmni's accelerator.enable_async defaults to false" -- plan --profile veomni --ring 1 --ulysses 2 --heads 4 --kv-heads 2
expect 0 "start q.fwd" -- plan --ring 1 --ulysses 2 --heads 4 --kv-heads 2 --ulysses-strategy async
expect 2 "ulysses_strategy 'overlap' is unknown; use auto, sync or async" -- plan --ulysses-strategy overlap
expect 2 "qk_norm_type 'batchnorm' is unknown; use rmsnorm or layernorm" -- check --qk-norm-type batchnorm
expect 0 "PASS" -- check --ring 1 --ulysses 4 --heads 8 --kv-heads 2 --qkv-bias --o-bias --qk-norm-type layernorm --ulysses-strategy async --dtype f32
# Today's attention options (docs/attention.md): each invalid combination named with its fix.
expect 2 "attention_pattern 'W' has sliding-window layers (W) but window=0; give --window W" -- check --attention-pattern W
expect 2 "attention_pattern 'WX' is not a string of F (full), W (sliding window) and C (chunked)" -- check --window 4 --attention-pattern WX
expect 2 "window_right=2 needs bidirectional attention" -- check --window 4 --window-right 2
expect 2 "window=4 and chunk=8 without an attention_pattern" -- check --window 4 --chunk 8
expect 2 "chunk=8 but attention_pattern 'W' has no C layer" -- plan --window 4 --chunk 8 --attention-pattern W
expect 2 "--mask 'sideways' is unknown; use causal or bidirectional" -- check --mask sideways
expect 2 "softcap=-1 must be finite and >= 0" -- check --softcap -1
expect 2 "scenario key 'mask' = \"diagonal\" is unknown" -- check --config "$(dirname "$0")/data/bad_mask.json"
for name in gpt-oss gemma3 gemma2 llama4 dit; do
  expect 0 "PASS" -- check --scenario "$name"
  expect 0 "PASS" -- check --scenario "$name" --dtype f32
done
expect 2 "pad it to 8" -- plan --ulysses 1 --ring 2 --docs 8,7
expect 2 "profile veomni does not support ring attention" -- plan --profile veomni --ulysses 2 --ring 2 --docs 8
expect 2 "ulysses=0 is out of range" -- plan --ulysses 0
expect 2 "'x' is not an integer" -- plan --docs 8,x
expect 2 "document 1 has length 0" -- plan --ulysses 1 --docs 8,0
expect 2 "scenario 'nope' is unknown; use one of default" -- plan --scenario nope
expect 2 "profile 'megatron' is unknown" -- plan --profile megatron
expect 2 "cp_fsdp_mode 'half' is unknown" -- plan --cp-fsdp-mode half
expect 2 "cannot read '$tmp/missing.json'" -- plan --config "$tmp/missing.json"
echo '{"ulysses": 2,' > "$tmp/bad.json"
expect 2 "is not valid JSON" -- plan --config "$tmp/bad.json"
echo '{"ulyses": 2}' > "$tmp/typo.json"
expect 2 "scenario key 'ulyses' is unknown" -- plan --config "$tmp/typo.json"
echo '{"ulysses": "two"}' > "$tmp/type.json"
expect 2 "scenario key 'ulysses' = \"two\" must be an integer in [-2147483648, 2147483647]" -- plan --config "$tmp/type.json"
# Numbers that do not fit an int (the fuzzer's 1e70 was undefined behaviour; 2^40 wrapped).
echo '{"ulysses": 1e70}' > "$tmp/huge.json"
expect 2 "scenario key 'ulysses' = 1e+70 must be an integer in [-2147483648, 2147483647]" -- plan --config "$tmp/huge.json"
expect 2 "the trace holds no collective" -- replay "$(dirname "$0")/data/fuzz/trace_scenario_float_1e70.jsonl"
echo '{"heads": 1099511627776}' > "$tmp/wide.json"
expect 2 "scenario key 'heads' = 1099511627776 must be an integer in" -- plan --config "$tmp/wide.json"
expect 2 "seqpar: error: The following argument was not expected: --no-such-flag; run 'seqpar plan --help'" -- plan --no-such-flag
expect 2 "seqpar: error: A subcommand is required" -- frobnicate
expect 2 "seqpar: error: Could not convert: --ulysses = x; run 'seqpar check --help'" -- check --ulysses x

# Invalid batches.
expect 2 "cannot read" -- collate --batch "$tmp/none.json"
echo '{"input_ids":[1,2,3],"labels":[2,3],"position_ids":[0,1,2]}' > "$tmp/short.json"
expect 2 "'labels' has 2 entries but input_ids has 3" -- collate --batch "$tmp/short.json"
echo '{"input_ids":[1,2,3],"labels":[1,2,3],"position_ids":[0,1,2]}' > "$tmp/unshifted.json"
expect 2 "labels are not shifted" -- collate --batch "$tmp/unshifted.json"
echo '{"input_ids":[1,2,3],"labels":[2,3,-100],"position_ids":[0,1,2.5]}' > "$tmp/float.json"
expect 2 "position_ids[2] = 2.5 is not an integer" -- collate --batch "$tmp/float.json"
echo '{"input_ids":[1,2,3],"labels":[2,3,-100]}' > "$tmp/nopos.json"
expect 2 "the batch has no 'position_ids'" -- collate --batch "$tmp/nopos.json"
echo '{"input_ids":[1,2,3,4,5,6,7,8],"labels":[2,3,4,-100,6,7,8,-100],"position_ids":[3,4,5,6,0,1,2,3]}' > "$tmp/cont.json"
expect 2 "silently drops the 4 token(s)" -- collate --ring 2 --batch "$tmp/cont.json"
expect 2 "" -- collate --ulysses 2

# DeepSpeed ALST (--profile deepspeed): the adapter's rules, each with the fix.
expect 2 "pad_to_multiple_of=4 (here to 56 tokens)" -- check --profile deepspeed --docs 24,16,13
expect 2 "profile deepspeed does not support ring attention (ring=2" -- plan --profile deepspeed --ring 2
expect 2 "micro_step=4 is out of range" -- check --profile deepspeed --micro-step 4
expect 2 "micro_step=1 is out of range" -- plan --micro-step 1
expect 2 "tiles=0 is out of range" -- check --tiles 0
echo '{"input_ids":[1,2,3],"labels":[1,2,3]}' > "$tmp/ds_nopos.json"
expect 2 "sample of SP rank 0 has no position_ids" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_nopos.json"
echo '{"input_ids":[1,2,3,4],"labels":[1,2,3,4],"position_ids":[0,1,2,3],"attention_mask":[1,1,1]}' > "$tmp/ds_mask.json"
expect 2 "'attention_mask' has 3 entries but input_ids has 4" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_mask.json"
echo '{"rows":[{"input_ids":[1,2,3,4],"labels":[1,2,3,4],"position_ids":[0,1,2,3]},{"input_ids":[1,2,3],"labels":[1,2,3],"position_ids":[0,1,2]}]}' > "$tmp/ds_odd.json"
expect 2 "the sample of SP rank 1 (micro-step 1) has 3 tokens, not divisible by ulysses=2" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_odd.json"
expect 2 "2 samples for ulysses=3" -- collate --profile deepspeed --ulysses 3 --batch "$tmp/ds_odd.json"
echo '{"input_ids":[1,2,3,4],"position_ids":[0,1,2,3]}' > "$tmp/ds_nolabels.json"
expect 2 "has no labels tensor" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_nolabels.json"
echo '{"input_ids":[1,2,3,4],"labels":[1,2,3,4],"position_ids":[0,1,2,3],"mask":[[[1,1,1,1]]]}' > "$tmp/ds_3d.json"
expect 2 "'mask' is a 3-D tensor" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_3d.json"
echo '{"input_ids":[5,6,7,8],"labels":[5,6,-100,8],"position_ids":[0,1,0,1],"src":"a"}' > "$tmp/ds_ok.json"
expect 0 '{"cp_rank":1,"input_ids":[7,8],"position_ids":[0,1],"src":"a","shift_labels":[8,-100]}' -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_ok.json" --json
expect 0 "micro-step 1 (sample of SP rank 1)" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/ds_ok.json"
expect 0 "sp_over_dp.grad.lm_head" -- check -q --profile deepspeed
expect 0 "equivalence PASS" -- record --profile deepspeed --micro-step 2 --out "$tmp/rec-ds.jsonl"
expect 0 "consistent" -- replay "$tmp/rec-ds.jsonl"

# More of the catalogue: every subcommand, each rule with its values and its fix.
expect 2 "mesh size dp_shard=0 is invalid: every dimension needs at least 1 rank; use --dp-shard 1" -- mesh --dp-shard 0
expect 2 "mesh size tp=0 is invalid" -- mesh --ulysses 2 --tp 0
expect 2 "cp_fsdp_mode ulysses_only is not available with profile veomni" -- mesh --profile veomni --cp-fsdp-mode ulysses_only --ulysses 2
expect 2 "profile 'foo' is not valid; use one of xorl, veomni" -- mesh --profile foo
expect 2 "cannot read trace '$tmp/none.jsonl'" -- replay "$tmp/none.jsonl"
printf '%s\n%s\n' '{"type":"meta","schema":"seqpar-trace/1","world_size":2}' '{"type":"collective","rank":0' >"$tmp/cut.jsonl"
expect 2 "cut.jsonl:2: not valid JSON" -- replay "$tmp/cut.jsonl"
expect 2 "cannot write '$tmp/no/dir/r.html'" -- replay "$(dirname "$0")/../../traces/healthy_xorl_u4_gqa.jsonl" --html "$tmp/no/dir/r.html"
[ ! -e "$tmp/no/dir/r.html" ] || fail "partial html left"
expect 2 "head_dim=0 is out of range; use a value in [1, 1024]" -- plan --head-dim 0
expect 2 "hidden=0 is out of range" -- plan --hidden 0
expect 2 "layers=0 is out of range; use a value in [1, 64]" -- plan --layers 0
expect 2 "vocab=1 is out of range; use a value in [2," -- plan --vocab 1
expect 2 "ring_backward 'foo' is unknown; use allgather or ring" -- plan --ring-backward foo --ring 2 --docs 8
expect 2 "ring_forward 'foo' is unknown; use p2p or allgather" -- plan --ring-forward foo --ring 2 --docs 8
echo '{"vocab":96,"pad_token_id":96}' >"$tmp/pad.json"
expect 2 "pad_token_id=96 is not a token of the vocabulary (vocab=96)" -- check --config "$tmp/pad.json"
echo '{"ulysses":2,"ring":1,"cp_size":4}' >"$tmp/cp.json"
expect 2 "scenario cp_size=4 disagrees with ulysses*ring=2*1=2" -- plan --config "$tmp/cp.json"
expect 2 "83886080 tokens in total is more than the supported 67108864" -- plan --docs 16777216,16777216,16777216,16777216,16777216
expect 2 "the CPU backends run the SP step in float64 or float32, not bfloat16; use --dtype f64|f32, or --backend gpu for bf16" -- check --dtype bf16
expect 2 "seqpar: error: --threads: Value -1 not in range 0 to 4096" -- check --threads -1
expect 2 "seqpar: error: --seed" -- plan --seed -1
echo '[1,2]' >"$tmp/arr.json"
expect 2 "a batch must be a JSON object with input_ids, labels, position_ids" -- collate --batch "$tmp/arr.json"
echo '{"input_ids":[1,2],"labels":[2,-100],"position_ids":[0,1],"attention_mask":[1]}' >"$tmp/mask1.json"
expect 2 "'attention_mask' has 1 entries but input_ids has 2" -- collate --batch "$tmp/mask1.json"
echo '{"input_ids":[1,2],"labels":[2,-100],"position_ids":[0,-1]}' >"$tmp/neg.json"
expect 2 "position_ids[1] = -1 is negative" -- collate --batch "$tmp/neg.json"
echo '{"input_ids":[1,2],"labels":[2,-100],"position_ids":[1,2]}' >"$tmp/nozero.json"
expect 2 "position_ids contain no 0, so the row has no document start" -- collate --batch "$tmp/nozero.json"
echo '{"rows":{"a":1}}' >"$tmp/rows.json"
expect 2 "'rows' must be an array of samples and the only key" -- collate --profile deepspeed --ulysses 2 --batch "$tmp/rows.json"
expect 2 "profile veomni does not support ring attention (ring=2" -- collate --profile veomni --ulysses 2 --ring 2 --batch "$tmp/ds_ok.json"
expect 2 "input '$tmp/nothing' does not exist" -- import --from fr "$tmp/nothing" --out "$tmp/imp.jsonl"
expect 2 "seqpar: error: --out is required; run 'seqpar record --help'" -- record --ulysses 2

# No partial output file: a failing run leaves nothing behind.
expect 2 "labels are not shifted" -- collate --batch "$tmp/unshifted.json" --out "$tmp/out.json"
[ ! -e "$tmp/out.json" ] || { fail "partial output left at $tmp/out.json"; }
echo '{"input_ids":[1,2,3,4,5],"labels":[2,3,4,5,-100],"position_ids":[0,1,2,3,4]}' > "$tmp/ok.json"
expect 2 "cannot write" -- collate --batch "$tmp/ok.json" --out "$tmp/no/such/dir/out.json"
expect 0 "" -- collate --ulysses 2 --batch "$tmp/ok.json" --json --out "$tmp/good.json"
grep -q '"padded_length":6' "$tmp/good.json" || { fail "collate --out wrote no result"; }
ls "$tmp" | grep -q seqpar-tmp && { fail "temp file left behind"; }

# Working commands and their contracts.
expect 0 '"cu_seqlens":[0,5,6]' -- collate --ulysses 2 --batch "$tmp/ok.json" --json
expect 0 "tail_padding_length" -- collate --profile veomni --ulysses 2 --batch "$tmp/ok.json" --json
expect 0 '"q_heads":[0,1]' -- plan --scenario ulysses --json
expect 0 '"ring_schedule":[{"kv_src":0,"section":"diagonal","step":0},{"kv_src":3,"section":"upper","step":1}' -- plan --ulysses 1 --ring 4 --heads 4 --kv-heads 4 --docs 16 --json
expect 0 "max/min" -- plan --ulysses 2 --ring 2 --docs 16,8
expect 0 "fsdp_size" -- mesh --ring 2 --ulysses 4 --dp-shard 2 --cp-fsdp-mode ulysses_only
# The main job and its contract.
expect 0 "PASS: 17 of 17" -- check -q
for sc in default ulysses ring qwen3-8b llama3-8b qwen2.5-7b mha-8; do
  expect 0 "PASS" -- check -q --scenario "$sc"
done
expect 0 '"pass":true' -- check -q --scenario ring --json --dtype f32
expect 0 '"rows":[{"max_abs"' -- check -q --json
expect 2 "--dtype 'f16' is unknown" -- check --dtype f16
# --backend gpu in a build without CUDA, or with it but no device: exit 2 naming why and the
# way out (a machine with a GPU runs the step instead: tests/gpu).
if ! "$seqpar" --version | grep -q '^cuda: CUDA'; then
  expect 2 "--backend gpu is not available: this seqpar was built without the GPU backend" -- \
    check --backend gpu
elif ! "$seqpar" check --backend gpu -q >/dev/null 2>&1; then
  expect 2 "--backend gpu found no CUDA device" -- check --backend gpu
  expect 2 "--backend gpu runs the SP step in f32 or bf16" -- check --backend gpu --dtype f64
fi
expect 2 "--backend tpu is unknown; use sim, mpi or gpu" -- check --backend tpu
expect 2 "num_heads=8 is not divisible by ulysses=3" -- check --ulysses 3
expect 2 "--timeout: Value 0 not in range" -- check --timeout 0
expect 2 "--timeout: Value -3 not in range" -- check --timeout -3
expect 2 "--timeout: Value 0 not in range" -- validate --timeout 0
# Fuzzer finding: a number beyond double range is a JSON error with exit 2, not an internal error.
printf '{"type":"meta","schema":"seqpar-trace/1","world_size":1e99999}\n' > "$tmp/huge.jsonl"
expect 2 "not valid JSON: number overflow parsing '1e99999'" -- replay "$tmp/huge.jsonl"
echo '{"input_ids": [1e99999]}' > "$tmp/huge-batch.json"
expect 2 "is not valid JSON: [json.exception.out_of_range.406] number overflow" -- collate --batch "$tmp/huge-batch.json"
expect 2 "not a Flight Recorder JSON dump" -- import --from fr "$(dirname "$0")/data/fuzz/fr_number_out_of_range.json" --out "$tmp/fr-huge.jsonl"
# Replay of a failed run's flight records (a directory of per-rank files).
mkdir -p "$tmp/emptydir"
expect 2 "the directory holds no *.jsonl trace" -- replay "$tmp/emptydir"
mkdir -p "$tmp/twoworlds"
"$seqpar" record --ulysses 2 --docs 8 --heads 4 --kv-heads 2 --out "$tmp/twoworlds/a.jsonl" > /dev/null 2>&1
"$seqpar" record --ulysses 4 --docs 8 --heads 4 --kv-heads 4 --out "$tmp/twoworlds/b.jsonl" > /dev/null 2>&1
expect 2 "b.jsonl is a trace of a world of 8 ranks but $tmp/twoworlds/a.jsonl of 4: replay the files of one run together" -- replay "$tmp/twoworlds"
expect 2 "cannot read trace '$tmp/twoworlds/none.jsonl'" -- replay "$tmp/twoworlds/a.jsonl" "$tmp/twoworlds/none.jsonl"
# Recorded traces of every built-in scenario replay clean.
for sc in default ulysses ring qwen3-8b llama3-8b qwen2.5-7b mha-8; do
  expect 0 "equivalence PASS" -- record --scenario "$sc" --out "$tmp/rec-$sc.jsonl"
  expect 0 "consistent" -- replay "$tmp/rec-$sc.jsonl"
done
expect 0 "consistent" -- replay "$tmp/rec-default.jsonl" --json
expect 2 "cannot write" -- record --out "$tmp/no/such/dir/t.jsonl"
for sub in check collate plan mesh record; do
  expect 0 "Example" -- "$sub" --help
done

# SIGTERM during a check leaves every rank's flight record (exit 128 + 15), and replay reads
# them and says why the run ended.
"$seqpar" check --ulysses 2 --ring 2 --layers 2 --docs 3000,3000 --heads 4 --kv-heads 2 \
  --flight-record "$tmp/sigfr" > "$tmp/sig.out" 2>&1 &
job=$!
# Up to 120 s for the ranks to start (a loaded machine starts them late: a 20 s wait once sent
# the signal before any rank existed, and no record was left).
for _ in $(seq 1 2400); do grep -q "SP step" "$tmp/sig.out" && break; sleep 0.05; done
sleep 0.2
kill -TERM "$job"
wait "$job"
rc=$?
if [ "$rc" -ne 143 ] || ! grep -q "stopped by signal 15" "$tmp/sig.out" ||
   [ "$(ls "$tmp/sigfr" 2> /dev/null | wc -l)" -ne 4 ]; then
  fail "SIGTERM: exit $rc (want 143), records: $(ls "$tmp/sigfr" 2>&1 | tr '\n' ' '): $(tail -2 "$tmp/sig.out")"
else
  ok
  out=$("$seqpar" replay "$tmp/sigfr" 2>&1)
  rc=$?
  if [ "$rc" -ge 2 ] || [[ "$out" != *"the run ended: stopped by signal 15"* ]]; then
    fail "SIGTERM: replay of the records exit $rc: $(head -3 <<< "$out")"
  else ok; fi
fi

# Every thread count gives the same report, bit for bit (issue 38): the oracle's tiles, the SP
# ranks on 1, 2 or 3 carriers, the comparison. 1,040 tokens: every operation in several tiles.
for dtype in f64 f32; do
  for t in 1 2 3; do
    "$seqpar" check --quiet --json --dtype "$dtype" --ulysses 2 --ring 2 --docs 700,300,40 \
      --heads 4 --kv-heads 2 --threads "$t" 2> /dev/null |
      sed -E 's/"seconds":\{[^}]*\}//' > "$tmp/threads.$dtype.$t.json"
  done
  if ! grep -q '"pass":true' "$tmp/threads.$dtype.1.json"; then
    fail "check --threads 1 --dtype $dtype did not pass: $(head -c 300 "$tmp/threads.$dtype.1.json")"
  elif cmp -s "$tmp/threads.$dtype.1.json" "$tmp/threads.$dtype.2.json" &&
     cmp -s "$tmp/threads.$dtype.1.json" "$tmp/threads.$dtype.3.json"; then
    ok
  else
    fail "check --dtype $dtype: the report differs between --threads 1, 2 and 3"
  fi
done

# A first run reads right (issue 34): a passing check's notes about framework semantics are in
# the report, stderr holds no warning; --version names the build.
"$seqpar" check --quiet > "$tmp/first.out" 2> "$tmp/first.err"
if [ -s "$tmp/first.err" ] || ! grep -q "^note: cu_seqlens end at 52" "$tmp/first.out"; then
  fail "first run: stderr '$(head -c 200 "$tmp/first.err")', note in report: $(grep -c '^note:' "$tmp/first.out")"
else ok; fi
expect 0 "git:" -- --version
expect 0 "cpu:  " -- --version

# Faults on purpose, from the outside (issue 33, item 6): check --fault corrupts one transport
# call; the check names what it changed, a wrong count ends the run with flight records that
# replay reads; an invalid spec is named.
expect 1 "--fault 'drop_chunk:rank=1,op=all_to_all,tag=q.fwd'" -- check --fault drop_chunk:rank=1,op=all_to_all,tag=q.fwd
expect 1 "FAIL: " -- check --fault swap_peers:rank=0,op=all_to_all,peer=0,other=1
# A float32 failure's reproduce line runs float32 (in float64 the same scenario would pass).
expect 1 "--seed 1 --dtype f32 --fault 'drop_chunk:rank=1,op=all_to_all,tag=q.fwd'" -- check \
  --dtype f32 --fault drop_chunk:rank=1,op=all_to_all,tag=q.fwd
expect 2 "send_counts[0] on rank 1 must equal recv_counts[1] on rank 0" -- check --fault wrong_count:rank=1,op=all_to_all --flight-record "$tmp/faultfr"
expect 1 "[RANK_FAILED] rank 1" -- replay "$tmp/faultfr"
expect 2 "the kind 'bogus' is unknown; use drop_chunk" -- check --fault bogus
expect 2 "rank=x is not an integer" -- check --fault drop_chunk:rank=x
expect 2 "the key 'colour' is unknown" -- record --out "$tmp/fault.jsonl" --fault drop_chunk:colour=red
[ -e "$tmp/fault.jsonl" ] && fail "record --fault with a bad spec left a trace"

# seqpar launch: the records are how it names a lost host, so --flight-record is required; a job
# that ended by itself keeps its own exit code and verdict (nothing waited for or added); the
# launched ranks see SEQPAR_DETACH_FROM_LAUNCHER=1.
expect 2 "add --flight-record DIR to the seqpar command" -- launch -- mpiexec -n 2 seqpar check --backend mpi
expect 2 "cannot run 'no-such-launcher-here'" -- launch -- no-such-launcher-here --flight-record "$tmp/lr"
"$seqpar" launch -- sh -c 'exit 3' --flight-record "$tmp/lr" > "$tmp/l.out" 2> "$tmp/l.err"
[ $? -eq 3 ] && [ ! -s "$tmp/l.err" ] && ok || fail "launch of a job exiting 3: exit $?, stderr $(head -c 200 "$tmp/l.err")"
"$seqpar" launch -- sh -c 'echo "detach=$SEQPAR_DETACH_FROM_LAUNCHER"' --flight-record "$tmp/lr" > "$tmp/l.out" 2>&1
grep -q "detach=1" "$tmp/l.out" && ok || fail "launch did not set SEQPAR_DETACH_FROM_LAUNCHER=1: $(head -c 200 "$tmp/l.out")"

finish
