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


from onca.ops.rope import rotary_pos_emb as _rotary_pos_emb

__all__ += ["rotary_pos_emb"]


def rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    in_place_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one launch: a drop-in for transformers'
    ``apply_rotary_pos_emb`` (Llama, Qwen, Mistral, ...; Phi-3 style partial rotary included).

    Returns ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` on the first
    ``rotary_dim = cos.shape[-1]`` dims of each head, the rest passed through unchanged. ``q``/``k``
    are ``(batch, heads, seq, head_dim)`` (``unsqueeze_dim=1``) or ``(batch, seq, heads, head_dim)``
    (``unsqueeze_dim=2``), ``k`` with as many or fewer heads (GQA); ``cos``/``sin`` are
    ``(1 or batch, seq, rotary_dim)``. Strided views (e.g. transposed projections) are read in place.
    The results are new tensors in the inputs' layout and promoted dtype; ``cos``/``sin`` get no
    gradient. ``position_ids`` is ignored, as in transformers (an ``int`` there is taken as
    transformers 5's positional ``unsqueeze_dim``). ``in_place_backward=True`` writes ``dq``/``dk``
    over the incoming gradients (saves memory; only when nothing else reads those gradients).
    """
    return _rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, in_place_backward)
