"""Models and joint graphs shared by the partition tests and benchmarks/partition_memory.py.

A joint graph is captured with a partition_fn that records what it is given and then calls
the default partition; both torch's functorch.compile.aot_function and aotforge's own
aot_function accept it, so the partitioners are tested on the joint graphs of either.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from aotforge.partition import default_partition


class MLP(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(F.gelu(self.fc1(x)))
        return self.norm2(F.gelu(self.fc2(x)))


class TransformerBlock(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class DropoutMLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.drop(F.gelu(self.fc1(x)))))


@dataclasses.dataclass
class Case:
    """A model, an input shape, and how big to make them."""

    name: str
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


CASES = {
    "mlp": Case("mlp", MLP, (8, 16)),
    "transformer": Case("transformer", TransformerBlock, (2, 8, 16)),
    "cnn": Case("cnn", SmallCNN, (2, 3, 8, 8)),
    "dropout": Case("dropout", DropoutMLP, (8, 16)),
}


@dataclasses.dataclass
class Joint:
    """A captured joint graph and what a partition_fn was given with it."""

    module: fx.GraphModule
    inputs: list
    num_fwd_outputs: int
    kwargs: dict
    model: nn.Module
    primals: list  # real tensors: parameters and buffers first, then the input
    names: list[str]


def functional_model(model: nn.Module) -> tuple[Callable, list, list[str]]:
    """``fn(*params_and_buffers, x)`` calling ``model``, and its state as flat lists."""
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    names = list(state)

    def fn(*args):
        return torch.func.functional_call(model, dict(zip(names, args[:-1])), (args[-1],))

    return fn, [state[n] for n in names], names


def capture_joint(
    case: Case,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    frontend: str = "torch",
    scale: int = 1,
    seed: int = 0,
    decompositions: dict | None = None,
) -> Joint:
    """Trace ``case`` and capture its joint graph through torch's or aotforge's aot_function
    (``frontend``), after ``decompositions`` if given."""
    torch.manual_seed(seed)
    model = case.make().to(device=device, dtype=dtype)
    fn, state, names = functional_model(model)
    shape = (case.input_shape[0] * scale, *case.input_shape[1:])
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    captured: list = []

    def capture(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured.append((joint, inputs, num_fwd_outputs, kwargs))
        if frontend == "torch":
            from torch._functorch.partitioners import default_partition as torch_default

            return torch_default(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        return default_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs)

    if frontend == "torch":
        from functorch.compile import aot_function, make_boxed_compiler

        compiled = aot_function(
            fn,
            fw_compiler=make_boxed_compiler(lambda gm, _: gm),
            partition_fn=capture,
            num_params_buffers=len(state),
            decompositions=decompositions,
        )
    else:
        import aotforge

        compiled = aotforge.aot_function(
            fn,
            fw_compiler=aotforge.nop,
            partition_fn=capture,
            num_params_buffers=len(state),
            decompositions=decompositions,
        )
    compiled(*state, x)
    joint, inputs, num_fwd_outputs, kwargs = captured[0]
    primals = [t.detach().clone() for t in state] + [x.detach().clone()]
    return Joint(joint, list(inputs), num_fwd_outputs, kwargs, model, primals, names + ["x"])


def num_saved_symints(fw_module: fx.GraphModule, num_fwd_outputs: int) -> int:
    (output,) = fw_module.graph.find_nodes(op="output")
    saved = output.args[0][num_fwd_outputs:]
    return sum(isinstance(n.meta.get("val"), torch.SymInt) for n in saved)


def run_partitioned(
    fw_module: fx.GraphModule,
    bw_module: fx.GraphModule,
    primals: list,
    tangents: list,
    num_fwd_outputs: int,
) -> tuple[list, list]:
    """Run a (forward, backward) pair as the runtime would; returns (outputs, gradients)."""
    fw_out = list(fw_module(*primals))
    outputs, saved = fw_out[:num_fwd_outputs], fw_out[num_fwd_outputs:]
    symints = num_saved_symints(fw_module, num_fwd_outputs)
    tensors = saved[: len(saved) - symints]
    grads = list(bw_module(*saved[len(saved) - symints :], *tensors, *tangents))
    return outputs, grads


def run_joint(joint: fx.GraphModule, primals: list, tangents: list) -> list:
    """Run the joint graph; returns its flat outputs (forward outputs, then gradients)."""
    interpreter = fx.Interpreter(joint, garbage_collect_values=False)
    interpreter.run(*primals, *tangents)
    (output,) = joint.graph.find_nodes(op="output")
    return [interpreter.env[n] if isinstance(n, fx.Node) else n for n in output.args[0]]


def make_tangents(joint: Joint, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    tangents = []
    for node in joint.module.graph.find_nodes(op="placeholder"):
        if node.target.startswith("tangents"):
            value = node.meta["val"]
            tangents.append(
                torch.randn(tuple(value.shape), generator=generator, dtype=value.dtype).to(value.device)
            )
    return tangents


def saved_nodes(fw_module: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    (output,) = fw_module.graph.find_nodes(op="output")
    return [n for n in output.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)]


def saved_bytes(fw_module: fx.GraphModule, num_fwd_outputs: int, exclude=()) -> int:
    from aotforge.partition.op_costs import node_bytes

    return sum(node_bytes(n) for n in saved_nodes(fw_module, num_fwd_outputs) if n.name not in exclude)
