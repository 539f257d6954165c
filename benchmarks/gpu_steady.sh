#!/usr/bin/env bash
# Steady-state table of issues 19/20 (and 21 with MODE=reduce-overhead backends), one device call:
#   bash benchmarks/gpu_steady.sh WORKLOADS MODES [SECONDS] [extra bench args]
#   bash benchmarks/gpu_steady.sh hf_gpt2,hf_bert train 540
# bf16 autocast, full sizes, eager vs inductor vs aotforge side by side, then --profile.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench_out}"; mkdir -p "$OUT"
workloads="$1"; modes="$2"; budget="${3:-540}"; shift 3 || shift $#
tag="$(echo "$workloads-$modes" | tr ',' '_')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env-$tag.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env-$tag.txt"
timeout $((budget + 50)) python3 -m aotforge bench --workloads "$workloads" --modes "$modes" --dtype bf16 --autocast \
    --backends "${BACKENDS:-eager,inductor,aotforge}" --time-budget "$budget" --backend-timeout 200 --profile \
    --json "$OUT/steady-$tag.json" "$@" 2>&1 | tee "$OUT/steady-$tag.log" | grep -v "^\[" | tail -40
