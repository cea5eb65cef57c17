"""Residual add fused with RMSNorm: ``h = x + residual``, returns ``(rms_norm(h), h)`` in one pass.

This is the pattern of every pre-norm decoder layer (Llama, Mistral, Qwen, Gemma, ...)::

    hidden_states = residual + hidden_states   # in the activations' dtype
    residual = hidden_states
    hidden_states = norm(hidden_states)

``h`` is rounded to the input dtype exactly as PyTorch's eager add rounds it (the sum is formed in
fp32 and rounded once), and the RMSNorm of ``h`` follows ``onca.ops.rms_norm``: the same casting
modes (``llama``, ``gemma``, ``none``), the same ``offset`` (Gemma's ``1 + w``) and the same jitted
helpers. Both outputs have the input's dtype.

Backward: ``x`` and ``residual`` receive the same gradient, ``d(rms_norm)/dh . dy + d_residual_out``;
one tensor is returned for both (as PyTorch's own add does). Saved for backward: ``h`` (which is
also the second output, so it costs no memory) and one fp32 ``rstd`` per row; the normalised row
is recomputed. With ``in_place=True`` the backward pass writes that gradient into the storage of
the incoming gradient of the normalised output.

Each kernel has a single-pass path and a column-tiled path, chosen by the plan, structured as
``onca.ops.rms_norm``'s: the tiled forward reduces over the row's tiles, then applies (the second
pass recomputes ``x + residual`` from the inputs rather than reading back ``h``); the tiled
backward first computes each row's ``mean(dn * n)``, then walks column tile by column tile over
all of its program's rows with the tile's ``dW`` in registers. ``dW`` is reduced deterministically
from partial rows each shared by at most two programs (see ``onca.ops._partials``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile
from onca.ops._partials import accumulate_partial, partial_buffer, partial_row, sum_partials
from onca.ops._rows import as_rows
from onca.ops._validate import check_float, check_last_dim, check_nonempty, check_same_device
from onca.ops.rms_norm import CASTING_MODES, _normalized, _scale
from onca.tiling import RowPlan, plan_rows

__all__ = ["fused_add_rms_norm", "FusedAddRMSNormFunction", "CASTING_MODES", "plan"]

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
FORWARD_TILES = dict(live_tiles=4, fp32_tiles=2)  # x, r, w, y (h replaces x + r); h and y in fp32
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=5)  # h, dy, d_res, w, dx; h, dy, n, dn, dx in fp32


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _residual_sum(x_rows, r_rows, cols, mask, X_DTYPE: tl.constexpr):
    """``x + residual`` rounded to the input dtype once, as PyTorch's eager add does."""
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return (x + r).to(X_DTYPE)


