"""CUDA graphs around a compiled graph (``mode="reduce-overhead"``, ``config.cudagraphs``).

A compiled graph's kernel launches are recorded once per input shape and replayed, so that a
launch-bound step runs at the GPU's speed instead of Python's. The invariant users rely on:
**a tensor we handed out is never changed by a later replay**, so every plain training loop
works with no extra call (``loss.backward(); opt.step(); opt.zero_grad()``, gradient
accumulation, ``outputs.append(model(x).detach())``, evaluation between steps).

Inputs, per position (decided at the first recording, printed by the record):

    static  a parameter (or an index the caller declared): read in place; when its address
            changes (a replaced parameter, ``load_state_dict(assign=True)``) the recording is
            dropped and made again, never replayed against the old address
    pool    an output of another recording of ours (the forward's saved activations, read by
            the backward): read in place; its address is part of the recording's key
    copy    anything else: copied into a static buffer of the same layout before each replay
            (misaligned inputs get an aligned buffer; expanded and self-overlapping ones copy
            the memory span they cover, so the layout stays exactly the caller's)
    value   numbers (sizes under dynamic shapes) and None: part of the key
    host scalar  a 0-d CPU tensor (an unspecialized float under dynamic shapes): read on the
            host as a number, so its value is part of the key

Outputs live in the recording's private memory pool. Before a replay the record checks, from
the storages' use counts, whether a caller still holds an output of the previous replay
(the loss of the previous step, a gradient that ``AccumulateGrad`` adopted as ``.grad``, an
appended ``.detach()``). If so the recording is retired (its memory now belongs to the
holder), this call runs the graph's launches without a CUDA graph, and the output's policy
escalates for the next recording:

    hand out  an alias of the pool memory (free; the default)
    hold      backward outputs: an alias we keep until the next replay, so that
              ``AccumulateGrad`` copies it into a fresh ``.grad`` instead of adopting the pool
              memory (and adds into an existing ``.grad`` in place: gradient accumulation)
    clone     a copy (one copy kernel per output), for outputs callers keep

Graphs that cannot be captured run as plain launches with one warning that says why
(``capture_blocker``: CPU tensors, host synchronization, data-dependent shapes, RNG whose
state is read on the host; or a capture that failed).
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten

# distinct input shapes (keys) recorded per graph; more run as plain launches, with a warning
MAX_SHAPES = 16
# recordings made again for one shape (outputs held, parameters moved) before giving up on it
MAX_RERECORDS = 4

STATIC, POOL, COPY, VALUE, HOST = "static", "pool", "copy", "value", "host scalar"
HAND_OUT, HOLD, CLONE = "hand out", "hold", "clone"

# Ops that cannot be captured, with why (keyed by overload packet; names a torch lacks are skipped).
NOT_CAPTURABLE: dict[Any, str] = {getattr(aten, name): reason for name, reason in (
    ("_local_scalar_dense", "reads a tensor's value on the host (.item()), which synchronizes"),
    ("nonzero", "has a data-dependent output shape (nonzero)"),
    ("masked_select", "has a data-dependent output shape (masked_select)"),
    ("unique_consecutive", "has a data-dependent output shape (unique_consecutive)"),
    ("_unique2", "has a data-dependent output shape (unique)"),
    ("equal", "returns a host bool (equal), which synchronizes"),
    ("is_nonzero", "returns a host bool (is_nonzero), which synchronizes"),
    ("_assert_async", "checks a value on the device with a synchronizing assert"),
) if hasattr(aten, name)}
# Ops that read or set the generator's state on the host (the "eager" RNG scheme of
# aot/rng.py): a replay would repeat the recorded state instead of advancing it.
_RNG_STATE_OPS = ("run_and_save_rng_state", "run_with_rng_state", "dropout_saving_state", "dropout_at_state")

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


# --- decisions that need only the graph ------------------------------------------------------

def capture_blocker(gm: fx.GraphModule) -> Optional[str]:
    """Why ``gm`` cannot be replayed as a CUDA graph, or None."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, torch.Tensor) and item.device.type != "cuda" and not _host_scalar(item):
                where = "an input" if node.op == "placeholder" else f"node {node.name}"
                return f"{where} is a {item.device.type.upper()} tensor (CUDA graphs replay GPU work only)"
            if isinstance(item, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(item):
                return f"node {node.name} has a data-dependent shape or value"
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if any(rng in name for rng in _RNG_STATE_OPS):
            return (f"node {node.name} reads the random generator's state on the host ({name}); "
                    "functionalized RNG with aotforge.config.fallback_random=False keeps it on the device")
        packet = getattr(node.target, "overloadpacket", None)
        if packet in (aten._to_copy, aten.copy, aten.copy_) and _copies_host_to_device(node):
            return f"node {node.name} copies a CPU tensor to the GPU (a replay would not read it again)"
        if packet is aten._local_scalar_dense and _host_scalar(_value(node.args[0])):
            continue  # a host scalar's value: part of the recording's key
        reason = NOT_CAPTURABLE.get(packet)
        if reason:
            return f"node {node.name} {reason}"
    return None


def _value(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _host_scalar(value: Any) -> bool:
    """A 0-d CPU tensor (Dynamo passes unspecialized floats so): ATen reads it on the host
    as a number, so a recording is keyed by its value like any number."""
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0


def _copies_host_to_device(node: fx.Node) -> bool:
    sources = [_value(a) for a in node.args if isinstance(a, fx.Node)]
    target = _value(node)
    return (isinstance(target, torch.Tensor) and target.device.type == "cuda"
            and any(isinstance(s, torch.Tensor) and s.device.type == "cpu" for s in sources))


def mutated_inputs(gm: fx.GraphModule) -> list[int]:
    """Placeholders that the graph writes into (``copy_`` of a kept mutation, in-place ops),
    directly or through views: their static buffers are copied back after a replay."""
    placeholders = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    found = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            while isinstance(target, fx.Node) and target.op == "call_function" and _is_view(target.target):
                target = target.args[0]
            if target in placeholders:
                found.add(placeholders[target])
    return sorted(found)


def _is_view(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


# --- capture backends ---------------------------------------------------------------------------

class CudaCapture:
    """Records with ``torch.cuda.graph`` (a private memory pool per recording)."""

    def unsupported(self, value: torch.Tensor) -> Optional[str]:
        if value.is_cuda or _host_scalar(value):
            return None
        return f"an input is a {value.device.type.upper()} tensor at run time"

    def host_scalar(self, value: torch.Tensor) -> bool:
        return _host_scalar(value)

    def capture(self, run: Callable[[list], Any], static_args: list) -> tuple[Any, list]:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads' CUDA calls (a data loader pinning memory) stay legal
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = list(run(list(static_args)))
        except Exception:
            _end_generator_capture()
            raise
        return graph, outputs

    def replay(self, graph: Any, args: Optional[list]) -> None:
        graph.replay()

    # a replay reads the addresses recorded: it needs no arguments
    needs_args = False


def _end_generator_capture() -> None:
    """A failed capture leaves the CUDA generator in capture mode (``capture_end`` stops at the
    failed stream capture, before the generators' epilogue), and the next random op raises
    "Offset increment outside graph capture". A small capture that succeeds ends that mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
                torch.zeros(1, device="cuda").add_(1)
        except Exception:  # noqa: BLE001  (best effort: the original error is what the user sees)
            pass


# --- the record ---------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Recording:
    """One captured graph: what it reads, where its outputs live, who may hold them."""

    key: tuple
    handle: Any                          # the captured graph
    static_args: list                    # per input: the tensor the graph reads, or the value
    copies: list                         # (position, static buffer, span copy?) for copy inputs
    static_ptrs: list                    # (position, address) for static inputs
    address_check: tuple                 # (addresses by position, positions): the same, for one C++ call
    producers: list                      # recordings whose outputs this one reads in place
    outputs: list                        # the graph's outputs (pool memory)
    storages: list                       # (storage handle, use count of ours, output positions)
    policy: list                         # per output: HAND_OUT | HOLD | CLONE
    input_aliases: set                   # outputs that alias an input read in place
    passed_through: dict                 # output -> copied input it is (the caller's tensor is returned)
    pool_inputs: int                     # inputs read in place from other recordings' pools
    held: list = dataclasses.field(default_factory=list)
    consumers: list = dataclasses.field(default_factory=list)  # (CudaGraphs, Recording)
    replays: int = 0
    valid: bool = True

    def describe(self) -> str:
        policies = collections.Counter(self.policy)
        return (f"replays {self.replays}, {len(self.copies)} inputs copied, {len(self.static_ptrs)} static, "
                f"{self.pool_inputs} from other graphs' pools; outputs: " +
                ", ".join(f"{n} {p}" for p, n in sorted(policies.items())) +
                (f" ({len(self.passed_through)} of them the caller's inputs)" if self.passed_through else ""))


# outputs of live recordings by address: inputs found here are read in place ("pool"); weak,
# so that a graph Dynamo dropped takes its recordings' memory with it
_pool_outputs: "weakref.WeakValueDictionary[int, Recording]" = weakref.WeakValueDictionary()

# how many references a storage has (ours included): whether a caller still holds an output
_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)


class CudaGraphs:
    """A boxed callable that runs ``run`` through CUDA graphs, and the record of doing so
    (``print(wrapper)``): input kinds, recordings per shape, output policies, what happened."""

    def __init__(self, run: Callable[[list], Any], kind: str, *, mutated: Sequence[int] = (),
                 static: Sequence[int] = (), blocker: Optional[str] = None, capture: Any = None) -> None:
        self.run = run
        self.kind = kind
        self.mutated = set(mutated)
        self.declared_static = set(static)
        self.capture = capture if capture is not None else CudaCapture()
        self.disabled = blocker            # why this graph runs without CUDA graphs
        self.kinds: Optional[list[str]] = None
        self.final = False                 # pool/copy decided (at the first recording)
        self.keyed: list[tuple[int, str]] = []
        self.recordings: dict[tuple, Recording] = {}
        self.warm: dict[tuple, list] = {}  # shape key -> output policy for its next recording
        self.rerecords: collections.Counter = collections.Counter()
        self.given_up: set = set()
        self.counts: collections.Counter = collections.Counter()
        self.events: collections.deque = collections.deque(maxlen=12)
        self._boxed_call = True
        if blocker:
            self._disable(blocker, warn=True)

    # --- printing ---------------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [f"CUDA graphs of the {self.kind} graph: " +
                 (f"off ({self.disabled})" if self.disabled else f"{len(self.recordings)} recording(s)")]
        if self.kinds is not None:
            kinds = collections.Counter(self.kinds)
            lines.append("  inputs: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) +
                         ("" if self.final else " (pool/copy decided at the first recording)"))
        if self.mutated:
            lines.append(f"  inputs written by the graph (copied back): {sorted(self.mutated)}")
        for key, recording in self.recordings.items():
            lines.append(f"  shape {_short(key)}: {recording.describe()}")
        if self.counts:
            lines.append("  calls: " + ", ".join(f"{name} {n}" for name, n in sorted(self.counts.items())))
        lines.extend(f"  - {event}" for event in self.events)
        return "\n".join(lines)

    __repr__ = __str__

    def _event(self, text: str) -> None:
        self.events.append(text)

    def _disable(self, reason: str, warn: bool) -> None:
        self.disabled = reason
        self._event(f"off: {reason}")
        if warn:
            _warn_once(f"aotforge: a compiled {self.kind} graph runs without CUDA graphs: {reason}")

    # --- the call ---------------------------------------------------------------------------

    def __call__(self, args: list) -> Any:
        if self.disabled:
            return self.run(args)
        if self.kinds is None and not self._classify(args):
            return self.run(args)
        key = self._key(args)
        if key is None:
            self.counts["plain: input not from a recorded graph"] += 1
            return self.run(args)
        shape_key, _ = key
        recording = self.recordings.get(key)
        if recording is not None:
            reason = self._why_not_replay(recording, args)
            if reason is None:
                return self._replay(recording, args)
            self._retire(recording, reason)
            self.counts["plain: " + reason.split(":")[0]] += 1
            return self._warm_up(args, counted=True)
        if shape_key in self.given_up:
            self.counts["plain: gave up on this shape"] += 1
            return self.run(args)
        if shape_key in self.warm:
            return self._record(key, args)
        if len(self.warm) >= MAX_SHAPES:
            self.counts["plain: over the shape limit"] += 1
            _warn_once(f"aotforge: a compiled {self.kind} graph was called with more than {MAX_SHAPES} input shapes; "
                       "new shapes run without CUDA graphs (mark the varying dimension dynamic, or pad inputs "
                       "to a few sizes)")
            return self.run(args)
        self.warm[shape_key] = None  # output policy: all handed out, until a caller holds one
        return self._warm_up(args)

    # --- inputs -------------------------------------------------------------------------------

    def _classify(self, args: list) -> bool:
        kinds = []
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                reason = self.capture.unsupported(value)
                if reason:
                    self._disable(f"{reason} (input {i})", warn=True)
                    return False
                static = i in self.declared_static or isinstance(value, torch.nn.Parameter)
                host = getattr(self.capture, "host_scalar", lambda v: False)(value)
                kinds.append(HOST if host else STATIC if static else COPY)
            else:
                kinds.append(VALUE)
        self.kinds = kinds
        self.keyed = [(i, k) for i, k in enumerate(kinds) if k != STATIC]
        return True

    def _finalize_kinds(self, args: list) -> None:
        """At the first recording: tensors that are outputs of a live recording are read in
        place from its pool (the backward reading the forward's saved activations)."""
        for i, kind in enumerate(self.kinds):
            if kind == COPY and args[i].data_ptr() in _pool_outputs:
                self.kinds[i] = POOL
        self.keyed = [(i, k) for i, k in enumerate(self.kinds) if k != STATIC]
        self.final = True

    def _key(self, args: list) -> Optional[tuple]:
        """(shape key, pool addresses), or None when a pool input is not in a live pool."""
        shapes, pool = [], []
        for i, kind in self.keyed:
            value = args[i]
            if kind == COPY:
                if not isinstance(value, torch.Tensor):
                    return None
                shapes.append((value.shape, value.stride(), value.dtype))
            elif kind == VALUE:
                if isinstance(value, torch.Tensor):
                    return None
                shapes.append(value if _hashable(value) else repr(value))
            elif kind == HOST:
                if not _host_scalar(value):
                    return None
                shapes.append((value.item(), value.dtype))
            else:
                if not isinstance(value, torch.Tensor):
                    return None
                pointer = value.data_ptr()
                if pointer not in _pool_outputs:
                    return None
                pool.append(pointer)
        return tuple(shapes), tuple(pool)

    def _why_not_replay(self, recording: Recording, args: list) -> Optional[str]:
        for producer in recording.producers:
            if not producer.valid:
                return "re-recorded: the graph producing its inputs was recorded again"
        if recording.static_ptrs and not _same_addresses(args, recording):
            moved = [i for i, pointer in recording.static_ptrs if not _at(args[i], pointer)]
            return (f"static input moved: input(s) {moved} changed address (a replaced parameter, "
                    "load_state_dict(assign=True)); recording again")
        recording.held.clear()  # ours: autograd has used them
        alive = [positions for storage, ours, positions in recording.storages if _use_count(storage) > ours]
        if alive:
            held = sorted(p for positions in alive for p in positions)
            escalate = HOLD if self.kind == "backward" else CLONE
            policy = list(recording.policy)
            for p in held:
                policy[p] = CLONE if policy[p] != HAND_OUT else escalate
            self.warm[recording.key[0]] = policy
            return (f"outputs in use: output(s) {held} of the previous replay are still held; "
                    f"their memory is the holder's now, and the next recording will "
                    f"{'/'.join(sorted({policy[p] for p in held}))} them")
        return None

    # --- warm-up, recording, replay ------------------------------------------------------------

    def _warm_up(self, args: list, counted: bool = False) -> Any:
        """A plain run, with misaligned inputs moved to aligned memory first: the kernels then
        compile (and autotune) for the layouts the recording will read, before capture."""
        if not counted:
            self.counts["plain: warm-up"] += 1
        run_args = list(args)
        written = []
        for i, kind in self.keyed:
            value = run_args[i]
            if kind in (COPY, POOL) and isinstance(value, torch.Tensor) and value.data_ptr() % 16:
                run_args[i] = _static_like(value)[0]
                _copy_in(run_args[i], value, _overlaps(value))
                if i in self.mutated:
                    written.append((value, run_args[i]))
        args.clear()
        outputs = self.run(run_args)
        for original, buffer in written:
            original.copy_(buffer)
        return outputs

    def _record(self, key: tuple, args: list) -> Any:
        if not self.final:
            policy = self.warm.pop(key[0], None)
            self._finalize_kinds(args)
            key = self._key(args)
            if key is None:  # cannot happen: pool inputs were just found in the registry
                return self.run(args)
            self.warm[key[0]] = policy
        policy = self.warm.get(key[0])
        static_args = list(args)
        copies, static_ptrs, producers, read_in_place = [], [], [], set()
        for i, kind in enumerate(self.kinds):
            value = args[i]
            if kind == COPY:
                buffer, _ = _static_like(value)
                span = _overlaps(value)
                _copy_in(buffer, value, span)
                static_args[i] = buffer
                copies.append((i, buffer, span))
            elif kind == STATIC:
                static_ptrs.append((i, value.data_ptr()))
                read_in_place.add(_storage(value))
            elif kind == POOL:
                producer = _pool_outputs[value.data_ptr()]
                if producer not in producers:
                    producers.append(producer)
                read_in_place.add(_storage(value))
        try:
            handle, outputs = self.capture.capture(self.run, static_args)
        except Exception as error:  # noqa: BLE001  (any failure: the graph runs as plain launches)
            self._disable(f"capturing it failed ({type(error).__name__}: {str(error).splitlines()[0][:300]})",
                          warn=True)
            return self.run(args)
        # keep only our buffers: a reference to a caller's tensor would keep it (and the
        # recording that produced it) in use
        static_args = [a if self.kinds[i] in (COPY, VALUE) else None for i, a in enumerate(static_args)]
        copied = {_storage(buffer): i for i, buffer, _ in copies}
        if policy is None or len(policy) != len(outputs):
            policy = [HAND_OUT] * len(outputs)
        policy = list(policy)
        input_aliases, passed_through = set(), {}
        by_storage: dict[int, list[int]] = {}
        for position, output in enumerate(outputs):
            if not isinstance(output, torch.Tensor):
                continue
            storage = _storage(output)
            if storage in copied and _same_layout(output, static_args[copied[storage]]):
                passed_through[position] = copied[storage]  # the graph returns an input: the caller's
            elif storage in copied:
                policy[position] = CLONE  # never hand out our input buffers
            elif storage in read_in_place:
                input_aliases.add(position)  # a view of the caller's tensor, as eager's
            else:
                by_storage.setdefault(storage, []).append(position)
        storages = [(storage, _use_count(storage), tuple(positions)) for storage, positions in by_storage.items()]
        recording = Recording(key, handle, static_args, copies, static_ptrs, _address_check(len(args), static_ptrs),
                              producers, outputs, storages, policy, input_aliases, passed_through,
                              self.kinds.count(POOL))
        for positions in by_storage.values():
            for position in positions:
                _pool_outputs[outputs[position].data_ptr()] = recording
        for producer in producers:
            producer.consumers.append((self, recording))
        self.recordings[key] = recording
        self.counts["recordings"] += 1
        return self._replay(recording, args, copied=True)

    def _replay(self, recording: Recording, args: list, copied: bool = False) -> Any:
        written = [(args[i], buffer) for i, buffer, _ in recording.copies if i in self.mutated]
        if not copied:
            for i, buffer, span in recording.copies:
                _copy_in(buffer, args[i], span)
        current = None
        if self.capture.needs_args:
            current = [a if b is None else b for a, b in zip(args, recording.static_args)]
        passed = {position: args[i] for position, i in recording.passed_through.items()}
        args.clear()
        self.capture.replay(recording.handle, current)
        current = None
        for original, buffer in written:
            original.copy_(buffer)
        recording.replays += 1
        self.counts["replays"] += 1
        results = []
        for output, policy in zip(recording.outputs, recording.policy):
            if not isinstance(output, torch.Tensor):
                results.append(output)
            elif passed and len(results) in passed:
                results.append(passed[len(results)])
            elif policy == CLONE:
                results.append(output.clone())
            else:
                alias = output.detach()
                if policy == HOLD:
                    recording.held.append(alias)
                results.append(alias)
        return results

    def _retire(self, recording: Recording, reason: str) -> None:
        """Drop a recording; its pool stays alive as long as someone holds an output."""
        self._event(reason)
        self._drop(recording)
        shape_key = recording.key[0]
        self.rerecords[shape_key] += 1
        if self.rerecords[shape_key] > MAX_RERECORDS:
            self.given_up.add(shape_key)
            _warn_once(f"aotforge: a compiled {self.kind} graph was recorded {MAX_RERECORDS + 1} times for one input "
                       f"shape and now runs without CUDA graphs for it; last reason: {reason}")
        self.warm.setdefault(shape_key, None)

    def _drop(self, recording: Recording) -> None:
        recording.valid = False
        if self.recordings.get(recording.key) is recording:
            del self.recordings[recording.key]
        for output in recording.outputs:
            if isinstance(output, torch.Tensor) and _pool_outputs.get(output.data_ptr()) is recording:
                del _pool_outputs[output.data_ptr()]
        for wrapper, consumer in recording.consumers:
            if consumer.valid:
                wrapper._drop(consumer)
        recording.consumers.clear()
        recording.handle = recording.outputs = recording.static_args = None
        recording.copies, recording.held = [], []


# --- tensors ----------------------------------------------------------------------------------

def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _at(value: Any, pointer: int) -> bool:
    return isinstance(value, torch.Tensor) and value.data_ptr() == pointer


_addresses_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _same_addresses(args: list, recording: Recording) -> bool:
    if _addresses_equal is not None:
        try:
            return _addresses_equal(args, *recording.address_check)
        except (TypeError, RuntimeError):
            pass
    return all(_at(args[i], pointer) for i, pointer in recording.static_ptrs)


def _address_check(count: int, static_ptrs: list) -> tuple:
    pointers: list = [None] * count
    for i, pointer in static_ptrs:
        pointers[i] = pointer
    return pointers, [i for i, _ in static_ptrs]


def _span(tensor: torch.Tensor) -> int:
    """Elements from the first to the last one the tensor addresses."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def _overlaps(tensor: torch.Tensor) -> bool:
    """Expanded (stride 0) or self-overlapping: such a layout cannot be written element by
    element, so its memory span is copied instead."""
    return tensor.numel() > 1 and torch._debug_has_internal_overlap(tensor) != 0


def _static_like(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of the same shape and strides in fresh, aligned memory (and its flat base)."""
    base = torch.empty(_span(tensor), dtype=tensor.dtype, device=tensor.device)
    return base.as_strided(tensor.shape, tensor.stride(), 0), base


def _copy_in(buffer: torch.Tensor, value: torch.Tensor, span: bool) -> None:
    if span:
        count = _span(value)
        buffer.as_strided((count,), (1,), 0).copy_(value.as_strided((count,), (1,)))
    else:
        buffer.copy_(value)


def _short(key: tuple) -> str:
    shapes, pool = key
    parts = [f"{tuple(s[0])}" if isinstance(s, tuple) and s and isinstance(s[0], torch.Size) else repr(s)
             for s in shapes]
    text = "[" + ", ".join(parts) + "]"
    return text + (f" + {len(pool)} pool inputs" if pool else "")


# --- the hook -----------------------------------------------------------------------------------

def wrap(run: Callable[[list], Any], gm: fx.GraphModule, kind: str,
         static: Sequence[int] = ()) -> Callable[[list], Any]:
    """``run`` (a boxed compiled graph, of any compiler) through CUDA graphs when
    ``config.cudagraphs`` is on and the graph runs on the GPU; ``run`` itself otherwise.
    ``static``: inputs whose address never changes besides parameters (which are found)."""
    from ...config import config

    if not config.cudagraphs:
        return run
    devices = {v.device.type for node in gm.graph.nodes
               for v in _values(node.meta.get("val")) if isinstance(v, torch.Tensor)}
    if "cuda" not in devices:
        nothing_to_do_on_cpu()
        return run
    if _use_count is None:
        _warn_once("aotforge: CUDA graphs need torch._C._storage_Use_Count (to tell whether a caller still "
                   f"holds an output), which torch {torch.__version__} lacks; graphs run as compiled")
        return run
    return CudaGraphs(run, kind, mutated=mutated_inputs(gm), static=static, blocker=capture_blocker(gm))


def wrap_compiled(compiled: Any, gm: fx.GraphModule) -> Any:
    """A ``CompiledGraph`` whose call replays CUDA graphs (``wrap``), with their record."""
    call = wrap(compiled.call, gm, compiled.kind)
    if call is compiled.call:
        return compiled
    return dataclasses.replace(compiled, call=call, cudagraphs=call)


def nothing_to_do_on_cpu() -> None:
    _warn_once("aotforge: CUDA graphs (mode='reduce-overhead', aotforge.config.cudagraphs) have nothing to "
               "do for graphs on the CPU; they run as compiled")


def _values(value: Any) -> Sequence:
    return value if isinstance(value, (list, tuple)) else [value]
