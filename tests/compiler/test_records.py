"""The compiler's stages print: golden text of the lowered graph, the kernel plan, the memory
plan and the wrapper for small graphs (fusion decisions, frees, reuse), and the dump folder
holds them in stage order."""
from __future__ import annotations

import os

import torch

from aotforge.compiler import compile_fx_inner
from aotforge.config import config

from .helpers import trace


def _compiled(fn, *args):
    with config.patch(triton_on_cpu=True):
        gm = trace(fn, *args)  # under the patch: the decompositions depend on the path
        compiled = compile_fx_inner(gm, list(args))
    outputs = compiled([a.clone() for a in args])
    expected = fn(*args)
    for actual, wanted in zip(outputs, expected):
        torch.testing.assert_close(actual, wanted)
    return compiled.compiled_graph


def _softmax_matmul_column_sum(x, w):
    y = torch.softmax(x, -1)
    return (y @ w, (y * 2).sum(0))


def test_lowered_graph_prints_each_buffer_with_its_body():
    graph = _compiled(_softmax_matmul_column_sum, torch.randn(4, 8), torch.randn(8, 3))
    assert str(graph.lowered) == """\
input x_1: f32[4, 8] stride [8, 1]
input w_1: f32[8, 3] stride [3, 1]
buf0: f32[4] stride [1] = max over [8] of (i0 | r0):
    t0 = load(x_1, 8*i0 + r0)
    -> t0
buf1: f32[4] stride [1] = sum over [8] of (i0 | r0):
    t0 = load(x_1, 8*i0 + r0)
    t1 = load(buf0, i0)
    t2 = sub(t0, t1)
    t3 = exp(t2)
    -> t3
buf2: f32[4, 8] stride [8, 1] = pointwise over [4, 8] (i0, i1):
    t0 = load(x_1, 8*i0 + i1)
    t1 = load(buf0, i0)
    t2 = sub(t0, t1)
    t3 = exp(t2)
    t4 = load(buf1, i0)
    t5 = truediv(t3, t4)
    -> t5
extern0 = aten.mm.default(buf2, w_1) -> buf3: f32[4, 3] stride [3, 1]
buf4: f32[8] stride [1] = sum over [4] of (i0 | r0):
    t0 = load(buf2, i0 + 8*r0)
    t1 = constant(2, float32)
    t2 = mul(t0, t1)
    -> t2
return (buf3, buf4)
"""


def test_kernel_plan_shows_fusion_and_what_is_stored():
    graph = _compiled(_softmax_matmul_column_sum, torch.randn(4, 8), torch.randn(8, 3))
    # the max, the sum and the normalized values share one pass over each row; the column
    # sum reads along the other axis and needs a kernel of its own, which reads the softmax
    # the matmul needed in memory (the row statistics stay in registers)
    assert str(graph.kernel_plan) == """\
kernel0: reduction x=4 r=8: buf0, buf1, buf2 (stored)
extern0: aten.mm.default -> buf3
kernel1: reduction x=8 r=4: buf4 (stored)
"""
    assert str(graph.memory_plan) == """\
kernel0: allocate buf2; after: free x_1
extern0: after: free w_1
kernel1: allocate buf4; after: free buf2
"""


def test_layer_norm_keeps_its_statistics_in_registers():
    fn = lambda x, w, b: (torch.nn.functional.layer_norm(x, (16,), w, b),)
    graph = _compiled(fn, torch.randn(8, 16), torch.randn(16), torch.randn(16))
    lines = str(graph.kernel_plan).splitlines()
    assert len(lines) == 1 and lines[0].startswith("kernel0: reduction x=8 r=16: ")
    assert lines[0].count("(stored)") == 1  # mean and variance are never written to memory


def _three_matmuls(x, w):
    a = torch.sin(x) @ w
    b = torch.cos(a) @ w
    return (torch.tanh(b) @ w,)


def test_memory_plan_frees_at_last_use_and_reuses_memory():
    graph = _compiled(_three_matmuls, torch.randn(4, 4), torch.randn(4, 4))
    assert str(graph.memory_plan) == """\
kernel0: allocate buf0; after: free x_1
extern0: after: free buf0
kernel1: allocate buf2 in buf1's memory (in place); after: free buf1
extern1: after: free buf2
kernel2: allocate buf4 in buf3's memory (in place); after: free buf3
extern2: after: free buf4, w_1
"""
    assert graph.program.source == """\
def call(args):
    x_1, w_1 = args
    args.clear()
    if not input_layouts.check(x_1, w_1):
        x_1 = ensure_layout(x_1, (4, 4), (4, 1))
        w_1 = ensure_layout(w_1, (4, 4), (4, 1))
        input_layouts.remember(x_1, w_1)
    buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    kernel0.run(x_1, buf0)
    del x_1
    extern0 = torch.ops.aten.mm.default(buf0, w_1)
    buf1 = ensure_layout(extern0, (4, 4), (4, 1))
    del extern0
    del buf0
    buf2 = reinterpret_tensor(buf1, (4, 4), (4, 1), 0)  # in place
    kernel1.run(buf1, buf2)
    del buf1
    extern1 = torch.ops.aten.mm.default(buf2, w_1)
    buf3 = ensure_layout(extern1, (4, 4), (4, 1))
    del extern1
    del buf2
    buf4 = reinterpret_tensor(buf3, (4, 4), (4, 1), 0)  # in place
    kernel2.run(buf3, buf4)
    del buf3
    extern2 = torch.ops.aten.mm.default(buf4, w_1)
    buf5 = ensure_layout(extern2, (4, 4), (4, 1))
    del extern2
    del buf4
    del w_1
    return (buf5,)
"""


def test_compiled_graph_prints_every_record_and_the_compile_time():
    graph = _compiled(_three_matmuls, torch.randn(4, 4), torch.randn(4, 4))
    text = str(graph)
    for section in ("## lowered graph", "## kernel plan", "## memory plan", "## kernels", "## wrapper"):
        assert section in text
    assert list(graph.timings)[:5] == ["post_grad_passes", "lower", "schedule", "codegen", "load"]
    assert "first_run" in graph.timings  # the first call (Triton compile, autotune) is timed too
    assert graph.describe_timings().startswith("forward graph: ")


def test_dump_folder_holds_the_stages_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    _compiled(_three_matmuls, torch.randn(4, 4), torch.randn(4, 4))
    files = sorted(f for f in tmp_path.rglob("*") if f.is_file())  # <pid>/<compile>/<numbered files>
    assert len({f.parent for f in files}) == 1
    names = [f.name for f in files]
    stages = ["post_grad", "lowered", "kernel_plan", "memory_plan", "kernels", "wrapper"]
    positions = [next(i for i, name in enumerate(names) if stage in name) for stage in stages]
    assert positions == sorted(positions), names
    plan = next(name for name in names if "kernel_plan" in name)
    assert "kernel0: pointwise x=16" in (files[0].parent / plan).read_text()
