"""Tensor subclasses that flatten themselves to plain tensors (``__tensor_flatten__`` /
``__tensor_unflatten__``: TwoTensor, DTensor, jagged nested tensors, ...).

The metadata is collected on the subclasses themselves (so the epilogue writes back, and
replays views, on the caller's subclass tensors, as eager would), but the graphs only ever
see plain tensors: ``TensorSubclasses`` is the wrapper that flattens them.

``pre_compile`` rewrites the function that gets traced::

    before:  graph_fn(x: TwoTensor(a, b), w)      -> [TwoTensor(c, d)]
    after:   plain_fn(x_a, x_b, w)               -> [c, d]          (rebuilds x inside)

``post_compile`` wraps the compiled graphs, inside the training autograd.Function (autograd
runs above the subclasses, as in eager): the compiled forward flattens the caller's
subclass arguments and rebuilds subclass outputs; the compiled backward coerces each
runtime tangent to the structure that was traced, flattens it, and rebuilds subclass
gradients.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

from . import functional
from .boxing import call_compiled
from .schemas import InputInfo, ViewAndMutationMeta, _to_expr, symbol_bindings


def is_subclass(value: Any) -> bool:
    """A wrapper tensor subclass that can flatten itself to plain tensors."""
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and is_traceable_wrapper_subclass(value)


# ----------------------------------------------------------------------------- checks

def unsupported_input_message(value: torch.Tensor) -> Optional[str]:
    """Why a tensor cannot be traced, or None if it can."""
    if is_subclass(value):
        return None
    if value.layout is not torch.strided:
        return (
            f"aotforge: a tensor with layout {value.layout} was passed to a compiled function; "
            "sparse and other non-strided layouts are not supported (their ops cannot be traced "
            "into functional graphs of plain tensors). Convert it with .to_dense() before the "
            "call, or call the function eagerly."
        )
    if value.is_nested:
        return (
            "aotforge: a nested tensor with layout torch.strided was passed to a compiled "
            "function; only jagged nested tensors (torch.nested.nested_tensor(..., "
            "layout=torch.jagged)) can be traced. Build it with layout=torch.jagged."
        )
    if dispatches_itself(type(value)):
        return (
            f"aotforge: an input is a {type(value).__qualname__}, a tensor subclass with its own "
            "__torch_dispatch__ but without __tensor_flatten__ and __tensor_unflatten__, so "
            "aotforge cannot reach the plain tensors inside it to trace them. Implement those two "
            "methods (as torch.testing._internal.two_tensor.TwoTensor does), or pass the inner "
            "tensor and wrap it inside the function, or call the function eagerly."
        )
    return None


_DISPATCHES_ITSELF: dict[type, bool] = {}


def dispatches_itself(cls: type) -> bool:
    """A tensor subclass that handles its ops in ``__torch_dispatch__`` (a wrapper around
    other tensors, with no storage of its own) and cannot flatten itself. Fake and functional
    tensors are aotforge's own tracing tensors, not the user's. Cached per class: checked on
    every call of a compiled function."""
    found = _DISPATCHES_ITSELF.get(cls)
    if found is None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        dispatch = getattr(cls.__torch_dispatch__, "__func__", cls.__torch_dispatch__)
        default = getattr(torch.Tensor.__torch_dispatch__, "__func__", torch.Tensor.__torch_dispatch__)
        found = _DISPATCHES_ITSELF[cls] = (
            dispatch is not default and not issubclass(cls, (FakeTensor, FunctionalTensor))
            and not hasattr(cls, "__tensor_flatten__")
        )
    return found


def check_supported_inputs(flat_args: Sequence) -> None:
    for value in flat_args:
        if isinstance(value, torch.Tensor):
            message = unsupported_input_message(value)
            if message is not None:
                raise NotImplementedError(message)


def subclass_signature(value: torch.Tensor, dynamic: bool) -> tuple:
    """The cache-key part of a subclass argument: its type, flatten context, and each inner
    tensor's dtype/device/shape/strides; inner tensors passed twice are keyed by position."""
    message = unsupported_input_message(value)
    if message is not None:
        raise NotImplementedError(message)
    seen: dict[int, int] = {}

    def key(tensor) -> tuple:
        if not isinstance(tensor, torch.Tensor):
            return ("constant", tensor)  # an opaque attribute (a DTensor's DeviceMesh)
        if not is_subclass(tensor):
            return (
                type(tensor), tensor.dtype, tensor.device, tensor.requires_grad,
                tensor.dim() if dynamic else tuple(tensor.shape),
                None if dynamic else tensor.stride(),
                None if dynamic else tensor.storage_offset(),
                seen.setdefault(id(tensor), len(seen)),
            )
        names, context = tensor.__tensor_flatten__()
        return (
            type(tensor), context, tuple(names), tensor.requires_grad, tensor.dtype,
            tuple(_static_or_marker(s) for s in tensor.shape) if not dynamic else tensor.dim(),
            *(key(getattr(tensor, name)) for name in names),
        )

    return key(value)


