"""aotforge.config: patches are per thread, unknown names and unusable values are rejected."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from aotforge.config import config


def test_patch_is_visible_only_in_its_thread():
    inside_patch = threading.Event()
    other_thread_checked = threading.Event()
    seen: dict[str, object] = {}

    def patching_thread():
        with config.patch(activation_memory_budget=0.25, cache_size_limit=3):
            seen["patcher"] = (config.activation_memory_budget, config.cache_size_limit)
            inside_patch.set()
            other_thread_checked.wait(timeout=30)
            seen["patcher_after_other"] = config.activation_memory_budget
        seen["patcher_after_exit"] = config.activation_memory_budget

    def reading_thread():
        inside_patch.wait(timeout=30)
        seen["reader"] = (config.activation_memory_budget, config.cache_size_limit)
        with config.patch(activation_memory_budget=0.75):  # its own patch does not leak back
            seen["reader_patched"] = config.activation_memory_budget
        other_thread_checked.set()

    threads = [threading.Thread(target=patching_thread), threading.Thread(target=reading_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    default_limit = config.cache_size_limit
    assert seen["patcher"] == (0.25, 3)
    assert seen["reader"] == (1.0, default_limit)
    assert seen["reader_patched"] == 0.75
    assert seen["patcher_after_other"] == 0.25
    assert seen["patcher_after_exit"] == 1.0
    assert config.activation_memory_budget == 1.0


def test_nested_patches_restore_in_order_and_assignment_inside_a_patch_stays_in_it():
    before, autotune = config.cache_size_limit, config.autotune
    with config.patch(cache_size_limit=5):
        with config.patch(cache_size_limit=6, autotune=not autotune):
            assert (config.cache_size_limit, config.autotune) == (6, not autotune)
        assert (config.cache_size_limit, config.autotune) == (5, autotune)
        config.cache_size_limit = 7
        assert config.cache_size_limit == 7
    assert config.cache_size_limit == before
    assert config.to_dict()["cache_size_limit"] == before


def test_unknown_option_is_rejected_with_the_known_names():
    with pytest.raises(AttributeError, match=r"no option\(s\) \['not_an_option'\].*known options"):
        with config.patch(not_an_option=1):
            pass


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        with config.patch(triton_on_cpu=True):
            pass
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with config.patch(triton_on_cpu=True):
        assert config.triton_on_cpu


def test_triton_on_cpu_from_the_environment_fails_at_import():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["AOTFORGE_TRITON_ON_CPU"] = "1"
    result = subprocess.run([sys.executable, "-c", "import aotforge"], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr


def test_backward_compiled_in_another_thread_sees_the_forward_patch():
    # autograd runs a CUDA backward in its device thread; the lazily compiled backward graph
    # must still see the patch that was active when the forward compiled
    import threading

    import torch

    import aotforge

    seen = {}

    def backward_compiler(gm, example_inputs):
        seen["budget"] = aotforge.config.activation_memory_budget
        return gm

    fn = aotforge.aot_function(lambda x: x.sin() * 2, aotforge.nop, backward_compiler)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with aotforge.config.patch(activation_memory_budget=0.25):
        out = fn(x)
    thread = threading.Thread(target=lambda: out.sum().backward())
    thread.start()
    thread.join()
    assert seen["budget"] == 0.25
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
