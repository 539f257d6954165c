#!/usr/bin/env bash
# One device call that checks the GPU path is still right after CPU-side work: the GPU tests,
# then every tiny model family (float32, then bf16 autocast while time is left), eager vs
# aotforge with AOTFORGE_STRICT=1 (a compiler failure is a FAILED row, not a fallback).
#   bash benchmarks/gpu_check.sh [SECONDS]      # default 540: fits one 10-minute device call
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench_out}"; mkdir -p "$OUT"
budget="${1:-540}"; start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
timeout $(( $(left) / 2 )) python3 -m pytest -q tests/gpu 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
export AOTFORGE_STRICT=1
for dtype in fp32 bf16; do
  t=$(( $(left) - 15 )); [ "$t" -gt 60 ] || break
  extra=(); [ "$dtype" = bf16 ] && extra=(--dtype bf16 --autocast)
  timeout "$t" python3 -m aotforge bench --suite families --backends eager,aotforge --repeat 1 --warmup 0 \
      --stabilize 0 --backend-timeout 60 --time-budget $(( t - 20 )) "${extra[@]}" \
      --json "$OUT/families-$dtype.json" 2>&1 | tee "$OUT/families-$dtype.log" | grep -v "^\[" | tail -45
done
