"""What each rank runs for the distributed tests (see cluster.py): a tiny transformer trained
for a few steps eagerly and through ``torch.compile(backend="aotforge")`` under DDP, FSDP2 and
tensor parallelism, from the same initial weights and data. Each scenario returns, per
training run, the loss of every step and the final full parameters, for the test to compare.
"""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import aotforge
import aotforge.backends
import aotforge.compiler

VOCAB, DIM, HEADS, SEQ, BATCH, BLOCKS = 32, 16, 4, 8, 4, 2
STEPS = 5
DDP_DIM = 128
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _load_example():
    """examples/ddp_fsdp.py, whose model and tensor-parallel plan the tests train."""
    path = Path(__file__).resolve().parents[2] / "examples" / "ddp_fsdp.py"
    spec = importlib.util.spec_from_file_location("aotforge_example_ddp_fsdp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()


def device_of(path: str) -> torch.device:
    """``gpu``: this rank's GPU (nccl); ``aten`` and ``triton``: the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if path == "gpu" else torch.device("cpu")


def make_model(path: str, dtype: torch.dtype, dim: int = DIM, dropout: float = 0.0,
               checkpointed: bool = False) -> nn.Module:
    torch.manual_seed(0)  # every rank and every run starts from the same weights
    return example.Transformer(VOCAB, dim, HEADS, BLOCKS, dropout, checkpointed).to(device_of(path), dtype)


def make_batches(path: str, same_on_every_rank: bool, steps: int = STEPS, micro: int = 1) -> list:
    """Token batches (inputs, targets); different on each rank (data parallel) unless asked."""
    generator = torch.Generator().manual_seed(1 if same_on_every_rank else 1 + dist.get_rank())
    return [[tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device_of(path)) for _ in range(2))
             for _ in range(micro)] for _ in range(steps)]


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

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for name, p in model.named_parameters()}


@contextlib.contextmanager
def compiler_path(path: str):
    """``aten``: CPU graphs run as their ATen calls (the default); ``triton``: the generated
    Triton kernels, in Triton's interpreter; ``gpu``: CUDA graphs (always Triton). Generated
    kernels draw random numbers on eager's generator (``fallback_random``): their philox
    draws would give other dropout masks than eager's."""
    torch._dynamo.reset()
    with aotforge.config.patch(triton_on_cpu=path == "triton", fallback_random=path != "aten"):
        yield


def _run(model: nn.Module, step_fn: Callable, batches: list, **kwargs: Any) -> dict:
    losses = train(model, step_fn, batches, **kwargs)
    return {"losses": torch.stack(losses).cpu(), "parameters": full_parameters(model)}


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
    return {"losses": torch.stack(losses).cpu(), "parameters": full_parameters(model), "graphs": log.summary()}


# --- DDP -----------------------------------------------------------------------------------

def ddp(path: str, dtype: str = "float64", no_sync: bool = False) -> dict:
    """DistributedDataParallel with small buckets (Dynamo splits the graph at bucket
    boundaries, so gradients of early buckets are all-reduced while later ones are computed)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches(path, same_on_every_rank=False, micro=2 if no_sync else 1)
    results = {}
    for mode in ("eager", "compiled"):
        # Dynamo's graph splits need buckets of at least DDP's first bucket (1 MB): a model of
        # 3 MB in float64 (1.6 MB in float32) makes several
        device = device_of(path)
        model = DDP(make_model(path, DTYPES[dtype], dim=DDP_DIM), bucket_cap_mb=1,
                    device_ids=[device.index] if device.type == "cuda" else None)
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

    batches = make_batches(path, same_on_every_rank=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    results = {}
    for mode in ("eager", "compiled"):
        log = GraphLog()
        with compiler_path(path):
            model = make_model(path, DTYPES[dtype], dropout=dropout, checkpointed=checkpointed)
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

def tensor_parallel(path: str, dtype: str = "float64") -> dict:
    """The example's tensor-parallel transformer (see ``example.tensor_parallel_plan``)."""
    batches = make_batches(path, same_on_every_rank=True)
    results = {}
    for mode in ("eager", "compiled"):
        log = GraphLog()
        with compiler_path(path):
            backend = log.backend if mode == "compiled" else "eager"
            model, step_fn = example.parallelize(make_model(path, DTYPES[dtype]), "tp", backend, device_of(path))
            results[mode] = _run(model, step_fn, batches, log)
    return results
