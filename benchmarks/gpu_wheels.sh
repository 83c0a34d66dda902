#!/usr/bin/env bash
# Run after `bash ../shared/gpu/prepare.sh` (see docs/gpu.md), from the checkout's root, with
# this checkout's venv active: makes the wheels in .gpu-a/.gpu-b the versions this venv runs
# (the ones CI tests), and adds what they need that the GPU machine's image lacks.
#
# Why: prepare.sh downloads the newest wheel of each name for a few manylinux tags, without
# dependencies. On 2026-11-27 that carried llguidance 1.6.1 (1.9.1 ships only a manylinux_2_31
# wheel; mlxkv needs >= 1.9: every grammar test failed) and openai/anthropic releases that import
# httpx2, which the image lacks (every part that used a client failed to start).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .gpu-b ] || { echo "no .gpu-b: run bash ../shared/gpu/prepare.sh first"; exit 1; }
# the client libraries' own needs that the image lacks or holds too old (anyio < 4.10)
extra="httpx2 httpcore2 truststore anyio h11 idna"
plat=""
for n in 17 24 27 28 31 34 35 39; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
fetched=$(mktemp -d)
trap 'rm -rf "$fetched"' EXIT
version_here() { python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null; }
carried=$(ls .gpu-a/*.whl .gpu-b/*.whl 2>/dev/null | xargs -n1 basename | cut -d- -f1 | grep -v '^mlx_cuda' || true)
for name in $carried $extra; do
  version=$(version_here "$name") || { echo "not in this venv, left as is: $name"; continue; }
  pattern="$(echo "$name" | tr - _)-*.whl"
  if compgen -G ".gpu-[ab]/$(echo "$name" | tr - _)-$version-*.whl" >/dev/null; then continue; fi
  # shellcheck disable=SC2086
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d "$fetched" "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
  rm -f .gpu-a/$pattern .gpu-b/$pattern
  echo "carried: $name $version"
done
mv "$fetched"/*.whl .gpu-b/ 2>/dev/null || true
du -sh .gpu-a .gpu-b
