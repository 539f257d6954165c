"""The CUDA attention kernels (memory-efficient, flash, cuDNN) return their philox seed and
offset as 0-d int64 tensors on the CPU (on the GPU inside a CUDA graph capture), where their
fake kernels say the GPU. The compiled forward's output check must accept either device for
those outputs and stay strict for every other. Checked with fake CUDA tensors, no GPU."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from aotforge.aot.runtime import check_outputs_once

aten = torch.ops.aten


def _attention_graph(mode: FakeTensorMode) -> fx.GraphModule:
    """``(q, k, v) -> (attention, logsumexp, seed, offset)`` with fake CUDA values, as a
    training forward that saves the attention's random state for its backward."""
    graph = fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    with mode:
        values = [torch.empty(2, 4, 16, 16, device="cuda") for _ in range(3)]
        result = aten._scaled_dot_product_efficient_attention.default(*values, None, True)
    for node, value in zip((q, k, v), values):
        node.meta["val"] = value
    attention = graph.call_function(aten._scaled_dot_product_efficient_attention.default, (q, k, v, None, True))
    attention.meta["val"] = result
    outputs = []
    for index in range(4):
        item = graph.call_function(__import__("operator").getitem, (attention, index))
        item.meta["val"] = result[index]
        outputs.append(item)
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_attention_seed_and_offset_may_come_back_on_the_cpu():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    gm = _attention_graph(mode)
    expected = [n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].args[0]]
    assert expected[2].device.type == "cuda"  # what the fake kernel says
    returned = [expected[0], expected[1], torch.tensor(123), torch.tensor(456)]  # what the real one gives
    checked = check_outputs_once(lambda *args: list(returned), gm, "fw_compiler")
    assert checked([]) == returned  # noqa


def test_other_outputs_on_the_wrong_device_still_fail():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    gm = _attention_graph(mode)
    expected = [n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].args[0]]
    # the attention itself (output 0) on the CPU is a compiler's mistake
    returned = [torch.empty(2, 4, 16, 16), expected[1], expected[2], expected[3]]
    checked = check_outputs_once(lambda *args: list(returned), gm, "fw_compiler")
    with pytest.raises(RuntimeError, match="returned output 0 as .* on cpu"):
        checked([])
    # a CPU seed of another dtype is not the kernel's random state either
    returned = [expected[0], expected[1], torch.tensor(1.0), expected[3]]
    checked = check_outputs_once(lambda *args: list(returned), gm, "fw_compiler")
    with pytest.raises(RuntimeError, match="returned output 2"):
        checked([])
