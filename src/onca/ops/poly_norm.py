"""PolyNorm (Zhuo et al., "Polynomial Composition Activations", PolyCom): a learned combination of
RMS-normalised powers of the input, over the last dimension:

    y = weight[0] * norm(x**3) + weight[1] * norm(x**2) + weight[2] * norm(x) + bias,
    norm(u) = u / sqrt(mean(u**2) + eps)

``weight`` has shape ``(3,)`` and ``bias`` one element (shape ``()`` or ``(1,)``), as in the
PolyCom reference module and liger-kernel's ``LigerPolyNorm``. Everything is computed in fp32
(the powers included) with one rounding of the output to ``x``'s dtype.

Saved for backward: ``x`` and three fp32 ``rstd`` per row (of ``x``, ``x**2`` and ``x**3``); the
normalised powers are recomputed. With ``n_k = x**k * rstd_k`` and ``c_k`` the weight of
``n_k``, the backward is

    dx = sum_k c_k * rstd_k * (dy - n_k * mean(dy * n_k)) * k * x**(k - 1),
    dc_k = sum(dy * n_k),  dbias = sum(dy),

so each row needs its three dot products ``sum(dy * n_k)`` before its ``dx``: the single-pass
path holds the row, the column-tiled path makes two passes over it (dot products, then ``dx``),
per row block (no state crosses row blocks). The four parameter gradients are scalars summed over
every row: each program of a persistent grid keeps their sums in registers and adds them to a
4-wide partial row it shares with at most one other program (``onca.ops._partials``), summed once
at the end: deterministic.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch, row_launch
from onca.ops._partials import accumulate_partial, partial_buffer, partial_row, sum_partials
from onca.ops._row_norm import launch_forward
from onca.ops._rows import rows_cols, rows_in_place, rows_ready
from onca.ops._validate import check_bool, check_float, check_number, check_same_device
from onca.ops.rms_norm import grad_output_buffer, may_overwrite
from onca.tiling import RowPlan, plan_rows

__all__ = ["plan", "poly_norm"]

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=4)  # x, y; x, x**2, x**3, y in fp32
# x, dy, dx; x, dy, n1, n2, n3, dx in fp32. The backward reduces the parameter gradients into
# per-program partial sums: a persistent grid.
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=6, persistent=True)
# The parameter gradients' partial row: dweight[0..2], dbias.
N_GRADS = 4


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _power_sums(x):
    """Per row: the sums of ``x**2``, ``x**4`` and ``x**6`` over the tile's columns."""
    x2 = x * x
    x4 = x2 * x2
    return tl.sum(x2, axis=1), tl.sum(x4, axis=1), tl.sum(x4 * x2, axis=1)


@triton.jit
def _poly(x, r1, r2, r3, w1, w2, w3, bias):
    """``w3 * x**3 * r3 + w2 * x**2 * r2 + w1 * x * r1 + bias`` in fp32."""
    x2 = x * x
    return x2 * x * (w3 * r3)[:, None] + x2 * (w2 * r2)[:, None] + x * (w1 * r1)[:, None] + bias


@triton.jit
def _dots(x, dy):
    """Per row: ``sum(dy * x)``, ``sum(dy * x**2)``, ``sum(dy * x**3)`` and ``sum(dy)``."""
    dyx = dy * x
    dyx2 = dyx * x
    return tl.sum(dyx, axis=1), tl.sum(dyx2, axis=1), tl.sum(dyx2 * x, axis=1), tl.sum(dy, axis=1)


@triton.jit
def _poly_dx(x, dy, r1, r2, r3, m1, m2, m3, w1, w2, w3):
    """``sum_k w_k r_k (dy - x**k m_k) k x**(k-1)`` with ``m_k = mean(dy * n_k) * r_k``."""
    x2 = x * x
    dx = (w1 * r1)[:, None] * (dy - x * m1[:, None])
    dx += (2.0 * w2 * r2)[:, None] * x * (dy - x2 * m2[:, None])
    dx += (3.0 * w3 * r3)[:, None] * x2 * (dy - x2 * x * m3[:, None])
    return dx


