"""The AOT cache for the kinds of compile issue 33 added: functionalized RNG (dropout), symbolic
sizes, outputs that alias inputs, and tensor subclasses (static layouts). In this process:
Dynamo's cache is reset between compiles, so each compile reaches the AOT cache as a restarted
process would. A hit must match the cold run (values, gradients, dropout masks) and eager.
Then two processes: the second one's aotforge time to its first result is at most half the
first's, through torch.compile and through aot_module / aot_function with compile_fx_inner."""
import json
import os
import subprocess
import sys

import pytest
import torch

from aotforge.config import config

from .runtime.conftest import forget_loaded_modules

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_start_worker.py")


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    from aotforge.compiler.runtime import disk_cache

    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(config, "cache", True)
    monkeypatch.setattr(disk_cache, "_warned", set())
    monkeypatch.setenv("AOTFORGE_LOG", "cache")
    forget_loaded_modules()
    yield tmp_path / "cache"
    forget_loaded_modules()
    torch._dynamo.reset()


def run(capsys, fn, args, dynamic=False, seed=0):
    """Compile ``fn`` from scratch and take one training step; returns (outputs, gradients of the
    inputs that require grad, the AOT cache's message)."""
    torch._dynamo.reset()
    forget_loaded_modules()
    capsys.readouterr()
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    compiled = torch.compile(fn, backend="aotforge", dynamic=dynamic)
    torch.manual_seed(seed)
    outputs = compiled(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    outputs[0].pow(2).sum().backward()
    grads = [a.grad for a in args if a.requires_grad]
    lines = [line for line in capsys.readouterr().err.splitlines() if ":aot: " in line]
    return outputs, grads, " / ".join(lines), args


def eager(fn, args, seed=0):
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    torch.manual_seed(seed)
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    outputs[0].pow(2).sum().backward()
    return outputs, [a.grad for a in args if a.requires_grad], args


def check_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def dropout_step(x, w):
    return torch.nn.functional.dropout(torch.nn.functional.gelu(x @ w), p=0.5, training=True).sum(-1)


def inputs(rows=8):
    generator = torch.Generator().manual_seed(rows)
    return [torch.randn(rows, 16, generator=generator), torch.randn(16, 8, generator=generator).requires_grad_()]


def test_dropout_hit_matches_the_cold_run_and_eager(cache_on, capsys):
    cold, cold_grads, message, _ = run(capsys, dropout_step, inputs())
    assert "AOT miss" in message
    for seed in (0, 1):  # the masks follow the generator: each seed's are eager's
        warm, warm_grads, message, _ = run(capsys, dropout_step, inputs(), seed=seed)
        assert "AOT hit" in message, message
        want, want_grads, _ = eager(dropout_step, inputs(), seed=seed)
        check_same(warm, want)
        check_same(warm_grads, want_grads)
        if seed == 0:
            check_same(warm, cold)
            check_same(warm_grads, cold_grads)
    state = torch.get_rng_state()  # and the generator advanced as eager's did
    torch.manual_seed(1)
    eager(dropout_step, inputs(), seed=1)
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())
    del state


def scaled(x, w):
    return (x * w).sum(-1).softmax(-1)


def test_symbolic_sizes_one_entry_serves_every_size(cache_on, capsys):
    assert "AOT miss" in run(capsys, scaled, [torch.randn(8, 16), torch.randn(16).requires_grad_()], dynamic=True)[2]
    entries = set(cache_on.glob("compile_*.json"))
    for rows in (12, 5, 30):
        args = [torch.randn(rows, 16), torch.randn(16).requires_grad_()]
        got, grads, message, _ = run(capsys, scaled, args, dynamic=True)
        assert "AOT hit" in message, (rows, message)
        want, want_grads, _ = eager(scaled, args)
        check_same(got, want)
        check_same(grads, want_grads)
    assert set(cache_on.glob("compile_*.json")) == entries  # the same entry served each size


def branchy(x, w):
    if x.shape[0] > 10:  # a shape guard Dynamo records; the entry keeps it
        return (x * w).sum(-1)
    return (x * w).sum(-1) * 2


def test_symbolic_sizes_outside_the_guards_miss(cache_on, capsys):
    run(capsys, branchy, [torch.randn(16, 8), torch.randn(8).requires_grad_()], dynamic=True)
    assert "AOT hit" in run(capsys, branchy, [torch.randn(24, 8), torch.randn(8).requires_grad_()], dynamic=True)[2]
    # (the other side of the branch is another Dynamo graph: its own entry)
    message = run(capsys, branchy, [torch.randn(4, 8), torch.randn(8).requires_grad_()], dynamic=True)[2]
    assert "AOT miss" in message, message


