"""The row helpers every row kernel's launcher reads its tensors through."""

import pytest
import torch

from onca.ops._rows import as_rows, rows_in_place, views_as_rows


def _layouts():
    base = torch.arange(2 * 3 * 5 * 8, dtype=torch.float32).reshape(2, 3, 5, 8)
    yield "contiguous", base
    yield "one row", base[0, 0, 0]
    yield "padded rows", torch.zeros(2, 3, 5, 11)[..., 2:10]
    yield "padded rows between size-1 dims", torch.zeros(5, 11)[:, 2:10].unsqueeze(0).unsqueeze(2)
    yield "a single row of a wider buffer", torch.arange(40.0).reshape(2, 20)[1:, 3:11]
    yield "leading dims that do not merge", base.transpose(0, 1)
    yield "column stride 2", torch.zeros(4, 16)[:, ::2]
    yield "no rows", torch.zeros(0, 3, 8)


@pytest.mark.parametrize("name, t", list(_layouts()), ids=[name for name, _ in _layouts()])
def test_rows_in_place_reads_the_matrix_as_rows(name, t):
    t = t.clone() if name == "no rows" else t
    matrix = as_rows(t)
    ready, rows, row_stride = rows_in_place(t)
    assert rows == matrix.shape[0]
    # t itself where the view reads it in place; a contiguous copy exactly where the view copies.
    in_place = views_as_rows(t)
    assert (ready is t) == in_place
    assert (ready.data_ptr() == t.data_ptr()) == in_place or t.numel() == 0
    assert in_place or ready.is_contiguous()
    if rows > 1:
        assert row_stride == matrix.stride(0)
        # Row r starts row_stride elements after row 0, and holds the matrix's row r.
        flat = torch.as_strided(ready, (rows, t.shape[-1]), (row_stride, 1))
        assert torch.equal(flat, matrix)
    else:
        assert row_stride == t.shape[-1]
