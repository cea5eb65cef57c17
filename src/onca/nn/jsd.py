"""``onca.nn.JSD``: the generalised Jensen-Shannon divergence loss (liger-kernel's ``LigerJSD``)."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.jsd import REDUCTIONS, check_beta, check_temperature, jsd


class JSD(nn.Module):
    """Generalised JSD between student and teacher distributions; see :mod:`onca.ops.jsd`.

    ``forward(input, target, labels=None)``: ``input`` is the student's log-probabilities, ``target``
    the teacher's, ``(..., vocab)``; ``labels`` (one per token) marks the tokens to leave out with
    ``ignore_index``. ``beta=0`` is KL(teacher || student), ``beta=1`` KL(student || teacher).
    ``temperature != 1`` (or ``from_logits=True``) compares ``softmax(input / T)`` with
    ``softmax(target / T)``, so logits may be passed.
    """

    def __init__(self, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 reduction: str = "mean", from_logits: bool = False):
        super().__init__()
        check_beta(beta)
        check_temperature(temperature)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.beta = float(beta)
        self.ignore_index = ignore_index
        self.temperature = float(temperature)
        self.reduction = reduction
        self.from_logits = from_logits

    def forward(self, input: torch.Tensor, target: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        return jsd(input, target, labels, self.beta, self.ignore_index, self.temperature, self.reduction,
                   self.from_logits)

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, ignore_index={self.ignore_index}, temperature={self.temperature}, "
                f"reduction={self.reduction!r}, from_logits={self.from_logits}")
