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
from aotforge.bench.workload import load_workloads, select


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


def test_quick_cpu_smoke_run(tmp_path, capsys):
    """The CI smoke run: one small workload, both modes, a correct, a wrong and a failing backend."""
    path = tmp_path / "bench.json"
    backends = "eager,bench_test_fx,bench_test_wrong_forward,bench_test_wrong_backward,bench_test_failing"
    code = main(["--quick", "--device", "cpu", "--workloads", "mlp", "--backends", backends,
                 "--repeat", "3", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| workload | mode | backend | status | median ms | spread | speedup | vs inductor |" in out
    assert "GB/s" not in out  # no bandwidth on CPU
    assert re.search(r"\| mlp \| train \| eager \| OK \| [0-9.]+ \| ±\d+% \|", out), out
    assert f"{torch.get_num_threads()} threads (pinned)" in out
    payload = json.loads(path.read_text())
    assert payload["meta"]["device"] == "cpu" and payload["meta"]["quick"] is True
    results = by_key(payload["results"])
    assert len(results) == 10
    for mode in ("train", "infer"):
        for name in ("eager", "bench_test_fx"):
            result = results[("mlp", mode, name)]
            assert result["status"] == "OK", result
            assert len(result["times_ms"]) == 3 and result["median_ms"] > 0
            assert result["compile_s"] > 0 and result["peak_bytes"] > 0
            assert result["max_error"] <= measure.TOLERANCES[torch.float32]
            assert math.isclose(result["speedup"], results[("mlp", mode, "eager")]["median_ms"] / result["median_ms"])
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
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


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
