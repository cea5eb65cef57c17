"""Row ops that map each row of ``x`` to a row of ``y`` and whose backward reads ``(dy, y)``
(softmax, sparsemax): :func:`register_row_map` declares an op's two custom ops
(``onca::<name>_forward``, ``onca::<name>_backward``), their fake implementations and autograd
(the output ``y`` saved), launching the op's two kernels with the two-pass plan below. An op file
holds its kernels, its tile counts and its public function.

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
from onca.ops._contract import Op, custom_op, register_autograd
from onca.ops._launch import row_launch
from onca.ops._rows import rows_cols, rows_in_place
from onca.tiling import RowPlan, cdiv, next_power_of_2, plan_rows

__all__ = ["GPU_WIDE_ROW_COLS", "TWO_PASS_ELEMENTS_PER_THREAD", "plan_two_pass", "plans", "register_row_map"]

# A two-pass (column-tiled) row keeps at most this many elements of a tile per thread of the widest
# program on a GPU: the loops over the tiles pipeline their loads, and at 16 per thread (8192-wide
# tiles) the backward kernels spill on sm_90 (tools/sm90_compile.py); at 8 they do not.
TWO_PASS_ELEMENTS_PER_THREAD = 8

# The GPU tile of a row too wide for one planned tile in an op that declares ``gpu_wide_rows``:
# this many columns in a 32-warp program (32 elements per thread), so that a row of up to this many
# columns is read once and a wider one in tiles this wide. Softmax, H100, bf16: see its tiles.
GPU_WIDE_ROW_COLS = 32768


def plan_two_pass(rows: int, cols: int, dtype: torch.dtype, tiles: dict,
                  profile: DeviceProfile | None = None) -> RowPlan:
    """``plan_rows`` for a row kernel with a single-tile path and a two-pass column-tiled path: on
    a GPU the column tiles are capped at ``TWO_PASS_ELEMENTS_PER_THREAD`` elements per thread of a
    ``max_warps`` program, or, where ``tiles`` declares ``gpu_wide_rows=True``, are
    ``GPU_WIDE_ROW_COLS`` wide (one tile when the row fits it). Other profiles ignore the key."""
    profile = profile or get_profile()
    wide = tiles.get("gpu_wide_rows", False)
    tiles = {key: value for key, value in tiles.items() if key != "gpu_wide_rows"}
    p = plan_rows(rows, cols, dtype, profile=profile, **tiles)
    if p.col_tiles == 1 or profile.kind != "cuda":
        return p
    if wide:
        return _wide_row_plan(p)
    cap = profile.max_warps * 32 * TWO_PASS_ELEMENTS_PER_THREAD
    if p.block_cols > cap:
        # The planner halves the widest block for a two-pass row: ask for twice the cap.
        p = plan_rows(rows, cols, dtype, profile=profile, max_block_cols=2 * cap, **tiles)
    wanted = p.block_rows * p.block_cols // (32 * TWO_PASS_ELEMENTS_PER_THREAD)
    warps = max(p.num_warps, min(profile.max_warps, wanted))
    return p if warps == p.num_warps else dataclasses.replace(p, num_warps=warps)


def _wide_row_plan(p: RowPlan) -> RowPlan:
    """``p`` (a GPU plan of rows too wide for one tile) with one row per ``GPU_WIDE_ROW_COLS``-wide
    tile in a 32-warp program, one program per row (or ``p``'s persistent grid)."""
    block_cols = min(next_power_of_2(p.cols), GPU_WIDE_ROW_COLS)
    bytes_per_col = p.tile_bytes // (p.block_rows * p.block_cols)
    return dataclasses.replace(
        p, block_rows=1, block_cols=block_cols, col_tiles=cdiv(p.cols, block_cols), row_blocks=p.rows,
        grid=min(p.grid, p.rows) if p.persistent else p.rows, num_warps=32,
        tile_bytes=bytes_per_col * block_cols,
    )


def plans(shape, dtype: torch.dtype, forward_tiles: dict, backward_tiles: dict,
          profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., cols)``, rows mapped over
    the last dimension)."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_two_pass(rows, cols, dtype, forward_tiles, profile),
        "backward": plan_two_pass(rows, cols, dtype, backward_tiles, profile),
    }


def launch_forward(kernel, x: Tensor, tiles: dict, **constexprs) -> Tensor:
    """``y`` (``x``'s dtype and shape, contiguous) from the forward ``kernel`` over the rows of
    ``x`` (any leading shape)."""
    cols = x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    if rows == 0 or cols == 0:
        return y
    grid, kwargs, _ = row_launch(kernel, rows, cols, x.dtype, tiles, constexprs, plan=plan_two_pass)
    kernel[grid](x, y, rows, cols, x_stride, cols, **kwargs)
    return y


def launch_backward(kernel, dy: Tensor, y: Tensor, tiles: dict, **constexprs) -> Tensor:
    """``dx`` (``y``'s dtype and shape, contiguous) from the backward ``kernel`` over the rows of
    ``dy`` and ``y`` (any leading shape, the same)."""
    cols = y.shape[-1]
    dx = torch.empty_like(y, memory_format=torch.contiguous_format)
    y, rows, y_stride = rows_in_place(y)
    if rows == 0 or cols == 0:
        return dx
    dy, _, dy_stride = rows_in_place(dy)
    grid, kwargs, _ = row_launch(kernel, rows, cols, y.dtype, tiles, constexprs, plan=plan_two_pass)
    kernel[grid](dy, y, dx, rows, cols, dy_stride, y_stride, cols, **kwargs)
    return dx


def register_row_map(name: str, forward_kernel, backward_kernel, forward_tiles: dict, backward_tiles: dict, *,
                     forward_doc: str, backward_doc: str, **forward_constexprs) -> Op:
    """Register ``onca::<name>_forward`` (``y`` from ``x`` of any leading shape) and ``onca::<name>_backward``
    (``dx`` from ``dy`` and the saved ``y``) with autograd; return the forward op."""

    def forward(x: Tensor) -> Tensor:
        return launch_forward(forward_kernel, x, forward_tiles, **forward_constexprs)

    def backward(dy: Tensor, y: Tensor) -> Tensor:
        return launch_backward(backward_kernel, dy, y, backward_tiles)

    forward.__doc__, backward.__doc__ = forward_doc, backward_doc
    forward_op = custom_op(f"{name}_forward")(forward)
    backward_op = custom_op(f"{name}_backward")(backward)
    forward_op.register_fake(lambda x: x.new_empty(x.shape))
    backward_op.register_fake(lambda dy, y: y.new_empty(y.shape))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    def grad(ctx, dy):
        (y,) = ctx.saved_tensors
        return backward_op(dy, y)

    register_autograd(forward_op, grad, setup_context=setup_context)
    return forward_op
