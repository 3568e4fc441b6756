#!/usr/bin/env bash
# seqpar check / plan --hf-config on the committed configs of Qwen3-8B, gpt-oss-20b, Gemma 3 and
# Llama 4 Scout (tests/python/data/hf_configs, written from their published config.json): the
# check of the drawn-down model passes under several layouts, the plan lists the U x R each
# model admits at its real size (and refuses the others with the reason), the kinds of layers,
# window, chunk and sinks reach the scenario; configs seqpar cannot model exit 2 naming the
# field.
#   hf_config-test.sh SEQPAR SOURCE_DIR
set -u
seqpar=$1
cfg=$2/tests/python/data/hf_configs
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok   $*"; }

for c in qwen3-8b gpt-oss-20b gemma3-4b llama4-scout; do
  for layout in "--ulysses 2 --ring 2" "--ulysses 4 --ring 1" "--ulysses 1 --ring 2 --no-zigzag"; do
    # shellcheck disable=SC2086
    out=$("$seqpar" check --hf-config "$cfg/$c.json" $layout --json 2>"$tmp/err")
    rc=$?
    if [ $rc -ne 0 ] || ! python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); sys.exit(0 if r["pass"] else 1)' <<< "$out"; then
      fail "check --hf-config $c $layout: exit $rc: $(tail -c 400 <<< "$out")"
    else ok "check --hf-config $c $layout"; fi
  done
done

# The scenario each config becomes (drawn down): kinds, window, chunk, sinks, heads.
scn() { "$seqpar" check --hf-config "$cfg/$1.json" --json 2>/dev/null | python3 -c "import json,sys; s=json.load(sys.stdin)['scenario']; print(s.get('$2'))"; }
[ "$(scn gpt-oss-20b attention_pattern)" = "WF" ] && [ "$(scn gpt-oss-20b sinks)" = "True" ] &&
  [ "$(scn gpt-oss-20b window)" = "8" ] && [ "$(scn gpt-oss-20b heads)" = "64" ] &&
  [ "$(scn gpt-oss-20b kv_heads)" = "8" ] && ok "gpt-oss: WF layers, window 8, sinks, 64/8 heads" ||
  fail "gpt-oss's scenario: pattern $(scn gpt-oss-20b attention_pattern) sinks $(scn gpt-oss-20b sinks) window $(scn gpt-oss-20b window)"
[ "$(scn llama4-scout attention_pattern)" = "CF" ] && [ "$(scn llama4-scout chunk)" = "8" ] &&
  ok "llama4: CF layers, chunk 8" || fail "llama4's scenario: $(scn llama4-scout attention_pattern) chunk $(scn llama4-scout chunk)"
[ "$(scn gemma3-4b attention_pattern)" = "WF" ] && [ "$(scn gemma3-4b qk_norm)" = "True" ] &&
  ok "gemma3: WF layers, q/k norm" || fail "gemma3's scenario: $(scn gemma3-4b attention_pattern)"
[ "$(scn qwen3-8b attention_pattern)" = "" ] || [ "$(scn qwen3-8b attention_pattern)" = "None" ] &&
  [ "$(scn qwen3-8b qk_norm)" = "True" ] && ok "qwen3: full layers, q/k norm" ||
  fail "qwen3's scenario: $(scn qwen3-8b attention_pattern) $(scn qwen3-8b qk_norm)"

# plan at the real size: what each admits.
out=$("$seqpar" plan --hf-config "$cfg/gemma3-4b.json" --max-cp 16 2>&1)
grep -q "refused: num_heads=8 is not divisible by ulysses=16" <<< "$out" &&
  grep -qE "^ +8 +1 +8 +4096 +x2 " <<< "$out" && ok "plan gemma3: U 16 refused, U 8 repeats KV x2" ||
  fail "plan --hf-config gemma3: $(head -c 1500 <<< "$out")"
out=$("$seqpar" plan --hf-config "$cfg/qwen3-8b.json" --max-cp 8 --docs 8192 --json 2>&1)
python3 - "$out" <<'PY' && ok "plan --json qwen3: 10 options, U 8 x R 1 at 1024 tokens per rank" || fail "plan --json: $out"
import json, sys
j = json.loads(sys.argv[1])
o = {(x["ulysses"], x["ring"]): x for x in j["options"]}
assert len(o) == 10, len(o)
assert o[(8, 1)]["tokens_per_rank"] == 1024 and o[(8, 1)]["kv_repeat"] == 1
assert o[(1, 8)]["all_to_all_mib_per_layer"] == 0 and o[(1, 8)]["ring_mib_per_layer"] > 0
assert j["layers"] == 36 and j["model"]["heads"] == 32
PY

# Bad configs: exit 2, one line naming the field, nothing written.
bad() {  # text, words
  printf '%s' "$1" > "$tmp/config.json"
  out=$("$seqpar" check --hf-config "$tmp/config.json" 2>&1)
  rc=$?
  if [ $rc -ne 2 ] || [[ "$out" != *"$2"* ]]; then fail "bad config $1: exit $rc: $out"
  else ok "refused: $2"; fi
}
bad '{"num_attention_heads": 8}' "no 'model_type'"
bad '{"model_type": "llama", "hidden_size": 64, "vocab_size": 10}' "no 'num_attention_heads'"
bad '{"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 48, "num_hidden_layers": 2, "vocab_size": 32}' "not a multiple of num_key_value_heads=4"
bad '{"model_type": "x", "num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 32, "layer_types": ["full_attention", "mamba"]}' "layer_types[1] is 'mamba'"
bad '{"model_type": "x", "num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 1, "vocab_size": 32, "layer_types": ["sliding_attention"]}' "sliding_window is null"
bad '{"model_type": "x", "num_attention_heads": "four"}' "'num_attention_heads' is \"four\""
bad '{' "is not valid JSON"
out=$("$seqpar" plan --hf-config "$tmp/nothing-here.json" 2>&1); rc=$?
[ $rc -eq 2 ] && ok "a missing file: exit 2" || fail "missing file: exit $rc $out"

[ $fails -eq 0 ] || { echo "$fails failures"; exit 1; }
echo "all hf_config checks passed"
