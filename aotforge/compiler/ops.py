"""``ops``: the instruction set that loop bodies are written in.

A body is a Python function of a symbolic index that calls ``ops.load``, ``ops.add``,
``ops.exp``, ... . What those calls do depends on the handler installed while the body runs:
the read analysis records which buffers are loaded at which index, the Triton code generator
emits one line of kernel code per call. Lowerings never know which handler is active.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

_state = threading.local()


class _OpsProxy:
    """Forwards ``ops.name(...)`` to the handler on top of the stack."""

    def __getattr__(self, name: str) -> Any:
        stack = getattr(_state, "stack", None)
        if not stack:
            raise RuntimeError(f"ops.{name} called outside of a loop body (no ops handler installed)")
        return getattr(stack[-1], name)


ops = _OpsProxy()


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

    Every value is an opaque token; ``reads`` lists ``(buffer name, index expression)``;
    ``op_count`` counts arithmetic (to decide whether a reused value is cheap to recompute).
    """

    def __init__(self) -> None:
        self.reads: list[tuple[str, Any]] = []
        self.op_count = 0
        self.has_indirect = False

    def load(self, name: str, index: Any) -> str:
        self.reads.append((name, index))
        return "v"

    def indirect_indexing(self, value: Any, size: Any, check: bool = True) -> Any:
        import sympy

        self.has_indirect = True
        return sympy.Symbol(f"indirect{len(self.reads)}", integer=True)

    def masked(self, mask: Any, body: Any, other: Any) -> str:
        body()
        return "v"

    # bookkeeping, not arithmetic: free to recompute
    FREE = frozenset({"constant", "to_dtype", "index_expr", "where"})

    def __getattr__(self, name: str) -> Any:
        def op(*args: Any, **kwargs: Any) -> str:
            if name not in self.FREE:
                self.op_count += 1
            return "v"
        return op
