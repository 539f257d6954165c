"""The min-cut partition against the joint graph it splits and against eager PyTorch.

Joint graphs come from torch's functorch.compile.aot_function and from aotforge's own
aot_function (see joints.py); every check runs in float64 on the CPU.
"""
from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.fx as fx

import aotforge
from aotforge.partition import default_partition, min_cut_rematerialization_partition
from aotforge.partition import op_costs
from aotforge.partition.mincut import NEVER_RECOMPUTED, classify_joint, knapsack, solve_min_cut
from aotforge.partition.default import split_with_saved_values
from aotforge.partition.schedule import estimate_peak_memory

from .joints import (
    CASES,
    capture_joint,
    make_tangents,
    run_joint,
    run_partitioned,
    saved_bytes,
    saved_nodes,
)

BUDGETS = [1.0, 0.5, 0.0]


@pytest.fixture(autouse=True, scope="module")
def fused_math():
    """The min-cut's choices over ops the compiler fuses: with eager's rounding kept on the C++
    path (config.cpu_eager_bits) GELU and its kind stay library calls, which are saved, never
    recomputed (tests/compiler/test_eager_rounding.py checks that); here they are fused math."""
    from aotforge.config import config

    saved = config.cpu_eager_bits
    config.cpu_eager_bits = False
    yield
    config.cpu_eager_bits = saved


@functools.lru_cache(maxsize=None)
def joint_for(name: str, frontend: str = "torch"):
    return capture_joint(CASES[name], frontend=frontend)


def partition(joint, budget: float = 1.0):
    return min_cut_rematerialization_partition(
        joint.module,
        joint.inputs,
        num_fwd_outputs=joint.num_fwd_outputs,
        memory_budget=budget,
        **joint.kwargs,
    )


def assert_close_lists(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        if b is None:
            assert a is None, f"output {index}: expected None"
            continue
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"output {index}")


@pytest.mark.parametrize("frontend", ["torch", "aotforge"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "dropout"])
def test_partition_computes_the_joint_graph(name: str, budget: float, frontend: str) -> None:
    joint = joint_for(name, frontend)
    tangents = make_tangents(joint)
    torch.manual_seed(7)  # dropout draws the same mask in both runs
    expected = run_joint(joint.module, joint.primals, tangents)
    fw, bw = partition(joint, budget)
    torch.manual_seed(7)
    outputs, grads = run_partitioned(fw, bw, joint.primals, tangents, joint.num_fwd_outputs)
    assert_close_lists(outputs + grads, expected)


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_gradients_equal_eager(name: str) -> None:
    joint = joint_for(name)
    tangents = make_tangents(joint)
    fw, bw = partition(joint)
    outputs, grads = run_partitioned(fw, bw, joint.primals, tangents, joint.num_fwd_outputs)
    # eager: the same model, same parameters, same input
    model = joint.model
    parameters = {*dict(model.named_parameters()), "x"}
    inputs = [
        p.detach().clone().requires_grad_(n in parameters) for n, p in zip(joint.names, joint.primals)
    ]
    state = dict(zip(joint.names[:-1], inputs[:-1]))
    eager_out = torch.func.functional_call(model, state, (inputs[-1],))
    wanted = [t for t in inputs if t.requires_grad]
    eager_grads = torch.autograd.grad(eager_out, wanted, tangents[0], allow_unused=True)
    # the forward returns updated buffers (batch norm's running stats) first, then the output
    torch.testing.assert_close(outputs[-1], eager_out.detach(), rtol=1e-10, atol=1e-12)
    ours = [g for g, t in zip(grads, inputs) if t.requires_grad]
    for got, want in zip(ours, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "dropout"])
def test_saves_fewer_bytes_than_default(name: str) -> None:
    joint = joint_for(name)
    fwo = joint.num_fwd_outputs
    default_fw, _ = default_partition(joint.module, joint.inputs, num_fwd_outputs=fwo)
    ours_fw, _ = partition(joint)
    assert saved_bytes(ours_fw, fwo) < saved_bytes(default_fw, fwo)


