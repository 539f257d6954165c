"""The partition report: what one graph saves, what its backward recomputes, what it costs.

Printed with ``AOTFORGE_LOG=partition`` (and written to ``AOTFORGE_DUMP_DIR``); usable from
``aotforge.explain`` through ``explain_partition``. Example::

    saved for backward: 3 tensors, 1,152 bytes (default partition: 1,664 bytes, -30.8%)
      name        shape     dtype    bytes  kind
      primals_1   (4, 8)    float64    256  parameter
      add         (4, 8)    float64    256  activation
      ...
    recomputed in backward: 2 ops: gelu (aten.gelu), mul (aten.mul)
    activation memory budget: 1.0
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import op_costs


def _describe(node: fx.Node, static_inputs: set) -> tuple[str, str, str, int, str]:
    value = node.meta.get("val")
    shape = tuple(op_costs.hint(s) for s in value.shape) if isinstance(value, torch.Tensor) else ()
    dtype = str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else "-"
    if node in static_inputs:
        kind = "parameter"
    elif node.op == "placeholder":
        kind = "input"
    elif op_costs.is_view(node):
        kind = "view"
    else:
        kind = "activation"
    return node.name, str(shape), dtype, op_costs.node_bytes(node), kind


def format_report(summary, default_bytes: int | None = None, title: str = "") -> str:
    """Readable text for a ``PartitionSummary`` (``fw_module.meta['partition']``)."""
    rows = [_describe(n, summary.static_inputs) for n in summary.saved]
    total = summary.saved_bytes
    lines = [title] if title else []
    headline = f"saved for backward: {len(rows)} tensors, {total:,} bytes"
    if default_bytes is not None:
        change = (total - default_bytes) / default_bytes * 100 if default_bytes else 0.0
        headline += f" (default partition: {default_bytes:,} bytes, {change:+.1f}%)"
    lines.append(headline)
    lines.append(
        f"  of which activations (not parameters/buffers): {summary.activation_bytes:,} bytes"
    )
    header = ("name", "shape", "dtype", "bytes", "kind")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        cells = [str(c).ljust(w) if i != 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    if summary.saved_symints:
        lines.append("saved symints: " + ", ".join(n.name for n in summary.saved_symints))
    recomputed = [n for n in summary.recomputed]
    names = ", ".join(f"{n.name} ({_op_name(n)})" for n in recomputed) or "nothing"
    lines.append(f"recomputed in backward: {len(recomputed)} ops: {names}")
    lines.append(f"activation memory budget: {summary.budget}")
    return "\n".join(lines) + "\n"


def _op_name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return f"aten.{packet.__name__}" if "aten" in str(packet) else str(packet)
    return getattr(target, "__name__", str(target))


def explain_partition(
    joint_module: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs
) -> str:
    """Partition ``joint_module`` with min-cut and return the report (for ``aotforge.explain``)."""
    from .mincut import default_saved_bytes, min_cut_rematerialization_partition

    fw_module, _ = min_cut_rematerialization_partition(
        joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
    )
    default_bytes = default_saved_bytes(joint_module, joint_inputs, num_fwd_outputs)
    return format_report(fw_module.meta["partition"], default_bytes)
