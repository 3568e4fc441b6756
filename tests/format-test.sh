#!/usr/bin/env bash
# Every C++/CUDA source is formatted with the committed .clang-format (STYLE.md).
# Exit 77 (meson SKIP) when clang-format is not installed.
set -u
cd "$1" || exit 2
command -v clang-format >/dev/null || { echo "clang-format not found"; exit 77; }
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.cu' '*.h' 2>/dev/null)
[ "${#files[@]}" -gt 0 ] || { echo "no sources listed (not a git checkout?)"; exit 77; }
if ! clang-format --dry-run -Werror "${files[@]}" 2>/tmp/format-test.$$; then
  grep -m 20 "error:" /tmp/format-test.$$
  echo "run: clang-format -i \$(git ls-files '*.cpp' '*.hpp' '*.cu')"
  rm -f /tmp/format-test.$$
  exit 1
fi
rm -f /tmp/format-test.$$
echo "${#files[@]} files formatted"