def _recomputed_names(fw: fx.GraphModule, bw: fx.GraphModule) -> set:
    forward = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    return {n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in forward}


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "dropout"])
def test_compute_heavy_and_random_ops_are_not_recomputed(name: str) -> None:
    joint = joint_for(name)
    fw, bw = partition(joint, 1.0)
    for node in bw.graph.nodes:
        if node.name in _recomputed_names(fw, bw):
            assert op_costs.op_kind(node) in op_costs.RECOMPUTABLE_KINDS, node.format_node()
    # at every budget, random ops stay in the forward
    for budget in BUDGETS:
        _, bw = partition(joint, budget)
        assert not [n for n in bw.graph.nodes if op_costs.op_kind(n) == op_costs.RANDOM]


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "dropout"])
def test_budget_zero_saves_only_inputs(name: str) -> None:
    joint = joint_for(name)
    fw, _ = partition(joint, 0.0)
    for node in saved_nodes(fw, joint.num_fwd_outputs):
        if node.op == "placeholder":
            continue
        # what random ops drew cannot be redrawn (dropout's mask)
        producer = node.args[0] if node.target is operator.getitem else node
        assert op_costs.op_kind(producer) in NEVER_RECOMPUTED, node.format_node()


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "dropout"])
def test_budget_half_stays_within_its_bytes(name: str) -> None:
    joint = joint_for(name)
    fwo = joint.num_fwd_outputs
    sizes = {b: saved_bytes(partition(joint, b)[0], fwo) for b in BUDGETS}
    if sizes[1.0] <= sizes[0.0]:
        assert sizes[0.5] == sizes[1.0]
    else:
        assert sizes[0.5] <= sizes[0.0] + 0.5 * (sizes[1.0] - sizes[0.0])
        assert sizes[0.5] >= sizes[0.0]


def test_budget_recomputes_matmuls_when_small() -> None:
    # one big activation from a matmul, needed by the backward: at budget 1 it is saved, at
    # budget 0.5 the knapsack lets the backward recompute it from the (smaller) inputs
    def f(x, w):
        return torch.tanh(x @ w)

    joint = _joint_of(f, torch.randn(64, 4, dtype=torch.float64), torch.randn(4, 64, dtype=torch.float64))
    fw1, bw1 = partition(joint, 1.0)
    fw_half, bw_half = partition(joint, 0.5)
    assert "mm" not in _recomputed_names(fw1, bw1)
    assert "mm" in _recomputed_names(fw_half, bw_half)
    assert saved_bytes(fw_half, 1) < saved_bytes(fw1, 1)
    tangents = make_tangents(joint)
    expected = run_joint(joint.module, joint.primals, tangents)
    outputs, grads = run_partitioned(fw_half, bw_half, joint.primals, tangents, 1)
    assert_close_lists(outputs + grads, expected)


def _joint_of(fn, *args):
    """Capture the joint graph of a plain function through torch's aot_function."""
    from functorch.compile import aot_function, make_boxed_compiler
    from torch._functorch.partitioners import default_partition as torch_default

    from .joints import Joint

    captured = []

    def capture(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured.append((joint, inputs, num_fwd_outputs, kwargs))
        return torch_default(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    leaves = [a.clone().requires_grad_() for a in args]
    aot_function(fn, fw_compiler=make_boxed_compiler(lambda gm, _: gm), partition_fn=capture)(*leaves)
    joint, inputs, fwo, kwargs = captured[0]
    return Joint(joint, list(inputs), fwo, kwargs, None, list(args), [])


def test_view_of_a_saved_base_is_not_saved() -> None:
    # both the base and its transposed view are read by the backward
    def f(x):
        y = x.sin()
        return (y.t() * y.t()).cos() + y.t()

    joint = _joint_of(f, torch.randn(8, 6, dtype=torch.float64))
    fw, bw = partition(joint)
    saved = saved_nodes(fw, joint.num_fwd_outputs)
    names = {n.name for n in saved}
    for node in saved:
        base = node
        while op_costs.is_view(base):
            base = base.args[0]
            assert base.name not in names, f"{node.name} is a view of saved {base.name}"
    tangents = make_tangents(joint)
    assert_close_lists(
        sum(run_partitioned(fw, bw, joint.primals, tangents, joint.num_fwd_outputs), []),
        run_joint(joint.module, joint.primals, tangents),
    )


def test_dead_code_is_removed() -> None:
    joint = _joint_of(lambda x: x.sin().cos(), torch.randn(5, dtype=torch.float64))
    graph = joint.module.graph
    primal = graph.find_nodes(op="placeholder")[0]
    with graph.inserting_after(primal):
        dead = graph.call_function(torch.ops.aten.exp.default, (primal,))
        dead.meta["val"] = primal.meta["val"]
    fw, bw = partition(joint)
    names = {n.name for g in (fw, bw) for n in g.graph.nodes}
    assert dead.name not in names


def test_parameters_are_free_to_save() -> None:
    joint = joint_for("mlp", "aotforge")  # aotforge passes parameters as static inputs
    fw, _ = partition(joint)
    summary = fw.meta["partition"]
    assert any(t.kind == "parameter" for t in summary.saved)
    assert summary.activation_bytes < summary.saved_bytes


def test_backward_order_lowers_peak_memory() -> None:
    joint = joint_for("transformer")
    info = classify_joint(joint.module, joint.num_fwd_outputs, ())
    saved = solve_min_cut(joint.module.graph, info)
    _, joint_order = split_with_saved_values(
        joint.module,
        [n for n in saved if not isinstance(n.meta["val"], torch.SymInt)],
        [n for n in saved if isinstance(n.meta["val"], torch.SymInt)],
        joint.num_fwd_outputs,
    )
    _, reordered = partition(joint)
    assert estimate_peak_memory(reordered) < estimate_peak_memory(joint_order)


def test_peak_memory_estimate_frees_after_last_use() -> None:
    def f(x):
        a = x.sin()  # 8 floats64 = 64 bytes each
        b = a.cos()  # a dies here
        c = b.exp()  # b dies here
        return c

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, dtype=torch.float64))
    # x, a alive together, then a, b, then b, c: never three at once
    assert estimate_peak_memory(gm) == 128


