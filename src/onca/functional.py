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


from onca.ops.embedding import embedding as _embedding  # noqa: E402

__all__ += ["embedding"]


def embedding(
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    deterministic: bool = False,
    *,
    scale_grad_by_freq: bool = False,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Embedding lookup ``weight[indices]``: ``(*indices.shape, embedding_dim)`` in the weight's dtype.

    ``indices``: int32 or int64, any shape. ``padding_idx``: that row gets no gradient (negative
    values count from the end). The weight gradient accumulates in fp32; ``deterministic=True``
    makes it bitwise reproducible (sorted segment reduction; bf16/fp16 weights always use it),
    otherwise fp32 weights use atomic adds. ``check_bounds`` (default on) raises an
    ``IndexError``/``ValueError`` for an index outside the table at the cost of one host-device
    synchronisation; without it, out-of-range indices give zero rows and no gradient.
    """
    return _embedding(indices, weight, padding_idx, deterministic, scale_grad_by_freq, check_bounds)


from onca.ops.attn_res import attn_res as _attn_res  # noqa: E402

__all__ += ["attn_res"]


def attn_res(V: torch.Tensor, w_query: torch.Tensor, w_norm: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Attention residuals: softmax attention over the first dimension of ``V`` (``(N, ..., D)``,
    e.g. ``[N, B, T, D]``, the outputs of N earlier layers).

    ``K = rms_norm(V) * w_norm`` over D, ``score = <w_query, K>``, ``alpha = softmax(score)`` over N,
    and the result ``sum_n alpha[n] * V[n]`` has shape ``(..., D)`` and ``V``'s dtype. ``w_query``
    and ``w_norm`` have shape ``(D,)``; all arithmetic is in fp32. Differentiable in all three.
    """
    return _attn_res(V, w_query, w_norm, eps)
