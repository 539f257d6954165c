"""OpInfo ops with symbolic sizes: each op compiled once with ``dynamic=True`` through the
Triton path (Triton's interpreter on the CPU), run on several samples, equal to eager forward
and backward in float64. Every graph with symbolic sizes must get generated kernels (no
lowering errors) rather than running as ATen calls; each op's floating results are doubled
so that a kernel reads them (a view op alone compiles to no kernel)."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler.pipeline import observe
from aotforge.torch_versions import torch_at_least

from .test_opinfo import TOLERANCE, _float_outputs, _fresh, _split_tensors

common_methods_invocations = pytest.importorskip("torch.testing._internal.common_methods_invocations")

DYNAMIC_OPS = [
    "add", "mul", "sub", "div", "where", "exp", "log", "sigmoid", "tanh", "rsqrt", "pow", "clamp", "abs",
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "softmax", "log_softmax", "sum", "mean",
    "amax", "var", "std", "nn.functional.layer_norm", "nn.functional.rms_norm", "cat", "view", "reshape",
    "permute", "transpose", "squeeze", "unsqueeze", "select", "narrow", "split", "index_select",
    "nn.functional.embedding", "gather", "masked_fill", "nn.functional.cross_entropy",
    "flatten", "flip", "repeat", "tril", "argmax", "logsumexp", "nn.functional.mse_loss", "stack",
]
SAMPLES = 3
# Known gaps, by op: its graphs run as ATen calls (right values, no generated kernels).
RUN_AS_ATEN_FROM_2_15 = {
    "narrow": "narrow's length reaches the graph as a symbolic int s, and a tensor of "
    "length s gets contiguous strides with Max(1, s), which the compiler cannot print yet; "
    "torch 2.14 specialized the third sample's length 0 to a constant (that graph compiled), "
    "torch 2.15 keeps it symbolic",
}


def _opinfos():
    by_name = {}
    for info in common_methods_invocations.op_db:
        by_name.setdefault(info.name, info)
    return [by_name[name] for name in DYNAMIC_OPS if name in by_name]


@pytest.mark.parametrize("info", _opinfos(), ids=lambda info: info.name)
def test_op_with_symbolic_sizes_matches_eager(info):
    dtype = torch.float64
    differentiable = info.supports_autograd
    samples = [s for s in info.sample_inputs("cpu", dtype, requires_grad=differentiable)
               if all(t.numel() > 1 for t in _split_tensors(s)[0])][:SAMPLES]
    torch._dynamo.reset()
    checked, dynamic_graphs = 0, 0
    for sample in samples:
        tensors, rebuild = _split_tensors(sample)

        def fn(*inputs):
            value, args, kwargs = rebuild(*inputs)
            # a kernel reads the result: a view op's symbolic strides reach generated code
            return pytree.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                                   info.op(value, *args, **kwargs))
        eager_inputs = _fresh(tensors)
        try:
            expected = _float_outputs(fn(*eager_inputs))
        except Exception:
            continue  # a sample eager rejects says nothing about the compiler
        compiled = torch.compile(fn, backend="aotforge", dynamic=True, options={"triton_on_cpu": True})
        inputs = _fresh(tensors)
        with observe() as graphs:
            actual = _float_outputs(compiled(*inputs))
            assert len(actual) == len(expected)
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, **TOLERANCE[dtype], equal_nan=True)
            pairs = [(a, e) for a, e in zip(actual, expected) if e.requires_grad]
            grad_inputs = [t for t in inputs if t.requires_grad]
            if differentiable and pairs and grad_inputs:
                cotangents = [torch.randn_like(e) for _, e in pairs]
                expected_grads = torch.autograd.grad([e for _, e in pairs], [t for t in eager_inputs if t.requires_grad],
                                                     cotangents, allow_unused=True)
                actual_grads = torch.autograd.grad([a for a, _ in pairs], grad_inputs, cotangents, allow_unused=True)
                for a, e in zip(actual_grads, expected_grads):
                    if e is not None:
                        torch.testing.assert_close(a, e, **TOLERANCE[dtype], equal_nan=True)
        for graph in graphs:
            if graph.lowered is not None:
                assert not graph.stats["lowering_errors"], graph.stats["lowering_errors"]
                dynamic_graphs += graph.lowered.sizes.dynamic
        checked += 1
    if not checked:
        pytest.skip("no usable sample")
    if not dynamic_graphs and info.name in RUN_AS_ATEN_FROM_2_15 and torch_at_least("2.15"):
        pytest.xfail(RUN_AS_ATEN_FROM_2_15[info.name])  # values and gradients were checked above
    assert dynamic_graphs, "no graph was compiled with symbolic sizes"

