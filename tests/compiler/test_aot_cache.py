"""The AOT cache (compiler/aot_cache.py) in this process: Dynamo's cache is reset between
compiles, so each compile reaches the backend as a restarted process would, and the AOT
cache's lookup reads the disk. (A second process: runtime/test_graph_cache.py.)"""
import pytest
import torch

from aotforge.compiler import compile_fx
from aotforge.compiler.runtime import disk_cache, keys
from aotforge.compiler.runtime.disk_cache import CacheEntryWarning
from aotforge.config import config

from .runtime.conftest import forget_loaded_modules


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(config, "cache", True)
    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(disk_cache, "_warned", set())
    monkeypatch.setenv("AOTFORGE_LOG", "cache")
    forget_loaded_modules()
    yield tmp_path / "cache"
    forget_loaded_modules()
    torch._dynamo.reset()


def make_step(activation):
    def step(x, w, b):
        b.add_(1)  # a buffer updated in place, as BatchNorm's running statistics are
        return activation(x @ w).sum(-1) + b.sum()
    return step


step = make_step(torch.nn.functional.gelu)
other_step = make_step(torch.nn.functional.silu)  # the same name, another graph


def make_inputs(rows: int = 8):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 16, dtype=torch.float64, generator=generator)
    w = torch.randn(16, 8, dtype=torch.float64, generator=generator).requires_grad_()
    return x, w, torch.zeros(3, dtype=torch.float64)


def compile_and_check(capsys, fn=step, rows: int = 8, grad: bool = True, **options) -> str:
    """Compile ``fn`` from scratch (Dynamo reset), run it and eager; returns the AOT cache's
    message for the compile."""
    torch._dynamo.reset()
    forget_loaded_modules()
    capsys.readouterr()
    x, w, b = make_inputs(rows)
    ew, eb = w.detach().clone().requires_grad_(), b.clone()
    compiled = torch.compile(fn, backend="aotforge", options=options or None)
    with torch.set_grad_enabled(grad):
        got, want = compiled(x, w, b), fn(x, ew, eb)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(b, eb)  # the in-place update, as eager's
    if grad:
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        torch.testing.assert_close(w.grad, ew.grad)
    lines = [line for line in capsys.readouterr().err.splitlines() if ":aot: " in line]
    return " / ".join(lines)


def test_a_compile_hits_after_a_restart(cache_on, capsys):
    assert "AOT miss (nothing stored yet" in compile_and_check(capsys)
    message = compile_and_check(capsys)
    assert "AOT hit" in message, message


@pytest.mark.parametrize("change, part", [
    (dict(fn=other_step), "graph"),
    (dict(rows=4), "inputs"),
    (dict(grad=False), "mode"),
    (dict(persistent_reduction_limit=16), "config"),
])
def test_each_key_part_misses_when_changed(cache_on, capsys, change, part):
    compile_and_check(capsys)
    message = compile_and_check(capsys, **change)
    assert f"AOT miss (changed: {part})" in message, message


def test_versions_changed_misses(cache_on, capsys, monkeypatch):
    compile_and_check(capsys)
    monkeypatch.setattr(keys, "_source_digest", "an edited aotforge")
    assert "AOT miss (changed: versions)" in compile_and_check(capsys)


def aot_entry(directory):
    (path,) = directory.glob("compile_*.json")
    return path


@pytest.mark.parametrize("cut", [0, 10, 100, -1])
def test_damaged_entry_recompiles(cache_on, capsys, cut):
    compile_and_check(capsys)
    path = aot_entry(cache_on)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:-1])
    with pytest.warns(CacheEntryWarning, match="does not match its hash"):
        assert "AOT miss" in compile_and_check(capsys)
    assert "AOT hit" in compile_and_check(capsys)  # rebuilt


def test_swapped_entry_recompiles(cache_on, capsys):
    """Another compile's (well-sealed) entry under this compile's name is refused by its key."""
    compile_and_check(capsys, fn=other_step)
    other = aot_entry(cache_on)
    other_bytes = other.read_bytes()
    other.unlink()
    compile_and_check(capsys)
    path = aot_entry(cache_on)
    path.write_bytes(other_bytes)
    with pytest.warns(CacheEntryWarning, match="made for another key"):
        assert "AOT miss" in compile_and_check(capsys)
    assert "AOT hit" in compile_and_check(capsys)


