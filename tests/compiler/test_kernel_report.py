"""The kernel report finds, without a GPU, the defects that cost kernel time on one: a
pointwise or reduction kernel whose loads are not coalesced along its vector dimension, a
kernel that moves more bytes than it must, pointer counts and index width; registers where
Triton can build for sm_90 here."""
from __future__ import annotations

import os

import pytest
import torch

import aotforge  # noqa: F401
from aotforge.compiler import kernel_report, observe
from aotforge.compiler.kernel_report import sm90_registers
from aotforge.config import config


def _report(fn, *inputs):
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        torch.compile(fn, backend="aotforge")(*inputs)
    (graph,) = graphs
    return kernel_report(graph)


def test_a_transposing_kernel_is_flagged_with_its_stride():
    # the sum over dim 0 of a transposed view: lanes of the output read 64 elements apart
    report = _report(lambda p: (p.transpose(-1, -2) * 2).sum(0), torch.randn(4, 64, 64))
    (kernel,) = report.kernels
    (bad,) = kernel.uncoalesced
    assert bad.kind == "load" and bad.stride == 64
    assert "not coalesced" in str(report) and "(stride 64)" in str(report)


def test_row_kernels_and_column_sums_are_coalesced_and_move_what_they_must():
    report = _report(lambda x, w: (torch.softmax(x, -1), w.sum(0)), torch.randn(32, 128), torch.randn(256, 33))
    assert len(report.kernels) == 2
    for kernel in report.kernels:
        assert not kernel.uncoalesced, kernel
        assert kernel.moves == kernel.must_move and kernel.pointers == 2 and not kernel.int64
    softmax = next(k for k in report.kernels if k.rnumel == 128)
    assert softmax.must_move == 2 * 32 * 128 * 4  # read once, written once


def test_a_kernel_that_reads_its_input_twice_moves_more_than_it_must():
    # x read at two different elements of the same row: twice the bytes of one read
    report = _report(lambda x: x + x.flip(-1), torch.randn(64, 256))
    (kernel,) = report.kernels
    assert kernel.moves == kernel.must_move + 64 * 256 * 4


@pytest.mark.skipif(not os.access(os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia",
                                               "bin", "cuobjdump"), os.X_OK), reason="Triton ships no cuobjdump here")
def test_registers_of_an_sm90_build():
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        torch.compile(lambda x: torch.softmax(x, -1), backend="aotforge")(torch.randn(32, 1024))
    registers, local = sm90_registers(graphs[0].kernels[0])
    assert registers is not None and 8 <= registers <= 255 and local == 0


def test_a_kernel_with_an_index_read_from_a_tensor_gets_a_report_and_dumping_changes_nothing(tmp_path, monkeypatch):
    """A gather's index is data (``indirectN`` in the kernel's index): the report walks it as 0.
    With a dump folder set, the same kernels are compiled as without (the report once failed
    there, and the graph fell back to ATen calls)."""
    table, rows = torch.randn(10, 8), torch.tensor([[3, 1, 4], [1, 5, 9]])

    def gather(t, i):
        return torch.nn.functional.embedding(i, t * 2) + 1

    report = _report(gather, table, rows)
    assert report.kernels and "kernel" in str(report)
    monkeypatch.setenv("AOTFORGE_DUMP_DIR", str(tmp_path))
    torch._dynamo.reset()
    with config.patch(triton_on_cpu=True), observe() as graphs:
        out = torch.compile(gather, backend="aotforge")(table, rows)
    torch.testing.assert_close(out, gather(table, rows))
    (graph,) = graphs
    assert graph.path == "triton" and len(graph.kernels) == len(report.kernels)
    assert list(tmp_path.rglob("*inference_kernel_report.txt"))