@fast_launch
@triton.jit
def _poly_norm_forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, y_row_stride, eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    w3 = tl.load(w_ptr).to(tl.float32)  # the weight of norm(x**3)
    w2 = tl.load(w_ptr + 1).to(tl.float32)
    w1 = tl.load(w_ptr + 2).to(tl.float32)
    bias = tl.load(b_ptr).to(tl.float32)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            s1, s2, s3 = _power_sums(x)
            r1 = tl.rsqrt(s1 / n_cols + eps)
            r2 = tl.rsqrt(s2 / n_cols + eps)
            r3 = tl.rsqrt(s3 / n_cols + eps)
            y = _poly(x, r1, r2, r3, w1, w2, w3, bias)
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            s1 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            s2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            s3 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                t1, t2, t3 = _power_sums(x)
                s1 += t1
                s2 += t2
                s3 += t3
            r1 = tl.rsqrt(s1 / n_cols + eps)
            r2 = tl.rsqrt(s2 / n_cols + eps)
            r3 = tl.rsqrt(s3 / n_cols + eps)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = _poly(x, r1, r2, r3, w1, w2, w3, bias)
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        rstd_rows = rstd_ptr + rows.to(tl.int64) * 3
        tl.store(rstd_rows, r1, mask=row_mask)
        tl.store(rstd_rows + 1, r2, mask=row_mask)
        tl.store(rstd_rows + 2, r3, mask=row_mask)


@fast_launch
@triton.jit
def _poly_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, grads_partial_ptr,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    w3 = tl.load(w_ptr).to(tl.float32)
    w2 = tl.load(w_ptr + 1).to(tl.float32)
    w1 = tl.load(w_ptr + 2).to(tl.float32)
    # This program's sums of dweight[2], dweight[1], dweight[0] and dbias over its rows.
    acc1 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        dy_rows = dy_ptr + rows64 * dy_row_stride
        dx_rows = dx_ptr + rows64 * dx_row_stride
        rstd_rows = rstd_ptr + rows.to(tl.int64) * 3
        r1 = tl.load(rstd_rows, mask=row_mask, other=0.0)
        r2 = tl.load(rstd_rows + 1, mask=row_mask, other=0.0)
        r3 = tl.load(rstd_rows + 2, mask=row_mask, other=0.0)
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            d1, d2, d3, db = _dots(x, dy)
        else:
            # Pass 1: the row's dot products, tile by tile.
            d1 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            d2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            d3 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            db = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                t1, t2, t3, tb = _dots(x, dy)
                d1 += t1
                d2 += t2
                d3 += t3
                db += tb
        # sum(dy * n_k) = r_k * sum(dy * x**k): the parameter gradients' terms of these rows.
        d1 *= r1
        d2 *= r2
        d3 *= r3
        acc1 += d1
        acc2 += d2
        acc3 += d3
        acc_b += db
        m1 = d1 * r1 / n_cols
        m2 = d2 * r2 / n_cols
        m3 = d3 * r3 / n_cols
        if COL_TILES == 1:
            dx = _poly_dx(x, dy, r1, r2, r3, m1, m2, m3, w1, w2, w3)
            tl.store(dx_rows + col_offsets[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            # Pass 2: dx, tile by tile.
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dx = _poly_dx(x, dy, r1, r2, r3, m1, m2, m3, w1, w2, w3)
                tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    index = tl.arange(0, 4)
    grads = tl.where(index == 0, tl.sum(acc3, axis=0),
                     tl.where(index == 1, tl.sum(acc2, axis=0),
                              tl.where(index == 2, tl.sum(acc1, axis=0), tl.sum(acc_b, axis=0))))
    accumulate_partial(partial_row(grads_partial_ptr, 4), index, grads, index < 4, False)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., hidden)``)."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, **BACKWARD_TILES),
    }


