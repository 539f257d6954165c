"""Generated kernel modules live as long as a compiled graph uses them: a process that keeps
compiling new graphs (and dropping old ones) keeps a bounded number of them, in sys.modules,
the launcher table and Triton's registry (issue 26)."""
import gc
import sys

import torch

from aotforge.compiler.runtime import compiled as compiled_runtime
from aotforge.compiler.runtime import modules

from ..helpers import compile_and_run


def _generated_modules() -> int:
    return sum(1 for name in list(sys.modules) if name.startswith("aotforge_generated_"))


def _triton_registry_entries() -> int:
    from triton.runtime import jit

    registry = getattr(jit, "_triton_jit_function_registry", {})
    return sum(1 for key in list(registry) if key.startswith("aotforge_generated_"))


def _compile_distinct(index: int):
    scale = 0.5 + index  # a constant of the kernel: a new kernel source per index

    def fn(x):
        return ((x * scale).sin() + scale,)

    x = torch.randn(8, dtype=torch.float64)
    outputs, stats = compile_and_run(fn, x)
    assert stats["path"] == "triton"
    torch.testing.assert_close(outputs[0], fn(x)[0])


def test_kernel_modules_stay_bounded_over_many_compiles():
    gc.collect()
    before = (_generated_modules(), len(compiled_runtime._launchers), len(modules._modules), _triton_registry_entries())
    for index in range(25):
        _compile_distinct(index)
    gc.collect()
    after = (_generated_modules(), len(compiled_runtime._launchers), len(modules._modules), _triton_registry_entries())
    assert after[0] == 0, "generated modules must not accumulate in sys.modules"
    for name, old, new in zip(("modules", "launchers", "loaded modules", "Triton registry"), before, after):
        assert new <= old + 2, f"{name}: {old} before 25 compiles, {new} after"


def test_identical_kernels_of_live_graphs_still_share_one_launcher():
    def fn(x):
        return ((x * 3.25).cos(),)

    x = torch.randn(8, dtype=torch.float64)
    from ..helpers import trace
    from aotforge.compiler import compile_fx_inner
    from aotforge.config import config

    with config.patch(triton_on_cpu=True):
        first = compile_fx_inner(trace(fn, x), [x])
        second = compile_fx_inner(trace(fn, x), [x])
        for compiled in (first, second):
            torch.testing.assert_close(compiled([x.clone()])[0], fn(x)[0])
    launchers = [set(map(id, c.compiled_graph.launchers.values())) for c in (first, second)]
    assert launchers[0] == launchers[1]
