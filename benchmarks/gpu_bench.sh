#!/usr/bin/env bash
# The benchmark suite's runs on the lent GPU machine (see benchmarks/RESULTS.md).
#   bash benchmarks/gpu_bench.sh validate      # short: every workload at quick sizes, micro at full size
#   bash benchmarks/gpu_bench.sh models        # full sizes: models + micro suites
#   bash benchmarks/gpu_bench.sh hf            # full sizes: HF GPT-2, BERT, timm ResNet-50
#   bash benchmarks/gpu_bench.sh all           # full sizes: every suite in one call
#   bash benchmarks/gpu_bench.sh families      # correctness: every tiny model family, float32 (TF32 off)
#                                              # then bf16 autocast, eager vs aotforge (AOTFORGE_STRICT=1:
#                                              # a compiler failure is a FAILED row, not a fallback)
# Extra arguments go to `python -m aotforge bench`. Results land in $OUT (default bench_out/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
phase="${1:-validate}"
shift || true
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 - <<'PY'
import importlib
for name in ("torch", "triton", "transformers", "timm", "matplotlib", "networkx", "sympy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "MISSING", error)
PY
} 2>&1 | tee "$OUT/env.txt"
bench() { python3 -m aotforge bench "$@"; }
case "$phase" in
  validate)
    bench --quick --time-budget 200 --json "$OUT/quick.json" "$@" 2>&1 | tee "$OUT/quick.log"
    bench --suite micro --backends eager,inductor --time-budget 100 --json "$OUT/micro.json" "$@" 2>&1 | tee "$OUT/micro.log"
    ;;
  models)
    bench --suite models,micro --time-budget 420 --backend-timeout 150 --json "$OUT/models.json" "$@" 2>&1 | tee "$OUT/models.log"
    ;;
  all)
    bench --time-budget 480 --backend-timeout 120 --json "$OUT/all.json" "$@" 2>&1 | tee "$OUT/all.log"
    ;;
  families)
    export AOTFORGE_STRICT=1
    family() { bench --suite families --backends eager,aotforge --repeat 1 --warmup 0 --stabilize 0 \
                     --backend-timeout 120 "$@"; }
    family --time-budget "${FAMILIES_BUDGET:-500}" --json "$OUT/families-fp32.json" "$@" 2>&1 | tee "$OUT/families-fp32.log"
    if [[ -z "${FAMILIES_FP32_ONLY:-}" ]]; then
      family --dtype bf16 --autocast --time-budget "${FAMILIES_BUDGET:-500}" --json "$OUT/families-bf16.json" "$@" 2>&1 | tee "$OUT/families-bf16.log"
    fi
    ;;
  hf)
    bench --suite hf --time-budget 420 --backend-timeout 150 --json "$OUT/hf.json" "$@" 2>&1 | tee "$OUT/hf.log"
    ;;
  *)
    echo "unknown phase $phase: validate, models, hf, families or all" >&2
    exit 2
    ;;
esac
