"""Loop bodies are data: captured once when a buffer is made, plain frozen records after
that (no closure survives lowering), walked by every later stage; lowered graphs compare
and hash by what they compute."""
from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch
import torch.nn.functional as F

from aotforge.compiler import body as body_module, ir
from aotforge.compiler.body import Code, Instruction, Ref, capture
from aotforge.compiler.codegen import triton_ops
from aotforge.compiler.codegen.kernel import emit_kernels
from aotforge.compiler.codegen.triton import TritonPrinter
from aotforge.compiler.codegen.wrapper import emit_wrapper
from aotforge.compiler.ir import ComputedBuffer, index_symbols
from aotforge.compiler.lowering import lower
from aotforge.compiler.ops import ARITHMETIC, INSTRUCTIONS, PREDICATES, ops
from aotforge.compiler.runtime import compiled as runtime
from aotforge.compiler.schedule import analyze_reads, fuse, plan_memory
from aotforge.config import config

from .helpers import trace


def _many_kinds(x, i):
    """Pointwise, reductions (one split), masked reads (cat, pad), an indirect read, argmax."""
    return (torch.cat([x, x.exp()], 1).sum(1), F.pad(x, (1, 2)) * 2, x[i].softmax(-1), x.argmax(0),
            x.reshape(-1).repeat(64).sum())


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8, 32, dtype=torch.float64), torch.randint(0, 8, (5,))


def _plain_values(obj, path="body"):
    """Every leaf of a record, with where it sits; records are dataclasses, tuples or leaves."""
    if dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            yield from _plain_values(getattr(obj, field.name), f"{path}.{field.name}")
    elif isinstance(obj, (tuple, list)):
        for position, item in enumerate(obj):
            yield from _plain_values(item, f"{path}[{position}]")
    else:
        yield path, obj


def test_bodies_are_plain_frozen_records():
    x, i = _inputs()
    lowered = lower(trace(_many_kinds, x, i))
    bodies = [op.body for op in lowered.operations if isinstance(op, ComputedBuffer)]
    assert len(bodies) >= 6
    ops_used = set()
    for body in bodies:
        assert isinstance(body.code, Code)
        for path, leaf in _plain_values(body):
            assert not callable(leaf) or isinstance(leaf, (torch.dtype, sympy.Basic)), f"{path} is {leaf!r}"
            assert not isinstance(leaf, list), f"{path} is a mutable list"
        ops_used |= {instruction.op for instruction in body.code.walk()}
        hash(body)
        with pytest.raises(dataclasses.FrozenInstanceError):
            body.code = None
    assert ops_used <= INSTRUCTIONS
    assert {"load", "masked", "indirect_indexing", "exp", "where"} <= ops_used


def test_no_stage_after_lowering_runs_a_closure(monkeypatch):
    """Capture is the last time a lowering's function runs (bodies hold no reference to it):
    with capturing made to fail after lowering, every later stage and the run still work."""
    x, i = _inputs()
    lowered = lower(trace(_many_kinds, x, i))

    def no_more_capture(*args, **kwargs):
        raise AssertionError("a body was captured (a closure ran) after lowering")
    monkeypatch.setattr(ir, "capture", no_more_capture)
    monkeypatch.setattr(body_module, "capture", no_more_capture)
    str(lowered)  # the printer walks the records
    reads = analyze_reads(lowered)
    plan = fuse(lowered, reads)
    memory = plan_memory(lowered, plan, reads)
    with config.patch(triton_on_cpu=True):
        kernels = emit_kernels(lowered, plan, reads, TritonPrinter())
        program = emit_wrapper(lowered, plan, memory, kernels)
        compiled = runtime.load("forward", lowered, plan, memory, kernels, program, {}, run_aten_graph=None)
        outputs = compiled.call([x.clone(), i.clone()])
    for actual, expected in zip(outputs, _many_kinds(x, i)):
        torch.testing.assert_close(actual, expected)
    assert len(plan.kernels()) >= 3


