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
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-15)  # (fused C++ kernels: ulps)
        out.sum().backward(); expected.sum().backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-15)
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


@pytest.fixture
def aten_on_cpu(monkeypatch):
    """CPU graphs as their ATen calls (config.cpu_codegen off): what the notices below are about."""
    monkeypatch.setattr(config, "cpu_codegen", False)


@pytest.fixture
def fresh_notices(monkeypatch):
    """The once-per-process notices (and log_once keys) as in a new process."""
    from aotforge import debug

    monkeypatch.setattr(backends, "_noticed", set())
    monkeypatch.setattr(debug, "_logged_once", set())
    return monkeypatch


@pytest.mark.parametrize("mode, autotune", [
    ("default", False), ("max-autotune", True), ("max-autotune-no-cudagraphs", True),
])
def test_mode_maps_to_config_for_this_compile_only(mode, autotune, monkeypatch, fresh_notices, aten_on_cpu):
    torch._dynamo.reset()
    seen = _spy_eager_compiler(monkeypatch)
    model = torch.nn.Linear(4, 2).double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_step(torch.compile(model, backend="aotforge", mode=mode), model)
    assert [s["autotune"] for s in seen] == [autotune, autotune]  # forward and backward
    assert config.autotune is False  # nothing left behind
    # On CPU autotuning does nothing, which the max-autotune modes say once, at the user's line.
    messages = [(str(w.message), w.filename) for w in caught if "aotforge" in str(w.message)]
    if autotune:
        assert messages == [(f"aotforge: mode={mode!r} has no effect on CPU tensors: graphs on CPU "
                             "run as eager's ATen calls (no generated reductions to autotune); it "
                             "applies to graphs on CUDA tensors", __file__)], messages
    else:
        assert messages == []


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


@pytest.mark.parametrize("kwargs, error, message", [
    ({"mode": "fastest"}, ValueError, r"unknown torch.compile mode 'fastest'; aotforge supports \["),
    ({"mode": "max-autotun"}, ValueError, r"mode 'max-autotun' \(did you mean 'max-autotune'\?\)"),
    ({"options": {"not_an_option": 1}}, AttributeError, r"no option\(s\) \['not_an_option'\]; known options"),
    ({"options": {"autotun": True}}, AttributeError, r"\['autotun'\] \(did you mean 'autotune'\?\)"),
    ({"options": {"activation_memory_budget": "half"}}, TypeError,
     r"activation_memory_budget='half': expected a number"),
    ({"options": {"activation_memory_budget": 1.5}}, ValueError, r"activation_memory_budget=1.5: expected a number from 0"),
    ({"options": {"autotune": "yes"}}, TypeError, r"autotune='yes': expected True or False"),
    ({"options": {"verify": 1}}, TypeError, r"verify=1: expected True or False"),
])
@pytest.mark.parametrize("backend", ["aotforge", "aotforge_eager"])
def test_bad_mode_or_option_is_rejected_inside_torch_compile(backend, kwargs, error, message):
    model = torch.nn.Linear(4, 2)
    with pytest.raises(error, match=message) as caught:
        torch.compile(model, backend=backend, **kwargs)  # not called: torch.compile itself fails
    text = str(caught.value)
    assert text.startswith(f"torch.compile(backend={backend!r}): ") and "report" not in text, text
    # The backend itself checks too (torch._dynamo.optimize(backend) without torch.compile).
    with pytest.raises(error, match=message):
        backends.config_patches(kwargs.get("mode"), kwargs.get("options"))


def test_bad_option_is_rejected_inside_torch_compile_without_import():
    # The first torch.compile(backend="aotforge") of a process loads aotforge from its entry
    # point, inside torch.compile: the check is in place before torch.compile returns.
    result = _run_fresh("""
        import sys, torch
        try:
            torch.compile(torch.nn.Linear(2, 2), backend="aotforge", options={"autotune": "yes"})
        except TypeError as error:
            print("REJECTED", error)
        assert "aotforge" in sys.modules
    """)
    assert "REJECTED torch.compile(backend='aotforge'): aotforge.config.autotune='yes'" in result.stdout, (
        result.stdout + result.stderr[-3000:])


