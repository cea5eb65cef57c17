"""``onca.nn.KLDivLoss``: a drop-in for ``torch.nn.KLDivLoss``."""

from __future__ import annotations

import torch

from onca.ops.kl_div import REDUCTIONS, kl_div


class KLDivLoss(torch.nn.KLDivLoss):
    """``torch.nn.KLDivLoss(reduction, log_target)`` computed by Onca's kernel: ``input`` holds
    log-probabilities, ``target`` probabilities (log-probabilities with ``log_target=True``)."""

    def __init__(self, reduction: str = "mean", log_target: bool = False):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        super().__init__(reduction=reduction, log_target=log_target)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, self.reduction, self.log_target)
