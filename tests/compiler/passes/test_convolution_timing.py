"""Each CPU convolution's layout chosen by timing it (passes/convolution_timing.py): whichever
layout the timer picks, the compiled graph computes eager's values in eager's strides; a shape
is timed once a process; an error while timing, a spent budget or the config switch off leave
the weight/input rule's choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import aotforge
from aotforge.compiler import observe
from aotforge.compiler.passes import convolution_timing

from .test_cpu_convolutions import (WeightHeavyNet, _check_like_eager, _compiled, _randomize_batch_norms, _steps,
                                    one_by_one_convolutions)  # noqa: F401  (a fixture)


@pytest.fixture
def timing(monkeypatch, one_by_one_convolutions):
    """Timing on (the suite's default is off), nothing remembered from earlier tests, the
    tests' small convolutions large enough to be timed, and the 1x1 ones kept convolutions."""
    monkeypatch.setattr(convolution_timing, "_timed", {})
    monkeypatch.setattr(convolution_timing, "MIN_TIMED_WORK", 0)
    with aotforge.config.patch(cpu_convolution_timing=True):
        yield


def _force(monkeypatch, nchw_ms: float, nhwc_ms: float) -> list:
    """Make every timing return these times; the list records the shapes timed."""
    timed = []

    def measure(key, budget):
        timed.append(key)
        return nchw_ms / 1e3, nhwc_ms / 1e3

    monkeypatch.setattr(convolution_timing, "_measure", measure)
    return timed


def _input_is_nhwc(graphs) -> list[bool]:
    """Per convolution call of the compiled graphs: whether its input has channel stride 1."""
    calls = [step for step in _steps(graphs) if "convolution" in str(getattr(step, "op", ""))]
    return [int(step.args[0].stride[1]) == 1 for step in calls]


def _run(model, x):
    out, graphs = _compiled(model, x)
    with torch.no_grad():
        _check_like_eager(out, model(x), rtol=1e-4, atol=1e-4)
    return graphs


# WeightHeavyNet: 16 -> 32 (1x1, stride 2), pooled to 2x2, 32 -> 128 (3x3, weight 36 times its
# input: the rule runs it NCHW), 128 -> 16 (1x1). The rule: NHWC, NCHW, NHWC.


@pytest.mark.parametrize("nchw_wins", [True, False])
def test_the_timed_layout_runs_and_matches_eager(timing, monkeypatch, nchw_wins):
    """Where NCHW times faster every convolution runs NCHW (the rule's NHWC ones too); where NHWC
    does, every one runs NHWC (the rule's NCHW one too). Values and strides as eager's."""
    timed = _force(monkeypatch, *((1.0, 2.0) if nchw_wins else (2.0, 1.0)))
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    graphs = _run(model, torch.randn(2, 16, 16, 16))
    assert len(timed) == 3
    if nchw_wins:
        # all NCHW: nothing is converted, the graph keeps eager's layout
        assert _input_is_nhwc(graphs) == [False, False, False]
    else:
        assert _input_is_nhwc(graphs) == [True, True, True]


def test_a_close_timing_keeps_the_rule(timing, monkeypatch):
    """The layout the rule did not pick must be MARGIN faster: just under it, in either direction,
    moves no convolution."""
    _force(monkeypatch, 1.0, 0.99 / (1 - convolution_timing.MARGIN))
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    assert _input_is_nhwc(_run(model, torch.randn(2, 16, 16, 16))) == [True, False, True]


def test_a_shape_is_timed_once_a_process(timing, monkeypatch):
    """A second compile (and a second convolution of the same sizes) reads the first timing;
    another thread count is timed again."""
    timed = _force(monkeypatch, 1.0, 2.0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = torch.randn(2, 8, 8, 8)
    _run(model, x)
    assert len(timed) == 1  # the two convolutions have the same sizes
    graphs = _run(model, x)
    assert len(timed) == 1 and _input_is_nhwc(graphs) == [False, False]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        _run(model, x)
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 2


def test_an_error_while_timing_keeps_the_rule(timing, monkeypatch):
    def measure(key, budget):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(convolution_timing, "_measure", measure)
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    assert _input_is_nhwc(_run(model, torch.randn(2, 16, 16, 16))) == [True, False, True]
    assert convolution_timing._timed == {}  # a failure is not remembered: the next compile tries again


def test_a_spent_budget_keeps_the_rule(timing, monkeypatch):
    timed = _force(monkeypatch, 1.0, 2.0)
    monkeypatch.setattr(convolution_timing, "GRAPH_BUDGET_S", -1.0)
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    assert _input_is_nhwc(_run(model, torch.randn(2, 16, 16, 16))) == [True, False, True]
    assert timed == []


def test_switched_off_nothing_is_timed(timing, monkeypatch):
    timed = _force(monkeypatch, 1.0, 2.0)
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    with aotforge.config.patch(cpu_convolution_timing=False):
        graphs = _run(model, torch.randn(2, 16, 16, 16))
    assert timed == [] and _input_is_nhwc(graphs) == [True, False, True]


def test_tiny_convolutions_are_not_timed(timing, monkeypatch):
    timed = _force(monkeypatch, 1.0, 2.0)
    monkeypatch.setattr(convolution_timing, "MIN_TIMED_WORK", 10 ** 9)
    torch.manual_seed(0)
    model = _randomize_batch_norms(WeightHeavyNet()).eval()
    assert _input_is_nhwc(_run(model, torch.randn(2, 16, 16, 16))) == [True, False, True]
    assert timed == []


def test_real_timing_reports_each_choice_and_leaves_the_random_stream(timing, monkeypatch, capfd):
    """Timed for real: one line per convolution under AOTFORGE_LOG=compile, values as eager's,
    and the global random generator where it would be without the compile."""
    monkeypatch.setenv("AOTFORGE_LOG", "compile")
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 256, 3, stride=2)).eval()
    x = torch.randn(2, 16, 12, 12)
    torch.manual_seed(5)
    _run(model, x)
    after_compile = torch.rand(4)
    torch.manual_seed(5)
    with torch.no_grad():
        model(x)
    assert torch.equal(after_compile, torch.rand(4))
    lines = [line for line in capfd.readouterr().err.splitlines() if "ms -> " in line]
    assert len(lines) == 2, lines
    assert lines[0].startswith("aotforge compile: convolution: NCHW ") and "(timed)" in lines[0]
    assert all(line.endswith(("-> NCHW (timed)", "-> NHWC (timed)")) for line in lines)
    assert len(convolution_timing._timed) == 2
    assert all(c.nchw_ms > 0 and c.nhwc_ms > 0 for c in convolution_timing._timed.values())


