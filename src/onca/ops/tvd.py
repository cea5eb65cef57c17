"""Total variation distance between two distributions, with liger-kernel's ``LigerTVDLoss``
semantics (``liger_tvd(input, target, shift_labels=None, reduction="mean", ignore_index=-100)``).

``input`` (``p``) and ``target`` (``q``) are *probabilities* over the last dimension, both
``(..., vocab)``; elementwise::

    loss = 0.5 * |p - q|

``shift_labels`` (one per token, any of the tokens' shapes or flat) leaves out the tokens whose
label equals ``ignore_index``: their loss and gradient are 0. ``reduction``:

- ``"none"``: the elementwise loss, ``input``'s shape;
- ``"sum"``: the sum over every element;
- ``"mean"``: the sum divided by ``tokens not ignored x vocab`` (liger's ``mean``);
- ``"batchmean"``: the sum divided by the number of tokens not ignored (all tokens without labels;
  a token is one row, whatever the leading shape: ``(B, T, V)`` counts ``B * T``).

When every token is ignored the loss is 0, and so is the gradient (liger divides by zero there).
With no tokens at all ``sum`` is 0 and ``mean``/``batchmean`` follow the same rule: 0 with labels,
NaN without (torch's mean over nothing), as ``onca.ops.jsd`` does. The loss is
fp32 whatever the inputs' dtype, as liger-kernel returns it.

Gradients: w.r.t. ``input``, ``0.5 * sign(p - q)`` times the reduction's factor and the incoming
gradient; w.r.t. ``target`` (when it requires one) the negation. Where ``p == q`` it is 0, as
torch's autograd of ``0.5 * abs(p - q)`` gives (liger-kernel gives ``-0.5`` there). For the scalar
reductions (fp32 and bf16 inputs) the forward kernel writes the input's gradient (for an incoming
gradient of 1) in the same pass as the loss and keeps only that: the backward pass rescales it
in place by the incoming gradient, reading the scale on the device and touching nothing when it is 1 (the usual case; no
host read), and hands it over (``onca.ops.cross_entropy.ForwardGradients``, as the cross entropy
does; traced by ``torch.compile``, into a new tensor). A second backward through the same graph
gets a new tensor and leaves the first one's result alone. fp16 inputs skip that: the unit-gradient
values of a mean over more than 2**24 elements are below fp16's smallest subnormal, and a loss
scale applied afterwards would multiply zeros; their backward kernel computes the gradient from the
saved inputs and the incoming gradient times the reduction's factor, in fp32, rounding once. For ``none`` the backward kernel recomputes it from the
saved ``input``/``target`` and the elementwise incoming gradient.

With labels the loss's factor is a device scalar (the count of tokens not ignored is never read on
the host); without, a host constant.
Rows are covered in column tiles of the plan's width; every element is independent, so one pass
serves any vocabulary. Reductions are deterministic: one sum per row, added up once afterwards.

A small call (:mod:`onca.ops._small_calls`: at most its limit of elements, eager, on CUDA, input
and target of one dtype) takes torch's ops instead: the same distance in fp32 and reductions,
autograd for the gradients.
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
from onca.ops._validate import check_float, check_same_device, check_tensor
from onca.ops.cross_entropy import keep_forward_gradients, take_forward_gradients
from onca.ops.jsd import check_ignore_index, check_labels, token_scale
from onca.tiling import RowPlan, plan_rows

__all__ = ["tvd", "REDUCTIONS", "plan"]

REDUCTIONS = ("none", "sum", "mean", "batchmean")

# Live tiles (input dtype; fp32). Forward: p, q, and the loss or dp stored; fp32 forms of p and q,
# the loss and the gradient. Backward: p, q, the incoming gradient, dp and dq; their fp32 forms.
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=4)
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=5)

# What the kernel writes of the loss (as in kl_div).
_LOSS_NONE, _LOSS_ELEMENTWISE, _LOSS_ROW_SUMS = 0, 1, 2


# ----------------------------------------------------------------------------------------- kernels


@fast_launch
@triton.jit
def _tvd_kernel(
    p_ptr, q_ptr, labels_ptr, g_ptr, loss_ptr, dp_ptr, dq_ptr,
    n_rows, n_cols,
    p_row_stride, q_row_stride, g_row_stride, loss_row_stride, dp_row_stride, dq_row_stride,
    scale, ignore_index,
    LOSS: tl.constexpr,
    G_MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    WRITE_DP: tl.constexpr,
    WRITE_DQ: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """One pass over each row: the loss (elementwise, or summed per row) and/or the gradients
    ``+-0.5 * sign(p - q) * g``, with ``g`` (``G_MODE``) the host constant ``scale`` (0), the device
    scalar ``g_ptr[0] * scale`` (1) or ``g_ptr[row, col] * scale`` (2). Ignored rows read nothing
    and write zeros."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    if G_MODE == 0:
        g_scalar = scale
    elif G_MODE == 1:
        g_scalar = tl.load(g_ptr).to(tl.float32) * scale
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        if HAS_LABELS:
            labels = tl.load(labels_ptr + rows, mask=row_mask, other=ignore_index)
            valid = row_mask & (labels != ignore_index)
        else:
            valid = row_mask
        rows64 = rows.to(tl.int64)[:, None]
        row_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = (cols < n_cols)[None, :]
            store_mask = row_mask[:, None] & col_mask
            load_mask = valid[:, None] & col_mask
            p = tl.load(p_ptr + rows64 * p_row_stride + cols[None, :], mask=load_mask, other=0.0)
            q = tl.load(q_ptr + rows64 * q_row_stride + cols[None, :], mask=load_mask, other=0.0)
            p = p.to(tl.float32)
            q = q.to(tl.float32)
            diff = p - q
            if LOSS == 1:
                tl.store(loss_ptr + rows64 * loss_row_stride + cols[None, :],
                         (0.5 * tl.abs(diff)).to(loss_ptr.dtype.element_ty), mask=store_mask)
            elif LOSS == 2:
                row_sum += tl.sum(0.5 * tl.abs(diff), axis=1)
            if WRITE_DP or WRITE_DQ:
                if G_MODE == 2:
                    g = tl.load(g_ptr + rows64 * g_row_stride + cols[None, :], mask=load_mask, other=0.0)
                    g = g.to(tl.float32) * scale
                else:
                    g = g_scalar
                # sign(p - q) / 2: 0 where p == q (and for ignored rows and padding, which read 0).
                half_sign = tl.where(diff > 0.0, 0.5, tl.where(diff < 0.0, -0.5, 0.0))
                grad = half_sign * g
                if WRITE_DP:
                    tl.store(dp_ptr + rows64 * dp_row_stride + cols[None, :],
                             grad.to(dp_ptr.dtype.element_ty), mask=store_mask)
                if WRITE_DQ:
                    tl.store(dq_ptr + rows64 * dq_row_stride + cols[None, :],
                             (-grad).to(dq_ptr.dtype.element_ty), mask=store_mask)
        if LOSS == 2:
            tl.store(loss_ptr + rows, row_sum, mask=row_mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for inputs of ``shape`` (``(..., vocab)``)."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, **BACKWARD_TILES),
    }


