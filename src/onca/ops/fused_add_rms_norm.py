"""Residual add fused with RMSNorm: ``h = x + residual``, returns ``(rms_norm(h), h)`` in one pass.

This is the pattern of every pre-norm decoder layer (Llama, Mistral, Qwen, Gemma, ...)::

    hidden_states = residual + hidden_states   # in the activations' dtype
    residual = hidden_states
    hidden_states = norm(hidden_states)

``h`` is rounded to the input dtype exactly as PyTorch's eager add rounds it (the sum is formed in
fp32 and rounded once), and the RMSNorm of ``h`` follows ``onca.ops.rms_norm``: the same casting
modes (``llama``, ``gemma``, ``none``), the same ``offset`` (Gemma's ``1 + w``) and the same kernels,
with their residual switches on. Both outputs have the input's dtype.

Backward: ``x`` and ``residual`` receive the same gradient, ``d(rms_norm)/dh . dy + d_residual_out``;
one tensor is returned for both (as PyTorch's own add does). Saved for backward: ``h`` (which is
also the second output, so it costs no memory) and one fp32 ``rstd`` per row; the normalised row
is recomputed. With ``overwrite_grad_output=True`` the backward pass writes that gradient into the
storage of the incoming gradient of the normalised output.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._rows import rows_ready
from onca.ops._validate import check_float, check_same_device
from onca.ops.rms_norm import (
    CASTING_MODES,
    grad_output_buffer,
    launch_rms_norm_backward,
    launch_rms_norm_forward,
    may_overwrite,
    validate_options,
    validate_weight,
)
from onca.ops.rms_norm import plan as rms_norm_plan
from onca.tiling import RowPlan

__all__ = ["CASTING_MODES", "fused_add_rms_norm", "plan"]


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for inputs of ``shape`` (``(..., hidden)``)."""
    return rms_norm_plan(shape, dtype, profile, residual=True)


# --------------------------------------------------------------------------------------------- ops


@custom_op("fused_add_rms_norm_forward")
def fused_add_rms_norm_forward(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float,
                               casting: int, overwrite_grad_output: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h, rstd)`` for ``x`` and ``residual`` of one shape (any leading dimensions).
    ``overwrite_grad_output`` is the backward's (see ``fused_add_rms_norm``)."""
    return launch_rms_norm_forward(x, residual, weight, eps, offset, casting)


@fused_add_rms_norm_forward.register_fake
def _(x, residual, weight, eps, offset, casting, overwrite_grad_output):
    rstd = x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)
    return x.new_empty(x.shape), x.new_empty(x.shape), rstd


@custom_op("fused_add_rms_norm_backward")
def fused_add_rms_norm_backward(dy: Tensor, dres: Tensor | None, h: Tensor, weight: Tensor, rstd: Tensor,
                                offset: float, casting: int,
                                overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``: ``dx`` is the gradient of both ``x`` and ``residual`` (``dres``, the
    residual output's gradient, added where given); with ``overwrite_grad_output`` (eager route only)
    it is written into ``dy``'s storage."""
    dx = grad_output_buffer(dy, h, overwrite_grad_output)
    dw = launch_rms_norm_backward(dy, dres, h, weight, rstd, offset, casting, dx, residual=True)
    return dx, dw


@fused_add_rms_norm_backward.register_fake
def _(dy, dres, h, weight, rstd, offset, casting, overwrite_grad_output):
    return h.new_empty(h.shape), torch.empty_like(weight)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    _x, _residual, weight, _eps, offset, casting, overwrite_grad_output = inputs
    _y, h, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(h, weight, rstd)
    ctx.offset, ctx.casting, ctx.overwrite_grad_output = offset, casting, overwrite_grad_output


def _backward(ctx, dy, dres, _drstd):
    h, weight, rstd = ctx.saved_tensors
    if dy is None:
        # Only the residual output was used: the normalised path contributes nothing.
        dw = torch.zeros_like(weight)
        return dres, dres, dw, None, None, None, None
    overwrite = may_overwrite(ctx.overwrite_grad_output, dy, h)
    dx, dw = fused_add_rms_norm_backward(dy, dres, h, weight, rstd, ctx.offset, ctx.casting, overwrite)
    return dx, dx, dw, None, None, None, None


register_autograd(fused_add_rms_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    overwrite_grad_output: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass: a decoder layer's residual add and
    the RMSNorm that follows it.

    ``x + residual`` is rounded to ``x``'s dtype as PyTorch's add rounds it; the RMSNorm takes
    ``eps``, ``offset`` and ``casting_mode`` as ``onca.functional.rms_norm`` does. ``x`` and
    ``residual`` receive the same gradient. ``x`` may have any leading shape, including no rows.
    ``overwrite_grad_output=True`` lets the backward pass write that gradient into the storage of
    the incoming gradient of the normalised output (eager only; compiled graphs manage their own
    buffers).
    """
    check_float(x, "x")
    check_float(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    check_same_device(residual, "residual", x, "x")
    validate_weight(weight, x)
    casting = validate_options(x, eps, offset, casting_mode, overwrite_grad_output)
    y, h, _ = fused_add_rms_norm_forward(rows_ready(x), rows_ready(residual), weight.contiguous(), float(eps),
                                         float(offset), casting, overwrite_grad_output)
    return y, h
