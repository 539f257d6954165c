#!/usr/bin/env bash
# Issue 10's measurement on the lent GPU: first call (caches empty) and steady-state step time,
# eager vs inductor vs aotforge, bf16 autocast, full sizes, one fresh process per backend.
# Rows are appended to $OUT/first_call.log as they finish, so a run cut short keeps what it had.
#   bash benchmarks/gpu_first_call.sh [child timeout s]
# TRAIN and INFER (comma-separated workloads) choose the rows; the defaults are issue 10's five.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-first_call_out}"
mkdir -p "$OUT"
limit="${1:-100}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c "import torch, triton, transformers, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'timm', timm.__version__)"
} 2>&1 | tee "$OUT/env.txt"
run() { python3 benchmarks/first_call.py --warmup 2 --repeat 10 --timeout "$limit" "$@"; }
INFER="${INFER-timm_resnet50}"
TRAIN="${TRAIN-nanogpt124m,hf_gpt2,hf_bert,timm_resnet50}"
[ -n "$INFER" ] && run --workloads "$INFER" --modes infer --json "$OUT/infer.json" 2>&1 | tee -a "$OUT/first_call.log"
[ -n "$TRAIN" ] && run --workloads "$TRAIN" --modes train --json "$OUT/train.json" 2>&1 | tee -a "$OUT/first_call.log"
