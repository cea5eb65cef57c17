"""KL divergence with ``torch.nn.KLDivLoss`` semantics, over ``(tokens, vocab)`` rows.

``input`` holds log-probabilities; ``target`` holds probabilities, or log-probabilities when
``log_target=True``. Elementwise, exactly as ``torch.nn.functional.kl_div``::

    log_target=False:  loss = xlogy(target, target) - target * input      (0 where target == 0)
    log_target=True:   loss = exp(target) * (target - input)

then reduced: ``none`` (elementwise, the input's shape), ``sum``, ``mean`` (divided by the number
of elements) or ``batchmean`` (divided by ``input.shape[0]``, the first dimension, as torch does
for any number of dimensions). Inputs of any shape are viewed as rows over their last dimension;
the two tensors must have the same shape (no broadcasting). The loss has the dtype torch would
give (``input`` and ``target`` promoted); the kernels compute in fp32.

Gradients:

- w.r.t. ``input``: ``-target`` (or ``-exp(target)``) times the reduction's scale and the
  incoming gradient. For the scalar reductions it is written by the forward kernel itself (one
  read of each tensor and one write of ``dinput``, instead of a second read of ``target`` in the
  backward pass); nothing else is saved. For ``none`` the backward kernel computes it from
  ``target`` and the elementwise incoming gradient.
- w.r.t. ``target`` (cheap, so supported): ``(log(target) + 1 - input)`` or
  ``exp(target) * (target - input + 1)``, times the same factors, computed in the backward pass
  when ``target`` requires a gradient (then ``input`` and ``target`` are saved). Where a
  probability target is exactly 0 it is ``-inf`` (torch gives NaN there).

Each row is covered in column tiles of the plan's width (the whole row in one tile when it fits),
so a vocabulary of any size runs on every profile. Reductions are deterministic: each row's sum is
written by the one program that owns it, and the row sums are added up once afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile
from onca.ops._rows import as_rows
from onca.ops._validate import check_float, check_nonempty, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["kl_div", "KLDivFunction", "REDUCTIONS", "plan"]

REDUCTIONS = ("none", "sum", "mean", "batchmean")

# Live tiles (input dtype; fp32). Forward: input, target, and loss or dinput stored; fp32 upcasts
# of both, the loss and the gradient. Backward: input, target, incoming gradient, dinput,
# dtarget; their fp32 forms.
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=4)
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=5)

# How the kernel gets the gradient factor: a constant ``scale``; ``scale`` times a device scalar
# (the incoming gradient of a scalar loss, read without a host sync); ``scale`` times an
# elementwise incoming gradient (reduction "none").
_G_CONST, _G_SCALAR, _G_ELEMENTWISE = 0, 1, 2
# What the kernel writes of the loss.
_LOSS_NONE, _LOSS_ELEMENTWISE, _LOSS_ROW_SUMS = 0, 1, 2


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _kl_div_kernel(
    x_ptr, t_ptr, g_ptr, loss_ptr, dx_ptr, dt_ptr,
    n_rows, n_cols,
    x_row_stride, t_row_stride, g_row_stride, loss_row_stride, dx_row_stride, dt_row_stride,
    scale,
    LOG_TARGET: tl.constexpr,
    LOSS: tl.constexpr,
    G_MODE: tl.constexpr,
    WRITE_DX: tl.constexpr,
    WRITE_DT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """One pass over each row: the loss (elementwise or summed per row) and/or the gradients.

    Every element is independent, so a row split into column tiles needs no second pass; the
    per-row sum is carried across the tiles in registers.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    g_scalar = scale
    if G_MODE == 1:
        g_scalar = tl.load(g_ptr).to(tl.float32) * scale
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        row_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            # Padding reads as a target of 1 (log-target 0) and an input of 0: finite, and masked
            # out of every store and sum.
            t = tl.load(t_ptr + rows64 * t_row_stride + cols[None, :], mask=mask,
                        other=0.0 if LOG_TARGET else 1.0).to(tl.float32)
            if LOSS != 0 or WRITE_DT:
                x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
                x = x.to(tl.float32)
            if LOG_TARGET:
                p = tl.exp(t)
            else:
                p = t
            if LOSS != 0:
                if LOG_TARGET:
                    loss = p * (t - x)
                else:
                    # xlogy(t, t): 0 where t == 0 (log(1) there), NaN where t < 0, as torch.
                    loss = t * tl.log(tl.where(t == 0.0, 1.0, t)) - t * x
                if LOSS == 1:
                    tl.store(loss_ptr + rows64 * loss_row_stride + cols[None, :],
                             loss.to(loss_ptr.dtype.element_ty), mask=mask)
                else:
                    row_sum += tl.sum(tl.where(mask, loss, 0.0), axis=1)
            if WRITE_DX or WRITE_DT:
                if G_MODE == 2:
                    g = tl.load(g_ptr + rows64 * g_row_stride + cols[None, :], mask=mask, other=0.0)
                    g = g.to(tl.float32) * scale
                else:
                    g = g_scalar
                if WRITE_DX:
                    tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :],
                             (-p * g).to(dx_ptr.dtype.element_ty), mask=mask)
                if WRITE_DT:
                    if LOG_TARGET:
                        dt = p * (t - x + 1.0)
                    else:
                        dt = tl.log(t) + 1.0 - x
                    tl.store(dt_ptr + rows64 * dt_row_stride + cols[None, :],
                             (dt * g).to(dt_ptr.dtype.element_ty), mask=mask)
        if LOSS == 2:
            tl.store(loss_ptr + rows, row_sum, mask=row_mask)


# --------------------------------------------------------------------------------------- launchers


