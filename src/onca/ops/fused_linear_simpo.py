"""Fused linear SimPO (Simple Preference Optimization): a reference-free, length-normalised
preference loss from the policy's hidden states and LM head, without the ``(2B, T, V)`` logits.

Layout as :mod:`onca.ops.fused_linear_dpo`. With ``avg`` each sequence's mean log-probability over
its non-ignored tokens (0 for a sequence with none)::

    loss = mean(-(1 - ls) logsigmoid(beta (avg_c - avg_r) - gamma)
                - ls logsigmoid(-(beta (avg_c - avg_r) - gamma)))  +  nll_weight * NLL(chosen)

which is TRL 1.16's ``CPOTrainer`` with ``loss_type="simpo"`` (``simpo_gamma = gamma``, ``cpo_alpha
= nll_weight``); the paper's loss is ``label_smoothing = nll_weight = 0``. It runs as CPO's
``simpo`` loss type (:func:`onca.ops.fused_linear_cpo.cpo_loss`): on pair-aligned chunks with the
gradient in the forward pass where a gradient is wanted, else on the chunk driver.
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops._chunked_head import plan
from onca.ops._posttrain import check_beta, check_common, check_paired
from onca.ops._validate import check_number
from onca.ops.fused_linear_cpo import check_label_smoothing, cpo_loss

__all__ = ["fused_linear_simpo", "plan"]


def fused_linear_simpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    nll_weight: float = 0.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """SimPO loss ``mean(-logsigmoid(beta * (avg_c - avg_r) - gamma))`` (+ label smoothing and
    ``nll_weight`` times the chosen mean token NLL) of the policy ``hidden (2B, T, H)`` / ``weight
    (V, H)`` (+ ``bias``), no reference model, without the logits (see the module docstring).
    Returns the fp32 scalar loss; ``return_aux=True`` returns ``(loss, aux)`` with the detached
    per-pair mean ``chosen_logps``/``rejected_logps``, ``chosen_rewards``/``rejected_rewards``
    (``beta * avg``), ``reward_accuracies``, ``reward_margins`` and the scalar ``nll_loss``.
    ``accum_dtype``: the weight gradient's accumulator over the chunks (None: the weight's dtype,
    one rounding per chunk, as liger-kernel; ``torch.float32``: fp32, a head-sized buffer more)."""
    hidden, weight, bias = check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux,
                                        accum_dtype=accum_dtype)
    check_paired(hidden, labels)
    check_beta(beta)
    check_number(gamma, "gamma")
    check_label_smoothing(label_smoothing)
    check_number(nll_weight, "nll_weight", minimum=0.0)
    return cpo_loss(hidden, weight, labels, bias, beta=float(beta), loss_type="simpo", gamma=float(gamma),
                    label_smoothing=float(label_smoothing), nll_weight=float(nll_weight), ignore_index=ignore_index,
                    chunk_tokens=chunk_tokens, return_aux=return_aux, accum_dtype=accum_dtype)