def _static_or_marker(size) -> Any:
    """Nested ints (a jagged dimension) differ per offsets tensor; the inner tensors' shapes
    already key them."""
    return size if isinstance(size, int) else "ragged"


# ----------------------------------------------------------------------------- functionalization

def to_functional(value):
    """``functional.to_functional`` that wraps a subclass's inner tensors (functionalization
    always runs below the subclass), keeping the subclass's autograd metadata."""
    if is_subclass(value):
        wrapped = transform_subclass(value, lambda _, inner: to_functional(inner))
        torch._mirror_autograd_meta_to(value, wrapped)
        return wrapped
    return functional.to_functional(value)


def from_functional(value):
    if is_subclass(value):
        return transform_subclass(value, lambda _, inner: from_functional(inner))
    return functional.from_functional(value)


def inner_leaves(value) -> list:
    """The plain tensors inside a subclass (recursively); [value] for a plain value."""
    if not is_subclass(value):
        return [value] if isinstance(value, torch.Tensor) else []
    names, _ = value.__tensor_flatten__()
    return [leaf for name in names for leaf in inner_leaves(getattr(value, name))]


_METADATA_MUTATION_MESSAGE = (
    "aotforge: the function changes the shape or strides of the tensor-subclass input {index} "
    "({kind}) in place (t_(), unsqueeze_(), resize_(), as_strided_(), ...). Metadata "
    "mutations of tensor subclasses are not supported (PyTorch's AOTAutograd rejects them "
    "too up to torch 2.13): aotforge cannot yet keep the subclass's inner tensors consistent "
    "with its outer strides. "
    "Use the out-of-place op (x = x.t()) instead."
)


def subclass_input_info(
    index: int, f_arg: torch.Tensor, arg: torch.Tensor, grad_fn_before, storage_swap_message: str
) -> InputInfo:
    """InputInfo of a subclass input: its data is mutated if any inner tensor is; a metadata
    mutation is an error."""
    leaves = inner_leaves(f_arg)
    if any(torch._functionalize_was_storage_changed(leaf.elem) for leaf in leaves):
        raise NotImplementedError(storage_swap_message)
    changed = (f_arg.shape, f_arg.stride(), f_arg.storage_offset()) != (arg.shape, arg.stride(), arg.storage_offset())
    if changed or any(functional.has_metadata_mutation(leaf, from_functional(leaf)) for leaf in leaves):
        raise RuntimeError(_METADATA_MUTATION_MESSAGE.format(index=index, kind=type(arg).__name__))
    mutated = [leaf for leaf in leaves if functional.has_data_mutation(leaf)]
    mutates_data = bool(mutated)
    under_no_grad = mutates_data and all(functional.mutations_under_no_grad(leaf) for leaf in mutated)
    # The inner tensors are below autograd; whether autograd saw the mutation shows on the
    # subclass itself: a recorded in-place op gives it a new grad_fn.
    hidden = mutates_data and f_arg.grad_fn is grad_fn_before
    return InputInfo(
        is_tensor=True,
        requires_grad=bool(arg.requires_grad),
        requires_grad_after=bool(f_arg.requires_grad),
        mutates_data=mutates_data,
        mutations_under_no_grad=under_no_grad,
        mutations_hidden_from_autograd=hidden,
        # The write-back copies into the subclass, outside the graph.
        mutation_kept_in_graph=False,
    )


