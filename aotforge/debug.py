"""What aotforge did, made visible.

``AOTFORGE_LOG=graphs,partition,...`` prints the named artifacts to stderr (``all``: every
topic; ``TOPICS`` lists them). ``AOTFORGE_DUMP_DIR=dir`` writes each artifact to
``dir/<pid>/<compile id>_<name>/NNN_<artifact>``: one folder per process and per compile, so
nothing is overwritten and the stages of one compile read in order. Under ``TORCH_TRACE=dir``
every artifact also goes to PyTorch's structured trace, so ``tlparse`` shows aotforge's graphs,
kernels and metrics beside Dynamo's.

A *compile scope* groups the artifacts of one compile: the torch.compile backend opens one per
Dynamo graph (``compile_scope``), the AOT layer one per compile outside torch.compile
(``ensure_scope``: nothing of a compile stays in the thread after it); a compile that opens
none starts an implicit scope at its first artifact of topic ``metadata``. The scope also
keeps the artifacts for ``aotforge.inspect``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable, Iterator, Optional

from .config import did_you_mean

log = logging.getLogger("aotforge")

# Every topic AOTFORGE_LOG accepts, with what it prints.
TOPICS: dict[str, str] = {
    "graphs": "the AOT joint, forward, backward and inference graphs; the compiler's post-grad graphs",
    "metadata": "which inputs each compile mutates and what each output aliases",
    "partition": "what the min-cut partitioner saves for the backward and what it recomputes",
    "lowering": "ops whose lowering failed (they run as ATen extern calls)",
    "ir": "the compiler's lowered loop IR, kernel plan and memory plan, per graph",
    "output_code": "generated kernels and the wrapper program",
    "compile": "how torch.compile routed each graph (and why nothing was fused on CPU); each CPU "
               "convolution's layout, with its timings",
    "compile_time": "seconds per compile stage, per graph",
    "recompiles": "why a function was compiled again: which part of its input signature changed "
                  "(under torch.compile also Dynamo's guard failure)",
    "verify": "AOTFORGE_VERIFY's comparison of each compiled graph with plain ATen",
    "cache": "compiled-graph and AOT cache hits and misses, and for a miss which part of the key changed",
}

# Topics that print nothing for graphs on CPU tensors (they run as eager's ATen calls, which
# skip the min-cut partitioner and the compiler), with why; said once per topic and process.
SILENT_ON_CPU: dict[str, str] = {
    "partition": "they use the default partition (save what eager saves), not min-cut",
    "lowering": "nothing is lowered",
    "ir": "nothing is lowered, so there is no loop IR",
    "output_code": "no kernels or wrapper are generated",
    "compile_time": "there are no compiler stages to time",
    "verify": "there is no generated code to check against ATen",
}

_local = threading.local()
_compile_counter = itertools.count()
_parsed: dict[str, frozenset] = {}
_logged_once: set[str] = set()
_lock = threading.Lock()
_DYNAMO_PREFIX = "dynamo_graph_"  # the AOT layer's name for graphs handed over by Dynamo


def _enabled_topics() -> frozenset:
    raw = os.environ.get("AOTFORGE_LOG", "")
    topics = _parsed.get(raw)
    if topics is None:
        topics = frozenset(part.strip() for part in raw.split(",") if part.strip())
        unknown = sorted(topics - set(TOPICS) - {"all"})
        if unknown:
            warn_user(f"AOTFORGE_LOG: unknown topic(s) {unknown}"
                      f"{did_you_mean(unknown, TOPICS)}; valid topics: all, "
                      + ", ".join(sorted(TOPICS)))
        _parsed[raw] = topics
    return topics


def enabled(topic: str) -> bool:
    topics = _enabled_topics()
    return topic in topics or "all" in topics


def dump_dir() -> str | None:
    """AOTFORGE_DUMP_DIR, or None when unset or when it names something other than a folder
    (warned once: a dump folder that cannot be used costs the dump, never the compile)."""
    base = os.environ.get("AOTFORGE_DUMP_DIR") or None
    if base is not None and os.path.exists(base) and not os.path.isdir(base):
        _dump_dir_unusable(base, "it is not a directory")
        return None
    return base


def _dump_dir_unusable(base: str, why: str) -> None:
    with _lock:
        if f"dump_dir:{base}" in _logged_once:
            return
        _logged_once.add(f"dump_dir:{base}")
    warnings.warn(f"aotforge: AOTFORGE_DUMP_DIR={base!r} cannot be used ({why}); artifacts are not written "
                  "there. Point it at a folder (it is created when missing)", stacklevel=4)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class CompileScope:
    """The artifacts of one compile, in order, and its dump folder (made on first write)."""

    def __init__(self, name: str, compile_id: Optional[str] = None, dynamo_compile_id: Any = None):
        self.index = next(_compile_counter)
        self.name = name
        self.compile_id = compile_id or str(self.index)
        # Dynamo's CompileId: artifacts emitted after the compile (the first run's timings)
        # still reach TORCH_TRACE under it, so that tlparse shows them with that compile.
        self.dynamo_compile_id = dynamo_compile_id
        self.artifacts: list[tuple[str, str, Any]] = []  # (topic, name, text or GraphModule)
        self._folders: dict[str, str] = {}  # per dump dir: AOTFORGE_DUMP_DIR may change meanwhile
        self._file_counter = itertools.count()

    def folder(self, base: str) -> str:
        if base not in self._folders:
            process = os.path.join(base, str(os.getpid()))
            os.makedirs(process, exist_ok=True)
            for attempt in itertools.count():
                # A folder left by an earlier process with the same pid is never reused.
                suffix = f"_{attempt}" if attempt else ""
                path = os.path.join(process, f"{self.index:03d}{suffix}_{_safe(self.name)}")
                try:
                    os.makedirs(path)
                    break
                except FileExistsError:
                    continue
            self._folders[base] = path
        return self._folders[base]

    def write(self, name: str, text: str, suffix: str) -> Optional[str]:
        base = dump_dir()
        assert base is not None
        # The folder already names the model; graphs from Dynamo are all "dynamo_graph_*".
        if name.startswith(_DYNAMO_PREFIX) and len(name) > len(_DYNAMO_PREFIX):
            name = name[len(_DYNAMO_PREFIX):]
        try:
            path = os.path.join(self.folder(base), f"{next(self._file_counter):03d}_{_safe(name)}{suffix}")
            with open(path, "w") as handle:
                handle.write(text)
        except OSError as error:  # a full disk, a folder we may not write: the dump is lost, not the compile
            _dump_dir_unusable(base, str(error))
            return None
        return path


def current_scope() -> Optional[CompileScope]:
    return getattr(_local, "scope", None)


def compile_name() -> Optional[str]:
    """The name of the compile scope opened around this code (not an implicit one)."""
    scope = current_scope()
    return scope.name if scope is not None and getattr(_local, "explicit", 0) else None


@contextlib.contextmanager
def compile_scope(name: str, compile_id: Optional[str] = None,
                  scope: Optional[CompileScope] = None,
                  dynamo_compile_id: Any = None) -> Iterator[CompileScope]:
    """Group the artifacts emitted inside the block as one compile (``scope``: re-enter an
    earlier compile's scope, e.g. for its backward compiled later)."""
    scope = scope if scope is not None else CompileScope(name, compile_id, dynamo_compile_id)
    previous = current_scope()
    _local.scope = scope
    _local.explicit = getattr(_local, "explicit", 0) + 1
    try:
        yield scope
    finally:
        _local.scope = previous
        _local.explicit -= 1


@contextlib.contextmanager
def ensure_scope(name: str) -> Iterator[CompileScope]:
    """The compile scope open in this thread (torch.compile's, per Dynamo graph), or a new one
    for the block. Either way nothing of the compile stays in the thread afterwards: its
    artifacts (graphs and the tensors they hold) live only as long as whoever keeps the scope
    (a compiled function's lazy backward, ``aotforge.inspect``'s records)."""
    if getattr(_local, "explicit", 0):
        yield current_scope()
        return
    with compile_scope(name) as scope:
        yield scope


def rejoin(scope: Optional[CompileScope]) -> contextlib.AbstractContextManager:
    """Re-enter ``scope`` (a compile's, saved at compile time) for artifacts emitted later,
    e.g. timings measured at a compiled graph's first run; nothing if there is none."""
    if scope is None:
        return contextlib.nullcontext()
    return compile_scope(scope.name, scope=scope)


def _scope_for(topic: str, name: str) -> CompileScope:
    scope = current_scope()
    if getattr(_local, "explicit", 0) == 0 and (scope is None or topic == "metadata"):
        # No compile opened a scope: each AOT compile starts with its metadata artifact.
        base = name[: -len("_metadata")] if name.endswith("_metadata") else name
        scope = CompileScope(base)
        _local.scope = scope
    return scope


def _trace_structured(kind: str, name: str, payload_fn, scope: Optional[CompileScope] = None) -> None:
    """Send an artifact to TORCH_TRACE (tlparse's input), if this torch has it and it is on.
    Inside a Dynamo compile torch adds the compile id itself; after it (a graph's first run)
    the scope's saved id is passed."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # a torch without structured tracing
        return
    metadata = {"name": f"aotforge_{name}"}
    if kind == "artifact":
        metadata["encoding"] = "string"
    compile_id = getattr(scope, "dynamo_compile_id", None)
    extra = {"compile_id": compile_id} if compile_id is not None else {}
    try:
        trace_structured(kind, metadata_fn=lambda: metadata, payload_fn=payload_fn,
                         expect_trace_id=False, **extra)
    except TypeError:  # older signature without expect_trace_id / compile_id
        trace_structured(kind, metadata_fn=lambda: metadata, payload_fn=payload_fn)


def artifact(topic: str, name: str, text: "str | Callable[[], str]", suffix: str = ".py") -> None:
    """Print ``text`` if ``topic`` is being logged, write it to the dump dir if set, send it
    to TORCH_TRACE, and keep it in the current compile scope (for ``aotforge.inspect``).
    ``text`` may be a function making it, called only when one of those reads it: printing
    ResNet-18's lowered IR took 3 s of a 15 s compile that nobody asked to see."""
    scope = _scope_for(topic, name)
    if callable(text):
        text = LazyText(text)
    scope.artifacts.append((topic, name, text))
    if enabled(topic):
        print(f"===== aotforge {topic}: {name} =====\n{text}", file=sys.stderr)
    if dump_dir():
        scope.write(name, str(text), suffix)
    _trace_structured("artifact", name, lambda: str(text), scope)


class LazyText:
    """A text made when first read (``str()``), once."""

    def __init__(self, make: "Callable[[], str]"):
        self._make, self._text = make, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._make()
        return self._text


def user_frame(stack_trace: str) -> str:
    """``File "f.py", line 3, in fn: code`` for the innermost frame of a node's stack trace."""
    lines = [line.strip() for line in stack_trace.strip().splitlines()]
    files = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not files:
        return lines[-1] if lines else ""
    index = files[-1]
    code = lines[index + 1] if index + 1 < len(lines) else ""
    return f"{lines[index]}: {code}"


def graph_text(gm) -> str:
    try:
        return gm.print_readable(print_output=False)
    except Exception:  # a graph without metadata still prints as plain code
        return gm.code


def graph_artifact(topic: str, name: str, gm) -> None:
    """Log an FX GraphModule's readable code (with shapes) under ``topic``."""
    scope = _scope_for(topic, name)
    scope.artifacts.append((topic, name, gm))
    wanted = enabled(topic) or dump_dir()
    text = graph_text(gm) if wanted else None
    if enabled(topic):
        print(f"===== aotforge {topic}: {name} =====\n{text}", file=sys.stderr)
    if dump_dir():
        scope.write(name, text, ".py")
    _trace_structured("graph_dump", name, lambda: text if text is not None else graph_text(gm), scope)


def metrics(name: str, values: dict) -> None:
    """Compile metrics (seconds per stage, counts): logged under ``compile_time`` and sent to
    TORCH_TRACE as JSON."""
    text = json.dumps(values, indent=1, sort_keys=True, default=str)
    artifact("compile_time", name, text, suffix=".json")


def log_once(topic: str, key: str, message: str, key_per_topic: bool = False) -> None:
    """Print ``message`` under ``topic`` the first time ``key`` is seen in this process."""
    if key_per_topic:
        key = f"{topic}:{key}"
    with _lock:
        if key in _logged_once:
            return
        _logged_once.add(key)
    if enabled(topic):
        print(f"aotforge {topic}: {message}", file=sys.stderr)
    log.info("%s", message)
    _trace_structured("artifact", f"{topic}_{_safe(key)}", lambda: message)


def explain_silent_topics_on_cpu() -> None:
    """For each enabled topic that prints nothing for CPU graphs: say why, once."""
    for topic, why in SILENT_ON_CPU.items():
        if enabled(topic):
            log_once(topic, "silent_on_cpu", f"nothing to print for graphs on CPU tensors: they "
                     f"run as eager's ATen calls and {why} (this topic prints for CUDA tensors)",
                     key_per_topic=True)


@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple[str, ...]:
    """aotforge's and torch's folders: frames inside them are never the user's line."""
    import torch

    return tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


@functools.lru_cache(maxsize=1024)
def _is_library_frame(filename: str) -> bool:
    if filename.startswith("<frozen "):
        return True  # importlib's bootstrap (an import that warns)
    return os.path.abspath(filename).startswith(_library_dirs())


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller point at the first
    frame outside aotforge and torch (the user's line, e.g. the call of a compiled model);
    the outermost frame when every frame is the library's (a backward in autograd's thread)."""
    frame = sys._getframe(2)  # the caller of the function that asks
    level = 2
    while _is_library_frame(frame.f_code.co_filename) and frame.f_back is not None:
        frame = frame.f_back
        # warnings.warn does not count importlib's frames (an import that warns): nor here.
        if not _is_importlib_frame(frame.f_code.co_filename):
            level += 1
    return level


def _is_importlib_frame(filename: str) -> bool:
    return "importlib" in filename and "_bootstrap" in filename


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line rather than aotforge's or torch's."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def note(topic: str, message: str) -> None:
    """Print ``message`` under ``topic`` (every time) if that topic is being logged."""
    if enabled(topic):
        print(f"aotforge {topic}: {message}", file=sys.stderr)
    log.debug("%s", message)


_enabled_topics()  # a typo in AOTFORGE_LOG is reported at import, not at the first compile
