"""Functionalized RNG: random ops whose draws the backward can reproduce bit for bit.

Eager dropout draws its mask from the global generator. A graph that recomputes a random op
in the backward (the min-cut partitioner, or ``torch.utils.checkpoint``, which re-runs the
checkpointed region during the backward after restoring the generator state) must get the
forward's mask again, not a fresh one; and after the step the global generator must be where
eager would have left it. Two schemes, chosen per compile:

* ``philox`` (CUDA by default; CPU when the compiler generates kernels there): every draw is
  ``aotforge::philox_rand(seed, counter_base, size)`` (aotforge/philox.py), a pure function of
  one extra graph input, the seed, which the runtime derives per call from the generator's
  state. A recomputation is the same call, so it gives the same numbers, and the compiler
  generates them inside its kernels. After the call the runtime advances the generator as
  eager's kernels would have (CUDA: the philox offset, by ATen's formula; CPU: by running
  eager's draws for their effect on the generator, since the CPU generator has no counter).
* ``eager`` (CPU by default, and everywhere with ``aotforge.config.fallback_random``): every
  first draw is ``run_and_save_rng_state(op, ...)``, which runs the ATen op on the real
  generator and also returns the state it started from; a re-draw is
  ``run_with_rng_state(state, op, ...)``. Masks and the generator state then equal eager's.

Which draw is a re-draw? While tracing, the real generators carry *markers*: seed
``MARKER_BASE + n`` stands for "after n draws". A draw reads the marker (its position) and
moves the generator to the next; ``torch.get_rng_state``/``set_rng_state`` (what checkpoint
and ``fork_rng`` call) save and restore markers like any state, so a draw at a position seen
before is a re-draw of that draw. A seed that is no marker means the function reseeded the
generator (``torch.manual_seed``) or loaded an outside state: that cannot be replayed per call,
so it is an error, as is passing a ``torch.Generator`` to a random op.

Before (joint, checkpointed dropout)::

    native_dropout = aten.native_dropout(primals_1, 0.5, True)        # forward
    native_dropout_1 = aten.native_dropout(primals_1, 0.5, True)      # recompute in backward

After, eager scheme (other random ops use run_and_save_rng_state / run_with_rng_state)::

    dropout_saving_state = aotforge.dropout_saving_state(primals_1, 0.5, True)   # (state, out, mask)
    getitem = dropout_saving_state[0]
    dropout_at_state = aotforge.dropout_at_state(getitem, primals_1, 0.5, True)  # (out, mask)

After, philox scheme (``primals_2`` is the seed)::

    philox_rand = aotforge.philox_rand(primals_2, 0, [8], torch.float32)    # both places
    ge = aten.ge(philox_rand, 0.5); ...
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import decompose, disable_proxy_modes_tracing, track_tensor_tree
from torch.utils._python_dispatch import TorchDispatchMode

from .. import op_table, philox
from ..config import config
from .functional import FunctionalTensor
from .schemas import InputInfo

aten = torch.ops.aten

MARKER_BASE = 0x5EED_0000_0000
MAX_DRAWS = 1 << 24

@functools.lru_cache(None)
def random_overloads() -> tuple:
    """Random ops intercepted while tracing: op_table's random draws, functional overloads only
    (functionalization turned in-place draws such as bernoulli_ into these before they reach
    the tracer)."""
    found = []
    for packet in op_table.packets_of_kind(op_table.RANDOM):
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            if overload._schema.is_mutable or torch.Tag.nondeterministic_seeded not in overload.tags:
                continue
            found.append(overload)
    return tuple(found)


class RngError(RuntimeError):
    pass


# --- dropout at a saved generator state --------------------------------------------------------
# The eager scheme's ops for dropout. run_and_save_rng_state(native_dropout) would return the
# nested (state, (out, mask)); these return flat tuples, which every compiler's extern calls
# handle. Saving the state is a draw (tagged random: never dead code, never merged); running
# at a saved state is a pure function of it, which the backward may recompute.

_library = torch.library.Library("aotforge", "FRAGMENT")  # noqa: TOR901
_library.define(
    "dropout_saving_state(Tensor input, float p, bool? train) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.nondeterministic_seeded,),
)
_library.define("dropout_at_state(Tensor state, Tensor input, float p, bool? train) -> (Tensor, Tensor)")


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state.cpu(), device)
    else:
        torch.set_rng_state(state.cpu())


def _dropout_saving_state(x, p, train):
    state = _get_state(x.device)
    out, mask = aten.native_dropout.default(x, p, train)
    return state, out, mask


def _dropout_at_state(state, x, p, train):
    current = _get_state(x.device)
    _set_state(x.device, state)
    try:
        return tuple(aten.native_dropout.default(x, p, train))
    finally:
        _set_state(x.device, current)


def _fake_state(device: torch.device) -> torch.Tensor:
    return torch.empty((_generator(device).get_state().numel(),), dtype=torch.uint8, device="cpu")


_library.impl("dropout_saving_state", _dropout_saving_state, "CompositeExplicitAutograd")
_library.impl("dropout_at_state", _dropout_at_state, "CompositeExplicitAutograd")
_library._register_fake(
    "dropout_saving_state",
    lambda x, p, train: (_fake_state(x.device), torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)),
)
_library._register_fake(
    "dropout_at_state", lambda state, x, p, train: (torch.empty_like(x), torch.empty_like(x, dtype=torch.bool))
)


_SEEDED_MESSAGE = (
    "aotforge: the compiled function reseeds or loads an outside state into the {device} random "
    "generator (torch.manual_seed, torch.set_rng_state with a state not saved inside the "
    "function, Generator.set_state). A compiled graph cannot replay that per call. Seed before "
    "calling the compiled function, or pass the seed in and draw with your own arithmetic."
)
_REWOUND_MESSAGE = (
    "aotforge: the compiled function restores an earlier {device} random generator state "
    "(torch.set_rng_state) without returning to the latest one, so eager would leave the "
    "generator rewound; aotforge cannot. Restore with torch.random.fork_rng (as "
    "torch.utils.checkpoint does) or restore the state outside the compiled function."
)
_GENERATOR_MESSAGE = (
    "aotforge: {op} gets an explicit torch.Generator inside the compiled function; its state "
    "cannot be threaded through the graph. Draw from the global generator (drop generator=), "
    "or run this op outside the compiled function."
)
_INFERENCE_REDRAW_MESSAGE = (
    "aotforge: the function redraws random numbers at an earlier generator state (set_rng_state "
    "inside the function, as torch.utils.checkpoint does) in a graph without functionalized RNG "
    "(aotforge.config.functionalize_rng is off, or the graph is an inference graph), so the "
    "redraw would give different numbers than eager's. Turn aotforge.config.functionalize_rng on."
)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _op_device(op, args, kwargs) -> torch.device:
    for value in pytree.tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            return _device_key(value.device)
    device = kwargs.get("device")
    return _device_key(torch.device(device) if device is not None else torch.device("cpu"))


def _draws(op, args, kwargs) -> bool:
    """native_dropout in eval mode (train=False) or with p=0 draws nothing, as in eager."""
    if op is aten.native_dropout.default:
        p, train = args[1], args[2] if len(args) > 2 else kwargs.get("train")
        return bool(train is not False) and p != 0
    return True


@dataclasses.dataclass
class Draw:
    op: Any
    device: torch.device
    state: Optional[torch.Tensor] = None  # eager scheme: the state it started from (traced)
    counter_base: Any = None  # philox scheme: the first counter it used


class Session:
    """The generators' positions while one function is traced (see the module docstring).

    Entered around metadata collection and around tracing; restores the real generators'
    states on exit."""

    def __init__(self, plan: "RandomOps", emit: bool):
        self.plan = plan
        self.emit = emit
        self.base_table: dict = {}  # the trace's own decompositions, for ops we leave alone
        self.saved: dict[torch.device, torch.Tensor] = {}
        self.next_fresh: dict[torch.device, int] = {}
        self.draws: dict[tuple, Draw] = {}
        self.counter = 0

    def _devices(self) -> list[torch.device]:
        devices = [torch.device("cpu")]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return devices

    def __enter__(self) -> "Session":
        for device in self._devices():
            generator = _generator(device)
            self.saved[device] = generator.get_state()
            generator.manual_seed(MARKER_BASE)
            self.next_fresh[device] = 0
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None:
                for device in self.saved:
                    position = self.position(device)
                    if position != self.next_fresh[device]:
                        raise RngError(_REWOUND_MESSAGE.format(device=device))
        finally:
            for device, state in self.saved.items():
                _generator(device).set_state(state)

    def position(self, device: torch.device) -> int:
        if device not in self.saved:  # a CUDA device first used inside the function
            raise RngError(
                f"aotforge: the {device} generator was first used inside the compiled function; "
                "initialize CUDA (e.g. create a tensor on the device) before compiling"
            )
        seed = _generator(device).initial_seed()
        if not MARKER_BASE <= seed < MARKER_BASE + MAX_DRAWS:
            raise RngError(_SEEDED_MESSAGE.format(device=device))
        return seed - MARKER_BASE

    def advance(self, device: torch.device) -> tuple[int, bool]:
        """Take one draw: (its position, whether it is the first draw at that position)."""
        position = self.position(device)
        fresh = position == self.next_fresh[device]
        if fresh:
            self.next_fresh[device] = position + 1
        _generator(device).manual_seed(MARKER_BASE + position + 1)
        return position, fresh

    # --- while tracing: one handler per random op, run in place of the op by make_fx ---------

    def decompositions(self, base_table: dict) -> dict:
        """``base_table`` plus a handler per random op."""
        if not self.emit:
            return base_table
        self.base_table = base_table
        return {**base_table, **{op: functools.partial(self._draw, op) for op in random_overloads()}}

    def _call_original(self, op, args, kwargs):
        with decompose(self.base_table):
            return op(*args, **kwargs)

    def _draw(self, op, *args, **kwargs):
        if kwargs.get("generator") is not None:
            raise RngError(_GENERATOR_MESSAGE.format(op=op))
        if not _draws(op, args, kwargs):
            return self._call_original(op, args, kwargs)
        device = _op_device(op, args, kwargs)
        position, fresh = self.advance(device)
        key = (device, position)
        if not self.plan.functionalized:
            if not fresh:
                raise RngError(_INFERENCE_REDRAW_MESSAGE)
            return self._call_original(op, args, kwargs)
        if fresh:
            self.draws[key] = Draw(op, device)
        draw = self.draws[key]
        lowering = PHILOX_DRAWS.get(op.overloadpacket)
        if self.plan.scheme == "philox" and device == self.plan.device and lowering is not None:
            numel = _static_numel(op, args, kwargs)
            if numel is not None and (fresh or draw.counter_base is not None):
                if fresh:
                    draw.counter_base = self.counter
                    self.counter += numel
                    self.plan.record_philox_draw(op, args, kwargs, device, numel)
                return lowering(self.plan.traced_seed(), draw.counter_base, *args, **kwargs)
        return self._eager_draw(op, draw, fresh, args, kwargs)

    def _eager_draw(self, op, draw: Draw, fresh: bool, args, kwargs):
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

        if op is aten.native_dropout.default and (fresh or draw.state is not None):
            return self._eager_dropout(draw, fresh, *args, **kwargs)
        proxy_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
        tracer = proxy_mode.tracer
        with disable_proxy_modes_tracing():
            out = op(*args, **kwargs)
        if draw.state is None and not fresh:
            raise RngError(
                "aotforge: a random op redraws at the position of a draw that used the philox "
                "scheme with a different op or shape; use the same op to recompute it"
            )
        proxy_args = pytree.tree_map(tracer.unwrap_proxy, (op, *args))
        proxy_kwargs = pytree.tree_map(tracer.unwrap_proxy, kwargs)
        if fresh:
            with disable_proxy_modes_tracing():
                state = _fake_state_like(draw.device, out)
            proxy = tracer.create_proxy("call_function", run_and_save_rng_state, proxy_args, proxy_kwargs)
            state, out = track_tensor_tree((state, out), proxy, constant=None, tracer=tracer)
            draw.state = state
            return out
        proxy = tracer.create_proxy(
            "call_function", run_with_rng_state, (tracer.unwrap_proxy(draw.state), *proxy_args), proxy_kwargs
        )
        return track_tensor_tree(out, proxy, constant=None, tracer=tracer)


    def _eager_dropout(self, draw: Draw, fresh: bool, x, p, train=None):
        if fresh:
            state, out, mask = torch.ops.aotforge.dropout_saving_state.default(x, p, train)
            draw.state = state
            return out, mask
        return torch.ops.aotforge.dropout_at_state.default(draw.state, x, p, train)


def _fake_state_like(device: torch.device, out) -> torch.Tensor:
    """A fake uint8 tensor shaped like the generator's state (the run_and_save result)."""
    size = _generator(device).get_state().numel()
    example = pytree.tree_leaves(out)[0]
    return example.new_empty((size,), dtype=torch.uint8, device="cpu")


