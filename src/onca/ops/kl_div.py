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
  backward pass); nothing else is kept, and the backward pass rescales it in place by the
  incoming gradient, read on the device, touching nothing when it is 1
  (``onca.ops.cross_entropy.ForwardGradients``; traced, into a new tensor). fp16 inputs skip that
  (a mean's unit-scale gradients fall below fp16's normal range before a loss scale could lift
  them): their backward kernel computes the gradient with the incoming gradient folded in. For
  ``none`` the backward kernel computes it from ``target`` and the elementwise incoming gradient.
- w.r.t. ``target`` (cheap, so supported): ``(log(target) + 1 - input)`` or
  ``exp(target) * (target - input + 1)``, times the same factors, computed in the backward pass
  when ``target`` requires a gradient (then ``input`` and ``target`` are saved). Where a
  probability target is exactly 0 it is ``-inf`` (torch gives NaN there).

Each row is covered in column tiles of the plan's width (the whole row in one tile when it fits),
so a vocabulary of any size runs on every profile. Reductions are deterministic: each row's sum is
written by the one program that owns it, and the row sums are added up once afterwards.

Empty inputs follow torch: a sum over nothing is 0, a mean over nothing NaN (``batchmean``
divides by ``input.shape[0]``, so it is NaN only when that is 0).
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
from onca.ops._partials import sum_scaled
from onca.ops._rows import as_rows, rows_cols
from onca.ops._validate import check_bool, check_float, check_same_device, check_tensor
from onca.ops.cross_entropy import keep_forward_gradients, take_forward_gradients
from onca.tiling import RowPlan, plan_rows

__all__ = ["kl_div", "REDUCTIONS", "plan"]

REDUCTIONS = ("none", "sum", "mean", "batchmean")

# Live tiles (input dtype; fp32). Forward: input, target, and loss or dinput stored; fp32 upcasts of both,
# the loss and the gradient. Backward: input, target, incoming gradient, dinput, dtarget; their fp32 forms.
# A row too wide for the forward's tile takes a whole-budget GPU tile (the planner's gpu_whole_two_pass):
# H100, bf16, forward + backward, 2.65 -> 2.55 ms at 8192 x 128256, 5.25 -> 5.08 at 8192 x 262144; the
# backward's gains nothing (and loses 9% at 1024 x 128256 beside the forward's).
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=4, gpu_whole_two_pass=True)
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=5)

# How the kernel gets the gradient factor: a constant ``scale``; ``scale`` times a device scalar
# (the incoming gradient of a scalar loss, read without a host sync); ``scale`` times an
# elementwise incoming gradient (reduction "none").
_G_CONST, _G_SCALAR, _G_ELEMENTWISE = 0, 1, 2
# What the kernel writes of the loss.
_LOSS_NONE, _LOSS_ELEMENTWISE, _LOSS_ROW_SUMS = 0, 1, 2


# ----------------------------------------------------------------------------------------- kernels


