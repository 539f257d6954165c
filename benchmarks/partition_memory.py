"""Saved-activation bytes and training-step memory: default partition vs min-cut vs PyTorch.

    python benchmarks/partition_memory.py              # saved bytes on the CPU (joint graphs)
    python benchmarks/partition_memory.py --gpu        # + peak memory and step time on CUDA
    python benchmarks/partition_memory.py --small      # tiny sizes, for a smoke run

Part 1 (any machine) captures the joint graph of each model (an MLP with GELU/LayerNorm, a
transformer block, a small CNN with batch norm) three ways: plain ATen ops (torch's
aot_function, no decompositions), after Inductor's decompositions (torch's aot_function), and
after aotforge's own decompositions (aotforge's aot_function, what the ``aotforge`` backend
partitions). On each joint graph it partitions with our default partition, our min-cut at
budgets 1 / 0.5 / 0, and PyTorch's own min-cut (torch._functorch.partitioners) at the same
budgets, and reports the bytes saved for the backward. Parameters are passed as static-
lifetime inputs to both min-cuts; "act" columns leave parameters out (they stay alive anyway).

Part 2 (``--gpu``) runs a training step (forward + backward with a fixed gradient, gradients
set to None between steps) and reports the memory held between forward and backward (the saved
activations, as the allocator sees them), the step's peak memory above the parameters, and
the median step time, for eager, the ``aotforge`` backend with the default partition and with
min-cut (budgets 1, 0.5, 0), and torch.compile with Inductor.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import aotforge  # noqa: E402
import aotforge.partition as partition  # noqa: E402
from aotforge.partition import default_partition, min_cut_rematerialization_partition  # noqa: E402
from tests.partition.joints import (  # noqa: E402
    Case,
    MLP,
    SmallCNN,
    TransformerBlock,
    capture_joint,
    saved_nodes,
)

BUDGETS = (1.0, 0.5, 0.0)


def cases(small: bool) -> list[Case]:
    if small:
        return [
            Case("mlp", lambda: MLP(64, 256), (128, 64)),
            Case("transformer", lambda: TransformerBlock(64, 4), (4, 32, 64)),
            Case("cnn", lambda: SmallCNN(16), (8, 3, 16, 16)),
        ]
    return [
        Case("mlp", lambda: MLP(1024, 4096), (4096, 1024)),
        Case("transformer", lambda: TransformerBlock(768, 12), (8, 512, 768)),
        Case("cnn", lambda: SmallCNN(64), (32, 3, 64, 64)),
    ]


# --- part 1: saved bytes on the joint graphs ---------------------------------------------


def _bytes(fw, num_fwd_outputs: int, static: set[str]) -> tuple[int, int]:
    from aotforge.partition.op_costs import node_bytes

    saved = saved_nodes(fw, num_fwd_outputs)
    total = sum(node_bytes(n) for n in saved)
    activations = sum(node_bytes(n) for n in saved if n.name not in static)
    return total, activations


def _torch_min_cut(budget: float):
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition as torch_min_cut

    def run(joint, inputs, *, num_fwd_outputs, **kwargs):
        with functorch_config.patch(activation_memory_budget=budget):
            return torch_min_cut(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    return run


def _ours(budget: float):
    def run(joint, inputs, *, num_fwd_outputs, **kwargs):
        return min_cut_rematerialization_partition(
            joint, inputs, num_fwd_outputs=num_fwd_outputs, memory_budget=budget, **kwargs
        )

    return run


def _flavors() -> dict:
    import torch._inductor.lowering  # noqa: F401  (registers ops Inductor's decompositions use)
    from torch._inductor.decomposition import select_decomp_table

    flavors = {"aten": ("torch", None), "inductor-decomp": ("torch", select_decomp_table())}
    try:
        from aotforge.compiler.decompositions import select_decomposition_table

        flavors["aotforge-decomp"] = ("aotforge", select_decomposition_table(None))
    except Exception as error:  # the compiler's table is optional for this measurement
        print(f"(aotforge decompositions unavailable: {error!r})")
    return flavors


def saved_bytes_table(small: bool) -> list[dict]:
    rows = []
    partitioners = {"default": lambda j, i, **k: default_partition(j, i, num_fwd_outputs=k["num_fwd_outputs"])}
    for budget in BUDGETS:
        partitioners[f"ours@{budget:g}"] = _ours(budget)
        partitioners[f"torch@{budget:g}"] = _torch_min_cut(budget)
    for flavor, (frontend, table) in _flavors().items():
        for case in cases(small):
            try:
                joint = capture_joint(case, dtype=torch.float32, frontend=frontend, decompositions=table)
            except Exception as error:
                print(f"{case.name}/{flavor}: capture FAILED {error!r}")
                continue
            num_params = len(joint.primals) - 1
            primal_names = [
                n.name for n in joint.module.graph.find_nodes(op="placeholder") if n.name.startswith("primals")
            ]
            static = set(primal_names[:num_params])
            row = {"model": case.name, "graph": flavor}
            for label, partition_fn in partitioners.items():
                try:
                    fw, _ = partition_fn(
                        joint.module,
                        joint.inputs,
                        num_fwd_outputs=joint.num_fwd_outputs,
                        static_lifetime_input_indices=list(range(num_params)),
                    )
                    row[label] = _bytes(fw, joint.num_fwd_outputs, static)
                except Exception as error:
                    print(f"{case.name}/{flavor}/{label}: FAILED {error!r}")
                    row[label] = None
            rows.append(row)
            print_bytes_row(row)
    return rows


def _mib(value) -> str:
    return "FAILED" if value is None else f"{value[1] / 2**20:.2f}"


def print_bytes_row(row: dict) -> None:
    cells = [f"{row['model']:<12}{row['graph']:<16}"]
    for key in ("default", "ours@1", "torch@1", "ours@0.5", "torch@0.5", "ours@0", "torch@0"):
        cells.append(f"{_mib(row.get(key)):>10}")
    print("".join(cells), flush=True)


def print_bytes_header() -> None:
    print("saved activation MiB (parameters excluded), float32")
    print(
        f"{'model':<12}{'graph':<16}"
        + "".join(f"{h:>10}" for h in ("default", "ours@1", "torch@1", "ours@0.5", "torch@0.5", "ours@0", "torch@0"))
    )


# --- part 2: a training step on the GPU ---------------------------------------------------


def _compiled(model, mode: str):
    if mode == "eager":
        return model
    if mode == "inductor":
        return torch.compile(model, backend="inductor")
    if mode.startswith("backend:"):  # any torch.compile backend, e.g. backend:aotforge_eager
        return torch.compile(model, backend=mode.split(":", 1)[1])
    if mode.startswith("aotforge-eager"):
        fn = default_partition if mode.endswith("default") else min_cut_rematerialization_partition
        return aotforge.aot_module(model, fw_compiler=aotforge.nop, partition_fn=fn)
    return torch.compile(model, backend="aotforge")  # the partitioner: _partition_setting


@contextlib.contextmanager
def _partition_setting(mode: str):
    """The aotforge backend partitions with min-cut; "aotforge-default" swaps in the default
    partition, "aotforge-torch-mincut" PyTorch's min-cut, "...@b" sets the memory budget."""
    if mode == "aotforge-default":
        with mock.patch.object(partition, "min_cut_rematerialization_partition", default_partition):
            yield
    elif mode == "aotforge-torch-mincut":
        from torch._functorch.partitioners import min_cut_rematerialization_partition as torch_min_cut

        with mock.patch.object(partition, "min_cut_rematerialization_partition", torch_min_cut):
            yield
    elif "@" in mode:
        with aotforge.config.patch(activation_memory_budget=float(mode.split("@")[1])):
            yield
    else:
        yield


