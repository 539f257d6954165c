"""The accuracy bisector: ``AOTFORGE_VERIFY=1`` / ``aotforge.config.verify``.

Every graph the ``aotforge`` backend compiles is wrapped (in backends.py) so that each call
also runs the same FX graph through plain ATen on the same inputs and compares the outputs
with a dtype-aware tolerance (``TOLERANCES``). On a mismatch it

1. bisects: compiles the graph's prefix up to node k (returning node k's value) with the real
   compiler and compares it with eager's value of node k; a binary search over k finds the
   first node whose compiled value diverges;
2. reports that node with its source lines (the user's stack trace when the graph kept it,
   else the graph's own code line);
3. writes a standalone repro script (``repro.py`` plus ``repro_inputs.pt``) for that prefix to
   the dump directory (``AOTFORGE_DUMP_DIR``, else a new temporary folder);

and raises ``AccuracyError`` with the report, so that a wrong answer is never silent.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import textwrap
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import debug
from .compiler import compile_fx_inner
from .config import Config, config

# dtype -> (rtol, atol). Fusion reorders floating-point arithmetic, so the bounds are looser
# than bit-exact but far below the size of a wrong lowering.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
    torch.complex128: (1e-7, 1e-7),
    torch.complex64: (1e-4, 1e-5),
}


class AccuracyError(RuntimeError):
    """A compiled graph's outputs differ from plain ATen's beyond the tolerance."""

    def __init__(self, message: str, report: "Mismatch"):
        super().__init__(message)
        self.report = report


class Mismatch:
    """Where the compiled graph first diverged from eager, and how to reproduce it."""

    def __init__(self, node: Optional[fx.Node], difference: str, source: list[str],
                 repro_path: Optional[str]):
        self.node, self.difference, self.source, self.repro_path = node, difference, source, repro_path

    def __str__(self) -> str:
        if self.node is None:
            where = "no single node's value diverges (the difference is in how outputs are returned)"
        else:
            where = f"first diverging node: {self.node.name} = {self.node.target}({_args_text(self.node)})"
        lines = [where, f"difference: {self.difference}"]
        if self.source:
            lines.append("source:\n" + "\n".join(f"  {line}" for line in self.source))
        if self.repro_path:
            lines.append(f"repro script: {self.repro_path} (python {self.repro_path})")
        return "\n".join(lines)


def _args_text(node: fx.Node) -> str:
    return ", ".join(str(a) for a in node.args)


def difference(actual: Any, expected: Any) -> Optional[str]:
    """None if ``actual`` matches ``expected`` within the dtype's tolerance, else why not."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return f"expected {len(expected)} outputs, got {actual!r:.80}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            why = difference(a, e)
            if why is not None:
                return f"output {index}: {why}"
        return None
    if not isinstance(expected, torch.Tensor):
        return None if actual == expected or expected is None else f"{actual!r} != {expected!r}"
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (f"shape/dtype {tuple(actual.shape)} {actual.dtype}, expected "
                f"{tuple(expected.shape)} {expected.dtype}")
    rtol, atol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
        return None
    if a.is_floating_point() or a.is_complex():
        error = (a - e).abs()
        error = torch.where(torch.isnan(error) & ~(torch.isnan(a) & torch.isnan(e)), math.inf, error)
        worst = float(error.nan_to_num(0.0).max())
        return f"max abs difference {worst:.3g} (rtol {rtol}, atol {atol}, {a.dtype})"
    return f"{int((a != e).sum())} of {a.numel()} elements differ ({a.dtype}, exact comparison)"


def _clone(values: Sequence[Any]) -> list:
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]


