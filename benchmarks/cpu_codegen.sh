#!/usr/bin/env bash
# The CPU comparison of issue 24: eager vs inductor's C++ backend vs aotforge on the cpu suite
# (aotforge/bench/workloads/cpu.py), float32, training and inference, in one process: each
# backend checked against eager (outputs, gradients, BatchNorm buffers), then timed in
# interleaved rounds (median and spread), every first call compiled against empty caches
# (--cold-caches), and a geomean row per backend at the end of the table.
#
#   bash benchmarks/cpu_codegen.sh            # full sizes, torch's thread count (2 here): about 5 min
#                                             # (most of it inductor's C++ compiles: 1.4-92 s a row)
#   bash benchmarks/cpu_codegen.sh --quick    # quick sizes, 1 thread: a smoke run of a few minutes
#
# Two threads need two idle CPUs: while other processes keep this machine busy (load average
# above 1), every parallel region waits for a time slice and steps run 4-13x slower and spread
# +-50-130% (measured: eager's conv net training step 35 ms at 1 thread, 480 ms at 2 under load
# 2.5). Run it on a quiet machine, or pass --threads 1 (rows then spread +-1-5%).
#
# Extra arguments go to `python -m aotforge bench` (later ones win): --workloads cpu_mlp,
# --backends eager,aotforge, --threads 1, --repeat 30 ... The raw output lands in
# benchmarks/results/<date>-cpu-codegen[-quick][-N]/ (or $OUT): env.txt (machine, load,
# versions), bench.log (the table, the legend and the progress lines), bench.json.
# ResNet-18 and MobileNetV3-small need torchvision; without it their rows are SKIPPED.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

quick=""
if [[ "${1:-}" == "--quick" ]]; then
  quick=1
  shift
fi
if [[ -z "${OUT:-}" ]]; then
  OUT="benchmarks/results/$(date -u +%Y-%m-%d)-cpu-codegen${quick:+-quick}"
  base="$OUT"
  for n in 2 3 4 5 6 7 8 9; do
    [[ -e "$OUT" ]] || break
    OUT="$base-$n"
  done
fi
mkdir -p "$OUT"

{
  date -u
  echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPU(s) usable"
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
  echo "c++: $( (${CXX:-c++} --version 2>/dev/null || echo none) | head -1)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -q . && echo '(uncommitted changes)')"
  python3 - <<'PY'
import importlib
import torch
for name in ("torch", "torchvision", "numpy"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "MISSING", error)
print("torch threads", torch.get_num_threads(), "| cpu capability", torch.backends.cpu.get_cpu_capability())
PY
} 2>&1 | tee "$OUT/env.txt"

common=(--suite cpu --device cpu --backends eager,inductor,aotforge --modes train,infer --cold-caches
        --json "$OUT/bench.json")
if [[ -n "$quick" ]]; then
  # Quick sizes run at 1 thread (the harness's default with --quick); inductor still compiles
  # every graph, about a minute per workload and mode here.
  python3 -m aotforge bench "${common[@]}" --quick --time-budget 1500 --backend-timeout 400 "$@" 2>&1 | tee "$OUT/bench.log"
else
  # 20 rounds per row, up to 20 s more per row while rows are NOISY; a backend that takes more
  # than 10 minutes on one row (compile + check + timing) is FAILED and the run goes on.
  python3 -m aotforge bench "${common[@]}" --repeat 20 --stabilize 20 --time-budget 3600 --backend-timeout 600 \
    "$@" 2>&1 | tee "$OUT/bench.log"
fi
status=${PIPESTATUS[0]}
echo "cpu_codegen: results in $OUT" >&2
exit "$status"