@triton.jit
def _fused_add_rms_norm_forward_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride, h_row_stride,
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
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        r_rows = r_ptr + rows64 * r_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        h_rows = h_ptr + rows64 * h_row_stride
        if COL_TILES == 1:
            col_mask = col_offsets < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            h = _residual_sum(x_rows, r_rows, col_offsets, mask, X_DTYPE)
            tl.store(h_rows + col_offsets[None, :], h, mask=mask)
            h = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
            w = tl.load(w_ptr + col_offsets, mask=col_mask, other=0.0)
            y = _scale(_normalized(h, rstd, CASTING, X_DTYPE), w, offset, CASTING, X_DTYPE)
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            sum_sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                h = _residual_sum(x_rows, r_rows, cols, mask, X_DTYPE)
                tl.store(h_rows + cols[None, :], h, mask=mask)
                h = h.to(tl.float32)
                sum_sq += tl.sum(h * h, axis=1)
            rstd = tl.rsqrt(sum_sq / n_cols + eps)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                # Recomputed (bit-identical) from the inputs: no read-back of this program's stores.
                h = _residual_sum(x_rows, r_rows, cols, mask, X_DTYPE).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
                y = _scale(_normalized(h, rstd, CASTING, X_DTYPE), w, offset, CASTING, X_DTYPE)
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _fused_add_rms_norm_backward_kernel(
    dy_ptr, dres_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, c_ptr,
    n_rows, n_cols, dy_row_stride, dres_row_stride, h_row_stride, dx_row_stride, offset,
    HAS_DRES: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    # RMSNorm's backward (see onca.ops.rms_norm) plus the gradient of the residual output.
    X_DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    # This program's row of the partial-sum buffer, shared with at most one other program.
    dw_row = partial_row(dw_partial_ptr, n_cols)
    if COL_TILES == 1:
        col_mask = col_offsets < n_cols
        dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            h = tl.load(h_ptr + rows64 * h_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            n = _normalized(h.to(tl.float32), rstd, CASTING, X_DTYPE)
            dw_acc += tl.sum(dy * n, axis=0)
            # The weight is reloaded per row block (an L1 hit) rather than held in registers
            # across the loop, beside the dW accumulator.
            w = tl.load(w_ptr + col_offsets, mask=col_mask, other=0.0)
            dn = _scale(dy, w, offset, CASTING, X_DTYPE)
            c = tl.sum(dn * n, axis=1) / n_cols
            dx = (dn - n * c[:, None]) * rstd[:, None]
            if HAS_DRES:
                dres = tl.load(dres_ptr + rows64 * dres_row_stride + col_offsets[None, :],
                               mask=mask, other=0.0)
                dx += dres.to(tl.float32)
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
                h = tl.load(h_ptr + rows64 * h_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
                n = _normalized(h.to(tl.float32), rstd, CASTING, X_DTYPE)
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
                h = tl.load(h_ptr + rows64 * h_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = dy.to(tl.float32)
                n = _normalized(h.to(tl.float32), rstd, CASTING, X_DTYPE)
                dn = _scale(dy, w, offset, CASTING, X_DTYPE)
                dx = (dn - n * c[:, None]) * rstd[:, None]
                if HAS_DRES:
                    dres = tl.load(dres_ptr + rows64 * dres_row_stride + cols[None, :], mask=mask, other=0.0)
                    dx += dres.to(tl.float32)
                tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw_acc += tl.sum(dy * n, axis=0)
            accumulate_partial(dw_row, cols, dw_acc, col_mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for inputs of ``shape`` (``(..., hidden)``)."""
    rows, cols = _rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, persistent=True, **BACKWARD_TILES),
    }


def _rows_cols(shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    return math.prod(shape[:-1]), shape[-1]


def fused_add_rms_norm_forward(x2d, r2d, weight, eps: float, offset: float, casting: int):
    rows, cols = x2d.shape
    p = plan_rows(rows, cols, x2d.dtype, **FORWARD_TILES)
    y = torch.empty((rows, cols), dtype=x2d.dtype, device=x2d.device)
    h = torch.empty((rows, cols), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    _fused_add_rms_norm_forward_kernel[(p.grid,)](
        x2d, r2d, weight, y, h, rstd,
        rows, cols, x2d.stride(0), r2d.stride(0), y.stride(0), h.stride(0),
        eps, offset,
        CASTING=casting, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return y, h, rstd


def fused_add_rms_norm_backward(dy2d, dres2d, h2d, weight, rstd, offset: float, casting: int, in_place: bool):
    """The gradient reaching ``x`` and ``residual`` (one tensor) and ``dW`` in the weight's dtype.

    ``dres2d`` may be None (the residual output took no gradient). With ``in_place`` the result
    is written into ``dy2d``'s storage.
    """
    rows, cols = h2d.shape
    p = plan_rows(rows, cols, h2d.dtype, persistent=True, **BACKWARD_TILES)
    dx = dy2d if in_place else torch.empty((rows, cols), dtype=h2d.dtype, device=h2d.device)
    dw_partial = partial_buffer(p.grid, cols, h2d.device)
    # The column-tiled path keeps each row's mean(dn * n) between its two phases.
    c = rstd if p.single_pass else torch.empty(rows, dtype=torch.float32, device=h2d.device)
    has_dres = dres2d is not None
    _fused_add_rms_norm_backward_kernel[(p.grid,)](
        dy2d, dres2d if has_dres else dy2d, h2d, weight, rstd, dx, dw_partial, c,
        rows, cols, dy2d.stride(0), dres2d.stride(0) if has_dres else 0, h2d.stride(0), dx.stride(0),
        offset,
        HAS_DRES=has_dres, CASTING=casting,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return dx, sum_partials(dw_partial, weight.dtype)


# ---------------------------------------------------------------------------------------- autograd


class FusedAddRMSNormFunction(torch.autograd.Function):
    """Autograd wrapper. Saves ``h = x + residual`` (the second output, already in memory) and
    fp32 ``rstd`` per row. Returns one tensor as the gradient of both ``x`` and ``residual``."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting_mode, in_place):
        casting = _validate(x, residual, weight, eps, casting_mode)
        x2d, r2d = as_rows(x), as_rows(residual)
        weight = weight.contiguous()
        y, h, rstd = fused_add_rms_norm_forward(x2d, r2d, weight, float(eps), float(offset), casting)
        ctx.save_for_backward(h, weight, rstd)
        ctx.offset, ctx.casting, ctx.in_place, ctx.x_shape = float(offset), casting, in_place, x.shape
        # Missing output gradients arrive as None instead of materialised zeros (see backward).
        ctx.set_materialize_grads(False)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dres):
        h2d, weight, rstd = ctx.saved_tensors
        shape = ctx.x_shape
        if dy is None:
            # Only the residual output was used: the normalised path contributes nothing.
            dw = torch.zeros_like(weight) if ctx.needs_input_grad[2] else None
            if dres is None:
                return None, None, dw, None, None, None, None
            return dres, dres, dw, None, None, None, None
        dy2d = dy.reshape(-1, dy.shape[-1])
        in_place = ctx.in_place and dy2d.is_contiguous() and dy2d.dtype == h2d.dtype
        if not in_place:
            dy2d = as_rows(dy2d)
        dres2d = None if dres is None else as_rows(dres.reshape(-1, dres.shape[-1]))
        dx, dw = fused_add_rms_norm_backward(
            dy2d, dres2d, h2d, weight, rstd, ctx.offset, ctx.casting, in_place
        )
        dx = dx.view(shape)
        return dx, dx, dw, None, None, None, None


def _validate(x, residual, weight, eps, casting_mode) -> int:
    check_float(x, "x")
    check_float(residual, "residual")
    check_float(weight, "weight")
    check_nonempty(x, "x")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D (hidden_size,), got shape {tuple(weight.shape)}")
    check_last_dim(x, "x", weight.shape[0], "the weight's hidden size")
    check_same_device(residual, "residual", x, "x")
    check_same_device(weight, "weight", x, "x")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite non-negative number, got {eps!r}")
    return CASTING_MODES[casting_mode]


def fused_add_rms_norm(x, residual, weight, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False):
    """``(rms_norm(x + residual), x + residual)`` over the last dimension. See the module docstring."""
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, casting_mode, in_place)
