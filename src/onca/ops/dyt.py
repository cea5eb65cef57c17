"""DyT (dynamic tanh, Zhu et al. 2025, "Transformers without Normalization"): a normalisation-free
replacement for LayerNorm/RMSNorm, ``y = weight * tanh(alpha * x) + bias`` over the last dimension.

``alpha`` is learnable: a scalar (shape ``()`` or ``(1,)``, the paper's and liger-kernel's) or one
value per channel (shape ``(hidden,)``). ``weight`` (the paper's ``weight``, liger's ``gamma``) is a
``(hidden,)`` vector; ``bias`` (liger's ``beta``) is optional. Everything is computed in fp32 with
one rounding of the output to ``x``'s dtype; ``tanh(z)`` is evaluated as ``2 * sigmoid(2z) - 1``,
which saturates to exactly +-1.

There is no reduction along a row, so the kernels have one path: a row is covered by its column
tiles (one tile when it fits the plan's block, several otherwise) and each tile is independent.
Saved for backward: ``x`` (``tanh`` is recomputed rather than stored), ``alpha``, ``weight`` and
``bias`` (the bias for its gradient's dtype only). The parameter gradients are sums over rows,
reduced deterministically through per-program partial rows (``onca.ops._partials``); a scalar
``alpha``'s gradient is the sum of the per-channel one. Only the gradients autograd asks for are
computed.
"""

from __future__ import annotations

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
from onca.ops._validate import check_float, check_same_device
from onca.tiling import RowPlan

__all__ = ["dyt", "plan"]

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
FORWARD_TILES = dict(live_tiles=4, fp32_tiles=3)  # x, w, b, y; x, tanh, y in fp32
# x, dy, w, dx; x, dy, tanh, dx; and one row of the three column accumulators (dalpha, dweight,
# dbias). Counted as full tiles, the accumulators kept two-row tiles out of reach: on an H100 (bf16,
# 16384 rows, CUDA-graph replays) two-row tiles of 8192 columns at 16 warps took the backward from
# 372 to 321 us at hidden 8192 and from 290 to 209 at 5376. A row's column tiles are independent
# (dx is elementwise; the sums are per column), so a wide row is not halved into two-pass tiles,
# and a GPU tile takes 4 rows (the rule's 8 at 1024 columns, 2 at 4096), as measured on the H100
# (backward op, device time, 16384 rows): hidden 1024 134 -> 89 us (4 x 1024 at 4 warps), 4096
# 202 -> 166 (4 x 4096 at 16 warps), 16384 832 -> 621 (2 x 8192 at 16 warps, liger-kernel 621);
# 2048 keeps 4 x 2048 (107), 5376 and 8192 2 x 8192 (the budget's cap).
BACKWARD_TILES = dict(live_tiles=4, fp32_tiles=4, column_fp32=3, row_state=False,
                      min_gpu_rows=4, max_gpu_rows=4)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(z):
    """``tanh(z) = 2 * sigmoid(2z) - 1``: exact +-1 where it saturates, no overflow."""
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


