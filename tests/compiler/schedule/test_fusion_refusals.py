"""Fusion says why a buffer did not join a kernel it was offered to, and records on each kernel
group whether its rows are held at once (persistent) or walked in a loop (looped)."""
from __future__ import annotations

import torch

from aotforge.compiler.lowering import lower
from aotforge.compiler.schedule import analyze_reads, fuse
from aotforge.config import config

from ..helpers import trace
from ..test_records import _compiled


def _column_and_row_sums(x):
    return x.sum(0), x - x.amax(-1, keepdim=True)  # (softmax is an ATen call on the CPU: eager_rounding)


def _plan(fn, *args):
    lowered = lower(trace(fn, *args))
    return fuse(lowered, analyze_reads(lowered))


def test_a_refusal_names_the_buffer_the_kernel_and_the_reason():
    plan = _plan(_column_and_row_sums, torch.randn(8, 32))
    assert [g.name for g in plan.kernels()] == ["kernel0", "kernel1"]
    assert plan.refusals == ("buf1 not in kernel0: a reduction of another shape",)
    assert plan.describe_refusals() == "buf1 not in kernel0: a reduction of another shape\n"


def test_fusion_records_persistent_and_looped_kernels():
    plan = _plan(lambda x: (x.sum(1), x.sum(0), x + 1), torch.randn(64, 8))
    kinds = {g.name: (g.kind, g.reduction_contiguous) for g in plan.kernels()}
    assert ("persistent", True) in kinds.values()  # rows of 8 contiguous elements
    with config.patch(persistent_reduction_limit=4):
        looped = _plan(lambda x: (x.sum(1),), torch.randn(64, 8))
    assert [g.kind for g in looped.kernels()] == ["looped"]
    assert [g.kind for g in _plan(lambda x: (x + 1,), torch.randn(64, 8)).kernels()] == ["pointwise"]


def test_refusals_are_printed_beside_the_kernel_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    _compiled(_column_and_row_sums, torch.randn(8, 32))
    names = sorted(f.name for f in tmp_path.rglob("*") if f.is_file())
    plan = next(i for i, name in enumerate(names) if "kernel_plan" in name)
    refusals = next(i for i, name in enumerate(names) if "fusion_refusals" in name)
    assert refusals == plan + 1, names
    text = next(f for f in tmp_path.rglob("*fusion_refusals*")).read_text()
    assert "buf1 not in kernel0: a reduction of another shape" in text


def test_one_strided_read_makes_a_reduction_strided():
    """A cross-entropy backward's bias gradient reads its per-row weights along the row and the
    logits down a column; the kernel walks column tiles whichever read comes first."""
    g, w = torch.randn(256, 100), torch.randn(256)
    for fn in (lambda g, w: ((w[:, None] * g.abs()).sum(0),), lambda g, w: ((g.abs() * w[:, None]).sum(0),)):
        (kernel,) = _plan(fn, g, w).kernels()
        assert (kernel.kind, kernel.reduction_contiguous) == ("looped", False)
    (kernel,) = _plan(lambda g, w: ((g.abs() * w[None, :100]).sum(1),), g, w).kernels()
    assert kernel.reduction_contiguous
