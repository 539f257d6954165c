"""torch.compile backends: found by name without ``import aotforge`` (entry points), ``mode=``
and ``options=``, CPU graphs run un-decomposed (never slower than eager)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path below runs on the CPU

import pytest
import torch

import aotforge
from aotforge import backends
from aotforge.config import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(aotforge.__file__)))


def _run_fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter that loads this checkout's aotforge (not another copy)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)


# The model, eager and compiled, in float64: outputs and gradients must agree exactly.
_COMPARE = """
    def check(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).double()
        reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).double()
        reference.load_state_dict(model.state_dict())
        x = torch.randn(2, 4, dtype=torch.float64)
        out = torch.compile(model, backend=backend)(x)
        expected = reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.sum().backward(); expected.sum().backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
"""


@pytest.mark.parametrize("backend", ["aotforge", "aotforge_eager"])
def test_backend_by_name_in_a_fresh_process_without_import(backend):
    result = _run_fresh(f"""
        import sys
        from importlib.metadata import entry_points
        import torch
        names = entry_points(group="torch_dynamo_backends").names
        assert "{backend}" in names, "aotforge is not installed (pip install -e .): no entry point"
        {textwrap.indent(textwrap.dedent(_COMPARE), "        ").strip()}
        assert "aotforge" not in sys.modules
        check("{backend}")
        assert sys.modules["aotforge"].__file__.startswith({REPO!r})
        print("OK")
    """)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_backend_by_name_after_list_backends_then_import():
    # Dynamo discovers the entry points first, then the user imports aotforge, then compiles:
    # the import must not register the names a second time (Dynamo's "duplicate name").
    result = _run_fresh(f"""
        import torch, torch._dynamo
        {textwrap.indent(textwrap.dedent(_COMPARE), "        ").strip()}
        assert "aotforge" in torch._dynamo.list_backends()
        assert "aotforge_eager" in torch._dynamo.list_backends()
        import aotforge
        check("aotforge"); check("aotforge_eager")
        aotforge.backends.register_backends()   # a second call is harmless too
        check("aotforge")
        print("OK")
    """)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_backend_by_name_with_import_first():
    result = _run_fresh(f"""
        import aotforge, torch
        {textwrap.indent(textwrap.dedent(_COMPARE), "        ").strip()}
        check("aotforge"); check("aotforge_eager")
        print("OK")
    """)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# --- mode= and options= --------------------------------------------------------------------

def _spy_eager_compiler(monkeypatch) -> list:
    """Record the config each graph compiler of the CPU route sees (forward and backward)."""
    from aotforge.aot import boxing

    seen = []
    real = boxing.boxed_nop

    def spy(gm, example_inputs):
        seen.append({"autotune": config.autotune, "budget": config.activation_memory_budget})
        return real(gm, example_inputs)

    spy._boxed_call = True
    monkeypatch.setattr(boxing, "boxed_nop", spy)
    return seen


def _train_step(compiled, model):
    torch.manual_seed(1)
    x = torch.randn(3, 4, dtype=torch.float64)
    out = compiled(x)
    expected = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()


@pytest.mark.parametrize("mode, autotune", [
    ("default", False), ("max-autotune", True), ("max-autotune-no-cudagraphs", True),
])
def test_mode_maps_to_config_for_this_compile_only(mode, autotune, monkeypatch):
    torch._dynamo.reset()
    seen = _spy_eager_compiler(monkeypatch)
    model = torch.nn.Linear(4, 2).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for these modes
        _train_step(torch.compile(model, backend="aotforge", mode=mode), model)
    assert [s["autotune"] for s in seen] == [autotune, autotune]  # forward and backward
    assert config.autotune is False  # nothing left behind


def test_reduce_overhead_turns_on_cuda_graphs_and_says_once_that_cpu_has_none(monkeypatch):
    from aotforge.compiler.runtime import cudagraphs

    assert backends.config_patches("reduce-overhead", None) == {"cudagraphs": True}
    monkeypatch.setattr(cudagraphs, "_warned", set())
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 2).double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aotforge", mode="reduce-overhead")
        _train_step(compiled, model)
        _train_step(compiled, model)
    messages = [str(w.message) for w in caught if "CUDA graphs" in str(w.message)]
    assert messages == ["aotforge: CUDA graphs (mode='reduce-overhead', aotforge.config.cudagraphs) have nothing "
                        "to do for graphs on the CPU; they run as compiled"]


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown torch.compile mode 'fastest'.*max-autotune"):
        backends.config_patches("fastest", None)


def test_options_patch_config_for_that_compile_only(monkeypatch):
    torch._dynamo.reset()
    seen = _spy_eager_compiler(monkeypatch)
    model = torch.nn.Linear(4, 2).double()
    compiled = torch.compile(model, backend="aotforge",
                             options={"activation_memory_budget": 0.25, "autotune": True})
    _train_step(compiled, model)
    assert seen == [{"autotune": True, "budget": 0.25}] * 2  # the later backward too
    assert config.activation_memory_budget == 1.0 and config.autotune is False
    # A second model compiled without options sees the defaults.
    torch._dynamo.reset()
    seen.clear()
    other = torch.nn.Linear(4, 2).double()
    _train_step(torch.compile(other, backend="aotforge_eager"), other)
    assert seen == [{"autotune": False, "budget": 1.0}] * 2


def test_unknown_option_gets_config_patch_error():
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 2)
    with pytest.raises(Exception, match=r"no option\(s\) \['not_an_option'\].*known options"):
        torch.compile(model, backend="aotforge", options={"not_an_option": 1})(torch.randn(2, 4))
    with pytest.raises(AttributeError, match=r"no option\(s\) \['not_an_option'\]"):
        backends.config_patches(None, {"not_an_option": 1})


def test_options_reach_the_compiler_on_the_triton_path(monkeypatch):
    # With triton_on_cpu the graph takes the code-generating route (what CUDA tensors take).
    import aotforge.compiler as compiler

    seen = []
    real = compiler.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((kwargs.get("is_backward", False), config.autotune, config.persistent_reduction_limit))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compiler, "compile_fx_inner", spy)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.GELU()).double()
    compiled = torch.compile(model, backend="aotforge", mode="max-autotune",
                             options=None)
    with config.patch(triton_on_cpu=True):
        _train_step(compiled, model)
    assert [entry[1] for entry in seen] == [True, True]
    torch._dynamo.reset()
    seen.clear()
    compiled = torch.compile(model, backend="aotforge", options={"triton_on_cpu": True,
                                                                 "persistent_reduction_limit": 64})
    _train_step(compiled, model)
    assert [(entry[0], entry[2]) for entry in seen] == [(False, 64), (True, 64)]


# --- CPU graphs: un-decomposed, said once --------------------------------------------------

def test_cpu_graphs_run_undecomposed_and_the_log_says_why(monkeypatch, capfd):
    from aotforge import debug

    monkeypatch.setenv("AOTFORGE_LOG", "compile")
    monkeypatch.setattr(debug, "_logged_once", set())
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).double()
    compiled = torch.compile(model, backend="aotforge")
    _train_step(compiled, model)
    _train_step(compiled, model)
    err = capfd.readouterr().err
    assert err.count("run un-decomposed") == 1, err
    report = aotforge.inspect(compiled)
    forward = report.records[0].graphs["forward"]
    targets = {str(n.target) for n in forward.graph.nodes if n.op == "call_function"}
    # Eager's fused kernels stay whole: no decomposition into pointwise ATen ops.
    assert any("native_layer_norm" in t for t in targets), targets
    assert any("gelu" in t for t in targets), targets
    assert all(part.compiled_graph is None for part in report.records[0].compiled.values())
