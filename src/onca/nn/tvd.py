"""``onca.nn.TVDLoss``: the total variation distance loss (liger-kernel's ``LigerTVDLoss``)."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.jsd import check_ignore_index
from onca.ops.tvd import REDUCTIONS, tvd


class TVDLoss(nn.Module):
    """``0.5 * |p - q|`` between two probability distributions, reduced; see :mod:`onca.ops.tvd`.

    ``forward(p, q, shift_labels=None)``: ``p`` (which gets the gradient) and ``q`` are
    probabilities ``(..., vocab)``; tokens whose ``shift_labels`` equal ``ignore_index`` are left
    out. ``reduction`` defaults to ``"batchmean"`` (the sum over tokens not ignored), as
    ``LigerTVDLoss`` does. No parameters.
    """

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100):
        super().__init__()
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        check_ignore_index(ignore_index)
        self.reduction = reduction
        self.ignore_index = ignore_index

    def forward(self, p: torch.Tensor, q: torch.Tensor,
                shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        return tvd(p, q, shift_labels, self.reduction, self.ignore_index)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}"