def _launch(tiles: dict, p, q, labels, g, scale: float, ignore_index: int, loss, loss_mode: int, dp, dq):
    """``g``: None (the factor is the host constant ``scale``), a one-element device scalar or the
    elementwise incoming gradient, each times ``scale``."""
    rows, cols = p.shape
    pl = plan_rows(rows, cols, p.dtype, **tiles)
    g_elementwise = g is not None and g.dim() == 2
    _tvd_kernel[(pl.grid,)](
        p, q, labels if labels is not None else p, g if g is not None else p, loss if loss is not None else p,
        dp if dp is not None else p, dq if dq is not None else p,
        rows, cols,
        p.stride(0), q.stride(0), g.stride(0) if g_elementwise else 0,
        loss.stride(0) if loss is not None and loss.dim() == 2 else 0,
        dp.stride(0) if dp is not None else 0, dq.stride(0) if dq is not None else 0,
        float(scale), int(ignore_index),
        LOSS=loss_mode, G_MODE=0 if g is None else 2 if g_elementwise else 1, HAS_LABELS=labels is not None,
        WRITE_DP=dp is not None, WRITE_DQ=dq is not None,
        BLOCK_ROWS=pl.block_rows, BLOCK_COLS=pl.block_cols, COL_TILES=pl.col_tiles, num_warps=pl.num_warps,
    )


