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


# ------------------------------------------------------------------ KL divergence, JSD (issue 6)

from onca.ops.fused_linear_jsd import fused_linear_jsd as _fused_linear_jsd  # noqa: E402
from onca.ops.jsd import jsd as _jsd  # noqa: E402
from onca.ops.kl_div import kl_div as _kl_div  # noqa: E402

__all__ += ["kl_div", "jsd", "fused_linear_jsd"]


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
           log_target: bool = False) -> torch.Tensor:
    """``torch.nn.functional.kl_div``: ``input`` is log-probabilities, ``target`` probabilities (or
    log-probabilities with ``log_target=True``), same shape ``(..., vocab)``. ``reduction`` is
    ``"none"``, ``"sum"``, ``"mean"`` (over all elements) or ``"batchmean"`` (over
    ``input.shape[0]``). Gradients for ``input`` and, when it requires one, ``target``."""
    return _kl_div(input, target, reduction, log_target)


def jsd(
    input: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    from_logits: bool = False,
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence (liger-kernel's ``LigerJSD``): student ``input`` and
    teacher ``target`` log-probabilities ``(..., vocab)``; ``beta`` in [0, 1] (0: KL(teacher ||
    student), 1: KL(student || teacher)); tokens whose ``labels`` equal ``ignore_index`` are left
    out; ``reduction="mean"`` averages over the tokens not ignored. ``temperature != 1`` (or
    ``from_logits=True``) compares ``softmax(input / T)`` with ``softmax(target / T)``, so logits may
    be passed. Gradient w.r.t. ``input`` only."""
    return _jsd(input, target, labels, beta, ignore_index, temperature, reduction, from_logits)


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Distillation loss ``jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T)``
    at ``temperature``, computed over chunks of tokens so that neither model's logits exist in full
    (liger-kernel's ``LigerFusedLinearJSD``). Gradients for the student's hidden states and head
    (fp32 accumulation for bf16/fp16 heads); the teacher gets none."""
    return _fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta,
                             ignore_index, temperature, reduction)