def _call(compiled: Callable, args: list) -> list:
    if getattr(compiled, "_boxed_call", False):
        out = compiled(args)
    else:
        out = compiled(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def verified(reference: fx.GraphModule, compiled: Callable, *, kind: str,
             patches: Optional[dict] = None,
             compile_graph: Optional[Callable] = None) -> Callable:
    """``compiled`` (boxed), checked on every call against ``reference`` run eagerly."""
    scope = debug.current_scope()
    # The settings this graph was compiled under (the bisector and the repro recompile with
    # them, later, when the caller's patch may be gone).
    defaults = Config().to_dict()
    patches = {k: v for k, v in config.to_dict().items() if v != defaults[k]} | dict(patches or {})
    patches.pop("verify", None)

    def run(args: list) -> list:
        originals = _clone(args)  # the compiled graph may free or mutate its inputs
        outputs = _call(compiled, args)
        expected = _call(reference, _clone(originals))
        why = difference(outputs, expected)
        if why is None:
            return outputs
        report = bisect(reference, originals, patches, compile_graph, scope)
        message = (f"aotforge verify: the compiled {kind} graph differs from eager ATen "
                   f"({why})\n{report}")
        debug.artifact("verify", f"{kind}_mismatch", message, suffix=".txt")
        raise AccuracyError(message, report)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.compiled_graph = getattr(compiled, "compiled_graph", None)  # type: ignore[attr-defined]
    return run


def _default_compiler(gm: fx.GraphModule, example_inputs: list) -> Callable:
    return compile_fx_inner(gm, example_inputs)


def prefix_graph(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule:
    """The graph's nodes up to ``node`` (all placeholders kept), returning ``node``'s value."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for current in gm.graph.nodes:
        if current.op == "output":
            break
        env[current] = graph.node_copy(current, lambda n: env[n])
        if current is node:
            break
    graph.output((env[node],))
    sub = fx.GraphModule(gm, graph)
    sub.graph.eliminate_dead_code()
    sub.recompile()
    return sub


def _fake_inputs(gm: fx.GraphModule) -> list:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def bisect(gm: fx.GraphModule, inputs: Sequence[Any], patches: dict,
           compile_graph: Optional[Callable], scope: Optional[debug.CompileScope]) -> Mismatch:
    """Find the first node whose compiled value differs from eager's; write its repro."""
    compile_graph = compile_graph or _default_compiler
    candidates = [n for n in gm.graph.nodes
                  if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
    checked: dict[int, Optional[str]] = {}

    def diverges(k: int) -> Optional[str]:
        if k not in checked:
            sub = prefix_graph(gm, candidates[k])
            expected = _call(fx.GraphModule(sub, sub.graph), _clone(inputs))
            with config.patch(**patches):
                compiled = compile_graph(fx.GraphModule(sub, _copy(sub.graph)), _fake_inputs(sub))
                actual = _call(compiled, _clone(inputs))
            checked[k] = difference(actual, expected)
        return checked[k]

    if not candidates:
        return Mismatch(None, "the outputs as a whole", [], None)
    low, high = 0, len(candidates) - 1  # invariant: candidates[high] diverges
    if diverges(high) is None:
        # The last node agrees (its value does not depend on the bad one): scan in order.
        high = next((k for k in range(len(candidates)) if diverges(k) is not None), -1)
        if high < 0:
            return Mismatch(None, "the outputs as a whole", [], None)
    while low < high:
        middle = (low + high) // 2
        if diverges(middle) is not None:
            high = middle
        else:
            low = middle + 1
    node = candidates[high]
    sub = prefix_graph(gm, node)
    path = write_repro(sub, inputs, patches, scope, node.name)
    return Mismatch(node, checked[high] or "", node_source(gm, node), path)


def _copy(graph: fx.Graph) -> fx.Graph:
    import copy

    return copy.deepcopy(graph)


def node_source(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The user's source lines for ``node`` if the graph kept its stack trace, else the line
    of the graph's code that computes it."""
    trace = node.meta.get("stack_trace")
    if trace:
        return [debug.user_frame(trace)]
    lines = [line.strip() for line in gm.code.splitlines() if line.strip().startswith(f"{node.name} = ")]
    return [f"graph code: {line}" for line in lines[:1]]


_REPRO_TEMPLATE = '''\
"""aotforge accuracy repro, written by AOTFORGE_VERIFY: the graph below (up to the first node
whose compiled value differs from eager's) is compiled by aotforge and run eagerly on the saved
inputs. Exit status 1: they still differ; 0: they agree (the bug is fixed).

    python {script}
"""
import os
import sys

if {interpret}:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on the CPU

import torch
from torch import device, inf, nan  # names the graph's code uses

from aotforge.compiler import compile_fx_inner
from aotforge.config import config
from aotforge.verify import difference

PATCHES = {patches!r}


class Repro(torch.nn.Module):
    def __init__(self, constants):
        super().__init__()
        for name, value in constants.items():
            self.register_buffer(name, value)
{code}


def main() -> int:
    saved = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "{inputs_file}"))
    gm = torch.fx.symbolic_trace(Repro(saved["constants"]))
    inputs = saved["inputs"]
    expected = gm(*[x.clone() for x in inputs])
    with config.patch(**PATCHES):
        compiled = compile_fx_inner(gm, [x.clone() for x in inputs])
        args = [x.clone() for x in inputs]
        actual = compiled(args) if getattr(compiled, "_boxed_call", False) else compiled(*args)
    why = difference(list(actual), list(expected))
    if why is None:
        print("aotforge repro: compiled and eager agree")
        return 0
    print(f"aotforge repro: compiled differs from eager at {node}: {{why}}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
'''


def write_repro(sub: fx.GraphModule, inputs: Sequence[Any], patches: dict,
                scope: Optional[debug.CompileScope], node_name: str) -> Optional[str]:
    """Write ``repro.py`` and ``repro_inputs.pt`` for ``sub``; returns the script's path."""
    base = debug.dump_dir()
    if base and scope is not None:
        folder = os.path.join(scope.folder(base), f"verify_{node_name}")
    elif base:
        folder = os.path.join(base, str(os.getpid()), f"verify_{node_name}")
    else:
        folder = tempfile.mkdtemp(prefix="aotforge_verify_")
    os.makedirs(folder, exist_ok=True)
    constants = {}
    for node in sub.graph.find_nodes(op="get_attr"):
        value = getattr(sub, node.target)
        if isinstance(value, torch.Tensor):
            constants[node.target] = value.detach().clone()
    tensors = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    torch.save({"inputs": tensors, "constants": constants}, os.path.join(folder, "repro_inputs.pt"))
    code = textwrap.indent(sub.code.strip("\n"), "    ")
    interpret = bool(patches.get("triton_on_cpu"))
    script = os.path.join(folder, "repro.py")
    with open(script, "w") as handle:
        handle.write(_REPRO_TEMPLATE.format(script=script, interpret=interpret, patches=patches,
                                            code=code, inputs_file="repro_inputs.pt", node=node_name))
    print(f"aotforge verify: repro script written to {script}", file=sys.stderr)
    return script
