"""The wrapper's allocation and view fast paths (torch's C++ helpers for compiled code, past
the dispatcher) and the device guard a GPU graph runs under. The GPU graphs are traced with
fake CUDA tensors and printed, not run (no GPU here; tests/gpu runs them)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from aotforge.compiler.codegen.kernel import emit_kernels
from aotforge.compiler.codegen.triton import TritonPrinter
from aotforge.compiler.codegen.wrapper import emit_wrapper
from aotforge.compiler.lowering import lower
from aotforge.compiler.runtime import launch
from aotforge.compiler.schedule import analyze_reads, fuse, plan_memory


def _program(fn, *devices):
    with FakeTensorMode(allow_non_fake_inputs=True):
        gm = make_fx(fn)(*[torch.empty(8, 8, device=device) for device in devices])
    lowered = lower(gm)
    reads = analyze_reads(lowered)
    plan = fuse(lowered, reads)
    memory = plan_memory(lowered, plan, reads)
    program = emit_wrapper(lowered, plan, memory, emit_kernels(lowered, plan, reads, TritonPrinter()))
    compile(program.source, "<wrapper>", "exec")  # valid Python, guard and all
    return program.source


def _two_kernels(x):
    y = x.sin() @ x  # a buffer for the kernel before the matmul
    return (y.cos().sum(0),)


def test_a_gpu_graph_allocates_on_the_fast_path_under_its_device_guard():
    source = _program(_two_kernels, "cuda:1")
    lines = source.splitlines()
    assert lines[0] == "def call(args):" and lines[1] == "    with torch.cuda._DeviceGuard(1):"
    assert all(line.startswith("        ") for line in lines[2:])  # the whole body is guarded
    assert "empty_strided_cuda((8, 8), (8, 1), torch.float32)" in source
    assert "device=" not in source


def test_a_cpu_graph_allocates_on_the_fast_path_without_a_guard():
    source = _program(_two_kernels, "cpu")
    assert "empty_strided_cpu((8, 8), (8, 1), torch.float32)" in source
    assert "_DeviceGuard" not in source


def test_a_graph_on_two_gpus_names_each_allocation_s_device():
    def f(x, y):
        return (x.sin() @ x, y.sin() @ y)

    source = _program(f, "cuda:0", "cuda:1")
    assert "_DeviceGuard" not in source and "empty_strided_cuda" not in source
    assert "empty_strided((8, 8), (8, 1), device=device_0" in source
    assert "empty_strided((8, 8), (8, 1), device=device_1" in source


def test_fast_helpers_make_what_the_aten_calls_make():
    made = launch.empty_strided_cpu((3, 4), (1, 3), torch.float64)
    assert (made.shape, made.stride(), made.dtype, made.device) == ((3, 4), (1, 3), torch.float64, torch.device("cpu"))
    base = torch.arange(20.0)[4:]  # a view with its own storage offset
    view = launch.reinterpret_tensor(base, (2, 3), (1, 2), 5)  # offset counts from base's data
    assert torch.equal(view, torch.as_strided(base, (2, 3), (1, 2), base.storage_offset() + 5))
    view.zero_()
    assert base[5:10].eq(0).all() and base[4] == 8.0 and base[11] == 15.0