def test_other_backends_are_untouched_by_the_check():
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager", options={"anything": "goes"})
    assert callable(compiled)


def test_options_patch_config_for_that_compile_only(monkeypatch, aten_on_cpu):
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

def test_cpu_graphs_run_undecomposed_and_the_log_says_why(monkeypatch, capfd, aten_on_cpu):
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


def test_cpu_notice_once_per_process_by_default():
    # A fresh process, logging left unconfigured (Python's last-resort handler): one line for
    # two models, several graphs and a recompile.
    result = _run_fresh("""
        import os
        os.environ["AOTFORGE_CPU_CODEGEN"] = "0"
        import torch
        for width in (4, 5):
            model = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
            compiled = torch.compile(model, backend="aotforge")
            for batch in (2, 3):
                compiled(torch.randn(batch, width)).sum().backward()
        print("OK")
    """)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "aotforge" in line]
    assert lines == [backends.CPU_NOTICE.format(why="config.cpu_codegen is off")], result.stderr


def test_cpu_graphs_get_cpp_kernels_and_no_notice(capfd):
    from aotforge.compiler.pipeline import observe
    from aotforge.compiler.runtime import cpp_build

    if cpp_build.compiler_problem() is not None:
        pytest.skip(cpp_build.compiler_problem())
    def run(model):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aotforge")
        with observe() as graphs:
            torch.manual_seed(1)
            x = torch.randn(3, 4, dtype=torch.float64)
            out = compiled(x)
            torch.testing.assert_close(out, model(x))
            out.sum().backward()
        return graphs

    graphs = run(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)).double())
    assert [g.path for g in graphs] == ["cpp", "cpp"] and all(g.kernels for g in graphs)
    # GELU and LayerNorm stay eager's kernels (cpu_eager_bits): a graph of library calls alone
    # is still on the C++ path
    graphs = run(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).double())
    assert [g.path for g in graphs] == ["cpp", "cpp"]
    assert "plain ATen calls" not in capfd.readouterr().err


@pytest.mark.parametrize("options, source", [
    ({"activation_memory_budget": 0.5}, "options={'activation_memory_budget': 0.5}"),
    ({"verify": True}, "options={'verify': True}"),
    ({"persistent_reduction_limit": 64}, "options={'persistent_reduction_limit': 64}"),
])
def test_options_that_do_nothing_on_cpu_say_so_once_at_the_users_line(options, source, fresh_notices, aten_on_cpu):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).double()
    compiled = torch.compile(model, backend="aotforge", options=options)
    with pytest.warns(UserWarning) as caught:
        _train_step(compiled, model)
        _train_step(compiled, model)
    messages = [str(w.message) for w in caught if "aotforge" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"aotforge: {source} has no effect on CPU tensors"), messages
    assert "applies to graphs on CUDA tensors" in messages[0]
    assert [w.filename for w in caught if "aotforge" in str(w.message)] == [__file__]


def test_global_option_that_does_nothing_on_cpu_names_its_environment_variable(fresh_notices, aten_on_cpu):
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 2).double()
    with config.patch(verify=True), pytest.warns(UserWarning, match=r"aotforge.config.verify=True "
                                                 r"\(or AOTFORGE_VERIFY\) has no effect on CPU"):
        _train_step(torch.compile(model, backend="aotforge"), model)


def test_log_topics_silent_on_cpu_say_why_once(fresh_notices, capfd, aten_on_cpu):
    from aotforge import debug

    fresh_notices.setattr(debug, "_parsed", {})
    fresh_notices.setenv("AOTFORGE_LOG", "ir,output_code,lowering,partition,compile_time,verify,graphs")
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).double()
    compiled = torch.compile(model, backend="aotforge")
    _train_step(compiled, model)
    _train_step(compiled, model)
    err = capfd.readouterr().err
    for topic in debug.SILENT_ON_CPU:
        said = f"aotforge {topic}: nothing to print for graphs on CPU tensors"
        assert err.count(said) == 1, (topic, err[-3000:])
        assert f"===== aotforge {topic}:" not in err  # the claim holds: nothing else printed
    assert "===== aotforge graphs:" in err  # a topic that prints on CPU prints, unexplained
    assert "aotforge graphs: nothing to print" not in err
