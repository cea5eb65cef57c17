"""Fused linear ORPO (Odds Ratio Preference Optimization): the chosen sequences' NLL plus an odds
ratio term, from the policy's hidden states and LM head without the ``(2B, T, V)`` logits.

Layout as :mod:`onca.ops.fused_linear_dpo`. As TRL 1.16's ``ORPOTrainer``: with ``avg`` each
sequence's mean token log-probability over its non-ignored labels::

    log_odds = (avg_c - avg_r) - (log(1 - exp(avg_c)) - log(1 - exp(avg_r)))
    loss     = nll_weight * NLL(chosen) - beta * mean(logsigmoid(log_odds))

``NLL(chosen)`` is the chosen sequences' mean token NLL over their non-ignored labels (TRL scores
the labels it is given: mask the prompt with ``ignore_index`` or not, as its ``labels`` do);
``nll_weight`` is 1 in ORPO. A pair with a sequence whose every label is ignored has no odds (its
mean log-probability is undefined): its odds-ratio term is 0 (TRL gives NaN). With a gradient
(bf16, fp32) the policy's head runs on chunks of whole pairs with the gradient in the forward pass
(:mod:`onca.ops._paired_head`); otherwise the per-token log-probabilities come from the chunk driver
(:mod:`onca.ops._chunked_head`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from onca.ops._chunked_head import plan
from onca.ops._paired_head import register_pair_loss
from onca.ops._posttrain import check_beta, check_common, check_paired, chosen_nll, policy_pair_logps, split_pairs
from onca.ops._validate import check_number

__all__ = ["fused_linear_orpo", "log1mexp", "odds_ratio_grads", "odds_ratios", "plan"]


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-log 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratios(avg_c: Tensor, avg_r: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """``(log_odds, logsigmoid(log_odds))`` per pair of mean log-probabilities; both 0 where a pair
    is not ``present`` (a sequence without labels)."""
    # Where a sequence is empty its mean is no log-probability: give log1mexp a safe input, drop the term.
    safe_c, safe_r = torch.where(present, avg_c, -1.0), torch.where(present, avg_r, -1.0)
    log_odds = (safe_c - safe_r) - (log1mexp(safe_c) - log1mexp(safe_r))
    return torch.where(present, log_odds, 0.0), torch.where(present, F.logsigmoid(log_odds), 0.0)


def odds_ratio_grads(avg_c: Tensor, avg_r: Tensor, present: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(logsigmoid(log_odds), d/davg_c, d/davg_r)`` per pair in closed form (the pair-aligned
    path runs inside a custom op, where autograd is off): ``dlog_odds/davg_c = 1 / (1 - exp(avg_c))``,
    ``dlog_odds/davg_r = -1 / (1 - exp(avg_r))``; 0 where the pair is not ``present``."""
    log_odds, ratio = odds_ratios(avg_c, avg_r, present)
    outer = torch.where(present, torch.sigmoid(-log_odds), 0.0)
    safe_c, safe_r = torch.where(present, avg_c, -1.0), torch.where(present, avg_r, -1.0)
    return ratio, outer / -torch.expm1(safe_c), -outer / -torch.expm1(safe_r)


def _pair_loss(sums_c, sums_r, counts, extras, loss_type, params, grads):
    """The per-pair odds-ratio losses ``-beta logsigmoid(log_odds)`` (and, with ``grads``, their
    derivatives w.r.t. the sequences' sums) for :mod:`onca.ops._paired_head`; the NLL term is the
    path's ``nll_weight``."""
    (beta,) = params
    counts_c, counts_r = counts()
    n_c, n_r = counts_c.clamp(min=1.0), counts_r.clamp(min=1.0)
    present = (counts_c > 0) & (counts_r > 0)
    if not grads:
        return -beta * odds_ratios(sums_c / n_c, sums_r / n_r, present)[1], None, None
    ratio, d_c, d_r = odds_ratio_grads(sums_c / n_c, sums_r / n_r, present)
    return -beta * ratio, -beta * d_c / n_c, -beta * d_r / n_r


# Its NaN-safe odds formula is some 40 small ops each way under autograd: at 16 tokens torch's route
# took 2.00 ms against the pair-aligned op's 1.78 (H100) and 2.38 against 1.73-2.02 (H200).
register_pair_loss("orpo", _pair_loss, aligned_when_small=True)


def fused_linear_orpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    beta: float = 0.1,
    nll_weight: float = 1.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """ORPO loss ``nll_weight * NLL(chosen) - beta * mean(logsigmoid(log_odds))`` of the policy
    ``hidden (2B, T, H)`` / ``weight (V, H)`` (+ ``bias``), without the logits (see the module
    docstring). Returns the fp32 scalar loss; ``return_aux=True`` returns ``(loss, aux)`` with the
    detached per-pair mean ``chosen_logps``/``rejected_logps``, ``chosen_rewards``/
    ``rejected_rewards`` (``beta * avg``), ``reward_accuracies``, ``reward_margins``, the scalar
    ``nll_loss``, ``log_odds_ratio`` (``mean(logsigmoid(log_odds))``) and ``log_odds_chosen``
    (``mean(log_odds)``), as TRL logs them.
    ``accum_dtype``: the weight gradient's accumulator over the chunks (None: the weight's dtype,
    one rounding per chunk, as liger-kernel; ``torch.float32``: fp32, a head-sized buffer more)."""
    hidden, weight, bias = check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux,
                                        accum_dtype=accum_dtype)
    check_paired(hidden, labels)
    check_beta(beta)
    check_number(nll_weight, "nll_weight", minimum=0.0)
    loss, logps = policy_pair_logps(hidden, weight, labels, bias, [], loss="orpo", loss_type="", params=[beta],
                                    nll_weight=nll_weight, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                                    accum_dtype=accum_dtype)
    if not return_aux:
        return loss
    avg_c, avg_r = split_pairs(logps.means)
    n_c, n_r = split_pairs(logps.counts)
    log_odds, ratio = odds_ratios(avg_c, avg_r, (n_c > 0) & (n_r > 0))
    nll = chosen_nll(logps)
    chosen_rewards, rejected_rewards = beta * avg_c.detach(), beta * avg_r.detach()
    return loss, {
        "chosen_logps": avg_c.detach(), "rejected_logps": avg_r.detach(),
        "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
        "reward_accuracies": (chosen_rewards > rejected_rewards).to(torch.float32),
        "reward_margins": chosen_rewards - rejected_rewards,
        "nll_loss": nll.detach(), "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    }
