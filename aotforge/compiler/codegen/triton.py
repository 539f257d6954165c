"""The Triton printer: how the kernel builder's lines (codegen/kernel.py) are spelled in
Triton, and the module a kernel's source is loaded in. The only module of the compiler that
spells Triton (with its tables, ``triton_ops.py``, and the runtime that launches the kernels).

Kernels are ``@triton.jit`` functions over blocks: ``XBLOCK`` outputs per program, and for a
reduction ``[XBLOCK, RBLOCK]`` tiles (``RBLOCK`` a whole row when it is persistent)::

    def aot_persistent_...(ptr0, ptr1, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
        xoffset = tl.program_id(0) * XBLOCK
        xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
        ...
        tmp0 = tl.load(ptr0 + (64*xindex + rindex), xmask & rmask, other=0)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..dtypes import compute_dtype
from ..reduction_kinds import ReductionKind
from .kernel import Printer
from .. import index_checks
from .triton_ops import (ACCUMULATE, ARITHMETIC, BEATS, COMBINE_FUNCTION, HELPERS, PREDICATES, TRITON_DTYPE,
                         spell)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if value != value:
            return "float('nan')"
        if value in (float("inf"), float("-inf")):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    return repr(int(value))


class TritonPrinter(Printer):
    """Spells the builder's lines in Triton (one line of text per call)."""

    language = "triton"

    def assign(self, name: str, expression: str) -> str:
        return f"{name} = {expression}"

    def mask_and(self, parts: list[str]) -> str:
        return " & ".join(parts)

    def _shape(self, level: int, is_reduction: bool) -> str:
        if not is_reduction:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if level == 2 else "[XBLOCK, 1]"

    def block_index(self, index: str, level: int, is_reduction: bool, full: bool) -> str:
        """Compiled Triton wants the pointer, the mask and the value of a load or store to have
        one shape: an index missing a variable of its level is widened with zeros."""
        if level == 0:
            return f"{index} + tl.full({'[1, 1]' if is_reduction else '[1]'}, 0, tl.int32)"
        return index if full else f"{index} + tl.full({self._shape(level, is_reduction)}, 0, tl.int32)"

    def broadcast(self, value: str, level: int, is_reduction: bool) -> str:
        return f"tl.broadcast_to({value}, {self._shape(level, is_reduction)})"

    def load(self, pointer: str, index: str, mask: Optional[str]) -> str:
        return f"tl.load({pointer} + ({index}), {mask}, other=0)" if mask else f"tl.load({pointer} + ({index}))"

    def upcast(self, load: str, dtype: torch.dtype) -> str:
        return load + ".to(tl.float32)" if compute_dtype(dtype) != dtype else load

    def store(self, pointer: str, index: str, value: str, mask: Optional[str]) -> str:
        return f"tl.store({pointer} + ({index}), {value}, {mask or 'None'})"

    def downcast(self, value: str, held: torch.dtype, target: torch.dtype) -> str:
        if target == torch.bool and held != torch.bool:
            return f"({value} != 0)"
        if compute_dtype(target) != held or target != compute_dtype(target):
            return f"{value}.to({TRITON_DTYPE[target]})"
        return value

    def constant(self, value: Any, dtype: torch.dtype) -> str:
        return f"tl.full([], {_literal(value)}, {TRITON_DTYPE[dtype]})"

    def to_dtype(self, value: str, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return f"({value} != 0)"
        if dtype != compute_dtype(dtype):
            return f"{value}.to({TRITON_DTYPE[dtype]}).to(tl.float32)"
        return f"{value}.to({TRITON_DTYPE[dtype]})"

    def index_expr(self, index: str, dtype: torch.dtype, level: int) -> str:
        if level == 0:
            return f"tl.full([], {index}, {TRITON_DTYPE[dtype]})"
        return f"({index}).to({TRITON_DTYPE[dtype]})"

    def wrap_negative(self, value: str, size: str) -> str:
        return f"tl.where({value} < 0, {value} + {size}, {value})"

    def indirect_index(self, value: str, size: str, check: Any) -> str:
        # checked, never wrapped where eager raises (index_select, gather, embedding): a device
        # assert on the GPU (the kernel is compiled with debug on: runtime/launch.py), eager's
        # exception in the interpreter (module_prelude)
        return f"aot_check_index({value}, {size}, {index_checks.encode(check)})"

    def where(self, condition: str, a: str, b: str) -> str:
        return f"tl.where({condition}, {a}, {b})"

    def philox_uniform(self, seed: str, counter: str) -> str:
        # the draw, the int32 fold and the scale in one call, as aotforge/philox.py's reference
        # (its int64 spelling cost about ten emulated 64-bit operations per element)
        return f"tl.rand({seed}, {counter})"

    def instruction(self, name: str, args: list[str], dtype: torch.dtype) -> str:
        entry = ARITHMETIC[name] if name in ARITHMETIC else PREDICATES[name]
        return f"({spell(entry, args, dtype)})"

    # --- reductions and loops -----------------------------------------------------------------

    def accumulator(self, kind: ReductionKind, name: str, identity: str, dtype: torch.dtype, bound: str) -> list[str]:
        lines = [f"{name} = tl.full([XBLOCK, RBLOCK], {identity}, {TRITON_DTYPE[dtype]})"]
        if kind.returns_index:
            lines.append(f"{name}_index = tl.full([XBLOCK, RBLOCK], {bound}, tl.int64)")
        return lines

    def accumulate(self, kind: ReductionKind, name: str, value: str, mask: str, bound: str, buffer: str) -> list[str]:
        if not kind.returns_index:
            step = ACCUMULATE[kind.combine].format(a=name, v=value)
            return [f"{name} = tl.where({mask}, {step}, {name})"]
        # a lane's first valid element always replaces the identity it starts from (a row of
        # -inf, of +inf or of uint8 zeros equals that identity and never beats it)
        return [f"better_{buffer} = (({BEATS[kind.combine]}({value}, {name}) | ({name}_index == {bound})) & {mask})",
                f"{name}_index = tl.where(better_{buffer}, rindex, {name}_index)",
                f"{name} = tl.where(better_{buffer}, {value}, {name})"]

    def finish(self, kind: ReductionKind, values: str, result: str, indices: str, bound: str) -> list[str]:
        combine = COMBINE_FUNCTION[kind.combine]
        if not kind.returns_index:
            return [f"{result} = tl.reduce({values}, 1, {combine})[:, None]"]
        positions = f"tl.broadcast_to({indices}, [XBLOCK, RBLOCK])"
        # the first position holding the best value (NaN counts as the best, as in eager)
        return [f"{result}_best = tl.reduce({values}, 1, {combine})[:, None]",
                f"{result} = tl.reduce(tl.where(_same_value({values}, {result}_best), {positions}, {bound}), 1, "
                f"_min_combine)[:, None].to(tl.int64)"]

    def loop(self, reductions: list) -> tuple[str, list[str]]:
        return "for roffset in range(0, rnumel, RBLOCK):", ["rindex = roffset + rbase", "rmask = rindex < rnumel"]

    # --- the kernel function --------------------------------------------------------------------

    def header(self, name: str, parameters: list[str], is_reduction: bool, dtypes: tuple = ()) -> list[str]:
        return [f"def {name}({', '.join(parameters)}, "
                f"XBLOCK: tl.constexpr{', RBLOCK: tl.constexpr' if is_reduction else ''}):"]

    def prologue(self, is_reduction: bool, persistent: bool, int64: bool) -> list[str]:
        offset = "tl.program_id(0).to(tl.int64) * XBLOCK" if int64 else "tl.program_id(0) * XBLOCK"
        lines = [f"xoffset = {offset}"]
        if not is_reduction:
            return lines + ["xindex = xoffset + tl.arange(0, XBLOCK)", "xmask = xindex < xnumel"]
        lines += ["xindex = xoffset + tl.arange(0, XBLOCK)[:, None]", "xmask = xindex < xnumel",
                  "rbase = tl.arange(0, RBLOCK)[None, :].to(tl.int64)" if int64 else "rbase = tl.arange(0, RBLOCK)[None, :]"]
        if persistent:
            lines += ["rindex = rbase", "rmask = rindex < rnumel"]
        return lines

    def rename(self, text: str, placeholder: str, name: str) -> str:
        return text.replace(f"def {placeholder}(", f"def {name}(", 1)


# A kernel that reads an index from a tensor checks it on the GPU with a device assert, as
# eager's CUDA kernels do (index_select, gather and embedding raise "device-side assert
# triggered"); Triton compiles asserts only into kernels built with debug on, which launch.py
# asks for (with its integer-overflow checks off) for kernels that call this helper only.
CHECK_INDEX_GPU = '''
@triton.jit
def aot_check_index(index, size, CHECK: tl.constexpr):
    position = index
    if CHECK % 4 == 0:  # advanced indexing (index_checks.py): negatives count from the end
        position = tl.where(index < 0, index + size, index)
    inside = (position >= 0) & (position < size)
    tl.device_assert(inside, "index out of bounds in an indexing operation (aotforge)")
    return tl.where(inside, position, 0)
'''
CHECKS_INDICES = "aot_check_index("  # in a kernel's source: it needs debug on (launch.py)


def module_prelude(interpret: bool) -> str:
    """What every module of Triton kernels starts with (the helpers kernels call)."""
    # the interpreter's libdevice, and a range() its loop bounds work with on every Triton;
    # its index check raises eager's exception (device asserts do nothing there)
    libdevice = ("from aotforge.compiler.runtime.interpret_math import aot_check_index, libdevice, range"
                 if interpret else "from triton.language.extra import libdevice")
    helpers = HELPERS if interpret else HELPERS + CHECK_INDEX_GPU
    return f"import triton\nimport triton.language as tl\n{libdevice}\n\n{helpers}\n"