@pytest.mark.parametrize("budget", [-0.1, 1.5, "half"])
def test_bad_budget_is_a_clear_error(budget) -> None:
    joint = joint_for("mlp")
    with pytest.raises(ValueError, match="activation_memory_budget must be a number in"):
        partition(joint, budget)


def test_budget_comes_from_config() -> None:
    joint = joint_for("mlp")
    fwo = joint.num_fwd_outputs
    with aotforge.config.patch(activation_memory_budget=0.0):
        fw, _ = min_cut_rematerialization_partition(joint.module, joint.inputs, num_fwd_outputs=fwo)
    assert all(n.op == "placeholder" for n in saved_nodes(fw, fwo))


def test_knapsack_matches_brute_force() -> None:
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(30):
        count = rng.randint(1, 7)
        sizes = [rng.randint(1, 100) for _ in range(count)]
        values = [rng.randint(1, 100) for _ in range(count)]
        capacity = rng.randint(1, 300)
        kept = knapsack(sizes, values, capacity)
        assert sum(sizes[i] for i in kept) <= capacity
        best = max(
            sum(values[i] for i in subset)
            for r in range(count + 1)
            for subset in itertools.combinations(range(count), r)
            if sum(sizes[i] for i in subset) <= capacity
        )
        # sizes are rounded up to 1/1000 of the capacity, which can cost a little
        assert sum(values[i] for i in kept) >= best * 0.9


@pytest.mark.parametrize("budget", [1.0, 0.0])
def test_through_aotforge_aot_function_matches_eager(budget: float) -> None:
    # at budget 0 the backward recomputes batch norm from the running statistics, which the
    # runtime updates in place after the forward: it must save them from before the update
    with aotforge.config.patch(activation_memory_budget=budget):
        _check_aot_module_against_eager()


