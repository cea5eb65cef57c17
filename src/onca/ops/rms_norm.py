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
from torch import Tensor

from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._partials import accumulate_partial, partial_buffer, partial_row, sum_partials
from onca.ops._rows import as_rows, rows_cols
from onca.ops._validate import check_bool, check_float, check_last_dim, check_number, check_same_device
from onca.tiling import RowPlan, plan_rows

__all__ = ["rms_norm", "CASTING_MODES", "plan"]

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
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, persistent=True, **BACKWARD_TILES),
    }


@custom_op("rms_norm_forward")
def rms_norm_forward(x: Tensor, weight: Tensor, eps: float, offset: float, casting: int,
                     overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` for the 2-D ``x``; ``rstd`` is fp32, one per row. ``overwrite_grad_output`` is
    the backward's (see ``rms_norm``)."""
    rows, cols = x.shape
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, rstd
    p = plan_rows(rows, cols, x.dtype, **FORWARD_TILES)
    _rms_norm_forward_kernel[(p.grid,)](
        x, weight, y, rstd,
        rows, cols, x.stride(0), y.stride(0),
        eps, offset,
        CASTING=casting, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return y, rstd


@rms_norm_forward.register_fake
def _(x, weight, eps, offset, casting, overwrite_grad_output):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("rms_norm_backward")
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, offset: float, casting: int,
                      overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``; with ``overwrite_grad_output`` (eager route only) ``dx`` is written into
    ``dy``'s storage."""
    rows, cols = x.shape
    dx = dy if overwrite_grad_output else torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    p = plan_rows(rows, cols, x.dtype, persistent=True, **BACKWARD_TILES)
    dw_partial = partial_buffer(p.grid, cols, x.device)
    # The column-tiled path keeps each row's mean(dn * n) between its two phases.
    c = rstd if p.single_pass else torch.empty(rows, dtype=torch.float32, device=x.device)
    _rms_norm_backward_kernel[(p.grid,)](
        dy, x, weight, rstd, dx, dw_partial, c,
        rows, cols, dy.stride(0), x.stride(0), dx.stride(0), offset,
        CASTING=casting, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return dx, sum_partials(dw_partial, weight.dtype)


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, offset, casting, overwrite_grad_output):
    return torch.empty_like(x), torch.empty_like(weight)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset, casting, overwrite_grad_output = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset, ctx.casting, ctx.overwrite_grad_output = offset, casting, overwrite_grad_output


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    # The incoming gradient is reused only where the caller asked for it and it can hold dx.
    overwrite = (ctx.overwrite_grad_output and not tracing(dy) and dy.is_contiguous()
                 and dy.dtype == x.dtype)
    dx, dw = rms_norm_backward(as_rows(dy), x, weight, rstd, ctx.offset, ctx.casting, overwrite)
    return dx, dw, None, None, None, None


register_autograd(rms_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(x, weight, eps, offset, casting_mode) -> int:
    check_float(x, "x")
    check_float(weight, "weight")
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D (hidden_size,), got shape {tuple(weight.shape)}")
    check_last_dim(x, "x", weight.shape[0], "the weight's hidden size")
    check_same_device(weight, "weight", x, "x")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
    check_number(eps, "eps", minimum=0.0)
    check_number(offset, "offset")
    return CASTING_MODES[casting_mode]


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    overwrite_grad_output: bool = False,
) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (offset + weight)``.

    ``casting_mode`` is ``"llama"`` (normalise in fp32, cast to ``x``'s dtype, then scale),
    ``"gemma"`` (all in fp32, then cast; use with ``offset=1.0`` for Gemma's ``1 + w``) or
    ``"none"`` (round to ``x``'s dtype at each step). The result has ``x``'s dtype and shape; ``x``
    may have any leading shape, including no rows.
    ``overwrite_grad_output=True`` lets the backward pass write ``dx`` into the storage of the
    gradient that arrives for the output (eager only; compiled graphs manage their own buffers).
    """
    casting = _validate(x, weight, eps, offset, casting_mode)
    check_bool(overwrite_grad_output, "overwrite_grad_output")
    y, _ = rms_norm_forward(as_rows(x), weight.contiguous(), float(eps), float(offset), casting,
                            overwrite_grad_output)
    return y.view(x.shape)
