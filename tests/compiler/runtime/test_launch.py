"""Loading generated modules and choosing block sizes: thread safety, bounded autotune, and
autotune choices on disk that are damaged, planted or stale.

The autotune tests use a hand-written Triton row sum (run by the interpreter on the CPU) and
let the CPU "autotune" it, so that the cache is exercised exactly as on a GPU."""
import json
import threading
import time
import warnings

import pytest
import torch

from aotforge.compiler.runtime import disk_cache, launch, modules
from aotforge.compiler.runtime.disk_cache import CacheEntryWarning
from aotforge.config import config

from .conftest import forget_loaded_modules, twice_in_a_thread

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
    module = modules.load_module(ROW_SUM, "row_sum")
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
    if how == "deeply nested":
        return b"[" * 100_000 + b"]" * 100_000
    if how == "choice not a candidate, by other keys":
        return json.dumps(dict(entry, config=dict(entry["config"], RBLOCK=16, num_warps=4))).encode()
    raise AssertionError(how)


BAD_ENTRIES = ["empty", "truncated", "not a dict", "bare config (old format)", "wrong key", "wrong candidate list",
               "choice not a candidate", "choice not a candidate, by other keys", "binary", "deeply nested"]


@pytest.mark.parametrize("how", BAD_ENTRIES)
def test_bad_autotune_entry_is_ignored_with_one_warning_and_rebuilt(cpu_autotune, how):
    run_row_sum()
    path = autotune_file(cpu_autotune)
    entry = json.loads(path.read_text())
    path.write_bytes(damage(entry, how))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = run_row_sum()  # checks the sum against eager
        forget_loaded_modules()
        run_row_sum()  # the rebuilt entry verifies: no second warning
    assert [w.category for w in caught] == [CacheEntryWarning], [str(w.message) for w in caught]
    assert kernel.best in CANDIDATES
    rebuilt = json.loads(path.read_text())
    assert rebuilt["key"] == entry["key"] and rebuilt["config"] in CANDIDATES


def test_autotune_choice_equal_to_a_candidate_is_served_as_the_candidate(cpu_autotune):
    """JSON's 8.0 and true compare equal to 8 and 1: the candidate is served, never the
    stored copy (a float block size makes a float grid)."""
    first = run_row_sum()
    path = autotune_file(cpu_autotune)
    entry = json.loads(path.read_text())
    path.write_text(json.dumps(dict(entry, config={k: float(v) for k, v in entry["config"].items()})))
    served = run_row_sum().best
    assert served == first.best and all(type(v) is int for v in served.values())


@pytest.mark.parametrize("what", ["directory", "fifo"])
def test_autotune_entry_that_is_not_a_file_is_ignored_with_one_warning(cpu_autotune, what):
    """A folder or a pipe where the entry should be: no hang (reading a pipe blocks), no
    crash (a folder cannot be replaced by the rebuilt entry), one warning."""
    import os

    run_row_sum()
    path = autotune_file(cpu_autotune)
    path.unlink()
    path.mkdir() if what == "directory" else os.mkfifo(path)
    results = []
    caught = twice_in_a_thread(lambda: results.append(run_row_sum().best), path, timeout=60)
    assert len(results) == 2 and all(best in CANDIDATES for best in results)
    assert [w.category for w in caught] == [CacheEntryWarning], [str(w.message) for w in caught]


