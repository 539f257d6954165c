"""The foundation: aot_function / aot_module / the Dynamo backend against eager, in float64."""
import os
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotforge
from aotforge import aot_function, aot_module, make_boxed_compiler, nop
from aotforge.testing import Inputs, verify, verify_module

D = torch.float64


def rand(*shape, grad=True, dtype=D):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


CASES = {
    "mlp": (
        lambda x, w1, b1, w2: torch.relu(x @ w1 + b1) @ w2,
        lambda: (rand(8, 5), rand(5, 16), rand(16), rand(16, 3)),
    ),
    "gelu_matmul_sum": (
        lambda x, w: F.gelu(x @ w).sum(-1),
        lambda: (rand(4, 5), rand(5, 3)),
    ),
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (6,), w, b),
        lambda: (rand(3, 4, 6), rand(6), rand(6)),
    ),
    "softmax_cross_entropy": (
        lambda logits, target: F.cross_entropy(torch.log_softmax(logits, -1), target),
        lambda: (rand(7, 10), torch.randint(0, 10, (7,))),
    ),
    "embedding": (
        lambda idx, table: F.embedding(idx, table).mean(1),
        lambda: (torch.randint(0, 20, (4, 6)), rand(20, 8)),
    ),
    "matmul_chain": (
        lambda a, b, c: (a @ b) @ c.t(),
        lambda: (rand(3, 4), rand(4, 5), rand(6, 5)),
    ),
    "reductions_broadcasting": (
        lambda x, y: (x - x.mean(0, keepdim=True)) * y + x.amax(-1, keepdim=True) + x.var(1, keepdim=True),
        lambda: (rand(5, 7), rand(1, 7)),
    ),
    "conv_batchnorm_eval": (
        lambda x, w, rm, rv, g, b: F.batch_norm(F.conv2d(x, w, padding=1), rm, rv, g, b, training=False),
        lambda: (rand(2, 3, 6, 6), rand(4, 3, 3, 3), torch.randn(4, dtype=D), torch.rand(4, dtype=D) + 0.5, rand(4), rand(4)),
    ),
    "integer_and_bool": (
        lambda x, i, m: (x * i.to(x.dtype)).masked_fill(m, 0.0).sum(0),
        lambda: (rand(4, 3), torch.arange(12).reshape(4, 3), torch.rand(4, 3) > 0.5),
    ),
    "integer_outputs": (
        lambda x: (x.argmax(-1), (x > 0).sum(), x * 2),
        lambda: (rand(3, 4),),
    ),
    "pytree_in_out": (
        lambda d, pair: {"sum": d["a"] + pair[0], "prod": [d["b"] * pair[1], pair[0].exp()]},
        lambda: ({"a": rand(3), "b": rand(3)}, (rand(3), rand(3))),
    ),
    "non_tensor_args": (
        lambda x, scale, flag, nothing, eps: (x * scale + (1 if flag else 0)) / (x.abs() + eps) if nothing is None else x,
        lambda: (rand(4), 2.5, True, None, 1e-3),
    ),
    "non_tensor_outputs": (
        lambda x: (x.sin(), x.shape[0], 3.5, None),
        lambda: (rand(5),),
    ),
    "some_inputs_without_grad": (
        lambda x, y: x * y.sin(),
        lambda: (rand(4), rand(4, grad=False)),
    ),
    "output_without_grad": (
        lambda x: (x.detach() * 2, x * 3),
        lambda: (rand(4),),
    ),
    "dropout_same_rng_stream_as_eager": (
        lambda x, w: F.dropout(x @ w, p=0.3, training=True).tanh() + torch.rand_like(x @ w),
        lambda: (rand(6, 4), rand(4, 5)),
    ),
    "dropout_free_rng_none": (
        lambda x: torch.where(x > 0, x, x * 0.1).cumsum(0),
        lambda: (rand(6),),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_eager(name):
    fn, make = CASES[name]
    verify(fn, make)


def test_kwargs():
    verify(lambda x, *, scale: x * scale, lambda: Inputs((rand(3),), {"scale": rand(3)}))


def test_compilers_see_named_graphs():
    seen = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            seen[kind] = gm
            assert len(example_inputs) == len(gm.graph.find_nodes(op="placeholder"))
            return gm
        return compiler

    fn = aot_function(lambda x, w: (x @ w).tanh(), capture("fw"), capture("bw"))
    fn(rand(2, 3), rand(3, 4)).sum().backward()
    fw_names = [n.name for n in seen["fw"].graph.find_nodes(op="placeholder")]
    bw_names = [n.name for n in seen["bw"].graph.find_nodes(op="placeholder")]
    assert fw_names == ["primals_1", "primals_2"]
    assert bw_names[-1] == "tangents_1"


def test_backward_compiles_lazily_and_once():
    calls = []

    def bw(gm, example_inputs):
        calls.append(gm)
        return gm

    fn = aot_function(lambda x: x.sin() * 2, nop, bw)
    x = rand(5)
    out = fn(x)
    assert calls == []
    out.sum().backward()
    fn(x).sum().backward()
    assert len(calls) == 1


def test_boxed_compiler_receives_list():
    boxed = make_boxed_compiler(nop)
    fn = aot_function(lambda x: x.cos(), boxed, boxed)
    x = rand(4)
    fn(x).sum().backward()
    torch.testing.assert_close(x.grad, -x.detach().sin())


def test_grad_mode_respected_at_call_time():
    fn = aot_function(lambda x: x.exp(), nop)
    x = rand(3)
    assert fn(x).requires_grad
    with torch.no_grad():
        assert not fn(x).requires_grad
    assert fn(x).requires_grad


def test_recompiles_on_new_signature_and_never_reuses_wrong_graph():
    fn = aot_function(lambda x: x.sum(0), nop)
    for shape, dtype, grad in [((3, 4), D, True), ((5, 4), D, True), ((3, 4), torch.float32, True), ((3, 4), D, False)]:
        x = torch.randn(*shape, dtype=dtype, requires_grad=grad)
        torch.testing.assert_close(fn(x), x.sum(0))
    assert len(fn._aotforge_cache) == 4
    fn(torch.randn(3, 4, dtype=D, requires_grad=True))
    assert len(fn._aotforge_cache) == 4  # reused


def test_cache_limit_gives_clear_error():
    fn = aot_function(lambda x: x + 1, nop)
    with aotforge.config.patch(cache_size_limit=2):
        fn(torch.randn(1))
        fn(torch.randn(2))
        with pytest.raises(RuntimeError, match="dynamic=True"):
            fn(torch.randn(3))


def test_dynamic_shapes_one_compile_serves_two_batch_sizes():
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm

    f = lambda x, w: F.gelu(x @ w).sum(-1)
    fn = aot_function(f, compiler, nop, dynamic=True)
    w = rand(5, 3)
    for batch in (4, 9):
        x = rand(batch, 5)
        out = fn(x, w)
        torch.testing.assert_close(out, f(x, w))
        out.sum().backward()
        gx = x.grad
        x.grad = None
        f(x, w).sum().backward()
        torch.testing.assert_close(gx, x.grad)
    assert len(graphs) == 1
    assert len(fn._aotforge_cache) == 1


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.fc2 = nn.Linear(12, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x)))) * self.scale


