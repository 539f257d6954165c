"""The AOT cache behind aot_function / aot_module with compile_fx_inner (compiler/function_cache.py).
In this process: each compile is a new aot_function (its in-memory cache empty) with the loaded
kernel modules forgotten, so it reaches the disk as a restarted process would. A hit must match
the cold run and eager (values, gradients, dropout masks). Two processes: test_aot_cache_kinds.py."""
import pytest
import torch

import aotforge
from aotforge.compiler import compile_fx_inner
from aotforge.config import config

from .runtime.conftest import forget_loaded_modules
from .test_aot_cache_kinds import check_same, dropout_step, inputs


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


def run(capsys, fn, args, dynamic=False, seed=0, compiler=compile_fx_inner, **options):
    """A fresh aot_function of ``fn``, one training step; (outputs, input gradients, the AOT
    cache's messages)."""
    forget_loaded_modules()
    capsys.readouterr()
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    compiled = aotforge.aot_function(fn, compiler, dynamic=dynamic, **options)
    torch.manual_seed(seed)
    outputs = compiled(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if outputs[0].requires_grad:
        outputs[0].pow(2).sum().backward()
    grads = [a.grad for a in args if a.requires_grad]
    lines = [line for line in capsys.readouterr().err.splitlines() if ":aot: " in line or ":aot " in line]
    return outputs, grads, " / ".join(lines)


def eager(fn, args, seed=0):
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    torch.manual_seed(seed)
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if outputs[0].requires_grad:
        outputs[0].pow(2).sum().backward()
    return outputs, [a.grad for a in args if a.requires_grad]


def test_dropout_hit_matches_the_cold_run_and_eager(cache_on, capsys):
    cold, cold_grads, message = run(capsys, dropout_step, inputs())
    assert "AOT miss" in message, message
    for seed in (0, 3):  # the masks follow the generator, as eager's
        warm, warm_grads, message = run(capsys, dropout_step, inputs(), seed=seed)
        assert "AOT hit" in message, message
        want, want_grads = eager(dropout_step, inputs(), seed=seed)
        check_same(warm, want)
        check_same(warm_grads, want_grads)
        if seed == 0:
            check_same(warm, cold)
            check_same(warm_grads, cold_grads)


def test_inference_and_aot_module_hit(cache_on, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    messages = []
    for _ in range(2):
        forget_loaded_modules()
        capsys.readouterr()
        got = aotforge.aot_module(model, compile_fx_inner)(x)
        got.sum().backward()  # a training compile is stored once its backward compiled (lazily)
        messages.append(capsys.readouterr().err)
        torch.testing.assert_close(got, model(x))
    assert "AOT miss" in messages[0] and "AOT hit" in messages[1], messages
    with torch.no_grad():  # an inference compile: its own entry
        assert "AOT miss" in run(capsys, dropout_step, [x.new_ones(3, 16), torch.randn(16, 8)])[2]
        assert "AOT hit" in run(capsys, dropout_step, [x.new_ones(3, 16), torch.randn(16, 8)])[2]


def scaled(x, w):
    return (x * w).sum(-1).softmax(-1)


def test_dynamic_one_entry_serves_every_size(cache_on, capsys):
    assert "AOT miss" in run(capsys, scaled, [torch.randn(8, 16), torch.randn(16).requires_grad_()], dynamic=True)[2]
    entries = set(cache_on.glob("compile_*.json"))
    for rows in (12, 5, 12):  # 12 twice: the second time through the entry named at those sizes
        args = [torch.randn(rows, 16), torch.randn(16).requires_grad_()]
        got, grads, message = run(capsys, scaled, args, dynamic=True)
        assert "AOT hit" in message, (rows, message)
        want, want_grads = eager(scaled, args)
        check_same(got, want)
        check_same(grads, want_grads)
    assert set(cache_on.glob("compile_*.json")) == entries  # one compiled entry served each size
    assert len(list(cache_on.glob("sizes_*.json"))) == 3  # and is named at each size seen


def test_a_hit_at_one_size_still_checks_a_later_call_of_another(cache_on, capsys):
    run(capsys, scaled, [torch.randn(8, 16), torch.randn(16).requires_grad_()], dynamic=True)
    forget_loaded_modules()
    compiled = aotforge.aot_function(scaled, compile_fx_inner, dynamic=True)
    for rows in (8, 3, 8, 40):  # the hit at 8 was named at 8: 3 and 40 go through the symbolic entry
        x, w = torch.randn(rows, 16), torch.randn(16)
        torch.testing.assert_close(compiled(x, w), scaled(x, w))


def branchy(x, w):
    if x.shape[0] > 10:  # a shape guard; the entry keeps it
        return (x * w).sum(-1)
    return (x * w).sum(-1) * 2


def test_dynamic_sizes_outside_the_guards_miss(cache_on, capsys):
    run(capsys, branchy, [torch.randn(16, 8), torch.randn(8).requires_grad_()], dynamic=True)
    assert "AOT hit" in run(capsys, branchy, [torch.randn(24, 8), torch.randn(8).requires_grad_()], dynamic=True)[2]
    args = [torch.randn(4, 8), torch.randn(8).requires_grad_()]
    got, grads, message = run(capsys, branchy, args, dynamic=True)
    assert "AOT miss" in message, message
    want, want_grads = eager(branchy, args)
    check_same(got, want)
    check_same(grads, want_grads)


def mutate_and_alias(x, w):
    x.mul_(2)
    return (x * w).sum(-1), x.view(-1)


def test_mutated_input_and_aliased_output_hit(cache_on, capsys):
    args = [torch.randn(4, 4), torch.randn(4).requires_grad_()]
    for expected in ("AOT miss", "AOT hit"):
        x = args[0].clone()
        forget_loaded_modules()
        capsys.readouterr()
        w = args[1].detach().clone().requires_grad_()
        out, view = aotforge.aot_function(mutate_and_alias, compile_fx_inner)(x, w)
        out.sum().backward()
        assert expected in capsys.readouterr().err
        ex = args[0].clone()
        want, want_view = mutate_and_alias(ex, args[1].detach())
        torch.testing.assert_close(x, ex)
        torch.testing.assert_close(out, want)
        assert view._base is x


def test_a_changed_closure_tensor_or_code_misses(cache_on, capsys):
    scale = torch.full((8,), 2.0)

    def f(x):
        return (x * scale).sum()

    def g(x):
        return (x * scale).mean()

    x = torch.randn(8, requires_grad=True)
    assert "AOT miss" in run(capsys, f, [x])[2]
    assert "AOT hit" in run(capsys, f, [x])[2]
    scale.fill_(3.0)  # a tensor read from outside: a constant of the trace, keyed by its bytes
    out, _, message = run(capsys, f, [x])
    assert "AOT miss" in message and "constants" in message, message
    torch.testing.assert_close(out[0], (x * 3.0).sum())
    g.__name__ = "f"
    assert "changed: graph" in run(capsys, g, [x])[2]


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def with_function(x):
    return Twice.apply(x).sin()


def with_hook(x):
    y = x * 2
    y.register_hook(lambda grad: grad * 10)
    return y.sum()


@pytest.mark.parametrize("fn, why", [(with_function, "custom autograd.Function"), (with_hook, "register_hook")])
def test_what_the_trace_does_not_record_is_not_cached(cache_on, capsys, fn, why):
    x = torch.randn(4, requires_grad=True)
    for _ in range(2):
        got, grads, message = run(capsys, fn, [x])
        assert "AOT compile not cached" in message and why in message, message
        want, want_grads = eager(fn, [x])
        check_same(got, want)
        check_same(grads, want_grads)
    assert not list(cache_on.glob("compile_*.json"))


def test_a_compiler_of_the_callers_own_is_not_cached(cache_on, capsys):
    from aotforge.aot.boxing import make_boxed_func

    def mine(gm, example_inputs):
        return make_boxed_func(gm.forward)

    assert "a compiler of the caller's own" in run(capsys, scaled, [torch.randn(3, 4), torch.randn(4)],
                                                   compiler=mine)[2]


def test_the_options_are_in_the_key(cache_on, capsys):
    args = [torch.randn(4, 4), torch.randn(4).requires_grad_()]
    run(capsys, scaled, args)
    assert "changed: options" in run(capsys, scaled, args, keep_inference_input_mutations=True)[2]


# --- one miss per key part; damaged entries --------------------------------------------------------

def change_inputs(args):
    return [torch.randn(6, 16), args[1]]


@pytest.mark.parametrize("part", ["inputs", "mode", "config", "versions"])
def test_each_key_part_misses_when_changed(cache_on, capsys, monkeypatch, part):
    """(graph, constants and options: the tests above)"""
    from aotforge.compiler.runtime import keys

    args = [torch.randn(4, 16), torch.randn(16).requires_grad_()]
    assert "AOT miss (nothing stored yet" in run(capsys, scaled, args)[2]
    assert "AOT hit" in run(capsys, scaled, args)[2]
    if part == "inputs":
        args = change_inputs(args)
    elif part == "mode":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    elif part == "config":
        monkeypatch.setattr(config, "persistent_reduction_limit", config.persistent_reduction_limit // 2)
    else:
        monkeypatch.setattr(keys, "_source_digest", "an edited aotforge")
    got, grads, message = run(capsys, scaled, args)
    assert f"AOT miss (changed: {part})" in message, message
    want, want_grads = eager(scaled, args)
    check_same(got, want)
    check_same(grads, want_grads)


def only(directory, pattern):
    (path,) = directory.glob(pattern)
    return path


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "swapped"])
def test_a_damaged_entry_is_refused_and_rebuilt(cache_on, capsys, damage):
    from aotforge.compiler.runtime.disk_cache import CacheEntryWarning

    args = [torch.randn(4, 16), torch.randn(16).requires_grad_()]
    if damage == "swapped":  # another compile's well-sealed entry under this one's name
        run(capsys, dropout_step, inputs())
        other = only(cache_on, "compile_*.json")
        other_bytes = other.read_bytes()
        other.unlink()
    run(capsys, scaled, args)
    path = only(cache_on, "compile_*.json")
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "bit-flipped":
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x04
        path.write_bytes(bytes(flipped))
    else:
        path.write_bytes(other_bytes)
    match = "made for another key" if damage == "swapped" else "does not match its hash|not valid JSON"
    with pytest.warns(CacheEntryWarning, match=match):
        got, grads, message = run(capsys, scaled, args)
    assert "AOT miss" in message, message
    want, want_grads = eager(scaled, args)
    check_same(got, want)
    check_same(grads, want_grads)
    assert "AOT hit" in run(capsys, scaled, args)[2]  # rebuilt


def test_a_damaged_sizes_entry_falls_back_to_the_symbolic_key(cache_on, capsys):
    from aotforge.compiler.runtime.disk_cache import CacheEntryWarning

    args = [torch.randn(8, 16), torch.randn(16).requires_grad_()]
    run(capsys, scaled, args, dynamic=True)
    path = only(cache_on, "sizes_*.json")
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.warns(CacheEntryWarning, match="does not match its hash"):
        got, _, message = run(capsys, scaled, args, dynamic=True)
    assert "AOT hit" in message, message  # through the symbolic key, which rewrites the sizes entry
    check_same(got, eager(scaled, args)[0])
    run(capsys, scaled, args, dynamic=True)  # no warning: rewritten


def test_subclass_inputs_hit_and_match_the_cold_run(cache_on, capsys):
    from torch.testing._internal.two_tensor import TwoTensor

    def mixed(x, w):
        return (x * 2).sin() * w

    def make():
        generator = torch.Generator().manual_seed(0)
        a, b = torch.randn(4, 3, generator=generator), torch.randn(4, 3, generator=generator)
        return [TwoTensor(a, b).requires_grad_(), torch.randn(3, generator=generator)]

    results = []
    for expected in ("AOT miss", "AOT hit"):
        got, grads, message = run(capsys, mixed, make())
        assert expected in message and "not cached" not in message and "not stored" not in message, message
        assert type(got[0]) is TwoTensor and type(grads[0]) is TwoTensor
        results.append((got[0], grads[0]))
    want, want_grads = eager(mixed, make())
    for got, grad in results:
        torch.testing.assert_close(got.a, want[0].a)
        torch.testing.assert_close(got.b, want[0].b)
        torch.testing.assert_close(grad.a, want_grads[0].a)
        torch.testing.assert_close(grad.b, want_grads[0].b)