@triton.jit
def _alpha(alpha_ptr, cols, col_mask, ALPHA_PER_CHANNEL: tl.constexpr):
    """The fp32 ``alpha`` of the columns ``cols``, as a row vector (or a broadcast scalar)."""
    if ALPHA_PER_CHANNEL:
        a = tl.load(alpha_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    else:
        a = tl.load(alpha_ptr).to(tl.float32)
    return a


@fast_launch
@triton.jit
def _dyt_forward_kernel(
    x_ptr, alpha_ptr, w_ptr, b_ptr, y_ptr,
    n_rows, n_cols, x_row_stride, y_row_stride,
    ALPHA_PER_CHANNEL: tl.constexpr,
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
        rows64 = rows.to(tl.int64)[:, None]
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            a = _alpha(alpha_ptr, cols, col_mask, ALPHA_PER_CHANNEL)
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = _tanh(a * x) * w[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _dyt_backward_kernel(
    dy_ptr, x_ptr, alpha_ptr, w_ptr, dx_ptr,
    n_rows, n_cols, dy_row_stride, x_row_stride, dx_row_stride,
    da_partial_ptr, dw_partial_ptr, db_partial_ptr, _scratch_ptr,
    ALPHA_PER_CHANNEL: tl.constexpr,
    COMPUTE_DA: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    DIRECT_PARTIALS: tl.constexpr,
):
    # With t = tanh(alpha * x) and g = w * dy * (1 - t^2):
    #   dx = alpha * g,  dalpha = sum x * g,  dW = sum_rows dy * t,  dB = sum_rows dy
    # One row per block (the widest rows, in column tiles) walks a contiguous range of rows: 4%
    # faster on an H100 at 16384 x 16384 bf16 (825 against 858 us); with one row of 8192 columns
    # the strided walk was 6% faster.
    first, end, step = program_row_blocks(tl.cdiv(n_rows, BLOCK_ROWS), BLOCK_ROWS == 1)
    col_offsets = tl.arange(0, BLOCK_COLS)
    da_row = partial_row(da_partial_ptr, n_cols)
    dw_row = partial_row(dw_partial_ptr, n_cols)
    db_row = partial_row(db_partial_ptr, n_cols)
    # Column tile by column tile, over all of this program's rows: the tile's parameter gradients
    # stay in registers (no read-modify-write of the partial rows until the tile is done).
    for tile in range(COL_TILES):
        cols = tile * BLOCK_COLS + col_offsets
        col_mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = _alpha(alpha_ptr, cols, col_mask, ALPHA_PER_CHANNEL)
        da_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for row_block in tl.range(first, end, step):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            t = _tanh(a * x)
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * t, axis=0)
            if COMPUTE_DB:
                db_acc += tl.sum(dy, axis=0)
            g = dy * w[None, :] * (1.0 - t * t)
            if COMPUTE_DA:
                da_acc += tl.sum(g * x, axis=0)
            tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], (g * a).to(dx_ptr.dtype.element_ty),
                     mask=mask)
        if COMPUTE_DA:
            accumulate_partial(da_row, cols, da_acc, col_mask, DIRECT_PARTIALS)
        if COMPUTE_DW:
            accumulate_partial(dw_row, cols, dw_acc, col_mask, DIRECT_PARTIALS)
        if COMPUTE_DB:
            accumulate_partial(db_row, cols, db_acc, col_mask, DIRECT_PARTIALS)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., hidden)``)."""
    return plans(shape, dtype, FORWARD_TILES, BACKWARD_TILES, profile)


@custom_op("dyt_forward")
def dyt_forward(x: Tensor, alpha: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``y`` for ``x`` of any leading shape; ``alpha`` has one element or one per column. The op
    takes ``x`` whole: a reshape outside it would add autograd view nodes."""
    cols = x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    if rows == 0:
        return y
    launch_forward(
        _dyt_forward_kernel,
        (x, alpha, weight, x if bias is None else bias, y, rows, cols, x_stride, cols),
        rows, cols, x.dtype, FORWARD_TILES,
        ALPHA_PER_CHANNEL=_per_channel(alpha), HAS_BIAS=bias is not None,
    )
    return y


def _per_channel(alpha: Tensor) -> bool:
    """Whether ``alpha`` holds one value per channel (a ``(hidden,)`` vector with hidden > 1)."""
    return alpha.numel() > 1


@dyt_forward.register_fake
def _(x, alpha, weight, bias):
    return x.new_empty(x.shape)


