"""The backend seam: a target is a printer (how the kernel builder's lines are spelled) and a
loader (how a kernel source becomes callable), nothing else. A tiny NumPy printer, written
here, runs the same kernel groups the Triton printer does: pointwise, persistent and looped
reductions, fused epilogues, masked and indirect reads."""
from __future__ import annotations

import pytest
import torch

from aotforge.compiler.codegen.kernel import Printer, emit_kernels
from aotforge.compiler.codegen.wrapper import emit_wrapper
from aotforge.compiler.lowering import lower
from aotforge.compiler.runtime import compiled as runtime
from aotforge.compiler.schedule import analyze_reads, fuse, plan_memory
from aotforge.config import config

from ..helpers import trace

NUMPY_DTYPE = {torch.float32: "np.float32", torch.float64: "np.float64", torch.int64: "np.int64",
               torch.int32: "np.int32", torch.bool: "np.bool_"}
INSTRUCTIONS = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "truediv": "({0} / {1})",
                "neg": "(-{0})", "exp": "np.exp({0})", "sqrt": "np.sqrt({0})", "rsqrt": "(1 / np.sqrt({0}))",
                "maximum": "np.maximum({0}, {1})", "minimum": "np.minimum({0}, {1})", "relu": "np.maximum({0}, 0)",
                "abs": "np.abs({0})", "remainder": "({0} % {1})", "floordiv": "({0} // {1})",
                "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
                "eq": "({0} == {1})", "ne": "({0} != {1})", "logical_and": "(({0} != 0) & ({1} != 0))"}
ACCUMULATE = {"add": "{a} + {v}", "mul": "{a} * {v}", "maximum": "np.maximum({a}, {v})",
              "minimum": "np.minimum({a}, {v})"}
ROW = {"add": "np.sum", "mul": "np.prod", "maximum": "np.max", "minimum": "np.min"}

PRELUDE = '''
import numpy as np

inf, nan = np.inf, np.nan  # as constants print


def _load(pointer, index, mask=None):
    if mask is None:
        return pointer[index]
    index, mask = np.broadcast_arrays(index, mask)
    return np.where(mask, pointer[np.where(mask, index, 0)], 0)


def _store(pointer, index, value, mask=None):
    index, value, mask = np.broadcast_arrays(index, value, True if mask is None else mask)
    pointer[index[mask]] = value[mask]
'''


class NumpyPrinter(Printer):
    """Whole-array NumPy: one "program" covers every output (XBLOCK = xnumel); a looped
    reduction walks its rows in RBLOCK chunks, as a GPU program would."""

    def assign(self, name, expression):
        return f"{name} = {expression}"

    def mask_and(self, parts):
        return " & ".join(parts)

    def block_index(self, index, level, is_reduction, full):
        return index  # NumPy broadcasts

    def broadcast(self, value, level, is_reduction):
        return value

    def load(self, pointer, index, mask):
        return f"_load({pointer}, {index}, {mask})" if mask else f"_load({pointer}, {index})"

    def upcast(self, load, dtype):
        return load

    def store(self, pointer, index, value, mask):
        return f"_store({pointer}, {index}, {value}, {mask})"

    def downcast(self, value, held, target):
        return f"np.asarray({value}).astype({NUMPY_DTYPE[target]})"

    def constant(self, value, dtype):
        return f"{NUMPY_DTYPE[dtype]}({value!r})"

    def to_dtype(self, value, dtype):
        return f"({value} != 0)" if dtype == torch.bool else f"np.asarray({value}).astype({NUMPY_DTYPE[dtype]})"

    def index_expr(self, index, dtype, level):
        return f"np.asarray({index}).astype({NUMPY_DTYPE[dtype]})"

    def wrap_negative(self, value, size):
        return f"np.where({value} < 0, {value} + {size}, {value})"

    def where(self, condition, a, b):
        return f"np.where({condition}, {a}, {b})"

    def instruction(self, name, args, dtype):
        return INSTRUCTIONS[name].format(*args)

    def accumulator(self, kind, name, identity, dtype, bound):
        if kind.returns_index:
            pytest.skip("this printer has no looped argmax")
        return [f"{name} = np.full((XBLOCK, RBLOCK), {identity})"]

    def accumulate(self, kind, name, value, mask, bound, buffer):
        return [f"{name} = np.where({mask}, {ACCUMULATE[kind.combine].format(a=name, v=value)}, {name})"]

    def finish(self, kind, values, result, indices, bound):
        if kind.returns_index:  # the first best position of each row (persistent rows only)
            best = "np.argmax" if kind.combine == "maximum" else "np.argmin"
            return [f"{result} = {best}({values}, axis=1)[:, None].astype(np.int64)"]
        return [f"{result} = {ROW[kind.combine]}({values}, axis=1)[:, None]"]

    def loop(self, reductions):
        return "for roffset in range(0, rnumel, RBLOCK):", ["rindex = roffset + rbase", "rmask = rindex < rnumel"]

    def header(self, name, parameters, is_reduction, dtypes):
        return [f"def {name}({', '.join(parameters)}, XBLOCK, RBLOCK=1):"]

    def prologue(self, is_reduction, persistent, int64):
        if not is_reduction:
            return ["xindex = np.arange(XBLOCK)", "xmask = xindex < xnumel"]
        lines = ["xindex = np.arange(XBLOCK)[:, None]", "xmask = xindex < xnumel", "rbase = np.arange(RBLOCK)[None, :]"]
        return lines + (["rindex = rbase", "rmask = rindex < rnumel"] if persistent else [])

    def rename(self, text, placeholder, name):
        return text.replace(f"def {placeholder}(", f"def {name}(", 1)


