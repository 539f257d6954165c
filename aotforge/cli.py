"""Command line: ``python -m aotforge demo | bench | explain | cache``."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("aotforge.demo", "train a small model eagerly and through torch.compile(backend=\"aotforge\"); "
                              "compare losses and step times, say what the compiler did"),
    "bench": ("aotforge.bench", "benchmark eager vs torch.compile (inductor) vs aotforge"),
    "explain": ("aotforge.explain", "print a model's exported forward/backward graphs"),
    "cache": ("aotforge.compiler.runtime.cache_cli", "info | clear: the on-disk cache's entries per kind"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="python -m aotforge")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text)
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}")
        parser.print_help()
        return 0 if argv else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)
