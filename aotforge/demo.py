"""``python -m aotforge demo``: train a small model eagerly and through aotforge, show that the
losses match, and print the forward and backward graphs aotforge captured."""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from .aot import aot_module
from .aot.boxing import nop


class DemoNet(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.norm = nn.LayerNorm(width)
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.gelu(self.norm(self.fc1(x)))), target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotforge demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quiet", action="store_true", help="do not print the graphs")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    eager_model = DemoNet().double()
    aot_model_inner = DemoNet().double()
    aot_model_inner.load_state_dict(eager_model.state_dict())
    graphs: dict[str, torch.fx.GraphModule] = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm
        return compiler

    aot_model = aot_module(aot_model_inner, capture("forward"), capture("backward"))
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.5)
    aot_opt = torch.optim.SGD(aot_model_inner.parameters(), lr=0.5)
    x = torch.randn(64, 16, dtype=torch.float64)
    target = torch.randint(0, 4, (64,))

    print(f"{'step':>4}  {'eager loss':>12}  {'aotforge loss':>14}  {'|diff|':>9}")
    worst = 0.0
    for step in range(args.steps):
        losses = []
        for model, opt in ((eager_model, eager_opt), (aot_model, aot_opt)):
            opt.zero_grad()
            loss = model(x, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        diff = abs(losses[0] - losses[1])
        worst = max(worst, diff)
        print(f"{step:>4}  {losses[0]:>12.8f}  {losses[1]:>14.8f}  {diff:>9.2e}")
    ok = worst < 1e-9
    print(f"\nlosses {'match' if ok else 'DIFFER'} (largest difference {worst:.2e}, float64)")
    if not args.quiet:
        for name in ("forward", "backward"):
            print(f"\n===== captured {name} graph =====")
            print(graphs[name].code.strip())
    return 0 if ok else 1
