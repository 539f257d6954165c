"""The peak memory a compiled inference graph's memory plan predicts, on the CPU (no GPU).

    python benchmarks/memory_plan_peak.py                 # ResNet-50, bf16 autocast, batch 128, 224px
    python benchmarks/memory_plan_peak.py --batch 8 --size 64 --fp32

The model (a bottleneck ResNet-50 written here, so torchvision is not needed) is traced as the
``aotforge`` backend would see its inference graph (under no_grad, parameters as inputs) and
compiled for the Triton path without running it; ``live_bytes`` walks the memory plan and
sums the bytes the wrapper holds at each step: the buffers it allocates and the outputs of
its ATen calls. Parameters and the input are the caller's and not counted, nor are library
workspaces (cuDNN's), so ``torch.cuda.max_memory_allocated`` on the GPU reads somewhat higher.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from aotforge.compiler import compile_fx_inner  # noqa: E402
from aotforge.compiler.schedule.memory import live_bytes  # noqa: E402
from aotforge.config import config  # noqa: E402
from tests.compiler.helpers import trace  # noqa: E402


class Bottleneck(nn.Module):
    def __init__(self, inputs: int, width: int, stride: int = 1):
        super().__init__()
        out = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inputs != out:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + identity)


def resnet50() -> nn.Module:
    blocks, inputs = [], 64
    for stage, count in enumerate((3, 4, 6, 3)):
        for index in range(count):
            blocks.append(Bottleneck(inputs, 64 * 2 ** stage, 2 if index == 0 and stage > 0 else 1))
            inputs = 4 * 64 * 2 ** stage
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, 1000)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    args = parser.parse_args()
    model = resnet50()
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]

    def inference(x, *state):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            return (torch.func.functional_call(model, dict(zip(names, state)), (x,)),)

    inputs = [torch.randn(args.batch, 3, args.size, args.size)] + [t.detach() for t in tensors]
    with config.patch(triton_on_cpu=True):
        graph = compile_fx_inner(trace(inference, *inputs), inputs, is_inference=True).compiled_graph
    live = live_bytes(graph.lowered, graph.kernel_plan, graph.memory_plan)
    peak = max(live)
    step = graph.memory_plan.steps[live.index(peak)]
    print(f"ResNet-50 inference, batch {args.batch}, {args.size}px, {'fp32' if args.fp32 else 'bf16 autocast'}: "
          f"{len(live)} steps, peak {peak / 2**20:.1f} MiB at {step}")


if __name__ == "__main__":
    main()
