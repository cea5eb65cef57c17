"""The launchers shared by row ops that map each row of ``x`` to a row of ``y`` and whose backward
reads ``(dy, y)`` (softmax, sparsemax): both kernels take the two-pass plan below and the same
arguments, so an op file declares its kernels, its custom ops and its tile counts, and nothing else.

Kernel signatures: ``forward(x, y, n_rows, n_cols, x_row_stride, y_row_stride, BLOCK_ROWS,
BLOCK_COLS, COL_TILES, ...)`` and ``backward(dy, y, dx, n_rows, n_cols, dy_row_stride,
y_row_stride, dx_row_stride, BLOCK_ROWS, BLOCK_COLS, COL_TILES, ...)``; the launchers pass any
further constexprs through.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops._rows import rows_cols
from onca.tiling import RowPlan, plan_rows

__all__ = ["TWO_PASS_ELEMENTS_PER_THREAD", "plan_two_pass", "plans", "launch_forward", "launch_backward"]

# A two-pass (column-tiled) row keeps at most this many elements of a tile per thread of the widest
# program on a GPU: the loops over the tiles pipeline their loads, and at 16 per thread (8192-wide
# tiles) the backward kernels spill on sm_90 (tools/sm90_compile.py); at 8 they do not.
TWO_PASS_ELEMENTS_PER_THREAD = 8


def plan_two_pass(rows: int, cols: int, dtype: torch.dtype, tiles: dict,
                  profile: DeviceProfile | None = None) -> RowPlan:
    """``plan_rows`` for a row kernel with a single-tile path and a two-pass column-tiled path: on
    a GPU the column tiles are capped at ``TWO_PASS_ELEMENTS_PER_THREAD`` elements per thread of a
    ``max_warps`` program."""
    profile = profile or get_profile()
    p = plan_rows(rows, cols, dtype, profile=profile, **tiles)
    if p.col_tiles == 1 or profile.kind != "cuda":
        return p
    cap = profile.max_warps * 32 * TWO_PASS_ELEMENTS_PER_THREAD
    if p.block_cols > cap:
        # The planner halves the widest block for a two-pass row: ask for twice the cap.
        p = plan_rows(rows, cols, dtype, profile=profile, max_block_cols=2 * cap, **tiles)
    wanted = p.block_rows * p.block_cols // (32 * TWO_PASS_ELEMENTS_PER_THREAD)
    warps = max(p.num_warps, min(profile.max_warps, wanted))
    return p if warps == p.num_warps else dataclasses.replace(p, num_warps=warps)


def plans(shape, dtype: torch.dtype, forward_tiles: dict, backward_tiles: dict,
          profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., cols)``, rows mapped over
    the last dimension)."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_two_pass(rows, cols, dtype, forward_tiles, profile),
        "backward": plan_two_pass(rows, cols, dtype, backward_tiles, profile),
    }


def _constexprs(p: RowPlan) -> dict:
    return {"BLOCK_ROWS": p.block_rows, "BLOCK_COLS": p.block_cols, "COL_TILES": p.col_tiles,
            "num_warps": p.num_warps}


def launch_forward(kernel, x: Tensor, tiles: dict, **constexprs) -> Tensor:
    """``y`` (``x``'s dtype) from the forward ``kernel`` over the rows of the 2-D ``x``."""
    rows, cols = x.shape
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    p = plan_two_pass(rows, cols, x.dtype, tiles)
    kernel[(p.grid,)](x, y, rows, cols, x.stride(0), y.stride(0), **constexprs, **_constexprs(p))
    return y


def launch_backward(kernel, dy: Tensor, y: Tensor, tiles: dict, **constexprs) -> Tensor:
    """``dx`` (``y``'s dtype) from the backward ``kernel`` over the rows of the 2-D ``dy``/``y``."""
    rows, cols = y.shape
    dx = torch.empty((rows, cols), dtype=y.dtype, device=y.device)
    if y.numel() == 0:
        return dx
    p = plan_two_pass(rows, cols, y.dtype, tiles)
    kernel[(p.grid,)](dy, y, dx, rows, cols, dy.stride(0), y.stride(0), dx.stride(0), **constexprs, **_constexprs(p))
    return dx
