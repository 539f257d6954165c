"""Each CPU convolution's layout in an NHWC graph, chosen by timing both (``config.cpu_convolution_timing``).

An inference graph runs its CPU convolutions in NHWC, except those that run faster in NCHW
(``library_calls.channels_last_convolutions``). Which ones those are depends on the CPU: on a
2-core EPYC (AVX2) NHWC wins for most of ResNet-18's convolutions and NCHW only where the weight
is over 32 times the input; on a Xeon (AVX-512) NCHW wins from a weight/input ratio of about 2
(benchmarks/RESULTS.md, round 9). No one threshold fits both, so each convolution is run here
once in each layout, on random tensors of its sizes, at compile time:

- NHWC: its operands converted as the graph converts them (``nhwc_operands``);
- NCHW: the same input brought back to NCHW first, the convolution on NCHW operands, and its
  output converted to NHWC: the conversions a convolution that leaves the graph's layout pays
  (whatever reads its output runs NHWC, or mixes layouts at a cost). Without the output's,
  ResNet-18's stem (3 -> 64 channels, 7x7 over 8 images of 64x64) timed 10% faster in NCHW on
  the EPYC, and the step ran no faster for it (A/B 1.006 in one process); with it NHWC wins.

Both compute the same convolution, so a choice changes speed, never values. The rule
(``MAX_CHANNELS_LAST_WEIGHT_PER_INPUT``) decides where timing cannot help or cannot run: tiny
convolutions, sizes without a hint, an error while timing, or a graph whose timing budget is
spent; it also wins ties (the other layout must be ``MARGIN`` faster). Choices are kept per
sizes, dtype, parameters and thread count for the process, so recompiles do not time again.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ... import debug
from .fx_edits import node_value, numel_hint, size_hint

aten = torch.ops.aten

# Seconds of timing per graph; the convolutions after that keep the rule. ResNet-18's 11
# distinct convolutions at 8 x 64x64 took 0.75-1.0 s on one thread of a busy 2-core EPYC.
GRAPH_BUDGET_S = 1.5
# Convolutions of fewer multiply-adds keep the rule: at about 50 us a call the two layouts
# differ by microseconds, less than the timing's noise.
MIN_TIMED_WORK = 2 ** 20
# Operands larger than this (bytes, input + weight + output) are not allocated to be timed.
MAX_TIMED_BYTES = 2 ** 30
# Timed calls per layout, after one warm-up call each (oneDNN builds its kernel for the shape):
# at least REPEATS, more (up to MAX_REPEATS) until both layouts together ran MIN_TIMED_S, so
# that a short convolution gets some calls no other process disturbed.
REPEATS = 3
MAX_REPEATS = 20
MIN_TIMED_S = 0.03
# The layout the rule did not pick must be this much faster to be chosen: on a busy machine the
# fastest of a few calls still moves by several percent (ResNet-18's 256 -> 512 convolution
# over 4x4 once timed over 5% faster in NHWC, wall-clock; run NHWC, the step is 3% slower).
MARGIN = 0.1


@dataclasses.dataclass(frozen=True)
class Choice:
    nchw: bool
    nchw_ms: Optional[float] = None  # the fastest calls timed (None: not timed)
    nhwc_ms: Optional[float] = None
    why: str = "timed"

    def describe(self, name: str) -> str:
        layout = "NCHW" if self.nchw else "NHWC"
        if self.nchw_ms is None:
            return f"{name}: {layout} by the weight/input rule ({self.why})"
        return f"{name}: NCHW {self.nchw_ms:.3f} ms, NHWC {self.nhwc_ms:.3f} ms -> {layout} ({self.why})"


# (sizes, dtype, parameters, NHWC operands, threads) -> the timed Choice, for this process
_timed: dict[tuple, Choice] = {}


class Budget:
    """The timing left to one graph."""

    def __init__(self, seconds: Optional[float] = None):
        self.deadline = time.perf_counter() + (GRAPH_BUDGET_S if seconds is None else seconds)

    def spent(self) -> bool:
        return time.perf_counter() > self.deadline


def _hints(value: torch.Tensor) -> Optional[tuple[int, ...]]:
    sizes = tuple(size_hint(size) for size in value.shape)
    return None if any(size is None for size in sizes) else sizes


def _work(convolution: fx.Node) -> Optional[int]:
    """Multiply-adds of a convolution at its sizes' hints."""
    weight, out = node_value(convolution.args[1]), convolution.meta["val"]
    weight_numel, out_numel = numel_hint(weight), numel_hint(out)
    if weight_numel is None or out_numel is None:
        return None
    # each output element sums one weight row (Cin/groups x kernel); transposed, each input does
    transposed = convolution.args[6]
    per_row = weight_numel // size_hint(weight.shape[1] if transposed else weight.shape[0])
    x_numel = numel_hint(node_value(convolution.args[0]))
    return (x_numel if transposed else out_numel) * per_row


