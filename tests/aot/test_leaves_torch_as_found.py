"""Each entry point leaves torch as it found it (issue 36): after aot_function, aot_module,
aot_module_simplified, the exports and the torch.compile backends return, the user's eager code
(torch.cond included, which runs through Dynamo even in eager) behaves as eager, and torch's
process-wide state (mode stacks, grad mode, dispatch keys, FX node meta, tracing context,
Dynamo's and FX's configs) is what it was.

The leak this pins: aotforge's metadata collection ran with a dispatch mode that Dynamo counts
as "the user's", so the torch.compile that torch.cond uses in eager skipped its frame and
marked the code object "skip" for the rest of the process; every later eager torch.cond then
failed (``torch.* op returned non-Tensor``, ``CondOp.gen_schema``).
"""
from __future__ import annotations

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.utils._python_dispatch as python_dispatch

import aotforge
from aotforge import aot_export_joint_simple, aot_export_module, aot_function, aot_module, nop
from aotforge.aot import aot_module_simplified


def _config(module_name: str):
    import importlib

    try:
        return importlib.import_module(module_name).get_config_copy()
    except (ImportError, AttributeError):
        return None


def _torch_state() -> dict:
    """The process-wide torch state an entry point could leave changed behind it."""
    eval_frame = torch._C._dynamo.eval_frame
    return {
        "dispatch mode stack": torch._C._len_torch_dispatch_stack(),
        "function mode stack": torch._C._len_torch_function_stack(),
        "in dispatch mode flags": [getattr(python_dispatch, name, None) for name in (
            "_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
            "_is_in_any_mode_without_ignore_compile_internals")],
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "dispatch keys included": str(torch._C._dispatch_tls_local_include_set()),
        "dispatch keys excluded": str(torch._C._dispatch_tls_local_exclude_set()),
        "fx node meta": (fx_traceback.has_preserved_node_meta(), dict(fx_traceback.get_current_meta())),
        "tracing context": torch._guards.TracingContext.try_get(),
        "dynamo callback": getattr(eval_frame, "get_eval_frame_callback", lambda: None)(),
        "dynamo config": _config("torch._dynamo.config"),
        "fx config": _config("torch.fx.experimental._config"),
        "default dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "functionalization reapplies views": torch._C._functionalization_reapply_views_tls(),
        "autograd fallback": getattr(torch._C, "_get_autograd_fallback_mode", lambda: None)(),
        "saved tensor hooks": getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)(False),
    }


def _branching(x):
    # torch.cond inside the traced code: tracing it is what marked torch's code "skip"
    y = torch.nn.functional.dropout(x, 0.25) * 2  # a random op: the RNG concern's watcher runs
    return torch.cond(y.sum() > 0, lambda t: t.cos(), lambda t: t.sin(), [y])


class _Branching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        return (_branching(self.linear(x)),)


class _SumLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return (self.model(x).sum(),)


def _x(requires_grad=True):
    return torch.randn(3, 4, dtype=torch.float64, requires_grad=requires_grad)


def _dynamo_graph():
    gm = torch.fx.symbolic_trace(lambda x: (torch.sin(x) * 2,))
    return gm, [_x()]


def _run_aot_function():
    aot_function(_branching, nop)(_x()).sum().backward()


def _run_aot_function_inference():
    aot_function(_branching, nop)(_x(requires_grad=False))


def _run_aot_module():
    aot_module(_Branching(), nop)(_x())[0].sum().backward()


def _run_aot_module_simplified():
    gm, args = _dynamo_graph()
    aot_module_simplified(gm, args, fw_compiler=nop, bw_compiler=nop)(*args)[0].sum().backward()


def _run_export():
    aot_export_module(_Branching(), (_x(False),), trace_joint=False)


def _run_export_dynamic():
    aot_export_module(_Branching(), (_x(False),), trace_joint=False, dynamic_shapes=True)


def _run_export_joint():
    model = torch.nn.Sequential(torch.nn.Linear(4, 1, dtype=torch.float64))
    aot_export_module(_SumLoss(model), (_x(False),), trace_joint=True, output_loss_index=0)


def _run_export_joint_simple():
    aot_export_joint_simple(lambda x: (_branching(x),), [_x(False)], trace_joint=False)


def _run_backend(name):
    def run():
        with aotforge.config.patch(cpu_codegen=False):
            torch.compile(_Branching(), backend=name, fullgraph=True)(_x())[0].sum().backward()
    return run


ENTRY_POINTS = {
    "aot_function": _run_aot_function,
    "aot_function_inference": _run_aot_function_inference,
    "aot_module": _run_aot_module,
    "aot_module_simplified": _run_aot_module_simplified,
    "aot_export_module": _run_export,
    "aot_export_module_dynamic": _run_export_dynamic,
    "aot_export_module_joint": _run_export_joint,
    "aot_export_joint_simple": _run_export_joint_simple,
    "backend_aotforge_eager": _run_backend("aotforge_eager"),
    "backend_aotforge": _run_backend("aotforge"),
}


def _eager_code_behaves_as_eager():
    """The user's eager code after the entry point: torch.cond both ways (with gradients), a
    torch.compile of the user's own and plain autograd, each compared with the same
    computation written without them."""
    for sign in (1.0, -1.0):
        x = (sign * torch.rand(5, dtype=torch.float64)).requires_grad_()
        reference = x.detach().clone().requires_grad_()
        out = torch.cond(x.sum() > 0, lambda t: t.cos(), lambda t: t.sin(), [x])
        expected = reference.cos() if sign > 0 else reference.sin()
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(x.grad, reference.grad)
    x = torch.rand(4, dtype=torch.float64)

    def user_fn(t):
        return torch.nn.functional.gelu(t) + 1

    torch.testing.assert_close(torch.compile(user_fn, backend="eager", fullgraph=True)(x), user_fn(x))


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
def test_eager_code_after_an_entry_point_behaves_as_eager(entry_point):
    before = _torch_state()
    ENTRY_POINTS[entry_point]()
    after = _torch_state()
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    assert not changed, f"{entry_point} left torch changed: {changed}"
    _eager_code_behaves_as_eager()
