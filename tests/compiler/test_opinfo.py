"""Op coverage from PyTorch's OpInfo database: every op with a lowering goes through
``aot_function`` + ``compile_fx_inner`` (Triton kernels run by the interpreter) and must equal
eager, forward and (where differentiable) backward, in float32 and float64.

The coverage table (which ATen ops were lowered, which fell back to ATen externs) is printed
at the end of the module."""
from __future__ import annotations

import collections
import functools
import sys

import pytest
import torch
import torch.utils._pytree as pytree

import aotforge
from aotforge.compiler import compile_fx_inner, select_decomposition_table
from aotforge.config import config

common_methods_invocations = pytest.importorskip("torch.testing._internal.common_methods_invocations")
op_db = common_methods_invocations.op_db

# OpInfo names tested: ops whose ATen ops (after our decompositions) have lowerings, plus a few
# that partly run as ATen externs (scans, scatters); the printed table says which is which
TESTED_OPS = [
    "abs", "acos", "acosh", "add", "amax", "amin", "any", "all", "argmax", "argmin", "asin", "asinh", "atan",
    "atan2", "atanh", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "cat", "ceil", "clamp",
    "clamp_max", "clamp_min", "clone", "constant_pad_nd", "cos", "cosh", "diagonal", "div", "eq", "erf",
    "erfc", "erfinv", "exp", "exp2", "expand", "expm1", "flatten", "floor", "floor_divide", "fmod", "gather",
    "ge", "gt", "index_select", "isinf", "isnan", "le", "lerp", "lgamma", "log", "log10", "log1p", "log2",
    "log_softmax", "logical_and", "logical_not", "logical_or", "logical_xor", "lt", "masked_fill", "max",
    "maximum", "mean", "min", "minimum", "mul", "narrow", "ne", "neg", "nn.functional.batch_norm",
    "nn.functional.elu", "nn.functional.embedding", "nn.functional.gelu", "nn.functional.hardtanh",
    "nn.functional.layer_norm", "nn.functional.leaky_relu", "nn.functional.mse_loss", "nn.functional.pad",
    "nn.functional.relu", "nn.functional.rms_norm", "nn.functional.silu", "nn.functional.softplus",
    "permute", "pow", "prod", "reciprocal", "remainder", "reshape", "round", "rsqrt", "rsub", "select",
    "sigmoid", "sign", "sin", "sinh", "softmax", "split", "sqrt", "square", "squeeze", "std", "sub", "sum",
    "t", "tan", "tanh", "transpose", "true_divide", "trunc", "unbind", "unsqueeze", "var", "var_mean", "view",
    "where", "_softmax_backward_data", "flip", "repeat", "addcmul", "addcdiv", "logsumexp", "tril", "triu",
    "nn.functional.hardsigmoid", "nn.functional.hardswish", "nn.functional.mish", "nn.functional.cross_entropy",
    "nn.functional.nll_loss", "nn.functional.group_norm", "nn.functional.softmin", "masked_fill", "nan_to_num",
    "index_add", "select_scatter", "slice_scatter", "scatter_add", "stack", "hstack", "roll", "full_like",
    "zeros_like", "ones_like", "new_zeros", "nn.functional.glu", "nn.functional.logsigmoid", "frac", "deg2rad",
    "hypot", "logaddexp", "xlogy", "sgn", "square", "erfinv", "special.erfcx", "aminmax", "cumsum",
    "__getitem__", "take_along_dim", "movedim", "expand_as", "broadcast_to", "nn.functional.threshold",
    "nn.functional.relu6", "nn.functional.selu", "nn.functional.celu", "nn.functional.softsign",
    "nn.functional.tanhshrink", "nn.functional.hardshrink", "nn.functional.softshrink", "logit", "sinc",
    "fmax", "fmin", "copysign", "heaviside", "isfinite", "isneginf", "isposinf", "nn.functional.kl_div",
    "nn.functional.smooth_l1_loss", "nn.functional.l1_loss", "nn.functional.huber_loss",
    "nn.functional.binary_cross_entropy_with_logits", "nn.functional.cosine_similarity",
    "nn.functional.normalize", "linalg.vector_norm", "nansum", "count_nonzero", "std_mean",
    "nn.functional.avg_pool2d", "nn.functional.pixel_shuffle", "diag_embed", "nn.functional.instance_norm",
]
SAMPLES_PER_OP = {torch.float32: 1, torch.float64: 2}
DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-7, atol=1e-7)}

coverage = {"lowered": collections.Counter(), "fallback": collections.Counter()}


def _recording_compiler(gm, example_inputs, **kwargs):
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    stats = compiled.compiled_graph.stats
    coverage["lowered"].update(stats.get("lowered", {}))
    coverage["fallback"].update(stats.get("fallbacks", {}))
    assert not stats.get("lowering_errors"), stats.get("lowering_errors")
    return compiled


