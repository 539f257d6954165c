"""The benchmark harness: correctness checks, failure handling, table and JSON, and a CPU smoke
run of ``python -m aotforge bench --quick`` on one small workload."""
from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch
from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

from aotforge.bench import main, measure, report, runner
from aotforge.bench.suites import load_workloads
from aotforge.bench.workload import select
from tests.bench_helpers import keep_threads_and_affinity  # noqa: F401  (autouse)


# --- test backends: one correct, one wrong in the forward, one wrong only in the backward, one
# that raises. Registered with Dynamo by name, as `--backends` takes names.


def fx_backend(gm: torch.fx.GraphModule, example_inputs):
    return gm.forward


def wrong_forward_backend(gm: torch.fx.GraphModule, example_inputs):
    def run(*args):
        return [out * 1.01 if isinstance(out, torch.Tensor) and out.is_floating_point() else out for out in gm(*args)]

    return run


class ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.1


def wrong_backward_backend(gm: torch.fx.GraphModule, example_inputs):
    def run(*args):
        return [ScaleGradient.apply(out) if isinstance(out, torch.Tensor) and out.requires_grad else out for out in gm(*args)]

    return run


def failing_backend(gm: torch.fx.GraphModule, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def slow_backend(gm: torch.fx.GraphModule, example_inputs):
    time.sleep(30)
    return gm.forward


TEST_BACKENDS = {
    "bench_test_fx": fx_backend,
    "bench_test_wrong_forward": wrong_forward_backend,
    "bench_test_wrong_backward": wrong_backward_backend,
    "bench_test_failing": failing_backend,
    "bench_test_slow": slow_backend,
}
for _name, _fn in TEST_BACKENDS.items():
    if _name not in _COMPILER_FNS:
        register_backend(compiler_fn=_fn, name=_name)


def by_key(results):
    return {(r["workload"], r["mode"], r["backend"]): r for r in results}


def test_quick_cpu_smoke_run(tmp_path, capsys, monkeypatch):
    """The CI smoke run: one small workload, both modes, a correct, a wrong and a failing backend."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the run says so
    path = tmp_path / "bench.json"
    backends = "eager,bench_test_fx,bench_test_wrong_forward,bench_test_wrong_backward,bench_test_failing"
    code = main(["--quick", "--device", "cpu", "--workloads", "mlp", "--backends", backends,
                 "--repeat", "3", "--stabilize", "0", "--json", str(path)])
    assert code == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "no chart written: it needs matplotlib, which the `bench` extra installs" in captured.err
    assert not path.with_suffix(".png").exists()
    assert "| workload | mode | backend | status | median ms | spread | speedup | vs inductor |" in out
    assert "GB/s" not in out  # no bandwidth on CPU
    assert re.search(r"\| mlp \| train \| eager \| OK \| [0-9.]+ \| ±\d+% \|", out), out
    assert "1 thread (pinned" in out  # --quick on the CPU: one thread unless --threads says otherwise
    assert "alternating rounds" in out  # the legend says how rows were timed
    payload = json.loads(path.read_text())
    assert payload["meta"]["device"] == "cpu" and payload["meta"]["quick"] is True
    results = by_key(payload["results"])
    assert len(results) == 10
    for mode in ("train", "infer"):
        for name in ("eager", "bench_test_fx"):
            result = results[("mlp", mode, name)]
            assert result["status"] == "OK", result
            assert len(result["times_ms"]) == 3 and result["median_ms"] > 0
            # Peak memory over the warm-up less the RSS before this backend's copy: a few KiB for
            # a model this small, 0 where freed memory was reused.
            assert result["compile_s"] > 0 and result["peak_bytes"] >= 0
            assert result["max_error"] <= measure.TOLERANCES[torch.float32]
            eager_times = results[("mlp", mode, "eager")]["times_ms"]
            paired = sorted(e / t for e, t in zip(eager_times, result["times_ms"]))
            assert math.isclose(result["speedup"], paired[1])  # the median of 3 rounds' ratios
            assert result["batch"] >= 1
        assert results[("mlp", mode, "bench_test_fx")]["graphs"] == 1
        wrong = results[("mlp", mode, "bench_test_wrong_forward")]
        assert wrong["status"] == "WRONG" and wrong["median_ms"] is None
        assert "relative error 1.00e-02 > allowed 1.00e-03" in wrong["reason"]
        failed = results[("mlp", mode, "bench_test_failing")]
        assert failed["status"] == "FAILED" and "this backend cannot compile anything" in failed["reason"]
        assert f"| mlp | {mode} | bench_test_failing | FAILED |" in out
    # Forward right, gradients 10% off: only training can see it.
    assert results[("mlp", "infer", "bench_test_wrong_backward")]["status"] == "OK"
    wrong_grad = results[("mlp", "train", "bench_test_wrong_backward")]
    assert wrong_grad["status"] == "WRONG" and wrong_grad["reason"].startswith("grad ")


def test_missing_package_is_skipped_and_run_goes_on():
    workload = runner.Workload("needs_package", "hf", lambda mode, quick: None, requires=("no_such_package_xyz",))
    settings = runner.Settings(torch.device("cpu"), torch.float32, quick=True)
    results = runner.run_all([workload], ["infer"], ["eager"], settings, log=lambda message: None)
    assert [(r.status, r.reason) for r in results] == [("SKIPPED", "needs no_such_package_xyz")]
    assert "| needs_package | infer | - | SKIPPED |" in report.table(results)


def test_a_workload_that_cannot_be_built_fails_every_backend():
    def broken(mode, quick):
        raise ValueError("bad size")

    workload = runner.Workload("broken", "models", broken)
    settings = runner.Settings(torch.device("cpu"), torch.float32, quick=True)
    results = runner.run_all([workload], ["train"], ["eager", "bench_test_fx"], settings, log=lambda message: None)
    assert [r.status for r in results] == ["FAILED", "FAILED"]
    assert all("bad size" in r.reason for r in results)


def test_every_quick_workload_runs_eagerly_in_both_modes():
    settings = runner.Settings(torch.device("cpu"), torch.float32)
    for workload in load_workloads():
        if workload.missing_packages():
            continue
        for mode in ("train", "infer"):
            torch.manual_seed(0)
            case = workload.build(mode, True)
            values = runner.run_eager_once(case, mode, settings.device, settings.dtype)
            assert values, workload.name
            for name, value in values.items():
                assert value is None or bool(torch.isfinite(value.double()).all()), (workload.name, mode, name)
            grads = [name for name, value in values.items() if name.startswith("grad") and value is not None]
            assert bool(grads) == (mode == "train"), (workload.name, mode)
            assert (case.elements_moved is not None) == (workload.suite == "micro")


def test_relative_error():
    x = torch.randn(100, dtype=torch.float64)
    assert measure.relative_error(x, x) == 0.0
    assert math.isclose(measure.relative_error(x * 1.01, x), 0.01, rel_tol=1e-6)
    assert measure.relative_error(x[:50], x) == math.inf
    y = x.clone()
    y[3] = float("nan")
    assert measure.relative_error(y, x) == math.inf
    assert measure.relative_error(y, y) == 0.0  # NaN where eager has NaN too is agreement
    assert measure.relative_error(torch.tensor([1, 2]), torch.tensor([1, 3])) == math.inf
    assert measure.relative_error(torch.zeros(4), torch.zeros(4)) == 0.0


def test_values_zero_up_to_rounding_are_compared_at_the_dtypes_absolute_floor():
    """A float32 running mean of about 2e-10 (0 in exact arithmetic) that two correct layouts
    round 3.7e-9 apart agrees; a value of the tensor's own size off by as much as itself does not,
    nor a float32 error of 1e-7 on values that small, nor float64 rounding noise at 1e-6."""
    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(72, generator=generator) * 2e-10
    layout_noise = torch.randn(72, generator=generator) * 3.7e-9
    assert measure.relative_error(mean + layout_noise, mean) < measure.TOLERANCES[torch.float32]
    assert measure.relative_error(mean + 1e-7, mean) > measure.TOLERANCES[torch.float32]
    big = torch.randn(72, generator=generator)
    assert measure.relative_error(big * 1.01, big) > measure.TOLERANCES[torch.float32]
    small64 = torch.randn(72, generator=generator, dtype=torch.float64) * 1e-9
    assert measure.relative_error(small64 + 1e-6, small64) > measure.TOLERANCES[torch.float64]


def test_tolerance_widens_to_eager_own_error():
    reference = {"output[0]": torch.ones(10, dtype=torch.float64)}
    eager = {"output[0]": torch.full((10,), 1.05)}
    allowed = measure.allowed_errors(eager, reference, torch.bfloat16)
    assert math.isclose(allowed["output[0]"], 3 * 0.05, rel_tol=1e-5)
    assert measure.allowed_errors(eager, None, torch.float32)["output[0]"] == measure.TOLERANCES[torch.float32]
    largest, mismatch = measure.compare({"output[0]": torch.full((10,), 1.10)}, eager, allowed)
    assert mismatch is None and largest > 0.04
    largest, mismatch = measure.compare({"output[0]": torch.full((10,), 1.5)}, eager, allowed)
    assert mismatch is not None and mismatch.name == "output[0]"
    _, mismatch = measure.compare({"output[0]": None}, eager, allowed)
    assert mismatch is not None and "missing" in mismatch.name


def test_time_steps_counts_repeats_after_warmup():
    calls = []
    times = measure.time_steps(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeat=4)
    # A step far below MIN_BATCH_S is timed in batches: many calls per timed value.
    assert len(times) == 4 and len(calls) > 2 + 4 and all(t >= 0 for t in times)


def test_warm_up_runs_at_least_warmup_steps_and_batches_short_steps():
    calls = []
    step_s = measure.warm_up(lambda: calls.append(1), torch.device("cpu"), warmup=5)
    assert len(calls) == 5 and 0 <= step_s < 1e-3
    assert measure.batch_size(1e-5) == 100  # 10 us steps: a batch lasts MIN_BATCH_S = 1 ms
    assert measure.batch_size(5e-3) == 1 and measure.batch_size(0.0) == measure.MAX_BATCH


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backends", "no_such_backend"], "unknown backend(s) ['no_such_backend']"),
        (["--workloads", "no_such_workload"], "unknown workload(s) ['no_such_workload']"),
        (["--quick", "--repeat", "0", "--workloads", "mlp"], "--repeat must be at least 1"),
    ],
)
def test_bad_arguments_give_a_clear_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_suite_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["--suite", "nonsense"])
    assert "not in models, micro, hf" in capsys.readouterr().err


def test_select_by_suite_and_name():
    workloads = load_workloads()
    assert {w.suite for w in select(workloads, ["micro"])} == {"micro"}
    assert [w.name for w in select(workloads, ["models", "micro"], ["softmax", "mlp"])] == ["softmax", "mlp"]
    assert select(workloads, ["hf"], ["mlp"]) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without a GPU")
def test_asking_for_cuda_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="torch sees no CUDA GPU"):
        main(["--quick", "--device", "cuda", "--workloads", "mlp"])


def test_a_backend_past_its_timeout_fails_and_the_run_goes_on():
    workload = select(load_workloads(), ["micro"], ["softmax"])[0]
    settings = runner.Settings(torch.device("cpu"), torch.float32, quick=True, repeat=2, backend_timeout=1.0)
    start = time.monotonic()
    results = runner.run_all([workload], ["infer"], ["bench_test_slow", "bench_test_fx"], settings, log=lambda m: None)
    assert time.monotonic() - start < 20
    assert results[0].status == "FAILED" and "did not finish within 1 s" in results[0].reason
    assert results[1].status == "OK" and results[1].median_ms > 0


def test_spread_is_half_the_interquartile_range_over_the_median():
    assert report.spread([10.0]) is None
    assert report.spread([9.0, 10.0, 11.0]) == pytest.approx(0.05)
    assert report.spread([10.0, 10.0, 10.0, 50.0]) == pytest.approx(0.5)  # one outlier


# --- interleaved rounds -------------------------------------------------------------------------


def test_rotated_starts_each_round_one_further():
    assert [measure.rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert measure.rotated([], 3) == []


CALLS: list[str] = []


def recording_backend(tag):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        def run(*args):
            CALLS.append(tag)
            return gm(*args)

        return run

    return backend


for _tag in "ABC":
    if f"bench_test_record_{_tag}" not in _COMPILER_FNS:
        register_backend(compiler_fn=recording_backend(_tag), name=f"bench_test_record_{_tag}")


def runs(calls):
    """Consecutive calls of one backend collapsed: ``AAABBA`` -> ``ABA``."""
    return "".join(tag for index, tag in enumerate(calls) if index == 0 or calls[index - 1] != tag)


def test_backends_are_timed_in_alternating_rounds_with_rotating_order():
    """Each backend is checked and warmed up in turn, all stay compiled, and then every round runs
    each once (a batch of calls), the order rotated by one per round; Dynamo keeps each backend's
    graph (no recompile when they alternate)."""
    workload = select(load_workloads(), ["micro"], ["softmax"])[0]
    settings = runner.Settings(torch.device("cpu"), torch.float32, quick=True, warmup=1, repeat=4, min_warmup_s=0.0)
    backends = [f"bench_test_record_{tag}" for tag in "ABC"]
    CALLS.clear()
    results = runner.run_all([workload], ["infer"], backends, settings, log=lambda m: None)
    # check + warm-up of A, B, C; round 0 (untimed); rounds 1-4.
    assert runs(CALLS) == "ABC" + "ABC" + "BCA" + "CAB" + "ABC" + "BCA", CALLS
    for result in results:
        assert result.status == "OK" and result.reason == "", result
        assert result.graphs == 1 and len(result.times_ms) == 4
        assert result.median_ms == measure.median(result.times_ms)


class FakeTime:
    """measure's clock, advanced only by the fake steps: round times known in advance."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def monotonic(self):
        return self.now


def scripted_step(clock, costs_ms, log, tag):
    """A step whose n-th call lasts ``costs_ms[n]`` on ``clock`` (each >= MIN_BATCH_S: one step
    per batch), or raises where the cost is an exception."""
    calls = iter(costs_ms)

    def step():
        cost = next(calls)
        log.append(tag)
        if isinstance(cost, BaseException):
            raise cost
        clock.now += cost / 1e3

    return step


def live(backend, step):
    return runner.Live(runner.Result("w", "micro", "infer", backend, "OK", compile_s=0.1), step, batch=1)


def test_rows_report_median_and_spread_from_their_rounds(monkeypatch):
    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    # Round 0 is untimed; rounds 1-3 give eager 2, 4, 6 ms and the other 1, 4, 1.5 ms.
    eager = live("eager", scripted_step(clock, [9, 2, 4, 6], log, "e"))
    other = live("inductor", scripted_step(clock, [9, 1, 4, 1.5], log, "i"))
    settings = runner.Settings(torch.device("cpu"), torch.float32, repeat=3)
    runner.time_rounds([eager, other], settings)
    assert log == list("ei" "ie" "ei" "ie")
    assert eager.result.times_ms == pytest.approx([2, 4, 6]) and eager.result.median_ms == pytest.approx(4)
    assert other.result.times_ms == pytest.approx([1, 4, 1.5]) and other.result.median_ms == pytest.approx(1.5)
    assert eager.result.batch == 1
    results = [eager.result, other.result]
    runner.add_ratios(results, runner.Case(torch.nn.Identity(), ()), torch.float32, None)
    # The speedup is the median of the rounds' ratios (2, 1, 4), not the ratio of medians (2.67).
    assert other.result.speedup == pytest.approx(2.0) and eager.result.speedup == pytest.approx(1.0)
    assert eager.result.vs_inductor == pytest.approx(0.5)
    table = report.table(results, bandwidth=False)
    assert "| w | infer | eager | OK | 4.000 | ±25% | 1.00x | 0.50x |" in table, table
    assert f"±{100 * report.spread([1, 4, 1.5]):.0f}%" in table


def test_a_backend_failing_in_a_round_leaves_the_rounds_and_the_others_go_on(monkeypatch):
    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    good = live("eager", scripted_step(clock, [2, 2, 2, 2], log, "g"))
    bad = live("aotforge", scripted_step(clock, [2, 2, RuntimeError("step 3 broke")], log, "b"))
    runner.time_rounds([good, bad], runner.Settings(torch.device("cpu"), torch.float32, repeat=3))
    assert log == list("gb" "bg" "gb" "g")
    assert good.result.status == "OK" and good.result.times_ms == pytest.approx([2, 2, 2])
    assert bad.result.status == "FAILED" and "step 3 broke" in bad.result.reason
    assert bad.result.median_ms is None and bad.result.times_ms == []


def test_the_backend_timeout_counts_time_spent_in_rounds(monkeypatch):
    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    monkeypatch.setattr(runner, "time", clock)
    slow = live("aotforge", scripted_step(clock, [400] * 4, log, "s"))
    fast = live("eager", scripted_step(clock, [2] * 4, log, "f"))
    slow.used_s = 0.5  # compile, check and warm-up
    runner.time_rounds([slow, fast], runner.Settings(torch.device("cpu"), torch.float32, repeat=3, backend_timeout=1.0))
    assert slow.result.status == "FAILED" and "did not finish within 1 s" in slow.result.reason
    assert fast.result.status == "OK" and len(fast.result.times_ms) == 3


def test_pin_cpu_threads_caps_at_the_cpus_allowed_and_reports_them():
    import os

    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    count, cpus = measure.pin_cpu_threads(10_000)
    assert count == torch.get_num_threads() == (len(affinity) if affinity else 10_000)
    if affinity is not None and cpus is not None:
        assert cpus == sorted(affinity) and os.sched_getaffinity(0) == affinity
    count, cpus = measure.pin_cpu_threads(1)
    assert count == torch.get_num_threads() == 1
    if cpus is not None:
        assert cpus == sorted(affinity)[:1] and os.sched_getaffinity(0) == set(cpus)


def test_threads_option(tmp_path, capsys):
    argv = ["--quick", "--device", "cpu", "--workloads", "softmax", "--modes", "infer", "--backends", "eager",
            "--repeat", "2", "--json", str(tmp_path / "b.json")]
    assert main(argv + ["--threads", "10000"]) == 0
    captured = capsys.readouterr()
    assert "--threads 10000 is more than the" in captured.err
    assert json.loads((tmp_path / "b.json").read_text())["meta"]["threads"] == torch.get_num_threads()
    assert main(argv[:-2] + ["--threads", "0"]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err


def test_a_busy_machine_is_reported_when_several_threads_are_used(monkeypatch):
    import os
    import sys

    main_module = sys.modules["aotforge.bench.main"]  # the attribute of that name is the function
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count() or 1), 0.0, 0.0))
    load, warning = main_module._busy_warning(2)
    assert load == float(os.cpu_count() or 1) and "--threads 1" in warning
    assert main_module._busy_warning(1)[1] == ""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert main_module._busy_warning(2)[1] == ""