def mutate_and_alias(x, w):
    x.mul_(2)  # an input mutated in place
    return (x * w).sum(-1), x.view(-1), x.t()  # outputs that are views of that input


def test_aliased_outputs_hit_and_are_views_of_the_input(cache_on, capsys):
    args = [torch.randn(4, 4), torch.randn(4).requires_grad_()]
    cold = run(capsys, mutate_and_alias, args)
    warm_out, warm_grads, message, warm_args = run(capsys, mutate_and_alias, args)
    assert "AOT hit" in message, message
    want, want_grads, want_args = eager(mutate_and_alias, args)
    check_same(warm_out, want)
    check_same(warm_out, cold[0])
    check_same(warm_grads, want_grads)
    torch.testing.assert_close(warm_args[0], want_args[0])  # the input's update
    x = warm_args[0]
    assert warm_out[1]._base is x and warm_out[2]._base is x
    warm_out[1].zero_()  # a real view: writing it writes the caller's tensor
    assert torch.equal(x, torch.zeros(4, 4))


def double_and_mix(x, w):
    return (x * 2).sin() * w


def twotensor_inputs():
    from torch.testing._internal.two_tensor import TwoTensor

    generator = torch.Generator().manual_seed(0)
    x = TwoTensor(torch.randn(4, 3, generator=generator), torch.randn(4, 3, generator=generator)).requires_grad_()
    return [x, torch.randn(3, generator=generator)]


def subclass_run(capsys, fn, args):
    torch._dynamo.reset()
    forget_loaded_modules()
    capsys.readouterr()
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = torch.compile(fn, backend="aotforge")(*args)
    out.sum().backward()
    lines = [line for line in capsys.readouterr().err.splitlines() if ":aot: " in line]
    return out, args[0].grad, " / ".join(lines)


def test_subclass_inputs_hit_and_match_the_cold_run_and_eager(cache_on, capsys):
    """A wrapper subclass with __torch_dispatch__ (TwoTensor) in and out: the entry keeps its
    layout (class, flatten context, inner attributes), and a hit rebuilds the subclass
    wrapper around the plain graphs."""
    from torch.testing._internal.two_tensor import TwoTensor

    cold, cold_grad, message = subclass_run(capsys, double_and_mix, twotensor_inputs())
    assert "AOT miss" in message and "not stored" not in message, message
    warm, warm_grad, message = subclass_run(capsys, double_and_mix, twotensor_inputs())
    assert "AOT hit" in message, message
    args = twotensor_inputs()
    want = double_and_mix(*args)
    want.sum().backward()
    for got in (warm, cold):
        assert type(got) is TwoTensor
        torch.testing.assert_close(got.a, want.a)
        torch.testing.assert_close(got.b, want.b)
    assert type(warm_grad) is TwoTensor
    torch.testing.assert_close(warm_grad.a, args[0].grad.a)
    torch.testing.assert_close(warm_grad.b, cold_grad.b)
    with torch.no_grad():  # inference: its own entry, hit too
        for expected in ("AOT miss", "AOT hit"):
            torch._dynamo.reset()
            forget_loaded_modules()
            capsys.readouterr()
            got = torch.compile(double_and_mix, backend="aotforge")(*twotensor_inputs())
            assert expected in capsys.readouterr().err
            torch.testing.assert_close(got.a, double_and_mix(*twotensor_inputs()).a)


def test_a_plain_input_where_a_subclass_was_misses(cache_on, capsys):
    subclass_run(capsys, double_and_mix, twotensor_inputs())
    x, w = twotensor_inputs()
    plain = [x.a.detach().clone().requires_grad_(), w]
    message = subclass_run(capsys, double_and_mix, plain)[2]
    assert "AOT hit" not in message, message


# --- two processes --------------------------------------------------------------------------------

def run_worker(path: str, directory) -> dict:
    environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       AOTFORGE_LOG="cache")
    environment.pop("AOTFORGE_CACHE", None)
    out = subprocess.run([sys.executable, WORKER, path, str(directory)], cwd=ROOT, env=environment,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("path", ["compile", "dynamic", "aot_function", "function", "function_dynamic"])
def test_a_second_process_takes_at_most_half_the_time(tmp_path, path):
    """torch.compile (static, dynamic), aot_module and aot_function (static, dynamic) with
    compile_fx_inner, on a model with dropout."""
    cold = run_worker(path, tmp_path / "cache")
    warm = run_worker(path, tmp_path / "cache")
    assert warm["out"] == cold["out"] and warm["grads"] == cold["grads"]  # dropout masks included
    assert any("AOT hit" in line for line in warm["log"]), warm["log"]
    assert not any("C++ library built" in line for line in warm["log"]), warm["log"]
    assert warm["seconds"] <= 0.5 * cold["seconds"], (cold["seconds"], warm["seconds"])