def _factor(labels, rows: int, cols: int, ignore_index: int, reduction: str, device):
    """The reduction's factor as ``(device scalar or None, host constant)``: with labels the device
    part counts the tokens not ignored (``onca.ops.jsd.token_scale``); without, the whole factor is
    known on the host (None: no one-element tensor filled per call). The host part is ``1 / vocab``
    for ``mean``, and ``1 / rows`` too without labels (NaN for no rows, as torch's mean)."""
    if reduction in ("none", "sum"):
        return None, 1.0
    const = 1.0 / cols if reduction == "mean" else 1.0
    scale = token_scale(labels, rows, ignore_index, "mean", device)
    return (None, const * scale) if isinstance(scale, float) else (scale, const)


@custom_op("tvd_forward")
def tvd_forward(input: Tensor, target: Tensor, shift_labels: Tensor | None, reduction: str,
                ignore_index: int, precompute_grad: bool) -> tuple[Tensor, Tensor]:
    """``(loss, dinput)`` for the 2-D ``input``/``target`` and 1-D ``shift_labels``: the fp32
    elementwise loss (``none``) or the reduced one; ``dinput`` (for an incoming gradient of 1) when
    ``precompute_grad`` and the loss is a scalar, else an empty tensor."""
    rows, cols = input.shape
    device = input.device
    dp = None
    if precompute_grad and reduction != "none":
        dp = torch.empty((rows, cols), dtype=input.dtype, device=device)
    factor, const = _factor(shift_labels, rows, cols, ignore_index, reduction, device)
    empty = input.numel() == 0
    if reduction == "none":
        loss = torch.empty((rows, cols), dtype=torch.float32, device=device)
        if not empty:
            _launch(FORWARD_TILES, input, target, shift_labels, factor, const, ignore_index, loss,
                    _LOSS_ELEMENTWISE, None, None)
        return loss, input.new_empty(0)
    # The kernel stores every row's sum; rows of no columns sum to 0.
    row_sums = (torch.zeros if empty else torch.empty)(rows, dtype=torch.float32, device=device)
    if not empty:
        _launch(FORWARD_TILES, input, target, shift_labels, factor, const, ignore_index, row_sums,
                _LOSS_ROW_SUMS, dp, None)
    loss = sum_scaled(row_sums, torch.float32, const, factor)
    return loss, dp if dp is not None else input.new_empty(0)


@tvd_forward.register_fake
def _(input, target, shift_labels, reduction, ignore_index, precompute_grad):
    loss = input.new_empty(input.shape if reduction == "none" else (), dtype=torch.float32)
    dp = input.new_empty(input.shape if precompute_grad and reduction != "none" else (0,))
    return loss, dp


@custom_op("tvd_backward")
def tvd_backward(grad: Tensor, input: Tensor, target: Tensor, shift_labels: Tensor | None,
                 ignore_index: int, want_input_grad: bool, want_target_grad: bool) -> tuple[Tensor, Tensor]:
    """``(dinput, dtarget)`` for the elementwise incoming gradient ``grad`` (reduction ``none``), or
    for a one-element fp32 ``grad`` that already holds the reduction's factor (a scalar loss whose
    gradient was not computed in the forward pass); a gradient not wanted is an empty tensor."""
    rows, cols = input.shape
    dp = torch.empty((rows, cols) if want_input_grad else (0,), dtype=input.dtype, device=input.device)
    dq = torch.empty((rows, cols) if want_target_grad else (0,), dtype=target.dtype, device=target.device)
    if input.numel() == 0 or not (want_input_grad or want_target_grad):
        return dp, dq
    _launch(BACKWARD_TILES, input, target, shift_labels, grad, 1.0, ignore_index, None, _LOSS_NONE,
            dp if want_input_grad else None, dq if want_target_grad else None)
    return dp, dq