def test_a_compile_inside_a_timed_round_is_noted_on_the_row(monkeypatch):
    from torch._dynamo.utils import counters

    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    counters.clear()
    calls = iter(range(100))

    def recompiling_step():  # a guard failing in round 2: Dynamo compiles a new graph there
        if next(calls) == 2:
            counters["stats"]["unique_graphs"] += 1
        clock.now += 2e-3

    steady = live("eager", scripted_step(clock, [2] * 4, log, "s"))
    flaky = live("aotforge", recompiling_step)
    runner.time_rounds([steady, flaky], runner.Settings(torch.device("cpu"), torch.float32, repeat=3))
    assert flaky.result.status == "OK" and flaky.result.reason == "Dynamo recompiled while it was timed"
    assert steady.result.reason == ""
    counters.clear()


# --- noisy rows: more rounds within --stabilize, then flagged -----------------------------------


def test_noisy_rows_get_more_rounds_until_stable(monkeypatch):
    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    monkeypatch.setattr(runner, "time", clock)
    # Rounds 1-3 disagree wildly (a busy machine); from round 4 on both are steady.
    eager = live("eager", scripted_step(clock, [9, 2, 20, 2] + [2] * 20, log, "e"))
    other = live("aotforge", scripted_step(clock, [9, 1, 1, 10] + [1] * 20, log, "a"))
    settings = runner.Settings(torch.device("cpu"), torch.float32, repeat=3, stabilize_s=60)
    runner.time_rounds([eager, other], settings)
    rounds = len(eager.result.times_ms)
    assert 3 < rounds <= 9, rounds  # extra rounds, at most 3 x repeat
    assert eager.result.noisy == "" and other.result.noisy == ""
    # Stopped at the first round where no row was noisy any more: one round fewer still was.
    shorter = [live(b.result.backend, None) for b in (eager, other)]
    for entry, full in zip(shorter, (eager, other)):
        entry.result.times_ms = full.result.times_ms[:-1]
    assert runner.noise(shorter)


