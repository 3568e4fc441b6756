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
