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


__all__ += ["cross_entropy", "fused_linear_cross_entropy"]


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    in_place_backward: bool = False,
):
    """Cross entropy of ``logits`` ``(..., vocab)`` against class indices ``target`` ``(...)``.

    As ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``, ``reduction``
    ``"none"``/``"mean"``/``"sum"``, mean over the non-ignored tokens; no class weights), plus the
    z-loss ``lse_square_scale * logsumexp(logits)**2`` per token and Gemma 2's logit soft-capping
    ``softcap * tanh(logits / softcap)``. With every token ignored the mean is 0.0 (torch: NaN).
    ``return_z_loss=True`` returns ``(loss, z_loss)`` (the z-loss part, for logging).
    ``in_place_backward=True`` computes the gradient in the forward pass and writes it over the
    logits (no second logits-sized buffer; the logits are destroyed).
    """
    from onca.ops.cross_entropy import cross_entropy as _cross_entropy

    return _cross_entropy(logits, target, ignore_index, label_smoothing, reduction, lse_square_scale,
                          softcap, return_z_loss, in_place_backward)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    chunk_tokens: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    ``hidden`` ``(..., H)`` (e.g. a causal LM's final hidden states ``(B, S, H)``), ``weight``
    ``(V, H)`` (the LM head, possibly tied to the embedding), ``target`` ``(...)`` class indices.
    The options are :func:`cross_entropy`'s; ``accum_dtype=torch.float32`` accumulates the weight
    gradient in fp32 for bf16/fp16 weights; ``chunk_tokens`` overrides the planned tokens per chunk.
    The loss is fp32. With ``reduction="sum"`` divide by ``num_items_in_batch`` yourself (Hugging
    Face's gradient accumulation); ``reduction="none"`` returns per-token losses (its backward
    recomputes the logits chunk by chunk).
    """
    from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy as _flce

    return _flce(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, lse_square_scale,
                 softcap, return_z_loss, accum_dtype, chunk_tokens)
