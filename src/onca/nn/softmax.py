"""``onca.nn.Softmax``: a drop-in for ``torch.nn.Softmax`` (liger-kernel's ``LigerSoftmax``)."""

from __future__ import annotations

import torch

from onca.ops.softmax import softmax


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax(dim)`` computed by Onca's kernel; ``dim`` defaults to the last dimension
    (``LigerSoftmax`` always uses it). No parameters."""

    def __init__(self, dim: int = -1):
        super().__init__(dim=dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return softmax(input, self.dim)