def _check_aot_module_against_eager() -> None:
    for name in ["mlp", "transformer", "cnn", "dropout"]:
        torch.manual_seed(0)
        model = CASES[name].make().double()
        x = torch.randn(CASES[name].input_shape, dtype=torch.float64, requires_grad=True)
        compiled = aotforge.aot_module(
            model, fw_compiler=aotforge.nop, partition_fn=min_cut_rematerialization_partition
        )
        torch.manual_seed(3)
        out = compiled(x)
        grads = torch.autograd.grad(out.sum() + (out * out).sum(), [x, *model.parameters()])
        torch.manual_seed(3)
        eager_out = model(x)
        eager_grads = torch.autograd.grad(
            eager_out.sum() + (eager_out * eager_out).sum(), [x, *model.parameters()]
        )
        torch.testing.assert_close(out, eager_out, rtol=1e-10, atol=1e-12)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_dynamic_shapes() -> None:
    """SymInt nodes are saved or recomputed like tensors; the graphs run at another size."""
    from functorch.compile import aot_function, make_boxed_compiler
    from torch._functorch.partitioners import default_partition as torch_default

    captured = []

    def capture(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured.append((joint, inputs, num_fwd_outputs))
        return torch_default(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def f(x, w):
        y = torch.nn.functional.gelu(x @ w)
        pairs = y.view(-1, y.shape[-1] // 2, 2).sum(-1)
        return torch.nn.functional.layer_norm(pairs, (y.shape[-1] // 2,))

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    compiled = aot_function(
        f, fw_compiler=make_boxed_compiler(lambda gm, _: gm), partition_fn=capture, dynamic=True
    )
    compiled(leaf(6, 8), leaf(8, 10))
    joint, inputs, fwo = captured[0]
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in joint.graph.nodes)
    x, w = leaf(3, 8), leaf(8, 14)  # another size than traced
    tangent = torch.randn(3, 7, dtype=torch.float64)
    expected_out = f(x, w)
    expected = torch.autograd.grad(expected_out, [x, w], tangent)
    for budget in BUDGETS:
        fw, bw = min_cut_rematerialization_partition(
            joint, inputs, num_fwd_outputs=fwo, memory_budget=budget
        )
        outputs, grads = run_partitioned(fw, bw, [x.detach(), w.detach()], [tangent], fwo)
        torch.testing.assert_close(outputs[0], expected_out.detach())
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)


def test_bad_arguments_are_clear_errors() -> None:
    joint = joint_for("mlp")
    with pytest.raises(ValueError, match="num_fwd_outputs=99 but the joint graph returns"):
        min_cut_rematerialization_partition(joint.module, joint.inputs, num_fwd_outputs=99)
    with pytest.raises(ValueError, match=r"static_lifetime_input_indices \[42\] are out of range"):
        min_cut_rematerialization_partition(
            joint.module, joint.inputs, num_fwd_outputs=1, static_lifetime_input_indices=[42]
        )
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2)
    graph.output((x,))
    with pytest.raises(ValueError, match=r"joint graph inputs \['x'\] are neither primals_N nor tangents_N"):
        min_cut_rematerialization_partition(fx.GraphModule({}, graph), None, num_fwd_outputs=1)


def test_module_constants_are_read_not_saved() -> None:
    constant = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    graphs = []

    def capture(joint, inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        graphs.append(fw)
        return fw, bw

    def f(x):
        return (x * constant).sin() * constant

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = aotforge.aot_function(f, aotforge.nop, partition_fn=capture)(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones(3, dtype=torch.float64))
    eager_x = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(f(eager_x), eager_x, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(grad, expected)
    assert all(n.op != "get_attr" for n in saved_nodes(graphs[0], 1))


def test_dropout_mask_is_saved_not_redrawn_in_the_backward():
    """A functionalized dropout's draw costs ten philox rounds per element: the backward
    reads the forward's 1-byte mask instead of drawing it again, and its gradients are those
    of the mask the forward drew."""
    from aotforge.compiler import observe
    from aotforge.config import config

    def fn(x, w):  # attention's shape: dropout over the probabilities, then a matmul
        p = torch.nn.functional.dropout(x.softmax(-1), 0.3, training=True)
        return (p @ w).sum(), p.detach()

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        loss, dropped = torch.compile(fn, backend="aotforge")(x, w)
        loss.backward()
    grads = (x.grad, w.grad)
    x.grad = w.grad = None
    mask = dropped != 0  # the forward's draw, replayed eagerly
    assert 0 < mask.sum() < mask.numel()
    ((x.softmax(-1) * mask / 0.7) @ w).sum().backward()
    torch.testing.assert_close(grads, (x.grad, w.grad))
    (forward,), (backward,) = [[g for g in graphs if g.kind == kind] for kind in ("forward", "backward")]
    assert "tl.rand(" in forward.kernel_source and "tl.rand(" not in backward.kernel_source
    assert any(b is not None and b.dtype == torch.bool for b in backward.lowered.inputs)


def test_a_cast_both_passes_multiply_with_is_saved_not_recast() -> None:
    """Autocast's pattern: attention probabilities (and a weight) cast once for the forward's
    matmul are saved for the backward's, not cast again there: a recast is a pass of its own
    over memory, since a matmul cannot fuse it, even where its source is saved anyway (the
    softmax backward reads the float64 probabilities). A cast only one pass reads is not kept."""

    def f(x, w):
        p = (x @ w).softmax(-1)
        p32 = p.to(torch.float32)
        return (p32 @ w.to(torch.float32)).sum() + x.to(torch.float32).sin().sum()

    x, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    joint = _joint_of(f, x, w)
    fw, bw = partition(joint)
    def feeds_a_matmul(node):
        return any(op_costs.op_kind(u) == op_costs.COMPUTE or (op_costs.is_view(u) and feeds_a_matmul(u))
                   for u in node.users)

    recast = [n.name for n in bw.graph.nodes
              if n.op == "call_function" and op_costs.op_kind(n) == op_costs.CAST and feeds_a_matmul(n)]
    assert recast == [], recast
    assert len([n for n in saved_nodes(fw, joint.num_fwd_outputs) if n.meta["val"].dtype == torch.float32]) == 2
    tangents = make_tangents(joint)
    assert_close_lists(
        sum(run_partitioned(fw, bw, joint.primals, tangents, joint.num_fwd_outputs), []),
        run_joint(joint.module, joint.primals, tangents),
    )
