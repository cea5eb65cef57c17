"""RMSNorm: ``y = x / sqrt(mean(x**2) + eps) * (offset + w)`` over the last dimension.

Casting modes follow the Hugging Face models they replace:

- ``llama``: normalise in fp32, cast to the input dtype, then multiply by the weight;
- ``gemma``: normalise and multiply in fp32, then cast (Gemma's weight is used as ``1 + w``);
- ``none``: the normalised row and the product are rounded to the input dtype (the reduction still
  accumulates in fp32).

The output has the input's dtype. Saved for backward: the input ``x`` and one fp32 ``rstd`` per row;
the normalised row is recomputed in the backward pass rather than stored.

Each kernel has a single-pass path (a whole row, or several, in one tile) and a column-tiled path,
chosen by the plan. The tiled forward reduces over the row's tiles, then applies (the second read
mostly hits L2). The tiled backward first computes each row's ``mean(dn * n)``, then walks column
tile by column tile over all of its program's rows, so that the tile's ``dW`` stays in registers.
``dW`` is reduced deterministically: each program of a persistent grid sums its rows in registers
and adds them to a partial row it shares with at most one other program (see ``_partials``), and
the partial rows are summed once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile
from onca.ops._partials import accumulate_partial, partial_buffer, partial_row, sum_partials
from onca.ops._validate import as_rows, check_float, check_last_dim, check_nonempty, check_same_device
from onca.tiling import RowPlan, plan_rows

__all__ = ["rms_norm", "RMSNormFunction", "CASTING_MODES", "plan"]

CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=2)  # x, w, y; x and y in fp32
BACKWARD_TILES = dict(live_tiles=4, fp32_tiles=5)  # x, dy, w, dx; x, dy, n, dn, dx in fp32


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _normalized(x, rstd, CASTING: tl.constexpr, X_DTYPE: tl.constexpr):
    """``x * rstd`` as the casting mode sees it: rounded to the input dtype except in gemma mode."""
    n = x * rstd[:, None]
    if CASTING != 1:
        n = n.to(X_DTYPE).to(tl.float32)
    return n


@triton.jit
def _scale(n, w, offset, CASTING: tl.constexpr, X_DTYPE: tl.constexpr):
    scale = w.to(tl.float32) + offset
    if CASTING == 2:
        scale = scale.to(X_DTYPE).to(tl.float32)
    return n * scale[None, :]


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, y_row_stride,
    eps, offset,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
        y_rows = y_ptr + rows.to(tl.int64)[:, None] * y_row_stride
        if COL_TILES == 1:
            col_mask = col_offsets < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
            w = tl.load(w_ptr + col_offsets, mask=col_mask, other=0.0)
            y = _scale(_normalized(x, rstd, CASTING, X_DTYPE), w, offset, CASTING, X_DTYPE)
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            sum_sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sum_sq += tl.sum(x * x, axis=1)
            rstd = tl.rsqrt(sum_sq / n_cols + eps)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
                y = _scale(_normalized(x, rstd, CASTING, X_DTYPE), w, offset, CASTING, X_DTYPE)
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, c_ptr,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride, offset,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    # This program's row of the partial-sum buffer, shared with at most one other program.
    dw_row = partial_row(dw_partial_ptr, n_cols)
    if COL_TILES == 1:
        col_mask = col_offsets < n_cols
        w = tl.load(w_ptr + col_offsets, mask=col_mask, other=0.0)
        dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            n = _normalized(x.to(tl.float32), rstd, CASTING, X_DTYPE)
            dw_acc += tl.sum(dy * n, axis=0)
            dn = _scale(dy, w, offset, CASTING, X_DTYPE)
            c = tl.sum(dn * n, axis=1) / n_cols
            dx = (dn - n * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64 * dx_row_stride + col_offsets[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
        accumulate_partial(dw_row, col_offsets, dw_acc, col_mask)
    else:
        # Phase 1, row by row: c = mean(dn * n) of each of this program's rows, kept in `c_ptr`.
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            dot = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
                n = _normalized(x.to(tl.float32), rstd, CASTING, X_DTYPE)
                dot += tl.sum(_scale(dy.to(tl.float32), w, offset, CASTING, X_DTYPE) * n, axis=1)
            tl.store(c_ptr + rows, dot / n_cols, mask=row_mask)
        # The rows' c were written by other threads of this program.
        tl.debug_barrier()
        # Phase 2, column tile by column tile: dx of every row of this program, and the tile's dW
        # summed over them in registers (no read-modify-write of the partial row).
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
            dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            for row_block in tl.range(pid, n_row_blocks, n_programs):
                rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
                row_mask = rows < n_rows
                rows64 = rows.to(tl.int64)[:, None]
                mask = row_mask[:, None] & col_mask[None, :]
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                c = tl.load(c_ptr + rows, mask=row_mask, other=0.0)
                x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = dy.to(tl.float32)
                n = _normalized(x.to(tl.float32), rstd, CASTING, X_DTYPE)
                dn = _scale(dy, w, offset, CASTING, X_DTYPE)
                dx = (dn - n * c[:, None]) * rstd[:, None]
                tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw_acc += tl.sum(dy * n, axis=0)
            accumulate_partial(dw_row, cols, dw_acc, col_mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., hidden)``)."""
    rows, cols = _rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, persistent=True, **BACKWARD_TILES),
    }


