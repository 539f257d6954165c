"""``libdevice`` for Triton's interpreter (TRITON_INTERPRET=1), which has no extern math
library: each function runs the same math through torch on the interpreter's numpy arrays.
Also a ``range`` for the kernels' loops that works on every Triton the project supports."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle


def _unwrap(value: Any) -> tuple[np.ndarray, Any]:
    if isinstance(value, tl.tensor):
        return value.handle.data, value.dtype.scalar if hasattr(value.dtype, "scalar") else value.dtype
    if isinstance(value, tl.constexpr):
        value = value.value
    return np.asarray(value), None


def _wrap(data: np.ndarray, dtype: Any) -> tl.tensor:
    data = np.asarray(data)
    kind = tl.block_type(dtype, list(data.shape)) if data.shape else dtype
    return tl.tensor(TensorHandle(data, dtype), kind)


def _elementwise(fn: Callable[..., torch.Tensor]) -> Callable[..., tl.tensor]:
    def apply(*args: Any) -> tl.tensor:
        arrays, dtypes = zip(*[_unwrap(a) for a in args])
        dtype = next(d for d in dtypes if d is not None)
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in np.broadcast_arrays(*arrays)]
        result = fn(*tensors)
        if result.dtype == torch.bool:
            return _wrap(result.numpy(), tl.int1)
        return _wrap(result.numpy().astype(arrays[0].dtype if arrays[0].dtype.kind == "f" else result.numpy().dtype), dtype)
    return apply


class _InterpreterLibdevice:
    floor = staticmethod(_elementwise(torch.floor))
    ceil = staticmethod(_elementwise(torch.ceil))
    trunc = staticmethod(_elementwise(torch.trunc))
    nearbyint = staticmethod(_elementwise(torch.round))
    fmod = staticmethod(_elementwise(torch.fmod))
    pow = staticmethod(_elementwise(torch.pow))
    atan2 = staticmethod(_elementwise(torch.atan2))
    copysign = staticmethod(_elementwise(torch.copysign))
    hypot = staticmethod(_elementwise(torch.hypot))
    expm1 = staticmethod(_elementwise(torch.expm1))
    log10 = staticmethod(_elementwise(torch.log10))
    log1p = staticmethod(_elementwise(torch.log1p))
    tan = staticmethod(_elementwise(torch.tan))
    asin = staticmethod(_elementwise(torch.asin))
    acos = staticmethod(_elementwise(torch.acos))
    atan = staticmethod(_elementwise(torch.atan))
    sinh = staticmethod(_elementwise(torch.sinh))
    cosh = staticmethod(_elementwise(torch.cosh))
    tanh = staticmethod(_elementwise(torch.tanh))
    asinh = staticmethod(_elementwise(torch.asinh))
    acosh = staticmethod(_elementwise(torch.acosh))
    atanh = staticmethod(_elementwise(torch.atanh))
    erfc = staticmethod(_elementwise(torch.erfc))
    erfinv = staticmethod(_elementwise(torch.erfinv))
    lgamma = staticmethod(_elementwise(torch.lgamma))
    signbit = staticmethod(_elementwise(torch.signbit))


libdevice = _InterpreterLibdevice()


_builtin_range = range


def range(*bounds: Any) -> Any:  # noqa: A001 (shadows the builtin in interpreted kernel modules)
    """The builtin ``range`` over interpreter scalars. Triton's interpreter hands an int argument
    (``rnumel``) to the kernel as a one-element array; Triton 3.6 turns it into an int with
    ``int(array)``, which NumPy 2.4 refuses for arrays that are not 0-dimensional."""
    return _builtin_range(*(_scalar(b) for b in bounds))


def _scalar(value: Any) -> Any:
    if isinstance(value, tl.tensor) and value.handle.data.size == 1:
        return int(value.handle.data.reshape(()))
    return value


def aot_check_index(index: Any, size: Any, check: Any) -> tl.tensor:
    """An index read from a tensor, checked against its dimension's ``size`` under the op's
    bounds rule (``check``: index_checks.encode), in the interpreter: a bad one raises eager's
    exception and message (index_checks.index_error), where a GPU kernel's device assert stops
    the launch (codegen/triton.py's ``aot_check_index``). Masked-off lanes hold their load's
    ``other`` value, 0, which is in bounds (a size-0 dimension reads nothing)."""
    from ..index_checks import decode, index_error, wraps_negative

    values, dtype = _unwrap(index)
    bound = int(np.asarray(_unwrap(size)[0]).reshape(-1)[0])
    rule = decode(int(np.asarray(_unwrap(check)[0]).reshape(-1)[0]))
    positions = np.where(values < 0, values + bound, values) if wraps_negative(rule) else values
    bad = (positions < 0) | (positions >= bound)
    if bound > 0 and bad.any():
        error = index_error(rule, int(values[bad].reshape(-1)[0]), bound)
        error.aotforge_index_check = True  # (the launcher unwraps it from the interpreter's error)
        raise error
    return _wrap(np.where(bad, 0, positions).astype(values.dtype), dtype)
