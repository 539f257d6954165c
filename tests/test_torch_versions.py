"""aotforge.torch_versions: what differs between the torch releases aotforge supports."""
from __future__ import annotations

import pytest
import torch

from aotforge import aot_function, nop
from aotforge.torch_versions import new_fake_mode, torch_at_least


def test_torch_at_least_reads_the_installed_version():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert torch_at_least(f"{major}.{minor}")
    assert not torch_at_least(f"{major}.{minor + 1}")
    assert torch_at_least("2.11")


def test_fakes_of_zero_dim_inputs_carry_no_value():
    """torch >= 2.14 would copy a 0-dim input's value into its fake (item() returning it)."""
    mode = new_fake_mode(allow_non_fake_inputs=True)
    for value in (torch.tensor(3), torch.tensor(2.5, dtype=torch.float64)):
        assert mode.from_tensor(value).item_memo is None


@pytest.mark.parametrize("count", [torch.tensor(3), torch.tensor(2.0, dtype=torch.float64)])
def test_item_of_an_input_is_never_baked_into_the_graph(count):
    """The value an input carries must not become a graph constant: a second call with
    another value would silently return the first value's result."""
    compiled = aot_function(lambda x, n: (x * n.item(),), nop)
    x = torch.ones(2, dtype=torch.float64)
    with pytest.raises(Exception, match="_local_scalar_dense"):
        compiled(x, count)


def test_size_hints_without_deprecated_shape_env_names():
    """ShapeEnv.var_to_val and size_hint warn (FutureWarning) from torch 2.13: the helpers read
    the new names where torch has them, and give the same values as the old ones."""
    import warnings

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from aotforge.torch_versions import backed_size_hints, optimization_size_hint

    env = ShapeEnv()
    fake = new_fake_mode(shape_env=env).from_tensor(torch.empty(5, 3), static_shapes=False)
    rows, cols = fake.shape
    unbacked = env.create_unbacked_symint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hints = {str(symbol): int(value) for symbol, value in backed_size_hints(env).items()}
        assert sorted(hints.values()) == [3, 5]
        assert optimization_size_hint(env, rows.node.expr * cols.node.expr, 7) == 15
        assert optimization_size_hint(env, unbacked.node.expr, 7) == 7
