"""Micro-kernel bandwidth of aotforge's compiler on the GPU (issue 4).

LayerNorm+GELU, softmax and RMSNorm at 16384x4096: the forward and the backward graph that
aotforge's AOT autograd hands the compiler are compiled with ``compile_fx_inner`` and timed
on their own. Bandwidth = (bytes of the graph's inputs + outputs, each moved once) / median
time, reported as a fraction of a device-to-device copy measured in the same run. Eager and
inductor (``torch.compile``) forward+backward times are printed alongside.

    python benchmarks/gpu_compiler.py [--dtype fp32,bf16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import aotforge
from aotforge.compiler import compile_fx_inner, select_decomposition_table
from aotforge.compiler.pipeline import partitioner

ROWS, COLUMNS = 16384, 4096


def layernorm_gelu(x, weight, bias):
    return F.gelu(F.layer_norm(x, (x.shape[-1],), weight, bias))


def softmax(x):
    return torch.softmax(x, dim=-1)


def rmsnorm(x, weight):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight


WORKLOADS = {"layernorm_gelu": (layernorm_gelu, 2), "softmax": (softmax, 0), "rmsnorm": (rmsnorm, 1)}


def median_ms(fn, repeat: int = 30) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(dtype) -> float:
    x = torch.randn(ROWS, COLUMNS, device="cuda").to(dtype)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6  # GB/s


def _nbytes(values) -> int:
    """Bytes of the distinct tensors (an output that is an input, or a view of one, counts once)."""
    seen, total = set(), 0
    for v in values:
        if isinstance(v, torch.Tensor) and (v.data_ptr(), v.numel()) not in seen:
            seen.add((v.data_ptr(), v.numel()))
            total += v.numel() * v.element_size()
    return total


def capture_graphs(fn, inputs):
    """Compile fn with aotforge; return the compiled forward and backward with their inputs."""
    captured = {}

    def compiler(kind):
        def compile_(gm, example_inputs, **kwargs):
            compiled = compile_fx_inner(gm, example_inputs, is_backward=kind == "backward")
            stats = compiled.compiled_graph.stats

            def run(args):
                if kind not in captured:
                    captured[kind] = dict(args=[a for a in args], stats=stats, compiled=compiled)
                return compiled(args)
            run._boxed_call = True
            return run
        return compile_

    # the same decompositions and partitioner (min-cut + joint-graph passes) as the backend
    compiled_fn = aotforge.aot_function(fn, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                        decompositions=select_decomposition_table(), partition_fn=partitioner())
    out = compiled_fn(*inputs)
    out.backward(torch.randn_like(out))
    return captured


def measure(name: str, dtype: torch.dtype) -> dict:
    fn, parameters = WORKLOADS[name]
    x = torch.randn(ROWS, COLUMNS, device="cuda", dtype=dtype, requires_grad=True)
    params = [torch.randn(COLUMNS, device="cuda", dtype=dtype, requires_grad=True) for _ in range(parameters)]
    inputs = [x, *params]
    started = time.perf_counter()
    captured = capture_graphs(fn, inputs)
    compile_s = time.perf_counter() - started
    row = dict(workload=name, dtype=str(dtype).replace("torch.", ""), compile_s=round(compile_s, 1))
    for kind in ("forward", "backward"):
        entry = captured[kind]
        args, compiled = entry["args"], entry["compiled"]
        outputs = compiled(list(args))
        moved = _nbytes(list(args) + list(outputs))
        ms = median_ms(lambda: compiled(list(args)))
        graph = getattr(compiled, "compiled_graph", None)
        configs = [f"{k.name}:{k.kind}:{k.numel}x{k.rnumel}:{k.best}" for k in (graph.kernels if graph else [])]
        row[kind] = dict(ms=round(ms, 4), bytes=moved, gbps=round(moved / ms / 1e6, 1), kernels=entry["stats"].get("kernels"),
                         fallbacks=entry["stats"].get("fallbacks"), configs=configs)
    # eager and inductor, forward + backward, for reference
    grad = torch.randn(ROWS, COLUMNS, device="cuda", dtype=dtype)

    def step(f):
        def run():
            out = f(*inputs)
            torch.autograd.grad(out, inputs, grad)
        return run
    row["eager_fwd_bwd_ms"] = round(median_ms(step(fn)), 4)
    torch._dynamo.reset()
    row["inductor_fwd_bwd_ms"] = round(median_ms(step(torch.compile(fn))), 4)
    row["aotforge_fwd_bwd_ms"] = round(row["forward"]["ms"] + row["backward"]["ms"], 4)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32,bf16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    rows = []
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for dtype_name in args.dtype.split(","):
        dtype = dtypes[dtype_name]
        copy_gbps = copy_bandwidth(dtype)
        for name in args.workloads.split(","):
            try:
                row = measure(name, dtype)
            except Exception as error:  # one broken workload must not lose the others
                row = dict(workload=name, dtype=dtype_name, error=f"{type(error).__name__}: {error}")
            row["copy_gbps"] = round(copy_gbps, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| workload | dtype | pass | ms | GB/s | of copy | kernels | eager fwd+bwd ms | inductor fwd+bwd ms | aotforge fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['workload']} | {row['dtype']} | ERROR {row['error'][:80]} |")
            continue
        for kind in ("forward", "backward"):
            r = row[kind]
            print(f"| {row['workload']} | {row['dtype']} | {kind} | {r['ms']:.3f} | {r['gbps']:.0f} | "
                  f"{r['gbps'] / row['copy_gbps']:.0%} | {r['kernels']} | {row['eager_fwd_bwd_ms']:.3f} | "
                  f"{row['inductor_fwd_bwd_ms']:.3f} | {row['aotforge_fwd_bwd_ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