def _key(convolution: fx.Node, nhwc_operands: tuple[int, ...]) -> Optional[tuple]:
    if len(convolution.args) != 9 or convolution.kwargs:
        return None
    x, weight, bias = (node_value(a) for a in convolution.args[:3])
    sizes = (_hints(x), _hints(weight), None if bias is None else _hints(bias))
    if sizes[0] is None or sizes[1] is None or (bias is not None and sizes[2] is None):
        return None
    # stride, padding, dilation, transposed, output_padding, groups
    parameters = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in convolution.args[3:])
    flat = [p for group in parameters for p in (group if isinstance(group, tuple) else (group,))]
    if not all(isinstance(p, int) for p in flat):
        return None  # a symbolic stride or padding (bools are ints)
    return sizes, x.dtype, parameters, nhwc_operands, torch.get_num_threads()


def _measure(key: tuple, budget: Budget) -> tuple[float, float]:
    """The fastest seconds per call of (NCHW, NHWC) on random operands (``fastest``)."""
    (x_sizes, weight_sizes, bias_sizes), dtype, parameters, nhwc_operands, _ = key
    x, weight, bias = random_operands(dtype, x_sizes, weight_sizes, bias_sizes)
    nhwc_x = x.contiguous(memory_format=torch.channels_last) if 0 in nhwc_operands else x
    nhwc_weight = weight.contiguous(memory_format=torch.channels_last) if 1 in nhwc_operands else weight

    def nhwc():
        aten.convolution.default(nhwc_x, nhwc_weight, bias, *parameters)

    def nchw():  # the graph brings an NHWC input back to NCHW (a no-op for an NCHW one)
        out = aten.convolution.default(nhwc_x.contiguous(), weight, bias, *parameters)
        out.contiguous(memory_format=torch.channels_last)

    return tuple(fastest((nchw, nhwc), budget))


def random_operands(dtype: torch.dtype, *sizes: Optional[Sequence[int]]) -> list[Optional[torch.Tensor]]:
    """Random tensors of ``sizes`` (None for None), from a generator of their own: compiling
    must not move the user's random stream."""
    generator = torch.Generator().manual_seed(0)
    return [None if size is None else torch.randn(size, generator=generator, dtype=torch.float32).to(dtype)
            for size in sizes]


def fastest(variants: Sequence[Callable[[], object]], budget: Budget) -> list[float]:
    """The fastest seconds per call of each variant, timed interleaved after one warm-up call
    each (oneDNN builds its kernel for the shape), with their calls' Python overhead as a graph
    pays it. The fastest, not the median: other work on the machine only ever adds time."""
    # One thread: the thread's CPU time, which a process that takes the core away does not add
    # to. On the shared 2-core EPYC the fastest of 5 wall-clock calls of ResNet-18's 128-channel
    # convolution over 8x8 in NHWC was 8.4 ms (4.0 ms on a quiet machine), and NCHW was chosen;
    # in CPU time it measured 3.6 ms under the same load. More threads: wall-clock.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    samples: list[list[float]] = [[] for _ in variants]
    for variant in variants:
        variant()
    started = time.perf_counter()
    for repeat in range(1, MAX_REPEATS + 1):
        for variant, times in zip(variants, samples):
            start = clock()
            variant()
            times.append(clock() - start)
        if budget.spent() or (repeat >= REPEATS and time.perf_counter() - started > MIN_TIMED_S):
            break
    return [min(times) for times in samples]


def _operand_bytes(convolution: fx.Node) -> int:
    values = (node_value(convolution.args[0]), node_value(convolution.args[1]), convolution.meta["val"])
    return sum(numel_hint(v) * v.element_size() for v in values)


def choose(convolution: fx.Node, nhwc_operands: tuple[int, ...], rule_nchw: bool, budget: Budget) -> Choice:
    """Whether a CPU convolution of an NHWC graph runs NCHW, timed (see the module's docstring);
    ``rule_nchw`` is the rule's answer, kept wherever timing does not decide."""
    key = _key(convolution, nhwc_operands)
    work = _work(convolution) if key is not None else None
    if key is None or work is None:
        choice = Choice(rule_nchw, why="sizes without a hint")
    elif key in _timed:
        choice = dataclasses.replace(_timed[key], why="timed before")
    elif work < MIN_TIMED_WORK:
        choice = Choice(rule_nchw, why=f"{work} multiply-adds, too few to time")
    elif _operand_bytes(convolution) > MAX_TIMED_BYTES:
        choice = Choice(rule_nchw, why="too large to time")
    elif budget.spent():
        choice = Choice(rule_nchw, why=f"the graph's {GRAPH_BUDGET_S} s of timing is spent")
    else:
        try:
            with unset_fake_temporarily(), torch.no_grad():
                nchw_s, nhwc_s = _measure(key, budget)
        except Exception as error:  # noqa: BLE001  (out of memory, a shape oneDNN refuses: the rule)
            choice = Choice(rule_nchw, why=f"timing failed: {type(error).__name__}: {error}")
        else:
            # the rule's layout stays unless the other is clearly faster
            nchw = nchw_s < nhwc_s * (1 - MARGIN) if not rule_nchw else not nhwc_s < nchw_s * (1 - MARGIN)
            choice = _timed[key] = Choice(nchw, nchw_s * 1e3, nhwc_s * 1e3)
    debug.note("compile", choice.describe(convolution.name))
    return choice


