"""``onca.nn.Sparsemax``: the sparsemax module (liger-kernel's ``LigerSparsemax``)."""

from __future__ import annotations

import torch

from onca.ops.sparsemax import sparsemax


class Sparsemax(torch.nn.Module):
    """Sparsemax over ``dim`` (default the last), computed by Onca's kernel; see
    :mod:`onca.ops.sparsemax`. No parameters."""

    def __init__(self, dim: int = -1):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
        self.dim = dim

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return sparsemax(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
