"""Sequence-level helpers shared by the post-training losses (DPO, SimPO, ORPO, CPO, KTO, GRPO).

Everything here is plain torch on per-token ``(sequences, T)`` and per-sequence ``(sequences,)``
fp32 tensors: the heavy part (the LM head and its gradient) is the chunk driver's
(:mod:`onca.ops._chunked_head`). No host synchronisation: counts stay on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from onca.ops._chunked_head import check_options, checked_logprobs, head_inputs, small_head, validate_head
from onca.ops._paired_head import ALIGNED_WHEN_SMALL, PAIR_LOSSES, paired_loss, use_paired_chunks
from onca.ops._validate import (autocast_enabled, check_accum_dtype, check_bool, check_float, check_number,
                                check_tensor)

__all__ = [
    "SequenceLogps",
    "SequenceSums",
    "check_beta",
    "check_choice",
    "check_paired",
    "check_per_sequence",
    "chosen_nll",
    "policy_logps",
    "policy_pair_logps",
    "reference_logps",
    "split_pairs",
]


class SequenceSums:
    """Per-sequence log-probability sums of ``(sequences, T)`` labels, with the sequences' token
    counts and means (the mean is 0 for a sequence with every token ignored), each made when first
    read: a loss that reads only the sums launches nothing more (at small sizes each small torch
    op is a host cost of its own)."""

    def __init__(self, sums: Tensor, labels: Tensor, ignore_index: int):
        self.sums = sums
        self._labels, self._ignore_index = labels, ignore_index
        self._mask = self._counts = self._means = None  # made when first read (no cached_property:
        # Python 3.11's takes a lock, which torch.compile cannot trace)

    @property
    def mask(self) -> Tensor:
        if self._mask is None:
            self._mask = self._labels != self._ignore_index
        return self._mask

    @property
    def counts(self) -> Tensor:
        if self._counts is None:
            self._counts = self.mask.sum(-1, dtype=torch.float32)  # one kernel: no cast after the sum
        return self._counts

    @property
    def means(self) -> Tensor:
        if self._means is None:
            self._means = self.sums / self.counts.clamp(min=1.0)
        return self._means


class SequenceLogps(SequenceSums):
    """Per-token log-probabilities of ``(sequences, T)`` labels (and entropies) and their
    per-sequence sums, token counts and means."""

    def __init__(self, per_token: Tensor, labels: Tensor, ignore_index: int, entropy: Tensor | None = None):
        super().__init__(per_token.sum(-1), labels, ignore_index)
        self.per_token = per_token
        self.entropy = entropy


def check_paired(hidden: Tensor, labels: Tensor, name: str = "hidden") -> int:
    """``hidden`` is ``(2B, T, H)`` (B chosen sequences, then B rejected); returns B."""
    if hidden.dim() != 3:
        raise ValueError(f"{name} must be (2 * batch, tokens, hidden) with the chosen sequences first and the "
                         f"rejected ones after, got shape {tuple(hidden.shape)}")
    if hidden.shape[0] == 0 or hidden.shape[0] % 2:
        raise ValueError(f"{name} must hold an even, non-zero number of sequences (B chosen, then B rejected), "
                         f"got {hidden.shape[0]}")
    return hidden.shape[0] // 2


def check_choice(value, name: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_beta(beta, name: str = "beta", *, positive: bool = True) -> None:
    check_number(beta, name)
    if positive and not 0.0 < beta < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {beta!r}")


def check_per_sequence(t, name: str, n: int, ref: Tensor, *, floating: bool = True) -> Tensor | None:
    """An optional per-sequence tensor ``(n,)`` on ``ref``'s device, as fp32 (or as it is)."""
    if t is None:
        return None
    check_tensor(t, name)
    if floating:
        check_float(t, name, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},) (one value per sequence), got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {ref.device}; move them to one device")
    return t.to(torch.float32) if floating else t


def policy_logps(hidden, weight, labels, bias, *, ignore_index, temperature=1.0, entropy=False,
                 chunk_tokens=None, accum_dtype=None) -> SequenceLogps:
    """The policy's per-token log-probabilities (differentiable) through the chunk driver, of a head
    already checked (:func:`check_common`, or :func:`reference_logps`'s checks) and cast."""
    per_token, ent = checked_logprobs(hidden, weight, labels, bias, ignore_index, temperature, entropy,
                                      chunk_tokens, check_accum_dtype(accum_dtype, weight.dtype), False,
                                      autocast_enabled(hidden.device.type))
    return SequenceLogps(per_token, labels, ignore_index, ent)


