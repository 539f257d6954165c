"""The op tables: which ops may be recomputed, and the runtime estimates."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from aotforge.config import config
from aotforge.partition import op_costs


def _nodes(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return {
        n.target.overloadpacket.__name__: n
        for n in gm.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload)
    }


def test_kinds_of_common_ops() -> None:
    x = torch.randn(4, 4)
    nodes = _nodes(
        lambda a: torch.ops.aten.native_dropout(
            torch.nn.functional.gelu(torch.mm(a, a)).t().sum(0, keepdim=True), 0.5, True
        ),
        x,
    )
    assert op_costs.op_kind(nodes["mm"]) == op_costs.COMPUTE
    with config.patch(cpu_eager_bits=False):
        assert op_costs.op_kind(nodes["gelu"]) == op_costs.POINTWISE
    # eager's CPU GELU kernel, kept on the C++ path for its rounding: saved like a library call
    with config.patch(cpu_eager_bits=True, cpu_codegen=True):
        assert op_costs.op_kind(nodes["gelu"]) == op_costs.COMPUTE
    assert op_costs.op_kind(nodes["t"]) == op_costs.VIEW
    assert op_costs.op_kind(nodes["sum"]) == op_costs.REDUCTION
    assert op_costs.op_kind(nodes["native_dropout"]) == op_costs.RANDOM
    # without autograd, dropout is an in-place bernoulli_: random through its tag
    nodes = _nodes(lambda a: torch.nn.functional.dropout(a, 0.5), x)
    assert op_costs.op_kind(nodes["bernoulli_"]) == op_costs.RANDOM


def test_ops_missing_from_the_table_use_tags_then_stay_unknown() -> None:
    # aten.hypot is in no table but is tagged pointwise; a custom op is unknown
    nodes = _nodes(lambda a: torch.hypot(a, a), torch.randn(3))
    with config.patch(cpu_eager_bits=False):  # (else eager's CPU kernel is kept: eager_rounding.py)
        assert op_costs.op_kind(nodes["hypot"]) == op_costs.POINTWISE

    @torch.library.custom_op("aotforge_test::opaque", mutates_args=())
    def opaque(a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    @opaque.register_fake
    def _(a):
        return torch.empty_like(a)

    nodes = _nodes(lambda a: opaque(a), torch.randn(3))
    assert op_costs.op_kind(nodes["opaque"]) == op_costs.UNKNOWN


def test_flop_estimates() -> None:
    nodes = _nodes(
        lambda a, b, w: (torch.mm(a, b), torch.nn.functional.conv2d(w, w[:2, :, :1, :1])),
        torch.randn(8, 16),
        torch.randn(16, 4),
        torch.randn(3, 3, 5, 5),
    )
    assert op_costs.estimate_flops(nodes["mm"]) == 2 * 8 * 16 * 4
    # output 3x2x5x5, each a dot product over 3 input channels x 1x1 kernel
    assert op_costs.estimate_flops(nodes["convolution"]) == 2 * (3 * 2 * 5 * 5) * 3


def test_sizes_use_hints_for_symbolic_shapes() -> None:
    gm = make_fx(lambda a: a * 2, tracing_mode="symbolic")(torch.randn(6, 5, dtype=torch.float64))
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert op_costs.node_bytes(mul) == 6 * 5 * 8
