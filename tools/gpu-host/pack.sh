#!/usr/bin/env bash
# Packs what tools/gpu-host/run.sh needs on a GPU host that has no network: the Debian packages
# of seqpar's build dependencies (headers and the two shared libraries the binaries load) and the
# cudnn-frontend headers (from the pinned wheel ./setup.sh fetched into .deps/). Run it here, on a
# Debian machine with apt and PyPI; carry the folder to the host with the checkout.
#   tools/gpu-host/pack.sh [BUNDLE_DIR]     (default: gpu-bundle, git-ignored)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle=${1:-$root/gpu-bundle}
mkdir -p "$bundle/debs"
# Build dependencies the host's image lacks (it has g++, nvcc, cmake, meson and ninja through
# pip, python3 with torch): each -dev package with the runtime library its .so points to.
debs=(libeigen3-dev libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev
      librapidcheck-dev libboost1.74-dev libboost-context1.74-dev libboost-context1.74.0
      zlib1g-dev zlib1g pkgconf pkgconf-bin libpkgconf3)
(cd "$bundle/debs" && rm -f ./*.deb && apt-get download "${debs[@]}" >/dev/null 2>&1) || {
  echo "pack: apt-get download failed (is this a Debian machine with its package lists?)" >&2
  exit 2
}
[ -f "$root/.deps/cudnn-frontend/VERSION" ] || {
  echo "pack: no cudnn-frontend headers in .deps/ (run ./setup.sh first)" >&2
  exit 2
}
tar -C "$root/.deps" -czf "$bundle/cudnn-frontend.tar.gz" cudnn-frontend
du -sh "$bundle" | sed 's/^/pack: /'
