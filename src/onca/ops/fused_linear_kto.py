"""Fused linear KTO (Kahneman-Tversky Optimization): an unpaired preference loss from the policy's
(and the reference model's) hidden states and LM heads, without the ``(B, T, V)`` logits.

Each of the ``B`` sequences in ``hidden (B, T, H)`` / ``labels (B, T)`` (aligned; ``ignore_index``
for prompt and padding) carries a ``desirable (B,)`` flag. As TRL 1.16's ``KTOTrainer``: with
``lr = pi - ref`` each sequence's summed log-ratio against the reference and ``kl`` the batch's
KL estimate (detached, clamped at 0)::

    kto                desirable: 1 - sigmoid(beta (lr - kl))   undesirable: 1 - sigmoid(beta (kl - lr))
    apo_zero_unpaired  desirable: 1 - sigmoid(beta lr)          undesirable: sigmoid(beta lr)
    loss = mean over the batch of (desirable_weight or undesirable_weight) * that

The KL estimate is TRL's ``mean(KL_logps - ref_KL_logps)`` over the batch's mismatched
(prompt, completion) pairs: pass it as ``kl`` (a number or 0-d tensor), or pass the mismatched
pairs' hidden states (``kl_hidden`` for the policy, ``ref_kl_hidden`` for the reference, both
scored against ``kl_labels``) and it is computed here without gradient; with neither it is 0
(TRL without ``calculate_KL``). Sequences are selected by ``torch.where`` on the flag, never
gathered: no data-dependent shapes.

A sequence's loss depends on its tokens only through their summed log-probability, so on chunks of
whole sequences each token's ``dLoss/dlogp`` (its sequence's derivative, in closed form below) is
known inside the chunk: the loss then computes its gradient in the forward pass
(:mod:`onca.ops._token_head`: three head matmuls per chunk). fp16 inputs, calls without a gradient,
sequences too long for one chunk and small calls take the chunk driver's per-token
log-probabilities (:mod:`onca.ops._chunked_head`: four), the same losses differentiated by
autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops._chunked_head import plan, small_head
from onca.ops._posttrain import (
    check_beta,
    check_choice,
    check_common,
    check_per_sequence,
    policy_logps,
    reference_logps,
)
from onca.ops._token_head import register_token_loss, token_loss, use_token_chunks
from onca.ops._validate import check_accum_dtype, check_number, check_tensor

__all__ = ["LOSS_TYPES", "fused_linear_kto", "plan"]

LOSS_TYPES = ("kto", "apo_zero_unpaired")


def _kl_estimate(kl, kl_hidden, ref_kl_hidden, kl_labels, weight, bias, ref_weight, ref_bias, ignore_index,
                 chunk_tokens, like: Tensor) -> Tensor | float:
    """The batch's KL estimate, clamped at 0: a detached fp32 scalar tensor, or a float where ``kl``
    is a number (the loss then subtracts it as a scalar: no device tensor to make)."""
    if kl is not None:
        if kl_hidden is not None or ref_kl_hidden is not None:
            raise ValueError("give the KL estimate either as kl or as kl_hidden/ref_kl_hidden/kl_labels, not both")
        if isinstance(kl, Tensor):
            if kl.numel() != 1:
                raise ValueError(f"kl must be a number or a one-element tensor, got shape {tuple(kl.shape)}")
            return kl.detach().reshape(()).to(device=like.device, dtype=torch.float32).clamp(min=0)
        check_number(kl, "kl")
        return max(float(kl), 0.0)
    if kl_hidden is None and ref_kl_hidden is None:
        return torch.zeros((), dtype=torch.float32, device=like.device)
    if kl_hidden is None or ref_kl_hidden is None or kl_labels is None:
        raise ValueError("the KL estimate needs kl_hidden, ref_kl_hidden and kl_labels together")
    policy = reference_logps(kl_hidden, weight, kl_labels, bias, ignore_index=ignore_index,
                             chunk_tokens=chunk_tokens, names=("kl_hidden", "weight", "bias"))
    ref = reference_logps(ref_kl_hidden, ref_weight, kl_labels, ref_bias, ignore_index=ignore_index,
                          chunk_tokens=chunk_tokens, names=("ref_kl_hidden", "ref_weight", "ref_bias"))
    return (policy.sums - ref.sums).mean().clamp(min=0)


def fused_linear_kto(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    desirable: Tensor,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    ref_bias: Tensor | None = None,
    ref_logps: Tensor | None = None,
    kl: float | Tensor | None = None,
    kl_hidden: Tensor | None = None,
    ref_kl_hidden: Tensor | None = None,
    kl_labels: Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """KTO loss of the policy ``hidden (B, T, H)`` / ``weight (V, H)`` (+ ``bias``) with one
    ``desirable (B,)`` bool flag per sequence, against a reference given as ``ref_hidden``/
    ``ref_weight`` (+ ``ref_bias``; no gradient) or as precomputed summed ``ref_logps (B,)``;
    the KL estimate as ``kl`` or from ``kl_hidden``/``ref_kl_hidden``/``kl_labels`` (see the
    module docstring), without the logits. Returns the fp32 scalar loss; ``return_aux=True``
    returns ``(loss, aux)`` with the detached per-sequence ``logps``, ``ref_logps``, ``rewards``
    (``beta * (pi - ref)``), the ``desirable`` flags and the ``kl`` used.
    ``accum_dtype``: the weight gradient's accumulator over the chunks (None: the weight's dtype,
    one rounding per chunk, as liger-kernel; ``torch.float32``: fp32, a head-sized buffer more)."""
    hidden, weight, bias = check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux,
                                        accum_dtype=accum_dtype)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (batch, tokens, hidden), got shape {tuple(hidden.shape)}")
    n = hidden.shape[0]
    check_tensor(desirable, "desirable")
    if desirable.dtype != torch.bool:
        raise TypeError(f"desirable must be a bool tensor (one flag per sequence), got {desirable.dtype}")
    desirable = check_per_sequence(desirable, "desirable", n, hidden, floating=False)
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_beta(beta)
    check_number(desirable_weight, "desirable_weight", minimum=0.0)
    check_number(undesirable_weight, "undesirable_weight", minimum=0.0)
    if ref_logps is not None:
        if ref_hidden is not None or ref_weight is not None:
            raise ValueError("give the reference either as ref_hidden/ref_weight or as ref_logps, not both")
        ref_sums = check_per_sequence(ref_logps, "ref_logps", n, hidden).detach()
    else:
        if ref_hidden is None or ref_weight is None:
            raise ValueError("fused_linear_kto needs the reference model: ref_hidden and ref_weight, or ref_logps")
        if tuple(ref_hidden.shape[:-1]) != tuple(hidden.shape[:-1]):
            raise ValueError(f"ref_hidden must have hidden's sequences and tokens {tuple(hidden.shape[:-1])}, "
                             f"got shape {tuple(ref_hidden.shape)}")
        ref_sums = reference_logps(ref_hidden, ref_weight, labels, ref_bias, ignore_index=ignore_index,
                                   chunk_tokens=chunk_tokens).sums
    kl_value = _kl_estimate(kl, kl_hidden, ref_kl_hidden, kl_labels, weight, bias, ref_weight, ref_bias,
                            ignore_index, chunk_tokens, hidden)
    params = [beta, desirable_weight, undesirable_weight, n, float(loss_type == "apo_zero_unpaired")]
    chunked = use_token_chunks(hidden, weight, bias, labels.shape[1])
    if chunked and not small_head(hidden, weight, labels, count=False):
        t = labels.shape[1]
        kl_tokens = (kl_value.expand(n, t) if isinstance(kl_value, Tensor)
                     else torch.full((n, t), kl_value, dtype=torch.float32, device=hidden.device))
        extras = (ref_sums[:, None].expand(n, t), desirable[:, None].expand(n, t), kl_tokens)
        loss, per_token, _ = token_loss(hidden, weight, bias, labels, extras, loss="kto", params=params,
                                        ignore_index=ignore_index, sequences=True, chunk_tokens=chunk_tokens,
                                        accum_fp32=check_accum_dtype(accum_dtype, weight.dtype))
        sums = per_token.sum(-1)
    else:
        sums = policy_logps(hidden, weight, labels, bias, ignore_index=ignore_index,
                            chunk_tokens=chunk_tokens, accum_dtype=accum_dtype).sums
        loss = _kto_losses(sums - ref_sums, desirable, kl_value, params)[0].sum()
    if not return_aux:
        return loss
    if not isinstance(kl_value, Tensor):
        kl_value = torch.full((), kl_value, dtype=torch.float32, device=hidden.device)
    return loss, {"logps": sums.detach(), "ref_logps": ref_sums, "rewards": beta * (sums.detach() - ref_sums),
                  "desirable": desirable, "kl": kl_value}


def _kto_losses(lr: Tensor, desirable: Tensor, kl_value, params, grads: bool = False):
    """Each sequence's weighted share of the loss (its loss times its class weight over the batch
    size) from its summed log-ratio ``lr``, and with ``grads`` the share's derivative w.r.t. ``lr``
    in closed form: ``d(1 - sigmoid(x))/dx = d(sigmoid(-x))/dx = -s (1 - s)`` with ``s =
    sigmoid(x)``."""
    beta, desirable_weight, undesirable_weight, n, apo = params
    # A KL given as 0 subtracts nothing (each small op is a host cost of its own at small sizes).
    x = beta * (lr if apo or not (isinstance(kl_value, Tensor) or kl_value) else lr - kl_value)
    s = torch.sigmoid(x)
    # kto: desirable 1 - sigmoid(x), undesirable 1 - sigmoid(-x) = sigmoid(x); apo_zero_unpaired the
    # same two expressions.
    losses = torch.where(desirable, 1 - s, s)
    if desirable_weight != 1.0 or undesirable_weight != 1.0 or grads:
        scale = torch.where(desirable, float(desirable_weight), float(undesirable_weight)) / n
    else:
        scale = 1.0 / n
    if not grads:
        return scale * losses, None
    derivative = beta * s * (1 - s) * torch.where(desirable, -1.0, 1.0)
    return scale * losses, scale * derivative


def _kto_sequence_loss(logp: Tensor, extras, params, grads: bool):
    """The token chunks' function (:mod:`onca.ops._token_head`): ``logp`` ``(sequences, T)``,
    ``extras`` the reference's sums, the flags and the KL estimate, each repeated over the tokens."""
    ref, desirable, kl = extras[0][:, 0], extras[1][:, 0] > 0.5, extras[2][:, 0]
    shares, derivative = _kto_losses(logp.sum(-1) - ref, desirable, kl, params, grads)
    return shares, (derivative[:, None].expand_as(logp) if grads else None)


register_token_loss("kto", _kto_sequence_loss)
