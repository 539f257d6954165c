"""C++ kernels compiled for symbolic sizes (torch.compile(..., dynamic=True)): a pointwise
kernel whose indices divide ``xindex`` by sizes runs as a nest of loops over those sizes
(codegen/cpp_nest.py), equal to eager bit for bit at every size (odd ones, ones not a multiple
of the SIMD width, 1), in NCHW, channels-last and strided layouts; and the innermost loop of
such a kernel divides by no size (the old form: ``xindex / (ks0*ks0)`` per element)."""
from __future__ import annotations

import copy
import itertools
import re

import pytest
import sympy
import torch
from torch import nn

from aotforge.compiler.codegen import cpp_nest
from aotforge.compiler.expr import FloorDiv, ModularIndexing
from aotforge.compiler.indexing import XINDEX
from aotforge.compiler.pipeline import observe
from aotforge.compiler.runtime import cpp_build
from aotforge.config import config

pytestmark = pytest.mark.skipif(cpp_build.compiler_problem() is not None, reason="no C++ compiler")

SIZES = [(2, 3, 5, 7), (3, 16, 9, 9), (1, 8, 4, 4), (2, 5, 1, 3), (1, 1, 1, 1)]

# a division or remainder by a size parameter (``/ ks0``, ``% (ks0*ks0)``)
_BY_A_SIZE = re.compile(r"[/%] \(*ks\d")


def innermost_loops(source: str) -> list[list[str]]:
    """The body of each innermost ``for`` loop of a kernel's source (no ``for`` inside)."""
    lines = source.split("\n")
    bodies = []
    for start, line in enumerate(lines):
        if not line.strip().startswith("for ("):
            continue
        depth, body = 0, []
        for inner in lines[start + 1:]:
            if inner.strip().startswith("for ("):
                break
            depth += inner.count("{") - inner.count("}")
            if depth < 0:
                bodies.append(body)
                break
            body.append(inner)
    return bodies


def assert_no_division_by_a_size_per_element(kernels) -> None:
    for kernel in kernels:
        for body in innermost_loops(kernel.source):
            assert not any(_BY_A_SIZE.search(line) for line in body), kernel.source


def layout(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if name == "strided":  # every other column of a wider tensor
        wide = torch.randn(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


def run_dynamic(fn, inputs_per_call):
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aotforge", dynamic=True)
    with config.patch(cpu_codegen=True), observe() as graphs:
        for inputs in inputs_per_call:
            expected = fn(*[a.clone() for a in inputs])
            actual = compiled(*[a.clone() for a in inputs])
            for a, e in zip(actual, expected):
                assert torch.equal(a, e), (inputs[0].shape, (a - e).abs().max())
    return graphs


@pytest.mark.parametrize("name", ["contiguous", "channels_last", "strided"])
def test_pointwise_over_symbolic_sizes_matches_eager_bit_for_bit(name):
    """Per-channel operands (``(xindex / (H*W)) % C``) and layout changes (a channels-last
    input written NCHW) over symbolic N, C, H, W."""
    def fn(x, w, b):
        y = torch.relu(x * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1))
        return y.contiguous(), (x + 1).contiguous(memory_format=torch.channels_last)

    calls = []
    for n, c, h, w in SIZES:
        x = layout(torch.randn(n, c, h, w), name)
        calls.append((x, torch.randn(c), torch.randn(c)))
    graphs = run_dynamic(fn, calls)
    cpp = [g for g in graphs if g.path == "cpp"]
    assert cpp, graphs
    dynamic = [k for g in cpp for k in g.kernels if k.dynamic]
    assert dynamic
    assert_no_division_by_a_size_per_element(dynamic)


def test_relu_of_a_channels_last_image_runs_as_loops_over_its_dimensions():
    """The conv net's in-place ReLU over a channels-last conv output walked in NCHW order: the
    innermost loop walks channels (contiguous), with no ``xindex / (ks0*ks0)`` per element."""
    conv = nn.Conv2d(3, 8, 3, padding=1, bias=False).to(memory_format=torch.channels_last)

    def fn(x):
        return (torch.relu(conv(x)).contiguous(),)

    with torch.no_grad():
        calls = [(torch.randn(n, 3, s, s).contiguous(memory_format=torch.channels_last),)
                 for n, s in [(2, 5), (3, 7), (4, 8), (1, 13)]]
        graphs = run_dynamic(fn, calls)
    kernels = [k for g in graphs if g.path == "cpp" for k in g.kernels if k.dynamic]
    assert kernels
    assert_no_division_by_a_size_per_element(kernels)
    assert any("for (int64_t x1 = 0" in k.source for k in kernels), [k.source for k in kernels]


def test_the_nest_s_counters_address_the_elements_xindex_did():
    """The rewrite is exact: for sizes of every kind (1, odd, a pooled side ``s // 2`` of 1 and
    more; of 0 the kernel has no elements), each division of ``xindex`` equals its sum of counters at every element."""
    s, c = (sympy.Symbol(n, integer=True, positive=True) for n in ("s7", "s9"))
    h = FloorDiv(s, 2)
    index = (32 * ModularIndexing(XINDEX, 1, h * h) + 32 * h * h * FloorDiv(XINDEX, c * h * h)
             + ModularIndexing(XINDEX, h * h, c) + 5 * ModularIndexing(XINDEX, h, h))
    numel = 3 * c * h * h
    chain = cpp_nest._bounds([index], numel)
    assert chain == [1, h, h * h, c * h * h]
    counters = [sympy.Symbol(f"x{level}", integer=True, nonnegative=True) for level in range(len(chain))]
    rewritten = cpp_nest._counters(index, chain, counters)
    assert not any(XINDEX in a.free_symbols for a in rewritten.atoms(FloorDiv, ModularIndexing))
    for s_value, c_value in itertools.product((2, 3, 5, 8), (1, 3, 4)):
        sizes = {s: s_value, c: c_value}
        bounds = [int(b.subs(sizes)) for b in chain]
        extents = [int((chain[i + 1] / chain[i]).subs(sizes)) for i in range(len(chain) - 1)] + [3]
        for digits in itertools.product(*[range(e) for e in extents]):
            flat = sum(d * b for d, b in zip(digits, bounds))
            assert index.subs(sizes).subs(XINDEX, flat) == rewritten.subs(sizes).subs(dict(zip(counters, digits)))


def test_old_form_is_caught_by_the_check():
    """The check itself: the one-loop form with per-element divisions fails it."""
    class Kernel:
        source = ("for (int64_t xindex = 0; xindex < xnumel; ++xindex) {\n"
                  "    auto tmp0 = ptr0[32*(xindex % (ks0*ks0)) + ((xindex / (ks0*ks0)) % 32)];\n"
                  "}\n")
    with pytest.raises(AssertionError):
        assert_no_division_by_a_size_per_element([Kernel()])


def test_conv_net_training_step_over_symbolic_sizes_matches_eager():
    """A training step of conv + BatchNorm + ReLU + pooling at several batch and image sizes:
    losses and gradients as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    eager, compiled_model = model, copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aotforge", dynamic=True)
    with config.patch(cpu_codegen=True), observe() as graphs:
        for n, s in [(4, 8), (3, 10), (5, 6)]:
            x = torch.randn(n, 3, s, s)
            for net, fn in ((eager, eager), (compiled_model, compiled)):
                net.zero_grad()
                fn(x).square().mean().backward()
            for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
            for b, c in zip(eager.buffers(), compiled_model.buffers()):
                torch.testing.assert_close(c, b)
    assert any(g.path == "cpp" for g in graphs), graphs
