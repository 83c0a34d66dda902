#!/usr/bin/env bash
# The GPU check in one command (see docs/gpu.md): on a lent GPU machine, after
# `bash .gpu-b/setup.sh`, run `bash benchmarks/gpu_check.sh --device gpu`; rehearsed here with
# `bash benchmarks/gpu_check.sh --device cpu --quick`. Options go to benchmarks/gpu_check.py.
# Results land in $OUT (default /tmp/mlxkv-gpu-check/out). A hard stop 60 s after the check's own
# budget (--total-s, 360 s by default) ends it, whatever hangs.
set -u
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/mlxkv-gpu-check/out}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
total_s=360
previous=""
for arg in "$@"; do
  [ "$previous" = "--total-s" ] && total_s=${arg%.*}
  previous=$arg
done
timeout -k 10 $((total_s + 60)) "$python" -m benchmarks.gpu_check "$@"
status=$?
ls -la "$OUT" 2>/dev/null
exit $status
