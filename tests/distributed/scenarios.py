"""What each rank runs for the distributed tests (see cluster.py): a tiny transformer trained
for a few steps eagerly and through ``torch.compile(backend="aotforge")`` under DDP, FSDP2 and
tensor parallelism, from the same initial weights and data. Each scenario returns, per
training run, the loss of every step and the final full parameters, for the test to compare.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import aotforge
import aotforge.backends
import aotforge.compiler

VOCAB, DIM, HEADS, SEQ, BATCH, BLOCKS = 32, 16, 4, 8, 4, 2
STEPS = 5
DDP_DIM = 128
DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.head_dim, self.dropout = dim // heads, dropout
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[:2]
        # -1 heads: under tensor parallelism each rank holds some of them
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.dropout(y, self.dropout, self.training)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.down(F.gelu(self.up(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0, checkpointed: bool = False):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, heads, dropout)
        self.mlp_norm, self.mlp = nn.LayerNorm(dim), MLP(dim, dropout)
        self.checkpointed = checkpointed

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Transformer(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, blocks: int = BLOCKS,
                 dropout: float = 0.0, checkpointed: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, checkpointed) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(dtype: torch.dtype, **options: Any) -> Transformer:
    torch.manual_seed(0)  # every rank and every run starts from the same weights
    return Transformer(**options).to(dtype)


def make_batches(same_on_every_rank: bool, steps: int = STEPS, micro: int = 1) -> list:
    """Token batches (inputs, targets); different on each rank (data parallel) unless asked."""
    generator = torch.Generator().manual_seed(1 if same_on_every_rank else 1 + dist.get_rank())
    return [[(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
              torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(micro)]
            for _ in range(steps)]


def loss_of(model: Callable, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(model: nn.Module, step_fn: Callable, batches: list, *, no_sync: bool = False) -> list:
    """SGD with momentum; the generator is seeded before each step (dropout masks); with
    ``no_sync`` all micro-batches but the last accumulate gradients without communicating."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step, micro_batches in enumerate(batches):
        torch.manual_seed(100 + step)
        total = 0.0
        for index, (tokens, targets) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            context = model.no_sync() if no_sync and not last else contextlib.nullcontext()
            with context:
                loss = loss_of(step_fn, tokens, targets) / len(micro_batches)
                loss.backward()
            total = total + loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def full_parameters(model: nn.Module) -> dict:
    """Every parameter as a whole (unsharded) plain tensor."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


@contextlib.contextmanager
def compiler_path(path: str):
    """``aten``: CPU graphs run as their ATen calls (the default); ``triton``: the generated
    Triton kernels, in Triton's interpreter."""
    torch._dynamo.reset()
    with aotforge.config.patch(triton_on_cpu=path == "triton"):
        yield


def _run(model: nn.Module, step_fn: Callable, batches: list, **kwargs: Any) -> dict:
    losses = train(model, step_fn, batches, **kwargs)
    return {"losses": torch.stack(losses), "parameters": full_parameters(model)}


class GraphLog:
    """What was compiled during a run: how many graphs Dynamo handed the backend (DDP's
    bucket splits make several), and on the Triton path each compiled graph's kind and the
    collectives it calls (as extern calls, in program order)."""

    def __init__(self) -> None:
        self.dynamo_graphs = 0
        self.compiled: list = []

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        """``backend="aotforge"`` itself, counting the graphs it receives."""
        self.dynamo_graphs += 1
        return aotforge.backends.aotforge_backend(gm, example_inputs, **kwargs)

    @contextlib.contextmanager
    def observing(self):
        with aotforge.compiler.observe() as graphs:
            yield
        for graph in graphs:
            externs = [step.op for step in graph.kernel_plan.steps if not hasattr(step, "nodes")] \
                if graph.kernel_plan is not None else []
            self.compiled.append((graph.kind, [str(op) for op in externs if "c10d" in str(op)]))

    def summary(self) -> dict:
        return {"dynamo_graphs": self.dynamo_graphs, "compiled": self.compiled}


def _run(model: nn.Module, step_fn: Callable, batches: list, log: GraphLog, **kwargs: Any) -> dict:
    with log.observing():
        losses = train(model, step_fn, batches, **kwargs)
    return {"losses": torch.stack(losses), "parameters": full_parameters(model), "graphs": log.summary()}


# --- DDP -----------------------------------------------------------------------------------

def ddp(path: str, dtype: str = "float64", no_sync: bool = False) -> dict:
    """DistributedDataParallel with small buckets (Dynamo splits the graph at bucket
    boundaries, so gradients of early buckets are all-reduced while later ones are computed)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches(same_on_every_rank=False, micro=2 if no_sync else 1)
    results = {}
    for mode in ("eager", "compiled"):
        # Dynamo's graph splits need buckets of at least DDP's first bucket (1 MB): a model of
        # 3 MB in float64 (1.6 MB in float32) makes several
        model = DDP(make_model(DTYPES[dtype], dim=DDP_DIM), bucket_cap_mb=1)
        log = GraphLog()
        with compiler_path(path):
            step_fn = torch.compile(model, backend=log.backend) if mode == "compiled" else model
            results[mode] = _run(model, step_fn, batches, log, no_sync=no_sync)
    return results


# --- FSDP2 ---------------------------------------------------------------------------------

def fsdp(path: str, dtype: str = "float64", compile_each: str = "model", bf16: bool = False,
         reshard_after_forward: bool = True, dropout: float = 0.0, checkpointed: bool = False) -> dict:
    """``fully_shard`` on each block and the root; ``compile_each`` is ``"model"`` (one
    torch.compile around the whole sharded model) or ``"block"`` (each block compiled before
    it is sharded, as torchtitan does)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    batches = make_batches(same_on_every_rank=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    results = {}
    for mode in ("eager", "compiled"):
        log = GraphLog()
        with compiler_path(path):
            model = make_model(DTYPES[dtype], dropout=dropout, checkpointed=checkpointed)
            for block in model.blocks:
                if mode == "compiled" and compile_each == "block":
                    block.compile(backend=log.backend)
                fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            step_fn = model
            if mode == "compiled" and compile_each == "model":
                step_fn = torch.compile(model, backend=log.backend)
            results[mode] = _run(model, step_fn, batches, log)
    return results


# --- tensor parallelism --------------------------------------------------------------------

def tensor_parallel_plan() -> dict:
    """Megatron-style: attention and MLP split by heads / hidden units (column-wise in,
    row-wise out), norms and the residual stream sharded along the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan: dict = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for index in range(BLOCKS):
        prefix = f"blocks.{index}."
        plan.update({
            prefix + "attention_norm": SequenceParallel(),
            prefix + "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            prefix + "attention.q": ColwiseParallel(), prefix + "attention.k": ColwiseParallel(),
            prefix + "attention.v": ColwiseParallel(),
            prefix + "attention.out": RowwiseParallel(output_layouts=Shard(1)),
            prefix + "mlp_norm": SequenceParallel(),
            prefix + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            prefix + "mlp.up": ColwiseParallel(),
            prefix + "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def tensor_parallel(path: str, dtype: str = "float64") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    batches = make_batches(same_on_every_rank=True)
    results = {}
    for mode in ("eager", "compiled"):
        log = GraphLog()
        with compiler_path(path):
            model = parallelize_module(make_model(DTYPES[dtype]), mesh, tensor_parallel_plan())
            step_fn = torch.compile(model, backend=log.backend) if mode == "compiled" else model
            results[mode] = _run(model, step_fn, batches, log)
    return results
