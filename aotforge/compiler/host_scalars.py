"""CPU scalars in GPU graphs.

Eager reads a 0-d CPU tensor in CUDA arithmetic (``t * torch.tensor(2.0)``, an optimizer's
``step`` count, a learning rate kept as a tensor) as a number. A generated kernel cannot read
host memory, so the lowering puts such an operand on the GPU first, through this op: a fill
whose value is a launch argument, which a CUDA graph can record (a host-to-device copy of
pageable memory could not be), once per graph call.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("aotforge::host_scalar_to_device", mutates_args=())
def host_scalar_to_device(scalar: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d tensor on ``device`` holding ``scalar``'s value (a 0-d CPU tensor)."""
    return torch.full((), scalar.item(), dtype=scalar.dtype, device=device)


@host_scalar_to_device.register_fake
def _(scalar: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=scalar.dtype, device=device)


HOST_SCALAR_TO_DEVICE = torch.ops.aotforge.host_scalar_to_device.default