def policy_pair_logps(hidden, weight, labels, bias, extras, *, loss, loss_type, params, nll_weight, ignore_index,
                      chunk_tokens, accum_dtype) -> tuple[Tensor, SequenceLogps | SequenceSums]:
    """A paired loss: ``(loss, log-probabilities)`` with the fp32 scalar ``mean(per-pair loss) +
    nll_weight * chosen NLL``, the per-pair function the one registered as ``loss``
    (:func:`onca.ops._paired_head.register_pair_loss`, called with ``extras``, ``loss_type`` and
    ``params``). On pair-aligned chunks where they apply (:func:`onca.ops._paired_head.use_paired_chunks`:
    gradient in the forward pass, the sequences' detached sums returned); else on the chunk driver,
    autograd through the per-pair losses (per-token log-probabilities returned)."""
    params = [float(p) for p in params]
    # A small call takes the chunk driver's entry, whose torch route (small_head) it then takes,
    # unless the loss keeps its pair-aligned op at every size (asked first: it is the cheaper test).
    if ((loss in ALIGNED_WHEN_SMALL or not small_head(hidden, weight, labels, count=False))
            and use_paired_chunks(hidden, weight, bias, chunk_tokens)):
        value, sums = paired_loss(hidden, weight, bias, labels, extras, loss=loss, loss_type=loss_type,
                                  params=params, nll_weight=nll_weight, ignore_index=ignore_index,
                                  accum_fp32=check_accum_dtype(accum_dtype, weight.dtype))
        return value, SequenceSums(sums, labels, ignore_index)
    logps = policy_logps(hidden, weight, labels, bias, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                         accum_dtype=accum_dtype)
    extras = tuple(e.detach().to(torch.float32) for e in extras)
    losses = PAIR_LOSSES[loss](*split_pairs(logps.sums), lambda: split_pairs(logps.counts), extras, loss_type,
                               params, False)[0]
    value = losses.mean()
    if nll_weight:
        value = value + nll_weight * chosen_nll(logps)
    return value, logps


def reference_logps(ref_hidden, ref_weight, labels, ref_bias, *, ignore_index, temperature=1.0,
                    chunk_tokens=None, names=("ref_hidden", "ref_weight", "ref_bias")) -> SequenceLogps:
    """A frozen model's per-token log-probabilities, without gradient (forward pass only)."""
    check_tensor(ref_hidden, names[0])
    check_tensor(ref_weight, names[1])
    (rh, rw, rb), _ = head_inputs(ref_hidden, ref_weight, ref_bias)
    validate_head(rh, rw, labels, rb, hidden_name=names[0], weight_name=names[1], labels_name="labels",
                  bias_name=names[2])
    with torch.no_grad():
        return policy_logps(rh.detach(), rw.detach(), labels, rb.detach() if rb is not None else None,
                            ignore_index=ignore_index, temperature=temperature, chunk_tokens=chunk_tokens)


def split_pairs(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(chosen, rejected)`` halves of a ``(2B, ...)`` tensor."""
    n = t.shape[0] // 2
    return t[:n], t[n:]


def chosen_nll(logps: SequenceLogps) -> Tensor:
    """The chosen sequences' negative log-likelihood, averaged over their non-ignored tokens (0 when
    there are none): the cross-entropy term of ORPO, CPO and DPO's ``nll_weight``."""
    sums, _ = split_pairs(logps.sums)
    counts, _ = split_pairs(logps.counts)
    return -sums.sum() / counts.sum().clamp(min=1.0)


def check_common(hidden, weight, labels, bias, ignore_index, chunk_tokens, return_aux, *, temperature=1.0,
                 accum_dtype=None):
    """Options and the policy head shared by every post-training loss; returns ``(hidden, weight,
    bias)`` cast to the autocast dtype under ``torch.autocast`` (as ``F.linear`` would)."""
    check_tensor(hidden, "hidden")
    check_tensor(weight, "weight")
    check_options(ignore_index, temperature, chunk_tokens)
    check_bool(return_aux, "return_aux")
    (hidden, weight, bias), _ = head_inputs(hidden, weight, bias)
    validate_head(hidden, weight, labels, bias)
    check_accum_dtype(accum_dtype, weight.dtype)
    return hidden, weight, bias


def logsigmoid(x: Tensor) -> Tensor:
    return F.logsigmoid(x)