class NumpyKernel:
    """The loader's launcher: the kernel's function over the buffers' storage as flat arrays."""

    def __init__(self, source):
        namespace: dict = {}
        exec(compile(PRELUDE + "\n\n" + source.source, f"<numpy {source.name}>", "exec"), namespace)
        self.fn, self.source = namespace[source.name], source
        self.launches = 0

    def run(self, *arguments):
        buffers = arguments[:len(self.source.arguments)]
        flat = [t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,)).numpy()
                for t in buffers]
        numel, rnumel = int(self.source.numel), int(self.source.rnumel)
        sizes = [numel] + ([rnumel] if self.source.kind != "pointwise" else [])
        rblock = rnumel if self.source.kind == "persistent" else 16  # looped: several chunks a row
        self.fn(*flat, *sizes, XBLOCK=numel, RBLOCK=rblock)
        self.launches += 1


def _compile_with_numpy(fn, *args):
    lowered = lower(trace(fn, *args))
    reads = analyze_reads(lowered)
    plan = fuse(lowered, reads)
    memory = plan_memory(lowered, plan, reads)
    kernels = emit_kernels(lowered, plan, reads, NumpyPrinter())
    program = emit_wrapper(lowered, plan, memory, kernels)
    return runtime.load("forward", lowered, plan, memory, kernels, program, {}, launcher=NumpyKernel), kernels


CASES = {
    "pointwise": (lambda x, w: ((x * 2 + w).exp(), x.relu() - w), lambda: (torch.randn(8, 32), torch.randn(32))),
    "persistent_reduction": (lambda x, w: (torch.softmax(x * w, -1), (x - x.mean(1, keepdim=True)).sum(1),
                                           x.argmax(1)),
                             lambda: (torch.randn(8, 32), torch.randn(32))),
    "looped_reduction": (lambda x, w: ((x * w).sum(0), x.amax(0)), lambda: (torch.randn(200, 8), torch.randn(8))),
    "masked_and_indirect": (lambda x, w: (torch.cat([x, x.exp()], 1).sum(1), x[w.long().abs() % 8] + 1),
                            lambda: (torch.randn(8, 32), torch.randn(5) * 8)),
}


@pytest.mark.parametrize("name", CASES)
def test_a_numpy_printer_runs_the_kernels(name):
    fn, make_inputs = CASES[name]
    torch.manual_seed(0)
    args = make_inputs()
    with config.patch(persistent_reduction_limit=64):  # (200-element columns loop)
        compiled, kernels = _compile_with_numpy(fn, *args)
    outputs = compiled.call([a.clone() for a in args])
    for actual, expected in zip(outputs, fn(*args)):
        torch.testing.assert_close(actual, expected)
    assert kernels and all("np." in k.source or "_load" in k.source for k in kernels)
    assert not any("tl." in k.source for k in kernels)  # only the Triton printer spells Triton
    assert all(launcher.launches == 1 for launcher in compiled.launchers.values())
    kinds = {k.kind for k in kernels}
    wanted = {"pointwise": "pointwise", "persistent_reduction": "persistent", "looped_reduction": "looped"}.get(name)
    assert wanted is None or wanted in kinds
