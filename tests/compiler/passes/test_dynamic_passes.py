"""The passes on graphs with symbolic sizes: no pass adds a guard to the ShapeEnv or replaces a
symbol by a constant (a guard is a recompile, or a wrong specialization, for Dynamo), and
torch.compile(backend="aotforge") recompiles no more than "aotforge_eager"."""
from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import aotforge
from aotforge.compiler import passes, select_decomposition_table
from aotforge.compiler.passes import graph_passes, known_true, statically_equal
from aotforge.config import config
from aotforge.testing import verify_module

aten = torch.ops.aten


# --- the helpers ------------------------------------------------------------------------------

def _symbolic_trace(fn, *args):
    table = select_decomposition_table()
    return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), decomposition_table=table,
                   tracing_mode="symbolic")(*args)


def _shape_env(gm):
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and getattr(val, "fake_mode", None) is not None:
            return val.fake_mode.shape_env
    raise AssertionError("no symbolic values in the graph")


def _what_the_shape_env_knows(shape_env):
    """Everything a guard or a specialization changes."""
    return (len(shape_env.guards), dict(shape_env.replacements), dict(shape_env.var_to_range),
            len(getattr(shape_env, "deferred_runtime_asserts", {})))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _sizes(gm):
    """Two symbolic sizes s0, s1 of a traced graph's first input."""
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return tuple(placeholder.meta["val"].shape)


def test_statically_equal_answers_only_what_holds_for_every_size():
    gm = _symbolic_trace(lambda x: (x + 1,), torch.randn(6, 5))
    shape_env = _shape_env(gm)
    before = _what_the_shape_env_knows(shape_env)
    s0, s1 = _sizes(gm)
    assert statically_equal(s0, s0) and statically_equal(s0 * s1, s1 * s0)
    assert statically_equal((s0, 3, s1), [s0, 3, s1])
    assert not statically_equal(s0, 6)  # true for this example only
    assert not statically_equal(s0, s1) and not statically_equal((s0, s1), (s1, s0))
    assert not statically_equal((s0,), (s0, 1)) and not statically_equal(s0, None)
    assert statically_equal(2, 2.0) and not statically_equal(float("nan"), float("nan"))
    assert known_true(s0 >= 2) and not known_true(s0 * s1 <= 4096) and known_true(7 <= 4096)
    assert _what_the_shape_env_knows(shape_env) == before


# --- each pass leaves the ShapeEnv alone --------------------------------------------------------

def _noop_candidates(x, w):
    """permute (a shape (s1, s0) next to (s0, s1)), a contiguous copy of it (same shape, strides
    (1, s0) against (s1, 1)), clones, x*1, a reshape to the same shape, an expand, casts."""
    t = x.t()
    copy = t.contiguous()
    same = x.reshape(x.shape[0], x.shape[1]) * 1 + 0
    y = (same.clone().to(x.dtype) @ w).expand(x.shape[0], w.shape[1])
    return (copy * 2, (copy.t() + x).sum(), y.permute(1, 0).permute(1, 0) - (-(-y)))


def _folding_candidates(x):
    table = torch.arange(4, dtype=x.dtype).exp()  # parameter-free: folded
    return (x + table.sum(), x.sin() + x.sin())


PASSES = [
    graph_passes.functionalize_inplace, passes.dead_code_elimination, passes.view_to_reshape,
    passes.remove_noops, passes.apply_pattern_rewrites, passes.constant_fold, passes.cse,
    passes.post_grad_passes, passes.joint_graph_passes,
]


@pytest.mark.parametrize("graph_pass", PASSES, ids=lambda p: p.__name__)
def test_pass_adds_no_guard(graph_pass):
    for fn, args in ((_noop_candidates, (torch.randn(6, 5), torch.randn(5, 3))),
                     (_folding_candidates, (torch.randn(6, 5),))):
        gm = _symbolic_trace(fn, *args)
        shape_env = _shape_env(gm)
        before = _what_the_shape_env_knows(shape_env)
        gm = graph_pass(gm)
        assert _what_the_shape_env_knows(shape_env) == before, f"{graph_pass.__name__} on {fn.__name__}"
        gm.recompile()
        for shape in ((7, 4), (3, 9)):  # still right for other sizes than the traced ones
            new_args = [torch.randn(shape)] + ([torch.randn(shape[1], 3)] if len(args) > 1 else [])
            torch.testing.assert_close(gm(*new_args), fn(*new_args))


def test_remove_noops_with_symbolic_sizes_removes_only_what_is_known():
    gm = passes.remove_noops(_symbolic_trace(_noop_candidates, torch.randn(6, 5), torch.randn(5, 3)))
    targets = _targets(gm)
    assert aten.clone.default in targets  # the contiguous copy: its strides differ for most sizes
    assert aten.mul.Tensor in targets  # copy * 2 stays; x * 1 goes
    assert targets.count(aten.mul.Tensor) == 1 and aten.add.Scalar not in targets
    assert aten.expand.default not in targets  # expand to its own (symbolic) shape


