"""The memory plan: in-place writes over dying buffers, ATen outputs nobody reads freed at
once, reuse of released memory; every compiled graph checked against eager, and the plan's
peak of live bytes (``live_bytes``) checked against a count by hand."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from aotforge.compiler import compile_fx_inner, pipeline
from aotforge.compiler.ir import ExternCall
from aotforge.compiler.passes import pooling
from aotforge.compiler.schedule import KernelGroup, KernelPlan
from aotforge.compiler.schedule.memory import Allocation, MemoryPlan, live_bytes
from aotforge.compiler.schedule.reads import kernel_shape
from aotforge.config import config

from ..helpers import trace


def _compiled(fn, *args):
    """Compile ``fn`` for the Triton path, run it on copies of ``args`` and compare outputs and
    inputs (never written over) with eager's; returns the CompiledGraph."""
    gm = trace(fn, *args)
    with config.patch(triton_on_cpu=True):
        compiled = compile_fx_inner(gm, list(args))
    copies = [a.clone() for a in args]
    outputs = compiled(list(copies))
    for actual, wanted in zip(outputs, fn(*args)):
        torch.testing.assert_close(actual, wanted)
    for copy, original in zip(copies, args):
        torch.testing.assert_close(copy, original, rtol=0, atol=0)
    return compiled.compiled_graph


def _peak(graph, memory: MemoryPlan = None) -> int:
    return max(live_bytes(graph.lowered, graph.kernel_plan, memory or graph.memory_plan))


def _without_reuse(memory: MemoryPlan) -> MemoryPlan:
    """The same plan with every buffer allocated fresh and deleted after its last use."""
    allocations = {i: tuple(Allocation(a.buffer) for a in made) for i, made in memory.allocations.items()}
    frees = {}
    for index in set(memory.frees) | set(memory.kept):
        frees[index] = memory.frees.get(index, ()) + memory.kept.get(index, ())
    return dataclasses.replace(memory, allocations=allocations, frees=frees, kept={})


# --- a ResNet bottleneck, inference ---------------------------------------------------------

def _batch_norm(x, stats):
    mean, var, weight, bias = stats
    return F.batch_norm(x, mean, var, weight, bias, training=False)


def _block(x, weights, stats, downsample=None):
    """conv 1x1 (to the narrow width) -> bn -> relu -> conv 3x3 -> bn -> relu -> conv 1x1 ->
    bn, plus the input (or its 1x1 convolution and bn), relu."""
    identity = x if downsample is None else _batch_norm(F.conv2d(x, downsample[0]), downsample[1])
    y = F.relu(_batch_norm(F.conv2d(x, weights[0]), stats[0]))
    y = F.relu(_batch_norm(F.conv2d(y, weights[1], padding=1), stats[1]))
    y = _batch_norm(F.conv2d(y, weights[2]), stats[2])
    return F.relu(y + identity)


def _stats(channels):
    return (torch.randn(channels, dtype=torch.float64), torch.rand(channels, dtype=torch.float64) + 0.5,
            torch.randn(channels, dtype=torch.float64), torch.randn(channels, dtype=torch.float64))


def _two_bottlenecks(x, *flat):
    w = flat[:7]  # block 1: three convolutions and the downsample; block 2: three convolutions
    s = [flat[7 + 4 * i:11 + 4 * i] for i in range(7)]  # the statistics of the seven batch norms
    y = _block(x, w[0:3], s[0:3], downsample=(w[3], s[3]))
    return (_block(y, w[4:7], s[4:7]),)


def _bottleneck_inputs(batch=2, size=8, inputs=8, width=4, out=16):
    f64 = dict(dtype=torch.float64)
    weights = [torch.randn(width, inputs, 1, 1, **f64), torch.randn(width, width, 3, 3, **f64),
               torch.randn(out, width, 1, 1, **f64), torch.randn(out, inputs, 1, 1, **f64),
               torch.randn(width, out, 1, 1, **f64), torch.randn(width, width, 3, 3, **f64),
               torch.randn(out, width, 1, 1, **f64)]
    stats = [t for c in (width, width, out, out, width, width, out) for t in _stats(c)]
    return [torch.randn(batch, inputs, size, size, **f64)] + weights + stats


def test_bottlenecks_write_batch_norm_and_relu_over_the_convolution_outputs():
    graph = _compiled(_two_bottlenecks, *_bottleneck_inputs())
    plan = str(graph.memory_plan)
    # every batch norm (+ relu, + residual add) kernel writes over a convolution's output
    kernels = [line for line in plan.splitlines() if line.startswith("kernel")]
    assert len(kernels) == 6 and all("(in place)" in line for line in kernels), plan
    # the peak is one block's output (or downsample), a narrow activation and the last
    # convolution's output: 2 wide + 1 narrow buffers. Without in-place writes the residual
    # kernel holds three wide buffers; if the second block recomputed the first one's output
    # from its two convolution outputs, those would stay alive through the second block.
    wide, narrow = 2 * 16 * 8 * 8 * 8, 2 * 4 * 8 * 8 * 8  # float64
    assert _peak(graph) == 2 * wide + narrow
    assert _peak(graph, _without_reuse(graph.memory_plan)) == 3 * wide


