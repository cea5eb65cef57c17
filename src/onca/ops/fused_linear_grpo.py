"""Fused linear GRPO (Group Relative Policy Optimization): the clipped policy-gradient loss over
sampled completions, from the policy's hidden states and LM head without the ``(B, T, V)`` logits.

``hidden (B, T, H)`` / ``labels (B, T)``: the B completions' positions, aligned (position ``t`` is
scored against ``labels[:, t]``), ``ignore_index`` where a position is not a completion token (the
completion mask). ``advantages`` is ``(B,)`` (one per completion, TRL's) or ``(B, T)``. As TRL
1.16's ``GRPOTrainer`` (``_compute_loss``), with ``logp`` the per-token log-probability at
``temperature`` and ``old_logps`` the sampling policy's (``logp.detach()`` when not given)::

    log_w = logp - old_logps                        (importance_sampling_level="token")
          = masked mean over the sequence of that   ("sequence", GSPO)
    r     = exp(log_w);  r_clip = clamp(r, 1 - epsilon_low, 1 + epsilon_high)
    (r    = min(r, delta) when delta is given: two-sided clipping)
    per_token = -min(r * A, r_clip * A) + beta * (exp(ref - logp) - (ref - logp) - 1)
    grpo     mean over sequences of (sum of per_token over the sequence's tokens / its token count)
    bnpo     sum of per_token over all tokens / token count
    dr_grpo  sum / (B * max_completion_length)         (max_completion_length defaults to T)
    dapo     sum / num_items_in_batch                   (defaults to the token count)

(token counts clamped to at least 1; TRL's division by the gradient accumulation steps is the
caller's). The KL term needs the reference's per-token log-probabilities: ``ref_logps (B, T)``, or
``ref_hidden``/``ref_weight`` (+ ``ref_bias``) scored here without gradient. The per-token
log-probabilities (and, with ``return_aux``, entropies) come from the chunk driver
(:mod:`onca.ops._chunked_head`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops._chunked_head import plan
from onca.ops._posttrain import check_choice, check_common, policy_logps, reference_logps
from onca.ops._validate import check_float, check_number

__all__ = ["LOSS_TYPES", "fused_linear_grpo", "plan"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence")


def _per_token(t, name, shape, hidden):
    if t is None:
        return None
    check_float(t, name, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (one value per token), got {tuple(t.shape)}")
    if t.device != hidden.device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; move them to one device")
    return t.detach().to(torch.float32)


def fused_linear_grpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    advantages: Tensor,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_bias: Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """GRPO loss of the policy ``hidden (B, T, H)`` / ``weight (V, H)`` (+ ``bias``) over sampled
    completions ``labels (B, T)`` with ``advantages`` ``(B,)`` or ``(B, T)``, without the logits
    (see the module docstring for the ratios, clipping, KL and the ``loss_type`` aggregations).
    Returns the fp32 scalar loss; ``return_aux=True`` returns ``(loss, aux)`` with the detached
    per-token ``logps`` and ``entropy``, and the scalars TRL logs: ``kl`` (mean per-token KL over
    completion tokens, when ``beta != 0``), ``clip_ratio_low``, ``clip_ratio_high`` and
    ``clip_ratio_region``.
    ``accum_dtype``: the weight gradient's accumulator over the chunks (None: the weight's dtype,
    one rounding per chunk, as liger-kernel; ``torch.float32``: fp32, a head-sized buffer more)."""
    hidden, weight, bias = check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux,
                                        temperature=temperature, accum_dtype=accum_dtype)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (batch, tokens, hidden), got shape {tuple(hidden.shape)}")
    b, t = labels.shape
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_choice(importance_sampling_level, "importance_sampling_level", LEVELS)
    check_number(beta, "beta", minimum=0.0)
    check_number(epsilon_low, "epsilon_low", minimum=0.0)
    check_number(epsilon_high, "epsilon_high", minimum=0.0)
    if delta is not None:
        check_number(delta, "delta", minimum=0.0)
    if advantages is None or tuple(getattr(advantages, "shape", ())) not in ((b,), (b, t)):
        raise ValueError(f"advantages must have shape ({b},) or ({b}, {t}), got "
                         f"{tuple(advantages.shape) if isinstance(advantages, Tensor) else advantages!r}")
    adv = _per_token(advantages, "advantages", advantages.shape, hidden)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = _per_token(old_logps, "old_logps", (b, t), hidden)
    ref = _per_token(ref_logps, "ref_logps", (b, t), hidden)
    if beta != 0.0 and ref is None:
        if ref_hidden is None or ref_weight is None:
            raise ValueError("beta != 0 needs the reference: ref_logps, or ref_hidden and ref_weight")
        ref = reference_logps(ref_hidden, ref_weight, labels, ref_bias, ignore_index=ignore_index,
                              temperature=temperature, chunk_tokens=chunk_tokens).per_token
    if max_completion_length is not None and (isinstance(max_completion_length, bool)
                                              or not isinstance(max_completion_length, int)
                                              or max_completion_length < 1):
        raise ValueError(f"max_completion_length must be None or a positive int, got {max_completion_length!r}")

    logps = policy_logps(hidden, weight, labels, bias, ignore_index=ignore_index, temperature=temperature,
                         entropy=return_aux, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype)
    logp, mask = logps.per_token, logps.mask.to(torch.float32)
    old = logp.detach() if old is None else old
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        diff = ref - logp
        per_token_kl = torch.exp(diff) - diff - 1
        per_token = per_token + beta * per_token_kl
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (b * (max_completion_length or t))
    else:
        if num_items_in_batch is None:
            normaliser = mask.sum().clamp(min=1.0)
        elif isinstance(num_items_in_batch, Tensor):
            normaliser = num_items_in_batch.to(device=hidden.device, dtype=torch.float32).clamp(min=1.0)
        else:
            check_number(num_items_in_batch, "num_items_in_batch", minimum=1.0)
            normaliser = float(num_items_in_batch)
        loss = masked.sum() / normaliser
    if not return_aux:
        return loss
    tokens = mask.sum().clamp(min=1.0)
    ratio = coef_1.detach().expand_as(mask)
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(torch.float32)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(torch.float32)
    aux = {"logps": logp.detach(), "entropy": logps.entropy.detach(),
           "clip_ratio_low": (low * mask).sum() / tokens, "clip_ratio_high": (high * mask).sum() / tokens,
           "clip_ratio_region": (torch.clamp(low + high, max=1.0) * mask).sum() / tokens}
    if beta != 0.0:
        aux["kl"] = (per_token_kl.detach() * mask).sum() / tokens
    return loss, aux
