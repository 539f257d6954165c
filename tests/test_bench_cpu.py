"""The CPU benchmark suite (issue 24): its workloads, --cold-caches, and the geomean rows."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from aotforge.bench import caches, main, report, runner
from aotforge.bench.runner import Result
from aotforge.bench.suites import load_workloads
from aotforge.bench.workload import DEFAULT_SUITES, SUITES, select
from aotforge.bench.workloads import cpu
from aotforge.bench.workloads.models import CausalSelfAttention
from aotforge.config import config
from tests.bench_helpers import keep_threads_and_affinity  # noqa: F401  (autouse: main pins threads and CPUs)

CPU_NAMES = ["cpu_mlp", "cpu_convnet", "cpu_transformer", "cpu_resnet18", "cpu_mobilenetv3"]


@pytest.fixture(autouse=True)
def keep_caches(monkeypatch):
    """--cold-caches points the caches elsewhere: give the rest of the session its own back."""
    for variable in (*caches.ENVIRONMENT, *caches.SWITCHED_OFF):
        monkeypatch.delenv(variable, raising=False)  # restored after the test
    cache_dir = config.cache_dir
    yield
    config.cache_dir = cache_dir


def test_the_cpu_suite_lists_its_workloads_and_is_run_only_when_asked_for():
    assert "cpu" in SUITES and "cpu" not in DEFAULT_SUITES
    workloads = select(load_workloads(), ["cpu"])
    assert [w.name for w in workloads] == CPU_NAMES
    assert {w.name: w.requires for w in workloads if w.requires} == {
        "cpu_resnet18": ("torchvision",), "cpu_mobilenetv3": ("torchvision",)}
    assert not [w for w in select(load_workloads(), DEFAULT_SUITES) if w.suite == "cpu"]


@pytest.mark.parametrize("name", CPU_NAMES)
def test_each_workload_builds_at_quick_size_and_runs_an_eager_step(name):
    workload = select(load_workloads(), ["cpu"], [name])[0]
    if workload.missing_packages():
        pytest.skip(f"needs {workload.missing_packages()}")
    for mode in ("train", "infer"):
        torch.manual_seed(0)
        case = workload.build(mode, True)
        module, inputs = runner.prepare(case, mode, torch.device("cpu"), torch.float32)
        out = runner.make_step(module, module, inputs, mode)()
        values = runner.snapshot(out, module, inputs, to_cpu=True)
        assert all(v is None or bool(torch.isfinite(v).all()) for v in values.values()), (name, mode)
        grads = [key for key, value in values.items() if key.startswith("grad") and value is not None]
        assert bool(grads) == (mode == "train"), (name, mode)
        # Every parameter takes a gradient in training: nothing of the model is left out of the step.
        assert mode == "infer" or all(values[f"grad {n}"] is not None for n, _ in module.named_parameters())
        assert module.training == (mode == "train")


def test_full_sizes_are_the_issues():
    mlp = cpu.build_cpu_mlp("train", False)
    assert mlp.inputs[0].shape == (256, 1024) and len(mlp.module.blocks) == 4
    assert isinstance(mlp.module.blocks[0][1], torch.nn.LayerNorm) and isinstance(mlp.module.blocks[0][2], torch.nn.GELU)
    convnet = cpu.build_cpu_convnet("train", False)
    assert convnet.inputs[0].shape == (32, 3, 32, 32) and convnet.inputs[1].shape == (32,)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in convnet.module.modules()) == 3
    block = cpu.build_cpu_transformer("infer", False)
    assert block.inputs[0].shape == (8, 64, 256) and isinstance(block.module.attn, cpu.MatmulAttention)


def test_matmul_attention_is_causal_attention():
    """The written-out attention computes what scaled_dot_product_attention(is_causal=True) does."""
    torch.manual_seed(0)
    fused = CausalSelfAttention(32, 4).double()
    written = cpu.MatmulAttention(32, 4, length=16).double()
    written.load_state_dict(fused.state_dict())
    x = torch.randn(3, 16, 32, dtype=torch.float64)
    torch.testing.assert_close(written(x), fused(x))
    torch.testing.assert_close(written(x[:, :5]), fused(x[:, :5]))  # shorter sequences: the mask's corner


def test_fresh_caches_are_new_empty_private_folders_and_switch_off_graph_caches():
    first = caches.use_fresh_caches("cpu_mlp-train-inductor")
    second = caches.use_fresh_caches("cpu_mlp-train-aotforge")
    assert set(first) == set(caches.ENVIRONMENT)
    for variable in caches.ENVIRONMENT:
        assert os.environ[variable] == second[variable] != first[variable]
        assert os.listdir(second[variable]) == []
        assert stat.S_IMODE(os.stat(second[variable]).st_mode) == 0o700
    assert "cpu_mlp-train-aotforge" in second["AOTFORGE_CACHE_DIR"]
    assert config.cache_dir == second["AOTFORGE_CACHE_DIR"]  # the config read its environment at import
    from aotforge.compiler.runtime.disk_cache import cache_directory

    assert cache_directory() == second["AOTFORGE_CACHE_DIR"]  # aotforge's compiles go there
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == second["TORCHINDUCTOR_CACHE_DIR"]  # inductor reads it on every use
    # inductor's FX graph and AOTAutograd caches: off for the configs it imports later
    assert all(os.environ[variable] == "0" for variable in caches.SWITCHED_OFF)


def test_cold_caches_are_the_default_for_the_cpu_suite_and_used_per_backend(tmp_path, monkeypatch):
    labels = []
    monkeypatch.setattr(caches, "use_fresh_caches", labels.append)

    def argv(workload, *extra):
        return ["--quick", "--device", "cpu", "--workloads", workload, "--modes", "infer", "--backends", "eager,inductor",
                "--repeat", "2", "--stabilize", "0", "--json", str(tmp_path / "b.json"), *extra]

    monkeypatch.setattr(runner, "compile_module", lambda backend, module: module)  # no inductor compile here
    assert main(argv("cpu_mlp")) == 0  # --workloads names a cpu workload: no --suite needed
    assert json.loads((tmp_path / "b.json").read_text())["meta"]["cold_caches"] is True
    assert labels == ["cpu_mlp-infer-eager", "cpu_mlp-infer-inductor"]
    labels.clear()
    assert main(argv("cpu_mlp", "--no-cold-caches")) == 0
    assert labels == [] and json.loads((tmp_path / "b.json").read_text())["meta"]["cold_caches"] is False
    # Other suites keep their caches unless asked.
    assert main(argv("mlp")) == 0
    assert labels == [] and json.loads((tmp_path / "b.json").read_text())["meta"]["cold_caches"] is False
    assert main(argv("mlp", "--cold-caches")) == 0
    assert labels == ["mlp-infer-eager", "mlp-infer-inductor"]


def row(workload, mode, backend, speedup, first, status="OK", vs_inductor=None):
    timed = status == "OK"
    return Result(workload, "cpu", mode, backend, status, median_ms=1.0 if timed else None,
                  speedup=speedup if timed else None, vs_inductor=vs_inductor, compile_s=first)


def test_geomean_rows_are_over_the_rows_every_backend_timed():
    results = [
        row("a", "train", "eager", 1.0, 0.5), row("a", "train", "inductor", 2.0, 10.0, vs_inductor=1.0),
        row("a", "train", "aotforge", 1.0, 1.0, vs_inductor=0.5),
        row("b", "infer", "eager", 1.0, 0.02), row("b", "infer", "inductor", 8.0, 40.0, vs_inductor=1.0),
        row("b", "infer", "aotforge", 4.0, 4.0, vs_inductor=0.5),
        # aotforge WRONG on c: c leaves every backend's means.
        row("c", "train", "eager", 1.0, 0.1), row("c", "train", "inductor", 100.0, 99.0, vs_inductor=1.0),
        row("c", "train", "aotforge", 3.0, 0.1, status="WRONG"),
        Result("d", "cpu", "infer", "-", "SKIPPED", "needs torchvision"),
    ]
    summary = {entry["backend"]: entry for entry in report.geomeans(results)}
    assert list(summary) == ["eager", "inductor", "aotforge"]
    assert summary["inductor"]["rows"] == 2
    assert summary["inductor"]["speedup"] == pytest.approx(4.0)  # sqrt(2 * 8): c is left out
    assert summary["inductor"]["first_call_s"] == pytest.approx(20.0)  # sqrt(10 * 40)
    assert summary["aotforge"]["speedup"] == pytest.approx(2.0) and summary["aotforge"]["vs_inductor"] == pytest.approx(0.5)
    assert summary["eager"]["first_call_s"] == pytest.approx(0.1)  # sqrt(0.5 * 0.02)
    assert summary["aotforge"]["left_out"] == 2 and summary["inductor"]["left_out"] == 1  # c, and d
    table = report.table(results, bandwidth=False)
    lines = table.splitlines()
    assert lines[-3:] == [
        "| geomean | 2 rows | eager |  |  |  | 1.00x |  | 0.10 |  |  | 1 row(s) not timed: left out of every mean |",
        "| geomean | 2 rows | inductor |  |  |  | 4.00x | 1.00x | 20.0 |  |  | 1 row(s) not timed: left out of every mean |",
        "| geomean | 2 rows | aotforge |  |  |  | 2.00x | 0.50x | 2.0 |  |  | 2 row(s) not timed: left out of every mean |",
    ], table
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    # One row: its geomean is itself, and no summary row is printed.
    assert "geomean" not in report.table(results[:3], bandwidth=False)
    assert report.geomeans([Result("d", "cpu", "infer", "-", "SKIPPED")]) == []


def test_a_package_that_fails_to_import_skips_the_row_with_why(tmp_path, monkeypatch):
    """A torchvision wheel built for another torch is installed but dies in its import: the
    row is SKIPPED with that reason, not a crash of the whole run."""
    from aotforge.bench.workload import Workload

    (tmp_path / "brokenvision").mkdir()
    (tmp_path / "brokenvision" / "__init__.py").write_text("raise RuntimeError('operator brokenvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    workload = Workload("w", "cpu", lambda mode, quick: None, requires=("brokenvision", "no_such_package_here"))
    broken, absent = workload.missing_packages()
    assert broken.startswith("brokenvision (installed, but importing it fails: RuntimeError: operator brokenvision::nms")
    assert absent == "no_such_package_here"