# ----------------------------------------------------------------------------- layouts

@dataclasses.dataclass(frozen=True)
class SubclassLayout:
    """How one subclass value is made of plain tensors: its type, flatten context, the
    layout of each inner attribute (None: a plain tensor), and its outer size and stride
    (ints or SymInts as traced).

    ``symbolic`` lists the positions in ``(*size, *stride)`` that were SymInts (not nested
    ints) when traced. Where a subclass is a graph INPUT (argument or tangent), those sizes
    are passed as SymInt graph inputs after its inner tensors, so that the trace can rebuild
    it with sizes it knows (Dynamo gives a subclass's outer sizes symbols of their own)."""

    cls: type
    context: Any
    attributes: tuple  # ((name, Optional[SubclassLayout]), ...)
    size: tuple
    stride: tuple
    requires_grad: bool
    symbolic: tuple = ()

    def num_leaves(self, symints: bool) -> int:
        inner = sum(num_leaves(child, symints) for _, child in self.attributes)
        return inner + (len(self.symbolic) if symints else 0)

    @property
    def is_static(self) -> bool:
        return all(isinstance(s, int) for s in (*self.size, *self.stride)) and all(
            not isinstance(child, SubclassLayout) or child.is_static for _, child in self.attributes
        )

    def describe(self) -> str:
        inner = ", ".join(
            f"{name}={c.describe() if isinstance(c, SubclassLayout) else 'tensor' if c is None else 'constant'}"
            for name, c in self.attributes
        )
        return f"{self.cls.__name__}({inner}; {self.context!r})"


Layout = Optional[SubclassLayout]  # None: one plain value (tensor, SymInt, None, ...)


@dataclasses.dataclass(frozen=True)
class ConstantAttribute:
    """A flattened attribute that is not a tensor (a DTensor's DeviceMesh): a constant of
    the trace, not a graph input; a call must pass an equal one."""

    value: Any


def layout_of(value) -> Layout:
    if not is_subclass(value):
        return None
    names, context = value.__tensor_flatten__()
    size, stride = tuple(value.size()), tuple(value.stride())
    return SubclassLayout(
        type(value),
        context,
        tuple((name, _attribute_layout(getattr(value, name))) for name in names),
        size,
        stride,
        bool(value.requires_grad),
        tuple(
            i for i, s in enumerate((*size, *stride))
            if isinstance(s, torch.SymInt) and not s.node.is_nested_int()
        ),
    )


def _attribute_layout(value):
    return layout_of(value) if isinstance(value, torch.Tensor) else ConstantAttribute(value)


def num_leaves(layout: Layout, symints: bool = False) -> int:
    if isinstance(layout, ConstantAttribute):
        return 0
    return 1 if layout is None else layout.num_leaves(symints)


def flatten(values: Sequence, layouts: Sequence[Layout], *, symints: bool = False) -> list:
    """The plain leaves of ``values``; with ``symints``, each subclass's symbolic outer
    sizes follow its inner tensors."""
    out: list = []
    for value, layout in zip(values, layouts):
        _flatten_one(value, layout, out, symints)
    return out


def _flatten_one(value, layout: Layout, out: list, symints: bool) -> None:
    if layout is None:
        out.append(value)
        return
    if isinstance(layout, ConstantAttribute):
        if value is not layout.value and value != layout.value:
            raise RuntimeError(
                f"aotforge: a tensor subclass was traced holding {layout.value!r} but this call's "
                f"holds {value!r}; the compiled graph is specific to it. Recompile for this call."
            )
        return
    if type(value) is not layout.cls:
        raise RuntimeError(
            f"aotforge: expected a {layout.cls.__name__} here, as traced, but got "
            f"{type(value).__name__}; the compiled graph only handles the structure it was traced with"
        )
    for name, child in layout.attributes:
        _flatten_one(getattr(value, name), child, out, symints)
    if symints and layout.symbolic:
        sizes = (*value.size(), *value.stride())
        out.extend(sizes[i] for i in layout.symbolic)


