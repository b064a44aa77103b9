"""The probe against the numbers on every public torch function a torch-function mode sees,
called on one (rows, tokens, features) operand with no other argument or with one dimension,
or on two (the second another value of the rows, or a constant): none may be followed silently
while it mixes rows; the few refused while row-wise are named."""

from __future__ import annotations

import pytest
import torch

from tests.core._row_mixing import sweep

REFUSED_THOUGH_ROW_WISE = {
    "atleast_1d", "atleast_2d", "atleast_3d",  # views the probe has no rule for
    "linalg_vander", "native_channel_shuffle", "slice_copy", "module_load",
    "roll",  # roll(x, 0): a shift of nothing over the flattened batch
    "unfold",  # F.unfold on an unbatched input: the rows as channels
    "unique_consecutive",  # row-wise only while no value repeats across rows
    "cross",  # without a dimension: its first of size 3, which may be the rows
    "kron",  # with a constant: copies of each row, in order
    "slice_scatter", "slice_inverse",  # no rule
}  # fmt: skip


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("operands", [1, 2], ids=["one-operand", "two-operands"])
def test_no_torch_function_mixes_rows_unnoticed(operands: int) -> None:
    found = sweep(torch.randn(4, 3, 8), operands)
    silent = {k: v for k, v in found.items() if v.startswith("mixes rows")}
    assert not silent
    refused = {k.split(".")[-1].split("(")[0] for k in found}
    assert refused <= REFUSED_THOUGH_ROW_WISE, refused - REFUSED_THOUGH_ROW_WISE
