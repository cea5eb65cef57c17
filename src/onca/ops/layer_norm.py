"""LayerNorm over the last dimension: ``y = (x - mean(x)) / sqrt(var(x) + eps) * w + b``.

The arithmetic is ``torch.nn.functional.layer_norm``'s: mean and biased variance in fp32, the
affine transform in fp32, one rounding to the input dtype at the end. ``weight`` and ``bias`` are
optional (``elementwise_affine=False`` / ``bias=False``) and may have another floating dtype than
``x`` (an fp32 master weight with bf16 activations); the output has ``x``'s dtype.

Saved for backward: the input ``x`` (the 2-D view the kernels read), the weight, the bias (a
reference kept for its gradient's dtype; its values are not read), and one fp32 ``mean`` and one
fp32 ``rstd`` per row; the normalised row ``(x - mean) * rstd`` is recomputed in the backward pass
rather than stored. Only the parameter gradients autograd asks for are computed.

Each kernel has a single-pass path (a whole row, or several, in one tile) and a column-tiled path
chosen by the plan when a row does not fit the on-chip budget. The single-pass forward centres the
row it holds on chip before squaring (two-step variance). The column-tiled forward reduces the
row's statistics tile by tile: each tile's count, mean and sum of squared deviations from its own
mean (of the row shifted by its first element), merged into the running ones with Chan et al.'s
pairwise update, then applies the normalisation in a second pass. Both stay accurate when
``|mean| >> std``, where ``E[x**2] - E[x]**2`` in fp32 loses the variance entirely. The
column-tiled backward first computes each row's ``mean(w * dy * xhat)`` and ``mean(w * dy)``, then
walks column tile by column tile over all of its program's rows, so that the tile's ``dW`` and
``dB`` stay in registers.

``dW`` and ``dB`` are reduced deterministically: each program of a persistent grid sums its rows in
registers and adds them to partial rows it shares with at most one other program (see
``onca.ops._partials``), and the partial rows are summed once at the end.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._partials import accumulate_partial, partial_row, program_row_blocks
from onca.ops._row_norm import launch_backward, launch_forward, plans
from onca.ops._rows import rows_in_place, rows_ready
from onca.ops._validate import check_float, check_number, check_same_device
from onca.tiling import RowPlan

__all__ = ["layer_norm", "plan"]

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
# A row too wide for the forward's tile takes a whole-budget GPU tile (the planner's
# gpu_whole_two_pass): H100, bf16, forward + backward at 16384 x 32768, 2.95 -> 2.83 ms (2.86 with
# the backward's too, whose 16384-column tile spills).
# x, w, b, y; x - mean and y in fp32
FORWARD_TILES = dict(live_tiles=4, fp32_tiles=2, gpu_whole_two_pass=True)
# x, dy, w, dx; x, dy, xhat, w*dy, dx, dW/dB sums in fp32. A GPU tile takes at least 4 rows (the
# rule's 2 at 4096 columns, in 8 warps): H200, bf16, forward + backward (CUDA-graph replays) at
# 16384 x 4096 228.8 -> 192.8 us, 8192 x 4096 126.0 -> 106.3, Phi-3-mini's 16384 x 3072 204.3 ->
# 171.8; 16 warps, one program an SM (the 8-warp one took 160 registers, so one an SM ran anyway),
# and half the partial rows (peak 132.2 -> 130.2 MB).
BACKWARD_TILES = dict(live_tiles=4, fp32_tiles=6, min_gpu_rows=4)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _affine(xhat, w_ptr, b_ptr, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``xhat * w + b`` in fp32, for the columns ``cols`` of the row tile ``xhat``."""
    y = xhat
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    return y


