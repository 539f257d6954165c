"""The lowering stage: ``lower(gm) -> LoweredGraph``, an FX graph of ATen ops in loop IR.

Each node goes through its lowering in ``LOWERINGS``; a node without one, or whose lowering
declines (``NotLowerable``), becomes an ``ExternCall`` to the ATen op itself, so compilation
never fails for a missing lowering. A lowering that declines leaves nothing behind: the
buffers it emitted and the values it realized are undone. The result is a list of
*operations* in program order (``ComputedBuffer``s and ``ExternCall``s) plus the graph's
inputs and outputs.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from ... import debug
from .. import ir
from ..ir import (ComputedBuffer, ExternBuffer, ExternCall, InputBuffer, Layout, Pointwise,
                  PointwiseBody, ReductionBody, StorageView, Value)
from ..dtypes import KERNEL_DTYPES
from ..host_scalars import HOST_SCALAR_TO_DEVICE
from ..ops import ReadRecorder, use_handler
from ..sizes import STATIC, SizeVars, to_expr
from ... import eager_rounding as rounding_table
from .registry import LOWERINGS, LoweringContext, NotLowerable

# A value used by several consumers is recomputed in each (fusing it) when it is this cheap;
# above it is computed once into a buffer. Recomputing keeps memory traffic low; the limits
# keep an expensive value from being computed many times.
REALIZE_OP_THRESHOLD = 24
# reads of tensors as large as the value itself (broadcast weights are nearly free to reread)
REALIZE_READ_THRESHOLD = 2
# Extern ops whose computed operands are written in the strides eager gives them (instead of
# contiguous): convolutions, whose library picks its kernels by the operands' memory format,
# pooling, whose CPU kernels are 5-14x faster over NHWC (passes/library_calls.py chooses it), and
# BatchNorm: a gradient written NCHW for an NHWC graph took a transposing kernel (8.6 ms for the
# conv net's 32 x 32 x 32 x 32 ReLU gradient, against 0.8 ms in memory order) and ATen's
# backward over mixed layouts.
KEEPS_EAGER_LAYOUT = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
                                torch.ops.aten.max_pool2d_with_indices.default,
                                torch.ops.aten.max_pool2d_with_indices_backward.default,
                                torch.ops.aten.native_batch_norm_backward.default,
                                torch.ops.aten._native_batch_norm_legit_functional.default,
                                torch.ops.aten._native_batch_norm_legit.default,
                                torch.ops.aten._native_batch_norm_legit_no_training.default})
# Extern ops that read a matrix operand in either memory order at no cost (cuBLAS transposes)
MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                     torch.ops.aten.baddbmm.default})


def lower(gm: fx.GraphModule, sizes: SizeVars = STATIC, *, eager_rounding: bool = False) -> ir.LoweredGraph:
    """The lowering stage: every node of ``gm`` in loop IR or as an ATen call. ``sizes`` says
    what the graph's symbolic sizes are (see sizes.py). ``eager_rounding``: ops whose eager
    kernel rounds its own way (aotforge/eager_rounding.py) run as ATen calls."""
    return GraphLowering(gm, sizes, eager_rounding=eager_rounding).run().result()


class GraphLowering:
    def __init__(self, gm: fx.GraphModule, sizes: SizeVars = STATIC, *, eager_rounding: bool = False):
        self.gm = gm
        self.sizes = sizes
        self.eager_rounding = eager_rounding
        self.operations: list[Any] = []  # ComputedBuffer | ExternCall, in program order
        self.inputs: list[Optional[InputBuffer]] = []
        self.input_names: set[str] = set()
        self.outputs: list[Any] = []  # StorageView | python value, per graph output
        self.values: dict[fx.Node, Any] = {}
        self.constants: dict[str, torch.Tensor] = {}  # get_attr tensors, by buffer name
        self.constant_buffers: dict[str, InputBuffer] = {}
        self.lowered_ops: dict[str, int] = {}
        self.fallback_ops: dict[str, int] = {}
        self.lowering_errors: list[str] = []
        self._buffer_names = ir.counter("buf")
        self._extern_names = ir.counter("extern")
        self._realized: list[Value] = []  # values given a buffer, in order (undone on decline)
        # The device generated kernels run on: a graph with any CUDA tensor gets GPU kernels, so
        # its CPU work (a step counter's update) runs as ATen calls and its CPU scalars (0-d
        # tensors, read by eager as numbers) are put on the GPU once per call for the kernels.
        self.kernel_device = _kernel_device(gm)
        self._on_device: dict[fx.Node, StorageView] = {}  # host scalar -> its copy on the GPU

    # --- building blocks used by lowerings ------------------------------------------------

    def new_buffer_name(self) -> str:
        return self._buffer_names()

    def realize(self, value: Value, stride_hint: Optional[list] = None) -> StorageView:
        """Give ``value`` a buffer of its own (computed by a kernel) and return a view of it."""
        if isinstance(value, StorageView):
            return value
        if getattr(value, "realized", None) is not None:  # one buffer per value, however often asked
            return value.realized
        value.realized = self._realize(value, stride_hint)
        self._realized.append(value)
        return value.realized

    def _realize(self, value: Value, stride_hint: Optional[list]) -> StorageView:
        view_of = getattr(value, "view_of", None)
        if view_of is not None:  # realize the viewed value, keep the view a view
            base, reapply = view_of
            viewed = reapply(self.realize(base))
            if isinstance(viewed, StorageView):
                return viewed
        size = value.size
        if stride_hint is not None and ir.is_non_overlapping_dense(size, stride_hint, self.sizes.hint):
            order = sorted(range(len(size)), key=lambda d: (-self.sizes.hint(stride_hint[d]), d))
            moved = [d for d in order if size[d] != 1]
            if moved != sorted(moved) and all(getattr(n, "is_Integer", False) for n in size):
                return self._realize_permuted(value, order)
            stride = ir.dense_strides_like(size, stride_hint, self.sizes.hint)
        else:
            stride = ir.contiguous_strides(size)
        buffer = ComputedBuffer(self.new_buffer_name(), Layout(list(size), stride), value.dtype, value.device,
                                PointwiseBody.capture(size, value.make_loader()))
        buffer.origins = getattr(value, "origins", ())
        self.operations.append(buffer)
        return buffer.view()

    def _realize_permuted(self, value: Value, order: list) -> StorageView:
        """``value`` stored with its dimensions in ``order`` (outermost first; a channels-last
        result: N, H, W, C): the buffer is contiguous in that order, so its kernel walks memory
        in order and its loads and stores coalesce; the returned view has the logical order."""
        size, loader = value.size, value.make_loader()
        permuted = [size[d] for d in order]
        position = {d: i for i, d in enumerate(order)}

        def body(index):
            return loader([index[position[d]] for d in range(len(size))])
        buffer = ComputedBuffer(self.new_buffer_name(), Layout(permuted, ir.contiguous_strides(permuted)),
                                value.dtype, value.device, PointwiseBody.capture(permuted, body))
        buffer.origins = getattr(value, "origins", ())
        self.operations.append(buffer)
        strides = buffer.layout.stride
        return StorageView(buffer, list(size), [strides[position[d]] for d in range(len(size))])

    def add_reduction(self, ranges, reduction_ranges, reduction_type, fn, source_dtype, out_dtype, device) -> StorageView:
        buffer = ComputedBuffer(self.new_buffer_name(), Layout(list(ranges), ir.contiguous_strides(ranges)),
                                out_dtype, device,
                                ReductionBody.capture(ranges, reduction_ranges, reduction_type, fn, source_dtype))
        self.operations.append(buffer)
        return buffer.view()

    def add_mutation(self, destination: StorageView, value: Value) -> None:
        layout = Layout(list(destination.size), list(destination.stride), destination.offset)
        buffer = ComputedBuffer(destination.buffer.name, layout, destination.dtype, destination.device,
                                PointwiseBody.capture(destination.size, value.make_loader()),
                                mutates=destination.buffer)
        self.operations.append(buffer)

    # --- the walk -------------------------------------------------------------------------

    def run(self) -> "GraphLowering":
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.values[node] = self._placeholder(node)
            elif node.op == "call_function":
                self.values[node] = self._call_function(node)
            elif node.op == "get_attr":
                self.values[node] = self._constant(node)
            elif node.op == "output":
                self._output(node)
            else:
                raise NotImplementedError(f"aotforge cannot lower FX node kind {node.op!r} ({node})")
        return self

    def _placeholder(self, node: fx.Node) -> Any:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            self.inputs.append(None)
            return to_expr(val) if isinstance(val, torch.SymInt) else val
        buffer = InputBuffer(node.name, Layout(list(ir.sympify_size(val.shape)), list(ir.sympify_size(val.stride()))),
                             val.dtype, val.device)
        buffer.storage_offset = to_expr(val.storage_offset())
        self.inputs.append(buffer)
        self.input_names.add(buffer.name)
        return buffer.view()

    def _constant(self, node: fx.Node) -> Any:
        value = getattr(self.gm, node.target)
        if not isinstance(value, torch.Tensor):
            return value
        name = "constant_" + "".join(c if c.isalnum() else "_" for c in node.target)
        buffer = InputBuffer(name, Layout(list(ir.sympify_size(value.shape)), list(ir.sympify_size(value.stride()))),
                             value.dtype, value.device)
        buffer.storage_offset = int(value.storage_offset())
        self.constants[name] = value
        self.constant_buffers[name] = buffer
        return buffer.view()

    def _call_function(self, node: fx.Node) -> Any:
        if isinstance(node.meta.get("val"), torch.SymInt):
            # size arithmetic (``sym_size(x, 0) * 32``): its expression, evaluated where used
            return to_expr(node.meta["val"])
        if node.target is operator.getitem:
            container = self.values[node.args[0]]
            return container[node.args[1]]
        lowering = LOWERINGS.get(node.target) if _kernel_dtypes_only(node) and self._on_kernel_device(node) else None
        if lowering is not None and self.eager_rounding and rounding_table.eager_rounding(node.target, node):
            lowering = None  # eager's kernel rounds its own way: its bits, as an ATen call
        value_of = self._value_of if lowering is None else self._kernel_operand
        # a SymInt read as a number would add a guard: lowerings see its expression
        args, kwargs = _map_values(fx.node.map_arg((node.args, node.kwargs), value_of),
                                   lambda a: to_expr(a) if isinstance(a, torch.SymInt) else a)
        name = _op_name(node.target)
        if lowering is not None:
            emitted, realized = len(self.operations), len(self._realized)
            try:
                result = lowering(LoweringContext(node, self), *args, **kwargs)
                self.lowered_ops[name] = self.lowered_ops.get(name, 0) + 1
                _record_origins(self.operations[emitted:], result, args, kwargs, name)
                return self._maybe_realize(node, result)
            except NotLowerable:
                self._undo(emitted, realized)
            except Exception as error:  # a lowering bug must not fail the compile: use ATen
                self._undo(emitted, realized)
                self.lowering_errors.append(f"{node.format_node()}: {type(error).__name__}: {error}")
                debug.artifact("lowering", f"lowering_error_{node.name}", self.lowering_errors[-1], ".txt")
        self.fallback_ops[name] = self.fallback_ops.get(name, 0) + 1
        return self.extern(node, args, kwargs)

    def _on_kernel_device(self, node: fx.Node) -> bool:
        """Whether ``node``'s tensor results live where the graph's kernels run."""
        if self.kernel_device is None:
            return True
        value = node.meta.get("val")
        leaves = value if isinstance(value, (tuple, list)) else [value]
        return all(leaf.device.type == self.kernel_device for leaf in leaves if isinstance(leaf, torch.Tensor))

    def _kernel_operand(self, node: fx.Node) -> Any:
        """An operand as a GPU kernel reads it: a CPU scalar (``x * torch.tensor(2.0)``, an
        optimizer's step count, a learning rate kept as a tensor) is filled into a GPU scalar
        once per call (``host_scalar_to_device``: a fill with the value as its argument, so a
        CUDA graph can record it), where a kernel would otherwise get a host pointer."""
        value = node.meta.get("val")
        if not (self.kernel_device == "cuda" and isinstance(value, torch.Tensor)
                and value.device.type == "cpu" and value.dim() == 0):
            return self._value_of(node)
        if node not in self._on_device:
            source = self.realize(self._value_of(node))
            call = ExternCall(self._extern_names(), HOST_SCALAR_TO_DEVICE, (source,),
                              {"device": torch.device(self.kernel_device)})
            buffer = ExternBuffer(self.new_buffer_name(), Layout([], []), value.dtype,
                                  torch.device(self.kernel_device), call, None)
            call.outputs.append(buffer)
            self.operations.append(call)
            self._on_device[node] = buffer.view()
        return self._on_device[node]

    def _value_of(self, node: fx.Node) -> Any:
        """A node's value as its users see it: a value that an earlier user gave a buffer (an
        ATen call's operand) is read from that buffer. Recomputing it would read its inputs
        again and keep them alive until this user runs (ResNet: the block's output would keep
        both convolutions' outputs alive until the next block's residual add)."""
        value = self.values[node]
        realized = getattr(value, "realized", None)
        return value if realized is None else realized

    def _undo(self, emitted: int, realized: int) -> None:
        """Forget what a declined lowering emitted: its buffers, and the buffers it gave to
        values it realized (they were never computed)."""
        del self.operations[emitted:]
        for value in self._realized[realized:]:
            value.realized = None
        del self._realized[realized:]

    def result(self) -> ir.LoweredGraph:
        return ir.LoweredGraph(tuple(self.inputs), dict(self.constants), dict(self.constant_buffers),
                               tuple(self.operations), tuple(self.outputs), dict(self.lowered_ops),
                               dict(self.fallback_ops), tuple(self.lowering_errors), self.sizes)

    def _maybe_realize(self, node: fx.Node, result: Any) -> Any:
        if isinstance(result, Pointwise):
            if len(node.users) > 1 and self._expensive(result):
                return self.realize(result, _stride_of(node.meta.get("val")))
        return result

    def _expensive(self, value: Pointwise) -> bool:
        recorder = ReadRecorder()
        with use_handler(recorder):
            value.make_loader()(ir.index_symbols("i", len(value.size)))
        size = self.sizes.hint(ir.product(value.size))
        large = {name for name, _ in recorder.reads if self._numel_of(name) * 2 >= size}
        return recorder.op_count > REALIZE_OP_THRESHOLD or len(large) > REALIZE_READ_THRESHOLD

    def _transposed_read_layout(self, value: Value) -> Optional[list]:
        """Strides for a matmul operand computed from a transposed read (``x.transpose(-1, -2)
        .to(bf16)`` before a bmm: BERT's attention backward): the buffer swaps its last two
        dimensions, as the read does, so that the kernel writing it walks both in memory order
        (a contiguous result read at a stride of a whole row: 0.32 ms where 0.08 ms would do,
        on 50M elements on an H200); the matmul takes either order at no cost. None otherwise."""
        size = value.size
        if (isinstance(value, StorageView) or len(size) < 2 or getattr(value, "view_of", None) is not None
                or not all(getattr(n, "is_Integer", False) for n in size) or 1 in (size[-1], size[-2])):
            return None
        symbols = ir.index_symbols("i", len(size))
        recorder = ReadRecorder()
        with use_handler(recorder):
            value.make_loader()(symbols)
        if recorder.has_indirect or not recorder.reads:
            return None
        _, index = max(recorder.reads, key=lambda read: self._numel_of(read[0]))
        index = sympy.expand(sympy.sympify(index))
        if index.coeff(symbols[-2]) != 1 or index.coeff(symbols[-1]) in (0, 1):
            return None
        order = list(range(len(size) - 2)) + [len(size) - 1, len(size) - 2]  # outermost first
        strides, running = [sympy.Integer(0)] * len(size), sympy.Integer(1)
        for dim in reversed(order):
            strides[dim], running = running, running * size[dim]
        return strides

    def _numel_of(self, name: str) -> int:
        for buffer in self.inputs + list(self.constant_buffers.values()):
            if buffer is not None and buffer.name == name:
                return self.sizes.hint(buffer.layout.storage_numel())
        for op in reversed(self.operations):
            for buffer in (op.outputs if isinstance(op, ExternCall) else [op]):
                if buffer is not None and buffer.name == name:
                    return self.sizes.hint(buffer.layout.storage_numel())
        return 0

    def extern(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """Run ``node.target`` through ATen at runtime; its tensor outputs become buffers."""
        def realize_arg(a):
            if not isinstance(a, Value):
                return a
            return self.realize(a, self._transposed_read_layout(a) if node.target in MATMULS else None)
        if node.target in KEEPS_EAGER_LAYOUT:  # operands in the layout the graph chose for them
            args = tuple(self.realize(a, _stride_of(n.meta.get("val"))) if isinstance(a, Value) and isinstance(n, fx.Node)
                         else a for a, n in zip(args, node.args))
        args = _map_values(args, realize_arg)
        kwargs = _map_values(kwargs, realize_arg)
        val = node.meta.get("val")
        call = ExternCall(self._extern_names(), node.target, args, kwargs,
                          single_output=not isinstance(val, (tuple, list)))
        outputs = [val] if call.single_output else list(val)

        def output(out, index):
            if isinstance(out, (tuple, list)):
                # a nested tuple (run_and_save_rng_state returns (state, op's outputs)): each
                # tensor inside is a buffer read at its path, e.g. extern0[1][0]
                return tuple(output(inner, (*index, position)) for position, inner in enumerate(out))
            if not isinstance(out, torch.Tensor):
                call.outputs.append(None)
                return out
            buffer = ExternBuffer(self.new_buffer_name(),
                                  Layout(list(ir.sympify_size(out.shape)), list(ir.sympify_size(out.stride()))),
                                  out.dtype, out.device, call, index)
            call.outputs.append(buffer)
            return buffer.view()

        if call.single_output:
            results = [output(val, None)]
        else:
            results = [output(out, (position,)) for position, out in enumerate(outputs)]
        self.operations.append(call)
        return results[0] if call.single_output else tuple(results)

    def _output(self, node: fx.Node) -> None:
        flat = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
        for arg in flat:
            value = self.values[arg] if isinstance(arg, fx.Node) else arg
            if isinstance(value, Value):
                value = self.realize(value, _stride_of(arg.meta.get("val")))
            self.outputs.append(value)


def _record_origins(emitted: list, result: Any, args: tuple, kwargs: dict, name: str) -> None:
    """The ATen ops a value or buffer computes, in order (``native_layer_norm``, ``gelu``, ...):
    what a kernel that computes it is named after. A lazy value carries the ops of the lazy
    values it was built from; a read of a stored buffer adds nothing (it is a load)."""
    origins: list = []
    for value in _flatten((args, kwargs)):
        if isinstance(value, Value) and not isinstance(value, StorageView):
            origins += [o for o in getattr(value, "origins", ()) if o not in origins]
    if name not in origins:
        origins.append(name)
    origins = tuple(origins)
    for op in emitted:
        if isinstance(op, ComputedBuffer) and not getattr(op, "origins", ()):
            op.origins = origins
    for value in _flatten(result):
        if isinstance(value, Value) and not isinstance(value, StorageView):
            value.origins = origins


def _flatten(obj: Any) -> list:
    if isinstance(obj, (list, tuple)):
        return [leaf for item in obj for leaf in _flatten(item)]
    if isinstance(obj, dict):
        return [leaf for item in obj.values() for leaf in _flatten(item)]
    return [obj]


def _kernel_device(gm: fx.GraphModule) -> Optional[str]:
    """``"cuda"`` for a graph with a CUDA tensor, else None (every node on one device)."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        for leaf in (value if isinstance(value, (tuple, list)) else [value]):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                return "cuda"
    return None


def _kernel_dtypes_only(node: fx.Node) -> bool:
    """Generated kernels handle real floating, integer and bool dtypes; anything else (complex,
    float8, unsigned wider than 8 bits) runs through ATen."""
    values = [node.meta.get("val")] + [n.meta.get("val") for n in node.all_input_nodes]
    for value in values:
        for leaf in (value if isinstance(value, (tuple, list)) else [value]):
            if isinstance(leaf, torch.Tensor) and leaf.dtype not in KERNEL_DTYPES:
                return False
    return True


def _stride_of(val: Any) -> Optional[list]:
    """The strides eager gives a node's result (expressions; reading them adds no guard)."""
    if isinstance(val, torch.Tensor):
        return ir.sympify_size(val.stride())
    return None


def _map_values(obj: Any, fn) -> Any:
    if isinstance(obj, (list, tuple)):
        mapped = [_map_values(o, fn) for o in obj]
        return type(obj)(mapped) if isinstance(obj, tuple) else mapped
    if isinstance(obj, dict):
        return {k: _map_values(v, fn) for k, v in obj.items()}
    return fn(obj)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))

