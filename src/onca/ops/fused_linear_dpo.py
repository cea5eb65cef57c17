"""Fused linear DPO: Direct Preference Optimization's loss from the policy's (and the reference
model's) last hidden states and LM heads, without either model's ``(2B, T, V)`` logits.

Layout (TRL's concatenated batch): ``hidden (2B, T, H)`` holds the B chosen sequences first and the
B rejected ones after; ``labels (2B, T)`` is aligned with it (position ``t`` is scored against
``labels[:, t]``: shift before calling), ``ignore_index`` marks prompt and padding. A sequence's
log-probability is the sum over its non-ignored tokens of ``log_softmax(hidden @ weight.T +
bias)[label]``. When a gradient is wanted (bf16 or fp32 inputs), the policy's head runs on chunks
of whole chosen/rejected pairs with the gradient computed in the forward pass
(:mod:`onca.ops._paired_head`: three head matmuls per chunk); otherwise (fp16, no gradient, a
``chunk_tokens`` override, pairs too long for one scratch) its per-token log-probabilities come from
the chunk driver (:mod:`onca.ops._chunked_head`: the logits exist one chunk of tokens at a time and
are recomputed in backward). ``dWeight`` accumulates in the weight's dtype (``accum_dtype``). The
reference model's come
from ``ref_hidden``/``ref_weight`` under ``torch.no_grad`` (one head matmul per chunk), or are
passed in precomputed (``ref_chosen_logps``/``ref_rejected_logps``). The loss is TRL 1.16's
``DPOTrainer`` formula for the loss type, on fp32 per-sequence tensors::

    d = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    sigmoid     mean(-logsigmoid(d))
    hinge       mean(relu(1 - d))
    ipo         mean(((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta)) ** 2)
    robust      mean((-(1 - ls) logsigmoid(d) + ls logsigmoid(-d)) / (1 - 2 ls))
    exo_pair    mean(sigmoid(d) (logsigmoid(d) - log(1 - ls)) + sigmoid(-d) (logsigmoid(-d) - log ls))
    nca_pair    mean(-logsigmoid(beta lr_c) - logsigmoid(-beta lr_c) / 2 - logsigmoid(-beta lr_r) / 2)
    bco_pair    mean(-logsigmoid(beta lr_c) - logsigmoid(-beta lr_r))
    sppo_hard   mean((lr_c - 1 / (2 beta)) ** 2 + (lr_r + 1 / (2 beta)) ** 2)
    apo_zero    mean(1 - sigmoid(beta lr_c) + sigmoid(beta lr_r))
    apo_down    mean(sigmoid(beta lr_c) + 1 - sigmoid(d))
    sigmoid_norm  mean(-logsigmoid(beta (lr_c / n_c - lr_r / n_r)))

with ``lr = pi - ref``, ``n`` a sequence's count of non-ignored labels (at least 1) and ``ls =
label_smoothing``; plus ``nll_weight`` times the chosen sequences' mean token NLL (TRL's ``"sft"``
loss, RPO's ``alpha``).
"""

from __future__ import annotations

import math

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
    check_per_sequence,
    chosen_nll,
    policy_pair_logps,
    reference_logps,
    split_pairs,
)
from onca.ops._validate import check_number

__all__ = ["LOSS_TYPES", "dpo_loss_grads", "dpo_losses", "fused_linear_dpo", "plan"]

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
              "apo_down", "sigmoid_norm")


