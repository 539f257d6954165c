"""(Run as a script by test_graph_cache.py, one fresh process per run.) Compile one case with
torch.compile(backend="aotforge") (Triton on the CPU through the interpreter), run it and
eager on the same inputs, and print one JSON line: whether everything matched eager, and
the cache's hit/miss messages.

    python cache_worker.py CASE CACHE_DIR [SIZE]

("inference" runs ``mlp`` under no_grad; "cpu_fx" runs ``mutation`` on the CPU path, where
graphs run as FX code.)
"""
import io
import json
import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"
os.environ["AOTFORGE_LOG"] = "cache"

import torch  # noqa: E402

import aotforge  # noqa: E402,F401
from aotforge.config import config  # noqa: E402


def mlp(x, w):
    return torch.nn.functional.gelu(x @ w).sum(-1).softmax(-1)


def mutation_and_alias(x, w):
    x.mul_(2)  # an input mutation: the caller's x must change as eager's does
    return (x * w).sum(-1), x.view(-1)  # an output that aliases the input


def mutation(x, w):
    x.mul_(2)  # mutated in place, no output aliases it
    return (x * w).sum(-1)


def dropout(x, w):
    return torch.nn.functional.dropout(x * w, p=0.5, training=True).sum(-1)


def branch(x, w):
    if x.shape[0] > 10:  # a shape guard; both sides compute the same graph
        return (x * w).sum(-1)
    return (x * w).sum(-1)


CASES = {"mlp": mlp, "mutation_and_alias": mutation_and_alias, "mutation": mutation, "dropout": dropout,
         "branch": branch, "inference": mlp, "cpu_fx": mutation, "cpu_cpp": mlp}


def inputs(size: int):
    generator = torch.Generator().manual_seed(size)
    x = torch.randn(size, 32, dtype=torch.float64, generator=generator)
    w = torch.randn(32 if size else 1, dtype=torch.float64, generator=generator).requires_grad_()
    return x, w


def compare(name: str, got, want, problems: list) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    except AssertionError as error:
        problems.append(f"{name}: {error}")


def main() -> None:
    case, directory = sys.argv[1], sys.argv[2]
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    config.cache_dir, config.cache = directory, True
    config.triton_on_cpu = case not in ("cpu_fx", "cpu_cpp")
    config.cpu_codegen = case == "cpu_cpp"  # cpu_fx: graphs run as their FX code (no kernels); cpu_cpp: C++

    config.fallback_random = True  # dropout through eager's generator: masks comparable bit for bit
    fn = CASES[case]
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        problems, caught = run(fn, case, size)
    finally:
        log, sys.stderr = sys.stderr.getvalue(), stderr
        print(log, file=sys.stderr)
    print(json.dumps(dict(problems=problems, log=[line for line in log.splitlines() if "aotforge cache" in line],
                          warnings=[str(w.message) for w in caught if "aotforge" in str(w.message)])))


def run(fn, case: str, size: int):
    problems: list = []
    with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(case != "inference"):
        warnings.simplefilter("always")
        compiled = torch.compile(fn, backend="aotforge", dynamic=case == "branch")
        x, w = inputs(size)
        ex, ew = x.clone(), w.detach().clone().requires_grad_()
        torch.manual_seed(0)
        got = compiled(x, w)
        got_state = torch.get_rng_state()
        torch.manual_seed(0)
        want = fn(ex, ew)
        want_state = torch.get_rng_state()
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        for i, (g, e) in enumerate(zip(got, want)):
            compare(f"output {i}", g, e, problems)
        compare("input x after the call", x, ex, problems)
        if not torch.equal(got_state, want_state):
            problems.append("the RNG state after the call differs from eager's")
        if case == "mutation_and_alias" and got[1].untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            problems.append("output 1 does not alias input x")
        if case != "inference":
            got[0].pow(2).sum().backward()
            want[0].pow(2).sum().backward()
            compare("gradient of w", w.grad, ew.grad, problems)
    return problems, caught


if __name__ == "__main__":
    main()
