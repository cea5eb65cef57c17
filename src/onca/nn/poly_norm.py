"""``onca.nn.PolyNorm``: a drop-in for PolyCom's ``PolyNorm`` activation (as in Motif's models)."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.poly_norm import poly_norm


class PolyNorm(nn.Module):
    """``weight[0] * norm(x**3) + weight[1] * norm(x**2) + weight[2] * norm(x) + bias`` over the
    last dimension, ``norm(u) = u / sqrt(mean(u**2) + eps)``.

    Parameters as PolyCom's reference module names and initialises them, so its state dicts load
    unchanged: ``weight`` ``(3,)`` of 1/3 and ``bias`` ``(1,)`` of zeros (liger-kernel's
    ``LigerPolyNorm`` starts its bias at 1). ``overwrite_grad_output`` is liger's ``in_place``.
    """

    def __init__(self, eps: float = 1e-6, overwrite_grad_output: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.overwrite_grad_output = overwrite_grad_output
        self.weight = nn.Parameter(torch.empty(3, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(1, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 / 3.0)
        nn.init.zeros_(self.bias)

    # liger-kernel and Hugging Face norms call it ``variance_epsilon``; keep both names working.
    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return poly_norm(x, self.weight, self.bias, self.eps, self.overwrite_grad_output)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, overwrite_grad_output={self.overwrite_grad_output}"
