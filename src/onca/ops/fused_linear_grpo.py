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
``ref_hidden``/``ref_weight`` (+ ``ref_bias``) scored here without gradient.

Every aggregation is ``sum_t w[t] * per_token[t]`` with weights ``w`` from the labels alone, so with
token-level ratios each token's ``dLoss/dlogp`` is known from its own log-probability: the loss
then runs on token chunks with its gradient in the forward pass (:mod:`onca.ops._token_head`: three
head matmuls per chunk, the derivative below in closed form). Sequence-level ratios (a token's
derivative needs its whole sequence), fp16 inputs, calls without a gradient and small calls take the
chunk driver's per-token log-probabilities (:mod:`onca.ops._chunked_head`: four head matmuls), the
same formulas differentiated by autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops._chunked_head import plan, small_head
from onca.ops._posttrain import check_choice, check_common, policy_logps, reference_logps
from onca.ops._token_head import register_token_loss, token_loss, use_token_chunks
from onca.ops._validate import check_accum_dtype, check_float, check_number

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

    mask = (labels != ignore_index).to(torch.float32)
    weights = _token_weights(mask, loss_type, max_completion_length, num_items_in_batch)
    params = [epsilon_low, epsilon_high, -1.0 if delta is None else delta, beta, float(old is not None)]
    extras = (old if old is not None else mask, adv.expand(b, t), ref if ref is not None else mask, weights)
    if (importance_sampling_level == "token" and use_token_chunks(hidden, weight, bias)
            and not small_head(hidden, weight, labels, count=False)):
        loss, logp, entropy = token_loss(
            hidden, weight, bias, labels, extras, loss="grpo", params=params, ignore_index=ignore_index,
            temperature=temperature, entropy=return_aux, chunk_tokens=chunk_tokens,
            accum_fp32=check_accum_dtype(accum_dtype, weight.dtype))
    else:
        logps = policy_logps(hidden, weight, labels, bias, ignore_index=ignore_index, temperature=temperature,
                             entropy=return_aux, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype)
        logp, entropy = logps.per_token, logps.entropy
        log_ratio = None
        if importance_sampling_level == "sequence":
            log_ratio = logp - (logp.detach() if old is None else old)
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        terms, _ = _grpo_token_loss(logp, extras, params, False, log_ratio=log_ratio)
        loss = terms.sum()
    if not return_aux:
        return loss
    logp = logp.detach()
    tokens = mask.sum().clamp(min=1.0)
    log_ratio = logp - (logp if old is None else old)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    ratio = ratio.expand_as(mask)
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(torch.float32)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(torch.float32)
    aux = {"logps": logp, "entropy": entropy.detach(),
           "clip_ratio_low": (low * mask).sum() / tokens, "clip_ratio_high": (high * mask).sum() / tokens,
           "clip_ratio_region": (torch.clamp(low + high, max=1.0) * mask).sum() / tokens}
    if beta != 0.0:
        diff = ref - logp
        aux["kl"] = ((torch.exp(diff) - diff - 1) * mask).sum() / tokens
    return loss, aux


def _token_weights(mask: Tensor, loss_type: str, max_completion_length, num_items_in_batch) -> Tensor:
    """``w`` with ``loss = sum(w * per_token)`` for each aggregation (0 where ignored)."""
    b, t = mask.shape
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * b)
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (b * (max_completion_length or t))
    if num_items_in_batch is None:
        return mask / mask.sum().clamp(min=1.0)
    if isinstance(num_items_in_batch, Tensor):
        return mask / num_items_in_batch.to(device=mask.device, dtype=torch.float32).clamp(min=1.0)
    check_number(num_items_in_batch, "num_items_in_batch", minimum=1.0)
    return mask / float(num_items_in_batch)


def _grpo_token_loss(logp: Tensor, extras, params, grads: bool, log_ratio: Tensor | None = None):
    """Per-token GRPO loss terms (the clipped objective and the KL term, times the token's weight
    ``w``) and, with ``grads``, their derivatives w.r.t. ``logp`` in closed form (token-level
    ratios). ``extras`` are ``(old_logps, advantages, ref_logps, w)`` per token (the first and
    third unread where ``params`` says they were not given); ``params`` ``[epsilon_low,
    epsilon_high, delta (-1: none), beta, old given]``;
    ``log_ratio`` (sequence level) replaces ``logp - old``. The derivative follows torch's
    autograd of the same ops: a clamp passes the gradient inside its bounds inclusive, and
    ``torch.minimum`` to the smaller term, half to each on a tie."""
    eps_low, eps_high, delta, beta, has_old = params
    old, adv, ref, weights = extras[0], extras[1], extras[2], extras[3]
    if log_ratio is None:
        log_ratio = logp - (old if has_old else logp.detach())
    raw = torch.exp(log_ratio)
    clipped = torch.clamp(raw, 1 - eps_low, 1 + eps_high)
    ratio = torch.clamp(raw, max=delta) if delta >= 0 else raw
    unclipped_term, clipped_term = ratio * adv, clipped * adv
    per_token = -torch.minimum(unclipped_term, clipped_term)
    if beta:
        diff = ref - logp
        per_token = per_token + beta * (torch.exp(diff) - diff - 1)
    if not grads:
        return weights * per_token, None
    d_ratio = raw if delta < 0 else torch.where(raw <= delta, raw, 0.0)
    d_clipped = torch.where((raw >= 1 - eps_low) & (raw <= 1 + eps_high), raw, 0.0)
    tie = torch.where(unclipped_term == clipped_term, 0.5, 0.0)
    share = torch.where(unclipped_term < clipped_term, 1.0, tie)
    derivative = -adv * (share * d_ratio + (1 - share) * d_clipped)
    if beta:
        derivative = derivative + beta * (1 - torch.exp(diff))
    return weights * per_token, weights * derivative


register_token_loss("grpo", _grpo_token_loss)