def _static_numel(op, args, kwargs) -> Optional[int]:
    size = _draw_size(op, args, kwargs)
    numel = 1
    for dim in size:
        if not isinstance(dim, int):
            return None  # symbolic: the eager scheme handles it
        numel *= dim
    return numel


def _draw_dtype(op, args, kwargs) -> torch.dtype:
    if op.overloadpacket is aten.rand:
        return kwargs.get("dtype") or torch.get_default_dtype()
    return kwargs.get("dtype") or args[0].dtype


def _draw_size(op, args, kwargs) -> Sequence:
    if op.overloadpacket in (aten.rand,):
        return list(args[0])
    return list(args[0].shape)


# --- the philox scheme's rewrites: ATen random op -> philox_rand + arithmetic ------------------

def _uniform(seed, base, size, device) -> torch.Tensor:
    return philox.philox_rand(seed, base, list(size), torch.float32)


def _dropout(seed, base, x, p, train=None):
    keep = _uniform(seed, base, x.shape, x.device) >= p
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return x * keep.to(x.dtype) * scale, keep


def _bernoulli(seed, base, x, p=None, *, generator=None):
    probability = x if p is None else p
    return (_uniform(seed, base, x.shape, x.device) < probability).to(x.dtype)


def _rand(seed, base, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _uniform(seed, base, size, device).to(dtype or torch.get_default_dtype())


def _rand_like(seed, base, x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _uniform(seed, base, x.shape, x.device).to(dtype or x.dtype)


def _uniform_between(seed, base, x, low=0.0, high=1.0, *, generator=None):
    return (_uniform(seed, base, x.shape, x.device) * (high - low) + low).to(x.dtype)


PHILOX_DRAWS: dict = {
    aten.native_dropout: _dropout,
    aten.bernoulli: _bernoulli,
    aten.rand: _rand,
    aten.rand_like: _rand_like,
    aten.uniform: _uniform_between,
}


class _RandomOpDetector(TorchDispatchMode):
    """Notes the devices random ops run on (before functionalization, so in-place draws too)."""

    supports_higher_order_operators = True  # with_effects & co. pass through untouched

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.cond (and the other higher-order ops) run eagerly through torch.compile. With a
        # mode on the stack that does not ignore compile internals, Dynamo skips that compile
        # and marks the wrapper's code object "skip" for good: every later eager torch.cond in
        # the process then fails (issue 36). Compiled code still runs its ops through this mode.
        return True

    def __init__(self, devices: set):
        super().__init__()
        self.devices = devices

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_table.info(func).kind == op_table.RANDOM:  # (uninitialized memory is not a draw)
            self.devices.add(_op_device(func, args, kwargs))
        return func(*args, **kwargs)


_active = threading.local()


def trace_decompositions(table: dict) -> dict:
    """``table`` plus the random-op handlers of the tracing session active in this thread
    (trace.py calls this for make_fx's decomposition table)."""
    session = getattr(_active, "session", None)
    return session.decompositions(table) if session is not None else table


class RandomOps:
    """The RNG concern of one compile: watches metadata collection for random ops, decides the
    scheme, and (as a wrapper in the compile's list) adds the seed input and feeds it at
    runtime."""

    def __init__(self):
        self.devices: set = set()
        self.functionalized = False
        self.scheme: Optional[str] = None
        self.device: Optional[torch.device] = None
        self._seed = None  # the seed argument while tracing
        self.philox_draws: list[tuple] = []  # (op, args spec, numel, dtype) per first philox draw

    # --- metadata collection --------------------------------------------------------------

    def watch(self, flat_fn: Callable) -> Callable:
        """``flat_fn`` run in a generator session, noting where it draws random numbers."""

        def watched(*args):
            with Session(self, emit=False), _RandomOpDetector(self.devices):
                return flat_fn(*args)

        return watched

    def decide(self, is_training: bool) -> None:
        """Choose the scheme once the metadata says whether this is a training graph."""
        self.functionalized = bool(is_training and self.devices and config.functionalize_rng)
        if not self.functionalized:
            return
        devices = sorted(self.devices, key=str)
        self.device = devices[0]
        uses_kernels_on_cpu = self.device.type == "cpu" and config.triton_on_cpu
        if config.fallback_random or len(devices) > 1 or not (self.device.type == "cuda" or uses_kernels_on_cpu):
            self.scheme = "eager"
        else:
            self.scheme = "philox"

    @property
    def needs_seed(self) -> bool:
        return self.scheme == "philox"

    # --- tracing ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        session = Session(self, emit=True)
        previous = getattr(_active, "session", None)
        _active.session = session
        try:
            with session:
                yield
        finally:
            _active.session = previous

    def traced_seed(self) -> torch.Tensor:
        """The seed input as the tracer sees it (below functionalization)."""
        seed = self._seed
        if isinstance(seed, FunctionalTensor):
            seed = torch._from_functional_tensor(seed.elem)
        return seed

    def record_philox_draw(self, op, args, kwargs, device, numel) -> None:
        spec = pytree.tree_map_only(torch.Tensor, lambda t: (tuple(t.shape), t.dtype), (args, kwargs))
        self.philox_draws.append((op, spec, numel, _draw_dtype(op, args, kwargs)))

    # --- the wrapper --------------------------------------------------------------------------

    def pre_compile(self, flat_fn: Callable, fake_args: Sequence, meta) -> tuple[Callable, list]:
        """Append the seed input (philox scheme) to the traced function and the metadata."""
        if not self.needs_seed:
            return flat_fn, list(fake_args)
        fake_mode = next(a.fake_mode for a in fake_args if isinstance(a, torch.Tensor) and hasattr(a, "fake_mode"))
        with fake_mode:
            seed = torch.empty((), dtype=torch.int64, device=self.device)
        meta.input_info.append(InputInfo(is_tensor=True))

        def seeded_fn(*args):
            self._seed = args[-1]
            return flat_fn(*args[:-1])

        return seeded_fn, [*fake_args, seed]

    def post_compile(self, run: Callable) -> Callable:
        if not self.needs_seed:
            return run
        device = self.device
        if device.type == "cuda":
            increment = sum(
                philox.cuda_offset_increment(n, device, fused_dropout=op.overloadpacket is aten.native_dropout, dtype=dtype)
                for op, _, n, dtype in self.philox_draws
            )
            generator = _generator(device)

            def seeded_run(args: list) -> list:
                seed, offset = generator.initial_seed(), generator.get_offset()
                key = torch.full((), philox.mix_seed(seed, offset), dtype=torch.int64, device=device)
                outputs = run([*args, key])
                generator.set_offset(generator.get_offset() + increment)
                return outputs

            return seeded_run
        replays = [(op, spec) for op, spec, _, _ in self.philox_draws]

        def seeded_cpu_run(args: list) -> list:
            state = torch.get_rng_state()
            key = philox.mix_seed(int(state.view(torch.int64).sum()) & 0xFFFFFFFFFFFFFFFF, 0)
            outputs = run([*args, torch.tensor(key, dtype=torch.int64)])
            _replay_eager_draws(replays)
            return outputs

        return seeded_cpu_run


def _replay_eager_draws(replays: list) -> None:
    """Advance the CPU generator as eager's draws would have: run them on empty tensors."""
    with torch.no_grad():
        for op, spec in replays:
            args, kwargs = pytree.tree_map(
                lambda leaf: torch.empty(leaf[0], dtype=leaf[1]) if _is_tensor_spec(leaf) else leaf,
                spec,
                is_leaf=_is_tensor_spec,
            )
            op(*args, **kwargs)


def _is_tensor_spec(value) -> bool:
    return (
        isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple)
        and isinstance(value[1], torch.dtype)
    )
