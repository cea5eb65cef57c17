"""The public functional API: thin, documented entry points to the ops' autograd Functions."""

from __future__ import annotations

import torch

from onca.ops.rms_norm import rms_norm as _rms_norm

__all__ = ["rms_norm"]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (offset + weight)``.

    ``casting_mode`` is ``"llama"`` (normalise in fp32, cast to ``x``'s dtype, then scale),
    ``"gemma"`` (all in fp32, then cast; use with ``offset=1.0`` for Gemma's ``1 + w``) or
    ``"none"`` (round to ``x``'s dtype at each step). The result has ``x``'s dtype and shape.
    ``in_place=True`` lets the backward pass write ``dx`` into the incoming gradient's storage.
    """
    return _rms_norm(x, weight, eps, offset, casting_mode, in_place)


from onca.ops.layer_norm import layer_norm as _layer_norm  # noqa: E402
from onca.ops.fused_add_rms_norm import fused_add_rms_norm as _fused_add_rms_norm  # noqa: E402

__all__ += ["layer_norm", "fused_add_rms_norm"]


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    ``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)`` with Onca's kernels:
    biased variance, fp32 statistics and affine transform, one rounding to ``x``'s dtype.
    ``weight`` and ``bias`` may be None; they may be fp32 with bf16/fp16 ``x``.
    """
    return _layer_norm(x, weight, bias, eps)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass: a decoder layer's residual add and
    the RMSNorm that follows it.

    ``x + residual`` is rounded to ``x``'s dtype as PyTorch's add rounds it; the RMSNorm takes
    ``eps``, ``offset`` and ``casting_mode`` as ``onca.functional.rms_norm`` does. ``x`` and
    ``residual`` receive the same gradient. ``in_place=True`` lets the backward pass write it into
    the storage of the incoming gradient of the normalised output.
    """
    return _fused_add_rms_norm(x, residual, weight, eps, offset, casting_mode, in_place)