def dpo_losses(loss_type: str, beta: float, label_smoothing: float, chosen_lr: Tensor, rejected_lr: Tensor,
               chosen_n: Tensor, rejected_n: Tensor) -> Tensor:
    """Per-pair DPO losses ``(B,)`` from the chosen and rejected log-ratios ``pi - ref`` and the
    sequences' token counts (clamped to at least 1), as TRL 1.16 computes them."""
    delta = chosen_lr - rejected_lr
    d = beta * delta
    ls = label_smoothing
    if loss_type == "sigmoid":
        return -F.logsigmoid(d)
    if loss_type == "hinge":
        return torch.relu(1 - d)
    if loss_type == "ipo":
        return (chosen_lr / chosen_n - rejected_lr / rejected_n - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - ls) * F.logsigmoid(d) + ls * F.logsigmoid(-d)) / (1 - 2 * ls)
    if loss_type == "exo_pair":
        return (torch.sigmoid(d) * (F.logsigmoid(d) - math.log1p(-ls))
                + torch.sigmoid(-d) * (F.logsigmoid(-d) - math.log(ls)))
    if loss_type == "nca_pair":
        cr, rr = beta * chosen_lr, beta * rejected_lr
        return -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
    if loss_type == "sppo_hard":
        return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(d)
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (chosen_lr / chosen_n - rejected_lr / rejected_n))
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def dpo_loss_grads(loss_type: str, beta: float, label_smoothing: float, chosen_lr: Tensor, rejected_lr: Tensor,
                   chosen_n: Tensor, rejected_n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(losses, dlosses/dchosen_lr, dlosses/drejected_lr)`` per pair, in closed form: the
    pair-aligned path needs them inside a custom op, where autograd (and ``torch.func`` under a
    dispatch mode) is not available. ``tests/ops/test_fused_linear_dpo.py`` holds them to autograd
    of :func:`dpo_losses` for every loss type."""
    losses = dpo_losses(loss_type, beta, label_smoothing, chosen_lr, rejected_lr, chosen_n, rejected_n)
    sig = torch.sigmoid
    d = beta * (chosen_lr - rejected_lr)
    ls = label_smoothing
    if loss_type in ("sigmoid", "hinge", "robust", "exo_pair"):
        if loss_type == "sigmoid":
            dd = -sig(-d)
        elif loss_type == "hinge":
            dd = -(d < 1).to(d.dtype)
        elif loss_type == "robust":
            dd = (-(1 - ls) * sig(-d) - ls * sig(d)) / (1 - 2 * ls)
        else:
            dd = sig(d) * sig(-d) * ((F.logsigmoid(d) - math.log1p(-ls)) - (F.logsigmoid(-d) - math.log(ls)))
        return losses, beta * dd, -beta * dd
    if loss_type == "ipo":
        u = 2 * (chosen_lr / chosen_n - rejected_lr / rejected_n - 1 / (2 * beta))
        return losses, u / chosen_n, -u / rejected_n
    if loss_type == "sigmoid_norm":
        de = -sig(-beta * (chosen_lr / chosen_n - rejected_lr / rejected_n))
        return losses, beta * de / chosen_n, -beta * de / rejected_n
    if loss_type == "sppo_hard":
        return losses, 2 * (chosen_lr - 0.5 / beta), 2 * (rejected_lr + 0.5 / beta)
    cr, rr = beta * chosen_lr, beta * rejected_lr
    if loss_type == "nca_pair":
        return losses, beta * (0.5 * sig(cr) - sig(-cr)), beta * 0.5 * sig(rr)
    if loss_type == "bco_pair":
        return losses, -beta * sig(-cr), beta * sig(rr)
    if loss_type == "apo_zero":
        return losses, -beta * sig(cr) * sig(-cr), beta * sig(rr) * sig(-rr)
    if loss_type == "apo_down":
        dd = beta * sig(d) * sig(-d)
        return losses, beta * sig(cr) * sig(-cr) - dd, dd
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


# The loss types that divide by a sequence's token count.
_BY_LENGTH = ("ipo", "sigmoid_norm")


def _pair_loss(sums_c, sums_r, counts, extras, loss_type, params, grads):
    """The per-pair DPO losses (and, with ``grads``, their derivatives w.r.t. the sequences' sums)
    for :mod:`onca.ops._paired_head`."""
    ref_c, ref_r = extras
    beta, label_smoothing = params
    n_c, n_r = (c.clamp(min=1.0) for c in counts()) if loss_type in _BY_LENGTH else (1.0, 1.0)
    args = (loss_type, beta, label_smoothing, sums_c - ref_c, sums_r - ref_r, n_c, n_r)
    return dpo_loss_grads(*args) if grads else (dpo_losses(*args), None, None)


register_pair_loss("dpo", _pair_loss)


def _check_label_smoothing(loss_type, label_smoothing) -> None:
    check_number(label_smoothing, "label_smoothing", minimum=0.0)
    if label_smoothing >= 0.5 and loss_type == "robust":
        raise ValueError(f"label_smoothing must be in [0, 0.5) for loss_type='robust', got {label_smoothing!r}")
    if loss_type == "exo_pair" and not 0.0 < label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in (0, 1) for loss_type='exo_pair', got {label_smoothing!r}")
    if label_smoothing > 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")


def fused_linear_dpo(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    ref_bias: Tensor | None = None,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    nll_weight: float = 0.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """DPO loss of the policy ``hidden (2B, T, H)`` / ``weight (V, H)`` (+ ``bias``) against a
    reference model, without the logits (see the module docstring for the layout and the loss
    types). The reference log-probabilities come from ``ref_hidden (2B, T, H')`` / ``ref_weight
    (V, H')`` (+ ``ref_bias``), computed without gradient, or from ``ref_chosen_logps`` /
    ``ref_rejected_logps`` ``(B,)`` (precomputed sums; give one source, not both). ``nll_weight``
    adds that multiple of the chosen sequences' mean token NLL. Returns the fp32 scalar loss;
    ``return_aux=True`` returns ``(loss, aux)`` with the detached per-pair ``chosen_logps``,
    ``rejected_logps``, ``ref_chosen_logps``, ``ref_rejected_logps``, ``chosen_rewards``,
    ``rejected_rewards`` (``beta * (pi - ref)``), ``reward_accuracies``, ``reward_margins`` and the
    scalar ``nll_loss``: what TRL logs. ``chunk_tokens`` overrides the planned tokens per chunk.
    Under ``torch.autocast`` the heads' inputs are cast to the autocast dtype first.
    ``accum_dtype``: the weight gradient's accumulator over the chunks (None: the weight's dtype,
    one rounding per chunk, as liger-kernel; ``torch.float32``: fp32, a head-sized buffer more)."""
    hidden, weight, bias = check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux,
                                        accum_dtype=accum_dtype)
    b = check_paired(hidden, labels)
    check_choice(loss_type, "loss_type", LOSS_TYPES)
    check_beta(beta)
    _check_label_smoothing(loss_type, label_smoothing)
    check_number(nll_weight, "nll_weight", minimum=0.0)
    precomputed = ref_chosen_logps is not None or ref_rejected_logps is not None
    if precomputed and (ref_hidden is not None or ref_weight is not None):
        raise ValueError("give the reference either as ref_hidden/ref_weight or as ref_chosen_logps/"
                         "ref_rejected_logps, not both")
    if precomputed:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError("ref_chosen_logps and ref_rejected_logps must be given together")
        ref_c = check_per_sequence(ref_chosen_logps, "ref_chosen_logps", b, hidden).detach()
        ref_r = check_per_sequence(ref_rejected_logps, "ref_rejected_logps", b, hidden).detach()
    else:
        if ref_hidden is None or ref_weight is None:
            raise ValueError("fused_linear_dpo needs the reference model: ref_hidden and ref_weight, or "
                             "ref_chosen_logps and ref_rejected_logps")
        if tuple(ref_hidden.shape[:-1]) != tuple(hidden.shape[:-1]):
            raise ValueError(f"ref_hidden must have hidden's sequences and tokens {tuple(hidden.shape[:-1])}, "
                             f"got shape {tuple(ref_hidden.shape)}")
        ref = reference_logps(ref_hidden, ref_weight, labels, ref_bias, ignore_index=ignore_index,
                              chunk_tokens=chunk_tokens)
        ref_c, ref_r = split_pairs(ref.sums)

    loss, logps = policy_pair_logps(hidden, weight, labels, bias, [ref_c, ref_r], loss="dpo", loss_type=loss_type,
                                    params=[beta, label_smoothing], nll_weight=nll_weight, ignore_index=ignore_index,
                                    chunk_tokens=chunk_tokens, accum_dtype=accum_dtype)
    if not return_aux:
        return loss
    pi_c, pi_r = split_pairs(logps.sums)
    chosen_lr, rejected_lr = pi_c - ref_c, pi_r - ref_r
    chosen_rewards, rejected_rewards = beta * chosen_lr.detach(), beta * rejected_lr.detach()
    aux = {
        "chosen_logps": pi_c.detach(), "rejected_logps": pi_r.detach(),
        "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r,
        "chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards,
        "reward_accuracies": (chosen_rewards > rejected_rewards).to(torch.float32),
        "reward_margins": chosen_rewards - rejected_rewards,
        "nll_loss": chosen_nll(logps).detach(),
    }
    return loss, aux
