"""Generalised Jensen-Shannon divergence between a student and a teacher distribution.

Arguments follow liger-kernel's ``LigerJSDFunction`` (and PyTorch's losses): ``input`` is the
student's log-probabilities ``log q``, ``target`` the teacher's ``log p``, both ``(..., vocab)``.
With ``M = beta * p + (1 - beta) * q``, per token::

    beta in (0, 1):  JSD_beta = beta * KL(p || M) + (1 - beta) * KL(q || M)
    beta == 0:       KL(p || q)   (forward KL: torch's kl_div(input, target, log_target=True))
    beta == 1:       KL(q || p)   (reverse KL: torch's kl_div(target, input, log_target=True))

(the two limits are defined separately, as liger-kernel and TRL's GKD loss do: the formula itself
would give 0 there). Terms whose probability is 0 contribute 0 (``0 * log 0 = 0``).

Tokens whose ``labels`` entry equals ``ignore_index`` contribute nothing. ``reduction``:
``"mean"`` (default, liger's semantics) divides the sum over tokens by the number of tokens that
are not ignored (a batchmean over tokens; 0, not NaN, when every token is ignored); ``"sum"``;
``"none"`` gives one loss per token (shape ``input.shape[:-1]``, 0 for ignored tokens). With no
tokens at all, ``sum`` is 0 and ``mean`` follows the same rule: 0 with labels, NaN without (torch's
mean over nothing, and its ``kl_div`` batchmean at the two limits).

Temperature: the divergence is between ``q = softmax(input / T)`` and ``p = softmax(target / T)``.
Because a log-probability differs from its logits by a per-row constant, which the softmax removes,
this is the same whether the inputs are logits or log-probabilities, so for ``T != 1`` either may
be passed. With ``T == 1`` the inputs are used as the log-probabilities they are declared to be,
without renormalising (liger's semantics: one pass, and the gradient is w.r.t. the log-probability
inputs as given); ``from_logits=True`` renormalises at ``T == 1`` too, for raw logits. When the
kernel normalises, the gradient is taken through that normalisation (w.r.t. the raw inputs).

The gradient is w.r.t. ``input`` only; the teacher is treated as a constant (``target`` gets no
gradient, as in liger-kernel). For ``mean``/``sum`` it is computed by the forward kernel (the
loss is last in the graph, so this saves reading both tensors again) and kept; the backward pass
rescales it in place by the incoming gradient, read on the device, touching nothing when it is 1
(``onca.ops.cross_entropy.ForwardGradients``; traced, into a new tensor). fp16 inputs skip that:
a mean's unit-scale gradients fall below fp16's normal range before a loss scale (GradScaler)
could lift them, so their backward kernel computes the gradient with the incoming gradient times
the token scale folded in. For ``none`` the backward kernel recomputes it with each token's
incoming gradient, from the saved ``input``/``target``.

Rows are tiled over the vocabulary with the plan's width. Without normalisation every element is
independent: one pass. With it, a row that does not fit one tile takes three passes: the two
log-sum-exps (online), then the loss and the sum of the per-element gradients, then the gradient
through the log-softmax. Reductions are deterministic (one row sum per row, added up after).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._partials import sum_scaled
from onca.ops._rows import as_rows, rows_cols
from onca.ops._validate import (
    check_bool,
    check_float,
    check_index,
    check_number,
    check_same_device,
    check_tensor,
)
from onca.ops.cross_entropy import keep_forward_gradients, take_forward_gradients
from onca.tiling import RowPlan, plan_rows

__all__ = [
    "jsd", "REDUCTIONS", "plan", "plan_divergence", "jsd_rows", "gradient_view", "token_scale", "check_beta",
    "check_temperature", "check_ignore_index", "check_labels",
]

REDUCTIONS = ("none", "sum", "mean")

# Live tiles (input dtype; fp32): input, target and dinput; their fp32 forms, the mixture's
# log-probability, the two probabilities and the per-element loss and gradient.
TILES = dict(live_tiles=3, fp32_tiles=6)
# On a GPU registers bound the tile: the normalising path keeps ~15 fp32 values per element alive
# (sm_90: ~122 registers at 8 elements per thread, 254 at 16, spills at 32), so its tiles hold at
# most this many elements per thread of the largest program; every launch gets at least the warps
# that give its tile this many elements per thread (the one-pass path: 40-110 registers).
ELEMENTS_PER_THREAD = 8

_FORWARD_KL, _REVERSE_KL, _GENERAL = 0, 1, 2


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _divergence_terms(x, y, beta, MODE: tl.constexpr):
    """Elementwise loss and its derivative w.r.t. ``x``, for student ``x = log q`` and teacher
    ``y = log p`` (fp32, ``-inf`` allowed: a zero probability contributes 0)."""
    if MODE == 0:  # KL(p || q)
        p = tl.exp(y)
        loss = tl.where(p == 0.0, 0.0, p * (y - x))
        grad = -p
    elif MODE == 1:  # KL(q || p)
        q = tl.exp(x)
        loss = tl.where(q == 0.0, 0.0, q * (x - y))
        grad = loss + q
    else:
        # log M = log(beta p + (1 - beta) q), shifted by max(x, y) so that it never underflows.
        m = tl.maximum(x, y)
        m = tl.where(m == float("-inf"), 0.0, m)
        mix = beta * tl.exp(y - m) + (1.0 - beta) * tl.exp(x - m)
        log_mix = m + tl.log(tl.where(mix == 0.0, 1.0, mix))
        p = tl.exp(y)
        q = tl.exp(x)
        q_term = tl.where(q == 0.0, 0.0, q * (x - log_mix))
        p_term = tl.where(p == 0.0, 0.0, p * (y - log_mix))
        loss = beta * p_term + (1.0 - beta) * q_term
        # d/dx of the loss: the terms through M cancel, leaving (1 - beta) q (x - log M).
        grad = (1.0 - beta) * q_term
    return loss, grad


@triton.jit
def _lse_update(m, s, v):
    """Online log-sum-exp over a row: fold the tile ``v`` (fp32, ``-inf`` padded) into the running
    maximum ``m`` and scaled sum ``s``."""
    m_new = tl.maximum(m, tl.max(v, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - shift) + tl.sum(tl.exp(v - shift[:, None]), axis=1)
    return m_new, s


@triton.jit
def _lse_finish(m, s):
    """``log(sum(exp))`` of a row, and 0 for a row with nothing in it (ignored or padding)."""
    shift = tl.where(m == float("-inf"), 0.0, m)
    return tl.where(s == 0.0, 0.0, shift + tl.log(tl.where(s == 0.0, 1.0, s)))


@fast_launch
@triton.jit
def _jsd_kernel(
    x_ptr, y_ptr, labels_ptr, g_ptr, dx_ptr, loss_ptr,
    n_rows, n_cols, x_row_stride, y_row_stride, dx_row_stride,
    beta, inv_temp, ignore_index, g_const,
    MODE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    G_MODE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Per row: the divergence summed over the vocabulary (into ``loss_ptr[row]``) and, when
    ``WRITE_GRAD``, its gradient w.r.t. ``x`` times ``g`` (``G_MODE``: the host constant
    ``g_const`` (0), a device scalar (1), or one value per row (2)).

    Ignored rows load nothing, and write a zero loss and a zero gradient.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        if HAS_LABELS:
            labels = tl.load(labels_ptr + rows, mask=row_mask, other=ignore_index)
            valid = row_mask & (labels != ignore_index)
        else:
            valid = row_mask
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        if WRITE_GRAD:
            dx_rows = dx_ptr + rows64 * dx_row_stride
            if G_MODE == 2:
                g = tl.load(g_ptr + rows, mask=valid, other=0.0).to(tl.float32)
            elif G_MODE == 1:
                g = tl.where(valid, tl.load(g_ptr).to(tl.float32), 0.0)
            else:
                g = tl.where(valid, g_const, 0.0)
        row_loss = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        if not NORMALIZE:
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = (cols < n_cols)[None, :]
                mask = valid[:, None] & col_mask
                # Padding (and ignored rows) read as x = y = 0: a zero loss and a finite gradient,
                # which the store's mask or the zero factor g of an ignored row removes.
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                loss, grad = _divergence_terms(x, y, beta, MODE)
                row_loss += tl.sum(loss, axis=1)
                if WRITE_GRAD:
                    tl.store(dx_rows + cols[None, :], (grad * g[:, None]).to(dx_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & col_mask)
        elif COL_TILES == 1:
            col_mask = (col_offsets < n_cols)[None, :]
            mask = valid[:, None] & col_mask
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            y = tl.load(y_rows + col_offsets[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            x = x * inv_temp
            y = y * inv_temp
            m_x, s_x = _lse_update(tl.full([BLOCK_ROWS], float("-inf"), tl.float32),
                                   tl.zeros([BLOCK_ROWS], dtype=tl.float32), x)
            m_y, s_y = _lse_update(tl.full([BLOCK_ROWS], float("-inf"), tl.float32),
                                   tl.zeros([BLOCK_ROWS], dtype=tl.float32), y)
            lse_x = _lse_finish(m_x, s_x)
            lse_y = _lse_finish(m_y, s_y)
            # Padding reads as log q = log p = 0 from here on: a zero loss, and masked out of sums.
            log_q = tl.where(mask, x - lse_x[:, None], 0.0)
            log_p = tl.where(mask, y - lse_y[:, None], 0.0)
            loss, grad = _divergence_terms(log_q, log_p, beta, MODE)
            row_loss += tl.sum(loss, axis=1)
            if WRITE_GRAD:
                # Through the log-softmax: dz = (dlog_q - q * sum(dlog_q)) / T.
                grad_sum = tl.sum(tl.where(mask, grad, 0.0), axis=1)
                dz = (grad - tl.exp(log_q) * grad_sum[:, None]) * (g * inv_temp)[:, None]
                tl.store(dx_rows + col_offsets[None, :], dz.to(dx_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & col_mask)
        else:
            # Pass 1: both rows' log-sum-exp, online.
            m_x = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
            m_y = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
            s_x = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            s_y = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = valid[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                y = tl.load(y_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                m_x, s_x = _lse_update(m_x, s_x, x * inv_temp)
                m_y, s_y = _lse_update(m_y, s_y, y * inv_temp)
            lse_x = _lse_finish(m_x, s_x)
            lse_y = _lse_finish(m_y, s_y)
            # Pass 2: the loss, and the sum of the per-element gradients that the log-softmax needs.
            grad_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = valid[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                y = tl.load(y_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                log_q = tl.where(mask, x * inv_temp - lse_x[:, None], 0.0)
                log_p = tl.where(mask, y * inv_temp - lse_y[:, None], 0.0)
                loss, grad = _divergence_terms(log_q, log_p, beta, MODE)
                row_loss += tl.sum(loss, axis=1)
                grad_sum += tl.sum(tl.where(mask, grad, 0.0), axis=1)
            # Pass 3: the gradient through the log-softmax. Each tile is read before it is written,
            # so dx may alias x (the fused linear op writes it over the logits it reads).
            if WRITE_GRAD:
                for tile in range(COL_TILES):
                    cols = tile * BLOCK_COLS + col_offsets
                    col_mask = (cols < n_cols)[None, :]
                    mask = valid[:, None] & col_mask
                    x = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                    y = tl.load(y_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                    log_q = tl.where(mask, x * inv_temp - lse_x[:, None], 0.0)
                    log_p = tl.where(mask, y * inv_temp - lse_y[:, None], 0.0)
                    _, grad = _divergence_terms(log_q, log_p, beta, MODE)
                    dz = (grad - tl.exp(log_q) * grad_sum[:, None]) * (g * inv_temp)[:, None]
                    tl.store(dx_rows + cols[None, :], dz.to(dx_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & col_mask)
        tl.store(loss_ptr + rows, row_loss, mask=row_mask)


# --------------------------------------------------------------------------------------- launchers


def plan_divergence(rows: int, cols: int, dtype: torch.dtype, normalize: bool,
                    profile: DeviceProfile | None = None) -> RowPlan:
    """The divergence kernel's plan. On a GPU the normalising path's tiles are capped at
    ``ELEMENTS_PER_THREAD`` per thread of a ``max_warps`` program, and every plan gets at least the
    warps that give its tile that many elements per thread (within the profile's cap)."""
    profile = profile or get_profile()
    cap = None
    if normalize and profile.kind == "cuda":
        cap = profile.max_warps * 32 * ELEMENTS_PER_THREAD
    p = plan_rows(rows, cols, dtype, profile=profile, max_block_cols=cap, **TILES)
    wanted = p.block_rows * p.block_cols // (32 * ELEMENTS_PER_THREAD)
    warps = max(p.num_warps, min(profile.max_warps, wanted))
    return p if warps == p.num_warps else dataclasses.replace(p, num_warps=warps)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The plans for inputs of ``shape`` (``(..., vocab)``): one kernel serves the forward pass
    and the backward pass of ``reduction="none"``; ``log_probs`` is its one-pass path (temperature
    1), ``normalizing`` the log-softmax path (temperature != 1, or ``from_logits``)."""
    rows, cols = rows_cols(shape)
    return {"log_probs": plan_divergence(rows, cols, dtype, False, profile),
            "normalizing": plan_divergence(rows, cols, dtype, True, profile)}


def mode_of(beta: float) -> int:
    return _FORWARD_KL if beta == 0.0 else _REVERSE_KL if beta == 1.0 else _GENERAL


def jsd_rows(x2d, y2d, labels, g, dx, row_loss, beta: float, ignore_index: int, temperature: float,
             normalize: bool, g_per_row: bool = False) -> None:
    """Launch the divergence kernel on ``(rows, vocab)`` matrices (at least one element).

    Writes each row's divergence into ``row_loss`` (fp32, ``(rows,)``) and, when ``dx`` is given,
    the gradient w.r.t. ``x2d`` times ``g`` (a host float, a one-element device tensor, or ``(rows,)``
    when ``g_per_row``). ``dx`` may alias ``x2d`` when ``normalize`` is set (each tile is read before
    it is written). Used by this op and by the fused linear JSD.
    """
    rows, cols = x2d.shape
    p = plan_divergence(rows, cols, x2d.dtype, normalize)
    on_host = isinstance(g, float)
    _jsd_kernel[(p.grid,)](
        x2d, y2d, labels, x2d if on_host else g, dx, row_loss,
        rows, cols, x2d.stride(0), y2d.stride(0), dx.stride(0) if dx is not None else 0,
        float(beta), 1.0 / float(temperature), int(ignore_index), g if on_host else 1.0,
        MODE=mode_of(beta), NORMALIZE=bool(normalize), HAS_LABELS=labels is not None,
        G_MODE=2 if g_per_row else 0 if on_host else 1, WRITE_GRAD=dx is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )


def gradient_view(logits: Tensor, dtype: torch.dtype) -> Tensor:
    """Where :func:`jsd_rows` may write a ``dtype`` gradient over the fp32 ``(n, V)`` ``logits`` it
    reads (``dx`` aliasing ``x2d``): the logits themselves for fp32, else the first half of each fp32
    row's bytes, row stride unchanged. Safe because each row block is one program's and every tile
    of a row is read before the tile holding its bytes' first half is written (the grad pass walks the
    tiles in order, and a 16-bit tile ``k`` lies in the fp32 tiles ``<= k``)."""
    if dtype == torch.float32:
        return logits
    return logits.view(dtype)[:, : logits.shape[1]]


def token_scale(labels, rows: int, ignore_index: int, reduction: str, device) -> float | torch.Tensor:
    """The factor each token's loss is multiplied by: a host float where it does not depend on the
    labels (no tensor filled per call), else a one-element fp32 device tensor (no host sync).
    ``mean``: ``1 / max(tokens not ignored, 1)`` with labels (0 when none counts), ``1 / rows``
    without (NaN for no rows, as torch's mean over nothing); else 1."""
    if reduction != "mean":
        return 1.0
    if labels is None:
        return 1.0 / rows if rows else float("nan")
    count = (labels != ignore_index).sum().clamp_(min=1).to(torch.float32)
    return count.reciprocal_().reshape(1)


def _reduce(row_loss: Tensor, scale: float | Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    if reduction == "none":
        return row_loss.to(dtype)
    return sum_scaled(row_loss, dtype, factor=scale)


@custom_op("jsd_forward")
def jsd_forward(input: Tensor, target: Tensor, labels: Tensor | None, beta: float, ignore_index: int,
                temperature: float, reduction: str, normalize: bool,
                precompute_grad: bool) -> tuple[Tensor, Tensor]:
    """``(loss, dinput)`` for the 2-D ``input``/``target`` and 1-D ``labels``: the loss per row
    (``none``) or reduced, in the input's dtype; ``dinput`` (for an incoming gradient of 1) when
    ``precompute_grad`` and the loss is a scalar, else an empty tensor."""
    rows, cols = input.shape
    dx = None
    if precompute_grad and reduction != "none":
        dx = torch.empty((rows, cols), dtype=input.dtype, device=input.device)
    scale = token_scale(labels, rows, ignore_index, reduction, input.device)
    # The kernel stores every row's loss; rows of no columns have none.
    empty = input.numel() == 0
    row_loss = (torch.zeros if empty else torch.empty)(rows, dtype=torch.float32, device=input.device)
    if not empty:
        jsd_rows(input, target, labels, scale, dx, row_loss, beta, ignore_index, temperature, normalize)
    return _reduce(row_loss, scale, reduction, input.dtype), dx if dx is not None else input.new_empty(0)


@jsd_forward.register_fake
def _(input, target, labels, beta, ignore_index, temperature, reduction, normalize, precompute_grad):
    loss = input.new_empty(input.shape[:1] if reduction == "none" else ())
    dx = input.new_empty(input.shape if precompute_grad and reduction != "none" else (0,))
    return loss, dx


@custom_op("jsd_backward")
def jsd_backward(grad: Tensor, input: Tensor, target: Tensor, labels: Tensor | None, beta: float,
                 ignore_index: int, temperature: float, normalize: bool) -> Tensor:
    """``dinput`` for the per-row incoming gradient ``grad`` (``(rows,)``, reduction ``none``), or for
    a 0-d one that already holds the reduction's token scale (a scalar loss whose gradient was not
    computed in the forward pass)."""
    rows, cols = input.shape
    dx = torch.empty((rows, cols), dtype=input.dtype, device=input.device)
    if input.numel() == 0:
        return dx
    g = grad.to(torch.float32).reshape(-1).contiguous()
    row_loss = torch.empty(rows, dtype=torch.float32, device=input.device)
    jsd_rows(input, target, labels, g, dx, row_loss, beta, ignore_index, temperature, normalize,
             g_per_row=grad.dim() == 1)
    return dx


@jsd_backward.register_fake
def _(grad, input, target, labels, beta, ignore_index, temperature, normalize):
    return input.new_empty(input.shape)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Keeps ``dinput`` when the forward op wrote it (``keep_forward_gradients``), else saves the
    2-D inputs and the labels."""
    input, target, labels, beta, ignore_index, temperature, reduction, normalize, precompute_grad = inputs
    loss, dx = output
    ctx.mark_non_differentiable(dx)
    ctx.precomputed = precompute_grad and reduction != "none"
    ctx.reduction = reduction
    ctx.args = (beta, ignore_index, temperature, normalize)
    if ctx.precomputed:
        keep_forward_gradients(ctx, [dx], input, loss)
    else:
        ctx.save_for_backward(input, target, labels)


def _backward(ctx, grad, _grad_dx):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None, None, None, None
    if ctx.precomputed:
        (dx,) = take_forward_gradients(ctx, grad)
    else:
        input, target, labels = ctx.saved_tensors
        if ctx.reduction != "none":  # a scalar loss (fp16): the incoming gradient times the token scale
            rows = input.shape[0]
            scale = token_scale(labels, rows, ctx.args[1], ctx.reduction, input.device)
            grad = grad.to(torch.float32).reshape(())
            grad = grad * (scale if isinstance(scale, float) else scale.reshape(()))
        dx = jsd_backward(grad, input, target, labels, *ctx.args)
    return dx, None, None, None, None, None, None, None, None


register_autograd(jsd_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def check_beta(beta) -> None:
    check_number(beta, "beta", minimum=0.0)
    if beta > 1.0:
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")


def check_temperature(temperature) -> None:
    check_number(temperature, "temperature", minimum=0.0)
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")


def check_ignore_index(ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def check_labels(labels, name: str, tokens_shape, ref: torch.Tensor, ref_name: str):
    """``labels`` (one per token, any leading shape or flat) as a contiguous 1-D tensor, or None."""
    if labels is None:
        return None
    check_index(labels, name)
    rows = math.prod(tokens_shape)
    if tuple(labels.shape) not in (tuple(tokens_shape), (rows,)):
        raise ValueError(
            f"{name} must have shape {tuple(tokens_shape)} (one per token), got {tuple(labels.shape)}"
        )
    check_same_device(labels, name, ref, ref_name)
    return labels.reshape(-1).contiguous()


def _validate(input, target, labels, beta, ignore_index, temperature, reduction, from_logits):
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
    check_beta(beta)
    check_temperature(temperature)
    check_ignore_index(ignore_index)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_bool(from_logits, "from_logits")
    return check_labels(labels, "labels", input.shape[:-1], input, "input")


def jsd(
    input: Tensor,
    target: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    from_logits: bool = False,
) -> Tensor:
    """Generalised Jensen-Shannon divergence (liger-kernel's ``LigerJSD``): student ``input`` and
    teacher ``target`` log-probabilities ``(..., vocab)``; ``beta`` in [0, 1] (0: KL(teacher ||
    student), 1: KL(student || teacher)); tokens whose ``labels`` equal ``ignore_index`` are left
    out; ``reduction="mean"`` averages over the tokens not ignored. ``temperature != 1`` (or
    ``from_logits=True``) compares ``softmax(input / T)`` with ``softmax(target / T)``, so logits may
    be passed. Gradient w.r.t. ``input`` only. See the module docstring (empty inputs included)."""
    labels1d = _validate(input, target, labels, beta, ignore_index, temperature, reduction, from_logits)
    normalize = from_logits or temperature != 1.0
    # A scalar loss is last in the graph: its gradient is written by the forward kernel, except in
    # fp16, whose unit-scale gradients of a mean fall below its normal range before a loss scale
    # (GradScaler) could lift them; there the backward computes them with the scale folded in.
    precompute_grad = (reduction != "none" and torch.is_grad_enabled() and input.requires_grad
                       and input.dtype != torch.float16)
    loss, _ = jsd_forward(as_rows(input), as_rows(target), labels1d, float(beta), ignore_index,
                          float(temperature), reduction, normalize, precompute_grad)
    return loss.view(input.shape[:-1]) if reduction == "none" else loss