def _rows_cols(shape) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 1, 1
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, shape[-1]


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., vocab)``)."""
    rows, cols = _rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, **BACKWARD_TILES),
    }


def _launch(p: RowPlan, x, t, g, loss, dx, dt, scale, log_target, loss_mode, g_mode):
    rows, cols = t.shape
    _kl_div_kernel[(p.grid,)](
        x, t, g, loss, dx, dt,
        rows, cols,
        x.stride(0), t.stride(0),
        g.stride(0) if g is not None and g.dim() == 2 else 0,
        loss.stride(0) if loss is not None else 0,
        dx.stride(0) if dx is not None else 0,
        dt.stride(0) if dt is not None else 0,
        float(scale),
        LOG_TARGET=bool(log_target), LOSS=loss_mode, G_MODE=g_mode,
        WRITE_DX=dx is not None, WRITE_DT=dt is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )


def kl_div_forward(x2d, t2d, reduction: str, log_target: bool, out_dtype, scale: float,
                   with_grad: bool):
    """The loss (elementwise or row sums, reduced here) and, when ``with_grad``, ``dinput`` for an
    incoming gradient of 1 (scalar reductions only)."""
    rows, cols = x2d.shape
    p = plan_rows(rows, cols, x2d.dtype, **FORWARD_TILES)
    dx = torch.empty((rows, cols), dtype=x2d.dtype, device=x2d.device) if with_grad else None
    if reduction == "none":
        loss = torch.empty((rows, cols), dtype=out_dtype, device=x2d.device)
        _launch(p, x2d, t2d, None, loss, dx, None, scale, log_target, _LOSS_ELEMENTWISE, _G_CONST)
        return loss, dx
    row_sums = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    _launch(p, x2d, t2d, None, row_sums, dx, None, scale, log_target, _LOSS_ROW_SUMS, _G_CONST)
    return (row_sums.sum() * scale).to(out_dtype), dx


def kl_div_backward(g, x2d, t2d, scale: float, log_target: bool, want_dx: bool, want_dt: bool):
    """``dinput`` and/or ``dtarget`` for the incoming gradient ``g``: a scalar, or a ``(rows, cols)``
    matrix (reduction "none")."""
    rows, cols = t2d.shape
    p = plan_rows(rows, cols, t2d.dtype, **BACKWARD_TILES)
    dx = torch.empty((rows, cols), dtype=x2d.dtype, device=t2d.device) if want_dx else None
    dt = torch.empty((rows, cols), dtype=t2d.dtype, device=t2d.device) if want_dt else None
    g_mode = _G_ELEMENTWISE if g.dim() == 2 else _G_SCALAR
    _launch(p, x2d, t2d, g, None, dx, dt, scale, log_target, _LOSS_NONE, g_mode)
    return dx, dt


# ---------------------------------------------------------------------------------------- autograd


def _reduction_scale(shape, numel: int, reduction: str) -> float:
    if reduction == "mean":
        return 1.0 / numel
    if reduction == "batchmean":
        return 1.0 / shape[0]
    return 1.0


def _grad_is_one(g: torch.Tensor) -> bool:
    """Whether a scalar incoming gradient is exactly 1 (the usual ``loss.backward()``): then the
    gradient computed in the forward pass is returned as is. Costs one device-to-host read."""
    return g.numel() == 1 and float(g) == 1.0


class KLDivFunction(torch.autograd.Function):
    """Autograd wrapper. Saves, for the scalar reductions, ``dinput`` computed in the forward pass
    (for an incoming gradient of 1); for ``none``, ``target`` (and ``input`` when ``target``
    needs a gradient). No copy of a caller's tensor is kept beyond the 2-D views the kernels use."""

    @staticmethod
    def forward(ctx, input, target, reduction, log_target):
        out_dtype = _validate(input, target, reduction)
        x2d, t2d = as_rows(input), as_rows(target)
        scale = _reduction_scale(input.shape, input.numel(), reduction)
        need_dx, need_dt = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        precompute = need_dx and not need_dt and reduction != "none"
        loss, dx = kl_div_forward(x2d, t2d, reduction, bool(log_target), out_dtype, scale, precompute)
        ctx.reduction, ctx.log_target, ctx.scale = reduction, bool(log_target), scale
        ctx.shape, ctx.precomputed = input.shape, precompute
        if precompute:
            ctx.save_for_backward(dx)
        elif need_dx or need_dt:
            ctx.save_for_backward(x2d, t2d)
        return loss.view(input.shape) if reduction == "none" else loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.precomputed:
            (dx,) = ctx.saved_tensors
            dx = dx if _grad_is_one(grad) else dx * grad.to(dx.dtype)
            return dx.view(ctx.shape), None, None, None
        x2d, t2d = ctx.saved_tensors
        if ctx.reduction == "none":
            g = as_rows(grad.expand(ctx.shape)) if grad.dim() else grad.reshape(1)
        else:
            g = grad.reshape(1)
        dx, dt = kl_div_backward(g, x2d, t2d, ctx.scale, ctx.log_target,
                                 ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (dx.view(ctx.shape) if dx is not None else None,
                dt.view(ctx.shape) if dt is not None else None, None, None)


def _validate(input, target, reduction) -> torch.dtype:
    check_float(input, "input")
    check_float(target, "target")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension, got a 0-d tensor")
    check_nonempty(input, "input")
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"target must have the input's shape {tuple(input.shape)}, got {tuple(target.shape)} "
            "(onca's kl_div does not broadcast)"
        )
    check_same_device(target, "target", input, "input")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return torch.promote_types(input.dtype, target.dtype)


def kl_div(input, target, reduction: str = "mean", log_target: bool = False):
    """``torch.nn.functional.kl_div(input, target, reduction, log_target=log_target)``. See the
    module docstring."""
    check_tensor(input, "input")
    check_tensor(target, "target")
    return KLDivFunction.apply(input, target, reduction, log_target)
