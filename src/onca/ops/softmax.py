"""Softmax over one dimension (the last by default): ``y = exp(x - max(x)) / sum(exp(x - max(x)))``.

liger-kernel's ``LigerSoftmax`` / ``liger_softmax(x)`` (always the last dimension), and
``torch.softmax(x, dim)`` for a floating input: the row is reduced in fp32 and ``y`` is stored
once in the input's dtype. A row of ``-inf`` (or one holding ``+inf`` or NaN) gives NaN, as in
torch. Another ``dim`` is moved last first (one copy of the input and, in the backward pass, of
the incoming gradient); the result is then a view in the input's shape.

Saved for backward: the output ``y`` (not ``x``). The backward pass is
``dx = y * (dy - sum(dy * y))`` per row, in fp32, stored in the input's dtype.

Each kernel covers a row in one tile when it fits the plan, else in column tiles with two passes
over the row: the forward's first pass keeps an online maximum and rescaled sum
(``onca.ops.jsd._lse_update``), its second writes ``y``; the backward's first pass sums
``dy * y``, its second writes ``dx``. Every row is independent: no cross-program reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _small_calls as small_calls
from onca.ops._launch import fast_launch
from onca.ops._row_map import plans, register_row_map
from onca.ops._rows import moved_back, moved_last
from onca.ops._validate import check_dim, check_float
from onca.ops.jsd import _lse_update
from onca.tiling import RowPlan

__all__ = ["plan", "softmax"]

# Live tiles (input dtype; fp32). Forward: x and y; x and exp(x - m) in fp32. Backward: dy, y and
# dx; their fp32 forms. A row too wide for one planned tile takes the row map's wide GPU tile
# (gpu_wide_rows: 32768 columns in 32 warps), timed on an H100 (bf16, forward + backward, CUDA-graph
# replay, kernels launched directly) against the whole-budget two-pass tile (8192 columns, 16
# warps) and liger-kernel: 1.048 -> 0.936 ms at 8192 x 32000 (liger 0.886: its forward alone is
# faster there, 16384-column tiles were 0.384 ms against 0.399), 2.833 -> 2.272 ms at 8192 x 65536
# (liger 2.417), 1.428 -> 1.140 at 4096 x 65536 (liger 1.215); 16384-column tiles in 32 warps
# were between the two.
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=2, gpu_wide_rows=True)
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=3, gpu_wide_rows=True)


# ----------------------------------------------------------------------------------------- kernels


@fast_launch
@triton.jit
def _softmax_forward_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            m = tl.max(x, axis=1)
            # A row of -inf has m = -inf and gives NaN (-inf - -inf), as torch's softmax does.
            e = tl.exp(x - m[:, None])
            y = e / tl.sum(e, axis=1)[:, None]
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
            s = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                m, s = _lse_update(m, s, x)
            # s was accumulated relative to m (or to 0 for a row of -inf: then m is -inf, and the
            # exponent below is NaN, as in the single-tile path).
            inv_s = 1.0 / s
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                y = tl.exp(x - m[:, None]) * inv_s[:, None]
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _softmax_backward_kernel(
    dy_ptr, y_ptr, dx_ptr, n_rows, n_cols, dy_row_stride, y_row_stride, dx_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        dy_rows = dy_ptr + rows64 * dy_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        dx_rows = dx_ptr + rows64 * dx_row_stride
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            dy = tl.load(dy_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            dot = tl.sum(dy * y, axis=1)
            dx = y * (dy - dot[:, None])
            tl.store(dx_rows + col_offsets[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            dot = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(dy * y, axis=1)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dx = y * (dy - dot[:, None])
                tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., cols)``, softmax over the
    last dimension)."""
    return plans(shape, dtype, FORWARD_TILES, BACKWARD_TILES, profile)


softmax_forward = register_row_map(
    "softmax", _softmax_forward_kernel, _softmax_backward_kernel, FORWARD_TILES, BACKWARD_TILES,
    forward_doc="``y``, the softmax of each row of ``x`` (any leading shape), in ``x``'s dtype.",
    backward_doc="``dx = y * (dy - sum(dy * y))`` per row of ``dy``/``y`` (any leading shape), in "
                 "``y``'s dtype.",
)


# ------------------------------------------------------------------------------------------ public


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax of ``x`` over ``dim`` (default the last dimension: liger-kernel's ``liger_softmax``),
    as ``torch.softmax(x, dim)``: reduced in fp32, the result in ``x``'s dtype and shape. ``x`` may
    have any leading shape, including no rows. Saves the output for the backward pass."""
    check_float(x, "x")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the one the softmax is over), got a 0-d tensor")
    d = check_dim(dim, "dim", x.dim())
    if small_calls.small(x.numel(), x):
        return torch.softmax(x, d)
    return moved_back(softmax_forward(moved_last(x, d)), d)
