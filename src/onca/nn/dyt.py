"""``onca.nn.DyT``: dynamic tanh, a drop-in for the DyT paper's ``DynamicTanh`` module."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.dyt import dyt


class DyT(nn.Module):
    """``weight * tanh(alpha * x) + bias`` over the last dimension (Zhu et al., 2025).

    Parameters as the paper's ``DynamicTanh`` names them, so its state dicts load unchanged:
    ``alpha`` (shape ``(1,)``, initialised to ``alpha_init_value``; ``alpha_per_channel=True``
    gives one per channel, ``(hidden_size,)``), ``weight`` (ones) and ``bias`` (zeros; absent
    with ``bias=False``). liger-kernel's ``LigerDyT`` calls the last two ``gamma`` and ``beta``
    and its initial alpha ``init_alpha``; the arithmetic is the same.
    """

    def __init__(self, hidden_size: int, alpha_init_value: float = 0.5, bias: bool = True,
                 alpha_per_channel: bool = False, device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.alpha_init_value = alpha_init_value
        self.alpha_per_channel = alpha_per_channel
        factory = dict(device=device, dtype=dtype)
        self.alpha = nn.Parameter(torch.empty(hidden_size if alpha_per_channel else 1, **factory))
        self.weight = nn.Parameter(torch.empty(hidden_size, **factory))
        self.bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha_init_value)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dyt(x, self.alpha, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, alpha_init_value={self.alpha_init_value}, bias={self.bias is not None}, "
                f"alpha_per_channel={self.alpha_per_channel}")