@pytest.mark.filterwarnings("ignore:Raw SymInt")
def test_cse_merges_nodes_with_the_same_symbolic_argument():
    gm = _symbolic_trace(lambda x: (x.sum(),), torch.randn(6, 5))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    s0 = x.meta["val"].shape[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):  # a SymInt written into the args, as a constant
        first = gm.graph.call_function(aten.mul.Tensor, (x, s0))
        second = gm.graph.call_function(aten.mul.Tensor, (x, s0 * 1))
        third = gm.graph.call_function(aten.mul.Tensor, (x, x.meta["val"].shape[1]))
    output.args = ((first, second, third),)
    shape_env = _shape_env(gm)
    before = _what_the_shape_env_knows(shape_env)
    gm = passes.cse(gm)
    assert _what_the_shape_env_knows(shape_env) == before
    assert _targets(gm).count(aten.mul.Tensor) == 2


def test_constant_fold_leaves_data_dependent_sizes():
    def fn(x):
        mask = torch.ones(64, 64, dtype=torch.bool)  # parameter-free, 4096 elements: foldable
        return (x + mask.nonzero().sum(),)  # (u0, 2): up to 8192 elements, not known to be small
    gm = _symbolic_trace(fn, torch.randn(4))
    shape_env = _shape_env(gm)
    before = _what_the_shape_env_knows(shape_env)
    gm = passes.constant_fold(gm)  # numel() of nonzero's result is unbacked: not compared
    assert _what_the_shape_env_knows(shape_env) == before
    gm.recompile()
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), fn(x))


# --- through torch.compile --------------------------------------------------------------------

class _CountingBackend:
    """A registered backend by name, counting the graphs Dynamo compiles (frames + recompiles)."""

    def __init__(self, name):
        from torch._dynamo.backends.registry import lookup_backend

        self.backend, self.compiles = lookup_backend(name), 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        return self.backend(gm, example_inputs)


@contextlib.contextmanager
def _fresh_dynamo(triton: bool = True):
    """A clean Dynamo cache, and the Triton path (in the interpreter) for CPU tensors: without
    it the aotforge backend would hand CPU graphs to aotforge_eager and run no pass."""
    torch._dynamo.reset()
    try:
        with config.patch(triton_on_cpu=triton):
            yield
    finally:
        torch._dynamo.reset()


def test_repro_linear_view_dynamic_no_recompile():
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).double()
    reference = nn.Linear(32, 32).double()
    reference.load_state_dict(lin.state_dict())
    counter = _CountingBackend("aotforge")
    with _fresh_dynamo():
        f = torch.compile(lambda x: lin(x).view(-1), backend=counter, dynamic=True)
        for rows in (24, 32):
            x = torch.randn(rows, 32, dtype=torch.float64, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            lin.zero_grad(), reference.zero_grad()
            out, expected = f(x), reference(x_ref).view(-1)
            torch.testing.assert_close(out, expected)
            grad = torch.randn_like(expected)
            out.backward(grad)
            expected.backward(grad)
            torch.testing.assert_close(x.grad, x_ref.grad)
            torch.testing.assert_close(lin.weight.grad, reference.weight.grad)
            torch.testing.assert_close(lin.bias.grad, reference.bias.grad)
    assert counter.compiles == 1


class _Attention(nn.Module):
    """A hand-written pre-norm attention block: the reshapes, transposes and contiguous copies
    of multi-head attention, where the sequence length is the dynamic size."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.norm, self.qkv, self.out = heads, nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (dim // self.heads) ** 0.5
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        attended = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(attended.transpose(1, 2).contiguous().view(batch, seq, dim))
        return x + self.mlp(x)


def _recompiles(make_module, backend, shapes):
    """Train ``make_module()`` compiled with ``backend`` (automatic dynamic shapes) at each of
    ``shapes``, against eager; returns how many graphs Dynamo compiled."""
    counter = _CountingBackend(backend)
    inputs = iter([torch.randn(*shape, dtype=torch.float64) for shape in shapes])
    with _fresh_dynamo():
        verify_module(lambda: make_module().double(), lambda m: torch.compile(m, backend=counter),
                      lambda: next(inputs), steps=len(shapes), lr=0.1, rtol=1e-6, atol=1e-6)
    return counter.compiles


# The third length equals the model's width: a pass that compares the symbolic length with
# == records "length != 16" on the dynamic compile, and the third step then recompiles.
SEQUENCE_LENGTHS = [(2, 5, 16), (2, 7, 16), (2, 16, 16)]

MODELS = {
    "attention_block": lambda: _Attention(),
    "transformer_encoder_layer": lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_recompiles_no_more_than_aotforge_eager(name):
    torch.manual_seed(0)
    eager_backend = _recompiles(MODELS[name], "aotforge_eager", SEQUENCE_LENGTHS)
    compiled = _recompiles(MODELS[name], "aotforge", SEQUENCE_LENGTHS)
    assert compiled <= eager_backend, f"aotforge compiled {compiled} graphs, aotforge_eager {eager_backend}"


def test_recompiles_tiny_hf_albert():
    transformers = pytest.importorskip("transformers")
    config_ = transformers.AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    class Embedded(nn.Module):  # float inputs for verify_module: the embeddings' output onward
        def __init__(self):
            super().__init__()
            self.model = transformers.AlbertModel(config_)

        def forward(self, embeds):
            return self.model(inputs_embeds=embeds).last_hidden_state

    shapes = [(2, 5, 8), (2, 7, 8), (2, 16, 8)]  # 16: the hidden size
    eager_backend = _recompiles(Embedded, "aotforge_eager", shapes)
    assert _recompiles(Embedded, "aotforge", shapes) <= eager_backend
