"""DDP, FSDP2 and tensor parallelism compiled by aotforge, on two spawned ranks of a gloo group
(CPU), five training steps each: the loss of every step and the final parameters on every
rank equal eager's. Each case runs on the ATen path (CPU graphs run as their ATen calls, the
default) and, where the interpreter is fast enough, on the Triton path (``triton_on_cpu``;
marked slow). On a machine with two GPUs the ``gpu`` cases run the same on NCCL
(``python -m pytest tests/distributed -k gpu``). Scenarios live in scenarios.py; cluster.py
starts the ranks once per module."""
from __future__ import annotations

import os

import pytest
import torch

distributed = pytest.importorskip("torch.distributed")
if not distributed.is_available() or not distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from . import scenarios  # noqa: E402
from .cluster import Cluster  # noqa: E402

ATEN = pytest.param("aten", id="aten")
TRITON = pytest.param("triton", id="triton", marks=pytest.mark.slow)
GPU = pytest.param("gpu", id="gpu", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1", reason="needs two GPUs"))
# bf16 compute (float32 master weights): kernels that round at other points than eager's
BF16_TOLERANCE = {"rtol": 1.6e-2, "atol": 2e-3}
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


class Clusters:
    """Two ranks on gloo (CPU paths) and, when a case asks for it, two on NCCL (``gpu``)."""

    def __init__(self) -> None:
        self.by_backend: dict[str, Cluster] = {}

    def run(self, fn, path: str, **kwargs):
        backend = "nccl" if path == "gpu" else "gloo"
        if backend not in self.by_backend:
            self.by_backend[backend] = Cluster(backend=backend)
        return self.by_backend[backend].run(fn, path=path, **kwargs)

    def stop(self) -> None:
        for ranks in self.by_backend.values():
            ranks.stop()


@pytest.fixture(scope="module")
def cluster():
    clusters = Clusters()
    try:
        yield clusters
    finally:
        clusters.stop()


def assert_equal_to_eager(results: list, **tolerance) -> None:
    for rank, result in enumerate(results):
        eager, compiled = result["eager"], result["compiled"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], **tolerance,
                                   msg=lambda m: f"rank {rank}: losses differ from eager's\n{m}")
        assert compiled["parameters"].keys() == eager["parameters"].keys()
        for name, expected in eager["parameters"].items():
            torch.testing.assert_close(compiled["parameters"][name], expected, **tolerance,
                                       msg=lambda m: f"rank {rank}: parameter {name} after training\n{m}")
    # the ranks trained one model: their final parameters agree
    for name, value in results[0]["compiled"]["parameters"].items():
        torch.testing.assert_close(results[1]["compiled"]["parameters"][name], value, rtol=0, atol=0)


def compiled_kinds(results: list) -> list:
    """Kinds of the graphs aotforge compiled to kernels, per rank (not on the ATen path)."""
    return [[kind for kind, _ in r["compiled"]["graphs"]["compiled"]] for r in results]


@pytest.mark.parametrize("path", [ATEN, TRITON, GPU])
def test_ddp_with_bucket_graph_splits(cluster, path):
    results = cluster.run(scenarios.ddp, path)
    assert_equal_to_eager(results)
    for result in results:
        assert result["compiled"]["graphs"]["dynamo_graphs"] >= 2, "Dynamo should split the graph at DDP's buckets"
    if path != "aten":
        assert all(kinds.count("backward") >= 2 for kinds in compiled_kinds(results))


@pytest.mark.parametrize("path", [ATEN, GPU])
def test_ddp_no_sync_accumulation(cluster, path):
    assert_equal_to_eager(cluster.run(scenarios.ddp, path, no_sync=True))


@pytest.mark.parametrize("compile_each", ["model", "block"])
@pytest.mark.parametrize("path", [ATEN, TRITON, GPU])
def test_fsdp2(cluster, path, compile_each):
    results = cluster.run(scenarios.fsdp, path, compile_each=compile_each)
    assert_equal_to_eager(results)
    for result in results:
        assert result["compiled"]["graphs"]["dynamo_graphs"] >= 1
    if path != "aten":
        assert all("backward" in kinds for kinds in compiled_kinds(results))


@pytest.mark.parametrize("path", [ATEN, TRITON, GPU])
def test_fsdp2_bf16_mixed_precision(cluster, path):
    assert_equal_to_eager(cluster.run(scenarios.fsdp, path, dtype="float32", bf16=True), **BF16_TOLERANCE)


@pytest.mark.parametrize("path", [ATEN, GPU])
def test_fsdp2_without_reshard_after_forward(cluster, path):
    assert_equal_to_eager(cluster.run(scenarios.fsdp, path, reshard_after_forward=False))


@pytest.mark.parametrize("path", [ATEN, TRITON, GPU])
def test_fsdp2_activation_checkpointing_with_dropout(cluster, path):
    """Each block's forward is recomputed in the backward; its dropout masks must be the
    forward's (and eager's: the CPU generator is seeded before every step)."""
    assert_equal_to_eager(cluster.run(scenarios.fsdp, path, compile_each="block", dropout=0.1,
                                      checkpointed=True))


@pytest.mark.parametrize("path", [ATEN, TRITON, GPU])
def test_tensor_parallel_transformer(cluster, path):
    results = cluster.run(scenarios.tensor_parallel, path)
    assert_equal_to_eager(results)
    if path != "aten":
        # DTensor's collectives are in the compiled graphs, as extern calls
        for result in results:
            for kind in ("forward", "backward"):
                called = {op.split(".")[1] for k, ops in result["compiled"]["graphs"]["compiled"] if k == kind
                          for op in ops}
                assert called & set(COLLECTIVES) and "wait_tensor" in called, f"{kind}: {called}"
