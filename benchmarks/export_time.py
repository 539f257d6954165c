"""Export: aotforge's aot_export_module against PyTorch's, on the benchmark suite's models.

    python benchmarks/export_time.py            # quick and medium sizes, CPU
    python benchmarks/export_time.py --quick    # quick sizes only (a smoke run, seconds)

For each model (the nanoGPT and ResNet workloads of ``aotforge/bench/workloads/models.py``, which
return their loss in training mode, and the MLP with a sum loss added) and each export kind
(joint with the loss, inference), it reports:

* export wall time, median of 3 exports after one warm-up, for aotforge and for
  ``torch._functorch.aot_autograd.aot_export_module``;
* graph size (ATen op nodes; ``getitem`` and ``detach`` left out: PyTorch keeps dead ones);
* agreement with eager: both graphs run on the same parameters, buffers and inputs in float64;
  every user output, buffer update and parameter gradient, found by its name in the
  signature, is compared with eager's (max ‖a − b‖ / ‖b‖ over all of them; "values" counts
  aotforge's). With tied weights (nanoGPT's wte / lm_head) PyTorch lists the parameter under
  both names and gives each a partial gradient, so its error there is large by design.
"""
from __future__ import annotations

import argparse
import copy
import operator
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aotforge import aot_export_module  # noqa: E402
from aotforge.bench.workloads.models import build_mlp, build_nanogpt, build_resnet  # noqa: E402


class TupleOutput(nn.Module):
    """PyTorch's export wants a tuple of outputs; the MLP's training export a scalar loss."""

    def __init__(self, inner: nn.Module, loss: bool):
        super().__init__()
        self.inner = inner
        self.loss = loss

    def forward(self, *args):
        out = self.inner(*args)
        return (out.square().mean() if self.loss else out,)


def medium(build, mode):
    """Between the suite's quick and full sizes: big enough to be a real graph, small enough
    for the CPU."""
    torch.manual_seed(0)
    if build is build_nanogpt:
        from aotforge.bench.workloads.models import NanoGPT

        model = NanoGPT(vocab=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
        idx = torch.randint(0, 512, (4, 64))
        return model, (idx,) if mode == "infer" else (idx, torch.randint(0, 512, (4, 64)))
    if build is build_resnet:
        from aotforge.bench.workloads.models import ResNet

        model = ResNet((16, 32, 64), 2, 10)
        images = torch.randn(8, 3, 32, 32)
        return model, (images,) if mode == "infer" else (images, torch.randint(0, 10, (8,)))
    from aotforge.bench.workloads.models import MLP

    return MLP(256, 512, 4), (torch.randn(64, 256),)


def build_case(name: str, size: str, mode: str):
    build = {"mlp": build_mlp, "nanogpt": build_nanogpt, "resnet": build_resnet}[name]
    torch.manual_seed(0)
    if size == "quick":
        case = build(mode, True)
        model, inputs = case.module, case.inputs
    else:
        model, inputs = medium(build, mode)
    model = TupleOutput(model, loss=name == "mlp" and mode == "train")
    return model.double(), tuple(t.double() if t.is_floating_point() else t for t in inputs)


def export_both(model, inputs, joint: bool):
    from torch._functorch.aot_autograd import aot_export_module as torch_export

    kwargs = {"trace_joint": joint, "output_loss_index": 0 if joint else None}
    return aot_export_module(model, inputs, **kwargs), torch_export(model, inputs, **kwargs)


def timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up: first-call costs (imports, dispatcher caches) are not export's
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def node_count(gm) -> int:
    """ATen ops in the graph; tuple getitems and detaches left out (PyTorch keeps dead ones)."""
    return sum(
        1 for n in gm.graph.nodes
        if n.op == "call_function" and n.target not in (torch.ops.aten.detach.default, operator.getitem)
    )


def named_results(gm, signature, model, inputs) -> dict:
    """Run an exported graph; name its outputs the way both signatures agree on."""
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    by_name = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    user = iter(inputs)
    args = [state[by_name[p]] if p in by_name else next(user) for p in placeholders]
    with torch.no_grad():
        values = gm(*args)
    (output,) = gm.graph.find_nodes(op="output")
    named = dict(zip((getattr(n, "name", None) for n in output.args[0]), values))
    results = {f"output {i}": named[n] for i, n in enumerate(signature.user_outputs)}
    results.update({f"buffer {fqn}": named[n] for n, fqn in signature.buffers_to_mutate.items()})
    if signature.backward_signature is not None:
        for n, fqn in signature.backward_signature.gradients_to_parameters.items():
            results[f"grad {fqn}"] = named[n]
    return results


def eager_results(model, inputs, joint: bool) -> dict:
    """The same names, from eager PyTorch on a copy of the model (the oracle)."""
    model = copy.deepcopy(model)
    with torch.enable_grad() if joint else torch.no_grad():
        outputs = model(*inputs)
    results = {f"output {i}": out.detach() for i, out in enumerate(outputs)}
    results.update({f"buffer {fqn}": b for fqn, b in model.named_buffers()})
    if joint:
        outputs[0].backward()
        results.update(
            {f"grad {fqn}": p.grad for fqn, p in model.named_parameters(remove_duplicate=False)}
        )
    return results


def max_relative_error(got: dict, want: dict) -> tuple[float, int]:
    """Worst ‖got − want‖ / ‖want‖ over the names ``got`` has."""
    worst = 0.0
    for key, a in got.items():
        b = want[key]
        if not b.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(a, b) else float("inf"))
        else:
            worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return worst, len(got)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quick sizes only")
    options = parser.parse_args(argv)
    sizes = ["quick"] if options.quick else ["quick", "medium"]
    print("| model | size | export | aotforge s | torch s | nodes (aotforge / torch) | values | aotforge error | torch error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("mlp", "nanogpt", "resnet"):
        for size in sizes:
            for mode in ("train", "infer"):
                model, inputs = build_case(name, size, mode)
                joint = mode == "train"
                (ours, our_sig), (theirs, their_sig) = export_both(model, inputs, joint)
                kwargs = {"trace_joint": joint, "output_loss_index": 0 if joint else None}
                from torch._functorch.aot_autograd import aot_export_module as torch_export

                our_time = timed(lambda: aot_export_module(model, inputs, **kwargs))
                their_time = timed(lambda: torch_export(model, inputs, **kwargs))
                want = eager_results(model, inputs, joint)
                our_error, compared = max_relative_error(named_results(ours, our_sig, model, inputs), want)
                their_error, _ = max_relative_error(named_results(theirs, their_sig, model, inputs), want)
                kind = "joint" if joint else "inference"
                print(
                    f"| {name} | {size} | {kind} | {our_time:.2f} | {their_time:.2f} | "
                    f"{node_count(ours)} / {node_count(theirs)} | {compared} | {our_error:.1e} | "
                    f"{their_error:.1e} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