@tvd_backward.register_fake
def _(grad, input, target, shift_labels, ignore_index, want_input_grad, want_target_grad):
    return (input.new_empty(input.shape if want_input_grad else (0,)),
            target.new_empty(target.shape if want_target_grad else (0,)))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Keeps ``dinput`` when the forward op wrote it (``keep_forward_gradients``), else saves the
    2-D inputs and the labels."""
    input, target, shift_labels, reduction, ignore_index, precompute_grad = inputs
    loss, dp = output
    ctx.mark_non_differentiable(dp)
    ctx.precomputed = precompute_grad and reduction != "none"
    ctx.reduction = reduction
    ctx.ignore_index = ignore_index
    ctx.target_dtype = target.dtype
    if ctx.precomputed:
        keep_forward_gradients(ctx, [dp], input, loss)
    else:
        ctx.save_for_backward(input, target, shift_labels)


def _backward(ctx, grad, _grad_dp):
    want_dp, want_dq = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.precomputed:
        (dp,) = take_forward_gradients(ctx, grad)
        dq = (-dp).to(ctx.target_dtype) if want_dq else None
        return dp if want_dp else None, dq, None, None, None, None
    input, target, shift_labels = ctx.saved_tensors
    if ctx.reduction == "none":
        g = as_rows(grad)
    else:  # a scalar loss (fp16 inputs): the incoming gradient times the reduction's factor, fp32
        rows, cols = input.shape
        factor, const = _factor(shift_labels, rows, cols, ctx.ignore_index, ctx.reduction, input.device)
        g = grad.to(torch.float32).reshape(1) * const
        if factor is not None:
            g = g * factor
    dp, dq = tvd_backward(g, input, target, shift_labels, ctx.ignore_index, want_dp, want_dq)
    return dp if want_dp else None, dq if want_dq else None, None, None, None, None


register_autograd(tvd_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(input, target, shift_labels, reduction, ignore_index):
    """The labels as a 1-D tensor (or None), after checking every argument."""
    check_tensor(input, "input")
    check_tensor(target, "target")
    check_float(input, "input")
    check_float(target, "target")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (..., vocab), got a 0-d tensor")
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(
            f"target must have the input's shape {tuple(input.shape)} (same tokens and vocabulary), "
            f"got {tuple(target.shape)}"
        )
    check_same_device(target, "target", input, "input")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_ignore_index(ignore_index)
    return check_labels(shift_labels, "shift_labels", input.shape[:-1], input, "input")


def tvd(
    input: Tensor,
    target: Tensor,
    shift_labels: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """Total variation distance ``0.5 * |input - target|`` between two probability distributions
    ``(..., vocab)`` (liger-kernel's ``liger_tvd``; ``onca.nn.TVDLoss`` defaults to ``batchmean``
    as ``LigerTVDLoss`` does). ``reduction``: ``"none"``, ``"sum"``, ``"mean"`` (over tokens not
    ignored x vocab) or ``"batchmean"`` (over tokens not ignored); tokens whose ``shift_labels``
    equal ``ignore_index`` are left out. The loss is fp32. Gradients ``0.5 * sign(input - target)``
    (0 at ties) for ``input`` and the negation for ``target`` when it requires one. See the module
    docstring for empty and all-ignored inputs."""
    labels = _validate(input, target, shift_labels, reduction, ignore_index)
    if (input.numel() and small_calls.same_dtype(input, target)
            and small_calls.small(input.numel(), input, target)):
        return _torch_tvd(input, target, labels, reduction, ignore_index)
    grad_on = torch.is_grad_enabled() and (input.requires_grad or target.requires_grad)
    # fp16 cannot hold the unit-gradient values of a large mean (0.5 / (tokens x vocab) is below its
    # smallest subnormal past 2**24 elements): rescaling them later by a loss scale (GradScaler)
    # would scale zeros. fp16 computes the gradient in the backward, from the incoming gradient.
    precompute_grad = reduction != "none" and grad_on and input.dtype != torch.float16
    loss, _ = tvd_forward(as_rows(input), as_rows(target), labels, reduction, ignore_index, precompute_grad)
    return loss.view(input.shape) if reduction == "none" else loss


def _torch_tvd(input: Tensor, target: Tensor, labels: Tensor | None, reduction: str,
               ignore_index: int) -> Tensor:
    """A small call by torch's ops (:mod:`onca.ops._small_calls`): ``0.5 * |input - target|`` in
    fp32, the ignored tokens' rows zeroed, the kernels' reductions (a ``mean`` or ``batchmean``
    over no token kept is 0; the half folded into the scalar's divisor, one elementwise op less);
    autograd gives the kernels' gradients (0 at ties, the negation for ``target``), rounded once to
    the inputs' dtype."""
    distance = (input.float() - target.float()).abs()
    kept = None
    if labels is not None:
        kept = (labels != ignore_index).reshape(*input.shape[:-1], 1)
        distance = torch.where(kept, distance, 0.0)
    if reduction == "none":
        return 0.5 * distance
    total = distance.sum()
    if reduction == "sum":
        return 0.5 * total
    tokens = kept.sum().clamp(min=1) if kept is not None else input.numel() // input.shape[-1]
    return total / (tokens * (2 * input.shape[-1])) if reduction == "mean" else total / (2 * tokens)