def test_rows_still_noisy_when_the_budget_ends_are_flagged(monkeypatch):
    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    monkeypatch.setattr(runner, "time", clock)
    costs = [9] + [2, 20, 2, 30] * 10
    eager = live("eager", scripted_step(clock, costs, log, "e"))
    other = live("aotforge", scripted_step(clock, [9] + [1] * 40, log, "a"))
    settings = runner.Settings(torch.device("cpu"), torch.float32, repeat=4, stabilize_s=60)
    runner.time_rounds([eager, other], settings)
    assert len(eager.result.times_ms) == 12  # 3 x repeat: the most rounds it takes
    assert eager.result.noisy.startswith("NOISY over 12 rounds: times vary ±"), eager.result.noisy
    assert "ratio to eager varies" in other.result.noisy, other.result.noisy
    results = [eager.result, other.result]
    runner.add_ratios(results, runner.Case(torch.nn.Identity(), ()), torch.float32, None)
    table = report.table(results, bandwidth=False)
    assert re.search(r"\| w \| infer \| eager \| OK \|.*\| NOISY over 12 rounds: times vary ±\d+% \|", table), table
    summary = report.noisy_summary(results, {"load_average": 9.5, "cpu_count": 2})
    assert summary.startswith("2 of 2 timed rows are NOISY (load average 9.5 on 2 CPUs at the start)")
    # Without --stabilize no extra round is taken.
    clock2, log2 = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock2)
    monkeypatch.setattr(runner, "time", clock2)
    eager = live("eager", scripted_step(clock2, costs, log2, "e"))
    other = live("aotforge", scripted_step(clock2, [9] + [1] * 40, log2, "a"))
    runner.time_rounds([eager, other], runner.Settings(torch.device("cpu"), torch.float32, repeat=4))
    assert len(eager.result.times_ms) == 4 and eager.result.noisy


def test_extra_rounds_stop_when_the_stabilize_budget_is_spent(monkeypatch):
    clock, log = FakeTime(), []
    monkeypatch.setattr(measure, "time", clock)
    monkeypatch.setattr(runner, "time", clock)
    costs = [9] + [200, 2000, 200, 3000] * 10  # steps of seconds: the budget ends first
    eager = live("eager", scripted_step(clock, costs, log, "e"))
    other = live("aotforge", scripted_step(clock, [9] + [100] * 40, log, "a"))
    settings = runner.Settings(torch.device("cpu"), torch.float32, repeat=4, stabilize_s=5)
    runner.time_rounds([eager, other], settings)
    assert 4 < len(eager.result.times_ms) < 12 and eager.result.noisy
