"""What aotforge did, made visible.

``AOTFORGE_LOG=graphs,partition,...`` prints the named artifacts to stderr;
``AOTFORGE_LOG=all`` prints every one. ``AOTFORGE_DUMP_DIR=dir`` writes each artifact to a
numbered file in ``dir`` (``003_forward.py``), so the stages of one compile read in order.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys

log = logging.getLogger("aotforge")
_counter = itertools.count()


def _enabled_topics() -> set[str]:
    raw = os.environ.get("AOTFORGE_LOG", "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def enabled(topic: str) -> bool:
    topics = _enabled_topics()
    return topic in topics or "all" in topics


def dump_dir() -> str | None:
    return os.environ.get("AOTFORGE_DUMP_DIR") or None


def artifact(topic: str, name: str, text: str, suffix: str = ".py") -> None:
    """Print ``text`` if ``topic`` is being logged and write it to the dump dir if set."""
    if enabled(topic):
        print(f"===== aotforge {topic}: {name} =====\n{text}", file=sys.stderr)
    directory = dump_dir()
    if directory:
        os.makedirs(directory, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        path = os.path.join(directory, f"{next(_counter):03d}_{safe}{suffix}")
        with open(path, "w") as handle:
            handle.write(text)


def graph_artifact(topic: str, name: str, gm) -> None:
    """Log an FX GraphModule's readable code (with shapes) under ``topic``."""
    if not (enabled(topic) or dump_dir()):
        return
    try:
        text = gm.print_readable(print_output=False)
    except Exception:  # a graph without metadata still prints as plain code
        text = gm.code
    artifact(topic, name, text)
