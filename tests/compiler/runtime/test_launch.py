"""Loading generated modules and choosing block sizes: thread safety, bounded autotune, and
autotune choices on disk that are damaged, planted or stale.

The autotune tests use a hand-written Triton row sum (run by the interpreter on the CPU) and
let the CPU "autotune" it, so that the cache is exercised exactly as on a GPU."""
import json
import threading
import time

import pytest
import torch

from aotforge.compiler.runtime import disk_cache, launch
from aotforge.compiler.runtime.disk_cache import CacheEntryWarning
from aotforge.config import config

from .conftest import forget_loaded_modules

ROW_SUM = '''
import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


# tl.reduce with our own combine function, as generated kernels do (Triton's interpreter
# sometimes fails on tl.sum after other tests ran)
@triton.jit
def row_sum(in_ptr, out_ptr, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    rindex = tl.arange(0, RBLOCK)[None, :]
    rmask = rindex < rnumel
    values = tl.load(in_ptr + xindex * rnumel + rindex, xmask & rmask, other=0.0)
    tl.store(out_ptr + xindex, tl.reduce(values, 1, _add)[:, None], xmask)
'''
ROWS, COLUMNS = 16, 64
CANDIDATES = [dict(XBLOCK=8, RBLOCK=64), dict(XBLOCK=4, RBLOCK=64), dict(XBLOCK=2, RBLOCK=64)]


@pytest.fixture
def cpu_autotune(monkeypatch, cache_dir):
    """Autotune on the CPU, for every size, among CANDIDATES."""
    monkeypatch.setattr(launch, "AUTOTUNE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(launch, "AUTOTUNE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(launch, "candidate_configs", lambda *args: [dict(c) for c in CANDIDATES])
    monkeypatch.setattr(config, "autotune", True)  # off by default (mode="max-autotune" turns it on)
    return cache_dir


def run_row_sum(**kernel_options):
    module = launch.load_module(ROW_SUM, "row_sum")
    kernel = launch.Kernel(module.row_sum, "row_sum", ROW_SUM, "persistent", ROWS, COLUMNS, True, False,
                           **kernel_options)
    x = torch.randn(ROWS, COLUMNS, dtype=torch.float64)
    out = torch.empty(ROWS, dtype=torch.float64)
    kernel.run(x, out)
    torch.testing.assert_close(out, x.sum(-1), rtol=0, atol=1e-12)
    return kernel


def autotune_file(directory):
    files = list(directory.glob("autotune_*.json"))
    assert len(files) == 1, files
    return files[0]


def test_autotune_choice_is_stored_and_served(cpu_autotune, monkeypatch):
    first = run_row_sum()
    assert first.best in CANDIDATES
    entry = json.loads(autotune_file(cpu_autotune).read_text())
    assert entry["config"] == first.best
    # served from disk: timing would call _time, which must not happen now
    monkeypatch.setattr(launch.Kernel, "_time",
                        lambda *args: pytest.fail("autotuned again despite a valid stored choice"))
    assert run_row_sum().best == first.best


def damage(entry: dict, how: str) -> bytes:
    if how == "empty":
        return b""
    if how == "truncated":
        return json.dumps(entry).encode()[:20]
    if how == "not a dict":
        return json.dumps([entry["config"]]).encode()
    if how == "bare config (old format)":
        return json.dumps(entry["config"]).encode()
    if how == "wrong key":
        return json.dumps(dict(entry, key="0" * 64)).encode()
    if how == "wrong candidate list":
        return json.dumps(dict(entry, candidates="0" * 64)).encode()
    if how == "choice not a candidate":  # a row block shorter than the row: a wrong sum if served
        return json.dumps(dict(entry, config=dict(XBLOCK=8, RBLOCK=16))).encode()
    if how == "binary":
        return b"\xff\xfe\x00garbage"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["empty", "truncated", "not a dict", "bare config (old format)", "wrong key",
                                 "wrong candidate list", "choice not a candidate", "binary"])
def test_bad_autotune_entry_is_ignored_and_rebuilt(cpu_autotune, how):
    run_row_sum()
    path = autotune_file(cpu_autotune)
    entry = json.loads(path.read_text())
    path.write_bytes(damage(entry, how))
    with pytest.warns(CacheEntryWarning):
        kernel = run_row_sum()  # checks the sum against eager
    assert kernel.best in CANDIDATES
    rebuilt = json.loads(path.read_text())
    assert rebuilt["key"] == entry["key"] and rebuilt["config"] in CANDIDATES


