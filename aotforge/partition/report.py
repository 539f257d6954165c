"""The partition report: what one graph saves, what its backward recomputes, what it costs.

Printed with ``AOTFORGE_LOG=partition`` (and written to ``AOTFORGE_DUMP_DIR``); usable from
``aotforge.explain`` through ``explain_partition``. Example (the MLP of the tests)::

    saved for backward: 9 tensors, 13,056 bytes (default partition: 18,432 bytes, -29.2%)
      of which activations (not parameters/buffers): 4,096 bytes
      name       shape     dtype    bytes  kind
      primals_1  (32, 16)  float64  4,096  parameter
      ...
      primals_9  (8, 16)   float64  1,024  input
      addmm      (8, 32)   float64  2,048  activation
      addmm_1    (8, 16)   float64  1,024  activation
    recomputed in backward: 7 ops: t (aten.t), gelu (aten.gelu), native_layer_norm ...
    estimated backward peak: 21,376 bytes
    activation memory budget: 1.0

The summary is plain data (names, shapes, bytes), kept on ``fw_module.meta['partition']``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from . import op_costs


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str  # parameter (static-lifetime input), input, view or activation


@dataclasses.dataclass
class PartitionSummary:
    """What a partition decided: saved tensors, saved SymInts, recomputed ops, the budget."""

    saved: list[SavedTensor]
    saved_symints: list[str]
    recomputed: list[tuple[str, str]]  # (node name, op name)
    budget: float
    backward_peak_bytes: int = 0  # estimate, freeing each value after its last use

    @property
    def saved_bytes(self) -> int:
        return sum(t.nbytes for t in self.saved)

    @property
    def activation_bytes(self) -> int:
        """Saved bytes, not counting parameters/buffers (which stay alive anyway)."""
        return sum(t.nbytes for t in self.saved if t.kind != "parameter")


def summarize(
    saved: list[fx.Node],
    saved_symints: list[fx.Node],
    recomputed: list[fx.Node],
    budget: float,
    static_inputs: set[fx.Node],
    backward_peak_bytes: int = 0,
) -> PartitionSummary:
    return PartitionSummary(
        saved=[_describe(n, static_inputs) for n in saved],
        saved_symints=[n.name for n in saved_symints],
        recomputed=[(n.name, _op_name(n)) for n in recomputed],
        budget=budget,
        backward_peak_bytes=backward_peak_bytes,
    )


def _describe(node: fx.Node, static_inputs: set) -> SavedTensor:
    value = node.meta.get("val")
    is_tensor = isinstance(value, torch.Tensor)
    if node in static_inputs:
        kind = "parameter"
    elif node.op == "placeholder":
        kind = "input"
    elif op_costs.is_view(node):
        kind = "view"
    else:
        kind = "activation"
    return SavedTensor(
        name=node.name,
        shape=tuple(op_costs.hint(s) for s in value.shape) if is_tensor else (),
        dtype=str(value.dtype).replace("torch.", "") if is_tensor else "-",
        nbytes=op_costs.node_bytes(node),
        kind=kind,
    )


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        namespace = getattr(packet, "_qualified_op_name", "aten::").split("::")[0]
        return f"{namespace}.{packet.__name__}"
    return getattr(node.target, "__name__", str(node.target))


def format_report(summary: PartitionSummary, default_bytes: int | None = None) -> str:
    """Readable text for a ``PartitionSummary``; ``default_bytes`` adds the comparison."""
    headline = f"saved for backward: {len(summary.saved)} tensors, {summary.saved_bytes:,} bytes"
    if default_bytes is not None:
        change = (summary.saved_bytes - default_bytes) / default_bytes * 100 if default_bytes else 0.0
        headline += f" (default partition: {default_bytes:,} bytes, {change:+.1f}%)"
    lines = [
        headline,
        f"  of which activations (not parameters/buffers): {summary.activation_bytes:,} bytes",
    ]
    header = ("name", "shape", "dtype", "bytes", "kind")
    rows = [header] + [
        (t.name, str(t.shape), t.dtype, f"{t.nbytes:,}", t.kind) for t in summary.saved
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    if summary.saved_symints:
        lines.append("saved symints: " + ", ".join(summary.saved_symints))
    recomputed = ", ".join(f"{name} ({op})" for name, op in summary.recomputed) or "nothing"
    lines.append(f"recomputed in backward: {len(summary.recomputed)} ops: {recomputed}")
    lines.append(f"estimated backward peak: {summary.backward_peak_bytes:,} bytes")
    lines.append(f"activation memory budget: {summary.budget}")
    return "\n".join(lines) + "\n"