def test_entry_whose_graph_is_gone_recompiles(cache_on, capsys):
    compile_and_check(capsys)
    for path in cache_on.glob("graph_*.json"):
        path.unlink()
    message = compile_and_check(capsys)
    assert "AOT miss (its" in message and "graph is not in the compiled-graph cache" in message, message
    assert "AOT hit" in compile_and_check(capsys)


def test_resealed_plan_that_cannot_be_rebuilt_recompiles(cache_on, capsys):
    import json

    compile_and_check(capsys)
    path = aot_entry(cache_on)
    body = json.loads(path.read_bytes().partition(b"\n")[2])
    body["variants"][-1]["plan"]["outputs"][0]["kind"] = "NO_SUCH_KIND"
    raw = json.dumps(body).encode()
    path.write_bytes(disk_cache.digest(raw).encode() + b"\n" + raw)
    with pytest.warns(CacheEntryWarning, match="cannot be loaded"):
        assert "AOT miss (the entry cannot be loaded)" in compile_and_check(capsys)


def test_verify_and_callers_compilers_are_not_cached(cache_on, capsys):
    assert "not cached" in compile_and_check(capsys, verify=True)
    assert not list(cache_on.glob("compile_*.json"))

    def own_compiler(gm, example_inputs, **kwargs):  # not compile_fx_inner: its result is the caller's
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=lambda gm, inputs: compile_fx(gm, inputs, inner_compile=own_compiler))
    x, w, b = make_inputs()
    compiled(x, w, b)
    assert not list(cache_on.glob("compile_*.json"))


def test_cpu_graphs_that_run_as_fx_hit(cache_on, capsys, monkeypatch):
    """On the CPU (no Triton path) the graphs run as their own FX code: the entry holds that
    code; a hit skips tracing and partitioning all the same."""
    monkeypatch.setattr(config, "triton_on_cpu", False)
    monkeypatch.setattr(config, "cpu_codegen", False)
    assert "AOT miss (nothing stored yet" in compile_and_check(capsys)
    assert "AOT hit" in compile_and_check(capsys)
    assert "AOT miss (changed: mode)" in compile_and_check(capsys, grad=False)  # inference: its own entry
    assert "AOT hit" in compile_and_check(capsys, grad=False)
    (entry,) = [p for p in cache_on.glob("compile_*.json") if b'"training": true' in p.read_bytes()]
    assert b"def forward(self" in entry.read_bytes()  # the FX code, not compiled-graph keys


@pytest.mark.parametrize("triton", [True, False], ids=["kernels", "fx"])
def test_inspect_shows_what_a_hit_loaded(cache_on, capsys, monkeypatch, triton):
    """A hit traces and compiles nothing, yet ``aotforge.inspect`` still has the compile: a
    record marked as loaded, with its compiled graphs (and, on the FX path, their code)."""
    import aotforge

    monkeypatch.setattr(config, "triton_on_cpu", triton)
    monkeypatch.setattr(config, "cpu_codegen", False)
    compile_and_check(capsys)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aotforge")
    x, w, b = make_inputs()
    compiled(x, w, b).sum().backward()
    record = aotforge.inspect(compiled).records[-1]  # (records are kept per function)
    assert record.cached and record.kind == "training"
    assert set(record.compiled) == {"forward", "backward"}
    assert "loaded from the AOT cache" in str(record)
    if triton:
        assert record.compiled["forward"].compiled_graph.kernels
    else:
        assert "torch.ops.aten.mm" in record.graph_code["forward"]
        assert "--- forward graph (its code, from the AOT cache) ---" in str(record)


def test_a_tensor_read_from_outside_is_read_at_each_call(cache_on, capsys):
    """Dynamo passes a tensor the function reads from outside as a graph input: a hit after its
    value changed is right (compile_and_check compares with eager). (A constant of the graph is
    keyed by its bytes: runtime/test_graph_cache.py, test_aot_function_cache.py.)"""
    scale = torch.full((8,), 2.0, dtype=torch.float64)

    def scaled_step(x, w, b):
        return (x @ w * scale).sum(-1) + b.sum()

    compile_and_check(capsys, fn=scaled_step)
    assert "AOT hit" in compile_and_check(capsys, fn=scaled_step)
    scale.fill_(3.0)
    assert "AOT hit" in compile_and_check(capsys, fn=scaled_step)