@pytest.mark.parametrize("transposed", [False, True])
def test_measure_times_both_layouts(transposed):
    """``_measure`` on a key as ``choose`` builds it, strided and grouped (and transposed): two
    positive times, within a fraction of the timing budget."""
    # 16 -> 32 channels in 2 groups; transposed, the weight is (in, out / groups, kh, kw)
    weight = (16, 16, 3, 3) if transposed else (32, 8, 3, 3)
    key = (((2, 16, 10, 10), weight, (32,)), torch.float32,
           ([2, 2], [1, 1], [1, 1], transposed, [1, 1] if transposed else [0, 0], 2), (0,), 1)
    budget = convolution_timing.Budget()
    nchw, nhwc = convolution_timing._measure(key, budget)
    assert 0 < nchw < 0.5 and 0 < nhwc < 0.5 and not budget.spent()


# --- a training graph's layout (training_prefers_nhwc) -----------------------------------------------


@pytest.mark.parametrize("seconds, nhwc", [((1.0, 0.5), True), ((1.0, 0.95), False), ((0.5, 1.0), False)])
def test_training_layout_sums_every_convolution_and_remembers(timing, monkeypatch, seconds, nhwc):
    monkeypatch.setattr(convolution_timing, "_timed_training", {})
    timed = []

    def measure(key, budget):
        timed.append(key)
        return seconds

    monkeypatch.setattr(convolution_timing, "_measure_training", measure)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
    x = torch.randn(2, 8, 6, 6)
    for _ in range(2):
        torch._dynamo.reset()
        with observe() as graphs:
            torch.compile(model, backend="aotforge")(x).sum().backward()
        inputs = [step.args[1] for step in _steps(graphs, "backward")
                  if str(getattr(step, "op", "")) == "aten.convolution_backward.default"]
        assert len(inputs) == 3 and all((int(t.stride[1]) == 1) == nhwc for t in inputs)
    assert len(timed) == 2  # two distinct convolutions, each timed once for both compiles


def test_training_layout_keeps_nchw_when_timing_fails_or_runs_out(timing, monkeypatch):
    monkeypatch.setattr(convolution_timing, "_timed_training", {})
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
    x = torch.randn(2, 8, 6, 6)

    def fail(key, budget):
        raise RuntimeError("out of memory")

    for measure in (fail, lambda key, budget: (1.0, 0.1)):
        if measure is not fail:  # a spent budget: nothing is timed, the graph keeps NCHW
            monkeypatch.setattr(convolution_timing, "TRAINING_BUDGET_S", -1.0)
        monkeypatch.setattr(convolution_timing, "_measure_training", measure)
        torch._dynamo.reset()
        with observe() as graphs:
            torch.compile(model, backend="aotforge")(x).sum().backward()
        inputs = [step.args[1] for step in _steps(graphs, "backward")
                  if str(getattr(step, "op", "")) == "aten.convolution_backward.default"]
        assert inputs and not any(int(t.stride[1]) == 1 for t in inputs)


@pytest.mark.parametrize("depthwise", [False, True])
def test_measure_training_times_both_layouts(depthwise):
    weight, groups = ((16, 1, 5, 5), 16) if depthwise else ((32, 16, 3, 3), 1)
    key = (((2, 16, 10, 10), weight, None), torch.float32, ([1, 1], [1, 1], [1, 1], False, [0, 0], groups), (0,), 1)
    budget = convolution_timing.Budget()
    nchw, nhwc = convolution_timing._measure_training(key, budget)
    assert 0 < nchw < 0.5 and 0 < nhwc < 0.5
