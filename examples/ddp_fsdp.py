"""Train a small transformer under DDP, FSDP2 and tensor parallelism, eagerly and compiled by
aotforge, and print the losses of both side by side with their step times.

    torchrun --nproc-per-node 2 examples/ddp_fsdp.py                     # every mode
    torchrun --nproc-per-node 2 examples/ddp_fsdp.py --mode tp --steps 20
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 examples/ddp_fsdp.py --dim 512 --layers 8

On GPUs the ranks talk through NCCL (keep NVLink multicast off: ``NCCL_NVLS_ENABLE=0``), on
the CPU through gloo. Every mode is PyTorch's own engine; aotforge only compiles the graphs:

- ``ddp``: ``DistributedDataParallel``; ``torch.compile`` splits the graph at DDP's gradient
  buckets, so early buckets are all-reduced while the rest of the backward runs.
- ``fsdp2``: ``fully_shard`` on each block and on the root, each block compiled.
- ``tp``: attention and MLP split across ranks (``ColwiseParallel`` in, ``RowwiseParallel``
  out), norms and the residual stream sharded along the sequence (``SequenceParallel``); the
  DTensor collectives are traced into aotforge's graphs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MODES = ("ddp", "fsdp2", "tp")


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
        self.checkpointed = checkpointed  # recompute the block in the backward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Transformer(nn.Module):
    """A GPT-style decoder whose attention and MLP split cleanly across ranks (separate q, k
    and v projections; no tied weights)."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, dropout: float = 0.0,
                 checkpointed: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, checkpointed) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan(layers: int) -> dict:
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
    for index in range(layers):
        block = f"blocks.{index}."
        for norm, part in (("attention_norm", "attention"), ("mlp_norm", "mlp")):
            plan[block + norm] = SequenceParallel()
            plan[block + part] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("attention.q", "attention.k", "attention.v", "mlp.up"):
            plan[block + name] = ColwiseParallel()
        for name in ("attention.out", "mlp.down"):
            plan[block + name] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def parallelize(model: nn.Module, mode: str, backend: str, device: torch.device,
                mp_policy: Any = None) -> tuple[nn.Module, Callable]:
    """``model`` under ``mode`` and the callable one step calls: the model itself (eager) or
    its compiled form. ``backend`` is ``"eager"`` or a torch.compile backend."""
    compiled = backend != "eager"
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model, torch.compile(model, backend=backend) if compiled else model
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = mp_policy or MixedPrecisionPolicy()
        for block in model.blocks:
            if compiled:
                block.compile(backend=backend)  # each block before it is sharded (torchtitan's way)
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, model
    if mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = parallelize_module(model, mesh, tensor_parallel_plan(len(model.blocks)))
        return model, torch.compile(model, backend=backend) if compiled else model
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model: nn.Module, step_fn: Callable, batches: list, device: torch.device, lr: float = 0.1) -> tuple:
    """Plain SGD with momentum; returns the loss and the seconds of every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, seconds = [], []
    for step, (tokens, targets) in enumerate(batches):
        torch.manual_seed(100 + step)  # dropout masks, the same in every run
        synchronize(device)
        started = time.perf_counter()
        logits = step_fn(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    return losses, seconds


def make_batches(args: argparse.Namespace, mode: str, device: torch.device) -> list:
    # data parallel ranks read different data; tensor-parallel ranks share theirs
    seed = 1 if mode == "tp" else 1 + dist.get_rank()
    generator = torch.Generator().manual_seed(seed)
    shape = (args.batch, args.seq)
    return [tuple(torch.randint(0, args.vocab, shape, generator=generator).to(device) for _ in range(2))
            for _ in range(args.steps)]


def run(args: argparse.Namespace, mode: str, backend: str, device: torch.device) -> tuple:
    torch._dynamo.reset()
    torch.manual_seed(0)  # every rank and every run start from the same weights
    model = Transformer(args.vocab, args.dim, args.heads, args.layers).to(device)
    model, step_fn = parallelize(model, mode, backend, device)
    return train(model, step_fn, make_batches(args, mode, device), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES + ("all",), default="all")
    parser.add_argument("--backend", default="aotforge", help="the torch.compile backend to compare with eager")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    # FSDP2 warns that the root module returns a view (the LM head's reshaped matmul); this
    # script does nothing in place with it
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc-per-node 2 examples/ddp_fsdp.py")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for mode in MODES if args.mode == "all" else (args.mode,):
            (eager_losses, eager_seconds), (losses, seconds) = (run(args, mode, b, device) for b in ("eager", args.backend))
            if rank != 0:
                continue
            print(f"\n== {mode} on {dist.get_world_size()} ranks ({device.type}, {dist.get_backend()}) ==")
            print(f"{'step':>4}  {'eager loss':>11}  {args.backend + ' loss':>14}  {'eager s':>8}  {args.backend + ' s':>11}")
            for step, row in enumerate(zip(eager_losses, losses, eager_seconds, seconds)):
                print(f"{step:>4}  {row[0]:>11.5f}  {row[1]:>14.5f}  {row[2]:>8.4f}  {row[3]:>11.4f}")
            # the first steps compile (and warm up); the median of the rest is the step time
            steady = slice(2, None) if args.steps > 3 else slice(0, None)
            print(f"median step after warm-up: eager {statistics.median(eager_seconds[steady]) * 1e3:.1f} ms, "
                  f"{args.backend} {statistics.median(seconds[steady]) * 1e3:.1f} ms; "
                  f"largest loss difference {max(abs(a - b) for a, b in zip(eager_losses, losses)):.2e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