@custom_op("dyt_backward")
def dyt_backward(dy: Tensor, x: Tensor, alpha: Tensor, weight: Tensor, bias: Tensor | None, compute_dalpha: bool,
                 compute_dweight: bool, compute_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dalpha, dweight, dbias)``, each parameter gradient in its parameter's dtype and
    shape; one not computed is empty. ``bias`` is read for its dtype only. ``dy``, ``x`` and
    ``dx`` have any leading shape, the same."""
    cols = x.shape[-1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    dy, _, dy_stride = rows_in_place(dy)
    dtypes = (torch.float32 if compute_dalpha else None, weight.dtype if compute_dweight else None,
              bias.dtype if compute_dbias else None)
    if rows == 0:
        # Sums over no rows: zero, as torch's.
        da, dw, db = (None if d is None else torch.zeros(cols, dtype=d, device=x.device) for d in dtypes)
    else:
        stand_in = torch.empty(1, dtype=torch.float32, device=x.device)
        da, dw, db = launch_backward(
            _dyt_backward_kernel,
            (dy, x, alpha, weight, dx, rows, cols, dy_stride, x_stride, cols),
            rows, cols, x.dtype, BACKWARD_TILES,
            grad_dtypes=dtypes, row_stats=0, stand_in=stand_in,
            ALPHA_PER_CHANNEL=_per_channel(alpha), COMPUTE_DA=compute_dalpha, COMPUTE_DW=compute_dweight,
            COMPUTE_DB=compute_dbias,
        )
    if da is not None:
        # A scalar alpha's gradient is the sum of the per-channel one (a fixed-order sum).
        da = (da if _per_channel(alpha) else da.sum()).to(alpha.dtype).reshape(alpha.shape)
    empty = x.new_empty(0)
    return dx, empty if da is None else da, empty if dw is None else dw, empty if db is None else db


@dyt_backward.register_fake
def _(dy, x, alpha, weight, bias, compute_dalpha, compute_dweight, compute_dbias):
    empty = x.new_empty(0)
    return (x.new_empty(x.shape), torch.empty_like(alpha) if compute_dalpha else empty,
            torch.empty_like(weight) if compute_dweight else empty,
            torch.empty_like(bias) if compute_dbias else empty)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, alpha, weight, bias = inputs
    ctx.save_for_backward(x, alpha, weight, bias)


def _backward(ctx, dy):
    x, alpha, weight, bias = ctx.saved_tensors
    need = ctx.needs_input_grad
    compute_da, compute_dw, compute_db = need[1], need[2], bias is not None and need[3]
    dx, da, dw, db = dyt_backward(dy, x, alpha, weight, bias, compute_da, compute_dw, compute_db)
    return dx, da if compute_da else None, dw if compute_dw else None, db if compute_db else None


register_autograd(dyt_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(x, alpha, weight, bias) -> None:
    check_float(x, "x")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension (the channels), got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    check_float(alpha, "alpha")
    if alpha.dim() > 1 or alpha.numel() not in (1, hidden):
        raise ValueError(
            f"alpha must be a scalar (shape () or (1,)) or one value per channel ({hidden},), "
            f"got shape {tuple(alpha.shape)}"
        )
    check_same_device(alpha, "alpha", x, "x")
    check_float(weight, "weight")  # required: None is a TypeError naming it
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        check_float(t, name)
        if t.dim() != 1 or t.shape[0] != hidden:
            raise ValueError(f"{name} must be 1-D of x's last dimension ({hidden},), got shape {tuple(t.shape)}")
        check_same_device(t, name, x, "x")


def dyt(x: Tensor, alpha: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Dynamic tanh over the last dimension: ``weight * tanh(alpha * x) + bias``.

    ``alpha``: the learnable steepness, a scalar (shape ``()`` or ``(1,)``, as in the DyT paper and
    liger-kernel's ``LigerDyT``) or one value per channel (``(hidden,)``); ``weight``:
    ``(hidden,)`` (liger's ``gamma``); ``bias``: ``(hidden,)`` or None (liger's ``beta``).
    Computed in fp32, rounded once to ``x``'s dtype; the parameters may be fp32 with bf16/fp16
    ``x``, and each gradient has its parameter's dtype and shape. ``x`` may have any leading
    shape, including no rows.
    """
    _validate(x, alpha, weight, bias)
    if small_calls.same_dtype(x, alpha, weight, bias) and small_calls.small(x.numel(), x):
        y = torch.tanh(alpha * x) * weight
        return y if bias is None else y + bias
    return dyt_forward(rows_ready(x), alpha.contiguous(), weight.contiguous(),
                       None if bias is None else bias.contiguous())