@custom_op("poly_norm_forward")
def poly_norm_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float,
                      overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` for ``x`` of any leading shape; ``rstd`` is fp32 ``(rows, 3)``: of ``x``,
    ``x**2``, ``x**3``. ``overwrite_grad_output`` is the backward's (see ``poly_norm``). The op
    takes ``x`` whole: a reshape outside it would add autograd view nodes."""
    cols = x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    rstd = x.new_empty((rows, 3), dtype=torch.float32)
    if rows == 0:
        return y, rstd
    launch_forward(_poly_norm_forward_kernel, (x, weight, bias, y, rstd, rows, cols, x_stride, cols, eps),
                   rows, cols, x.dtype, FORWARD_TILES)
    return y, rstd


@poly_norm_forward.register_fake
def _(x, weight, bias, eps, overwrite_grad_output):
    return x.new_empty(x.shape), x.new_empty((math.prod(x.shape[:-1]), 3), dtype=torch.float32)


@custom_op("poly_norm_backward")
def poly_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, rstd: Tensor,
                       overwrite_grad_output: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` in the dtypes and shapes of ``x``, ``weight`` and ``bias`` (read for
    its dtype and shape only); with ``overwrite_grad_output`` (eager route only) ``dx`` is written
    into ``dy``'s storage. ``dy``, ``x`` and ``dx`` have any leading shape, the same."""
    cols = x.shape[-1]
    dx = grad_output_buffer(dy, x, overwrite_grad_output)
    x, rows, x_stride = rows_in_place(x)
    dy, _, dy_stride = rows_in_place(dy)
    if rows == 0:
        return dx, torch.zeros_like(weight), torch.zeros_like(bias)
    grid, kwargs, p = row_launch(_poly_norm_backward_kernel, rows, cols, x.dtype, BACKWARD_TILES, {})
    partials = partial_buffer(p.grid, N_GRADS, x.device)
    _poly_norm_backward_kernel[grid](dy, x, weight, rstd, dx, partials, rows, cols, dy_stride, x_stride, cols,
                                     **kwargs)
    grads = sum_partials(partials)
    return dx, grads[:3].to(weight.dtype), grads[3].to(bias.dtype).reshape(bias.shape)


@poly_norm_backward.register_fake
def _(dy, x, weight, bias, rstd, overwrite_grad_output):
    return x.new_empty(x.shape), torch.empty_like(weight), torch.empty_like(bias)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps, overwrite_grad_output = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, bias, rstd)
    ctx.overwrite_grad_output = overwrite_grad_output


def _backward(ctx, dy, _drstd):
    x, weight, bias, rstd = ctx.saved_tensors
    overwrite = may_overwrite(ctx.overwrite_grad_output, dy, x)
    dx, dw, db = poly_norm_backward(dy, x, weight, bias, rstd, overwrite)
    need = ctx.needs_input_grad
    return dx, dw if need[1] else None, db if need[2] else None, None, None


register_autograd(poly_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def poly_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-6,
              overwrite_grad_output: bool = False) -> Tensor:
    """PolyNorm over the last dimension:
    ``weight[0] * norm(x**3) + weight[1] * norm(x**2) + weight[2] * norm(x) + bias`` with
    ``norm(u) = u / sqrt(mean(u**2) + eps)``.

    ``weight``: shape ``(3,)``; ``bias``: one element (shape ``()`` or ``(1,)``), as in PolyCom's
    module and liger-kernel's ``LigerPolyNorm`` (whose ``in_place`` is ``overwrite_grad_output``
    here). Powers, norms and sums in fp32, one rounding to ``x``'s dtype; the parameters may be
    fp32 with bf16/fp16 ``x`` and their gradients keep their dtypes. ``x`` may have any leading
    shape, including no rows. ``overwrite_grad_output=True`` lets the backward pass write ``dx``
    into the storage of the gradient that arrives for the output (eager only).
    """
    check_float(x, "x")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (the normalised one), got shape {tuple(x.shape)}")
    check_float(weight, "weight")
    if weight.shape != (3,):
        raise ValueError(f"weight must have shape (3,) (the weights of x**3, x**2, x), got {tuple(weight.shape)}")
    check_float(bias, "bias")
    if bias.dim() > 1 or bias.numel() != 1:
        raise ValueError(f"bias must have one element (shape () or (1,)), got shape {tuple(bias.shape)}")
    check_same_device(weight, "weight", x, "x")
    check_same_device(bias, "bias", x, "x")
    check_number(eps, "eps", minimum=0.0)
    check_bool(overwrite_grad_output, "overwrite_grad_output")
    y, _ = poly_norm_forward(rows_ready(x), weight.contiguous(), bias.contiguous(), float(eps),
                             overwrite_grad_output)
    return y
