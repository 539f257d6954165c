"""How many pieces a reduction is cut into (lowering/reductions.py ``_split_count``): the
GPU's column reductions are cut until their grid fills the device; everything else keeps the
rule for a few long rows. The values are checked against eager on the GPU in
tests/gpu/test_gpu_compiler.py (``test_wide_column_sum_matches_eager``)."""
from __future__ import annotations

import pytest

from aotforge.compiler.lowering.reductions import _split_count


@pytest.mark.parametrize("numel, rnumel, pieces", [
    (30522, 8192, 8),   # BERT's MLM bias gradient: ~477 programs of 64 columns, cut to ~3,800
    (768, 8192, 32),    # a LayerNorm's weight gradient: cut as before
    (262144, 8192, 1),  # enough columns for the grid already
    (30522, 2048, 1),   # rows under the threshold stay whole
])
def test_column_reductions_are_cut_to_fill_the_grid(numel, rnumel, pieces):
    assert _split_count(numel, rnumel, "sum", column=True) == pieces


def test_row_reductions_keep_their_rule():
    assert _split_count(30522, 8192, "sum") == 1  # many rows: one program per row fills the grid
    assert _split_count(3072, 8192, "sum") == 16
    assert _split_count(30522, 8192, "sum", column=True, exact=True) == 8


def test_a_reduction_that_cannot_be_combined_is_never_cut():
    assert _split_count(30522, 8192, "argmax", column=True) == 1
