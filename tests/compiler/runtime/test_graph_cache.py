"""The compiled-graph cache: a new process loads what an earlier one compiled, and gets eager's
answers; any change to what the result depends on misses; a damaged entry is rebuilt.

Processes: cache_worker.py compiles one case through torch.compile (Triton on the CPU via the
interpreter) in a fresh interpreter and compares it with eager there. In-process tests call
``compile_fx_inner`` directly: its lookup reads the disk every time, as a new process would."""
import json
import os
import subprocess
import sys

import pytest
import torch

from aotforge.compiler import compile_fx_inner
from aotforge.compiler.runtime import disk_cache, graph_cache, keys
from aotforge.compiler.runtime.disk_cache import CacheEntryWarning
from aotforge.config import config

from ..helpers import trace
from .conftest import forget_loaded_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache_worker.py")


@pytest.fixture
def cache_on(cache_dir, monkeypatch):
    monkeypatch.setattr(config, "cache", True)
    monkeypatch.setenv("AOTFORGE_LOG", "cache")
    yield cache_dir


def start_worker(case: str, directory, size: int = 8) -> subprocess.Popen:
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    environment.pop("AOTFORGE_CACHE", None)
    return subprocess.Popen([sys.executable, WORKER, case, str(directory), str(size)], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["problems"] == [], report
    return report


def run_worker(case: str, directory, size: int = 8) -> dict:
    return finish(start_worker(case, directory, size))


def outcomes(report: dict) -> list[str]:
    """'hit' or 'miss' per compiled graph, in compile order."""
    return ["hit" if "compiled-graph hit" in line else "miss" for line in report["log"] if "compiled-graph" in line]


# --- a new process -------------------------------------------------------------------------------

def aot_outcome(report: dict) -> str:
    """What the AOT cache did for the compile: hit, miss or not stored (with the reason)."""
    lines = [line.split(": ", 2)[2] for line in report["log"] if ":aot: " in line]
    return " / ".join(lines)


# case -> what the AOT cache does with it (the compiled-graph cache hits for every case)
AOT_OUTCOME = {
    "mlp": "AOT hit",
    "mutation": "AOT hit",  # an input mutated in place: the epilogue's write-back is plain data
    "inference": "AOT hit",
    "mutation_and_alias": "AOT hit",  # the output's view replay is plain data
    "dropout": "AOT hit",  # functionalized RNG (eager's generator: fallback_random)
    "cpu_fx": "AOT hit",  # graphs that run as FX code: the entry holds the code
    "cpu_cpp": "AOT hit",  # C++ kernels: the entry's library comes from the C++ library cache
}


@pytest.mark.parametrize("case", sorted(AOT_OUTCOME))
def test_second_process_hits_and_matches_eager(tmp_path, case):
    """Values, gradients, the mutated input, the output aliasing the input, the RNG state
    after the call: eager's, in the process that compiled and in the one that loaded."""
    first = run_worker(case, tmp_path / "cache")
    graphs = 0 if case == "cpu_fx" else 1 if case == "inference" else 2  # forward and backward, or inference
    assert outcomes(first) == ["miss"] * graphs, first
    second = run_worker(case, tmp_path / "cache")
    assert outcomes(second) == ["hit"] * graphs, second
    assert second["warnings"] == []
    assert AOT_OUTCOME[case] in aot_outcome(second if AOT_OUTCOME[case] == "AOT hit" else first), (first, second)


def test_dynamic_entry_hits_within_its_guards_and_misses_outside(tmp_path):
    """``branch`` guards ``x.shape[0] > 10`` (both sides trace the same graph): a new size on the
    same side hits, a size on the other side misses on the stored guards."""
    assert outcomes(run_worker("branch", tmp_path / "cache", 16)) == ["miss", "miss"]
    assert outcomes(run_worker("branch", tmp_path / "cache", 24)) == ["hit", "hit"]
    outside = run_worker("branch", tmp_path / "cache", 4)
    assert outcomes(outside) == ["miss", "miss"]
    assert "outside the entry's guards" in [line for line in outside["log"] if "compiled-graph" in line][0]
    # both variants are kept: each side now hits
    assert outcomes(run_worker("branch", tmp_path / "cache", 6)) == ["hit", "hit"]
    assert outcomes(run_worker("branch", tmp_path / "cache", 12)) == ["hit", "hit"]


def test_two_processes_compile_into_one_folder_at_once(tmp_path):
    processes = [start_worker("mlp", tmp_path / "cache") for _ in range(2)]
    reports = [finish(p) for p in processes]
    assert all(r["warnings"] == [] for r in reports), reports
    assert outcomes(run_worker("mlp", tmp_path / "cache")) == ["hit", "hit"]
    assert not [p for p in os.listdir(tmp_path / "cache") if p.endswith(".part")]


# --- in this process: what the key holds ------------------------------------------------------------

def scaled_row_sum(x, y):
    return ((x * 2.0 + y.sin()).sum(-1),)


X = torch.randn(8, 32, dtype=torch.float64)
Y = torch.randn(8, 32, dtype=torch.float64)


def compile_and_check(fn, *args, capsys=None, kind: str = "forward", gm=None, **patches):
    """Compile ``fn`` (or its graph ``gm``) for ``args``, compare with eager; returns the
    cache's message."""
    gm = gm if gm is not None else trace(fn, *args)
    forget_loaded_modules()
    if capsys is not None:
        capsys.readouterr()
    with config.patch(triton_on_cpu=True, **patches):
        compiled = compile_fx_inner(gm, list(args), is_inference=kind == "inference")
        outputs = compiled([a.clone() for a in args])
    for got, want in zip(outputs, fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if want.dtype == torch.float64 else 1e-4)
    if capsys is None:
        return ""
    lines = [line for line in capsys.readouterr().err.splitlines() if "compiled-graph" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_same_graph_hits(cache_on, capsys):
    assert "miss (nothing stored yet" in compile_and_check(scaled_row_sum, X, Y, capsys=capsys)
    assert "hit" in compile_and_check(scaled_row_sum, X, Y, capsys=capsys)


def other_graph(x, y):
    return ((x * 3.0 + y.cos()).sum(-1),)


CHANGES = {
    "graph": dict(fn=other_graph),
    "inputs": dict(args=(X[:4], Y[:4])),  # shapes
    "inputs ": dict(args=(X.float(), Y.float())),  # dtypes
    "inputs  ": dict(args=(X.t().contiguous().t(), Y)),  # strides
    "inputs   ": dict(args=(X.requires_grad_(False).clone().requires_grad_(), Y)),  # requires_grad
    "kind": dict(kind="inference"),
    "config": dict(patches=dict(persistent_reduction_limit=16)),
}


@pytest.mark.parametrize("part", sorted(CHANGES))
def test_each_key_part_misses_when_changed(cache_on, capsys, part):
    compile_and_check(scaled_row_sum, X, Y, capsys=capsys)
    change = CHANGES[part]
    message = compile_and_check(change.get("fn", scaled_row_sum), *change.get("args", (X, Y)), capsys=capsys,
                                kind=change.get("kind", "forward"), **change.get("patches", {}))
    # (the kind is also part of the name the index explains misses by)
    expected = "miss (nothing stored yet for graph:inference)" if part == "kind" else f"miss (changed: {part.strip()})"
    assert expected in message, message


def test_versions_changed_misses(cache_on, capsys, monkeypatch):
    compile_and_check(scaled_row_sum, X, Y, capsys=capsys)
    monkeypatch.setattr(keys, "_source_digest", "an edited aotforge")
    assert "miss (changed: versions)" in compile_and_check(scaled_row_sum, X, Y, capsys=capsys)
    monkeypatch.setattr(keys, "_source_digest", None)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert "miss (changed: versions)" in compile_and_check(scaled_row_sum, X, Y, capsys=capsys)


def with_constant(values):
    """A graph reading ``values`` as a get_attr constant (as AOT graphs hold small tensors)."""
    constant = torch.tensor(values, dtype=torch.float64)
    gm = trace(lambda x, y, c: ((x * c + y).sum(-1),), X, Y, constant)
    placeholder = gm.graph.find_nodes(op="placeholder")[2]
    gm.register_buffer("_tensor_constant0", constant)
    with gm.graph.inserting_before(placeholder):
        attribute = gm.graph.get_attr("_tensor_constant0")
    attribute.meta = dict(placeholder.meta)
    placeholder.replace_all_uses_with(attribute)
    gm.graph.erase_node(placeholder)
    gm.recompile()
    return (lambda x, y: ((x * constant + y).sum(-1),)), gm


def test_constant_values_are_keyed_and_restored(cache_on, capsys):
    row = [float(i) for i in range(32)]
    fn, gm = with_constant(row)
    compile_and_check(fn, X, Y, capsys=capsys, gm=gm)
    fn, gm = with_constant(row)
    assert "hit" in compile_and_check(fn, X, Y, capsys=capsys, gm=gm)  # restored from the entry
    fn, gm = with_constant(row[::-1])
    changed = compile_and_check(fn, X, Y, capsys=capsys, gm=gm)
    assert "miss (changed: constants)" in changed, changed


def test_cache_off_stores_nothing(cache_on):
    with config.patch(cache=False):
        compile_and_check(scaled_row_sum, X, Y)
    assert not list(cache_on.glob("graph_*.json"))


def test_symbolic_sizes_guards_round_trip():
    assert graph_cache._evaluate("Eq(Mod(s0, 2), 0)", {"s0": 4}) is True
    assert graph_cache._evaluate("s0 <= 10", {"s0": 11}) is False
    entry = dict(symbols={"s0": [16, 11, None]}, guards=["s0 > 10"])
    assert graph_cache._failed_guard(entry, {"s0": (24, 11, None)}) is None
    assert "outside" in graph_cache._failed_guard(entry, {"s0": (4, 2, 10)})
    assert "symbols" in graph_cache._failed_guard(entry, {"s1": (4, 2, None)})


# --- damaged entries ----------------------------------------------------------------------------------

def entry_file(directory):
    files = sorted(directory.glob("graph_*.json"))
    assert len(files) == 1, files
    return files[0]


def damaged_recompiles(directory, damage, capsys, why: str) -> None:
    compile_and_check(scaled_row_sum, X, Y, capsys=capsys)
    path = entry_file(directory)
    original = path.read_bytes()
    path.write_bytes(damage(original))
    disk_cache._warned.clear()
    with pytest.warns(CacheEntryWarning, match=why) as record:
        message = compile_and_check(scaled_row_sum, X, Y, capsys=capsys)  # eager's answer
    assert len(record) == 1
    assert "miss" in message
    assert "hit" in compile_and_check(scaled_row_sum, X, Y, capsys=capsys)  # rebuilt


@pytest.mark.parametrize("cut", [0, 1, 40, 64, 65, 200, -1])
def test_truncated_entry_recompiles(cache_on, capsys, cut):
    why = "does not match its hash"
    damaged_recompiles(cache_on, lambda data: data[:cut] if cut >= 0 else data[:-1], capsys, why)


def test_corrupt_entry_recompiles(cache_on, capsys):
    def flip(data: bytes) -> bytes:
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]
    damaged_recompiles(cache_on, flip, capsys, "does not match its hash")


def test_resealed_but_wrong_content_recompiles(cache_on, capsys):
    """An entry whose seal matches but whose program cannot be loaded (edited and re-hashed):
    ignored, never a crash."""
    def edit(data: bytes) -> bytes:
        body = json.loads(data.partition(b"\n")[2])
        body["variants"][0]["namespace"] = {"device_0": {"nonsense": 1}}
        raw = json.dumps(body).encode()
        return disk_cache.digest(raw).encode() + b"\n" + raw
    damaged_recompiles(cache_on, edit, capsys, "cannot be loaded")


def test_swapped_entry_recompiles(cache_on, capsys):
    """Another graph's (well-sealed) entry under this graph's name is refused by its key."""
    compile_and_check(other_graph, X, Y, capsys=capsys)
    other = entry_file(cache_on)
    other_bytes = other.read_bytes()
    other.unlink()
    damaged_recompiles(cache_on, lambda data: other_bytes, capsys, "made for another key")


def test_folder_in_place_of_entry_is_survived(cache_on, capsys):
    compile_and_check(scaled_row_sum, X, Y, capsys=capsys)
    path = entry_file(cache_on)
    path.unlink()
    path.mkdir()
    disk_cache._warned.clear()
    with pytest.warns(CacheEntryWarning):
        compile_and_check(scaled_row_sum, X, Y, capsys=capsys)


# --- the command line ------------------------------------------------------------------------------

def test_cache_info_and_clear(cache_on, capsys):
    from aotforge.cli import main

    compile_and_check(scaled_row_sum, X, Y)
    (cache_on / "notes.txt").write_text("not ours")
    capsys.readouterr()
    assert main(["cache", "info"]) == 0
    info = capsys.readouterr().out
    assert str(cache_on) in info
    assert [line.split()[2] for line in info.splitlines() if "compiled graphs" in line] == ["1"]
    assert [line.split()[2] for line in info.splitlines() if "kernel modules" in line] == ["1"]
    assert main(["cache", "clear"]) == 0
    assert "removed 3 entries" in capsys.readouterr().out  # the graph, its kernel, the miss index
    assert sorted(p.name for p in cache_on.iterdir()) == ["notes.txt"]  # only aotforge's entries


def test_cache_info_on_a_folder_it_would_not_use(tmp_path, monkeypatch, capsys):
    from aotforge.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(config, "cache_dir", str(shared))
    assert main(["cache", "clear"]) == 1
    assert "writable by other users" in capsys.readouterr().out
