"""benchmarks/dynamic_shapes.py (issue 14's GPU measurement): a CPU smoke run of the tiny
config through child processes, a child cut off by its time limit, and the correctness and
ratio verdicts on made-up rows."""
from __future__ import annotations

import json
import math
import sys

import torch

from pathlib import Path

# the repository root, where the `benchmarks` package lives
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import dynamic_shapes  # noqa: E402


def test_small_cpu_run_one_dynamic_graph_serves_every_length(tmp_path, capsys):
    path = tmp_path / "dynamic.json"
    code = dynamic_shapes.main(["--small", "--device", "cpu", "--backends", "eager,aotforge_eager",
                                "--warmup", "1", "--steps", "2", "--timeout", "300", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert payload["meta"]["seqlens"] == "8,12,16" and payload["meta"]["batch"] == 2
    rows = {(r["backend"], r["mode"], r["T"]): r for r in payload["rows"]}
    assert sorted(rows) == sorted((b, m, t) for b, m in [("eager", "eager"), ("aotforge_eager", "dynamic"),
                                                         ("aotforge_eager", "static")] for t in (8, 12, 16))
    for row in rows.values():
        assert row["status"] == "OK", row
        assert row["median_ms"] > 0 and row["first_call_s"] > 0
    for t in (8, 12, 16):
        for mode in ("dynamic", "static"):
            row = rows[("aotforge_eager", mode, t)]
            assert row["max_rel_error"] <= 2e-2 and row["correct"]
            assert math.isclose(row["loss"], rows[("eager", "eager", t)]["loss"], rel_tol=2e-2)
        # static: a fresh compile per length; dynamic: the first length's graph serves the rest
        assert rows[("aotforge_eager", "static", t)]["dynamo_graphs"] == 1
        assert rows[("aotforge_eager", "dynamic", t)]["dynamo_graphs"] == (1 if t == 8 else 0)
    # correctness is printed before the step's timing row
    check = out.index("[aotforge_eager dynamic T=12] first call")
    assert "relative error vs eager (loss, grads): loss" in out[check:check + 200]
    assert check < out.index("| aotforge_eager | dynamic | 12 | OK |")
    assert "| T | eager ms | aotforge_eager dynamic ms | aotforge_eager static ms | aotforge_eager dynamic/static (<= 1.10) |" in out
    assert "aotforge_eager dynamic: 1 Dynamo graph(s)" in out


def test_child_past_its_limit_gives_timeout_rows_and_the_run_goes_on(tmp_path, capsys):
    path = tmp_path / "dynamic.json"
    code = dynamic_shapes.main(["--small", "--device", "cpu", "--backends", "eager,aotforge_eager", "--modes", "static",
                                "--timeout", "0.5", "--json", str(path)])
    assert code == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["backend"], r["T"], r["status"]) for r in rows] == [
        (b, t, "TIMEOUT after 0.5 s") for b in ("eager", "aotforge_eager") for t in (8, 12, 16)]
    assert "| aotforge_eager | static | 16 | TIMEOUT after 0.5 s |" in capsys.readouterr().out


def test_budget_skips_children_that_cannot_start(tmp_path):
    path = tmp_path / "dynamic.json"
    dynamic_shapes.main(["--small", "--device", "cpu", "--backends", "eager,aotforge_eager", "--budget", "1",
                         "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 9 and {r["status"] for r in rows} == {"SKIPPED (budget)"}


def test_a_wrong_gradient_is_reported(tmp_path):
    values = {"loss": torch.tensor(2.0), "grad w": torch.ones(4, 4), "grad norm (all)": torch.tensor(4.0)}
    reference = tmp_path / "eager-T8.pt"
    assert dynamic_shapes._correctness(values, reference, is_eager=True) == {"loss": 2.0}
    same = dynamic_shapes._correctness(values, reference, is_eager=False)
    assert same["correct"] and same["max_rel_error"] == 0.0
    wrong = dict(values, **{"grad w": torch.full((4, 4), 1.05)})
    result = dynamic_shapes._correctness(wrong, reference, is_eager=False)
    assert not result["correct"] and math.isclose(result["errors"]["grad w"], 0.05, rel_tol=1e-6)
    assert "WRONG (allowed 2e-02)" in dynamic_shapes._correctness_line(dict(result, backend="x", mode="dynamic", T=8,
                                                                            first_call_s=1.0))
    assert dynamic_shapes._correctness(values, tmp_path / "missing.pt", is_eager=False)["errors"] is None


def test_ratio_table_targets():
    def row(backend, mode, t, ms, status="OK"):
        return dict(backend=backend, mode=mode, T=t, median_ms=ms, status=status)

    rows = [row("eager", "eager", 512, 50.0),
            row("aotforge", "dynamic", 512, 21.0), row("aotforge", "static", 512, 20.0),
            row("inductor", "dynamic", 512, 22.0), row("inductor", "static", 512, 19.0),
            row("aotforge", "dynamic", 768, 33.0), row("aotforge", "static", 768, 29.0),
            row("inductor", "dynamic", 768, 30.0, status="WRONG"), row("inductor", "static", 768, 28.0)]
    text = dynamic_shapes.ratio_table(rows, ["eager", "inductor", "aotforge"])
    lines = text.splitlines()
    assert lines[0] == ("| T | eager ms | inductor dynamic ms | inductor static ms | aotforge dynamic ms | "
                        "aotforge static ms | inductor dynamic/static (<= 1.10) | aotforge dynamic/static (<= 1.10) | "
                        "aotforge dynamic vs inductor dynamic (>= 1.00x) |")
    assert lines[2] == "| 512 | 50.00 | 22.00 | 19.00 | 21.00 | 20.00 | 1.16 MISSED | 1.05 met | 1.05x met |"
    assert lines[3] == ("| 768 |  | 30.00 WRONG | 28.00 | 33.00 | 29.00 | 1.07 met (WRONG row) | 1.14 MISSED | "
                        "0.91x MISSED (WRONG row) |")


def test_plan_runs_eager_then_dynamic_then_static():
    assert dynamic_shapes.plan(["eager", "inductor", "aotforge"]) == [
        ("eager", "eager"), ("aotforge", "dynamic"), ("inductor", "dynamic"), ("aotforge", "static"),
        ("inductor", "static")]