@fast_launch
@triton.jit
def _layer_norm_forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, y_row_stride, eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
        y_rows = y_ptr + rows.to(tl.int64)[:, None] * y_row_stride
        if COL_TILES == 1:
            col_mask = col_offsets < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=1) / n_cols
            # Two-step variance on the row held on chip: exact centring, no cancellation.
            xc = tl.where(mask, x - mean[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
            y = _affine(xc * rstd[:, None], w_ptr, b_ptr, col_offsets, col_mask, HAS_WEIGHT, HAS_BIAS)
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            # Pass 1: per-tile (count, mean, M2) merged into the running row statistics (Chan).
            # The row is shifted by its first element, so that the tile means and their
            # differences are of the order of the spread, not of the mean (which may be far
            # larger: fp32 rounding of |mean| would otherwise leak into the variance through the
            # merge term). Every tile but the last is full: tile * BLOCK_COLS elements seen so far.
            shift = tl.load(x_ptr + rows.to(tl.int64) * x_row_stride, mask=row_mask, other=0.0)
            shift = shift.to(tl.float32)
            mean = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            m2 = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.where(mask, x - shift[:, None], 0.0)
                seen = tile * BLOCK_COLS * 1.0
                count = tl.minimum(n_cols - tile * BLOCK_COLS, BLOCK_COLS) * 1.0
                tile_mean = tl.sum(x, axis=1) / count
                d = tl.where(mask, x - tile_mean[:, None], 0.0)
                tile_m2 = tl.sum(d * d, axis=1)
                total = seen + count
                delta = tile_mean - mean
                mean = mean + delta * (count / total)
                m2 = m2 + tile_m2 + delta * delta * (seen * count / total)
            rstd = tl.rsqrt(m2 / n_cols + eps)
            # Pass 2: normalise and apply the affine transform, tile by tile.
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                xhat = ((x - shift[:, None]) - mean[:, None]) * rstd[:, None]
                y = _affine(xhat, w_ptr, b_ptr, cols, col_mask, HAS_WEIGHT, HAS_BIAS)
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
            mean += shift
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@fast_launch
@triton.jit
def _layer_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride,
    dw_partial_ptr, db_partial_ptr, c_ptr,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    DIRECT_PARTIALS: tl.constexpr,
):
    # With xhat = (x - mean) * rstd and g = w * dy:
    #   dx = (g - xhat * mean(g * xhat) - mean(g)) * rstd,  dW = sum_rows dy * xhat,  dB = sum_rows dy
    # One row per block (the widest rows) walks a contiguous range of rows: 5-7% faster on an H100
    # at 16384 x 16384 and 4096 x 16384 bf16; with two rows per block the strided walk was the
    # faster by 15-35% (16384 x 5376, 16384 x 8192), and from four rows on they were level.
    first, end, step = program_row_blocks(tl.cdiv(n_rows, BLOCK_ROWS), BLOCK_ROWS == 1)
    col_offsets = tl.arange(0, BLOCK_COLS)
    # This program's rows of the partial-sum buffers, each shared with at most one other program.
    dw_row = partial_row(dw_partial_ptr, n_cols)
    db_row = partial_row(db_partial_ptr, n_cols)
    if COL_TILES == 1:
        col_mask = col_offsets < n_cols
        dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for row_block in tl.range(first, end, step):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            # Masked columns load x = 0, so xhat is not 0 there; dy = 0 there keeps every sum exact.
            xhat = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                # Reloaded per row block (an L1 hit) rather than held in registers across the loop.
                g = dy * tl.load(w_ptr + col_offsets, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g = dy
            c1 = tl.sum(g * xhat, axis=1) / n_cols
            c2 = tl.sum(g, axis=1) / n_cols
            dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            tl.store(dx_ptr + rows64 * dx_row_stride + col_offsets[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
            # The parameter gradients after dx's store, not before it: on an H100 this order ran
            # 5-11% faster at 16384 rows of 5376, 8192 and 16384 bf16 columns, level at 3072 and
            # 4096, 3% slower at 1024 (CUDA-graph replays of the backward alone).
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if COMPUTE_DB:
                db_acc += tl.sum(dy, axis=0)
        if COMPUTE_DW:
            accumulate_partial(dw_row, col_offsets, dw_acc, col_mask, DIRECT_PARTIALS)
        if COMPUTE_DB:
            accumulate_partial(db_row, col_offsets, db_acc, col_mask, DIRECT_PARTIALS)
    else:
        # Phase 1, row by row: c1 = mean(g * xhat) and c2 = mean(g) of each of this program's
        # rows, kept in `c_ptr` (c1 at [row], c2 at [n_rows + row]).
        for row_block in tl.range(first, end, step):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            sum_gx = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            sum_g = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                g = dy.to(tl.float32)
                if HAS_WEIGHT:
                    g = g * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                xhat = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
                sum_gx += tl.sum(g * xhat, axis=1)
                sum_g += tl.sum(g, axis=1)
            tl.store(c_ptr + rows, sum_gx / n_cols, mask=row_mask)
            tl.store(c_ptr + n_rows + rows, sum_g / n_cols, mask=row_mask)
        # The rows' c1 and c2 were written by other threads of this program.
        tl.debug_barrier()
        # Phase 2, column tile by column tile: dx of every row of this program, and the tile's dW
        # and dB summed over them in registers (no read-modify-write of the partial rows).
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
            for row_block in tl.range(first, end, step):
                rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
                row_mask = rows < n_rows
                rows64 = rows.to(tl.int64)[:, None]
                mask = row_mask[:, None] & col_mask[None, :]
                mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
                rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
                c1 = tl.load(c_ptr + rows, mask=row_mask, other=0.0)
                c2 = tl.load(c_ptr + n_rows + rows, mask=row_mask, other=0.0)
                x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
                dy = dy.to(tl.float32)
                xhat = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
                if HAS_WEIGHT:
                    g = dy * w[None, :]
                else:
                    g = dy
                dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
                tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if COMPUTE_DW:
                    dw_acc += tl.sum(dy * xhat, axis=0)
                if COMPUTE_DB:
                    db_acc += tl.sum(dy, axis=0)
            if COMPUTE_DW:
                accumulate_partial(dw_row, cols, dw_acc, col_mask, DIRECT_PARTIALS)
            if COMPUTE_DB:
                accumulate_partial(db_row, cols, db_acc, col_mask, DIRECT_PARTIALS)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., hidden)``)."""
    return plans(shape, dtype, FORWARD_TILES, BACKWARD_TILES, profile)


@custom_op("layer_norm_forward")
def layer_norm_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                       eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` for ``x`` of any leading shape; ``mean`` and ``rstd`` are fp32, one per
    row. The op takes ``x`` whole: a reshape outside it would add autograd view nodes."""
    cols = x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    mean = x.new_empty(rows, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    if rows == 0:
        return y, mean, rstd
    launch_forward(
        _layer_norm_forward_kernel,
        (x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd,
         rows, cols, x_stride, cols, eps),
        rows, cols, x.dtype, FORWARD_TILES,
        # Measured on an H200 (bf16, 16384 rows): 0.28 against 0.43 ms at 16384 columns, 0.24 against
        # 0.39 at 12288, even at 8192; fp32 rows 2% slower capped, RMSNorm's forward up to 25%.
        cap_registers=x.element_size() == 2,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
    )
    return y, mean, rstd


@layer_norm_forward.register_fake
def _(x, weight, bias, eps):
    stat = x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)
    return x.new_empty(x.shape), stat, torch.empty_like(stat)


@custom_op("layer_norm_backward")
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                        rstd: Tensor, compute_dw: bool, compute_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``; a parameter gradient not computed is empty. ``bias`` is read for its
    dtype only (the backward does not need its values). ``dy``, ``x`` and ``dx`` have any leading
    shape, the same."""
    cols = x.shape[-1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    dy, _, dy_stride = rows_in_place(dy)
    dw_dtype = weight.dtype if compute_dw else None
    db_dtype = bias.dtype if compute_db else None
    if rows == 0:
        dw, db = (None if d is None else torch.zeros(cols, dtype=d, device=x.device)
                  for d in (dw_dtype, db_dtype))
    else:
        dw, db = launch_backward(
            _layer_norm_backward_kernel,
            (dy, x, x if weight is None else weight, mean, rstd, dx, rows, cols, dy_stride, x_stride, cols),
            rows, cols, x.dtype, BACKWARD_TILES,
            grad_dtypes=(dw_dtype, db_dtype), row_stats=2, stand_in=rstd,
            # 16-bit rows only, as measured (fp32 tiles took 150-255 registers, and would spill).
            cap_registers=x.element_size() == 2,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
        )
    return dx, _or_empty(dw, x), _or_empty(db, x)


def _or_empty(grad: Tensor | None, x: Tensor) -> Tensor:
    return x.new_empty(0) if grad is None else grad


@layer_norm_backward.register_fake
def _(dy, x, weight, bias, mean, rstd, compute_dw, compute_db):
    dw = torch.empty_like(weight) if compute_dw else x.new_empty(0)
    db = torch.empty_like(bias) if compute_db else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # The bias is saved for its dtype (the gradient's); the backward never reads its values.
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    compute_db = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = layer_norm_backward(dy, x, weight, bias, mean, rstd, compute_dw, compute_db)
    return dx, dw if compute_dw else None, db if compute_db else None, None


register_autograd(layer_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(x, weight, bias, eps) -> None:
    check_float(x, "x")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"x must have a non-empty last dimension (the normalised one), got shape {tuple(x.shape)}"
        )
    hidden = x.shape[-1]
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        check_float(t, name)
        if t.dim() != 1 or t.shape[0] != hidden:
            raise ValueError(
                f"{name} must be 1-D of x's last dimension ({hidden},), got shape {tuple(t.shape)}"
            )
        check_same_device(t, name, x, "x")
    check_number(eps, "eps", minimum=0.0)


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)`` with Onca's kernels:
    biased variance, fp32 statistics and affine transform, one rounding to ``x``'s dtype.
    ``weight`` and ``bias`` may be None; they may be fp32 with bf16/fp16 ``x``. ``x`` may have any
    leading shape, including no rows.
    """
    _validate(x, weight, bias, eps)
    if small_calls.same_dtype(x, weight, bias) and small_calls.small(x.numel(), x):
        # torch.nn.functional's op without its Python wrapper (its torch-function test is the
        # route's own): the same ATen call, about 2 us less host time a call.
        return torch.layer_norm(x, (x.shape[-1],), weight, bias, eps, torch.backends.cudnn.enabled)
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y, _, _ = layer_norm_forward(rows_ready(x), weight, bias, float(eps))
    return y