def test_changed_candidate_list_is_not_served_an_old_choice(cpu_autotune, monkeypatch):
    first = run_row_sum()
    others = [c for c in CANDIDATES if c != first.best]
    new_candidates = others + [dict(XBLOCK=1, RBLOCK=64)]
    monkeypatch.setattr(launch, "candidate_configs", lambda *args: [dict(c) for c in new_candidates])
    second = run_row_sum()
    assert second.best in new_candidates
    assert len(list(cpu_autotune.glob("autotune_*.json"))) == 2


def test_pointwise_and_small_kernels_do_not_autotune(cache_dir):
    with config.patch(autotune=True):
        pointwise = launch.Kernel(None, "k", "", "pointwise", 1 << 20, 1, True, False)
        small = launch.Kernel(None, "k", "", "looped", 64, 64, True, False)
        mutating = launch.Kernel(None, "k", "", "looped", 1 << 12, 1 << 12, True, True)
    assert not pointwise.tunes() and not small.tunes() and not mutating.tunes()
    with config.patch(autotune=False):
        assert not launch.Kernel(None, "k", "", "looped", 1 << 12, 1 << 12, True, False).tunes()


def test_candidate_lists_are_bounded(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's lists
    for numel in (1, 7, 100, 1 << 12, 1 << 20):
        pointwise = launch.candidate_configs("pointwise", numel, 1, True)
        assert len(pointwise) == 1 and pointwise[0]["XBLOCK"] <= max(1, launch.ceil_pow2(numel))
        for rnumel in (1, 33, 512, 2048, 4096, 1 << 16):
            for kind in ("persistent", "looped"):
                for contiguous in (True, False):
                    configs = launch.candidate_configs(kind, numel, rnumel, contiguous)
                    assert 1 <= len(configs) <= launch.MAX_CANDIDATES
                    assert len({json.dumps(c, sort_keys=True) for c in configs}) == len(configs)
                    if kind == "persistent":  # a row must fit in one block
                        assert all(c["RBLOCK"] >= rnumel for c in configs)


# --- loading modules from several threads ------------------------------------------------------

SLOW_MODULE = "import time\ntime.sleep(0.3)\nVALUE = {value}\n"


def test_threads_never_see_a_half_initialized_module(cache_dir):
    source = SLOW_MODULE.format(value=42)
    seen, errors = [], []

    def load():
        try:
            seen.append(launch.load_module(source, "slow"))
        except Exception as error:  # pragma: no cover  reported below
            errors.append(error)

    first = threading.Thread(target=load)
    first.start()
    time.sleep(0.1)  # the first thread is now executing the module body
    others = [threading.Thread(target=load) for _ in range(3)]
    for thread in others:
        thread.start()
    for thread in [first] + others:
        thread.join()
    assert errors == []
    assert all(module.VALUE == 42 for module in seen) and len({id(m) for m in seen}) == 1


def test_threads_loading_different_modules_at_once(cache_dir):
    barrier = threading.Barrier(8)
    results = {}

    def load(value):
        barrier.wait()
        results[value] = launch.load_module(f"VALUE = {value}\n" + "# padding\n" * 5000, "many")

    threads = [threading.Thread(target=load, args=(v,)) for v in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {v: m.VALUE for v, m in results.items()} == {v: v for v in range(8)}
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(".part")]


def test_failed_module_execution_leaves_nothing_registered(cache_dir):
    import sys

    source = "VALUE = 1\nraise ValueError('broken kernel module')\n"
    with pytest.raises(ValueError, match="broken kernel module"):
        launch.load_module(source, "broken")
    assert not [n for n in sys.modules if n.startswith("aotforge_generated_broken_")]
    with pytest.raises(ValueError, match="broken kernel module"):  # again: not served half-built
        launch.load_module(source, "broken")


def test_module_is_executed_from_its_source_not_the_file(cache_dir):
    module = launch.load_module("VALUE = 1\n", "pinned")
    path = module.__file__
    with open(path, "w") as handle:
        handle.write("VALUE = 2\n")
    forget_loaded_modules()
    disk_cache._warned.clear()
    with pytest.warns(CacheEntryWarning):
        assert launch.load_module("VALUE = 1\n", "pinned").VALUE == 1
    with open(path) as handle:
        assert handle.read() == "VALUE = 1\n"
