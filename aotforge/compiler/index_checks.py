"""The bounds rules of indices read from tensors (``ops.indirect_indexing``'s ``check``), one
per eager op family, with the error eager raises for an index outside them.

Eager does not treat every index alike::

    x[torch.tensor([-1])]                 # advanced indexing: -1 counts from the end
    x.index_select(0, torch.tensor([-1])) # IndexError: index out of range in self
    x.gather(0, torch.tensor([[-1]]))     # RuntimeError: index -1 is out of bounds for dimension 0 with size 5

so a lowering names its op's rule, and a kernel that meets a bad index reports the value, the
dimension's size and the rule, from which the launcher raises eager's exception, message and
all (``index_error``). A check is a short string (a body's record holds it as data):
``"index:<dim>"``, ``"select"``, ``"gather:<dim>"``; ``"select_dim1"`` is index_select along
dimension 1 of a tensor of two or more dimensions (eager's kernel for it has its own message).
"""
from __future__ import annotations

from typing import Any

# rule -> (negative indices count from the end, eager's exception type)
RULES = {"index": (True, IndexError), "select": (False, IndexError), "gather": (False, RuntimeError),
         "select_dim1": (False, RuntimeError)}


def index_check(rule: str, dim: int = 0) -> str:
    assert rule in RULES, rule
    return rule if rule in ("select", "select_dim1") else f"{rule}:{dim}"


def parse(check: Any) -> tuple[str, int]:
    """(rule, dimension) of a check; ``True`` (the default of ``indirect_indexing``) is
    advanced indexing's rule."""
    if not isinstance(check, str):
        return "index", 0
    rule, _, dim = check.partition(":")
    return rule, int(dim or 0)


def wraps_negative(check: Any) -> bool:
    return RULES[parse(check)[0]][0]


def index_error(check: Any, value: int, size: int) -> Exception:
    """The exception eager raises for ``value`` outside a dimension of ``size`` under ``check``."""
    rule, dim = parse(check)
    if rule == "select":
        return IndexError("index out of range in self")
    if rule == "select_dim1":
        return RuntimeError(f"INDICES element is out of DATA bounds, id={value} axis_dim={size}")
    return RULES[rule][1](f"index {value} is out of bounds for dimension {dim} with size {size}")


# the C++ kernels' integer spelling of a check (codegen/cpp.py; read back by runtime/cpp_launch.py)
_CODES = {"index": 0, "select": 1, "gather": 2, "select_dim1": 3}
_RULES_BY_CODE = {code: rule for rule, code in _CODES.items()}


def encode(check: Any) -> int:
    rule, dim = parse(check)
    return _CODES[rule] + 4 * dim


def decode(code: int) -> str:
    return index_check(_RULES_BY_CODE[code % 4], code // 4)
