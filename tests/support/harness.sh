# Shared scaffolding of the shell tests, sourced after the test has read its arguments:
#   . "$(dirname "$0")/../support/harness.sh"
# A scratch directory $tmp removed at exit, pass/fail counters, and the closing line.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passes=0
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
ok() { passes=$((passes + 1)); }
# finish: the closing line; its status is the test's (0 only when nothing failed).
finish() {
  echo "$passes passed, $failures failed"
  [ "$failures" -eq 0 ]
}
# expect CODE "words" -- ARGS…: runs "$seqpar" ARGS; passes when it exits CODE and its output
# (stdout + stderr) contains the words; never a crash or an internal error.
expect() {
  local code=$1 words=$2
  shift 3
  local out rc
  out=$("$seqpar" "$@" 2>&1)
  rc=$?
  if [ "$rc" -ne "$code" ] || [[ "$out" != *"$words"* ]]; then
    fail "seqpar $* → exit $rc (want $code), output lacks '$words':"
    echo "$out" | tail -5 | sed 's/^/    /'
  else
    ok
  fi
  if [[ "$out" == *"internal error"* || "$out" == *"terminate"* ]]; then
    fail "seqpar $* crashed instead of a clear message"
  fi
}
