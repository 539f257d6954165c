"""compile_fx, the torch.compile backend: graph normalizations around AOT autograd."""
from __future__ import annotations

import threading

import pytest
import torch

import aotforge  # noqa: F401  (registers the backends)
from aotforge.compiler import compile_fx, compile_fx_inner, observe
from aotforge.config import config



def test_graph_returning_a_single_tensor():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    x = torch.randn(5, dtype=torch.float64)
    with config.patch(triton_on_cpu=True):
        out = compile_fx(gm, [x])(x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, torch.relu(x) * 2)


def test_nested_list_inputs_are_flattened():
    class Model(torch.nn.Module):
        def forward(self, pair, y):
            return (pair[0] * pair[1] + y,)
    x = [torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    y = torch.randn(3, dtype=torch.float64)
    with config.patch(triton_on_cpu=True):
        out = compile_fx(Model(), [x, y])(x, y)
    torch.testing.assert_close(out[0], x[0] * x[1] + y)


def test_pytree_codegen_from_dynamo_export():
    def fn(inputs):
        return {"sum": inputs["a"] + inputs["b"], "prod": inputs["a"] * inputs["b"]}
    inputs = {"a": torch.randn(4, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    gm, _ = torch._dynamo.export(fn)(inputs)
    with config.patch(triton_on_cpu=True):
        out = compile_fx(gm, [inputs])(inputs)
    torch.testing.assert_close(out["sum"], inputs["a"] + inputs["b"])
    torch.testing.assert_close(out["prod"], inputs["a"] * inputs["b"])


def test_config_patches_apply_while_compiling_and_running():
    gm = torch.fx.symbolic_trace(lambda x: (x.exp(),))
    x = torch.randn(4, dtype=torch.float64)
    with observe() as graphs:
        out = compile_fx(gm, [x], config_patches={"triton_on_cpu": True})(x)
    assert [g.path for g in graphs] == ["triton"]
    torch.testing.assert_close(out[0], x.exp())


def test_config_patches_apply_to_the_backward_compiled_later():
    gm = torch.fx.symbolic_trace(lambda x: (x.exp() * x,))
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with observe() as graphs:
        compiled = compile_fx(gm, [x], config_patches={"triton_on_cpu": True})
        out = compiled(x)
        assert not config.triton_on_cpu  # the patch does not outlive the call
        out[0].sum().backward()  # the backward graph compiles here, outside any patch
    assert [(g.kind, g.path) for g in graphs] == [("forward", "triton"), ("backward", "triton")]
    torch.testing.assert_close(x.grad, x.exp() * (x + 1))


def test_config_patches_apply_to_a_backward_compiled_lazily_in_another_thread(monkeypatch):
    """Where the backward compiles at the first backward call (the AOT layer's default), it
    compiles after compile_fx returned, possibly in autograd's device thread: the patches
    must reach it there."""
    import aotforge.aot
    from aotforge.compiler import pipeline

    simplified = aotforge.aot.aot_module_simplified
    monkeypatch.setattr(pipeline, "aot_module_simplified",
                        lambda *args, **kwargs: simplified(*args, **dict(kwargs, compile_backward_now=False)))
    gm = torch.fx.symbolic_trace(lambda x: (x.exp() * x,))
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with observe() as graphs:
        (out,) = compile_fx(gm, [x], config_patches={"triton_on_cpu": True})(x)
        assert [g.kind for g in graphs] == ["forward"]  # the backward is not compiled yet
        thread = threading.Thread(target=lambda: out.sum().backward())
        thread.start()
        thread.join()
    assert [(g.kind, g.path) for g in graphs] == [("forward", "triton"), ("backward", "triton")]
    torch.testing.assert_close(x.grad, x.detach().exp() * (x.detach() + 1))


def test_config_patches_do_not_leak_into_other_threads():
    """While one thread compiles under config_patches, another thread sees the global
    configuration, and its own compile (which waits for the first: compiles are serialized
    by the AOT layer's trace lock) keeps the global path."""
    inside = threading.Event()
    other_done = threading.Event()
    seen = {}

    def held_compile(gm, example_inputs, **kwargs):  # holds the patched compile open
        inside.set()
        assert other_done.wait(timeout=120)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def patched():
        gm = torch.fx.symbolic_trace(lambda x: (x.exp(),))
        x = torch.randn(4, dtype=torch.float64)
        seen["patched"] = compile_fx(gm, [x], inner_compile=held_compile, config_patches={"triton_on_cpu": True})(x)

    def other():
        assert inside.wait(timeout=120)
        try:
            seen["other_flag"] = config.triton_on_cpu
        finally:
            other_done.set()
        gm = torch.fx.symbolic_trace(lambda x: (x.cos(),))
        seen["other"] = compile_fx(gm, [torch.randn(4, dtype=torch.float64)])

    with observe() as graphs:
        threads = [threading.Thread(target=patched), threading.Thread(target=other)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert seen["other_flag"] is False and "other" in seen and "patched" in seen
    # the patched graph (exp) went through Triton, the other (cos) kept the global path (C++)
    assert sorted(g.path for g in graphs) == ["cpp", "triton"]
    (triton_graph,) = [g for g in graphs if g.path == "triton"]
    assert "exp" in triton_graph.kernel_source and "cos" not in triton_graph.kernel_source


def test_unknown_config_patch_is_rejected_at_once():
    gm = torch.fx.symbolic_trace(lambda x: (x.exp(),))
    with pytest.raises(AttributeError, match="no option"):
        compile_fx(gm, [torch.randn(4)], config_patches={"no_such_option": 1})


def test_backend_registered_with_torch_compile():
    torch._dynamo.reset()
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    with config.patch(triton_on_cpu=True), observe() as graphs:
        out = torch.compile(lambda x: (x.sin() * x).sum(), backend="aotforge")(x)
        out.backward()
    torch.testing.assert_close(x.grad, x.sin() + x * x.cos())
    assert [(g.kind, g.path) for g in graphs] == [("forward", "triton"), ("backward", "triton")]


def test_the_backends_partitioner_serves_aot_function_without_arguments():
    """benchmarks/gpu_compiler.py builds aot_function with the backend's partitioner."""
    from aotforge.aot.boxing import nop
    from aotforge.compiler.pipeline import partitioner

    def fn(x, w):
        return (torch.tanh(x @ w) * x.sum()).exp().sum(0)

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    compiled = aotforge.aot_function(fn, fw_compiler=nop, bw_compiler=nop, partition_fn=partitioner())
    out = compiled(x, w)
    out.sum().backward()
    expected_x, expected_w = torch.autograd.grad(fn(x, w).sum(), (x, w))
    torch.testing.assert_close(out, fn(x, w))
    torch.testing.assert_close((x.grad, w.grad), (expected_x, expected_w))
