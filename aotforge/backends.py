"""torch.compile backends: ``aotforge_eager`` (AOT autograd, graphs run as FX) and
``aotforge`` (AOT autograd + our compiler)."""
from __future__ import annotations

import torch


def aotforge_eager_backend(gm: torch.fx.GraphModule, example_inputs):
    from aotforge.aot import aot_module_simplified
    from aotforge.aot.boxing import boxed_nop

    return aot_module_simplified(gm, example_inputs, fw_compiler=boxed_nop, bw_compiler=boxed_nop)


def aotforge_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    from aotforge.compiler import compile_fx

    return compile_fx(gm, example_inputs, **kwargs)


def register_backends() -> None:
    """Register both backends with Dynamo (idempotent; the package's entry points also let
    Dynamo find them without an import)."""
    from torch._dynamo.backends import registry

    for name, fn in (("aotforge_eager", aotforge_eager_backend), ("aotforge", aotforge_backend)):
        # An entry point may have registered the name already (then _COMPILER_FNS has it).
        if name not in registry._COMPILER_FNS:
            registry.register_backend(compiler_fn=fn, name=name)