def rebuild(leaves: Iterator, layouts: Sequence[Layout], *, sizes: Callable, tracing: bool, symints: bool = False) -> list:
    """The values described by ``layouts``, made from the plain ``leaves`` in order.
    ``sizes(layout)`` gives the outer (size, stride) to rebuild with, unless ``symints``
    (the symbolic sizes are then among the leaves).

    ``tracing``: the leaves are the trace's functional wrappers of its placeholders. The
    subclass is rebuilt from the placeholders themselves and functionalized as a whole, as
    the caller's subclass was when the metadata was collected (a jagged tensor reads its
    ragged size from fake offsets, not from a functional wrapper of them)."""
    values = []
    for layout in layouts:
        if layout is None:
            values.append(next(leaves))
            continue
        value = _rebuild_one(leaves, layout, sizes, tracing, symints)
        if tracing:
            value = to_functional(value)
            if layout.requires_grad:
                # autograd.grad differentiates with respect to the rebuilt subclass, as
                # eager differentiated with respect to the caller's.
                value.requires_grad_(True)
        values.append(value)
    return values


def _rebuild_one(leaves: Iterator, layout: Layout, sizes: Callable, tracing: bool, symints: bool):
    if isinstance(layout, ConstantAttribute):
        return layout.value
    if layout is None:
        leaf = next(leaves)
        if tracing and isinstance(leaf, functional.FunctionalTensor):
            leaf = torch._from_functional_tensor(leaf.elem)
        return leaf
    inner = {name: _rebuild_one(leaves, child, sizes, tracing, symints) for name, child in layout.attributes}
    if symints:
        outer = list((*layout.size, *layout.stride))
        for position in layout.symbolic:
            outer[position] = next(leaves)
        size, stride = tuple(outer[: len(layout.size)]), tuple(outer[len(layout.size) :])
    else:
        size, stride = sizes(layout)
    return layout.cls.__tensor_unflatten__(inner, layout.context, size, stride)


def traced_sizes(layout: SubclassLayout) -> tuple:
    return layout.size, layout.stride


def runtime_sizes(bindings: Callable[[], dict]) -> Callable:
    """Outer sizes for this call: ints as traced; symbolic sizes evaluated from the size
    symbols' values in this call; None if some cannot be (a nested int, whose subclass
    derives it from its inner tensors at runtime)."""

    def sizes(layout: SubclassLayout) -> tuple:
        if all(isinstance(s, int) for s in (*layout.size, *layout.stride)):
            return layout.size, layout.stride
        values = bindings()
        return _evaluate_all(layout.size, values), _evaluate_all(layout.stride, values)

    return sizes


def _evaluate_all(sizes: tuple, bindings: dict) -> Optional[tuple]:
    result = []
    for size in sizes:
        if isinstance(size, int):
            result.append(size)
            continue
        if size.node.is_nested_int():
            return None
        expr = _to_expr(size)
        if isinstance(expr, int):
            result.append(expr)
            continue
        if not expr.free_symbols <= set(bindings):
            return None
        result.append(int(expr.xreplace(bindings)))
    return tuple(result)


# ----------------------------------------------------------------------------- tangents

def coerce_traced_tangent(tangent):
    """The tangent the backward is traced with: a subclass in its "normal" metadata
    (``__coerce_tangent_metadata__``, e.g. a DTensor's Partial placement made Replicate),
    with contiguous inner tensors."""
    if not is_subclass(tangent):
        return tangent
    if hasattr(tangent, "__coerce_tangent_metadata__"):
        tangent = tangent.__coerce_tangent_metadata__()
    return transform_subclass(tangent, lambda _, inner: _contiguous(coerce_traced_tangent(inner)))


def _contiguous(tensor):
    if not isinstance(tensor, torch.Tensor) or is_subclass(tensor) or tensor.is_contiguous():
        return tensor
    return tensor.contiguous()