# --- a training graph's layout: all its convolutions, forward and backward ----------------------

# Seconds of timing per training graph: each convolution runs forward and backward in both
# layouts, about twice an inference graph's work (GRAPH_BUDGET_S). Not measured alone: the first
# training steps with it on the Xeon took 2.7 s (conv net), 11.7 s (ResNet-18) and 22.2 s
# (MobileNetV3), against inductor's 16.4, 99.0 and 79.2 s.
TRAINING_BUDGET_S = 4.0
# key (as ``choose``'s) -> (NCHW seconds, NHWC seconds) of one forward and backward, for this process
_timed_training: dict[tuple, tuple[float, float]] = {}


def training_prefers_nhwc(convolutions: Sequence[fx.Node], nhwc_operands: Callable[[fx.Node], tuple[int, ...]]
                          ) -> bool:
    """Whether a CPU training graph's convolutions, forward and backward, together run clearly
    faster with NHWC operands than NCHW (``MARGIN``); False wherever a convolution cannot be
    timed (sizes without a hint, an error, the budget spent): the graph then keeps eager's
    layout. Which layout wins depends on the CPU and the network: measured on a Xeon's thread,
    eager's conv net step ran 27% faster NHWC, MobileNetV3-small's 23%, ResNet-18's 25% slower,
    and this timing picked NHWC, NHWC and NCHW for them there (on the EPYC: NCHW, NHWC, NCHW)."""
    budget = Budget(TRAINING_BUDGET_S)
    totals = [0.0, 0.0]
    for convolution in convolutions:
        key = _key(convolution, nhwc_operands(convolution))
        if key is None or _operand_bytes(convolution) > MAX_TIMED_BYTES:
            return False
        if key not in _timed_training:
            if budget.spent():
                debug.note("compile", f"training layout: the {TRAINING_BUDGET_S} s of timing is spent: NCHW")
                return False
            try:
                with unset_fake_temporarily(), torch.no_grad():
                    _timed_training[key] = _measure_training(key, budget)
            except Exception as error:  # noqa: BLE001  (out of memory, a shape oneDNN refuses)
                debug.note("compile", f"training layout: timing {convolution.name} failed ({error}): NCHW")
                return False
        for index, seconds in enumerate(_timed_training[key]):
            totals[index] += seconds
    nhwc = totals[1] < totals[0] * (1 - MARGIN)
    debug.note("compile", f"training layout: convolutions NCHW {totals[0] * 1e3:.3f} ms, NHWC {totals[1] * 1e3:.3f} ms"
                          f" -> {'NHWC' if nhwc else 'NCHW'}")
    return nhwc


def _measure_training(key: tuple, budget: Budget) -> tuple[float, float]:
    """The fastest seconds of one forward and backward (input and weight gradients) of a
    convolution, (NCHW, NHWC operands), on random operands."""
    (x_sizes, weight_sizes, bias_sizes), dtype, parameters, nhwc_operands, _ = key
    x, weight = random_operands(dtype, x_sizes, weight_sizes)
    grad = random_operands(dtype, aten.convolution.default(x, weight, None, *parameters).shape)[0]
    # a depthwise convolution's weight gradient is passes/depthwise.py's (a grouped convolution
    # whose layout costs little); ATen's own, slow in both layouts, would decide the layout
    depthwise = parameters[-1] > 1 and parameters[-1] == x_sizes[1] and weight_sizes[1] == 1
    mask = [True, not depthwise, bias_sizes is not None]

    def run(x, weight, grad):
        def step():
            aten.convolution.default(x, weight, None, *parameters)
            aten.convolution_backward.default(grad, x, weight, bias_sizes, *parameters, mask)
        return step

    channels_last = torch.channels_last
    nhwc = run(x.contiguous(memory_format=channels_last) if 0 in nhwc_operands else x,
               weight.contiguous(memory_format=channels_last) if 1 in nhwc_operands else weight,
               grad.contiguous(memory_format=channels_last))
    nchw_s, nhwc_s = fastest((run(x, weight, grad), nhwc), budget)
    return nchw_s, nhwc_s
