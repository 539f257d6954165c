#!/usr/bin/env bash
# One device call: the new CUDA RNG tests, the first-call rows still missing, then the RNG check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-final_out}"; mkdir -p "$OUT"
start=$(date +%s)
timeout 90 python3 -m pytest -q -x tests/gpu/test_gpu_rng.py 2>&1 | tail -25 | tee "$OUT/gpu_rng.log"
TRAIN=timm_resnet50,hf_bert INFER=timm_resnet50 OUT="$OUT" bash benchmarks/gpu_first_call.sh 100
left=$(( 470 - ($(date +%s) - start) ))
echo "rng_check gets ${left}s"
[ "$left" -gt 30 ] && timeout "$left" python3 benchmarks/rng_check.py 2>&1 | tee "$OUT/rng_check.log"