@pytest.mark.parametrize("change", ["old choice dropped", "candidate added"])
def test_changed_candidate_list_is_not_served_an_old_choice(cpu_autotune, monkeypatch, change):
    first = run_row_sum()
    if change == "old choice dropped":
        new_candidates = [c for c in CANDIDATES if c != first.best] + [dict(XBLOCK=1, RBLOCK=64)]
    else:  # the old choice is still a candidate, but the new one was never timed against it
        new_candidates = CANDIDATES + [dict(XBLOCK=1, RBLOCK=64)]
    monkeypatch.setattr(launch, "candidate_configs", lambda *args: [dict(c) for c in new_candidates])
    timed = []
    original_time = launch.Kernel._time
    monkeypatch.setattr(launch.Kernel, "_time", lambda self, args, candidate, on_gpu:
                        timed.append(candidate) or original_time(self, args, candidate, on_gpu))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheEntryWarning)  # another key, not a bad entry
        second = run_row_sum()
    assert timed == new_candidates  # tuned afresh among the new candidates
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
            seen.append(modules.load_module(source, "slow"))
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
        results[value] = modules.load_module(f"VALUE = {value}\n" + "# padding\n" * 5000, "many")

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
        modules.load_module(source, "broken")
    assert not [n for n in sys.modules if n.startswith("aotforge_generated_broken_")]
    with pytest.raises(ValueError, match="broken kernel module"):  # again: not served half-built
        modules.load_module(source, "broken")


def test_module_is_executed_from_its_source_not_the_file(cache_dir):
    module = modules.load_module("VALUE = 1\n", "pinned")
    path = module.__file__
    with open(path, "w") as handle:
        handle.write("VALUE = 2\n")
    forget_loaded_modules()
    disk_cache._warned.clear()
    with pytest.warns(CacheEntryWarning):
        assert modules.load_module("VALUE = 1\n", "pinned").VALUE == 1
    with open(path) as handle:
        assert handle.read() == "VALUE = 1\n"


# --- the config a kernel was compiled under --------------------------------------------------

def test_backward_first_launch_keeps_the_compile_fx_config_patches(cache_dir, tmp_path, monkeypatch):
    """``compile_fx(config_patches=...)`` compiles both graphs under the patches, but the
    backward's first launch (where autotune runs) comes later, outside them, maybe in
    autograd's thread. Each kernel keeps the autotune flag and cache folder it was compiled
    under: the backward's reductions are tuned as the forward's, into the patched folder."""
    from aotforge.compiler import compile_fx, observe

    monkeypatch.setattr(launch, "AUTOTUNE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(launch, "AUTOTUNE_MIN_ELEMENTS", 0)
    original_candidates = launch.candidate_configs

    def candidates(kind, numel, rnumel, contiguous):
        if kind == "pointwise":
            return original_candidates(kind, numel, rnumel, contiguous)
        return [dict(XBLOCK=x, RBLOCK=launch.ceil_pow2(rnumel)) for x in (16, 8, 4)]
    monkeypatch.setattr(launch, "candidate_configs", candidates)

    patched_dir = tmp_path / "patched"
    # forward: rows of x reduced along the contiguous dim; backward: w's gradient reduces
    # along the other dim (another kernel, not one shared with the forward)
    gm = torch.fx.symbolic_trace(lambda x, w: ((x * w).sum(1),))
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    with observe() as graphs:
        compiled = compile_fx(gm, [x, w], config_patches=dict(triton_on_cpu=True, autotune=True,
                                                               cache_dir=str(patched_dir)))
        (out,) = compiled(x, w)
        thread = threading.Thread(target=lambda: out.sum().backward())  # as autograd's device thread
        thread.start()
        thread.join()
    torch.testing.assert_close(w.grad, x.detach().sum(0))
    torch.testing.assert_close(x.grad, w.detach().expand(8, 16))
    assert [g.kind for g in graphs] == ["forward", "backward"]
    tuned = {g.kind: [k for k in g.launchers.values() if k.kind != "pointwise"] for g in graphs}
    assert tuned["forward"] and tuned["backward"]
    for kernel in tuned["forward"] + tuned["backward"]:
        assert kernel.autotune and kernel.cache_dir == str(patched_dir)
        assert kernel.seconds["autotune"] > 0
    assert len(list(patched_dir.glob("autotune_*.json"))) == len(tuned["forward"]) + len(tuned["backward"])
    assert not list(cache_dir.glob("autotune_*.json"))  # nothing in the unpatched folder