def _rows_cols(shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    cols = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, cols


def rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: int):
    rows, cols = x2d.shape
    p = plan_rows(rows, cols, x2d.dtype, **FORWARD_TILES)
    y = torch.empty((rows, cols), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    _rms_norm_forward_kernel[(p.grid,)](
        x2d, weight, y, rstd,
        rows, cols, x2d.stride(0), y.stride(0),
        eps, offset,
        CASTING=casting, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return y, rstd


def rms_norm_backward(dy2d, x2d, weight, rstd, offset: float, casting: int, in_place: bool):
    rows, cols = x2d.shape
    p = plan_rows(rows, cols, x2d.dtype, persistent=True, **BACKWARD_TILES)
    dx = dy2d if in_place else torch.empty((rows, cols), dtype=x2d.dtype, device=x2d.device)
    dw_partial = partial_buffer(p.grid, cols, x2d.device)
    # The column-tiled path keeps each row's mean(dn * n) between its two phases.
    c = rstd if p.single_pass else torch.empty(rows, dtype=torch.float32, device=x2d.device)
    _rms_norm_backward_kernel[(p.grid,)](
        dy2d, x2d, weight, rstd, dx, dw_partial, c,
        rows, cols, dy2d.stride(0), x2d.stride(0), dx.stride(0), offset,
        CASTING=casting, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return dx, sum_partials(dw_partial, weight.dtype)


# ---------------------------------------------------------------------------------------- autograd


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper. Saves ``x`` (as the 2-D view used by the kernels) and fp32 ``rstd``."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting_mode, in_place):
        casting = _validate(x, weight, eps, casting_mode)
        x2d = as_rows(x)
        weight = weight.contiguous()
        y, rstd = rms_norm_forward(x2d, weight, float(eps), float(offset), casting)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset, ctx.casting, ctx.in_place, ctx.x_shape = float(offset), casting, in_place, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        in_place = ctx.in_place and dy2d.is_contiguous() and dy2d.dtype == x2d.dtype
        if not in_place:
            dy2d = as_rows(dy2d)
        dx, dw = rms_norm_backward(dy2d, x2d, weight, rstd, ctx.offset, ctx.casting, in_place)
        return dx.view(ctx.x_shape), dw, None, None, None, None


def _validate(x, weight, eps, casting_mode) -> int:
    check_float(x, "x")
    check_float(weight, "weight")
    check_nonempty(x, "x")
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D (hidden_size,), got shape {tuple(weight.shape)}")
    check_last_dim(x, "x", weight.shape[0], "the weight's hidden size")
    check_same_device(weight, "weight", x, "x")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    return CASTING_MODES[casting_mode]


def rms_norm(x, weight, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False):
    """RMSNorm over the last dimension of ``x`` (any leading shape). See the module docstring."""
    return RMSNormFunction.apply(x, weight, eps, offset, casting_mode, in_place)