def train_step_stats(case: Case, mode: str, steps: int, device: str = "cuda") -> dict:
    """Held-after-forward and peak memory (CUDA only) and the median step time."""
    cuda = device == "cuda"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case.make().to(device)
    x = torch.randn(case.input_shape, device=device)
    with _partition_setting(mode):
        step_fn = _compiled(model, mode)
        grad = None

        def step() -> int:
            nonlocal grad
            for p in model.parameters():
                p.grad = None
            out = step_fn(x)
            if grad is None:
                grad = torch.randn_like(out)
            held = torch.cuda.memory_allocated() if cuda else 0
            out.backward(grad)
            return held

        for _ in range(3):  # compile and warm up
            step()
        # gradients against eager, same parameters and input: a fast wrong answer is no answer
        compiled_grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        model(x).backward(grad)
        # one norm over all gradients: a conv bias before batch norm has a gradient of ~0,
        # whose own relative error means nothing
        got = torch.cat([g.flatten() for g in compiled_grads])
        want = torch.cat([p.grad.flatten() for p in model.parameters()])
        error = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        held = step()
        stats = {"grad_rel_err": error}
        if cuda:
            torch.cuda.synchronize()
            stats["held_mib"] = (held - base) / 2**20
            stats["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                step()
                times.append((time.perf_counter() - began) * 1000)
    times.sort()
    stats["ms"] = times[len(times) // 2]
    return stats


def train_step_table(
    small: bool, modes: list[str], steps: int, device: str, rows: list, save=lambda: None
) -> list[dict]:
    """One row per (model, mode), appended to ``rows``; ``save`` runs after each."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\ntraining step on {name}, float32")
    print(f"{'model':<12}{'mode':<26}{'held MiB':>10}{'peak MiB':>10}{'ms':>9}{'grad err':>10}")
    for case in cases(small):
        for mode in modes:
            began = time.time()
            try:
                stats = train_step_stats(case, mode, steps, device)
                line = (
                    f"{stats.get('held_mib', float('nan')):>10.1f}"
                    f"{stats.get('peak_mib', float('nan')):>10.1f}{stats['ms']:>9.3f}"
                    f"{stats['grad_rel_err']:>10.1e}"
                )
            except Exception as error:
                stats = {"error": repr(error)[:300]}
                traceback.print_exc(limit=3)
                line = f"  FAILED {repr(error)[:80]}"
            stats.update(model=case.name, mode=mode, wall_s=round(time.time() - began, 1))
            rows.append(stats)
            save()
            print(f"{case.name:<12}{mode:<26}{line}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke run)")
    parser.add_argument("--gpu", action="store_true", help="also time training steps on CUDA")
    parser.add_argument(
        "--cpu-steps", action="store_true", help="time training steps on the CPU (smoke run)"
    )
    parser.add_argument("--no-bytes", action="store_true", help="skip part 1")
    parser.add_argument(
        "--modes",
        default="eager,aotforge-default,aotforge,aotforge@0.5,aotforge@0,inductor",
        help="comma-separated: eager, aotforge-default, aotforge, aotforge@B, "
        "aotforge-torch-mincut, aotforge-eager-default, aotforge-eager-mincut[@B] "
        "(aot_module, graphs run as FX), inductor, backend:NAME",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write all numbers here")
    args = parser.parse_args(argv)
    results: dict = {"torch": torch.__version__}

    def save() -> None:  # after each part, so a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=1)

    if not args.no_bytes:
        print_bytes_header()
        results["saved_bytes"] = saved_bytes_table(args.small)
        save()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA; run part 1 alone without --gpu")
    if args.gpu or args.cpu_steps:
        device = "cuda" if args.gpu else "cpu"
        results["train_step"] = []
        train_step_table(args.small, args.modes.split(","), args.steps, device, results["train_step"], save)

if __name__ == "__main__":
    main()
