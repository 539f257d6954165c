#!/usr/bin/env bash
# Issue 14's measurement on the lent GPU: nanoGPT-124M training (bf16 autocast, batch 8) at
# T=512, 768, 1024, one torch.compile(dynamic=True) serving every T against a dynamic=False
# compile per T, eager vs inductor vs aotforge; each backend and mode in a fresh process with
# empty caches. Rows are appended to $OUT/dynamic.log as they finish (and $OUT/dynamic.json
# rewritten), so a run cut short keeps what it had; each child's stderr is in $OUT/children/.
#   bash benchmarks/gpu_dynamic.sh [child timeout s] [whole-run budget s]
# The defaults fit one 10-minute device call: children that would start with under 30 s of
# the budget left are skipped. BACKENDS, SEQLENS, BATCH override the plan.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-dynamic_out}"
mkdir -p "$OUT"
limit="${1:-200}"
budget="${2:-540}"
{
  date -u
  git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 benchmarks/dynamic_shapes.py --backends "${BACKENDS:-eager,inductor,aotforge}" \
  --seqlens "${SEQLENS:-512,768,1024}" --batch "${BATCH:-8}" --warmup 3 --steps 10 \
  --timeout "$limit" --budget "$budget" --json "$OUT/dynamic.json" --logs "$OUT/children" \
  2>&1 | tee -a "$OUT/dynamic.log"