@fast_launch
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


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., vocab)``)."""
    rows, cols = rows_cols(shape)
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
        scale,
        LOG_TARGET=log_target, LOSS=loss_mode, G_MODE=g_mode,
        WRITE_DX=dx is not None, WRITE_DT=dt is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )


def _precomputes(reduction: str, precompute_grad: bool) -> bool:
    """Whether the forward op writes ``dinput``: only a scalar loss has one gradient factor."""
    return precompute_grad and reduction != "none"


@custom_op("kl_div_forward")
def kl_div_forward(input: Tensor, target: Tensor, reduction: str, log_target: bool, scale: float,
                   precompute_grad: bool) -> tuple[Tensor, Tensor]:
    """``(loss, dinput)`` for the 2-D ``input``/``target``: the elementwise loss (``none``) or the
    summed loss times ``scale``, in the promoted dtype; ``dinput`` (for an incoming gradient of 1)
    when ``precompute_grad`` and the loss is a scalar, else an empty tensor."""
    rows, cols = input.shape
    out_dtype = torch.promote_types(input.dtype, target.dtype)
    dx = None
    if _precomputes(reduction, precompute_grad):
        dx = torch.empty((rows, cols), dtype=input.dtype, device=input.device)
    empty = input.numel() == 0
    p = None if empty else plan_rows(rows, cols, input.dtype, **FORWARD_TILES)
    if reduction == "none":
        loss = torch.empty((rows, cols), dtype=out_dtype, device=input.device)
        if not empty:
            _launch(p, input, target, None, loss, dx, None, scale, log_target,
                    _LOSS_ELEMENTWISE, _G_CONST)
    else:
        # The kernel stores every row's sum; rows of no columns sum to 0 (times the scale, a mean
        # over nothing is NaN, as in torch).
        row_sums = (torch.zeros if empty else torch.empty)(rows, dtype=torch.float32, device=input.device)
        if not empty:
            _launch(p, input, target, None, row_sums, dx, None, scale, log_target,
                    _LOSS_ROW_SUMS, _G_CONST)
        loss = sum_scaled(row_sums, out_dtype, scale)
    return loss, dx if dx is not None else input.new_empty(0)


@kl_div_forward.register_fake
def _(input, target, reduction, log_target, scale, precompute_grad):
    out_dtype = torch.promote_types(input.dtype, target.dtype)
    loss = input.new_empty(input.shape if reduction == "none" else (), dtype=out_dtype)
    dx = input.new_empty(input.shape if _precomputes(reduction, precompute_grad) else (0,))
    return loss, dx


@custom_op("kl_div_backward")
def kl_div_backward(grad: Tensor, input: Tensor, target: Tensor, scale: float, log_target: bool,
                    want_input_grad: bool, want_target_grad: bool) -> tuple[Tensor, Tensor]:
    """``(dinput, dtarget)`` for the incoming gradient ``grad``: one element (a scalar loss), or
    ``(rows, cols)`` (reduction ``none``). A gradient not wanted is an empty tensor."""
    rows, cols = target.shape
    dx = torch.empty((rows, cols) if want_input_grad else (0,), dtype=input.dtype, device=input.device)
    dt = torch.empty((rows, cols) if want_target_grad else (0,), dtype=target.dtype, device=target.device)
    if target.numel() == 0 or not (want_input_grad or want_target_grad):
        return dx, dt
    g_mode = _G_ELEMENTWISE if grad.dim() == 2 else _G_SCALAR
    p = plan_rows(rows, cols, target.dtype, **BACKWARD_TILES)
    _launch(p, input, target, grad, None, dx if want_input_grad else None,
            dt if want_target_grad else None, scale, log_target, _LOSS_NONE, g_mode)
    return dx, dt


@kl_div_backward.register_fake
def _(grad, input, target, scale, log_target, want_input_grad, want_target_grad):
    return (input.new_empty(input.shape if want_input_grad else (0,)),
            target.new_empty(target.shape if want_target_grad else (0,)))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Keeps ``dinput`` when the forward op wrote it (``keep_forward_gradients``), else saves the
    2-D ``input`` and ``target``."""
    input, target, reduction, log_target, scale, precompute_grad = inputs
    loss, dx = output
    ctx.mark_non_differentiable(dx)
    ctx.precomputed = _precomputes(reduction, precompute_grad)
    ctx.reduction, ctx.log_target, ctx.scale = reduction, log_target, scale
    if ctx.precomputed:
        keep_forward_gradients(ctx, [dx], input, loss)
    else:
        ctx.save_for_backward(input, target)


def _backward(ctx, grad, _grad_dx):
    if ctx.precomputed:  # only dinput is wanted (the public function's choice)
        (dx,) = take_forward_gradients(ctx, grad)
        return dx, None, None, None, None, None
    input, target = ctx.saved_tensors
    want_dx, want_dt = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g = as_rows(grad) if ctx.reduction == "none" else grad.reshape(1)
    dx, dt = kl_div_backward(g, input, target, ctx.scale, ctx.log_target, want_dx, want_dt)
    return dx if want_dx else None, dt if want_dt else None, None, None, None, None


register_autograd(kl_div_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _reduction_scale(shape, numel: int, reduction: str) -> float:
    """The loss's divisor as a factor; NaN where torch divides zero by zero (nothing to average)."""
    divisor = {"mean": numel, "batchmean": shape[0]}.get(reduction, 1)
    return 1.0 / divisor if divisor else float("nan")


def _validate(input, target, reduction, log_target) -> None:
    check_tensor(input, "input")
    check_tensor(target, "target")
    check_float(input, "input")
    check_float(target, "target")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension, got a 0-d tensor")
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"target must have the input's shape {tuple(input.shape)}, got {tuple(target.shape)} "
            "(onca's kl_div does not broadcast)"
        )
    check_same_device(target, "target", input, "input")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_bool(log_target, "log_target")


def kl_div(input: Tensor, target: Tensor, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """``torch.nn.functional.kl_div``: ``input`` is log-probabilities, ``target`` probabilities (or
    log-probabilities with ``log_target=True``), same shape ``(..., vocab)``. ``reduction`` is
    ``"none"``, ``"sum"``, ``"mean"`` (over all elements) or ``"batchmean"`` (over
    ``input.shape[0]``). Gradients for ``input`` and, when it requires one, ``target``. Empty inputs
    give torch's results (a sum of 0, a NaN mean)."""
    _validate(input, target, reduction, log_target)
    # A probability target's gradient where it is 0 differs (torch: NaN): that call stays Onca's.
    if not target.requires_grad and small_calls.small(input.numel(), input, target):
        return torch.nn.functional.kl_div(input, target, reduction=reduction, log_target=log_target)
    scale = _reduction_scale(input.shape, input.numel(), reduction)
    # A scalar loss is last in the graph: its input gradient is written by the forward kernel
    # (one pass over both tensors) unless the target wants a gradient too, or in fp16, whose
    # unit-scale gradients of a mean fall below its normal range before a loss scale (GradScaler)
    # could lift them; the backward kernel then computes them with the scale folded in.
    precompute_grad = (reduction != "none" and torch.is_grad_enabled() and input.requires_grad
                       and not target.requires_grad and input.dtype != torch.float16)
    loss, _ = kl_div_forward(as_rows(input), as_rows(target), reduction, log_target, scale, precompute_grad)
    return loss.view(input.shape) if reduction == "none" else loss
