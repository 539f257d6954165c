"""Fusion keeps recomputation next to its use: a buffer joins only kernels near it in program
order (or one whose value only it reads), and horizontal fusion stays within a pointer budget.
Without that, a transformer's backward hoisted every layer's recomputed layer norm into its
first kernel (nanoGPT and BERT on an H200: kernels of 77-159 pointers, 2-3 ms each)."""
from __future__ import annotations

import torch

from aotforge.bench.workloads.models import NanoGPT
from aotforge.compiler import observe
from aotforge.compiler.schedule import analyze_reads, fuse
from aotforge.compiler.schedule.fusion import HORIZONTAL_POINTER_BUDGET
from aotforge.compiler.lowering import lower
from aotforge.config import config

from ..helpers import trace


def _backward_kernels(layers: int):
    torch.manual_seed(0)
    model = NanoGPT(64, 16, layers, 2, 32)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.compile(model, backend="aotforge")(idx, targets)
        loss.backward()
    (backward,) = [g for g in graphs if g.kind == "backward"]
    return backward


def test_recomputed_layer_norms_stay_with_their_layers():
    backward = _backward_kernels(6)
    widest = max(len(kernel.arguments) for kernel in backward.kernels)
    # the kernel that rebuilds the residual stream reads 2 matmul outputs per layer and stores
    # each layer's input; before, every layer's layer norm joined it too (about 80 pointers here)
    assert widest <= 4 * 6 + 4, widest  # unlimited fusion: 86
    stored_per_kernel = [sum(1 for n in k.nodes if n.name in backward.kernel_plan.stored)
                         for k in backward.kernel_plan.kernels()]
    assert max(stored_per_kernel) <= 2 * 6, stored_per_kernel  # unlimited fusion: 45


def test_horizontal_fusion_respects_the_pointer_budget():
    # many independent sums over the same rows: siblings, but not all in one kernel
    def many_sums(*xs):
        return [x.sum(-1) for x in xs]

    inputs = [torch.randn(8, 32) for _ in range(40)]
    lowered = lower(trace(many_sums, *inputs))
    plan = fuse(lowered, analyze_reads(lowered))
    for kernel in plan.kernels():
        reads = {name for node in kernel.nodes for name in analyze_reads(lowered).of(node)}
        assert len(reads) + len(kernel.nodes) <= HORIZONTAL_POINTER_BUDGET
    assert len(plan.kernels()) > 1


def test_a_cast_that_is_its_producers_only_reader_still_joins_it_across_library_calls():
    def fn(x, w, g):
        total = g.sum(0)           # a bias gradient's column sum
        y = (x @ w) @ w            # two library calls in between
        z = (y @ w) @ w
        u = (z @ w) @ w
        v = (u @ w) @ w
        return z, u, v, total.to(torch.float64)  # the final cast reads only the sum

    plan = fuse(*(lambda low: (low, analyze_reads(low)))(lower(trace(
        fn, torch.randn(8, 8), torch.randn(8, 8), torch.randn(16, 8)))))
    groups = [k for k in plan.kernels() if any(n.body.__class__.__name__ == "ReductionBody" for n in k.nodes)]
    assert len(groups) == 1 and len(groups[0].nodes) == 2, plan