def test_aot_module_parameter_gradients():
    compiled = []

    def compile_module(model):
        compiled.append(aot_module(model, nop, nop))
        return compiled[-1]

    verify_module(lambda: SmallNet().double(), compile_module, lambda: torch.randn(5, 6, dtype=D))
    assert list(compiled[0].parameters())  # parameters are reachable for optimizers


def test_torch_compile_aotforge_eager_training_step():
    torch._dynamo.reset()
    verify_module(
        lambda: SmallNet().double(),
        lambda model: torch.compile(model, backend="aotforge_eager"),
        lambda: torch.randn(4, 6, dtype=D),
        lr=0.1,
    )
    torch._dynamo.reset()


def test_package_does_not_import_the_system_it_rebuilds():
    import pathlib
    import re

    root = pathlib.Path(aotforge.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+(torch\._functorch|functorch|torch\._inductor)\b|torch\._functorch\.|torch\._inductor\.", re.M)
    offenders = [str(p) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_log_and_dump_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AOTFORGE_LOG", "graphs,metadata")
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    fn = aot_function(lambda x: x.sin() * 2, nop, nop)
    fn(rand(3)).sum().backward()
    err = capsys.readouterr().err
    for name in ("joint", "forward", "backward", "metadata"):
        assert f"_{name} =====" in err
    # one folder per process and compile: <pid>/<compile id>_<name>/<numbered files>
    paths = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.relative_to(tmp_path).parts[0] for p in paths} == {str(os.getpid())}
    files = sorted(p.name for p in paths)
    assert any("joint" in f for f in files) and any("backward" in f for f in files)
    assert files[0].startswith("000_")
    joint = next(p for p in paths if "joint" in p.name).read_text()
    assert "tangents_1" in joint and "aten.sin" in joint


def test_non_callable_compiler_is_a_clear_error():
    with pytest.raises(TypeError, match="fw_compiler must be callable"):
        aot_function(lambda x: x, "inductor")


def test_public_api_aliases():
    assert aotforge.compiled_function is aotforge.aot_function
    assert aotforge.compiled_module is aotforge.aot_module
    boxed = aotforge.make_boxed_func(lambda a, b: (a + b,))
    assert boxed._boxed_call and boxed([1, 2]) == (3,)
    assert aotforge.AOTConfig is not None and aotforge.default_partition is not None


def test_torch_compile_dynamic_shapes_with_symint_inputs():
    torch._dynamo.reset()

    def f(x, w):
        return F.gelu(x @ w).sum(-1), x.view(-1)[:3]

    compiled = torch.compile(f, backend="aotforge_eager", dynamic=True)
    w = rand(5, 3)
    for batch in (4, 7, 9):
        verify(f, lambda: (rand(batch, 5), w), compile=lambda fn, mode: compiled, modes=("train", "inference"))
    torch._dynamo.reset()


def test_autocast_state_is_part_of_the_signature():
    f = lambda x, w: (x @ w).relu()
    fn = aot_function(f, nop, nop)
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    torch.testing.assert_close(fn(x, w), f(x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = fn(x, w), f(x, w)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    assert len(fn._aotforge_cache) == 2


def test_backward_twice_with_retain_graph():
    f = lambda x, w: (x @ w).tanh().sum()
    fn = aot_function(f, nop, nop)
    x, w = rand(3, 4), rand(4, 2)
    out = fn(x, w)
    out.backward(retain_graph=True)
    first = w.grad.clone()
    out.backward()
    torch.testing.assert_close(w.grad, 2 * first)
    again = fn(x, w)
    again.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        again.backward()  # as in eager: saved tensors were freed by the first backward


def test_dynamo_marks_parameters_and_buffers_static_for_the_partitioner():
    torch._dynamo.reset()
    seen = {}

    def partition(joint, inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kwargs):
        seen["static"] = static_lifetime_input_indices
        return aotforge.default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs)

    def backend(gm, example_inputs):
        return aotforge.aot_module_simplified(gm, example_inputs, nop, nop, partition_fn=partition)

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    torch.compile(model, backend=backend)(torch.randn(3, 4)).sum().backward()
    assert len(seen["static"]) == 7  # 2 linear + 2 batch norm parameters + 3 buffers; not x
    torch._dynamo.reset()