def test_lowered_graphs_compare_and_hash_by_what_they_compute():
    x, i = _inputs()
    first, second = lower(trace(_many_kinds, x, i)), lower(trace(_many_kinds, x, i))
    assert first is not second and first == second and hash(first) == hash(second)
    assert len({first, second}) == 1
    other = lower(trace(lambda x, i: (x.cos().sum(1),), x, i))
    assert first != other
    # the same ops at another size are another graph
    assert lower(trace(_many_kinds, torch.randn(4, 32, dtype=torch.float64), i)) != first


def test_capture_records_each_call_once_and_names_its_values():
    i0, i1 = index_symbols("i", 2)
    code = capture(lambda index: ops.exp(ops.add(ops.load("x", 4 * index[0] + index[1]),
                                                 ops.constant(1.0, torch.float32))), [i0, i1])
    assert code == Code((Instruction(0, "load", ("x", 4 * i0 + i1)),
                         Instruction(1, "constant", (1.0, torch.float32)),
                         Instruction(2, "add", (Ref(0), Ref(1))),
                         Instruction(3, "exp", (Ref(2),))), Ref(3))


def test_an_unknown_instruction_is_a_clear_error():
    with pytest.raises(AttributeError, match="ops.frobnicate, which is no instruction"):
        capture(lambda index: ops.frobnicate(ops.load("x", index[0])), index_symbols("i", 1))


def test_the_triton_printer_spells_every_instruction():
    assert set(triton_ops.ARITHMETIC) == ARITHMETIC
    assert set(triton_ops.PREDICATES) == PREDICATES



def test_a_value_read_twice_is_captured_once():
    # max pooling's taps are a chain of selects, each reading the best so far twice: captured
    # as a tree, n links were 2^n loads of the first tap (a 5 x 5 window: hours to compile)
    x = ir.Pointwise([sympy.Integer(4)], torch.float32, torch.device("cpu"), lambda index: ops.load("x", index[0]))
    best = x
    for link in range(12):
        prev = best.make_loader()
        best = ir.Pointwise(best.size, best.dtype, best.device,
                            lambda index, prev=prev: ops.where(ops.gt(ops.constant(float(link), torch.float32),
                                                                      prev(index)), prev(index), prev(index)))
    code = capture(best.make_loader(), index_symbols("i", 1))
    loads = [i for i in code.walk() if i.op == "load"]
    assert len(loads) == 1, len(loads)
    assert len(list(code.walk())) < 100


def test_a_value_read_inside_and_outside_a_masked_block_is_recorded_in_each():
    # a value recorded in a masked block exists only there: read after it, it is recorded again
    x = ir.Pointwise([sympy.Integer(4)], torch.float32, torch.device("cpu"), lambda index: ops.load("x", index[0]))
    load = x.make_loader()

    def body(index):
        inner = ops.masked(ops.lt(index[0], 2), lambda: load(index), 0.0)
        return ops.add(inner, load(index))
    code = capture(body, index_symbols("i", 1))
    outer = [i for i in code.instructions if i.op == "load"]
    masked = next(i for i in code.instructions if i.op == "masked")
    assert len(outer) == 1 and [i.op for i in masked.args[1].instructions] == ["load"]


def test_nested_masked_blocks_opened_back_to_back_keep_their_values_apart():
    # the inner block opens before the outer one records anything: a value recorded in the
    # inner block must still be recorded again in the outer one
    x = ir.Pointwise([sympy.Integer(4)], torch.float32, torch.device("cpu"), lambda index: ops.load("x", index[0]))
    load = x.make_loader()

    def body(index):
        mask = ops.lt(index[0], 2)

        def outer():
            inner = ops.masked(mask, lambda: load(index), 0.0)
            return ops.add(inner, load(index))
        return ops.masked(mask, outer, 0.0)
    code = capture(body, index_symbols("i", 1))
    (outer,) = [i for i in code.instructions if i.op == "masked"]
    outer_block = outer.args[1].instructions
    (inner,) = [i for i in outer_block if i.op == "masked"]
    assert [i.op for i in inner.args[1].instructions] == ["load"]
    assert [i.op for i in outer_block if i.op == "load"] == ["load"]
