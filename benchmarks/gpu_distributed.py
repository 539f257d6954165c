"""Distributed training compiled by aotforge on two GPUs (issue 25): nanoGPT-124M in bf16, 8
sequences of 1024 tokens per rank, 20 AdamW steps under DDP, FSDP2 and 2-way tensor
parallelism, eager vs inductor vs aotforge, in one run and one table.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/gpu_distributed.py [--json out.json]
    torchrun --nproc-per-node 2 benchmarks/gpu_distributed.py --tiny --backends eager,aotforge  # CPU check

- DDP and FSDP2 train the suite's nanoGPT (aotforge/bench/workloads/models.py, GPT-2 small's
  shapes, tied LM head). Tensor parallelism trains examples/ddp_fsdp.py's transformer at the
  same shapes (12 layers, d=768, 12 heads, vocab 50304): nanoGPT's fused qkv projection and
  tied head cannot be split column-wise.
- bf16: DDP and tensor parallelism run the forward under ``torch.autocast(bfloat16)`` with
  float32 weights; FSDP2 uses ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
- Every backend starts from the same weights and reads the same data; the loss of every step
  is compared with eager's (bf16 tolerance: ``--loss-tolerance``, relative).
- Step time: median of the steps after the first ``--warmup`` (which compile); peak memory:
  ``max_memory_allocated`` per rank over the 20 steps.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aotforge.bench.workloads.models import NanoGPT  # noqa: E402

MODES = ("ddp", "fsdp2", "tp")
BACKENDS = ("eager", "inductor", "aotforge")
# GPT-2 small (nanoGPT-124M), and a tiny one for a CPU check of the script itself
SHAPES = {"124m": dict(vocab=50304, seq=1024, layers=12, heads=12, dim=768, batch=8),
          "tiny": dict(vocab=64, seq=32, layers=2, heads=4, dim=64, batch=2)}


def _example():
    spec = importlib.util.spec_from_file_location("aotforge_example_ddp_fsdp", ROOT / "examples" / "ddp_fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()


def build(mode: str, shape: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights for every backend and rank
    if mode == "tp":
        model = example.Transformer(shape["vocab"], shape["dim"], shape["heads"], shape["layers"])
    else:
        model = NanoGPT(shape["vocab"], shape["seq"], shape["layers"], shape["heads"], shape["dim"])
    return model.to(device)


def batches(mode: str, shape: dict, steps: int, device: torch.device) -> list:
    # data-parallel ranks read different data, tensor-parallel ranks the same
    generator = torch.Generator().manual_seed(1 if mode == "tp" else 1 + dist.get_rank())
    size = (shape["batch"], shape["seq"])
    return [tuple(torch.randint(0, shape["vocab"], size, generator=generator).to(device) for _ in range(2))
            for _ in range(steps)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(mode: str, backend: str, shape: dict, args: argparse.Namespace, device: torch.device) -> dict:
    """Train ``args.steps`` steps; the losses, seconds per step and this rank's peak memory."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    bf16 = device.type == "cuda" or args.bf16_on_cpu
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    model, step_fn = example.parallelize(build(mode, shape, device), mode, backend, device, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    # FSDP2 casts the parameters itself; the other modes compute in bf16 under autocast
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and mode != "fsdp2" \
        else contextlib.nullcontext()
    losses, seconds = [], []
    for tokens, targets in batches(mode, shape, args.steps, device):
        synchronize(device)
        started = time.perf_counter()
        with autocast:
            logits = step_fn(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del model, step_fn, optimizer
    return {"losses": losses, "seconds": seconds, "peak_bytes": peak}


def table(results: dict, args: argparse.Namespace, shape: dict, world: int) -> str:
    """One row per mode and backend: step time, throughput, peak memory per rank, loss check."""
    tokens = shape["batch"] * shape["seq"]
    lines = [f"{'mode':<6} {'backend':<9} {'first step s':>12} {'step ms':>9} {'tokens/s/rank':>14} "
             f"{'peak GiB per rank':>20} {'max rel loss diff':>18} {'vs eager':>9}"]
    for mode, by_backend in results.items():
        eager = by_backend.get("eager")
        for backend, ranks in by_backend.items():
            seconds = statistics.median(ranks[0]["seconds"][args.warmup:])
            peaks = "/".join(f"{r['peak_bytes'] / 2**30:.2f}" for r in ranks)
            if eager is None or backend == "eager":
                diff, verdict = "-", "-"
            else:
                worst = max(abs(a - b) / abs(b) for r, e in zip(ranks, eager)
                            for a, b in zip(r["losses"], e["losses"]))
                diff, verdict = f"{worst:.2e}", "equal" if worst <= args.loss_tolerance else "DIFFERS"
            lines.append(f"{mode:<6} {backend:<9} {ranks[0]['seconds'][0]:>12.2f} {seconds * 1e3:>9.1f} "
                         f"{tokens / seconds:>14.0f} {peaks:>20} {diff:>18} {verdict:>9}")
    return "\n".join(lines)


def loss_table(mode: str, by_backend: dict) -> str:
    """The loss of every step on rank 0, one column per backend."""
    names = list(by_backend)
    lines = [f"{mode}, rank 0 losses:", f"{'step':>6} " + " ".join(f"{n:>10}" for n in names)]
    for step in range(len(by_backend[names[0]][0]["losses"])):
        lines.append(f"{step:>6} " + " ".join(f"{by_backend[n][0]['losses'][step]:>10.5f}" for n in names))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the step time (compiles)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the script on a CPU)")
    parser.add_argument("--bf16-on-cpu", action="store_true", help="bf16 on the CPU too (the GPU always is)")
    parser.add_argument("--loss-tolerance", type=float, default=2e-2, help="relative, per step (bf16)")
    parser.add_argument("--json", help="write every rank's losses, step times and peak memory here")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("launch with torchrun --nproc-per-node 2")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the GPU machine's rule)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    shape = SHAPES["tiny" if args.tiny else "124m"]
    world, rank = dist.get_world_size(), dist.get_rank()
    results: dict[str, dict[str, list]] = {}
    try:
        for mode in args.modes.split(","):
            for backend in args.backends.split(","):
                mine = run(mode, backend, shape, args, device)
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, mine)
                results.setdefault(mode, {})[backend] = gathered
                if rank == 0:
                    print(f"{mode} {backend}: median step {statistics.median(mine['seconds'][args.warmup:]) * 1e3:.1f} ms",
                          flush=True)
        if rank == 0:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            print(f"\n{world} ranks, {gpu}, torch {torch.__version__}, {'tiny' if args.tiny else 'nanoGPT-124M'}, "
                  f"batch {shape['batch']}x{shape['seq']} per rank, {args.steps} steps")
            print(table(results, args, shape, world))
            for mode, by_backend in results.items():
                print("\n" + loss_table(mode, by_backend))
            if args.json:
                Path(args.json).write_text(json.dumps({"shape": shape, "world": world, "results": results}, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