def test_the_plan_prints_in_place_writes_and_frees_outputs_nobody_reads(monkeypatch):
    # max pooling runs as an ATen call that also returns the indices, which inference never reads
    # (with the pooling's taps as a kernel off: passes/pooling.py)
    monkeypatch.setattr(pooling, "POINTWISE_POOL_DEVICES", ())
    fn = lambda x, w: (F.max_pool2d(F.relu(F.conv2d(x, w, padding=1)), 2),)
    graph = _compiled(fn, torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.randn(4, 3, 3, 3, dtype=torch.float64))
    assert str(graph.kernel_plan) == """\
extern0: aten.convolution.default -> buf0
kernel0: pointwise x=512: buf1 (stored)
extern1: aten.max_pool2d_with_indices.default -> buf2, buf3
"""
    assert str(graph.memory_plan) == """\
extern0: after: free w_1, x_1
kernel0: allocate buf1 in buf0's memory (in place); after: free buf0
extern1: after: free buf1, buf3
"""
    assert "    buf1 = reinterpret_tensor(buf0, (2, 4, 8, 8), (256, 64, 8, 1), 0)  # in place\n" \
           "    kernel0.run(buf0, buf1)\n    del buf0\n" in graph.program.source


def test_relu_writes_over_a_training_batch_norm_s_output():
    """The outputs of an ATen call of several outputs that allocates each on its own (a training
    BatchNorm: output, saved mean and rstd, new running stats) may be written over once dead, as
    eager's ``relu_`` writes over BatchNorm's output; the running stats, read later, are not."""
    def fn(x, weight, bias, mean, var):
        out, save_mean, save_rstd, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional(
            x, weight, bias, mean, var, True, 0.1, 1e-5)
        return (F.relu(out) * 2, save_mean, save_rstd, new_mean + 1, new_var)

    c = 4
    graph = _compiled(fn, torch.randn(2, c, 5, 5, dtype=torch.float64), torch.randn(c, dtype=torch.float64),
                      torch.randn(c, dtype=torch.float64), torch.randn(c, dtype=torch.float64),
                      torch.rand(c, dtype=torch.float64) + 0.5)
    assert str(graph.memory_plan) == """\
extern0: after: free bias_1, mean_1, var_1, weight_1, x_1
kernel0: allocate buf5 in buf0's memory (in place); after: free buf0
kernel1: allocate buf6 in buf3's memory (in place); after: free buf3
"""


def test_released_memory_is_kept_for_a_later_buffer_when_no_aten_call_allocates_between():
    def fn(x, w, y):
        s = (x @ w).sum(0)  # buf0 (the product) dies in the column sum's kernel
        return (torch.sigmoid(y) @ w, y * s)

    graph = _compiled(fn, *(torch.randn(4, 4, dtype=torch.float64) for _ in range(3)))
    assert str(graph.memory_plan) == """\
extern0: after: free x_1
kernel0: allocate buf1; after: free buf0 (kept)
kernel1: allocate buf2 in buf0's memory, buf4; after: free buf1, y_1
extern1: after: free buf2, w_1
"""


def test_memory_is_not_kept_across_an_aten_call_that_allocates():
    def fn(x, w):
        r = (x @ w).sum(1)  # the product dies in the row sum's kernel
        z = x @ x  # this call's output could take the product's memory: it is not held past it
        return (torch.sigmoid(z.t()) * r,)  # a new 4x4 buffer (not in place: z is read transposed)

    graph = _compiled(fn, *(torch.randn(4, 4, dtype=torch.float64) for _ in range(2)))
    assert str(graph.memory_plan) == """\
extern0: after: free w_1
kernel0: allocate buf1; after: free buf0
extern1: after: free x_1
kernel1: allocate buf3; after: free buf1, buf2
"""


def test_no_in_place_write_over_a_buffer_read_elsewhere_than_the_element_written():
    def fn(x, w):
        a = x @ w
        # reads a's rows in reverse: element i is written before it is read (a transposed read
        # no longer makes the hazard: a matmul operand is stored in its read's order)
        return ((a.flip(0) * 2) @ w,)

    graph = _compiled(fn, torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    assert "in place" not in str(graph.memory_plan)


def test_no_in_place_write_over_a_buffer_another_kernel_member_reads():
    def fn(x, w):
        a = x @ w
        return (torch.sin(a) @ w, torch.cos(a) @ w)  # one kernel computes both from a

    graph = _compiled(fn, torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    assert "in place" not in str(graph.memory_plan)


def test_graph_inputs_and_other_dtypes_are_never_written_over():
    def fn(x, w):
        a = x @ w
        return (torch.relu(x) @ w, (a * 2).to(torch.float32))  # x is the caller's; a is float64

    graph = _compiled(fn, torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))
    assert "in place" not in str(graph.memory_plan) and "'s memory" not in str(graph.memory_plan)


def _one_kernel_per_buffer(lowered, reads) -> KernelPlan:
    """A plan without fusion: each computed buffer in a kernel of its own, stored."""
    steps = [op if isinstance(op, ExternCall) else KernelGroup(f"kernel{i}", *kernel_shape(op), (op,))
             for i, op in enumerate(lowered.operations)]
    return KernelPlan(tuple(steps), frozenset(op.name for op in lowered.operations if not isinstance(op, ExternCall)))


def test_memory_written_over_in_place_is_given_to_no_other_buffer(monkeypatch):
    monkeypatch.setattr(pipeline, "fuse", _one_kernel_per_buffer)
    # sin(x @ w) is written over the product; cos(y), a buffer of the same size made by the
    # next kernel, must not get the product's memory too (it would write over sin's values)
    fn = lambda x, w, y: (torch.sin(x @ w), torch.cos(y))
    graph = _compiled(fn, *(torch.randn(4, 4, dtype=torch.float64) for _ in range(3)))
    assert str(graph.memory_plan) == """\
extern0: after: free w_1, x_1
kernel1: allocate buf1 in buf0's memory (in place); after: free buf0
kernel2: allocate buf2; after: free y_1
"""
    assert _peak(graph) == 2 * 4 * 4 * 8
