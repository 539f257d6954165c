"""(Run as a script by test_aot_cache_kinds.py, one fresh process per run.) Compile a small MLP
with dropout, run one training step, and print one JSON line: aotforge's seconds to the first
result, the output and the gradients (as lists), and the cache log.

    python warm_start_worker.py PATH CACHE_DIR   # PATH: compile | dynamic | aot_function |
                                                 #       function | function_dynamic

"aotforge's seconds": under torch.compile, the seconds spent in the backend and in the first
calls of what it returned (Dynamo's own tracing is not aotforge's); under aot_module
("aot_function") and aot_function ("function", "function_dynamic": dynamic=True), the whole
first step (tracing is aotforge's there).
"""
import io
import json
import sys
import time

import torch

import aotforge
from aotforge.backends import aotforge_backend
from aotforge.compiler import compile_fx_inner
from aotforge.config import config


def model_and_input(rows: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
    return model, torch.randn(rows, 32)


def main() -> None:
    path, directory = sys.argv[1], sys.argv[2]
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    config.cache_dir, config.cache = directory, True
    spent = [0.0]

    def timed(fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started
        return run

    def backend(gm, example_inputs, **kwargs):
        compiled = timed(aotforge_backend)(gm, example_inputs, **kwargs)
        state = {"first": True}

        def call(*args):
            if state.pop("first", False):
                return timed(compiled)(*args)
            return compiled(*args)
        return call

    model, x = model_and_input(rows)
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        if path == "aot_function":
            compiled = aotforge.aot_module(model, compile_fx_inner)
            torch.manual_seed(1)
            started = time.perf_counter()
            out = compiled(x)
            out.pow(2).sum().backward()
            spent[0] = time.perf_counter() - started
        elif path.startswith("function"):
            names = [name for name, _ in model.named_parameters()]

            def step(x, *params):
                return torch.func.functional_call(model, dict(zip(names, params)), (x,))

            compiled = aotforge.aot_function(step, compile_fx_inner, dynamic=path == "function_dynamic")
            torch.manual_seed(1)
            started = time.perf_counter()
            out = compiled(x, *model.parameters())
            out.pow(2).sum().backward()
            spent[0] = time.perf_counter() - started
        else:
            compiled = torch.compile(model, backend=backend, dynamic=path == "dynamic")
            torch.manual_seed(1)
            out = compiled(x)
            out.pow(2).sum().backward()
    finally:
        log, sys.stderr = sys.stderr.getvalue(), stderr
    grads = [p.grad.flatten().tolist() for p in model.parameters()]
    print(json.dumps(dict(seconds=spent[0], out=out.detach().flatten().tolist(), grads=grads,
                          log=[line for line in log.splitlines() if "aotforge cache" in line])))


if __name__ == "__main__":
    main()
