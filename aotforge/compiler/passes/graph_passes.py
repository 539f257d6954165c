"""Generic passes over FX graphs of ATen ops. Each is ``pass(gm) -> gm`` and edits in place."""
from __future__ import annotations

import math

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ... import op_table
from .collectives import sink_waits
from .depthwise import depthwise_weight_gradients
from .fx_edits import run_passes
from .library_calls import channels_last_joint
from .patterns import apply_pattern_rewrites
from .symbolic import is_symbolic, known_true, statically_equal, sym_expr

aten = torch.ops.aten



def _is_pure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable:
            return False
        return not op_table.info(target).distinct  # random draws, fresh uninitialized memory
    return target.__module__ == "_operator"


def dead_code_elimination(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop nodes nobody uses (mutating and random ops stay: FX marks them impure)."""
    gm.graph.eliminate_dead_code()
    return gm


def cse(gm: fx.GraphModule) -> fx.GraphModule:
    """Common subexpression elimination::

        a = mul(x, y); b = mul(x, y); c = add(a, b)   ->   a = mul(x, y); c = add(a, a)
    """
    seen: dict[Any, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not _is_pure(node):
            continue
        try:
            key = (node.target, _hashable(node.args), _hashable(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    return gm


def _hashable(obj: Any) -> Any:
    """A key that equals another only when the values are the same. A SymInt is keyed by its
    expression (hashing or comparing the SymInt itself would ask the ShapeEnv)."""
    if is_symbolic(obj):
        expr = sym_expr(obj)
        if expr is None:
            raise TypeError("a symbolic value without an expression")  # cse keeps the node
        return ("sym", type(obj).__name__, expr)
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__,) + tuple(_hashable(o) for o in obj)
    if isinstance(obj, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in obj.items()))
    if isinstance(obj, float) and obj != obj:
        return ("nan",)
    return obj


def functionalize_inplace(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite in-place ops on intermediates (left by decompositions) to their functional
    form when no view can observe the difference::

        mean = mean(x); add_(mean, eps); r = rsqrt(mean)  ->  add = add(mean, eps); r = rsqrt(add)
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.split("::")[-1]
        if not (target._schema.is_mutable and name.endswith("_") and node.args):
            continue
        mutated = node.args[0]
        if not isinstance(mutated, fx.Node) or mutated.op != "call_function":
            continue
        if op_table.is_view(mutated.target) or any(op_table.is_view(u.target) for u in mutated.users):
            continue
        packet = getattr(aten, name[:-1], None)
        functional = getattr(packet, target._overloadname, None) if packet is not None else None
        if functional is None:
            continue
        node.target = functional
        for user in list(mutated.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(mutated, node)
    return gm


def view_to_reshape(gm: fx.GraphModule) -> fx.GraphModule:
    """``view`` -> ``reshape``: after passes change layouts, a view may no longer be legal on
    its input's strides; a reshape always is (and is a view whenever a view would be)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default
    return gm


def _same_meta(a: Any, b: Any) -> bool:
    """Same dtype, device and shape, the shape compared without guards (symbolic sizes that
    are equal only for some inputs count as different)."""
    va, vb = getattr(a, "meta", {}).get("val"), getattr(b, "meta", {}).get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.device == vb.device and statically_equal(va.shape, vb.shape))


def _identity_scalar(position: int, value: Any) -> Callable[[fx.Node], bool]:
    return lambda node: len(node.args) > position and not isinstance(node.args[position], fx.Node) \
        and statically_equal(node.args[position], value) and statically_equal(node.kwargs.get("alpha", 1), 1)


_ADDS_ZERO = _identity_scalar(1, 0)


def _adds_zero(node: fx.Node) -> bool:
    """``x + 0`` is ``x`` for integers, but not for floats: ``-0.0 + 0 == +0.0``. Adding
    ``-0.0`` is the float identity; subtracting ``+0`` too (``-0.0 - 0 == -0.0``)."""
    if not _ADDS_ZERO(node):
        return False
    dtype = getattr(node.meta.get("val"), "dtype", None)
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return True
    negative_zero = isinstance(node.args[1], float) and math.copysign(1.0, node.args[1]) < 0
    return negative_zero == (node.target in (aten.add.Tensor, aten.add.Scalar))


