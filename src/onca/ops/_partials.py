"""Deterministic reduction of per-program partial sums (weight and bias gradients).

Kernels that reduce across rows give each program of a persistent grid its own fp32 row of a
``(programs, cols)`` buffer. ``sum_partials`` adds the rows in a fixed order, column tiles in
parallel: the same bits on every run, no atomics, and one small launch (``torch.sum`` over dim 0 of
a few hundred rows took 10-15 us on an H200, several times a kernel that reads 4 MB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onca.device import get_profile
from onca.tiling import plan_rows


@triton.jit
def _sum_partials_kernel(src_ptr, dst_ptr, n_rows, n_cols,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(src_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(dst_ptr + cols, tl.sum(acc, axis=0).to(dst_ptr.dtype.element_ty), mask=col_mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum a contiguous fp32 ``(programs, cols)`` buffer over its rows, stored in ``dtype``."""
    n_rows, n_cols = partials.shape
    # Column tiles of at least 32 fp32 (128 bytes, whole memory transactions), enough of them to
    # spread over the compute units.
    units = get_profile().compute_units
    p = plan_rows(n_rows, n_cols, torch.float32, live_tiles=2, max_block_cols=max(32, n_cols // units))
    total = torch.empty(n_cols, dtype=dtype, device=partials.device)
    _sum_partials_kernel[(p.col_tiles,)](partials, total, n_rows, n_cols,
                                         BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols,
                                         num_warps=p.num_warps)
    return total
