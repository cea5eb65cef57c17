"""Fused linear CPO (Contrastive Preference Optimization) and its SimPO variant: a reference-free
preference loss plus the chosen sequences' NLL, from the policy's hidden states and LM head without
the ``(2B, T, V)`` logits.

Layout as :mod:`onca.ops.fused_linear_dpo` (``hidden (2B, T, H)``, chosen first; ``labels (2B, T)``
aligned, ``ignore_index`` for prompt and padding). As TRL 1.16's ``CPOTrainer`` (AlphaPO's reward
transform, ``alpha != 0``, is not supported): with ``pi`` each sequence's summed token
log-probability (its mean over the non-ignored tokens for ``ipo`` and ``simpo``) and
``x = pi_c - pi_r``::

    sigmoid  mean(-(1 - ls) logsigmoid(beta x) - ls logsigmoid(-beta x))
    hinge    mean(relu(1 - beta x))
    ipo      mean((x - 1 / (2 beta)) ** 2)
    simpo    as sigmoid with x - gamma / beta (SimPO's margin gamma)

plus ``nll_weight`` (TRL's ``cpo_alpha``, default 1) times the chosen sequences' mean token NLL.
With a gradient (bf16, fp32) the policy's head runs on chunks of whole pairs with the gradient in
the forward pass (:mod:`onca.ops._paired_head`); otherwise the per-token log-probabilities come from
the chunk driver (:mod:`onca.ops._chunked_head`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from onca.ops._chunked_head import plan
from onca.ops._paired_head import register_pair_loss
from onca.ops._posttrain import (
    check_beta,
    check_choice,
    check_common,
    check_paired,
    chosen_nll,
    policy_pair_logps,
    split_pairs,
)
from onca.ops._validate import check_number

__all__ = ["LOSS_TYPES", "cpo_loss", "cpo_loss_grads", "cpo_losses", "fused_linear_cpo", "plan"]

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def cpo_losses(loss_type: str, beta: float, gamma: float, label_smoothing: float, x: Tensor) -> Tensor:
    """Per-pair CPO losses ``(B,)`` of the margins ``x = pi_c - pi_r``, as TRL 1.16 computes them."""
    ls = label_smoothing
    if loss_type in ("sigmoid", "simpo"):
        z = beta * x - gamma if loss_type == "simpo" else beta * x
        if not ls:  # one small kernel fewer each way, for the common case
            return -F.logsigmoid(z)
        return -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
    if loss_type == "hinge":
        return torch.relu(1 - beta * x)
    return (x - 1 / (2 * beta)) ** 2


def cpo_loss_grads(loss_type: str, beta: float, gamma: float, label_smoothing: float,
                   x: Tensor) -> tuple[Tensor, Tensor]:
    """``(losses, dlosses/dx)`` per pair in closed form (the pair-aligned path runs inside a custom
    op, where autograd is off); ``tests/ops/test_fused_linear_cpo.py`` holds them to autograd."""
    losses = cpo_losses(loss_type, beta, gamma, label_smoothing, x)
    ls = label_smoothing
    if loss_type in ("sigmoid", "simpo"):
        z = beta * x - (gamma if loss_type == "simpo" else 0.0)
        return losses, beta * (-(1 - ls) * torch.sigmoid(-z) + ls * torch.sigmoid(z))
    if loss_type == "hinge":
        return losses, -beta * (beta * x < 1).to(x.dtype)
    return losses, 2 * (x - 1 / (2 * beta))


def _averaged(loss_type: str) -> bool:
    """Whether the loss type scores a sequence by its mean token log-probability (else its sum)."""
    return loss_type in ("ipo", "simpo")


def _pair_loss(sums_c, sums_r, counts, extras, loss_type, params, grads):
    """The per-pair CPO losses (and, with ``grads``, their derivatives w.r.t. the sequences' sums)
    for :mod:`onca.ops._paired_head`."""
    beta, gamma, label_smoothing = params
    if _averaged(loss_type):
        n_c, n_r = (c.clamp(min=1.0) for c in counts())
        x = sums_c / n_c - sums_r / n_r
    else:
        n_c, n_r, x = 1.0, 1.0, sums_c - sums_r
    if not grads:
        return cpo_losses(loss_type, beta, gamma, label_smoothing, x), None, None
    losses, dx = cpo_loss_grads(loss_type, beta, gamma, label_smoothing, x)
    return losses, dx / n_c, -dx / n_r


register_pair_loss("cpo", _pair_loss)


def cpo_loss(hidden, weight, labels, bias, *, beta, loss_type, gamma, label_smoothing, nll_weight, ignore_index,
             chunk_tokens, return_aux, accum_dtype=None):
    """The shared body of CPO and SimPO (inputs already checked)."""
    loss, logps = policy_pair_logps(hidden, weight, labels, bias, [], loss="cpo", loss_type=loss_type,
                                    params=[beta, gamma, label_smoothing], nll_weight=nll_weight,
                                    ignore_index=ignore_index, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype)
    if not return_aux:
        return loss
    pi_c, pi_r = split_pairs(logps.means if _averaged(loss_type) else logps.sums)
    nll = chosen_nll(logps)
    chosen_rewards, rejected_rewards = beta * pi_c.detach(), beta * pi_r.detach()
    return loss, {
        "chosen_logps": pi_c.detach(), "rejected_logps": pi_r.detach(),
        "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
        "reward_accuracies": (chosen_rewards > rejected_rewards).to(torch.float32),
        "reward_margins": chosen_rewards - rejected_rewards,
        "nll_loss": nll.detach(),
    }


def check_label_smoothing(label_smoothing) -> None:
    check_number(label_smoothing, "label_smoothing", minimum=0.0)
    if label_smoothing > 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing!r}")


def fused_linear_cpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    simpo_gamma: float = 0.5,
    label_smoothing: float = 0.0,
    nll_weight: float = 1.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """CPO loss (TRL's ``CPOTrainer``: ``sigmoid``, ``hinge``, ``ipo``, ``simpo`` with margin
    ``simpo_gamma``) of the policy ``hidden (2B, T, H)`` / ``weight (V, H)`` (+ ``bias``), plus
    ``nll_weight`` (``cpo_alpha``) times the chosen mean token NLL, without the logits (see the
    module docstring). Returns the fp32 scalar loss; ``return_aux=True`` returns ``(loss, aux)``
    with the detached per-pair ``chosen_logps``, ``rejected_logps`` (means for ``ipo``/``simpo``),
    ``chosen_rewards``, ``rejected_rewards`` (``beta * logps``), ``reward_accuracies``,
    ``reward_margins`` and the scalar ``nll_loss``.
    ``accum_dtype``: the weight gradient's accumulator over the chunks (None: the weight's dtype,
    one rounding per chunk, as liger-kernel; ``torch.float32``: fp32, a head-sized buffer more)."""
    hidden, weight, bias = check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux,
                                        accum_dtype=accum_dtype)
    check_paired(hidden, labels)
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_beta(beta)
    check_number(simpo_gamma, "simpo_gamma")
    check_label_smoothing(label_smoothing)
    check_number(nll_weight, "nll_weight", minimum=0.0)
    return cpo_loss(hidden, weight, labels, bias, beta=float(beta), loss_type=loss_type, gamma=float(simpo_gamma),
                    label_smoothing=float(label_smoothing), nll_weight=float(nll_weight), ignore_index=ignore_index,
                    chunk_tokens=chunk_tokens, return_aux=return_aux, accum_dtype=accum_dtype)