# op -> predicate saying the node returns its first argument unchanged
NOOPS: dict[Any, Callable[[fx.Node], bool]] = {
    aten.add.Tensor: _adds_zero, aten.add.Scalar: _adds_zero,
    aten.sub.Tensor: _adds_zero, aten.sub.Scalar: _adds_zero,
    aten.mul.Tensor: _identity_scalar(1, 1), aten.mul.Scalar: _identity_scalar(1, 1),
    aten.div.Tensor: _identity_scalar(1, 1), aten.div.Scalar: _identity_scalar(1, 1),
    aten.pow.Tensor_Scalar: _identity_scalar(1, 1),
    aten.clone.default: lambda node: True,
    aten.alias.default: lambda node: True,
    aten._to_copy.default: lambda node: set(node.kwargs) <= {"dtype", "layout", "device", "memory_format"},
    torch.ops.prims.convert_element_type.default: lambda node: True,
    aten.expand.default: lambda node: True, aten.reshape.default: lambda node: True,
    aten.view.default: lambda node: True, aten.permute.default: lambda node: list(node.args[1]) == sorted(node.args[1]),
}


def remove_noops(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ops that return their input unchanged (``x + 0``, ``x * 1``, a ``clone``, a
    cast to the same dtype, a reshape to the same shape) by their input::

        y = add(x, 0); z = mul(y, w)   ->   z = mul(x, w)

    A node is kept when removing it would make a graph output alias an input or another
    output (outputs must stay distinct tensors)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    for node in list(gm.graph.nodes):
        predicate = NOOPS.get(node.target) if node.op == "call_function" else None
        if predicate is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        if not _same_meta(node, source) or not predicate(node):
            continue
        if node in returned and (source.op == "placeholder" or source in returned):
            continue
        source_val, node_val = source.meta["val"], node.meta["val"]
        if not statically_equal(node_val.stride(), source_val.stride()):
            continue  # a later view may depend on the copy's layout
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
    return gm


def constant_fold(gm: fx.GraphModule, max_numel: int = 4096) -> fx.GraphModule:
    """Evaluate parameter-free subgraphs at compile time (``arange(8) * 2`` becomes a stored
    constant). Fills alone are left for the lowering (free to generate); random ops are never
    folded; large results are left so as not to hold their memory."""
    constant: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            constant[node] = getattr(gm, node.target)
            continue
        if not _is_pure(node) or not isinstance(node.target, torch._ops.OpOverload):
            continue
        inputs = node.all_input_nodes
        if not all(i in constant for i in inputs):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: constant[n])
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not known_true(val.numel() <= max_numel):
            continue  # a symbolic (e.g. data-dependent) size is not known to be small
        if any(is_symbolic(a) for a in pytree.tree_leaves((args, kwargs))):
            continue  # running the op on a SymInt would specialize it
        try:
            constant[node] = node.target(*args, **kwargs)
        except Exception:
            continue
    folded = 0
    for node, value in constant.items():
        if node.op == "get_attr" or not node.all_input_nodes:
            continue  # a fill from nothing: the lowering generates it for free
        if all(user in constant for user in node.users):
            continue  # only the last constant of a chain is stored
        name = f"_folded_constant_{folded}"
        folded += 1
        gm.register_buffer(name, value, persistent=False)
        with gm.graph.inserting_before(node):
            replacement = gm.graph.get_attr(name)
        replacement.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(replacement)
    gm.graph.eliminate_dead_code()
    return gm


def remove_identity_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """``nn.Identity()(x)`` -> ``x`` in a torch-level graph."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Identity):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return gm


def remove_unused_lookups(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop unused ``getitem``/``getattr`` results. General dead code elimination is not safe
    on a torch-level graph: ``buffer.add_(1)`` has no users and must stay."""
    import operator

    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in (operator.getitem, getattr) and not node.users:
            gm.graph.erase_node(node)
    return gm


def pre_grad_passes(gm: fx.GraphModule) -> fx.GraphModule:
    """Passes on the torch-level graph Dynamo hands us, before AOT autograd traces it."""
    return run_passes(gm, (remove_identity_modules, remove_unused_lookups))


def joint_graph_passes(gm: fx.GraphModule) -> fx.GraphModule:
    """Passes on the joint forward+backward graph, before it is partitioned."""
    return run_passes(gm, (remove_noops, apply_pattern_rewrites, cse, dead_code_elimination, channels_last_joint,
                           depthwise_weight_gradients))


def post_grad_passes(gm: fx.GraphModule) -> fx.GraphModule:
    """Passes on each graph about to be compiled, in order."""
    return run_passes(gm, (functionalize_inplace, dead_code_elimination, view_to_reshape, remove_noops,
                           apply_pattern_rewrites, constant_fold, cse, dead_code_elimination, sink_waits))
