"""RMSNorm: ``y = x / sqrt(mean(x**2) + eps) * (offset + w)`` over the last dimension.

Casting modes follow the Hugging Face models they replace:

- ``llama``: normalise in fp32, cast to the input dtype, then multiply by the weight;
- ``gemma``: normalise and multiply in fp32, then cast (Gemma's weight is used as ``1 + w``);
- ``none``: the normalised row and the product are rounded to the input dtype (the reduction still
  accumulates in fp32).

Without a weight (``elementwise_affine=False``) there is no scale: ``y`` is the normalised row cast
to the input dtype in every mode, as ``torch.nn.functional.rms_norm(x, shape, None, eps)``.

The output has the input's dtype. Saved for backward: the input ``x`` and one fp32 ``rstd`` per row;
the normalised row is recomputed in the backward pass rather than stored.

The kernels also serve the fused residual add (``onca.ops.fused_add_rms_norm``) through constexpr
switches that cost nothing when off: with ``HAS_RESIDUAL`` the forward normalises
``h = x + residual`` and stores ``h``; with ``HAS_RESIDUAL_GRAD`` the backward adds the residual
output's incoming gradient to ``dx``.

Each kernel has a single-pass path (a whole row, or several, in one tile) and a column-tiled path,
chosen by the plan. The tiled forward reduces over the row's tiles, then applies (the second read
mostly hits L2). The tiled backward first computes each row's ``mean(dn * n)``, then walks column
tile by column tile over all of its program's rows, so that the tile's ``dW`` stays in registers.
``dW`` is reduced deterministically: each program of a persistent grid sums its rows in registers
and adds them to a partial row it shares with at most one other program (see ``_partials``), and
the partial rows are summed once at the end.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch
from onca.ops._partials import accumulate_partial, partial_row
from onca.ops._row_norm import launch_backward, launch_forward, plans
from onca.ops._rows import rows_in_place, rows_ready
from onca.ops._validate import check_bool, check_float, check_last_dim, check_number, check_same_device
from onca.tiling import RowPlan

__all__ = ["CASTING_MODES", "launch_rms_norm_backward", "launch_rms_norm_forward", "plan", "rms_norm"]

CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
# A row too wide for one tile takes a whole-budget GPU tile (the planner's gpu_whole_two_pass): H100,
# bf16, forward + backward at 16384 x 32768, 2.85 -> 2.80 ms for the forward's, 2.65 with the
# backward's too. The residual kernels keep half-budget tiles: 4.69 -> 5.11 ms with whole ones.
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=2, gpu_whole_two_pass=True)  # x, w, y; x and y in fp32
# x, dy, w, dx; x, dy, n, dn, dx in fp32
BACKWARD_TILES = dict(live_tiles=4, fp32_tiles=5, gpu_whole_two_pass=True)
# With the residual: x, r, w, y (h replaces x + r); h and y in fp32.
RESIDUAL_FORWARD_TILES = dict(live_tiles=4, fp32_tiles=2)
# With the residual output's gradient: h, dy, d_res, w, dx; h, dy, n, dn, dx in fp32. GPU tiles of
# at least 4 rows (the rule gives 2 from 3072 to 4096 columns): H100, bf16, backward op device time
# at 16384 rows, 229 -> 203 us at hidden 4096 and 214 -> 187 at 3584 (4 x 4096 at 16 warps); at
# 1024 the rule's 8 rows stay (72 us, against 77 with 4). RMSNorm's own backward measured 156 ->
# 163 us with 4 rows at 4096 and keeps the rule.
RESIDUAL_BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=5, min_gpu_rows=4)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _input_tile(x_rows, r_rows, h_rows, cols, mask, HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr,
                X_DTYPE: tl.constexpr):
    """The fp32 tile that is normalised: ``x``, or ``h = x + residual`` rounded to the input dtype
    once, as PyTorch's eager add rounds it (and stored to ``h`` when ``STORE_SUM``)."""
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X_DTYPE)
        if STORE_SUM:
            tl.store(h_rows + cols[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _weight(w_ptr, cols, col_mask, HAS_WEIGHT: tl.constexpr):
    """The weight's tile; without a weight, a placeholder that ``_scale`` never reads."""
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
    else:
        w = 0.0
    return w


@triton.jit
def _normalized(x, rstd, CASTING: tl.constexpr, X_DTYPE: tl.constexpr):
    """``x * rstd`` as the casting mode sees it: rounded to the input dtype except in gemma mode."""
    n = x * rstd[:, None]
    if CASTING != 1:
        n = n.to(X_DTYPE).to(tl.float32)
    return n


@triton.jit
def _scale(n, w, offset, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr, X_DTYPE: tl.constexpr):
    if HAS_WEIGHT:
        scale = w.to(tl.float32) + offset
        if CASTING == 2:
            scale = scale.to(X_DTYPE).to(tl.float32)
        n = n * scale[None, :]
    return n


@fast_launch
@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr,
    n_rows, n_cols, x_row_stride, r_row_stride, y_row_stride, h_row_stride,
    eps, offset,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
            x = _input_tile(x_rows, r_rows, h_rows, col_offsets, mask, HAS_RESIDUAL, True, X_DTYPE)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
            w = _weight(w_ptr, col_offsets, col_mask, HAS_WEIGHT)
            y = _scale(_normalized(x, rstd, CASTING, X_DTYPE), w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            sum_sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = _input_tile(x_rows, r_rows, h_rows, cols, mask, HAS_RESIDUAL, True, X_DTYPE)
                sum_sq += tl.sum(x * x, axis=1)
            rstd = tl.rsqrt(sum_sq / n_cols + eps)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                # h is recomputed (bit-identical) from the inputs: no read-back of this program's stores.
                x = _input_tile(x_rows, r_rows, h_rows, cols, mask, HAS_RESIDUAL, False, X_DTYPE)
                w = _weight(w_ptr, cols, col_mask, HAS_WEIGHT)
                y = _scale(_normalized(x, rstd, CASTING, X_DTYPE), w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _residual_grad(dx, dres_ptr, rows64, dres_row_stride, cols, mask, HAS_RESIDUAL_GRAD: tl.constexpr):
    """``dx`` plus the residual output's incoming gradient, where there is one."""
    if HAS_RESIDUAL_GRAD:
        dres = tl.load(dres_ptr + rows64 * dres_row_stride + cols[None, :], mask=mask, other=0.0)
        dx += dres.to(tl.float32)
    return dx


@fast_launch
@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, dres_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr,
    n_rows, n_cols, dy_row_stride, dres_row_stride, x_row_stride, dx_row_stride, offset,
    dw_partial_ptr, c_ptr,
    HAS_RESIDUAL_GRAD: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    DIRECT_PARTIALS: tl.constexpr,
):
    # x is the normalised input (h = x + residual for the fused op).
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    # This program's row of the partial-sum buffer, shared with at most one other program.
    dw_row = partial_row(dw_partial_ptr, n_cols)
    if COL_TILES == 1:
        col_mask = col_offsets < n_cols
        # Where registers are short the weight is reloaded per row block (an L1 hit) rather than
        # held across the loop beside the dW sums: with the residual gradient's tile live too, and in
        # a tile of 16384 columns or more (held, it spilled: H200, bf16, fwd+bwd at 16384 x 16384,
        # CUDA-graph replay, 0.694 against 0.792 ms; 16384 x 4096 the same either way).
        RELOAD_WEIGHT: tl.constexpr = HAS_RESIDUAL_GRAD or BLOCK_COLS >= 16384
        if not RELOAD_WEIGHT:
            w = _weight(w_ptr, col_offsets, col_mask, HAS_WEIGHT)
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
            if HAS_WEIGHT:
                dw_acc += tl.sum(dy * n, axis=0)
            if RELOAD_WEIGHT:
                w = _weight(w_ptr, col_offsets, col_mask, HAS_WEIGHT)
            dn = _scale(dy, w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
            c = tl.sum(dn * n, axis=1) / n_cols
            dx = (dn - n * c[:, None]) * rstd[:, None]
            dx = _residual_grad(dx, dres_ptr, rows64, dres_row_stride, col_offsets, mask, HAS_RESIDUAL_GRAD)
            tl.store(dx_ptr + rows64 * dx_row_stride + col_offsets[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            accumulate_partial(dw_row, col_offsets, dw_acc, col_mask, DIRECT_PARTIALS)
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
                w = _weight(w_ptr, cols, col_mask, HAS_WEIGHT)
                n = _normalized(x.to(tl.float32), rstd, CASTING, X_DTYPE)
                dot += tl.sum(_scale(dy.to(tl.float32), w, offset, HAS_WEIGHT, CASTING, X_DTYPE) * n, axis=1)
            tl.store(c_ptr + rows, dot / n_cols, mask=row_mask)
        # The rows' c were written by other threads of this program.
        tl.debug_barrier()
        # Phase 2, column tile by column tile: dx of every row of this program, and the tile's dW
        # summed over them in registers (no read-modify-write of the partial row).
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            w = _weight(w_ptr, cols, col_mask, HAS_WEIGHT)
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
                dn = _scale(dy, w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
                dx = (dn - n * c[:, None]) * rstd[:, None]
                dx = _residual_grad(dx, dres_ptr, rows64, dres_row_stride, cols, mask, HAS_RESIDUAL_GRAD)
                tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if HAS_WEIGHT:
                    dw_acc += tl.sum(dy * n, axis=0)
            if HAS_WEIGHT:
                accumulate_partial(dw_row, cols, dw_acc, col_mask, DIRECT_PARTIALS)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None, *,
         residual: bool = False) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., hidden)``); ``residual``:
    those of the fused residual add."""
    return plans(shape, dtype, *_tiles(residual), profile)


def _tiles(residual: bool) -> tuple[dict, dict]:
    if residual:
        return RESIDUAL_FORWARD_TILES, RESIDUAL_BACKWARD_TILES
    return FORWARD_TILES, BACKWARD_TILES


def launch_rms_norm_forward(x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float,
                            offset: float, casting: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(y, h, rstd)`` for ``x`` of any leading shape (``h = x + residual``, None without a
    residual); ``y`` and ``h`` have ``x``'s shape, ``rstd`` one value per row."""
    # Outputs are new contiguous tensors of x's shape (row stride: cols); x and the residual are
    # read in place where they can be (the op takes x whole: a reshape outside it would add
    # autograd view nodes).
    cols = x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    rstd = x.new_empty(rows, dtype=torch.float32)
    if rows == 0:
        return y, h, rstd
    # An absent residual, h or weight is never touched (constexpr switches); x stands in for it.
    r, _, r_stride = (x, rows, x_stride) if residual is None else rows_in_place(residual)
    launch_forward(
        _rms_norm_forward_kernel,
        (x, r, x if weight is None else weight, y, x if h is None else h, rstd, rows, cols,
         x_stride, r_stride, cols, cols, eps, offset),
        rows, cols, x.dtype, _tiles(residual is not None)[0],
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, CASTING=casting,
    )
    return y, h, rstd


def launch_rms_norm_backward(dy: Tensor, dres: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor,
                             offset: float, casting: int, dx: Tensor, residual: bool) -> Tensor | None:
    """Writes ``dx`` (plus ``dres`` where given) of the normalised input ``x`` (any leading shape,
    as ``dy``, ``dres`` and ``dx``; ``dx`` contiguous); returns ``dW`` in the weight's dtype (None
    without a weight). ``residual``: plan as the fused residual add."""
    cols = x.shape[-1]
    x, rows, x_stride = rows_in_place(x)
    if rows == 0:
        return None if weight is None else torch.zeros_like(weight)
    dy, _, dy_stride = rows_in_place(dy)
    d_r, _, d_r_stride = (x, rows, x_stride) if dres is None else rows_in_place(dres)
    (dw,) = launch_backward(
        _rms_norm_backward_kernel,
        (dy, d_r, x, x if weight is None else weight, rstd, dx, rows, cols,
         dy_stride, d_r_stride, x_stride, cols, offset),
        rows, cols, x.dtype, _tiles(residual)[1],
        grad_dtypes=(None if weight is None else weight.dtype,), row_stats=1, stand_in=rstd,
        HAS_RESIDUAL_GRAD=dres is not None, HAS_WEIGHT=weight is not None, CASTING=casting,
    )
    return dw


def grad_output_buffer(dy: Tensor, x: Tensor, overwrite_grad_output: bool) -> Tensor:
    """Where ``dx`` goes: ``dy``'s storage if the caller allowed it, else a new tensor.

    The reused storage is returned as a new tensor object (``detach``), not as ``dy`` itself:
    autograd hands a gradient over to a leaf's ``.grad`` without a copy only when nothing else holds
    the tensor object, and the caller of ``backward`` still holds ``dy``."""
    # Only where the kernel's dx rows are dy's own (a strided dy's rows would be a copy).
    if overwrite_grad_output and dy.is_contiguous() and dy.dtype == x.dtype:
        return dy.detach()
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def may_overwrite(asked: bool, dy: Tensor, x: Tensor) -> bool:
    """Whether the incoming gradient can take ``dx``: asked for, on the eager route (a traced graph
    owns its buffers: nothing is mutated there), and of ``dx``'s layout and dtype."""
    return asked and not tracing(dy) and dy.is_contiguous() and dy.dtype == x.dtype


@custom_op("rms_norm_forward")
def rms_norm_forward(x: Tensor, weight: Tensor | None, eps: float, offset: float, casting: int,
                     overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` for ``x`` of any leading shape; ``rstd`` is fp32, one per row.
    ``overwrite_grad_output`` is the backward's (see ``rms_norm``)."""
    y, _, rstd = launch_rms_norm_forward(x, None, weight, eps, offset, casting)
    return y, rstd


@rms_norm_forward.register_fake
def _(x, weight, eps, offset, casting, overwrite_grad_output):
    return x.new_empty(x.shape), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@custom_op("rms_norm_backward")
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, casting: int,
                      overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``, ``dweight`` empty without a weight; with ``overwrite_grad_output`` (eager
    route only) ``dx`` is written into ``dy``'s storage."""
    dx = grad_output_buffer(dy, x, overwrite_grad_output)
    dw = launch_rms_norm_backward(dy, None, x, weight, rstd, offset, casting, dx, residual=False)
    return dx, x.new_empty(0) if dw is None else dw


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd, offset, casting, overwrite_grad_output):
    return x.new_empty(x.shape), x.new_empty(0) if weight is None else torch.empty_like(weight)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, _eps, offset, casting, overwrite_grad_output = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset, ctx.casting, ctx.overwrite_grad_output = offset, casting, overwrite_grad_output


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    overwrite = may_overwrite(ctx.overwrite_grad_output, dy, x)
    dx, dw = rms_norm_backward(dy, x, weight, rstd, ctx.offset, ctx.casting, overwrite)
    return dx, None if weight is None else dw, None, None, None, None


register_autograd(rms_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def validate_weight(weight, x) -> None:
    """The weight of an RMSNorm of ``x``: a 1-D floating tensor of ``x``'s hidden size, on its device."""
    check_float(weight, "weight")
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D (hidden_size,), got shape {tuple(weight.shape)}")
    check_last_dim(x, "x", weight.shape[0], "the weight's hidden size")
    check_same_device(weight, "weight", x, "x")


def validate_options(x, eps, offset, casting_mode, overwrite_grad_output) -> int:
    """Checks the options shared with the fused residual add; returns the casting mode's code."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"x must have a non-empty last dimension (the normalised one), got shape {tuple(x.shape)}"
        )
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
    check_number(eps, "eps", minimum=0.0)
    check_number(offset, "offset")
    check_bool(overwrite_grad_output, "overwrite_grad_output")
    return CASTING_MODES[casting_mode]


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    overwrite_grad_output: bool = False,
) -> Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (offset + weight)``.

    ``casting_mode`` is ``"llama"`` (normalise in fp32, cast to ``x``'s dtype, then scale),
    ``"gemma"`` (all in fp32, then cast; use with ``offset=1.0`` for Gemma's ``1 + w``) or
    ``"none"`` (round to ``x``'s dtype at each step). The result has ``x``'s dtype and shape; ``x``
    may have any leading shape, including no rows. ``weight=None`` (``elementwise_affine=False``):
    no scale, the normalised row cast to ``x``'s dtype (``offset`` does not apply).
    ``overwrite_grad_output=True`` lets the backward pass write ``dx`` into the storage of the
    gradient that arrives for the output (eager only; compiled graphs manage their own buffers).
    """
    check_float(x, "x")
    if weight is not None:
        validate_weight(weight, x)
    casting = validate_options(x, eps, offset, casting_mode, overwrite_grad_output)
    weight = None if weight is None else weight.contiguous()
    y, _ = rms_norm_forward(rows_ready(x), weight, float(eps), float(offset), casting, overwrite_grad_output)
    return y
