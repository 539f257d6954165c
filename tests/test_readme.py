"""Every ```python block of README.md runs as written, in a namespace of its own (so each
defines what it uses). A block whose first line is ``# requires: cuda`` runs only where
torch sees a GPU; elsewhere it must still compile."""
from __future__ import annotations

import os
import re

import pytest
import torch

import aotforge

REPO = os.path.dirname(os.path.dirname(os.path.abspath(aotforge.__file__)))
README = os.path.join(REPO, "README.md")


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of each ```python block."""
    with open(README) as handle:
        text = handle.read()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks_and_a_training_loop():
    assert len(BLOCKS) >= 6
    assert any("optimizer.step()" in source and "backward()" in source for _, source in BLOCKS)


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs_as_written(line, source, capsys):
    code = compile(source, f"README.md:{line}", "exec")
    if source.lstrip().startswith("# requires: cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the block compiled; it runs on a GPU machine)")
    torch._dynamo.reset()
    namespace = {"__name__": "__readme__"}
    exec(code, namespace)


def test_the_cpu_recipe_asks_for_a_torch_in_the_supported_range():
    # A CPU torch outside the range would be replaced by `pip install -e .` with the default
    # (CUDA) wheel: the multi-GB download the recipe is there to avoid.
    with open(os.path.join(REPO, "pyproject.toml")) as handle:
        (spec,) = re.findall(r'"torch([<>=!~,.0-9 ]+)"', handle.read())
    with open(README) as handle:
        readme = handle.read()
    assert f'pip install "torch{spec}" --index-url https://download.pytorch.org/whl/cpu' in readme
