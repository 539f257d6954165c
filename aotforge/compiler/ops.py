"""``ops``: the instruction set that loop bodies are written in.

A lowering writes a body as a Python function of a symbolic index that calls ``ops.load``,
``ops.add``, ``ops.exp``, ... ; it runs once, under the capturing handler, into a record
(body.py). Every later stage replays the record through its own handler: the read analysis
records which buffers are loaded at which index, the printer writes numbered lines, the
kernel builder emits one line of kernel code per call. Lowerings never know which handler is
active.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

# --- the instruction set ---------------------------------------------------------------------
#
# Every instruction a body may use, with its operands and the dtype of its result. A body is
# captured into a record of these (body.py); every handler (read analysis, printer, each code
# generator) implements all of them.

# structure: memory, conversions, index arithmetic, control
STRUCTURE = {
    "load": "(buffer name, index) -> the buffer's dtype (half types: held as float32)",
    "constant": "(number, dtype) -> dtype",
    "to_dtype": "(value, dtype, source dtype) -> dtype",
    "index_expr": "(index expression, dtype) -> dtype",
    "indirect_indexing": "(value, size, check) -> an index symbol (check: the op's bounds rule, index_checks.py)",
    "masked": "(mask, body, other) -> the body's value where mask holds, other elsewhere; loads in the body are masked",
    "where": "(condition, a, b) -> a's dtype",
    "philox_uniform": "(seed, counter) -> float32: Philox4x32-10's first word for (seed, counter) as a "
                      "uniform in [0, 1), aotforge/philox.py's (Triton's tl.rand)",
}
# elementwise math whose result has its (first) operand's dtype (fma(a, b, c): a * b + c rounded
# once, as eager's vectorized CPU kernels compute lerp)
ARITHMETIC = frozenset("""
    add sub rsub mul truediv neg abs maximum minimum relu reciprocal floordiv truncdiv remainder fmod
    pow atan2 copysign hypot fmax fmin sign floor ceil trunc round bitwise_and bitwise_or bitwise_xor
    bitwise_not exp exp2 expm1 log log2 log10 log1p sqrt rsqrt sin cos tan asin acos atan sinh cosh
    tanh asinh acosh atanh erf erfc erfinv sigmoid lgamma fma""".split())
# comparisons and tests: a bool result
PREDICATES = frozenset("""
    eq ne lt le gt ge logical_and logical_or logical_xor logical_not isnan isinf signbit""".split())

INSTRUCTIONS = frozenset(STRUCTURE) | ARITHMETIC | PREDICATES

_state = threading.local()


class _OpsProxy:
    """Forwards ``ops.name(...)`` to the handler on top of the stack."""

    def __getattr__(self, name: str) -> Any:
        stack = getattr(_state, "stack", None)
        if not stack:
            raise RuntimeError(f"ops.{name} called outside of a loop body (no ops handler installed)")
        return getattr(stack[-1], name)


ops = _OpsProxy()


def current_handler() -> Any:
    """The handler ``ops`` calls go to now (None outside of a loop body)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_handler(handler: Any) -> Iterator[Any]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(handler)
    try:
        yield handler
    finally:
        stack.pop()


class ReadRecorder:
    """A handler that runs a body only to learn what it reads and how much work it does.

    ``reads`` lists ``(buffer name, index expression)`` per load; ``op_count`` counts distinct
    arithmetic (a subexpression the body computes twice counts once, as in generated code),
    to decide whether a reused value is cheap to recompute.
    """

    # bookkeeping, not arithmetic: free to recompute
    FREE = frozenset({"constant", "to_dtype", "index_expr", "where"})

    def __init__(self) -> None:
        self.reads: list[tuple[str, Any]] = []
        self.values: dict[Any, int] = {}
        self.has_indirect = False

    @property
    def op_count(self) -> int:
        return sum(1 for key in self.values if key[0] not in self.FREE and key[0] != "load")

    def _value(self, key: Any) -> int:
        return self.values.setdefault(key, len(self.values))

    def load(self, name: str, index: Any) -> int:
        self.reads.append((name, index))
        return self._value(("load", name, index))

    def indirect_indexing(self, value: Any, size: Any, check: bool = True) -> Any:
        import sympy

        self.has_indirect = True
        return sympy.Symbol(f"indirect{value}", integer=True)

    def masked(self, mask: Any, body: Any, other: Any) -> int:
        return self._value(("masked", mask, body(), _key(other)))

    def __getattr__(self, name: str) -> Any:
        def op(*args: Any, **kwargs: Any) -> int:
            return self._value((name,) + tuple(_key(a) for a in args))
        return op


def _key(value: Any) -> Any:
    """``value`` as part of a dict key: itself when hashable (sympy expressions hash without
    being printed; printing them was a large part of compile time), else its text."""
    try:
        hash(value)
    except TypeError:
        return str(value)
    return value


class BodyPrinter:
    """A handler that writes a body as numbered lines, one per distinct value, for printing
    the loop IR (``LoweredGraph``)::

        t0 = load(arg0_1, i1 + 64*i0)
        t1 = exp(t0)
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, str] = {}

    def _value(self, text: str) -> str:
        if text not in self.names:
            self.names[text] = f"t{len(self.names)}"
            self.lines.append(f"{self.names[text]} = {text}")
        return self.names[text]

    def load(self, name: str, index: Any) -> str:
        return self._value(f"load({name}, {index})")

    def indirect_indexing(self, value: Any, size: Any, check: bool = True) -> Any:
        import sympy

        return sympy.Symbol(str(value), integer=True)

    def masked(self, mask: Any, body: Any, other: Any) -> str:
        return self._value(f"masked({mask}, {body()}, {other})")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def op(*args: Any, **kwargs: Any) -> str:
            shown = [str(a).replace("torch.", "") for a in args] + [f"{k}={v}" for k, v in kwargs.items()]
            return self._value(f"{name}({', '.join(shown)})")
        return op