def coerce_runtime_tangent(tangent, layout: Layout, position: int):
    """A runtime tangent in the structure the backward was traced with, or a clear error."""
    if tangent is None or not isinstance(tangent, torch.Tensor) or isinstance(layout, ConstantAttribute):
        return tangent
    expected = torch.Tensor if layout is None else layout.cls
    context = None if layout is None else layout.context
    actual_context = tangent.__tensor_flatten__()[1] if is_subclass(tangent) else None
    actual = type(tangent) if is_subclass(tangent) else torch.Tensor
    if (actual, actual_context) != (expected, context):
        coerce = getattr(tangent, "__coerce_same_metadata_as_tangent__", None)
        coerced = None
        if coerce is not None:
            coerced = coerce(context) if actual is expected else coerce(context, expected)
        if coerced is None:
            raise RuntimeError(
                # PyTorch's first sentences (code that catches it matches on them), then ours
                "\nDuring the backward, we encountered a tensor subclass where we guessed its\n"
                "metadata incorrectly.\n"
                + (f"Expected a {expected.__name__} tangent but got a plain Tensor.\n"
                   if actual is torch.Tensor and expected is not torch.Tensor else "")
                + f"aotforge: the gradient of output {position} is a {actual.__name__} "
                f"(flatten context {actual_context!r}), but the backward was compiled for a "
                f"{expected.__name__} (flatten context {context!r}), the type of the forward "
                f"output, and {actual.__name__} cannot convert itself "
                "(__coerce_same_metadata_as_tangent__). Pass a gradient of the output's type "
                "and layout to backward()."
            )
        tangent = coerced
    if layout is None:
        return tangent if tangent.is_contiguous() else tangent.contiguous()
    names, _ = tangent.__tensor_flatten__()
    if tuple(names) != tuple(name for name, _ in layout.attributes):
        raise RuntimeError(
            f"aotforge: the gradient of output {position} is a {actual.__name__} made of "
            f"{list(names)}, but the backward was compiled for one made of "
            f"{[name for name, _ in layout.attributes]}; pass a gradient with the forward "
            "output's inner structure."
        )
    return transform_subclass(
        tangent,
        lambda name, inner: coerce_runtime_tangent(inner, dict(layout.attributes)[name], position),
    )


# ----------------------------------------------------------------------------- the wrapper

