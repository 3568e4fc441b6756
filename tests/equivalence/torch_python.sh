# Sourced by the live PyTorch tests: sets $py to the first of $PYTHON, python3 on PATH and
# Debian's /usr/bin/python3 (python3-torch) that can import torch, or exits 77 (meson SKIP).
py=""
for cand in ${PYTHON:-} python3 /usr/bin/python3; do
  if "$cand" -c 'import torch' 2>/dev/null; then
    py=$cand
    break
  fi
done
if [ -z "$py" ]; then
  echo "SKIP: no python3 here can import torch (apt-get install python3-torch)"
  exit 77
fi
