"""Functional collectives in compiled graphs (what DTensor and tensor parallelism trace): they
run as extern calls in the graph's order, each wait moves down to the first use of its result,
and a collective's input keeps its memory until the wait. Run in one process on a gloo group
of one rank (collectives copy their input), compared with eager."""
from __future__ import annotations

import pytest
import torch

distributed = pytest.importorskip("torch.distributed")
if not distributed.is_available() or not distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from aotforge.compiler import compile_fx_inner, observe  # noqa: E402
from aotforge.compiler.passes import sink_waits  # noqa: E402
from aotforge.config import config  # noqa: E402

from .helpers import trace  # noqa: E402

c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def group_name(tmp_path_factory):
    if distributed.is_initialized():
        pytest.skip("a process group is already initialized")
    store = distributed.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield distributed.group.WORLD.group_name
    finally:
        distributed.destroy_process_group()


def _calls(gm) -> list[str]:
    return [str(n.target).split(".")[-2] for n in gm.graph.nodes if n.op == "call_function"]


def test_waits_move_to_the_first_use_and_collectives_keep_their_order(group_name):
    def fn(w, u, x, v):
        full_w = c10d.wait_tensor(c10d.all_gather_into_tensor(w, 1, group_name))
        full_u = c10d.wait_tensor(c10d.all_gather_into_tensor(u, 1, group_name))
        h = torch.relu(x @ v)
        return (h @ full_u) @ full_w,

    args = [torch.randn(4, 4) for _ in range(4)]
    gm = trace(fn, *args)
    assert _calls(gm).index("wait_tensor") < _calls(gm).index("relu")
    calls = _calls(sink_waits(gm))
    gathers = [n for n in gm.graph.nodes if "all_gather" in str(n.target)]
    assert [g.args[0].name for g in gathers] == ["w_1", "u_1"], "collectives must keep the graph's order"
    # each wait now comes after the independent matmul and relu, just before its first use:
    # relu, wait(u), mm(h, full_u), wait(w), mm(.., full_w)
    relu = calls.index("relu")
    assert calls[relu + 1:] == ["wait_tensor", "mm", "wait_tensor", "mm"], calls
    gm.recompile()
    torch.testing.assert_close(gm(*args)[0], fn(*args)[0])


def test_a_wait_never_crosses_a_write(group_name):
    def fn(w, x):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(w, 1, group_name))
        w.mul_(2)
        return full * x,

    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(torch.randn(4), torch.randn(4))
    calls = _calls(sink_waits(gm))
    assert calls.index("wait_tensor") < calls.index("mul_"), calls


def test_collective_inputs_keep_their_memory_until_the_wait(group_name):
    """``a`` is last read by the reduce-scatter; ``y * 3``, of the same size, is computed by a
    kernel before the wait (a matmul needs it): it must not take ``a``'s memory, which the
    collective may still be reading."""
    def fn(x, y, z):
        a = x * 2
        scattered = c10d.reduce_scatter_tensor(a, "sum", 1, group_name)
        b = (y * 3) @ z
        return c10d.wait_tensor(scattered) + 1, b

    args = [torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)]
    gm = trace(fn, *args)
    with config.patch(triton_on_cpu=True), observe() as graphs:
        compiled = compile_fx_inner(gm, args)
        outputs = compiled([a.clone() for a in args])
    expected = fn(*args)
    for actual, wanted in zip(outputs, expected):
        torch.testing.assert_close(actual, wanted)
    (graph,) = graphs
    steps = [getattr(s, "op", s.name) for s in graph.kernel_plan.steps]
    assert [str(s) for s in steps] == ["kernel0", "_c10d_functional.reduce_scatter_tensor.default", "kernel1",
                                       "aten.mm.default", "_c10d_functional.wait_tensor.default", "kernel2"]
    collective = graph.kernel_plan.steps[1]
    sent = collective.args[0].buffer.name  # a's buffer
    reused = [a.reuses for allocations in graph.memory_plan.allocations.values() for a in allocations]
    assert sent not in reused, f"a buffer took the memory of the collective's input {sent}: {graph.memory_plan}"


def test_the_backward_never_recomputes_a_collective(group_name):
    """Even with a memory budget of 0 (recompute all it can), the min-cut saves an
    all-gather's result: a collective issued again in the backward is one the other ranks
    may not issue."""
    from aotforge import aot_function
    from aotforge.partition.mincut import min_cut_rematerialization_partition

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm
        return compiler

    def partition(joint, inputs, **kwargs):
        return min_cut_rematerialization_partition(joint, inputs, memory_budget=0.0, **kwargs)

    def fn(w, x):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(w, 1, group_name))
        return torch.tanh(x @ full).sum()

    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    compiled = aot_function(fn, keep("forward"), keep("backward"), partition_fn=partition)
    compiled(w, x).backward()
    expected_w, expected_x = (t.detach().clone().requires_grad_() for t in (w, x))
    fn(expected_w, expected_x).backward()
    torch.testing.assert_close(w.grad, expected_w.grad)
    torch.testing.assert_close(x.grad, expected_x.grad)
    assert "all_gather_into_tensor" in str(graphs["forward"].code)
    # the backward reduce-scatters w's gradient (the all-gather's own backward), nothing more
    backward = str(graphs["backward"].code)
    assert "all_gather_into_tensor" not in backward and "reduce_scatter_tensor" in backward, backward
