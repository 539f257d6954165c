"""Loop bodies as data: a computed buffer's body, captured once into a record of instructions.

Lowerings write a body as a Python function of a symbolic index that calls ``ops``
(``ops.load``, ``ops.add``, ...). When the buffer is made, ``capture`` runs that function
once, with plain index symbols (``i0, i1, ...`` for the kept dimensions, ``r0, ...`` for the
reduced ones), and keeps what it did::

    Code(instructions=(
        Instruction(0, "load", ("arg0_1", 64*i0 + r0)),
        Instruction(1, "exp", (Ref(0),)),
    ), result=Ref(1))

Every later stage (the read analysis, the printed records, fusion, code generation) *walks*
the record with ``replay(code, handler, mapping)``: each instruction becomes one call of the
handler, operands that name an earlier value (``Ref``) become the handler's value for it and
index expressions have the stage's index substituted for the symbols. Nothing after lowering
ever runs a lowering's closure, and a body is a plain, frozen, hashable value.

``masked(mask, body, other)`` keeps its body as a nested ``Code`` block: handlers scope it
(the Triton kernel masks every load inside it). ``indirect_indexing`` defines a symbol
(``indirect3``) that later index expressions use; replay maps it to the handler's symbol.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import sympy

from .ops import INSTRUCTIONS, use_handler


@dataclasses.dataclass(frozen=True)
class Ref:
    """An operand that is the value of instruction ``number``."""

    number: int

    def __str__(self) -> str:
        return f"t{self.number}"


@dataclasses.dataclass(frozen=True)
class Instruction:
    number: int  # the value it defines (``Ref(number)``); numbered in the order of capture
    op: str  # a name of ops.INSTRUCTIONS
    args: tuple  # Ref | sympy expression | number | dtype | str | Code (masked's body)


@dataclasses.dataclass(frozen=True)
class Code:
    """A straight-line list of instructions and the value it produces."""

    instructions: tuple
    result: Any  # Ref, or a plain value when the body computes nothing (rare)

    def walk(self):
        """Every instruction, nested blocks' included, in capture order."""
        for instruction in self.instructions:
            for arg in instruction.args:
                if isinstance(arg, Code):
                    yield from arg.walk()
            yield instruction


def indirect_symbol(number: int) -> sympy.Symbol:
    return sympy.Symbol(f"indirect{number}", integer=True)


class _Capture:
    """The ``ops`` handler that records: every call appends an instruction and returns its
    ``Ref``. An unknown instruction is a lowering bug, reported at once."""

    def __init__(self) -> None:
        self.count = 0
        self.blocks: list[list[Instruction]] = [[]]
        self.scopes = [0]  # a number per open block: a value recorded in one is read in it only
        self.opened = 0  # blocks opened so far (each gets its own number)

    def _add(self, op: str, args: tuple) -> Ref:
        instruction = Instruction(self.count, op, args)
        self.count += 1
        self.blocks[-1].append(instruction)
        return Ref(instruction.number)

    def indirect_indexing(self, value: Any, size: Any, check: bool = True) -> sympy.Symbol:
        return indirect_symbol(self._add("indirect_indexing", (value, size, check)).number)

    @property
    def scope(self) -> int:
        return self.scopes[-1]

    def masked(self, mask: Any, body: Callable[[], Any], other: Any) -> Ref:
        self.blocks.append([])
        self.opened += 1
        self.scopes.append(self.opened)
        try:
            result = body()
        finally:
            inner = self.blocks.pop()
            self.scopes.pop()
        return self._add("masked", (mask, Code(tuple(inner), result), other))

    def __getattr__(self, name: str) -> Any:
        if name not in INSTRUCTIONS:
            raise AttributeError(f"a loop body called ops.{name}, which is no instruction of ops.INSTRUCTIONS")

        def op(*args: Any) -> Ref:
            return self._add(name, args)
        return op


def capture(fn: Callable, *indices: Sequence[sympy.Symbol]) -> Code:
    """Run a lowering's body function once on ``indices`` (plain symbols) and keep its record."""
    recorder = _Capture()
    with use_handler(recorder):
        result = fn(*indices)
    return Code(tuple(recorder.blocks[0]), result)


def replay(code: Code, handler: Any, mapping: dict) -> Any:
    """Walk ``code`` through ``handler`` (the handler need not be installed), with the index
    symbols replaced as ``mapping`` says; returns the handler's value for the result."""
    values: dict[int, Any] = {}
    mapping = dict(mapping)
    with use_handler(handler):
        return _run(code, handler, values, mapping)


def _run(code: Code, handler: Any, values: dict, mapping: dict) -> Any:
    for instruction in code.instructions:
        op, args = instruction.op, instruction.args
        if op == "masked":
            mask, block, other = args
            values[instruction.number] = handler.masked(
                _operand(mask, values, mapping), lambda block=block: _run(block, handler, values, mapping), other)
            continue
        operands = [_operand(a, values, mapping) for a in args]
        result = getattr(handler, op)(*operands)
        if op == "indirect_indexing":
            mapping[indirect_symbol(instruction.number)] = result
        values[instruction.number] = result
    return _operand(code.result, values, mapping)


def _operand(arg: Any, values: dict, mapping: dict) -> Any:
    if isinstance(arg, Ref):
        return values[arg.number]
    if isinstance(arg, sympy.Basic) and mapping and not arg.is_Number:
        return arg.xreplace(mapping)
    return arg
