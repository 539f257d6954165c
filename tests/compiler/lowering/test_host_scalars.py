"""CPU scalars (0-d CPU tensors) in GPU graphs: eager reads them as numbers, so a generated GPU
kernel must never get one as a pointer. Checked without a GPU: the graph is traced with fake
CUDA tensors and lowered, scheduled and printed (no launch)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from aotforge.compiler.codegen.kernel import emit_kernels
from aotforge.compiler.codegen.triton import TritonPrinter
from aotforge.compiler.codegen.wrapper import emit_wrapper
from aotforge.compiler.host_scalars import HOST_SCALAR_TO_DEVICE, host_scalar_to_device
from aotforge.compiler.lowering import lower
from aotforge.compiler.schedule import analyze_reads, fuse, plan_memory


def _compile_on_fake_cuda(fn, *shapes_and_devices):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty(shape, device=device, dtype=dtype) for shape, device, dtype in shapes_and_devices]
        gm = make_fx(fn)(*inputs)
    lowered = lower(gm)
    reads = analyze_reads(lowered)
    plan = fuse(lowered, reads)
    memory = plan_memory(lowered, plan, reads)
    kernels = emit_kernels(lowered, plan, reads, TritonPrinter())
    program = emit_wrapper(lowered, plan, memory, kernels)
    return lowered, kernels, program


def test_a_cpu_scalar_input_reaches_gpu_kernels_as_a_device_scalar():
    def f(t, s):
        return (t * s + 1).sin(), s + 1  # s + 1: CPU work in a GPU graph

    lowered, kernels, program = _compile_on_fake_cuda(
        f, ((8,), "cuda", torch.float32), ((), "cpu", torch.float32))
    copies = [op for op in lowered.operations if getattr(op, "op", None) is HOST_SCALAR_TO_DEVICE]
    assert len(copies) == 1 and copies[0].outputs[0].device.type == "cuda"
    # no kernel reads the CPU buffer; the CPU update runs as an ATen call on the CPU
    assert all("s_1" not in kernel.arguments for kernel in kernels)
    cpu_calls = [op for op in lowered.operations if getattr(op, "op", None) is torch.ops.aten.add.Tensor]
    assert len(cpu_calls) == 1 and cpu_calls[0].outputs[0].device.type == "cpu"
    assert "host_scalar_to_device" in str(program.namespace) or "host_scalar_to_device" in program.source


def test_a_cpu_scalar_read_twice_is_put_on_the_gpu_once():
    def f(t, s):
        return t * s, (t + s).cos()

    lowered, kernels, _ = _compile_on_fake_cuda(f, ((8,), "cuda", torch.float32), ((), "cpu", torch.float32))
    assert sum(getattr(op, "op", None) is HOST_SCALAR_TO_DEVICE for op in lowered.operations) == 1


def test_a_cpu_only_graph_is_untouched():
    def f(t, s):
        return t * s

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        gm = make_fx(f)(torch.empty(8), torch.empty(()))
    lowered = lower(gm)
    assert not any(getattr(op, "op", None) is HOST_SCALAR_TO_DEVICE for op in lowered.operations)


@pytest.mark.parametrize("value", [2.5, -3, True, 1e-3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_host_scalar_to_device_keeps_value_and_dtype(value, dtype):
    scalar = torch.tensor(value).to(dtype)
    out = host_scalar_to_device(scalar, torch.device("cpu"))
    assert out.dtype == dtype and out.dim() == 0
    assert torch.equal(out, scalar)