class TensorSubclasses:
    """The subclass wrapper: graphs over plain tensors, subclasses outside them.

    Built from the (subclass-level) fake arguments and graph outputs of one compile; the
    joint half also records the layouts of the tangents and gradients it traced.
    """

    def __init__(self, fake_args: Sequence, graph_output_fakes: Sequence):
        self.input_layouts = [layout_of(a) for a in fake_args]
        self.output_layouts = [layout_of(o) for o in graph_output_fakes]
        self.tangent_layouts: list[Layout] = []
        self.grad_layouts: list[Layout] = []
        flat = flatten(fake_args, self.input_layouts, symints=True)
        # An inner tensor object passed twice (TwoTensor(x, x), or x and TwoTensor(x, y))
        # is one graph input, as a duplicated plain input is.
        first_index: dict = {}
        self.keep: list[int] = []  # flat positions that become graph inputs
        self.source: list[int] = []  # for each flat position, its graph input
        for position, value in enumerate(flat):
            key = id(value) if isinstance(value, torch.Tensor) else ("position", position)
            if key not in first_index:
                first_index[key] = len(self.keep)
                self.keep.append(position)
            self.source.append(first_index[key])
        self.has_duplicates = len(self.keep) != len(flat)
        self.plain_fake_args = [flat[i] for i in self.keep]
        self.num_plain_outputs = sum(num_leaves(layout) for layout in self.output_layouts)
        self.is_static = all(layout is None or layout.is_static for layout in self.output_layouts)

    @staticmethod
    def needed(fake_args: Sequence, graph_output_fakes: Sequence) -> bool:
        return any(is_subclass(v) for v in (*fake_args, *graph_output_fakes))

    # ------------------------------------------------------------------ pre_compile

    def plain_meta(self, meta: ViewAndMutationMeta) -> ViewAndMutationMeta:
        """``meta`` with one input record per graph input (an inner tensor shares its
        subclass's record), for what reads the graphs' placeholders (the partitioner's
        clones of saved inputs, kept mutations)."""
        infos = []
        for info, layout in zip(meta.input_info, self.input_layouts):
            infos.extend([info] * num_leaves(layout, symints=True))
        infos = [infos[i] for i in self.keep]
        return dataclasses.replace(meta, input_info=infos)

    def plain_indices(self, indices: Sequence[int]) -> list[int]:
        """Graph input indices of the given (subclass-level) input indices."""
        starts, position = [], 0
        for layout in self.input_layouts:
            starts.append(position)
            position += num_leaves(layout, symints=True)
        flat_positions = [
            starts[i] + k for i in indices for k in range(num_leaves(self.input_layouts[i], symints=True))
        ]
        return sorted({self.source[p] for p in flat_positions})

    def _rebuild_args(self, plain_args: Sequence) -> list:
        flat = [plain_args[i] for i in self.source]
        return rebuild(iter(flat), self.input_layouts, sizes=traced_sizes, tracing=True, symints=True)

    def pre_compile(self, graph_fn: Callable) -> Callable:
        """The forward over plain tensors: ``plain_fn(*plain_args) -> plain outputs``."""

        def plain_fn(*plain_args):
            return flatten(graph_fn(*self._rebuild_args(plain_args)), self.output_layouts)

        return plain_fn

    def pre_compile_joint(self, joint: Callable, tangents: Sequence) -> tuple[Callable, list]:
        """The joint over plain tensors, and the plain fake tangents to trace it with.
        ``joint(primals, tangents) -> (*forward outputs, *one gradient per primal)``."""
        tangents = [coerce_traced_tangent(t) for t in tangents]
        self.tangent_layouts = [layout_of(t) for t in tangents]
        num_outputs = len(self.output_layouts)

        def plain_joint(plain_primals, plain_tangents):
            primals = self._rebuild_args(plain_primals)
            subclass_tangents = rebuild(
                iter(plain_tangents), self.tangent_layouts, sizes=traced_sizes, tracing=True, symints=True
            )
            results = list(joint(primals, subclass_tangents))
            outputs, grads = results[:num_outputs], results[num_outputs:]
            self.grad_layouts = [layout_of(g) for g in grads]
            return [*flatten(outputs, self.output_layouts), *flatten(grads, self.grad_layouts)]

        # A tangent often shares inner tensors with its output (a jagged tangent's offsets
        # are the input's): each tangent placeholder needs its own fake, or the trace would
        # read the tangent where the forward reads the input.
        self.tangent_leaf_fakes = [flatten([t], [layout], symints=True) for t, layout in zip(tangents, self.tangent_layouts)]
        seen = {id(a) for a in self.plain_fake_args}
        plain_tangents = []
        for leaf in flatten(tangents, self.tangent_layouts, symints=True):
            if isinstance(leaf, torch.Tensor):
                if id(leaf) in seen:
                    leaf = leaf.clone()
                seen.add(id(leaf))
            plain_tangents.append(leaf)
        return plain_joint, plain_tangents

    # ------------------------------------------------------------------ post_compile

    def _plain_runtime_args(self, args: Sequence) -> list:
        flat = flatten(args, self.input_layouts, symints=True)
        if not self.has_duplicates:
            return flat
        for position, key in enumerate(self.source):
            if flat[position] is not flat[self.keep[key]]:
                raise RuntimeError(
                    "aotforge: a tensor subclass argument was traced holding the same inner "
                    "tensor twice (or one also passed on its own), but this call's do not; "
                    "the compiled graph would read the wrong tensor. Recompile for this call."
                )
        return [flat[i] for i in self.keep]

    def _sizes(self, plain_args: Sequence, plain_outputs: Sequence, output_fakes: Sequence) -> Callable:
        if self.is_static:
            return runtime_sizes(dict)
        cache: list = []

        def bindings() -> dict:
            if not cache:
                values = _int_bindings(self.plain_fake_args, plain_args)
                values.update(_int_bindings(output_fakes, plain_outputs))
                cache.append(values)
            return cache[0]

        return runtime_sizes(bindings)

    def post_compile(self, compiled: Callable, output_fakes: Sequence = ()) -> Callable:
        """The compiled forward (or inference) graph, called with the caller's subclass
        arguments: returns the rebuilt user-level outputs, then the saved activations."""
        num_plain = self.num_plain_outputs
        layouts = self.output_layouts

        def forward(args: list) -> list:
            plain_args = self._plain_runtime_args(args)
            args.clear()
            results = call_compiled(compiled, list(plain_args))
            plain_outputs = results[:num_plain]
            sizes = self._sizes(plain_args, plain_outputs, output_fakes)
            outputs = _checked_rebuild(plain_outputs, layouts, sizes)
            return [*outputs, *results[num_plain:]]

        forward._boxed_call = True  # type: ignore[attr-defined]
        return forward

    def _materialized_zeros(self, tangent, position: int):
        """Autograd hands an unused output of the compiled autograd.Function a plain zero
        tensor, whatever the output's type: rebuild it as a zero subclass tangent. A plain
        tangent that is not all zeros is left for ``coerce_runtime_tangent`` to reject."""
        layout = self.tangent_layouts[position]
        if layout is None or not isinstance(tangent, torch.Tensor) or is_subclass(tangent) or bool(tangent.any()):
            return tangent
        leaves = self.tangent_leaf_fakes[position]
        if not all(isinstance(s, int) for leaf in leaves if isinstance(leaf, torch.Tensor) for s in leaf.shape):
            raise RuntimeError(_zero_tangent_message(position, layout))
        zeros = [
            torch.zeros(tuple(leaf.shape), dtype=leaf.dtype, device=tangent.device) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        return rebuild(iter(zeros), [layout], sizes=traced_sizes, tracing=False, symints=True)[0]

    def post_compile_backward(self, compiled: Callable) -> Callable:
        """The compiled backward: ``[*saved, *subclass tangents] -> subclass gradients``."""
        num_tangents = len(self.tangent_layouts)
        tangent_layouts = self.tangent_layouts
        grad_layouts = self.grad_layouts

        def backward(args: list) -> list:
            split = len(args) - num_tangents
            saved, tangents = args[:split], args[split:]
            args.clear()
            tangents = [
                coerce_runtime_tangent(self._materialized_zeros(t, position), layout, position)
                for position, (t, layout) in enumerate(zip(tangents, tangent_layouts))
            ]
            grads = call_compiled(compiled, [*saved, *flatten(tangents, tangent_layouts, symints=True)])
            return _checked_rebuild(grads, grad_layouts, runtime_sizes(dict))

        backward._boxed_call = True  # type: ignore[attr-defined]
        return backward


def _zero_tangent_message(position: int, layout: SubclassLayout) -> str:
    return (
        f"aotforge: output {position} (a {layout.cls.__name__}) did not take part in the "
        "loss, and autograd handed the backward a plain zero tensor for it; aotforge can only "
        "rebuild a zero gradient of a subclass whose inner tensors have static shapes. Use "
        "every subclass output in the loss (or detach the ones you do not), or pass its "
        "gradient explicitly."
    )


def _int_bindings(fakes: Sequence, reals: Sequence) -> dict:
    """``symbol_bindings`` for the graphs' plain inputs, skipping values that are not ints
    at runtime (Dynamo passes a jagged tensor's ragged size as a nested int)."""
    pairs = [
        (fake, real) for fake, real in zip(fakes, reals)
        if isinstance(fake, torch.Tensor) or (isinstance(fake, torch.SymInt) and isinstance(real, int))
    ]
    return symbol_bindings([f for f, _ in pairs], [r for _, r in pairs])


def _checked_rebuild(plain: Sequence, layouts: Sequence[Layout], sizes: Callable) -> list:
    """``rebuild`` at runtime, with an error naming the subclass if it refuses its pieces."""
    try:
        return rebuild(iter(plain), layouts, sizes=sizes, tracing=False)
    except Exception as error:
        kinds = sorted({layout.cls.__name__ for layout in layouts if layout is not None})
        raise RuntimeError(
            f"aotforge: could not rebuild the tensor subclass outputs ({', '.join(kinds)}) from "
            f"the compiled graph's plain outputs: {type(error).__name__}: {error}"
        ) from error