def _opinfos():
    by_name = {}
    for info in op_db:
        by_name.setdefault(info.name, info)
    return [by_name[name] for name in dict.fromkeys(TESTED_OPS) if name in by_name]


def _split_tensors(sample):
    """Flatten a sample into (tensor leaves, rebuild function)."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def rebuild(*tensors):
        filled = list(leaves)
        for position, tensor in zip(positions, tensors):
            filled[position] = tensor
        return pytree.tree_unflatten(filled, spec)
    return [leaves[i] for i in positions], rebuild


def _fresh(tensors):
    """Independent copies: in-place updates (batch norm's running stats) must not leak
    between the eager and the compiled run."""
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _float_outputs(out):
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


@pytest.mark.parametrize("target", ["triton", "cpp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("info", _opinfos(), ids=lambda info: info.name)
def test_op_matches_eager(info, dtype, target):
    """``target``: Triton's kernels in its interpreter, or the C++ kernels of the CPU target."""
    if dtype not in info.supported_dtypes("cpu"):
        pytest.skip(f"{info.name} does not support {dtype}")
    differentiable = info.supports_autograd and dtype.is_floating_point
    samples = list(info.sample_inputs("cpu", dtype, requires_grad=differentiable))[:SAMPLES_PER_OP[dtype]]
    checked = 0
    for sample in samples:
        tensors, rebuild = _split_tensors(sample)
        if not tensors:
            continue

        def fn(*inputs):
            value, args, kwargs = rebuild(*inputs)
            return info.op(value, *args, **kwargs)
        eager_inputs = _fresh(tensors)
        try:
            expected = fn(*eager_inputs)
        except Exception:
            continue  # a sample eager rejects says nothing about the compiler
        expected_outputs = _float_outputs(expected)
        compiled = aotforge.aot_function(fn, fw_compiler=_recording_compiler, bw_compiler=_recording_compiler,
                                         inference_compiler=_recording_compiler,
                                         decompositions=select_decomposition_table())
        tensors = _fresh(tensors)
        with config.patch(triton_on_cpu=target == "triton", cpu_codegen=True):
            try:
                actual = compiled(*tensors)
            except NotImplementedError as error:
                if not isinstance(error.__cause__, torch._subclasses.fake_tensor.DataDependentOutputException):
                    raise
                continue  # the op reads tensor data at trace time (narrow by a tensor): not traceable
        actual_outputs = _float_outputs(actual)
        assert len(actual_outputs) == len(expected_outputs)
        for a, e in zip(actual_outputs, expected_outputs):
            torch.testing.assert_close(a, e, **TOLERANCE[dtype], equal_nan=True,
                                       msg=lambda m: f"{info.name} forward: {m}")
        grad_inputs = [t for t in tensors if t.requires_grad]
        grad_outputs = [(a, e) for a, e in zip(actual_outputs, expected_outputs)
                        if e.requires_grad and e.dtype.is_floating_point]
        if differentiable and grad_inputs and grad_outputs:
            cotangents = [torch.randn_like(e) for _, e in grad_outputs]
            eager_grad_inputs = [t for t in eager_inputs if t.requires_grad]
            expected_grads = torch.autograd.grad([e for _, e in grad_outputs], eager_grad_inputs, cotangents,
                                                 allow_unused=True)
            with config.patch(triton_on_cpu=target == "triton", cpu_codegen=True):
                actual_grads = torch.autograd.grad([a for a, _ in grad_outputs], grad_inputs, cotangents,
                                                   allow_unused=True)
            for a, e in zip(actual_grads, expected_grads):
                if e is None:
                    continue
                torch.testing.assert_close(a, e, **TOLERANCE[dtype], equal_nan=True,
                                           msg=lambda m: f"{info.name} backward: {m}")
        checked += 1
    if not checked:
        pytest.skip("no usable sample")


def test_print_coverage_table():
    """The table of what the op tests above compiled (run last in this module). pytest shows
    it only when asked: `python -m pytest -s tests/compiler/test_opinfo.py` (or -rP)."""
    lines = ["", "aotforge compiler op coverage (ATen ops seen by compile_fx_inner in the OpInfo tests)",
             f"{'ATen op':50s} {'lowered':>8s} {'fallback':>9s}"]
    for name in sorted(set(coverage["lowered"]) | set(coverage["fallback"])):
        lines.append(f"{name:50s} {coverage['lowered'][name]:8d} {coverage['fallback'][name]:9d}")
    lines.append(f"{len(coverage['lowered'])} ops lowered, {len(coverage['fallback'])} ops fell back to ATen")
    print("\n".join(lines))
    if coverage["lowered"]:
        assert len(coverage["lowered"]) > 40


_ = functools
