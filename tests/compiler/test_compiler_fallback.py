"""A failure inside aotforge's compiler never costs a user their step: outside strict mode the
graph runs as its own ATen calls (eager's kernels) with one warning that names the graph, the
stage and the error. Strict mode (``AOTFORGE_STRICT=1``, the tests' default) raises."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import aotforge  # noqa: F401
from aotforge.compiler import pipeline
from aotforge.config import config


class InjectedBug(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise InjectedBug("injected by the test")


STAGES = {
    "post_grad_passes": (pipeline.passes, "post_grad_passes"),
    "lower": (pipeline, "lower"),
    "codegen": (pipeline, "emit_kernels"),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)).double()


def _run(model, x, train):
    if train:
        model(x).square().sum().backward()
        return [p.grad for p in model.parameters()]
    with torch.no_grad():
        return [model(x)]


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_compiler_failure_costs_one_warning_per_graph_and_gives_eagers_answer(stage, train, monkeypatch):
    owner, name = STAGES[stage]
    monkeypatch.setattr(owner, name, _raise)
    eager = _model()
    compiled = copy.deepcopy(eager)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch._dynamo.reset()
    with config.patch(strict=False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = [a.clone() for a in _run(torch.compile(compiled, backend="aotforge"), x, train)]
        _run(torch.compile(compiled, backend="aotforge"), x, train)  # a second call: no second warning
    expected = _run(eager, x, train)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    messages = [str(w.message) for w in caught if "runs as ATen calls" in str(w.message)]
    assert len(messages) == (2 if train else 1), messages  # forward and backward graphs: one each
    graph = "forward" if train else "inference"
    assert f"the {graph} graph" in messages[0] and f"its {stage} stage failed with InjectedBug" in messages[0]
    assert "AOTFORGE_STRICT=1" in messages[0]


def test_strict_mode_raises_the_compilers_error(monkeypatch):
    monkeypatch.setattr(pipeline, "lower", _raise)
    torch._dynamo.reset()
    with config.patch(strict=True), pytest.raises(Exception, match="injected by the test"):
        torch.compile(_model(), backend="aotforge")(torch.randn(4, 8, dtype=torch.float64))


def test_a_kernel_that_fails_at_its_first_launch_falls_back_to_aten(monkeypatch):
    """Triton compiles a kernel at its first launch: a failure there is the compiler's too."""
    model = _model()
    x = torch.randn(4, 8, dtype=torch.float64)
    calls = []
    original_load = pipeline.runtime.load

    def load(*args, **kwargs):
        compiled = original_load(*args, **kwargs)
        inner = compiled.call

        def call(arguments):
            if not calls:
                calls.append(1)
                raise InjectedBug("a kernel failed to build")
            return inner(arguments)
        compiled.call = call
        return compiled

    monkeypatch.setattr(pipeline.runtime, "load", load)
    torch._dynamo.reset()
    with config.patch(strict=False), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="aotforge")(x)
        out2 = torch.compile(model, backend="aotforge")(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
        torch.testing.assert_close(out2, model(x))
    assert calls, "the injected failure never ran: the test checks nothing"
    assert any("kernel compile (first launch)" in str(w.message) for w in caught)
